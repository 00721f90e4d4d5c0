"""What a fresh output costs: filling a new tensor against refilling one, with and without the
huge-page advice the CPU kernels give their outputs of ``huge_pages_min_bytes`` and more.

    python benchmarks/fresh_outputs.py [threads] [--rounds 15]

Per shape (fp32), the median ms per call (addnorm's harness, ``addnorm.tools.bench.measure``,
interleaved) and the median minor page faults of one call:
``torch.empty(...).fill_(1)`` (torch's allocation, as any op's output), the same through the
kernels' allocation (``addnorm.kernels.cpu.launch.empty_output``: huge pages asked for at 32 MiB and more
when Linux's THP mode is ``madvise``), and ``fill_`` of a tensor allocated once.
"""

from __future__ import annotations

import argparse
import resource
import statistics

import torch

from addnorm.kernels.cpu import config, launch
from addnorm.tools.bench import measure, parse_shapes
from addnorm.tools.cli import UsageError

SHAPES = [(4096, 768), (4096, 1024), (2048, 4096)]


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def faults_per_call(fn, rounds: int) -> float:
    counts = []
    for _ in range(rounds):
        f = faults()
        fn()
        counts.append(faults() - f)
    return statistics.median(counts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("threads", type=int, nargs="?", help="torch threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved samples per call (default 15)")
    p.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in SHAPES), help="MxN,... (default %(default)s)")
    args = p.parse_args()
    try:
        shapes = parse_shapes(args.shapes)
    except UsageError as err:
        p.error(str(err))
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"{torch.get_num_threads()} thread(s); huge-page advice "
        f"{'on' if launch.MADVISE is not None else 'off (THP mode is not madvise)'} "
        f"from {config.SETTINGS.huge_pages_min_bytes >> 20} MiB; median ms (page faults per call)"
    )
    for shape in shapes:
        kept = torch.empty(shape)
        calls = {
            "torch.empty + fill": lambda shape=shape: torch.empty(shape).fill_(1),
            "kernels' empty_output + fill": lambda kept=kept: launch.empty_output(kept, torch.float32).fill_(1),
            "refill a kept tensor": lambda kept=kept: kept.fill_(1),
        }
        times = measure(calls, args.rounds, "cpu")
        cells = [
            f"{name} {times[name][0] * 1e3:.2f} ({faults_per_call(fn, args.rounds):.0f})" for name, fn in calls.items()
        ]
        print(f"  {shape[0]}x{shape[1]} ({4 * shape[0] * shape[1] >> 20} MiB): " + ", ".join(cells))


if __name__ == "__main__":
    main()
