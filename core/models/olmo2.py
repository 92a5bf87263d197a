"""AI2's OLMo 2 (``Olmo2ForCausalLM``: OLMo-2 7B, 13B, 32B), on the Llama plumbing (:mod:`specray.models.llama`: paged
KV per layer, pipeline stages, weight loading, the model interface). Where it differs from the Llama family:

* each layer norms its blocks' outputs, not their inputs: ``h = h + norm(attn(h))``, then ``h = h + norm(mlp(h))``
  (``post_attention_layernorm``, ``post_feedforward_layernorm``; no ``input_layernorm``);
* the queries and the keys are RMS-normed over all their heads at once (``q_norm`` over ``heads * head_dim``,
  ``k_norm`` over ``kv_heads * head_dim``) before RoPE. Under tensor parallelism a rank holds only its heads, so the
  mean square is summed over the ranks (one all-reduce of a [T, 2] tensor per layer) and each rank scales its own
  features by its share of the norms' weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.layers import RMSNorm, _copy, _param, apply_rotary, narrow
from specray.models.llama import (LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, _kv_spec,
                                  attention_projections)
from specray.parallel import TPGroup


class Olmo2Attention(LlamaAttention):
    """Llama's attention with q and k RMS-normed over all heads (each rank holding its heads' features)."""

    def __init__(self, config, tp: TPGroup, layer: int):
        nn.Module.__init__(self)
        kv = config.num_key_value_heads
        if kv < tp.size:
            raise ValueError(f"num_key_value_heads={kv} is fewer than tensor_parallel_size={tp.size}: OLMo 2 norms "
                             "the keys over all heads, which replicated KV heads would count twice; choose a "
                             f"tensor_parallel_size of at most {kv}")
        head_dim = attention_projections(self, config, tp)
        self.tp, self.eps = tp, config.rms_norm_eps
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.q_norm = self._norm_weight(q_size, tp.rank * q_size)
        self.k_norm = self._norm_weight(kv_size, self.qkv_proj.kv_head_start * head_dim)
        self.widths = (config.num_attention_heads * head_dim, kv * head_dim)  # each norm's whole width
        self.clip = getattr(config, "clip_qkv", None)  # OLMoE's: q and k (normed) and v clamped to +-clip
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip_qkv={self.clip} must be a positive number, or null for no clamp")
        self.attn = PagedAttention(self.num_heads, _kv_spec(config, layer, self.qkv_proj), head_dim**-0.5)

    @staticmethod
    def _norm_weight(size: int, start: int) -> nn.Module:
        """A norm's weight holding this rank's ``size`` features of it, from ``start``."""
        norm = nn.Module()
        norm.weight = _param(size)

        def load(param: nn.Parameter, loaded: Any) -> None:
            _copy(param, narrow(loaded, 0, start, size))

        norm.weight.weight_loader = load
        return norm

    def _normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, q_size], k: [T, kv_size] (this rank's features) -> both RMS-normed over their whole widths
        squares = torch.stack((q.float().pow(2).sum(-1), k.float().pow(2).sum(-1)), dim=-1)  # [T, 2]
        if self.tp.size > 1:
            squares = self.tp.all_reduce(squares)
        (q_width, k_width), eps = self.widths, self.eps
        q_inv, k_inv = torch.rsqrt(squares[:, :1] / q_width + eps), torch.rsqrt(squares[:, 1:] / k_width + eps)
        return (q.float() * q_inv * self.q_norm.weight.float()).to(q.dtype), \
            (k.float() * k_inv * self.k_norm.weight.float()).to(k.dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, 1, D/2] -> [T, H]
        t = x.shape[0]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q, k = self._normed(q, k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        qk = apply_rotary(torch.cat((q.view(t, self.num_heads, self.head_dim),
                                     k.view(t, self.num_kv_heads, self.head_dim)), dim=1), cos, sin)
        out = self.attn(qk[:, : self.num_heads], qk[:, self.num_heads:], v.view(t, self.num_kv_heads, self.head_dim),
                        meta)
        return self.o_proj(out)


class Olmo2DecoderLayer(nn.Module):
    """A post-norm layer: ``h = h + norm(attn(h))``, ``h = h + norm(mlp(h))``."""

    attention_class: type[nn.Module] = Olmo2Attention  # (EXAONE 4.0's layer: Llama's attention)

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__()
        self.self_attn = self.attention_class(config, tp, layer)
        self.mlp = self.build_mlp(config, tp, layer, expert_parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @staticmethod
    def build_mlp(config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        """The layer's MLP: a dense one (FlexOlmo's: experts)."""
        return LlamaMLP(config, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H], the stream being x + residual (the stack adds them lazily) -> the MLP's normed output
        # and the stream before it (their sum: the layer's output)
        h = x if residual is None else x + residual
        h = h + self.post_attention_layernorm(self.self_attn(h, cos, sin, meta))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Olmo2Model(LlamaModel):
    layer_class = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = Olmo2Model

    def _a_norm(self) -> torch.Tensor:
        return self.model.layers[self.model.stage.start].post_attention_layernorm.weight
