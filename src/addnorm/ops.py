"""The one entry point behind every public function, and the one router that picks how a call runs.

:func:`add_norm` checks its arguments (:mod:`addnorm.checks`), picks the backend
(:mod:`addnorm.backend`: ``"auto"`` by device alone, so every size takes the same path with the
same numerics) and hands the call to one route, chosen by :func:`_route`. Every route computes
the same formulas (:mod:`addnorm.reference`):

============  =====================================================================================
route         taken by
============  =====================================================================================
nested        jagged nested tensors: the norm of their packed values
onnx          ``torch.onnx.export``: torch's own norm, which exports as the standard ONNX op
training      plain tensors in eager mode that take a gradient: :class:`~addnorm.autograd.EagerAddNorm`
              (a call without options before any other check: :mod:`addnorm.shortcut`, its
              :class:`~addnorm.autograd.PlainAddNorm`)
inference     plain tensors in eager mode without gradients (``no_grad``, or no input requires
              grad), or any call writing into ``out=``/``residual_out=``: the backend's forward
              alone, nothing saved, the stream and the statistics written only when returned; a
              call without options before any other check (:mod:`addnorm.shortcut`)
compiled      ``torch.compile`` / ``torch.export`` graphs: the custom op ``addnorm::forward``
              (into ``out=``/``residual_out=``: its results copied there)
transform     ``torch.func`` transforms and forward-mode AD, compiled or not: the reference
              formulas as differentiable torch ops (:func:`addnorm.kernels.torch.composite`)
subclass      tensor subclasses (FakeTensor, DTensor through :mod:`addnorm.sharding`) and
              ``torch.jit.trace``: the custom op, after DTensor's own checks
============  =====================================================================================

The training, compiled and subclass routes share the save plan and the backward of
:mod:`addnorm.autograd`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from . import backend as backends
from . import reference, shortcut
from .autograd import EagerSecondNorm, OpArgs, _to, eager_apply, forward_op, make_branch, op_args, train_forward
from .autograd import transformed as is_transformed
from .checks import (
    PLAIN,
    SUPPORTED_DTYPES,
    check_backend,
    check_dtensors,
    check_flag,
    check_float_tensor,
    check_inputs,
    check_out,
    check_parallel,
    check_residual_dtype,
    check_sublayer,
    normalize_shape,
    overlaps,
    warn_caller,
)
from .dropped import dropped_add, keep_mask_of
from .kernels import torch as torch_kernels

_is_compiling, _is_exporting = torch.compiler.is_compiling, torch.compiler.is_exporting
# Python dispatch modes (make_fx, FakeTensorMode, selective checkpointing) see ops, not kernels: the op route
_dispatch_modes = torch._C._len_torch_dispatch_stack
_tracing_state = torch._C._get_tracing_state
# RMSNorm's default eps per input dtype, as torch: the machine epsilon of the statistics dtype
_RMS_DEFAULT_EPS = {
    dt: torch.finfo(reference.stats_dtype(dt)).eps
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


def _stream_dtype(x, residual, residual_dtype) -> torch.dtype | None:
    """The dtype of the stream a call normalizes: ``residual_dtype`` when given (with or without a
    residual), else :func:`addnorm.reference.stream_dtype`'s; None where x is no tensor (before
    check_inputs says so)."""
    if residual_dtype is not None or not isinstance(x, Tensor):
        return residual_dtype
    residual = residual if isinstance(residual, Tensor) else None
    if x.dtype not in SUPPORTED_DTYPES or (residual is not None and residual.dtype not in SUPPORTED_DTYPES):
        return None  # (a float8 tensor, say: check_inputs names it)
    return reference.stream_dtype(x, residual, None)


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


NO_SUBLAYER = Sublayer()


class Parallel(NamedTuple):
    """Parallel blocks (GPT-J, GPT-NeoX, Falcon, PaLM: attention and MLP on the same stream): a
    second sublayer output ``x1`` added to the stream with a dropout mask of its own, and a
    second norm of the same ``s`` (``weight1``, ``bias1``)."""

    x1: Tensor | None = None
    weight1: Tensor | None = None
    bias1: Tensor | None = None


NO_PARALLEL = Parallel()


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
    sublayer: Sublayer = NO_SUBLAYER,
    parallel: Parallel = NO_PARALLEL,
) -> Tensor | tuple[Tensor, ...]:
    """The one entry point behind every function of :mod:`addnorm.functional` (module docstring).

    ``residual=None`` in an Add & Norm call (pre-norm, a branch, or a stream dtype of its own)
    starts the stream: ``s = rowscale * layer_scale * dropout(x)`` in ``residual_dtype``
    (:func:`_stream_starts_here`); ``parallel`` adds ``x1`` and a second norm (:func:`_parallel`)."""
    if eps is None and rms:  # RMSNorm's default (a bad x or dtype is reported by check_inputs)
        eps = _RMS_DEFAULT_EPS.get(_stream_dtype(x, residual, residual_dtype), 0.0)  # (the stream's: normalized)
    if type(prenorm) is not bool:  # (before the routes below, whose results it decides)
        check_flag("prenorm", prenorm)
    if residual_dtype is not None:
        check_residual_dtype(residual_dtype)
    elif (
        backend == "auto"
        and sublayer is NO_SUBLAYER
        and parallel is NO_PARALLEL
        and out is None
        and residual_out is None
    ):
        # a plain call: the backend's kernel straight away, where it has one
        result = shortcut.forward(x, residual, normalized_shape, weight, bias, eps, rms, prenorm)
        if result is not None:
            return result
    if isinstance(x, Tensor) and x.is_nested:
        if sublayer != NO_SUBLAYER or parallel is not NO_PARALLEL:
            raise TypeError(
                "dropout_p, layer_scale, rowscale, zero_centered_weight, x1 and weight1 take plain tensors, not nested"
            )
        return _nested(
            x, residual, normalized_shape, weight, bias, eps, rms, prenorm, residual_dtype, backend, out, residual_out
        )
    if parallel is not NO_PARALLEL or (
        residual is None
        and (
            prenorm
            or residual_out is not None
            or (residual_dtype is not None and residual_dtype != getattr(x, "dtype", None))
            or _has_branch(sublayer)
        )
    ):
        call = (x, residual, normalized_shape, weight, bias, eps, rms, prenorm, residual_dtype, backend)
        if parallel is not NO_PARALLEL:
            return _parallel(*call, out, residual_out, sublayer, parallel)
        return _stream_starts_here(*call, out, residual_out, sublayer)
    shape, eps = check_inputs(x, residual, normalized_shape, weight, bias, eps, residual_dtype, rms)
    if backend != "auto":
        check_backend(backend)
    dropout_p, seed, layer_scale, rowscale = 0.0, None, None, None
    if sublayer is not NO_SUBLAYER and sublayer != NO_SUBLAYER:  # a field off its default
        weight, dropout_p, seed = _sublayer(x, residual, shape, weight, sublayer)
        layer_scale, rowscale = sublayer.layer_scale, sublayer.rowscale
    traced = _is_exporting() or _tracing_state() is not None
    if traced and torch.onnx.is_in_onnx_export():
        branch = make_branch(dropout_p, seed, layer_scale, rowscale)
        return _onnx_form(x, residual, shape, weight, bias, eps, rms, prenorm, residual_dtype, branch)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad
        or (residual is not None and residual.requires_grad)
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
        or (layer_scale is not None and layer_scale.requires_grad)
    )
    buffers = out is not None or residual_out is not None
    if buffers:  # (the buffers as given: returned themselves, below)
        check_out(x, residual, out, residual_out, reference.stream_dtype(x, residual, residual_dtype), needs_grad)
        given = (out, residual_out)
    if len(shape) > 1:  # rows of n features: the normalized dims flattened into one
        n = math.prod(shape)
        flat = lambda t: None if t is None else t.reshape(*t.shape[: t.dim() - len(shape)], n)  # noqa: E731
        x, residual, weight, bias, out, residual_out, layer_scale = map(
            flat, (x, residual, weight, bias, out, residual_out, layer_scale)
        )
    if layer_scale is not None or rowscale is not None or dropout_p:  # a branch sums in residual's dtype
        residual = _to(residual, reference.stream_dtype(x, residual, residual_dtype))
    a = op_args(
        (x, residual, weight, bias, eps, rms, residual_dtype, backend, prenorm, dropout_p, seed, layer_scale, rowscale)
    )
    y, s = _route(a, traced, needs_grad)(a, out, residual_out)
    if buffers:  # routes that make fresh outputs (compiled, transforms): copied into the buffers
        y = _into(out, y) if out is not None else y
        s = _into(residual_out, s) if residual_out is not None else s
    if len(shape) == 1 and not prenorm and not sublayer.return_dropout_mask:
        return y  # the common case, without the tuple below
    result = (y, s) if prenorm else (y,)
    if sublayer.return_dropout_mask:
        result += (_dropout_mask(x, x.shape[-1], dropout_p, seed),)
    if len(shape) > 1:
        result = tuple(t.unflatten(-1, shape) for t in result)
        if buffers:  # the buffers themselves, not views of them
            result = tuple(b if b is not None else t for t, b in zip(result, (*given[: 1 + prenorm], None, None)))
    return result if len(result) > 1 else result[0]


# --------------------------------------------------------------------------- the router

Route = Callable[[OpArgs, "Tensor | None", "Tensor | None"], tuple]


def _into(buffer: Tensor, result: Tensor) -> Tensor:
    """``buffer`` holding ``result``: copied in, or (written by a kernel) its version counted up as by an op."""
    if result is not buffer:
        return buffer.copy_(result)
    torch.autograd.graph.increment_version(buffer)
    return buffer


def _route(a: OpArgs, traced: bool, needs_grad: bool) -> Route:
    """The route of a call (module docstring), from its tensors' types and what torch is doing
    (``traced``: exporting or ``torch.jit.trace``; ONNX export has been routed already)."""
    x, residual, weight, bias = a.x, a.residual, a.weight, a.bias
    compiling = _is_compiling()
    transformed = is_transformed()
    if (
        type(x) in PLAIN
        and (residual is None or type(residual) in PLAIN)
        and (weight is None or type(weight) in PLAIN)
        and (bias is None or type(bias) in PLAIN)
        and not (traced or compiling or transformed or _dispatch_modes())
    ):
        return _training if needs_grad else _inference
    if transformed:  # (first: the custom op cannot run under a transform, compiled or not)
        return _transform
    if compiling or _is_exporting():
        return _compiled
    return _subclass


def _training(a: OpArgs, out, residual_out) -> tuple[Tensor, Tensor | None]:
    # residual and layer_scale are autograd inputs only when given (EagerAddNorm)
    if a.layer_scale is not None:
        y = eager_apply(a, a.x, a.weight, a.bias, a.residual, a.layer_scale)
    elif a.residual is not None:
        y = eager_apply(a, a.x, a.weight, a.bias, a.residual)
    else:
        y = eager_apply(a, a.x, a.weight, a.bias)
    return y if type(y) is tuple else (y, None)


def _inference(a: OpArgs, out, residual_out) -> tuple[Tensor, Tensor | None]:
    """The backend's forward alone: no autograd, nothing saved, the stream only when it is
    returned, into ``out``/``residual_out`` when given."""
    y, s, _, _ = backends.resolve(a.backend, a.x).forward(
        a.x,
        a.residual,
        a.weight,
        a.bias,
        eps=a.eps,
        rms=a.rms,
        residual_dtype=a.residual_dtype,
        write_stream=a.prenorm or residual_out is not None,
        write_stats=False,
        out=out,
        residual_out=residual_out,
        branch=make_branch(a.dropout_p, a.seed, a.layer_scale, a.rowscale),
    )
    return y, s


def _compiled(a: OpArgs, out, residual_out) -> tuple[Tensor, Tensor]:
    _dtensor_rules()
    y, s, _, _ = forward_op(*a)
    return y, s


def _transform(a: OpArgs, out, residual_out) -> tuple[Tensor, Tensor]:
    x, residual = a.x, a.residual
    n = x.shape[-1]  # the reference formulas as torch ops, which every transform composes
    y, s = torch_kernels.composite(
        x.reshape(-1, n),
        None if residual is None else residual.reshape(-1, n),
        a.weight,
        a.bias,
        a.eps,
        a.rms,
        a.residual_dtype,
        make_branch(a.dropout_p, a.seed, a.layer_scale, a.rowscale),
    )
    return y.view(x.shape), s.view(x.shape)


def _subclass(a: OpArgs, out, residual_out) -> tuple[Tensor, Tensor]:
    buffers = out is not None or residual_out is not None
    if _dtensor_rules():
        check_dtensors(a.x, a.residual, a.weight, a.bias, buffers, a.dropout_p)
    if buffers:  # written eagerly, outside any graph (no autograd: check_out)
        return _inference(a, out, residual_out)
    y, s, _, _ = forward_op(*a)
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


# --------------------------------------------------------------------------- the sublayer branch


def _sublayer(x, residual, shape, weight, sub: Sublayer) -> tuple[Tensor | None, float, Tensor | None]:
    """Check the :class:`Sublayer` arguments; ``(weight, dropout_p, seed)``: the weight the norm
    applies (``1 + weight`` in the statistics dtype when zero-centred), and the dropout seed drawn
    from ``generator`` (None without dropout)."""
    check_sublayer(x, residual, shape, weight, sub)
    if sub.zero_centered_weight:
        weight = weight.to(reference.stats_dtype(weight.dtype)) + 1
    p = float(sub.dropout_p)
    return weight, p, draw_seed(sub.generator, x.device) if p > 0 else None


def draw_seed(generator: torch.Generator | None, device: torch.device) -> Tensor:
    """The dropout mask's 0-d int64 seed for one call, drawn from ``generator`` (torch's default
    generator of ``device`` when None): on the device, so a CUDA call does not synchronize.

    A forward run during a backward pass with grad enabled is activation checkpointing's
    recompute (``torch.utils.checkpoint``), which restores torch's default generators alone: a
    seed drawn there from ``generator`` is not the forward's, and the gradients would come from
    another mask. That is warned of (not under torch.compile, which does not take generators)."""
    if generator is not None and not torch.compiler.is_compiling() and torch.is_grad_enabled():
        if torch._C._current_graph_task_id() != -1:
            warn_caller(
                "addnorm: dropout with generator= is drawing its seed in a backward pass, as activation "
                "checkpointing recomputes a forward. torch.utils.checkpoint restores torch's default generator "
                "alone, so this mask is not the forward's and the gradients are wrong: under checkpointing leave "
                "generator=None (torch.manual_seed reproduces the run)",
                RuntimeWarning,
            )
    return torch.randint(0, 2**62, (), dtype=torch.int64, device=device, generator=generator)


def _dropout_mask(x: Tensor, n: int, dropout_p: float, seed: Tensor | None) -> Tensor:
    """The keep mask of ``x``'s rows of ``n`` features, as a bool tensor of x's shape (all True
    without dropout)."""
    if dropout_p == 0:
        return torch.ones(x.shape, dtype=torch.bool, device=x.device)
    return keep_mask_of(x, n, dropout_p, seed).view(x.shape)


# --------------------------------------------------------------------------- first and parallel blocks


def _has_branch(sublayer: Sublayer) -> bool:
    """Whether the sublayer branch changes ``x`` (dropout, a layer scale or a row scale)."""
    return sublayer is not NO_SUBLAYER and (
        bool(sublayer.dropout_p) or sublayer.layer_scale is not None or sublayer.rowscale is not None
    )


def _stream_starts_here(
    x, residual, shape, weight, bias, eps, rms, prenorm, residual_dtype, backend, out, residual_out, sublayer
):
    """Add & Norm without a residual: the first block of a pre-norm stack, whose stream is the
    sublayer branch of ``x`` alone, in ``residual_dtype``. With a branch or a stream dtype of its
    own the stream is ``0 + branch(x)``, rounded to that dtype: the residual case with a residual
    of zeros, which is exactly ``branch(x)``. Else the stream is ``x`` itself (no copy), unless
    ``out`` would overwrite it (pre-norm with ``out=x``): then a copy, written by the same call."""
    x = check_float_tensor("x", x)
    sd = residual_dtype or x.dtype
    overwritten = prenorm and out is not None and (out is x or overlaps(out, x))
    if sd != x.dtype or residual_out is not None or _has_branch(sublayer) or overwritten:
        zeros = torch.zeros_like(x, dtype=sd, requires_grad=False)
        return add_norm(
            x, zeros, shape, weight, bias, eps, rms=rms, prenorm=prenorm, residual_dtype=sd, backend=backend,
            out=out, residual_out=residual_out, sublayer=sublayer,
        )  # fmt: skip
    result = add_norm(
        x, None, shape, weight, bias, eps, rms=rms, prenorm=False, residual_dtype=None, backend=backend, out=out,
        sublayer=sublayer,
    )  # fmt: skip
    y, *masks = result if type(result) is tuple else (result,)
    return (y, x, *masks)


def _parallel(
    x, residual, shape, weight, bias, eps, rms, prenorm, residual_dtype, backend, out, residual_out, sublayer, parallel
):
    """Parallel blocks: ``s = residual + dropout1(x1)`` first (rounded to the stream dtype), then
    ``s + rowscale * layer_scale * dropout(x)`` as any Add & Norm call, and ``y1``, the norm of the
    same ``s`` with ``weight1`` and ``bias1``. Returns ``y``, ``y1`` (with ``weight1``), ``s``
    (pre-norm), then the keep masks of ``x`` and ``x1`` (``return_dropout_mask``).

    ``x1``'s mask is the same hash as ``x``'s (:func:`addnorm.reference.keep_mask`) with a seed of
    its own, drawn before ``x``'s from the same generator: the two masks are independent."""
    x1, weight1, bias1 = parallel
    x = check_float_tensor("x", x)
    if backend != "auto":  # (before the backend's capabilities are looked up by name)
        check_backend(backend)
    norm_shape, eps_checked = check_inputs(x, residual, shape, weight, bias, eps, residual_dtype, rms)
    check_parallel(x, norm_shape, parallel, sublayer, out, residual_out)
    check_sublayer(x, residual, norm_shape, weight, sublayer)  # (before x1's seed is drawn)
    n = math.prod(norm_shape)
    p = float(sublayer.dropout_p)
    if x1 is not None and p > 0 and _dtensor_rules():  # (x1's mask is drawn before the norm's checks)
        check_dtensors(x, residual, weight, bias, False, p, x1)
    masks, added = (), None
    if x1 is not None:
        sd = _stream_dtype(x, residual, residual_dtype)
        seed1 = draw_seed(sublayer.generator, x.device) if p > 0 else None
        base = torch.zeros_like(x1, dtype=sd) if residual is None else residual.to(sd)
        if _adds_x1(backend, x, residual, x1, weight, bias, weight1, bias1, sublayer, prenorm):
            residual, added = base, backends.X1(x1, p, seed1)  # added as the norm reads each row
        else:
            residual = dropped_add(base, x1, n, p, seed1, sd, backend)
        residual_dtype = sd
        if sublayer.return_dropout_mask:  # (the mask is a pass over x1 of its own: only when returned)
            masks = (_dropout_mask(x1, n, p, seed1),)
    if added is not None or (
        weight1 is not None and _fuses_second_norm(backend, x, residual, weight, bias, weight1, bias1, sublayer)
    ):
        y, y1, s, mask = _second_norm(
            x, residual, norm_shape, weight, bias, weight1, bias1, eps_checked, rms, prenorm, residual_dtype, backend,
            sublayer, added,
        )  # fmt: skip
        out_tuple = (y,) + ((y1,) if weight1 is not None else ()) + ((s,) if prenorm else ())
        out_tuple += (mask, *masks) if sublayer.return_dropout_mask else ()
        return out_tuple if len(out_tuple) > 1 else out_tuple[0]
    want_stream = prenorm or weight1 is not None
    result = add_norm(
        x, residual, norm_shape, weight, bias, eps_checked, rms=rms, prenorm=want_stream,
        residual_dtype=residual_dtype, backend=backend, sublayer=sublayer,
    )  # fmt: skip
    result = result if type(result) is tuple else (result,)
    y, rest = result[0], result[1:]
    s = rest[0] if want_stream else None
    mask = rest[1:] if want_stream else rest
    out_tuple = (y,)
    if weight1 is not None:
        second = NO_SUBLAYER if not sublayer.zero_centered_weight else Sublayer(zero_centered_weight=True)
        y1 = add_norm(
            s, None, norm_shape, weight1, bias1, eps_checked, rms=rms, prenorm=False, residual_dtype=None,
            backend=backend, sublayer=second,
        )  # fmt: skip
        out_tuple += (y1.to(x.dtype),)
    if prenorm:
        out_tuple += (s,)
    if sublayer.return_dropout_mask:
        out_tuple += (*mask, *masks)
    return out_tuple if len(out_tuple) > 1 else out_tuple[0]


def _eager_plain(*tensors) -> bool:
    """Whether ``tensors`` (None where absent) are plain tensors in eager mode: the training and
    inference routes."""
    return all(t is None or type(t) in PLAIN for t in tensors) and shortcut.eager_mode()


def _fuses_second_norm(backend, x, residual, weight, bias, weight1, bias1, sublayer) -> bool:
    """Whether parallel blocks' two norms run as one call: plain tensors in eager mode (the
    training and inference routes), on a backend with ``Capabilities.second_norm``."""
    tensors = (x, residual, weight, bias, weight1, bias1, sublayer.layer_scale, sublayer.rowscale)
    return _eager_plain(*tensors) and backends.resolve(backend, x).CAPABILITIES.second_norm


def _adds_x1(backend, x, residual, x1, weight, bias, weight1, bias1, sublayer, prenorm) -> bool:
    """Whether ``x1`` is added to the residual inside the norm's pass (``Capabilities.adds_x1``)
    rather than by a pass of its own: plain tensors in eager mode, on a backend that also fuses
    the second norm when ``weight1`` is given. In training only where the backward needs neither the
    summed residual nor ``x1``'s mask: a pre-norm parallel block with both norms (its stream
    saved) and no branch (no dropout, no layer scale), whose ``dx1`` is ``ds``
    (:class:`~addnorm.autograd.EagerSecondNorm`); elsewhere the separate pass keeps the sum."""
    tensors = (x, residual, x1, weight, bias, weight1, bias1, sublayer.layer_scale)
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors):
        if not prenorm or weight1 is None or _has_branch(sublayer):
            return False
    if not _eager_plain(*tensors):
        return False
    capabilities = backends.resolve(backend, x).CAPABILITIES
    return capabilities.adds_x1 and (weight1 is None or capabilities.second_norm)


