"""Gemma 3 (text), written with tensor-parallel layers.

Where it differs from the Llama family (:mod:`specray.models.llama`, whose plumbing it shares: paged KV per layer,
weight loading, the model interface):

* RMSNorm scales by ``1 + weight`` and multiplies in float32 before casting back;
* every layer is a sandwich: norms before and after attention, and before and after the MLP, with the residual
  added after the post-norms; an RMSNorm over each query and key head before RoPE;
* the embedding is scaled by sqrt(hidden_size) (in the embedding's dtype); attention scales by
  ``query_pre_attn_scalar ** -0.5``; the MLP is gated GELU (tanh approximation);
* sliding-window layers interleave with global ones (``layer_types``), each kind with its own RoPE
  (``rope_parameters[layer_type]``: a local base, and a global base with optional scaling);
* ``final_logit_softcapping`` caps the logits by ``cap * tanh(logits / cap)`` where the config sets it.

Gemma 2 (:mod:`specray.models.gemma2`) is these layers without the q/k norms, with attention logit soft-capping.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.layers import (MergedColumnParallelLinear, RotaryEmbedding, RowParallelLinear,
                                   VocabParallelEmbedding, _param, apply_rotary, rope_parameters)
from specray.models.llama import LlamaForCausalLM, StageModel, _head_dim, _kv_spec, attention_projections
from specray.parallel import PPGroup, TPGroup

LAYER_TYPES = ("sliding_attention", "full_attention")


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)`` in float32, cast back to x's dtype."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = F.rms_norm(x.float(), self.weight.shape, None, self.eps)  # one op (on CUDA one fused kernel)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(nn.Module):
    qk_norm = True  # an RMSNorm over each query and key head before RoPE (Gemma 3; Gemma 2 has none)
    softcaps = False  # whether attn_logit_softcapping applies (Gemma 2's; transformers' Gemma 3 ignores it)

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__()
        softcap = getattr(config, "attn_logit_softcapping", None)
        if softcap is not None and not self.softcaps:
            raise ValueError(f"attn_logit_softcapping={softcap} is not supported (Gemma 2's; Gemma 3 sets none)")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"attn_logit_softcapping={softcap} must be a positive number, or null for no cap")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True is not supported: a causal LM is served causally")
        head_dim = attention_projections(self, config, tp)
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps) if self.qk_norm else None
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps) if self.qk_norm else None
        scalar = getattr(config, "query_pre_attn_scalar", None) or head_dim  # Gemma 1 has none: head_dim's
        self.attn = PagedAttention(self.num_heads, _kv_spec(config, layer, self.qkv_proj), scalar ** -0.5, softcap)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, 1, D/2] -> [T, H]
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q = qkv[:, :q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, q_size: q_size + kv_size].view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        qk = apply_rotary(torch.cat((q, k), dim=1), cos, sin)
        v = qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(qk[:, : self.num_heads], qk[:, self.num_heads:], v, meta))


class Gemma3MLP(nn.Module):
    """Gated GELU (tanh) of width ``intermediate_size`` (the config's unless given: Gemma 4's double-wide layers)
    split over ``tp``."""

    legacy_gelu = False  # whether "gelu" means the tanh approximation (Gemma 1's first releases, as transformers reads)

    def __init__(self, config, tp: TPGroup, intermediate_size: int | None = None):
        super().__init__()
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        if act == "gelu" and self.legacy_gelu:
            act = "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation={act!r} is not supported; Gemma 2, 3 and 4 use 'gelu_pytorch_tanh'")
        inter = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], tp)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    attention_class: type[Gemma3Attention] = Gemma3Attention

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__()
        self.layer_type = config.layer_types[layer]
        if self.layer_type not in LAYER_TYPES:
            raise ValueError(f"layer_types[{layer}]={self.layer_type!r} is not supported; one of {list(LAYER_TYPES)}")
        self.self_attn = self.attention_class(config, tp, layer)
        self.mlp = Gemma3MLP(config, tp)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: the residual stream [T, H] -> the next layer's
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(StageModel):
    layer_class: type[Gemma3DecoderLayer] = Gemma3DecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__()
        self.build_stage(config, pp, lambda i: self.layer_class(config, tp, i),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps))
        self.embed_scale = config.hidden_size ** 0.5  # applied in the embedding's dtype, as transformers does
        head_dim = _head_dim(config)
        # one RoPE per kind of layer (a config with one for all layers, Gemma 2's, gives each kind the same)
        kinds = getattr(config, "layer_types", None) or ["full_attention"]  # Gemma 1: every layer global
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(head_dim, rope_parameters(config, kind),
                                                           config.max_position_embeddings)
                                     for kind in sorted(set(kinds))})

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # input_ids: [T] -> hidden [T, H], and the residual stream [T, H] entering each layer of aux_layers. A stage
        # after the first starts from the previous stage's residual stream ``intermediate`` [1, T, H]; a stage before
        # the last ends there, returning its own
        # image rows (meta.input_embeds) replace the scaled token embeddings unscaled, as transformers scatters them
        x = meta.with_input_embeds(self.embed(input_ids)) if intermediate is None else intermediate[0]
        tables = {}
        for kind, rotary in self.rotary.items():
            rotary.ensure(meta.max_position + 1)
            tables[kind] = rotary(meta.positions, x.dtype)
        aux: dict[int, torch.Tensor] = {}
        for i, layer in self.stage_layers():
            if i in aux_layers:
                aux[i] = x
            x = layer(x, *tables[layer.layer_type], meta)
        if not self.pp.is_last:
            return x[None], [aux[i] for i in aux_layers]
        return self.norm(x), [aux[i] for i in aux_layers]


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model for causal LM, sharded over ``tp`` (the plumbing is
    :class:`~specray.models.llama.LlamaForCausalLM`'s)."""

    model_class = Gemma3Model
    stage_width = 1  # a stage hands the next its residual stream alone
    caps_logits = True

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)
