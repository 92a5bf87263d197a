"""BigCode's GPT-BigCode (``GPTBigCodeForCausalLM``: StarCoder, StarCoderBase, SantaCoder, WizardCoder, OctoCoder,
IBM's Granite Code 20B / 34B), on the Llama plumbing (:mod:`specray.models.llama`). GPT-2's layout (learned
positions, LayerNorms with biases, biases everywhere, a gateless GELU MLP) with these differences:

* multi-query attention (``multi_query``: every release): one key/value head shared by every query head, q/k/v fused
  as ``c_attn`` ``[q (hidden), k (head_dim), v (head_dim)]``; without it, one KV head per query head fused head by
  head; split at load either way (:func:`~specray.models.classic.split_grouped_qkv`: one group, or one per head);
* plain ``Linear`` weights (GPT-2's are ``Conv1D``); the head tied unless ``tie_word_embeddings`` is false;
* scores unscaled where ``scale_attn_weights`` is false.

Its names: ``transformer.wte`` / ``wpe`` / ``h.N`` / ``ln_f``, ``attn.c_attn`` / ``c_proj``, ``mlp.c_fc`` /
``c_proj``. Refused by name: cross-attention (``add_cross_attention``).
"""

from __future__ import annotations

import re
from specray.models.arcee import GATELESS_STACKED
from specray.models.classic import (FusedQKVAdapters, GatelessMLP, LearnedPositionsModel, NoRopeAttention, layer_norm,
                                    llama_view)
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from specray.parallel import PPGroup, TPGroup

_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^transformer\.wte\.", "model.embed_tokens."), (r"^transformer\.wpe\.", "model.embed_positions."),
    (r"^transformer\.ln_f\.", "model.norm."), (r"^transformer\.h\.", "model.layers."),
    (r"\.ln_1\.", ".input_layernorm."), (r"\.ln_2\.", ".post_attention_layernorm."),
    (r"\.attn\.c_proj\.", ".self_attn.o_proj."), (r"\.attn\.", ".self_attn.")))


class GPTBigCodeAttention(NoRopeAttention):
    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        if not config.scale_attn_weights:  # scores as q.k (the releases scale them by head_dim ** -0.5)
            self.attn.scale = 1.0


class GPTBigCodeDecoderLayer(LlamaDecoderLayer):
    attention_class = GPTBigCodeAttention
    mlp_class = GatelessMLP
    build_norm = staticmethod(layer_norm)  # (the final norm too: LlamaModel.final_norm)


class GPTBigCodeModel(LearnedPositionsModel):
    layer_class = GPTBigCodeDecoderLayer


class GPTBigCodeForCausalLM(FusedQKVAdapters, LlamaForCausalLM):
    """GPT-BigCode for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is (the one KV head of
    multi-query attention on every rank)."""

    model_class = GPTBigCodeModel
    stacked = GATELESS_STACKED
    fused_qkv = ".c_attn."
    # LoRA on q/k/v (an adapter's c_attn split as the weight is), c_proj and the MLP
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        if getattr(hf_config, "add_cross_attention", False):
            raise ValueError("add_cross_attention=True is not supported for model_type='gpt_bigcode' (a decoder with "
                             "cross-attention over an encoder's states); specray serves its decoder-only releases")
        heads = hf_config.num_attention_heads
        config = llama_view(hf_config, num_key_value_heads=1 if hf_config.multi_query else heads, head_dim=None,
                            sliding_window=None, attention_bias=True, hidden_act=hf_config.activation_function,
                            layer_norm_eps=hf_config.layer_norm_epsilon,
                            intermediate_size=hf_config.n_inner or 4 * hf_config.hidden_size)
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES
