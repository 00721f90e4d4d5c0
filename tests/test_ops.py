"""The custom ops: torch.compile, what autograd saves, grad modes, dispatch and errors."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as TF

import addnorm
from addnorm import autograd
from addnorm import backend as backends
from conftest import interpreted


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


def test_zero_rows(backend):
    x = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    y = addnorm.layer_norm(x, 8, w, backend=backend)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros(8))


def test_auto_backend_and_explicit_names():
    assert backends.auto_name(torch.empty(2, 4)) in backends.REGISTRY
    with pytest.raises(ValueError, match=r"backend must be one of \['auto', 'reference'"):
        addnorm.layer_norm(torch.randn(2, 4), 4, backend="cuda")
    with pytest.raises(TypeError, match="backend must be a string"):
        addnorm.layer_norm(torch.randn(2, 4), 4, backend=None)


@pytest.mark.parametrize("n", [1, 2])
def test_tiny_normalized_shape_warns(n):
    x = torch.randn(3, n)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = addnorm.layer_norm(x, n)
    assert any(f"normalizing over {n} feature" in str(w.message) for w in caught)
    torch.testing.assert_close(y, TF.layer_norm(x, (n,)))


@pytest.mark.parametrize("n", [1, 2])
def test_tiny_normalized_shape_compiles_fullgraph(n):
    """The warning above is left out of compiled graphs (a warning is a graph break)."""
    torch._dynamo.reset()
    x = torch.randn(3, n)
    torch.testing.assert_close(
        torch.compile(lambda t: addnorm.layer_norm(t, n), fullgraph=True)(x), TF.layer_norm(x, (n,))
    )


@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_calls_write_into_out_buffers(fullgraph):
    """Under torch.compile, out= and residual_out= are written and returned as in eager mode, with
    one or several normalized dims and out=x in place."""
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    cases = {
        "add_layer_norm, both buffers": (
            lambda x, r, o, ro: addnorm.add_layer_norm(x, r, 8, out=o, residual_out=ro, prenorm=True),
            (TF.layer_norm(x + r, (8,)), x + r),
        ),
        "add_rms_norm, out": (lambda x, r, o, ro: addnorm.add_rms_norm(x, r, 8, out=o), (TF.rms_norm(x + r, (8,)),)),
        "layer_norm over two dims": (
            lambda x, r, o, ro: addnorm.layer_norm(x, (4, 8), out=o),
            (TF.layer_norm(x, (4, 8)),),
        ),
        "out=x": (lambda x, r, o, ro: addnorm.layer_norm(o, 8, out=o), (TF.layer_norm(x, (8,)),)),
    }
    for name, (fn, want) in cases.items():
        torch._dynamo.reset()
        buffers = [x.clone() if name == "out=x" else torch.zeros_like(x), torch.zeros_like(x)]
        got = torch.compile(fn, fullgraph=fullgraph, backend="aot_eager")(x, r, *buffers)
        got = got if type(got) is tuple else (got,)
        for i, (t, buffer, expected) in enumerate(zip(got, buffers, want)):
            assert t is buffer, f"{name}: result {i} is not its buffer"
            torch.testing.assert_close(buffer, expected, msg=lambda m, name=name, i=i: f"{name}, result {i}: {m}")


@pytest.mark.parametrize("transform", ["grad", "jacrev", "vmap"])
def test_torch_func_transforms_compile(transform):
    """torch.compile of a torch.func transform of addnorm: the transform's results, as of torch's
    own ops (the custom op cannot run under a transform: the reference formulas do)."""
    torch._dynamo.reset()
    x, r, w, b = (t.detach() for t in _inputs())
    if transform == "vmap":
        f = lambda x: addnorm.add_layer_norm(x, r[0], 16, w, b)  # noqa: E731
        ft = lambda x: TF.layer_norm(x + r[0], (16,), w, b)  # noqa: E731
    else:
        f = lambda x: addnorm.add_layer_norm(x, r, 16, w, b).pow(2).sum()  # noqa: E731
        ft = lambda x: TF.layer_norm(x + r, (16,), w, b).pow(2).sum()  # noqa: E731
    wrap = getattr(torch.func, transform)
    got = torch.compile(wrap(f), fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(got, wrap(ft)(x))


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
    for prenorm in (False, True):
        args = (x2, r2 if residual else None, w, None if rms else b, 1e-5, rms, None, backend, prenorm)
        torch.library.opcheck(autograd.forward_op, args)
        y, s, mean, rstd = autograd.forward_op(*args)
        s_parts = [s.detach()] if s.numel() else [x2.detach()] + ([r2.detach()] if residual else [])
        dy = torch.randn_like(y)
        bargs = (
            dy,
            torch.randn_like(s) if s.numel() else None,
            s_parts,
            w.detach(),
            None if rms else mean,
            rstd,
            rms,
            not rms,
            backend,
        )
        torch.library.opcheck(autograd.backward_op, bargs)


def test_gradcheck_through_the_custom_op_path(backend):
    """The graph-traced path (custom op + registered autograd) has the same exact gradients."""
    x, r, w, b = (t.detach().double().requires_grad_() for t in _inputs(n=6))
    op = autograd.forward_op
    f = lambda x, r, w, b: op(x.reshape(-1, 6), r.reshape(-1, 6), w, b, 1e-5, False, None, backend, True)[:2]
    assert torch.autograd.gradcheck(f, (x, r, w, b), fast_mode=interpreted(backend))
