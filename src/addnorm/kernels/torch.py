"""The ``reference`` backend: :mod:`addnorm.reference`'s formulas as torch ops, on any device.

The fallback where no fused kernel runs (``backend="auto"`` on a device without one), the
backend ``addnorm.testing.check_backend`` holds the others to, and two all-rows-at-once forms of
the same formulas that autograd can differentiate: :func:`composite` (what ``torch.func``
transforms and forward-mode AD run) and :func:`differentiable_backward` (a second derivative).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import reference
from ..backend import Branch, Capabilities, Grads, check_s_parts

# Rows are processed in blocks of about BLOCK_ELEMENTS elements: the float32 temporaries of
# the formulas below then take a fixed ~0.5 MiB instead of several copies of the whole input,
# so forward + backward peak at torch eager's memory (s, y and ds) plus that fixed buffer.
# The block size depends only on N, so dweight/dbias are summed in the same order every run.
BLOCK_ELEMENTS = 1 << 14


def row_blocks(m: int, n: int) -> list[slice]:
    step = max(1, BLOCK_ELEMENTS // max(n, 1))
    return [slice(i, min(i + step, m)) for i in range(0, m, step)]


# Any device; post-norm saves ``s`` (a backward that recomputed the sum in torch ops would make
# one more pass over memory, so nothing is gained)
CAPABILITIES = Capabilities(device_types=None)


def unavailable_reason(x: Tensor | None) -> str | None:
    return None


def _rows(t: Tensor, n: int) -> Tensor:
    """``t`` as contiguous rows of ``n``: torch sums a row of a strided tensor (a transposed
    input, an expanded gradient) in another order than a contiguous one, and a row's bits must
    not depend on how the rest of the batch is laid out."""
    return t.reshape(-1, n).contiguous()


def forward(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    *,
    eps: float,
    rms: bool,
    residual_dtype: torch.dtype | None,
    write_stream: bool = True,
    write_stats: bool = True,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
    branch: Branch | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """Normalize each row of ``x`` (after adding ``residual`` if given, through ``branch``).

    Returns ``(y, s, mean, rstd)``: ``y`` in ``x.dtype``; ``s`` the residual stream
    ``x + residual`` (``None`` without a residual); ``mean`` (``None`` for RMSNorm) and
    ``rstd`` of shape ``(M,)`` in :func:`~addnorm.reference.stats_dtype`. (``write_stream``/``write_stats`` let a
    fused kernel skip writing what the caller will not use; here ``s`` is the norm's input and
    the statistics cost nothing extra, so they are returned anyway.) ``out``/``residual_out``
    receive ``y`` and ``s``.
    """
    s = reference.stream(x, residual, residual_dtype, branch)
    if residual_out is not None:
        s = residual_out.copy_(s)
    cd = reference.stats_dtype(s.dtype)
    n = s.shape[-1]
    s2 = _rows(s, n)
    m = s2.shape[0]
    y = out if out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(m, n)
    mean = None if rms else torch.empty(m, dtype=cd, device=x.device)
    rstd = torch.empty(m, dtype=cd, device=x.device)
    w = weight.to(cd) if weight is not None else None
    b = bias.to(cd) if bias is not None else None
    for rows in row_blocks(m, n):
        st = reference.forward_rows(s2[rows].to(cd), w, b, eps, rms)
        y2[rows], rstd[rows] = st["y"], st["rstd"]
        if mean is not None:
            mean[rows] = st["mean"]
    return y, (s if residual is not None else None), mean, rstd


def backward(
    dy: Tensor,
    dstream: Tensor | None,
    s_parts: tuple[Tensor, ...],
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    *,
    rms: bool,
    has_bias: bool,
    branch: Branch | None = None,
    param_dtype: torch.dtype | None = None,
) -> Grads:
    """Gradients of :func:`forward` from the saved ``s`` (``s_parts = (s,)``, or ``(x, residual)``
    from which ``s`` is recomputed), ``mean`` and ``rstd``.

    ``dy`` is the gradient of ``y``; ``dstream`` that of the returned stream ``s`` (pre-norm)
    or ``None``. Returns :class:`~addnorm.backend.Grads`: ``ds`` in the dtype of ``s`` (the
    gradient of ``residual``, and of ``x`` without a branch), ``dweight`` and ``dbias`` summed in
    the statistics dtype, returned in ``param_dtype`` when given (``None`` where there is no such
    parameter); with a ``branch``, ``dx`` and ``dlayer_scale`` by :func:`~addnorm.reference.branch_backward`.
    """
    check_s_parts(s_parts, branch)
    n = s_parts[0].shape[-1]
    s, *r = (_rows(part, n) for part in s_parts)
    dy = _rows(dy, n)
    dstream = _rows(dstream, n) if dstream is not None else None
    cd = rstd.dtype
    m = s.shape[0]
    sd = s_parts[-1].dtype  # the stream dtype (with a branch, residual's)
    ds = torch.empty((m, n), dtype=sd, device=s.device)
    dx = torch.empty((m, n), dtype=sd, device=s.device) if branch is not None else None
    zeros = lambda: torch.zeros(n, dtype=cd, device=s.device)  # noqa: E731
    dweight = zeros() if weight is not None else None
    dbias = zeros() if has_bias else None
    dlayer_scale = zeros() if branch is not None and branch.layer_scale is not None else None
    w = weight.to(cd) if weight is not None else None
    for rows in row_blocks(m, n):
        sf = (reference.stream(s[rows], r[0][rows], sd, branch, rows.start) if r else s[rows]).to(cd)
        st = reference.backward_rows(
            dy[rows].to(cd),
            dstream[rows].to(cd) if dstream is not None else None,
            sf,
            w,
            None if rms else mean[rows],
            rstd[rows],
            rms,
        )
        ds[rows] = st["ds"]
        if branch is not None:
            # from ds as stored (rounded to the stream dtype), as autograd would
            indices = torch.arange(rows.start, rows.stop, device=s.device)
            dx_rows, dls = reference.branch_backward(ds[rows].to(cd), s[rows].to(sd).to(cd), branch, indices)
            dx[rows] = dx_rows
            if dls is not None:
                dlayer_scale += dls
        if dweight is not None:
            dweight += st["dweight"]
        if dbias is not None:
            dbias += st["dbias"]
    shape = s_parts[0].shape
    if param_dtype is not None:
        dweight, dbias = (None if g is None else g.to(param_dtype) for g in (dweight, dbias))
    return Grads(ds.view(shape), dweight, dbias, None if dx is None else dx.view(shape), dlayer_scale)


def composite(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    residual_dtype: torch.dtype | None,
    branch: Branch | None = None,
) -> tuple[Tensor, Tensor]:
    """``(y, s)`` by :func:`~addnorm.reference.forward_rows` on all rows at once, as differentiable torch ops (no
    in-place writes): what runs under ``torch.func`` transforms and forward-mode AD, where
    torch's autograd differentiates these formulas (to any order)."""
    st = reference.forward_steps(x, residual, weight, bias, eps, rms, residual_dtype, branch)
    return st["y"].to(x.dtype), st["s"]


