"""Element access in any of the kernels' dtypes: 16-bit floats widened on load, rounded on store.

numba has no bfloat16 or float16, so those tensors travel as their 16-bit patterns (bfloat16 as
``uint16``, float16 as ``int16``, see ``entry.NUMPY_DTYPES``). :func:`load` widens an element to
float32 (float32 and float64 elements are read as they are); :func:`put` rounds a value to
nearest-even in the row's dtype, as torch's casts do, and stores it. Both are chosen by the
row's type when compiling, so each row loop compiles to straight-line code that vectorizes.

The conversions are LLVM instructions (``bitcast``, and ``fpext``/``fptrunc`` for float16),
written as numba intrinsics: numba cannot reinterpret the bits of a scalar itself.

An output row wrapped in :class:`Streamed` is written with non-temporal stores (straight to
memory: see its docstring); :func:`put` takes either.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .jit import njit, overload


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


@njit
def bf16_bits(v):
    """float32 -> bfloat16 bits, round to nearest-even, NaN stays a quiet NaN (as torch)."""
    if v != v:
        return np.uint16(0x7FC0)
    b = bits_from_f32(np.float32(v))
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


class Streamed(NamedTuple):
    """An output row that :func:`put` writes with non-temporal stores: straight to memory, where
    a plain store first reads in the cache line it writes (for a row computed from two inputs, a
    third more traffic). For large outputs, which would leave the cache before they are read
    again. The row must start on 64 bytes and span a multiple of 64 bytes: the launcher checks
    (:func:`.launch.streamed`), so that each vector store of a loop over the row is aligned to
    its own width (see :func:`_store_nontemporal`)."""

    row: object


@intrinsic
def _store_nontemporal(typingctx, a, j, element):
    """``a[j] = element`` (of a's dtype), marked non-temporal and claiming 64-byte alignment.
    LLVM's loop vectorizer makes a non-temporal store a vector store only when the store claims
    the vector's alignment (else it leaves the loop scalar); it never peels a loop for
    alignment, so on a row that starts on 64 bytes each vector store (64 bytes, or a narrower
    one in the loop's vectorized epilogue) falls at a multiple of its own width, which is what
    the aligned instructions (``vmovntps``) need. The claim overstates the alignment of the
    scalar stores a vectorized loop leaves at its tail (none on a row of 64-byte multiples
    whose length divides by the vector widths): those are non-temporal stores of any alignment
    on x86 (``movnti``), and LLVM's x86 code does not use the claim for them."""

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]], boundscheck=False)
        store = builder.store(args[2], ptr, align=64)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return types.void(a, j, a.dtype), codegen


@intrinsic
def fence(typingctx):
    """A full memory fence: non-temporal stores are weakly ordered, and are made visible to
    other threads before a block of rows is counted done."""

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


def load(a, j):
    """Element ``a[j]`` of a row widened to float32 (kept float64 for float64 rows)."""


def put(a, j, v):
    """Write ``v`` to ``a[j]`` rounded to nearest-even in ``a``'s dtype (a :class:`Streamed` row
    with a non-temporal store); return that rounded value widened back (what a load of ``a[j]``
    now gives)."""


def round_to(a, v):
    """``v`` rounded to the dtype of ``a`` and widened back (what :func:`put` would return)."""


def widened(a, like):
    """A parameter row ``a`` (weight, bias) as the row loops read it, in the statistics dtype of
    ``like``: a 16-bit row widened once into a new array (each row then loads it with no
    conversion, which costs a shuffle and a shift per vector in every row's loop), any other row
    ``a`` itself. The same values either way: widening is exact."""


@overload(widened)
def _widened_row_impl(a, like):
    if a.dtype not in (types.uint16, types.int16):
        return lambda a, like: a

    def widen(a, like):
        out = np.empty(a.shape[0], like.dtype)
        for j in range(a.shape[0]):
            out[j] = load(a, j)
        return out

    return widen


def _element(a, v):
    """``v`` as ``a`` stores it: rounded to nearest-even in a's dtype, 16-bit floats as their bit
    patterns."""


def _widened(a, e):
    """An element of ``a`` (as stored) widened to float32 (float64 for float64 rows)."""


@overload(_element)
def _element_impl(a, v):
    if a.dtype == types.uint16:
        return lambda a, v: bf16_bits(v)
    if a.dtype == types.int16:
        return lambda a, v: half_from_f32(np.float32(v))
    if a.dtype == types.float32:
        return lambda a, v: np.float32(v)
    return lambda a, v: np.float64(v)


@overload(_widened)
def _widened_impl(a, e):
    if a.dtype == types.uint16:
        return lambda a, e: f32_from_bits(np.uint32(e) << np.uint32(16))
    if a.dtype == types.int16:
        return lambda a, e: f32_from_half(e)
    return lambda a, e: e


@overload(load)
def _load_impl(a, j):
    return lambda a, j: _widened(a, a[j])


@overload(put)
def _put_impl(a, j, v):
    if isinstance(a, types.BaseNamedTuple) and a.instance_class is Streamed:

        def put_streamed(a, j, v):
            e = _element(a.row, v)
            _store_nontemporal(a.row, j, e)
            return _widened(a.row, e)

        return put_streamed

    def put_plain(a, j, v):
        e = _element(a, v)
        a[j] = e
        return _widened(a, e)

    return put_plain


@overload(round_to)
def _round_to_impl(a, v):
    return lambda a, v: _widened(a, _element(a, v))
