"""Parallel blocks: both norms in one call, against two calls, torch eager and flash-attn.

    python benchmarks/parallel_blocks.py [ROWSxCOLS ...] [--dtype float32|bfloat16] [--dropout-p P]
        [--rounds 15] [--device cpu|cuda]   (default: 4096x1024 2048x4096, no dropout, cpu)

A parallel block (GPT-J, GPT-NeoX, Falcon, PaLM) adds two sublayer outputs to the stream and
normalizes it twice: ``y, y1, s = add_layer_norm(x, residual, n, weight, bias, x1=x1,
weight1=weight1, bias1=bias1, prenorm=True)``. Timed side by side in one process
(``addnorm.tools.bench.measure``, interleaved rounds), on torch's thread count:

- ``one call``: the cpu backend's second norm (``Capabilities.second_norm``): the stream read
  once, ``y`` and ``y1`` written by one loop; one backward pass for both norms (on ``cuda``
  the triton backend's, which does the same in its kernels);
- ``two calls``: the same op with the capability switched off: the norm of ``s``, then a
  second norm of ``s`` (what a backend without it runs);
- ``torch eager``: ``s = residual + x1 + x``, then ``F.layer_norm`` twice;
- ``flash-attn`` (on ``cuda``, where ``flash_attn.ops.triton.layer_norm`` imports):
  its ``layer_norm_fn`` with ``x1``, ``weight1`` and ``bias1``, which also fuses both norms.

``--dropout-p``: each sublayer output dropped with its own mask (``F.dropout`` of each for torch
eager).

Passes: the forward under ``no_grad`` (inference) and a training forward with its backward.
Prints median ms per call (wall clock, synchronized on ``cuda``) and how much faster the one call
is. On the CPU, run with ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0`` so that fresh outputs do not
page-fault (docs/benchmarks.md, "Fresh outputs page-fault").
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib

import torch

import addnorm
from addnorm.tools.bench import measure, parse_shapes
from addnorm.tools.cli import UsageError

F = torch.nn.functional
IMPLS = ("one call", "two calls", "torch eager")
BACKENDS = {"cpu": "cpu", "cuda": "triton"}  # the backend timed on each device type


def impls(device: str = "cpu") -> tuple[str, ...]:
    """The implementations timed on ``device``: flash-attn's fused norm too where it imports."""
    if device == "cpu":
        return IMPLS
    try:
        importlib.import_module("flash_attn.ops.triton.layer_norm")
    except ImportError:
        return IMPLS
    return (*IMPLS, "flash-attn")


def block(impl: str, n: int, p: float = 0.0, device: str = "cpu"):
    """``(x, residual, x1, weight, bias, weight1, bias1) -> (y, y1, s)`` of ``impl``, each
    sublayer output dropped with probability ``p``."""
    if impl == "torch eager":

        def run(x, r, x1, w, b, w1, b1):
            s = r + F.dropout(x1, p) + F.dropout(x, p) if p else r + x1 + x
            return F.layer_norm(s, (n,), w, b), F.layer_norm(s, (n,), w1, b1), s

        return run
    if impl == "flash-attn":
        from flash_attn.ops.triton.layer_norm import layer_norm_fn

        def run(x, r, x1, w, b, w1, b1):
            return layer_norm_fn(x, w, b, r, x1, w1, b1, eps=1e-5, dropout_p=p, prenorm=True)

        return run
    backend = BACKENDS[device]
    module = importlib.import_module(f"addnorm.kernels.{backend}")
    capabilities = dataclasses.replace(module.CAPABILITIES, second_norm=impl == "one call")

    def run(x, r, x1, w, b, w1, b1):
        saved, module.CAPABILITIES = module.CAPABILITIES, capabilities
        try:
            return addnorm.add_layer_norm(
                x, r, n, w, b, x1=x1, weight1=w1, bias1=b1, prenorm=True, dropout_p=p, backend=backend
            )
        finally:
            module.CAPABILITIES = saved

    return run


def calls(m: int, n: int, dtype: torch.dtype, p: float = 0.0, device: str = "cpu") -> dict:
    """``(pass, impl) -> callable`` for every pass and implementation, on one set of tensors."""
    g = torch.Generator().manual_seed(0)
    x, r, x1, dy, dy1, ds = (torch.randn(m, n, generator=g).to(device, dtype) for _ in range(6))
    w, b, w1, b1 = (torch.randn(n, generator=g).to(device, dtype) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (x, r, x1, w, b, w1, b1)]
    runs = {}
    for impl in impls(device):
        fn = block(impl, n, p, device)

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
    p.add_argument("--device", default="cpu", choices=sorted(BACKENDS), help="default cpu")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
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
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"{args.dtype}{dropout}, {where}; median ms per call (one call's speed-up)")
    for m, n in shapes:
        t = measure(calls(m, n, dtype, args.dropout_p, args.device), args.rounds, args.device)
        for pass_ in ("fwd", "fwd+bwd"):
            one = t[(pass_, "one call")][0]
            cells = [f"one call {one * 1e3:7.3f}"]
            for impl in impls(args.device)[1:]:
                other = t[(pass_, impl)][0]
                cells.append(f"{impl} {other * 1e3:7.3f} ({other / one:.2f}x)")
            print(f"{m:>5d}x{n:<5d} {pass_:<8s} " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
