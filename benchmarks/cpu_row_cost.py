"""Per-element cost of the CPU kernels' row loops against torch's own CPU layer_norm, 1 thread.

    python benchmarks/cpu_row_cost.py [float32|bfloat16] [--rounds 15] [--lengths]

Rows stay in cache (16 and 80 rows of 768), and the per-call cost (Python, dispatch) cancels
out: the reported ns/element is the slope between the medians at the two sizes, all calls timed
interleaved by addnorm's harness (``addnorm.tools.bench.measure``).

``--lengths``: the fused forward and the backward at rows of 256 to 6144 elements instead, each
length at the same two element counts (those of 16 and 80 rows of 768). A fixed cost per row
shows as a slope that falls as rows grow: the per-row cost is the difference between two
lengths' slopes over that of 1/length.
"""

from __future__ import annotations

import argparse

import torch

from addnorm.kernels import cpu
from addnorm.tools.bench import measure

N = 768
LENGTHS = (256, 768, 3072, 6144)
SMALL, LARGE = 16, 80  # rows of N per call; for --lengths, as many elements


def calls(m: int, dtype: torch.dtype, n: int = N) -> dict:
    g = torch.Generator().manual_seed(0)
    x, r, dy = (torch.randn(m, n, generator=g).to(dtype) for _ in range(3))
    w, b = (torch.randn(n, generator=g).to(dtype) for _ in range(2))
    y, s = torch.empty_like(x), torch.empty_like(x)
    _, _, mean, rstd = cpu.forward(x, r, w, b, eps=1e-5, rms=False, residual_dtype=None)
    _, tmean, trstd = torch.native_layer_norm(x, (n,), w, b, 1e-5)
    return {
        "addnorm add+layer_norm forward": lambda: cpu.forward(
            x, r, w, b, eps=1e-5, rms=False, residual_dtype=None, out=y, residual_out=s
        ),
        "addnorm add+layer_norm fwd, no s": lambda: cpu.forward(
            x, r, w, b, eps=1e-5, rms=False, residual_dtype=None, out=y, write_stream=False
        ),
        "addnorm layer_norm forward": lambda: cpu.forward(
            x, None, w, b, eps=1e-5, rms=False, residual_dtype=None, out=y
        ),
        "torch layer_norm forward": lambda: torch.native_layer_norm(x, (n,), w, b, 1e-5),
        "addnorm layer_norm backward": lambda: cpu.backward(dy, None, (x,), w, mean, rstd, rms=False, has_bias=True),
        "addnorm add+layer_norm bwd, x+r": lambda: cpu.backward(
            dy, None, (x, r), w, mean, rstd, rms=False, has_bias=True
        ),
        "torch layer_norm backward": lambda: torch.ops.aten.native_layer_norm_backward(
            dy, x, (n,), tmean, trstd, w, b, (True, True, True)
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dtype", nargs="?", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=15, help="interleaved samples per call (default 15)")
    p.add_argument("--lengths", action="store_true", help="per-row against per-element cost, rows of 256 to 6144")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    if args.lengths:
        row_lengths(dtype, args.rounds)
        return
    small, large = calls(SMALL, dtype), calls(LARGE, dtype)
    runs = {**{(name, SMALL): fn for name, fn in small.items()}, **{(name, LARGE): fn for name, fn in large.items()}}
    medians = {key: t[0] for key, t in measure(runs, args.rounds, "cpu").items()}
    print(f"{dtype}, 1 thread, rows of {N}: ns per element (slope between {SMALL} and {LARGE} rows)")
    for name in small:
        slope = (medians[name, LARGE] - medians[name, SMALL]) / ((LARGE - SMALL) * N)
        print(f"  {name:32s} {slope * 1e9:.3f}")


def row_lengths(dtype: torch.dtype, rounds: int) -> None:
    names = ("addnorm add+layer_norm forward", "addnorm layer_norm backward")
    runs = {}
    for n in LENGTHS:
        for rows in (SMALL, LARGE):
            made = calls(rows * N // n, dtype, n)
            runs.update({(name, n, rows): made[name] for name in names})
    medians = {key: t[0] for key, t in measure(runs, rounds, "cpu").items()}
    print(f"{dtype}, 1 thread: ns per element (slope between {SMALL * N} and {LARGE * N} elements)")
    for name in names:
        slopes = {n: (medians[name, n, LARGE] - medians[name, n, SMALL]) / ((LARGE - SMALL) * N) * 1e9 for n in LENGTHS}
        per_row = (slopes[LENGTHS[0]] - slopes[LENGTHS[2]]) / (1 / LENGTHS[0] - 1 / LENGTHS[2])
        cells = "  ".join(f"{n}: {slopes[n]:.3f}" for n in LENGTHS)
        print(f"  {name:32s} {cells}  per row ~{per_row:.0f} ns")


if __name__ == "__main__":
    main()
