"""torch.onnx.export of addnorm modules writes standard ONNX norms that onnxruntime runs."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from tiny_models import TinyTransformer

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

STANDARD_DOMAINS = ("", "ai.onnx")


@pytest.mark.parametrize("opset,layer_norms,rms_norms", [(18, 2, 0), (23, 2, 3)])
def test_export_uses_standard_norms_and_matches_onnxruntime(opset, layer_norms, rms_norms):
    # two addnorm.LayerNorm, two addnorm.RMSNorm and an AddNorm(norm="rms"); RMSNormalization
    # exists from opset 23, before it the exporter writes RMSNorm as primitive ops
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    ids = torch.randint(0, 64, (2, 8))
    program = torch.onnx.export(model, (ids,), dynamo=True, opset_version=opset, verbose=False)
    proto = program.model_proto
    onnx.checker.check_model(proto)
    nodes = list(proto.graph.node) + [n for f in proto.functions for n in f.node]
    assert {n.domain for n in nodes} <= set(STANDARD_DOMAINS), "custom-domain op in the graph"
    counts = collections.Counter(n.op_type for n in nodes)
    assert counts["LayerNormalization"] == layer_norms and counts["RMSNormalization"] == rms_norms
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {session.get_inputs()[0].name: ids.numpy()})
    with torch.no_grad():
        expected = model(ids).numpy()
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
