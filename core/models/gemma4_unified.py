"""Google's Gemma 4 Unified (text): ``Gemma4UnifiedForCausalLM`` (``gemma4_unified_text``) and the text model of
``Gemma4UnifiedForConditionalGeneration`` (``gemma4_unified``, read from ``model.language_model.``), the
encoder-free multimodal Gemma 4 (image patches and audio frames projected straight into the text model's space by
small embedders, which are not read here: text only).

Its text model is Gemma 4's (:mod:`specray.models.gemma4`) with two parts left out, and nothing added: transformers'
``Gemma4UnifiedTextDecoderLayer`` is Gemma 4's layer (the same attention: sliding and full layers of their own head
sizes, k = v full layers, the proportional RoPE, KV sharing and double-wide MLPs on the shared layers; the same norms,
``layer_scalar`` and final soft cap) without the per-layer inputs (``hidden_size_per_layer_input``) and without the
mixture of experts (``enable_moe_block``). Its config class has neither field, and a config.json that names them
anyway is read by transformers into attributes its model never looks at; so here both are forced off
(:func:`text_view`) rather than built, the checkpoint then carries no such tensors (any it did carry would be
ignored by both, with a warning here).

Everything else is Gemma 4's class unchanged: KV-shared layers' cache specs, LoRA (q/k/v/o, gate/up/down), tensor
parallel ranks, pipeline stages (a KV-shared layer on its source's stage), Gemma 4's assistant reading the "store"
layers' K/V (:mod:`specray.models.gemma4_assistant`, which also serves ``gemma4_unified_assistant``).
``use_bidirectional_attention`` "vision" (the default: text tokens attend causally) is served, "all" refused by name
(Gemma 4's check). Images (:mod:`specray.models.gemma4_unified_images`): an image's soft tokens see each other both
ways in every layer, the full ones too (unlike Gemma 4, whose full layers stay causal), so the full layers here take
the plain paged attention. Tiny random models against transformers only: never run on a GPU or a real checkpoint.
"""

from __future__ import annotations

import copy
import logging

from specray.models.gemma4 import Gemma4ForCausalLM
from specray.parallel import PPGroup, TPGroup

logger = logging.getLogger(__name__)

# Gemma 4's fields that transformers' Gemma4UnifiedTextConfig drops and its model never reads, with the value that
# switches each part off in Gemma 4's stack
ABSENT_FIELDS = {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "enable_moe_block": False}


def text_view(config):
    """A copy of the Unified text ``config`` in which Gemma 4's per-layer inputs and experts are off, as
    transformers' Unified model builds it whatever config.json says; a field that would have switched one on is
    logged."""
    named = {f: getattr(config, f) for f in ABSENT_FIELDS if getattr(config, f, None)}
    if named:
        logger.info("Gemma 4 Unified builds no per-layer inputs and no experts (as transformers' model): ignoring "
                    "config fields %s", named)
    view = copy.copy(config)
    for field, off in ABSENT_FIELDS.items():
        setattr(view, field, off)
    # transformers' Unified model lets an image's soft tokens see each other both ways in its full layers too (Gemma
    # 4's stay causal: their mask kind ``CAUSAL_KEYS``)
    view.images_both_ways_in_full_layers = True
    return view


class Gemma4UnifiedForCausalLM(Gemma4ForCausalLM):
    """Gemma 4 Unified's text model for causal LM: Gemma 4's class on :func:`text_view` of the config."""

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(text_view(hf_config), tp, expert_parallel, pp)
