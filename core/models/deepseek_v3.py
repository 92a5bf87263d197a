"""DeepSeek-V3 / R1 (``DeepseekV3ForCausalLM``), written with tensor-parallel layers on the Llama plumbing.

**Multi-head latent attention, weight-absorbed for decode.** A token's keys and values come from one latent ``c`` (width
``kv_lora_rank`` R, after ``kv_a_layernorm``) and one RoPE key ``k_rot`` shared by every head (width r): head h's key
is ``[W_UK_h c ; k_rot]`` and its value ``W_UV_h c`` (``kv_b_proj``'s rows). Since

    q_h . k_h = (W_UK_h^T q_nope_h) . c + q_rot_h . k_rot      and      sum_j a_hj W_UV_h c_j = W_UV_h sum_j a_hj c_j,

attention runs as multi-query attention over ``[c ; k_rot]`` (one KV head of width R + r, the same tensor as key
and value) with head h's query ``[W_UK_h^T q_nope_h ; q_rot_h]``, and ``W_UV_h`` maps the first R columns of its
output. The paged cache holds only ``[c ; k_rot]`` per token (:class:`~specray.models.kv_cache.MLAAttentionSpec`):
(R + r) numbers per layer where a Llama-style cache of the same heads would hold 2 x heads x head_dim. The softmax
scale is the unabsorbed one, ``qk_head_dim ** -0.5`` (times YaRN's mscale squared when ``mscale_all_dim`` is set).
A sequence with many new tokens (a prefill chunk of at least :func:`unabsorbed_threshold` tokens, 171 at
DeepSeek-V3's sizes) runs the unabsorbed form instead: its context's latent rows are expanded into per-head keys and
values once, and its many queries attend them with nope + r + v products per pair instead of 2R + r
(:meth:`LatentAttention.attend`); decode rows stay absorbed, where expanding the context would cost far more.

**RoPE** covers ``qk_rope_head_dim`` only (YaRN scaling); ``rope_interleave`` checkpoints rotate interleaved pairs,
which is the rotate-half rotation of the de-interleaved vector: q and k are de-interleaved alike (a dot product
does not see the order).

**Tensor parallelism**: heads split over the ranks (``q_b_proj``/``q_proj`` and ``kv_b_proj`` by head, ``o_proj``
by input); the latent (``q_a_proj``, ``kv_a_proj_with_mqa``, their norms) and its cache are replicated on every rank,
since every head reads all of it (splitting it would need a gather per layer; it is small).

**DeepSeek-V2** (``DeepseekV2ForCausalLM``) is this model with its RoPE pairs always interleaved and its own router
(:mod:`specray.models.moe`'s ``scaled_softmax`` row: the top k of a softmax, optionally group-limited, scaled).

**DeepSeek-V3.2** (``DeepseekV32ForCausalLM``: DeepSeek Sparse Attention) is this model with an indexer in every
layer's attention (:class:`Indexer`) that picks, for each query, the ``index_topk`` keys of its context it attends;
the others are masked out. The indexer's key per token sits in the latent cache row after ``[c ; k_rot]``
(``MLAAttentionSpec.index_head_dim``), so a block holds all of a layer's per-token state and moves as one. The
selection is computed densely (every query scores its whole allowed context, then the top k), so it keeps the
model's outputs, not its speed: no sparse kernel. Its MLA rotates interleaved pairs always (V2's rule).
**GLM-5** (``GlmMoeDsaForCausalLM``) is V3.2 with its indexer's RoPE on interleaved pairs too, and layers whose
``indexer_types`` entry is ``"shared"`` have no indexer: they attend the keys the last layer with one picked.

**Mistral 4** (``Mistral4ForCausalLM``) is this model with softmax expert scores in the grouped router (no correction
bias) and its queries scaled by ``1 + beta ln(1 + floor(p / L0))`` at position p (``llama_4_scaling_beta``, L0 the
rope's ``original_max_position_embeddings``).

**MoE**: layers from ``first_k_dense_replace`` on use :class:`~specray.models.moe.SparseMoE` with DeepSeek's grouped
sigmoid router and shared experts; the ones before, a dense MLP. The MTP layers (``model.layers.{L..}``) are the
MTP drafter's, skipped here.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.kv_cache import MLAAttentionSpec
from specray.models.layers import (ColumnParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear,
                                   VocabParallelEmbedding, _yarn_mscale, apply_rotary, divide,
                                   position_query_scaling, rope_parameters, scale_queries)
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel, multiplier
from specray.models.moe import SparseMoE
from specray.parallel import PPGroup, TPGroup

logger = logging.getLogger(__name__)
# sparse attention's indexer scores: at most this many per-head scores at once (a pass over as many heads as fit)
INDEX_SCORE_ELEMENTS = 1 << 26
# the q / kv latent norms' epsilon: transformers builds them at its RMSNorm's default whatever rms_norm_eps says (as
# DeepSeek's reference does) in every family on this attention
LATENT_NORM_EPS = 1e-6


class LatentAttention(PagedAttention):
    """Attention over a latent cache ``[slots, R + r]`` whose rows are both key and value: multi-query attention in
    the absorbed form, and for a sequence with many new tokens (a prefill chunk) the unabsorbed one (see
    :meth:`attend`)."""

    def __init__(self, num_heads: int, kv_spec: MLAAttentionSpec, scale: float, nope: int, v_dim: int,
                 index_topk: int = 0, shares_selection: bool = False):
        nn.Module.__init__(self)
        self.num_heads, self.kv_spec, self.scale = num_heads, kv_spec, scale
        self.num_kv_heads, self.head_dim, self.groups = 1, kv_spec.kv_lora_rank + kv_spec.qk_rope_head_dim, num_heads
        self.mask_kind = kv_spec.mask_kind
        self.block_size = 1
        self.k_cache = self.v_cache = torch.empty(0)
        self.fp8: torch.dtype | None = None
        self.k_scale = self.v_scale = 1.0  # no calibrated scales for the latent cache
        self.rank, self.nope, self.v_dim = kv_spec.kv_lora_rank, nope, v_dim
        self.unabsorbed_from = unabsorbed_threshold(self.rank, nope, v_dim)
        self.index_dim, self.index_topk = kv_spec.index_head_dim, index_topk  # DeepSeek Sparse Attention (V3.2)
        self.shares_selection = shares_selection  # attends the keys an earlier layer's indexer picked (GLM-5)
        self.rows = self.k_cache  # [1, slots, R + r + index_dim]: whole cache rows, indexer keys included

    def bind_cache(self, cache: torch.Tensor, block_size: int, fp8: torch.dtype | None = None) -> None:
        """``fp8``: the cache holds the latent rows in that FP8 format (see :class:`PagedAttention`)."""
        assert cache.shape == self.kv_spec.shape(cache.shape[0]), (tuple(cache.shape), self.kv_spec)
        self.block_size = block_size
        self.rows = cache[None]
        # [1, slots, R + r]: one "head", key and value alike (the indexer's keys, past it, are read apart)
        self.k_cache = self.v_cache = self.rows[..., : self.head_dim]
        self.fp8 = fp8

    def kernel_widths(self) -> tuple[int, int, bool]:
        # the absorbed form: values are each row's latent (R), keys the latent and its RoPE part (R + r)
        return self.rank, self.head_dim - self.rank, True

    def _store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.rows.index_copy_(1, slots, self._stored(k.transpose(0, 1)))  # v is k: one write of whole rows

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        logger.warning("the checkpoint's K/V cache scales (%s, %s) are not used: the latent cache has none", k_scale,
                       v_scale)

    def attend(self, q_nope: torch.Tensor, q_rot: torch.Tensor, kv: torch.Tensor, w_uk: torch.Tensor,
               w_uv: torch.Tensor, meta: AttentionMetadata,
               index: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q_nope [T, Hl, nope], q_rot [T, Hl, r] (rotated), kv [T, 1, R + r (+ index_dim)] (the latent, the rotated
        shared key, and with sparse attention the indexer's key), W_UK [Hl, nope, R], W_UV [Hl, v, R] -> each
        token's attention output [T, Hl, v]. ``index``: the indexer's queries [T, Hi, index_dim] and head weights
        [T, Hi] (float32), with which each query keeps only its ``index_topk`` best keys (:meth:`_select`), kept in
        ``meta.selected`` for the layers after it that share it; a sharing layer (no ``index``) reads them there.

        Absorbed (decode rows, short sequences): the query ``[W_UK^T q_nope ; q_rot]`` attends the latent rows as
        keys and values, and W_UV maps the result. Unabsorbed (a sequence of at least ``unabsorbed_from`` new
        tokens): its context's latent rows are expanded into each head's key ``[W_UK c ; k_rot]`` and value
        ``W_UV c``, and it attends them as ordinary multi-head attention: per head and (query, key) pair nope + r
        + v products instead of 2R + r, for R (nope + v) per context token to expand them, which pays from
        ``R (nope + v) / (2R - nope - v)`` new tokens on (171 at DeepSeek-V3's sizes)."""
        kv = self._read(self._stored(kv), kv.dtype)  # as the cache holds it (FP8: rounded), for every path below
        self._store(kv, kv, meta.slot_mapping)
        keys, kv = kv[:, 0, self.head_dim:], kv[..., : self.head_dim]  # the indexer's keys apart (none without it)
        t, hl = q_nope.shape[:2]
        wide = [seq.query_len >= self.unabsorbed_from for seq in meta.own]
        query = None
        if meta.short is not None or not all(wide):
            query = torch.cat((torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rot), dim=-1)  # [T, Hl, R + r]
        selected = None
        if index is not None:
            selected = {"short": None if meta.short is None else self._short_select(index, meta)}
            selected.update((i, self._own_select(index, keys, meta, i)) for i in range(len(meta.own)))
            meta.selected = selected
        elif self.shares_selection:
            selected = meta.selected
            assert selected is not None, "a layer sharing its keys' selection runs after one that makes it"
        short = None
        if meta.short is not None:
            short = self._short(query, meta, None if selected is None else selected["short"])
        if short is not None and meta.short.token_index is None:  # identity layout: every sequence is short
            return self._values(short, w_uv)
        out = q_nope.new_empty(t, hl, self.v_dim)
        if short is not None:
            out.index_copy_(0, meta.short.out_dst, self._values(short, w_uv).index_select(0, meta.short.out_src))
        for i, seq in enumerate(meta.own):
            rows = slice(seq.token_start, seq.token_end)
            select = None if selected is None else selected[i]
            if wide[i]:
                out[rows] = self._unabsorbed(q_nope[rows], q_rot[rows], kv, w_uk, w_uv, meta, i, select)
            else:
                out[rows] = self._values(self._own(query, kv, kv, meta, i, select), w_uv)
        return out

    # ---- DeepSeek Sparse Attention: which keys each query keeps

    def _select(self, queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                allowed: torch.Tensor) -> torch.Tensor:
        return top_index_keys(queries, weights, keys, allowed, self.index_topk)

    def _short_select(self, index: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        sb = meta.short
        queries, weights = index
        if sb.token_index is not None:
            queries, weights = queries.index_select(0, sb.token_index), weights.index_select(0, sb.token_index)
        keys = self.rows[0, :, self.head_dim:].view(-1, self.block_size, self.index_dim).index_select(
            0, sb.block_index)  # [Bs * nb, bs, Di]
        keys = self._read(keys, queries.dtype).float().reshape(sb.num_seqs, -1, self.index_dim)
        allowed = meta.short_mask(1, self.mask_kind)[:, 0]  # [Bs, Q, L]
        return self._select(queries.view(sb.num_seqs, sb.max_query_len, *queries.shape[1:]),
                            weights.view(sb.num_seqs, sb.max_query_len, -1), keys, allowed)

    def _own_select(self, index: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor, meta: AttentionMetadata,
                    i: int) -> torch.Tensor:
        """Own sequence ``i``'s [q, ctx]; ``keys``: the step's indexer keys [T, Di], as the cache holds them."""
        seq = meta.own[i]
        rows = slice(seq.token_start, seq.token_end)
        if not seq.fresh:
            context = self.rows[0, :, self.head_dim:]  # [slots, Di]
            if seq.first_slot is not None:
                keys = context[seq.first_slot: seq.first_slot + seq.context_len]
            else:
                keys = context.view(-1, self.block_size, self.index_dim).index_select(0, seq.block_index).reshape(
                    -1, self.index_dim)[: seq.context_len]
            keys = self._read(keys, index[0].dtype)
        else:
            keys = keys[rows]
        queries, weights = index
        return self._select(queries[None, rows], weights[None, rows], keys[None].float(),
                            meta.own_allowed(i, self.mask_kind)[None])[0]

    def _values(self, o: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """Absorbed outputs [N, Hl * (R + r)] -> W_UV of their latent part [N, Hl, v]."""
        o = o.view(o.shape[0], self.num_heads, self.head_dim)[..., : self.rank]
        return torch.einsum("thr,hvr->thv", o, w_uv)

    def _unabsorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor, kv: torch.Tensor, w_uk: torch.Tensor,
                    w_uv: torch.Tensor, meta: AttentionMetadata, i: int,
                    select: torch.Tensor | None = None) -> torch.Tensor:
        seq = meta.own[i]
        rows = slice(seq.token_start, seq.token_end)
        ctx = kv[rows, 0] if seq.fresh else self._read(self._context(self.k_cache, seq)[0, 0], kv.dtype)  # [ctx, R+r]
        latent, k_rot = ctx[:, : self.rank], ctx[:, self.rank:]
        hl = self.num_heads
        keys = torch.cat((torch.einsum("cr,hnr->hcn", latent, w_uk), k_rot[None].expand(hl, -1, -1)), dim=-1)
        values = torch.einsum("cr,hvr->hcv", latent, w_uv)  # [Hl, ctx, v]
        query = torch.cat((q_nope, q_rot), dim=-1).transpose(0, 1)  # [Hl, q, nope + r]
        mask = meta.own_mask(i, 1, self.mask_kind) if select is None else select  # [q, ctx] (None: causal)
        o = F.scaled_dot_product_attention(query[None], keys[None], values[None], attn_mask=mask,
                                           is_causal=mask is None and seq.fresh, scale=self.scale)
        return o[0].transpose(0, 1)  # [q, Hl, v]


def top_index_keys(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor,
                   topk: int) -> torch.Tensor:
    """queries [N, Q, Hi, Di], weights [N, Q, Hi], keys [N, L, Di] (float32), allowed [N, Q, L] -> [N, Q, L] bool:
    each query's ``topk`` allowed keys of the best index score ``sum_h w_h relu(q_h . k)`` (every allowed key when
    it has no more): DeepSeek Sparse Attention's pick (V3.2's keys, V4's compressed entries)."""
    # a few heads at a time, so that the per-head scores [N, Q, h, L] stay within INDEX_SCORE_ELEMENTS at any
    # context length (all 64 heads of a long context's batch at once would be gigabytes)
    n, q, heads, _ = queries.shape
    per_pass = max(1, INDEX_SCORE_ELEMENTS // max(1, n * q * keys.shape[1]))
    scores = 0
    for h in range(0, heads, per_pass):
        part = torch.einsum("nqhd,nld->nqhl", queries[:, :, h: h + per_pass], keys).relu_()
        scores = scores + torch.einsum("nqh,nqhl->nql", weights[:, :, h: h + per_pass], part)
    top = scores.masked_fill(~allowed, float("-inf")).topk(min(topk, scores.shape[-1]), dim=-1)
    return torch.zeros_like(allowed).scatter_(-1, top.indices, True) & allowed


def unabsorbed_threshold(rank: int, nope: int, v_dim: int) -> int:
    """The fewest new tokens of a sequence for which the unabsorbed form does fewer products: expanding its
    context costs R (nope + v) per context token and head, and saves 2R - nope - v per (query, key) pair and
    head (the latent's R + r key and R value widths against nope + r and v); never when nothing is saved."""
    saved = 2 * rank - nope - v_dim
    return -(-rank * (nope + v_dim) // saved) if saved > 0 else 1 << 62


def _yarn_softmax_scale(config) -> float:
    scale = config.qk_head_dim ** -0.5
    params = rope_parameters(config, partial=True)  # (the rotated part: qk_rope_head_dim)
    mscale_all_dim = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and mscale_all_dim:
        scale *= _yarn_mscale(params["factor"], mscale_all_dim) ** 2
    return scale


class Indexer(nn.Module):
    """DeepSeek Sparse Attention's indexer (DeepSeek-V3.2): scores every key of a query's context cheaply so that
    its layer attends only the best ``index_topk``. Per token a key ``k = LayerNorm(W_k x)`` and per query ``Hi``
    heads ``q_h = W_qb c_q`` (from MLA's query latent) of width Di, the first r features of each rotated by the
    layer's RoPE on halves (not MLA's interleaved pairs), and head weights ``w = W_w x / sqrt(Hi Di)``; the score of
    a key is ``sum_h w_h relu(q_h . k)`` (the 1/sqrt(Di) moved out of the relu, which it commutes with).
    Replicated on every tensor-parallel rank: every head of the layer reads the same selection, and it is small."""

    def __init__(self, config, interleave: bool = False, rope_last: bool = False, eps: float = 1e-6):
        super().__init__()
        one = TPGroup.single()
        self.heads, self.dim = config.index_n_heads, config.index_head_dim
        self.interleave = interleave  # its rotated features in interleaved pairs (GLM-5), else halves (V3.2)
        self.rope_last = rope_last  # the rotated features are each head's last r (Hunyuan 4), else its first
        self.wq_b = ColumnParallelLinear(config.q_lora_rank, self.heads * self.dim, one)
        self.wk = ColumnParallelLinear(config.hidden_size, self.dim, one)
        self.k_norm = nn.LayerNorm(self.dim, eps=eps)
        self.weights_proj = ColumnParallelLinear(config.hidden_size, self.heads, one)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x [T, H], q_latent [T, q_lora_rank] -> keys [T, Di], queries [T, Hi, Di] and weights [T, Hi] (float32)
        t = x.shape[0]
        queries, keys = self.wq_b(q_latent).view(t, self.heads, self.dim), self.k_norm(self.wk(x))[:, None]
        if self.interleave:  # pairs to halves, as MLA's rotation (module docstring); a dot product keeps the order
            r = 2 * cos.shape[-1]
            queries, keys = (torch.cat((v[..., 0:r:2], v[..., 1:r:2], v[..., r:]), dim=-1) for v in (queries, keys))
        if self.rope_last:
            r = 2 * cos.shape[-1]
            queries, keys = (torch.cat((v[..., :-r], apply_rotary(v[..., -r:], cos, sin)), dim=-1)
                             for v in (queries, keys))
            keys = keys[:, 0]
        else:
            queries, keys = apply_rotary(queries, cos, sin), apply_rotary(keys, cos, sin)[:, 0]
        weights = self.weights_proj(x).float() * (self.heads * self.dim) ** -0.5
        return keys, queries.float(), weights


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention, weight-absorbed (see the module docstring), over ``tp``."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__()
        self.num_heads = divide(config.num_attention_heads, tp.size, "num_attention_heads")
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        # interleaved RoPE pairs: a checkpoint's rope_interleave (V3), always for V2 (its rotation is complex)
        self.interleave = (bool(getattr(config, "rope_interleave", False))
                           or config.model_type in ("deepseek_v2", "deepseek_v32", "glm_moe_dsa"))
        one, bias, h = TPGroup.single(), bool(config.attention_bias), config.hidden_size
        heads = config.num_attention_heads
        if config.q_lora_rank is None:
            self.q_a_proj = self.q_a_layernorm = None
            self.q_proj = ColumnParallelLinear(h, heads * (self.nope + self.rope), tp)
        else:
            self.q_a_proj = ColumnParallelLinear(h, config.q_lora_rank, one, bias=bias)  # replicated
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * (self.nope + self.rope), tp)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(h, self.rank + self.rope, one, bias=bias)  # replicated
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.rank, heads * (self.nope + self.v_dim), tp)  # by head
        self.kv_b_proj.keeps_dense_weight = True  # read as W_UK and W_UV, never applied as a linear
        self.o_proj = RowParallelLinear(heads * self.v_dim, h, tp, bias=bias)
        # DeepSeek Sparse Attention (V3.2): an indexer picks each query's keys
        sparse = bool(getattr(config, "index_topk", None))
        if sparse and config.q_lora_rank is None:
            raise ValueError(f"index_topk={config.index_topk} (DeepSeek Sparse Attention) needs q_lora_rank, whose "
                             "query latent its indexer reads; the checkpoint's config.json has none")
        kinds = getattr(config, "indexer_types", None) or []  # GLM-5's: "shared" reuses the last layer's pick
        shared = sparse and layer < len(kinds) and kinds[layer] == "shared"  # (an MTP layer past them picks)
        if shared and not any(kind == "full" for kind in kinds[:layer]):
            raise ValueError(f"indexer_types[{layer}]='shared' but no layer before it has an indexer ('full') whose "
                             "pick it could share; the checkpoint's config.json is inconsistent")
        hunyuan = config.model_type == "hy_v4"  # its indexer rotates each head's last features, its norm's eps
        self.indexer = Indexer(config, config.model_type == "glm_moe_dsa", rope_last=hunyuan,
                               eps=config.rms_norm_eps if hunyuan else 1e-6) if sparse and not shared else None
        spec = MLAAttentionSpec(self.rank, self.rope, 0 if self.indexer is None else self.indexer.dim)
        self.attn = LatentAttention(self.num_heads, spec, _yarn_softmax_scale(config), self.nope, self.v_dim,
                                    config.index_topk if sparse else 0, shared)
        self.query_scaling = position_query_scaling(config)  # Mistral 4's queries scaled by position

    def _deinterleave(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if self.interleave else x

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, 1, r/2] -> [T, H]
        return self.o_proj(self.head_outputs(x, cos, sin, meta).reshape(x.shape[0], -1))

    def head_outputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
                     ) -> torch.Tensor:
        """Each of this rank's heads' attention output [T, Hl, v], before ``o_proj``."""
        t, hl = x.shape[0], self.num_heads
        q_latent = None if self.q_a_proj is None else self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_proj(x) if q_latent is None else self.q_b_proj(q_latent)
        if self.query_scaling is not None:
            q = scale_queries(q, meta.positions, self.query_scaling)
        return self.attend_queries(x, q.view(t, hl, self.nope + self.rope), q_latent, cos, sin, meta)

    def attend_queries(self, x: torch.Tensor, q: torch.Tensor, q_latent: torch.Tensor | None, cos: torch.Tensor,
                       sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The heads' outputs [T, Hl, v] for their queries ``q`` [T, Hl, nope + rope] (a family builds them its
        way): the rows' latent and RoPE key (:meth:`rope_key` on the checkpoint's order), the indexer's pick from
        ``q_latent``, the latent attention."""
        hl = self.num_heads
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, R]
        k_rot = self.rope_key(k_rot)
        rot = apply_rotary(torch.cat((self._deinterleave(q_rot), self._deinterleave(k_rot)[:, None]), dim=1), cos, sin)
        w_kv = self.kv_b_proj.weight.view(hl, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w_kv[:, : self.nope], w_kv[:, self.nope:]  # [Hl, nope, R], [Hl, v, R]
        kv, index = torch.cat((latent, rot[:, hl]), dim=-1), None  # [T, R + r]
        if self.indexer is not None:
            keys, queries, weights = self.indexer(x, q_latent, cos, sin)
            kv, index = torch.cat((kv, keys), dim=-1), (queries, weights)  # [T, R + r + Di]
        return self.attn.attend(q_nope, rot[:, :hl], kv[:, None], w_uk, w_uv, meta, index)  # [T, Hl, v]

    def rope_key(self, k_rot: torch.Tensor) -> torch.Tensor:
        """The shared RoPE key [T, r] before it is rotated (a family that norms it: Dots3-Note)."""
        return k_rot


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        nn.Module.__init__(self)
        self.self_attn = MLAttention(config, tp, layer)
        kinds = getattr(config, "mlp_layer_types", None)  # V3.2's config names each layer's kind
        if kinds:
            dense = kinds[layer] == "dense"
        else:  # MiniCPM3 has no experts at all
            dense = not hasattr(config, "n_routed_experts") or layer < (config.first_k_dense_replace or 0)
        self.mlp = LlamaMLP(config, tp) if dense else SparseMoE(config, tp, expert_parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = multiplier(config, "residual_multiplier")  # MiniCPM3's scale_depth


class DeepseekV3Model(LlamaModel):
    layer_class = DeepseekV3DecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)
        self.build_stage(config, pp, lambda i: self.layer_class(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.embedding_multiplier = multiplier(config, "embedding_multiplier")  # MiniCPM3's scale_emb
        self.rotary_emb = RotaryEmbedding(config.qk_rope_head_dim, rope_parameters(config, partial=True),
                                          config.max_position_embeddings)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V3 / R1 for causal LM, sharded over ``tp`` (see the module docstring)."""

    # LoRA on every projection applied as a linear (kv_b_proj's weight is read as W_UK and W_UV, never applied: an
    # adapter of it is refused by name)
    lora_modules: tuple[str, ...] = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj",
                                     "up_proj", "down_proj")
    model_class = DeepseekV3Model
    stacked = {".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}  # q/k/v are not merged

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False) -> tuple[nn.Module, nn.Module]:
        """An MTP module's block (``model.layers.{num_hidden_layers + k}``): a layer past the dense ones, so latent
        attention and the experts, split over ``tp`` as the target's layers are (``expert_parallel``: whole experts
        per rank) (:class:`~specray.models.draft_head.DraftHead` builds the rest)."""
        return MLAttention(config, tp, config.num_hidden_layers), SparseMoE(config, tp, expert_parallel)
