"""The parallel kernels: every calling thread claims blocks of rows until none is left.

Rows are split into contiguous blocks of ``block_rows`` rows. Each thread that runs a kernel
claims the next block from a shared atomic counter (``counters[0]``), runs the row loop of
:mod:`.rows` on it, counts it done (``counters[1]``), and returns once every block is done, so
the results are complete whichever threads ran. Claiming blocks, rather than fixing one share
per thread, matters on shared machines: a thread that starts late (descheduled, still spinning
down from torch's last op) takes fewer blocks instead of holding the others up.

``dweight``/``dbias`` (and ``dlayer_scale``) accumulate into one partial row per block, not per
thread, and the backward's blocks are fixed by the shape (``reduction_blocks``), so their sums
depend neither on which thread ran which block nor on how many threads ran: the same bits on
any thread count (docs/reliability.md, "3. Determinism and the reduction contract").
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .branch import dropped_row, prepare_branch
from .floats import fence, widened
from .jit import njit, overload
from .pieces import index_or_none
from .rows import backward_rows, backward_rows_branch, forward_rows


@intrinsic
def _atomic_increment(typingctx, counters, k):
    """Atomically add 1 to ``counters[k]`` (an int64 array) and return its previous value."""

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]])
        return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "seq_cst")

    return types.int64(counters, types.intp), codegen


@intrinsic
def _atomic_load(typingctx, counters, k):
    """Atomic load of ``counters[k]``: a value another thread is updating."""

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]])
        return builder.load_atomic(ptr, "seq_cst", 8)

    return types.int64(counters, types.intp), codegen


_NEXT_BLOCK, _BLOCKS_DONE = 0, 1  # the two counters, in this order (entry.COUNTERS)


def _fence_if(streamed):
    """A memory fence after non-temporal stores (``streamed`` True; nothing when None): they are
    weakly ordered, and must reach memory before another thread is told the block is done."""


@overload(_fence_if)
def _fence_if_impl(streamed):
    if isinstance(streamed, types.NoneType):
        return lambda streamed: None
    return lambda streamed: fence()


def _second_block(second, lo, hi):
    """The forward's second norm ``(weight1, bias1, y1)`` on rows ``lo:hi``, or None."""


@overload(_second_block)
def _second_block_impl(second, lo, hi):
    if isinstance(second, types.NoneType):
        return lambda second, lo, hi: None
    return lambda second, lo, hi: (second[0], second[1], second[2][lo:hi])


def _second_widened(second, like):
    """The forward's second norm with ``weight1``/``bias1`` :func:`.floats.widened`, or None."""


@overload(_second_widened)
def _second_widened_impl(second, like):
    if isinstance(second, types.NoneType):
        return lambda second, like: None
    return lambda second, like: (widened(second[0], like), widened(second[1], like), second[2])


def _second_grad_widened(second, like):
    """The backward's second norm with ``weight1`` :func:`.floats.widened`, or None."""


@overload(_second_grad_widened)
def _second_grad_widened_impl(second, like):
    if isinstance(second, types.NoneType):
        return lambda second, like: None
    return lambda second, like: (second[0], widened(second[1], like), second[2], second[3])


def _second_grad_block(second, blk, lo, hi):
    """The backward's second norm ``(dy1, weight1, dweight1, dbias1)`` on rows ``lo:hi``, with
    block ``blk``'s partial rows of ``dweight1``/``dbias1`` zeroed; or None."""


@overload(_second_grad_block)
def _second_grad_block_impl(second, blk, lo, hi):
    if isinstance(second, types.NoneType):
        return lambda second, blk, lo, hi: None

    def block(second, blk, lo, hi):
        second[2][blk][:] = 0
        second[3][blk][:] = 0
        return (second[0][lo:hi], second[1], second[2][blk], second[3][blk])

    return block


def _added(x1, r, n, cd):
    """``(x1, its prepared dropout branch or None, a scratch row of the stream dtype (``r``'s), a
    gate row)`` for :func:`.pieces.residual_row`, or None without ``x1``."""


@overload(_added)
def _added_impl(x1, r, n, cd):
    if isinstance(x1, types.NoneType):
        return lambda x1, r, n, cd: None
    return lambda x1, r, n, cd: (x1[0], prepare_branch(x1[1], n), np.empty_like(r[0]), np.empty(n, cd))


def _added_block(added, lo, hi):
    """``added`` on rows ``lo:hi`` (the scratch rows shared), or None."""


@overload(_added_block)
def _added_block_impl(added, lo, hi):
    if isinstance(added, types.NoneType):
        return lambda added, lo, hi: None
    return lambda added, lo, hi: (added[0][lo:hi], added[1], added[2], added[3])


@njit
def _claim_block(counters, block_rows, m):
    """``(block, lo, hi)``: the next unclaimed block of rows, or block -1 when none is left."""
    blk = _atomic_increment(counters, _NEXT_BLOCK)
    lo = blk * block_rows
    if lo >= m:
        return -1, m, m
    return blk, lo, min(m, lo + block_rows)


@njit
def _wait_all_blocks(counters, block_rows, m):
    """Return once every block is done: the results are then complete, whether or not the other
    threads ever got a block."""
    blocks = (m + block_rows - 1) // block_rows
    while _atomic_load(counters, _BLOCKS_DONE) < blocks:
        pass


