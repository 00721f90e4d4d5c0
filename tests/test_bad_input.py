"""Bad input everywhere: every public function, module and CLI command, one table row per case.

Each wrong argument must raise a ValueError/TypeError whose message names the argument, before
any backend runs; the CLI must answer with an error line naming the problem and exit status 2,
never a traceback. Adding a case (or, after a new CLI command lands, a command) is one row.
"""
# ruff: noqa: E501  (one table row per line reads best)

from __future__ import annotations

import contextlib
import io
import math
import re
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import addnorm
from addnorm.compat.flash_attn import layer_norm_fn, layer_norm_linear_fn, rms_norm_fn
from addnorm.tools import cli

X = torch.randn(4, 8)
W = torch.ones(8)
META = torch.device("meta")  # stands in for "another device" (cuda) on a CPU-only machine

# (id, call(backend), exception type, regex the message must match)
FUNCTION_CASES = [
    # x
    ("x list", lambda b: addnorm.layer_norm([[1.0] * 8], 8, backend=b), TypeError, r"^x must be a torch.Tensor"),
    ("x numpy", lambda b: addnorm.rms_norm(np.ones((2, 8)), 8, backend=b), TypeError, r"^x must be a torch.Tensor"),
    ("x int", lambda b: addnorm.layer_norm(X.long(), 8, backend=b), TypeError, r"^x must be a floating.*int64"),
    ("x bool", lambda b: addnorm.rms_norm(X.bool(), 8, backend=b), TypeError, r"^x must be a floating.*bool"),
    ("x complex", lambda b: addnorm.layer_norm(X.cfloat(), 8, backend=b), TypeError, r"^x must be a floating"),
    (
        "x float8",
        lambda b: addnorm.layer_norm(X.to(torch.float8_e4m3fn), 8, backend=b),
        TypeError,
        r"^x must be a floating.*float8",
    ),
    (  # (RMSNorm's default eps is the stream dtype's: the dtype is checked first)
        "x float8, default eps",
        lambda b: addnorm.add_rms_norm(X.to(torch.float8_e4m3fn), X, 8, backend=b),
        TypeError,
        r"^x must be a floating.*float8",
    ),
    (
        "residual float8, default eps",
        lambda b: addnorm.AddNorm(8, norm="rms", backend=b)(X, X.to(torch.float8_e5m2)),
        TypeError,
        r"^residual must be a floating.*float8",
    ),
    (
        "x 0-d",
        lambda b: addnorm.layer_norm(torch.tensor(1.0), 1, backend=b),
        ValueError,
        r"^x of shape \(\) must end with normalized_shape",
    ),
    (
        "x wrong trailing",
        lambda b: addnorm.layer_norm(X, 7, backend=b),
        ValueError,
        r"^x of shape \(4, 8\) must end with normalized_shape \(7,\)",
    ),
    (
        "x too few dims",
        lambda b: addnorm.rms_norm(X, (2, 4, 8), backend=b),
        ValueError,
        r"^x of shape .* must end with normalized_shape \(2, 4, 8\)",
    ),
    # normalized_shape
    ("shape float", lambda b: addnorm.layer_norm(X, 8.0, backend=b), TypeError, r"^normalized_shape must be an int"),
    ("shape str", lambda b: addnorm.layer_norm(X, "8", backend=b), TypeError, r"^normalized_shape must be an int"),
    (
        "shape tensor",
        lambda b: addnorm.layer_norm(X, torch.tensor(8), backend=b),
        TypeError,
        r"^normalized_shape must be an int",
    ),
    ("shape bool", lambda b: addnorm.layer_norm(X, True, backend=b), TypeError, r"^normalized_shape must be an int"),
    ("shape 0", lambda b: addnorm.layer_norm(X, 0, backend=b), ValueError, r"^normalized_shape must be .*positive"),
    ("shape negative", lambda b: addnorm.rms_norm(X, -8, backend=b), ValueError, r"^normalized_shape .*positive"),
    ("shape empty", lambda b: addnorm.layer_norm(X, [], backend=b), ValueError, r"^normalized_shape .*positive"),
    ("shape float item", lambda b: addnorm.layer_norm(X, [8.0], backend=b), ValueError, r"^normalized_shape"),
    # weight / bias
    (
        "weight numpy",
        lambda b: addnorm.layer_norm(X, 8, np.ones(8), backend=b),
        TypeError,
        r"^weight must be a torch.Tensor",
    ),
    ("weight list", lambda b: addnorm.rms_norm(X, 8, [1.0] * 8, backend=b), TypeError, r"^weight must be a torch"),
    ("weight int", lambda b: addnorm.layer_norm(X, 8, W.long(), backend=b), TypeError, r"^weight must be a floating"),
    (
        "weight shape",
        lambda b: addnorm.rms_norm(X, 8, torch.ones(7), backend=b),
        ValueError,
        r"^weight must have shape \(8,\)",
    ),
    (
        "weight broadcastable",
        lambda b: addnorm.layer_norm(X, 8, torch.ones(1, 8), backend=b),
        ValueError,
        r"^weight must have shape \(8,\)",
    ),
    (
        "weight device",
        lambda b: addnorm.layer_norm(X, 8, W.to(META), backend=b),
        ValueError,
        r"^weight is on meta but x is on cpu",
    ),
    (
        "bias shape",
        lambda b: addnorm.layer_norm(X, 8, W, torch.zeros(4), backend=b),
        ValueError,
        r"^bias must have shape \(8,\)",
    ),
    (
        "bias numpy",
        lambda b: addnorm.layer_norm(X, 8, W, np.zeros(8), backend=b),
        TypeError,
        r"^bias must be a torch.Tensor",
    ),
    (
        "bias device",
        lambda b: addnorm.add_layer_norm(X, X, 8, W, W.to(META), backend=b),
        ValueError,
        r"^bias is on meta",
    ),
    # layouts: sparse and mkldnn tensors have no rows to read
    ("x sparse", lambda b: addnorm.layer_norm(X.to_sparse(), 8, backend=b), TypeError, r"^x must be a dense tensor"),
    (
        "residual sparse",
        lambda b: addnorm.add_rms_norm(X, X.to_sparse(), 8, backend=b),
        TypeError,
        r"^residual must be a dense tensor, got layout torch.sparse_coo",
    ),
    ("x mkldnn", lambda b: addnorm.rms_norm(X.to_mkldnn(), 8, backend=b), TypeError, r"^x must be a dense tensor"),
    # eps
    ("eps negative", lambda b: addnorm.layer_norm(X, 8, eps=-1e-5, backend=b), ValueError, r"^eps must be"),
    ("eps nan", lambda b: addnorm.rms_norm(X, 8, eps=math.nan, backend=b), ValueError, r"^eps must be.*nan"),
    ("eps inf", lambda b: addnorm.layer_norm(X, 8, eps=math.inf, backend=b), ValueError, r"^eps must be.*finite"),
    ("eps str", lambda b: addnorm.layer_norm(X, 8, eps="1e-5", backend=b), TypeError, r"^eps must be.*str"),
    (
        "eps inf in float32",
        lambda b: addnorm.layer_norm(X, 8, eps=1e39, backend=b),
        ValueError,
        r"^eps must be at most",
    ),
    (
        "eps tensor",
        lambda b: addnorm.rms_norm(X, 8, eps=torch.tensor(1e-5), backend=b),
        TypeError,
        r"^eps must be.*Tensor",
    ),
    (
        "eps None (LayerNorm)",
        lambda b: addnorm.layer_norm(X, 8, eps=None, backend=b),
        TypeError,
        r"^eps must be.*NoneType",
    ),
    ("eps bool", lambda b: addnorm.add_rms_norm(X, X, 8, eps=True, backend=b), TypeError, r"^eps must be.*bool"),
    (
        "eps an int beyond float",
        lambda b: addnorm.layer_norm(X, 8, eps=10**400, backend=b),
        ValueError,
        r"^eps must be at most",
    ),
    (
        "dropout_p a tensor",
        lambda b: addnorm.add_layer_norm(X, X, 8, dropout_p=torch.tensor(0.1), backend=b),
        ValueError,
        r"^dropout_p must be a probability in \[0, 1\] \(a Python number\), got Tensor$",
    ),
    # residual
    (
        "x1 of another shape",
        lambda b: addnorm.add_layer_norm(X, X, 8, x1=X[:1], backend=b),
        ValueError,
        r"^x1 must have the shape of x \(4, 8\)",
    ),
    (
        "x1 with rowscale",
        lambda b: addnorm.add_rms_norm(X, X, 8, x1=X, rowscale=torch.ones(4), backend=b),
        ValueError,
        r"^rowscale with x1 is ambiguous",
    ),
    (
        "x1 with a float layer_scale",
        lambda b: addnorm.add_layer_norm(X, X, 8, x1=X, layer_scale=0.1, backend=b),
        TypeError,
        r"^layer_scale must be a torch.Tensor, got float",
    ),
    (
        "bias1 without weight1",
        lambda b: addnorm.add_layer_norm(X, X, 8, bias1=torch.ones(8), backend=b),
        ValueError,
        r"^bias1 is the bias of the second norm: it needs weight1",
    ),
    (
        "weight1 of another shape",
        lambda b: addnorm.add_layer_norm(X, X, 8, weight1=torch.ones(4), backend=b),
        ValueError,
        r"^weight1 must have shape \(8,\)",
    ),
    (
        "residual list",
        lambda b: addnorm.add_rms_norm(X, X.tolist(), 8, backend=b),
        TypeError,
        r"^residual must be a torch.Tensor",
    ),
    (
        "residual int",
        lambda b: addnorm.add_layer_norm(X, X.int(), 8, backend=b),
        TypeError,
        r"^residual must be a floating",
    ),
    (
        "residual broadcast",
        lambda b: addnorm.add_layer_norm(X, X[0], 8, backend=b),
        ValueError,
        r"^residual must have the shape of x \(4, 8\), got \(8,\)",
    ),
    (
        "residual rows",
        lambda b: addnorm.add_rms_norm(X, X[:2], 8, backend=b),
        ValueError,
        r"^residual must have the shape of x",
    ),
    (
        "residual device",
        lambda b: addnorm.add_layer_norm(X, X.to(META), 8, backend=b),
        ValueError,
        r"^residual is on meta but x is on cpu",
    ),
    (
        "residual_dtype str",
        lambda b: addnorm.add_layer_norm(X, X, 8, residual_dtype="float32", backend=b),
        TypeError,
        r"^residual_dtype must be",
    ),
    (
        "residual_dtype int",
        lambda b: addnorm.add_rms_norm(X, X, 8, residual_dtype=torch.int32, backend=b),
        TypeError,
        r"^residual_dtype must be.*int32",
    ),
    (
        "residual_dtype float8",
        lambda b: addnorm.add_rms_norm(X, X, 8, residual_dtype=torch.float8_e5m2, backend=b),
        TypeError,
        r"^residual_dtype must be",
    ),
    (
        "prenorm str",
        lambda b: addnorm.add_layer_norm(X, X, 8, prenorm="no", backend=b),
        TypeError,
        r"^prenorm must be True or False",
    ),
    (
        "prenorm None",
        lambda b: addnorm.add_rms_norm(X, X, 8, prenorm=None, backend=b),
        TypeError,
        r"^prenorm must be True or False",
    ),
    # the same arguments where the stream starts in the call (residual=None) or with parallel blocks
    (
        "prenorm str, no residual",
        lambda b: addnorm.add_layer_norm(X, None, 8, prenorm="no", backend=b),
        TypeError,
        r"^prenorm must be True or False",
    ),
    (
        "prenorm str, x1",
        lambda b: addnorm.add_layer_norm(X, X, 8, x1=X, prenorm="no", backend=b),
        TypeError,
        r"^prenorm must be True or False",
    ),
    (
        "residual_dtype str, no residual",
        lambda b: addnorm.add_layer_norm(X, None, 8, residual_dtype="float32", prenorm=True, backend=b),
        TypeError,
        r"^residual_dtype must be",
    ),
    (
        "residual_dtype int, no residual",
        lambda b: addnorm.add_rms_norm(X, None, 8, residual_dtype=torch.int32, prenorm=True, backend=b),
        TypeError,
        r"^residual_dtype must be.*int32",
    ),
    (
        "generator str, x1",
        lambda b: addnorm.add_layer_norm(X, X, 8, x1=X, dropout_p=0.1, generator="g", backend=b),
        TypeError,
        r"^generator must be a torch.Generator",
    ),
    # addnorm.compat.flash_attn
    (
        "compat is_rms_norm str",
        lambda b: layer_norm_fn(X, W, None, is_rms_norm="no", backend=b),
        TypeError,
        r"^is_rms_norm must be True or False",
    ),
    (
        "compat residual_in_fp32 str",
        lambda b: layer_norm_fn(X, W, None, residual_in_fp32="no", backend=b),
        TypeError,
        r"^residual_in_fp32 must be True or False",
    ),
    (
        "compat out_dtype int",
        lambda b: layer_norm_fn(X, W, None, out_dtype=torch.int32, backend=b),
        TypeError,
        r"^out_dtype must be.*int32",
    ),
    (
        "compat out_dtype str",
        lambda b: rms_norm_fn(X, W, None, out_dtype="float16", backend=b),
        TypeError,
        r"^out_dtype must be",
    ),
    (
        "compat out with out_dtype",
        lambda b: layer_norm_fn(X, W, None, out_dtype=torch.float16, out=torch.empty(4, 8), backend=b),
        ValueError,
        r"^out= with out_dtype",
    ),
    (
        "compat x 0-d",
        lambda b: layer_norm_fn(torch.tensor(1.0), W, None, backend=b),
        ValueError,
        r"^x must have the hidden size as its last dim",
    ),
    (
        "compat rowscale rows",
        lambda b: layer_norm_fn(X, W, None, rowscale=torch.ones(3), backend=b),
        ValueError,
        r"^rowscale must have x's leading dims",
    ),
    (
        "compat residual int",
        lambda b: layer_norm_fn(X, W, None, residual=torch.ones(4, 8, dtype=torch.int64), backend=b),
        TypeError,
        r"^residual must be a floating-point tensor",
    ),
    (
        "compat x width",
        lambda b: rms_norm_fn(torch.randn(4, 9), W, None, backend=b),
        ValueError,
        r"^x's last dim must be the hidden size, weight's 8, got x of shape \(4, 9\)",
    ),
    (
        "compat mamba_ssm 1.x positional",
        lambda b: rms_norm_fn(X, W, None, None, True, backend=b),
        TypeError,
        r"^x1 must be a torch.Tensor or None, got bool: mamba_ssm 1.x's",
    ),
    (
        "compat linear_weight",
        lambda b: layer_norm_linear_fn(X, W, None, None, None, backend=b),
        TypeError,
        r"^linear_weight must be a torch.Tensor, got NoneType",
    ),
    (
        "compat linear_weight of another width",
        lambda b: layer_norm_linear_fn(X, W, None, torch.ones(3, 7), None, backend=b),
        ValueError,
        r"^linear_weight must be \(out_features, 8\), the hidden size of x last, got \(3, 7\)",
    ),
    (
        "compat linear_bias of another size",
        lambda b: layer_norm_linear_fn(X, W, None, torch.ones(3, 8), torch.ones(4), backend=b),
        ValueError,
        r"^linear_bias must be \(3,\), one per output feature, got \(4,\)",
    ),
    # backend (the fixture's backend is not used: these rows are about the name itself)
    ("backend unknown", lambda b: addnorm.layer_norm(X, 8, backend="cuda"), ValueError, r"^backend must be one of"),
    (
        "backend unknown, x1",
        lambda b: addnorm.add_layer_norm(X, X, 8, x1=X, backend="cpuu"),
        ValueError,
        r"^backend must be one of",
    ),
    (
        "backend int, weight1",
        lambda b: addnorm.add_rms_norm(X, X, 8, W, weight1=W, backend=3),
        TypeError,
        r"^backend must be a string",
    ),
    ("backend None", lambda b: addnorm.rms_norm(X, 8, backend=None), TypeError, r"^backend must be a string"),
    ("backend positional", lambda b: addnorm.layer_norm(X, 8, None, None, 1e-5, b), TypeError, r"positional"),
    # modules: constructor arguments, then forward inputs
    ("LayerNorm backend", lambda b: addnorm.LayerNorm(8, backend="gpu"), ValueError, r"^backend must be one of"),
    (
        "LayerNorm shape float",
        lambda b: addnorm.LayerNorm(8.0, backend=b),
        TypeError,
        r"^normalized_shape must be an int",
    ),
    (
        "RMSNorm shape zero",
        lambda b: addnorm.RMSNorm([8, 0], backend=b),
        ValueError,
        r"^normalized_shape must be one or",
    ),
    ("RMSNorm backend", lambda b: addnorm.RMSNorm(8, backend=1), TypeError, r"^backend must be a string"),
    ("AddNorm norm", lambda b: addnorm.AddNorm(8, norm="batch", backend=b), ValueError, r"^norm must be"),
    ("AddNorm prenorm", lambda b: addnorm.AddNorm(8, prenorm="yes", backend=b), TypeError, r"^prenorm must be"),
    (
        "AddNorm residual_dtype",
        lambda b: addnorm.AddNorm(8, residual_dtype="bf16", backend=b),
        TypeError,
        r"^residual_dtype must be",
    ),
    ("AddNorm backend", lambda b: addnorm.AddNorm(8, backend="nope"), ValueError, r"^backend must be one of"),
    (
        "LayerNorm x shape",
        lambda b: addnorm.LayerNorm(8, backend=b)(torch.randn(2, 7)),
        ValueError,
        r"^x of shape \(2, 7\) must end with normalized_shape \(8,\)",
    ),
    ("LayerNorm x numpy", lambda b: addnorm.LayerNorm(8, backend=b)(np.ones((2, 8))), TypeError, r"^x must be"),
    ("LayerNorm eps None", lambda b: addnorm.LayerNorm(8, eps=None, backend=b)(X), TypeError, r"^eps must be"),
    ("LayerNorm eps negative", lambda b: addnorm.LayerNorm(8, eps=-1.0, backend=b)(X), ValueError, r"^eps must"),
    (
        "LayerNorm x meta",
        lambda b: addnorm.LayerNorm(8, backend=b)(X.to(META)),
        ValueError,
        r"^weight is on cpu but x is on meta",
    ),
    ("RMSNorm x int", lambda b: addnorm.RMSNorm(8, backend=b)(X.int()), TypeError, r"^x must be a floating"),
    ("RMSNorm eps str", lambda b: addnorm.RMSNorm(8, eps="a", backend=b)(X), TypeError, r"^eps must be"),
    (
        "AddNorm residual shape",
        lambda b: addnorm.AddNorm(8, norm="rms", backend=b)(X, X[:, :4]),
        ValueError,
        r"^residual must have the shape of x",
    ),
    ("AddNorm x list", lambda b: addnorm.AddNorm(8, backend=b)(X.tolist(), X), TypeError, r"^x must be"),
    # patch / unpatch
    ("patch model", lambda b: addnorm.patch(X, backend=b), TypeError, r"^model must be a torch.nn.Module, got Tensor"),
    (
        "patch backend",
        lambda b: addnorm.patch(torch.nn.Linear(2, 2), backend="fast"),
        ValueError,
        r"^backend must be one of",
    ),
    (
        "patch fuse flag",
        lambda b: addnorm.patch(torch.nn.Linear(2, 2), fuse_residual="yes", backend=b),
        TypeError,
        r"^fuse_residual must be a bool",
    ),
    (
        "patch norm_types",
        lambda b: addnorm.patch(torch.nn.Linear(2, 2), norm_types=3, backend=b),
        TypeError,
        r"^norm_types must be",
    ),
    ("unpatch model", lambda b: addnorm.unpatch("model"), TypeError, r"^model must be a torch.nn.Module, got str"),
]


