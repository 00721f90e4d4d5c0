"""Fused CPU kernels (numba): the contract of :mod:`addnorm.reference`, one pass over memory.

Rows are split into contiguous blocks (``blocks_per_thread`` per thread, :mod:`.config`); the
threads claim blocks
from an atomic counter and run a compiled, GIL-free row loop on each. The modules, from the
bottom up:

- :mod:`.config`: the settings (threads, blocks, huge pages), one table.
- :mod:`.floats`: element loads and stores in every dtype (16-bit floats as their bit patterns).
- :mod:`.numerics`: the row sums and statistics (corrected mean, centred variance, row scaling).
- :mod:`.branch`: the sublayer branch fused into the add (dropout hash, layer scale, rowscale).
- :mod:`.rows`: the forward and backward loops over a block of rows.
- :mod:`.pieces`: the row pieces those loops take, chosen by type when compiling.
- :mod:`.blocks`: the parallel kernels, whose threads claim blocks of rows.
- :mod:`.entry`: the C entry points and the argument slots they read.
- :mod:`.launch`: the threads an entry runs on, and the tensors a call hands it.

This module is the backend contract (:class:`addnorm.backend.Backend`): ``CAPABILITIES``,
``unavailable_reason``, ``forward``, ``backward``.

Determinism: ``dweight``/``dbias`` are summed per block of rows in row order, then the blocks'
partial rows in a fixed tree (:func:`addnorm.reference.sum_partials`); the backward's blocks
depend on the shape alone (:func:`reduction_blocks`), so the bits are the same from run to run
and for any thread count; which thread runs a row never changes its bits.

Accuracy: no fastmath except reassociation inside the row sums (:mod:`.numerics`); the order of
operations is fixed by the compiled code, so results are run-to-run deterministic on a machine,
not across CPU generations. Statistics and arithmetic are float32 (float64 for
float64 streams); 16-bit floats are widened to float32 and rounded back to nearest-even.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from ... import reference
from ...backend import Branch, Capabilities, Grads, check_s_parts
from . import config
from .branch import keep_rows
from .entry import NO_BRANCH, backward_entry, dropped_entry, float64_bits, forward_entry
from .launch import (
    branch_args,
    constant_row,
    contiguous_rows,
    dropout_args,
    empty_output,
    empty_vector,
    kernel_param_dtype,
    kernel_ready,
    param_row,
    run_on_threads,
    streamed,
)

# Post-norm training of float32 and float64 streams saves x and residual, and backward recomputes
# s = x + residual as it reads them (addnorm.autograd.save_plan): the forward writes y alone, not
# s and y. Same bytes over forward + backward, one fresh output fewer, and fresh outputs are what
# cost most there (see docs/benchmarks.md, "Fresh outputs page-fault"). 16-bit streams save s:
# their backward is bound by its arithmetic, of which the recomputed add and its rounding are a
# large part (docs/performance-log.md, "CPU backward: where the time goes").
CAPABILITIES = Capabilities(
    device_types=("cpu",), recomputes_stream=(torch.float32, torch.float64), second_norm=True, adds_x1=True
)


_NO_SECOND = (0, 0, 0)  # the forward's WEIGHT1, BIAS1, Y1 slots without a second norm
_NO_X1 = (0, 0, 0, 0)  # the forward's X1, X1_SEED, X1_KEEP_THRESHOLD, X1_SCALE slots without x1
_NO_SECOND_GRAD = (0, 0, 0, 0)  # the backward's DY1, WEIGHT1, DWEIGHT1, DBIAS1 slots


def unavailable_reason(x: Tensor | None) -> str | None:
    return None  # numba is a dependency of addnorm; the device is checked against CAPABILITIES


def keep_mask(seed: Tensor, rows: int, n: int, p: float) -> Tensor:
    """:func:`addnorm.reference.keep_mask` of rows ``0..rows-1`` (bool, ``(rows, n)``), the same
    bits from the kernels' hash: one compiled loop instead of a dozen int64 torch ops."""
    threshold = reference.keep_threshold(p)
    if threshold >= 1 << 32:  # p = 1: nothing kept
        return torch.zeros((rows, n), dtype=torch.bool, device="cpu")
    out = torch.empty((rows, n), dtype=torch.bool, device="cpu")
    keep_rows(int(seed), threshold, out.numpy())
    return out


