"""dots.llm3 / Dots3-Note's text model (``Dots3NoteForCausalLM``, model_type ``dots3_note_text``; the text part of
``dots3_note``'s ``Dots3NoteForConditionalGeneration``, whose vision and audio towers are not read): DeepSeek-V3.2
(:mod:`specray.models.deepseek_v3`: latent attention with a query latent, DeepSeek Sparse Attention's indexer,
DeepSeek-V3's grouped sigmoid router with a correction bias, shared experts; each layer's MLP by ``mlp_layer_types``)
on the Llama plumbing.

Where it differs from DeepSeek-V3.2:

* **Three kinds of layer** (``layer_types``): ``"indexed_attention"`` (V3.2's: the indexer keeps each query's
  ``index_topk`` best keys), ``"full_attention"`` (no indexer: every earlier key; a config with ``use_dsa: false``)
  and ``"sliding_attention"`` (no indexer; the keys of the last ``sliding_window`` positions, the query's own
  included). The releases alternate them (two indexed layers, then one in four).
* **Per-layer geometry** (transformers' ``per_layer_config``, layer -> overrides; the sliding layers' ``swa_*``
  fields in a release's config): a layer's heads, ``q_lora_rank``, ``kv_lora_rank``, ``head_dim``, nope / rope /
  v widths may differ from the global ones, so each layer builds from its own view of the config
  (:func:`layer_config`) and caches its own latent width (layers of one width share a cache tensor).
* **RoPE per kind** (``rope_parameters[kind]``, DiffusionGemma's rotary embedding): each kind has its own theta and
  scaling; a kind rotates ``int(head_dim * partial_rotary_factor)`` features (its first layer's ``head_dim``), which
  must be its layers' ``qk_rope_head_dim``. The cos/sin carry the scaling's attention factor (YaRN's
  mscale / mscale_all_dim), and the softmax scale is plain ``qk_head_dim ** -0.5``: no YaRN ``mscale_all_dim``
  squared, unlike DeepSeek's.
* **Scaled latents**: the normed query latent is multiplied by ``sqrt(hidden_size / q_lora_rank)`` (what
  ``q_b_proj`` and the indexer read) and the normed KV latent by ``sqrt(hidden_size / kv_lora_rank)`` (what is
  cached, keys and values alike), as LongCat-Flash's (:class:`~specray.models.longcat_flash.ScaledRMSNorm`).
* **The shared RoPE key normed** (``k_rope_only_layernorm``, an RMSNorm of ``rms_norm_eps``) before it is rotated.
* **A per-head output gate** (``g_proj``): each head's attention output times ``sigmoid(g_proj(x))``, one scalar per
  head from the layer's normed input, before ``o_proj`` (split by head over tensor-parallel ranks).
* MLA's RoPE and the indexer's are both on interleaved pairs (the indexer is GLM-5's); the shared experts are
  ``shared_experts_intermediate_size`` (times ``n_shared_experts``) wide, not ``moe_intermediate_size``.

Exact in float32 (tests/test_dots3_note.py); in bfloat16 the indexed layers' cos/sin are rounded to the model's dtype
where transformers keeps them (and so the indexer's rotated keys) in float32.

**MTP**: transformers skips a release's ``model.layers.{num_hidden_layers}.*`` and ``model.mtp.*`` tensors and has no
multi-token-prediction module (nor ``num_nextn_predict_layers``), so their layout is unknown: ``method="mtp"`` is
refused (:meth:`Dots3NoteForCausalLM.mtp_layer_parts`) and those tensors are not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.deepseek_v3 import (DeepseekV3DecoderLayer, DeepseekV3ForCausalLM, DeepseekV3Model,
                                        LatentAttention, MLAttention)
from specray.models.kv_cache import MaskKind, MLAAttentionSpec
from specray.models.layers import (ColumnParallelLinear, RMSNorm, RotaryEmbedding, VocabParallelEmbedding,
                                   max_positions, rope_parameters, rotary_dim)
from specray.models.llama import LlamaMLP
from specray.models.longcat_flash import ScaledRMSNorm
from specray.models.moe import FAMILIES, MoEFamily, SparseMoE
from specray.models.olmo3 import RopePerKind
from specray.models.plain_config import PlainConfig, plain_config
from specray.parallel import PPGroup, TPGroup

# DeepSeek-V3's grouped sigmoid router and names; the shared experts of their own width
FAMILIES["dots3_note_text"] = MoEFamily("grouped_sigmoid", "n_routed_experts", "moe_intermediate_size",
                                        shared="shared_experts", shared_width="shared_experts_intermediate_size")
INDEXED, FULL, SLIDING = "indexed_attention", "full_attention", "sliding_attention"
LAYER_TYPES = (INDEXED, FULL, SLIDING)
MLP_TYPES = ("dense", "sparse")


@dataclass(frozen=True)
class SlidingMLAAttentionSpec(MLAAttentionSpec):
    """A latent cache row per slot whose queries see the last ``sliding_window`` positions (Dots3-Note's sliding
    layers); every slot is kept, as every spec's (the window is a mask)."""

    sliding_window: int = 0

    @property
    def mask_kind(self) -> MaskKind:
        return MaskKind(window=self.sliding_window)


