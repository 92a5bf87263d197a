"""LFM2 (``Lfm2ForCausalLM``: Liquid AI's LFM2-350M / 700M / 1.2B / 2.6B) and LFM2-MoE (``Lfm2MoeForCausalLM``:
LFM2-8B-A1B) on the Llama plumbing (:mod:`specray.models.llama`): most layers are gated short convolutions, the rest
(``layer_types``) attention with q/k RMSNorms; a SwiGLU MLP in every layer, or in LFM2-MoE's after its first
``num_dense_layers`` a mixture of experts (:class:`~specray.models.moe.SparseMoE`: sigmoid scores, the top k of
score + ``expert_bias``, renormalised, times ``routed_scaling_factor``).

The short conv of a token t, with ``in_proj(x_t) = [B; C; x]`` (each ``hidden_size`` wide):
``y_t = C_t * sum_j w[:, j] * (B * x)_{t - K + 1 + j}``, a depthwise causal conv of width K (``conv_L_cache``) over
``B * x``, no activation, then ``out_proj``. Its only state is the conv's last K - 1 inputs, which the recurrent-state
machinery keeps per request as it keeps Gated DeltaNet's and Mamba-2's (:class:`ShortConv` is a
:class:`~specray.models.gated_deltanet.RecurrentMixer` with no matrix: its rule returns the conv's output as it is),
so drafts are replayed, token trees verified and graph steps taken as there. Channels split over tensor-parallel ranks
(the conv is depthwise, so it stays local); ``out_proj`` reduces once.

Checkpoint names: ``conv.`` (``in_proj``, ``conv``, ``out_proj``), ``self_attn.`` with ``out_proj``,
``q_layernorm`` and ``k_layernorm``, ``feed_forward.`` with ``w1`` / ``w3`` / ``w2`` (gate, up, down),
``operator_norm`` and ``ffn_norm`` before the mixer and the MLP, and ``model.embedding_norm``, which despite its name
is the norm after the last layer. The MLP's width is the config's ``intermediate_size`` adjusted as transformers
does (``block_auto_adjust_ff_dim``: two thirds, times ``block_ffn_dim_multiplier``, rounded up to
``block_multiple_of``)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.gated_deltanet import ConvOnlyMixer, FusedColumnLinear, RecurrentModel, depthwise_conv
from specray.models.kv_cache import RecurrentStateSpec
from specray.models.layers import RMSNorm, RowParallelLinear, divide
from specray.models.llama import _CHECKPOINT_NAMES, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, \
    LlamaModel
from specray.models.moe import SparseMoE
from specray.parallel import TPGroup


class ShortConv(ConvOnlyMixer):
    """LFM2's gated short conv over this rank's channels (module docstring); its checkpoint's ``conv.conv`` is
    ``conv1d`` here, the name every recurrent mixer's conv has."""

    conv_activation = False

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        h = config.hidden_size
        self.width = divide(h, tp.size, "hidden_size")
        self.kernel = config.conv_L_cache
        bias = bool(config.conv_bias)
        self.in_proj = FusedColumnLinear(h, [h, h, h], tp, bias=bias)  # B | C | x, one checkpoint tensor
        self.conv1d = depthwise_conv(tp, self.width, self.kernel, bias)
        self.out_proj = RowParallelLinear(h, h, tp, bias=bias)

    @property
    def state_spec(self) -> RecurrentStateSpec:
        # the conv's history and pending inputs; no matrix (no heads) and no gates
        return RecurrentStateSpec(conv_dim=self.width, conv_width=self.kernel - 1, num_heads=0, key_dim=1,
                                  value_dim=1)

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        # x: [T, H] -> [T, H] (meta.recurrent: see RecurrentMixer.recurrence)
        t = x.shape[0]
        b, c, h = self.in_proj(x).split(self.width, dim=-1)
        none = x.new_zeros(t, 0, dtype=torch.float32)  # no decay, no strength: nothing but the conv
        y = self.recurrence(b * h, none, none, meta).reshape(t, -1)  # [T, C]
        return self.out_proj(c * y.to(x.dtype))


