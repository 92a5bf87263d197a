"""Recursive's Flint (``FlintForCausalLM``), Qwen3-MoE's layers (:mod:`specray.models.llama`: an RMSNorm over each query
and key head; dense layers where ``mlp_only_layers`` says) with:

* sliding-window layers beside global ones (``layer_types``), RoPE on the sliding ones alone (the global ones NoPE);
* a learned sink logit per head (``self_attn.sinks``; the release's ``softmax_offset``), as GPT-OSS's;
* experts weighted by the sigmoids of their top k router logits (renormalised with ``norm_topk_prob``), beside a shared
  MLP (``shared_expert``, ``shared_expert_intermediate_size``).
"""

from __future__ import annotations

import re

from specray.models.gpt_oss import sink_attention
from specray.models.llama import _CHECKPOINT_NAMES, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from specray.models.moe import FAMILIES, MoEFamily
from specray.parallel import TPGroup

FAMILIES["flint"] = MoEFamily("topk_sigmoid", "num_experts", "moe_intermediate_size", shared="shared_expert",
                              shared_width="shared_expert_intermediate_size", shared_count=None)
# the sinks (the release's softmax_offset, transformers' sinks) sit on our PagedAttention
_CHECKPOINT_NAMES["flint"] = ((re.compile(r"\.self_attn\.(?:sinks|softmax_offset)$"), ".self_attn.attn.sinks"),)


class FlintAttention(LlamaAttention):
    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        self.attn = sink_attention(self.num_heads, self.attn.kv_spec, self.attn.scale, tp)


class FlintDecoderLayer(LlamaDecoderLayer):
    attention_class = FlintAttention


class FlintModel(LlamaModel):
    layer_class = FlintDecoderLayer


class FlintForCausalLM(LlamaForCausalLM):
    """Flint for causal LM, sharded over ``tp`` (heads and sinks split; experts by width, or whole with expert
    parallelism) and ``pp``."""

    model_class = FlintModel
