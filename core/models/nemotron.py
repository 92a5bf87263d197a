"""NVIDIA's Nemotron (``NemotronForCausalLM``: Nemotron-4, Minitron), on the Llama plumbing
(:mod:`specray.models.llama`: partial RoPE from ``partial_rotary_factor``, ``attention_bias``). Where it differs from
Llama: LayerNorms with biases that scale by ``1 + weight`` (``LayerNorm1P``, before each block and after the last
layer) and AFM's gateless MLP ``down(relu(up(x))^2)`` (:class:`~specray.models.arcee.ReluSquaredMLP`)."""

from __future__ import annotations

from torch import nn

from specray.models.arcee import ArceeDecoderLayer, ArceeForCausalLM
from specray.models.layers import LayerNorm
from specray.models.llama import LlamaModel


def _layer_norm_1p(config) -> nn.Module:
    return LayerNorm(config.hidden_size, config.norm_eps, bias=True, unit_offset=True)


class NemotronDecoderLayer(ArceeDecoderLayer):
    build_norm = staticmethod(_layer_norm_1p)  # (the final norm too: LlamaModel.final_norm)


class NemotronModel(LlamaModel):
    layer_class = NemotronDecoderLayer


class NemotronForCausalLM(ArceeForCausalLM):
    """Nemotron for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is (AFM's names and LoRA modules)."""

    model_class = NemotronModel
