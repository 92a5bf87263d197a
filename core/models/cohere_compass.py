"""Cohere Compass's text model (``CohereCompassForCausalLM``, model_type ``cohere_compass_text``; the text part of
``CohereCompassForConditionalGeneration``, model_type ``cohere_compass``, North-Micro-Vision's, whose vision tower and
merger are not read), on Command R7B's layers (:mod:`specray.models.cohere2`: one bias-free LayerNorm before attention
and MLP in parallel, a LayerNorm after the last layer, sliding and global layers by ``layer_types``, the logits
scaled). transformers builds it as Cohere2's layers inside Qwen3-VL's text model, with Gemma 3's rotary embedding
(one table per kind of layer) and an attention of its own.

Where it differs from Cohere2:

* RoPE rotates the two halves of each head (Qwen3's ``rotate_half``), not interleaved pairs, in the model's dtype
  (transformers' Cohere2 upcasts q and k to float32 for it; Compass's does not, nor does our shared attention);
* each kind of layer has its own RoPE, ``rope_parameters[layer_type]`` (a dict: its type, base, scaling), and a kind
  whose entry is null has none (NoPE). Cohere2 rotates the sliding layers alone, by one setting; here the config says
  which kinds rotate, so a release may rotate its global layers too, by another base or scaling;
* the rotary tables are multimodal RoPE's (``mrope_section``: the frequencies split between temporal, height and width
  position ids, interleaved as Qwen3-VL's). A text-only sequence gives each token's three ids the same value (its
  position: the causal LM expands its 1-D positions to three equal rows, and the multimodal model's
  ``get_rope_index`` gives every text token ``arange`` in all three), so the recomposed table is the plain one and
  ``mrope_section`` has no effect here. With images (:mod:`specray.models.cohere_compass_vision`) the step's
  ``meta.rope_positions`` give the three ids, which each rotating kind's table takes as transformers does: always
  interleaved, over ``mrope_section`` or [24, 20, 20] where the kind names none (:func:`kind_mrope`);
* ``logit_scale`` may be null (the default): the logits are then not scaled;
* no q/k norms (Command R+'s ``use_qk_norm`` is not read), and ``head_dim`` is always ``hidden_size /
  num_attention_heads`` (transformers' config sets it so).

Refused with a ValueError: configs transformers itself cannot run, ``rope_parameters`` not keyed by layer type
(flat, or missing a kind the layers name: transformers' rotary embedding fails on a KeyError) and a kind other than
"sliding_attention" / "full_attention" (its masks know no other); a ``partial_rotary_factor`` (transformers' tables
always span the whole head: its default RoPE ignores the factor, its scaled types do not fit it); a zero
``logit_scale`` (every logit 0). A "dynamic" (NTK) kind stretches its base per position, as
:class:`~specray.models.layers.RotaryEmbedding` documents, where transformers rescales per batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.cohere2 import Cohere2DecoderLayer, Cohere2ForCausalLM, Cohere2Model
from specray.models.layers import LayerNorm, RotaryEmbedding, VocabParallelEmbedding, max_positions, rope_parameters
from specray.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, _head_dim
from specray.parallel import PPGroup, TPGroup

LAYER_KINDS = ("sliding_attention", "full_attention")  # transformers' mask mapping knows these two alone


def kind_ropes(config) -> dict[str, dict | None]:
    """Each kind of layer the config names -> its RoPE settings as one flat dict (``rope_parameters``), or None where
    ``rope_parameters[kind]`` is null (that kind is not rotated)."""
    kinds = list(getattr(config, "layer_types", None) or [])
    if len(kinds) != config.num_hidden_layers or not set(kinds) <= set(LAYER_KINDS):
        raise ValueError(f"layer_types={kinds} must name one of {list(LAYER_KINDS)} for each of the "
                         f"num_hidden_layers={config.num_hidden_layers} layers; fix layer_types in config.json")
    given = getattr(config, "rope_parameters", None) or {}
    missing = [kind for kind in dict.fromkeys(kinds) if kind not in given]
    if missing:
        raise ValueError(f"rope_parameters={given!r:.200} has no entry for layer type(s) {missing}: Cohere Compass "
                         "keys its RoPE by layer type (rope_parameters[kind]: a dict with rope_type and rope_theta, or "
                         "null for no RoPE on that kind), as transformers reads it; give one per kind in config.json")
    ropes: dict[str, dict | None] = {}
    for kind in dict.fromkeys(kinds):
        params = given[kind]
        if params is None:
            ropes[kind] = None
            continue
        if not isinstance(params, dict):
            raise ValueError(f"rope_parameters[{kind!r}]={params!r:.80} must be a dict (rope_type, rope_theta, ...) "
                             "or null (no RoPE on that kind of layer); fix it in config.json")
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        if factor != 1.0:
            raise ValueError(f"rope_parameters[{kind!r}] partial_rotary_factor={factor} is not supported: "
                             "transformers' Cohere Compass builds each kind's tables over the whole head (its default "
                             "RoPE ignores the factor, its scaled types do not fit it); remove partial_rotary_factor "
                             "from config.json to rotate whole heads as transformers does")
        one = copy.copy(config)  # the kind's settings alone, read as rope_parameters reads a per-kind config
        one.rope_parameters = {kind: params}
        ropes[kind] = rope_parameters(one, kind)
    return ropes


MROPE_SECTION = [24, 20, 20]  # transformers' sections for a kind whose rope_parameters name none


def kind_mrope(rope: dict) -> dict:
    """A kind's RoPE settings with its multimodal sections as transformers' Compass rotates image positions:
    interleaved (Qwen3-VL's, whatever ``mrope_interleaved`` says) over ``mrope_section``, [24, 20, 20] by default."""
    return {**rope, "mrope_section": rope.get("mrope_section") or MROPE_SECTION, "mrope_interleaved": True}


class CohereCompassAttention(LlamaAttention):
    """Llama's attention (biases on q/k/v/o where ``attention_bias``, a window on the sliding layers, RoPE on the two
    halves of each head), rotating q and k where its kind of layer has RoPE (``rope_parameters[kind]`` not null)."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        self.use_rope = kind_ropes(config)[config.layer_types[layer]] is not None
        self.interleaved_rope = False  # Qwen3's rotate_half (Cohere2's pairs are interleaved)


class CohereCompassDecoderLayer(Cohere2DecoderLayer):
    """Cohere2's ``h = h + attn(norm(h)) + mlp(norm(h))`` with :class:`CohereCompassAttention`."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        nn.Module.__init__(self)
        self.self_attn = CohereCompassAttention(config, tp, layer)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, bias=False)


class CohereCompassModel(Cohere2Model):
    """Cohere2's stack with a RoPE table per kind of layer that has RoPE (Gemma 3's rotary embedding, as OLMo 3's
    :class:`~specray.models.olmo3.RopePerKind`), and none for a NoPE kind."""

    layer_class = CohereCompassDecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)
        ropes = kind_ropes(config)
        self.layer_types = list(config.layer_types)
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(_head_dim(config), kind_mrope(rope), max_positions(config))
                                     for kind, rope in sorted(ropes.items()) if rope is not None})
        self.build_stage(config, pp, lambda i: self.layer_class(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: self.final_norm(config))

    def rope_tables(self, meta: AttentionMetadata, dtype: torch.dtype) -> Callable[[int], tuple[torch.Tensor, ...]]:
        """Layer index -> the (cos, sin) of its kind's table; (None, None) for a NoPE kind's layers, which read
        neither."""
        tables = {}
        for kind, rotary in self.rotary.items():
            rotary.ensure(meta.max_position + 1)
            tables[kind] = (rotary(meta.positions, dtype) if meta.rope_positions is None  # images: three ids per token
                            else rotary.multimodal(meta.rope_positions, dtype))
        return lambda layer: tables.get(self.layer_types[layer], (None, None))


class CohereCompassForCausalLM(Cohere2ForCausalLM):
    """Cohere Compass's text model for causal LM, sharded over ``tp`` and ``pp`` as the Llama family is."""

    model_class = CohereCompassModel

    def __init__(self, hf_config, *args, **kwargs):
        LlamaForCausalLM.__init__(self, hf_config, *args, **kwargs)
        scale = getattr(hf_config, "logit_scale", None)
        if scale is not None and not float(scale):
            raise ValueError("logit_scale=0 would make every logit 0; set it to the release's scale, or null for "
                             "unscaled logits, in config.json (text_config of a multimodal release)")
        # transformers multiplies the logits by logit_scale (none where null); the stack divides by logits_scaling
        self.logits_scaling = 1.0 if scale is None else 1.0 / float(scale)
