"""Cohere's Command R7B and Command A (``Cohere2ForCausalLM``), on the Llama plumbing (:mod:`specray.models.llama`:
paged KV per layer, pipeline stages, weight loading, the model interface; its flags give Cohere2 RoPE on interleaved
pairs, on the ``sliding_attention`` layers alone, the others attending everything without it). Where it differs from
Llama:

* one norm per layer, a LayerNorm without a bias (mean-centred, in float32), whose output both blocks read in
  parallel: ``h = h + attn(norm(h)) + mlp(norm(h))``; the final norm is the same kind;
* the logits are scaled by ``logit_scale``.
"""

from __future__ import annotations

import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.layers import LayerNorm
from specray.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, norm_stream
from specray.parallel import TPGroup


class Cohere2DecoderLayer(nn.Module):
    """``h = h + attn(norm(h)) + mlp(norm(h))``."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__()
        self.self_attn = LlamaAttention(config, tp, layer)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H], the stream being x + residual (added in the next norm) -> both blocks' outputs and the
        # stream they join
        h, residual = norm_stream(self.input_layernorm, x, residual)
        return self.self_attn(h, cos, sin, meta) + self.mlp(h), residual


class Cohere2Model(LlamaModel):
    layer_class = Cohere2DecoderLayer

    @staticmethod
    def final_norm(config) -> nn.Module:
        return LayerNorm(config.hidden_size, config.layer_norm_eps, bias=False)


class Cohere2ForCausalLM(LlamaForCausalLM):
    """Command R7B / Command A for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = Cohere2Model

    def __init__(self, hf_config, *args, **kwargs):
        super().__init__(hf_config, *args, **kwargs)
        self.logits_scaling = 1.0 / float(hf_config.logit_scale)  # the stack divides the logits by it
