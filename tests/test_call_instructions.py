"""``benchmarks/call_instructions.py``: the counted calls compute what they stand for, callgrind's
count is read from its report, and bad input is refused by name (the counting itself runs
valgrind for minutes: it is the benchmark's, not the tests')."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from conftest import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "call_instructions.py"
instructions = load_benchmark("call_instructions")


def test_the_counted_calls_compute_torchs_results(on_cpu):
    runs = instructions.calls(8, 64, torch.float32)
    assert set(runs) == set(instructions.CALLS)
    pairs = (("addnorm fwd+bwd", "torch fwd+bwd"), ("addnorm fwd no-grad", "torch fwd no-grad"))
    for ours, theirs in pairs:
        got, want = runs[ours](), runs[theirs]()
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    floor = runs["Function allocating only fwd+bwd"]()
    assert [t.shape for t in floor] == [t.shape for t in runs["torch fwd+bwd"]()]


def test_the_count_is_read_from_callgrinds_report():
    report = "==8144== Events    : Ir\n==8144== Collected : 105683357\n==8144== \n==8144== I   refs:      105,683,357\n"
    assert instructions.collected(report) == 105683357
    assert instructions.collected("==1== Command: python\n") is None


def test_bad_input_is_refused_by_name():
    for args, message in (
        (["--shape", "8by768"], "--shape: expected rows x columns"),
        (["--calls", "torch fwd+bwd,bogus"], "--calls: unknown 'bogus'"),
        (["--steps", "0"], "--steps: expected a positive count"),
    ):
        bad = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr
