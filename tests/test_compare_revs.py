"""``benchmarks/compare_revs.py``: addnorm bench on two revisions, runs alternated, ratios per
round."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "compare_revs.py"
compare_revs = load_benchmark("compare_revs")


def row(impl: str, ms: float, copy_gbps: float | None = 1.0) -> dict:
    r = {
        "op": "add_layer_norm",
        "pass": "fwd",
        "rows": 8,
        "cols": 64,
        "dtype": "float32",
        "impl": impl,
        "median_ms": ms,
        "bytes": 1e5,  # 0.1 GB/s at 1 ms
    }
    if copy_gbps is not None:
        r["copy_gbps"] = copy_gbps
    return r


def test_the_ratio_is_the_median_of_each_rounds_ratio():
    # base/head per round: 2.0, 1.0, 4.0 -> median 2.0; the sides' own medians are 2.0 and 1.0
    base = [2.0, 1.0, 4.0]
    head = [1.0, 1.0, 1.0]
    rounds = [
        {"base": [row("addnorm", b), row("torch-eager", 1.0)], "head": [row("addnorm", h), row("torch-eager", 0.5)]}
        for b, h in zip(base, head)
    ]
    lines = {ln["impl"]: ln for ln in compare_revs.summarize(rounds)}
    line = lines["addnorm"]
    assert line["speedup"] == 2.0 and (line["speedup_low"], line["speedup_high"]) == (1.0, 4.0)
    assert (line["base_ms"], line["head_ms"], line["rounds"]) == (2.0, 1.0, 3)
    # each side against the torch of its own run: 1.0 / 2.0 and 0.5 / 1.0
    assert line["base_vs_torch"] == 0.5 and line["head_vs_torch"] == 0.5
    # 1e5 bytes in 2 ms at 1 GB/s; in 1 ms
    assert line["base_copy_fraction"] == pytest.approx(0.05) and line["head_copy_fraction"] == pytest.approx(0.1)
    text = compare_revs.render([line], "markdown", ("base a", "head b"))
    assert "| add_layer_norm | fwd | 8x64 | float32 | addnorm |" in text and "2.00x (1.00-4.00)" in text


def test_a_run_without_torch_eager_shows_no_ratio_to_it():
    rounds = [{"base": [row("addnorm", 2.0)], "head": [row("addnorm", 1.0)]}]
    (line,) = compare_revs.summarize(rounds)
    text = compare_revs.render([line], "table", ("base", "head"))
    assert "2.000 · 0.05 · -" in text and "1.000 · 0.10 · -" in text and "nan" not in text
    assert "2.00x (2.00-2.00)" in text


def test_a_configuration_missing_from_a_round_is_left_out():
    rounds = [
        {"base": [row("addnorm", 1.0), row("torch-eager", 1.0)], "head": [row("addnorm", 1.0)]},
        {
            "base": [row("addnorm", 1.0), row("torch-eager", 1.0)],
            "head": [row("addnorm", 1.0), row("torch-eager", 1.0)],
        },
    ]
    assert [ln["impl"] for ln in compare_revs.summarize(rounds)] == ["addnorm"]


def test_rows_of_a_revision_without_copy_bandwidth_take_the_other_sides():
    rounds = [{"base": [row("addnorm", 2.0, copy_gbps=None)], "head": [row("addnorm", 1.0, copy_gbps=0.5)]}]
    (line,) = compare_revs.summarize(rounds)
    assert line["base_copy_fraction"] == pytest.approx(0.1) and line["head_copy_fraction"] == pytest.approx(0.2)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_a_revision_that_is_no_commit_is_named_in_one_line():
    done = run("no-such-revision", "--", "--shapes", "8x64")
    assert done.returncode == 2
    assert "'no-such-revision' is not a commit" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("option", ["--format", "--save", "--plot=x.png"])
def test_options_the_script_sets_itself_are_refused(option):
    done = run("HEAD", "--", option, "json")
    assert done.returncode == 2 and option.split("=")[0] in done.stderr


def test_head_against_itself_from_an_archive(tmp_path):
    saved = tmp_path / "rows.jsonl"
    bench = ["--op", "add_layer_norm", "--shapes", "8x64", "--dtype", "float32", "--pass", "fwd", "--rounds", "3"]
    done = run("HEAD", "--rounds", "2", "--save", str(saved), "--", *bench, "--impl", "torch-eager,addnorm-reference")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:5] == ["op", "pass", "shape", "dtype", "impl"]
    assert {ln.split()[4] for ln in lines[1:]} == {"torch-eager", "addnorm-reference"}
    rows = [json.loads(ln) for ln in saved.read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2  # rounds x sides x implementations
    assert {(r["side"], r["round"]) for r in rows} == {(s, k) for s in ("base", "head") for k in (0, 1)}
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert {r["commit"] for r in rows if r["side"] == "base"} == {head.stdout.strip()}
