"""How the Triton kernels are launched: one table of settings per kind of kernel, and the
functions that turn it into a launch (tile shape, warps, program count).

``BLOCK_N`` is the next power of two of ``N``, or ``chunked.chunk_n`` on the chunked path (rows
wider than the kind's ``max_fused_n``). Short rows are stacked into ``BLOCK_M`` rows per program
so that a tile holds about ``tile_elems`` elements (at most ``max_block_m`` rows). ``num_warps``
gives each thread about ``bytes_per_thread`` bytes of the tile, clamped to 1..32 warps: fewer,
fuller warps let each row reduction cross fewer warps and keep more loads in flight per thread.
The chunked path streams its chunks, one row per program, with its own bytes per thread. The
backward launches ``max(1, warps_in_flight // num_warps)`` programs, each looping over a fixed
block of rows and writing one row of dweight/dbias partials, summed in a fixed order: a count of
the shape alone (never the GPU's SM count), so that dweight and dbias are the same bits on any GPU
and any run (the reduction contract: docs/reliability.md).

The forward keeps fewer values live than the backward, so it fuses wider rows; with the sublayer
branch the backward also keeps ``x`` and the keep mask live, so it fuses narrower rows with fewer
bytes per thread, a setting chosen to compile without register spills under Triton 3.9
(``python benchmarks/triton_registers.py`` prints registers and spills for sm_90 without a GPU;
docs/gpu.md, "Launch heuristics", lists where Triton 3.6 spills with the same table). Its short
rows, stacked, share their warps (``stacked_bytes_per_thread``, rows of 512 and wider): a tile
of four rows of 768 given as many warps as four rows' bytes ran 4-10 times slower on an H200.
The plain backward counts its bytes per thread in the statistics dtype (``stats_bytes``: fp32
for 16-bit inputs, where its tiles live) and holds one row per tile (N >= 768): 16 fp32 values per thread
at 64 bytes, for bf16 as for fp32, was the fastest setting timed at N = 768 to 8192 on an H200,
or within 3 % of it (docs/performance-log.md, "On an NVIDIA H200: bf16 rounded by the cast").
The values come from ``python benchmarks/triton_tune.py`` (docs/gpu.md, "Launch heuristics"; the
timings are in docs/performance-log.md, "On an NVIDIA H100" and the H200 sections after it).

The tile shape and warps depend on ``N``, the dtype, the kind and the device type alone, so a
row's results never depend on the batch (the number of rows sets only how the dweight/dbias
partials are grouped). The launchers read :data:`TABLE` at each call, so a test or a
tuning script may swap it (``TABLE.updated("forward", max_fused_n=256)``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class KernelLaunch:
    """The launch settings of one kind of fused kernel (rows held whole in registers)."""

    max_fused_n: int  # widest row held whole in registers; wider rows take the chunked path
    bytes_per_thread: int  # num_warps = tile bytes / (32 * this), clamped to 1..32
    tile_elems: int = 4096  # elements per program tile when short rows are stacked
    max_block_m: int = 32  # at most this many rows per tile
    warps_in_flight: int | None = None  # backward kinds: max(1, this // num_warps) programs
    # stacked short rows of at least stacked_min_n columns: bytes_per_thread for each row of the
    # tile, up to this many in all (stacking adds bytes per thread, not warps); None, or narrower
    # rows: bytes_per_thread for the whole tile
    stacked_bytes_per_thread: int | None = None
    stacked_min_n: int = 512  # the widths timed (docs/benchmarks.md); narrower rows would spill
    # count the tile's bytes in the statistics dtype (fp32 for 16-bit inputs), where the kernel
    # holds its tiles: its registers per thread follow those bytes, not the input's
    stats_bytes: bool = False
    # backward kinds: each program issues the loads of its next tile of rows before reducing
    # the current one, so a program's memory latency overlaps its own row reductions, at the
    # cost of registers (on for the branch backward alone: docs/performance-log.md, "On an NVIDIA
    # H200: the backward's prefetch")
    prefetch: bool = False


@dataclass(frozen=True)
class ChunkedLaunch:
    """The chunked path, forward and backward: one row per program, walked in chunks."""

    chunk_n: int  # columns per chunk (a power of two)
    bytes_per_thread: int
    warps_in_flight: int  # the chunked backward's programs: max(1, this // num_warps)
    prefetch: bool = False  # as KernelLaunch's, for the chunked backward


@dataclass(frozen=True)
class InterpreterLaunch:
    """Triton's interpreter (CPU tensors) pays Python per Triton op per program, whatever the
    tile size, so there tiles stack more rows (same code, fewer programs), and the backward runs
    a fixed number of programs (there is no SM count)."""

    tile_elems: int
    max_block_m: int
    backward_programs: int


@dataclass(frozen=True)
class LaunchTable:
    forward: KernelLaunch
    backward: KernelLaunch
    branch_backward: KernelLaunch  # the backward with the sublayer branch (dropout, layer scale)
    chunked: ChunkedLaunch
    interpreter: InterpreterLaunch

    def updated(self, kind: str, **fields) -> LaunchTable:
        """A copy with ``fields`` of entry ``kind`` changed: ``TABLE.updated("chunked", chunk_n=256)``."""
        return dataclasses.replace(self, **{kind: dataclasses.replace(getattr(self, kind), **fields)})


TABLE = LaunchTable(
    forward=KernelLaunch(max_fused_n=16384, bytes_per_thread=64),
    # one row per tile (N >= 768), 16 fp32 values per thread; warps_in_flight: 16 warps on each
    # of an H100's or H200's 132 SMs, as a constant (the chunked path keeps its own, 32)
    backward=KernelLaunch(
        max_fused_n=8192, bytes_per_thread=64, tile_elems=1024, warps_in_flight=2112, stats_bytes=True
    ),
    # warps_in_flight: 32 warps on each of the 132 SMs
    branch_backward=KernelLaunch(
        max_fused_n=4096, bytes_per_thread=16, warps_in_flight=4224, stacked_bytes_per_thread=64, prefetch=True
    ),
    chunked=ChunkedLaunch(chunk_n=4096, bytes_per_thread=16, warps_in_flight=4224),
    interpreter=InterpreterLaunch(tile_elems=65536, max_block_m=256, backward_programs=4),
)
KINDS = ("forward", "backward", "branch_backward")  # the entries a launch is planned from


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` on the host. (``triton.cdiv`` is a constexpr function in recent Triton,
    whose call from Python unwraps its arguments: several µs, paid on every launch.)"""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least ``n`` (0 for 0, as ``triton.next_power_of_2``), on the
    host (see :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


class Launch(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    chunked: bool


# (id(TABLE), kind, n, device type, elem_size) -> (TABLE, its Launch): each entry holds its
# table, so an id stays that table's while cached, and a swapped-in table plans anew
_PLANS: dict = {}


def plan(kind: str, n: int, device: torch.device, elem_size: int) -> Launch:
    """The launch of kernel ``kind`` (one of :data:`KINDS`) on rows of ``n`` features of
    ``elem_size`` bytes on ``device``, from :data:`TABLE` as it is now (module docstring)."""
    key = (id(TABLE), kind, n, device.type, elem_size)
    cached = _PLANS.get(key)
    if cached is None:
        cached = _PLANS[key] = TABLE, _plan(TABLE, kind, n, device, elem_size)
    return cached[1]


def _plan(table: LaunchTable, kind: str, n: int, device: torch.device, elem_size: int) -> Launch:
    entry = getattr(table, kind)
    chunked = n > entry.max_fused_n
    block_n = table.chunked.chunk_n if chunked else next_power_of_2(n)
    if device.type == "cuda":
        tile, max_m = entry.tile_elems, entry.max_block_m
    else:
        tile, max_m = table.interpreter.tile_elems, table.interpreter.max_block_m
    block_m = 1 if chunked else max(1, min(max_m, tile // block_n))
    bytes_per_thread = table.chunked.bytes_per_thread if chunked else entry.bytes_per_thread
    if not chunked and entry.stacked_bytes_per_thread and n >= entry.stacked_min_n:
        bytes_per_thread = max(bytes_per_thread, min(entry.stacked_bytes_per_thread, bytes_per_thread * block_m))
    if not chunked and entry.stats_bytes:
        elem_size = max(elem_size, 4)
    num_warps = max(1, min(32, block_m * block_n * elem_size // (32 * bytes_per_thread)))
    return Launch(block_m, block_n, next_power_of_2(num_warps), chunked)


def backward_programs(kind: str, m: int, num_warps: int, device: torch.device, chunked: bool = False) -> int:
    """How many programs the backward kernel of ``kind`` runs over ``m`` rows: a function of the
    shape (through ``num_warps`` and whether the rows are ``chunked``) and the device type, never
    of the device's size."""
    if device.type == "cuda":
        return min(m, max(1, backward_entry(kind, chunked).warps_in_flight // num_warps))
    return min(m, TABLE.interpreter.backward_programs)


def backward_entry(kind: str, chunked: bool) -> KernelLaunch | ChunkedLaunch:
    """The table entry a backward kernel of ``kind`` takes its programs and ``prefetch`` from."""
    return TABLE.chunked if chunked else getattr(TABLE, kind)
