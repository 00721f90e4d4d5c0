"""backend="auto" on small CPU inputs: torch's own ops (``x + residual``, then torch's norm).

Which path ran is read from the autograd graph: torch's path ends in torch's own backward
nodes, the kernel path in addnorm's hand-written one (``_EagerAddNormBackward``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF

import addnorm
from addnorm import ops
from conftest import DTYPES, assert_matches_oracle


def _call(x, r, shape, w, b, *, rms, prenorm=False, eps=None, **kw):
    if r is None:
        return addnorm.rms_norm(x, shape, w, eps, **kw) if rms else addnorm.layer_norm(x, shape, w, b, 1e-5, **kw)
    if rms:
        return addnorm.add_rms_norm(x, r, shape, w, eps, prenorm=prenorm, **kw)
    return addnorm.add_layer_norm(x, r, shape, w, b, prenorm=prenorm, **kw)


def _inputs(m, n, dtype, offset=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, n, generator=g, dtype=torch.float64) + offset).to(dtype).requires_grad_()
    r = torch.randn(m, n, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = torch.randn(n, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    b = torch.randn(n, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return x, r, w, b


def _kernel_path(y) -> bool:
    """Whether addnorm's backward node is in the last two steps of ``y``'s graph (the kernel
    path ends in a view of its output)."""
    nodes = [y.grad_fn, *(f for f, _ in y.grad_fn.next_functions if f is not None)]
    return any("_EagerAddNorm" in type(f).__name__ for f in nodes)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_small_inputs_take_torchs_ops_large_ones_the_kernels(rms, monkeypatch):
    x, r, w, b = _inputs(8, 64, torch.float32)
    assert not _kernel_path(_call(x, r, 64, w, b, rms=rms))
    assert _kernel_path(_call(x, r, 64, w, b, rms=rms, backend="reference"))  # a named backend: never
    monkeypatch.setattr(ops, "TORCH_PATH_MAX_ELEMENTS", 8 * 64)  # now this input is "large"
    assert _kernel_path(_call(x, r, 64, w, b, rms=rms))


def test_what_torchs_ops_cannot_do_alike_goes_to_the_kernels():
    """Mixed dtypes (the stream or the parameters in another dtype than x) keep the reference
    contract's casts, so they skip torch's path."""
    x, r, w, b = _inputs(8, 64, torch.bfloat16)
    r32, w32 = r.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    assert _kernel_path(addnorm.add_layer_norm(x, r32, 64, w, b))
    assert _kernel_path(addnorm.add_layer_norm(x, r, 64, w32, None))
    assert _kernel_path(addnorm.add_layer_norm(x, r, 64, w, b, residual_dtype=torch.float32))
    assert not _kernel_path(addnorm.add_layer_norm(x, r, (64,), w, b))  # a tuple shape: torch's path


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("case", ["norm", "post", "pre"])
def test_torch_path_matches_the_fp64_oracle(dtype, rms, case):
    """Forward and all gradients against the fp64 oracle (torch in float64), rows far from zero
    included; RMSNorm's default eps is the float32 epsilon for 16-bit inputs, as the kernels."""
    x, r, w, b = _inputs(37, 96, dtype, offset=100.0)
    if case == "norm":
        r = None
    b = None if rms else b
    leaves = [t for t in (x, r, w, b) if t is not None]
    out = _call(x, r, 96, w, b, rms=rms, prenorm=case == "pre")
    y, s = out if case == "pre" else (out, None)
    assert not _kernel_path(y) and y.dtype == dtype

    x64, r64, w64, b64 = (None if t is None else t.detach().double().requires_grad_() for t in (x, r, w, b))
    s64 = x64 + r64 if r is not None else x64
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    y64 = TF.rms_norm(s64, (96,), w64, eps) if rms else TF.layer_norm(s64, (96,), w64, b64, 1e-5)
    xt, rt, wt, bt = (None if t is None else t.detach().clone().requires_grad_() for t in (x, r, w, b))
    st = xt + rt if r is not None else xt
    yt = TF.rms_norm(st, (96,), wt, eps) if rms else TF.layer_norm(st, (96,), wt, bt, 1e-5)
    assert_matches_oracle(y.detach(), y64.detach(), yt.detach())
    if s is not None:
        assert torch.equal(s, (x + r).detach())

    g = torch.Generator().manual_seed(1)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    outs, outs64 = ((y, s), (y64, s64)) if s is not None else ((y,), (y64,))
    douts = (dy, dy) if s is not None else (dy,)
    grads = torch.autograd.grad(outs, leaves, [d.to(dtype) for d in douts])
    leaves64 = [t for t in (x64, r64, w64, b64) if t is not None]
    grads64 = torch.autograd.grad(outs64, leaves64, douts)
    leaves_t = [t for t in (xt, rt, wt, bt) if t is not None]
    grads_t = torch.autograd.grad((yt, st) if s is not None else (yt,), leaves_t, [d.to(dtype) for d in douts])
    for ours, oracle, same_dtype in zip(grads, grads64, grads_t):
        assert_matches_oracle(ours, oracle, same_dtype, scale=37.0 if ours.dim() == 1 else 1.0)


def test_bad_input_is_still_reported_by_addnorm():
    """The torch path's lean checks hand anything unusual to the full checks."""
    x, r, w, b = _inputs(8, 64, torch.float32)
    with pytest.raises(ValueError, match="residual must have the shape of x"):
        addnorm.add_layer_norm(x, r[:, :32], 64, w, b)
    with pytest.raises(ValueError, match="weight must have shape"):
        addnorm.layer_norm(x, 64, w[:32])
    with pytest.raises(ValueError, match="eps must be a non-negative finite number"):
        addnorm.layer_norm(x, 64, eps=float("nan"))
    with pytest.raises(ValueError, match="must end with normalized_shape"):
        addnorm.layer_norm(x, 65)
    with pytest.raises(ValueError, match="must end with normalized_shape"):
        addnorm.add_rms_norm(x, r, (4, 64), w)
    with pytest.raises(ValueError, match="bias must have shape"):
        addnorm.add_layer_norm(x, r, 64, w, b[:63])
    with pytest.raises(ValueError, match="normalized_shape must be one or more positive ints"):
        addnorm.layer_norm(x, (0, 64))
    with pytest.raises(TypeError, match="prenorm must be True or False"):
        addnorm.add_layer_norm(x, r, 64, prenorm="yes")


def test_what_torch_rejects_or_would_read_otherwise_gets_addnorms_errors():
    """Arguments the lean path leaves to torch (the parameters' type and device, x's dtype) or
    checks itself (eps) still get addnorm's messages, on every function."""
    x, r, w, b = (t.detach() for t in _inputs(8, 64, torch.float32))
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        addnorm.layer_norm(x, 64, [1.0] * 64)
    with pytest.raises(TypeError, match="bias must be a torch.Tensor"):
        addnorm.add_layer_norm(x, r, 64, w, b.numpy())
    with pytest.raises(ValueError, match="weight is on meta but x is on cpu"):
        addnorm.rms_norm(x, 64, w.to("meta"))
    with pytest.raises(ValueError, match="residual is on meta but x is on cpu"):
        addnorm.add_rms_norm(x, r.to("meta"), 64)
    for dtype in (torch.complex64, torch.int32):
        with pytest.raises(TypeError, match="x must be a floating-point tensor"):
            addnorm.layer_norm(x.to(dtype), 64)
    with pytest.raises(ValueError, match="eps must be a non-negative finite number"):
        addnorm.add_layer_norm(x, r, 64, eps=-1e-5)
    with pytest.raises(TypeError, match="eps must be a non-negative finite number"):
        addnorm.rms_norm(x, 64, eps=True)
