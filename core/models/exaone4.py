"""LG AI Research's EXAONE 4.0 (``Exaone4ForCausalLM``: EXAONE-4.0-1.2B, EXAONE-4.0-32B), on the Llama plumbing
(:mod:`specray.models.llama`). Its layer is OLMo 2's post-norm layer (``h = h + norm(attn(h))``, then
``h = h + norm(mlp(h))``; :class:`~specray.models.olmo2.Olmo2DecoderLayer`) around Llama's attention with Qwen3's
RMSNorm over each query and key head (``llama.py``'s flags). Where the config sets ``sliding_window``, the
``sliding_attention`` layers (``layer_types``) attend a window with RoPE and the others attend everything without it
(NoPE); without one, every layer is global with RoPE (the 1.2B)."""

from __future__ import annotations

from specray.models.llama import LlamaAttention, LlamaModel
from specray.models.olmo2 import Olmo2DecoderLayer, Olmo2ForCausalLM


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    """OLMo 2's post-norm layer with Llama's attention (per-head q/k norms, RoPE where the layer uses it)."""

    attention_class = LlamaAttention


class Exaone4Model(LlamaModel):
    layer_class = Exaone4DecoderLayer


class Exaone4ForCausalLM(Olmo2ForCausalLM):
    """EXAONE 4.0 for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = Exaone4Model
