"""JetBrains' Mellum 2 (``MellumForCausalLM``: Mellum2-12B-A2.5B), Qwen3-MoE's layers (:mod:`specray.models.llama`: an
RMSNorm over each query and key head, softmax-routed experts renormalised with ``norm_topk_prob``) with:

* sliding-window layers beside global ones (``layer_types``), each kind with its own RoPE base
  (``rope_parameters[kind]``, :class:`~specray.models.olmo3.RopePerKind`);
* each layer's MLP dense or experts as ``mlp_layer_types`` names it.

Its releases' multi-token-prediction layer (``mtp.*``) is not read (not yet a drafter here).
"""

from __future__ import annotations

from torch import nn

from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from specray.models.moe import FAMILIES, SparseMoE
from specray.models.olmo3 import RopePerKindModel
from specray.parallel import TPGroup

FAMILIES["mellum"] = FAMILIES["qwen3_moe"]


class MellumDecoderLayer(LlamaDecoderLayer):
    @classmethod
    def build_mlp(cls, config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        if config.mlp_layer_types[layer] == "sparse":
            return SparseMoE(config, tp, expert_parallel)
        return LlamaMLP(config, tp)


class MellumModel(RopePerKindModel):
    layer_class = MellumDecoderLayer


class MellumForCausalLM(LlamaForCausalLM):
    """Mellum 2 for causal LM, sharded over ``tp`` (experts by width, or whole with expert parallelism) and ``pp``."""

    model_class = MellumModel
    skipped = ("mtp.", "model.mtp.")  # the release's MTP layer (no drafter for it yet)
