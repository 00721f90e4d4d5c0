"""Swap the norms of an existing model for addnorm's, in place, and swap them back.

:func:`patch` walks ``model.modules()`` and changes the *class* of every norm it knows,
never the module object: parameters stay the same ``Parameter`` objects (optimizers,
hooks, tied weights, ``state_dict`` keys, device and dtype are untouched) and only
``forward`` changes. :func:`unpatch` restores the original classes.

Each kind of norm keeps the numerics of the model it comes from (:mod:`.norms`: the styles and
the Hugging Face classes of ``HF_NORMS``); any other class that computes one of them can be
passed as ``norm_types={MyNorm: "llama"}``. GPT-2, BERT, ViT and most other models use
``torch.nn.LayerNorm`` itself.

``fuse_residual=True`` also gives the blocks of ``FAMILIES`` (:mod:`.blocks`) a forward that runs
each residual add inside the norm that reads the sum next, the next block's first norm included
(same outputs, one pass over the stream fewer per add for a fused kernel backend). The report
lists every add of those blocks, fused or not and why (:mod:`.report`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from .. import nn as addnorm_nn
from ..checks import check_backend
from ..compat import flash_attn as flash_attn_compat
from .blocks import (
    FAMILY,
    NEXT,
    NEXT_IF,
    ORIGINAL,
    OWNERS,
    attribute,
    bindings,
    block_forward,
    owners,
    renamed_arguments,
)
from .families import FAMILIES, family_of
from .hf_norms import HF_NORMS
from .layout import Family, modules
from .norms import (
    FLASH_ATTN_MODULES,
    HF_STYLES,
    OLMO_EPS,
    STYLES,
    add_norm_forward,
    eps_of,
    flash_attn_style,
    norm_forward,
    norm_style,
    torch_norm_forward,
)
from .report import Add, PatchReport

__all__ = ["FAMILIES", "HF_NORMS", "STYLES", "Add", "PatchReport", "add_norm_forward", "norm_style", "patch", "unpatch"]


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# --------------------------------------------------------------------------- patched classes

_SUBCLASSES: dict[tuple[type, str], type] = {}
_HANDOFF = "handoff"  # addnorm's own LayerNorm / RMSNorm, taking the output a block hands it


def _subclass(cls: type, kind: str) -> type:
    """``cls`` with addnorm's forward: kind is a norm style, ``"handoff"`` or ``"block"``."""
    if (cls, kind) not in _SUBCLASSES:
        if kind == "flash_attn":
            body = {"forward": flash_attn_compat.RMSNorm.forward, "addnorm_style": kind}
        elif kind in STYLES:
            body = {"forward": norm_forward, "addnorm_style": kind}
        elif kind == _HANDOFF:
            body = {"forward": torch_norm_forward}
        else:
            signature = inspect.signature(cls.forward)
            body = {
                "forward": block_forward,
                "_addnorm_signature": signature,
                # the stream's name: the first argument after self
                "_addnorm_stream": list(signature.parameters)[1],
                "_addnorm_renamed": renamed_arguments(cls.forward),
                "_addnorm_bindings": bindings(cls.forward),
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


# --------------------------------------------------------------------------- norms


_KNOWN: dict[type | str, str] = {nn.LayerNorm: "layer", nn.RMSNorm: "rms", **HF_NORMS}  # (norm_types=None)


def _resolve_norm_types(norm_types) -> dict[type | str, str]:
    if norm_types is None:
        return _KNOWN
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
        style = _KNOWN.get(cls, _KNOWN.get(_path(cls))) if isinstance(cls, type) else None
        if style is None:
            raise ValueError(
                f"norm_types: {cls!r} is not a norm addnorm knows; pass a mapping "
                f"{{cls: style}} with style one of {STYLES} if it computes one of them"
            )
        chosen[cls] = style
    return chosen


def _looks_like_norm(m: nn.Module) -> bool:
    """A norm :func:`patch` was not asked to replace: a subclass of torch's (with a forward of
    its own, so not replaced by default), or a class named like one that holds no module with
    parameters (not a layer named after its norms: wav2vec 2.0's ``EncoderLayerStableLayerNorm``)."""
    name = type(m).__name__
    if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
        return True
    return ("LayerNorm" in name or "RMSNorm" in name) and not any(True for c in m.children() for _ in c.parameters())


def _patch_norm(m: nn.Module, style: str, backend: str) -> str | None:
    """Swap ``m``'s class; returns why it cannot be patched, or None."""
    cls = type(m)
    if "backend" in m.__dict__:
        return "already has an attribute named 'backend'"
    if "forward" in m.__dict__:
        return _WRAPPED
    if style == "olmo2" and getattr(m, "with_scale", None) is False and getattr(m, "weight", None) is None:
        style = "nanochat"  # (Gemma 4's and Gemma 3n's norms built without a weight: xhat.to(x.dtype))
    if style in HF_STYLES or style == "flash_attn":
        why = _why_not_hf_norm(m, style)
        if why is not None:
            return why
    if style == "nanochat" and (
        eps_of(m) is None or any(True for _ in m.parameters()) or any(True for _ in m.buffers())
    ):
        return "expected a float 'eps' and no parameters or buffers"
    if style == "moonshine":
        why = _why_not_moonshine(m)
        if why is not None:
            return why
    if style == "olmo":
        shape = getattr(m, "normalized_shape", None)
        if not isinstance(shape, tuple) or not all(type(n) is int for n in shape) or any(True for _ in m.parameters()):
            return "expected a tuple 'normalized_shape' and no parameters"
        if eps_of(m) not in (None, OLMO_EPS):
            return f"style 'olmo' computes with eps {OLMO_EPS} (OlmoLayerNorm's), the module's is {eps_of(m)}"
    if style == "flash_attn" and FLASH_ATTN_MODULES[cls.__module__] and not hasattr(m, "drop"):
        # (its dropout would be lost unseen)
        return "expected flash-attn's 'drop' attribute (its dropout module, or None)"
    if cls is nn.LayerNorm:
        new = addnorm_nn.LayerNorm
    elif cls is nn.RMSNorm:
        new = addnorm_nn.RMSNorm
    else:
        if style in ("layer", "rms") and not isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            return f"style {style!r} needs the attributes of torch.nn.LayerNorm / RMSNorm"
        if getattr(m, "data_format", "channels_last") != "channels_last":  # (ConvNeXt's)
            return f"data_format={m.data_format!r} normalizes another dim than the last"
        new = _subclass(cls, style)
    m.__class__ = new
    m.backend = backend
    m.__dict__[ORIGINAL] = cls
    return None


def _why_not_moonshine(m: nn.Module) -> str | None:
    """Why ``m`` does not compute MoonshineStreamingLayerNorm's ``(gamma + unit_offset) * ln(x)``
    with ``ln`` a LayerNorm without parameters over gamma's features."""
    gamma, offset, ln = getattr(m, "gamma", None), getattr(m, "unit_offset", None), getattr(m, "ln", None)
    if not isinstance(gamma, Tensor) or gamma.dim() != 1:
        return "expected a 1-D 'gamma', one per feature of the last dim"
    if not isinstance(offset, (int, float)) or isinstance(offset, bool):
        return "expected a float 'unit_offset'"
    if (
        not isinstance(ln, nn.LayerNorm)
        or ln.weight is not None
        or ln.bias is not None
        or tuple(ln.normalized_shape) != tuple(gamma.shape)
    ):
        return "expected an 'ln' LayerNorm without parameters over gamma's features"
    if ln._forward_hooks or ln._forward_pre_hooks or "forward" in ln.__dict__:
        return "its 'ln' has hooks or a forward of its own, which style 'moonshine' would skip"
    return _unused_tensors(m, ("gamma",), "moonshine")


def _unused_tensors(m: nn.Module, kept: tuple[str, ...], style: str) -> str | None:
    """Why not, where ``m`` holds a parameter or buffer of its own besides ``kept``: one the style
    would not compute with."""
    extra = [n for n, _ in m.named_parameters(recurse=False) if n not in kept]
    extra += [n for n, _ in m.named_buffers(recurse=False)]
    return f"has {extra[0]!r} besides {kept[0]!r}, which style {style!r} does not compute with" if extra else None


_WRAPPED = "its forward is replaced on the module itself (accelerate's hooks?): patch before dispatching or offloading"
# attributes some Hugging Face norm classes have which, away from their default, change what they
# compute (a norm per group of features; statistics in the input's dtype): none of the styles
_OPTIONS = {"group_size": None, "force_float32_reductions": True}


def _why_not_hf_norm(m: nn.Module, style: str) -> str | None:
    """Why ``m``, of a class computing ``style`` as constructed by default, does not compute it."""
    w = getattr(m, "weight", None)
    if not isinstance(w, Tensor) or w.dim() != 1:
        return "expected a 1-D 'weight', one per feature of the last dim"
    if eps_of(m) is None:
        return "expected a float 'variance_epsilon' or 'eps'"
    kept = ("weight", "bias") if style in ("deberta", "nemotron") else ("weight",)
    bias = getattr(m, "bias", None)
    if style == "deberta" and (not isinstance(bias, Tensor) or bias.shape != w.shape):
        return "expected a 'bias' of the weight's shape"
    if style == "nemotron" and bias is not None and (not isinstance(bias, Tensor) or bias.shape != w.shape):
        return "expected a 'bias' of the weight's shape, or None"
    why = _unused_tensors(m, kept, style)
    if why is not None:
        return why
    for name, default in _OPTIONS.items():
        if getattr(m, name, default) != default:
            return f"{name}={getattr(m, name)!r} changes what it computes"
    return None


# --------------------------------------------------------------------------- blocks


def _why_not_norm(norm: nn.Module, name: str) -> str | None:
    if norm_style(norm) is None:
        return f"{name} ({type(norm).__name__}) was not patched"
    return None


def _stack(model: nn.Module, name: str, family: Family) -> tuple[str, nn.Module | None]:
    """The nearest ancestor of block ``name`` holding the family's final norm, and that norm; without
    one, the block's parent (its list of blocks: a stack of its own) and None."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:i])
        for final in (_dotted(model.get_submodule(prefix), n) for n in family.final_names):
            if isinstance(final, nn.Module):
                return prefix, final
    return ".".join(parts[:-1]), None


def _dotted(module: nn.Module, path: str):
    """The attribute at dotted ``path`` of ``module`` (a final norm inside a module of the stack's
    holder: Qwen2-VL's ``merger.ln_q``), or None where there is none."""
    try:
        return attribute(module, path)
    except AttributeError:
        return None


def _fuse_blocks(model: nn.Module, report: PatchReport) -> None:
    """Give every block of ``FAMILIES`` the fused forward; wire each block's last add to the norms
    the stream goes through next (the next block's first norms, or the stack's final norm)."""
    blocks = []
    for name, m in model.named_modules():
        family = family_of(m)
        if family is None:
            continue
        names = [a for s in family.steps for a in (*modules(s.sublayer), s.norm, s.post, s.layer_scale, s.beside) if a]
        names += [family.out_norm] if family.out_norm else []
        missing = [a for a in dict.fromkeys(names) if not _has(m, a)]
        if missing:
            report.skipped.append((name, type(m).__name__, f"has no {', '.join(missing)}: not the layout fused"))
            continue
        if "forward" in m.__dict__:
            report.skipped.append((name, type(m).__name__, _WRAPPED))
            continue
        blocks.append((name, m, family))
    # a block inside another (Zamba's Mamba layer in its hybrid layer) runs only in the outer
    # block's own forward, which the fused one replaces
    blocks = [b for b in blocks if not any(b[0].startswith(f"{o[0]}.") for o in blocks)]
    stacks: dict[str, list] = {}
    by_name = {b[0]: b for b in blocks}
    for name, m, family in blocks:
        stacks.setdefault(_stack(model, name, family)[0], []).append((name, m, family))
    for _stack_name, members in stacks.items():
        for i, (name, m, family) in enumerate(members):
            following = members[i + 1] if i + 1 < len(members) else None
            if family.alone and not (family.alone == "but_last" and following is None):
                following = "the model changes the stream after this layer (merges or adds tokens or embeddings)"
            elif family.then and _ends_a_stage_with(model, name, family.then):
                following = f"the stage's {family.then} changes the stream after this layer"
            elif family.scale:
                following = f"the layer scales the stream after its last add ({family.scale})"
            elif not (family.post_norm or family.norm_after or family.out_norm):  # (those hand nothing on)
                following = _runs_next(model, name, following, by_name)
            _wire(model, report, following, name, m, family)
    for name, m, family in blocks:
        if not any(a.fused for a in report.adds if a.block == name):  # (its own forward computes the same)
            continue
        original = type(m)
        m.__class__ = _subclass(original, "block")
        m.__dict__[ORIGINAL] = original
        m.__dict__[FAMILY] = family
        m.__dict__[OWNERS] = {name: type(getattr(m, name)) for name in owners(family)}
        report.fused.append(name)
    _report_unknown_blocks(model, report)


def _ends_a_stage_with(model: nn.Module, name: str, then: str) -> bool:
    """Whether block ``name`` is the last item of its list, and the module holding that list has a
    ``then`` module (not None) that runs after it."""
    parent, _, index = name.rpartition(".")
    if not index.isdigit() or int(index) + 1 < len(model.get_submodule(parent)):
        return False
    holder = model.get_submodule(parent.rpartition(".")[0]) if "." in parent else model
    return isinstance(getattr(holder, then, None), nn.Module)


def _report_unknown_blocks(model: nn.Module, report: PatchReport) -> None:
    """List the layers (items of a ModuleList) that hold a patched norm but no block of the table:
    their norms run addnorm's ops, their adds stay plain adds."""
    unknown = "block layout not in addnorm.patch.FAMILIES: its norms are replaced, its adds stay plain"
    # (a class of the table whose family runs not this configuration: BLOOM with the residual
    # taken after the norm)
    unfused = "this configuration of the block is not fused: its norms are replaced, its adds stay plain"
    listed = {a.block for a in report.adds}  # (blocks none of whose adds is fused: report.adds says why)
    for list_name, layers in model.named_modules():
        parts = list_name.split(".")
        if not isinstance(layers, nn.ModuleList) or any(".".join(parts[:k]) in listed for k in range(len(parts))):
            continue  # (a list inside a block of the table: Longcat-Flash's two attentions)
        for i, layer in enumerate(layers):
            if layer is None or f"{list_name}.{i}" in listed:  # (a ModuleList may hold None: Informer's conv_layers)
                continue
            inside = list(layer.modules())
            if any(norm_style(m) for m in inside) and not any(
                ORIGINAL in m.__dict__ and FAMILY in m.__dict__ for m in inside
            ):
                known = f"{type(layer).__module__}.{type(layer).__qualname__}" in FAMILIES
                report.skipped.append((f"{list_name}.{i}", type(layer).__name__, unfused if known else unknown))


def _runs_next(model: nn.Module, name: str, following, blocks: dict):
    """``following`` (the next block of the stack, or None for the stack's end) if that is what
    runs right after block ``name``; at a stack's end, the block of ``blocks`` that runs next (T5's
    block list patched without its final norm: each item's layers a stack of their own); else why
    the block hands nothing on: a layer addnorm does not fuse runs in between (a hybrid model's
    other kind), or the block is no item of a layer list."""
    nxt = _next_layer(model, name)
    if (following[0] if following is not None else None) == nxt:
        return following
    if following is None and nxt in blocks:
        return blocks[nxt]
    if nxt is None:
        return "the block is no item of a layer list: which layer runs next is unknown"
    layer = model.get_submodule(nxt.rpartition(".")[0])[int(nxt.rpartition(".")[2])]
    return f"the next layer, {nxt} ({type(layer).__name__}), is not fused"


def _next_layer(model: nn.Module, name: str) -> str | None:
    """The layer that runs after layer ``name`` (an item of a ModuleList or Sequential): the next
    item; after the last item of a list held by an item of another list (T5's ``block.i.layer``),
    the same list's first item in the next outer item; else None (the stack ends)."""
    parent, _, index = name.rpartition(".")
    if not index.isdigit():
        return None
    if int(index) + 1 < len(model.get_submodule(parent)):
        return f"{parent}.{int(index) + 1}" if parent else str(int(index) + 1)  # (a list patched itself)
    owner, _, attr = parent.rpartition(".")
    outer = _next_layer(model, owner) if owner else None
    if outer is None:
        return None
    inner = getattr(model.get_submodule(outer), attr, None)
    return f"{outer}.{attr}.0" if isinstance(inner, (nn.ModuleList, nn.Sequential)) and len(inner) else outer


def _has(m: nn.Module, path: str) -> bool:
    try:
        attribute(m, path)
    except AttributeError:
        return False
    return True


def _wire(model, report: PatchReport, following, name: str, m: nn.Module, family: Family) -> None:
    """Record the adds of block ``m`` and set the norms its last add feeds (``following``: the next
    block of the same stack, None for the last one, or why the next layer takes no hand-off)."""
    cls = type(m).__name__
    steps = family.steps
    if family.post_norm or family.norm_after:  # each add feeds its own step's norm
        for step in steps:
            why = _why_not_norm(attribute(m, step.norm), f"{name}.{step.norm}")
            report.adds.append(Add(name, cls, step.sublayer, None if why else f"{name}.{step.norm}", why or ""))
        return
    parallel = family.parallel is not None
    inner = [] if parallel else steps[:-1]
    for step, nxt in zip(inner, steps[1:], strict=False):
        if nxt.norm is None:
            why = f"no norm reads the sum: {nxt.sublayer} takes the stream itself"
        else:
            why = _why_not_norm(attribute(m, nxt.norm), f"{name}.{nxt.norm}")
        report.adds.append(Add(name, cls, step.sublayer, None if why else f"{name}.{nxt.norm}", why or ""))
    last = "+".join(s.sublayer for s in steps[:2]) if parallel else steps[-1].sublayer
    if family.out_norm:  # the block's own norm reads its last add
        why = _why_not_norm(attribute(m, family.out_norm), f"{name}.{family.out_norm}")
        report.adds.append(Add(name, cls, last, None if why else f"{name}.{family.out_norm}", why or ""))
        return
    if isinstance(following, str):
        targets, where = [(None, None)], following
    elif following is not None:
        f_name, f_block, f_family = following
        names = f_family.entry_norms
        targets = [(f"{f_name}.{n}", attribute(f_block, n)) if n else (None, None) for n in names]
        where = f"the next block's {names[0] or f_family.steps[0].sublayer} takes the stream itself"
    else:
        _, final = _stack(model, name, family)
        targets = [(_module_name(model, final), final)] if final is not None else [(None, None)]
        finals = " or ".join(map(repr, family.final_names))
        where = f"no final norm {finals + ' ' if finals else ''}found above the block"
    why = _handoff_problem(targets, where)
    if why is None and family.cast and getattr(m, "residual_in_fp32", False):
        cast = [n for n, norm in targets if norm.weight.dtype != torch.float32]
        if cast:  # (as blocks._reads_the_stream decides at each call)
            why = f"the stream is float32 (residual_in_fp32), {cast[0]}'s weight is not: the norm reads a cast copy"
    if why is None:
        m.__dict__[NEXT] = tuple(norm for _, norm in targets)
        if isinstance(following, tuple) and following[2].skipped_without:
            m.__dict__[NEXT_IF] = following[2].skipped_without
        for _, norm in targets:
            if type(norm) in (addnorm_nn.LayerNorm, addnorm_nn.RMSNorm):
                norm.__class__ = _subclass(type(norm), _HANDOFF)
    report.adds.append(Add(name, cls, last, None if why else " + ".join(n for n, _ in targets), why or ""))


def _handoff_problem(targets, where: str) -> str | None:
    if any(norm is None for _, norm in targets):
        return where
    for target, norm in targets:
        why = _why_not_norm(norm, target)
        if why:
            return why
    if len(targets) == 2:
        (_, a), (_, b) = targets
        if norm_style(a) not in ("layer", "rms") or norm_style(b) != norm_style(a):
            return "the next block's two norms are not LayerNorm / RMSNorm of one style"
        if a.normalized_shape != b.normalized_shape or a.eps != b.eps:
            return "the next block's two norms differ in shape or eps"
    return None


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


# --------------------------------------------------------------------------- patch / unpatch


def patch(model: nn.Module, *, norm_types=None, fuse_residual: bool = False, backend: str = "auto") -> PatchReport:
    """Make every norm of ``model`` run addnorm's ops, in place; returns a :class:`PatchReport`.

    Args:
        model: any ``nn.Module`` (a plain torch model, a Hugging Face model, ...).
        norm_types: which norms to replace. ``None`` (default): ``torch.nn.LayerNorm``,
            ``torch.nn.RMSNorm`` (exact classes, not subclasses with their own forward) and the
            Hugging Face norms of ``HF_NORMS``. An iterable of those classes picks some of them;
            a mapping ``{cls: style}`` (style in ``STYLES``) adds classes addnorm does not know.
        fuse_residual: also run the residual adds of the blocks of ``FAMILIES`` inside the norms
            that follow them (opt-in; same outputs; ``report.adds`` says which).
        backend: the ``backend=`` of the patched norms (``"auto"``, ``"reference"``, ...); patching
            a patched model again gives its norms this backend (and fuses the adds with
            ``fuse_residual=True``; blocks fused before stay fused: :func:`unpatch` undoes both).

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
    inside = ()  # the prefixes of replaced norms: modules inside one (a "moonshine" norm's ``ln``) are never called
    for name, m in list(model.named_modules()):
        cls = type(m)
        if name.startswith(inside):
            continue
        if ORIGINAL in m.__dict__:  # patched before (a norm: runs this call's backend from now on)
            if "backend" in m.__dict__:
                inside += (f"{name}." if name else "",)
                if m.backend != backend:
                    m.backend = backend
                    report.replaced.append((name, m.__dict__[ORIGINAL].__name__, norm_style(m)))
                    continue
            report.already.append(name)
            continue
        style = types.get(cls, types.get(_path(cls)))
        if style is None and norm_types is None:
            style = flash_attn_style(m)
        if style is None:
            if norm_types is not None and (cls in _KNOWN or _path(cls) in _KNOWN or flash_attn_style(m)):
                report.skipped.append((name, cls.__name__, "a norm addnorm knows, left out by norm_types"))
            elif norm_style(m) is None and _looks_like_norm(m):
                report.skipped.append((name, cls.__name__, "unknown norm class; see norm_types"))
            continue
        why = _patch_norm(m, style, backend)
        if why is None:
            report.replaced.append((name, cls.__name__, norm_style(m)))
            inside += (f"{name}." if name else "",)
        else:
            report.skipped.append((name, cls.__name__, why))
    if fuse_residual:
        _fuse_blocks(model, report)
    if not (report.replaced or report.already or report.skipped):
        warnings.warn(f"addnorm.patch: no norm found in the {type(model).__name__}", stacklevel=2)
    return report


def unpatch(model: nn.Module) -> int:
    """Give every module :func:`patch` changed its original class back; returns how many."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    count = 0
    for m in model.modules():
        original = m.__dict__.pop(ORIGINAL, None)
        m.__dict__.pop(NEXT, None)
        m.__dict__.pop(NEXT_IF, None)
        m.__dict__.pop(FAMILY, None)
        m.__dict__.pop(OWNERS, None)
        if original is not None:
            if norm_style(m) is not None:
                del m.backend
            m.__class__ = _remade_on(original, type(m))
            count += 1
    return count


def _patched_class(cls: type) -> bool:
    """Whether :func:`patch` made ``cls`` (in this process or, unpickled, in another)."""
    return cls in (addnorm_nn.LayerNorm, addnorm_nn.RMSNorm) or "_addnorm_made_from" in cls.__dict__


def _remade_on(original: type, cls: type) -> type:
    """``original`` for a module of a class :func:`patch` made; for one of a class made from that
    after patching (torch's parametrize makes one per module, holding the properties of the
    parametrized tensors), the same class made from ``original`` instead."""
    if _patched_class(cls) or not _patched_class(cls.__bases__[0]):
        return original
    body = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
    return type(cls.__name__.replace(cls.__bases__[0].__name__, original.__name__), (original,), body)
