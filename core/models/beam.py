"""Reflection's Beam (``BeamForCausalLM``: Beam-1.0-501B-A23B), on the Llama plumbing (:mod:`specray.models.llama`).
Where it differs from Llama:

* attention with an RMSNorm over each query and key head; sliding-window layers rotated by RoPE
  (``rope_parameters["sliding_attention"]``), global layers without RoPE whose queries are scaled by position,
  ``exp(0.1 * log1p((p + 1) / 2048))``; the output gated feature by feature, ``sigmoid(gate_proj(x) + gate_bias)``
  (a bias per head);
* a sandwich of norms around each block, and a depth-scaled residual: the k-th addition to the stream (two a layer,
  counted from 2) is ``out / sqrt(k) + stream * sqrt((k - 1) / k)``;
* dense MLPs for the first layers (``mlp_layer_types``), then experts (:class:`~specray.models.moe.SparseMoE`):
  DeepSeek-V3's grouped sigmoid router (``n_group``, ``topk_group``, correction bias), renormalised, times
  ``routed_scaling_factor``, no shared expert;
* the logits soft-capped, ``cap * tanh(logits / cap)`` (``final_logit_softcapping``).
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.classic import llama_view
from specray.models.layers import ColumnParallelLinear, RMSNorm, RotaryEmbedding, VocabParallelEmbedding, _copy, \
    _param, narrow, rope_parameters, rotary_dim
from specray.models.llama import _CHECKPOINT_NAMES, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, \
    LlamaModel, _head_dim, _sliding_window, norm_stream
from specray.models.moe import FAMILIES, MoEFamily, SparseMoE
from specray.parallel import PPGroup, TPGroup

FAMILIES["beam"] = MoEFamily("grouped_sigmoid", "num_experts", "moe_intermediate_size")
# its attention gate (``gate_proj`` would read as an MLP's) and its norms' Gemma names (post_attention_layernorm norms
# the attention's output: our post_self_attn_layernorm; pre_feedforward_layernorm is the norm before the MLP)
_CHECKPOINT_NAMES["beam"] = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.self_attn\.gate_proj\.", ".self_attn.g_proj."),
    (r"\.post_attention_layernorm\.", ".post_self_attn_layernorm."),
    (r"\.pre_feedforward_layernorm\.", ".post_attention_layernorm."),
    (r"\.post_feedforward_layernorm\.", ".post_mlp_layernorm.")))


class BeamAttention(LlamaAttention):
    """q/k norms; RoPE on the sliding layers, position-scaled queries on the global ones; a gated output."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        self.use_rope = _sliding_window(config, layer) is not None
        heads = self.num_heads
        self.g_proj = ColumnParallelLinear(config.hidden_size, config.num_attention_heads * self.head_dim, tp,
                                           bias=False)
        self.gate_bias = _param(heads)  # this rank's heads'
        first = tp.rank * heads
        self.gate_bias.weight_loader = lambda param, loaded: _copy(param, narrow(loaded, 0, first, heads))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        q, k, v = self.project(x, cos, sin, meta)
        if not self.use_rope:  # the global layers' queries, scaled by their position
            scale = torch.exp(0.1 * torch.log1p((meta.positions.float() + 1) / 2048))  # [T]
            q = (q.float() * scale[:, None, None]).to(q.dtype)
        out = self.attn(q, k, v, meta)  # [T, heads * D]
        t = x.shape[0]
        gate = self.g_proj(x).view(t, self.num_heads, self.head_dim) + self.gate_bias[:, None]
        return self.o_proj((out.view(t, self.num_heads, self.head_dim) * torch.sigmoid(gate)).view(t, -1))


class BeamDecoderLayer(LlamaDecoderLayer):
    """The sandwich of norms, and the stream rescaled at each addition (module docstring)."""

    attention_class = BeamAttention

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__(config, tp, layer, expert_parallel)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        k = 2 * (layer + 1)  # the attention's addition; the MLP's is k + 1
        self.scales = [(1 / math.sqrt(i), math.sqrt((i - 1) / i)) for i in (k, k + 1)]

    @classmethod
    def build_mlp(cls, config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        if config.mlp_layer_types[layer] == "sparse":
            return SparseMoE(config, tp, expert_parallel)
        return LlamaMLP(config, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H], the stream being x + residual (added in the next norm): each block's scaled output
        # and the scaled stream it joins
        h, stream = norm_stream(self.input_layernorm, x, residual)
        (out_a, keep_a), (out_m, keep_m) = self.scales
        a = self.post_self_attn_layernorm(self.self_attn(h, cos, sin, meta))
        h, stream = self.post_attention_layernorm(a * out_a, stream * keep_a)
        m = self.post_mlp_layernorm(self.mlp(h))
        return m * out_m, stream * keep_m


class BeamModel(LlamaModel):
    layer_class = BeamDecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)
        sliding = dict((config.rope_parameters or {}).get("sliding_attention") or {})  # (the global layers': none)
        rope = rope_parameters(llama_view(config, rope_parameters=sliding), partial=True)
        self.rotary_emb = RotaryEmbedding(rotary_dim(_head_dim(config), rope), rope, config.max_position_embeddings)
        self.embedding_multiplier = 1.0
        self.build_stage(config, pp, lambda i: BeamDecoderLayer(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))


class BeamForCausalLM(LlamaForCausalLM):
    """Beam for causal LM, sharded over ``tp`` (experts by width, or whole with expert parallelism) and ``pp``."""

    model_class = BeamModel
    caps_logits = True
    lora_modules = LlamaForCausalLM.lora_modules + ("g_proj",)
