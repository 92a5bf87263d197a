"""BitNet b1.58 (``BitNetForCausalLM``: microsoft/bitnet-b1.58-2B-4T and its ``-bf16`` release), on the Llama
plumbing (:mod:`specray.models.llama`).

Where it differs from Llama: an RMSNorm over the attention's output before ``o_proj`` (``attn_sub_norm``) and over
the MLP's gated product before ``down_proj`` (``ffn_sub_norm``), and a squared-ReLU gate, ``down(norm(relu(gate)^2 *
up))``. Both norms read features that tensor-parallel ranks split, so each rank norms its share with the squares summed
over the ranks (:class:`ShardedRMSNorm`).

The main release is quantized (``quantization_config``: ``quant_method: bitnet``, ``linear_class: bitlinear``,
``quantization_mode: offline``): every decoder projection stores ternary weights packed four 2-bit values a byte
along its rows (stored row ``i``, bits ``2 j``: row ``j * rows/4 + i``, value + 1) and one ``weight_scale``, and
computes ``(round(x * s_x) W_t^T) / (weight_scale * s_x)`` with ``s_x = 127 / max|x|`` per token (activations in
int8's range). Here the weights are unpacked at load into a dense tensor of the ternary values (exact in any
dtype; the memory of a dense model, not of 2 bits), the scales become one per output row (a merged q/k/v or gate/up
keeps each part's), and the projections (:class:`BitLinearMixin`) quantize their input as transformers' ``BitLinear``
does; a row-parallel projection takes each token's largest value over every rank's share (one all-gather of [T, 1]).
The embedding and the LM head are never quantized, as in transformers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.fp8 import config_quantization
from specray.models.layers import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, _copy, _param,
                                   materialize, narrow)
from specray.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, _head_dim
from specray.parallel import TPGroup

QUANT_METHOD = "bitnet"
VALUES_PER_BYTE = 4  # ternary values packed 2 bits each
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def bitnet_quantization(config) -> bool:
    """Whether ``config`` is a packed ternary release (its ``quantization_config``, checked: the fields transformers'
    ``BitLinear`` serves and specray reproduces; anything else refused by name)."""
    quant = config_quantization(config)
    if not quant:
        return False
    method = quant.get("quant_method")
    if method != QUANT_METHOD:
        raise ValueError(f"quantization_config.quant_method={method!r} is not supported for model_type='bitnet'; "
                         f"'{QUANT_METHOD}' (the packed ternary release) is, or load the -bf16 release")
    for field, served in (("linear_class", "bitlinear"), ("quantization_mode", "offline"), ("use_rms_norm", False)):
        value = quant.get(field, served)
        if value != served:
            raise ValueError(f"quantization_config.{field}={value!r} is not supported for BitNet (specray serves "
                             f"{field}={served!r}, microsoft/bitnet-b1.58-2B-4T's); load the -bf16 release")
    kept = [m for m in quant.get("modules_to_not_convert") or [] if "lm_head" not in m]
    if kept:
        raise ValueError(f"quantization_config.modules_to_not_convert={kept!r}: specray quantizes every decoder "
                         "projection of a BitNet release; load the -bf16 release")
    return True


def unpack_ternary(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ternary weight [4 R, C] in ``dtype`` of a packed one [R, C] (uint8): bits ``2 j`` of stored row ``i`` hold
    row ``j R + i``, as the value + 1."""
    packed = packed.to(torch.uint8)
    parts = [((packed >> (2 * j)) & 3) for j in range(VALUES_PER_BYTE)]
    return torch.cat(parts).to(dtype) - 1


