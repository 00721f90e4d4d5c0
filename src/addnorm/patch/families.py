"""Which blocks ``patch(fuse_residual=True)`` fuses, and how each runs: a block is a sequence of
:class:`Step` (sublayer, the norm before it, dropout, ...), its :class:`Family` the steps and where
its stack's stream goes next. ``FAMILIES`` maps each Hugging Face block class to its Family (the
short per-family table of docs/integrations.md, section 3); :mod:`.blocks` runs them all.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from .copies import ALONE, COPIES, FINALS
from .hf_norms import hf_path, pairs
from .layout import Family, Step


def _llama(m: str, c: str, steps: tuple[Step, ...]) -> tuple[str, Family]:
    return hf_path(m, f"{c}DecoderLayer"), Family(steps, final="norm")


_PRE = (Step("self_attn", "input_layernorm"), Step("mlp", "post_attention_layernorm"))


def _each(steps: tuple[Step, ...], **changes) -> tuple[Step, ...]:
    """``steps`` with ``changes`` made to each."""
    return tuple(dataclasses.replace(step, **changes) for step in steps)


_GRANITE = _each(_PRE, multiplier="residual_multiplier")  # s + out * m
# OLMo 2's layout under Llama's norm names: each norm on its sublayer's output, before the add
_NORM_AFTER_OUTPUT = (Step("self_attn", post="input_layernorm"), Step("mlp", post="post_attention_layernorm"))
_SANDWICH = (
    Step("self_attn", "input_layernorm", post="post_attention_layernorm"),
    Step("mlp", "pre_feedforward_layernorm", post="post_feedforward_layernorm"),
)
_T5GEMMA_ATTENTION = Step("self_attn", "pre_self_attn_layernorm", post="post_self_attn_layernorm", dropout="dropout")
_T5GEMMA_MLP = Step("mlp", "pre_feedforward_layernorm", post="post_feedforward_layernorm", dropout="dropout")
_T5_ATTENTION = dict(final="final_layer_norm", rename=(("attention_mask", "mask"),), extras=True)
_T5_LAYERS = {  # T5's and mT5's layer classes, by the name after the model's prefix
    "LayerSelfAttention": Family((Step("SelfAttention", "layer_norm", dropout="dropout"),), **_T5_ATTENTION),
    "LayerCrossAttention": Family((Step("EncDecAttention", "layer_norm", dropout="dropout"),), **_T5_ATTENTION),
    "LayerFF": Family((Step("DenseReluDense", "layer_norm", dropout="dropout"),), final="final_layer_norm"),
}

_DINO = (  # layer scale and drop path on each step (DINOv2, DINOv3)
    Step("attention", "norm1", layer_scale="layer_scale1", drop_path="drop_path"),
    Step("mlp", "norm2", layer_scale="layer_scale2", drop_path="drop_path"),
)
_CLIP = (Step("self_attn", "layer_norm1"), Step("mlp", "layer_norm2"))
# ViT's layer as first written: the MLP's second half (``output``) adds the stream itself; its dense
# layer and dropout run here instead (VideoMAE, YOLOS, DPT, ViLT, FLAVA)
_VIT_OUTPUT = (
    Step("attention", "layernorm_before"),
    Step("intermediate output.dense", "layernorm_after", dropout="output.dropout"),
)
# ViT's steps, each output scaled by a learned scale per channel (InternVL's vision encoder)
_LAMBDA = (
    Step("attention", "layernorm_before", multiplier="lambda_1"),
    Step("mlp", "layernorm_after", dropout="dropout", multiplier="lambda_2"),
)
_VIT = (Step("attention", "layernorm_before", dropout="dropout"), Step("mlp", "layernorm_after", dropout="dropout"))
_POST = (Step("self_attn", post="post_attention_layernorm"), Step("mlp", post="post_feedforward_layernorm"))
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
# post-norm layers with Whisper's steps, each norm after its add (BART)
_BART = {side: dataclasses.replace(family, norm_after=True, final=None) for side, family in _WHISPER.items()}


def _hybrid(block: nn.Module) -> Family:
    """Qwen3-Next's layers: linear attention (which takes no positions) or full attention, then the MLP."""
    linear = block.block_type == "linear_attention"
    mixer = Step("linear_attn" if linear else "self_attn", "input_layernorm")
    return Family((mixer, _PRE[1]), final="norm", drop=("position_embeddings", "position_ids") if linear else ())


