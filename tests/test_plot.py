"""`addnorm plot`: each kind writes a valid PNG; the seeds' histogram data; clear errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from addnorm import cli
from addnorm.plot import hist_data

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


def test_plot_hist_writes_png(tmp_path, capsys):
    assert cli.main(["plot", "hist", "--points", "2", "--d-model", "64", "--out", str(tmp_path)]) == 0
    assert_png(tmp_path / "hist.png")
    assert f"wrote {tmp_path / 'hist.png'}" in capsys.readouterr().out


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
    assert "lacks field(s) machine" in error_line(capsys)
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(bench_rows()[0]) + "\n")
    assert cli.main(["plot", "bench", "--results", str(good), "--dtype", "bfloat16"]) == 2
    assert "match" in error_line(capsys)


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
