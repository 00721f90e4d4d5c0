r"""The math of every addnorm op, in plain torch: the one place to read the formulas.

This module is the documentation, the test oracle and the fallback backend at once.
Every kernel (``kernels/cpu.py``, ``kernels/triton/``) implements exactly the two
functions below, :func:`forward` and :func:`backward`, with the same arguments and
results, on rows of a 2-D ``(M, N)`` view: ``M`` rows, each normalized over its ``N``
features (the product of ``normalized_shape``).

Forward (one row ``s`` of ``N`` features, optional residual add first)::

    s     = x + residual                 (in residual_dtype, else torch's type promotion)
    mu    = mean(s)                      (LayerNorm only; RMSNorm has mu = 0), then
                                         corrected by mean(s - mu): exact for constant rows
    var   = mean((s - mu)^2)             biased, two passes: never E[s^2] - E[s]^2
    rstd  = 1 / sqrt(var + eps)          eps inside the square root, as torch; computed on
                                         s * 2**-e for rows beyond 1, so no overflow
    xhat  = (s - mu) * rstd
    y     = weight * xhat + bias

Statistics (``mean``, ``rstd``) and all arithmetic are float32 for float16/bfloat16/float32
inputs and float64 for float64 inputs; ``y`` is written in the dtype of ``x``.

Backward, derived by hand. Write ``g = dy * weight`` (``g = dy`` without a weight). With
``xhat_j = (s_j - mu) * rstd`` the chain rule through ``mu`` and ``rstd`` gives, for
LayerNorm::

    d xhat_j / d s_i = rstd * (delta_ij - 1/N - xhat_i * xhat_j / N)
    ds_i = sum_j g_j * d xhat_j / d s_i
         = rstd * (g_i - mean(g) - xhat_i * mean(g * xhat))

For RMSNorm ``mu = 0`` and the ``-1/N`` term vanishes::

    ds_i = rstd * (g_i - xhat_i * mean(g * xhat))

The parameter gradients sum over rows: ``dweight = sum_rows dy * xhat`` and
``dbias = sum_rows dy``. For Add & Norm, ``s`` feeds both the norm and (in pre-norm)
the next residual stream, so its gradient is the norm's ``ds`` plus the stream's own
gradient ``d(stream)``; ``x`` and ``residual`` both receive that sum, because
``ds/dx = ds/dresidual = 1``.

Only ``s`` (or ``x``), ``mean`` and ``rstd`` are needed for backward: ``xhat`` is
recomputed from them, which costs one multiply per element and saves a full tensor. The saved
``mean`` is rounded to the statistics dtype, which cannot hold the forward's corrected mean of
a row far from zero (at an offset of 1e6 a float32 ulp is 0.0625, as large as the spread of
the row may be), so the backward re-centres exactly as the forward::

    d     = s - mean                     (mean as saved)
    xhat  = (d - mean(d)) * rstd         (mean(d) is below one ulp of mean; 0 if it was exact)

Without it ``xhat`` would be shifted by ``(mean - mean(s)) * rstd``, and every gradient
with it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .backend import Branch, Capabilities, Grads, check_s_parts


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the statistics and of all arithmetic: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def stream_dtype(x: Tensor, residual: Tensor | None, residual_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of ``s = x + residual``: ``residual_dtype`` if given, else torch's promotion."""
    if residual is None:
        return x.dtype
    if residual_dtype is not None:
        return residual_dtype
    return torch.promote_types(x.dtype, residual.dtype)