class Lfm2Attention(LlamaAttention):
    """Llama's attention with RMSNorms over each head's q and k (``q_layernorm``, ``k_layernorm``)."""

    def __init__(self, config, tp: TPGroup, layer: int, input_size: int | None = None):
        super().__init__(config, tp, layer, input_size)
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps)


def mlp_width(config) -> int:
    """The dense MLP's width as transformers' LFM2 computes it from ``intermediate_size`` (LFM2-MoE's: as it is)."""
    width = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):
        width = int(2 * width / 3)
        if config.block_ffn_dim_multiplier is not None:
            width = int(config.block_ffn_dim_multiplier * width)
            width = config.block_multiple_of * -(-width // config.block_multiple_of)
    return width


class Lfm2Layer(LlamaDecoderLayer):
    """Llama's pre-norm layer whose mixer is the short conv or attention (``layer_types``)."""

    attention_class = Lfm2Attention

    def build_mixer(self, config, tp: TPGroup, layer: int) -> None:
        kind = config.layer_types[layer]
        if kind not in ("conv", "full_attention"):
            raise ValueError(f"layer_types[{layer}]={kind!r} is not supported for model_type='lfm2'; 'conv' or "
                             "'full_attention'")
        self.is_conv = kind == "conv"
        if self.is_conv:
            self.conv = ShortConv(config, tp)
        else:
            super().build_mixer(config, tp, layer)

    @classmethod
    def build_mlp(cls, config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        if layer >= getattr(config, "num_dense_layers", config.num_hidden_layers):  # LFM2-MoE's sparse layers
            return SparseMoE(config, tp, expert_parallel)
        return LlamaMLP(SimpleNamespace(  # SwiGLU (its config names no activation), no biases
            model_type=config.model_type, hidden_act="silu", hidden_size=config.hidden_size,
            intermediate_size=mlp_width(config)), tp)

    @staticmethod
    def build_norm(config) -> nn.Module:
        return RMSNorm(config.hidden_size, config.norm_eps)

    def mix(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.conv(x, meta) if self.is_conv else self.self_attn(x, cos, sin, meta)


class Lfm2Model(LlamaModel):
    layer_class = Lfm2Layer


_CHECKPOINT_NAMES["lfm2"] = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.conv\.conv\.", ".conv.conv1d."), (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
    (r"\.self_attn\.q_layernorm\.", ".self_attn.q_norm."), (r"\.self_attn\.k_layernorm\.", ".self_attn.k_norm."),
    (r"\.feed_forward\.w1\.", ".mlp.gate_proj."), (r"\.feed_forward\.w3\.", ".mlp.up_proj."),
    (r"\.feed_forward\.w2\.", ".mlp.down_proj."), (r"\.operator_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"^model\.embedding_norm\.", "model.norm.")))
# LFM2-MoE: LFM2's names, and its MoE block's under ``feed_forward.`` too (the expert bias beside the router there,
# the router's correction bias here; each expert's w1 / w3 / w2 its gate / up / down, as Mixtral's)
_CHECKPOINT_NAMES["lfm2_moe"] = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.feed_forward\.expert_bias$", ".mlp.gate.e_score_correction_bias"),
    (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."), (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
    (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."))) + _CHECKPOINT_NAMES["lfm2"] + (
    (re.compile(r"\.feed_forward\."), ".mlp."),)


class Lfm2ForCausalLM(RecurrentModel, LlamaForCausalLM):
    """LFM2 for causal LM, sharded over ``tp`` (the short convs' channels and the attention heads split over the
    ranks)."""

    model_class = Lfm2Model
    # LoRA on the attention's q/k/v/o (out_proj in its checkpoint), the dense MLPs (w1 / w3 / w2) and the short
    # convs' in_proj and out_proj (adapters name modules as the checkpoint does: adapter_module renames them)
    lora_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                     "in_proj", "out_proj")

    @classmethod
    def recurrent_layers(cls, config) -> bool:
        return "conv" in config.layer_types

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        if config.hidden_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not split this model's hidden_size="
                             f"{config.hidden_size} (its short convs' channels); choose one that divides it")

