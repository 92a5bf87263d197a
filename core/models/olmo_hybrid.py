"""AI2's OLMo Hybrid (``OlmoHybridForCausalLM``): OLMo 3's post-norm attention layers (q and k RMS-normed over all
heads: :mod:`specray.models.olmo2`) among pre-norm linear-attention layers (``layer_types``), each a Gated DeltaNet
(:mod:`specray.models.gated_deltanet`, its recurrent state per request) that differs from Qwen3-Next's in three ways:

* q, k and v come from projections of their own (``q_proj``, ``k_proj``, ``v_proj``: here one merged projection,
  loaded part by part, a LoRA adapter of each part keeping its own A), the output gate from ``g_proj``, the decay
  and strength from ``a_proj`` and ``b_proj``;
* with ``linear_allow_neg_eigval`` the strength is ``2 * sigmoid(b)`` (in [0, 2]: negative eigenvalues allowed);
* the gated output norm's epsilon is 1e-5 whatever ``rms_norm_eps`` says.

The attention layers rotate q and k where the config gives a ``rope_theta`` (as transformers and vLLM do: the
releases leave it null, which transformers' config fills with 10000, so they rotate), and attend without RoPE where it
gives none. Served as the other linear-attention hybrids are (n-gram chains, chunked prefill, preemption, prefix
caching, TP over the heads of both kinds of layer). LoRA adapters adapt every linear a PEFT adapter of the release
names (attention's and the linear layers' q/k/v/o, g_proj, a_proj, b_proj, the MLPs); the convs are refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.gated_deltanet import GatedDeltaNet, GatedRMSNorm, RecurrentModel, check_linear_heads_split
from specray.models.kimi_delta import PartwiseColumnLinear
from specray.models.layers import RMSNorm, loaded_whole, materialize
from specray.models.llama import _STACKED, LlamaForCausalLM, LlamaMLP, LlamaModel, _head_dim
from specray.models.olmo2 import Olmo2DecoderLayer
from specray.parallel import TPGroup

# the release's names -> ours: its layers' norms (transformers renames them alike), and the linear layers' as
# Qwen3-Next's, which GatedDeltaNet's modules carry (q/k/v and their convs: parts of one each)
_RENAMES = tuple((re.compile(a), b) for a, b in (
    (r"\.attention_layer_norm\.", ".input_layernorm."), (r"\.feedforward_layer_norm\.", ".post_attention_layernorm."),
    (r"\.linear_attn\.([qkv])_proj\.", r".linear_attn.in_proj_\1."),
    (r"\.linear_attn\.([qkv])_conv1d\.", r".linear_attn.conv1d_\1."),
    (r"\.linear_attn\.a_proj\.", ".linear_attn.in_proj_a."), (r"\.linear_attn\.b_proj\.", ".linear_attn.in_proj_b."),
    (r"\.linear_attn\.g_proj\.", ".linear_attn.in_proj_z."), (r"\.linear_attn\.o_proj\.", ".linear_attn.out_proj."),
    (r"\.linear_attn\.o_norm\.", ".linear_attn.norm.")))
_STACKED_QKV = {**{f".in_proj_{p}.": (".in_proj_qkv.", i) for i, p in enumerate("qkv")},
                **{f".conv1d_{p}.": (".conv1d.", i) for i, p in enumerate("qkv")}}
_PART = re.compile(r"\.(in_proj_qkv|conv1d)\.weight:(\d)$")
GATED_NORM_EPS = 1e-5  # the release's gated output norm's (transformers': OlmoHybridRMSNormGated(eps=1e-5))


class OlmoGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's Gated DeltaNet with OLMo Hybrid's differences (module docstring)."""

    def __init__(self, config, tp: TPGroup):
        super().__init__(config, tp)
        # q | k | v from three checkpoint tensors: merged part by part (a LoRA adapter of each part has its own A)
        self.in_proj_qkv = PartwiseColumnLinear(config.hidden_size, list(self.in_proj_qkv.output_sizes), tp)
        self.beta_scale = 2.0 if getattr(config, "linear_allow_neg_eigval", True) else 1.0
        self.norm = GatedRMSNorm(self.dv, GATED_NORM_EPS)
        self.conv1d.weight.weight_loader = self._load_conv_part
        self._conv_parts: dict[int, torch.Tensor] = {}  # the conv's pieces come so far (_load_conv_part)

    def _load_conv_part(self, param: nn.Parameter, loaded: Any, shard: int | None = None) -> None:
        """The release's conv in three pieces (``q_conv1d``, ``k_conv1d``, ``v_conv1d``; ``shard``: which), joined in
        order once all three came, then loaded as one conv (this rank's channels of q, k and v): the pieces are read
        by their order, not their sizes (a folder transformers saved cuts the joined conv in three near-equal
        pieces, not at q | k | v); the whole conv without ``shard``."""
        if shard is None:
            self._load_conv(param, loaded)
            return
        self._conv_parts[shard] = materialize(loaded)
        if len(self._conv_parts) == 3:
            self._load_conv(param, torch.cat([self._conv_parts.pop(i) for i in range(3)]))

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        # x: [T, H] -> [T, H] (meta.recurrent: see GatedDeltaNet.recurrence)
        t = x.shape[0]
        mixed = self.in_proj_qkv(x)  # [T, C]: q | k | v before the conv
        z = self.in_proj_z(x).view(t, self.value_heads, self.dv)  # g_proj: the output gate
        beta = self.in_proj_b(x).sigmoid().float() * self.beta_scale  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [T, Hv]
        o = self.recurrence(mixed, g, beta, meta)  # [T, Hv, dv]
        return self.out_proj(self.norm(o.to(x.dtype), z).reshape(t, -1))


