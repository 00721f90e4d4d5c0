"""``benchmarks/cpu_streaming.py``: its two sides are the streamed and the plain kernels, it
leaves the backend's settings as it found them, and the script runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from addnorm.kernels import cpu
from conftest import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_streaming.py"
streaming = load_benchmark("cpu_streaming")


def test_each_side_runs_the_stores_it_names(monkeypatch):
    asked = []
    real = cpu.entry.forward_entry, cpu.entry.backward_entry
    monkeypatch.setattr(cpu, "forward_entry", lambda *a, **k: asked.append(("fwd", k["streamed"])) or real[0](*a, **k))
    monkeypatch.setattr(cpu, "backward_entry", lambda *a, **k: asked.append(("bwd", k["streamed"])) or real[1](*a, **k))
    settings = cpu.config.SETTINGS
    calls = streaming.calls(4, 1024, streaming.torch.float32, rms=False, dropout_p=0.1)
    asked.clear()  # (the forward that made the statistics)
    for (direction, stores), run in calls.items():
        run()
        assert asked.pop() == (direction.split()[0], stores == "streamed")
        assert cpu.config.SETTINGS is settings


def test_the_script_runs_and_reports_each_shape():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "8x1024", "--rounds", "1"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:]] == list(streaming.OPS)
    assert all(line.count("x)") == 3 for line in lines[1:])


@pytest.mark.parametrize("bad", [["8by1024"], ["--dtype", "bfloat16"]])
def test_bad_arguments_are_refused_without_a_traceback(bad):
    done = subprocess.run([sys.executable, str(SCRIPT), *bad], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "error:" in done.stderr
