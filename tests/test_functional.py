"""Forward and backward of every functional op against torch's own ops in float64."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as TF

import addnorm
from addnorm import backend as backends
from conftest import DTYPES, assert_matches_oracle, interpreted

ROWS = [0, 1, 37, 199]
WIDTHS = [3, 1023, 3000]


def torch_norm(s, shape, weight, bias, eps, rms):
    """torch's own norm (an independent oracle when run in float64)."""
    if rms:
        return TF.rms_norm(s, shape, weight, eps)
    return TF.layer_norm(s, shape, weight, bias, eps)


def make(rows, n, dtype, *, affine=True, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g, dtype=torch.float64) * 2 + 0.5
    r = torch.randn(rows, n, generator=g, dtype=torch.float64)
    w = torch.randn(n, generator=g, dtype=torch.float64) if affine else None
    b = torch.randn(n, generator=g, dtype=torch.float64) if affine and bias else None
    cast = lambda t: None if t is None else t.to(dtype)
    return cast(x), cast(r), cast(w), cast(b)


def call(x, r, w, b, *, rms, eps, backend, prenorm=False, residual_dtype=None):
    n = x.shape[-1]
    if r is None:
        if rms:
            return addnorm.rms_norm(x, n, w, eps, backend=backend)
        return addnorm.layer_norm(x, n, w, b, eps, backend=backend)
    if rms:
        return addnorm.add_rms_norm(x, r, n, w, eps, prenorm=prenorm, residual_dtype=residual_dtype, backend=backend)
    return addnorm.add_layer_norm(x, r, n, w, b, eps, prenorm=prenorm, residual_dtype=residual_dtype, backend=backend)


CASES = [
    pytest.param(*case, marks=pytest.mark.large) if case[0] > 100 else case
    for case in itertools.product(ROWS, WIDTHS, DTYPES, [False, True], [False, True])
]


@pytest.mark.parametrize("rows,n,dtype,rms,residual", CASES)
def test_forward_backward_match_torch(backend, rows, n, dtype, rms, residual):
    eps = 1e-5
    x, r, w, b = make(rows, n, dtype, bias=not rms)
    if not residual:
        r = None
    leaves = [t.requires_grad_() for t in (x, r, w, b) if t is not None]
    y = call(x, r, w, b, rms=rms, eps=eps, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape

    # fp64 oracle: torch's own op on the fp64 copy, with autograd for the gradients.
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    x64, *rest = leaves64
    r64 = rest.pop(0) if r is not None else None
    w64, b64 = (rest + [None, None])[:2]
    s64 = x64 + r64 if r64 is not None else x64
    y64 = torch_norm(s64, (n,), w64, b64, eps, rms)
    # torch in the same dtype, for the low-precision error budget.
    leaves_t = [t.detach().clone().requires_grad_() for t in leaves]
    xt, *rest_t = leaves_t
    rt = rest_t.pop(0) if r is not None else None
    wt, bt = (rest_t + [None, None])[:2]
    yt = torch_norm(xt + rt if rt is not None else xt, (n,), wt, bt, eps, rms)
    assert_matches_oracle(y, y64.detach(), yt.detach())

    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(y, leaves, dy.to(dtype))
    grads64 = torch.autograd.grad(y64, leaves64, dy)
    grads_t = torch.autograd.grad(yt, leaves_t, dy.to(dtype))
    for leaf, ours, ref, same in zip(leaves, grads, grads64, grads_t):
        assert ours.dtype == leaf.dtype
        if not rows:  # no rows: the weight's and bias's gradients are sums of nothing
            assert torch.equal(ours, torch.zeros_like(leaf))
        assert_matches_oracle(ours, ref, same, scale=max(1.0, rows**0.5) if leaf.dim() == 1 else 1.0)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("residual,prenorm", [(False, False), (True, False), (True, True)])
def test_gradcheck_float64(backend, rms, affine, bias, residual, prenorm):
    x, r, w, b = make(5, 7, torch.float64, affine=affine, bias=bias and not rms)
    args = [t.requires_grad_() for t in (x, r if residual else None, w, b) if t is not None]

    def f(*leaves):
        it = iter(leaves)
        x = next(it)
        r = next(it) if residual else None
        w = next(it) if affine else None
        b = next(it) if affine and bias and not rms else None
        out = call(x, r, w, b, rms=rms, eps=1e-5, backend=backend, prenorm=prenorm)
        return out  # both outputs of prenorm carry gradient

    # fast_mode (random projections of the Jacobian) keeps interpreted backends to seconds.
    assert torch.autograd.gradcheck(f, args, fast_mode=interpreted(backend))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True])
