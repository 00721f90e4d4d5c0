"""Argument checks of the public ops: each names the argument and what was expected.

The checks of :func:`check_inputs` run on every call, so each first tests the common case in a
few attribute reads and only a failing test calls the function that finds and words the error
(a small norm's whole call costs little more than the checks: docs/benchmarks.md, "What limits it").
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import warnings
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from . import backend as backends

PLAIN = (Tensor, torch.nn.Parameter)  # the tensor types the eager routes hand to a kernel


_FLOAT_DTYPES = "float16, bfloat16, float32 or float64"
# float8 and other exotic floats pass is_floating_point() but no backend computes in them.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)


# the frames a warning skips: addnorm's own, and torch's that call into it (nn.Module.__call__)
_SKIPPED = (os.path.dirname(__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep)


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside addnorm and torch: the user's line,
    whichever of addnorm's paths (functional, modules, the flash-attn layer, parallel blocks) led
    there."""
    level, frame = 1, sys._getframe()
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def check_float_tensor(name: str, t: object) -> Tensor:
    if type(t) in PLAIN and t.dtype in _SUPPORTED and t.layout is _STRIDED:
        return t
    if not isinstance(t, Tensor):
        if isinstance(t, torch.fx.Proxy):
            raise TypeError(
                f"{name} is a torch.fx Proxy: symbolic tracing reached addnorm's checks. Call addnorm's "
                "functions as addnorm.layer_norm(...) or addnorm.functional.layer_norm(...), which a trace "
                "records as one node, or torch.fx.wrap the function that calls them"
            )
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor ({_FLOAT_DTYPES}), got {t.dtype}")
    if t.layout not in (_STRIDED, torch.jagged):  # (jagged: nested tensors, normalized by their values)
        raise TypeError(f"{name} must be a dense tensor, got layout {t.layout}: call .to_dense() first")
    return t


_STRIDED = torch.strided


def normalize_shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    """``normalized_shape`` as a tuple of positive ints, or a clear error."""
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        shape: tuple = (int(normalized_shape),)
    elif isinstance(normalized_shape, Iterable) and not isinstance(normalized_shape, (str, bytes, torch.Tensor)):
        shape = tuple(normalized_shape)  # (as torch: a numpy array or a generator too)
    else:
        raise TypeError(f"normalized_shape must be an int or a sequence of ints, got {type(normalized_shape).__name__}")
    if not shape or not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and d > 0 for d in shape):
        raise ValueError(f"normalized_shape must be one or more positive ints, got {normalized_shape!r}")
    return tuple(int(d) for d in shape)


def check_param(name: str, p: Tensor | None, shape: tuple[int, ...], x: Tensor) -> None:
    if p is None:
        return
    check_float_tensor(name, p)
    if p.shape != shape:
        raise ValueError(f"{name} must have shape {shape} (normalized_shape), got {tuple(p.shape)}")
    if not (p.is_cpu and x.is_cpu) and p.device != x.device:
        raise ValueError(f"{name} is on {p.device} but x is on {x.device}; expected the same device")


def check_eps(eps: object) -> float:
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool):
        raise TypeError(f"eps must be a non-negative finite number, got {type(eps).__name__} {eps!r}")
    if isinstance(eps, float) and not math.isfinite(eps) or eps < 0:  # eps=inf: every output its bias
        raise ValueError(f"eps must be a non-negative finite number, got {eps!r}")
    if eps > _FLOAT32_MAX:  # as inf, in the float32 statistics
        raise ValueError(f"eps must be at most float32's largest value {_FLOAT32_MAX:.7g}, got {eps!r}")
    return float(eps)


_FLOAT32_MAX = torch.finfo(torch.float32).max


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


def check_dtype(name: str, dtype: object) -> torch.dtype | None:
    """A dtype argument (``residual_dtype``, ``out_dtype``): None or a supported float dtype."""
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be None or a torch dtype ({_FLOAT_DTYPES}), got {dtype!r}")
    return dtype


def check_residual_dtype(residual_dtype: object) -> torch.dtype | None:
    return check_dtype("residual_dtype", residual_dtype)


_tracing_state = torch._C._get_tracing_state


