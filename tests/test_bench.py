"""``addnorm bench`` runs on a tiny shape and writes well-formed rows (no timing assertions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from addnorm.tools import bench
from addnorm.tools.cli import main


def test_bench_writes_rows_in_the_documented_format(tmp_path, capsys):
    results = tmp_path / "rows.jsonl"
    args = [
        "bench",
        "--op",
        "add_layer_norm,rms_norm",
        "--shapes",
        "4x64",
        "--dtype",
        "float32",
        "--pass",
        "fwd,fwd+bwd",
        "--impl",
        "torch-eager,addnorm,addnorm-reference,liger",
        "--rounds",
        "3",
        "--save",
        "--results",
        str(results),
    ]
    assert main(args) == 0
    assert "liger" in capsys.readouterr().out  # reported as not installed / unusable, not fatal
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(rows) == 2 * 2 * 3  # ops x passes x impls that ran
    for row in rows:
        assert list(row) == bench.ROW_FIELDS
        assert row["device"] == "cpu" and row["rows"] == 4 and row["cols"] == 64 and row["dtype"] == "float32"
        assert row["p20_ms"] <= row["median_ms"] <= row["p80_ms"]
        assert row["gbps"] == pytest.approx(row["bytes"] / row["median_ms"] / 1e6)
    by = {(r["op"], r["pass"]): r["bytes"] for r in rows if r["impl"] == "addnorm"}  # the CPU kernels
    # hand count, fp32: post-norm inference reads x, r and writes y (3 x 4x64) + weight, bias (2 x 64);
    # it writes no stream s (ops.plan: only when returned)
    assert by["add_layer_norm", "fwd"] == (3 * 4 * 64 + 2 * 64) * 4
    # rms fwd: x, y + weight, rstd written (4 rows); bwd: dy, x, dx + weight, dweight, rstd read
    assert by["rms_norm", "fwd+bwd"] == ((2 * 4 * 64 + 64) + (3 * 4 * 64 + 2 * 64)) * 4 + 2 * 4 * 4
    assert main(args) == 0  # --save appends
    assert len(results.read_text().splitlines()) == 2 * len(rows)


def test_a_configuration_named_twice_is_measured_once(capsys):
    argv = TINY[:4] + ["4x64,4x64", "--shapes", "4x64"] + TINY[5:] + ["--impl", "torch-eager", "--format", "json"]
    argv[argv.index("--dtype") + 1] = "float32,float32"
    assert main(argv) == 0
    assert len(json.loads(capsys.readouterr().out)["rows"]) == 1


def test_torch_compile_keeps_its_backward_rows(capsys):
    """--pass bwd times backward calls of one kept forward (retain_graph), which torch.compile's
    donated buffers refuse: the bench turns them off, so torch-compile is measured, not skipped."""
    argv = [*TINY[:-4], "--pass", "bwd", "--rounds", "3", "--impl", "torch-eager,torch-compile", "--format", "json"]
    argv[argv.index("--op") + 1] = "add_layer_norm"
    import torch._functorch.config as functorch_config

    before = functorch_config.donated_buffer
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["impl"] for r in out["rows"]] == ["torch-eager", "torch-compile"] and not out["skipped"]
    assert functorch_config.donated_buffer == before  # (off for the run alone)


def test_a_run_that_measured_nothing_fails(capsys):
    """Only implementations that cannot run here (not installed): an error, not a table of nothing."""
    argv = ["bench", "--op", "add_layer_norm", "--shapes", "4x64", "--impl", "liger", "--rounds", "3"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert (
        err.splitlines()[-1]
        == "addnorm bench: error: no implementation of --impl liger could run here: nothing measured"
    )


def test_an_impl_failing_on_its_first_call_is_reported_not_fatal(monkeypatch):
    real = bench.make_impl

    def make_impl(name, op, device):
        if name == "liger":  # stands in for a third-party norm whose API changed

            def broken(x, r, w, b):
                raise TypeError("layer_norm_fn() got an unexpected keyword argument")

            return broken
        return real(name, op, device)

    monkeypatch.setattr(bench, "make_impl", make_impl)
    results, skipped = bench.run_config(
        "add_layer_norm", 4, 64, torch.float32, "fwd", ["torch-eager", "liger"], "cpu", 3, False
    )
    assert [r["impl"] for r in results] == ["torch-eager"]
    assert skipped == {"liger": "TypeError: layer_norm_fn() got an unexpected keyword argument"}


def test_git_commit_flags_a_working_tree_that_differs_from_head(tmp_path, monkeypatch):
    import subprocess

    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    run = lambda *args: subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
    run("init", "-q")
    (repo / "pkg" / "f.py").write_text("a = 1\n")
    (repo / "benchmarks" / "results").mkdir(parents=True)
    (repo / "benchmarks" / "results" / "bench.jsonl").write_text("{}\n")
    run("add", ".")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    monkeypatch.setattr(bench.rows, "__file__", str(repo / "pkg" / "rows.py"))
    assert bench.git_commit() == head
    # rows appended by an earlier run (--save) and edited docs leave the code as it was
    (repo / "benchmarks" / "results" / "bench.jsonl").write_text("{}\n{}\n")
    (repo / "docs").mkdir()
    (repo / "docs" / "benchmarks.md").write_text("rows\n")
    run("add", "docs")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "docs")
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    (repo / "docs" / "benchmarks.md").write_text("rows and a reading\n")
    assert bench.git_commit() == head
    (repo / "pkg" / "f.py").write_text("a = 2\n")
    assert bench.git_commit() == head + "-dirty"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--shapes", "4096by768"], "expected ROWSxCOLS"),
        (["--shapes", "0x768"], "expected ROWSxCOLS"),
        (["--op", "batch_norm"], "--op: expected"),
        (["--dtype", "int8"], "--dtype: expected"),
        (["--impl", "nope"], "--impl: expected"),
        (["--threads", "0"], "--threads must be between 1 and"),
        (["--threads", "100000"], "--threads must be between 1 and"),  # set_num_threads(100000) crashes
        (["--results", "rows.jsonl"], "--results names the file --save appends to: add --save"),
        (["--dtype", "float32,,bfloat16"], "--dtype: expected a comma-separated list"),
        (["--shapes", "2x\u00b2"], "expected ROWSxCOLS"),  # (str.isdigit takes a superscript two)
        (["--shapes", "\uff18x8"], "expected ROWSxCOLS"),  # (and a full-width eight)
        (["--shapes", "1000000x1000000"], "needs about 44703.5 GiB"),  # before the copy is timed
    ],
)
def test_bad_arguments_are_one_line_usage_errors(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


TINY = ["bench", "--op", "layer_norm", "--shapes", "4x64", "--dtype", "float32", "--pass", "fwd", "--rounds", "3"]


@pytest.fixture
def no_measuring(monkeypatch):
    """Measuring fails the test: the arguments must be refused before any work."""

    def run_config(*args):
        raise AssertionError("measured before checking the outputs")

    monkeypatch.setattr(bench, "run_config", run_config)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: run_config())


def test_unwritable_outputs_are_refused_before_measuring(tmp_path, capsys, no_measuring):
    (tmp_path / "a_file").write_text("")
    under_a_file = str(tmp_path / "a_file" / "x" / "b.jsonl")
    folder, jpg, a_file = str(tmp_path), str(tmp_path / "fig.jpg"), str(tmp_path / "a_file")
    cases = [
        (["--save", "--results", under_a_file], "--results: cannot write into"),
        (["--save", "--results", folder], f"--results: '{folder}' is a folder; expected a file name"),
        (["--plot", jpg], f"--plot: '{jpg}': expected a .png file"),
        (["--plot", a_file + "/b.png"], f"--plot: '{a_file}' is a file, not a folder"),
    ]
    if Path("/proc/self").is_dir():
        cases.append((["--save", "--results", "/proc/x/b.jsonl"], "--results: cannot write into '/proc/x'"))
    for argv, message in cases:
        assert main([*TINY, *argv]) == 2
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and err.startswith("addnorm bench: error: ") and message in err, (argv, err)
    assert not (tmp_path / "fig.jpg").exists()


def test_plot_of_this_run(tmp_path, capsys):
    from matplotlib.image import imread

    assert main([*TINY, "--impl", "torch-eager,addnorm-reference", "--plot", str(tmp_path)]) == 0
    assert f"wrote {tmp_path / 'bench.png'}" in capsys.readouterr().out
    image = imread(tmp_path / "bench.png")
    assert image.shape[0] > 300 and image.shape[1] > 600


def test_the_plot_is_drawn_when_the_table_cannot_be_printed(tmp_path, monkeypatch, capsys):
    """``addnorm bench --plot p.png | head``: the reader went away before the table; the plot of
    what was measured is drawn all the same, and the run ends quietly (exit 1). (capsys: a stdout
    without a file descriptor, which the quiet exit leaves alone.)"""

    def reader_gone(*args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(bench, "render", reader_gone)
    assert main([*TINY, "--impl", "torch-eager", "--plot", str(tmp_path / "p.png")]) == 1
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_rows_appended_after_a_last_line_without_its_newline_start_a_line(tmp_path):
    """A results file whose last line lost its newline (edited by hand) gets the new rows on
    lines of their own: every line stays one JSON object."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}')
    bench.rows.append_rows(path, [{"b": 2}, {"c": 3}])
    bench.rows.append_rows(path, [{"d": 4}])
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"a": 1}, {"b": 2}, {"c": 3}, {"d": 4}]


def test_ctrl_c_shows_saves_and_draws_what_had_finished(tmp_path, capsys, monkeypatch):
    """Ctrl-C during the second configuration: the first one's rows are printed, kept in
    --results and drawn, then the command stops with status 130 and says how far it got."""
    from matplotlib.image import imread

    real, calls = bench.run_config, []

    def run_config(*args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(bench, "run_config", run_config)
    results, png = tmp_path / "rows.jsonl", tmp_path / "b.png"
    argv = [*TINY, "--pass", "fwd,fwd+bwd", "--impl", "torch-eager,addnorm-reference", "--save", "--results"]
    assert main([*argv, str(results), "--plot", str(png)]) == 130
    out, err = capsys.readouterr()
    assert "layer_norm fwd, 4x64, float32" in out and "fwd+bwd" not in out
    assert err.endswith(
        "addnorm bench: error: interrupted: 1 of 2 configurations had finished; their rows are shown above\n"
    )
    assert [json.loads(line)["impl"] for line in results.read_text().splitlines()] == [
        "torch-eager",
        "addnorm-reference",
    ]
    assert imread(png).shape[0] > 300
