"""Meta's OPT (``OPTForCausalLM``: OPT-125M to OPT-66B, and Galactica, which shares its layout), on the Llama plumbing
(:mod:`specray.models.llama`). Where it differs from Llama:

* no RoPE: a learned embedding of each position joins the token's, from row ``position + 2`` of its table
  (:class:`~specray.models.classic.LearnedPositionsModel`);
* LayerNorms with biases before each block (``self_attn_layer_norm``, ``final_layer_norm``) and after the last layer,
  biases on every projection (``enable_bias``), a gateless ReLU MLP (``fc1``, ``fc2``), the LM head tied;
* its names: ``model.decoder.*`` (some releases ``decoder.*``), ``self_attn.out_proj``.

OPT-350M's layout (each block's norm after it, ``do_layer_norm_before=False``; embeddings narrower than the layers,
``word_embed_proj_dim``) is refused by name.
"""

from __future__ import annotations

import re

from specray.models.arcee import GATELESS_STACKED
from specray.models.classic import GatelessMLP, LearnedPositionsModel, NoRopeAttention, layer_norm, llama_view
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from specray.parallel import PPGroup, TPGroup

_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^(?:model\.)?decoder\.final_layer_norm\.", "model.norm."), (r"^(?:model\.)?decoder\.", "model."),
    (r"\.self_attn_layer_norm\.", ".input_layernorm."), (r"\.final_layer_norm\.", ".post_attention_layernorm."),
    (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."), (r"\.fc1\.", ".mlp.c_fc."), (r"\.fc2\.", ".mlp.c_proj.")))


class OPTDecoderLayer(LlamaDecoderLayer):
    attention_class = NoRopeAttention
    mlp_class = GatelessMLP
    build_norm = staticmethod(layer_norm)  # (the final norm too: LlamaModel.final_norm)


class OPTModel(LearnedPositionsModel):
    layer_class = OPTDecoderLayer
    position_offset = 2


class OPTForCausalLM(LlamaForCausalLM):
    """OPT for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = OPTModel
    stacked = GATELESS_STACKED
    # LoRA on q/k/v, the output projection and the MLP: our names (adapters name the checkpoint's: adapter_module
    # renames them)
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        checks = (("do_layer_norm_before", True, "each block's norm after it, OPT-350M's"),
                  ("word_embed_proj_dim", hf_config.hidden_size, "embeddings projected to the layers' width, "
                   "OPT-350M's"), ("_remove_final_layer_norm", False, "no norm after the last layer"),
                  ("layer_norm_elementwise_affine", True, "LayerNorms without a weight"))
        for field, supported, what in checks:
            value = getattr(hf_config, field, supported)
            if value != supported:
                raise ValueError(f"{field}={value!r} is not supported for model_type='opt' ({what}); specray serves "
                                 f"OPT releases with {field}={supported!r}")
        config = llama_view(hf_config, num_key_value_heads=hf_config.num_attention_heads, head_dim=None,
                            sliding_window=None, attention_bias=hf_config.enable_bias, use_bias=hf_config.enable_bias,
                            hidden_act=hf_config.activation_function, layer_norm_eps=1e-5,
                            intermediate_size=hf_config.ffn_dim)
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES
