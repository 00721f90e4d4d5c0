"""What ``addnorm train`` reports: the results table, the readings (each prediction of the
literature judged seed by seed), ``report.md``, and the files of a finished run."""

from __future__ import annotations

import math
import pathlib

import numpy as np

from .config import Config
from .data import NOISE
from .plots import plot_results
from .schema import FAIL_RATIO, WITHIN, ArmResult, Results, RunSummary, Summary, first_epoch, summarize


def three_digits(v: float | None) -> str:
    """``v`` to 3 significant digits; "—" for a value that is missing or not finite."""
    return "—" if v is None or not math.isfinite(v) else f"{v:.3g}"


def table_rows(results: Results) -> list[list[str]]:
    """The results table: one row per arm (medians over seeds)."""
    rows = []
    for arm in results.arms.values():
        s = arm.summary
        lr = f"{arm.lr:g}"
        first = "never" if s.first_within is None else f"{s.first_within:g}"
        failed = ("yes" if s.failed else "no") if s.runs == 1 else f"{s.failed}/{s.runs}"
        final, best, ratio = three_digits(s.final), three_digits(s.best), three_digits(s.ratio)
        rows.append([arm.label, lr, final, best, ratio, first, failed, f"{s.seconds:.1f}"])
    return rows


TABLE_HEADER = [
    "arm",
    "lr",
    "final MSE",
    "best MSE",
    "final ÷ floor",
    f"epoch ≤ {WITHIN:g}x floor",
    "failed",
    "time (s)",
]


# --------------------------------------------------------------------------- readings


def _describe(arm: ArmResult) -> str:
    s = arm.summary
    off = (
        ""
        if s.first_below_fail is None or s.first_within is None
        else f"fell below {FAIL_RATIO:g}x the floor at epoch {s.first_below_fail:g}, "
    )
    when = (
        f"never came within {WITHIN:g}x the floor"
        if s.first_within is None
        else f"came within {WITHIN:g}x at epoch {s.first_within:g}"
    )
    return f"{arm.label} {off}{when} and ended at {three_digits(s.final)} ({three_digits(s.ratio)}x floor)"


def _speed(s: RunSummary | Summary) -> tuple[float, float]:
    """How well a run (or an arm's medians) trained: arriving within WITHIN x the floor earlier,
    then a lower final MSE, is better (smaller)."""
    final = s.final if s.final is not None and math.isfinite(s.final) else math.inf
    return (math.inf if s.first_within is None else s.first_within, final)


VERDICTS = ("Held", "Partly held", "Did not hold")
GROWTH = 1.2  # post-LN's gradient norm "grows toward the output": last / first layer at least this


def _judge(holds: list[bool]) -> tuple[str, str]:
    """A verdict from the seeds: held on all of them, on some (says how many), or on none."""
    n, k = len(holds), sum(holds)
    verdict = VERDICTS[0] if k == n else VERDICTS[2] if k == 0 else VERDICTS[1]
    return verdict, "" if n == 1 else f" ({k} of {n} seeds)"


def _seeds(results: Results, *names: str) -> list[tuple[RunSummary, ...]]:
    """Per seed, the summaries of the runs of ``names`` from that seed (seeds all of them ran)."""
    runs = [{r.seed: summarize(r.test_mse, results.floor) for r in results.arms[n].runs} for n in names]
    common = [seed for seed in runs[0] if all(seed in r for r in runs)]
    return [tuple(r[seed] for r in runs) for seed in common]


