"""The shortest route (addnorm.shortcut): plain calls without gradients go straight to the cpu
backend's plain_forward, plain calls that take gradients straight to the training Function, each
with the bits of the general route; every other call takes that route."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as TF

import addnorm
from addnorm import backend as backends
from addnorm import shortcut
from addnorm.kernels import cpu
from addnorm.kernels.cpu import config

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.fixture
def taken(monkeypatch):
    """The calls the cpu backend's plain_forward ran (not declined), counted."""
    ran = []
    original = cpu.plain_forward

    def counting(*args):
        result = original(*args)
        ran.append(result is not None)
        return result

    counting.__module__ = cpu.__name__  # (a plain_forward is taken from its forward's module alone)
    monkeypatch.setattr(cpu, "plain_forward", counting)
    addnorm.layer_norm(torch.randn(2, 8), 8)  # "auto" has chosen its cpu backend
    ran.clear()
    return ran


@pytest.fixture
def trained(monkeypatch):
    """The training calls the shortcut handed to the training Function, counted."""
    ran = []
    original = shortcut._training

    def counting(*args):
        ran.append(True)
        return original(*args)

    monkeypatch.setattr(shortcut, "_training", counting)
    return ran


def _oracle(x, residual, n, weight, bias, eps, rms):
    """float64 torch ops: the stream rounded to its dtype, as every addnorm path rounds it."""
    s = x if residual is None else x + residual
    w = None if weight is None else weight.double()
    if rms:
        return TF.rms_norm(s.double(), (n,), w, eps), s
    return TF.layer_norm(s.double(), (n,), w, None if bias is None else bias.double(), eps), s


def _call(op, x, residual, n, weight, bias, prenorm, **kw):
    if op == "layer_norm":
        return addnorm.layer_norm(x, n, weight, bias, **kw)
    if op == "rms_norm":
        return addnorm.rms_norm(x, n, weight, **kw)
    if op == "add_layer_norm":
        return addnorm.add_layer_norm(x, residual, n, weight, bias, prenorm=prenorm, **kw)
    return addnorm.add_rms_norm(x, residual, n, weight, prenorm=prenorm, **kw)


CALLS = [
    ("layer_norm", False),
    ("rms_norm", False),
    ("add_layer_norm", False),
    ("add_layer_norm", True),
    ("add_rms_norm", False),
    ("add_rms_norm", True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op, prenorm", CALLS)
@pytest.mark.parametrize("shape", [(768,), (1, 768), (8, 768), (2, 3, 1000), (5, 3)])
@pytest.mark.parametrize("affine", [True, False])
def test_plain_calls_take_the_shortcut_with_the_general_routes_bits(taken, dtype, op, prenorm, shape, affine):
    g = torch.Generator().manual_seed(sum(shape))
    n = shape[-1]
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 4 + 300).to(dtype)
    residual = torch.randn(shape, generator=g).to(dtype) if op.startswith("add") else None
    weight = torch.randn(n, generator=g).to(dtype) if affine else None
    bias = torch.randn(n, generator=g).to(dtype) if affine and "layer" in op else None
    with torch.no_grad():
        got = _call(op, x, residual, n, weight, bias, prenorm)
        general = _call(op, x, residual, n, weight, bias, prenorm, backend="cpu")  # (never the shortcut)
    assert taken == [True]
    got, general = (got, general) if prenorm else ((got,), (general,))
    for ours, theirs in zip(got, general):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    eps = 1e-5 if "layer" in op else torch.finfo(torch.float64 if dtype is torch.float64 else torch.float32).eps
    want, s = _oracle(x, residual, n, weight, bias, eps, "rms" in op)
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got[0].double(), want, rtol=tol, atol=tol)
    if prenorm:
        assert torch.equal(got[1], s)


GRADS = {"all": (0, 1, 2, 3), "x": (0,), "weight": (2,), "residual and bias": (1, 3)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op, prenorm", CALLS)
@pytest.mark.parametrize("shape", [(8, 768), (2, 3, 100), (5, 3), (86, 768)])  # (the last past one thread)
@pytest.mark.parametrize("wanted", GRADS)
def test_training_calls_take_the_shortcut_with_the_general_routes_bits(trained, dtype, op, prenorm, shape, wanted):
    """A plain call that takes gradients goes straight to the training Function: its outputs and
    every gradient (of y, and of s with pre-norm) the bits of the general route, whichever inputs
    require grad."""
    g = torch.Generator().manual_seed(sum(shape) + len(wanted))
    n = shape[-1]
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 4 + 300).to(dtype)
    residual = torch.randn(shape, generator=g).to(dtype) if op.startswith("add") else None
    weight = torch.randn(n, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if "layer" in op else None
    dy, ds = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    results = []
    for kw in ({}, {"backend": "cpu"}):  # the shortcut, then the general route (never the shortcut)
        inputs = [None if t is None else t.clone() for t in (x, residual, weight, bias)]
        leaves = [inputs[i] for i in GRADS[wanted] if inputs[i] is not None]
        for t in leaves:
            t.requires_grad_()
        out = _call(op, *inputs[:2], n, *inputs[2:], prenorm, **kw)
        out = out if prenorm else (out,)
        grads = torch.autograd.grad(out, leaves, (dy, ds)[: len(out)]) if leaves else ()
        results.append((out, grads))
    assert trained == ([True] if leaves else [])  # (none of the inputs there: a call without gradients)
    (got, got_grads), (general, general_grads) = results
    for ours, theirs in zip((*got, *got_grads), (*general, *general_grads), strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_training_on_the_shortcut_differentiates_twice_as_the_general_route(trained):
    """``create_graph=True`` through a call on the shortcut: the second derivative is the general
    route's, and matches torch's own norm's in float64."""
    g = torch.Generator().manual_seed(5)
    x, r, w, b = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((3, 16), (3, 16), (16,), (16,)))
    results = []
    for kw in ({}, {"backend": "cpu"}, None):
        leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
        if kw is None:  # torch's own ops
            y = TF.layer_norm(leaves[0] + leaves[1], (16,), leaves[2], leaves[3])
        else:
            y = addnorm.add_layer_norm(*leaves[:2], 16, *leaves[2:], **kw)
        (dx,) = torch.autograd.grad((y * y.sin()).sum(), leaves[0], create_graph=True)
        results.append(torch.autograd.grad(dx.pow(2).sum(), leaves))
    assert trained == [True]
    for ours, general, torchs in zip(*results, strict=True):
        assert torch.equal(ours, general)
        torch.testing.assert_close(ours, torchs)


def test_an_unused_output_on_the_shortcut_gives_the_general_routes_gradients(trained):
    """Pre-norm with only the stream used: no gradient for the weight and bias (None), as the
    general route and torch's norms give."""
    x, r, w, b = (torch.randn(*s) for s in ((4, 32), (4, 32), (32,), (32,)))
    results = []
    for kw in ({}, {"backend": "cpu"}):
        leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
        _, s = addnorm.add_layer_norm(*leaves[:2], 32, *leaves[2:], prenorm=True, **kw)
        results.append(torch.autograd.grad(s.sum(), leaves, allow_unused=True))
    assert trained == [True]
    for ours, theirs in zip(*results, strict=True):
        assert (ours is None and theirs is None) or torch.equal(ours, theirs)
    assert results[0][2] is None and results[0][3] is None


def test_a_residual_made_in_inference_mode_is_saved_as_by_the_general_route(trained):
    """A residual made under ``torch.inference_mode`` cannot be saved for backward: the shortcut's
    training call saves a copy (post-norm saves x and the residual), as EagerAddNorm does, with
    the general route's bits."""
    with torch.inference_mode():
        r = torch.randn(4, 32)
    x, w, dy = torch.randn(4, 32), torch.randn(32), torch.randn(4, 32)
    results = []
    for kw in ({}, {"backend": "cpu"}):
        leaf = x.clone().requires_grad_()
        y = addnorm.add_layer_norm(leaf, r, 32, w, prenorm=False, **kw)
        results.append((y, *torch.autograd.grad(y, leaf, dy)))
    assert trained == [True]
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_module_calls_in_inference_take_the_shortcut(taken):
    norm, add = addnorm.LayerNorm(64), addnorm.AddNorm(64, norm="rms", prenorm=True)
    x, r = torch.randn(3, 64), torch.randn(3, 64)
    with torch.inference_mode():
        y = norm(x)
        z, s = add(x, r)
    assert taken == [True, True]
    torch.testing.assert_close(y, TF.layer_norm(x, (64,), norm.weight, norm.bias))
    torch.testing.assert_close(s, x + r, rtol=0, atol=0)
    torch.testing.assert_close(z, TF.rms_norm(x + r, (64,), add.norm.weight, torch.finfo(torch.float32).eps))


def test_calls_with_options_take_the_general_route(taken, trained):
    x, r, w, b = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32), torch.randn(32)
    leaf = w.clone().requires_grad_()
    y = addnorm.add_layer_norm(x, r, 32, leaf, b, dropout_p=0.1)  # a gradient to record, and an option
    assert y.grad_fn is not None and trained == []
    with torch.no_grad():
        addnorm.add_layer_norm(x, r, 32, w, b, residual_dtype=torch.float64)
        addnorm.add_layer_norm(x, r, 32, w, b, dropout_p=0.1)
        addnorm.layer_norm(x, 32, w, b, out=torch.empty_like(x))
        addnorm.layer_norm(x, 32, w.double(), b)  # parameters of another dtype
        addnorm.layer_norm(x.view(2, 2, 32), (2, 32), w.repeat(2).view(2, 32))  # two normalized dims
        addnorm.layer_norm(x, 32, w, b, backend="reference")
    assert taken == []


