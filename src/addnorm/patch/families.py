"""Which blocks ``patch(fuse_residual=True)`` fuses, and how each runs: a block is a sequence of
:class:`Step` (sublayer, the norm before it, dropout, ...), its :class:`Family` the steps and where
its stack's stream goes next. ``FAMILIES`` maps each Hugging Face block class to its Family (the
short per-family table of docs/integrations.md, section 3); :mod:`.blocks` runs them all.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from . import tables
from .copies import ALONE, COPIES, FINALS
from .hf_norms import hf_path, pairs
from .layout import Family, Step
from .steps import (
    BART,
    CLIP,
    DINO,
    DONUT_SWIN,
    GATED_CROSS,
    GRANITE,
    LAMBDA,
    MASKFORMER_SWIN,
    NORM_AFTER_OUTPUT,
    POST,
    PRE,
    SAM,
    SANDWICH,
    SWIN,
    T5_LAYERS,
    T5GEMMA_ATTENTION,
    T5GEMMA_MLP,
    VIT,
    VIT_OUTPUT,
    WHISPER,
    WHISPER_ATTENTION,
    WHISPER_MLP,
    ZAMBA,
    bamba,
    beit_attention,
    each,
    falcon,
    falcon_h1,
    gated_attention,
    gated_mlp,
    gemma4,
    granite_shared,
    hybrid,
    kimi,
    lfm,
    llama,
    molmo2,
    nemotron_h,
)

# block class path -> Family: the short per-family table (docs/integrations.md, section 3)
FAMILIES: dict[str, Family] = {
    **ZAMBA,  # Zamba and Zamba 2: Mamba layers, and hybrid layers around a shared transformer
    # the tables of patch/tables.py, by kind of model
    **tables.WAV2VEC2,  # speech encoders: wav2vec 2.0's layers, post-norm and pre-norm, WavLM's, OmniASR's
    **tables.CONFORMERS,  # Parakeet's encoder blocks: four pre-norm steps, then the block's own norm
    **tables.RETURNING_WEIGHTS,  # BART's layers returning their attentions' weights: MVP, TrOCR, SpeechT5, ...
    **tables.VISION,  # vision encoders: Qwen2-VL's blocks (Qwen2.5-VL, Qwen3-VL, GLM-4V, ...), AIMv2, V-JEPA 2, ...
    **tables.ENCODERS,  # ModernBERT's, DistilBERT's and OpenAI's privacy filter's layers
    **tables.CROSS_ATTENTION,  # Canary's, SeamlessM4T's and NLLB-MoE's layers, BigBird-Pegasus's encoder
    **tables.DETR,  # DETR's encoder and decoder layers (post-norm, position embeddings)
    **tables.LLAMA_RENAMED,  # Llama's steps under other names: ERNIE 4.5 VL's text layers, Dia's, ...
    **dict(llama(m, c, PRE) for m, c in [("llama", "Llama"), ("mistral", "Mistral"), ("mixtral", "Mixtral")]),
    **dict(llama(m, c, PRE) for m, c in [("qwen2", "Qwen2"), ("qwen3", "Qwen3"), ("gemma", "Gemma")]),
    **dict(
        llama(m, c, steps)
        for m, c, steps in [
            ("qwen2_moe", "Qwen2Moe", PRE),
            ("qwen3_moe", "Qwen3Moe", PRE),
            ("granite", "Granite", GRANITE),
            (
                "granitemoe",
                "GraniteMoe",
                (GRANITE[0], Step("block_sparse_moe", "post_attention_layernorm", multiplier="residual_multiplier")),
            ),
        ]
    ),
    **dict(llama(m, c, SANDWICH) for m, c in [("gemma2", "Gemma2"), ("gemma3", "Gemma3")]),
    **{
        hf_path(m, c): Family(POST, final="norm")
        for m, c in [("olmo2", "Olmo2DecoderLayer"), ("flex_olmo", "FlexOlmoDecoderLayer")]
    },
    hf_path("dbrx", "DbrxBlock"): tables.DBRX,
    hf_path("gpt_oss", "GptOssDecoderLayer"): Family(
        (PRE[0], Step("mlp", "post_attention_layernorm", first=True)), final="norm"
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
        hf_path(m, f"{c}DecoderLayer"): hybrid
        for m, c in [("qwen3_next", "Qwen3Next"), ("qwen3_5_moe", "Qwen3_5Moe"), ("qwen3_5", "Qwen3_5")]
    },
    hf_path("kimi_linear", "KimiLinearDecoderLayer"): kimi,
    hf_path("bamba", "BambaDecoderLayer"): bamba,
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
        (Step("mamba+self_attn", "input_layernorm", run=falcon_h1), Step("feed_forward", "pre_ff_layernorm")),
        final="final_layernorm",
        extras=True,
    ),
    # Chameleon's layers: Llama's, or with ``swin_norm`` OLMo 2's (each norm on its sublayer's output);
    # Llama 4's vision encoder: Llama's steps, its stream named ``hidden_state``
    **{
        hf_path(m, c): Family(steps, final=final, extras=True, extras_if="output_attentions", drop=drop)
        for m, c, steps, final, drop in [
            ("chameleon", "ChameleonDecoderLayer", PRE, "norm", ()),
            ("chameleon", "ChameleonSwinDecoderLayer", NORM_AFTER_OUTPUT, "norm", ()),
            ("llama4", "Llama4VisionEncoderLayer", PRE, "layernorm_post", ("output_attentions",)),
        ]
    },
    hf_path("gemma4", "Gemma4TextDecoderLayer"): gemma4,
    hf_path("gemma4_unified", "Gemma4UnifiedTextDecoderLayer"): Family(SANDWICH, final="norm", scale="layer_scalar"),
    hf_path("gemma4", "Gemma4VisionEncoderLayer"): Family(SANDWICH),  # (pooled after its stack: no final norm)
    # Qwen3-ASR's audio encoder: Whisper's encoder steps, no dropout, clips' rows packed; returns (stream,)
    hf_path("qwen3_asr", "Qwen3ASRAudioEncoderLayer"): Family(
        (Step("self_attn", "self_attn_layer_norm"), Step("fc1 activation_fn fc2", "final_layer_norm")),
        final="ln_post",
        clamp16=True,
        extras=True,
    ),
    hf_path("molmo2", "Molmo2DecoderLayer"): molmo2,
    # Whisper's encoder layer, its attention given no use_cache (BioGPT)
    hf_path("biogpt", "BioGptDecoderLayer"): Family(
        (WHISPER_ATTENTION, WHISPER_MLP), final="layer_norm", drop=("use_cache",)
    ),
    **{
        hf_path(m, f"{c}{side}Layer"): Family((T5GEMMA_ATTENTION, T5GEMMA_MLP), final="norm")
        for m, c, side in [
            ("t5gemma", "T5Gemma", "Encoder"),
            ("t5gemma2", "T5Gemma2", "Encoder"),
            ("t5gemma2", "T5Gemma2", "Decoder"),  # (one attention over itself and the encoder: merged)
        ]
    },
    # self-attention on the self-attention part of the cache, then cross-attention on the whole of it
    hf_path("t5gemma", "T5GemmaDecoderLayer"): Family(
        (
            T5GEMMA_ATTENTION,
            Step(
                "cross_attn",
                "pre_cross_attn_layernorm",
                post="post_cross_attn_layernorm",
                dropout="dropout",
                first=True,
                call=(("encoder_hidden_states", "encoder_hidden_states"), ("encoder_attention_mask", "attention_mask"))
                + (("cache", "cache"), ("use_cache", "use_cache")),
            ),
            T5GEMMA_MLP,
        ),
        final="norm",
        drop=("encoder_hidden_states", "encoder_attention_mask"),
        self_cache="self_attention_cache",
    ),
    hf_path("modernbert_decoder", "ModernBertDecoderLayer"): Family(
        (Step("attn", "attn_norm"), Step("mlp", "mlp_norm")), final="final_norm"
    ),
    hf_path("mllama", "MllamaSelfAttentionDecoderLayer"): Family(
        PRE, final="norm", drop=("cross_attention_states", "cross_attention_mask", "full_text_row_masked_out_mask")
    ),
    # its cross-attention layers, each output gated: the model skips them in calls without image states
    hf_path("mllama", "MllamaCrossAttentionDecoderLayer"): Family(
        GATED_CROSS, final="norm", skipped_without="cross_attention_states"
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
    **{hf_path(m, f"{c}DecoderLayer"): lfm for m, c in [("lfm2", "Lfm2"), ("lfm2_moe", "Lfm2Moe"), ("lfm3", "Lfm3")]},
    **{
        hf_path(m, f"{c}DecoderLayer"): granite_shared
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
    hf_path("minicpm3", "MiniCPM3DecoderLayer"): Family(each(PRE, multiplier="residual_scale"), final="norm"),
    hf_path("emu3", "Emu3DecoderLayer"): Family(each(PRE, dropout="dropout"), final="norm"),
    # ESM C: each output divided by a constant before its add; its LayerNorms cast back to the input's dtype
    hf_path("esmc", "EsmcLayer"): Family(each(PRE, divisor="scaling_factor"), final="norm"),
    hf_path("persimmon", "PersimmonDecoderLayer"): Family(
        (PRE[0], Step("mlp", "post_attention_layernorm", dropout="dropout")), final="final_layernorm"
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
                PRE[0],
                Step("mlp", "post_attention_layernorm", call=(("codebook_idx", "layer_idx"),), kwargs=False)
                if block.use_flexible_linear
                else PRE[1],
            ),
            final="norm",
        )
        for m, c in [("moshi", "Moshi"), ("kyutai_speech_to_text", "KyutaiSpeechToText")]
    },
    # OLMo-Hybrid's linear attention layers (pre-norm; its attention layers: OLMo 2's)
    hf_path("olmo_hybrid", "OlmoHybridLinearAttentionDecoderLayer"): Family(
        (Step("linear_attn", "input_layernorm"), PRE[1]),
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
    # Nemotron-H: one mixer per block (Mamba-2, attention, MLP or MoE), its norm reading the stream cast as Mamba's
    hf_path("nemotron_h", "NemotronHBlock"): Family(
        (Step("mixer", "norm", run=nemotron_h),), final="norm_f", cast=True
    ),
    "transformers.models.clip.modeling_clip.CLIPEncoderLayer": Family(CLIP, final="final_layer_norm"),
    hf_path("blip", "BlipEncoderLayer"): Family(CLIP, final="post_layernorm"),  # BLIP's vision encoder: CLIP's steps
    "transformers.models.vit.modeling_vit.ViTLayer": Family(VIT, final="layernorm"),
    **{
        hf_path(m, f"{c}{side.capitalize()}Layer"): layouts[side]
        for m, c, layouts in [("whisper", "Whisper", WHISPER), ("bart", "Bart", BART)]
        for side in layouts
    },
    # SigLIP's vision encoder normalizes the whole stream after its last layer (``post_layernorm``)
    "transformers.models.siglip.modeling_siglip.SiglipEncoderLayer": Family(
        CLIP, final=("final_layer_norm", "post_layernorm")
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
        hf_path(m, c): Family(PRE, final="norm", extras=True, extras_from=2)
        for m, c in [("glm_moe_dsa", "GlmMoeDsaDecoderLayer"), ("mistral_large4", "MistralLarge4TextDecoderLayer")]
    },
    # Nemotron: Llama's layer, its attention called without the block's **kwargs
    "transformers.models.nemotron.modeling_nemotron.NemotronDecoderLayer": Family(PRE, final="norm", kwargs=False),
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
    "transformers.models.falcon.modeling_falcon.FalconDecoderLayer": lambda block: falcon(block.config),
    "transformers.models.dinov2.modeling_dinov2.Dinov2Layer": Family(DINO, final="layernorm"),
    # Swin: a stage's last layer hands nothing on where the stage merges patches after it, the last
    # stage's to the final norm
    hf_path("swin", "SwinLayer"): Family(SWIN, final="layernorm", extras=True, then="downsample"),
    # Donut's and MaskFormer's older form of it (no final norm in Donut's model)
    **{
        f"transformers.models.{model}.modeling_{model}_swin.{c}SwinLayer": Family(
            steps, final=final, extras=True, extras_if="output_attentions", then="downsample"
        )
        for model, c, steps, final in [
            ("donut", "Donut", DONUT_SWIN, None),
            ("maskformer", "MaskFormer", MASKFORMER_SWIN, "layernorm"),
        ]
    },
    # SAM's image encoder: a neck of convolutions after the last layer, no norm
    hf_path("sam", "SamVisionLayer"): Family(SAM),
    hf_path("internvl", "InternVLVisionLayer"): Family(LAMBDA, final="layernorm"),
    # Llama 3.2 Vision's encoder: Llama's steps with LayerNorm, its local layers' stack followed by
    # ``layernorm_post``; its global layers scale each output by the tanh of a learned gate first
    # (each then a sublayer of its own: ``Step.run``), and no norm follows their stack
    hf_path("mllama", "MllamaVisionEncoderLayer"): lambda block: Family(
        (
            (Step("self_attn", "input_layernorm", run=gated_attention) if block.is_gated else PRE[0]),
            (Step("mlp", "post_attention_layernorm", run=gated_mlp) if block.is_gated else PRE[1]),
        ),
        final=None if block.is_gated else "layernorm_post",
    ),
    # Qianfan-OCR's vision encoder: InternVL's, with a drop path module per step
    hf_path("qianfan_ocr", "QianfanOCRVisionLayer"): Family(
        (
            dataclasses.replace(LAMBDA[0], drop_path="drop_path1"),
            dataclasses.replace(LAMBDA[1], drop_path="drop_path2"),
        ),
        final="layernorm",
    ),
    # Step3.7's vision encoder: its attention named as Llama's, no norm after the stack
    hf_path("step3p7", "Step3p7VisionEncoderLayer"): Family(
        (dataclasses.replace(LAMBDA[0], sublayer="self_attn"), dataclasses.replace(LAMBDA[1], dropout=None))
    ),
    **{
        hf_path(m, c): Family(VIT_OUTPUT, final="layernorm")
        for m, c in [("videomae", "VideoMAELayer"), ("dpt", "DPTViTLayer")]
    },
    # (YOLOS's encoder adds position embeddings after each layer but the last, by default: then only
    # the last layer hands its last add on, to the final norm)
    hf_path("yolos", "YolosLayer"): lambda block: Family(
        VIT_OUTPUT,
        final="layernorm",
        alone="but_last" if block.attention.attention.config.use_mid_position_embeddings else False,
    ),
    # (returning the attention's weights too, when asked)
    **{
        hf_path(m, c): Family(VIT_OUTPUT, final="layernorm", extras=True)
        for m, c in [("vilt", "ViltLayer"), ("flava", "FlavaLayer")]
    },
    # BEiT: dropout, the scale per channel and drop path on each step, its attention given the
    # layer's relative position bias
    hf_path("beit", "BeitLayer"): Family(
        tuple(
            dataclasses.replace(step, dropout="dropout", drop_path="drop_path")
            for step in (dataclasses.replace(LAMBDA[0], run=beit_attention), LAMBDA[1])
        ),
        final="layernorm",
    ),
    hf_path("dinov3_vit", "DINOv3ViTLayer"): Family(DINO, final="norm"),  # (its attention takes RoPE)
    # Pixtral's vision encoder: Llama's steps, no norm after its stack (the projector reads it)
    # Kosmos-2's and Kosmos-2.5's text decoders: Whisper's steps, the MLP a module of its own (``ffn``);
    # Kosmos-2's cross-attention (when configured and given) takes the encoder's states by name
    # (without a cross-attention, a layer given the encoder's states runs its own forward, which
    # refuses them)
    hf_path("kosmos2", "Kosmos2TextBlock"): lambda block: Family(
        (
            WHISPER_ATTENTION,
            dataclasses.replace(
                WHISPER["decoder"].steps[1],
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
        (WHISPER_ATTENTION, Step("ffn", "final_layer_norm")), final="layer_norm"
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
        for layer, family in T5_LAYERS.items()
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
