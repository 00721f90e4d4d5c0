"""The backend contract from outside: register() and the conformance check of addnorm.testing.

Every backend of the package passes ``check_backend``; a backend registered from outside the
package runs through every public function; and the check fails, saying what failed, on a
backend whose output is off by 1e-3, one that computes the variance as E[x²] − E[x]², and one
that loses the dropout mask.
"""

from __future__ import annotations

import types

import pytest
import torch

import addnorm
import toy_backend
from addnorm import backend as backends
from addnorm import reference
from addnorm.kernels import torch as formulas
from addnorm.testing import check_backend
from conftest import TEST_DEVICE, usable_backends


@pytest.mark.parametrize("name", usable_backends())
def test_every_backend_of_the_package_passes_the_conformance_check(name):
    dtypes = (torch.float32, torch.bfloat16) if name == "triton" and TEST_DEVICE.type == "cpu" else None
    check_backend(name, device=TEST_DEVICE, **({"dtypes": dtypes} if dtypes else {}))


@pytest.fixture
def registered():
    """Register backends for one test, and remove them after it."""
    names = []

    def register(name, module, **kwargs):
        backends.register(name, module, **kwargs)
        names.append(name)

    yield register
    for name in names:
        backends.unregister(name)


def _variant(name: str, **functions) -> types.ModuleType:
    """The reference backend as a module of its own, with some functions replaced."""
    module = types.ModuleType(name)
    module.CAPABILITIES = backends.Capabilities(device_types=None)
    module.unavailable_reason = lambda x: None
    module.forward, module.backward = formulas.forward, formulas.backward
    for key, fn in functions.items():
        setattr(module, key, fn)
    return module


@pytest.mark.parametrize("bad", [True, torch.float32, ("float32",), [torch.float32]])
def test_recomputes_stream_names_the_stream_dtypes(bad):
    """``recomputes_stream`` is a tuple of dtypes (it was a bool): anything else is refused when
    the backend declares it, not when a training step first reads it."""
    with pytest.raises(TypeError, match=r"recomputes_stream takes a tuple of torch dtypes .*got"):
        backends.Capabilities(device_types=None, recomputes_stream=bad)
    assert backends.Capabilities(device_types=None, recomputes_stream=(torch.bfloat16,)).recomputes_stream == (
        torch.bfloat16,
    )


@pytest.mark.usefixtures("on_cpu")  # the toy backend runs on CPU tensors alone
def test_a_backend_registered_from_outside_runs_every_public_function(registered):
    registered("toy", "toy_backend")
    assert "toy" in backends.names()
    before = dict(toy_backend.calls)
    x, r = torch.randn(6, 32, requires_grad=True), torch.randn(6, 32)
    ln = addnorm.LayerNorm(32, backend="toy")
    y, s = addnorm.add_layer_norm(ln(x), r, 32, ln.weight, ln.bias, prenorm=True, backend="toy")
    (y.sum() + s.sum()).backward()
    assert toy_backend.calls["forward"] == before["forward"] + 2
    assert toy_backend.calls["backward"] == before["backward"] + 2
    expected = torch.nn.functional.layer_norm(x.detach(), (32,))
    torch.testing.assert_close(ln(x).detach(), expected)
    check_backend("toy")


@pytest.mark.usefixtures("on_cpu")  # registered for CPU tensors: the test's tensors are on the CPU
def test_auto_picks_a_backend_registered_for_the_device_type_until_it_is_unregistered(registered):
    registered("toy_auto", "toy_backend", device_types_for_auto=("cpu",))
    before = toy_backend.calls["forward"]
    addnorm.layer_norm(torch.randn(2, 8), 8)
    assert toy_backend.calls["forward"] == before + 1
    backends.unregister("toy_auto")
    assert backends.auto_name(torch.empty(1)) == "cpu"
    backends.register("toy_auto", "toy_backend")  # (the fixture unregisters it again)


def test_a_y_off_by_1e_3_fails_the_check(registered):
    def forward(*args, **kwargs):
        y, s, mean, rstd = formulas.forward(*args, **kwargs)
        return y + 1e-3, s, mean, rstd

    registered("off", _variant("off", forward=forward))
    with pytest.raises(AssertionError, match=r"(?s)backend 'off' failed .*float32 normal 37x256 layer: forward y"):
        check_backend("off")


