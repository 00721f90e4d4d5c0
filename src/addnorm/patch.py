"""Swap the norms of an existing model for addnorm's, in place, and swap them back.

:func:`patch` walks ``model.modules()`` and changes the *class* of every norm it knows,
never the module object: parameters stay the same ``Parameter`` objects (optimizers,
hooks, tied weights, ``state_dict`` keys, device and dtype are untouched) and only
``forward`` changes. :func:`unpatch` restores the original classes.

Each kind of norm keeps the numerics of the model it comes from, which differ in where
the result is cast back to the activation dtype (all compute the statistics in float32)::

    "layer"  torch.nn.LayerNorm      y = (xhat * w + b).to(x.dtype)      -> addnorm.LayerNorm
    "rms"    torch.nn.RMSNorm        y = (xhat * w).to(x.dtype)          -> addnorm.RMSNorm
    "llama"  LlamaRMSNorm & copies   y = w * xhat.to(x.dtype)            (cast, then weight)
    "gemma"  GemmaRMSNorm & copies   y = (xhat * (1 + w.float())).to(x.dtype)

Hugging Face norms are recognised by their exact class (``HF_NORMS``); any other class
that computes one of these can be passed as ``norm_types={MyNorm: "llama"}``. GPT-2,
BERT, ViT and most other models use ``torch.nn.LayerNorm`` itself.

``fuse_residual=True`` also rewrites the pre-norm blocks listed in ``FUSABLE_BLOCKS``
(GPT-2, Llama, Gemma) so that the add of the attention output to the residual stream
runs inside the second norm's op (``add_*_norm(..., prenorm=True)``): same outputs, one
pass over the stream fewer for a fused kernel backend. The add after the MLP feeds the
*next* block's first norm across the model's own loop, so it stays a plain add.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from . import nn as addnorm_nn
from .checks import check_backend
from .ops import Sublayer, add_norm

STYLES = ("layer", "rms", "llama", "gemma")

# Hugging Face norms by exact class path -> style; each entry is checked against the
# real class by tests/test_patch.py (Olmo2RMSNorm, for one, casts after the weight: not "llama").
HF_NORMS: dict[str, str] = {
    **{
        f"transformers.models.{m}.modeling_{m}.{c}RMSNorm": "llama"
        for m, c in [
            ("llama", "Llama"),
            ("mistral", "Mistral"),
            ("qwen2", "Qwen2"),
            ("qwen3", "Qwen3"),
            ("phi3", "Phi3"),
        ]
    },
    **{
        f"transformers.models.{m}.modeling_{m}.{c}RMSNorm": "gemma"
        for m, c in [("gemma", "Gemma"), ("gemma2", "Gemma2"), ("gemma3", "Gemma3")]
    },
}

# Pre-norm blocks whose residual add can move into the second norm: class path -> (name of the
# second norm, the forward parameters of a layout the fused forward mirrors). transformers 5.24
# renamed the cache argument ``past_key_values`` to ``cache``: either name is accepted, as the
# fused forwards pass every argument on by the name the original forward gives it.
_CACHE_NAMES = ("past_key_values", "cache")
FUSABLE_BLOCKS: dict[str, tuple[str, tuple[tuple[str, ...], ...]]] = {
    "transformers.models.gpt2.modeling_gpt2.GPT2Block": (
        "ln_2",
        tuple(
            (
                "self",
                "hidden_states",
                cache,
                "attention_mask",
                "encoder_hidden_states",
                "encoder_attention_mask",
                "use_cache",
                "kwargs",
            )
            for cache in _CACHE_NAMES
        ),
    ),
    **{
        f"transformers.models.{m}.modeling_{m}.{c}DecoderLayer": (
            "post_attention_layernorm",
            tuple(
                (
                    "self",
                    "hidden_states",
                    "attention_mask",
                    "position_ids",
                    cache,
                    "use_cache",
                    "position_embeddings",
                    "kwargs",
                )
                for cache in _CACHE_NAMES
            ),
        )
        for m, c in [("llama", "Llama"), ("gemma", "Gemma")]
    },
}

_ORIGINAL = "_addnorm_original_class"


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _eps(norm: nn.Module) -> float | None:
    """The epsilon of a Hugging Face RMSNorm: ``variance_epsilon`` (Llama) or ``eps`` (Gemma)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else None


def norm_style(module: nn.Module) -> str | None:
    """The style addnorm runs ``module`` with (one of ``STYLES``), or ``None`` if it is not addnorm's."""
    if isinstance(module, addnorm_nn.LayerNorm):
        return "layer"
    if isinstance(module, addnorm_nn.RMSNorm):
        return "rms"
    return getattr(type(module), "addnorm_style", None)


