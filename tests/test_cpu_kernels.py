"""The numba CPU kernels: 16-bit rounding, determinism, wide rows, auto dispatch, warm cache.

Their general accuracy (every op, dtype, awkward size) is covered by test_functional.py,
which runs over every usable backend, this one included.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import addnorm
from addnorm import backend as backends
from conftest import assert_matches_oracle

cpu = pytest.importorskip("addnorm.kernels.cpu", reason="numba is not installed")


def _special_fp32_values() -> torch.Tensor:
    """fp32 values that stress rounding to 16 bits: ties, near-ties, overflow, subnormals, inf, NaN."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (4096,), generator=g, dtype=torch.int64).to(torch.int32)
    bits[:1024] = (bits[:1024] & ~0xFFFF) | 0x8000  # exact bf16 ties
    normal = (torch.randn(1024, generator=g) * 100).view(torch.int32)
    bits[1024:2048] = (normal & ~0x1FFF) | 0x1000  # exact fp16 ties, in fp16's normal range
    values = bits.view(torch.float32).clone()
    values[values.isnan()] = 1.0
    extra = torch.tensor(
        [0.0, 1e-40, -3e-39, 6e-8, 3e-8, 65504.0, 65520.0, 7e4, 3.4e38, float("inf"), float("-inf"), float("nan")]
    )
    return torch.cat([values, extra])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_output_rounding_is_torchs_round_to_nearest_even(dtype):
    """weight 0, bias b: the kernel's fp32 result is exactly b, so y must be b.to(dtype) bit for bit."""
    b = _special_fp32_values()
    n = b.numel()
    x = torch.randn(3, n).to(dtype)
    y, *_ = cpu.forward(x, None, torch.zeros(n), b, eps=1e-5, rms=False, residual_dtype=None)
    expected = b.to(dtype).expand(3, n)
    same = (y.view(torch.int16) == expected.view(torch.int16)) | (y.isnan() & expected.isnan())
    assert bool(same.all()), f"{int((~same).sum())} values rounded differently from torch"


