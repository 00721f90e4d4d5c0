"""The Python a call through the triton backend runs on the host, measured without a GPU.

On a GPU a call of a few rows is bound by its host time (docs/benchmarks.md, "GPU: where it
stands"): checks, routing, allocations, the launch's arguments and the key of its compiled kernel
(``addnorm.kernels.triton.common.launch``). This times that Python on CPU tensors, every launch
replaced by what a launch does before the kernel runs when its kernel is compiled already (the
key, built as on a GPU, looked up); neither Triton's launch nor the kernel runs. A CPU tensor's
allocation is cheaper than a CUDA tensor's, so the GPU's host cost is more than this;
``gpu_checklist.py --only env,host`` measures it on a GPU.

    python benchmarks/triton_host_python.py [--shape 8x768] [--dtype bfloat16] [--rounds 7]

Routes (``add_layer_norm`` post-norm, no gradients): ``backend="triton"`` (the general route);
``backend="auto"`` with the triton backend as the CPU's "auto" (the shortcut to its
``plain_forward``, where the tree has one); the backend's ``forward`` and ``plain_forward``
called directly. Then a training step's forward and backward (``torch.autograd.grad``) with
``backend="triton"`` and with ``backend="auto"`` (the triton backend as "auto", as above). Run it
against another tree with ``PYTHONPATH=<tree>/src`` to compare.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import timeit
from collections.abc import Callable

os.environ["TRITON_INTERPRET"] = "1"  # (CPU tensors: the kernels are never run, but must import)

import torch  # noqa: E402

import addnorm  # noqa: E402
from addnorm import backend as backends  # noqa: E402
from addnorm.kernels import triton as K  # noqa: E402
from addnorm.kernels.triton import common  # noqa: E402
from addnorm.tools.bench.rows import machine_name  # noqa: E402


def _launch_found(kernel, grid, args, num_warps, **constexprs) -> None:
    """A launch up to its compiled kernel: the key of :func:`common.launch`, looked up."""
    if hasattr(common, "_key"):
        key = common._key(kernel, args, num_warps, constexprs)
    else:  # (a tree from before the key had a function of its own builds it as its launch did)
        settings = common._settings(kernel)
        key = (kernel, args[0].device.index, num_warps, settings, *constexprs.items(), *map(common._spec, args))
    common._COMPILED.get(key)


@contextlib.contextmanager
def launches_stopped():
    """Within: every launch of the forward's and the backward's kernels stops once its compiled
    kernel is found (the kernel never runs: what it would write is left as allocated)."""
    modules = (K.forward_kernels, K.backward_kernels)
    real = [module.launch for module in modules]
    for module in modules:
        module.launch = _launch_found
    try:
        yield
    finally:
        for module, launch in zip(modules, real, strict=True):
            module.launch = launch


@contextlib.contextmanager
def triton_as_auto():
    """Within: ``backend="auto"`` runs the triton backend on CPU tensors, as it does on CUDA ones."""
    backends.register("triton_as_auto", K, device_types_for_auto=("cpu",))
    try:
        yield
    finally:
        backends.unregister("triton_as_auto")


def calls(m: int, n: int, dtype: torch.dtype) -> dict[str, Callable]:
    """The timed calls by name, on rows of ``m x n`` (post-norm ``add_layer_norm`` on inputs that
    need no gradient): each returns ``y``. The ``backend='auto'`` call needs :func:`triton_as_auto`."""
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(m, n, generator=g).to(dtype) for _ in range(2))
    w, b = (torch.randn(n, generator=g).to(dtype) for _ in range(2))
    forward_kw = dict(eps=1e-5, rms=False, residual_dtype=None, write_stream=False, write_stats=False)
    runs = {
        "add_layer_norm, backend='triton'": lambda: addnorm.add_layer_norm(x, r, n, w, b, backend="triton"),
        "backend forward": lambda: K.forward(x, r, w, b, **forward_kw)[0],
    }
    if hasattr(K, "plain_forward"):
        runs["add_layer_norm, backend='auto'"] = lambda: addnorm.add_layer_norm(x, r, n, w, b)
        runs["backend plain_forward"] = lambda: K.plain_forward(x, r, w, b, 1e-5, False, False)[0]
    return runs


def training_call(m: int, n: int, dtype: torch.dtype, backend: str = "triton") -> Callable:
    """A training step's call, ``backend="triton"`` (the general route), or ``"auto"`` (the
    shortcut, where the tree has one: what "auto" runs on CUDA tensors; needs
    :func:`triton_as_auto`): the forward of post-norm ``add_layer_norm`` on inputs that require
    gradients, and their gradients through ``torch.autograd.grad``; returns ``(y, grads)``."""
    g = torch.Generator().manual_seed(0)
    leaves = [
        t.to(dtype).requires_grad_() for t in (torch.randn(*s, generator=g) for s in ((m, n), (m, n), (n,), (n,)))
    ]
    dy = torch.randn(m, n, generator=g).to(dtype)

    def step():
        y = addnorm.add_layer_norm(leaves[0], leaves[1], n, *leaves[2:], backend=backend)
        return y.detach(), torch.autograd.grad(y, leaves, dy)

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8x768", help="rows x features (default 8x768)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--rounds", type=int, default=7, help="the best of this many rounds of 2000 calls")
    args = p.parse_args()
    try:
        m, n = map(int, args.shape.split("x"))
    except ValueError:
        p.error(f"--shape must be ROWSxFEATURES, such as 8x768; got {args.shape!r}")
    if m < 1 or n < 1:
        p.error(f"--shape needs at least one row of one feature; got {args.shape!r}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1; got {args.rounds}")
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    print(f"{machine_name('cpu')}, torch {torch.__version__}, 1 thread, {m}x{n} {args.dtype}")
    print(f"addnorm from {os.path.dirname(addnorm.__file__)}")
    with launches_stopped(), triton_as_auto():
        addnorm.layer_norm(torch.zeros(1, n, dtype=dtype), n)  # ("auto" chooses its backend on its first call)
        runs = calls(m, n, dtype)
        for backend in ("triton", "auto"):
            runs[f"fwd+bwd, backend='{backend}'"] = training_call(m, n, dtype, backend)
        for name, call in runs.items():
            call()
            best = min(timeit.repeat(call, number=2000, repeat=args.rounds)) / 2000
            print(f"  {name:36s} {best * 1e6:7.2f} µs per call")


if __name__ == "__main__":
    main()
