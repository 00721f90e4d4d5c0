"""Fused CPU kernels (numba): the contract of :mod:`addnorm.reference`, one pass over memory.

Algorithm. Rows are split into contiguous blocks (BLOCKS_PER_THREAD per thread); the threads
claim blocks from an atomic counter and run a compiled, GIL-free row loop on each. Forward, per
row: add the residual and round it to the stream dtype (written out as ``s``, unless post-norm
needs no ``s``), the row in the statistics dtype (``x`` or ``s`` itself
when already in it, else widened into a buffer), then passes over it while it sits in L1/L2
(the mean, corrected by the mean of the centered row, then the mean of squared
deviations: never E[s^2]-E[s]^2; a row whose sum of squares overflows is scaled by a power of
two and done again), then the output. Backward, per row: the row sums (of ``s - mean``, whose
mean re-centres the row about the rounded saved mean as the forward centred it, of
``g = dy * weight`` and of ``g * xhat``) in one pass, then ``ds`` (plus the stream's own
gradient) and the row's share of ``dweight``/``dbias`` in another, ``xhat`` and ``g`` recomputed
rather than stored (and ``s`` itself recomputed from ``x`` and ``residual`` for post-norm: see
CAPABILITIES).
``dweight``/``dbias`` accumulate into one partial row per block (not per thread, so the result
does not depend on which thread ran which block), summed in block order afterwards:
bit-identical from run to run for the same thread count. A call of one block (small inputs)
rounds its sums into the parameters' dtype itself.

Threads. The blocks run on torch's own OpenMP team (``GOMP_parallel`` of the libgomp torch
loaded), whose threads are awake and pinned after torch's previous op; elsewhere (another
OpenMP, a forked child) on this thread plus a small Python pool. What the threads run is a C
entry point (a numba ``cfunc`` per dtype combination) reading the call's arguments from one
block of int64 slots: no Python, and no GIL, between the threads. Claiming blocks instead of
fixing one per thread matters on shared machines: a thread that starts late (descheduled,
still spinning down from torch's last op) takes fewer blocks instead of holding the others up.
Why not ``@njit(parallel=True)``: its thread pool is a second pool beside torch's, whose
spinning threads starved torch's own ops, or (workqueue layer) woke two threads per call
(docs/benchmarks.md, "Dispatch, threads, compile time, warm start"). A hand-off to other threads
still costs several µs, so inputs below PARALLEL_MIN_ELEMENTS stay on the calling thread.

Accuracy: no fastmath except reassociation inside the row sums (so they vectorize; the
partial sums are then shorter, and a 65536-wide fp32 row keeps torch's accuracy). The order is
fixed by the compiled code: run-to-run deterministic on a machine, not across CPU generations.

Dtypes. Statistics and arithmetic are float32 (float64 for float64 streams). numba has no
bfloat16/float16, so tensors travel as their 16-bit patterns: bfloat16 as ``uint16`` and
float16 as ``int16``; they are widened to float32 and rounded back to nearest-even here.

Compiled code is cached on disk (``NUMBA_CACHE_DIR`` or numba's defaults: next to this file,
else a user cache directory), so a second process starts warm; without any writable cache
directory the kernels still work, compiled once per process.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import struct
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from torch import Tensor

from .. import reference
from ..backend import Capabilities, Grads, check_s_parts

# Post-norm training saves x and residual, and backward recomputes s = x + residual as it reads
# them (addnorm.ops.plan): the forward writes y alone, not s and y. Same bytes over forward +
# backward, one fresh output fewer, and fresh outputs are what cost most here (see
# docs/benchmarks.md, "Fresh outputs").
CAPABILITIES = Capabilities(device_types=("cpu",), recomputes_stream=True)

# Below this many elements one thread does the whole call: waking the other threads costs more
# than they save (`python benchmarks/cpu_threads.py`; docs/benchmarks.md, "Dispatch, threads").
# Results never depend on it: each row is computed the same way on any thread.
PARALLEL_MIN_ELEMENTS = 1 << 16
# Rows are split into this many blocks per thread, claimed one at a time: a late thread costs
# at most its share of blocks, and dweight/dbias keep one partial row per block.
BLOCKS_PER_THREAD = 8
_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (pid that made it, pool)


def unavailable_reason(x: Tensor | None) -> str | None:
    return None  # numba is a dependency of addnorm; the device is checked against CAPABILITIES


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


@intrinsic
def _claim(typingctx, counters, k):
    """Atomically add 1 to ``counters[k]`` (an int64 array) and return its previous value."""

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]])
        return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "seq_cst")

    return types.int64(counters, types.intp), codegen


@intrinsic
def _read(typingctx, counters, k):
    """Atomic load of ``counters[k]``: a value another thread is updating."""

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]])
        return builder.load_atomic(ptr, "seq_cst", 8)

    return types.int64(counters, types.intp), codegen


def _bf16_bits(v):
    """float32 -> bfloat16 bits, round to nearest-even, NaN stays a quiet NaN (as torch)."""
    if v != v:
        return np.uint16(0x7FC0)
    b = _bits_from_f32(np.float32(v))
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


_bf16_bits_jit = numba.njit(_bf16_bits)


def _load(a, j):
    """Element ``a[j]`` of a row widened to float32 (kept float64 for float64 rows)."""


def _put(a, j, v):
    """Write ``v`` to ``a[j]`` rounded to nearest-even in ``a``'s dtype; return that rounded
    value widened back (what a load of ``a[j]`` now gives)."""


def _round(a, v):
    """``v`` rounded to the dtype of ``a`` and widened back (what ``_put`` would return)."""


@overload(_load)
def _load_impl(a, j):
    if a.dtype == types.uint16:
        return lambda a, j: _f32_from_bits(np.uint32(a[j]) << np.uint32(16))
    if a.dtype == types.int16:
        return lambda a, j: _f32_from_half(a[j])
    return lambda a, j: a[j]


@overload(_put)
def _put_impl(a, j, v):
    if a.dtype == types.uint16:

        def put_bf16(a, j, v):
            bits = _bf16_bits_jit(v)
            a[j] = bits
            return _f32_from_bits(np.uint32(bits) << np.uint32(16))

        return put_bf16
    if a.dtype == types.int16:

        def put_half(a, j, v):
            bits = _half_from_f32(np.float32(v))
            a[j] = bits
            return _f32_from_half(bits)

        return put_half

    def put(a, j, v):
        a[j] = v
        return a[j]

    return put


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

# Only these row sums may be reassociated (so that they vectorize, and no less accurate, as the
# partial sums are shorter); no other fastmath flag.
_SUM_MATH = {"reassoc"}


# The row sum behind the first mean adds blocks of this many elements in lanes, then the blocks'
# sums in float64: summed in lanes alone, a float32 row of 20000 values at 3e7 had its mean off
# by 50 ulps, and the correction of that mean, itself rounded, off by 2e-6 of the row's spread.
_SUM_BLOCK = 1024


@numba.njit(fastmath=_SUM_MATH)
def _sum(a):
    n = a.shape[0]
    total = np.float64(0.0)
    for lo in range(0, n, _SUM_BLOCK):
        block = a[lo : min(lo + _SUM_BLOCK, n)]  # a slice: a loop over an index range did not vectorize
        part = block[0]  # not block[0] - block[0] as a typed zero: that is NaN when block[0] is inf
        for j in range(1, block.shape[0]):
            part += block[j]
        total += part
    return _round(a, total)


@numba.njit(fastmath=_SUM_MATH)
def _sums_dev(a, mu):
    """Sum of ``d = a - mu`` and of ``d * d`` in one pass."""
    total = sq = mu - mu
    for j in range(a.shape[0]):
        d = a[j] - mu
        total += d
        sq += d * d
    return total, sq


@numba.njit(fastmath=_SUM_MATH)
def _dot(a, b):
    total = a[0] * b[0]
    for j in range(1, a.shape[0]):
        total += a[j] * b[j]
    return total


@numba.njit(fastmath=_SUM_MATH)
def _load_row(xi, ri, si, buf, has_residual, write_s, rms):
    """``buf`` = the row of ``s`` in the statistics dtype: ``x + residual`` rounded to the stream
    dtype (both already in it), written to ``si`` when ``write_s``; else ``x``. Returns the sum of
    the row (of its squares for RMSNorm), taken in the same pass."""
    total = _round(buf, 0.0)
    for j in range(buf.shape[0]):
        if has_residual:
            v = _load(xi, j) + _load(ri, j)
            v = _put(si, j, v) if write_s else _round(si, v)
        else:
            v = _load(xi, j)
        buf[j] = v
        total += v * v if rms else v
    return total


@numba.njit
def _add_rows(xi, ri, si):
    """``si = xi + ri``, all three in the statistics dtype."""
    for j in range(si.shape[0]):
        si[j] = xi[j] + ri[j]


@numba.njit
def _row_scale(a, k):
    """:func:`addnorm.reference.row_scale`: the power of two ``k <= 1`` with ``max|a * k| < 1``
    (statistics on ``a * k`` cannot overflow; the scaling is exact, so rows that need no
    scaling get the same results either way). Returned in the row's dtype through the
    one-element array ``k``."""
    amax = abs(a[0])
    for j in range(a.shape[0]):
        amax = max(amax, abs(a[j]))
    _, e = math.frexp(amax)
    top = 126 if k.itemsize == 4 else 1022  # k stays a normal number, as the reference
    k[0] = math.ldexp(1.0, -min(max(e, 0), top)) if math.isfinite(amax) else 1.0  # inf/nan: 1
    return k[0]


@numba.njit  # not _SUM_MATH: reassociation would turn (a - mu) - c into a - (mu + c), rounded
def _sq_corrected(a, mu, c):
    """Sum of ``((a - mu) - c)**2``, the squared deviations from the corrected mean, summed
    pairwise: such a row is often a few large squares among many tiny ones, which added one by
    one to a large partial sum would round away (as torch's cascade sum in the reference, the
    error grows with log N)."""
    n = a.shape[0]
    t = np.empty(n, a.dtype)  # rare rows only (see _centred_stats)
    for j in range(n):
        d = (a[j] - mu) - c
        t[j] = d * d
    while n > 1:
        half = n // 2
        for j in range(half):  # writes t[j], reads t[2j], t[2j + 1]: never a value already replaced
            t[j] = t[2 * j] + t[2 * j + 1]
        if n % 2:
            t[half] = t[n - 1]
            half += 1
        n = half
    return t[0]


_CANCEL = reference.CANCEL  # a third pass once c*c exceeds mean(d*d) / _CANCEL


@numba.njit
def _centred_stats(row, total, nf):
    """``(mu, c, var)`` of a row whose sum is ``total``: var of the deviations from ``mu + c``.

    The mean is off by its rounding error; the mean of the centred row measures it (``c``,
    subtracted separately): exact centring, as the reference, for constant rows and rows far
    from zero. The variance of the corrected deviations ``d - c`` is then ``mean(d*d) - c*c``,
    except where ``c*c`` is not small beside ``mean(d*d)`` (a near-constant row far from zero,
    spread over a few ulps of its mean): that difference would cancel, so a third pass over the
    row (in cache) squares ``d - c`` itself, as the reference does.
    """
    mu = total / nf
    dev, sq = _sums_dev(row, mu)
    c = dev / nf
    if c * c * _CANCEL > sq / nf:
        return mu, c, _sq_corrected(row, mu, c) / nf
    return mu, c, max(sq / nf - c * c, nf - nf)


@numba.njit
def _stats(buf, nf, rms):
    """``(mu, c, var)`` of a row: var of the deviations from ``mu + c`` (:func:`_centred_stats`)."""
    if rms:
        return nf - nf, nf - nf, _dot(buf, buf) / nf
    return _centred_stats(buf, _sum(buf), nf)


# --------------------------------------------------------------------------- the sublayer branch

# reference.mask_hash in 32-bit lanes: an LLVM intrinsic, so that the loop over a row vectorizes
# with 32-bit multiplies (numba would widen every integer operation to 64 bits)
_M32 = np.uint64(0xFFFFFFFF)
_GOLDEN = np.uint64(reference._GOLDEN)
_U32 = np.uint64(32)


def _fmix32_codegen(combine):
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        h = combine(builder, args[0], args[1])
        for shift, factor in ((16, reference._FMIX[0]), (13, reference._FMIX[1]), (16, None)):
            h = builder.xor(h, builder.lshr(h, ir.Constant(i32, shift)))
            if factor is not None:
                h = builder.mul(h, ir.Constant(i32, factor - (1 << 32)))  # the same bits, as a signed i32
        return h

    return codegen


@intrinsic
def _fmix32_xor(typingctx, a, b):
    """``fmix32(a ^ b)`` of two uint32 values (reference.fmix32)."""
    return types.uint32(types.uint32, types.uint32), _fmix32_codegen(lambda bld, a, b: bld.xor(a, b))


@intrinsic
def _fmix32_add(typingctx, a, b):
    """``fmix32(a + b mod 2**32)`` of two uint32 values."""
    return types.uint32(types.uint32, types.uint32), _fmix32_codegen(lambda bld, a, b: bld.add(a, b))


def _branch_keys(br, n):
    """None without a branch; else ``(k0, k1, threshold, scale, layer_scale, rowscale, col_keys,
    layer_scaled)`` from ``br = (seed, threshold, scale, layer_scale, rowscale, layer_scaled)``,
    the column keys of :func:`addnorm.reference.mask_hash` computed once per thread."""


@overload(_branch_keys)
def _branch_keys_impl(br, n):
    if isinstance(br, types.NoneType):
        return lambda br, n: None

    def keys(br, n):
        seed, threshold, scale, layer_scale, rowscale, layer_scaled = br
        k0, k1 = np.uint64(seed) & _M32, (np.uint64(seed) >> _U32) & _M32
        k0, k1, k0g = np.uint32(k0), np.uint32(k1), np.uint32(k0 ^ _GOLDEN)
        cols = np.empty(n, np.uint32)
        for j in range(n):
            cols[j] = _fmix32_add(_fmix32_xor(np.uint32(j), k1), k0g)
        # p = 1 (threshold 2**32) has scale 0: the gate is 0 whatever the 32-bit comparison says
        return k0, k1, np.uint32(min(threshold, 0xFFFFFFFF)), scale, layer_scale, rowscale, cols, layer_scaled

    return keys


@numba.njit
def _branch_row(xi, ri, sbuf, gates, bk, row):
    """``sbuf`` = the stream of row ``row`` (its index in the call) through the branch, rounded to
    the residual's dtype, in the statistics dtype: :func:`addnorm.reference.stream` with
    :func:`addnorm.reference.branch_terms`, bit for bit. ``gates[0]`` gets ``keep ? scale : 0``
    and ``gates[1]`` the factor of ``x``, that times the layer scale. (Two loops, the integer
    one and the float one, each of which vectorizes.)"""
    k0, k1, threshold, scale, layer_scale, rowscale, cols, _ = bk
    a = _fmix32_add(_fmix32_xor(np.uint32(row), k0), k1)
    zero = scale - scale
    gate, factor = gates[0], gates[1]
    for j in range(sbuf.shape[0]):
        g = scale if _fmix32_add(a, cols[j]) >= threshold else zero
        gate[j] = g
        factor[j] = g * layer_scale[j]
    rs = rowscale[row]
    for j in range(sbuf.shape[0]):
        sbuf[j] = _round(ri, _load(ri, j) + _load(xi, j) * factor[j] * rs)


@numba.njit
def _forward_rows(
    x, r, w, b, eps, nf, has_residual, write_s, write_stats, rms, y, s, mean, rstd, buf, kbuf, direct, bk, first, gates
):
    """``direct``: None for 16-bit rows, whose x and s are never in the statistics dtype (a type:
    the branches below that use x or s directly are then pruned when compiling; left in, they
    kept the widening loop from vectorizing). ``bk``: the branch's keys (None without one),
    ``first`` the index of the first row in the call."""
    n = buf.shape[0]
    one = nf / nf
    for i in range(x.shape[0]):
        # the row in the statistics dtype and its sum (of squares for RMSNorm): 16-bit rows are
        # widened into buf, summed as they are; others are x or s itself (nothing copied: a store
        # per element fewer), or buf = x + residual, summed after, so that every path (plain,
        # pre-norm, post-norm) sums its row the same way
        if bk is not None:
            row = buf
            _branch_row(x[i], r[i], buf, gates, bk, first + i)
            if write_s:
                si = s[i]
                for j in range(n):
                    _put(si, j, buf[j])
            total = _dot(row, row) if rms else _sum(row)
        elif direct is None:
            row = buf
            total = _load_row(x[i], r[i], s[i], buf, has_residual, write_s, rms)
        else:
            if not has_residual:
                row = x[i]
            elif write_s:
                row = s[i]
                _add_rows(x[i], r[i], row)
            else:
                row = buf
                _add_rows(x[i], r[i], row)
            total = _dot(row, row) if rms else _sum(row)
        k = one
        if rms:
            mu = c = nf - nf
            var = total / nf
        else:
            mu, c, var = _centred_stats(row, total, nf)
        if not np.isfinite(var):  # overflow (bf16 beyond ~1e19): again on the row times k <= 1
            k = _row_scale(row, kbuf)
            if k != one:
                for j in range(n):
                    buf[j] = row[j] * k
                row = buf
                mu, c, var = _stats(row, nf, rms)
        rs = one / np.sqrt(var + eps * k * k)  # rstd / k
        yi = y[i]
        for j in range(n):
            _put(yi, j, ((row[j] - mu) - c) * rs * _load(w, j) + _load(b, j))
        if write_stats:
            if not rms:
                mean[i] = (mu + c) / k
            rstd[i] = rs * k


def _stream_row(si, ri, sbuf):
    """``(row, residual)`` with ``_stream_at(row, residual, j)`` element ``j`` of the stream. When
    the saved row ``si`` is ``x`` (``ri`` the residual, see CAPABILITIES), the stream is the
    forward's ``x + residual``, rounded as the forward rounded it: bit for bit its ``s``. For
    16-bit rows it is recomputed once into ``sbuf`` (statistics dtype) rather than in each of the
    backward's two passes, where the add and its rounding cost more instructions than the rest of
    a pass; float32 and float64 rows add in place, in each pass, where the buffer measured slower
    (`python benchmarks/cpu_row_cost.py`; docs/benchmarks.md, "Row cost in cache")."""


def _stream_at(si, ri, j):
    """Element ``j`` of the stream: ``si[j]`` (``ri`` None), else ``si[j] + ri[j]`` rounded to the
    dtype of ``si``. (Choices by type, made when compiling: each case gets its own vectorized
    loops.)"""


def _part(a, index):
    """``a[index]``, or None when ``a`` is None."""


@overload(_stream_row)
def _stream_row_impl(si, ri, sbuf):
    if isinstance(ri, types.NoneType) or si.dtype == sbuf.dtype:
        return lambda si, ri, sbuf: (si, ri)

    def recompute(si, ri, sbuf):
        for j in range(sbuf.shape[0]):
            sbuf[j] = _round(si, _load(si, j) + _load(ri, j))
        return sbuf, None

    return recompute


@overload(_stream_at)
def _stream_at_impl(si, ri, j):
    if isinstance(ri, types.NoneType):
        return lambda si, ri, j: _load(si, j)
    return lambda si, ri, j: _round(si, _load(si, j) + _load(ri, j))


@overload(_part)
def _part_impl(a, index):
    if isinstance(a, types.NoneType):
        return lambda a, index: None
    return lambda a, index: a[index]


@numba.njit(fastmath=_SUM_MATH)
def _backward_sums(si, ri, dyi, w, k, mu, rs_k):
    """The row sums of ``d = s * k - mu``, of ``g = dy * weight`` and of ``g * d * rs_k``."""
    sum_d = sum_g = sum_gx = mu - mu
    for j in range(w.shape[0]):
        d = _stream_at(si, ri, j) * k - mu
        gj = _load(dyi, j) * _load(w, j)
        sum_d += d
        sum_g += gj
        sum_gx += gj * (d * rs_k)
    return sum_d, sum_g, sum_gx


# Below this rstd (a std beyond 1e18) s - mean may overflow in float32: backward then scales
# the row as the forward did. Above it the scaling would change nothing (it is exact).
_SCALE_BELOW_RSTD = 1e-18


@numba.njit
def _row_coefs(si, ri, dyi, w, mean, rstd, i, nf, rms, sbuf, kbuf):
    """``(k, mu, c, rs_k, mean(g * xhat), mean(g))`` of row ``i``, ``xhat = (s * k - mu - c) *
    rs_k``: ``mu`` the saved mean and ``c`` its correction, the mean of ``s * k - mu`` (the saved
    mean is rounded: see :func:`addnorm.reference.backward_rows`), both scaled by the row scale
    ``k`` as in the forward. The pass that sums ``g`` and ``g * (s * k - mu) * rs_k`` takes ``c``
    too, and ``sum(g * xhat) = sum(g * (s * k - mu) * rs_k) - c * rs_k * sum(g)``: no pass more.
    Rows with rstd below _SCALE_BELOW_RSTD are copied to ``sbuf`` to find ``k``."""
    zero = nf - nf
    rs = rstd[i]
    k = nf / nf
    if rs < _SCALE_BELOW_RSTD:
        for j in range(sbuf.shape[0]):  # (a copy onto itself when si is sbuf)
            sbuf[j] = _stream_at(si, ri, j)
        k = _row_scale(sbuf, kbuf)
    mu = zero if rms else mean[i] * k
    rs_k = rs / k
    sum_d, sum_g, sum_gx = _backward_sums(si, ri, dyi, w, k, mu, rs_k)
    c = zero if rms else sum_d / nf
    return k, mu, c, rs_k, (sum_gx - c * rs_k * sum_g) / nf, (zero if rms else sum_g / nf)


@numba.njit
def _backward_rows(dy, dstream, s, r, w, mean, rstd, nf, has_dstream, rms, ds, dw, db, sbuf, kbuf):
    """Two passes over each row while it sits in cache: the row sums, then ``dweight``,
    ``dbias`` and ``ds`` in one loop. ``xhat`` and ``g`` are recomputed in each (a multiply-add
    each) rather than stored to buffers by the first: fewer stores (docs/benchmarks.md, "Row cost
    in cache"). ``r``: None (``s`` is the stream), or the residual, ``s`` then being ``x`` (see
    _stream_row)."""
    for i in range(s.shape[0]):
        (si, ri), dyi, dsi = _stream_row(s[i], _part(r, i), sbuf), dy[i], ds[i]
        k, mu, c, rs_k, mgx, mg = _row_coefs(si, ri, dyi, w, mean, rstd, i, nf, rms, sbuf, kbuf)
        rs = rstd[i]
        # the same loop twice, so that each compiles to one vectorized loop
        if has_dstream:
            dsti = dstream[i]
            for j in range(w.shape[0]):
                dj = _load(dyi, j)
                xh = ((_stream_at(si, ri, j) * k - mu) - c) * rs_k
                dw[j] += dj * xh
                db[j] += dj
                _put(dsi, j, (dj * _load(w, j) - xh * mgx - mg) * rs + _load(dsti, j))
        else:
            for j in range(w.shape[0]):
                dj = _load(dyi, j)
                xh = ((_stream_at(si, ri, j) * k - mu) - c) * rs_k
                dw[j] += dj * xh
                db[j] += dj
                _put(dsi, j, (dj * _load(w, j) - xh * mgx - mg) * rs)


@numba.njit
def _backward_rows_branch(
    dy, dstream, x, r, w, mean, rstd, nf, has_dstream, rms, ds, dw, db, sbuf, kbuf, bk, first, gates, dx, dls
):
    """:func:`_backward_rows` through the branch: the stream and its gates recomputed into
    ``sbuf``/``gates`` (:func:`_branch_row`), then besides ``ds`` (the residual's gradient) ``dx``
    and the row's share of ``dlayer_scale``, as :func:`addnorm.reference.branch_backward`."""
    rowscale, layer_scaled = bk[5], bk[7]
    gate, factor = gates[0], gates[1]
    for i in range(x.shape[0]):
        xi, dyi, dsi, dxi = x[i], dy[i], ds[i], dx[i]
        _branch_row(xi, r[i], sbuf, gates, bk, first + i)
        k, mu, c, rs_k, mgx, mg = _row_coefs(sbuf, None, dyi, w, mean, rstd, i, nf, rms, sbuf, kbuf)
        rs, rsc = rstd[i], rowscale[first + i]
        # short loops over few rows each, so that each vectorizes: ds (and dweight, dbias) as
        # without a branch, then dx and dlayer_scale from ds as stored (as autograd reads it)
        if has_dstream:
            dsti = dstream[i]
            for j in range(w.shape[0]):
                dj = _load(dyi, j)
                xh = ((sbuf[j] * k - mu) - c) * rs_k
                dw[j] += dj * xh
                db[j] += dj
                _put(dsi, j, (dj * _load(w, j) - xh * mgx - mg) * rs + _load(dsti, j))
        else:
            for j in range(w.shape[0]):
                dj = _load(dyi, j)
                xh = ((sbuf[j] * k - mu) - c) * rs_k
                dw[j] += dj * xh
                db[j] += dj
                _put(dsi, j, (dj * _load(w, j) - xh * mgx - mg) * rs)
        for j in range(w.shape[0]):
            _put(dxi, j, _load(dsi, j) * factor[j] * rsc)
        if layer_scaled:  # (a row of ones stands in for a missing layer scale: no gradient to take)
            for j in range(w.shape[0]):
                dls[j] += _load(dsi, j) * (_load(xi, j) * gate[j] * rsc)


# The kernels: every calling thread claims blocks of ``block_rows`` rows from the shared counter
# ``sched[0]``, counts each block it finishes in ``sched[1]``, and returns once all are done
# (see _launch).


@numba.njit
def _claim_rows(sched, block_rows, m):
    """``(block, lo, hi)``: the next unclaimed block of rows, or block -1 when none is left."""
    blk = _claim(sched, 0)
    lo = blk * block_rows
    if lo >= m:
        return -1, m, m
    return blk, lo, min(m, lo + block_rows)


@numba.njit
def _wait_all(sched, block_rows, m):
    """Return once every block is done: the results are then complete, whether or not the other
    threads ever got a block."""
    blocks = (m + block_rows - 1) // block_rows
    while _read(sched, 1) < blocks:
        pass


@numba.njit(nogil=True, error_model="numpy")
def _forward_kernel(
    x, r, w, b, eps, nf, has_residual, write_s, write_stats, rms, y, s, mean, rstd, sched, block_rows, direct, br
):
    m, n = x.shape
    buf = np.empty(n, rstd.dtype)
    kbuf = np.empty(1, rstd.dtype)
    bk = _branch_keys(br, n)
    gates = np.empty((2, n if br is not None else 0), rstd.dtype)
    blk, lo, hi = _claim_rows(sched, block_rows, m)
    while blk >= 0:
        _forward_rows(
            x[lo:hi],
            r[lo:hi],
            w,
            b,
            eps,
            nf,
            has_residual,
            write_s,
            write_stats,
            rms,
            y[lo:hi],
            s[lo:hi],
            mean[lo:hi],
            rstd[lo:hi],
            buf,
            kbuf,
            direct,
            bk,
            lo,
            gates,
        )
        _claim(sched, 1)
        blk, lo, hi = _claim_rows(sched, block_rows, m)
    _wait_all(sched, block_rows, m)


@numba.njit(nogil=True, error_model="numpy")
def _backward_kernel(
    dy, dstream, s, r, w, mean, rstd, nf, has_dstream, rms, ds, dw, db, sched, block_rows, br, dx, dls
):
    """``dw``/``db`` (and ``dls``): one partial row per block (not per thread), so that the sums
    do not depend on which thread ran which block."""
    m, n = s.shape
    sbuf = np.empty(n, rstd.dtype)
    kbuf = np.empty(1, rstd.dtype)
    bk = _branch_keys(br, n)
    gates = np.empty((2, n if br is not None else 0), rstd.dtype)
    blk, lo, hi = _claim_rows(sched, block_rows, m)
    while blk >= 0:
        dw[blk][:] = 0  # (scratch from torch.empty: zeros would cost a call each)
        db[blk][:] = 0
        if br is not None:  # an argument: the other branch is pruned when compiling
            dls[blk][:] = 0
            _backward_rows_branch(
                dy[lo:hi],
                dstream[lo:hi],
                s[lo:hi],
                _part(r, slice(lo, hi)),
                w,
                mean[lo:hi],
                rstd[lo:hi],
                nf,
                has_dstream,
                rms,
                ds[lo:hi],
                dw[blk],
                db[blk],
                sbuf,
                kbuf,
                bk,
                lo,
                gates,
                dx[lo:hi],
                dls[blk],
            )
        else:
            _backward_rows(
                dy[lo:hi],
                dstream[lo:hi],
                s[lo:hi],
                _part(r, slice(lo, hi)),
                w,
                mean[lo:hi],
                rstd[lo:hi],
                nf,
                has_dstream,
                rms,
                ds[lo:hi],
                dw[blk],
                db[blk],
                sbuf,
                kbuf,
            )
        _claim(sched, 1)
        blk, lo, hi = _claim_rows(sched, block_rows, m)
    _wait_all(sched, block_rows, m)


# --------------------------------------------------------------------------- C entry points

# One call's arguments travel as a block of int64 slots (tensor addresses, sizes, flags, eps as
# float64 bits; the last two slots are the block-claiming counters), read by a C entry point
# compiled per combination of dtypes. Threads run it with no Python in between: no GIL to hand
# from thread to thread and no unboxing of a dozen arguments by numba's dispatcher, which cost
# tens of µs per call.
_SLOTS = 25
_SCHED = _SLOTS - 2  # [next block to claim, blocks done]
_NO_BRANCH_SLOTS = (0,) * 6  # see _branch_slots
_FORWARD_PAD = (0,) * (_SLOTS - 13 - len(_NO_BRANCH_SLOTS))  # zeros up to and with the counters
_BACKWARD_PAD = (0,) * (_SLOTS - 17 - len(_NO_BRANCH_SLOTS))
_pack_slots = struct.Struct(f"{_SLOTS}q").pack_into  # (block, 0, *slots): fewer µs than a new array
_THREAD = threading.local()  # .block: this thread's argument block, reused by each of its calls


_NUMPY_DTYPES = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.bfloat16: np.uint16,
    torch.float16: np.int16,
}


