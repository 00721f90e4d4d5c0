"""``addnorm bench``: addnorm's backends against torch eager, ``torch.compile`` and other norms.

Every implementation of a configuration (op, shape, dtype, pass) runs in the same process,
interleaved round by round, so that noise from other processes
hits all of them alike (the order is shuffled each round, so that no implementation always
follows the same one). Each sample times enough calls to last ~1 ms; we report the median and
p20/p80 per call, the throughput in GB/s from an explicit count of the bytes each pass must
move (:func:`bytes_moved`), that throughput as a fraction of a copy bandwidth measured in the
same run (``dst.copy_(src)`` of a 64 MiB buffer), and the ratio to torch eager.

Rows go to a JSONL file with ``--save`` (format: one object per line, fields in :data:`ROW_FIELDS`).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import backend as backends
from .. import reference
from .cli import UsageError, check_threads, output_file

# "*_dropout": Add & Norm with residual dropout at DROPOUT_P (the original Transformer's P_drop),
# fused in addnorm, against what one writes with torch: dropout, then the add, then the norm
OPS = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "add_layer_norm_dropout", "add_rms_norm_dropout"]
DROPOUT_P = 0.1
PASSES = ["fwd", "bwd", "fwd+bwd"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
DEFAULT_SHAPES = "8x768,4096x768,4096x1024,2048x4096,16384x1024,512x65536"
OTHER_IMPLS = ["liger", "apex", "flash-attn"]
ROW_FIELDS = [
    "time",
    "commit",
    "machine",
    "device",
    "threads",
    "torch",
    "op",
    "pass",
    "rows",
    "cols",
    "dtype",
    "impl",
    "median_ms",
    "p20_ms",
    "p80_ms",
    "bytes",
    "gbps",
]
DEFAULT_RESULTS = Path("benchmarks") / "results" / "bench.jsonl"
EPS = 1e-5


def all_impls() -> list[str]:
    return ["torch-eager", "torch-compile", "addnorm", *(f"addnorm-{b}" for b in backends.REGISTRY), *OTHER_IMPLS]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"4096x768,8x768"`` -> ``[(4096, 768), (8, 768)]``, or a UsageError."""
    shapes = []
    for part in text.replace(" ", "").split(","):
        rows, sep, cols = part.lower().partition("x")
        if not sep or not rows.isdigit() or not cols.isdigit() or int(rows) < 1 or int(cols) < 1:
            raise UsageError(f"--shapes: expected ROWSxCOLS with positive ints (e.g. 4096x768), got {part!r}")
        shapes.append((int(rows), int(cols)))
    return shapes


def _choices(text: str, allowed: list[str], flag: str) -> list[str]:
    items = [t for t in text.replace(" ", "").split(",") if t]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise UsageError(f"{flag}: expected a comma-separated list of {', '.join(allowed)}; got {text!r}")
    return items


def bytes_moved(op: str, rows: int, cols: int, dtype: torch.dtype, pass_: str) -> int:
    """Bytes a pass must read and write at least, counted from the tensors it touches.

    Forward reads x (and residual), writes y (and the stream s); backward reads dy and the
    saved x or s, writes dx (the residual's gradient is the same tensor); parameters (weight,
    and bias for LayerNorm) are read once and their gradients written once.
    """
    add = op.startswith("add_")
    params = 1 if "rms" in op else 2
    elems = {"fwd": rows * cols * (4 if add else 2) + cols * params, "bwd": rows * cols * 3 + cols * (1 + params)}
    total = sum(elems[p] for p in (("fwd", "bwd") if pass_ == "fwd+bwd" else (pass_,)))
    return total * torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------- implementations


def _torch_norm(op: str) -> Callable:
    rms = "rms" in op
    p = DROPOUT_P if op.endswith("_dropout") else 0.0

    def f(x, r, w, b):
        s = (F.dropout(x, p) if p else x) + r if r is not None else x
        return F.rms_norm(s, (s.shape[-1],), w, None) if rms else F.layer_norm(s, (s.shape[-1],), w, b, EPS)

    return f


