r"""The math of every addnorm op, in plain torch: the one place to read the formulas.

This module is the documentation, the test oracle and the fallback backend at once.
Every kernel (``kernels/cpu.py``, ``kernels/triton.py``) implements exactly the two
functions below, :func:`forward` and :func:`backward`, with the same arguments and
results, on rows of a 2-D ``(M, N)`` view: ``M`` rows, each normalized over its ``N``
features (the product of ``normalized_shape``).

Forward (one row ``s`` of ``N`` features, optional residual add first)::

    s     = x + residual                 (in residual_dtype, else torch's type promotion)
    mu    = mean(s)                      (LayerNorm only; RMSNorm has mu = 0)
    var   = mean((s - mu)^2)             biased, two passes: never E[s^2] - E[s]^2
    rstd  = 1 / sqrt(var + eps)          eps inside the square root, as torch
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


def forward_steps(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    residual_dtype: torch.dtype | None,
) -> dict[str, Tensor | None]:
    """:func:`forward`, keeping every intermediate (for ``addnorm explain``).

    Returns ``s`` (the stream, or ``x`` itself without a residual), ``mean`` (``None`` for
    RMSNorm), the biased ``var`` (for RMSNorm the mean square), ``rstd``, ``xhat`` and ``y``;
    all but ``s`` in :func:`stats_dtype`.
    """
    if residual is not None:
        sd = stream_dtype(x, residual, residual_dtype)
        s = x.to(sd) + residual.to(sd)
    else:
        s = x
    cd = stats_dtype(s.dtype)
    sf = s.to(cd)
    if rms:
        mean = None
        centered = sf
    else:
        mean = sf.mean(dim=-1)
        centered = sf - mean[:, None]
    var = (centered * centered).mean(dim=-1)
    rstd = torch.rsqrt(var + eps)
    xhat = centered * rstd[:, None]
    y = xhat
    if weight is not None:
        y = y * weight.to(cd)
    if bias is not None:
        y = y + bias.to(cd)
    return {"s": s, "mean": mean, "var": var, "rstd": rstd, "xhat": xhat, "y": y}


def forward(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    residual_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """Normalize each row of the 2-D ``x`` (after adding ``residual`` if given).

    Returns ``(y, s, mean, rstd)``: ``y`` in ``x.dtype``; ``s`` the residual stream
    ``x + residual`` (``None`` without a residual); ``mean`` (``None`` for RMSNorm) and
    ``rstd`` of shape ``(M,)`` in :func:`stats_dtype`.
    """
    st = forward_steps(x, residual, weight, bias, eps, rms, residual_dtype)
    return st["y"].to(x.dtype), (st["s"] if residual is not None else None), st["mean"], st["rstd"]


def backward_steps(
    dy: Tensor,
    dstream: Tensor | None,
    s: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    has_bias: bool,
) -> dict[str, Tensor | None]:
    """:func:`backward`, keeping every intermediate (for ``addnorm explain``).

    Returns ``xhat``, ``g = dy * weight``, the per-row ``mean_g`` (``None`` for RMSNorm) and
    ``mean_gxhat``, and ``ds``, ``dweight``, ``dbias``; all in the statistics dtype.
    """
    cd = rstd.dtype
    sf = s.to(cd)
    xhat = (sf if mean is None else sf - mean[:, None]) * rstd[:, None]
    dyf = dy.to(cd)
    g = dyf * weight.to(cd) if weight is not None else dyf
    n = s.shape[-1]
    mean_gxhat = (g * xhat).sum(dim=-1) / n
    inner = g - xhat * mean_gxhat[:, None]
    mean_g = None
    if mean is not None:
        mean_g = g.sum(dim=-1) / n
        inner = inner - mean_g[:, None]
    ds = inner * rstd[:, None]
    if dstream is not None:
        ds = ds + dstream.to(cd)
    dweight = (dyf * xhat).sum(dim=0) if weight is not None else None
    dbias = dyf.sum(dim=0) if has_bias else None
    return {"xhat": xhat, "g": g, "mean_g": mean_g, "mean_gxhat": mean_gxhat, "ds": ds,
            "dweight": dweight, "dbias": dbias}


def backward(
    dy: Tensor,
    dstream: Tensor | None,
    s: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    has_bias: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Gradients of :func:`forward` from the saved ``s`` (or ``x``), ``mean`` and ``rstd``.

    ``dy`` is the gradient of ``y``; ``dstream`` that of the returned stream ``s`` (pre-norm)
    or ``None``. RMSNorm is selected by ``mean is None``. Returns ``(ds, dweight, dbias)``:
    ``ds`` in ``s.dtype`` (it is the gradient of both ``x`` and ``residual``), ``dweight``
    and ``dbias`` in the statistics dtype (``None`` where there is no such parameter).
    """
    st = backward_steps(dy, dstream, s, weight, mean, rstd, has_bias)
    return st["ds"].to(s.dtype), st["dweight"], st["dbias"]
