"""docs/tutorial.ipynb runs from top to bottom, and its numbers are the seeds' and a float64 oracle's.

The notebook is executed in a fresh kernel (nbclient + ipykernel, the ``dev`` extra) with a
headless matplotlib backend; one cell appended here reads its variables back as JSON and
recomputes what they should be in float64, beside them in the same kernel.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn.functional as TF
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "docs" / "tutorial.ipynb"

# Reads the notebook's results back, and computes the Add & Norm section again in float64 from
# the notebook's own input and sublayers (the one thing the test cannot rebuild outside the kernel).
CHECK_CELL = r"""
import json as _json
import torch.nn.functional as _F

with torch.no_grad():
    _h, _s, _post64, _pre64 = x0.double(), x0.double(), [], []
    for _f in sublayers:
        _w, _b = _f.weight.double(), _f.bias.double()
        _h = _F.layer_norm(_h + _F.linear(_h, _w, _b), (d,))
        _post64.append(_h.std(dim=-1, correction=0).mean().item())
        _s = _s + _F.linear(_F.layer_norm(_s, (d,)), _w, _b)
        _pre64.append(_s.std(dim=-1, correction=0).mean().item())
print(_json.dumps({
    "dims": dims, "mean_shape": list(mean.shape),
    "mean": mean.flatten().tolist(), "std": std.flatten().tolist(), "out": out.tolist(),
    "out_addnorm": out_addnorm.tolist(), "module": layer_norm(inputs).tolist(),
    "dout": dout.tolist(), "dx": dx.tolist(), "x_grad": x.grad.tolist(), "dw": dw.tolist(), "db": db.tolist(),
    "ln_out": ln_out.tolist(), "bn_out": bn_out.tolist(), "other_batch": other_batch.tolist(),
    "ln_change": ln_change, "bn_change": bn_change, "ln_eval_change": ln_eval_change, "bn_eval_change": bn_eval_change,
    "row_mean": row_mean.item(),
    "textbook_errors": [c["textbook_error"] for c in comparison["cases"]],
    "reference_errors": [c["reference_error"] for c in comparison["cases"]],
    "before": before.tolist(), "after": after.tolist(),
    "post_std": post_std, "pre_std": pre_std, "post64": _post64, "pre64": _pre64,
}))
"""

SEEDS_X = [[0.2, 0.1, 0.3], [0.5, 0.1, 0.1]]
SEEDS_MEAN, SEEDS_STD = [0.2, 0.2333], [0.0817, 0.1886]
SEEDS_Y = [[0.0, -1.2238, 1.2238], [1.4140, -0.7070, -0.7070]]
EPS = 1e-5


def t64(value) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


@pytest.fixture(scope="module")
def results() -> dict:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(CHECK_CELL))
    mp = pytest.MonkeyPatch()
    mp.setenv("MPLBACKEND", "Agg")  # the kernel inherits the environment: no display needed
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        mp.undo()
    out = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream" and o.name == "stdout")
    return json.loads(out)


def test_committed_notebook_is_valid_and_stripped():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def test_worked_example_gives_the_seeds_numbers(results):
    assert results["dims"] == [-1, -2] and results["mean_shape"] == [2, 1, 1]
    torch.testing.assert_close(t64(results["mean"]), t64(SEEDS_MEAN), atol=1e-4, rtol=0)
    torch.testing.assert_close(t64(results["std"]), t64(SEEDS_STD), atol=1e-4, rtol=0)
    for key in ("out", "out_addnorm", "module"):
        torch.testing.assert_close(t64(results[key]).reshape(2, 3), t64(SEEDS_Y), atol=1e-4, rtol=0)
    x64 = t64(SEEDS_X).reshape(2, 1, 3)
    oracle = TF.layer_norm(x64, (1, 3), eps=EPS)
    for key in ("out", "out_addnorm", "module"):
        torch.testing.assert_close(t64(results[key]), oracle, atol=1e-6, rtol=0)
    var = x64.var(dim=(-1, -2), correction=0)
    torch.testing.assert_close(t64(results["std"]), (var + EPS).sqrt().flatten(), atol=1e-6, rtol=0)


def test_hand_backward_matches_autograd_and_float64(results):
    x64 = t64(SEEDS_X).reshape(2, 1, 3).requires_grad_()
    w64 = torch.ones(1, 3, dtype=torch.float64, requires_grad=True)
    b64 = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    TF.layer_norm(x64, (1, 3), w64, b64, eps=EPS).backward(t64(results["dout"]))
    torch.testing.assert_close(t64(results["dx"]), x64.grad, atol=1e-4, rtol=1e-5)  # |dx| up to 12
    torch.testing.assert_close(t64(results["dx"]), t64(results["x_grad"]), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(t64(results["dw"]), w64.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(t64(results["db"]), b64.grad, atol=0, rtol=0)


def test_layernorm_vs_batchnorm(results):
    x, other = t64(SEEDS_X), t64(results["other_batch"])
    torch.testing.assert_close(t64(results["ln_out"]), TF.layer_norm(x, (3,), eps=EPS), atol=1e-6, rtol=0)
    bn64 = (x - x.mean(0)) / (x.var(0, correction=0) + EPS).sqrt()  # per feature, over the batch
    torch.testing.assert_close(t64(results["bn_out"]), bn64, atol=1e-5, rtol=0)
    bn_other = (other - other.mean(0)) / (other.var(0, correction=0) + EPS).sqrt()
    assert results["ln_change"] < 1e-6
    assert math.isclose(results["bn_change"], (bn_other[0] - bn64[0]).abs().max().item(), abs_tol=1e-4)
    # eval: the running statistics of the two training batches (momentum 0.1, unbiased variance)
    mean, var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    for batch in (x, other):
        mean, var = 0.9 * mean + 0.1 * batch.mean(0), 0.9 * var + 0.1 * batch.var(0, correction=1)
    bn_eval = (x - mean) / (var + EPS).sqrt()
    assert results["ln_eval_change"] < 1e-6
    assert math.isclose(results["bn_eval_change"], (bn_eval - bn64).abs().max().item(), abs_tol=1e-4)


def test_textbook_rows(results):
    assert results["row_mean"] == 1000000.1875  # 1e6 + 0.1 in float32 is 1000000.125
    assert min(results["textbook_errors"]) > 0.25 and max(results["reference_errors"]) < 4e-3


def test_histograms_data_is_normalized_per_point(results):
    before, after = t64(results["before"]), t64(results["after"])
    assert before.shape == after.shape == (4, 256)
    assert bool((before.std(dim=-1, correction=0) > 10).all())  # randn·√256 + encoding: std about 16
    torch.testing.assert_close(after, TF.layer_norm(before, (256,), eps=EPS), atol=1e-5, rtol=0)
    torch.testing.assert_close(after.mean(-1), torch.zeros(4, dtype=torch.float64), atol=1e-6, rtol=0)
    var = before.var(dim=-1, correction=0)
    torch.testing.assert_close(after.std(-1, correction=0), (var / (var + EPS)).sqrt(), atol=1e-6, rtol=0)


def test_add_and_norm_pre_vs_post(results):
    post, pre = t64(results["post_std"]), t64(results["pre_std"])
    assert post.shape == pre.shape == (12,)
    torch.testing.assert_close(post, t64(results["post64"]), atol=1e-5, rtol=0)
    torch.testing.assert_close(pre, t64(results["pre64"]), atol=0, rtol=1e-5)
    assert bool(((post - 1).abs() < 1e-3).all())  # every post-norm output is normalized
    assert bool((pre.diff() > 0).all()) and pre[-1] > 1.5 * pre[0]  # the pre-norm stream grows