def test_backward_from_x_and_residual_is_backward_from_the_stream(backend, dtype, rms):
    """The backward contract's ``residual=``: from the saved ``x`` and ``residual`` the stream is
    recomputed bit for bit, so every gradient is the one computed from the forward's ``s``."""
    impl = backends.resolve(backend, torch.empty(1, 4))
    x, r, w, b = make(37, 1023, dtype)
    x = x * 64 + 1000  # rounding in the sum matters: a recomputed stream must round the same way
    if rms:
        b = None
    _, s, mean, rstd = impl.forward(x, r, w, b, eps=1e-5, rms=rms, residual_dtype=None)
    dy = make(37, 1023, dtype, seed=1)[0]
    from_stream = impl.backward(dy, None, (s,), w, mean, rstd, rms=rms, has_bias=b is not None)
    from_inputs = impl.backward(dy, None, (x, r), w, mean, rstd, rms=rms, has_bias=b is not None)
    for a, c in zip(from_stream, from_inputs):
        assert (a is None and c is None) or torch.equal(a, c)
    with pytest.raises(ValueError, match=r"s_parts=\(x, residual\) in backward need one shape and dtype"):
        impl.backward(
            dy,
            None,
            (x, r.double() if dtype != torch.float64 else r.float()),
            w,
            mean,
            rstd,
            rms=rms,
            has_bias=b is not None,
        )


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [37, 300])  # one block; several blocks (and threads) on the CPU
def test_backward_returns_weight_grads_in_param_dtype(backend, param_dtype, rows):
    """``param_dtype``: dweight and dbias come back in the parameters' dtype, rounded once from
    the sums in the statistics dtype: bit for bit the conversion of what comes back without it."""
    impl = backends.resolve(backend, torch.empty(1, 4))
    x, r, w, b = make(rows, 512, torch.bfloat16)
    w, b = w.to(param_dtype), b.to(param_dtype)
    _, s, mean, rstd = impl.forward(x, r, w, b, eps=1e-5, rms=False, residual_dtype=None)
    dy = make(rows, 512, torch.bfloat16, seed=1)[0]
    plain = impl.backward(dy, None, (s,), w, mean, rstd, rms=False, has_bias=True)
    rounded = impl.backward(dy, None, (s,), w, mean, rstd, rms=False, has_bias=True, param_dtype=param_dtype)
    assert plain.dweight.dtype == plain.dbias.dtype == torch.float32
    assert rounded.dweight.dtype == rounded.dbias.dtype == param_dtype
    assert torch.equal(rounded.dweight, plain.dweight.to(param_dtype))
    assert torch.equal(rounded.dbias, plain.dbias.to(param_dtype))
    assert torch.equal(rounded.ds, plain.ds)
    no_bias = impl.backward(dy, None, (s,), w, mean, rstd, rms=False, has_bias=False, param_dtype=param_dtype)
    assert no_bias.dbias is None and torch.equal(no_bias.dweight, rounded.dweight)


@pytest.mark.parametrize("rms", [False, True])
def test_prenorm_returns_normed_and_stream(backend, rms):
    x, r, w, b = make(6, 16, torch.float32, bias=not rms)
    y, s = call(x, r, w, b, rms=rms, eps=1e-5, backend=backend, prenorm=True)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, torch_norm(x + r, (16,), w, b, 1e-5, rms))
    post = call(x, r, w, b, rms=rms, eps=1e-5, backend=backend)
    torch.testing.assert_close(post, y, rtol=0, atol=0)


