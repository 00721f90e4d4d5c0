"""The Hugging Face layers that run with another layer's :class:`~.families.Family`, as data:
copies of a layer of the table (``COPIES``), copies whose model changes the stream after them
(``ALONE``), and copies whose stack's final norm has another name (``FINALS``). :mod:`.families`
adds them to ``FAMILIES``.
"""

from __future__ import annotations

# layers whose forward runs the statements of a layer of the table: the same syntax tree, docstring,
# comments and signature aside, where a sublayer called with ``hidden_states=h`` counts as called
# with ``h`` first (a test compares the trees, and checks that those sublayers take ``hidden_states``
# first). Each runs with that layer's Family. The original "model.Class" -> its copies.
COPIES: dict[str, str] = {
    "mt5.MT5LayerSelfAttention": """
    longt5.LongT5LayerSelfAttention pop2piano.Pop2PianoLayerSelfAttention
    switch_transformers.SwitchTransformersLayerSelfAttention udop.UdopLayerSelfAttention
    """,
    "mt5.MT5LayerCrossAttention": """
    longt5.LongT5LayerCrossAttention pop2piano.Pop2PianoLayerCrossAttention
    switch_transformers.SwitchTransformersLayerCrossAttention udop.UdopLayerCrossAttention
    """,
    "mt5.MT5LayerFF": """
    longt5.LongT5LayerFF pix2struct.Pix2StructTextLayerFF pop2piano.Pop2PianoLayerFF udop.UdopLayerFF
    umt5.UMT5LayerFF
    """,
    "bert.BertSelfOutput": """
    align.AlignTextOutput align.AlignTextSelfOutput altclip.AltRobertaOutput
    altclip.AltRobertaSelfOutput bert.BertOutput bert_generation.BertGenerationOutput
    bert_generation.BertGenerationSelfOutput big_bird.BigBirdOutput big_bird.BigBirdSelfOutput
    blip/blip_text.BlipTextOutput blip/blip_text.BlipTextSelfOutput blip_2.Blip2QFormerOutput
    blip_2.Blip2QFormerSelfOutput bridgetower.BridgeTowerOutput
    bridgetower.BridgeTowerSelfOutput bros.BrosOutput bros.BrosSelfOutput camembert.CamembertOutput
    camembert.CamembertSelfOutput canine.CanineOutput canine.CanineSelfOutput
    chinese_clip.ChineseCLIPTextOutput chinese_clip.ChineseCLIPTextSelfOutput clap.ClapTextOutput
    clap.ClapTextSelfOutput convbert.ConvBertOutput convbert.ConvBertSelfOutput cpmant.CpmAntOutput
    deberta.DebertaOutput deberta.DebertaSelfOutput deberta_v2.DebertaV2Output
    deberta_v2.DebertaV2SelfOutput electra.ElectraOutput electra.ElectraSelfOutput ernie.ErnieOutput
    ernie.ErnieSelfOutput fnet.FNetOutput git.GitOutput git.GitSelfOutput
    instructblip.InstructBlipQFormerOutput instructblip.InstructBlipQFormerSelfOutput
    instructblipvideo.InstructBlipVideoQFormerOutput
    instructblipvideo.InstructBlipVideoQFormerSelfOutput layoutlm.LayoutLMOutput
    layoutlm.LayoutLMSelfOutput layoutlmv2.LayoutLMv2Output layoutlmv2.LayoutLMv2SelfOutput
    layoutlmv3.LayoutLMv3Output layoutlmv3.LayoutLMv3SelfOutput lilt.LiltOutput lilt.LiltSelfOutput
    longformer.LongformerOutput longformer.LongformerSelfOutput luke.LukeOutput luke.LukeSelfOutput
    lxmert.LxmertAttentionOutput lxmert.LxmertOutput markuplm.MarkupLMOutput
    markuplm.MarkupLMSelfOutput mpnet.MPNetOutput mra.MraOutput mra.MraSelfOutput
    nystromformer.NystromformerOutput nystromformer.NystromformerSelfOutput rembert.RemBertOutput
    rembert.RemBertSelfOutput roberta.RobertaOutput roberta.RobertaSelfOutput roc_bert.RoCBertOutput
    roc_bert.RoCBertSelfOutput roformer.RoFormerOutput roformer.RoFormerSelfOutput sew_d.SEWDOutput
    sew_d.SEWDSelfOutput splinter.SplinterOutput splinter.SplinterSelfOutput tapas.TapasOutput
    tapas.TapasSelfOutput visual_bert.VisualBertOutput visual_bert.VisualBertSelfOutput
    xlm_roberta.XLMRobertaOutput xlm_roberta.XLMRobertaSelfOutput yoso.YosoOutput
    yoso.YosoSelfOutput
    """,
    "llama.LlamaDecoderLayer": """
    arcee.ArceeDecoderLayer aria.AriaTextDecoderLayer axk1.AXK1DecoderLayer axk2.AXK2DecoderLayer
    bitnet.BitNetDecoderLayer cosmos3_edge.Cosmos3EdgeTextDecoderLayer csm.CsmDecoderLayer
    cwm.CwmDecoderLayer deepseek_ocr2.DeepseekOcr2TextDecoderLayer
    deepseek_ocr2.DeepseekOcr2VisionEncoderLayer deepseek_v2.DeepseekV2DecoderLayer
    deepseek_v3.DeepseekV3DecoderLayer deepseek_v32.DeepseekV32DecoderLayer
    diffllama.DiffLlamaDecoderLayer dots1.Dots1DecoderLayer dots3_note.Dots3NoteTextDecoderLayer
    ernie4_5.Ernie4_5DecoderLayer ernie4_5_moe.Ernie4_5_MoeDecoderLayer
    eurobert.EuroBertDecoderLayer exaone_moe.ExaoneMoeDecoderLayer flint.FlintDecoderLayer
    glm.GlmDecoderLayer glm4_moe.Glm4MoeDecoderLayer glm4_moe_lite.Glm4MoeLiteDecoderLayer
    glm4v_moe.Glm4vMoeTextDecoderLayer gradium_phonon_tts.GradiumPhononTTSDecoderLayer
    helium.HeliumDecoderLayer hrm_text.HrmTextDecoderLayer
    hunyuan_v1_dense.HunYuanDenseV1DecoderLayer hunyuan_v1_moe.HunYuanMoEV1DecoderLayer
    hunyuan_vl.HunYuanVLDenseV1DecoderLayer hy_v3.HYV3DecoderLayer jais2.Jais2DecoderLayer
    laguna.LagunaDecoderLayer mellum.MellumDecoderLayer mimo_v2_flash.MiMoV2FlashDecoderLayer
    ministral.MinistralDecoderLayer ministral3.Ministral3DecoderLayer mistral4.Mistral4DecoderLayer
    moonshine.MoonshineEncoderLayer moonshine_streaming.MoonshineStreamingEncoderLayer
    nanochat.NanoChatDecoderLayer neucodec.NeuCodecDecoderLayer olmo.OlmoDecoderLayer
    olmoe.OlmoeDecoderLayer paddleocr_vl.PaddleOCRDecoderLayer pe_audio.PeAudioEncoderLayer
    pe_audio_video.PeAudioVideoEncoderLayer pe_video.PeVideoEncoderLayer
    pocket_tts.PocketTTSDecoderLayer qwen2_5_omni.Qwen2_5OmniDecoderLayer
    qwen2_5_vl.Qwen2_5_VLDecoderLayer qwen2_vl.Qwen2VLDecoderLayer
    qwen3_omni_moe.Qwen3OmniMoeTalkerCodePredictorDecoderLayer
    qwen3_omni_moe.Qwen3OmniMoeTalkerDecoderLayer qwen3_omni_moe.Qwen3OmniMoeThinkerTextDecoderLayer
    qwen3_vl.Qwen3VLTextDecoderLayer qwen3_vl_moe.Qwen3VLMoeTextDecoderLayer
    seed_oss.SeedOssDecoderLayer smollm3.SmolLM3DecoderLayer solar_open.SolarOpenDecoderLayer
    starcoder2.Starcoder2DecoderLayer step3p7.Step3p7DecoderLayer ultrabert.UltrabertDecoderLayer
    unlimited_ocr.UnlimitedOcrTextDecoderLayer xcodec2.Xcodec2DecoderLayer youtu.YoutuDecoderLayer
    """,
    "olmo2.Olmo2DecoderLayer": """
    exaone4.Exaone4DecoderLayer exaone4_5.Exaone4_5_DecoderLayer olmo3.Olmo3DecoderLayer
    olmo_hybrid.OlmoHybridAttentionDecoderLayer
    """,
    "siglip.SiglipEncoderLayer": """
    idefics2.Idefics2EncoderLayer idefics3.Idefics3EncoderLayer siglip2.Siglip2EncoderLayer
    smolvlm.SmolVLMEncoderLayer
    """,
    "vit.ViTLayer": """
    audio_spectrogram_transformer.ASTLayer deit.DeiTLayer ijepa.IJepaLayer
    videoprism.VideoPrismLayer vit_mae.ViTMAELayer vit_msn.ViTMSNLayer vivit.VivitLayer
    """,
    "whisper.WhisperEncoderLayer": """
    audioflamingo3.AudioFlamingo3EncoderLayer blenderbot.BlenderbotEncoderLayer
    m2m_100.M2M100EncoderLayer mbart.MBartEncoderLayer
    moss_transcribe_diarize.MossTranscribeDiarizeAudioLayer pegasus.PegasusEncoderLayer
    qwen2_audio.Qwen2AudioEncoderLayer speech_to_text.Speech2TextEncoderLayer
    voxtral.VoxtralEncoderLayer
    """,
    "qwen3_asr.Qwen3ASRAudioEncoderLayer": """
    qwen2_5_omni.Qwen2_5OmniAudioEncoderLayer qwen3_omni_moe.Qwen3OmniMoeAudioEncoderLayer
    """,
    "whisper.WhisperDecoderLayer": """
    bigbird_pegasus.BigBirdPegasusDecoderLayer blenderbot.BlenderbotDecoderLayer
    m2m_100.M2M100DecoderLayer mbart.MBartDecoderLayer musicgen.MusicgenDecoderLayer
    pegasus.PegasusDecoderLayer pegasus_x.PegasusXDecoderLayer
    pp_formulanet.PPFormulaNetDecoderLayer speech_to_text.Speech2TextDecoderLayer
    xglm.XGLMDecoderLayer
    """,
    "bart.BartEncoderLayer": """
    blenderbot_small.BlenderbotSmallEncoderLayer informer.InformerEncoderLayer
    marian.MarianEncoderLayer plbart.PLBartEncoderLayer
    time_series_transformer.TimeSeriesTransformerEncoderLayer
    """,
    "bart.BartDecoderLayer": """
    blenderbot_small.BlenderbotSmallDecoderLayer informer.InformerDecoderLayer
    marian.MarianDecoderLayer plbart.PLBartDecoderLayer
    time_series_transformer.TimeSeriesTransformerDecoderLayer
    """,
    "clip.CLIPEncoderLayer": """
    altclip.AltCLIPEncoderLayer chinese_clip.ChineseCLIPVisionLayer clipseg.CLIPSegEncoderLayer
    git.GitVisionEncoderLayer granite_docling.GraniteDoclingEncoderLayer
    groupvit.GroupViTEncoderLayer hunyuan_vl.HunYuanVLVisionBlock hy_v4_vl.HYV4VLVisionBlock
    janus.JanusVisionEncoderLayer kosmos2.Kosmos2VisionEncoderLayer metaclip_2.MetaClip2EncoderLayer
    minicpm_ocr.MiniCPMOcrVisionEncoderLayer minicpmv4_6.MiniCPMV4_6VisionEncoderLayer
    minicpmv4_7.MiniCPMV4_7VisionEncoderLayer molmo2.Molmo2VisionEncoderLayer
    nemotron3_5_transcribe.Nemotron3_5TranscribeAsrAudioLayer
    nemotron3_diarization.Nemotron3DiarizationAudioLayer owlv2.Owlv2EncoderLayer
    owlvit.OwlViTEncoderLayer phi4_multimodal.Phi4MultimodalVisionEncoderLayer
    pp_ocrv5_mobile_rec.PPOCRV5MobileRecBlock pp_ocrv5_server_rec.PPOCRV5ServerRecBlock
    pp_ocrv6_small_rec.PPOCRV6SmallRecBlock sam3_lite_text.Sam3LiteTextTextEncoderLayer
    tipsv2.Tipsv2TextEncoderLayer unlimited_ocr.UnlimitedOcrEncoderLayer x_clip.XCLIPEncoderLayer
    """,
    "gptj.GPTJBlock": """
    codegen.CodeGenBlock
    """,
    "cohere2.Cohere2DecoderLayer": """
    cohere2_moe.Cohere2MoeDecoderLayer cohere_compass.CohereCompassDecoderLayer
    """,
    "gpt2.GPT2Block": """
    decision_transformer.DecisionTransformerGPT2Block
    """,
    "dinov2.Dinov2Layer": """
    dinov2_with_registers.Dinov2WithRegistersLayer eomt.EomtLayer radio.RadioLayer
    tipsv2.Tipsv2VisionLayer videomt.VideomtLayer
    """,
    "phi3.Phi3DecoderLayer": """
    dots3_note.Dots3NoteAudioLayer phi4_multimodal.Phi4MultimodalDecoderLayer
    """,
    "granite.GraniteDecoderLayer": """
    granite4_vision.Granite4VisionTextDecoderLayer granite_docling.GraniteDoclingTextDecoderLayer
    granite_swa.GraniteSWADecoderLayer
    """,
    "glm4.Glm4DecoderLayer": """
    kolibri1.Kolibri1DecoderLayer
    """,
    "mixtral.MixtralDecoderLayer": """
    minimax_m2.MiniMaxM2DecoderLayer minimax_m3_vl.MiniMaxM3VLDecoderLayer phimoe.PhimoeDecoderLayer
    """,
    "gemma2.Gemma2DecoderLayer": """
    muse_glimmer.MuseGlimmerTextDecoderLayer
    """,
    "glm4v.Glm4vTextDecoderLayer": "glm_image.GlmImageTextDecoderLayer glm_ocr.GlmOcrTextDecoderLayer",
    "granitemoeshared.GraniteMoeSharedDecoderLayer": "granitemoe_swa.GraniteMoeSWADecoderLayer",
    "kimi_linear.KimiLinearDecoderLayer": "bailing_hybrid.BailingHybridDecoderLayer",
    "lfm2.Lfm2DecoderLayer": "lfm3_vl.Lfm3VlVisionLayer",  # (no final norm: see FINALS)
    "mllama.MllamaSelfAttentionDecoderLayer": "blt.BltTransformerLayer",
    "qwen3_5.Qwen3_5DecoderLayer": "lara_mini.LaraMiniDecoderLayer",
    "sam.SamVisionLayer": """
    deepseek_ocr2.DeepseekOcr2SamVisionLayer got_ocr2.GotOcr2VisionLayer pp_formulanet.PPFormulaNetVisionLayer
    sam_hq.SamHQVisionLayer slanext.SLANeXtVisionLayer unlimited_ocr.UnlimitedOcrSamVisionLayer
    """,
    "wav2vec2.Wav2Vec2EncoderLayer": """
    hubert.HubertEncoderLayer sew.SEWEncoderLayer unispeech.UniSpeechEncoderLayer
    unispeech_sat.UniSpeechSatEncoderLayer
    """,
    "qwen2_5_vl.Qwen2_5_VLVisionBlock": """
    cohere_compass.CohereCompassVisionBlock dots3_note.Dots3NoteVisionBlock
    ernie4_5_vl_moe.Ernie4_5_VLMoeVisionBlock exaone4_5.Exaone4_5_VisionBlock glm4v.Glm4vVisionBlock
    glm4v_moe.Glm4vMoeVisionBlock glm5_next.Glm5NextVisionBlock glm_ocr.GlmOcrVisionBlock
    kimi_k25.Kimi_K25VisionEncoderLayer muse_glimmer.MuseGlimmerVisionEncoderLayer
    muse_spark.MuseSparkVisionEncoderLayer qwen2_5_omni.Qwen2_5OmniVisionBlock qwen2_vl.Qwen2VLVisionBlock
    qwen3_5.Qwen3_5VisionBlock qwen3_5_moe.Qwen3_5MoeVisionBlock qwen3_omni_moe.Qwen3OmniMoeVisionBlock
    qwen3_vl.Qwen3VLVisionBlock qwen3_vl_moe.Qwen3VLMoeVisionBlock qwen4_exp.Qwen4ExpVisionBlock
    """,
    "paddleocr_vl.PaddleOCRVisionEncoderLayer": "video_llama_3.VideoLlama3VisionEncoderLayer",
    "detr.DetrEncoderLayer": "conditional_detr.ConditionalDetrEncoderLayer",
    "detr.DetrDecoderLayer": "maskformer.MaskFormerDetrDecoderLayer",
    "dinov3_vit.DINOv3ViTLayer": "eomt_dinov3.EomtDinov3Layer sapiens2.Sapiens2Layer",
    "aimv2.Aimv2EncoderLayer": "ovis2.Ovis2VisionEncoderLayer",
    "canary.CanaryDecoderLayer": "cohere_asr.CohereAsrDecoderLayer",
    "seamless_m4t.SeamlessM4TEncoderLayer": "seamless_m4t_v2.SeamlessM4Tv2EncoderLayer",
    "seamless_m4t.SeamlessM4TDecoderLayer": "seamless_m4t_v2.SeamlessM4Tv2DecoderLayer",
    "blip.BlipEncoderLayer": """
    blip_2.Blip2EncoderLayer instructblip.InstructBlipEncoderLayer instructblipvideo.InstructBlipVideoEncoderLayer
    """,
    "wav2vec2.Wav2Vec2EncoderLayerStableLayerNorm": """
    hubert.HubertEncoderLayerStableLayerNorm unispeech.UniSpeechEncoderLayerStableLayerNorm
    unispeech_sat.UniSpeechSatEncoderLayerStableLayerNorm
    """,
    "parakeet.ParakeetEncoderBlock": "granite_speech5.GraniteSpeech5EncoderBlock",
    "wav2vec2_bert.Wav2Vec2BertEncoderLayer": "seamless_m4t.SeamlessM4TConformerEncoderLayer",
}


