"""The modules are drop-ins for torch's: constructor, parameters, state_dict, outputs."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from torch import nn

import addnorm


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"eps": 1e-6},
        {"elementwise_affine": False},
        {"bias": False},
        {"dtype": torch.float64},
    ],
)
@pytest.mark.parametrize("shape", [8, (3, 8)])
def test_layer_norm_is_a_drop_in(backend, shape, kwargs):
    theirs = nn.LayerNorm(shape, **kwargs)
    ours = addnorm.LayerNorm(shape, **kwargs, backend=backend)
    assert isinstance(ours, nn.LayerNorm)
    assert repr(ours) == repr(theirs)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    with torch.no_grad():  # random, non-trivial parameters
        for p in theirs.parameters():
            p.normal_()
    buf = io.BytesIO()
    torch.save(theirs.state_dict(), buf)
    buf.seek(0)
    ours.load_state_dict(torch.load(buf), strict=True)
    x = torch.randn(5, *theirs.normalized_shape, dtype=kwargs.get("dtype", torch.float32))
    torch.testing.assert_close(ours(x), theirs(x))
    if not kwargs.get("elementwise_affine", True):
        assert ours.weight is None and ours.bias is None
    if kwargs.get("bias") is False:
        assert ours.bias is None and "bias" not in dict(ours.named_parameters())


@pytest.mark.parametrize(
    "shape", [np.array([3, 8]), np.int64(8), torch.Size([8]), range(8, 9), [3, 8]], ids=lambda s: type(s).__name__
)
def test_normalized_shape_takes_what_torch_takes(shape):
    for ours, theirs in [(addnorm.LayerNorm, nn.LayerNorm), (addnorm.RMSNorm, nn.RMSNorm)]:
        assert ours(shape).normalized_shape == theirs(shape).normalized_shape
    assert addnorm.RMSNorm(n for n in (3, 8)).normalized_shape == (3, 8)  # (a generator, read once)


def test_a_zero_centred_weight_shows_in_the_repr():
    """Such a module scales by 1 + weight: loading a plain norm's checkpoint into it doubles the
    scale, so it must not print as a plain one."""
    for cls in (addnorm.LayerNorm, addnorm.RMSNorm):
        assert repr(cls(16, zero_centered_weight=True)) == repr(cls(16))[:-1] + ", zero_centered_weight=True)"


@pytest.mark.parametrize("kwargs", [{}, {"eps": 1e-6}, {"elementwise_affine": False}])
def test_rms_norm_is_a_drop_in(backend, kwargs):
    theirs = nn.RMSNorm(16, **kwargs)
    ours = addnorm.RMSNorm(16, **kwargs, backend=backend)
    assert isinstance(ours, nn.RMSNorm)
    assert repr(ours) == repr(theirs)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(4, 7, 16)
    torch.testing.assert_close(ours(x), theirs(x))


def test_reset_parameters_restores_init():
    m = addnorm.LayerNorm(6)
    with torch.no_grad():
        m.weight.fill_(3.0)
        m.bias.fill_(2.0)
    m.reset_parameters()
    assert torch.equal(m.weight, torch.ones(6)) and torch.equal(m.bias, torch.zeros(6))


@pytest.mark.parametrize(
    "make",
    [
        lambda: addnorm.LayerNorm(6),
        lambda: addnorm.RMSNorm(6, zero_centered_weight=True),
        lambda: addnorm.AddNorm(6, layer_scale=True, layer_scale_init=0.1),
        lambda: addnorm.AddNorm(6, norm="rms", zero_centered_weight=True, layer_scale=True),
    ],
    ids=["LayerNorm", "RMSNorm zero-centred", "AddNorm layer scale", "AddNorm rms zero-centred"],
)
def test_made_on_the_meta_device_then_reset_as_made(make):
    """FSDP2's way to build a large model: on the meta device, then to_empty() (memory holding
    anything) and reset_parameters() of each module that has one: the parameters as made."""
    want = make().state_dict()
    with torch.device("meta"):
        model = torch.nn.Sequential(make())
    model.to_empty(device=next(iter(want.values())).device)
    for p in model.parameters():
        p.detach().fill_(-7.0)  # what uninitialised memory may hold
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    got = model[0].state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), got


def test_module_gradients_match_torch(backend):
    torch.manual_seed(0)
    theirs = nn.LayerNorm(32)
    ours = addnorm.LayerNorm(32, backend=backend)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(10, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    (theirs(x) ** 2).sum().backward()
    (ours(x2) ** 2).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad)
    torch.testing.assert_close(ours.bias.grad, theirs.bias.grad)


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("prenorm", [False, True])
def test_add_norm_module(backend, norm, prenorm):
    torch.manual_seed(1)
    m = addnorm.AddNorm(24, norm=norm, prenorm=prenorm, backend=backend)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    x, r = torch.randn(3, 5, 24), torch.randn(3, 5, 24)
    out = m(x, r)
    if norm == "layer":
        expected = TF.layer_norm(x + r, (24,), m.norm.weight, m.norm.bias, 1e-5)
    else:
        expected = TF.rms_norm(x + r, (24,), m.norm.weight, None)
    if prenorm:
        y, s = out
        torch.testing.assert_close(s, x + r)
    else:
        y = out
    torch.testing.assert_close(y, expected)
    assert set(m.state_dict()) == ({"norm.weight", "norm.bias"} if norm == "layer" else {"norm.weight"})
    assert "prenorm=" in repr(m)


def test_add_norm_rejects_unknown_norm():
    with pytest.raises(ValueError, match="norm must be 'layer' or 'rms'"):
        addnorm.AddNorm(8, norm="batch")


def test_eval_mode_keeps_no_running_statistics():
    m = addnorm.LayerNorm(8)
    x = torch.randn(4, 8)
    train_out = m(x)
    m.eval()
    torch.testing.assert_close(m(x), train_out)
    assert list(m.buffers()) == []
