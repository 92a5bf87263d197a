"""A GGUF's linears and experts kept as integers through its conversion into an HF folder: the 4-bit ones in 4 bits,
so that a model of a Q4 file takes about a quarter of bf16's memory where the device keeps 4-bit weights
(:mod:`specray.models.int_quant`; a mixture's experts: :class:`~specray.models.moe.SparseMoE`) and about a fifth of
float32's disk in the cache; the 5-, 6- and 8-bit ones (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0: :func:`_unpack_bytes`) a byte
per value, about a third of float32's disk, dequantized as they load.

llama.cpp's 4-bit types give each run of 32 columns of a row its own scale:

* Q4_0, blocks of 32: d (f16), then 16 bytes, byte j holding column j in its low bits and j + 16 in its high:
  ``W = d (q - 8)``;
* Q4_1: d and m (f16), then the same 16 bytes: ``W = d q + m``;
* Q4_K, super-blocks of 256: d and dmin (f16), 12 bytes packing eight 6-bit scales ``sc`` and mins ``mn``, then
  128 bytes, the 32 bytes of each 64-column chunk c holding sub-block 2c in their low bits and 2c + 1 in their
  high: ``W = (d sc) q - (dmin mn)``.

Each is ``W = (q - z) s + offset`` per group of 32 columns (Q6_K: 16) with z = 8 or 0 (Q5_0: 16, Q6_K: 32, Q8_0:
128), an :class:`IntWeight` with offsets, and dequantizes (float32) to gguf-py's values bit for bit.

The conversion reads a file through transformers' tensor processors or our own readers, which permute rows
(llama.cpp's q/k RoPE order undone), split or join them, but change no value of a row they keep. So a converted
linear's weight whose every row is a row of the file's integer tensors (looked up by a hash of its float32 bits:
:class:`RowIndex`; a block's fused experts, [E, rows, cols], as their rows one expert after another) is stored as
those rows' integers, scales and offsets, once they are checked to dequantize to the converted weight exactly (fused
experts one expert's projection at a time, as a checkpoint with a tensor per expert names them); any other tensor
(one a reader changed, one of rows of several widths or groups, of another type: F16, the ternary and IQ types;
embeddings, norms) is stored dense as before.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from specray.models.int_quant import GGUF_GROUP, IntWeight

KEPT_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")  # llama.cpp's types kept as integers
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # those a device may keep in 4 bits (the others: a byte per value)
# the converted tensors that may be kept: a decoder layer's weights but its norms' (its linears, a router llama.cpp
# quantized; 1-D ones never match) and its experts' (one expert's, or all of a block's fused in 3-D); a layer named
# ``layers.N`` or, as the classic GPT families' checkpoints name theirs, ``h.N`` (GPT-2, Falcon, BLOOM, StarCoder) or
# ``blocks.N`` (MPT)
_KEPT_NAME = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.(?!.*norm)(?:.*\.)?"
                        r"(?:\w+\.weight|experts\.(?:gate_up_proj|up_proj|down_proj))$")
# a block's experts fused (transformers' names: [E, 2I, H], [E, I, H], [E, H, I]), stored one expert at a time
_FUSED_EXPERTS = re.compile(r"\.(?:mlp|feed_forward)\.experts\.(gate_up_proj|up_proj|down_proj)$")
_ROWS_AT_ONCE = 4096  # rows hashed or unpacked at a time: bounds the int64 copies they take


def keeps_name(name: str, layers: int, dims: int = 2) -> bool:
    """Whether converted tensor ``name`` of ``dims`` dimensions is a weight of one of the model's ``layers`` decoder
    layers (its linears, its experts'; not its norms'), which its loader reads as it reads a checkpoint's slices (an
    MTP layer's, after them, is not: its drafter loads it); a 3-D one only as a block's fused experts
    (:func:`stored_weights` stores those one expert at a time; another stacking, Granite's ``input_linear``, stays
    dense)."""
    found = _KEPT_NAME.search(name)
    if found is None or int(found.group(1)) >= layers or dims not in (2, 3):
        return False
    return dims == 2 or _FUSED_EXPERTS.search(name) is not None


def stored_weights(name: str, shape: tuple[int, ...], w: IntWeight) -> list[tuple[str, IntWeight]]:
    """Converted tensor ``name`` of ``shape``, found as ``w`` (its rows, experts after one another for a 3-D one),
    as the 2-D weights it is stored as: itself, or a block's fused experts one expert's projection at a time, under
    the names one expert's take (``experts.3.gate_proj.weight``): gate rows, then up rows. (The one family whose
    fused gate/up interleaves them, GPT-OSS, stores it inputs first, [E, H, 2I]: rows no file row equals, never
    found.)"""
    if len(shape) == 2:
        return [(name, w)]
    found = _FUSED_EXPERTS.search(name)
    assert found and len(shape) == 3, name
    base, kind = name[: found.start(1)], found.group(1)
    experts, rows = shape[0], shape[1]
    out = []
    for e in range(experts):
        mine = w.rows(e * rows, rows)
        if kind == "gate_up_proj":
            out += [(f"{base}{e}.gate_proj.weight", mine.rows(0, rows // 2)),
                    (f"{base}{e}.up_proj.weight", mine.rows(rows // 2, rows // 2))]
        else:
            out.append((f"{base}{e}.{kind}.weight", mine))
    return out


def _f16(pair: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes of a little-endian float16 -> [...] float32."""
    return pair.contiguous().view(torch.float16).squeeze(-1).float()


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the n low 4-bit values, then the n high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits32(raw: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes of a little-endian uint32 -> its 32 bits [..., 32] (uint8), the lowest first."""
    word = raw.to(torch.int64)
    word = word[..., 0] | word[..., 1] << 8 | word[..., 2] << 16 | word[..., 3] << 24
    return ((word.unsqueeze(-1) >> torch.arange(32)) & 1).to(torch.uint8)


def unpack(raw: torch.Tensor, type_name: str) -> IntWeight:
    """Rows of a tensor of one of ``KEPT_TYPES`` as the file stores them (``raw`` [rows, bytes], uint8) -> an
    IntWeight [rows, cols]: 4 bits for ``FOUR_BIT_TYPES``, else 8 (a byte per value)."""
    rows = raw.shape[0]
    if type_name not in FOUR_BIT_TYPES:
        return _unpack_bytes(raw, type_name)
    if type_name == "Q4_K":
        blocks = raw.reshape(rows, -1, 144)
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [rows, supers]
        a, b, c = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
        # sub-blocks 0-3: a's and b's low 6 bits; 4-7: c's low (scales) or high (mins) nibble, topped by the high
        # 2 bits of a (scales) or b (mins)
        sc = torch.cat([a & 63, (c & 15) | ((a >> 2) & 48)], dim=-1)  # [rows, supers, 8]
        mn = torch.cat([b & 63, (c >> 4) | ((b >> 2) & 48)], dim=-1)
        q = _low_high(blocks[..., 16:].reshape(rows, -1, 4, 32))  # [rows, supers, chunk, 64]
        scale = (d.unsqueeze(-1) * sc.float()).reshape(rows, -1)
        offset = -(dmin.unsqueeze(-1) * mn.float()).reshape(rows, -1)
        zero = torch.zeros_like(scale)
    else:
        width = {"Q4_0": 18, "Q4_1": 20}[type_name]
        blocks = raw.reshape(rows, -1, width)
        scale = _f16(blocks[..., 0:2])
        q = _low_high(blocks[..., width - 16:])  # [rows, blocks, 32]
        if type_name == "Q4_0":
            zero, offset = torch.full_like(scale, 8.0), torch.zeros_like(scale)
        else:
            zero, offset = torch.zeros_like(scale), _f16(blocks[..., 2:4])
    return IntWeight(q.reshape(rows, -1).contiguous(), scale, zero, GGUF_GROUP, 4, offset)


def _unpack_bytes(raw: torch.Tensor, type_name: str) -> IntWeight:
    """:func:`unpack` of the types of more than 4 bits, each value a byte.

    * Q8_0, blocks of 32: d (f16), 32 int8 x: ``W = x d`` (stored x + 128, z = 128);
    * Q5_0 / Q5_1, blocks of 32: d (and m, Q5_1's), a uint32 of each value's 5th bit, Q4's 16 bytes of low 4 bits:
      ``W = d (q - 16)`` / ``W = d q + m``;
    * Q5_K, super-blocks of 256: Q4_K's d, dmin and 6-bit scales and mins, then 32 bytes whose bit j is the 5th bit of
      sub-block j, then Q4_K's 128 bytes of low 4 bits: ``W = (d sc) q - (dmin mn)``;
    * Q6_K, super-blocks of 256 in 16 groups of 16: 128 bytes of low 4 bits, 64 of high 2, 16 int8 scales, d:
      ``W = (d sc) (q - 32)``."""
    rows = raw.shape[0]
    if type_name == "Q8_0":
        blocks = raw.reshape(rows, -1, 34)
        scale = _f16(blocks[..., 0:2])
        q = (blocks[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        zero, offset = torch.full_like(scale, 128.0), torch.zeros_like(scale)
    elif type_name in ("Q5_0", "Q5_1"):
        width = 22 if type_name == "Q5_0" else 24
        blocks = raw.reshape(rows, -1, width)
        scale = _f16(blocks[..., 0:2])
        q = _low_high(blocks[..., width - 16:]) | _bits32(blocks[..., width - 20: width - 16]) << 4
        if type_name == "Q5_0":
            zero, offset = torch.full_like(scale, 16.0), torch.zeros_like(scale)
        else:
            zero, offset = torch.zeros_like(scale), _f16(blocks[..., 2:4])
    elif type_name == "Q5_K":
        blocks = raw.reshape(rows, -1, 176)
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        a, b, c = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
        sc = torch.cat([a & 63, (c & 15) | ((a >> 2) & 48)], dim=-1)  # Q4_K's packing
        mn = torch.cat([b & 63, (c >> 4) | ((b >> 2) & 48)], dim=-1)
        high = (blocks[..., 16:48].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1  # [.., 8, 32]
        low = _low_high(blocks[..., 48:].reshape(rows, -1, 4, 32)).reshape(*high.shape)
        q = low | high << 4
        scale = (d.unsqueeze(-1) * sc.float()).reshape(rows, -1)
        offset = -(dmin.unsqueeze(-1) * mn.float()).reshape(rows, -1)
        zero = torch.zeros_like(scale)
    else:
        assert type_name == "Q6_K", type_name  # (RowIndex takes KEPT_TYPES alone)
        blocks = raw.reshape(rows, -1, 210)
        supers = blocks.shape[1]
        low = (blocks[..., :128].reshape(rows, supers, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8)
               .view(2, 1)) & 15  # [.., half, 2, 64]: a half's 64 bytes' low then high nibbles
        high = (blocks[..., 128:192].reshape(rows, supers, 2, 1, 32)
                >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3  # [.., half, 4, 32]
        q = low.reshape(rows, supers, 2, 4, 32) | high << 4
        d = _f16(blocks[..., 208:210])
        scale = (d.unsqueeze(-1) * blocks[..., 192:208].view(torch.int8).float()).reshape(rows, -1)
        zero, offset = torch.full_like(scale, 32.0), torch.zeros_like(scale)
    return IntWeight(q.reshape(rows, -1).contiguous(), scale.reshape(rows, -1).contiguous(),
                     zero.reshape(rows, -1).contiguous(), 16 if type_name == "Q6_K" else GGUF_GROUP, 8,
                     offset.reshape(rows, -1).contiguous())


_COEFFICIENTS: dict[int, torch.Tensor] = {}


def row_hashes(w: torch.Tensor) -> torch.Tensor:
    """[rows, cols] float32 -> [rows] int64: a hash of each row's bits (a sum of them times fixed odd numbers,
    wrapping: the same for equal rows whatever the order of the sum; -0.0 hashed as 0.0, which it equals)."""
    rows, cols = w.shape
    if not rows:
        return torch.zeros(0, dtype=torch.long)
    if cols not in _COEFFICIENTS:
        gen = torch.Generator().manual_seed(cols)
        _COEFFICIENTS[cols] = torch.randint(-(1 << 62), 1 << 62, (cols,), generator=gen) * 2 + 1
    coef = _COEFFICIENTS[cols]
    w = w.contiguous()
    return torch.cat([((w[i: i + _ROWS_AT_ONCE] + 0.0).view(torch.int32).long() * coef).sum(1)  # -0.0 + 0.0: 0.0
                      for i in range(0, rows, _ROWS_AT_ONCE)])


class RowIndex:
    """Every row of a GGUF's integer tensors of ``KEPT_TYPES`` (gguf-py's reader tensors; 2-D, or stacked experts),
    found by the hash of its dequantized values; :meth:`match` gives a converted weight back as those rows'
    integers."""

    def __init__(self, tensors: list[Any]):
        self.tensors = [t for t in tensors if t.tensor_type.name in KEPT_TYPES and len(t.shape) in (2, 3)
                        and t.name.startswith("blk.")]  # (a layer's: the embeddings and head are never kept)
        hashes, sources, rows = [], [], []
        for i, t in enumerate(self.tensors):
            raw = _rows(t)
            for start in range(0, raw.shape[0], _ROWS_AT_ONCE):
                part = unpack(torch.from_numpy(np.array(raw[start: start + _ROWS_AT_ONCE])), t.tensor_type.name)
                hashes.append(row_hashes(part.dense()))
                sources.append(torch.full((part.q.shape[0],), i, dtype=torch.int32))
                rows.append(torch.arange(start, start + part.q.shape[0]))
        self.hashes, order = torch.cat(hashes).sort() if hashes else (torch.zeros(0, dtype=torch.long), None)
        self.sources = torch.cat(sources)[order] if hashes else None
        self.rows = torch.cat(rows)[order] if hashes else None

    def __len__(self) -> int:
        return len(self.hashes)

    def match(self, w: torch.Tensor) -> IntWeight | None:
        """``w`` [rows, cols] (float32; [experts, rows, cols]: its experts' rows one after another) as the file's
        integer rows it is made of, checked to dequantize to ``w`` exactly; None where any row is not one of them,
        or they come from types of other widths or groups (one stored form per weight)."""
        if not len(self) or w.dim() not in (2, 3) or w.dtype != torch.float32:
            return None
        w = w.reshape(-1, w.shape[-1])
        h = row_hashes(w)
        pos = torch.searchsorted(self.hashes, h).clamp(max=len(self) - 1)
        if not torch.equal(self.hashes[pos], h):
            return None
        sources, rows = self.sources[pos], self.rows[pos]
        n, cols = w.shape
        parts = []
        for source in sources.unique().tolist():
            t = self.tensors[source]
            if int(t.shape[0]) != cols:
                return None
            mine = (sources == source).nonzero().squeeze(1)
            parts.append((mine, unpack(torch.from_numpy(np.array(_rows(t)[rows[mine].numpy()])), t.tensor_type.name)))
        if len({(part.bits, part.group_size) for _, part in parts}) != 1:
            return None
        like = parts[0][1]
        q = torch.empty(n, cols, dtype=torch.uint8)
        scale, zero, offset = (torch.empty(n, cols // like.group_size) for _ in range(3))
        for mine, part in parts:
            q[mine], scale[mine], zero[mine], offset[mine] = part.q, part.scale, part.zero, part.offset
        kept = IntWeight(q, scale, zero, like.group_size, like.bits, offset)
        for i in range(0, n, _ROWS_AT_ONCE):  # a chunk at a time: no float32 copy of a whole block's experts
            if not torch.equal(kept.rows(i, min(_ROWS_AT_ONCE, n - i)).dense(), w[i: i + _ROWS_AT_ONCE]):
                return None
        return kept


def _rows(t: Any) -> np.ndarray:
    """A reader tensor's blocks, one row of the weight per row (a 3-D one's experts after one another)."""
    return t.data.reshape(-1, t.data.shape[-1])
