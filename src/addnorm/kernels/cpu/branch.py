"""The sublayer branch fused into the add: ``s = residual + rowscale * layer_scale * dropout(x)``.

The keep mask is :func:`addnorm.reference.keep_mask`, a counter-based hash of ``(seed, row,
column)``: no mask is stored, the backward recomputes it. The hash (``reference.mask_hash``) is
written here in 32-bit lanes: ``fmix32`` as LLVM intrinsics, so that the loop over a row
vectorizes with 32-bit multiplies (numba would widen every integer operation to 64 bits). The
column keys depend only on the seed and the column, so each thread computes them once per call
(:func:`prepare_branch`); a row then costs one hash per element.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ... import reference
from .floats import load, put, round_to
from .jit import njit, overload

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


def prepare_branch(args, n):
    """None without a branch; else ``(k0, k1, threshold, scale, layer_scale, rowscale, col_keys,
    layer_scaled)`` from ``args = (seed, threshold, scale, layer_scale, rowscale, layer_scaled)``
    (``entry.read_branch``), the column keys of :func:`addnorm.reference.mask_hash` computed once
    per thread."""


@overload(prepare_branch)
def _prepare_branch_impl(args, n):
    if isinstance(args, types.NoneType):
        return lambda args, n: None

    def prepare(args, n):
        seed, threshold, scale, layer_scale, rowscale, layer_scaled = args
        k0, k1, cols = _keys(seed, n)
        # p = 1 (threshold 2**32) has scale 0: the gate is 0 whatever the 32-bit comparison says
        return k0, k1, np.uint32(min(threshold, 0xFFFFFFFF)), scale, layer_scale, rowscale, cols, layer_scaled

    return prepare


@njit
def _keys(seed, n):
    """``(k0, k1, column keys)`` of :func:`addnorm.reference.mask_hash` for the int64 ``seed``."""
    k0, k1 = np.uint64(seed) & _M32, (np.uint64(seed) >> _U32) & _M32
    k0, k1, k0g = np.uint32(k0), np.uint32(k1), np.uint32(k0 ^ _GOLDEN)
    cols = np.empty(n, np.uint32)
    for j in range(n):
        cols[j] = _fmix32_add(_fmix32_xor(np.uint32(j), k1), k0g)
    return k0, k1, cols


@njit(nogil=True)
def keep_rows(seed, threshold, out):
    """``out`` (bool, rows x columns) = :func:`addnorm.reference.keep_mask` of rows ``0..`` for
    ``threshold < 2**32``: the kernels' hash, one vectorized loop per row."""
    m, n = out.shape
    k0, k1, cols = _keys(seed, n)
    t = np.uint32(threshold)
    for i in range(m):
        a = _fmix32_add(_fmix32_xor(np.uint32(i), k0), k1)
        row = out[i]
        for j in range(n):
            row[j] = _fmix32_add(a, cols[j]) >= t


@njit
def gate_row(branch, row, gate):
    """``gate`` = ``keep ? scale : 0`` over row ``row`` (its index in the call) of the branch
    (from :func:`prepare_branch`): :func:`addnorm.reference.branch_terms`' gate, bit for bit."""
    k0, k1, threshold, scale, _, _, cols, _ = branch
    a = _fmix32_add(_fmix32_xor(np.uint32(row), k0), k1)
    zero = scale - scale
    for j in range(gate.shape[0]):
        gate[j] = scale if _fmix32_add(a, cols[j]) >= threshold else zero


@njit
def stream_through_branch(xi, ri, sbuf, gates, branch, row):
    """``sbuf`` = the stream of row ``row`` (its index in the call) through the branch (from
    :func:`prepare_branch`), rounded to the residual's dtype, in the statistics dtype:
    :func:`addnorm.reference.stream` with :func:`addnorm.reference.branch_terms`, bit for bit.
    ``gates[0]`` gets ``keep ? scale : 0`` and ``gates[1]`` the factor of ``x``, that times the
    layer scale. (Separate loops, the integer one and the float ones, so that each vectorizes.)"""
    layer_scale, rowscale = branch[4], branch[5]
    gate, factor = gates[0], gates[1]
    gate_row(branch, row, gate)
    for j in range(sbuf.shape[0]):
        factor[j] = gate[j] * layer_scale[j]
    rs = rowscale[row]
    for j in range(sbuf.shape[0]):
        sbuf[j] = round_to(ri, load(ri, j) + load(xi, j) * factor[j] * rs)


def _plus(addend, j, v):
    """``addend[j] + v`` (widened), or ``v`` when ``addend`` is None."""


@overload(_plus)
def _plus_impl(addend, j, v):
    if isinstance(addend, types.NoneType):
        return lambda addend, j, v: v
    return lambda addend, j, v: load(addend, j) + v


def _gate_row_if(branch, row, gate):
    """:func:`gate_row`, or nothing without dropout (``branch`` None)."""


@overload(_gate_row_if)
def _gate_row_if_impl(branch, row, gate):
    if isinstance(branch, types.NoneType):
        return lambda branch, row, gate: None
    return lambda branch, row, gate: gate_row(branch, row, gate)


def _gated(src, j, gate, branch):
    """``src[j]`` (widened) times the gate, or ``src[j]`` itself without dropout."""


@overload(_gated)
def _gated_impl(src, j, gate, branch):
    if isinstance(branch, types.NoneType):
        return lambda src, j, gate, branch: load(src, j)
    return lambda src, j, gate, branch: load(src, j) * gate[j]


@njit
def dropped_row(src, addend, out, gate, branch, row):
    """``out`` = ``addend + dropout(src)`` of row ``row``, summed in the statistics dtype and
    rounded to ``out``'s: :func:`addnorm.reference.stream` of a dropout-only branch, bit for bit
    (parallel blocks' ``x1``; with ``addend`` None, ``dropout(src)``: its gradient). ``branch``
    None: no dropout, ``addend + src`` rounded once (torch's add of the two in ``out``'s dtype)."""
    _gate_row_if(branch, row, gate)
    for j in range(out.shape[0]):
        put(out, j, _plus(addend, j, _gated(src, j, gate, branch)))