def check_inputs(
    x: object,
    residual: object,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: object,
    residual_dtype: object,
    rms: bool = False,
    _quiet: bool = False,
) -> tuple[tuple[int, ...], float]:
    """Validate the arguments of a public op; returns ``(normalized_shape, eps)`` (module
    docstring: the common case first). Rows too narrow to normalize (LayerNorm over 2 features
    or fewer, RMSNorm over 1) are warned of. Under ``torch.jit.trace`` without its warnings that
    sizes of the example inputs are compared (the checks are no part of the trace)."""
    if not _quiet and _tracing_state() is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            return check_inputs(x, residual, normalized_shape, weight, bias, eps, residual_dtype, rms, True)
    if not (type(x) in PLAIN and x.dtype in _SUPPORTED and x.layout is _STRIDED):
        x = check_float_tensor("x", x)
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
        if n <= (1 if rms else 2) and not torch.compiler.is_compiling():  # (a warning would break the graph)
            warn_caller(
                f"normalizing over {n} feature(s): every output row is then ±1 (or 0) times weight"
                f"{'' if rms else ', plus bias'}, whatever the input; project the features to a wider dimension first"
            )
    cpu = x.is_cpu
    if weight is not None and not (
        type(weight) in PLAIN and weight.dtype in _SUPPORTED and weight.shape == shape and weight.is_cpu and cpu
    ):
        check_param("weight", weight, shape, x)
    if bias is not None and not (
        type(bias) in PLAIN and bias.dtype in _SUPPORTED and bias.shape == shape and bias.is_cpu and cpu
    ):
        check_param("bias", bias, shape, x)
    if residual is not None:
        if not (type(residual) in PLAIN and residual.dtype in _SUPPORTED and residual.layout is _STRIDED):
            residual = check_float_tensor("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
        if not (residual.is_cpu and cpu) and residual.device != x.device:
            raise ValueError(f"residual is on {residual.device} but x is on {x.device}; expected the same device")
    if residual_dtype is not None:
        check_residual_dtype(residual_dtype)
    if type(eps) is not float or not 0.0 <= eps <= _FLOAT32_MAX:  # (the common case without a call)
        eps = check_eps(eps)
    return shape, eps


def check_out(x, residual, out, residual_out, sd, needs_grad) -> None:
    """``out``/``residual_out`` must be contiguous buffers of the results' shape, dtype and device."""
    if needs_grad:
        raise ValueError(
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
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} requires grad: write into it under torch.no_grad(), or pass a buffer without")
        # (under torch.compile the graph copies into the buffer, which checks it: dynamo cannot ask)
        if not torch.compiler.is_compiling() and t.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(f"{name} is an inference tensor: it can be written only under torch.inference_mode()")
        if t.shape != x.shape or t.dtype != dtype or t.device != x.device or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous {dtype} tensor of shape {tuple(x.shape)} on "
                f"{x.device}, got {'' if t.is_contiguous() else 'non-contiguous '}"
                f"{t.dtype} of shape {tuple(t.shape)} on {t.device}"
            )
        # a buffer may be an input itself (written in place), never part of one: the kernels
        # would overwrite rows they have yet to read
        for other_name, other in (("x", x), ("residual", residual)):
            if other is not None and overlaps(t, other) and not _same_view(t, other):
                raise ValueError(
                    f"{name} overlaps {other_name} without being {other_name} itself: pass a separate buffer, "
                    f"or {other_name} itself to write in place"
                )
    if out is not None and residual_out is not None and overlaps(out, residual_out):
        raise ValueError("residual_out and out share memory: pass two separate buffers")


