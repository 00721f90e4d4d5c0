"""Triton kernels for every addnorm op: the contract of :mod:`addnorm.reference` on GPU rows.

Algorithm (forward). A program normalizes a tile of ``BLOCK_M`` rows by ``BLOCK_N`` columns.
Rows up to ``FORWARD_MAX_FUSED_N`` features are held whole in registers: one read of ``x`` (and
``residual``), one write of the stream ``s`` and of ``y``, and in between four reductions over
registers, as ``reference.forward_rows``: ``max|s|`` gives the row scale ``k`` (a power of two,
so ``s * k`` is exact and its squares cannot overflow even near bf16's maximum); the mean of
``s * k``; the mean of the centred row, which corrects that mean (exact centring of constant
rows and of rows with a large offset); the mean of the centred squares (never
E[s^2] - E[s]^2). Wider rows take the chunked path: the same program walks the row in
``CHUNK_N`` chunks three times: ``max|s|`` and the sum of ``s * k`` (rescaled, exactly, when a
later chunk lowers ``k``); the sums of the centred values and of their squares, whose corrected
two-pass combination ``mean(c^2) - mean(c)^2`` is the variance about the corrected mean; then
normalize. The re-reads should mostly hit L2, as a row in flight is at most a few hundred KB.

Algorithm (backward). ``ds = rstd * (g - xhat * mean(g * xhat) - mean(g))`` per row (see
reference.py), plus ``dstream``, with ``xhat = (d - corr) * (rstd / k)``, ``d = s * k - mean * k``
and the forward's row scale ``k`` (one more max-reduction), so it cannot overflow either. The
saved mean is rounded, so ``corr = mean(d)`` re-centres the row as the forward centred it
(``_correction``). Each program owns a contiguous block of rows and one column chunk, keeps fp32
(fp64 for fp64) sums of ``dy * xhat`` and ``dy`` for its columns in registers, and writes them
as one row of a ``(programs, N)`` partials buffer. A second kernel sums the partials of
64-column strips, 64 partial rows at a time, always in the same order: no atomics, no locks, so
dweight/dbias are bit-identical from run to run on the same device (the Triton tutorial's
lock-based reduction is not). Rows wider than ``BACKWARD_MAX_FUSED_N`` first get ``k``,
``corr`` and their two row coefficients (mean(g * xhat), mean(g)) from a chunked kernel (a
pass for ``max|s|``, then one pass for all the sums: ``sum(g * xhat)`` is ``sum(g * d) -
corr * sum(g)``, times ``rstd / k``), then every column chunk is a separate program.

Limits and why. Statistics and arithmetic are fp32 for fp16/bf16/fp32 and fp64 for fp64, as
the reference. Row offsets are int64 (tensors over 2**31 elements are safe); rows may have any
stride (a copy is made only when the last dim is not contiguous, as the kernels need unit
column stride for coalesced loads). bf16 is rounded to nearest even by hand (``_round``)
because Triton's interpreter truncates; on GPU the same few integer ops cost nothing in a
memory-bound kernel.

Launch heuristic (``_config``), timed on an H100 with ``python benchmarks/triton_tune.py``
(docs/benchmarks.md, "On an NVIDIA H100"): ``BLOCK_N`` is the next power of two of ``N`` (or
``CHUNK_N``); short rows are stacked into ``BLOCK_M`` rows per program so that a tile holds
about ``TILE_ELEMS`` elements; ``num_warps`` gives each thread about 64 bytes of the tile
(``FORWARD_/BACKWARD_BYTES_PER_THREAD``), clamped to 1..32 warps: fewer, fuller warps let each
row reduction cross fewer warps and keep more loads in flight per thread. The forward fuses
rows up to 16384 features, the backward, which keeps about six row-sized values live, up to
8192 (beyond, it spills: ``python benchmarks/triton_registers.py`` prints registers and spills
for sm_90 without a GPU). The chunked path streams its chunks and takes 16 bytes per thread
(``CHUNKED_BYTES_PER_THREAD``). Backward launches ``SMs * max(1, BACKWARD_WARPS_PER_SM //
num_warps)`` programs, each looping over its rows, which bounds the partials buffer to
``programs * N`` values. The tile shape and warps depend on ``N``, the dtype and the device
alone, so a row's results never depend on the batch (the number of programs does: it sets only
how the dweight/dbias partials are grouped).

The kernels are compiled by ``triton.jit``, which reads ``TRITON_INTERPRET`` when this module
is imported: with ``TRITON_INTERPRET=1`` set before then, they run on CPU tensors through
Triton's interpreter (that is how CI tests them), otherwise they need CUDA tensors.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference
from ..backend import Capabilities, Grads, check_s_parts

# widest row held whole in registers (wider rows take the chunked path): the forward keeps
# fewer values live than the backward (benchmarks/triton_tune.py measured both on an H100)
FORWARD_MAX_FUSED_N = 16384
BACKWARD_MAX_FUSED_N = 8192
# with the sublayer branch the backward also keeps x and the keep mask live: with these limits it
# compiles for sm_90 without spills from 2048 to 4096 features, where the plain limits spilled
# (python benchmarks/triton_registers.py: chosen by registers, not yet timed on a GPU)
BRANCH_BACKWARD_MAX_FUSED_N = 4096
BRANCH_BACKWARD_BYTES_PER_THREAD = 16
CHUNK_N = 4096  # columns per chunk on the chunked path (a power of two)
TILE_ELEMS = 4096  # elements per program tile when short rows are stacked
MAX_BLOCK_M = 32  # at most this many rows per tile
FORWARD_BYTES_PER_THREAD = 64  # num_warps = tile bytes / (32 * this), clamped to 1..32
BACKWARD_BYTES_PER_THREAD = 64
CHUNKED_BYTES_PER_THREAD = 16  # the same on the chunked path, forward and backward
_CANCEL = tl.constexpr(reference.CANCEL)  # pass 3 of the chunked forward's variance
BACKWARD_WARPS_PER_SM = 32  # backward launches SMs * max(1, this // num_warps) programs
# The interpreter pays ~1 ms of Python per Triton op per program, whatever the tile size, so
# on CPU tensors tiles stack more rows (same code, fewer programs); tests can set these back.
INTERPRETER_TILE_ELEMS = 65536
INTERPRETER_MAX_BLOCK_M = 256
INTERPRETER_PROGRAMS = 4  # backward programs under the interpreter (no SM count on CPU)


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_forward_kernel, InterpretedFunction)


# CUDA tensors; CPU tensors only through Triton's interpreter (how CI runs these kernels)
CAPABILITIES = Capabilities(device_types=("cuda", "cpu"))


def unavailable_reason(x: Tensor | None) -> str | None:
    """Why these kernels cannot run on ``x`` (``None`` if they can)."""
    if x is not None and x.device.type == "cpu" and not _interpreted():
        return "CPU tensors need TRITON_INTERPRET=1 (set before addnorm's triton kernels are imported)"
    return None


# --------------------------------------------------------------------------- kernels


@triton.jit
def _round(v, DT: tl.constexpr):
    """``v`` rounded to ``DT`` to nearest even. bf16 is rounded by hand, identically on GPU and
    in Triton's interpreter, whose own fp32 -> bf16 cast truncates (Triton 3.9)."""
    if DT == tl.bfloat16:
        v = v.to(tl.float32)
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(v != v, v.to(tl.bfloat16), out)  # NaN stays NaN
    else:
        return v.to(DT)


