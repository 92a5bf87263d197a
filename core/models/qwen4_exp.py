"""Qwen4-Exp's text model (``Qwen4ExpForCausalLM``, model_type ``qwen4_exp_text``; the text part of the multimodal
``Qwen4ExpForConditionalGeneration``, model_type ``qwen4_exp``, whose vision tower is not read), on the Llama plumbing
(:mod:`specray.models.llama`: weights, paged KV, the model interface) with Qwen3.5's hybrid parts
(:mod:`specray.models.qwen3_5`, :mod:`specray.models.gated_deltanet`).

The residual is ``hc_count`` streams of ``hidden_size`` (the embedding copied into each), held as one [T, hc * H]
row per token. Every block reads them through a gated residual (:class:`GatedResidual`: the streams RMS-normed each
on its own, ``1 + w``; a low-rank sigmoid mix per feature, averaged over the streams, is the block's input) and writes
its output back into each stream times its own ``2 sigmoid(.)`` weight; after the last layer a gated residual without
write-back gives the hidden state (there is no other final norm). The layers (``layer_types``):

* ``linear_attention``: Qwen3.5's Gated DeltaNet, its output gate's activation ``output_gate_type`` (silu or sigmoid);
* ``indexed_attention`` ("full_attention" in the release, which transformers reads as this): Qwen3.5's gated attention
  (q/k norms, partial RoPE, a sigmoid gate per head) whose queries attend only the keys the QSA indexer keeps
  (:class:`QSAAttention`): per token ``indexer_n_heads`` queries (normed, rotated) and one raw key of
  ``indexer_head_dim``; for each query, the complete blocks of ``indexer_compress_ratio`` consecutive key positions it
  sees are pooled (the mean of their raw keys, normed, rotated at the block's first position) and scored
  (``sum_h relu(q_h . k_block) / sqrt(d)``); the best ``indexer_budget / indexer_compress_ratio`` blocks and the
  positions past the last complete block are attended. The indexer's raw key per token is cached beside the layer's
  K/V (MiniMax-M3's :class:`~specray.models.minimax_m3.IndexKeySpec`), so prefix caching, tree moves and chunked
  prefill carry it; the pick is computed densely (outputs exact, no sparse kernel's speed), with no host sync;
* every layer's MLP: Qwen3-Next's experts with a sigmoid-gated shared expert (:mod:`specray.models.moe`'s Qwen3.5-MoE
  row);
* on the ``ple_layer_ids`` layers (one-indexed), before the blocks, the per-layer n-gram embedding (PLE,
  :class:`PerLayerEmbedding`): each token's 2..``ngram_size``-grams of ids (the earlier ids of its segment: an EOS
  ends one, and a sequence starts as if after an EOS) are hashed into ``heads_per_ngram`` prime-sized tables each;
  their embeddings give a value and a key per stream, each stream gates the value by its normed activations, and the
  gated values plus a dilated depthwise causal conv (``ple_conv_kernel_size`` taps, dilation ``ngram_size``) over them
  are added to the streams. Both the ids a token's n-grams need and the conv's history are per-request state, kept as
  the recurrent layers' is (:class:`~specray.models.gated_deltanet.RecurrentMixer`: the conv as a dense one with zero
  weights between the taps; the ids as conv channels of base-256 digits, exact in any float type, that a fixed
  one-hot conv shifts), so drafts are replayed, token trees verified and graph steps taken as Qwen3.5's.

Tensor parallelism splits the attention and linear heads and the experts as Qwen3.5's, and the PLE's n-gram tables
by columns (each rank looks up its slice of every row, one all-gather joins them; the checkpoint's row shards are
read unjoined, each rank reading only its columns); the gated residuals, the indexers and the rest of the PLE are
replicated on every rank. Pipeline stages hand on the streams
(``stage_width`` = ``hc_count``). Not supported: hidden-state draft heads (EAGLE, MTP: the release's ``mtp.*`` is
not read), LoRA (refused at build).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention, own_key_positions
from specray.models.gated_deltanet import (ConvOnlyMixer, GatedDeltaNet, GatedRMSNorm, RecurrentMixer, RecurrentModel,
                                           check_linear_heads_split)
from specray.models.kv_cache import KVCache, KVCacheSpec, RecurrentStateSpec
from specray.models.layers import (ColumnParallelLinear, RotaryEmbedding, VocabParallelEmbedding, _copy, _param,
                                   apply_rotary, materialize, narrow, rope_parameters, rotary_dim, shape_of)
from specray.models.llama import LlamaForCausalLM, StageModel, _head_dim
from specray.models.minimax_m3 import (INDEX_SCORE_ELEMENTS, BlockSparseAttention, IndexKeySpec, UnitOffsetRMSNorm,
                                       _rotate_as_transformers)
from specray.models.moe import FAMILIES, SparseMoE
from specray.models.qwen3_5 import GatedAttention
from specray.parallel import PPGroup, TPGroup

MODEL_TYPE = "qwen4_exp_text"
LAYER_TYPES = ("linear_attention", "indexed_attention")
FAMILIES[MODEL_TYPE] = FAMILIES["qwen3_5_moe_text"]  # Qwen3-Next's experts and gated shared expert
DIGITS = 3  # base-256 digits of (token id + 1) carried per earlier token: ids below 2**24 - 1, each digit exact
_SKIPPED = ("mtp.", "model.visual.", "model.language_model.visual.")
_NGRAM_SHARD = re.compile(r"^(.*\.ngram_embedding)\.shard_(\d+)\.weight$")
_BUFFERS = (".layer_multipliers", ".ngram_heads_vocab_sizes", ".ngram_heads_offsets")  # recomputed, not read


def _one() -> TPGroup:
    return TPGroup.single()


class GroupedRMSNorm(nn.Module):
    """``1 + w`` RMSNorm over each group of ``group`` features of a [.., n * group] row (one stream each), float32,
    cast back."""

    def __init__(self, size: int, group: int, eps: float):
        super().__init__()
        self.group, self.eps = group, eps
        self.weight = _param(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().unflatten(-1, (-1, self.group))
        xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedResidual(nn.Module):
    """The streams [T, n * H] -> a block's input [T, H] (the normed streams mixed per feature by
    ``sigmoid(up(silu(down(normed) / n)))`` and averaged over the streams), and with ``inject`` each stream's weight
    for the block's output [T, n] (``2 sigmoid(inject(normed) / n)``). Replicated on every rank."""

    def __init__(self, config, inject: bool = True):
        super().__init__()
        n, h = config.hc_count, config.hidden_size
        self.n, self.h = n, h
        self.hc_norm = GroupedRMSNorm(n * h, h, config.rms_norm_eps)
        self.input_mix_weight_down = ColumnParallelLinear(n * h, config.hc_lowrank, _one())
        self.input_mix_weight_up = ColumnParallelLinear(config.hc_lowrank, n * h, _one())
        self.block_inject_weight = ColumnParallelLinear(n * h, n, _one()) if inject else None

    def forward(self, streams: torch.Tensor):
        normed = self.hc_norm(streams)
        mix = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(normed) / self.n)))
        mixed = (mix * normed).unflatten(-1, (self.n, self.h)).mean(-2)  # [T, H]
        if self.block_inject_weight is None:
            return mixed
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.n)

    @staticmethod
    def write(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The streams [T, n * H] with a block's output [T, H] added to each stream times its weight [T, n]."""
        return streams + (out[:, None, :] * weights[..., None]).flatten(1)


# ---------------------------------------------------------------------------------------------- linear attention


class SigmoidGatedRMSNorm(GatedRMSNorm):
    """:class:`~specray.models.gated_deltanet.GatedRMSNorm` gated by ``sigmoid(gate)`` (``output_gate_type``)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype) * torch.sigmoid(gate.float())).to(x.dtype)


class Qwen4ExpGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's Gated DeltaNet whose gated norm's activation is ``output_gate_type`` (silu, or sigmoid)."""

    def __init__(self, config, tp: TPGroup):
        super().__init__(config, tp)
        if (config.output_gate_type or config.hidden_act) == "sigmoid":
            self.norm = SigmoidGatedRMSNorm(self.dv, config.rms_norm_eps)


# ---------------------------------------------------------------------------------------------- QSA attention


class QSAIndexer(nn.Module):
    """The QSA indexer of one layer, replicated on every rank: ``index_qk_proj`` gives per token ``indexer_n_heads``
    queries (normed ``1 + w``, rotated by the layer's partial RoPE) and one raw key (cached as it is; pooled, normed
    and rotated per block when a query scores it: :meth:`select`)."""

    def __init__(self, config):
        super().__init__()
        self.heads, self.dim = config.indexer_n_heads, config.indexer_head_dim
        self.ratio = config.indexer_compress_ratio
        self.block_topk = config.indexer_budget // self.ratio
        self.index_qk_proj = ColumnParallelLinear(config.hidden_size, (self.heads + 1) * self.dim, _one())
        self.q_layernorm = UnitOffsetRMSNorm(self.dim, config.rms_norm_eps)
        self.k_layernorm = UnitOffsetRMSNorm(self.dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x [T, H] -> raw keys [T, Di], queries [T, Hi, Di]
        t = x.shape[0]
        q, k = self.index_qk_proj(x).split([self.heads * self.dim, self.dim], dim=-1)
        return k, _rotate_as_transformers(self.q_layernorm(q.reshape(t, self.heads, self.dim)), cos, sin)

    def select(self, queries: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, q_pos: torch.Tensor,
               k_pos: torch.Tensor, chunks: tuple[list[int], list[int]] | None, rotary: RotaryEmbedding
               ) -> torch.Tensor:
        """queries [N, Q, Hi, Di], raw keys [N, L, Di], allowed [N, Q, L] bool, q_pos [N, Q], k_pos [N, L] -> [N, Q,
        L] bool: the allowed keys each query attends. ``chunks`` None: each sequence is a chain whose key l sits at
        position l, so every query sees the same keys in a block and the pooled keys are shared; else per sequence
        the index of its first new key and its new keys' count (``(starts, lens)``: a token tree among them), whose
        pooled keys are each query's own (the keys before the new ones, shared, plus the new ones it may see)."""
        n, q, _, d = queries.shape
        length, r = keys.shape[1], self.ratio
        blocks = length // r
        if blocks == 0:
            return allowed
        dev = keys.device
        index = torch.arange(blocks, device=dev)
        if chunks is None:
            sums = keys[:, : blocks * r].float().reshape(n, 1, blocks, r, d).sum(3)  # [N, 1, B, Di]
            complete = (index + 1) * r <= q_pos[..., None] + 1  # [N, Q, B]
        else:
            starts = torch.tensor(chunks[0], device=dev)
            lens = torch.tensor(chunks[1], device=dev)
            before = torch.arange(length, device=dev)[None] < starts[:, None]  # [N, L]: keys every query sees
            head = before[:, : blocks * r]
            base = keys[:, : blocks * r].float().masked_fill(~head[..., None], 0.0).reshape(n, blocks, r, d).sum(2)
            counts = head.reshape(n, blocks, r).sum(-1)  # [N, B]
            new = torch.arange(max(chunks[1]), device=dev)  # [J]
            rows = (starts[:, None] + new).clamp(max=length - 1)  # [N, J]
            new_keys = keys.gather(1, rows[..., None].expand(-1, -1, d)).float()
            onehot = ((k_pos.gather(1, rows) // r)[..., None] == index).float()  # [N, J, B]
            seen = allowed.gather(2, rows[:, None].expand(n, q, -1)) & (new < lens[:, None])[:, None]  # [N, Q, J]
            seen = seen.float()
            sums = base[:, None] + torch.einsum("nqj,njb,njd->nqbd", seen, onehot, new_keys)
            complete = counts[:, None] + torch.einsum("nqj,njb->nqb", seen, onehot) == r
        pooled = self.k_layernorm((sums / r).to(keys.dtype))  # [N, Q or 1, B, Di]
        starts_pos = (index * r).clamp(max=rotary.table_len - 1)  # blocks past the table are never complete
        cos, sin = rotary(starts_pos, keys.dtype)  # [B, 1, R/2]
        pooled = _rotate_as_transformers(pooled, cos[:, 0], sin[:, 0]).float()
        per_head = torch.einsum("nqhd,nqbd->nqhb", queries.float(), pooled.expand(n, q, blocks, d))
        scores = per_head.relu().sum(2) / math.sqrt(d)  # [N, Q, B]
        scores = scores.masked_fill(~complete, float("-inf"))
        top = scores.topk(min(self.block_topk, blocks), dim=-1)
        picked = torch.zeros_like(complete).scatter_(-1, top.indices, top.values > float("-inf"))
        key_block = (k_pos // r)[:, None].expand(n, q, length)  # [N, Q, L]
        inside = key_block < blocks
        key_block = key_block.clamp(max=blocks - 1)
        dropped = inside & complete.gather(-1, key_block) & ~picked.gather(-1, key_block)
        return allowed & ~dropped


class QSAAttention(BlockSparseAttention):
    """Paged attention whose queries attend only the keys their QSA indexer keeps (one pick per query, shared by its
    heads), on both of :class:`PagedAttention`'s paths; the indexer's raw keys cached beside the K/V
    (:class:`~specray.models.minimax_m3.IndexKeySpec`, :meth:`bind_index_cache`)."""

    def __init__(self, num_heads: int, kv_spec, scale: float, index_dim: int):
        PagedAttention.__init__(self, num_heads, kv_spec, scale)
        self.index_dim = index_dim
        self.index_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                index: tuple | None = None) -> torch.Tensor:
        # q [T, Hq, D], k, v [T, Hkv, D]; index: (raw keys [T, Di], queries [T, Hi, Di], the indexer, the RoPE table)
        assert index is not None, "an indexed layer attends the keys its indexer keeps"
        keys, queries, indexer, rotary = index
        self._store(k, v, meta.slot_mapping)
        stored = self._stored(keys)
        self.index_cache.index_copy_(0, meta.slot_mapping, stored)
        keys = self._read(stored, keys.dtype)
        select = lambda *args: indexer.select(*args, rotary)  # noqa: E731
        return self._by_path(q, meta, lambda: self._short_qsa(q, queries, meta, select),
                             lambda i: self._own_qsa(q, k, v, keys, queries, meta, i, select))

    def _heads_mask(self, keep: torch.Tensor) -> torch.Tensor:
        # [N, Q, L] -> [N, Hkv, G*Q, L]: the folded rows (head h*G + g, query j) all take their query's pick
        n, q, length = keep.shape
        return keep[:, None, None].expand(n, self.num_kv_heads, self.groups, q, length).reshape(
            n, self.num_kv_heads, self.groups * q, length)

    def _short_qsa(self, q: torch.Tensor, queries: torch.Tensor, meta: AttentionMetadata, select) -> torch.Tensor:
        sb = meta.short
        bs, q_len = sb.num_seqs, sb.max_query_len
        if sb.token_index is not None:
            q, queries = q.index_select(0, sb.token_index), queries.index_select(0, sb.token_index)
        keys = self.index_cache.view(-1, self.block_size, self.index_dim).index_select(0, sb.block_index)
        keys = self._read(keys, queries.dtype).reshape(bs, -1, self.index_dim)  # [Bs, L, Di]
        allowed = meta.short_mask(1, self.mask_kind)[:, 0]  # [Bs, Q, L]
        chunks = None if all(meta.plain(i) for i in sb.seq_ids) else (
            [meta.start_positions[i] for i in sb.seq_ids], [meta.query_lens[i] for i in sb.seq_ids])
        keep = select(queries.view(bs, q_len, *queries.shape[1:]), keys, allowed, sb.query_positions,
                      meta.short_key_positions(), chunks)
        k = self._read(self._gather(self.k_cache, sb.block_index, bs), q.dtype, self.k_scale)
        v = self._read(self._gather(self.v_cache, sb.block_index, bs), q.dtype, self.v_scale)
        return self._unfold(self._attend(self._fold(q, bs, q_len), k, v, self._heads_mask(keep)), bs, q_len)

    def _own_qsa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, queries: torch.Tensor,
                 meta: AttentionMetadata, i: int, select) -> torch.Tensor:
        seq = meta.own[i]
        rows = slice(seq.token_start, seq.token_end)
        if seq.fresh:
            ks, vs = (self._read(self._stored(x[rows], s), q.dtype, s).transpose(0, 1)[None]
                      for x, s in ((k, self.k_scale), (v, self.v_scale)))  # [1, Hkv, q, D]
            index_keys = keys[rows]
        else:
            ks = self._read(self._context(self.k_cache, seq), q.dtype, self.k_scale)
            vs = self._read(self._context(self.v_cache, seq), q.dtype, self.v_scale)
            index_keys = self._read(self._index_context(seq), queries.dtype)
        allowed = meta.own_allowed(i, self.mask_kind)  # [q, ctx]
        k_pos = own_key_positions(meta, i)
        q_pos = k_pos[seq.start_pos:]
        length, q_len = k_pos.shape[0], seq.query_len
        chunks = None if meta.plain(seq.seq_id) else ([seq.start_pos], [q_len])
        step = max(1, INDEX_SCORE_ELEMENTS // max(1, length * max(self.num_heads, queries.shape[1])))
        out = []
        for r in range(0, q_len, step):
            part = slice(r, min(r + step, q_len))
            n = part.stop - part.start
            keep = select(queries[rows][None, part], index_keys[None], allowed[None, part], q_pos[None, part],
                          k_pos[None], chunks)  # [1, n, ctx]
            if seq.fresh:
                o = self._attend(q[rows][part].transpose(0, 1)[None], ks, vs, keep[:, None])  # [1, Hq, n, D]
                out.append(o[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim))
            else:
                out.append(self._unfold(self._attend(self._fold(q[rows][part], 1, n), ks, vs,
                                                     self._heads_mask(keep)), 1, n))
        return out[0] if len(out) == 1 else torch.cat(out)


class Qwen4ExpAttention(GatedAttention):
    """Qwen3.5's gated attention (q/k norms ``1 + w``, partial RoPE, a sigmoid gate per head) over the keys its QSA
    indexer keeps."""

    def __init__(self, config, tp: TPGroup):
        super().__init__(config, tp)
        self.indexer = QSAIndexer(config)
        self.attn = QSAAttention(self.num_heads, self.attn.kv_spec, self.attn.scale, self.indexer.dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                rotary: RotaryEmbedding | None = None) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        q_gate, kv = qkv[:, : 2 * self.num_heads * d], qkv[:, 2 * self.num_heads * d:]
        q_gate = q_gate.view(t, self.num_heads, 2 * d)
        q, gate = self.q_norm(q_gate[..., :d]), q_gate[..., d:].reshape(t, self.num_heads * d)
        k = self.k_norm(kv[:, : self.num_kv_heads * d].view(t, self.num_kv_heads, d))
        v = kv[:, self.num_kv_heads * d:].view(t, self.num_kv_heads, d)
        qk = apply_rotary(torch.cat((q, k), dim=1), cos, sin)
        keys, queries = self.indexer(x, cos, sin)
        out = self.attn(qk[:, : self.num_heads], qk[:, self.num_heads:], v, meta, (keys, queries, self.indexer, rotary))
        return self.o_proj(out * torch.sigmoid(gate))


# ---------------------------------------------------------------------------------------------- PLE


_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _mix64(value: int) -> int:
    """SplitMix64's finaliser (the multipliers' seed mixing)."""
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def ngram_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The odd multipliers hashing the ids at each n-gram position of PLE layer ``ple_index`` (so that every product
    with an id stays below 2**63)."""
    half = max(1, (((1 << 63) - 1) // max(vocab_size, 1)) // 2)
    base = seed + 10007 * ple_index
    return [2 * (_mix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % f for f in range(3, math.isqrt(value) + 1, 2))


def ngram_table_sizes(base: int, first: int, count: int) -> list[int]:
    """The prime table sizes of heads ``first .. first + count - 1`` (counted over every PLE layer): head j's is the
    (j + 1)-th prime at or above ``base``."""
    sizes, p, seen = [], base - 1, 0
    while len(sizes) < count:
        p += 1
        while not _prime(p):
            p += 1
        if seen >= first:
            sizes.append(p)
        seen += 1
    return sizes


class NGramEmbedding(ConvOnlyMixer):
    """A PLE layer's hashed n-gram embedding. Its state is the last ``ngram_size - 1`` ids of the request, kept as a
    conv history (each id as :data:`DIGITS` base-256 digits of id + 1, 0 before the first token) that a fixed one-hot
    conv shifts: channel group s reads the token s back."""

    conv_activation = False
    restarts_at_eos = True  # an EOS ends the n-grams (tests switch it off to see that it matters)

    def __init__(self, config, ple_index: int, tp: TPGroup):
        super().__init__()
        self.n = config.ngram_size
        self.kernel = self.n
        self.per_ngram = config.heads_per_ngram
        heads = (self.n - 1) * self.per_ngram
        self.eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
        sizes = ngram_table_sizes(config.ngram_vocab_size_base, ple_index * heads, heads)
        offsets = [sum(sizes[:i]) for i in range(heads)]
        divisor = config.make_ngram_vocab_size_divisible_by
        rows = -(-sum(sizes) // divisor) * divisor
        self.register_buffer("multipliers", torch.tensor(ngram_multipliers(
            config.vocab_size, self.n, ple_index, config.seed), dtype=torch.long), persistent=False)
        self.register_buffer("sizes", torch.tensor(sizes, dtype=torch.long), persistent=False)
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.long), persistent=False)
        self.tp = tp  # each rank holds its slice of every row's columns (transformers' "embedding_colwise")
        self.width = config.ple_embed_dim // heads // tp.size
        self.ngram_embedding = nn.Module()
        self.ngram_embedding.weight = _param(rows, self.width)
        self.ngram_embedding.weight.weight_loader = self._load_table
        channels = (self.n - 1) * DIGITS
        shift = torch.zeros(channels, self.n)
        for s in range(1, self.n):  # window column K - 1 is the token itself, K - 1 - s the one s back
            shift[(s - 1) * DIGITS: s * DIGITS, self.n - 1 - s] = 1.0
        self.conv1d = nn.Module()
        self.conv1d.register_buffer("weight", shift, persistent=False)
        self.channels = channels
        self.register_buffer("places", torch.tensor([1 << (8 * i) for i in range(DIGITS)]), persistent=False)

    @property
    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(conv_dim=self.channels, conv_width=self.n - 1, num_heads=0, key_dim=1, value_dim=1)

    def earlier_ids(self, input_ids: torch.Tensor, meta, dtype: torch.dtype) -> torch.Tensor:
        """[T] ids -> [T, n - 1] the ids 1 .. n - 1 tokens back (-1 before the sequence's first)."""
        t = input_ids.shape[0]
        plus = input_ids.long() + 1
        digits = torch.stack([(plus >> (8 * i)) & 255 for i in range(DIGITS)], -1).to(dtype)  # [T, DIGITS]
        if self.conv1d.weight.dtype != dtype:  # the model's dtype (0 and 1 exactly)
            self.conv1d.weight = self.conv1d.weight.to(dtype)
        none = digits.new_zeros(t, 0, dtype=torch.float32)
        out = self.recurrence(digits.repeat(1, self.n - 1), none, none, meta).reshape(t, self.n - 1, DIGITS)
        return (out.round().long() * self.places).sum(-1) - 1

    def forward(self, input_ids: torch.Tensor, meta, dtype: torch.dtype) -> torch.Tensor:
        # input_ids [T] -> [T, ple_embed_dim]
        ids = input_ids.long()
        earlier = self.earlier_ids(ids, meta, dtype)  # [T, n - 1]
        eos = torch.full_like(ids, self.eos)
        cut = torch.zeros_like(ids, dtype=torch.bool)
        shifted = [ids]
        for s in range(1, self.n):  # a token s back counts only if no EOS (nor the start) lies between
            raw = earlier[:, s - 1]
            cut = cut | (raw < 0) | ((raw == self.eos) & self.restarts_at_eos)
            shifted.append(torch.where(cut, eos, raw))
        blocks = []
        for size in range(2, self.n + 1):
            mixed = shifted[0] * self.multipliers[0]
            for pos in range(1, size):
                mixed = torch.bitwise_xor(mixed, shifted[pos] * self.multipliers[pos])
            heads = slice((size - 2) * self.per_ngram, (size - 1) * self.per_ngram)
            blocks.append(torch.remainder(mixed[:, None], self.sizes[heads]) + self.offsets[heads])
        rows = torch.cat(blocks, -1)  # [T, heads]
        # [T, heads, width] per rank -> every rank's columns in rank order [T, heads, ple_embed_dim / heads]
        return self.tp.all_gather(F.embedding(rows, self.ngram_embedding.weight), dim=-1).flatten(1)

    def _load_table(self, param: nn.Parameter, loaded: Any) -> None:
        """This rank's columns of the table, read piece by piece (the checkpoint's row shards in order,
        :class:`RowShards`, or one whole tensor): only this rank's slice of each is ever read."""
        pieces = loaded if isinstance(loaded, RowShards) else (loaded,)
        start = 0
        for piece in pieces:
            rows = shape_of(piece)[0]
            if start + rows > param.shape[0]:
                raise ValueError(f"the n-gram table's checkpoint rows ({start + rows} so far) exceed its "
                                 f"{param.shape[0]} rows: the checkpoint does not match its config.json")
            _copy(param.data[start: start + rows], narrow(piece, 1, self.tp.rank * self.width, self.width))
            start += rows
        if start != param.shape[0]:
            raise ValueError(f"the n-gram table's checkpoint has {start} rows, its config {param.shape[0]}: the "
                             "checkpoint does not match its config.json")


class RowShards(tuple):
    """A table's row shards in the checkpoint's order (``ngram_embedding.shard_<i>``, ``split_ngram_parts`` of
    them), handed to the table's loader unjoined so that no rank ever holds the whole table in memory."""


class PerLayerEmbedding(ConvOnlyMixer):
    """A layer's PLE (module docstring), replicated on every rank but its n-gram table; the mixer itself is its
    dilated conv (a dense conv of ``(K - 1) * ngram_size + 1`` taps, zero between the checkpoint's ``K``)."""

    def __init__(self, config, ple_index: int, tp: TPGroup):
        super().__init__()
        n, h = config.hc_count, config.hidden_size
        self.n, self.h = n, h
        dim = config.ple_embed_dim
        self.ple_embedding = NGramEmbedding(config, ple_index, tp)
        self.key_proj = ColumnParallelLinear(dim, n * h, _one())
        self.value_proj = ColumnParallelLinear(dim, h, _one())
        self.norm_key = GroupedRMSNorm(n * h, h, config.rms_norm_eps)
        self.norm_query = GroupedRMSNorm(n * h, h, config.rms_norm_eps)
        self.norm_conv = GroupedRMSNorm(n * h, h, config.rms_norm_eps)
        self.taps, self.dilation = config.ple_conv_kernel_size, config.ngram_size
        self.kernel = (self.taps - 1) * self.dilation + 1
        self.conv1d = nn.Module()
        self.conv1d.weight = _param(n * h, self.kernel)
        self.conv1d.weight.weight_loader = self._load_conv

    def _load_conv(self, param: nn.Parameter, loaded: Any) -> None:
        dense = torch.zeros(param.shape, dtype=param.dtype)
        dense[:, :: self.dilation] = materialize(loaded).reshape(param.shape[0], self.taps)
        _copy(param, dense)

    @property
    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(conv_dim=self.n * self.h, conv_width=self.kernel - 1, num_heads=0, key_dim=1,
                                  value_dim=1)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, meta) -> torch.Tensor:
        # streams [T, n * H] -> what PLE adds to them [T, n * H]
        t = streams.shape[0]
        emb = self.ple_embedding(input_ids, meta, streams.dtype)
        key = self.norm_key(self.key_proj(emb)).unflatten(-1, (self.n, self.h))
        query = self.norm_query(streams).unflatten(-1, (self.n, self.h))
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(self.h)  # [T, n, 1]
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * self.value_proj(emb)[:, None]).flatten(1)  # [T, n * H]
        none = streams.new_zeros(t, 0, dtype=torch.float32)
        conv = self.recurrence(self.norm_conv(gated), none, none, meta).reshape(t, -1)
        return gated + conv.to(gated.dtype)


# ---------------------------------------------------------------------------------------------- the stack


class Qwen4ExpDecoderLayer(nn.Module):
    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__()
        self.layer_type = config.layer_types[layer]
        if self.layer_type == "linear_attention":
            self.linear_attn = Qwen4ExpGatedDeltaNet(config, tp)
        else:
            self.self_attn = Qwen4ExpAttention(config, tp)
        self.mlp = SparseMoE(config, tp, expert_parallel)
        ple = list(config.ple_layer_ids or [])
        self.ple = PerLayerEmbedding(config, ple.index(layer + 1), tp) if layer + 1 in ple else None
        self.attn_hyper_connection = GatedResidual(config)
        self.mlp_hyper_connection = GatedResidual(config)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: RotaryEmbedding, meta: AttentionMetadata) -> torch.Tensor:
        # streams [T, n * H] -> the next layer's
        if self.ple is not None:
            streams = streams + self.ple(streams, input_ids, meta)
        h, weights = self.attn_hyper_connection(streams)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, meta)
        else:
            h = self.self_attn(h, cos, sin, meta, rotary)
        streams = GatedResidual.write(streams, h, weights)
        h, weights = self.mlp_hyper_connection(streams)
        return GatedResidual.write(streams, self.mlp(h), weights)


class Qwen4ExpModel(StageModel):
    """The stack over ``hc_count`` streams; its final "norm" is the last gated residual (``hyper_connection_mixer``
    in the checkpoint). A stage hands the next its streams, [n, T, H]."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__()
        self.build_stage(config, pp, lambda i: Qwen4ExpDecoderLayer(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: GatedResidual(config, inject=False))
        self.n, self.h = config.hc_count, config.hidden_size
        rope = rope_parameters(config, partial=True)
        self.rotary_emb = RotaryEmbedding(rotary_dim(_head_dim(config), rope), rope, config.max_position_embeddings)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # input_ids [T] -> hidden [T, H]; a stage after the first starts from the streams [n, T, H]
        assert not aux_layers, "refused at build: no hidden-state heads"
        if intermediate is None:
            streams = self.embed(input_ids).repeat(1, self.n)  # [T, n * H]
        else:
            streams = intermediate.transpose(0, 1).flatten(1)
        self.rotary_emb.ensure(meta.max_position + 1)
        cos, sin = self.rotary_emb(meta.positions, streams.dtype)
        for _, layer in self.stage_layers():
            streams = layer(streams, input_ids, cos, sin, self.rotary_emb, meta)
        if not self.pp.is_last:
            return streams.unflatten(1, (self.n, self.h)).transpose(0, 1).contiguous(), []
        return self.norm(streams), []


def _checked(config):
    """``config`` with what this module does not build refused by name."""
    kinds = list(config.layer_types or [])
    if len(kinds) != config.num_hidden_layers or any(kind not in LAYER_TYPES for kind in kinds):
        raise ValueError(f"layer_types={kinds!r} is not supported for model_type={MODEL_TYPE!r}: one entry per layer "
                         f"(num_hidden_layers={config.num_hidden_layers}), each one of {list(LAYER_TYPES)}")
    gate = config.output_gate_type or config.hidden_act
    if gate not in ("silu", "sigmoid"):
        raise ValueError(f"output_gate_type={config.output_gate_type!r} (hidden_act={config.hidden_act!r}): the "
                         "linear layers' output gate is 'silu' or 'sigmoid'; set output_gate_type to one of them")
    if "indexed_attention" in kinds:
        fields = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
                  "indexer_compress_ratio")
        missing = [f for f in fields if not getattr(config, f, None)]
        if missing:
            raise ValueError(f"{missing[0]}={getattr(config, missing[0], None)!r}: the indexed_attention layers need "
                             f"every QSA field {list(fields)} set to a positive int (the release's values)")
        if config.indexer_kv_heads != 1:
            raise ValueError(f"indexer_kv_heads={config.indexer_kv_heads}: Qwen4-Exp's QSA indexer has one key head; "
                             "set it to 1")
        if config.indexer_budget % config.indexer_compress_ratio:
            raise ValueError(f"indexer_budget={config.indexer_budget} is not a multiple of indexer_compress_ratio="
                             f"{config.indexer_compress_ratio}: the budget is whole blocks")
        rotated = rotary_dim(_head_dim(config), rope_parameters(config, partial=True))
        if rotated > config.indexer_head_dim:
            raise ValueError(f"indexer_head_dim={config.indexer_head_dim} is narrower than the {rotated} features "
                             "the attention's RoPE rotates; the indexer rotates as many of its own")
    if config.ple_layer_ids:
        heads = (config.ngram_size - 1) * config.heads_per_ngram
        if config.ngram_size < 2 or heads < 1 or config.ple_embed_dim % heads:
            raise ValueError(f"ple_embed_dim={config.ple_embed_dim}, ngram_size={config.ngram_size}, heads_per_ngram="
                             f"{config.heads_per_ngram}: PLE needs ngram_size >= 2 and ple_embed_dim a multiple of "
                             f"its {heads} n-gram heads")
        if config.eos_token_id is None or config.eos_token_id == []:
            raise ValueError("eos_token_id=None: PLE's n-grams restart after an EOS; set eos_token_id")
        if config.vocab_size >= (1 << (8 * DIGITS)) - 1:
            raise ValueError(f"vocab_size={config.vocab_size}: PLE carries earlier ids in {DIGITS} bytes; at most "
                             f"{(1 << (8 * DIGITS)) - 2} ids are supported")
        wrong = [i for i in config.ple_layer_ids if not 1 <= i <= config.num_hidden_layers]
        if wrong:
            raise ValueError(f"ple_layer_ids={config.ple_layer_ids}: ids are one-indexed layers in [1, "
                             f"{config.num_hidden_layers}]")
    return config


class Qwen4ExpForCausalLM(RecurrentModel, LlamaForCausalLM):
    """Qwen4-Exp's text model for causal LM (module docstring), sharded over ``tp`` and ``pp``."""

    model_class = Qwen4ExpModel
    serves_heads = False  # the streams give no hidden-state head its input (specray.engine.builder)
    lora_modules: tuple[str, ...] = ()

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False, pp=None):
        super().__init__(_checked(hf_config), tp, expert_parallel, pp)
        self.stage_width = hf_config.hc_count

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        check_linear_heads_split(config, tp, pp)
        width = config.ple_embed_dim // ((config.ngram_size - 1) * config.heads_per_ngram)
        if config.ple_layer_ids and width % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not split the n-gram tables' columns (ple_embed_dim="
                             f"{config.ple_embed_dim} over {(config.ngram_size - 1) * config.heads_per_ngram} heads: "
                             f"{width} each); choose a tensor_parallel_size that divides {width}")

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False):
        raise ValueError(f"method='mtp' is not supported for model_type={MODEL_TYPE!r}: the release's mtp.* layer "
                         "is not read; use speculative_config={'method': 'ngram'}")

    def _a_norm(self) -> torch.Tensor:
        return self.model.layers[self.model.stage.start].attn_hyper_connection.hc_norm.weight

    def _recurrent_mixers(self) -> list[RecurrentMixer]:
        # per layer: its Gated DeltaNet, its PLE's conv and its n-gram ids (module order)
        return [m for _, layer in self.model.stage_layers() for m in layer.modules() if isinstance(m, RecurrentMixer)]

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Each indexed layer's K/V spec, then its indexer's raw keys (IndexKeySpec), in layer order."""
        specs: list[KVCacheSpec] = []
        for attn in self._attention_layers():
            specs += [attn.attn.kv_spec, IndexKeySpec(attn.indexer.dim)]
        return specs

    def bind_kv_cache(self, cache: KVCache) -> None:
        assert cache.specs == self.kv_cache_specs(), "the cache was allocated for another model's specs"
        for j, attn in enumerate(self._attention_layers()):
            attn.attn.bind_cache(cache.layer(2 * j), cache.block_size, cache.fp8)
            attn.attn.bind_index_cache(cache.layer(2 * j + 1))
        self.kv_cache_allocated = True

    def _our_name(self, name: str) -> str:
        name = super()._our_name(name)
        return name.replace("model.hyper_connection_mixer.", "model.norm.")

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The checkpoint's tensors under our names: a multimodal release's text model renamed (its vision tower and
        the MTP layer dropped), each PLE table's shards joined, the n-gram hashing's buffers left out (recomputed)."""
        shards: dict[str, dict[int, Any]] = {}
        parts = int(getattr(self.config, "split_ngram_parts", 1) or 1)
        for name, tensor in weights:
            if name.startswith(_SKIPPED) or name.endswith(_BUFFERS):
                continue
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model."):]
            match = _NGRAM_SHARD.match(name)
            if match is None:
                yield name, tensor
                continue
            held = shards.setdefault(match.group(1), {})
            held[int(match.group(2))] = tensor
            if len(held) == parts:
                yield match.group(1) + ".weight", RowShards(held[i] for i in range(parts))
                del shards[match.group(1)]
        if shards:
            raise ValueError(f"{next(iter(shards))}: {len(next(iter(shards.values())))} of split_ngram_parts={parts} "
                             "shards in the checkpoint; is it complete?")
