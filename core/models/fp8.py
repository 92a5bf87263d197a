"""FP8 checkpoints with block scales (``quantization_config.quant_method == "fp8"``: DeepSeek-V3/R1's release,
Qwen3's ``-FP8`` ones), dequantized as they load; and llm-compressor's FP8 checkpoints (``quant_method ==
"compressed-tensors"``, ``format: "float-quantized"``: the ``-FP8`` and ``-FP8-dynamic`` releases of RedHatAI and
others), whose ``X.weight_scale`` is one scale per output row (``strategy: channel``), per tensor or per block, and
whose static ``X.input_scale`` (activations quantized with a fixed scale) full-precision matmuls do not need (the
linears kept in FP8 use it).

Each quantized linear weight ``X.weight`` is stored as float8 (e4m3) beside ``X.weight_scale_inv``, one float32 scale
per ``weight_block_size`` block ([128, 128] in these releases), or without a block size (AutoFP8's layout, vLLM's
``quant_method: fp8`` per tensor) beside ``X.weight_scale``, one per tensor. The weight is ``W = W_fp8 * scale`` over
each block (the scale is the inverse of the quantizer's: multiply to dequantize). Activations are quantized per token
at run time in the block-scaled releases (``activation_scheme: dynamic``), which full-precision matmuls need not
mimic; AutoFP8's ``activation_scheme: static`` releases add one calibrated ``X.input_scale`` per linear, which linears
kept in FP8 use (:mod:`specray.models.w8a8`). Weights come out in float32 and are then cast to the model's dtype, so a
model loads at its dtype's size (bf16: twice the FP8 bytes), but for the linears of a checkpoint with one scale per
output row or per tensor on a device with FP8 matmuls: those come out as :class:`~specray.models.w8a8.RowScaled` and
stay FP8 (:mod:`specray.models.w8a8`).

DeepSeek-V4's release stores the same block-scaled FP8 linears with power-of-two scales (``scale_fmt: ue8m0``: one
``float8_e8m0fnu`` byte each) named ``X.scale`` (read as ``X.weight_scale_inv``: :func:`renamed_block_scales`), and
its routed experts in FP4 (``expert_dtype: fp4``): ``X.weight`` int8 [out, in / 2], two e2m1 codes a byte, beside
``X.scale`` [out, in / 32], one E8M0 scale per 32 values (MXFP4's values), which come as
:class:`~specray.models.mxfp4.Mxfp4Expert`: kept so by a mixture that keeps quantized experts, else dequantized to
bfloat16.

A mixture of experts' per-expert weights (nearly all of DeepSeek-V3's 671 B parameters) are the exception: they
come out as :class:`Fp8Weight` (the stored values and their scales) and :class:`~specray.models.moe.SparseMoE`
keeps them so, half a bf16 model's bytes, dequantizing an expert's weights block by block when tokens reach it
(:func:`dequantize_blocks`: the same float32 products as at load, so the same outputs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch

from specray.models.fp8_blocks import BlockScaled
from specray.models.w8a8 import FP8, INT8, Format, row_scaled, row_scales
from specray.models.int_quant import COMPRESSED_TENSORS, int_scheme
from specray.models.layers import materialize, shape_of
from specray.models.mxfp4 import Mxfp4Expert, is_mxfp4
from specray.models.nvfp4 import MODELOPT, modelopt_algo, nvfp4_layout

SCALE_SUFFIX = "_scale_inv"
INPUT_SCALE = ".input_scale"  # a static release's activation scale, beside X.weight
# the "block" of an FP8 weight with one scale per output row (or one per tensor, repeated on every row): one row by
# the whole width (b1 = 0)
ROW_SCALES = (1, 0)
COMPRESSED_SCALE_SUFFIX = "_scale"  # compressed-tensors' weight_scale (multiplied, as weight_scale_inv is)


def renamed_block_scales(weights: Iterable[tuple[str, Any]], quant: dict | None) -> Iterator[tuple[str, Any]]:
    """A release with E8M0 block scales (``scale_fmt: ue8m0``: DeepSeek-V4's) names each weight's ``X.scale``; the
    others here read ``X.weight_scale_inv``, so it comes out under that name (as transformers reads it)."""
    if (quant or {}).get("scale_fmt") != "ue8m0":
        yield from weights
        return
    for name, tensor in weights:
        yield (name[: -len(".scale")] + ".weight" + SCALE_SUFFIX if name.endswith(".scale") else name), tensor


def fp4_experts(quant: dict | None) -> bool:
    """Whether a block-scaled FP8 release stores its experts in FP4 (``expert_dtype: fp4``: DeepSeek-V4's)."""
    return (quant or {}).get("expert_dtype") == "fp4"


def scale_suffix(quant: dict) -> tuple[str, ...]:
    """What may follow ``.weight`` in the name of a quantized weight's scale: ``_scale`` for compressed-tensors,
    ``_scale_inv`` or ``_scale`` for ``quant_method: fp8`` (vLLM names a block-scaled weight's scale ``_scale_inv``,
    DeepSeek's way, and a per-tensor one ``_scale``, AutoFP8's)."""
    if quant.get("quant_method") in (COMPRESSED_TENSORS, MODELOPT):
        return (COMPRESSED_SCALE_SUFFIX,)
    return SCALE_SUFFIX, COMPRESSED_SCALE_SUFFIX


def static_activations(quant: dict | None) -> bool:
    """Whether a W8A8 release (its ``quantization_config``) quantizes activations with static, calibrated scales (one
    ``X.input_scale`` per linear): AutoFP8's ``activation_scheme: static``, or compressed-tensors'
    ``input_activations`` with ``dynamic: false`` (symmetric ones: an asymmetric scheme's zero points are not read,
    and its rows get their own scales as a dynamic release's do)."""
    method = (quant or {}).get("quant_method")
    if method == "fp8":
        return quant.get("activation_scheme", "dynamic") == "static"
    if method == MODELOPT:  # ModelOpt's FP8: a calibrated input_scale per linear
        return modelopt_algo(quant) == "FP8"
    if method != COMPRESSED_TENSORS:
        return False
    acts = [g.get("input_activations") or {} for g in (quant.get("config_groups") or {}).values()]
    static = [a for a in acts if a.get("dynamic") is False and a.get("symmetric", True)]
    for a in static:
        if a.get("strategy", "tensor") != "tensor":
            raise ValueError(f"quantization_config: static input_activations with strategy={a.get('strategy')!r} are "
                             "not supported (one scale per tensor, 'tensor', is); load a bf16 version")
    return bool(static)


def fp8_block_size(quant: dict | None) -> tuple[int, int] | None | bool:
    """The block of a checkpoint's FP8 weights ([rows, cols]; None: one scale per tensor or per output row) by its
    config.json's ``quantization_config`` (``quant``), or False when it has none. A quantization other than FP8
    (block FP8, or compressed-tensors' float-quantized FP8) is a ValueError naming it."""
    if not quant or int_scheme(quant) is not None or is_mxfp4(quant) or nvfp4_layout(quant) is not None:
        return False  # (specray.models.int_quant, .mxfp4, .nvfp4)
    method = quant.get("quant_method")
    if method == "bitnet":  # packed ternary weights: unpacked by BitNet's own loader (specray.models.bitnet)
        return False
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors_block(quant)
    if method == MODELOPT:  # ModelOpt's FP8 (its NVFP4 returned above): one scale per tensor
        return None
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method={method!r} is not supported (specray loads FP8 "
                         "checkpoints: quant_method 'fp8', or 'compressed-tensors' with 8-bit float weights; "
                         "integer ones: 'gptq', 'awq', or 'compressed-tensors' pack-quantized; 'mxfp4'; NVFP4: "
                         "'modelopt' or 'compressed-tensors' nvfp4-pack-quantized); load a "
                         "bf16 or fp16 version of the checkpoint")
    block = quant.get("weight_block_size")
    if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size={block!r} must be two positive ints, e.g. [128, 128]")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static") or (scheme == "static" and block is not None):
        raise ValueError(f"quantization_config.activation_scheme={scheme!r}"
                         f"{' with a weight_block_size' if block is not None else ''}: block-scaled FP8 weights take "
                         "dynamic activation scales, per-tensor ones 'dynamic' or 'static'; load a bf16 version")
    return None if block is None else (int(block[0]), int(block[1]))


def _compressed_tensors_block(quant: dict) -> tuple[int, int] | None:
    """llm-compressor's FP8 (``format: float-quantized``, every group's weights 8-bit floats): the weights' block
    for ``strategy: block``, else None (a scale per tensor or per output row); any other scheme (INT4/INT8 packed
    weights, ...) is a ValueError naming it."""
    fmt = quant.get("format")
    groups = list((quant.get("config_groups") or {}).values())
    schemes = [(g.get("weights") or {}) for g in groups]
    if fmt != "float-quantized" or not schemes or any(
            w.get("num_bits") != 8 or w.get("type") != "float" for w in schemes):
        raise ValueError(f"quantization_config (compressed-tensors, format={fmt!r}, weights "
                         f"{[{k: w.get(k) for k in ('num_bits', 'type', 'strategy')} for w in schemes]}) is not "
                         "supported: specray loads compressed-tensors checkpoints with 8-bit float weights "
                         "(format 'float-quantized'); load a bf16 or fp16 version of the checkpoint")
    strategies = {w.get("strategy", "tensor") for w in schemes}
    if not strategies <= {"tensor", "channel", "block"} or len(strategies) > 1:
        raise ValueError(f"quantization_config: weight strategies {sorted(strategies)} are not supported; one of "
                         "'tensor', 'channel' or 'block' is")
    if strategies == {"block"}:
        block = schemes[0].get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"quantization_config: block_structure={block!r} must be two positive ints")
        return int(block[0]), int(block[1])
    return None


