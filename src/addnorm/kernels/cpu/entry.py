"""The C entry points the threads run, and the layout of the argument block they read.

One call's arguments travel as a block of int64 slots: the two block counters of
:mod:`.blocks`, then tensor addresses, sizes, flags (0 or 1) and floats as their float64 bits,
then the branch's arguments. :class:`ForwardSlot`, :class:`BackwardSlot` and
:class:`BranchSlot` name every slot, once: the entries read them by name, and the Python side
packs plain tuples in that order (keyword arguments would cost more than the packing itself on
small calls; tests/test_cpu_kernels.py checks every slot by name).

An entry is a numba ``cfunc``, ``void entry(int64 *block)``, compiled per combination of
dtypes: threads run it with no Python in between, so no GIL to hand from thread to thread and
no unboxing of a dozen arguments by numba's dispatcher (docs/benchmarks.md, "Dispatch,
threads, compile time, warm start").

Compiled entries are cached on disk (``NUMBA_CACHE_DIR`` or numba's defaults: next to these
files, else a user cache directory), so a second process starts warm; without any writable cache
directory the kernels still work, compiled once per process. numba checks a cached entry against
this file alone, so each entry also holds a digest of the whole package's source (and of
:mod:`addnorm.reference`, whose constants the kernels compile in): an edit to any of them
recompiles instead of loading stale code.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import tempfile
import warnings
from enum import IntEnum, auto
from pathlib import Path

import numpy as np
import torch
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic

from ... import reference
from .blocks import backward_blocks, dropped_blocks, forward_blocks
from .floats import put
from .jit import cfunc, njit, overload

COUNTERS = 2  # slots 0 and 1: next block to claim, blocks done (see .blocks); each call zeroes them


class ForwardSlot(IntEnum):
    X = COUNTERS
    RESIDUAL = auto()  # (x's address again without a residual: never read then)
    WEIGHT = auto()
    BIAS = auto()
    Y = auto()
    S = auto()  # 0 unless WRITE_S
    MEAN = auto()  # 0 unless WRITE_STATS, and for RMSNorm
    RSTD = auto()  # 0 unless WRITE_STATS
    ROWS = auto()
    COLS = auto()
    BLOCK_ROWS = auto()
    HAS_RESIDUAL = auto()
    WRITE_S = auto()
    RMS = auto()
    WRITE_STATS = auto()
    EPS = auto()  # float64 bits
    WEIGHT1 = auto()  # the second norm (parallel blocks): 0 without one
    BIAS1 = auto()  # (weight1's address again without bias1: never read then)
    Y1 = auto()
    X1 = auto()  # parallel blocks' second sublayer output, added to the residual: 0 without one
    X1_SEED = auto()  # x1's dropout: its seed, keep threshold and scale (float64 bits); 0 without
    X1_KEEP_THRESHOLD = auto()
    X1_SCALE = auto()
    BRANCH = auto()  # the first of the branch's slots (BranchSlot)


class BackwardSlot(IntEnum):
    DY = COUNTERS
    DSTREAM = auto()  # (s's address again without one: never read then)
    S = auto()  # s, or x when the stream is recomputed (RESIDUAL, or through the branch)
    RESIDUAL = auto()  # 0 unless the stream is recomputed as x + residual
    WEIGHT = auto()
    MEAN = auto()  # (rstd's address for RMSNorm: never read then)
    RSTD = auto()
    DS = auto()
    DWEIGHT = auto()  # 0: not wanted (one block); else BLOCKS partial rows
    DBIAS = auto()  # as DWEIGHT
    DX = auto()  # 0 without a branch
    DLAYER_SCALE = auto()  # BLOCKS partial rows; 0 without a branch
    ROWS = auto()
    COLS = auto()
    BLOCK_ROWS = auto()
    BLOCKS = auto()
    HAS_DSTREAM = auto()
    RMS = auto()
    DY1 = auto()  # the second norm (parallel blocks): 0 without one
    WEIGHT1 = auto()
    DWEIGHT1 = auto()  # as DWEIGHT
    DBIAS1 = auto()  # as DWEIGHT
    BRANCH = auto()  # the first of the branch's slots (BranchSlot)


class DroppedSlot(IntEnum):
    """``out = addend + dropout(src)``, or ``dropout(src)``: parallel blocks' ``x1`` and its
    gradient, through the branch's slots (a dropout-only branch)."""

    SRC = COUNTERS
    ADDEND = auto()  # 0 without one
    OUT = auto()
    ROWS = auto()
    COLS = auto()
    BLOCK_ROWS = auto()
    BRANCH = auto()  # the first of the branch's slots (BranchSlot)


class BranchSlot(IntEnum):
    """Offsets from a direction's ``BRANCH`` slot; all 0 without a branch."""

    SEED = 0
    KEEP_THRESHOLD = auto()
    SCALE = auto()  # float64 bits
    LAYER_SCALE = auto()  # address of a row of COLS factors (ones for a missing layer scale)
    ROWSCALE = auto()  # address of ROWS factors (ones for a missing rowscale)
    LAYER_SCALED = auto()  # a layer scale was given: its gradient is wanted


SLOTS = max(ForwardSlot.BRANCH, BackwardSlot.BRANCH, DroppedSlot.BRANCH) + len(BranchSlot)


NO_BRANCH = (0,) * len(BranchSlot)  # the branch's slots without a branch


def _pack_into(layout: type[IntEnum]):
    return struct.Struct(f"{layout.BRANCH + len(BranchSlot)}q").pack_into


# ``PACK_INTO[len(args)](block, 0, *ZEROED_COUNTERS, *args, *branch)``: a call's slots (the
# counters, its own in ForwardSlot, BackwardSlot or DroppedSlot order, the branch's) into a
# ctypes block in one call; keyed by the number of a layout's own slots, which differs per layout
ZEROED_COUNTERS = (0,) * COUNTERS
_LAYOUTS = (ForwardSlot, BackwardSlot, DroppedSlot)
PACK_INTO = {layout.BRANCH - COUNTERS: _pack_into(layout) for layout in _LAYOUTS}
assert len(PACK_INTO) == len(_LAYOUTS), "two slot layouts with as many slots of their own"

NUMPY_DTYPES = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.bfloat16: np.uint16,
    torch.float16: np.int16,
}


