r"""The math of every addnorm op, in plain torch: the one place to read the formulas.

This module is the documentation and the test oracle; the ``reference`` backend
(:mod:`addnorm.kernels.torch`) runs these formulas as torch ops. Every backend computes them, bit
for bit where this page says so (the dropout hash), on rows of a 2-D ``(M, N)`` view: ``M`` rows,
each normalized over its ``N`` features (the product of ``normalized_shape``). The functions:
the stream (:func:`stream`) and the sublayer branch (:func:`branch_terms`, :func:`keep_mask`);
the forward and backward of a block of rows, every step kept (:func:`forward_rows`,
:func:`backward_rows`) and of all rows at once (:func:`forward_steps`, :func:`backward_steps`).

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

from .backend import Branch


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
    keep: Tensor | None = None,
) -> Tensor:
    """``s = x + residual`` in :func:`stream_dtype` (``x`` itself without a residual); with a
    ``branch``, ``s = residual + branch_term(x)`` summed in the statistics dtype, then rounded
    (``first_row``: the index of ``x``'s first row in the call, for the dropout mask; ``keep``:
    that mask when already made, see :func:`branch_terms`)."""
    if residual is None:
        return x
    sd = stream_dtype(x, residual, residual_dtype)
    if branch is None:
        return x.to(sd) + residual.to(sd)
    cd = stats_dtype(sd)  # x is rounded to the stream dtype first, as without a branch
    rows = torch.arange(first_row, first_row + x.numel() // max(x.shape[-1], 1), device=x.device)
    return (residual.to(cd) + branch_terms(x.to(sd).to(cd), branch, rows.view(x.shape[:-1]), keep)["t"]).to(sd)


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


def branch_terms(x: Tensor, branch: Branch, rows: Tensor, keep: Tensor | None = None) -> dict[str, Tensor | None]:
    """``t = rowscale * layer_scale * dropout(x)`` for ``x`` in the statistics dtype, whose rows
    have the indices ``rows`` (``keep``: their :func:`keep_mask` when the caller has made it
    already), in this order of operations (every backend keeps it)::

        gate   = keep ? 1 / (1 - p) : 0              (1 when p = 0)
        factor = gate * layer_scale                  (per element; the layer scale when given)
        t      = x * factor * rowscale               (the row's factor when given)

    As torch's dropout, a dropped element is multiplied by 0, so a NaN or inf in ``x`` still
    shows as NaN. Returns ``keep`` (None when ``p = 0``), ``gate`` and ``t``."""
    factor = gate = torch.ones((), dtype=x.dtype, device=x.device)
    if branch.p <= 0:
        keep = None
    else:
        keep = keep_mask(branch.seed, rows, x.shape[-1], branch.p) if keep is None else keep.view(x.shape)
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


def sum_partials(partials: Tensor) -> Tensor:
    """The sum over dim 0 of the ``(blocks, N)`` partial rows of a parameter gradient, in a fixed
    pairwise tree: ``p[i] + p[i + half]`` level by level, each level one elementwise add, so the
    order of every sum depends on the number of blocks alone, never on threads (the reduction
    contract: docs/reliability.md). In place: each level is written over the first rows of the
    one before (``partials`` is overwritten), so the tree needs no memory beyond the rows."""
    rows = partials.shape[0]
    while rows > 1:
        half = rows // 2
        partials[:half] += partials[half : 2 * half]
        if rows % 2:  # the odd row out joins the next level
            partials[half] = partials[2 * half]
        rows = half + rows % 2
    return partials[0].clone()  # (not a view holding every partial row)


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


def fold_rows(t: Tensor) -> Tensor:
    """The sum of each row of ``t`` (keepdim) by halving: the first half plus the second, until one
    column is left (an odd column waits for the next level). Elementwise adds only, so every row
    is summed in the same order on any device; a GPU's own reductions pick their order from the
    tensor's shape, so a row's bits there would depend on the batch."""
    while t.shape[-1] > 1:
        n = t.shape[-1]
        half = t[..., : n // 2] + t[..., n // 2 : n // 2 * 2]
        t = torch.cat([half, t[..., n // 2 * 2 :]], dim=-1) if n % 2 else half
    return t


# The kernels compute the variance about the corrected mean as mean(d*d) - c*c, two passes
# where the reference takes three; a row where c*c exceeds mean(d*d) / CANCEL (a near-constant
# row far from zero) would lose bits to that difference, and gets the third pass there too.
CANCEL = 16


def row_mean(t: Tensor) -> Tensor:
    """The mean of each row of ``t`` (keepdim), summed in the same order whatever the number of
    rows, their position or the thread count (see ROW_CHUNK; off the CPU, :func:`fold_rows`)."""
    n = t.shape[-1]
    if t.device.type != "cpu":
        return fold_rows(t) / n
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
    # A constant row far from zero (its centered values all 0) would lose eps to underflow in
    # eps * k * k (beyond 2**55), and 0 * rsqrt(0) is NaN: its rstd is the unscaled row's,
    # 1/sqrt(eps) (for every constant row, and the same bits where k is 1). Finite while
    # 1/sqrt(eps) / k is (rows below 2**119 at eps 1e-5).
    rstd_k = torch.where(var_k == 0, torch.rsqrt(var_k + eps) / k, rstd_k)
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
    """:func:`forward_rows` on all rows at once from the inputs, keeping every step (``s`` too)."""
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
    """:func:`backward_rows` on all rows at once, keeping every step, with ``dweight``/``dbias``
    ``None`` where there is no such parameter."""
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