def dropped(src: Tensor, addend: Tensor | None, n: int, p: float, seed: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``addend + dropout(src)`` over rows of ``n`` features, summed in the statistics dtype of
    ``src``'s and rounded once to ``out_dtype`` (:func:`addnorm.reference.stream` of a
    dropout-only :class:`~addnorm.backend.Branch`, bit for bit); without ``addend``,
    ``dropout(src)``: parallel blocks' ``x1`` and its gradient in one pass each, the mask from
    the kernels' hash. ``addend``, when given, has ``src``'s dtype and shape; ``0 < p``."""
    src = contiguous_rows(src)
    out = empty_output(src, out_dtype)
    m = src.numel() // n if n else 0
    if m:
        addend = None if addend is None else contiguous_rows(addend)
        threads, block_rows = (1, m) if m * n < config.SETTINGS.parallel_min_elements else thread_plan(m)
        cd = reference.stats_dtype(src.dtype)
        branch_slots, held = branch_args(Branch(p, seed, None, None), m, n, cd)
        args = (  # in entry.DroppedSlot order
            src.data_ptr(),
            0 if addend is None else addend.data_ptr(),
            out.data_ptr(),
            m,
            n,
            block_rows,
        )
        run_on_threads(dropped_entry(src.dtype, out_dtype, addend is not None), threads, args, branch_slots)
        del held
    return out


def _forward_slots(x, residual, w, b, y, s, mean, rstd, m, n, block_rows, rms, eps, second, x1) -> tuple[int, ...]:
    """The forward entry's arguments, in ``entry.ForwardSlot`` order: ``s``, ``mean`` and ``rstd``
    None where not written, ``second`` and ``x1`` their slots (``_NO_SECOND``, ``_NO_X1``)."""
    return (
        x.data_ptr(),
        x.data_ptr() if residual is None else residual.data_ptr(),
        w.data_ptr(),
        b.data_ptr(),
        y.data_ptr(),
        0 if s is None else s.data_ptr(),
        0 if mean is None else mean.data_ptr(),
        0 if rstd is None else rstd.data_ptr(),
        m,
        n,
        block_rows,
        residual is not None,
        s is not None,  # WRITE_S
        rms,
        rstd is not None,  # WRITE_STATS
        float64_bits(eps),
        *second,
        *x1,
    )


def _backward_slots(
    dy, dst, s, residual, w, mean, rstd, ds, dw, db, dx, dls, m, n, block_rows, blocks, dstream, rms, second
) -> tuple[int, ...]:  # fmt: skip
    """The backward entry's arguments, in ``entry.BackwardSlot`` order: ``residual``, ``dw``,
    ``db``, ``dx`` and ``dls`` None where there are none, ``second`` its slots (``_NO_SECOND_GRAD``)."""
    return (
        dy.data_ptr(),
        dst.data_ptr(),
        s.data_ptr(),
        0 if residual is None else residual.data_ptr(),
        w.data_ptr(),
        (rstd if rms else mean).data_ptr(),
        rstd.data_ptr(),
        ds.data_ptr(),
        0 if dw is None else dw.data_ptr(),
        0 if db is None else db.data_ptr(),
        0 if dx is None else dx.data_ptr(),
        0 if dls is None else dls.data_ptr(),
        m,
        n,
        block_rows,
        blocks,
        dstream is not None,
        rms,
        *second,
    )


def thread_plan(rows: int) -> tuple[int, int]:
    """``(threads, block_rows)`` of a forward of ``parallel_min_elements`` or more (smaller ones
    run as one block on the calling thread): torch's thread count, ``blocks_per_thread`` blocks
    each."""
    threads = max(1, min(rows, torch.get_num_threads()))
    blocks = config.SETTINGS.blocks_per_thread * threads if threads > 1 else 1
    return threads, -(-rows // max(1, min(rows, blocks)))


def reduction_blocks(rows: int, cols: int) -> tuple[int, int]:
    """``(blocks, block_rows)`` of the backward: one block below ``parallel_min_elements``, else up
    to ``reduction_blocks`` blocks of at least ``reduction_min_rows`` rows. The shape alone
    decides, never the thread count: dweight/dbias are the same bits on any number of threads
    (docs/reliability.md)."""
    settings = config.SETTINGS
    if rows * cols < settings.parallel_min_elements:
        return 1, max(rows, 1)
    block_rows = -(-rows // max(1, min(settings.reduction_blocks, rows // settings.reduction_min_rows)))
    return -(-rows // block_rows), block_rows


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
    second=None,
    x1=None,
):
    """:func:`addnorm.reference.forward` in one pass over the rows; ``y`` and ``s`` are written
    straight into ``out``/``residual_out`` when given. ``second``: ``(weight1, bias1)`` of a second
    norm of the same stream (parallel blocks), whose output ``y1`` is written by the same loop
    and returned fifth. ``x1``: an :class:`~addnorm.backend.X1` (parallel blocks), added to each
    row of ``residual`` (which must be given) as it is read."""
    if branch is None and second is None and x1 is None and out is None and residual_out is None:
        dtype = x.dtype
        if (
            residual_dtype is None
            and (residual is None or residual.dtype is dtype)
            and (weight is None or weight.dtype is dtype)
            and (bias is None or bias.dtype is dtype)
        ):
            plain = _plain(x, residual, weight, bias, eps, rms, write_stream, write_stats)
            if plain is not None:
                return plain
    n = x.shape[-1]
    y_dtype = sd = x.dtype
    if residual is not None:
        sd = reference.stream_dtype(x, residual, residual_dtype)
        if x.dtype is not sd or residual.dtype is not sd:
            # mixed dtypes (e.g. bf16 x, fp32 stream): cast first, as the reference does, so that one
            # compiled kernel per dtype serves; y then goes through the statistics dtype
            x, residual = x.to(sd), residual.to(sd)
        residual = contiguous_rows(residual)
    if x1 is not None:  # in its own dtype: the kernel rounds each row to the stream dtype first
        x1, p1, seed1 = x1
        if residual is None or x1.shape != x.shape:
            raise ValueError(f"x1 is added to the residual: it needs one, and x's shape {tuple(x.shape)}")
        x1 = contiguous_rows(x1)
    cd = reference.stats_dtype(sd)
    x = contiguous_rows(x)
    m = x.numel() // n if n else 0
    direct = sd is y_dtype  # else y is computed in the statistics dtype, then cast once
    y = out if out is not None and direct else empty_output(x, y_dtype if direct else cd)
    write_s = residual is not None and (write_stream or residual_out is not None)
    s = None
    if write_s:
        s = residual_out if residual_out is not None else empty_output(x, sd)
    mean = rstd = None
    if write_stats:
        mean = None if rms else torch.empty(m, dtype=cd, device="cpu")
        rstd = torch.empty(m, dtype=cd, device="cpu")
    y1, second_args = None, _NO_SECOND
    if second is not None:
        y1 = empty_output(x, y.dtype)
    if m:
        threads, block_rows = (1, m) if m * n < config.SETTINGS.parallel_min_elements else thread_plan(m)
        pd = cd if sd is cd else kernel_param_dtype(sd, cd, weight, bias, *(second or ()))
        w, b = param_row(weight, n, pd, 1.0), param_row(bias, n, pd, 0.0)  # held: the kernel reads them
        branch_slots, held = branch_args(branch, m, n, cd) if branch is not None else (NO_BRANCH, ())
        if second is not None:
            w1, b1 = param_row(second[0], n, pd, 1.0), param_row(second[1], n, pd, 0.0)
            second_args = (w1.data_ptr(), b1.data_ptr(), y1.data_ptr())  # w1, b1 held: the kernel reads them
        x1_args = _NO_X1
        if x1 is not None:
            x1_args = (x1.data_ptr(), *dropout_args(p1, seed1))
        args = _forward_slots(x, residual, w, b, y, s, mean, rstd, m, n, block_rows, rms, eps, second_args, x1_args)
        # y straight to memory when it is the output itself (not a float32 y cast afterwards)
        moved = x.nbytes * (2 + (residual is not None) + write_s + (y1 is not None) + (x1 is not None))
        stream_y = direct and streamed(y, moved) and (y1 is None or streamed(y1, moved))
        x1_dtype, dropped = (None, False) if x1 is None else (x1.dtype, p1 > 0)
        entry = forward_entry(
            sd,
            y.dtype,
            pd,
            branch is not None,
            streamed=stream_y,
            second=y1 is not None,
            x1_dtype=x1_dtype,
            dropped=dropped,
        )
        run_on_threads(entry, threads, args, branch_slots)
        del held
    if y.dtype is not y_dtype:
        y = out.copy_(y) if out is not None else y.to(y_dtype)
    if second is None:
        return y, s, mean, rstd
    return y, s, mean, rstd, y1 if y1.dtype is y_dtype else y1.to(y_dtype)


def plain_forward(x, residual, weight, bias, eps, rms, write_stream):
    """:func:`forward` of the call a decode step makes, in as few steps as it takes (the optional
    ``plain_forward`` of the backend contract, :mod:`addnorm.backend`): ``x``, ``residual`` (or
    None), ``weight`` and ``bias`` (or None) of one dtype; no statistics, buffers or branch.
    Returns ``(y, s)`` (``s`` None unless ``write_stream``), or None where the call is not one of
    these: a tensor :func:`forward` would copy first, work for more than one thread, or outputs
    large enough to stream or to ask for huge pages. The kernel entry and its arguments are
    :func:`forward`'s for the same call, so the bits are too."""
    result = _plain(x, residual, weight, bias, eps, rms, write_stream, False)
    return None if result is None else result[:2]