def differentiable_backward(
    dy: Tensor,
    dstream: Tensor | None,
    s_parts: tuple[Tensor, ...],
    weight: Tensor | None,
    eps: float,
    rms: bool,
    has_bias: bool,
    branch: Branch | None = None,
) -> Grads:
    """:func:`backward` on all rows at once as differentiable torch ops, for a second derivative
    (``create_graph=True``): the statistics are recomputed from ``s`` by the forward formulas, so
    that the gradient's dependence on ``s`` through ``mean`` and ``rstd`` is part of the graph.
    The formulas take rows: the tensors are viewed as ``(rows, N)``, the gradients returned in
    their shape."""
    shape, n = s_parts[0].shape, s_parts[0].shape[-1]
    s_parts = tuple(part.reshape(-1, n) for part in s_parts)
    dy, dstream = (None if t is None else t.reshape(-1, n) for t in (dy, dstream))
    s = s_parts[0] if len(s_parts) == 1 else reference.stream(*s_parts, s_parts[1].dtype, branch)
    st = reference.forward_steps(s, None, None, None, eps, rms, None)
    bt = reference.backward_steps(dy, dstream, s, weight, st["mean"], st["rstd"], rms=rms, has_bias=has_bias)
    ds = bt["ds"].to(s.dtype)
    if branch is None:
        return Grads(ds.view(shape), bt["dweight"], bt["dbias"])
    x, cd = s_parts[0], st["rstd"].dtype
    rows = torch.arange(x.shape[0], device=x.device)
    dx, dlayer_scale = reference.branch_backward(ds.to(cd), x.to(cd), branch, rows)
    return Grads(ds.view(shape), bt["dweight"], bt["dbias"], dx.to(s.dtype).view(shape), dlayer_scale)