def _addnorm_norm(op: str, backend: str) -> Callable:
    from .. import functional

    if op.endswith("_dropout"):
        fn = getattr(functional, op.removesuffix("_dropout"))
        if "rms" in op:
            return lambda x, r, w, b, **out: fn(x, r, x.shape[-1], w, dropout_p=DROPOUT_P, backend=backend, **out)
        return lambda x, r, w, b, **out: fn(x, r, x.shape[-1], w, b, dropout_p=DROPOUT_P, backend=backend, **out)
    fn = getattr(functional, op)
    # one plain call per op, as lean as _torch_norm's: at 8x768 each µs is ~10 % of the norm
    if op == "layer_norm":
        return lambda x, r, w, b, **out: fn(x, x.shape[-1], w, b, backend=backend, **out)
    if op == "rms_norm":
        return lambda x, r, w, b, **out: fn(x, x.shape[-1], w, backend=backend, **out)
    if op == "add_layer_norm":
        return lambda x, r, w, b, **out: fn(x, r, x.shape[-1], w, b, backend=backend, **out)
    return lambda x, r, w, b, **out: fn(x, r, x.shape[-1], w, backend=backend, **out)


def _reference_norm(op: str) -> Callable:
    rms = "rms" in op

    def f(x, r, w, b):
        eps = torch.finfo(reference.stats_dtype(x.dtype)).eps if rms else EPS  # torch's defaults
        # the formulas on all rows at once: reference.forward's row-block loop (a memory bound for
        # eager) would unroll into one graph per block under torch.compile
        return reference.forward_steps(x, r, w, None if rms else b, eps, rms, None)["y"].to(x.dtype)

    return f


def _other_norm(name: str, op: str, device: str) -> Callable:
    """Liger / Apex / flash-attn norms; ImportError when not installed, RuntimeError when unusable."""
    rms = "rms" in op
    p = DROPOUT_P if op.endswith("_dropout") else 0.0
    if p and name != "flash-attn":
        raise RuntimeError("no fused dropout")
    if name == "liger":
        from liger_kernel.transformers.functional import liger_layer_norm, liger_rms_norm

        def norm(s, w, b):
            return liger_rms_norm(s, w, 1e-6) if rms else liger_layer_norm(s, w, b, EPS)
    elif name == "apex":
        from apex.normalization.fused_layer_norm import fused_layer_norm_affine, fused_rms_norm_affine

        def norm(s, w, b):
            shape = (s.shape[-1],)
            return fused_rms_norm_affine(s, w, shape, EPS) if rms else fused_layer_norm_affine(s, w, b, shape, EPS)
    else:
        from flash_attn.ops.triton.layer_norm import layer_norm_fn

        def f(x, r, w, b):
            return layer_norm_fn(x, w, None if rms else b, residual=r, eps=EPS, dropout_p=p, is_rms_norm=rms)

        norm = None
    if device != "cuda":
        raise RuntimeError("needs a CUDA device")
    if norm is None:
        return f
    return lambda x, r, w, b: norm(x + r if r is not None else x, w, b)


def make_impl(name: str, op: str, device: str) -> Callable:
    """``f(x, residual, weight, bias) -> y`` for implementation ``name``; raises if unusable."""
    if name == "torch-eager":
        return _torch_norm(op)
    if name == "torch-compile":
        # a fresh compile per configuration: past dynamo's recompile limit (8) it would
        # silently run the reference eagerly
        torch._dynamo.reset()
        # with dropout: the torch code one would write, compiled (the reference has no dropout)
        return torch.compile(_torch_norm(op) if op.endswith("_dropout") else _reference_norm(op))
    if name == "addnorm":
        return _addnorm_norm(op, "auto")
    if name.startswith("addnorm-"):
        backend = name.removeprefix("addnorm-")
        probe = torch.empty(1, 4, device=device)
        reason = backends.unavailable_reason(backend, probe)
        if reason is not None:
            raise RuntimeError(reason)
        return _addnorm_norm(op, backend)
    return _other_norm(name, op, device)


def _out_variant(name: str, op: str, fn: Callable, x, r, w, b) -> Callable | None:
    """The forward of ``fn`` writing into preallocated buffers, or None if ``name`` has none."""
    y = torch.empty_like(x)
    s = torch.empty_like(x) if r is not None else None
    if name.startswith("addnorm"):
        out = {"out": y, "residual_out": s} if s is not None else {"out": y}
        return lambda x, r, w, b: fn(x, r, w, b, **out)
    if name == "torch-eager" and "rms" not in op and not op.endswith("_dropout"):
        m = x.new_empty((x.shape[0], 1))  # aten wants the statistics in x.dtype here
        rs = torch.empty_like(m)

        def f(x, r, w, b):
            src = torch.add(x, r, out=s) if r is not None else x
            return torch.ops.aten.native_layer_norm.out(src, [x.shape[-1]], w, b, EPS, out0=y, out1=m, out2=rs)

        return f
    return None