def readings(results: Results) -> list[tuple[str, str, str]]:
    """``(prediction, verdict, what happened)`` for each prediction whose arms were run; the verdict
    is one of :data:`VERDICTS`, judged seed by seed (each seed's runs against each other)."""
    if results.sweep is not None:
        return sweep_readings(results)
    a = results.arms
    out = []

    def add(prediction: str, holds: list[bool], what: str) -> None:
        verdict, seeds = _judge(holds)
        out.append((prediction, verdict, f"{what}{seeds}."))

    if {"pre", "post"} <= a.keys():
        add(
            "Pre-LN trains without warmup; post-LN without warmup struggles (Xiong et al. 2020).",
            [not pre.failed and _speed(pre) < _speed(post) for pre, post in _seeds(results, "pre", "post")],
            f"{_describe(a['pre'])}; {_describe(a['post'])}",
        )
    if {"post-warmup", "post"} <= a.keys():
        add(
            "Warmup rescues post-LN (Vaswani et al. 2017; Xiong et al. 2020).",
            [not w.failed and _speed(w) < _speed(p) for w, p in _seeds(results, "post-warmup", "post")],
            f"{_describe(a['post-warmup'])}; without warmup, {_describe(a['post'])}",
        )
    if "post-small-lr" in a:
        add(
            "A smaller learning rate keeps post-LN stable without warmup, at the cost of speed.",
            [not s.failed for (s,) in _seeds(results, "post-small-lr")],
            _describe(a["post-small-lr"]),
        )
    for large in ("post-warmup-large-lr", "post-large-lr"):
        if {large, "pre-large-lr"} <= a.keys():
            pre, post = a["pre-large-lr"], a[large]
            warm = " even with warmup" if large == "post-warmup-large-lr" else ""
            add(
                f"At a larger learning rate pre-LN still trains without warmup; post-LN{warm} does not "
                "(Xiong et al. 2020).",
                [not p.failed and _speed(p) < _speed(q) for p, q in _seeds(results, "pre-large-lr", large)],
                f"{_describe(pre)}; {_describe(post)}",
            )
    normed = [n for n in ("post", "pre") if n in a]
    if "none" in a and normed:
        add(
            "Without a norm the deep residual stack trains worse than with one.",
            [r[0].failed or all(_speed(r[0]) > _speed(n) for n in r[1:]) for r in _seeds(results, "none", *normed)],
            _describe(a["none"]),
        )
    g = results.grad_norms
    if len(g["post"]["encoder"]) < 2:  # a trend over layers needs at least two
        return out
    growth = {pos: {part: g[pos][part][-1] / g[pos][part][0] for part in g[pos]} for pos in g}
    # "grows": the last layer's gradient norm at least GROWTH x the first's, and more than pre-LN's
    parts = [growth["post"][p] >= GROWTH and growth["post"][p] > growth["pre"][p] for p in growth["post"]]
    held = VERDICTS[0] if all(parts) else VERDICTS[1] if any(parts) else VERDICTS[2]
    scale = {p: np.mean(g["post"][p]) / np.mean(g["pre"][p]) for p in g["post"]}
    out.append(
        (
            "At initialisation post-LN's gradient norm grows toward the last layers, pre-LN's does not "
            "(Xiong et al. 2020, Fig. 3).",
            held,
            f"mean of {results.grad_inits} initialisations, last layer ÷ first layer: post-LN encoder "
            f"{growth['post']['encoder']:.2f}, decoder {growth['post']['decoder']:.2f}; pre-LN encoder "
            f"{growth['pre']['encoder']:.2f}, decoder {growth['pre']['decoder']:.2f} (a trend counts "
            f"from {GROWTH:g}). Post-LN's gradients are {scale['encoder']:.1f}x pre-LN's in the encoder "
            f"and {scale['decoder']:.1f}x in the decoder, on average.",
        )
    )
    return out


def _failed(arm: ArmResult) -> str:
    return f"{arm.summary.failed}/{arm.summary.runs}"


def sweep_readings(results: Results) -> list[tuple[str, str, str]]:
    """The depth sweep's reading: post-LN fails more often as it gets deeper, pre-LN at no depth."""
    arms = results.sweep.by_arm()
    if not {"post", "pre"} <= arms.keys() or len(arms["post"]) < 2:
        return []
    post, pre = arms["post"], arms["pre"]
    shallow, deep = min(post), max(post)
    grows = post[deep].summary.failed / post[deep].summary.runs > (
        post[shallow].summary.failed / post[shallow].summary.runs
    )
    pre_ok = not any(arm.summary.failed for arm in pre.values())
    verdict = VERDICTS[0] if grows and pre_ok else VERDICTS[1] if grows or pre_ok else VERDICTS[2]
    seen = ", ".join(f"depth {d}: {_failed(arm)}" for d, arm in post.items())
    seen_pre = ", ".join(f"depth {d}: {_failed(arm)}" for d, arm in pre.items())
    return [
        (
            "Post-LN's trouble grows with depth; pre-LN's does not (Liu et al. 2020).",
            verdict,
            f"failed runs, post-LN {seen}; pre-LN {seen_pre}.",
        )
    ]


