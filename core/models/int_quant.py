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
* compressed-tensors: ``X.weight_packed`` [out, in / p] packed along the input, ``X.weight_scale`` [out, groups]
  (one group: per output row), ``X.weight_shape`` [2] (the unpadded [out, in]); symmetric, z = 2^(b-1) (the signed
  values stored offset by it); an act-order ``X.weight_g_idx`` [in] groups the columns as GPTQ's does.

The weights come out in float32 (``X.weight`` [out, in]) and are then cast to the model's dtype, so a model loads at
its dtype's size: integer matmul kernels are not written (on a GPU they would keep the 4-bit bytes, a quarter of
bf16's). A tensor that is not part of a quantized linear (norms, embeddings, an unquantized head, biases) passes
through untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from specray.models.layers import materialize

COMPRESSED_TENSORS = "compressed-tensors"
AWQ_COLUMNS = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of an int32's eight sits in its slot AWQ_COLUMNS[c]
# each kind's tensors of one linear: the ones it needs, then the one it may have
_PARTS = {"gptq": (("qweight", "qzeros", "scales"), "g_idx"), "awq": (("qweight", "qzeros", "scales"), None),
          "packed": (("weight_packed", "weight_scale", "weight_shape"), "weight_g_idx")}


@dataclass(frozen=True)
class IntScheme:
    """How a checkpoint's linears are quantized: the layout (``kind``: gptq, awq or packed), the bits per value,
    the input columns per group (-1: one group, a scale per output row) and what a GPTQ release adds to its stored
    zero points."""

    kind: str
    bits: int
    group_size: int
    zero_offset: int = 0

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
    return None


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
                     1 if fmt == "gptq" else 0)


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
    return IntScheme("packed", _bits(w.get("num_bits"), (4, 8), "weights.num_bits"), group)


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 ``packed`` -> its 32 / bits values per entry spread along ``dim`` (the first from the lowest bits), as
    int32 in [0, 2^bits)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., p]: arithmetic shifts, masked
    values = values.movedim(-1, dim + 1)  # each entry's values right after its own axis
    shape = list(packed.shape)
    shape[dim] *= len(shifts)
    return values.reshape(shape)


def dequantize(scheme: IntScheme, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """One linear's ``X.weight`` [out, in] in float32 from its quantized tensors (``parts``, by name after ``X.``)."""
    if scheme.kind == "packed":
        q = unpack(parts["weight_packed"], scheme.bits, 1)  # [out, in (padded)]
        out, cols = (int(v) for v in parts["weight_shape"].reshape(-1).tolist())
        q, s = q[:out, :cols], parts["weight_scale"].float()  # s [out, groups]
        groups = _groups(scheme, cols, s.shape[1], parts.get("weight_g_idx"))
        return (q - (1 << (scheme.bits - 1))).float() * s[:, groups]
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
    groups = _groups(scheme, q.shape[0], s.shape[0], g)
    return ((q - z[groups]).float() * s[groups]).t()


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


def dequantized(weights: Iterable[tuple[str, Any]], scheme: IntScheme) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) pairs with every quantized linear's tensors (in any order, from any file)
    replaced by its dequantized ``X.weight``; other tensors pass through untouched (lazy slices stay lazy). A
    linear whose optional group index never came is dequantized at the end; one missing a needed tensor is a
    ValueError."""
    needed, optional = _PARTS[scheme.kind]
    suffixes = {f".{part}": part for part in (*needed, *filter(None, [optional]))}
    waiting: dict[str, dict[str, Any]] = {}
    for name, tensor in weights:
        base, part = _split(name, suffixes)
        if part is None:
            yield name, tensor
            continue
        held = waiting.setdefault(base, {})
        held[part] = tensor
        if all(p in held for p in needed) and (optional is None or optional in held):
            yield f"{base}.weight", dequantize(scheme, _materialized(waiting.pop(base)))
    incomplete = {base: sorted(set(needed) - set(held)) for base, held in waiting.items() if set(needed) - set(held)}
    if incomplete:
        raise ValueError(f"quantized linears without all their tensors, e.g. {dict(list(incomplete.items())[:3])}: "
                         "the checkpoint is incomplete")
    for base, held in waiting.items():
        yield f"{base}.weight", dequantize(scheme, _materialized(held))


def _split(name: str, suffixes: dict[str, str]) -> tuple[str, str | None]:
    for suffix, part in suffixes.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], part
    return name, None


def _materialized(parts: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {part: materialize(t) for part, t in parts.items()}
