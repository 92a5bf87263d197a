"""Gemma 2, on Gemma 3's layers (:mod:`specray.models.gemma3`): the same sandwich of ``(1 + w)`` RMSNorms, scaled
embedding, ``query_pre_attn_scalar``, gated GELU (tanh), sliding-window layers beside global ones (``layer_types``;
transformers 5 fills it in as every other layer sliding, from the first), tied embeddings and
``final_logit_softcapping``.

Where it differs from Gemma 3:

* no RMSNorm over the query and key heads;
* one RoPE for every layer (``rope_theta``; no local base for the sliding layers);
* attention logit soft-capping: each layer's scores are ``cap * tanh(scores / cap)`` (``attn_logit_softcapping``)
  before the mask and softmax, which :class:`~specray.models.attention.PagedAttention` attends explicitly.
"""

from __future__ import annotations

from specray.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3Model


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
