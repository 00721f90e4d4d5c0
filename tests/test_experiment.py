"""The square-corners task, the --data loader, and `addnorm train` end to end (tiny configuration)."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest
import torch

from addnorm import cli, experiment
from addnorm.experiment import (
    ARMS,
    FAIL_RATIO,
    N_TEST,
    N_TRAIN,
    TEST_SEED,
    TRAIN_SEED,
    Config,
    decoder_input,
    grad_norms_at_init,
    load_sequences,
    lr_lambda,
    noise_floor,
    plot_results,
    square_sequences,
    summarize,
    train_arm,
)

SQUARE = {(-1, -1), (-1, 1), (1, 1), (1, -1)}


# --------------------------------------------------------------------------- data


def test_sequences_are_the_corners_in_order_with_the_stated_noise():
    points, directions = square_sequences(N_TRAIN, TRAIN_SEED)
    assert points.shape == (N_TRAIN, 4, 2) and points.dtype == np.float32
    corners = np.sign(points).astype(int)
    for seq, clockwise in zip(corners, directions, strict=True):
        assert {tuple(c) for c in seq} == SQUARE  # each corner once
        edges = np.diff(np.vstack([seq, seq[:1]]), axis=0)
        assert (np.abs(edges).sum(axis=1) == 2).all()  # neighbours: one coordinate flips
        # z of the cross product of consecutive edges: negative = clockwise (x right, y up)
        turn = edges[0, 0] * edges[1, 1] - edges[0, 1] * edges[1, 0]
        assert (turn < 0) == bool(clockwise)
    assert {tuple(c) for c in corners[:, 0]} == SQUARE  # every starting corner occurs
    assert 0.3 < directions.mean() < 0.7
    noise = (points - corners).ravel()
    se = 0.1 / math.sqrt(2 * noise.size)  # standard error of the sample std
    assert abs(noise.std() - 0.1) < 5 * se and abs(noise.mean()) < 5 * 0.1 / math.sqrt(noise.size)


def test_sequences_are_seeded():
    a, _ = square_sequences(8, 3)
    b, _ = square_sequences(8, 3)
    c, _ = square_sequences(8, 4)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_noise_floor_is_the_mse_of_the_exact_corners():
    rng = np.random.default_rng(0)
    clean = np.array([[[-1, -1], [-1, 1], [1, 1], [1, -1]]] * 50, dtype=float)
    noise = rng.normal(0, 0.1, clean.shape)
    assert noise_floor(clean + noise) == pytest.approx(np.mean(noise[:, 2:] ** 2), rel=1e-12)
    # on the test set: sigma^2 = 0.01, within 4 standard errors of a mean of 512 squared N(0, 0.01)
    test, _ = square_sequences(N_TEST, TEST_SEED)
    assert abs(noise_floor(test) - 0.01) < 4 * 0.01 * math.sqrt(2 / (N_TEST * 4))


def test_decoder_input_is_teacher_forcing():
    src = torch.arange(8.0).reshape(1, 2, 2, 2)[0]
    tgt = src + 100
    assert decoder_input(src, tgt).tolist() == [[[2, 3], [100, 101]], [[6, 7], [104, 105]]]


# --------------------------------------------------------------------------- --data


def test_load_npy_and_csv(tmp_path):
    points, _ = square_sequences(6, 0)
    np.save(tmp_path / "seq.npy", points)
    np.testing.assert_array_equal(load_sequences(tmp_path / "seq.npy"), points)
    rows = points.reshape(6, 8)
    np.savetxt(tmp_path / "plain.csv", rows, delimiter=",")
    np.savetxt(tmp_path / "header.csv", rows, delimiter=",", header="x0,y0,x1,y1,x2,y2,x3,y3", comments="")
    for name in ("plain.csv", "header.csv"):
        np.testing.assert_allclose(load_sequences(tmp_path / name), points, rtol=1e-6)


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("missing.npy", None, "no such file"),
        ("seq.txt", "1,2", "expected a .npy or .csv"),
        ("wrong.npy", np.zeros((5, 3, 2)), r"shape \[n, 4, 2\].*got shape \[5, 3, 2\]"),
        ("one.npy", np.zeros((1, 4, 2)), "n >= 2"),
        ("nan.npy", np.full((3, 4, 2), np.nan), "NaN"),
        ("short.csv", "1,2,3\n4,5,6\n", "8 columns"),
        ("words.csv", "a,b\nc,d\n", "could not read"),
    ],
)
def test_load_errors(tmp_path, name, content, match):
    path = tmp_path / name
    if isinstance(content, np.ndarray):
        np.save(path, content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_sequences(path)


def test_cli_reports_bad_data_and_arms(tmp_path, capsys):
    (tmp_path / "bad.npy").write_bytes(b"not numpy")
    assert cli.main(["train", "--data", str(tmp_path / "bad.npy"), "--out", str(tmp_path)]) == 2
    assert "--data" in capsys.readouterr().err
    assert cli.main(["train", "--arms", "post,sideways", "--out", str(tmp_path)]) == 2
    assert "sideways" in capsys.readouterr().err
    assert cli.main(["train", "--epochs", "0", "--out", str(tmp_path)]) == 2
    assert "--epochs must be at least 1" in capsys.readouterr().err
    assert cli.main(["train", "--lr", "-1", "--out", str(tmp_path)]) == 2
    assert "--lr" in capsys.readouterr().err
    assert cli.main(["train", "--threads", "100000", "--out", str(tmp_path)]) == 2
    assert "--threads must be between 1 and" in capsys.readouterr().err
    assert cli.main(["train", "--data", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "is a folder, not a file" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


# --------------------------------------------------------------------------- training

TINY = Config(epochs=1, depth=1, d_model=8, n_heads=2, d_ff=8)


def test_training_is_reproducible():
    train, _ = square_sequences(32, 1)
    test, _ = square_sequences(16, 2)
    a = train_arm(ARMS["pre"], 0, TINY, train, test)
    b = train_arm(ARMS["pre"], 0, TINY, train, test)
    assert a["test_mse"] == b["test_mse"] and a["train_loss"] == b["train_loss"]
    assert train_arm(ARMS["pre"], 1, TINY, train, test)["test_mse"] != a["test_mse"]


def test_warmup_is_linear_then_constant():
    f = lr_lambda(ARMS["post-warmup"], 40)  # warmup over a quarter of 40 steps
    assert [f(s) for s in (0, 4, 9, 10, 39)] == [0.1, 0.5, 1.0, 1.0, 1.0]
    assert lr_lambda(ARMS["post"], 40)(0) == 1.0


def test_summarize():
    s = summarize([1.0, 0.05, 0.019, 0.03], floor=0.01)
    assert (s["final"], s["best"], s["first_within"], s["failed"]) == (0.03, 0.019, 3, False)
    assert s["first_below_fail"] == 2  # first epoch within FAIL_RATIO x floor = 0.1
    assert s["ratio"] == pytest.approx(3.0)
    assert summarize([0.5, FAIL_RATIO * 0.01 * 1.01], 0.01)["failed"]
    assert summarize([0.5, math.nan], 0.01)["failed"]
    assert summarize([0.5, 0.4], 0.01)["first_within"] is None


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("position", ["post", "pre"])
def test_grad_norms_at_init_are_finite_per_layer(position, norm):
    train, _ = square_sequences(32, 1)
    g = grad_norms_at_init(Config(depth=3, d_model=8, n_heads=2, d_ff=8, norm=norm), position, 0, train)
    assert len(g["encoder"]) == 3 and len(g["decoder"]) == 3
    assert all(math.isfinite(v) and v > 0 for v in g["encoder"] + g["decoder"])


def test_train_quick_end_to_end(tmp_path):
    out = tmp_path / "run"
    assert cli.main(["train", "--quick", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["arms"]) == list(ARMS)
    test, _ = square_sequences(N_TEST, TEST_SEED)
    assert results["floor"] == pytest.approx(noise_floor(test))
    for arm in results["arms"].values():
        (run,) = arm["runs"]
        assert len(run["test_mse"]) == 2 and all(v is None or v > 0 for v in run["test_mse"])
    for pos in ("post", "pre"):
        norms = results["grad_norms"][pos]
        assert all(math.isfinite(v) and v > 0 for v in norms["encoder"] + norms["decoder"])
    report = (out / "report.md").read_text()
    assert f"{results['floor']:.4f}" in report and "curves.png" in report and "grad_norms.png" in report
    assert "predicting the exact corners (≈ σ² = 0.01)" in report
    # one verdict per prediction; the gradient-norm trend needs >= 2 layers (--quick has 1)
    assert report.count("Held") + report.count("Did not hold") == 5
    for png in ("curves.png", "grad_norms.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # plot_results redraws from results.json alone
    again = plot_results(out / "results.json", tmp_path / "again")
    assert sorted(p.name for p in again) == ["curves.png", "grad_norms.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in again)


def test_train_on_user_data(tmp_path):
    points, _ = square_sequences(30, 5)
    np.save(tmp_path / "mine.npy", points)
    out = tmp_path / "run"
    argv = ["train", "--quick", "--arms", "pre", "--epochs", "1", "--data", str(tmp_path / "mine.npy")]
    assert cli.main([*argv, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["n_train"] + results["n_test"] == 30 and results["n_test"] == 10
    assert "mine.npy" in results["data"] and list(results["arms"]) == ["pre"]
    report = (out / "report.md").read_text()  # the floor of the user's data, not of the generated task
    assert f"**Noise floor: {results['floor']:.4f}**" in report and "σ²" not in report
    assert "the corner of [-1, 1]² nearest to it" in report


def test_missing_matplotlib_is_a_clear_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert cli.main(["train", "--quick", "--out", str(tmp_path)]) == 2
    assert "pip install 'addnorm[plot]'" in capsys.readouterr().err


# --------------------------------------------------------------------------- outputs: checked first, never lost


@pytest.fixture
def no_training(monkeypatch):
    """Training fails the test: the arguments must be refused before any work."""

    def run_experiment(*args):
        raise AssertionError("trained before checking --out")

    monkeypatch.setattr(experiment, "run_experiment", run_experiment)


def test_out_is_checked_before_training(tmp_path, capsys, no_training):
    (tmp_path / "a_file").write_text("")
    cases = [
        (str(tmp_path / "a_file"), "is a file; train writes results.json, curves.png, grad_norms.png and report.md"),
        (str(tmp_path / "a_file" / "sub"), "cannot write into"),
        (str(tmp_path / "run.png"), "looks like a file name"),
    ]
    if os.path.isdir("/proc/self"):
        cases.append(("/proc/run", "cannot write into '/proc/run'"))
    for out, message in cases:
        assert cli.main(["train", "--quick", "--out", out]) == 2
        err = capsys.readouterr().err
        assert err.startswith("addnorm train: error: --out: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run.png").exists()
    assert cli.main(["train", "--quick", "--out", str(tmp_path / "lr0.001")]) == 1  # a folder: training starts
    assert "trained before checking --out" in capsys.readouterr().err


def test_results_survive_a_failed_write(tmp_path, capsys, monkeypatch):
    """The folder was fine at the start but the write fails at the end: the results are kept."""
    import tempfile

    def write_outputs(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(experiment, "write_outputs", write_outputs)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    argv = ["train", "--quick", "--arms", "pre", "--epochs", "1", "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert "pre-LN" in out  # the table was printed
    assert err.startswith("addnorm train: error: --out: cannot write into") and "No space left on device" in err
    saved = err.split("the results are saved in ")[1].split(":")[0]
    results = json.loads(open(saved).read())
    assert list(results["arms"]) == ["pre"] and results["command"].startswith("addnorm train --arms pre")
    assert cli.main(["plot", "train", "--results", saved, "--out", str(tmp_path / "figs")]) == 0


def test_data_on_the_exact_corners_has_no_floor(tmp_path, capsys, no_training):
    corners = np.array([[[-1, -1], [-1, 1], [1, 1], [1, -1]]] * 6, dtype=np.float32)
    np.save(tmp_path / "exact.npy", corners)
    assert cli.main(["train", "--quick", "--data", str(tmp_path / "exact.npy"), "--out", str(tmp_path)]) == 2
    assert "the noise floor is 0" in capsys.readouterr().err
