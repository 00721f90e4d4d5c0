"""Markdown tables of saved ``addnorm bench --save`` rows, and the tables of docs/benchmarks.md.

    python benchmarks/bench_table.py --since 2026-11-22T19:30 [--until ...] [--results FILE]
    python benchmarks/bench_table.py --page docs/benchmarks.md [--check] [--results FILE]

``--since``: the rows saved in a time range, as ``addnorm bench --format markdown`` prints them.
``--page``: rewrites each table of the page between ``<!-- table: NAME -->`` and
``<!-- end table -->`` from the rows (:data:`PAGE_TABLES` says which machine and shapes each
shows); ``--check`` only says whether the page is up to date (exit 1 if not).

A page table is the latest run on its machine that measured ``add_layer_norm`` at every one of
its shapes, in float32 and bfloat16, forward (inference) and forward+backward, against torch
eager: one line per configuration, one column per implementation. GB/s are recounted with
today's ``bytes_moved`` for what each implementation moves (``impls.traffic``), so that rows
saved before a change of the count read the same as new ones.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from addnorm.tools.bench import DEFAULT_SHAPES, bytes_moved, parse_shapes
from addnorm.tools.bench.impls import traffic
from addnorm.tools.bench.rows import DEFAULT_RESULTS, read_rows, run_key
from addnorm.tools.bench.table import gbps, markdown, ms


class PageTable(NamedTuple):
    machine: str  # the rows' "machine" field
    shapes: str  # ROWSxCOLS,...


OP = "add_layer_norm"
DTYPES = ("float32", "bfloat16")
PASSES = ("fwd", "fwd+bwd")
GPU_SHAPES = "4096x4096,16384x4096,32768x4096,8192x8192,4096x65536"
PAGE_TABLES = {
    "cpu-amd-epyc": PageTable("AMD EPYC (2 cpus)", DEFAULT_SHAPES),
    "cpu-intel-xeon": PageTable("Intel(R) Xeon(R) Processor (2 cpus)", DEFAULT_SHAPES),
    "gpu-h100": PageTable("NVIDIA H100 80GB HBM3", GPU_SHAPES),
}
BLOCK = re.compile(r"(<!-- table: ([\w-]+) -->\n)(.*?)(<!-- end table -->)", re.S)


def _shape(row: dict) -> tuple[int, int]:
    return (row["rows"], row["cols"])


def latest_run(rows: list[dict], spec: PageTable) -> list[dict]:
    """The ``OP`` rows of the latest run on ``spec.machine`` that covers all its configurations."""
    wanted = {(s, d, p) for s in parse_shapes(spec.shapes) for d in DTYPES for p in PASSES}
    runs: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["machine"] == spec.machine and r["op"] == OP and r["impl"] == "torch-eager":
            runs.setdefault(run_key(r), []).append(r)
    covering = [key for key, eager in runs.items() if wanted <= {(_shape(r), r["dtype"], r["pass"]) for r in eager}]
    if not covering:
        raise SystemExit(f"no run on {spec.machine!r} measured {OP} at all of {spec.shapes} against torch eager")
    key = max(covering)
    return [r for r in rows if run_key(r) == key and r["op"] == OP and (_shape(r), r["dtype"], r["pass"]) in wanted]


def _recounted_gbps(r: dict) -> float:
    """The row's GB/s with today's byte count (the counts of some implementations changed after
    older rows were saved); the GB/s it was saved with where this machine cannot tell how the row's
    backend runs (a backend not installed here, a device absent), and for addnorm's GPU rows: the
    Triton forward wrote the stream and the statistics on every call when they were saved, and
    writes only what it returns since, so today's count is not what those runs moved."""
    if r["device"] != "cpu" and r["impl"].startswith("addnorm"):
        return r["gbps"]
    dtype = getattr(torch, r["dtype"])
    try:
        flags = traffic(r["impl"], r["device"], dtype)
    except (ImportError, RuntimeError, AssertionError):
        return r["gbps"]
    return bytes_moved(r["op"], r["rows"], r["cols"], dtype, r["pass"], **flags) / r["median_ms"] / 1e6


