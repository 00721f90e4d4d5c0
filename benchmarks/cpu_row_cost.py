"""Per-element cost of the CPU kernels' row loops against torch's own CPU layer_norm, 1 thread.

    python benchmarks/cpu_row_cost.py [float32|bfloat16] [--reps CALLS]

Rows stay in cache (16 and 80 rows of 768), and the per-call cost (Python, dispatch) cancels
out: the reported ns/element is the slope between the two sizes, best of 7 repetitions.
"""

from __future__ import annotations

import argparse
import time

import torch

from addnorm.kernels import cpu

N = 768


def calls(m: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    x, r, dy = (torch.randn(m, N, generator=g).to(dtype) for _ in range(3))
    w, b = (torch.randn(N, generator=g).to(dtype) for _ in range(2))
    y, s = torch.empty_like(x), torch.empty_like(x)
    _, _, mean, rstd = cpu.forward(x, r, w, b, eps=1e-5, rms=False, residual_dtype=None)
    _, tmean, trstd = torch.native_layer_norm(x, (N,), w, b, 1e-5)
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
        "torch layer_norm forward": lambda: torch.native_layer_norm(x, (N,), w, b, 1e-5),
        "addnorm layer_norm backward": lambda: cpu.backward(dy, None, (x,), w, mean, rstd, rms=False, has_bias=True),
        "addnorm add+layer_norm bwd, x+r": lambda: cpu.backward(
            dy, None, (x, r), w, mean, rstd, rms=False, has_bias=True
        ),
        "torch layer_norm backward": lambda: torch.ops.aten.native_layer_norm_backward(
            dy, x, (N,), tmean, trstd, w, b, (True, True, True)
        ),
    }


def best_seconds(fn, reps: int = 300) -> float:
    fn()
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dtype", nargs="?", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=300, help="calls per timed repetition (default 300)")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    small, large = calls(16, dtype), calls(80, dtype)
    print(f"{dtype}, 1 thread, rows of {N}: ns per element (slope between 16 and 80 rows)")
    for name in small:
        slope = (best_seconds(large[name], args.reps) - best_seconds(small[name], args.reps)) / (64 * N)
        print(f"  {name:32s} {slope * 1e9:.3f}")


if __name__ == "__main__":
    main()
