"""Post-norm training on the CPU backend: recompute the stream in the backward, or save it?

    python benchmarks/cpu_save_plan.py [ROWSxCOLS ...] [--dtype float32,bfloat16] [--op add_rms_norm]
        [--rounds 15]   (default shapes: 4096x768 4096x1024 2048x4096 16384x1024)

The CPU backend declares the stream dtypes it ``recomputes_stream`` for
(``addnorm.autograd.save_plan``: float32 and float64): their post-norm forward writes ``y``
alone and the backward adds ``s = x + residual`` again from the saved inputs. The other plan,
its choice for 16-bit streams, writes ``s`` in the forward and the backward reads it; this
script runs each plan for every dtype. Both move the same bytes over a forward+backward and
give the same bits (checked here); they differ in the fresh outputs a step writes (two or
three: each page of a fresh output faults on first write unless the allocator keeps freed
memory, docs/benchmarks.md, "Fresh outputs page-fault") and in the backward's arithmetic (an
add per element in each of its two passes, and two input streams instead of one).

Forward+backward through ``torch.autograd.grad`` with the plan switched between calls, both
plans and torch eager (``layer_norm(x + r)``) timed in shuffled order each round; the ratio is
the median over rounds of recompute's time over saving's (above 1: saving ``s`` is faster).
Run it as is and under the allocator setting that keeps freed memory
(``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296``): the
answer changes with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

import torch

import addnorm
from addnorm.checks import SUPPORTED_DTYPES
from addnorm.kernels import cpu
from addnorm.tools.bench import parse_shapes
from addnorm.tools.bench.measure import quantile
from addnorm.tools.cli import UsageError

SHAPES = "4096x768,4096x1024,2048x4096,16384x1024"


OWN = cpu.CAPABILITIES  # the backend's own choice, per dtype; restored when done
PLANS = {  # each plan for every dtype
    "recompute": dataclasses.replace(OWN, recomputes_stream=SUPPORTED_DTYPES),
    "save s": dataclasses.replace(OWN, recomputes_stream=()),
}


def one(m: int, n: int, dtype: torch.dtype, rms: bool, rounds: int) -> str:
    """The table row of one shape and dtype."""
    g = torch.Generator().manual_seed(0)
    x, r, dy = (torch.randn(m, n, generator=g).to(dtype) for _ in range(3))
    w, b = torch.ones(n, dtype=dtype), torch.zeros(n, dtype=dtype)
    leaves = [t.requires_grad_() for t in (x, r, w) + (() if rms else (b,))]
    if rms:
        ours = lambda: addnorm.add_rms_norm(x, r, n, w)  # noqa: E731
        theirs = lambda: torch.nn.functional.rms_norm(x + r, (n,), w)  # noqa: E731
    else:
        ours = lambda: addnorm.add_layer_norm(x, r, n, w, b)  # noqa: E731
        theirs = lambda: torch.nn.functional.layer_norm(x + r, (n,), w, b)  # noqa: E731

    def step(plan=None, fn=ours):
        if plan is not None:
            cpu.CAPABILITIES = PLANS[plan]
        return torch.autograd.grad(fn(), leaves, dy)

    same = all(torch.equal(a, c) for a, c in zip(step("recompute"), step("save s"), strict=True))
    cpu.CAPABILITIES = OWN  # (each timed run sets its own plan; main restores the backend's)
    runs = {"recompute": lambda: step("recompute"), "save s": lambda: step("save s"), "torch": lambda: step(fn=theirs)}
    times = {k: [] for k in runs}
    order = list(runs)
    for k in order:  # warm: compile, allocate
        runs[k]()
    for _ in range(rounds):
        random.shuffle(order)
        for k in order:
            t = time.perf_counter()
            runs[k]()
            times[k].append(time.perf_counter() - t)
    ratios = sorted(a / c for a, c in zip(times["recompute"], times["save s"], strict=True))
    med = {k: quantile(sorted(v), 0.5) * 1e3 for k, v in times.items()}
    return (
        f"| {m}x{n} | {str(dtype)[6:]} | {med['recompute']:.3f} | {med['save s']:.3f} | {med['torch']:.3f} | "
        f"{quantile(ratios, 0.5):.3f} ({quantile(ratios, 0.2):.2f}-{quantile(ratios, 0.8):.2f}) | {same} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="*", default=[SHAPES])
    p.add_argument("--dtype", default="float32,bfloat16")
    p.add_argument("--op", default="add_layer_norm", choices=["add_layer_norm", "add_rms_norm"])
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    try:
        shapes = parse_shapes(",".join(args.shapes))
    except UsageError as e:
        p.error(str(e).replace("--shapes: ", "shapes: "))
    dtypes = [getattr(torch, name, None) for name in args.dtype.split(",")]
    if not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes):
        p.error(f"--dtype: expected floating dtypes such as float32,bfloat16, got {args.dtype!r}")
    print(f"{args.op}, forward+backward, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| shape | dtype | recompute ms | save s ms | torch eager ms | recompute / save s (p20-p80) | same bits |")
    print("|---|---|---:|---:|---:|---:|---|")
    try:
        for m, n in shapes:
            for dtype in dtypes:
                print(one(m, n, dtype, args.op == "add_rms_norm", args.rounds), flush=True)
    finally:
        cpu.CAPABILITIES = OWN


if __name__ == "__main__":
    main()
