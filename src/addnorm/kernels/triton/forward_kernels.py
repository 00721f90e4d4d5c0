"""The forward kernel: :func:`addnorm.kernels.torch.forward` on tiles of rows.

A program normalizes a tile of ``BLOCK_M`` rows by ``BLOCK_N`` columns. Rows up to the forward's
``max_fused_n`` features (:mod:`.config`) are held whole in registers: one read of ``x`` (and
``residual``), one write of the stream ``s`` and of ``y``, and in between four reductions over
registers, as ``reference.forward_rows``: ``max|s|`` gives the row scale ``k`` (a power of two,
so ``s * k`` is exact and its squares cannot overflow even near bf16's maximum); the mean of
``s * k``; the mean of the centred row, which corrects that mean (exact centring of constant
rows and of rows with a large offset); the mean of the centred squares (never
E[s^2] - E[s]^2). Wider rows take the chunked path: the same program walks the row in
chunks three times: ``max|s|`` and the sum of ``s * k`` (rescaled, exactly, when a later chunk
lowers ``k``); the sums of the centred values and of their squares, whose corrected two-pass
combination ``mean(c^2) - mean(c)^2`` is the variance about the corrected mean; then normalize.
The re-reads should mostly hit L2, as a row in flight is at most a few hundred KB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import reference
from . import config
from .common import (
    _branch,
    _branch_args,
    _centre,
    _constant,
    _device,
    _dropout_args,
    _gate,
    _load_tile,
    _round,
    _row_scale,
    _rows,
    _xhat,
    launch,
)

_CANCEL = tl.constexpr(reference.CANCEL)  # pass 3 of the chunked forward's variance

# --------------------------------------------------------------------------- kernels


@triton.jit
def _rsqrt(v):
    """``1 / sqrt(v)`` correctly rounded, as the reference's ``torch.rsqrt`` (not tl.rsqrt's
    approximation); fp64 sqrt and division are correctly rounded in Triton anyway."""
    if v.dtype == tl.float64:
        return 1.0 / tl.sqrt(v)
    else:
        return tl.div_rn(tl.full(v.shape, 1.0, tl.float32), tl.sqrt_rn(v))


@triton.jit
def _load_stream(
    X,
    R,
    SD: tl.constexpr,
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
    X1,
    sx1,
    SEED1,
    SCALE1,
    threshold1,
    CD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BRANCH: tl.constexpr,
    ADDED: tl.constexpr,
    DROPPED1: tl.constexpr,
):
    """``s = x + residual`` rounded to the stream dtype ``SD`` (each of them rounded to it first, as
    ``x.to(sd) + residual.to(sd)``), returned in ``CD``; with
    ``BRANCH``, ``x`` goes through :func:`_branch` first. With ``ADDED`` the residual is first
    ``residual + dropout1(x1)`` (parallel blocks' ``x1``, with ``DROPPED1`` through its dropout),
    summed in ``CD`` and rounded to the stream dtype: the bits of the separate pass
    (:mod:`.dropped_kernels`)."""
    x = _load_tile(X, rows, cols, sx, mask)
    if X.dtype.element_ty != SD:  # each input rounded to the stream dtype first (exact when it widens)
        x = _round(x, SD)
    x = x.to(CD)
    if HAS_RESIDUAL:
        r = _load_tile(R, rows, cols, sr, mask)
        if R.dtype.element_ty != SD:
            r = _round(r, SD)
        r = r.to(CD)
        if ADDED:  # x1 rounded to the stream dtype first (exact when it widens), as x1.to(sd)
            a = _load_tile(X1, rows, cols, sx1, mask)
            if X1.dtype.element_ty != SD:
                a = _round(a, SD)
            a = a.to(CD)
            if DROPPED1:
                a = a * _gate(rows, cols, SEED1, SCALE1, threshold1, CD)
            r = _round(r + a, SD).to(CD)
        if BRANCH:
            x = _branch(x, rows, cols, M, N, SEED, SCALE, LS, RSC, threshold, CD)[0]
        x = _round(x + r, SD).to(CD)
    return x


@triton.jit
def _load_param(P, cols, N, CD: tl.constexpr, HAS: tl.constexpr):
    """The weight (or bias) of the tile's columns in ``CD``; zeros, unused, when there is none."""
    if HAS:
        return tl.load(P + cols, mask=cols < N, other=0.0).to(CD)
    else:
        return tl.zeros(cols.shape, dtype=CD)


@triton.jit
def _stream_chunk_k(
    X,
    R,
    SD: tl.constexpr,
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
    X1,
    sx1,
    SEED1,
    SCALE1,
    threshold1,
    CD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BRANCH: tl.constexpr,
    ADDED: tl.constexpr,
    DROPPED1: tl.constexpr,
):
    """Columns ``start + cols`` of the stream (:func:`_load_stream`) times the row scale ``k``,
    and their mask: a chunk of the chunked forward's second and third passes."""
    ccols = start + cols
    mask = (rows < M)[:, None] & (ccols < N)[None, :]
    s = _load_stream(
        X, R, SD, rows, ccols, mask, sx, sr, M, N, SEED, SCALE, LS, RSC, threshold,
        X1, sx1, SEED1, SCALE1, threshold1, CD, HAS_RESIDUAL, BRANCH, ADDED, DROPPED1,
    )  # fmt: skip
    return s * k[:, None], mask


@triton.jit
def _store_stream(s, S, rows, cols, mask, N, WRITE_STREAM: tl.constexpr):
    """Write the stream ``s`` of one tile (with ``WRITE_STREAM``; nothing without)."""
    if WRITE_STREAM:  # s holds values of S's dtype already: the cast is exact
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
    EPS,
    SEED,
    SCALE,
    LS,
    RSC,
    threshold,
    W1,
    B1,
    Y1,
    X1,
    sx1,
    SEED1,
    SCALE1,
    threshold1,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_RMS: tl.constexpr,
    CHUNKED: tl.constexpr,
    BRANCH: tl.constexpr,
    SECOND: tl.constexpr,
    HAS_BIAS1: tl.constexpr,
    ADDED: tl.constexpr,
    DROPPED1: tl.constexpr,
    WRITE_STREAM: tl.constexpr,
    WRITE_STATS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``y`` (``s``, the statistics) of a tile of rows; with ``SECOND`` also ``y1`` from the same
    ``xhat`` with ``W1``/``B1`` (a second norm of the same stream: parallel blocks); with
    ``ADDED``, parallel blocks' ``x1`` added to the residual as it is read (:func:`_load_stream`).
    ``s`` is written with ``WRITE_STREAM`` (then in ``S``'s dtype; else the stream is in ``y``'s),
    the statistics with ``WRITE_STATS``."""
    CD: tl.constexpr = EPS.dtype.element_ty  # the statistics dtype (eps is passed in it)
    if WRITE_STREAM:
        SD: tl.constexpr = S.dtype.element_ty
    else:
        SD: tl.constexpr = Y.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_N)
    mean_k = tl.zeros([BLOCK_M], dtype=CD)  # the mean of s * k, then its correction
    corr = tl.zeros([BLOCK_M], dtype=CD)
    if not CHUNKED:  # the whole row is in registers: every pass is over registers
        mask = row_ok[:, None] & (cols < N)[None, :]
        s = _load_stream(
            X, R, SD, rows, cols, mask, sx, sr, M, N, SEED, SCALE, LS, RSC, threshold,
            X1, sx1, SEED1, SCALE1, threshold1, CD, HAS_RESIDUAL, BRANCH, ADDED, DROPPED1,
        )  # fmt: skip
        w = _load_param(W, cols, N, CD, HAS_WEIGHT)  # issued now: latency hidden by the reductions
        b = _load_param(B, cols, N, CD, HAS_BIAS)
        _store_stream(s, S, rows, cols, mask, N, WRITE_STREAM)  # now: s need not stay live
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
                X, R, SD, rows, ccols, mask, sx, sr, M, N, SEED, SCALE, LS, RSC, threshold,
                X1, sx1, SEED1, SCALE1, threshold1, CD, HAS_RESIDUAL, BRANCH, ADDED, DROPPED1,
            )  # fmt: skip
            _store_stream(s, S, rows, ccols, mask, N, WRITE_STREAM)
            amax = tl.maximum(amax, tl.max(tl.abs(s), axis=1))
            k_new = _row_scale(amax)
            if not IS_RMS:
                mean_k = mean_k * (k_new / k) + tl.sum(s * k_new[:, None], axis=1)
            k = k_new
        mean_k = mean_k / N
        m2 = tl.zeros([BLOCK_M], dtype=CD)
        for start in range(0, N, BLOCK_N):
            c, mask = _stream_chunk_k(
                X, R, SD, rows, start, cols, k, sx, sr, M, N, SEED, SCALE, LS, RSC, threshold,
                X1, sx1, SEED1, SCALE1, threshold1, CD, HAS_RESIDUAL, BRANCH, ADDED, DROPPED1,
            )  # fmt: skip
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
                X, R, SD, rows, start, cols, k, sx, sr, M, N, SEED, SCALE, LS, RSC, threshold,
                X1, sx1, SEED1, SCALE1, threshold1, CD, HAS_RESIDUAL, BRANCH, ADDED, DROPPED1,
            )  # fmt: skip
            c = tl.where(mask, (c - mean_k[:, None]) - corr[:, None], 0.0)
            m3 += tl.sum(c * c, axis=1)
        var_k = tl.where(redo, m3 / N, var_k)
    eps = tl.load(EPS)  # (in CD: a float argument is fp32)
    rstd_k = _rsqrt(var_k + eps * k * k)  # = rstd / k
    rstd_k = tl.where(var_k == 0, _rsqrt(var_k + eps) / k, rstd_k)  # a constant row: reference.forward_rows
    if WRITE_STATS:
        if not IS_RMS:
            tl.store(MEAN + rows, (mean_k + corr) / k, mask=row_ok)
        tl.store(RSTD + rows, rstd_k * k, mask=row_ok)
    if not CHUNKED:
        xhat = _xhat(_centre(sk, mask, mean_k, IS_RMS), corr, rstd_k, IS_RMS)
        _store_y(xhat, w, b, Y, rows, cols, mask, N, HAS_WEIGHT, HAS_BIAS)
        if SECOND:
            w1, b1 = _load_param(W1, cols, N, CD, True), _load_param(B1, cols, N, CD, HAS_BIAS1)
            _store_y(xhat, w1, b1, Y1, rows, cols, mask, N, True, HAS_BIAS1)
    else:
        for start in range(0, N, BLOCK_N):
            ccols = start + cols
            mask = row_ok[:, None] & (ccols < N)[None, :]
            sk = _load_stream(
                X, R, SD, rows, ccols, mask, sx, sr, M, N, SEED, SCALE, LS, RSC, threshold,
                X1, sx1, SEED1, SCALE1, threshold1, CD, HAS_RESIDUAL, BRANCH, ADDED, DROPPED1,
            ) * k[:, None]  # fmt: skip
            w = _load_param(W, ccols, N, CD, HAS_WEIGHT)
            b = _load_param(B, ccols, N, CD, HAS_BIAS)
            xhat = _xhat(_centre(sk, mask, mean_k, IS_RMS), corr, rstd_k, IS_RMS)
            _store_y(xhat, w, b, Y, rows, ccols, mask, N, HAS_WEIGHT, HAS_BIAS)
            if SECOND:
                w1, b1 = _load_param(W1, ccols, N, CD, True), _load_param(B1, ccols, N, CD, HAS_BIAS1)
                _store_y(xhat, w1, b1, Y1, rows, ccols, mask, N, True, HAS_BIAS1)


# --------------------------------------------------------------------------- launchers

_NO_X1 = (None, 0, None, None, 0)  # (X1, sx1, SEED1, SCALE1, threshold1) without parallel blocks' x1


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
    branch=None,
    second=None,
    x1=None,
) -> tuple:
    """:func:`addnorm.kernels.torch.forward`, fused: one read of the inputs, one write of the
    outputs. ``s`` is written when ``write_stream`` or ``residual_out`` asks for it, and whenever
    its dtype is not ``y``'s (the kernel takes the stream's dtype from ``S``, else from ``Y``);
    the statistics when ``write_stats``. ``second``: ``(weight1, bias1)`` of a second norm of the
    same stream (parallel blocks), whose ``y1`` the same kernel writes and which is returned
    fifth. ``x1``: an :class:`~addnorm.backend.X1` (parallel blocks), added to each row of
    ``residual`` (which must be given) as it is read."""
    shape, n = x.shape, x.shape[-1]
    y_dtype = x.dtype
    sd = reference.stream_dtype(x, residual, residual_dtype)
    if branch is not None and x.dtype != sd:  # the branch takes x rounded to the stream dtype
        x = x.to(sd)
    x = _rows(x.reshape(-1, n))
    residual = _rows(residual.reshape(-1, n)) if residual is not None else None
    m = x.shape[0]
    cd = reference.stats_dtype(sd)
    x1_args, dropped1 = _NO_X1, False
    if x1 is not None:  # in its own dtype: the kernel rounds it to the stream dtype as it reads it
        x1, p1, seed1 = x1
        if residual is None or x1.shape != shape:
            raise ValueError(f"x1 is added to the residual: it needs one, and x's shape {tuple(shape)}")
        x1 = _rows(x1.reshape(-1, n))
        x1_args, dropped1 = (x1, x1.stride(0), *_dropout_args(p1, seed1, cd, x.device)), p1 > 0
    y = out if out is not None else torch.empty(shape, dtype=y_dtype, device=x.device)
    s = into = None
    if residual is not None and (write_stream or residual_out is not None or sd != y_dtype):
        s = residual_out if residual_out is not None else torch.empty(shape, dtype=sd, device=x.device)
        if residual_out is not None and _reads_again(n, x) and _shares_storage(residual_out, x, residual, x1):
            into, s = residual_out, torch.empty(shape, dtype=sd, device=x.device)  # copied into it after
    mean = None if rms or not write_stats else torch.empty((m,), dtype=cd, device=x.device)
    rstd = None if not write_stats else torch.empty((m,), dtype=cd, device=x.device)
    y1 = None if second is None else torch.empty(shape, dtype=y_dtype, device=x.device)
    if m:
        branch_args = _branch_args(branch, m, n, cd, x.device)
        second_args = (None, None, None) if second is None else (_rows(second[0]), _rows(second[1]), y1)
        flags = dict(BRANCH=branch is not None, SECOND=second is not None, ADDED=x1 is not None, DROPPED1=dropped1)
        flags["HAS_BIAS1"] = second is not None and second[1] is not None
        _launch(x, residual, weight, bias, y, s, mean, rstd, eps, cd, rms, branch_args, second_args, x1_args, flags)
    if into is not None:
        s = into.copy_(s)
    return (y, s, mean, rstd) if second is None else (y, s, mean, rstd, y1)


def _reads_again(n: int, x: Tensor) -> bool:
    """Whether the forward reads the inputs of rows of ``n`` features again after writing their
    stream: the chunked path, whose later passes read ``x`` and ``residual`` (and ``x1``) again."""
    return config.plan("forward", n, x.device, x.element_size()).chunked


def _shares_storage(t: Tensor, *others: Tensor | None) -> bool:
    """Whether ``t`` lies in the memory of one of ``others`` (the same storage: conservatively)."""
    ptr = t.untyped_storage().data_ptr()
    return any(o is not None and o.untyped_storage().data_ptr() == ptr for o in others)


_CONTIGUOUS = torch.contiguous_format
_PLAIN_FLAGS = dict(BRANCH=False, SECOND=False, ADDED=False, DROPPED1=False, HAS_BIAS1=False)
_PLAIN_ARGS = _branch_args(None, 0, 0, None, None), (None, None, None), _NO_X1


def plain_forward(x, residual, weight, bias, eps, rms, write_stream):
    """:func:`forward` of the call a decode step makes (the optional ``plain_forward`` of the
    backend contract, :mod:`addnorm.backend`): ``x``, ``residual`` (or None), ``weight`` and
    ``bias`` (or None) of one dtype; no statistics, buffers, branch or parallel block. Returns
    ``(y, s)`` (``s`` None unless ``write_stream`` with a residual): the launch :func:`forward`
    makes for the call, with less Python around it (on a GPU a call of a few rows is bound by
    the host: docs/benchmarks.md, "GPU: where it stands")."""
    y = torch.empty_like(x, memory_format=_CONTIGUOUS)  # (the fewest Python steps to a new tensor)
    s = torch.empty_like(x, memory_format=_CONTIGUOUS) if write_stream and residual is not None else None
    if y.numel():
        n, dtype = x.shape[-1], x.dtype
        x = _rows(x if x.dim() == 2 else x.reshape(-1, n))
        residual = None if residual is None else _rows(residual if residual.dim() == 2 else residual.reshape(-1, n))
        cd = reference.stats_dtype(dtype)
        _launch(x, residual, weight, bias, y, s, None, None, eps, cd, rms, *_PLAIN_ARGS, _PLAIN_FLAGS)
    return y, s


def _launch(x, residual, weight, bias, y, s, mean, rstd, eps, cd, rms, branch_args, second_args, x1_args, flags):
    """One launch of :func:`_forward_kernel` over the rows of ``x`` (``residual``'s rows of its
    shape): writes ``y``, and ``s``, ``mean``, ``rstd`` where given."""
    m, n = x.shape
    block_m, block_n, num_warps, chunked = config.plan("forward", n, x.device, x.element_size())
    with _device(x):
        launch(
            _forward_kernel,
            (config.cdiv(m, block_m),),
            (
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
                _constant(1, cd, x.device, eps),
                *branch_args,
                *second_args,
                *x1_args,
            ),
            num_warps=num_warps,
            HAS_RESIDUAL=residual is not None,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            IS_RMS=rms,
            CHUNKED=chunked,
            **flags,
            WRITE_STREAM=s is not None,
            WRITE_STATS=rstd is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
        )