def sweep_rows(results: Results) -> tuple[list[str], list[list[str]]]:
    """The depth sweep's table: per arm and depth, the median final test MSE ÷ floor and the failed runs."""
    arms = results.sweep.by_arm()
    depths = sorted({d for by_depth in arms.values() for d in by_depth})
    header = ["arm", "lr", *(f"depth {d}" for d in depths)]
    rows = []
    for by_depth in arms.values():
        first = next(iter(by_depth.values()))
        cells = [
            f"{three_digits(by_depth[d].summary.ratio)}x ({_failed(by_depth[d])} failed)" if d in by_depth else "—"
            for d in depths
        ]
        rows.append([first.label, f"{first.lr:g}", *cells])
    return header, rows


# --------------------------------------------------------------------------- report.md


def _wobble(results: Results) -> str:
    """How much the test MSE moves once a run has come within WITHIN x the floor."""
    after = []
    for arm in results.arms.values():
        for r in arm.runs:
            first = first_epoch(r.test_mse, WITHIN * results.floor)
            after += [v for v in r.test_mse[first - 1 :] if math.isfinite(v)] if first else []
    if not after:
        return ""
    lo, hi = min(after) / results.floor, max(after) / results.floor
    return (
        f"Once within {WITHIN:g}x the floor, runs kept moving between {lo:.1f}x and {hi:.1f}x of it from "
        "epoch to epoch, so a difference of an epoch or two in the "
        f"{WITHIN:g}x column, or a small one in the final MSE, is within that noise. "
    )


def _schedule_text(results: Results) -> str:
    arms = results.all_arms()
    warm = next((arm for arm in arms if arm.warmup_steps), None)
    decay = f"Learning rate: decays linearly to zero over the {arms[0].steps} steps"
    if warm is None:
        return decay + "."
    return (
        f"{decay}; the arms with warmup ({', '.join(dict.fromkeys(a.label for a in arms if a.warmup_steps))}) "
        f"first rise linearly from zero over the first {warm.warmup_steps} steps, then decay to zero."
    )


def smaller_than_default(cfg: Config) -> bool:
    """Fewer layers or epochs than the default run: the literature's predictions say little there."""
    return cfg.depth < Config.depth or cfg.epochs < Config.epochs


def below_floor(results: Results) -> str:
    """A warning where an arm's median final test MSE is below the noise floor, which no model
    reaches on noisy square corners: the data (``--data``) are not those, and the floor and the
    verdicts read against it say little; else ""."""
    finals = [np.median([_final(r) for r in arm.runs]) for arm in results.all_arms()]
    if not any(f < results.floor for f in finals):
        return ""
    return (
        f"the models end below the noise floor ({min(finals):.4g} < {results.floor:.4g}): these data are not "
        "noisy corners of [-1, 1]², so the floor and the verdicts read against it say little"
    )


def _final(run) -> float:
    v = run.test_mse[-1]
    return v if v is not None and math.isfinite(v) else math.inf


def _floor_text(data: str | None) -> str:
    """What the noise floor is, for the generated sequences or for ``--data``."""
    if data is None:
        return f"the test MSE of predicting the exact corners (≈ σ² = {NOISE**2:g}); no model can do better on average"
    return (
        "the test MSE of predicting, for each target point, the corner of [-1, 1]² nearest to it; "
        "if the data are noisy corners, no model can do better on average"
    )


def report_markdown(results: Results) -> str:
    """``report.md``: the command, the setup, the table, the figures and the readings."""
    cfg = results.config
    sweep = results.sweep is not None
    layers = (
        f"{', '.join(map(str, results.sweep.depth))} encoder and as many decoder layers (a depth sweep)"
        if sweep
        else f"{cfg.depth} + {cfg.depth} layers"
    )
    dropout = f", residual dropout {cfg.dropout:g}" if cfg.dropout else ""
    lines = [
        "# What the norm and its placement do to training" + (": a depth sweep" if sweep else ""),
        "",
        f"Command: `{results.command}` — {results.seconds:.0f} s wall clock, "
        f"{results.cpu_seconds:.0f} s of CPU time in all ({results.workers} process(es)), "
        f"torch {results.torch}, {cfg.threads} thread(s) per process.",
        "",
    ]
    stopped = results.interrupted
    if stopped:
        lines += [
            f"**Interrupted:** {stopped.finished} of {stopped.planned} runs had finished; "
            "the tables and readings below are of those alone.",
            "",
        ]
    lines += [
        f"Model: encoder-decoder Transformer, {layers}, d_model {cfg.d_model}, "
        f"{cfg.n_heads} heads, FFN {cfg.d_ff}, norm `{cfg.norm}`{dropout}; Adam betas "
        f"{tuple(cfg.betas)}, batch {cfg.batch_size}, {cfg.epochs} epochs, seeds {cfg.seeds}. "
        f"Data: {results.data}. Given the first two corners the model predicts the last two; test MSE is "
        "measured autoregressively after every epoch.",
        "",
        f"**Noise floor: {results.floor:.4f}** — {_floor_text(cfg.data)}. A run *failed* if its "
        f"final test MSE is above {FAIL_RATIO:g}x the floor or not finite.",
        "",
    ]
    note = below_floor(results)
    if note:
        lines += [f"**Note:** {note}.", ""]
    if sweep:
        header, rows = sweep_rows(results)
        lines += [
            _schedule_text(results) + " Each cell: the median over seeds of the final test MSE ÷ floor, and "
            "how many runs failed.",
            "",
            *_markdown_table(header, rows),
            "",
            "![final test MSE against depth](depth.png)",
            "",
            "## Reading",
            "",
        ]
    else:
        lines += [
            _schedule_text(results) + f" *epoch ≤ {WITHIN:g}x floor* is the first epoch whose test MSE is "
            f"within {WITHIN:g}x the floor; the table shows medians over seeds (failed: how many seeds failed).",
            "",
            *_markdown_table(TABLE_HEADER, table_rows(results)),
            "",
            "![test MSE per epoch](curves.png)",
            "",
            "![gradient norm per layer at initialisation](grad_norms.png)",
            "",
            "## Reading: what the literature predicts, and what happened here",
            "",
        ]
        if smaller_than_default(cfg):
            lines += [
                f"This run is smaller than the default ({Config.depth} + {Config.depth} layers, "
                f"{Config.epochs} epochs); the predictions are about deep models trained for longer, "
                "so the verdicts below say little.",
                "",
            ]
    for prediction, held, what in readings(results):
        lines += [f"- **{prediction}** {held} here: {what}", ""]
    n_seeds = len(cfg.seeds)
    lines += [
        "These readings are generated from the numbers above by fixed rules, seed by seed (each seed's "
        f"runs against each other): arriving within {WITHIN:g}x the floor earlier, then a lower final MSE, "
        f"counts as training better; a run fails above {FAIL_RATIO:g}x the floor. "
        + ("" if sweep else _wobble(results))
        + (
            "One seed on one small task is a demonstration, not a benchmark: rerun with `--seeds 3` to see "
            "how much of it is luck."
            if n_seeds == 1
            else f"{n_seeds} seeds on one small task are a demonstration, not a benchmark."
        ),
        "",
    ]
    return "\n".join(lines)


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def write_outputs(results: Results, out_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """Write ``results.json``, the plots (:func:`plot_results`) and ``report.md`` into ``out_dir``."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_json = out / "results.json"
    results.write(results_json)
    pngs = plot_results(results_json, out)
    report = out / "report.md"
    report.write_text(report_markdown(results))
    return [results_json, *pngs, report]


# --------------------------------------------------------------------------- the terminal


def rich_table(results: Results):
    """The results table for the terminal (80 columns): report.md's, without the best MSE."""
    from rich import box
    from rich.table import Table

    table = Table(
        title=f"test MSE, noise floor {results.floor:.4f} (medians over {len(results.config.seeds)} seed(s))",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    if results.sweep is not None:
        headers, rows = sweep_rows(results)  # one column per depth: "ratio x (k/n failed)"
        headers = [h.replace("depth ", "depth\n") for h in headers]
        rows = [[*row[:2], *(c.replace(" (", "\n(").replace(" failed", "") for c in row[2:])] for row in rows]
        table.title = f"final test MSE ÷ noise floor {results.floor:.4f}, median over seeds (failed runs)"
        for i, header in enumerate(headers):
            table.add_column(header, justify="left" if i < 2 else "right", no_wrap=True)
        for row in rows:
            table.add_row(*row)
        return table
    rows = [row[:3] + row[4:] for row in table_rows(results)]  # report.md also has the best MSE
    headers = [
        "arm",
        "lr",
        "final\nMSE",
        "final\n÷ floor",
        f"epoch\n≤{WITHIN:g}x fl.",
        "failed",
        "time\n(s)",
    ]  # TABLE_HEADER on two lines: fits 80 columns
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i < 2 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table
