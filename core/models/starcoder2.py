"""BigCode's StarCoder2 (``Starcoder2ForCausalLM``: StarCoder2 3B / 7B / 15B), on the Llama plumbing
(:mod:`specray.models.llama`; its ``use_bias`` flag biases q/k/v and o, and ``sliding_window`` slides every layer as
Mistral's). Where it differs from Llama: LayerNorms with biases (before each block and after the last layer), and a
gateless MLP ``c_proj(gelu_tanh(c_fc(x)))`` with biases."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.layers import ColumnParallelLinear, LayerNorm, RowParallelLinear
from specray.models.arcee import GATELESS_STACKED
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from specray.parallel import TPGroup

ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # hidden_act -> F.gelu's approximate


class Starcoder2MLP(nn.Module):
    """``c_proj(gelu(c_fc(x)))``, ``c_fc`` split by columns and ``c_proj`` by rows over ``tp``."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported for model_type='starcoder2'; one "
                             f"of {sorted(ACTIVATIONS)}")
        self.approximate = ACTIVATIONS[config.hidden_act]
        bias = bool(getattr(config, "use_bias", True))
        self.c_fc = ColumnParallelLinear(config.hidden_size, config.intermediate_size, tp, bias=bias)
        self.c_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, tp, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


def _layer_norm(config) -> nn.Module:
    return LayerNorm(config.hidden_size, config.norm_epsilon, bias=bool(getattr(config, "use_bias", True)))


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    mlp_class = Starcoder2MLP
    build_norm = staticmethod(_layer_norm)  # (the final norm too: LlamaModel.final_norm)


class Starcoder2Model(LlamaModel):
    layer_class = Starcoder2DecoderLayer


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """StarCoder2 for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = Starcoder2Model
    stacked = GATELESS_STACKED
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")
