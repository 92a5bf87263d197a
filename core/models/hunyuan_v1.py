"""Tencent's Hunyuan dense models (``HunYuanDenseV1ForCausalLM``: Hunyuan-0.5B / 1.8B / 4B / 7B), on the Llama
plumbing (:mod:`specray.models.llama`). Where it differs from Llama: each query and key head is RMS-normed *after*
RoPE (``query_layernorm``, ``key_layernorm``), and the releases stretch RoPE's base once by a fixed ``alpha``
(``rope_scaling: {type: dynamic, alpha: ...}``: :data:`specray.models.layers.ROPE_TYPES`' ``ntk_alpha``).

Hunyuan's MoE (``HunYuanMoEV1ForCausalLM``: Hunyuan-A13B) is the same layer with experts in every layer
(:mod:`specray.models.moe`'s ``hunyuan_v1_moe`` row: softmax over ``num_experts``, top ``moe_topk`` renormalised, a
shared MLP as wide as each expert; the router's ``gate.wg`` read as our ``gate``). One count and width for every
layer, as transformers' class keeps them: per-layer lists (the release writes some) are read where every layer has
the same value (and the experts' width is ``intermediate_size``), else refused."""

from __future__ import annotations

import copy

import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.layers import RMSNorm, apply_rotary
from specray.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from specray.models.moe import SparseMoE
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


class HunYuanMoEDecoderLayer(HunYuanDecoderLayer):
    @staticmethod
    def build_mlp(config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        return SparseMoE(uniform_moe_config(config), tp, expert_parallel)


def uniform_moe_config(config):
    """``config`` with its per-layer expert counts as one value each (a copy where it had lists), or a ValueError
    naming the field whose layers differ."""
    fields = {"num_experts": None, "moe_topk": None, "moe_intermediate_size": config.intermediate_size}
    scalars = {}
    for field, must_be in fields.items():
        value = getattr(config, field, None)
        if not isinstance(value, (list, tuple)):
            continue
        if len(set(value)) != 1 or (must_be is not None and value[0] != must_be):
            want = "one value for every layer" + ("" if must_be is None else f", equal to intermediate_size={must_be}")
            raise ValueError(f"{field}={list(value)} is not supported for model_type='hunyuan_v1_moe' (transformers' "
                             f"class keeps one count and width for every layer): {want}")
        scalars[field] = value[0]
    if not scalars:
        return config
    config = copy.copy(config)
    for field, value in scalars.items():
        setattr(config, field, value)
    return config


class HunYuanMoEModel(LlamaModel):
    layer_class = HunYuanMoEDecoderLayer


class HunYuanMoEV1ForCausalLM(LlamaForCausalLM):
    """Hunyuan's MoE for causal LM, sharded over ``tp`` (experts by width, or whole with expert parallelism) and
    ``pp``."""

    model_class = HunYuanMoEModel
