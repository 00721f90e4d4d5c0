"""The Triton kernels' own paths: chunked wide rows, row strides, determinism, bf16 rounding.

The core suite (test_functional.py) already runs every op through ``backend="triton"``; these
tests reach what its shapes do not. On CPU tensors they run through Triton's interpreter
(conftest.py sets TRITON_INTERPRET=1), so shapes stay small and the chunked path is forced
at small N by lowering its threshold.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as TF

import addnorm
import test_numerics
from addnorm import backend as backends
from addnorm.kernels import torch as torch_kernels
from conftest import TEST_DEVICE, TOLERANCES, assert_matches_oracle

triton = pytest.importorskip("triton")  # the optional [gpu] extra; CI installs it
from addnorm.kernels import triton as K  # noqa: E402
from addnorm.kernels.triton import common, config  # noqa: E402


def chunked_above(n: int) -> config.LaunchTable:
    """The launch table with rows wider than ``n`` features on the chunked path (forward and
    plain backward), in chunks of ``n``."""
    table = config.TABLE.updated("forward", max_fused_n=n).updated("backward", max_fused_n=n)
    return table.updated("chunked", chunk_n=n)


def force_chunked(monkeypatch) -> None:
    """Rows wider than 256 features take the chunked path, in chunks of 256."""
    monkeypatch.setattr(config, "TABLE", chunked_above(256))


@pytest.fixture
def chunked(monkeypatch):
    force_chunked(monkeypatch)


@pytest.fixture
def gpu_tiles(monkeypatch):
    """The tile shapes a GPU launch uses, instead of the interpreter's taller tiles."""
    gpu = config.TABLE.forward
    table = config.TABLE.updated("interpreter", tile_elems=gpu.tile_elems, max_block_m=gpu.max_block_m)
    monkeypatch.setattr(config, "TABLE", table)


def rows_of(m, n, dtype, seed=0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, n, generator=g, dtype=torch.float64) + offset).to(dtype)


def check_against_torch(m, n, dtype, *, rms, residual=True, offset=0.0):
    """Forward and backward of add_(layer|rms)_norm with prenorm against torch in float64."""
    x, r, dy, ds = (rows_of(m, n, dtype, seed=i, offset=offset if i < 2 else 0.0) for i in range(4))
    w, b = rows_of(1, n, dtype, seed=5)[0], rows_of(1, n, dtype, seed=6)[0]
    b = None if rms else b
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b) if t is not None]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    leaves_t = [t.detach().clone().requires_grad_() for t in leaves]
    outs = []
    for (xx, rr, ww, *bb), impl in ((leaves, "ours"), (leaves64, "torch"), (leaves_t, "torch")):
        bb = bb[0] if bb else None
        if impl == "ours":
            fn = addnorm.add_rms_norm if rms else addnorm.add_layer_norm
            args = (xx, rr, n, ww) if rms else (xx, rr, n, ww, bb)
            y, s = fn(*args, eps=1e-5, prenorm=True, backend="triton")
        else:
            s = xx + rr
            y = TF.rms_norm(s, (n,), ww, 1e-5) if rms else TF.layer_norm(s, (n,), ww, bb, 1e-5)
        outs.append((y, s))
    (y, s), (y64, s64), (yt, st) = outs
    assert_matches_oracle(y, y64.detach(), yt.detach())
    assert_matches_oracle(s, s64.detach(), st.detach())
    grads = torch.autograd.grad((y, s), leaves, (dy, ds))
    grads64 = torch.autograd.grad((y64, s64), leaves64, (dy.double(), ds.double()))
    grads_t = torch.autograd.grad((yt, st), leaves_t, (dy, ds))
    for ours, oracle, same in zip(grads, grads64, grads_t, strict=True):
        assert_matches_oracle(ours, oracle, same, scale=max(1.0, m**0.5) if ours.dim() == 1 else 1.0)


@pytest.mark.filterwarnings("ignore:normalizing over 1 feature")
@pytest.mark.parametrize("n", [1, 1000])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_awkward_widths_match_torch(n, rms, dtype):
    """N=1 (a tile of one column, masked) and N=1000 (a 1024-wide tile with 24 masked lanes)."""
    check_against_torch(7, n, dtype, rms=rms)


@pytest.mark.parametrize("n", [257, 1000])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_rows_match_torch(chunked, n, rms, dtype):
    check_against_torch(5, n, dtype, rms=rms)


@pytest.mark.parametrize("rms", [False, True])
def test_chunked_fp32_stream_under_bf16(chunked, rms):
    """residual_dtype=float32 on the chunked path: s is x + residual in fp32, y is bf16."""
    x, r = rows_of(4, 600, torch.bfloat16), rows_of(4, 600, torch.float32, seed=1)
    fn = addnorm.add_rms_norm if rms else addnorm.add_layer_norm
    y, s = fn(x, r, 600, prenorm=True, residual_dtype=torch.float32, backend="triton")
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert torch.equal(s, x.float() + r)
    s64 = s.double()
    oracle = TF.rms_norm(s64, (600,), eps=1e-5) if rms else TF.layer_norm(s64, (600,), eps=1e-5)
    torch.testing.assert_close(y.double(), oracle, rtol=1.6e-2, atol=1e-2)


def test_chunked_statistics_with_large_mean_offset(chunked):
    """Chan's chunk combination keeps fp32 rows of 1e4 + N(0, 1) as accurate as torch's."""
    x = rows_of(16, 1000, torch.float64, offset=1e4)
    oracle = TF.layer_norm(x, (1000,))
    ours = (addnorm.layer_norm(x.float(), 1000, backend="triton").double() - oracle).abs().max()
    theirs = (TF.layer_norm(x.float(), (1000,)).double() - oracle).abs().max()
    assert ours <= 1.5 * theirs + 1e-6, (ours, theirs)


CHUNKED_SCENARIOS = [
    sc
    for sc in test_numerics.SCENARIOS
    if sc.name
    in (
        "mean offset 1e6",
        "all-equal rows",
        "near-constant (var 1e-8 << eps)",
        "bf16 1e18 rms",
        "near bf16 max",
        "denormal fp32",
    )
]


@pytest.mark.parametrize("sc", CHUNKED_SCENARIOS, ids=[s.name for s in CHUNKED_SCENARIOS])
def test_chunked_hard_numerics(chunked, sc):
    """The chunked path (two chunks of 256 here) meets the same bar as the fused one: offset,
    constant, near-overflow and subnormal rows, forward and backward, against fp64 and torch."""
    test_numerics.test_error_no_worse_than_torch("triton", sc)


def test_chunked_offset_rows_are_centered_exactly(chunked):
    test_numerics.test_offset_rows_are_centered_exactly("triton")


@pytest.mark.parametrize("mode", test_numerics.OFFSET_MODES)
@pytest.mark.parametrize("rows", ["offset 1e4", "offset 1e6"])
def test_chunked_offset_rows_gradients(chunked, rows, mode):
    """The coefficient kernel re-centres the saved mean too (three chunks of 256 here)."""
    test_numerics.offset_gradients("triton", rows, mode, m=3, n=600)


# per dtype, the exponents j of max|s| = 2**j: both sides of 1, and up to the dtype's largest
POW2_MAX = {
    torch.float32: [-1, 0, 1, 64, 126, 127],
    torch.bfloat16: [-1, 0, 1, 60, 127],
    torch.float64: [-1, 0, 1, 600, 1023],
}


@pytest.mark.parametrize("path", ["fused", "chunked"])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", list(POW2_MAX), ids=str)
def test_rows_whose_max_is_a_power_of_two(monkeypatch, path, rms, dtype):
    """Row j has max|s| exactly 2**j (the frexp edge of the row scale), up to the dtype's top
    binade, where s**2 overflows. Oracle: torch in fp64 on s / 2**j with eps / 4**j, which is
    the same function (LayerNorm and RMSNorm are scale-invariant once eps is scaled too); the
    gradient of s is that oracle's gradient divided by 2**j. Compared after scaling by 2**j."""
    if path == "chunked":
        force_chunked(monkeypatch)
    js, n, eps = POW2_MAX[dtype], 300, 1e-5
    scale = torch.tensor([2.0**j for j in js], dtype=torch.float64)[:, None]
    unit = rows_of(len(js), n, torch.float64).clamp(-0.99, 0.99)
    unit[:, 7] = 1.0
    x = (unit * scale).to(dtype)
    w, dy = rows_of(1, n, dtype, seed=1)[0] + 1, rows_of(len(js), n, dtype, seed=2)
    b = None if rms else rows_of(1, n, dtype, seed=3)[0]
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    y = test_numerics.ours_norm(*leaves, b, eps, rms, "triton")
    dx, dw = torch.autograd.grad(y, leaves, dy)
    rtol, atol = TOLERANCES[dtype]
    for i, c in enumerate(scale[:, 0].tolist()):
        s, w64 = (x[i : i + 1].double() / c).requires_grad_(), w.double()
        b64 = None if b is None else b.double()
        y64 = test_numerics.torch_norm(s, None, None, eps / c / c, rms) * w64
        y64 = y64 + b64 if b64 is not None else y64
        (ds64,) = torch.autograd.grad(y64, s, dy[i : i + 1].double())
        torch.testing.assert_close(y[i : i + 1].double(), y64, rtol=rtol, atol=atol, msg=f"y, 2**{js[i]}")
        torch.testing.assert_close(dx[i : i + 1].double() * c, ds64, rtol=rtol, atol=atol, msg=f"dx, 2**{js[i]}")
    xhat = torch.stack(
        [
            test_numerics.torch_norm(x[i].double() / c, None, None, eps / c / c, rms)
            for i, c in enumerate(scale[:, 0].tolist())
        ]
    )
    torch.testing.assert_close(dw.double(), (dy.double() * xhat).sum(0), rtol=rtol, atol=atol * len(js))


@pytest.mark.parametrize("n", [1000, 3000])
def test_gpu_tile_shapes_match_torch(gpu_tiles, n):
    """One row per tile (N=3000) and four rows per tile (N=1000), as the forward is launched on
    a GPU (the backward's GPU tiles hold one row at both)."""
    check_against_torch(9, n, torch.float32, rms=False)


@pytest.mark.parametrize("path", ["fused", "chunked"])
def test_one_row_writes_dweight_and_dbias(monkeypatch, path):
    if path == "chunked":
        force_chunked(monkeypatch)
    s, dy = rows_of(1, 1000, torch.float32), rows_of(1, 1000, torch.float32, seed=1)
    w = rows_of(1, 1000, torch.float32, seed=2)[0]
    _, _, mean, rstd = torch_kernels.forward(s, None, w, None, eps=1e-5, rms=False, residual_dtype=None)
    _, dweight, dbias, *_ = K.backward(dy, None, (s,), w, mean, rstd, rms=False, has_bias=True)
    xhat = (s.double() - s.double().mean()) / s.double().var(unbiased=False).add(1e-5).sqrt()
    torch.testing.assert_close(dweight.double(), (dy.double() * xhat)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dbias, dy[0], rtol=0, atol=0)


@pytest.mark.parametrize("path,m", [("fused", 150), ("chunked", 24)])
def test_dweight_is_bit_identical_across_runs(monkeypatch, path, m):
    """Several programs' partials (3 or 4 here) summed in a fixed order: same bits every run."""
    if path == "chunked":
        force_chunked(monkeypatch)
    s, dy = rows_of(m, 600, torch.float32), rows_of(m, 600, torch.float32, seed=1)
    w = rows_of(1, 600, torch.float32, seed=2)[0]
    _, _, mean, rstd = torch_kernels.forward(s, None, w, None, eps=1e-5, rms=False, residual_dtype=None)
    first = K.backward(dy, None, (s,), w, mean, rstd, rms=False, has_bias=True)
    again = K.backward(dy.clone(), None, (s.clone(),), w, mean, rstd, rms=False, has_bias=True)
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(first, again, strict=True))
    oracle = torch_kernels.backward(
        dy.double(), None, (s.double(),), w.double(), mean.double(), rstd.double(), rms=False, has_bias=True
    )
    torch.testing.assert_close(first[1].double(), oracle[1], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("path", ["fused", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_prefetching_backward_gives_the_same_bits(monkeypatch, path, dtype):
    """A backward that loads its next tile of rows before reducing the current one (``prefetch``)
    computes every output from the same values in the same order: the bits of the one that does
    not, with each program walking several tiles, the last one cut short (37 rows), for the
    plain backward (with a stream gradient), RMSNorm, the branch (dropout, layer scale) and a
    second norm of the stream."""
    if path == "chunked":
        force_chunked(monkeypatch)
    m, n = 37, 300 if path == "chunked" else 200
    few = config.TABLE.updated("interpreter", tile_elems=256, max_block_m=2, backward_programs=3)
    for kind in ("backward", "branch_backward"):  # a handful of programs on a GPU too
        few = few.updated(kind, tile_elems=256, max_block_m=2, warps_in_flight=4)
    few = few.updated("chunked", warps_in_flight=4)
    x, r, dy, dst, dy1 = (rows_of(m, n, dtype, seed=i) for i in range(5))
    w, b, w1, ls = (rows_of(1, n, dtype, seed=5 + i)[0] for i in range(4))
    y, s, mean, rstd = K.forward(x, r, w, b, eps=1e-5, rms=False, residual_dtype=None)
    rstd_rms = K.forward(x, r, w, None, eps=1e-5, rms=True, residual_dtype=None)[3]
    seed = torch.tensor(7, dtype=torch.int64)
    calls = {
        "plain": lambda: K.backward(dy, dst, (s,), w, mean, rstd, rms=False, has_bias=True),
        "rms": lambda: K.backward(dy, None, (s,), w, None, rstd_rms, rms=True, has_bias=False),
        "branch": lambda: K.backward(
            dy, dst, (x, r), w, mean, rstd, rms=False, has_bias=True, branch=backends.Branch(0.3, seed, ls, None)
        ),
        "second": lambda: K.backward(dy, None, (s,), w, mean, rstd, rms=False, has_bias=True, second=(dy1, w1, True)),
    }
    for name, call in calls.items():
        results = []
        for prefetch in (False, True):
            table = few.updated("chunked", prefetch=prefetch)
            for kind in ("backward", "branch_backward"):
                table = table.updated(kind, prefetch=prefetch)
            monkeypatch.setattr(config, "TABLE", table)
            results.append(call())
        assert all(a is c is None or torch.equal(a, c) for a, c in zip(*results, strict=True)), name
        assert results[0].ds.isfinite().all(), name


def test_each_kernel_kind_launches_from_its_own_table_entry(monkeypatch):
    """The forward, the plain backward and the backward through the sublayer branch (dropout)
    each plan their launch from their own entry of the launch table."""
    seen = []
    plan = config.plan
    monkeypatch.setattr(config, "plan", lambda kind, *args: seen.append(kind) or plan(kind, *args))
    x, r = rows_of(4, 64, torch.float32).requires_grad_(), rows_of(4, 64, torch.float32, seed=1)
    addnorm.add_layer_norm(x, r, 64, backend="triton").sum().backward()
    addnorm.add_layer_norm(x, r, 64, dropout_p=0.5, backend="triton").sum().backward()
    assert seen == ["forward", "backward", "forward", "branch_backward"]


def test_a_kinds_bytes_per_thread_set_its_warps_on_a_gpu(monkeypatch):
    """On a GPU launch, num_warps follows the kind's own bytes per thread (a 4096-wide bf16 row
    of 8 KiB: 8 warps at 32 bytes, 32 at 8), counted in the statistics dtype where the entry
    says so, and the chunked path follows the chunked entry."""
    cuda = torch.device("cuda")
    table = config.TABLE.updated("branch_backward", bytes_per_thread=32)
    table = table.updated("backward", bytes_per_thread=8, stats_bytes=False)
    monkeypatch.setattr(config, "TABLE", table)
    assert config.plan("branch_backward", 4096, cuda, 2) == (1, 4096, 8, False)
    assert config.plan("backward", 4096, cuda, 2) == (1, 4096, 32, False)
    # the plain backward counts its tiles in the statistics dtype: bf16 rows take fp32's warps
    counted = table.updated("backward", bytes_per_thread=64, tile_elems=1024, stats_bytes=True)
    monkeypatch.setattr(config, "TABLE", counted)
    assert config.plan("backward", 4096, cuda, 2) == config.plan("backward", 4096, cuda, 4) == (1, 4096, 8, False)
    assert config.plan("backward", 768, cuda, 2) == (1, 1024, 2, False)
    assert config.plan("backward", 4096, cuda, 8) == (1, 4096, 16, False)  # fp64 statistics
    # stacked short rows share the warps of one row: 4 rows of 768 (a 1024-wide tile) in bf16
    # at 16 bytes per row per thread take 4 warps, and at most 64 bytes per thread in all
    stacked = table.updated("branch_backward", bytes_per_thread=16, stacked_bytes_per_thread=64)
    monkeypatch.setattr(config, "TABLE", stacked)
    assert config.plan("branch_backward", 768, cuda, 2) == (4, 1024, 4, False)
    assert config.plan("branch_backward", 2048, cuda, 2) == (2, 2048, 8, False)
    assert config.plan("branch_backward", 512, cuda, 2) == (8, 512, 4, False)  # 64 bytes, not 16 * 8
    assert config.plan("branch_backward", 256, cuda, 2) == (16, 256, 16, False)  # narrower: per tile
    monkeypatch.setattr(config, "TABLE", table)
    chunk = table.chunked  # one row per program, chunk_n columns of 2 bytes
    warps = chunk.chunk_n * 2 // (32 * chunk.bytes_per_thread)
    assert config.plan("backward", 65536, cuda, 2) == (1, chunk.chunk_n, warps, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_launch_gives_the_bits_of_tritons_own_launcher(monkeypatch, dtype):
    """``common.launch`` calls a kernel compiled earlier directly on a GPU (CPU tensors go through
    the interpreter, and nothing is kept): forward and backward of a parallel block with dropout
    on both branches, and the forwards that write less (inference, a plain call), at
    16-byte-aligned and unaligned addresses, give Triton's own launcher's bits on the first call
    and on the calls that reuse a compiled kernel."""
    from addnorm.kernels.triton import backward_kernels, dropped_kernels, forward_kernels

    m, n = 37, 200
    flat = rows_of(1, 3 * m * n + 1, dtype)[0]
    aligned, unaligned = flat[: m * n].view(m, n), flat[1 : m * n + 1].view(m, n)
    assert aligned.data_ptr() % 16 == 0 and unaligned.data_ptr() % 16 != 0
    r, x1 = (rows_of(m, n, dtype, seed=i) for i in (1, 2))
    params = [rows_of(1, n, dtype, seed=i)[0] for i in (3, 4, 5)]

    def run() -> list:
        results = []
        for x in (aligned, unaligned, aligned):
            x, x1g = x.detach().requires_grad_(), x1.clone().requires_grad_()
            w, b, w1 = (p.clone().requires_grad_() for p in params)
            g = torch.Generator(device=x.device).manual_seed(7)
            y, y1, s = addnorm.add_layer_norm(
                x, r, n, w, b, prenorm=True, dropout_p=0.25, generator=g, x1=x1g, weight1=w1, backend="triton"
            )
            (y.float().square().sum() + y1.float().sum() + s.float().sum()).backward()
            results += [y, y1, s, x.grad, x1g.grad, w.grad, b.grad, w1.grad]
            with torch.no_grad():  # the forward writing y alone: inference's, and a plain call's
                results.append(addnorm.add_layer_norm(x, r, n, w, b, backend="triton"))
                results += K.plain_forward(x, r, w, b, 1e-5, False, True)
        return results

    monkeypatch.setattr(common, "_COMPILED", {})
    monkeypatch.setattr(common, "FAST_LAUNCH", False)
    expected = run()
    monkeypatch.setattr(common, "FAST_LAUNCH", True)
    for _ in range(2):
        assert all(torch.equal(a, e) for a, e in zip(run(), expected, strict=True))
    kernels = {key[0] for key in common._COMPILED}
    if TEST_DEVICE.type == "cuda":
        launched = (forward_kernels._forward_kernel, backward_kernels._backward_kernel)
        launched += (backward_kernels._sum_partials_kernel, dropped_kernels._dropped_kernel)
        assert kernels == set(launched)
    else:
        assert not kernels


def test_hooks_and_triton_settings_reach_the_direct_launch(monkeypatch):
    """A launch hook (a profiler's) sends every launch through Triton's own launcher; a setting
    that changes what Triton compiles (debug mode) changes the direct launch's key."""
    import triton

    base = common._settings(K.forward_kernels._forward_kernel)
    assert base is not None
    monkeypatch.setattr(triton.knobs.runtime, "debug", not triton.knobs.runtime.debug)
    assert common._settings(K.forward_kernels._forward_kernel) not in (None, base)
    hook = triton.knobs.runtime.launch_exit_hook
    hook.add(print)
    try:
        assert common._settings(K.forward_kernels._forward_kernel) is None
    finally:
        hook.remove(print)


def test_strided_rows_are_read_in_place():
    """Rows with a stride (a slice of wider rows) run without a copy and match contiguous rows."""
    base = rows_of(40, 130, torch.float32)
    x, r = base[::2, :100], base[1::2, 3:103]
    assert x.stride() == (260, 1) and common._rows(x) is x
    w = rows_of(1, 100, torch.float32, seed=3)[0]
    y, s = addnorm.add_layer_norm(x, r, 100, w, prenorm=True, backend="triton")
    yc, sc = addnorm.add_layer_norm(x.contiguous(), r.contiguous(), 100, w, prenorm=True, backend="triton")
    assert torch.equal(y, yc) and torch.equal(s, sc)
    torch.testing.assert_close(y, TF.layer_norm(x + r, (100,), w))


@pytest.mark.parametrize("path", ["fused", "chunked"])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_forward_writing_less_gives_the_same_bits(monkeypatch, path, rms, dtype):
    """Without the stream and the statistics (an inference call, a plain call's
    ``plain_forward``) the forward kernel writes ``y`` alone, with the bits of the forward that
    writes everything; a stream of another dtype than ``y``'s is written anyway (the kernel
    reads the stream's dtype from it), with its bits."""
    if path == "chunked":
        force_chunked(monkeypatch)
    m, n = 5, 600  # (chunked: three chunks of 256, the last cut)
    x, r = rows_of(m, n, dtype), rows_of(m, n, dtype, seed=1, offset=3e2)
    w, b = rows_of(1, n, dtype, seed=2)[0], None if rms else rows_of(1, n, dtype, seed=3)[0]
    for residual_dtype in (None, torch.float32) if dtype != torch.float32 else (None,):
        kw = dict(eps=1e-5, rms=rms, residual_dtype=residual_dtype)
        y, s, mean, rstd = K.forward(x, r, w, b, **kw)
        y_, s_, mean_, rstd_ = K.forward(x, r, w, b, **kw, write_stream=False, write_stats=False)
        assert mean_ is None and rstd_ is None and rstd.dtype == torch.float32
        assert mean is None if rms else mean.dtype == torch.float32
        assert torch.equal(y_, y)
        assert s_ is None if residual_dtype is None else torch.equal(s_, s)
    for residual, write_stream in ((r, True), (r, False), (None, False)):
        got_y, got_s = K.plain_forward(x, residual, w, b, 1e-5, rms, write_stream)
        y, s, _, _ = K.forward(x, residual, w, b, eps=1e-5, rms=rms, residual_dtype=None)
        assert torch.equal(got_y, y)
        assert torch.equal(got_s, s) if write_stream else got_s is None


@pytest.mark.parametrize("into", ["residual", "x"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stream_written_into_an_input_on_the_chunked_path(chunked, into, dtype):
    """``residual_out=`` one of the inputs (an input may be its own buffer): the chunked forward
    reads its inputs again after writing the stream, so it writes a buffer of its own and copies
    it into ``residual_out`` after: ``y`` and ``s`` as with a buffer apart (the fused path reads
    each row once, before it writes)."""
    m, n = 4, 600  # three chunks of 256
    x, r = rows_of(m, n, dtype), rows_of(m, n, dtype, seed=1, offset=5.0)
    w = rows_of(1, n, dtype, seed=2)[0]
    want = addnorm.add_layer_norm(x, r, n, w, prenorm=True, backend="triton")
    inputs = {"x": x.clone(), "residual": r.clone()}
    y, s = addnorm.add_layer_norm(
        inputs["x"], inputs["residual"], n, w, prenorm=True, backend="triton", residual_out=inputs[into]
    )
    assert s is inputs[into]
    assert torch.equal(y, want[0]) and torch.equal(s, want[1])


def test_plain_calls_take_the_triton_backends_plain_forward(monkeypatch):
    """Where "auto" runs the triton backend (CUDA tensors; here, registered for the test's
    device), a plain call without gradients goes to its ``plain_forward``, with the bits of
    ``backend="triton"``; a call with gradients takes the general route."""
    from addnorm.kernels.triton import forward_kernels

    ran = []
    original = forward_kernels.plain_forward

    def counting(*args):
        ran.append(args[0].shape)
        return original(*args)

    counting.__module__ = forward_kernels.__name__  # (a plain_forward is taken from its forward's module alone)
    monkeypatch.setattr(K, "plain_forward", counting)
    backends.register("triton_auto", K, device_types_for_auto=(TEST_DEVICE.type,))
    try:
        n = 96
        x, r = rows_of(3, n, torch.bfloat16), rows_of(3, n, torch.bfloat16, seed=1)
        w, b = rows_of(1, n, torch.bfloat16, seed=2)[0], rows_of(1, n, torch.bfloat16, seed=3)[0]
        addnorm.layer_norm(x, n)  # (the first call chooses the backend "auto" runs)
        ran.clear()
        with torch.no_grad():
            y, s = addnorm.add_layer_norm(x, r, n, w, b, prenorm=True)
            y_rms = addnorm.rms_norm(x.unsqueeze(0), n, w)
        assert ran == [(3, n), (1, 3, n)]
        y_t, s_t = addnorm.add_layer_norm(x, r, n, w, b, prenorm=True, backend="triton")
        assert torch.equal(y, y_t) and torch.equal(s, s_t)
        assert torch.equal(y_rms, addnorm.rms_norm(x.unsqueeze(0), n, w, backend="triton"))
        torch.testing.assert_close(y_rms[0].double(), TF.rms_norm(x.double(), (n,), w.double()), rtol=0, atol=2e-2)
        addnorm.add_layer_norm(x.requires_grad_(), r, n, w, b)
        assert len(ran) == 2
    finally:
        backends.unregister("triton_auto")


def test_bf16_results_are_rounded_to_nearest_even():
    """s = x + residual in bf16 equals torch's bf16 add, ties included: 1 + 2^-8 rounds down to
    the even 1.0, (1 + 2^-7) + 2^-8 rounds up to the even 1 + 2^-6."""
    x = torch.tensor([[1.0, 1.0 + 2**-7, -(1.0 + 2**-7), 3.0]], dtype=torch.bfloat16).repeat(3, 1)
    x = torch.cat([x, rows_of(5, 4, torch.bfloat16)])
    r = torch.tensor([[2**-8, 2**-8, -(2**-8), 1e-3]], dtype=torch.bfloat16).repeat(3, 1)
    r = torch.cat([r, rows_of(5, 4, torch.bfloat16, seed=1)])
    _, s = addnorm.add_rms_norm(x, r, 4, prenorm=True, backend="triton")
    assert torch.equal(s, x + r)
    assert s[0, 1].item() == 1.0 + 2**-6 and s[0, 0].item() == 1.0


def test_compiles_without_graph_break():
    """The Triton path stays inside the custom ops: fullgraph tracing holds, backward included."""
    layer = addnorm.AddNorm(64, norm="layer", backend="triton", device=TEST_DEVICE)
    x, r = rows_of(4, 64, torch.float32).requires_grad_(), rows_of(4, 64, torch.float32, seed=1)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    compiled(x, r).square().sum().backward()
    expected = TF.layer_norm(x.detach() + r, (64,), layer.norm.weight, layer.norm.bias)
    torch.testing.assert_close(compiled(x, r), expected)
    assert x.grad is not None and layer.norm.weight.grad is not None


def test_unavailable_reasons():
    assert "got a tensor on meta" in backends.unavailable_reason("triton", torch.zeros(1, 4, device="meta"))
    assert backends.unavailable_reason("triton", torch.zeros(1, 4, device=TEST_DEVICE)) is None
    assert backends.auto_name(torch.zeros(1, 4, device="cpu")) != "triton"  # never the interpreter
    if TEST_DEVICE.type == "cuda":
        assert backends.auto_name(torch.zeros(1, 4, device=TEST_DEVICE)) == "triton"


@pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="about CPU tensors without the interpreter")
def test_cpu_tensors_need_the_interpreter():
    """Imported without TRITON_INTERPRET=1, the kernels are compiled and CPU tensors are refused."""
    code = (
        "import torch, addnorm\n"
        "from addnorm import backend as backends\n"
        "print(backends.unavailable_reason('triton', torch.zeros(1, 4)))\n"
        "try:\n"
        "    addnorm.layer_norm(torch.zeros(2, 4), 4, backend='triton')\n"
        "except RuntimeError as err:\n"
        "    print(err)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    out = out.stdout
    assert out.count("CPU tensors need TRITON_INTERPRET=1") == 2, out


def test_kernels_compile_for_sm90():
    """The interpreter runs the kernels as Python and accepts code that Triton's compiler rejects
    (a loop-carried variable that changes type, say): compile them for an H100 (sm_90; no GPU
    needed). The sum of the gradients' partial rows (float32, float64, and float32 sums stored as
    bfloat16 parameters' gradients) and x1's dropout (forward and gradient) once;
    the others (a plain call's forward, writing neither the stream nor the statistics, among
    them) at a width that takes the
    fused forward and backward and, with the sublayer branch or a second norm, the chunked
    backward and its coefficient kernel; and at one that takes every chunked path (the forward's
    third variance pass included)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_registers.py"
    out = subprocess.run([sys.executable, str(script), "8192", "20000"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert sum("regs=" in line for line in lines) == 44 + 3 + 2, out.stdout  # + partials, x1's dropout
    # the chunked backward (with its coefficient kernel): the branch's and the parallel block's at
    # 8192, every one at 20000
    assert sum("bwd" in line and "coef:" in line for line in lines) == 4 + 8, out.stdout


@pytest.mark.parametrize("rms", [False, True])
def test_chunked_second_norm_matches_torch(chunked, rms):
    """Parallel blocks' second norm on the chunked path (forward, coefficient and backward
    kernels): y, y1 and every gradient against torch's ops in float64."""
    m, n = 5, 600
    x, r, dy, dy1, ds = (rows_of(m, n, torch.float32, seed=i) for i in range(5))
    w, b, w1, b1 = (rows_of(1, n, torch.float32, seed=9 + i)[0] * 0.5 + 1 for i in range(4))
    b, b1 = (None, None) if rms else (b, b1)
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, r, w, b, w1, b1)]
    fn = addnorm.add_rms_norm if rms else addnorm.add_layer_norm
    args = (leaves[0], leaves[1], n, leaves[2]) if rms else (leaves[0], leaves[1], n, leaves[2], leaves[3])
    extra = {} if rms else {"bias1": leaves[5]}
    y, y1, s = fn(*args, weight1=leaves[4], prenorm=True, eps=1e-5, backend="triton", **extra)
    present = [t for t in leaves if t is not None]
    grads = torch.autograd.grad((y * dy).sum() + (y1 * dy1).sum() + (s * ds).sum(), present)
    wanted = [t.double().requires_grad_() if t is not None else None for t in (x, r, w, b, w1, b1)]
    s64 = wanted[0] + wanted[1]
    norm = (
        (lambda v, w_, b_: TF.rms_norm(v, (n,), w_, eps=1e-5))
        if rms
        else (lambda v, w_, b_: TF.layer_norm(v, (n,), w_, b_))
    )
    y64, y164 = norm(s64, wanted[2], wanted[3]), norm(s64, wanted[4], wanted[5])
    loss = (y64 * dy.double()).sum() + (y164 * dy1.double()).sum() + (s64 * ds.double()).sum()
    want = torch.autograd.grad(loss, [t for t in wanted if t is not None])
    for ours, oracle in zip((y, y1), (y64, y164)):
        assert_matches_oracle(ours.detach(), oracle.detach())
    for ours, oracle in zip(grads, want):
        assert_matches_oracle(ours, oracle, scale=m)


def test_host_cdiv_and_next_power_of_2_are_triton_s():
    """The launchers' own host arithmetic (cheaper to call than Triton's constexpr functions)
    gives Triton's results."""
    for n in [*range(0, 4100), 65535, 65536, 65537, 2**31 + 5]:
        assert config.next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in [*range(0, 300), 2**31 + 7]:
        for b in (1, 2, 3, 7, 64, 128, 4224):
            assert config.cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_the_backward_program_count_is_the_shape_s_not_the_gpu_s(monkeypatch):
    """dweight/dbias are summed over ``programs`` partial rows (the reduction contract): the count
    comes from the shape and the launch table alone, never from the GPU's size, so any GPU sums
    the same partials in the same order."""

    def no_device_queries(*args, **kwargs):
        raise AssertionError("the launch plan asked the GPU about itself")

    for name in ("get_device_properties", "device_count", "current_device", "get_device_name"):
        monkeypatch.setattr(torch.cuda, name, no_device_queries)
    cuda = torch.device("cuda")
    for kind in ("backward", "branch_backward"):
        for n, elem in ((768, 2), (4096, 4), (8192, 2), (65536, 4)):
            launch = config.plan(kind, n, cuda, elem)
            entry = config.TABLE.chunked if launch.chunked else getattr(config.TABLE, kind)
            for m in (1, 100, 4096, 65536):
                programs = config.backward_programs(kind, m, launch.num_warps, cuda, launch.chunked)
                assert programs == min(m, max(1, entry.warps_in_flight // launch.num_warps))


@pytest.mark.parametrize("third_pass", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_forward_adds_x1_with_the_separate_pass_bits(monkeypatch, chunked, dtype, p, third_pass):
    """Parallel blocks' ``x1`` (and its dropout) added in the chunked forward, whose passes read
    the stream again (x1 added again, the same bits): every output the separate pass's, and the
    stream's values ``residual + dropout1(x1) + x`` in float64 within the dtype's rounding.
    ``third_pass``: the variance's third pass (for rows whose mean cancels) made to run on every
    row, through the interpreter (a compiled kernel keeps the threshold it was built with)."""
    import dataclasses

    import triton.language as tl

    from addnorm.kernels.triton import forward_kernels

    if third_pass and TEST_DEVICE.type == "cpu":
        monkeypatch.setattr(forward_kernels, "_CANCEL", tl.constexpr(1e30))
    m, n = 5, 600  # three chunks of 256, the last cut
    x, r, x1 = (rows_of(m, n, dtype, seed=i, offset=3e4 if i == 1 else 0.0) for i in range(3))
    w, b, w1 = (rows_of(1, n, dtype, seed=5 + i)[0] for i in range(3))
    calls, real_forward = [], K.forward
    monkeypatch.setattr(K, "forward", lambda *a, **k: calls.append("x1" in k) or real_forward(*a, **k))

    def run():
        with torch.no_grad():
            return addnorm.add_layer_norm(
                x, r, n, w, b, x1=x1, weight1=w1, prenorm=True, dropout_p=p, return_dropout_mask=p > 0,
                generator=torch.Generator().manual_seed(2), backend="triton",
            )  # fmt: skip

    fused = run()
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(K, "CAPABILITIES", dataclasses.replace(K.CAPABILITIES, adds_x1=False))
        separate = run()
    assert calls == [True, False]  # x1 in the norm's forward, then in a pass of its own
    assert all(torch.equal(a, c) for a, c in zip(fused, separate, strict=True))
    keep1 = fused[-1] if p > 0 else torch.ones_like(x1, dtype=torch.bool)
    s64 = r.double() + x1.double() * keep1 / (1 - p) + x.double() * (fused[3] if p > 0 else 1) / (1 - p)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(fused[2].double(), s64, rtol=rtol, atol=atol)


def test_kept_constants_are_made_on_their_own_thread_and_shared_across_lengths(monkeypatch):
    """A constant the kernels read (ones for a missing layer scale or rowscale, eps, the dropout
    scale) is made once, on a thread of its own (never in a CUDA graph's memory pool, which a CUDA
    graph tree routes the warming thread's allocations into), and shared by every length up to
    its power of two."""
    monkeypatch.setattr(common, "_CONSTANTS", {})
    made_on = []
    make = common._make_constant

    def recording(*args):
        made_on.append(threading.get_ident())
        return make(*args)

    monkeypatch.setattr(common, "_make_constant", recording)
    device = torch.device(TEST_DEVICE)
    five, seven, three = (common._constant(n, torch.float32, device, 1.0) for n in (5, 7, 3))
    assert [t.shape[0] for t in (five, seven, three)] == [5, 7, 3]
    assert torch.equal(seven, torch.ones(7, device=device))
    assert five.data_ptr() == seven.data_ptr() and five.data_ptr() != three.data_ptr()  # 8 and 4 kept
    assert len(made_on) == 2 and threading.get_ident() not in made_on
    eps = common._constant(1, torch.float64, device, 1e-5)
    assert eps.dtype == torch.float64 and eps.item() == 1e-5 and len(made_on) == 3


def test_a_constant_missing_while_a_graph_is_captured_is_made_for_that_launch_alone(monkeypatch):
    """While a CUDA graph is captured, a constant not kept yet is made on the capturing stream
    (the graph replays its fill) and not kept: a kept one would live in the graph's memory."""
    monkeypatch.setattr(common, "_CONSTANTS", {})
    monkeypatch.setattr(common, "_capturing", lambda device: True)
    device = torch.device(TEST_DEVICE)
    got = common._constant(3, torch.float32, device, 0.5)
    assert torch.equal(got, torch.full((3,), 0.5, device=device)) and not common._CONSTANTS
    monkeypatch.setattr(common, "_capturing", lambda device: False)
    kept = common._constant(3, torch.float32, device, 0.5)
    assert kept.data_ptr() != got.data_ptr() and len(common._CONSTANTS) == 1
    assert common._constant(4, torch.float32, device, 0.5).data_ptr() == kept.data_ptr()


def test_at_most_64_constants_are_kept(monkeypatch):
    monkeypatch.setattr(common, "_CONSTANTS", {})
    first = common._constant(1, torch.float32, torch.device(TEST_DEVICE), 0.0)
    for i in range(1, 70):
        common._constant(1, torch.float32, torch.device(TEST_DEVICE), float(i))
    assert len(common._CONSTANTS) == 64 and all(t.data_ptr() != first.data_ptr() for t in common._CONSTANTS.values())


def test_an_error_making_a_constant_is_raised_on_the_caller_s_thread(monkeypatch):
    monkeypatch.setattr(common, "_CONSTANTS", {})

    def failing(*args):
        raise RuntimeError("no memory for a constant")

    monkeypatch.setattr(common, "_make_constant", failing)
    with pytest.raises(RuntimeError, match="no memory for a constant"):
        common._constant(2, torch.float32, torch.device(TEST_DEVICE), 1.0)
    assert not common._CONSTANTS
