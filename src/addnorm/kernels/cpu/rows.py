"""The row loops: forward and backward over a block of rows, each row while it sits in L1/L2.

Forward, per row: add the residual and round it to the stream dtype (written out as ``s``,
unless post-norm needs no ``s``), the row in the statistics dtype (``x`` or ``s`` itself when
already in it, else widened into a buffer), then the statistics (:mod:`.numerics`) and the
output. float32 and float64 rows with a residual run one row ahead: the loop that writes a
row's output adds the next row's stream, so that reading the next row overlaps writing this
one (:func:`_forward_rows_pipelined`; docs/performance-log.md, "CPU forward: one row ahead").

Backward, per row: the row sums (of ``s - mean``, whose mean re-centres the row about the
rounded saved mean as the forward centred it, of ``g = dy * weight`` and of ``g * xhat``) in one
pass, then ``ds`` (plus the stream's own gradient) and the row's share of ``dweight``/``dbias``
in another (:func:`gradient_pass`). ``xhat`` and ``g`` are recomputed in each pass (a
multiply-add each) rather than stored by the first: fewer stores (docs/benchmarks.md, "Dispatch,
threads, compile time, warm start": row cost in cache). For post-norm the stream ``s`` is itself
recomputed from ``x`` and ``residual`` (:func:`.pieces.stream_row`), bit for bit the forward's.

A second norm of the same rows (parallel blocks: ``weight1``, ``bias1``) costs no pass of its
own: the loop that writes ``y`` writes ``y1`` from the same statistics, and the backward's
passes take ``g = dy * weight + dy1 * weight1`` and add the row's share of ``dweight1`` and
``dbias1`` (:func:`.pieces.second_row`, :func:`.pieces.second_grad_row`: None without one,
pruned when compiling).
Parallel blocks' ``x1`` costs no pass of its own either where the forward takes it
(``Capabilities.adds_x1``): each residual row is read as ``residual + dropout(x1)``, summed into
a scratch row just before the row's own loops (:func:`.pieces.residual_row`).

Large outputs that are not read back (``y``; ``ds``, or ``dx`` through a branch) are written
with non-temporal stores when the launcher asks (``streamed``, :class:`.floats.Streamed`): the
same values, straight to memory.

Choices that depend on a dtype or on an argument being None are made by type when compiling
(the row pieces of :mod:`.pieces`, or a None argument), so that each case gets its own loops and
each loop vectorizes; a runtime test inside a row loop would keep it from vectorizing.
"""

from __future__ import annotations

import numpy as np

from . import config
from .branch import stream_through_branch
from .floats import load, put
from .jit import njit
from .numerics import SUM_MATH, add_row, centred_stats, dot, load_row, row_scale, row_stats, row_sum
from .pieces import (
    g_at,
    index_or_none,
    negative_zeros,
    output_row,
    plus_dstream,
    put_second,
    residual_row,
    second_grad_row,
    second_params,
    second_params_pair,
    second_row,
    stream_at,
    stream_row,
    y_at,
)

PAIR_MIN_COLS = config.SETTINGS.pair_min_cols  # a constant of the compiled kernels

# Below this rstd (a std beyond 1e18) s - mean may overflow in float32: backward then scales
# the row as the forward did. Above it the scaling would change nothing (it is exact).
_SCALE_BELOW_RSTD = 1e-18


@njit
def forward_rows(
    x,
    r,
    w,
    b,
    eps,
    nf,
    has_residual,
    write_s,
    write_stats,
    rms,
    y,
    s,
    mean,
    rstd,
    buf,
    kbuf,
    direct,
    branch,
    first,
    gates,
    streamed,
    second,
    added,
):
    """``y`` (and ``s``, ``mean``, ``rstd``) of the rows ``x`` (plus ``r``). ``direct``: None for
    16-bit rows, whose x and s are never in the statistics dtype (a type, so that the branches
    below that use x or s directly are pruned when compiling: left in, they keep the widening
    loop from vectorizing). ``branch``: from :func:`.branch.prepare_branch` (None without one),
    ``first`` the index of the first row in the call. ``buf``: three rows of scratch.
    ``streamed``: True to write ``y`` with non-temporal stores, else None. ``second``: the
    second norm of the same rows, ``(weight1, bias1, y1)`` (parallel blocks: ``y1`` from the same
    statistics, in the same loop as ``y``), or None. ``added``: parallel blocks' ``x1``, added to
    each row of ``r`` first (:func:`.pieces.residual_row`), or None."""
    if direct is not None and branch is None and has_residual and write_s:
        _forward_rows_pipelined(
            x, r, w, b, eps, nf, write_stats, rms, y, s, mean, rstd, buf, kbuf, streamed, second, added, first
        )
        return
    row_buf = buf[0]
    for i in range(x.shape[0]):
        # the row in the statistics dtype and its sum (of squares for RMSNorm): 16-bit rows are
        # widened into buf, summed as they are; others are x itself (nothing copied: a store per
        # element fewer), or x + residual added into buf when the stream is not written
        if branch is not None:
            row = row_buf
            stream_through_branch(x[i], residual_row(r, i, added, first), row_buf, gates, branch, first + i)
            if write_s:
                si = s[i]
                for j in range(row_buf.shape[0]):
                    put(si, j, row_buf[j])
            total = dot(row, row) if rms else row_sum(row)
        elif direct is None:
            row = row_buf
            total = load_row(x[i], residual_row(r, i, added, first), s[i], row_buf, has_residual, write_s, rms)
        else:
            row = x[i]
            if has_residual:
                add_row(x[i], residual_row(r, i, added, first), row_buf)
                row = row_buf
            total = dot(row, row) if rms else row_sum(row)
        row, mu, c, rs, k = _row_statistics(row, total, eps, nf, rms, buf[2], kbuf)
        _output_row(row, mu, c, rs, w, b, output_row(y, i, streamed), second_row(second, i, streamed))
        if write_stats:
            _store_stats(mean, rstd, i, mu, c, rs, k, rms)


@njit
def _forward_rows_pipelined(
    x, r, w, b, eps, nf, write_stats, rms, y, s, mean, rstd, buf, kbuf, streamed, second, added, first
):
    """:func:`forward_rows` of float32/float64 rows with a residual whose stream ``s`` is
    written, one row ahead: the loop that writes row i's output also adds row i+1's stream, so
    that the memory reads of the next row and the writes of this one run together (as an
    elementwise op's would), and only the row's sums run from cache alone. Each value is
    computed as without the overlap (the same loops, the same operations on the same values):
    the same bits. Rows whose stream is not written take the plain loop, one row at a time:
    there the overlap, through two alternating scratch rows, measured slower on two threads
    (docs/performance-log.md, "CPU forward: one row ahead")."""
    m = x.shape[0]
    if m == 0:
        return
    add_row(x[0], residual_row(r, 0, added, first), s[0])
    for i in range(m):
        row = s[i]
        total = dot(row, row) if rms else row_sum(row)
        row, mu, c, rs, k = _row_statistics(row, total, eps, nf, rms, buf[2], kbuf)
        if i + 1 < m:
            _output_row_and_add(
                row,
                mu,
                c,
                rs,
                w,
                b,
                output_row(y, i, streamed),
                second_row(second, i, streamed),
                x[i + 1],
                residual_row(r, i + 1, added, first),
                s[i + 1],
            )
        else:
            _output_row(row, mu, c, rs, w, b, output_row(y, i, streamed), second_row(second, i, streamed))
        if write_stats:
            _store_stats(mean, rstd, i, mu, c, rs, k, rms)


@njit(inline="always")
def _row_statistics(row, total, eps, nf, rms, scaled, kbuf):
    """``(row, mu, c, rs, k)``: the row's mean, its correction and ``rstd / k``. A row whose
    variance overflows (bf16 beyond ~1e19) is done again on ``row * k`` (``k <= 1``, a power of
    two), written to ``scaled``, which is then the row returned."""
    one = nf / nf
    k = one
    if rms:
        mu = c = nf - nf
        var = total / nf
    else:
        mu, c, var = centred_stats(row, total, nf)
    if not np.isfinite(var):
        k = row_scale(row, kbuf)
        if k != one:
            for j in range(row.shape[0]):
                scaled[j] = row[j] * k
            row = scaled
            mu, c, var = row_stats(row, nf, rms)
            if var == 0:  # a constant row: the unscaled row's rstd (reference.forward_rows)
                return row, mu, c, one / np.sqrt(var + eps) / k, k
    return row, mu, c, one / np.sqrt(var + eps * k * k), k


@njit(inline="always")
def _output_row(row, mu, c, rs, w, b, yi, second_i):
    for j in range(row.shape[0]):
        put(yi, j, y_at(row, j, mu, c, rs, w, b))
        put_second(row, j, mu, c, rs, second_i)


@njit(inline="always")
def _output_row_and_add(row, mu, c, rs, w, b, yi, second_i, xn, rn, dest):
    """:func:`_output_row` of this row and the next row's stream into ``dest``, in one loop."""
    for j in range(row.shape[0]):
        put(yi, j, y_at(row, j, mu, c, rs, w, b))
        put_second(row, j, mu, c, rs, second_i)
        dest[j] = stream_at(xn, rn, j)


@njit(inline="always")
def _store_stats(mean, rstd, i, mu, c, rs, k, rms):
    if not rms:
        mean[i] = (mu + c) / k
    rstd[i] = rs * k


@njit(fastmath=SUM_MATH)
def _backward_sums(si, ri, dyi, w, sec, mu, rs_k):
    """The row sums of ``d = s - mu``, of ``g = dy * weight`` (:func:`g_at`) and of
    ``g * d * rs_k``."""
    sum_d = sum_g = sum_gx = mu - mu
    for j in range(w.shape[0]):
        d = stream_at(si, ri, j) - mu
        gj = g_at(load(dyi, j), w, sec, j)
        sum_d += d
        sum_g += gj
        sum_gx += gj * (d * rs_k)
    return sum_d, sum_g, sum_gx


@njit
def scaled_row(si, ri, sbuf, kbuf):
    """The row scale ``k`` of a row whose rstd is below _SCALE_BELOW_RSTD
    (:func:`.numerics.row_scale` of the stream, the forward's ``k`` where the forward scaled the
    row; elsewhere an exact scaling that changes nothing), and the stream times ``k`` in
    ``sbuf``, which the backward's passes then read as the row (``si`` may be ``sbuf`` itself)."""
    for j in range(sbuf.shape[0]):
        sbuf[j] = stream_at(si, ri, j)
    k = row_scale(sbuf, kbuf)
    for j in range(sbuf.shape[0]):
        sbuf[j] = sbuf[j] * k
    return k


@njit
def _row_coefs(si, ri, dyi, w, sec, mean, rstd, i, nf, rms, k):
    """``(mu, c, rs_k, mean(g * xhat), mean(g))`` of row ``i``, ``xhat = (s - mu - c) * rs_k``,
    the row ``s`` already scaled by ``k`` (:func:`scaled_row`; 1 for all other rows, whose
    passes then multiply by nothing): ``mu`` the saved mean and ``c`` its correction, the mean of
    ``s - mu`` (the saved mean is rounded: see :func:`addnorm.reference.backward_rows`), both
    scaled by ``k`` as in the forward. The pass that sums ``g`` and ``g * (s - mu) * rs_k``
    takes ``c`` too, and ``sum(g * xhat) = sum(g * (s - mu) * rs_k) - c * rs_k * sum(g)``: no
    pass more."""
    zero = nf - nf
    rs = rstd[i]
    mu = zero if rms else mean[i] * k
    rs_k = rs / k
    sum_d, sum_g, sum_gx = _backward_sums(si, ri, dyi, w, sec, mu, rs_k)
    c = zero if rms else sum_d / nf
    return mu, c, rs_k, (sum_gx - c * rs_k * sum_g) / nf, (zero if rms else sum_g / nf)


@njit(inline="always")  # into each caller: as a call of its own, one case vectorized worse
def gradient_pass(si, ri, dyi, w, sec, dsti, coefs, rs, dsi, dw, db):
    """The backward's second pass over a row: ``ds`` (plus ``dsti``, the gradient of the returned
    stream, when not None) and the row's share of ``dweight`` and ``dbias`` (and of the second
    norm's, ``sec``: :func:`.pieces.second_grad_row`), from the row's ``coefs``
    (:func:`_row_coefs`). ``dsti`` and ``sec`` None or not are types: each case compiles to one
    vectorized loop."""
    mu, c, rs_k, mgx, mg = coefs
    for j in range(w.shape[0]):
        dj = load(dyi, j)
        xh = ((stream_at(si, ri, j) - mu) - c) * rs_k
        dw[j] += dj * xh
        db[j] += dj
        second_params(sec, xh, j)
        put(dsi, j, plus_dstream((g_at(dj, w, sec, j) - xh * mgx - mg) * rs, dsti, j))


@njit(inline="always")
def _gradient_pair(rows, w, dw, db):
    """:func:`gradient_pass` of two rows in one pass: ``dweight``/``dbias`` loaded and stored
    once per pair, each row's term added in row order as two passes would (the same bits).
    ``rows``: per row ``(si, ri, dyi, sec, dsti, coefs, rs, dsi)``."""
    si, ri, dyi, seci, dsti, (mu, c, rs_k, mgx, mg), rs, dsi = rows[0]
    sj, rj, dyj, secj, dstj, (mu2, c2, rs_k2, mgx2, mg2), rs2, dsj = rows[1]
    for j in range(w.shape[0]):
        di = load(dyi, j)
        xi = ((stream_at(si, ri, j) - mu) - c) * rs_k
        dj = load(dyj, j)
        xj = ((stream_at(sj, rj, j) - mu2) - c2) * rs_k2
        dw[j] = (dw[j] + di * xi) + dj * xj
        db[j] = (db[j] + di) + dj
        second_params_pair(seci, secj, xi, xj, j)
        put(dsi, j, plus_dstream((g_at(di, w, seci, j) - xi * mgx - mg) * rs, dsti, j))
        put(dsj, j, plus_dstream((g_at(dj, w, secj, j) - xj * mgx2 - mg2) * rs2, dstj, j))


@njit
def backward_rows(dy, dstream, s, r, w, mean, rstd, nf, has_dstream, rms, ds, dw, db, sbuf, kbuf, streamed, second):
    """``ds`` of the rows and their share of ``dweight`` (``dw``) and ``dbias`` (``db``): two
    passes over each row while it sits in cache; rows of PAIR_MIN_COLS or more take their
    second pass two at a time (:func:`_gradient_pair`), the same bits. ``r``: None (``s`` is
    the stream), or the residual, ``s`` then being ``x`` (see :func:`.pieces.stream_row`).
    ``sbuf``: two rows of scratch. ``streamed``: True to write ``ds`` with non-temporal stores, else None.
    ``second``: ``(dy1, weight1, dweight1, dbias1)`` of a second norm of the same rows, or None.
    A row scaled for overflow (rstd below _SCALE_BELOW_RSTD) runs alone, from its scaled copy
    (:func:`_backward_row`); a pair with such a row runs as two rows, in row order: the same
    dweight/dbias sums."""
    m = s.shape[0]
    paired = m - m % 2 if w.shape[0] >= PAIR_MIN_COLS else 0
    one = nf / nf
    for i in range(0, paired, 2):
        if rstd[i] < _SCALE_BELOW_RSTD or rstd[i + 1] < _SCALE_BELOW_RSTD:
            _backward_row(
                dy, dstream, s, r, w, mean, rstd, nf, has_dstream, rms, ds, dw, db, sbuf, kbuf, streamed, second, i
            )
            _backward_row(
                dy, dstream, s, r, w, mean, rstd, nf, has_dstream, rms, ds, dw, db, sbuf, kbuf, streamed, second, i + 1
            )
            continue
        (si, ri), dyi = stream_row(s[i], index_or_none(r, i), sbuf[0]), dy[i]
        (sj, rj), dyj = stream_row(s[i + 1], index_or_none(r, i + 1), sbuf[1]), dy[i + 1]
        seci, secj = second_grad_row(second, i), second_grad_row(second, i + 1)
        ci = _row_coefs(si, ri, dyi, w, seci, mean, rstd, i, nf, rms, one)
        cj = _row_coefs(sj, rj, dyj, w, secj, mean, rstd, i + 1, nf, rms, one)
        if has_dstream:
            rows = (
                (si, ri, dyi, seci, dstream[i], ci, rstd[i], output_row(ds, i, streamed)),
                (sj, rj, dyj, secj, dstream[i + 1], cj, rstd[i + 1], output_row(ds, i + 1, streamed)),
            )
            _gradient_pair(rows, w, dw, db)
        else:
            rows = (
                (si, ri, dyi, seci, None, ci, rstd[i], output_row(ds, i, streamed)),
                (sj, rj, dyj, secj, None, cj, rstd[i + 1], output_row(ds, i + 1, streamed)),
            )
            _gradient_pair(rows, w, dw, db)
    for i in range(paired, m):
        if rstd[i] < _SCALE_BELOW_RSTD:
            _backward_row(
                dy, dstream, s, r, w, mean, rstd, nf, has_dstream, rms, ds, dw, db, sbuf, kbuf, streamed, second, i
            )
            continue
        (si, ri), dyi = stream_row(s[i], index_or_none(r, i), sbuf[0]), dy[i]
        sec = second_grad_row(second, i)
        coefs = _row_coefs(si, ri, dyi, w, sec, mean, rstd, i, nf, rms, one)
        if has_dstream:
            gradient_pass(si, ri, dyi, w, sec, dstream[i], coefs, rstd[i], output_row(ds, i, streamed), dw, db)
        else:
            gradient_pass(si, ri, dyi, w, sec, None, coefs, rstd[i], output_row(ds, i, streamed), dw, db)


@njit
def _backward_row(dy, dstream, s, r, w, mean, rstd, nf, has_dstream, rms, ds, dw, db, sbuf, kbuf, streamed, second, i):
    """Row ``i`` of :func:`backward_rows` alone. A row scaled for overflow is read from its
    scaled copy in ``sbuf[0]`` (:func:`scaled_row`), plus a row of -0.0 in ``sbuf[1]`` in place
    of the residual (``v + -0.0`` is ``v``, -0.0 included), so that where the types allow, one
    compiled loop serves both."""
    (si, ri), dyi = stream_row(s[i], index_or_none(r, i), sbuf[0]), dy[i]
    dsi = output_row(ds, i, streamed)
    args = (dyi, w, second_grad_row(second, i), mean, rstd, i, nf, rms, has_dstream, dstream[i], dsi, dw, db)
    if rstd[i] < _SCALE_BELOW_RSTD:
        k = scaled_row(si, ri, sbuf[0], kbuf)
        _row_passes(sbuf[0], negative_zeros(ri, sbuf[1]), k, args)
    else:
        _row_passes(si, ri, nf / nf, args)


@njit
def _row_passes(si, ri, k, args):
    """Both passes of one row (:func:`_row_coefs`, :func:`gradient_pass`), the row ``si`` (plus
    ``ri``) already scaled by ``k``; ``dsti`` read only when ``has_dstream``."""
    dyi, w, sec, mean, rstd, i, nf, rms, has_dstream, dsti, dsi, dw, db = args
    coefs = _row_coefs(si, ri, dyi, w, sec, mean, rstd, i, nf, rms, k)
    if has_dstream:
        gradient_pass(si, ri, dyi, w, sec, dsti, coefs, rstd[i], dsi, dw, db)
    else:
        gradient_pass(si, ri, dyi, w, sec, None, coefs, rstd[i], dsi, dw, db)


@njit
def backward_rows_branch(
    dy,
    dstream,
    x,
    r,
    w,
    mean,
    rstd,
    nf,
    has_dstream,
    rms,
    ds,
    dw,
    db,
    sbuf,
    kbuf,
    branch,
    first,
    gates,
    dx,
    dls,
    streamed,
    second,
):
    """:func:`backward_rows` through the branch: the stream and its gates recomputed into
    ``sbuf``/``gates`` (:func:`.branch.stream_through_branch`), then besides ``ds`` (the
    residual's gradient) ``dx`` and the row's share of ``dlayer_scale`` (``dls``), as
    :func:`addnorm.reference.branch_backward`. ``streamed``: True to write ``dx`` with
    non-temporal stores (``ds`` is read back, and keeps plain ones), else None."""
    rowscale, layer_scaled = branch[5], branch[7]
    gate, factor = gates[0], gates[1]
    for i in range(x.shape[0]):
        xi, dyi, dsi, dxi = x[i], dy[i], ds[i], output_row(dx, i, streamed)
        stream_through_branch(xi, r[i], sbuf, gates, branch, first + i)
        sec = second_grad_row(second, i)
        k = scaled_row(sbuf, None, sbuf, kbuf) if rstd[i] < _SCALE_BELOW_RSTD else nf / nf
        coefs = _row_coefs(sbuf, None, dyi, w, sec, mean, rstd, i, nf, rms, k)
        rsc = rowscale[first + i]
        # short loops over the row, so that each vectorizes: ds (and dweight, dbias) as without
        # a branch, then dx and dlayer_scale from ds as stored (as autograd reads it)
        if has_dstream:
            gradient_pass(sbuf, None, dyi, w, sec, dstream[i], coefs, rstd[i], dsi, dw, db)
        else:
            gradient_pass(sbuf, None, dyi, w, sec, None, coefs, rstd[i], dsi, dw, db)
        for j in range(w.shape[0]):
            put(dxi, j, load(dsi, j) * factor[j] * rsc)
        if layer_scaled:  # (a row of ones stands in for a missing layer scale: no gradient to take)
            for j in range(w.shape[0]):
                dls[j] += load(dsi, j) * (load(xi, j) * gate[j] * rsc)
