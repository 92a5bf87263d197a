"""Which of our model classes serves an HF config (by ``architectures``, else ``model_type``)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from importlib import import_module
from typing import Any

# HF architecture name -> "module:Class". Llama, Mistral, Qwen2, Qwen3, the MoEs and Phi-3 share one class (config flags
# pick the variant); Gemma 3 has its own layers on the same plumbing.
_ARCHITECTURES = {
    "LlamaForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "Qwen2MoeForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "Phi3ForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "GraniteForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "GraniteMoeForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "GraniteMoeSharedForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "SmolLM3ForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "Ernie4_5ForCausalLM": "specray.models.ernie4_5:Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM": "specray.models.ernie4_5:Ernie4_5ForCausalLM",
    "SeedOssForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "Olmo2ForCausalLM": "specray.models.olmo2:Olmo2ForCausalLM",
    "OlmoeForCausalLM": "specray.models.olmoe:OlmoeForCausalLM",
    "OlmoForCausalLM": "specray.models.olmo:OlmoForCausalLM",
    "GlmForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "Glm4ForCausalLM": "specray.models.glm4:Glm4ForCausalLM",
    "ArceeForCausalLM": "specray.models.arcee:ArceeForCausalLM",
    "Starcoder2ForCausalLM": "specray.models.starcoder2:Starcoder2ForCausalLM",
    "NemotronForCausalLM": "specray.models.nemotron:NemotronForCausalLM",
    "ApertusForCausalLM": "specray.models.apertus:ApertusForCausalLM",
    "PhimoeForCausalLM": "specray.models.phimoe:PhimoeForCausalLM",
    "Cohere2ForCausalLM": "specray.models.cohere2:Cohere2ForCausalLM",
    "CohereForCausalLM": "specray.models.cohere2:CohereForCausalLM",
    "Cohere2MoeForCausalLM": "specray.models.cohere2_moe:Cohere2MoeForCausalLM",
    "HunYuanDenseV1ForCausalLM": "specray.models.hunyuan_v1:HunYuanDenseV1ForCausalLM",
    "HunYuanMoEV1ForCausalLM": "specray.models.hunyuan_v1:HunYuanMoEV1ForCausalLM",
    "MinistralForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "Ministral3ForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "Exaone4ForCausalLM": "specray.models.exaone4:Exaone4ForCausalLM",
    "ExaoneMoeForCausalLM": "specray.models.exaone_moe:ExaoneMoeForCausalLM",
    "Olmo3ForCausalLM": "specray.models.olmo3:Olmo3ForCausalLM",
    "Gemma3ForCausalLM": "specray.models.gemma3:Gemma3ForCausalLM",
    "Gemma2ForCausalLM": "specray.models.gemma2:Gemma2ForCausalLM",
    "VaultGemmaForCausalLM": "specray.models.gemma2:VaultGemmaForCausalLM",
    "Jais2ForCausalLM": "specray.models.jais2:Jais2ForCausalLM",
    "CwmForCausalLM": "specray.models.llama:LlamaForCausalLM",
    "YoutuForCausalLM": "specray.models.deepseek_v3:DeepseekV3ForCausalLM",
    "HeliumForCausalLM": "specray.models.helium:HeliumForCausalLM",
    "HyperCLOVAXForCausalLM": "specray.models.hyperclovax:HyperCLOVAXForCausalLM",
    "AXK1ForCausalLM": "specray.models.axk1:AXK1ForCausalLM",
    "Kolibri1ForCausalLM": "specray.models.kolibri1:Kolibri1ForCausalLM",
    "AfmoeForCausalLM": "specray.models.afmoe:AfmoeForCausalLM",
    "GraniteSWAForCausalLM": "specray.models.granite_swa:GraniteSWAForCausalLM",
    "GraniteMoeSWAForCausalLM": "specray.models.granite_swa:GraniteMoeSWAForCausalLM",
    "MellumForCausalLM": "specray.models.mellum:MellumForCausalLM",
    "LagunaForCausalLM": "specray.models.laguna:LagunaForCausalLM",
    "FlintForCausalLM": "specray.models.flint:FlintForCausalLM",
    "NanoChatForCausalLM": "specray.models.nanochat:NanoChatForCausalLM",
    "BeamForCausalLM": "specray.models.beam:BeamForCausalLM",
    "GemmaForCausalLM": "specray.models.gemma:GemmaForCausalLM",
    "DeepseekV3ForCausalLM": "specray.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV2ForCausalLM": "specray.models.deepseek_v3:DeepseekV3ForCausalLM",
    "MiniCPM3ForCausalLM": "specray.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM": "specray.models.deepseek_v3:DeepseekV3ForCausalLM",
    "GlmMoeDsaForCausalLM": "specray.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV4ForCausalLM": "specray.models.deepseek_v4:DeepseekV4ForCausalLM",
    "MiniMaxM2ForCausalLM": "specray.models.minimax_m2:MiniMaxM2ForCausalLM",
    "Mistral4ForCausalLM": "specray.models.deepseek_v3:DeepseekV3ForCausalLM",
    "Glm4MoeLiteForCausalLM": "specray.models.deepseek_v3:DeepseekV3ForCausalLM",
    "SolarOpenForCausalLM": "specray.models.glm4_moe:Glm4MoeForCausalLM",
    "Dots1ForCausalLM": "specray.models.glm4_moe:Glm4MoeForCausalLM",
    "HYV3ForCausalLM": "specray.models.hy_v3:HYV3ForCausalLM",
    "MiMoV2FlashForCausalLM": "specray.models.mimo_v2:MiMoV2FlashForCausalLM",
    "HYV4ForCausalLM": "specray.models.hy_v4:HYV4ForCausalLM",
    "Llama4ForCausalLM": "specray.models.llama4:Llama4ForCausalLM",
    "GptOssForCausalLM": "specray.models.gpt_oss:GptOssForCausalLM",
    "Glm4MoeForCausalLM": "specray.models.glm4_moe:Glm4MoeForCausalLM",
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "gemma2": "Gemma2ForCausalLM", "gemma": "GemmaForCausalLM", "gpt_oss": "GptOssForCausalLM",
                "glm4_moe": "Glm4MoeForCausalLM",
                "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                "deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM",
                "deepseek_v4": "DeepseekV4ForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM",
                "mistral4": "Mistral4ForCausalLM", "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
                "solar_open": "SolarOpenForCausalLM", "hy_v3": "HYV3ForCausalLM",
                "mimo_v2_flash": "MiMoV2FlashForCausalLM", "hy_v4": "HYV4ForCausalLM",
                "llama4_text": "Llama4ForCausalLM", "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM",
                "granitemoe": "GraniteMoeForCausalLM", "granitemoeshared": "GraniteMoeSharedForCausalLM",
                "olmo": "OlmoForCausalLM", "olmo2": "Olmo2ForCausalLM", "olmoe": "OlmoeForCausalLM",
                "smollm3": "SmolLM3ForCausalLM",
                "olmo3": "Olmo3ForCausalLM", "ernie4_5": "Ernie4_5ForCausalLM", "seed_oss": "SeedOssForCausalLM",
                "glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM", "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
                "dots1": "Dots1ForCausalLM", "exaone4": "Exaone4ForCausalLM", "exaone_moe": "ExaoneMoeForCausalLM",
                "arcee": "ArceeForCausalLM", "starcoder2": "Starcoder2ForCausalLM", "ministral": "MinistralForCausalLM",
                "cohere2": "Cohere2ForCausalLM", "ministral3": "Ministral3ForCausalLM",
                "cohere2_moe": "Cohere2MoeForCausalLM", "vaultgemma": "VaultGemmaForCausalLM",
                "jais2": "Jais2ForCausalLM", "cwm": "CwmForCausalLM", "youtu": "YoutuForCausalLM",
                "helium": "HeliumForCausalLM", "hyperclovax": "HyperCLOVAXForCausalLM", "axk1": "AXK1ForCausalLM",
                "kolibri1": "Kolibri1ForCausalLM", "afmoe": "AfmoeForCausalLM",
                "granite_swa": "GraniteSWAForCausalLM", "granitemoe_swa": "GraniteMoeSWAForCausalLM",
                "mellum": "MellumForCausalLM", "laguna": "LagunaForCausalLM",
                "flint": "FlintForCausalLM", "nanochat": "NanoChatForCausalLM",
                "beam": "BeamForCausalLM",
                "nemotron": "NemotronForCausalLM", "cohere": "CohereForCausalLM", "apertus": "ApertusForCausalLM",
                "phimoe": "PhimoeForCausalLM", "minicpm3": "MiniCPM3ForCausalLM",
                "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM", "hunyuan_v1_moe": "HunYuanMoEV1ForCausalLM"}

# the classic GPT-style families (specray.models.classic): GPT-NeoX (Pythia), Phi, GPT-J, StableLM, GPT-2, OPT, Falcon,
# GPT-BigCode (StarCoder)
_ARCHITECTURES.update({"GPTNeoXForCausalLM": "specray.models.gpt_neox:GPTNeoXForCausalLM",
                       "PhiForCausalLM": "specray.models.phi:PhiForCausalLM",
                       "GPTJForCausalLM": "specray.models.gptj:GPTJForCausalLM",
                       "StableLmForCausalLM": "specray.models.stablelm:StableLmForCausalLM",
                       "GPT2LMHeadModel": "specray.models.gpt2:GPT2LMHeadModel",
                       "OPTForCausalLM": "specray.models.opt:OPTForCausalLM",
                       "FalconForCausalLM": "specray.models.falcon:FalconForCausalLM",
                       "GPTBigCodeForCausalLM": "specray.models.gpt_bigcode:GPTBigCodeForCausalLM"})
_MODEL_TYPES.update({"gpt_neox": "GPTNeoXForCausalLM", "phi": "PhiForCausalLM", "gptj": "GPTJForCausalLM",
                     "stablelm": "StableLmForCausalLM", "gpt2": "GPT2LMHeadModel", "opt": "OPTForCausalLM",
                     "falcon": "FalconForCausalLM", "gpt_bigcode": "GPTBigCodeForCausalLM"})
# ALiBi's families (specray.models.alibi): BLOOM, MPT (and Falcon-RW, a Falcon)
_ARCHITECTURES.update({"BloomForCausalLM": "specray.models.bloom:BloomForCausalLM",
                       "MptForCausalLM": "specray.models.mpt:MptForCausalLM"})
_MODEL_TYPES.update({"bloom": "BloomForCausalLM", "mpt": "MptForCausalLM"})
# DBRX: MPT's names and fused Wqkv over RoPE and experts (specray.models.dbrx)
_ARCHITECTURES["DbrxForCausalLM"] = "specray.models.dbrx:DbrxForCausalLM"
_MODEL_TYPES["dbrx"] = "DbrxForCausalLM"

# a multimodal checkpoint whose text model we serve: its architecture -> the prefix of the text model's tensors (the
# rest, the vision tower and projector, is not loaded); Mistral 3's (Mistral Small 3.1 / 3.2, Devstral, Magistral)
# is a Mistral
_TEXT_PARTS = {"Llama4ForConditionalGeneration": "language_model.", "Gemma3ForConditionalGeneration": "language_model.",
               "Mistral3ForConditionalGeneration": "language_model."}

# hybrid linear attention (Gated DeltaNet layers with a recurrent state per request: specray.models.qwen3_5). A
# multimodal Qwen3.5 release keeps its text model under ``model.language_model.`` beside ``lm_head``; its text config
# names no architecture
_ARCHITECTURES.update({arch: "specray.models.qwen3_5:Qwen3_5ForCausalLM"
                       for arch in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")})
_MODEL_TYPES.update({"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                     "qwen3_next": "Qwen3NextForCausalLM"})
# (read by name patterns, so that the image encoder gets the rest: the tower under ``model.visual.``; ``mtp.*`` stays
# the MTP drafter's, which reads the checkpoint itself)
_TEXT_PARTS["Qwen3_5ForConditionalGeneration"] = _TEXT_PARTS["Qwen3_5MoeForConditionalGeneration"] = (
    (re.compile(r"^model\.language_model\."), "model."), (re.compile(r"^lm_head\."), "lm_head."))
# OLMo Hybrid: OLMo 3's attention layers among Gated DeltaNet ones (specray.models.olmo_hybrid)
_ARCHITECTURES["OlmoHybridForCausalLM"] = "specray.models.olmo_hybrid:OlmoHybridForCausalLM"
_MODEL_TYPES["olmo_hybrid"] = "OlmoHybridForCausalLM"
# LongCat-Flash: two latent-attention sublayers and a shortcut MoE with zero-computation experts per layer
_ARCHITECTURES["LongcatFlashForCausalLM"] = "specray.models.longcat_flash:LongcatFlashForCausalLM"
_MODEL_TYPES["longcat_flash"] = "LongcatFlashForCausalLM"

# Mamba models and hybrids (Mamba-2 or Mamba-1 layers with a recurrent state per request: specray.models.mamba_hybrid,
# zamba2) and LFM2 / LFM3 (short convs, a conv history per request: specray.models.lfm2, lfm3)
_ARCHITECTURES.update({"BambaForCausalLM": "specray.models.mamba_hybrid:MambaHybridForCausalLM",
                       "GraniteMoeHybridForCausalLM": "specray.models.mamba_hybrid:GraniteMoeHybridForCausalLM",
                       "NemotronHForCausalLM": "specray.models.mamba_hybrid:NemotronHForCausalLM",
                       "FalconH1ForCausalLM": "specray.models.mamba_hybrid:FalconH1ForCausalLM",
                       "Mamba2ForCausalLM": "specray.models.mamba_hybrid:Mamba2ForCausalLM",
                       "Lfm2ForCausalLM": "specray.models.lfm2:Lfm2ForCausalLM",
                       "Lfm2MoeForCausalLM": "specray.models.lfm2:Lfm2ForCausalLM",
                       "Lfm3ForCausalLM": "specray.models.lfm3:Lfm3ForCausalLM",
                       "JambaForCausalLM": "specray.models.mamba_hybrid:JambaForCausalLM",
                       "MambaForCausalLM": "specray.models.mamba_hybrid:Mamba1ForCausalLM",
                       "FalconMambaForCausalLM": "specray.models.mamba_hybrid:Mamba1ForCausalLM",
                       "Zamba2ForCausalLM": "specray.models.zamba2:Zamba2ForCausalLM",
                       "MiniMaxForCausalLM": "specray.models.minimax:MiniMaxForCausalLM"})
_MODEL_TYPES.update({"bamba": "BambaForCausalLM", "granitemoehybrid": "GraniteMoeHybridForCausalLM",
                     "nemotron_h": "NemotronHForCausalLM", "falcon_h1": "FalconH1ForCausalLM",
                     "mamba2": "Mamba2ForCausalLM", "lfm2": "Lfm2ForCausalLM", "lfm2_moe": "Lfm2MoeForCausalLM",
                     "lfm3": "Lfm3ForCausalLM",
                     "jamba": "JambaForCausalLM", "mamba": "MambaForCausalLM", "falcon_mamba": "FalconMambaForCausalLM",
                     "zamba2": "Zamba2ForCausalLM", "minimax": "MiniMaxForCausalLM"})
# Nemotron 3 Nano Omni: a Nemotron-H text model (its text_config) under ``language_model.`` beside its vision and
# audio towers and their projectors (not read)
_TEXT_PARTS["NemotronH_Omni_Reasoning_V3"] = "language_model."

# Qwen2.5-VL's and Qwen3-VL's text models are a Qwen2, a Qwen3 and a Qwen3-MoE (multimodal RoPE, ``mrope_section``,
# rotates a text-only sequence as plain RoPE does: its three position ids are equal). Qwen2.5-VL's releases keep the
# text model at the top (``model.``, beside ``visual.``), Qwen3-VL's under ``model.language_model.`` (beside
# ``model.visual.``), which is how transformers 5 reads both; ``lm_head.`` in both. So name patterns, not a prefix: a
# tensor's name -> the text model's (the first that matches; a tensor none matches is the vision tower's)
_QWEN_VL_TEXT = ((re.compile(r"^model\.(?:language_model\.)?(?!visual\.)"), "model."),
                 (re.compile(r"^lm_head\."), "lm_head."))
_MODEL_TYPES.update({"qwen2_5_vl_text": "Qwen2ForCausalLM", "qwen3_vl_text": "Qwen3ForCausalLM",
                     "qwen3_vl_moe_text": "Qwen3MoeForCausalLM"})
_TEXT_PARTS.update({arch: _QWEN_VL_TEXT for arch in ("Qwen2_5_VLForConditionalGeneration",
                                                     "Qwen3VLForConditionalGeneration",
                                                     "Qwen3VLMoeForConditionalGeneration")})

# EXAONE 4.5: an EXAONE 4.0 text model (its text_config) under ``model.language_model.`` beside Qwen2.5-VL's vision
# tower (``model.visual.``) and ``lm_head.``; its MTP module (``mtp.*``) is not read
_TEXT_PARTS["Exaone4_5_ForConditionalGeneration"] = ((re.compile(r"^model\.language_model\."), "model."),
                                                     (re.compile(r"^lm_head\."), "lm_head."))

# Gemma 4 (specray.models.gemma4): its multimodal releases keep the text model under ``model.language_model.``
# beside ``model.vision_tower.``, ``model.audio_tower.`` and their embedders; ``lm_head.`` (tied) at the top
_ARCHITECTURES["Gemma4ForCausalLM"] = "specray.models.gemma4:Gemma4ForCausalLM"
_MODEL_TYPES["gemma4_text"] = "Gemma4ForCausalLM"
_TEXT_PARTS["Gemma4ForConditionalGeneration"] = ((re.compile(r"^model\.language_model\."), "model."),
                                                 (re.compile(r"^lm_head\."), "lm_head."))

# Kimi K2.5 / K2.6: DeepSeek-V3's text model (its text_config) beside a vision tower; the release names the text's
# tensors language_model.model.* and language_model.lm_head.*, transformers' modules model.language_model.* and
# lm_head.* (the release's own code names the class KimiK25ForConditionalGeneration, transformers' Kimi_K25...)
_TEXT_PARTS["Kimi_K25ForConditionalGeneration"] = _TEXT_PARTS["KimiK25ForConditionalGeneration"] = (
    (re.compile(r"^(?:language_model\.model|model\.language_model)\."), "model."),
    (re.compile(r"^(?:language_model\.)?lm_head\."), "lm_head."))


# architecture -> text-config fields its whole model overrides (transformers' composite model computes them so:
# Aya Vision's plain lm_head ignores its Cohere2 text config's logit_scale); filled below
_TEXT_CONFIG_FIXES: dict[str, dict[str, Any]] = {}
# architecture -> the sub-config holding its text_config (and the whole model's tie flag), where not the top one
# (Qwen2.5-Omni's whole release: its thinker_config); filled below
_TEXT_HOLDERS: dict[str, str] = {}


def text_part(hf_config) -> tuple[object, Any] | None:
    """(the text model's config, where its tensors are: a prefix or name patterns, see :func:`text_tensors`) for a
    multimodal checkpoint we serve the text of, else None.
    Its LM head is tied to its embedding as the whole model's config says (transformers ties the composite model's
    head by that flag, whatever the text config's own says: Mistral 3's differ)."""
    for arch in getattr(hf_config, "architectures", None) or []:
        holder = getattr(hf_config, _TEXT_HOLDERS[arch], None) if arch in _TEXT_HOLDERS else hf_config
        text = getattr(holder, "text_config", None)
        if arch in _TEXT_PARTS and text is not None:
            if getattr(holder, "tie_word_embeddings", None) is not None:
                text.tie_word_embeddings = holder.tie_word_embeddings
            for field, value in _TEXT_CONFIG_FIXES.get(arch, {}).items():
                setattr(text, field, value)
            return text, _TEXT_PARTS[arch]
    return None


def text_tensors(weights: Iterable[tuple[str, Any]], part: Any) -> Iterator[tuple[str, Any]]:
    """The text model's tensors among a multimodal checkpoint's ``weights`` ((name, tensor) pairs), named as the text
    model names them; ``part``: where they are (:func:`text_part`), a prefix (the tensors under it, named without it)
    or (pattern, replacement) pairs (the first pattern a name matches renames it; a tensor none matches is left out)."""
    if isinstance(part, str):
        yield from ((name[len(part):], t) for name, t in weights if name.startswith(part))
        return
    for name, tensor in weights:
        for pattern, ours in part:
            if pattern.match(name):
                yield pattern.sub(ours, name, count=1), tensor
                break


# vision-language releases served with their images: architecture -> ("module:EncoderClass", "module:ProcessorClass")
# (specray.multimodal). Such a release's text model is served as its ``_TEXT_PARTS`` entry says; the encoder (vision
# tower and projector) is built from the whole config and reads its own tensors, the processor from its folder.
_MULTIMODAL: dict[str, tuple[str, str]] = {}


def multimodal_classes(hf_config) -> tuple[type, type] | None:
    """(encoder class, processor class) of a vision-language checkpoint whose images we serve, else None."""
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in _MULTIMODAL:
            encoder, processor = _MULTIMODAL[arch]
            return _resolve(encoder), _resolve(processor)
    return None


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def _resolve(target: str) -> type:
    module, name = target.split(":")
    return getattr(import_module(module), name)


# model types served by their own class whatever the config's architectures say (transformers serves them through
# another family's class and saves them naming it, with their releases' tensor names; filled below)
_BY_MODEL_TYPE: set[str] = set()


def get_model_class(hf_config) -> type:
    """Our ``nn.Module`` class for ``hf_config``; ValueError for an architecture we do not implement."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if getattr(hf_config, "model_type", None) in _BY_MODEL_TYPE:  # saved by transformers under another family's class
        return _resolve(_ARCHITECTURES[_MODEL_TYPES[hf_config.model_type]])
    for arch in archs:
        if arch in _ARCHITECTURES:
            return _resolve(_ARCHITECTURES[arch])
    model_type = getattr(hf_config, "model_type", None)
    if not archs and model_type in _MODEL_TYPES:
        return _resolve(_ARCHITECTURES[_MODEL_TYPES[model_type]])
    raise ValueError(
        f"architecture {archs or model_type!r} is not supported; supported architectures: "
        f"{supported_architectures()} (config.json 'architectures' / 'model_type')"
    )
