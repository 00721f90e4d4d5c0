"""How ``addnorm explain`` shows its numbers: rich tables (wide or long tensors with their
middle elided) or, with ``--json``, every value as strict JSON."""

from __future__ import annotations

import json
import math

import torch
from torch import Tensor

from ..cli import UsageError

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


def print_json(doc: dict) -> None:
    """``doc`` as strict JSON on stdout, unless it holds more than :data:`MAX_JSON_NUMBERS` numbers."""
    count = _count_numbers(doc)
    if count > MAX_JSON_NUMBERS:
        raise UsageError(
            f"--json would print {count:,} numbers (about {count * 20 / 1e6:.0f} MB); explain shows "
            f"small examples in full: give a smaller --input (at most {MAX_JSON_NUMBERS:,} numbers "
            "in all), or drop --json (the tables elide the middle of large inputs)"
        )
    print(json.dumps(_plain(doc), indent=1))


# --------------------------------------------------------------------------- rich output


class Printer:
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


def vec(t: Tensor, pr: Printer) -> str:
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


def print_explanation(
    r: dict, shape: tuple[int, ...], normalized_shape: tuple[int, ...], eps: float, rms: bool, pr: Printer
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
            "x̂ without ε": [vec(v, pr) for v in r["xhat_no_eps"]],
            "x̂ with ε": [vec(v, pr) for v in r["xhat"]],
        },
    )
    i = int(r["var"].argmin())  # ε matters most where the variance is smallest
    j = int(r["xhat_no_eps"][i].abs().nan_to_num(-1.0).argmax())
    c.print(
        f"row {pr.row_labels[i]}, feature {pr.col_labels[j]}: {pr.num(r['xhat_no_eps'][i, j].item())} "
        f"without ε vs {pr.num(r['xhat'][i, j].item())} with ε = {eps:g}.\n"
        f"ε matters most where the {'mean square' if rms else 'variance'} is small (row {pr.row_labels[i]}: "
        f"{r['var'][i].item():.3g}); it keeps a constant row finite."
    )
    for msg in r["warnings"]:
        c.print(f"note: {msg}", style="yellow")
    c.print(
        f"\nagreement with these float64 steps, max |difference| of y:\n"
        f"  {r['op_name']}: {r['op_maxdiff']:.1e}\n  {r['torch_name']}: {r['torch_maxdiff']:.1e}"
    )


def print_backward(
    r: dict, shape: tuple[int, ...], normalized_shape: tuple[int, ...], rms: bool, given: bool, pr: Printer
) -> None:
    bw = r["backward"]
    c = pr.console
    stat = _shape_str(shape[: len(shape) - len(normalized_shape)])
    c.rule("backward: the hand-derived gradient (addnorm.reference.backward_steps)")
    pr.matrix("upstream gradient dy" + ("" if given else " (all ones; pass --grad for another)"), bw["dy"], shape)
    pr.matrix("g = dy·γ", bw["g"], shape)
    cols = {}
    if not rms:
        cols[f"mean(g) {stat}"] = bw["mean_g"]
    cols[f"mean(g·x̂) {stat}"] = bw["mean_gxhat"]
    cols["1/rms = rstd" if rms else "1/std = rstd"] = r["rstd"]
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


def print_compare(cmp: dict, eps: float, pr: Printer) -> None:
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
            vec(row["layernorm_row0"], pr),
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
                vec(row["batchnorm_row0"], pr),
                f"{row['batchnorm_change']:.{pr.p}f}",
                end_section=True,
            )
    c.print(table)
    bufs = ", ".join(f"{k} {vec(v, pr)}" for k, v in cmp["batchnorm_buffers"].items())
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


# significant digits that show each input value exactly (1000000.1875, not 1000000.2)
_EXACT_DIGITS = {"float32": 12, "float16": 6, "bfloat16": 4}


def print_textbook(doc: dict, pr: Printer) -> None:
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
        table.add_row("float64 oracle", vec(case["oracle"], pr), "", "")
        for form, label in (("textbook", "textbook"), ("reference", "addnorm.reference")):
            table.add_row(
                label, vec(case[form], pr), f"{case[f'{form}_error']:.1e}", f"{case[f'rms_{form}_error']:.1e}"
            )
        c.print(table)
        c.print(f"textbook:  {case['wrong']}\nreference: {case['prevented']}\n")
    c.print(
        "RMSNorm has no mean to round, so rows 1-2 are right in its textbook form too; "
        "its x² overflows as LayerNorm's (x − μ)² does in rows 3-4."
    )
