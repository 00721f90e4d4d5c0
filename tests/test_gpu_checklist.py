"""``benchmarks/gpu_checklist.py --dry-run``: every part of the GPU checklist runs on a tiny CPU
shape through Triton's interpreter and leaves its files, so the checklist cannot rot between
GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
PARTS = [
    "env",
    "invariance",
    "dweight",
    "graphs",
    "parity",
    "kernels",
    "host",
    "dropout",
    "parallel",
    "wallclock",
    "training",
    "widths",
    "tests",
]
TARGETS = [
    "kernel fwd ≥ 0.90 of copy",
    "kernel bwd ≥ 0.85 of copy",
    "wall clock ≥ 1.0x torch eager",
    "host cost fwd ≤ torch eager + 15 µs",
    "host cost fwd+bwd ≤ torch eager + 40 µs",
    "dropout fwd+bwd within +15 %",
    "dweight bitwise reproducible",
    "compat: addnorm within 2x flash-attn's error",
    "parallel block: one call ahead of every other",
]


def test_dry_run_writes_every_part_and_the_summary(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("ADDNORM_TEST_DEVICE", None)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_checklist.py"), "--dry-run", "--out", str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    for i, name in enumerate(PARTS, start=1):
        stem = tmp_path / f"{i:02d}-{name}"
        table = stem.with_suffix(".md").read_text()
        assert "|---" in table, (name, table)
        assert "error:" not in table and "skipped" not in table, (name, table)
        rows = json.loads(stem.with_suffix(".json").read_text())
        assert rows and all(isinstance(row, dict) for row in rows), name
        assert stem.with_suffix(".log").exists()
    kernels = json.loads((tmp_path / "06-kernels.json").read_text())
    assert {row["pass"] for row in kernels} == {"copy", "fwd", "bwd"}
    assert all(row["of copy"] > 0 for row in kernels)
    wall = json.loads((tmp_path / "10-wallclock.json").read_text())
    assert {"addnorm-triton", "torch-eager"} <= {row["impl"] for row in wall}
    # the bitwise checks are real even on the interpreter
    assert all(row["bitwise equal"] for row in json.loads((tmp_path / "02-invariance.json").read_text()))
    parity = json.loads((tmp_path / "05-parity.json").read_text())
    # every output and gradient of both norms and every case, compared (here addnorm with itself)
    assert {row["result"] for row in parity} >= {"y", "y1", "s", "dx", "dx1", "dweight1", "dresidual"}
    assert {row["norm"] for row in parity} == {"layer", "rms"} and all(row["within"] for row in parity)
    parallel = json.loads((tmp_path / "09-parallel.json").read_text())
    assert {(row["pass"], row["impl"], row["dropout_p"]) for row in parallel} == {
        (p, i, d) for p in ("fwd", "fwd+bwd") for i in ("one call", "two calls", "torch eager") for d in (0.0, 0.1)
    }
    training = json.loads((tmp_path / "11-training.json").read_text())
    assert {row["variant"] for row in training} >= {"unpatched", "addnorm"}
    summary = (tmp_path / "summary.md").read_text()
    assert "| target | measured | result |" in summary
    for target in TARGETS:
        assert target in summary, target
    for name in PARTS:
        assert f"| {name} |" in summary, name


@pytest.fixture
def checklist(monkeypatch):
    """The checklist's modules, imported in this process."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_checklist
    import gpu_checklist_parts

    return gpu_checklist, gpu_checklist_parts


def _fixed(P, name: str):
    rows = [{"value": name}]
    return lambda setup, state: P.Part(rows=rows, table=P.markdown(rows), log=name)


def test_a_failing_part_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, checklist):
    """One part raising leaves its error in its own files, no traceback on the console, and
    every later part still runs."""
    gpu_checklist, P = checklist

    def broken(setup):
        raise ValueError("no such device")

    monkeypatch.setattr(P, "dweight_reproducible", broken)
    dweight = next(s for s in gpu_checklist.steps(P) if s.name == "dweight")
    steps = [gpu_checklist.Step("first", 0.1, "", _fixed(P, "first")), dweight]
    steps.append(gpu_checklist.Step("last", 0.1, "", _fixed(P, "last")))
    monkeypatch.setattr(gpu_checklist, "steps", lambda P: steps)
    state = gpu_checklist.State(25, dry=True)
    done = gpu_checklist.run_parts(P.dry_setup(), state, tmp_path, P)
    assert [status for _, status, _ in done] == ["ok", "error: ValueError: no such device", "ok"]
    assert "error: ValueError: no such device" in (tmp_path / "02-dweight.md").read_text()
    assert "Traceback" in (tmp_path / "02-dweight.log").read_text()  # for the reader, in the file
    assert "| last |" in (tmp_path / "03-last.md").read_text()
    summary = gpu_checklist.summary(done, state, P.dry_setup(), P)
    assert "| dweight bitwise reproducible | - | error: ValueError: no such device |" in summary


def test_parts_past_the_budget_are_skipped_and_said_so(tmp_path, monkeypatch, checklist):
    gpu_checklist, P = checklist
    steps = [
        gpu_checklist.Step("first", 0.1, "", _fixed(P, "first")),
        gpu_checklist.Step("long", 5.0, "", _fixed(P, "long")),
        gpu_checklist.Step("short", 0.5, "", _fixed(P, "short")),
    ]
    monkeypatch.setattr(gpu_checklist, "steps", lambda P: steps)
    state = gpu_checklist.State(budget_minutes=1, dry=False)  # "long" would overrun it
    done = gpu_checklist.run_parts(P.dry_setup(), state, tmp_path, P)
    assert [status.split(":")[0] for _, status, _ in done] == ["ok", "skipped", "ok"]
    assert "skipped" in (tmp_path / "02-long.md").read_text()
    summary = gpu_checklist.summary(done, state, P.dry_setup(), P)
    assert "Skipped to stay within the budget: long." in summary


def test_only_runs_the_parts_named_and_refuses_unknown_ones(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("ADDNORM_TEST_DEVICE", None)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_checklist.py"), "--dry-run", "--out", str(tmp_path)]
    done = subprocess.run([*cmd, "--only", "env,dweight"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("*.md")) == ["01-env.md", "03-dweight.md", "summary.md"]
    summary = (tmp_path / "summary.md").read_text()
    assert "| 03 | dweight |" in summary and "| 02 |" not in summary
    bad = subprocess.run([*cmd, "--only", "env,kernel"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "--only: unknown part(s) kernel" in bad.stderr and "kernels" in bad.stderr


def test_wall_shapes_and_dtypes_narrow_a_short_loans_run(tmp_path):
    """``--wall-shapes`` and ``--dtypes`` set what the parts time (one shape a call, so a run cut
    off keeps the shapes before it); bad values are refused by name."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("ADDNORM_TEST_DEVICE", None)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_checklist.py"), "--dry-run", "--out", str(tmp_path)]
    narrowed = [*cmd, "--only", "wallclock", "--wall-shapes", "4x32,2x16", "--dtypes", "float32"]
    done = subprocess.run(narrowed, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "10-wallclock.json").read_text())
    assert {(row["shape"], row["dtype"]) for row in rows} == {("4x32", "float32"), ("2x16", "float32")}
    bad_values = [
        ("--wall-shapes", "4x"),
        ("--wall-shapes", "0x32"),
        ("--dtypes", "int8"),
        ("--train-variants", "fast"),
        ("--train-models", "gpt3"),
    ]
    for flag, value in bad_values:
        bad = subprocess.run([*cmd, flag, value], env=env, capture_output=True, text=True, timeout=300)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        assert f"{flag}: expected" in bad.stderr and repr(value) in bad.stderr