# FlexOlmo: OLMo 2's post-norm layer with OLMoE's experts (specray.models.flex_olmo)
_ARCHITECTURES["FlexOlmoForCausalLM"] = "specray.models.flex_olmo:FlexOlmoForCausalLM"
_MODEL_TYPES["flex_olmo"] = "FlexOlmoForCausalLM"
# Lara Mini: Qwen3.5's Gated DeltaNet layers beside sliding (RoPE) and global (NoPE) attention, Flint's experts
# (specray.models.lara_mini)
_ARCHITECTURES["LaraMiniForCausalLM"] = "specray.models.lara_mini:LaraMiniForCausalLM"
_MODEL_TYPES["lara_mini"] = "LaraMiniForCausalLM"
# A.X-K2: DeepSeek-V3.2 with gated norms, an output gate from q_gate_proj, optional grouped routing
# (specray.models.axk2)
_ARCHITECTURES["AXK2ForCausalLM"] = "specray.models.axk2:AXK2ForCausalLM"
_MODEL_TYPES["axk2"] = "AXK2ForCausalLM"
# Cohere Compass (North-Micro-Vision): Command R7B's layers with RoPE on halves, per kind of layer (specray.models.
# cohere_compass); its multimodal releases keep the text model as Qwen3-VL's do (model.language_model., beside
# model.visual.; lm_head.)
_ARCHITECTURES["CohereCompassForCausalLM"] = "specray.models.cohere_compass:CohereCompassForCausalLM"
_MODEL_TYPES["cohere_compass_text"] = "CohereCompassForCausalLM"
_TEXT_PARTS["CohereCompassForConditionalGeneration"] = _QWEN_VL_TEXT
# Gemma 3n (specray.models.gemma3n): Gemma 4's stack with AltUp streams, LAuReL and activation sparsity; its
# multimodal releases keep the text model under ``model.language_model.`` beside ``model.vision_tower.``,
# ``model.audio_tower.`` and their embedders (``model.embed_vision.``, ``model.embed_audio.``: not read)
_ARCHITECTURES["Gemma3nForCausalLM"] = "specray.models.gemma3n:Gemma3nForCausalLM"
_MODEL_TYPES["gemma3n_text"] = "Gemma3nForCausalLM"
_TEXT_PARTS["Gemma3nForConditionalGeneration"] = ((re.compile(r"^model\.language_model\."), "model."),
                                                  (re.compile(r"^lm_head\."), "lm_head."))
# dots.llm3 / Dots3-Note's text model: DeepSeek-V3.2 with indexed, full and sliding latent-attention layers of their
# own geometry, a RoPE per kind, scaled latents, a normed RoPE key and a per-head output gate
# (specray.models.dots3_note). Its multimodal release keeps the text model under ``model.`` (transformers' modules:
# ``model.language_model.``) beside ``vision_encoder.`` and ``audio_encoder.`` (not read); its MTP tensors
# (``model.mtp.``) are left out too. A release naming Dots3NoteForCausalLM over a dots3_note config reads the same way
_ARCHITECTURES["Dots3NoteForCausalLM"] = "specray.models.dots3_note:Dots3NoteForCausalLM"
_MODEL_TYPES["dots3_note_text"] = "Dots3NoteForCausalLM"
_TEXT_PARTS["Dots3NoteForConditionalGeneration"] = _TEXT_PARTS["Dots3NoteForCausalLM"] = (
    (re.compile(r"^model\.(?:language_model\.)?(?=(?:embed_tokens|layers|norm)\.)"), "model."),
    (re.compile(r"^lm_head\."), "lm_head."))
# MiniMax-M3's text model (specray.models.minimax_m3): its multimodal release keeps it under ``language_model.model.``
# and ``language_model.lm_head.`` (transformers' modules: ``model.language_model.``, ``lm_head.``) beside the vision
# tower, its projectors and the patch-merge MLP (not read); transformers names the class
# MiniMaxM3SparseForConditionalGeneration
_ARCHITECTURES["MiniMaxM3VLForCausalLM"] = "specray.models.minimax_m3:MiniMaxM3ForCausalLM"
_MODEL_TYPES["minimax_m3_vl_text"] = "MiniMaxM3VLForCausalLM"
_TEXT_PARTS["MiniMaxM3VLForConditionalGeneration"] = _TEXT_PARTS["MiniMaxM3SparseForConditionalGeneration"] = (
    (re.compile(r"^(?:language_model\.model|model\.language_model)\."), "model."),
    (re.compile(r"^(?:language_model\.)?lm_head\."), "lm_head."))
# Persimmon: Phi's attention (q/k LayerNorms, partial RoPE) in Llama's order with LayerNorms, q/k/v fused head by head,
# a squared-ReLU MLP (specray.models.persimmon)
_ARCHITECTURES["PersimmonForCausalLM"] = "specray.models.persimmon:PersimmonForCausalLM"
_MODEL_TYPES["persimmon"] = "PersimmonForCausalLM"
# Kimi-Linear: Kimi Delta Attention layers (a per-channel decay) among DeepSeek-V3's NoPE latent attention,
# DeepSeek-V3's experts (specray.models.kimi_linear, specray.models.kimi_delta)
_ARCHITECTURES["KimiLinearForCausalLM"] = "specray.models.kimi_linear:KimiLinearForCausalLM"
_MODEL_TYPES["kimi_linear"] = "KimiLinearForCausalLM"
# Ling 3.0 hybrid: Kimi Delta Attention layers with a full-rank bounded forget gate among DeepSeek-V3's latent
# attention with RoPE and a per-head output gate, DeepSeek-V3's experts (specray.models.bailing_hybrid)
_ARCHITECTURES["BailingHybridForCausalLM"] = "specray.models.bailing_hybrid:BailingHybridForCausalLM"
_MODEL_TYPES["bailing_hybrid"] = "BailingHybridForCausalLM"
# Apertus 1.5's text model: Apertus with a vocabulary extended by visual and audio codes and an LM head that may be
# pruned to the text ids (specray.models.apertus1p5); its multimodal release keeps the text model under
# ``model.language_model.`` and ``lm_head.`` beside ``model.vision_tokenizer.`` and ``model.audio_tokenizer.``
# (not read)
_ARCHITECTURES["Apertus1p5TextForCausalLM"] = "specray.models.apertus1p5:Apertus1p5ForCausalLM"
_MODEL_TYPES["apertus1p5_text"] = "Apertus1p5TextForCausalLM"
_TEXT_PARTS["Apertus1p5ForConditionalGeneration"] = ((re.compile(r"^model\.language_model\."), "model."),
                                                     (re.compile(r"^lm_head\."), "lm_head."))
