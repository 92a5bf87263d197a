"""EleutherAI's GPT-NeoX (``GPTNeoXForCausalLM``: Pythia 70M-12B, GPT-NeoX-20B, and the models trained with its code:
RedPajama-INCITE, Dolly v2), on the Llama plumbing (:mod:`specray.models.llama`: partial RoPE on each head's first
``partial_rotary_factor``, ``attention_bias`` on q/k/v and the output). Where it differs from Llama:

* LayerNorms with biases; with ``use_parallel_residual`` (every release) both blocks read the stream entering the
  layer, each through its own norm: ``h + attn(ln1(h)) + mlp(ln2(h))`` (:class:`~specray.models.classic.
  ParallelDecoderLayer`), else Llama's order;
* a gateless GELU MLP with biases (``dense_h_to_4h``, ``dense_4h_to_h``);
* q/k/v fused head by head (``query_key_value``: each head's q, k and v rows in turn), split at load;
* its names: ``gpt_neox.embed_in``, ``attention.dense``, ``gpt_neox.final_layer_norm``, ``embed_out`` (the head,
  never tied). Older releases also store each layer's causal mask and RoPE frequencies as tensors (not read).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from specray.models.arcee import GATELESS_STACKED
from specray.models.classic import FusedQKVAdapters, GatelessMLP, ParallelDecoderLayer, layer_norm, llama_view
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from specray.parallel import PPGroup, TPGroup

_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^gpt_neox\.embed_in\.", "model.embed_tokens."), (r"^gpt_neox\.final_layer_norm\.", "model.norm."),
    (r"^gpt_neox\.layers\.", "model.layers."), (r"^embed_out\.", "lm_head."),
    (r"\.attention\.dense\.", ".self_attn.o_proj."), (r"\.attention\.", ".self_attn."),
    (r"\.mlp\.dense_h_to_4h\.", ".mlp.c_fc."), (r"\.mlp\.dense_4h_to_h\.", ".mlp.c_proj.")))
# tensors older releases keep that are not weights: each layer's causal mask and its fill value, RoPE's frequencies
_BUFFERS = re.compile(r"\.attention\.(?:bias|masked_bias|rotary_emb\.inv_freq)$")


class GPTNeoXParallelLayer(ParallelDecoderLayer):
    pass


class GPTNeoXSequentialLayer(LlamaDecoderLayer):
    mlp_class = GatelessMLP
    build_norm = staticmethod(layer_norm)


class GPTNeoXModel(LlamaModel):
    layer_class = GPTNeoXParallelLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        if not config.use_parallel_residual:
            self.layer_class = GPTNeoXSequentialLayer
        super().__init__(config, tp, expert_parallel, pp)


class GPTNeoXForCausalLM(FusedQKVAdapters, LlamaForCausalLM):
    """GPT-NeoX for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = GPTNeoXModel
    stacked = GATELESS_STACKED
    # LoRA on q/k/v (an adapter's query_key_value split head by head, as the weight is), dense and the MLP
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        config = llama_view(hf_config, num_key_value_heads=hf_config.num_attention_heads, head_dim=None,
                            tie_word_embeddings=False, sliding_window=None)
        super().__init__(config, tp, expert_parallel, pp)
        self.renames = _RENAMES

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        return super()._unfused((name, tensor) for name, tensor in weights if not _BUFFERS.search(name))
