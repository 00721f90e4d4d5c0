"""Before/after of a change: addnorm bench on two revisions, their runs alternated.

    python benchmarks/compare_revs.py BASE [--head REV] [--rounds K] [--format table|markdown]
        [--save FILE] -- [addnorm bench arguments]

``BASE`` (and ``--head``) is any commit of this repository (a hash, a tag, ``HEAD~3``); without
``--head`` the other side is this working tree as it is, uncommitted edits included. Each
revision is exported with ``git archive`` into a temporary folder and benchmarked from there
(``PYTHONPATH=<folder>/src``); nothing in this checkout changes.

Each round runs ``addnorm bench ... --save`` once per side, in alternating order
(base first, then head first), so that both sides of a round run on the machine as it is then.
A shared machine's speed drifts from minute to minute: a ratio is the median, over the rounds,
of the ratio of the two sides' medians in the same round, with its lowest and highest round.
Torch eager's rows, when asked for (``--impl torch-eager,...``), are measured in both runs, and
each side's ``vs torch`` is against the torch of its own run.

A run cut short (a failed bench, Ctrl-C) prints the rounds that finished; ``--save`` appends
every finished run's rows (JSON lines, each with its side and round) as they come.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEY = ("op", "pass", "rows", "cols", "dtype", "impl")
OWNED = ("--format", "--save", "--results", "--plot")  # the bench options this script sets itself


class Failure(Exception):
    """A problem to report in one line (exit status ``code``), with no traceback."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def resolve(rev: str) -> str:
    """The full hash of commit ``rev`` of this repository, or a Failure naming it."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise Failure(f"cannot run git in {ROOT}: {e}", 2) from None
    if done.returncode or not done.stdout.strip():
        raise Failure(f"{rev!r} is not a commit of the repository at {ROOT}", 2)
    return done.stdout.strip()


def export(commit: str, into: Path) -> Path:
    """The tree of ``commit``, written under ``into`` by ``git archive``."""
    tree = into / commit[:10]
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT, capture_output=True, timeout=300)
    if archive.returncode:
        raise Failure(f"git archive {commit[:10]} failed: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def child_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "src"), *filter(None, [env.get("PYTHONPATH")])])
    return env


def check_imports_from(tree: Path) -> None:
    """Fail unless ``import addnorm`` in a child run from ``tree`` loads ``tree``'s own copy (an
    installed copy found first would make both sides the same code)."""
    code = "import addnorm, sys; sys.stdout.write(addnorm.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=child_env(tree), capture_output=True, text=True)
    where = Path(done.stdout.strip() or "?").resolve()
    if done.returncode or not where.is_relative_to(tree.resolve()):
        raise Failure(f"import addnorm from {tree} loaded {where}, not that tree: {done.stderr.strip()[-300:]}")


def cli_command(tree: Path) -> list[str]:
    """The command that runs ``tree``'s ``addnorm`` CLI: its console script (``[project.scripts]``
    of its pyproject.toml) called in a child Python, so that revisions older than ``python -m
    addnorm`` run too."""
    try:
        found = re.search(r'^addnorm\s*=\s*"([\w.]+):(\w+)"', (tree / "pyproject.toml").read_text(), re.MULTILINE)
    except OSError as e:
        raise Failure(f"cannot read {tree}/pyproject.toml: {e}") from None
    if found is None:
        raise Failure(f"{tree}/pyproject.toml names no addnorm console script")
    module, func = found.groups()
    call = f"import sys; from {module} import {func} as main; sys.argv[0] = 'addnorm'; sys.exit(main())"
    return [sys.executable, "-c", call]


def bench(tree: Path, args: list[str], scratch: Path) -> list[dict]:
    """The rows of one ``addnorm bench`` run of the code in ``tree``, read from the JSONL file its
    ``--save --results`` writes (older revisions have no ``--format json``)."""
    rows = scratch / "rows.jsonl"
    rows.unlink(missing_ok=True)
    cmd = [*cli_command(tree), "bench", *args, "--save", "--results", str(rows)]
    done = subprocess.run(cmd, cwd=tree, env=child_env(tree), capture_output=True, text=True)
    if done.returncode:
        tail = done.stderr.strip().splitlines()[-3:]
        raise Failure(f"addnorm bench failed in {tree} (exit {done.returncode}): " + " | ".join(tail))
    return [json.loads(line) for line in rows.read_text().splitlines() if line.strip()]


def _with_derived(rnd: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The round's rows with ``vs_torch_eager`` (against the torch-eager row of the same run) and
    ``copy_fraction`` (bytes over time over the copy bandwidth of the run, or, for a revision
    whose rows record no copy bandwidth, of the other side's run in the same round; the bytes are
    the newer side's count, as both sides move the same tensors) set on every row."""
    copy = {side: next((r["copy_gbps"] for r in rows if r.get("copy_gbps")), None) for side, rows in rnd.items()}
    count = {tuple(r[k] for k in KEY): r["bytes"] for rows in rnd.values() for r in rows if "copy_gbps" in r}
    out = {}
    for side, rows in rnd.items():
        torch_ms = {tuple(r[k] for k in KEY[:5]): r["median_ms"] for r in rows if r["impl"] == "torch-eager"}
        gbps = copy[side] or next((g for g in copy.values() if g), None)
        derived = []
        for r in rows:
            key = tuple(r[k] for k in KEY)
            nbytes = count.get(key, r["bytes"])
            fraction = nbytes / (r["median_ms"] * 1e6) / gbps if gbps else float("nan")
            base_ms = torch_ms.get(key[:5])
            vs = base_ms / r["median_ms"] if base_ms else float("nan")
            derived.append({**r, "copy_fraction": fraction, "vs_torch_eager": vs})
        out[side] = derived
    return out