@intrinsic
def _ptr(typingctx, address):
    """The int64 ``address`` as a pointer, for ``carray``."""

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(types.int64), codegen


def _compile_entry(fn):
    """``fn(block)`` compiled as a C function ``void fn(int64 *block)``, cached on disk."""
    sig = types.void(types.voidptr)
    try:
        return numba.cfunc(sig, cache=True)(fn)
    except RuntimeError as err:  # no writable cache directory: compile per process instead
        warnings.warn(
            f"addnorm: numba cache unavailable ({err}); kernels compile on first use", RuntimeWarning, stacklevel=3
        )
        return numba.cfunc(sig)(fn)


def _branch_slots(a, f, at, m, n, cd, branched):
    """The branch's arguments from slots ``at``.. (seed, keep threshold, scale as float64 bits,
    layer_scale and rowscale addresses, whether a layer scale was given) as ``_branch_keys``
    takes them; None (a constant, so the
    branch code is pruned when compiling) without a branch."""


@overload(_branch_slots)
def _branch_slots_impl(a, f, at, m, n, cd, branched):
    if isinstance(branched, types.NoneType):
        return lambda a, f, at, m, n, cd, branched: None

    def slots(a, f, at, m, n, cd, branched):
        return (
            a[at],
            a[at + 1],
            cd(f[at + 2]),
            carray(_ptr(a[at + 3]), n, cd),
            carray(_ptr(a[at + 4]), m, cd),
            a[at + 5] != 0,
        )

    return slots


