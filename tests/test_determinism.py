"""Determinism and threads.

Guarantee (docs/reliability.md): for a fixed backend and input, every output and gradient -- y,
s, dx, dresidual, dweight, dbias, dlayer_scale -- is bit-identical from run to run and for any
torch thread count: dweight/dbias are summed per block of rows fixed by the shape, then in a
fixed tree (the reduction contract). Calls from several Python threads at once neither deadlock
nor change any result.
"""

from __future__ import annotations

import threading

import pytest
import torch

import addnorm
from addnorm import reference

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
def test_one_and_two_threads_give_the_same_bits(backend, dtype, rms):
    with Threads(1):
        one = step(backend, dtype, rms)
    with Threads(2):
        two = step(backend, dtype, rms)
    for name, a, b in zip(NAMES, one, two, strict=False):
        assert torch.equal(a, b), f"{name} differs between 1 and 2 threads"


# The reduction contract (docs/reliability.md): dweight, dbias and dlayer_scale are the same bits
# on any number of threads, at row counts below, at and across the CPU backward's block
# boundaries (one block below 2**16 elements; blocks of at least 16 rows, at most 64 blocks).
OPS = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm_prenorm", "add_layer_norm_layer_scale"]
ROWS = [63, 64, pytest.param(1025, marks=pytest.mark.large), pytest.param(1100, marks=pytest.mark.large)]


def _parameter_grads(backend, op, dtype, m, n=1024):
    g = torch.Generator().manual_seed(m)
    make = lambda *shape: torch.randn(*shape, generator=g).to(dtype).requires_grad_()  # noqa: E731
    x, r, w, b, ls = make(m, n), make(m, n), make(n), make(n), make(n)
    if op == "layer_norm":
        out, params = addnorm.layer_norm(x, n, w, b, backend=backend), [w, b]
    elif op == "rms_norm":
        out, params = addnorm.rms_norm(x, n, w, backend=backend), [w]
    elif op == "add_layer_norm":
        out, params = addnorm.add_layer_norm(x, r, n, w, b, backend=backend), [w, b]
    elif op == "add_rms_norm_prenorm":
        out, params = addnorm.add_rms_norm(x, r, n, w, prenorm=True, backend=backend), [w]
    else:
        out, params = addnorm.add_layer_norm(x, r, n, w, b, layer_scale=ls, backend=backend), [w, b, ls]
    outs = out if isinstance(out, tuple) else (out,)
    cotangents = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
    return torch.autograd.grad(outs, params, cotangents)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", OPS)
def test_parameter_gradients_are_the_same_bits_on_any_thread_count(backend, op, dtype, m):
    with Threads(1):
        one = _parameter_grads(backend, op, dtype, m)
    for threads in (2, 3, 4):  # 3 and 4: more threads than this machine's cores, too
        with Threads(threads):
            other = _parameter_grads(backend, op, dtype, m)
        for i, (a, b) in enumerate(zip(one, other, strict=True)):
            assert torch.equal(a, b), f"parameter gradient {i} differs between 1 and {threads} threads"


def test_partial_rows_are_summed_in_a_fixed_tree():
    """reference.sum_partials: the pairwise tree, checked against its own definition written out."""
    p = torch.randn(7, 5, dtype=torch.float32)
    level1 = torch.cat((p[:3] + p[3:6], p[6:]))  # 7 rows: 3 pairs and the odd one out
    level2 = level1[:2] + level1[2:4]  # 4 rows: 2 pairs
    expected = level2[0] + level2[1]
    total = reference.sum_partials(p.clone())
    assert torch.equal(total, expected) and total.untyped_storage().nbytes() == 5 * 4  # not a view of p
    torch.testing.assert_close(reference.sum_partials(p.double()), p.double().sum(0))


def test_concurrent_python_threads_no_deadlock_same_results(backend):
    """Four Python threads call forward + backward at once; all finish, results unchanged."""
    jobs = [(dtype, rms) for dtype in (torch.float32, torch.bfloat16) for rms in (False, True)]
    expected = {job: step(backend, *job) for job in jobs}
    results: dict = {}
    errors: list[BaseException] = []

    device = torch.get_default_device()  # the default device is per thread

    def worker(job):
        try:
            torch.set_default_device(device)
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
