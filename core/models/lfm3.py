"""Liquid AI's LFM3 (``Lfm3ForCausalLM``: LFM3-1.7B), LFM2's layers (:mod:`specray.models.lfm2`: gated short convs
beside attention with q/k RMSNorms, a SwiGLU MLP, the same recurrent-state machinery) with:

* a third kind of layer, ``sliding_attention`` (the last ``sliding_window`` positions), beside ``full_attention``
  and ``conv`` (``layer_types``);
* each attention kind's own RoPE (``rope_parameters[kind]``): the sliding layers' plain, the full layers'
  "proportional" (Gemma 4's: a whole head's frequencies, the first ``partial_rotary_factor`` of the pairs rotated);
* with ``use_attention_gate``, each head's attention output times ``sigmoid(g_proj(x))``, one gate per head from
  the layer's input;
* with ``use_sandwich_norm``, an RMSNorm on the mixer's and the MLP's outputs before they join the residual stream
  (``post_operator_norm``, ``post_ffn_norm``);
* its MLP ``intermediate_size`` wide as the config says (no width adjustment).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.gemma4 import ProportionalRotaryEmbedding
from specray.models.layers import (ColumnParallelLinear, RotaryEmbedding, VocabParallelEmbedding, rope_parameters,
                                   rotary_dim)
from specray.models.lfm2 import Lfm2Attention, Lfm2ForCausalLM, Lfm2Layer, ShortConv
from specray.models.glm4 import Glm4DecoderLayer
from specray.models.llama import _CHECKPOINT_NAMES, LlamaModel, _head_dim
from specray.parallel import TPGroup

KINDS = ("conv", "sliding_attention", "full_attention")


class Lfm3Attention(Lfm2Attention):
    """LFM2's attention; with ``use_attention_gate``, each of this rank's heads' outputs times a sigmoid gate."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        self.g_proj = ColumnParallelLinear(config.hidden_size, config.num_attention_heads, tp, bias=False) \
            if config.use_attention_gate else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        out = self.attn(*self.project(x, cos, sin, meta), meta)  # [T, heads * D]
        if self.g_proj is not None:
            t = x.shape[0]
            gate = torch.sigmoid(self.g_proj(x)).unsqueeze(-1)  # [T, heads, 1]
            out = (out.view(t, self.num_heads, self.head_dim) * gate).view(t, -1)
        return self.o_proj(out)


class Lfm3Layer(Lfm2Layer):
    """LFM2's layer with a third kind (sliding attention) and the sandwich norms."""

    attention_class = Lfm3Attention

    forward = Glm4DecoderLayer.forward  # (the norms on the blocks' outputs under GLM-4's names)

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__(config, tp, layer, expert_parallel)
        sandwich = bool(config.use_sandwich_norm)
        self.post_self_attn_layernorm = self.build_norm(config) if sandwich else None
        self.post_mlp_layernorm = self.build_norm(config) if sandwich else None

    def build_mixer(self, config, tp: TPGroup, layer: int) -> None:
        kind = config.layer_types[layer]
        if kind not in KINDS:
            raise ValueError(f"layer_types[{layer}]={kind!r} is not supported for model_type='lfm3'; one of "
                             f"{list(KINDS)}")
        self.is_conv = kind == "conv"
        if self.is_conv:
            self.conv = ShortConv(config, tp)
        else:
            self.self_attn = self.attention_class(config, tp, layer)


def _rotary(config, kind: str) -> RotaryEmbedding:
    """The RoPE of ``kind``'s layers: "proportional" as Gemma 4's, else as the Llama plumbing builds it."""
    head_dim = _head_dim(config)
    params = dict((config.rope_parameters or {}).get(kind) or {})
    if params.get("rope_type") == "proportional":
        return ProportionalRotaryEmbedding(head_dim, params, config.max_position_embeddings)
    rope = rope_parameters(config, kind, partial=True)
    return RotaryEmbedding(rotary_dim(head_dim, rope), rope, config.max_position_embeddings)


class Lfm3Model(LlamaModel):
    layer_class = Lfm3Layer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp=None):
        nn.Module.__init__(self)
        self.layer_types = list(config.layer_types)
        self.rotary = nn.ModuleDict({kind: _rotary(config, kind) for kind in sorted(set(self.layer_types))
                                     if kind != "conv"})
        self.embedding_multiplier = 1.0
        self.build_stage(config, pp, lambda i: Lfm3Layer(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: self.final_norm(config))

    def rope_tables(self, meta: AttentionMetadata, dtype: torch.dtype) -> Callable[[int], tuple]:
        """Layer index -> the (cos, sin) of its kind's table (a conv layer's: none)."""
        tables = {}
        for kind, rotary in self.rotary.items():
            rotary.ensure(meta.max_position + 1)
            tables[kind] = rotary(meta.positions, dtype)
        return lambda layer: tables.get(self.layer_types[layer], (None, None))


# LFM2's names, the release's name of the heads' gate (transformers renames it g_proj as it loads, and back as it
# saves), its norms on the blocks' outputs under GLM-4's names
_CHECKPOINT_NAMES["lfm3"] = (((re.compile(r"\.self_attn\.gate_proj\."), ".self_attn.g_proj."),
                              (re.compile(r"\.post_operator_norm\."), ".post_self_attn_layernorm."),
                              (re.compile(r"\.post_ffn_norm\."), ".post_mlp_layernorm."))
                             + _CHECKPOINT_NAMES["lfm2"])


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    """LFM3 for causal LM, sharded over ``tp`` as LFM2 is (the gates' heads with the attention's)."""

    model_class = Lfm3Model
    # LFM2's, and the heads' gate (``self_attn.gate_proj`` in the release, ``g_proj`` here)
    lora_modules = Lfm2ForCausalLM.lora_modules + ("g_proj",)
