"""`addnorm plot`: each kind writes a valid PNG; the seeds' histogram data; clear errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from addnorm.tools import cli
from addnorm.tools.plot import hist_data

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    from matplotlib.image import imread

    data = path.read_bytes()
    assert len(data) > 0 and data.startswith(PNG_SIGNATURE)
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_hist_data_is_the_seeds_setup():
    encoded, normed = hist_data(4, 256, 23)
    assert encoded.shape == normed.shape == (4, 1, 256)
    # printed in seed 003 (torch.manual_seed(23), randn(4, 1, 256), PositionalEncoding(1, 256))
    assert torch.allclose(encoded[0, 0, :3], torch.tensor([-14.4193, 10.0495, -7.8116]), atol=1e-4)
    assert torch.allclose(encoded[3, 0, -3:], torch.tensor([-3.2333, -17.0188, 3.9237]), atol=1e-4)
    assert torch.allclose(normed[0, 0, :3], torch.tensor([-0.9210, 0.5911, -0.5127]), atol=1e-4)
    assert torch.allclose(normed, torch.nn.functional.layer_norm(encoded, (256,)), atol=1e-5)


def test_a_library_warning_is_one_line_of_the_command_s(tmp_path, capsys):
    """LayerNorm over 2 features warns; through the CLI as one line, not Python's file and line."""
    assert cli.main(["plot", "hist", "--points", "1", "--d-model", "2", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err.startswith("addnorm plot: warning: normalizing over 2 feature(s)") and err.count("\n") == 1


def test_plot_hist_refuses_a_seed_torch_cannot_take(tmp_path, capsys):
    assert cli.main(["plot", "hist", "--seed", str(2**64), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seed must be an integer from -2**63 to 2**64 - 1" in err


def test_plot_hist_writes_png(tmp_path, capsys):
    assert cli.main(["plot", "hist", "--points", "2", "--d-model", "64", "--out", str(tmp_path)]) == 0
    assert_png(tmp_path / "hist.png")
    assert f"wrote {tmp_path / 'hist.png'}" in capsys.readouterr().out


@pytest.mark.parametrize("points", [1, 2, 8])
def test_plot_hist_title_fits_the_figure(points, tmp_path, monkeypatch, capsys):
    from addnorm.tools import plot

    figures, save = [], plot._save
    monkeypatch.setattr(plot, "_save", lambda fig, path: figures.append(fig) or save(fig, path))
    plot.plot_hist(tmp_path / "hist.png", points, 256, 23)
    (fig,) = figures
    title = fig._suptitle.get_window_extent(fig._get_renderer())  # (as drawn when saved)
    assert 0 <= title.x0 and title.x1 <= fig.bbox.width, (title, fig.bbox)


def bench_rows() -> list[dict]:
    rows = []
    for impl, gbps in [("addnorm-reference", 5.0), ("torch-eager", 8.0)]:
        for r, c in [(1024, 1024), (4096, 4096)]:
            nbytes = r * c * 4 * 2
            ms = nbytes / gbps / 1e6
            rows.append(
                {
                    "time": "2026-01-01T00:00:00Z",
                    "commit": "abc1234",
                    "machine": "test cpu",
                    "device": "cpu",
                    "threads": 2,
                    "torch": torch.__version__,
                    "op": "layer_norm",
                    "pass": "fwd",
                    "rows": r,
                    "cols": c,
                    "dtype": "float32",
                    "impl": impl,
                    "median_ms": ms,
                    "p20_ms": ms,
                    "p80_ms": ms,
                    "bytes": nbytes,
                    "gbps": gbps,
                }
            )
    return rows


def test_plot_bench_writes_png(tmp_path):
    results = tmp_path / "bench.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in bench_rows()))
    out = tmp_path / "b.png"
    args = ["plot", "bench", "--results", str(results), "--out", str(out), "--op", "layer_norm"]
    assert cli.main(args) == 0
    assert_png(out)


def test_plot_train_redraws_the_experiment(tmp_path):
    """A real (quick) training run, then its plots redrawn from results.json alone."""
    run = tmp_path / "run"
    assert cli.main(["train", "--quick", "--out", str(run)]) == 0
    assert cli.main(["plot", "train", "--results", str(run / "results.json"), "--out", str(tmp_path / "figs")]) == 0
    for name in ("curves.png", "grad_norms.png"):
        assert_png(tmp_path / "figs" / name)


def error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("addnorm plot: error: ")
    return lines[0]


def test_bench_errors(tmp_path, capsys):
    assert cli.main(["plot", "bench", "--results", str(tmp_path / "none.jsonl")]) == 2
    assert "not found; run `addnorm bench --save` first" in error_line(capsys)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert cli.main(["plot", "bench", "--results", str(empty)]) == 2
    assert "holds no rows" in error_line(capsys)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(bench_rows()[0]) + "\n{not json\n")
    assert cli.main(["plot", "bench", "--results", str(bad)]) == 2
    assert f"{bad}:2 is not JSON" in error_line(capsys)
    partial = tmp_path / "partial.jsonl"
    partial.write_text(json.dumps({"op": "layer_norm"}) + "\n")
    assert cli.main(["plot", "bench", "--results", str(partial)]) == 2
    assert "lacks field(s) time, commit, machine" in error_line(capsys)
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(bench_rows()[0]) + "\n")
    assert cli.main(["plot", "bench", "--results", str(good), "--dtype", "bfloat16"]) == 2
    assert "match --dtype bfloat16; the file holds ops ['layer_norm'], dtypes ['float32']" in error_line(capsys)


def test_train_errors(tmp_path, capsys, monkeypatch):
    assert cli.main(["plot", "train", "--results", str(tmp_path / "none.json")]) == 2
    assert "not found" in error_line(capsys)
    results = tmp_path / "results.json"
    for text in ("{}", "not json", "[1, 2]"):
        results.write_text(text)
        assert cli.main(["plot", "train", "--results", str(results)]) == 2
        assert error_line(capsys).endswith("is not a results.json written by 'addnorm train'")


def test_missing_matplotlib_is_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert cli.main(["plot", "hist", "--out", str(tmp_path)]) == 2
    assert "pip install 'addnorm[plot]'" in error_line(capsys)


@pytest.mark.parametrize("args", [["--points", "0"], ["--d-model", "7"]])
def test_hist_bad_sizes(args, capsys):
    assert cli.main(["plot", "hist", *args]) == 2
    assert "even --d-model" in error_line(capsys)


# --------------------------------------------------------------------------- --out


def test_out_names_a_png_file_or_a_folder(tmp_path, capsys):
    args = ["plot", "hist", "--points", "1", "--d-model", "8", "--out"]
    assert cli.main([*args, str(tmp_path / "figs")]) == 0  # no suffix: a folder, created
    assert_png(tmp_path / "figs" / "hist.png")
    assert cli.main([*args, str(tmp_path / "mine.PNG")]) == 0
    assert_png(tmp_path / "mine.PNG")
    capsys.readouterr()
    assert cli.main([*args, str(tmp_path / "fig.jpg")]) == 2
    assert "fig.jpg': expected a .png file, or a folder" in error_line(capsys)
    assert not (tmp_path / "fig.jpg").exists()  # no folder named like a file


def test_plot_train_out_must_be_a_folder(tmp_path, capsys):
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"floor": 0.01, "arms": {}}))
    assert cli.main(["plot", "train", "--results", str(results), "--out", str(tmp_path / "curves.png")]) == 2
    message = "looks like a file name; plot train writes curves.png and grad_norms.png (depth.png for a depth sweep)"
    assert f"{message} into a folder" in error_line(capsys)
    assert not (tmp_path / "curves.png").exists()
    assert cli.main(["plot", "train", "--results", str(results), "--out", str(results)]) == 2
    assert "is a file; plot train writes" in error_line(capsys)


