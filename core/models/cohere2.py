"""Cohere's Command R7B and Command A (``Cohere2ForCausalLM``) and Command R / R+ (``CohereForCausalLM``), on the Llama
plumbing (:mod:`specray.models.llama`:
paged KV per layer, pipeline stages, weight loading, the model interface; its flags give Cohere2 RoPE on interleaved
pairs, on the ``sliding_attention`` layers alone, the others attending everything without it). Where it differs from
Llama:

* one norm per layer, a LayerNorm without a bias (mean-centred, in float32), whose output both blocks read in
  parallel: ``h = h + attn(norm(h)) + mlp(norm(h))``; the final norm is the same kind;
* the logits are scaled by ``logit_scale``.

Command R / R+ (``CohereForCausalLM``) is the same layer with RoPE (on interleaved pairs) on every layer and, where
``use_qk_norm`` (R+), each query and key head LayerNormed over its features before RoPE with a weight of its own
(``q_norm`` [heads, head_dim]: each rank reads its heads' rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.layers import LayerNorm, _copy, _param, narrow
from specray.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, norm_stream
from specray.parallel import TPGroup


class HeadLayerNorm(nn.Module):
    """A bias-free LayerNorm over each head's features with a weight per head: x [T, heads, D] -> the same, this
    rank's ``heads`` of the checkpoint's [all heads, D] weight from head ``start``."""

    def __init__(self, heads: int, head_dim: int, eps: float, start: int):
        super().__init__()
        self.eps = eps
        self.weight = _param(heads, head_dim)
        self.weight.weight_loader = lambda param, loaded: _copy(param, narrow(loaded, 0, start, heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class CohereAttention(LlamaAttention):
    """Llama's attention; with ``use_qk_norm``, each query and key head normed by :class:`HeadLayerNorm` first."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        if getattr(config, "use_qk_norm", False):
            qkv, eps = self.qkv_proj, config.layer_norm_eps
            self.q_norm = HeadLayerNorm(self.num_heads, self.head_dim, eps, tp.rank * self.num_heads)
            self.k_norm = HeadLayerNorm(self.num_kv_heads, self.head_dim, eps, qkv.kv_head_start)


class Cohere2DecoderLayer(nn.Module):
    """``h = h + attn(norm(h)) + mlp(norm(h))``."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__()
        self.self_attn = CohereAttention(config, tp, layer)
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


class CohereForCausalLM(Cohere2ForCausalLM):
    """Command R / R+ for causal LM: Command R7B's layers, every one rotated (``model_type`` "cohere")."""
