"""A GGUF's 4-bit linears and experts kept in 4 bits through its conversion into an HF folder, so that a model of a
Q4 file takes about a quarter of bf16's memory where the device keeps 4-bit weights (:mod:`specray.models.int_quant`;
a mixture's experts: :class:`~specray.models.moe.SparseMoE`) and about a fifth of float32's disk in the cache.

llama.cpp's 4-bit types give each run of 32 columns of a row its own scale:

* Q4_0, blocks of 32: d (f16), then 16 bytes, byte j holding column j in its low bits and j + 16 in its high:
  ``W = d (q - 8)``;
* Q4_1: d and m (f16), then the same 16 bytes: ``W = d q + m``;
* Q4_K, super-blocks of 256: d and dmin (f16), 12 bytes packing eight 6-bit scales ``sc`` and mins ``mn``, then
  128 bytes, the 32 bytes of each 64-column chunk c holding sub-block 2c in their low bits and 2c + 1 in their
  high: ``W = (d sc) q - (dmin mn)``.

Each is ``W = (q - z) s + offset`` per group of 32 columns with z = 8 or 0, an :class:`IntWeight` with offsets, and
dequantizes (float32) to gguf-py's values bit for bit.

The conversion reads a file through transformers' tensor processors or our own readers, which permute rows
(llama.cpp's q/k RoPE order undone), split or join them, but change no value of a row they keep. So a converted
linear's weight whose every row is a row of the file's 4-bit tensors (looked up by a hash of its float32 bits:
:class:`RowIndex`; a block's fused experts, [E, rows, cols], as their rows one expert after another) is stored as
those rows' integers, scales and offsets, once they are checked to dequantize to the converted weight exactly (fused
experts one expert's projection at a time, as a checkpoint with a tensor per expert names them); any other tensor
(one a reader changed, an 8-bit, 5-bit or 6-bit one, embeddings, norms) is stored dense as before.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import torch

from specray.models.int_quant import GGUF_GROUP, IntWeight

logger = logging.getLogger(__name__)

KEPT_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # llama.cpp's types kept in 4 bits
# the converted tensors that may be kept: a decoder layer's projections (the model's linears) and its experts' (one
# expert's, or all of a block's fused in 3-D)
_KEPT_NAME = re.compile(r"\.layers\.(\d+)\.(?:.*\.)?(?:\w+_proj\.weight|experts\.\d+\.\w+\.weight|"
                        r"experts\.(?:gate_up_proj|up_proj|down_proj))$")
# a block's experts fused (transformers' names: [E, 2I, H], [E, I, H], [E, H, I]), stored one expert at a time
_FUSED_EXPERTS = re.compile(r"\.(?:mlp|feed_forward)\.experts\.(gate_up_proj|up_proj|down_proj)$")
_ROWS_AT_ONCE = 4096  # rows hashed or unpacked at a time: bounds the int64 copies they take


def keeps_name(name: str, layers: int) -> bool:
    """Whether converted tensor ``name`` is a linear of one of the model's ``layers`` decoder layers, or its experts'
    (an MTP layer's, after them, is not: its drafter loads it)."""
    found = _KEPT_NAME.search(name)
    return found is not None and int(found.group(1)) < layers


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


def unpack(raw: torch.Tensor, type_name: str) -> IntWeight:
    """Rows of a 4-bit tensor as the file stores them (``raw`` [rows, bytes], uint8) -> an IntWeight [rows, cols]."""
    rows = raw.shape[0]
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
    """Every row of a GGUF's 2-D 4-bit tensors (gguf-py's reader tensors), found by the hash of its dequantized
    values; :meth:`match` gives a converted weight back as those rows' integers."""

    def __init__(self, tensors: list[Any]):
        self.tensors = [t for t in tensors if t.tensor_type.name in KEPT_TYPES and len(t.shape) in (2, 3)]
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
        4-bit rows it is made of, checked to dequantize to ``w`` exactly; None where any row is not one of them."""
        if not len(self) or w.dim() not in (2, 3) or w.dtype != torch.float32 or w.shape[-1] % GGUF_GROUP:
            return None
        w = w.reshape(-1, w.shape[-1])
        h = row_hashes(w)
        pos = torch.searchsorted(self.hashes, h).clamp(max=len(self) - 1)
        if not torch.equal(self.hashes[pos], h):
            return None
        sources, rows = self.sources[pos], self.rows[pos]
        n, cols = w.shape
        q = torch.empty(n, cols, dtype=torch.uint8)
        scale, zero, offset = (torch.empty(n, cols // GGUF_GROUP) for _ in range(3))
        for source in sources.unique().tolist():
            t = self.tensors[source]
            if int(t.shape[0]) != cols:
                return None
            mine = (sources == source).nonzero().squeeze(1)
            part = unpack(torch.from_numpy(np.array(_rows(t)[rows[mine].numpy()])), t.tensor_type.name)
            q[mine], scale[mine], zero[mine], offset[mine] = part.q, part.scale, part.zero, part.offset
        kept = IntWeight(q, scale, zero, GGUF_GROUP, 4, offset)
        for i in range(0, n, _ROWS_AT_ONCE):  # a chunk at a time: no float32 copy of a whole block's experts
            if not torch.equal(kept.rows(i, min(_ROWS_AT_ONCE, n - i)).dense(), w[i: i + _ROWS_AT_ONCE]):
                return None
        return kept


def _rows(t: Any) -> np.ndarray:
    """A reader tensor's blocks, one row of the weight per row (a 3-D one's experts after one another)."""
    return t.data.reshape(-1, t.data.shape[-1])
