"""Triton kernels for every addnorm op: the contract of :mod:`addnorm.reference` on GPU rows.

Algorithm (forward). A program normalizes a tile of ``BLOCK_M`` rows by ``BLOCK_N`` columns.
Rows up to ``MAX_FUSED_N`` features are held whole in registers: one read of ``x`` (and
``residual``), two passes over registers for the statistics (mean, then the mean of the
centred squares -- never E[s^2] - E[s]^2), one write of ``y`` (and the stream ``s``).
Wider rows take the chunked path: the same program walks the row in ``CHUNK_N`` chunks,
combining per-chunk (count, mean, M2) with Chan's parallel formula (exact two-pass statistics
inside a chunk, a stable update between chunks), then walks the row again to normalize; the
second read should mostly hit L2, as a row in flight is at most a few hundred KB.

Algorithm (backward). ``ds = rstd * (g - xhat * mean(g * xhat) - mean(g))`` per row (see
reference.py), plus ``dstream``. Each program owns a contiguous block of rows and one column
chunk, keeps fp32 (fp64 for fp64) sums of ``dy * xhat`` and ``dy`` for its columns in
registers, and writes them as one row of a ``(programs, N)`` partials buffer. A second kernel
sums the partials column by column in program order: no atomics, no locks, so dweight/dbias
are bit-identical from run to run on the same device (the Triton tutorial's lock-based
reduction is not). Rows wider than ``MAX_FUSED_N`` first get their two row coefficients
(mean(g * xhat), mean(g)) from a chunked pass, then every column chunk is a separate program.

Limits and why. Statistics and arithmetic are fp32 for fp16/bf16/fp32 and fp64 for fp64, as
the reference. Row offsets are int64 (tensors over 2**31 elements are safe); rows may have any
stride (a copy is made only when the last dim is not contiguous, as the kernels need unit
column stride for coalesced loads). ``MAX_FUSED_N = 8192``: at the maximum of 32 warps a
thread then holds 8 elements of the row; the backward keeps about six row-sized values live
(s, dy, xhat, g and the dweight/dbias sums) and compiles to at most 64 registers without
spilling, while 16384 features (16 per thread) spill 72-192 bytes per thread in ptxas for
sm_90 (``python benchmarks/triton_registers.py --max-fused-n 16384 16384`` compiles every
kernel for sm_90 without a GPU and prints registers and spills). bf16 is rounded to nearest
even by hand (``_round``) because Triton's interpreter truncates; on GPU the same few integer
ops cost nothing in a memory-bound kernel.

Launch heuristic (``_config``): ``BLOCK_N`` is the next power of two of ``N`` (or ``CHUNK_N``);
short rows are stacked into ``BLOCK_M`` rows per program so that a tile holds about
``TILE_ELEMS`` elements; ``num_warps`` gives each thread ``ELEMS_PER_THREAD`` = 4 elements of
the tile (clamped to 1..32). The kernels are memory-bound, so what matters is warps resident
per SM: at N=4096 four elements per thread compile to 23-48 registers (32 or more warps per
SM for every kernel), where eight per thread took 49-128 registers and left 16 warps per SM
(``benchmarks/triton_registers.py --elems-per-thread 8 4096``). Backward launches
``SMs * max(1, 32 // num_warps)`` programs, each looping over its rows, which bounds the
partials buffer to ``programs * N`` fp32 values. These are reasoned defaults, not yet timed on
hardware (docs/gpu.md lists what a GPU run must check).

The kernels are compiled by ``triton.jit``, which reads ``TRITON_INTERPRET`` when this module
is imported: with ``TRITON_INTERPRET=1`` set before then, they run on CPU tensors through
Triton's interpreter (that is how CI tests them), otherwise they need CUDA tensors.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference

MAX_FUSED_N = 8192  # widest row held whole in registers; wider rows take the chunked path
CHUNK_N = 4096  # columns per chunk on the chunked path (a power of two)
TILE_ELEMS = 4096  # elements per program tile when short rows are stacked
MAX_BLOCK_M = 32  # at most this many rows per tile
ELEMS_PER_THREAD = 4  # num_warps = tile / (32 * this), clamped to 1..32
# The interpreter pays ~1 ms of Python per Triton op per program, whatever the tile size, so
# on CPU tensors tiles stack more rows (same code, fewer programs); tests can set these back.
INTERPRETER_TILE_ELEMS = 65536
INTERPRETER_MAX_BLOCK_M = 256
INTERPRETER_PROGRAMS = 4  # backward programs under the interpreter (no SM count on CPU)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_forward_kernel, InterpretedFunction)


def unavailable_reason(x: Tensor | None) -> str | None:
    """Why these kernels cannot run on ``x`` (``None`` if they can)."""
    if x is None:
        return None
    if x.device.type == "cpu" and not _interpreted():
        return "CPU tensors need TRITON_INTERPRET=1 (set before addnorm's triton kernels are imported)"
    if x.device.type not in ("cpu", "cuda"):
        return f"Triton kernels run on CUDA tensors, got a tensor on {x.device}"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} is not supported (float16, bfloat16, float32, float64)"
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
def _load_stream(X, R, S, rows, cols, mask, sx, sr, CD: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """``s = x + residual`` rounded to the stream dtype (``S``'s), returned in ``CD``."""
    x = tl.load(X + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(CD)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * sr + cols[None, :], mask=mask, other=0.0).to(CD)
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
def _normalize_store(s, w, b, Y, S, rows, cols, mask, N, mean, rstd,
                     HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr):
    """Write ``y`` (and the stream ``s``) of one tile, given ``s``, the tile's weight and bias
    and the row statistics."""
    out = rows[:, None] * N + cols[None, :]
    if HAS_RESIDUAL:  # s holds values of S's dtype already: the cast is exact
        tl.store(S + out, s.to(S.dtype.element_ty), mask=mask)
    if IS_RMS:
        y = s * rstd[:, None]
    else:
        y = (s - mean[:, None]) * rstd[:, None]
    if HAS_WEIGHT:
        y = y * w[None, :]
    if HAS_BIAS:
        y = y + b[None, :]
    tl.store(Y + out, _round(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _forward_kernel(X, R, W, B, Y, S, MEAN, RSTD, M, N, sx, sr, eps,
                    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    IS_RMS: tl.constexpr, CHUNKED: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    CD: tl.constexpr = RSTD.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_N)
    if not CHUNKED:  # the whole row is in registers: two passes over it there
        mask = row_ok[:, None] & (cols < N)[None, :]
        s = _load_stream(X, R, S, rows, cols, mask, sx, sr, CD, HAS_RESIDUAL)
        w = _load_param(W, cols, N, CD, HAS_WEIGHT)  # issued now: latency hidden by the reductions
        b = _load_param(B, cols, N, CD, HAS_BIAS)
        if IS_RMS:
            mean = tl.zeros([BLOCK_M], dtype=CD)
            c = s
        else:
            mean = tl.sum(s, axis=1) / N
            c = tl.where(mask, s - mean[:, None], 0.0)
        rstd = _rsqrt(tl.sum(c * c, axis=1) / N + eps)
    else:  # chunks combined with Chan's formula: mean and M2 of the `start` columns seen so far
        mean = tl.zeros([BLOCK_M], dtype=CD)
        m2 = tl.zeros([BLOCK_M], dtype=CD)
        for start in range(0, N, BLOCK_N):
            ccols = start + cols
            mask = row_ok[:, None] & (ccols < N)[None, :]
            s = _load_stream(X, R, S, rows, ccols, mask, sx, sr, CD, HAS_RESIDUAL)
            if IS_RMS:
                m2 += tl.sum(s * s, axis=1)
            else:
                n_b = tl.minimum(N - start, BLOCK_N).to(CD)
                mean_b = tl.sum(s, axis=1) / n_b
                c = tl.where(mask, s - mean_b[:, None], 0.0)
                delta = mean_b - mean
                seen = tl.full([BLOCK_M], start, CD)
                mean += delta * (n_b / (seen + n_b))
                m2 += tl.sum(c * c, axis=1) + delta * delta * (seen * n_b / (seen + n_b))
        rstd = _rsqrt(m2 / N + eps)
    if not IS_RMS:
        tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    if not CHUNKED:
        _normalize_store(s, w, b, Y, S, rows, cols, mask, N, mean, rstd,
                         HAS_RESIDUAL, HAS_WEIGHT, HAS_BIAS, IS_RMS)
    else:
        for start in range(0, N, BLOCK_N):
            ccols = start + cols
            mask = row_ok[:, None] & (ccols < N)[None, :]
            s = _load_stream(X, R, S, rows, ccols, mask, sx, sr, CD, HAS_RESIDUAL)
            w = _load_param(W, ccols, N, CD, HAS_WEIGHT)
            b = _load_param(B, ccols, N, CD, HAS_BIAS)
            _normalize_store(s, w, b, Y, S, rows, ccols, mask, N, mean, rstd,
                             HAS_RESIDUAL, HAS_WEIGHT, HAS_BIAS, IS_RMS)


@triton.jit
def _load_grad_terms(DY, S, W, MEAN, RSTD, rows, row_ok, cols, sdy, ss, N,
                     CD: tl.constexpr, HAS_WEIGHT: tl.constexpr, IS_RMS: tl.constexpr):
    """``(xhat, g = dy * weight, dy, rstd, mask)`` of one tile, zero outside the tile's mask."""
    mask = row_ok[:, None] & (cols < N)[None, :]
    s = tl.load(S + rows[:, None] * ss + cols[None, :], mask=mask, other=0.0).to(CD)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    if IS_RMS:
        xhat = s * rstd[:, None]
    else:
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
    dy = tl.load(DY + rows[:, None] * sdy + cols[None, :], mask=mask, other=0.0).to(CD)
    g = dy
    if HAS_WEIGHT:
        g = dy * tl.load(W + cols, mask=cols < N, other=0.0).to(CD)[None, :]
    return xhat, g, dy, rstd, mask


@triton.jit
def _coef_kernel(DY, S, W, MEAN, RSTD, C1, C2, M, N, sdy, ss,
                 HAS_WEIGHT: tl.constexpr, IS_RMS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Chunked path: the row coefficients ``mean(g * xhat)`` and ``mean(g)`` of wide rows."""
    CD: tl.constexpr = RSTD.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    c1 = tl.zeros([BLOCK_M], dtype=CD)
    c2 = tl.zeros([BLOCK_M], dtype=CD)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        xhat, g, dy, rstd, mask = _load_grad_terms(DY, S, W, MEAN, RSTD, rows, row_ok, cols, sdy, ss, N,
                                                   CD, HAS_WEIGHT, IS_RMS)
        c1 += tl.sum(g * xhat, axis=1)
        c2 += tl.sum(g, axis=1)
    tl.store(C1 + rows, c1 / N, mask=row_ok)
    tl.store(C2 + rows, c2 / N, mask=row_ok)


@triton.jit
def _backward_kernel(DY, DSTREAM, S, W, MEAN, RSTD, C1, C2, DS, DW, DB, M, N, rows_per_program,
                     sdy, sdst, ss,
                     HAS_DSTREAM: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     IS_RMS: tl.constexpr, CHUNKED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``ds`` of rows ``[pid * rows_per_program, ...)`` and their partial dweight/dbias sums.

    Grid ``(programs, column chunks)``; without ``CHUNKED`` one chunk holds the whole row and
    the row coefficients are computed here, else they come from :func:`_coef_kernel`.
    """
    CD: tl.constexpr = RSTD.dtype.element_ty
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dw = tl.zeros([BLOCK_N], dtype=CD)
    db = tl.zeros([BLOCK_N], dtype=CD)
    first = pid.to(tl.int64) * rows_per_program
    for offset in range(0, rows_per_program, BLOCK_M):
        rows = first + offset + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        xhat, g, dy, rstd, mask = _load_grad_terms(DY, S, W, MEAN, RSTD, rows, row_ok, cols, sdy, ss, N,
                                                   CD, HAS_WEIGHT, IS_RMS)
        if CHUNKED:
            c1 = tl.load(C1 + rows, mask=row_ok, other=0.0)
            c2 = tl.load(C2 + rows, mask=row_ok, other=0.0)
        else:
            c1 = tl.sum(g * xhat, axis=1) / N
            c2 = tl.sum(g, axis=1) / N
        inner = g - xhat * c1[:, None]
        if not IS_RMS:
            inner = inner - c2[:, None]
        ds = inner * rstd[:, None]
        if HAS_DSTREAM:
            ds += tl.load(DSTREAM + rows[:, None] * sdst + cols[None, :], mask=mask, other=0.0).to(CD)
        tl.store(DS + rows[:, None] * N + cols[None, :], _round(ds, DS.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            dw += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
    partial = pid.to(tl.int64) * N + cols
    if HAS_WEIGHT:
        tl.store(DW + partial, dw, mask=cols < N)
    if HAS_BIAS:
        tl.store(DB + partial, db, mask=cols < N)


@triton.jit
def _sum_partials_kernel(P, OUT, programs, N, BLOCK_N: tl.constexpr):
    """``OUT[j] = sum_p P[p, j]``, adding the programs' partials in order: deterministic."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=OUT.dtype.element_ty)
    ptrs = P + cols  # advanced by whole rows: pointer arithmetic is 64-bit
    for _ in range(0, programs):
        acc += tl.load(ptrs, mask=cols < N, other=0.0)
        ptrs += N
    tl.store(OUT + cols, acc, mask=cols < N)


# --------------------------------------------------------------------------- launchers

def _config(n: int, device: torch.device) -> tuple[int, int, int, bool]:
    """``(BLOCK_M, BLOCK_N, num_warps, chunked)`` for rows of ``n`` features (module docstring)."""
    chunked = n > MAX_FUSED_N
    block_n = CHUNK_N if chunked else triton.next_power_of_2(n)
    tile, max_m = (TILE_ELEMS, MAX_BLOCK_M) if device.type == "cuda" else (
        INTERPRETER_TILE_ELEMS, INTERPRETER_MAX_BLOCK_M)
    block_m = 1 if chunked else max(1, min(max_m, tile // block_n))
    num_warps = max(1, min(32, block_m * block_n // (32 * ELEMS_PER_THREAD)))
    return block_m, block_n, triton.next_power_of_2(num_warps), chunked


def _backward_programs(m: int, num_warps: int, device: torch.device) -> int:
    if device.type == "cuda":
        per_sm = max(1, 32 // num_warps)
        return min(m, torch.cuda.get_device_properties(device).multi_processor_count * per_sm)
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


def forward(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    residual_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """:func:`addnorm.reference.forward`, fused: one read of the inputs, one write of the outputs."""
    x, residual = _rows(x), _rows(residual)
    m, n = x.shape
    sd = reference.stream_dtype(x, residual, residual_dtype)
    cd = reference.stats_dtype(sd)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    s = torch.empty((m, n), dtype=sd, device=x.device) if residual is not None else None
    mean = None if rms else torch.empty((m,), dtype=cd, device=x.device)
    rstd = torch.empty((m,), dtype=cd, device=x.device)
    if m == 0:
        return y, s, mean, rstd
    block_m, block_n, num_warps, chunked = _config(n, x.device)
    with _device(x):
        _forward_kernel[(triton.cdiv(m, block_m),)](
            x, residual, _rows(weight), _rows(bias), y, s, mean, rstd, m, n,
            x.stride(0), residual.stride(0) if residual is not None else 0, eps,
            HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            IS_RMS=rms, CHUNKED=chunked, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    return y, s, mean, rstd


def _sum_partials(partials: Tensor) -> Tensor:
    programs, n = partials.shape
    if programs == 1:
        return partials[0]
    out = torch.empty((n,), dtype=partials.dtype, device=partials.device)
    block_n = min(triton.next_power_of_2(n), 1024)
    _sum_partials_kernel[(triton.cdiv(n, block_n),)](partials, out, programs, n, BLOCK_N=block_n, num_warps=4)
    return out


def backward(
    dy: Tensor,
    dstream: Tensor | None,
    s: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    has_bias: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """:func:`addnorm.reference.backward`, fused, with deterministic dweight/dbias."""
    with _device(s):
        return _backward(_rows(dy), _rows(dstream), _rows(s), _rows(weight), mean, rstd, has_bias)


def _backward(dy, dstream, s, weight, mean, rstd, has_bias):
    m, n = s.shape
    cd = rstd.dtype
    ds = torch.empty((m, n), dtype=s.dtype, device=s.device)
    if m == 0:
        zeros = torch.zeros((n,), dtype=cd, device=s.device)
        return ds, (zeros if weight is not None else None), (zeros.clone() if has_bias else None)
    block_m, block_n, num_warps, chunked = _config(n, s.device)
    c1 = c2 = None
    if chunked:
        c1 = torch.empty((m,), dtype=cd, device=s.device)
        c2 = torch.empty((m,), dtype=cd, device=s.device)
        _coef_kernel[(triton.cdiv(m, block_m),)](
            dy, s, weight, mean, rstd, c1, c2, m, n, dy.stride(0), s.stride(0),
            HAS_WEIGHT=weight is not None, IS_RMS=mean is None, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps,
        )
    programs = _backward_programs(m, num_warps, s.device)
    rows_per_program = triton.cdiv(triton.cdiv(m, programs), block_m) * block_m
    programs = triton.cdiv(m, rows_per_program)
    dw = torch.empty((programs, n), dtype=cd, device=s.device) if weight is not None else None
    db = torch.empty((programs, n), dtype=cd, device=s.device) if has_bias else None
    _backward_kernel[(programs, triton.cdiv(n, block_n))](
        dy, dstream, s, weight, mean, rstd, c1, c2, ds, dw, db, m, n, rows_per_program,
        dy.stride(0), dstream.stride(0) if dstream is not None else 0, s.stride(0),
        HAS_DSTREAM=dstream is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=has_bias,
        IS_RMS=mean is None, CHUNKED=chunked, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    dweight = _sum_partials(dw) if dw is not None else None
    return ds, dweight, (_sum_partials(db) if db is not None else None)
