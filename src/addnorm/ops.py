"""Argument checks, the plan of what is written and saved, the custom ops, and dispatch.

Every public function ends in :func:`add_norm`, which checks its arguments, picks the backend
(:mod:`addnorm.backend`: ``"auto"`` by device alone, so every size takes the same path with the
same numerics) and runs it one of five ways, all computing the same formulas:

- eager training: :class:`_EagerAddNorm`, an ``autograd.Function`` around the backend's forward
  and hand-written backward (a Python custom op would cost tens of µs of dispatch per call);
- eager inference (no input requires grad, or ``no_grad``): the backend's forward alone, nothing
  saved, the stream and the statistics not even written unless returned;
- compiled graphs (``torch.compile``/``torch.export``), tensor subclasses (FakeTensor, DTensor,
  ...) and ``torch.jit.trace``: the custom ops ``addnorm::forward``/``addnorm::backward``, whose
  fake kernels, autograd registration and the dispatcher take care of each (DTensor through the
  sharding rules of :mod:`addnorm.sharding`, which run the ops on each rank's local shard);
- ``torch.func`` transforms and forward-mode AD: :func:`addnorm.reference.composite`, the
  reference formulas as differentiable torch ops, so that every transform composes;
- jagged nested tensors: the norm of their packed values.

The first and third share :func:`plan` (what the forward writes and what is saved) and the
backward (:func:`_make_backward`); a second derivative (``create_graph=True``) differentiates
the hand-written backward formulas themselves (:func:`addnorm.reference.differentiable_backward`).
"""

from __future__ import annotations

import math
import numbers
import sys
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd import forward_ad

from . import backend as backends
from . import reference

_is_compiling, _is_exporting = torch.compiler.is_compiling, torch.compiler.is_exporting
_tracing_state = torch._C._get_tracing_state
_functorch_level = torch._C._functorch.peek_interpreter_stack
_PLAIN = (Tensor, torch.nn.Parameter)  # the tensor types the eager paths hand to a kernel
# RMSNorm's default eps per input dtype, as torch: the machine epsilon of the statistics dtype
_RMS_DEFAULT_EPS = {
    dt: torch.finfo(reference.stats_dtype(dt)).eps
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


# --------------------------------------------------------------------------- the plan


class Plan(NamedTuple):
    """What a training call's forward writes (besides y, mean and rstd) and what it saves."""

    write_stream: bool  # the forward writes s = x + residual
    save_inputs: bool  # training saves x and residual (the backward recomputes s), else s (or x)


def plan(
    impl: backends.Backend,
    x: Tensor,
    residual: Tensor | None,
    residual_dtype: torch.dtype | None,
    prenorm: bool,
    branch: backends.Branch | None = None,
) -> Plan:
    """One plan for both ways a training call runs (eager and the custom op).

    Training saves ``s`` (``x`` without a residual), ``mean``, ``rstd`` and the weight. Post-norm
    on a backend that ``recomputes_stream`` saves ``x`` and ``residual`` instead and the forward
    never writes ``s``: in a Transformer the memory kept is the same (``residual`` is kept anyway
    as the input of the next sublayer), and a fresh output fewer is written. Only when both
    already have the stream dtype, so that the sum is bit for bit the forward's. (Inference,
    :func:`_infer`, writes the stream only when it is returned, and no statistics.) With a
    branch (dropout, layer scale, rowscale) every backend saves ``x`` and ``residual``: ``dx`` is
    not ``ds``, the layer scale's gradient reads ``x``, and the keep mask is recomputed from the
    seed, never saved.
    """
    if residual is None:
        return _NORM_ONLY
    if branch is not None:
        return Plan(prenorm, True)
    save_inputs = (
        residual is not None
        and not prenorm
        and impl.CAPABILITIES.recomputes_stream
        and x.dtype == residual.dtype
        and residual_dtype in (None, x.dtype)
    )
    return Plan(residual is not None and not save_inputs, save_inputs)


_NORM_ONLY = Plan(False, False)  # no residual: nothing to write but y, and x is saved


# --------------------------------------------------------------------------- custom ops and autograd


def _empty(like: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty((0,), dtype=dtype, device=like.device)


def _rows(x: Tensor) -> tuple[int, ...]:
    """The shape of the ops' per-row tensors: one per row, ``x.shape[:-1]`` (the statistics,
    ``rowscale``). Their row-shaped placeholders (RMSNorm's mean, a stream or ``dx`` not written)
    are empty, of shape ``_rows(x) + (0,)``. Keeping x's leading dims lets a DTensor shard them
    like x's (:mod:`addnorm.sharding`); a backend takes them flat."""
    return x.shape[:-1]


def _train_forward(
    x, residual, weight, bias, eps, rms, residual_dtype, backend, prenorm, dropout_p, seed, layer_scale, rowscale
) -> tuple[Plan, tuple]:
    """``(plan, (y, s, mean, rstd))``: the forward of a training call, as :func:`plan` says, for
    both the custom op and the eager ``autograd.Function``."""
    impl = backends.resolve(backend, x)
    branch = _branch(dropout_p, seed, layer_scale, rowscale)
    p = plan(impl, x, residual, residual_dtype, prenorm, branch)
    return p, impl.forward(
        x,
        residual,
        weight,
        bias,
        eps=eps,
        rms=rms,
        residual_dtype=residual_dtype,
        write_stream=p.write_stream,
        branch=branch,
    )


def _forward_impl(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    residual_dtype: torch.dtype | None,
    backend: str,
    prenorm: bool,
    dropout_p: float = 0.0,
    seed: Tensor | None = None,
    layer_scale: Tensor | None = None,
    rowscale: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    p, (y, s, mean, rstd) = _train_forward(
        x, residual, weight, bias, eps, rms, residual_dtype, backend, prenorm, dropout_p, seed, layer_scale, rowscale
    )
    cd = rstd.dtype
    return (
        y.contiguous(),
        s.contiguous() if p.write_stream else x.new_empty((*_rows(x), 0)),
        mean.view(_rows(x)) if mean is not None else x.new_empty((*_rows(x), 0), dtype=cd),
        rstd.view(_rows(x)),
    )


def _branch(p: float, seed: Tensor | None, layer_scale: Tensor | None, rowscale: Tensor | None):
    """The :class:`~addnorm.backend.Branch` of these arguments, None when it changes nothing
    (``rowscale`` flat, one factor per row, as backends take it)."""
    if rowscale is None and layer_scale is None and not p:  # (as backends.active, without a tuple)
        return None
    return backends.Branch(p, seed, layer_scale, None if rowscale is None else rowscale.reshape(-1))


def _run_backward(
    dy, dstream, s_parts, weight, mean, rstd, rms, has_bias, backend, p, seed, layer_scale, rowscale, param_dtype
) -> backends.Grads:
    impl = backends.resolve(backend, s_parts[0])
    branch = _branch(p, seed, layer_scale, rowscale)
    return impl.backward(
        dy, dstream, s_parts, weight, mean, rstd, rms=rms, has_bias=has_bias, branch=branch, param_dtype=param_dtype
    )


def _backward_impl(
    dy: Tensor,
    dstream: Tensor | None,
    s_parts: list[Tensor],
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    rms: bool,
    has_bias: bool,
    backend: str,
    dropout_p: float = 0.0,
    seed: Tensor | None = None,
    layer_scale: Tensor | None = None,
    rowscale: Tensor | None = None,
    param_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    mean = None if mean is None else mean.reshape(-1)  # statistics flat, as backends take them
    branch_args = (dropout_p, seed, layer_scale, rowscale)
    s_parts = tuple(s_parts)
    rstd = rstd.reshape(-1)
    g = _run_backward(dy, dstream, s_parts, weight, mean, rstd, rms, has_bias, backend, *branch_args, param_dtype)
    cd = rstd.dtype
    return (
        g.ds.contiguous(),
        g.dweight if g.dweight is not None else _empty(g.ds, cd),
        g.dbias if g.dbias is not None else _empty(g.ds, cd),
        g.dx.contiguous() if g.dx is not None else g.ds.new_empty((*_rows(g.ds), 0)),
        g.dlayer_scale if g.dlayer_scale is not None else _empty(g.ds, cd),
    )


_forward_op = torch.library.custom_op("addnorm::forward", _forward_impl, mutates_args=())
_backward_op = torch.library.custom_op("addnorm::backward", _backward_impl, mutates_args=())


@_forward_op.register_fake
def _forward_fake(
    x,
    residual,
    weight,
    bias,
    eps,
    rms,
    residual_dtype,
    backend,
    prenorm,
    dropout_p=0.0,
    seed=None,
    layer_scale=None,
    rowscale=None,
):
    branch = _branch(dropout_p, seed, layer_scale, rowscale)
    p = plan(backends.resolve(backend, x), x, residual, residual_dtype, prenorm, branch)
    sd = reference.stream_dtype(x, residual, residual_dtype)
    cd = reference.stats_dtype(sd)
    s = x.new_empty(x.shape, dtype=sd) if p.write_stream else x.new_empty((*_rows(x), 0))
    mean = x.new_empty((*_rows(x), 0) if rms else _rows(x), dtype=cd)
    return x.new_empty(x.shape), s, mean, x.new_empty(_rows(x), dtype=cd)


@_backward_op.register_fake
def _backward_fake(
    dy,
    dstream,
    s_parts,
    weight,
    mean,
    rstd,
    rms,
    has_bias,
    backend,
    dropout_p=0.0,
    seed=None,
    layer_scale=None,
    rowscale=None,
    param_dtype=None,
):
    s = s_parts[-1]  # ds and dx have the stream dtype: the residual's with a branch
    n, cd = s.shape[-1], rstd.dtype
    branch = _branch(dropout_p, seed, layer_scale, rowscale)
    vector = lambda present, dt=cd: s.new_empty((n,), dtype=dt) if present else _empty(s, cd)  # noqa: E731
    dx = s.new_empty(s.shape) if branch is not None else s.new_empty((*_rows(s), 0))
    layer_scaled = branch is not None and branch.layer_scale is not None
    pd = param_dtype or cd
    return s.new_empty(s.shape), vector(weight is not None, pd), vector(has_bias, pd), dx, vector(layer_scaled)


def _saved(x: Tensor, residual: Tensor | None, s: Tensor | None, p: Plan) -> tuple[Tensor, ...]:
    """The backward's ``s_parts`` under plan ``p``: ``(x, residual)`` to recompute ``s`` from, or
    the stream itself (``x`` without a residual)."""
    return (x, residual) if p.save_inputs else (x if residual is None else s,)


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


def _meta(x, residual, bias, eps, rms, backend, stream_output, dropout_p) -> _Meta:
    fields = (
        x.dtype,
        None if residual is None else residual.dtype,
        None if bias is None else bias.dtype,
        eps,
        rms,
        backend,
        stream_output,
        dropout_p,
    )
    return tuple.__new__(_Meta, fields)  # (what _Meta(*fields) makes, without its Python __new__)


def _setup_context(ctx, inputs, output):
    """The custom op's autograd: the plan its forward made, the statistics saved as tensors."""
    x, residual, weight, bias, eps, rms, residual_dtype, backend, prenorm, p, seed, layer_scale, rowscale = inputs
    y, s, mean, rstd = output
    branch = _branch(p, seed, layer_scale, rowscale)
    pl = plan(backends.resolve(backend, x), x, residual, residual_dtype, prenorm, branch)
    ctx.save_for_backward(weight, None if rms else mean, rstd, seed, layer_scale, rowscale, *_saved(x, residual, s, pl))
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)
    ctx.meta = _meta(x, residual, bias, eps, rms, backend, pl.write_stream, p)


def _to(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)  # .to() itself costs ~1 µs even when a no-op


def _grads(dy, dstream, saved, meta: _Meta, backward_fn) -> tuple:
    """``(dx, dresidual, dweight, dbias, dlayer_scale)``: the one backward of both autograd
    wrappers, from the saved ``(weight, mean, rstd, seed, layer_scale, rowscale, *s_parts)``."""
    weight, mean, rstd, seed, layer_scale, rowscale = saved[:6]
    s_parts = tuple(saved[6:])
    x_dtype, residual_dtype, bias_dtype, eps, rms, backend, stream_output, p = meta
    branch = _branch(p, seed, layer_scale, rowscale)
    if dy is None:  # only the stream output was used (zeros_like: a DTensor's zeros are one too)
        dy = torch.zeros_like(s_parts[0], dtype=x_dtype)
    if not stream_output:  # no stream output, or an empty placeholder (its gradient too)
        dstream = None
    has_bias = bias_dtype is not None
    if torch.is_grad_enabled():  # create_graph=True: a backward that is itself differentiable
        g = reference.differentiable_backward(dy, dstream, s_parts, weight, eps, rms, has_bias, branch)
    else:
        # dweight and dbias straight in the parameters' dtype when they share one
        param_dtype = bias_dtype if weight is None else weight.dtype
        if has_bias and bias_dtype is not param_dtype:
            param_dtype = None
        g = backward_fn(
            dy,
            dstream,
            s_parts,
            weight,
            mean,
            rstd,
            rms,
            has_bias,
            backend,
            p,
            seed,
            layer_scale,
            rowscale,
            param_dtype,
        )
    ds = g.ds
    return (
        _to(ds if branch is None else g.dx, x_dtype),
        None if residual_dtype is None else _to(ds, residual_dtype),
        None if weight is None else _to(g.dweight, weight.dtype),
        _to(g.dbias, bias_dtype) if has_bias else None,
        _to(g.dlayer_scale, layer_scale.dtype) if layer_scale is not None else None,
    )


def _op_backward_grads(*args) -> backends.Grads:
    return backends.Grads(*_backward_op(*args))


def _op_backward(ctx, dy, dstream, _dmean, _drstd):
    dx, dresidual, dweight, dbias, dlayer_scale = _grads(dy, dstream, ctx.saved_tensors, ctx.meta, _op_backward_grads)
    return (dx, dresidual, dweight, dbias) + (None,) * 7 + (dlayer_scale, None)


_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


class _EagerAddNorm(torch.autograd.Function):
    """Eager-mode twin of ``addnorm::forward``: the same implementation, plan and backward, no op
    dispatch, and less autograd bookkeeping: the outputs are ``y`` (and ``s`` for pre-norm) alone
    (the statistics are saved, not returned), the arguments that are no tensors travel as one
    tuple, and ``residual`` and ``layer_scale`` are passed only when given (each input costs the
    autograd graph some bookkeeping). (The old-style ``forward(ctx, ...)`` on purpose: with a
    separate ``setup_context``, ``Function.apply`` binds the arguments with ``inspect.signature``
    on every call.)"""

    @staticmethod
    def forward(ctx, x, weight, bias, options, residual=None, layer_scale=None):
        eps, rms, residual_dtype, backend, prenorm, p, seed, rowscale = options
        pl, (y, s, mean, rstd) = _train_forward(
            x, residual, weight, bias, eps, rms, residual_dtype, backend, prenorm, p, seed, layer_scale, rowscale
        )
        ctx.save_for_backward(weight, mean, rstd, seed, layer_scale, rowscale, *_saved(x, residual, s, pl))
        # s is an output whenever it is written (and so saved), so that a second derivative
        # reaches x and residual through it; post-norm discards it
        ctx.meta = _meta(x, residual, bias, eps, rms, backend, pl.write_stream, p)
        if not pl.write_stream:
            return y
        ctx.set_materialize_grads(False)
        return y, s

    @staticmethod
    def backward(ctx, dy, dstream=None):
        dx, dresidual, dweight, dbias, dlayer_scale = _grads(dy, dstream, ctx.saved_tensors, ctx.meta, _run_backward)
        return dx, dweight, dbias, None, dresidual, dlayer_scale  # (trailing Nones beyond the inputs are dropped)


# Function.apply's Python wrapper binds setup_context arguments and unwraps functorch tensors:
# neither applies here (the eager path runs only outside torch.func transforms), so the C
# implementation it ends in is called directly: several µs less per training call.
_eager_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _EagerAddNorm)


# --------------------------------------------------------------------------- checks

_FLOAT_DTYPES = "float16, bfloat16, float32 or float64"
# float8 and other exotic floats pass is_floating_point() but no backend computes in them.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)


def _check_float_tensor(name: str, t: object) -> Tensor:
    if type(t) in _PLAIN and t.dtype in _SUPPORTED:
        return t
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor ({_FLOAT_DTYPES}), got {t.dtype}")
    return t


def normalize_shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    """``normalized_shape`` as a tuple of positive ints, or a clear error."""
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        shape: tuple = (int(normalized_shape),)
    elif isinstance(normalized_shape, (Sequence, torch.Size)) and not isinstance(normalized_shape, str):
        shape = tuple(normalized_shape)
    else:
        raise TypeError(f"normalized_shape must be an int or a sequence of ints, got {type(normalized_shape).__name__}")
    if not shape or not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and d > 0 for d in shape):
        raise ValueError(f"normalized_shape must be one or more positive ints, got {normalized_shape!r}")
    return tuple(int(d) for d in shape)


def _check_param(name: str, p: Tensor | None, shape: tuple[int, ...], x: Tensor) -> None:
    if p is None:
        return
    _check_float_tensor(name, p)
    if p.shape != shape:
        raise ValueError(f"{name} must have shape {shape} (normalized_shape), got {tuple(p.shape)}")
    if not (p.is_cpu and x.is_cpu) and p.device != x.device:
        raise ValueError(f"{name} is on {p.device} but x is on {x.device}; expected the same device")


def check_eps(eps: object) -> float:
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool):
        raise TypeError(f"eps must be a non-negative finite number, got {type(eps).__name__} {eps!r}")
    if not math.isfinite(eps) or eps < 0:  # eps=inf would silently turn every output into bias
        raise ValueError(f"eps must be a non-negative finite number, got {eps!r}")
    return float(eps)


def check_backend(backend: object) -> str:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, one of {backends.names()}, got {type(backend).__name__}")
    if backend != "auto" and backend not in backends.REGISTRY:
        raise ValueError(f"backend must be one of {backends.names()}, got {backend!r}")
    return backend


def check_flag(name: str, value: object) -> bool:
    # A truthy string such as prenorm="no" would silently change what is returned.
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_residual_dtype(residual_dtype: object) -> torch.dtype | None:
    if residual_dtype is not None and residual_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"residual_dtype must be None or a torch dtype ({_FLOAT_DTYPES}), got {residual_dtype!r}")
    return residual_dtype


def check_inputs(
    x: object,
    residual: object,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: object,
    residual_dtype: object,
) -> tuple[tuple[int, ...], float]:
    """Validate the arguments of a public op; returns ``(normalized_shape, eps)``. Each check
    first tests the common case in a few attribute reads, as a small norm's whole call is a few
    µs (docs/benchmarks.md, "Per-call cost at small sizes"); only a failing test calls the
    function that finds and words the error."""
    if not (type(x) in _PLAIN and x.dtype in _SUPPORTED):
        x = _check_float_tensor("x", x)
    n = normalized_shape
    if type(n) is not int and type(n) in (tuple, torch.Size) and len(n) == 1 and type(n[0]) is int:
        n = n[0]  # a module's (n,)
    if type(n) is int and 2 < n:
        shape: tuple[int, ...] = (n,)
        if x.dim() == 0 or x.shape[-1] != n:
            raise ValueError(f"x of shape {tuple(x.shape)} must end with normalized_shape {shape}")
    else:
        shape = normalize_shape(normalized_shape)
        if tuple(x.shape[x.dim() - len(shape) :]) != shape or x.dim() < len(shape):
            raise ValueError(f"x of shape {tuple(x.shape)} must end with normalized_shape {shape}")
        n = math.prod(shape)
        if n <= 2:
            warnings.warn(
                f"normalizing over {n} feature(s): every output row is then ±1 (or 0) times weight, "
                "plus bias, whatever the input; project the features to a wider dimension first",
                UserWarning,
                stacklevel=4,
            )
    cpu = x.is_cpu
    if weight is not None and not (
        type(weight) in _PLAIN and weight.dtype in _SUPPORTED and weight.shape == shape and weight.is_cpu and cpu
    ):
        _check_param("weight", weight, shape, x)
    if bias is not None and not (
        type(bias) in _PLAIN and bias.dtype in _SUPPORTED and bias.shape == shape and bias.is_cpu and cpu
    ):
        _check_param("bias", bias, shape, x)
    if residual is not None:
        if not (type(residual) in _PLAIN and residual.dtype in _SUPPORTED):
            residual = _check_float_tensor("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
        if not (residual.is_cpu and cpu) and residual.device != x.device:
            raise ValueError(f"residual is on {residual.device} but x is on {x.device}; expected the same device")
    if residual_dtype is not None:
        check_residual_dtype(residual_dtype)
    if type(eps) is not float or not 0.0 <= eps < math.inf:
        eps = check_eps(eps)
    return shape, eps


def _check_out(x, residual, out, residual_out, sd, needs_grad) -> None:
    """``out``/``residual_out`` must be contiguous buffers of the results' shape, dtype and device."""
    if needs_grad:
        raise RuntimeError(
            "out= and residual_out= do not support autograd: an input requires grad; "
            "call under torch.no_grad() / torch.inference_mode(), or drop out="
        )
    if residual_out is not None and residual is None:
        raise ValueError("residual_out= needs a residual: only add_layer_norm/add_rms_norm produce a stream")
    for name, t, dtype in (("out", out, x.dtype), ("residual_out", residual_out, sd)):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != x.shape or t.dtype != dtype or t.device != x.device or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous {dtype} tensor of shape {tuple(x.shape)} on "
                f"{x.device}, got {'' if t.is_contiguous() else 'non-contiguous '}"
                f"{t.dtype} of shape {tuple(t.shape)} on {t.device}"
            )


# --------------------------------------------------------------------------- entry point


class Sublayer(NamedTuple):
    """The keyword-only arguments on the sublayer branch of Add & Norm and on the weight (all off
    by default): ``s = residual + rowscale * layer_scale * dropout(x)``, the norm scaled by
    ``1 + weight`` when ``zero_centered_weight``."""

    dropout_p: float = 0.0
    generator: torch.Generator | None = None
    layer_scale: Tensor | None = None
    rowscale: Tensor | None = None
    zero_centered_weight: bool = False
    return_dropout_mask: bool = False


_NO_SUBLAYER = Sublayer()


def add_norm(
    x: Tensor,
    residual: Tensor | None,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    *,
    rms: bool,
    prenorm: bool,
    residual_dtype: torch.dtype | None,
    backend: str,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
    sublayer: Sublayer = _NO_SUBLAYER,
) -> Tensor | tuple[Tensor, ...]:
    """The one entry point behind every function of :mod:`addnorm.functional` (module docstring)."""
    if eps is None and rms:  # RMSNorm's default (a bad x or dtype is reported by check_inputs)
        eps = _RMS_DEFAULT_EPS.get(getattr(x, "dtype", None), 0.0)
    if isinstance(x, Tensor) and x.is_nested:
        if sublayer != _NO_SUBLAYER:
            raise TypeError("dropout_p, layer_scale, rowscale and zero_centered_weight take plain tensors, not nested")
        return _nested(
            x, residual, normalized_shape, weight, bias, eps, rms, prenorm, residual_dtype, backend, out, residual_out
        )
    shape, eps = check_inputs(x, residual, normalized_shape, weight, bias, eps, residual_dtype)
    if type(prenorm) is not bool:
        check_flag("prenorm", prenorm)
    if backend != "auto":
        check_backend(backend)
    branch = None
    if sublayer is not _NO_SUBLAYER and sublayer != _NO_SUBLAYER:  # a field off its default
        weight, branch = _sublayer(x, residual, shape, weight, sublayer)
    exporting, tracing = _is_exporting(), _tracing_state() is not None
    if (exporting or tracing) and torch.onnx.is_in_onnx_export():
        branch = None if branch is None else _branch(*branch)  # rowscale flat
        return _onnx_form(x, residual, shape, weight, bias, eps, rms, prenorm, residual_dtype, branch)
    if len(shape) > 1:  # rows of n features: the normalized dims flattened into one
        n = math.prod(shape)
        flat = lambda t: None if t is None else t.reshape(*t.shape[: t.dim() - len(shape)], n)  # noqa: E731
        x, residual, weight, bias, out, residual_out = map(flat, (x, residual, weight, bias, out, residual_out))
        if branch is not None:
            branch = branch._replace(layer_scale=flat(branch.layer_scale))
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad
        or (residual is not None and residual.requires_grad)
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
        or (branch is not None and branch.layer_scale is not None and branch.layer_scale.requires_grad)
    )
    buffers = out is not None or residual_out is not None
    if buffers:
        _check_out(x, residual, out, residual_out, reference.stream_dtype(x, residual, residual_dtype), needs_grad)
    if branch is not None:  # the stream dtype is the saved residual's (backend.Branch)
        residual = _to(residual, reference.stream_dtype(x, residual, residual_dtype))
    p, seed, layer_scale, rowscale = branch or _NO_BRANCH
    if (
        type(x) not in _PLAIN
        or (residual is not None and type(residual) not in _PLAIN)
        or (weight is not None and type(weight) not in _PLAIN)
        or (bias is not None and type(bias) not in _PLAIN)
        or exporting
        or tracing
        or _is_compiling()
        or _functorch_level() is not None
        or forward_ad._current_level >= 0
    ):
        args = (x, residual, weight, bias, eps, rms, residual_dtype, backend, prenorm, p, seed, layer_scale, rowscale)
        y, s = _traced_or_transformed(args, buffers, out, residual_out)
    elif needs_grad:  # layer_scale may take a gradient
        options = (eps, rms, residual_dtype, backend, prenorm, p, seed, rowscale)
        if layer_scale is not None:
            out = _eager_apply(x, weight, bias, options, residual, layer_scale)
        elif residual is not None:
            out = _eager_apply(x, weight, bias, options, residual)
        else:
            out = _eager_apply(x, weight, bias, options)
        y, s = out if type(out) is tuple else (out, None)
    else:
        branch = None if branch is None else _branch(*branch)  # rowscale flat
        y, s = _infer(x, residual, weight, bias, eps, rms, residual_dtype, backend, prenorm, branch, out, residual_out)
    if len(shape) == 1 and not prenorm and not sublayer.return_dropout_mask:
        return y  # the common case, without the tuple below
    result = (y, s) if prenorm else (y,)
    if sublayer.return_dropout_mask:
        result += (_dropout_mask(x, branch),)
    if len(shape) > 1:
        result = tuple(t.unflatten(-1, shape) for t in result)
    return result if len(result) > 1 else result[0]


_NO_BRANCH = backends.Branch(0.0, None, None, None)


def _sublayer(x, residual, shape, weight, sub: Sublayer) -> tuple[Tensor | None, backends.Branch | None]:
    """Check the :class:`Sublayer` arguments; ``(weight, branch)``: the weight the norm applies
    (``1 + weight`` in the statistics dtype when zero-centred), and the active branch, its
    dropout seed drawn from ``generator`` (None when nothing is on)."""
    p, generator, layer_scale, rowscale, zero_centered, return_mask = sub
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= p <= 1:  # NaN fails too
        raise ValueError(f"dropout_p must be a probability in [0, 1], got {p!r}")
    check_flag("zero_centered_weight", zero_centered)
    check_flag("return_dropout_mask", return_mask)
    if residual is None and (p or layer_scale is not None or rowscale is not None):
        raise ValueError("dropout_p, layer_scale and rowscale act on the sublayer output added to a residual")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if generator.device.type != x.device.type or (x.is_cuda and generator.device != x.device):
            raise ValueError(f"generator is on {generator.device} but x is on {x.device}; expected x's device")
    _check_param("layer_scale", layer_scale, shape, x)
    if rowscale is not None:
        _check_float_tensor("rowscale", rowscale)
        lead = tuple(x.shape[: x.dim() - len(shape)])
        if tuple(rowscale.shape) != lead or rowscale.device != x.device:
            raise ValueError(
                f"rowscale must have x's leading dims {lead} (one factor per row) on {x.device}, "
                f"got {tuple(rowscale.shape)} on {rowscale.device}"
            )
        if rowscale.requires_grad and torch.is_grad_enabled():
            raise ValueError("rowscale is a per-row constant (drop path) and takes no gradient: pass rowscale.detach()")
    if zero_centered:
        if weight is None:
            raise ValueError("zero_centered_weight=True scales by 1 + weight: it needs a weight")
        weight = weight.to(reference.stats_dtype(weight.dtype)) + 1
    seed = draw_seed(generator, x.device) if p > 0 else None
    return weight, backends.active(backends.Branch(float(p), seed, layer_scale, rowscale))


