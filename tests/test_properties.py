"""Property tests: random shapes, dtypes, options and memory layouts against the fp64 oracle.

Hypothesis draws one Add & Norm call at a time -- LayerNorm or RMSNorm, with or without a
residual, pre- or post-norm, ``residual_dtype``, affine or not, 1 to 3 normalized dims, 0 to 300
rows, transposed / step-sliced / broadcast-expanded inputs -- and checks the output, the
returned stream and every gradient against torch's own ops in float64, with the per-dtype
tolerances of conftest.py (fp16/bf16: at most twice torch's own error in that dtype, plus atol).

The "ci" profile (default) is derandomized and short; ``HYPOTHESIS_PROFILE=long`` runs many
more examples locally. Sizes are bounded (N <= 2048 features, <= 16384 elements) so that slow
backends such as the Triton interpreter stay cheap; wide rows have their own cases below.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as TF
from hypothesis import given, settings
from hypothesis import strategies as st

import addnorm
from addnorm.reference import stats_dtype
from conftest import DTYPES, assert_matches_oracle

MAX_N = 2048
MAX_ELEMENTS = 16384
LAYOUTS = ["contiguous", "transpose", "step", "expand"]


@dataclass
class Layout:
    """How a tensor of ``shape`` is stored: a view of a differently shaped base tensor."""

    kind: str
    dim: int = 0
    dim2: int = 0

    def base_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        s = list(shape)
        if self.kind == "transpose":
            s[self.dim], s[self.dim2] = s[self.dim2], s[self.dim]
        elif self.kind == "step":
            s[self.dim] *= 2
        elif self.kind == "expand":
            s[self.dim] = 1
        return tuple(s)

    def view(self, base: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if self.kind == "transpose":
            return base.transpose(self.dim, self.dim2)
        if self.kind == "step":
            return base[(slice(None),) * self.dim + (slice(None, None, 2),)]
        if self.kind == "expand":
            return base.expand(shape)
        return base


@st.composite
def layouts(draw, ndim: int) -> Layout:
    kind = draw(st.sampled_from(LAYOUTS if ndim >= 2 else ["contiguous", "step", "expand"]))
    dim = draw(st.integers(0, ndim - 1))
    dim2 = draw(st.integers(0, ndim - 1).filter(lambda d: d != dim)) if kind == "transpose" else 0
    return Layout(kind, dim, dim2)


@st.composite
def dims(draw, ndims: list[int], budget: int) -> tuple[int, ...]:
    """``ndims`` sizes >= 1 whose product is at most ``budget``, often small."""
    out: list[int] = []
    for _ in range(draw(st.sampled_from(ndims))):
        high = max(1, budget // math.prod(out))
        out.append(draw(st.one_of(st.integers(1, min(high, 40)), st.integers(1, high))))
    return tuple(out)


@dataclass
class Case:
    rms: bool
    residual: bool
    prenorm: bool
    dtype: torch.dtype
    residual_input_dtype: torch.dtype
    residual_dtype: torch.dtype | None
    affine: bool
    bias: bool
    eps: float | None
    batch: tuple[int, ...]
    norm: tuple[int, ...]
    x_layout: Layout
    r_layout: Layout
    offset: float
    seed: int


@st.composite
def cases(draw, max_n: int = MAX_N, max_elements: int = MAX_ELEMENTS) -> Case:
    rms = draw(st.booleans())
    residual = draw(st.booleans())
    dtype = draw(st.sampled_from(DTYPES))
    r_dtype = draw(st.sampled_from([dtype, torch.float32]))
    stream = torch.promote_types(dtype, r_dtype)
    # residual_dtype may only widen the stream: narrowing rounds s by the user's choice.
    wider = [d for d in (torch.float32, torch.float64) if torch.promote_types(d, stream) == d]
    residual_dtype = draw(st.sampled_from([None, *wider])) if residual else None
    norm = draw(dims([1, 2, 3], max_n))
    n = math.prod(norm)
    batch = draw(dims([1, 2, 1, 0], min(300, max_elements // n)))
    if batch and draw(st.integers(0, 9)) == 0:  # now and then no rows at all
        batch = (0, *batch[1:])
    ndim = len(batch) + len(norm)
    affine = draw(st.booleans())
    return Case(
        rms=rms,
        residual=residual,
        prenorm=residual and draw(st.booleans()),
        dtype=dtype,
        residual_input_dtype=r_dtype,
        residual_dtype=residual_dtype,
        affine=affine,
        bias=affine and not rms and draw(st.booleans()),
        eps=draw(st.sampled_from([1e-5, 1e-6, 1e-3, 0.1] + ([None] if rms else []))),
        batch=batch,
        norm=norm,
        x_layout=draw(layouts(ndim)),
        r_layout=draw(layouts(ndim)),
        offset=draw(st.sampled_from([0.0, 0.5, 3.0])),
        seed=draw(st.integers(0, 2**16)),
    )


def torch_norm(s, shape, weight, bias, eps, rms):
    return TF.rms_norm(s, shape, weight, eps) if rms else TF.layer_norm(s, shape, weight, bias, eps)


def check(
    records: list, name: str, ours: torch.Tensor, oracle: torch.Tensor, theirs: torch.Tensor, scale: float = 1.0
) -> None:
    """Record (name, dtype, our max error, torch's max error), then assert with conftest's rule."""
    if ours.numel():
        records.append(
            (
                name,
                ours.dtype,
                (ours.double() - oracle).abs().max().item(),
                (theirs.double() - oracle).abs().max().item(),
            )
        )
    assert_matches_oracle(ours, oracle, theirs, scale=scale)


def run_case(c: Case, backend: str) -> list:
    """Check one drawn call; returns the error records (see :func:`check`) for reports."""
    records: list = []
    shape = c.batch + c.norm
    n = math.prod(c.norm)
    rows = math.prod(c.batch)
    g = torch.Generator().manual_seed(c.seed)
    rand = lambda shp: torch.randn(shp, generator=g, dtype=torch.float64)
    # Leaves in the dtype each is handed to addnorm; x and residual are views of them.
    leaves = {"x": (rand(c.x_layout.base_shape(shape)) * 2 + c.offset).to(c.dtype)}
    if c.residual:
        leaves["residual"] = rand(c.r_layout.base_shape(shape)).to(c.residual_input_dtype)
    if c.affine:
        leaves["weight"] = (rand(c.norm) + 1).to(c.dtype)
    if c.bias:
        leaves["bias"] = rand(c.norm).to(c.dtype)
    eps = torch.finfo(stats_dtype(c.dtype)).eps if c.eps is None else c.eps
    sd = addnorm.reference.stream_dtype(leaves["x"], leaves.get("residual"), c.residual_dtype)

    def forward(tensors: dict[str, torch.Tensor], ours: bool, wdtype: torch.dtype | None):
        """Returns (y, s or None, the inputs as passed: gradients are taken of these)."""
        x = c.x_layout.view(tensors["x"], shape)
        r = c.r_layout.view(tensors["residual"], shape) if c.residual else None
        w, b = tensors.get("weight"), tensors.get("bias")
        inputs = {k: t for k, t in (("x", x), ("residual", r), ("weight", w), ("bias", b)) if t is not None}
        if ours:
            common = dict(prenorm=c.prenorm, residual_dtype=c.residual_dtype, backend=backend)
            if not c.residual:
                y = (
                    addnorm.rms_norm(x, c.norm, w, c.eps, backend=backend)
                    if c.rms
                    else addnorm.layer_norm(x, c.norm, w, b, c.eps, backend=backend)
                )
            elif c.rms:
                y = addnorm.add_rms_norm(x, r, c.norm, w, c.eps, **common)
            else:
                y = addnorm.add_layer_norm(x, r, c.norm, w, b, c.eps, **common)
            return (*y, inputs) if c.prenorm else (y, None, inputs)
        s = x.to(wdtype) + r.to(wdtype) if c.residual else x.to(wdtype)
        cast = lambda t: None if t is None else t.to(wdtype)
        y = torch_norm(s, c.norm, cast(w), cast(b), eps, c.rms).to(x.dtype)
        return y, (s if c.prenorm else None), inputs

    dy, dstream = rand(shape), rand(shape)

    def grads(outs):
        # Of the views, not of their bases: the sum autograd makes over an expanded dim is
        # torch's, and would turn our rounding into absolute error where the sum cancels to 0.
        *outs, tensors = outs
        pairs = [(outs[0], dy.to(outs[0].dtype))]
        if outs[1] is not None:
            pairs.append((outs[1], dstream.to(outs[1].dtype)))
        if rows == 0:
            return {k: torch.zeros_like(t) for k, t in tensors.items()}
        got = torch.autograd.grad([o for o, _ in pairs], list(tensors.values()), [d for _, d in pairs])
        return dict(zip(tensors, got, strict=True))

    def fresh(fp64=False):
        return {k: (t.double() if fp64 else t).detach().clone().requires_grad_() for k, t in leaves.items()}

    mine, oracle, same = fresh(), fresh(fp64=True), fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # n <= 2 features
        out = forward(mine, True, None)
    ref = forward(oracle, False, torch.float64)
    tor = forward(same, False, sd)

    y, s, _ = out
    assert y.shape == shape and y.dtype == c.dtype
    flat = lambda t: t.detach().reshape(-1, n)
    check(records, "y", flat(y), flat(ref[0]), flat(tor[0]))
    if c.prenorm:
        assert s.shape == shape and s.dtype == sd
        check(records, "s", flat(s), flat(ref[1]), flat(tor[1]))

    g_mine, g_ref, g_tor = grads(out), grads(ref), grads(tor)
    for k, leaf in leaves.items():
        assert g_mine[k].dtype == leaf.dtype, k
        if k in ("x", "residual"):
            check(records, "d" + k, flat(g_mine[k]), flat(g_ref[k]), flat(g_tor[k]))
        else:  # dweight, dbias sum over rows: their rounding grows like sqrt(rows)
            check(records, "d" + k, g_mine[k], g_ref[k].detach(), g_tor[k], scale=max(1.0, math.sqrt(rows)))
    return records


@settings(max_examples=settings().max_examples * 3)
@given(case=cases())
def test_every_op_matches_fp64_oracle(backend, case):
    run_case(case, backend)


WIDE = [
    Case(
        False,
        True,
        True,
        torch.float32,
        torch.float32,
        None,
        True,
        True,
        1e-5,
        (3,),
        (5000,),
        Layout("contiguous"),
        Layout("step", 1),
        0.5,
        1,
    ),
    Case(
        True,
        True,
        False,
        torch.bfloat16,
        torch.float32,
        torch.float32,
        True,
        False,
        None,
        (2,),
        (3, 1667),
        Layout("transpose", 0, 2),
        Layout("contiguous"),
        0.0,
        2,
    ),
    Case(
        False,
        False,
        False,
        torch.float16,
        torch.float16,
        None,
        True,
        True,
        1e-5,
        (2,),
        (65536,),
        Layout("expand", 0),
        Layout("contiguous"),
        3.0,
        3,
    ),
    Case(
        True,
        False,
        False,
        torch.float64,
        torch.float64,
        None,
        False,
        False,
        1e-6,
        (2,),
        (4099,),
        Layout("step", 1),
        Layout("contiguous"),
        0.5,
        4,
    ),
]


@pytest.mark.parametrize("case", WIDE, ids=["ln-5000", "rms-3x1667", "ln-65536-fp16", "rms-4099-fp64"])
def test_wide_rows_match_fp64_oracle(backend, case):
    run_case(case, backend)
