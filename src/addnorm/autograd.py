"""Training calls: what a forward writes and saves, the custom ops, and one backward.

Two wrappers run a call that takes gradients, with the same save plan (:func:`save_plan`) and the
same backward (:func:`_grads`):

- :class:`EagerAddNorm`, an ``autograd.Function`` for plain tensors in eager mode, with as little
  autograd bookkeeping per call as the custom op allows (a small norm's whole call costs little
  more than that bookkeeping: docs/benchmarks.md, "What limits it"), and :class:`PlainAddNorm`,
  the same for a call without options (:mod:`addnorm.shortcut`) with less bookkeeping still;
- the custom ops ``addnorm::forward`` / ``addnorm::backward``, whose fake kernels and autograd
  registration serve ``torch.compile``, ``torch.export``, ``torch.jit.trace`` and tensor
  subclasses (FakeTensor, DTensor through :mod:`addnorm.sharding`).

A second derivative (``create_graph=True``) differentiates the hand-written backward formulas
themselves (:func:`addnorm.kernels.torch.differentiable_backward`).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from . import backend as backends
from . import reference
from .kernels import torch as torch_kernels


class OpArgs(NamedTuple):
    """The arguments of one call of the op, as every route takes them: ``x`` and ``residual`` as
    rows of ``N`` features (``normalized_shape`` flattened into the last dim), the sublayer
    branch ``s = residual + rowscale * layer_scale * dropout(x)`` in its last four fields. The
    custom op's schema (:data:`_FORWARD_SCHEMA`) lists the same fields, checked at import."""

    x: Tensor
    residual: Tensor | None
    weight: Tensor | None
    bias: Tensor | None
    eps: float
    rms: bool
    residual_dtype: torch.dtype | None
    backend: str
    prenorm: bool
    dropout_p: float = 0.0
    seed: Tensor | None = None  # int64 0-d, drawn when dropout_p > 0
    layer_scale: Tensor | None = None  # (N,)
    rowscale: Tensor | None = None  # x's leading dims: one factor per row


# OpArgs(*fields) without NamedTuple's Python-level __new__ (a call less on every op call): all
# thirteen fields, always
op_args = partial(tuple.__new__, OpArgs)


def make_branch(
    dropout_p: float, seed: Tensor | None, layer_scale: Tensor | None, rowscale: Tensor | None
) -> backends.Branch | None:
    """The :class:`~addnorm.backend.Branch` of these arguments as backends take it (``rowscale``
    flat, one factor per row), None when it changes nothing."""
    if rowscale is None and layer_scale is None and not dropout_p:
        return None
    return backends.Branch(dropout_p, seed, layer_scale, None if rowscale is None else rowscale.reshape(-1))


def row_shape(x: Tensor) -> tuple[int, ...]:
    """The shape of the per-row tensors (the statistics, ``rowscale``): ``x.shape[:-1]``. Their
    placeholders (RMSNorm's mean, a stream or ``dx`` not written) are empty, of shape
    ``row_shape(x) + (0,)``. Keeping x's leading dims lets a DTensor shard them like x's
    (:mod:`addnorm.sharding`); a backend takes them flat."""
    return x.shape[:-1]


def _no_vector(like: Tensor, dtype: torch.dtype) -> Tensor:
    """The custom op's placeholder for a parameter gradient that does not exist."""
    return torch.empty((0,), dtype=dtype, device=like.device)


# --------------------------------------------------------------------------- the save plan


class SavePlan(NamedTuple):
    """What a training call's forward writes (besides y, mean and rstd) and what it saves."""

    write_stream: bool  # the forward writes s = x + residual
    save_inputs: bool  # training saves x and residual (the backward recomputes s), else s (or x)


_NORM_ONLY = SavePlan(False, False)  # no residual: nothing to write but y, and x is saved


