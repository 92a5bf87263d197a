"""TII's Falcon (``FalconForCausalLM``: Falcon-7B / 40B / 180B, Falcon 2 11B), on the Llama plumbing
(:mod:`specray.models.llama`). Where it differs from Llama:

* q/k/v fused KV head by KV head (``query_key_value``: each KV head's queries, then its key and value), split at
  load: the 40B / 180B layout (``new_decoder_architecture``, ``num_kv_heads`` of them), 7B's one shared KV head
  (``multi_query``), or one KV head per query head;
* LayerNorms with biases; attention and MLP in parallel, reading the stream through a norm each (``ln_attn``,
  ``ln_mlp``: ``num_ln_in_parallel_attn = 2``, the new layout's default) or one for both (``input_layernorm``: 7B,
  Falcon 2), or one after the other (``parallel_attn`` false);
* a gateless GELU MLP (``dense_h_to_4h``, ``dense_4h_to_h``), biases where ``bias``, the head tied;
* its names: ``transformer.word_embeddings``, ``transformer.h.N``, ``self_attention``, ``transformer.ln_f``.

Falcon-RW (``alibi``): no RoPE but ALiBi's bias (:mod:`specray.models.alibi`), scaled with the scores (its bias is
added before they are scaled by ``head_dim ** -0.5``), its blocks in sequence with a KV head per query head.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from specray.models.alibi import AlibiSelfAttention
from specray.models.arcee import GATELESS_STACKED
from specray.models.attention import AttentionMetadata
from specray.models.classic import (FusedQKVAdapters, GatelessMLP, ParallelDecoderLayer, PositionFreeModel, layer_norm,
                                    llama_view)
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from specray.parallel import PPGroup, TPGroup

_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^transformer\.word_embeddings\.", "model.embed_tokens."), (r"^transformer\.ln_f\.", "model.norm."),
    (r"^transformer\.h\.", "model.layers."), (r"\.self_attention\.dense\.", ".self_attn.o_proj."),
    (r"\.self_attention\.", ".self_attn."), (r"\.ln_attn\.", ".input_layernorm."),
    (r"\.ln_mlp\.", ".post_attention_layernorm."), (r"\.mlp\.dense_h_to_4h\.", ".mlp.c_fc."),
    (r"\.mlp\.dense_4h_to_h\.", ".mlp.c_proj.")))


class FalconSequentialLayer(LlamaDecoderLayer):
    mlp_class = GatelessMLP
    build_norm = staticmethod(layer_norm)  # (the final norm too: LlamaModel.final_norm)


class FalconRWLayer(FalconSequentialLayer):
    attention_class = AlibiSelfAttention


class FalconParallelLayer(ParallelDecoderLayer):
    """Attention and MLP reading the stream through a norm each (``ln_attn``, ``ln_mlp``)."""


class FalconOneNormLayer(ParallelDecoderLayer):
    one_norm = True


def num_kv_heads(config) -> int:
    """The KV heads the fused q/k/v holds (module docstring)."""
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


class FalconModel(LlamaModel):
    layer_class = FalconSequentialLayer  # (every kind's norms are LayerNorms: the final one too)

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        if config.alibi:
            if config.new_decoder_architecture or config.parallel_attn:
                raise ValueError("alibi=True is supported for model_type='falcon' with its blocks in sequence, as "
                                 "Falcon-RW's (new_decoder_architecture=false, parallel_attn=false): no ALiBi "
                                 "release has parallel blocks")
            self.layer_class = FalconRWLayer
        elif config.new_decoder_architecture:
            two = (config.num_ln_in_parallel_attn or 2) == 2
            self.layer_class = FalconParallelLayer if two else FalconOneNormLayer
        else:
            self.layer_class = FalconOneNormLayer if config.parallel_attn else FalconSequentialLayer
        super().__init__(config, tp, expert_parallel, pp)
        self.alibi = config.alibi

    def rope_tables(self, meta: AttentionMetadata, dtype: torch.dtype) -> Callable[[int], tuple[Any, Any]]:
        if self.alibi:  # (no layer rotates)
            return PositionFreeModel.rope_tables(self, meta, dtype)
        return super().rope_tables(meta, dtype)


class FalconForCausalLM(FusedQKVAdapters, LlamaForCausalLM):
    """Falcon for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is (7B's one KV head on every rank)."""

    model_class = FalconModel
    stacked = GATELESS_STACKED
    # LoRA on q/k/v (an adapter's query_key_value split KV head by KV head, as the weight is), dense and the MLP
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        config = llama_view(hf_config, num_key_value_heads=num_kv_heads(hf_config), head_dim=None,
                            sliding_window=None, attention_bias=hf_config.bias, use_bias=hf_config.bias,
                            hidden_act=hf_config.activation, layer_norm_eps=hf_config.layer_norm_epsilon,
                            intermediate_size=hf_config.ffn_hidden_size or 4 * hf_config.hidden_size,
                            alibi_scale=(hf_config.hidden_size // hf_config.num_attention_heads) ** -0.5)
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES
