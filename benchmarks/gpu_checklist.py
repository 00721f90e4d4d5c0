"""The GPU checklist in one command: the first thing to run on a GPU machine (docs/gpu.md).

    python benchmarks/gpu_checklist.py                       # on a CUDA machine, 25 minutes at most
    python benchmarks/gpu_checklist.py --budget-minutes 12 --out /tmp/check
    python benchmarks/gpu_checklist.py --dry-run --out DIR   # no GPU: every part on a tiny CPU shape

Runs the parts below, most valuable first, and saves each one's rows (``NN-name.json``), table
(``NN-name.md``) and raw output (``NN-name.log``) under
``benchmarks/results/<YYYY-MM-DD>-<device>/`` as soon as it finishes, so a run cut off midway
keeps what finished; then ``summary.md``: every target, what was measured, met or not, and
which parts were skipped (a part whose estimate would overrun ``--budget-minutes``) or failed (a
part that raises records its error in its own files and the run goes on). The parts live in
``gpu_checklist_parts.py``. ``--dry-run`` runs the same functions on CPU tensors through
Triton's interpreter in well under a minute (``tests/test_gpu_checklist.py``), so none can rot
between GPU sessions.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Step:
    name: str
    minutes: float  # the estimate a GPU run checks against the budget before starting it (timed on
    # an H200's fresh machine, docs/gpu.md: a part longer than the budget left is skipped)
    why: str  # one line for the summary: what the part checks
    run: Callable  # (setup, state) -> Part


def steps(P) -> list[Step]:
    """The parts in the order they run: cheap and decisive first, long and time-boxed last."""

    def later_minutes(name: str) -> float:
        names = [s.name for s in order]
        return sum(s.minutes for s in order[names.index(name) + 1 :])

    def suite(setup, state):
        return P.test_suite(setup, timeout_s=state.time_box(later_minutes("tests"), cap_minutes=10))

    def widths(setup, state):
        return P.gpu_widths(setup, timeout_s=state.time_box(later_minutes("widths"), cap_minutes=4))

    order = [
        Step("env", 0.3, "device, driver and versions; copy bandwidth", lambda s, st: P.environment(s)),
        Step("invariance", 0.5, "a row's bits do not depend on the batch", lambda s, st: P.batch_invariance(s)),
        Step("dweight", 0.2, "dweight/dbias bitwise equal over two runs", lambda s, st: P.dweight_reproducible(s)),
        Step("graphs", 0.3, "forward+backward in a CUDA graph = eager", lambda s, st: P.cuda_graphs(s)),
        Step("parity", 1.5, "compat module vs flash-attn itself", lambda s, st: P.flash_attn_parity(s)),
        Step("kernels", 0.6, "kernels alone vs copy bandwidth", lambda s, st: P.kernel_table(s)),
        Step("host", 0.3, "host time per call at 8x768", lambda s, st: P.host_cost(s)),
        Step("dropout", 0.3, "fused dropout vs the plain add", lambda s, st: P.dropout_cost(s)),
        Step("parallel", 1.3, "parallel blocks: one call vs two, flash-attn", lambda s, st: P.parallel_block_cost(s)),
        Step("wallclock", 7.0, "per call vs torch eager, torch.compile, peers", lambda s, st: P.wall_clock(s)),
        Step("training", 1.0, "GPT-2 / Llama training step: tokens/s, memory", lambda s, st: P.training_step(s)),
        Step("widths", 2.0, "gpu_widths.py: real widths vs the fp64 oracle", widths),
        Step("tests", 1.0, "the test suite on the device (time-boxed)", suite),
    ]
    return order


PART_NAMES = [s.name for s in steps(None)]


class State:
    """The run's clock against its budget."""

    def __init__(self, budget_minutes: float, dry: bool):
        self.start = time.monotonic()
        self.budget_s = budget_minutes * 60
        self.dry = dry

    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    def fits(self, minutes: float) -> bool:
        return self.dry or self.elapsed_s() + minutes * 60 <= self.budget_s

    def time_box(self, later_minutes: float, cap_minutes: float) -> float:
        """Seconds a subprocess part may take: what the budget leaves after the parts behind it,
        at least its own estimate's minute, at most ``cap_minutes``."""
        if self.dry:
            return 120.0
        left = self.budget_s - self.elapsed_s() - later_minutes * 60
        return max(60.0, min(cap_minutes * 60, left))


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def run_parts(setup, state: State, out: Path, P, only: set[str] | None = None) -> list[tuple[Step, str, object]]:
    """Every part in order (those named in ``only``, if given), each saved as it finishes:
    ``(step, status, part or None)``."""
    done = []
    for i, step in enumerate(steps(P), start=1):
        stem = out / f"{i:02d}-{step.name}"
        if only is not None and step.name not in only:
            continue
        if not state.fits(step.minutes):
            used = state.elapsed_s() / 60
            status = f"skipped: {used:.1f} of {state.budget_s / 60:.0f} budget minutes used, needs ~{step.minutes}"
            P.save(P.Part(table=f"{status}\n", log=status), stem)
            done.append((step, status, None))
            print(f"[{i:02d}] {step.name}: {status}", flush=True)
            continue
        t = time.monotonic()
        try:
            part = step.run(setup, state)
            status = "ok"
        except Exception as err:  # noqa: BLE001 - one part failing must not stop the checklist
            status = f"error: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            part = P.Part(table=f"{status}\n", log=traceback.format_exc())
        P.save(part, stem)
        done.append((step, status, part))
        print(f"[{i:02d}] {step.name}: {status} ({time.monotonic() - t:.0f} s) -> {stem}.md", flush=True)
    return done


def summary(done, state: State, setup, P) -> str:
    """``summary.md``: the environment line, every target against what was measured, and each
    part's status."""
    env = next((p for s, st, p in done if s.name == "env" and p is not None and p.rows), None)
    head = "GPU checklist" + (" (dry run: tiny CPU shapes through Triton's interpreter)" if setup.dry else "")
    lines = [f"# {head}", ""]
    if env is not None:
        lines += [env.log, ""]
    targets = [
        ("kernel fwd ≥ 0.90 of copy at N=768..16384", "kernels"),
        ("kernel bwd ≥ 0.85 of copy at N=768..16384", "kernels"),
        ("wall clock ≥ 1.0x torch eager at every target shape", "wallclock"),
        ("host cost fwd ≤ torch eager + 15 µs", "host"),
        ("host cost fwd+bwd ≤ torch eager + 40 µs", "host"),
        ("dropout fwd+bwd within +15 % of the plain add", "dropout"),
        ("dweight bitwise reproducible", "dweight"),
        ("rows bitwise independent of the batch", "invariance"),
        ("compat: addnorm within 2x flash-attn's error + 1 rounding", "parity"),
        ("parallel block: one call ahead of every other", "parallel"),
        ("CUDA graphs give eager's results", "graphs"),
        ("gpu_widths.py", "widths"),
        ("test suite on the device", "tests"),
    ]
    found = {v[0]: v for s, st, p in done if p is not None for v in p.verdicts}
    status = {s.name: st for s, st, p in done}
    mark = {True: "**met**", False: "**NOT met**", None: "not judged"}
    lines += ["## Targets", "", "| target | measured | result |", "|---|---|---|"]
    for target, part in targets:
        verdict = found.get(target)
        if verdict is None:
            lines.append(f"| {target} | - | {status.get(part, 'not run')} |")
        else:
            lines.append(f"| {target} | {verdict[1]} | {mark[verdict[2]]} |")
    lines += ["", "## Parts", "", "| # | part | checks | status |", "|---|---|---|---|"]
    number = {s.name: i for i, s in enumerate(steps(P), start=1)}  # as the files are numbered
    lines += [f"| {number[s.name]:02d} | {s.name} | {s.why} | {st} |" for s, st, _ in done]
    skipped = [s.name for s, st, _ in done if st.startswith("skipped")]
    if skipped:
        lines += ["", f"Skipped to stay within the budget: {', '.join(skipped)}."]
    lines += ["", f"Ran {state.elapsed_s() / 60:.1f} minutes of a {state.budget_s / 60:.0f}-minute budget."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-minutes", type=float, default=25.0, help="skip parts that would overrun it (default 25)")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<date>-<device>/)")
    p.add_argument("--dry-run", action="store_true", help="no GPU: every part on a tiny shape on CPU tensors")
    p.add_argument("--only", metavar="PART,...", help=f"run these parts alone: {','.join(PART_NAMES)}")
    p.add_argument("--wall-shapes", metavar="MxN,...", help="the wallclock part's shapes (default: the targets')")
    p.add_argument(
        "--train-variants",
        metavar="VARIANT,...",
        help="the training part's variants: unpatched, addnorm, liger, each also +compile "
        "(torch.compile) or +graphs (its CUDA graphs) (default unpatched,addnorm,liger)",
    )
    p.add_argument(
        "--train-profile",
        action="store_true",
        help="the training part also profiles two steps of each variant: GPU kernel time per step, the norms' share",
    )
    p.add_argument(
        "--train-models",
        metavar="MODEL,...",
        help="the training part's models: gpt2-small, llama-2048x8 (default both)",
    )
    p.add_argument(
        "--dtypes", metavar="DTYPE,...", help="the dtypes the parts check and time (default bfloat16,float32)"
    )
    args = p.parse_args(argv)
    if args.budget_minutes <= 0:
        p.error(f"--budget-minutes must be positive, got {args.budget_minutes}")
    only = None if args.only is None else set(args.only.split(","))
    if only is not None and not only <= set(PART_NAMES):
        p.error(f"--only: unknown part(s) {','.join(sorted(only - set(PART_NAMES)))}; parts: {','.join(PART_NAMES)}")
    wall_shapes = dtypes = None
    try:
        if args.wall_shapes:
            wall_shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.wall_shapes.split(",")]
            if any(len(shape) != 2 or min(shape) < 1 for shape in wall_shapes):
                raise ValueError
    except ValueError:
        p.error(f"--wall-shapes: expected rows x columns, e.g. 16384x4096,65536x768; got {args.wall_shapes!r}")
    if args.dtypes:
        dtypes = args.dtypes.split(",")
        if not set(dtypes) <= {"bfloat16", "float16", "float32"}:
            p.error(f"--dtypes: expected bfloat16, float16 or float32, comma-separated; got {args.dtypes!r}")
    variants = None
    if args.train_variants:
        variants = args.train_variants.split(",")
        known = {f"{v}{c}" for v in ("unpatched", "addnorm", "liger") for c in ("", "+compile", "+graphs")}
        if not set(variants) <= known:
            p.error(
                f"--train-variants: expected {', '.join(sorted(known))}, comma-separated; got {args.train_variants!r}"
            )
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before addnorm's Triton kernels are first imported
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_checklist_parts as P
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device here: run with --dry-run to check the checklist itself", file=sys.stderr)
        return 2
    models = args.train_models.split(",") if args.train_models else None
    known = list(P.gpu_setup().models)
    if models and not set(models) <= set(known):
        p.error(f"--train-models: expected {', '.join(known)}, comma-separated; got {args.train_models!r}")
    setup = P.dry_setup() if args.dry_run else P.gpu_setup()
    if wall_shapes:
        setup = dataclasses.replace(setup, wall_shapes=wall_shapes)
    if dtypes:
        setup = dataclasses.replace(setup, dtypes=[getattr(torch, name) for name in dtypes])
    if variants:
        setup = dataclasses.replace(setup, train_variants=variants)
    if args.train_profile:
        setup = dataclasses.replace(setup, train_profile=True)
    if models and not args.dry_run:  # the dry run's one tiny model stands for them all
        setup = dataclasses.replace(setup, models={name: setup.models[name] for name in models})
    device = "cpu-interpreter" if args.dry_run else device_slug(torch.cuda.get_device_name())
    out = args.out or ROOT / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}-{device}"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"--out: cannot create {out}: {err.strerror}", file=sys.stderr)
        return 2
    state = State(args.budget_minutes, args.dry_run)
    done = run_parts(setup, state, out, P, only)
    (out / "summary.md").write_text(summary(done, state, setup, P))
    print(f"summary: {out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
