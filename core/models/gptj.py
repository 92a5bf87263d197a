"""EleutherAI's GPT-J (``GPTJForCausalLM``: GPT-J-6B and its fine-tunes), on the Llama plumbing
(:mod:`specray.models.llama`). Where it differs from Llama:

* one LayerNorm (with a bias) per layer, whose output both blocks read: ``h + attn(ln_1(h)) + mlp(ln_1(h))``
  (:class:`~specray.models.classic.ParallelDecoderLayer`);
* RoPE on the interleaved pairs of each head's first ``rotary_dim`` features (the rest pass through);
* no biases in the attention, a gateless GELU MLP with biases (``fc_in``, ``fc_out``), an LM head with a bias;
* its names: ``transformer.wte``, ``transformer.h.N``, ``attn.out_proj``, ``transformer.ln_f``. Releases also store
  each layer's causal mask as a tensor (not read).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from specray.models.arcee import GATELESS_STACKED
from specray.models.classic import ParallelDecoderLayer, llama_view
from specray.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from specray.parallel import PPGroup, TPGroup

_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^transformer\.wte\.", "model.embed_tokens."), (r"^transformer\.ln_f\.", "model.norm."),
    (r"^transformer\.h\.", "model.layers."), (r"\.ln_1\.", ".input_layernorm."),
    (r"\.attn\.out_proj\.", ".self_attn.o_proj."), (r"\.attn\.", ".self_attn."),
    (r"\.mlp\.fc_in\.", ".mlp.c_fc."), (r"\.mlp\.fc_out\.", ".mlp.c_proj.")))
_BUFFERS = re.compile(r"\.attn\.(?:bias|masked_bias)$")  # each layer's causal mask and its fill value


class GPTJAttention(LlamaAttention):
    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        self.interleaved_rope = True


class GPTJDecoderLayer(ParallelDecoderLayer):
    attention_class = GPTJAttention
    one_norm = True


class GPTJModel(LlamaModel):
    layer_class = GPTJDecoderLayer


class GPTJForCausalLM(LlamaForCausalLM):
    """GPT-J for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = GPTJModel
    stacked = GATELESS_STACKED
    # LoRA on q/k/v, the output projection and the MLP: our names (adapters name the checkpoint's: adapter_module
    # renames them)
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        heads, hidden = hf_config.num_attention_heads, hf_config.hidden_size
        rotary = hf_config.rotary_dim or hidden // heads  # (none: the whole head)
        config = llama_view(
            hf_config, num_key_value_heads=heads, head_dim=None, sliding_window=None, attention_bias=False,
            lm_head_bias=True, hidden_act=hf_config.activation_function, layer_norm_eps=hf_config.layer_norm_epsilon,
            intermediate_size=hf_config.n_inner or 4 * hidden,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": rotary / (hidden // heads)})
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        return ((name, tensor) for name, tensor in weights if not _BUFFERS.search(name))
