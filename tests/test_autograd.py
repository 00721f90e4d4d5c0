"""Autograd beyond the first derivative: double backward and torch.func, against torch's own ops.

Second derivatives differentiate the hand-written backward formulas (``gradgradcheck`` in
float64 on every backend); ``torch.func`` transforms and forward-mode AD run the reference
formulas as torch ops. Sizes include rows past every threshold (2**20 elements).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF
from torch.func import grad, jacrev, jvp, vmap

import addnorm
from conftest import interpreted


def _op(rms, residual, prenorm, affine, backend):
    """A function of (x, r, w, b) calling addnorm; its torch twin is _torch_op."""

    def f(x, r, w, b):
        w, b = (w, b) if affine else (None, None)
        if not residual:
            return (
                addnorm.rms_norm(x, 8, w, 1e-5, backend=backend)
                if rms
                else addnorm.layer_norm(x, 8, w, b, backend=backend)
            )
        if rms:
            return addnorm.add_rms_norm(x, r, 8, w, 1e-5, prenorm=prenorm, backend=backend)
        return addnorm.add_layer_norm(x, r, 8, w, b, prenorm=prenorm, backend=backend)

    return f


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize(
    "residual,prenorm", [(False, False), (True, False), (True, True)], ids=["plain", "post", "pre"]
)
@pytest.mark.parametrize("affine", [False, True], ids=["no-affine", "affine"])
def test_double_backward_gradgradcheck(backend, rms, residual, prenorm, affine):
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(3, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    args += [torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    f = _op(rms, residual, prenorm, affine, backend)
    assert torch.autograd.gradgradcheck(f, args, fast_mode=interpreted(backend))


def test_second_derivative_matches_torch(backend):
    """The case users hit first: grad of a gradient (a gradient penalty), layer_norm 3x8 float64."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True)
    c = torch.randn(3, 8, generator=g, dtype=torch.float64)
    results = []
    for fn in (lambda: addnorm.layer_norm(x, 8, w, b, backend=backend), lambda: TF.layer_norm(x, (8,), w, b)):
        (gx,) = torch.autograd.grad((fn() * c).sum(), x, create_graph=True)
        results.append(torch.autograd.grad((gx**2).sum(), (x, w, b), allow_unused=True, materialize_grads=True))
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("branch", [False, True], ids=["plain", "branch"])
def test_second_derivative_of_rows_in_leading_dims_matches_torch(backend, rms, branch):
    """x of shape (2, 3, 8): the rows sit in two leading dims, as a Transformer's (batch, seq,
    hidden) activations. The gradients taken with ``create_graph=True`` (each row with its own
    statistics) and their gradients match torch's ops on the same formula: pre-norm with the
    stream's gradient, and through the branch (layer scale, a rowscale per row)."""
    g = torch.Generator().manual_seed(2)
    f64 = dict(generator=g, dtype=torch.float64)
    x, r = (torch.randn(2, 3, 8, **f64).requires_grad_() for _ in range(2))
    w, b, ls = (torch.randn(8, **f64).requires_grad_() for _ in range(3))
    rowscale = torch.rand(2, 3, **f64) + 0.5
    c, c2 = torch.randn(2, 3, 8, **f64), torch.randn(2, 3, 8, **f64)
    extra = {"layer_scale": ls, "rowscale": rowscale} if branch else {}

    def ours():
        if rms:
            return addnorm.add_rms_norm(x, r, 8, w, 1e-5, prenorm=True, backend=backend, **extra)
        return addnorm.add_layer_norm(x, r, 8, w, b, prenorm=True, backend=backend, **extra)

    def theirs():
        s = r + (x * ls * rowscale[..., None] if branch else x)
        y = TF.rms_norm(s, (8,), w, 1e-5) if rms else TF.layer_norm(s, (8,), w, b)
        return y, s

    leaves = (x, r, w, b, ls)
    results = []
    for fn in (ours, theirs):
        y, s = fn()
        first = torch.autograd.grad((y * c).sum() + (s * c2).sum(), leaves, create_graph=True, allow_unused=True)
        penalty = sum((gr**2).sum() for gr in first if gr is not None and gr.requires_grad)
        second = torch.autograd.grad(penalty, leaves, allow_unused=True, materialize_grads=True)
        results.append([gr for gr in first if gr is not None] + list(second))
    for a, e in zip(*results, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9)


# --------------------------------------------------------------------------- torch.func


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_vmap_at_size_matches_torch(rms):
    """2 x 1100 x 1024: past 2**20 elements, where a raw-pointer path would see wrapped tensors."""
    x = torch.randn(2, 1100, 1024)
    w = torch.randn(1024)
    if rms:
        ours = vmap(lambda t: addnorm.rms_norm(t, 1024, w))(x)
        theirs = TF.rms_norm(x, (1024,), w, torch.finfo(torch.float32).eps)
    else:
        ours = vmap(lambda t: addnorm.layer_norm(t, 1024, w))(x)
        theirs = TF.layer_norm(x, (1024,), w)
    torch.testing.assert_close(ours, theirs)


def test_vmap_over_the_residual_stream_and_weights():
    x, r = torch.randn(3, 5, 64), torch.randn(3, 5, 64)
    w = torch.randn(3, 64)  # a weight per vmapped entry
    y, s = vmap(lambda a, b, c: addnorm.add_layer_norm(a, b, 64, c, prenorm=True))(x, r, w)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, torch.stack([TF.layer_norm(x[i] + r[i], (64,), w[i]) for i in range(3)]))


@pytest.mark.parametrize("m", [4, 1100])
def test_grad_matches_torch(m):
    x, w, b = (
        torch.randn(m, 1024, dtype=torch.float64),
        torch.randn(1024, dtype=torch.float64),
        torch.randn(1024, dtype=torch.float64),
    )
    c = torch.randn(m, 1024, dtype=torch.float64)
    ours = grad(lambda t, v: (addnorm.layer_norm(t, 1024, v, b) * c).sum(), argnums=(0, 1))(x, w)
    theirs = grad(lambda t, v: (TF.layer_norm(t, (1024,), v, b) * c).sum(), argnums=(0, 1))(x, w)
    for a, e in zip(ours, theirs):
        torch.testing.assert_close(a, e)


def test_jacrev_matches_torch():
    x, r = torch.randn(3, 16, dtype=torch.float64), torch.randn(3, 16, dtype=torch.float64)
    w = torch.randn(16, dtype=torch.float64)
    ours = jacrev(lambda a, b: addnorm.add_rms_norm(a, b, 16, w, 1e-6), argnums=(0, 1))(x, r)
    theirs = jacrev(lambda a, b: TF.rms_norm(a + b, (16,), w, 1e-6), argnums=(0, 1))(x, r)
    for a, e in zip(ours, theirs):
        torch.testing.assert_close(a, e)


def test_jvp_and_forward_ad_match_torch():
    x, t = torch.randn(4, 32, dtype=torch.float64), torch.randn(4, 32, dtype=torch.float64)
    w, b = torch.randn(32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    ours = jvp(lambda a: addnorm.layer_norm(a, 32, w, b), (x,), (t,))
    theirs = jvp(lambda a: TF.layer_norm(a, (32,), w, b), (x,), (t,))
    for a, e in zip(ours, theirs):
        torch.testing.assert_close(a, e)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        y = addnorm.layer_norm(fwAD.make_dual(x, t), 32, w, b)
        torch.testing.assert_close(fwAD.unpack_dual(y).tangent, theirs[1])
