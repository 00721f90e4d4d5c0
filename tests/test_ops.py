"""The custom ops: torch.compile, what autograd saves, grad modes, dispatch and errors."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import addnorm
from addnorm import ops


def _inputs(requires_grad=True, n=16):
    g = torch.Generator().manual_seed(0)
    t = lambda *s: torch.randn(*s, generator=g).requires_grad_(requires_grad)
    return t(4, 3, n), t(4, 3, n), t(n), t(n)


@pytest.mark.parametrize("rms", [False, True])
def test_torch_compile_fullgraph_forward_and_backward(backend, rms):
    torch._dynamo.reset()

    def step(x, r, w, b):
        if rms:
            y, s = addnorm.add_rms_norm(x, r, 16, w, prenorm=True, backend=backend)
        else:
            y, s = addnorm.add_layer_norm(x, r, 16, w, b, prenorm=True, backend=backend)
        return (y * y).sum() + (s * s.sin()).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_in, comp_in = _inputs(), _inputs()
    step(*eager_in).backward()
    compiled(*comp_in).backward()
    for a, b in zip(eager_in, comp_in):
        if a.grad is None:  # rms has no bias
            assert b.grad is None
            continue
        torch.testing.assert_close(b.grad, a.grad)


def test_torch_compile_inductor_module():
    torch._dynamo.reset()
    m = addnorm.LayerNorm(16)
    x = torch.randn(8, 16)
    torch.testing.assert_close(torch.compile(m, fullgraph=True)(x), TF.layer_norm(x, (16,), m.weight, m.bias))


def _saved(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


def test_training_saves_only_stream_mean_rstd_and_weight(backend):
    """(Under backend="auto" small CPU inputs run torch's own ops, which save what torch saves.)"""
    x, r, w, b = _inputs()
    (y, s), saved = _saved(lambda: addnorm.add_layer_norm(x, r, 16, w, b, prenorm=True, backend=backend))
    shapes = sorted(tuple(t.shape) for t in saved)
    # s (the stream), weight, mean and rstd per row: no xhat, no output.
    assert shapes == sorted([(12, 16), (16,), (12,), (12,)])
    assert any(t.data_ptr() == s.data_ptr() for t in saved)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode_save_nothing(mode):
    x, r, w, b = _inputs()
    with mode():
        out, saved = _saved(lambda: addnorm.add_layer_norm(x, r, 16, w, b))
    assert saved == [] and not out.requires_grad
    torch.testing.assert_close(out, TF.layer_norm(x + r, (16,), w, b).detach())


def test_zero_rows(backend):
    x = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    y = addnorm.layer_norm(x, 8, w, backend=backend)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros(8))


def test_auto_backend_and_explicit_names():
    assert ops.auto_backend(torch.empty(2, 4)) in ops.BACKEND_MODULES
    with pytest.raises(ValueError, match=r"backend must be one of \['auto', 'reference'"):
        addnorm.layer_norm(torch.randn(2, 4), 4, backend="cuda")
    with pytest.raises(TypeError, match="backend must be a string"):
        addnorm.layer_norm(torch.randn(2, 4), 4, backend=None)


# --------------------------------------------------------------------------- errors

