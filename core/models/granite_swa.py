"""IBM's Granite SWA (``GraniteSWAForCausalLM``: granite-swash), Granite's layers (:mod:`specray.models.llama`: its
multipliers) with:

* sliding-window layers beside global ones (``layer_types``);
* a learned sink logit per head (``self_attn.sinks``), as GPT-OSS's (:mod:`specray.models.gpt_oss`): it joins each
  query's softmax and takes its share of the probability;
* each layer's own RoPE base (``layer_rope_theta``), 0 for a layer without RoPE (NoPE).

Its MoE releases (``GraniteMoeSWAForCausalLM``: granite-swash-3b-a600m) are the same layers over Granite's shared MoE
(experts in every layer beside a shared MLP, its names).
"""

from __future__ import annotations

import re
from collections.abc import Callable
import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.gpt_oss import sink_attention
from specray.models.layers import RotaryEmbedding, rope_parameters, rotary_dim
from specray.models.llama import _CHECKPOINT_NAMES, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, \
    _head_dim
from specray.parallel import PPGroup, TPGroup

# the checkpoint's sinks sit on the attention module; ours on its PagedAttention, which attends with them
_CHECKPOINT_NAMES["granite_swa"] = ((re.compile(r"\.self_attn\.sinks$"), ".self_attn.attn.sinks"),)
_CHECKPOINT_NAMES["granitemoe_swa"] = _CHECKPOINT_NAMES["granite_swa"] + _CHECKPOINT_NAMES["granitemoeshared"]


class GraniteSWAAttention(LlamaAttention):
    """Granite's attention with a sink logit per head (this rank's heads'), and no RoPE where its base is 0."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        self.attn = sink_attention(self.num_heads, self.attn.kv_spec, self.attn.scale, tp)
        self.use_rope = bool(config.layer_rope_theta[layer])


class GraniteSWADecoderLayer(LlamaDecoderLayer):
    attention_class = GraniteSWAAttention


class GraniteSWAModel(LlamaModel):
    layer_class = GraniteSWADecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__(config, tp, expert_parallel, pp)
        self.thetas = [float(theta) for theta in config.layer_rope_theta]
        if len(self.thetas) != config.num_hidden_layers:
            raise ValueError(f"layer_rope_theta has {len(self.thetas)} entries for num_hidden_layers="
                             f"{config.num_hidden_layers}: give one RoPE base per layer (0 for none)")
        rope = rope_parameters(config, partial=True)
        self.rotary = nn.ModuleDict({_key(theta): RotaryEmbedding(rotary_dim(_head_dim(config), rope),
                                                                 {**rope, "rope_theta": theta},
                                                                 config.max_position_embeddings)
                                     for theta in sorted(set(self.thetas)) if theta})

    def rope_tables(self, meta: AttentionMetadata, dtype: torch.dtype) -> Callable[[int], tuple]:
        """Layer index -> the (cos, sin) of its base's table (a NoPE layer's: none)."""
        tables = {}
        for theta, rotary in self.rotary.items():
            rotary.ensure(meta.max_position + 1)
            tables[theta] = rotary(meta.positions, dtype)
        return lambda layer: tables.get(_key(self.thetas[layer]), (None, None))


def _key(theta: float) -> str:
    """A RoPE base as a module name (no dots)."""
    return f"theta_{theta!r}".replace(".", "_")


class GraniteSWAForCausalLM(LlamaForCausalLM):
    """Granite SWA for causal LM, sharded over ``tp`` (heads and their sinks split) and ``pp``."""

    model_class = GraniteSWAModel


class GraniteMoeSWAForCausalLM(GraniteSWAForCausalLM):
    """Granite SWA's MoE releases: the same layers, Granite's shared MoE in each (experts by width, or whole with
    expert parallelism)."""
