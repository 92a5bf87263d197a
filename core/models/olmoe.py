"""AI2's OLMoE (``OlmoeForCausalLM``: OLMoE-1B-7B), on the Llama plumbing (:mod:`specray.models.llama`): Llama's
pre-norm layer around OLMo 2's attention (:class:`~specray.models.olmo2.Olmo2Attention`: q and k RMS-normed over all
heads at once, then, where the config sets ``clip_qkv``, q, k and v clamped to it) and experts in every layer
(:mod:`specray.models.moe`'s softmax routing over ``num_experts``, top ``num_experts_per_tok``, renormalised only
where ``norm_topk_prob``; no shared expert)."""

from __future__ import annotations

from torch import nn

from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from specray.models.moe import SparseMoE
from specray.models.olmo2 import Olmo2Attention
from specray.parallel import TPGroup


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_class = Olmo2Attention

    @staticmethod
    def build_mlp(config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        return SparseMoE(config, tp, expert_parallel)


class OlmoeModel(LlamaModel):
    layer_class = OlmoeDecoderLayer


class OlmoeForCausalLM(LlamaForCausalLM):
    """OLMoE for causal LM, sharded over ``tp`` (experts by width, or whole with expert parallelism) and ``pp``."""

    model_class = OlmoeModel
