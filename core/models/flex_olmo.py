"""AI2's FlexOlmo (``FlexOlmoForCausalLM``: FlexOlmo-7x7B-1T and its RT release), on the Llama plumbing
(:mod:`specray.models.llama`): OLMo 2's post-norm layer (:class:`~specray.models.olmo2.Olmo2DecoderLayer`: q and k
RMS-normed over all heads, each block's output normed before it joins the stream) with OLMoE's experts in every layer
(:mod:`specray.models.moe`'s softmax routing over ``num_experts``, top ``num_experts_per_tok``, renormalised only
where ``norm_topk_prob``; no shared expert)."""

from __future__ import annotations

from torch import nn

from specray.models.llama import LlamaModel
from specray.models.moe import SparseMoE
from specray.models.olmo2 import Olmo2DecoderLayer, Olmo2ForCausalLM
from specray.parallel import TPGroup


class FlexOlmoDecoderLayer(Olmo2DecoderLayer):
    @staticmethod
    def build_mlp(config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        return SparseMoE(config, tp, expert_parallel)


class FlexOlmoModel(LlamaModel):
    layer_class = FlexOlmoDecoderLayer


class FlexOlmoForCausalLM(Olmo2ForCausalLM):
    """FlexOlmo for causal LM, sharded over ``tp`` (experts by width, or whole with expert parallelism) and ``pp``."""

    model_class = FlexOlmoModel
