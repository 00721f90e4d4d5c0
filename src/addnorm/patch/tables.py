"""Tables of ``FAMILIES`` (:mod:`.families`) by kind of model, each written with the steps of
:mod:`.steps`: speech encoders (wav2vec 2.0's kind, Conformers), BART's layers as first written
(returning their attentions' weights), vision encoders, encoders of BERT's kind, decoders with a
cross-attention step, DETR's layers, DBRX's blocks, and Llama's steps under other names."""

from __future__ import annotations

import dataclasses
import functools

from torch import nn

from .hf_norms import hf_path
from .layout import Family, Step
from .steps import BART, CLIP, PRE, WHISPER, WHISPER_ATTENTION

# wav2vec 2.0's encoder layers. Post-norm, each norm after its add (BART's layout); pre-norm
# (``do_stable_layer_norm``: XLS-R, MMS, the large LV-60 models), the encoder's final norm after
# the last layer, where a layer with an attention adapter (MMS's per-language adapters, added after
# the MLP's add) keeps its own forward. WavLM's: the same two layouts, each layer handing its
# attention's relative position bias on to the next.
_W2V = (Step("attention", "layer_norm", dropout="dropout"), Step("feed_forward", "final_layer_norm"))
WAV2VEC2 = {
    hf_path("wav2vec2", "Wav2Vec2EncoderLayer"): Family(_W2V, norm_after=True),
    hf_path("wav2vec2", "Wav2Vec2EncoderLayerStableLayerNorm"): lambda block: (
        None if block.adapter_layer is not None else Family(_W2V, final="layer_norm")
    ),
    hf_path("wavlm", "WavLMEncoderLayer"): Family(_W2V, norm_after=True, extras=True, extras_from=2),
    hf_path("wavlm", "WavLMEncoderLayerStableLayerNorm"): Family(_W2V, final="layer_norm", extras=True, extras_from=2),
    # OmniASR's: pre-norm, dropout after each sublayer, the final norm after the last layer
    hf_path("omniasr", "OmniASREncoderLayer"): Family(
        (_W2V[0], dataclasses.replace(_W2V[1], dropout="dropout")), final="layer_norm"
    ),
}


def _alone(name: str, block: nn.Module, h, s, named: dict):
    """The block's module ``name`` on ``h`` alone: a first sublayer that takes none of the block's
    arguments (a Conformer's feed-forward; those go to the attention after it)."""
    return getattr(block, name)(h)


def _conformer(
    names: tuple, attention: tuple, conv: tuple = (), dropout: str | None = None, weights: tuple[str, str] = ()
) -> Family:
    """A Conformer block: a half-step feed-forward, self-attention (``dropout`` after it), a
    convolution and a second half-step feed-forward, each pre-norm (``names``: each sublayer and
    its norm, then the block's last norm), the attention and convolution given the block
    arguments of ``attention`` and ``conv``; then the block's own norm of the stream, which it
    returns (``Family.out_norm``). A convolution module that starts with a norm of its own reads
    the stream itself (norm None): the attention's add is not fused. ``weights``: the block's
    lists ``(stream weight, output weight)`` of the feed-forwards' adds and of the convolution's
    (LASR: ``w0 * s + w1 * out``), where the feed-forwards' are otherwise ``s + 0.5 * out``."""
    (ffn1, norm1), (attn, norm2), (conv_module, norm3), (ffn2, norm4), out = names
    half = dict(multiplier=0.5)
    ffn = dict(multiplier=f"{weights[0]}.1", residual_scale=f"{weights[0]}.0") if weights else half
    conv_weights = dict(multiplier=f"{weights[1]}.1", residual_scale=f"{weights[1]}.0") if weights else {}
    return Family(
        (
            Step(ffn1, norm1, run=functools.partial(_alone, ffn1), **ffn),
            Step(attn, norm2, first=True, dropout=dropout, call=attention),
            Step(conv_module, norm3, call=conv, kwargs=False, **conv_weights),
            Step(ffn2, norm4, **ffn),
        ),
        out_norm=out,
    )


# Conformer blocks: a half-step feed-forward, self-attention, convolution and a second half-step
# feed-forward, each pre-norm, then the block's own norm of the stream, which it returns: each add
# is read by the next step's norm (but the attention's, in the wav2vec2 kind, whose convolution
# module normalizes inside), the last by that one. Parakeet's (Canary's encoder, Granite Speech 5's)
# and Nemotron's streaming ASR's (a cache); wav2vec2-BERT's (SeamlessM4T's speech encoder),
# SeamlessM4T v2's (its attention without relative positions) and wav2vec2-Conformer's (its
# convolution without the mask).
_PARAKEET = (
    ("feed_forward1", "norm_feed_forward1"),
    ("self_attn", "norm_self_att"),
    ("conv", "norm_conv"),
    ("feed_forward2", "norm_feed_forward2"),
    "norm_out",
)
_W2V_CONFORMER = (
    ("ffn1", "ffn1_layer_norm"),
    ("self_attn", "self_attn_layer_norm"),
    ("conv_module", None),
    ("ffn2", "ffn2_layer_norm"),
    "final_layer_norm",
)
_MASK = ("attention_mask", "attention_mask")
_W2V_ATTENTION = (_MASK, ("relative_position_embeddings", "relative_position_embeddings"))
CONFORMERS = {
    hf_path("parakeet", "ParakeetEncoderBlock"): _conformer(
        _PARAKEET, (_MASK, ("position_embeddings", "position_embeddings")), (_MASK,)
    ),
    hf_path("nemotron_asr_streaming", "NemotronAsrStreamingEncoderBlock"): _conformer(
        _PARAKEET,
        (_MASK, ("position_embeddings", "position_embeddings"), ("cache", "cache")),
        (("all_masked_rows", "all_masked_rows"), ("padding_cache", "padding_cache")),
    ),
    # LASR's (MedASR's): Parakeet's, each feed-forward's and the convolution's add weighted
    hf_path("lasr", "LasrEncoderBlock"): _conformer(
        _PARAKEET,
        (_MASK, ("position_embeddings", "position_embeddings")),
        (_MASK,),
        weights=("feed_forward_residual_weights", "conv_residual_weights"),
    ),
    hf_path("wav2vec2_bert", "Wav2Vec2BertEncoderLayer"): _conformer(
        _W2V_CONFORMER, _W2V_ATTENTION, (("conv_attention_mask", "attention_mask"),), dropout="self_attn_dropout"
    ),
    hf_path("seamless_m4t_v2", "SeamlessM4Tv2ConformerEncoderLayer"): _conformer(
        _W2V_CONFORMER, (_MASK,), (("conv_attention_mask", "attention_mask"),), dropout="self_attn_dropout"
    ),
    hf_path("wav2vec2_conformer", "Wav2Vec2ConformerEncoderLayer"): _conformer(
        _W2V_CONFORMER, _W2V_ATTENTION, dropout="self_attn_dropout"
    ),
}


# BART's layers as first written, returning their attentions' weights: the encoder's always (with
# LED's global attention's; ProphetNet's when asked), the decoder's when asked, its
# cross-attention's after its self-attention's (None without encoder states). TrOCR's decoder;
# MVP's, whose attentions each take a prompt; SpeechT5's, whose MLP adds no dropout of its own
# (wav2vec 2.0's).
def _returning_weights(encoder: Family, decoder: Family, prompts: bool = False) -> dict[str, Family]:
    self_attn, cross, mlp = decoder.steps
    call = cross.call + (("output_attentions", "output_attentions"),)
    call += (("cross_attn_prompt", "attn_prompt"),) if prompts else ()
    rename = (("self_attn_prompt", "attn_prompt"),) if prompts else ()
    return {
        "encoder": dataclasses.replace(encoder, extras=True, rename=rename),
        "decoder": dataclasses.replace(
            decoder,
            steps=(self_attn, dataclasses.replace(cross, call=call, extras=True), mlp),
            rename=rename,
            drop=decoder.drop + (("cross_attn_prompt",) if prompts else ()),
            extras=True,
            extras_if="output_attentions",
            padded=2,
            kwargs=False,
        ),
    }


