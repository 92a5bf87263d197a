"""Tencent's Hunyuan dense models (``HunYuanDenseV1ForCausalLM``: Hunyuan-0.5B / 1.8B / 4B / 7B), on the Llama
plumbing (:mod:`specray.models.llama`). Where it differs from Llama: each query and key head is RMS-normed *after*
RoPE (``query_layernorm``, ``key_layernorm``), and the releases stretch RoPE's base once by a fixed ``alpha``
(``rope_scaling: {type: dynamic, alpha: ...}``: :data:`specray.models.layers.ROPE_TYPES`' ``ntk_alpha``)."""

from __future__ import annotations

import torch
from specray.models.attention import AttentionMetadata
from specray.models.layers import RMSNorm, apply_rotary
from specray.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from specray.parallel import TPGroup


class HunYuanAttention(LlamaAttention):
    """Llama's attention with each query and key head RMS-normed after RoPE."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        self.query_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.key_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, 1, R/2] -> [T, H]
        t = x.shape[0]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        qk = apply_rotary(torch.cat((q.view(t, self.num_heads, self.head_dim),
                                     k.view(t, self.num_kv_heads, self.head_dim)), dim=1), cos, sin)
        q, k = self.query_layernorm(qk[:, : self.num_heads]), self.key_layernorm(qk[:, self.num_heads:])
        return self.o_proj(self.attn(q, k, v.view(t, self.num_kv_heads, self.head_dim), meta))


class HunYuanDecoderLayer(LlamaDecoderLayer):
    attention_class = HunYuanAttention


class HunYuanModel(LlamaModel):
    layer_class = HunYuanDecoderLayer


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    """Hunyuan (dense) for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = HunYuanModel
