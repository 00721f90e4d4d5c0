"""The norm styles :func:`addnorm.patch` knows, and the one function that runs any of them.

Each style keeps the numerics of the model it comes from, which differ in where the result is
cast back to the activation dtype (all compute the statistics in float32)::

    "layer"  torch.nn.LayerNorm      y = (xhat * w + b).to(x.dtype)      -> addnorm.LayerNorm
    "rms"    torch.nn.RMSNorm        y = (xhat * w).to(x.dtype)          -> addnorm.RMSNorm
    "llama"  LlamaRMSNorm & copies   y = w * xhat.to(x.dtype)            (cast, then weight)
    "gemma"  GemmaRMSNorm & copies   y = (xhat * (1 + w.float())).to(x.dtype)
    "olmo2"  Olmo2RMSNorm            y = (w * xhat).to(x.dtype)          (weight, then cast)
    "t5"     T5LayerNorm             y = w * xhat.to(w.dtype if w is half else float32)
    "cohere" CohereLayerNorm         y = (w.float() * xhat).to(x.dtype)  (LayerNorm, no bias)
    "olmo"   OlmoLayerNorm           y = xhat.to(x.dtype)                (LayerNorm, no parameters)
    "nanochat" NanoChatRMSNorm       y = xhat.to(x.dtype)                (RMSNorm, no parameters)
    "deberta" DebertaLayerNorm       y = w * xhat.to(x.dtype) + b        (LayerNorm, cast, then weight and bias)
    "nemotron" NemotronLayerNorm1P   y = (xhat * (w + 1) + b).to(x.dtype) (LayerNorm; w + 1 in w's dtype)
    "moonshine" MoonshineStreamingLayerNorm  y = (g + offset) * xhat.to(x.dtype)  (LayerNorm, cast, then
             its ``gamma`` plus its ``unit_offset``, added in gamma's dtype)
    "flash_attn"  flash-attn's / mamba_ssm's RMSNorm: its own forward(x, residual, prenorm,
             residual_in_fp32), run by :class:`addnorm.compat.flash_attn.RMSNorm`

``"olmo2"`` is ``"rms"`` on a class with ``variance_epsilon`` instead of torch's attributes, and
``"cohere"`` and ``"olmo"`` are ``"layer"`` on such classes; ``"t5"`` casts to the *weight's* dtype,
which is ``"llama"`` whenever the input has the weight's dtype. :mod:`.hf_norms` lists the Hugging
Face classes of each style.

A norm may also receive its output ready-made (:func:`hand_off`): the block before it computed the
residual stream and this norm's output in one fused op. The norm uses it only when it is called
with that very stream tensor and still holds the weight and bias it was made with, so anything
that changes either in between (a hook, a clamp, a dtype cast, an edit of the weight) makes it
compute as usual.
"""

# (no `from __future__ import annotations`: a patched norm's forward is defined here, and torch.fx
# copies its annotations into the code of a GraphModule rooted at it, which pickles only if they
# are types)
import inspect
import weakref

import torch
from torch import Tensor, nn

from .. import nn as addnorm_nn
from ..ops import NO_PARALLEL, NO_SUBLAYER, Parallel, Sublayer, add_norm

STYLES = (
    *("layer", "rms", "llama", "gemma", "olmo2", "t5", "cohere", "olmo", "nanochat", "deberta", "nemotron"),
    *("moonshine", "flash_attn"),
)
# Hugging Face classes: a 1-D weight (and bias, "deberta"; optional, "nemotron") and an epsilon
HF_STYLES = ("llama", "gemma", "olmo2", "t5", "cohere", "deberta", "nemotron")
MEAN_STYLES = ("layer", "cohere", "olmo", "deberta", "nemotron", "moonshine")  # LayerNorm: the mean subtracted
OLMO_EPS = 1e-5  # OlmoLayerNorm's, written in its forward
PARAMETERS = ("weight", "bias", "gamma")  # the names of the tensors a norm of any style computes with

_HALF = (torch.float16, torch.bfloat16)
# flash-attn's fused-norm module and its copies in mamba_ssm, recognised by name and signature
# (never imported): their forward takes the residual and returns the stream itself. The value:
# whether the module's RMSNorm has a dropout (its ``drop``); mamba_ssm 1.x's (``layernorm``) has none
FLASH_ATTN_MODULES = {
    "flash_attn.ops.triton.layer_norm": True,
    "mamba_ssm.ops.triton.layer_norm": True,
    "mamba_ssm.ops.triton.layernorm": False,
}
_FLASH_ATTN_FORWARD = ["self", "x", "residual", "prenorm", "residual_in_fp32"]


def flash_attn_style(module: nn.Module) -> str | None:
    """``"flash_attn"`` for flash-attn's or mamba_ssm's ``RMSNorm`` (by class name, module and
    forward signature), else None."""
    cls = type(module)
    if cls.__name__ != "RMSNorm" or cls.__module__ not in FLASH_ATTN_MODULES:
        return None
    try:
        params = list(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return None
    return "flash_attn" if params == _FLASH_ATTN_FORWARD else None


def eps_of(norm: nn.Module) -> float | None:
    """The epsilon of a Hugging Face RMSNorm: ``variance_epsilon`` (Llama) or ``eps`` (Gemma)."""
    eps = norm.__dict__.get("variance_epsilon", norm.__dict__.get("eps"))
    if eps is None:  # (not a plain attribute: a property, or a buffer)
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else None


_STYLE_OF: dict[type, str | None] = {}  # a module's class -> its style (a fused call asks several times)


def norm_style(module: nn.Module | None) -> str | None:
    """The style addnorm runs ``module`` with (one of ``STYLES``), or ``None`` if it is not addnorm's."""
    cls = type(module)
    if cls in _STYLE_OF:
        return _STYLE_OF[cls]
    if issubclass(cls, addnorm_nn.LayerNorm):
        style = "layer"
    elif issubclass(cls, addnorm_nn.RMSNorm):
        style = "rms"
    else:
        style = getattr(cls, "addnorm_style", None)
    return remember(_STYLE_OF, cls, style)


def remember(cache: dict, key, value):
    """``value``, kept in ``cache`` under ``key`` unless torch.compile is tracing (which would
    take the write for a change of the model's state: a graph break)."""
    if not torch.compiler.is_compiling():
        cache[key] = value
    return value


def _t5_dtype(norm: nn.Module, x: Tensor) -> torch.dtype:
    """The dtype T5LayerNorm casts the normalized input to before the weight."""
    w = norm.weight.dtype
    return w if w in _HALF else torch.promote_types(x.dtype, torch.float32)


def fusable(norm: nn.Module, x: Tensor) -> bool:
    """Whether ``norm``'s output on the stream of ``x``'s dtype can come out of a fused Add & Norm
    (a T5 norm casting to a dtype other than the stream's cannot, nor a Nemotron norm casting to
    the autocast dtype: their input is never rounded)."""
    style = norm_style(norm)
    if style == "nemotron":
        return _nemotron_autocast(norm, x) is None
    return style is not None and (style != "t5" or _t5_dtype(norm, x) == x.dtype)


def _nemotron_autocast(norm: nn.Module, x: Tensor) -> torch.dtype | None:
    """The dtype NemotronLayerNorm1P casts ``x``, ``w + 1`` and bias to before its layer norm (run
    with autocast off) where ``torch.is_autocast_enabled()`` (CUDA's autocast, as the class asks it)
    and the cast changes one of them (:func:`_autocast_cast`; ``w + 1`` has the weight's dtype and
    device), else None."""
    if not torch.is_autocast_enabled():
        return None
    device, dtype = x.device.type, torch.get_autocast_dtype(x.device.type)
    tensors = (x, norm.weight, getattr(norm, "bias", None))
    return dtype if any(_autocast_cast(t, device, dtype) is not t for t in tensors) else None


def _autocast_cast(t: Tensor | None, device: str, dtype: torch.dtype) -> Tensor | None:
    """``t`` as autocast's own cast leaves it: a floating tensor on ``device``'s type, float64
    excepted, in ``dtype``; any other as it is (``t`` itself where nothing changes)."""
    if t is None or not t.is_floating_point() or t.device.type != device or t.dtype in (torch.float64, dtype):
        return t
    return t.to(dtype)


def add_norm_forward(
    norm: nn.Module,
    x: Tensor,
    residual: Tensor | None = None,
    *,
    sublayer: Sublayer = NO_SUBLAYER,
    x1: Tensor | None = None,
    norm1: nn.Module | None = None,
    prenorm: bool | None = None,
):
    """``norm(x)`` with addnorm's op and ``norm``'s numerics. With ``residual`` (the pre-norm Add &
    Norm) returns ``(norm(s), s)`` for the stream ``s = residual + branch(x)`` from one op, where the
    branch is ``sublayer``'s dropout, layer scale and row scale; ``x1`` adds a second sublayer output
    (parallel blocks) and ``norm1`` a second norm of the same ``s``: ``(norm(s), norm1(s), s)``.
    ``prenorm=False`` (post-norm blocks) returns ``norm(s)`` alone."""
    style = norm_style(norm)
    if style is None:
        raise TypeError(f"norm must be a module patched by addnorm, got {type(norm).__name__}")
    prenorm = residual is not None if prenorm is None else prenorm
    if residual is not None:
        # the output in the stream's dtype, as the norm of the unfused add returns it (a bf16
        # sublayer output on a float32 stream under autocast); the stream's bits are the same, as
        # the op sums in float32 from x widened exactly
        x = x.to(torch.promote_types(x.dtype, residual.dtype))  # (x itself when already in it)
    if style == "t5" and _t5_dtype(norm, x) != x.dtype:
        if residual is not None:
            raise ValueError("a T5 norm casting to another dtype than the stream's cannot be fused")
        up = torch.promote_types(x.dtype, _t5_dtype(norm, x)) != x.dtype  # exact: x is widened
        y = add_norm(x.to(_t5_dtype(norm, x)) if up else x, None, *_norm_args(norm, None, x), rms=True, **_common(norm))
        return norm.weight * y.to(_t5_dtype(norm, x))
    cast = _nemotron_autocast(norm, x) if style == "nemotron" else None
    if cast is not None:  # its own cast, then no autocast (unfused: fusable says so)
        if residual is not None:
            raise ValueError("a Nemotron norm casting to the autocast dtype cannot be fused")
        device = x.device.type
        x, weight, bias = (_autocast_cast(t, device, cast) for t in (x, norm.weight + 1, getattr(norm, "bias", None)))
        with torch.autocast(device, enabled=False):
            return add_norm(x, None, norm.weight.shape, weight, bias, eps_of(norm), rms=False, **_common(norm))
    parallel = NO_PARALLEL
    if x1 is not None or norm1 is not None:
        if norm1 is not None and style not in ("layer", "rms"):  # (x1 alone only changes the stream)
            raise ValueError("norm1 takes norms of style 'layer' or 'rms'")
        w1, b1 = (None, None) if norm1 is None else (norm1.weight, getattr(norm1, "bias", None))
        parallel = Parallel(x1, w1, b1)
    if style == "gemma":  # the (1 + w) offset in float32 (zero_centered_weight), the cast last
        sublayer = sublayer._replace(zero_centered_weight=True)
    weight = _weight(norm)  # (None: a norm without parameters)
    late = style in ("llama", "t5", "deberta", "moonshine") and not (
        x.dtype == weight.dtype == torch.float32 and (residual is None or residual.dtype == torch.float32)
    )  # the cast comes before the weight: in float32 it is a no-op and the weight can go into the op
    common = dict(rms=style not in MEAN_STYLES, prenorm=prenorm, residual_dtype=None, backend=norm.backend)
    out = add_norm(
        x, residual, *_norm_args(norm, None if late else weight, x), **common, sublayer=sublayer, parallel=parallel
    )
    if not late:
        return out
    y = weight * (out[0] if prenorm else out)
    if style == "deberta":
        y = y + norm.bias
    return (y, out[1]) if prenorm else y


def _weight(norm: nn.Module) -> Tensor | None:
    """What the norm multiplies ``xhat`` by (besides a "gemma" or "nemotron" offset, which the op
    or :func:`_norm_args` adds): its ``weight``, or a "moonshine" norm's ``gamma + unit_offset``
    (in gamma's dtype, as the class adds them)."""
    if norm_style(norm) == "moonshine":
        return norm.gamma + norm.unit_offset
    return getattr(norm, "weight", None)


def _norm_args(norm: nn.Module, weight: Tensor | None, x: Tensor) -> tuple:
    """``(normalized_shape, weight, bias, eps)`` of ``norm`` for :func:`addnorm.ops.add_norm` on ``x``."""
    if norm_style(norm) in ("layer", "rms"):
        bias = getattr(norm, "bias", None)
        return norm.normalized_shape, weight, bias, norm.eps
    if norm_style(norm) == "olmo":
        return norm.normalized_shape, None, None, OLMO_EPS
    if norm_style(norm) == "nanochat":  # (no parameters, no shape: the last dim of its input)
        return x.shape[-1:], None, None, eps_of(norm)
    if norm_style(norm) == "nemotron":  # the weight plus one, added in its own dtype, as the class does
        return norm.weight.shape, norm.weight + 1, getattr(norm, "bias", None), eps_of(norm)
    if norm_style(norm) == "moonshine":  # (its statistics: a LayerNorm without parameters, ``ln``)
        return norm.ln.normalized_shape, weight, None, norm.ln.eps
    bias = norm.bias if norm_style(norm) == "deberta" and weight is not None else None  # (late: added after)
    return norm.weight.shape, weight, bias, eps_of(norm)


def _common(norm: nn.Module) -> dict:
    return dict(prenorm=False, residual_dtype=None, backend=norm.backend)


# --------------------------------------------------------------------------- hand-off between blocks

# norm -> (a weak reference to the stream, its version, the autograd context, the norm's parameters,
# its output): until the norm's next call, the next hand-off, or the stream's end (a layer LayerDrop
# skipped never calls the norm: its output goes with the stream); kept off the module so that
# pickling and deepcopy never see them
_PENDING: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()


def _autograd_context() -> tuple:
    """What decides how an output enters the autograd graph: grad mode, and the saved-tensor hooks
    in force (activation checkpointing's: each checkpointed call has its own). An output made in
    another context than the norm's call is not the norm's to return: a block checkpointed without
    grad would hand the next norm an output outside the graph, and a checkpointed norm must compute
    what its recomputation will."""
    return torch.is_grad_enabled(), torch._C._autograd._top_saved_tensors_default_hooks(False)


_CLASS_ATTRIBUTES: dict[type, bool] = {}  # norm class -> whether it defines one of PARAMETERS itself


def tensors(norm: nn.Module) -> list:
    """The tensors ``norm`` computes with (its attributes named in ``PARAMETERS``, None where
    unset), looked up in the module's dicts as ``nn.Module.__getattr__`` does, without the
    exception a missing name costs there: the fused forward asks for them several times a call."""
    cls = type(norm)
    named = _CLASS_ATTRIBUTES.get(cls)
    if named is None:
        named = remember(_CLASS_ATTRIBUTES, cls, any(hasattr(cls, n) for n in PARAMETERS))
    if named:  # (a property, say: the attribute lookup itself)
        return [getattr(norm, n, None) for n in PARAMETERS]
    d = norm.__dict__
    params, buffers = d["_parameters"], d["_buffers"]
    return [params[n] if n in params else d[n] if n in d else buffers.get(n) for n in PARAMETERS]


def _parameters(norm: nn.Module) -> tuple:
    """The tensors ``norm`` computes with, and their versions: an output made with them is stale
    once one is replaced or changed in place (an optimizer step, an edit between two calls)."""
    return tuple((t, t._version) for t in tensors(norm) if t is not None)


def hand_off(norm: nn.Module, stream: Tensor, output: Tensor) -> None:
    """Give ``norm`` its output on ``stream``, computed by the block before it."""
    key = weakref.ref(norm)

    def forget(ref: weakref.ref) -> None:  # the stream is gone: so is what was made from it
        owner = key()
        if owner is not None and _PENDING.get(owner, (None,))[0] is ref:
            del _PENDING[owner]

    _PENDING[norm] = (weakref.ref(stream, forget), stream._version, _autograd_context(), _parameters(norm), output)


def handed_off(norm: nn.Module, x: Tensor) -> Tensor | None:
    """The output handed to ``norm`` for the input ``x``, if ``x`` is that very stream tensor,
    unchanged since (no in-place op, e.g. a hook steering the stream), in the same autograd
    context (:func:`_autograd_context`), and the norm's weight and bias the very tensors it was
    computed with, unchanged since."""
    if torch.compiler.is_compiling() or not _PENDING:
        return None
    pending = _PENDING.pop(norm, None)
    if pending is None:
        return None
    stream, version, context, parameters, output = pending
    if stream() is not x or x._version != version or context != _autograd_context():
        return None
    now = _parameters(norm)
    if len(now) != len(parameters) or any(a is not b or v != w for (a, v), (b, w) in zip(now, parameters)):
        return None
    return output


# torch.fx.symbolic_trace of a patched model: each patched module traces as the model's own
# (its original forward, which computes the same), whose Python takes the Proxy values a trace
# passes; addnorm's own modules and torch's norms patched trace as one call of addnorm's op
fx_tracing = torch.fx._symbolic_trace.is_fx_symbolic_tracing


def norm_forward(self, x: Tensor) -> Tensor:
    """The forward of every class :func:`addnorm.patch` makes for a norm."""
    if fx_tracing():
        return super(type(self), self).forward(x)
    y = handed_off(self, x)
    return add_norm_forward(self, x) if y is None else y


def torch_norm_forward(self, x: Tensor) -> Tensor:
    """The forward of addnorm's own LayerNorm / RMSNorm when a block hands them their output."""
    y = None if fx_tracing() else handed_off(self, x)
    return super(type(self), self).forward(x) if y is None else y
