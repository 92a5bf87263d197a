"""MiniMax's MiniMax-Text-01 and MiniMax-M1 (``MiniMaxForCausalLM``), hybrid: most layers "lightning" linear attention,
the rest softmax attention (``layer_types``), every layer's MLP Mixtral's experts (:mod:`specray.models.moe`).

Lightning attention is linear attention with a fixed decay per head: per head h, with
``q, k, v = silu(qkv_proj(x))`` (``in_proj`` here; each head's q, k, v in turn) and
``S_t = exp(-s_h) S_(t-1) + k_t v_t^T``, the output is ``q_t S_t`` (no scale); ``s_h = b^(h + 1) (1 - l / (L - 1) +
1e-5)`` with ``b = 2^(-8 / heads)`` at layer l of L. That is the plain gated
rule (:func:`~specray.models.gated_deltanet.gated_delta_scan`, ``delta=False``) with ``g = -s_h`` and ``beta = 1``, so
:class:`LightningAttention` is a :class:`~specray.models.gated_deltanet.RecurrentMixer` whose conv is the identity
(kernel 1: its state is the matrix alone), and the recurrent-state machinery (drafts replayed, token trees, prefix
caching from kept states, graph steps) serves it as it serves Mamba-2's. The heads' outputs are RMS-normed together
(over every head: under tensor parallelism the sum of squares summed over the ranks), gated by
``sigmoid(output_gate(x))`` and projected by ``out_proj``.

The layer's residual is its normed input (DeepNorm's form): ``h = ln1(x)``, ``h = alpha h + beta attn(h)``,
``h = ln2(h)``, ``out = alpha' h + beta' mlp(h)`` (``*_alpha_factor``, ``*_beta_factor``: the linear and the softmax
layers' own). The softmax layers are Mixtral's attention, rotating the first ``rotary_dim`` features of each head where
the config gives it (:func:`with_rotary_dim`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.classic import llama_view
from specray.models.gated_deltanet import RecurrentMixer, RecurrentModel
from specray.models.kv_cache import RecurrentStateSpec
from specray.models.layers import ColumnParallelLinear, RowParallelLinear, _copy, _param, divide, narrow
from specray.models.llama import _CHECKPOINT_NAMES, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from specray.models.moe import FAMILIES, SparseMoE
from specray.parallel import TPGroup

FAMILIES["minimax"] = FAMILIES["mixtral"]
# Mixtral's names, and the lightning layers' own (``self_attn.qkv_proj`` ..., ours ``linear_attn.in_proj`` ...; a
# qkv_proj of ours would be read as q, k and v apart)
_CHECKPOINT_NAMES["minimax"] = ((re.compile(r"\.self_attn\.qkv_proj\."), ".linear_attn.in_proj."),
                                (re.compile(r"\.self_attn\.(out_proj|output_gate|norm)\."), r".linear_attn.\1."),
                                ) + _CHECKPOINT_NAMES["mixtral"]


# what the releases store of the decays, computed here from the config (slopes)
_DECAYS = re.compile(r"\.self_attn\.(?:slope_rate|query_decay|key_decay|diagonal_decay)$")


def slopes(config, layer: int) -> torch.Tensor:
    """Each head's decay rate s_h at layer ``layer`` (module docstring): [heads], float32."""
    heads, layers = config.num_attention_heads, config.num_hidden_layers
    base = 1 / (2 ** (8 / heads))
    rate = base ** (torch.arange(heads, dtype=torch.float32) + 1)
    return rate * (1 - layer / (layers - 1 + 1e-5) + 1e-5)


class _Identity(nn.Module):
    """A kernel-1 depthwise conv of ones, nothing learned (the mixer's conv1d)."""

    def __init__(self, channels: int):
        super().__init__()
        self.register_buffer("weight", torch.ones(channels, 1), persistent=False)
        self.bias = None