@triton.jit
def _rsqrt(v):
    """``1 / sqrt(v)`` correctly rounded, as the reference's ``torch.rsqrt`` (not tl.rsqrt's
    approximation); fp64 sqrt and division are correctly rounded in Triton anyway."""
    if v.dtype == tl.float64:
        return 1.0 / tl.sqrt(v)
    else:
        return tl.div_rn(tl.full(v.shape, 1.0, tl.float32), tl.sqrt_rn(v))


@triton.jit
def _fmix32(h):
    """MurmurHash3's finalizer on uint32 values (``reference.fmix32``): wraps mod 2**32."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _branch(x, rows, cols, M, N, SEED, SCALE, LS, RSC, threshold, CD: tl.constexpr):
    """``(t, gate)`` of one tile: ``gate = keep ? scale : 0`` with ``keep`` the hash of ``(seed,
    row, column)`` at least ``threshold``, ``t = x * (gate * layer_scale) * rowscale``:
    reference.branch_terms and reference.mask_hash, bit for bit. A missing factor is a tensor of
    ones (``* 1`` is exact)."""
    seed = tl.load(SEED)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    a = _fmix32(_fmix32(rows.to(tl.uint32) ^ k0) + k1)
    b = _fmix32(_fmix32(cols.to(tl.uint32) ^ k1) + (k0 ^ 0x9E3779B9))
    keep = _fmix32(a[:, None] + b[None, :]).to(tl.int64) >= threshold
    gate = tl.where(keep, tl.load(SCALE).to(CD), 0.0)
    factor = gate * tl.load(LS + cols, mask=cols < N, other=1.0).to(CD)[None, :]
    t = x * factor * tl.load(RSC + rows, mask=rows < M, other=1.0).to(CD)[:, None]
    return t, gate


@triton.jit
def _load_stream(
    X,
    R,
    S,
    rows,
    cols,
    mask,
    sx,
    sr,
    M,
    N,
    SEED,
    SCALE,
    LS,
    RSC,
    threshold,
    CD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BRANCH: tl.constexpr,
):
    """``s = x + residual`` rounded to the stream dtype (``S``'s), returned in ``CD``; with
    ``BRANCH``, ``x`` goes through :func:`_branch` first."""
    x = tl.load(X + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(CD)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * sr + cols[None, :], mask=mask, other=0.0).to(CD)
        if BRANCH:
            x = _branch(x, rows, cols, M, N, SEED, SCALE, LS, RSC, threshold, CD)[0]
        x = _round(x + r, S.dtype.element_ty).to(CD)
    return x


@triton.jit
def _load_param(P, cols, N, CD: tl.constexpr, HAS: tl.constexpr):
    """The weight (or bias) of the tile's columns in ``CD``; zeros, unused, when there is none."""
    if HAS:
        return tl.load(P + cols, mask=cols < N, other=0.0).to(CD)
    else:
        return tl.zeros(cols.shape, dtype=CD)


@triton.jit
def _row_scale(amax):
    """Per row, the power of two ``k = 2**-e <= 1`` with ``max|s * k| < 1`` (``reference.row_scale``),
    built from the exponent bits of ``amax = max|s|``: exact, and at ``amax = 2**j`` it is
    ``2**-(j + 1)``, as frexp. ``e`` stops at the smallest normal's exponent, so ``k`` is never
    subnormal (a GPU may flush those): rows beyond ``2**126`` get ``max|s * k| < 4``, which is
    as safe. Non-finite rows get ``k = 1`` and propagate as unscaled."""
    if amax.dtype == tl.float64:
        biased = (amax.to(tl.int64, bitcast=True) >> 52) & 0x7FF
        e = tl.where(biased == 0x7FF, 0, tl.minimum(tl.maximum(biased - 1022, 0), 1022))
        return ((1023 - e) << 52).to(tl.float64, bitcast=True)
    else:
        biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        e = tl.where(biased == 0xFF, 0, tl.minimum(tl.maximum(biased - 126, 0), 126))
        return ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _centre(sk, mask, mean_k, IS_RMS: tl.constexpr):
    """``d = s * k - mean_k`` from ``sk = s * k``, zero outside ``mask`` (``sk`` for RMSNorm)."""
    if IS_RMS:
        return sk
    else:
        return tl.where(mask, sk - mean_k[:, None], 0.0)


@triton.jit
def _xhat(d, corr, rstd_k, IS_RMS: tl.constexpr):
    """``xhat = (d - corr) * rstd_k`` from ``d`` of :func:`_centre`: the rough mean subtracted, then
    its correction (exact for constant rows), as ``reference.forward_rows`` (``d * rstd_k`` for
    RMSNorm). Not masked (a select less, fewer registers): outside the tile's mask it is never
    stored, and the backward's column sums take it times ``dy``, which is zero there."""
    if IS_RMS:
        return d * rstd_k[:, None]
    else:
        return (d - corr[:, None]) * rstd_k[:, None]


@triton.jit
def _stream_chunk_k(
    X,
    R,
    S,
    rows,
    start,
    cols,
    k,
    sx,
    sr,
    M,
    N,
    SEED,
    SCALE,
    LS,
    RSC,
    threshold,
    CD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BRANCH: tl.constexpr,
):
    """Columns ``start + cols`` of the stream (:func:`_load_stream`) times the row scale ``k``,
    and their mask: a chunk of the chunked forward's second and third passes."""
    ccols = start + cols
    mask = (rows < M)[:, None] & (ccols < N)[None, :]
    s = _load_stream(
        X, R, S, rows, ccols, mask, sx, sr, M, N, SEED, SCALE, LS, RSC, threshold, CD, HAS_RESIDUAL, BRANCH
    )
    return s * k[:, None], mask


@triton.jit
def _store_stream(s, S, rows, cols, mask, N, HAS_RESIDUAL: tl.constexpr):
    """Write the stream ``s`` of one tile (with a residual; nothing without)."""
    if HAS_RESIDUAL:  # s holds values of S's dtype already: the cast is exact
        tl.store(S + rows[:, None] * N + cols[None, :], s.to(S.dtype.element_ty), mask=mask)


@triton.jit
def _store_y(xhat, w, b, Y, rows, cols, mask, N, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Write ``y = xhat * weight + bias`` of one tile."""
    out = rows[:, None] * N + cols[None, :]
    y = xhat
    if HAS_WEIGHT:
        y = y * w[None, :]
    if HAS_BIAS:
        y = y + b[None, :]
    tl.store(Y + out, _round(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _forward_kernel(
    X,
    R,
    W,
    B,
    Y,
    S,
    MEAN,
    RSTD,
    M,
    N,
    sx,
    sr,
    eps,
    SEED,
    SCALE,
    LS,
    RSC,
    threshold,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_RMS: tl.constexpr,
    CHUNKED: tl.constexpr,
    BRANCH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    CD: tl.constexpr = RSTD.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_N)
    mean_k = tl.zeros([BLOCK_M], dtype=CD)  # the mean of s * k, then its correction
    corr = tl.zeros([BLOCK_M], dtype=CD)
    if not CHUNKED:  # the whole row is in registers: every pass is over registers
        mask = row_ok[:, None] & (cols < N)[None, :]
        s = _load_stream(
            X, R, S, rows, cols, mask, sx, sr, M, N, SEED, SCALE, LS, RSC, threshold, CD, HAS_RESIDUAL, BRANCH
        )
        w = _load_param(W, cols, N, CD, HAS_WEIGHT)  # issued now: latency hidden by the reductions
        b = _load_param(B, cols, N, CD, HAS_BIAS)
        _store_stream(s, S, rows, cols, mask, N, HAS_RESIDUAL)  # now: s need not stay live
        k = _row_scale(tl.max(tl.abs(s), axis=1))
        sk = s * k[:, None]
        c = sk
        if not IS_RMS:
            mean_k = tl.sum(c, axis=1) / N
            c = tl.where(mask, c - mean_k[:, None], 0.0)
            corr = tl.sum(c, axis=1) / N
            c = tl.where(mask, c - corr[:, None], 0.0)
        var_k = tl.sum(c * c, axis=1) / N
    else:
        # Pass 1: k from max|s|, and (LayerNorm) the sum of s * k, rescaled whenever k shrinks
        # (by a power of two: exact). Pass 2: the centred sum and sum of squares; their
        # corrected two-pass combination gives the variance about the corrected mean.
        k = tl.full([BLOCK_M], 1.0, CD)
        amax = tl.zeros([BLOCK_M], dtype=CD)
        for start in range(0, N, BLOCK_N):
            ccols = start + cols
            mask = row_ok[:, None] & (ccols < N)[None, :]
            s = _load_stream(
                X, R, S, rows, ccols, mask, sx, sr, M, N, SEED, SCALE, LS, RSC, threshold, CD, HAS_RESIDUAL, BRANCH
            )
            _store_stream(s, S, rows, ccols, mask, N, HAS_RESIDUAL)
            amax = tl.maximum(amax, tl.max(tl.abs(s), axis=1))
            k_new = _row_scale(amax)
            if not IS_RMS:
                mean_k = mean_k * (k_new / k) + tl.sum(s * k_new[:, None], axis=1)
            k = k_new
        mean_k = mean_k / N
        m2 = tl.zeros([BLOCK_M], dtype=CD)
        for start in range(0, N, BLOCK_N):
            c, mask = _stream_chunk_k(
                X, R, S, rows, start, cols, k, sx, sr, M, N, SEED, SCALE, LS, RSC, threshold, CD, HAS_RESIDUAL, BRANCH
            )
            if not IS_RMS:
                c = tl.where(mask, c - mean_k[:, None], 0.0)
                corr += tl.sum(c, axis=1)
            m2 += tl.sum(c * c, axis=1)
        corr = corr / N
        var_k = tl.maximum(m2 / N - corr * corr, 0.0)
        # Where corr * corr is not small beside m2 / N (a near-constant row far from zero), that
        # difference cancels: pass 3, over no column unless some row needs it (never for
        # RMSNorm, whose corr is 0), squares the corrected deviations themselves, as the CPU
        # kernel's _centred_stats (the same threshold) and the reference.
        redo = row_ok & (corr * corr * _CANCEL > m2 / N)
        m3 = tl.zeros([BLOCK_M], dtype=CD)
        for start in range(0, N * tl.max(redo.to(tl.int32), axis=0), BLOCK_N):
            c, mask = _stream_chunk_k(
                X, R, S, rows, start, cols, k, sx, sr, M, N, SEED, SCALE, LS, RSC, threshold, CD, HAS_RESIDUAL, BRANCH
            )
            c = tl.where(mask, (c - mean_k[:, None]) - corr[:, None], 0.0)
            m3 += tl.sum(c * c, axis=1)
        var_k = tl.where(redo, m3 / N, var_k)
    rstd_k = _rsqrt(var_k + eps * k * k)  # = rstd / k
    if not IS_RMS:
        tl.store(MEAN + rows, (mean_k + corr) / k, mask=row_ok)
    tl.store(RSTD + rows, rstd_k * k, mask=row_ok)
    if not CHUNKED:
        xhat = _xhat(_centre(sk, mask, mean_k, IS_RMS), corr, rstd_k, IS_RMS)
        _store_y(xhat, w, b, Y, rows, cols, mask, N, HAS_WEIGHT, HAS_BIAS)
    else:
        for start in range(0, N, BLOCK_N):
            ccols = start + cols
            mask = row_ok[:, None] & (ccols < N)[None, :]
            sk = (
                _load_stream(
                    X, R, S, rows, ccols, mask, sx, sr, M, N, SEED, SCALE, LS, RSC, threshold, CD, HAS_RESIDUAL, BRANCH
                )
                * k[:, None]
            )
            w = _load_param(W, ccols, N, CD, HAS_WEIGHT)
            b = _load_param(B, ccols, N, CD, HAS_BIAS)
            xhat = _xhat(_centre(sk, mask, mean_k, IS_RMS), corr, rstd_k, IS_RMS)
            _store_y(xhat, w, b, Y, rows, ccols, mask, N, HAS_WEIGHT, HAS_BIAS)


@triton.jit
def _load_s(S, rows, row_ok, cols, ss, N, CD: tl.constexpr):
    """``(s, mask)`` of one tile, zero outside the mask."""
    mask = row_ok[:, None] & (cols < N)[None, :]
    return tl.load(S + rows[:, None] * ss + cols[None, :], mask=mask, other=0.0).to(CD), mask


@triton.jit
def _branch_stream(S, R, rows, row_ok, cols, ss, sr, M, N, SEED, SCALE, LS, RSC, threshold, CD: tl.constexpr):
    """``(s, mask, x, gate)`` of one tile whose stream is recomputed through the branch: ``S``
    holds ``x``, and ``s = residual + t`` (:func:`_branch`) rounded to the residual's dtype."""
    x, mask = _load_s(S, rows, row_ok, cols, ss, N, CD)
    r = tl.load(R + rows[:, None] * sr + cols[None, :], mask=mask, other=0.0).to(CD)
    t, gate = _branch(x, rows, cols, M, N, SEED, SCALE, LS, RSC, threshold, CD)
    return _round(r + t, R.dtype.element_ty).to(CD), mask, x, gate


@triton.jit
def _load_dy(DY, rows, cols, mask, sdy, CD: tl.constexpr):
    """``dy`` of one tile, loaded with ``s`` before any reduction so both loads are in flight."""
    return tl.load(DY + rows[:, None] * sdy + cols[None, :], mask=mask, other=0.0).to(CD)


@triton.jit
def _saved_stats(MEAN, RSTD, rows, row_ok, k, IS_RMS: tl.constexpr):
    """``(mean_k, rstd, rstd_k)`` of the tile's rows: the forward's saved mean times the row scale
    ``k`` (zero for RMSNorm), rstd, and ``rstd / k``."""
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    if IS_RMS:
        mean_k = tl.zeros(rstd.shape, dtype=rstd.dtype)
    else:
        mean_k = tl.load(MEAN + rows, mask=row_ok, other=0.0) * k
    return mean_k, rstd, rstd / k


@triton.jit
def _grad_terms(s, dy, k, mask, mean_k, W, cols, N, CD: tl.constexpr, HAS_WEIGHT: tl.constexpr, IS_RMS: tl.constexpr):
    """``(d, g = dy * weight)`` of one tile: ``d`` of :func:`_centre` with the forward's row scale
    ``k`` and saved mean, from which ``xhat`` cannot overflow. ``dy`` (so ``g``) is loaded as zero
    outside the tile's mask, so products with ``g`` vanish there."""
    g = dy
    if HAS_WEIGHT:
        g = dy * tl.load(W + cols, mask=cols < N, other=0.0).to(CD)[None, :]
    return _centre(s * k[:, None], mask, mean_k, IS_RMS), g


@triton.jit
def _correction(d, N, IS_RMS: tl.constexpr):
    """``corr``, the mean of ``d`` (:func:`_centre`): the saved mean is rounded
    (reference.backward_rows), and ``xhat = (d - corr) * rstd_k`` re-centres the row as the
    forward centred it. Zero for RMSNorm (no mean; unused)."""
    if IS_RMS:
        return tl.zeros([d.shape[0]], dtype=d.dtype)
    else:
        return tl.sum(d, axis=1) / N


@triton.jit
def _coef_kernel(
    DY,
    S,
    R,
    W,
    MEAN,
    RSTD,
    K,
    CORR,
    C1,
    C2,
    M,
    N,
    sdy,
    ss,
    sr,
    SEED,
    SCALE,
    LS,
    RSC,
    threshold,
    HAS_WEIGHT: tl.constexpr,
    IS_RMS: tl.constexpr,
    BRANCH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Chunked path: the row scale ``k`` (a pass for max|s|), then the correction ``corr`` of the
    saved mean (:func:`_correction`) and the row coefficients ``mean(g * xhat)`` and ``mean(g)``
    of wide rows, all from one pass of row sums."""
    CD: tl.constexpr = RSTD.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    amax = tl.zeros([BLOCK_M], dtype=CD)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        if BRANCH:
            s, mask, _, _ = _branch_stream(S, R, rows, row_ok, cols, ss, sr, M, N, SEED, SCALE, LS, RSC, threshold, CD)
        else:
            s, mask = _load_s(S, rows, row_ok, cols, ss, N, CD)
        amax = tl.maximum(amax, tl.max(tl.abs(s), axis=1))
    k = _row_scale(amax)
    mean_k, rstd, rstd_k = _saved_stats(MEAN, RSTD, rows, row_ok, k, IS_RMS)  # rstd unused; "_" is a tile below
    corr = tl.zeros([BLOCK_M], dtype=CD)
    c1 = tl.zeros([BLOCK_M], dtype=CD)
    c2 = tl.zeros([BLOCK_M], dtype=CD)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        if BRANCH:
            s, mask, _, _ = _branch_stream(S, R, rows, row_ok, cols, ss, sr, M, N, SEED, SCALE, LS, RSC, threshold, CD)
        else:
            s, mask = _load_s(S, rows, row_ok, cols, ss, N, CD)
        dy = _load_dy(DY, rows, cols, mask, sdy, CD)
        d, g = _grad_terms(s, dy, k, mask, mean_k, W, cols, N, CD, HAS_WEIGHT, IS_RMS)
        if not IS_RMS:
            corr += tl.sum(d, axis=1)
        c1 += tl.sum(g * (d * rstd_k[:, None]), axis=1)  # g * xhat before the correction
        c2 += tl.sum(g, axis=1)
    corr = corr / N
    if not IS_RMS:  # sum(g * (d - corr) * rstd_k), without a second pass over the row for corr
        c1 -= corr * rstd_k * c2
    tl.store(K + rows, k, mask=row_ok)
    tl.store(CORR + rows, corr, mask=row_ok)
    tl.store(C1 + rows, c1 / N, mask=row_ok)
    tl.store(C2 + rows, c2 / N, mask=row_ok)


@triton.jit
def _backward_kernel(
    DY,
    DSTREAM,
    S,
    R,
    W,
    MEAN,
    RSTD,
    K,
    CORR,
    C1,
    C2,
    DS,
    DW,
    DB,
    DX,
    DLS,
    M,
    N,
    rows_per_program,
    sdy,
    sdst,
    ss,
    sr,
    SEED,
    SCALE,
    LS,
    RSC,
    threshold,
    HAS_DSTREAM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_RMS: tl.constexpr,
    CHUNKED: tl.constexpr,
    BRANCH: tl.constexpr,
    LAYER_SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``ds`` of rows ``[pid * rows_per_program, ...)`` and their partial dweight/dbias sums;
    with ``BRANCH`` (``S`` holds ``x``, the stream is recomputed through the branch) also ``dx``
    and, with ``LAYER_SCALED``, the partial sums of dlayer_scale, as ``reference.branch_backward``.

    Grid ``(programs, column chunks)``; without ``CHUNKED`` one chunk holds the whole row and
    the row scale and coefficients are computed here, else they come from :func:`_coef_kernel`.
    """
    CD: tl.constexpr = RSTD.dtype.element_ty
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dw = tl.zeros([BLOCK_N], dtype=CD)
    db = tl.zeros([BLOCK_N], dtype=CD)
    dls = tl.zeros([BLOCK_N], dtype=CD)
    first = pid.to(tl.int64) * rows_per_program
    for offset in range(0, rows_per_program, BLOCK_M):
        rows = first + offset + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        if BRANCH:
            s, mask, x, gate = _branch_stream(
                S, R, rows, row_ok, cols, ss, sr, M, N, SEED, SCALE, LS, RSC, threshold, CD
            )
        else:
            s, mask = _load_s(S, rows, row_ok, cols, ss, N, CD)
        dy = _load_dy(DY, rows, cols, mask, sdy, CD)
        if CHUNKED:
            k = tl.load(K + rows, mask=row_ok, other=1.0)
        else:
            k = _row_scale(tl.max(tl.abs(s), axis=1))
        mean_k, rstd, rstd_k = _saved_stats(MEAN, RSTD, rows, row_ok, k, IS_RMS)
        d, g = _grad_terms(s, dy, k, mask, mean_k, W, cols, N, CD, HAS_WEIGHT, IS_RMS)
        if CHUNKED:
            corr = tl.load(CORR + rows, mask=row_ok, other=0.0)
            c1 = tl.load(C1 + rows, mask=row_ok, other=0.0)
            c2 = tl.load(C2 + rows, mask=row_ok, other=0.0)
        else:
            corr = _correction(d, N, IS_RMS)  # the row is in registers: a sum of them, then xhat
        xhat = _xhat(d, corr, rstd_k, IS_RMS)
        if not CHUNKED:
            c1 = tl.sum(g * xhat, axis=1) / N
            c2 = tl.sum(g, axis=1) / N
        inner = g - xhat * c1[:, None]
        if not IS_RMS:
            inner = inner - c2[:, None]
        ds = inner * rstd[:, None]
        if HAS_DSTREAM:
            ds += tl.load(DSTREAM + rows[:, None] * sdst + cols[None, :], mask=mask, other=0.0).to(CD)
        ds = _round(ds, DS.dtype.element_ty)
        tl.store(DS + rows[:, None] * N + cols[None, :], ds, mask=mask)
        if BRANCH:  # from ds as stored, as autograd would read it
            ds = ds.to(CD)
            dx = _branch(ds, rows, cols, M, N, SEED, SCALE, LS, RSC, threshold, CD)[0]
            tl.store(DX + rows[:, None] * N + cols[None, :], _round(dx, DX.dtype.element_ty), mask=mask)
        if LAYER_SCALED:
            rowscale = tl.load(RSC + rows, mask=row_ok, other=1.0).to(CD)
            dls += tl.sum(ds * (x * gate * rowscale[:, None]), axis=0)
        if HAS_WEIGHT:
            dw += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
    partial = pid.to(tl.int64) * N + cols
    if HAS_WEIGHT:
        tl.store(DW + partial, dw, mask=cols < N)
    if HAS_BIAS:
        tl.store(DB + partial, db, mask=cols < N)
    if LAYER_SCALED:
        tl.store(DLS + partial, dls, mask=cols < N)


@triton.jit
def _sum_partials_kernel(P, OUT, programs, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """``OUT[j] = sum_p P[p, j]``: ``BLOCK_P`` partial rows at a time into a ``(BLOCK_P, BLOCK_N)``
    accumulator, then one reduction over its rows, in the same order on every run: deterministic."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=OUT.dtype.element_ty)
    for start in range(0, programs, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        mask = (p < programs)[:, None] & (cols < N)[None, :]
        acc += tl.load(P + p.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0), mask=cols < N)


# --------------------------------------------------------------------------- launchers


def _config(
    n: int, device: torch.device, elem_size: int, bytes_per_thread: int, max_fused_n: int
) -> tuple[int, int, int, bool]:
    """``(BLOCK_M, BLOCK_N, num_warps, chunked)`` for rows of ``n`` features of ``elem_size`` bytes,
    each thread holding about ``bytes_per_thread`` of the tile (module docstring)."""
    chunked = n > max_fused_n
    block_n = CHUNK_N if chunked else triton.next_power_of_2(n)
    tile, max_m = (
        (TILE_ELEMS, MAX_BLOCK_M) if device.type == "cuda" else (INTERPRETER_TILE_ELEMS, INTERPRETER_MAX_BLOCK_M)
    )
    block_m = 1 if chunked else max(1, min(max_m, tile // block_n))
    bytes_per_thread = CHUNKED_BYTES_PER_THREAD if chunked else bytes_per_thread
    num_warps = max(1, min(32, block_m * block_n * elem_size // (32 * bytes_per_thread)))
    return block_m, block_n, triton.next_power_of_2(num_warps), chunked


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _backward_programs(m: int, num_warps: int, device: torch.device) -> int:
    if device.type == "cuda":
        return min(m, _sm_count(device) * max(1, BACKWARD_WARPS_PER_SM // num_warps))
    return min(m, INTERPRETER_PROGRAMS)


# Triton's interpreter patches triton.language's globals while a kernel runs, so two Python
# threads interpreting kernels at once break each other: interpreted launches take turns.
_INTERPRETER_LOCK = threading.RLock()


def _device(t: Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it ``t``'s (multi-GPU processes).
    On CPU tensors (the interpreter) it holds the interpreter's lock instead."""
    return torch.cuda.device(t.device) if t.is_cuda else _INTERPRETER_LOCK


def _rows(t: Tensor | None) -> Tensor | None:
    """``t`` with unit column stride (rows may keep any stride): copy only when needed."""
    return t if t is None or t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


@functools.lru_cache(maxsize=64)
def _constant(n: int, dtype: torch.dtype, device: torch.device, value: float) -> Tensor:
    """``n`` values ``value`` (never written): a missing layer scale or rowscale (ones), the dropout
    scale (one value), a seed when there is no dropout (zero)."""
    return torch.full((n,), value, dtype=dtype, device=device)


def _branch_args(branch, m: int, n: int, cd: torch.dtype, device: torch.device) -> tuple:
    """``(SEED, SCALE, LS, RSC, threshold)`` for the kernels (see ``_branch``): a missing factor is
    a row of ones; all None (and threshold 0) without a branch."""
    if branch is None:
        return None, None, None, None, 0
    p = branch.p
    return (
        branch.seed if p > 0 else _constant(1, torch.int64, device, 0),
        _constant(1, cd, device, reference.dropout_scale(p)),
        _rows(branch.layer_scale) if branch.layer_scale is not None else _constant(n, cd, device, 1.0),
        _rows(branch.rowscale) if branch.rowscale is not None else _constant(m, cd, device, 1.0),
        reference.keep_threshold(p),
    )


def forward(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    *,
    eps: float,
    rms: bool,
    residual_dtype: torch.dtype | None,
    write_stream: bool = True,  # s and the statistics are always written here
    write_stats: bool = True,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
    branch=None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """:func:`addnorm.reference.forward`, fused: one read of the inputs, one write of the outputs."""
    shape, n = x.shape, x.shape[-1]
    y_dtype = x.dtype
    sd = reference.stream_dtype(x, residual, residual_dtype)
    if branch is not None and x.dtype != sd:  # the branch takes x rounded to the stream dtype
        x = x.to(sd)
    x = _rows(x.reshape(-1, n))
    residual = _rows(residual.reshape(-1, n)) if residual is not None else None
    m = x.shape[0]
    cd = reference.stats_dtype(sd)
    y = out if out is not None else torch.empty(shape, dtype=y_dtype, device=x.device)
    s = None
    if residual is not None:
        s = residual_out if residual_out is not None else torch.empty(shape, dtype=sd, device=x.device)
    mean = None if rms else torch.empty((m,), dtype=cd, device=x.device)
    rstd = torch.empty((m,), dtype=cd, device=x.device)
    if m == 0:
        return y, s, mean, rstd
    block_m, block_n, num_warps, chunked = _config(
        n, x.device, x.element_size(), FORWARD_BYTES_PER_THREAD, FORWARD_MAX_FUSED_N
    )
    with _device(x):
        _forward_kernel[(triton.cdiv(m, block_m),)](
            x,
            residual,
            _rows(weight),
            _rows(bias),
            y,
            s,
            mean,
            rstd,
            m,
            n,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            eps,
            *_branch_args(branch, m, n, cd, x.device),
            HAS_RESIDUAL=residual is not None,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            IS_RMS=rms,
            CHUNKED=chunked,
            BRANCH=branch is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
    return y, s, mean, rstd


def _sum_partials(partials: Tensor) -> Tensor:
    programs, n = partials.shape
    if programs == 1:
        return partials[0]
    out = torch.empty((n,), dtype=partials.dtype, device=partials.device)
    block_n = min(triton.next_power_of_2(n), 64)  # narrow column strips: n / 64 programs
    _sum_partials_kernel[(triton.cdiv(n, block_n),)](
        partials, out, programs, n, BLOCK_P=64, BLOCK_N=block_n, num_warps=4
    )
    return out


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
    branch=None,
    param_dtype: torch.dtype | None = None,
) -> Grads:
    """:func:`addnorm.reference.backward`, fused, with deterministic dweight/dbias (summed in the
    statistics dtype, then converted to ``param_dtype`` when given). (From
    ``s_parts = (x, residual)`` without a branch the stream is summed first: on a GPU writing
    ``s`` in the forward costs what reading ``x`` and ``residual`` again would, so
    ``recomputes_stream`` is off and autograd never asks for this. With a branch the kernels
    recompute the stream, the mask included, as they read ``x`` and ``residual``.)"""
    check_s_parts(s_parts, branch)
    residual = None
    if branch is not None:
        residual = s_parts[1]
        s = s_parts[0] if s_parts[0].dtype == residual.dtype else s_parts[0].to(residual.dtype)
    else:
        s = s_parts[0] if len(s_parts) == 1 else s_parts[0] + s_parts[1]
    shape, n = s.shape, s.shape[-1]
    rows = [None if t is None else _rows(t.reshape(-1, n)) for t in (dy, dstream, s, residual)]
    with _device(s):
        g = _backward(*rows, _rows(weight), mean, rstd, rms, has_bias, branch)
        if param_dtype is not None:
            g = g._replace(
                **{k: getattr(g, k).to(param_dtype) for k in ("dweight", "dbias") if getattr(g, k) is not None}
            )
    return g._replace(ds=g.ds.view(shape), dx=None if g.dx is None else g.dx.view(shape))


def _backward(dy, dstream, s, residual, weight, mean, rstd, rms, has_bias, branch) -> Grads:
    m, n = s.shape
    cd = rstd.dtype
    ds = torch.empty((m, n), dtype=s.dtype, device=s.device)
    dx = torch.empty((m, n), dtype=s.dtype, device=s.device) if branch is not None else None
    layer_scaled = branch is not None and branch.layer_scale is not None
    if m == 0:
        zeros = lambda present: torch.zeros((n,), dtype=cd, device=s.device) if present else None  # noqa: E731
        return Grads(ds, zeros(weight is not None), zeros(has_bias), dx, zeros(layer_scaled))
    max_fused_n = BACKWARD_MAX_FUSED_N if branch is None else BRANCH_BACKWARD_MAX_FUSED_N
    block_m, block_n, num_warps, chunked = _config(
        n, s.device, s.element_size(), BACKWARD_BYTES_PER_THREAD, max_fused_n
    )
    branch_args = _branch_args(branch, m, n, cd, s.device)
    sr = residual.stride(0) if residual is not None else 0
    k = corr = c1 = c2 = None
    if chunked:
        k, corr, c1, c2 = (torch.empty((m,), dtype=cd, device=s.device) for _ in range(4))
        _coef_kernel[(triton.cdiv(m, block_m),)](
            dy,
            s,
            residual,
            weight,
            mean,
            rstd,
            k,
            corr,
            c1,
            c2,
            m,
            n,
            dy.stride(0),
            s.stride(0),
            sr,
            *branch_args,
            HAS_WEIGHT=weight is not None,
            IS_RMS=rms,
            BRANCH=branch is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
    programs = _backward_programs(m, num_warps, s.device)
    rows_per_program = triton.cdiv(triton.cdiv(m, programs), block_m) * block_m
    programs = triton.cdiv(m, rows_per_program)
    partials = lambda present: torch.empty((programs, n), dtype=cd, device=s.device) if present else None  # noqa: E731
    dw, db, dls = partials(weight is not None), partials(has_bias), partials(layer_scaled)
    _backward_kernel[(programs, triton.cdiv(n, block_n))](
        dy,
        dstream,
        s,
        residual,
        weight,
        mean,
        rstd,
        k,
        corr,
        c1,
        c2,
        ds,
        dw,
        db,
        dx,
        dls,
        m,
        n,
        rows_per_program,
        dy.stride(0),
        dstream.stride(0) if dstream is not None else 0,
        s.stride(0),
        sr,
        *branch_args,
        HAS_DSTREAM=dstream is not None,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=has_bias,
        IS_RMS=rms,
        CHUNKED=chunked,
        BRANCH=branch is not None,
        LAYER_SCALED=layer_scaled,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    total = lambda p: None if p is None else _sum_partials(p)  # noqa: E731
    return Grads(ds, total(dw), total(db), dx, total(dls))
