"""Where splitting a call over threads starts to pay in the CPU kernels (``parallel_min_elements``).

    python benchmarks/cpu_threads.py [ROWSxCOLS ...] [--rounds 15]   (default: 16x1024 ... 1024x1024)

fp32 add+layer_norm forward and layer_norm backward, ``addnorm.kernels.cpu`` called directly,
on one thread and on torch's thread count, with torch's own ops beside them for scale
(``layer_norm(x + r)`` and ``native_layer_norm_backward``). Timed interleaved by addnorm's
harness (``addnorm.tools.bench.measure``), median µs per call.
"""

from __future__ import annotations

import argparse

import torch

from addnorm.kernels import cpu
from addnorm.tools.bench import measure, parse_shapes
from addnorm.tools.cli import UsageError


def threaded(min_elements: int, fn):
    def run():
        with cpu.config.using(parallel_min_elements=min_elements):
            fn()

    return run


def calls(m: int, n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x, r, dy = (torch.randn(m, n, generator=g) for _ in range(3))
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    _, s, mean, rstd = cpu.forward(x, r, w, b, eps=1e-5, rms=False, residual_dtype=None)
    _, tmean, trstd = torch.native_layer_norm(s, (n,), w, b, 1e-5)
    fwd = lambda: cpu.forward(x, r, w, b, eps=1e-5, rms=False, residual_dtype=None)  # noqa: E731
    bwd = lambda: cpu.backward(dy, None, (s,), w, mean, rstd, rms=False, has_bias=True)  # noqa: E731
    return {
        "fwd 1 thread": threaded(1 << 62, fwd),
        "fwd threads": threaded(1, fwd),
        "fwd torch": lambda: torch.layer_norm(x + r, (n,), w, b, 1e-5),
        "bwd 1 thread": threaded(1 << 62, bwd),
        "bwd threads": threaded(1, bwd),
        "bwd torch": lambda: torch.ops.aten.native_layer_norm_backward(
            dy, s, (n,), tmean, trstd, w, b, (True, True, True)
        ),
    }


def _shape(text: str) -> tuple[int, int]:
    try:
        m, n = (int(v) for v in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS, e.g. 64x1024, got {text!r}") from None
    if m < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"rows and columns must be positive, got {text!r}")
    return m, n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="*", metavar="ROWSxCOLS", help="default: 16x1024 ... 1024x1024")
    p.add_argument("--rounds", type=int, default=15, help="interleaved samples per call (default 15)")
    args = p.parse_args()
    shapes = args.shapes or ["16x1024", "32x1024", "64x1024", "128x1024", "256x1024", "512x1024", "1024x1024"]
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    try:
        shapes = parse_shapes(",".join(shapes))
    except UsageError as e:
        p.error(str(e).replace("--shapes: ", ""))
    print(f"fp32, {torch.get_num_threads()} threads; median µs per call")
    for m, n in shapes:
        times = measure(calls(m, n), args.rounds, "cpu")
        print(f"{m:>5d}x{n:<5d} " + "  ".join(f"{k} {t[0] * 1e6:6.0f}" for k, t in times.items()))


if __name__ == "__main__":
    main()
