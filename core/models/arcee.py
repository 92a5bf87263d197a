"""Arcee's AFM (``ArceeForCausalLM``: AFM-4.5B), on the Llama plumbing (:mod:`specray.models.llama`). Where it differs
from Llama: the MLP has no gate, ``down(relu(up(x))^2)`` (``hidden_act: relu2``), so ``up_proj`` is a projection of its
own rather than half of a merged gate/up one."""

from __future__ import annotations

import torch
from torch import nn

from specray.models.layers import ColumnParallelLinear, RowParallelLinear
from specray.models.llama import _STACKED, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from specray.parallel import TPGroup


class ReluSquaredMLP(nn.Module):
    """``down(relu(up(x))^2)``, ``up`` split by columns and ``down`` by rows over ``tp``."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        if config.hidden_act != "relu2":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported for "
                             f"model_type={config.model_type!r}; 'relu2' is")
        bias = bool(getattr(config, "mlp_bias", False))
        self.up_proj = ColumnParallelLinear(config.hidden_size, config.intermediate_size, tp, bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, tp, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        return self.down_proj(torch.relu(self.up_proj(x)).square())


# the checkpoint names merged into our modules when the MLP has no gate (its up projection stands alone)
GATELESS_STACKED = {piece: merged for piece, merged in _STACKED.items() if piece not in (".gate_proj.", ".up_proj.")}


class ArceeDecoderLayer(LlamaDecoderLayer):
    mlp_class = ReluSquaredMLP


class ArceeModel(LlamaModel):
    layer_class = ArceeDecoderLayer


class ArceeForCausalLM(LlamaForCausalLM):
    """AFM for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = ArceeModel
    stacked = GATELESS_STACKED
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