def _lfm(block: nn.Module) -> Family:
    """LFM2's and LFM3's layers: attention or a short convolution (which takes no positions), then
    the MLP; LFM3's with a norm after each (``post_operator_norm``, ``post_ffn_norm``)."""
    attention = block.is_attention_layer
    post = ("post_operator_norm", "post_ffn_norm") if hasattr(block, "post_ffn_norm") else (None, None)
    steps = (
        Step("self_attn" if attention else "conv", "operator_norm", post=post[0]),
        Step("feed_forward", "ffn_norm", post=post[1]),
    )
    return Family(steps, final="embedding_norm", drop=() if attention else ("position_embeddings", "position_ids"))


def _granite_shared(block: nn.Module) -> Family:
    """Granite's layers with a shared MLP beside the experts (their outputs summed), Granite 4's
    with Mamba or attention by layer (Mamba takes no positions); both with a residual multiplier."""
    mamba = getattr(block, "mamba", None) is not None
    experts = getattr(block, "has_experts", True) and block.block_sparse_moe is not None
    mlp = "block_sparse_moe" if block.shared_mlp is None else "block_sparse_moe+shared_mlp" if experts else "shared_mlp"
    steps = (Step("mamba" if mamba else "self_attn", "input_layernorm"), Step(mlp, "post_attention_layernorm"))
    return Family(
        _each(steps, multiplier="residual_multiplier"),
        final="norm",
        drop=("use_cache", "position_embeddings") if mamba else (),
    )


def _bamba(block: nn.Module) -> Family:
    """Bamba's layers: Mamba-2 (called with the cache and mask alone) or attention by layer, each
    returning the stream and the attention's weights (None from a Mamba layer)."""
    mamba = block.block_type == "linear_attention"
    steps = (Step("mamba" if mamba else "self_attn", "input_layernorm"), Step("feed_forward", "pre_ff_layernorm"))
    drop = ("position_ids", "use_cache", "position_embeddings") if mamba else ()
    return Family(steps, final="final_layernorm", drop=drop, extras=True, padded=1)


def _kimi(block: nn.Module) -> Family:
    """Kimi Linear's layers: linear attention (which takes no positions) or full attention."""
    linear = block.block_type == "linear_attention"
    return Family(_PRE, final="norm", drop=("position_ids", "use_cache") if linear else ())


def _molmo2(block: nn.Module) -> Family:
    """Molmo2's text layers: Llama's, or with ``norm_after`` OLMo 2's (each norm on its sublayer's
    output, before the add)."""
    return Family(_NORM_AFTER_OUTPUT if block.norm_after else _PRE, final="norm")


def _gemma4_experts(block: nn.Module, h, s, call: dict):
    """Gemma 4's MoE step (:attr:`Step.run`), as its layer computes it: the MLP on the pre-norm's
    output ``h`` beside the experts, routed from the stream ``s`` and run on their own pre-norm
    of it; each output normed, then summed."""
    flat = s.reshape(-1, s.shape[-1])
    _, weights, index = block.router(flat)
    experts = block.experts(block.pre_feedforward_layernorm_2(flat), index, weights).reshape(s.shape)
    return block.post_feedforward_layernorm_1(block.mlp(h)) + block.post_feedforward_layernorm_2(experts)


def _gemma4(block: nn.Module) -> Family:
    """Gemma 4's text layers: Gemma 3's sandwich norms, the MLP beside routed experts in the MoE
    layout; then, with per-layer inputs (E2B, E4B), a gated projection of the per-layer input,
    which reads the stream itself; then the stream times a learned scalar."""
    steps = _SANDWICH
    if block.enable_moe_block:
        steps = (steps[0], dataclasses.replace(steps[1], sublayer="mlp+experts", run=_gemma4_experts))
    if block.hidden_size_per_layer_input:
        gated = Step(
            "per_layer_input_gate act_fn *per_layer_input per_layer_projection",
            post="post_per_layer_input_norm",
            call=(("per_layer_input", "per_layer_input"),),
            kwargs=False,
        )
        steps += (gated,)
    return Family(steps, final="norm", drop=("per_layer_input",), scale="layer_scalar")


