"""Paged attention over a mixed batch (prefill chunks, decode tokens, last token + drafts) in one call.

The batch is the concatenation of B sequences. Sequence i brings ``query_lens[i]`` new tokens at positions
``start_positions[i] ..``; its first ``start_positions[i]`` tokens are already in the paged KV cache. Position p
of sequence i lives in slot ``block_tables[i][p // block_size] * block_size + p % block_size``.

Two paths, both planned once per step in :func:`build_attention_metadata` (all index tensors are built there from
Python lists, so a forward has no host syncs):

* short queries (at most ``SHORT_QUERY_MAX`` new tokens: decode, last token + drafts, small prefills) run as one
  padded batched SDPA. Each sequence's context is gathered from the cache by whole blocks; the query's GQA group
  is folded into the query length (``[Bs, Hkv, G*Q, D]``) so the keys are never repeated;
* long prefill chunks run one SDPA each: a fresh prefill attends to its own new k/v with ``is_causal``, a
  continued chunk gathers its context and uses a precomputed causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

SHORT_QUERY_MAX = 16  # sequences with at most this many new tokens take the padded batched path


@dataclass
class ShortBatch:
    """The padded batch of short-query sequences."""

    seq_ids: list[int]  # indices into the step's sequences
    max_query_len: int  # Q (padded query length)
    num_ctx_blocks: int  # blocks gathered per sequence; padded context length L = num_ctx_blocks * block_size
    block_index: torch.Tensor  # [Bs * num_ctx_blocks] block ids (padding: block 0, masked out)
    query_positions: torch.Tensor  # [Bs, Q] position of every padded query row (pads repeat the last one)
    token_index: torch.Tensor | None  # [Bs * Q] row of the step for each padded query row; None: identity
    out_src: torch.Tensor | None  # [n] real rows of the padded output
    out_dst: torch.Tensor | None  # [n] their rows in the step

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)


@dataclass
class LongSeq:
    """One long prefill chunk, attended on its own."""

    token_start: int
    token_end: int
    start_pos: int
    context_len: int
    block_index: torch.Tensor | None  # [nb] blocks of its context; None for a fresh prefill (start_pos == 0)


@dataclass
class AttentionMetadata:
    """Built once per forward, shared by every layer."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_lens: list[int]
    start_positions: list[int]
    context_lens: list[int]
    block_size: int
    max_position: int  # largest position in the step (a Python int: no sync to size RoPE tables)
    short: ShortBatch | None
    long: list[LongSeq]
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def short_mask(self, groups: int, window: int | None) -> torch.Tensor:
        """[Bs, 1, G*Q, L] bool, True where a folded query row may attend a context slot (cached per step)."""
        key = ("short", groups, window)
        if key not in self._masks:
            self._masks[key] = _short_mask(self.short, self.block_size, groups, window)
        return self._masks[key]

    def long_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        """[q, ctx] bool for long chunk ``i``; None means plain ``is_causal`` over its own tokens."""
        seq = self.long[i]
        if seq.start_pos == 0 and window is None:
            return None
        key = ("long", i, window)
        if key not in self._masks:
            self._masks[key] = _causal_mask(
                seq.start_pos, seq.token_end - seq.token_start, seq.context_len, window, self.positions.device
            )
        return self._masks[key]


def _causal_mask(start: int, q_len: int, ctx_len: int, window: int | None, device) -> torch.Tensor:
    q_pos = torch.arange(start, start + q_len, device=device)[:, None]  # [q, 1]
    k_pos = torch.arange(ctx_len, device=device)[None, :]  # [1, ctx]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _short_mask(short: ShortBatch, block_size: int, groups: int, window: int | None) -> torch.Tensor:
    q_pos = short.query_positions[:, :, None]  # [Bs, Q, 1]
    k_pos = torch.arange(short.num_ctx_blocks * block_size, device=q_pos.device)  # [L]
    mask = k_pos <= q_pos  # [Bs, Q, L]; also hides padded context, which lies past every query position
    if window is not None:
        mask &= k_pos > q_pos - window
    bs, q, length = mask.shape
    return mask[:, None].expand(bs, groups, q, length).reshape(bs, 1, groups * q, length)


