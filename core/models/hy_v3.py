"""Tencent's Hunyuan 3 (``HYV3ForCausalLM``), on the Llama plumbing (:mod:`specray.models.llama`: paged KV per layer,
pipeline stages, weight loading, the model interface). Where it differs from the Llama family:

* an RMSNorm over each query and key head before RoPE (Qwen3's; a ``llama.py`` flag by ``model_type``);
* each layer's MLP is dense or a mixture of experts as ``mlp_layer_types`` names it (the first dense): sigmoid scores,
  the top k of score + correction bias, renormalised, times ``router_scaling_factor``, and shared experts
  (``num_shared_experts`` of ``moe_intermediate_size``) (:mod:`specray.models.moe`, the ``hy_v3`` row);
* the release names the router ``mlp.router.gate``, the correction bias ``mlp.expert_bias`` and the shared experts
  ``mlp.shared_mlp``.

Its releases' multi-token-prediction layer (``model.layers.{num_hidden_layers}``: ``enorm``, ``hnorm``, ``eh_proj``, a
layer with experts, ``final_layernorm``) is the ``mtp`` drafter's, DeepSeek-V3's layout (:meth:`mtp_layer_parts`).
"""

from __future__ import annotations

from torch import nn

from specray.models.layers import RMSNorm
from specray.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from specray.models.moe import SparseMoE
from specray.parallel import TPGroup


class HYV3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        nn.Module.__init__(self)
        self.self_attn = LlamaAttention(config, tp, layer)
        sparse = config.mlp_layer_types[layer] == "sparse"
        self.mlp = SparseMoE(config, tp, expert_parallel) if sparse else LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class HYV3Model(LlamaModel):
    layer_class = HYV3DecoderLayer


class HYV3ForCausalLM(LlamaForCausalLM):
    """Hunyuan 3 for causal LM, sharded over ``tp`` (heads; experts by width, or whole with ``expert_parallel``) and
    ``pp``."""

    model_class = HYV3Model

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False) -> tuple[nn.Module, nn.Module]:
        """The MTP layer's block: a layer past the dense ones, so the family's attention (q/k norms) and the experts,
        split over ``tp`` as the target's layers are (:class:`~specray.models.draft_head.DraftHead` builds the
        rest)."""
        return LlamaAttention(config, tp, config.num_hidden_layers), SparseMoE(config, tp, expert_parallel)