# --------------------------------------------------------------------------- timing


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _runner(fn: Callable, pass_: str, x, r, w, b, dy) -> Callable[[], object]:
    """A no-argument callable doing one ``pass_`` of ``fn`` on the given tensors."""
    leaves = [t for t in (x, r, w, b) if t is not None]
    if pass_ == "fwd":

        def run():
            with torch.no_grad():
                return fn(x, r, w, b)

        return run
    grads = [t.detach().requires_grad_() for t in leaves]
    it = iter(grads)
    gx, gr, gw, gb = (next(it) if t is not None else None for t in (x, r, w, b))
    if pass_ == "fwd+bwd":
        return lambda: torch.autograd.grad(fn(gx, gr, gw, gb), grads, dy)
    y = fn(gx, gr, gw, gb)
    return lambda: torch.autograd.grad(y, grads, dy, retain_graph=True)


def _time(run: Callable, reps: int, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    _sync(device)
    return (time.perf_counter() - t0) / reps


def _quantile(sorted_values: list[float], q: float) -> float:
    k = (len(sorted_values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def measure(runs: dict[str, Callable], rounds: int, device: str, min_sample_s: float = 1e-3) -> dict:
    """Interleaved timing of every callable in ``runs``: name -> (median, p20, p80) seconds per call."""
    reps = {}
    for name, run in runs.items():
        run()  # first call: compile, allocate, warm the caches
        t = _time(run, 1, device)
        reps[name] = max(1, min(1000, math.ceil(min_sample_s / max(t, 1e-7))))
    samples: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)  # a new order each round: no impl always runs right after the same one
        for name in order:
            samples[name].append(_time(runs[name], reps[name], device))
    out = {}
    for name, values in samples.items():
        values.sort()
        out[name] = (_quantile(values, 0.5), _quantile(values, 0.2), _quantile(values, 0.8))
    return out


def copy_bandwidth(device: str, mib: int = 64, rounds: int = 15) -> float:
    """GB/s of ``dst.copy_(src)`` on a ``mib`` MiB buffer (bytes read + bytes written)."""
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    median = measure({"copy": lambda: dst.copy_(src)}, rounds, device)["copy"][0]
    return 2 * src.numel() * 4 / median / 1e9


# --------------------------------------------------------------------------- rows


def machine_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cpus)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cpus)"


def git_commit() -> str:
    """HEAD's short hash, with ``-dirty`` when tracked files differ from it (the rows then
    describe code that no commit holds)."""
    here = Path(__file__).parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        if not head:
            return "unknown"
        changed = subprocess.run(  # (saved rows and edited docs leave the code as it was)
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ":(top,exclude)benchmarks/results",
                ":(top,exclude)docs",
            ],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return f"{head}-dirty" if changed else head
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_config(op, rows, cols, dtype, pass_, impls, device, rounds, reuse_out) -> tuple[list[dict], dict]:
    """Measure ``impls`` on one configuration: (result rows, {impl: reason} for those skipped)."""
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
                fn = _out_variant(name, op, fn, x, r, w, b)
                if fn is None:
                    raise RuntimeError("no out= variant")
            run = _runner(fn, pass_, x, r, w, b, dy)
            run()  # fail here, not in the timing loop
            runs[name] = run
        except ImportError as err:
            skipped[name] = f"not installed ({err.name or err})"
        except Exception as err:  # noqa: BLE001 - any failure of a third-party impl is reported, not fatal
            skipped[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:80] if str(err) else ''}"
    timings = measure(runs, rounds, device) if runs else {}
    nbytes = bytes_moved(op, rows, cols, dtype, pass_)
    results = [
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
        }
        for name, (med, p20, p80) in timings.items()
    ]
    return results, skipped


