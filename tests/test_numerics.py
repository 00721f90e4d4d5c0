"""Hard numerics: inputs that break naive LayerNorm/RMSNorm, against torch and the fp64 oracle.

For each scenario our error against the fp64 oracle (torch's own op on the same values in
float64), forward and backward, must be no worse than torch's own error in the same dtype
(up to a factor 2 for rounding-order noise, plus the dtype's atol). Where torch's float32
statistics overflow (bfloat16 beyond ~1e18), we must instead be within twice the error of
the oracle rounded to bfloat16: exact up to the dtype. Non-finite inputs and eps=0
must propagate exactly as in torch: the same elements become NaN/inf, the other rows are exact.
``benchmarks/reliability_report.py`` prints the figures for these scenarios.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as TF

import addnorm
from conftest import TOLERANCES, assert_matches_oracle

ROWS, N = 16, 512  # small: every backend (the Triton interpreter too) runs each scenario


@dataclass
class Scenario:
    name: str
    dtype: torch.dtype
    rms: bool
    make: Callable[[torch.Generator], torch.Tensor]  # float64 values, cast to dtype by the test
    eps: float = 1e-5
    # torch's own statistics overflow here (bf16 has float32's range): measure us against the
    # best possible result, the oracle rounded to the dtype, instead of against torch's error.
    torch_overflows: bool = False


def _randn(g, scale=1.0, offset=0.0):
    return torch.randn(ROWS, N, generator=g, dtype=torch.float64) * scale + offset


def _full(value):
    return lambda g: torch.full((ROWS, N), value, dtype=torch.float64)


SCENARIOS = [
    Scenario("mean offset 1e4", torch.float32, False, lambda g: _randn(g, 1.0, 1e4)),
    Scenario("mean offset 1e6", torch.float32, False, lambda g: _randn(g, 1.0, 1e6)),
    Scenario("mean offset 1e4 rms", torch.float32, True, lambda g: _randn(g, 1.0, 1e4)),
    Scenario("near-constant (var 1e-8 << eps)", torch.float32, False, lambda g: _randn(g, 1e-4, 3.0)),
    Scenario("near-constant fp16", torch.float16, False, lambda g: _randn(g, 1e-3, 3.0)),
    Scenario("near-constant bf16", torch.bfloat16, False, lambda g: _randn(g, 1e-2, 3.0)),
    Scenario("all-equal rows", torch.float32, False, _full(3.7)),
    Scenario("all-equal rows fp16", torch.float16, False, _full(-1.3)),
    Scenario("all-equal rows bf16 rms", torch.bfloat16, True, _full(7.0)),
    Scenario("near fp16 max", torch.float16, False, lambda g: _randn(g).clamp(-1, 1) * 65000),
    Scenario("near fp16 max rms", torch.float16, True, lambda g: _randn(g).clamp(-1, 1) * 65000),
    Scenario(
        "bf16 1e18 (sum of squares overflows fp32)",
        torch.bfloat16,
        False,
        lambda g: _randn(g, 1e18),
        torch_overflows=True,
    ),
    Scenario("bf16 1e18 rms", torch.bfloat16, True, lambda g: _randn(g, 1e18), torch_overflows=True),
    Scenario("near bf16 max", torch.bfloat16, False, lambda g: _randn(g).clamp(-1, 1) * 3e38, torch_overflows=True),
    Scenario("near bf16 max rms", torch.bfloat16, True, lambda g: _randn(g).clamp(-1, 1) * 3e38, torch_overflows=True),
    Scenario("denormal fp32", torch.float32, False, lambda g: _randn(g, 1e-40)),
    Scenario("denormal fp32 rms", torch.float32, True, lambda g: _randn(g, 1e-40)),
    Scenario("subnormal fp16", torch.float16, False, lambda g: _randn(g, 1e-6)),
    Scenario("denormal bf16 rms", torch.bfloat16, True, lambda g: _randn(g, 1e-40)),
]


def torch_norm(x, w, b, eps, rms):
    return TF.rms_norm(x, x.shape[-1:], w, eps) if rms else TF.layer_norm(x, x.shape[-1:], w, b, eps)


def ours_norm(x, w, b, eps, rms, backend):
    n = x.shape[-1]
    if rms:
        return addnorm.rms_norm(x, n, w, eps, backend=backend)
    return addnorm.layer_norm(x, n, w, b, eps, backend=backend)


def evaluate(sc: Scenario, backend: str, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Outputs and gradients (x, weight, bias) of ours, torch in ``sc.dtype`` and the fp64 oracle."""
    g = torch.Generator().manual_seed(seed)
    x = sc.make(g).to(sc.dtype)
    w = (torch.randn(x.shape[-1], generator=g, dtype=torch.float64) + 1).to(sc.dtype)
    b = None if sc.rms else torch.randn(x.shape[-1], generator=g, dtype=torch.float64).to(sc.dtype)
    dy = torch.randn(x.shape, generator=g, dtype=torch.float64)
    results = {}
    for who in ("ours", "torch", "oracle"):
        dtype = torch.float64 if who == "oracle" else sc.dtype
        leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w, b) if t is not None]
        args = (*leaves[:2], leaves[2] if len(leaves) > 2 else None, sc.eps, sc.rms)
        y = ours_norm(*args, backend) if who == "ours" else torch_norm(*args)
        grads = torch.autograd.grad(y, leaves, dy.to(dtype))
        results[who] = dict(zip(["y", "dx", "dweight", "dbias"], [y.detach(), *grads], strict=False))
    return results


