"""MiniMax-M3's text model (``MiniMaxM3VLForCausalLM``, model_type ``minimax_m3_vl_text``; the text part of the
multimodal ``MiniMaxM3VLForConditionalGeneration`` / transformers' ``MiniMaxM3SparseForConditionalGeneration``, whose
vision tower and projector are not read), on MiniMax-M2's plumbing (:mod:`specray.models.minimax_m2`, itself on the
Llama family's: paged KV per layer, pipeline stages, weight loading).

Where it differs from MiniMax-M2:

* every RMSNorm (the layers', the final one, the q/k norms, the indexer's) scales by ``1 + weight`` in float32
  (Gemma 3's); the queries and keys are normed over each head (``head_dim``), not over all heads at once, so
  tensor parallelism needs no all-reduce there;
* partial RoPE as transformers' ``MiniMaxM3VL`` reads it: ``rope_parameters['partial_rotary_factor']`` of each
  head; M2's legacy ``rotary_dim`` field is not read by transformers here, so a config whose ``rotary_dim``
  disagrees with it is refused rather than guessed;
* each layer's MLP by ``mlp_layer_types``: "dense", a fused ``gate_up_proj`` MLP of ``dense_intermediate_size``, or
  "sparse", experts (:mod:`specray.models.moe`'s ``minimax_m3_vl_text`` row: M2's sigmoid routing, the top k of
  score + correction bias, renormalised, times ``routed_scaling_factor``; DeepSeek-V4's fused experts) beside a
  shared MLP of ``shared_intermediate_size`` (Laguna's block). Every one of them, dense, shared or routed, is GPT-OSS's
  clamped SwiGLU ("swigluoai": gate clamped above and up both sides at ``swiglu_limit``, ``(up + 1) * gate *
  sigmoid(swiglu_alpha * gate)``) over gate and up halves, not interleaved;
* layers whose ``layer_types`` entry is ``"minimax_m3_sparse"`` attend block-sparsely: a lightning indexer
  (:class:`LightningIndexer`: ``index_n_heads`` query heads and one key head of ``index_head_dim``, per-head norms,
  RoPE) scores each query against every key of its context (a plain dot product in float32), max-pools the scores
  over blocks of ``index_block_size`` key positions, boosts the ``index_local_blocks`` blocks ending at the query's
  own, and keeps the ``index_topk_blocks`` best blocks; each indexer head's pick is what its group of query heads
  attends (:class:`BlockSparseAttention`). The indexer's key per token is cached beside the layer's K/V
  (:class:`IndexKeySpec`), so prefix caching, tree moves and chunked prefill carry it. The pick is computed densely
  (every query scores its whole context): the outputs are the model's, not the speed of MiniMax's sparse kernel;
* the release names the sparse block ``block_sparse_moe`` as M2's does (experts' ``w1``, ``w3``, ``w2``, the
  correction bias on the block), and the indexer's tensors ``self_attn.index_{q,k}_{proj,norm}``; transformers' own
  save fuses the dense and shared MLPs' ``gate_up_proj`` and the experts (``experts.gate_up_proj``, ``down_proj``).

Not supported: the release's multi-token-prediction module (``mtp.*``, never read; the ``mtp`` drafter refuses this
family); LoRA adapters on the MLPs (the attention's projections take them, as M2's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention, own_key_positions
from specray.models.classic import llama_view
from specray.models.kv_cache import KVCache, KVCacheSpec
from specray.models.layers import ColumnParallelLinear, RMSNorm, rope_parameters
from specray.models.llama import _CHECKPOINT_NAMES, LlamaAttention, LlamaDecoderLayer, _head_dim
from specray.models.minimax_m2 import MiniMaxM2DecoderLayer, MiniMaxM2ForCausalLM, MiniMaxM2Model
from specray.models.moe import FAMILIES, GatedMLP, MoEFamily, SWIGLU_ALPHA, SparseMoE
from specray.parallel import TPGroup

MODEL_TYPE = "minimax_m3_vl_text"
SPARSE = "minimax_m3_sparse"  # a layer_types entry: block-sparse attention picked by the indexer
# the indexer's scores and the attention's per-head masks: at most this many elements at once (a long context's
# queries in slices, a batch's indexer heads a few per pass)
INDEX_SCORE_ELEMENTS = 1 << 26

# MiniMax-M2's sigmoid routing, scaled, beside a shared MLP; clamped SwiGLU experts (their halves not interleaved)
FAMILIES[MODEL_TYPE] = MoEFamily("scored", "num_local_experts", "intermediate_size", normalized=True,
                                 scoring="sigmoid", scaling="routed_scaling_factor", shared="shared_experts",
                                 shared_width="shared_intermediate_size", shared_count=None, clamped=True)
# the release's names: M2's (Mixtral's block and experts, the correction bias on the block), the indexer's beside the
# attention's; our indexer's linears are wq / wk (the Llama loader merges any ``.q_proj.`` / ``.k_proj.`` into qkv)
_CHECKPOINT_NAMES[MODEL_TYPE] = _CHECKPOINT_NAMES["minimax_m2"] + tuple(
    (re.compile(pattern), ours) for pattern, ours in (
        (r"\.self_attn\.(?:index_q_proj|indexer\.q_proj)\.", ".self_attn.indexer.wq."),
        (r"\.self_attn\.(?:index_k_proj|indexer\.k_proj)\.", ".self_attn.indexer.wk."),
        (r"\.self_attn\.index_q_norm\.", ".self_attn.indexer.q_norm."),
        (r"\.self_attn\.index_k_norm\.", ".self_attn.indexer.k_norm.")))


class UnitOffsetRMSNorm(RMSNorm):
    """Gemma 3's RMSNorm: ``x / rms(x) * (1 + weight)`` in float32, cast back to x's dtype; with ``residual``, as
    :class:`~specray.models.layers.RMSNorm` (adds it first)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., D]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """transformers' MiniMax-M3 MLPs' activation: gate clamped above and up both sides at ``limit``,
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


class SwigluOaiMLP(GatedMLP):
    """A gate/up MLP of width ``intermediate_size`` split over ``tp`` with :func:`swiglu_oai`: a dense layer's MLP
    (``forward``) or the experts' shared MLP (``partial``, this rank's share before the block's one all-reduce)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup, limit: float, alpha: float):
        super().__init__(hidden_size, intermediate_size, tp)
        self.swiglu = (limit, alpha)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return swiglu_oai(gate, up, *self.swiglu)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.partial(self._hidden(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        return self.down_proj(self._hidden(x))


def _swiglu(config) -> tuple[float, float]:
    return float(config.swiglu_limit), float(getattr(config, "swiglu_alpha", None) or SWIGLU_ALPHA)


class MiniMaxM3SparseMoE(SparseMoE):
    """The experts (the ``minimax_m3_vl_text`` row) beside a shared MLP with the experts' clamped SwiGLU."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False):
        super().__init__(config, tp, expert_parallel)
        self.shared_experts = SwigluOaiMLP(config.hidden_size, config.shared_intermediate_size, tp, *_swiglu(config))


# ---------------------------------------------------------------------------------------------- sparse attention


@dataclass(frozen=True)
class IndexKeySpec(KVCacheSpec):
    """A sparse layer's indexer key per slot, ``[slots, index_head_dim]``, the same on every TP rank (every rank's
    heads read the whole pick). It moves with the slots as the layer's K/V does (tree moves, prefix caching)."""

    index_head_dim: int

    @property
    def slot_shape(self) -> tuple[int, ...]:
        return (1, self.index_head_dim)

    @property
    def slot_dim(self) -> int:
        return 0


def _rotate_as_transformers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` with its cos/sin cut to x's width (the indexer's): x [T, h, Di];
    cos, sin [T, 1, R/2] (ours: half the rotated width R) -> the first min(R, Di) features rotated by halves of
    that width against cat(cos, cos)[:min(R, Di)], the rest as they are."""
    width = min(2 * cos.shape[-1], x.shape[-1])
    cos, sin = torch.cat((cos, cos), dim=-1)[..., :width], torch.cat((sin, sin), dim=-1)[..., :width]
    rot, rest = x[..., :width], x[..., width:]
    half = width // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


class LightningIndexer(nn.Module):
    """MiniMax-M3's lightning indexer, replicated on every rank: per token ``index_n_heads`` queries and one key of
    ``index_head_dim``, each RMS-normed (1 + w) and rotated by the layer's RoPE (cut to its width)."""

    def __init__(self, config):
        super().__init__()
        one = TPGroup.single()
        self.heads, self.dim = config.index_n_heads, config.index_head_dim
        self.wq = ColumnParallelLinear(config.hidden_size, self.heads * self.dim, one)
        self.wk = ColumnParallelLinear(config.hidden_size, self.dim, one)
        self.q_norm = UnitOffsetRMSNorm(self.dim, config.rms_norm_eps)
        self.k_norm = UnitOffsetRMSNorm(self.dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x [T, H] -> keys [T, Di], queries [T, Hi, Di] (x's dtype)
        t = x.shape[0]
        queries = self.q_norm(self.wq(x).view(t, self.heads, self.dim))
        keys = self.k_norm(self.wk(x).view(t, 1, self.dim))
        return _rotate_as_transformers(keys, cos, sin)[:, 0], _rotate_as_transformers(queries, cos, sin)


class BlockSparseAttention(PagedAttention):
    """Paged attention whose query heads attend only the key blocks their indexer head picked (the module
    docstring), on both of :class:`PagedAttention`'s paths: the padded short batch and one sequence at a time (a
    long one in slices of queries). Blocks are of key *positions* (a token tree's nodes sit at their depth), the
    scores of keys a query may not see never count, and the pick syncs nothing with the host."""

    def __init__(self, num_heads: int, kv_spec, scale: float, config, tp: TPGroup):
        super().__init__(num_heads, kv_spec, scale)
        self.index_heads, self.index_dim = config.index_n_heads, config.index_head_dim
        self.index_block, self.topk_blocks = config.index_block_size, config.index_topk_blocks
        self.local_blocks = config.index_local_blocks
        per_index_head = config.num_attention_heads // self.index_heads
        first = tp.rank * num_heads  # this rank's query heads are a contiguous run of them
        # each local query head's indexer head (transformers repeats each pick over its run of query heads)
        self.register_buffer("head_map", torch.arange(first, first + num_heads) // per_index_head, persistent=False)
        self.index_cache = torch.empty(0)  # [slots, Di]: bind_index_cache

    def bind_index_cache(self, cache: torch.Tensor) -> None:
        """The indexer's keys ``cache`` [slots, Di] (an :class:`IndexKeySpec`'s view; FP8 bytes with an FP8 cache,
        as the K/V beside it, bound first)."""
        self.index_cache = cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                index: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]; index: the indexer's keys [T, Di] and queries [T, Hi, Di] -> [T, Hq*D]
        assert index is not None, "a sparse layer attends the blocks its indexer picks"
        keys, queries = index
        self._store(k, v, meta.slot_mapping)
        stored = self._stored(keys)
        self.index_cache.index_copy_(0, meta.slot_mapping, stored)
        keys = self._read(stored, keys.dtype)  # as the cache holds them (FP8: rounded), for a fresh sequence
        return self._by_path(q, meta, lambda: self._short_sparse(q, queries, meta),
                             lambda i: self._own_sparse(q, k, v, keys, queries, meta, i))

    def pick(self, queries: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, q_pos: torch.Tensor,
             k_pos: torch.Tensor) -> torch.Tensor:
        """queries [N, Q, Hi, Di], keys [N, L, Di], allowed [N, Q, L] bool, q_pos [N, Q], k_pos [N, L] -> [N, Hl,
        Q, L] bool: the keys each local query head attends, those of its indexer head's picked blocks it may see."""
        n, q, heads, _ = queries.shape
        length = keys.shape[1]
        blocks = -(-length // self.index_block)  # every key position is below L, so its block below this
        key_block = (k_pos // self.index_block)[:, None, None, :]  # [N, 1, 1, L]
        local = (q_pos // self.index_block)[..., None] - torch.arange(self.local_blocks, device=q_pos.device)
        local = local.clamp(min=0)[:, None]  # [N, 1, Q, local]: the blocks ending at each query's own
        keys = keys.float()
        per_pass = max(1, INDEX_SCORE_ELEMENTS // max(1, n * q * length))
        chosen = []
        for h in range(0, heads, per_pass):
            part = queries[:, :, h: h + per_pass].float()
            scores = torch.einsum("nqhd,nld->nhql", part, keys).masked_fill(~allowed[:, None], float("-inf"))
            shape = (n, part.shape[2], q, blocks)
            best = scores.new_full(shape, float("-inf")).scatter_reduce_(
                -1, key_block.expand(scores.shape), scores, "amax")  # [N, h, Q, blocks]
            best.scatter_(-1, local.expand(n, part.shape[2], q, self.local_blocks), float("inf"))
            top = best.topk(min(self.topk_blocks, blocks), dim=-1)
            picked = torch.zeros(shape, dtype=torch.bool, device=best.device).scatter_(
                -1, top.indices, top.values > float("-inf"))  # a block of no visible key is never kept
            chosen.append(picked.gather(-1, key_block.expand(n, part.shape[2], q, length)))
        per_index_head = chosen[0] if len(chosen) == 1 else torch.cat(chosen, dim=1)  # [N, Hi, Q, L]
        return per_index_head.index_select(1, self.head_map) & allowed[:, None]

    def _short_sparse(self, q: torch.Tensor, queries: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [T, Hq, D], queries: [T, Hi, Di] -> [Bs*Q, Hq*D] (padded rows included), as PagedAttention._short
        sb = meta.short
        bs, q_len = sb.num_seqs, sb.max_query_len
        if sb.token_index is not None:
            q, queries = q.index_select(0, sb.token_index), queries.index_select(0, sb.token_index)
        keys = self.index_cache.view(-1, self.block_size, self.index_dim).index_select(0, sb.block_index)
        keys = self._read(keys, queries.dtype).reshape(bs, -1, self.index_dim)  # [Bs, L, Di]
        allowed = meta.short_mask(1, self.mask_kind)[:, 0]  # [Bs, Q, L]
        mask = self.pick(queries.view(bs, q_len, *queries.shape[1:]), keys, allowed, sb.query_positions,
                         meta.short_key_positions())  # [Bs, Hq, Q, L]
        mask = mask.reshape(bs, self.num_kv_heads, self.groups * q_len, -1)  # folded rows: head h*G + g, query j
        k = self._read(self._gather(self.k_cache, sb.block_index, bs), q.dtype, self.k_scale)  # [Bs, Hkv, L, D]
        v = self._read(self._gather(self.v_cache, sb.block_index, bs), q.dtype, self.v_scale)
        return self._unfold(self._attend(self._fold(q, bs, q_len), k, v, mask), bs, q_len)

    def _own_sparse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
                    queries: torch.Tensor, meta: AttentionMetadata, i: int) -> torch.Tensor:
        # own sequence i's rows -> [q_len, Hq*D], its queries in slices whose masks stay within INDEX_SCORE_ELEMENTS
        seq = meta.own[i]
        rows = slice(seq.token_start, seq.token_end)
        if seq.fresh:  # its own new tokens' K/V and index keys (as the cache holds them)
            ks, vs = (self._read(self._stored(x[rows], s), q.dtype, s).transpose(0, 1)[None]
                      for x, s in ((k, self.k_scale), (v, self.v_scale)))  # [1, Hkv, q, D]
            index_keys = keys[rows]
        else:
            ks = self._read(self._context(self.k_cache, seq), q.dtype, self.k_scale)  # [1, Hkv, ctx, D]
            vs = self._read(self._context(self.v_cache, seq), q.dtype, self.v_scale)
            index_keys = self._read(self._index_context(seq), queries.dtype)
        allowed = meta.own_allowed(i, self.mask_kind)  # [q, ctx]
        k_pos = own_key_positions(meta, i)  # [ctx]
        q_pos = k_pos[seq.start_pos:]
        length, q_len = k_pos.shape[0], seq.query_len
        step = max(1, INDEX_SCORE_ELEMENTS // max(1, length * max(self.num_heads, self.index_heads)))
        out = []
        for r in range(0, q_len, step):
            part = slice(r, min(r + step, q_len))
            n = part.stop - part.start
            mask = self.pick(queries[rows][None, part], index_keys[None], allowed[None, part], q_pos[None, part],
                             k_pos[None])  # [1, Hq, n, ctx]
            if seq.fresh:
                o = self._attend(q[rows][part].transpose(0, 1)[None], ks, vs, mask)  # [1, Hq, n, D]
                out.append(o[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim))
            else:
                mask = mask.reshape(1, self.num_kv_heads, self.groups * n, length)
                out.append(self._unfold(self._attend(self._fold(q[rows][part], 1, n), ks, vs, mask), 1, n))
        return out[0] if len(out) == 1 else torch.cat(out)

    def _index_context(self, seq) -> torch.Tensor:
        # -> [ctx, Di]: a view of the index cache when the sequence's blocks are consecutive, else gathered
        if seq.first_slot is not None:
            return self.index_cache[seq.first_slot: seq.first_slot + seq.context_len]
        blocks = self.index_cache.view(-1, self.block_size, self.index_dim).index_select(0, seq.block_index)
        return blocks.reshape(-1, self.index_dim)[: seq.context_len]


class MiniMaxM3Attention(LlamaAttention):
    """Llama's attention with each query and key head RMS-normed (1 + w) before partial RoPE; on a sparse layer
    (``layer_types``) its heads attend the key blocks its indexer picks."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        self.q_norm = UnitOffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = UnitOffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.indexer = None
        if config.layer_types[layer] == SPARSE:
            self.indexer = LightningIndexer(config)
            self.attn = BlockSparseAttention(self.num_heads, self.attn.kv_spec, self.attn.scale, config, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, 1, R/2] -> [T, H]
        q, k, v = self.project(x, cos, sin, meta)
        if self.indexer is None:
            return self.o_proj(self.attn(q, k, v, meta))
        return self.o_proj(self.attn(q, k, v, meta, self.indexer(x, cos, sin)))


class MiniMaxM3DecoderLayer(MiniMaxM2DecoderLayer):
    """Mixtral's pre-norm layer (norms of 1 + w) with MiniMax-M3's attention and its layer's MLP, dense or sparse."""

    attention_class = MiniMaxM3Attention

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        LlamaDecoderLayer.__init__(self, config, tp, layer, expert_parallel)

    @staticmethod
    def build_norm(config) -> nn.Module:
        return UnitOffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    @classmethod
    def build_mlp(cls, config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        if config.mlp_layer_types[layer] == "sparse":
            return MiniMaxM3SparseMoE(config, tp, expert_parallel)
        return SwigluOaiMLP(config.hidden_size, config.dense_intermediate_size, tp, *_swiglu(config))


class MiniMaxM3Model(MiniMaxM2Model):
    layer_class = MiniMaxM3DecoderLayer


def _checked(config):
    """``config`` as the layers read it, with what transformers' MiniMax-M3 ignores set as it computes (a ValueError
    for what we would have to guess)."""
    layers = config.num_hidden_layers
    for field, allowed in (("layer_types", ("full_attention", SPARSE)), ("mlp_layer_types", ("dense", "sparse"))):
        kinds = list(getattr(config, field, None) or [])
        if len(kinds) != layers or any(kind not in allowed for kind in kinds):
            raise ValueError(f"{field}={kinds!r} is not supported for model_type={MODEL_TYPE!r}: give one entry per "
                             f"layer (num_hidden_layers={layers}), each one of {list(allowed)}")
    head_dim = _head_dim(config)
    rotated = int(head_dim * rope_parameters(config, partial=True)["partial_rotary_factor"])
    given = getattr(config, "rotary_dim", None)
    if given is not None and int(given) != rotated:
        raise ValueError(f"rotary_dim={given} but rope_parameters' partial_rotary_factor rotates {rotated} of "
                         f"head_dim={head_dim} features (transformers' MiniMax-M3 reads only the latter): set "
                         f"rope_parameters.partial_rotary_factor to {int(given) / head_dim} (hf_overrides) to rotate "
                         f"rotary_dim features, or rotary_dim to {rotated}")
    if SPARSE in config.layer_types:
        heads, index_heads = config.num_attention_heads, config.index_n_heads
        if index_heads < 1 or heads % index_heads:
            raise ValueError(f"index_n_heads={index_heads} must divide num_attention_heads={heads}: each indexer "
                             "head picks the key blocks of a run of query heads (the release has one per KV head)")
        if (not 0 <= config.index_local_blocks <= config.index_topk_blocks or config.index_topk_blocks < 1
                or config.index_block_size < 1):
            raise ValueError(f"index_local_blocks={config.index_local_blocks}, index_topk_blocks="
                             f"{config.index_topk_blocks}, index_block_size={config.index_block_size}: the always "
                             "kept local blocks must fit in the picked ones and a block hold a key; use the "
                             "release's values")
    scoring = getattr(config, "scoring_func", None)
    if scoring not in (None, "sigmoid"):
        raise ValueError(f"scoring_func={scoring!r} is not supported for model_type={MODEL_TYPE!r}: transformers' "
                         "MiniMax-M3 scores its experts by sigmoid always; use 'sigmoid'")
    # transformers' router renormalises the chosen scores whatever norm_topk_prob says, and its attention has no
    # biases whatever attention_bias says
    return llama_view(config, norm_topk_prob=True, attention_bias=False)


class MiniMaxM3ForCausalLM(MiniMaxM2ForCausalLM):
    """MiniMax-M3's text model for causal LM, sharded over ``tp`` (heads; the indexers replicated; experts by width,
    or whole with ``expert_parallel``) and ``pp``."""

    model_class = MiniMaxM3Model
    skipped = ("mtp.", "model.mtp.")  # the release's MTP module (transformers ignores it too)

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False, pp=None):
        super().__init__(_checked(hf_config), tp, expert_parallel, pp)
        dense, shared = hf_config.dense_intermediate_size, hf_config.shared_intermediate_size
        # transformers' own save fuses the dense and shared MLPs' gate and up rows (the release keeps them apart)
        self.fused = {".mlp.shared_experts.gate_up_proj.": ((".mlp.shared_experts.gate_proj.", shared),
                                                            (".mlp.shared_experts.up_proj.", shared)),
                      ".mlp.gate_up_proj.": ((".mlp.gate_proj.", dense), (".mlp.up_proj.", dense))}

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False) -> tuple[nn.Module, nn.Module]:
        raise ValueError("MiniMax-M3's multi-token-prediction module is not supported (its layout is not read); "
                         "use a drafter that needs no MTP weights, e.g. speculative_config={'method': 'ngram'}")

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Each layer's K/V spec in layer order, a sparse layer's indexer keys after its own."""
        specs: list[KVCacheSpec] = []
        for _, layer in self.model.stage_layers():
            specs.append(layer.self_attn.attn.kv_spec)
            if layer.self_attn.indexer is not None:
                specs.append(IndexKeySpec(layer.self_attn.indexer.dim))
        return specs

    def bind_kv_cache(self, cache: KVCache) -> None:
        assert cache.specs == self.kv_cache_specs(), "the cache was allocated for another model's specs"
        j = 0
        for _, layer in self.model.stage_layers():
            attn = layer.self_attn.attn
            attn.bind_cache(cache.layer(j), cache.block_size, cache.fp8)
            j += 1
            if layer.self_attn.indexer is not None:
                attn.bind_index_cache(cache.layer(j))
                j += 1
        self.kv_cache_allocated = True
