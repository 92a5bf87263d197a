"""K-EXAONE (``ExaoneMoeForCausalLM``): the Llama stack with K-EXAONE's rules (:mod:`specray.models.llama`: per-head
q/k norms, RoPE on the sliding layers alone where there are any, dense or DeepSeek-V3's experts by
``mlp_layer_types``), and its release's MTP module, the ``mtp`` drafter's:

``mtp.fc`` over ``[pre_fc_norm_embedding(e); pre_fc_norm_hidden(h)]`` (the next token's embedding first), one
decoder layer ``mtp.layers.0`` of the kind ``mtp_layer_types[0]`` names (a sliding layer rotates, a global one does
not, as the stack's own layers of that kind) with a dense MLP, and ``mtp.norm`` before the target's LM head; reused
for every draft step. Read as vLLM's ``ExaoneMoeMTP`` reads it (Qwen3.5's names: :data:`MTP_NAMES`).
"""

from __future__ import annotations

import copy

from torch import nn

from specray.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from specray.parallel import TPGroup

# the release's MTP names (under ``mtp.``) -> the head's
MTP_NAMES = (("fc.", "eh_proj."), ("pre_fc_norm_embedding.", "enorm."), ("pre_fc_norm_hidden.", "hnorm."),
             ("norm.", "norm."), ("layers.0.", "layers.0."))


def mtp_kind(config) -> str:
    """The MTP layer's kind of attention: its config's ``mtp_layer_types[0]``, else a global layer's."""
    kinds = getattr(config, "mtp_layer_types", None) or ["full_attention"]
    return kinds[0]


class ExaoneMoeForCausalLM(LlamaForCausalLM):
    """K-EXAONE for causal LM (module docstring)."""

    mtp_names = MTP_NAMES
    skipped = ("mtp.",)  # the release's MTP module: the mtp drafter's

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False) -> tuple[nn.Module, nn.Module]:
        """The MTP layer's block: the stack's attention as a layer of its kind would have it (sliding or global,
        RoPE on a sliding one alone), split over ``tp`` as the target's layers are, and a dense MLP."""
        layers = config.num_hidden_layers
        mtp = copy.copy(config)
        mtp.layer_types = [*config.layer_types[:layers], mtp_kind(config)]
        return LlamaAttention(mtp, tp, layers), LlamaMLP(config, tp)
