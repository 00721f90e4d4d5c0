"""Batch invariance: a row's output and gradient are bitwise the same whatever else is in the call.

The same row (and its output gradient) is placed in batches of 1 to 2048 rows, at the first,
a middle and the last position, and run with 1 and 2 threads, in training (forward + backward)
and in inference (no_grad). Every result must equal the single-row call's bit for bit, on every
backend and through ``"auto"``. Sizes reach past every threshold a path could key on (2**16
elements for the CPU kernels' threads, 2**20 overall, one row of 40000 features beside torch's
own 32768-element reduction grain).
"""

from __future__ import annotations

import math

import pytest
import torch

import addnorm
from conftest import interpreted


def _call(x, r, n, w, b, op, backend):
    if op == "layer":
        return addnorm.layer_norm(x, n, w, b, backend=backend)
    if op == "rms":
        return addnorm.rms_norm(x, n, w, backend=backend)
    fn = addnorm.add_layer_norm if op.startswith("add_layer") else addnorm.add_rms_norm
    args = (x, r, n, w) if "rms" in op else (x, r, n, w, b)
    return fn(*args, prenorm=op.endswith("pre"), backend=backend)


def _row_results(op, backend, dtype, n, m, pos, threads, seed_row):
    """The results belonging to one fixed row placed at ``pos`` in a batch of ``m`` random rows."""
    g = torch.Generator().manual_seed(1000 + m)  # the other rows differ from batch to batch
    row = torch.Generator().manual_seed(seed_row)
    x, r, dy, dst = (torch.randn(m, n, generator=g) * 3 + 5 for _ in range(4))
    for t in (x, r, dy, dst):
        t[pos] = torch.randn(n, generator=row) * 3 + 5
    x, r, dy, dst = (t.to(dtype) for t in (x, r, dy, dst))
    w = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(dtype)
    b = torch.randn(n, generator=torch.Generator().manual_seed(8)).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            out = _call(x, r, n, w, b, op, backend)
        inference = out if isinstance(out, tuple) else (out,)
        x.requires_grad_(), r.requires_grad_(), w.requires_grad_()
        out = _call(x, r, n, w, b, op, backend)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, (dy, dst)[: len(outs)])
    finally:
        torch.set_num_threads(before)
    grads = [x.grad[pos]] + ([r.grad[pos]] if op.startswith("add") else [])
    return [t[pos] for t in inference] + [t[pos].detach() for t in outs] + grads


OPS = ["layer", "rms", "add_layer_post", "add_layer_pre", "add_rms_post", "add_rms_pre"]


def _check(op, backend, dtype, n, batches):
    alone = _row_results(op, backend, dtype, n, 1, 0, 1, seed_row=3)
    for m in batches:
        for pos in sorted({0, m // 2, m - 1}):
            for threads in (1, 2):
                got = _row_results(op, backend, dtype, n, m, pos, threads, seed_row=3)
                for i, (a, c) in enumerate(zip(alone, got)):
                    assert torch.equal(a, c), (
                        f"result {i} of the row differs at batch {m}, position {pos}, {threads} threads: "
                        f"max diff {(a.double() - c.double()).abs().max().item():.3g}"
                    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", OPS)
def test_a_row_is_the_same_in_every_batch(backend, op, dtype):
    batches = [2, 7, 64] if interpreted(backend) else [2, 8, 2048]  # 2048x768 > 2**20 elements
    _check(op, backend, dtype, 768, batches)


@pytest.mark.large
@pytest.mark.parametrize("op", ["layer", "add_rms_pre"])
def test_a_wide_row_is_the_same_in_every_batch(backend, op):
    """One row of 40000 features: above torch's reduction grain, where a single-row reduction
    may be split over threads, and above every CPU-kernel threshold on its own."""
    _check(op, backend, torch.float32, 40000, [2, 33])


@pytest.mark.parametrize("n", [1, 2, 7, 1023, 4096, 40000])
def test_the_reference_folds_rows_in_an_order_fixed_by_the_width(n):
    """``reference.fold_rows``, the reference's row sums off the CPU: each row's bits do not
    depend on the rows beside it, and the sum is within a pairwise sum's error of float64's."""
    from addnorm import reference

    x = torch.randn(9, n, generator=torch.Generator("cpu").manual_seed(n), device="cpu") + 3
    folded = reference.fold_rows(x)
    assert folded.shape == (9, 1)
    for i in (0, 4, 8):
        assert torch.equal(reference.fold_rows(x[i : i + 1]), folded[i : i + 1])
        assert torch.equal(reference.fold_rows(x[i:].clone())[0], folded[i])
    exact = x.double().sum(-1, keepdim=True)
    bound = torch.finfo(torch.float32).eps * max(1, math.ceil(math.log2(n))) * x.double().abs().sum(-1, keepdim=True)
    assert ((folded.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", OPS)
def test_a_row_is_the_same_whatever_the_batch_layout(backend, op, dtype):
    """The batch's inputs column-major (a transposed activation) and the output gradient one row
    expanded over the batch (stride 0): each row's results as it gives alone and contiguous."""
    n, m = 768, 16 if interpreted(backend) else 256
    g = torch.Generator().manual_seed(5)
    x, r, dst = ((torch.randn(n, m, generator=g) * 3 + 5).to(dtype).t() for _ in range(3))
    dy = (torch.randn(n, generator=g) * 3 + 5).to(dtype).expand(m, n)
    w, b = (torch.randn(n, generator=g).to(dtype) for _ in range(2))

    def results(x, r, dy, dst):
        x, r = x.detach().requires_grad_(), r.detach().requires_grad_()
        out = _call(x, r, n, w, b, op, backend)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, (dy, dst)[: len(outs)])
        return [t.detach() for t in outs] + [x.grad] + ([r.grad] if op.startswith("add") else [])

    batch = results(x, r, dy, dst)
    for i in sorted({0, m // 2, m - 1}):
        alone = results(*(t[i : i + 1].contiguous() for t in (x, r, dy, dst)))
        for k, (a, c) in enumerate(zip(alone, batch)):
            assert torch.equal(a[0], c[i]), (
                f"result {k} of row {i} differs: {(a[0].double() - c[i].double()).abs().max()}"
            )
