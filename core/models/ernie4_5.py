"""ERNIE 4.5 (``Ernie4_5ForCausalLM``, ``Ernie4_5_MoeForCausalLM``): the Llama stack with ERNIE's rules
(:mod:`specray.models.llama`: biases by ``use_bias``, RoPE on interleaved pairs, experts from
``moe_layer_start_index``), and its releases' MTP module, the ``mtp`` drafter's, as Baidu's training code runs it:

at position p the module reads the target's residual stream past its last layer (before the final norm: aux layer
``num_hidden_layers``) and the next token's embedding, ``mtp_linear_proj([mtp_emb_norm(e); mtp_hidden_norm(h)])``,
runs one decoder layer (``mtp_block``, a dense one: past ``moe_layer_end_index``), and its output goes through the
target's own final norm (``model.norm``) and LM head. The release names them ``model.mtp_emb_norm.{k}``,
``model.mtp_hidden_norm.{k}``, ``model.mtp_linear_proj.{k}`` and ``model.mtp_block.{k}`` (:func:`mtp_tensor`).
"""

from __future__ import annotations

import re

from torch import nn

from specray.models.llama import _CHECKPOINT_NAMES, LlamaAttention, LlamaForCausalLM, LlamaMLP
from specray.parallel import TPGroup

_MTP = re.compile(r"^model\.(mtp_emb_norm|mtp_hidden_norm|mtp_linear_proj|mtp_block)\.(\d+)\.(.*)$")
_OURS = {"mtp_emb_norm": "enorm.", "mtp_hidden_norm": "hnorm.", "mtp_linear_proj": "eh_proj.", "mtp_block": "layers.0."}


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    """ERNIE 4.5, dense or with experts, for causal LM (module docstring)."""

    aux_past_end = True  # its MTP module reads the residual past the last layer
    skipped = ("model.mtp_",)  # the release's MTP module (model.mtp_block.0., ...): the mtp drafter's

    @staticmethod
    def mtp_feature_layers(config) -> tuple[int, ...]:
        """What the MTP module reads of the target: the residual stream past its last layer, before the norm."""
        return (config.num_hidden_layers,)

    @staticmethod
    def mtp_tensor(name: str, model_type: str) -> tuple[int, str] | None:
        """A checkpoint tensor's (module, name in the head) where it is the MTP module's (the target's final norm is
        every module's last norm: module -1), else None."""
        if name == "model.norm.weight":
            return -1, "norm.weight"
        found = _MTP.match(name)
        if found is None:
            return None
        kind, k, rest = found.groups()
        ours = _OURS[kind] + rest
        if kind == "mtp_block":  # the block's names as the target's layers have them
            for pattern, replacement in _CHECKPOINT_NAMES.get(model_type, ()):
                ours = pattern.sub(replacement, ours)
        return int(k), ours

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False) -> tuple[nn.Module, nn.Module]:
        """The MTP block: the stack's attention (biases, interleaved RoPE) and a dense MLP."""
        return LlamaAttention(config, tp, config.num_hidden_layers), LlamaMLP(config, tp)
