"""Gemma 4's assistant (``Gemma4AssistantForCausalLM``, model type ``gemma4_assistant``; e.g.
google/gemma-4-e2b-it-assistant): the small multi-token-prediction drafter Google releases beside each Gemma 4, built
from our Gemma 4 layers (:mod:`specray.models.gemma4`). Gemma 4 Unified's (``Gemma4UnifiedAssistantForCausalLM``,
``gemma4_unified_assistant``) is transformers' same class over a ``gemma4_unified_text`` config and is served as it is,
drafting for a Gemma 4 Unified target (:mod:`specray.models.gemma4_unified`).

One draft step, for a request whose last seen token ``t`` sits at position P:

* its input is ``cat(E(t), h)`` [2 * backbone_hidden_size], E the target's (scaled) embedding and h a hidden state of
  the target's width: at the first step the target's last hidden state (after its final norm) at position P - 1, the
  token before ``t``; at later steps the assistant's own ``post_projection`` output of the step before;
* ``pre_projection`` takes it to the assistant's width, then every assistant layer runs, each a Gemma 4 decoder layer
  whose attention has a query projection only: all of them are KV-shared with the **target**. A sliding layer attends
  the K/V of the target's last sliding layer that computes K/V, a full layer those of its last full one (transformers'
  "store" layers: :func:`specray.models.gemma4.kv_store_layers`), read in place from the target's paged cache through
  the target's block tables; the assistant owns no cache and writes nothing;
* every query sits at the constant RoPE position P, and sees the target's committed keys before P: a full layer keys
  0 .. P - 1, a sliding layer the last ``sliding_window + 1`` of them, P - 1 - W .. P - 1 (transformers' mask for the
  assistant: a bidirectional window of W around the query, flipped onto the past). Key P is never seen: the target has
  not written the K/V of the token it just sampled (after a rejected draft, slot P holds that draft's);
* its final norm, then ``lm_head`` (tied to its own embedding) gives the logits and ``post_projection`` the next step's
  hidden state. With ``use_ordered_embeddings``, the logits are the centroid-masked head's: the ``centroids``
  projection's top ``centroid_intermediate_top_k`` clusters of ``token_ordering`` are scored, the other tokens masked.
  transformers fills the masked ones with (the batch's smallest score - 1), which needs a host sync and depends on the
  batch; here they are -inf, so the argmax is the same and a sampled request's q has no mass outside the clusters
  (what is drawn is verified against that q, so verification stays exact).

No softcap on the logits (transformers' assistant has none). One rank only: the target's K/V are split by heads over
tensor-parallel ranks, and the driver would see its share alone. Tiny random models against transformers only: never
run on a GPU or a real checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata, build_attention_metadata
from specray.models.draft_head import ReadsTarget
from specray.models.gemma4 import Gemma4DecoderLayer, Gemma4RMSNorm, _rotary, kv_store_layers, layer_geometry
from specray.models.kv_cache import MaskKind
from specray.models.layers import ColumnParallelLinear, materialize
from specray.models.llama import _map_name, expected_keys, load_param
from specray.parallel import TPGroup

logger = logging.getLogger(__name__)

MODEL_TYPE = "gemma4_assistant"
# Gemma 4 Unified's assistant (``Gemma4UnifiedAssistantForCausalLM``) is transformers' Gemma 4 assistant class
# renamed, over a gemma4_unified_text config: the same drafter, for either kind of target
MODEL_TYPES = (MODEL_TYPE, "gemma4_unified_assistant")
# a multimodal release's text part is read as its text model type (specray.models.gemma4_unified for Unified's)
TARGET_MODEL_TYPES = ("gemma4_text", "gemma4_unified_text")


def check_assistant(config, target_config) -> None:
    """A ValueError naming the field where the assistant ``config`` (the whole ``gemma4_assistant`` config, its
    ``text_config`` inside) does not fit the target's text config ``target_config``."""
    target_type = getattr(target_config, "model_type", None)
    if target_type not in TARGET_MODEL_TYPES:
        raise ValueError(f"method='gemma4_assistant' drafts for a Gemma 4 target, and the target's model_type is "
                         f"{target_type!r}: serve a Gemma 4 model (model_type 'gemma4' or 'gemma4_text', or Gemma 4 "
                         "Unified's 'gemma4_unified' or 'gemma4_unified_text'), or pick another speculative method")
    own_type = getattr(config, "model_type", None)
    if own_type not in MODEL_TYPES:
        raise ValueError(f"speculative_config.model has model_type={own_type!r}; method='gemma4_assistant' needs a "
                         f"Gemma 4 assistant checkpoint (model_type {MODEL_TYPE!r} or 'gemma4_unified_assistant', "
                         "e.g. google/gemma-4-e2b-it-assistant)")
    text = config.text_config
    h = target_config.hidden_size
    if config.backbone_hidden_size != h:
        raise ValueError(f"the assistant's backbone_hidden_size={config.backbone_hidden_size} does not match the "
                         f"target's hidden_size={h}: the assistant was trained for another Gemma 4")
    if text.vocab_size != target_config.vocab_size:
        raise ValueError(f"the assistant's vocab_size={text.vocab_size} does not match the target's "
                         f"vocab_size={target_config.vocab_size}: the assistant was trained for another Gemma 4")
    for field in ("hidden_size_per_layer_input", "enable_moe_block", "use_double_wide_mlp"):
        if getattr(text, field, None):
            raise ValueError(f"the assistant's text_config.{field}={getattr(text, field)!r} is not supported (a Gemma "
                             "4 assistant has none)")
    shared = int(getattr(text, "num_kv_shared_layers", 0) or 0)
    if shared != text.num_hidden_layers:
        raise ValueError(f"the assistant's text_config.num_kv_shared_layers={shared} must equal its "
                         f"num_hidden_layers={text.num_hidden_layers}: every assistant layer reads the target's K/V")
    stores = kv_store_layers(target_config)
    for i, kind in enumerate(text.layer_types):
        if kind not in stores:
            raise ValueError(f"the assistant's layer {i} is a {kind} layer, and the target has no {kind} layer "
                             "computing K/V for it to read")
        own, theirs = layer_geometry(text, i), layer_geometry(target_config, stores[kind])
        if own != theirs:
            raise ValueError(f"the assistant's layer {i} ({kind}) has (head_dim, num_key_value_heads)={own} but the "
                             f"target's layer {stores[kind]}, whose K/V it reads, has {theirs}: the assistant was "
                             "trained for another Gemma 4")
    if getattr(config, "use_ordered_embeddings", False):
        clusters = config.num_centroids
        if text.vocab_size % clusters or not 0 < config.centroid_intermediate_top_k <= clusters:
            raise ValueError(f"the assistant's num_centroids={clusters} must divide vocab_size={text.vocab_size} and "
                             f"centroid_intermediate_top_k={config.centroid_intermediate_top_k} be in [1, {clusters}]")


class Gemma4Assistant(ReadsTarget):
    """The assistant over ``target`` (our :class:`~specray.models.gemma4.Gemma4ForCausalLM`, one rank): see the module
    docstring. Build it under the target's device and dtype; it holds no reference to the target's parameters."""

    def __init__(self, config, target, target_config):
        super().__init__()
        check_assistant(config, target_config)
        text = config.text_config
        self.config = config
        self._target = (target,)  # a tuple: not a submodule, so its weights are never ours
        single = TPGroup.single()
        self.tp = single
        h, hb, vocab = text.hidden_size, config.backbone_hidden_size, text.vocab_size
        stores = kv_store_layers(target_config)
        self.layers = nn.ModuleList([Gemma4DecoderLayer(text, single, i, stores[kind])
                                     for i, kind in enumerate(text.layer_types)])
        window = MaskKind(window=text.sliding_window + 1)  # keys P - 1 - W .. P - 1 (seen from mask position P - 1)
        for layer in self.layers:
            if layer.layer_type == "sliding_attention":
                layer.self_attn.attn.mask_kind = window
        self.norm = Gemma4RMSNorm(h, text.rms_norm_eps)
        self.pre_projection = ColumnParallelLinear(2 * hb, h, single)
        self.post_projection = ColumnParallelLinear(h, hb, single)
        self.lm_head = ColumnParallelLinear(h, vocab, single)
        kinds = sorted(set(text.layer_types))
        self.rotary = nn.ModuleDict({kind: _rotary(text, kind, layer_geometry(text, text.layer_types.index(kind))[0])
                                     for kind in kinds})
        self.centroids = None
        if getattr(config, "use_ordered_embeddings", False):
            self.centroids = ColumnParallelLinear(h, config.num_centroids, single)
            self.top_clusters = int(config.centroid_intermediate_top_k)
            self.register_buffer("token_ordering", torch.zeros(vocab, dtype=torch.long))
        self.vocab_size = vocab
        self.aux_layers: tuple[int, ...] = ()

    def kv_cache_specs(self) -> list:
        return []  # no cache of its own: it reads the target's

    def bind_target_kv(self) -> None:
        """Point every layer's attention at the cache view of the target layer it reads (the runner binds the
        target's cache after the drafter is built, and may bind it again)."""
        for layer in self.layers:
            source, attn = self.target.kv_store_attention(layer.layer_type), layer.self_attn.attn
            attn.k_cache, attn.v_cache, attn.block_size, attn.fp8 = (source.k_cache, source.v_cache,
                                                                     source.block_size, source.fp8)
            attn.k_scale, attn.v_scale = source.k_scale, source.v_scale

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: token_ids [B] (each request's last seen token), hidden [B, Hb] (the target's row before it,
        or the last step's output), positions [B] (the RoPE position P of that token), ``meta`` one query per
        request at mask position P - 1 over the target's block tables (:func:`draft_metadata`) -> (the next step's
        hidden [B, Hb], the normed last hidden [B, H] for :meth:`logits`)."""
        x = self.pre_projection(torch.cat((self.target.embed(token_ids).to(hidden.dtype), hidden), dim=-1))
        tables = {}
        for kind, rotary in self.rotary.items():
            rotary.ensure(int(meta.max_position) + 2)  # P = mask position + 1: no host sync (a Python int)
            tables[kind] = rotary(positions, x.dtype)
        nothing = x.new_empty(0)  # the shared layers read the target's cache, never a step's own K/V
        for layer in self.layers:
            x, _ = layer(x, None, *tables[layer.layer_type], meta, (nothing, nothing))
        last = self.norm(x)
        return self.post_projection(last), last

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """last [B, H] -> logits [B, V] float32: ``lm_head``'s, or the centroid-masked head's (-inf outside the top
        clusters)."""
        if self.centroids is None:
            return self.lm_head(last).float()
        b = last.shape[0]
        top = self.centroids(last).topk(self.top_clusters, dim=-1).indices  # [B, k]
        ids = self.token_ordering.view(self.centroids.out_local, -1)[top].reshape(b, -1)  # [B, k * V/C] token ids
        rows = F.embedding(ids, self.lm_head.weight)  # [B, k * V/C, H]
        scores = torch.matmul(rows, last[:, :, None]).squeeze(-1).float()
        return scores.new_full((b, self.vocab_size), float("-inf")).scatter_(1, ids, scores)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The checkpoint's tensors (``model.layers.{i}.*``, ``model.norm``, ``pre_projection``, ``post_projection``,
        ``lm_head`` or the tied ``model.embed_tokens``, ``masked_embedding.*``)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        embedding = None
        for name, tensor in weights:
            if name == "model.embed_tokens.weight":
                embedding = tensor  # the tied LM head's rows (the assistant reads the target's embedding)
                continue
            if name == "masked_embedding.token_ordering":
                if self.centroids is None:
                    continue
                value = materialize(tensor).to(torch.long)
                if sorted(value.tolist()) != list(range(self.vocab_size)):
                    raise ValueError("the assistant's masked_embedding.token_ordering is not a permutation of its "
                                     f"vocabulary of {self.vocab_size}: the checkpoint does not match its config")
                self.token_ordering.copy_(value)
                loaded.add("token_ordering")
                continue
            name = name.removeprefix("model.").replace("masked_embedding.centroids.", "centroids.")
            target, shard = _map_name(name)
            if target not in params and name in params:  # a shared layer's q_proj stands alone
                target, shard = name, None
            param = params.get(target)
            if param is None:
                logger.warning("ignoring assistant checkpoint tensor %s: no such parameter", name)
                continue
            loaded.add(load_param(param, target, tensor, shard))
        if "lm_head.weight" not in loaded and embedding is not None:
            loaded.add(load_param(params["lm_head.weight"], "lm_head.weight", embedding, None))
        expected = expected_keys(params) | ({"token_ordering"} if self.centroids is not None else set())
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"the assistant checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}; is it a "
                             "complete gemma4_assistant checkpoint matching its config.json?")


def draft_metadata(positions: list[int], tables: list[list[int]], block_size: int, device: torch.device
                   ) -> AttentionMetadata:
    """One query per request whose last seen token sits at ``positions[i]`` = P: at mask position P - 1, so that it
    sees the target's committed keys before P (a full layer's all of them, a sliding layer's last W + 1), with the
    context read from the cache on the padded short path (the query writes nothing, so no step's own K/V exists to
    attend)."""
    return build_attention_metadata([1] * len(positions), [p - 1 for p in positions], tables, block_size, device,
                                    read_in_place=False)


def load_assistant(path, config, target, target_config) -> Gemma4Assistant:
    """The assistant in ``path`` (its plain ``config`` as :func:`specray.models.loader.read_config` gives it) over
    ``target``, on the target's device and dtype, in eval mode."""
    from specray.models.loader import _default_dtype, iter_weights, resolve_model

    with _default_dtype(target.dtype), torch.device(target.device):
        model = Gemma4Assistant(config, target, target_config)
    model.load_weights(iter_weights(resolve_model(path)))
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
