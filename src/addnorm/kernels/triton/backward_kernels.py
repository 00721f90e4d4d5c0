"""The backward kernels: :func:`addnorm.kernels.torch.backward` on tiles of rows, with deterministic
dweight/dbias.

``ds = rstd * (g - xhat * mean(g * xhat) - mean(g))`` per row (see reference.py), plus
``dstream``, with ``xhat = (d - corr) * (rstd / k)``, ``d = s * k - mean * k`` and the forward's
row scale ``k`` (one more max-reduction), so it cannot overflow either. The saved mean is
rounded, so ``corr = mean(d)`` re-centres the row as the forward centred it (``_correction``).
Each program owns a contiguous block of rows and one column chunk, keeps fp32 (fp64 for fp64)
sums of ``dy * xhat`` and ``dy`` for its columns in registers, and writes them as one row of a
``(programs, N)`` partials buffer (one buffer holds every parameter gradient's). A second
kernel, one launch for all of them, sums the partials of 16-column strips, 64 partial rows at a
time, always in the same order: no atomics, no locks, so dweight/dbias are
bit-identical from run to run on the same device (the Triton tutorial's lock-based reduction is
not). Rows wider than the kind's ``max_fused_n`` (:mod:`.config`) first get ``k``, ``corr`` and
their two row coefficients (mean(g * xhat), mean(g)) from a chunked kernel (a pass for
``max|s|``, then one pass for all the sums: ``sum(g * xhat)`` is ``sum(g * d) - corr * sum(g)``,
times ``rstd / k``), then every column chunk is a separate program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...backend import Grads, check_s_parts
from . import config
from .common import _branch, _branch_args, _centre, _device, _load_tile, _round, _row_scale, _rows, _xhat, launch

# --------------------------------------------------------------------------- kernels


@triton.jit
def _load_s(S, rows, row_ok, cols, ss, N, CD: tl.constexpr):
    """``(s, mask)`` of one tile, zero outside the mask."""
    mask = row_ok[:, None] & (cols < N)[None, :]
    return _load_tile(S, rows, cols, ss, mask).to(CD), mask


@triton.jit
def _through_branch(x, r, rows, cols, M, N, SEED, SCALE, LS, RSC, threshold, RD: tl.constexpr, CD: tl.constexpr):
    """``(s, x, gate)`` of one tile whose stream is recomputed through the branch from ``x`` and
    the residual ``r`` as loaded: ``s = residual + t`` (:func:`_branch`) rounded to the
    residual's dtype ``RD``."""
    x = x.to(CD)
    t, gate = _branch(x, rows, cols, M, N, SEED, SCALE, LS, RSC, threshold, CD)
    return _round(r.to(CD) + t, RD).to(CD), x, gate


@triton.jit
def _branch_stream(S, R, rows, row_ok, cols, ss, sr, M, N, SEED, SCALE, LS, RSC, threshold, CD: tl.constexpr):
    """``(s, mask)`` of one tile of :func:`_through_branch`, ``S`` holding ``x``."""
    mask = row_ok[:, None] & (cols < N)[None, :]
    x, r = _load_tile(S, rows, cols, ss, mask), _load_tile(R, rows, cols, sr, mask)
    return _through_branch(x, r, rows, cols, M, N, SEED, SCALE, LS, RSC, threshold, R.dtype.element_ty, CD)[0], mask