_MAMBA_SKIPS = ("attention_mask", "mamba_attention_mask", "position_ids", "use_cache", "position_embeddings")


def _falcon_h1(block: nn.Module, h, s, named: dict):
    """Falcon-H1's first sublayer (:attr:`Step.run`), as its layer computes it: Mamba-2 (with its
    own mask) and attention (on ``h`` times ``attention_in_multiplier``) side by side, their
    outputs scaled by ``ssm_out_multiplier`` and ``attn_out_multiplier`` and summed."""
    mamba_args = {k: v for k, v in named.items() if k not in _MAMBA_SKIPS}
    mamba = block.mamba(hidden_states=h, attention_mask=named["mamba_attention_mask"], **mamba_args)
    attention_args = {k: v for k, v in named.items() if k != "mamba_attention_mask"}
    attention, _ = block.self_attn(hidden_states=h * block.attention_in_multiplier, **attention_args)
    return mamba * block.ssm_out_multiplier + attention * block.attn_out_multiplier


def _beit_attention(block: nn.Module, h, s, named: dict):
    """BEiT's attention (:attr:`Step.run`), its mask plus the layer's relative position bias when
    it has one, as its layer computes it."""
    mask = named.pop("attention_mask")
    resolution, interpolate = named.pop("resolution"), named.pop("interpolate_pos_encoding")
    if block.relative_position_bias is not None:
        window = (resolution[0] // block.patch_size, resolution[1] // block.patch_size)
        bias = block.relative_position_bias(window, interpolate, dim_size=s.shape[1])
        mask = bias + mask if mask is not None else bias
    return block.attention(h, attention_mask=mask, **named)[0]


def _nemotron_h(block: nn.Module, h, s, named: dict):
    """Nemotron-H's mixer (:attr:`Step.run`), called as its block calls the kind it holds: Mamba-2
    (without positions), attention (its weights dropped), or an MLP or MoE (``h`` alone)."""
    if block.block_type == "linear_attention":
        return block.mixer(h, **{k: v for k, v in named.items() if k not in ("position_ids", "use_cache")})
    if block.block_type == "full_attention":
        return block.mixer(hidden_states=h, **named)[0]
    return block.mixer(h)


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
    **{
        hf_path(m, c): Family(_POST, final="norm")
        for m, c in [("olmo2", "Olmo2DecoderLayer"), ("flex_olmo", "FlexOlmoDecoderLayer")]
    },
    hf_path("gpt_oss", "GptOssDecoderLayer"): Family(
        (_PRE[0], Step("mlp", "post_attention_layernorm", first=True)), final="norm"
    ),
    **{
        hf_path(m, f"{c}DecoderLayer"): Family(
            (Step("self_attn", "input_layernorm"), Step("mlp", "input_layernorm")), final="norm", parallel="chain"
        )
        for m, c in [("cohere", "Cohere"), ("cohere2", "Cohere2")]
    },
    **{
        hf_path(m, c): Family(
            (
                Step("self_attn", "input_layernorm", post="post_self_attn_layernorm"),
                Step("mlp", "post_attention_layernorm", post="post_mlp_layernorm"),
            ),
            final="norm",
        )
        for m, c in [("glm4", "Glm4DecoderLayer"), ("glm4v", "Glm4vTextDecoderLayer")]
    },
    "transformers.models.llama4.modeling_llama4.Llama4TextDecoderLayer": lambda block: Family(
        (
            Step("self_attn", "input_layernorm"),
            Step("feed_forward", "post_attention_layernorm", first=block.is_moe_layer, flat=True),
        ),
        final="norm",
        drop=("position_ids",),
    ),
    **{
        hf_path(m, f"{c}DecoderLayer"): _hybrid
        for m, c in [("qwen3_next", "Qwen3Next"), ("qwen3_5_moe", "Qwen3_5Moe"), ("qwen3_5", "Qwen3_5")]
    },
    hf_path("kimi_linear", "KimiLinearDecoderLayer"): _kimi,
    hf_path("bamba", "BambaDecoderLayer"): _bamba,
    # MiniMax's layers: each norm's output is the residual, scaled by alpha, the sublayer's by beta
    hf_path("minimax", "MiniMaxDecoderLayer"): Family(
        (
            Step("self_attn", "input_layernorm", multiplier="attn_beta_factor", residual_scale="attn_alpha_factor"),
            Step("mlp", "post_attention_layernorm", multiplier="mlp_beta_factor", residual_scale="mlp_alpha_factor"),
        ),
        final="norm",
        normed_residual=True,
    ),
    hf_path("falcon_h1", "FalconH1DecoderLayer"): Family(
        (Step("mamba+self_attn", "input_layernorm", run=_falcon_h1), Step("feed_forward", "pre_ff_layernorm")),
        final="final_layernorm",
        extras=True,
    ),
    # Chameleon's layers: Llama's, or with ``swin_norm`` OLMo 2's (each norm on its sublayer's output);
    # Llama 4's vision encoder: Llama's steps, its stream named ``hidden_state``
    **{
        hf_path(m, c): Family(steps, final=final, extras=True, extras_if="output_attentions", drop=drop)
        for m, c, steps, final, drop in [
            ("chameleon", "ChameleonDecoderLayer", _PRE, "norm", ()),
            ("chameleon", "ChameleonSwinDecoderLayer", _NORM_AFTER_OUTPUT, "norm", ()),
            ("llama4", "Llama4VisionEncoderLayer", _PRE, "layernorm_post", ("output_attentions",)),
        ]
    },
    hf_path("gemma4", "Gemma4TextDecoderLayer"): _gemma4,
    hf_path("gemma4_unified", "Gemma4UnifiedTextDecoderLayer"): Family(_SANDWICH, final="norm", scale="layer_scalar"),
    hf_path("gemma4", "Gemma4VisionEncoderLayer"): Family(_SANDWICH),  # (pooled after its stack: no final norm)
    # Qwen3-ASR's audio encoder: Whisper's encoder steps, no dropout, the rows of all clips packed;
    # it returns (stream,)
    hf_path("qwen3_asr", "Qwen3ASRAudioEncoderLayer"): Family(
        (Step("self_attn", "self_attn_layer_norm"), Step("fc1 activation_fn fc2", "final_layer_norm")),
        final="ln_post",
        clamp16=True,
        extras=True,
    ),
    hf_path("molmo2", "Molmo2DecoderLayer"): _molmo2,
    # Whisper's encoder layer, its attention given no use_cache (BioGPT)
    hf_path("biogpt", "BioGptDecoderLayer"): Family(
        (_WHISPER_ATTENTION, _WHISPER_MLP), final="layer_norm", drop=("use_cache",)
    ),
    # post-norm, each norm after its add (BART's layout): wav2vec 2.0's encoder layer
    hf_path("wav2vec2", "Wav2Vec2EncoderLayer"): Family(
        (Step("attention", "layer_norm", dropout="dropout"), Step("feed_forward", "final_layer_norm")), norm_after=True
    ),
    **{
        hf_path(m, f"{c}{side}Layer"): Family((_T5GEMMA_ATTENTION, _T5GEMMA_MLP), final="norm")
        for m, c, side in [
            ("t5gemma", "T5Gemma", "Encoder"),
            ("t5gemma2", "T5Gemma2", "Encoder"),
            ("t5gemma2", "T5Gemma2", "Decoder"),  # (one attention over itself and the encoder: merged)
        ]
    },
    # self-attention on the self-attention part of the cache, then cross-attention on the whole of it
    hf_path("t5gemma", "T5GemmaDecoderLayer"): Family(
        (
            _T5GEMMA_ATTENTION,
            Step(
                "cross_attn",
                "pre_cross_attn_layernorm",
                post="post_cross_attn_layernorm",
                dropout="dropout",
                first=True,
                call=(("encoder_hidden_states", "encoder_hidden_states"), ("encoder_attention_mask", "attention_mask"))
                + (("cache", "cache"), ("use_cache", "use_cache")),
            ),
            _T5GEMMA_MLP,
        ),
        final="norm",
        drop=("encoder_hidden_states", "encoder_attention_mask"),
        self_cache="self_attention_cache",
    ),
    hf_path("modernbert_decoder", "ModernBertDecoderLayer"): Family(
        (Step("attn", "attn_norm"), Step("mlp", "mlp_norm")), final="final_norm"
    ),
    hf_path("mllama", "MllamaSelfAttentionDecoderLayer"): Family(
        _PRE, final="norm", drop=("cross_attention_states", "cross_attention_mask", "full_text_row_masked_out_mask")
    ),
    # Jamba's Mamba layers call their mixer with the cache and mask alone
    hf_path("jamba", "JambaMambaDecoderLayer"): Family(
        (Step("mamba", "input_layernorm"), Step("feed_forward", "pre_ff_layernorm")),
        final="final_layernorm",
        drop=("position_ids",),
        kwargs=False,
    ),
    hf_path("jamba", "JambaAttentionDecoderLayer"): Family(
        (Step("self_attn", "input_layernorm"), Step("feed_forward", "pre_ff_layernorm")), final="final_layernorm"
    ),
    hf_path("afmoe", "AfmoeDecoderLayer"): Family(
        (
            Step("self_attn", "input_layernorm", post="post_attention_layernorm"),
            Step("mlp", "pre_mlp_layernorm", post="post_mlp_layernorm"),
        ),
        final="norm",
    ),
    **{hf_path(m, f"{c}DecoderLayer"): _lfm for m, c in [("lfm2", "Lfm2"), ("lfm2_moe", "Lfm2Moe"), ("lfm3", "Lfm3")]},
    **{
        hf_path(m, f"{c}DecoderLayer"): _granite_shared
        for m, c in [("granitemoeshared", "GraniteMoeShared"), ("granitemoehybrid", "GraniteMoeHybrid")]
    },
    # Llama's layer with its norms named otherwise, or with a residual scale, dropout or sandwich
    # norms (each a forward of its own, not a copy of Llama's statements)
    **{
        hf_path(m, c): Family((Step(attn, n1), Step("mlp", n2)), final="norm")
        for m, c, attn, n1, n2 in [
            ("apertus", "ApertusDecoderLayer", "self_attn", "attention_layernorm", "feedforward_layernorm"),
            ("apertus1p5", "Apertus1p5TextDecoderLayer", "self_attn", "attention_layernorm", "feedforward_layernorm"),
            ("vaultgemma", "VaultGemmaDecoderLayer", "self_attn", "input_layernorm", "pre_feedforward_layernorm"),
            ("jetmoe", "JetMoeDecoderLayer", "self_attention", "input_layernorm", "post_attention_layernorm"),
        ]
    },
    hf_path("minicpm3", "MiniCPM3DecoderLayer"): Family(_each(_PRE, multiplier="residual_scale"), final="norm"),
    hf_path("emu3", "Emu3DecoderLayer"): Family(_each(_PRE, dropout="dropout"), final="norm"),
    hf_path("persimmon", "PersimmonDecoderLayer"): Family(
        (_PRE[0], Step("mlp", "post_attention_layernorm", dropout="dropout")), final="final_layernorm"
    ),
    hf_path("hyperclovax", "HyperCLOVAXDecoderLayer"): Family(
        (
            Step("self_attn", "input_layernorm", post="post_norm1", multiplier="residual_multiplier"),
            Step("mlp", "post_attention_layernorm", post="post_norm2", multiplier="residual_multiplier"),
        ),
        final="norm",
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
    # Moshi and Kyutai's speech-to-text: Llama's layer; the depth decoder's MLP takes the codebook
    # index (its weights one set per codebook)
    **{
        hf_path(m, f"{c}DecoderLayer"): lambda block: Family(
            (
                _PRE[0],
                Step("mlp", "post_attention_layernorm", call=(("codebook_idx", "layer_idx"),), kwargs=False)
                if block.use_flexible_linear
                else _PRE[1],
            ),
            final="norm",
        )
        for m, c in [("moshi", "Moshi"), ("kyutai_speech_to_text", "KyutaiSpeechToText")]
    },
    # OLMo-Hybrid's linear attention layers (pre-norm; its attention layers: OLMo 2's)
    hf_path("olmo_hybrid", "OlmoHybridLinearAttentionDecoderLayer"): Family(
        (Step("linear_attn", "input_layernorm"), _PRE[1]),
        final="norm",
        drop=("position_ids", "use_cache", "position_embeddings", "output_attentions"),
    ),
    # Doge: the stream scaled per channel by a learned residual weight before each add, dropout on
    # each output; its MoE returns (output, router logits)
    hf_path("doge", "DogeDecoderLayer"): lambda block: Family(
        (
            Step("self_attn", "input_layernorm", dropout="hidden_dropout", residual_scale="input_residual"),
            Step(
                "mlp",
                "post_attention_layernorm",
                dropout="hidden_dropout",
                residual_scale="post_attention_residual",
                first=block.config.is_moe,
            ),
        ),
        final="norm",
    ),
    # RecurrentGemma (Griffin): a recurrent or attention block, then the MLP, in Llama's steps
    hf_path("recurrent_gemma", "RecurrentGemmaDecoderLayer"): Family(
        (Step("temporal_block", "temporal_pre_norm"), Step("mlp_block", "channel_pre_norm")), final="final_norm"
    ),
    # Nemotron-H: one mixer per block (Mamba-2, attention, MLP or MoE), its norm reading the stream
    # cast to the norm's dtype as Mamba's
    hf_path("nemotron_h", "NemotronHBlock"): Family(
        (Step("mixer", "norm", run=_nemotron_h),), final="norm_f", cast=True
    ),
    "transformers.models.clip.modeling_clip.CLIPEncoderLayer": Family(_CLIP, final="final_layer_norm"),
    "transformers.models.vit.modeling_vit.ViTLayer": Family(_VIT, final="layernorm"),
    **{
        hf_path(m, f"{c}{side.capitalize()}Layer"): layouts[side]
        for m, c, layouts in [("whisper", "Whisper", _WHISPER), ("bart", "Bart", _BART)]
        for side in layouts
    },
    # SigLIP's vision encoder normalizes the whole stream after its last layer (``post_layernorm``)
    "transformers.models.siglip.modeling_siglip.SiglipEncoderLayer": Family(
        _CLIP, final=("final_layer_norm", "post_layernorm")
    ),
    # Moonshine's decoders: Llama's layer with Whisper's cross-attention between, which the block
    # calls without its **kwargs (and its encoder's positions unused)
    **{
        hf_path(m, f"{c}DecoderLayer"): Family(
            (
                Step("self_attn", "input_layernorm"),
                Step(
                    "encoder_attn",
                    "post_attention_layernorm",
                    first=True,
                    call=(
                        ("encoder_hidden_states", "key_value_states"),
                        ("encoder_attention_mask", "attention_mask"),
                        ("cache", "cache"),
                        ("use_cache", "use_cache"),
                    ),
                    needs="encoder_hidden_states",
                    kwargs=False,
                ),
                Step("mlp", "final_layernorm"),
            ),
            final="norm",
            drop=("encoder_hidden_states", "encoder_attention_mask")
            + ("encoder_position_ids", "encoder_position_embeddings"),  # (unused by the original)
        )
        for m, c in [("moonshine", "Moonshine"), ("moonshine_streaming", "MoonshineStreaming")]
    },
    # GLM-5 and Mistral Large 4: Llama's layer, returning its attention's top-k token indices (the
    # attention's third output) for the next layer's sparse attention
    **{
        hf_path(m, c): Family(_PRE, final="norm", extras=True, extras_from=2)
        for m, c in [("glm_moe_dsa", "GlmMoeDsaDecoderLayer"), ("mistral_large4", "MistralLarge4TextDecoderLayer")]
    },
    # Nemotron: Llama's layer, its attention called without the block's **kwargs
    "transformers.models.nemotron.modeling_nemotron.NemotronDecoderLayer": Family(_PRE, final="norm", kwargs=False),
    "transformers.models.gptj.modeling_gptj.GPTJBlock": Family(
        (Step("attn", "ln_1"), Step("mlp", "ln_1")), final="ln_f", parallel="sum"
    ),
    # BLOOM's attention adds the residual it is given after its own dropout: given NO_RESIDUAL, it
    # returns its dropped-out output, whose add is fused; its MLP's layers run here, their dropout
    # and add fused. Not with the residual taken after the norm, nor with the MLP's sliced "slow but
    # exact" matmul (other sums than one dense layer's)
    "transformers.models.bloom.modeling_bloom.BloomBlock": lambda block: (
        None
        if block.apply_residual_connection_post_layernorm or (block.mlp.pretraining_tp > 1 and block.mlp.slow_but_exact)
        else Family(
            (
                Step("self_attention", "input_layernorm", adds="residual"),
                Step(
                    "mlp.dense_h_to_4h mlp.gelu_impl mlp.dense_4h_to_h",
                    "post_attention_layernorm",
                    dropout="mlp.hidden_dropout",
                ),
            ),
            final="ln_f",
            extras=True,
            kwargs=False,
        )
    ),
    # OPT-350m normalizes after each add (do_layer_norm_before=False), the others before
    "transformers.models.opt.modeling_opt.OPTDecoderLayer": lambda block: Family(
        (
            Step("self_attn", "self_attn_layer_norm", dropout="dropout"),
            Step("fc1 activation_fn fc2", "final_layer_norm", dropout="dropout"),
        ),
        final="final_layer_norm" if block.do_layer_norm_before else None,
        drop=("use_cache",),
        norm_after=not block.do_layer_norm_before,
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
    "transformers.models.dinov2.modeling_dinov2.Dinov2Layer": Family(_DINO, final="layernorm"),
    hf_path("internvl", "InternVLVisionLayer"): Family(_LAMBDA, final="layernorm"),
    # Qianfan-OCR's vision encoder: InternVL's, with a drop path module per step
    hf_path("qianfan_ocr", "QianfanOCRVisionLayer"): Family(
        (
            dataclasses.replace(_LAMBDA[0], drop_path="drop_path1"),
            dataclasses.replace(_LAMBDA[1], drop_path="drop_path2"),
        ),
        final="layernorm",
    ),
    # Step3.7's vision encoder: its attention named as Llama's, no norm after the stack
    hf_path("step3p7", "Step3p7VisionEncoderLayer"): Family(
        (dataclasses.replace(_LAMBDA[0], sublayer="self_attn"), dataclasses.replace(_LAMBDA[1], dropout=None))
    ),
    **{
        hf_path(m, c): Family(_VIT_OUTPUT, final="layernorm")
        for m, c in [("videomae", "VideoMAELayer"), ("dpt", "DPTViTLayer")]
    },
    # (YOLOS's encoder adds position embeddings after each layer but the last, by default: then no
    # layer hands its last add on)
    hf_path("yolos", "YolosLayer"): lambda block: Family(
        _VIT_OUTPUT, final="layernorm", alone=block.attention.attention.config.use_mid_position_embeddings
    ),
    # (returning the attention's weights too, when asked)
    **{
        hf_path(m, c): Family(_VIT_OUTPUT, final="layernorm", extras=True)
        for m, c in [("vilt", "ViltLayer"), ("flava", "FlavaLayer")]
    },
    # BEiT: dropout, the scale per channel and drop path on each step, its attention given the
    # layer's relative position bias
    hf_path("beit", "BeitLayer"): Family(
        tuple(
            dataclasses.replace(step, dropout="dropout", drop_path="drop_path")
            for step in (dataclasses.replace(_LAMBDA[0], run=_beit_attention), _LAMBDA[1])
        ),
        final="layernorm",
    ),
    hf_path("dinov3_vit", "DINOv3ViTLayer"): Family(_DINO, final="norm"),  # (its attention takes RoPE)
    # Pixtral's vision encoder: Llama's steps, no norm after its stack (the projector reads it)
    # Kosmos-2's and Kosmos-2.5's text decoders: Whisper's steps, the MLP a module of its own (``ffn``);
    # Kosmos-2's cross-attention (when configured and given) takes the encoder's states by name
    # (without a cross-attention, a layer given the encoder's states runs its own forward, which
    # refuses them)
    hf_path("kosmos2", "Kosmos2TextBlock"): lambda block: Family(
        (
            _WHISPER_ATTENTION,
            dataclasses.replace(
                _WHISPER["decoder"].steps[1],
                call=(
                    ("encoder_hidden_states", "encoder_hidden_states"),
                    ("encoder_attention_mask", "attention_mask"),
                    ("cache", "cache"),
                    ("output_attentions", "output_attentions"),
                ),
            ),
            Step("ffn", "final_layer_norm"),
        ),
        final="layer_norm",
        drop=("encoder_hidden_states", "encoder_attention_mask"),
        fallback=() if hasattr(block, "encoder_attn") else ("encoder_hidden_states",),
    ),
    hf_path("kosmos2_5", "Kosmos2_5TextBlock"): Family(
        (_WHISPER_ATTENTION, Step("ffn", "final_layer_norm")), final="layer_norm"
    ),
    # MPT: its MLP module adds the stream itself; its layers and dropout run here instead (as BLOOM's)
    hf_path("mpt", "MptBlock"): Family(
        (
            Step("attn", "norm_1", dropout="resid_attn_dropout"),
            Step("ffn.up_proj ffn.act ffn.down_proj", "norm_2", dropout="ffn.hidden_dropout"),
        ),
        final="norm_f",
        rename=(("layer_past", "cache"),),
        drop=("use_cache", "output_attentions"),
        kwargs=False,
        extras=True,
    ),
    # GTE, Nomic's BERT and Jina's v3 embeddings: post-norm, each add then its norm (as BART's)
    **{
        hf_path(m, c): Family(
            (
                Step("self_attn", "post_attention_layernorm", dropout="post_attention_dropout"),
                Step("mlp", "post_mlp_layernorm", dropout="post_mlp_dropout"),
            ),
            norm_after=True,
        )
        for m, c in [
            ("gte", "GteLayer"),
            ("nomic_bert", "NomicBertLayer"),
            ("jina_embeddings_v3", "JinaEmbeddingsV3Layer"),
        ]
    },
    # Mimi's transformers (the codec of Moshi and Kyutai's speech-to-text): Llama's steps, each output
    # through a layer scale module; no norm after the stack
    hf_path("mimi", "MimiTransformerLayer"): Family(
        (
            Step("self_attn", "input_layernorm", layer_scale="self_attn_layer_scale"),
            Step("mlp", "post_attention_layernorm", layer_scale="mlp_layer_scale"),
        )
    ),
    hf_path("pixtral", "PixtralAttentionLayer"): Family(
        (Step("attention", "attention_norm"), Step("feed_forward", "ffn_norm"))
    ),
    **{
        hf_path(m, f"{c}{layer}"): family
        for m, c in [("t5", "T5"), ("mt5", "MT5")]
        for layer, family in _T5_LAYERS.items()
    },
    "transformers.models.bert.modeling_bert.BertSelfOutput": Family(
        (Step("dense", "LayerNorm", dropout="dropout"),), post_norm=True
    ),
}

# the copies of :mod:`.copies`: each with its original's Family, alone or with another final norm
FAMILIES.update(
    {
        hf_path(m, c): FAMILIES[hf_path(*original.split("."))]
        for original, copies in COPIES.items()
        for m, c in pairs(copies)
    }
)


def _with(entry, **changes):
    """A ``FAMILIES`` entry (a Family, or a function of the block giving one) with ``changes``."""
    if callable(entry):
        return lambda block: dataclasses.replace(entry(block), **changes)
    return dataclasses.replace(entry, **changes)


FAMILIES.update({hf_path(m, c): _with(FAMILIES[hf_path(m, c)], alone=True) for m, c in pairs(ALONE)})
FAMILIES.update(
    {hf_path(*cls.split(".")): _with(FAMILIES[hf_path(*cls.split("."))], final=final) for cls, final in FINALS.items()}
)


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
    if family.post_norm or family.norm_after:
        return ()
    steps = family.steps[:2] if family.parallel else family.steps[:1]
    return tuple(dict.fromkeys(step.norm for step in steps))
