"""Weight-only integer checkpoints, dequantized as they load: GPTQ (``quant_method: gptq``, AutoGPTQ's and
GPTQModel's ``-GPTQ`` / ``-Int4`` releases), AWQ (``quant_method: awq``, ``version: gemm``: AutoAWQ's ``-AWQ``
releases) and llm-compressor's packed integers (``quant_method: compressed-tensors``, ``format: pack-quantized``:
the ``-W4A16`` / ``-quantized.w4a16`` releases of RedHatAI and others).

Each quantized linear ``X`` of ``out`` rows and ``in`` columns stores b-bit integers q (b = 4 or 8), 32 / b of them
per int32, the first in the lowest bits, with one scale s (and, but for a symmetric scheme, one zero point z) per
group of ``group_size`` input columns and output row:

    W[o, i] = s[g(i), o] * (q[i, o] - z[g(i), o])

* GPTQ: ``X.qweight`` [in / p, out] packed along the input, ``X.qzeros`` [groups, out / p] packed along the output,
  ``X.scales`` [groups, out] and ``X.g_idx`` [in], the group of each input column (act-order checkpoints,
  ``desc_act``, permute it; without it, i // group_size). Its first format (``checkpoint_format: gptq``) stores
  z - 1, ``gptq_v2`` stores z.
* AWQ: ``X.qweight`` [in, out / 8] and ``X.qzeros`` [groups, out / 8], both packed along the output in AWQ's order
  (the int32's eight 4-bit slots hold columns 0, 2, 4, 6, 1, 3, 5, 7 of its eight), ``X.scales`` [groups, out].
* compressed-tensors' INT8 W8A8 (``format: int-quantized``: the ``-quantized.w8a8`` releases): ``X.weight`` [out, in]
  int8 with ``X.weight_scale`` (one per output row or per tensor), symmetric; the activations' scheme (per token,
  or a static ``X.input_scale``) is the matmul's: a device that keeps these linears in 8 bits quantizes each row of
  activations over its own scale (:mod:`specray.models.w8a8`), elsewhere they are dequantized as they load.
* compressed-tensors: ``X.weight_packed`` [out, in / p] packed along the input, ``X.weight_scale`` [out, groups]
  (one group: per output row), ``X.weight_shape`` [2] (the unpadded [out, in]); symmetric, z = 2^(b-1) (the signed
  values stored offset by it); an act-order ``X.weight_g_idx`` [in] groups the columns as GPTQ's does.

A GGUF's linears and experts of llama.cpp's integer types keep their integers through its conversion
(:mod:`specray.models.gguf_quant`; ``quant_method: specray_gguf``): ``X.q_weight`` (uint8: with ``X.q_bits`` 4, two
columns a byte, the even one in the low bits, [out, in / 2]; with 8, a byte per column, [out, in], values of up to 8
bits), ``X.q_scale`` and ``X.q_offset`` [out, groups] (float32) and ``X.q_zero`` [out, groups] (uint8), the groups runs
of in / groups columns: ``W = (q - z) * s + offset``, the arithmetic gguf-py dequantizes them by. The 4-bit ones (in
groups of 32) are what a device keeps in 4 bits; the others are dequantized as they load.

Each linear comes out as ``X.weight``, an :class:`IntWeight` (its integers unpacked, one byte each, with its groups'
scales and zero points) that reads as the dequantized float32 weight wherever a tensor is read (``w[...]``, as a
safetensors slice reads), or as that float32 weight itself for act-order groups, which are not runs of columns. A
tensor that is not part of a quantized linear (norms, embeddings, an unquantized head, biases) passes through
untouched.

Kept in 4 bits. The model's linears (:class:`~specray.models.layers.LinearBase`) built under
:func:`~specray.models.layers.int_linears` (``load_model`` does, for a 4-bit checkpoint whose groups torch's kernel
takes, on a device and dtype it runs) hold no dense weight: each stages its rank's integers as they load and then
keeps them packed for torch's 4-bit weight-only matmul (:class:`Int4Weight`: tinygemm on CUDA in bf16; on CPU its
kernel, only when ``cpu_kernels.INT4_WEIGHTS`` asks, being slow there), a quarter of bf16's bytes. tinygemm computes
``W = (q - 8) * s + m`` per group, so ``m = (8 - z) s`` holds a zero point z. A linear whose shape the kernel does not
take, or whose groups straddle its rank's columns, is dequantized instead; one the checkpoint left unquantized loads
its dense weight as any other.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from specray.config import DEQUANTIZE_INT4_ENV
from specray.models import cpu_kernels
from specray.models.w8a8 import INT8, row_scaled

COMPRESSED_TENSORS = "compressed-tensors"
AWQ_COLUMNS = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of an int32's eight sits in its slot AWQ_COLUMNS[c]
# each kind's tensors of one linear: the ones it needs, then the one it may have
_PARTS = {"gptq": (("qweight", "qzeros", "scales"), "g_idx"), "awq": (("qweight", "qzeros", "scales"), None),
          "packed": (("weight_packed", "weight_scale", "weight_shape"), "weight_g_idx"),
          "int8": (("weight", "weight_scale"), None),
          "gguf": (("q_weight", "q_scale", "q_zero", "q_offset", "q_bits"), None)}
GGUF_QUANT_METHOD = "specray_gguf"  # a converted GGUF's integer weights (specray.models.gguf_quant)
GGUF_GROUP = 32  # the columns of a Q4_0 / Q4_1 block, and of a Q4_K sub-block


@dataclass(frozen=True)
class IntScheme:
    """How a checkpoint's linears are quantized: the layout (``kind``: gptq, awq, packed or gguf), the bits per value,
    the input columns per group (-1: one group, a scale per output row) and what a GPTQ release adds to its stored
    zero points."""

    kind: str
    bits: int
    group_size: int
    zero_offset: int = 0
    act_order: bool = False  # groups scattered over the columns (g_idx): dequantized, never kept in 4 bits

    @property
    def per_int(self) -> int:
        return 32 // self.bits


def int_scheme(quant: dict | None) -> IntScheme | None:
    """The integer scheme of a config's ``quantization_config`` (``quant``); None for no quantization or another
    method (FP8: :mod:`specray.models.fp8`). An integer one specray cannot load is a ValueError naming the fix."""
    method = (quant or {}).get("quant_method")
    if method == "gptq":
        return _gptq(quant)
    if method == "awq":
        return _awq(quant)
    if method == COMPRESSED_TENSORS and quant.get("format") == "pack-quantized":
        return _packed(quant)
    if method == COMPRESSED_TENSORS and quant.get("format") == "int-quantized":
        return _int8(quant)
    if method == GGUF_QUANT_METHOD:
        return IntScheme("gguf", 4, GGUF_GROUP)
    return None


def gguf_quantization_config() -> dict:
    """The ``quantization_config`` of a converted GGUF whose weights kept their integers (the scheme's bits and
    groups: those a device may keep in 4 bits; each weight's own are in its ``q_bits`` and its groups' count)."""
    return {"quant_method": GGUF_QUANT_METHOD, "bits": 4, "group_size": GGUF_GROUP}


def gguf_parts(w: IntWeight) -> dict[str, torch.Tensor]:
    """A linear's tensors as a converted GGUF stores them (by name after ``X.``), which :func:`dequantize` reads: 4-bit
    values packed two a byte, others (``bits`` 8: values of up to 8 bits) a byte each."""
    assert w.bits in (4, 8) and (w.bits == 8 or w.q.shape[1] % 2 == 0)
    q = pack_nibbles(w.q) if w.bits == 4 else w.q.to(torch.uint8)
    return {"q_weight": q.contiguous(), "q_scale": w.scale.float().contiguous(),
            "q_zero": w.zero.to(torch.uint8).contiguous(), "q_offset": w.offsets().float().contiguous(),
            "q_bits": torch.tensor([w.bits], dtype=torch.uint8)}


def _refuse(what: str) -> ValueError:
    return ValueError(f"quantization_config: {what} is not supported; load a bf16 or fp16 version of the checkpoint")


def _bits(value: Any, allowed: tuple[int, ...], field: str) -> int:
    if value not in allowed:
        raise _refuse(f"{field}={value!r} (supported: {list(allowed)})")
    return int(value)


def _group(value: Any, field: str = "group_size") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not (value > 0 or value == -1):
        raise _refuse(f"{field}={value!r} (a positive number of input columns, or -1 for one group per row)")
    return value


def _gptq(quant: dict) -> IntScheme:
    fmt = quant.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"GPTQ checkpoint_format={fmt!r} (supported: 'gptq', 'gptq_v2')")
    return IntScheme("gptq", _bits(quant.get("bits"), (4, 8), "bits"), _group(quant.get("group_size", 128)),
                     1 if fmt == "gptq" else 0, bool(quant.get("desc_act")))


def _awq(quant: dict) -> IntScheme:
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(f"AWQ version={quant.get('version')!r} (supported: 'gemm')")
    if not quant.get("zero_point", True):
        raise _refuse("AWQ zero_point=false")
    bits = _bits(quant.get("bits", quant.get("w_bit")), (4,), "bits")
    return IntScheme("awq", bits, _group(quant.get("group_size", quant.get("q_group_size"))))


def _packed(quant: dict) -> IntScheme:
    schemes = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values()]
    if len(schemes) != 1:
        raise _refuse(f"compressed-tensors with {len(schemes)} weight schemes (one is supported)")
    w = schemes[0]
    if w.get("type", "int") != "int" or not w.get("symmetric", True):
        raise _refuse(f"compressed-tensors pack-quantized weights of type={w.get('type')!r}, "
                      f"symmetric={w.get('symmetric')!r} (symmetric integers are supported)")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise _refuse(f"compressed-tensors weight strategy={strategy!r} (supported: 'group', 'channel')")
    group = _group(w.get("group_size"), "weights.group_size") if strategy == "group" else -1
    return IntScheme("packed", _bits(w.get("num_bits"), (4, 8), "weights.num_bits"), group,
                     act_order=w.get("actorder") == "group")


def _int8(quant: dict) -> IntScheme:
    """compressed-tensors' INT8 W8A8: 8-bit symmetric integer weights, one scale per output row or per tensor."""
    schemes = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values()]
    if len(schemes) != 1:
        raise _refuse(f"compressed-tensors with {len(schemes)} weight schemes (one is supported)")
    w = schemes[0]
    if w.get("num_bits") != 8 or w.get("type", "int") != "int" or not w.get("symmetric", True) \
            or w.get("strategy") not in ("channel", "tensor"):
        fields = {k: w.get(k) for k in ("num_bits", "type", "symmetric", "strategy")}
        raise _refuse(f"compressed-tensors int-quantized weights {fields}, not 8-bit symmetric integers with one "
                      "scale per channel or per tensor,")
    return IntScheme("int8", 8, -1)


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 ``packed`` -> its 32 / bits values per entry spread along ``dim`` (the first from the lowest bits), as
    int32 in [0, 2^bits)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., p]: arithmetic shifts, masked
    values = values.movedim(-1, dim + 1)  # each entry's values right after its own axis
    shape = list(packed.shape)
    shape[dim] *= len(shifts)
    return values.reshape(shape)