_MVP = _returning_weights(BART["encoder"], BART["decoder"], prompts=True)
_SPEECHT5 = _returning_weights(
    Family(_W2V, norm_after=True, extras_if="output_attentions"),
    dataclasses.replace(BART["decoder"], steps=(*BART["decoder"].steps[:2], _W2V[1])),
)
RETURNING_WEIGHTS = {
    # MusicGen-Melody's decoder: Whisper's without cross-attention, returning its self-attention's weights
    hf_path("musicgen_melody", "MusicgenMelodyDecoderLayer"): dataclasses.replace(WHISPER["decoder"], extras=True),
    hf_path("mvp", "MvpEncoderLayer"): _MVP["encoder"],
    hf_path("mvp", "MvpDecoderLayer"): _MVP["decoder"],
    hf_path("trocr", "TrOCRDecoderLayer"): _returning_weights(BART["encoder"], BART["decoder"])["decoder"],
    hf_path("led", "LEDEncoderLayer"): dataclasses.replace(BART["encoder"], extras=True),
    # ProphetNet's encoder: post-norm, no dropout on its adds
    hf_path("prophetnet", "ProphetNetEncoderLayer"): Family(
        (Step("self_attn", "self_attn_layer_norm"), Step("feed_forward", "feed_forward_layer_norm")),
        norm_after=True,
        extras=True,
        extras_if="output_attentions",
    ),
    hf_path("speecht5", "SpeechT5EncoderLayer"): _SPEECHT5["encoder"],
    hf_path("speecht5", "SpeechT5DecoderLayer"): _SPEECHT5["decoder"],
}


# Vision encoders. Qwen2-VL's blocks and those built on them (Qwen2.5-VL, Qwen3-VL, GLM-4V, ...):
# Llama's steps on the packed patches of all images, each attention given the images' bounds
# (``cu_seqlens``), the stack's last add read by its patch merger's norm (``FINALS``: where others).
# PaddleOCR-VL's (and VideoLLaMA3's, Cosmos 3 Edge's): CLIP's steps on packed patches. AIMv2's (and Ovis2's):
# RMSNorm before each sublayer. Pix2Struct's: returning its attention's weights (Kosmos-2.5's: not).
_QWEN_VL = (Step("attn", "norm1"), Step("mlp", "norm2"))
_PIX2STRUCT = (Step("attention", "pre_attention_layer_norm"), Step("mlp", "pre_mlp_layer_norm"))
VISION = {
    hf_path("qwen2_5_vl", "Qwen2_5_VLVisionBlock"): Family(_QWEN_VL, final="merger.ln_q"),
    hf_path("paddleocr_vl", "PaddleOCRVisionEncoderLayer"): Family(CLIP, final="post_layernorm"),
    hf_path("cosmos3_edge", "Cosmos3EdgeVisionEncoderLayer"): Family(CLIP, final="post_layernorm"),
    # MLCD's: CLIP's steps, each attention given its positions; its norm after the stack reads the
    # pooled token alone (CLIP's vision encoder's layout)
    hf_path("mlcd", "MLCDEncoderLayer"): Family(CLIP),
    # ViTPose's backbone: ViT's steps (ViTPose+'s layers, with an MLP of experts by dataset, keep
    # their own forward), the final norm reading the last layer's output
    hf_path("vitpose_backbone", "VitPoseBackboneLayer"): lambda block: (
        Family((Step("attention", "layernorm_before"), Step("mlp", "layernorm_after")), final="layernorm")
        if block.num_experts == 1
        else None
    ),
    hf_path("aimv2", "Aimv2EncoderLayer"): Family(
        (Step("attention", "rms_norm1"), Step("ffn", "rms_norm2")), final="rms_norm"
    ),
    hf_path("pix2struct", "Pix2StructVisionLayer"): Family(_PIX2STRUCT, final="layernorm", extras=True),
    hf_path("kosmos2_5", "Kosmos2_5VisionLayer"): Family(_PIX2STRUCT, final="layernorm"),  # (its stream alone)
    # GLM-Image's vision encoder: Qwen2-VL's blocks, no norm after them
    hf_path("glm_image", "GlmImageVisionBlock"): Family(_QWEN_VL),
    # V-JEPA 2's: drop path on each step, its attention given the position mask alone, returning its weights
    hf_path("vjepa2", "VJEPA2Layer"): Family(
        (Step("attention", "norm1", drop_path="drop_path"), Step("mlp", "norm2", drop_path="drop_path")),
        final="layernorm",
        extras=True,
        kwargs=False,
    ),
    # Pixio's: dropout then drop path on each step
    hf_path("pixio", "PixioLayer"): Family(
        (
            Step("attention", "layernorm_before", dropout="dropout", drop_path="drop_path"),
            Step("mlp", "layernorm_after", dropout="dropout", drop_path="drop_path"),
        ),
        final="layernorm",
    ),
}


# DBRX: Llama's steps, its attention and both norms inside one module (``norm_attn_norm``), each
# output after a dropout
DBRX = Family(
    (
        Step("norm_attn_norm.attn", "norm_attn_norm.norm_1", dropout="norm_attn_norm.resid_pdrop"),
        Step("ffn", "norm_attn_norm.norm_2", dropout="resid_pdrop"),
    ),
    final="norm_f",
)


