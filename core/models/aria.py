"""Rhymes AI's Aria text model (``AriaTextForCausalLM``, model type ``aria_text``; the text model of
``AriaForConditionalGeneration``, served through ``registry._TEXT_PARTS``): Llama's pre-norm layers (attention with
RoPE, GQA) whose every MLP is a mixture of experts: a router picks the top ``moe_topk`` of ``moe_num_experts`` SwiGLU
experts by its logits and weights them by the softmax over the chosen logits alone, and ``moe_num_shared_experts``
shared experts (one SwiGLU MLP ``moe_num_shared_experts`` times as wide as an expert) run on every token. The experts
are :class:`~specray.models.moe.SparseMoE` with this module's ``aria_text`` row (GPT-OSS's ``topk_softmax`` routing
without biases, the fused tensors stored [E, H, 2I] and [E, I, H]).

The release names the fused experts ``mlp.experts.fc1.weight`` / ``fc2.weight`` (transformers saves them so too; its
modules call them ``gate_up_proj`` / ``down_proj``): both are read. The multimodal release keeps the text model under
``language_model.model.`` and ``language_model.lm_head.`` (transformers' modules: ``model.language_model.`` and
``lm_head.``) beside ``vision_tower.`` and ``multi_modal_projector.``, which are not read: a text-only engine never
runs them."""

from __future__ import annotations

import re

from torch import nn

from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from specray.models.moe import FAMILIES, MoEFamily, SparseMoE
from specray.parallel import PPGroup, TPGroup

# Aria's experts: the top k router logits softmaxed among themselves, fused [E, H, 2I] / [E, I, H] tensors, shared
# experts as wide as moe_num_shared_experts experts (intermediate_size each)
FAMILIES["aria_text"] = MoEFamily("topk_softmax", "moe_num_experts", "intermediate_size", router="router",
                                  shared="shared_experts", shared_width="intermediate_size",
                                  shared_count="moe_num_shared_experts", top_k="moe_topk", fused_in_out=True)
# the release's fused expert names for transformers' modules' (ours: SparseMoE's fused loader)
RELEASE_NAMES = ((re.compile(r"\.mlp\.experts\.fc1\.weight$"), ".mlp.experts.gate_up_proj"),
                 (re.compile(r"\.mlp\.experts\.fc2\.weight$"), ".mlp.experts.down_proj"))


def check_aria_config(config) -> None:
    """Refuse what Aria's text model could set that the experts do not implement, by name."""
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported for model_type='aria_text' (the shared experts' biases: "
                         "specray's shared experts have none); load a release with mlp_bias false")
    if not getattr(config, "moe_num_shared_experts", 0):
        raise ValueError(f"moe_num_shared_experts={getattr(config, 'moe_num_shared_experts', None)!r}: Aria's MoE "
                         "layers have at least one shared expert (transformers builds a shared MLP of that many "
                         "experts' width); set it to a positive int")


class AriaDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with the experts in every layer."""

    @staticmethod
    def build_mlp(config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        return SparseMoE(config, tp, expert_parallel)


class AriaTextModel(LlamaModel):
    layer_class = AriaDecoderLayer


class AriaTextForCausalLM(LlamaForCausalLM):
    """Aria's text model for causal LM, sharded over ``tp`` (experts by width, or whole with expert parallelism) and
    ``pp``; reads the release's ``fc1`` / ``fc2`` expert names and transformers' module names alike."""

    model_class = AriaTextModel

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        check_aria_config(hf_config)
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.renames = RELEASE_NAMES
