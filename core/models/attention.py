"""Paged attention over a mixed batch (prefill chunks, decode tokens, last token + drafts) in one call.

The batch is the concatenation of B sequences. Sequence i brings ``query_lens[i]`` new tokens at positions
``start_positions[i] ..``; its first ``start_positions[i]`` tokens are already in the paged KV cache. Position p
of sequence i lives in slot ``block_tables[i][p // block_size] * block_size + p % block_size``.

The cache of one layer is ``[Hkv, num_blocks * block_size, D]`` (k and v): slot ``s`` of every KV head is row
``s`` of that head's matrix, so the context of a sequence whose blocks are consecutive is one view of the cache.

Two paths, both planned once per step in :func:`build_attention_metadata` (all index tensors are built there from
Python lists, so a forward has no host syncs):

* short queries (at most ``SHORT_QUERY_MAX`` new tokens: decode, last token + drafts, small prefills) run as one
  padded batched SDPA. Each sequence's context is gathered from the cache by whole blocks; the query's GQA group
  is folded into the query length (``[Bs, Hkv, G*Q, D]``) so the keys are never repeated;
* sequences attended on their own, one SDPA each: long prefill chunks, and on CPU also the short queries once
  the longest of their contexts reaches ``OWN_MIN_CONTEXT`` tokens (the padded batch gathers every context padded
  to the longest). There gathering costs more than attending: a decode step of 8 x 1.6k contexts took 300 ms
  gathered and 190 ms read in place, and gathered up to 650 ms when the allocator returned the large temporaries
  to the OS between steps; below ~512 tokens the padded batch is as fast or faster
  (``benchmarks/bench_long_context.py``). A fresh prefill attends to its own new k/v with ``is_causal``; a
  sequence with context reads it in place when its blocks are consecutive (the block manager keeps them so
  where it can), else gathers its blocks, and folds its GQA group like the short path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

SHORT_QUERY_MAX = 16  # sequences with at most this many new tokens take the padded batched path
OWN_MIN_CONTEXT = 512  # on CPU, short queries attend one sequence at a time from this longest context


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
class OwnSeq:
    """One sequence attended on its own."""

    token_start: int
    token_end: int
    start_pos: int
    context_len: int
    first_slot: int | None  # its blocks are consecutive: the slot of position 0 (its context is one view)
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

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_lens: list[int]
    start_positions: list[int]
    context_lens: list[int]
    block_size: int
    max_position: int  # largest position in the step (a Python int: no sync to size RoPE tables)
    short: ShortBatch | None
    own: list[OwnSeq]
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

    def own_mask(self, i: int, groups: int, window: int | None) -> torch.Tensor | None:
        """Mask of own sequence ``i``: for a fresh prefill [q, q] (None: plain ``is_causal``), else [G*q, ctx]
        over its GQA-folded query rows (None: every row sees the whole context)."""
        seq = self.own[i]
        if window is None and (seq.fresh or seq.query_len == 1):
            return None
        key = ("own", i, groups, window)
        if key not in self._masks:
            mask = _causal_mask(seq.start_pos, seq.query_len, seq.context_len, window, self.positions.device)
            if not seq.fresh:
                mask = mask.repeat(groups, 1)  # [G*q, ctx]: folded row g*q + j is query j
            self._masks[key] = mask
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
    if short_ids and _read_in_place(device, [context_lens[i] for i in short_ids]):
        short_ids = []
    own_ids = sorted(set(range(len(query_lens))) - set(short_ids))
    short = _plan_short(short_ids, query_lens, start_positions, context_lens, block_tables, block_size, offsets,
                        device) if short_ids else None
    own = [_plan_own(i, query_lens, start_positions, context_lens, block_tables, block_size, offsets, device)
           for i in own_ids]
    return AttentionMetadata(
        positions=_long_tensor(positions, device),
        slot_mapping=_long_tensor(slots, device),
        query_lens=list(query_lens),
        start_positions=list(start_positions),
        context_lens=context_lens,
        block_size=block_size,
        max_position=max(context_lens) - 1,
        short=short,
        own=own,
    )


def _read_in_place(device, context_lens: list[int]) -> bool:
    """Whether short queries attend one sequence at a time, reading contexts in place (CPU, long contexts). The
    padded batch gathers every sequence's context padded to the longest, so the longest decides."""
    return torch.device(device).type == "cpu" and max(context_lens) >= OWN_MIN_CONTEXT


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


