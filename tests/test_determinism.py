"""Determinism and threads.

Guarantee (docs/reliability.md): for a fixed backend, input and torch thread count, every
output and gradient -- y, s, dx, dresidual, dweight, dbias -- is bit-identical from run to
run; dweight/dbias are reduced in a fixed order. Across thread counts results agree within
the dtype's tolerance. Calls from several Python threads at once neither deadlock nor
change any result.
"""

from __future__ import annotations

import threading

import pytest
import torch

import addnorm
from conftest import TOLERANCES

pytestmark = pytest.mark.usefixtures("parallel_cpu_kernels")

M, N = 64, 384  # several row blocks / parallel chunks, yet cheap for every backend
NAMES = ["y", "s", "dx", "dresidual", "dweight", "dbias"]


def step(backend: str, dtype: torch.dtype, rms: bool, seed: int = 0) -> list[torch.Tensor]:
    """One pre-norm Add & Norm forward + backward: [y, s, dx, dresidual, dweight, (dbias)]."""
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).to(dtype).requires_grad_()
    x, r, w = make(M, N), make(M, N), make(N)
    b = None if rms else make(N)
    dy, dstream = torch.randn(M, N, generator=g).to(dtype), torch.randn(M, N, generator=g).to(dtype)
    if rms:
        y, s = addnorm.add_rms_norm(x, r, N, w, prenorm=True, backend=backend)
    else:
        y, s = addnorm.add_layer_norm(x, r, N, w, b, prenorm=True, backend=backend)
    leaves = [t for t in (x, r, w, b) if t is not None]
    return [y.detach(), s.detach(), *torch.autograd.grad((y, s), leaves, (dy, dstream))]


class Threads:
    """``with Threads(n):`` runs the block with ``torch.set_num_threads(n)``, then restores."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_bit_identical_across_runs(backend, dtype, rms, threads):
    with Threads(threads):
        first = step(backend, dtype, rms)
        for _ in range(2):
            again = step(backend, dtype, rms)
            for name, a, b in zip(NAMES, first, again, strict=False):
                assert torch.equal(a, b), f"{name} differs between two identical runs ({threads} threads)"


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_and_two_threads_agree(backend, dtype, rms):
    with Threads(1):
        one = step(backend, dtype, rms)
    with Threads(2):
        two = step(backend, dtype, rms)
    rtol, atol = TOLERANCES[dtype]
    for a, b in zip(one, two, strict=True):
        # dweight/dbias sum M rows; a different reduction split may round differently
        scale = M**0.5 if a.dim() == 1 else 1.0
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * scale)


def test_concurrent_python_threads_no_deadlock_same_results(backend):
    """Four Python threads call forward + backward at once; all finish, results unchanged."""
    jobs = [(dtype, rms) for dtype in (torch.float32, torch.bfloat16) for rms in (False, True)]
    expected = {job: step(backend, *job) for job in jobs}
    results: dict = {}
    errors: list[BaseException] = []

    def worker(job):
        try:
            for _ in range(3):
                results[job] = step(backend, *job)
                for a, b in zip(expected[job], results[job], strict=True):
                    assert torch.equal(a, b)
        except BaseException as err:  # reported in the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(job,), daemon=True) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread is still running after 120 s: deadlock?"
    assert not errors, errors
    assert set(results) == set(jobs)
