"""The pieces ``FAMILIES`` (:mod:`.families`) is written with: the steps several layouts share
(Llama's pre-norm ``PRE``, sandwich norms, ViT's, Whisper's, ...), the functions that choose a
block's :class:`Family` from its config (a hybrid model's kind of layer), and the sublayers that are
more than modules called in turn (:attr:`Step.run`: Falcon-H1's side-by-side mixers, BEiT's
attention with its position bias, ...)."""

from __future__ import annotations

import dataclasses
import sys
from functools import partial

import torch
from torch import nn

from .blocks import ORIGINAL
from .hf_norms import hf_path
from .layout import Family, Step


def llama(m: str, c: str, steps: tuple[Step, ...]) -> tuple[str, Family]:
    return hf_path(m, f"{c}DecoderLayer"), Family(steps, final="norm")


PRE = (Step("self_attn", "input_layernorm"), Step("mlp", "post_attention_layernorm"))


def each(steps: tuple[Step, ...], **changes) -> tuple[Step, ...]:
    """``steps`` with ``changes`` made to each."""
    return tuple(dataclasses.replace(step, **changes) for step in steps)


GRANITE = each(PRE, multiplier="residual_multiplier")  # s + out * m
# OLMo 2's layout under Llama's norm names: each norm on its sublayer's output, before the add
NORM_AFTER_OUTPUT = (Step("self_attn", post="input_layernorm"), Step("mlp", post="post_attention_layernorm"))
SANDWICH = (
    Step("self_attn", "input_layernorm", post="post_attention_layernorm"),
    Step("mlp", "pre_feedforward_layernorm", post="post_feedforward_layernorm"),
)
T5GEMMA_ATTENTION = Step("self_attn", "pre_self_attn_layernorm", post="post_self_attn_layernorm", dropout="dropout")
T5GEMMA_MLP = Step("mlp", "pre_feedforward_layernorm", post="post_feedforward_layernorm", dropout="dropout")
_T5_ATTENTION = dict(final="final_layer_norm", rename=(("attention_mask", "mask"),), extras=True)
T5_LAYERS = {  # T5's and mT5's layer classes, by the name after the model's prefix
    "LayerSelfAttention": Family((Step("SelfAttention", "layer_norm", dropout="dropout"),), **_T5_ATTENTION),
    "LayerCrossAttention": Family((Step("EncDecAttention", "layer_norm", dropout="dropout"),), **_T5_ATTENTION),
    "LayerFF": Family((Step("DenseReluDense", "layer_norm", dropout="dropout"),), final="final_layer_norm"),
}

DINO = (  # layer scale and drop path on each step (DINOv2, DINOv3)
    Step("attention", "norm1", layer_scale="layer_scale1", drop_path="drop_path"),
    Step("mlp", "norm2", layer_scale="layer_scale2", drop_path="drop_path"),
)
CLIP = (Step("self_attn", "layer_norm1"), Step("mlp", "layer_norm2"))
# ViT's layer as first written: the MLP's second half (``output``) adds the stream itself; its dense
# layer and dropout run here instead (VideoMAE, YOLOS, DPT, ViLT, FLAVA)
VIT_OUTPUT = (
    Step("attention", "layernorm_before"),
    Step("intermediate output.dense", "layernorm_after", dropout="output.dropout"),
)
# ViT's steps, each output scaled by a learned scale per channel (InternVL's vision encoder)
LAMBDA = (
    Step("attention", "layernorm_before", multiplier="lambda_1"),
    Step("mlp", "layernorm_after", dropout="dropout", multiplier="lambda_2"),
)
VIT = (Step("attention", "layernorm_before", dropout="dropout"), Step("mlp", "layernorm_after", dropout="dropout"))
POST = (Step("self_attn", post="post_attention_layernorm"), Step("mlp", post="post_feedforward_layernorm"))
WHISPER_ATTENTION = Step("self_attn", "self_attn_layer_norm", dropout="dropout")
WHISPER_MLP = Step("fc1 activation_fn activation_dropout fc2", "final_layer_norm", dropout="dropout")
WHISPER = {
    # the encoder clamps a float16 stream after each layer
    "encoder": Family((WHISPER_ATTENTION, WHISPER_MLP), final="layer_norm", clamp16=True),
    "decoder": Family(
        (
            WHISPER_ATTENTION,
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
            WHISPER_MLP,
        ),
        final="layer_norm",
        drop=("encoder_hidden_states", "encoder_attention_mask", "use_cache"),
    ),
}
# post-norm layers with Whisper's steps, each norm after its add (BART)
BART = {side: dataclasses.replace(family, norm_after=True, final=None) for side, family in WHISPER.items()}


