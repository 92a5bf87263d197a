"""Phi-4-multimodal's text model (``Phi4MultimodalForCausalLM``, model type ``phi4_multimodal``: transformers' own
layout of microsoft/Phi-4-multimodal-instruct; and the release's original layout, ``Phi4MMForCausalLM`` / ``phi4mm``),
served text-only on the Llama plumbing (:mod:`specray.models.llama`) as the Phi-3 it is: q/k/v fused in ``qkv_proj``
and gate/up in ``gate_up_proj`` (split as they load, Phi-3's ``unfuse``), partial RoPE and LongRoPE, a sliding window
where the config sets one. Where it differs from Phi-3:

* its checkpoint also holds the image and audio encoders and their projectors (``model.embed_tokens_extend.``):
  not read. For a prompt of text alone transformers' forward hands the token embeddings through that module unchanged,
  so the text model is Phi-3's on the ids;
* the release's projections carry built-in LoRA adapters for its vision and speech modes (``X.base_layer.weight``
  beside ``X.lora_A.vision.weight``, ``X.lora_B.vision.weight`` and the ``speech`` ones). Text alone runs the base
  weights with no adapter (the release's code unsets its adapters in its language mode; transformers' layout keeps the
  adapters out of the checkpoint, in the ``vision-lora`` / ``speech-lora`` folders), so ``base_layer`` is read as the
  projection's weight and the adapters' tensors are not read.

Images and audio are refused as every multimodal release's are (a non-text content part or ``multi_modal_data`` is an
error: :mod:`specray.llm`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from specray.models.classic import llama_view
from specray.models.llama import LlamaForCausalLM, fused_pieces
from specray.parallel import PPGroup, TPGroup

# the release's built-in adapters of a projection (its vision and speech modes'): not read for text
BUILT_IN_ADAPTER = re.compile(r"\.lora_[AB]\.[^.]+\.weight$")
_BASE_LAYER = re.compile(r"\.base_layer\.")  # a projection's own weight under the release's LoRA wrapper


class Phi4MultimodalForCausalLM(LlamaForCausalLM):
    """Phi-4-multimodal's text model for causal LM (Phi-3's layers; the towers and built-in adapters not read),
    sharded over ``tp`` and ``pp`` as the Llama family is."""

    skipped = ("model.embed_tokens_extend.",)  # the image and audio encoders and their projectors

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.fused = fused_pieces(llama_view(hf_config, model_type="phi3"))  # Phi-3's fused qkv_proj, gate_up_proj
        self.renames = ((_BASE_LAYER, "."),)

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        return super()._unfused((name, tensor) for name, tensor in weights if not BUILT_IN_ADAPTER.search(name))

    def reads_weight(self, name: str) -> bool:
        return not BUILT_IN_ADAPTER.search(name) and super().reads_weight(name)
