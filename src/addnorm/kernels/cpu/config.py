"""The CPU backend's settings, in one table: when a call uses threads, how rows are split into
blocks, which fresh outputs ask for huge pages, which outputs are written with non-temporal
stores, which rows take the backward's paired gradient pass. Each setting changes speed alone,
never a result's bits, except ``reduction_blocks`` and ``reduction_min_rows``: they fix the
order in which ``dweight``/``dbias`` are summed (a function of the shape alone, so still the
same bits on any thread count; docs/reliability.md, "3. Determinism and the reduction
contract").

The launchers read :data:`SETTINGS` at each call, so a test or a benchmark may swap it
(``config.SETTINGS = SETTINGS.updated(parallel_min_elements=1)``, or for a ``with`` block
:func:`using`); ``pair_min_cols`` is read when the kernels are compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # as /sys writes cache sizes


def cache_sizes() -> dict[int, int]:
    """The data caches Linux lists for cpu0 (``/sys/devices/system/cpu/cpu0/cache``), as
    ``{level: bytes}``; empty where it lists none."""
    sizes: dict[int, int] = {}
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            fields = {name: (Path(index) / name).read_text().strip() for name in ("level", "size", "type")}
        except OSError:
            continue
        level, size = fields["level"], fields["size"]
        if fields["type"] != "Instruction" and level.isdigit() and size[:-1].isdigit() and size[-1] in _SIZE_UNITS:
            if int(size[:-1]) > 0:  # some VMs list caches of size 0
                sizes[int(level)] = max(sizes.get(int(level), 0), int(size[:-1]) * _SIZE_UNITS[size[-1]])
    return sizes


def streaming_threshold_bytes() -> int:
    """The default ``streaming_min_bytes``: four times a core's L2 cache, at most the last-level
    cache; that cache where no L2 is listed, 32 MiB where no cache beyond L1 is. A shared
    last-level cache is no measure of what a call keeps there (a VM may list a whole socket's,
    shared with every other guest): past a few times the private caches its outputs leave them
    before they are read again."""
    sizes = cache_sizes()
    if max(sizes, default=1) < 2:
        return 32 << 20
    last = sizes[max(sizes)]
    return min(4 * sizes[2], last) if 2 in sizes else last


@dataclass(frozen=True)
class Settings:
    # Below this many elements one thread does the whole call: waking the other threads costs
    # more than they save (`python benchmarks/cpu_threads.py`; docs/benchmarks.md, "Dispatch,
    # threads, compile time, warm start").
    parallel_min_elements: int = 1 << 16
    # The forward splits rows into this many blocks per thread, claimed one at a time: a late
    # thread costs at most its share of blocks.
    blocks_per_thread: int = 8
    # The backward's blocks, one partial row of dweight/dbias each: at most reduction_blocks, of
    # at least reduction_min_rows rows (the scratch stays small beside the (m, n) tensors).
    reduction_blocks: int = 64
    reduction_min_rows: int = 16
    # Fresh outputs of at least this many bytes ask for transparent huge pages: glibc serves
    # requests of 32 MiB and more with a fresh mmap on every call, every 4 KiB page of which
    # faults when first written (`python benchmarks/fresh_outputs.py`; docs/benchmarks.md,
    # "Fresh outputs page-fault").
    huge_pages_min_bytes: int = 32 << 20
    # A call that moves at least this many bytes (its inputs and outputs together) writes y, or
    # ds, with non-temporal stores, which skip reading each cache line in before writing it: by
    # the end of such a call the cache holds little of its output anyway. Four times a core's
    # L2 (docs/performance-log.md, "Non-temporal stores").
    streaming_min_bytes: int = dataclasses.field(default_factory=streaming_threshold_bytes)
    # Rows at least this wide take the backward's second pass two rows at a time, which loads
    # and stores dweight/dbias once per pair; narrower rows one at a time, where the pair loop's
    # setup weighs more. Where pairs start to pay depends on the machine (docs/performance-log.md,
    # "CPU backward: where the time goes"): from 128 on the Intel Xeon, from 2048 on the EPYC.
    pair_min_cols: int = 128

    def updated(self, **changes) -> Settings:
        return dataclasses.replace(self, **changes)


SETTINGS = Settings()


@contextlib.contextmanager
def using(**changes) -> Iterator[Settings]:
    """:data:`SETTINGS` with ``changes`` inside a ``with`` block, restored after it."""
    global SETTINGS
    old = SETTINGS
    SETTINGS = old.updated(**changes)
    try:
        yield SETTINGS
    finally:
        SETTINGS = old