@triton.jit
def _raw_tile(
    S,
    R,
    DY,
    DY1,
    DSTREAM,
    rows,
    cols,
    mask,
    ss,
    sr,
    sdy,
    sdy1,
    sdst,
    BRANCH: tl.constexpr,
    SECOND: tl.constexpr,
    HAS_DSTREAM: tl.constexpr,
):
    """Every load of one tile of the backward, in its tensors' dtypes, zero outside ``mask``:
    ``(s or x, residual, dy, dy1, dstream)``, each absent one a constant 0 (unused). Issued
    together, before any reduction, so that they are all in flight at once."""
    r = 0
    dy1 = 0
    dst = 0
    s = _load_tile(S, rows, cols, ss, mask)
    if BRANCH:
        r = _load_tile(R, rows, cols, sr, mask)
    dy = _load_tile(DY, rows, cols, sdy, mask)
    if SECOND:
        dy1 = _load_tile(DY1, rows, cols, sdy1, mask)
    if HAS_DSTREAM:
        dst = _load_tile(DSTREAM, rows, cols, sdst, mask)
    return s, r, dy, dy1, dst


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
def _grad_terms(
    s,
    dy,
    k,
    mask,
    mean_k,
    W,
    cols,
    N,
    dy1,
    W1,
    CD: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    IS_RMS: tl.constexpr,
    SECOND: tl.constexpr,
):
    """``(d, g = dy * weight)`` of one tile: ``d`` of :func:`_centre` with the forward's row scale
    ``k`` and saved mean, from which ``xhat`` cannot overflow; with ``SECOND`` (a second norm of
    the same stream) ``g = dy * weight + dy1 * weight1``. ``dy`` (so ``g``) is loaded as zero
    outside the tile's mask, so products with ``g`` vanish there."""
    g = dy
    if HAS_WEIGHT:
        g = dy * tl.load(W + cols, mask=cols < N, other=0.0).to(CD)[None, :]
    if SECOND:
        g = g + dy1 * tl.load(W1 + cols, mask=cols < N, other=0.0).to(CD)[None, :]
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
    DY1,
    W1,
    sdy1,
    HAS_WEIGHT: tl.constexpr,
    IS_RMS: tl.constexpr,
    BRANCH: tl.constexpr,
    SECOND: tl.constexpr,
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
            s, mask = _branch_stream(S, R, rows, row_ok, cols, ss, sr, M, N, SEED, SCALE, LS, RSC, threshold, CD)
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
            s, mask = _branch_stream(S, R, rows, row_ok, cols, ss, sr, M, N, SEED, SCALE, LS, RSC, threshold, CD)
        else:
            s, mask = _load_s(S, rows, row_ok, cols, ss, N, CD)
        dy = _load_tile(DY, rows, cols, sdy, mask).to(CD)
        dy1 = dy
        if SECOND:
            dy1 = _load_tile(DY1, rows, cols, sdy1, mask).to(CD)
        d, g = _grad_terms(s, dy, k, mask, mean_k, W, cols, N, dy1, W1, CD, HAS_WEIGHT, IS_RMS, SECOND)
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
    DY1,
    W1,
    DW1,
    DB1,
    sdy1,
    HAS_DSTREAM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_RMS: tl.constexpr,
    CHUNKED: tl.constexpr,
    BRANCH: tl.constexpr,
    LAYER_SCALED: tl.constexpr,
    SECOND: tl.constexpr,
    HAS_BIAS1: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``ds`` of rows ``[pid * rows_per_program, ...)`` and their partial dweight/dbias sums;
    with ``BRANCH`` (``S`` holds ``x``, the stream is recomputed through the branch) also ``dx``
    and, with ``LAYER_SCALED``, the partial sums of dlayer_scale, as ``reference.branch_backward``.

    Grid ``(programs, column chunks)``; without ``CHUNKED`` one chunk holds the whole row and
    the row scale and coefficients are computed here, else they come from :func:`_coef_kernel`.
    With ``SECOND`` (a second norm of the same stream) ``g`` takes ``dy1 * weight1`` too, and
    the partial sums of dweight1/dbias1 are written as dweight/dbias's.
    """
    CD: tl.constexpr = RSTD.dtype.element_ty
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dw = tl.zeros([BLOCK_N], dtype=CD)
    db = tl.zeros([BLOCK_N], dtype=CD)
    dls = tl.zeros([BLOCK_N], dtype=CD)
    dw1 = tl.zeros([BLOCK_N], dtype=CD)
    db1 = tl.zeros([BLOCK_N], dtype=CD)
    first = pid.to(tl.int64) * rows_per_program
    end = tl.minimum(first + rows_per_program, M)
    rows = first + tl.arange(0, BLOCK_M)
    col_ok = (cols < N)[None, :]
    if PREFETCH:  # the next tile's loads are issued before this tile's reductions
        n_s, n_r, n_dy, n_dy1, n_dst = _raw_tile(
            S, R, DY, DY1, DSTREAM, rows, cols, (rows < end)[:, None] & col_ok, ss, sr, sdy, sdy1, sdst,
            BRANCH, SECOND, HAS_DSTREAM,
        )  # fmt: skip
    for _ in range(0, rows_per_program, BLOCK_M):
        row_ok = rows < end
        mask = row_ok[:, None] & col_ok
        if PREFETCH:
            s, r, dy, dy1, dst = n_s, n_r, n_dy, n_dy1, n_dst
            ahead = rows + BLOCK_M
            n_s, n_r, n_dy, n_dy1, n_dst = _raw_tile(
                S, R, DY, DY1, DSTREAM, ahead, cols, (ahead < end)[:, None] & col_ok, ss, sr, sdy, sdy1, sdst,
                BRANCH, SECOND, HAS_DSTREAM,
            )  # fmt: skip
        else:
            s, r, dy, dy1, dst = _raw_tile(
                S, R, DY, DY1, DSTREAM, rows, cols, mask, ss, sr, sdy, sdy1, sdst, BRANCH, SECOND, HAS_DSTREAM
            )
        if BRANCH:
            s, x, gate = _through_branch(
                s, r, rows, cols, M, N, SEED, SCALE, LS, RSC, threshold, R.dtype.element_ty, CD
            )
        else:
            s = s.to(CD)
        dy = dy.to(CD)
        if SECOND:
            dy1 = dy1.to(CD)
        if CHUNKED:
            k = tl.load(K + rows, mask=row_ok, other=1.0)
        else:
            k = _row_scale(tl.max(tl.abs(s), axis=1))
        mean_k, rstd, rstd_k = _saved_stats(MEAN, RSTD, rows, row_ok, k, IS_RMS)
        d, g = _grad_terms(s, dy, k, mask, mean_k, W, cols, N, dy1, W1, CD, HAS_WEIGHT, IS_RMS, SECOND)
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
            ds += dst.to(CD)
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
        if SECOND:
            dw1 += tl.sum(dy1 * xhat, axis=0)
            db1 += tl.sum(dy1, axis=0)
        rows += BLOCK_M
    partial = pid.to(tl.int64) * N + cols
    if HAS_WEIGHT:
        tl.store(DW + partial, dw, mask=cols < N)
    if HAS_BIAS:
        tl.store(DB + partial, db, mask=cols < N)
    if LAYER_SCALED:
        tl.store(DLS + partial, dls, mask=cols < N)
    if SECOND:
        tl.store(DW1 + partial, dw1, mask=cols < N)
        if HAS_BIAS1:
            tl.store(DB1 + partial, db1, mask=cols < N)


@triton.jit
def _sum_partials_kernel(P, O0, O1, O2, O3, O4, programs, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """``Ok[j] = sum_p P[k, p, j]`` for every parameter gradient ``k`` (grid axis 1, at most five,
    each its own tensor, rounded once to its dtype) in one launch: ``BLOCK_P`` partial rows at a
    time into a ``(BLOCK_P, BLOCK_N)`` accumulator, then one reduction over its rows, in the same
    order on every run: deterministic."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1)
    P += k.to(tl.int64) * programs * N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=P.dtype.element_ty)
    for start in range(0, programs, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        mask = (p < programs)[:, None] & (cols < N)[None, :]
        acc += tl.load(P + p.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    ok = cols < N
    if k == 0:  # one store per output: each has a dtype of its own
        tl.store(O0 + cols, _round(total, O0.dtype.element_ty), mask=ok)
    if k == 1:
        tl.store(O1 + cols, _round(total, O1.dtype.element_ty), mask=ok)
    if k == 2:
        tl.store(O2 + cols, _round(total, O2.dtype.element_ty), mask=ok)
    if k == 3:
        tl.store(O3 + cols, _round(total, O3.dtype.element_ty), mask=ok)
    if k == 4:
        tl.store(O4 + cols, _round(total, O4.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------- launchers


def _sum_partials(partials: Tensor, dtypes: list[torch.dtype], strip: int = 16) -> list[Tensor]:
    """The sums over the programs of ``(k, programs, n)`` partials, ``k`` tensors of ``n`` in
    ``dtypes`` (one each): every parameter gradient of a backward in one launch, in column
    strips of ``strip``: n / 16 programs sum 1056 partial rows of 768 three times as fast as
    n / 64 on an H200 (docs/performance-log.md, "On an NVIDIA H200: the backward's prefetch")."""
    grads, programs, n = partials.shape
    outs = [torch.empty((n,), dtype=dt, device=partials.device) for dt in dtypes]
    block_n = min(config.next_power_of_2(n), strip)  # narrow column strips: n / strip programs
    launch(
        _sum_partials_kernel,
        (config.cdiv(n, block_n), grads),
        (partials, *outs, *outs[:1] * (5 - grads), programs, n),
        num_warps=4,
        BLOCK_P=64,
        BLOCK_N=block_n,
    )
    return outs


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
    second=None,
) -> Grads:
    """:func:`addnorm.kernels.torch.backward`, fused, with deterministic dweight/dbias (summed in the
    statistics dtype, then converted to ``param_dtype`` when given). (From
    ``s_parts = (x, residual)`` without a branch the stream is summed first: on a GPU writing
    ``s`` in the forward costs what reading ``x`` and ``residual`` again would, so
    ``recomputes_stream`` is off and autograd never asks for this. With a branch the kernels
    recompute the stream, the mask included, as they read ``x`` and ``residual``.)
    ``second``: ``(dy1, weight1, has_bias1)`` of a second norm of the same stream (parallel
    blocks): ``g = dy * weight + dy1 * weight1``, and ``dweight1``/``dbias1`` in the result."""
    check_s_parts(s_parts, branch)
    residual = None
    if branch is not None:
        residual = s_parts[1]
        s = s_parts[0] if s_parts[0].dtype == residual.dtype else s_parts[0].to(residual.dtype)
    else:
        s = s_parts[0] if len(s_parts) == 1 else s_parts[0] + s_parts[1]
    shape, n = s.shape, s.shape[-1]
    rows = [None if t is None else _rows(t.reshape(-1, n)) for t in (dy, dstream, s, residual)]
    if second is not None:
        second = (_rows(second[0].reshape(-1, n)), _rows(second[1]), second[2])
    with _device(s):
        g = _backward(*rows, _rows(weight), mean, rstd, rms, has_bias, branch, second, param_dtype)
    return g._replace(ds=g.ds.view(shape), dx=None if g.dx is None else g.dx.view(shape))


def _backward(dy, dstream, s, residual, weight, mean, rstd, rms, has_bias, branch, second, param_dtype) -> Grads:
    m, n = s.shape
    cd = rstd.dtype
    pd = param_dtype or cd  # dweight, dbias, dweight1, dbias1; dlayer_scale stays in cd
    ds = torch.empty((m, n), dtype=s.dtype, device=s.device)
    dx = torch.empty((m, n), dtype=s.dtype, device=s.device) if branch is not None else None
    layer_scaled = branch is not None and branch.layer_scale is not None
    dy1, weight1, has_bias1 = second if second is not None else (None, None, False)
    if m == 0:
        zeros = lambda present, dt=pd: torch.zeros((n,), dtype=dt, device=s.device) if present else None  # noqa: E731
        return Grads(
            ds,
            zeros(weight is not None),
            zeros(has_bias),
            dx,
            zeros(layer_scaled, cd),
            zeros(dy1 is not None),
            zeros(has_bias1),
        )
    second_args = (dy1, weight1, 0 if dy1 is None else dy1.stride(0))
    # a branch or a second norm keeps more tiles live per row: the launch kind with more warps
    # per row (fewer registers per thread; `python benchmarks/triton_registers.py`)
    kind = "backward" if branch is None and dy1 is None else "branch_backward"
    block_m, block_n, num_warps, chunked = config.plan(kind, n, s.device, s.element_size())
    branch_args = _branch_args(branch, m, n, cd, s.device)
    sr = residual.stride(0) if residual is not None else 0
    k = corr = c1 = c2 = None
    if chunked:
        k, corr, c1, c2 = (torch.empty((m,), dtype=cd, device=s.device) for _ in range(4))
        launch(
            _coef_kernel,
            (config.cdiv(m, block_m),),
            (
                dy, s, residual, weight, mean, rstd, k, corr, c1, c2, m, n, dy.stride(0), s.stride(0), sr,
                *branch_args, *second_args,
            ),
            num_warps=num_warps,
            HAS_WEIGHT=weight is not None,
            IS_RMS=rms,
            BRANCH=branch is not None,
            SECOND=dy1 is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
        )  # fmt: skip
    programs = config.backward_programs(kind, m, num_warps, s.device, chunked)
    rows_per_program = config.cdiv(config.cdiv(m, programs), block_m) * block_m
    programs = config.cdiv(m, rows_per_program)
    # one buffer of partial rows for every parameter gradient present, summed in one launch
    present = (weight is not None, has_bias, layer_scaled, dy1 is not None, has_bias1)
    buffer = torch.empty((sum(present), programs, n), dtype=cd, device=s.device)
    parts = iter(buffer)
    dw, db, dls, dw1, db1 = (next(parts) if here else None for here in present)
    launch(
        _backward_kernel,
        (programs, config.cdiv(n, block_n)),
        (
            dy, dstream, s, residual, weight, mean, rstd, k, corr, c1, c2, ds, dw, db, dx, dls, m, n,
            rows_per_program, dy.stride(0), dstream.stride(0) if dstream is not None else 0, s.stride(0), sr,
            *branch_args, dy1, weight1, dw1, db1, second_args[2],
        ),
        num_warps=num_warps,
        HAS_DSTREAM=dstream is not None,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=has_bias,
        IS_RMS=rms,
        CHUNKED=chunked,
        BRANCH=branch is not None,
        LAYER_SCALED=layer_scaled,
        SECOND=dy1 is not None,
        HAS_BIAS1=has_bias1,
        PREFETCH=config.backward_entry(kind, chunked).prefetch,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )  # fmt: skip
    dtypes = [dt for here, dt in zip(present, (pd, pd, cd, pd, pd)) if here]
    sums = iter(_sum_partials(buffer, dtypes) if len(buffer) else ())
    dw, db, dls, dw1, db1 = (next(sums) if here else None for here in present)
    return Grads(ds, dw, db, dx, dls, dw1, db1)