def test_declined_calls_keep_their_bits(taken):
    """Strided rows and calls past the one-thread threshold: the backend declines them, the general
    route runs them."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(config.SETTINGS.parallel_min_elements // 512 + 7, 512, generator=g)
    strided = torch.randn(64, 9, generator=g).t()
    with torch.no_grad():
        for x in (big, strided):
            n = x.shape[-1]
            w = torch.randn(n, generator=g)
            got = addnorm.layer_norm(x, n, w)
            assert torch.equal(got, addnorm.layer_norm(x, n, w, backend="cpu"))
            torch.testing.assert_close(got.double(), TF.layer_norm(x.double(), (n,), w.double()), rtol=2e-6, atol=2e-5)
    assert taken == [False, False]


def test_bad_input_is_reported_as_before():
    x = torch.randn(4, 16)
    with torch.no_grad():
        with pytest.raises(ValueError, match="normalized_shape"):
            addnorm.layer_norm(x, 8)
        with pytest.raises(ValueError, match="residual must have the shape of x"):
            addnorm.add_layer_norm(x, x[:2], 16)
        with pytest.raises(ValueError, match="eps"):
            addnorm.layer_norm(x, 16, eps=-1.0)
        with pytest.warns(UserWarning, match="normalizing over 2 feature"):
            addnorm.layer_norm(torch.randn(3, 2), 2)


def test_a_registered_auto_backend_without_it_runs_its_own_forward():
    """The shortcut asks the backend "auto" runs: one registered for the CPU runs its forward."""
    import toy_backend

    backends.register("toy_plain", toy_backend, device_types_for_auto=("cpu",))
    try:
        calls = toy_backend.calls
        before = calls["forward"]
        with torch.no_grad():
            addnorm.layer_norm(torch.randn(2, 8), 8)
        assert calls["forward"] == before + 1
        x = torch.randn(2, 8, requires_grad=True)  # a training call on the shortcut: its forward and backward
        addnorm.add_rms_norm(x, torch.randn(2, 8), 8, prenorm=True)[0].sum().backward()
        assert calls["forward"] == before + 2 and x.grad is not None
    finally:
        backends.unregister("toy_plain")


def test_a_backend_reexporting_the_cpu_backend_runs_its_own_forward(monkeypatch):
    """A backend made of the cpu backend's functions (``import *``) with a forward of its own:
    "auto" runs that forward, never the cpu backend's shortcut beside it."""
    import types

    mine = types.ModuleType("my_cpu_backend")
    mine.__dict__.update({k: v for k, v in vars(cpu).items() if not k.startswith("_")})  # (as import *)
    seen = []

    @functools.wraps(cpu.forward)  # (its __module__ then names the cpu backend's)
    def forward(x, residual, weight, bias, **kwargs):
        seen.append(tuple(x.shape))
        return cpu.forward(x, residual, weight, bias, **kwargs)

    mine.forward = forward
    assert mine.plain_forward is cpu.plain_forward
    backends.register("mine_reexported", mine, device_types_for_auto=("cpu",))
    try:
        with torch.no_grad():
            for _ in range(3):
                addnorm.layer_norm(torch.randn(2, 8), 8)
        assert seen == [(2, 8)] * 3
    finally:
        backends.unregister("mine_reexported")


def test_a_torch_function_mode_sees_the_general_routes_calls(taken):
    """A ``__torch_function__`` mode sees the torch functions a call makes: under one, calls take
    the general route (its checks, ``check_inputs``, among what the mode sees)."""
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    x, r = torch.randn(2, 8), torch.randn(2, 8)
    with torch.no_grad(), Seen() as mode:
        y, s = addnorm.add_layer_norm(x, r, 8, prenorm=True)
    assert taken == [] and "dim" in mode.seen
    torch.testing.assert_close(s, x + r, rtol=0, atol=0)
    torch.testing.assert_close(y, TF.layer_norm(x + r, (8,)))


def test_the_kernel_entry_is_asked_for_by_name(taken, monkeypatch):
    """The shortcut asks for the forward's kernel entry as forward does, its flags by name (what
    code observing the entries reads)."""
    asked, entry = [], cpu.forward_entry
    monkeypatch.setattr(cpu, "forward_entry", lambda *a, **k: asked.append(k["streamed"]) or entry(*a, **k))
    with torch.no_grad():
        addnorm.rms_norm(torch.randn(3, 16), 16)
    assert taken == [True] and asked == [False]


@pytest.mark.parametrize("default", ["cpu", "meta"])
def test_a_default_device_keeps_the_shortcut(taken, default):
    """``torch.set_default_device`` and ``with torch.device(...)`` install a ``__torch_function__``
    mode that only gives a device to factory calls naming none: plain calls keep the shortcut,
    with the general route's bits, their results on the inputs' device (a "meta" default would
    catch a factory call on the route that names no device)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x, r, w = (torch.randn(*s, generator=g, device="cpu") for s in ((4, 64), (4, 64), (64,)))
    previous = torch.get_default_device()
    with torch.no_grad():
        want = addnorm.add_layer_norm(x, r, 64, w, prenorm=True, backend="cpu")  # (never the shortcut)
        with torch.device(default):
            in_context = addnorm.add_layer_norm(x, r, 64, w, prenorm=True)
        torch.set_default_device(default)
        try:
            by_default = addnorm.add_layer_norm(x, r, 64, w, prenorm=True)
        finally:
            torch.set_default_device(previous)
    assert taken == [True, True]
    for got in (in_context, by_default):
        assert all(a.device.type == "cpu" and torch.equal(a, b) for a, b in zip(got, want, strict=True))