def test_the_textbook_variance_fails_the_check_on_rows_far_from_zero(registered):
    def forward(x, residual, weight, bias, *, eps, rms, residual_dtype, **kwargs):
        s = reference.stream(x, residual, residual_dtype)
        sf = s.float() if s.dtype != torch.float64 else s
        mean = sf.mean(-1, keepdim=True)
        var = (sf * sf).mean(-1, keepdim=True) - mean * mean  # E[x²] − E[x]²: cancels far from zero
        rstd = torch.rsqrt(var.clamp(min=0) + eps)
        y = (sf - mean) * rstd
        y = y * weight if weight is not None else y
        y = y + bias if bias is not None else y
        return y.to(x.dtype), (s if residual is not None else None), mean[:, 0], rstd[:, 0]

    registered("textbook", _variant("textbook", forward=forward))
    with pytest.raises(AssertionError, match=r"float32 offset 9x1000 layer: forward y"):
        check_backend("textbook", dtypes=(torch.float32,))


def _two_d_only(x, *args, **kwargs):
    rows, cols = x.shape  # noqa: F841 (a backend that takes 2-D rows alone)
    return formulas.forward(x, *args, **kwargs)


def _fixed_eps(*args, eps, **kwargs):
    return formulas.forward(*args, eps=1e-5, **kwargs)


def _stream_in_x_dtype(*args, residual_dtype, **kwargs):
    return formulas.forward(*args, residual_dtype=None, **kwargs)


def _contiguous_strides(x, *args, **kwargs):  # reads x's memory as if it were contiguous
    return formulas.forward(torch.as_strided(x, x.shape, torch.empty(x.shape).stride()), *args, **kwargs)


def _stats_in_float64(*args, **kwargs):
    y, s, mean, rstd = formulas.forward(*args, **kwargs)
    return y, s, None if mean is None else mean.double(), rstd


def _ds_in_float32(*args, **kwargs):
    g = formulas.backward(*args, **kwargs)
    return g._replace(ds=g.ds.float())


def _stream_not_recomputed(dy, dstream, s_parts, *args, **kwargs):  # takes (x, residual) for (s,)
    return formulas.backward(dy, dstream, s_parts[:1], *args, **kwargs)


@pytest.mark.parametrize(
    "functions, recomputes, match",
    [
        ({"forward": _two_d_only}, (), r"calls as addnorm makes them: raised ValueError"),
        ({"forward": _fixed_eps}, (), r"strided, eps=0.1, residual_dtype=None: forward y"),
        ({"forward": _stream_in_x_dtype}, (), r"residual_dtype=torch.float32: forward s = x.to\(torch.float32\)"),
        ({"forward": _contiguous_strides}, (), r"\(2, 3, 64\) strided, .*: forward y"),
        ({"forward": _stats_in_float64}, (), r"strided, .*: mean is torch.float64"),
        ({"backward": _ds_in_float32}, (), r"bfloat16 normal 37x256 layer: backward ds is torch.float32, expected"),
        ({"backward": _stream_not_recomputed}, (torch.float32,), r"backward from \(x, residual\): ds"),
    ],
    ids=["2-D only", "eps fixed", "residual_dtype ignored", "strides ignored", "float64 mean", "float32 ds",
         "stream not recomputed"],
)  # fmt: skip
def test_what_addnorm_hands_a_backend_is_checked(registered, functions, recomputes, match):
    """Leading dims, strides, eps, residual_dtype, the recomputed stream and the results' dtypes:
    a backend wrong in any of them fails the check, which names the case."""
    module = _variant("partial", **functions)
    module.CAPABILITIES = backends.Capabilities(device_types=None, recomputes_stream=recomputes)
    registered("partial", module)
    with pytest.raises(AssertionError, match=match):
        check_backend("partial", dtypes=(torch.float32, torch.bfloat16))


