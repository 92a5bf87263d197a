"""Zhipu's GLM-4 dense models (``Glm4ForCausalLM``: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1), on the Llama plumbing
(:mod:`specray.models.llama`: paged KV per layer, pipeline stages, weight loading, the model interface; its flags give
GLM-4 q/k/v biases without one on o, RoPE on interleaved pairs of each head's first half, and the release's fused
``gate_up_proj``). Where the layer differs from Llama's: each block's output is RMS-normed again before it joins the
residual stream (``post_self_attn_layernorm``, ``post_mlp_layernorm``), as in a sandwich of norms around each block."""

from __future__ import annotations

import torch

from specray.models.attention import AttentionMetadata
from specray.models.layers import RMSNorm
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, norm_stream
from specray.parallel import TPGroup


class Glm4DecoderLayer(LlamaDecoderLayer):
    """``h = h + norm(attn(norm(h)))``, then ``h = h + norm(mlp(norm(h)))``: the sandwich of norms the families built
    on it share (Kolibri-1, Trinity; LFM3 and HyperCLOVA X SEED with their mixers, a norm left out as None, and
    HyperCLOVA X's residual multiplier on each block's output)."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__(config, tp, layer, expert_parallel)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H], the stream being x + residual (added in the next norm) -> the MLP's normed output and
        # the stream before it
        x, residual = norm_stream(self.input_layernorm, x, residual)
        x = self.mix(x, cos, sin, meta)
        if self.post_self_attn_layernorm is not None:
            x = self.post_self_attn_layernorm(x)
        m = self.residual_multiplier
        x, residual = self.post_attention_layernorm(x if m == 1.0 else x * m, residual)
        x = self.mlp(x)
        if self.post_mlp_layernorm is not None:
            x = self.post_mlp_layernorm(x)
        return (x if m == 1.0 else x * m), residual


class Glm4Model(LlamaModel):
    layer_class = Glm4DecoderLayer


class Glm4ForCausalLM(LlamaForCausalLM):
    """GLM-4 for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = Glm4Model
