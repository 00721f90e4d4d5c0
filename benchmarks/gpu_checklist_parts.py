"""The parts of ``benchmarks/gpu_checklist.py``: each a small function of the run's :class:`Setup`
returning a :class:`Part` (rows, a markdown table, raw output, and verdicts on the targets).

On a GPU every part times or checks the Triton backend on CUDA tensors; with ``--dry-run`` the
same functions run on a tiny shape on CPU tensors through Triton's interpreter, so that every
table is built and no part can rot unseen.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import addnorm
from addnorm.tools import bench

ROOT = Path(__file__).resolve().parents[1]
PEERS = ("liger-kernel", "quack-kernels", "flash-attn")
OTHER_IMPLS = ["liger", "quack", "flash-attn"]  # timed beside addnorm where installed
EPS = 1e-5


@dataclass(frozen=True)
class Setup:
    """What a run measures: a GPU run, or the dry run's tiny CPU version of every part."""

    device: str
    dry: bool
    kernel_shapes: list[tuple[int, int]]
    wall_shapes: list[tuple[int, int]]
    dropout_shape: tuple[int, int]
    dtypes: list[torch.dtype]
    rounds: int
    host_calls: int
    invariance_widths: list[int]
    invariance_batch: int
    dweight_shape: tuple[int, int]
    wall_impls: list[str]
    pytest_args: list[str]
    widths_args: list[str]
    models: dict[str, dict]  # e2e: name -> transformers config kwargs
    train_variants: list[str]  # e2e: unpatched, addnorm, liger, each "+compile" too (torch.compile)
    tokens: tuple[int, int]  # e2e: (batch, sequence)
    steps: int
    parity_shapes: list[tuple[int, int]]  # addnorm.compat.flash_attn against flash-attn itself
    parallel_cases: list[tuple[int, int, float]]  # parallel blocks (rows, cols, dropout_p): one call, two calls, peers
    train_profile: bool = False  # e2e: also profile two steps of each variant (kernel_profile)


def gpu_setup() -> Setup:
    return Setup(
        device="cuda",
        dry=False,
        kernel_shapes=[(65536, 768), (16384, 1024), (16384, 2048), (32768, 4096), (8192, 8192), (4096, 16384)],
        wall_shapes=[
            (4096, 4096),
            (16384, 4096),
            (32768, 4096),
            (8192, 8192),
            (65536, 768),
            (16384, 1024),
            (4096, 65536),
        ],
        dropout_shape=(4096, 4096),
        dtypes=[torch.bfloat16, torch.float32],
        rounds=9,
        host_calls=1000,
        invariance_widths=[768, 4096, 16384, 65536],
        invariance_batch=4096,
        dweight_shape=(16384, 4096),
        wall_impls=["addnorm-triton", "torch-eager", "torch-compile", *OTHER_IMPLS],
        pytest_args=[
            "tests/test_functional.py",
            "tests/test_triton.py",
            "tests/test_dropout.py",
            "tests/test_batch_invariance.py",
            "tests/test_determinism.py",
            "tests/test_parallel_blocks.py",
            "tests/test_compat_flash_attn.py",
            "tests/test_backend_contract.py",
        ],
        widths_args=[],
        models={
            "gpt2-small": dict(kind="gpt2", n_layer=12, n_embd=768, n_head=12, vocab_size=50257),
            "llama-2048x8": dict(
                kind="llama", num_hidden_layers=8, hidden_size=2048, intermediate_size=5632, num_attention_heads=16
            ),
        },
        train_variants=["unpatched", "addnorm", "liger"],
        tokens=(8, 1024),
        steps=6,
        parity_shapes=[(2048, 4096)],  # flash-attn autotunes (6 compiles) every case it meets
        parallel_cases=[(4096, 4096, 0.0), (16384, 4096, 0.0), (65536, 768, 0.0), (16384, 4096, 0.1)],
    )


def dry_setup() -> Setup:
    return Setup(
        device="cpu",
        dry=True,
        kernel_shapes=[(8, 64)],
        wall_shapes=[(8, 64)],
        dropout_shape=(8, 64),
        dtypes=[torch.bfloat16],
        rounds=3,
        host_calls=2,
        invariance_widths=[64],
        invariance_batch=6,
        dweight_shape=(16, 64),
        # torch.compile on CPU tensors compiles C++ for longer than the dry run may take
        wall_impls=["addnorm-triton", "torch-eager", *OTHER_IMPLS],
        pytest_args=["tests/test_triton.py::test_bf16_results_are_rounded_to_nearest_even"],
        widths_args=["--help"],
        models={
            "gpt2-tiny": dict(
                kind="gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0
            )
        },
        train_variants=["unpatched", "addnorm", "liger"],
        tokens=(1, 8),
        steps=1,
        parity_shapes=[(8, 64)],
        parallel_cases=[(8, 64, 0.0), (8, 64, 0.1)],
    )


@dataclass
class Part:
    """What one part found: ``rows`` (saved as JSON), ``table`` (markdown), ``log`` (raw output)
    and ``verdicts``: ``(target, what was measured, met)`` for the summary (met None: no data)."""

    rows: list[dict] = field(default_factory=list)
    table: str = ""
    log: str = ""
    verdicts: list[tuple[str, str, bool | None]] = field(default_factory=list)


