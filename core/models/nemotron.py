"""NVIDIA's Nemotron (``NemotronForCausalLM``: Nemotron-4, Minitron), on the Llama plumbing
(:mod:`specray.models.llama`: partial RoPE from ``partial_rotary_factor``, ``attention_bias``). Where it differs from
Llama: LayerNorms with biases that scale by ``1 + weight`` (``LayerNorm1P``, before each block and after the last
layer) and AFM's gateless MLP ``down(relu(up(x))^2)`` (:class:`~specray.models.arcee.ReluSquaredMLP`)."""

from __future__ import annotations

from torch import nn

from specray.models.arcee import ArceeForCausalLM, ReluSquaredMLP
from specray.models.layers import LayerNorm
from specray.models.llama import LlamaDecoderLayer, LlamaModel
from specray.parallel import TPGroup


def _layer_norm_1p(config) -> nn.Module:
    return LayerNorm(config.hidden_size, config.norm_eps, bias=True, unit_offset=True)


class NemotronDecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def build_norm(config) -> nn.Module:
        return _layer_norm_1p(config)

    @staticmethod
    def build_mlp(config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        return ReluSquaredMLP(config, tp)


class NemotronModel(LlamaModel):
    layer_class = NemotronDecoderLayer

    @staticmethod
    def final_norm(config) -> nn.Module:
        return _layer_norm_1p(config)


class NemotronForCausalLM(ArceeForCausalLM):
    """Nemotron for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is (AFM's names and LoRA modules)."""

    model_class = NemotronModel