# Encoders of BERT's kind whose layers are not BERT's: ModernBERT's (pre-norm; its first layer's
# attention norm an identity, as the embeddings end with a norm) and DistilBERT's (post-norm, each
# norm after its add, as BART's; dropout inside the MLP module); and OpenAI's privacy filter
# (GPT-OSS's steps: its MoE returns its router's scores too)
ENCODERS = {
    hf_path("openai_privacy_filter", "OpenAIPrivacyFilterEncoderLayer"): Family(
        (PRE[0], Step("mlp", "post_attention_layernorm", first=True)), final="norm"
    ),
    hf_path("modernbert", "ModernBertEncoderLayer"): Family(
        (Step("attn", "attn_norm"), Step("mlp", "mlp_norm")), final="final_norm"
    ),
    hf_path("distilbert", "TransformerBlock"): Family(
        (Step("attention", "sa_layer_norm"), Step("ffn", "output_layer_norm")), norm_after=True
    ),
}


def _nllb_moe_ffn(block: nn.Module) -> Step:
    """NLLB-MoE's MLP step: its sparse layers' experts are given the layer's attention mask."""
    call = (("attention_mask", "padding_mask"),) if block.is_sparse else ()
    return Step("ffn", "ff_layer_norm", dropout="ff_dropout", call=call, kwargs=False)


# Decoders with a cross-attention step between Llama's two. Canary's (and Cohere's speech
# recognizer's): the cross-attention given the encoder's states by name, without the layer's
# **kwargs. SeamlessM4T's text encoder and decoder, and NLLB-MoE's: dropout modules after each
# sublayer (NLLB-MoE's clamp a float16 stream: in float16 they run their own forward).
_SEAMLESS_ATTENTION = Step("self_attn", "self_attn_layer_norm", dropout="attn_dropout")
_SEAMLESS_FFN = Step("ffn", "ffn_layer_norm", dropout="ffn_dropout")
# (the cross-attention given the encoder's states and mask by those names, and the whole cache)
_CROSS = (("encoder_hidden_states", "encoder_hidden_states"), ("encoder_attention_mask", "attention_mask"))
_CROSS += (("cache", "cache"),)
_SEAMLESS_CROSS = Step(
    "cross_attention",
    "cross_attention_layer_norm",
    dropout="attn_dropout",
    first=True,
    call=_CROSS,
    needs="encoder_hidden_states",
)
CROSS_ATTENTION = {
    # BigBird-Pegasus's encoder: Whisper's steps without the MLP's inner dropout, its block-sparse
    # attention given its masks, the stream normalized by ``layernorm_embedding`` after the last layer
    hf_path("bigbird_pegasus", "BigBirdPegasusEncoderLayer"): Family(
        (WHISPER_ATTENTION, Step("fc1 activation_fn fc2", "final_layer_norm", dropout="dropout")),
        final="layernorm_embedding",
        clamp16=True,
    ),
    hf_path("canary", "CanaryDecoderLayer"): Family(
        (
            Step("self_attn", "input_layernorm"),
            Step(
                "encoder_attn",
                "post_attention_layernorm",
                first=True,
                call=_CROSS,
                needs="encoder_hidden_states",
                kwargs=False,
            ),
            Step("mlp", "final_layernorm"),
        ),
        final="norm",
        drop=("encoder_hidden_states", "encoder_attention_mask", "encoder_position_ids"),
    ),
    hf_path("seamless_m4t", "SeamlessM4TEncoderLayer"): Family(
        (_SEAMLESS_ATTENTION, _SEAMLESS_FFN), final="layer_norm"
    ),
    hf_path("seamless_m4t", "SeamlessM4TDecoderLayer"): Family(
        (_SEAMLESS_ATTENTION, _SEAMLESS_CROSS, _SEAMLESS_FFN),
        final="layer_norm",
        drop=("encoder_hidden_states", "encoder_attention_mask", "use_cache"),
    ),
    hf_path("nllb_moe", "NllbMoeEncoderLayer"): lambda block: Family(
        (_SEAMLESS_ATTENTION, _nllb_moe_ffn(block)), final="layer_norm", clamp16=True
    ),
    hf_path("nllb_moe", "NllbMoeDecoderLayer"): lambda block: Family(
        (
            _SEAMLESS_ATTENTION,
            dataclasses.replace(_SEAMLESS_CROSS, call=WHISPER["decoder"].steps[1].call),  # (key_value_states=)
            _nllb_moe_ffn(block),
        ),
        final="layer_norm",
        clamp16=True,
        drop=("encoder_hidden_states", "encoder_attention_mask"),
    ),
}