def markdown(rows: list[dict], columns: list[str] | None = None) -> str:
    """``rows`` as a markdown table (every key of the first row, or ``columns``)."""
    if not rows:
        return "| (no rows) |\n|---|\n"
    columns = columns or list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _randn(setup: Setup, *shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator(device=setup.device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=setup.device).to(dtype)


# --------------------------------------------------------------------------- 1. environment


def environment(setup: Setup) -> Part:
    """Device, driver, torch, Triton and peers' versions, and the copy bandwidth."""
    import triton

    env = {"device": bench.machine_name(setup.device), "python": platform.python_version()}
    if setup.device == "cuda":
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        try:
            env["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as err:
            env["driver"] = f"unknown ({type(err).__name__})"
        env["cuda"] = torch.version.cuda
    env |= {"torch": torch.__version__, "triton": triton.__version__, "commit": bench.git_commit()}
    for name in PEERS:
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            # flash-attn's Triton norms also run from its source files alone (docs/gpu.md)
            module = importlib.util.find_spec(name.replace("-", "_").removesuffix("_kernels"))
            env[name] = "not installed" if module is None else f"source files ({module.origin})"
    env["copy_gbps"] = bench.copy_bandwidth(setup.device, mib=4 if setup.dry else 64)
    line = ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in env.items())
    return Part(rows=[env], table=markdown([env]), log=line)


# --------------------------------------------------------------------------- 2. correctness


def _subprocess(cmd: list[str], timeout_s: float, env: dict | None = None) -> tuple[int | str, str]:
    """``(exit status or "timeout", output)`` of ``cmd`` run from the repository root."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout_s)
        return done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"") + (err.stderr or b"")
        return "timeout", out.decode(errors="replace") if isinstance(out, bytes) else out


def test_suite(setup: Setup, timeout_s: float) -> Part:
    """The test selection on the device (``ADDNORM_TEST_DEVICE``), time-boxed. Verbose, so that a
    run cut off by its time box still names the tests that failed before then."""
    env = {"ADDNORM_TEST_DEVICE": setup.device}
    workers = max(2, min(15, (os.cpu_count() or 2) - 1))  # workers compile kernels in parallel
    workers = [] if setup.dry or importlib.util.find_spec("xdist") is None else ["-n", str(workers)]
    cmd = [sys.executable, "-m", "pytest", "-v", "-rf", "-p", "no:cacheprovider", *workers, *setup.pytest_args]
    status, out = _subprocess(cmd, timeout_s, env)
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", out)}
    # "[gw1] [ 9%] FAILED tests/x.py::t" (xdist), "tests/x.py::t FAILED [ 9%]", "FAILED tests/x.py::t" (-rf)
    failed = sorted({a or b for a, b in re.findall(r"(?:FAILED|ERROR) (tests/\S+)|(tests/\S+) (?:FAILED|ERROR)", out)})
    if not counts:  # cut off by the time box: count the verbose lines seen so far
        counts = {
            "passed so far": len(re.findall(r" PASSED\b", out)),
            "failed so far": len(failed),
        }
    row = {"command": " ".join(cmd[1:]), "status": status, "timeout_s": round(timeout_s), **counts}
    row["failed tests"] = " ".join(failed) or "-"
    ok = status == 0
    return Part(rows=[row], table=markdown([row]), log=out, verdicts=[("test suite on the device", str(counts), ok)])


def gpu_widths(setup: Setup, timeout_s: float) -> Part:
    """``benchmarks/gpu_widths.py``: the real widths CI never reaches (``--help`` in the dry run)."""
    cmd = [sys.executable, "benchmarks/gpu_widths.py", *setup.widths_args]
    status, out = _subprocess(cmd, timeout_s)
    lines = [line for line in out.splitlines() if line.rstrip().endswith(("ok", "FAIL"))]
    rows = [{"check": line.rsplit("  ", 1)[0].strip(), "result": line.rsplit(" ", 1)[1]} for line in lines]
    rows = rows or [{"check": " ".join(cmd[1:]), "result": f"exit {status}"}]
    verdict = None if setup.dry else status == 0
    return Part(rows=rows, table=markdown(rows), log=out, verdicts=[("gpu_widths.py", f"exit {status}", verdict)])


def _add_norm(op: str, x, r, w, b, **kw):
    n = x.shape[-1]
    if op == "add_layer_norm":
        return addnorm.add_layer_norm(x, r, n, w, b, prenorm=True, backend="triton", **kw)
    return addnorm.add_rms_norm(x, r, n, w, prenorm=True, backend="triton", **kw)


def _row_results(op, x, r, w, b, dy, call=None, **kw) -> list[torch.Tensor]:
    """``y``, ``s`` and the gradients of ``x`` and ``residual``, for a row-wise comparison (through
    ``call(x, r)`` when given)."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, r)]
    y, s = _add_norm(op, *leaves, w, b, **kw) if call is None else call(*leaves)
    dx, dr = torch.autograd.grad((y, s), leaves, (dy, dy))
    return [y.detach(), s.detach(), dx, dr]


def batch_invariance(setup: Setup) -> Part:
    """A row computed alone and inside a big batch (first and last position): the same bits."""
    rows, all_ok = [], True
    for n in setup.invariance_widths:
        m = max(2, min(setup.invariance_batch, 2**24 // n))
        for dtype in setup.dtypes:
            for op in ("add_layer_norm", "add_rms_norm"):
                x, r, dy = (_randn(setup, m, n, dtype=dtype, seed=i) for i in range(3))
                w, b = _randn(setup, n, dtype=dtype, seed=3), _randn(setup, n, dtype=dtype, seed=4)
                batch = _row_results(op, x, r, w, b, dy)
                same = True
                for pos in (0, m - 1):
                    alone = _row_results(op, x[pos : pos + 1], r[pos : pos + 1], w, b, dy[pos : pos + 1])
                    same &= all(torch.equal(a[0], t[pos]) for a, t in zip(alone, batch, strict=True))
                all_ok &= same
                rows.append({"op": op, "shape": f"{m}x{n}", "dtype": _dtype_name(dtype), "bitwise equal": same})
    verdict = ("rows bitwise independent of the batch", f"{len(rows)} cases, y, s, dx, dresidual", all_ok)
    return Part(rows=rows, table=markdown(rows), verdicts=[verdict])


def dweight_reproducible(setup: Setup) -> Part:
    """dweight and dbias of two identical backward passes: the same bits."""
    m, n = setup.dweight_shape
    rows = []
    for dtype in setup.dtypes:
        x, r, dy = (_randn(setup, m, n, dtype=dtype, seed=i) for i in range(3))
        grads = []
        for _ in range(2):
            w, b = (_randn(setup, n, dtype=dtype, seed=s).requires_grad_() for s in (3, 4))
            y, s = _add_norm("add_layer_norm", x, r, w, b)
            grads.append(torch.autograd.grad((y, s), (w, b), (dy, dy)))
        same = all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
        rows.append({"shape": f"{m}x{n}", "dtype": _dtype_name(dtype), "dweight, dbias bitwise equal": same})
    ok = all(r["dweight, dbias bitwise equal"] for r in rows)
    return Part(rows=rows, table=markdown(rows), verdicts=[("dweight bitwise reproducible", f"{m}x{n}", ok)])


def cuda_graphs(setup: Setup) -> Part:
    """Forward + backward captured in a CUDA graph and replayed gives eager's results: after a
    warm-up, and with a constant of the kernels (eps) first needed inside the capture; and the
    forward under ``torch.compile(mode="reduce-overhead")`` (a CUDA graph tree), first called
    there. The dry run compares two eager runs: there is no graph capture on CPU."""
    m, n = setup.wall_shapes[0]
    x, r, dy = (_randn(setup, m, n, dtype=torch.bfloat16, seed=i) for i in range(3))
    w, b = _randn(setup, n, dtype=torch.bfloat16, seed=3), _randn(setup, n, dtype=torch.bfloat16, seed=4)
    if setup.device != "cuda":
        eager = _row_results("add_layer_norm", x, r, w, b, dy)
        outs, how = _row_results("add_layer_norm", x, r, w, b, dy), "eager twice (no CUDA graphs on CPU)"
        rows = [{"output": k, "how": how, "equal to eager": torch.equal(a, e)} for k, a, e in zip(NAMES, outs, eager)]
        return Part(rows=rows, table=markdown(rows), verdicts=[("CUDA graphs give eager's results", how, None)])
    rows = []
    for how, eps in (("captured and replayed", None), ("captured, eps new in the capture", 1e-3)):
        rows += _graph_rows(how, x, r, w, b, dy, eps, _captured)
    rows += _graph_rows("torch.compile reduce-overhead", x, r, w, b, dy, 2e-3, _tree)
    ok = all(row["equal to eager"] is True for row in rows)
    hows = ", ".join(dict.fromkeys(row["how"] for row in rows))
    return Part(rows=rows, table=markdown(rows), verdicts=[("CUDA graphs give eager's results", hows, ok)])


NAMES = ("y", "s", "dx", "dresidual")


def _graph_rows(how: str, x, r, w, b, dy, eps: float | None, run: Callable) -> list[dict]:
    """``run``'s results against eager's, one row per output (eager after it, which would make and
    keep a new eps first), or one row with the error it raised."""
    kw = {} if eps is None else {"eps": eps}
    try:
        got = run(x, r, w, b, dy, kw)
        want = _row_results("add_layer_norm", x, r, w, b, dy, **kw)
    except Exception as err:  # noqa: BLE001 - recorded as a failed row; the other checks go on
        return [{"output": "-", "how": how, "equal to eager": f"{type(err).__name__}: {err}"[:200]}]
    return [{"output": k, "how": how, "equal to eager": torch.equal(a, e)} for k, a, e in zip(NAMES, got, want)]


def _captured(x, r, w, b, dy, kw: dict) -> list[torch.Tensor]:
    """:func:`_row_results` captured in a CUDA graph and replayed: warmed up on a side stream
    first, unless ``kw`` names an eps (its constant then first made inside the capture)."""
    static = [t.clone() for t in (x, r, dy)]
    if not kw:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compile and allocate outside the capture
                _row_results("add_layer_norm", static[0], static[1], w, b, static[2])
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _row_results("add_layer_norm", static[0], static[1], w, b, static[2], **kw)
    for out in outs:
        out.zero_()  # so that only the replay can have written the results
    graph.replay()
    torch.cuda.synchronize()
    return outs


def _tree(x, r, w, b, dy, kw: dict) -> list[torch.Tensor]:
    """:func:`_row_results` with the forward compiled with CUDA graph trees, called three times
    (warm-up, recording, replay)."""
    compiled = torch.compile(lambda x, r: _add_norm("add_layer_norm", x, r, w, b, **kw), mode="reduce-overhead")
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        outs = [t.clone() for t in _row_results("add_layer_norm", x, r, w, b, dy, call=compiled)]
    torch.cuda.synchronize()
    return outs


# --------------------------------------------------------------------------- 3. performance


def _device_ms(fn: Callable[[], object], setup: Setup) -> float:
    """Device time per call, host excluded (``bench.kernel_seconds``: a CUDA graph of the call
    replayed between CUDA events; wall time on CPU tensors, the dry run)."""
    return bench.kernel_seconds(fn, setup.device) * 1e3


def _copy_gbps(setup: Setup) -> float:
    """The copy bandwidth timed as the kernels are (``bench.kernel_copy_bandwidth``)."""
    return bench.kernel_copy_bandwidth(setup.device, mib=4 if setup.dry else 256)


def _kernel_rows(setup: Setup, m: int, n: int, dtype: torch.dtype, copy_gbps: float) -> list[dict]:
    from addnorm.kernels import triton as K

    x, r, dy = (_randn(setup, m, n, dtype=dtype, seed=i) for i in range(3))
    w, b = _randn(setup, n, dtype=dtype, seed=3), _randn(setup, n, dtype=dtype, seed=4)
    _, s, mean, rstd = K.forward(x, r, w, b, eps=EPS, rms=False, residual_dtype=None)
    passes = {
        "fwd": lambda: K.forward(x, r, w, b, eps=EPS, rms=False, residual_dtype=None),
        "bwd": lambda: K.backward(dy, None, (s,), w, mean, rstd, rms=False, has_bias=True),
    }
    rows = []
    for pass_, fn in passes.items():
        ms = _device_ms(fn, setup)
        # the kernels' forward with its defaults (a training forward's) writes the stream and the
        # statistics (writes_unused)
        gbps = bench.bytes_moved("add_layer_norm", m, n, dtype, pass_, writes_unused=True) / ms / 1e6
        row = {"pass": pass_, "shape": f"{m}x{n}", "dtype": _dtype_name(dtype), "ms": ms}
        rows.append(row | {"GB/s": gbps, "of copy": gbps / copy_gbps})
    return rows


def kernel_table(setup: Setup) -> Part:
    """The Triton kernels alone (``addnorm.kernels.triton``): forward (add + LayerNorm with weight
    and bias) and backward, as a fraction of a copy timed the same way."""
    copy_gbps = _copy_gbps(setup)
    rows = [{"pass": "copy", "shape": "", "dtype": "", "ms": "", "GB/s": copy_gbps, "of copy": 1.0}]
    for m, n in setup.kernel_shapes:
        for dtype in setup.dtypes:
            rows += _kernel_rows(setup, m, n, dtype, copy_gbps)
    verdicts = []
    for pass_, target in (("fwd", 0.90), ("bwd", 0.85)):
        got = [r for r in rows if r["pass"] == pass_ and 768 <= int(r["shape"].split("x")[1]) <= 16384]
        worst = min(got, key=lambda r: r["of copy"]) if got else None
        seen = f"worst {worst['of copy']:.2f} at {worst['shape']} {worst['dtype']}" if worst else "no data"
        name = f"kernel {pass_} ≥ {target:.2f} of copy at N=768..16384"
        verdicts.append((name, seen, None if setup.dry or not worst else worst["of copy"] >= target))
    return Part(rows=rows, table=markdown(rows), verdicts=verdicts)


def _quack(op: str) -> Callable:
    """quack-kernels' RMSNorm with its fused residual add (CuTe DSL, CUDA only), in
    ``bench.make_impl``'s calling convention."""
    import quack

    if op != "add_rms_norm":
        raise RuntimeError("quack has RMSNorm only")

    def f(x, r, w, b):
        out = quack.rmsnorm(x, w, residual=r, eps=EPS)
        return out[0] if isinstance(out, tuple) else out

    return f


def _impl(name: str, op: str, device: str) -> Callable:
    return _quack(op) if name == "quack" else bench.make_impl(name, op, device)


def _wall_rows(setup: Setup, entries: list[tuple[str, str]], shape, dtype, pass_: str) -> tuple[list[dict], dict]:
    """Wall-clock time per call of each ``(op, impl)`` of ``entries``, interleaved
    (``bench.measure``), with the ratio to torch eager on the same op; and ``{entry: why}`` for
    those that could not run."""
    m, n = shape
    x, r, dy = (_randn(setup, m, n, dtype=dtype, seed=i) for i in range(3))
    w, b = _randn(setup, n, dtype=dtype, seed=3), _randn(setup, n, dtype=dtype, seed=4)
    grad_mode = torch.no_grad if pass_ == "fwd" else torch.enable_grad
    runs, skipped = {}, {}
    for op, name in entries:
        try:
            fn = _impl(name, op, setup.device)
            if pass_ == "fwd":
                run = lambda fn=fn: fn(x, r, w, b)  # noqa: E731
            else:
                leaves = [t.detach().requires_grad_() for t in (x, r, w, b)]
                run = lambda fn=fn, lv=leaves: torch.autograd.grad(fn(*lv), lv, dy, allow_unused=True)  # noqa: E731
            with grad_mode():
                run()  # fail here, not in the timing loop
            runs[op, name] = run
        except ImportError as err:
            skipped[f"{op} {name}"] = f"not installed ({err.name or err})"
        except Exception as err:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            skipped[f"{op} {name}"] = f"{type(err).__name__}: {str(err).splitlines()[0][:80] if str(err) else ''}"
    timed = {}
    if runs:
        with grad_mode():
            timed = bench.measure(runs, setup.rounds, setup.device)
    rows = []
    for (op, name), (med, _, _) in timed.items():
        eager = timed.get((op, "torch-eager"), (None,))[0]
        row = {"op": op, "pass": pass_, "shape": f"{m}x{n}", "dtype": _dtype_name(dtype), "impl": name}
        gbps = bench.bytes_moved(op, m, n, dtype, pass_) / med / 1e9
        rows.append(row | {"ms": med * 1e3, "GB/s": gbps, "vs torch eager": eager / med if eager else ""})
    return rows, skipped


def wall_clock(setup: Setup) -> Part:
    """``add_layer_norm`` per call, host included, against torch eager, torch.compile and the
    peers installed (``add_rms_norm`` too, in bf16, where quack has its RMSNorm); target: addnorm
    at least torch eager's speed at every shape."""
    rows, skipped = [], {}
    layer_impls = [i for i in setup.wall_impls if i != "quack"]  # quack has no LayerNorm to compare
    rms_impls = [i for i in setup.wall_impls if i != "torch-compile"]
    for shape in setup.wall_shapes:
        for dtype in setup.dtypes:
            for pass_ in ("fwd", "fwd+bwd"):
                entries = [("add_layer_norm", i) for i in layer_impls]
                if dtype == torch.bfloat16:
                    entries += [("add_rms_norm", i) for i in rms_impls]
                got, skip = _wall_rows(setup, entries, shape, dtype, pass_)
                rows += got
                skipped |= skip
    ours = [r for r in rows if r["impl"] == "addnorm-triton" and r["vs torch eager"] != ""]
    worst = min(ours, key=lambda r: r["vs torch eager"]) if ours else None
    seen = "no data"
    if worst:
        seen = f"worst {worst['vs torch eager']:.2f}x ({worst['op']} {worst['pass']} {worst['shape']} {worst['dtype']})"
    met = None if setup.dry or not worst else worst["vs torch eager"] >= 1.0
    log = "\n".join(f"{k}: {v}" for k, v in sorted(skipped.items()))
    verdicts = [("wall clock ≥ 1.0x torch eager at every target shape", seen, met)]
    return Part(rows=rows, table=markdown(rows) + ("\nnot run: " + log if log else ""), log=log, verdicts=verdicts)


def dropout_cost(setup: Setup) -> Part:
    """Fused residual dropout forward + backward against the plain fused add, same shape,
    interleaved."""
    entries = [("add_layer_norm", "addnorm-triton"), ("add_layer_norm_dropout", "addnorm-triton")]
    rows, skipped = _wall_rows(setup, entries, setup.dropout_shape, torch.bfloat16, "fwd+bwd")
    if skipped:
        raise RuntimeError(f"could not run: {skipped}")
    ms = {row["op"]: row["ms"] for row in rows}
    ratio = ms["add_layer_norm_dropout"] / ms["add_layer_norm"]
    m, n = setup.dropout_shape
    met = None if setup.dry else ratio <= 1.15
    table = markdown(rows, ["op", "pass", "shape", "dtype", "impl", "ms"]) + f"\ndropout / plain: {ratio:.3f}x\n"
    verdicts = [("dropout fwd+bwd within +15 % of the plain add", f"{ratio:.2f}x at {m}x{n} bf16", met)]
    return Part(rows=rows, table=table, verdicts=verdicts)


def host_cost(setup: Setup) -> Part:
    """Host time per call at 8x768 bf16, no sync inside the loop (the device keeps up with tiny
    kernels), averaged over ``host_calls`` calls; targets: torch eager +15 µs forward, +40 µs
    forward + backward, for ``addnorm`` as users call it (``backend="auto"``: a forward without
    gradients takes the shortcut to the triton backend's ``plain_forward``); ``addnorm-triton``
    (the backend named: the general route) beside it."""
    n = 768 if not setup.dry else 64
    x, r, dy = (_randn(setup, 8, n, dtype=torch.bfloat16, seed=i) for i in range(3))
    w, b = _randn(setup, n, dtype=torch.bfloat16, seed=3), _randn(setup, n, dtype=torch.bfloat16, seed=4)
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
    rows = []
    for impl in ("addnorm", "addnorm-triton", "torch-eager"):
        fn = bench.make_impl(impl, "add_layer_norm", setup.device)
        cases = {
            "fwd": lambda fn=fn: fn(x, r, w, b),
            "fwd+bwd": lambda fn=fn: torch.autograd.grad(fn(*leaves), leaves, dy),
        }
        for pass_, call in cases.items():
            for _ in range(3 if setup.dry else 50):
                call()
            _sync(setup.device)
            t = time.perf_counter()
            for _ in range(setup.host_calls):
                call()
            us = (time.perf_counter() - t) / setup.host_calls * 1e6
            _sync(setup.device)
            rows.append({"impl": impl, "pass": pass_, "shape": f"8x{n}", "host µs/call": us})
    verdicts = []
    for pass_, allowed in (("fwd", 15), ("fwd+bwd", 40)):
        ours, eager = (
            next(r["host µs/call"] for r in rows if r["impl"] == i and r["pass"] == pass_)
            for i in ("addnorm", "torch-eager")
        )
        name = f"host cost {pass_} ≤ torch eager + {allowed} µs"
        verdicts.append((name, f"{ours:.1f} vs {eager:.1f} µs", None if setup.dry else ours <= eager + allowed))
    return Part(rows=rows, table=markdown(rows), verdicts=verdicts)


def _model(kind: str, dtype: torch.dtype, device: str, **config) -> torch.nn.Module:
    """A Hugging Face model with random weights from ``config`` (no download), without dropout."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tf.GPT2Config(**config, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = tf.GPT2LMHeadModel(cfg)
    else:
        cfg = tf.LlamaConfig(**config, vocab_size=32000, max_position_embeddings=1024)
        model = tf.LlamaForCausalLM(cfg)
    return model.to(device=device, dtype=dtype)


def _patched(variant: str, model: torch.nn.Module, kind: str, backend: str) -> torch.nn.Module:
    if variant == "addnorm":
        addnorm.patch(model, fuse_residual=True, backend=backend)
    elif variant == "liger":
        if kind != "llama":
            raise RuntimeError("Liger has no GPT-2 patch")
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        # its norms only, as addnorm's patch replaces norms only (Liger's default also swaps the
        # MLP, RoPE and the loss)
        kw = dict(rope=False, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=False)
        apply_liger_kernel_to_llama(rms_norm=True, model=model, **kw)
    return model


def training_step(setup: Setup) -> Part:
    """A training step (forward, loss, backward, AdamW) of a GPT-2-small-shaped and a
    Llama-shaped stack with random weights: unpatched, addnorm's patch, Liger's patch, and each
    under ``torch.compile`` where ``setup.train_variants`` names it ("addnorm+compile"), or under
    ``torch.compile(mode="reduce-overhead")``, whose CUDA graphs replay the step's launches
    without their host code ("addnorm+graphs"); tokens/s, peak memory and the first step's seconds
    (a compile's included). Liger's patch rewrites the Llama module globally, so its variants run
    last."""
    rows, log = [], []
    batch, seq = setup.tokens
    backend = "triton"
    dtype = torch.bfloat16 if not setup.dry else torch.float32
    for name, cfg in setup.models.items():
        cfg = dict(cfg)
        kind = cfg.pop("kind")
        for variant in sorted(setup.train_variants, key=lambda v: v.startswith("liger")):
            try:
                base, _, how = variant.partition("+")
                model = _patched(base, _model(kind, dtype, setup.device, **cfg), kind, backend)
                graphs = how == "graphs"
                if how:
                    model = torch.compile(model, mode="reduce-overhead" if graphs else "default")
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
                ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=setup.device)

                def step(model=model, opt=opt, ids=ids, graphs=graphs):
                    if graphs:  # a new step: the last one's graph outputs may be overwritten
                        torch.compiler.cudagraph_mark_step_begin()
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                t = time.perf_counter()
                step()
                _sync(setup.device)
                first_s = time.perf_counter() - t
                if setup.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t = time.perf_counter()
                for _ in range(setup.steps):
                    step()
                _sync(setup.device)
                elapsed = time.perf_counter() - t
                peak = torch.cuda.max_memory_allocated() / 2**30 if setup.device == "cuda" else ""
                row = {"model": name, "variant": variant, "tokens/s": batch * seq * setup.steps / elapsed}
                rows.append(row | {"peak GiB": peak, "first step s": first_s})
                if setup.train_profile:
                    kernels = kernel_profile(step, setup.device, steps=2)
                    rows[-1] |= {"kernel ms/step": kernels.total_ms, "norm kernels ms/step": kernels.norm_ms}
                    log.append(f"{name} {variant}: {kernels.describe()}")
                del model, opt
            except ImportError as err:
                log.append(f"{name} {variant}: not installed ({err.name or err})")
            except Exception as err:  # noqa: BLE001 - one variant failing must not end the part
                log.append(
                    f"{name} {variant}: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
                )
            if setup.device == "cuda":
                torch.cuda.empty_cache()
    text = "\n".join(log)
    return Part(rows=rows, table=markdown(rows) + ("\n" + text if text else ""), log=text)


# the kernels of a norm, by name: addnorm's own, torch's eager layer_norm, Inductor's generated
# ones (named after the ops they fuse: "native_layer_norm", or RMSNorm's "rsqrt"), Liger's
NORM_KERNELS = re.compile(r"_forward_kernel|_backward_kernel|_sum_partials|_coef_kernel|layer_norm|rsqrt|rms_norm")


@dataclass
class KernelProfile:
    """The GPU kernels of a few profiled steps: the time per step of all of them, of the norms'
    (:data:`NORM_KERNELS`), and the costliest kernels by name."""

    total_ms: float
    norm_ms: float
    top: list[tuple[str, float, int]]  # (name, ms per step, launches per step)

    def describe(self) -> str:
        lines = [f"kernels {self.total_ms:.2f} ms/step, of which norms {self.norm_ms:.2f}"]
        lines += [f"  {ms:8.3f} ms {calls:5d}x  {name[:110]}" for name, ms, calls in self.top]
        return "\n".join(lines)


def kernel_profile(step: Callable, device: str, steps: int, top: int = 12) -> KernelProfile:
    """Runs ``step`` ``steps`` times under torch's profiler and sums its GPU kernels' durations by
    name (from the trace's ``kernel`` events; none on a CPU)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    by_name: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "kernel" and "dur" in e:
            by_name.setdefault(e["name"], []).append(e["dur"] / 1000 / steps)
    total = sum(sum(d) for d in by_name.values())
    norms = sum(sum(d) for n, d in by_name.items() if NORM_KERNELS.search(n))
    ranked = sorted(((n, sum(d), len(d) // steps) for n, d in by_name.items()), key=lambda r: -r[1])
    return KernelProfile(total, norms, ranked[:top])


# --------------------------------------------------------------------------- 4. flash-attn's API

PARITY_CASES = {  # name -> layer_norm_fn keywords beside x, weight, bias (prenorm, no dropout)
    "residual fp32": dict(residual=torch.float32),
    "no residual, rowscale": dict(rowscale=True),
    "no residual, fp32 stream, zero-centred": dict(residual_in_fp32=True, zero_centered_weight=True),
    "parallel block": dict(residual=torch.bfloat16, x1=True, weight1=True),
}


def _flash_attn_fns(setup: Setup) -> tuple[str, Callable, Callable]:
    """``(name, layer_norm_fn, rms_norm_fn)`` of flash-attn (CUDA only), or of addnorm's own
    compat module in the dry run or where flash-attn does not import (the comparison then checks
    itself and judges nothing)."""
    try:
        if setup.dry:
            raise ImportError("the dry run has no CUDA")
        from flash_attn.ops.triton.layer_norm import layer_norm_fn, rms_norm_fn

        return "flash-attn", layer_norm_fn, rms_norm_fn
    except ImportError:
        from addnorm.compat.flash_attn import layer_norm_fn, rms_norm_fn

        return "addnorm (no flash-attn)", layer_norm_fn, rms_norm_fn


def _parity_inputs(setup: Setup, m: int, n: int, case: dict, rms: bool) -> dict:
    """The tensors of one case: bf16 activations, fp32 weights, as mixed-precision training has."""
    bf16, fp32 = torch.bfloat16, torch.float32
    t = {"x": _randn(setup, m, n, dtype=bf16), "weight": _randn(setup, n, dtype=fp32, seed=1)}
    t["bias"] = None if rms else _randn(setup, n, dtype=fp32, seed=2)
    if "residual" in case:
        t["residual"] = _randn(setup, m, n, dtype=case["residual"], seed=3)
    if case.get("rowscale"):
        t["rowscale"] = (_randn(setup, m, seed=4).abs() + 0.5).to(bf16)
    if case.get("x1"):
        t["x1"] = _randn(setup, m, n, dtype=bf16, seed=5)
        t["weight1"] = _randn(setup, n, dtype=fp32, seed=6)
        t["bias1"] = None if rms else _randn(setup, n, dtype=fp32, seed=7)
    return t


def _parity_reference(t: dict, case: dict, rms: bool, eps: float) -> list[torch.Tensor]:
    """``y, [y1,] s`` of the unfused formula in float32 torch ops."""
    f = lambda name: None if t.get(name) is None else t[name].float()  # noqa: E731
    s = f("x") * f("rowscale")[:, None] if "rowscale" in t else f("x")
    s = s + f("x1") if "x1" in t else s
    s = s + f("residual") if "residual" in t else s

    def norm(w, b):
        w = w + 1 if case.get("zero_centered_weight") else w
        if rms:
            return s * torch.rsqrt(s.square().mean(-1, keepdim=True) + eps) * w
        return torch.nn.functional.layer_norm(s, s.shape[-1:], w, b, eps)

    ys = [norm(f("weight"), f("bias"))] + ([norm(f("weight1"), f("bias1"))] if "x1" in t else [])
    return [*ys, s]


def flash_attn_parity(setup: Setup) -> Part:
    """``addnorm.compat.flash_attn`` against flash-attn's own ``layer_norm_fn``/``rms_norm_fn``
    on the same inputs (no dropout: the two libraries draw different masks): the largest error of
    each output and gradient against the float32 formula, in roundings: units of bf16's eps (the
    activations' dtype) times the result's largest magnitude. Target: addnorm's error at most
    twice flash-attn's plus one rounding, flash-attn's own acceptance rule with flash-attn as the
    low-precision reference."""
    peer, peer_ln, peer_rms = _flash_attn_fns(setup)
    from addnorm.compat.flash_attn import layer_norm_fn, rms_norm_fn

    eps, rows, ok = 1e-6, [], True
    for m, n in setup.parity_shapes:
        for rms in (False, True):
            for name, case in PARITY_CASES.items():
                t = _parity_inputs(setup, m, n, case, rms)
                flags = {k: v for k, v in case.items() if k in ("residual_in_fp32", "zero_centered_weight")}
                leaves = {k: v for k, v in t.items() if v is not None and k != "rowscale"}
                fixed = {k: v.detach().clone().requires_grad_() for k, v in leaves.items()}
                ref = _parity_reference(t | fixed, case, rms, eps)  # the float32 formula, once
                g = torch.Generator(device=setup.device).manual_seed(1)
                cots = [torch.randn(r.shape, generator=g, device=setup.device) for r in ref]
                ref_grads = torch.autograd.grad(ref, list(fixed.values()), cots)
                names = ["y", "y1", "s"] if len(ref) == 3 else ["y", "s"]
                names += [f"d{k}" for k in leaves]
                unit = torch.finfo(t["x"].dtype).eps  # the cotangents reach bf16 outputs in bf16
                results = {}
                for who, fn in (
                    ("addnorm", rms_norm_fn if rms else layer_norm_fn),
                    (peer, peer_rms if rms else peer_ln),
                ):
                    mine = {k: v.detach().clone().requires_grad_() for k, v in leaves.items()}
                    outs = fn(**(t | mine), eps=eps, prenorm=True, **flags)
                    grads = torch.autograd.grad([o.float() for o in outs], list(mine.values()), cots)
                    results[who] = {
                        k: ((a.float() - r).abs().max() / (unit * r.abs().max())).item()
                        for k, a, r in zip(names, [*outs, *grads], [*ref, *ref_grads], strict=True)
                    }
                for k in results["addnorm"]:
                    ours, theirs = results["addnorm"][k], results[peer][k]
                    within = ours <= 2 * theirs + 1
                    ok &= within
                    row = {"norm": "rms" if rms else "layer", "case": name, "shape": f"{m}x{n}", "result": k}
                    rows.append(row | {"addnorm (roundings)": ours, f"{peer} (roundings)": theirs, "within": within})
    real = peer == "flash-attn"
    verdict = (
        "compat: addnorm within 2x flash-attn's error + 1 rounding",
        f"{len(rows)} results vs {peer}",
        ok if real else None,
    )
    return Part(rows=rows, table=markdown(rows), verdicts=[verdict])


SPEEDUP = "one call's speed-up"


def parallel_block_cost(setup: Setup) -> Part:
    """Parallel blocks (``x1``, ``weight1``, ``bias1``) through ``benchmarks/parallel_blocks.py``:
    addnorm's one call against its two calls, torch eager and flash-attn (where it imports),
    wall clock per call, bf16; without dropout, and with each sublayer output dropped (``x1``'s
    dropout one kernel of its own, the Triton backend's ``dropped``)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import parallel_blocks

    rows = []
    for m, n, p in setup.parallel_cases:
        timed = bench.measure(parallel_blocks.calls(m, n, torch.bfloat16, p, setup.device), setup.rounds, setup.device)
        for pass_ in ("fwd", "fwd+bwd"):
            one = timed[(pass_, "one call")][0]
            for impl in parallel_blocks.impls(setup.device):
                med = timed[(pass_, impl)][0]
                row = {"pass": pass_, "shape": f"{m}x{n}", "dtype": "bfloat16", "dropout_p": p, "impl": impl}
                row["ms"] = med * 1e3
                rows.append(row | {SPEEDUP: med / one})
    others = [r for r in rows if r["impl"] != "one call"]
    worst = min(others, key=lambda r: r[SPEEDUP])
    case = f"{worst['pass']} {worst['shape']}" + (f" p={worst['dropout_p']}" if worst["dropout_p"] else "")
    seen = f"worst {worst[SPEEDUP]:.2f}x vs {worst['impl']} ({case})"
    met = None if setup.dry else worst[SPEEDUP] >= 1.0
    return Part(
        rows=rows, table=markdown(rows), verdicts=[("parallel block: one call ahead of every other", seen, met)]
    )


def save(part: Part, stem: Path) -> None:
    """``stem.json`` (rows), ``stem.md`` (table), ``stem.log`` (raw output)."""
    stem.with_suffix(".json").write_text(json.dumps(part.rows, indent=1, default=str) + "\n")
    stem.with_suffix(".md").write_text(part.table if part.table.endswith("\n") else part.table + "\n")
    stem.with_suffix(".log").write_text(part.log + ("\n" if part.log else ""))