def _forward_entry(sd, yd, pd, branched):
    """Slots: x, residual, weight, bias, y, s, mean, rstd, rows, cols, block_rows, flags (has_residual
    | write_s << 1 | rms << 2 | write_stats << 3), eps (float64 bits), then the branch's (see
    _branch_slots); ``sd``: the dtype of x, residual and s, ``yd`` that of y, ``pd`` that of weight
    and bias (numpy dtypes; 16-bit floats as uint16/int16); ``branched``: True, or None without a
    branch."""
    cd = np.float64 if sd == np.float64 else np.float32
    direct = True if sd == cd else None  # see _forward_rows

    def entry(block):
        a = carray(block, _SLOTS, np.int64)
        f = carray(block, _SLOTS, np.float64)
        m, n, flags = a[8], a[9], a[11]
        stats_rows = m if flags & 8 else 0
        _forward_kernel(
            carray(_ptr(a[0]), (m, n), sd),
            carray(_ptr(a[1]), (m, n), sd),
            carray(_ptr(a[2]), n, pd),
            carray(_ptr(a[3]), n, pd),
            cd(f[12]),
            cd(n),
            flags & 1 != 0,
            flags & 2 != 0,
            flags & 8 != 0,
            flags & 4 != 0,
            carray(_ptr(a[4]), (m, n), yd),
            carray(_ptr(a[5]), (m, n if flags & 2 else 0), sd),
            carray(_ptr(a[6]), stats_rows, cd),
            carray(_ptr(a[7]), stats_rows, cd),
            a[_SCHED:],
            a[10],
            direct,
            _branch_slots(a, f, 13, m, n, cd, branched),
        )

    return _compile_entry(entry)


