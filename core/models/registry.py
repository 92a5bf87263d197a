"""Which of our model classes serves an HF config (by ``architectures``, else ``model_type``)."""

from __future__ import annotations

from importlib import import_module

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
    "Olmo2ForCausalLM": "specray.models.olmo2:Olmo2ForCausalLM",
    "Gemma3ForCausalLM": "specray.models.gemma3:Gemma3ForCausalLM",
    "Gemma2ForCausalLM": "specray.models.gemma2:Gemma2ForCausalLM",
    "DeepseekV3ForCausalLM": "specray.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV2ForCausalLM": "specray.models.deepseek_v3:DeepseekV3ForCausalLM",
    "Llama4ForCausalLM": "specray.models.llama4:Llama4ForCausalLM",
    "GptOssForCausalLM": "specray.models.gpt_oss:GptOssForCausalLM",
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "gemma2": "Gemma2ForCausalLM", "gpt_oss": "GptOssForCausalLM",
                "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                "llama4_text": "Llama4ForCausalLM", "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM",
                "olmo2": "Olmo2ForCausalLM"}


# a multimodal checkpoint whose text model we serve: its architecture -> the prefix of the text model's tensors (the
# rest, the vision tower and projector, is not loaded); Mistral 3's (Mistral Small 3.1 / 3.2, Devstral, Magistral)
# is a Mistral
_TEXT_PARTS = {"Llama4ForConditionalGeneration": "language_model.", "Gemma3ForConditionalGeneration": "language_model.",
               "Mistral3ForConditionalGeneration": "language_model."}


def text_part(hf_config) -> tuple[object, str] | None:
    """(the text model's config, its tensors' prefix) for a multimodal checkpoint we serve the text of, else None.
    Its LM head is tied to its embedding as the whole model's config says (transformers ties the composite model's
    head by that flag, whatever the text config's own says: Mistral 3's differ)."""
    for arch in getattr(hf_config, "architectures", None) or []:
        text = getattr(hf_config, "text_config", None)
        if arch in _TEXT_PARTS and text is not None:
            if getattr(hf_config, "tie_word_embeddings", None) is not None:
                text.tie_word_embeddings = hf_config.tie_word_embeddings
            return text, _TEXT_PARTS[arch]
    return None


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def _resolve(target: str) -> type:
    module, name = target.split(":")
    return getattr(import_module(module), name)


def get_model_class(hf_config) -> type:
    """Our ``nn.Module`` class for ``hf_config``; ValueError for an architecture we do not implement."""
    archs = list(getattr(hf_config, "architectures", None) or [])
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
