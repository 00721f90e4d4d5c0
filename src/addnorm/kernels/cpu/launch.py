"""Running an entry on threads, and the tensors a call hands the kernels.

Threads. The blocks run on torch's own OpenMP team (``GOMP_parallel`` of the libgomp torch
loaded), whose threads are awake and pinned after torch's previous op; elsewhere (another
OpenMP, a forked child) on this thread plus a small Python pool. Why not
``@njit(parallel=True)``: its thread pool is a second pool beside torch's, whose spinning
threads starve torch's own ops, or (workqueue layer) wake two threads per call
(docs/benchmarks.md, "Dispatch, threads, compile time, warm start").

Outputs. Fresh outputs of ``huge_pages_min_bytes`` (:mod:`.config`) and more ask for transparent huge pages, as numpy
does for its own arrays (docs/benchmarks.md, "Fresh outputs page-fault").
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from ... import reference
from . import config
from .entry import PACK_INTO, SLOTS, ZEROED_COUNTERS, float64_bits

_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (pid that made it, pool)
_ARGUMENT_BLOCKS = threading.local()  # .block: this thread's argument block, reused by each of its calls


def _torch_gomp_parallel():
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


_GOMP_PARALLEL = _torch_gomp_parallel()
_GOMP_PID = os.getpid()  # a forked child has no OpenMP team (its threads stayed behind): the pool then


def run_on_threads(entry, threads: int, args: tuple[int, ...], branch: tuple[int, ...]) -> None:
    """Run the C ``entry`` on ``threads`` threads, its arguments ``args`` (in ``entry.ForwardSlot``,
    ``BackwardSlot`` or ``DroppedSlot`` order) and ``branch`` (``BranchSlot`` order) packed into this thread's
    argument block (a call holds it until its kernel returns; calls on other threads have
    blocks of their own). Each thread
    claims blocks of rows until none is left, and the call returns once all are done. The
    threads are torch's own OpenMP team when torch runs on libgomp (GOMP_parallel returns once
    every thread has left the entry), else this thread and a small pool. (A ctypes call
    releases the GIL.)"""
    global _POOL
    block = getattr(_ARGUMENT_BLOCKS, "block", None)
    if block is None:
        block = _ARGUMENT_BLOCKS.block = (ctypes.c_int64 * SLOTS)()
    PACK_INTO[len(args)](block, 0, *ZEROED_COUNTERS, *args, *branch)
    if threads == 1:
        entry.ctypes(ctypes.addressof(block))
    elif _GOMP_PARALLEL is not None and _GOMP_PID == os.getpid():
        _GOMP_PARALLEL(entry.address, ctypes.addressof(block), threads, 0)
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


def _madvise_if_asked():
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


MADVISE = _madvise_if_asked() if hasattr(mmap, "MADV_HUGEPAGE") else None  # None: no advice to give


def empty_output(like: Tensor, dtype: torch.dtype) -> Tensor:
    """``torch.empty_like`` of a contiguous ``like`` (so contiguous too); a large one asks for huge
    pages over the pages it spans."""
    t = torch.empty_like(like) if dtype is like.dtype else torch.empty_like(like, dtype=dtype)
    if MADVISE is not None and t.nbytes >= config.SETTINGS.huge_pages_min_bytes:
        start = -(-t.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (t.data_ptr() + t.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        MADVISE(start, end - start, mmap.MADV_HUGEPAGE)  # advice only: a failure changes nothing
    return t


def empty_vector(like: Tensor, size: int, dtype: torch.dtype) -> Tensor:
    """``size`` uninitialized values of ``dtype`` on the CPU: ``like.new_empty`` where ``like``
    (a CPU tensor) has that dtype, which takes fewer steps than a dtype and device named."""
    return like.new_empty(size) if like.dtype is dtype else torch.empty(size, dtype=dtype, device="cpu")


def streamed(out: Tensor, moved_bytes: int) -> bool:
    """Whether a kernel writes ``out`` with non-temporal stores (:class:`.floats.Streamed`): when
    the call moves at least ``streaming_min_bytes`` (:mod:`.config`), ``out``'s rows are contiguous,
    start on 64 bytes and span a multiple of 64 bytes, as the stores' alignment requires, and its elements
    are float32 or float64, whose vector stores fill whole cache lines (16-bit rows were slower
    with them: docs/performance-log.md, "Non-temporal stores")."""
    return (
        moved_bytes >= config.SETTINGS.streaming_min_bytes
        and out.element_size() >= 4
        and out.is_contiguous()
        and out.data_ptr() % 64 == 0
        and out.shape[-1] * out.element_size() % 64 == 0
    )


def kernel_ready(t: Tensor) -> bool:
    """Whether the kernels may read ``t`` through its data pointer as it is: what
    :func:`contiguous_rows` makes of any tensor."""
    return t.is_contiguous() and not t.is_neg() and not t._is_zerotensor()


def contiguous_rows(t: Tensor) -> Tensor:
    """``t`` as the kernels read it, through its data pointer: rows contiguous, a lazy negation
    applied, a ZeroTensor (autograd's zeros with no memory) made real zeros; ``t`` itself when all
    hold already."""
    if t.is_neg():
        t = t.resolve_neg()
    if t._is_zerotensor():
        t = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    return t if t.is_contiguous() else t.contiguous()


@functools.lru_cache(maxsize=64)
def constant_row(n: int, dtype: torch.dtype, value: float) -> Tensor:
    """A weight of ones or a bias of zeros, made once per width (never written)."""
    return torch.full((n,), value, dtype=dtype, device="cpu")  # (never the default device)


def param_row(p: Tensor | None, n: int, dtype: torch.dtype, fill: float) -> Tensor:
    """``p`` as ``n`` contiguous values of ``dtype`` (``fill`` when None)."""
    if p is None:
        return constant_row(n, dtype, fill)
    if p.dtype is dtype and kernel_ready(p):
        return p
    # (.to() of the same dtype returns a strided or expanded 1-D tensor as it is, whatever its
    # memory_format: the kernels read n contiguous values)
    return contiguous_rows(p.detach().to(dtype))


def kernel_param_dtype(sd: torch.dtype, cd: torch.dtype, *params: Tensor | None) -> torch.dtype:
    """The dtype the kernels read the weight (and bias) in: the stream dtype ``sd`` when every
    one given has it (a 16-bit float widens exactly: the same results as in ``cd``, without a
    conversion on every call), else the statistics dtype ``cd``."""
    for p in params:
        if p is not None and p.dtype is not sd:
            return cd
    return sd


def dropout_args(p: float, seed: Tensor | None) -> tuple[int, int, int]:
    """A keep mask's slots, ``(seed, keep threshold, scale as float64 bits)`` (the seed 0 without
    dropout): the branch's (``BranchSlot``) and ``x1``'s (``ForwardSlot.X1_SEED``..)."""
    return int(seed) if p > 0 else 0, reference.keep_threshold(p), float64_bits(reference.dropout_scale(p))


def branch_args(branch, m: int, n: int, cd: torch.dtype) -> tuple[tuple[int, ...], tuple[Tensor, ...]]:
    """The branch's argument slots (``entry.BranchSlot``) and the tensors they point into, which
    the caller holds while the kernel runs; a missing factor is a row of ones (``* 1`` is exact,
    so one compiled kernel serves every combination)."""
    layer_scale = param_row(branch.layer_scale, n, cd, 1.0)
    rowscale = param_row(branch.rowscale, m, cd, 1.0)
    args = (  # in BranchSlot order
        *dropout_args(branch.p, branch.seed),
        layer_scale.data_ptr(),
        rowscale.data_ptr(),
        branch.layer_scale is not None,
    )
    return args, (layer_scale, rowscale)