def summarize(rounds: list[dict[str, list[dict]]]) -> list[dict]:
    """One line per configuration and implementation measured on both sides in every round."""
    by_key: dict[tuple, dict[str, list[dict]]] = {}
    for rnd in rounds:
        for side, rows in _with_derived(rnd).items():
            for row in rows:
                by_key.setdefault(tuple(row[k] for k in KEY), {}).setdefault(side, []).append(row)
    lines = []
    for key, sides in by_key.items():
        base, head = sides.get("base", []), sides.get("head", [])
        if not base or len(base) != len(head) or len(base) != len(rounds):
            continue
        ratios = [b["median_ms"] / h["median_ms"] for b, h in zip(base, head)]
        med = lambda rows, field: statistics.median(r[field] for r in rows)  # noqa: E731
        lines.append(
            {
                **dict(zip(KEY, key)),
                "base_ms": med(base, "median_ms"),
                "head_ms": med(head, "median_ms"),
                "base_copy_fraction": med(base, "copy_fraction"),
                "head_copy_fraction": med(head, "copy_fraction"),
                "base_vs_torch": med(base, "vs_torch_eager"),
                "head_vs_torch": med(head, "vs_torch_eager"),
                "speedup": statistics.median(ratios),
                "speedup_low": min(ratios),
                "speedup_high": max(ratios),
                "rounds": len(ratios),
            }
        )
    return lines


def _side(ln: dict, side: str) -> str:
    """A side's cell: median ms, fraction of the copy bandwidth, and its ratio to torch eager of
    the same run ("-" where the run timed no torch eager)."""
    vs = ln[f"{side}_vs_torch"]
    return f"{ln[f'{side}_ms']:.3f} · {ln[f'{side}_copy_fraction']:.2f} · " + ("-" if vs != vs else f"{vs:.2f}x")


def render(lines: list[dict], fmt: str, labels: tuple[str, str]) -> str:
    """The summary as a terminal table or a markdown table (each side's cell: :func:`_side`)."""
    head = ["op", "pass", "shape", "dtype", "impl", labels[0], labels[1], "head vs base"]
    body = [
        [
            ln["op"],
            ln["pass"],
            f"{ln['rows']}x{ln['cols']}",
            ln["dtype"],
            ln["impl"],
            _side(ln, "base"),
            _side(ln, "head"),
            f"{ln['speedup']:.2f}x ({ln['speedup_low']:.2f}-{ln['speedup_high']:.2f})",
        ]
        for ln in lines
    ]
    if fmt == "markdown":
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * 5 + "---:|" * 3]
        out += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(out)
    widths = [max(len(str(r[i])) for r in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head, *body])


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ours, bench_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(
        prog="compare_revs.py",
        description=__doc__.splitlines()[0],
        epilog="Arguments after -- go to addnorm bench (see: addnorm bench --help).",
    )
    p.add_argument("base", metavar="BASE", help="the commit to compare against (hash, tag, HEAD~1, ...)")
    p.add_argument("--head", metavar="REV", help="the other commit (default: this working tree as it is)")
    p.add_argument("--rounds", type=int, default=3, help="alternated runs per side (default 3)")
    p.add_argument("--format", choices=["table", "markdown"], default="table")
    p.add_argument("--save", metavar="FILE", help="append every run's rows as JSON lines to FILE")
    args = p.parse_args(ours)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    owned = [a for a in bench_args if a.split("=")[0] in OWNED]
    if owned:
        p.error(f"{', '.join(owned)}: set by this script; give addnorm bench the other options")
    return args, bench_args


def main(argv: list[str] | None = None) -> int:
    args, bench_args = parse(sys.argv[1:] if argv is None else argv)
    rounds: list[dict[str, list[dict]]] = []
    labels = ("base", "head")
    code = 0
    with tempfile.TemporaryDirectory(prefix="addnorm-revs-") as tmp:
        try:
            base = resolve(args.base)
            trees = {"base": export(base, Path(tmp))}
            head_label = "working tree"
            if args.head is not None:
                head = resolve(args.head)
                trees["head"], head_label = export(head, Path(tmp)), head[:10]
            else:
                trees["head"] = ROOT
            labels = (f"base {base[:10]}", f"head {head_label}")
            commits = {"base": base[:7], "head": None if args.head is None else head_label[:7]}
            for tree in trees.values():
                check_imports_from(tree)
            print(f"{labels[0]} vs {labels[1]}: addnorm bench {' '.join(bench_args)}", file=sys.stderr)
            for k in range(args.rounds):
                order = ("base", "head") if k % 2 == 0 else ("head", "base")
                rnd = {}
                for side in order:
                    rnd[side] = bench(trees[side], bench_args, Path(tmp))
                    if args.save:
                        with open(args.save, "a") as f:
                            for row in rnd[side]:
                                commit = commits[side] or row["commit"]  # (an archive has no git)
                                f.write(json.dumps({**row, "commit": commit, "side": side, "round": k}) + "\n")
                rounds.append(rnd)
                print(f"round {k + 1}/{args.rounds} done", file=sys.stderr)
        except Failure as e:
            print(f"compare_revs: {e}", file=sys.stderr)
            code = e.code
        except KeyboardInterrupt:
            print("compare_revs: interrupted", file=sys.stderr)
            code = 130
    if rounds:
        if code:
            print(f"(the {len(rounds)} round(s) that finished)", file=sys.stderr)
        print(render(summarize(rounds), args.format, labels))
    return code


if __name__ == "__main__":
    sys.exit(main())
