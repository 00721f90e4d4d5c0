"""torch.compile(fullgraph=True) of patched models: no graph break from addnorm's ops, same results.

The Hugging Face model goes through dynamo and AOT autograd (``aot_eager``: the whole
tracing stack, custom ops' fake kernels and autograd included, without inductor's C++
build, which takes minutes for a whole model on two cores); a small model's inference
also runs through inductor, which plans buffers from the fake kernels' shapes and strides
(its backward graph would double the build time and adds no new op).
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn

import addnorm
from tiny_models import hf_inputs, hf_model


def recording(backend: str, graphs: list):
    """A dynamo backend that keeps each graph it is given, then compiles it with ``backend``."""
    inner = torch._dynamo.lookup_backend(backend)

    def compile_fn(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    return compile_fn


def addnorm_calls(graphs) -> int:
    return sum(node.target is torch.ops.addnorm.forward.default for gm in graphs for node in gm.graph.nodes)


# BLOOM's attention given NO_RESIDUAL to add, ESM C's divided outputs, Llama 3.2 Vision's gated
# cross-attention layers (image states in its inputs), Swin's shifted windows
@pytest.mark.parametrize("name", ["llama", "bloom", "esmc", "mllama", "swin"])
def test_patched_hf_model_compiles_fullgraph_and_matches_eager(name):
    pytest.importorskip("transformers")
    torch._dynamo.reset()
    model = hf_model(name)
    report = addnorm.patch(model, fuse_residual=True)
    eager = copy.deepcopy(model)
    graphs = []
    compiled = torch.compile(model, fullgraph=True, backend=recording("aot_eager", graphs))
    inputs = hf_inputs(name)
    loss_c, loss_e = compiled(**inputs).loss, eager(**inputs).loss
    loss_c.backward()
    loss_e.backward()
    assert len(graphs) == 1 and addnorm_calls(graphs) == len(report.replaced)  # our ops are in the graph
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-6)
    for (name, pc), pe in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_block_called_with_its_stream_by_name_compiles_from_cold_caches(monkeypatch):
    """A fused block called with its stream by name binds its arguments with ``inspect``, whose
    signature objects torch.compile traces only where nothing in the graph writes a dict: the
    per-class lookups the fused forward keeps (norm styles, parameter names) are written outside
    tracing alone, so a graph traced before any eager call has no break."""
    norms = importlib.import_module("addnorm.patch.norms")
    monkeypatch.setattr(norms, "_STYLE_OF", {})
    monkeypatch.setattr(norms, "_CLASS_ATTRIBUTES", {})
    torch._dynamo.reset()
    model = hf_model("llama")
    addnorm.patch(model, fuse_residual=True)
    norms._STYLE_OF.clear()  # (as after a fresh import: patch() filled it)
    layers, rotary = model.model.layers, model.model.rotary_emb
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    position = rotary(x, torch.arange(8)[None])

    def call(x):  # (the second layer binds its call after the first has run)
        for layer in layers:
            x = layer(hidden_states=x, position_embeddings=position)
        return x

    graphs = []
    got = torch.compile(call, fullgraph=True, backend=recording("aot_eager", graphs))(x)
    assert len(graphs) == 1 and addnorm_calls(graphs) == 4  # each layer's two norms
    torch.testing.assert_close(got, call(x), rtol=1e-6, atol=1e-6)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)
        self.add_norm = addnorm.AddNorm(16, norm="rms", prenorm=True)

    def forward(self, x):
        return self.add_norm(self.proj(self.ln(x)), x)  # no pointwise op: no C++ kernel to build


def test_inductor_inference_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Small()
    addnorm.patch(model)
    eager = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    graphs = []
    with torch.no_grad():
        y_c = torch.compile(model, fullgraph=True, backend=recording("inductor", graphs))(x)
        y_e = eager(x)
    assert addnorm_calls(graphs) == 2
    torch.testing.assert_close(y_c, y_e)  # (y, stream)