class IntWeight:
    """One linear's integers ``q`` [out, in] (uint8, in [0, 2^bits)), with the scale and zero point [out, groups]
    (float32) of each run of ``group_size`` input columns, and, where given, an offset [out, groups] (float32; a
    GGUF's minimum: :mod:`specray.models.gguf_quant`): ``W = (q - z) * s (+ offset)``. Read like a safetensors slice
    (``get_shape()``, ``w[index]``: the dequantized float32 weight), so a loader that wants a dense weight gets one;
    :meth:`rows` and :meth:`cols` cut it without dequantizing."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, bits: int,
                 offset: torch.Tensor | None = None):
        self.q, self.scale, self.zero, self.group_size, self.bits = q, scale, zero, group_size, bits
        self.offset = offset

    def get_shape(self) -> list[int]:
        return list(self.q.shape)

    def get_dtype(self) -> str:
        return "F32"  # as a safetensors slice names the dtype it reads as

    def offsets(self) -> torch.Tensor:
        """The offsets [out, groups] (zeros where it has none)."""
        return torch.zeros_like(self.scale) if self.offset is None else self.offset

    def dense(self) -> torch.Tensor:
        w = (self.q.float() - self.zero.repeat_interleave(self.group_size, 1)) \
            * self.scale.repeat_interleave(self.group_size, 1)
        return w if self.offset is None else w + self.offset.repeat_interleave(self.group_size, 1)

    def __getitem__(self, index) -> torch.Tensor:
        return self.dense()[index]

    def rows(self, start: int, count: int) -> "IntWeight":
        cut = slice(start, start + count)
        return IntWeight(self.q[cut], self.scale[cut], self.zero[cut], self.group_size, self.bits,
                         None if self.offset is None else self.offset[cut])

    def cols(self, start: int, count: int) -> "IntWeight | None":
        """Input columns ``start .. start + count`` (None unless they are whole groups)."""
        g = self.group_size
        if start % g or count % g:
            return None
        groups = slice(start // g, (start + count) // g)
        return IntWeight(self.q[:, start: start + count], self.scale[:, groups], self.zero[:, groups], g, self.bits,
                         None if self.offset is None else self.offset[:, groups])

    def staging(self, rows: int, cols: int) -> "IntStaging":
        """Where a linear of [rows, cols] gathers its parts of this kind (:class:`IntStaging`)."""
        return IntStaging(rows, cols, self)


def dequantize(scheme: IntScheme, parts: dict[str, torch.Tensor], rows: bool = False) -> IntWeight | torch.Tensor:
    """One linear's ``X.weight`` [out, in] from its quantized tensors (``parts``, by name after ``X.``): an
    :class:`IntWeight`, or the float32 weight where act order scatters its groups over the columns (and for INT8
    W8A8; with ``rows``, a model that keeps those in 8 bits, a :class:`~specray.models.w8a8.RowScaled`)."""
    if scheme.kind == "int8":
        w = row_scaled(parts["weight"], parts["weight_scale"], INT8, parts.get("input_scale"))
        return w if rows else w.dense()
    if scheme.kind == "gguf":
        bits = int(parts["q_bits"].reshape(-1)[0])
        q = unpack_nibbles(parts["q_weight"]) if bits == 4 else parts["q_weight"]  # [out, in]
        s, z, offset = parts["q_scale"].float(), parts["q_zero"].float(), parts["q_offset"].float()
        if bits not in (4, 8) or q.shape[1] % s.shape[1] or not s.shape == z.shape == offset.shape:
            raise ValueError(f"converted GGUF linear of {tuple(q.shape)} {bits}-bit integers with scales "
                             f"{tuple(s.shape)}: the conversion is damaged; delete it from the cache "
                             "(SPECRAY_CACHE_DIR) to convert again")
        return IntWeight(q.contiguous(), s.contiguous(), z.contiguous(), q.shape[1] // s.shape[1], bits,
                         offset.contiguous())
    if scheme.kind == "packed":
        q = unpack(parts["weight_packed"], scheme.bits, 1)  # [out, in (padded)]
        out, cols = (int(v) for v in parts["weight_shape"].reshape(-1).tolist())
        q, s = q[:out, :cols], parts["weight_scale"].float()  # s [out, groups]
        z = torch.full_like(s, 1 << (scheme.bits - 1))
        return _weight(scheme, q, s, z, _groups(scheme, cols, s.shape[1], parts.get("weight_g_idx")))
    if scheme.kind == "awq":
        q = _awq_columns(unpack(parts["qweight"], scheme.bits, 1))  # [in, out]
        z = _awq_columns(unpack(parts["qzeros"], scheme.bits, 1))  # [groups, out]
        g = None
    else:
        q = unpack(parts["qweight"], scheme.bits, 0)  # [in, out]
        z = unpack(parts["qzeros"], scheme.bits, 1) + scheme.zero_offset
        g = parts.get("g_idx")
    s = parts["scales"].float()  # [groups, out]
    if q.shape[1] != s.shape[1] or z.shape != s.shape:
        raise ValueError(f"quantized weight of shape {tuple(q.shape)} (in, out) with scales {tuple(s.shape)} and "
                         f"zero points {tuple(z.shape)}: the checkpoint does not match its quantization_config")
    return _weight(scheme, q.t(), s.t(), z.t().float(), _groups(scheme, q.shape[0], s.shape[0], g))


def _weight(scheme: IntScheme, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, groups: torch.Tensor
            ) -> IntWeight | torch.Tensor:
    """q [out, in], s and z [out, groups], each column's group -> an IntWeight where the groups are runs of columns,
    else (act order) the float32 weight."""
    size = q.shape[1] // s.shape[1]
    if q.shape[1] == size * s.shape[1] and torch.equal(groups, torch.arange(q.shape[1]) // size):
        return IntWeight(q.to(torch.uint8).contiguous(), s.contiguous(), z.float().contiguous(), size, scheme.bits)
    return (q - z[:, groups]).float() * s[:, groups]


def _awq_columns(values: torch.Tensor) -> torch.Tensor:
    """[rows, 8n] in AWQ's slot order -> the columns in their own order."""
    rows, cols = values.shape
    order = torch.tensor(AWQ_COLUMNS, device=values.device)
    return values.view(rows, cols // 8, 8).index_select(2, order).view(rows, cols)


def _groups(scheme: IntScheme, columns: int, num_groups: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """The group of each of ``columns`` input columns: ``g_idx`` where given, else consecutive runs of
    ``group_size`` (one group: all of them)."""
    if g_idx is not None:
        groups = g_idx.long().reshape(-1)
    else:
        size = columns if scheme.group_size == -1 else scheme.group_size
        groups = torch.arange(columns) // size
    if groups.numel() != columns or int(groups.max()) >= num_groups:
        raise ValueError(f"{columns} input columns in groups of {scheme.group_size} do not fit the checkpoint's "
                         f"{num_groups} groups of scales: the checkpoint does not match its quantization_config")
    return groups


def dequantized(weights: Iterable[tuple[str, Any]], scheme: IntScheme, rows: bool = False, static: bool = False
                ) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) pairs with every quantized linear's tensors (in any order, from any file)
    replaced by its dequantized ``X.weight`` (``rows``: INT8 W8A8 weights kept, :func:`dequantize`, each with its
    static activation scale where the release has them, ``static``); other tensors pass through untouched (lazy
    slices stay lazy), but an INT8 checkpoint's activation scales that the matmuls do not use. A linear whose
    optional group index never came is dequantized at the end; one missing a needed tensor is a ValueError."""
    needed, optional = _PARTS[scheme.kind]
    inputs = scheme.kind == "int8" and rows and static  # each linear's static input_scale rounds its activations
    needed = (*needed, "input_scale") if inputs else needed
    suffixes = {f".{part}": part for part in (*needed, *filter(None, [optional]))}
    waiting: dict[str, dict[str, Any]] = {}
    for name, tensor in weights:
        if scheme.kind == "int8" and name.endswith((".input_zero_point", *(() if inputs else (".input_scale",)))):
            continue  # (each row of activations gets its own scale)
        if scheme.kind == "int8" and name.endswith(".weight") and not _is_int8(tensor):
            yield name, tensor  # a weight the checkpoint left in full precision (norms, embeddings, the head)
            continue
        base, part = _split(name, suffixes)
        if part is None:
            yield name, tensor
            continue
        held = waiting.setdefault(base, {})
        held[part] = tensor
        if all(p in held for p in needed) and (optional is None or optional in held):
            yield f"{base}.weight", dequantize(scheme, _materialized(waiting.pop(base)), rows)
    waiting = {base: held for base, held in waiting.items() if held.keys() != {"input_scale"}}  # (an unquantized one's)
    incomplete = {base: sorted(set(needed) - set(held)) for base, held in waiting.items() if set(needed) - set(held)}
    if incomplete:
        raise ValueError(f"quantized linears without all their tensors, e.g. {dict(list(incomplete.items())[:3])}: "
                         "the checkpoint is incomplete")
    for base, held in waiting.items():
        yield f"{base}.weight", dequantize(scheme, _materialized(held), rows)


def _is_int8(tensor: Any) -> bool:
    return tensor.dtype == torch.int8 if isinstance(tensor, torch.Tensor) else tensor.get_dtype() == "I8"


def _split(name: str, suffixes: dict[str, str]) -> tuple[str, str | None]:
    for suffix, part in suffixes.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], part
    return name, None


def _materialized(parts: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {part: t if isinstance(t, torch.Tensor) else t[...] for part, t in parts.items()}


# ---------------------------------------------------------------------------------------------- kept in 4 bits


class IntStaging:
    """A linear's integers as its parts load (a merged linear's each at its rows), on the host, until packed."""

    def __init__(self, rows: int, cols: int, like: IntWeight):
        g = like.group_size
        self.q = torch.zeros(rows, cols, dtype=torch.uint8)
        self.scale, self.zero = torch.zeros(rows, cols // g), torch.zeros(rows, cols // g)
        self.offset: torch.Tensor | None = None  # made when a part with offsets comes (zeros: as none)
        self.group_size, self.bits = g, like.bits

    def fits(self, w, offset: int) -> bool:
        return isinstance(w, IntWeight) and (w.group_size, w.bits) == (self.group_size, self.bits) \
            and w.q.shape[1] == self.q.shape[1]

    def put(self, offset: int, w: IntWeight) -> None:
        rows = slice(offset, offset + w.q.shape[0])
        self.q[rows], self.scale[rows], self.zero[rows] = w.q, w.scale, w.zero
        if w.offset is not None:
            if self.offset is None:
                self.offset = torch.zeros_like(self.scale)
            self.offset[rows] = w.offset

    def weight(self) -> IntWeight:
        return IntWeight(self.q, self.scale, self.zero, self.group_size, self.bits, self.offset)

    def dense(self) -> torch.Tensor:
        return self.weight().dense()

    def kept(self, device: torch.device, dtype: torch.dtype) -> "Int4Weight | None":
        return pack_int4(self.weight(), device, dtype)


INT4_GROUPS = (32, 64, 128, 256)  # the group sizes torch's 4-bit kernels take


def random_int4(rows: int, cols: int, group_size: int, limit: float, device: torch.device) -> IntWeight:
    """A random 4-bit weight [rows, cols] of values in [-limit, limit] (q uniform in 0..15 about a zero point of 8),
    made on ``device``: a dummy model's (``load_format="dummy"``) linear kept in 4 bits."""
    groups = -(-cols // group_size)
    q = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, device=device)
    scale = torch.full((rows, groups), limit / 8, device=device)
    return IntWeight(q, scale, torch.full_like(scale, 8.0), group_size, 4)