# DETR's encoder and decoder layers: post-norm (each norm after its add, as BART's), each attention
# given its position embeddings: the encoder's the image's, the decoder's self-attention the object
# queries', its cross-attention both. (The encoder clamps a stream that is not finite in training:
# its last norm's output, finite wherever its weights are.)
_DETR_ATTENTION = Step("self_attn", "self_attn_layer_norm", dropout="dropout")
_DETR_MLP = Step("mlp", "final_layer_norm")
_DETR_CROSS = (("encoder_hidden_states", "key_value_states"), ("encoder_attention_mask", "attention_mask"))
_DETR_CROSS += (("object_queries_position_embeddings", "position_embeddings"),)
_DETR_CROSS += (("spatial_position_embeddings", "encoder_position_embeddings"),)
_DEFORMABLE = ("reference_points", "spatial_shapes", "spatial_shapes_list", "level_start_index")


def conditional_detr_cross_attention(block: nn.Module, h, s, call: dict):
    """Conditional DETR's cross-attention (:attr:`Step.run`): given the object queries' positions
    in the first layer alone (``is_first``), as its layers call it."""
    call = dict(call)
    if not call.pop("is_first"):
        call["query_position_embeddings"] = None
    return block.encoder_attn(hidden_states=h, **call)


def deformable_encoder_attention(block: nn.Module, h, s, named: dict):
    """Deformable DETR's encoder attention (:attr:`Step.run`): the layer's input is its memory too."""
    return block.self_attn(h, encoder_hidden_states=h, encoder_attention_mask=named.get("attention_mask"), **named)


def _detr_decoder(call, *, run=None, needs="encoder_hidden_states", kwargs=True, **family) -> Family:
    """A decoder layer of DETR's kind: self-attention, cross-attention (given ``call``'s block
    arguments, or run by ``run``) and MLP, each add then its norm."""
    options = dict(dropout="dropout", first=True, call=call, run=run, needs=needs, kwargs=kwargs)
    cross = Step("encoder_attn", "encoder_attn_layer_norm", **options)
    return Family((_DETR_ATTENTION, cross, _DETR_MLP), norm_after=True, **family)


DETR = {
    hf_path("detr", "DetrEncoderLayer"): Family(
        (_DETR_ATTENTION, _DETR_MLP), norm_after=True, rename=(("spatial_position_embeddings", "position_embeddings"),)
    ),
    hf_path("detr", "DetrDecoderLayer"): _detr_decoder(
        _DETR_CROSS,
        rename=(("object_queries_position_embeddings", "position_embeddings"),),
        drop=("spatial_position_embeddings", "encoder_hidden_states", "encoder_attention_mask"),
    ),
    # Conditional DETR's decoder: the same layout, its cross-attention given the query sine
    # embedding, and the queries' positions in the first layer alone
    hf_path("conditional_detr", "ConditionalDetrDecoderLayer"): _detr_decoder(
        (
            ("encoder_hidden_states", "encoder_hidden_states"),
            ("encoder_attention_mask", "attention_mask"),
            ("query_sine_embed", "query_sine_embed"),
            ("spatial_position_embeddings", "encoder_position_embeddings"),
            ("query_position_embeddings", "query_position_embeddings"),
            ("is_first", "is_first"),
        ),
        run=conditional_detr_cross_attention,
        drop=("spatial_position_embeddings", "query_sine_embed", "encoder_hidden_states", "encoder_attention_mask")
        + ("is_first",),
    ),
    # Table Transformer's decoder: pre-norm, the self-attention given the queries' positions as
    # ``object_queries``, the cross-attention the image's too, returning both attentions' weights
    # when asked; without encoder states its MLP reads the cross-attention's norm: its own forward
    hf_path("table_transformer", "TableTransformerDecoderLayer"): Family(
        (
            Step("self_attn", "self_attn_layer_norm", dropout="dropout"),
            Step(
                "encoder_attn",
                "encoder_attn_layer_norm",
                dropout="dropout",
                first=True,
                extras=True,
                kwargs=False,
                call=(
                    ("query_position_embeddings", "object_queries"),
                    ("encoder_hidden_states", "key_value_states"),
                    ("encoder_attention_mask", "attention_mask"),
                    ("object_queries", "spatial_position_embeddings"),
                    ("output_attentions", "output_attentions"),
                ),
            ),
            Step("fc1 activation_fn activation_dropout fc2", "final_layer_norm", dropout="dropout"),
        ),
        final="layernorm",
        rename=(("query_position_embeddings", "object_queries"),),
        drop=("object_queries", "encoder_hidden_states", "encoder_attention_mask"),
        extras=True,
        extras_if="output_attentions",
        kwargs=False,
        requires="encoder_hidden_states",
    ),
    # Deformable DETR's: the same layout, its multi-scale attentions given the feature maps' shapes
    # and reference points, without the layer's **kwargs (but the decoder's self-attention)
    hf_path("deformable_detr", "DeformableDetrEncoderLayer"): Family(
        (dataclasses.replace(_DETR_ATTENTION, run=deformable_encoder_attention), _DETR_MLP),
        norm_after=True,
        rename=(("spatial_position_embeddings", "position_embeddings"),),
        kwargs=False,
    ),
    hf_path("deformable_detr", "DeformableDetrDecoderLayer"): _detr_decoder(
        (
            ("encoder_attention_mask", "attention_mask"),
            ("encoder_hidden_states", "encoder_hidden_states"),
            ("encoder_attention_mask", "encoder_attention_mask"),
            ("object_queries_position_embeddings", "position_embeddings"),
            *((a, a) for a in _DEFORMABLE),
        ),
        needs=None,
        kwargs=False,
        rename=(("object_queries_position_embeddings", "position_embeddings"),),
        drop=("encoder_hidden_states", "encoder_attention_mask", *_DEFORMABLE),
    ),
}