class Fp8Weight(NamedTuple):
    """An FP8 weight as the checkpoint stores it: its float8 values [out, in] and their block scales
    [ceil(out / b0), ceil(in / b1)] (tensors or lazy safetensors slices), or with ``block`` :data:`ROW_SCALES` one
    scale per row [out, 1]; ``input_scale``: a static release's activation scale (0-d float32), else None."""

    weight: Any
    scale: Any
    block: tuple[int, int]
    input_scale: torch.Tensor | None = None

    def dequantized(self) -> torch.Tensor:
        return dequantize(materialize(self.weight), materialize(self.scale), self.block)


def config_quantization(config) -> dict | None:
    """``config``'s ``quantization_config`` as a dict (None without one)."""
    quant = getattr(config, "quantization_config", None)
    return quant if quant is None or isinstance(quant, dict) else vars(quant)


def w8a8_format(quant: dict | None) -> Format | None:
    """The 8-bit format of a checkpoint (its ``quantization_config``) whose weights are scaled per row or per tensor
    and meant for 8-bit matmuls (INT8 W8A8; FP8 without blocks: :mod:`specray.models.w8a8`), else None."""
    scheme = int_scheme(quant)
    if scheme is not None:
        return INT8 if scheme.kind == "int8" else None
    return FP8 if fp8_block_size(quant) is None else None


def kept_block(config) -> tuple[int, int] | None:
    """The weight block of a checkpoint whose experts stay in 8 bits (its ``quantization_config`` block FP8;
    :data:`ROW_SCALES` for one scale per row or per tensor, FP8 or INT8 W8A8), else None."""
    quant = config_quantization(config)
    if w8a8_format(quant) is not None:
        return ROW_SCALES
    return fp8_block_size(quant) or None


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W [out, in] (float8, both dims whole blocks) times its blocks' scales [out / b0, in / b1] (or, with
    :data:`ROW_SCALES`, its rows' [out, 1]), in float32: :func:`dequantize`'s products without materializing the
    scales at full size."""
    (rows, cols), (b0, b1) = weight.shape, block
    if b1 == 0:
        return weight.float() * scale.float().reshape(rows, 1)
    blocks = weight.float().view(rows // b0, b0, cols // b1, b1) * scale.float()[:, None, :, None]
    return blocks.view(rows, cols)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """W [out, in] (float8) times its block's scale (``scale`` [ceil(out / b0), ceil(in / b1)], one number, or
    without a block one per output row)."""
    w = weight.float()
    if scale.numel() == 1:
        return w * scale.float().reshape(())
    if block is None or block == ROW_SCALES:
        if scale.numel() != w.shape[0]:
            raise ValueError(f"a weight of shape {tuple(w.shape)} needs one scale, or one per output row, not "
                             f"{tuple(scale.shape)}: the checkpoint does not match its config")
        return w * scale.float().reshape(-1, 1)
    rows, cols = w.shape
    check_block_scales((rows, cols), scale, block)
    full = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return w * full


def check_block_scales(shape: tuple[int, int], scale: torch.Tensor, block: tuple[int, int]) -> None:
    """A ValueError unless ``scale`` is one per ``block`` of a weight of ``shape`` (the last blocks may be partial)."""
    expected = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"a weight of shape {tuple(shape)} with weight_block_size {list(block)} needs scales of "
                         f"shape {expected}, not {tuple(scale.shape)}: the checkpoint does not match its config")


def dequantized(weights: Iterable[tuple[str, Any]], block: tuple[int, int] | None,
                keep: Callable[[str], bool] = lambda name: False, suffix: str | tuple[str, ...] = SCALE_SUFFIX,
                rows: bool = False, static: bool = False, blocks: bool = False,
                fp4: bool = False) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) pairs with every FP8 weight dequantized (and its scale, named ``.weight`` +
    ``suffix``, or one of several, consumed), but for those named by ``keep`` (e4m3 with block scales, or scaled by
    row or tensor), which come as :class:`Fp8Weight`, and, with ``rows`` (a model that keeps FP8 linears), the e4m3
    weights scaled per row or per tensor, which come as :class:`~specray.models.w8a8.RowScaled`, with ``static`` (a
    release with static activation scales) each with its ``X.input_scale``; with ``blocks`` (a model that keeps
    block-scaled FP8 linears) the block-scaled ones not named by ``keep`` come as
    :class:`~specray.models.fp8_blocks.BlockScaled`. Other activation scales are dropped, and other tensors pass
    through untouched (lazy slices stay lazy). With ``fp4`` (``expert_dtype: fp4``) an int8 weight is an expert's
    FP4 codes: an :class:`~specray.models.mxfp4.Mxfp4Expert` where ``keep`` names it, else dequantized. A weight and
    its scales may come in any order,
    from any file; a weight without one at the end is a ValueError."""
    suffixes = (suffix,) if isinstance(suffix, str) else tuple(suffix)
    held: dict[str, dict[str, Any]] = {}  # a weight's name -> its parts come so far: weight, scale, input

    def by_row(name: str, weight: Any) -> bool:  # kept by a linear in FP8
        return block is None and rows and not keep(name) and dtype_of(weight) == torch.float8_e4m3fn

    def needs_input(name: str, weight: Any) -> bool:  # a static release's weight multiplied in FP8: a linear's, or
        return static and rows and block is None and dtype_of(weight) == torch.float8_e4m3fn  # an expert's

    def ready(name: str, parts: dict[str, Any]) -> bool:
        if "weight" not in parts or "scale" not in parts:
            return False
        return "input" in parts or not needs_input(name, parts["weight"])

    def paired(name: str, parts: dict[str, Any]) -> Any:
        weight, scale = parts["weight"], parts["scale"]
        if fp4 and dtype_of(weight) == torch.int8:  # an expert's FP4 codes: kept so by a mixture that keeps them
            return Mxfp4Expert(weight, scale) if keep(name) else Mxfp4Expert(weight, scale).dequantized()
        if block is not None and keep(name):
            return Fp8Weight(weight, scale, block)
        if block is None and keep(name) and dtype_of(weight) == torch.float8_e4m3fn:  # kept by row, as experts
            inputs = materialize(parts["input"]).float().reshape(()) if "input" in parts else None
            return Fp8Weight(weight, row_scales(materialize(scale), tuple(shape_of(weight)))[:, None], ROW_SCALES,
                             inputs)
        if by_row(name, weight):
            inputs = materialize(parts["input"]) if "input" in parts else None
            return row_scaled(materialize(weight), materialize(scale), FP8, inputs)
        if block is not None and blocks and dtype_of(weight) == torch.float8_e4m3fn:  # kept by a linear in FP8
            weight, scale = materialize(weight), materialize(scale)
            check_block_scales(tuple(weight.shape), scale, block)
            return BlockScaled(weight, scale.float(), block)
        return dequantize(materialize(weight), materialize(scale), block)

    for name, tensor in weights:
        scale_of = next((s for s in suffixes if name.endswith(".weight" + s)), None)
        if name.endswith(INPUT_SCALE):
            base, part = name[: -len(INPUT_SCALE)] + ".weight", "input"
            if not (static and rows):
                continue  # (a full-precision matmul needs none)
        elif scale_of is not None:
            base, part = name[: -len(scale_of)], "scale"
        elif name.endswith(".weight") and (_is_fp8(tensor) or fp4 and dtype_of(tensor) == torch.int8):
            base, part = name, "weight"
        else:
            yield name, tensor
            continue
        parts = held.setdefault(base, {})
        parts[part] = tensor
        if ready(base, parts):
            yield base, paired(base, held.pop(base))

    def missing(name: str, parts: dict[str, Any]) -> list[str]:
        inputs = {"input"} if "weight" in parts and needs_input(name, parts["weight"]) else set()
        labels = {"weight": "weight", "scale": " or ".join("weight" + s for s in suffixes), "input": "input_scale"}
        return [labels[part] for part in sorted(({"weight", "scale"} | inputs) - set(parts))]

    unpaired = {base: missing(base, parts) for base, parts in held.items()
                if parts.keys() != {"input"}}  # (an input scale beside a weight the release left unquantized)
    if unpaired:
        raise ValueError(f"FP8 weights without their {' or '.join('weight' + s for s in suffixes)}"
                         f"{' or input_scale' if static and rows else ''}, or scales without their weight (e.g. "
                         f"{dict(list(unpaired.items())[:3])} missing): the checkpoint is incomplete")


def _is_fp8(tensor: Any) -> bool:
    return dtype_of(tensor) in (torch.float8_e4m3fn, torch.float8_e5m2)


def dtype_of(tensor: Any) -> torch.dtype | None:
    """A tensor's dtype; for a safetensors slice, its float8 dtype (None for any other)."""
    return tensor.dtype if isinstance(tensor, torch.Tensor) else _slice_dtype(tensor)


def _slice_dtype(tensor: Any) -> torch.dtype | None:
    """A safetensors slice's dtype ("F8_E4M3", ...) as torch's."""
    return {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I8": torch.int8}.get(tensor.get_dtype())