def keeps_int4(scheme: IntScheme | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model of ``dtype`` on ``device`` keeps a checkpoint of ``scheme`` in 4 bits: 4-bit runs of
    columns in groups torch's kernel takes, on CUDA in bf16 (tinygemm's one dtype), or on a CPU when asked to
    (:func:`specray.models.cpu_kernels.keeps_int4_weights`: its kernel is slow there); never with
    ``$SPECRAY_DEQUANTIZE_INT4`` set."""
    if scheme is None or scheme.bits != 4 or scheme.group_size not in INT4_GROUPS or scheme.act_order:
        return False
    if os.environ.get(DEQUANTIZE_INT4_ENV, "0") != "0":
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16
    return device.type == "cpu" and cpu_kernels.keeps_int4_weights() and dtype in (torch.float32, torch.bfloat16)


class Int4Weight(torch.nn.Module):
    """A linear's weight [N, K] kept in 4 bits for torch's weight-only matmul: ``packed`` in the device kernel's
    layout and ``scales_and_zeros`` [K / G, N, 2] (s and m = (8 - z) s per group, in the activations' dtype)."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int):
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.group_size = group_size

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, K] -> [M, N]
        if x.device.type == "cpu":
            return cpu_kernels.int4_mm(x, self.packed, self.group_size, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_and_zeros)


