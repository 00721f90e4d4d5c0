"""Custom ops, argument checks and backend dispatch.

Two ``torch.library`` custom ops carry every norm: ``addnorm::forward`` and
``addnorm::backward``. Both work on a 2-D ``(M, N)`` view of the rows and call a
backend module, which implements :func:`addnorm.reference.forward` and
:func:`addnorm.reference.backward` with the same contract. Autograd is registered
with the hand-written backward op (never autograd of the forward), and both ops have
fake kernels, so ``torch.compile(fullgraph=True)`` traces through them without a
graph break. In eager mode an ``autograd.Function`` runs the same two implementations
without the custom-op dispatch cost.

The backend is chosen at call time by the ``backend=`` keyword of every public
function: ``"auto"`` picks by device, dtype and size; a name picks that backend or
fails with the reason it cannot run.
"""

from __future__ import annotations

import importlib
import math
import numbers
import warnings
from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor

from . import reference

# name -> module implementing forward()/backward() as in reference.py.
# A kernel module may define ``unavailable_reason(x) -> str | None`` (None: usable).
BACKEND_MODULES: dict[str, str] = {
    "reference": "addnorm.reference",
    "cpu": "addnorm.kernels.cpu",
    "triton": "addnorm.kernels.triton",
}

# backend="auto" sends CPU inputs to the numba kernels when they can run: since eager calls skip
# the custom-op dispatch they beat the reference at every size, down to 2x768. Measured with
# `addnorm bench --op add_layer_norm --threads 1 --impl addnorm-cpu,addnorm-reference,torch-eager
# --shapes 2x768,8x768,32x768,128x768 --dtype float32,bfloat16 --pass fwd,fwd+bwd --rounds 21`
# (medians, ms, cpu vs reference): fp32 fwd 2x768 0.138 vs 0.299, 8x768 0.076 vs 0.187,
# 128x768 0.237 vs 1.355; bf16 fwd+bwd 8x768 0.534 vs 0.828.
#
# Below TORCH_PATH_MAX_ELEMENTS, "auto" runs torch's own ops instead (``x + residual``, then
# torch's layer_norm / rms_norm, differentiated by torch; see _torch_path): there the ~35 µs of
# Python around a kernel call (argument checks, the custom op and its autograd, the kernel's
# argument block) cost more than the fused pass saves. On the 2-core development machine,
# `addnorm bench --op add_layer_norm,layer_norm --shapes 128x1024,256x1024,512x1024,1024x1024
# --dtype float32,bfloat16 --pass fwd,fwd+bwd --impl torch-eager,addnorm-cpu --rounds 15` gave
# (kernels vs torch eager, add_layer_norm fp32): fwd 128x1024 0.59x, 256x1024 0.83x, 512x1024
# 0.96x, 1024x1024 3.06x; fwd+bwd 0.48x, 0.63x, 1.08x, 1.14x (bf16: fwd+bwd 0.65x, 0.72x, 1.20x,
# 1.19x); layer_norm alone is behind torch up to 512x1024 (0.74-0.92x fwd+bwd). With this path,
# `addnorm bench --op add_layer_norm,add_rms_norm,layer_norm --shapes 8x768,64x768,256x768,512x768
# --dtype float32,bfloat16 --pass fwd,fwd+bwd --impl torch-eager,addnorm,addnorm-cpu --rounds 15`
# gave "auto" 0.70-0.98x of torch eager at 8x768..256x768 (the rest is this module's argument
# checks), but for one noisy row: add_rms_norm fp32 fwd+bwd at 256x768, 0.51x.
TORCH_PATH_MAX_ELEMENTS = 1 << 20
_is_compiling, _is_exporting = torch.compiler.is_compiling, torch.compiler.is_exporting
_INF = math.inf
# RMSNorm's default eps per input dtype, as torch: the machine epsilon of the statistics dtype
_RMS_DEFAULT_EPS = {dt: torch.finfo(reference.stats_dtype(dt)).eps
                    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def backend_names() -> list[str]:
    return ["auto", *BACKEND_MODULES]


def backend_unavailable_reason(name: str, x: Tensor | None = None) -> str | None:
    """Why backend ``name`` cannot run (on ``x``, if given), or ``None`` if it can."""
    try:
        module = importlib.import_module(BACKEND_MODULES[name])
    except ImportError as err:  # an optional dependency is missing
        return f"{err.name or err}: not installed"
    check = getattr(module, "unavailable_reason", None)
    return check(x) if check is not None else None


def auto_backend(x: Tensor) -> str:
    """The backend ``backend="auto"`` picks for ``x`` (2-D rows about to be normalized)."""
    if x.is_cuda and backend_unavailable_reason("triton", x) is None:
        return "triton"
    if x.device.type == "cpu" and backend_unavailable_reason("cpu", x) is None:
        return "cpu"
    return "reference"


def auto_choice(x: Tensor) -> str:
    """What ``backend="auto"`` runs for the rows ``x`` when stream, weight and bias share its
    dtype: ``"torch"`` (torch's own ops, see _torch_path) for small CPU inputs, else the backend
    :func:`auto_backend` picks."""
    return "torch" if _small_cpu_input(x) else auto_backend(x)


def _small_cpu_input(x: Tensor) -> bool:
    """Whether ``x`` is small enough, and on the CPU, for torch's own ops (TORCH_PATH_MAX_ELEMENTS)."""
    return x.is_cpu and x.numel() < TORCH_PATH_MAX_ELEMENTS


def resolve_backend(name: str, x: Tensor) -> ModuleType:
    check_backend(name)
    if name == "auto":
        name = auto_backend(x)  # picks only a backend that can run on x
    else:
        reason = backend_unavailable_reason(name, x)
        if reason is not None:
            raise RuntimeError(f"backend {name!r} cannot run here: {reason}")
    return importlib.import_module(BACKEND_MODULES[name])


# --------------------------------------------------------------------------- ops and autograd
#
# The same two implementations run in two wrappers. In eager mode a plain
# torch.autograd.Function calls them directly: a Python custom op costs tens of
# microseconds of dispatch per call, more than a small norm itself. Under
# torch.compile / torch.export the custom ops below wrap them, with fake kernels, so
# graphs trace through without a break. setup_context and the backward are shared.

def _empty(like: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty((0,), dtype=dtype, device=like.device)


def _forward_impl(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    residual_dtype: torch.dtype | None,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _forward_with(resolve_backend(backend, x), x, residual, weight, bias, eps, rms, residual_dtype)


def _forward_with(impl, x, residual, weight, bias, eps, rms, residual_dtype, need_stream=True):
    """``impl.forward`` with the custom op's four outputs (empty tensors in place of None)."""
    y, s, mean, rstd = impl.forward(x, residual, weight, bias, eps, rms, residual_dtype, need_stream=need_stream)
    cd = rstd.dtype
    return (
        y.contiguous(),
        s.contiguous() if s is not None else _empty(x, x.dtype),
        mean if mean is not None else _empty(x, cd),
        rstd,
    )


def _backward_impl(
    dy: Tensor,
    dstream: Tensor | None,
    s: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    has_bias: bool,
    backend: str,
    residual: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    impl = resolve_backend(backend, s)
    ds, dweight, dbias = impl.backward(dy, dstream, s, weight, mean, rstd, has_bias, residual=residual)
    cd = rstd.dtype
    return (
        ds.contiguous(),
        dweight if dweight is not None else _empty(s, cd),
        dbias if dbias is not None else _empty(s, cd),
    )


_forward_op = torch.library.custom_op("addnorm::forward", _forward_impl, mutates_args=())
_backward_op = torch.library.custom_op("addnorm::backward", _backward_impl, mutates_args=())


@_forward_op.register_fake
def _forward_fake(x, residual, weight, bias, eps, rms, residual_dtype, backend):
    m, n = x.shape
    sd = reference.stream_dtype(x, residual, residual_dtype)
    cd = reference.stats_dtype(sd)
    s = x.new_empty((m, n), dtype=sd) if residual is not None else _empty(x, x.dtype)
    mean = x.new_empty((m,), dtype=cd) if not rms else _empty(x, cd)
    return x.new_empty((m, n)), s, mean, x.new_empty((m,), dtype=cd)


@_backward_op.register_fake
def _backward_fake(dy, dstream, s, weight, mean, rstd, has_bias, backend, residual=None):
    n = s.shape[1]
    cd = rstd.dtype
    dweight = s.new_empty((n,), dtype=cd) if weight is not None else _empty(s, cd)
    dbias = s.new_empty((n,), dtype=cd) if has_bias else _empty(s, cd)
    return s.new_empty(s.shape), dweight, dbias


def _recomputes_stream(impl: ModuleType, x: Tensor, residual: Tensor | None, residual_dtype: torch.dtype | None,
                       prenorm: bool) -> bool:
    """Whether a post-norm training call saves ``x`` and ``residual`` and has the backend's
    backward recompute ``s = x + residual`` from them, so that the forward never writes ``s``
    (a backend's ``RECOMPUTE_STREAM``: where writing a tensor costs more than reading two again).
    The memory kept is the same in a Transformer: ``s`` is not kept, ``x`` is, and ``residual``
    is kept anyway as the input of the next sublayer. Only when ``x`` and ``residual`` already
    have the stream dtype, so that the sum is bit for bit the forward's."""
    return (residual is not None and not prenorm and getattr(impl, "RECOMPUTE_STREAM", False)
            and x.dtype == residual.dtype and residual_dtype in (None, x.dtype))


def _setup_context(ctx, inputs, output, recompute=False):
    x, residual, weight, bias, eps, rms, residual_dtype, backend = inputs[:8]
    y, s, mean, rstd = output
    saved = (x, residual) if recompute else (x if residual is None else s, None)
    ctx.save_for_backward(*saved, weight, None if rms else mean, rstd)
    ctx.num_inputs = len(inputs)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = residual.dtype if residual is not None else None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.backend = backend


def _to(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)  # .to() itself costs ~1 µs even when a no-op


def _make_backward(backward_fn):
    def backward(ctx, dy, dstream, _dmean, _drstd):
        saved, saved_residual, weight, mean, rstd = ctx.saved_tensors
        if dy is None:  # only the stream output was used
            dy = torch.zeros(saved.shape, dtype=ctx.x_dtype, device=saved.device)
        if ctx.residual_dtype is None:
            dstream = None
        has_bias = ctx.bias_dtype is not None
        ds, dweight, dbias = backward_fn(dy, dstream, saved, weight, mean, rstd, has_bias, ctx.backend,
                                         saved_residual)
        dx = _to(ds, ctx.x_dtype)
        dresidual = _to(ds, ctx.residual_dtype) if ctx.residual_dtype is not None else None
        dweight = _to(dweight, weight.dtype) if weight is not None else None
        dbias = _to(dbias, ctx.bias_dtype) if has_bias else None
        return (dx, dresidual, dweight, dbias) + (None,) * (ctx.num_inputs - 4)

    return backward


_forward_op.register_autograd(_make_backward(_backward_op), setup_context=_setup_context)


class _EagerAddNorm(torch.autograd.Function):
    """Eager-mode twin of ``addnorm::forward``: same implementation, no op dispatch.

    (The old-style ``forward(ctx, ...)`` on purpose: with a separate ``setup_context``,
    ``Function.apply`` binds the arguments with ``inspect.signature`` on every call.)
    """

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms, residual_dtype, backend, prenorm):
        impl = resolve_backend(backend, x)
        recompute = _recomputes_stream(impl, x, residual, residual_dtype, prenorm)
        output = _forward_with(impl, x, residual, weight, bias, eps, rms, residual_dtype, need_stream=not recompute)
        _setup_context(ctx, (x, residual, weight, bias, eps, rms, residual_dtype, backend, prenorm), output, recompute)
        return output

    backward = staticmethod(_make_backward(_backward_impl))


# --------------------------------------------------------------------------- checks

_FLOAT_DTYPES = "float16, bfloat16, float32 or float64"
# float8 and other exotic floats pass is_floating_point() but no backend computes in them.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_float_tensor(name: str, t: object) -> Tensor:
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
        raise TypeError(
            f"normalized_shape must be an int or a sequence of ints, got {type(normalized_shape).__name__}"
        )
    if not shape or not all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) and d > 0 for d in shape
    ):
        raise ValueError(f"normalized_shape must be one or more positive ints, got {normalized_shape!r}")
    return tuple(int(d) for d in shape)


def _check_param(name: str, p: Tensor | None, shape: tuple[int, ...], x: Tensor) -> None:
    if p is None:
        return
    _check_float_tensor(name, p)
    if tuple(p.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} (normalized_shape), got {tuple(p.shape)}")
    if p.device != x.device:
        raise ValueError(f"{name} is on {p.device} but x is on {x.device}; expected the same device")


def check_eps(eps: object) -> float:
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool):
        raise TypeError(f"eps must be a non-negative finite number, got {type(eps).__name__} {eps!r}")
    if not math.isfinite(eps) or eps < 0:  # eps=inf would silently turn every output into bias
        raise ValueError(f"eps must be a non-negative finite number, got {eps!r}")
    return float(eps)