def test_plot_train_rejects_a_malformed_results_json(tmp_path, capsys):
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"floor": 0.01, "arms": {"pre": {"label": "pre-LN"}}}))
    assert cli.main(["plot", "train", "--results", str(results), "--out", str(tmp_path)]) == 2
    assert "is not a results.json written by 'addnorm train' (KeyError" in error_line(capsys)


def unwritable(tmp_path) -> list[str]:
    """Output paths that cannot be written: under a file, and (on Linux) in /proc."""
    (tmp_path / "a_file").write_text("")
    paths = [str(tmp_path / "a_file" / "sub" / "h.png")]
    if Path("/proc/self").is_dir():
        paths.append("/proc/h.png")
    return paths


def test_unwritable_out_is_a_one_line_error(tmp_path, capsys):
    for out in unwritable(tmp_path):
        assert cli.main(["plot", "hist", "--out", out]) == 2
        assert "--out: cannot write into" in error_line(capsys)


# --------------------------------------------------------------------------- bench rows


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("gbps", "fast", "'gbps' must be a positive number, got 'fast'"),
        ("gbps", float("nan"), "'gbps' must be a positive number, got nan"),
        ("gbps", True, "'gbps' must be a positive number, got True"),
        ("gbps", 0, "'gbps' must be a positive number, got 0"),
        ("rows", 2.5, "'rows' must be a positive integer, got 2.5"),
        ("impl", None, "'impl' must be text, got None"),
    ],
)
def test_bench_rows_with_bad_values(tmp_path, capsys, field, value, message):
    rows = bench_rows()
    rows[1][field] = value
    results = tmp_path / "bench.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))  # NaN is written as NaN
    assert cli.main(["plot", "bench", "--results", str(results), "--out", str(tmp_path)]) == 2
    assert error_line(capsys).endswith(f"{results}:2: {message}")


def test_results_that_are_folders(tmp_path, capsys):
    assert cli.main(["plot", "bench", "--results", str(tmp_path)]) == 2
    assert "is a folder; expected the JSONL file" in error_line(capsys)
    assert cli.main(["plot", "train", "--results", str(tmp_path)]) == 2
    assert "is a folder; expected the results.json in it" in error_line(capsys)


def test_bench_results_not_text(tmp_path, capsys):
    binary = tmp_path / "bench.jsonl"
    binary.write_bytes(bytes(range(256)))
    assert cli.main(["plot", "bench", "--results", str(binary), "--out", str(tmp_path)]) == 2
    assert "is not text; expected the JSON lines of `addnorm bench --save`" in error_line(capsys)


def two_runs() -> list[dict]:
    """An older run (more shapes, another impl) and a newer one of another commit."""
    old = [{**r, "time": "2026-01-01T00:00:00+00:00", "commit": "aaa1111"} for r in bench_rows()]
    old += [{**r, "impl": "addnorm-cpu", "rows": 8} for r in old]
    new = [{**r, "time": "2026-02-01T00:00:00+00:00", "commit": "bbb2222"} for r in bench_rows()]
    return old + new


def test_plot_bench_draws_the_latest_run(tmp_path, capsys, monkeypatch):
    from matplotlib.image import imread

    from addnorm.tools import plot

    drawn = []
    real = plot.draw_bench
    monkeypatch.setattr(plot, "draw_bench", lambda rows, *a: drawn.append(rows) or real(rows, *a))
    results = tmp_path / "bench.jsonl"
    rows = two_runs()
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["plot", "bench", "--results", str(results), "--out", str(tmp_path / "latest.png")]) == 0
    assert {r["commit"] for r in drawn[-1]} == {"bbb2222"} and len(drawn[-1]) == 4
    assert "drew the latest of 2 matching runs" in capsys.readouterr().out
    assert (
        cli.main(["plot", "bench", "--results", str(results), "--out", str(tmp_path / "a.png"), "--commit", "aaa"]) == 0
    )
    assert {r["commit"] for r in drawn[-1]} == {"aaa1111"} and len(drawn[-1]) == 8
    for name in ("latest.png", "a.png"):
        assert_png(tmp_path / name)
        assert imread(tmp_path / name).shape[0] < 1000  # one panel, not one per run
    assert cli.main(["plot", "bench", "--results", str(results), "--commit", "ccc"]) == 2
    assert "commits aaa1111, bbb2222" in error_line(capsys)


def test_plot_bench_lays_out_panels_in_a_grid(tmp_path):
    """ops x dtypes down, passes across: 2 x 2 panels for 2 ops, 1 dtype, 2 passes."""
    from matplotlib.image import imread

    rows = [
        {**r, "op": op, "pass": p} for r in bench_rows() for op in ("layer_norm", "rms_norm") for p in ("fwd", "bwd")
    ]
    results = tmp_path / "bench.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["plot", "bench", "--results", str(results), "--out", str(tmp_path / "grid.png")]) == 0
    assert_png(tmp_path / "grid.png")
    height, width = imread(tmp_path / "grid.png").shape[:2]
    assert 1000 <= width <= 1400 and height <= 1200
