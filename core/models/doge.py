"""Doge (SmallDoge's ``DogeForCausalLM``, model_type ``doge``: Doge-20M .. 320M and their -Instruct releases) on the
Llama family's plumbing (paged K/V per layer, pipeline stages, weight loading, LoRA on Llama's seven projections).

Where it differs from Llama:

* dynamic mask attention: every key token carries one bias per KV head, ``exp(A * softplus(dt_proj(v)))``, computed
  from that token's own values (all KV heads' ``v`` concatenated, before any rotation), added to every query's score
  of that key (repeated over the head's query group). Since it depends on the key's token alone it is cached per slot
  beside the layer's K/V (:class:`DynamicMaskSpec`, listed after the layer's K/V in ``kv_cache_specs``), so tree
  moves, prefix caching, chunked prefill, pipeline stages and an FP8 cache carry it as they carry the K/V, and a
  token's bias never changes after the step that wrote it. Where a query may see more than ``keep_window_size``
  keys, it attends only the ``keep_window_size`` keys of largest bias among those it may see (per KV head), as
  transformers' top-k over its mask does; keys it may not see never count;
* Qwen3's RMSNorm over each query and key head before RoPE;
* learned per-channel residual scales: each block's input stream is multiplied by ``input_residual`` (attention) or
  ``post_attention_residual`` (MLP) before the block's output joins it.

Under tensor parallelism each rank holds its KV heads' values, while ``dt_proj`` reads every head's: the ranks
all-gather ``v`` (one [T, Hkv * D] gather per layer; replicated KV heads taken once each) and every rank holds the
whole, small ``dt_proj`` and ``A``.

Refused: ``is_moe`` (the cross-domain MoE, CDMoE: transformers routes it from a view of the router's output that
mixes different tokens' logits within one forward, so a prefill's routing depends on the tokens beside it and no
paged schedule reproduces it). The bias (an [rows, keys] tensor per KV head) is materialised on both attention
paths, a long sequence's by blocks of rows (:data:`specray.models.alibi.BIAS_ELEMENTS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.alibi import BIAS_ELEMENTS
from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.kv_cache import FullAttentionSpec, KVCache, KVCacheSpec
from specray.models.layers import ColumnParallelLinear, RMSNorm
from specray.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from specray.parallel import TPGroup

MODEL_TYPE = "doge"


@dataclass(frozen=True)
class DynamicMaskSpec(KVCacheSpec):
    """A layer's dynamic-mask bias per slot, one value per KV head of this rank: ``[slots, Hkv]``. It moves with the
    slots as the layer's K/V does."""

    num_kv_heads: int

    @property
    def slot_shape(self) -> tuple[int, ...]:
        return (1, self.num_kv_heads)

    @property
    def slot_dim(self) -> int:
        return 0