def _span(t: Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` that ``t``'s elements lie in."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def overlaps(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors' memory spans intersect: plain tensors, and subclasses that have memory
    of their own (``as_subclass``); not wrappers without (DTensor, FakeTensor), nor under
    torch.compile, whose graphs write buffers by copying results made whole first."""
    if a.device != b.device or torch.compiler.is_compiling():
        return False
    if not (type(a) in PLAIN and type(b) in PLAIN or _has_memory(a) and _has_memory(b)):
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _has_memory(t: Tensor) -> bool:
    try:
        t.data_ptr()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass, a fake or meta tensor
        return False
    return t.device.type != "meta"


def _same_view(a: Tensor, b: Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)


def check_sublayer(x: Tensor, residual: Tensor | None, shape: tuple[int, ...], weight, sublayer) -> None:
    """The keyword-only arguments of the sublayer branch (:class:`addnorm.ops.Sublayer`)."""
    p, generator, layer_scale, rowscale, zero_centered, return_mask = sublayer
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= p <= 1:  # NaN fails too
        if isinstance(p, numbers.Real):
            raise ValueError(f"dropout_p must be a probability in [0, 1], got {p!r}")
        raise ValueError(f"dropout_p must be a probability in [0, 1] (a Python number), got {type(p).__name__}")
    check_flag("zero_centered_weight", zero_centered)
    check_flag("return_dropout_mask", return_mask)
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if generator.device.type != x.device.type or (x.is_cuda and generator.device != x.device):
            raise ValueError(f"generator is on {generator.device} but x is on {x.device}; expected x's device")
    check_param("layer_scale", layer_scale, shape, x)
    if rowscale is not None:
        check_float_tensor("rowscale", rowscale)
        lead = tuple(x.shape[: x.dim() - len(shape)])
        if tuple(rowscale.shape) != lead or rowscale.device != x.device:
            raise ValueError(
                f"rowscale must have x's leading dims {lead} (one factor per row) on {x.device}, "
                f"got {tuple(rowscale.shape)} on {rowscale.device}"
            )
        if rowscale.requires_grad and torch.is_grad_enabled():
            raise ValueError("rowscale is a per-row constant (drop path) and takes no gradient: pass rowscale.detach()")
    if zero_centered and weight is None:
        raise ValueError("zero_centered_weight=True scales by 1 + weight: it needs a weight")


def check_dtensors(x, residual, weight, bias, buffers: bool, dropout_p: float, x1=None) -> None:
    """What DTensors cannot do here (DTensor loaded): write into ``out=`` buffers, and take
    dropout on rows sharded over ranks, whose keep mask is a function of each row's index in the
    call: a shard of the rows would draw the masks of other rows, the same on every rank (the
    sharding rules would gather the rows instead: a cost better asked for than hidden). ``x1``:
    parallel blocks' second sublayer output, dropped out as ``x`` is."""
    dtensor = sys.modules["torch.distributed.tensor"].DTensor
    if buffers and any(isinstance(t, dtensor) for t in (x, residual, weight, bias)):
        raise ValueError("out= and residual_out= take plain tensors, not DTensors")
    placements = [p for t in (x, residual, x1) if isinstance(t, dtensor) for p in t.placements]
    if dropout_p > 0 and not all(p.is_replicate() for p in placements):
        raise ValueError(
            "dropout_p > 0 needs x and residual replicated when they are DTensors (and x1, when given): the "
            "keep mask is a function of each row's index, which a shard of the rows does not know. Keep "
            "dropout_p=0 and apply torch.nn.Dropout to the sublayer output before the norm, or redistribute "
            "them to Replicate()"
        )


def check_parallel(x: Tensor, shape: tuple[int, ...], parallel, sublayer, out, residual_out) -> None:
    """``x1``, ``weight1`` and ``bias1`` (:class:`addnorm.ops.Parallel`), and what they cannot be
    combined with."""
    x1, weight1, bias1 = parallel
    if x1 is not None:
        check_float_tensor("x1", x1)
        if x1.shape != x.shape or x1.device != x.device:
            raise ValueError(
                f"x1 must have the shape of x {tuple(x.shape)} on {x.device}, got {tuple(x1.shape)} on {x1.device}"
            )
        if sublayer.rowscale is not None:
            raise ValueError(
                "rowscale with x1 is ambiguous (which sublayer output does it scale?): scale x and x1 before the call"
            )
    check_param("weight1", weight1, shape, x)
    check_param("bias1", bias1, shape, x)
    if bias1 is not None and weight1 is None:
        raise ValueError("bias1 is the bias of the second norm: it needs weight1")
    if out is not None or residual_out is not None:
        raise ValueError("out= and residual_out= are not supported with x1 or weight1")
