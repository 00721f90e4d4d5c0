"""``addnorm train``: its options, the progress bars while the arms train, the table and the
readings, and the files it writes (checked writable before any training starts)."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import sys

from ..cli import CommandError, Interrupted, UsageError, check_threads, output_dir
from .config import ARMS, DEFAULT_ARMS, Config
from .data import load_data, noise_floor
from .plots import pyplot
from .report import VERDICTS, below_floor, readings, rich_table, smaller_than_default, three_digits, write_outputs
from .schema import Results
from .training import Job, jobs_of, run_experiment

QUICK = dict(epochs=2, depth=1, seeds=[0])  # the whole pipeline in seconds (tests, CI)
SWEEP_DEPTHS = [2, 4, 6, 8]  # --sweep depth (Liu et al. 2020: post-LN's trouble grows with depth)
SWEEP_ARMS = ["post", "pre", "post-warmup"]
QUICK_DEPTHS = [1, 2]


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(f"{flag}: expected positive whole numbers separated by commas, got {text!r}")
    return sorted(set(values))


def config_from_args(args) -> tuple[Config, list[int] | None]:
    """The run's :class:`Config`, and the depths of a depth sweep (None without ``--sweep``)."""
    default_arms = SWEEP_ARMS if args.sweep else DEFAULT_ARMS
    arms = [a.strip() for a in args.arms.split(",")] if args.arms else list(default_arms)
    if arms == ["all"]:
        arms = list(ARMS)
    unknown = [a for a in arms if a not in ARMS]  # (an empty item too: 'pre,,post')
    if unknown:
        raise UsageError(f"--arms: unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    for name in ("seeds", "epochs", "depth", "jobs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be at least 1, got {value}")
    check_threads(args.threads)
    if args.lr is not None and not (args.lr > 0 and math.isfinite(args.lr)):
        raise UsageError(f"--lr must be a positive number, got {args.lr}")
    if not 0 <= args.dropout < 1:  # NaN fails too
        raise UsageError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.sweep and args.depth is not None:
        raise UsageError("--depth: a depth sweep trains at every depth of --depths; give those instead")
    if args.depths is not None and not args.sweep:
        raise UsageError("--depths only applies to '--sweep depth'")
    cfg = Config(
        arms=list(dict.fromkeys(arms)), norm=args.norm, data=args.data, threads=args.threads, dropout=args.dropout
    )
    if args.quick:
        cfg = dataclasses.replace(cfg, **QUICK)
    for name in ("epochs", "depth", "lr"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    if args.seeds is not None:
        cfg.seeds = list(range(args.seeds))
    if not args.sweep:
        return cfg, None
    default_depths = QUICK_DEPTHS if args.quick else SWEEP_DEPTHS
    return cfg, default_depths if args.depths is None else _int_list(args.depths, "--depths")


def default_workers() -> int:
    """One worker process per CPU this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def command_line(args) -> str:
    """The ``addnorm train`` command that reproduces ``args`` (options left at their default
    omitted; ``--jobs`` changes how long a run takes, not its results)."""
    import shlex

    words = ["addnorm", "train"]
    for name in ("sweep", "depths", "arms", "seeds", "epochs", "depth", "lr", "data", "out"):
        if getattr(args, name) is not None:
            words += [f"--{name}", str(getattr(args, name))]
    if args.dropout:
        words += ["--dropout", f"{args.dropout:g}"]
    if args.norm != "layer":
        words += ["--norm", args.norm]
    if args.threads != 1:
        words += ["--threads", str(args.threads)]
    return shlex.join(words + (["--quick"] if args.quick else []))


def run(args) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cfg, depths = config_from_args(args)
    try:
        pyplot()
        if cfg.data is not None and noise_floor(load_data(cfg)[1]) == 0:
            raise ValueError(
                f"--data {cfg.data}: the test points lie exactly on the corners of [-1, 1]², so the noise "
                "floor is 0 and the results, read against it, would mean nothing; give noisy sequences"
            )
    except (RuntimeError, ValueError) as err:
        raise UsageError(str(err)) from err
    writes = (
        "a depth sweep writes results.json, depth.png and report.md"
        if depths
        else "train writes results.json, curves.png, grad_norms.png and report.md"
    )
    out_dir = output_dir(args.out, "--out", writes)
    if (out_dir / "results.json").exists() and not args.force:  # (a finished run: never lost unasked)
        raise UsageError(
            f"--out: {args.out!r} holds a finished run (results.json); give another folder, "
            "or --force to replace that run"
        )
    jobs = jobs_of(cfg, depths)
    workers = min(args.jobs or default_workers(), len(jobs))
    console = _console()
    layers = f"depth {','.join(map(str, depths))}" if depths else f"{cfg.depth}+{cfg.depth} layers"
    console.print(
        f"[bold]addnorm train[/]: {len(cfg.arms)} arm(s) x {len(cfg.seeds)} seed(s), {layers}, "
        f"{cfg.epochs} epochs, norm {cfg.norm!r}, base lr {cfg.lr:g}"
        + (f", dropout {cfg.dropout:g}" if cfg.dropout else "")
        + f"; {len(jobs)} runs in {workers} process(es)"
    )
    columns = (
        TextColumn("{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("last test MSE {task.fields[mse]}"),
        TimeElapsedColumn(),
    )
    results = _train(cfg, depths, workers, jobs, Progress(*columns, console=console, auto_refresh=False))
    stopped = results.interrupted
    if stopped and not stopped.finished:
        raise Interrupted("interrupted before any run finished; nothing written")
    # written before anything is printed: a closed or full stdout loses no finished run
    results = dataclasses.replace(results, command=command_line(args))
    failed, written = None, []
    try:
        written = write_outputs(results, out_dir)
    except OSError as err:  # the folder was checked at the start; keep the results if it went away since
        failed = CommandError(f"--out: cannot write into {args.out!r} ({err}); {_rescue(results)}")
    for stale in (out_dir / name for name in _OUTPUTS):  # (a replaced run's files this one does not write)
        if not failed and stale not in written and stale.exists():
            stale.unlink()
    console.print(rich_table(results))
    if smaller_than_default(cfg) and not depths:
        console.print(
            f"(smaller than the default {Config.depth}+{Config.depth} layers, "
            f"{Config.epochs} epochs: the verdicts below say little)"
        )
    note = below_floor(results)
    if note:
        console.print(f"[yellow]note[/]: {note}")
    colours = dict(zip(VERDICTS, ("green", "yellow", "red"), strict=True))
    for prediction, held, _ in readings(results):
        console.print(f"[{colours[held]}]{held.lower()}[/]: {prediction}")
    if failed:
        raise failed
    console.print(f"wrote {', '.join(str(p) for p in written)} ({results.seconds:.0f} s)")
    if stopped:
        raise Interrupted(
            f"interrupted: {stopped.finished} of {stopped.planned} runs had finished; {out_dir} holds those"
        )
    return 1 if console.quiet else 0  # (quiet: the reader went away, as `addnorm explain | head` ends)


def _console():
    """rich's Console, except that a reader going away (``addnorm train | head``) silences it
    instead of exiting: the runs go on and their files are written (rich's own handler raises
    SystemExit, which would lose them)."""
    from rich.console import Console

    class QuietOnBrokenPipe(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):  # stdout is not a real file
                pass

    return QuietOnBrokenPipe()


def _train(cfg: Config, depths, workers: int, jobs, bars) -> Results:
    """Every run of ``jobs``, one progress bar per arm (and depth). A stdout closed or full as
    the bars are drawn (at the end, when it is not a terminal) loses none of the runs."""
    epochs_done: dict[Job, int] = {}
    results = None
    try:
        # no refresh thread: the training processes are forked from this one (training._train_in_pool)
        with bars as bar:
            tasks = {}
            for name, _, depth in jobs:
                label = ARMS[name].title(cfg.norm) + (f", depth {depth}" if depths else "")
                if (name, depth) not in tasks:
                    tasks[name, depth] = bar.add_task(label, total=cfg.epochs * len(cfg.seeds), mse="—")

            def progress(job: Job, done: int, mse: float) -> None:
                epochs_done[job] = done
                name, _, depth = job
                total = sum(n for (a, _, d), n in epochs_done.items() if (a, d) == (name, depth))
                bar.update(tasks[name, depth], completed=total, mse=three_digits(mse))
                bar.refresh()

            results = run_experiment(cfg, progress, workers, depths)
    except OSError:  # stdout full (rich's own error: a closed one silences the console instead)
        if results is None:
            raise
    return results


_OUTPUTS = ("results.json", "report.md", "curves.png", "grad_norms.png", "depth.png")  # what a run may write


def _rescue(results: Results) -> str:
    """Save ``results`` to a fresh temporary folder; says where (or that it could not)."""
    import tempfile

    try:
        path = pathlib.Path(tempfile.mkdtemp(prefix="addnorm-train-")) / "results.json"
        results.write(path)
    except OSError as err:
        return f"could not save the results anywhere either ({err})"
    return f"the results are saved in {path}: 'addnorm plot train --results {path}' draws them"


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a deep Transformer with the norm after, before, or nowhere; compare",
        description="Train the same deep encoder-decoder Transformer on the square-corners task with "
        "different norm placements and learning-rate schedules (arms), side by side, and report "
        "test MSE against the noise floor, gradient norms at initialisation, plots and a "
        "reading.",
    )
    p.add_argument(
        "--arms",
        help=f"comma-separated arms to run (default: {','.join(DEFAULT_ARMS)}; with --sweep depth: "
        f"{','.join(SWEEP_ARMS)}); 'all' runs every one: {', '.join(ARMS)}",
    )
    p.add_argument("--seeds", type=int, help=f"number of seeds per arm (seeds 0..N-1; default {len(Config().seeds)})")
    p.add_argument("--epochs", type=int, help=f"training epochs (default {Config.epochs})")
    p.add_argument("--depth", type=int, help=f"encoder layers = decoder layers (default {Config.depth})")
    p.add_argument("--lr", type=float, help=f"base learning rate (default {Config.lr:g})")
    p.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        metavar="P",
        help="residual dropout on every sublayer's output, fused into its Add & Norm (the original "
        "Transformer: 0.1; default 0)",
    )
    p.add_argument(
        "--sweep",
        choices=["depth"],
        help=f"train the arms at several depths instead (default arms {','.join(SWEEP_ARMS)}); writes depth.png",
    )
    p.add_argument(
        "--depths", metavar="D,D,...", help=f"the depths of --sweep depth (default {','.join(map(str, SWEEP_DEPTHS))})"
    )
    p.add_argument(
        "--jobs",
        type=int,
        help="training processes run side by side (default: one per CPU); the results do not depend on it",
    )
    p.add_argument("--norm", choices=["layer", "rms"], default="layer", help="LayerNorm or RMSNorm (default layer)")
    p.add_argument("--data", metavar="FILE", help="your own sequences: .npy or .csv of shape [n, 4, 2]")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the model is tiny)")
    p.add_argument("--out", default="addnorm-train", metavar="DIR", help="output folder (default ./addnorm-train)")
    p.add_argument(
        "--force", action="store_true", help="replace the finished run the --out folder holds (refused without it)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny run for a smoke test: {QUICK['depth']}+{QUICK['depth']} layers, {QUICK['epochs']} epochs, "
        f"{len(QUICK['seeds'])} seed (with --sweep depth: depths {','.join(map(str, QUICK_DEPTHS))})",
    )
    p.set_defaults(func=run)
