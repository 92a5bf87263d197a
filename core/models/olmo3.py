"""AI2's OLMo 3 (``Olmo3ForCausalLM``: Olmo-3 7B and 32B, base, Instruct and Think): OLMo 2's layers
(:mod:`specray.models.olmo2`: post-norm blocks, q and k RMS-normed over all heads) with two kinds of layer:

* ``layer_types`` names each layer "sliding_attention" (attending to the last ``sliding_window`` positions) or
  "full_attention" (three sliding layers to one full one in the releases);
* each kind has its own RoPE (``rope_parameters[layer_type]``): the long-context releases scale the full layers'
  (YaRN) and leave the sliding layers' plain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.layers import RMSNorm, RotaryEmbedding, VocabParallelEmbedding, rope_parameters, rotary_dim
from specray.models.llama import LlamaModel, _head_dim
from specray.models.olmo2 import Olmo2DecoderLayer, Olmo2ForCausalLM, Olmo2Model
from specray.parallel import PPGroup, TPGroup

LAYER_TYPES = ("sliding_attention", "full_attention")


class RopePerKind:
    """A stack whose kinds of layer (``layer_types``) each rotate by their own RoPE table (``rope_parameters[kind]``,
    partial RoPE allowed): OLMo 3's, MiMo-V2-Flash's."""

    def build_ropes(self, config, kinds: Sequence[str] = LAYER_TYPES) -> None:
        layer_kinds = list(config.layer_types)
        if len(layer_kinds) != config.num_hidden_layers or not set(layer_kinds) <= set(kinds):
            raise ValueError(f"layer_types={layer_kinds} must name one of {list(kinds)} for each of the "
                             f"num_hidden_layers={config.num_hidden_layers} layers")
        self.layer_types = layer_kinds
        ropes = {kind: rope_parameters(config, kind, partial=True) for kind in sorted(set(layer_kinds))}
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(rotary_dim(_head_dim(config), rope), rope,
                                                           config.max_position_embeddings)
                                     for kind, rope in ropes.items()})

    def rope_tables(self, meta: AttentionMetadata, dtype: torch.dtype) -> Callable[[int], tuple[torch.Tensor, ...]]:
        """Layer index -> the (cos, sin) of its kind's table."""
        tables = {}
        for kind, rotary in self.rotary.items():
            rotary.ensure(meta.max_position + 1)
            tables[kind] = rotary(meta.positions, dtype)
        return lambda layer: tables[self.layer_types[layer]]


class RopePerKindModel(RopePerKind, LlamaModel):
    """Llama's stack (its ``layer_class``, an RMSNorm after the last layer) with a RoPE table per kind of layer:
    MiMo-V2-Flash's, Mellum 2's, Laguna's."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)
        self.build_ropes(config)
        self.build_stage(config, pp, lambda i: self.layer_class(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))


class Olmo3Model(RopePerKind, Olmo2Model):
    """OLMo 2's stack with a RoPE table per kind of layer (the full layers' YaRN-scaled, the sliding ones' not)."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)
        self.build_ropes(config)
        self.build_stage(config, pp, lambda i: Olmo2DecoderLayer(config, tp, i),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3 for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = Olmo3Model
