"""The CPU kernels' per-row and per-element cost, apart: rows of 256 to 6144 elements, 1 thread.

    python benchmarks/cpu_row_length.py [bfloat16|float32] [--rounds 15]

For each row length, the slope between a call of 12288 and one of 61440 elements (rows in
cache) gives ns per element at that length; a fixed cost per row shows as a slope that falls as
rows grow (per-row cost = the difference between two lengths' slopes over that of 1/length).
All calls timed interleaved by addnorm's harness (``addnorm.tools.bench.measure``).
"""

from __future__ import annotations

import argparse

import torch

from addnorm.kernels import cpu
from addnorm.tools.bench import measure

LENGTHS = (256, 768, 3072, 6144)
SMALL, LARGE = 16 * 768, 80 * 768  # elements per call


def calls(m: int, n: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    x, r, dy = (torch.randn(m, n, generator=g).to(dtype) for _ in range(3))
    w, b = (torch.randn(n, generator=g).to(dtype) for _ in range(2))
    y, s = torch.empty_like(x), torch.empty_like(x)
    _, _, mean, rstd = cpu.forward(x, r, w, b, eps=1e-5, rms=False, residual_dtype=None)
    return {
        "add+layer_norm forward": lambda: cpu.forward(
            x, r, w, b, eps=1e-5, rms=False, residual_dtype=None, out=y, residual_out=s
        ),
        "layer_norm backward": lambda: cpu.backward(dy, None, (x,), w, mean, rstd, rms=False, has_bias=True),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dtype", nargs="?", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--rounds", type=int, default=15, help="interleaved samples per call (default 15)")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    runs = {}
    for n in LENGTHS:
        for size in (SMALL, LARGE):
            for name, fn in calls(size // n, n, dtype).items():
                runs[name, n, size] = fn
    medians = {key: t[0] for key, t in measure(runs, args.rounds, "cpu").items()}
    print(f"{dtype}, 1 thread: ns per element (slope between {SMALL} and {LARGE} elements)")
    for name in ("add+layer_norm forward", "layer_norm backward"):
        slopes = {n: (medians[name, n, LARGE] - medians[name, n, SMALL]) / (LARGE - SMALL) * 1e9 for n in LENGTHS}
        row_ns = (slopes[LENGTHS[0]] - slopes[LENGTHS[2]]) / (1 / LENGTHS[0] - 1 / LENGTHS[2])
        cells = "  ".join(f"{n}: {slopes[n]:.3f}" for n in LENGTHS)
        print(f"  {name:24s} {cells}  per row ~{row_ns:.0f} ns")


if __name__ == "__main__":
    main()