def quantize_activations(x: torch.Tensor, tp: TPGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, K] rounded to int8's range by each token's scale ``127 / max|x|`` (``tp``: the largest value over
    every rank's share of the row), as values of ``x``'s dtype, and the scales [T, 1]."""
    largest = x.abs().amax(dim=-1, keepdim=True)
    if tp is not None and tp.size > 1:
        largest = tp.all_gather(largest, dim=-1).amax(dim=-1, keepdim=True)
    scale = 127 / largest.clamp(min=1e-5)
    return (x * scale).round().clamp(-128, 127), scale


class BitLinearMixin:
    """A TP linear holding ternary weights (dense) and a scale per output row (``weight_scale``): its input quantized
    per token, its output divided by the weight's and the input's scales (module docstring)."""

    tp: TPGroup
    row_parallel = False

    def bit_scales(self, rows: int) -> None:
        self.weight_scale = _param(rows)
        if not self.row_parallel:  # this rank's rows of a column-parallel one (a merged one's parts apart)
            self.weight_scale.weight_loader = self.weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] (a row-parallel one's share) -> [T, out]
        xq, scale = quantize_activations(x, self.tp if self.row_parallel else None)
        return super().forward(xq) / (self.weight_scale * scale)


class BitQKVParallelLinear(BitLinearMixin, QKVParallelLinear):
    pass


class BitMergedColumnParallelLinear(BitLinearMixin, MergedColumnParallelLinear):
    pass


class BitRowParallelLinear(BitLinearMixin, RowParallelLinear):
    row_parallel = True


class ShardedRMSNorm(nn.Module):
    """An RMSNorm over ``width`` features of which this rank holds ``local`` from ``start`` (a row-parallel
    projection's input): the squares summed over the ranks, the weight this rank's share (computed as
    :class:`~specray.models.layers.RMSNorm`: float32, the weight applied in the input's dtype)."""

    def __init__(self, width: int, local: int, start: int, eps: float, tp: TPGroup):
        super().__init__()
        self.width, self.eps, self.tp = width, eps, tp
        self.weight = _param(local)

        def load(param: nn.Parameter, loaded: Any) -> None:
            _copy(param, narrow(loaded, 0, start, local))

        self.weight.weight_loader = load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, local] -> [T, local]
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        if self.tp.size > 1:
            squares = self.tp.all_reduce(squares)
        return self.weight * (xf * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)


class BitNetAttention(LlamaAttention):
    """Llama's attention with ``attn_sub_norm`` before ``o_proj``; q/k/v and o as ternary linears in a packed
    release."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        if bitnet_quantization(config):
            if getattr(config, "attention_bias", False):
                raise ValueError("attention_bias=True is not supported for a packed BitNet release (its ternary "
                                 "linears have no bias in transformers' BitLinear either); set it to false")
            d = self.head_dim
            self.qkv_proj = BitQKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                                 config.num_key_value_heads, tp)
            self.qkv_proj.bit_scales(self.qkv_proj.out_local)
            self.o_proj = BitRowParallelLinear(config.num_attention_heads * d, config.hidden_size, tp)
            self.o_proj.bit_scales(config.hidden_size)
        width = config.num_attention_heads * self.head_dim
        self.attn_sub_norm = ShardedRMSNorm(width, self.qkv_proj.q_size, tp.rank * self.qkv_proj.q_size,
                                            config.rms_norm_eps, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        return self.o_proj(self.attn_sub_norm(self.attn(*self.project(x, cos, sin, meta), meta)))


class BitNetMLP(nn.Module):
    """``down(ffn_sub_norm(relu(gate(x))^2 * up(x)))``; ternary linears in a packed release."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        if config.hidden_act != "relu2":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported for model_type='bitnet'; 'relu2' "
                             "(squared ReLU) is")
        inter = config.intermediate_size
        if bitnet_quantization(config):
            self.gate_up_proj = BitMergedColumnParallelLinear(config.hidden_size, [inter, inter], tp)
            self.gate_up_proj.bit_scales(self.gate_up_proj.out_local)
            self.down_proj = BitRowParallelLinear(inter, config.hidden_size, tp)
            self.down_proj.bit_scales(config.hidden_size)
        else:
            self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], tp)
            self.down_proj = RowParallelLinear(inter, config.hidden_size, tp)
        local = self.gate_up_proj.local_sizes[0]
        self.ffn_sub_norm = ShardedRMSNorm(inter, local, tp.rank * local, config.rms_norm_eps, tp)

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.relu(gate).square()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.ffn_sub_norm(self.activation(gate) * up))


class BitNetDecoderLayer(LlamaDecoderLayer):
    attention_class = BitNetAttention
    mlp_class = BitNetMLP


class BitNetModel(LlamaModel):
    layer_class = BitNetDecoderLayer


class BitNetForCausalLM(LlamaForCausalLM):
    """BitNet for causal LM, sharded over ``tp`` and ``pp`` as Llama is; a packed release's ternary weights unpacked
    as they load (module docstring)."""

    model_class = BitNetModel
    reads_quantization = "bitnet"  # its packed release's method, which no other family reads (the loader refuses it)

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False, pp=None):
        self.packed_release = bitnet_quantization(hf_config)
        super().__init__(hf_config, tp, expert_parallel, pp)
        if self.packed_release:
            self.lora_modules = ()  # an adapter over quantized activations is not what PEFT would compute

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        if not self.packed_release:
            yield from super()._unfused(weights)
            return
        config = self.config
        d = _head_dim(config)
        rows = {"q_proj": config.num_attention_heads * d, "k_proj": config.num_key_value_heads * d,
                "v_proj": config.num_key_value_heads * d, "o_proj": config.hidden_size,
                "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size,
                "down_proj": config.hidden_size}
        for name, tensor in super()._unfused(weights):
            which = next((p for p in PROJECTIONS if f".{p}." in name), None)
            if which is None or not name.startswith("model.layers."):
                yield name, tensor
            elif name.endswith(".weight"):
                value = materialize(tensor)
                if value.dtype != torch.uint8 or value.shape[0] * VALUES_PER_BYTE != rows[which]:
                    raise ValueError(f"{name} of dtype {value.dtype} and shape {tuple(value.shape)}: a packed BitNet "
                                     f"release stores uint8 [{rows[which] // VALUES_PER_BYTE}, in] (4 ternary rows a "
                                     "byte); is config.json's quantization_config this checkpoint's?")
                yield name, unpack_ternary(value, torch.float32)
            elif name.endswith(".weight_scale"):
                scale = materialize(tensor).float().reshape(-1)
                if scale.numel() != 1:
                    raise ValueError(f"{name} has {scale.numel()} values; BitNet's weight_scale is one per tensor")
                yield name, scale.expand(rows[which]).contiguous()
            else:
                yield name, tensor
