"""Residual fusion: the one forward that runs every block of ``FAMILIES`` (:mod:`.families`) with
each add inside the norm that follows it.

A block is a sequence of steps on the residual stream ``s``: ``h = norm(s)`` (or ``s`` itself),
``out = post(sublayer(h))``, ``s = s + branch(out)`` where the branch is the block's dropout, layer
scale and drop path. Each add is fused with the norm that reads ``s`` next: the next step's norm
inside the block, and for the block's last add, the first norm of the *next* block (or the stack's
final norm after the last block), found by :func:`addnorm.patch` from the model's structure. That
last Add & Norm is computed in the block and handed to the next norm (:func:`.norms.hand_off`),
which uses it only when called with the very stream tensor the block returned: the model's own
loop, hooks and checkpointing stay as they are, and anything that changes the stream in between
makes the next norm compute as usual. Parallel blocks (GPT-NeoX) add both sublayer outputs in one
op and hand the next block both of its norms (``x1``, ``norm1``).
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..ops import NO_SUBLAYER, Sublayer
from .layout import NO_RESIDUAL, Family, Step, modules
from .norms import add_norm_forward, fusable, fx_tracing, hand_off, tensors

ORIGINAL = "_addnorm_original_class"
NEXT = "_addnorm_next"  # the norms the block's last add feeds, set by patch()
NEXT_IF = "_addnorm_next_if"  # a block argument without which the next block is skipped, set by patch()
FAMILY = "_addnorm_family"  # the block's Family, set by patch() (some depend on the block's config)
OWNERS = "_addnorm_owners"  # {name: class} of the modules of owners(family), set by patch()
# In eval mode without autograd, a block whose stream has fewer elements than this runs its own
# forward (its norms patched), where that gives the same bits (:attr:`Family.unfused_same_bits`):
# a decode step's one row per sequence moves too few bytes for a fused add to save anything, and
# the fused forward's Python costs more than the add it saves (docs/integrations.md, "Generation").
INFERENCE_FUSE_MIN_ELEMENTS = 1 << 16


# --------------------------------------------------------------------------- the fused forward


def renamed_arguments(forward) -> frozenset[str]:
    """The argument names a decorator of a block's ``forward`` renames before calling it:
    transformers' ``deprecate_kwarg`` (``past_key_values`` -> ``cache``), found by the ``old_name``
    its wrapper holds. A call using one of them runs the original forward, which renames it (the
    fused forward, not decorated, would pass it on under the old name, beside the new one)."""
    names = set()
    while callable(forward):
        try:
            old = inspect.getclosurevars(forward).nonlocals.get("old_name")
        except (TypeError, ValueError):  # (not a Python function)
            break
        if isinstance(old, str):
            names.add(old)
        forward = getattr(forward, "__wrapped__", None)
    return frozenset(names)


def bindings(forward) -> tuple[tuple[str, ...], dict, frozenset, bool] | None:
    """The arguments after the stream of a block's ``forward``: the names that may come by
    position, in order, the defaults, the names without one, and whether it takes ``**kwargs``,
    for :func:`_arguments` to bind a call without ``inspect``'s ``bind`` (a large share of the
    fused forward's Python on a one-row call); None where a parameter is positional-only or
    ``*args``, or ``**`` has another name than ``kwargs``: those calls bind with ``inspect``."""
    P = inspect.Parameter
    positional, defaults, required, spreads = [], {}, set(), False
    for p in list(inspect.signature(forward).parameters.values())[2:]:
        if p.kind == P.VAR_KEYWORD and p.name == "kwargs":
            spreads = True
            continue
        if p.kind not in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY):
            return None
        if p.kind == P.POSITIONAL_OR_KEYWORD:
            positional.append(p.name)
        if p.default is P.empty:
            required.add(p.name)
        else:
            defaults[p.name] = p.default
    return tuple(positional), defaults, frozenset(required), spreads


def _arguments(self, args, kwargs) -> tuple[Tensor, dict, dict]:
    """The stream (the original block forward's first argument, whatever its name: Llama 4's
    vision layers take ``hidden_state``), the arguments after it by name, with its defaults filled
    in and its ``**kwargs`` spread (passed on as the original does, whichever name its cache
    argument has); and those ``**kwargs`` alone."""
    cls = type(self)
    spreads = self.__dict__[FAMILY].kwargs
    if args and cls._addnorm_bindings is not None:  # the stream, then arguments it names: the usual call
        positional, defaults, required, takes_kwargs = cls._addnorm_bindings
        named, spread = dict(defaults), {}
        given = dict(zip(positional, args[1:]))
        if len(args) - 1 <= len(positional) and not any(key in kwargs for key in given):  # (as torch.compile traces it)
            named.update(given)
            for key, value in kwargs.items():
                if key in named or key in required:
                    named[key] = value
                elif takes_kwargs and key not in (cls._addnorm_stream, "self"):
                    spread[key] = value
                else:  # (an unknown name: inspect's error)
                    break
            else:
                if all(key in named for key in required):
                    return args[0], named | spread if spreads else named, spread if spreads else {}
    bound = cls._addnorm_signature.bind(self, *args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    del named["self"]
    stream = named.pop(cls._addnorm_stream)
    spread = named.pop("kwargs", {})  # (popped either way: the sublayer gets no argument 'kwargs')
    if not spreads:
        spread = {}
    return stream, named | spread, spread


def attribute(block: nn.Module, path: str):
    """The attribute at dotted ``path`` of ``block`` (``"mlp.dense_4h_to_h"``; ``""``: the block); a
    number after a list or tuple is its item (``"conv_residual_weights.1"``)."""
    if "." not in path:
        return getattr(block, path) if path else block
    value = block
    for name in filter(None, path.split(".")):
        value = value[int(name)] if isinstance(value, (list, tuple)) else getattr(value, name)
    return value


def owners(family: Family) -> set[str]:
    """The modules whose layers the fused forward runs one by one instead of calling them (BLOOM's
    ``mlp`` in ``"mlp.dense_h_to_4h mlp.gelu_impl mlp.dense_4h_to_h"``), and those it gives
    ``NO_RESIDUAL`` (:attr:`Step.adds`: BLOOM's attention), which a hook or another module in
    their place would see instead of the stream; and the layer scale modules, whose scale the fused
    op reads instead of calling them."""
    inside = {path.split(".")[0] for step in family.steps for path in modules(step.sublayer) if "." in path}
    scales = {step.layer_scale for step in family.steps if step.layer_scale}
    return inside | scales | {step.sublayer for step in family.steps if step.adds}


def _owners_intact(block: nn.Module) -> bool:
    """Whether calling each of :func:`owners` would run what the fused forward runs instead: the
    class seen when patched, its own forward, and no hook that the call would fire (a hook on it,
    FSDP's, a global one)."""
    for name, cls in block.__dict__.get(OWNERS, {}).items():
        owner = getattr(block, name)
        if type(owner) is not cls or "forward" in owner.__dict__ or _hooked(owner):
            return False
    return True


def _dropout_p(block: nn.Module, step: Step) -> float:
    """The dropout probability of ``step`` now: an ``nn.Dropout``'s own when that module is in
    training mode (as its own call; 0 in eval mode, whatever the block's mode), a float
    attribute's when the module holding it is (the block, or BLOOM's MLP: as
    ``F.dropout(..., training=self.training)`` there)."""
    if step.dropout is None:
        return 0.0
    value = attribute(block, step.dropout)
    if isinstance(value, nn.Dropout):
        return float(value.p) if value.training else 0.0
    # (a config's float attribute follows the block's mode)
    owner = attribute(block, step.dropout.rpartition(".")[0]) if "." in step.dropout else block
    return float(value) if (owner if isinstance(owner, nn.Module) else block).training else 0.0


def _rowscale(block: nn.Module, step: Step, x: Tensor) -> Tensor | None:
    """Drop path as one factor per row: each sample kept with probability 1 - p and scaled by
    1 / (1 - p), drawn as Hugging Face's ``drop_path`` draws it (one uniform per sample)."""
    module = getattr(block, step.drop_path) if step.drop_path else None
    p = float(getattr(module, "drop_prob", 0.0) or 0.0)
    if not p or not module.training:  # (the drop path module's mode, as its own call)
        return None
    keep = 1 - p
    kept = (keep + torch.rand(x.shape[:1], dtype=x.dtype, device=x.device)).floor_()
    return (kept / keep).view(-1, *[1] * (x.dim() - 2)).expand(x.shape[:-1])


def _branch(block: nn.Module, step: Step, out: Tensor) -> Tensor:
    """The unfused branch: what the original forward adds to the stream."""
    p = _dropout_p(block, step)
    if p:
        out = F.dropout(out, p, training=True)
    if step.layer_scale:
        out = getattr(block, step.layer_scale)(out)
    if step.multiplier:
        out = out * _multiplier(block, step)
    if step.drop_path:
        out = getattr(block, step.drop_path)(out)
    return out


def _layer_scale(module: nn.Module) -> Tensor | None:
    """The scale per channel of a layer scale module: DINOv2's ``lambda1``, Mimi's ``scale``; None
    for an identity (Sapiens2's MLP has none)."""
    if isinstance(module, nn.Identity):
        return None
    return module.lambda1 if hasattr(module, "lambda1") else module.scale


def _multiplier(block: nn.Module, step: Step):
    """What :attr:`Step.multiplier` scales the output by: the block's attribute it names, or itself."""
    return step.multiplier if isinstance(step.multiplier, float) else attribute(block, step.multiplier)


def _sublayer(block: nn.Module, step: Step, x: Tensor) -> Sublayer:
    if not (step.layer_scale or step.multiplier or step.dropout or step.drop_path):
        return NO_SUBLAYER
    scale = _layer_scale(getattr(block, step.layer_scale)) if step.layer_scale else None
    multiplier = _multiplier(block, step) if step.multiplier else None
    if isinstance(multiplier, Tensor):  # a learned scale per channel: the layer scale itself
        scale = multiplier
    elif multiplier is not None:  # a constant layer scale, in float32 (float64 for float64) as torch
        # multiplies a tensor by a Python float
        dtype = torch.promote_types(x.dtype, torch.float32)
        scale = torch.full(x.shape[-1:], float(multiplier), dtype=dtype, device=x.device)
    return Sublayer(dropout_p=_dropout_p(block, step), layer_scale=scale, rowscale=_rowscale(block, step, x))


def _may_hand_off(block: nn.Module, norms: tuple[nn.Module, ...], x: Tensor) -> bool:
    """Whether the last add can be computed with the next norms now: not under torch.compile or
    activation checkpointing (which replay a block alone), not on an inference tensor (which has
    no version counter: an in-place change of the stream before the next norm would go unseen,
    :func:`.norms.handed_off`), and with outputs the next norms can take (:func:`_computable`)."""
    if not norms or torch.compiler.is_compiling() or x.is_inference():
        return False
    if getattr(block, "gradient_checkpointing", False) and block.training:
        return False
    # a forward pre-hook runs before the norm's forward, and may set what it computes with (torch's
    # pruning rebuilds the weight in one): the output is then computed by the norm's own call
    pre_hooks = any(n._forward_pre_hooks for n in norms) or nn.modules.module._global_forward_pre_hooks
    return not pre_hooks and all(_computable(norm, x) for norm in norms)


def _computable(norm: nn.Module, x: Tensor) -> bool:
    """Whether ``norm``'s output on ``x`` can come out of a fused op: its output can
    (:func:`.norms.fusable`), its parameters are plain tensors on ``x``'s device (not sharded away by
    FSDP, not offloaded), and calling it runs its class's forward alone (no forward set on the
    module itself, as accelerate's hooks set one to load the weights first)."""
    for w in tensors(norm):
        if not isinstance(w, Tensor):
            continue
        # (a parameter of a plain tensor is one: only a subclass's ``.data``, a new tensor each
        # time, needs asking)
        plain = type(w) is nn.Parameter or type(w) is Tensor or type(w.data) is Tensor
        if not plain or w.device != x.device:
            return False
    return "forward" not in norm.__dict__ and fusable(norm, x)


def _inline(norm: nn.Module | None, x: Tensor) -> bool:
    """Whether a norm called inside the block can be computed by the block's fused op instead:
    its output can come from it, and nothing hooks the norm's call (a hook on it, or a global
    module hook), which the fused op would skip."""
    if norm is None or not _computable(norm, x):
        return False
    return not _hooked(norm)


def _hooked(module: nn.Module) -> bool:
    """Whether a call of ``module`` runs a hook: one on it, or a global module hook."""
    hooks = nn.modules.module
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    )


def _add(block: nn.Module, step: Step, out: Tensor, s: Tensor, norm: nn.Module | None):
    """``(norm(s'), s')`` for the new stream ``s' = s + branch(out)``, fused when ``norm`` is given
    (and its output can come from the fused op, :func:`_inline`); ``(s', s')`` when no norm follows."""
    if _inline(norm, out):
        return add_norm_forward(norm, out, s, sublayer=_sublayer(block, step, out))
    s = s + _branch(block, step, out)
    return (s, s) if norm is None else (norm(s), s)


def _run(block: nn.Module, step: Step, h: Tensor, call: dict, s: Tensor | None = None) -> Tensor:
    """The step's sublayer (its modules in turn, a float among them a dropout; or its ``run``, given
    the stream ``s`` too) on ``h``; ``call``: the keyword arguments of a sublayer that takes the
    block's (:attr:`Step.call`), those named ``*name`` in it multiplying ``h`` there rather than
    passed on."""
    if step.adds:
        call = call | {step.adds: _no_residual()}
    if step.run:
        return step.run(block, h, s, call)
    words = step.sublayer.split()
    factors = {word[1:]: call[word[1:]] for word in words if word[0] == "*"}
    if factors:
        call = {k: v for k, v in call.items() if k not in factors}
    for name in words:
        if name[0] == "*":  # as the block's ``h = h * name``
            h = h * factors[name[1:]]
            continue
        if "+" in name:  # modules on the same input, their outputs summed in the order written
            first, *others = (attribute(block, path) for path in name.split("+"))
            out = first(h, **call)
            for module in others:
                out = out + module(h, **call)
            h = out
            continue
        module = attribute(block, name)
        if isinstance(module, (int, float)):  # as F.dropout(h, p=self.<name>, training=self.training)
            h = F.dropout(h, module, training=block.training) if module else h
        else:
            h = module(h, **call)
    return h


def _no_residual():
    """What a sublayer that adds a residual itself is given (:attr:`Step.adds`): ``NO_RESIDUAL``,
    whose sum is the other tensor itself; 0 when torch.compile (or export) traces the block, whose
    graphs take no Python object in an add (and fuse the add of 0 away)."""
    return 0 if torch.compiler.is_compiling() else NO_RESIDUAL


def _call_first(
    block: nn.Module, family: Family, step: Step, h: Tensor, s: Tensor, named: dict
) -> tuple[Tensor, tuple]:
    for old, new in family.rename:
        named[new] = named.pop(old)
    if step.adds:
        named[step.adds] = _no_residual()
    if family.self_cache and named.get("cache") is not None:
        named["cache"] = getattr(named["cache"], family.self_cache)
    result = step.run(block, h, s, named) if step.run else attribute(block, step.sublayer)(h, **named)
    return (result[0], tuple(result[family.extras_from :])) if isinstance(result, tuple) else (result, ())


def block_forward(self, *args, **kwargs):
    """The forward of every block of ``FAMILIES``: the original's steps with each add fused."""
    family = self.__dict__[FAMILY]
    if (
        fx_tracing()  # (first: nothing below may take the Proxy values of a trace)
        or (kwargs and not type(self)._addnorm_renamed.isdisjoint(kwargs))
        or _too_small(self, family, args, kwargs)
    ):
        return self.__dict__[ORIGINAL].forward(self, *args, **kwargs)  # (fx_tracing, renamed_arguments, _too_small)
    if family.post_norm:
        return _post_norm_forward(self, family, *args, **kwargs)
    hidden_states, named, spread = _arguments(self, args, kwargs)
    extras_asked = family.extras_if is None or bool(named.get(family.extras_if))
    if (
        any(named.get(name) is not None for name in family.fallback)
        or (family.requires is not None and named.get(family.requires) is None)
        or (family.clamp16 and hidden_states.dtype == torch.float16)
        or not _owners_intact(self)
    ):
        return self.__dict__[ORIGINAL].forward(self, *args, **kwargs)
    steps = tuple(st for st in family.steps if st.needs is None or named.get(st.needs) is not None)
    calls = [
        {new: named.get(old) for old, new in st.call} | (spread if st.kwargs else {}) if st.call else {} for st in steps
    ]
    nxt = tuple(self.__dict__.get(NEXT, ()))
    if NEXT_IF in self.__dict__ and named.get(self.__dict__[NEXT_IF]) is None:  # the next block is skipped
        nxt = ()
    for name in family.fallback + family.drop:
        named.pop(name, None)
    if not _may_hand_off(self, nxt, hidden_states):
        nxt = ()
    if family.parallel:
        s, extras = _parallel_forward(self, family, hidden_states, named, nxt)
    else:
        s, extras = _sequential_forward(self, family, steps, hidden_states, named, calls, nxt)
    if not family.extras:
        return s
    if not extras_asked:
        return (s,)
    return (s, *extras, *(None,) * (family.padded - len(extras)))


def _too_small(block: nn.Module, family: Family, args: tuple, kwargs: dict) -> bool:
    """Whether the call is an inference call too small to gain from fusing, which its block's own
    forward computes with the same bits (``INFERENCE_FUSE_MIN_ELEMENTS``)."""
    if block.training or torch.is_grad_enabled() or not family.unfused_same_bits:
        return False
    at = 1 if family.post_norm else 0  # (BERT's output: the stream is the residual it adds, its second argument)
    stream = args[at] if len(args) > at else kwargs.get(list(type(block)._addnorm_signature.parameters)[at + 1])
    small = isinstance(stream, Tensor) and stream.numel() < INFERENCE_FUSE_MIN_ELEMENTS
    return small and not torch.compiler.is_compiling()


def _norm(block: nn.Module, name: str | None) -> nn.Module | None:
    return None if name is None else attribute(block, name)


def _reads_the_stream(family: Family, norm: nn.Module, s: Tensor, out: Tensor) -> bool:
    """Whether ``norm`` is called on the new stream ``s + out`` itself: in a family that casts the
    stream to the norm's weight dtype first, only where that cast changes nothing (else the norm
    reads a copy, and a handed-off output would go unused)."""
    return not family.cast or torch.result_type(s, out) == norm.weight.dtype


def _sequential_forward(self, family, steps, s: Tensor, named: dict, calls: list, nxt: tuple) -> tuple[Tensor, tuple]:
    """The steps that run this call (each with its keyword arguments in ``calls``), one by one."""
    first = None if family.norm_after else _norm(self, steps[0].norm)
    if family.cast:
        h = first(s.to(first.weight.dtype))
        s = s.to(torch.float32) if getattr(self, "residual_in_fp32", False) else s
    else:
        h = s if first is None else first(s)
    if family.normed_residual:
        s = h
    extras, later = (), None
    for i, step in enumerate(steps):
        if step.beside:  # (run first, as the block runs it)
            later = attribute(self, step.beside)(h)
        if i == 0:
            out, extras = _call_first(self, family, step, h, s, named)
        else:
            out = _run(self, step, h, calls[i], s)
            if step.extras:
                extras += tuple(out[1:])
            out = out[0] if step.first else out
            out = out.view(s.shape) if step.flat else out
        if step.post is not None:
            out = attribute(self, step.post)(out)
        if step.divisor:
            out = out / attribute(self, step.divisor)
        if step.residual_scale:
            s = s * attribute(self, step.residual_scale)
        if family.norm_after:
            h = s = _add_then_norm(self, step, out, s)
        elif i + 1 < len(steps):
            h, s = _add(self, step, out, s, _norm(self, steps[i + 1].norm))
            s = h if family.normed_residual else s
        elif family.out_norm:  # (the block returns the norm's output: the stream ends here)
            s, _ = _add(self, step, out, s, attribute(self, family.out_norm))
        elif nxt and not family.scale and fusable(nxt[0], out) and _reads_the_stream(family, nxt[0], s, out):
            # (the next norm is called by the model: its hooks run there)
            if later is None:
                y, s = add_norm_forward(nxt[0], out, s, sublayer=_sublayer(self, step, out))
            else:  # s + out + later: the op adds its x1 first (the last step has no branch: Step)
                y, s = add_norm_forward(nxt[0], later, s, x1=out)
            hand_off(nxt[0], s, y)
        else:
            s = s + _branch(self, step, out)
            s = s if later is None else s + later
    if family.scale:  # (a fresh sum: scaled in place, as the block does)
        s *= attribute(self, family.scale)
    return s, extras


def _parallel_forward(self, family: Family, s: Tensor, named: dict, nxt: tuple) -> tuple[Tensor, tuple]:
    """Attention and MLP on the same stream: ``s + dropout(mlp) + dropout(attn)`` (GPT-NeoX, "x1";
    Cohere, "chain") or ``s + dropout(mlp + attn)`` (Falcon, "sum"). The fused op adds ``attn`` (its
    ``x1``) to ``s`` first, as Cohere does; without dropout "x1" adds the outputs' sum, as GPT-NeoX."""
    attn, mlp = family.steps[:2]
    h_attn = attribute(self, attn.norm)(s)
    h_mlp = h_attn if mlp.norm == attn.norm else attribute(self, mlp.norm)(s)
    out_attn, extras = _call_first(self, family, attn, h_attn, s, named)
    out_mlp = _run(self, mlp, h_mlp, {})
    p, p_attn = _dropout_p(self, mlp), _dropout_p(self, attn)
    if family.parallel == "sum" or (family.parallel == "x1" and not p and not p_attn):
        # (without dropout, GPT-NeoX's and Phi's mlp + attn + s is s plus the outputs' sum: the
        # model's own bits)
        out_mlp, out_attn = out_mlp + out_attn, None
    if nxt and (out_attn is None or p == p_attn):
        second = nxt[1] if len(nxt) > 1 else None
        ys = add_norm_forward(nxt[0], out_mlp, s, sublayer=Sublayer(dropout_p=p), x1=out_attn, norm1=second)
        for norm, y in zip(nxt, ys[:-1], strict=True):
            hand_off(norm, ys[-1], y)
        return ys[-1], extras
    if out_attn is None:
        return s + _branch(self, mlp, out_mlp), extras
    if family.parallel == "chain":
        return s + _branch(self, attn, out_attn) + _branch(self, mlp, out_mlp), extras
    return _branch(self, mlp, out_mlp) + _branch(self, attn, out_attn) + s, extras


def _add_then_norm(block: nn.Module, step: Step, out: Tensor, s: Tensor) -> Tensor:
    """Post-norm: ``norm(branch(out) + s)`` of the step's norm, dropout, add and norm in one op."""
    norm = attribute(block, step.norm)
    if not _inline(norm, out):
        return norm(_branch(block, step, out) + s)
    return add_norm_forward(norm, out, s, sublayer=_sublayer(block, step, out), prenorm=False)


def _post_norm_forward(self, family: Family, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
    """BERT's output: ``norm(dropout(dense(h)) + input_tensor)``."""
    (step,) = family.steps
    return _add_then_norm(self, step, _run(self, step, hidden_states, {}), input_tensor)
