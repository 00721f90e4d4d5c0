"""``addnorm explain --textbook``: :mod:`addnorm.textbook` (LayerNorm as a learner writes it)
beside :mod:`addnorm.reference` (the exact form every backend runs), on rows where the textbook
breaks, each with the step of the reference that prevents it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as TF
from torch import Tensor

from ... import reference, textbook
from ...kernels import torch as torch_kernels
from ..info import WORKED_INPUT
from .compute import maxdiff


@dataclass(frozen=True)
class TextbookRow:
    """A row where :mod:`addnorm.textbook` breaks: what it is, and the two lines that explain it
    (format strings over the measurements of :func:`textbook_comparison`)."""

    name: str
    values: list[float]
    dtype: torch.dtype
    wrong: str
    prevented: str


# Each built from the seeds' first row [0.2, 0.1, 0.3]; each breaks the textbook's LayerNorm.
TEXTBOOK_ROWS = [
    TextbookRow(
        "float32 row at a 1e6 offset (the seeds' row 0 + 1e6)",
        [1e6 + 0.2, 1e6 + 0.1, 1e6 + 0.3],
        torch.float32,
        "float32 mean {mean:.4f}, not {exact_mean:.4f}: every x − μ is shifted by {shift_sigma:+.2f}σ",
        "the mean correction (forward_rows) subtracts mean(x − μ), the first mean's rounding error",
    ),
    TextbookRow(
        "constant row (three features of 1e6 + 0.1)",
        [1e6 + 0.1] * 3,
        torch.float32,
        "float32 mean {mean:.4f}, not {exact_mean:.4f}: x − μ = {centered:g} ≫ √ε, so y = {y0:.4f}, not 0",
        "the mean correction makes x − μ exactly 0, and ε inside the square root keeps 0/√ε = 0",
    ),
    TextbookRow(
        "bfloat16 row near 1e20 (the seeds' row 0 × 1e21)",
        [2e20, 1e20, 3e20],
        torch.bfloat16,
        "(x − μ)² reaches {max_square:.2g} > {dtype_max:.3g}, bfloat16's max (float32's {float32_max:.3g}): var = "
        "inf, y = 0",
        "row_scale: the row is scaled by 2^-{scale_exponent} before squaring (float32 alone: off by "
        "{float32_error:.2g})",
    ),
    TextbookRow(
        "float16 row with one huge element (the seeds' row 0 and 1000)",
        [0.2, 0.1, 0.3, 1000.0],
        torch.float16,
        "(x − μ)² reaches {max_square:.3g} > {dtype_max:.5g}, float16's max: var = inf, 1/std = 0, y = 0",
        "statistics in float32 (stats_dtype; off by {float32_error:.1e}); row_scale (2^-{scale_exponent}) alone "
        "also does",
    ),
]


def _textbook_layer_norm(x: Tensor, eps: float) -> tuple[Tensor, tuple]:
    n = x.shape[-1]
    return textbook.layer_norm_forward(x, torch.ones(n, dtype=x.dtype), torch.zeros(n, dtype=x.dtype), eps)


def _exact(x: Tensor, eps: float, rms: bool = False) -> Tensor:
    return torch_kernels.forward(x, None, None, None, eps=eps, rms=rms, residual_dtype=None)[0]


def textbook_comparison(eps: float = 1e-5) -> dict:
    """:mod:`addnorm.textbook` beside :func:`addnorm.kernels.torch.forward` (γ = 1, β = 0), both
    against torch's LayerNorm in float64 (the oracle): on the seeds' worked example
    (``worked_example_error``), then on each of :data:`TEXTBOOK_ROWS` (``cases``).

    Per row: the input, the oracle, both forms' outputs and max errors, the same errors for
    RMSNorm (ε the dtype's machine epsilon, as torch), what the textbook computed on the way
    (its mean, its var from 1/std) and the two lines that explain it.
    """
    x = torch.tensor(WORKED_INPUT)
    oracle = TF.layer_norm(x.double(), x.shape[-1:], eps=eps)
    worked = {
        "textbook": maxdiff(_textbook_layer_norm(x, eps)[0], oracle),
        "reference": maxdiff(_exact(x, eps), oracle),
    }
    cases = []
    for row in TEXTBOOK_ROWS:
        x = torch.tensor([row.values], dtype=row.dtype)
        x64 = x.double()
        oracle = TF.layer_norm(x64, x.shape[-1:], eps=eps)
        tb_y, (_, _, tb_mean, tb_rstd) = _textbook_layer_norm(x, eps)
        ref_y = _exact(x, eps)
        rms_eps = torch.finfo(reference.stats_dtype(x.dtype)).eps
        rms_oracle = TF.rms_norm(x64, x.shape[-1:], eps=rms_eps)
        rms_tb = textbook.rms_norm_forward(x, torch.ones(x.shape[-1], dtype=x.dtype), rms_eps)[0]
        exact_mean, exact_var = x64.mean().item(), x64.var(correction=0).item()
        mean = tb_mean.double().item()
        measured = {
            "mean": mean,
            "exact_mean": exact_mean,
            "var": tb_rstd.double().item() ** -2 - eps if tb_rstd.item() != 0 else math.inf,
            "exact_var": exact_var,
            "shift_sigma": (exact_mean - mean) / math.sqrt(exact_var + eps),  # x − μ moves opposite to μ
            "float32_max": torch.finfo(torch.float32).max,
            "centered": (x[0, 0] - tb_mean[0, 0]).item(),
            "y0": tb_y[0, 0].item(),
            "max_square": ((x64 - exact_mean) ** 2).max().item(),
            "dtype_max": torch.finfo(x.dtype).max,
            "float32_error": maxdiff(_textbook_layer_norm(x.float(), eps)[0], oracle),
            "scale_exponent": round(-math.log2(reference.row_scale(x.float()).item())),
        }
        cases.append(
            {
                "name": row.name,
                "dtype": str(x.dtype).removeprefix("torch."),
                "x": x64[0],
                "oracle": oracle[0],
                "textbook": tb_y.double()[0],
                "reference": ref_y.double()[0],
                "textbook_error": maxdiff(tb_y, oracle),
                "reference_error": maxdiff(ref_y, oracle),
                "rms_textbook_error": maxdiff(rms_tb, rms_oracle),
                "rms_reference_error": maxdiff(_exact(x, rms_eps, rms=True), rms_oracle),
                "measured": measured,
                "wrong": row.wrong.format(**measured),
                "prevented": row.prevented.format(**measured),
            }
        )
    return {"eps": eps, "worked_example_error": worked, "cases": cases}
