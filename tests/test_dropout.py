"""The sublayer branch fused into Add & Norm: s = residual + rowscale * layer_scale * dropout(x),
and the zero-centred weight (1 + weight), on every backend.

Oracles: torch autograd on the unfused formula with the mask the call returns (float64), the
reference's keep mask (the same bits on every backend), and binomial statistics for the mask."""

from __future__ import annotations

import math
import pickle
import warnings

import pytest
import torch

import addnorm
from addnorm import ops, reference
from conftest import TEST_DEVICE, TOLERANCES, interpreted

F = torch.nn.functional


def fused(norm: str):
    return addnorm.add_layer_norm if norm == "layer" else addnorm.add_rms_norm


def call(norm, x, r, w, b, **kw):
    args = (x, r, x.shape[-1], w) if norm == "rms" else (x, r, x.shape[-1], w, b)
    return fused(norm)(*args, **kw)


def unfused(norm, x, r, w, b, mask, p, layer_scale=None, rowscale=None, zero_centered=False):
    """What a user writes today, with the fused call's mask: torch's own ops, autograd backward."""
    t = torch.where(mask, x / (1 - p), 0) if p < 1 else torch.zeros_like(x)
    if layer_scale is not None:
        t = t * layer_scale
    if rowscale is not None:
        t = t * rowscale[..., None]
    s = r + t
    w = 1 + w if zero_centered else w
    n = (x.shape[-1],)
    return (F.layer_norm(s, n, w, b) if norm == "layer" else F.rms_norm(s, n, w)), s


def inputs(shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype).to(TEST_DEVICE)  # noqa: E731
    return mk(*shape), mk(*shape), mk(n), mk(n), mk(n), torch.rand(shape[:-1], generator=g, dtype=dtype).to(TEST_DEVICE)


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("extras", ["dropout", "all"])
def test_forward_and_gradients_match_torch_with_the_returned_mask(backend, norm, prenorm, extras):
    x, r, w, b, ls, rs = (t.requires_grad_() for t in inputs((5, 3, 70)))
    rs = rs.detach()
    kw = dict(layer_scale=ls, rowscale=rs, zero_centered_weight=True) if extras == "all" else {}
    out = call(norm, x, r, w, b, prenorm=prenorm, dropout_p=0.3, return_dropout_mask=True, backend=backend, **kw)
    mask = out[-1]
    assert mask.dtype == torch.bool and mask.shape == x.shape
    y_ref, s_ref = unfused(
        norm, x, r, w, b, mask, 0.3, kw.get("layer_scale"), kw.get("rowscale"), kw.get("zero_centered_weight", False)
    )
    torch.testing.assert_close(out[0], y_ref, rtol=1e-9, atol=1e-9)
    g = torch.Generator().manual_seed(1)
    dy, dst = (torch.randn(x.shape, generator=g, dtype=x.dtype).to(TEST_DEVICE) for _ in range(2))
    loss = (out[0] * dy).sum() + ((out[1] * dst).sum() if prenorm else 0)
    loss_ref = (y_ref * dy).sum() + ((s_ref * dst).sum() if prenorm else 0)
    if prenorm:
        torch.testing.assert_close(out[1], s_ref, rtol=1e-12, atol=1e-12)
    params = [x, r, w] + ([b] if norm == "layer" else []) + ([ls] if extras == "all" else [])
    for got, want in zip(torch.autograd.grad(loss, params), torch.autograd.grad(loss_ref, params), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_low_precision_matches_the_float64_oracle(backend, dtype, norm):
    x, r, w, b, ls, rs = inputs((33, 257), dtype=dtype)
    x, r, ls = (t.requires_grad_() for t in (x, r, ls))
    y, mask = call(
        norm, x, r, w, b, dropout_p=0.1, layer_scale=ls, rowscale=rs, return_dropout_mask=True, backend=backend
    )
    assert y.dtype == dtype
    d = [t.detach().double().requires_grad_() for t in (x, r, ls)]
    y_ref, _ = unfused(norm, d[0], d[1], w.double(), b.double(), mask, 0.1, d[2], rs.double())
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(y.double(), y_ref, rtol=rtol, atol=atol * 4)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(TEST_DEVICE)
    got = torch.autograd.grad((y.float() * dy).sum(), (x, r, ls))
    want = torch.autograd.grad((y_ref * dy.double()).sum(), d)
    for g, h in zip(got, want, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), h, rtol=rtol * 4, atol=atol * 8 * (1 + h.abs().max().item() / 100))


