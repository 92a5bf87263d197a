"""OpenAI's GPT-2 (``GPT2LMHeadModel``: gpt2, gpt2-medium / large / xl, distilgpt2, and the models trained in its
layout), on the Llama plumbing (:mod:`specray.models.llama`). Where it differs from Llama:

* no RoPE: a learned embedding of each position joins the token's (``wpe``,
  :class:`~specray.models.classic.LearnedPositionsModel`);
* LayerNorms with biases, biases on every projection, a gateless GELU MLP (``c_fc``, ``c_proj``), the LM head tied;
* its projections are stored as ``Conv1D`` weights, ``[in, out]``: transposed at load, and q/k/v fused as
  ``c_attn`` (split at load);
* its names: ``transformer.wte`` / ``wpe`` / ``h.N`` / ``ln_f`` (the first releases without ``transformer.``).
  Releases also store each layer's causal mask as a tensor (not read).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from specray.models.arcee import GATELESS_STACKED
from specray.models.classic import (GatelessMLP, LearnedPositionsModel, NoRopeAttention, ThirdsQKVAdapters, layer_norm,
                                    llama_view)
from specray.models.layers import materialize
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from specray.parallel import PPGroup, TPGroup

_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^(?:transformer\.)?wte\.", "model.embed_tokens."), (r"^(?:transformer\.)?wpe\.", "model.embed_positions."),
    (r"^(?:transformer\.)?ln_f\.", "model.norm."), (r"^(?:transformer\.)?h\.", "model.layers."),
    (r"\.ln_1\.", ".input_layernorm."), (r"\.ln_2\.", ".post_attention_layernorm."),
    (r"\.attn\.c_proj\.", ".self_attn.o_proj."), (r"\.attn\.", ".self_attn.")))
_BUFFERS = re.compile(r"\.attn\.(?:bias|masked_bias)$")  # each layer's causal mask and its fill value
_CONV1D = re.compile(r"\.(?:attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")  # stored [in, out]


class GPT2DecoderLayer(LlamaDecoderLayer):
    attention_class = NoRopeAttention
    mlp_class = GatelessMLP
    build_norm = staticmethod(layer_norm)  # (the final norm too: LlamaModel.final_norm)


class GPT2Model(LearnedPositionsModel):
    layer_class = GPT2DecoderLayer


class GPT2LMHeadModel(ThirdsQKVAdapters, LlamaForCausalLM):
    """GPT-2 for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = GPT2Model
    stacked = GATELESS_STACKED
    skipped_buffers = _BUFFERS  # the stored tensors that are no weights (OpenAI GPT's: its own)
    # LoRA on q/k/v (an adapter's c_attn: its B's rows split into q, k, v as the weight's are), c_proj and the MLP;
    # PEFT's adapters of a Conv1D are A [r, in] and B [out, r], as a Linear's
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        for flag, supported in (("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True),
                                ("add_cross_attention", False)):
            if bool(getattr(hf_config, flag, supported)) != supported:
                raise ValueError(f"{flag}={not supported} is not supported for model_type='gpt2' (GPT-2's releases "
                                 f"set {flag}={supported})")
        hidden = hf_config.hidden_size
        config = llama_view(hf_config, num_key_value_heads=hf_config.num_attention_heads, head_dim=None,
                            sliding_window=None, attention_bias=True, hidden_act=hf_config.activation_function,
                            layer_norm_eps=hf_config.layer_norm_epsilon,
                            intermediate_size=hf_config.n_inner or 4 * hidden,
                            tie_word_embeddings=getattr(hf_config, "tie_word_embeddings", True))
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        hidden = self.config.hidden_size
        for name, tensor in weights:
            if self.skipped_buffers.search(name):
                continue
            if _CONV1D.search(name):
                tensor = materialize(tensor).t()
            if ".attn.c_attn." in name:  # [3 H, ...]: q, k, v in turn
                yield from ((name.replace(".c_attn.", f".{p}_proj."), tensor[i * hidden:(i + 1) * hidden])
                            for i, p in enumerate("qkv"))
            else:
                yield name, tensor