def _second_norm(
    x, residual, shape, weight, bias, weight1, bias1, eps, rms, prenorm, residual_dtype, backend, sub, added=None
):
    """``(y, y1, s, mask)`` of parallel blocks in one call (:func:`_fuses_second_norm`, or
    :func:`_adds_x1`): the
    stream ``s = residual + rowscale * layer_scale * dropout(x)`` normalized once, ``y`` with
    ``weight``/``bias`` and ``y1`` with ``weight1``/``bias1`` written by the same loop; ``mask``
    the keep mask of ``x``. Without a residual, the stream starts here (:func:`_stream_starts_here`).
    ``added``: an :class:`~addnorm.backend.X1` that the same pass adds to the residual first
    (:func:`_adds_x1`); in inference ``weight1`` may then be None (no second norm, ``y1`` None)."""
    weight, p, seed = _sublayer(x, residual, shape, weight, sub)
    if sub.zero_centered_weight and weight1 is not None:
        weight1 = weight1.to(reference.stats_dtype(weight1.dtype)) + 1
    layer_scale, rowscale = sub.layer_scale, sub.rowscale
    if residual is None and ((residual_dtype or x.dtype) != x.dtype or _has_branch(sub)):
        residual = torch.zeros_like(x, dtype=residual_dtype or x.dtype)
    if residual is not None and _has_branch(sub):  # a branch sums in residual's dtype
        residual = _to(residual, reference.stream_dtype(x, residual, residual_dtype))
    n = math.prod(shape)
    lead = x.shape[: x.dim() - len(shape)]
    flat = lambda t: None if t is None else t.reshape(*t.shape[: t.dim() - len(shape)], n)  # noqa: E731
    xf, rf, wf, bf, w1f, b1f, lsf = map(flat, (x, residual, weight, bias, weight1, bias1, layer_scale))
    a = op_args((xf, rf, wf, bf, eps, rms, residual_dtype, backend, prenorm, p, seed, lsf, rowscale))
    added = None if added is None else added._replace(x1=flat(added.x1))
    params = (xf, wf, bf, w1f, b1f, rf, lsf, None if added is None else added.x1)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in params):
        outputs = eager_apply_second(a, *params)
        y, y1, s = outputs if len(outputs) == 3 else (*outputs, None)
    else:
        second = None if w1f is None else (w1f, b1f)
        _, _, (y, s, _, _, *y1) = train_forward(a, second, write_stats=False, x1=added, write_stream=prenorm)
        y1 = y1[0] if y1 else None
    if s is None:
        s = xf if rf is None else None
    unflat = lambda t: None if t is None else t.view(*lead, *shape)  # noqa: E731
    mask = _dropout_mask(x, n, p, seed) if sub.return_dropout_mask else None
    return unflat(y), unflat(y1), unflat(s), mask


eager_apply_second = torch._C._FunctionBase.__dict__["apply"].__get__(None, EagerSecondNorm)


# --------------------------------------------------------------------------- nested, onnx


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
