"""Microsoft's Phi-3.5-MoE (``PhimoeForCausalLM``: Phi-3.5-MoE-instruct, Phi-tiny-MoE), on the Llama plumbing
(:mod:`specray.models.llama`: LongRoPE, ``attention_bias`` on q/k/v and o, Mixtral's names for its experts, and an
LM head with a bias where ``lm_head_bias``). Where it differs from Mixtral: LayerNorms with biases (before each block
and after the last layer) and the sparsemixer's choice of two experts (:mod:`specray.models.moe`'s ``phimoe`` row)."""

from __future__ import annotations

from torch import nn

from specray.models.layers import LayerNorm
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def _layer_norm(config) -> nn.Module:
    return LayerNorm(config.hidden_size, config.rms_norm_eps)  # (the config names its LayerNorms' eps so)


class PhimoeDecoderLayer(LlamaDecoderLayer):
    build_norm = staticmethod(_layer_norm)  # (the final norm too: LlamaModel.final_norm)


class PhimoeModel(LlamaModel):
    layer_class = PhimoeDecoderLayer


class PhimoeForCausalLM(LlamaForCausalLM):
    """Phi-3.5-MoE for causal LM, sharded over ``tp`` (experts by width, or whole with expert parallelism) and
    ``pp``."""

    model_class = PhimoeModel