# Llama's steps under other names, or with a sublayer called otherwise. ERNIE 4.5 VL's text layers:
# its MoE layers' experts are given the token types (text or image) and return their router's
# outputs too. GLM-ASR's and VoxtralRealtime's audio encoders. Dia's encoder and decoder (its
# self-attention given the self-attention part of the cache, its cross-attention the encoder's
# states positionally).
def _ernie_vl(block: nn.Module) -> Family:
    moe = type(block.mlp).__name__.endswith("MoeBlock")
    call = (("moe_mm_token_type_ids", "moe_mm_token_type_ids"),) if moe else ()
    mlp = Step("mlp", "post_attention_layernorm", first=moe, call=call, kwargs=False)
    return Family((PRE[0], mlp), final="norm", drop=("moe_mm_token_type_ids",))


# Longcat-Flash's layers: two of Llama's layers in one (two of each module, in module lists), the
# first MLP's input read by a shortcut MoE too, whose output the last add adds after the second
# MLP's (``Step.beside``)
_LONGCAT_ATTENTION = ("attention_mask", "position_ids", "cache", "use_cache", "position_embeddings")
LONGCAT = Family(
    (
        Step("self_attn.0", "input_layernorm.0"),
        Step("mlps.0", "post_attention_layernorm.0", beside="mlp"),
        Step("self_attn.1", "input_layernorm.1", first=True, call=tuple((a, a) for a in _LONGCAT_ATTENTION)),
        Step("mlps.1", "post_attention_layernorm.1"),
    ),
    final="norm",
)
_DIA_SELF = Step("self_attention", "pre_sa_norm")
LLAMA_RENAMED = {
    hf_path("longcat_flash", "LongcatFlashDecoderLayer"): LONGCAT,
    hf_path("ernie4_5_vl_moe", "Ernie4_5_VLMoeDecoderLayer"): _ernie_vl,
    hf_path("glmasr", "GlmAsrEncoderLayer"): Family(PRE, final="norm"),
    hf_path("voxtral_realtime", "VoxtralRealtimeEncoderLayer"): Family(
        (Step("self_attn", "self_attn_layer_norm"), Step("mlp", "final_layer_norm")), final="norm"
    ),
    hf_path("dia", "DiaEncoderLayer"): Family((_DIA_SELF, Step("mlp", "post_sa_norm")), final="norm"),
    hf_path("dia", "DiaDecoderLayer"): Family(
        (
            _DIA_SELF,
            Step(
                "cross_attention",
                "pre_ca_norm",
                first=True,
                call=(
                    ("encoder_hidden_states", "cross_attention_states"),
                    ("encoder_attention_mask", "attention_mask"),
                    ("cache", "cache"),
                ),
            ),
            Step("mlp", "pre_mlp_norm"),
        ),
        final="norm",
        drop=("encoder_hidden_states", "encoder_attention_mask"),
        self_cache="self_attention_cache",
    ),
}
