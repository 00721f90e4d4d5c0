"""What a fresh output costs: filling a new tensor against refilling one, with and without the
huge-page advice the CPU kernels give their outputs of HUGE_PAGES_MIN_BYTES and more.

    python benchmarks/fresh_outputs.py [threads] [--shapes ROWSxCOLS,...]

Per shape (fp32), median ms of 15 calls and minor page faults per call, interleaved:
``torch.empty(...).fill_(1)`` (torch's allocation, as any op's output), the same through the
kernels' allocation (``addnorm.kernels.cpu.launch.empty_output``: huge pages asked for at 32 MiB and more
when Linux's THP mode is ``madvise``), and ``fill_`` of a tensor allocated once.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from addnorm.kernels.cpu import launch

SHAPES = [(4096, 768), (4096, 1024), (2048, 4096)]


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("threads", nargs="?", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in SHAPES), help="ROWSxCOLS,...")
    args = parser.parse_args()
    try:
        shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
        parser.error(f"--shapes: expected positive ROWSxCOLS,..., got {args.shapes!r}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("threads must be at least 1")
        torch.set_num_threads(args.threads)
    print(
        f"{torch.get_num_threads()} thread(s); huge-page advice "
        f"{'on' if launch.MADVISE is not None else 'off (THP mode is not madvise)'} "
        f"from {launch.HUGE_PAGES_MIN_BYTES >> 20} MiB; median ms (page faults per call)"
    )
    for shape in shapes:
        kept = torch.empty(shape)
        calls = {
            "torch.empty + fill": lambda shape=shape: torch.empty(shape).fill_(1),
            "kernels' empty_output + fill": lambda kept=kept: launch.empty_output(kept, torch.float32).fill_(1),
            "refill a kept tensor": lambda kept=kept: kept.fill_(1),
        }
        times: dict[str, list[float]] = {name: [] for name in calls}
        counts: dict[str, list[int]] = {name: [] for name in calls}
        for fn in calls.values():
            fn()
        for _ in range(15):
            for name, fn in calls.items():
                f, t = faults(), time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
                counts[name].append(faults() - f)
        cells = [
            f"{name} {statistics.median(times[name]) * 1e3:.2f} ({statistics.median(counts[name]):.0f})"
            for name in calls
        ]
        print(f"  {shape[0]}x{shape[1]} ({4 * shape[0] * shape[1] >> 20} MiB): " + ", ".join(cells))


if __name__ == "__main__":
    main()
