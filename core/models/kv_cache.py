"""The paged KV cache: what each attention layer needs (a :class:`KVCacheSpec`), and one owner that allocates it.

A model states one spec per attention layer (``kv_cache_specs()``); the :class:`KVCache` allocates one tensor per
group of layers whose slots have the same shape and hands each layer a view of it (``bind_kv_cache``). Sizing
(bytes per block over all layers), snapshots of slots and moving K/V between slots are calls on the cache, so the
runner never loops over the model's layers, and a move over every layer is one ``index_copy_`` per group.

Slots: slot ``s`` is position ``s % block_size`` of block ``s // block_size``. Every spec keeps all of a
sequence's slots (a sliding-window or chunked-local layer masks what it may not see instead of freeing it), so
one block table serves every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specray.kv_blocks import slots_of  # noqa: F401  (re-exported: the attention builder's slot arithmetic)


@dataclass(frozen=True)
class MaskKind:
    """Which earlier keys a query may attend, compared by RoPE position (not by slot): always causal, plus a
    sliding ``window`` (keys within ``window`` positions) or a ``chunk`` (keys in the same chunk of positions,
    Llama-4's chunked-local attention). ``causal_keys``: causal by position even where a sequence brings a mask
    among its new tokens (a tree's ancestors, an image's both ways), which can then only narrow it (Gemma 4's full
    layers, DFlash's layers that keep their block causal)."""

    window: int | None = None
    chunk: int | None = None
    causal_keys: bool = False

    @property
    def plain(self) -> bool:
        """Causal and nothing more where a sequence brings no mask of its own."""
        return self.window is None and self.chunk is None

    def allows(self, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: torch.Tensor | None = None) -> torch.Tensor:
        """Bool mask, broadcast over ``q_pos`` and ``k_pos``; ``causal`` replaces ``k_pos <= q_pos`` where a
        caller knows better (a tree's ancestors), or narrows it (``causal_keys``)."""
        mask = k_pos <= q_pos if causal is None else causal & (k_pos <= q_pos) if self.causal_keys else causal
        if self.window is not None:
            mask = mask & (k_pos > q_pos - self.window)
        if self.chunk is not None:
            mask = mask & (k_pos // self.chunk == q_pos // self.chunk)
        return mask


CAUSAL = MaskKind()
CAUSAL_KEYS = MaskKind(causal_keys=True)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer caches per slot on this rank. Base of the concrete specs."""

    @property
    def slot_shape(self) -> tuple[int, ...]:
        """The shape of the layer's cache with the slot dimension of size 1 (see :attr:`slot_dim`)."""
        raise NotImplementedError

    @property
    def slot_dim(self) -> int:
        """Which dimension of the layer's cache indexes slots."""
        raise NotImplementedError

    @property
    def mask_kind(self) -> MaskKind:
        return CAUSAL

    def shape(self, num_slots: int) -> tuple[int, ...]:
        shape = list(self.slot_shape)
        shape[self.slot_dim] = num_slots
        return tuple(shape)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block of ``block_size`` slots takes in this layer."""
        per_slot = 1
        for n in self.slot_shape:
            per_slot *= n
        return per_slot * block_size * dtype.itemsize


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """k and v of this rank's KV heads: the layer's cache is ``[2, Hkv, slots, D]`` (k = [0], v = [1]), so one
    head's context of consecutive blocks is one view. ``kv_head_start`` is the global index of this rank's first
    KV head (heads are split over TP ranks, or replicated when there are fewer than ranks). A draft head's extra
    layers are more of these."""

    num_kv_heads: int
    head_dim: int
    kv_head_start: int = 0

    @property
    def slot_shape(self) -> tuple[int, ...]:
        return (2, self.num_kv_heads, 1, self.head_dim)

    @property
    def slot_dim(self) -> int:
        return 2

    @property
    def kv_head_range(self) -> tuple[int, int]:
        """The global KV heads this rank holds: ``(start, count)``."""
        return self.kv_head_start, self.num_kv_heads


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Full-attention layout; queries see the last ``sliding_window`` positions (Mistral, Qwen2 layers)."""

    sliding_window: int = 0

    @property
    def mask_kind(self) -> MaskKind:
        return MaskKind(window=self.sliding_window)


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(FullAttentionSpec):
    """Full-attention layout; queries see earlier positions of their own chunk of ``attention_chunk_size``
    (Llama-4's local layers)."""

    attention_chunk_size: int = 0

    @property
    def mask_kind(self) -> MaskKind:
        return MaskKind(chunk=self.attention_chunk_size)


@dataclass(frozen=True)
class MLAAttentionSpec(KVCacheSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): one compressed latent plus the RoPE part of the key per
    slot, ``[slots, kv_lora_rank + qk_rope_head_dim]``, the same on every TP rank. ``index_head_dim``: DeepSeek
    Sparse Attention's indexer key (V3.2), kept in the same row after them."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int = 0

    @property
    def slot_shape(self) -> tuple[int, ...]:
        return (1, self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim)

    @property
    def slot_dim(self) -> int:
        return 0


@dataclass(frozen=True)
class CompressedAttentionSpec(KVCacheSpec):
    """DeepSeek-V4's attention: one row per slot, the same on every TP rank. A token's key, which is also its value
    (``head_dim``), that a sliding window of queries attends; on a compressing layer (``compress_rate`` m > 0) also
    what its compressor pools from it, a key and a gate of ``head_dim`` per series (two series where windows overlap,
    ``overlap``: the compressed sparse layers), the entry a window's last token holds (the pooled key of the m tokens
    up to it), and with an indexer (``index_head_dim``) the same three for the indexer's keys. Every value in a row
    follows from the token and those before it, so blocks are shared (prefix caching) and rows past a rejected draft
    are rewritten by the next tokens at those positions, as every layer's K/V is."""

    head_dim: int
    compress_rate: int = 0
    overlap: bool = False
    index_head_dim: int = 0

    @property
    def columns(self) -> dict[str, tuple[int, int]]:
        """Where each part of a row is: name -> (start, width)."""
        series = 2 if self.overlap else 1
        widths = [("kv", self.head_dim)]
        if self.compress_rate:
            widths += [("raw_kv", series * self.head_dim), ("raw_gate", series * self.head_dim),
                       ("entry", self.head_dim)]
        if self.index_head_dim:
            widths += [("index_raw_kv", 2 * self.index_head_dim), ("index_raw_gate", 2 * self.index_head_dim),
                       ("index_entry", self.index_head_dim)]
        out, start = {}, 0
        for name, width in widths:
            out[name] = (start, width)
            start += width
        return out

    @property
    def slot_shape(self) -> tuple[int, ...]:
        return (1, sum(width for _, width in self.columns.values()))

    @property
    def slot_dim(self) -> int:
        return 0


@dataclass(frozen=True)
class SharedKVSpec(KVCacheSpec):
    """A layer that caches nothing of its own: it attends over the K/V that an earlier layer of the same model
    writes, ``source`` (that layer's index among the specs; a layer with a cache of its own and the same mask),
    Gemma 4's KV-shared layers. It takes no memory: :class:`KVCache` hands it the source's view, and slot moves and
    snapshots go through the source."""

    source: int

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 0


# vLLM's kv_cache_dtype: "auto" keeps the model's dtype; the others store each K/V value in one byte, in that FP8
# format (divided by the checkpoint's K/V scale, else 1; values past its range clamped to it), and attention reads
# them back into the model's dtype
FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def fp8_format(kv_cache_dtype: str) -> torch.dtype | None:
    """The FP8 format of a ``kv_cache_dtype`` ("auto": None, the model's own dtype)."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype not in FP8_FORMATS:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be 'auto' or one of {list(FP8_FORMATS)}")
    return FP8_FORMATS[kv_cache_dtype]


def storage_dtype(dtype: torch.dtype, fp8: torch.dtype | None) -> torch.dtype:
    """What a cache of ``dtype`` values holds: bytes (uint8) for an FP8 cache, whose values index and move as
    plain bytes and are viewed as ``fp8`` only to convert."""
    return dtype if fp8 is None else torch.uint8


def bytes_per_block(specs: list[KVCacheSpec], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over every layer of ``specs``: the unit a rank's memory budget is divided by."""
    return sum(spec.bytes_per_block(block_size, dtype) for spec in specs)


class HasKVCache(Protocol):
    dtype: torch.dtype
    device: torch.device

    def kv_cache_specs(self) -> list[KVCacheSpec]: ...

    def bind_kv_cache(self, cache: "KVCache") -> None: ...


def fresh_tail_blocks(query_lens: list[int], starts: list[int], tables: list[list[int]], block_size: int
                      ) -> list[int]:
    """The blocks a step writes first and only in part: each sequence's last written slot's block where the step
    also writes its first slot and not its last. Their slots past the step's hold what an earlier owner of the
    block wrote; a path that reads whole blocks (the short batch's gather) masks them out, but a masked key's weight
    0 times a NaN left there is NaN, so one request's non-finite K/V would spread to later requests through its
    freed blocks. Zeroed before the step stores (:meth:`KVCache.zero_blocks`), every slot a sequence's blocks hold
    is its own or 0: a block's first slot is written by the first step that reaches it."""
    out = []
    for q_len, start, table in zip(query_lens, starts, tables):
        last = start + q_len - 1
        if last - last % block_size >= start and last % block_size != block_size - 1:
            out.append(table[last // block_size])
    return out


class KVCache:
    """Every layer's paged cache on one rank: one zeroed tensor ``[layers_in_group, *spec.shape(slots)]`` per
    group of layers with equal slot shapes (masked-out slots must hold finite values), and one view per layer.
    ``fp8``: the values are stored in that FP8 format, as bytes (see :func:`storage_dtype`)."""

    def __init__(self, specs: list[KVCacheSpec], num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, fp8: torch.dtype | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"allocate_kv_cache(num_blocks={num_blocks}, block_size={block_size}): both must be >= 1")
        self.specs = list(specs)
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.fp8 = fp8
        self.storage_dtype = storage_dtype(dtype, fp8)
        self.num_slots = num_blocks * block_size
        groups: dict[tuple, list[int]] = {}
        for i, spec in enumerate(self.specs):
            if isinstance(spec, SharedKVSpec):
                assert 0 <= spec.source < i and not isinstance(self.specs[spec.source], SharedKVSpec), (i, spec)
                continue  # the source's view, below
            groups.setdefault((spec.slot_shape, spec.slot_dim), []).append(i)
        self._groups: list[tuple[torch.Tensor, int, list[int]]] = []  # (tensor, slot dim in it, layer ids)
        self._views: list[torch.Tensor] = [torch.empty(0)] * len(self.specs)
        for (_, slot_dim), layers in groups.items():
            shape = self.specs[layers[0]].shape(self.num_slots)
            tensor = torch.zeros((len(layers), *shape), dtype=self.storage_dtype, device=device)
            self._groups.append((tensor, slot_dim + 1, layers))
            for j, layer in enumerate(layers):
                self._views[layer] = tensor[j]
        for i, spec in enumerate(self.specs):
            if isinstance(spec, SharedKVSpec):
                self._views[i] = self._views[spec.source]

    @property
    def num_layers(self) -> int:
        return len(self.specs)

    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i``'s cache, a view: ``spec.shape(num_slots)``."""
        return self._views[i]

    def bytes_per_block(self) -> int:
        return bytes_per_block(self.specs, self.block_size, self.storage_dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move every layer's cached values at slots ``src`` [n] to slots ``dst`` [n] (int64, on the cache's
        device): all sources are read before any destination is written, so the two may overlap."""
        for tensor, dim, _ in self._groups:
            tensor.index_copy_(dim, dst, tensor.index_select(dim, src))

    def zero_blocks(self, blocks: list[int]) -> None:
        """Zero every layer's slots of ``blocks`` (a step's first write into them; see :func:`fresh_tail_blocks`)."""
        if not blocks or not self._groups:
            return
        device = self._groups[0][0].device
        index = torch.tensor(blocks, dtype=torch.long, device=device)
        for tensor, dim, _ in self._groups:
            tensor.unflatten(dim, (self.num_blocks, self.block_size)).index_fill_(dim, index, 0)

    def snapshot(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """A copy of every layer's values at ``slots`` [n]: per layer, ``spec.shape(n)`` (for tests and
        debugging)."""
        out: list[torch.Tensor] = [torch.empty(0)] * self.num_layers
        for tensor, dim, layers in self._groups:
            picked = tensor.index_select(dim, slots.to(tensor.device))
            for j, layer in enumerate(layers):
                out[layer] = picked[j]
        for i, spec in enumerate(self.specs):
            if isinstance(spec, SharedKVSpec):
                out[i] = out[spec.source]
        return out


def allocate_kv_cache(model: HasKVCache, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto") -> KVCache:
    """A cache of ``num_blocks`` blocks for ``model``'s layers, in its dtype (or an FP8 format: ``kv_cache_dtype``)
    and on its device, bound to them. The caller owns it (the model runner, a drafter, a test)."""
    cache = KVCache(model.kv_cache_specs(), num_blocks, block_size, model.dtype, model.device,
                    fp8_format(kv_cache_dtype))
    model.bind_kv_cache(cache)
    return cache


# ---- recurrent state (linear-attention layers: Gated DeltaNet) ---------------------------------------------------
#
# Not paged: slots per running request, assigned by the runner (workers/model_runner.RecurrentSlots). A slot holds
# what the layer carries from one token to the next, as of the request's last committed token, plus the inputs of
# the drafts its last verify chunk brought (``max_pending`` rows), which the request's next chunk replays over the
# committed state for as many drafts as were accepted (the plan's next start position says how many).
#
# The runner gives each request two slots (``SLOTS_PER_REQUEST``): a step reads the one holding the committed state
# and writes the other, which becomes the committed one only once the whole step succeeded. A step that fails part
# way (one request's bad input, a drafter's error) thus leaves every request's state as it was, and the engine's retry
# without the failing request runs the others correctly; the step before can also be taken back once, for a retry
# after a failure outside the runner (another rank's, the executor's). Weighed against the alternatives: staging a
# step's new states and copying them in after it, or snapshotting the touched slots before it, cost a second copy of
# the touched slots' matrices too (transient, every layer's at once, which no budget accounts for) and, the snapshot,
# one more read and write of them per step; two slots cost no copy at all (a step already reads its slots into a
# scratch tensor and writes them back) and their memory is counted in the KV budget (``recurrent_bytes``).
SLOTS_PER_REQUEST = 2
# One more slot past the requests' (the last): a graph step's padding sequences read and write it (zeros in, whatever
# out), as its padding rows write the paged cache's scratch blocks; no request owns it. Counted in the budget too.
SCRATCH_SLOTS = 1


# vLLM's mamba_ssm_cache_dtype: the dtype the recurrent matrices are kept in between steps (the math is float32
# either way). "auto": the model config's own ``mamba_ssm_cache_dtype`` (Nemotron-H's field) where it names one, else
# float32, since the matrix sums every token a request has seen and a half type rounds each step's sum; a half type
# halves the state's memory (and its snapshots') at that accuracy.
SSM_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def ssm_cache_dtype(name: str, config=None) -> torch.dtype:
    """The recurrent matrices' dtype for the engine's ``mamba_ssm_cache_dtype`` ``name`` and the model's config."""
    if name == "auto":
        name = str(getattr(config, "mamba_ssm_cache_dtype", None) or "float32").removeprefix("torch.")
        if name not in SSM_CACHE_DTYPES:
            raise ValueError(f"the model config's mamba_ssm_cache_dtype={name!r} is not one of "
                             f"{list(SSM_CACHE_DTYPES)}; set the engine's mamba_ssm_cache_dtype to one of them")
    if name not in SSM_CACHE_DTYPES:
        raise ValueError(f"mamba_ssm_cache_dtype={name!r} must be 'auto' or one of {list(SSM_CACHE_DTYPES)}")
    return SSM_CACHE_DTYPES[name]


@dataclass(frozen=True)
class RecurrentStateSpec:
    """What one linear-attention layer keeps per request on this rank: its causal conv's last ``conv_width`` inputs
    (``conv_dim`` channels, the model's dtype) and a ``[num_heads, key_dim, value_dim]`` matrix (float32 unless
    ``mamba_ssm_cache_dtype`` says otherwise: :func:`ssm_cache_dtype`). Replay needs, per pending draft, its conv
    input (``conv_dim``) and its decay and update strength (``num_heads`` each, float32)."""

    conv_dim: int
    conv_width: int
    num_heads: int
    key_dim: int
    value_dim: int

    def bytes_per_slot(self, dtype: torch.dtype, max_pending: int, state_dtype: torch.dtype = torch.float32) -> int:
        conv = (self.conv_width + max_pending) * self.conv_dim * dtype.itemsize
        matrix = self.num_heads * self.key_dim * self.value_dim * state_dtype.itemsize
        return conv + matrix + max_pending * 2 * self.num_heads * 4


def recurrent_bytes(specs: list[RecurrentStateSpec], num_requests: int, dtype: torch.dtype, max_pending: int,
                    snapshots: int = 0, state_dtype: torch.dtype = torch.float32) -> int:
    """Bytes the recurrent state of every layer of ``specs`` takes for ``num_requests`` requests (their
    ``SLOTS_PER_REQUEST`` slots each, and the ``SCRATCH_SLOTS``) and ``snapshots`` kept states (prefix caching),
    its matrices in ``state_dtype``."""
    slots = num_requests * SLOTS_PER_REQUEST + SCRATCH_SLOTS + snapshots
    return slots * sum(spec.bytes_per_slot(dtype, max_pending, state_dtype) for spec in specs)


@dataclass
class RecurrentLayerState:
    """One layer's views: ``inputs`` [slots, conv_width + max_pending, conv_dim] (rows before ``conv_width``: the
    conv's committed history, oldest first; then the pending drafts' inputs), ``gates`` [slots, max_pending, 2,
    heads] float32 (each pending draft's log decay g and strength beta), ``matrix`` [slots, heads, key_dim,
    value_dim] (float32, or the engine's ``mamba_ssm_cache_dtype``: layers read it as float32 and round what they
    write back)."""

    inputs: torch.Tensor
    gates: torch.Tensor
    matrix: torch.Tensor

    @property
    def max_pending(self) -> int:
        return self.gates.shape[1]


class RecurrentState:
    """Every linear-attention layer's state on one rank, in ``num_slots`` slots (the runner gives each request
    ``SLOTS_PER_REQUEST`` and keeps ``SCRATCH_SLOTS`` for graph steps' padding), zeroed; the runner owns it and binds
    a model to it (``bind_recurrent_state``)."""

    def __init__(self, specs: list[RecurrentStateSpec], num_slots: int, max_pending: int, dtype: torch.dtype,
                 device: torch.device | str, state_dtype: torch.dtype = torch.float32):
        if num_slots < 1:
            raise ValueError(f"a recurrent state needs at least one slot (max_num_seqs), got {num_slots}")
        self.specs, self.num_slots, self.max_pending = list(specs), num_slots, max_pending
        self.layers = [RecurrentLayerState(
            torch.zeros(num_slots, s.conv_width + max_pending, s.conv_dim, dtype=dtype, device=device),
            torch.zeros(num_slots, max_pending, 2, s.num_heads, dtype=torch.float32, device=device),
            torch.zeros(num_slots, s.num_heads, s.key_dim, s.value_dim, dtype=state_dtype, device=device))
            for s in self.specs]

    def layer(self, i: int) -> RecurrentLayerState:
        return self.layers[i]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.layers for t in (s.inputs, s.gates, s.matrix))

    def move_pending(self, src: list[tuple[int, int]], dst: list[tuple[int, int]]) -> None:
        """Pending draft rows (slot, draft index) ``src`` copied to ``dst`` in every layer (a token tree's accepted
        path into path order); all sources are read before any destination is written."""
        if not src:
            return
        for layer in self.layers:
            width = layer.inputs.shape[1] - layer.gates.shape[1]  # the conv history's rows come first
            inputs = [layer.inputs[s, width + i].clone() for s, i in src]
            gates = [layer.gates[s, i].clone() for s, i in src]
            for (s, i), row, gate in zip(dst, inputs, gates):
                layer.inputs[s, width + i] = row
                layer.gates[s, i] = gate

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Every layer's state in slots ``src`` copied into slots ``dst`` (a kept snapshot and a request's slot, either
        way); all sources are read before any destination is written."""
        if not src:
            return
        device = self.layers[0].matrix.device
        src_t, dst_t = (torch.tensor(x, dtype=torch.long, device=device) for x in (src, dst))
        for layer in self.layers:
            for t in (layer.inputs, layer.gates, layer.matrix):
                t.index_copy_(0, dst_t, t.index_select(0, src_t))


def allocate_recurrent_state(model, num_slots: int, max_pending: int,
                             state_dtype: torch.dtype = torch.float32) -> RecurrentState | None:
    """The recurrent state of ``model``'s linear-attention layers (None for a model without any), bound to them,
    their matrices in ``state_dtype``."""
    specs = getattr(model, "recurrent_state_specs", lambda: [])()
    if not specs:
        return None
    state = RecurrentState(specs, num_slots, max_pending, model.dtype, model.device, state_dtype)
    model.bind_recurrent_state(state)
    return state
