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
        mean = sk.mean(dim=-1, keepdim=True)
        centered = sk - mean
        correction = centered.mean(dim=-1, keepdim=True)
        centered = centered - correction
        mean = ((mean + correction) / k)[:, 0]
    var_k = (centered * centered).mean(dim=-1, keepdim=True)  # the variance of s, times k**2
    rstd_k = torch.rsqrt(var_k + eps * k * k)  # = rstd / k
    xhat = centered * rstd_k
    y = xhat
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return {"mean": mean, "var": (var_k / (k * k))[:, 0], "rstd": (rstd_k * k)[:, 0], "xhat": xhat, "y": y}


def backward_rows(dyf: Tensor, dstreamf: Tensor | None, sf: Tensor, w: Tensor | None,
                  mean: Tensor | None, rstd: Tensor) -> dict[str, Tensor | None]:
    """The backward formulas on rows already in the statistics dtype, every step kept.

    Returns ``xhat``, ``g = dy * weight``, the per-row ``mean_g`` (``None`` for RMSNorm) and
    ``mean_gxhat``, ``ds``, and this block's partial sums ``dweight`` and ``dbias``.
    """
    k = row_scale(sf)  # as in the forward: (s - mean) * rstd may not overflow on the way
    xhat = (sf * k if mean is None else sf * k - mean[:, None] * k) * (rstd[:, None] / k)
    g = dyf * w if w is not None else dyf
    n = sf.shape[-1]
    mean_gxhat = (g * xhat).sum(dim=-1) / n
    inner = g - xhat * mean_gxhat[:, None]
    mean_g = None
    if mean is not None:
        mean_g = g.sum(dim=-1) / n
        inner = inner - mean_g[:, None]
    ds = inner * rstd[:, None]
    if dstreamf is not None:
        ds = ds + dstreamf
    return {"xhat": xhat, "g": g, "mean_g": mean_g, "mean_gxhat": mean_gxhat, "ds": ds,
            "dweight": (dyf * xhat).sum(dim=0), "dbias": dyf.sum(dim=0)}


def forward_steps(x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None,
                  eps: float, rms: bool, residual_dtype: torch.dtype | None) -> dict[str, Tensor | None]:
    """:func:`forward` on all rows at once, keeping every step (``s`` too), for ``addnorm explain``."""
    s = stream(x, residual, residual_dtype)
    cd = stats_dtype(s.dtype)
    st = forward_rows(s.to(cd), *(None if t is None else t.to(cd) for t in (weight, bias)), eps, rms)
    return dict(st, s=s)


def backward_steps(dy: Tensor, dstream: Tensor | None, s: Tensor, weight: Tensor | None,
                   mean: Tensor | None, rstd: Tensor, has_bias: bool) -> dict[str, Tensor | None]:
    """:func:`backward` on all rows at once, keeping every step, for ``addnorm explain``."""
    cd = rstd.dtype
    st = backward_rows(dy.to(cd), None if dstream is None else dstream.to(cd), s.to(cd),
                       None if weight is None else weight.to(cd), mean, rstd)
    return dict(st, dweight=st["dweight"] if weight is not None else None,
                dbias=st["dbias"] if has_bias else None)


def forward(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    residual_dtype: torch.dtype | None,
    *,
    need_stream: bool = True,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """Normalize each row of the 2-D ``x`` (after adding ``residual`` if given).

    Returns ``(y, s, mean, rstd)``: ``y`` in ``x.dtype``; ``s`` the residual stream
    ``x + residual`` (``None`` without a residual); ``mean`` (``None`` for RMSNorm) and
    ``rstd`` of shape ``(M,)`` in :func:`stats_dtype`. ``need_stream=False`` says the caller will
    not use ``s`` (inference post-norm): a fused kernel may then skip writing it and return
    ``None`` (here ``s`` is the input of the norm, so it is returned anyway).
    """
    s = stream(x, residual, residual_dtype)
    cd = stats_dtype(s.dtype)
    m, n = s.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    mean = None if rms else torch.empty(m, dtype=cd, device=x.device)
    rstd = torch.empty(m, dtype=cd, device=x.device)
    w = weight.to(cd) if weight is not None else None
    b = bias.to(cd) if bias is not None else None
    for rows in row_blocks(m, n):
        st = forward_rows(s[rows].to(cd), w, b, eps, rms)
        y[rows], rstd[rows] = st["y"], st["rstd"]
        if mean is not None:
            mean[rows] = st["mean"]
    return y, (s if residual is not None else None), mean, rstd


def check_recompute_dtypes(x: Tensor, residual: Tensor) -> None:
    """The stream can be recomputed in backward from ``x`` and ``residual`` (instead of being
    saved) only when both already have the stream's dtype: then ``x + residual`` is exactly the
    forward's ``s``."""
    if residual.dtype != x.dtype or residual.shape != x.shape:
        raise ValueError(f"residual= in backward needs x's shape and dtype {tuple(x.shape)} {x.dtype}, "
                         f"got {tuple(residual.shape)} {residual.dtype}")


def backward(
    dy: Tensor,
    dstream: Tensor | None,
    s: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    has_bias: bool,
    *,
    residual: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Gradients of :func:`forward` from the saved ``s`` (or ``x``), ``mean`` and ``rstd``.

    ``dy`` is the gradient of ``y``; ``dstream`` that of the returned stream ``s`` (pre-norm)
    or ``None``. RMSNorm is selected by ``mean is None``. Returns ``(ds, dweight, dbias)``:
    ``ds`` in ``s.dtype`` (it is the gradient of both ``x`` and ``residual``), ``dweight``
    and ``dbias`` in the statistics dtype (``None`` where there is no such parameter).

    ``residual``: when given, ``s`` is ``x`` and the stream is recomputed as ``x + residual``
    (both in the stream dtype: bit for bit the forward's ``s``), so that the forward need not
    write ``s`` at all (post-norm, where ``s`` is not an output).
    """
    if residual is not None:
        check_recompute_dtypes(s, residual)
    cd = rstd.dtype
    m, n = s.shape
    ds = torch.empty((m, n), dtype=s.dtype, device=s.device)
    dweight = torch.zeros(n, dtype=cd, device=s.device) if weight is not None else None
    dbias = torch.zeros(n, dtype=cd, device=s.device) if has_bias else None
    w = weight.to(cd) if weight is not None else None
    for rows in row_blocks(m, n):
        st = backward_rows(
            dy[rows].to(cd),
            dstream[rows].to(cd) if dstream is not None else None,
            (s[rows] if residual is None else s[rows] + residual[rows]).to(cd),
            w,
            mean[rows] if mean is not None else None,
            rstd[rows],
        )
        ds[rows] = st["ds"]
        if dweight is not None:
            dweight += st["dweight"]
        if dbias is not None:
            dbias += st["dbias"]
    return ds, dweight, dbias