class DynamicMaskAttention(PagedAttention):
    """Paged attention whose scores get each key's cached bias added, on both of :class:`PagedAttention`'s paths
    (the padded short batch, one sequence at a time), keeping for each query the ``keep_window_size`` visible keys
    of largest bias. The masks are built from cached values and the step's metadata alone: no host sync."""

    def __init__(self, num_heads: int, kv_spec: FullAttentionSpec, scale: float, keep_window_size: int):
        super().__init__(num_heads, kv_spec, scale)
        self.keep_window_size = keep_window_size
        self.bias_cache = torch.empty(0)  # [slots, Hkv]: bind_bias_cache
        self._step_bias = torch.empty(0)  # [T, Hkv]: this step's rows, as the cache holds them (a fresh sequence's)

    def bind_bias_cache(self, cache: torch.Tensor) -> None:
        """The per-key biases ``cache`` [slots, Hkv] (a :class:`DynamicMaskSpec`'s view; FP8 bytes with an FP8
        cache, as the K/V beside it, bound first)."""
        self.bias_cache = cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]; bias: [T, Hkv] each new key's -> [T, Hq*D]
        assert bias is not None, "a dynamic-mask layer attends with its keys' biases"
        self._store(k, v, meta.slot_mapping)
        stored = self._stored(bias)
        self.bias_cache.index_copy_(0, meta.slot_mapping, stored)
        self._step_bias = self._read(stored, q.dtype)
        return self._by_path(q, meta, lambda: self._short(q, meta), lambda i: self._own(q, k, v, meta, i))

    def masked_bias(self, key_bias: torch.Tensor, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """key_bias [B, Hkv, L], allowed [B, 1 or Hkv, R, L] bool -> the additive mask [B, Hkv, R, L]: each key's
        bias where the row may see it and it is among the row's ``keep_window_size`` largest visible ones, else
        -inf."""
        mask = key_bias[:, :, None, :].to(dtype).masked_fill(~allowed, float("-inf"))
        w = self.keep_window_size
        if mask.shape[-1] <= w:  # (a host int: the padded context's length) every visible key is kept
            return mask
        kth = mask.topk(w, dim=-1).values[..., -1:]
        # keys tied with the w-th largest (a token repeated: equal values in the first layer) fill the places left,
        # the latest first (transformers leaves their order to torch.topk's, which no device specifies)
        tied = mask == kth
        left = w - (mask > kth).sum(-1, keepdim=True)
        latest = tied.flip(-1).cumsum(-1).flip(-1)  # tied keys at or after each key
        return mask.masked_fill((mask < kth) | (tied & (latest > left)), float("-inf"))

    def short_mask(self, meta: AttentionMetadata, dtype: torch.dtype) -> torch.Tensor:
        # -> [Bs, Hkv, G*Q, L] additive, from the padded contexts' cached biases (this step's already written)
        sb = meta.short
        hkv = self.num_kv_heads
        blocks = self.bias_cache.view(-1, self.block_size, hkv).index_select(0, sb.block_index)
        key_bias = self._read(blocks, dtype).view(sb.num_seqs, -1, hkv).transpose(1, 2)  # [Bs, Hkv, L]
        return self.masked_bias(key_bias, meta.short_mask(self.groups, self.mask_kind), dtype)

    def _own(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
             i: int, select: torch.Tensor | None = None) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [q_len, Hq*D], GQA-folded, by blocks of rows whose masks stay within
        # BIAS_ELEMENTS values
        assert select is None, "dynamic mask attention picks its keys by their biases"
        seq = meta.own[i]
        ks, vs = self.own_keys_values(k, v, meta, i, q.dtype)  # [1, Hkv, ctx, D]
        if seq.fresh:  # its keys are its own rows
            key_bias = self._step_bias[seq.token_start: seq.token_end]
        else:
            key_bias = self._read(self._bias_context(seq), q.dtype)
        key_bias = key_bias.t()[None]  # [1, Hkv, ctx]
        block = max(1, BIAS_ELEMENTS // (self.num_heads * seq.context_len))
        out = []
        for a in range(0, seq.query_len, block):
            b = min(a + block, seq.query_len)
            keys = seq.start_pos + b  # later keys are later tokens (a tree lists parents first): no row here sees them
            allowed = meta.own_allowed(i, self.mask_kind, slice(a, b))[:, :keys].repeat(self.groups, 1)  # [G*r, keys]
            mask = self.masked_bias(key_bias[..., :keys], allowed[None, None], q.dtype)  # [1, Hkv, G*r, keys]
            o = self._attend(self._fold(q[seq.token_start + a: seq.token_start + b], 1, b - a), ks[:, :, :keys],
                             vs[:, :, :keys], mask)
            out.append(self._unfold(o, 1, b - a))
        return out[0] if len(out) == 1 else torch.cat(out)

    def _bias_context(self, seq) -> torch.Tensor:
        # -> [ctx, Hkv]: a view of the bias cache when the sequence's blocks are consecutive, else gathered
        if seq.first_slot is not None:
            return self.bias_cache[seq.first_slot: seq.first_slot + seq.context_len]
        blocks = self.bias_cache.view(-1, self.block_size, self.num_kv_heads).index_select(0, seq.block_index)
        return blocks.reshape(-1, self.num_kv_heads)[: seq.context_len]


class DogeAttention(LlamaAttention):
    """Llama's attention with per-head q/k RMSNorms and the dynamic mask (module docstring): ``dt_proj`` and ``A``
    turn each new token's values into its keys' biases."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.tp = tp
        self.total_kv_heads = config.num_key_value_heads
        self.kv_head_start = self.qkv_proj.kv_head_start
        bias = bool(getattr(config, "attention_bias", False))
        self.dt_proj = ColumnParallelLinear(self.total_kv_heads * self.head_dim, self.total_kv_heads,
                                            TPGroup.single(), bias=bias)  # the whole of it on every rank
        self.A = nn.Parameter(torch.zeros(self.total_kv_heads), requires_grad=False)
        self.attn = DynamicMaskAttention(self.num_heads, self.attn.kv_spec, self.attn.scale,
                                         int(config.keep_window_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, 1, D/2] -> [T, H]
        q, k, v = self.project(x, cos, sin, meta)
        return self.o_proj(self.attn(q, k, v, meta, self.key_bias(v)))

    def key_bias(self, v: torch.Tensor) -> torch.Tensor:
        """v [T, Hkv_local, D] -> each new token's bias per local KV head [T, Hkv_local]: ``exp(A * softplus(
        dt_proj(v of every KV head)))``."""
        t = v.shape[0]
        every = self.tp.all_gather(v.reshape(t, -1), dim=-1)  # [T, ranks * Hkv_local * D], in rank order
        if self.tp.size > self.total_kv_heads:  # each KV head on tp / Hkv ranks in a row: take it once
            every = every.view(t, self.tp.size, -1)[:, :: self.tp.size // self.total_kv_heads].reshape(t, -1)
        bias = torch.exp(self.A * F.softplus(self.dt_proj(every)))  # [T, Hkv]
        return bias[:, self.kv_head_start: self.kv_head_start + self.num_kv_heads]


class DogeDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer whose blocks' input streams are scaled per channel (``input_residual``,
    ``post_attention_residual``) before each block's output joins them."""

    attention_class = DogeAttention

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__(config, tp, layer, expert_parallel)
        self.input_residual = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.post_attention_residual = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H], the stream entering the layer is x + residual; the pair returned sums to the stream
        # leaving it (the next norm adds them)
        stream = x if residual is None else x + residual
        h = self.mix(self.input_layernorm(stream), cos, sin, meta)
        h, stream = self.post_attention_layernorm(h, self.input_residual * stream)
        return self.mlp(h), self.post_attention_residual * stream