def _impl_order(impl: str) -> tuple:
    return (impl != "torch-eager", not impl.startswith("addnorm"), impl)


def page_table(rows: list[dict], spec: PageTable) -> str:
    """The Markdown of one page table: the command, the run, and the table."""
    run = latest_run(rows, spec)
    first = run[0]
    shapes = parse_shapes(spec.shapes)
    impls = sorted({r["impl"] for r in run}, key=_impl_order)
    device = "" if first["device"] == "cpu" else f" --device {first['device']}"
    command = (
        f"addnorm bench{device} --op {OP} --dtype {','.join(DTYPES)} --pass {','.join(PASSES)} \\\n"
        f"    --shapes {spec.shapes} \\\n"
        f"    --impl {','.join(impls)} --threads {first['threads']} --save"
    )
    lines = [
        "```",
        command,
        "```",
        "",
        f"_{first['machine']}, {first['threads']} threads, torch {first.get('torch', '?')}, "
        f"commit {first['commit']}, {first['time']}_",
        "",
        "| shape | dtype | pass | " + " | ".join(impls) + " |",
        "|---|---|---|" + "---:|" * len(impls),
    ]
    cells = {(_shape(r), r["dtype"], r["pass"], r["impl"]): r for r in run}
    for shape in shapes:
        for dtype in DTYPES:
            for pass_ in PASSES:
                eager = cells[shape, dtype, pass_, "torch-eager"]
                row = [f"{shape[0]}x{shape[1]}", dtype, pass_]
                for impl in impls:
                    r = cells.get((shape, dtype, pass_, impl))
                    if r is None:
                        row.append("-")
                        continue
                    cell = f"{ms(r['median_ms'])} ms · {gbps(_recounted_gbps(r))} GB/s"
                    if impl != "torch-eager":
                        cell += f" · **{eager['median_ms'] / r['median_ms']:.2f}x**"
                    row.append(cell)
                lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def render_page(text: str, rows: list[dict]) -> str:
    """``text`` with every marked table regenerated from ``rows``."""
    names = [m.group(2) for m in BLOCK.finditer(text)]
    unknown = [n for n in names if n not in PAGE_TABLES]
    if unknown:
        raise SystemExit(f"tables {unknown} are not in PAGE_TABLES ({', '.join(PAGE_TABLES)})")
    return BLOCK.sub(lambda m: m.group(1) + page_table(rows, PAGE_TABLES[m.group(2)]) + m.group(4), text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--since", help="ISO time: print the rows saved at or after it")
    what.add_argument("--page", type=Path, help="a Markdown page whose marked tables to regenerate")
    p.add_argument("--until", default="9999", help="with --since, ISO time: rows saved before it")
    p.add_argument("--check", action="store_true", help="with --page: exit 1 if the page is not up to date")
    args = p.parse_args()
    rows = read_rows(args.results)
    if args.page is not None:
        text = args.page.read_text(encoding="utf-8")
        new = render_page(text, rows)
        if args.check:
            print(f"{args.page}: {'up to date' if new == text else 'out of date: rerun without --check'}")
            return 0 if new == text else 1
        args.page.write_text(new, encoding="utf-8")
        print(f"wrote {args.page}")
        return 0
    rows = [r for r in rows if args.since <= r["time"] < args.until and "median_ms" in r]  # (older rows: no times)
    if not rows:
        raise SystemExit(f"no timed rows saved between {args.since} and {args.until} in {args.results}")
    runs: dict[tuple, list[dict]] = {}
    for r in rows:  # one table per run: each row beside the torch eager of its own run
        runs.setdefault(run_key(r), []).append(r)
    for run in runs.values():
        r = run[0]
        torch_version = r.get("torch", "?")
        print(f"_{r['time']}: {r['machine']}, {r['threads']} threads, torch {torch_version}, commit {r['commit']}_\n")
        print(markdown(run) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