class LightningAttention(RecurrentMixer):
    """One lightning-attention layer over this rank's heads (module docstring)."""

    delta_rule = False
    conv_activation = False  # (the silu comes before: on the projection)

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__()
        self.tp = tp
        heads = config.num_attention_heads
        self.dk = self.dv = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.value_heads = divide(heads, tp.size, "num_attention_heads")
        width = heads * self.dk
        self.in_proj = ColumnParallelLinear(config.hidden_size, 3 * width, tp, bias=False)  # per head q | k | v
        self.output_gate = ColumnParallelLinear(config.hidden_size, width, tp, bias=False)
        self.out_proj = RowParallelLinear(width, config.hidden_size, tp, bias=False)
        self.kernel = 1
        self.conv1d = _Identity(3 * self.value_heads * self.dk)
        first, mine = tp.rank * self.value_heads, self.value_heads
        self.register_buffer("decay", -slopes(config, layer)[first:first + mine], persistent=False)  # g per head
        self.norm = nn.Module()  # its weight: this rank's heads' features of the norm over every head
        self.norm.weight = _param(mine * self.dk)
        self.norm.weight.weight_loader = lambda param, loaded: _copy(param, narrow(loaded, 0, first * self.dk,
                                                                                   mine * self.dk))
        self.eps = 1e-6  # (transformers' port: the norm's default, whatever the config says)
        self.width = width

    @property
    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(conv_dim=self.conv1d.weight.shape[0], conv_width=0, num_heads=self.value_heads,
                                  key_dim=self.dk, value_dim=self.dv)

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        # x: [T, H] -> [T, H] (meta.recurrent: see RecurrentMixer.recurrence)
        t = x.shape[0]
        mixed = F.silu(self.in_proj(x))  # [T, heads * 3D], this rank's heads
        g = self.decay.expand(t, -1)  # [T, heads]
        o = self.recurrence(mixed, g, torch.ones_like(g), meta).reshape(t, -1)  # [T, heads * D], float32
        squares = o.pow(2).sum(-1, keepdim=True)  # the norm is over every head: the ranks' sums added
        if self.tp.size > 1:
            squares = self.tp.all_reduce(squares)
        normed = (o * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype) * self.norm.weight
        return self.out_proj(normed * torch.sigmoid(self.output_gate(x)))

    def _split_heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, length, _ = conv.shape
        q, k, v = conv.float().reshape(b, length, self.value_heads, 3 * self.dk).split(self.dk, dim=-1)
        return q, k, v


def with_rotary_dim(config):
    """``config`` with its releases' ``rotary_dim`` (MiniMax-Text-01's: 64 of each head's 128 features) as RoPE's
    partial factor: the softmax layers rotate that many features, as vLLM's port (MiniMax's own) does; transformers'
    port ignores the field and rotates whole heads (the same where the field is absent, as in the tests' models)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary = getattr(config, "rotary_dim", None)
    if not rotary or rotary == head_dim:
        return config
    rope = dict(getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    return llama_view(config, rope_parameters={**rope, "partial_rotary_factor": rotary / head_dim})


class MiniMaxDecoderLayer(LlamaDecoderLayer):
    """A lightning or a softmax layer (``layer_types``), Mixtral's experts, the normed input as the residual."""

    def build_mixer(self, config, tp: TPGroup, layer: int) -> None:
        kind = config.layer_types[layer]
        if kind not in ("linear_attention", "full_attention"):
            raise ValueError(f"layer_types[{layer}]={kind!r} is not supported for model_type='minimax'; "
                             "'linear_attention' or 'full_attention'")
        self.linear = kind == "linear_attention"
        if self.linear:
            self.linear_attn = LightningAttention(config, tp, layer)
            self.alpha, self.beta = config.linear_attn_alpha_factor, config.linear_attn_beta_factor
        else:
            super().build_mixer(config, tp, layer)
            self.alpha, self.beta = config.full_attn_alpha_factor, config.full_attn_beta_factor
        self.mlp_alpha, self.mlp_beta = config.mlp_alpha_factor, config.mlp_beta_factor

    @classmethod
    def build_mlp(cls, config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        return SparseMoE(config, tp, expert_parallel)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: Any, sin: Any,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H], the stream being x + residual -> the MLP's scaled output and the scaled normed input
        h = self.input_layernorm(x if residual is None else x + residual)
        a = self.linear_attn(h, meta) if self.linear else self.self_attn(h, cos, sin, meta)
        h = self.post_attention_layernorm(h * self.alpha + a * self.beta)
        return self.mlp(h) * self.mlp_beta, h * self.mlp_alpha


class MiniMaxModel(LlamaModel):
    layer_class = MiniMaxDecoderLayer


class MiniMaxForCausalLM(RecurrentModel, LlamaForCausalLM):
    """MiniMax-Text-01 / M1 for causal LM, sharded over ``tp`` (the lightning heads and the attention heads split;
    experts by width, or whole with expert parallelism)."""

    model_class = MiniMaxModel
    # LoRA on the softmax layers' q/k/v/o and the lightning layers' projections (the release's qkv_proj is our in_proj:
    # one projection, adapted whole), not the experts
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "output_gate")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False, pp=None):
        super().__init__(with_rotary_dim(hf_config), tp, expert_parallel, pp)

    @classmethod
    def recurrent_layers(cls, config) -> bool:
        return "linear_attention" in config.layer_types

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        return ((name, tensor) for name, tensor in weights if not _DECAYS.search(name))

    def _a_norm(self) -> torch.Tensor:
        return self.model.layers[self.model.stage.start].input_layernorm.weight
