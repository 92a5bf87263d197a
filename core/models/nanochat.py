"""Karpathy's nanochat (``NanoChatForCausalLM``: nanochat-d20 / d32), on the Llama plumbing (:mod:`specray.models.llama`).
Where it differs from Llama:

* every norm is an RMSNorm with nothing learned (:class:`WeightlessRMSNorm`), and the embeddings are normed too
  before the first layer;
* RoPE turns the other way (its rotate-half is ``[x2, -x1]``: the sines negated), and each query and key head is
  RMS-normed *after* it (as Hunyuan's, :mod:`specray.models.hunyuan_v1`);
* a gateless MLP ``fc2(relu(fc1(x))^2)`` without biases (AFM's :class:`~specray.models.arcee.ReluSquaredMLP`);
* the logits soft-capped, ``cap * tanh(logits / cap)`` (``final_logit_softcapping``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from specray.models.arcee import GATELESS_STACKED, ReluSquaredMLP
from specray.models.attention import AttentionMetadata
from specray.models.hunyuan_v1 import HunYuanAttention
from specray.models.layers import RMSNorm
from specray.models.llama import _CHECKPOINT_NAMES, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from specray.parallel import TPGroup

_CHECKPOINT_NAMES["nanochat"] = ((re.compile(r"\.mlp\.fc1\."), ".mlp.up_proj."),
                                 (re.compile(r"\.mlp\.fc2\."), ".mlp.down_proj."))


class WeightlessRMSNorm(RMSNorm):
    """``x / rms(x)`` in float32, nothing learned; with ``residual``, as :class:`RMSNorm` (adds it first)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__(hidden_size, eps)
        del self.weight  # nothing to load; an empty buffer in its place carries the model's dtype and device
        self.register_buffer("weight", torch.empty(0), persistent=False)  # (LlamaForCausalLM reads them there)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class NanoChatAttention(HunYuanAttention):
    """Hunyuan's order (RoPE, then each q and k head normed), the norms weightless."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        self.query_layernorm = WeightlessRMSNorm(self.head_dim, config.rms_norm_eps)
        self.key_layernorm = WeightlessRMSNorm(self.head_dim, config.rms_norm_eps)


class NanoChatDecoderLayer(LlamaDecoderLayer):
    attention_class = NanoChatAttention
    mlp_class = ReluSquaredMLP

    @staticmethod
    def build_norm(config) -> nn.Module:  # (the final norm too: LlamaModel.final_norm)
        return WeightlessRMSNorm(config.hidden_size, config.rms_norm_eps)


class NanoChatModel(LlamaModel):
    layer_class = NanoChatDecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp=None):
        super().__init__(config, tp, expert_parallel, pp)
        self.embed_norm = WeightlessRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed_step(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # input_ids: [T] -> the normed embeddings [T, H]
        return self.embed_norm(self.embed(input_ids))

    def rope_tables(self, meta: AttentionMetadata, dtype: torch.dtype) -> Callable[[int], tuple[torch.Tensor, ...]]:
        cos, sin = super().rope_tables(meta, dtype)(0)
        tables = (cos, -sin)  # its rotation's other direction
        return lambda layer: tables


class NanoChatForCausalLM(LlamaForCausalLM):
    """nanochat for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = NanoChatModel
    caps_logits = True
    stacked = GATELESS_STACKED
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