# GPT-Neo: learned positions, global and local (windowed) attention layers with unscaled scores, Llama's order with
# LayerNorms, a bias on the output projection alone, a gateless GELU MLP, a tied head (specray.models.gpt_neo)
_ARCHITECTURES["GPTNeoForCausalLM"] = "specray.models.gpt_neo:GPTNeoForCausalLM"
_MODEL_TYPES["gpt_neo"] = "GPTNeoForCausalLM"
# CodeGen: GPT-J's layers with q/k/v fused in qkv_proj in four model-parallel blocks of (q, v, k), split at load
# (specray.models.codegen)
_ARCHITECTURES["CodeGenForCausalLM"] = "specray.models.codegen:CodeGenForCausalLM"
_MODEL_TYPES["codegen"] = "CodeGenForCausalLM"
# ZAYA: Compressed Convolutional Attention (a short conv over the q/k projections, delayed values: a recurrent state
# per request) with q/k length norms, residual scaling and one expert per token from a router MLP whose state runs
# through the layers (specray.models.zaya)
_ARCHITECTURES["ZayaForCausalLM"] = "specray.models.zaya:ZayaForCausalLM"
_MODEL_TYPES["zaya"] = "ZayaForCausalLM"
# Inkling 2's text model (specray.models.inkling2): sliding and global attention with a relative position bias, L2
# clips, short convs (dynamic on the global layers' k / v), gated outputs and per-token sinks, soft-capped SwiGLU
# experts, a block attention residual. Its multimodal release keeps it under ``model.llm.`` (the release's names,
# which transformers saves) beside ``model.visual.`` (not read). The looped release is served only with
# loop_num_passes 1 (its loop is refused by name)
_ARCHITECTURES["Inkling2ForCausalLM"] = "specray.models.inkling2:Inkling2ForCausalLM"
_ARCHITECTURES["Inkling2LoopForCausalLM"] = "specray.models.inkling2:Inkling2LoopForCausalLM"
_MODEL_TYPES["inkling2_text"] = "Inkling2ForCausalLM"
_MODEL_TYPES["inkling2_loop_text"] = "Inkling2LoopForCausalLM"
_TEXT_PARTS["Inkling2ForConditionalGeneration"] = _TEXT_PARTS["Inkling2LoopForConditionalGeneration"] = (
    (re.compile(r"^model\.llm\."), "model.llm."),)
# Inkling's text model: attention with relative logits and residual short convs (a conv history per request, LFM2's
# machinery), no RoPE, a normed embedding, experts with weighted shared experts (specray.models.inkling). Its
# multimodal release keeps the text model under ``model.llm.`` in its own names (transformers' modules:
# ``model.language_model.`` and ``lm_head.``) beside ``model.visual.`` and ``model.audio.`` (not read)
_ARCHITECTURES["InklingForCausalLM"] = "specray.models.inkling:InklingForCausalLM"
_MODEL_TYPES["inkling_text"] = "InklingForCausalLM"
_TEXT_PARTS["InklingForConditionalGeneration"] = (
    (re.compile(r"^model\.llm\."), "model.llm."), (re.compile(r"^model\.language_model\."), "model."),
    (re.compile(r"^lm_head\."), "lm_head."))
# Qwen4-Exp's text model (specray.models.qwen4_exp): Gated DeltaNet layers among gated attention over the keys a QSA
# indexer keeps, Qwen3-Next's experts, hc_count residual streams joined by gated residuals, per-layer n-gram
# embeddings (PLE). Its multimodal release keeps the text model under ``model.language_model.`` beside
# ``model.visual.`` (not read) and ``lm_head.``; its MTP layer (``mtp.``) is not read either
_ARCHITECTURES["Qwen4ExpForCausalLM"] = "specray.models.qwen4_exp:Qwen4ExpForCausalLM"
_MODEL_TYPES["qwen4_exp_text"] = "Qwen4ExpForCausalLM"
_TEXT_PARTS["Qwen4ExpForConditionalGeneration"] = ((re.compile(r"^model\.language_model\."), "model."),
                                                   (re.compile(r"^lm_head\."), "lm_head."))
# Dory: a looped nGPT (weightless L2 norms, interpolating residuals, gated attention, a recurrent section run
# n_recurrent_loops times with a KV cache per loop, a scaled LM head) (specray.models.dory)
_ARCHITECTURES["DoryForCausalLM"] = "specray.models.dory:DoryForCausalLM"
_MODEL_TYPES["dory"] = "DoryForCausalLM"
# HRM-Text: an L stack run L_cycles times and an H stack once in each of H_cycles cycles, every run of a layer over
# its own K/V (specray.models.hrm_text)
_ARCHITECTURES["HrmTextForCausalLM"] = "specray.models.hrm_text:HrmTextForCausalLM"
_MODEL_TYPES["hrm_text"] = "HrmTextForCausalLM"
# Zamba (v1): Mamba-1 layers whose channel groups have their own x_proj / dt_proj, one shared transformer block over
# [stream; embedding] at the hybrid layers (Zamba2's layout: specray.models.zamba)
_ARCHITECTURES["ZambaForCausalLM"] = "specray.models.zamba:ZambaForCausalLM"
_MODEL_TYPES["zamba"] = "ZambaForCausalLM"
# JetMoE: a mixture of attention heads (per-token expert query/output projections over shared K/V) and a mixture of
# SwiGLU experts, each with its own top-k router and a bias (specray.models.jetmoe)
_ARCHITECTURES["JetMoeForCausalLM"] = "specray.models.jetmoe:JetMoeForCausalLM"
_MODEL_TYPES["jetmoe"] = "JetMoeForCausalLM"
# RecurrentGemma (Griffin): recurrent blocks (a short conv, then the RG-LRU, a gated diagonal recurrence: a recurrent
# state per request) alternating with local multi-query attention by block_types, Gemma's scaled embedding and norms,
# soft-capped logits (specray.models.recurrent_gemma)
_ARCHITECTURES["RecurrentGemmaForCausalLM"] = "specray.models.recurrent_gemma:RecurrentGemmaForCausalLM"
_MODEL_TYPES["recurrent_gemma"] = "RecurrentGemmaForCausalLM"
# DiffLlama: Llama with differential attention (two softmax maps per output head subtracted with a learned lambda,
# attended as pair heads of 2 head_dim over the same paged cache) (specray.models.diffllama)
_ARCHITECTURES["DiffLlamaForCausalLM"] = "specray.models.diffllama:DiffLlamaForCausalLM"
_MODEL_TYPES["diffllama"] = "DiffLlamaForCausalLM"
# BitNet b1.58: Llama's layer with RMSNorms before o_proj and down_proj and a squared-ReLU gate; its packed ternary
# release (quant_method bitnet) unpacked at load, activations quantized per token (specray.models.bitnet)
_ARCHITECTURES["BitNetForCausalLM"] = "specray.models.bitnet:BitNetForCausalLM"
_MODEL_TYPES["bitnet"] = "BitNetForCausalLM"
# Aria's text model: Llama's layers with experts in every layer (top-k logits softmaxed, fused [E, H, 2I] experts) and
# shared experts (specray.models.aria); its multimodal release keeps it under ``language_model.model.`` and
# ``language_model.lm_head.`` (transformers' modules: ``model.language_model.``, ``lm_head.``) beside the vision tower
# and projector (not read)
_ARCHITECTURES["AriaTextForCausalLM"] = "specray.models.aria:AriaTextForCausalLM"
_MODEL_TYPES["aria_text"] = "AriaTextForCausalLM"
_TEXT_PARTS["AriaForConditionalGeneration"] = (
    (re.compile(r"^(?:language_model\.model|model\.language_model)\."), "model."),
    (re.compile(r"^(?:language_model\.)?lm_head\."), "lm_head."))
# Phi-4-multimodal's text model: Phi-3's layers; its image encoder (``model.embed_tokens_extend.image_embed.``) and
# its projections' built-in vision / speech LoRA adapters are not read, the base weights (the release's
# ``base_layer``) serve text (specray.models.phi4_multimodal). Its config is flat (no text_config): the architecture is
# served by the text class itself. transformers' layout takes audio: its Conformer encoder and speech projector
# (``model.embed_tokens_extend.audio_embed.``) into the <|audio|> rows (specray.models.phi4_multimodal_audio).
# Phi4MMForCausalLM / phi4mm: the release's own layout (its config class is remote code), text only
_ARCHITECTURES["Phi4MultimodalForCausalLM"] = "specray.models.phi4_multimodal:Phi4MultimodalForCausalLM"
_MULTIMODAL["Phi4MultimodalForCausalLM"] = ("specray.models.phi4_multimodal_audio:Phi4MultimodalAudioEncoder",
                                            "specray.models.phi4_multimodal_audio:Phi4MultimodalAudioProcessor")
_ARCHITECTURES["Phi4MMForCausalLM"] = "specray.models.phi4_multimodal:Phi4MultimodalForCausalLM"
_MODEL_TYPES["phi4_multimodal"] = "Phi4MultimodalForCausalLM"
_MODEL_TYPES["phi4mm"] = "Phi4MMForCausalLM"
# Doge (SmallDoge): Llama's layers with dynamic mask attention (a per-key bias from each token's values, cached per
# slot beside its K/V, top keep_window_size keys per query), q/k norms and learned residual scales
# (specray.models.doge)
_ARCHITECTURES["DogeForCausalLM"] = "specray.models.doge:DogeForCausalLM"
_MODEL_TYPES["doge"] = "DogeForCausalLM"
# Emu3's text model: Llama's layers over a vocabulary holding the VQ-VAE's image codes (specray.models.emu3); its
# multimodal release keeps it under ``text_model.model.`` and ``text_model.lm_head.`` (transformers' modules:
# ``model.text_model.``, ``lm_head.``) beside the VQ-VAE (``vqmodel.``, not read)
_ARCHITECTURES["Emu3ForCausalLM"] = "specray.models.emu3:Emu3ForCausalLM"
_MODEL_TYPES["emu3_text_model"] = "Emu3ForCausalLM"
_TEXT_PARTS["Emu3ForConditionalGeneration"] = (
    (re.compile(r"^(?:text_model\.model|model\.text_model)\."), "model."),
    (re.compile(r"^(?:text_model\.)?lm_head\."), "lm_head."))
# GPT-NeoX-Japanese: GPT-NeoX's fused q/k/v and partial RoPE in Llama's order, bias-free but for the last layer's
# attention output (dense_bias), an MLP intermediate_multiple_size times wide (specray.models.gpt_neox_japanese)
_ARCHITECTURES["GPTNeoXJapaneseForCausalLM"] = "specray.models.gpt_neox_japanese:GPTNeoXJapaneseForCausalLM"
_MODEL_TYPES["gpt_neox_japanese"] = "GPTNeoXJapaneseForCausalLM"
# XGLM: fairseq's sinusoidal positions (offset 2) added to the scaled token embedding, pre-LayerNorms, biases
# everywhere, a gateless MLP, the head tied (specray.models.xglm)
_ARCHITECTURES["XGLMForCausalLM"] = "specray.models.xglm:XGLMForCausalLM"
_MODEL_TYPES["xglm"] = "XGLMForCausalLM"
# Llama 3.2 Vision's text model: Llama 3's layers among cross-attention layers, which transformers skips entirely for a
# text-only prompt (specray.models.mllama: skipped, their tensors unread; an embedding of vocab_size + 8 rows); its
# multimodal release keeps it under ``language_model.model.`` and ``language_model.lm_head.`` (transformers' modules:
# ``model.language_model.``, ``lm_head.``) beside ``vision_model.`` and ``multi_modal_projector.`` (not read)
_ARCHITECTURES["MllamaForCausalLM"] = "specray.models.mllama:MllamaForCausalLM"
_MODEL_TYPES["mllama_text_model"] = "MllamaForCausalLM"
_TEXT_PARTS["MllamaForConditionalGeneration"] = (
    (re.compile(r"^(?:language_model\.model|model\.language_model)\."), "model."),
    (re.compile(r"^(?:language_model\.)?lm_head\."), "lm_head."))
# OpenAI GPT (the first GPT): GPT-2's Conv1D projections and learned positions with post-LayerNorm blocks (OPT-350M's
# layer), no norm after the last layer, its afn activations (specray.models.openai_gpt)
_ARCHITECTURES["OpenAIGPTLMHeadModel"] = "specray.models.openai_gpt:OpenAIGPTLMHeadModel"
_MODEL_TYPES["openai-gpt"] = "OpenAIGPTLMHeadModel"
# RWKV-4: token shifts and the WKV recurrence (per-channel decay and bonus, a running max for stability) as recurrent
# mixers of width-2 convs, squared-ReLU channel mixing, rescale_every's halvings (specray.models.rwkv)
_ARCHITECTURES["RwkvForCausalLM"] = "specray.models.rwkv:RwkvForCausalLM"
_MODEL_TYPES["rwkv"] = "RwkvForCausalLM"
# xLSTM (NX-AI's xLSTM-7b): mLSTM blocks alone, a matrix memory per head with exponential input gates, a normalizer
# and a max-stabilizer, kept as a recurrent state per request (specray.models.xlstm)
_ARCHITECTURES["xLSTMForCausalLM"] = "specray.models.xlstm:XLSTMForCausalLM"
_MODEL_TYPES["xlstm"] = "xLSTMForCausalLM"
# CTRL: sinusoidal positions (sin of the even features' angles, then cos of the odd ones', no offset) added to the
# scaled token embedding, pre-LayerNorms, biases everywhere, a ReLU MLP, a tied head with a bias (specray.models.ctrl)
_ARCHITECTURES["CTRLLMHeadModel"] = "specray.models.ctrl:CTRLLMHeadModel"
_MODEL_TYPES["ctrl"] = "CTRLLMHeadModel"
# BioGPT: learned positions from row position + 2 added to the scaled token embedding, pre-LayerNorms (eps 1e-5),
# biases everywhere, a gateless MLP, a tied head (specray.models.biogpt)
_ARCHITECTURES["BioGptForCausalLM"] = "specray.models.biogpt:BioGptForCausalLM"
_MODEL_TYPES["biogpt"] = "BioGptForCausalLM"
# ModernBERT's decoder (Ettin): global and local (sliding) layers with a RoPE per kind, LayerNorms without bias (one
# after the embedding, none before layer 0's attention), a GeGLU MLP (Wi, Wo), a dense + norm prediction head before
# the tied decoder (specray.models.modernbert_decoder)
_ARCHITECTURES["ModernBertDecoderForCausalLM"] = "specray.models.modernbert_decoder:ModernBertDecoderForCausalLM"
_MODEL_TYPES["modernbert-decoder"] = "ModernBertDecoderForCausalLM"
# Gemma 4 Unified (specray.models.gemma4_unified): Gemma 4's text model without per-layer inputs or experts; its
# encoder-free multimodal release keeps it under ``model.language_model.`` beside ``model.embed_vision.`` and
# ``model.embed_audio.`` (not read); ``lm_head.`` (tied) at the top
_ARCHITECTURES["Gemma4UnifiedForCausalLM"] = "specray.models.gemma4_unified:Gemma4UnifiedForCausalLM"
_MODEL_TYPES["gemma4_unified_text"] = "Gemma4UnifiedForCausalLM"
_TEXT_PARTS["Gemma4UnifiedForConditionalGeneration"] = ((re.compile(r"^model\.language_model\."), "model."),
                                                        (re.compile(r"^lm_head\."), "lm_head."))
# Model types transformers serves through another family's class with config classes and tensor names of their own
# (specray.models.aliases): EXAONE 3.0 / 3.5 (Llama, GPT-2-style names), InternLM3 and IQuest-Coder (Llama), Sarvam's
# 105B (DeepSeek-V3) and 30B (GLM-4.5, Bailing's names, q/k/v fused); transformers saves them naming the family's
# class, so they are picked by model type first
_ARCHITECTURES.update({arch: f"specray.models.aliases:{arch}" for arch in (
    "ExaoneForCausalLM", "InternLM3ForCausalLM", "IQuestCoderForCausalLM", "SarvamMLAForCausalLM",
    "SarvamMoEForCausalLM")})
_MODEL_TYPES.update({"exaone": "ExaoneForCausalLM", "internlm3": "InternLM3ForCausalLM",
                     "iquestcoder": "IQuestCoderForCausalLM", "sarvam_mla": "SarvamMLAForCausalLM",
                     "sarvam_moe": "SarvamMoEForCausalLM"})
_BY_MODEL_TYPE.update(("exaone", "internlm3", "iquestcoder", "sarvam_mla", "sarvam_moe"))
# Fuyu (fuyu-8b): Persimmon's text model behind a linear patch embedder; a text-only prompt runs Persimmon alone (the
# embedder only replaces image placeholders' embeddings). The release keeps it under ``language_model.model.`` and
# ``language_model.lm_head.`` (transformers' modules: ``model.language_model.``, ``lm_head.``) beside
# ``vision_embed_tokens.`` (not read)
_TEXT_PARTS["FuyuForCausalLM"] = ((re.compile(r"^(?:language_model\.model|model\.language_model)\."), "model."),
                                  (re.compile(r"^(?:language_model\.)?lm_head\."), "lm_head."))
# LLaVA (LLaVA 1.5 and the releases of its layout): the text model its text_config names (Llama, Mistral, Qwen2, ...)
# under ``language_model.model.`` / ``language_model.lm_head.`` (the releases' and what transformers 5 saves) or
# ``model.language_model.`` / ``lm_head.`` (transformers' modules'); its images through a CLIP or SigLIP vision tower
# and the two-layer projector (specray.models.llava, specray.models.vision_towers)
_TEXT_PARTS["LlavaForConditionalGeneration"] = (
    (re.compile(r"^(?:language_model\.model|model\.language_model)\."), "model."),
    (re.compile(r"^(?:language_model\.)?lm_head\."), "lm_head."))
_MULTIMODAL["LlavaForConditionalGeneration"] = ("specray.models.llava:LlavaImageEncoder",
                                                "specray.models.llava:LlavaImageProcessor")
# Mistral 3 with images (specray.models.mistral3): Pixtral's vision tower (specray.models.pixtral_vision) and Mistral
# 3's projector (RMSNorm, the spatial patch merger, two linears); the processor expands each [IMG] into rows of [IMG]
# closed by [IMG_BREAK] / [IMG_END]. Its text (a Mistral) is under ``language_model.model.`` and
# ``language_model.lm_head.`` as released (and as transformers saves it), ``model.language_model.`` and ``lm_head.``
# as transformers' modules name it: both read
_TEXT_PARTS["Mistral3ForConditionalGeneration"] = (
    (re.compile(r"^(?:language_model\.model|model\.language_model)\."), "model."),
    (re.compile(r"^(?:language_model\.)?lm_head\."), "lm_head."))
_MULTIMODAL["Mistral3ForConditionalGeneration"] = ("specray.models.mistral3:Mistral3ImageEncoder",
                                                   "specray.models.mistral3:Mistral3Processor")
# Qwen2-VL and Qwen2.5-VL with images (specray.models.qwen2_vl_vision): their vision towers and patch mergers, the
# <|image_pad|> placeholder expanded per merged patch, multimodal RoPE positions (the text model's rotary tables take
# them through mrope_section); Qwen2-VL's text model is a Qwen2, its tensors where Qwen2.5-VL's are
_MODEL_TYPES["qwen2_vl_text"] = "Qwen2ForCausalLM"
_TEXT_PARTS["Qwen2VLForConditionalGeneration"] = _QWEN_VL_TEXT
_MULTIMODAL["Qwen2VLForConditionalGeneration"] = ("specray.models.qwen2_vl_vision:Qwen2VLImageEncoder",
                                                  "specray.models.qwen2_vl_vision:QwenVLImageProcessor")
_MULTIMODAL["Qwen2_5_VLForConditionalGeneration"] = ("specray.models.qwen2_vl_vision:Qwen2_5_VLImageEncoder",
                                                     "specray.models.qwen2_vl_vision:QwenVLImageProcessor")
# LLaVA-NeXT (llava-v1.6-mistral-7b / vicuna / 34b, specray.models.llava_next): LLaVA's CLIP tower and projector over
# the base image and its any-resolution tiles, unpadded to the image's aspect, a learned newline closing each row; its
# text model (Mistral, Llama, Yi as a Llama) where LLaVA's is
_TEXT_PARTS["LlavaNextForConditionalGeneration"] = _TEXT_PARTS["LlavaForConditionalGeneration"]
_MULTIMODAL["LlavaNextForConditionalGeneration"] = ("specray.models.llava_next:LlavaNextImageEncoder",
                                                    "specray.models.llava_next:LlavaNextImageProcessor")
