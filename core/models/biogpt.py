"""Microsoft's BioGPT (``BioGptForCausalLM``, model type ``biogpt``: microsoft/biogpt, BioGPT-Large and
BioGPT-Large-PubMedQA), on the Llama plumbing (:mod:`specray.models.llama`) with the classic families' pieces
(:mod:`specray.models.classic`). Where it differs from Llama:

* no RoPE: a learned embedding of each position joins the token's, from row ``position + 2`` of its table (fairseq's
  offset, as OPT's: :class:`~specray.models.classic.LearnedPositionsModel`);
* the token embedding scaled by ``sqrt(hidden_size)`` where ``scale_embedding`` says (every release);
* pre-LayerNorms with biases (``self_attn_layer_norm``, ``final_layer_norm``; ``biogpt.layer_norm`` after the last
  layer), all at eps 1e-5 (transformers builds them at torch's default and never reads ``layer_norm_eps``); biases on
  q/k/v, ``out_proj`` and the gateless MLP (``fc1``, ``fc2``, ``hidden_act``), scores scaled by ``head_dim ** -0.5``;
* the LM head (``output_projection``) tied to the embedding, no bias.

Its names: ``biogpt.embed_tokens`` / ``embed_positions`` / ``layers.N`` / ``layer_norm``, ``output_projection``.
"""

from __future__ import annotations

import math
import re

from specray.models.arcee import GATELESS_STACKED
from specray.models.classic import GatelessMLP, LearnedPositionsModel, NoRopeAttention, layer_norm, llama_view
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from specray.parallel import PPGroup, TPGroup

LAYER_NORM_EPS = 1e-5  # every LayerNorm's (torch's default, which transformers' BioGPT keeps)
POSITION_OFFSET = 2  # the learned table's first rows are unused (fairseq's padding offset)
_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^biogpt\.layer_norm\.", "model.norm."), (r"^biogpt\.", "model."), (r"^output_projection\.", "lm_head."),
    (r"\.self_attn_layer_norm\.", ".input_layernorm."), (r"\.final_layer_norm\.", ".post_attention_layernorm."),
    (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."), (r"\.fc1\.", ".mlp.c_fc."), (r"\.fc2\.", ".mlp.c_proj.")))


class BioGptDecoderLayer(LlamaDecoderLayer):
    attention_class = NoRopeAttention
    mlp_class = GatelessMLP
    build_norm = staticmethod(layer_norm)  # (the final norm too: LlamaModel.final_norm)


class BioGptModel(LearnedPositionsModel):
    """Learned positions from row ``position + 2``, the token embedding scaled by sqrt(hidden_size)."""

    layer_class = BioGptDecoderLayer
    position_offset = POSITION_OFFSET

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__(config, tp, expert_parallel, pp)
        self.embedding_multiplier = math.sqrt(config.hidden_size) if config.scale_embedding else 1.0


class BioGptForCausalLM(LlamaForCausalLM):
    """BioGPT for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = BioGptModel
    stacked = GATELESS_STACKED
    # LoRA on q/k/v, out_proj and the MLP (an adapter names fc1 / fc2 / out_proj, renamed as the weights are)
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        config = llama_view(hf_config, num_key_value_heads=hf_config.num_attention_heads, head_dim=None,
                            sliding_window=None, attention_bias=True, layer_norm_eps=LAYER_NORM_EPS,
                            tie_word_embeddings=getattr(hf_config, "tie_word_embeddings", True))
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES
