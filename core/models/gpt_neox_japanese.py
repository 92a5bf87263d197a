"""ABEJA's GPT-NeoX-Japanese (``GPTNeoXJapaneseForCausalLM``: abeja/gpt-neox-japanese-2.7b), on the Llama plumbing
(:mod:`specray.models.llama`) with GPT-NeoX's pieces (:mod:`specray.models.gpt_neox`, :mod:`specray.models.classic`).
Where it differs from GPT-NeoX:

* Llama's order, never GPT-NeoX's parallel blocks: ``h + attn(ln1(h))``, then ``+ mlp(ln2(.))``, LayerNorms with
  biases;
* no bias on q/k/v, on the attention's output projection (``dense``) nor in the MLP, but for the last layer's
  attention, whose output adds a bias of its own (``attention.dense_bias``: our o_proj's bias on that layer alone);
* the MLP ``intermediate_multiple_size`` times the hidden size wide (a GELU by ``hidden_act``);
* partial RoPE on each head's first ``rotary_pct`` (``rope_parameters``' ``partial_rotary_factor``), q/k/v fused head
  by head in ``query_key_value`` as GPT-NeoX's (split at load, and an adapter's B alike);
* its names: ``gpt_neox_japanese.embed_in`` / ``layers`` / ``final_layer_norm``, the head ``embed_out``, tied to the
  embedding where ``tie_word_embeddings`` says (transformers' default).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from specray.models.arcee import GATELESS_STACKED
from specray.models.classic import FusedQKVAdapters, llama_view
from specray.models.gpt_neox import _BUFFERS, GPTNeoXSequentialLayer
from specray.models.llama import LlamaForCausalLM, LlamaModel
from specray.parallel import PPGroup, TPGroup

_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^gpt_neox_japanese\.embed_in\.", "model.embed_tokens."),
    (r"^gpt_neox_japanese\.final_layer_norm\.", "model.norm."),
    (r"^gpt_neox_japanese\.layers\.", "model.layers."), (r"^embed_out\.", "lm_head."),
    (r"\.attention\.dense_bias$", ".self_attn.o_proj.bias"),
    (r"\.attention\.dense\.", ".self_attn.o_proj."), (r"\.attention\.", ".self_attn."),
    (r"\.mlp\.dense_h_to_4h\.", ".mlp.c_fc."), (r"\.mlp\.dense_4h_to_h\.", ".mlp.c_proj.")))


class GPTNeoXJapaneseLayer(GPTNeoXSequentialLayer):
    """GPT-NeoX's sequential layer, bias-free but for the last layer's attention output (``dense_bias``)."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        last = layer == config.num_hidden_layers - 1
        super().__init__(llama_view(config, attention_out_bias=last), tp, layer, expert_parallel)


class GPTNeoXJapaneseModel(LlamaModel):
    layer_class = GPTNeoXJapaneseLayer


class GPTNeoXJapaneseForCausalLM(FusedQKVAdapters, LlamaForCausalLM):
    """GPT-NeoX-Japanese for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = GPTNeoXJapaneseModel
    stacked = GATELESS_STACKED
    # LoRA on q/k/v (an adapter's query_key_value split head by head, as the weight is), dense and the MLP
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        multiple = hf_config.intermediate_multiple_size
        if not multiple or multiple <= 0:
            raise ValueError(f"intermediate_multiple_size={multiple!r} must be a positive number for "
                             "model_type='gpt_neox_japanese' (the MLP is that many times hidden_size wide)")
        config = llama_view(hf_config, num_key_value_heads=hf_config.num_attention_heads, head_dim=None,
                            sliding_window=None, attention_bias=False, use_bias=False,
                            intermediate_size=int(hf_config.hidden_size * multiple),
                            tie_word_embeddings=getattr(hf_config, "tie_word_embeddings", True))
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        return super()._unfused((name, tensor) for name, tensor in weights if not _BUFFERS.search(name))
