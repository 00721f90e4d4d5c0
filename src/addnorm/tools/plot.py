"""``addnorm plot``: PNG figures of what the norm does and how fast it runs.

- ``plot hist``: histograms of each data point's features before and after LayerNorm
  (random data + sinusoidal positional encoding, as in the seeds).
- ``plot bench``: GB/s per implementation from the rows ``addnorm bench --save`` wrote.
- ``plot train``: the training experiment's curves (drawn by :mod:`addnorm.tools.experiment`).

matplotlib is an optional dependency (``pip install 'addnorm[plot]'``), imported only here,
and only the Agg canvas is used: no display is needed.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from pathlib import Path

import torch

from .bench.rows import DEFAULT_RESULTS, PASSES, read_rows, run_key
from .cli import UsageError, check_seed, output_dir, output_file

MAX_D_MODEL = 65536


def new_figure(*args, **kwargs):
    """A matplotlib Figure on the Agg canvas (no pyplot, no global state)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("addnorm plot needs matplotlib: pip install 'addnorm[plot]'") from None
    return Figure(*args, **kwargs)


def png_path(out: str | None, default_name: str, flag: str = "--out") -> Path:
    """``--out``: a ``.png`` file, or a folder that gets ``default_name``; checked writable now,
    before anything is drawn."""
    return output_file(out or ".", flag, suffixes=(".png",), default_name=default_name)


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return path


# --------------------------------------------------------------------------- hist


