"""What a fresh output costs: filling a new tensor against refilling one, with and without the
huge-page advice the CPU kernels give their outputs of HUGE_PAGES_MIN_BYTES and more.

    python benchmarks/fresh_outputs.py [threads]

Per shape (fp32), median ms of 15 calls and minor page faults per call, interleaved:
``torch.empty(...).fill_(1)`` (torch's allocation, as any op's output), the same through the
kernels' allocation (``addnorm.kernels.cpu._empty``: huge pages asked for at 32 MiB and more
when Linux's THP mode is ``madvise``), and ``fill_`` of a tensor allocated once.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time

import torch

from addnorm.kernels import cpu

SHAPES = [(4096, 768), (4096, 1024), (2048, 4096)]


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))
    print(
        f"{torch.get_num_threads()} thread(s); huge-page advice "
        f"{'on' if cpu._MADVISE is not None else 'off (THP mode is not madvise)'} "
        f"from {cpu.HUGE_PAGES_MIN_BYTES >> 20} MiB; median ms (page faults per call)"
    )
    for shape in SHAPES:
        kept = torch.empty(shape)
        calls = {
            "torch.empty + fill": lambda shape=shape: torch.empty(shape).fill_(1),
            "kernels' _empty + fill": lambda kept=kept: cpu._empty(kept, torch.float32).fill_(1),
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
