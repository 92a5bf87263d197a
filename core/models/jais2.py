"""Inception's Jais 2 (``Jais2ForCausalLM``: Jais-2-8B), on the Llama plumbing (:mod:`specray.models.llama`: its
``attention_bias`` on q/k/v and o). Where it differs from Llama: LayerNorms with biases (before each block and after
the last layer), and AFM's gateless MLP ``down(relu(up(x))^2)`` (:class:`~specray.models.arcee.ReluSquaredMLP`) with
biases (``mlp_bias``)."""

from __future__ import annotations

from specray.models.arcee import ArceeDecoderLayer, ArceeForCausalLM
from specray.models.classic import layer_norm
from specray.models.llama import LlamaModel


class Jais2DecoderLayer(ArceeDecoderLayer):
    build_norm = staticmethod(layer_norm)  # (the final norm too: LlamaModel.final_norm)


class Jais2Model(LlamaModel):
    layer_class = Jais2DecoderLayer


class Jais2ForCausalLM(ArceeForCausalLM):
    """Jais 2 for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is (AFM's names and LoRA modules)."""

    model_class = Jais2Model