def test_a_dropout_mask_of_its_own_fails_the_check(registered):
    def forward(x, residual, weight, bias, *, branch=None, **kwargs):
        if branch is not None and branch.p > 0:  # torch's dropout instead of the documented hash
            gen = torch.Generator(x.device).manual_seed(int(branch.seed))
            keep = torch.rand(x.shape, generator=gen, device=x.device) >= branch.p
            x = torch.where(keep, x / (1 - branch.p), 0)
            branch = branch._replace(p=0.0)
        return formulas.forward(x, residual, weight, bias, branch=branch, **kwargs)

    registered("own_mask", _variant("own_mask", forward=forward))
    with pytest.raises(AssertionError, match=r"dropout: the kept elements are reference.keep_mask's"):
        check_backend("own_mask", dtypes=(torch.float32,))


def _two_norms(drop_dy1: bool = False) -> types.ModuleType:
    """The reference formulas with ``Capabilities.second_norm``: the second norm as a second call
    (``drop_dy1``: its gradient left out of ``ds``, as a broken fused backward would)."""

    def forward(x, residual, weight, bias, *, second=None, **kw):
        y, s, mean, rstd = formulas.forward(x, residual, weight, bias, **kw)
        if second is None:
            return y, s, mean, rstd
        stream = s if s is not None else x
        y1 = formulas.forward(stream, None, *second, **{**kw, "write_stream": False})[0]
        return y, s, mean, rstd, y1

    def backward(dy, dstream, s_parts, weight, mean, rstd, *, second=None, **kw):
        grads = formulas.backward(dy, dstream, s_parts, weight, mean, rstd, **kw)
        if second is None:
            return grads
        dy1, weight1, has_bias1 = second
        other = formulas.backward(dy1, None, s_parts, weight1, mean, rstd, **{**kw, "has_bias": has_bias1})
        ds = grads.ds if drop_dy1 else grads.ds + other.ds
        return grads._replace(ds=ds, dweight1=other.dweight, dbias1=other.dbias)

    module = _variant("two_norms", forward=forward, backward=backward)
    module.CAPABILITIES = backends.Capabilities(device_types=None, second_norm=True)
    return module


def test_the_check_covers_a_declared_second_norm(registered):
    """A backend declaring ``second_norm`` is checked on it: two norm calls pass, a backward
    that leaves dy1's term out of ds fails."""
    registered("two_norms", _two_norms())
    check_backend("two_norms", dtypes=(torch.float32,))
    registered("drops_dy1", _two_norms(drop_dy1=True))
    with pytest.raises(AssertionError, match=r"second norm: torch.float32 layer: backward ds"):
        check_backend("drops_dy1", dtypes=(torch.float32,))


def test_register_refuses_what_it_cannot_use(registered):
    with pytest.raises(TypeError, match=r"backend 'half' \(half\) does not implement backward"):
        registered("half", _variant("half", backward=None))
    for name in ("auto", "cpu"):
        with pytest.raises(ValueError, match="already registered"):
            backends.register(name, "toy_backend")
    with pytest.raises(ValueError, match="must be an identifier"):
        backends.register("my backend", "toy_backend")
    with pytest.raises(TypeError, match="module must be a module or its import path"):
        backends.register("nothing", 3)
    for bad in (3, "cpu", ("cpu", 0)):  # a bare string would be taken a letter at a time
        with pytest.raises(TypeError, match=r"device_types_for_auto takes a tuple of device type names"):
            backends.register("misfit", "toy_backend", device_types_for_auto=bad)
        assert "misfit" not in backends.REGISTRY  # refused before anything was registered
    with pytest.raises(TypeError, match=r"Capabilities.device_types takes a tuple of device type names"):
        backends.Capabilities(device_types="cpu")
    with pytest.raises(ValueError, match="built in"):
        backends.unregister("reference")
    with pytest.raises(ValueError, match="not registered"):
        backends.unregister("never")


def test_check_backend_names_an_unknown_backend():
    with pytest.raises(AssertionError, match="backend 'nope' is not registered"):
        check_backend("nope")


def test_check_backend_names_a_path_that_does_not_import(registered):
    registered("typo", "my_package_that_is_not_there.backend")
    with pytest.raises(AssertionError, match="backend 'typo' could not be imported: No module named"):
        check_backend("typo")
