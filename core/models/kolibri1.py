"""Aleph Alpha's Kolibri-1 (``Kolibri1ForCausalLM``), on GLM-4's layer (:mod:`specray.models.glm4`: each block's
output RMS-normed again before it joins the residual stream) with EXAONE 4.0's attention (an RMSNorm over each query
and key head; RoPE on the sliding layers alone, the global ones without, ``layer_types``) and a mixture of experts in
every layer (:class:`~specray.models.moe.SparseMoE`): the top k of router logit + ``e_score_correction_bias``, weighted
by their logits' sigmoids (renormalised with ``norm_topk_prob``), beside a shared MLP
(``shared_expert_intermediate_size``)."""

from __future__ import annotations

import re

from torch import nn

from specray.models.glm4 import Glm4DecoderLayer, Glm4ForCausalLM
from specray.models.llama import _CHECKPOINT_NAMES, LlamaModel
from specray.models.moe import SparseMoE
from specray.parallel import TPGroup


# the release's names (transformers renames them as it loads and back as it saves): the router's correction bias, the
# norms on the blocks' outputs
_CHECKPOINT_NAMES["kolibri1"] = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.moe\.router\.expert_bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.post_attn_norm\.", ".post_self_attn_layernorm."), (r"\.post_ffn_norm\.", ".post_mlp_layernorm.")))


class Kolibri1DecoderLayer(Glm4DecoderLayer):
    @classmethod
    def build_mlp(cls, config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        return SparseMoE(config, tp, expert_parallel)


class Kolibri1Model(LlamaModel):
    layer_class = Kolibri1DecoderLayer


class Kolibri1ForCausalLM(Glm4ForCausalLM):
    """Kolibri-1 for causal LM, sharded over ``tp`` (experts by width, or whole with expert parallelism) and ``pp``."""

    model_class = Kolibri1Model
