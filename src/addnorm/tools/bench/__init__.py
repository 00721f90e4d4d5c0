"""``addnorm bench``: addnorm's backends against torch eager, ``torch.compile`` and other norms.

Every implementation of a configuration (op, shape, dtype, pass) runs in the same process,
interleaved round by round (:func:`~.measure.measure`); we report the median and p20/p80 per
call, the throughput in GB/s from an explicit count of the bytes each call moves
(:func:`~.measure.bytes_moved`), that throughput as a fraction of a copy bandwidth measured in the
same run, and the ratio to torch eager.

The parts: :mod:`.rows` (the results rows and their file), :mod:`.measure` (the timing harness),
:mod:`.impls` (the implementations), :mod:`.table` (what is printed, ``--format``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys

import torch

from ..cli import CommandError, Interrupted, UsageError, check_threads, output_file
from .impls import DROPOUT_P, DTYPES, EPS, OTHER_IMPLS, all_impls, make_impl, out_variant, runner, traffic
from .measure import Copy, bytes_moved, copy_bandwidth, kernel_copy_bandwidth, kernel_seconds, measure, quantile, sync
from .rows import (
    DEFAULT_RESULTS,
    OPS,
    PASSES,
    ROW_FIELDS,
    append_rows,
    git_commit,
    machine_name,
    make_row,
    read_rows,
)
from .table import FORMATS, render

__all__ = [
    "DEFAULT_RESULTS",
    "DEFAULT_SHAPES",
    "DROPOUT_P",
    "DTYPES",
    "EPS",
    "FORMATS",
    "OPS",
    "OTHER_IMPLS",
    "PASSES",
    "ROW_FIELDS",
    "all_impls",
    "bytes_moved",
    "Copy",
    "copy_bandwidth",
    "git_commit",
    "kernel_copy_bandwidth",
    "kernel_seconds",
    "machine_name",
    "make_impl",
    "measure",
    "parse_shapes",
    "quantile",
    "read_rows",
    "register",
    "run",
    "run_config",
    "sync",
]

DEFAULT_SHAPES = "8x768,4096x768,4096x1024,2048x4096,16384x1024,512x65536"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"4096x768,8x768"`` -> ``[(4096, 768), (8, 768)]``, or a UsageError."""
    shapes = []
    for part in text.replace(" ", "").split(","):
        rows, sep, cols = part.lower().partition("x")
        if not sep or not _digits(rows) or not _digits(cols) or int(rows) < 1 or int(cols) < 1:
            raise UsageError(f"--shapes: expected ROWSxCOLS with positive ints (e.g. 4096x768), got {part!r}")
        shapes.append((int(rows), int(cols)))
    return shapes


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()  # (str.isdigit alone takes '²' and full-width digits)


def _choices(text: str, allowed: list[str], flag: str) -> list[str]:
    items = text.replace(" ", "").split(",")
    bad = [t for t in items if t not in allowed]  # (an empty item too: 'a,,b')
    if bad:
        raise UsageError(f"{flag}: expected a comma-separated list of {', '.join(allowed)}; got {text!r}")
    return list(dict.fromkeys(items))  # each once: a repeated configuration would be timed twice


# the (rows, cols) tensors a configuration holds at most: inputs, output gradients, outputs and
# gradients, and an unfused implementation's intermediates
_TENSORS_HELD = 12


def check_fits(shapes, dtypes, device: str) -> None:
    """A UsageError, before any measurement, for a configuration whose tensors cannot fit in the
    device's memory (physical memory on the CPU)."""
    if device == "cuda":
        total = torch.cuda.mem_get_info()[1]
    elif hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    else:
        return
    size = max(torch.empty(0, dtype=d).element_size() for d in dtypes)
    for rows, cols in shapes:
        need = _TENSORS_HELD * rows * cols * size
        if need > total:
            raise UsageError(
                f"--shapes: {rows}x{cols} needs about {need / 2**30:.1f} GiB ({_TENSORS_HELD} tensors of it), "
                f"more than the {total / 2**30:.1f} GiB of {device} memory here"
            )


_COPY = object()  # the copy's key among a configuration's runs: no implementation's name


def run_config(op, rows, cols, dtype, pass_, impls, device, rounds, reuse_out, copy=None) -> tuple[list[dict], dict]:
    """Measure ``impls`` on one configuration: (result rows, {impl: reason} for those skipped).
    ``copy`` (a :class:`.measure.Copy`), when given, is timed in the same rounds: each row's
    ``copy_gbps`` is then the copy bandwidth of the moments its configuration ran, not of the
    run's start (a shared machine's bandwidth drifts within a run)."""
    g = torch.Generator(device=device).manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, generator=g, device=device).to(dtype)
    x, dy = mk(rows, cols), mk(rows, cols)
    r = mk(rows, cols) if op.startswith("add_") else None
    w, b = mk(cols), (mk(cols) if "rms" not in op else None)
    runs, skipped = {}, {}
    for name in impls:
        try:
            fn = make_impl(name, op, device)
            if reuse_out:
                fn = out_variant(name, op, fn, x, r, w, b)
                if fn is None:
                    raise RuntimeError("no out= variant")
            run = runner(fn, pass_, x, r, w, b, dy)
            run()  # fail here, not in the timing loop
            runs[name] = run
        except ImportError as err:
            skipped[name] = f"not installed ({err.name or err})"
        except Exception as err:  # noqa: BLE001 - any failure of a third-party impl is reported, not fatal
            skipped[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if runs and copy is not None:
        runs[_COPY] = copy
    timings = measure(runs, rounds, device) if runs else {}
    copy_gbps = copy.gbps(timings.pop(_COPY)[0]) if _COPY in timings else None
    results = []
    for name, (med, p20, p80) in timings.items():
        # out= buffers: the stream's buffer is filled too
        nbytes = bytes_moved(op, rows, cols, dtype, pass_, writes_stream=reuse_out, **traffic(name, device, dtype))
        results.append(
            {
                "op": op,
                "pass": pass_,
                "rows": rows,
                "cols": cols,
                "dtype": str(dtype).removeprefix("torch."),
                "impl": name,
                "median_ms": med * 1e3,
                "p20_ms": p20 * 1e3,
                "p80_ms": p80 * 1e3,
                "bytes": nbytes,
                "gbps": nbytes / med / 1e9,
                **({"copy_gbps": copy_gbps} if copy_gbps is not None else {}),
            }
        )
    return results, skipped


def run(args) -> int:
    from rich.console import Console
    from rich.progress import Progress

    op_list = _choices(args.op, OPS, "--op")
    passes = _choices(args.pass_, PASSES, "--pass")
    dtypes = [DTYPES[d] for d in _choices(args.dtype, list(DTYPES), "--dtype")]
    impls = _choices(args.impl, all_impls(), "--impl") if args.impl else all_impls()
    shapes = list(dict.fromkeys(s for text in (args.shapes or [DEFAULT_SHAPES]) for s in parse_shapes(text)))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here")
    if args.threads is not None:
        check_threads(args.threads)
        torch.set_num_threads(args.threads)
    if args.rounds < 3:
        raise UsageError(f"--rounds must be at least 3, got {args.rounds}")
    if args.results is not None and not args.save:  # a file named, and nothing would go there
        raise UsageError("--results names the file --save appends to: add --save to save the rows")
    if args.out_buffers and passes != ["fwd"]:
        raise UsageError("--out-buffers measures inference: use it with --pass fwd")
    check_fits(shapes, dtypes, args.device)
    # outputs are checked before the first measurement: a run must not end failing to write them
    path = output_file(args.results or str(DEFAULT_RESULTS), "--results") if args.save else None
    if args.plot:
        from ..plot import new_figure, png_path

        new_figure()  # a clear error now if matplotlib is missing
        plot_path = png_path(args.plot, "bench.png", "--plot")

    # csv and json go alone to stdout, for programs; what people read goes to stderr then
    for_people = sys.stdout if args.format in ("table", "markdown") else sys.stderr
    say = lambda *lines: print(*lines, sep="\n", file=for_people)  # noqa: E731
    copy_gbps = copy_bandwidth(args.device)
    copy = Copy(args.device)  # timed again beside each configuration (run_config)
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    run_fields = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": machine_name(args.device),
        "device": args.device,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "copy_gbps": copy_gbps,
    }
    say(  # the machine's name alone may take most of a line
        f"{run_fields['machine']}, {run_fields['threads']} threads",
        f"torch {torch.__version__}, commit {run_fields['commit']}",
        f"copy bandwidth {copy_gbps:.1f} GB/s; load average {load}"
        + ("; outputs into reused buffers (out=)" if args.out_buffers else ""),
    )
    if args.format == "markdown":
        say("")
    configs = [(op, s, d, p) for op in op_list for s in shapes for d in dtypes for p in passes]
    results, skipped, finished = [], {}, 0
    # --pass bwd times backward calls of one forward kept (retain_graph), which a compiled graph
    # that donates its saved buffers to its backward refuses (at random configurations): off for
    # the run, as torch.compile's setting
    import torch._functorch.config as functorch_config

    keep_buffers = "torch-compile" in impls and "bwd" in passes
    try:
        with (
            functorch_config.patch(donated_buffer=False) if keep_buffers else contextlib.nullcontext(),
            Progress(console=Console(stderr=True), transient=True) as progress,
        ):
            task = progress.add_task("benchmarking", total=len(configs))
            for op, (rows, cols), dtype, pass_ in configs:
                progress.update(task, description=f"{op} {pass_} {rows}x{cols} {dtype}")
                res, skip = run_config(
                    op, rows, cols, dtype, pass_, impls, args.device, args.rounds, args.out_buffers, copy
                )
                res = [make_row(run_fields, r) for r in res]
                results += res
                skipped.update(skip)
                if path is not None:  # appended as each configuration finishes
                    append_rows(path, res)
                finished += 1
                progress.advance(task)
    except KeyboardInterrupt:  # Ctrl-C: what had finished is shown (and drawn) before stopping
        stopped = f"interrupted: {finished} of {len(configs)} configurations had finished"
    else:
        stopped = None
    try:
        print(render(results, skipped, args.format))
        if args.format in ("markdown", "csv") and skipped:  # (table and json show them themselves)
            say("", *(f"- {name}: {reason}" for name, reason in sorted(skipped.items())))
        if path is not None:
            say(f"appended {len(results)} rows to {path}")
        if args.plot and not results:
            say(f"no implementation ran: nothing to draw in {plot_path}")
    finally:  # drawn even when the table could not be printed (`addnorm bench --plot p.png | head`)
        if args.plot and results:
            from ..plot import draw_bench

            with contextlib.redirect_stdout(for_people):  # it prints where it wrote
                draw_bench(results, plot_path, "this run")
    if stopped:
        raise Interrupted(stopped + ("; their rows are shown above" if results else ""))
    if configs and not results:  # (every --impl asked for skipped: nothing was measured)
        raise CommandError(f"no implementation of --impl {','.join(impls)} could run here: nothing measured")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="measure addnorm against torch eager, torch.compile and other norms (GB/s)",
        description="Time each implementation of a norm on the same inputs, interleaved in one process: "
        "median and p20/p80 per call, GB/s from explicit byte counts, the fraction of the "
        "copy bandwidth measured in the same run, and the ratio to torch eager.",
    )
    p.add_argument("--op", default="add_layer_norm", help=f"comma-separated, of {', '.join(OPS)} (default %(default)s)")
    p.add_argument(
        "--shapes",
        "--shape",
        action="append",
        metavar="ROWSxCOLS[,...]",
        help=f"shapes to measure (repeatable); default {DEFAULT_SHAPES}",
    )
    p.add_argument(
        "--dtype", default="float32,bfloat16", help=f"comma-separated, of {', '.join(DTYPES)} (default %(default)s)"
    )
    p.add_argument(
        "--pass",
        dest="pass_",
        metavar="PASS",
        default="fwd,fwd+bwd",
        help=f"comma-separated, of {', '.join(PASSES)} (default %(default)s)",
    )
    p.add_argument("--impl", help="comma-separated implementations (default: all): " + ", ".join(all_impls()))
    p.add_argument("--threads", type=int, help="torch (and addnorm-cpu) threads; default: torch's")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to run (default cpu)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved samples per implementation (default 15)")
    p.add_argument(
        "--out-buffers",
        action="store_true",
        help="forward into preallocated buffers (out=; inference without allocation)",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="table",
        help="table: grouped by configuration, for a terminal; markdown: for docs; csv, json: for "
        "programs, alone on stdout (default %(default)s)",
    )
    p.add_argument("--save", action="store_true", help="append the rows as JSON lines to --results")
    p.add_argument("--results", metavar="FILE", help=f"JSONL file for --save (default {DEFAULT_RESULTS})")
    p.add_argument("--plot", metavar="PNG", help="write a bar chart of GB/s to this .png file (or folder)")
    p.set_defaults(func=run)