def layer_types(config) -> list[str]:
    """Each layer's kind (``layer_types``), checked."""
    kinds = list(getattr(config, "layer_types", None) or [])
    if len(kinds) != config.num_hidden_layers or not set(kinds) <= set(LAYER_TYPES):
        raise ValueError(f"layer_types={kinds!r}: Dots3-Note needs one of {list(LAYER_TYPES)} for each of the "
                         f"num_hidden_layers={config.num_hidden_layers} layers; fix config.json")
    return kinds


def _overrides(config, layer: int) -> dict[str, Any]:
    """Layer ``layer``'s per-layer overrides (a plain config carries ``per_layer_config`` as layer -> fields)."""
    per_layer = getattr(config, "per_layer_config", None) or {}
    if not isinstance(per_layer, dict):
        raise ValueError(f"per_layer_config of type {type(per_layer).__name__}: Dots3-Note reads it as a dict, layer "
                         "-> fields; pass the config as specray.models.loader.read_config gives it")
    return dict(per_layer.get(layer) or per_layer.get(str(layer)) or {})


def _kind_rope(config, kind: str) -> dict:
    """The RoPE settings of ``kind`` (``rope_parameters[kind]``), flat, partial rotation allowed."""
    return rope_parameters(config, kind, partial=True)


def _kind_rotary_dim(config, kind: str) -> int:
    """How many features ``kind``'s RoPE rotates: its first layer's ``head_dim`` times the kind's
    ``partial_rotary_factor``, truncated, as transformers builds the kind's table."""
    first = layer_config(config, layer_types(config).index(kind))
    head_dim = getattr(first, "head_dim", None) or first.hidden_size // first.num_attention_heads
    return rotary_dim(head_dim, _kind_rope(config, kind))


def layer_config(config, layer: int) -> PlainConfig:
    """Layer ``layer``'s view of ``config``: the global fields with its ``per_layer_config`` overrides, its kind's
    RoPE settings as the only ones, and ``index_topk`` 0 unless it is an indexed layer (so that
    :class:`~specray.models.deepseek_v3.MLAttention` builds an indexer there alone)."""
    kind = layer_types(config)[layer]
    values = {**vars(config), **_overrides(config, layer)}
    values["rope_parameters"] = _kind_rope(config, kind)
    values["qk_head_dim"] = values["qk_nope_head_dim"] + values["qk_rope_head_dim"]  # (the layer's own)
    values["rope_scaling"] = None
    topk = values.get("index_topk")
    if kind == INDEXED and not (isinstance(topk, int) and topk > 0):
        raise ValueError(f"index_topk={topk!r}: layer {layer} is an 'indexed_attention' layer, whose indexer keeps "
                         "index_topk keys per query; give a positive int index_topk in config.json")
    values["index_topk"] = topk if kind == INDEXED else 0
    values.pop("per_layer_config", None)
    return PlainConfig(**values)


class Dots3NoteAttention(MLAttention):
    """DeepSeek-V3.2's latent attention (an indexer on the indexed layers, a window on the sliding ones) with Dots3's
    scaled latents, normed RoPE key and per-head output gate (module docstring), over ``tp``; built from layer
    ``layer``'s own view of the config."""

    def __init__(self, config, tp: TPGroup, layer: int):
        kind = layer_types(config)[layer]
        own = layer_config(config, layer)
        if not own.q_lora_rank:
            raise ValueError(f"q_lora_rank={own.q_lora_rank!r} (layer {layer}, {kind}): Dots3-Note's queries and "
                             "indexer read the query latent, so every layer needs a positive q_lora_rank; fix "
                             "config.json (per_layer_config / swa_q_lora_rank)")
        r = _kind_rotary_dim(config, kind)
        if own.qk_rope_head_dim != r:
            raise ValueError(f"qk_rope_head_dim={own.qk_rope_head_dim} (layer {layer}) but rope_parameters[{kind!r}] "
                             f"rotates {r} features (head_dim times partial_rotary_factor): transformers' table and "
                             "the layer would disagree; fix config.json so that they match")
        super().__init__(own, tp, layer)
        self.kind = kind
        self.interleave = True  # MLA's RoPE on interleaved pairs (transformers' apply_rotary_pos_emb_interleave)
        if self.indexer is not None:
            if self.indexer.dim < self.rope:
                raise ValueError(f"index_head_dim={self.indexer.dim} < qk_rope_head_dim={self.rope} (layer {layer}): "
                                 "the indexer rotates its first qk_rope_head_dim features; fix config.json")
            self.indexer.interleave = True  # GLM-5's indexer
        self.query_scaling = None  # (no position scaling of the queries in transformers' Dots3 attention)
        h, eps = own.hidden_size, own.rms_norm_eps
        self.q_a_layernorm = ScaledRMSNorm(own.q_lora_rank, eps, (h / own.q_lora_rank) ** 0.5)
        self.kv_a_layernorm = ScaledRMSNorm(self.rank, eps, (h / self.rank) ** 0.5)
        self.k_rope_only_layernorm = RMSNorm(self.rope, eps)
        self.g_proj = ColumnParallelLinear(h, own.num_attention_heads, tp)  # by head, as q_b_proj
        window = own.sliding_window if kind == SLIDING else None
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window={window!r} (layer {layer}, sliding_attention): a positive int is "
                             "needed; fix config.json (sliding_window / sliding_window_size)")
        index_dim = 0 if self.indexer is None else self.indexer.dim
        spec = (MLAAttentionSpec(self.rank, self.rope, index_dim) if window is None
                else SlidingMLAAttentionSpec(self.rank, self.rope, index_dim, sliding_window=window))
        # the plain softmax scale: no YaRN mscale_all_dim in it (transformers' Dots3 attention resets it)
        self.attn = LatentAttention(self.num_heads, spec, (self.nope + self.rope) ** -0.5, self.nope, self.v_dim,
                                    own.index_topk if self.indexer is not None else 0)

    def gate(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Each head's output [T, Hl, v] times the sigmoid of its gate [T, Hl] (in the model's dtype, as
        transformers)."""
        return out * torch.sigmoid(gate)[..., None]

    def head_outputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
                     ) -> torch.Tensor:
        """Each of this rank's heads' gated attention output [T, Hl, v], before ``o_proj``."""
        t, hl = x.shape[0], self.num_heads
        q_latent = self.q_a_layernorm(self.q_a_proj(x))  # [T, q_lora_rank], scaled: what the indexer reads too
        q = self.q_b_proj(q_latent).view(t, hl, self.nope + self.rope)
        return self.gate(self.attend_queries(x, q, q_latent, cos, sin, meta), self.g_proj(x))

    def rope_key(self, k_rot: torch.Tensor) -> torch.Tensor:
        return self.k_rope_only_layernorm(k_rot)  # normed on the checkpoint's (interleaved) order, then rotated


def _check_experts(config) -> None:
    """ValueErrors for expert settings transformers' Dots3-Note refuses too, naming the field."""
    shared = getattr(config, "n_shared_experts", None)
    if not isinstance(shared, int) or shared < 1:
        raise ValueError(f"n_shared_experts={shared!r}: Dots3-Note's experts have at least one shared expert (their "
                         "width shared_experts_intermediate_size times n_shared_experts); fix config.json")
    experts, groups = config.n_routed_experts, config.n_group
    if not isinstance(groups, int) or groups < 1 or experts % groups or experts // groups < 2:
        raise ValueError(f"n_routed_experts={experts}, n_group={groups!r}: the experts must split into n_group groups "
                         "of at least 2 (a group's worth is its two best scores); fix config.json")