def _backward_entry(sd, gd, td, pd, od, summed, branched):
    """Slots: dy, dstream, s (or x), weight, mean, rstd, ds, dweight, dbias, rows, cols,
    block_rows, flags (has_dstream | rms << 1), blocks, residual, dx, dlayer_scale blocks, then the
    branch's (see _branch_slots); ``sd``: the dtype of s and ds, ``gd`` of dy, ``td`` of dstream,
    ``pd`` of weight, ``od`` of dweight and dbias; ``summed``: the stream is recomputed as x +
    residual; ``branched``: True (the stream recomputed through the branch), or None.

    dweight and dbias: with one block (one thread), ``n`` values of ``od`` (or address 0: not
    wanted), summed here and rounded once; with several, one partial row per block in the
    statistics dtype, which the caller sums."""
    cd = np.float64 if sd == np.float64 else np.float32

    def entry(block):
        a = carray(block, _SLOTS, np.int64)
        f = carray(block, _SLOTS, np.float64)
        m, n, flags, blocks = a[9], a[10], a[12], a[13]
        r = carray(_ptr(a[14]), (m, n), sd) if summed else None  # pruned when compiling: a constant
        br = _branch_slots(a, f, 17, m, n, cd, branched)
        rows_dx = m if br is not None else 0
        single = blocks == 1
        dw = np.empty((1, n), cd) if single else carray(_ptr(a[7]), (blocks, n), cd)
        db = np.empty((1, n), cd) if single else carray(_ptr(a[8]), (blocks, n), cd)
        _backward_kernel(
            carray(_ptr(a[0]), (m, n), gd),
            carray(_ptr(a[1]), (m, n), td),
            carray(_ptr(a[2]), (m, n), sd),
            r,
            carray(_ptr(a[3]), n, pd),
            carray(_ptr(a[4]), m, cd),
            carray(_ptr(a[5]), m, cd),
            cd(n),
            flags & 1 != 0,
            flags & 2 != 0,
            carray(_ptr(a[6]), (m, n), sd),
            dw,
            db,
            a[_SCHED:],
            a[11],
            br,
            carray(_ptr(a[15]), (rows_dx, n), sd),
            carray(_ptr(a[16]), (blocks if br is not None else 0, n), cd),
        )
        if single:
            for at, sums in ((7, dw[0]), (8, db[0])):
                if a[at] != 0:
                    out = carray(_ptr(a[at]), n, od)
                    for j in range(n):
                        _put(out, j, sums[j])

    return _compile_entry(entry)


