"""MXFP4 checkpoints (``quantization_config.quant_method == "mxfp4"``: GPT-OSS's releases): their experts kept in
MXFP4 where a mixture keeps quantized experts (:mod:`specray.models.moe`: a GPU), else dequantized as they load.

Their quantized tensors are the experts' fused weights (``mlp.experts.gate_up_proj`` and ``down_proj``), each
stored as two tensors: ``X_blocks`` [E, rows, G, 16] uint8, 32 FP4 (e2m1) codes per group of 32 values along the
last (input) dimension, two per byte, the even value in the low nibble; and ``X_scales`` [E, rows, G] uint8, one
power-of-two scale per group, its exponent biased by 127 (E8M0). A value is ``FP4[code] * 2 ** (scale - 127)``.
The values come out as transformers 5 names and lays out the dequantized tensor: ``X`` [E, cols, rows] (its
``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]), which :mod:`specray.models.moe` reads.

They come out in bfloat16: an FP4 value (two significant bits) times a power of two in E8M0's range is exact there
(bfloat16 has float32's exponents, subnormals included), at half float32's bytes; the model casts them to its
dtype. Every other tensor (attention, router, biases, embeddings) passes through untouched.

The loader hands the experts' pairs over as :class:`Mxfp4Weight` (the stored codes and scales, read lazily): a
mixture that keeps them copies its share of the codes and scales (half a byte and 1/32 of a byte per value: a quarter
of bf16's bytes) and decodes an expert with :func:`decode` when tokens reach it, to the same values as the load-time
dequantization; one that does not asks for :meth:`Mxfp4Weight.dequantized`, the tensor this module gave before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch

from specray.models.layers import materialize

QUANT_METHOD = "mxfp4"
BLOCKS, SCALES = "_blocks", "_scales"
SCALE_BIAS = 127  # E8M0: the scale's exponent is the stored byte minus this
# the 16 FP4 (e2m1) codes' values: sign bit 3, then two exponent bits and one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_mxfp4(quant: dict | None) -> bool:
    """Whether a config's ``quantization_config`` (``quant``) is MXFP4."""
    return (quant or {}).get("quant_method") == QUANT_METHOD


def decode(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One weight's FP4 codes [rows, cols / 2] uint8 (two a byte, the even column in the low nibble) and E8M0 scales
    [rows, cols / 32] uint8 -> its values [rows, cols] in ``dtype`` (exact in bfloat16 and float32)."""
    rows, half = codes.shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=codes.device)
    values = lut[torch.stack((codes & 0x0F, codes >> 4), dim=-1).long()].view(rows, -1, 32)  # [rows, G, 32]
    power = torch.exp2(scales.float() - SCALE_BIAS)[..., None]  # [rows, G, 1]
    return (values * power).view(rows, 2 * half).to(dtype)


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16 or blocks.dim() != 4:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype}: expected uint8 [E, rows, G, 16] and uint8 [E, rows, G]; the checkpoint "
                         "does not match its quantization_config")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Blocks [E, rows, G, 16] uint8 and scales [E, rows, G] uint8 -> [E, G * 32, rows] bfloat16 (transposed, as
    transformers lays the weights out), one expert at a time (a float32 copy of one expert at most)."""
    _check(blocks, scales)
    e, rows, groups, _ = blocks.shape
    out = torch.empty(e, rows, groups * 32, dtype=torch.bfloat16, device=blocks.device)
    for i in range(e):
        out[i] = decode(blocks[i].reshape(rows, groups * 16), scales[i], torch.bfloat16)
    return out.transpose(1, 2)


class Mxfp4Weight(NamedTuple):
    """A fused expert weight as an MXFP4 release stores it: ``blocks`` [E, rows, G, 16] and ``scales`` [E, rows, G]
    (uint8 tensors or lazy safetensors slices; rows are the output features, G the groups of 32 input columns)."""

    blocks: Any
    scales: Any

    def codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [E, rows, G * 16], scales [E, rows, G]), read and checked."""
        blocks, scales = materialize(self.blocks), materialize(self.scales)
        _check(blocks, scales)
        return blocks.flatten(2), scales

    def dequantized(self) -> torch.Tensor:
        """The values [E, cols, rows] in bfloat16 (:func:`dequantize`)."""
        return dequantize(materialize(self.blocks), materialize(self.scales))


class Mxfp4Expert(NamedTuple):
    """One expert's weight as DeepSeek-V4's release stores it: ``codes`` [rows, cols / 2] (int8 or uint8, two FP4
    codes a byte, the even column in the low nibble) and ``scales`` [rows, cols / 32] (E8M0: float8_e8m0fnu or
    uint8), tensors or lazy safetensors slices: MXFP4's values, one expert at a time."""

    codes: Any
    scales: Any

    def kept(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) as uint8, read and checked: what a mixture that keeps MXFP4 experts stores."""
        codes, scales = materialize(self.codes), materialize(self.scales)
        rows, half = codes.shape
        if codes.dtype not in (torch.int8, torch.uint8) or scales.dtype not in (torch.float8_e8m0fnu, torch.uint8) \
                or tuple(scales.shape) != (rows, 2 * half // 32) or half % 16:
            raise ValueError(f"an FP4 weight of {tuple(codes.shape)} {codes.dtype} bytes needs E8M0 scales of shape "
                             f"{(rows, 2 * half // 32)}, one per 32 values, not {tuple(scales.shape)} {scales.dtype}: "
                             "the checkpoint does not match its quantization_config (expert_dtype: fp4)")
        return codes.view(torch.uint8), scales.view(torch.uint8)

    def dequantized(self) -> torch.Tensor:
        """The values [rows, cols] in bfloat16 (exact)."""
        return decode(*self.kept(), torch.bfloat16)


def dequantized(weights: Iterable[tuple[str, Any]], keep: Callable[[str], bool] = lambda name: False
                ) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) pairs with each ``X_blocks`` and ``X_scales`` pair (in either order, from any
    file) as one dequantized ``X``, or for those named by ``keep`` (experts' weights) as an :class:`Mxfp4Weight`;
    other tensors pass through (lazy slices stay lazy). One without the other at the end is a ValueError."""
    waiting: dict[str, dict[str, Any]] = {}
    for name, tensor in weights:
        part = BLOCKS if name.endswith(BLOCKS) else SCALES if name.endswith(SCALES) else None
        if part is None:
            yield name, tensor
            continue
        base = name[: -len(part)]
        pair = waiting.setdefault(base, {})
        pair[part] = tensor
        if len(pair) == 2:
            del waiting[base]
            weight = Mxfp4Weight(pair[BLOCKS], pair[SCALES])
            yield base, weight if keep(base) else weight.dequantized()
    if waiting:
        raise ValueError(f"MXFP4 tensors without their blocks or scales: {sorted(waiting)[:4]}; the checkpoint is "
                         "incomplete")