class DogeModel(LlamaModel):
    layer_class = DogeDecoderLayer


def _checked(config):
    """``config`` as the layers read it; a ValueError for what is not implemented."""
    if getattr(config, "is_moe", False):
        raise ValueError(f"is_moe=True (Doge's cross-domain MoE, CDMoE) is not supported for model_type="
                         f"'{MODEL_TYPE}': transformers routes it from a view of the router's output that mixes the "
                         "logits of different tokens of one forward, so no paged schedule reproduces a prefill; "
                         "serve a dense Doge release (is_moe=false)")
    window = getattr(config, "keep_window_size", None)
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"keep_window_size={window!r} must be a positive integer (the keys each query keeps by "
                         "their dynamic-mask bias); use the release's value (2048)")
    return config


class DogeForCausalLM(LlamaForCausalLM):
    """Doge for causal LM, sharded over ``tp`` (heads; ``dt_proj`` and ``A`` replicated) and ``pp``."""

    model_class = DogeModel

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False, pp=None):
        super().__init__(_checked(hf_config), tp, expert_parallel, pp)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Each layer's K/V spec in layer order, its keys' biases after it."""
        specs: list[KVCacheSpec] = []
        for _, layer in self.model.stage_layers():
            specs += [layer.self_attn.attn.kv_spec, DynamicMaskSpec(layer.self_attn.num_kv_heads)]
        return specs

    def bind_kv_cache(self, cache: KVCache) -> None:
        assert cache.specs == self.kv_cache_specs(), "the cache was allocated for another model's specs"
        for j, (_, layer) in enumerate(self.model.stage_layers()):
            attn = layer.self_attn.attn
            attn.bind_cache(cache.layer(2 * j), cache.block_size, cache.fp8)
            attn.bind_bias_cache(cache.layer(2 * j + 1))
        self.kv_cache_allocated = True
