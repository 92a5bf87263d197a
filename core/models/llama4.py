"""Llama-4's text model (``Llama4ForCausalLM``: Scout, Maverick), written with tensor-parallel layers on the Llama
plumbing.

Where it differs from the Llama family:

* RoPE layers and NoPE layers (``no_rope_layers``: 1 where a layer uses RoPE). RoPE layers attend within chunks of
  ``attention_chunk_size`` positions (chunked local attention:
  :class:`~specray.models.kv_cache.ChunkedLocalAttentionSpec`), rotate interleaved pairs (computed as the
  rotate-half rotation of the de-interleaved vector, q and k alike: a dot product does not see the order), then
  L2-normalise q and k per head (``use_qk_norm``). NoPE layers attend globally and, with
  ``attn_temperature_tuning``, scale q by ``1 + attn_scale * log1p(floor((position + 1) / floor_scale))``;
* every ``moe_layers`` layer's ``feed_forward`` is a mixture of experts (:mod:`specray.models.moe`, Llama-4's row:
  the top-k router logits through a sigmoid scale the experts' input, a shared expert added); the others are a
  dense MLP of ``intermediate_size_mlp``.
"""

from __future__ import annotations

import torch
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.kv_cache import ChunkedLocalAttentionSpec, FullAttentionSpec
from specray.models.layers import RMSNorm, RotaryEmbedding, VocabParallelEmbedding, apply_rotary, rope_parameters
from specray.models.llama import (LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel, _head_dim,
                                  attention_projections)
from specray.models.moe import SparseMoE
from specray.parallel import PPGroup, TPGroup


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(nn.Module):
    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__()
        head_dim = attention_projections(self, config, tp)
        self.use_rope = bool(config.no_rope_layers[layer])
        self.qk_norm_eps = config.rms_norm_eps if (config.use_qk_norm and self.use_rope) else None
        self.temperature = (float(config.attn_scale), float(config.floor_scale)) if (
            config.attn_temperature_tuning and not self.use_rope) else None
        if self.temperature is not None and not self.temperature[1] > 0:  # (0: NaN logits)
            raise ValueError(f"floor_scale={config.floor_scale} must be a positive number of positions (Llama 4's: "
                             "8192), or attn_temperature_tuning=False")
        chunk = getattr(config, "attention_chunk_size", None)
        if "chunked_attention" in config.layer_types and not (isinstance(chunk, int) and chunk > 0):
            raise ValueError(f"attention_chunk_size={chunk!r} must be a positive number of positions (Llama 4's: "
                             "8192) for the chunked_attention layers of layer_types")
        heads = dict(num_kv_heads=self.num_kv_heads, head_dim=head_dim, kv_head_start=self.qkv_proj.kv_head_start)
        chunked = config.layer_types[layer] == "chunked_attention"
        spec = (ChunkedLocalAttentionSpec(**heads, attention_chunk_size=config.attention_chunk_size) if chunked
                else FullAttentionSpec(**heads))
        self.attn = PagedAttention(self.num_heads, spec, head_dim ** -0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, 1, D/2] -> [T, H]
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        qk = qkv[:, : q_size + kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.use_rope:
            qk = apply_rotary(torch.cat((qk[..., 0::2], qk[..., 1::2]), dim=-1), cos, sin)  # interleaved pairs
            if self.qk_norm_eps is not None:
                qk = _l2_norm(qk, self.qk_norm_eps)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        if self.temperature is not None:
            attn_scale, floor_scale = self.temperature
            scale = torch.log1p(torch.floor((meta.positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scale[:, None, None]).to(q.dtype)
        v = qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, meta))


class Llama4DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        nn.Module.__init__(self)
        self.self_attn = Llama4Attention(config, tp, layer)
        self.feed_forward = (SparseMoE(config, tp, expert_parallel) if layer in config.moe_layers
                             else LlamaMLP(config, tp, config.intermediate_size_mlp))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def mlp(self) -> nn.Module:  # Llama-4 names it feed_forward
        return self.feed_forward


class Llama4Model(LlamaModel):
    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)
        self.build_stage(config, pp, lambda i: Llama4DecoderLayer(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.rotary_emb = RotaryEmbedding(_head_dim(config), rope_parameters(config), config.max_position_embeddings)


class Llama4ForCausalLM(LlamaForCausalLM):
    """Llama-4's text model for causal LM, sharded over ``tp`` (experts by width, or whole with
    ``expert_parallel``)."""

    model_class = Llama4Model
