"""Markdown tables of saved `addnorm bench --save` rows, as pasted into docs/benchmarks.md.

    python benchmarks/bench_table.py --since 2026-11-22T19:30 [--until ...] [--results FILE]

One line per (op, pass, shape, dtype); one column per implementation: median ms (p20-p80) and,
for all but torch eager, the ratio to torch eager's median from the same run (above 1: faster).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default="benchmarks/results/bench.jsonl")
    p.add_argument("--since", required=True, help="ISO time: rows saved at or after it")
    p.add_argument("--until", default="9999", help="ISO time: rows saved before it")
    args = p.parse_args()
    rows = [json.loads(line) for line in Path(args.results).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if args.since <= r["time"] < args.until]
    if not rows:
        raise SystemExit(f"no rows saved between {args.since} and {args.until} in {args.results}")
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    configs: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        configs.setdefault((r["op"], r["pass"], f"{r['rows']}x{r['cols']}", r["dtype"]), {})[r["impl"]] = r
    first, last = min(r["time"] for r in rows), max(r["time"] for r in rows)
    machine = {f"{r['machine']}, {r['threads']} threads, torch {r['torch']}, commit {r['commit']}" for r in rows}
    print(f"_rows saved {first} .. {last}; {'; '.join(sorted(machine))}_\n")
    print("| op | pass | shape | dtype | " + " | ".join(impls) + " |")
    print("|---|---|---|---|" + "---:|" * len(impls))
    for (op, pass_, shape, dtype), by_impl in configs.items():
        base = by_impl.get("torch-eager")
        cells = []
        for impl in impls:
            r = by_impl.get(impl)
            if r is None:
                cells.append("-")
                continue
            cell = f"{r['median_ms']:.3f} ({r['p20_ms']:.3f}-{r['p80_ms']:.3f})"
            if base is not None and impl != "torch-eager":
                cell += f" **{base['median_ms'] / r['median_ms']:.2f}x**"
            cells.append(cell)
        print(f"| {op} | {pass_} | {shape} | {dtype} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