def _print_table(console, results: list[dict], skipped: dict, copy_gbps: float, title: str) -> None:
    from rich.table import Table

    table = Table(title=title)
    for col in ("op", "pass", "shape", "dtype", "impl", "median ms", "p20-p80 ms", "GB/s", "of copy bw", "vs torch"):
        table.add_column(col, justify="right" if col not in ("op", "pass", "impl", "dtype") else "left")
    eager = {
        (r["op"], r["pass"], r["rows"], r["cols"], r["dtype"]): r["median_ms"]
        for r in results
        if r["impl"] == "torch-eager"
    }
    for row in results:
        key = (row["op"], row["pass"], row["rows"], row["cols"], row["dtype"])
        ratio = f"{eager[key] / row['median_ms']:.2f}x" if key in eager else "-"
        table.add_row(
            row["op"],
            row["pass"],
            f"{row['rows']}x{row['cols']}",
            row["dtype"],
            row["impl"],
            f"{row['median_ms']:.3f}",
            f"{row['p20_ms']:.3f}-{row['p80_ms']:.3f}",
            f"{row['gbps']:.1f}",
            f"{row['gbps'] / copy_gbps:.2f}",
            ratio,
        )
    console.print(table)
    for name, reason in sorted(skipped.items()):
        console.print(f"  {name}: {reason}")


def run(args) -> int:
    from rich.console import Console
    from rich.progress import Progress

    op_list = _choices(args.op, OPS, "--op")
    passes = _choices(args.pass_, PASSES, "--pass")
    dtypes = [DTYPES[d] for d in _choices(args.dtype, list(DTYPES), "--dtype")]
    impls = _choices(args.impl, all_impls(), "--impl") if args.impl else all_impls()
    shapes = [s for text in (args.shapes or [DEFAULT_SHAPES]) for s in parse_shapes(text)]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here")
    if args.threads is not None:
        check_threads(args.threads)
        torch.set_num_threads(args.threads)
    if args.rounds < 3:
        raise UsageError(f"--rounds must be at least 3, got {args.rounds}")
    if args.out_buffers and passes != ["fwd"]:
        raise UsageError("--out-buffers measures inference: use it with --pass fwd")
    # outputs are checked before the first measurement: a run must not end failing to write them
    path = output_file(args.results, "--results") if args.save else None
    if args.plot:
        from .plot import new_figure, png_path

        new_figure()  # a clear error now if matplotlib is missing
        plot_path = png_path(args.plot, "bench.png", "--plot")

    console = Console()
    copy_gbps = copy_bandwidth(args.device)
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    header = (
        f"{machine_name(args.device)}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"copy bandwidth {copy_gbps:.1f} GB/s; load average {load}"
    )
    console.print(header)
    configs = [(op, s, d, p) for op in op_list for s in shapes for d in dtypes for p in passes]
    common = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": machine_name(args.device),
        "device": args.device,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    save = path.open("a") if path is not None else None  # rows appended as each configuration finishes
    results, skipped = [], {}
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("benchmarking", total=len(configs))
            for op, (rows, cols), dtype, pass_ in configs:
                progress.update(task, description=f"{op} {pass_} {rows}x{cols} {dtype}")
                res, skip = run_config(op, rows, cols, dtype, pass_, impls, args.device, args.rounds, args.out_buffers)
                results += res
                skipped.update(skip)
                if save is not None:
                    save.writelines(json.dumps({k: {**common, **row}[k] for k in ROW_FIELDS}) + "\n" for row in res)
                    save.flush()
                progress.advance(task)
    finally:
        if save is not None:
            save.close()
    _print_table(
        console,
        results,
        skipped,
        copy_gbps,
        "addnorm bench" + (" (outputs into reused buffers)" if args.out_buffers else ""),
    )
    if save is not None:
        console.print(f"appended {len(results)} rows to {path}")
    if args.plot and not results:
        console.print(f"no implementation ran: nothing to draw in {plot_path}")
    elif args.plot:
        from .plot import draw_bench

        draw_bench([{**common, **row} for row in results], plot_path, "this run")  # prints where it wrote
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
    p.add_argument("--save", action="store_true", help="append the rows as JSON lines to --results")
    p.add_argument(
        "--results", metavar="FILE", default=str(DEFAULT_RESULTS), help="JSONL file for --save (default %(default)s)"
    )
    p.add_argument("--plot", metavar="PNG", help="write a bar chart of GB/s to this .png file (or folder)")
    p.set_defaults(func=run)
