"""Fused CPU kernels (numba): the contract of :mod:`addnorm.reference`, one pass over memory.

Algorithm. Rows are split into ``chunks`` contiguous blocks, one per thread (``prange``).
Forward, per row: add the residual and round it to the stream dtype (written out as ``s``),
widen it into a per-chunk buffer of the statistics dtype, then two passes over that buffer
while it sits in L1/L2 (mean, then the mean of squared deviations: never E[s^2]-E[s]^2),
then the output. Backward, per row: ``xhat`` and ``g = dy * weight`` into buffers, the two
row sums, then ``ds`` (plus the stream's own gradient) in one pass. ``dweight``/``dbias``
accumulate into one partial row per chunk, summed in chunk order afterwards: bit-identical
from run to run for the same thread count.

Why it is exact enough: no fastmath. Row sums use 8 interleaved accumulators (the compiler
may then vectorize them without reassociating) so a 65536-wide fp32 row keeps torch's accuracy.

Dtypes. Statistics and arithmetic are float32 (float64 for float64 streams). numba has no
bfloat16/float16, so tensors travel as their 16-bit patterns: bfloat16 as ``uint16`` and
float16 as ``int16``; they are widened to float32 and rounded back to nearest-even here.

Threads: ``torch.get_num_threads()``, passed to numba outside the compiled code (asking numba
for its thread count inside a cached kernel would disable the cache). numba's thread pool is
its "workqueue" layer unless ``NUMBA_THREADING_LAYER`` says otherwise: its OpenMP layer brings
a second OpenMP runtime whose spinning threads starve torch's (we measured torch's own 64x256
add+layer_norm going from 0.02 ms to 24 ms after one numba call). workqueue does not allow
concurrent launches, so launches are serialized by a lock. Compiled code is cached
on disk (``NUMBA_CACHE_DIR`` or numba's defaults); without a writable cache directory the
kernels still work, compiled once per process.
"""

from __future__ import annotations

import os
import threading
import warnings

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic, overload
from torch import Tensor

from .. import reference

# forward() accepts out=/residual_out= buffers and writes the results straight into them.
WRITES_OUT = True

if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"
_LAUNCH = threading.Lock()

_SUPPORTED = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def unavailable_reason(x: Tensor | None) -> str | None:
    """Why these kernels cannot run on ``x`` (None: they can)."""
    if x is None:
        return None
    if x.device.type != "cpu":
        return f"tensor on {x.device}, the numba kernels run on CPU only"
    if x.dtype not in _SUPPORTED:
        return f"dtype {x.dtype} not supported (float32, float64, bfloat16, float16)"
    return None


def _jit(fn):
    try:
        return numba.njit(parallel=True, cache=True)(fn)
    except RuntimeError as err:  # no writable cache directory: compile per process instead
        warnings.warn(f"addnorm: numba cache unavailable ({err}); kernels compile on first use",
                      RuntimeWarning, stacklevel=2)
        return numba.njit(parallel=True)(fn)


# --------------------------------------------------------------------------- 16-bit floats

@intrinsic
def _f32_from_bits(typingctx, bits):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _bits_from_f32(typingctx, value):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _f32_from_half(typingctx, bits):
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.int16), codegen


@intrinsic
def _half_from_f32(typingctx, value):
    def codegen(context, builder, sig, args):  # fptrunc rounds to nearest-even
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.int16(types.float32), codegen


def _bf16_bits(v):
    """float32 -> bfloat16 bits, round to nearest-even, NaN stays a quiet NaN (as torch)."""
    if v != v:
        return np.uint16(0x7FC0)
    b = _bits_from_f32(np.float32(v))
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


_bf16_bits_jit = numba.njit(_bf16_bits)


def _load(a, i, j):
    """Element ``a[i, j]`` widened to float32 (kept float64 for float64 arrays)."""


def _store(a, i, j, v):
    """Write ``v`` to ``a[i, j]`` rounded to nearest-even in ``a``'s dtype."""


def _round(a, v):
    """``v`` rounded to the dtype of ``a`` and widened back (the value a store then load gives)."""


@overload(_load)
def _load_impl(a, i, j):
    if a.dtype == types.uint16:
        return lambda a, i, j: _f32_from_bits(np.uint32(a[i, j]) << np.uint32(16))
    if a.dtype == types.int16:
        return lambda a, i, j: _f32_from_half(a[i, j])
    return lambda a, i, j: a[i, j]