def add_norm_forward(norm: nn.Module, x: Tensor, residual: Tensor | None = None):
    """``norm(x)`` with addnorm's op and ``norm``'s numerics; with ``residual``, returns
    ``(norm(x + residual), x + residual)`` from one fused op (the pre-norm Add & Norm)."""
    style = norm_style(norm)
    common = dict(prenorm=residual is not None, residual_dtype=None, backend=norm.backend)
    if style in ("layer", "rms"):
        bias = norm.bias if style == "layer" else None
        return add_norm(x, residual, norm.normalized_shape, norm.weight, bias, norm.eps, rms=style == "rms", **common)
    w = norm.weight
    if style == "gemma":  # the (1 + w) offset in float32 (zero_centered_weight), the cast last
        gemma = Sublayer(zero_centered_weight=True)
        return add_norm(x, residual, w.shape, w, None, _eps(norm), rms=True, sublayer=gemma, **common)
    if style != "llama":
        raise TypeError(f"norm must be a module patched by addnorm, got {type(norm).__name__}")
    if x.dtype == w.dtype == torch.float32 and (residual is None or residual.dtype == torch.float32):
        # the cast is a no-op in float32: the weight can go into the op
        return add_norm(x, residual, w.shape, w, None, _eps(norm), rms=True, **common)
    out = add_norm(x, residual, w.shape, None, None, _eps(norm), rms=True, **common)
    return (w * out[0], out[1]) if residual is not None else w * out


# --------------------------------------------------------------------------- patched classes


def _norm_forward(self, x: Tensor) -> Tensor:
    return add_norm_forward(self, x)


def _block_arguments(self, hidden_states, args, kwargs) -> dict:
    """The arguments of the original block forward after ``hidden_states``, by name, with its
    defaults filled in and its ``**kwargs`` spread (the fused forwards pass them on as the
    original does, whichever name its cache argument has)."""
    bound = type(self)._addnorm_signature.bind(self, hidden_states, *args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    del named["self"], named["hidden_states"]
    named.update(named.pop("kwargs", {}))
    return named


def _gpt2_block_forward(self, hidden_states, *args, **kwargs):
    named = _block_arguments(self, hidden_states, args, kwargs)
    if named.pop("encoder_hidden_states") is not None:  # cross-attention sits between the adds
        return getattr(self, _ORIGINAL).forward(self, hidden_states, *args, **kwargs)
    del named["encoder_attention_mask"]
    residual = hidden_states
    attn_output, _ = self.attn(self.ln_1(hidden_states), **named)
    hidden_states, residual = add_norm_forward(self.ln_2, attn_output, residual)
    return residual + self.mlp(hidden_states)


def _llama_layer_forward(self, hidden_states, *args, **kwargs):
    named = _block_arguments(self, hidden_states, args, kwargs)
    residual = hidden_states
    hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **named)
    hidden_states, residual = add_norm_forward(self.post_attention_layernorm, hidden_states, residual)
    return residual + self.mlp(hidden_states)


_SUBCLASSES: dict[tuple[type, str], type] = {}


def _subclass(cls: type, kind: str) -> type:
    """``cls`` with addnorm's forward (kind: a norm style, or "gpt2"/"llama_layer" for blocks)."""
    if (cls, kind) not in _SUBCLASSES:
        if kind in STYLES:
            body = {"forward": _norm_forward, "addnorm_style": kind}
        else:
            body = {
                "forward": _gpt2_block_forward if kind == "gpt2" else _llama_layer_forward,
                "_addnorm_signature": inspect.signature(cls.forward),
            }
        body |= {"__module__": __name__, "__reduce_ex__": _reduce_ex, "_addnorm_made_from": (cls, kind)}
        _SUBCLASSES[cls, kind] = type(f"Addnorm{cls.__name__}", (cls,), body)
    return _SUBCLASSES[cls, kind]


def _reduce_ex(self, protocol):
    """Pickle a module of a class made by :func:`_subclass` (which no module attribute names, so
    pickle cannot find it) as "the same subclass of the original class", rebuilt on loading."""
    _, _, *state = object.__reduce_ex__(self, protocol)  # (copyreg.__newobj__, (cls,), state, ...)
    return (_new_patched, type(self)._addnorm_made_from, *state)


def _new_patched(original: type, kind: str) -> nn.Module:
    """An empty module of ``_subclass(original, kind)``; pickle then restores its state."""
    cls = _subclass(original, kind)
    return cls.__new__(cls)


# --------------------------------------------------------------------------- patch / unpatch


@dataclass
class PatchReport:
    """What :func:`patch` did: ``replaced`` (module name, original class, style), ``fused``
    (blocks whose residual add now runs in the norm op) and ``skipped`` (name, class, why)."""

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    fused: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} norm(s), fused {len(self.fused)} residual add(s)"]
        lines += [f"  {name or '<model>'}: {cls} -> {style}" for name, cls, style in self.replaced]
        lines += [f"  {name}: residual add fused" for name in self.fused]
        lines += [f"  skipped {name or '<model>'} ({cls}): {why}" for name, cls, why in self.skipped]
        return "\n".join(lines)


def _resolve_norm_types(norm_types) -> dict[type | str, str]:
    known: dict[type | str, str] = {nn.LayerNorm: "layer", nn.RMSNorm: "rms", **HF_NORMS}
    if norm_types is None:
        return known
    if isinstance(norm_types, Mapping):
        for cls, style in norm_types.items():
            if not isinstance(cls, type) or not issubclass(cls, nn.Module):
                raise TypeError(f"norm_types keys must be nn.Module classes, got {cls!r}")
            if style not in STYLES:
                raise ValueError(f"norm_types[{cls.__name__}] must be one of {STYLES}, got {style!r}")
        return dict(norm_types)
    if not isinstance(norm_types, Iterable) or isinstance(norm_types, (str, type)):
        raise TypeError(
            f"norm_types must be None, an iterable of norm classes or a mapping {{class: style}}, got {norm_types!r}"
        )
    chosen = {}
    for cls in norm_types:
        style = known.get(cls, known.get(_path(cls))) if isinstance(cls, type) else None
        if style is None:
            raise ValueError(
                f"norm_types: {cls!r} is not a norm addnorm knows; pass a mapping "
                f"{{cls: style}} with style one of {STYLES} if it computes one of them"
            )
        chosen[cls] = style
    return chosen


def _looks_like_norm(m: nn.Module) -> bool:
    """A norm :func:`patch` was not asked to replace: a subclass of torch's (with a forward of
    its own, so not replaced by default), or a class named like one."""
    name = type(m).__name__
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or "LayerNorm" in name or "RMSNorm" in name


def _patch_norm(m: nn.Module, style: str, backend: str) -> str | None:
    """Swap ``m``'s class; returns why it cannot be patched, or None."""
    cls = type(m)
    if "backend" in m.__dict__:
        return "already has an attribute named 'backend'"
    if style in ("llama", "gemma"):
        w = getattr(m, "weight", None)
        if not isinstance(w, Tensor) or w.dim() != 1 or _eps(m) is None:
            return "expected a 1-D 'weight' and a float 'variance_epsilon' or 'eps'"
    if cls is nn.LayerNorm:
        new = addnorm_nn.LayerNorm
    elif cls is nn.RMSNorm:
        new = addnorm_nn.RMSNorm
    else:
        if style in ("layer", "rms") and not isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            return f"style {style!r} needs the attributes of torch.nn.LayerNorm / RMSNorm"
        new = _subclass(cls, style)
    m.__class__ = new
    m.backend = backend
    m.__dict__[_ORIGINAL] = cls
    return None


def _fuse_block(m: nn.Module) -> str | None:
    norm_name, layouts = FUSABLE_BLOCKS[_path(type(m))]
    if norm_style(getattr(m, norm_name, None)) is None:
        return f"its {norm_name} was not patched"
    if tuple(inspect.signature(type(m).forward).parameters) not in layouts:
        return "its forward differs from the transformers 5 layout the fused forward mirrors"
    kind = "gpt2" if norm_name == "ln_2" else "llama_layer"
    original = type(m)
    m.__class__ = _subclass(original, kind)
    m.__dict__[_ORIGINAL] = original
    return None


def patch(model: nn.Module, *, norm_types=None, fuse_residual: bool = False, backend: str = "auto") -> PatchReport:
    """Make every norm of ``model`` run addnorm's ops, in place; returns a :class:`PatchReport`.

    Args:
        model: any ``nn.Module`` (a plain torch model, a Hugging Face model, ...).
        norm_types: which norms to replace. ``None`` (default): ``torch.nn.LayerNorm``,
            ``torch.nn.RMSNorm`` (exact classes, not subclasses with their own forward) and the
            Hugging Face norms of ``HF_NORMS``. An iterable of those classes picks some of them;
            a mapping ``{cls: style}`` (style in ``STYLES``) adds classes addnorm does not know.
        fuse_residual: also move the residual add of the pre-norm blocks of ``FUSABLE_BLOCKS``
            into their second norm's op (opt-in; same outputs).
        backend: the ``backend=`` of the patched norms (``"auto"``, ``"reference"``, ...).

    Parameters, buffers, hooks and ``state_dict`` keys are kept (the module objects are the
    same, only their class changes). Patch before wrapping with DDP/FSDP or ``torch.compile``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_backend(backend)
    if not isinstance(fuse_residual, bool):
        raise TypeError(f"fuse_residual must be a bool, got {type(fuse_residual).__name__}")
    types = _resolve_norm_types(norm_types)
    report = PatchReport()
    for name, m in list(model.named_modules()):
        cls = type(m)
        style = types.get(cls, types.get(_path(cls)))
        if style is None:
            if norm_style(m) is None and _looks_like_norm(m):
                report.skipped.append((name, cls.__name__, "unknown norm class; see norm_types"))
            continue
        why = _patch_norm(m, style, backend)
        if why is None:
            report.replaced.append((name, cls.__name__, style))
        else:
            report.skipped.append((name, cls.__name__, why))
    if fuse_residual:
        for name, m in list(model.named_modules()):
            if _path(type(m)) in FUSABLE_BLOCKS:
                why = _fuse_block(m)
                if why is None:
                    report.fused.append(name)
                else:
                    report.skipped.append((name, type(m).__name__, why))
    return report


def unpatch(model: nn.Module) -> int:
    """Give every module :func:`patch` changed its original class back; returns how many."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    count = 0
    for m in model.modules():
        original = m.__dict__.pop(_ORIGINAL, None)
        if original is not None:
            if norm_style(m) is not None:
                del m.backend
            m.__class__ = original
            count += 1
    return count
