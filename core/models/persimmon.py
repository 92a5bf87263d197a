"""Adept's Persimmon (``PersimmonForCausalLM``: Persimmon-8B base and chat), on the Llama plumbing
(:mod:`specray.models.llama`: partial RoPE on each head's first ``partial_rotary_factor``). Where it differs from
Llama:

* LayerNorms with biases before each block and after the last layer (``final_layernorm``);
* q/k/v fused head by head (``query_key_value``: each head's q, k and v rows in turn), split at load; biases on q/k/v
  and the output projection (``dense``); with ``qk_layernorm``, a LayerNorm (weight and bias shared by the heads)
  over each query and key head before RoPE (:class:`~specray.models.phi.PhiAttention`);
* a gateless MLP of squared ReLUs with biases (``dense_h_to_4h``, ``dense_4h_to_h``); the LM head never tied.
"""

from __future__ import annotations

import re

from specray.models.arcee import GATELESS_STACKED
from specray.models.classic import FusedQKVAdapters, GatelessMLP, layer_norm, llama_view
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from specray.models.phi import PhiAttention
from specray.parallel import PPGroup, TPGroup

_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.self_attn\.dense\.", ".self_attn.o_proj."), (r"\.self_attn\.(q|k)_layernorm\.", r".self_attn.\1_norm."),
    (r"\.mlp\.dense_h_to_4h\.", ".mlp.c_fc."), (r"\.mlp\.dense_4h_to_h\.", ".mlp.c_proj."),
    (r"^model\.final_layernorm\.", "model.norm.")))


class PersimmonDecoderLayer(LlamaDecoderLayer):
    attention_class = PhiAttention
    mlp_class = GatelessMLP
    build_norm = staticmethod(layer_norm)  # (the final norm too: LlamaModel.final_norm)


class PersimmonModel(LlamaModel):
    layer_class = PersimmonDecoderLayer


class PersimmonForCausalLM(FusedQKVAdapters, LlamaForCausalLM):
    """Persimmon for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = PersimmonModel
    stacked = GATELESS_STACKED
    # LoRA on q/k/v (an adapter's query_key_value split head by head, as the weight is), dense and the MLP
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        config = llama_view(hf_config, num_key_value_heads=hf_config.num_attention_heads, head_dim=None,
                            sliding_window=None, attention_bias=True, tie_word_embeddings=False)
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES
