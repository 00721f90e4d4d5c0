"""A stream that starts in the call (``residual=None``) and parallel blocks (``x1``, ``weight1``,
``bias1``), on every backend and through ``"auto"``.

Oracles: torch's own ops in float64 with the masks the call returns (the reference's keep mask,
the same bits on every backend), ``gradcheck`` and ``gradgradcheck`` in float64."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as TF

import addnorm
from conftest import TOLERANCES, assert_matches_oracle, interpreted

F = torch.nn.functional


def _norm(kind, s, w, b):
    if kind == "rms":  # eps=None: the machine epsilon of the statistics dtype, float32's below float64
        eps = torch.finfo(torch.float64 if s.dtype == torch.float64 else torch.float32).eps
        return F.rms_norm(s, s.shape[-1:], w, eps=eps) if w is not None else None
    return F.layer_norm(s, s.shape[-1:], w, b)


def _call(kind, x, r, w, b, **kw):
    if kind == "rms":
        kw.pop("bias1", None)
        return addnorm.add_rms_norm(x, r, x.shape[-1], w, **kw)
    return addnorm.add_layer_norm(x, r, x.shape[-1], w, b, **kw)


def _tensors(m, n, dtype, seed=0, count=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(m, n, generator=g).to(dtype) for _ in range(3)] + [
        (torch.randn(n, generator=g) * 0.5 + 1).to(dtype) for _ in range(count - 3)
    ]


# --------------------------------------------------------------------------- residual=None


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_without_a_residual_the_stream_is_x_itself(backend, kind):
    x, _, _, w, b, *_ = _tensors(5, 64, torch.float32)
    y, s = _call(kind, x, None, w, b, prenorm=True, backend=backend)
    assert s is x  # nothing to add, nothing to copy
    expected = _call(kind, x, torch.zeros_like(x), w, b, backend=backend)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_without_a_residual_the_stream_takes_residual_dtype(backend):
    x, _, _, w, b, *_ = _tensors(5, 64, torch.bfloat16)
    y, s = addnorm.add_layer_norm(x, None, 64, w, b, prenorm=True, residual_dtype=torch.float32, backend=backend)
    assert s.dtype == torch.float32 and torch.equal(s, x.float())
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, addnorm.layer_norm(x, 64, w, b, backend=backend))


@pytest.mark.parametrize("weight1", [False, True], ids=["x1", "x1-weight1"])
def test_without_a_residual_x1_starts_the_stream_in_residual_dtype(backend, weight1):
    """``s = x1 + x`` in ``residual_dtype`` (flash-attn's ``residual_in_fp32`` with ``x1`` and no
    residual): each summand widened, their sum rounded once to float32, never to x's bfloat16."""
    x, _, x1, w, b, *_ = _tensors(5, 64, torch.bfloat16)
    extra = {"weight1": w.flip(0), "bias1": b} if weight1 else {}
    out = addnorm.add_layer_norm(
        x, None, 64, w, b, prenorm=True, residual_dtype=torch.float32, x1=x1, backend=backend, **extra
    )
    s = out[-1]
    assert s.dtype == torch.float32 and torch.equal(s, x1.float() + x.float())
    assert torch.equal(out[0], addnorm.layer_norm(s, 64, w, b, backend=backend).to(torch.bfloat16))
    if weight1:
        assert torch.equal(out[1], addnorm.layer_norm(s, 64, w.flip(0), b, backend=backend).to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_without_a_residual_the_branch_applies_to_x(backend, kind):
    x = torch.rand(33, 128) + 0.5  # no zeros: a zero in s is a dropped element
    ls, rs = torch.rand(128) + 0.5, torch.rand(33) + 0.5
    kw = dict(prenorm=True, dropout_p=0.3, layer_scale=ls, rowscale=rs, return_dropout_mask=True)
    y, s, mask = _call(kind, x, None, None, None, generator=torch.Generator().manual_seed(4), backend=backend, **kw)
    keep = torch.where(mask, x.double() / 0.7, 0) * ls.double() * rs.double()[:, None]
    assert_matches_oracle(s, keep)
    ys, ss, masks = _call(
        kind, x, None, None, None, generator=torch.Generator().manual_seed(4), backend="reference", **kw
    )
    assert torch.equal(mask, masks) and torch.equal(s, ss)  # the same bits on every backend
    assert_matches_oracle(y, _norm(kind, keep, torch.ones(128, dtype=torch.float64), None))


def test_add_norm_module_takes_no_residual(backend):
    block = addnorm.AddNorm(32, prenorm=True, backend=backend)
    x = torch.randn(4, 32)
    y, s = block(x)
    assert s is x
    torch.testing.assert_close(y, F.layer_norm(x, (32,)), rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_without_a_residual_gradcheck(backend, kind):
    x, _, _, w, b, *_ = _tensors(3, 12, torch.float64)
    ls = torch.rand(12, dtype=torch.float64) + 0.5
    leaves = [t.clone().requires_grad_() for t in (x, w, b, ls)]

    def f(x, w, b, ls):
        g = torch.Generator().manual_seed(2)
        return _call(kind, x, None, w, b, prenorm=True, dropout_p=0.25, layer_scale=ls, generator=g, backend=backend)

    assert torch.autograd.gradcheck(f, leaves, fast_mode=interpreted(backend))


# --------------------------------------------------------------------------- parallel blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_parallel_block_matches_the_unfused_formula(backend, kind, dtype):
    x, r, x1, w, b, w1, b1 = _tensors(37, 256, dtype)
    b, b1 = (None, None) if kind == "rms" else (b, b1)
    y, y1, s = _call(kind, x, r, w, b, x1=x1, weight1=w1, bias1=b1, prenorm=True, backend=backend)
    s64 = r.double() + x1.double() + x.double()
    rounded = (r.float() + x1.float()).to(dtype).float() + x.float()  # the documented order
    assert torch.equal(s, rounded.to(dtype))
    ref = lambda w_, b_: _norm(kind, s.double(), w_.double(), None if b_ is None else b_.double())  # noqa: E731
    same_dtype = lambda w_, b_: _norm(kind, s, w_, b_)  # noqa: E731
    assert_matches_oracle(y, ref(w, b), same_dtype(w, b))
    assert_matches_oracle(y1, ref(w1, b1), same_dtype(w1, b1))
    assert_matches_oracle(s, s64, (r + x1) + x)


def test_parallel_block_with_dropout_has_two_independent_masks(backend):
    x, r, x1, w, b, w1, b1 = _tensors(40, 300, torch.float32)
    kw = dict(x1=x1, weight1=w1, bias1=b1, prenorm=True, dropout_p=0.4, return_dropout_mask=True)
    y, y1, s, mask, mask1 = addnorm.add_layer_norm(
        x, r, 300, w, b, generator=torch.Generator().manual_seed(9), backend=backend, **kw
    )
    assert mask.shape == mask1.shape == x.shape and not torch.equal(mask, mask1)
    agree = (mask == mask1).double().mean().item()  # independent at p = 0.4: 0.6² + 0.4² = 0.52
    assert abs(agree - 0.52) < 0.03
    for m in (mask, mask1):
        assert abs(m.double().mean().item() - 0.6) < 0.03
    s64 = (r.double() + torch.where(mask1, x1.double() / 0.6, 0)) + torch.where(mask, x.double() / 0.6, 0)
    assert_matches_oracle(s, s64)
    assert_matches_oracle(y1, F.layer_norm(s.double(), (300,), w1.double(), b1.double()))
    again = addnorm.add_layer_norm(
        x, r, 300, w, b, generator=torch.Generator().manual_seed(9), backend="reference", **kw
    )
    for ours, theirs in zip((y, y1), again):  # the norms may sum in another order
        torch.testing.assert_close(ours, theirs, rtol=1.3e-6, atol=1e-5)
    assert torch.equal(s, again[2])  # the stream and the masks: the same bits on every backend
    assert torch.equal(mask, again[3]) and torch.equal(mask1, again[4])


def _bits_differ(a, b) -> torch.Tensor:
    """Where ``a`` and ``b`` (of one shape and dtype) differ bit for bit, any NaN matching any NaN
    (torch itself writes a bfloat16 NaN as 0x7FC0 or 0xFFFF depending on its code path)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return (a.view(ints) != b.view(ints)) & ~(a.isnan() & b.isnan())


def _same_bits(a, b) -> bool:
    """Equal bit for bit, any NaN matching any NaN (:func:`_bits_differ`)."""
    return a.dtype == b.dtype and a.shape == b.shape and not _bits_differ(a, b).any()


def _first_difference(a, b) -> str:
    """Where ``a`` and ``b`` first differ in their bits (NaN matching NaN), and how many differ."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shapes {tuple(a.shape)} {tuple(b.shape)}, dtypes {a.dtype} {b.dtype}"
    differ = _bits_differ(a, b)
    if not differ.any():
        return "the same bits"
    at = tuple(differ.nonzero()[0].tolist())
    return f"{int(differ.sum())} differ, first at {at}: {a[at].item()!r} against {b[at].item()!r}"


def _dropped_kernels(name: str, request):
    """The kernels module whose ``dropped`` is tested, with its tensors' device in force: the cpu
    backend's on CPU tensors; the Triton backend's on the test device (its interpreter on CPU)."""
    if name == "cpu":
        request.getfixturevalue("on_cpu")
        return pytest.importorskip("addnorm.kernels.cpu", reason="numba is not installed")
    pytest.importorskip("triton")
    return importlib.import_module("addnorm.kernels.triton.dropped_kernels")


@pytest.mark.parametrize("kernels", ["cpu", "cpu, threads", "triton"])
@pytest.mark.parametrize("sd", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("p", [0.1, 0.5, 1.0])
def test_dropped_is_the_reference_stream_bit_for_bit(kernels, sd, p, request, monkeypatch):
    """``x1``'s dropout in one compiled pass: ``residual + dropout(x1)`` and its gradient
    ``dropout(ds)`` (the kernels' ``dropped``), every bit as the reference's torch ops
    (:func:`addnorm.reference.stream` of a dropout-only branch, and its ``branch_terms`` rounded
    to x1's dtype), inf and NaN included, on the cpu kernels' one thread and split over threads,
    and on the Triton kernel's tiles (one row, one column, tiles cut at both edges)."""
    impl = _dropped_kernels(kernels.split(",")[0], request)
    if kernels == "cpu, threads":
        monkeypatch.setattr(impl.config, "SETTINGS", impl.config.SETTINGS.updated(parallel_min_elements=1))
    reference = addnorm.reference
    g = torch.Generator().manual_seed(3)
    for m, n in [(1, 1), (3, 17), (65, 1000)]:
        r, x1 = (torch.randn(m, n, generator=g).to(sd) for _ in range(2))
        x1[0, 0], x1[-1, -1] = float("inf"), float("nan")
        seed = torch.tensor(0x9E3779B97F4A7C15 >> 3, dtype=torch.int64)
        branch = addnorm.backend.Branch(p, seed, None, None)
        assert _same_bits(impl.dropped(x1, r, n, p, seed, sd), reference.stream(x1, r, sd, branch))
        cd = reference.stats_dtype(sd)
        for out in {sd, torch.float32, torch.float16, torch.bfloat16}:  # dx1 in x1's dtype, maybe not sd
            expected = reference.branch_terms(x1.to(cd), branch, torch.arange(m))["t"].to(out)
            assert _same_bits(impl.dropped(x1, None, n, p, seed, out), expected)


@pytest.mark.usefixtures("on_cpu")  # the compiled pass runs on CPU tensors alone
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_backend", ["auto", "cpu"])
def test_x1_dropout_runs_compiled_on_cpu_with_the_torch_ops_bits(monkeypatch, dtype, norm_backend):
    """``x1``'s dropout on plain CPU tensors, with the cpu backend, takes one compiled pass forward
    and one backward (``cpu.dropped``), every bit as the reference's torch ops (the path of other
    backends, under torch.func, under torch.compile and on other devices): outputs, stream and
    every gradient."""
    cpu = pytest.importorskip("addnorm.kernels.cpu", reason="numba is not installed")
    import addnorm.dropped

    x, r, x1, w, b, w1, b1 = _tensors(300, 1024, dtype)
    dys = [torch.randn(300, 1024, generator=torch.Generator().manual_seed(k)).to(dtype) for k in range(3)]
    calls, compiled = [], cpu.dropped
    monkeypatch.setattr(cpu, "dropped", lambda *a: calls.append(a[1] is None) or compiled(*a))

    def run():
        leaves = [t.clone().requires_grad_() for t in (x, r, x1, w, b, w1, b1)]
        outs = addnorm.add_layer_norm(
            leaves[0], leaves[1], 1024, leaves[3], leaves[4], x1=leaves[2], weight1=leaves[5], bias1=leaves[6],
            prenorm=True, dropout_p=0.3, generator=torch.Generator().manual_seed(5), backend=norm_backend,
        )  # fmt: skip
        sum((o.float() * dy.float()).sum() for o, dy in zip(outs, dys)).backward()
        return [o.detach() for o in outs] + [t.grad for t in leaves]

    fused = run()
    assert calls == [False, True]  # x1's add forward, then dx1
    monkeypatch.setattr(addnorm.dropped, "_dropped_kernels", lambda *args: None)
    plain = run()
    assert calls == [False, True]
    for a, c in zip(fused, plain):
        assert torch.equal(a, c)


def _adds_x1_backend(name: str, request):
    """The backend module whose forward adds ``x1``, with its tensors' device in force (as
    :func:`_dropped_kernels`), and the shape its tests run at: several threads' blocks of rows on
    the cpu backend, fewer rows through Triton's interpreter."""
    if name == "cpu":
        request.getfixturevalue("on_cpu")
        return pytest.importorskip("addnorm.kernels.cpu", reason="numba is not installed"), (300, 1024)
    pytest.importorskip("triton")
    return importlib.import_module("addnorm.kernels.triton"), (37, 200) if interpreted(name) else (300, 1024)


@pytest.mark.parametrize("name", ["cpu", "triton"])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("second", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_adds_x1_in_the_norm_pass_with_the_separate_pass_bits(monkeypatch, request, name, dtype, second, p):
    """In inference on the cpu and triton backends (and "auto" where it runs either), ``x1`` (and
    its dropout) is added to each residual row as the norm reads it (``Capabilities.adds_x1``):
    one forward with ``x1`` in it, and every output the bits of the separate pass followed by the
    norm (the path a training call, or a backend without the capability, takes), pre- and
    post-norm (the stream asked for only when returned), LayerNorm and RMSNorm, with a stream
    dtype of its own (wider or narrower than x's), a layer scale, no residual."""
    impl, (m, n) = _adds_x1_backend(name, request)
    x, r, x1, w, b, w1, b1, ls = _tensors(m, n, dtype, seed=7, count=8)
    names = (name, "auto") if addnorm.backend.auto_name(x) == name else (name,)
    cases = [
        {"prenorm": prenorm, "residual": res, "residual_dtype": rd, "layer_scale": lsc, "kind": kind}
        for prenorm in (False, True)
        for kind in ("layer", "rms")
        for res, rd, lsc in (
            (r, None, None), (r, torch.float32, None), (r, torch.bfloat16, None), (None, None, None), (r, None, ls)
        )
    ]  # fmt: skip
    calls, streams, real_forward = [], [], impl.forward

    def forward(*a, **k):
        calls.append("x1" in k)
        streams.append(k["write_stream"])
        return real_forward(*a, **k)

    monkeypatch.setattr(impl, "forward", forward)

    def run(case, backend):
        kw = {"weight1": w1, "bias1": b1} if second else {}
        with torch.no_grad():
            out = _call(
                case["kind"], x, case["residual"], w, b, x1=x1, prenorm=case["prenorm"], dropout_p=p,
                residual_dtype=case["residual_dtype"], layer_scale=case["layer_scale"], return_dropout_mask=p > 0,
                generator=torch.Generator().manual_seed(11), backend=backend, **kw,
            )  # fmt: skip
        return out if isinstance(out, tuple) else (out,)

    for case in cases:
        fused = [run(case, backend) for backend in names]
        assert calls == [True] * len(names), case  # one forward each, x1 in it
        assert streams == [case["prenorm"]] * len(names), case  # the stream written only when returned
        calls.clear()
        streams.clear()
        with monkeypatch.context() as patched:
            patched.setattr(impl, "CAPABILITIES", dataclasses.replace(impl.CAPABILITIES, adds_x1=False))
            separate = run(case, name)
        assert calls == [False], case  # x1's own pass, then the norm
        calls.clear()
        streams.clear()
        for outputs in fused:
            assert len(outputs) == len(separate)
            for ours, theirs in zip(outputs, separate):
                assert _same_bits(ours, theirs), case
    (y, *_), (oracle, *_) = run(cases[0], name), _oracle_post_norm(x, r, x1, w, b, p, dtype)
    assert_matches_oracle(y, oracle, _oracle_post_norm(x, r, x1, w, b, p, dtype, in_dtype=True))


@pytest.mark.usefixtures("on_cpu")  # the cpu backend runs on CPU tensors alone
def test_cpu_x1_dropout_takes_no_pass_of_its_own_in_inference(monkeypatch):
    """With the capability, the cpu backend's separate dropout pass (``cpu.dropped``) is not run
    in inference; without it, it is."""
    p = 0.3
    cpu = pytest.importorskip("addnorm.kernels.cpu", reason="numba is not installed")
    x, r, x1, w, b = _tensors(300, 1024, torch.float32, seed=7, count=5)
    calls, real_dropped = [], cpu.dropped
    monkeypatch.setattr(cpu, "dropped", lambda *a: calls.append("dropped") or real_dropped(*a))
    for adds in (True, False):
        monkeypatch.setattr(cpu, "CAPABILITIES", dataclasses.replace(cpu.CAPABILITIES, adds_x1=adds))
        with torch.no_grad():
            addnorm.add_layer_norm(x, r, 1024, w, b, x1=x1, dropout_p=p, generator=torch.Generator().manual_seed(1))
        assert calls == ([] if adds else ["dropped"])
        calls.clear()


@pytest.mark.parametrize("name", ["cpu", "triton"])
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_adds_x1_in_the_norm_pass_where_the_backward_needs_no_sum(monkeypatch, request, name, dtype, kind):
    """In training, ``x1`` is added in the norm's pass only for a pre-norm parallel block with both
    norms and no branch (the stream is saved; ``dx1`` is ``ds``): outputs and every gradient the
    bits of the separate pass, on the cpu and triton backends. With dropout, a layer scale,
    post-norm or no second norm, the separate pass stays (the backward takes the summed
    residual)."""
    impl, (m, n) = _adds_x1_backend(name, request)
    x, r, x1, w, b, w1, b1, ls = _tensors(m, n, dtype, seed=9, count=8)
    dys = [torch.randn(m, n, generator=torch.Generator().manual_seed(k)).to(dtype) for k in range(3)]
    calls, real_forward = [], impl.forward
    monkeypatch.setattr(impl, "forward", lambda *a, **k: calls.append("x1" in k) or real_forward(*a, **k))

    def run(residual=r, prenorm=True, second=True, **kw):
        leaves = [t.clone().requires_grad_() for t in (x, residual if residual is not None else r, x1, w, b, w1, b1)]
        extra = {"weight1": leaves[5], "bias1": leaves[6]} if second else {}
        outs = _call(
            kind, leaves[0], None if residual is None else leaves[1], leaves[3], leaves[4], x1=leaves[2],
            prenorm=prenorm, generator=torch.Generator().manual_seed(3), backend=name, **extra, **kw,
        )  # fmt: skip
        outs = outs if isinstance(outs, tuple) else (outs,)
        sum((o.float() * dy.float()).sum() for o, dy in zip(outs, dys)).backward()
        return [o.detach() for o in outs] + [t.grad for t in leaves if t.grad is not None]

    for case in ({}, {"residual_dtype": torch.float32}, {"residual": None}):
        fused = run(**case)
        assert calls == [True], case
        calls.clear()
        with monkeypatch.context() as patched:
            patched.setattr(impl, "CAPABILITIES", dataclasses.replace(impl.CAPABILITIES, adds_x1=False))
            separate = run(**case)
        calls.clear()
        # y, y1, s; dx, dx1, dweight, dweight1, and dresidual, dbias and dbias1 where there are
        has_residual = case.get("residual", r) is not None
        assert len(fused) == len(separate) == 7 + has_residual + 2 * (kind == "layer")
        for ours, theirs in zip(fused, separate):
            assert _same_bits(ours, theirs), case
    for case in ({"dropout_p": 0.2}, {"layer_scale": ls}, {"prenorm": False}, {"second": False}):
        run(**case)
        assert True not in calls, case
        calls.clear()


@pytest.mark.parametrize("name", ["cpu", "triton"])
@pytest.mark.parametrize(
    "x1_dtype,sd",
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float64, torch.float16),
        (torch.float16, torch.float32),
        (torch.float64, torch.float32),
    ],
)
def test_x1_of_another_dtype_is_rounded_to_the_stream_dtype_as_it_is_read(request, name, x1_dtype, sd):
    """A backend's forward reads ``x1`` in its own dtype and rounds it to the stream dtype first:
    the bits of ``x1.to(sd)`` added by the reference's stream (dropout included), then the norm,
    inf, NaN and a tie of the stream dtype included (where x1's dtype holds it), in the first, a
    middle and the last row; no conversion pass of its own. Compiled for a GPU, an ``x1`` narrower
    than the stream has the tile laid out for its wider vectors, so ``y``'s row sums are added in
    another order (docs/gpu.md, "x1 narrower than the stream"): ``s`` is still the same bits,
    ``y`` the separate pass's to its rounding."""
    impl, (m, n) = _adds_x1_backend(name, request)  # the cpu backend: several threads' blocks
    narrower = x1_dtype.itemsize < sd.itemsize and name == "triton" and not interpreted(name)
    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(m, n, generator=g).to(sd) for _ in range(2))
    x1 = (torch.randn(m, n, generator=g, dtype=torch.float64) * 3).to(x1_dtype)
    tie = 1 + torch.finfo(sd).eps / 2  # halfway between 1 and the stream dtype's next value
    x1[0, 0], x1[m // 2, 1], x1[m - 1, n - 1] = float("inf"), float("nan"), tie
    w = torch.randn(n, generator=g).to(sd)
    seed = torch.tensor(12345, dtype=torch.int64)
    for p in (0.0, 0.3):
        x1_arg = addnorm.backend.X1(x1, p, seed if p else None)
        fused = impl.forward(x, r, w, None, eps=1e-5, rms=False, residual_dtype=sd, x1=x1_arg)
        branch = addnorm.backend.Branch(p, seed, None, None) if p else None
        summed = addnorm.reference.stream(x1.to(sd), r, sd, branch)
        separate = impl.forward(x, summed, w, None, eps=1e-5, rms=False, residual_dtype=sd)
        for name, a, c in zip("ys", fused[:2], separate[:2]):
            if name == "y" and narrower:
                torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6, equal_nan=True, msg=lambda m, p=p: f"{p}: {m}")
            else:
                assert _same_bits(a, c), (p, name, _first_difference(a, c))


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_a_nan_of_x1_stays_a_nan_when_rounded_to_a_bf16_stream(request, name):
    """An fp32 ``x1`` NaN whose payload sits in the low 16 bits alone (the bits of a signalling
    NaN) is still a NaN once rounded to a bf16 stream, not an infinity; so is a quiet one."""
    impl, (m, n) = _adds_x1_backend(name, request)
    x, r = torch.zeros(m, n, dtype=torch.bfloat16), torch.zeros(m, n, dtype=torch.bfloat16)
    x1 = torch.zeros(m, n, dtype=torch.float32)
    x1.view(torch.int32)[0, :2] = torch.tensor([0x7F800001, -0x007FFFFF], dtype=torch.int32)
    x1[1, 0] = float("nan")
    s = impl.forward(x, r, None, None, eps=1e-5, rms=True, residual_dtype=None, x1=addnorm.backend.X1(x1, 0.0, None))[1]
    assert s[0, :2].isnan().all() and s[1, 0].isnan(), s[:2, :2]


def _oracle_post_norm(x, r, x1, w, b, p, dtype, in_dtype=False):
    """``layer_norm(r + dropout1(x1) + dropout(x))`` by torch's ops (float64, or in ``dtype`` when
    ``in_dtype``) with the call's keep masks: their seeds drawn from a generator seeded 11,
    ``x1``'s first."""
    n, g = x.shape[-1], torch.Generator().manual_seed(11)
    keep1 = keep = torch.ones_like(x1, dtype=torch.bool)
    if p > 0:
        seed1, seed = (torch.randint(0, 2**62, (), dtype=torch.int64, generator=g) for _ in range(2))
        keep1, keep = (addnorm.reference.keep_mask(k, torch.arange(x.shape[0]), n, p) for k in (seed1, seed))
    t = (lambda u: u.to(dtype)) if in_dtype else (lambda u: u.double())
    s = t(r) + t(x1) * keep1 / (1 - p) + t(x) * keep / (1 - p)
    return F.layer_norm(s, (n,), t(w), t(b))


@pytest.mark.parametrize("compiled", [True, False])
def test_x1_dropout_has_second_derivatives(backend, monkeypatch, compiled):
    """Under ``create_graph`` the gradient of ``x1`` is itself differentiable (its dropout is
    linear: the Hessian-vector product through it is the mask times the stream's), whether or
    not the first backward would take a compiled pass."""
    import addnorm.dropped

    if not compiled:
        monkeypatch.setattr(addnorm.dropped, "_dropped_kernels", lambda *args: None)
    x, r, x1, w = _tensors(6, 64, torch.float64, count=4)
    x1 = x1.clone().requires_grad_()
    g = torch.Generator().manual_seed(2)
    y, s, _, mask1 = addnorm.add_layer_norm(
        x, r, 64, w, None, x1=x1, prenorm=True, dropout_p=0.3, generator=g, return_dropout_mask=True,
        backend=backend,
    )  # fmt: skip
    (gx1,) = torch.autograd.grad((s**2).sum(), x1, create_graph=True)
    assert gx1.requires_grad
    (hv,) = torch.autograd.grad(gx1.sum(), x1)
    # d/dx1 of sum(2 s * keep / 0.7) = 2 (keep / 0.7)**2, with s = r + x1 * keep / 0.7 + x * keep0 / 0.7
    torch.testing.assert_close(hv, 2 * (mask1.double() / 0.7) ** 2)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_parallel_block_gradcheck_and_gradgradcheck(backend, kind):
    x, r, x1, w, b, w1, b1 = (t.clone().requires_grad_() for t in _tensors(3, 10, torch.float64))

    def f(x, r, x1, w, b, w1, b1):
        g = torch.Generator().manual_seed(5)
        return _call(
            kind, x, r, w, b, x1=x1, weight1=w1, bias1=b1, prenorm=True, dropout_p=0.3, generator=g, backend=backend
        )

    inputs = (x, r, x1, w, b, w1, b1)
    assert torch.autograd.gradcheck(f, inputs, fast_mode=interpreted(backend))
    if not interpreted(backend):  # a second derivative differentiates the torch formulas on every
        # backend (kernels/torch.differentiable_backward): the interpreter would only repeat it slowly
        assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_parallel_block_forward_mode_ad_matches_the_formula(backend, kind, p):
    """``torch.func.jvp`` and ``torch.autograd.forward_ad`` through a call with ``x1`` (and its
    dropout), against the jvp of the unfused formula in float64 with the call's own masks."""
    x, r, x1, w, b, w1, b1 = _tensors(3, 10, torch.float64)
    g = torch.Generator().manual_seed(11)
    tangents = tuple(torch.randn(t.shape, generator=g, dtype=t.dtype) for t in (x, r, x1))
    kw = dict(x1=None, weight1=w1, bias1=b1, prenorm=True, dropout_p=p, backend=backend)

    def f(x, r, x1):
        return _call(kind, x, r, w, b, **{**kw, "x1": x1}, generator=torch.Generator().manual_seed(5))

    *_, mask, mask1 = _call(kind, x, r, w, b, **{**kw, "x1": x1}, return_dropout_mask=True,
                            generator=torch.Generator().manual_seed(5))  # fmt: skip

    def formula(x, r, x1):
        s = r + x1 * mask1 / (1 - p) + x * mask / (1 - p)
        return _norm(kind, s, w, b), _norm(kind, s, w1, b1), s

    ours = torch.func.jvp(f, (x, r, x1), tangents)
    theirs = torch.func.jvp(formula, (x, r, x1), tangents)
    for got, want in zip(ours, theirs, strict=True):
        for a, e in zip(got, want, strict=True):
            torch.testing.assert_close(a, e)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        duals = [fwAD.make_dual(t, d) for t, d in zip((x, r, x1), tangents)]
        for a, e in zip(f(*duals), theirs[1], strict=True):
            torch.testing.assert_close(fwAD.unpack_dual(a).tangent, e)


def test_return_order_follows_flash_attn(backend):
    x, r, x1, w, b, w1, b1 = _tensors(4, 16, torch.float32)
    assert isinstance(addnorm.add_layer_norm(x, r, 16, w, b, x1=x1, backend=backend), torch.Tensor)
    assert len(addnorm.add_layer_norm(x, r, 16, w, b, weight1=w1, backend=backend)) == 2  # y, y1
    out = addnorm.add_layer_norm(x, r, 16, w, b, x1=x1, prenorm=True, return_dropout_mask=True, backend=backend)
    assert len(out) == 4 and out[2].dtype == out[3].dtype == torch.bool  # y, s, mask, mask1
    out = addnorm.add_rms_norm(x, None, 16, w, weight1=w1, prenorm=True, return_dropout_mask=True, backend=backend)
    assert len(out) == 4 and out[3].dtype == torch.bool and bool(out[3].all())  # y, y1, s, mask


def test_parallel_block_under_compile_and_torch_func():
    x, r, x1, w, *_ = _tensors(3, 8, torch.float64)
    f = torch.compile(
        lambda x, r, x1: addnorm.add_layer_norm(x, r, 8, w, x1=x1, weight1=w, prenorm=True), fullgraph=True
    )
    expected = addnorm.add_layer_norm(x, r, 8, w, x1=x1, weight1=w, prenorm=True)
    for got, want in zip(f(x, r, x1), expected):
        torch.testing.assert_close(got, want, **dict(zip(("rtol", "atol"), TOLERANCES[torch.float64])))
    g = lambda x, x1: addnorm.add_rms_norm(x, r[0], 8, w, x1=x1).sum()  # noqa: E731
    grads = torch.func.vmap(torch.func.grad(g, argnums=1))(x, x1)
    x1g = x1.clone().requires_grad_()
    torch.autograd.backward([addnorm.add_rms_norm(x, r[0].expand_as(x), 8, w, x1=x1g).sum()])
    torch.testing.assert_close(grads, x1g.grad)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_parallel_block_training_compiles_fullgraph(p):
    """A training step with x1 (and x1's dropout) under ``torch.compile(fullgraph=True)``: the
    outputs and every gradient of the unfused formula in torch ops with the returned keep masks."""
    x, r, x1, w, b, *_ = _tensors(6, 32, torch.float32)

    def call(x, r, x1, w, b):
        kw = dict(x1=x1, weight1=w * 2, bias1=b, dropout_p=p, prenorm=True, return_dropout_mask=True)
        return addnorm.add_layer_norm(x, r, 32, w, b, **kw)

    leaves = [t.clone().requires_grad_() for t in (x, r, x1, w, b)]
    y, y1, s, mask, mask1 = torch.compile(call, fullgraph=True)(*leaves)
    twins = [t.clone().requires_grad_() for t in (x, r, x1, w, b)]
    tx, tr, tx1, tw, tb = twins
    scale = 1 / (1 - p)
    ts = (tr + tx1 * mask1 * scale) + tx * mask * scale
    expected = (TF.layer_norm(ts, (32,), tw, tb), TF.layer_norm(ts, (32,), tw * 2, tb), ts)
    dy = [torch.randn(6, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    got = (y, y1, s, *torch.autograd.grad((y, y1, s), leaves, dy))
    want = (*expected, *torch.autograd.grad(expected, twins, dy))
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_the_same_seed_reproduces_a_parallel_block():
    x, r, x1, w, *_ = _tensors(6, 32, torch.float32)
    torch.manual_seed(11)
    a = addnorm.add_rms_norm(x, r, 32, w, x1=x1, dropout_p=0.5, return_dropout_mask=True)
    torch.manual_seed(11)
    b = addnorm.add_rms_norm(x, r, 32, w, x1=x1, dropout_p=0.5, return_dropout_mask=True)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_the_guide_s_python_examples_run():
    """docs/guide.md, section 7: each Python block runs as written, its asserts included."""
    text = (Path(__file__).parent.parent / "docs" / "guide.md").read_text()
    namespace: dict = {}
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert len(blocks) >= 3
    for block in blocks:
        exec(compile(block, "docs/guide.md", "exec"), namespace)


# --------------------------------------------------------------------------- one call on the cpu backend


def _torch_step(kind, x, r, ls, w, b, w1, b1, dy, dy1, ds, prenorm, dtype=torch.float64):
    """Outputs and gradients of a parallel block from torch's ops in ``dtype`` (the same upstream
    gradients): ``s = r + ls * x``, ``y``/``y1`` its two norms."""
    leaves = [t.to(dtype).requires_grad_() if t is not None else None for t in (x, r, ls, w, b, w1, b1)]
    x_, r_, ls_, w_, b_, w1_, b1_ = leaves
    s = r_ + ls_ * x_
    y, y1 = _norm(kind, s, w_, b_), _norm(kind, s, w1_, b1_)
    loss = (y * dy.to(dtype)).sum() + (y1 * dy1.to(dtype)).sum() + ((s * ds.to(dtype)).sum() if prenorm else 0)
    grads = torch.autograd.grad(loss, [t for t in leaves if t is not None])
    return [t.detach() for t in (y, y1, s)], grads


def _fused_step(kind, x, r, ls, w, b, w1, b1, dy, dy1, ds, prenorm, backend="cpu"):
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, r, ls, w, b, w1, b1)]
    x_, r_, ls_, w_, b_, w1_, b1_ = leaves
    out = _call(kind, x_, r_, w_, b_, weight1=w1_, bias1=b1_, layer_scale=ls_, prenorm=prenorm, backend=backend)
    loss = (out[0].float() * dy.float()).sum() + (out[1].float() * dy1.float()).sum()
    if prenorm:
        loss = loss + (out[2].float() * ds.float()).sum()
    return out, torch.autograd.grad(loss, [t for t in leaves if t is not None])


def _counting_second_norm(monkeypatch):
    """How many cpu forward and backward calls ran a second norm, from now on."""
    from addnorm.kernels import cpu

    calls = []
    for name in ("forward", "backward"):
        real = getattr(cpu, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, kwargs.get("second") is not None))
            return _real(*args, **kwargs)

        monkeypatch.setattr(cpu, name, counted)
    return calls


@pytest.mark.usefixtures("on_cpu")  # the cpu backend runs on CPU tensors alone
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(37, 256), (300, 1024)])  # one block; blocks and threads
@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_runs_both_norms_in_one_call_with_the_two_calls_forward_bits(
    monkeypatch, dtype, kind, prenorm, shape, threads
):
    """On the cpu backend (and "auto") a parallel block is one forward and one backward call: the
    stream is normalized once and ``y1`` written by the loop that writes ``y``, the same bits as
    two calls; the backward sums ``dy * weight + dy1 * weight1`` in one pass, its gradients
    checked against torch's ops in float64 (bf16: at most twice torch's own bf16 error)."""
    from addnorm.kernels import cpu

    m, n = shape
    x, r, dy, w, b, w1, b1, ls = _tensors(m, n, dtype, seed=3, count=8)
    g = torch.Generator().manual_seed(4)
    dy1, ds = (torch.randn(m, n, generator=g).to(dtype) for _ in range(2))
    b, b1 = (None, None) if kind == "rms" else (b, b1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        calls = _counting_second_norm(monkeypatch)
        for backend in ("cpu", "auto"):
            fused, grads = _fused_step(kind, x, r, ls, w, b, w1, b1, dy, dy1, ds, prenorm, backend)
        assert calls == [("forward", True), ("backward", True)] * 2
        two_norms = dataclasses.replace(cpu.CAPABILITIES, second_norm=False, adds_x1=False)
        monkeypatch.setattr(cpu, "CAPABILITIES", two_norms)
        with torch.no_grad():
            two_calls = _call(kind, x, r, w, b, weight1=w1, bias1=b1, layer_scale=ls, prenorm=True, backend="cpu")
    finally:
        torch.set_num_threads(before)
    for i, (ours, theirs) in enumerate(zip(fused, two_calls)):
        # (bf16 y1 is checked below alone: through the branch (the layer scale) the second call
        # sums its 16-bit rows as it widens them, the one call as it sums the stream's row)
        if i != 1 or dtype == torch.float32:
            assert torch.equal(ours, theirs)
    step = (kind, x, r, ls, w, b, w1, b1, dy, dy1, ds, prenorm)
    (outputs, want), (torch_outputs, torch_grads) = _torch_step(*step), _torch_step(*step, dtype=dtype)
    for ours, oracle, same_dtype in zip(fused, outputs, torch_outputs):
        assert_matches_oracle(ours, oracle, same_dtype)
    for ours, oracle, same_dtype in zip(grads, want, torch_grads):
        assert_matches_oracle(ours, oracle, same_dtype, scale=m)


@pytest.mark.usefixtures("on_cpu")  # the cpu backend runs on CPU tensors alone
@pytest.mark.parametrize("shape", [(300, 1024), (40, 2048), (17, 4096)])  # rows one and two at a time
def test_second_norm_gradients_are_the_same_bits_on_any_thread_count_and_store(monkeypatch, shape):
    """``dweight1``/``dbias1`` follow the reduction contract as ``dweight``/``dbias`` do (partial
    rows per block fixed by the shape, summed in a fixed tree): the same bits on 1 to 4 threads;
    and every output and gradient is the same with outputs streamed (non-temporal stores) or not."""
    from addnorm.kernels import cpu

    m, n = shape
    x, r, dy, w, b, w1, b1, ls = _tensors(m, n, torch.float32, seed=6, count=8)
    dy1, ds = (t.flip(0) for t in (dy, r))
    before = torch.get_num_threads()
    results = []
    try:
        for threads, streaming_min_bytes in [(1, 1 << 62), (2, 1 << 62), (3, 0), (4, 0), (2, 0)]:
            torch.set_num_threads(threads)
            monkeypatch.setattr(
                cpu.config, "SETTINGS", cpu.config.SETTINGS.updated(streaming_min_bytes=streaming_min_bytes)
            )
            for prenorm in (False, True):
                out, grads = _fused_step("layer", x, r, ls, w, b, w1, b1, dy, dy1, ds, prenorm)
                results.append((prenorm, [*out, *grads]))
    finally:
        torch.set_num_threads(before)
    for prenorm in (False, True):
        first, *others = [tensors for p, tensors in results if p is prenorm]
        for tensors in others:
            assert all(torch.equal(a, b) for a, b in zip(first, tensors))


@pytest.mark.parametrize("used", ["y", "y1", "s"])
def test_one_call_takes_gradients_of_whichever_outputs_are_used(backend, used):
    """Outputs left out of the loss have no gradient (None reaches the backward): the rest is
    torch's in float64, through the one call (cpu, "auto") as through two calls."""
    x, r, dy, w, b, w1, b1 = _tensors(9, 64, torch.float64, seed=8)
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b, w1, b1)]
    y, y1, s = addnorm.add_layer_norm(
        leaves[0], leaves[1], 64, *leaves[2:4], weight1=leaves[4], bias1=leaves[5], prenorm=True, backend=backend
    )
    out = {"y": y, "y1": y1, "s": s}[used]
    grads = torch.autograd.grad((out * dy).sum(), leaves, allow_unused=True)
    x_, r_, w_, b_, w1_, b1_ = (t.clone().requires_grad_() for t in (x, r, w, b, w1, b1))
    s_ = r_ + x_
    want = {"y": F.layer_norm(s_, (64,), w_, b_), "y1": F.layer_norm(s_, (64,), w1_, b1_), "s": s_}[used]
    expected = torch.autograd.grad((want * dy).sum(), (x_, r_, w_, b_, w1_, b1_), allow_unused=True)
    for ours, theirs in zip(grads, expected):
        if theirs is None:  # a parameter the used output does not depend on
            assert ours is None or not ours.any()
        else:
            torch.testing.assert_close(ours, theirs)
