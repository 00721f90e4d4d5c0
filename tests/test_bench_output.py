"""``addnorm bench --format``: each format read back, and the table within 80 columns; and the
bytes a call moves (``bytes_moved``) against a hand count and against what autograd saves."""

from __future__ import annotations

import csv
import io
import json

import pytest
import torch

import addnorm
from addnorm.tools import bench
from addnorm.tools.bench import bytes_moved, impls, table
from addnorm.tools.cli import main

RUN = "bench --op add_layer_norm,rms_norm --shapes 4x64 --dtype float32 --pass fwd,fwd+bwd --rounds 3".split()
RUN += ["--impl", "torch-eager,addnorm-reference,addnorm,liger"]


@pytest.fixture
def fixed_copy(monkeypatch):
    """A copy bandwidth of 10 GB/s, at the run's start and beside each configuration: copy
    fractions are then gbps / 10."""

    class TenGBps:
        def __init__(self, device):
            pass

        def __call__(self):
            pass

        def gbps(self, seconds_per_call):
            return 10.0

    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 10.0)
    monkeypatch.setattr(bench, "Copy", TenGBps)


def _check_values(rows: list[dict]) -> None:
    """Four configurations x three implementations, with the derived columns right."""
    assert len(rows) == 2 * 2 * 3
    assert {(r["op"], r["pass"]) for r in rows} == {
        (o, p) for o in ("add_layer_norm", "rms_norm") for p in bench.PASSES[::2]
    }
    eager = {(r["op"], r["pass"]): float(r["median_ms"]) for r in rows if r["impl"] == "torch-eager"}
    for r in rows:
        assert float(r["copy_gbps"]) == 10.0
        assert float(r["copy_fraction"]) == pytest.approx(float(r["gbps"]) / 10.0)
        assert float(r["vs_torch_eager"]) == pytest.approx(eager[r["op"], r["pass"]] / float(r["median_ms"]))
        assert int(r["bytes"]) == bytes_moved(
            r["op"], 4, 64, torch.float32, r["pass"], **impls.traffic(r["impl"], "cpu", torch.float32)
        )


def test_json_parses_back(capsys, fixed_copy):
    assert main([*RUN, "--format", "json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)  # stdout holds the JSON alone; the machine line went to stderr
    assert "copy bandwidth 10.0 GB/s" in err
    assert list(doc["rows"][0]) == bench.ROW_FIELDS + table.EXTRA_FIELDS
    assert "liger" in doc["skipped"]
    _check_values(doc["rows"])


def test_csv_parses_back(capsys, fixed_copy):
    assert main([*RUN, "--format", "csv"]) == 0
    out = capsys.readouterr().out
    reader = csv.DictReader(io.StringIO(out))
    assert reader.fieldnames == bench.ROW_FIELDS + table.EXTRA_FIELDS
    _check_values(list(reader))


def test_table_fits_80_columns_grouped_by_configuration(capsys, fixed_copy, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main([*RUN, "--impl", "torch-eager,addnorm-reference,torch-compile,liger,apex,flash-attn"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    headings = [line for line in lines if line and not line.startswith(" ")]
    assert "add_layer_norm fwd+bwd, 4x64, float32" in headings and "rms_norm fwd, 4x64, float32" in headings
    eager = [line.split() for line in lines if line.strip().startswith("torch-eager")]
    assert len(eager) == 4 and all(cells[-1] == "1.00x" for cells in eager)  # whole numbers, no "…"
    assert not any("…" in line for line in lines)
    assert any(line.strip().startswith("flash-attn: not installed") for line in lines)


def test_markdown_is_one_table(capsys, fixed_copy):
    assert main([*RUN, "--format", "markdown"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert lines[0].startswith("| op | pass | shape | dtype | impl | median ms")
    assert len(lines) == 2 + 12 and all(line.count("|") == 11 for line in lines)
    firsts = [line.split("|")[1].strip() for line in lines[2:]]
    assert firsts.count("add_layer_norm") == 2 and firsts.count("") == 8  # config named once per group


def test_a_format_not_offered_is_a_usage_error(capsys):
    assert main(["bench", "--format", "xml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--format" in err and "xml" in err


# --------------------------------------------------------------------------- bytes_moved

M, N = 4, 8


@pytest.mark.parametrize(
    "op,pass_,flags,expected_elements,stats",
    [
        # inference: x (r) w (b) read, y written; no s, no statistics
        ("layer_norm", "fwd", {}, 2 * M * N + 2 * N, 0),
        ("add_layer_norm", "fwd", {"recomputes_stream": True}, 3 * M * N + 2 * N, 0),
        ("add_rms_norm", "fwd", {}, 3 * M * N + N, 0),
        # a backend writing s and the statistics anyway
        ("add_rms_norm", "fwd", {"writes_unused": True}, 4 * M * N + N, M),
        # backward reading s: dy, s, dx + w read, dw db written; mean and rstd read
        ("add_layer_norm", "bwd", {}, 3 * M * N + 3 * N, 2 * M),
        # backward recomputing s: dy, x, r, dx
        ("add_layer_norm", "bwd", {"recomputes_stream": True}, 4 * M * N + 3 * N, 2 * M),
        # dropout: x and r saved, dx and dresidual two tensors
        ("add_rms_norm_dropout", "bwd", {}, 5 * M * N + 2 * N, M),
        # training: the forward writes s and statistics (or not s), the backward reads them back
        ("add_layer_norm", "fwd+bwd", {}, (3 * M * N + 2 * N + M * N) + (3 * M * N + 3 * N), 4 * M),
        ("add_layer_norm", "fwd+bwd", {"recomputes_stream": True}, (3 * M * N + 2 * N) + (4 * M * N + 3 * N), 4 * M),
        ("rms_norm", "fwd+bwd", {"writes_unused": True}, (2 * M * N + N) + (3 * M * N + 2 * N), 2 * M),
        # dropout and a backend writing s anyway: s written, x and r saved and read
        ("add_rms_norm_dropout", "fwd+bwd", {"writes_unused": True}, (4 * M * N + N) + (5 * M * N + 2 * N), 2 * M),
    ],
)
def test_bytes_moved_hand_count(op, pass_, flags, expected_elements, stats):
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):  # statistics in float32 either way
        assert bytes_moved(op, M, N, dtype, pass_, **flags) == expected_elements * size + stats * 4
    assert bytes_moved(op, M, N, torch.float64, pass_, **flags) == (expected_elements + stats) * 8


def test_bytes_moved_counts_the_stream_buffer_when_filled():
    plain = bytes_moved("add_layer_norm", M, N, torch.float32, "fwd")
    assert bytes_moved("add_layer_norm", M, N, torch.float32, "fwd", writes_stream=True) == plain + M * N * 4
    assert bytes_moved("layer_norm", M, N, torch.float32, "fwd", writes_stream=True) == (2 * M * N + 2 * N) * 4


def _observed(op: str, backend: str, dtype: torch.dtype, pass_: str, monkeypatch) -> int:
    """The bytes of one call seen from outside the count: the inputs; the tensors the backend's
    forward returns (what it wrote); for a backward, ``dy``, the tensors autograd saved for it
    (hooks) and the distinct gradients it returns."""
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_()  # noqa: E731
    x, r, w, b = mk(M, N), mk(M, N), mk(N), mk(N)
    rms, add = "rms" in op, op.startswith("add_")
    inputs = [x, *([r] if add else []), w, *([] if rms else [b])]
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    written: list[torch.Tensor] = []
    impl = addnorm.backend.load(backend)
    real = impl.forward

    def forward(*args, **kwargs):
        out = real(*args, **kwargs)
        written.extend(t for t in out if t is not None and t.numel())
        return out

    monkeypatch.setattr(impl, "forward", forward)
    saved: dict[int, torch.Tensor] = {}

    def pack(t):
        if t.numel() and not (t.dtype == torch.int64 and t.dim() == 0):  # (the dropout seed is left out)
            saved[t.data_ptr()] = t
        return t

    kwargs = {"backend": backend, **({"dropout_p": 0.1} if op.endswith("_dropout") else {})}
    call = lambda: getattr(addnorm, op.removesuffix("_dropout"))(*inputs[: 1 + add], N, *inputs[1 + add :], **kwargs)  # noqa: E731
    if pass_ == "fwd":
        with torch.no_grad():
            call()
        return nbytes(inputs) + nbytes(written)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = call()
    grads = {t.data_ptr(): t for t in torch.autograd.grad(y, inputs, torch.ones_like(y))}.values()
    bwd = nbytes([y]) + nbytes(saved.values()) + nbytes(grads)  # dy is y's size
    return bwd if pass_ == "bwd" else nbytes(inputs) + nbytes(written) + bwd


@pytest.mark.parametrize("op", bench.OPS)
@pytest.mark.parametrize("backend", ["cpu", "triton", "reference"])
def test_bytes_moved_is_what_each_backend_reads_and_writes(op, backend, monkeypatch):
    for dtype in (torch.float32, torch.bfloat16):
        flags = impls.traffic(f"addnorm-{backend}", "cpu", dtype)
        # addnorm.autograd.save_plan: the CPU kernels recompute a float32 s, save a 16-bit one;
        # the CPU and Triton kernels write only what is used, the reference everything
        recomputes = backend == "cpu" and dtype == torch.float32
        assert flags == {"recomputes_stream": recomputes, "writes_unused": backend == "reference"}
        for pass_ in bench.PASSES:
            expected = _observed(op, backend, dtype, pass_, monkeypatch)
            assert bytes_moved(op, M, N, dtype, pass_, **flags) == expected, (dtype, pass_)


def test_rows_carry_the_copy_bandwidth_timed_beside_their_configuration(capsys, monkeypatch):
    """The run's start measures 10 GB/s; the copy timed in each configuration's rounds 20 GB/s:
    the rows (and their fractions) take the latter, and the copy was timed in every round."""
    calls = []

    class TwentyGBps:
        def __init__(self, device):
            pass

        def __call__(self):
            calls.append(1)

        def gbps(self, seconds_per_call):
            return 20.0

    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 10.0)
    monkeypatch.setattr(bench, "Copy", TwentyGBps)
    assert main([*RUN, "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert "copy bandwidth 10.0 GB/s" in err
    rows = json.loads(out)["rows"]
    assert {r["copy_gbps"] for r in rows} == {20.0}
    assert all(r["copy_fraction"] == pytest.approx(r["gbps"] / 20.0) for r in rows)
    assert len(calls) >= 4 * 3  # four configurations, every round (at least 3) times the copy
