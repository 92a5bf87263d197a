"""Microsoft's Phi (``PhiForCausalLM``: phi-1, phi-1.5, phi-2), on the Llama plumbing (:mod:`specray.models.llama`:
partial RoPE on each head's first ``partial_rotary_factor``). Where it differs from Llama:

* one LayerNorm (with a bias) per layer, whose output both blocks read: ``h + attn(ln(h)) + mlp(ln(h))``
  (:class:`~specray.models.classic.ParallelDecoderLayer`); the final norm the same kind (``final_layernorm``);
* biases on q/k/v, the output projection (``dense``) and the LM head; with ``qk_layernorm``, a LayerNorm (weight and
  bias shared by the heads) over each query and key head before RoPE;
* a gateless GELU MLP with biases (``fc1``, ``fc2``).
"""

from __future__ import annotations

import re

from specray.models.arcee import GATELESS_STACKED
from specray.models.classic import ParallelDecoderLayer, llama_view
from specray.models.layers import LayerNorm
from specray.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from specray.parallel import PPGroup, TPGroup

_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.self_attn\.dense\.", ".self_attn.o_proj."), (r"\.self_attn\.(q|k)_layernorm\.", r".self_attn.\1_norm."),
    (r"\.mlp\.fc1\.", ".mlp.c_fc."), (r"\.mlp\.fc2\.", ".mlp.c_proj."), (r"^model\.final_layernorm\.", "model.norm.")))


class PhiAttention(LlamaAttention):
    """Llama's attention; with ``qk_layernorm``, each query and key head LayerNormed over its features first."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        if config.qk_layernorm:
            self.q_norm = LayerNorm(self.head_dim, config.layer_norm_eps)
            self.k_norm = LayerNorm(self.head_dim, config.layer_norm_eps)


class PhiDecoderLayer(ParallelDecoderLayer):
    attention_class = PhiAttention
    one_norm = True


class PhiModel(LlamaModel):
    layer_class = PhiDecoderLayer


class PhiForCausalLM(LlamaForCausalLM):
    """Phi for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = PhiModel
    stacked = GATELESS_STACKED
    # LoRA on q/k/v, the output projection and the MLP: our names (adapters name the checkpoint's: adapter_module
    # renames them)
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        config = llama_view(hf_config, attention_bias=True, lm_head_bias=True, head_dim=None, sliding_window=None,
                            num_key_value_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads)
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES
