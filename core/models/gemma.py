"""Gemma (the first: ``GemmaForCausalLM``, Gemma 2B / 7B, CodeGemma), on Gemma 3's parts (:mod:`specray.models.gemma3`):
``(1 + w)`` RMSNorms in float32, the embedding scaled by sqrt(hidden_size), gated GELU (tanh; the releases' legacy
``"gelu"`` read as transformers reads it, the tanh approximation), tied embeddings. Where it differs from Gemma 2 and 3:
a pre-norm layer as Llama's (a norm before attention and one before the MLP, none after either), every layer global
with one RoPE, attention scaled by ``head_dim ** -0.5``, no q/k norms, no soft caps."""

from __future__ import annotations

import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.gemma3 import Gemma3Attention, Gemma3ForCausalLM, Gemma3MLP, Gemma3Model, GemmaRMSNorm
from specray.parallel import TPGroup


class GemmaAttention(Gemma3Attention):
    qk_norm = False


class GemmaMLP(Gemma3MLP):
    legacy_gelu = True


class GemmaDecoderLayer(nn.Module):
    """``h = h + attn(norm(h))``, then ``h = h + mlp(norm(h))``."""

    layer_type = "full_attention"

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__()
        if getattr(config, "layer_types", None) is not None or getattr(config, "sliding_window", None) is not None:
            raise ValueError("layer_types / sliding_window are not Gemma 1's: a Gemma 2 or 3 checkpoint names "
                             "Gemma2ForCausalLM or Gemma3ForCausalLM in its config's architectures")
        self.self_attn = GemmaAttention(config, tp, layer)
        self.mlp = GemmaMLP(config, tp)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: the residual stream [T, H] -> the next layer's
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class GemmaModel(Gemma3Model):
    layer_class = GemmaDecoderLayer


class GemmaForCausalLM(Gemma3ForCausalLM):
    """Gemma for causal LM, sharded over ``tp`` and ``pp`` as Gemma 3's."""

    model_class = GemmaModel
