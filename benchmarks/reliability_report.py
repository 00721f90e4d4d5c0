"""Figures for docs/reliability.md, from the same code the tests run.

    PYTHONPATH=src python benchmarks/reliability_report.py [--examples 300] [--backend NAME ...]

Prints Markdown: for every usable backend, the property-test cases tried and the max error of
ours and of torch (same dtype) against the fp64 oracle; the hard-numerics scenarios; run-to-run
and 1-vs-2-thread determinism; peak memory of forward + backward against torch eager; the size
of the bad-input tables. Nothing is hard-coded: every number comes from this run.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import conftest  # noqa: E402  (the tolerance table, the hypothesis profiles, usable_backends)
import test_bad_input as bad  # noqa: E402
import test_determinism as det  # noqa: E402
import test_memory as mem  # noqa: E402
import test_numerics as num  # noqa: E402
import test_properties as prop  # noqa: E402

DT = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def properties(backend: str, examples: int) -> tuple[int, float, dict]:
    records: list = []
    count = 0

    @settings(
        max_examples=examples, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(case=prop.cases())
    def collect(case):
        nonlocal count
        count += 1
        records.extend(prop.run_case(case, backend))

    start = time.perf_counter()
    collect()
    table: dict = defaultdict(lambda: [0, 0.0, 0.0, 0])
    for name, dtype, ours, theirs in records:
        row = table[(DT[dtype], "output" if name in ("y", "s") else "gradient")]
        row[0] += 1
        row[1], row[2] = max(row[1], ours), max(row[2], theirs)
        row[3] += ours <= theirs
    return count, time.perf_counter() - start, table


def determinism(backend: str) -> tuple[int, int, float]:
    identical = runs = 0
    spread = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        for rms in (False, True):
            first = {}
            for threads in (1, 2):
                with det.Threads(threads):
                    first[threads] = det.step(backend, dtype, rms)
                    for _ in range(4):
                        again = det.step(backend, dtype, rms)
                        runs += 1
                        same = zip(first[threads], again, strict=True)
                        identical += all(torch.equal(a, b) for a, b in same)
            spread = max(
                spread, *((a.double() - b.double()).abs().max().item() for a, b in zip(first[1], first[2], strict=True))
            )
    return identical, runs, spread


def memory(backend: str, m: int, n: int, dtype: torch.dtype, prenorm: bool) -> tuple[float, float]:
    x, r, w, b = mem._inputs(m, n, dtype, rms=False)
    dy, dstream = torch.randn(m, n).to(dtype), torch.randn(m, n).to(dtype)
    grad_out = (dy, dstream) if prenorm else dy

    def ours():
        out = mem._call(x, r, w, b, rms=False, prenorm=prenorm, backend=backend)
        torch.autograd.grad(out, (x, r, w, b), grad_out)

    def eager():
        s = x + r
        y = torch.nn.functional.layer_norm(s, (n,), w, b)
        torch.autograd.grad((y, s) if prenorm else y, (x, r, w, b), grad_out)

    ours(), eager()
    return mem.peak_bytes(ours) / 2**20, mem.peak_bytes(eager) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300, help="property-test cases per backend")
    parser.add_argument("--backend", nargs="*", default=conftest.usable_backends())
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    p = print
    p(
        f"Run: `PYTHONPATH=src python benchmarks/reliability_report.py {' '.join(sys.argv[1:])}` on "
        f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} torch threads.\n"
    )
    for backend in args.backend:
        p(f"### backend `{backend}`\n")
        count, secs, table = properties(backend, args.examples)
        p(
            f"Property tests: {count} random cases in {secs:.1f} s, all within tolerance. "
            "Max |error| against the fp64 oracle:\n"
        )
        p("| dtype | checked | checks | ours | torch (same dtype) | ours <= torch |")
        p("|---|---|---|---|---|---|")
        for (dt, kind), (k, ours, theirs, better) in sorted(table.items()):
            p(f"| {dt} | {kind} | {k} | {ours:.3g} | {theirs:.3g} | {better / k:.0%} |")
        p("\nHard numerics (16 x 512 rows; max |error| against the fp64 oracle, ours / torch):\n")
        p("| scenario | dtype | y | dx | dweight |")
        p("|---|---|---|---|---|")
        for sc in num.SCENARIOS:
            res = num.evaluate(sc, backend)
            err = lambda who, k: num.max_error(res[who][k], res["oracle"][k])  # noqa: B023
            cells = [f"{err('ours', k):.2g} / {err('torch', k):.2g}" for k in ("y", "dx", "dweight")]
            p(f"| {sc.name} | {DT[sc.dtype]} | " + " | ".join(cells) + " |")
        identical, runs, spread = determinism(backend)
        p(
            f"\nDeterminism ({det.M} x {det.N}, pre-norm, fp32/bf16, LayerNorm/RMSNorm, 1 and 2 threads): "
            f"{identical}/{runs} repeated runs bit-identical in all six results; "
            f"max difference 1 vs 2 threads: {spread:.3g}.\n"
        )
        p("Peak memory of forward + backward of add_layer_norm (MiB, torch's CPU allocator):\n")
        p("| shape | dtype | mode | ours | torch eager |")
        p("|---|---|---|---|---|")
        for m, n in ((1024, 1024), (4096, 1024)):
            for dtype in (torch.float32, torch.bfloat16):
                for prenorm in (False, True):
                    ours, eager = memory(backend, m, n, dtype, prenorm)
                    mode = "pre" if prenorm else "post"
                    p(f"| {m} x {n} | {DT[dtype]} | {mode}-norm | {ours:.2f} | {eager:.2f} |")
        p("")
    p(
        f"Bad input: {len(bad.FUNCTION_CASES)} table rows over the public functions and modules, "
        f"{len(bad.CLI_CASES)} CLI rows, CLI fuzzing over {len(bad.FUZZ_COMMANDS)} command(s)."
    )


if __name__ == "__main__":
    main()
