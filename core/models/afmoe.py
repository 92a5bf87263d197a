"""Arcee's Trinity models (``AfmoeForCausalLM``: Trinity Nano / Mini / Large), on the Llama plumbing
(:mod:`specray.models.llama`). Where they differ from Llama:

* attention with an RMSNorm over each query and key head, RoPE on the sliding layers alone (the global ones NoPE,
  ``layer_types``), and its output gated feature by feature, ``o_proj(attn * sigmoid(gate_proj(x)))``;
* a sandwich of norms: each block's output RMS-normed again before it joins the residual stream (the release's
  ``post_attention_layernorm`` after attention, ``pre_mlp_layernorm`` / ``post_mlp_layernorm`` around the MLP);
* after its first ``num_dense_layers`` (a dense SwiGLU MLP), a mixture of experts
  (:class:`~specray.models.moe.SparseMoE`): sigmoid scores, the top k of score + ``expert_bias``, renormalised, times
  ``route_scale``, beside shared experts (``num_shared_experts`` of ``moe_intermediate_size``);
* with ``mup_enabled``, the embeddings scaled by ``sqrt(hidden_size)``.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.glm4 import Glm4DecoderLayer
from specray.models.layers import ColumnParallelLinear
from specray.models.llama import _CHECKPOINT_NAMES, LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from specray.models.moe import SparseMoE
from specray.parallel import PPGroup, TPGroup

# the release's names for our modules: its attention gate (``gate_proj`` would read as an MLP's), its norms (its
# post_attention_layernorm norms the attention's output: GLM-4's post_self_attn_layernorm; its pre_mlp_layernorm is
# the norm before the MLP), the router and its bias (transformers keeps these names)
_CHECKPOINT_NAMES["afmoe"] = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.self_attn\.gate_proj\.", ".self_attn.g_proj."),
    (r"\.post_attention_layernorm\.", ".post_self_attn_layernorm."),
    (r"\.pre_mlp_layernorm\.", ".post_attention_layernorm."),
    (r"\.mlp\.router\.gate\.", ".mlp.gate."), (r"\.mlp\.expert_bias$", ".mlp.gate.e_score_correction_bias")))


class AfmoeAttention(LlamaAttention):
    """Llama's attention (q/k norms and RoPE by the family's flags) with its output gated feature by feature."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        self.g_proj = ColumnParallelLinear(config.hidden_size, config.num_attention_heads * self.head_dim, tp,
                                           bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        out = self.attn(*self.project(x, cos, sin, meta), meta)  # [T, heads * D], this rank's heads
        return self.o_proj(out * torch.sigmoid(self.g_proj(x)))


class AfmoeDecoderLayer(Glm4DecoderLayer):
    attention_class = AfmoeAttention

    @classmethod
    def build_mlp(cls, config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        if layer < config.num_dense_layers:
            return LlamaMLP(config, tp)
        return SparseMoE(config, tp, expert_parallel)


class AfmoeModel(LlamaModel):
    layer_class = AfmoeDecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__(config, tp, expert_parallel, pp)
        if getattr(config, "mup_enabled", False):
            self.embedding_multiplier = config.hidden_size ** 0.5


class AfmoeForCausalLM(LlamaForCausalLM):
    """Trinity for causal LM, sharded over ``tp`` (experts by width, or whole with expert parallelism) and ``pp``."""

    model_class = AfmoeModel
    # LoRA on attention (its gate too: ``gate_proj`` in the release, g_proj here), the dense MLPs and shared experts
    lora_modules = LlamaForCausalLM.lora_modules + ("g_proj",)
