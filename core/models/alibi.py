"""ALiBi (Press et al., "Train Short, Test Long"): attention without position embeddings, where each head adds a
linear penalty for distance to its scores, ``s(q, k) = q.k * scale + slope_h * (pos_k - pos_q)`` (``pos_k <=
pos_q``: the penalty grows with distance). BLOOM, MPT and Falcon-RW attend so.

Each head's slope is a geometric sequence over the heads (:func:`alibi_slopes`). Releases add ``slope_h * pos_k``
instead (transformers builds a bias per key); the two differ by ``slope_h * pos_q``, the same for every key of a
query, which the softmax cancels. The distance is taken between RoPE positions, never slots, as the masks are
(:mod:`specray.models.attention`), so a token tree's siblings at one depth see their ancestors at the right
distances.

The bias is additive: each step builds it once per path (the short batch's ``[Bs, Hkv, G*Q, L]`` over its folded query
rows, an own sequence's over its context), already masked (``-inf`` where the mask says no), and every layer reads it as
SDPA's float mask, so the layers keep SDPA's kernels and the GQA folding. A sequence attended on its own whose bias
would pass :data:`BIAS_ELEMENTS` values (a long prefill chunk: heads x rows x context) attends by blocks of rows, each
block's bias built in each layer, so its memory stays bounded; the short batch's is not split: its rows are few (at most
``SHORT_QUERY_MAX`` a sequence, a graph step's ``step_graphs.GRAPH_QUERY_MAX``), so it holds heads x rows x 2 bytes per
padded context slot, against the K/V's layers x 2 x KV heads x head_dim x 2 bytes per cached token (BLOOM-7B1, 8 rows:
512 B against 480 KB). A graph step's bias is one more of its static inputs, rebuilt from each step's metadata as its
masks are. On a GPU a kernel that takes the slopes (flash-attention's ``alibi_slopes``) would not materialise the bias:
not done here; never run on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specray.models.attention import AttentionMetadata, PagedAttention, own_key_positions
from specray.models.classic import NoRopeAttention
from specray.models.kv_cache import FullAttentionSpec
from specray.parallel import TPGroup


def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> list[float]:
    """Each head's slope. With ``n`` heads, ``n`` a power of two: ``2^(-max_bias * i / n)`` for head ``i = 1..n``.
    Otherwise the ``m`` slopes of the largest power of two ``m`` below ``n``, then the first ``n - m`` of the slopes
    of ``2m`` heads that lie between them (odd ``i``: ``2^(-max_bias * i / 2m)``); BLOOM's and MPT's rule
    (``alibi_bias_max``: MPT's ``max_bias``, 8 in every release)."""
    if num_heads < 1 or not max_bias > 0:
        raise ValueError(f"ALiBi needs at least one head and a positive alibi_bias_max, got num_heads={num_heads}, "
                         f"alibi_bias_max={max_bias}")
    m = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [2.0 ** (-max_bias * i / m) for i in range(1, m + 1)]
    return slopes + [2.0 ** (-max_bias * i / (2 * m)) for i in range(1, 2 * (num_heads - m), 2)]


BIAS_ELEMENTS = 1 << 26  # a sequence attended on its own holds at most this many bias values: a longer one, by rows


class AlibiAttention(PagedAttention):
    """:class:`PagedAttention` whose masks carry ALiBi's bias (module docstring). ``slopes``: this rank's heads'
    slopes, each already times what the family scales its bias by (Falcon-RW: the score scale)."""

    def __init__(self, num_heads: int, kv_spec: FullAttentionSpec, scale: float, slopes: Sequence[float]):
        super().__init__(num_heads, kv_spec, scale)
        assert len(slopes) == num_heads, (len(slopes), num_heads)
        self.slopes = tuple(float(s) for s in slopes)  # host floats: the key of the step's bias, shared by layers
        self._on_device: dict[torch.device, torch.Tensor] = {}  # copied once per device, not at every step

    def short_mask(self, meta: AttentionMetadata, dtype: torch.dtype) -> torch.Tensor:
        # -> [Bs, Hkv, G*Q, L] additive
        return meta.cached(("alibi-short", self.slopes, self.groups, self.mask_kind, dtype),
                           lambda m: self._short_bias(m, dtype))

    def own_mask(self, meta: AttentionMetadata, i: int, dtype: torch.dtype) -> torch.Tensor:
        # -> [1, Hq, q, q] for a fresh prefill, else [1, Hkv, G*q, ctx] over its folded query rows; additive
        return meta.cached(("alibi-own", i, self.slopes, self.groups, self.mask_kind, dtype),
                           lambda m: self._own_bias(m, i, dtype))

    def _own(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
             i: int, select: torch.Tensor | None = None) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [q_len, Hq*D]. A long chunk's bias over its whole context would be
        # heads x rows x context values (a long prefill's: gigabytes): it goes by blocks of rows, each its own bias
        seq = meta.own[i]
        block = max(1, BIAS_ELEMENTS // (self.num_heads * seq.context_len))
        if seq.query_len <= block:  # the step's bias, built once and shared by the layers
            return super()._own(q, k, v, meta, i, select)
        assert select is None, "ALiBi has no sparse selection"
        ks, vs = self.own_keys_values(k, v, meta, i, q.dtype)  # [1, Hkv, ctx, D]
        k_pos = own_key_positions(meta, i)  # [ctx]
        out = []
        for a in range(0, seq.query_len, block):
            b = min(a + block, seq.query_len)
            keys = seq.start_pos + b  # later keys are later tokens (a tree lists parents first): no row here sees them
            distance = (k_pos[None, :keys] - k_pos[seq.start_pos + a: keys, None]).float()  # [r, keys]
            allowed = meta.own_allowed(i, self.mask_kind, slice(a, b))[:, :keys]
            bias = (self._slopes(distance.device) * distance).masked_fill(~allowed, float("-inf"))  # [Hkv, G, r, keys]
            bias = bias.reshape(1, self.num_kv_heads, self.groups * (b - a), keys).to(q.dtype)
            o = self._attend(self._fold(q[seq.token_start + a: seq.token_start + b], 1, b - a), ks[:, :, :keys],
                             vs[:, :, :keys], bias)
            out.append(self._unfold(o, 1, b - a))
        return torch.cat(out)

    def _slopes(self, device: torch.device) -> torch.Tensor:
        # [Hkv, G, 1, 1]: query head h * G + g's slope at [h, g] (the folded layout's order). The first step on a
        # device copies them there (a host-to-device copy waits for the stream: once, in the warm-up, never again)
        if device not in self._on_device:
            slopes = torch.tensor(self.slopes, device=device)
            self._on_device[device] = slopes.view(self.num_kv_heads, self.groups, 1, 1)
        return self._on_device[device]

    def _short_bias(self, meta: AttentionMetadata, dtype: torch.dtype) -> torch.Tensor:
        short = meta.short
        bs, q_len = short.num_seqs, short.max_query_len
        distance = meta.short_key_positions()[:, None, :] - short.query_positions[:, :, None]  # [Bs, Q, L]
        bias = self._slopes(distance.device) * distance[:, None, None].float()  # [Bs, Hkv, G, Q, L]
        allowed = meta.short_mask(self.groups, self.mask_kind)  # [Bs, 1, G*Q, L]
        bias = bias.reshape(bs, self.num_kv_heads, self.groups * q_len, -1)
        return bias.masked_fill(~allowed, float("-inf")).to(dtype)

    def _own_bias(self, meta: AttentionMetadata, i: int, dtype: torch.dtype) -> torch.Tensor:
        seq = meta.own[i]
        k_pos = own_key_positions(meta, i)  # [ctx]
        distance = (k_pos[None, :] - k_pos[seq.start_pos:, None]).float()  # [q, ctx]
        allowed = meta.own_allowed(i, self.mask_kind)  # [q, ctx]
        bias = (self._slopes(distance.device) * distance).masked_fill(~allowed, float("-inf"))  # [Hkv, G, q, ctx]
        if seq.fresh:  # attended unfolded: [1, Hq, q, ctx]
            return bias.reshape(1, self.num_heads, seq.query_len, -1).to(dtype)
        return bias.reshape(1, self.num_kv_heads, self.groups * seq.query_len, -1).to(dtype)


class AlibiSelfAttention(NoRopeAttention):
    """Llama's attention with ALiBi's bias in place of RoPE. The config (a family's view) gives ``alibi_bias_max``
    (default 8), ``alibi_scale``: what the family multiplies its bias by (default 1), and ``softmax_scale``: the
    scores' scale (default ``head_dim ** -0.5``)."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        scale = float(getattr(config, "alibi_scale", 1.0))
        slopes = alibi_slopes(config.num_attention_heads, float(getattr(config, "alibi_bias_max", 8.0)))
        first = tp.rank * self.num_heads  # this rank's query heads
        self.attn = AlibiAttention(self.num_heads, self.attn.kv_spec,
                                   getattr(config, "softmax_scale", None) or self.attn.scale,
                                   [s * scale for s in slopes[first:first + self.num_heads]])
