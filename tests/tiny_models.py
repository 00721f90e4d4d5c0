"""Tiny randomly initialised models for integration tests: no downloads, a few ms per step."""

from __future__ import annotations

import io
import sys

import torch
from torch import nn

import addnorm

VOCAB, SEQ, WIDTH = 64, 8, 32


_VQ = dict(embed_dim=WIDTH, num_embeddings=16, base_channels=WIDTH, channel_multiplier=[1, 1], num_res_blocks=1)
_VQ |= dict(latent_channels=WIDTH, resolution=16, attn_resolutions=[])
_IMAGE_TOKEN = dict(vocabulary_map={"<image>": VOCAB - 1})  # (Chameleon's: never in the prompts here)
# DeepSeek-V3's multi-head latent attention with a sparse attention's indexer (GLM-5, Mistral Large 4):
# top-k of 4 of the 8 positions, the second layer reusing the first layer's choice
_DSA = dict(num_key_value_heads=4, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8)
_DSA |= dict(v_head_dim=8, n_group=1, topk_group=1, index_topk=4, index_head_dim=16, index_n_heads=2)
_DSA |= dict(indexer_types=["full", "shared"])
# Llama-shaped decoders: name -> (config class, model class, config arguments beyond the common ones)
DECODERS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=2, num_experts_per_tok=1)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(residual_multiplier=0.3)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=WIDTH, shared_expert_intermediate_size=WIDTH),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=WIDTH),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", dict(num_experts=2, num_experts_per_tok=1)),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=2, num_experts_per_tok=1)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
    "ministral": ("MinistralConfig", "MinistralForCausalLM", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(residual_dropout=0.0, embedding_dropout=0.0)),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(attention_dropout=0.0, residual_dropout=0.0)),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {}),
    "nanochat": ("NanoChatConfig", "NanoChatForCausalLM", {}),  # Llama's layer, norms without a weight
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", {}),  # LayerNorm with weight + 1
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {}),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1, moe_intermediate_size=WIDTH)
        | dict(num_key_value_heads=4, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8)
        | dict(v_head_dim=8, n_group=1, topk_group=1),
    ),
    "glm_moe_dsa": (  # GLM-5: DeepSeek-V3's layer with a sparse attention's indexer; the second
        # layer reuses the first one's top-k indices, which the first layer returns
        "GlmMoeDsaConfig",
        "GlmMoeDsaForCausalLM",
        _DSA | dict(n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1, moe_intermediate_size=WIDTH),
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1, moe_intermediate_size=WIDTH)
        | dict(n_group=1, topk_group=1),
    ),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=2, num_experts_per_tok=1)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {}),
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(num_local_experts=2, num_experts_per_tok=1, residual_multiplier=0.3),
    ),
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",  # the second layer a mixture of experts
        dict(intermediate_size_mlp=2 * WIDTH, num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2),
    ),
    "qwen3_next": (  # a linear-attention layer, then a full-attention one
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4, linear_num_key_heads=2)
        | dict(linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1)
        | dict(moe_intermediate_size=WIDTH, shared_expert_intermediate_size=WIDTH),
    ),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {}),
    "qwen3_5": (  # Qwen3-Next's layers without the MoE
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4, linear_num_key_heads=2)
        | dict(linear_key_head_dim=8, linear_value_head_dim=8),
    ),
    # Llama's layer with its norms named otherwise, a residual scale, dropout or sandwich norms
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {}),
    "apertus1p5": ("Apertus1p5TextConfig", "Apertus1p5TextForCausalLM", {}),
    "vaultgemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM", {}),
    **{  # (its image tokenizer a VQ-VAE, tiny too)
        name: (
            "ChameleonConfig",
            "ChameleonForConditionalGeneration",
            dict(vq_config=_VQ, swin_norm=swin) | _IMAGE_TOKEN,
        )
        for name, swin in [("chameleon", False), ("chameleon_swin", True)]
    },
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(hidden_size_per_layer_input=0)),
    "gemma4_ple": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(hidden_size_per_layer_input=8)),  # per-layer inputs
    "gemma4_moe": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=2, top_k_experts=1)
        | dict(moe_intermediate_size=WIDTH),
    ),
    "gemma4_unified": ("Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM", {}),
    "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM", dict(num_local_experts=2, num_experts_per_tok=1, kv_channels=8)),
    "minicpm3": (
        "MiniCPM3Config",
        "MiniCPM3ForCausalLM",
        dict(
            q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_key_value_heads=4
        ),
    ),
    "emu3": ("Emu3TextConfig", "Emu3ForCausalLM", dict(attention_dropout=0.0, num_key_value_heads=4)),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", dict(hidden_dropout=0.0, attention_dropout=0.0)),
    "hyperclovax": ("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", dict(residual_multiplier=0.3)),
    "biogpt": ("BioGptConfig", "BioGptForCausalLM", dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "modernbert_decoder": (
        "ModernBertDecoderConfig",
        "ModernBertDecoderForCausalLM",
        dict(global_attn_every_n_layers=2, local_attention=4),
    ),
    "mllama": ("MllamaTextConfig", "MllamaForCausalLM", dict(cross_attention_layers=[1])),  # the second: gated
    # a short convolution, then an attention layer
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(layer_types=["conv", "full_attention"])),
    "lfm2_moe": (
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        dict(layer_types=["conv", "full_attention"], num_experts=2, num_experts_per_tok=1)
        | dict(moe_intermediate_size=WIDTH, num_dense_layers=1),
    ),
    "lfm3": ("Lfm3Config", "Lfm3ForCausalLM", dict(layer_types=["conv", "full_attention"])),  # sandwich norms
    # the experts and a shared MLP, their outputs summed; Granite 4: Mamba, then attention
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        "GraniteMoeSharedForCausalLM",
        dict(num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=WIDTH, residual_multiplier=0.3),
    ),
    "zamba": (  # Mamba layers, and two hybrid layers sharing one transformer (a hybrid layer's is tied)
        "ZambaConfig",
        "ZambaForCausalLM",
        dict(num_hidden_layers=5, layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "mamba"])
        | dict(mamba_d_state=4, n_mamba_heads=2, mamba_dt_rank=4, attention_hidden_size=2 * WIDTH),
    ),
    "zamba2": (  # Mamba layers, a hybrid layer second
        "Zamba2Config",
        "Zamba2ForCausalLM",
        dict(num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "mamba"])
        | dict(mamba_d_state=4, n_mamba_heads=8, chunk_size=4),
    ),
    "jamba": (  # a Mamba layer, then an attention layer with experts
        "JambaConfig",
        "JambaForCausalLM",
        dict(num_experts=2, num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1)
        | dict(attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_dt_rank=4, use_mamba_kernels=False)
        | dict(num_key_value_heads=4),
    ),
    "kimi_linear": (  # linear, then full attention
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"], num_experts=2)
        | dict(num_experts_per_token=1, moe_intermediate_size=WIDTH, linear_head_dim=8, linear_num_heads=4)
        | dict(num_shared_experts=1, num_key_value_heads=4),
    ),
    "afmoe": (  # sandwich norms
        "AfmoeConfig",
        "AfmoeForCausalLM",
        dict(
            num_dense_layers=1, num_experts=2, num_experts_per_tok=1, num_shared_experts=1, moe_intermediate_size=WIDTH
        )
        | dict(layer_types=["sliding_attention", "full_attention"], global_attn_every_n_layers=2),
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=WIDTH, residual_multiplier=0.3)
        | dict(layers_block_type=["linear_attention", "full_attention"], mamba_n_heads=4, mamba_d_head=16)
        | dict(mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=4),
    ),
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8)
        | dict(mamba_chunk_size=4),
    ),
    "minimax": (  # lightning and full attention, the residuals and outputs scaled away from 1
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        dict(num_local_experts=2, num_experts_per_tok=1, layer_types=["linear_attention", "full_attention"])
        | dict(block_size=4, full_attn_alpha_factor=1.7, full_attn_beta_factor=0.8, linear_attn_alpha_factor=1.3)
        | dict(linear_attn_beta_factor=0.9, mlp_alpha_factor=1.6, mlp_beta_factor=0.7),
    ),
    "olmo_hybrid": (
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        dict(layer_types=["linear_attention", "full_attention"]),
    ),
    "doge": ("DogeConfig", "DogeForCausalLM", dict(hidden_dropout=0.0)),  # the stream scaled per channel
    "doge_moe": (
        "DogeConfig",
        "DogeForCausalLM",
        dict(hidden_dropout=0.0, is_moe=True, num_experts=4, num_experts_per_tok=2),
    ),
    "recurrent_gemma": (  # a recurrent layer, then a local attention one
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        dict(block_types=["recurrent", "attention"], lru_width=WIDTH, attention_window_size=4, conv1d_width=2),
    ),
    "nemotron_h": (  # each kind of mixer once
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], num_hidden_layers=4)
        | dict(mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=8, chunk_size=4)
        | dict(n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=WIDTH)
        | dict(moe_shared_expert_intermediate_size=WIDTH),
    ),
    "falcon_h1": (  # its mixer's multipliers away from 1
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(mamba_d_ssm=WIDTH, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8)
        | dict(mamba_chunk_size=4, attention_in_multiplier=0.7, ssm_out_multiplier=1.3, attention_out_multiplier=0.6),
    ),
}
SMALL = dict(num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=4)
_ENCODER = dict(**SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_IMAGE = dict(**_ENCODER, image_size=8, patch_size=4, num_channels=3, num_labels=5)
# Swin (and its older forms, Donut's and MaskFormer's): two stages of two layers on a 4 x 4 patch
# grid, windows of 2 x 2, each stage's second layer shifted
SWIN = dict(image_size=8, patch_size=2, num_channels=3, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=2)
_VISION = dict(**SMALL, image_size=8, patch_size=4, num_channels=3)
# Parakeet's Conformer encoder (Canary's, Nemotron's streaming one): 16 log-mel bins, time subsampled by 4
CONFORMER_ENCODER = dict(SMALL, num_mel_bins=16, subsampling_conv_channels=8, subsampling_factor=4, conv_kernel_size=3)
CONFORMER_ENCODER |= dict(dropout=0.0, activation_dropout=0.0, attention_dropout=0.0, layerdrop=0.0)
# wav2vec 2.0's kind: its layers without dropout, masking or LayerDrop, and its feature encoder
_SPEECH_LAYERS = dict(SMALL, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0)
_SPEECH_LAYERS |= dict(mask_time_prob=0.0, layerdrop=0.0, vocab_size=16, pad_token_id=0)
_WAV2VEC2_FEATURES = dict(conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3))
_WAV2VEC2_FEATURES |= dict(num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4)
_IDS = dict(bos_token_id=0, eos_token_id=0)
_GEMMA_TEXT = dict(**SMALL, num_key_value_heads=2, head_dim=WIDTH // 4, vocab_size=VOCAB)
_TOWER = dict(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=1, num_attention_heads=4)
_TOWER |= dict(image_size=8, patch_size=4)
_SEQ2SEQ = dict(
    vocab_size=VOCAB, d_model=WIDTH, encoder_layers=2, decoder_layers=2, pad_token_id=0, dropout=0.0, **_IDS
) | dict(encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH)
# other layouts: name -> (config class, model class, config arguments)
_MOSHI = dict(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8)
_MOSHI |= dict(ffn_dim=2 * WIDTH, max_position_embeddings=SEQ, sliding_window=SEQ, audio_vocab_size=16, num_codebooks=2)
_MIMI = dict(hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=8)
_MIMI |= dict(intermediate_size=2 * WIDTH, codebook_dim=8, codebook_size=16, num_quantizers=2, num_filters=4)
_MIMI |= dict(upsampling_ratios=[2], upsample_groups=WIDTH, sliding_window=SEQ)
OTHERS = {
    "esmc": (  # a protein language model: pre-norm, each output divided by a constant before its add
        "EsmcConfig",
        "EsmcForMaskedLM",
        dict(SMALL, vocab_size=VOCAB, max_position_embeddings=SEQ, pad_token_id=1, mask_token_id=VOCAB - 1),
    ),
    "kyutai_stt": (  # text and audio tokens summed into one stream; the codec's Mimi layers left plain
        "KyutaiSpeechToTextConfig",
        "KyutaiSpeechToTextForConditionalGeneration",
        dict(_MOSHI, codebook_vocab_size=16, vocab_size=VOCAB, codec_config=_MIMI, **_IDS)
        | dict(audio_bos_token_id=15, audio_pad_token_id=VOCAB + 32, pad_token_id=0),
    ),
    "moshi": (  # its text decoder (the depth decoder: test_patch_families.py)
        "MoshiConfig",
        "MoshiForCausalLM",
        dict(
            vocab_size=VOCAB,
            **_MOSHI,
            depth_decoder_config=dict(_MOSHI, vocab_size=VOCAB, input_size=WIDTH),
            audio_encoder_config=_MIMI,
        ),
    ),
    "mistral_large4": (  # its text model (MoE, sparse attention) and a Pixtral vision tower
        "MistralLarge4Config",
        "MistralLarge4ForConditionalGeneration",
        dict(
            text_config=SMALL
            | _DSA
            | dict(head_dim=WIDTH // 4, vocab_size=VOCAB, max_position_embeddings=SEQ, pad_token_id=0, **_IDS)
            | dict(n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1, moe_intermediate_size=WIDTH),
            vision_config=_VISION | dict(num_hidden_layers=1, head_dim=WIDTH // 4),
            image_token_index=VOCAB - 1,
        ),
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_layer=2, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=SEQ, **_IDS)
        | dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    ),
    "mpt": (  # its MLP module adds the stream itself; norms without a bias
        "MptConfig",
        "MptForCausalLM",
        dict(d_model=WIDTH, n_heads=4, n_layers=2, vocab_size=VOCAB, max_seq_len=SEQ, **_IDS),
    ),
    "bert": ("BertConfig", "BertForMaskedLM", dict(**_ENCODER, vocab_size=VOCAB, max_position_embeddings=SEQ)),
    **{  # post-norm embedding models (RoPE, gated MLP), each add then its norm in the layer itself
        name: (f"{c}Config", f"{c}ForMaskedLM", dict(**_ENCODER, vocab_size=VOCAB, max_position_embeddings=SEQ))
        for name, c in [("gte", "Gte"), ("nomic_bert", "NomicBert"), ("jina_embeddings_v3", "JinaEmbeddingsV3")]
    },
    "longcat_flash": (  # two of Llama's layers in one (MLA), a shortcut MoE beside the first MLP
        "LongcatFlashConfig",
        "LongcatFlashForCausalLM",
        dict(vocab_size=VOCAB, hidden_size=WIDTH, num_layers=2, num_attention_heads=4, num_key_value_heads=4)
        | dict(max_position_embeddings=16, ffn_hidden_size=2 * WIDTH, q_lora_rank=8, kv_lora_rank=8, head_dim=8)
        | dict(qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, expert_ffn_hidden_size=WIDTH, **_IDS)
        | dict(moe_topk=2, n_routed_experts=2, zero_expert_num=1, pad_token_id=0),  # (transformers fails at top-1)
    ),
    "dbrx": (  # its attention and both norms inside one module; two experts (its qkv clipped: transformers
        # fails without a clip)
        "DbrxConfig",
        "DbrxForCausalLM",
        dict(d_model=WIDTH, n_heads=4, n_layers=2, max_seq_len=SEQ, vocab_size=VOCAB, resid_pdrop=0.0, emb_pdrop=0.0)
        | dict(attn_config=dict(kv_n_heads=2, attn_pdrop=0.0, rope_theta=10000.0, clip_qkv=8.0), **_IDS)
        | dict(ffn_config=dict(ffn_hidden_size=2 * WIDTH, moe_num_experts=2, moe_top_k=1), pad_token_id=0),
    ),
    "openai_privacy_filter": (  # GPT-OSS's layer (MoE, sliding window) as a token classifier
        "OpenAIPrivacyFilterConfig",
        "OpenAIPrivacyFilterForTokenClassification",
        dict(num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=WIDTH, head_dim=8, num_attention_heads=4)
        | dict(num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1, sliding_window=4, vocab_size=VOCAB)
        | dict(max_position_embeddings=16, pad_token_id=0, eos_token_id=0, num_labels=VOCAB),
    ),
    "modernbert": (  # local attention in its first layer (an identity for its attention norm), global in its second
        "ModernBertConfig",
        "ModernBertForMaskedLM",
        dict(**SMALL, vocab_size=VOCAB, max_position_embeddings=SEQ, global_attn_every_n_layers=2, local_attention=4)
        | dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2),
    ),
    "distilbert": (
        "DistilBertConfig",
        "DistilBertForMaskedLM",
        dict(dim=WIDTH, hidden_dim=2 * WIDTH, n_layers=2, n_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ)
        | dict(dropout=0.0, attention_dropout=0.0, pad_token_id=0),
    ),
    "roberta": (
        "RobertaConfig",
        "RobertaForMaskedLM",
        dict(**_ENCODER, vocab_size=VOCAB, max_position_embeddings=SEQ + 2, pad_token_id=1),
    ),
    "deberta": ("DebertaConfig", "DebertaForMaskedLM", dict(**_ENCODER, vocab_size=VOCAB, max_position_embeddings=SEQ)),
    "vit": ("ViTConfig", "ViTForImageClassification", _IMAGE),
    "beit": (  # a learned scale per channel, relative position bias, its final norm on every token
        "BeitConfig",
        "BeitForImageClassification",
        dict(**_IMAGE, layer_scale_init_value=0.5, use_relative_position_bias=True, use_mean_pooling=False)
        | dict(drop_path_rate=0.0),
    ),
    "dinov2": ("Dinov2Config", "Dinov2ForImageClassification", dict(**_IMAGE, layerscale_value=0.5)),
    "swin": (
        "SwinConfig",
        "SwinForImageClassification",
        SWIN | dict(num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0),
    ),
    **{
        name: (
            "GPTNeoXConfig",
            "GPTNeoXForCausalLM",
            dict(**SMALL, vocab_size=VOCAB, max_position_embeddings=SEQ, use_parallel_residual=parallel, **_IDS)
            | dict(hidden_dropout=0.0, attention_dropout=0.0),
        )
        for name, parallel in [("gpt_neox", True), ("gpt_neox_sequential", False)]
    },
    **{
        name: (
            f"{prefix}Config",
            f"{prefix}ForImageClassification",
            dict(
                vision_config=_VISION,
                text_config=dict(**SMALL, vocab_size=VOCAB, max_position_embeddings=SEQ),
                num_labels=5,
            ),
        )
        for name, prefix in [("clip", "CLIP"), ("siglip", "Siglip")]
    },
    **{
        name: (
            "OPTConfig",
            "OPTForCausalLM",
            dict(hidden_size=WIDTH, num_hidden_layers=2, ffn_dim=2 * WIDTH, num_attention_heads=4, vocab_size=VOCAB)
            | dict(max_position_embeddings=SEQ, word_embed_proj_dim=WIDTH, dropout=0.0, **_IDS)
            | dict(do_layer_norm_before=before),
        )
        for name, before in [("opt", True), ("opt_350m", False)]  # OPT-350m: a norm after each add
    },
    **{
        name: (
            f"{prefix}Config",
            f"{prefix}ForCausalLM",
            dict(num_hidden_layers=2, hidden_size=WIDTH, vocab_size=VOCAB) | extra,
        )
        for name, prefix, extra in [
            ("mamba", "Mamba", dict(state_size=4, time_step_rank=4)),
            ("mamba2", "Mamba2", dict(state_size=4, num_heads=4, head_dim=16, n_groups=1, chunk_size=4)),
            ("falcon_mamba", "FalconMamba", dict(state_size=4, time_step_rank=4)),
        ]
    },
    "whisper": (
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        dict(_SEQ2SEQ, num_mel_bins=8, max_source_positions=SEQ, max_target_positions=SEQ, decoder_start_token_id=0),
    ),
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", dict(_SEQ2SEQ, max_position_embeddings=SEQ)),
    "xglm": (  # Whisper's decoder layer without cross-attention
        "XGLMConfig",
        "XGLMForCausalLM",
        dict(vocab_size=VOCAB, d_model=WIDTH, num_layers=2, attention_heads=4, ffn_dim=2 * WIDTH)
        | dict(max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, **_IDS),
    ),
    **{
        name: (
            f"{prefix}Config",
            model,
            dict(_SEQ2SEQ, max_position_embeddings=SEQ, decoder_start_token_id=0),
        )
        for name, prefix, model in [
            ("bart", "Bart", "BartForConditionalGeneration"),
            ("marian", "Marian", "MarianMTModel"),
        ]
    },
    # BART's layers as first written, returning their attentions' weights: MVP's (each attention
    # given a prompt), TrOCR's decoder (reading image states), LED's encoder (local and global
    # attention: 4 positions each side) and SpeechT5's speech-to-text encoder and decoder
    "mvp": (
        "MvpConfig",
        "MvpForConditionalGeneration",
        dict(_SEQ2SEQ, max_position_embeddings=SEQ, decoder_start_token_id=0)
        | dict(use_prompt=True, prompt_length=3, prompt_mid_dim=16),
    ),
    "trocr": (
        "TrOCRConfig",
        "TrOCRForCausalLM",
        dict(vocab_size=VOCAB, d_model=WIDTH, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=2 * WIDTH)
        | dict(max_position_embeddings=SEQ, cross_attention_hidden_size=16, dropout=0.0, pad_token_id=0, **_IDS),
    ),
    "led": (
        "LEDConfig",
        "LEDForConditionalGeneration",
        dict(_SEQ2SEQ, max_encoder_position_embeddings=16, max_decoder_position_embeddings=SEQ, attention_window=4)
        | dict(decoder_start_token_id=0),
    ),
    # Llama's layer with a cross-attention step between: SeamlessM4T's text encoder-decoder
    # (dropout modules) and Canary's decoder over a Parakeet encoder (log-mel features)
    "seamless_m4t": (
        "SeamlessM4TConfig",
        "SeamlessM4TForTextToText",
        dict(vocab_size=VOCAB, t2u_vocab_size=VOCAB, hidden_size=WIDTH, encoder_layers=2, decoder_layers=2)
        | dict(
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH
        )
        | dict(max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2)
        | dict(
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0
        ),
    ),
    "parakeet": (  # a Conformer encoder (the Canary's) with a CTC head
        "ParakeetCTCConfig",
        "ParakeetForCTC",
        dict(vocab_size=VOCAB, pad_token_id=0, encoder_config=CONFORMER_ENCODER),
    ),
    "lasr": (  # Parakeet's encoder with weighted adds (MedASR's), its own subsampling
        "LasrCTCConfig",
        "LasrForCTC",
        dict(vocab_size=VOCAB, pad_token_id=0, encoder_config=CONFORMER_ENCODER | dict(num_hidden_layers=2)),
    ),
    "canary": (
        "CanaryConfig",
        "CanaryForConditionalGeneration",
        dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
        | dict(
            encoder_config=CONFORMER_ENCODER | dict(num_hidden_layers=1, num_key_value_heads=4),
            decoder_config=dict(
                **SMALL, num_key_value_heads=4, head_dim=8, vocab_size=VOCAB, max_position_embeddings=16
            )
            | dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
        ),
    ),
    "dia": (  # text in, two channels of audio codes out
        "DiaConfig",
        "DiaForConditionalGeneration",
        dict(pad_token_id=VOCAB - 1, eos_token_id=VOCAB - 2, bos_token_id=VOCAB - 3, delay_pattern=[0, 1])
        | dict(
            encoder_config=dict(
                **SMALL, num_key_value_heads=4, head_dim=8, vocab_size=VOCAB, max_position_embeddings=16
            ),
            decoder_config=dict(
                **SMALL, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=16
            )
            | dict(cross_num_attention_heads=4, cross_head_dim=8, cross_num_key_value_heads=4, cross_hidden_size=WIDTH)
            | dict(num_channels=2),
        ),
    ),
    "musicgen_melody": (  # two codebooks: each prompt's rows one per codebook
        "MusicgenMelodyDecoderConfig",
        "MusicgenMelodyForCausalLM",
        dict(
            vocab_size=VOCAB, max_position_embeddings=16, num_hidden_layers=2, ffn_dim=2 * WIDTH, num_attention_heads=4
        )
        | dict(hidden_size=WIDTH, num_codebooks=2, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
        | dict(layerdrop=0.0, pad_token_id=VOCAB - 1, bos_token_id=VOCAB - 2),
    ),
    "nllb_moe": (  # a dense layer, then a sparse one (two experts), in the encoder and the decoder
        "NllbMoeConfig",
        "NllbMoeForConditionalGeneration",
        dict(_SEQ2SEQ, max_position_embeddings=SEQ, decoder_start_token_id=0, num_experts=2, expert_capacity=16)
        | dict(encoder_sparse_step=2, decoder_sparse_step=2, moe_token_dropout=0.0, attention_dropout=0.0)
        | dict(encoder_layerdrop=0.0, decoder_layerdrop=0.0),
    ),
    "bigbird_pegasus": (  # full attention (block-sparse needs longer rows)
        "BigBirdPegasusConfig",
        "BigBirdPegasusForConditionalGeneration",
        dict(_SEQ2SEQ, max_position_embeddings=SEQ, decoder_start_token_id=0, attention_type="original_full"),
    ),
    "prophetnet": (  # its encoder post-norm (its n-gram decoder's layers run their own forward)
        "ProphetNetConfig",
        "ProphetNetForConditionalGeneration",
        dict(vocab_size=VOCAB, hidden_size=WIDTH, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH, ngram=2)
        | dict(num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4, num_decoder_attention_heads=4)
        | dict(max_position_embeddings=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
        | dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=0),
    ),
    "speecht5": (
        "SpeechT5Config",
        "SpeechT5ForSpeechToText",
        dict(vocab_size=16, hidden_size=WIDTH, encoder_layers=2, decoder_layers=2, pad_token_id=0)
        | dict(
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH
        )
        | dict(conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), encoder_max_relative_position=8)
        | dict(num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, mask_time_prob=0.0, max_text_positions=SEQ)
        | dict(hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0)
        | dict(positional_dropout=0.0, speech_decoder_prenet_dropout=0.0, decoder_start_token_id=1)
        | dict(encoder_layerdrop=0.0, decoder_layerdrop=0.0),
    ),
    "blip": (  # its vision encoder (CLIP's steps) and a BERT-style text decoder reading it
        "BlipConfig",
        "BlipForConditionalGeneration",
        dict(vision_config=_VISION, text_config=dict(**SMALL, vocab_size=VOCAB, max_position_embeddings=SEQ)),
    ),
    **{  # speech encoders, post-norm (each norm after its add) or pre-norm (``do_stable_layer_norm``);
        # WavLM's with its relative position bias
        name: (
            f"{prefix}Config",
            f"{prefix}ForCTC",
            _SPEECH_LAYERS
            | _WAV2VEC2_FEATURES
            | dict(do_stable_layer_norm=stable)
            | (dict(num_buckets=8, max_bucket_distance=16) if prefix == "WavLM" else {}),
        )
        for name, prefix, stable in [
            ("wav2vec2", "Wav2Vec2", False),
            ("hubert", "Hubert", False),
            ("wav2vec2_stable", "Wav2Vec2", True),
            ("hubert_stable", "Hubert", True),
            ("wavlm", "WavLM", False),
            ("wavlm_stable", "WavLM", True),
        ]
    },
    "wav2vec2_conformer": (  # Conformer layers on wav2vec 2.0's feature encoder (relative positions)
        "Wav2Vec2ConformerConfig",
        "Wav2Vec2ConformerForCTC",
        _SPEECH_LAYERS
        | _WAV2VEC2_FEATURES
        | dict(position_embeddings_type="relative", conv_depthwise_kernel_size=3, conformer_conv_dropout=0.0),
    ),
    "wav2vec2_bert": (  # Conformer layers on log-mel features (SeamlessM4T's speech encoder)
        "Wav2Vec2BertConfig",
        "Wav2Vec2BertForCTC",
        _SPEECH_LAYERS
        | dict(feature_projection_input_dim=16, conv_depthwise_kernel_size=3, conformer_conv_dropout=0.0),
    ),
    "t5gemma": (  # sandwich norms and dropout; the decoder's self-attention and cross-attention
        "T5GemmaConfig",
        "T5GemmaForConditionalGeneration",
        dict(vocab_size=VOCAB, dropout_rate=0.0, attention_dropout=0.0, pad_token_id=0, **_IDS)
        | {
            side: dict(**SMALL, num_key_value_heads=2, head_dim=WIDTH // 4, vocab_size=VOCAB)
            for side in ("encoder", "decoder")
        },
    ),
    "t5gemma2": (  # its text encoder, decoder (one merged attention) and SigLIP vision tower
        "T5Gemma2Config",
        "T5Gemma2ForConditionalGeneration",
        dict(dropout_rate=0.0, attention_dropout=0.0, image_token_index=VOCAB - 1, pad_token_id=0, **_IDS)
        | dict(
            encoder=dict(text_config=_GEMMA_TEXT, vision_config=_TOWER, mm_tokens_per_image=1),
            decoder=_GEMMA_TEXT,
        ),
    ),
    "bloom": (
        "BloomConfig",
        "BloomForCausalLM",
        dict(hidden_size=WIDTH, n_layer=2, n_head=4, vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0)
        | _IDS,
    ),
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        dict(n_layer=2, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=SEQ, **_IDS)
        | dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    ),
    "phi": (
        "PhiConfig",
        "PhiForCausalLM",
        dict(**SMALL, vocab_size=VOCAB, max_position_embeddings=SEQ, **_IDS)
        | dict(resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    ),
    **{
        name: (
            "StableLmConfig",
            "StableLmForCausalLM",
            dict(**SMALL, vocab_size=VOCAB, max_position_embeddings=SEQ, use_parallel_residual=parallel, **_IDS)
            | dict(num_key_value_heads=4, hidden_dropout=0.0, attention_dropout=0.0),
        )
        for name, parallel in [("stablelm", False), ("stablelm_parallel", True)]
    },
    "gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        dict(n_layer=2, n_embd=WIDTH, n_head=4, rotary_dim=4, vocab_size=VOCAB, n_positions=SEQ, **_IDS)
        | dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    ),
    **{
        name: (
            "FalconConfig",
            "FalconForCausalLM",
            dict(num_hidden_layers=2, hidden_size=WIDTH, num_attention_heads=4, vocab_size=VOCAB, **_IDS)
            | dict(hidden_dropout=0.0, attention_dropout=0.0, **layout),
        )
        for name, layout in [
            ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),  # two norms, in parallel
            ("falcon_7b", dict(new_decoder_architecture=False, parallel_attn=True, multi_query=True)),
            ("falcon_rw", dict(new_decoder_architecture=False, parallel_attn=False, alibi=True)),
        ]
    },
    **{
        name: (
            f"{prefix}Config",
            f"{prefix}ForConditionalGeneration",
            dict(d_model=WIDTH, d_ff=2 * WIDTH, d_kv=WIDTH // 4, num_layers=2, num_heads=4, vocab_size=VOCAB)
            | dict(dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
        )
        for name, prefix in [("t5", "T5"), ("mt5", "MT5")]
    },
}
IMAGES = ("vit", "beit", "dinov2", "swin", "clip", "siglip")
SPEECH = ("wav2vec2", "hubert", "wav2vec2_stable", "hubert_stable", "wavlm", "wavlm_stable", "speecht5")
SPEECH += ("wav2vec2_conformer",)


def hf_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0, dropout: float = 0.0) -> nn.Module:
    """A 2-layer Hugging Face model (no dropout unless ``dropout``: then every ``nn.Dropout`` has
    that probability), with its norm weights moved away from their init so that a wrong weight,
    offset or bias shows in the outputs."""
    import transformers as tf

    torch.manual_seed(seed)
    if name in DECODERS:
        config_cls, model_cls, extra = DECODERS[name]
        common = dict(
            **SMALL, num_key_value_heads=2, head_dim=WIDTH // 4, vocab_size=VOCAB, max_position_embeddings=SEQ
        )
        config = getattr(tf, config_cls)(**(common | dict(bos_token_id=0, eos_token_id=0, pad_token_id=0) | extra))
        model = getattr(tf, model_cls)(config)
    elif name in OTHERS:
        config_cls, model_cls, extra = OTHERS[name]
        model = getattr(tf, model_cls)(getattr(tf, config_cls)(**extra))
    else:
        raise ValueError(name)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = dropout
    if name.startswith("falcon"):  # applied from the config, not by modules
        model.config.hidden_dropout = model.config.attention_dropout = dropout
    for m in model.modules():  # (OPT, Whisper: a float attribute of each layer, applied by F.dropout)
        if type(m).__name__.endswith("Layer") and isinstance(getattr(m, "dropout", None), float):
            m.dropout = dropout
        if isinstance(getattr(m, "hidden_dropout", None), float):  # (BLOOM's attention and MLP)
            m.hidden_dropout = dropout
    with torch.no_grad():
        for n, p in model.named_parameters():  # (and BEiT's relative position biases, zeros at init)
            if p.dim() == 1 or n.endswith("relative_position_bias_table"):
                p.add_(torch.randn_like(p) * 0.3)
        for m in model.modules():  # (Gemma 4's scale of each layer's output: a buffer, ones at init)
            if isinstance(getattr(m, "layer_scalar", None), torch.Tensor):
                m.layer_scalar.mul_(0.5 + torch.rand(()))
    return model.to(dtype).train()


def hf_inputs(name: str, dtype: torch.dtype = torch.float32, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    if name in IMAGES:
        return dict(
            pixel_values=torch.randn(2, 3, 8, 8, generator=g).to(dtype), labels=torch.randint(0, 5, (2,), generator=g)
        )
    if name in SPEECH:  # 400 samples (7 encoder positions), 5 CTC labels
        return dict(
            input_values=torch.randn(2, 400, generator=g).to(dtype), labels=torch.randint(1, 16, (2, 5), generator=g)
        )
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    if name == "t5gemma2":  # one image per prompt, its one token (VOCAB - 1) second
        ids = torch.randint(0, VOCAB - 1, (2, SEQ), generator=g)
        image, ids[:, 1] = torch.randn(2, 3, 8, 8, generator=g).to(dtype), VOCAB - 1
        return dict(input_ids=ids, pixel_values=image, labels=torch.randint(0, VOCAB - 1, (2, SEQ), generator=g))
    if name == "kyutai_stt":  # a text token and two codebooks' audio tokens per position
        ids = torch.randint(0, 16, (2, SEQ, 3), generator=g)
        return dict(input_ids=ids, labels=ids[..., 0])
    if name == "mistral_large4":  # one image per prompt (4 patches merged into one token, VOCAB - 1) second
        ids = torch.randint(0, VOCAB - 1, (2, SEQ), generator=g)
        ids[:, 1] = VOCAB - 1
        image = torch.randn(2, 3, 8, 8, generator=g).to(dtype)
        return dict(input_ids=ids, pixel_values=image, image_sizes=torch.tensor([[8, 8]] * 2), labels=ids)
    if name == "mllama":  # five image states per prompt: the first prompt's last two masked out, the
        # second prompt's first two text rows attending to no image (their cross-attention MLP rows zeroed)
        mask = torch.zeros(2, 1, SEQ, 5)
        mask[0, ..., 3:] = torch.finfo(torch.float32).min
        rows = torch.ones(2, 1, SEQ, 1)
        rows[1, :, :2] = 0
        states = torch.randn(2, 5, WIDTH, generator=g).to(dtype)
        image = dict(
            cross_attention_states=states, cross_attention_mask=mask.to(dtype), full_text_row_masked_out_mask=rows
        )
        return dict(input_ids=ids, labels=ids, **image)
    if name == "blip":  # an image and its caption
        return dict(pixel_values=torch.randn(2, 3, 8, 8, generator=g).to(dtype), input_ids=ids, labels=ids)
    if name == "dia":  # text, and its audio codes in two channels
        codes = torch.randint(0, VOCAB - 3, (2, SEQ, 2), generator=g)
        return dict(input_ids=ids % (VOCAB - 3), decoder_input_ids=codes, labels=codes)
    if name == "musicgen_melody":  # each prompt's codes, one row per codebook; labels (prompt, position, codebook)
        codes = torch.randint(0, VOCAB - 2, (2, 2, SEQ), generator=g)
        return dict(input_ids=codes.reshape(4, SEQ), labels=codes.transpose(1, 2))
    if name == "wav2vec2_bert":  # 8 frames of 16 features (stacked log-mel bins), the second clip's last 2 padding
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, 6:] = 0
        features = torch.randn(2, 8, 16, generator=g).to(dtype)
        return dict(input_features=features, attention_mask=mask, labels=torch.randint(1, 16, (2, 5), generator=g))
    if name == "canary":  # 32 frames of 16 log-mel bins (8 encoder positions)
        return dict(input_features=torch.randn(2, 32, 16, generator=g).to(dtype), labels=ids)
    if name in ("parakeet", "lasr"):  # the same frames, the second clip's last 8 padding; 5 CTC labels
        mask = torch.ones(2, 32, dtype=torch.long)
        mask[1, 24:] = 0
        features = torch.randn(2, 32, 16, generator=g).to(dtype)
        return dict(input_features=features, attention_mask=mask, labels=torch.randint(1, VOCAB, (2, 5), generator=g))
    if name == "trocr":  # five image states of width 16 for its cross-attention
        return dict(input_ids=ids, labels=ids, encoder_hidden_states=torch.randn(2, 5, 16, generator=g).to(dtype))
    if name == "whisper":  # log-mel features: 8 bins, two frames per encoder position
        return dict(input_features=torch.randn(2, 8, 2 * SEQ, generator=g).to(dtype), labels=ids[:, :5])
    return dict(input_ids=ids, labels=ids)


class Block(nn.Module):
    """A pre-norm Transformer block built from plain torch layers and ``norm`` modules."""

    def __init__(self, width: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.norm1, self.norm2 = norm(width), norm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Embedding, two pre-norm blocks (LayerNorm and RMSNorm), an Add & Norm and a head."""

    def __init__(self, width: int = WIDTH, vocab: int = VOCAB, *, layer=addnorm.LayerNorm, rms=addnorm.RMSNorm):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width, layer), Block(width, rms)])
        self.add_norm = addnorm.AddNorm(width, norm="rms", eps=1e-6)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        h = x
        for block in self.blocks:
            h = block(h)
        return self.head(self.add_norm(h, x))


def step(model, inputs):
    """Forward and backward; returns (logits, {name: grad})."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out.logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(a, b, inputs, *, exact=False, exact_grads=None):
    """Logits and gradients of ``b`` match ``a``'s: bit for bit if ``exact`` (the gradients
    too unless ``exact_grads=False``), else within float32 rounding."""
    la, ga = step(a, inputs)
    lb, gb = step(b, inputs)
    assert ga.keys() == gb.keys() and len(ga) > 0
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lb, la, **tol)
    for name in ga:
        if exact_grads is False:  # bf16 rounding of sums: relative to the gradient's scale
            tol = dict(rtol=1.6e-2, atol=1.6e-2 * ga[name].abs().max().item())
        elif not exact:  # float32 rounding, at the gradient's scale where it exceeds 1 (a CTC loss's)
            tol = dict(rtol=1e-5, atol=1e-5 * max(1.0, ga[name].abs().max().item()))
        torch.testing.assert_close(gb[name], ga[name], **tol, msg=lambda m, n=name: f"grad of {n}: {m}")


def round_trip(model: nn.Module) -> nn.Module:
    """torch.save then torch.load, as in a fresh process: the classes patch() made are forgotten."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    cache = sys.modules["addnorm.patch"]._SUBCLASSES
    sys.modules["addnorm.patch"]._SUBCLASSES = {}  # a new process has made none of them yet
    try:
        return torch.load(buffer, weights_only=False)
    finally:
        sys.modules["addnorm.patch"]._SUBCLASSES = cache