X = torch.randn(2, 3, 4)
ERRORS = [
    (lambda: addnorm.layer_norm(X, 5), ValueError, r"x of shape \(2, 3, 4\) must end with normalized_shape \(5,\)"),
    (lambda: addnorm.layer_norm(X, (2, 4)), ValueError, r"must end with normalized_shape \(2, 4\)"),
    (lambda: addnorm.layer_norm(X, (1, 2, 3, 4)), ValueError, "must end with normalized_shape"),
    (lambda: addnorm.layer_norm(X, 0), ValueError, "normalized_shape must be one or more positive ints"),
    (lambda: addnorm.layer_norm(X, "4"), TypeError, "normalized_shape must be an int or a sequence"),
    (lambda: addnorm.layer_norm(X, 4, torch.ones(3)), ValueError, r"weight must have shape \(4,\)"),
    (lambda: addnorm.layer_norm(X, 4, None, torch.ones(2, 4)), ValueError, r"bias must have shape \(4,\)"),
    (lambda: addnorm.layer_norm(X, 4, torch.ones(4, dtype=torch.int64)), TypeError,
     "weight must be a floating-point tensor"),
    (lambda: addnorm.layer_norm(X, 4, torch.ones(4, device="meta")), ValueError,
     "weight is on meta but x is on cpu"),
    (lambda: addnorm.layer_norm(X, 4, [1.0] * 4), TypeError, "weight must be a torch.Tensor, got list"),
    (lambda: addnorm.layer_norm(torch.ones(2, 4, dtype=torch.int32), 4), TypeError,
     "x must be a floating-point tensor .* got torch.int32"),
    (lambda: addnorm.layer_norm(np.ones((2, 4)), 4), TypeError, "x must be a torch.Tensor, got ndarray"),
    (lambda: addnorm.layer_norm(X, 4, eps=-1e-5), ValueError, "eps must be a non-negative finite number"),
    (lambda: addnorm.layer_norm(X, 4, eps=float("nan")), ValueError, "eps must be a non-negative finite number"),
    (lambda: addnorm.rms_norm(X, 4, eps="small"), TypeError, "eps must be a non-negative finite number"),
    (lambda: addnorm.add_layer_norm(X, torch.randn(2, 4), 4), ValueError,
     r"residual must have the shape of x \(2, 3, 4\), got \(2, 4\)"),
    (lambda: addnorm.add_layer_norm(X, None, 4), TypeError, "residual must be a torch.Tensor, got NoneType"),
    (lambda: addnorm.add_rms_norm(X, X.long(), 4), TypeError, "residual must be a floating-point tensor"),
    (lambda: addnorm.add_rms_norm(X, X, 4, residual_dtype=torch.int32), TypeError,
     r"residual_dtype must be None or a torch dtype \(float16, bfloat16, float32 or float64\)"),
    (lambda: addnorm.add_rms_norm(X, X.to("meta"), 4), ValueError, "residual is on meta but x is on cpu"),
]


@pytest.mark.parametrize("call,exc,match", ERRORS)
def test_bad_input_raises_clear_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("n", [1, 2])
def test_tiny_normalized_shape_warns(n):
    x = torch.randn(3, n)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = addnorm.layer_norm(x, n)
    assert any(f"normalizing over {n} feature" in str(w.message) for w in caught)
    torch.testing.assert_close(y, TF.layer_norm(x, (n,)))


def test_three_features_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        addnorm.layer_norm(torch.randn(3, 3), 3)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_custom_ops_pass_opcheck(backend, rms, residual):
    """Fake kernels, schema, autograd registration and dispatch of the custom ops, as torch checks them."""
    x, r, w, b = (t.double() for t in _inputs(n=8))
    x2, r2 = x.detach().reshape(-1, 8).requires_grad_(), r.detach().reshape(-1, 8).requires_grad_()
    args = (x2, r2 if residual else None, w, None if rms else b, 1e-5, rms, None, backend)
    torch.library.opcheck(ops._forward_op, args)
    y, s, mean, rstd = ops._forward_op(*args)
    saved = s if residual else x2
    dy = torch.randn_like(y)
    bargs = (dy, torch.randn_like(s) if residual else None, saved.detach(), w.detach(),
             None if rms else mean, rstd, not rms, backend)
    torch.library.opcheck(ops._backward_op, bargs)


def test_gradcheck_through_the_custom_op_path(backend):
    """The graph-traced path (custom op + registered autograd) has the same exact gradients."""
    x, r, w, b = (t.detach().double().requires_grad_() for t in _inputs(n=6))
    f = lambda x, r, w, b: ops._forward_op(x.reshape(-1, 6), r.reshape(-1, 6), w, b, 1e-5, False, None, backend)[:2]
    assert torch.autograd.gradcheck(f, (x, r, w, b))