@pytest.mark.parametrize("rms", [False, True])
def test_residual_dtype_keeps_stream_in_fp32(backend, rms):
    x, r, w, b = make(8, 64, torch.float32, bias=not rms)
    xb = x.bfloat16()
    y, s = call(xb, r, w, b, rms=rms, eps=1e-5, backend=backend, prenorm=True, residual_dtype=torch.float32)
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32
    s64 = xb.double() + r.double()
    torch.testing.assert_close(s.double(), s64, rtol=1e-6, atol=1e-6)
    ref = torch_norm(s64, (64,), w.double(), None if b is None else b.double(), 1e-5, rms)
    torch.testing.assert_close(y.double(), ref, rtol=1.6e-2, atol=1e-2)
    xb.requires_grad_()
    r.requires_grad_()
    y, s = call(xb, r, w, b, rms=rms, eps=1e-5, backend=backend, prenorm=True, residual_dtype=torch.float32)
    dx, dr = torch.autograd.grad((y.float().sum() + s.sum()), (xb, r))
    assert dx.dtype == torch.bfloat16 and dr.dtype == torch.float32


def test_multi_dim_normalized_shape(backend):
    """The seeds normalize an [S, B, E] tensor over its last two dims."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4, 6, generator=g)
    w, b = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    y = addnorm.layer_norm(x, (4, 6), w, b, backend=backend)
    torch.testing.assert_close(y, TF.layer_norm(x, (4, 6), w, b))
    y = addnorm.rms_norm(x, (4, 6), w, backend=backend)
    torch.testing.assert_close(y, TF.rms_norm(x, (4, 6), w))


@pytest.mark.parametrize("view", ["transpose", "step_slice", "expand"])
def test_non_contiguous_inputs(backend, view):
    g = torch.Generator().manual_seed(4)
    base = torch.randn(32, 48, generator=g)
    x = {"transpose": base.t()[:, :32], "step_slice": base[::2, ::2], "expand": base[:1].expand(5, 48)}[view]
    n = x.shape[-1]
    w = torch.randn(n, generator=g)
    r = torch.randn(x.shape, generator=g)
    torch.testing.assert_close(addnorm.layer_norm(x, n, w, backend=backend), TF.layer_norm(x, (n,), w))
    torch.testing.assert_close(addnorm.add_rms_norm(x, r, n, w, backend=backend), TF.rms_norm(x + r, (n,), w))


def test_large_mean_offset_no_less_accurate_than_torch(backend):
    """Rows of 1e4 + N(0, 1) in float32: two-pass statistics keep the error at torch's level."""
    g = torch.Generator().manual_seed(5)
    x64 = 1e4 + torch.randn(64, 1024, generator=g, dtype=torch.float64)
    x = x64.float()
    oracle = TF.layer_norm(x.double(), (1024,))
    ours = (addnorm.layer_norm(x, 1024, backend=backend).double() - oracle).abs().max()
    theirs = (TF.layer_norm(x, (1024,)).double() - oracle).abs().max()
    assert ours <= theirs * 1.5 + 1e-6, (ours, theirs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_statistics_are_fp32_or_fp64(dtype):
    from addnorm.kernels import torch as torch_kernels

    x = torch.randn(4, 8).to(dtype)
    y, s, mean, rstd = torch_kernels.forward(x, None, None, None, eps=1e-5, rms=False, residual_dtype=None)
    expected = torch.float64 if dtype == torch.float64 else torch.float32
    assert mean.dtype == expected and rstd.dtype == expected and y.dtype == dtype


def test_rms_default_eps_is_machine_epsilon(backend):
    x = torch.full((2, 4), 1e-4).bfloat16()
    torch.testing.assert_close(addnorm.rms_norm(x, 4, backend=backend), TF.rms_norm(x, (4,)))


@pytest.mark.parametrize("how", ["float64 residual", "residual_dtype=float64"])
def test_rms_default_eps_is_that_of_the_stream(backend, how):
    """add_rms_norm normalizes the stream: eps=None is the stream dtype's machine epsilon, as
    torch's rms_norm of the stream (rows of 1e-5, where float32's epsilon would dominate)."""
    g = torch.Generator().manual_seed(2)
    x, r = (torch.randn(3, 16, generator=g, dtype=torch.float64) * 1e-5 for _ in range(2))
    if how == "float64 residual":
        y = addnorm.add_rms_norm(x.float(), r, 16, backend=backend)
        s = x.float().double() + r
    else:
        y = addnorm.add_rms_norm(x.float(), r.float(), 16, residual_dtype=torch.float64, backend=backend)
        s = x.float().double() + r.float().double()
    torch.testing.assert_close(y, TF.rms_norm(s, (16,)).float())