# compiled entries, made on first use: (stream, y, parameter dtypes, branched) and (s, dy,
# dstream, weight, weight gradient dtypes, summed, branched)
_FORWARD_ENTRIES: dict[tuple, object] = {}
_BACKWARD_ENTRIES: dict[tuple, object] = {}


def _forward_entry_for(sd: torch.dtype, yd: torch.dtype, pd: torch.dtype, branched: bool = False):
    key = (sd, yd, pd, branched)
    entry = _FORWARD_ENTRIES.get(key)
    if entry is None:
        dtypes = (_NUMPY_DTYPES[d] for d in (sd, yd, pd))
        entry = _FORWARD_ENTRIES[key] = _forward_entry(*dtypes, True if branched else None)
    return entry


def _backward_entry_for(
    sd: torch.dtype,
    gd: torch.dtype,
    td: torch.dtype,
    pd: torch.dtype,
    od: torch.dtype,
    summed: bool,
    branched: bool = False,
):
    key = (sd, gd, td, pd, od, summed, branched)
    entry = _BACKWARD_ENTRIES.get(key)
    if entry is None:
        dtypes = (_NUMPY_DTYPES[d] for d in (sd, gd, td, pd, od))
        entry = _BACKWARD_ENTRIES[key] = _backward_entry(*dtypes, summed, True if branched else None)
    return entry