def _plan_own(i, query_lens, start_positions, context_lens, block_tables, block_size, offsets,
              device) -> OwnSeq:
    start = start_positions[i]
    first_slot = block_index = None
    if start > 0:
        blocks = block_tables[i][: -(-context_lens[i] // block_size)]
        if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
            first_slot = blocks[0] * block_size
        else:
            block_index = _long_tensor(blocks, device)
    return OwnSeq(offsets[i], offsets[i] + query_lens[i], start, context_lens[i], first_slot, block_index)


class PagedAttention(nn.Module):
    """Attention of one layer over its paged KV cache ``[Hkv, num_blocks * block_size, D]`` (k and v)."""

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
        self.block_size = 1
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> None:
        """Zeroed caches (masked-out slots must hold finite values) of ``num_blocks`` blocks."""
        shape = (self.num_kv_heads, num_blocks * block_size, self.head_dim)
        self.block_size = block_size
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def read_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v cached at ``slots`` [n]: two [n, Hkv, D] (for tests and debugging)."""
        return self.k_cache[:, slots].transpose(0, 1), self.v_cache[:, slots].transpose(0, 1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq*D]
        self._store(k, v, meta.slot_mapping)
        short = self._short(q, meta) if meta.short is not None else None
        if short is not None and meta.short.token_index is None:  # identity layout: every sequence is short
            return short
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if short is not None:
            out.index_copy_(0, meta.short.out_dst, short.index_select(0, meta.short.out_src))
        for i, seq in enumerate(meta.own):
            out[seq.token_start : seq.token_end] = self._own(q, k, v, meta, i)
        return out

    def _store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        # k, v: [T, Hkv, D]; slots: [T]
        self.k_cache.index_copy_(1, slots, k.transpose(0, 1))
        self.v_cache.index_copy_(1, slots, v.transpose(0, 1))

    def _gather(self, cache: torch.Tensor, block_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
        # cache: [Hkv, N*bs, D]; block_index: [num_seqs * nb] -> [num_seqs, Hkv, nb*bs, D]
        blocks = cache.view(self.num_kv_heads, -1, self.block_size, self.head_dim).index_select(1, block_index)
        return blocks.view(self.num_kv_heads, num_seqs, -1, self.head_dim).transpose(0, 1)

    def _context(self, cache: torch.Tensor, seq: OwnSeq) -> torch.Tensor:
        # -> [1, Hkv, ctx, D]: a view of the cache when the sequence's blocks are consecutive, else gathered
        if seq.first_slot is not None:
            return cache[None, :, seq.first_slot : seq.first_slot + seq.context_len]
        return self._gather(cache, seq.block_index, 1)[:, :, : seq.context_len]

    def _fold(self, q: torch.Tensor, bs: int, q_len: int) -> torch.Tensor:
        # q: [bs*q_len, Hq, D] -> [bs, Hkv, G*q_len, D]: each KV head's G query heads as more query rows
        hkv, g, d = self.num_kv_heads, self.groups, self.head_dim
        return q.view(bs, q_len, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(bs, hkv, g * q_len, d)

    def _unfold(self, o: torch.Tensor, bs: int, q_len: int) -> torch.Tensor:
        # o: [bs, Hkv, G*q_len, D] -> [bs*q_len, Hq*D]
        hkv, g, d = self.num_kv_heads, self.groups, self.head_dim
        return o.view(bs, hkv, g, q_len, d).permute(0, 3, 1, 2, 4).reshape(bs * q_len, hkv * g * d)

    def _short(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [T, Hq, D] -> [Bs*Q, Hq*D] (padded rows included)
        sb = meta.short
        bs, q_len = sb.num_seqs, sb.max_query_len
        if sb.token_index is not None:
            q = q.index_select(0, sb.token_index)
        k = self._gather(self.k_cache, sb.block_index, bs)  # [Bs, Hkv, L, D]
        v = self._gather(self.v_cache, sb.block_index, bs)
        mask = meta.short_mask(self.groups, self.sliding_window)  # [Bs, 1, G*Q, L]
        o = F.scaled_dot_product_attention(self._fold(q, bs, q_len), k, v, attn_mask=mask, scale=self.scale)
        return self._unfold(o, bs, q_len)

    def _own(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
             i: int) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [q_len, Hq*D]
        seq = meta.own[i]
        rows = slice(seq.token_start, seq.token_end)
        mask = meta.own_mask(i, self.groups, self.sliding_window)
        if seq.fresh:  # only its own new tokens: causal, GQA in the kernel
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
                                               v[rows].transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                                               scale=self.scale, enable_gqa=self.groups > 1)  # [1, Hq, q, D]
            return o[0].transpose(0, 1).reshape(-1, self.num_heads * self.head_dim)
        ks, vs = self._context(self.k_cache, seq), self._context(self.v_cache, seq)  # [1, Hkv, ctx, D]
        o = F.scaled_dot_product_attention(self._fold(q[rows], 1, seq.query_len), ks, vs, attn_mask=mask,
                                           scale=self.scale)  # [1, Hkv, G*q, D]
        return self._unfold(o, 1, seq.query_len)