@njit(nogil=True, error_model="numpy")
def forward_blocks(
    x, r, w, b, eps, nf, has_residual, write_s, write_stats, rms, y, s, mean, rstd,
    counters, block_rows, direct, br, streamed, second, x1,
):  # fmt: skip
    """:func:`.rows.forward_rows` over the blocks this thread claims. ``br``: the branch's
    arguments (``entry.read_branch``), or None; ``streamed``: True to write ``y`` (and ``y1``)
    with non-temporal stores, fenced before the block is counted done, else None; ``second``:
    ``(weight1, bias1, y1)`` of a second norm, or None; ``x1``: parallel blocks' second sublayer
    output and its dropout branch's arguments, ``(x1, br1 or None)`` (``entry.read_x1``), added
    to the residual row by row (:func:`.pieces.residual_row`), or None."""
    m, n = x.shape
    w, b, second = widened(w, rstd), widened(b, rstd), _second_widened(second, rstd)
    added = _added(x1, r, n, rstd.dtype)
    buf = np.empty((3, n), rstd.dtype)  # the row (two, alternating, when pipelined) and a scaled row
    kbuf = np.empty(1, rstd.dtype)
    branch = prepare_branch(br, n)
    gates = np.empty((2, n if br is not None else 0), rstd.dtype)
    blk, lo, hi = _claim_block(counters, block_rows, m)
    while blk >= 0:
        forward_rows(
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
            branch,
            lo,
            gates,
            streamed,
            _second_block(second, lo, hi),
            _added_block(added, lo, hi),
        )
        _fence_if(streamed)
        _atomic_increment(counters, _BLOCKS_DONE)
        blk, lo, hi = _claim_block(counters, block_rows, m)
    _wait_all_blocks(counters, block_rows, m)


@njit(nogil=True, error_model="numpy")
def backward_blocks(
    dy, dstream, s, r, w, mean, rstd, nf, has_dstream, rms, ds, dw, db, counters, block_rows, br, dx, dls, streamed,
    second,
):  # fmt: skip
    """:func:`.rows.backward_rows` (or ``backward_rows_branch``) over the blocks this thread
    claims. ``dw``/``db`` (and ``dls``): one partial row per block (not per thread), so that the
    sums do not depend on which thread ran which block. ``streamed``: True to write ``ds`` (with a
    branch, whose loops read ``ds`` back, ``dx``) with non-temporal stores, else None. ``second``:
    ``(dy1, weight1, dweight1, dbias1)`` of a second norm (partial rows per block, as ``dw``), or
    None."""
    m, n = s.shape
    w, second = widened(w, rstd), _second_grad_widened(second, rstd)
    sbuf = np.empty((2, n), rstd.dtype)
    kbuf = np.empty(1, rstd.dtype)
    branch = prepare_branch(br, n)
    gates = np.empty((2, n if br is not None else 0), rstd.dtype)
    blk, lo, hi = _claim_block(counters, block_rows, m)
    while blk >= 0:
        dw[blk][:] = 0  # (scratch from torch.empty: zeros would cost a call each)
        db[blk][:] = 0
        sec = _second_grad_block(second, blk, lo, hi)
        if br is not None:  # an argument: the other branch is pruned when compiling
            dls[blk][:] = 0
            backward_rows_branch(
                dy[lo:hi],
                dstream[lo:hi],
                s[lo:hi],
                index_or_none(r, slice(lo, hi)),
                w,
                mean[lo:hi],
                rstd[lo:hi],
                nf,
                has_dstream,
                rms,
                ds[lo:hi],
                dw[blk],
                db[blk],
                sbuf[0],
                kbuf,
                branch,
                lo,
                gates,
                dx[lo:hi],
                dls[blk],
                streamed,
                sec,
            )
        else:
            backward_rows(
                dy[lo:hi],
                dstream[lo:hi],
                s[lo:hi],
                index_or_none(r, slice(lo, hi)),
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
                streamed,
                sec,
            )
        _fence_if(streamed)
        _atomic_increment(counters, _BLOCKS_DONE)
        blk, lo, hi = _claim_block(counters, block_rows, m)
    _wait_all_blocks(counters, block_rows, m)


@njit(nogil=True, error_model="numpy")
def dropped_blocks(src, addend, out, counters, block_rows, br, cd):
    """:func:`.branch.dropped_row` over the rows of the blocks this thread claims. ``addend``:
    None (``out = dropout(src)``) or the rows added; ``br``: the dropout branch's arguments
    (``entry.read_branch``); ``cd``: the statistics dtype."""
    m, n = out.shape
    branch = prepare_branch(br, n)
    gate = np.empty(n, cd)
    blk, lo, hi = _claim_block(counters, block_rows, m)
    while blk >= 0:
        for i in range(lo, hi):
            dropped_row(src[i], index_or_none(addend, i), out[i], gate, branch, i)
        _atomic_increment(counters, _BLOCKS_DONE)
        blk, lo, hi = _claim_block(counters, block_rows, m)
    _wait_all_blocks(counters, block_rows, m)