_EPS_BITS: dict[float, int] = {}  # eps -> its float64 bits, for the argument block


def _eps_bits(eps: float) -> int:
    bits = _EPS_BITS.get(eps)
    if bits is None:
        bits = _EPS_BITS[eps] = int.from_bytes(struct.pack("<d", eps), "little", signed=True)
    return bits


# --------------------------------------------------------------------------- launchers


def _plan(rows: int, cols: int, max_blocks: int | None = None) -> tuple[int, int]:
    """``(threads, block_rows)`` for one call: torch's thread count (one for small inputs), and
    BLOCKS_PER_THREAD blocks per thread, at most ``max_blocks`` (but one per thread)."""
    if rows * cols < PARALLEL_MIN_ELEMENTS:
        return 1, rows  # one block on this thread (forward and backward test this first: a call less)
    threads = max(1, min(rows, torch.get_num_threads()))
    blocks = BLOCKS_PER_THREAD * threads if threads > 1 else 1
    if max_blocks is not None:
        blocks = min(blocks, max(threads, max_blocks))
    return threads, -(-rows // max(1, min(rows, blocks)))


def _torch_gomp():
    """``GOMP_parallel`` of the libgomp torch runs its own threads on, or None (another OpenMP,
    or none). Work handed to it runs on torch's OpenMP threads, already awake after torch's
    previous op, instead of contending with them for the cores."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    if "OpenMP" not in torch.__config__.parallel_info() or not os.path.exists(path):
        return None
    try:
        fn = ctypes.CDLL(path).GOMP_parallel  # void GOMP_parallel(void (*)(void *), void *, unsigned, unsigned)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    fn.restype = None
    return fn


_GOMP = _torch_gomp()
_GOMP_PID = os.getpid()  # a forked child has no OpenMP team (its threads stayed behind): the pool then


def _launch(entry, threads: int, *slots: int) -> None:
    """Run the C ``entry`` on ``threads`` threads, its arguments ``slots`` (see _SLOTS) packed into
    this thread's argument block (a call holds it until its kernel returns; calls on other threads
    have blocks of their own). Each thread claims blocks of rows until none is left, and the call
    returns once all are done, so a thread that starts late only takes fewer blocks. The threads
    are torch's own OpenMP team when torch runs on libgomp (GOMP_parallel returns once every
    thread has left the entry), else this thread and a small pool. (A ctypes call releases the
    GIL.)"""
    global _POOL
    block = getattr(_THREAD, "block", None)
    if block is None:
        block = _THREAD.block = (ctypes.c_int64 * _SLOTS)()
    _pack_slots(block, 0, *slots)
    if threads == 1:
        entry.ctypes(ctypes.addressof(block))
    elif _GOMP is not None and _GOMP_PID == os.getpid():
        _GOMP(entry.address, ctypes.addressof(block), threads, 0)
    else:
        # a new pool when more threads are asked for, or in a forked child (its threads stayed behind)
        if _POOL is None or _POOL[0] != os.getpid() or _POOL[1]._max_workers < threads - 1:
            _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="addnorm-cpu"))
        # a copy of the block for this call alone: a pool thread may start after the call has
        # returned (it then finds no rows left), while this thread's block holds its next call
        own = type(block).from_buffer_copy(block)
        run = lambda: entry.ctypes(ctypes.addressof(own))  # noqa: E731 (holds the copy until it has run)
        for _ in range(threads - 1):
            _POOL[1].submit(run)
        run()


def _transparent_huge_pages():
    """``madvise`` of libc when Linux hands out transparent huge pages only to memory that asks
    for them (``/sys/kernel/mm/transparent_hugepage/enabled`` reads ``[madvise]``), else None."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[madvise]" not in f.read():
                return None
        fn = ctypes.CDLL(None, use_errno=True).madvise  # int madvise(void *, size_t, int)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