def build_attention_metadata(
    query_lens: list[int],
    start_positions: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Plan one forward over a mixed batch (see the module docstring for the semantics)."""
    _validate(query_lens, start_positions, block_tables, block_size)
    positions: list[int] = []
    slots: list[int] = []
    for q_len, start, table in zip(query_lens, start_positions, block_tables):
        for p in range(start, start + q_len):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    context_lens = [s + q for s, q in zip(start_positions, query_lens)]
    offsets = [0]
    for q_len in query_lens:
        offsets.append(offsets[-1] + q_len)

    short_ids = [i for i, q in enumerate(query_lens) if q <= SHORT_QUERY_MAX]
    long_ids = [i for i, q in enumerate(query_lens) if q > SHORT_QUERY_MAX]
    short = _plan_short(short_ids, query_lens, start_positions, context_lens, block_tables, block_size, offsets,
                        device) if short_ids else None
    long = [_plan_long(i, query_lens, start_positions, context_lens, block_tables, block_size, offsets, device)
            for i in long_ids]
    return AttentionMetadata(
        positions=_long_tensor(positions, device),
        slot_mapping=_long_tensor(slots, device),
        query_lens=list(query_lens),
        start_positions=list(start_positions),
        context_lens=context_lens,
        block_size=block_size,
        max_position=max(context_lens) - 1,
        short=short,
        long=long,
    )


def _validate(query_lens, start_positions, block_tables, block_size) -> None:
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


def _plan_short(ids, query_lens, start_positions, context_lens, block_tables, block_size, offsets,
                device) -> ShortBatch:
    q_max = max(query_lens[i] for i in ids)
    nb = max(-(-context_lens[i] // block_size) for i in ids)
    blocks, q_pos, tok_idx, src, dst = [], [], [], [], []
    for b, i in enumerate(ids):
        used = -(-context_lens[i] // block_size)
        blocks.extend(block_tables[i][:used])
        blocks.extend([0] * (nb - used))
        q_len, start, off = query_lens[i], start_positions[i], offsets[i]
        for j in range(q_max):
            jj = min(j, q_len - 1)  # pad rows repeat the last real query (finite softmax, result dropped)
            q_pos.append(start + jj)
            tok_idx.append(off + jj)
        src.extend(range(b * q_max, b * q_max + q_len))
        dst.extend(range(off, off + q_len))
    identity = ids == list(range(len(query_lens))) and all(query_lens[i] == q_max for i in ids)
    return ShortBatch(
        seq_ids=list(ids),
        max_query_len=q_max,
        num_ctx_blocks=nb,
        block_index=_long_tensor(blocks, device),
        query_positions=_long_tensor(q_pos, device).view(len(ids), q_max),
        token_index=None if identity else _long_tensor(tok_idx, device),
        out_src=None if identity else _long_tensor(src, device),
        out_dst=None if identity else _long_tensor(dst, device),
    )


def _long_tensor(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _plan_long(i, query_lens, start_positions, context_lens, block_tables, block_size, offsets,
               device) -> LongSeq:
    start = start_positions[i]
    block_index = None
    if start > 0:
        used = -(-context_lens[i] // block_size)
        block_index = _long_tensor(block_tables[i][:used], device)
    return LongSeq(offsets[i], offsets[i] + query_lens[i], start, context_lens[i], block_index)


class PagedAttention(nn.Module):
    """Attention of one layer over its paged KV cache ``[num_blocks, block_size, Hkv, D]`` (k and v)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.groups = num_heads // num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq*D]
        self._store(k, v, meta.slot_mapping)
        short = self._short(q, meta) if meta.short is not None else None
        if short is not None and meta.short.token_index is None:  # identity layout: every sequence is short
            return short
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if short is not None:
            out.index_copy_(0, meta.short.out_dst, short.index_select(0, meta.short.out_src))
        for i, seq in enumerate(meta.long):
            out[seq.token_start : seq.token_end] = self._long(q, k, v, meta, i)
        return out

    def _store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        # k, v: [T, Hkv, D]; slots: [T]
        self.k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k)
        self.v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v)

    def _gather(self, cache: torch.Tensor, block_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
        # cache: [N, bs, Hkv, D]; block_index: [num_seqs * nb] -> [num_seqs, Hkv, nb*bs, D]
        ctx = cache.index_select(0, block_index).view(num_seqs, -1, self.num_kv_heads, self.head_dim)
        return ctx.transpose(1, 2)

    def _short(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [T, Hq, D] -> [Bs*Q, Hq*D] (padded rows included)
        sb = meta.short
        bs, q_len, hkv, g, d = sb.num_seqs, sb.max_query_len, self.num_kv_heads, self.groups, self.head_dim
        if sb.token_index is not None:
            q = q.index_select(0, sb.token_index)
        q = q.view(bs, q_len, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(bs, hkv, g * q_len, d)
        k = self._gather(self.k_cache, sb.block_index, bs)  # [Bs, Hkv, L, D]
        v = self._gather(self.v_cache, sb.block_index, bs)
        mask = meta.short_mask(g, self.sliding_window)  # [Bs, 1, G*Q, L]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # [Bs, Hkv, G*Q, D]
        return o.view(bs, hkv, g, q_len, d).permute(0, 3, 1, 2, 4).reshape(bs * q_len, hkv * g * d)

    def _long(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
              i: int) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [q_len, Hq*D]
        seq = meta.long[i]
        qs = q[seq.token_start : seq.token_end].transpose(0, 1)[None]  # [1, Hq, q, D]
        if seq.block_index is None:
            ks = k[seq.token_start : seq.token_end].transpose(0, 1)[None]  # [1, Hkv, q, D]
            vs = v[seq.token_start : seq.token_end].transpose(0, 1)[None]
        else:
            ks = self._gather(self.k_cache, seq.block_index, 1)[:, :, : seq.context_len]  # [1, Hkv, ctx, D]
            vs = self._gather(self.v_cache, seq.block_index, 1)[:, :, : seq.context_len]
        mask = meta.long_mask(i, self.sliding_window)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                           enable_gqa=self.groups > 1)  # [1, Hq, q, D]
        return o[0].transpose(0, 1).reshape(-1, self.num_heads * self.head_dim)
