"""The experiment's figures, drawn from results.json alone: ``curves.png`` and ``grad_norms.png``
for a plain run, ``depth.png`` for a depth sweep."""

from __future__ import annotations

import math
import pathlib

import numpy as np

from .schema import FAIL_RATIO, WITHIN, Results


def pyplot():
    """matplotlib's pyplot on the Agg canvas (no display needed), or a RuntimeError that says how
    to install it."""
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError("the plots need matplotlib: pip install 'addnorm[plot]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


CLIP = 10.0  # test MSE above this is drawn at the top edge of curves.png


def plot_results(results_json_path: str | pathlib.Path, out_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """(Re)draw ``curves.png`` and ``grad_norms.png`` (``depth.png`` for a depth sweep) in ``out_dir``
    from a ``results.json``."""
    plt = pyplot()
    results = Results.read(results_json_path)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if results.sweep is not None:
        return [plot_sweep(results, out)]
    return [_plot_curves(results, out, plt), _plot_grad_norms(results, out, plt)]


def _bottom(results: Results) -> float:
    """The log axis' lower end: half the floor, or lower when a test MSE is (data other than noisy
    corners, ``--data``), so that no point is cut off."""
    values = [
        v
        for arm in results.all_arms()
        for run in arm.runs
        for v in run.test_mse
        if v is not None and math.isfinite(v) and v > 0
    ]
    return min([results.floor, *values]) / 2


def _plot_curves(results: Results, out: pathlib.Path, plt) -> pathlib.Path:
    """``curves.png``: test MSE per epoch, per arm (median, band min-max over seeds)."""
    floor = results.floor
    fig, ax = plt.subplots(figsize=(10, 5))
    clipped = False
    for arm in results.arms.values():
        curves = np.array([r.test_mse for r in arm.runs], dtype=float)
        median = np.nanmedian(np.where(np.isfinite(curves), curves, np.inf), axis=0)
        clipped |= bool((median > CLIP).any())
        epochs = np.arange(1, curves.shape[1] + 1)
        style = "--" if arm.norm_position == "pre" else ":" if arm.norm_position == "none" else "-"
        label = arm.label + _runs_note([len(arm.runs)], results)
        (line,) = ax.plot(epochs, np.minimum(median, CLIP), style, marker="o", ms=3, label=label)
        if len(curves) > 1:
            lo, hi = np.nanmin(curves, axis=0), np.nanmax(curves, axis=0)
            ax.fill_between(epochs, np.minimum(lo, CLIP), np.minimum(hi, CLIP), color=line.get_color(), alpha=0.15)
    ax.axhline(floor, color="black", lw=1)
    ax.text(1, floor * 0.8, f"noise floor {floor:.4f}", va="top", fontsize=9)
    ax.axhline(WITHIN * floor, color="gray", lw=0.8, ls="--")
    ax.text(1, WITHIN * floor * 1.1, f"{WITHIN:g}x floor", va="bottom", fontsize=9, color="gray")
    ax.set_yscale("log")
    ax.set_ylim(_bottom(results), CLIP * 1.5)
    ax.set_xlabel("epoch")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("test MSE (autoregressive, log scale)")
    title = f"Test MSE per epoch ({_over_seeds([len(a.runs) for a in results.arms.values()], results)})"
    ax.set_title(title + (f"\nvalues above {CLIP:g} drawn at {CLIP:g}" if clipped else ""), fontsize=11)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    curves_png = out / "curves.png"
    fig.savefig(curves_png, dpi=120)
    plt.close(fig)
    return curves_png


def _plot_grad_norms(results: Results, out: pathlib.Path, plt) -> pathlib.Path:
    """``grad_norms.png``: the gradient norm of each layer at initialisation, post- and pre-norm."""
    grads = results.grad_norms
    fig, axes = plt.subplots(1, 2, figsize=(9, 4), sharey=True)
    for ax, part in zip(axes, ("encoder", "decoder"), strict=True):
        for pos, style in (("post", "-o"), ("pre", "--s")):
            values = grads[pos][part]
            label = f"{pos}-{'LN' if results.config.norm == 'layer' else 'RMSNorm'}"
            ax.plot(np.arange(1, len(values) + 1), values, style, label=label)
        ax.set_title(f"{part} layers")
        ax.set_xlabel("layer (1 = nearest the input)")
        ax.set_xticks(np.arange(1, len(grads["post"][part]) + 1))
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_ylim(bottom=0)  # shared: after both panels are drawn
    axes[0].set_ylabel("‖∂loss/∂W‖ of the FFN output weight")
    fig.suptitle(
        f"Gradient norm per layer at initialisation, mean of {results.grad_inits} inits (cf. Xiong et al. 2020, Fig. 3)"
    )
    fig.tight_layout()
    grads_png = out / "grad_norms.png"
    fig.savefig(grads_png, dpi=120)
    plt.close(fig)
    return grads_png


def plot_sweep(results: Results, out: pathlib.Path) -> pathlib.Path:
    """``depth.png``: final test MSE against depth, per arm (median, band min-max over seeds)."""
    plt = pyplot()
    floor = results.floor
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for by_depth in results.sweep.by_arm().values():
        depths = list(by_depth)
        finals = [[_clip(r.test_mse[-1]) for r in arm.runs] for arm in by_depth.values()]
        first = next(iter(by_depth.values()))
        style = "--s" if first.norm_position == "pre" else "-o"
        label = first.label + _runs_note([len(f) for f in finals], results)
        (line,) = ax.plot(depths, [np.median(f) for f in finals], style, label=label)
        ax.fill_between(depths, [min(f) for f in finals], [max(f) for f in finals], color=line.get_color(), alpha=0.15)
    ax.axhline(floor, color="black", lw=1)
    ax.text(min(results.sweep.depth), floor * 0.8, f"noise floor {floor:.4f}", va="top", fontsize=9)
    ax.axhline(FAIL_RATIO * floor, color="gray", lw=0.8, ls="--")
    ax.text(
        min(results.sweep.depth),
        FAIL_RATIO * floor * 1.1,
        f"failed above {FAIL_RATIO:g}x floor",
        va="bottom",
        fontsize=9,
        color="gray",
    )
    ax.set_yscale("log")
    ax.set_ylim(_bottom(results), CLIP * 1.5)
    ax.set_xticks(results.sweep.depth)
    ax.set_xlabel("encoder layers = decoder layers")
    ax.set_ylabel("final test MSE (log scale)")
    counts = [len(arm.runs) for by_depth in results.sweep.by_arm().values() for arm in by_depth.values()]
    ax.set_title(f"Final test MSE against depth ({_over_seeds(counts, results)})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    path = out / "depth.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _over_seeds(counts: list[int], results: Results) -> str:
    """What a line and its band are, from the number of runs behind each line (``counts``): fewer
    than the seeds planned where a run was interrupted (the legend then says how many)."""
    seeds = len(results.config.seeds)
    if set(counts) != {seeds}:
        return "median of the seeds that finished, band: min-max; interrupted"
    return f"median of {seeds} seeds, band: min-max" if seeds > 1 else "1 seed"


def _runs_note(counts: list[int], results: Results) -> str:
    """A line's legend note where its runs (``counts``: one per point, or one for the line) are
    fewer than the seeds planned: ``" (1 of 3 seeds)"``, ``" (3, 2 of 3 seeds)"``."""
    seeds = len(results.config.seeds)
    return "" if set(counts) == {seeds} else f" ({', '.join(map(str, counts))} of {seeds} seeds)"


def _clip(v: float) -> float:
    return CLIP if not math.isfinite(v) or v > CLIP else v