def save_plan(impl: backends.Backend, a: OpArgs, branch: backends.Branch | None) -> SavePlan:
    """One plan for both wrappers.

    Training saves ``s`` (``x`` without a residual), ``mean``, ``rstd`` and the weight. Post-norm
    with a stream dtype the backend ``recomputes_stream`` for saves ``x`` and ``residual`` instead
    and the forward never writes ``s``: in a Transformer the memory kept is the same
    (``residual`` is kept anyway as the input of the next sublayer), and a fresh output fewer is
    written. Only when both already have the stream dtype, so that the sum is bit for bit the
    forward's. With a branch (dropout, layer scale, rowscale) every backend saves ``x`` and
    ``residual``: ``dx`` is not ``ds``, the layer scale's gradient reads ``x``, and the keep mask
    is recomputed from the seed, never saved. (Inference writes the stream only when it is
    returned, and no statistics.)
    """
    x, residual = a.x, a.residual
    if residual is None:
        return _NORM_ONLY
    if branch is not None:
        return SavePlan(a.prenorm, True)
    save_inputs = (
        not a.prenorm
        and x.dtype in impl.CAPABILITIES.recomputes_stream
        and x.dtype == residual.dtype
        and a.residual_dtype in (None, x.dtype)
    )
    return SavePlan(not save_inputs, save_inputs)


def _saved(a: OpArgs, s: Tensor | None, plan: SavePlan) -> tuple[Tensor, ...]:
    """The backward's ``s_parts`` under ``plan``: ``(x, residual)`` to recompute ``s`` from, or the
    stream itself (``x`` without a residual). An input made under ``torch.inference_mode`` cannot be
    saved for backward (the weight's gradient needs it): a copy of it is."""
    parts = (a.x, a.residual) if plan.save_inputs else (a.x if a.residual is None else s,)
    return tuple(t.clone() if t is not None and t.is_inference() else t for t in parts)


def train_forward(
    a: OpArgs,
    second: tuple | None = None,
    write_stats: bool = True,
    x1: backends.X1 | None = None,
    write_stream: bool | None = None,
) -> tuple:
    """``(plan, branch, (y, s, mean, rstd))``: the forward of a training call, as the plan says.
    ``second``: ``(weight1, bias1)`` of a second norm of the same stream (parallel blocks, on a
    backend with ``Capabilities.second_norm``), whose ``y1`` then comes fifth. ``x1``: parallel
    blocks' second sublayer output, added to the residual in the same pass (a backend with
    ``Capabilities.adds_x1``; where the backward needs no summed residual: :func:`addnorm.ops._adds_x1`).
    ``write_stream``: whether ``s`` is written, when not as the plan says (inference: only when
    returned)."""
    impl = backends.resolve(a.backend, a.x)
    branch = make_branch(a.dropout_p, a.seed, a.layer_scale, a.rowscale)
    plan = save_plan(impl, a, branch)
    outputs = impl.forward(
        a.x,
        a.residual,
        a.weight,
        a.bias,
        eps=a.eps,
        rms=a.rms,
        residual_dtype=a.residual_dtype,
        write_stream=plan.write_stream if write_stream is None else write_stream,
        write_stats=write_stats,
        branch=branch,
        **({} if second is None else {"second": second}),
        **({} if x1 is None else {"x1": x1}),
    )
    return plan, branch, outputs


# --------------------------------------------------------------------------- the one backward


class _Meta(NamedTuple):
    """What the backward needs besides the saved tensors, in one ctx attribute."""

    x_dtype: torch.dtype
    residual_dtype: torch.dtype | None
    bias_dtype: torch.dtype | None
    eps: float
    rms: bool
    backend: str
    stream_output: bool  # the stream is an output with a gradient to take
    dropout_p: float


def _meta(a: OpArgs, stream_output: bool) -> _Meta:
    residual, bias = a.residual, a.bias
    fields = (
        a.x.dtype,
        None if residual is None else residual.dtype,
        None if bias is None else bias.dtype,
        a.eps,
        a.rms,
        a.backend,
        stream_output,
        a.dropout_p,
    )
    return tuple.__new__(_Meta, fields)


def _save(ctx, a: OpArgs, plan: SavePlan, mean: Tensor | None, rstd: Tensor, s: Tensor | None) -> None:
    ctx.save_for_backward(a.weight, mean, rstd, a.seed, a.layer_scale, a.rowscale, *_saved(a, s, plan))
    ctx.meta = _meta(a, plan.write_stream)


def _saved_outputs(ctx, a: OpArgs, plan: SavePlan, y: Tensor, s: Tensor | None, mean, rstd) -> Tensor | tuple:
    """Save what ``plan`` says, then the eager Functions' outputs: ``y``, and ``s`` whenever it is
    written (and so saved), so that a second derivative reaches x and residual through it
    (post-norm discards it)."""
    _save(ctx, a, plan, mean, rstd, s)
    if not plan.write_stream:
        return y
    ctx.set_materialize_grads(False)
    return y, s


