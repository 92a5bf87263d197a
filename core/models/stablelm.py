"""Stability AI's StableLM (``StableLmForCausalLM``: StableLM-3B-4E1T, StableLM 2 1.6B / 12B, StableCode), on the
Llama plumbing (:mod:`specray.models.llama`: Llama's names and gated SiLU MLP, partial RoPE on each head's first
``partial_rotary_factor``). Where it differs from Llama:

* LayerNorms with biases; with ``use_parallel_residual`` (StableLM 2 12B) one norm per layer whose output both blocks
  read, ``h + attn(ln(h)) + mlp(ln(h))`` (:class:`~specray.models.classic.ParallelDecoderLayer`), else Llama's order;
* q/k/v biases where ``use_qkv_bias``, none on the output projection;
* with ``qk_layernorm``, each query and key head LayerNormed (no bias) with a weight of its own before RoPE: the
  release keeps one LayerNorm per head (``q_layernorm.norms.{h}``), read as one [heads, head_dim] weight.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from specray.models.classic import ParallelDecoderLayer, layer_norm, llama_view
from specray.models.cohere2 import HeadLayerNorm
from specray.models.layers import materialize
from specray.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from specray.parallel import PPGroup, TPGroup

_PER_HEAD = re.compile(r"^(.*\.self_attn\.)(q|k)_layernorm\.norms\.(\d+)\.weight$")


class StableLmAttention(LlamaAttention):
    """Llama's attention; with ``qk_layernorm``, each query and key head normed by its own LayerNorm first."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        if config.qk_layernorm:
            eps, qkv = config.layer_norm_eps, self.qkv_proj
            self.q_norm = HeadLayerNorm(self.num_heads, self.head_dim, eps, tp.rank * self.num_heads)
            self.k_norm = HeadLayerNorm(self.num_kv_heads, self.head_dim, eps, qkv.kv_head_start)


class StableLmDecoderLayer(LlamaDecoderLayer):
    attention_class = StableLmAttention
    build_norm = staticmethod(layer_norm)  # (the final norm too: LlamaModel.final_norm)


class StableLmParallelLayer(ParallelDecoderLayer):
    attention_class = StableLmAttention
    mlp_class = LlamaMLP
    one_norm = True


class StableLmModel(LlamaModel):
    layer_class = StableLmDecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        if config.use_parallel_residual:
            self.layer_class = StableLmParallelLayer
        super().__init__(config, tp, expert_parallel, pp)


class StableLmForCausalLM(LlamaForCausalLM):
    """StableLM for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = StableLmModel

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        config = llama_view(hf_config, attention_bias=hf_config.use_qkv_bias, attention_out_bias=False, head_dim=None,
                            sliding_window=None)
        super().__init__(config, tp, expert_parallel, pp)

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """A layer's per-head q (k) LayerNorm weights as one ``q_norm.weight`` [heads, head_dim], once all came."""
        heads = {"q": self.config.num_attention_heads, "k": self.config.num_key_value_heads}
        pending: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        for name, tensor in weights:
            found = _PER_HEAD.match(name)
            if found is None:
                yield name, tensor
                continue
            prefix, kind, head = found.group(1), found.group(2), int(found.group(3))
            got = pending.setdefault((prefix, kind), {})
            got[head] = materialize(tensor)
            if len(got) == heads[kind]:
                del pending[(prefix, kind)]
                yield f"{prefix}{kind}_norm.weight", torch.stack([got[h] for h in range(heads[kind])])
