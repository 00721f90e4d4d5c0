"""The textbook form (addnorm.textbook): right on ordinary rows, wrong on the rows of
`addnorm explain --textbook`, where the reference is right; and the step named for each row is
the one that prevents it. The oracle is torch's own op in float64 throughout."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as TF

from addnorm import reference, textbook
from addnorm.kernels import torch as torch_kernels
from addnorm.tools import cli
from addnorm.tools.explain import TEXTBOOK_ROWS
from conftest import TOLERANCES

EPS = 1e-5
ROWS = {row.name.split(" (")[0]: row for row in TEXTBOOK_ROWS}
OFFSET, CONSTANT, BF16_1E20, FP16_HUGE = ROWS


def row_input(name: str) -> torch.Tensor:
    row = ROWS[name]
    return torch.tensor([row.values], dtype=row.dtype)


def oracle(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    return TF.layer_norm(x.double(), x.shape[-1:], eps=eps)


def error(y: torch.Tensor, x: torch.Tensor, eps: float = EPS) -> float:
    return (y.double() - oracle(x, eps)).abs().max().item()


def textbook_y(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    n = x.shape[-1]
    return textbook.layer_norm_forward(x, torch.ones(n, dtype=x.dtype), torch.zeros(n, dtype=x.dtype), eps)[0]


def reference_y(x: torch.Tensor, rms: bool = False, eps: float = EPS) -> torch.Tensor:
    return torch_kernels.forward(x, None, None, None, eps=eps, rms=rms, residual_dtype=None)[0]


def right(y: torch.Tensor, x: torch.Tensor, eps: float = EPS) -> bool:
    rtol, atol = TOLERANCES[y.dtype]
    o = oracle(x, eps)
    return bool(((y.double() - o).abs() <= atol + rtol * o.abs()).all())


# --------------------------------------------------------------------------- ordinary rows


def test_seeds_worked_example_in_sbe_layout():
    """Seed 001: [B,S,E] = [1,2,3] reshaped to [S,B,E], normalized over the last two dims."""
    x = torch.tensor([[[0.2, 0.1, 0.3], [0.5, 0.1, 0.1]]]).reshape(2, 1, 3)
    y, (_, _, mean, rstd) = textbook.layer_norm_forward(x, torch.ones(1, 3), torch.zeros(1, 3))
    assert mean.shape == rstd.shape == (2, 1, 1)
    torch.testing.assert_close(mean.flatten(), torch.tensor([0.2, 0.2333]), atol=1e-4, rtol=0)
    torch.testing.assert_close((1 / rstd).flatten(), torch.tensor([0.0817, 0.1886]), atol=1e-4, rtol=0)
    seeds_y = torch.tensor([[[0.0, -1.2238, 1.2238]], [[1.4140, -0.7070, -0.7070]]])
    torch.testing.assert_close(y, seeds_y, atol=1e-4, rtol=0)


@pytest.mark.parametrize("normalized", [(8,), (3, 8)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_forward_and_hand_backward_match_torch_on_ordinary_rows(normalized, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, generator=g, dtype=dtype) * 2 + 0.5
    w, b = (torch.randn(normalized, generator=g, dtype=dtype) for _ in range(2))
    dy = torch.randn(x.shape, generator=g, dtype=dtype)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    y64 = TF.layer_norm(x64, normalized, w64, b64, eps=EPS)
    y64.backward(dy.double())
    y, cache = textbook.layer_norm_forward(x, w, b)
    dx, dw, db = textbook.layer_norm_backward(dy, cache)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {}
    for ours, theirs in ((y, y64), (dx, x64.grad), (dw, w64.grad), (db, b64.grad)):
        assert ours.shape == theirs.shape and ours.dtype == dtype
        torch.testing.assert_close(ours.double(), theirs.detach(), **tol)

    x64.grad = w64.grad = None
    r64 = TF.rms_norm(x64, normalized, w64, eps=1e-6)
    r64.backward(dy.double())
    r, cache = textbook.rms_norm_forward(x, w, 1e-6)
    dx, dw = textbook.rms_norm_backward(dy, cache)
    for ours, theirs in ((r, r64), (dx, x64.grad), (dw, w64.grad)):
        torch.testing.assert_close(ours.double(), theirs.detach(), **tol)


# --------------------------------------------------------------------------- the rows where it breaks


@pytest.mark.parametrize("name", ROWS)
def test_textbook_breaks_where_the_reference_does_not(name):
    x = row_input(name)
    assert error(textbook_y(x), x) > 0.25  # not rounding: a wrong answer (|y| is about 1)
    assert right(reference_y(x), x)


@pytest.mark.parametrize("name", ROWS)
def test_rmsnorm_textbook_breaks_only_where_a_square_overflows(name):
    x = row_input(name)
    eps = torch.finfo(torch.float32).eps
    o = TF.rms_norm(x.double(), x.shape[-1:], eps=eps)
    tb_err = (textbook.rms_norm_forward(x, torch.ones(x.shape[-1], dtype=x.dtype), eps)[0].double() - o).abs().max()
    ref_err = (reference_y(x, rms=True, eps=eps).double() - o).abs().max()
    rtol, atol = TOLERANCES[x.dtype]
    assert ref_err <= atol + rtol
    overflows = (x.double() ** 2).max() > torch.finfo(x.dtype).max
    assert overflows == (name in (BF16_1E20, FP16_HUGE))
    assert (tb_err > 1.0) if overflows else (tb_err <= atol + rtol)


def test_offset_and_constant_rows_are_the_mean_rounding_and_the_correction_fixes_them():
    for name in (OFFSET, CONSTANT):
        x = row_input(name)
        mean = x.mean(dim=-1, keepdim=True)
        assert mean.item() != x.double().mean().item()  # the float32 mean itself is off
        centered = x - mean  # exact here (Sterbenz): the error is all in the mean
        centered = centered - centered.mean(dim=-1, keepdim=True)  # the reference's correction
        y = centered * (centered.pow(2).mean(dim=-1, keepdim=True) + EPS) ** -0.5
        assert right(y, x), name
    y = reference_y(row_input(CONSTANT))
    assert bool((y == 0).all())


def test_bf16_row_needs_row_scale_not_only_float32(monkeypatch):
    x = row_input(BF16_1E20)
    assert not right(textbook_y(x.float()).bfloat16(), x)  # float32 has bfloat16's range
    k = reference.row_scale(x.float())
    assert right(textbook_y(x.float() * k, EPS * k.item() ** 2).bfloat16(), x)  # the textbook, scaled first
    monkeypatch.setattr(reference, "row_scale", lambda sf: torch.ones(sf.shape[0], 1, dtype=sf.dtype))
    assert not right(reference_y(x), x)


def test_fp16_huge_element_needs_float32_statistics_or_row_scale(monkeypatch):
    x = row_input(FP16_HUGE)
    assert right(textbook_y(x.float()).half(), x)
    monkeypatch.setattr(reference, "stats_dtype", lambda dtype: dtype)  # statistics in float16
    assert right(reference_y(x), x)  # row_scale alone keeps it finite
    monkeypatch.setattr(reference, "row_scale", lambda sf: torch.ones(sf.shape[0], 1, dtype=sf.dtype))
    assert not right(reference_y(x), x)  # without both, the reference breaks as the textbook does


# --------------------------------------------------------------------------- addnorm explain --textbook


def test_explain_textbook_json_numbers(capsys):
    assert cli.main(["explain", "--textbook", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in doc["cases"]] == [row.name for row in TEXTBOOK_ROWS]
    assert max(doc["worked_example_error"].values()) < 1e-6
    for case, row in zip(doc["cases"], TEXTBOOK_ROWS):
        x = torch.tensor([row.values], dtype=row.dtype)
        o = oracle(x)
        assert case["x"] == x.double()[0].tolist()
        torch.testing.assert_close(torch.tensor(case["oracle"], dtype=torch.float64), o[0], rtol=0, atol=1e-12)
        assert case["textbook_error"] > 0.25 and case["reference_error"] < 4e-3
        assert math.isclose(case["textbook_error"], error(torch.tensor(case["textbook"]), x), abs_tol=1e-6)
        m = case["measured"]
        assert m["mean"] == x.mean().double().item()
        assert math.isclose(m["exact_mean"], x.double().mean().item(), rel_tol=1e-15)
        assert m["dtype_max"] == torch.finfo(row.dtype).max
    offset, constant, bf16, fp16 = (c["measured"] for c in doc["cases"])
    # 1e6 + 0.2, 0.1, 0.3 in float32 are 1000000.1875, .125, .3125: exact mean 1000000.2083...
    assert offset["mean"] == 1000000.1875 and abs(offset["shift_sigma"] - 0.267) < 1e-3  # x − μ too high: μ too low
    assert constant["centered"] == -0.0625 and abs(constant["y0"] + 0.9987) < 1e-4
    assert bf16["max_square"] > 1e40 and bf16["var"] is None and bf16["float32_error"] > 1  # inf is null in JSON
    assert fp16["max_square"] == pytest.approx(749.85**2, rel=1e-3) and fp16["float32_error"] < 1e-6


def test_explain_textbook_tables_and_lines(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one line per sentence
    assert cli.main(["explain", "--textbook"]) == 0
    out = capsys.readouterr().out
    for text in [
        "1. float32 row at a 1e6 offset",
        "1000000.1875, 1000000.125, 1000000.3125",
        "float32 mean 1000000.1875, not 1000000.2083: every x − μ is shifted by +0.27σ",
        "subtracts mean(x − μ)",
        "y = -0.9987, not 0",
        "> 3.39e+38, bfloat16's max (float32's 3.4e+38)",
        "row_scale: the row is scaled by 2^-69",
        "65504, float16's max",
        "statistics in float32 (stats_dtype",
    ]:
        assert text in out, text


@pytest.mark.parametrize("extra", [["--input", "[[1,2,3]]"], ["--backward"], ["--norm", "rms"], ["--eps", "0"]])
def test_explain_textbook_rejects_options_it_does_not_take(capsys, extra):
    assert cli.main(["explain", "--textbook", *extra]) == 2
    err = capsys.readouterr().err
    assert "--textbook runs its own rows; drop" in err and extra[0] in err and "Traceback" not in err
