"""BAAI's Emu3 text model (``Emu3ForCausalLM``, model type ``emu3_text_model``; the text model of
``Emu3ForConditionalGeneration``, served through ``registry._TEXT_PARTS``): Llama's layers as they are (RoPE, GQA,
SwiGLU, RMSNorm; its dropout runs in training alone), over a vocabulary that holds the VQ-VAE's image codes as
ordinary token ids. A text prompt is therefore served whole by the text model: transformers' multimodal model embeds
such a prompt's ids and runs its text model on them, exactly as here (an image would be encoded by the VQ-VAE into
those ids first; images are refused, as for every multimodal release served text-only).

The multimodal release keeps the text model under ``text_model.model.`` and ``text_model.lm_head.`` (transformers'
modules: ``model.text_model.`` and ``lm_head.``) beside the VQ-VAE (``vqmodel.``), which is not read."""

from __future__ import annotations

from specray.models.llama import LlamaForCausalLM
from specray.parallel import PPGroup, TPGroup


class Emu3ForCausalLM(LlamaForCausalLM):
    """Emu3's text model for causal LM: Llama's class, sharded over ``tp`` and ``pp``."""

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        window = getattr(hf_config, "sliding_window", None)
        if window is not None:  # Llama's class would honour it; transformers' Emu3 has no window
            raise ValueError(f"sliding_window={window!r} is not supported for model_type={hf_config.model_type!r}: "
                             "Emu3's attention attends every earlier token (transformers ignores the field); remove "
                             "it from config.json or set it to null")
        super().__init__(hf_config, tp, expert_parallel, pp)
