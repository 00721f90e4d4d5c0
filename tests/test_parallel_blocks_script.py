"""benchmarks/parallel_blocks.py: each implementation computes the same parallel block, the
one-call side runs the cpu backend's second norm and the two-call side does not, the script runs,
and bad arguments are refused without a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from addnorm.kernels import cpu
from conftest import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "parallel_blocks.py"
parallel_blocks = load_benchmark("parallel_blocks")


def test_each_side_computes_the_block_and_runs_the_calls_it_names(monkeypatch):
    seconds = []
    real = cpu.forward
    monkeypatch.setattr(cpu, "forward", lambda *a, **k: seconds.append(k.get("second") is not None) or real(*a, **k))
    runs = parallel_blocks.calls(6, 64, torch.float32)
    results = {}
    for impl, norm_calls in [("one call", [True]), ("two calls", [False, False]), ("torch eager", [])]:
        seconds.clear()
        results[impl] = runs[("fwd", impl)]()
        assert seconds == norm_calls
        assert len(runs[("fwd+bwd", impl)]()) == 7  # a gradient for each input
        assert cpu.CAPABILITIES.second_norm
    for impl in ("two calls", "torch eager"):
        for ours, theirs in zip(results["one call"], results[impl]):
            torch.testing.assert_close(ours, theirs)
    dropped = parallel_blocks.calls(6, 64, torch.float32, p=0.5)  # (--dropout-p: each side drops)
    for impl in parallel_blocks.IMPLS:
        y, y1, s = dropped[("fwd", impl)]()
        assert not torch.allclose(s, results[impl][2])  # (the same inputs, without dropout)
        assert len(dropped[("fwd+bwd", impl)]()) == 7


def test_the_script_runs_and_reports_each_pass():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "8x256", "--rounds", "1", "--dropout-p", "0.1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[1] for line in lines[1:]] == ["fwd", "fwd+bwd"]
    assert all(line.count("x)") == 2 for line in lines[1:])


NO_CUDA = [] if torch.cuda.is_available() else [["--device", "cuda"]]


@pytest.mark.parametrize("bad", [["8by1024"], ["--rounds", "0"], ["--dropout-p", "1"], *NO_CUDA])
def test_bad_arguments_are_refused_without_a_traceback(bad):
    done = subprocess.run([sys.executable, str(SCRIPT), *bad], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "error:" in done.stderr
