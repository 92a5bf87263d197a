"""OpenAI's GPT-OSS (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b), written with tensor-parallel layers on the
Llama plumbing (:mod:`specray.models.llama`: pre-norm layers with RMSNorm, paged KV per layer, pipeline stages,
weight loading, the model interface).

Where it differs from the Llama family:

* attention has biases on q, k, v and o, and a learned sink logit per head (``self_attn.sinks``): it joins each
  query row's softmax over the scores and its probability is dropped, so a row may attend to less than all of its
  weight (:class:`~specray.models.attention.PagedAttention`'s explicit path). Under tensor parallelism each rank
  holds its own heads' sinks;
* sliding-window layers (``sliding_window``) alternate with full ones (``layer_types``); one YaRN RoPE for all;
* every layer's MLP is a mixture of experts (:mod:`specray.models.moe`, GPT-OSS's row: a router with a bias, a
  softmax over the top-k logits, experts with biases and a clamped SwiGLU, gate and up interleaved in the fused
  tensor), split by width or (``expert_parallel``) by whole experts;
* the releases store the experts in MXFP4, kept so where quantized experts are (a GPU) and decoded as tokens
  reach them, else dequantized as they load (:mod:`specray.models.mxfp4`).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from specray.models.attention import PagedAttention
from specray.models.layers import RMSNorm, RotaryEmbedding, VocabParallelEmbedding, _copy, narrow, rope_parameters
from specray.models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, _head_dim,
                                  _kv_spec, attention_projections)
from specray.models.moe import SparseMoE
from specray.parallel import PPGroup, TPGroup

# the checkpoint's sinks sit on the attention module; ours on its PagedAttention, which attends with them
_SINK_NAMES = ((re.compile(r"\.self_attn\.sinks$"), ".self_attn.attn.sinks"),)


def sink_attention(num_heads: int, kv_spec, scale: float, tp: TPGroup) -> PagedAttention:
    """A layer's attention over ``num_heads`` of this rank's query heads with a learned sink logit per head: its
    ``sinks`` load this rank's heads' rows of the checkpoint's (as QKVParallelLinear splits the heads)."""
    attn = PagedAttention(num_heads, kv_spec, scale, sinks=True)
    first = tp.rank * num_heads

    def load_sinks(param: nn.Parameter, loaded: Any) -> None:
        _copy(param, narrow(loaded, 0, first, num_heads))

    attn.sinks.weight_loader = load_sinks
    return attn


class GptOssAttention(LlamaAttention):
    """Llama's attention (its forward) with q/k/v/o biases (``attention_bias``) and per-head sinks."""

    def __init__(self, config, tp: TPGroup, layer: int):
        nn.Module.__init__(self)
        head_dim = attention_projections(self, config, tp)
        self.q_norm = self.k_norm = None
        self.attn = sink_attention(self.num_heads, _kv_spec(config, layer, self.qkv_proj), head_dim ** -0.5, tp)


class GptOssDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        nn.Module.__init__(self)
        self.self_attn = GptOssAttention(config, tp, layer)
        self.mlp = SparseMoE(config, tp, expert_parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GptOssModel(LlamaModel):
    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)
        layer_types = getattr(config, "layer_types", None) or []
        bad = sorted({t for t in layer_types if t not in ("sliding_attention", "full_attention")})
        if bad:
            raise ValueError(f"layer_types has {bad}: GPT-OSS layers are 'sliding_attention' or 'full_attention'")
        self.build_stage(config, pp, lambda i: GptOssDecoderLayer(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.rotary_emb = RotaryEmbedding(_head_dim(config), rope_parameters(config), config.max_position_embeddings)


class GptOssForCausalLM(LlamaForCausalLM):
    """GPT-OSS for causal LM, sharded over ``tp`` (heads and their sinks split; experts by width, or whole with
    ``expert_parallel``) and ``pp`` (a pipeline stage)."""

    model_class = GptOssModel
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj")  # the experts are fused tensors, not linears

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.renames = _SINK_NAMES