@pytest.mark.parametrize("call,error,match", [c[1:] for c in FUNCTION_CASES], ids=[c[0] for c in FUNCTION_CASES])
def test_bad_argument_names_it(backend, call, error, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the 1-feature warning of "x 0-d"
        with pytest.raises(error, match=match):
            call(backend)


def test_table_covers_every_public_name():
    """A new public function or module must get rows above."""
    covered = (
        " ".join(c[0] for c in FUNCTION_CASES)
        + " "
        + " ".join(c[1].__code__.co_names.__repr__() for c in FUNCTION_CASES)
    )
    for name in addnorm.__all__:
        assert name in covered, f"no bad-input row calls addnorm.{name}"


# --------------------------------------------------------------------------- CLI


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``addnorm ARGV`` in-process: (exit status, stdout, stderr); argparse's exits included."""
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # argparse reports bad usage by raising SystemExit(2)
        status = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return status, out, err


# (argv, regex the last stderr line must match). After a command lands, add its bad inputs here,
# e.g. ["explain", "--matrix", "[[1, 2], [3]]"] -> r"matrix".
CLI_CASES = [
    ([], None),  # no command: help, status 2
    (["frobnicate"], r"^addnorm: error: argument COMMAND: invalid choice: 'frobnicate'"),
    (["--no-such-option"], r"^addnorm: error: unrecognized arguments: --no-such-option"),
    # arguments no parser took: reported by the subcommand given them, pointing to its own help
    (["info", "extra"], r"^addnorm info: error: unrecognized arguments: extra \(see 'addnorm info --help'\)$"),
    (["info", "--threads", "2"], r"^addnorm info: error: unrecognized arguments: --threads 2"),
    (
        ["plot", "hist", "--bogus"],
        r"^addnorm plot hist: error: unrecognized arguments: --bogus \(see 'addnorm plot hist",
    ),
    (["explain", "--input", "[[1,2],[3]]"], r"^addnorm explain: error: --input: ragged rows"),
    (["explain", "--input", "[[1,a]]"], r"^addnorm explain: error: --input: non-numeric value 'a'"),
    (["explain", "--input", "missing.npy"], r"^addnorm explain: error: --input: file 'missing.npy' not found"),
    (
        ["explain", "--normalized-shape", "5"],
        r"^addnorm explain: error: --normalized-shape 5 must equal the trailing dims",
    ),
    (["explain", "--eps", "-1"], r"^addnorm explain: error: --eps must be a non-negative number"),
    (["plot", "bench", "--results", "missing.jsonl"], r"^addnorm plot: error: --results: 'missing.jsonl' not found"),
    (["plot", "hist", "--points", "0"], r"^addnorm plot: error: plot hist needs 1 to 8 --points"),
    (["train", "--epochs", "0"], r"^addnorm train: error: --epochs must be at least 1, got 0"),
    (["train", "--arms", "bogus"], r"^addnorm train: error: --arms: unknown arm\(s\) \['bogus'\]"),
    (["train", "--data", "missing.npy"], r"^addnorm train: error: --data missing.npy: no such file"),
]


@pytest.mark.parametrize("argv,match", CLI_CASES, ids=[" ".join(a) or "<none>" for a, _ in CLI_CASES])
def test_cli_bad_input_exit_2_one_line(argv, match, capsys):
    status, out, err = run_cli(argv, capsys)
    assert status == 2
    assert "Traceback" not in err + out
    if match is None:  # no command at all: the help on stdout
        assert "usage: addnorm" in out
    else:
        assert len(err.splitlines()) == 1 and re.match(match, err), err


def test_cli_usage_error_is_one_line(capsys, monkeypatch):
    """A command's UsageError is printed as one line naming the command, exit status 2."""

    def boom(args):
        raise cli.UsageError("bad --n: -1")

    def register(sub):
        sub.add_parser("boom").set_defaults(func=boom)

    monkeypatch.setattr(cli, "COMMAND_MODULES", [*cli.COMMAND_MODULES, "fake_command"])
    monkeypatch.setitem(sys.modules, "fake_command", type("M", (), {"register": register}))
    status, out, err = run_cli(["boom"], capsys)
    assert (status, out, err) == (2, "", "addnorm boom: error: bad --n: -1\n")


# Argument words a fuzzer combines: valid-looking and hostile pieces. Add a command's words here.
FUZZ_COMMANDS = ["info", "explain"]  # not train/bench: valid words would start real runs
WORDS = st.one_of(
    st.sampled_from(["--help", "-h", "--version", "--", "-", "--x=1", "[[1,2],[3,4]]", "nan", "1e999", "\x00"]),
    st.text(max_size=12),
)


@given(command=st.sampled_from(FUZZ_COMMANDS + ["", "bogus"]), words=st.lists(WORDS, max_size=4))
def test_cli_fuzz_never_tracebacks(command, words):
    argv = ([command] if command else []) + words
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli.main(argv)
        except SystemExit as exc:
            status = exc.code
    assert status in (0, 1, 2, None), (argv, status)
    assert "Traceback" not in out.getvalue() + err.getvalue()


@pytest.mark.parametrize(
    "call, warns",
    [
        (lambda x: addnorm.layer_norm(x[:, :2], 2), True),  # LayerNorm of 2 features: ±1
        (lambda x: addnorm.rms_norm(x[:, :2], 2), False),  # RMSNorm of 2 features: x / rms(x), informative
        (lambda x: addnorm.rms_norm(x[:, :1], 1), True),  # RMSNorm of 1 feature: ±1
        (lambda x: addnorm.LayerNorm(2)(x[:, :2]), True),  # through nn.Module.__call__
        (lambda x: layer_norm_fn(x[:, :2], torch.ones(2), None), True),  # the flash-attn layer
        (lambda x: addnorm.add_layer_norm(x[:, :2], x[:, 2:], 2, x1=x[:, :2]), True),  # parallel blocks
    ],
)
def test_too_few_features_are_warned_of_at_the_caller_s_line(call, warns):
    """Rows that normalize to ±1 whatever the input (LayerNorm over 2 features or fewer, RMSNorm
    over 1) are warned of, the warning attributed to the line that called addnorm."""
    x = torch.tensor([[3.0, 1.0, 0.5, -2.0]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call(x)
    narrow = [w for w in caught if "feature(s)" in str(w.message)]
    assert len(narrow) == warns
    assert all(w.filename == __file__ for w in narrow)  # (the lambda's line, in this file)