def _plain(x, residual, weight, bias, eps, rms, write_stream, write_stats):
    """``(y, s, mean, rstd)`` of a call :func:`plain_forward` takes (``residual``, ``weight`` and
    ``bias`` of x's dtype where given), with the statistics when ``write_stats``; else None."""
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    settings = config.SETTINGS
    write_s = residual is not None and write_stream
    moved = x.nbytes * (2 + (residual is not None) + write_s)  # as forward counts them
    if not (
        m
        and m * n < settings.parallel_min_elements
        and moved < settings.streaming_min_bytes
        and x.nbytes < settings.huge_pages_min_bytes
        and kernel_ready(x)
        and (residual is None or kernel_ready(residual))
        and (weight is None or kernel_ready(weight))
        and (bias is None or kernel_ready(bias))
    ):
        return None
    dtype = x.dtype
    y = torch.empty_like(x)
    s = torch.empty_like(x) if write_s else None
    mean = rstd = None
    if write_stats:
        cd = reference.stats_dtype(dtype)
        mean = None if rms else empty_vector(x, m, cd)
        rstd = empty_vector(x, m, cd)
    w = constant_row(n, dtype, 1.0) if weight is None else weight
    b = constant_row(n, dtype, 0.0) if bias is None else bias
    args = _forward_slots(x, residual, w, b, y, s, mean, rstd, m, n, m, rms, eps, _NO_SECOND, _NO_X1)
    run_on_threads(forward_entry(dtype, dtype, dtype, streamed=False), 1, args, NO_BRANCH)  # (by name, as forward)
    return y, s, mean, rstd


def backward(dy, dstream, s_parts, weight, mean, rstd, *, rms, has_bias, branch=None, param_dtype=None, second=None):
    """:func:`addnorm.reference.backward` in two passes over each row; from ``s_parts = (x,
    residual)`` the stream is recomputed as it is read (through the branch, when given).
    ``second``: ``(dy1, weight1, has_bias1)`` of a second norm of the same stream (parallel
    blocks): ``g = dy * weight + dy1 * weight1`` in the same passes, and ``dweight1``/``dbias1``
    in the returned :class:`Grads`."""
    if branch is None and second is None:
        plain = _plain_backward(dy, dstream, s_parts, weight, mean, rstd, rms, has_bias, param_dtype)
        if plain is not None:
            return plain
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
    dy1 = weight1 = None
    if second is not None:
        dy1, weight1, has_bias1 = second
        dy1 = contiguous_rows(dy1 if dy1.dtype is dy.dtype else dy1.to(dy.dtype))
    s, dy = contiguous_rows(s), contiguous_rows(dy)
    if residual is not None:
        residual = contiguous_rows(residual)
    n = s.shape[-1]
    m = s.numel() // n if n else 0
    ds = empty_output(s, sd)
    dx = empty_output(s, sd) if branch is not None else None
    # one block (one thread): the kernel sums dweight and dbias itself, rounded to ``od`` once;
    # else one partial row per block in the statistics dtype, summed below in a fixed tree
    blocks, block_rows = reduction_blocks(m, n)
    threads = 1 if blocks == 1 else min(blocks, max(1, torch.get_num_threads()))
    od = param_dtype if param_dtype is cd or param_dtype is sd else cd
    # separate tensors: the custom op's outputs may not alias. The kernel zeroes each block's row
    # before it sums into it: zeros only where it does not run
    alloc = partial(torch.empty if m else torch.zeros, device="cpu")  # (never the default device)
    if blocks == 1:
        dw = alloc(n, dtype=od) if weight is not None else None
        db = alloc(n, dtype=od) if has_bias else None
    else:
        dw, db = alloc((blocks, n), dtype=cd), alloc((blocks, n), dtype=cd)
    dls = alloc((blocks, n) if blocks > 1 else n, dtype=cd) if branch is not None else None
    dw1 = db1 = None
    if second is not None:  # as dw and db; without bias1, dbias1's partial rows are summed, then dropped
        shape, dtype = ((blocks, n), cd) if blocks > 1 else (n, od)
        dw1 = alloc(shape, dtype=dtype)
        db1 = alloc(shape, dtype=dtype) if has_bias1 or blocks > 1 else None
    second_args = _NO_SECOND_GRAD
    if m:
        dst = s if dstream is None else contiguous_rows(dstream)
        pd = cd if sd is cd else kernel_param_dtype(sd, cd, weight, weight1)
        w = param_row(weight, n, pd, 1.0)  # held: the kernel reads it
        if second is not None:
            w1 = param_row(weight1, n, pd, 1.0)  # held: the kernel reads it
            second_args = (dy1.data_ptr(), w1.data_ptr(), dw1.data_ptr(), 0 if db1 is None else db1.data_ptr())
        branch_slots, held = branch_args(branch, m, n, cd) if branch is not None else (NO_BRANCH, ())
        args = _backward_slots(
            dy,
            dst,
            s,
            residual,
            w,
            mean,
            rstd,
            ds,
            dw,
            db,
            dx,
            dls,
            m,
            n,
            block_rows,
            blocks,
            dstream,
            rms,
            second_args,
        )
        # ds straight to memory; through a branch, whose loops read ds back, dx. The bytes the
        # call moves: dy, s, ds, and residual, dstream and dx where there are
        tensors = 3 + (residual is not None) + (dstream is not None) + (dx is not None) + (dy1 is not None)
        stream = streamed(ds if dx is None else dx, tensors * ds.nbytes)
        summed, branched = residual is not None, branch is not None
        entry = backward_entry(
            sd, dy.dtype, dst.dtype, pd, od, summed, branched, streamed=stream, second=dy1 is not None
        )
        run_on_threads(entry, threads, args, branch_slots)
        del held
    if blocks > 1:  # the per-block partial rows, in a tree fixed by the number of blocks
        dw = reference.sum_partials(dw) if weight is not None else None
        db = reference.sum_partials(db) if has_bias else None
        dls = None if dls is None else reference.sum_partials(dls)
        if second is not None:
            dw1, db1 = reference.sum_partials(dw1), reference.sum_partials(db1) if has_bias1 else None
    if param_dtype is not None:
        dw, db, dw1, db1 = (g if g is None or g.dtype is param_dtype else g.to(param_dtype) for g in (dw, db, dw1, db1))
    if branch is None or branch.layer_scale is None:
        dls = None
    return Grads(ds, dw, db, dx, dls, dw1, db1)


def _plain_backward(dy, dstream, s_parts, weight, mean, rstd, rms, has_bias, param_dtype) -> Grads | None:
    """:func:`backward` without a branch or a second norm, in as few steps as it takes, for a
    call of one block (one thread) whose tensors the kernel reads as they are, all of the stream
    dtype (``param_dtype`` None, it or the statistics dtype); else None. The kernel entry and its
    arguments are :func:`backward`'s for the same call, so the bits are too."""
    s = s_parts[0]
    sd, cd = s.dtype, rstd.dtype
    residual = s_parts[1] if len(s_parts) == 2 else None
    n = s.shape[-1] if s.dim() else 0
    m = s.numel() // n if n else 0
    if not (
        m
        and m * n < config.SETTINGS.parallel_min_elements
        and len(s_parts) <= 2
        and dy.dtype is sd
        and (param_dtype is None or param_dtype is sd or param_dtype is cd)
        and (residual is None or residual.dtype is sd and residual.shape == s.shape and kernel_ready(residual))
        and (dstream is None or dstream.dtype is sd and kernel_ready(dstream))
        and (weight is None or weight.dtype is sd and kernel_ready(weight))
        and kernel_ready(s)
        and kernel_ready(dy)
    ):
        return None
    od = cd if param_dtype is None else param_dtype  # (as backward picks it)
    ds = torch.empty_like(s)
    dw = empty_vector(s, n, od) if weight is not None else None
    db = empty_vector(s, n, od) if has_bias else None
    w = constant_row(n, sd, 1.0) if weight is None else weight
    dst = s if dstream is None else dstream
    args = _backward_slots(
        dy, dst, s, residual, w, mean, rstd, ds, dw, db, None, None, m, n, m, 1, dstream, rms, _NO_SECOND_GRAD
    )
    stream = streamed(ds, (3 + (residual is not None) + (dstream is not None)) * ds.nbytes)  # (as backward counts)
    entry = backward_entry(sd, sd, sd, sd, od, residual is not None, False, streamed=stream)
    run_on_threads(entry, 1, args, NO_BRANCH)
    return Grads(ds, dw, db)