def hybrid(block: nn.Module) -> Family:
    """Qwen3-Next's layers: linear attention (which takes no positions) or full attention, then the MLP."""
    linear = block.block_type == "linear_attention"
    mixer = Step("linear_attn" if linear else "self_attn", "input_layernorm")
    return Family((mixer, PRE[1]), final="norm", drop=("position_embeddings", "position_ids") if linear else ())


def lfm(block: nn.Module) -> Family:
    """LFM2's and LFM3's layers: attention or a short convolution (which takes no positions), then
    the MLP; LFM3's with a norm after each (``post_operator_norm``, ``post_ffn_norm``)."""
    attention = block.is_attention_layer
    post = ("post_operator_norm", "post_ffn_norm") if hasattr(block, "post_ffn_norm") else (None, None)
    steps = (
        Step("self_attn" if attention else "conv", "operator_norm", post=post[0]),
        Step("feed_forward", "ffn_norm", post=post[1]),
    )
    return Family(steps, final="embedding_norm", drop=() if attention else ("position_embeddings", "position_ids"))


def granite_shared(block: nn.Module) -> Family:
    """Granite's layers with a shared MLP beside the experts (their outputs summed), Granite 4's
    with Mamba or attention by layer (Mamba takes no positions); both with a residual multiplier."""
    mamba = getattr(block, "mamba", None) is not None
    experts = getattr(block, "has_experts", True) and block.block_sparse_moe is not None
    mlp = "block_sparse_moe" if block.shared_mlp is None else "block_sparse_moe+shared_mlp" if experts else "shared_mlp"
    steps = (Step("mamba" if mamba else "self_attn", "input_layernorm"), Step(mlp, "post_attention_layernorm"))
    return Family(
        each(steps, multiplier="residual_multiplier"),
        final="norm",
        drop=("use_cache", "position_embeddings") if mamba else (),
    )


def bamba(block: nn.Module) -> Family:
    """Bamba's layers: Mamba-2 (called with the cache and mask alone) or attention by layer, each
    returning the stream and the attention's weights (None from a Mamba layer)."""
    mamba = block.block_type == "linear_attention"
    steps = (Step("mamba" if mamba else "self_attn", "input_layernorm"), Step("feed_forward", "pre_ff_layernorm"))
    drop = ("position_ids", "use_cache", "position_embeddings") if mamba else ()
    return Family(steps, final="final_layernorm", drop=drop, extras=True, padded=1)


def kimi(block: nn.Module) -> Family:
    """Kimi Linear's layers: linear attention (which takes no positions) or full attention."""
    linear = block.block_type == "linear_attention"
    return Family(PRE, final="norm", drop=("position_ids", "use_cache") if linear else ())


def molmo2(block: nn.Module) -> Family:
    """Molmo2's text layers: Llama's, or with ``norm_after`` OLMo 2's (each norm on its sublayer's
    output, before the add)."""
    return Family(NORM_AFTER_OUTPUT if block.norm_after else PRE, final="norm")


def _gemma4_experts(block: nn.Module, h, s, call: dict):
    """Gemma 4's MoE step (:attr:`Step.run`), as its layer computes it: the MLP on the pre-norm's
    output ``h`` beside the experts, routed from the stream ``s`` and run on their own pre-norm
    of it; each output normed, then summed."""
    flat = s.reshape(-1, s.shape[-1])
    _, weights, index = block.router(flat)
    experts = block.experts(block.pre_feedforward_layernorm_2(flat), index, weights).reshape(s.shape)
    return block.post_feedforward_layernorm_1(block.mlp(h)) + block.post_feedforward_layernorm_2(experts)


def gemma4(block: nn.Module) -> Family:
    """Gemma 4's text layers: Gemma 3's sandwich norms, the MLP beside routed experts in the MoE
    layout; then, with per-layer inputs (E2B, E4B), a gated projection of the per-layer input,
    which reads the stream itself; then the stream times a learned scalar."""
    steps = SANDWICH
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


