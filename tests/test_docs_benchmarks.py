"""docs/benchmarks.md: its tables are what benchmarks/bench_table.py makes of the saved rows,
and the links and section names other docs and the code point at are there (and in
docs/performance-log.md)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from addnorm.tools.bench.rows import read_rows
from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"
LOG = ROOT / "docs" / "performance-log.md"  # the changes and runs behind the figures
RESULTS = ROOT / "benchmarks" / "results" / "bench.jsonl"


def _bench_table():
    return load_benchmark("bench_table")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_the_tables_are_generated_from_the_saved_rows():
    bt = _bench_table()
    text = PAGE.read_text(encoding="utf-8")
    names = [m.group(2) for m in bt.BLOCK.finditer(text)]
    assert sorted(names) == sorted(bt.PAGE_TABLES), "a table marker is missing or unknown"
    expected = bt.render_page(text, read_rows(RESULTS))
    assert text == expected, "docs/benchmarks.md is stale: python benchmarks/bench_table.py --page docs/benchmarks.md"


def _row(time: str, impl: str, median_ms: float, **more) -> dict:
    run = dict(time=time, commit="c0ffee0", machine="m", device="cpu", threads=2, torch="2.13.0+cpu")
    config = dict(op="layer_norm", **{"pass": "fwd"}, rows=4, cols=64, dtype="float32", impl=impl)
    timing = dict(median_ms=median_ms, p20_ms=median_ms, p80_ms=median_ms, bytes=2048, gbps=2048 / median_ms / 1e6)
    return run | config | timing | more


def test_since_shows_each_run_against_its_own_torch_eager(tmp_path, monkeypatch, capsys):
    """Two runs of one configuration: each addnorm row is compared with its own run's torch eager,
    each run a table of its own; a row saved without times is left out, not a crash."""
    rows = [_row("2026-01-01T00:00", "torch-eager", 1.0), _row("2026-01-01T00:00", "addnorm", 0.5)]
    rows += [_row("2026-01-02T00:00", "torch-eager", 4.0), _row("2026-01-02T00:00", "addnorm", 2.0)]
    old = {k: v for k, v in _row("2026-01-01T12:00", "addnorm", 1.0).items() if not k.endswith("_ms")}
    results = tmp_path / "rows.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in [*rows, old]))
    monkeypatch.setattr(sys, "argv", ["bench_table.py", "--results", str(results), "--since", "2026"])
    assert _bench_table().main() == 0
    out = capsys.readouterr().out
    assert out.count("| op | pass |") == 2 and out.count("2.00x") == 2 and "4.00x" not in out


def test_a_row_of_a_backend_missing_here_keeps_its_saved_gbps(monkeypatch):
    """The page recounts GB/s with today's byte counts, which needs the row's backend; where it is
    not installed (no triton, no CUDA), the GB/s the row was saved with, not a crash."""
    bt = _bench_table()

    def missing(*args):
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(bt, "traffic", missing)
    row = _row("2026-01-01T00:00", "addnorm-triton", 0.5, gbps=123.0)
    assert bt._recounted_gbps(row) == 123.0


def test_a_changed_row_changes_the_page():
    bt = _bench_table()
    text = PAGE.read_text(encoding="utf-8")
    rows = read_rows(RESULTS)
    bt.latest_run(rows, bt.PAGE_TABLES["cpu-amd-epyc"])[0]["median_ms"] *= 2  # (the same dicts as rows')
    assert bt.render_page(text, rows) != text


def test_each_table_is_its_machines_latest_covering_run():
    bt = _bench_table()
    rows = read_rows(RESULTS)
    for name, spec in bt.PAGE_TABLES.items():
        run = bt.latest_run(rows, spec)
        assert {r["machine"] for r in run} == {spec.machine}, name
        assert len({r["time"] for r in run}) == 1, name
        shapes = {f"{r['rows']}x{r['cols']}" for r in run}
        assert shapes == set(spec.shapes.split(",")), name
        table = bt.page_table(rows, spec)
        assert run[0]["commit"] in table and run[0]["time"] in table
        # one line per shape, dtype and pass
        assert sum(line.startswith("| ") and "x" in line.split("|")[1] for line in table.splitlines()) == 4 * len(
            shapes
        )


@pytest.mark.parametrize("source", ["README.md", *(p.name for p in (ROOT / "docs").glob("*.md"))])
@pytest.mark.parametrize("page", [PAGE, LOG], ids=lambda p: p.name)
def test_links_into_the_pages_resolve(source, page):
    path = ROOT / source if source == "README.md" else ROOT / "docs" / source
    text = path.read_text(encoding="utf-8")
    anchors = _anchors(page.read_text(encoding="utf-8"))
    targets = re.findall(re.escape(page.name) + r"#([\w-]+)", text)
    if path == page:
        targets += re.findall(r"\]\(#([\w-]+)\)", text)
    for target in targets:
        assert target in anchors, f"{source}: #{target} is not a heading of docs/{page.name}"


@pytest.mark.parametrize("page", [PAGE, LOG], ids=lambda p: p.name)
def test_sections_the_code_names_exist(page):
    text = page.read_text(encoding="utf-8")
    headings_and_bold = re.findall(r"^#+ (.+)$", text, re.M) + re.findall(r"\*\*(.+?)\*\*", text, re.S)
    named = []
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]:
        source = path.read_text(encoding="utf-8")
        comments = re.sub(r"\s*#\s*", " ", source)  # a name may run over two comment lines
        named += re.findall(r"docs/" + re.escape(page.name) + r', "([^"]+)"', comments)
    assert named
    for name in named:
        name = " ".join(name.split())
        assert any(h.startswith(name) for h in headings_and_bold), f"no section {name!r} in docs/{page.name}"
