"""AI2's first OLMo (``OlmoForCausalLM``: OLMo-1B, OLMo-7B, their 0424 / 0724 releases), on the Llama plumbing
(:mod:`specray.models.llama`: ``clip_qkv`` clamps q, k and v as projected). Where it differs from Llama: its norms
(before each block and after the last layer) are LayerNorms without a weight or a bias, eps 1e-5."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.layers import RMSNorm
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

EPS = 1e-5  # transformers' OlmoLayerNorm: fixed, whatever the config says


class WeightlessLayerNorm(RMSNorm):
    """A LayerNorm with nothing learned, in float32; with ``residual``, as :class:`RMSNorm` (adds it first)."""

    def __init__(self, hidden_size: int):
        super().__init__(hidden_size, EPS)
        del self.weight  # nothing to load; an empty buffer in its place carries the model's dtype and device
        self.register_buffer("weight", torch.empty(0), persistent=False)  # (LlamaForCausalLM reads them there)
        self.hidden_size = hidden_size

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (self.hidden_size,), None, None, self.eps).to(x.dtype)


class OlmoDecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def build_norm(config) -> nn.Module:  # (the final norm too: LlamaModel.final_norm)
        return WeightlessLayerNorm(config.hidden_size)


class OlmoModel(LlamaModel):
    layer_class = OlmoDecoderLayer


class OlmoForCausalLM(LlamaForCausalLM):
    """OLMo for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = OlmoModel