@overload(_store)
def _store_impl(a, i, j, v):
    if a.dtype == types.uint16:
        def store_bf16(a, i, j, v):
            a[i, j] = _bf16_bits_jit(v)
        return store_bf16
    if a.dtype == types.int16:
        def store_half(a, i, j, v):
            a[i, j] = _half_from_f32(np.float32(v))
        return store_half
    def store(a, i, j, v):
        a[i, j] = v
    return store


@overload(_round)
def _round_impl(a, v):
    if a.dtype == types.uint16:
        return lambda a, v: _f32_from_bits(np.uint32(_bf16_bits_jit(v)) << np.uint32(16))
    if a.dtype == types.int16:
        return lambda a, v: _f32_from_half(_half_from_f32(np.float32(v)))
    if a.dtype == types.float32:
        return lambda a, v: np.float32(v)
    return lambda a, v: np.float64(v)


# --------------------------------------------------------------------------- row sums

@numba.njit
def _sum(a, b, shift, mode):
    """Row sum of ``a`` (mode 0), ``(a - shift)**2`` (mode 1) or ``a * b`` (mode 2), in 8
    interleaved lanes added in a fixed order (``mode`` is a constant once inlined)."""
    n = a.shape[0]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = shift - shift
    for j in range(0, n - n % 8, 8):
        if mode == 0:
            s0 += a[j]
            s1 += a[j + 1]
            s2 += a[j + 2]
            s3 += a[j + 3]
            s4 += a[j + 4]
            s5 += a[j + 5]
            s6 += a[j + 6]
            s7 += a[j + 7]
        elif mode == 1:
            s0 += (a[j] - shift) * (a[j] - shift)
            s1 += (a[j + 1] - shift) * (a[j + 1] - shift)
            s2 += (a[j + 2] - shift) * (a[j + 2] - shift)
            s3 += (a[j + 3] - shift) * (a[j + 3] - shift)
            s4 += (a[j + 4] - shift) * (a[j + 4] - shift)
            s5 += (a[j + 5] - shift) * (a[j + 5] - shift)
            s6 += (a[j + 6] - shift) * (a[j + 6] - shift)
            s7 += (a[j + 7] - shift) * (a[j + 7] - shift)
        else:
            s0 += a[j] * b[j]
            s1 += a[j + 1] * b[j + 1]
            s2 += a[j + 2] * b[j + 2]
            s3 += a[j + 3] * b[j + 3]
            s4 += a[j + 4] * b[j + 4]
            s5 += a[j + 5] * b[j + 5]
            s6 += a[j + 6] * b[j + 6]
            s7 += a[j + 7] * b[j + 7]
    for j in range(n - n % 8, n):
        if mode == 0:
            s0 += a[j]
        elif mode == 1:
            s0 += (a[j] - shift) * (a[j] - shift)
        else:
            s0 += a[j] * b[j]
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


# --------------------------------------------------------------------------- kernels

