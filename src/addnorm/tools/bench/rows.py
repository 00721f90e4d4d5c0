"""The rows ``addnorm bench --save`` appends: their fields, where they go, how they are read back.

One JSON object per line, one per (configuration, implementation) of a run. The fields, in the
order :data:`ROW_FIELDS` lists them:

- ``time`` (ISO, the run's start: all rows of one run share it), ``commit`` (``-dirty`` when the
  code differs from it), ``machine``, ``device``, ``threads``, ``torch``: the run;
- ``op``, ``pass``, ``rows``, ``cols``, ``dtype``, ``impl``: the configuration and implementation;
- ``median_ms``, ``p20_ms``, ``p80_ms``: time per call; ``bytes``: what one call moves
  (:func:`addnorm.tools.bench.measure.bytes_moved`); ``gbps``: ``bytes`` over the median;
- ``copy_gbps``: the copy bandwidth, timed in the same interleaved rounds as the row's
  configuration (rows saved before then carry the run's, measured at its start; older rows
  lack it).

This module is the only one that knows the schema: ``addnorm bench`` writes through it, and
``addnorm plot bench`` and ``benchmarks/bench_table.py`` read through it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from pathlib import Path

from ..cli import UsageError

# "*_dropout": Add & Norm with residual dropout fused (addnorm) or written with torch
OPS = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "add_layer_norm_dropout", "add_rms_norm_dropout"]
PASSES = ["fwd", "bwd", "fwd+bwd"]
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
    "copy_gbps",
]
# what a row must hold to be read back: rows of older runs lack the later fields
LATER_FIELDS = ("torch", "median_ms", "p20_ms", "p80_ms", "bytes", "copy_gbps")
REQUIRED_FIELDS = tuple(f for f in ROW_FIELDS if f not in LATER_FIELDS)
DEFAULT_RESULTS = Path("benchmarks") / "results" / "bench.jsonl"

_TEXT_FIELDS = ("time", "commit", "machine", "device", "op", "pass", "dtype", "impl")
_COUNT_FIELDS = ("threads", "rows", "cols")
_POSITIVE_FIELDS = ("gbps", *LATER_FIELDS[1:])


def _positive(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def bad_field(row: dict) -> str | None:
    """Why ``row`` is not a well-formed results row, or None."""
    for name in _TEXT_FIELDS:
        if not isinstance(row[name], str):
            return f"{name!r} must be text, got {row[name]!r}"
    for name in _COUNT_FIELDS:
        if not isinstance(row[name], int) or isinstance(row[name], bool) or row[name] < 1:
            return f"{name!r} must be a positive integer, got {row[name]!r}"
    for name in _POSITIVE_FIELDS:
        if name in row and not _positive(row[name]):
            return f"{name!r} must be a positive number, got {row[name]!r}"
    return None


def read_rows(path: Path, flag: str = "--results") -> list[dict]:
    """The rows of a JSONL file that ``addnorm bench --save`` wrote, each checked; a
    :class:`UsageError` naming ``flag`` for a file that is missing, not text, or not such rows."""
    if path.is_dir():
        raise UsageError(f"{flag}: {str(path)!r} is a folder; expected the JSONL file of `addnorm bench --save`")
    if not path.is_file():
        raise UsageError(f"{flag}: {str(path)!r} not found; run `addnorm bench --save` first")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(
            f"{flag}: {str(path)!r} is not text; expected the JSON lines of `addnorm bench --save`"
        ) from None
    except OSError as err:
        raise UsageError(f"{flag}: cannot read {str(path)!r}: {err.strerror or err}") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UsageError(f"{flag}: {path}:{lineno} is not JSON ({err.msg})") from None
        missing = [f for f in REQUIRED_FIELDS if not isinstance(row, dict) or f not in row]
        if missing:
            raise UsageError(f"{flag}: {path}:{lineno} lacks field(s) {', '.join(missing)}")
        why = bad_field(row)
        if why is not None:
            raise UsageError(f"{flag}: {path}:{lineno}: {why}")
        rows.append(row)
    if not rows:
        raise UsageError(f"{flag}: {str(path)!r} holds no rows; run `addnorm bench --save` first")
    return rows


def make_row(run: dict, result: dict) -> dict:
    """One results row, fields in :data:`ROW_FIELDS` order: the run's fields (:func:`run_fields`)
    and one measurement (``op`` ... ``gbps``)."""
    both = {**run, **result}
    return {k: both[k] for k in ROW_FIELDS}


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append ``rows`` (from :func:`make_row`) to ``path``, one JSON object per line (on a line
    of its own after a last line without its newline, as an editor may leave it)."""
    with path.open("a+b") as f:
        if f.tell() and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
            f.write(b"\n")
        f.writelines((json.dumps(row) + "\n").encode() for row in rows)


def run_key(row: dict) -> tuple:
    """One ``addnorm bench`` invocation: its rows share the start time, commit and machine."""
    return (row["time"], row["commit"], row["machine"], row["device"], row["threads"])


def machine_name(device: str) -> str:
    """The GPU's name, or the CPU's model name with the CPU count."""
    if device == "cuda":
        import torch

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