# copies in models that change the stream between their layers: merged (MiniCPM's vision) or added
# tokens (EoMT), or a cross-attention output added before each layer (BLT's local decoder)
ALONE = """
    blt.BltTransformerLayer eomt.EomtLayer eomt_dinov3.EomtDinov3Layer minicpm_ocr.MiniCPMOcrVisionEncoderLayer
    minicpmv4_6.MiniCPMV4_6VisionEncoderLayer minicpmv4_7.MiniCPMV4_7VisionEncoderLayer
"""

# copies whose stack names its final norm otherwise than the original's does (each applied right
# after the stack's last layer); ViT-MAE's layer runs in its encoder and in its decoder
FINALS = {
    "bigbird_pegasus.BigBirdPegasusDecoderLayer": "layernorm_embedding",
    # Qwen2-VL's vision blocks' copies: the norm their stack's last add goes through next
    **dict.fromkeys(
        """cohere_compass.CohereCompassVisionBlock qwen3_5.Qwen3_5VisionBlock qwen3_5_moe.Qwen3_5MoeVisionBlock
        qwen3_vl.Qwen3VLVisionBlock qwen3_vl_moe.Qwen3VLMoeVisionBlock qwen4_exp.Qwen4ExpVisionBlock""".split(),
        "merger.norm",
    ),
    **dict.fromkeys(
        """glm4v.Glm4vVisionBlock glm4v_moe.Glm4vMoeVisionBlock glm5_next.Glm5NextVisionBlock
        glm_ocr.GlmOcrVisionBlock""".split(),
        "post_layernorm",
    ),
    "dots3_note.Dots3NoteVisionBlock": "norm",
    "ernie4_5_vl_moe.Ernie4_5_VLMoeVisionBlock": "ln",
    "kimi_k25.Kimi_K25VisionEncoderLayer": "final_layernorm",
    # none: MuSE's vision models put the patches back in their order before their final norm
    "muse_glimmer.MuseGlimmerVisionEncoderLayer": (),
    "muse_spark.MuseSparkVisionEncoderLayer": (),
    "dots3_note.Dots3NoteAudioLayer": "layer_norm",
    "hrm_text.HrmTextDecoderLayer": "final_norm",
    "moonshine.MoonshineEncoderLayer": "layer_norm",
    "moonshine_streaming.MoonshineStreamingEncoderLayer": "final_norm",
    "nemotron3_5_transcribe.Nemotron3_5TranscribeAsrAudioLayer": "layer_norm",
    "nemotron3_diarization.Nemotron3DiarizationAudioLayer": "layer_norm",
    "pp_ocrv5_mobile_rec.PPOCRV5MobileRecBlock": "norm",
    "pp_ocrv5_server_rec.PPOCRV5ServerRecBlock": "norm",
    "pp_ocrv6_small_rec.PPOCRV6SmallRecBlock": "norm",
    "vit_mae.ViTMAELayer": ("layernorm", "decoder_norm"),
    # none: LFM3-VL's vision model applies its embedding_norm (LFM2's final norm) before its layers
    "lfm3_vl.Lfm3VlVisionLayer": (),
    # none: these audio encoders pool their rows in pairs before their final norm
    "qwen2_5_omni.Qwen2_5OmniAudioEncoderLayer": (),
    "qwen2_audio.Qwen2AudioEncoderLayer": (),
    "audioflamingo3.AudioFlamingo3EncoderLayer": (),
}
