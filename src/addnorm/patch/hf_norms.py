"""The Hugging Face norm classes :func:`addnorm.patch` replaces by default, and the style each runs with
(:mod:`.norms`).

A class enters this table when it computes one of the styles exactly: tests/test_patch.py checks every
entry against the real class (the RMSNorm styles' outputs bit for bit in float32, bfloat16 and float16,
and with a weight and an input of different dtypes, where those styles differ; the LayerNorm styles',
"layer", "cohere", "olmo", "deberta", "nemotron" and "moonshine", within rounding, their mean and
variance summed in another order; gradients within float32 rounding). ESM C's ``EsmcLayerNorm``, a
``torch.nn.LayerNorm`` that casts its output to the input's dtype, is style "layer": addnorm's output
has that dtype already. An entry whose module the installed transformers lacks is never matched.
Other classes are left as they are and listed by the report;
``addnorm.patch(model, norm_types={MyNorm: "llama"})`` adds one.
"""

from __future__ import annotations

# style -> "model.Class" entries, each for transformers.models.<model>.modeling_<model>.<Class>
_BY_STYLE = {
    "llama": """
    aimv2.Aimv2RMSNorm apertus.ApertusRMSNorm apertus1p5.Apertus1p5TextRMSNorm arcee.ArceeRMSNorm
    aria.AriaTextRMSNorm axk1.AXK1RMSNorm axk2.AXK2RMSNorm bailing_hybrid.BailingHybridRMSNorm
    bamba.BambaRMSNorm bitnet.BitNetRMSNorm blt.BltRMSNorm chameleon.ChameleonRMSNorm clvp.ClvpRMSNorm
    cohere2_moe.Cohere2MoeRMSNorm cosmos3_edge.Cosmos3EdgeTextRMSNorm csm.CsmRMSNorm cwm.CwmRMSNorm
    deepseek_ocr2.DeepseekOcr2TextRMSNorm deepseek_ocr2.DeepseekOcr2VisionRMSNorm
    deepseek_v2.DeepseekV2RMSNorm deepseek_v3.DeepseekV3RMSNorm deepseek_v32.DeepseekV32RMSNorm
    deimv2.Deimv2RMSNorm dia.DiaRMSNorm diffllama.DiffLlamaRMSNorm doge.DogeRMSNorm dots1.Dots1RMSNorm
    dots3_note.Dots3NoteRMSNorm emu3.Emu3RMSNorm ernie4_5.Ernie4_5RMSNorm
    ernie4_5_moe.Ernie4_5_MoeRMSNorm ernie4_5_vl_moe.Ernie4_5_VLMoeRMSNorm eurobert.EuroBertRMSNorm
    evolla.EvollaRMSNorm exaone4.Exaone4RMSNorm exaone4_5.Exaone4_5_RMSNorm exaone_moe.ExaoneMoeRMSNorm
    falcon_h1.FalconH1RMSNorm falcon_mamba.FalconMambaRMSNorm glm.GlmRMSNorm glm4.Glm4RMSNorm
    glm4_moe.Glm4MoeRMSNorm glm4_moe_lite.Glm4MoeLiteRMSNorm glm4v.Glm4vRMSNorm
    glm4v_moe.Glm4vMoeRMSNorm glm4v_moe.Glm4vMoeTextRMSNorm glm5_next.Glm5NextRMSNorm
    glm5_next.Glm5NextTextRMSNorm glm_image.GlmImageRMSNorm glm_moe_dsa.GlmMoeDsaRMSNorm
    glm_ocr.GlmOcrRMSNorm granite.GraniteRMSNorm granite4_vision.Granite4VisionTextRMSNorm
    granite_docling.GraniteDoclingTextRMSNorm granite_swa.GraniteSWARMSNorm granitemoe.GraniteMoeRMSNorm
    granitemoe_swa.GraniteMoeSWARMSNorm granitemoehybrid.GraniteMoeHybridRMSNorm
    granitemoeshared.GraniteMoeSharedRMSNorm higgs_audio_v2.HiggsAudioV2RMSNorm
    hunyuan_v1_dense.HunYuanDenseV1RMSNorm hunyuan_v1_moe.HunYuanMoEV1RMSNorm
    hunyuan_vl.HunYuanVLRMSNorm hy_v3.HYV3RMSNorm hy_v4.HYV4RMSNorm hy_v4_vl.HYV4VLRMSNorm
    hyperclovax.HyperCLOVAXRMSNorm idefics2.Idefics2RMSNorm idefics3.Idefics3RMSNorm
    inkling.InklingRMSNorm internvl.InternVLVisionRMSNorm jamba.JambaRMSNorm jetmoe.JetMoeRMSNorm
    kimi_linear.KimiLinearRMSNorm kolibri1.Kolibri1RMSNorm laguna.LagunaRMSNorm lfm2.Lfm2RMSNorm
    lfm2_moe.Lfm2MoeRMSNorm lfm3.Lfm3RMSNorm lfm3_vl.Lfm3VlVisionRMSNorm lighton_ocr.LightOnOcrRMSNorm
    llama.LlamaRMSNorm llama4.Llama4TextRMSNorm longcat_flash.LongcatFlashRMSNorm mamba.MambaRMSNorm
    mamba2.Mamba2RMSNorm mellum.MellumRMSNorm mimo_v2_flash.MiMoV2FlashRMSNorm minicpm3.MiniCPM3RMSNorm
    minimax.MiniMaxRMSNorm minimax_m2.MiniMaxM2RMSNorm ministral.MinistralRMSNorm
    ministral3.Ministral3RMSNorm mistral.MistralRMSNorm mistral3.Mistral3RMSNorm
    mistral4.Mistral4RMSNorm mistral_large4.MistralLarge4RMSNorm mixtral.MixtralRMSNorm
    mllama.MllamaTextRMSNorm molmo2.Molmo2RMSNorm muse_glimmer_assistant.MuseGlimmerAssistantRMSNorm
    neucodec.NeuCodecRMSNorm olmoe.OlmoeRMSNorm ovis2.Ovis2RMSNorm paddleocr_vl.PaddleOCRRMSNorm
    pe_audio.PeAudioEncoderRMSNorm pe_audio_video.PeAudioVideoEncoderRMSNorm
    pe_video.PeVideoEncoderRMSNorm phi3.Phi3RMSNorm phi4_multimodal.Phi4MultimodalRMSNorm
    pixtral.PixtralRMSNorm qianfan_ocr.QianfanOCRVisionRMSNorm qwen2.Qwen2RMSNorm
    qwen2_5_omni.Qwen2_5OmniRMSNorm qwen2_5_vl.Qwen2_5_VLRMSNorm qwen2_moe.Qwen2MoeRMSNorm
    qwen2_vl.Qwen2VLRMSNorm qwen3.Qwen3RMSNorm qwen3_moe.Qwen3MoeRMSNorm
    qwen3_omni_moe.Qwen3OmniMoeCode2WavRMSNorm qwen3_omni_moe.Qwen3OmniMoeRMSNorm
    qwen3_omni_moe.Qwen3OmniMoeTextRMSNorm qwen3_omni_moe.Qwen3OmniMoeThinkerTextRMSNorm
    qwen3_vl.Qwen3VLTextRMSNorm qwen3_vl_moe.Qwen3VLMoeTextRMSNorm sapiens2.Sapiens2RMSNorm
    seed_oss.SeedOssRMSNorm smollm3.SmolLM3RMSNorm solar_open.SolarOpenRMSNorm timesfm.TimesFmRMSNorm
    timesfm2_5.TimesFm2_5RMSNorm ultrabert.UltrabertRMSNorm ultravbert.UltraVBertRMSNorm
    unlimited_ocr.UnlimitedOcrTextRMSNorm vibevoice.VibeVoiceRMSNorm
    vibevoice_acoustic_tokenizer.VibeVoiceAcousticTokenizerRMSNorm vibevoice_asr.VibeVoiceAsrRMSNorm
    voxtral_realtime.VoxtralRealtimeRMSNorm xcodec2.Xcodec2RMSNorm xlstm.xLSTMRMSNorm youtu.YoutuRMSNorm
    zamba.ZambaRMSNorm zamba2.Zamba2RMSNorm zaya.ZayaRMSNorm
    """,
    "gemma": """
    gemma.GemmaRMSNorm gemma2.Gemma2RMSNorm gemma3.Gemma3RMSNorm minimax_m3_vl.MiniMaxM3VLRMSNorm
    muse_glimmer.MuseGlimmerTextCenteredRMSNorm qwen3_5.Qwen3_5RMSNorm qwen3_5_moe.Qwen3_5MoeRMSNorm
    qwen3_next.Qwen3NextRMSNorm qwen4_exp.Qwen4ExpTextRMSNorm recurrent_gemma.RecurrentGemmaRMSNorm
    step3p7.Step3p7RMSNorm t5gemma.T5GemmaRMSNorm t5gemma2.T5Gemma2RMSNorm vaultgemma.VaultGemmaRMSNorm
    """,
    "olmo2": """
    afmoe.AfmoeRMSNorm beam.BeamRMSNorm deepseek_v4.DeepseekV4RMSNorm
    diffusion_gemma.DiffusionGemmaRMSNorm embedding_gemma2.EmbeddingGemma2RMSNorm
    flex_olmo.FlexOlmoRMSNorm flint.FlintRMSNorm gemma3n.Gemma3nRMSNorm gemma4.Gemma4RMSNorm
    gemma4_unified.Gemma4UnifiedRMSNorm gpt_oss.GptOssRMSNorm helium.HeliumRMSNorm
    inkling2.Inkling2RMSNorm inkling2_loop.Inkling2LoopRMSNorm
    kyutai_speech_to_text.KyutaiSpeechToTextRMSNorm lara_mini.LaraMiniRMSNorm moshi.MoshiRMSNorm
    muse_glimmer.MuseGlimmerRMSNorm muse_spark.MuseSparkRMSNorm nemotron_h.NemotronHRMSNorm
    nemotron_h_omni.NemotronH_Omni_RMSNorm neomme.NeoMMERMSNorm olmo2.Olmo2RMSNorm olmo3.Olmo3RMSNorm
    olmo_hybrid.OlmoHybridRMSNorm openai_privacy_filter.OpenAIPrivacyFilterRMSNorm
    """,
    "t5": """
    idefics.IdeficsRMSNorm kosmos2_5.Kosmos2_5LayerNorm longt5.LongT5LayerNorm mt5.MT5LayerNorm
    pix2struct.Pix2StructLayerNorm pop2piano.Pop2PianoLayerNorm switch_transformers.SwitchTransformersLayerNorm
    t5.T5LayerNorm udop.UdopLayerNorm umt5.UMT5LayerNorm
    """,
    "cohere": """
    cohere.CohereLayerNorm cohere2.Cohere2LayerNorm cohere2_moe.Cohere2MoeLayerNorm
    cohere_compass.CohereCompassLayerNorm
    """,
    "olmo": "olmo.OlmoLayerNorm",
    "layer": "esmc.EsmcLayerNorm",
    "nanochat": """
    esmfold2.EsmFold2RMSNorm hrm_text.HrmTextRMSNorm inkling2.Inkling2UnweightedRMSNorm
    inkling2_loop.Inkling2LoopUnweightedRMSNorm nanochat.NanoChatRMSNorm
    """,
    "deberta": "deberta.DebertaLayerNorm",
    "nemotron": "nemotron.NemotronLayerNorm1P",
    "moonshine": "moonshine_streaming.MoonshineStreamingLayerNorm",
}


def hf_path(model: str, name: str) -> str:
    """The path of class ``name`` of a Hugging Face model: ``transformers.models.<model>.modeling_<model>.<name>``;
    ``model`` as ``<model>/<file>`` for a class in another file of the model (``blip/blip_text``:
    ``modeling_blip_text``)."""
    model, _, file = model.partition("/")
    return f"transformers.models.{model}.modeling_{file or model}.{name}"


def pairs(entries: str) -> list[tuple[str, str]]:
    """``"llama.LlamaRMSNorm gpt2.GPT2"`` -> ``[("llama", "LlamaRMSNorm"), ("gpt2", "GPT2")]``: the
    tables' entries, each a model and a class name (or its prefix), whitespace apart."""
    return [tuple(entry.split(".")) for entry in entries.split()]


HF_NORMS: dict[str, str] = {hf_path(m, c): style for style, entries in _BY_STYLE.items() for m, c in pairs(entries)}
