"""Parallel blocks on the CPU: both norms in one call, against two calls and against torch eager.

    python benchmarks/parallel_blocks.py [ROWSxCOLS ...] [--dtype float32|bfloat16] [--dropout-p P]
        [--rounds 15]   (default: 4096x1024 2048x4096, no dropout)

A parallel block (GPT-J, GPT-NeoX, Falcon, PaLM) adds two sublayer outputs to the stream and
normalizes it twice: ``y, y1, s = add_layer_norm(x, residual, n, weight, bias, x1=x1,
weight1=weight1, bias1=bias1, prenorm=True)``. Timed side by side in one process
(``addnorm.tools.bench.measure``, interleaved rounds), on torch's thread count:

- ``one call``: the cpu backend's second norm (``Capabilities.second_norm``): the stream read
  once, ``y`` and ``y1`` written by one loop; one backward pass for both norms;
- ``two calls``: the same op with the capability switched off: the norm of ``s``, then a
  second norm of ``s`` (what a backend without it runs);
- ``torch eager``: ``s = residual + x1 + x``, then ``F.layer_norm`` twice.

``--dropout-p``: each sublayer output dropped with its own mask (``F.dropout`` of each for torch
eager).

Passes: the forward under ``no_grad`` (inference) and a training forward with its backward.
Prints median ms per call and how much faster the one call is. Run with
``GLIBC_TUNABLES=glibc.malloc.mmap_max=0`` so that fresh outputs do not page-fault
(docs/benchmarks.md, "Fresh outputs page-fault").
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import addnorm
from addnorm.kernels import cpu
from addnorm.tools.bench import measure, parse_shapes
from addnorm.tools.cli import UsageError

F = torch.nn.functional
IMPLS = ("one call", "two calls", "torch eager")


def block(impl: str, n: int, p: float = 0.0):
    """``(x, residual, x1, weight, bias, weight1, bias1) -> (y, y1, s)`` of ``impl``, each
    sublayer output dropped with probability ``p``."""
    if impl == "torch eager":

        def run(x, r, x1, w, b, w1, b1):
            s = r + F.dropout(x1, p) + F.dropout(x, p) if p else r + x1 + x
            return F.layer_norm(s, (n,), w, b), F.layer_norm(s, (n,), w1, b1), s

        return run
    fused = impl == "one call"
    capabilities = dataclasses.replace(cpu.CAPABILITIES, second_norm=fused)

    def run(x, r, x1, w, b, w1, b1):
        saved, cpu.CAPABILITIES = cpu.CAPABILITIES, capabilities
        try:
            return addnorm.add_layer_norm(
                x, r, n, w, b, x1=x1, weight1=w1, bias1=b1, prenorm=True, dropout_p=p, backend="cpu"
            )
        finally:
            cpu.CAPABILITIES = saved

    return run


def calls(m: int, n: int, dtype: torch.dtype, p: float = 0.0) -> dict:
    """``(pass, impl) -> callable`` for every pass and implementation, on one set of tensors."""
    g = torch.Generator().manual_seed(0)
    x, r, x1, dy, dy1, ds = (torch.randn(m, n, generator=g).to(dtype) for _ in range(6))
    w, b, w1, b1 = (torch.randn(n, generator=g).to(dtype) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (x, r, x1, w, b, w1, b1)]
    runs = {}
    for impl in IMPLS:
        fn = block(impl, n, p)

        def fwd(fn=fn):
            with torch.no_grad():
                return fn(x, r, x1, w, b, w1, b1)

        def train(fn=fn):
            return torch.autograd.grad(fn(*leaves), leaves, (dy, dy1, ds))

        runs[("fwd", impl)], runs[("fwd+bwd", impl)] = fwd, train
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="*", metavar="ROWSxCOLS", help="default: 4096x1024 2048x4096")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="default float32")
    p.add_argument("--dropout-p", type=float, default=0.0, help="dropout of x and x1 (default 0)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved samples per call (default 15)")
    args = p.parse_args()
    if not 0 <= args.dropout_p < 1:
        p.error("--dropout-p must be in [0, 1)")
    dtype = getattr(torch, args.dtype)
    try:
        shapes = parse_shapes(",".join(args.shapes or ["4096x1024", "2048x4096"]))
    except UsageError as err:
        p.error(str(err).replace("--shapes: ", ""))
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    dropout = f", dropout_p={args.dropout_p}" if args.dropout_p else ""
    print(f"{args.dtype}{dropout}, {torch.get_num_threads()} threads; median ms per call (one call's speed-up)")
    for m, n in shapes:
        t = measure(calls(m, n, dtype, args.dropout_p), args.rounds, "cpu")
        for pass_ in ("fwd", "fwd+bwd"):
            one = t[(pass_, "one call")][0]
            cells = [f"one call {one * 1e3:7.3f}"]
            for impl in IMPLS[1:]:
                other = t[(pass_, impl)][0]
                cells.append(f"{impl} {other * 1e3:7.3f} ({other / one:.2f}x)")
            print(f"{m:>5d}x{n:<5d} {pass_:<8s} " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