def max_error(t: torch.Tensor, oracle: torch.Tensor) -> float:
    """Max |t - oracle|; NaN or inf where the oracle is finite counts as infinitely wrong."""
    return (t.double() - oracle).abs().nan_to_num(math.inf, math.inf, math.inf).max().item()


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_error_no_worse_than_torch(backend, sc):
    res = evaluate(sc, backend)
    rtol, atol = TOLERANCES[sc.dtype]
    for key, oracle in res["oracle"].items():
        assert bool(oracle.isfinite().all()), f"{key}: the oracle itself is not finite"
        ours, theirs = max_error(res["ours"][key], oracle), max_error(res["torch"][key], oracle)
        if sc.torch_overflows:
            theirs = max_error(oracle.to(sc.dtype), oracle)
        # dweight/dbias sum ROWS terms: their rounding grows like sqrt(ROWS)
        slack = atol * (math.sqrt(ROWS) if key in ("dweight", "dbias") else 1.0) + rtol * oracle.abs().max().item()
        assert ours <= 2 * theirs + slack, f"{sc.name} {key}: ours {ours:.3g} vs torch's {theirs:.3g}"


def test_offset_rows_are_centered_exactly(backend):
    """The corrected mean makes a large common offset harmless: at 1e6 (fp32 ulp 0.0625) the
    output is as accurate as for centered data, where torch's single-pass mean loses ~0.4."""
    res = evaluate(SCENARIOS[1], backend)
    assert max_error(res["ours"]["y"], res["oracle"]["y"]) < 1e-4


def _near_constant_rows(offset: float, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows at ``offset`` whose spread is a few ulps: one element raised by 4 to 16 ulps, or
    (the last row) every element raised by 0 to 2 ulps at random. Their rounded mean is off by
    about as much as the row spreads, so mean(d*d) - c*c, the kernels' two-pass variance,
    cancels; they take a third pass (reference.CANCEL)."""
    g = torch.Generator().manual_seed(3)
    ulp = torch.finfo(dtype).eps * offset
    x = torch.full((5, n), offset, dtype=torch.float64)
    for i in range(4):
        x[i, (37 * i) % n] += 4 * (i + 1) * ulp
    x[4] += torch.randint(0, 3, (n,), generator=g).double() * ulp
    return x.to(dtype)


@pytest.mark.parametrize("offset", [1e6, 3e7])
@pytest.mark.parametrize("n", [1024, 4096, 20000])  # 20000: the Triton forward's chunked path
def test_near_constant_rows_far_from_zero_are_exact(backend, offset, n):
    """The variance of a row spread over a few ulps of a large mean comes out exact to float32
    on every backend, as the reference's; without the third pass the CPU kernel's output was
    off by up to 4e-3 of its scale at 3e7 and Triton's chunked path by 1.6e-6."""
    x = _near_constant_rows(offset, n)
    xs = x.double()
    oracle = (xs - xs.mean(-1, keepdim=True)) / torch.sqrt(xs.var(-1, unbiased=False, keepdim=True) + 1e-5)
    y = addnorm.layer_norm(x, n, backend=backend).double()
    error = ((y - oracle).abs().amax(-1) / oracle.abs().amax(-1)).max().item()
    assert error < 5e-7, f"{backend}: relative error {error:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("kind", ["constant", "normal", "offset"])
@pytest.mark.parametrize("residual", [False, True])
def test_wide_rows_keep_the_statistics_of_narrow_ones(dtype, rms, kind, residual):
    """A row of 2**20 elements (a norm over several dims): the cpu backend's mean, variance and
    mean square, against float64 sums of the same row, within the error of a row of a thousand.
    Each sum adds its row by blocks; one running lane sum would drift with the row's length (the
    squares of a constant row most: nothing corrects them)."""
    from addnorm import backend as backends

    n, g = 1 << 20, torch.Generator().manual_seed(7)
    base = {"constant": torch.full((1, n), 3.7), "normal": torch.randn(1, n, generator=g)}.get(kind)
    x = (base if base is not None else 40 + 1e-2 * torch.randn(1, n, generator=g)).to(dtype)
    r = (torch.randn(1, n, generator=g) if residual else torch.zeros(1, n)).to(dtype)
    _, s, mean, rstd = backends.load("cpu").forward(
        x, r if residual else None, None, None, eps=1e-5, rms=rms, residual_dtype=None
    )
    s = (x if s is None else s).double()
    if rms:
        want = 1 / torch.sqrt(s.square().mean(-1) + 1e-5)
    else:
        want = 1 / torch.sqrt(s.var(-1, unbiased=False) + 1e-5)
        scale = s.square().mean().sqrt().item()  # (a normal row's mean is near 0: its error is to its scale)
        torch.testing.assert_close(mean.double(), s.mean(-1), rtol=0, atol=2e-7 * scale)
    torch.testing.assert_close(rstd.double(), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("value", [3.7, 1e20, 2.0**99, -1e33, 6e35])
@pytest.mark.parametrize("n", [8, 1000, 20000])
@pytest.mark.parametrize("rows", [3, pytest.param(36, marks=pytest.mark.large)])  # 36 x 20000: threaded blocks
def test_constant_rows_of_any_magnitude_give_the_bias(backend, value, n, rows):
    """A constant row's centred values are all zero: ``y`` is the bias, ``dx = rstd * (g -
    mean(g))`` with ``g = dy * weight`` and ``rstd = 1/sqrt(eps)``, and the row adds nothing to
    ``dweight``, at any magnitude below 2**119. Rows scaled against overflow (beyond 2**63 in the
    reference) lost eps to underflow in ``eps * k * k`` and came out NaN. (torch's float32 norm
    gives NaN from 1e20 and its float64 backward cancels there: the oracle is the formula.)"""
    g = torch.Generator().manual_seed(5)
    x = torch.tensor([value, -value, value / 3]).repeat(rows // 3).repeat_interleave(n).view(rows, n).requires_grad_()
    w, b = torch.randn(n, generator=g).requires_grad_(), torch.randn(n, generator=g).requires_grad_()
    dy = torch.randn(rows, n, generator=g)
    y = addnorm.layer_norm(x, n, w, b, backend=backend)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), dy)
    assert torch.equal(y, b.detach().expand(rows, n)), f"{backend}: y is not the bias"
    gw = (dy * w.detach()).double()
    expected = (gw - gw.mean(-1, keepdim=True)) / math.sqrt(1e-5)
    assert max_error(dx, expected) <= 1e-6 * expected.abs().max().item(), backend
    assert torch.equal(dw, torch.zeros(n)), backend
    assert max_error(db, dy.double().sum(0)) <= 1e-6 * rows, backend  # (a sum over the rows)


# ----------------------------------------------------------------------- non-finite inputs


def _nonfinite_input(kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 40, generator=g, dtype=torch.float64)
    eps = 1e-5
    if kind == "nan":
        x[2, 5] = math.nan
    elif kind == "inf":
        x[4, 0] = math.inf
    elif kind == "-inf and nan":
        x[1, 39], x[3, 3] = -math.inf, math.nan
    elif kind == "eps=0 constant row":
        x[3] = 2.5
        eps = 0.0
    elif kind == "eps=0 zero row":
        x[0] = 0.0
        eps = 0.0
    return x.to(dtype), eps


NONFINITE = ["nan", "inf", "-inf and nan", "eps=0 constant row", "eps=0 zero row"]


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", NONFINITE)
def test_nonfinite_propagate_as_torch(backend, kind, dtype, rms):
    """Only the affected rows turn NaN/inf, exactly where torch's do; other rows stay exact."""
    x, eps = _nonfinite_input(kind, dtype)
    n = x.shape[-1]
    w = torch.linspace(0.5, 1.5, n).to(dtype)
    b = None if rms else torch.linspace(-1, 1, n).to(dtype)
    dy = torch.ones_like(x)
    out = {}
    for who in ("ours", "torch", "oracle"):
        dt = torch.float64 if who == "oracle" else dtype
        xl, wl = x.to(dt).requires_grad_(), w.to(dt).requires_grad_()
        bl = None if b is None else b.to(dt)
        y = ours_norm(xl, wl, bl, eps, rms, backend) if who == "ours" else torch_norm(xl, wl, bl, eps, rms)
        out[who] = (y.detach(), *torch.autograd.grad(y, (xl, wl), dy.to(dt)))
    for name, ours, theirs, oracle in zip(("y", "dx", "dweight"), *out.values(), strict=True):
        assert torch.equal(ours.isnan(), theirs.isnan()), f"{name}: NaN where torch has none (or vice versa)"
        assert torch.equal(ours.isinf(), theirs.isinf()), f"{name}: inf where torch has none (or vice versa)"
        if name != "dweight":  # dweight sums over rows: one bad row spoils it, as in torch
            bad_rows = theirs.isfinite().logical_not().any(dim=-1)
            assert bad_rows.sum() <= 2, "a non-finite value spread beyond its own row"
            assert_matches_oracle(ours[~bad_rows], oracle[~bad_rows], theirs[~bad_rows])


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_nan_in_residual_stays_in_its_row(backend, rms):
    """Add & Norm (pre-norm): a NaN in the residual spoils that row of y, s, dx and dresidual
    only, exactly as torch's ``x + r`` followed by its norm."""
    g = torch.Generator().manual_seed(8)
    x, r = (torch.randn(5, 24, generator=g) for _ in range(2))
    r[3, 7] = math.nan
    w = torch.rand(24, generator=g) + 0.5
    dy, dstream = torch.randn(5, 24, generator=g), torch.randn(5, 24, generator=g)
    out = {}
    for who in ("ours", "torch"):
        xl, rl = x.clone().requires_grad_(), r.clone().requires_grad_()
        if who == "ours":
            call = addnorm.add_rms_norm if rms else addnorm.add_layer_norm
            y, s = call(xl, rl, 24, w, prenorm=True, backend=backend)
        else:
            s = xl + rl
            y = torch_norm(s, w, None, 1e-5 if not rms else None, rms)
        out[who] = (y.detach(), s.detach(), *torch.autograd.grad((y, s), (xl, rl), (dy, dstream)))
    for name, ours, theirs in zip(("y", "s", "dx", "dresidual"), out["ours"], out["torch"], strict=True):
        assert torch.equal(ours.isnan(), theirs.isnan()), name
        assert torch.equal(ours.isnan().any(dim=-1), torch.tensor([False, False, False, True, False])), name
        torch.testing.assert_close(ours[[0, 1, 2, 4]], theirs[[0, 1, 2, 4]], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------- gradients at an offset

# Rows far from zero, in float32: the saved mean cannot hold the forward's corrected mean (at 1e6
# an ulp is 0.0625), so the backward must re-centre as the forward does. Without it the gradients
# are off by ~1e-5 (offset 1e4) to order one (three features spread over a few ulps).
OFFSET_ROWS = {
    "offset 1e4": lambda g, m, n: torch.randn(m, n, generator=g, dtype=torch.float64) + 1e4,
    "offset 1e6": lambda g, m, n: torch.randn(m, n, generator=g, dtype=torch.float64) + 1e6,
    "3 features at 1e6": lambda g, m, n: torch.tensor([[1e6 + 0.1, 1e6 + 0.2, 1e6 + 0.3]], dtype=torch.float64),
}
OFFSET_MODES = ["no residual", "post-norm", "pre-norm"]


def offset_gradients(backend: str, rows: str, mode: str, m: int = 6, n: int = 96, create_graph: bool = False) -> None:
    """Every gradient of ``layer_norm`` (``mode`` "no residual") or ``add_layer_norm`` (post- or
    pre-norm) on float32 rows at a large offset, against torch's autograd on the same inputs in
    float64, within the float32 tolerance: no ``2 x torch's error`` allowance here, as torch's own
    float32 gradients are off by up to order one on these rows."""
    g = torch.Generator().manual_seed(3)
    s = OFFSET_ROWS[rows](g, m, n).float()
    m, n = s.shape
    w = torch.randn(n, generator=g) + 1
    b = torch.randn(n, generator=g)
    dy, dstream = torch.randn(m, n, generator=g), torch.randn(m, n, generator=g)
    inputs = [s]
    if mode != "no residual":
        # x, a multiple of 1/16 (of ulp(1e6)), and the residual are exact in float32, and so is
        # their sum: the float64 oracle sees the very stream that float32 computes
        x = (torch.randn(m, n, generator=g) * 16).round() / 16
        inputs = [x, (s.double() - x.double()).float()]
        assert torch.equal(inputs[0] + inputs[1], s)
    grads = {}
    for dtype in (torch.float32, torch.float64):
        leaves = [t.to(dtype).requires_grad_() for t in (*inputs, w, b)]
        if dtype == torch.float32 and mode == "no residual":
            outs = (addnorm.layer_norm(leaves[0], n, *leaves[1:], backend=backend),)
        elif dtype == torch.float32:
            outs = addnorm.add_layer_norm(*leaves[:2], n, *leaves[2:], prenorm=mode == "pre-norm", backend=backend)
        else:
            stream = leaves[0] if mode == "no residual" else leaves[0] + leaves[1]
            outs = (TF.layer_norm(stream, (n,), *leaves[-2:]), stream)[: 2 if mode == "pre-norm" else 1]
        outs = outs if isinstance(outs, tuple) else (outs,)
        grads[dtype] = torch.autograd.grad(outs, leaves, (dy, dstream)[: len(outs)], create_graph=create_graph)
    names = ["dx", "dresidual", "dweight", "dbias"] if mode != "no residual" else ["dx", "dweight", "dbias"]
    for name, ours, oracle in zip(names, grads[torch.float32], grads[torch.float64], strict=True):
        assert ours.dtype == torch.float32, name
        try:  # dweight/dbias sum m rows: their rounding grows like sqrt(m)
            assert_matches_oracle(ours.detach(), oracle.detach(), scale=math.sqrt(m) if ours.dim() == 1 else 1.0)
        except AssertionError as err:
            raise AssertionError(f"{rows}, {mode}: {name}: {err}") from None


@pytest.mark.parametrize("mode", OFFSET_MODES)
@pytest.mark.parametrize("rows", OFFSET_ROWS)
def test_offset_rows_gradients_match_the_oracle(backend, rows, mode):
    """dx, dresidual, dweight and dbias of rows at a large mean offset, as exact as float32 allows."""
    offset_gradients(backend, rows, mode)


@pytest.mark.parametrize("rows", OFFSET_ROWS)
def test_offset_rows_gradients_with_create_graph(rows):
    """The differentiable backward (``create_graph=True``, for a second derivative) re-centres
    too: its statistics are recomputed, and rounded, as the forward's."""
    offset_gradients("auto", rows, "pre-norm", create_graph=True)