class BackwardArgs(NamedTuple):
    """The arguments of one backward, as both wrappers pass them (the fields of the custom op
    ``addnorm::backward``'s schema, :data:`_BACKWARD_SCHEMA`, checked at import)."""

    dy: Tensor
    dstream: Tensor | None
    s_parts: tuple[Tensor, ...]  # (s,), or (x, residual): see addnorm.backend.Backend.backward
    weight: Tensor | None
    mean: Tensor | None
    rstd: Tensor
    rms: bool
    has_bias: bool
    backend: str
    dropout_p: float = 0.0
    seed: Tensor | None = None
    layer_scale: Tensor | None = None
    rowscale: Tensor | None = None
    param_dtype: torch.dtype | None = None  # the dtype dweight/dbias are returned in


def run_backward(b: BackwardArgs, second: tuple | None = None) -> backends.Grads:
    """The backend's backward, eagerly (the custom op ``addnorm::backward`` runs the same);
    ``second``: ``(dy1, weight1, has_bias1)`` of a second norm, for a backend with
    ``Capabilities.second_norm``."""
    impl = backends.resolve(b.backend, b.s_parts[0])
    branch = make_branch(b.dropout_p, b.seed, b.layer_scale, b.rowscale)
    return impl.backward(
        b.dy,
        b.dstream,
        tuple(b.s_parts),
        b.weight,
        b.mean,
        b.rstd,
        rms=b.rms,
        has_bias=b.has_bias,
        branch=branch,
        param_dtype=b.param_dtype,
        **({} if second is None else {"second": second}),
    )


def _to(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)  # (.to() costs a dispatch even when a no-op)


def _grads(dy, dstream, saved, meta: _Meta, backward_fn, second: tuple | None = None) -> tuple:
    """``(dx, dresidual, dweight, dbias, dlayer_scale)``: the one backward of both wrappers, from
    the saved ``(weight, mean, rstd, seed, layer_scale, rowscale, *s_parts)``; ``backward_fn``
    takes :class:`BackwardArgs`, as :func:`run_backward`. ``second``: ``(dy1, weight1,
    bias1_dtype)`` of a second norm of the same stream (:class:`EagerSecondNorm`, which passes
    :func:`run_backward`): ``dweight1``, ``dbias1`` then follow. A second derivative then
    differentiates the two norms' backward formulas and adds them (each is linear in its
    incoming gradient)."""
    weight, mean, rstd, seed, layer_scale, rowscale = saved[:6]
    s_parts = tuple(saved[6:])
    x_dtype, residual_dtype, bias_dtype, eps, rms, backend, stream_output, dropout_p = meta
    branch = make_branch(dropout_p, seed, layer_scale, rowscale)
    # an output nobody used gives its parameters no gradient (None, as torch's norms), not zeros: a
    # block's output handed to a norm that never ran (a layer LayerDrop skipped)
    unused = (dy is None, second is not None and second[0] is None)
    if dy is None:  # only the stream output was used (zeros_like: a DTensor's zeros are one too)
        dy = torch.zeros_like(s_parts[0], dtype=x_dtype)
    if not stream_output:  # no stream output, or an empty placeholder (its gradient too)
        dstream = None
    has_bias = bias_dtype is not None
    if second is not None:
        dy1, weight1, bias1_dtype = second
        if dy1 is None:  # only y and the stream were used
            dy1 = torch.zeros_like(s_parts[0], dtype=x_dtype)
        has_bias1 = bias1_dtype is not None
    if torch.is_grad_enabled():  # create_graph=True: a backward that is itself differentiable
        g = torch_kernels.differentiable_backward(dy, dstream, s_parts, weight, eps, rms, has_bias, branch)
        if second is not None:
            g1 = torch_kernels.differentiable_backward(dy1, None, s_parts, weight1, eps, rms, has_bias1, branch)
            plus = lambda u, v: None if u is None else u + v  # noqa: E731
            g = g._replace(ds=g.ds + g1.ds, dx=plus(g.dx, g1.dx), dlayer_scale=plus(g.dlayer_scale, g1.dlayer_scale))
            g = g._replace(dweight1=g1.dweight, dbias1=g1.dbias)
    else:
        # dweight and dbias straight in the parameters' dtype when they share one
        param_dtype = bias_dtype if weight is None else weight.dtype
        if has_bias and bias_dtype is not param_dtype:
            param_dtype = None
        if second is not None and (weight1.dtype is not param_dtype or has_bias1 and bias1_dtype is not param_dtype):
            param_dtype = None
        args = (
            dy,
            dstream,
            s_parts,
            weight,
            mean,
            rstd,
            rms,
            has_bias,
            backend,
            dropout_p,
            seed,
            layer_scale,
            rowscale,
        )
        b = tuple.__new__(BackwardArgs, (*args, param_dtype))
        g = backward_fn(b) if second is None else backward_fn(b, (dy1, weight1, has_bias1))
    ds = g.ds
    grads = (
        _to(ds if branch is None else g.dx, x_dtype),
        None if residual_dtype is None else _to(ds, residual_dtype),
        None if weight is None else _to(g.dweight, weight.dtype),
        _to(g.dbias, bias_dtype) if has_bias else None,
        _to(g.dlayer_scale, layer_scale.dtype) if layer_scale is not None else None,
    )
    if unused[0]:
        grads = (*grads[:2], None, None, grads[4])
    if second is None:
        return grads
    if unused[1]:
        return (*grads, None, None)
    return (*grads, _to(g.dweight1, weight1.dtype), _to(g.dbias1, bias1_dtype) if has_bias1 else None)