def _forward_kernel(x, r, w, b, eps, nf, has_residual, rms, y, s, mean, rstd, chunks):
    m, n = x.shape
    zero = nf - nf
    for c in prange(chunks):
        buf = np.empty(n, w.dtype)
        for i in range(c * m // chunks, (c + 1) * m // chunks):
            if has_residual:  # s = x + residual, each rounded to the stream dtype as torch does
                for j in range(n):
                    v = _round(s, _round(s, _load(x, i, j)) + _round(s, _load(r, i, j)))
                    _store(s, i, j, v)
                    buf[j] = v
            else:
                for j in range(n):
                    buf[j] = _load(x, i, j)
            mu = zero if rms else _sum(buf, buf, zero, 0) / nf
            rs = (nf / nf) / np.sqrt(_sum(buf, buf, mu, 1) / nf + eps)
            for j in range(n):
                _store(y, i, j, (buf[j] - mu) * rs * w[j] + b[j])
            if not rms:
                mean[i] = mu
            rstd[i] = rs


def _backward_kernel(dy, dstream, s, w, mean, rstd, nf, has_dstream, rms, ds, dw_part, db_part, chunks):
    m, n = s.shape
    zero = nf - nf
    for c in prange(chunks):
        xhat = np.empty(n, w.dtype)
        g = np.empty(n, w.dtype)
        dw = dw_part[c]
        db = db_part[c]
        for i in range(c * m // chunks, (c + 1) * m // chunks):
            mu = zero if rms else mean[i]
            rs = rstd[i]
            for j in range(n):
                d = _round(w, _load(dy, i, j))
                xh = (_load(s, i, j) - mu) * rs
                xhat[j] = xh
                g[j] = d * w[j]
                dw[j] += d * xh
                db[j] += d
            mgx = _sum(g, xhat, zero, 2) / nf
            mg = zero if rms else _sum(g, g, zero, 0) / nf
            for j in range(n):
                v = (g[j] - xhat[j] * mgx - mg) * rs
                if has_dstream:
                    v += _load(dstream, i, j)
                _store(ds, i, j, v)


_forward_jit = _jit(_forward_kernel)
_backward_jit = _jit(_backward_kernel)


# --------------------------------------------------------------------------- launchers

def _array(t: Tensor) -> np.ndarray:
    """A numpy view of the contiguous CPU tensor ``t`` (16-bit floats as their bit patterns)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy()
    return t.numpy()


def _chunks(rows: int) -> int:
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(threads)
    return min(rows, threads)


def _param(p: Tensor | None, n: int, cd: torch.dtype, fill: float) -> np.ndarray:
    if p is None:
        return np.full(n, fill, dtype=np.float64 if cd == torch.float64 else np.float32)
    return p.detach().to(cd).contiguous().numpy()


def forward(x, residual, weight, bias, eps, rms, residual_dtype, *, out=None, residual_out=None):
    """:func:`addnorm.reference.forward`; ``y`` and ``s`` are written into the contiguous
    ``out``/``residual_out`` when given (no allocation: see ``docs/benchmarks.md``)."""
    m, n = x.shape
    sd = reference.stream_dtype(x, residual, residual_dtype)
    cd = reference.stats_dtype(sd)
    y_dtype = x.dtype
    if residual is not None and (x.dtype != sd or residual.dtype != sd):
        # mixed dtypes (e.g. bf16 x, fp32 stream): cast first, as the reference does, so that one
        # compiled kernel per dtype serves; y then goes through the statistics dtype
        x, residual = x.to(sd), residual.to(sd)
    x = x.contiguous()
    direct = x.dtype == y_dtype  # else y is computed in the statistics dtype, then cast once
    y = out if out is not None and direct else torch.empty((m, n), dtype=y_dtype if direct else cd)
    s = None
    if residual is not None:
        s = residual_out if residual_out is not None else torch.empty((m, n), dtype=sd)
    mean = torch.empty(m, dtype=cd)
    rstd = torch.empty(m, dtype=cd)
    if m:
        r = residual.contiguous() if residual is not None else x
        npd = np.float64 if cd == torch.float64 else np.float32
        with _LAUNCH:
            _forward_jit(_array(x), _array(r), _param(weight, n, cd, 1.0), _param(bias, n, cd, 0.0),
                         npd(eps), npd(n), residual is not None, rms, _array(y),
                         _array(s if s is not None else y), _array(mean), _array(rstd), _chunks(m))
    if y.dtype != y_dtype:
        y = out.copy_(y) if out is not None else y.to(y_dtype)
    return y, s, (None if rms else mean), rstd


def backward(dy, dstream, s, weight, mean, rstd, has_bias):
    """:func:`addnorm.reference.backward` in one fused pass over the rows."""
    m, n = s.shape
    cd = rstd.dtype
    # a gradient of another dtype than s is cast to the statistics dtype first (as the reference)
    dy, dstream = (t if t is None or t.dtype == s.dtype else t.to(cd) for t in (dy, dstream))
    s = s.contiguous()
    ds = torch.empty((m, n), dtype=s.dtype)
    chunks = _chunks(m) if m else 1
    dw_part = torch.zeros((chunks, n), dtype=cd)
    db_part = torch.zeros((chunks, n), dtype=cd)
    if m:
        dst = dstream.contiguous() if dstream is not None else s
        with _LAUNCH:
            _backward_jit(_array(dy.contiguous()), _array(dst), _array(s), _param(weight, n, cd, 1.0),
                          _array(mean if mean is not None else rstd), _array(rstd), rstd.numpy().dtype.type(n),
                          dstream is not None, mean is None, _array(ds), _array(dw_part), _array(db_part),
                          chunks)
    # sum the per-chunk partial rows in chunk order: deterministic for a given thread count
    dweight, dbias = dw_part[0].clone(), db_part[0].clone()
    for k in range(1, chunks):
        dweight += dw_part[k]
        dbias += db_part[k]
    return ds, (dweight if weight is not None else None), (dbias if has_bias else None)