def test_the_keep_mask_is_the_same_bits_on_every_backend(backend, monkeypatch):
    """What each backend dropped is read off its stream (x nonzero, residual 0, so s = 0 exactly
    where dropped): equal to the reference's keep_mask, and the streams bit for bit equal."""
    if interpreted(backend):
        from addnorm.kernels.triton import config
        from test_triton import chunked_above

        monkeypatch.setattr(config, "TABLE", chunked_above(64))  # the chunked path too
    x = torch.rand(2, 37, 300).add(0.5).to(TEST_DEVICE)
    r = torch.zeros_like(x).requires_grad_()
    x.requires_grad_()
    seed = torch.Generator().manual_seed(7)
    y, s, mask = addnorm.add_layer_norm(
        x, r, 300, prenorm=True, dropout_p=0.4, generator=seed, return_dropout_mask=True, backend=backend
    )
    rows = torch.arange(74, device=x.device)
    seed_value = torch.randint(0, 2**62, (), generator=torch.Generator().manual_seed(7))
    expected = reference.keep_mask(seed_value.to(x.device), rows, 300, 0.4).view(x.shape)
    assert torch.equal(mask, expected)
    assert torch.equal(s != 0, expected)
    assert torch.equal(s, torch.where(expected, x.detach() * torch.tensor(1 / 0.6), 0))
    dx, dr = torch.autograd.grad(y.sum() + s.sum(), (x, r))
    assert torch.equal(dx == 0, ~expected | (dr == 0))  # the backward recomputed the same mask
    torch.testing.assert_close(dx, torch.where(expected, dr / 0.6, 0))


def test_mask_hash_matches_a_plain_python_transcription():
    """The documented formula, written again with Python ints (no tensors, no overflow)."""

    def fmix(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    seed = 0x1234_5678_9ABC_DEF
    k0, k1 = seed & 0xFFFFFFFF, seed >> 32
    got = reference.mask_hash(torch.tensor(seed), torch.arange(3), 5)
    for row in range(3):
        a = fmix((fmix(row ^ k0) + k1) & 0xFFFFFFFF)
        for col in range(5):
            b = fmix((fmix(col ^ k1) + (k0 ^ 0x9E3779B9)) & 0xFFFFFFFF)
            assert got[row, col].item() == fmix((a + b) & 0xFFFFFFFF)


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_mask_statistics(p):
    """Keep rate within binomial bounds; no correlation between neighbouring elements, rows or
    consecutive calls beyond what independent draws show (5 standard deviations)."""
    m, n = 512, 1024
    x, r = torch.ones(m, n), torch.zeros(m, n)
    masks = [addnorm.add_layer_norm(x, r, n, dropout_p=p, return_dropout_mask=True)[1] for _ in range(2)]
    total = m * n
    kept = masks[0].sum().item()
    assert abs(kept - total * (1 - p)) < 5 * math.sqrt(total * p * (1 - p))
    bound = 5 / math.sqrt(total)
    mask = masks[0]
    assert abs(correlation(mask[:, 1:], mask[:, :-1])) < bound  # neighbours in a row
    assert abs(correlation(mask[1:], mask[:-1])) < bound  # neighbouring rows
    assert abs(correlation(masks[0], masks[1])) < bound  # consecutive calls
    for stride in (2, 32, 1024):  # no period along the flattened elements
        flat = mask.flatten()
        assert abs(correlation(flat[stride:], flat[:-stride])) < bound
    # the statistic can fail: a mask with repeated rows is caught
    repeated = mask.clone()
    repeated[1::2] = repeated[::2]
    assert abs(correlation(repeated[1:], repeated[:-1])) > 10 * bound


def test_seeds_come_from_the_generator():
    x, r = torch.randn(8, 64), torch.randn(8, 64)
    draw = lambda **kw: addnorm.add_layer_norm(x, r, 64, dropout_p=0.5, return_dropout_mask=True, **kw)[1]  # noqa: E731
    torch.manual_seed(0)
    first = draw()
    torch.manual_seed(0)
    assert torch.equal(draw(), first)  # torch.manual_seed makes runs reproducible
    assert not torch.equal(draw(), first)  # and the next call draws a new mask
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    assert torch.equal(draw(generator=g()), draw(generator=g()))


@pytest.mark.parametrize("rows", [4, 2100])  # 2100 x 32: past the CPU kernels' threading threshold
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_replays_the_masks(backend, reentrant, rows):
    """torch.utils.checkpoint recomputes the forward in the backward pass: with torch's default
    generator, whose state it restores, the same masks and the plain run's gradients; with a
    generator of one's own, which it does not restore, a warning that the recomputed mask differs."""
    from torch.utils.checkpoint import checkpoint

    def grads(checkpointed, **kw):
        torch.manual_seed(3)
        m = addnorm.AddNorm(32, prenorm=True, dropout=0.5, backend=backend, **kw)
        h = torch.randn(rows if not interpreted(backend) else 4, 32, requires_grad=True)
        r = torch.randn(h.shape)
        y, s = checkpoint(m, h, r, use_reentrant=reentrant) if checkpointed else m(h, r)
        ((y * y).sum() + (s * s * s).sum()).backward()
        return h.grad, m.norm.weight.grad

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for got, want in zip(grads(True), grads(False)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.warns(RuntimeWarning, match="generator= is drawing its seed in a backward pass"):
        grads(True, generator=torch.Generator().manual_seed(5))


def test_no_mask_is_saved_for_backward(backend):
    """Saved tensors: x, residual, weight, statistics, the seed and the (N,) and (M,) factors;
    nothing of x's size beyond x and residual, no bool."""
    x, r, w, b, ls, rs = inputs((16, 128), dtype=torch.float32)
    x, r, w, ls = (t.requires_grad_() for t in (x, r, w, ls))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, s = addnorm.add_layer_norm(
            x, r, 128, w, b, prenorm=True, dropout_p=0.5, layer_scale=ls, rowscale=rs, backend=backend
        )
    (y.sum() + s.sum()).backward()
    assert not any(t.dtype == torch.bool for t in saved)
    big = [t for t in saved if t.numel() >= x.numel()]
    assert len(big) == 2 and any(t is x for t in big) and any(t is r for t in big)


def test_p0_is_bitwise_the_plain_add_and_p1_drops_everything(backend):
    x, r, w, b, _, _ = inputs((9, 300), dtype=torch.float32)
    plain = addnorm.add_layer_norm(x, r, 300, w, b, prenorm=True, backend=backend)
    zero = addnorm.add_layer_norm(x, r, 300, w, b, prenorm=True, dropout_p=0.0, backend=backend)
    assert all(torch.equal(a, c) for a, c in zip(plain, zero, strict=True))
    x = x.clone().requires_grad_()
    y, s = addnorm.add_layer_norm(x, r, 300, w, b, prenorm=True, dropout_p=1.0, backend=backend)
    assert torch.equal(s, r) and not y.isnan().any()
    torch.testing.assert_close(y, F.layer_norm(r, (300,), w, b), rtol=1e-5, atol=1e-5)
    (dx,) = torch.autograd.grad(y.sum() + s.sum(), x)
    assert torch.equal(dx, torch.zeros_like(dx))


@pytest.mark.large  # gradcheck calls the kernels hundreds of times: not through an interpreter
def test_gradcheck_and_second_derivatives_with_a_fixed_seed(backend):
    x, r, w, b, ls, rs = inputs((4, 12))
    args = tuple(t.requires_grad_() for t in (x, r, w, b, ls))

    def f(x, r, w, b, ls):
        g = torch.Generator(device=x.device).manual_seed(3)
        return addnorm.add_layer_norm(
            x, r, 12, w, b, prenorm=True, dropout_p=0.25, generator=g, layer_scale=ls, rowscale=rs, backend=backend
        )

    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)


def test_compiles_fullgraph():
    x, r, w, b, ls, rs = inputs((6, 40), dtype=torch.float32)
    x.requires_grad_()
    fn = torch.compile(
        lambda x, r: addnorm.add_layer_norm(x, r, 40, w, b, dropout_p=0.2, layer_scale=ls, return_dropout_mask=True),
        fullgraph=True,
    )
    y, mask = fn(x, r)
    y_ref, _ = unfused("layer", x, r, w, b, mask, 0.2, ls)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    (dx,) = torch.autograd.grad(y.sum(), x)
    (dx_ref,) = torch.autograd.grad(y_ref.sum(), x)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)


def test_zero_centered_weight_keeps_small_weights_exact_in_bfloat16(backend):
    """1 + weight in float32: a bf16 weight of 1e-3 is not lost in a bf16 sum (1 + 1e-3 rounds to 1)."""
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.full((64,), 1e-3, dtype=torch.bfloat16, requires_grad=True)
    y = addnorm.rms_norm(x, 64, w, zero_centered_weight=True, backend=backend)
    ref = F.rms_norm(x.double(), (64,), 1 + w.double().detach())
    torch.testing.assert_close(y.double(), ref, rtol=1.6e-2, atol=1e-2)
    plain = addnorm.rms_norm(x, 64, torch.ones(64, dtype=torch.bfloat16), backend=backend)
    assert not torch.equal(y, plain)  # the 1e-3 made it through
    (dw,) = torch.autograd.grad(y.float().sum(), w)
    assert dw.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(dropout_p=1.5), r"dropout_p must be a probability in \[0, 1\], got 1.5"),
        (dict(dropout_p=float("nan")), r"dropout_p must be a probability in \[0, 1\], got nan"),
        (dict(dropout_p=True), r"dropout_p must be a probability"),
        (dict(dropout_p=0.1, generator="7"), r"generator must be a torch.Generator or None, got str"),
        (dict(layer_scale=torch.ones(5)), r"layer_scale must have shape \(8,\)"),
        (dict(rowscale=torch.ones(4)), r"rowscale must have x's leading dims \(2, 3\)"),
        (dict(rowscale=torch.ones(2, 3, requires_grad=True)), r"rowscale is a per-row constant"),
        (dict(zero_centered_weight=1), r"zero_centered_weight must be True or False"),
        (dict(return_dropout_mask="yes"), r"return_dropout_mask must be True or False"),
    ],
)
def test_bad_arguments_get_clear_errors(kw, match):
    x, r = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    with pytest.raises((ValueError, TypeError), match=match):
        addnorm.add_layer_norm(x, r, 8, torch.ones(8), **kw)


def test_a_generator_on_another_device_is_refused():
    x = torch.randn(2, 8, device="meta")
    with pytest.raises(ValueError, match=r"generator is on cpu but x is on meta"):
        ops._sublayer(x, x, (8,), None, ops.Sublayer(dropout_p=0.1, generator=torch.Generator("cpu")))
    with pytest.raises(ValueError, match=r"zero_centered_weight=True scales by 1 \+ weight: it needs a weight"):
        addnorm.layer_norm(torch.randn(2, 8), 8, zero_centered_weight=True)


def test_add_norm_module_applies_dropout_in_train_mode_only(backend):
    torch.manual_seed(0)
    m = addnorm.AddNorm(32, dropout=0.1, layer_scale=True, layer_scale_init=0.5, backend=backend)
    x, r = torch.randn(4, 32), torch.randn(4, 32)
    m.eval()
    expected = addnorm.add_layer_norm(x * 0.5, r, 32, backend="reference")
    torch.testing.assert_close(m(x, r), expected, rtol=1e-6, atol=1e-6)
    m.train()
    assert not torch.allclose(m(x, r), expected)
    assert list(m.state_dict()) == ["layer_scale", "norm.weight", "norm.bias"]
    copy = pickle.loads(pickle.dumps(m))
    assert torch.equal(copy.layer_scale, m.layer_scale) and copy.dropout == 0.1
    with pytest.raises(ValueError, match=r"dropout must be a probability in \[0, 1\], got -0.1"):
        addnorm.AddNorm(32, dropout=-0.1)


def test_zero_centered_modules_start_as_the_identity_scale():
    for norm in (addnorm.LayerNorm(16, zero_centered_weight=True), addnorm.RMSNorm(16, zero_centered_weight=True)):
        assert torch.equal(norm.weight, torch.zeros(16))
        x = torch.randn(3, 16)
        plain = F.layer_norm(x, (16,)) if isinstance(norm, addnorm.LayerNorm) else F.rms_norm(x, (16,))
        torch.testing.assert_close(norm(x), plain, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs elementwise_affine=True"):
        addnorm.LayerNorm(16, elementwise_affine=False, zero_centered_weight=True)


@pytest.mark.large  # above the CPU kernel's threading threshold (parallel_min_elements): many row blocks
def test_gradients_above_the_threading_threshold(backend):
    """Several row blocks on several threads: dlayer_scale's per-block partials, dx and the mask
    at rows far from the first block, against the float64 oracle with the returned mask."""
    from addnorm.kernels import cpu

    shape = (300, 512)
    assert shape[0] * shape[1] > 2 * cpu.config.SETTINGS.parallel_min_elements
    x, r, w, b, ls, rs = inputs(shape, dtype=torch.float32)
    x, r, w, ls = (t.requires_grad_() for t in (x, r, w, ls))
    y, s, mask = addnorm.add_layer_norm(
        x,
        r,
        512,
        w,
        b,
        prenorm=True,
        dropout_p=0.1,
        layer_scale=ls,
        rowscale=rs,
        return_dropout_mask=True,
        backend=backend,
    )
    d = [t.detach().double().requires_grad_() for t in (x, r, w, ls)]
    y_ref, s_ref = unfused("layer", d[0], d[1], d[2], b.double(), mask, 0.1, d[3], rs.double())
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(4)
    dy, dst = (torch.randn(shape, generator=g).to(TEST_DEVICE) for _ in range(2))
    got = torch.autograd.grad((y * dy).sum() + (s * dst).sum(), (x, r, w, ls))
    want = torch.autograd.grad((y_ref * dy.double()).sum() + (s_ref * dst.double()).sum(), d)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-4 * (1 + e.abs().max().item()))
