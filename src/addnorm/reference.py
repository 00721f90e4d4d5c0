r"""The math of every addnorm op, in plain torch: the one place to read the formulas.

This module is the documentation, the test oracle and the fallback backend at once.
Every kernel (``kernels/cpu.py``, ``kernels/triton.py``) implements exactly the two
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
recomputed from them, which costs one multiply per element and saves a full tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .backend import Capabilities, check_s_parts


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


def stream(x: Tensor, residual: Tensor | None, residual_dtype: torch.dtype | None) -> Tensor:
    """``s = x + residual`` in :func:`stream_dtype` (``x`` itself without a residual)."""
    if residual is None:
        return x
    sd = stream_dtype(x, residual, residual_dtype)
    return x.to(sd) + residual.to(sd)


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
    xhat = (sf * k if rms else sf * k - mean[:, None] * k) * (rstd[:, None] / k)
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
) -> dict[str, Tensor | None]:
    """:func:`forward` on all rows at once, keeping every step (``s`` too), for ``addnorm explain``."""
    s = stream(x, residual, residual_dtype)
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
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """Normalize each row of the 2-D ``x`` (after adding ``residual`` if given).

    Returns ``(y, s, mean, rstd)``: ``y`` in ``x.dtype``; ``s`` the residual stream
    ``x + residual`` (``None`` without a residual); ``mean`` (``None`` for RMSNorm) and
    ``rstd`` of shape ``(M,)`` in :func:`stats_dtype`. (``write_stream``/``write_stats`` let a
    fused kernel skip writing what the caller will not use; here ``s`` is the norm's input and
    the statistics cost nothing extra, so they are returned anyway.) ``out``/``residual_out``
    receive ``y`` and ``s``.
    """
    s = stream(x, residual, residual_dtype)
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
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Gradients of :func:`forward` from the saved ``s`` (``s_parts = (s,)``, or ``(x, residual)``
    whose sum is ``s``), ``mean`` and ``rstd``.

    ``dy`` is the gradient of ``y``; ``dstream`` that of the returned stream ``s`` (pre-norm)
    or ``None``. Returns ``(ds, dweight, dbias)``: ``ds`` in the dtype of ``s`` (it is the
    gradient of both ``x`` and ``residual``), ``dweight`` and ``dbias`` in the statistics dtype
    (``None`` where there is no such parameter).
    """
    check_s_parts(s_parts)
    n = s_parts[0].shape[-1]
    s, *r = (part.reshape(-1, n) for part in s_parts)
    dy = dy.reshape(-1, n)
    dstream = dstream.reshape(-1, n) if dstream is not None else None
    cd = rstd.dtype
    m = s.shape[0]
    ds = torch.empty((m, n), dtype=s.dtype, device=s.device)
    dweight = torch.zeros(n, dtype=cd, device=s.device) if weight is not None else None
    dbias = torch.zeros(n, dtype=cd, device=s.device) if has_bias else None
    w = weight.to(cd) if weight is not None else None
    for rows in row_blocks(m, n):
        st = backward_rows(
            dy[rows].to(cd),
            dstream[rows].to(cd) if dstream is not None else None,
            (s[rows] + r[0][rows] if r else s[rows]).to(cd),
            w,
            None if rms else mean[rows],
            rstd[rows],
            rms,
        )
        ds[rows] = st["ds"]
        if dweight is not None:
            dweight += st["dweight"]
        if dbias is not None:
            dbias += st["dbias"]
    return ds.view(s_parts[0].shape), dweight, dbias


def composite(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    residual_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor]:
    """``(y, s)`` by :func:`forward_rows` on all rows at once, as differentiable torch ops (no
    in-place writes): what runs under ``torch.func`` transforms and forward-mode AD, where
    torch's autograd differentiates these formulas (to any order)."""
    st = forward_steps(x, residual, weight, bias, eps, rms, residual_dtype)
    return st["y"].to(x.dtype), st["s"]


def differentiable_backward(
    dy: Tensor, dstream: Tensor | None, s: Tensor, weight: Tensor | None, eps: float, rms: bool, has_bias: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """:func:`backward` on all rows at once as differentiable torch ops, for a second derivative
    (``create_graph=True``): the statistics are recomputed from ``s`` by the forward formulas, so
    that the gradient's dependence on ``s`` through ``mean`` and ``rstd`` is part of the graph."""
    st = forward_steps(s, None, None, None, eps, rms, None)
    bt = backward_steps(dy, dstream, s, weight, st["mean"], st["rstd"], rms=rms, has_bias=has_bias)
    return bt["ds"].to(s.dtype), bt["dweight"], bt["dbias"]
