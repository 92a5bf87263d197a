"""Xiaomi's MiMo-V2-Flash (``MiMoV2FlashForCausalLM``), on the Llama plumbing (:mod:`specray.models.llama`: paged KV
per layer, pipeline stages, weight loading, the model interface). Where it differs from the Llama family:

* queries and keys of ``head_dim`` (192) but values of ``v_head_dim`` (128), the values scaled by
  ``attention_value_scale``; the paged cache keeps one width for both, so a value is stored padded with zeros to the
  key's width (a third of the value half of the cache holds zeros) and the padding is dropped from the output;
* sliding-window layers (``layer_types``) with twice the KV heads of the full ones and a learned sink logit per query
  head (GPT-OSS's, :class:`~specray.models.attention.PagedAttention`'s explicit path); each kind its own partial RoPE
  (:class:`~specray.models.olmo3.RopePerKind`);
* each layer's MLP dense or a mixture of experts as ``mlp_layer_types`` names it: DeepSeek-V3's grouped sigmoid router
  with its correction bias, no shared expert (:mod:`specray.models.moe`, the ``mimo_v2_flash`` row).

Under tensor parallelism the query heads, both kinds of KV heads (each a multiple of the ranks) and the sinks split
over the ranks.

Its releases' multi-token-prediction modules (``model.mtp.layers.{k}``) are the ``mtp`` drafter's: each DeepSeek's
``eh_proj(cat(enorm(e), hnorm(h)))`` into a block of a sliding-window layer (its KV heads, sinks and RoPE) with a
dense MLP, then ``final_layernorm`` and the target's LM head (:meth:`MiMoV2FlashForCausalLM.mtp_layer_parts`,
:data:`MTP_NAMES`); one module reused for every draft step, or the first K chained
(``speculative_config.num_nextn_predict_layers``).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.kv_cache import FullAttentionSpec, SlidingWindowSpec
from specray.models.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, _copy, apply_rotary, divide, narrow
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from specray.models.moe import SparseMoE
from specray.models.olmo3 import RopePerKindModel
from specray.parallel import PPGroup, TPGroup

# the sinks (the release's attention_sink_bias, transformers' sinks) sit on our PagedAttention
_SINK_NAMES = ((re.compile(r"\.self_attn\.(?:sinks|attention_sink_bias)$"), ".self_attn.attn.sinks"),)


# the release's MTP module k (under model.mtp.layers.{k}.) in the mtp head's names
MTP_NAMES = (("enorm.", "enorm."), ("hnorm.", "hnorm."), ("eh_proj.", "eh_proj."), ("final_layernorm.", "norm."),
             ("input_layernorm.", "layers.0.input_layernorm."),
             ("pre_mlp_layernorm.", "layers.0.post_attention_layernorm."),
             ("post_attention_layernorm.", "layers.0.post_attention_layernorm."),
             ("self_attn.attention_sink_bias", "layers.0.self_attn.attn.sinks"),
             ("self_attn.sinks", "layers.0.self_attn.attn.sinks"),
             ("self_attn.", "layers.0.self_attn."), ("mlp.", "layers.0.mlp."))


class MiMoV2Attention(nn.Module):
    def __init__(self, config, tp: TPGroup, sliding: bool):
        super().__init__()
        kv = config.num_key_value_heads * (2 if sliding else 1)
        self.head_dim, self.v_dim = config.head_dim, config.v_head_dim
        self.num_heads = divide(config.num_attention_heads, tp.size, "num_attention_heads")
        self.num_kv_heads = divide(kv, tp.size, "the layer's KV heads (sliding layers: 2 x num_key_value_heads)")
        bias, h = bool(getattr(config, "attention_bias", False)), config.hidden_size
        self.q_proj = ColumnParallelLinear(h, config.num_attention_heads * self.head_dim, tp, bias=bias)
        self.k_proj = ColumnParallelLinear(h, kv * self.head_dim, tp, bias=bias)
        self.v_proj = ColumnParallelLinear(h, kv * self.v_dim, tp, bias=bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.v_dim, h, tp)
        self.v_scale = float(getattr(config, "attention_value_scale", None) or 1.0)
        heads = dict(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                     kv_head_start=tp.rank * self.num_kv_heads)
        spec = SlidingWindowSpec(**heads, sliding_window=config.sliding_window) if sliding else \
            FullAttentionSpec(**heads)
        self.attn = PagedAttention(self.num_heads, spec, self.head_dim ** -0.5, sinks=sliding)
        if sliding:
            first = tp.rank * self.num_heads

            def load_sinks(param: nn.Parameter, loaded: Any) -> None:
                _copy(param, narrow(loaded, 0, first, self.num_heads))

            self.attn.sinks.weight_loader = load_sinks

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, 1, R/2] (the layer kind's, partial) -> [T, H]
        t = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.v_dim) * self.v_scale
        v = F.pad(v, (0, self.head_dim - self.v_dim))  # stored at the keys' width
        out = self.attn(q, k, v, meta).view(t, self.num_heads, self.head_dim)[..., : self.v_dim]
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))


class MiMoV2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        nn.Module.__init__(self)
        self.self_attn = MiMoV2Attention(config, tp, config.layer_types[layer] == "sliding_attention")
        sparse = config.mlp_layer_types[layer] == "sparse"
        self.mlp = SparseMoE(config, tp, expert_parallel) if sparse else LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MiMoV2Model(RopePerKindModel):
    layer_class = MiMoV2DecoderLayer


class MiMoV2FlashForCausalLM(LlamaForCausalLM):
    """MiMo-V2-Flash for causal LM, sharded over ``tp`` and ``pp`` (see the module docstring)."""

    model_class = MiMoV2Model
    stacked = {".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}  # q, k, v apart
    lora_modules: tuple[str, ...] = ()  # no adapters for it yet

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.renames = _SINK_NAMES

    skipped = ("model.mtp.",)  # the release's MTP modules: the mtp drafter's
    mtp_module_prefix = "model.mtp.layers.{k}."  # the release's MTP modules, in the mtp head's names by MTP_NAMES
    mtp_names = MTP_NAMES
    mtp_layer_type = "sliding_attention"  # the MTP layer rotates by the sliding layers' RoPE

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False) -> tuple[nn.Module, nn.Module]:
        """An MTP module's block: a sliding-window layer's attention (twice the KV heads, sinks) and a dense MLP,
        split over ``tp`` as the target's layers are (:class:`~specray.models.draft_head.DraftHead` builds the
        rest)."""
        return MiMoV2Attention(config, tp, sliding=True), LlamaMLP(config, tp)
