"""The row pieces chosen by type when compiling: each is a stub whose ``@overload`` picks the
code for the argument types it is compiled for (a dtype, or an argument being None), so that
each case of :mod:`.rows`' loops gets its own loop body and each loop vectorizes; a runtime test
inside a row loop would keep it from vectorizing.

- the residual row, with parallel blocks' ``x1`` added into a scratch row (:func:`residual_row`);
- the stream, recomputed from ``x`` and ``residual`` for post-norm (:func:`stream_row`,
  :func:`stream_at`);
- the output rows, with non-temporal stores or without (:func:`output_row`), and a second norm's
  (:func:`second_row`, :func:`put_second`, :func:`second_grad_row`, :func:`second_params`);
- the backward's ``g = dy * weight`` (:func:`g_at`) and the returned stream's own gradient
  (:func:`plus_dstream`).
"""

from __future__ import annotations

from numba import types

from .branch import dropped_row
from .floats import Streamed, load, put, round_to
from .jit import njit, overload


@njit(inline="always")
def y_at(row, j, mu, c, rs, w, b):
    """Element ``j`` of the output: ``(row - mean) * rstd * weight + bias``, the mean corrected
    by ``c`` in a subtraction of its own (:func:`.numerics.centred_stats`)."""
    return ((row[j] - mu) - c) * rs * load(w, j) + load(b, j)


def residual_row(r, i, added, first):
    """Row ``i`` of the residual: ``r[i]``; with parallel blocks' ``x1`` (``added``: ``(x1, its
    dropout branch or None, a scratch row of the stream dtype, a gate row)``), ``r[i] +
    dropout1(x1[i])`` summed in the statistics dtype and rounded to the stream dtype, into the
    scratch row: :func:`.branch.dropped_row`, the bits of the pass it replaces (``first``: the
    index of row 0 in the call, for the keep mask). ``x1`` of another dtype than the stream's is
    rounded to it first, in the scratch row (``x1.to(sd)``'s bits, with no pass of its own). The
    scratch row is read before the next row's sum overwrites it."""


def stream_row(si, ri, sbuf):
    """``(row, residual)`` with ``stream_at(row, residual, j)`` element ``j`` of the stream. When
    the saved row ``si`` is ``x`` (``ri`` the residual, see ``CAPABILITIES``), the stream is the
    forward's ``x + residual``, rounded as the forward rounded it: bit for bit its ``s``. For
    16-bit rows it is recomputed once into ``sbuf`` (statistics dtype) rather than in each of the
    backward's two passes, where the add and its rounding cost more instructions than the rest of
    a pass; float32 and float64 rows add in place, in each pass, where the buffer costs more than
    it saves (`python benchmarks/cpu_row_cost.py`; docs/benchmarks.md, "Dispatch, threads,
    compile time, warm start": row cost in cache)."""


def stream_at(si, ri, j):
    """Element ``j`` of the stream: ``si[j]`` (``ri`` None), else ``si[j] + ri[j]`` rounded to the
    dtype of ``si``."""


def index_or_none(a, index):
    """``a[index]``, or None when ``a`` is None."""


def output_row(a, i, streamed):
    """Row ``i`` of the output ``a`` as :func:`.floats.put` takes it: ``a[i]``, or
    ``Streamed(a[i])`` (non-temporal stores) when ``streamed`` is not None. Made once per row,
    outside the loop over its elements (inside, the loop would not vectorize)."""


def second_row(second, i, streamed):
    """Row ``i`` of the second norm's output: ``(weight1, bias1, y1 row)`` (the row as
    :func:`output_row` makes it), or None without a second norm."""


def put_second(row, j, mu, c, rs, second_i):
    """Element ``j`` of the second norm's output (``weight1``, ``bias1`` on the same ``xhat``), or
    nothing when ``second_i`` is None."""


def second_grad_row(second, i):
    """``(dy1 row, weight1, dweight1, dbias1)`` of row ``i`` for the backward (``second`` the
    whole ``(dy1, weight1, dweight1, dbias1)``), or None without a second norm."""


def g_at(dj, w, sec, j):
    """Element ``j`` of ``g = dy * weight`` (``dj``: ``dy[j]`` as loaded), plus ``dy1 * weight1``
    with a second norm: the gradient that reaches ``xhat`` from both outputs."""


def second_params(sec, xh, j):
    """Row's share of ``dweight1``/``dbias1`` at ``j`` (nothing without a second norm)."""


def second_params_pair(sec_i, sec_j, xi, xj, j):
    """:func:`second_params` of two rows, each row's term added in row order."""


def plus_dstream(v, dsti, j):
    """``v + dsti[j]`` (the gradient of the returned stream, pre-norm), or ``v`` when ``dsti`` is
    None."""


@overload(residual_row)
def _residual_row_impl(r, i, added, first):
    if isinstance(added, types.NoneType):
        return lambda r, i, added, first: r[i]

    if added[0].dtype != r.dtype:

        def convert_and_add(r, i, added, first):
            x1, branch1, row, gate = added
            x1i = x1[i]
            for j in range(row.shape[0]):
                put(row, j, load(x1i, j))
            dropped_row(row, r[i], row, gate, branch1, first + i)  # (each element read, then written)
            return row

        return convert_and_add

    def add(r, i, added, first):
        x1, branch1, row, gate = added
        dropped_row(x1[i], r[i], row, gate, branch1, first + i)
        return row

    return add


@overload(stream_row)
def _stream_row_impl(si, ri, sbuf):
    if isinstance(ri, types.NoneType) or si.dtype == sbuf.dtype:
        return lambda si, ri, sbuf: (si, ri)

    def recompute(si, ri, sbuf):
        for j in range(sbuf.shape[0]):
            sbuf[j] = round_to(si, load(si, j) + load(ri, j))
        return sbuf, None

    return recompute


@overload(stream_at)
def _stream_at_impl(si, ri, j):
    if isinstance(ri, types.NoneType):
        return lambda si, ri, j: load(si, j)
    return lambda si, ri, j: round_to(si, load(si, j) + load(ri, j))


@overload(index_or_none)
def _index_or_none_impl(a, index):
    if isinstance(a, types.NoneType):
        return lambda a, index: None
    return lambda a, index: a[index]


@overload(output_row)
def _output_row_impl(a, i, streamed):
    if isinstance(streamed, types.NoneType):
        return lambda a, i, streamed: a[i]
    return lambda a, i, streamed: Streamed(a[i])


@overload(second_row)
def _second_row_impl(second, i, streamed):
    if isinstance(second, types.NoneType):
        return lambda second, i, streamed: None
    return lambda second, i, streamed: (second[0], second[1], output_row(second[2], i, streamed))


@overload(put_second)
def _put_second_impl(row, j, mu, c, rs, second_i):
    if isinstance(second_i, types.NoneType):
        return lambda row, j, mu, c, rs, second_i: None

    def write(row, j, mu, c, rs, second_i):
        w1, b1, y1i = second_i
        put(y1i, j, y_at(row, j, mu, c, rs, w1, b1))

    return write


@overload(second_grad_row)
def _second_grad_row_impl(second, i):
    if isinstance(second, types.NoneType):
        return lambda second, i: None
    return lambda second, i: (second[0][i], second[1], second[2], second[3])


@overload(g_at)
def _g_at_impl(dj, w, sec, j):
    if isinstance(sec, types.NoneType):
        return lambda dj, w, sec, j: dj * load(w, j)
    return lambda dj, w, sec, j: dj * load(w, j) + load(sec[0], j) * load(sec[1], j)


@overload(second_params)
def _second_params_impl(sec, xh, j):
    if isinstance(sec, types.NoneType):
        return lambda sec, xh, j: None

    def add(sec, xh, j):
        d1 = load(sec[0], j)
        sec[2][j] += d1 * xh
        sec[3][j] += d1

    return add


@overload(second_params_pair)
def _second_params_pair_impl(sec_i, sec_j, xi, xj, j):
    if isinstance(sec_i, types.NoneType):
        return lambda sec_i, sec_j, xi, xj, j: None

    def add(sec_i, sec_j, xi, xj, j):
        di, dj = load(sec_i[0], j), load(sec_j[0], j)
        sec_i[2][j] = (sec_i[2][j] + di * xi) + dj * xj
        sec_i[3][j] = (sec_i[3][j] + di) + dj

    return add


@overload(plus_dstream)
def _plus_dstream_impl(v, dsti, j):
    if isinstance(dsti, types.NoneType):
        return lambda v, dsti, j: v
    return lambda v, dsti, j: v + load(dsti, j)


def negative_zeros(ri, row):
    """``row`` filled with -0.0 (None when ``ri`` is None): the identity of ``+``."""


@overload(negative_zeros)
def _negative_zeros_impl(ri, row):
    if isinstance(ri, types.NoneType):
        return lambda ri, row: None

    def fill(ri, row):
        row[:] = -0.0
        return row

    return fill
