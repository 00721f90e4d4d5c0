"""``addnorm plot``: PNG figures of what the norm does and how fast it runs.

- ``plot hist``: histograms of each data point's features before and after LayerNorm
  (random data + sinusoidal positional encoding, as in the seeds).
- ``plot bench``: GB/s per implementation from the rows ``addnorm bench --save`` wrote.
- ``plot train``: the training experiment's curves (drawn by :mod:`addnorm.experiment`).

matplotlib is an optional dependency (``pip install 'addnorm[plot]'``), imported only here,
and only the Agg canvas is used: no display is needed.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import torch

from .cli import UsageError

DEFAULT_BENCH = Path("benchmarks/results/bench.jsonl")
BENCH_FIELDS = ("machine", "device", "threads", "op", "pass", "rows", "cols", "dtype", "impl", "gbps")


def _figure(*args, **kwargs):
    """A matplotlib Figure on the Agg canvas (no pyplot, no global state)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("addnorm plot needs matplotlib: pip install 'addnorm[plot]'") from None
    return Figure(*args, **kwargs)


def _out_path(out: str | None, default_name: str) -> Path:
    """``--out``: a .png file, or a directory that gets ``default_name``."""
    path = Path(out) if out else Path(default_name)
    if path.suffix.lower() != ".png" and out:
        path = path / default_name
    if path.parent.exists() and not path.parent.is_dir():
        raise UsageError(f"--out: {str(path.parent)!r} is not a directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return path


# --------------------------------------------------------------------------- hist


def hist_data(points: int, d_model: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeds' setup: ``randn(points, 1, d_model)·√d_model`` + positional encoding, and
    its LayerNorm (addnorm's, eps 1e-5, γ=1, β=0)."""
    from .functional import layer_norm
    from .transformer import sinusoidal_table

    torch.manual_seed(seed)
    data = torch.randn(points, 1, d_model)
    encoded = data * math.sqrt(d_model) + sinusoidal_table(1, d_model)
    return encoded, layer_norm(encoded, d_model)


def _num(v: float) -> str:
    return f"{0.0 if abs(v) < 5e-5 else v:.4f}"  # never "-0.0000"


def plot_hist(out: str | None, points: int, d_model: int, seed: int) -> Path:
    before, after = (t[:, 0].detach().double() for t in hist_data(points, d_model, seed))
    fig = _figure(figsize=(3.4 * points + 0.6, 6.4), layout="constrained")
    axs = fig.subplots(2, points, squeeze=False, sharey="row")
    rows = [("before: positionally encoded input", before, "tab:blue"), ("after LayerNorm", after, "tab:orange")]
    for r, (label, values, color) in enumerate(rows):
        lim = values.abs().max().item()
        bins = torch.linspace(-lim, lim, 31).tolist()
        for i in range(points):
            v = values[i]
            ax = axs[r][i]
            ax.hist(v.tolist(), bins=bins, color=color, alpha=0.8)
            ax.set_title(
                f"point #{i}: mean {_num(v.mean().item())}\nstd {_num(v.std(correction=0).item())}", fontsize=10
            )
            ax.set_xlabel("feature value (unitless)")
            if i == 0:
                ax.set_ylabel(f"{label}\n# of features")
    fig.suptitle(
        f"{points} data points × {d_model} features (randn·√{d_model} + sinusoidal positional "
        f"encoding, seed {seed}), before and after LayerNorm (eps 1e-5, γ=1, β=0)",
        fontsize=11,
    )
    return _save(fig, _out_path(out, "hist.png"))


# --------------------------------------------------------------------------- bench


def read_bench_rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise UsageError(f"--results: {str(path)!r} not found; run `addnorm bench --save` first")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UsageError(f"--results: {path}:{lineno} is not JSON ({err.msg})") from None
        missing = [f for f in BENCH_FIELDS if not isinstance(row, dict) or f not in row]
        if missing:
            raise UsageError(f"--results: {path}:{lineno} lacks field(s) {', '.join(missing)}")
        rows.append(row)
    if not rows:
        raise UsageError(f"--results: {str(path)!r} holds no rows; run `addnorm bench --save` first")
    return rows


def plot_bench(out: str | None, results: str | None, op: str | None, dtype: str | None, passes: str | None) -> Path:
    path = Path(results) if results else DEFAULT_BENCH
    rows = read_bench_rows(path)
    keep = [
        r
        for r in rows
        if (op is None or r["op"] == op)
        and (dtype is None or r["dtype"] == dtype)
        and (passes is None or r["pass"] == passes)
    ]
    if not keep:
        ops, dtypes = sorted({r["op"] for r in rows}), sorted({r["dtype"] for r in rows})
        raise UsageError(f"--results: no rows in {str(path)!r} match (ops {ops}, dtypes {dtypes})")
    return draw_bench(keep, out, str(path))


def draw_bench(rows: list[dict], out: str | None, source: str) -> Path:
    """GB/s bars, one panel per (op, pass, dtype, machine, device, threads), from bench rows
    (the format ``addnorm bench --save`` writes); ``source`` names them in the title."""
    groups: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
    for r in rows:  # the latest row wins for a repeated (shape, impl)
        key = (r["op"], r["pass"], r["dtype"], r["machine"], r["device"], r["threads"])
        cell = (r["rows"], r["cols"], r["impl"])
        if cell not in groups[key] or str(r.get("time", "")) >= str(groups[key][cell].get("time", "")):
            groups[key][cell] = r
    fig = _figure(figsize=(11, 4.2 * len(groups)), layout="constrained")
    axs = fig.subplots(len(groups), 1, squeeze=False)
    all_impls = sorted({r["impl"] for r in rows})
    colors = {impl: f"C{i % 10}" for i, impl in enumerate(all_impls)}  # one colour per impl everywhere
    for ax, (key, cells) in zip(axs[:, 0], sorted(groups.items()), strict=True):
        op_name, pass_name, dt, machine, device, threads = key
        shapes = sorted({(rw, c) for rw, c, _ in cells}, key=lambda s: (s[0] * s[1], s))
        impls = sorted({impl for _, _, impl in cells})
        width = 0.8 / len(impls)
        for k, impl in enumerate(impls):
            xs = [i + (k - (len(impls) - 1) / 2) * width for i, s in enumerate(shapes) if (*s, impl) in cells]
            ys = [cells[(*s, impl)]["gbps"] for s in shapes if (*s, impl) in cells]
            bars = ax.bar(xs, ys, width=width, label=impl, color=colors[impl])
            ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
        ax.set_xticks(range(len(shapes)), [f"{rw}×{c}" for rw, c in shapes], rotation=30 if len(shapes) > 6 else 0)
        ax.set_xlabel("shape (rows × cols)")
        ax.set_ylabel("throughput (GB/s, higher is better)")
        ax.set_title(f"{op_name} {pass_name}, {dt} — {machine} ({device}, {threads} threads)", fontsize=11)
        ax.set_ylim(0, 1.25 * max(r["gbps"] for r in cells.values()))  # room for the legend
        ax.legend(fontsize=9, ncols=min(len(impls), 4), loc="upper left")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"addnorm bench: bytes moved / median time, from {source}", fontsize=10)
    return _save(fig, _out_path(out, "bench.png"))


# --------------------------------------------------------------------------- train


def plot_train(out: str | None, results: str) -> list[Path]:
    path = Path(results)
    if not path.is_file():
        raise UsageError(f"--results: {str(path)!r} not found; run the training experiment first")
    import json

    from .experiment import plot_results

    _figure()  # a clear error if matplotlib is missing
    try:
        results_ok = {"floor", "arms"} <= set(json.loads(path.read_text()))
    except (ValueError, TypeError, UnicodeDecodeError):
        results_ok = False
    if not results_ok:
        raise UsageError(f"--results: {str(path)!r} is not a results.json written by 'addnorm train'")
    out_dir = Path(out) if out else Path(".")
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out: {str(out_dir)!r} is not a directory (plot train writes several files)")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [Path(p) for p in plot_results(path, out_dir)]
    for p in written:
        print(f"wrote {p}")
    return written


# --------------------------------------------------------------------------- command


def run(args) -> int:
    if args.what == "hist":
        if args.points < 1 or args.points > 8 or args.d_model < 2 or args.d_model % 2:
            raise UsageError("plot hist needs 1 to 8 --points and an even --d-model >= 2")
        plot_hist(args.out, args.points, args.d_model, args.seed)
    elif args.what == "bench":
        plot_bench(args.out, args.results, args.op, args.dtype, args.pass_)
    else:
        plot_train(args.out, args.results)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "plot",
        help="PNG plots: feature histograms, benchmark GB/s, training curves",
        description="Write PNG plots (matplotlib, no display needed).",
    )
    kinds = p.add_subparsers(dest="what", metavar="KIND", required=True)
    h = kinds.add_parser("hist", help="histograms of features per data point, before and after LayerNorm")
    h.add_argument("--points", type=int, default=4, help="data points (default 4)")
    h.add_argument("--d-model", type=int, default=256, help="features per point (default 256)")
    h.add_argument("--seed", type=int, default=23, help="torch.manual_seed (default 23, as the seeds)")
    b = kinds.add_parser("bench", help="GB/s per implementation from `addnorm bench --save` rows")
    b.add_argument("--results", metavar="FILE", help=f"JSONL rows (default {DEFAULT_BENCH})")
    b.add_argument("--op", help="only this op, e.g. layer_norm")
    b.add_argument("--dtype", help="only this dtype, e.g. float32")
    b.add_argument("--pass", dest="pass_", choices=["fwd", "fwd+bwd"], help="only this pass")
    t = kinds.add_parser("train", help="the training experiment's curves")
    t.add_argument("--results", metavar="FILE", required=True, help="the JSON the experiment wrote")
    for q in (h, b, t):
        q.add_argument("--out", metavar="FILE|DIR", help="PNG file or directory (default: current directory)")
        q.set_defaults(func=run)