def _source_digest() -> str:
    """A digest of the source the entries compile from: this package and addnorm.reference."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")) + [Path(reference.__file__)]:
        try:
            digest.update(path.read_bytes())
        except OSError:  # no source to read (a frozen install): numba's own check stands alone
            digest.update(path.name.encode())
    return digest.hexdigest()


SOURCE_DIGEST = _source_digest()


@intrinsic
def _pointer(typingctx, address):
    """The int64 ``address`` as a pointer, for ``carray``."""

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(types.int64), codegen


def _stats_dtype(sd):
    """The statistics dtype (numpy) of rows of numpy dtype ``sd``: float64 for float64, else
    float32 (:func:`addnorm.reference.stats_dtype`)."""
    return np.float64 if sd == np.float64 else np.float32


@njit(inline="always")
def _slots(block):
    """The argument block as its two views: int64 slots and float64 slots (the same memory)."""
    return carray(block, SLOTS, np.int64), carray(block, SLOTS, np.float64)


def _lock_path(fn) -> Path:
    """The lock file of entry ``fn``: named by what makes the entry (its maker, the dtypes and
    flags in its closure, the source digest) and the cache it goes to, the same in every
    process."""
    made_of = [fn.__qualname__, *(repr(cell.cell_contents) for cell in fn.__closure__ or ())]
    made_of.append(os.environ.get("NUMBA_CACHE_DIR", ""))
    name = hashlib.sha256("\n".join(made_of).encode()).hexdigest()[:24]
    return Path(tempfile.gettempdir()) / f"addnorm-compile-{os.getuid()}" / f"{name}.lock"


@contextlib.contextmanager
def _compiling_alone(fn):
    """Held while entry ``fn`` compiles: one process at a time compiles an entry, and the others
    that want it wait, then load it from the disk cache, instead of compiling it too (processes
    started together on a cold cache: test workers, ``torchrun`` ranks, data-loader workers).
    An advisory ``flock``, released when its process ends; without one (no ``fcntl``, no
    writable lock directory) each process compiles as it would alone."""
    try:
        import fcntl

        path = _lock_path(fn)
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path, "a")  # noqa: SIM115 (closed below, after the compile)
    except (ImportError, OSError, AttributeError):  # (Windows has no fcntl nor os.getuid)
        yield
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: compile as alone
            pass
        yield


def _compile_entry(fn):
    """``fn(block)`` compiled as a C function ``void fn(int64 *block)``, cached on disk."""
    sig = types.void(types.voidptr)
    try:
        with _compiling_alone(fn):
            return cfunc(sig, cache=True)(fn)
    except RuntimeError as err:  # no writable cache directory: compile per process instead
        warnings.warn(
            f"addnorm: numba cache unavailable ({err}); kernels compile on first use", RuntimeWarning, stacklevel=3
        )
        return cfunc(sig)(fn)


def read_branch(a, f, at, m, n, cd, branched):
    """The branch's arguments from slots ``at``.. (int64 view ``a``, float64 view ``f``) as
    :func:`.branch.prepare_branch` takes them; None (a constant, so the branch code is pruned
    when compiling) without a branch."""


@overload(read_branch)
def _read_branch_impl(a, f, at, m, n, cd, branched):
    if isinstance(branched, types.NoneType):
        return lambda a, f, at, m, n, cd, branched: None

    def read(a, f, at, m, n, cd, branched):
        return (
            a[at + BranchSlot.SEED],
            a[at + BranchSlot.KEEP_THRESHOLD],
            cd(f[at + BranchSlot.SCALE]),
            carray(_pointer(a[at + BranchSlot.LAYER_SCALE]), n, cd),
            carray(_pointer(a[at + BranchSlot.ROWSCALE]), m, cd),
            a[at + BranchSlot.LAYER_SCALED] != 0,
        )

    return read


def read_second(a, m, n, pd, yd, second):
    """The forward's second norm ``(weight1, bias1, y1)`` from its slots, or None (a constant:
    pruned when compiling)."""


@overload(read_second)
def _read_second_impl(a, m, n, pd, yd, second):
    if isinstance(second, types.NoneType):
        return lambda a, m, n, pd, yd, second: None

    def read(a, m, n, pd, yd, second):
        return (
            carray(_pointer(a[ForwardSlot.WEIGHT1]), n, pd),
            carray(_pointer(a[ForwardSlot.BIAS1]), n, pd),
            carray(_pointer(a[ForwardSlot.Y1]), (m, n), yd),
        )

    return read


def read_x1(a, f, m, n, xd, cd, dropped):
    """Parallel blocks' ``x1`` (of numpy dtype ``xd``) and its dropout branch's arguments (as
    :func:`read_branch`'s, no layer scale or rowscale; None without dropout), or None without
    ``x1`` (``xd`` None; pruned when compiling)."""


@overload(read_x1)
def _read_x1_impl(a, f, m, n, xd, cd, dropped):
    if isinstance(xd, types.NoneType):
        return lambda a, f, m, n, xd, cd, dropped: None
    if isinstance(dropped, types.NoneType):
        return lambda a, f, m, n, xd, cd, dropped: (carray(_pointer(a[ForwardSlot.X1]), (m, n), xd), None)

    def read(a, f, m, n, xd, cd, dropped):
        none = np.empty(0, cd)  # (no layer scale, no rowscale: only the keep mask and scale are read)
        br = (a[ForwardSlot.X1_SEED], a[ForwardSlot.X1_KEEP_THRESHOLD], cd(f[ForwardSlot.X1_SCALE]), none, none, False)
        return carray(_pointer(a[ForwardSlot.X1]), (m, n), xd), br

    return read


def read_second_grad(a, m, n, gd, pd, cd, second):
    """The backward's second norm ``(dy1, weight1, dweight1, dbias1)`` from its slots (the
    gradients' partial rows, or one row each of scratch with one block), or None."""


@overload(read_second_grad)
def _read_second_grad_impl(a, m, n, gd, pd, cd, second):
    if isinstance(second, types.NoneType):
        return lambda a, m, n, gd, pd, cd, second: None

    def read(a, m, n, gd, pd, cd, second):
        blocks = a[BackwardSlot.BLOCKS]
        single = blocks == 1
        return (
            carray(_pointer(a[BackwardSlot.DY1]), (m, n), gd),
            carray(_pointer(a[BackwardSlot.WEIGHT1]), n, pd),
            np.empty((1, n), cd) if single else carray(_pointer(a[BackwardSlot.DWEIGHT1]), (blocks, n), cd),
            np.empty((1, n), cd) if single else carray(_pointer(a[BackwardSlot.DBIAS1]), (blocks, n), cd),
        )

    return read


def write_second_sums(a, n, od, sec):
    """With one block: the second norm's ``dweight1``/``dbias1`` rounded to ``od`` into their
    slots (where wanted); nothing without a second norm."""


@overload(write_second_sums)
def _write_second_sums_impl(a, n, od, sec):
    if isinstance(sec, types.NoneType):
        return lambda a, n, od, sec: None

    def write(a, n, od, sec):
        _write_sums(a, n, od, ((BackwardSlot.DWEIGHT1, sec[2][0]), (BackwardSlot.DBIAS1, sec[3][0])))

    return write


@njit
def _write_sums(a, n, od, pairs):
    """Each ``(slot, sums)`` of ``pairs`` rounded to ``od`` into the slot's address, unless 0."""
    for at, sums in pairs:
        if a[at] != 0:
            out = carray(_pointer(a[at]), n, od)
            for j in range(n):
                put(out, j, sums[j])


def _compile_forward(sd, yd, pd, branched, streamed, second, xd, dropped):
    """The forward entry (ForwardSlot); ``sd``: the dtype of x, residual and s, ``yd`` that of
    y, ``pd`` that of weight and bias (numpy dtypes; 16-bit floats as uint16/int16, see
    NUMPY_DTYPES); ``branched``: True, or None without a branch; ``streamed``: True (y written
    with non-temporal stores), or None; ``second``: True (a second norm: ``weight1``, ``bias1``,
    ``y1``), or None; ``xd``: the dtype of parallel blocks' ``x1``, added to the residual (rounded
    to ``sd`` first), or None without one; ``dropped``: True (``x1`` through its dropout), or
    None."""
    cd = _stats_dtype(sd)
    direct = True if sd == cd else None  # see rows.forward_rows
    source_digest = SOURCE_DIGEST

    def entry(block):
        source_digest  # noqa: B018 (in the closure, so in numba's cache key)
        a, f = _slots(block)
        m, n = a[ForwardSlot.ROWS], a[ForwardSlot.COLS]
        write_s, write_stats = a[ForwardSlot.WRITE_S] != 0, a[ForwardSlot.WRITE_STATS] != 0
        stats_rows = m if write_stats else 0
        forward_blocks(
            carray(_pointer(a[ForwardSlot.X]), (m, n), sd),
            carray(_pointer(a[ForwardSlot.RESIDUAL]), (m, n), sd),
            carray(_pointer(a[ForwardSlot.WEIGHT]), n, pd),
            carray(_pointer(a[ForwardSlot.BIAS]), n, pd),
            cd(f[ForwardSlot.EPS]),
            cd(n),
            a[ForwardSlot.HAS_RESIDUAL] != 0,
            write_s,
            write_stats,
            a[ForwardSlot.RMS] != 0,
            carray(_pointer(a[ForwardSlot.Y]), (m, n), yd),
            carray(_pointer(a[ForwardSlot.S]), (m, n if write_s else 0), sd),
            carray(_pointer(a[ForwardSlot.MEAN]), stats_rows, cd),
            carray(_pointer(a[ForwardSlot.RSTD]), stats_rows, cd),
            a[:COUNTERS],
            a[ForwardSlot.BLOCK_ROWS],
            direct,
            read_branch(a, f, ForwardSlot.BRANCH, m, n, cd, branched),
            streamed,
            read_second(a, m, n, pd, yd, second),
            read_x1(a, f, m, n, xd, cd, dropped),
        )

    return _compile_entry(entry)


def _compile_backward(sd, gd, td, pd, od, summed, branched, streamed, second):
    """The backward entry (BackwardSlot); ``sd``: the dtype of s and ds, ``gd`` of dy, ``td`` of
    dstream, ``pd`` of weight, ``od`` of dweight and dbias; ``summed``: the stream is recomputed
    as x + residual; ``branched``: True (the stream recomputed through the branch), or None;
    ``streamed``: True (ds, or dx with a branch, written with non-temporal stores), or None;
    ``second``: True (a second norm: ``dy1``, ``weight1``, ``dweight1``, ``dbias1``), or None.

    dweight and dbias: with one block (one thread), ``n`` values of ``od`` (or address 0: not
    wanted), summed here and rounded once; with several, one partial row per block in the
    statistics dtype, which the caller sums."""
    cd = _stats_dtype(sd)
    source_digest = SOURCE_DIGEST

    def entry(block):
        source_digest  # noqa: B018 (in the closure, so in numba's cache key)
        a, f = _slots(block)
        m, n, blocks = a[BackwardSlot.ROWS], a[BackwardSlot.COLS], a[BackwardSlot.BLOCKS]
        r = carray(_pointer(a[BackwardSlot.RESIDUAL]), (m, n), sd) if summed else None  # a constant: pruned
        br = read_branch(a, f, BackwardSlot.BRANCH, m, n, cd, branched)
        rows_dx = m if br is not None else 0
        single = blocks == 1
        dw = np.empty((1, n), cd) if single else carray(_pointer(a[BackwardSlot.DWEIGHT]), (blocks, n), cd)
        db = np.empty((1, n), cd) if single else carray(_pointer(a[BackwardSlot.DBIAS]), (blocks, n), cd)
        sec = read_second_grad(a, m, n, gd, pd, cd, second)
        backward_blocks(
            carray(_pointer(a[BackwardSlot.DY]), (m, n), gd),
            carray(_pointer(a[BackwardSlot.DSTREAM]), (m, n), td),
            carray(_pointer(a[BackwardSlot.S]), (m, n), sd),
            r,
            carray(_pointer(a[BackwardSlot.WEIGHT]), n, pd),
            carray(_pointer(a[BackwardSlot.MEAN]), m, cd),
            carray(_pointer(a[BackwardSlot.RSTD]), m, cd),
            cd(n),
            a[BackwardSlot.HAS_DSTREAM] != 0,
            a[BackwardSlot.RMS] != 0,
            carray(_pointer(a[BackwardSlot.DS]), (m, n), sd),
            dw,
            db,
            a[:COUNTERS],
            a[BackwardSlot.BLOCK_ROWS],
            br,
            carray(_pointer(a[BackwardSlot.DX]), (rows_dx, n), sd),
            carray(_pointer(a[BackwardSlot.DLAYER_SCALE]), (blocks if br is not None else 0, n), cd),
            streamed,
            sec,
        )
        if single:
            _write_sums(a, n, od, ((BackwardSlot.DWEIGHT, dw[0]), (BackwardSlot.DBIAS, db[0])))
            write_second_sums(a, n, od, sec)

    return _compile_entry(entry)


def _compile_dropped(src_d, out_d, added):
    """The entry of ``out = addend + dropout(src)`` (DroppedSlot); ``src_d``: the dtype of src
    (and of addend), ``out_d`` that of out; ``added``: True, or None without an addend."""
    cd = _stats_dtype(src_d)
    source_digest = SOURCE_DIGEST

    def entry(block):
        source_digest  # noqa: B018 (in the closure, so in numba's cache key)
        a, f = _slots(block)
        m, n = a[DroppedSlot.ROWS], a[DroppedSlot.COLS]
        addend = carray(_pointer(a[DroppedSlot.ADDEND]), (m, n), src_d) if added else None  # a constant: pruned
        dropped_blocks(
            carray(_pointer(a[DroppedSlot.SRC]), (m, n), src_d),
            addend,
            carray(_pointer(a[DroppedSlot.OUT]), (m, n), out_d),
            a[:COUNTERS],
            a[DroppedSlot.BLOCK_ROWS],
            read_branch(a, f, DroppedSlot.BRANCH, m, n, cd, True),
            cd,
        )

    return _compile_entry(entry)


# compiled entries, made on first use: (stream, y, parameter dtypes, branched, streamed, second,
# added, dropped)
# and (s, dy, dstream, weight, weight gradient dtypes, summed, branched, streamed, second), and
# (src, out dtypes, added)
FORWARD_ENTRIES: dict[tuple, object] = {}
BACKWARD_ENTRIES: dict[tuple, object] = {}
DROPPED_ENTRIES: dict[tuple, object] = {}


def _flag(value: bool) -> bool | None:
    """A compile-time flag: True, or None (a type, so that the code it guards is pruned)."""
    return True if value else None


def forward_entry(
    sd: torch.dtype,
    yd: torch.dtype,
    pd: torch.dtype,
    branched: bool = False,
    streamed: bool = False,
    second: bool = False,
    x1_dtype: torch.dtype | None = None,
    dropped: bool = False,
):
    key = (sd, yd, pd, branched, streamed, second, x1_dtype, dropped)
    entry = FORWARD_ENTRIES.get(key)
    if entry is None:
        dtypes = (NUMPY_DTYPES[d] for d in (sd, yd, pd))
        flags = map(_flag, (branched, streamed, second))
        xd = None if x1_dtype is None else NUMPY_DTYPES[x1_dtype]
        entry = FORWARD_ENTRIES[key] = _compile_forward(*dtypes, *flags, xd, _flag(dropped))
    return entry


def backward_entry(
    sd: torch.dtype,
    gd: torch.dtype,
    td: torch.dtype,
    pd: torch.dtype,
    od: torch.dtype,
    summed: bool,
    branched: bool = False,
    streamed: bool = False,
    second: bool = False,
):
    key = (sd, gd, td, pd, od, summed, branched, streamed, second)
    entry = BACKWARD_ENTRIES.get(key)
    if entry is None:
        dtypes = (NUMPY_DTYPES[d] for d in (sd, gd, td, pd, od))
        flags = (_flag(branched), _flag(streamed), _flag(second))
        entry = BACKWARD_ENTRIES[key] = _compile_backward(*dtypes, summed, *flags)
    return entry


def dropped_entry(src_d: torch.dtype, out_d: torch.dtype, added: bool):
    key = (src_d, out_d, added)
    entry = DROPPED_ENTRIES.get(key)
    if entry is None:
        entry = DROPPED_ENTRIES[key] = _compile_dropped(NUMPY_DTYPES[src_d], NUMPY_DTYPES[out_d], _flag(added))
    return entry


_FLOAT64_BITS: dict[float, int] = {}


def float64_bits(value: float) -> int:
    """``value``'s float64 bits as an int64, for a slot read as float64 (eps, the dropout scale)."""
    bits = _FLOAT64_BITS.get(value)
    if bits is None:
        bits = _FLOAT64_BITS[value] = int.from_bytes(struct.pack("<d", value), "little", signed=True)
    return bits