def check_backend(backend: object) -> str:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, one of {backend_names()}, got {type(backend).__name__}")
    if backend != "auto" and backend not in BACKEND_MODULES:
        raise ValueError(f"backend must be one of {backend_names()}, got {backend!r}")
    return backend


def check_flag(name: str, value: object) -> bool:
    # A truthy string such as prenorm="no" would silently change what is returned.
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_residual_dtype(residual_dtype: object) -> torch.dtype | None:
    if residual_dtype is not None and residual_dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"residual_dtype must be None or a torch dtype ({_FLOAT_DTYPES}), got {residual_dtype!r}")
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
    """Validate the arguments of a public op; returns ``(normalized_shape, eps)``."""
    x = _check_float_tensor("x", x)
    shape = normalize_shape(normalized_shape)
    if tuple(x.shape[x.dim() - len(shape):]) != shape or x.dim() < len(shape):
        raise ValueError(
            f"x of shape {tuple(x.shape)} must end with normalized_shape {shape}"
        )
    _check_param("weight", weight, shape, x)
    _check_param("bias", bias, shape, x)
    if residual is not None:
        residual = _check_float_tensor("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(
                f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device} but x is on {x.device}; expected the same device")
    check_residual_dtype(residual_dtype)
    eps = check_eps(eps)
    n = math.prod(shape)
    if n <= 2:
        warnings.warn(
            f"normalizing over {n} feature(s): every output row is then ±1 (or 0) times weight, "
            "plus bias, whatever the input; project the features to a wider dimension first",
            UserWarning,
            stacklevel=4,
        )
    return shape, eps


def _check_out(x, residual, out, residual_out, sd, needs_grad) -> None:
    """``out``/``residual_out`` must be contiguous buffers of the results' shape, dtype and device."""
    if needs_grad:
        raise RuntimeError("out= and residual_out= do not support autograd: an input requires grad; "
                           "call under torch.no_grad() / torch.inference_mode(), or drop out=")
    if residual_out is not None and residual is None:
        raise ValueError("residual_out= needs a residual: only add_layer_norm/add_rms_norm produce a stream")
    for name, t, dtype in (("out", out, x.dtype), ("residual_out", residual_out, sd)):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != x.shape or t.dtype != dtype or t.device != x.device or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {tuple(x.shape)} on "
                             f"{x.device}, got {'' if t.is_contiguous() else 'non-contiguous '}"
                             f"{t.dtype} of shape {tuple(t.shape)} on {t.device}")


# --------------------------------------------------------------------------- entry point

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
) -> Tensor | tuple[Tensor, Tensor]:
    """The one entry point behind every function of :mod:`addnorm.functional`: torch's own ops
    for small CPU inputs under ``backend="auto"`` (:func:`_torch_path`), else the full argument
    checks, then the custom op (compiled graphs), its autograd twin (training) or the backend's
    forward alone (inference)."""
    if backend == "auto" and out is None and residual_out is None:
        result = _torch_path(x, residual, normalized_shape, weight, bias, eps, rms, prenorm, residual_dtype)
        if result is not None:
            return result
    if eps is None and rms:  # RMSNorm's default (a bad x or dtype is reported by check_inputs)
        eps = _RMS_DEFAULT_EPS.get(x.dtype, 0.0) if isinstance(x, Tensor) else 0.0
    shape, eps = check_inputs(x, residual, normalized_shape, weight, bias, eps, residual_dtype)
    check_flag("prenorm", prenorm)
    check_backend(backend)
    if torch.onnx.is_in_onnx_export():
        return _onnx_form(x, residual, shape, weight, bias, eps, rms, prenorm, residual_dtype)
    n = math.prod(shape)
    x2 = x.reshape(-1, n)
    r2 = residual.reshape(-1, n) if residual is not None else None
    w = weight.reshape(n) if weight is not None else None
    b = bias.reshape(n) if bias is not None else None
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, residual, weight, bias))
    if out is not None or residual_out is not None:
        _check_out(x, residual, out, residual_out, reference.stream_dtype(x, residual, residual_dtype), needs_grad)
    buffers = out is not None or residual_out is not None  # written by the backend itself, eagerly
    if (torch.compiler.is_compiling() or torch.compiler.is_exporting()) and not buffers:
        y, s, _, _ = _forward_op(x2, r2, w, b, eps, rms, residual_dtype, backend)
    elif needs_grad:
        y, s, _, _ = _EagerAddNorm.apply(x2, r2, w, b, eps, rms, residual_dtype, backend, prenorm)
    else:  # inference: no autograd, nothing saved, the stream only when it is returned
        y, s = _infer(x2, r2, w, b, eps, rms, residual_dtype, backend, prenorm, out, residual_out)
    y = out if out is not None else y.view(x.shape)
    if not prenorm:
        return y
    return y, (residual_out if residual_out is not None else s.view(x.shape))


def _torch_path(x, residual, normalized_shape, weight, bias, eps, rms, prenorm, residual_dtype):
    """Add & Norm by torch's own ops, or None when ``backend="auto"`` does not hand this call to
    them: ``s = x + residual``, then torch's layer_norm (one fused kernel, forward and backward)
    or rms_norm, differentiated by torch. For a small CPU input (TORCH_PATH_MAX_ELEMENTS) whose
    stream, weight and bias all have the dtype of ``x``, in eager mode (compiled graphs keep the
    custom ops). The formulas, statistics dtype and default eps are the reference's (torch
    computes 16-bit inputs in float32 too).

    Lean on purpose: at 8x768 a norm takes ~4 µs, and each attribute read here ~50 ns. What
    torch checks itself (``x`` ends with ``normalized_shape``, the parameters have that shape
    and ``x``'s device) is left to it: its error sends the call to :func:`add_norm`'s full checks,
    which say what is wrong in addnorm's words. What torch would accept with another meaning (a
    residual that broadcasts, mixed dtypes, a negative or NaN ``eps``, complex ``x``) or that
    warns (two features or fewer) is checked here. ``torch.layer_norm``/``torch.rms_norm`` are
    what ``torch.nn.functional``'s wrappers call (they still honour ``__torch_function__``),
    without the wrappers' ~0.5 µs."""
    if type(x) is not Tensor or not x.is_cpu or x.numel() >= TORCH_PATH_MAX_ELEMENTS:
        return None
    dt = x.dtype
    default_eps = _RMS_DEFAULT_EPS.get(dt)  # None: not a supported dtype
    if type(normalized_shape) is int:  # the common case first, in few steps
        shape = (normalized_shape,)
        few = normalized_shape <= 2  # <= 2 (or < 1): the warning or the error of the full checks
    elif type(normalized_shape) is tuple and all(type(d) is int and d > 0 for d in normalized_shape):
        shape, few = normalized_shape, math.prod(normalized_shape) <= 2
    else:
        return None
    if few or default_eps is None or type(prenorm) is not bool:
        return None
    if residual is not None and (type(residual) is not Tensor or residual.dtype is not dt
                                 or residual.shape != x.shape or residual_dtype not in (None, dt)):
        return None
    if getattr(weight, "dtype", dt) is not dt or getattr(bias, "dtype", dt) is not dt:  # None passes
        return None
    if eps is None:
        if not rms:
            return None
        eps = default_eps
    elif type(eps) is not float or not 0.0 <= eps < _INF:
        return None
    if _is_compiling() or _is_exporting():
        return None
    try:
        s = x if residual is None else torch.add(x, residual)
        y = torch.rms_norm(s, shape, weight, eps) if rms else torch.layer_norm(s, shape, weight, bias, eps, False)
    except (RuntimeError, TypeError):  # torch rejected a shape, device or type: the full checks say which
        return None
    return (y, s) if prenorm else y


