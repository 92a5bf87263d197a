"""EleutherAI's GPT-Neo (``GPTNeoForCausalLM``: gpt-neo-125m, 1.3B and 2.7B, and the models trained in its layout),
on the Llama plumbing (:mod:`specray.models.llama`). Where it differs from Llama:

* no RoPE: a learned embedding of each position joins the token's (``wpe``,
  :class:`~specray.models.classic.LearnedPositionsModel`);
* global and local attention layers as ``attention_layers`` lists them (expanded by transformers' config from
  ``attention_types``, every release alternating ``global`` and ``local``): a local layer's queries see the last
  ``window_size`` positions, themselves included (a sliding-window cache spec, as Mistral's layers);
* the scores are not scaled (q.k, no ``head_dim ** -0.5``);
* q, k and v without biases, the output projection (``out_proj``) with one; LayerNorms with biases in Llama's order,
  a gateless GELU MLP with biases (``c_fc``, ``c_proj``), the LM head tied to the embedding;
* its names: ``transformer.wte`` / ``wpe`` / ``h.N`` / ``ln_f``, ``attn.attention.q_proj``. Older releases also store
  each layer's causal mask as a tensor (not read).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from specray.models.arcee import GATELESS_STACKED
from specray.models.classic import (ACTIVATIONS, GatelessMLP, LearnedPositionsModel, NoRopeAttention, layer_norm,
                                    llama_view)
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from specray.parallel import PPGroup, TPGroup

_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^transformer\.wte\.", "model.embed_tokens."), (r"^transformer\.wpe\.", "model.embed_positions."),
    (r"^transformer\.ln_f\.", "model.norm."), (r"^transformer\.h\.", "model.layers."),
    (r"\.ln_1\.", ".input_layernorm."), (r"\.ln_2\.", ".post_attention_layernorm."),
    (r"\.attn\.attention\.out_proj\.", ".self_attn.o_proj."), (r"\.attn\.attention\.", ".self_attn.")))
_BUFFERS = re.compile(r"\.attn\.attention\.(?:bias|masked_bias)$")  # each layer's causal (or local) mask, its fill
# a layer kind of attention_layers -> the Llama plumbing's layer_types (a "sliding_attention" layer takes the window)
_LAYER_TYPES = {"global": "full_attention", "local": "sliding_attention"}


class GPTNeoAttention(NoRopeAttention):
    """Learned positions' attention (no RoPE) with unscaled scores."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        self.attn.scale = 1.0


class GPTNeoDecoderLayer(LlamaDecoderLayer):
    attention_class = GPTNeoAttention
    mlp_class = GatelessMLP
    build_norm = staticmethod(layer_norm)  # (the final norm too: LlamaModel.final_norm)


class GPTNeoModel(LearnedPositionsModel):
    layer_class = GPTNeoDecoderLayer


def _checked(config) -> list[str]:
    """The config's layer kinds as the Llama plumbing's ``layer_types``, or a ValueError naming what is not served."""
    kinds = list(config.attention_layers)
    unknown = sorted({k for k in kinds if k not in _LAYER_TYPES}, key=str)
    if unknown:
        raise ValueError(f"attention_types={config.attention_types!r} names layer kinds {unknown}: GPT-Neo's layers "
                         f"are 'global' or 'local' (as transformers builds them)")
    if len(kinds) != config.num_hidden_layers:
        raise ValueError(f"attention_types={config.attention_types!r} lists {len(kinds)} layers but num_layers="
                         f"{config.num_hidden_layers}: give one kind per layer")
    window = config.window_size
    if "local" in kinds and not (isinstance(window, int) and window > 0):
        raise ValueError(f"window_size={window!r}: GPT-Neo's local layers need a positive int (the releases: 256)")
    if config.activation_function not in ACTIVATIONS:
        raise ValueError(f"activation_function={config.activation_function!r} is not supported for "
                         f"model_type='gpt_neo'; one of {sorted(ACTIVATIONS)}")
    return [_LAYER_TYPES[k] for k in kinds]


class GPTNeoForCausalLM(LlamaForCausalLM):
    """GPT-Neo for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = GPTNeoModel
    stacked = GATELESS_STACKED
    # LoRA on q/k/v, the output projection and the MLP: our names (adapters name the checkpoint's, out_proj:
    # adapter_module renames them)
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        layer_types = _checked(hf_config)
        hidden = hf_config.hidden_size
        config = llama_view(
            hf_config, num_key_value_heads=hf_config.num_attention_heads, head_dim=None, attention_bias=False,
            attention_out_bias=True, hidden_act=hf_config.activation_function,
            layer_norm_eps=hf_config.layer_norm_epsilon, intermediate_size=hf_config.intermediate_size or 4 * hidden,
            sliding_window=hf_config.window_size, layer_types=layer_types,
            tie_word_embeddings=getattr(hf_config, "tie_word_embeddings", True))
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        return ((name, tensor) for name, tensor in weights if not _BUFFERS.search(name))
