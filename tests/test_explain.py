"""`addnorm explain`: its numbers against the seeds' hand computation and torch, its JSON, its errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import addnorm
from addnorm.tools import cli
from addnorm.tools.explain.parse import parse_literal

SEEDS_X = [[0.2, 0.1, 0.3], [0.5, 0.1, 0.1]]
# The seeds' worked example (seeds 000, 001, 004): torch's values with eps = 1e-5 ...
SEEDS_MEAN = [0.2, 0.2333]
SEEDS_STD = [0.0817, 0.1886]
SEEDS_Y = [[0.0, -1.2238, 1.2238], [1.4140, -0.7070, -0.7070]]
# ... and the hand computation with sigma without eps (seed 000): 0.1 / 0.08164 = 1.2247.
SEEDS_HAND_XHAT_ROW0 = [0.0, -1.2247, 1.2247]


def run_json(capsys, *args: str) -> dict:
    assert cli.main(["explain", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def close(a, b, atol):
    return torch.allclose(
        torch.tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=atol, rtol=0
    )


def test_default_is_the_seeds_example(capsys):
    r = run_json(capsys)
    assert r["shape"] == [2, 3] and r["normalized_shape"] == [3] and r["eps"] == 1e-5
    assert close(r["mean"], SEEDS_MEAN, 1e-4)
    # biased variance by hand: (0 + 0.01 + 0.01) / 3 and (0.071111 + 0.017778 + 0.017778) / 3
    var_hand = [0.02 / 3, ((0.8 / 3) ** 2 + 2 * (0.4 / 3) ** 2) / 3]
    assert close(r["var"], var_hand, 1e-7)
    assert close(r["std"], SEEDS_STD, 1e-4)
    assert close(r["y"], SEEDS_Y, 1e-4)
    assert close(r["xhat_no_eps"][0], SEEDS_HAND_XHAT_ROW0, 1e-4)
    assert close(r["std_no_eps"], [math.sqrt(v) for v in var_hand], 1e-7)
    # against torch in float64 on the same input (a literal is parsed in float64)
    x = torch.tensor(SEEDS_X, dtype=torch.float64)
    assert close(r["y"], TF.layer_norm(x, (3,), eps=1e-5), 1e-12)
    # the check line's numbers: mean 0, std sqrt(var / (var + eps)), just under 1
    assert close(r["check_mean"], [0.0, 0.0], 1e-12)
    var = torch.tensor(r["var"], dtype=torch.float64)
    assert close(r["check_std"], (var / (var + 1e-5)).sqrt(), 1e-12)
    assert r["op_maxdiff"] < 1e-6 and r["torch_maxdiff"] < 1e-12


def test_tables_show_the_seeds_numbers_with_shapes(capsys):
    assert cli.main(["explain"]) == 0
    out = capsys.readouterr().out
    for text in [
        "input x   shape (2, 3)",
        "mean μ (2, 1)",
        "0.2333",
        "0.0817",
        "0.1886",
        "1.4140",
        "-0.7070",
        "-1.2238",
        "-1.2247",
        "γ (weight) and β (bias)   shape (3,)",
        "output y = γ·x̂ + β   shape (2, 3)",
        "check: each row of x̂ has mean [0.0000, 0.0000] = 0 and std [0.9993, 0.9999]",
    ]:
        assert text in out, text
    assert "-0.0000" not in out


def test_precision(capsys):
    assert cli.main(["explain", "--precision", "6"]) == 0
    assert "1.223827" in capsys.readouterr().out


def test_seeds_three_dim_input_over_two_trailing_dims(capsys):
    # the seeds' [S, B, E] = [2, 1, 3], normalized over [B, E]
    r = run_json(capsys, "--input", "[[[0.2,0.1,0.3]],[[0.5,0.1,0.1]]]", "--normalized-shape", "1,3")
    assert r["normalized_shape"] == [1, 3] and r["rows"] == 2 and r["features"] == 3
    assert close(r["y"], SEEDS_Y, 1e-4)


def test_several_trailing_dims_gamma_beta_against_torch(capsys):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 4, generator=g, dtype=torch.float64)
    w = torch.randn(2, 4, generator=g, dtype=torch.float64)
    b = torch.randn(2, 4, generator=g, dtype=torch.float64)
    lit = lambda t: json.dumps(t.tolist())
    r = run_json(
        capsys,
        "--input",
        lit(x),
        "--normalized-shape",
        "2,4",
        "--eps",
        "1e-3",
        "--gamma",
        lit(w.flatten()),
        "--beta",
        ",".join(str(v) for v in b.flatten().tolist()),
    )
    want = TF.layer_norm(x, (2, 4), w, b, 1e-3)
    assert close(r["y"], want.reshape(3, 8), 1e-12)
    assert r["op_maxdiff"] < 1e-5


def test_residual_is_the_add_and_norm_step(capsys):
    r = run_json(capsys, "--residual", "[[0.1,0.1,0.1],[0,0.2,-0.1]]", "--gamma", "2", "--beta", "0.5")
    x = torch.tensor(SEEDS_X, dtype=torch.float64)
    res = torch.tensor([[0.1, 0.1, 0.1], [0, 0.2, -0.1]], dtype=torch.float64)
    assert close(r["s"], x + res, 1e-12)
    assert close(
        r["y"],
        TF.layer_norm(x + res, (3,), torch.full((3,), 2.0).double(), torch.full((3,), 0.5).double(), 1e-5),
        1e-12,
    )


def test_rms_norm(capsys):
    r = run_json(capsys, "--norm", "rms")
    eps = torch.finfo(torch.float64).eps  # torch's default for RMSNorm: the input dtype's (float64 here)
    assert r["eps"] == eps and r["mean"] is None
    x = torch.tensor(SEEDS_X, dtype=torch.float64)
    assert close(r["y"], TF.rms_norm(x, (3,), eps=eps), 1e-12)
    assert close(r["check_std"], [1.0, 1.0], 1e-5)  # root-mean-square of each row is 1


@pytest.mark.parametrize("rms", [False, True])
def test_backward_steps_match_autograd(capsys, rms):
    dy = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0]], dtype=torch.float64)
    w = torch.tensor([1.5, -0.5, 2.0], dtype=torch.float64)
    args = ["--backward", "--grad", json.dumps(dy.tolist()), "--gamma", "1.5,-0.5,2"]
    r = run_json(capsys, *args, *(["--norm", "rms"] if rms else []))
    eps = r["eps"]
    x = torch.tensor(SEEDS_X, dtype=torch.float64).requires_grad_()
    wg = w.clone().requires_grad_()
    bg = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    y = TF.rms_norm(x, (3,), wg, eps) if rms else TF.layer_norm(x, (3,), wg, bg, eps)
    y.backward(dy)
    bw = r["backward"]
    assert close(bw["ds"], x.grad, 1e-10)
    assert close(bw["dweight"], wg.grad, 1e-10)
    if rms:
        assert bw["dbias"] is None and bw["mean_g"] is None
    else:
        assert close(bw["dbias"], bg.grad, 1e-12)
        assert close(bw["mean_g"], (dy * w).mean(dim=-1), 1e-12)
    # the printed intermediates, by hand: g = dy * gamma, mean(g * xhat)
    xd = x.detach()
    if rms:
        xhat = xd * torch.rsqrt((xd * xd).mean(-1, keepdim=True) + eps)
    else:
        xhat = TF.layer_norm(xd, (3,), eps=eps)
    assert close(bw["g"], dy * w, 1e-12)
    assert close(bw["mean_gxhat"], (dy * w * xhat).mean(dim=-1), 1e-10)
    assert max(bw["autograd_maxdiff"].values()) < 1e-10
    assert max(bw["op_maxdiff"].values()) < 1e-4  # addnorm's op runs in float32


def test_backward_default_all_ones_gives_zero_dx(capsys):
    # sum(y) = N * mean(beta) for gamma = 1 whatever x is, so a uniform dy has no effect on x
    r = run_json(capsys, "--backward")
    assert close(r["backward"]["dy"], torch.ones(2, 3), 0)
    assert close(r["backward"]["ds"], torch.zeros(2, 3), 1e-9)
    assert close(r["backward"]["dbias"], [2.0, 2.0, 2.0], 1e-12)
    assert cli.main(["explain", "--backward"]) == 0
    out = capsys.readouterr().out
    assert "dx = rstd·(g − mean(g) − x̂·mean(g·x̂))" in out and "torch autograd's dx" in out


def test_compare_batchnorm(capsys):
    r = run_json(capsys, "--compare", "batchnorm")["compare_batchnorm"]
    x = torch.tensor(SEEDS_X, dtype=torch.float64)
    eps = 1e-5
    mean, var = x.mean(dim=0), x.var(dim=0, correction=0)
    assert close(r["batchnorm"], (x - mean) / torch.sqrt(var + eps), 1e-12)  # per feature over the batch
    assert close(r["layernorm"], TF.layer_norm(x, (3,), eps=eps), 1e-12)  # per row over features
    rows = {row["batch"]: row for row in r["row0"]}
    assert all(row["layernorm_change"] == 0.0 for row in r["row0"])
    assert all(close(row["layernorm_row0"], SEEDS_Y[0], 1e-4) for row in r["row0"])
    assert rows["other rows redrawn (seed 0)"]["batchnorm_change"] > 0.1
    assert rows["batch of 6: 4 random rows added"]["batchnorm_change"] > 0.1
    alone = rows["batch of 1: row 0 alone"]
    assert alone["batchnorm_row0"] is None and "more than 1 value" in alone["batchnorm_error"]
    # running statistics after one training batch, momentum 0.1 (unbiased variance, as torch)
    assert r["layernorm_buffers"] == [] and r["layernorm_train_eval_diff"] == 0.0
    rm, rv = 0.1 * mean, 0.9 + 0.1 * x.var(dim=0, correction=1)
    assert close(r["batchnorm_buffers"]["running_mean"], rm, 1e-12)
    assert close(r["batchnorm_buffers"]["running_var"], rv, 1e-12)
    assert close(r["batchnorm_eval"], (x - rm) / torch.sqrt(rv + eps), 1e-12)
    assert r["batchnorm_train_eval_diff"] > 0.5


def test_compare_tables(capsys):
    assert cli.main(["explain", "--compare", "batchnorm"]) == 0
    out = capsys.readouterr().out
    assert "row 0 inside different batches" in out and "BatchNorm output in eval mode" in out


def test_constant_row_needs_eps(capsys):
    # sigma = 0: without eps the hand computation divides by zero; with it the row maps to beta
    r = run_json(capsys, "--input", "[[1,1,1],[1,2,3]]")
    assert r["xhat_no_eps"][0] == [None, None, None]  # NaN, written as null in strict JSON
    x = torch.tensor([[1.0, 1, 1], [1, 2, 3]], dtype=torch.float64)
    assert close(r["y"], TF.layer_norm(x, (3,), eps=1e-5), 1e-12)
    assert cli.main(["explain", "--input", "[[1,1,1],[1,2,3]]"]) == 0
    assert "[nan, nan, nan]" in capsys.readouterr().out


def test_one_row_and_two_features(capsys):
    r = run_json(capsys, "--input", "[1,2,3]")
    assert r["shape"] == [3] and r["rows"] == 1
    assert close(r["y"], [TF.layer_norm(torch.tensor([1.0, 2, 3]).double(), (3,)).tolist()], 1e-12)
    r = run_json(capsys, "--input", "[[1.4636,2.3663],[1.9806,-0.7564]]")  # seed 003: two features
    assert close(r["y"], [[-1.0, 1.0], [1.0, -1.0]], 1e-3)
    assert any("normalizing over 2 feature(s)" in w for w in r["warnings"])


def test_wide_input_is_elided_in_tables_not_in_json(capsys, tmp_path):
    x = torch.randn(30, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    np.save(tmp_path / "x.npy", x.numpy())
    assert cli.main(["explain", "--input", str(tmp_path / "x.npy")]) == 0
    out = capsys.readouterr().out
    assert "shape (30, 40)" in out and "│ …   │" in out and "38" in out
    r = run_json(capsys, "--input", str(tmp_path / "x.npy"))
    assert close(r["y"], TF.layer_norm(x, (40,)), 1e-12)


def test_files(capsys, tmp_path):
    x = np.array(SEEDS_X)
    np.save(tmp_path / "x.npy", x)
    torch.save(torch.tensor(SEEDS_X), tmp_path / "x.pt")
    (tmp_path / "x.csv").write_text("0.2,0.1,0.3\n0.5,0.1,0.1\n")
    for name, dtype in [("x.npy", "float64"), ("x.pt", "float32"), ("x.csv", "float64")]:
        r = run_json(capsys, "--input", str(tmp_path / name))
        assert r["dtype"] == dtype
        assert close(r["y"], SEEDS_Y, 1e-4)


def test_parse_literal_accepts_plain_number_syntax():
    assert parse_literal(" [[1e-3, -.5], [2, 3,]] ", "--input") == [[1e-3, -0.5], [2.0, 3.0]]
    assert parse_literal("2.5", "--gamma") == 2.5


ERRORS = [
    (["--input", "[[0.2,0.1],[0.5]]"], "ragged rows: [1] has 1 values but [0] has 2 values"),
    (["--input", "[[0.2,abc]]"], "non-numeric value 'abc'"),
    (["--input", "[[0.2,0.1]"], "unbalanced brackets"),
    (["--input", "[[0.2,0.1]]]"], "unexpected ']'"),
    (["--input", "[[1,2][3,4]]"], "expected ',' or ']'"),
    (["--input", "[]"], "empty list"),
    (["--input", "[[1,nan]]"], "not a finite number"),
    (["--input", "hello"], "must be a matrix literal"),
    (["--input", "no/such/file.npy"], "file 'no/such/file.npy' not found"),
    (["--normalized-shape", "2"], "must equal the trailing dims of the input, whose shape is [2, 3]"),
    (["--normalized-shape", "0,3"], "--normalized-shape must be positive ints"),
    (["--normalized-shape", "a"], "--normalized-shape must be positive ints"),
    (["--compare", "batchnorm", "--eps", "0"], "--eps 0 with --compare batchnorm: torch's batch_norm needs eps > 0"),
    (["--compare", "batchnorm", "--norm", "rms"], "compares plain LayerNorm; drop --norm rms"),
    (
        ["--input", "[[1,2],[3,4]]", "--normalized-shape", "2,2", "--compare", "batchnorm"],
        "an input of shape [2, 2] normalized over its trailing [2, 2] is a single row",
    ),
    (["--residual", "[[1,2,3],[4,5,6]]", "--dropout", "0.5", "--seed", str(2**64)], "--seed must be an integer"),
    (
        ["--residual", "[[1,2,3],[4,5,6]]", "--dropout", "0.5", "--seed", str(-(2**63) - 1)],
        "--seed must be an integer from -2**63 to 2**64 - 1",
    ),
    (["--seed", "3"], "--seed is the seed of --dropout's mask: add --dropout"),
    (["--input", "[[0,0],[1,2]]", "--eps", "0"], "--eps 0: row(s) [0] are constant"),
    (["--input", "[[0,0],[1,2]]", "--eps", "0", "--norm", "rms"], "--eps 0: row(s) [0] are constant"),
    (["--gamma", "1,2"], "--gamma needs 1 or 3 values"),
    (["--gamma", "abc"], "--gamma: non-numeric value 'abc'; expected one number, or one per feature"),
    (["--norm", "rms", "--beta", "1"], "RMSNorm has no bias"),
    (["--residual", "[[1,2]]"], "--residual must have the input's shape [2, 3]"),
    (["--grad", "[[1,1,1],[1,1,1]]"], "add --backward"),
    (["--eps", "-1"], "--eps must be a non-negative number"),
    (["--eps", "-1e-5"], "--eps must be a non-negative number, got -1e-05"),
    (["--precision", "-1"], "--precision must be between 0 and 12"),
    (["--input", "[[1,2,1e400]]"], "'1e400' is not a finite number"),
    (["--compare", "batchnorm", "--input", "[[1,2,3]]"], "--compare batchnorm needs at least 2 rows"),
    (["--compare", "batchnorm", "--input", "[1,2,3]"], "--compare batchnorm needs at least 2 rows"),
]


@pytest.mark.parametrize("args,message", ERRORS)
def test_errors_are_one_line_exit_2(capsys, args, message):
    assert cli.main(["explain", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("addnorm explain: error: ")
    assert message in lines[0]


def test_unreadable_file(capsys, tmp_path):
    (tmp_path / "x.csv").write_text("0.2,0.1,0.3\n0.5,0.1\n")
    torch.save({"x": 1}, tmp_path / "d.pt")
    (tmp_path / "text.npy").write_text("hello")
    (tmp_path / "empty.csv").write_text("")
    torch.save(torch.empty(2, 3, device="meta"), tmp_path / "meta.pt")
    for name, message in [
        ("x.csv", "cannot read"),
        ("d.pt", "holds a dict, expected one tensor"),
        ("text.npy", "not a .npy file of numbers (Python objects in .npy files are never loaded)"),
        ("empty.csv", "--input is empty"),
        ("meta.pt", "holds a tensor on the meta device, which has no values"),
    ]:
        assert cli.main(["explain", "--input", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_unusable_tensor_files(capsys, tmp_path):
    torch.save(torch.eye(3).to_sparse(), tmp_path / "sparse.pt")
    torch.save(torch.ones(2, 3, dtype=torch.complex64), tmp_path / "complex.pt")
    torch.save(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged), tmp_path / "nested.pt")
    np.save(tmp_path / "complex.npy", np.ones((2, 3), dtype=np.complex64))
    for name, message in [
        ("sparse.pt", "holds a sparse_coo tensor; expected a dense one (save t.to_dense())"),
        ("complex.pt", "--input is complex64; expected real numbers"),
        ("nested.pt", "holds a nested tensor; expected a dense one"),
        ("complex.npy", "--input is complex64; expected real numbers"),
    ]:
        assert cli.main(["explain", "--input", str(tmp_path / name)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and message in err, (name, err)


# --------------------------------------------------------------------------- float64 literals


def test_literals_are_parsed_in_float64(capsys):
    r = run_json(capsys, "--input", "[[0.1,0.2,0.3]]")
    assert r["dtype"] == "float64" and r["x"] == [[0.1, 0.2, 0.3]]  # not 0.10000000149011612
    assert "float64" in r["op_name"] and r["op_maxdiff"] < 1e-15
    r = run_json(capsys, "--input", "[[1,2,1e-300]]")
    assert r["x"] == [[1.0, 2.0, 1e-300]]  # float32 would have flushed it to 0
    x = torch.tensor([[1.0, 2.0, 1e-300]], dtype=torch.float64)
    assert close(r["y"], TF.layer_norm(x, (3,), eps=1e-5), 1e-12)


def test_huge_values_are_normalized_not_rejected(capsys):
    # 1e300 overflows float32 (the old "contains NaN or infinite values"); in float64 the row is
    # [1, 2, 1e300]: x̂ is (-1, -1, 2)/√2 up to 1e-300 relative terms, whatever the huge scale
    r = run_json(capsys, "--input", "[[1,2,1e300]]")
    assert r["x"] == [[1.0, 2.0, 1e300]]
    assert close(r["y"], [[-1 / math.sqrt(2), -1 / math.sqrt(2), math.sqrt(2)]], 1e-12)
    assert r["op_maxdiff"] < 1e-12
    assert cli.main(["explain", "--input", "[[1,2,1e300]]"]) == 0
    out = capsys.readouterr().out
    assert "1.0000e+300" in out and "3.3333e+299" in out and "1.4142" in out  # no 300-digit numbers
    assert max(len(line) for line in out.splitlines()) <= 100


def test_json_size_guard(capsys, monkeypatch):
    from addnorm.tools.explain import show

    monkeypatch.setattr(show, "MAX_JSON_NUMBERS", 400)
    x = json.dumps(torch.arange(30.0).reshape(3, 10).tolist())
    r = run_json(capsys, "--input", x)  # a forward of 30 values stays under 400 numbers
    assert len(r["y"]) == 3
    assert cli.main(["explain", "--json", "--backward", "--input", x]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("addnorm explain: error: --json would print ")
    count = int(err.split("would print ")[1].split(" numbers")[0].replace(",", ""))
    assert count > 400 and "at most 400 numbers" in err
    assert cli.main(["explain", "--backward", "--input", x]) == 0  # the tables elide instead


def test_json_into_a_closed_pipe_is_quiet(tmp_path):
    """`addnorm explain --json ... | head -c 100`: the reader leaves early; no BrokenPipeError."""
    import subprocess
    import sys

    torch.save(torch.randn(60, 60, generator=torch.Generator().manual_seed(0)), tmp_path / "x.pt")
    argv = [sys.executable, "-m", "addnorm", "explain", "--json", "--input", str(tmp_path / "x.pt")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(proc.stdout.read(100)) == 100
    proc.stdout.close()  # as `head -c 100` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert err == "", err


def test_dropout_shows_the_mask_the_op_uses(capsys):
    """--dropout P --seed S: the keep mask is the one addnorm's op draws from a generator seeded S
    (the op's output agrees with these steps to rounding), and s = residual + kept x / (1 - p)."""
    x = [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [6.0, 5.0, 4.0, 3.0, 2.0, 1.5]]
    res = [[0.5] * 6, [-1.0] * 6]
    r = run_json(capsys, "--input", str(x), "--residual", str(res), "--dropout", "0.5", "--seed", "3", "--backward")
    _, mask = addnorm.add_layer_norm(
        torch.tensor(x),
        torch.tensor(res),
        6,
        dropout_p=0.5,
        generator=torch.Generator().manual_seed(3),
        return_dropout_mask=True,
    )
    keep = torch.tensor(r["keep"], dtype=torch.bool)
    assert torch.equal(keep, mask) and 0 < keep.sum() < keep.numel()
    expected_s = torch.tensor(res, dtype=torch.float64) + torch.where(keep, torch.tensor(x, dtype=torch.float64) * 2, 0)
    assert torch.equal(torch.tensor(r["s"]), expected_s)
    assert r["op_maxdiff"] < 1e-12 and r["torch_maxdiff"] < 1e-12
    assert max(r["backward"]["op_maxdiff"].values()) < 1e-12
    assert cli.main(["explain", "--dropout", "0.5", "--residual", str(res), "--input", str(x)]) == 0
    out = capsys.readouterr().out
    assert "Dropout keep mask" in out and "s = residual + dropout(x)" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--dropout", "0.1"], "--dropout drops the sublayer output x before it is added to --residual"),
        (["--dropout", "1", "--residual", "[[1,2,3]]", "--input", "[[1,2,3]]"], r"--dropout must be a probability"),
    ],
)
def test_dropout_errors(capsys, args, message):
    assert cli.main(["explain", *args]) == 2
    assert message in capsys.readouterr().err
