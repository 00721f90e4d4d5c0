"""Row statistics: the row sums, the centred mean and variance, and the scaling of huge rows.

The formulas are :mod:`addnorm.reference`'s (docs/reliability.md, "2. Hard numerics"): the mean
corrected by the mean of the centred row, the variance of the deviations from that corrected
mean (never ``E[s^2] - E[s]^2``), and a row whose sum of squares overflows scaled by a power of
two and done again. Each helper works on one row that sits in L1/L2.

Only the row sums are reassociated (``fastmath={"reassoc"}``), so that they vectorize; their
partial sums are then shorter, so no less accurate. No other fastmath flag anywhere: the order
of every other operation is the compiled code's, fixed on a machine.
"""

from __future__ import annotations

import math

import numpy as np

from ... import reference
from .floats import load, put, round_to
from .jit import njit

SUM_MATH = {"reassoc"}  # the one fastmath flag, for the row sums only

# Every row sum adds blocks of this many elements in vector lanes, then the blocks' sums in
# float64: the error of a lane sum grows with the number of its terms, so a wide row's sums
# (of squares above all: nothing corrects them) stay as accurate as a row of one block's. A row
# of one block is summed as a lane sum alone (its float64 total is exact).
_SUM_BLOCK = 1024

_CANCEL = reference.CANCEL  # a third pass once c*c exceeds mean(d*d) / _CANCEL


@njit(fastmath=SUM_MATH)
def row_sum(a):
    """Sum of a row, rounded to its dtype: lane sums of blocks of _SUM_BLOCK, added in float64."""
    n = a.shape[0]
    total = np.float64(0.0)
    for lo in range(0, n, _SUM_BLOCK):
        block = a[lo : min(lo + _SUM_BLOCK, n)]  # a slice, so that the loop vectorizes (an index range does not)
        part = block[0]  # not block[0] - block[0] as a typed zero: that is NaN when block[0] is inf
        for j in range(1, block.shape[0]):
            part += block[j]
        total += part
    return round_to(a, total)


@njit(fastmath=SUM_MATH, inline="always")  # (a row of one block: the loop as it was)
def _deviation_block(a, mu):
    total = sq = mu - mu
    for j in range(a.shape[0]):
        d = a[j] - mu
        total += d
        sq += d * d
    return total, sq


@njit(fastmath=SUM_MATH)
def deviation_sums(a, mu):
    """Sum of ``d = a - mu`` and of ``d * d`` in one pass, by blocks as :func:`row_sum`."""
    n = a.shape[0]
    if n <= _SUM_BLOCK:
        return _deviation_block(a, mu)
    total = sq = np.float64(0.0)
    for lo in range(0, n, _SUM_BLOCK):
        part, part_sq = _deviation_block(a[lo : min(lo + _SUM_BLOCK, n)], mu)
        total += part
        sq += part_sq
    return round_to(a, total), round_to(a, sq)


@njit(fastmath=SUM_MATH, inline="always")  # (a row of one block: the loop as it was)
def _dot_block(a, b):
    total = a[0] * b[0]
    for j in range(1, a.shape[0]):
        total += a[j] * b[j]
    return total


@njit(fastmath=SUM_MATH)
def dot(a, b):
    """Sum of ``a * b``, by blocks as :func:`row_sum`."""
    n = a.shape[0]
    if n <= _SUM_BLOCK:
        return _dot_block(a, b)
    total = np.float64(0.0)
    for lo in range(0, n, _SUM_BLOCK):
        hi = min(lo + _SUM_BLOCK, n)
        total += _dot_block(a[lo:hi], b[lo:hi])
    return round_to(a, total)


@njit(fastmath=SUM_MATH, inline="always")  # (a row of one block: the loop as it was)
def _load_block(xi, ri, si, buf, has_residual, write_s, rms):
    total = round_to(buf, 0.0)
    for j in range(buf.shape[0]):
        if has_residual:
            v = load(xi, j) + load(ri, j)
            v = put(si, j, v) if write_s else round_to(si, v)
        else:
            v = load(xi, j)
        buf[j] = v
        total += v * v if rms else v
    return total


@njit(fastmath=SUM_MATH)
def load_row(xi, ri, si, buf, has_residual, write_s, rms):
    """``buf`` = the row of ``s`` in the statistics dtype: ``x + residual`` rounded to the stream
    dtype (both already in it), written to ``si`` when ``write_s``; else ``x``. Returns the sum of
    the row (of its squares for RMSNorm), taken in the same pass, by blocks as :func:`row_sum`."""
    n = buf.shape[0]
    if n <= _SUM_BLOCK:
        return _load_block(xi, ri, si, buf, has_residual, write_s, rms)
    total = np.float64(0.0)
    for lo in range(0, n, _SUM_BLOCK):
        hi = min(lo + _SUM_BLOCK, n)
        total += _load_block(xi[lo:hi], ri[lo:hi], si[lo:hi], buf[lo:hi], has_residual, write_s, rms)
    return round_to(buf, total)


@njit
def add_row(xi, ri, si):
    """``si = xi + ri``, all three in the statistics dtype."""
    for j in range(si.shape[0]):
        si[j] = xi[j] + ri[j]


@njit
def row_scale(a, k):
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


@njit  # not SUM_MATH: reassociation would turn (a - mu) - c into a - (mu + c), rounded
def corrected_square_sum(a, mu, c):
    """Sum of ``((a - mu) - c)**2``, the squared deviations from the corrected mean, summed
    pairwise: such a row is often a few large squares among many tiny ones, which added one by
    one to a large partial sum would round away (as torch's cascade sum in the reference, the
    error grows with log N)."""
    n = a.shape[0]
    t = np.empty(n, a.dtype)  # rare rows only (see centred_stats)
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


@njit
def centred_stats(row, total, nf):
    """``(mu, c, var)`` of a row whose sum is ``total``: var of the deviations from ``mu + c``.

    The mean is off by its rounding error; the mean of the centred row measures it (``c``,
    subtracted separately): exact centring, as the reference, for constant rows and rows far
    from zero. The variance of the corrected deviations ``d - c`` is then ``mean(d*d) - c*c``,
    except where ``c*c`` is not small beside ``mean(d*d)`` (a near-constant row far from zero,
    spread over a few ulps of its mean): that difference would cancel, so a third pass over the
    row (in cache) squares ``d - c`` itself, as the reference does.
    """
    mu = total / nf
    dev, sq = deviation_sums(row, mu)
    c = dev / nf
    if c * c * _CANCEL > sq / nf:
        return mu, c, corrected_square_sum(row, mu, c) / nf
    return mu, c, max(sq / nf - c * c, nf - nf)


@njit
def row_stats(buf, nf, rms):
    """``(mu, c, var)`` of a row: var of the deviations from ``mu + c`` (:func:`centred_stats`)."""
    if rms:
        return nf - nf, nf - nf, dot(buf, buf) / nf
    return centred_stats(buf, row_sum(buf), nf)
