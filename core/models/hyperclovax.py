"""Naver's HyperCLOVA X SEED (``HyperCLOVAXForCausalLM``: HyperCLOVAX-SEED-Think-14B), Granite's layers
(:mod:`specray.models.llama`: its ``embedding_multiplier``, ``attention_multiplier`` as the attention's scale, by
default ``head_dim ** -0.5``, and ``residual_multiplier``) with:

* with ``use_post_norm`` (Peri-LN), an RMSNorm on each block's output before it joins the residual stream
  (``post_norm1`` after attention, ``post_norm2`` after the MLP);
* the logits *multiplied* by ``logits_scaling`` (Granite divides by it).
"""

from __future__ import annotations

import torch

from specray.models.attention import AttentionMetadata
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, norm_stream
from specray.parallel import TPGroup


class HyperCLOVAXDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__(config, tp, layer, expert_parallel)
        post = bool(config.use_post_norm)
        self.post_norm1 = self.build_norm(config) if post else None
        self.post_norm2 = self.build_norm(config) if post else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H], the stream being x + residual (added in the next norm)
        x, residual = norm_stream(self.input_layernorm, x, residual)
        x = self.mix(x, cos, sin, meta)
        if self.post_norm1 is not None:
            x = self.post_norm1(x)
        x, residual = self.post_attention_layernorm(x * self.residual_multiplier, residual)
        x = self.mlp(x)
        if self.post_norm2 is not None:
            x = self.post_norm2(x)
        return x * self.residual_multiplier, residual


class HyperCLOVAXModel(LlamaModel):
    layer_class = HyperCLOVAXDecoderLayer


class HyperCLOVAXForCausalLM(LlamaForCausalLM):
    """HyperCLOVA X SEED for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = HyperCLOVAXModel

    def __init__(self, hf_config, *args, **kwargs):
        super().__init__(hf_config, *args, **kwargs)
        self.logits_scaling = 1.0 / float(getattr(hf_config, "logits_scaling", 1.0))  # the stack divides by it
