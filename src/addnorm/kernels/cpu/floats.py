"""Element access in any of the kernels' dtypes: 16-bit floats widened on load, rounded on store.

numba has no bfloat16 or float16, so those tensors travel as their 16-bit patterns (bfloat16 as
``uint16``, float16 as ``int16``, see ``entry.NUMPY_DTYPES``). :func:`load` widens an element to
float32 (float32 and float64 elements are read as they are); :func:`put` rounds a value to
nearest-even in the row's dtype, as torch's casts do, and stores it. Both are chosen by the
row's type when compiling, so each row loop compiles to straight-line code that vectorizes.

The conversions are LLVM instructions (``bitcast``, and ``fpext``/``fptrunc`` for float16),
written as numba intrinsics: numba cannot reinterpret the bits of a scalar itself.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload


@intrinsic
def f32_from_bits(typingctx, bits):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def bits_from_f32(typingctx, value):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def f32_from_half(typingctx, bits):
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.int16), codegen


@intrinsic
def half_from_f32(typingctx, value):
    def codegen(context, builder, sig, args):  # fptrunc rounds to nearest-even
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.int16(types.float32), codegen


@numba.njit
def bf16_bits(v):
    """float32 -> bfloat16 bits, round to nearest-even, NaN stays a quiet NaN (as torch)."""
    if v != v:
        return np.uint16(0x7FC0)
    b = bits_from_f32(np.float32(v))
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


def load(a, j):
    """Element ``a[j]`` of a row widened to float32 (kept float64 for float64 rows)."""


def put(a, j, v):
    """Write ``v`` to ``a[j]`` rounded to nearest-even in ``a``'s dtype; return that rounded
    value widened back (what a load of ``a[j]`` now gives)."""


def round_to(a, v):
    """``v`` rounded to the dtype of ``a`` and widened back (what :func:`put` would return)."""


@overload(load)
def _load_impl(a, j):
    if a.dtype == types.uint16:
        return lambda a, j: f32_from_bits(np.uint32(a[j]) << np.uint32(16))
    if a.dtype == types.int16:
        return lambda a, j: f32_from_half(a[j])
    return lambda a, j: a[j]


@overload(put)
def _put_impl(a, j, v):
    if a.dtype == types.uint16:

        def put_bf16(a, j, v):
            bits = bf16_bits(v)
            a[j] = bits
            return f32_from_bits(np.uint32(bits) << np.uint32(16))

        return put_bf16
    if a.dtype == types.int16:

        def put_half(a, j, v):
            bits = half_from_f32(np.float32(v))
            a[j] = bits
            return f32_from_half(bits)

        return put_half

    def put_float(a, j, v):
        a[j] = v
        return a[j]

    return put_float


@overload(round_to)
def _round_to_impl(a, v):
    if a.dtype == types.uint16:
        return lambda a, v: f32_from_bits(np.uint32(bf16_bits(v)) << np.uint32(16))
    if a.dtype == types.int16:
        return lambda a, v: f32_from_half(half_from_f32(np.float32(v)))
    if a.dtype == types.float32:
        return lambda a, v: np.float32(v)
    return lambda a, v: np.float64(v)
