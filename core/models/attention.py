"""Paged attention over a mixed batch (prefill chunks, decode tokens, last token + drafts) in one call.

The batch is the concatenation of B sequences. Sequence i brings ``query_lens[i]`` new tokens; its first
``start_positions[i]`` tokens are already in the paged KV cache, and its new tokens take the next slot indices
``start_positions[i] ..``. Slot index p of sequence i is slot ``block_tables[i][p // block_size] * block_size +
p % block_size``. Each new token also has a RoPE position, by default its slot index; a caller may give others
(a token tree: siblings share a depth). Cached keys sit at the position equal to their slot index (a step's kept
tokens are a chain, moved to consecutive slots when they were not).

Masks compare positions, never slots: a query sees a key when its layer's :class:`MaskKind` allows the pair of
positions (causal, plus a sliding window or a chunk). A sequence may also bring an ancestor mask ``[q, q]``
among its new tokens, which replaces the causal comparison there (every cached key stays visible). The masks
are built once per step, by one builder, for both paths below.

The cache of one layer is ``[Hkv, num_blocks * block_size, D]`` (k and v, views of the runner's
:class:`~specray.models.kv_cache.KVCache`): slot ``s`` of every KV head is row ``s`` of that head's matrix, so
the context of a sequence whose blocks are consecutive is one view of the cache.

Two paths, both planned once per step in :func:`build_attention_metadata` (all index tensors are built there from
Python lists, so a forward has no host syncs):

* short queries (at most ``SHORT_QUERY_MAX`` new tokens: decode, last token + drafts, small prefills) run as one
  padded batched SDPA. Each sequence's context is gathered from the cache by whole blocks; the query's GQA group
  is folded into the query length (``[Bs, Hkv, G*Q, D]``) so the keys are never repeated. On a GPU one Triton
  kernel reads the contexts in place instead, with the same folding and masks (:mod:`specray.models.triton_attention`);
* sequences attended on their own, one SDPA each: long prefill chunks, and the short queries too where
  :func:`specray.models.cpu_kernels.reads_in_place` says gathering costs more than attending (long contexts on
  CPU). A fresh prefill attends to its own new k/v (``is_causal`` when it can); a sequence with context reads it
  in place when its blocks are consecutive (the block manager keeps them so where it can), else gathers its
  blocks, and folds its GQA group like the short path.

A layer with an attention logit soft cap (Gemma 2's ``attn_logit_softcapping``) or attention sinks (GPT-OSS's: one
learned logit per head that joins each row's softmax and whose probability is dropped) takes the same paths, masks
and GQA folding, but SDPA has no hook on the scores, so it attends explicitly (:func:`explicit_attention`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specray.models import cpu_kernels, triton_attention
from specray.models.kv_cache import FullAttentionSpec, MaskKind, slots_of

SHORT_QUERY_MAX = 16  # sequences with at most this many new tokens take the padded batched path


@dataclass
class ShortBatch:
    """The padded batch of short-query sequences."""

    seq_ids: list[int]  # indices into the step's sequences
    max_query_len: int  # Q (padded query length)
    num_ctx_blocks: int  # blocks gathered per sequence; padded context length L = num_ctx_blocks * block_size
    block_index: torch.Tensor  # [Bs * num_ctx_blocks] block ids (padding: block 0, masked out)
    query_positions: torch.Tensor  # [Bs, Q] RoPE position of every padded query row (pads repeat the last one)
    token_index: torch.Tensor | None  # [Bs * Q] row of the step for each padded query row; None: identity
    out_src: torch.Tensor | None  # [n] real rows of the padded output
    out_dst: torch.Tensor | None  # [n] their rows in the step

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)


@dataclass
class OwnSeq:
    """One sequence attended on its own."""

    seq_id: int  # index into the step's sequences
    token_start: int
    token_end: int
    start_pos: int  # slot index of its first new token (= its cached tokens)
    context_len: int
    first_slot: int | None  # its blocks are consecutive: the slot of slot index 0 (its context is one view)
    block_index: torch.Tensor | None  # [nb] else the blocks of its context; both None for a fresh prefill

    @property
    def fresh(self) -> bool:
        return self.start_pos == 0

    @property
    def query_len(self) -> int:
        return self.token_end - self.token_start


@dataclass
class AttentionMetadata:
    """Built once per forward, shared by every layer."""

    positions: torch.Tensor  # [T] int64 RoPE positions
    slot_mapping: torch.Tensor  # [T] int64
    query_lens: list[int]
    start_positions: list[int]
    context_lens: list[int]
    block_size: int
    max_position: int  # largest position in the step (a Python int: no sync to size RoPE tables)
    short: ShortBatch | None
    own: list[OwnSeq]
    # per sequence, its new tokens' positions when some differ from their slot indices (else None)
    seq_positions: list[list[int]] | None = None
    # per sequence, None or [q, q] bool: new token r may attend new token c (replaces causal among new tokens)
    ancestors: list[torch.Tensor | None] | None = None
    # linear-attention layers: each sequence's recurrent-state slot and replay (specray.models.gated_deltanet
    # .RecurrentBatch), set by the runner for a model with such layers; None otherwise
    recurrent: object | None = None
    # sparse attention (DeepSeek-V3.2, GLM-5): the keys each query kept in the step's last layer that picked them
    # ({"short": [Bs, Q, L] or None, own sequence i: [q, ctx]}), for the layers that reuse a pick (GLM-5's "shared")
    selected: dict | None = None
    # image embeddings (specray.multimodal): (rows [n] int64, values [n, H]) that replace those rows of the step's
    # token embeddings (the text model's embedding step applies them: ``with_input_embeds``); None without
    input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # DeepStack (Qwen3-VL): those rows' own features [k, n, H] that the first k layers add to their outputs; None
    # without
    deepstack_embeds: torch.Tensor | None = None
    # multimodal RoPE (Qwen2-VL): [3, T] int64 position ids per axis (temporal, height, width), set by the runner for a
    # step holding a request with images; None: every axis takes ``positions``
    rope_positions: torch.Tensor | None = None
    _masks: dict = field(default_factory=dict, repr=False)  # key -> a per-step tensor every layer shares
    _builders: dict = field(default_factory=dict, repr=False)  # key -> how it is built from a step's metadata

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def plain(self, i: int) -> bool:
        """Sequence ``i``'s new tokens sit at positions equal to their slot indices, in causal order."""
        return self.seq_positions is None and (self.ancestors is None or self.ancestors[i] is None)

    def with_rope_positions(self, rope: tuple[torch.Tensor, int] | None) -> None:
        """Multimodal RoPE's position ids [3, T] of the step's tokens and the largest (None: each token's position
        is its one id)."""
        if rope is not None:
            self.rope_positions, self.max_position = rope[0], max(self.max_position, rope[1])

    def with_input_embeds(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """The step's token embeddings ``x`` [T, H] with the image embeddings' rows in place (``input_embeds``),
        times ``scale`` (a text model that scales its whole input embeddings, as transformers' Granite does)."""
        if self.input_embeds is None:
            return x
        rows, values = self.input_embeds
        values = values.to(x.dtype)
        return x.index_copy(0, rows, values if scale == 1.0 else values * scale)

    def cached(self, key: tuple, build: Callable[[AttentionMetadata], torch.Tensor]) -> torch.Tensor:
        """The step's tensor ``key`` (a mask, a position bias), built once by ``build(self)`` and shared by every
        layer; a graph's static metadata refreshes each of its tensors from a later step's metadata by the same
        ``build`` (:class:`~specray.models.step_graphs.StepGraphs`)."""
        if key not in self._masks:
            self._masks[key] = build(self)
            self._builders[key] = build
        return self._masks[key]

    def short_mask(self, groups: int, kind: MaskKind) -> torch.Tensor:
        """[Bs, 1, G*Q, L] bool, True where a folded query row may attend a context slot (cached per step)."""
        return self.cached(("short", groups, kind), lambda meta: _fold_rows(meta.short_rows_mask(kind), groups))

    def short_rows_mask(self, kind: MaskKind) -> torch.Tensor:
        """[Bs, Q, L] bool, True where a query may attend a context slot, before GQA folding (cached per step)."""
        return self.cached(("short-rows", kind), lambda meta: _short_mask(meta, kind))

    def short_key_positions(self) -> torch.Tensor:
        """[Bs, L]: :func:`short_key_positions`, cached per step."""
        return self.cached(("short-keys",), short_key_positions)

    def own_allowed(self, i: int, kind: MaskKind, rows: slice = slice(None)) -> torch.Tensor:
        """[q, ctx] bool of own sequence ``i``: which of its context's keys each of its queries (those of ``rows``)
        may attend (never None, unlike :meth:`own_mask`)."""
        return _own_mask(self, i, kind, rows)

    def own_mask(self, i: int, groups: int, kind: MaskKind) -> torch.Tensor | None:
        """Mask of own sequence ``i``: for a fresh prefill [q, q] (None: plain ``is_causal``), else [G*q, ctx]
        over its GQA-folded query rows (None: every row sees the whole context)."""
        seq = self.own[i]
        if kind.plain and self.plain(seq.seq_id) and (seq.fresh or seq.query_len == 1):
            return None
        return self.cached(("own", i, groups, kind), lambda meta: _own_mask(meta, i, kind) if seq.fresh
                           else _own_mask(meta, i, kind).repeat(groups, 1))  # [q, ctx] or [G*q, ctx]


# ---------------------------------------------------------------------------------------------- masks
#
# One builder for both paths: per sequence, the query rows' positions [.., Q] and the keys' positions [.., L]
# (cached keys: their slot index; new keys: their positions), then MaskKind.allows, with the sequence's ancestor
# mask replacing the causal comparison among its new tokens.


def _short_mask(meta: AttentionMetadata, kind: MaskKind) -> torch.Tensor:
    # -> [Bs, Q, L]
    short = meta.short
    q_pos = short.query_positions[:, :, None]  # [Bs, Q, 1]
    length = short.num_ctx_blocks * meta.block_size
    k_idx = torch.arange(length, device=q_pos.device)  # [L]
    if all(meta.plain(i) for i in short.seq_ids):  # padded context lies past every query position
        return kind.allows(q_pos, k_idx)
    starts = [meta.start_positions[i] for i in short.seq_ids]
    k_pos = short_key_positions(meta)[:, None, :]  # [Bs, 1, L]
    causal = k_pos <= q_pos  # [Bs, Q, L]
    for b, i in enumerate(short.seq_ids):
        anc = None if meta.ancestors is None else meta.ancestors[i]
        if anc is not None:
            q_len, start = meta.query_lens[i], starts[b]
            pad_rows = anc[-1:].expand(short.max_query_len - q_len, q_len)  # pad rows repeat the last query
            causal[b, :, start : start + q_len] = torch.cat([anc, pad_rows]).to(causal.device)
    ctx = _long([meta.context_lens[i] for i in short.seq_ids], k_pos.device)[:, None, None]  # [Bs, 1, 1]
    return kind.allows(q_pos, k_pos, causal) & (k_idx < ctx)


def short_key_positions(meta: AttentionMetadata) -> torch.Tensor:
    """[Bs, L]: the position of each slot of the short batch's padded contexts (a cached key's: its slot index; a
    new token's: its own, which differs in a tree)."""
    short = meta.short
    k_pos = torch.arange(short.num_ctx_blocks * meta.block_size, device=short.query_positions.device)
    k_pos = k_pos.repeat(short.num_seqs, 1)  # [Bs, L]
    if meta.seq_positions is not None:
        starts = [meta.start_positions[i] for i in short.seq_ids]
        rows = [b for b, i in enumerate(short.seq_ids) for _ in meta.seq_positions[i]]
        cols = [starts[b] + j for b, i in enumerate(short.seq_ids) for j in range(len(meta.seq_positions[i]))]
        vals = [p for i in short.seq_ids for p in meta.seq_positions[i]]
        k_pos[_long(rows, k_pos.device), _long(cols, k_pos.device)] = _long(vals, k_pos.device)
    return k_pos


def own_key_positions(meta: AttentionMetadata, i: int) -> torch.Tensor:
    """[ctx]: the position of each key of own sequence ``i``'s context (cached keys, then its new tokens)."""
    seq, device = meta.own[i], meta.positions.device
    new_pos = _long(seq_positions(meta, seq.seq_id), device)
    return torch.cat([torch.arange(seq.start_pos, device=device), new_pos])


def _own_mask(meta: AttentionMetadata, i: int, kind: MaskKind, rows: slice = slice(None)) -> torch.Tensor:
    # -> [q, ctx] over own sequence i's whole context (cached keys and new ones), for its queries of rows
    seq = meta.own[i]
    k_pos = own_key_positions(meta, i)[None, :]  # [1, ctx]
    q_pos = k_pos[0, seq.start_pos:, None][rows]  # [q, 1]
    causal = k_pos <= q_pos
    anc = None if meta.ancestors is None else meta.ancestors[seq.seq_id]
    if anc is not None:
        causal[:, seq.start_pos :] = anc[rows].to(k_pos.device)
    return kind.allows(q_pos, k_pos, causal)


def seq_positions(meta: AttentionMetadata, i: int) -> list[int]:
    """Sequence ``i``'s new tokens' positions (host ints)."""
    if meta.seq_positions is not None:
        return meta.seq_positions[i]
    start = meta.start_positions[i]
    return list(range(start, start + meta.query_lens[i]))


def _fold_rows(mask: torch.Tensor, groups: int) -> torch.Tensor:
    # mask: [Bs, Q, L] -> [Bs, 1, G*Q, L]: folded query row g*Q + j is query j
    bs, q, length = mask.shape
    return mask[:, None].expand(bs, groups, q, length).reshape(bs, 1, groups * q, length)


# ---------------------------------------------------------------------------------------------- the plan


def build_attention_metadata(
    query_lens: list[int],
    start_positions: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    positions: list[int] | None = None,
    ancestors: list[torch.Tensor | None] | None = None,
    min_ctx_blocks: int = 0,
    read_in_place: bool = True,
    short_max: int | None = None,
) -> AttentionMetadata:
    """Plan one forward over a mixed batch (see the module docstring for the semantics). ``positions``: [T] RoPE
    position of every new token (None: its slot index); ``ancestors``: per sequence None or a [q, q] bool mask
    among its new tokens. For a step of fixed shapes (a CUDA graph's): ``min_ctx_blocks`` pads the short path's
    context to at least that many blocks, ``read_in_place=False`` keeps every short query on the short path, and
    ``short_max`` is the most new tokens of a short query (None: ``SHORT_QUERY_MAX``; a graph's rows: more)."""
    _validate(query_lens, start_positions, block_tables, block_size, positions, ancestors)
    slot_index = [p for q_len, start in zip(query_lens, start_positions) for p in range(start, start + q_len)]
    slots: list[int] = []
    for q_len, start, table in zip(query_lens, start_positions, block_tables):
        slots.extend(slots_of(table, range(start, start + q_len), block_size))
    context_lens = [s + q for s, q in zip(start_positions, query_lens)]
    offsets = [0]
    for q_len in query_lens:
        offsets.append(offsets[-1] + q_len)
    seq_positions = None
    if positions is not None and positions != slot_index:
        seq_positions = [positions[offsets[i] : offsets[i + 1]] for i in range(len(query_lens))]
    else:
        positions = slot_index
    if ancestors is not None and all(a is None for a in ancestors):
        ancestors = None

    short_ids = [i for i, q in enumerate(query_lens) if q <= (SHORT_QUERY_MAX if short_max is None else short_max)]
    if short_ids and read_in_place and cpu_kernels.reads_in_place(device, [context_lens[i] for i in short_ids]):
        short_ids = []
    own_ids = sorted(set(range(len(query_lens))) - set(short_ids))
    short = _plan_short(short_ids, query_lens, start_positions, context_lens, block_tables, block_size, offsets,
                        positions, device, min_ctx_blocks) if short_ids else None
    own = [_plan_own(i, query_lens, start_positions, context_lens, block_tables, block_size, offsets, device)
           for i in own_ids]
    return AttentionMetadata(
        positions=_long(positions, device),
        slot_mapping=_long(slots, device),
        query_lens=list(query_lens),
        start_positions=list(start_positions),
        context_lens=context_lens,
        block_size=block_size,
        max_position=max(positions),
        short=short,
        own=own,
        seq_positions=seq_positions,
        ancestors=ancestors,
    )


def _validate(query_lens, start_positions, block_tables, block_size, positions, ancestors) -> None:
    if not (len(query_lens) == len(start_positions) == len(block_tables)) or not query_lens:
        raise ValueError(
            f"build_attention_metadata: query_lens ({len(query_lens)}), start_positions ({len(start_positions)}) "
            f"and block_tables ({len(block_tables)}) must be non-empty and of equal length (one per sequence)"
        )
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    for i, (q_len, start, table) in enumerate(zip(query_lens, start_positions, block_tables)):
        if q_len < 1 or start < 0:
            raise ValueError(f"sequence {i}: query_len={q_len} must be >= 1 and start_position={start} >= 0")
        needed = -(-(start + q_len) // block_size)
        if len(table) < needed:
            raise ValueError(
                f"sequence {i}: block table has {len(table)} blocks but context {start + q_len} needs {needed} "
                f"blocks of {block_size}; allocate blocks before scheduling the step"
            )
    if positions is not None and (len(positions) != sum(query_lens) or min(positions) < 0):
        raise ValueError(f"build_attention_metadata: positions has {len(positions)} entries (min "
                         f"{min(positions, default=None)}); give one position >= 0 per new token ({sum(query_lens)})")
    if ancestors is not None:
        if len(ancestors) != len(query_lens):
            raise ValueError(f"build_attention_metadata: ancestors has {len(ancestors)} entries for "
                             f"{len(query_lens)} sequences; give one (None or a [q, q] bool mask) per sequence")
        for i, (anc, q_len) in enumerate(zip(ancestors, query_lens)):
            if anc is not None and (tuple(anc.shape) != (q_len, q_len) or anc.dtype != torch.bool):
                raise ValueError(f"sequence {i}: ancestor mask of shape {tuple(anc.shape)} and dtype {anc.dtype}; "
                                 f"it must be [{q_len}, {q_len}] bool (one row and column per new token)")


def _plan_short(ids, query_lens, start_positions, context_lens, block_tables, block_size, offsets, positions,
                device, min_ctx_blocks: int = 0) -> ShortBatch:
    q_max = max(query_lens[i] for i in ids)
    nb = max(min_ctx_blocks, *(-(-context_lens[i] // block_size) for i in ids))
    blocks, q_pos, tok_idx, src, dst = [], [], [], [], []
    for b, i in enumerate(ids):
        used = -(-context_lens[i] // block_size)
        blocks.extend(block_tables[i][:used])
        blocks.extend(block_tables[i][:1] * (nb - used))  # its own (masked out; another's block 0 may hold a NaN)
        q_len, off = query_lens[i], offsets[i]
        for j in range(q_max):
            jj = min(j, q_len - 1)  # pad rows repeat the last real query (finite softmax, result dropped)
            q_pos.append(positions[off + jj])
            tok_idx.append(off + jj)
        src.extend(range(b * q_max, b * q_max + q_len))
        dst.extend(range(off, off + q_len))
    identity = ids == list(range(len(query_lens))) and all(query_lens[i] == q_max for i in ids)
    return ShortBatch(
        seq_ids=list(ids),
        max_query_len=q_max,
        num_ctx_blocks=nb,
        block_index=_long(blocks, device),
        query_positions=_long(q_pos, device).view(len(ids), q_max),
        token_index=None if identity else _long(tok_idx, device),
        out_src=None if identity else _long(src, device),
        out_dst=None if identity else _long(dst, device),
    )


def _long(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _plan_own(i, query_lens, start_positions, context_lens, block_tables, block_size, offsets,
              device) -> OwnSeq:
    start = start_positions[i]
    first_slot = block_index = None
    if start > 0:
        blocks = block_tables[i][: -(-context_lens[i] // block_size)]
        if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
            first_slot = blocks[0] * block_size
        else:
            block_index = _long(blocks, device)
    return OwnSeq(i, offsets[i], offsets[i] + query_lens[i], start, context_lens[i], first_slot, block_index)


# ---------------------------------------------------------------------------------------------- the layer


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                       cap: float | None = None, is_causal: bool = False, sinks: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """SDPA's attention spelled out (in float32), for what SDPA has no hook on: each score capped, ``s = cap *
    tanh(q.k * scale / cap)``, before the mask (``cap``); and a sink logit per query row joining its softmax, whose
    probability is dropped, so a row's weights sum to ``1 - p_sink`` (``sinks``, broadcast to [B, Hq, Lq, 1]).
    q: [B, Hq, Lq, D]; k, v: [B, Hkv, L, D], query head h reading KV head h // (Hq / Hkv) as SDPA's ``enable_gqa``;
    ``mask`` as SDPA's (bool, True: attend; or additive), broadcast over [B, Hq, Lq, L]; ``is_causal``: SDPA's
    top-left causal mask. -> [B, Hq, Lq, D]."""
    b, hq, lq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    folded = q.reshape(b, hkv, hq // hkv * lq, d)  # each KV head's query heads as more rows: keys never repeated
    scores = torch.matmul(folded, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G*Lq, L]
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.view(b, hq, lq, length)
    if is_causal:
        mask = torch.ones(lq, length, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # softmax over [scores, sink], the sink's column dropped (a row masked whole attends to nothing: zeros)
        sink = sinks.float().expand(b, hq, lq, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :length]
    probs = probs.to(v.dtype).view(b, hkv, hq // hkv * lq, length)
    return torch.matmul(probs, v).view(b, hq, lq, d)


class PagedAttention(nn.Module):
    """Attention of one layer over its paged KV cache ``[Hkv, num_blocks * block_size, D]`` (k and v), a view of
    the runner's :class:`~specray.models.kv_cache.KVCache` that :meth:`bind_cache` hands in. ``kv_spec`` says
    what the layer caches and which keys it may see; ``softcap``: each score is capped to ``softcap * tanh(score /
    softcap)`` before the mask (Gemma 2); ``sinks``: the layer has a parameter ``sinks`` [num_heads] (this rank's
    heads; its owner loads it), each head's sink logit (GPT-OSS). Either is attended explicitly
    (:func:`explicit_attention`) instead of by SDPA."""

    softcap: float | None = None

    def __init__(self, num_heads: int, kv_spec: FullAttentionSpec, scale: float, softcap: float | None = None,
                 sinks: bool = False):
        super().__init__()
        assert num_heads % kv_spec.num_kv_heads == 0, (num_heads, kv_spec.num_kv_heads)
        assert softcap is None or softcap > 0, softcap
        self.softcap = softcap
        self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False) if sinks else None
        self.num_heads = num_heads
        self.kv_spec = kv_spec
        self.num_kv_heads = kv_spec.num_kv_heads
        self.head_dim = kv_spec.head_dim
        self.groups = num_heads // self.num_kv_heads
        self.scale = scale
        self.mask_kind = kv_spec.mask_kind
        self.block_size = 1
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.fp8: torch.dtype | None = None
        # an FP8 cache stores k / k_scale and v / v_scale (a checkpoint's calibrated scales: set_kv_scales; else 1)
        self.k_scale = self.v_scale = 1.0

    def kernel_widths(self) -> tuple[int, int, bool]:
        """How :mod:`~specray.models.triton_attention`'s kernel reads this layer's cache rows: (value width, key
        columns past it that only join q.k, whether the values are the keys' first columns). Each head's query, key
        and value are ``head_dim`` wide here; a layer that binds its cache otherwise says how it reads it."""
        return self.head_dim, 0, False

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """A checkpoint's K and V scales for an FP8 cache (llm-compressor's ``kv_cache_scheme``): values are stored
        divided by them and multiplied back as they are read; a cache in the model's dtype ignores them."""
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (value > 0 and value != float("inf")):
                raise ValueError(f"the checkpoint's {name}={value} must be a positive finite number")
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)

    def bind_cache(self, cache: torch.Tensor, block_size: int, fp8: torch.dtype | None = None) -> None:
        """Attend over ``cache`` [2, Hkv, slots, D] (k, v), owned by the caller; ``fp8``: it holds the values in
        that FP8 format, as bytes. Every token's key and value are then read as the cache holds them, its own step's
        too (never the unrounded ones), so that the outputs do not depend on how tokens are grouped into steps."""
        assert cache.shape == self.kv_spec.shape(cache.shape[2]), (tuple(cache.shape), self.kv_spec)
        self.block_size = block_size
        self.k_cache, self.v_cache = cache[0], cache[1]
        self.fp8 = fp8

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq*D]
        self._store(k, v, meta.slot_mapping)
        return self._by_path(q, meta, lambda: self._short(q, meta), lambda i: self._own(q, k, v, meta, i))

    def _by_path(self, q: torch.Tensor, meta: AttentionMetadata, short: Callable[[], torch.Tensor],
                 own: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """The step's rows [T, Hq*D] from both paths: the short batch's (``short()``, its padded rows [Bs*Q, Hq*D])
        and each own sequence's (``own(i)``, [q, Hq*D]), in the step's order."""
        rows = short() if meta.short is not None else None
        if rows is not None and meta.short.token_index is None:  # identity layout: every sequence is short
            return rows
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if rows is not None:
            out.index_copy_(0, meta.short.out_dst, rows.index_select(0, meta.short.out_src))
        for i, seq in enumerate(meta.own):
            out[seq.token_start : seq.token_end] = own(i)
        return out

    def _store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        # k, v: [T, Hkv, D]; slots: [T]
        self.k_cache.index_copy_(1, slots, self._stored(k.transpose(0, 1), self.k_scale))
        self.v_cache.index_copy_(1, slots, self._stored(v.transpose(0, 1), self.v_scale))

    def _stored(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Values as the cache holds them: FP8 bytes of ``x / scale`` (clamped to the format's range) or as they
        are."""
        if self.fp8 is None:
            return x
        bound = torch.finfo(self.fp8).max
        return (x if scale == 1.0 else x / scale).clamp(-bound, bound).to(self.fp8).view(torch.uint8)

    def _read(self, x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        """Cached values (gathered or a view) in the model's dtype, times ``scale``."""
        if self.fp8 is None:
            return x
        x = x.view(self.fp8).to(dtype)
        return x if scale == 1.0 else x * scale

    def _gather(self, cache: torch.Tensor, block_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
        # cache: [Hkv, N*bs, D]; block_index: [num_seqs * nb] -> [num_seqs, Hkv, nb*bs, D]
        blocks = cache.view(self.num_kv_heads, -1, self.block_size, self.head_dim).index_select(1, block_index)
        return blocks.view(self.num_kv_heads, num_seqs, -1, self.head_dim).transpose(0, 1)

    def _context(self, cache: torch.Tensor, seq: OwnSeq) -> torch.Tensor:
        # -> [1, Hkv, ctx, D]: a view of the cache when the sequence's blocks are consecutive, else gathered
        if seq.first_slot is not None:
            return cache[None, :, seq.first_slot : seq.first_slot + seq.context_len]
        return self._gather(cache, seq.block_index, 1)[:, :, : seq.context_len]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                is_causal: bool = False) -> torch.Tensor:
        # q: [B, Hq, Lq, D] (or GQA-folded: [B, Hkv, G*q, D]); k, v: [B, Hkv, L, D] (fewer KV heads: GQA)
        # -> q's shape
        own_sinks = getattr(self, "sinks", None)  # none where a subclass builds its own state (DeepSeek's MLA)
        if self.softcap is not None or own_sinks is not None:
            sinks = None if own_sinks is None else self._row_sinks(q.shape[1], q.shape[2])
            return explicit_attention(q, k, v, mask, self.scale, self.softcap, is_causal, sinks)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale,
                                              enable_gqa=q.shape[1] != k.shape[1])

    def _row_sinks(self, heads: int, rows: int) -> torch.Tensor:
        """Each query row's sink logit, [heads, rows, 1]: per head for q [B, Hq, q, D]; for q folded [B, Hkv, G*q,
        D] (:meth:`_fold`: row g*q + j of KV head h is query j of head h*G + g) each head's repeated over its q
        rows."""
        if heads == self.num_heads:
            return self.sinks.view(heads, 1, 1)
        return self.sinks.view(heads, self.groups, 1).expand(heads, self.groups, rows // self.groups).reshape(
            heads, rows, 1)

    def _fold(self, q: torch.Tensor, bs: int, q_len: int) -> torch.Tensor:
        # q: [bs*q_len, Hq, D] -> [bs, Hkv, G*q_len, D]: each KV head's G query heads as more query rows
        hkv, g, d = self.num_kv_heads, self.groups, self.head_dim
        return q.view(bs, q_len, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(bs, hkv, g * q_len, d)

    def _unfold(self, o: torch.Tensor, bs: int, q_len: int) -> torch.Tensor:
        # o: [bs, Hkv, G*q_len, D] -> [bs*q_len, Hq*D]
        hkv, g, d = self.num_kv_heads, self.groups, self.head_dim
        return o.view(bs, hkv, g, q_len, d).permute(0, 3, 1, 2, 4).reshape(bs * q_len, hkv * g * d)

    def _short(self, q: torch.Tensor, meta: AttentionMetadata, select: torch.Tensor | None = None) -> torch.Tensor:
        # q: [T, Hq, D] -> [Bs*Q, Hq*D] (padded rows included); select: [Bs, Q, L] bool, the keys each query
        # attends when a layer picks them itself (a subset of what the mask allows: DeepSeek's sparse attention)
        if select is None and triton_attention.runs(self, q):  # on a GPU: read in place through the block table
            rows = triton_attention.short_attention(self, q, meta)
            if rows is not None:  # None: Triton refused the kernel on this GPU (logged)
                return rows
        sb = meta.short
        bs, q_len = sb.num_seqs, sb.max_query_len
        if sb.token_index is not None:
            q = q.index_select(0, sb.token_index)
        k = self._read(self._gather(self.k_cache, sb.block_index, bs), q.dtype, self.k_scale)  # [Bs, Hkv, L, D]
        v = self._read(self._gather(self.v_cache, sb.block_index, bs), q.dtype, self.v_scale)
        mask = self.short_mask(meta, q.dtype) if select is None else _fold_rows(select, self.groups)
        return self._unfold(self._attend(self._fold(q, bs, q_len), k, v, mask), bs, q_len)

    def short_mask(self, meta: AttentionMetadata, dtype: torch.dtype) -> torch.Tensor:
        """The short batch's mask over its folded query rows, [Bs, 1, G*Q, L] bool (a subclass's: additive in
        ``dtype``, with a bias of its own: :mod:`specray.models.alibi`)."""
        return meta.short_mask(self.groups, self.mask_kind)

    def own_mask(self, meta: AttentionMetadata, i: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Own sequence ``i``'s mask (:meth:`AttentionMetadata.own_mask`; a subclass's: additive, never None)."""
        return meta.own_mask(i, self.groups, self.mask_kind)

    def own_keys_values(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, i: int,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Own sequence ``i``'s keys and values as its attention reads them, [1, Hkv, ctx, D] each: a fresh
        sequence's own rows of ``k`` / ``v`` [T, Hkv, D] (rounded as the cache holds them), another's context from the
        cache (a family with an additive bias per row attends them itself, by blocks of rows)."""
        seq = meta.own[i]
        if seq.fresh:
            rows = slice(seq.token_start, seq.token_end)
            ks, vs = (self._read(self._stored(x[rows], s), dtype, s).transpose(0, 1)[None]
                      for x, s in ((k, self.k_scale), (v, self.v_scale)))
            return ks, vs
        return (self._read(self._context(self.k_cache, seq), dtype, self.k_scale),
                self._read(self._context(self.v_cache, seq), dtype, self.v_scale))

    def _own(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
             i: int, select: torch.Tensor | None = None) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [q_len, Hq*D]; select: [q, ctx] bool, as :meth:`_short`'s
        seq = meta.own[i]
        if not seq.fresh and select is None and triton_attention.runs(self, q, own=True):
            out = triton_attention.own_attention(self, q, meta, i)  # on a GPU: read in place, masked by position
            if out is not None:  # None: Triton refused the kernel on this GPU (logged)
                return out
        rows = slice(seq.token_start, seq.token_end)
        mask = self.own_mask(meta, i, q.dtype)
        if select is not None:
            mask = select if seq.fresh else select.repeat(self.groups, 1)
        if seq.fresh:  # only its own new tokens: causal, GQA in the kernel (rounded as the cache holds them)
            k_rows, v_rows = (self._read(self._stored(x[rows], s), q.dtype, s)
                              for x, s in ((k, self.k_scale), (v, self.v_scale)))
            o = self._attend(q[rows].transpose(0, 1)[None], k_rows.transpose(0, 1)[None],
                             v_rows.transpose(0, 1)[None], mask, is_causal=mask is None)  # [1, Hq, q, D]
            return o[0].transpose(0, 1).reshape(-1, self.num_heads * self.head_dim)
        ks = self._read(self._context(self.k_cache, seq), q.dtype, self.k_scale)  # [1, Hkv, ctx, D]
        vs = self._read(self._context(self.v_cache, seq), q.dtype, self.v_scale)
        o = self._attend(self._fold(q[rows], 1, seq.query_len), ks, vs, mask)  # [1, Hkv, G*q, D]
        return self._unfold(o, 1, seq.query_len)
