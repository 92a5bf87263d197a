"""Swiss AI's Apertus (``ApertusForCausalLM``: Apertus-8B, 70B), on the Llama plumbing (:mod:`specray.models.llama`:
Llama 3's RoPE scaling, Qwen3's RMSNorm over each query and key head by ``model_type``). Where it differs from Llama:
a gateless MLP ``down(xielu(up(x)))`` (AFM's names: ``up_proj`` not merged) whose activation has learned scalars per
layer, and the norms' names (``attention_layernorm``, ``feedforward_layernorm``), read as Llama's.

xIELU (Huang et al., 2024): ``a_p x^2 + b x`` for x > 0, else ``a_n (expm1(min(x, eps)) - x) + b x``, with
``a_p = softplus(alpha_p)`` and ``a_n = b + softplus(alpha_n)``; computed in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.arcee import ArceeForCausalLM
from specray.models.layers import ColumnParallelLinear, RowParallelLinear
from specray.models.llama import LlamaDecoderLayer, LlamaModel
from specray.parallel import TPGroup


class XIELU(nn.Module):
    """The xIELU activation with its checkpoint's scalars (``alpha_p``, ``alpha_n`` [1]; ``beta``, ``eps`` [])."""

    def __init__(self):
        super().__init__()
        self.alpha_p = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.beta = nn.Parameter(torch.tensor(0.5), requires_grad=False)
        self.eps = nn.Parameter(torch.tensor(-1e-6), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf, beta = x.float(), self.beta.float()
        a_p, a_n = F.softplus(self.alpha_p.float()), beta + F.softplus(self.alpha_n.float())
        negative = (torch.expm1(torch.minimum(xf, self.eps.float())) - xf) * a_n
        return torch.where(xf > 0, a_p * xf * xf, negative).add_(beta * xf).to(x.dtype)


class ApertusMLP(nn.Module):
    """``down(xielu(up(x)))``, ``up`` split by columns and ``down`` by rows over ``tp``."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        if config.hidden_act != "xielu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported for model_type="
                             f"{config.model_type!r}; 'xielu' is")
        self.up_proj = ColumnParallelLinear(config.hidden_size, config.intermediate_size, tp)
        self.act_fn = XIELU()
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        return self.down_proj(self.act_fn(self.up_proj(x)))


class ApertusDecoderLayer(LlamaDecoderLayer):
    mlp_class = ApertusMLP


class ApertusModel(LlamaModel):
    layer_class = ApertusDecoderLayer


class ApertusForCausalLM(ArceeForCausalLM):
    """Apertus for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is (AFM's names and LoRA modules)."""

    model_class = ApertusModel
