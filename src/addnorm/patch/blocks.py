"""Residual fusion: which add of which block feeds which norm (``FAMILIES``), and the one forward
that runs every block of the table with each add inside the norm that follows it.

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

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..ops import Sublayer
from .hf_norms import hf_path, pairs
from .norms import add_norm_forward, fusable, hand_off

ORIGINAL = "_addnorm_original_class"
NEXT = "_addnorm_next"  # the norms the block's last add feeds, set by patch()
FAMILY = "_addnorm_family"  # the block's Family, set by patch() (some depend on the block's config)


@dataclass(frozen=True)
class Step:
    """One sublayer and its add: ``s = s + branch(post(sublayer(norm(s))))``."""

    # a module, or several applied in turn ("fc1 activation_fn fc2": OPT's MLP), a float attribute
    # among them a dropout probability (Whisper's "activation_dropout")
    sublayer: str
    norm: str | None = None  # the pre-norm (None: the sublayer reads the stream itself)
    post: str | None = None  # a norm of the sublayer's output before the add (sandwich norms)
    dropout: str | None = None  # an nn.Dropout (module) or a float attribute path ("config.p")
    layer_scale: str | None = None  # a module whose ``lambda1`` scales the output
    multiplier: str | None = None  # a float attribute of the block scaling the output (Granite)
    drop_path: str | None = None  # a per-sample drop path module with ``drop_prob``
    first: bool = False  # the sublayer returns a tuple whose first item is its output (GPT-OSS's MoE)
    flat: bool = False  # the sublayer returns the rows flat, (tokens, hidden) (Llama 4's MoE)
    # after the first step: block argument -> sublayer keyword, passed with the block's **kwargs
    # (Whisper's cross-attention: encoder_hidden_states -> key_value_states)
    call: tuple[tuple[str, str], ...] = ()
    needs: str | None = None  # a block argument without which the step is skipped (cross-attention)


@dataclass(frozen=True)
class Family:
    """How to run a block class: its steps, the final norm of the stack it sits in (an attribute
    of the nearest ancestor that has it), and how its first sublayer is called."""

    steps: tuple[Step, ...]
    final: str | tuple[str, ...] | None = None  # the stack's final norm (the first name its holder has)
    rename: tuple[tuple[str, str], ...] = ()  # block argument -> attention argument
    drop: tuple[str, ...] = ()  # block arguments the attention does not take
    fallback: tuple[str, ...] = ()  # arguments which, when given, make the block run its own forward
    extras: bool = False  # the block returns (stream, *the attention's other outputs)
    kwargs: bool = True  # the block passes its ``**kwargs`` on to the attention
    # parallel blocks: "x1" adds both outputs, each with its dropout (GPT-NeoX: mlp + attn + s);
    # "chain" the same in the stream's order (Cohere: s + attn + mlp); "sum" adds their sum with
    # one dropout (Falcon); the steps' norms may be one module
    parallel: str | None = None
    post_norm: bool = False  # (BERT) the block is ``norm(dropout(sublayer(h)) + input_tensor)``
    # (Mamba) the first norm reads the stream cast to its weight's dtype, and the add takes the stream
    # in float32 where the block's ``residual_in_fp32`` is set
    cast: bool = False
    clamp16: bool = False  # (Whisper) float16 streams are clamped after the last add: they run the original


def _llama(m: str, c: str, steps: tuple[Step, ...]) -> tuple[str, Family]:
    return hf_path(m, f"{c}DecoderLayer"), Family(steps, final="norm")


_PRE = (Step("self_attn", "input_layernorm"), Step("mlp", "post_attention_layernorm"))
_GRANITE = tuple(Step(s.sublayer, s.norm, multiplier="residual_multiplier") for s in _PRE)  # s + out * m
_SANDWICH = (
    Step("self_attn", "input_layernorm", post="post_attention_layernorm"),
    Step("mlp", "pre_feedforward_layernorm", post="post_feedforward_layernorm"),
)
_BERT = Family((Step("dense", "LayerNorm", dropout="dropout"),), post_norm=True)
_T5_ATTENTION = dict(final="final_layer_norm", rename=(("attention_mask", "mask"),), extras=True)
_T5_LAYERS = {  # T5's and mT5's layer classes, by the name after the model's prefix
    "LayerSelfAttention": Family((Step("SelfAttention", "layer_norm", dropout="dropout"),), **_T5_ATTENTION),
    "LayerCrossAttention": Family((Step("EncDecAttention", "layer_norm", dropout="dropout"),), **_T5_ATTENTION),
    "LayerFF": Family((Step("DenseReluDense", "layer_norm", dropout="dropout"),), final="final_layer_norm"),
}

# (model, class prefix) of decoder layers whose forward runs the statements of Llama's (or OLMo 2's)
# LlamaDecoderLayer.forward: the same syntax tree, docstring, comments and signature aside (a test
# compares them; the signature is bound as each class declares it)
COPIES = {
    "llama": """
    arcee.Arcee aria.AriaText bitnet.BitNet csm.Csm cwm.Cwm deepseek_v2.DeepseekV2 deepseek_v3.DeepseekV3
    deepseek_v32.DeepseekV32 diffllama.DiffLlama dots1.Dots1 ernie4_5.Ernie4_5 ernie4_5_moe.Ernie4_5_Moe
    exaone_moe.ExaoneMoe glm.Glm glm4_moe.Glm4Moe glm4_moe_lite.Glm4MoeLite glm4v_moe.Glm4vMoeText
    helium.Helium hunyuan_v1_dense.HunYuanDenseV1 hunyuan_v1_moe.HunYuanMoEV1 jais2.Jais2
    mimo_v2_flash.MiMoV2Flash ministral.Ministral ministral3.Ministral3 mistral4.Mistral4 olmo.Olmo
    olmoe.Olmoe qwen2_5_omni.Qwen2_5Omni qwen2_5_vl.Qwen2_5_VL qwen2_vl.Qwen2VL
    qwen3_omni_moe.Qwen3OmniMoeThinkerText qwen3_vl.Qwen3VLText qwen3_vl_moe.Qwen3VLMoeText
    seed_oss.SeedOss smollm3.SmolLM3 solar_open.SolarOpen starcoder2.Starcoder2 youtu.Youtu
    """,
    "olmo2": "exaone4.Exaone4 olmo3.Olmo3",
}
# encoder layers whose forward runs the statements of CLIPEncoderLayer.forward, in models whose
# encoders end with a norm of the whole stream: the text encoder's ``final_layer_norm``, the vision
# encoder's ``post_layernorm`` (CLIP's vision encoder normalizes only its pooled token: not fused)
CLIP_COPIES = "siglip.Siglip siglip2.Siglip2 idefics2.Idefics2 idefics3.Idefics3 smolvlm.SmolVLM"
_CLIP = (Step("self_attn", "layer_norm1"), Step("mlp", "layer_norm2"))
# layers whose forward runs the statements of ViTLayer.forward (model.class prefix of <prefix>Layer)
VIT_COPIES = """
    audio_spectrogram_transformer.AST deit.DeiT ijepa.IJepa videoprism.VideoPrism vit_mae.ViTMAE vit_msn.ViTMSN
    vivit.Vivit
"""
_VIT = (Step("attention", "layernorm_before", dropout="dropout"), Step("mlp", "layernorm_after", dropout="dropout"))
_POST = (Step("self_attn", post="post_attention_layernorm"), Step("mlp", post="post_feedforward_layernorm"))
# encoder and decoder layers whose forward runs the statements of Whisper's (a keyword
# ``hidden_states=`` to a sublayer counted as its first argument): mBART, NLLB, Pegasus, ...
WHISPER_COPIES = {
    "encoder": """
    audioflamingo3.AudioFlamingo3EncoderLayer blenderbot.BlenderbotEncoderLayer m2m_100.M2M100EncoderLayer
    mbart.MBartEncoderLayer moss_transcribe_diarize.MossTranscribeDiarizeAudioLayer pegasus.PegasusEncoderLayer
    qwen2_audio.Qwen2AudioEncoderLayer speech_to_text.Speech2TextEncoderLayer voxtral.VoxtralEncoderLayer
    """,
    "decoder": """
    bigbird_pegasus.BigBirdPegasusDecoderLayer blenderbot.BlenderbotDecoderLayer m2m_100.M2M100DecoderLayer
    mbart.MBartDecoderLayer musicgen.MusicgenDecoderLayer pegasus.PegasusDecoderLayer
    pegasus_x.PegasusXDecoderLayer pp_formulanet.PPFormulaNetDecoderLayer speech_to_text.Speech2TextDecoderLayer
    xglm.XGLMDecoderLayer
    """,
}
_WHISPER_ATTENTION = Step("self_attn", "self_attn_layer_norm", dropout="dropout")
_WHISPER_MLP = Step("fc1 activation_fn activation_dropout fc2", "final_layer_norm", dropout="dropout")
_WHISPER = {
    # the encoder clamps a float16 stream after each layer
    "encoder": Family((_WHISPER_ATTENTION, _WHISPER_MLP), final="layer_norm", clamp16=True),
    "decoder": Family(
        (
            _WHISPER_ATTENTION,
            Step(
                "encoder_attn",
                "encoder_attn_layer_norm",
                dropout="dropout",
                first=True,
                call=(
                    ("encoder_hidden_states", "key_value_states"),
                    ("encoder_attention_mask", "attention_mask"),
                    ("cache", "cache"),
                ),
                needs="encoder_hidden_states",
            ),
            _WHISPER_MLP,
        ),
        final="layer_norm",
        drop=("encoder_hidden_states", "encoder_attention_mask", "use_cache"),
    ),
}

# block class path -> Family: the short per-family table (docs/integrations.md, section 3)
FAMILIES: dict[str, Family] = {
    **dict(_llama(m, c, _PRE) for m, c in [("llama", "Llama"), ("mistral", "Mistral"), ("mixtral", "Mixtral")]),
    **dict(_llama(m, c, _PRE) for m, c in [("qwen2", "Qwen2"), ("qwen3", "Qwen3"), ("gemma", "Gemma")]),
    **dict(
        _llama(m, c, steps)
        for m, c, steps in [
            ("qwen2_moe", "Qwen2Moe", _PRE),
            ("qwen3_moe", "Qwen3Moe", _PRE),
            ("granite", "Granite", _GRANITE),
            (
                "granitemoe",
                "GraniteMoe",
                (_GRANITE[0], Step("block_sparse_moe", "post_attention_layernorm", multiplier="residual_multiplier")),
            ),
        ]
    ),
    **dict(_llama(m, c, _SANDWICH) for m, c in [("gemma2", "Gemma2"), ("gemma3", "Gemma3")]),
    **dict(_llama(m, c, _PRE) for m, c in pairs(COPIES["llama"])),
    **dict(_llama(m, c, _POST) for m, c in [("olmo2", "Olmo2"), *pairs(COPIES["olmo2"])]),
    hf_path("gpt_oss", "GptOssDecoderLayer"): Family(
        (_PRE[0], Step("mlp", "post_attention_layernorm", first=True)), final="norm"
    ),
    **{
        hf_path(m, f"{c}DecoderLayer"): Family(
            (Step("self_attn", "input_layernorm"), Step("mlp", "input_layernorm")), final="norm", parallel="chain"
        )
        for m, c in [("cohere", "Cohere"), ("cohere2", "Cohere2")]
    },
    hf_path("glm4", "Glm4DecoderLayer"): Family(
        (
            Step("self_attn", "input_layernorm", post="post_self_attn_layernorm"),
            Step("mlp", "post_attention_layernorm", post="post_mlp_layernorm"),
        ),
        final="norm",
    ),
    "transformers.models.llama4.modeling_llama4.Llama4TextDecoderLayer": lambda block: Family(
        (
            Step("self_attn", "input_layernorm"),
            Step("feed_forward", "post_attention_layernorm", first=block.is_moe_layer, flat=True),
        ),
        final="norm",
        drop=("position_ids",),
    ),
    "transformers.models.phi.modeling_phi.PhiDecoderLayer": Family(
        (
            Step("self_attn", "input_layernorm", dropout="resid_dropout"),
            Step("mlp", "input_layernorm", dropout="resid_dropout"),
        ),
        final="final_layernorm",
        parallel="x1",
    ),
    "transformers.models.stablelm.modeling_stablelm.StableLmDecoderLayer": lambda block: Family(
        (
            Step("self_attn", "input_layernorm"),
            Step(
                "mlp",
                "input_layernorm" if block.use_parallel_residual else "post_attention_layernorm",
                dropout="dropout",
            ),
        ),
        final="norm",
        kwargs=False,
        parallel="chain" if block.use_parallel_residual else None,
    ),
    **{
        hf_path(m, f"{c}Block"): Family((Step("mixer", "norm"),), final="norm_f", kwargs=m == "mamba2", cast=True)
        for m, c in [("mamba", "Mamba"), ("mamba2", "Mamba2"), ("falcon_mamba", "FalconMamba")]
    },
    "transformers.models.clip.modeling_clip.CLIPEncoderLayer": Family(_CLIP, final="final_layer_norm"),
    **{hf_path(m, f"{c}Layer"): Family(_VIT, final="layernorm") for m, c in [("vit", "ViT"), *pairs(VIT_COPIES)]},
    **{
        hf_path(m, c): _WHISPER[side]
        for side, entries in WHISPER_COPIES.items()
        for m, c in [("whisper", f"Whisper{side.capitalize()}Layer"), *pairs(entries)]
    },
    **{
        hf_path(m, f"{c}EncoderLayer"): Family(_CLIP, final=("final_layer_norm", "post_layernorm"))
        for m, c in pairs(CLIP_COPIES)
    },
    "transformers.models.gptj.modeling_gptj.GPTJBlock": Family(
        (Step("attn", "ln_1"), Step("mlp", "ln_1")), final="ln_f", parallel="sum"
    ),
    # OPT-350m normalizes after each add (do_layer_norm_before=False): not fused
    "transformers.models.opt.modeling_opt.OPTDecoderLayer": lambda block: (
        Family(
            (
                Step("self_attn", "self_attn_layer_norm", dropout="dropout"),
                Step("fc1 activation_fn fc2", "final_layer_norm", dropout="dropout"),
            ),
            final="final_layer_norm",
            drop=("use_cache",),
        )
        if block.do_layer_norm_before
        else None
    ),
    "transformers.models.phi3.modeling_phi3.Phi3DecoderLayer": Family(
        (
            Step("self_attn", "input_layernorm", dropout="resid_attn_dropout"),
            Step("mlp", "post_attention_layernorm", dropout="resid_mlp_dropout"),
        ),
        final="norm",
    ),
    **{
        hf_path(m, f"{c}Block"): Family(
            (Step("attn", "ln_1"), Step("mlp", "ln_2")),
            final="ln_f",
            drop=("encoder_attention_mask",),
            fallback=("encoder_hidden_states",),  # cross-attention sits between the adds
        )
        for m, c in [("gpt2", "GPT2"), ("gpt_bigcode", "GPTBigCode")]
    },
    "transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXLayer": lambda block: Family(
        (
            Step("attention", "input_layernorm", dropout="post_attention_dropout"),
            Step("mlp", "post_attention_layernorm", dropout="post_mlp_dropout"),
        ),
        final="final_layer_norm",
        parallel="x1" if block.use_parallel_residual else None,
    ),
    "transformers.models.falcon.modeling_falcon.FalconDecoderLayer": lambda block: _falcon(block.config),
    "transformers.models.dinov2.modeling_dinov2.Dinov2Layer": Family(
        (
            Step("attention", "norm1", layer_scale="layer_scale1", drop_path="drop_path"),
            Step("mlp", "norm2", layer_scale="layer_scale2", drop_path="drop_path"),
        ),
        final="layernorm",
    ),
    **{
        hf_path(m, f"{c}{layer}"): family
        for m, c in [("t5", "T5"), ("mt5", "MT5")]
        for layer, family in _T5_LAYERS.items()
    },
    "transformers.models.bert.modeling_bert.BertSelfOutput": _BERT,
    "transformers.models.bert.modeling_bert.BertOutput": _BERT,
    "transformers.models.roberta.modeling_roberta.RobertaSelfOutput": _BERT,
    "transformers.models.roberta.modeling_roberta.RobertaOutput": _BERT,
}


def _falcon(config) -> Family:
    """Falcon's three layouts: sequential (Falcon-RW), parallel with one norm (Falcon-7B) or two
    (the new decoder architecture); its attention takes no ``**kwargs``."""
    common = dict(final="ln_f", extras=True, kwargs=False)
    if not (config.parallel_attn or config.new_decoder_architecture):
        return Family(
            (
                Step("self_attention", "input_layernorm", dropout="config.attention_dropout"),
                Step("mlp", "post_attention_layernorm", dropout="config.hidden_dropout"),
            ),
            **common,
        )
    two = config.new_decoder_architecture and config.num_ln_in_parallel_attn == 2
    attn, mlp = ("ln_attn", "ln_mlp") if two else ("input_layernorm", "input_layernorm")
    steps = (Step("self_attention", attn), Step("mlp", mlp, dropout="config.hidden_dropout"))
    return Family(steps, parallel="sum", **common)


def family_of(block: nn.Module) -> Family | None:
    """The Family of a block of a class in ``FAMILIES`` (resolved from its config where it varies),
    without the optional steps whose sublayer the block was built without (XGLM without
    cross-attention)."""
    entry = FAMILIES.get(f"{type(block).__module__}.{type(block).__qualname__}")
    family = entry(block) if callable(entry) else entry
    if family is None or all(hasattr(block, st.sublayer) for st in family.steps if st.needs):
        return family
    return dataclasses.replace(
        family, steps=tuple(st for st in family.steps if not st.needs or hasattr(block, st.sublayer))
    )


def final_names(family: Family) -> tuple[str, ...]:
    """The names the final norm of a block's stack may have, in the order they are looked for."""
    return (family.final,) if isinstance(family.final, str) else family.final or ()


def entry_norms(family: Family) -> tuple[str | None, ...]:
    """The norms the stream entering a block goes through first (both of a parallel block's)."""
    if family.post_norm:
        return ()
    steps = family.steps[:2] if family.parallel else family.steps[:1]
    return tuple(dict.fromkeys(step.norm for step in steps))


# --------------------------------------------------------------------------- the fused forward


def _arguments(self, hidden_states, args, kwargs) -> tuple[dict, dict]:
    """The arguments of the original block forward after ``hidden_states``, by name, with its
    defaults filled in and its ``**kwargs`` spread (passed on as the original does, whichever
    name its cache argument has); and those ``**kwargs`` alone."""
    bound = type(self)._addnorm_signature.bind(self, hidden_states, *args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    del named["self"], named["hidden_states"]
    spread = named.pop("kwargs", {}) if self.__dict__[FAMILY].kwargs else {}
    return named | spread, spread


def _dropout_p(block: nn.Module, step: Step) -> float:
    """The dropout probability of ``step`` now: an ``nn.Dropout``'s own when that module is in
    training mode (as its own call; 0 in eval mode, whatever the block's mode), a float
    attribute's when the block is (as ``F.dropout(..., training=self.training)``)."""
    if step.dropout is None:
        return 0.0
    owner, *path = step.dropout.split(".")
    value = getattr(block, owner)
    for name in path:
        value = getattr(value, name)
    if isinstance(value, nn.Dropout):
        return float(value.p) if value.training else 0.0
    return float(value) if block.training else 0.0


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
        out = out * getattr(block, step.multiplier)
    if step.drop_path:
        out = getattr(block, step.drop_path)(out)
    return out


def _sublayer(block: nn.Module, step: Step, x: Tensor) -> Sublayer:
    scale = getattr(block, step.layer_scale).lambda1 if step.layer_scale else None
    if step.multiplier:  # a constant layer scale, in float32 (float64 for float64) as torch multiplies
        # a tensor by a Python float
        dtype = torch.promote_types(x.dtype, torch.float32)
        scale = torch.full(x.shape[-1:], float(getattr(block, step.multiplier)), dtype=dtype, device=x.device)
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
    (:func:`.norms.fusable`), its weight is a plain tensor on ``x``'s device (not sharded away by
    FSDP, not offloaded), and calling it runs its class's forward alone (no forward set on the
    module itself, as accelerate's hooks set one to load the weights first)."""
    w = getattr(norm, "weight", None)
    if w is not None and (type(w.data) is not Tensor or w.device != x.device):
        return False
    return "forward" not in norm.__dict__ and fusable(norm, x)


def _inline(norm: nn.Module | None, x: Tensor) -> bool:
    """Whether a norm called inside the block can be computed by the block's fused op instead:
    its output can come from it, and nothing hooks the norm's call (a hook on it, or a global
    module hook), which the fused op would skip."""
    if norm is None or not _computable(norm, x):
        return False
    hooks = nn.modules.module
    return not (
        norm._forward_hooks
        or norm._forward_pre_hooks
        or norm._backward_hooks
        or norm._backward_pre_hooks
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


def _run(block: nn.Module, step: Step, h: Tensor, call: dict) -> Tensor:
    """The step's sublayer (its modules in turn, a float among them a dropout) on ``h``; ``call``:
    the keyword arguments of a sublayer that takes the block's (:attr:`Step.call`)."""
    for name in step.sublayer.split():
        module = getattr(block, name)
        if isinstance(module, float):  # as F.dropout(h, p=self.<name>, training=self.training)
            h = F.dropout(h, module, training=block.training) if module else h
        else:
            h = module(h, **call)
    return h


def _call_first(block: nn.Module, family: Family, step: Step, h: Tensor, named: dict) -> tuple[Tensor, tuple]:
    for old, new in family.rename:
        named[new] = named.pop(old)
    result = getattr(block, step.sublayer)(h, **named)
    return (result[0], tuple(result[1:])) if isinstance(result, tuple) else (result, ())


def block_forward(self, hidden_states, *args, **kwargs):
    """The forward of every block of ``FAMILIES``: the original's steps with each add fused."""
    family = self.__dict__[FAMILY]
    if family.post_norm:
        return _post_norm_forward(self, family, hidden_states, *args, **kwargs)
    named, spread = _arguments(self, hidden_states, args, kwargs)
    if any(named.get(name) is not None for name in family.fallback) or (
        family.clamp16 and hidden_states.dtype == torch.float16
    ):
        return self.__dict__[ORIGINAL].forward(self, hidden_states, *args, **kwargs)
    steps = tuple(st for st in family.steps if st.needs is None or named.get(st.needs) is not None)
    calls = [{new: named.get(old) for old, new in st.call} | spread if st.call else {} for st in steps]
    for name in family.fallback + family.drop:
        named.pop(name, None)
    nxt = tuple(self.__dict__.get(NEXT, ()))
    if not _may_hand_off(self, nxt, hidden_states):
        nxt = ()
    if family.parallel:
        s, extras = _parallel_forward(self, family, hidden_states, named, nxt)
    else:
        s, extras = _sequential_forward(self, family, steps, hidden_states, named, calls, nxt)
    return (s, *extras) if family.extras else s


def _norm(block: nn.Module, name: str | None) -> nn.Module | None:
    return None if name is None else getattr(block, name)


def _reads_the_stream(family: Family, norm: nn.Module, s: Tensor, out: Tensor) -> bool:
    """Whether ``norm`` is called on the new stream ``s + out`` itself: in a family that casts the
    stream to the norm's weight dtype first, only where that cast changes nothing (else the norm
    reads a copy, and a handed-off output would go unused)."""
    return not family.cast or torch.result_type(s, out) == norm.weight.dtype


def _sequential_forward(self, family, steps, s: Tensor, named: dict, calls: list, nxt: tuple) -> tuple[Tensor, tuple]:
    """The steps that run this call (each with its keyword arguments in ``calls``), one by one."""
    first = _norm(self, steps[0].norm)
    if family.cast:
        h = first(s.to(first.weight.dtype))
        s = s.to(torch.float32) if self.residual_in_fp32 else s
    else:
        h = s if first is None else first(s)
    extras = ()
    for i, step in enumerate(steps):
        if i == 0:
            out, extras = _call_first(self, family, step, h, named)
        else:
            out = _run(self, step, h, calls[i])
            out = out[0] if step.first else out
            out = out.view(s.shape) if step.flat else out
        if step.post is not None:
            out = getattr(self, step.post)(out)
        if i + 1 < len(steps):
            h, s = _add(self, step, out, s, _norm(self, steps[i + 1].norm))
        elif nxt and fusable(nxt[0], out) and _reads_the_stream(family, nxt[0], s, out):
            # (the next norm is called by the model: its hooks run there)
            y, s = add_norm_forward(nxt[0], out, s, sublayer=_sublayer(self, step, out))
            hand_off(nxt[0], s, y)
        else:
            s = s + _branch(self, step, out)
    return s, extras


def _parallel_forward(self, family: Family, s: Tensor, named: dict, nxt: tuple) -> tuple[Tensor, tuple]:
    """Attention and MLP on the same stream: ``s + dropout(mlp) + dropout(attn)`` (GPT-NeoX, "x1";
    Cohere, "chain") or ``s + dropout(mlp + attn)`` (Falcon, "sum"). The fused op adds ``attn`` (its
    ``x1``) to ``s`` first, as Cohere does; without dropout "x1" adds the outputs' sum, as GPT-NeoX."""
    attn, mlp = family.steps[:2]
    h_attn = getattr(self, attn.norm)(s)
    h_mlp = h_attn if mlp.norm == attn.norm else getattr(self, mlp.norm)(s)
    out_attn, extras = _call_first(self, family, attn, h_attn, named)
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


def _post_norm_forward(self, family: Family, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
    """BERT's output: ``norm(dropout(dense(h)) + input_tensor)``, dropout, add and norm in one op."""
    (step,) = family.steps
    out = _run(self, step, hidden_states, {})
    norm = getattr(self, step.norm)
    if not _inline(norm, out):
        return norm(_branch(self, step, out) + input_tensor)
    return add_norm_forward(norm, out, input_tensor, sublayer=_sublayer(self, step, out), prenorm=False)
