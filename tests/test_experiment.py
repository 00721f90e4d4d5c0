"""The square-corners task, the --data loader, and `addnorm train` end to end (tiny configuration)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from addnorm.tools import cli
from addnorm.tools.experiment import command, plot_results, report, training
from addnorm.tools.experiment.config import ARMS, DEFAULT_ARMS, Config
from addnorm.tools.experiment.data import (
    N_TEST,
    N_TRAIN,
    TEST_SEED,
    TRAIN_SEED,
    decoder_input,
    load_sequences,
    noise_floor,
    square_sequences,
)
from addnorm.tools.experiment.schema import FAIL_RATIO, ArmResult, Results, Run, aggregate, summarize
from addnorm.tools.experiment.training import grad_norms_at_init, lr_lambda, train_arm

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
        ("/dev/null", None, "/dev/null: is not a regular file; expected a .npy or .csv file"),
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
    if name == "/dev/null":  # a file that exists, not a regular one
        path = pathlib.Path(name)
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
    assert cli.main(["train", "--arms", "pre,,post", "--out", str(tmp_path)]) == 2
    assert "--arms: unknown arm(s) ['']" in capsys.readouterr().err
    assert cli.main(["train", "--epochs", "0", "--out", str(tmp_path)]) == 2
    assert "--epochs must be at least 1" in capsys.readouterr().err
    assert cli.main(["train", "--lr", "-1", "--out", str(tmp_path)]) == 2
    assert "--lr" in capsys.readouterr().err
    assert cli.main(["train", "--threads", "100000", "--out", str(tmp_path)]) == 2
    assert "--threads must be between 1 and" in capsys.readouterr().err
    assert cli.main(["train", "--data", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "is a folder; expected a .npy or .csv file" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


# --------------------------------------------------------------------------- training

TINY = Config(epochs=1, depth=1, d_model=8, n_heads=2, d_ff=8)


def test_training_is_reproducible():
    train, _ = square_sequences(32, 1)
    test, _ = square_sequences(16, 2)
    a = train_arm(ARMS["pre"], 0, TINY, train, test)
    b = train_arm(ARMS["pre"], 0, TINY, train, test)
    assert a.test_mse == b.test_mse and a.train_loss == b.train_loss
    assert train_arm(ARMS["pre"], 1, TINY, train, test).test_mse != a.test_mse


def test_schedule_is_linear_warmup_then_linear_decay_to_zero():
    f = lr_lambda(ARMS["post-warmup"], 40)  # warmup over a quarter of 40 steps, decay over the rest
    assert [f(s) for s in (0, 4, 9, 10, 25, 39, 40)] == [0.1, 0.5, 1.0, 1.0, 0.5, 1 / 30, 0.0]
    g = lr_lambda(ARMS["post"], 40)  # no warmup: decays from the first step
    assert [g(s) for s in (0, 20, 39, 40)] == [1.0, 0.5, 1 / 40, 0.0]
    # the optimizer really follows it: the lr torch applies at each step
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
    seen = []
    for _ in range(40):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * f(s) for s in range(40)]) and min(seen) > 0


def _run(seed: int, curve: list[float]) -> Run:
    return Run(seed=seed, lr=0.006, test_mse=curve, train_loss=[], seconds=1.0, cpu_seconds=1.0)


def _arm(name: str, runs: list[Run], floor: float) -> ArmResult:
    return ArmResult(name, "post", 0.006, 0, 2, runs, aggregate(runs, floor))


def test_readings_are_judged_seed_by_seed():
    """Pre-LN beats post-LN on seed 0 and loses on seed 1: partly held, and it says so."""
    floor = 0.01
    good, slow, bad = [0.5, 0.015, 0.012], [0.5, 0.5, 0.015], [0.5, 0.5, 0.5]
    runs = {"pre": [_run(0, good), _run(1, slow)], "post": [_run(0, bad), _run(1, good)]}
    arms = {name: _arm(name, r, floor) for name, r in runs.items()}
    grad_norms = {"post": {"encoder": [1.0]}, "pre": {"encoder": [1.0]}}
    results = Results(Config(), "", floor, 0, 0, "", 1, 0.0, 0.0, None, arms=arms, grad_norms=grad_norms, grad_inits=1)
    ((prediction, verdict, what),) = report.readings(results)
    assert prediction.startswith("Pre-LN trains without warmup") and verdict == "Partly held"
    assert what.endswith("(1 of 2 seeds).")
    runs["post"][1] = _run(1, bad)  # now pre-LN wins on both seeds
    arms["post"].runs = runs["post"]
    assert report.readings(results)[0][1] == "Held"
    runs["pre"] = [_run(0, bad), _run(1, bad)]  # pre-LN fails everywhere
    arms["pre"].runs = runs["pre"]
    assert report.readings(results)[0][1] == "Did not hold"


def test_summarize():
    s = summarize([1.0, 0.05, 0.019, 0.03], floor=0.01)
    assert (s.final, s.best, s.first_within, s.failed) == (0.03, 0.019, 3, False)
    assert s.first_below_fail == 2  # first epoch within FAIL_RATIO x floor = 0.1
    assert s.ratio == pytest.approx(3.0)
    assert summarize([0.5, FAIL_RATIO * 0.01 * 1.01], 0.01).failed
    assert summarize([0.5, math.nan], 0.01).failed
    assert summarize([0.5, 0.4], 0.01).first_within is None


DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("name", ["experiment", "experiment-depth"])
def test_results_schema_reads_and_writes_the_recorded_results(name):
    """The recorded results.json files load as Results and are written back byte for byte."""
    text = (DOCS / name / "results.json").read_text()
    doc = json.loads(text)
    results = Results.from_json(doc)
    assert json.dumps(results.to_json(), indent=1) + "\n" == text
    assert results.config == Config(**{**doc["config"], "betas": tuple(doc["config"]["betas"])})
    arms = results.all_arms()
    assert arms and all(len(a.runs) == len(doc["config"]["seeds"]) for a in arms)
    assert all(isinstance(r, Run) and len(r.test_mse) == doc["config"]["epochs"] for a in arms for r in a.runs)
    assert (results.sweep is None) == (name == "experiment")
    if results.sweep is not None:
        assert list(results.sweep.arms) == results.sweep.depth == [2, 4, 6, 8]


def test_results_schema_writes_nan_as_null(tmp_path):
    """A diverged run: NaN in memory, null in results.json (strict JSON), NaN again once read."""
    run = Run(seed=0, lr=0.006, test_mse=[0.5, math.nan], train_loss=[math.inf, 0.1], seconds=1.0, cpu_seconds=1.0)
    arms = {"post": ArmResult("post-LN", "post", 0.006, 0, 2, [run], aggregate([run], 0.01))}
    grads = {"post": {"encoder": [1.0], "decoder": [2.0]}, "pre": {"encoder": [1.0], "decoder": [1.0]}}
    results = Results(TINY, "d", 0.01, 32, 16, "t", 1, 1.0, 1.0, None, arms=arms, grad_norms=grads, grad_inits=5)
    results.command = "addnorm train"
    results.write(tmp_path / "results.json")
    doc = json.loads((tmp_path / "results.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert doc["arms"]["post"]["runs"][0]["test_mse"] == [0.5, None]
    assert doc["arms"]["post"]["runs"][0]["train_loss"] == [None, 0.1]
    assert doc["arms"]["post"]["summary"]["final"] is None and doc["arms"]["post"]["summary"]["failed"] == 1
    assert list(doc) == [
        *("config", "data", "floor", "n_train", "n_test", "torch", "workers", "seconds", "cpu_seconds"),
        *("interrupted", "arms", "grad_norms", "grad_inits", "command"),
    ]
    again = Results.read(tmp_path / "results.json")
    assert math.isnan(again.arms["post"].runs[0].test_mse[1]) and math.isnan(again.arms["post"].summary.final)
    assert again.arms["post"].runs[0].test_mse[0] == 0.5 and again.config == TINY and again.command == "addnorm train"


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
    assert list(results["arms"]) == DEFAULT_ARMS and results["interrupted"] is None
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
    assert report.count("Held") + report.count("Did not hold") == 4
    for png in ("curves.png", "grad_norms.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # plot_results redraws from results.json alone
    again = plot_results(out / "results.json", tmp_path / "again")
    assert sorted(p.name for p in again) == ["curves.png", "grad_norms.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in again)


def test_runs_in_parallel_processes_equal_runs_in_one():
    """The worker processes give bit for bit the curves of a run in this process, whatever the
    order the runs finish in."""
    cfg = dataclasses.replace(TINY, arms=["pre", "post-warmup"], seeds=[0, 1], epochs=2)
    jobs = training.jobs_of(cfg, [1, 2])
    assert len(jobs) == 8 and len(set(jobs)) == 8
    serial, stopped = training.train_all(cfg, jobs, workers=1)
    seen = []
    parallel, stopped_too = training.train_all(cfg, jobs, lambda *msg: seen.append(msg), workers=2)
    assert not stopped and not stopped_too and serial.keys() == parallel.keys() == set(jobs)
    for job in jobs:
        assert serial[job].test_mse == parallel[job].test_mse, job
        assert serial[job].train_loss == parallel[job].train_loss, job
    # progress came back from the workers: every epoch of every run, with its test MSE
    assert sorted((job, epoch) for job, epoch, _ in seen) == sorted((j, e) for j in jobs for e in (1, 2))
    assert {(job, epoch): mse for job, epoch, mse in seen}[jobs[0], 2] == serial[jobs[0]].test_mse[1]


def test_workers_with_several_threads_each_do_not_hang():
    """With more than one thread per worker the workers are spawned, not forked: a forked child
    that runs OpenMP on several threads after its parent did waits forever (GNU libgomp)."""
    import signal

    def hung(*args):
        raise TimeoutError("the worker processes hung")

    cfg = dataclasses.replace(TINY, arms=["pre"], seeds=[0, 1], threads=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.ones(1 << 16).exp_().sum()  # this process has run OpenMP on two threads
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(240)  # a hang fails the test instead of the run
    try:
        parallel, _ = training.train_all(cfg, training.jobs_of(cfg), workers=2)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        torch.set_num_threads(threads)
    serial, _ = training.train_all(cfg, training.jobs_of(cfg), workers=1)
    assert all(parallel[job].test_mse == serial[job].test_mse for job in serial)


@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_keeps_the_finished_runs(workers):
    """Ctrl-C while training: the finished runs come back, the workers are stopped."""
    import multiprocessing

    cfg = dataclasses.replace(TINY, arms=["pre", "post"], seeds=[0, 1, 2], epochs=2)
    jobs = training.jobs_of(cfg)

    def progress(job, epoch, mse):  # Ctrl-C reaches the parent as the fourth run starts
        if job == jobs[3]:
            raise KeyboardInterrupt

    done, stopped = training.train_all(cfg, jobs, progress, workers=workers)
    # one run at a time: the first three finished. Two at a time: the fourth starts once two had
    # finished, and the other worker may finish more runs (on a loaded machine, all the rest)
    # before the fourth reports its first epoch
    assert stopped and (set(done) == set(jobs[:3]) if workers == 1 else len(done) >= 2), done.keys()
    assert jobs[3] not in done
    assert multiprocessing.active_children() == []
    reference, _ = training.train_all(cfg, list(done), workers=1)
    assert all(done[job].test_mse == reference[job].test_mse for job in done)


def test_cli_interrupted_writes_what_finished(tmp_path, capsys, monkeypatch):
    calls = []
    real = training.train_arm

    def train_arm(*args, **kwargs):  # Ctrl-C during the third run
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "train_arm", train_arm)
    argv = ["train", "--quick", "--arms", "pre,post", "--seeds", "2", "--jobs", "1", "--out", str(tmp_path)]
    assert cli.main(argv) == 130
    out, err = capsys.readouterr()
    assert err == f"addnorm train: error: interrupted: 2 of 4 runs had finished; {tmp_path} holds those\n"
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["arms"]) == ["pre"] and len(results["arms"]["pre"]["runs"]) == 2
    assert results["interrupted"] == {"finished": 2, "planned": 4}
    assert "**Interrupted:** 2 of 4 runs had finished" in (tmp_path / "report.md").read_text()
    calls.clear()
    monkeypatch.setattr(training, "train_arm", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert cli.main([*argv[:-1], str(tmp_path / "none")]) == 130
    assert capsys.readouterr().err.endswith("interrupted before any run finished; nothing written\n")
    assert not (tmp_path / "none" / "results.json").exists()


def test_curves_of_an_interrupted_run_say_how_many_seeds_each_line_holds(tmp_path, monkeypatch):
    """Ctrl-C during the fourth of four runs: pre-LN's line is the median of 2 seeds, post-LN's
    is 1 seed, and curves.png says so instead of "median of 2 seeds"."""
    from matplotlib.figure import Figure

    calls, real, drawn = [], training.train_arm, {}

    def train_arm(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    def savefig(fig, path, **kwargs):
        ax = fig.axes[0]
        drawn[pathlib.Path(path).name] = (ax.get_title(), [t.get_text() for t in ax.get_legend().get_texts()])

    monkeypatch.setattr(training, "train_arm", train_arm)
    monkeypatch.setattr(Figure, "savefig", savefig)
    argv = ["train", "--quick", "--arms", "pre,post", "--seeds", "2", "--jobs", "1", "--out", str(tmp_path)]
    assert cli.main(argv) == 130
    title, labels = drawn["curves.png"]
    assert title.startswith("Test MSE per epoch (median of the seeds that finished, band: min-max; interrupted)")
    assert labels == ["pre-LN", "post-LN (1 of 2 seeds)"]


def test_dropout_reaches_every_add_and_norm(tmp_path):
    from addnorm.nn import AddNorm

    cfg = dataclasses.replace(TINY, dropout=0.1)
    model = training.build_model(cfg, "post")
    norms = [m for m in model.modules() if isinstance(m, AddNorm)]
    assert norms and all(m.dropout == 0.1 for m in norms)
    train, _ = square_sequences(32, 1)
    test, _ = square_sequences(16, 2)
    with_dropout = train_arm(ARMS["post"], 0, cfg, train, test)
    assert with_dropout.test_mse != train_arm(ARMS["post"], 0, TINY, train, test).test_mse
    assert with_dropout.test_mse == train_arm(ARMS["post"], 0, cfg, train, test).test_mse  # seeded
    out = tmp_path / "run"
    assert cli.main(["train", "--quick", "--arms", "post", "--dropout", "0.1", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["dropout"] == 0.1 and "--dropout 0.1" in results["command"]
    assert "residual dropout 0.1" in (out / "report.md").read_text()


def test_arms_all_runs_every_arm():
    args = cli.build_parser().parse_args(["train", "--arms", "all"])
    assert command.config_from_args(args)[0].arms == list(ARMS)


def test_a_finished_run_is_replaced_only_with_force(tmp_path, capsys):
    """A folder holding a finished run is refused before training; with --force the new run
    replaces it, and a replaced run's files the new one does not write (a depth sweep's
    depth.png after a plain run) are removed, so the folder never mixes two runs."""
    out = tmp_path / "run"
    argv = ["train", "--sweep", "depth", "--depths", "1", "--arms", "pre", "--epochs", "1", "--seeds", "1"]
    assert cli.main([*argv, "--out", str(out)]) == 0
    before = (out / "results.json").read_bytes()
    capsys.readouterr()
    assert cli.main(["train", "--quick", "--arms", "pre", "--seeds", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds a finished run (results.json)" in err and "--force" in err and err.count("\n") == 1
    assert (out / "results.json").read_bytes() == before
    assert cli.main(["train", "--quick", "--arms", "pre", "--seeds", "1", "--force", "--out", str(out)]) == 0
    assert (out / "results.json").read_bytes() != before
    assert (out / "curves.png").is_file() and not (out / "depth.png").exists()


def test_depth_sweep_end_to_end(tmp_path):
    out = tmp_path / "sweep"
    argv = ["train", "--sweep", "depth", "--depths", "2,1", "--arms", "post,pre", "--epochs", "1"]
    assert cli.main([*argv, "--seeds", "2", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["sweep"]["depth"] == [1, 2] and "arms" not in results
    for depth in ("1", "2"):
        arms = results["sweep"]["arms"][depth]
        assert list(arms) == ["post", "pre"] and all(len(a["runs"]) == 2 for a in arms.values())
    # the runs at depth 2 are the runs of a plain experiment at depth 2
    cfg = Config(arms=["pre"], seeds=[1], epochs=1, depth=2)
    again = training.train_all(cfg, training.jobs_of(cfg))[0][("pre", 1, 2)]
    assert results["sweep"]["arms"]["2"]["pre"]["runs"][1]["test_mse"] == again.test_mse
    report = (out / "report.md").read_text()
    assert "| post-LN | 0.006 | " in report and "depth.png" in report and "Liu et al. 2020" in report
    assert (out / "depth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "curves.png").exists()
    assert cli.main(["plot", "train", "--results", str(out / "results.json"), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "depth.png").is_file()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dropout", "1"], "--dropout must be in [0, 1), got 1.0"),
        (["--dropout", "-0.1"], "--dropout must be in [0, 1), got -0.1"),
        (["--dropout", "nan"], "--dropout must be in [0, 1), got nan"),
        (["--jobs", "0"], "--jobs must be at least 1, got 0"),
        (["--depths", "2,4"], "--depths only applies to '--sweep depth'"),
        (["--sweep", "depth", "--depth", "4"], "--depth: a depth sweep trains at every depth of --depths"),
        (["--sweep", "depth", "--depths", "2,x"], "--depths: expected positive whole numbers"),
        (["--sweep", "depth", "--depths", "0"], "--depths: expected positive whole numbers"),
        (["--sweep", "width"], "argument --sweep: invalid choice: 'width'"),
    ],
)
def test_bad_train_options(tmp_path, capsys, no_training, argv, message):
    assert cli.main(["train", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("addnorm train: error: ") and message in err and err.count("\n") == 1, err


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


def test_data_far_from_noisy_corners_are_flagged_and_plotted_whole(tmp_path, capsys):
    """Data whose targets are no noisy corners (every value 0.1: each target 0.9 from its nearest
    corner) have a noise floor models end far below: the terminal and report.md say the floor
    means little there, and the curves' axis reaches down to every point drawn."""
    from addnorm.tools.experiment import plots

    np.savetxt(tmp_path / "flat.csv", np.full((40, 8), 0.1), delimiter=",")
    out = tmp_path / "run"
    argv = ["train", "--quick", "--arms", "pre", "--seeds", "1", "--data", str(tmp_path / "flat.csv")]
    assert cli.main([*argv, "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["floor"] == pytest.approx(0.81)
    final = doc["arms"]["pre"]["runs"][0]["test_mse"][-1]
    assert final < doc["floor"]
    assert "the models end below the noise floor" in capsys.readouterr().out
    assert "**Note:** the models end below the noise floor" in (out / "report.md").read_text()
    results = Results.from_json(doc)
    assert plots._bottom(results) <= min(v for v in doc["arms"]["pre"]["runs"][0]["test_mse"]) / 2
    points, _ = square_sequences(40, 5)  # noisy corners: no note, the axis from half the floor
    np.save(tmp_path / "mine.npy", points)
    argv[-1] = str(tmp_path / "mine.npy")
    assert cli.main([*argv, "--out", str(tmp_path / "corners")]) == 0
    assert "Note" not in (tmp_path / "corners" / "report.md").read_text()


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

    monkeypatch.setattr(command, "run_experiment", run_experiment)


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

    monkeypatch.setattr(command, "write_outputs", write_outputs)
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


def test_a_reader_going_away_loses_no_finished_run(tmp_path):
    """``addnorm train | head -1``: stdout closes while the runs train; the runs' files are still
    written (rich's console exited at its next print, before any file was)."""
    out = tmp_path / "run"
    argv = ["train", "--quick", "--arms", "pre", "--epochs", "1", "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "addnorm", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"addnorm train:")
    proc.stdout.close()  # the reader goes away
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and err == b""  # quietly, as any command whose reader left
    assert list(json.loads((out / "results.json").read_text())["arms"]) == ["pre"]
    assert (out / "report.md").exists() and (out / "curves.png").exists()


def test_data_on_the_exact_corners_has_no_floor(tmp_path, capsys, no_training):
    corners = np.array([[[-1, -1], [-1, 1], [1, 1], [1, -1]]] * 6, dtype=np.float32)
    np.save(tmp_path / "exact.npy", corners)
    assert cli.main(["train", "--quick", "--data", str(tmp_path / "exact.npy"), "--out", str(tmp_path)]) == 2
    assert "the noise floor is 0" in capsys.readouterr().err
