"""``benchmarks/compiled_call_cost.py``: the calls it times compute what they stand for (the op's
call and its implementation alone give the same results; the eager calls torch's gradients), and
its bad input is refused by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from conftest import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compiled_call_cost.py"
cost = load_benchmark("compiled_call_cost")


def test_the_timed_calls_compute_the_same_results(on_cpu):
    runs = cost.calls(8, 64, torch.float32, "cpu")
    op, alone = runs["addnorm::forward op, no grad"](), runs["its implementation alone"]()
    assert all(torch.equal(a, b) for a, b in zip(op, alone, strict=True))
    for got, want in zip(runs["addnorm eager"](), runs["torch eager"](), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_bad_shape_is_refused_by_name():
    bad = subprocess.run([sys.executable, str(SCRIPT), "--shape", "8by768"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--shape: expected rows x columns" in bad.stderr and "Traceback" not in bad.stderr


def test_the_lower_bounds_stand_for_the_call(on_cpu):
    """The allocation-only Function takes the eager call's inputs and gives gradients of their
    shapes; the kernels alone give the eager call's gradients (ds for x and the residual)."""
    runs = cost.calls(8, 64, torch.float32, "cpu")
    want = runs["addnorm eager"]()
    floor = runs["autograd.Function, allocates only"]()
    assert [t.shape for t in floor] == [t.shape for t in want]
    grads = runs["addnorm kernels alone, fwd + bwd"]()
    for got, expected in zip((grads.ds, grads.ds, grads.dweight, grads.dbias), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
