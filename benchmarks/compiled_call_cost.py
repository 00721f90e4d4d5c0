"""Cost per call of one Add & Norm, forward + backward, eager and under ``torch.compile``.

    python benchmarks/compiled_call_cost.py [--shape 8x768] [--dtype float32] [--device cpu] [--rounds 15]

At a small shape the call's time is its host cost: Python, dispatch, launches. Compiled, each
addnorm norm stays a custom op that Inductor calls as it is, with addnorm's Python and
torch.library's around the kernels (docs/performance-log.md, "On an NVIDIA H200: `patch()` on CUDA,
training steps under `torch.compile`"). Two rows bound the eager call from below: an
``autograd.Function`` with the same inputs and output that only allocates (the Python autograd
layer every eager call pays, whatever its kernels), and the backend's forward and backward called
alone (the kernels with their launcher, no autograd). The last two rows split one forward op's call:
``torch.ops.addnorm.forward`` with no gradient (torch.library's dispatch and its Python
autograd layer, then addnorm's implementation) against that implementation called alone. All
calls are timed interleaved by addnorm's harness (``addnorm.tools.bench.measure``), one thread.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import addnorm
from addnorm import autograd
from addnorm import backend as backends
from addnorm.tools.bench import measure


class AllocatesOnly(torch.autograd.Function):
    """An Add & Norm's autograd bookkeeping and nothing else: the inputs of ``add_layer_norm``
    (x, residual, weight, bias), one output, and gradients that are only allocated."""

    @staticmethod
    def forward(ctx, x, r, w, b):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        ds = torch.empty_like(dy)
        return ds, ds, dy.new_empty(dy.shape[-1:]), dy.new_empty(dy.shape[-1:])


def inputs(m: int, n: int, dtype: torch.dtype, device: str) -> tuple:
    """``(x, r, w, b, dy, leaves)`` of the timed call: rows ``x`` and ``r``, parameters ``w`` and
    ``b``, an incoming gradient ``dy``, and ``leaves``, copies of x, r, w, b that require grad
    (benchmarks/call_instructions.py counts calls on the same inputs)."""
    g = torch.Generator(device=device).manual_seed(0)
    x, r, dy = (torch.randn(m, n, generator=g, device=device).to(dtype) for _ in range(3))
    w, b = (torch.randn(n, generator=g, device=device).to(dtype) for _ in range(2))
    return x, r, w, b, dy, [t.clone().requires_grad_() for t in (x, r, w, b)]


def norms(n: int) -> tuple:
    """The two calls compared, of ``(x, r, w, b)`` with rows of ``n`` features: addnorm's pre-norm
    ``add_layer_norm`` (its ``y``) and torch's ``layer_norm(x + r)``."""

    def ours(x, r, w, b):
        return addnorm.add_layer_norm(x, r, n, w, b, prenorm=True)[0]

    def torch_norm(x, r, w, b):
        return F.layer_norm(x + r, (n,), w, b)

    return ours, torch_norm


def calls(m: int, n: int, dtype: torch.dtype, device: str) -> dict:
    x, r, w, b, dy, leaves = inputs(m, n, dtype, device)
    ours, torch_norm = norms(n)

    def step(fn):
        return lambda: torch.autograd.grad(fn(*leaves), leaves, dy)

    impl = backends.resolve("auto", x)

    def kernels_alone():
        y, s, mean, rstd = impl.forward(x, r, w, b, eps=1e-5, rms=False, residual_dtype=None)
        return impl.backward(dy, None, (s,), w, mean, rstd, rms=False, has_bias=True, param_dtype=dtype)

    op_args = (x, r, w, b, 1e-5, False, None, backends.auto_name(x), True)
    return {
        "addnorm eager": step(ours),
        "addnorm compiled": step(torch.compile(ours)),
        "torch eager": step(torch_norm),
        "torch compiled": step(torch.compile(torch_norm)),
        "autograd.Function, allocates only": step(AllocatesOnly.apply),
        "addnorm kernels alone, fwd + bwd": kernels_alone,
        "addnorm::forward op, no grad": lambda: torch.ops.addnorm.forward(*op_args),
        "its implementation alone": lambda: autograd._forward_impl(*op_args),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8x768", help="rows x columns (default 8x768)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved samples per call (default 15)")
    args = p.parse_args()
    try:
        m, n = (int(v) for v in args.shape.split("x"))
    except ValueError:
        p.error(f"--shape: expected rows x columns, e.g. 8x768; got {args.shape!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    torch.set_num_threads(1)
    runs = calls(m, n, getattr(torch, args.dtype), args.device)
    times = measure(runs, args.rounds, args.device)
    print(f"{args.shape} {args.dtype} on {args.device}, 1 thread: median µs per call (p20-p80)")
    for name, (median, low, high) in times.items():
        print(f"  {name:34s} {median * 1e6:8.1f}  ({low * 1e6:.1f}-{high * 1e6:.1f})")


if __name__ == "__main__":
    main()