class Dots3NoteDecoderLayer(DeepseekV3DecoderLayer):
    """V3.2's pre-norm layer with Dots3's attention; a dense MLP or the experts by ``mlp_layer_types``."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        nn.Module.__init__(self)
        kinds = list(getattr(config, "mlp_layer_types", None) or [])
        if len(kinds) != config.num_hidden_layers or not set(kinds) <= set(MLP_TYPES):
            raise ValueError(f"mlp_layer_types={kinds!r}: Dots3-Note needs one 'dense' or 'sparse' per layer "
                             f"(num_hidden_layers={config.num_hidden_layers}); fix config.json")
        if kinds[layer] == "sparse":
            _check_experts(config)
        self.self_attn = Dots3NoteAttention(config, tp, layer)
        self.mlp = SparseMoE(config, tp, expert_parallel) if kinds[layer] == "sparse" else LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = 1.0


class Dots3NoteModel(RopePerKind, DeepseekV3Model):
    """V3.2's stack with a RoPE table per kind of layer (module docstring)."""

    layer_class = Dots3NoteDecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)
        self.layer_types = layer_types(config)
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(_kind_rotary_dim(config, kind), _kind_rope(config, kind),
                                                           max_positions(config))
                                     for kind in sorted(set(self.layer_types))})
        self.build_stage(config, pp, lambda i: self.layer_class(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.embedding_multiplier = 1.0


class Dots3NoteForCausalLM(DeepseekV3ForCausalLM):
    """Dots3-Note's text model for causal LM, sharded over ``tp`` (heads, ``g_proj`` by head; experts by width, or
    whole with expert parallelism) and ``pp``."""

    # every projection applied as a linear (kv_b_proj is read as W_UK and W_UV)
    lora_modules = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "g_proj", "gate_proj", "up_proj",
                    "down_proj")
    model_class = Dots3NoteModel
    skipped = ("model.mtp.",)  # a release's MTP module (layout unknown: module docstring)

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        # plain attributes: transformers' heterogeneous config refuses to give the per-layer fields globally
        super().__init__(plain_config(hf_config), tp, expert_parallel, pp)

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False) -> tuple[nn.Module, nn.Module]:
        raise ValueError("speculative_config method='mtp' is not supported for model_type='dots3_note_text': "
                         "transformers' Dots3-Note has no multi-token-prediction module (it skips a release's "
                         "model.layers.{num_hidden_layers}.* and model.mtp.* tensors), so their layout is unknown; "
                         "use a drafter that needs no MTP layers (ngram, suffix, lookahead, draft_model, or an EAGLE "
                         "head trained for it)")
