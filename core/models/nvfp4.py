"""NVFP4 checkpoints, dequantized as they load: NVIDIA's ModelOpt releases (``quantization_config.quant_method:
"modelopt"``, ``quant_algo: "NVFP4"``: nvidia/*-FP4, *-NVFP4) and llm-compressor's (``quant_method:
"compressed-tensors"``, ``format: "nvfp4-pack-quantized"``).

A quantized linear's weight [out, in] is stored as FP4 (e2m1) codes two a byte, the even column in the low nibble
([out, in / 2] uint8: ModelOpt's ``X.weight``, llm-compressor's ``X.weight_packed``), one float8 (e4m3) scale per
group of 16 input columns (``X.weight_scale`` [out, in / 16]) and one float32 number for the whole tensor: ModelOpt's
``X.weight_scale_2`` multiplies, llm-compressor's ``X.weight_global_scale`` divides. A value is
``FP4[code] * scale[group] * global`` (``global`` the multiplier), computed in float32, where it is exact (two
significant bits times four times one float32). Activations are quantized to FP4 at run time in these releases
(``X.input_scale``, ``X.input_global_scale``): full-precision matmuls need none of it, so those are dropped, and the
model multiplies in its own dtype, at its dtype's bytes (bf16: four times NVFP4's). ModelOpt's KV-cache scales
(``self_attn.k_proj.k_scale``, ``v_proj.v_scale``) come out under the names the attention reads
(``self_attn.k_scale``, ``self_attn.v_scale``). Tensors left unquantized (``exclude_modules``, ``ignore``) pass
through untouched.

A mixture's experts (one tensor per expert, DeepSeek-R1's and Qwen3-MoE's layout) come from the loader as
:class:`Nvfp4Weight` (codes, group scales and the tensor's multiplier): a mixture that keeps quantized experts (a GPU)
keeps the codes and each group's float32 scale times the multiplier (three quarters of a byte per value, against
bf16's two) and decodes an expert with :func:`decode` when tokens reach it, to the values a load-time dequantization
gives; elsewhere :meth:`Nvfp4Weight.dequantized` gives them at load.

ModelOpt's FP8 releases (``quant_algo: "FP8"``: one float8 weight scale per tensor, a static input scale) load through
:mod:`specray.models.fp8`, as AutoFP8's do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch

from specray.models.layers import materialize, shape_of
from specray.models.mxfp4 import FP4_VALUES

MODELOPT, COMPRESSED_TENSORS = "modelopt", "compressed-tensors"
GROUP = 16  # input columns per float8 scale
# each layout's tensors of one linear: (the codes, the group scales, the global number, whether it divides), and
# the activation scales it has that full-precision matmuls drop
_PARTS = {MODELOPT: (("weight", "weight_scale", "weight_scale_2"), False, ("input_scale",)),
          COMPRESSED_TENSORS: (("weight_packed", "weight_scale", "weight_global_scale"), True,
                               ("input_global_scale",))}
# ModelOpt's KV-cache scales -> the names the attention reads them by
_KV_SCALES = ((".self_attn.k_proj.k_scale", ".self_attn.k_scale"), (".self_attn.v_proj.v_scale", ".self_attn.v_scale"))


def modelopt_algo(quant: dict | None) -> str | None:
    """A ModelOpt ``quantization_config``'s ``quant_algo`` ("NVFP4", "FP8"), None for another method; an algorithm
    specray cannot load is a ValueError naming it."""
    if (quant or {}).get("quant_method") != MODELOPT:
        return None
    algo = str(quant.get("quant_algo", "")).upper()
    if algo not in ("NVFP4", "FP8"):
        raise ValueError(f"quantization_config.quant_algo={quant.get('quant_algo')!r} (quant_method 'modelopt') is not "
                         "supported: specray loads ModelOpt's 'NVFP4' and 'FP8' releases; load a bf16 version")
    group = quant.get("group_size", GROUP)
    if algo == "NVFP4" and group != GROUP:
        raise ValueError(f"quantization_config.group_size={group!r}: NVFP4 groups are {GROUP} columns")
    return algo


def nvfp4_layout(quant: dict | None) -> str | None:
    """Which NVFP4 layout a checkpoint's ``quantization_config`` has (:data:`MODELOPT`, :data:`COMPRESSED_TENSORS`),
    None when it is not NVFP4."""
    if modelopt_algo(quant) == "NVFP4":
        return MODELOPT
    if (quant or {}).get("quant_method") == COMPRESSED_TENSORS and quant.get("format") == "nvfp4-pack-quantized":
        groups = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values()]
        if any(w.get("num_bits") != 4 or w.get("type") != "float" or w.get("group_size") != GROUP for w in groups):
            fields = [{k: w.get(k) for k in ("num_bits", "type", "strategy", "group_size")} for w in groups]
            raise ValueError(f"quantization_config (compressed-tensors, nvfp4-pack-quantized, weights {fields}) is "
                             f"not NVFP4's 4-bit floats in groups of {GROUP}; load a bf16 version")
        return COMPRESSED_TENSORS
    return None


def dequantize(codes: torch.Tensor, scales: torch.Tensor, global_scale: float) -> torch.Tensor:
    """FP4 codes [out, in / 2] (uint8, the even column low), float8 scales [out, in / 16] and the tensor's
    multiplier -> the weight [out, in] in float32."""
    rows, half = codes.shape
    if codes.dtype != torch.uint8 or scales.shape != (rows, 2 * half // GROUP) or (2 * half) % GROUP:
        raise ValueError(f"NVFP4 codes {tuple(codes.shape)} {codes.dtype} with scales {tuple(scales.shape)}: expected "
                         f"uint8 [out, in / 2] and one scale per {GROUP} columns; the checkpoint does not match its "
                         "quantization_config")
    return decode(codes, group_scales(scales, global_scale), torch.float32)


def group_scales(scales: torch.Tensor, global_scale: float) -> torch.Tensor:
    """Each group's float8 scale times the tensor's multiplier, in float32 (what a value's code is multiplied by)."""
    return scales.float() * global_scale


def decode(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP4 codes [out, in / 2] (uint8, the even column low) times their groups' float32 scales [out, in / 16]
    (:func:`group_scales`) -> [out, in] in ``dtype``."""
    rows, half = codes.shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=codes.device)
    values = lut[torch.stack((codes & 0x0F, codes >> 4), dim=-1).long()].view(rows, -1, GROUP)  # [out, G, 16]
    return (values * scales[..., None]).view(rows, 2 * half).to(dtype)


class Nvfp4Weight(NamedTuple):
    """One NVFP4 weight as stored: ``codes`` [out, in / 2] uint8, ``scales`` [out, in / 16] float8 and its
    multiplier ``number`` (tensors or lazy safetensors slices but the number)."""

    codes: Any
    scales: Any
    number: float

    def get_shape(self) -> list[int]:
        rows, half = shape_of(self.codes)
        return [rows, 2 * half]

    def kept(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, each group's float32 scale times the number): what a mixture keeps."""
        return materialize(self.codes), group_scales(materialize(self.scales), self.number)

    def dequantized(self) -> torch.Tensor:
        return dequantize(materialize(self.codes), materialize(self.scales), self.number)


def dequantized(weights: Iterable[tuple[str, Any]], layout: str, keep: Callable[[str], bool] = lambda name: False
                ) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) pairs with each NVFP4 linear's tensors (in any order, from any file) as its
    dequantized ``X.weight`` (float32), or for those named by ``keep`` (experts' weights) as an
    :class:`Nvfp4Weight`, and its activation scales dropped; other tensors pass through untouched (lazy slices stay
    lazy). A linear missing a tensor at the end is a ValueError."""
    (codes_name, scale_name, global_name), divides, dropped = _PARTS[layout]
    suffixes = {f".{part}": part for part in (codes_name, scale_name, global_name)}
    waiting: dict[str, dict[str, Any]] = {}
    for name, tensor in weights:
        if name.endswith(tuple(f".{d}" for d in dropped)):
            continue
        part = next((p for s, p in suffixes.items() if name.endswith(s)), None)
        # (ModelOpt's codes are named X.weight as an unquantized linear's weight is: its uint8 tells them apart)
        if part is None or (part == codes_name == "weight" and _dtype(tensor) != torch.uint8):
            yield name, tensor
            continue
        base = name[: -len(part) - 1]
        held = waiting.setdefault(base, {})
        held[part] = tensor
        if len(held) == 3:
            del waiting[base]
            number = float(materialize(held[global_name]).float().reshape(-1)[0])
            weight = Nvfp4Weight(held[codes_name], held[scale_name], 1.0 / number if divides else number)
            yield f"{base}.weight", weight if keep(f"{base}.weight") else weight.dequantized()
    if waiting:
        missing = {base: sorted(set(suffixes.values()) - set(held)) for base, held in list(waiting.items())[:3]}
        raise ValueError(f"NVFP4 linears without all their tensors, e.g. {missing}: the checkpoint is incomplete")


def renamed_kv_scales(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A ModelOpt release's (name, tensor) pairs with its KV-cache scales (``self_attn.k_proj.k_scale``,
    ``v_proj.v_scale``) under the names the attention reads them by (``self_attn.k_scale``, ``v_scale``)."""
    for name, tensor in weights:
        yield next((name[: -len(old)] + new for old, new in _KV_SCALES if name.endswith(old)), name), tensor


def _dtype(tensor: Any) -> torch.dtype | None:
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype
    return {"U8": torch.uint8}.get(tensor.get_dtype())
