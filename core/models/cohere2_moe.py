"""Cohere's MoE Command models (``Cohere2MoeForCausalLM``: Command A+), on Command R7B's layer
(:mod:`specray.models.cohere2`: one norm whose output attention and MLP read in parallel, RoPE on interleaved pairs on
the sliding layers, scaled logits). Where it differs:

* each layer's MLP is dense (``mlp_layer_types``: the first layers', ``prefix_dense_intermediate_size`` wide) or a
  mixture of experts (:class:`~specray.models.moe.SparseMoE`): the top ``num_experts_per_tok`` router logits, weighted
  by their softmax, or by their sigmoids (``expert_selection_fn``), renormalised where ``norm_topk_prob``; with
  ``num_shared_experts``, a shared MLP that wide times over, its output added to the experts' or averaged with it
  (``shared_expert_combination_strategy``);
* the dense prefix layers rotate q and k too where ``prefix_dense_sliding_window_pattern`` is 1 (all of them global);
* the norms are RMSNorms where the config gives ``rms_norm_eps``, else Command's bias-free LayerNorms.
"""

from __future__ import annotations

from torch import nn

from specray.models.cohere2 import Cohere2DecoderLayer, Cohere2ForCausalLM, Cohere2Model, CohereAttention
from specray.models.layers import LayerNorm, RMSNorm
from specray.models.llama import LlamaMLP
from specray.models.moe import SparseMoE
from specray.parallel import TPGroup


def norm(config) -> nn.Module:
    """The norm before each layer's blocks and after the last layer: an RMSNorm, or a bias-free LayerNorm."""
    if getattr(config, "rms_norm_eps", None) is not None:
        return RMSNorm(config.hidden_size, config.rms_norm_eps)
    return LayerNorm(config.hidden_size, config.layer_norm_eps, bias=False)


class Cohere2MoeDecoderLayer(Cohere2DecoderLayer):
    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        nn.Module.__init__(self)
        self.self_attn = CohereAttention(config, tp, layer)
        if config.mlp_layer_types[layer] == "dense":
            width = config.prefix_dense_intermediate_size or config.intermediate_size
            self.mlp = LlamaMLP(config, tp, width)
        else:
            self.mlp = SparseMoE(config, tp, expert_parallel)
        self.input_layernorm = norm(config)


class Cohere2MoeModel(Cohere2Model):
    layer_class = Cohere2MoeDecoderLayer

    @staticmethod
    def final_norm(config) -> nn.Module:
        return norm(config)


class Cohere2MoeForCausalLM(Cohere2ForCausalLM):
    """Command A+ for causal LM, sharded over ``tp`` (experts by width, or whole with expert parallelism) and
    ``pp``."""

    model_class = Cohere2MoeModel
