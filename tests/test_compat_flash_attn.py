"""addnorm.compat.flash_attn: flash-attn's signatures and result order, held to flash-attn's own
acceptance rule, restated here: for the output, the stream and every gradient,
``|addnorm - ref_fp32| <= 2 * |ref_in_dtype - ref_fp32| + atol``, where ``ref`` is the unfused
formula in torch ops with the call's own keep masks, computed in float32 and in the input dtype."""

from __future__ import annotations

import itertools

import pytest
import torch

import addnorm
from addnorm.compat.flash_attn import (
    LayerNormFn,
    LayerNormLinearFn,
    RMSNorm,
    layer_norm_fn,
    layer_norm_linear_fn,
    layer_norm_ref,
    rms_norm_fn,
    rms_norm_ref,
)

F = torch.nn.functional
ATOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def reference(x, weight, bias, residual, x1, weight1, bias1, eps, p, masks, rowscale, zero_centered, rms, upcast):
    """The formula, unfused, in torch ops: in float32 with ``upcast``, else in the inputs' dtypes."""
    dtype = x.dtype
    if upcast:
        x, weight, bias, residual, x1, weight1, bias1 = (
            None if t is None else t.float() for t in (x, weight, bias, residual, x1, weight1, bias1)
        )
    if zero_centered:
        weight, weight1 = (None if w is None else w + 1 for w in (weight, weight1))
    if rowscale is not None:
        x = x * rowscale[..., None]
    if p > 0:
        x = x.masked_fill(~masks[0], 0.0) / (1 - p)
        if x1 is not None:
            x1 = x1.masked_fill(~masks[1], 0.0) / (1 - p)
    if x1 is not None:
        x = x + x1
    if residual is not None:
        x = (x + residual).to(x.dtype)
    s = x

    def norm(w, b):
        if rms:
            y = s * torch.rsqrt(s.float().square().mean(-1, keepdim=True) + eps).to(s.dtype) * w
            return (y + b if b is not None else y).to(dtype)
        return F.layer_norm(s.to(w.dtype), s.shape[-1:], w, b, eps).to(dtype)

    ys = (norm(weight, bias),) + ((norm(weight1, bias1),) if weight1 is not None else ())
    return ys, s


CASES = list(
    itertools.product(
        [256, 1023],  # hidden
        [(torch.float32, torch.float32), (torch.float16, torch.float32), (torch.bfloat16, torch.float32)]
        + [(torch.bfloat16, torch.bfloat16)],  # (input, residual)
        [torch.float32, torch.bfloat16],  # weight
        [True, False],  # residual
        [False, True],  # rms
        [False, True],  # prenorm
        [0.0, 0.27],  # dropout
    )
)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("hidden,dtypes,wdtype,has_residual,rms,prenorm,p", CASES)
def test_flash_attn_acceptance_rule(hidden, dtypes, wdtype, has_residual, rms, prenorm, p, parallel):
    # the dropout seeds come from torch's global generator (flash-attn's API takes none): seeded
    # here, and restored after, so that the masks do not depend on which tests ran before
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(hidden + p.__hash__() % 89)
        _acceptance_rule(hidden, dtypes, wdtype, has_residual, rms, prenorm, p, parallel)


