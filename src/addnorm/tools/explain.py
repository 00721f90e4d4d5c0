"""``addnorm explain``: LayerNorm, RMSNorm or Add & Norm step by step, for learners.

Every intermediate is computed in float64 by :func:`addnorm.reference.forward_steps`
(and :func:`~addnorm.reference.backward_steps` for ``--backward``), the same formulas the
library runs, and is printed with its shape. addnorm's own op (in the input's dtype) and
torch's are then run on the same input, and their difference from the steps is shown.
``--compare batchnorm`` puts BatchNorm beside LayerNorm on the same rows.
``--textbook`` puts the textbook form (:mod:`addnorm.textbook`) beside the exact one on rows
where the textbook breaks, and names the step of the reference that prevents each.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as TF
from torch import Tensor

from .. import backend, functional, ops, reference
from ..backend import Branch
from ..kernels import torch as torch_kernels
from .cli import UsageError
from .info import WORKED_INPUT

MATRIX_HELP = 'a matrix literal like "[[0.2,0.1,0.3],[0.5,0.1,0.1]]" or a .npy, .pt or .csv file'
PARAM_HELP = "one number, or one per feature like 1.5,-0.5,2"
FILE_SUFFIXES = (".npy", ".pt", ".pth", ".csv")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what addnorm's ops take
_TOKEN = re.compile(r"\s*(?:([\[\],])|([^\s\[\],]+))")


# --------------------------------------------------------------------------- parsing user input


def parse_literal(text: str, what: str, expected: str = MATRIX_HELP) -> float | list:
    """Parse a number or nested list of numbers (``[[1, 2], [3, 4]]``) without ``eval``;
    ``expected`` says what ``what`` takes, in the error messages."""
    tokens = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    if not tokens:
        raise UsageError(f"{what} is empty; expected {expected}")

    def value(i: int) -> tuple[float | list, int]:
        tok = tokens[i] if i < len(tokens) else None
        if tok == "[":
            items: list = []
            i += 1
            while i < len(tokens) and tokens[i] != "]":
                item, i = value(i)
                items.append(item)
                if i < len(tokens) and tokens[i] == ",":
                    i += 1
                elif i < len(tokens) and tokens[i] != "]":
                    raise UsageError(f"{what}: expected ',' or ']' before {tokens[i]!r}")
            if i >= len(tokens):
                raise UsageError(f"{what}: unbalanced brackets, a ']' is missing")
            return items, i + 1
        if tok is None or tok in "],":
            raise UsageError(f"{what}: expected a number or '[' but found {tok or 'the end'!r}")
        try:
            number = float(tok)
        except ValueError:
            raise UsageError(f"{what}: non-numeric value {tok!r}; expected {expected}") from None
        if not math.isfinite(number):
            raise UsageError(f"{what}: {tok!r} is not a finite number")
        return number, i + 1

    try:
        result, end = value(0)
    except RecursionError:
        raise UsageError(f"{what}: nested too deeply") from None
    if end != len(tokens):
        raise UsageError(f"{what}: unexpected {tokens[end]!r} after the end of the matrix")
    return result


def _shape_of(value: float | list, what: str, path: str = "") -> tuple[int, ...]:
    """The rectangular shape of a nested list, or a clear error naming the ragged row."""
    if not isinstance(value, list):
        return ()
    if not value:
        raise UsageError(f"{what}: empty list {path or 'at the top'}")
    shapes = [_shape_of(v, what, f"{path}[{i}]") for i, v in enumerate(value)]

    def describe(sh: tuple[int, ...]) -> str:
        return "a single number" if not sh else f"{sh[0]} values" if len(sh) == 1 else f"shape {list(sh)}"

    for i, sh in enumerate(shapes):
        if sh != shapes[0]:
            raise UsageError(
                f"{what}: ragged rows: {path}[{i}] has {describe(sh)} but {path}[0] has {describe(shapes[0])}"
            )
    return (len(value), *shapes[0])


def literal_tensor(text: str, what: str) -> Tensor:
    """A matrix literal as float64: Python's own parsing of each number, so ``0.1`` stays 0.1
    and ``1e300`` or ``1e-300`` keep their value."""
    value = parse_literal(text, what)
    _shape_of(value, what)
    return torch.tensor(value, dtype=torch.float64)


def load_matrix(text: str, what: str) -> Tensor:
    """A tensor from a matrix literal (float64) or a ``.npy``/``.pt``/``.csv`` file (a floating
    dtype is kept, integers become float64)."""
    stripped = text.strip()
    if stripped.startswith("[") or _is_number(stripped):
        t = literal_tensor(stripped, what)
    elif stripped.lower().endswith(FILE_SUFFIXES):
        t = _load_file(Path(stripped), what)
    else:
        raise UsageError(f"{what} must be {MATRIX_HELP}, got {text!r}")
    if t.dim() == 0:
        raise UsageError(f"{what} must have at least one dimension (a row of features), got a scalar")
    if t.numel() == 0:
        raise UsageError(f"{what} is empty (shape {tuple(t.shape)})")
    if t.dtype not in FLOAT_DTYPES and (t.is_floating_point() or t.is_complex() or t.is_quantized):
        raise UsageError(
            f"{what} is {str(t.dtype).removeprefix('torch.')}; expected real numbers "
            f"({', '.join(str(d).removeprefix('torch.') for d in FLOAT_DTYPES)} or integers)"
        )
    if not t.is_floating_point():
        t = t.to(torch.float64)
    if not bool(torch.isfinite(t).all()):
        raise UsageError(f"{what} contains NaN or infinite values")
    return t


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _load_file(path: Path, what: str) -> Tensor:
    if not path.is_file():
        raise UsageError(f"{what}: file {str(path)!r} not found")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            import numpy as np

            return torch.from_numpy(np.load(path, allow_pickle=False))
        if suffix == ".csv":
            import numpy as np

            return torch.from_numpy(np.loadtxt(path, delimiter=",", ndmin=2, dtype="float64"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "sparse/nested tensors are in beta": rejected below anyway
            t = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # any reader's complaint becomes one line
        raise UsageError(f"{what}: cannot read {str(path)!r}: {str(err).splitlines()[0]}") from None
    if not isinstance(t, Tensor):
        raise UsageError(f"{what}: {str(path)!r} holds a {type(t).__name__}, expected one tensor")
    if t.is_nested or t.layout != torch.strided:
        kind = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        hint = "" if t.is_nested else " (save t.to_dense())"
        raise UsageError(f"{what}: {str(path)!r} holds a {kind} tensor; expected a dense one{hint}")
    return t.detach()


def parse_shape(text: str) -> tuple[int, ...]:
    """``"1,3"`` (or ``"[1,3]"``, ``"3"``) -> ``(1, 3)``."""
    parts = [p for p in re.split(r"[\s,x×]+", text.strip().strip("[]()")) if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or min(shape) <= 0:
        raise UsageError(f"--normalized-shape must be positive ints like 3 or 1,3; got {text!r}")
    return shape


def parse_param(text: str | None, shape: tuple[int, ...], what: str, default: float) -> Tensor:
    """``--gamma``/``--beta``: a scalar (every feature) or one value per feature, as float64."""
    n = math.prod(shape)
    if text is None:
        return torch.full(shape, float(default), dtype=torch.float64)
    stripped = text.strip()
    if not stripped.startswith("[") and "," in stripped:
        stripped = f"[{stripped}]"
    value = parse_literal(stripped, what, PARAM_HELP)
    _shape_of(value, what)
    t = torch.tensor(value, dtype=torch.float64)
    if t.dim() == 0:
        return t.expand(shape).clone()
    if t.numel() != n:
        raise UsageError(f"{what} needs 1 or {n} values (normalized shape {list(shape)}), got {t.numel()}")
    return t.reshape(shape)


# --------------------------------------------------------------------------- the computation


def _rows(t: Tensor, n: int) -> Tensor:
    return t.reshape(-1, n).to(torch.float64)


def _maxdiff(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def explain(
    x: Tensor,
    normalized_shape: tuple[int, ...],
    *,
    eps: float,
    gamma: Tensor,
    beta: Tensor | None,
    rms: bool = False,
    residual: Tensor | None = None,
    grad: Tensor | None = None,
    backward: bool = False,
    dropout: float = 0.0,
    seed: int = 0,
) -> dict:
    """Every step of the norm of ``x`` over its trailing ``normalized_shape`` dims, as tensors.

    Values are (rows, features) float64 tensors, per-row statistics are ``(rows,)``. With
    ``dropout`` (and a residual), the sublayer output ``x`` is dropped before the add, with the
    keep mask addnorm's op draws from a generator seeded ``seed``.
    """
    n = math.prod(normalized_shape)
    x2 = _rows(x, n)
    r2 = _rows(residual, n) if residual is not None else None
    w = gamma.reshape(n)
    b = beta.reshape(n) if beta is not None else None
    branch = None
    if dropout:  # the seed the op below draws from torch.Generator().manual_seed(seed)
        branch = Branch(dropout, ops.draw_seed(torch.Generator().manual_seed(seed), x2.device), None, None)
    st = reference.forward_steps(x2, r2, w, b, eps, rms, None, branch)
    bare = reference.forward_steps(st["s"], None, None, None, 0.0, rms, None)
    out = {
        "x": x2,
        "residual": r2,
        "s": st["s"],
        "mean": st["mean"],
        "var": st["var"],
        "std": torch.sqrt(st["var"] + eps),
        "rstd": st["rstd"],
        "xhat": st["xhat"],
        "gamma": w,
        "beta": b,
        "y": st["y"],
        "std_no_eps": torch.sqrt(bare["var"]),
        "xhat_no_eps": bare["xhat"],
        "dropout": dropout,
    }
    if branch is not None:
        terms = reference.branch_terms(x2, branch, torch.arange(x2.shape[0]))
        out["keep"], out["dropped"] = terms["keep"], x2 * terms["gate"]
    out["check_mean"] = st["xhat"].mean(dim=-1)
    xh = st["xhat"]
    out["check_std"] = (xh * xh).mean(dim=-1).sqrt() if rms else xh.std(dim=-1, correction=0)

    # addnorm's op in the input's dtype, and torch's own op in float64, on the same input.
    dt = x.dtype
    xt = x.detach().clone().requires_grad_(backward)
    rt = residual.to(dt).detach().clone().requires_grad_(backward) if residual is not None else None
    wt = gamma.to(dt).detach().clone().requires_grad_(backward)  # a copy even when dt is already float64
    bt = beta.to(dt).detach().clone().requires_grad_(backward) if beta is not None else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if rt is None:
            y_op = (
                functional.rms_norm(xt, normalized_shape, wt, eps)
                if rms
                else functional.layer_norm(xt, normalized_shape, wt, bt, eps)
            )
        else:
            drop = dict(dropout_p=dropout, generator=torch.Generator().manual_seed(seed)) if dropout else {}
            y_op = (
                functional.add_rms_norm(xt, rt, normalized_shape, wt, eps, **drop)
                if rms
                else functional.add_layer_norm(xt, rt, normalized_shape, wt, bt, eps, **drop)
            )
    out["warnings"] = [str(c.message) for c in caught]
    s64 = st["s"].reshape(x.shape).clone().requires_grad_(backward)
    w64 = gamma.clone().requires_grad_(backward)
    b64 = beta.clone().requires_grad_(backward) if beta is not None else None
    y_torch = (
        TF.rms_norm(s64, normalized_shape, w64, eps) if rms else TF.layer_norm(s64, normalized_shape, w64, b64, eps)
    )
    out["op_name"] = (
        f"addnorm.{'add_' if residual is not None else ''}{'rms' if rms else 'layer'}_norm"
        f" ({str(dt).removeprefix('torch.')}, backend auto: {backend.auto_name(x2)})"
    )
    out["torch_name"] = f"torch.nn.functional.{'rms' if rms else 'layer'}_norm (float64)"
    out["op_maxdiff"] = _maxdiff(y_op.reshape(-1, n), st["y"])
    out["torch_maxdiff"] = _maxdiff(y_torch.reshape(-1, n), st["y"])

    if backward:
        dy = _rows(grad, n) if grad is not None else torch.ones_like(x2)
        bs = reference.backward_steps(dy, None, st["s"], w, st["mean"], st["rstd"], rms=rms, has_bias=beta is not None)
        out["backward"] = dict(bs, dy=dy)
        y_torch.backward(dy.reshape(x.shape))
        y_op.backward(dy.reshape(x.shape).to(dt))
        auto = {
            "ds": s64.grad.reshape(-1, n),
            "dweight": w64.grad.reshape(n),
            "dbias": b64.grad.reshape(n) if b64 is not None else None,
        }
        out["backward"]["autograd"] = auto
        out["backward"]["autograd_maxdiff"] = {k: _maxdiff(v, bs[k]) for k, v in auto.items() if v is not None}
        op_grads = {
            "ds": (rt if rt is not None else xt).grad.reshape(-1, n),  # x's is ds only without dropout
            "dweight": wt.grad.reshape(n),
            "dbias": bt.grad.reshape(n) if bt is not None else None,
        }
        out["backward"]["op_maxdiff"] = {k: _maxdiff(v, bs[k]) for k, v in op_grads.items() if v is not None}
    return out


def _random_rows(like: Tensor, rows: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = like.std().item() if like.numel() > 1 else 1.0
    return torch.randn(rows, like.shape[1], generator=g, dtype=like.dtype) * (scale or 1.0) + like.mean()


def compare_batchnorm(x2: Tensor, eps: float) -> dict:
    """BatchNorm (per feature over the rows) beside LayerNorm (per row over the features).

    Row 0 is normalized inside batches that differ in their other rows or their size: its
    LayerNorm output never changes, its BatchNorm output does. Then train vs eval mode.
    """
    from ..nn import LayerNorm

    m, n = x2.shape
    ln = LayerNorm(n, eps=eps, dtype=torch.float64)
    bn = torch.nn.BatchNorm1d(n, eps=eps, dtype=torch.float64)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # few features: explain() reports it once
        ln_y, bn_y = ln(x2), bn(x2)  # bn is in training mode: batch statistics
        bn_mean, bn_var = x2.mean(dim=0), x2.var(dim=0, correction=0)
        variants = [("as given", x2)]
        if m > 1:
            variants.append(("other rows redrawn (seed 0)", torch.cat([x2[:1], _random_rows(x2, m - 1, 0)])))
        variants.append(("batch of 1: row 0 alone", x2[:1]))
        variants.append((f"batch of {m + 4}: 4 random rows added", torch.cat([x2, _random_rows(x2, 4, 1)])))
        rows = []
        for label, batch in variants:
            fresh = torch.nn.BatchNorm1d(n, eps=eps, dtype=torch.float64)
            try:
                bn_row0 = fresh(batch)[0]
                bn_error = None
            except ValueError as err:  # BatchNorm cannot normalize one value per feature
                bn_row0, bn_error = None, str(err)
            ln_row0 = ln(batch)[0]
            rows.append(
                {
                    "batch": label,
                    "batch_size": batch.shape[0],
                    "layernorm_row0": ln_row0,
                    "layernorm_change": _maxdiff(ln_row0, ln_y[0]),
                    "batchnorm_row0": bn_row0,
                    "batchnorm_error": bn_error,
                    "batchnorm_change": None if bn_row0 is None else _maxdiff(bn_row0, bn_y[0]),
                }
            )
        ln.eval()
        bn.eval()
        ln_eval, bn_eval = ln(x2), bn(x2)
    return {
        "x": x2,
        "layernorm": ln_y,
        "batchnorm": bn_y,
        "batch_mean": bn_mean,
        "batch_var": bn_var,
        "row0": rows,
        "layernorm_buffers": [name for name, _ in ln.named_buffers()],
        "batchnorm_buffers": {name: b for name, b in bn.named_buffers() if b.is_floating_point()},
        "batchnorm_momentum": bn.momentum,
        "layernorm_eval": ln_eval,
        "batchnorm_eval": bn_eval,
        "layernorm_train_eval_diff": _maxdiff(ln_eval, ln_y),
        "batchnorm_train_eval_diff": _maxdiff(bn_eval, bn_y),
    }


# --------------------------------------------------------------------------- JSON


MAX_JSON_NUMBERS = 1_000_000  # ~20 MB of JSON; explain is for examples a reader can follow


def _count_numbers(value) -> int:
    if isinstance(value, Tensor):
        return value.numel()
    if isinstance(value, dict):
        return sum(_count_numbers(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_count_numbers(v) for v in value)
    return 1


def _plain(value):
    """Tensors -> nested lists; NaN/inf -> None, so that the JSON is strict."""
    if isinstance(value, Tensor):
        value = value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# --------------------------------------------------------------------------- rich output


class _Printer:
    def __init__(self, precision: int, lead_shape: tuple[int, ...], normalized_shape: tuple[int, ...]):
        from rich.console import Console

        self.console = Console(highlight=False, markup=False)  # "[nan, ...]" is data
        self.p = precision
        self.row_labels = [_index_label(i, lead_shape) for i in range(math.prod(lead_shape))]
        self.col_labels = [_index_label(j, normalized_shape) for j in range(math.prod(normalized_shape))]

    def num(self, v: float) -> str:
        if math.isnan(v):
            return "nan"
        if abs(v) >= 1e6 and math.isfinite(v):  # 1e300 as 1.0000e+300, not 301 digits
            return f"{v:.{self.p}e}"
        text = f"{v:.{self.p}f}"
        return text[1:] if text.startswith("-") and not text.strip("-0.") else text  # no "-0.0000"

    def title(self, text: str) -> None:
        from rich.text import Text

        self.console.print(Text(text, style="bold"))

    def matrix(
        self,
        title: str,
        t: Tensor,
        shape: tuple[int, ...],
        caption: str | None = None,
        row_labels: list[str] | None = None,
        first: str = "row",
    ) -> None:
        from rich.table import Table

        self.title(f"{title}   shape {_shape_str(shape)}")
        table = Table(caption=caption)
        table.add_column(first)
        # each column takes about precision + 7 characters (sign, digits, padding, border)
        fit = max(4, (self.console.width - 8) // (self.p + 7))
        cols = _shown(t.shape[1], min(MAX_COLUMNS, fit))
        for j in cols:
            table.add_column("…" if j is None else self.col_labels[j], justify="right")
        labels = row_labels or self.row_labels
        values = t.tolist()
        for i in _shown(len(values), MAX_ROWS):
            if i is None:
                table.add_row("…", *("…" for _ in cols))
            else:
                table.add_row(labels[i], *("…" if j is None else self.num(values[i][j]) for j in cols))
        self.console.print(table)

    def columns(
        self,
        title: str,
        columns: dict[str, Tensor | list],
        caption: str | None = None,
        labels: list[str] | None = None,
        first: str = "row",
    ) -> None:
        from rich.table import Table

        self.title(title)
        table = Table(caption=caption)
        table.add_column(first)
        for name in columns:
            table.add_column(name, justify="right")
        values = [c.tolist() if isinstance(c, Tensor) else c for c in columns.values()]
        labels = labels or self.row_labels
        for i in _shown(len(labels), MAX_ROWS):
            if i is None:
                table.add_row("…", *("…" for _ in values))
            else:
                table.add_row(labels[i], *(v[i] if isinstance(v[i], str) else self.num(v[i]) for v in values))
        self.console.print(table)


# Wider or longer tensors are shown with their middle elided ("…"); --json has every value.
MAX_COLUMNS, MAX_ROWS, MAX_VECTOR = 12, 24, 6


def _shown(count: int, limit: int) -> list[int | None]:
    """The indices to print: all of them, or the first ones, None (for "…"), the last two."""
    if count <= limit:
        return list(range(count))
    return [*range(limit - 3), None, count - 2, count - 1]


def _vec(t: Tensor, pr: _Printer) -> str:
    values = t.tolist()
    shown = _shown(len(values), MAX_VECTOR)
    return "[" + ", ".join("…" if j is None else pr.num(values[j]) for j in shown) + "]"


def _index_label(i: int, shape: tuple[int, ...]) -> str:
    idx = []
    for d in reversed(shape):
        idx.append(i % d)
        i //= d
    if not shape:  # a 1-D input is a single row
        return "0"
    return ",".join(str(k) for k in reversed(idx)) if len(shape) != 1 else str(idx[0])


def _shape_str(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _print_explanation(
    r: dict, shape: tuple[int, ...], normalized_shape: tuple[int, ...], eps: float, rms: bool, pr: _Printer
) -> None:
    k = len(normalized_shape)
    lead = shape[:-k]
    stat_shape = (*lead, *(1,) * k)
    c = pr.console
    name = "RMSNorm" if rms else "LayerNorm"
    pr.matrix("input x", r["x"], shape)
    dims = ", ".join(str(d) for d in range(len(shape) - k, len(shape)))
    m, n = r["x"].shape
    c.print(
        f"{name} over the last {k} dim(s) (dim {dims}), normalized_shape "
        f"{list(normalized_shape)}, eps = {eps:g}:\n"
        f"{m} row(s) of {n} features, one set of statistics per row\n"
    )
    if r["residual"] is not None:
        pr.matrix("residual (the sublayer's input, carried around it)", r["residual"], shape)
        if r["dropout"]:
            p = r["dropout"]
            pr.matrix(
                f"Dropout keep mask (1 kept, 0 dropped; p = {p:g}): a hash of (seed, row, column)",
                r["keep"].double(),
                shape,
            )
            pr.matrix(f"dropout(x) = kept x / (1 − p) = x × {1 / (1 - p):.4g}, else 0", r["dropped"], shape)
            pr.matrix("Add: s = residual + dropout(x)  (the norm sees s)", r["s"], shape)
        else:
            pr.matrix("Add: s = x + residual  (the norm sees s)", r["s"], shape)
    src = "s" if r["residual"] is not None else "x"
    if rms:
        stats = {
            f"mean square mean({src}²) {_shape_str(stat_shape)}": r["var"],
            f"rms √(mean({src}²)+ε) {_shape_str(stat_shape)}": r["std"],
        }
        formula = f"x̂ = {src} / rms   (RMSNorm does not subtract the mean)"
    else:
        stats = {
            f"mean μ {_shape_str(stat_shape)}": r["mean"],
            f"variance σ² (biased, ÷N) {_shape_str(stat_shape)}": r["var"],
            f"std √(σ²+ε) {_shape_str(stat_shape)}": r["std"],
        }
        formula = f"x̂ = ({src} − μ) / √(σ²+ε)"
    pr.columns("per-row statistics", stats)
    pr.matrix("normalized " + formula, r["xhat"], shape)
    params = [r["gamma"]] + ([r["beta"]] if r["beta"] is not None else [])
    pr.matrix("γ (weight) and β (bias)", torch.stack(params), normalized_shape, row_labels=["γ", "β"], first="")
    pr.matrix("output y = γ·x̂" + (" + β" if r["beta"] is not None else ""), r["y"], shape)

    mean_txt = ", ".join(pr.num(v) for v in r["check_mean"].tolist())
    std_txt = ", ".join(pr.num(v) for v in r["check_std"].tolist())
    if rms:
        c.print(
            f"check: each row of x̂ has root-mean-square [{std_txt}] ≈ 1\n"
            f"       (its mean [{mean_txt}] is not forced to 0)"
        )
    else:
        affine = bool((r["gamma"] == 1).all()) and bool((r["beta"] == 0).all())
        c.print(
            f"check: each row of x̂ has mean [{mean_txt}] = 0 and std [{std_txt}] ≈ 1\n"
            f"       (std is just under 1 because of ε: √(σ²/(σ²+ε)))"
            + ("; γ = 1 and β = 0, so y = x̂" if affine else "")
        )

    pr.columns(
        f"ε effect: by hand one divides by {'rms' if rms else 'σ'} (ε = 0); torch and addnorm "
        f"by √({'mean square' if rms else 'σ²'}+ε)",
        {
            f"{'rms' if rms else 'σ'} (ε = 0)": r["std_no_eps"],
            "√(·+ε)": r["std"],
            "x̂ without ε": [_vec(v, pr) for v in r["xhat_no_eps"]],
            "x̂ with ε": [_vec(v, pr) for v in r["xhat"]],
        },
    )
    i = int(r["var"].argmin())  # ε matters most where the variance is smallest
    j = int(r["xhat_no_eps"][i].abs().nan_to_num(-1.0).argmax())
    c.print(
        f"row {pr.row_labels[i]}, feature {pr.col_labels[j]}: {pr.num(r['xhat_no_eps'][i, j].item())} "
        f"without ε vs {pr.num(r['xhat'][i, j].item())} with ε = {eps:g}.\n"
        f"ε matters most where the variance is small (row {pr.row_labels[i]}: "
        f"{r['var'][i].item():.3g}); it keeps a constant row finite."
    )
    for msg in r["warnings"]:
        c.print(f"note: {msg}", style="yellow")
    c.print(
        f"\nagreement with these float64 steps, max |difference| of y:\n"
        f"  {r['op_name']}: {r['op_maxdiff']:.1e}\n  {r['torch_name']}: {r['torch_maxdiff']:.1e}"
    )


def _print_backward(
    r: dict, shape: tuple[int, ...], normalized_shape: tuple[int, ...], rms: bool, given: bool, pr: _Printer
) -> None:
    bw = r["backward"]
    c = pr.console
    stat = _shape_str(shape[: len(shape) - len(normalized_shape)])
    c.rule("backward: the hand-derived gradient (addnorm.reference.backward)")
    pr.matrix("upstream gradient dy" + ("" if given else " (all ones; pass --grad for another)"), bw["dy"], shape)
    pr.matrix("g = dy·γ", bw["g"], shape)
    cols = {}
    if not rms:
        cols[f"mean(g) {stat}"] = bw["mean_g"]
    cols[f"mean(g·x̂) {stat}"] = bw["mean_gxhat"]
    cols["1/std = rstd"] = r["rstd"]
    pr.columns("per-row sums", cols)
    target = "s (= d x = d residual)" if r["residual"] is not None else "x"
    formula = "rstd·(g − x̂·mean(g·x̂))" if rms else "rstd·(g − mean(g) − x̂·mean(g·x̂))"
    pr.matrix(f"d{target} = {formula}", bw["ds"], shape)
    pr.matrix("torch autograd's dx (float64), for comparison", bw["autograd"]["ds"], shape)
    params = {"dγ = Σ_rows dy·x̂": bw["dweight"].tolist(), "autograd dγ": bw["autograd"]["dweight"].tolist()}
    if bw["dbias"] is not None:
        params |= {"dβ = Σ_rows dy": bw["dbias"].tolist(), "autograd dβ": bw["autograd"]["dbias"].tolist()}
    pr.columns("parameter gradients, per feature", params, labels=pr.col_labels, first="feature")
    names = {"ds": "dx", "dweight": "dγ", "dbias": "dβ"}
    diffs = ", ".join(f"{names[k]} {v:.1e}" for k, v in bw["autograd_maxdiff"].items())
    op = ", ".join(f"{names[k]} {v:.1e}" for k, v in bw["op_maxdiff"].items())
    c.print(f"max |hand − autograd| (float64): {diffs}\naddnorm's op through autograd, {r['op_name']}:\n  {op}")
    if not given and not rms and bool((r["gamma"] == r["gamma"][0]).all()):
        c.print(
            "note: with dy = 1 and a constant γ, Σ y = N·mean(β) whatever x is,\n"
            "      so dx = 0 up to rounding; pass --grad to see a non-trivial gradient"
        )


def _print_compare(cmp: dict, eps: float, pr: _Printer) -> None:
    c = pr.console
    m, n = cmp["x"].shape
    rows = [str(i) for i in range(m)]
    c.rule("LayerNorm vs BatchNorm on the same rows")
    c.print(
        f"LayerNorm: per row, over its {n} features.\n"
        f"BatchNorm (train mode): per feature, over the {m} rows of the batch.\n"
        f"eps = {eps:g}, γ = 1, β = 0 for both\n"
    )
    pr.matrix("LayerNorm output (per row)", cmp["layernorm"], (m, n), row_labels=rows)
    pr.columns(
        "BatchNorm batch statistics, per feature",
        {"batch mean": cmp["batch_mean"].tolist(), "batch variance (÷M)": cmp["batch_var"].tolist()},
        labels=pr.col_labels,
        first="feature",
    )
    pr.matrix("BatchNorm output (per feature)", cmp["batchnorm"], (m, n), row_labels=rows)
    from rich.table import Table

    pr.title("row 0 inside different batches: does its output change?")
    table = Table()
    for col in ("batch", "size", "norm", "output of row 0", "max change"):
        table.add_column(col, justify="right" if col in ("size", "max change") else "left")
    for row in cmp["row0"]:
        table.add_row(
            row["batch"],
            str(row["batch_size"]),
            "LayerNorm",
            _vec(row["layernorm_row0"], pr),
            f"{row['layernorm_change']:.{pr.p}f}",
        )
        if row["batchnorm_row0"] is None:
            table.add_row(
                "", "", "BatchNorm", "error: training needs more than 1 row per feature", "-", end_section=True
            )
        else:
            table.add_row(
                "",
                "",
                "BatchNorm",
                _vec(row["batchnorm_row0"], pr),
                f"{row['batchnorm_change']:.{pr.p}f}",
                end_section=True,
            )
    c.print(table)
    bufs = ", ".join(f"{k} {_vec(v, pr)}" for k, v in cmp["batchnorm_buffers"].items())
    c.print(
        f"running statistics: LayerNorm keeps none (buffers: {cmp['layernorm_buffers'] or 'none'}).\n"
        f"BatchNorm after one training batch (momentum {cmp['batchnorm_momentum']}):\n  {bufs}"
    )
    pr.matrix(
        "BatchNorm output in eval mode (uses the running statistics)", cmp["batchnorm_eval"], (m, n), row_labels=rows
    )
    c.print(
        f"train vs eval, max |difference|: LayerNorm {cmp['layernorm_train_eval_diff']:.1e}, "
        f"BatchNorm {cmp['batchnorm_train_eval_diff']:.{pr.p}f}"
    )


# --------------------------------------------------------------------------- --textbook


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
        "(x − μ)² reaches {max_square:.2g} > {dtype_max:.3g}, bfloat16's and float32's max: var = inf, y = 0",
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
    from .. import textbook

    n = x.shape[-1]
    return textbook.layer_norm_forward(x, torch.ones(n, dtype=x.dtype), torch.zeros(n, dtype=x.dtype), eps)


def _exact(x: Tensor, eps: float, rms: bool = False) -> Tensor:
    return torch_kernels.forward(x, None, None, None, eps=eps, rms=rms, residual_dtype=None)[0]


def textbook_comparison(eps: float = 1e-5) -> dict:
    """:mod:`addnorm.textbook` beside :func:`addnorm.reference.forward` (γ = 1, β = 0), both
    against torch's LayerNorm in float64 (the oracle): on the seeds' worked example
    (``worked_example_error``), then on each of :data:`TEXTBOOK_ROWS` (``cases``).

    Per row: the input, the oracle, both forms' outputs and max errors, the same errors for
    RMSNorm (ε the dtype's machine epsilon, as torch), what the textbook computed on the way
    (its mean, its var from 1/std) and the two lines that explain it.
    """
    from .. import textbook

    x = torch.tensor(WORKED_INPUT)
    oracle = TF.layer_norm(x.double(), x.shape[-1:], eps=eps)
    worked = {
        "textbook": _maxdiff(_textbook_layer_norm(x, eps)[0], oracle),
        "reference": _maxdiff(_exact(x, eps), oracle),
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
            "shift_sigma": (mean - exact_mean) / math.sqrt(exact_var + eps),
            "centered": (x[0, 0] - tb_mean[0, 0]).item(),
            "y0": tb_y[0, 0].item(),
            "max_square": ((x64 - exact_mean) ** 2).max().item(),
            "dtype_max": torch.finfo(x.dtype).max,
            "float32_error": _maxdiff(_textbook_layer_norm(x.float(), eps)[0], oracle),
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
                "textbook_error": _maxdiff(tb_y, oracle),
                "reference_error": _maxdiff(ref_y, oracle),
                "rms_textbook_error": _maxdiff(rms_tb, rms_oracle),
                "rms_reference_error": _maxdiff(_exact(x, rms_eps, rms=True), rms_oracle),
                "measured": measured,
                "wrong": row.wrong.format(**measured),
                "prevented": row.prevented.format(**measured),
            }
        )
    return {"eps": eps, "worked_example_error": worked, "cases": cases}


# significant digits that show each input value exactly (1000000.1875, not 1000000.2)
_EXACT_DIGITS = {"float32": 12, "float16": 6, "bfloat16": 4}


def _print_textbook(doc: dict, pr: _Printer) -> None:
    from rich.table import Table

    c = pr.console
    eps, worked_error, cases = doc["eps"], doc["worked_example_error"], doc["cases"]
    c.print(
        "addnorm.textbook:  LayerNorm as a learner writes it (the seeds' formulas, in the input's dtype)\n"
        "addnorm.reference: the exact form, which every backend runs\n"
        f"error: max |y − torch's LayerNorm in float64|, eps = {eps:g} (RMSNorm: the dtype's machine epsilon)\n"
        f"On the seeds' worked example both are right (error: textbook {worked_error['textbook']:.1e}, "
        f"reference {worked_error['reference']:.1e}).\nOn these rows the textbook breaks:\n"
    )
    for i, case in enumerate(cases, 1):
        pr.title(f"{i}. {case['name']}")
        table = Table()
        for col in ("", "values", "LayerNorm error", "RMSNorm error"):
            table.add_column(col, justify="left" if col in ("", "values") else "right")
        digits = _EXACT_DIGITS[case["dtype"]]
        x_text = "[" + ", ".join(f"{v:.{digits}g}" for v in case["x"].tolist()) + "]"
        table.add_row(f"x ({case['dtype']})", x_text, "", "")
        table.add_row("float64 oracle", _vec(case["oracle"], pr), "", "")
        for form, label in (("textbook", "textbook"), ("reference", "addnorm.reference")):
            table.add_row(
                label, _vec(case[form], pr), f"{case[f'{form}_error']:.1e}", f"{case[f'rms_{form}_error']:.1e}"
            )
        c.print(table)
        c.print(f"textbook:  {case['wrong']}\nreference: {case['prevented']}\n")
    c.print(
        "RMSNorm has no mean to round, so rows 1-2 are right in its textbook form too; "
        "its x² overflows as LayerNorm's (x − μ)² does in rows 3-4."
    )


def run_textbook(args) -> int:
    """``addnorm explain --textbook``: :func:`textbook_comparison`, as tables or ``--json``."""
    given = [k for k in TEXTBOOK_CONFLICTS if getattr(args, k) is not None and getattr(args, k) is not False]
    extra = [f"--{k.replace('_', '-')}" for k in given] + (["--norm rms"] if args.norm != "layer" else [])
    if extra:
        raise UsageError(f"--textbook runs its own rows; drop {', '.join(extra)}")
    if args.precision < 0 or args.precision > 12:
        raise UsageError(f"--precision must be between 0 and 12, got {args.precision}")
    doc = textbook_comparison()
    if args.json:
        print(json.dumps(_plain(doc), indent=1))
    else:
        _print_textbook(doc, _Printer(args.precision, (1,), (1,)))
    return 0


# the options of `addnorm explain` that --textbook does not take (it has its own rows)
TEXTBOOK_CONFLICTS = ("input", "normalized_shape", "eps", "gamma", "beta", "residual", "backward", "grad", "compare")


# --------------------------------------------------------------------------- command


def run(args) -> int:
    if args.textbook:
        return run_textbook(args)
    x = torch.tensor(WORKED_INPUT, dtype=torch.float64) if args.input is None else load_matrix(args.input, "--input")
    normalized_shape = parse_shape(args.normalized_shape) if args.normalized_shape else (x.shape[-1],)
    k = len(normalized_shape)
    if x.dim() < k or tuple(x.shape[-k:]) != normalized_shape:
        raise UsageError(
            f"--normalized-shape {','.join(map(str, normalized_shape))} must equal the trailing "
            f"dims of the input, whose shape is {list(x.shape)}; e.g. {x.shape[-1]}"
        )
    rms = args.norm == "rms"
    if rms and args.beta is not None:
        raise UsageError("--beta: RMSNorm has no bias (β); drop --beta or use --norm layer")
    if args.compare and (rms or args.residual is not None or args.backward):
        raise UsageError("--compare batchnorm compares plain LayerNorm; drop --norm rms, --residual and --backward")
    if args.compare and x.numel() // math.prod(normalized_shape) < 2:
        raise UsageError(
            "--compare batchnorm needs at least 2 rows: BatchNorm normalizes each feature over the "
            "rows of the batch, and a single row leaves it nothing to normalize over"
        )
    if args.dropout and args.residual is None:
        raise UsageError("--dropout drops the sublayer output x before it is added to --residual: add --residual")
    if not 0 <= args.dropout < 1:
        raise UsageError(f"--dropout must be a probability in [0, 1), got {args.dropout}")
    if args.grad is not None and not args.backward:
        raise UsageError("--grad is the upstream gradient of --backward; add --backward")
    if args.precision < 0 or args.precision > 12:
        raise UsageError(f"--precision must be between 0 and 12, got {args.precision}")
    eps = args.eps
    if eps is None:
        eps = torch.finfo(reference.stats_dtype(x.dtype)).eps if rms else 1e-5
    if not math.isfinite(eps) or eps < 0:
        raise UsageError(f"--eps must be a non-negative number, got {eps}")
    gamma = parse_param(args.gamma, normalized_shape, "--gamma", 1.0)
    beta = None if rms else parse_param(args.beta, normalized_shape, "--beta", 0.0)
    residual = grad = None
    if args.residual is not None:
        residual = load_matrix(args.residual, "--residual")
        if residual.shape != x.shape:
            raise UsageError(f"--residual must have the input's shape {list(x.shape)}, got {list(residual.shape)}")
    if args.grad is not None:
        grad = load_matrix(args.grad, "--grad")
        if grad.shape != x.shape:
            raise UsageError(f"--grad must have the input's shape {list(x.shape)}, got {list(grad.shape)}")

    r = explain(
        x,
        normalized_shape,
        eps=eps,
        gamma=gamma,
        beta=beta,
        rms=rms,
        residual=residual,
        grad=grad,
        backward=args.backward,
        dropout=args.dropout,
        seed=args.seed,
    )
    cmp = compare_batchnorm(r["x"], eps) if args.compare else None
    if args.json:
        doc = {
            "shape": list(x.shape),
            "normalized_shape": list(normalized_shape),
            "rows": r["x"].shape[0],
            "features": r["x"].shape[1],
            "norm": args.norm,
            "eps": eps,
            "dtype": str(x.dtype)[6:],
        }
        doc |= {k: v for k, v in r.items() if k not in ("backward",)}
        if args.backward:
            doc["backward"] = r["backward"]
        if cmp is not None:
            doc["compare_batchnorm"] = cmp
        count = _count_numbers(doc)
        if count > MAX_JSON_NUMBERS:
            raise UsageError(
                f"--json would print {count:,} numbers (about {count * 20 / 1e6:.0f} MB); explain shows "
                f"small examples in full: give a smaller --input (at most {MAX_JSON_NUMBERS:,} numbers "
                "in all), or drop --json (the tables elide the middle of large inputs)"
            )
        print(json.dumps(_plain(doc), indent=1))
        return 0
    pr = _Printer(args.precision, tuple(x.shape[:-k]), normalized_shape)
    if cmp is not None:
        pr.matrix("input x", r["x"], tuple(x.shape))
        _print_compare(cmp, eps, pr)
        for msg in r["warnings"]:
            pr.console.print(f"note: {msg}", style="yellow")
        return 0
    _print_explanation(r, tuple(x.shape), normalized_shape, eps, rms, pr)
    if args.backward:
        _print_backward(r, tuple(x.shape), normalized_shape, rms, grad is not None, pr)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "explain",
        help="LayerNorm / RMSNorm / Add & Norm step by step, with shapes",
        description="Print every step of a norm with shapes: input, normalized dims, per-row mean, "
        "biased variance, std with eps, normalized values, gamma, beta, output; the effect "
        "of eps; the hand-derived backward (--backward); BatchNorm beside it (--compare). "
        "Default input: the worked example [[0.2,0.1,0.3],[0.5,0.1,0.1]].",
    )
    p.add_argument("--input", metavar="MATRIX|FILE", help=MATRIX_HELP + " (a literal is read in float64)")
    p.add_argument(
        "--normalized-shape",
        metavar="DIMS",
        help="trailing dims normalized together, e.g. 3 or 1,3 (default: the last dim)",
    )
    p.add_argument(
        "--eps",
        type=float,
        help="added to the variance inside the square root "
        "(default 1e-5; RMSNorm: the dtype's machine epsilon, as torch)",
    )
    p.add_argument("--gamma", metavar="VALUES", help="weight γ: one number, or one per feature (default 1)")
    p.add_argument("--beta", metavar="VALUES", help="bias β: one number, or one per feature (default 0)")
    p.add_argument("--norm", choices=["layer", "rms"], default="layer", help="LayerNorm (default) or RMSNorm")
    p.add_argument("--residual", metavar="MATRIX|FILE", help="Add & Norm: normalize s = input + residual")
    p.add_argument(
        "--dropout",
        metavar="P",
        type=float,
        default=0.0,
        help="with --residual: residual dropout of x before the add, as the original Transformer (P_drop 0.1)",
    )
    p.add_argument("--seed", metavar="S", type=int, default=0, help="the generator seed of --dropout's mask")
    p.add_argument("--backward", action="store_true", help="the hand-derived backward beside autograd's")
    p.add_argument("--grad", metavar="MATRIX|FILE", help="upstream gradient for --backward (default: ones)")
    p.add_argument("--compare", choices=["batchnorm"], help="put BatchNorm beside LayerNorm")
    p.add_argument(
        "--textbook",
        action="store_true",
        help="the textbook form (addnorm.textbook) beside the exact one on rows where the textbook breaks",
    )
    p.add_argument("--json", action="store_true", help="print the same numbers as JSON (full precision)")
    p.add_argument("--precision", metavar="N", type=int, default=4, help="digits after the point in tables (default 4)")
    p.set_defaults(func=run)