def falcon_h1(block: nn.Module, h, s, named: dict):
    """Falcon-H1's first sublayer (:attr:`Step.run`), as its layer computes it: Mamba-2 (with its
    own mask) and attention (on ``h`` times ``attention_in_multiplier``) side by side, their
    outputs scaled by ``ssm_out_multiplier`` and ``attn_out_multiplier`` and summed."""
    mamba_args = {k: v for k, v in named.items() if k not in _MAMBA_SKIPS}
    mamba = block.mamba(hidden_states=h, attention_mask=named["mamba_attention_mask"], **mamba_args)
    attention_args = {k: v for k, v in named.items() if k != "mamba_attention_mask"}
    attention, _ = block.self_attn(hidden_states=h * block.attention_in_multiplier, **attention_args)
    return mamba * block.ssm_out_multiplier + attention * block.attn_out_multiplier


def beit_attention(block: nn.Module, h, s, named: dict):
    """BEiT's attention (:attr:`Step.run`), its mask plus the layer's relative position bias when
    it has one, as its layer computes it."""
    mask = named["attention_mask"]
    if block.relative_position_bias is not None:
        resolution = named["resolution"]
        window = (resolution[0] // block.patch_size, resolution[1] // block.patch_size)
        bias = block.relative_position_bias(window, named["interpolate_pos_encoding"], dim_size=s.shape[1])
        mask = bias + mask if mask is not None else bias
    rest = {k: v for k, v in named.items() if k not in ("attention_mask", "resolution", "interpolate_pos_encoding")}
    return block.attention(h, attention_mask=mask, **rest)[0]


def gated_attention(block: nn.Module, h, s, named: dict):
    """A gated layer's attention (Llama 3.2 Vision's global encoder), its output times the tanh of
    the layer's ``gate_attn``, as the layer computes it."""
    return block.gate_attn.tanh() * block.self_attn(h, **named)[0]


def gated_mlp(block: nn.Module, h, s, call: dict):
    """A gated layer's MLP, its output times the tanh of the layer's ``gate_ffn``."""
    return block.gate_ffn.tanh() * block.mlp(h)


# the arguments of Llama 3.2 Vision's cross-attention layer: the rest are ``**kwargs``, passed on
_CROSS_LAYER = ("cross_attention_states", "cross_attention_mask", "attention_mask", "full_text_row_masked_out_mask")
_CROSS_LAYER += ("position_ids", "cache", "use_cache", "position_embeddings")


def gated_cross_attention(block: nn.Module, h, s, named: dict):
    """Llama 3.2 Vision's cross-attention layer's attention (the text attending to the image's
    states, masked by ``cross_attention_mask``), its output times the tanh of the layer's
    ``cross_attn_attn_gate``, as the layer computes it."""
    rest = {k: v for k, v in named.items() if k not in _CROSS_LAYER}
    out = block.cross_attn(
        hidden_states=h,
        attention_mask=named["cross_attention_mask"],
        cross_attention_states=named["cross_attention_states"],
        cache=named["cache"],
        **rest,
    )[0]
    return block.cross_attn_attn_gate.tanh() * out


def gated_masked_mlp(block: nn.Module, h, s, call: dict):
    """The cross-attention layer's MLP: its rows times ``full_text_row_masked_out_mask`` (0 for a
    text row that attends to no image), then times the tanh of ``cross_attn_mlp_gate``."""
    out = block.mlp(h)
    mask = call["full_text_row_masked_out_mask"]
    if mask is not None:
        out = mask[:, 0] * out
    return block.cross_attn_mlp_gate.tanh() * out


def _window_map(block: nn.Module, h, named: dict):
    """Swin's normalized rows as the stage's feature map, padded to whole windows (the layer's window
    and shift sizes set for the stage's size first, unless ``always_partition``, where the layer sets
    them: MaskFormer's does not): ``(map, pad)``."""
    if not named.get("always_partition") and hasattr(block, "set_shift_and_window_size"):
        block.set_shift_and_window_size(named["input_dimensions"])
    height, width = named["input_dimensions"]
    return block.maybe_pad(h.view(h.shape[0], height, width, h.shape[-1]), height, width)


def _map_rows(out, pad, named: dict):
    """The feature map ``out`` unpadded, as rows again (the inverse of :func:`_window_map`)."""
    height, width = named["input_dimensions"]
    if pad[3] > 0 or pad[5] > 0:
        out = out[:, :height, :width, :].contiguous()
    return out.view(out.shape[0], height * width, out.shape[-1])


def shifted_window_attention(block: nn.Module, h, s, named: dict):
    """Swin's attention, as its layer computes it: the normalized rows as the stage's feature map,
    padded to whole windows, cyclically shifted, attended window by window (under the shift's mask),
    through the layer's dropout, then shifted back and unpadded; returns ``(output, weights)``. The
    window helpers are those of the layer's own file."""
    helpers = sys.modules[block.__dict__[ORIGINAL].__module__]
    h, pad = _window_map(block, h, named)
    _, height_pad, width_pad, channels = h.shape
    size = block.window_size
    windows = helpers.window_partition(block.cyclic_shift(h), size).view(-1, size * size, channels)
    mask = block.get_attn_mask(height_pad, width_pad, dtype=h.dtype, device=windows.device)
    rest = {k: v for k, v in named.items() if k not in ("input_dimensions", "always_partition")}
    out, weights = block.attention(windows, mask, **rest)
    out = block.dropout(out).view(-1, size, size, channels)
    out = block.cyclic_shift(helpers.window_reverse(out, size, height_pad, width_pad), reverse=True)
    return _map_rows(out, pad, named), weights


def mask_by_size(block: nn.Module, height: int, width: int, like):
    """The shifted windows' attention mask of Donut's layer: ``get_attn_mask(height, width, dtype, device)``."""
    return block.get_attn_mask(height, width, dtype=like.dtype, device=like.device)


def mask_by_resolution(block: nn.Module, height: int, width: int, like):
    """MaskFormer's: ``get_attn_mask((height, width), device, dtype)``."""
    return block.get_attn_mask((height, width), device=like.device, dtype=like.dtype)


def rolled_window_attention(block: nn.Module, h, s, named: dict, mask_of=mask_by_size):
    """:func:`shifted_window_attention` in the older form Donut's and MaskFormer's Swin layers write
    it: the shift a ``torch.roll`` of the padded map, no dropout after the attention, the mask from
    ``mask_of``; returns the attention's outputs, its weights after the output when asked
    (``output_attentions``)."""
    helpers = sys.modules[block.__dict__[ORIGINAL].__module__]
    h, pad = _window_map(block, h, named)
    _, height_pad, width_pad, channels = h.shape
    size, shift = block.window_size, block.shift_size
    if shift > 0:
        h = torch.roll(h, shifts=(-shift, -shift), dims=(1, 2))
    windows = helpers.window_partition(h, size).view(-1, size * size, channels)
    mask = mask_of(block, height_pad, width_pad, windows)
    outputs = block.attention(windows, mask, output_attentions=named.get("output_attentions"))
    out = helpers.window_reverse(outputs[0].view(-1, size, size, channels), size, height_pad, width_pad)
    if shift > 0:
        out = torch.roll(out, shifts=(shift, shift), dims=(1, 2))
    return (_map_rows(out, pad, named), *outputs[1:])


def sam_window_attention(block: nn.Module, h, s, named: dict):
    """SAM's attention (ViTDet's), as its layer computes it: on the feature map cut into windows
    (padded to whole ones) where the layer has a window size, on the whole map otherwise, the
    windows then put back together."""
    if block.window_size > 0:
        height, width = h.shape[1], h.shape[2]
        h, padding = block.window_partition(h, block.window_size)
    out = block.attn(hidden_states=h)[0]
    if block.window_size > 0:
        out = block.window_unpartition(out, block.window_size, padding, (height, width))
    return out


# Llama 3.2 Vision's cross-attention layer: each output gated (the MLP's rows masked first), each a
# sublayer of its own (``Step.run``)
GATED_CROSS = (
    Step("cross_attn", "input_layernorm", run=gated_cross_attention),
    Step(
        "mlp",
        "post_attention_layernorm",
        run=gated_masked_mlp,
        call=(("full_text_row_masked_out_mask",) * 2,),
        kwargs=False,
    ),
)
# SAM's vision layer (and its copies): the attention in windows or global by layer (``Step.run``)
SAM = (Step("attn", "layer_norm1", run=sam_window_attention), Step("mlp", "layer_norm2"))
# Swin's layer: its attention on shifted windows of the stage's feature map (``Step.run``)
SWIN = (
    Step("attention", "layernorm_before", run=shifted_window_attention, drop_path="drop_path"),
    Step("mlp", "layernorm_after", dropout="dropout"),
)
# Donut's Swin layer: the same steps, its MLP's last dense layer and dropout in an output module run
# here instead (ViT's second step); MaskFormer's, the same with its mask's own signature
DONUT_SWIN = (dataclasses.replace(SWIN[0], run=rolled_window_attention), VIT_OUTPUT[1])
MASKFORMER_SWIN = (dataclasses.replace(SWIN[0], run=partial(rolled_window_attention, mask_of=mask_by_resolution)),)
MASKFORMER_SWIN += DONUT_SWIN[1:]


def nemotron_h(block: nn.Module, h, s, named: dict):
    """Nemotron-H's mixer (:attr:`Step.run`), called as its block calls the kind it holds: Mamba-2
    (without positions), attention (its weights dropped), or an MLP or MoE (``h`` alone)."""
    if block.block_type == "linear_attention":
        return block.mixer(h, **{k: v for k, v in named.items() if k not in ("position_ids", "use_cache")})
    if block.block_type == "full_attention":
        return block.mixer(hidden_states=h, **named)[0]
    return block.mixer(h)


def falcon(config) -> Family:
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


_ZAMBA_ARGS = ("original_hidden_states", "layer_idx", "attention_mask", "causal_mask", "cache", "use_cache")
_ZAMBA_ARGS += ("position_embeddings", "position_ids")


def zamba_hybrid(block: nn.Module, h, s, named: dict):
    """Zamba's hybrid layer (:attr:`Step.run`), as it computes it: the shared transformer on the
    stream (beside the word embeddings), projected, is added to what its Mamba layer's norm reads,
    but not to the stream; then that Mamba mixer, whose output the fused op adds to the stream.
    Zamba 2's shared transformer takes positions, Zamba's ``use_cache``."""
    a = {k: named.get(k) for k in _ZAMBA_ARGS}
    rest = {k: v for k, v in named.items() if k not in _ZAMBA_ARGS}  # the layer's **kwargs
    zamba2 = hasattr(block, "shared_transformer")
    positions = dict(position_embeddings=a["position_embeddings"]) if zamba2 else {}
    own = dict(positions, position_ids=a["position_ids"]) if zamba2 else dict(use_cache=a["use_cache"])
    shared = block.shared_transformer if zamba2 else block.shared_transf
    t = shared(
        s,
        original_hidden_states=a["original_hidden_states"],
        layer_idx=a["layer_idx"],
        attention_mask=a["causal_mask"],
        cache=a["cache"],
        **own,
        **rest,
    )
    decoder = block.mamba_decoder
    h = decoder.input_layernorm(s + block.linear(t))
    return decoder.mamba(hidden_states=h, cache=a["cache"], attention_mask=a["attention_mask"], **positions, **rest)


# Zamba and Zamba 2: Mamba layers, and the hybrid layers, which run their own Mamba layer's norm
# and mixer (:func:`zamba_hybrid`; a Mamba layer given the shared transformer's output, as only a
# hybrid layer's own forward gives it, runs its own forward)
ZAMBA = {
    **{
        hf_path(m, f"{c}MambaDecoderLayer"): Family(
            (Step("mamba", "input_layernorm"),),
            final="final_layernorm",
            fallback=("transformer_hidden_states",),
            drop=("original_hidden_states", "layer_idx", "causal_mask", "use_cache", "position_ids"),
        )
        for m, c in [("zamba", "Zamba"), ("zamba2", "Zamba2")]
    },
    **{
        hf_path(m, f"{c}HybridLayer"): Family(
            (Step(f"{shared} linear mamba_decoder.mamba", run=zamba_hybrid),), final="final_layernorm"
        )
        for m, c, shared in [("zamba", "Zamba", "shared_transf"), ("zamba2", "Zamba2", "shared_transformer")]
    },
}