def _ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at ``|t|`` (fp64 values), its subnormal spacing below the normal range."""
    fi = torch.finfo(dtype)
    exponent = torch.floor(torch.log2(t.abs().clamp_min(fi.tiny)))
    return torch.exp2(exponent) * fi.eps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stream_is_torchs_add_and_output_is_rounded_fp32(dtype):
    """The stream is torch's own rounded add, bit for bit. The output is the fp32 result rounded
    once: within half a 16-bit ulp of the exact value, plus the fp32 error of ``w*x̂ + b``
    (a few fp32 ulps of ``|w*x̂| + |b|``: where the two cancel, near zero, that is many 16-bit ulps
    of the output, and which neighbour comes out depends on the CPU's FMA use). torch's own
    layer_norm in the same dtype must meet the same bound, which keeps it honest."""
    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(64, 1000, generator=g) * 3).to(dtype), torch.randn(64, 1000, generator=g).to(dtype)
    w, b = torch.randn(1000, generator=g).to(dtype), torch.randn(1000, generator=g).to(dtype)
    y, s = addnorm.add_layer_norm(x, r, 1000, w, b, prenorm=True, backend="cpu")
    assert torch.equal(s.view(torch.int16), (x + r).view(torch.int16))  # torch's own rounded add
    s64, w64, b64 = s.double(), w.double(), b.double()
    xhat = (s64 - s64.mean(-1, keepdim=True)) * torch.rsqrt(s64.var(-1, unbiased=False, keepdim=True) + 1e-5)
    exact = xhat * w64 + b64
    fp32_error = 8 * torch.finfo(torch.float32).eps * ((xhat * w64).abs() + b64.abs())
    for name, got in (("addnorm", y), ("torch", TF.layer_norm(s, (1000,), w, b))):
        bound = 0.5 * _ulp(torch.maximum(exact.abs(), got.double().abs()), dtype) + fp32_error
        excess = ((got.double() - exact).abs() - bound).max()
        assert excess <= 0, f"{name}: {float(excess):.3g} beyond the bound"
    y_ref, _ = addnorm.add_layer_norm(x, r, 1000, w, b, prenorm=True, backend="reference")
    far = (y.view(torch.int16).int() - y_ref.view(torch.int16).int()).abs() > 1
    cancelled = exact.abs() < 64 * fp32_error
    assert bool(cancelled[far].all()), "more than 1 ulp from the reference away from a cancellation"


def _grads(backend, rows=199, n=1023):
    g = torch.Generator().manual_seed(2)
    x, r = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g)
    w, b = torch.randn(n, generator=g).requires_grad_(), torch.randn(n, generator=g).requires_grad_()
    y = addnorm.add_layer_norm(x, r, n, w, b, backend=backend)
    return torch.autograd.grad(y, (w, b), torch.randn(rows, n, generator=g))


@pytest.mark.usefixtures("parallel_cpu_kernels")
def test_parameter_gradients_are_bit_identical_from_run_to_run():
    first = _grads("cpu")
    for _ in range(3):
        again = _grads("cpu")
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    for ours, ref in zip(first, _grads("reference")):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.usefixtures("parallel_cpu_kernels")
def test_outputs_do_not_depend_on_thread_count():
    x = torch.randn(37, 3000)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = addnorm.layer_norm(x, 3000, backend="cpu")
        torch.set_num_threads(2)
        two = addnorm.layer_norm(x, 3000, backend="cpu")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("rms", [False, True])
def test_wide_rows_keep_torchs_accuracy(rms):
    """65536 features with a mean offset, forward and backward, against the fp64 oracle."""
    g = torch.Generator().manual_seed(3)
    n = 65536
    x64 = 3 + torch.randn(4, n, generator=g, dtype=torch.float64)
    w64 = torch.randn(n, generator=g, dtype=torch.float64)
    dy = torch.randn(4, n, generator=g)
    norm = (lambda t, w: TF.rms_norm(t, (n,), w, 1e-5)) if rms else (lambda t, w: TF.layer_norm(t, (n,), w))
    ours_fn = addnorm.rms_norm if rms else addnorm.layer_norm
    results = []
    for fn, dtype in (
        (lambda t, w: ours_fn(t, n, w, eps=1e-5, backend="cpu"), torch.float32),
        (norm, torch.float64),
        (norm, torch.float32),
    ):
        x, w = x64.to(dtype).requires_grad_(), w64.to(dtype).requires_grad_()
        y = fn(x, w)
        results.append((y, *torch.autograd.grad(y, (x, w), dy.to(dtype))))
    for ours, oracle, torch_fp32 in zip(*results):
        assert_matches_oracle(
            ours.detach(), oracle.detach(), torch_fp32.detach(), scale=2.0 if ours.dim() == 1 else 1.0
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 768, 2048])  # rows one, then two at a time (pair_min_cols)
@pytest.mark.parametrize("rms", [False, True])
def test_rows_scaled_for_overflow_anywhere_in_a_block(dtype, n, rms):
    """A row whose variance overflows float32 (scaled by a power of two in forward and
    backward), alone, first or second of a pair, or the odd last row: every row's ds and the
    block's dweight match the float64 oracle row by row; each row's ds is the bits of the same
    row run alone (its neighbours, scaled or not, change nothing), and dweight/dbias are the
    rows' own run-alone gradients added in row order, bit for bit."""
    g = torch.Generator().manual_seed(11)
    m = 5
    assert m * n < cpu.config.SETTINGS.parallel_min_elements  # one block: the rows in order
    assert (n >= cpu.rows.PAIR_MIN_COLS) == (n > 64)
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    for huge in range(m):
        x64 = torch.randn(m, n, generator=g, dtype=torch.float64) + 2
        x64[huge] *= 1e30  # variance 1e60: beyond float32
        r64, dy64 = (torch.randn(m, n, generator=g, dtype=torch.float64) for _ in range(2))
        w64 = torch.randn(n, generator=g, dtype=torch.float64)
        x, r, dy, w = (t.to(dtype) for t in (x64, r64, dy64, w64))
        y, s, mean, rstd = cpu.forward(x, r, w, None, eps=1e-5, rms=rms, residual_dtype=None, write_stream=False)
        assert rstd[huge] < cpu.rows._SCALE_BELOW_RSTD and (rstd >= cpu.rows._SCALE_BELOW_RSTD).sum() == m - 1
        ds, dw, db, *_ = cpu.backward(dy, None, (x, r), w, mean, rstd, rms=rms, has_bias=True)
        s64 = (x + r).double().requires_grad_()  # the stream as the forward rounded it
        w64 = w.double().requires_grad_()
        y64 = TF.rms_norm(s64, (n,), w64, 1e-5) if rms else TF.layer_norm(s64, (n,), w64, None, 1e-5)
        oracle = torch.autograd.grad(y64, (s64, w64), dy.double())
        alone = []
        for i in range(m):  # relative to each row's own magnitude (the huge row's ds is ~1e-30)
            err = (ds[i].double() - oracle[0][i]).abs().max()
            assert err <= rtol * oracle[0][i].abs().max(), (huge, i)
            row = (x[i : i + 1], r[i : i + 1])
            stats = (None if rms else mean[i : i + 1], rstd[i : i + 1])
            alone.append(cpu.backward(dy[i : i + 1], None, row, w, *stats, rms=rms, has_bias=True))
            assert torch.equal(alone[i][0][0], ds[i]), (huge, i)
        assert (dw.double() - oracle[1]).abs().max() <= rtol * (oracle[1].abs().max() + 1)
        for k, total in ((1, dw), (2, db)):
            in_order = alone[0][k]
            for a in alone[1:]:
                in_order = in_order + a[k]
            assert torch.equal(in_order, total), (huge, k)


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_scaled_for_overflow_through_auto_above_every_threshold(threads):
    """Training through ``backend="auto"`` on 64 rows of 2048 (several row blocks, rows taken two
    at a time), rows whose variance overflows float32 among them: each row's gradients are the
    bits of the same row trained alone, and match the float64 oracle."""
    g = torch.Generator().manual_seed(12)
    m, n = 64, 2048
    assert m * n >= cpu.config.SETTINGS.parallel_min_elements and n >= cpu.rows.PAIR_MIN_COLS
    x64 = torch.randn(m, n, generator=g, dtype=torch.float64) + 2
    x64[[0, 1, 31, 63]] *= 1e30  # a whole pair, a pair's second row, the last row
    r, dy = torch.randn(m, n, generator=g), torch.randn(m, n, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:

        def grads(rows):
            x, res = x64[rows].float().requires_grad_(), r[rows].clone().requires_grad_()
            addnorm.add_layer_norm(x, res, n, backend="auto").backward(dy[rows])
            return x.grad, res.grad

        dx, dres = grads(slice(None))
        for i in (0, 1, 2, 30, 31, 62, 63):
            alone = grads(slice(i, i + 1))
            assert torch.equal(alone[0][0], dx[i]) and torch.equal(alone[1][0], dres[i]), i
    finally:
        torch.set_num_threads(before)
    s64 = (x64.float() + r).double().requires_grad_()  # the stream as the forward rounded it
    (oracle,) = torch.autograd.grad(TF.layer_norm(s64, (n,), eps=1e-5), s64, dy.double())
    for i in range(m):  # relative to each row's own magnitude (a scaled row's is ~1e-30)
        assert (dx[i].double() - oracle[i]).abs().max() <= 1e-4 * oracle[i].abs().max(), i


def test_auto_picks_the_kernels_on_cpu_at_every_size():
    for shape in [(1, 3), (2, 768), (4096, 768)]:
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            assert backends.auto_name(torch.empty(*shape, dtype=dtype)) == "cpu"
    assert backends.auto_name(torch.empty(2, 768, device="meta")) == "reference"


def test_unavailable_reason_names_device():
    assert backends.unavailable_reason("cpu", torch.empty(2, 2)) is None
    assert "runs on cpu tensors, got a tensor on meta" in backends.unavailable_reason(
        "cpu", torch.empty(2, 2, device="meta")
    )


def test_second_process_loads_compiled_kernels_from_cache():
    """The on-disk cache works: a fresh process finds the kernel compiled by this one."""
    addnorm.layer_norm(torch.randn(2, 8), 8, backend="cpu")  # compiled (or loaded) and saved here
    code = (
        "import torch; from addnorm.kernels import cpu; "
        "cpu.forward(torch.randn(2, 8), None, None, None, eps=1e-5, rms=False, residual_dtype=None); "
        "print(sum(e.cache_hits for e in cpu.entry.FORWARD_ENTRIES.values()))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(addnorm.__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= 1, out.stdout


@pytest.mark.skipif(sys.platform == "win32", reason="the compile lock is an flock (POSIX)")
def test_processes_started_together_on_a_cold_cache_compile_an_entry_once(tmp_path):
    """Two processes that want the same entry from an empty cache at once: one compiles it, the
    other waits for it and loads it from the disk cache (one cache hit between them, where each
    would compile it without the lock)."""
    code = (
        "import sys, torch; from addnorm.kernels.cpu import entry; "
        "print('ready', flush=True); sys.stdin.read(); "  # then both ask for the entry at once
        "print(entry.dropped_entry(torch.float32, torch.float32, False).cache_hits)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(addnorm.__file__).parents[1]), "NUMBA_CACHE_DIR": str(tmp_path)}
    run = [sys.executable, "-c", code]
    procs = [subprocess.Popen(run, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]
        for p in procs:
            p.stdin.close()
        outs = [p.stdout.read() for p in procs]
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(int(o) for o in outs) == [0, 1], outs


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")
@pytest.mark.usefixtures("parallel_cpu_kernels")
def test_forked_child_can_still_run_the_kernels():
    """A DataLoader-style fork after the thread pool exists must not hang in the child."""
    import time

    x = torch.randn(256, 1024)  # split over the threads (parallel_cpu_kernels)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        y = addnorm.layer_norm(x, 1024, backend="cpu")
        pid = os.fork()
        if pid == 0:  # child: same call, exit status says whether it matched (compared in numpy:
            # torch's own OpenMP pool is not usable in a forked child, a known torch limitation)
            os._exit(0 if np.array_equal(addnorm.layer_norm(x, 1024, backend="cpu").numpy(), y.numpy()) else 3)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in the kernels")
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rms", [False, True])
def test_post_norm_inference_never_writes_the_stream(dtype, rms):
    """write_stream=False (no_grad post-norm) gives the same y, and no s at all."""
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(70, 300, generator=g).to(dtype), torch.randn(70, 300, generator=g).to(dtype)
    w, b = torch.randn(300, generator=g).to(dtype), torch.randn(300, generator=g).to(dtype)
    y_full, s_full, *_ = cpu.forward(x, r, w, b, eps=1e-5, rms=rms, residual_dtype=None)
    y, s, *_ = cpu.forward(x, r, w, b, eps=1e-5, rms=rms, residual_dtype=None, write_stream=False)
    assert s is None and torch.equal(y, y_full)
    assert torch.equal(s_full, x + r)
    with torch.no_grad():  # the public call takes that path
        out = (
            addnorm.add_layer_norm(x, r, 300, w, b, backend="cpu")
            if not rms
            else addnorm.add_rms_norm(x, r, 300, w, eps=1e-5, backend="cpu")
        )
    assert torch.equal(
        out, y_full if not rms else cpu.forward(x, r, w, None, eps=1e-5, rms=True, residual_dtype=None)[0]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_with_a_residual_match_the_norm_of_their_sum_bit_for_bit(dtype, rms, threads):
    """float32/float64 rows with a residual run one row ahead (the next row's add inside this
    row's output loop): y, s and the statistics are the bits of the plain norm of ``x + r``
    (torch's add, the same rounding), on 1 and 2 threads, at every position in a block (odd row
    counts, one row, rows far from zero, a row whose variance overflows and is scaled)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(4)
        for m, n in [(1, 40), (5, 300), (133, 1024)]:
            x = (torch.randn(m, n, generator=g) * 3 + 1e4).to(dtype)
            r = torch.randn(m, n, generator=g).to(dtype)
            if m > 2:  # a row whose variance overflows: scaled, done again
                x[2] = torch.linspace(-1, 1, n, dtype=dtype) * (torch.finfo(dtype).max / 2)
            w, b = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
            bias = None if rms else b
            plain = cpu.forward(x + r, None, w, bias, eps=1e-5, rms=rms, residual_dtype=None)
            for write_stream in (False, True):
                y, s, mean, rstd = cpu.forward(
                    x, r, w, bias, eps=1e-5, rms=rms, residual_dtype=None, write_stream=write_stream
                )
                assert y.isfinite().all() and torch.equal(y, plain[0]) and torch.equal(rstd, plain[3])
                assert rms or torch.equal(mean, plain[2])
                assert (s is None) != write_stream and (s is None or torch.equal(s, x + r))
            with torch.no_grad():  # the public call, through "auto", takes the same rows
                norm, add = (
                    (addnorm.rms_norm, addnorm.add_rms_norm) if rms else (addnorm.layer_norm, addnorm.add_layer_norm)
                )
                extra = {} if rms else {"bias": b}
                fused = add(x, r, n, w, eps=1e-5, backend="auto", **extra)
                assert torch.equal(fused, norm(x + r, n, w, eps=1e-5, backend="auto", **extra))
    finally:
        torch.set_num_threads(before)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process holding ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_large_fresh_outputs_ask_for_huge_pages_where_linux_wants_asking():
    """Outputs of ``huge_pages_min_bytes`` and more carry MADV_HUGEPAGE ("hg") when transparent
    huge pages are in madvise mode, and only then."""
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        madvise_mode = "[madvise]" in f.read()
    assert (cpu.launch.MADVISE is not None) == madvise_mode
    big = cpu.launch.empty_output(
        torch.empty(1, 1).expand(cpu.config.SETTINGS.huge_pages_min_bytes // 4 // 1024, 1024), torch.float32
    )
    assert ("hg" in _vm_flags(big.data_ptr() + big.nbytes // 2)) == madvise_mode


def _float64_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _packed(monkeypatch, call) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``(args, branch)`` slots ``call`` hands the entry (which is not run)."""
    calls = []
    monkeypatch.setattr(cpu, "run_on_threads", lambda entry, threads, args, branch: calls.append((args, branch)))
    result = call()
    assert len(calls) == 1
    return result, *calls[0]


def test_forward_packs_each_value_in_the_slot_its_entry_reads(monkeypatch):
    """forward packs a plain tuple in ForwardSlot order: each value must be where the entry reads
    that name (a swap would hand the kernel one tensor's address for another's)."""
    from addnorm.kernels.cpu.entry import COUNTERS, BranchSlot, ForwardSlot

    m, n = 3, 8
    x, r, w, b = torch.randn(m, n), torch.randn(m, n), torch.randn(n), torch.randn(n)
    ls, seed = torch.randn(n), torch.tensor(1234, dtype=torch.int64)
    w1, b1 = torch.randn(n), torch.randn(n)
    branch = backends.Branch(0.25, seed, ls, None)
    x1 = backends.X1(torch.randn(m, n), 0.125, torch.tensor(5678, dtype=torch.int64))
    (y, s, mean, rstd, y1), args, br = _packed(
        monkeypatch,
        lambda: cpu.forward(x, r, w, b, eps=0.5, rms=False, residual_dtype=None, branch=branch, second=(w1, b1), x1=x1),
    )
    assert len(args) == ForwardSlot.BRANCH - COUNTERS and len(br) == len(BranchSlot)
    assert {slot.name: args[slot - COUNTERS] for slot in ForwardSlot if slot < ForwardSlot.BRANCH} == {
        "X": x.data_ptr(),
        "RESIDUAL": r.data_ptr(),
        "WEIGHT": w.data_ptr(),
        "BIAS": b.data_ptr(),
        "Y": y.data_ptr(),
        "S": s.data_ptr(),
        "MEAN": mean.data_ptr(),
        "RSTD": rstd.data_ptr(),
        "ROWS": m,
        "COLS": n,
        "BLOCK_ROWS": m,
        "HAS_RESIDUAL": True,
        "WRITE_S": True,
        "RMS": False,
        "WRITE_STATS": True,
        "EPS": _float64_bits(0.5),
        "WEIGHT1": w1.data_ptr(),
        "BIAS1": b1.data_ptr(),
        "Y1": y1.data_ptr(),
        "X1": x1.x1.data_ptr(),
        "X1_SEED": 5678,
        "X1_KEEP_THRESHOLD": addnorm.reference.keep_threshold(0.125),
        "X1_SCALE": _float64_bits(addnorm.reference.dropout_scale(0.125)),
    }
    packed = {slot.name: br[slot] for slot in BranchSlot}
    assert packed.pop("ROWSCALE") not in (0, ls.data_ptr())  # a row of ones made for the call
    assert packed == {
        "SEED": 1234,
        "KEEP_THRESHOLD": addnorm.reference.keep_threshold(0.25),
        "SCALE": _float64_bits(addnorm.reference.dropout_scale(0.25)),
        "LAYER_SCALE": ls.data_ptr(),
        "LAYER_SCALED": True,
    }


def test_backward_packs_each_value_in_the_slot_its_entry_reads(monkeypatch):
    """As the forward's test, for BackwardSlot: post-norm (the stream recomputed from x and the
    residual), with a stream gradient, RMSNorm, no branch, a second norm."""
    from addnorm.kernels.cpu.entry import COUNTERS, NO_BRANCH, BackwardSlot

    m, n = 3, 8
    x, r, w, dy, dstream = torch.randn(m, n), torch.randn(m, n), torch.randn(n), torch.randn(m, n), torch.randn(m, n)
    rstd = torch.rand(m) + 1
    dy1, w1 = torch.randn(m, n), torch.randn(n)
    grads, args, br = _packed(
        monkeypatch,
        lambda: cpu.backward(dy, dstream, (x, r), w, None, rstd, rms=True, has_bias=True, second=(dy1, w1, True)),
    )
    assert len(args) == BackwardSlot.BRANCH - COUNTERS and br == NO_BRANCH
    assert {slot.name: args[slot - COUNTERS] for slot in BackwardSlot if slot < BackwardSlot.BRANCH} == {
        "DY": dy.data_ptr(),
        "DSTREAM": dstream.data_ptr(),
        "S": x.data_ptr(),
        "RESIDUAL": r.data_ptr(),
        "WEIGHT": w.data_ptr(),
        "MEAN": rstd.data_ptr(),  # RMSNorm: no mean, never read
        "RSTD": rstd.data_ptr(),
        "DS": grads.ds.data_ptr(),
        "DWEIGHT": grads.dweight.data_ptr(),
        "DBIAS": grads.dbias.data_ptr(),
        "DX": 0,
        "DLAYER_SCALE": 0,
        "ROWS": m,
        "COLS": n,
        "BLOCK_ROWS": m,
        "BLOCKS": 1,
        "HAS_DSTREAM": True,
        "RMS": True,
        "DY1": dy1.data_ptr(),
        "WEIGHT1": w1.data_ptr(),
        "DWEIGHT1": grads.dweight1.data_ptr(),
        "DBIAS1": grads.dbias1.data_ptr(),
    }


def _recording_entries(monkeypatch) -> list[tuple[str, bool]]:
    """``(direction, streamed)`` of each entry the CPU backend asks for from now on."""
    asked = []

    def record(direction, make):
        def entry(*args, **kwargs):
            asked.append((direction, bool(kwargs["streamed"])))
            return make(*args, **kwargs)

        return entry

    monkeypatch.setattr(cpu, "forward_entry", record("forward", cpu.entry.forward_entry))
    monkeypatch.setattr(cpu, "backward_entry", record("backward", cpu.entry.backward_entry))
    return asked


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_non_temporal_stores_write_the_same_bits(monkeypatch, dtype, rms, threads):
    """Large outputs go straight to memory (non-temporal stores): y, s, the statistics and every
    gradient are the bits of the same call with plain stores, post- and pre-norm, with and without
    the stream's gradient, rows one and two at a time (1024 and 2048 wide), odd row counts, a
    row scaled for overflow; and the streamed kernels did run."""
    settings = cpu.config.SETTINGS.updated(parallel_min_elements=1)
    asked = _recording_entries(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(5)
    try:
        # widths of 64-byte multiples that leave the vectorized loops a tail (1040 float32, 1032
        # float64), besides ones that do not
        odd = 1040 if dtype == torch.float32 else 1032
        for m, n in [(1, 1024), (37, 1024), (9, 2048), (5, odd)]:
            x = (torch.randn(m, n, generator=g) * 3 + 1e3).to(dtype)
            x[m // 2] = torch.linspace(-1, 1, n, dtype=dtype) * (torch.finfo(dtype).max / 2)
            r, dy, dstream = (torch.randn(m, n, generator=g).to(dtype) for _ in range(3))
            w, b = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
            for write_stream, with_dstream in [(False, False), (True, False), (True, True)]:
                results = []
                for streaming_min_bytes in (0, 1 << 62):
                    monkeypatch.setattr(
                        cpu.config, "SETTINGS", settings.updated(streaming_min_bytes=streaming_min_bytes)
                    )
                    y, s, mean, rstd = cpu.forward(
                        x, r, w, b, eps=1e-5, rms=rms, residual_dtype=None, write_stream=write_stream
                    )
                    parts = (s,) if write_stream else (x, r)
                    grads = cpu.backward(
                        dy, dstream if with_dstream else None, parts, w, mean, rstd, rms=rms, has_bias=True
                    )
                    results.append((y, s, mean, rstd, *grads[:3]))
                for streamed, plain in zip(*results):
                    assert (streamed is None and plain is None) or torch.equal(streamed, plain)
                assert results[0][0].isfinite().all()
    finally:
        torch.set_num_threads(before)
    assert {("forward", True), ("forward", False), ("backward", True), ("backward", False)} == set(asked)


def test_non_temporal_stores_only_where_they_fit(monkeypatch):
    """Outputs are streamed only in calls of ``streaming_min_bytes`` and more, and only where
    the stores' alignment holds (rows starting on 64 bytes, a multiple of 64 bytes long) and
    their vector stores fill whole cache lines (float32, float64); a misaligned ``out=`` buffer
    is still written right, with plain stores."""
    monkeypatch.setattr(cpu.config, "SETTINGS", cpu.config.SETTINGS.updated(streaming_min_bytes=1 << 20))
    big = 1 << 20
    aligned = torch.empty(8, 1024)
    assert aligned.data_ptr() % 64 == 0 and cpu.launch.streamed(aligned, big)
    assert not cpu.launch.streamed(aligned, big - 1)
    assert not cpu.launch.streamed(torch.empty(8, 1000), big)  # rows of 4000 bytes
    assert not cpu.launch.streamed(torch.empty(8, 1024, dtype=torch.bfloat16), big)
    misaligned = torch.empty(8 * 1024 + 4)[4:].view(8, 1024)  # 16 bytes past an aligned start
    assert not cpu.launch.streamed(misaligned, big)

    asked = _recording_entries(monkeypatch)
    monkeypatch.setattr(cpu.config, "SETTINGS", cpu.config.SETTINGS.updated(streaming_min_bytes=0))
    x, r = torch.randn(8, 1024), torch.randn(8, 1024)
    with torch.no_grad():
        y = addnorm.add_layer_norm(x, r, 1024, out=misaligned)
        fresh = addnorm.add_layer_norm(x, r, 1024)  # an aligned output: streamed
    assert y is misaligned and torch.equal(y, fresh)
    torch.testing.assert_close(y, TF.layer_norm(x + r, (1024,)))
    assert asked == [("forward", False), ("forward", True)]


def test_streaming_threshold_reads_the_caches_linux_lists_or_falls_back(monkeypatch, tmp_path):
    """``streaming_min_bytes`` defaults to four times the L2 cache Linux lists for cpu0, at most
    its last-level cache (instruction caches and caches of size 0 left out), or 32 MiB where it
    lists none beyond L1."""
    caches = [(1, "48K", "Data"), (1, "32K", "Instruction"), (2, "2048K", "Unified"), (3, "300M", "Unified")]

    def listed(case, entries):
        for k, (level, size, kind) in enumerate(entries):
            index = tmp_path / str(case) / f"index{k}"
            index.mkdir(parents=True)
            for name, text in (("level", level), ("size", size), ("type", kind)):
                (index / name).write_text(f"{text}\n")
        return str(tmp_path / str(case) / "index*")

    real_glob = cpu.config.glob.glob
    for case, (entries, want) in enumerate(
        [
            (caches, 8 << 20),  # 4 x 2 MiB
            (caches[:3] + [(3, "4M", "Unified")], 4 << 20),  # no more than the last level
            (caches[:2] + [(2, "1M", "Unified")], 1 << 20),  # L2 the last level
            (caches[:2] + [(3, "16M", "Unified")], 16 << 20),  # no L2: the last level
            (caches[:2] + [(2, "0K", "Unified"), (3, "300M", "Unified")], 300 << 20),  # an L2 of size 0
            (caches[:2], 32 << 20),  # L1 alone
            ([], 32 << 20),
        ]
    ):
        pattern = listed(case, entries)
        monkeypatch.setattr(cpu.config.glob, "glob", lambda p, pattern=pattern: real_glob(pattern))
        assert cpu.config.streaming_threshold_bytes() == want, entries


@pytest.mark.parametrize("threads", [1, 2])
def test_non_temporal_stores_through_the_branch_write_the_same_bits(monkeypatch, threads):
    """Through the sublayer branch (dropout, layer scale, rowscale) ``y`` and ``dx`` are streamed
    (``ds`` is read back for ``dx``, and keeps plain stores): every output and gradient is the
    bits of plain stores, pre- and post-norm."""
    settings = cpu.config.SETTINGS.updated(parallel_min_elements=1)
    asked = _recording_entries(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(6)
    m, n = 37, 1024
    x, r, dy = (torch.randn(m, n, generator=g) for _ in range(3))
    w, b, layer_scale = (torch.randn(n, generator=g) for _ in range(3))
    branch = backends.Branch(0.25, torch.tensor(1234), layer_scale, torch.rand(m, generator=g))
    try:
        for write_stream in (False, True):
            results = []
            for streaming_min_bytes in (0, 1 << 62):
                monkeypatch.setattr(cpu.config, "SETTINGS", settings.updated(streaming_min_bytes=streaming_min_bytes))
                y, s, mean, rstd = cpu.forward(
                    x, r, w, b, eps=1e-5, rms=False, residual_dtype=None, write_stream=write_stream, branch=branch
                )
                grads = cpu.backward(dy, s, (x, r), w, mean, rstd, rms=False, has_bias=True, branch=branch)
                results.append((y, s, mean, rstd, *grads))
            for streamed, plain in zip(*results):
                assert (streamed is None and plain is None) or torch.equal(streamed, plain)
            assert results[0][7] is not None and not torch.equal(results[0][7], results[0][4])  # dx is not ds
    finally:
        torch.set_num_threads(before)
    assert {("forward", True), ("forward", False), ("backward", True), ("backward", False)} == set(asked)


def test_streamed_rows_compile_to_non_temporal_vector_stores_of_the_widest_vectors(tmp_path):
    """The streamed entries' loops store whole vectors marked non-temporal (what makes them fast:
    a scalar or plain store would pass the bit-for-bit tests too): the forward's and backward's
    float32 entries, compiled afresh (a cached entry keeps no code to read), in a subprocess.
    Every function asks LLVM for vectors of ``jit.VECTOR_BITS`` (``"prefer-vector-width"``), and on
    a CPU with AVX-512 those stores are 512 bits wide (LLVM's own tuning would make them 256)."""
    code = (
        "import re, torch\n"
        "import llvmlite.binding as llvm\n"
        "from addnorm.kernels.cpu import entry, jit\n"
        "f32 = torch.float32\n"
        "print(jit.VECTOR_BITS, int('+avx512f' in llvm.get_host_cpu_features().flatten().split(',')))\n"
        "for e in (entry.forward_entry(f32, f32, f32, False, streamed=True),"
        " entry.backward_entry(f32, f32, f32, f32, f32, True, False, streamed=True),"
        " entry.backward_entry(f32, f32, f32, f32, f32, True, True, streamed=True)):\n"
        "    ll = e.inspect_llvm()\n"
        "    widths = [int(w) for w in re.findall(r'store <(\\d+) x float>[^\\n]*!nontemporal', ll)]\n"
        '    asked = f\'"prefer-vector-width"="{jit.VECTOR_BITS}"\' in ll\n'
        "    print(len(widths), max(widths, default=0) * 32, int(asked))\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    (bits, avx512), *entries = [[int(v) for v in line.split()] for line in done.stdout.splitlines()]
    assert bits == 512 and len(entries) == 3, done.stdout
    for stores, widest, asked in entries:
        assert stores > 0 and asked == 1, done.stdout
        assert widest == 512 if avx512 else 0 < widest <= 256, done.stdout


def test_auto_streams_a_training_step_above_the_default_threshold(monkeypatch):
    """Through ``backend="auto"`` with the default settings, a float32 training step whose
    forward moves more than ``streaming_min_bytes`` (four times the machine's L2: 4096x1024 or
    more rows) streams its outputs, forward and backward, and gives the bits of plain stores."""
    n = 1024
    m = max(4096, cpu.config.SETTINGS.streaming_min_bytes // (3 * n * 4) + 1)  # x, residual, y
    g = torch.Generator().manual_seed(7)
    x, r, dy = (torch.randn(m, n, generator=g) for _ in range(3))
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def step():
        leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
        y = addnorm.add_layer_norm(leaves[0], leaves[1], n, leaves[2], leaves[3], backend="auto")
        y.backward(dy)
        return (y.detach(), *(t.grad for t in leaves))

    asked = _recording_entries(monkeypatch)
    streamed = step()
    assert asked == [("forward", True), ("backward", True)]
    with cpu.config.using(streaming_min_bytes=1 << 62):
        plain = step()
    assert asked[2:] == [("forward", False), ("backward", False)]
    for a, c in zip(streamed, plain):
        assert torch.equal(a, c)


@pytest.mark.parametrize("p", [0.0, 1e-9, 0.1, 0.5, 0.999, 1.0])
def test_keep_mask_is_the_reference_hash_bit_for_bit(p):
    """The masks of x1's dropout and of return_dropout_mask come from the kernels' hash on CPU
    tensors: every bit as :func:`addnorm.reference.keep_mask`, over seeds that fill both 32-bit
    halves, one row and one column, widths across the vector lanes, and p = 1 (nothing kept)."""
    for seed in (0, 1, 0x9E3779B97F4A7C15 >> 2, 2**62 - 1):
        for m, n in [(1, 1), (3, 17), (65, 1000)]:
            seed_t = torch.tensor(seed, dtype=torch.int64)
            ours = cpu.keep_mask(seed_t, m, n, p)
            assert ours.dtype == torch.bool and ours.shape == (m, n)
            assert torch.equal(ours, addnorm.reference.keep_mask(seed_t, torch.arange(m), n, p))
    if p == 1.0:
        assert not ours.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(33, 96), (64, 2048)])  # one block; several blocks and threads, pairs
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("backend", ["cpu", "auto"])
def test_post_norm_training_gives_the_same_bits_whether_the_stream_is_saved_or_recomputed(
    monkeypatch, dtype, shape, rms, backend
):
    """The CPU backend's post-norm training of a float32 or float64 stream saves ``x`` and
    ``residual`` and adds the stream again in the backward (``recomputes_stream``); the plan
    every other backend (and the CPU backend for 16-bit streams) follows writes ``s`` in the
    forward and reads it back. Both must give every output and gradient bit for bit
    (``benchmarks/cpu_save_plan.py`` times the two), and match the float64 oracle."""
    m, n = shape
    assert backends.resolve(backend, torch.empty(1, n)) is cpu  # "auto" picks it for CPU tensors
    g = torch.Generator().manual_seed(13)
    x64, r64, dy64 = (torch.randn(m, n, generator=g, dtype=torch.float64) + 3 for _ in range(3))
    w64, b64 = (torch.randn(n, generator=g, dtype=torch.float64) for _ in range(2))

    def train(recompute: bool):
        caps = dataclasses.replace(cpu.CAPABILITIES, recomputes_stream=(dtype,) if recompute else ())
        monkeypatch.setattr(cpu, "CAPABILITIES", caps)
        x, r, w, b = (t.to(dtype).requires_grad_() for t in (x64, r64, w64, b64))
        if rms:
            y = addnorm.add_rms_norm(x, r, n, w, backend=backend)
        else:
            y = addnorm.add_layer_norm(x, r, n, w, b, backend=backend)
        leaves = (x, r, w) if rms else (x, r, w, b)
        return (y, *torch.autograd.grad(y, leaves, dy64.to(dtype)))

    recomputed, saved = train(True), train(False)
    for a, c in zip(recomputed, saved, strict=True):
        assert torch.equal(a, c)

    def norm_grads(s, w, b, dy):  # torch's own: y, ds, dweight
        s, w, b = (t.detach().requires_grad_() for t in (s, w, b))
        y = TF.rms_norm(s, (n,), w, 1e-5) if rms else TF.layer_norm(s, (n,), w, b, 1e-5)
        return (y.detach(), *torch.autograd.grad(y, (s, w), dy))

    s = x64.to(dtype) + r64.to(dtype)  # the stream as rounded
    w, b, dy = w64.to(dtype), b64.to(dtype), dy64.to(dtype)
    oracle = norm_grads(s.double(), w.double(), b.double(), dy.double())
    same_dtype = norm_grads(s, w, b, dy)
    for ours, k in ((recomputed[0], 0), (recomputed[1], 1), (recomputed[3], 2)):
        assert_matches_oracle(ours, oracle[k], same_dtype[k], scale=m if k == 2 else 1.0)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor the kernels cannot read as it is (every other element)."""
    return torch.stack([t, t], -1)[..., 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rows", [1, 85, 86])  # 85 x 768 the last one-thread call, 86 x 768 past it
def test_calls_of_one_block_in_fewer_steps_give_the_bits_of_the_full_path(monkeypatch, dtype, rows):
    """forward and backward take a call of one block with no option, whose tensors the kernel
    reads as they are, in fewer steps (``_plain``, ``_plain_backward``): the same call with every
    tensor strided takes the full path, with the same bits, for LayerNorm and RMSNorm, with and
    without a residual, weight, bias and stream gradient, the stream saved or recomputed, and
    dweight/dbias in each dtype backward returns them in."""
    n = 768
    taken = {"forward": 0, "backward": 0}
    for name, direction in (("_plain", "forward"), ("_plain_backward", "backward")):
        original = getattr(cpu, name)

        def counting(*args, _original=original, _direction=direction):
            result = _original(*args)
            taken[_direction] += result is not None
            return result

        monkeypatch.setattr(cpu, name, counting)
    g = torch.Generator().manual_seed(rows)
    x, r, dy, dstream = ((torch.randn(rows, n, generator=g) * 3 + 50).to(dtype) for _ in range(4))
    w, b = (torch.randn(n, generator=g).to(dtype) for _ in range(2))
    calls = 0
    for rms in (False, True):
        for residual, weight, bias in ((r, w, b), (None, w, None), (r, None, None)):
            kw = dict(eps=1e-5, rms=rms, residual_dtype=None, write_stream=residual is not None)
            fast = cpu.forward(x, residual, weight, bias, **kw)
            full = cpu.forward(*(None if t is None else _strided(t) for t in (x, residual, weight, bias)), **kw)
            for ours, theirs in zip(fast, full, strict=True):
                assert (ours is None and theirs is None) or torch.equal(ours, theirs)
            _, s, mean, rstd = fast
            cd = rstd.dtype
            for parts in ((x,),) if residual is None else ((s,), (x, residual)):
                for d in (None, dstream):
                    for param_dtype in {None, dtype, cd}:
                        args = (mean, rstd)
                        kw = dict(rms=rms, has_bias=bias is not None, param_dtype=param_dtype)
                        fast = cpu.backward(dy, d, parts, weight, *args, **kw)
                        strided = [None if t is None else _strided(t) for t in (dy, d, weight)]
                        full = cpu.backward(
                            strided[0], strided[1], tuple(map(_strided, parts)), strided[2], *args, **kw
                        )
                        calls += 1
                        for ours, theirs in zip(fast, full, strict=True):
                            assert (ours is None and theirs is None) or (
                                ours.dtype == theirs.dtype and torch.equal(ours, theirs)
                            )
    one_block = rows * n < cpu.config.SETTINGS.parallel_min_elements
    assert taken == ({"forward": 6, "backward": calls} if one_block else {"forward": 0, "backward": 0})
