"""Instructions per call of one Add & Norm at a small shape, counted by valgrind: the host cost
without the machine's noise.

    python benchmarks/call_instructions.py [--shape 8x768] [--dtype float32] [--steps 200] [--calls a,b]

At a small shape a call's time is its host cost (Python, dispatch, allocations, autograd), and on
a shared machine that time moves from run to run; the instructions the call executes do not.
Each call runs in a process of its own under ``valgrind --tool=callgrind``, instrumented only
once it is warm, and only the instructions inside one ``sorted`` over ``--steps`` calls are
counted (``--toggle-collect`` on CPython's ``list_sort_impl``). Instructions are not time (Python's
code runs fewer of them per cycle than torch's C++), so the counts compare how much host code each
call runs, before and after a change, not how fast it is (docs/benchmarks.md, "Per-call cost at
small sizes"). Needs valgrind and a CPython whose symbols valgrind can see. After an edit to the
kernels' source, run it twice and keep the second: the first run after one counted 726 K
instructions for a forward+backward the next run counted at 530 K (the kernel entries had to
compile anew for the new source; why that moved the count was not traced).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compiled_call_cost import AllocatesOnly, inputs, norms  # noqa: E402

CALLS = (
    "addnorm fwd+bwd",
    "torch fwd+bwd",
    "Function allocating only fwd+bwd",
    "addnorm fwd no-grad",
    "torch fwd no-grad",
)


def calls(m: int, n: int, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """The counted calls: a pre-norm ``add_layer_norm`` and torch's ``layer_norm(x + r)``, forward
    and backward (``autograd.grad`` of ``y`` over x, the residual, the weight and the bias) and
    forward alone without gradients, and the floor of a Python ``autograd.Function`` with the same
    inputs that only allocates (benchmarks/compiled_call_cost.py)."""
    x, r, w, b, dy, leaves = inputs(m, n, dtype, "cpu")
    ours, torchs = norms(n)

    def step(fn):
        return lambda: torch.autograd.grad(fn(*leaves), leaves, dy)

    def no_grad(fn):
        def call():
            with torch.no_grad():
                return fn(x, r, w, b)

        return call

    return {
        "addnorm fwd+bwd": step(ours),
        "torch fwd+bwd": step(torchs),
        "Function allocating only fwd+bwd": step(AllocatesOnly.apply),
        "addnorm fwd no-grad": no_grad(ours),
        "torch fwd no-grad": no_grad(torchs),
    }


def collected(valgrind_output: str) -> int | None:
    """The instruction count callgrind reports (``==pid== Collected : N``), or None."""
    found = re.search(r"Collected\s*:\s*(\d+)", valgrind_output)
    return int(found.group(1)) if found else None


def _child(name: str, m: int, n: int, dtype: torch.dtype, steps: int) -> None:
    """Run under callgrind: warm the call up, turn instrumentation on, then call it ``steps`` times
    inside one ``sorted`` (the only instructions collected)."""
    torch.set_num_threads(1)
    run = calls(m, n, dtype)[name]
    for _ in range(20):
        run()
    subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], capture_output=True, check=False)
    time.sleep(1.0)  # (callgrind takes the command up asynchronously)
    for _ in range(5):  # (code instrumented from now on runs once before it is counted)
        run()
    sorted(range(steps), key=lambda i: (run(), i)[1])


def count(name: str, shape: str, dtype: str, steps: int) -> int:
    """Instructions per call of ``name``, from a child process under callgrind."""
    command = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--collect-atstart=no",
        "--toggle-collect=list_sort_impl",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        name,
        "--shape",
        shape,
        "--dtype",
        dtype,
        "--steps",
        str(steps),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    total = collected(done.stderr)
    if done.returncode != 0 or not total:
        tail = done.stderr.strip().splitlines()[-3:]
        raise RuntimeError(f"{name}: nothing counted (exit {done.returncode}); valgrind said: {' | '.join(tail)}")
    return round(total / steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8x768", help="rows x columns (default 8x768)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--steps", type=int, default=200, help="calls counted per implementation (default 200)")
    p.add_argument("--calls", default=",".join(CALLS), help=f"comma-separated, of: {', '.join(CALLS)}")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    try:
        m, n = (int(v) for v in args.shape.split("x"))
    except ValueError:
        p.error(f"--shape: expected rows x columns, e.g. 8x768; got {args.shape!r}")
    if args.steps < 1:
        p.error(f"--steps: expected a positive count, got {args.steps}")
    if args.child:
        _child(args.child, m, n, getattr(torch, args.dtype), args.steps)
        return
    names = [name.strip() for name in args.calls.split(",")]
    unknown = [name for name in names if name not in CALLS]
    if unknown:
        p.error(f"--calls: unknown {', '.join(map(repr, unknown))}; expected some of: {', '.join(CALLS)}")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        p.error("valgrind (with callgrind_control) is not installed: it counts the instructions")
    print(f"{args.shape} {args.dtype} on the CPU, 1 thread: instructions per call ({args.steps} calls counted)")
    counts = {}
    for name in names:
        try:
            counts[name] = count(name, args.shape, args.dtype, args.steps)
        except RuntimeError as err:
            print(f"  {name:34s} {err}")
            continue
        print(f"  {name:34s} {counts[name]:>10,}")
    for ours, theirs in (("addnorm fwd+bwd", "torch fwd+bwd"), ("addnorm fwd no-grad", "torch fwd no-grad")):
        if ours in counts and theirs in counts:
            print(f"  {ours} / {theirs}: {counts[ours] / counts[theirs]:.2f}")


if __name__ == "__main__":
    main()