def _acceptance_rule(hidden, dtypes, wdtype, has_residual, rms, prenorm, p, parallel):
    input_dtype, residual_dtype = dtypes
    g = torch.Generator().manual_seed(hidden + 7 * p.__hash__() % 97)
    mk = lambda *shape, dt=input_dtype: torch.randn(*shape, generator=g).to(dt).requires_grad_()  # noqa: E731
    x = mk(3, 5, hidden)
    residual = mk(3, 5, hidden, dt=residual_dtype) if has_residual else None
    weight, bias = mk(hidden, dt=wdtype), mk(hidden, dt=wdtype)
    x1 = mk(3, 5, hidden) if parallel else None
    weight1, bias1 = (mk(hidden, dt=wdtype), mk(hidden, dt=wdtype)) if parallel else (None, None)
    rowscale = None if parallel else (torch.rand(3, 5, generator=g) + 0.5).to(input_dtype)
    zero_centered = not parallel
    fn = rms_norm_fn if rms else layer_norm_fn
    out = fn(
        x, weight, bias, residual=residual, x1=x1, weight1=weight1, bias1=bias1, eps=1e-6, dropout_p=p,
        rowscale=rowscale, prenorm=True, residual_in_fp32=residual_dtype == torch.float32 and not has_residual,
        zero_centered_weight=zero_centered, return_dropout_mask=True,
    )  # fmt: skip
    ys = out[: 2 if parallel else 1]
    s, masks = out[len(ys)], out[len(ys) + 1 :]
    assert len(masks) == 2 and (masks[1] is None) == (not parallel or p == 0) and (masks[0] is None) == (p == 0)
    args = (x, weight, bias, residual, x1, weight1, bias1, 1e-6, p, masks, rowscale, zero_centered, rms)
    ref_ys, ref_s = reference(*args, upcast=True)
    low_ys, low_s = reference(*args, upcast=False)
    leaves = [t for t in (x, residual, weight, bias, x1, weight1, bias1) if t is not None]
    dys = [torch.randn(y.shape, generator=g).to(y.dtype) for y in ys]
    ds = torch.randn(s.shape, generator=g).to(s.dtype) if prenorm else None

    def grads(ys_, s_):
        outs = [*ys_, s_] if prenorm else list(ys_)
        cots = [*dys, ds] if prenorm else dys
        return torch.autograd.grad([o.float() for o in outs], leaves, [c.float() for c in cots], allow_unused=True)

    compared = [(ys[i], ref_ys[i], low_ys[i]) for i in range(len(ys))] + [(s, ref_s, low_s)]
    compared += list(zip(grads(ys, s), grads(ref_ys, ref_s), grads(low_ys, low_s)))
    for i, (ours, ref, low) in enumerate(compared):
        if ours is None:
            assert ref is None
            continue
        atol = ATOL[ours.dtype] * (4 if i >= len(ys) + 1 else 1)  # parameter gradients sum 15 rows
        allowed = 2 * (low.float() - ref.float()).abs().max().item() + atol
        # plus one rounding to the result's dtype: a value within float32 noise of a midpoint
        # rounds either way (eps * |ref| is at least its ulp)
        error = (ours.float() - ref.float()).abs() - torch.finfo(ours.dtype).eps * ref.float().abs()
        err = error.max().item()
        assert err <= allowed, f"result {i} ({ours.dtype}): error {err:.3g} beyond one rounding > {allowed:.3g}"


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("parallel", [False, True])
def test_reference_functions_give_the_fused_op_s_results_in_float64(rms, parallel):
    """layer_norm_ref / rms_norm_ref (flash-attn's test oracles, plain torch ops) against the fused
    op on the same dropout masks: results and gradients, float64."""
    g = torch.Generator().manual_seed(5)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    x, residual, weight, bias = mk(3, 5, 64), mk(3, 5, 64), mk(64), mk(64)
    x1, weight1, bias1 = (mk(3, 5, 64), mk(64), mk(64)) if parallel else (None, None, None)
    rowscale = None if parallel else torch.rand(15, generator=g, dtype=torch.float64) + 0.5  # flat, as in flash-attn
    fn, ref = (rms_norm_fn, rms_norm_ref) if rms else (layer_norm_fn, layer_norm_ref)
    args = (x, weight, bias, residual, x1, weight1, bias1, 1e-6, 0.3, rowscale, True)
    *ours, mask, mask1 = fn(*args, zero_centered_weight=True, return_dropout_mask=True)
    theirs = ref(*args, zero_centered_weight=True, dropout_mask=mask, dropout_mask1=mask1)
    assert len(theirs) == len(ours) == (3 if parallel else 2) and (mask1 is None) == (not parallel)
    flat = [None if m is None else m.reshape(15, 64) for m in (mask, mask1)]  # flash-attn's (rows, hidden)
    for a, b in zip(theirs, ref(*args, zero_centered_weight=True, dropout_mask=flat[0], dropout_mask1=flat[1])):
        assert torch.equal(a, b)
    leaves = [t for t in (x, residual, weight, bias, x1, weight1, bias1) if t is not None]
    cots = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in ours]
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    grads = [torch.autograd.grad(outs, leaves, cots) for outs in (ours, theirs)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_rms_norm_ref_rounds_as_flash_attn_s():
    """flash-attn's tests size their tolerances from its reference: rstd = 1 / sqrt(.), not rsqrt."""
    x, w = torch.randn(64, 256) * 3, torch.rand(256) + 0.5
    want = x * (1 / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6)) * w
    assert torch.equal(rms_norm_ref(x, w, None), want)


@pytest.mark.parametrize("ref", [layer_norm_ref, rms_norm_ref])
def test_reference_functions_compute_in_the_inputs_dtype_or_upcast(ref):
    x, residual = torch.randn(4, 32).bfloat16(), torch.randn(4, 32).bfloat16()
    weight = torch.rand(32).bfloat16() + 0.5
    y, s = ref(x, weight, None, residual, prenorm=True)
    assert y.dtype == s.dtype == torch.bfloat16 and torch.equal(s, x + residual)
    y32, s32 = ref(x, weight, None, residual, prenorm=True, upcast=True)
    assert y32.dtype == torch.bfloat16 and s32.dtype == torch.float32
    assert torch.equal(s32, x.float() + residual.float())
    exact = ref(x.double(), weight.double(), None, residual.double())
    assert (y32.double() - exact).abs().max() <= (y.double() - exact).abs().max()  # float32 is closer
    torch.manual_seed(0)
    dropped = ref(torch.ones(64, 64), None, None, dropout_p=0.5, prenorm=True)[1]  # torch's dropout
    assert set(dropped.unique().tolist()) == {0.0, 2.0} and 0.4 < (dropped == 0).float().mean() < 0.6
    with pytest.raises(ValueError, match="rowscale with x1"):
        ref(x, weight, None, residual, x, rowscale=torch.ones(4))


def test_rowscale_is_taken_flat_as_flash_attn_takes_it():
    """flash-attn flattens the rows and its ``rowscale`` with them: ``(rows,)`` for a 3-D x gives
    what x's leading dims give."""
    x, r, w = torch.randn(2, 3, 32), torch.randn(2, 3, 32), torch.randn(32)
    rowscale = torch.rand(2, 3)
    flat = layer_norm_fn(x, w, None, residual=r, rowscale=rowscale.reshape(-1), prenorm=True)
    lead = layer_norm_fn(x, w, None, residual=r, rowscale=rowscale, prenorm=True)
    for a, e in zip(flat, lead, strict=True):
        assert torch.equal(a, e)
    torch.testing.assert_close(flat[1], r + x * rowscale[..., None])


def test_buffers_take_the_rows_flat_as_flash_attn_takes_them():
    """``out`` and ``residual_out`` of ``(rows, hidden)`` for a 3-D ``x``: written, and the results
    returned as views of them in ``x``'s shape, equal to the allocating call's."""
    x, r, w = torch.randn(2, 3, 32), torch.randn(2, 3, 32), torch.randn(32)
    out, residual_out = torch.empty(6, 32), torch.empty(6, 32)
    y, s = rms_norm_fn(x, w, None, residual=r, prenorm=True, out=out, residual_out=residual_out)
    want_y, want_s = rms_norm_fn(x, w, None, residual=r, prenorm=True)
    assert y.shape == x.shape and y.data_ptr() == out.data_ptr() and s.data_ptr() == residual_out.data_ptr()
    assert torch.equal(y, want_y) and torch.equal(s, want_s) and torch.equal(out, want_y.reshape(6, 32))
    with pytest.raises(ValueError, match="out"):  # rows of another width are not x's
        layer_norm_fn(x, w, None, out=torch.empty(3, 64))


@pytest.mark.parametrize("prenorm", [True, False])
def test_buffers_under_autograd_are_written_and_returned_as_flash_attn_does(prenorm):
    """flash-attn's Function writes ``out`` and ``residual_out`` under autograd too: the results
    are the buffers (views of them in ``x``'s shape), holding the allocating call's values, and
    gradients reach every input through them as through the allocating call's results."""
    g = torch.Generator().manual_seed(1)
    x, r, w, b, dy = (torch.randn(*s, generator=g) for s in ((2, 3, 32), (2, 3, 32), (32,), (32,), (2, 3, 32)))
    results = []
    for buffers in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
        out, residual_out = (torch.empty(6, 32), torch.empty(6, 32)) if buffers else (None, None)
        got = layer_norm_fn(
            *leaves[:1], *leaves[2:], residual=leaves[1], prenorm=prenorm, out=out, residual_out=residual_out
        )
        y, s = got if prenorm else (got, None)
        if buffers:
            assert y.data_ptr() == out.data_ptr() and y.shape == x.shape
            assert torch.equal(residual_out.view(x.shape), x + r)
            assert s is None or s.data_ptr() == residual_out.data_ptr()
        loss = (y * dy).sum() + (0 if s is None else s.square().sum())
        results.append((y.detach(), *torch.autograd.grad(loss, leaves)))
    for a, e in zip(*results, strict=True):
        assert torch.equal(a, e)
    with pytest.raises(ValueError, match="out must be a torch.float32 tensor of shape"):
        layer_norm_fn(x.requires_grad_(), w, b, residual=r, out=torch.empty(2, 3, 32, dtype=torch.float64))


def test_jit_trace_of_a_flash_attn_call():
    """``torch.jit.trace`` (and the TorchScript ONNX exporter, which traces) of a compat call:
    the hidden size is read as an int, not a traced shape, and the trace replays on new rows."""
    w = torch.randn(32)
    f = lambda x, r: rms_norm_fn(x, w, None, residual=r, prenorm=True, residual_in_fp32=True)  # noqa: E731
    x, r = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    with torch.no_grad():
        traced = torch.jit.trace(f, (x, r), check_trace=False)
        x, r = torch.randn(4, 5, 32), torch.randn(4, 5, 32)
        for got, want in zip(traced(x, r), f(x, r), strict=True):
            torch.testing.assert_close(got, want)


def test_results_come_in_flash_attn_order():
    x, r, w, b = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32), torch.randn(32)
    assert isinstance(layer_norm_fn(x, w, b, residual=r), torch.Tensor)
    y, s = layer_norm_fn(x, w, b, residual=r, prenorm=True)
    torch.testing.assert_close(s, x + r)
    y, y1 = layer_norm_fn(x, w, b, residual=r, weight1=w * 2, bias1=b)
    y, y1, s = rms_norm_fn(x, w, None, residual=r, x1=x, weight1=w, prenorm=True)
    torch.testing.assert_close(s, r + x + x)
    y, mask, mask1 = layer_norm_fn(x, w, b, residual=r, return_dropout_mask=True)
    assert mask is None and mask1 is None  # no dropout: no masks, as flash-attn
    y, s, mask, mask1 = rms_norm_fn(x, w, None, dropout_p=0.5, prenorm=True, return_dropout_mask=True)
    assert mask.dtype == torch.bool and mask1 is None
    assert torch.equal(s, torch.where(mask, x * 2, 0))
    y, s = rms_norm_fn(x, w, None, prenorm=True)
    assert s is x  # nothing added, dropped or converted: the stream is x, as flash-attn returns it
    y = layer_norm_fn(x.bfloat16(), w, b, residual=r, out_dtype=torch.float32)
    assert y.dtype == torch.float32


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("prenorm", [False, True])
def test_layer_norm_linear_fn_is_the_norm_then_a_linear_layer(rms, prenorm):
    """Against the formula in float64: the norm of ``x + residual``, then ``F.linear``; the
    gradients of every input, and autocast's dtype for the linear under autocast."""
    g = torch.Generator().manual_seed(3)
    x, r, w, b = (torch.randn(shape, generator=g) for shape in [(2, 5, 32), (2, 5, 32), (32,), (32,)])
    lw, lb = torch.randn(16, 32, generator=g), torch.randn(16, generator=g)
    leaves = [t.requires_grad_() for t in (x, r, w, b, lw, lb)]
    result = layer_norm_linear_fn(x, w, b, lw, lb, residual=r, eps=1e-5, prenorm=prenorm, is_rms_norm=rms)
    out, s = result if prenorm else (result, None)

    def formula(x, r, w, b, lw, lb):
        s = x + r
        if rms:
            y = s * torch.rsqrt(s.square().mean(-1, keepdim=True) + 1e-5) * w + b
        else:
            y = F.layer_norm(s, (32,), w, b, 1e-5)
        return F.linear(y, lw, lb), s

    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref, ref_s = formula(*ref_leaves)
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    if prenorm:
        torch.testing.assert_close(s, ref_s.float())
    dout = torch.randn(out.shape, generator=g)
    ours = torch.autograd.grad(out, leaves, dout)
    wanted = torch.autograd.grad(ref, ref_leaves, dout.double())
    for a, e in zip(ours, wanted, strict=True):
        torch.testing.assert_close(a, e.float(), rtol=1e-4, atol=1e-4)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        low = layer_norm_linear_fn(x, w, b, lw, None, residual=r, eps=1e-5, is_rms_norm=rms)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), (ref - lb.detach()).float(), rtol=0.05, atol=0.1)


def test_functions_called_positionally_as_flash_attn_s_wrappers_call_them():
    """``LayerNormFn.apply`` and ``LayerNormLinearFn.apply`` with every argument positional, in
    the order flash-attn's ``rms_norm_fn`` and ``layer_norm_linear_fn`` pass them, against the
    formula in float64."""
    g = torch.Generator().manual_seed(5)
    x, r, w, b = (torch.randn(shape, generator=g, dtype=torch.float64) for shape in [(3, 16), (3, 16), (16,), (16,)])
    args = (x, w, b, r, None, None, None, 1e-5, 0.0, None, True, False, False, True, False, None, None, None)
    y, s = LayerNormFn.apply(*args)
    torch.testing.assert_close(s, x + r, rtol=0, atol=0)
    torch.testing.assert_close(y, (x + r) * torch.rsqrt((x + r).square().mean(-1, keepdim=True) + 1e-5) * w + b)
    lw = torch.randn(8, 16, generator=g, dtype=torch.float64)
    out = LayerNormLinearFn.apply(x, w, b, lw, None, r, 1e-5, False, False, False)
    torch.testing.assert_close(out, F.linear(F.layer_norm(x + r, (16,), w, b, 1e-5), lw))


def test_rms_norm_module_is_flash_attn_s():
    norm = RMSNorm(16, eps=1e-5, dropout_p=0.1)
    assert list(norm.state_dict()) == ["weight"] and norm.bias is None and torch.equal(norm.weight, torch.ones(16))
    assert torch.equal(RMSNorm(16, zero_centered_weight=True).weight, torch.zeros(16))
    x, r = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    norm.eval()
    y, s = norm(x, r, prenorm=True, residual_in_fp32=True)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, addnorm.add_rms_norm(x, r, 16, norm.weight, 1e-5))
    norm.train()
    torch.manual_seed(0)
    y_train = norm(x, r)
    assert not torch.allclose(y_train, y)  # dropout in training only
    loaded = RMSNorm(16)
    loaded.load_state_dict(norm.state_dict())


class FlashRMSNorm(torch.nn.Module):
    """A stand-in for flash-attn's RMSNorm module (flash-attn is not installed here): its name,
    module, attributes and forward signature, with the unfused formula as its forward."""

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0):
        super().__init__()
        self.eps = eps
        self.drop = torch.nn.Dropout(dropout_p) if dropout_p > 0 else None
        self.zero_centered_weight = False
        self.weight = torch.nn.Parameter(torch.randn(hidden_size) * 0.1 + 1)
        self.register_parameter("bias", None)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        s = x if residual is None else x + residual
        s = s.float() if residual_in_fp32 else s
        y = (s * torch.rsqrt(s.float().square().mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)
        return (y, s) if prenorm else y


FlashRMSNorm.__name__ = FlashRMSNorm.__qualname__ = "RMSNorm"


@pytest.mark.parametrize("module", ["flash_attn.ops.triton.layer_norm", "mamba_ssm.ops.triton.layer_norm"])
def test_patch_swaps_flash_attn_s_rms_norm(module, monkeypatch):
    monkeypatch.setattr(FlashRMSNorm, "__module__", module)
    model = torch.nn.ModuleDict({"norm": FlashRMSNorm(32), "other": torch.nn.Linear(32, 32)})
    x, r = torch.randn(4, 32), torch.randn(4, 32)
    before_y, before_s = model["norm"](x, r, prenorm=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = addnorm.patch(model, backend="reference")
    assert report.replaced == [("norm", "RMSNorm", "flash_attn")]
    y, s = model["norm"](x, r, prenorm=True)
    torch.testing.assert_close(y, before_y)
    torch.testing.assert_close(s, before_s)
    assert model["norm"].backend == "reference"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert addnorm.unpatch(model) == 1 and type(model["norm"]) is FlashRMSNorm


def test_patch_swaps_mamba_ssm_1_s_rms_norm_which_has_no_dropout(monkeypatch):
    """mamba_ssm 1.x's RMSNorm (``mamba_ssm.ops.triton.layernorm``) has no ``drop``: nothing of
    it is lost, so it is patched, and its layernorm_gated namesake (another signature) is not."""
    monkeypatch.setattr(FlashRMSNorm, "__module__", "mamba_ssm.ops.triton.layernorm")
    norm = FlashRMSNorm(32)
    del norm.drop, norm.zero_centered_weight
    x, r = torch.randn(4, 32), torch.randn(4, 32)
    before = norm(x, r, prenorm=True, residual_in_fp32=True)
    report = addnorm.patch(torch.nn.Sequential(norm), backend="reference")
    assert report.replaced == [("0", "RMSNorm", "flash_attn")]
    after = norm(x, r, prenorm=True, residual_in_fp32=True)
    for a, e in zip(after, before, strict=True):
        torch.testing.assert_close(a, e)

    class RMSNorm(torch.nn.Module):  # mamba_ssm.ops.triton.layernorm_gated's signature
        def __init__(self):
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.ones(8)), 1e-5

        def forward(self, x, z=None):
            return x

    monkeypatch.setattr(RMSNorm, "__module__", "mamba_ssm.ops.triton.layernorm_gated")
    assert addnorm.patch(torch.nn.Sequential(RMSNorm())).replaced == []


def test_a_look_alike_with_another_signature_is_left_alone(monkeypatch):
    class RMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.ones(8)), 1e-5

        def forward(self, x):
            return x

    monkeypatch.setattr(RMSNorm, "__module__", "flash_attn.ops.triton.layer_norm")
    report = addnorm.patch(torch.nn.Sequential(RMSNorm()))
    assert report.replaced == [] and report.skipped[0][2] == "unknown norm class; see norm_types"


def test_a_look_alike_keeping_its_dropout_elsewhere_is_left_alone(monkeypatch):
    """flash-attn's name, module and signature, but no ``drop`` attribute: patched, its dropout
    would be lost unseen, so it is skipped, saying why."""
    monkeypatch.setattr(FlashRMSNorm, "__module__", "flash_attn.ops.triton.layer_norm")
    norm = FlashRMSNorm(16, dropout_p=0.5)
    norm.dropout_p = 0.5
    del norm.drop
    report = addnorm.patch(torch.nn.Sequential(norm))
    assert report.replaced == [] and "'drop'" in report.skipped[0][2]
    assert type(norm) is FlashRMSNorm


def test_a_dropped_inf_multiplies_to_nan_as_torch_s_dropout_where_flash_attn_selects_zero():
    """The documented difference: a dropped element is multiplied by 0 (torch's dropout), so an
    inf there gives NaN in the stream; flash-attn's oracle selects 0. Kept elements agree."""
    x, r, w = torch.randn(4, 16), torch.randn(4, 16), torch.ones(16)
    x[0] = float("inf")
    torch.manual_seed(0)
    _, s, keep, _ = layer_norm_fn(x, w, None, r, dropout_p=0.5, prenorm=True, return_dropout_mask=True)
    _, s_ref = layer_norm_ref(x, w, None, r, dropout_p=0.5, prenorm=True, dropout_mask=keep)
    assert (~keep[0]).any() and keep[0].any()
    assert s[0][~keep[0]].isnan().all() and torch.equal(s_ref[0][~keep[0]], r[0][~keep[0]])
    assert torch.equal(s[1:], s_ref[1:]) and s[0][keep[0]].isinf().all()