def hist_data(points: int, d_model: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeds' setup: ``randn(points, 1, d_model)·√d_model`` + positional encoding, and
    its LayerNorm (addnorm's, eps 1e-5, γ=1, β=0)."""
    from ..functional import layer_norm
    from ..transformer import sinusoidal_table

    torch.manual_seed(seed)
    data = torch.randn(points, 1, d_model)
    encoded = data * math.sqrt(d_model) + sinusoidal_table(1, d_model)
    return encoded, layer_norm(encoded, d_model)


def _num(v: float) -> str:
    return f"{0.0 if abs(v) < 5e-5 else v:.4f}"  # never "-0.0000"


def plot_hist(path: Path, points: int, d_model: int, seed: int) -> Path:
    before, after = (t[:, 0].detach().double() for t in hist_data(points, d_model, seed))
    fig = new_figure(figsize=(max(3.4 * points + 0.6, 7.4), 6.6), layout="constrained")  # (the title's width)
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
        f"{points} data point{'s' if points > 1 else ''} × {d_model} features, before and after LayerNorm "
        f"(eps 1e-5, γ=1, β=0)\ninput: randn·√{d_model} + sinusoidal positional encoding, seed {seed}",
        fontsize=11,
    )
    return _save(fig, path)


# --------------------------------------------------------------------------- bench


def plot_bench(
    path: Path, results: str | None, op: str | None, dtype: str | None, passes: str | None, commit: str | None
) -> Path:
    """Draw the latest run in ``results`` (of ``commit``, if given) whose rows match the filters."""
    source = Path(results) if results else DEFAULT_RESULTS
    rows = read_rows(source)
    keep = [
        r
        for r in rows
        if (op is None or r["op"] == op)
        and (dtype is None or r["dtype"] == dtype)
        and (passes is None or r["pass"] == passes)
        and (commit is None or r["commit"].startswith(commit))
    ]
    if not keep:
        asked = [f"--{k} {v}" for k, v in (("op", op), ("dtype", dtype), ("pass", passes), ("commit", commit)) if v]
        ops, dtypes = sorted({r["op"] for r in rows}), sorted({r["dtype"] for r in rows})
        commits = sorted({r["commit"] for r in rows})
        raise UsageError(
            f"no rows in {str(source)!r} match {' '.join(asked) or 'the filters'}; the file holds ops {ops}, "
            f"dtypes {dtypes}, commits {', '.join(commits[:12])}{', ...' if len(commits) > 12 else ''}"
        )
    latest = max(run_key(r) for r in keep)
    runs = len({run_key(r) for r in keep})
    written = draw_bench([r for r in keep if run_key(r) == latest], path, str(source))
    if runs > 1:
        print(
            f"drew the latest of {runs} matching runs in {source} ({latest[0]}, commit {latest[1]}); "
            "--commit HASH draws another"
        )
    return written


def _gbps_label(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"  # 2633, 15.2, 0.00607


def draw_bench(rows: list[dict], path: Path, source: str) -> Path:
    """GB/s bars from the rows of one ``addnorm bench`` run, in one figure: a panel per
    (op, dtype) and pass, the shapes along x, a bar per implementation (one colour each)."""
    panels: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
    for r in rows:  # the latest row wins for a repeated (shape, impl)
        cell = (r["rows"], r["cols"], r["impl"])
        old = panels[r["op"], r["dtype"], r["pass"]].get(cell)
        if old is None or str(r.get("time", "")) >= str(old.get("time", "")):
            panels[r["op"], r["dtype"], r["pass"]][cell] = r
    order = {p: i for i, p in enumerate(PASSES)}
    grid_rows = sorted({(op, dt) for op, dt, _ in panels})
    grid_cols = sorted({p for _, _, p in panels}, key=lambda p: (order.get(p, len(order)), p))
    impls = sorted({r["impl"] for r in rows})
    colors = {impl: f"C{i % 10}" for i, impl in enumerate(impls)}  # one colour per impl everywhere
    bars = max(len(cells) for cells in panels.values())
    width = max(5.5, 0.2 * bars + 1.5)  # inches per panel: bars and their labels stay readable
    upright = bars <= 8  # more bars than that: labels turned 90° so that they do not overlap
    fig = new_figure(figsize=(max(8.0, width * len(grid_cols)), 3.2 * len(grid_rows) + 1.4), layout="constrained")
    axs = fig.subplots(len(grid_rows), len(grid_cols), squeeze=False)
    for (i, (op_name, dt)), (j, pass_name) in itertools.product(enumerate(grid_rows), enumerate(grid_cols)):
        ax, cells = axs[i][j], panels.get((op_name, dt, pass_name))
        if cells is None:
            ax.set_axis_off()
            ax.text(0.5, 0.5, f"{op_name} {pass_name}, {dt}: not measured", ha="center", transform=ax.transAxes)
            continue
        shapes = sorted({(rw, c) for rw, c, _ in cells}, key=lambda s: (s[0] * s[1], s))
        here = [impl for impl in impls if any(k[2] == impl for k in cells)]
        step = 0.8 / len(here)
        for k, impl in enumerate(here):
            xs = [n + (k - (len(here) - 1) / 2) * step for n, s in enumerate(shapes) if (*s, impl) in cells]
            ys = [cells[(*s, impl)]["gbps"] for s in shapes if (*s, impl) in cells]
            drawn = ax.bar(xs, ys, width=step, label=impl, color=colors[impl])
            ax.bar_label(drawn, fmt=_gbps_label, fontsize=7, padding=1, rotation=0 if upright else 90)
        ax.set_xticks(range(len(shapes)), [f"{rw}×{c}" for rw, c in shapes], fontsize=8)
        ax.set_title(f"{op_name} {pass_name}, {dt}", fontsize=10)
        ax.set_ylim(0, (1.15 if upright else 1.3) * max(r["gbps"] for r in cells.values()))  # room for labels
        ax.grid(axis="y", alpha=0.3)
        if j == 0:
            ax.set_ylabel("GB/s (higher is better)")
        if i == len(grid_rows) - 1:
            ax.set_xlabel("shape (rows × cols)")
    from matplotlib.patches import Patch

    handles = [Patch(color=colors[impl]) for impl in impls]
    fig.legend(handles, impls, loc="outside lower center", ncols=min(len(impls), 6), fontsize=9)
    runs = sorted({run_key(r) for r in rows})
    if len(runs) == 1:
        time, commit, machine, device, threads = runs[0]
        about = f"{machine} ({device}, {threads} threads)\ncommit {commit}, {time}, from {source}"
    else:
        about = f"{len(runs)} runs from {source}"
    fig.suptitle(f"addnorm bench: GB/s = bytes moved / median time\n{about}", fontsize=10)
    return _save(fig, path)


# --------------------------------------------------------------------------- train


def plot_train(out_dir: Path, results: str) -> list[Path]:
    """Redraw the training experiment's figures from its ``results.json`` into ``out_dir``."""
    from .experiment import plot_results

    path = Path(results)
    if path.is_dir():
        raise UsageError(f"--results: {str(path)!r} is a folder; expected the results.json in it")
    if not path.is_file():
        raise UsageError(f"--results: {str(path)!r} not found; run the training experiment first")
    not_results = f"--results: {str(path)!r} is not a results.json written by 'addnorm train'"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise UsageError(not_results) from None
    if not isinstance(doc, dict) or "floor" not in doc or not doc.keys() & {"arms", "sweep"}:
        raise UsageError(not_results)
    try:
        written = [Path(p) for p in plot_results(path, out_dir)]
    except (KeyError, TypeError, ValueError, IndexError) as err:  # a field missing or of the wrong kind
        raise UsageError(f"{not_results} ({type(err).__name__}: {err})") from None
    for p in written:
        print(f"wrote {p}")
    return written


# --------------------------------------------------------------------------- command


def run(args) -> int:
    new_figure()  # a clear error if matplotlib is missing, before anything else
    if args.what == "hist":
        if not (1 <= args.points <= 8 and 2 <= args.d_model <= MAX_D_MODEL and args.d_model % 2 == 0):
            raise UsageError(f"plot hist needs 1 to 8 --points and an even --d-model from 2 to {MAX_D_MODEL}")
        check_seed(args.seed, "--seed")
        plot_hist(png_path(args.out, "hist.png"), args.points, args.d_model, args.seed)
    elif args.what == "bench":
        plot_bench(png_path(args.out, "bench.png"), args.results, args.op, args.dtype, args.pass_, args.commit)
    else:
        writes = "plot train writes curves.png and grad_norms.png (depth.png for a depth sweep)"
        plot_train(output_dir(args.out or ".", "--out", writes), args.results)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "plot",
        help="PNG plots: feature histograms, benchmark GB/s, training curves",
        description="Write PNG plots (matplotlib, no display needed).",
    )
    kinds = p.add_subparsers(dest="what", metavar="KIND", required=True)
    h = kinds.add_parser(
        "hist",
        help="histograms of features per data point, before and after LayerNorm",
        description="Histograms of each data point's features before and after LayerNorm "
        "(random data scaled by √d_model plus a sinusoidal positional encoding, as in the seeds).",
    )
    h.add_argument("--points", type=int, default=4, help="data points, 1 to 8 (default 4)")
    h.add_argument("--d-model", type=int, default=256, help="features per point, even (default 256)")
    h.add_argument("--seed", type=int, default=23, help="torch.manual_seed (default 23, as the seeds)")
    b = kinds.add_parser(
        "bench",
        help="GB/s per implementation from `addnorm bench --save` rows",
        description="Bar charts of GB/s per implementation and shape from the rows `addnorm bench --save` "
        "appended: the latest run (one `addnorm bench` invocation) whose rows match the filters.",
    )
    b.add_argument("--results", metavar="FILE", help=f"JSONL rows (default {DEFAULT_RESULTS})")
    b.add_argument("--op", help="only this op, e.g. layer_norm")
    b.add_argument("--dtype", help="only this dtype, e.g. float32")
    b.add_argument("--pass", dest="pass_", choices=PASSES, help="only this pass")
    b.add_argument("--commit", metavar="HASH", help="the latest run of this commit (a prefix is enough)")
    t = kinds.add_parser(
        "train",
        help="the training experiment's curves",
        description="Redraw curves.png and grad_norms.png from the results.json of `addnorm train`.",
    )
    t.add_argument("--results", metavar="FILE", required=True, help="the results.json `addnorm train` wrote")
    for q, what in ((h, "hist.png"), (b, "bench.png")):
        q.add_argument("--out", metavar="FILE|DIR", help=f"a .png file, or a folder for {what} (default: .)")
    t.add_argument("--out", metavar="DIR", help="folder for curves.png and grad_norms.png (default: .)")
    for q in (h, b, t):
        q.set_defaults(func=run)
