"""poolside's Laguna (``LagunaForCausalLM``: laguna-XS), on the Llama plumbing (:mod:`specray.models.llama`). Where it
differs from Llama:

* each layer's own number of query heads (``num_attention_heads_per_layer``; the KV heads the same everywhere);
* an RMSNorm over each query and key head; sliding-window layers beside global ones (``layer_types``), each kind with
  its own RoPE (``rope_parameters[kind]``: the global layers' on half of each head);
* the attention's output gated by ``softplus(g_proj(x))``, one gate per head (``gating`` true or "per-head") or per
  feature ("per-element");
* after a dense first layer (``mlp_layer_types``), experts (:class:`~specray.models.moe.SparseMoE`): sigmoid scores
  (of logits soft-capped at ``moe_router_logit_softcapping`` where it is set), the top k of score + correction bias,
  renormalised, times ``moe_routed_scaling_factor``, beside a shared MLP (``shared_expert_intermediate_size``).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.classic import llama_view
from specray.models.layers import ColumnParallelLinear
from specray.models.llama import _CHECKPOINT_NAMES, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from specray.models.moe import SparseMoE
from specray.models.olmo3 import RopePerKindModel
from specray.parallel import TPGroup

# the release's names: the router's correction bias under the experts, its shared MLP's name
_CHECKPOINT_NAMES["laguna"] = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.mlp\.experts\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.mlp\.shared_expert\.", ".mlp.shared_experts.")))


class LagunaAttention(LlamaAttention):
    """Llama's attention (q/k norms, RoPE by kind) with its output gated by a softplus, per head or per feature."""

    def __init__(self, config, tp: TPGroup, layer: int):
        heads = config.num_attention_heads_per_layer[layer]
        super().__init__(llama_view(config, num_attention_heads=heads), tp, layer)
        gating = config.gating
        if gating not in (True, "per-head", "per-element"):
            raise ValueError(f"gating={gating!r} is not supported for model_type='laguna'; true, 'per-head' or "
                             "'per-element'")
        self.per_head = gating in (True, "per-head")
        width = heads if self.per_head else heads * self.head_dim
        self.g_proj = ColumnParallelLinear(config.hidden_size, width, tp, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        out = self.attn(*self.project(x, cos, sin, meta), meta)  # [T, heads * D], this rank's heads
        gate = F.softplus(self.g_proj(x).float()).to(out.dtype)
        if self.per_head:
            t = x.shape[0]
            out = (out.view(t, self.num_heads, self.head_dim) * gate.unsqueeze(-1)).view(t, -1)
        else:
            out = out * gate
        return self.o_proj(out)


class LagunaDecoderLayer(LlamaDecoderLayer):
    attention_class = LagunaAttention

    @classmethod
    def build_mlp(cls, config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        if config.mlp_layer_types[layer] == "sparse":
            return SparseMoE(config, tp, expert_parallel)
        return LlamaMLP(config, tp)


class LagunaModel(RopePerKindModel):
    layer_class = LagunaDecoderLayer


class LagunaForCausalLM(LlamaForCausalLM):
    """Laguna for causal LM, sharded over ``tp`` (each layer's heads; experts by width, or whole with expert
    parallelism) and ``pp``."""

    model_class = LagunaModel
    lora_modules = LlamaForCausalLM.lora_modules + ("g_proj",)
