"""BigCode's StarCoder2 (``Starcoder2ForCausalLM``: StarCoder2 3B / 7B / 15B), on the Llama plumbing
(:mod:`specray.models.llama`; its ``use_bias`` flag biases q/k/v and o, and ``sliding_window`` slides every layer as
Mistral's). Where it differs from Llama: LayerNorms with biases (before each block and after the last layer), and a
gateless MLP ``c_proj(gelu_tanh(c_fc(x)))`` with biases
(:class:`~specray.models.classic.GatelessMLP`)."""

from __future__ import annotations

from torch import nn

from specray.models.arcee import GATELESS_STACKED
from specray.models.classic import GatelessMLP
from specray.models.layers import LayerNorm
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def _layer_norm(config) -> nn.Module:
    return LayerNorm(config.hidden_size, config.norm_epsilon, bias=bool(getattr(config, "use_bias", True)))


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    mlp_class = GatelessMLP
    build_norm = staticmethod(_layer_norm)  # (the final norm too: LlamaModel.final_norm)


class Starcoder2Model(LlamaModel):
    layer_class = Starcoder2DecoderLayer


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """StarCoder2 for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = Starcoder2Model
    stacked = GATELESS_STACKED
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")