# Qwen3-VL and Qwen3-VL-MoE with images (specray.models.qwen3_vl_vision): the vision tower with learned position
# embeddings resampled to each image, its patch merger and DeepStack mergers (their features added to the image rows
# after the text model's first layers: llama.add_deepstack), Qwen2-VL's processor and positions, the text rotary
# tables' interleaved sections (mrope_interleaved); the text models are served as _TEXT_PARTS says above
_MULTIMODAL["Qwen3VLForConditionalGeneration"] = ("specray.models.qwen3_vl_vision:Qwen3VLImageEncoder",
                                                  "specray.models.qwen3_vl_vision:Qwen3VLImageProcessor")
_MULTIMODAL["Qwen3VLMoeForConditionalGeneration"] = ("specray.models.qwen3_vl_vision:Qwen3VLImageEncoder",
                                                     "specray.models.qwen3_vl_vision:Qwen3VLImageProcessor")
# Llama 4 Scout / Maverick with images (specray.models.llama4_vision): the tiled vision model (unfolded patches, class
# token, 2D RoPE, pixel-shuffle adapter) and projector into the <|patch|> rows; the <|image|> placeholder expanded as
# Llama4Processor writes it (tiles, separators, the global tile); the text model served as _TEXT_PARTS says above
_MULTIMODAL["Llama4ForConditionalGeneration"] = ("specray.models.llama4_vision:Llama4ImageEncoder",
                                                 "specray.models.llama4_vision:Llama4ImageProcessor")
# Gemma 3 with images (specray.models.gemma3_images): SigLIP's vision tower and Gemma 3's projector (the patch grid
# averaged to mm_tokens_per_image, Gemma's RMSNorm, mm_input_projection_weight); <start_of_image> expanded as
# Gemma3Processor writes it, its soft tokens attending to each other both ways; the text as _TEXT_PARTS says above
_MULTIMODAL["Gemma3ForConditionalGeneration"] = ("specray.models.gemma3_images:Gemma3ImageEncoder",
                                                 "specray.models.gemma3_images:Gemma3ImageProcessor")
# InternVL (InternVL3 / InternVL3.5 -hf releases, specray.models.internvl): the InternViT tower (layer scale, optional
# q/k RMSNorms), pixel shuffle and a LayerNorm-led two-linear projector over GotOcr2's tiles, each tile's context tokens
# between <img> and </img>; its text model (Qwen2, Qwen3, Llama) under ``language_model.model.`` /
# ``language_model.lm_head.`` (what transformers 5 saves) or ``model.language_model.`` / ``lm_head.`` (its modules')
_TEXT_PARTS["InternVLForConditionalGeneration"] = (
    (re.compile(r"^(?:language_model\.model|model\.language_model)\."), "model."),
    (re.compile(r"^(?:language_model\.)?lm_head\."), "lm_head."))
_MULTIMODAL["InternVLForConditionalGeneration"] = ("specray.models.internvl:InternVLImageEncoder",
                                                   "specray.models.internvl:InternVLImageProcessor")
# Idefics3 and SmolVLM / SmolVLM2 with images (specray.models.idefics3): a SigLIP-like vision model over the image's
# crops and its global image, the pixel-shuffle connector; <image> expanded as Idefics3Processor / SmolVLMProcessor
# write it (<fake_token_around_image>, <row_r_col_c>, <global-img>); the text model (a Llama) under model.text_model.*
_TEXT_PARTS["Idefics3ForConditionalGeneration"] = _TEXT_PARTS["SmolVLMForConditionalGeneration"] = (
    (re.compile(r"^model\.text_model\."), "model."), (re.compile(r"^lm_head\."), "lm_head."))
_MULTIMODAL["Idefics3ForConditionalGeneration"] = ("specray.models.idefics3:Idefics3ImageEncoder",
                                                   "specray.models.idefics3:Idefics3ImageProcessor")
_MULTIMODAL["SmolVLMForConditionalGeneration"] = _MULTIMODAL["Idefics3ForConditionalGeneration"]
# GLM-4.1V and GLM-4.5V (specray.models.glm4v): their text models on GLM-4's and GLM-4.5's classes (a view of the text
# config as that family's, multimodal RoPE through mrope_section), read under ``model.language_model.`` beside
# ``model.visual.`` (Qwen-VL's patterns); their images through the GLM-4V vision tower (learned positions resampled
# bicubically, downsample conv, gated merger) and Qwen2-VL's processor and positions (<|image|> once per merged token)
_ARCHITECTURES["Glm4vTextForCausalLM"] = "specray.models.glm4v:Glm4vTextForCausalLM"
_ARCHITECTURES["Glm4vMoeTextForCausalLM"] = "specray.models.glm4v:Glm4vMoeTextForCausalLM"
_MODEL_TYPES.update({"glm4v_text": "Glm4vTextForCausalLM", "glm4v_moe_text": "Glm4vMoeTextForCausalLM"})
_TEXT_PARTS["Glm4vForConditionalGeneration"] = _TEXT_PARTS["Glm4vMoeForConditionalGeneration"] = _QWEN_VL_TEXT
_MULTIMODAL["Glm4vForConditionalGeneration"] = ("specray.models.glm4v:Glm4vImageEncoder",
                                                "specray.models.glm4v:Glm4vImageProcessor")
_MULTIMODAL["Glm4vMoeForConditionalGeneration"] = ("specray.models.glm4v:Glm4vImageEncoder",
                                                   "specray.models.glm4v:Glm4vImageProcessor")
# Aya Vision (aya-vision-8b / 32b, specray.models.aya_vision): SigLIP's tower over GotOcr2's tiles, pixel shuffle and
# a SwiGLU projector; <image> written out as AyaVisionProcessor writes it (tile markers, patch tokens); its text model
# a Cohere2 under ``language_model.model.`` / ``language_model.lm_head.`` or ``model.language_model.`` / ``lm_head.``
_TEXT_PARTS["AyaVisionForConditionalGeneration"] = (
    (re.compile(r"^(?:language_model\.model|model\.language_model)\."), "model."),
    (re.compile(r"^(?:language_model\.)?lm_head\."), "lm_head."))
_MULTIMODAL["AyaVisionForConditionalGeneration"] = ("specray.models.aya_vision:AyaVisionImageEncoder",
                                                    "specray.models.aya_vision:AyaVisionImageProcessor")
# transformers' AyaVisionForConditionalGeneration computes its logits with a plain lm_head: the Cohere2 text config's
# logit_scale is not applied
_TEXT_CONFIG_FIXES["AyaVisionForConditionalGeneration"] = {"logit_scale": 1.0}
# EXAONE 4.5 images (specray.models.exaone4_5_vision): Qwen2.5-VL's vision tower with grouped-query attention
# (vision_config.num_key_value_heads) and Qwen2-VL's processor (<|image_pad|> once per merged token); its EXAONE 4.0
# text model takes plain 1D positions
_MULTIMODAL["Exaone4_5_ForConditionalGeneration"] = ("specray.models.exaone4_5_vision:Exaone4_5ImageEncoder",
                                                     "specray.models.exaone4_5_vision:Exaone4_5ImageProcessor")
# Qwen3.5 / Qwen3.5-MoE images (specray.models.qwen3_5_vision): Qwen3-VL's vision tower and merger without DeepStack,
# Qwen3-VL's processor and positions (<|image_pad|> once per merged token); their hybrid text models (specray.models
# .qwen3_5, already in _TEXT_PARTS) take the image rows and the interleaved multimodal RoPE positions
_MULTIMODAL["Qwen3_5ForConditionalGeneration"] = ("specray.models.qwen3_5_vision:Qwen3_5ImageEncoder",
                                                  "specray.models.qwen3_5_vision:Qwen3_5ImageProcessor")
_MULTIMODAL["Qwen3_5MoeForConditionalGeneration"] = _MULTIMODAL["Qwen3_5ForConditionalGeneration"]

# Kimi K2.5 / K2.6's images (specray.models.kimi_k25_vision): the MoonViT tower (learned positions resampled
# bicubically, a 2D RoPE, bidirectional attention over the image) and the patch-merging projector;
# <|media_pad|> once per merged token; the DeepSeek-V3 text model (already in _TEXT_PARTS) takes the image rows
_MULTIMODAL["Kimi_K25ForConditionalGeneration"] = ("specray.models.kimi_k25_vision:KimiK25ImageEncoder",
                                                   "specray.models.kimi_k25_vision:KimiK25ImageProcessor")
_MULTIMODAL["KimiK25ForConditionalGeneration"] = _MULTIMODAL["Kimi_K25ForConditionalGeneration"]
# Nemotron 3 Nano Omni with images (specray.models.nemotron_h_omni_vision): the C-RADIO tower (CPE positions resampled
# to each image's patch grid, class and register tokens, InternViT's layer math), pixel shuffle and the squared-ReLU
# projector; <image> expanded to <img>, one <image> per merged token, </img>; its Nemotron-H text as _TEXT_PARTS says
_MULTIMODAL["NemotronH_Omni_Reasoning_V3"] = ("specray.models.nemotron_h_omni_vision:NemotronHOmniImageEncoder",
                                              "specray.models.nemotron_h_omni_vision:NemotronHOmniImageProcessor")
# Cohere Compass images (specray.models.cohere_compass_vision): Qwen3-VL's vision tower, DeepStack mergers and
# processor (<|IMAGE_PAD|> once per merged token, Qwen3-VL's multimodal RoPE positions), its text model rotating them
# per kind of layer (interleaved sections)
_MULTIMODAL["CohereCompassForConditionalGeneration"] = (
    "specray.models.cohere_compass_vision:CohereCompassImageEncoder",
    "specray.models.cohere_compass_vision:CohereCompassImageProcessor")
