"""What ``addnorm bench`` prints: its results rows grouped by configuration, as a text table for
an 80-column terminal, Markdown for docs, or CSV and JSON for programs (``--format``).

Per implementation: the median time per call and its p20-p80, GB/s (the bytes one call moves
over the median), that as a fraction of the copy bandwidth measured in the same run (``of
copy bw``), and torch eager's median over this one's (``vs torch``, above 1: faster than torch).
"""

from __future__ import annotations

import csv
import io
import json
import math
import textwrap

from .rows import ROW_FIELDS, run_key

FORMATS = ["table", "markdown", "csv", "json"]
WIDTH = 80
EXTRA_FIELDS = ["copy_fraction", "vs_torch_eager"]  # derived per row, in csv and json
_HEAD = ("impl", "median ms", "p20-p80 ms", "GB/s", "of copy bw", "vs torch")
_TEXT_LAYOUT = "  {:<18}{:>10}  {:>19}{:>8}{:>11}{:>9}"  # 79 columns


def config_key(row: dict) -> tuple:
    return (row["op"], row["pass"], row["rows"], row["cols"], row["dtype"])


def config_title(row: dict) -> str:
    return f"{row['op']} {row['pass']}, {row['rows']}x{row['cols']}, {row['dtype']}"


def grouped(rows: list[dict]) -> list[list[tuple[dict, dict]]]:
    """``(row, derived values)`` pairs by configuration, in the order each configuration first
    appears."""
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for row, extra in zip(rows, derived(rows), strict=True):
        groups.setdefault(config_key(row), []).append((row, extra))
    return list(groups.values())


def derived(rows: list[dict]) -> list[dict]:
    """``copy_fraction`` (None without a copy bandwidth) and ``vs_torch_eager`` (None without a
    torch eager row of the same configuration in the same run), one dict per row."""
    key = lambda r: (run_key(r), config_key(r))  # noqa: E731
    eager = {key(r): r["median_ms"] for r in rows if r["impl"] == "torch-eager"}
    out = []
    for r in rows:
        copy = r.get("copy_gbps")
        base = eager.get(key(r))
        out.append(
            {
                "copy_fraction": r["gbps"] / copy if copy else None,
                "vs_torch_eager": base / r["median_ms"] if base is not None else None,
            }
        )
    return out


def ms(v: float) -> str:
    """A time in ms to four significant digits or more: ``139.1``, ``39.056``, ``0.02000``."""
    if v >= 100:
        return f"{v:.1f}"
    return f"{v:.3f}" if v >= 1 else f"{v:.{3 - math.floor(math.log10(v))}f}"


def gbps(v: float) -> str:
    """GB/s to three significant digits or more: ``2633``, ``45.1``, ``0.67``."""
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _cells(row: dict, extra: dict) -> list[str]:
    copy, ratio = extra["copy_fraction"], extra["vs_torch_eager"]
    return [
        row["impl"],
        ms(row["median_ms"]),
        f"{ms(row['p20_ms'])}-{ms(row['p80_ms'])}",
        gbps(row["gbps"]),
        "-" if copy is None else f"{copy:.2f}",
        "-" if ratio is None else f"{ratio:.2f}x",
    ]


def text(rows: list[dict], skipped: dict[str, str]) -> str:
    """A heading line per configuration, then one line per implementation; no line over
    :data:`WIDTH` columns."""
    lines = []
    for group in grouped(rows):
        lines += ["", config_title(group[0][0]), _TEXT_LAYOUT.format(*_HEAD)]
        lines += [_TEXT_LAYOUT.format(*_cells(r, extra)) for r, extra in group]
    for name, reason in sorted(skipped.items()):
        lines += textwrap.wrap(f"{name}: {reason}", WIDTH, initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines).lstrip("\n")


def markdown(rows: list[dict]) -> str:
    """One Markdown table; the configuration named on the first row of its group."""
    lines = [
        "| op | pass | shape | dtype | " + " | ".join(_HEAD) + " |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for group in grouped(rows):
        for i, (r, extra) in enumerate(group):
            config = [r["op"], r["pass"], f"{r['rows']}x{r['cols']}", r["dtype"]] if i == 0 else [""] * 4
            lines.append("| " + " | ".join(config + _cells(r, extra)) + " |")
    return "\n".join(lines)


def csv_text(rows: list[dict]) -> str:
    """A header line, then one line per row: :data:`ROW_FIELDS` and :data:`EXTRA_FIELDS`."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=ROW_FIELDS + EXTRA_FIELDS, lineterminator="\n")
    writer.writeheader()
    for r, extra in zip(rows, derived(rows), strict=True):
        writer.writerow({**{k: r.get(k) for k in ROW_FIELDS}, **extra})
    return out.getvalue().rstrip("\n")


def json_text(rows: list[dict], skipped: dict[str, str]) -> str:
    """``{"rows": [...], "skipped": {impl: reason}}``; each row has :data:`ROW_FIELDS` and
    :data:`EXTRA_FIELDS` (null where there is no value)."""
    full = [{**{k: r.get(k) for k in ROW_FIELDS}, **extra} for r, extra in zip(rows, derived(rows), strict=True)]
    return json.dumps({"rows": full, "skipped": skipped}, indent=1)


def render(rows: list[dict], skipped: dict[str, str], fmt: str) -> str:
    if fmt == "table":
        return text(rows, skipped)
    if fmt == "markdown":
        return markdown(rows)
    if fmt == "csv":
        return csv_text(rows)
    return json_text(rows, skipped)