def stream(
    x: Tensor,
    residual: Tensor | None,
    residual_dtype: torch.dtype | None,
    branch: Branch | None = None,
    first_row: int = 0,
) -> Tensor:
    """``s = x + residual`` in :func:`stream_dtype` (``x`` itself without a residual); with a
    ``branch``, ``s = residual + branch_term(x)`` summed in the statistics dtype, then rounded
    (``first_row``: the index of ``x``'s first row in the call, for the dropout mask)."""
    if residual is None:
        return x
    sd = stream_dtype(x, residual, residual_dtype)
    if branch is None:
        return x.to(sd) + residual.to(sd)
    cd = stats_dtype(sd)  # x is rounded to the stream dtype first, as without a branch
    rows = torch.arange(first_row, first_row + x.numel() // max(x.shape[-1], 1), device=x.device)
    return (residual.to(cd) + branch_terms(x.to(sd).to(cd), branch, rows.view(x.shape[:-1]))["t"]).to(sd)


# --------------------------------------------------------------------------- the sublayer branch

# Dropout's keep mask is a counter-based hash of (seed, row, column), the row counted in the
# call's 2-D view of rows: no generator state, no saved mask, and the same bits on every backend
# and device, so a GPU run replays on a CPU. Every backend implements these lines bit for bit
# with 32-bit unsigned arithmetic (here int64 tensors hold the 32-bit values).
_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: keeps the column keys apart from the row keys
_FMIX = (0x85EBCA6B, 0xC2B2AE35)


def _mul32(h: Tensor, c: int) -> Tensor:
    """``h * c mod 2**32`` for 32-bit values ``h``: in 16-bit halves of ``c``, no int64 overflow."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's finalizer: a bijection of 32-bit values in which every input bit flips
    every output bit with probability about 1/2."""
    h = h ^ (h >> 16)
    h = _mul32(h, _FMIX[0])
    h = h ^ (h >> 13)
    h = _mul32(h, _FMIX[1])
    return h ^ (h >> 16)


def mask_hash(seed: Tensor, rows: Tensor, n: int) -> Tensor:
    """The 32-bit hash of every ``(row, column)``, shape ``rows.shape + (n,)``: a key per row
    and per column from the two halves ``k0``, ``k1`` of the 64-bit ``seed``, mixed again::

        a_row = fmix32(fmix32(row ^ k0) + k1)
        b_col = fmix32(fmix32(col ^ k1) + (k0 ^ 0x9E3779B9))
        h     = fmix32(a_row + b_col)                    (all sums mod 2**32)
    """
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    a = fmix32((fmix32(rows ^ k0) + k1) & _M32)
    cols = torch.arange(n, device=rows.device)
    b = fmix32((fmix32(cols ^ k1) + (k0 ^ _GOLDEN)) & _M32)
    return fmix32((a[..., None] + b) & _M32)


def keep_threshold(p: float) -> int:
    """An element is kept when its hash is at least this: ``floor(p * 2**32)`` (``2**32`` at
    ``p = 1``: nothing kept), so it is kept with probability ``1 - p`` to within ``2**-32``."""
    return math.floor(p * 2**32)


def dropout_scale(p: float) -> float:
    """Inverted dropout's scale of the kept elements, ``1 / (1 - p)`` (0 at ``p = 1``)."""
    return 1.0 / (1.0 - p) if p < 1 else 0.0


def keep_mask(seed: Tensor, rows: Tensor, n: int, p: float) -> Tensor:
    """The dropout keep mask (bool) of ``rows`` (their indices in the call's rows), ``n`` columns."""
    return mask_hash(seed, rows, n) >= keep_threshold(p)


def branch_terms(x: Tensor, branch: Branch, rows: Tensor) -> dict[str, Tensor | None]:
    """``t = rowscale * layer_scale * dropout(x)`` for ``x`` in the statistics dtype, whose rows
    have the indices ``rows``, in this order of operations (every backend keeps it)::

        gate   = keep ? 1 / (1 - p) : 0              (1 when p = 0)
        factor = gate * layer_scale                  (per element; the layer scale when given)
        t      = x * factor * rowscale               (the row's factor when given)

    As torch's dropout, a dropped element is multiplied by 0, so a NaN or inf in ``x`` still
    shows as NaN. Returns ``keep`` (None when ``p = 0``), ``gate`` and ``t``."""
    keep = None
    factor = gate = torch.ones((), dtype=x.dtype, device=x.device)
    if branch.p > 0:
        keep = keep_mask(branch.seed, rows, x.shape[-1], branch.p)
        gate = torch.where(keep, torch.tensor(dropout_scale(branch.p), dtype=x.dtype, device=x.device), 0)
        factor = gate
    if branch.layer_scale is not None:
        factor = factor * branch.layer_scale.to(x.dtype)
    t = x * factor if branch.p > 0 or branch.layer_scale is not None else x
    if branch.rowscale is not None:
        t = t * branch.rowscale.to(x.dtype)[rows][..., None]
    return {"keep": keep, "gate": gate, "t": t}


def branch_backward(ds: Tensor, x: Tensor, branch: Branch, rows: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(dx, dlayer_scale)`` from ``ds`` (the gradient of ``s``) for the rows ``rows``, all in the
    statistics dtype: ``dx = ds * factor * rowscale`` (the forward's factors, in its order) and
    ``dlayer_scale = sum_rows ds * (x * gate * rowscale)``."""
    dlayer_scale = None
    if branch.layer_scale is not None:
        dropped = branch_terms(x, branch._replace(layer_scale=None), rows)["t"]
        dlayer_scale = (ds * dropped).reshape(-1, ds.shape[-1]).sum(dim=0)
    return branch_terms(ds, branch, rows)["t"], dlayer_scale


# Rows are processed in blocks of about BLOCK_ELEMENTS elements: the float32 temporaries of
# the formulas below then take a fixed ~0.5 MiB instead of several copies of the whole input,
# so forward + backward peak at torch eager's memory (s, y and ds) plus that fixed buffer.
# The block size depends only on N, so dweight/dbias are summed in the same order every run.
BLOCK_ELEMENTS = 1 << 14


def row_blocks(m: int, n: int) -> list[slice]:
    step = max(1, BLOCK_ELEMENTS // max(n, 1))
    return [slice(i, min(i + step, m)) for i in range(0, m, step)]


def row_scale(sf: Tensor) -> Tensor:
    """Per row, a power of two ``k <= 1`` with ``max|s * k| < 1``, shape ``(rows, 1)``.

    The statistics are computed on ``s * k``, which cannot overflow: bfloat16 shares
    float32's range, so rows beyond ~1e19 would overflow ``s**2`` and rows near the
    maximum even the sum. Scaling by a power of two is exact, so rows within ``(-1, 1)``
    are untouched and others get bit-for-bit the statistics they would have unscaled.
    ``k`` stays a normal number (rows in the top two binades then get ``max|s * k| < 4``),
    so it survives flush-to-zero modes.
    """
    _, exponent = torch.frexp(sf.abs().amax(dim=-1, keepdim=True))
    top = 1022 if sf.dtype == torch.float64 else 126  # the largest e with 2**-e normal
    return torch.ldexp(torch.ones_like(exponent, dtype=sf.dtype), -exponent.clamp(min=0, max=top))


# torch reduces a single row of at least 32768 elements (its grain) in per-thread pieces, and
# rows of several-row calls whole: the bits would depend on the batch and the thread count. Wide
# rows are therefore summed in fixed chunks of this many elements, then the chunk sums.
ROW_CHUNK = 1 << 14


# The kernels compute the variance about the corrected mean as mean(d*d) - c*c, two passes
# where the reference takes three; a row where c*c exceeds mean(d*d) / CANCEL (a near-constant
# row far from zero) would lose bits to that difference, and gets the third pass there too.
CANCEL = 16


def row_mean(t: Tensor) -> Tensor:
    """The mean of each row of ``t`` (keepdim), summed in the same order whatever the number of
    rows, their position or the thread count (see ROW_CHUNK)."""
    n = t.shape[-1]
    if n < 2 * ROW_CHUNK:
        return t.sum(dim=-1, keepdim=True) / n
    chunks = -(-n // ROW_CHUNK)
    padded = torch.nn.functional.pad(t, (0, chunks * ROW_CHUNK - n))  # zeros: exact
    return padded.unflatten(-1, (chunks, ROW_CHUNK)).sum(dim=-1).sum(dim=-1, keepdim=True) / n


def forward_rows(sf: Tensor, w: Tensor | None, b: Tensor | None, eps: float, rms: bool) -> dict[str, Tensor | None]:
    """The forward formulas on rows ``sf`` already in the statistics dtype, every step kept.

    Returns ``mean`` (``None`` for RMSNorm), the biased ``var`` (for RMSNorm the mean
    square), ``rstd``, ``xhat`` and ``y``, all in the dtype of ``sf``.
    """
    k = row_scale(sf)
    sk = sf * k
    if rms:
        mean = None
        centered = sk
    else:
        # The first mean is off by its rounding error (about ulp(mean) for rows far from
        # zero, and nonzero even for a constant row); the mean of the centered row measures
        # that error and removes it, so the centered values come out exact to rounding.
        mean = row_mean(sk)
        centered = sk - mean
        correction = row_mean(centered)
        centered = centered - correction
        mean = ((mean + correction) / k)[:, 0]
    var_k = row_mean(centered * centered)  # the variance of s, times k**2
    rstd_k = torch.rsqrt(var_k + eps * k * k)  # = rstd / k
    xhat = centered * rstd_k
    y = xhat
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return {"mean": mean, "var": (var_k / (k * k))[:, 0], "rstd": (rstd_k * k)[:, 0], "xhat": xhat, "y": y}


def backward_rows(
    dyf: Tensor, dstreamf: Tensor | None, sf: Tensor, w: Tensor | None, mean: Tensor | None, rstd: Tensor, rms: bool
) -> dict[str, Tensor | None]:
    """The backward formulas on rows already in the statistics dtype, every step kept (``mean``
    is not read for RMSNorm).

    Returns ``xhat``, ``g = dy * weight``, the per-row ``mean_g`` (``None`` for RMSNorm) and
    ``mean_gxhat``, ``ds``, and this block's partial sums ``dweight`` and ``dbias``.
    """
    k = row_scale(sf)  # as in the forward: (s - mean) * rstd may not overflow on the way
    centered = sf * k
    if not rms:
        # the saved mean is rounded (see the module docstring): re-centre as the forward does
        centered = centered - mean[:, None] * k
        centered = centered - row_mean(centered)
    xhat = centered * (rstd[:, None] / k)
    g = dyf * w if w is not None else dyf
    mean_gxhat = row_mean(g * xhat)[:, 0]
    inner = g - xhat * mean_gxhat[:, None]
    mean_g = None
    if not rms:
        mean_g = row_mean(g)[:, 0]
        inner = inner - mean_g[:, None]
    ds = inner * rstd[:, None]
    if dstreamf is not None:
        ds = ds + dstreamf
    return {
        "xhat": xhat,
        "g": g,
        "mean_g": mean_g,
        "mean_gxhat": mean_gxhat,
        "ds": ds,
        "dweight": (dyf * xhat).sum(dim=0),
        "dbias": dyf.sum(dim=0),
    }


def forward_steps(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    residual_dtype: torch.dtype | None,
    branch: Branch | None = None,
) -> dict[str, Tensor | None]:
    """:func:`forward` on all rows at once, keeping every step (``s`` too), for ``addnorm explain``."""
    s = stream(x, residual, residual_dtype, branch)
    cd = stats_dtype(s.dtype)
    st = forward_rows(s.to(cd), *(None if t is None else t.to(cd) for t in (weight, bias)), eps, rms)
    return dict(st, s=s)


def backward_steps(
    dy: Tensor,
    dstream: Tensor | None,
    s: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    *,
    rms: bool,
    has_bias: bool,
) -> dict[str, Tensor | None]:
    """:func:`backward` on all rows at once, keeping every step, for ``addnorm explain``."""
    cd = rstd.dtype
    st = backward_rows(
        dy.to(cd),
        None if dstream is None else dstream.to(cd),
        s.to(cd),
        None if weight is None else weight.to(cd),
        mean,
        rstd,
        rms,
    )
    return dict(st, dweight=st["dweight"] if weight is not None else None, dbias=st["dbias"] if has_bias else None)


# The reference as a backend (addnorm.backend): any device, and post-norm saves ``s`` (its backward
# would recompute the sum in torch ops, one more pass over memory, so nothing is gained)
CAPABILITIES = Capabilities(device_types=None)


def unavailable_reason(x: Tensor | None) -> str | None:
    return None


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
    ``rstd`` of shape ``(M,)`` in :func:`stats_dtype`. (``write_stream``/``write_stats`` let a
    fused kernel skip writing what the caller will not use; here ``s`` is the norm's input and
    the statistics cost nothing extra, so they are returned anyway.) ``out``/``residual_out``
    receive ``y`` and ``s``.
    """
    s = stream(x, residual, residual_dtype, branch)
    if residual_out is not None:
        s = residual_out.copy_(s)
    cd = stats_dtype(s.dtype)
    n = s.shape[-1]
    s2 = s.reshape(-1, n)
    m = s2.shape[0]
    y = out if out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(m, n)
    mean = None if rms else torch.empty(m, dtype=cd, device=x.device)
    rstd = torch.empty(m, dtype=cd, device=x.device)
    w = weight.to(cd) if weight is not None else None
    b = bias.to(cd) if bias is not None else None
    for rows in row_blocks(m, n):
        st = forward_rows(s2[rows].to(cd), w, b, eps, rms)
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
    parameter); with a ``branch``, ``dx`` and ``dlayer_scale`` by :func:`branch_backward`.
    """
    check_s_parts(s_parts, branch)
    n = s_parts[0].shape[-1]
    s, *r = (part.reshape(-1, n) for part in s_parts)
    dy = dy.reshape(-1, n)
    dstream = dstream.reshape(-1, n) if dstream is not None else None
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
        sf = (stream(s[rows], r[0][rows], sd, branch, rows.start) if r else s[rows]).to(cd)
        st = backward_rows(
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
            dx_rows, dls = branch_backward(ds[rows].to(cd), s[rows].to(sd).to(cd), branch, indices)
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
    """``(y, s)`` by :func:`forward_rows` on all rows at once, as differentiable torch ops (no
    in-place writes): what runs under ``torch.func`` transforms and forward-mode AD, where
    torch's autograd differentiates these formulas (to any order)."""
    st = forward_steps(x, residual, weight, bias, eps, rms, residual_dtype, branch)
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
    that the gradient's dependence on ``s`` through ``mean`` and ``rstd`` is part of the graph."""
    s = s_parts[0] if len(s_parts) == 1 else stream(*s_parts, s_parts[1].dtype, branch)
    st = forward_steps(s, None, None, None, eps, rms, None)
    bt = backward_steps(dy, dstream, s, weight, st["mean"], st["rstd"], rms=rms, has_bias=has_bias)
    ds = bt["ds"].to(s.dtype)
    if branch is None:
        return Grads(ds, bt["dweight"], bt["dbias"])
    x = s_parts[0]
    rows = torch.arange(x.numel() // x.shape[-1], device=x.device).view(x.shape[:-1])
    dx, dlayer_scale = branch_backward(ds.to(st["rstd"].dtype), x.to(st["rstd"].dtype), branch, rows)
    return Grads(ds, bt["dweight"], bt["dbias"], dx.to(s.dtype), dlayer_scale)