# Gemma 4 with images (specray.models.gemma4_images): Gemma 4's vision model (patches with learned 2D positions, a 2D
# RoPE, Gemma 4's norms, the pooled grid scaled by sqrt(hidden)) and its embedder into the <|image|> rows, between boi
# and eoi as Gemma4Processor writes them; with use_bidirectional_attention "vision" an image's soft tokens see each
# other both ways in the sliding layers (the full layers stay causal); no audio or video; the text as _TEXT_PARTS says
_MULTIMODAL["Gemma4ForConditionalGeneration"] = ("specray.models.gemma4_images:Gemma4ImageEncoder",
                                                 "specray.models.gemma4_images:Gemma4ImageProcessor")
# Apertus 1.5 with images (specray.models.apertus1p5_vision): each image tokenized into discrete codes by its VQGAN
# vision tokenizer (float32, argmax over the IBQ codebook), the codes' rows of the text model's embedding in place of
# the image tokens that Apertus1p5Processor writes (grid header, rows joined by end-of-line tokens); text as above
_MULTIMODAL["Apertus1p5ForConditionalGeneration"] = ("specray.models.apertus1p5_vision:Apertus1p5ImageEncoder",
                                                     "specray.models.apertus1p5_vision:Apertus1p5ImageProcessor")
# LLaVA-OneVision (specray.models.llava_onevision): a Qwen2 text model in LLaVA's layout (``language_model.model.`` /
# ``language_model.lm_head.``, or transformers' modules' ``model.language_model.`` / ``lm_head.``); its images through
# SigLIP's tower, LLaVA's projector and LLaVA-NeXT's any-resolution tiles, the grid bounded by "anyres_max_N"
_TEXT_PARTS["LlavaOnevisionForConditionalGeneration"] = _TEXT_PARTS["LlavaForConditionalGeneration"]
_MULTIMODAL["LlavaOnevisionForConditionalGeneration"] = (
    "specray.models.llava_onevision:LlavaOnevisionImageEncoder",
    "specray.models.llava_onevision:LlavaOnevisionImageProcessor")
# Gemma 4 Unified with images (specray.models.gemma4_unified_images): the encoder-free embedder (merged 48x48 patches
# LayerNormed, projected and LayerNormed, factorized column + row positions, LayerNorm, then the multimodal embedder)
# into the <|image|> rows between boi and eoi as Gemma4UnifiedProcessor writes them; with use_bidirectional_attention
# "vision" an image's soft tokens see each other both ways in every layer; no audio or video; text as _TEXT_PARTS says
_MULTIMODAL["Gemma4UnifiedForConditionalGeneration"] = (
    "specray.models.gemma4_unified_images:Gemma4UnifiedImageEncoder",
    "specray.models.gemma4_unified_images:Gemma4UnifiedImageProcessor")
# PaliGemma / PaliGemma 2 (specray.models.paligemma): a Gemma (PaliGemma) or Gemma 2 (PaliGemma 2) text model in
# LLaVA's layout (``language_model.model.``, its head tied; transformers' modules: ``model.language_model.``,
# ``lm_head.``); its images through SigLIP's tower and one linear, the whole prompt (images, <bos>, text, "\n") one
# span attending both ways
_TEXT_PARTS["PaliGemmaForConditionalGeneration"] = _TEXT_PARTS["LlavaForConditionalGeneration"]
_MULTIMODAL["PaliGemmaForConditionalGeneration"] = ("specray.models.paligemma:PaliGemmaImageEncoder",
                                                    "specray.models.paligemma:PaliGemmaImageProcessor")
# (PaliGemma's config sets its text model's use_bidirectional_attention, but the whole model hands that text model a
# mask of its own: causal, the prompt's prefix both ways, which the image item's bidirectional span gives us)
_TEXT_CONFIG_FIXES["PaliGemmaForConditionalGeneration"] = {"use_bidirectional_attention": False}
# Emu3's images: the VQ-VAE's encoder (2D levels, then causal temporal convs over the repeated frame) gives discrete
# codes, mapped to their visual tokens' ids with an end-of-line id per row (specray.models.emu3_vision)
_MULTIMODAL["Emu3ForConditionalGeneration"] = ("specray.models.emu3_vision:Emu3ImageEncoder",
                                               "specray.models.emu3_vision:Emu3ImageProcessor")
# Qwen2.5-Omni's thinker (specray.models.qwen2_5_omni), text out only: a Qwen2 with Qwen2.5-VL's multimodal RoPE (its
# text_config) under ``model.`` (transformers 5's modules: ``model.language_model.``; the whole release: ``thinker.
# model.``) beside its audio tower and vision tower, ``lm_head.`` / ``thinker.lm_head.``; its audios through the
# windowed Whisper-style audio tower into the <|AUDIO|> rows, its images through Qwen2.5-VL's tower, TMRoPE positions.
# The whole release (Qwen2_5OmniModel as Qwen/Qwen2.5-Omni-3B / 7B's config.json names it,
# Qwen2_5OmniForConditionalGeneration as transformers does) keeps the thinker's config under thinker_config; its talker
# and token2wav (speech out) are not read
_QWEN_OMNI_TEXT = ((re.compile(r"^(?:thinker\.)?model\.(?:language_model\.)?(?!visual\.|audio_tower\.)"), "model."),
                   (re.compile(r"^(?:thinker\.)?lm_head\."), "lm_head."))
_MODEL_TYPES["qwen2_5_omni_text"] = "Qwen2ForCausalLM"
_TEXT_HOLDERS.update(Qwen2_5OmniModel="thinker_config", Qwen2_5OmniForConditionalGeneration="thinker_config")
_TEXT_PARTS.update(dict.fromkeys(("Qwen2_5OmniThinkerForConditionalGeneration", "Qwen2_5OmniModel",
                                  "Qwen2_5OmniForConditionalGeneration"), _QWEN_OMNI_TEXT))
_MULTIMODAL.update(dict.fromkeys(("Qwen2_5OmniThinkerForConditionalGeneration", "Qwen2_5OmniModel",
                                  "Qwen2_5OmniForConditionalGeneration"),
                                 ("specray.models.qwen2_5_omni:Qwen2_5OmniEncoder",
                                  "specray.models.qwen2_5_omni:Qwen2_5OmniProcessor")))
# Qwen2-Audio (specray.models.qwen2_audio) and Audio Flamingo 3 (specray.models.audioflamingo3) with audio: a
# Whisper-style encoder with an average pool (specray.models.whisper_audio, the padded frames masked as keys) and the
# release's projector (one linear; two linears) into the <|AUDIO|> / <sound> rows, as Qwen2AudioProcessor /
# AudioFlamingo3Processor expand them (Audio Flamingo 3: 30 s windows); their Qwen2 text models in LLaVA's layout
# (``language_model.model.`` / ``language_model.lm_head.``, or ``model.language_model.`` / ``lm_head.``)
_TEXT_PARTS["Qwen2AudioForConditionalGeneration"] = _TEXT_PARTS["LlavaForConditionalGeneration"]
_TEXT_PARTS["AudioFlamingo3ForConditionalGeneration"] = _TEXT_PARTS["LlavaForConditionalGeneration"]
_MULTIMODAL["Qwen2AudioForConditionalGeneration"] = ("specray.models.qwen2_audio:Qwen2AudioEncoder",
                                                     "specray.models.qwen2_audio:Qwen2AudioProcessor")
_MULTIMODAL["AudioFlamingo3ForConditionalGeneration"] = ("specray.models.audioflamingo3:AudioFlamingo3Encoder",
                                                         "specray.models.audioflamingo3:AudioFlamingo3Processor")
# Granite Speech (granite-speech-3.x) and Granite Speech Plus with audio (specray.models.granite_speech): log-mel
# features (redone with torch: transformers' extractor needs torchaudio), a CTC Conformer encoder (block-wise
# attention with Shaw's relative positions, depthwise convs, the mid-layer CTC self-conditioning; plus: chosen layers'
# states concatenated) and a windowed Q-former projector into the <|audio|> rows GraniteSpeechProcessor writes; the
# Granite text model in LLaVA's layout (``language_model.model.`` / ``language_model.lm_head.``, or transformers'
# modules' ``model.language_model.`` / ``lm_head.``)
for _arch in ("GraniteSpeechForConditionalGeneration", "GraniteSpeechPlusForConditionalGeneration"):
    _TEXT_PARTS[_arch] = _TEXT_PARTS["LlavaForConditionalGeneration"]
    _MULTIMODAL[_arch] = ("specray.models.granite_speech:GraniteSpeechAudioEncoder",
                          "specray.models.granite_speech:GraniteSpeechAudioProcessor")
del _arch
# GLM-ASR (GLM-ASR-Nano-2512, specray.models.glmasr): a Llama text model under ``language_model.model.`` (transformers'
# modules: ``model.language_model.``), its head tied; its audio through the rotary Whisper-style encoder, the merge of
# four frames and the two-layer projector into the <|pad|> rows GlmAsrProcessor writes (one per embedding); no images
_TEXT_PARTS["GlmAsrForConditionalGeneration"] = _TEXT_PARTS["LlavaForConditionalGeneration"]
_MULTIMODAL["GlmAsrForConditionalGeneration"] = ("specray.models.glmasr:GlmAsrAudioEncoder",
                                                 "specray.models.glmasr:GlmAsrAudioProcessor")
# (Granite Speech's and Granite Speech Plus's whole model: its plain lm_head does not divide by the Granite text
# config's logits_scaling, as transformers computes it; vLLM's GraniteForCausalLM-based model does divide)
_TEXT_CONFIG_FIXES.update({arch: {"logits_scaling": 1.0} for arch in ("GraniteSpeechForConditionalGeneration",
                                                                       "GraniteSpeechPlusForConditionalGeneration")})
# Music Flamingo (specray.models.musicflamingo): Audio Flamingo 3's encoder, windows and projector with a rotary time
# embedding between them (each row turned by its window's index and its time in seconds), each audio's <sound> rows
# between <|sound_bos|> and <|sound_eos|>; its Qwen2 text model where Audio Flamingo 3's is
_TEXT_PARTS["MusicFlamingoForConditionalGeneration"] = _TEXT_PARTS["LlavaForConditionalGeneration"]
_MULTIMODAL["MusicFlamingoForConditionalGeneration"] = ("specray.models.musicflamingo:MusicFlamingoEncoder",
                                                        "specray.models.musicflamingo:MusicFlamingoProcessor")