# Fresh outputs of at least this many bytes ask for transparent huge pages, as numpy does for its
# own arrays: glibc serves requests of 32 MiB and more with a fresh mmap on every call, every 4 KiB
# page of which faults when first written; smaller ones come from its heap and do not fault once
# warm (`python benchmarks/fresh_outputs.py`; docs/benchmarks.md, "Fresh outputs page-fault").
HUGE_PAGES_MIN_BYTES = 32 << 20
_MADVISE = _transparent_huge_pages() if hasattr(mmap, "MADV_HUGEPAGE") else None


def _empty(like: Tensor, dtype: torch.dtype) -> Tensor:
    """``torch.empty_like`` of a contiguous ``like`` (so contiguous too); a large one asks for huge
    pages over the pages it spans."""
    t = torch.empty_like(like) if dtype is like.dtype else torch.empty_like(like, dtype=dtype)
    if _MADVISE is not None and t.nbytes >= HUGE_PAGES_MIN_BYTES:
        start = -(-t.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (t.data_ptr() + t.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        _MADVISE(start, end - start, mmap.MADV_HUGEPAGE)  # advice only: a failure changes nothing
    return t


@functools.lru_cache(maxsize=64)
def _constant(n: int, dtype: torch.dtype, value: float) -> Tensor:
    """A weight of ones or a bias of zeros, made once per width (never written)."""
    return torch.full((n,), value, dtype=dtype)


def _param(p: Tensor | None, n: int, dtype: torch.dtype, fill: float) -> Tensor:
    """``p`` as ``n`` contiguous values of ``dtype`` (``fill`` when None)."""
    if p is None:
        return _constant(n, dtype, fill)
    if p.dtype is dtype and p.is_contiguous():
        return p
    return p.detach().to(dtype, memory_format=torch.contiguous_format)


def _param_dtype(sd: torch.dtype, cd: torch.dtype, *params: Tensor | None) -> torch.dtype:
    """The dtype the kernels read the weight (and bias) in: the stream dtype ``sd`` when every
    one given has it (a 16-bit float widens exactly: the same results as in ``cd``, without a
    conversion on every call), else the statistics dtype ``cd``."""
    for p in params:
        if p is not None and p.dtype is not sd:
            return cd
    return sd


def _rows(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _branch_block(branch, m: int, n: int, cd: torch.dtype) -> tuple[tuple[int, ...], tuple[Tensor, ...]]:
    """The branch's argument slots (see _branch_slots) and the tensors they point into, which
    the caller holds while the kernel runs; a missing factor is a row of ones (``* 1`` is exact,
    so one compiled kernel serves every combination)."""
    p = branch.p
    layer_scale = _param(branch.layer_scale, n, cd, 1.0)
    rowscale = _param(branch.rowscale, m, cd, 1.0)
    seed = int(branch.seed) if p > 0 else 0
    slots = (seed, reference.keep_threshold(p), _eps_bits(reference.dropout_scale(p)))
    pointers = (layer_scale.data_ptr(), rowscale.data_ptr(), branch.layer_scale is not None)
    return slots + pointers, (layer_scale, rowscale)


def forward(
    x,
    residual,
    weight,
    bias,
    *,
    eps,
    rms,
    residual_dtype,
    write_stream=True,
    write_stats=True,
    out=None,
    residual_out=None,
    branch=None,
):
    """:func:`addnorm.reference.forward` in one pass over the rows; ``y`` and ``s`` are written
    straight into ``out``/``residual_out`` when given."""
    n = x.shape[-1]
    y_dtype = sd = x.dtype
    if residual is not None:
        sd = reference.stream_dtype(x, residual, residual_dtype)
        if x.dtype is not sd or residual.dtype is not sd:
            # mixed dtypes (e.g. bf16 x, fp32 stream): cast first, as the reference does, so that one
            # compiled kernel per dtype serves; y then goes through the statistics dtype
            x, residual = x.to(sd), residual.to(sd)
        residual = _rows(residual)
    cd = torch.float64 if sd is torch.float64 else torch.float32
    if not x.is_contiguous():
        x = x.contiguous()
    m = x.numel() // n if n else 0
    direct = sd is y_dtype  # else y is computed in the statistics dtype, then cast once
    y = out if out is not None and direct else _empty(x, y_dtype if direct else cd)
    write_s = residual is not None and (write_stream or residual_out is not None)
    s = None
    if write_s:
        s = residual_out if residual_out is not None else _empty(x, sd)
    mean = rstd = None
    if write_stats:
        mean = None if rms else torch.empty(m, dtype=cd)
        rstd = torch.empty(m, dtype=cd)
    if m:
        threads, block_rows = (1, m) if m * n < PARALLEL_MIN_ELEMENTS else _plan(m, n)  # (a call less)
        pd = cd if sd is cd else _param_dtype(sd, cd, weight, bias)
        w, b = _param(weight, n, pd, 1.0), _param(bias, n, pd, 0.0)  # held: the kernel reads them
        branch_slots, held = _branch_block(branch, m, n, cd) if branch is not None else (_NO_BRANCH_SLOTS, ())
        _launch(
            _forward_entry_for(sd, y.dtype, pd, branch is not None),
            threads,
            x.data_ptr(),
            x.data_ptr() if residual is None else residual.data_ptr(),
            w.data_ptr(),
            b.data_ptr(),
            y.data_ptr(),
            s.data_ptr() if write_s else 0,
            0 if mean is None else mean.data_ptr(),
            0 if rstd is None else rstd.data_ptr(),
            m,
            n,
            block_rows,
            (residual is not None) | write_s << 1 | rms << 2 | write_stats << 3,
            _eps_bits(eps),
            *branch_slots,
            *_FORWARD_PAD,
        )
        del held
    if y.dtype is not y_dtype:
        y = out.copy_(y) if out is not None else y.to(y_dtype)
    return y, s, mean, rstd


def backward(dy, dstream, s_parts, weight, mean, rstd, *, rms, has_bias, branch=None, param_dtype=None):
    """:func:`addnorm.reference.backward` in two passes over each row; from ``s_parts = (x,
    residual)`` the stream is recomputed as it is read (through the branch, when given)."""
    check_s_parts(s_parts, branch)
    s, residual = s_parts if len(s_parts) == 2 else (s_parts[0], None)
    sd = s_parts[-1].dtype  # the stream dtype (with a branch, residual's)
    cd = rstd.dtype
    if s.dtype is not sd:
        s = s.to(sd)
    # a gradient of another dtype than s is cast to the statistics dtype first (as the reference)
    if dy.dtype is not sd:
        dy = dy.to(cd)
    if dstream is not None and dstream.dtype is not sd:
        dstream = dstream.to(cd)
    s, dy = _rows(s), _rows(dy)
    if residual is not None:
        residual = _rows(residual)
    n = s.shape[-1]
    m = s.numel() // n if n else 0
    ds = _empty(s, sd)
    dx = _empty(s, sd) if branch is not None else None
    # one block (one thread): the kernel sums dweight and dbias itself, rounded to ``od`` once;
    # else one partial row per block in the statistics dtype, at most 1/16 of ds's rows (the
    # scratch stays small beside the (m, n) tensors for few, wide rows), summed below
    threads, block_rows = (1, m) if m * n < PARALLEL_MIN_ELEMENTS else _plan(m, n, max_blocks=m // 16)
    blocks = -(-m // block_rows) if m else 1
    od = param_dtype if param_dtype is cd or param_dtype is sd else cd
    # separate tensors: the custom op's outputs may not alias. The kernel zeroes each block's row
    # before it sums into it: zeros only where it does not run
    alloc = torch.empty if m else torch.zeros
    if blocks == 1:
        dw = alloc(n, dtype=od) if weight is not None else None
        db = alloc(n, dtype=od) if has_bias else None
    else:
        dw, db = alloc((blocks, n), dtype=cd), alloc((blocks, n), dtype=cd)
    dls = alloc((blocks, n) if blocks > 1 else n, dtype=cd) if branch is not None else None
    if m:
        dst = s if dstream is None else _rows(dstream)
        pd = cd if sd is cd else _param_dtype(sd, cd, weight)
        w = _param(weight, n, pd, 1.0)  # held: the kernel reads it
        branch_slots, held = _branch_block(branch, m, n, cd) if branch is not None else (_NO_BRANCH_SLOTS, ())
        _launch(
            _backward_entry_for(sd, dy.dtype, dst.dtype, pd, od, residual is not None, branch is not None),
            threads,
            dy.data_ptr(),
            dst.data_ptr(),
            s.data_ptr(),
            w.data_ptr(),
            (rstd if rms else mean).data_ptr(),
            rstd.data_ptr(),
            ds.data_ptr(),
            0 if dw is None else dw.data_ptr(),
            0 if db is None else db.data_ptr(),
            m,
            n,
            block_rows,
            (dstream is not None) | rms << 1,
            blocks,
            0 if residual is None else residual.data_ptr(),
            0 if dx is None else dx.data_ptr(),
            0 if dls is None else dls.data_ptr(),
            *branch_slots,
            *_BACKWARD_PAD,
        )
        del held
    if blocks > 1:  # the per-block partial rows summed by torch (no atomics, a fixed order for a
        # given shape): bit-identical from run to run for a given thread count
        dw = dw.sum(0) if weight is not None else None
        db = db.sum(0) if has_bias else None
        dls = None if dls is None else dls.sum(0)
    if param_dtype is not None:
        dw, db = (g if g is None or g.dtype is param_dtype else g.to(param_dtype) for g in (dw, db))
    if branch is None or branch.layer_scale is None:
        dls = None
    return Grads(ds, dw, db, dx, dls)