# --------------------------------------------------------------------------- eager


class EagerAddNorm(torch.autograd.Function):
    """Eager-mode twin of ``addnorm::forward``: the same plan and backward, no op dispatch, and
    less autograd bookkeeping: the outputs are ``y`` (and ``s`` when written) alone (the
    statistics are saved, not returned), the arguments travel as one :class:`OpArgs`, and
    ``residual`` and ``layer_scale`` are passed as inputs only when given (each input costs the
    graph some bookkeeping). (The old-style ``forward(ctx, ...)`` on purpose: with a separate
    ``setup_context``, ``Function.apply`` binds the arguments with ``inspect.signature`` on every
    call.) The tensors in ``a`` are the inputs themselves."""

    @staticmethod
    def forward(ctx, a, x, weight, bias, residual=None, layer_scale=None):
        plan, _, (y, s, mean, rstd) = train_forward(a)
        return _saved_outputs(ctx, a, plan, y, s, mean, rstd)

    @staticmethod
    def backward(ctx, dy, dstream=None):
        dx, dresidual, dweight, dbias, dlayer_scale = _grads(dy, dstream, ctx.saved_tensors, ctx.meta, run_backward)
        return None, dx, dweight, dbias, dresidual, dlayer_scale  # (trailing Nones beyond the inputs are dropped)


class PlainAddNorm(torch.autograd.Function):
    """:class:`EagerAddNorm` for a plain call (:mod:`addnorm.shortcut`: plain tensors of one dtype,
    no branch, ``residual_dtype`` or buffer), with less bookkeeping per call: the backend ``impl``
    is given, and the backward calls its ``backward`` straight. The same save plan, the same
    tensors saved, the same bits; an unused output and a second derivative take EagerAddNorm's
    backward (:func:`_grads`)."""

    @staticmethod
    def forward(ctx, a, impl, x, weight, bias, residual=None):
        plan = save_plan(impl, a, None)
        y, s, mean, rstd = impl.forward(
            x, residual, weight, bias, eps=a.eps, rms=a.rms, residual_dtype=None, write_stream=plan.write_stream
        )
        ctx.impl = impl
        return _saved_outputs(ctx, a, plan, y, s, mean, rstd)

    @staticmethod
    def backward(ctx, dy, dstream=None):
        saved, meta = ctx.saved_tensors, ctx.meta
        if dy is None or torch.is_grad_enabled():
            dx, dresidual, dweight, dbias, _ = _grads(dy, dstream, saved, meta, run_backward)
            return None, None, dx, dweight, dbias, dresidual
        weight, mean, rstd = saved[:3]
        has_bias = meta.bias_dtype is not None
        param_dtype = meta.bias_dtype if weight is None else weight.dtype  # (one dtype: the stream's, or None)
        g = ctx.impl.backward(
            dy, dstream, saved[6:], weight, mean, rstd, rms=meta.rms, has_bias=has_bias, param_dtype=param_dtype
        )
        return None, None, g.ds, g.dweight, g.dbias, None if meta.residual_dtype is None else g.ds


# Function.apply's Python wrapper binds setup_context arguments and unwraps functorch tensors:
# neither applies here (the eager route runs only outside torch.func transforms), so the C
# implementation it ends in is called directly.
eager_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, EagerAddNorm)
plain_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, PlainAddNorm)


# --------------------------------------------------------------------------- the custom ops

_FORWARD_SCHEMA = (
    "(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, bool rms, ScalarType? residual_dtype, "
    "str backend, bool prenorm, float dropout_p=0.0, Tensor? seed=None, Tensor? layer_scale=None, "
    "Tensor? rowscale=None) -> (Tensor, Tensor, Tensor, Tensor)"
)
_BACKWARD_SCHEMA = (
    "(Tensor dy, Tensor? dstream, Tensor[] s_parts, Tensor? weight, Tensor? mean, Tensor rstd, bool rms, "
    "bool has_bias, str backend, float dropout_p=0.0, Tensor? seed=None, Tensor? layer_scale=None, "
    "Tensor? rowscale=None, ScalarType? param_dtype=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
for _schema, _fields in ((_FORWARD_SCHEMA, OpArgs._fields), (_BACKWARD_SCHEMA, BackwardArgs._fields)):
    if [arg.name for arg in torch._C.parse_schema("f" + _schema).arguments] != list(_fields):
        raise AssertionError(f"a custom op's schema and its arguments' structure differ: {_schema}")


# The dispatcher may leave out trailing arguments at their defaults: OpArgs(*args) fills them.


def _forward_impl(*args, **kwargs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    a = OpArgs(*args, **kwargs)
    plan, _, (y, s, mean, rstd) = train_forward(a)
    x, rows = a.x, row_shape(a.x)
    return (
        y.contiguous(),
        s.contiguous() if plan.write_stream else x.new_empty((*rows, 0)),
        mean.view(rows) if mean is not None else x.new_empty((*rows, 0), dtype=rstd.dtype),
        rstd.view(rows),
    )


def _forward_fake(*args, **kwargs):
    a = OpArgs(*args, **kwargs)
    x = a.x
    branch = make_branch(a.dropout_p, a.seed, a.layer_scale, a.rowscale)
    plan = save_plan(backends.resolve(a.backend, x), a, branch)
    sd = reference.stream_dtype(x, a.residual, a.residual_dtype)
    cd, rows = reference.stats_dtype(sd), row_shape(x)
    s = x.new_empty(x.shape, dtype=sd) if plan.write_stream else x.new_empty((*rows, 0))
    mean = x.new_empty((*rows, 0) if a.rms else rows, dtype=cd)
    return x.new_empty(x.shape), s, mean, x.new_empty(rows, dtype=cd)


def _backward_impl(*args, **kwargs) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    b = BackwardArgs(*args, **kwargs)
    # the statistics flat, as backends take them
    b = b._replace(mean=None if b.mean is None else b.mean.reshape(-1), rstd=b.rstd.reshape(-1))
    g = run_backward(b)
    cd = b.rstd.dtype
    return (
        g.ds.contiguous(),
        g.dweight if g.dweight is not None else _no_vector(g.ds, cd),
        g.dbias if g.dbias is not None else _no_vector(g.ds, cd),
        g.dx.contiguous() if g.dx is not None else g.ds.new_empty((*row_shape(g.ds), 0)),
        g.dlayer_scale if g.dlayer_scale is not None else _no_vector(g.ds, cd),
    )


def _backward_fake(*args, **kwargs):
    b = BackwardArgs(*args, **kwargs)
    s = b.s_parts[-1]  # ds and dx have the stream dtype: the residual's with a branch
    n, cd = s.shape[-1], b.rstd.dtype
    branch = make_branch(b.dropout_p, b.seed, b.layer_scale, b.rowscale)
    vector = lambda present, dt=cd: s.new_empty((n,), dtype=dt) if present else _no_vector(s, cd)  # noqa: E731
    dx = s.new_empty(s.shape) if branch is not None else s.new_empty((*row_shape(s), 0))
    layer_scaled = branch is not None and branch.layer_scale is not None
    pd = b.param_dtype or cd
    return s.new_empty(s.shape), vector(b.weight is not None, pd), vector(b.has_bias, pd), dx, vector(layer_scaled)


# Defined with torch.library's Library, each implementation registered as the op's kernel for
# every device: the dispatcher calls it directly. (``torch.library.custom_op`` wraps each call in
# Python layers of its own, an autograd kernel even for an op without autograd: docs/benchmarks.md,
# "Per-call cost at small sizes".) addnorm::backward has no autograd kernel: it runs inside a
# backward, or is traced into one.
_LIB = torch.library.Library("addnorm", "DEF")
for _name, _schema, _impl, _fake in (
    ("forward", _FORWARD_SCHEMA, _forward_impl, _forward_fake),
    ("backward", _BACKWARD_SCHEMA, _backward_impl, _backward_fake),
):
    _LIB.define(_name + _schema)
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"addnorm::{_name}", _fake, lib=_LIB)
forward_op = torch.ops.addnorm.forward.default
backward_op = torch.ops.addnorm.backward.default


def _setup_context(ctx, inputs, output):
    """The custom op's autograd: the plan its forward made, the statistics saved as tensors."""
    a = OpArgs(*inputs)
    y, s, mean, rstd = output
    branch = make_branch(a.dropout_p, a.seed, a.layer_scale, a.rowscale)
    plan = save_plan(backends.resolve(a.backend, a.x), a, branch)
    _save(ctx, a, plan, None if a.rms else mean, rstd, s)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)


def _op_backward_grads(b: BackwardArgs) -> backends.Grads:
    return backends.Grads(*backward_op(*b))


def _op_backward(ctx, dy, dstream, _dmean, _drstd):
    dx, dresidual, dweight, dbias, dlayer_scale = _grads(dy, dstream, ctx.saved_tensors, ctx.meta, _op_backward_grads)
    return (dx, dresidual, dweight, dbias) + (None,) * 7 + (dlayer_scale, None)


torch.library.register_autograd("addnorm::forward", _op_backward, setup_context=_setup_context, lib=_LIB)


# --------------------------------------------------------------------------- a second norm


class EagerSecondNorm(torch.autograd.Function):
    """:class:`EagerAddNorm` with a second norm of the same stream (parallel blocks): outputs
    ``y``, ``y1`` (and ``s`` when written); one backward pass over the rows sums ``g = dy * weight
    + dy1 * weight1`` and gives ``dweight1``/``dbias1`` besides the rest (:func:`_grads`).

    ``x1``: parallel blocks' second sublayer output, added to the residual in the forward's pass
    (``Capabilities.adds_x1``), without dropout and on a stream that is saved (pre-norm, no
    branch: :func:`addnorm.ops._adds_x1`): its gradient is then ``ds`` itself, as the separate
    pass's (:class:`addnorm.dropped.DroppedAdd`) would give."""

    @staticmethod
    def forward(ctx, a, x, weight, bias, weight1, bias1, residual=None, layer_scale=None, x1=None):
        added = None if x1 is None else backends.X1(x1, 0.0, None)
        plan, branch, (y, s, mean, rstd, y1) = train_forward(a, (weight1, bias1), x1=added)
        if x1 is not None and (plan.save_inputs or branch is not None):  # the backward would lack x1
            raise RuntimeError("x1 in the norm's pass needs a saved stream and no branch (addnorm.ops._adds_x1)")
        ctx.save_for_backward(a.weight, mean, rstd, a.seed, a.layer_scale, a.rowscale, weight1, *_saved(a, s, plan))
        ctx.meta, ctx.bias1_dtype = _meta(a, plan.write_stream), None if bias1 is None else bias1.dtype
        ctx.x1_dtype = None if x1 is None else x1.dtype
        ctx.set_materialize_grads(False)
        if not plan.write_stream:
            return y, y1
        return y, y1, s

    @staticmethod
    def backward(ctx, dy, dy1, dstream=None):
        saved = ctx.saved_tensors  # weight1 after the six of EagerAddNorm, before s_parts
        second = (dy1, saved[6], ctx.bias1_dtype)
        dx, dresidual, dweight, dbias, dls, dweight1, dbias1 = _grads(
            dy, dstream, saved[:6] + saved[7:], ctx.meta, run_backward, second
        )
        dx1 = None if ctx.x1_dtype is None or dresidual is None else _to(dresidual, ctx.x1_dtype)
        return None, dx, dweight, dbias, dweight1, dbias1, dresidual, dls, dx1


def transformed() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp, ...) or forward-mode AD is active: then the
    tensors are seen through the autograd.Functions' own rules, never the eager shortcuts. (An
    ``isinstance`` test rather than ``is not None``: torch.compile traces the stack's top as an
    object, which is never None, where ``isinstance`` reads what it holds.)"""
    interpreter = torch._C._functorch.peek_interpreter_stack()
    return isinstance(interpreter, torch._C._functorch.CInterpreter) or torch.autograd.forward_ad._current_level >= 0
