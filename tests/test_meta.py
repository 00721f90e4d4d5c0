"""Meta tensors (deferred initialization, shape inference): every route returns meta outputs of
the right shape and dtype, as torch's own norms do, with no data read."""

from __future__ import annotations

import pytest
import torch

import addnorm

META = torch.device("meta")


def _expected(x, residual_dtype=None):
    return x.shape, x.dtype, residual_dtype or x.dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
@pytest.mark.parametrize("grad", [False, True])
def test_functions_on_meta_return_meta_outputs(fn, dtype, grad):
    x = torch.randn(3, 5, 16, device=META, dtype=dtype, requires_grad=grad)
    w = torch.ones(16, device=META, dtype=dtype)
    if fn.startswith("add_"):
        r = torch.randn(3, 5, 16, device=META, dtype=dtype)
        y, s = getattr(addnorm, fn)(x, r, 16, w, prenorm=True, residual_dtype=torch.float32, dropout_p=0.1)
        assert (s.device, s.shape, s.dtype) == (META, x.shape, torch.float32)
    else:
        y = getattr(addnorm, fn)(x, 16, w)
    assert (y.device, y.shape, y.dtype) == (META, x.shape, dtype)
    # the same as torch's own norm on meta
    assert torch.nn.functional.layer_norm(x, (16,)).shape == y.shape
    if grad:
        y.sum().backward()
        assert (x.grad.device, x.grad.shape, x.grad.dtype) == (META, x.shape, dtype)


def test_modules_built_on_meta_run_on_meta():
    for module in (
        addnorm.LayerNorm((4, 8), device=META),
        addnorm.RMSNorm(8, device=META, dtype=torch.bfloat16),
    ):
        x = torch.randn(2, 4, 8, device=META, dtype=module.weight.dtype)
        y = module(x)
        assert (y.device, y.shape, y.dtype) == (META, x.shape, x.dtype)
    add = addnorm.AddNorm(8, prenorm=True, dropout=0.1, device=META)
    x = torch.randn(2, 8, device=META)
    y, s = add(x, x)
    assert y.device == s.device == META


def test_compiled_calls_on_meta():
    f = torch.compile(lambda x, r: addnorm.add_rms_norm(x, r, 8, prenorm=True), fullgraph=True)
    x = torch.randn(4, 8, device=META)
    y, s = f(x, x)
    assert (y.device, y.shape, s.shape) == (META, (4, 8), (4, 8))


def test_a_patched_model_built_on_meta_infers_shapes():
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    config.vocab_size = 100
    with META:
        model = transformers.LlamaForCausalLM(config)
    addnorm.patch(model, fuse_residual=True)
    logits = model(torch.zeros(2, 5, dtype=torch.long, device=META)).logits
    assert (logits.device, logits.shape) == (META, (2, 5, 100))