def pack_int4(w: IntWeight, device: torch.device, dtype: torch.dtype) -> Int4Weight | None:
    """``w`` packed for the 4-bit kernel of ``device`` in ``dtype``; None where its shape does not fit the kernel
    (CUDA: N a multiple of 8 and K of 32; CPU: N a multiple of 16), or it is not 4-bit."""
    n, k = w.q.shape
    if w.bits != 4 or w.group_size not in INT4_GROUPS or k % w.group_size:
        return None
    offsets = ((8 - w.zero) * w.scale)  # tinygemm's W = (q - 8) s + m
    if w.offset is not None:
        offsets = offsets + w.offset
    scales_and_zeros = torch.stack([w.scale.t(), offsets.t()], dim=-1).to(dtype).contiguous()  # [K / G, N, 2]
    if device.type == "cpu":
        packed = cpu_kernels.int4_pack(w.q, n)
    else:
        tiles = next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)
        if n % 8 or tiles is None:
            return None
        q = w.q.to(torch.int32)
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # two columns a byte, the even one high
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs.to(device), tiles)
    if packed is None:
        return None
    return Int4Weight(packed.to(device), scales_and_zeros.to(device), w.group_size)


# ---------------------------------------------------------------------------------------------- experts in 4 bits


def experts_int4_group(quant: dict | None, device: torch.device) -> int | None:
    """The group size in which a mixture's experts keep a checkpoint's 4-bit integers on ``device``
    (:class:`~specray.models.moe.SparseMoE`: packed two a byte with a scale, zero point and offset per group,
    dequantized expert by expert as tokens reach them), or None: not a 4-bit checkpoint in runs of columns, a CPU
    not asked to keep them (``cpu_kernels.INT4_WEIGHTS``), or ``$SPECRAY_DEQUANTIZE_INT4`` set."""
    scheme = int_scheme(quant)
    if scheme is None or scheme.bits != 4 or scheme.act_order or scheme.group_size < 2 or scheme.group_size % 2:
        return None
    if os.environ.get(DEQUANTIZE_INT4_ENV, "0") != "0" or (device.type == "cpu" and not cpu_kernels.INT4_WEIGHTS):
        return None
    return scheme.group_size


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit values [..., 2n] (uint8) -> [..., n] bytes, the even column in the low bits."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | q[..., 1::2] << 4


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """:func:`pack_nibbles`' bytes [..., n] -> the values [..., 2n] (uint8)."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def group_terms(w: IntWeight) -> torch.Tensor:
    """An IntWeight's scale, zero point and offset [rows, groups, 3] (float32), as an expert keeps them."""
    return torch.stack([w.scale.float(), w.zero.float(), w.offsets().float()], dim=-1)


def dequantize_packed(packed: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """:func:`pack_nibbles`' bytes [rows, cols / 2] with :func:`group_terms` [rows, groups, 3] -> float32 [rows, cols]:
    ``(q - z) * s + offset``, the arithmetic :meth:`IntWeight.dense` does (the same values)."""
    rows, groups = terms.shape[:2]
    q = unpack_nibbles(packed).float().view(rows, groups, -1)
    s, z, offset = terms.unbind(-1)
    return ((q - z[..., None]) * s[..., None] + offset[..., None]).view(rows, -1)
