"""Gemma 2, on Gemma 3's layers (:mod:`specray.models.gemma3`): the same sandwich of ``(1 + w)`` RMSNorms, scaled
embedding, ``query_pre_attn_scalar``, gated GELU (tanh), sliding-window layers beside global ones (``layer_types``;
transformers 5 fills it in as every other layer sliding, from the first), tied embeddings and
``final_logit_softcapping``.

Where it differs from Gemma 3:

* no RMSNorm over the query and key heads;
* one RoPE for every layer (``rope_theta``; no local base for the sliding layers);
* attention logit soft-capping: each layer's scores are ``cap * tanh(scores / cap)`` (``attn_logit_softcapping``)
  before the mask and softmax, which :class:`~specray.models.attention.PagedAttention` attends explicitly.

VaultGemma (``VaultGemmaForCausalLM``: vaultgemma-1b, trained with differential privacy) is Gemma 2 without the norms
on the blocks' outputs (``post_attention_layernorm``, ``post_feedforward_layernorm``): a plain pre-norm layer.
"""

from __future__ import annotations

import torch

from specray.models.attention import AttentionMetadata
from specray.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3Model
from specray.parallel import TPGroup


class Gemma2Attention(Gemma3Attention):
    qk_norm = False
    softcaps = True


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    attention_class = Gemma2Attention


class Gemma2Model(Gemma3Model):
    layer_class = Gemma2DecoderLayer


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 for causal LM, sharded over ``tp`` (tensor parallel) and ``pp`` (a pipeline stage), as Gemma 3's."""

    model_class = Gemma2Model


class VaultGemmaDecoderLayer(Gemma2DecoderLayer):
    """Gemma 2's layer with a norm before each block only."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        del self.post_attention_layernorm, self.post_feedforward_layernorm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: the residual stream [T, H] -> the next layer's
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.pre_feedforward_layernorm(x))


class VaultGemmaModel(Gemma2Model):
    layer_class = VaultGemmaDecoderLayer


class VaultGemmaForCausalLM(Gemma2ForCausalLM):
    """VaultGemma for causal LM, sharded as Gemma 2 is."""

    model_class = VaultGemmaModel