# Qwen3-Omni-MoE's thinker (specray.models.qwen3_omni_moe), text out only: a Qwen3-MoE text model with Qwen3-VL's
# interleaved multimodal RoPE (its ``qwen3_omni_moe_text`` text_config) where Qwen2.5-Omni's is (``model.`` or
# ``model.language_model.`` in the thinker, ``thinker.model.`` in the whole release, whose config.json names it
# Qwen3OmniMoeForConditionalGeneration and keeps the thinker's config under thinker_config; its talker and code2wav
# are not read); its audios through the three-conv2d windowed audio encoder into the <|audio_pad|> rows, its images
# through Qwen3-VL's tower and DeepStack mergers, TMRoPE positions
_MODEL_TYPES["qwen3_omni_moe_text"] = "Qwen3MoeForCausalLM"
_TEXT_HOLDERS["Qwen3OmniMoeForConditionalGeneration"] = "thinker_config"
_TEXT_PARTS.update(dict.fromkeys(("Qwen3OmniMoeThinkerForConditionalGeneration",
                                  "Qwen3OmniMoeForConditionalGeneration"), _QWEN_OMNI_TEXT))
_MULTIMODAL.update(dict.fromkeys(("Qwen3OmniMoeThinkerForConditionalGeneration",
                                  "Qwen3OmniMoeForConditionalGeneration"),
                                 ("specray.models.qwen3_omni_moe:Qwen3OmniMoeEncoder",
                                  "specray.models.qwen3_omni_moe:Qwen3OmniMoeProcessor")))
# Qwen3-ASR: a Qwen3 text model (text_config) under model.language_model.* and lm_head.*, Qwen3-Omni's audio encoder
# (model.audio_tower.*) with its projector moved out (model.multi_modal_projector.*) into the <|audio_pad|> rows
# (specray.models.qwen3_asr)
_TEXT_PARTS["Qwen3ASRForConditionalGeneration"] = ((re.compile(r"^model\.language_model\."), "model."),
                                                   (re.compile(r"^lm_head\."), "lm_head."))
_MULTIMODAL["Qwen3ASRForConditionalGeneration"] = ("specray.models.qwen3_asr:Qwen3ASREncoder",
                                                   "specray.models.qwen3_asr:Qwen3ASRProcessor")
# OmniASR's LLM recognisers: a Llama text model (text_config) under model.language_model.* and lm_head.*, a wav2vec 2.0
# encoder over the raw waveform (model.audio_tower.*) and one linear (model.multi_modal_projector) into its audio
# placeholder's rows (specray.models.omniasr)
_TEXT_PARTS["OmniASRForConditionalGeneration"] = _TEXT_PARTS["Qwen3ASRForConditionalGeneration"]
_MULTIMODAL["OmniASRForConditionalGeneration"] = ("specray.models.omniasr:OmniASREncoder",
                                                  "specray.models.omniasr:OmniASRProcessor")
# Fun-ASR-Nano: a Qwen3 text model (text_config) under model.language_model.* and lm_head.*, SenseVoice's SAN-M
# encoder (model.audio_tower.*) over Kaldi filterbanks stacked at a low frame rate, and the projector with its adaptor
# layers (model.multi_modal_projector.*) into the audio placeholder's rows (specray.models.fun_asr_nano)
_TEXT_PARTS["FunAsrNanoForConditionalGeneration"] = _TEXT_PARTS["Qwen3ASRForConditionalGeneration"]
_MULTIMODAL["FunAsrNanoForConditionalGeneration"] = ("specray.models.fun_asr_nano:FunAsrNanoEncoder",
                                                     "specray.models.fun_asr_nano:FunAsrNanoProcessor")

# granite-vision-3.x (LLaVA-NeXT with a Granite text model; LLaVA 1.5's and LLaVA-OneVision's layouts alike): the
# whole model's plain lm_head does not divide by the Granite text config's logits_scaling, as transformers computes
# it (the encoders scale their rows by its embedding_multiplier: specray.models.llava.input_embeds_scale)
_TEXT_CONFIG_FIXES.update({arch: {"logits_scaling": 1.0} for arch in ("LlavaForConditionalGeneration",
                                                                       "LlavaNextForConditionalGeneration",
                                                                       "LlavaOnevisionForConditionalGeneration")})
# Gemma 3n's audio (specray.models.gemma3n_audio): the USM-style Conformer audio tower and embed_audio into the
# audio soft tokens' rows (and <end_of_audio>'s); images (timm's MobileNetV5 tower) are refused by name
_MULTIMODAL["Gemma3nForConditionalGeneration"] = ("specray.models.gemma3n_audio:Gemma3nAudioEncoder",
                                                  "specray.models.gemma3n_audio:Gemma3nAudioProcessor")
# Nemotron 3 Nano Omni with audio (specray.models.nemotron_h_omni_audio): the image encoder and processor above with
# the Parakeet (FastConformer) encoder and sound projector added where config.json has an audio_config; <so_embedding>
# expanded to <so_start>, one <so_embedding> per embedding, <so_end>; one processor for images and audio
_MULTIMODAL["NemotronH_Omni_Reasoning_V3"] = ("specray.models.nemotron_h_omni_audio:NemotronHOmniEncoder",
                                              "specray.models.nemotron_h_omni_audio:NemotronHOmniProcessor")
# Voxtral (specray.models.voxtral): Whisper's encoder over whole 30 s windows (no pool, no key mask), its rows taken
# four at a time into the projector (linear_1, act, linear_2) and into the [AUDIO] rows of the Llama / Mistral text
# model; the host side pads and counts as mistral_common does (tekken.json's audio section), [BEGIN_AUDIO] first
_TEXT_PARTS["VoxtralForConditionalGeneration"] = _TEXT_PARTS["LlavaForConditionalGeneration"]
_MULTIMODAL["VoxtralForConditionalGeneration"] = ("specray.models.voxtral:VoxtralEncoder",
                                                  "specray.models.voxtral:VoxtralProcessor")
# LLaVA-NeXT-Video (specray.models.llava_next_video): LLaVA-NeXT's images, and videos whose frames go through the same
# tower, pooled 2 x 2 (average or max) before the projector, no newline; the Llama-family text model as LLaVA's
_TEXT_PARTS["LlavaNextVideoForConditionalGeneration"] = _TEXT_PARTS["LlavaForConditionalGeneration"]
_MULTIMODAL["LlavaNextVideoForConditionalGeneration"] = ("specray.models.llava_next_video:LlavaNextVideoEncoder",
                                                         "specray.models.llava_next_video:LlavaNextVideoProcessor")
# Command A Vision (command-a-vision-07-2025, specray.models.cohere2_vision): SigLIP2's fixed-size tower (SigLIP's),
# pixel shuffle and a norm-free SwiGLU projector; pixels made in torch as transformers' torchvision-only
# Cohere2VisionImageProcessor makes them (tiles + thumbnail), <|IMG_PATCH|> written out as Cohere2VisionProcessor
# writes it; its text model a Cohere2 (LLaVA's patterns), logits by a plain lm_head as transformers' composite model
_TEXT_PARTS["Cohere2VisionForConditionalGeneration"] = _TEXT_PARTS["AyaVisionForConditionalGeneration"]
_MULTIMODAL["Cohere2VisionForConditionalGeneration"] = ("specray.models.cohere2_vision:Cohere2VisionImageEncoder",
                                                       "specray.models.cohere2_vision:Cohere2VisionImageProcessor")
_TEXT_CONFIG_FIXES["Cohere2VisionForConditionalGeneration"] = {"logit_scale": 1.0}
# Idefics2 with images (specray.models.idefics2): Idefics3's SigLIP-like vision model over each crop's real patches
# (the image, or its four quarters and the whole image), the gated modality_projection and the perceiver resampler;
# <image> expanded as Idefics2Processor writes it (<fake_token_around_image>, image_seq_len <image> per crop); the text
# model (a Mistral) under model.text_model.* as Idefics3's
_TEXT_PARTS["Idefics2ForConditionalGeneration"] = _TEXT_PARTS["Idefics3ForConditionalGeneration"]
_MULTIMODAL["Idefics2ForConditionalGeneration"] = ("specray.models.idefics2:Idefics2ImageEncoder",
                                                   "specray.models.idefics2:Idefics2ImageProcessor")
# LFM2-VL (specray.models.lfm2_vl): a SigLIP2 NaFlex tower (the position table resized to each tile's patch grid),
# 2 x 2 pixel unshuffle and a LayerNorm + two-linear projector into the LFM2 text model (short convs: a conv history
# per request); the host side tiles large images with a thumbnail (row / column tokens) as Lfm2VlProcessor does
_TEXT_PARTS["Lfm2VlForConditionalGeneration"] = ((re.compile(r"^(?:model\.language_model|language_model\.model)\."),
                                                  "model."), (re.compile(r"^(?:language_model\.)?lm_head\."),
                                                              "lm_head."))
_MULTIMODAL["Lfm2VlForConditionalGeneration"] = ("specray.models.lfm2_vl:Lfm2VlImageEncoder",
                                                 "specray.models.lfm2_vl:Lfm2VlImageProcessor")
# Fuyu's images (specray.models.fuyu_images): no vision tower, each 30 x 30 patch through one linear
# (vision_embed_tokens) into the |SPEAKER| rows; FuyuProcessor's prompt (the image first: |SPEAKER| rows closed by
# |NEWLINE|, then <s>, then the text and <0x04>), one image per prompt; the text model is Persimmon as above
_MULTIMODAL["FuyuForCausalLM"] = ("specray.models.fuyu_images:FuyuImageEncoder",
                                  "specray.models.fuyu_images:FuyuImageProcessor")