class OlmoLinearLayer(nn.Module):
    """A pre-norm linear-attention layer, in the Llama stack's lazy-residual form."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        self.linear_attn = OlmoGatedDeltaNet(config, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: the stream is x + residual -> (the MLP's output, the stream before it)
        h = x if residual is None else x + residual
        h = h + self.linear_attn(self.input_layernorm(h), meta)
        return self.mlp(self.post_attention_layernorm(h)), h


def _no_rope(config) -> bool:
    rope = getattr(config, "rope_parameters", None)
    return not isinstance(rope, dict) or rope.get("rope_theta") is None


class OlmoHybridModel(LlamaModel):
    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp=None):
        kinds = list(config.layer_types)
        if len(kinds) != config.num_hidden_layers or not set(kinds) <= {"linear_attention", "full_attention"}:
            raise ValueError(f"layer_types={kinds} must name 'linear_attention' or 'full_attention' for each of the "
                             f"num_hidden_layers={config.num_hidden_layers} layers")
        self.nope = _no_rope(config)
        self.layer_class = lambda c, t, i, ep: (OlmoLinearLayer(c, t) if kinds[i] == "linear_attention"
                                                else Olmo2DecoderLayer(c, t, i))
        super().__init__(config if not self.nope else _with_default_rope(config), tp, expert_parallel, pp)
        self.half_dim = _head_dim(config) // 2

    def rope_tables(self, meta: AttentionMetadata, dtype: torch.dtype) -> Callable[[int], tuple[torch.Tensor, ...]]:
        if not self.nope:
            return super().rope_tables(meta, dtype)
        t = meta.positions.shape[0]  # NoPE: a rotation by 0 (cos 1, sin 0) leaves q and k as they are
        cos = torch.ones(t, 1, self.half_dim, dtype=dtype, device=meta.positions.device)
        tables = (cos, torch.zeros_like(cos))
        return lambda layer: tables


def _with_default_rope(config):
    """The config with a plain RoPE table to build the stack's (never used: the layers attend without it)."""
    import copy

    config = copy.copy(config)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    return config


class OlmoHybridForCausalLM(RecurrentModel, LlamaForCausalLM):
    """OLMo Hybrid for causal LM, sharded over ``tp``: the attention heads as OLMo 2's, the linear-attention heads
    as Qwen3-Next's (each layer's kind by ``layer_types``)."""

    model_class = OlmoHybridModel
    stacked = {**_STACKED, **_STACKED_QKV}
    # LoRA on every linear of the release: attention's q/k/v/o, the linear layers' q/k/v (parts of in_proj_qkv, named
    # in_proj_q/k/v once renamed), g_proj (in_proj_z), a_proj, b_proj and o_proj (out_proj), and the MLPs; not the
    # convs (q_conv1d ...)
    lora_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                     "in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_a", "in_proj_b",
                                     "out_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False, pp=None):
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.renames = _RENAMES

    def _check_loaded(self, loaded: set[str], params: dict[str, nn.Parameter]) -> None:
        """A fused projection or conv loaded from its three parts counts as loaded once all three came."""
        super()._check_loaded(loaded_whole(loaded, _PART), params)

    def _a_norm(self) -> torch.Tensor:
        return self.model.layers[self.model.stage.start].post_attention_layernorm.weight  # (both kinds have one)

    check_split = staticmethod(check_linear_heads_split)