def draw_seed(generator: torch.Generator | None, device: torch.device) -> Tensor:
    """The dropout mask's 0-d int64 seed for one call, drawn from ``generator`` (torch's default
    generator of ``device`` when None): on the device, so a CUDA call does not synchronize."""
    return torch.randint(0, 2**62, (), dtype=torch.int64, device=device, generator=generator)


def _dropout_mask(x: Tensor, branch: backends.Branch | None) -> Tensor:
    """The keep mask the call used, as a bool tensor of x's shape (all True without dropout)."""
    if branch is None or branch.p == 0:
        return torch.ones(x.shape, dtype=torch.bool, device=x.device)
    rows = torch.arange(x.numel() // x.shape[-1] if x.shape[-1] else 0, device=x.device)
    return reference.keep_mask(branch.seed, rows, x.shape[-1], branch.p).view(x.shape)


def _infer(x, residual, weight, bias, eps, rms, residual_dtype, backend, prenorm, branch, out, residual_out):
    """Inference: the backend's forward alone, no autograd, nothing saved, the stream only when
    it is returned, into ``out``/``residual_out`` when given. (``branch`` as the backends take it:
    None when inactive, ``rowscale`` flat.)"""
    y, s, _, _ = backends.resolve(backend, x).forward(
        x,
        residual,
        weight,
        bias,
        eps=eps,
        rms=rms,
        residual_dtype=residual_dtype,
        write_stream=prenorm or residual_out is not None,
        write_stats=False,
        out=out,
        residual_out=residual_out,
        branch=branch,
    )
    return y, s


def _traced_or_transformed(args, buffers: bool, out, residual_out) -> tuple[Tensor, Tensor | None]:
    """``(y, s)`` for graphs being traced, ``torch.func`` transforms, forward-mode AD and tensor
    subclasses (module docstring)."""
    x, residual, weight, bias, eps, rms, residual_dtype, backend, prenorm, *branch_args = args
    if (_is_compiling() or _is_exporting()) and not buffers:
        _dtensor_rules()
        y, s, _, _ = _forward_op(*args)
        return y, s
    if _functorch_level() is not None or forward_ad._current_level >= 0:
        n = x.shape[-1]  # the reference formulas as torch ops, which every transform composes
        y, s = reference.composite(
            x.reshape(-1, n),
            None if residual is None else residual.reshape(-1, n),
            weight,
            bias,
            eps,
            rms,
            residual_dtype,
            _branch(*branch_args),
        )
        return y.view(x.shape), s.view(x.shape)
    if _dtensor_rules():
        _check_dtensors(x, residual, weight, bias, buffers, dropout_p=branch_args[0])
    if buffers:  # written eagerly, outside any graph (no autograd: _check_out)
        return _infer(*args[:9], _branch(*branch_args), out, residual_out)
    y, s, _, _ = _forward_op(*args)
    return y, s


@torch.compiler.assume_constant_result  # torch.compile calls it while tracing, not in the graph
def _dtensor_rules() -> bool:
    """Whether DTensor is loaded; if so, addnorm's sharding rules are registered with it (once,
    :mod:`addnorm.sharding`), so that DTensor's dispatch runs the ops on local shards. A DTensor
    exists only once ``torch.distributed.tensor`` is imported: it is never imported here."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from . import sharding

    sharding.register()
    return True


def _check_dtensors(x, residual, weight, bias, buffers: bool, dropout_p: float) -> None:
    """What DTensors cannot do here (DTensor loaded): write into ``out=`` buffers, and take
    dropout on rows sharded over ranks, whose keep mask is a function of each row's index in the
    call: a shard of the rows would draw the masks of other rows, the same on every rank (the
    sharding rules would gather the rows instead: a cost better asked for than hidden)."""
    dtensor = sys.modules["torch.distributed.tensor"].DTensor
    if buffers and any(isinstance(t, dtensor) for t in (x, residual, weight, bias)):
        raise ValueError("out= and residual_out= take plain tensors, not DTensors")
    placements = [p for t in (x, residual) if isinstance(t, dtensor) for p in t.placements]
    if dropout_p > 0 and not all(p.is_replicate() for p in placements):
        raise ValueError(
            "dropout_p > 0 needs x and residual replicated when they are DTensors: the keep mask is a function "
            "of each row's index, which a shard of the rows does not know. Keep dropout_p=0 and apply "
            "torch.nn.Dropout to the sublayer output before the norm, or redistribute x and residual to "
            "Replicate()"
        )


def _nested(x, residual, shape, weight, bias, eps, rms, prenorm, residual_dtype, backend, out, residual_out):
    """A jagged nested tensor normalized over its last (regular) dim, as torch's layer_norm does:
    the norm of its packed values, rows of the same features whatever their sequence."""
    shape = normalize_shape(shape)
    if x.layout != torch.jagged or len(shape) != 1 or x.dim() < 3 or x._ragged_idx == x.dim() - 1:
        raise TypeError(
            "nested tensors are supported with layout=torch.jagged, normalized over their last "
            f"(regular) dim; got layout {x.layout} with normalized_shape {shape}"
        )
    if out is not None or residual_out is not None:
        raise ValueError("out= and residual_out= take plain tensors, not nested ones")
    if residual is not None and (
        not residual.is_nested
        or residual.layout != torch.jagged
        or residual.offsets() is not x.offsets()
        and not torch.equal(residual.offsets(), x.offsets())
    ):
        raise ValueError("residual must be a jagged nested tensor with the offsets of x")
    result = add_norm(
        x.values(),
        None if residual is None else residual.values(),
        shape,
        weight,
        bias,
        eps,
        rms=rms,
        prenorm=prenorm,
        residual_dtype=residual_dtype,
        backend=backend,
    )
    wrap = lambda v: torch.nested.nested_tensor_from_jagged(v, x.offsets(), lengths=x.lengths())  # noqa: E731
    return (wrap(result[0]), wrap(result[1])) if prenorm else wrap(result)


def _onnx_form(x, residual, shape, weight, bias, eps, rms, prenorm, residual_dtype, branch):
    """What ``torch.onnx.export`` traces instead of the custom op: torch's own norm, which it
    writes as the standard ``LayerNormalization`` (opset 17+) / ``RMSNormalization`` (opset 23;
    primitive ops below), and a plain ``Add`` that runtimes fuse themselves."""
    s = reference.stream(x, residual, residual_dtype, branch)
    if rms:
        y = torch.nn.functional.rms_norm(s, shape, weight, eps)
    else:
        y = torch.nn.functional.layer_norm(s, shape, weight, bias, eps)
    y = y.to(x.dtype)
    return (y, s) if prenorm else y