def _infer(x2, r2, w, b, eps, rms, residual_dtype, backend, prenorm, out, residual_out):
    """The backend's forward called directly (no autograd), writing into ``out``/``residual_out``
    when given. Post-norm inference asks for no stream: a fused kernel then never writes it."""
    impl = resolve_backend(backend, x2)
    n = x2.shape[1]
    y2 = out.view(-1, n) if out is not None else None
    s2 = residual_out.view(-1, n) if residual_out is not None else None
    args = (x2, r2, w, b, eps, rms, residual_dtype)
    need_stream = prenorm or s2 is not None
    if getattr(impl, "WRITES_OUT", False):  # the kernel writes straight into the buffers
        y, s, _, _ = impl.forward(*args, out=y2, residual_out=s2, need_stream=need_stream)
    else:
        y, s, _, _ = impl.forward(*args, need_stream=need_stream)
        y, s = (y if y2 is None else y2.copy_(y)), (s if s2 is None or s is None else s2.copy_(s))
    return y, s


def _onnx_form(x, residual, shape, weight, bias, eps, rms, prenorm, residual_dtype):
    """What ``torch.onnx.export`` traces instead of the custom op: torch's own norm, which it
    writes as the standard ``LayerNormalization`` (opset 17+) / ``RMSNormalization`` (opset 23;
    primitive ops below), and a plain ``Add`` that runtimes fuse themselves."""
    s = reference.stream(x, residual, residual_dtype)
    if rms:
        y = torch.nn.functional.rms_norm(s, shape, weight, eps)
    else:
        y = torch.nn.functional.layer_norm(s, shape, weight, bias, eps)
    y = y.to(x.dtype)
    return (y, s) if prenorm else y
