"""Google's Gemma 4 (text): ``Gemma4ForCausalLM`` (``gemma4_text``) and the text model of
``Gemma4ForConditionalGeneration``, written with tensor-parallel layers on the Llama plumbing
(:class:`~specray.models.llama.LlamaForCausalLM`: weights, KV binding, the interface).

Where it differs from Gemma 3 (:mod:`specray.models.gemma3`):

* RMSNorm scales by ``weight`` (not ``1 + weight``); values get an RMSNorm without a scale; attention's scale is 1
  (the q and k norms set the scores' size);
* sliding-window layers and full ones (``layer_types``) differ in shape as well as in RoPE: the full layers' heads
  are ``global_head_dim`` wide (transformers keeps it per layer, ``per_layer_config``), with
  ``num_global_key_value_heads`` KV heads under ``attention_k_eq_v``, where they have no v projection: the values are
  the keys' projection (normed apart from the keys, unrotated). Each kind has its own RoPE
  (``rope_parameters[layer_type]``); the full layers' is "proportional": the first ``partial_rotary_factor`` of the
  frequencies of a whole head's, the rest not rotated;
* KV sharing (``num_kv_shared_layers``): the last layers compute no K/V and attend over the K/V of the last earlier
  layer of their kind, which the cache expresses (:class:`~specray.models.kv_cache.SharedKVSpec`: no memory, the
  source's view); with ``use_double_wide_mlp`` those layers' MLPs are twice as wide;
* ``enable_moe_block``: every layer adds a mixture of experts beside its dense MLP, each through norms of its own
  (:class:`Gemma4Experts`: :mod:`specray.models.moe`'s block with Gemma 4's router and a gated GELU);
* per-layer inputs (``hidden_size_per_layer_input``, the small E2B / E4B releases): a second embedding, of every
  layer's ``hidden_size_per_layer_input`` features per token, mixed with a projection of the embedded tokens, gates a
  small residual branch at the end of each layer;
* every layer's output is multiplied by its ``layer_scalar`` (a checkpoint tensor);
* ``final_logit_softcapping`` as Gemma 2 and 3.

LoRA adapters (:mod:`specray.models.lora`) adapt q/k/v/o and gate/up/down, the names a PEFT adapter of
transformers' Gemma 4 targets: a KV-shared layer's q and o alone, a k = v full layer's q, k and o (transformers builds
neither a shared layer's k/v projections nor a k = v layer's v projection, so PEFT never adapts them: an adapter
naming one was made for another model and is refused by name, as are the per-layer-input projections, the router
and the experts).

Pipeline stages: the first stage computes the per-layer inputs (it holds both embeddings) and hands them on behind
its residual stream (:attr:`Gemma4ForCausalLM.stage_width`), packed into as many [T, H] rows as they need; a
KV-shared layer must sit on its source layer's stage (it reads that layer's cache), else a ValueError names
num_kv_shared_layers and pipeline_parallel_size. Tiny random models against transformers only: never run on a GPU
or a real checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.kv_cache import CAUSAL_KEYS, FullAttentionSpec, KVCacheSpec, SharedKVSpec, SlidingWindowSpec
from specray.models.layers import (ColumnParallelLinear, OtherStage, QKVParallelLinear,
                                   RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding, _param, apply_rotary,
                                   divide, materialize, on_stage, rope_parameters)
from specray.models.gemma3 import Gemma3ForCausalLM, Gemma3MLP
from specray.models.llama import (KV_SCALE_NAMES, StageModel, _layer_index, _map_name, checkpoint_names,
                                  expected_keys, load_param)
from specray.models.moe import SparseMoE
from specray.parallel import PPGroup, TPGroup, stage_layers

LAYER_TYPES = ("sliding_attention", "full_attention")
ACTIVATION = "gelu_pytorch_tanh"


def layer_geometry(config, layer: int) -> tuple[int, int]:
    """(head_dim, num_key_value_heads) of layer ``layer``: the config's, or its per-layer override (a transformers
    config's ``per_layer_config[layer]``; a plain config carries the overrides as a dict, layer -> fields)."""
    per_layer = getattr(config, "per_layer_config", None)
    if per_layer is None or isinstance(per_layer, dict):
        overrides = (per_layer or {}).get(layer) or (per_layer or {}).get(str(layer)) or {}
        return (int(overrides.get("head_dim", config.head_dim)),
                int(overrides.get("num_key_value_heads", config.num_key_value_heads)))
    layer_config = per_layer[layer]
    return int(layer_config.head_dim), int(layer_config.num_key_value_heads)


def kv_sources(config) -> list[int | None]:
    """Per layer, the layer whose K/V it attends over (None: its own): with ``num_kv_shared_layers`` = n, each of
    the last n layers shares those of the last earlier layer of its kind, as transformers' ``kv_sharing_modes``."""
    layers, shared = config.num_hidden_layers, int(getattr(config, "num_kv_shared_layers", 0) or 0)
    if not 0 <= shared < layers:
        raise ValueError(f"num_kv_shared_layers={shared} must be at least 0 and below num_hidden_layers={layers}: "
                         "some earlier layer must compute the K/V the shared layers read")
    first = layers - shared
    kinds = list(config.layer_types)
    sources: list[int | None] = [None] * layers
    for i in range(first, layers):
        owners = [j for j in range(first) if kinds[j] == kinds[i]]
        if not owners:
            raise ValueError(f"num_kv_shared_layers={shared}: layer {i} ({kinds[i]}) shares K/V, but no layer before "
                             f"layer {first} is a {kinds[i]} layer to share them")
        sources[i] = owners[-1]
    return sources


def kv_store_layers(config) -> dict[str, int]:
    """Per layer kind, the last layer of that kind that computes K/V (before the KV-shared ones): transformers' "store"
    layers, whose K/V the shared layers and Gemma 4's assistant (:mod:`specray.models.gemma4_assistant`) attend."""
    first = config.num_hidden_layers - int(getattr(config, "num_kv_shared_layers", 0) or 0)
    return {kind: i for i, kind in enumerate(list(config.layer_types)[:first])}


def _kv_shard(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """(this rank's KV heads, the first one's global index), as :class:`QKVParallelLinear` splits them."""
    if num_kv_heads >= tp.size:
        local = divide(num_kv_heads, tp.size, "num_key_value_heads")
        return local, tp.rank * local
    if tp.size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp.size} must be a multiple of num_key_value_heads={num_kv_heads} "
                         "when it exceeds it (KV heads are then replicated)")
    return 1, tp.rank // (tp.size // num_kv_heads)


class Gemma4RMSNorm(nn.Module):
    """``x / rms(x) * weight`` in float32, cast back to x's dtype; without a scale where ``scaled`` is False (the
    values' norm, the router's)."""

    def __init__(self, size: int, eps: float, scaled: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = _param(size) if scaled else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = F.rms_norm(x.float(), x.shape[-1:], None, self.eps)  # one op (on CUDA one fused kernel)
        return (xf if self.weight is None else xf * self.weight.float()).to(x.dtype)


class QKParallelLinear(QKVParallelLinear):
    """q and k in one matmul, no v (``attention_k_eq_v``: the values are the keys' projection); q and k are split
    over ranks as :class:`QKVParallelLinear` splits them."""

    lora_parts = ("q", "k")  # a LoRA adapter's parts (specray.models.lora): no v_proj to adapt

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, tp: TPGroup,
                 bias: bool = False):
        super().__init__(hidden_size, head_dim, num_heads, num_kv_heads, tp, bias)
        self.out_local = self.q_size + self.kv_size
        self.weight = self._own_weight(self.out_local, hidden_size)
        if bias:
            self.bias = _param(self.out_local)
            self.bias.weight_loader = self.weight_loader


class SharedPagedAttention(PagedAttention):
    """Attention over another layer's cache (bound to its view): it reads the K/V that layer wrote this step and
    before, and writes none."""

    def _store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        pass


class ProportionalRotaryEmbedding(RotaryEmbedding):
    """Gemma 4's "proportional" RoPE over a whole head: the first ``partial_rotary_factor`` of its frequency pairs
    at a whole head's frequencies (``theta ** (-2i / head_dim)``), the others at 0 (not rotated)."""

    def _inv_freq(self) -> torch.Tensor:
        p, dim = self.params, self.head_dim
        angles = int(p.get("partial_rotary_factor", 1.0) * dim // 2)
        rotated = 1.0 / (p["rope_theta"] ** (torch.arange(0, 2 * angles, 2, device="cpu").float() / dim))
        return torch.cat((rotated, torch.zeros(dim // 2 - angles, device="cpu"))) / float(p.get("factor", 1.0))


def _rotary(config, kind: str, head_dim: int) -> RotaryEmbedding:
    """The RoPE of ``kind``'s layers (``rope_parameters[kind]``)."""
    params = dict((getattr(config, "rope_parameters", None) or {}).get(kind) or {})
    if params.get("rope_type") == "proportional":
        params.setdefault("rope_theta", 10000.0)
        return ProportionalRotaryEmbedding(head_dim, params, config.max_position_embeddings)
    return RotaryEmbedding(head_dim, rope_parameters(config, kind), config.max_position_embeddings)


class Gemma4Attention(nn.Module):
    """One layer's attention; ``source``: the layer whose K/V it reads (None: it computes and caches its own)."""

    def __init__(self, config, tp: TPGroup, layer: int, source: int | None):
        super().__init__()
        self.layer_type = config.layer_types[layer]
        sliding = self.layer_type == "sliding_attention"
        head_dim, kv_heads = layer_geometry(config, layer)
        self.head_dim, self.source = head_dim, source
        self.k_eq_v = bool(getattr(config, "attention_k_eq_v", False)) and not sliding
        bias = bool(getattr(config, "attention_bias", False))
        heads = config.num_attention_heads
        eps = config.rms_norm_eps
        if source is None:
            linear = QKParallelLinear if self.k_eq_v else QKVParallelLinear
            self.qkv_proj = linear(config.hidden_size, head_dim, heads, kv_heads, tp, bias=bias)
            self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
            kv_start = self.qkv_proj.kv_head_start
            self.k_norm = Gemma4RMSNorm(head_dim, eps)
            self.v_norm = Gemma4RMSNorm(head_dim, eps, scaled=False)
        else:  # the source's K/V: a query projection alone
            self.q_proj = ColumnParallelLinear(config.hidden_size, heads * head_dim, tp, bias=bias)
            self.num_heads = divide(heads, tp.size, "num_attention_heads")
            self.num_kv_heads, kv_start = _kv_shard(kv_heads, tp)
        self.q_norm = Gemma4RMSNorm(head_dim, eps)
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, tp, bias=bias)
        spec = dict(num_kv_heads=self.num_kv_heads, head_dim=head_dim, kv_head_start=kv_start)
        kv_spec = SlidingWindowSpec(**spec, sliding_window=config.sliding_window) if sliding else \
            FullAttentionSpec(**spec)
        self.attn = (SharedPagedAttention if source is not None else PagedAttention)(self.num_heads, kv_spec, 1.0)
        # a full layer stays causal over images that see each other both ways in the sliding layers
        # (``ProcessedImage.bidirectional``, specray.models.gemma4_images), as transformers masks Gemma 4's full
        # layers: a step's mask among a sequence's new tokens (a tree's ancestors, an image's) narrows its causal
        # order, never widens it (Gemma 4 Unified's images see each other in every layer: its text config says so)
        if not (sliding or getattr(config, "images_both_ways_in_full_layers", False)):
            self.attn.mask_kind = CAUSAL_KEYS

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        # x: [T, H]; cos, sin: [T, 1, D/2]; shared: the source layer's (k, v) [T, Hkv, D] of this step
        # -> ([T, H], this layer's (k, v) for the layers sharing them, None where it shares another's)
        t = x.shape[0]
        if self.source is not None:
            q = apply_rotary(self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim)), cos, sin)
            k, v = shared
            return self.o_proj(self.attn(q, k, v, meta)), None
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q = self.q_norm(qkv[:, :q_size].view(t, self.num_heads, self.head_dim))
        raw_k = qkv[:, q_size: q_size + kv_size].view(t, self.num_kv_heads, self.head_dim)
        raw_v = raw_k if self.k_eq_v else qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, self.head_dim)
        qk = apply_rotary(torch.cat((q, self.k_norm(raw_k)), dim=1), cos, sin)
        q, k, v = qk[:, : self.num_heads], qk[:, self.num_heads:], self.v_norm(raw_v)
        return self.o_proj(self.attn(q, k, v, meta)), (k, v)


class Gemma4Experts(SparseMoE):
    """Gemma 4's experts on :class:`~specray.models.moe.SparseMoE` (its storage, split over ranks, loading of the fused
    ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], and dispatch; moe.py's ``gemma4_text`` row), with
    Gemma 4's router:

    * the router reads the residual stream (not the experts' input): RMS-normed without a scale, times ``scale`` [H]
      and ``hidden_size ** -0.5``, projected (``gate``), softmax in float32, the top k renormalised, each weight
      times its expert's ``per_expert_scale``;
    * each expert is a gated GELU (tanh)."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False):
        for field in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if not getattr(config, field, None):
                raise ValueError(f"enable_moe_block=True needs {field} (got {getattr(config, field, None)!r})")
        super().__init__(config, tp, expert_parallel)  # moe.py's gemma4_text row
        self.router_norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps, scaled=False)
        self.router_scale = _param(config.hidden_size)
        self.per_expert_scale = _param(config.num_experts)
        self.root_size = config.hidden_size ** -0.5

    def route(self, stream: torch.Tensor, token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # stream: the residual stream [T, H] (``forward(x, router_input=stream)``), not the experts' input; token_ids:
        # unused (no hash-routed layers)
        h = self.router_norm(stream) * self.router_scale * self.root_size
        probs = F.softmax(F.linear(h, self.gate.weight), dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale.float()[ids]
        return weights.to(stream.dtype), ids


def _single_linear(in_features: int, out_features: int) -> ColumnParallelLinear:
    """A small projection every rank holds whole."""
    return ColumnParallelLinear(in_features, out_features, TPGroup.single())


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config, tp: TPGroup, layer: int, source: int | None, expert_parallel: bool = False):
        super().__init__()
        self.layer_type = config.layer_types[layer]
        if self.layer_type not in LAYER_TYPES:
            raise ValueError(f"layer_types[{layer}]={self.layer_type!r} is not supported; one of {list(LAYER_TYPES)}")
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, tp, layer, source)
        wide = 2 if source is not None and getattr(config, "use_double_wide_mlp", False) else 1
        self.mlp = Gemma3MLP(config, tp, config.intermediate_size * wide)
        self.input_layernorm = Gemma4RMSNorm(h, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.moe = None
        if getattr(config, "enable_moe_block", False):
            self.moe = Gemma4Experts(config, tp, expert_parallel)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
        per_layer = getattr(config, "hidden_size_per_layer_input", 0) or 0
        if per_layer:
            self.per_layer_input_gate = _single_linear(h, per_layer)
            self.per_layer_projection = _single_linear(per_layer, h)
            self.post_per_layer_input_norm = Gemma4RMSNorm(h, eps)
        self.layer_scalar = _param(1)

    def forward(self, x: torch.Tensor, per_layer: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, shared: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        # x: the residual stream [T, H]; per_layer: this layer's input [T, P] (or None) -> the next layer's, and
        # this layer's (k, v) for the layers sharing them
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, meta, shared)
        x = x + self.post_attention_layernorm(a)
        y = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe is not None:
            experts = self.moe(self.pre_feedforward_layernorm_2(x), x)
            y = self.post_feedforward_layernorm_1(y) + self.post_feedforward_layernorm_2(experts)
        x = x + self.post_feedforward_layernorm(y)
        if per_layer is not None:
            gated = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar, kv


def check_supported(config, pp: PPGroup) -> None:
    """A ValueError naming the field of what Gemma 4 here does not serve."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act != ACTIVATION:
        raise ValueError(f"hidden_activation={act!r} is not supported; Gemma 4 uses {ACTIVATION!r}")
    if getattr(config, "use_bidirectional_attention", None) not in (None, "vision"):
        raise ValueError(f"use_bidirectional_attention={config.use_bidirectional_attention!r} is not supported: a "
                         "causal LM is served causally (None, or 'vision', which text tokens attend causally)")
    kinds = list(config.layer_types)
    if len(kinds) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries for num_hidden_layers={config.num_hidden_layers}")
    check_stages(config, kv_sources(config), pp.size)


def check_stages(config, sources: list[int | None], stages: int) -> None:
    """A ValueError unless every KV-shared layer sits on its source layer's pipeline stage: it attends over that
    layer's cache, which no other stage holds."""
    if stages == 1:
        return
    stage_of = {i: s for s in range(stages) for i in stage_layers(config.num_hidden_layers, s, stages)}
    for i, source in enumerate(sources):
        if source is not None and stage_of[i] != stage_of[source]:
            shared = config.num_kv_shared_layers
            raise ValueError(f"num_kv_shared_layers={shared} with pipeline_parallel_size={stages}: layer {i} reads "
                             f"the KV cache of layer {source}, which stage {stage_of[source]} holds, but layer {i} "
                             f"is on stage {stage_of[i]}; a KV-shared layer must share its source's stage: choose a "
                             "pipeline_parallel_size whose last stage holds the shared layers and their sources (1 "
                             "always does), or split the model with tensor_parallel_size")


class Gemma4Model(StageModel):
    # built as (config, tp, layer, source, expert_parallel); a stack on this one with other layers gives its own
    # (Gemma 3n's, specray.models.gemma3n)
    layer_class: type[nn.Module] = Gemma4DecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__()
        pp = pp or PPGroup.single()
        check_supported(config, pp)
        self.sources = kv_sources(config)
        self.build_stage(config, pp, lambda i: self.layer_class(config, tp, i, self.sources[i], expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.embed_scale = config.hidden_size ** 0.5  # applied in the embedding's dtype, as transformers does
        self.layer_types = list(config.layer_types)
        dims = {kind: layer_geometry(config, self.layer_types.index(kind))[0] for kind in set(self.layer_types)}
        self.rotary = nn.ModuleDict({kind: _rotary(config, kind, dims[kind]) for kind in sorted(dims)})
        self.per_layer = getattr(config, "hidden_size_per_layer_input", 0) or 0
        self.pad_token_id = getattr(config, "pad_token_id", None)  # image rows' per-layer token (text_ids)
        # the rows [T, H] a stage hands on behind its residual stream: every layer's per-layer inputs, packed
        self.hidden_size = config.hidden_size
        self.per_layer_rows = -(-config.num_hidden_layers * self.per_layer // config.hidden_size)
        if self.per_layer:  # the first stage's (it computes every layer's from the tokens and their embedding)
            layers, width, first = config.num_hidden_layers, self.per_layer, self.pp.is_first
            self.embed_tokens_per_layer = on_stage(first, lambda: VocabParallelEmbedding(
                config.vocab_size_per_layer_input, layers * width, tp))
            self.per_layer_model_projection = on_stage(first, lambda: _single_linear(config.hidden_size,
                                                                                     layers * width))
            self.per_layer_projection_norm = on_stage(first, lambda: Gemma4RMSNorm(width, config.rms_norm_eps))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def text_ids(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The ids the per-layer inputs' own embedding reads: an image row's is ``pad_token_id`` (transformers looks
        up the pad token for its placeholders there; their projected half reads the image's embedding)."""
        if meta.input_embeds is None:
            return input_ids
        return input_ids.index_fill(0, meta.input_embeds[0], int(self.pad_token_id or 0))

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Every layer's input [T, L, P]: the tokens' per-layer embedding (times sqrt(P)) and the RMS-normed
        projection of their embedding ``x`` [T, H] (times H ** -0.5), averaged by 2 ** -0.5."""
        t, width = input_ids.shape[0], self.per_layer
        tokens = self.embed_tokens_per_layer(input_ids)
        tokens = (tokens * torch.tensor(width ** 0.5, dtype=tokens.dtype)).view(t, -1, width)
        projected = self.per_layer_model_projection(x) * (x.shape[-1] ** -0.5)
        projected = self.per_layer_projection_norm(projected.view(t, -1, width))
        return (projected + tokens) * (2.0 ** -0.5)

    def _pack(self, per_layer: torch.Tensor) -> torch.Tensor:
        # per_layer: [T, L, P] -> [R, T, H] (``per_layer_rows`` R, zero-padded): what a stage hands on
        t, h = per_layer.shape[0], self.hidden_size
        flat = F.pad(per_layer.reshape(t, -1), (0, self.per_layer_rows * h - per_layer[0].numel()))
        return flat.view(t, self.per_layer_rows, h).transpose(0, 1)

    def _unpack(self, rows: torch.Tensor) -> torch.Tensor:
        # rows: [R, T, H] -> [T, L, P]
        t, layers = rows.shape[1], len(self.layers)
        return rows.transpose(0, 1).reshape(t, -1)[:, : layers * self.per_layer].view(t, layers, self.per_layer)

    def kind_tables(self, meta: AttentionMetadata, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each kind of layer's RoPE (cos, sin) at the step's positions."""
        tables = {}
        for kind, rotary in self.rotary.items():
            rotary.ensure(meta.max_position + 1)
            tables[kind] = rotary(meta.positions, dtype)
        return tables

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # input_ids: [T] -> hidden [T, H], and the residual stream [T, H] entering each layer of aux_layers. A stage
        # after the first starts from the previous stage's ``intermediate`` [1 + R, T, H] (the residual stream, then
        # the per-layer inputs packed); a stage before the last ends there, returning its own
        if intermediate is None:
            x = meta.with_input_embeds(self.embed(input_ids))  # image rows in place, unscaled (as transformers)
            per_layer = self.per_layer_inputs(self.text_ids(input_ids, meta), x) if self.per_layer else None
        else:
            x = intermediate[0]
            per_layer = self._unpack(intermediate[1:]) if self.per_layer else None
        tables = self.kind_tables(meta, x.dtype)
        aux: dict[int, torch.Tensor] = {}
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> its (k, v) of this step
        for i, layer in self.stage_layers():
            if i in aux_layers:
                aux[i] = x
            source = self.sources[i]
            x, kv = layer(x, None if per_layer is None else per_layer[:, i], *tables[layer.layer_type], meta,
                          None if source is None else shared[source])
            if kv is not None and i in self.sources:
                shared[i] = kv
        if not self.pp.is_last:
            return torch.cat([x[None]] + ([self._pack(per_layer)] if self.per_layer else [])), \
                [aux[i] for i in aux_layers]
        return self.norm(x), [aux[i] for i in aux_layers]


# checkpoint names -> ours (the router's pieces live on our experts' block)
_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.router\.proj\.", ".moe.gate."), (r"\.router\.scale$", ".moe.router_scale"),
    (r"\.router\.per_expert_scale$", ".moe.per_expert_scale")))
_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.experts\.(gate_up_proj|down_proj)$")
_SHARED_KV = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:k_proj|v_proj|k_norm|v_norm)\.")


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    """Gemma 4's text model for causal LM, sharded over ``tp`` (experts by width, or whole with
    ``expert_parallel``); Gemma 3's scaled embedding and soft-capped logits."""

    model_class = Gemma4Model
    # Llama's seven (q/k/v of each layer that has them: see the module docstring); the per-layer-input projections,
    # the router and the experts take none
    lora_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.stage_width = 1 + self.model.per_layer_rows  # the residual stream, then the per-layer inputs packed

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        """What the engine checks before any rank starts (:func:`specray.engine.builder.check_model_split`): a
        KV-shared layer on its source's stage."""
        check_stages(config, kv_sources(config), pp)

    def kv_store_attention(self, kind: str) -> PagedAttention:
        """The attention of the last ``kind`` layer that computes K/V (:func:`kv_store_layers`), bound to its view of
        the runner's cache once the cache is allocated: what Gemma 4's assistant attends over."""
        layer = kv_store_layers(self.config)[kind]
        if isinstance(self.model.layers[layer], OtherStage):
            raise ValueError(f"Gemma 4's assistant attends over layer {layer}'s KV cache, which another pipeline "
                             f"stage holds (pipeline_parallel_size={self.pp.size}); serve it with "
                             "pipeline_parallel_size=1")
        return self.model.layers[layer].self_attn.attn

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One spec per layer of this stage: its own cache, or (a KV-shared layer) a :class:`SharedKVSpec` naming its
        source by its index among this stage's specs."""
        start = self.model.stage.start
        return [layer.self_attn.attn.kv_spec if self.model.sources[i] is None
                else SharedKVSpec(source=self.model.sources[i] - start) for i, layer in self.model.stage_layers()]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load HF-named checkpoint tensors (torch tensors or safetensors slices), keeping this rank's shard; a
        KV-shared layer's k/v projections and norms, which transformers does not use either, are skipped."""
        if any(getattr(m, "packed", None) is not None for m in self.modules()):
            raise ValueError("this model's linear weights are packed for CPU inference (load_model packs them); "
                             "load weights into a fresh model, or build it with load_model(..., pack=False)")
        params = dict(self.named_parameters(remove_duplicate=False))
        layers = self.model.layers
        loaded: set[str] = set()
        kv_scales: dict[int, dict[str, float]] = {}  # layer -> the checkpoint's K/V scales (an FP8 KV cache's)
        unused: list[str] = []  # checkpoint tensors with no place in the model
        for name, tensor in weights:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if (name == "model.embed_tokens.weight" and self.tie_word_embeddings and self.pp.is_last
                    and not self.shares_embedding):  # a later pipeline stage's head of its own
                loaded.add(load_param(params["lm_head.weight"], "lm_head.weight", tensor, None))
            if name.startswith(self.other_stage):
                continue  # another pipeline stage's
            if name.endswith(KV_SCALE_NAMES):
                kv_scales.setdefault(_layer_index(name), {})[name.rsplit(".", 1)[-1]] = float(materialize(tensor))
                continue
            found = _EXPERTS.match(name)
            if found:
                i, moe = found.group(1), layers[int(found.group(1))].moe
                if moe is None:
                    raise ValueError(f"checkpoint tensor {name} holds experts, but enable_moe_block is off in "
                                     "config.json: the checkpoint does not match its config")
                keys = moe.load_expert_tensor(f"model.layers.{i}.mlp.experts.{found.group(2)}", tensor)
                loaded.update(f"model.layers.{i}.moe.{key}" for key in keys)
                continue
            found = _SHARED_KV.match(name)
            if found and self.model.sources[int(found.group(1))] is not None:
                continue
            theirs = name
            for pattern, ours in _RENAMES:
                name = pattern.sub(ours, name)
            target, shard = _map_name(name, self.stacked)
            if target not in params and name in params:  # a KV-shared layer's q_proj stands alone
                target, shard = name, None
            param = params.get(target)
            if param is None:
                unused.append(theirs)
                continue
            loaded.add(load_param(param, target, tensor, shard))
        self._warn_unused(unused, {})
        self._check_gemma4_loaded(loaded, params)
        for i, layer in self.model.stage_layers():  # a shared layer reads its source's cache, so its scales
            scales = kv_scales.get(i if self.model.sources[i] is None else self.model.sources[i])
            if scales:
                both = scales.get("kv_scale", 1.0)
                layer.self_attn.attn.set_kv_scales(scales.get("k_scale", both), scales.get("v_scale", both))

    def _check_gemma4_loaded(self, loaded: set[str], params: dict[str, nn.Parameter]) -> None:
        expected = expected_keys(n for n in params if not (n == "lm_head.weight" and self.shares_embedding)
                                 and not n.endswith((".moe.w13", ".moe.w2")))
        for i, layer in self.model.stage_layers():
            if layer.moe is not None:
                expected.update(f"model.layers.{i}.moe.{key}" for key in layer.moe.expected_keys())
            if layer.self_attn.source is None and layer.self_attn.k_eq_v:  # no v projection
                expected -= {f"model.layers.{i}.self_attn.qkv_proj.{p}:v" for p in ("weight", "bias")}
        missing = checkpoint_names(expected - loaded, self.stacked)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}; is it a complete "
                             f"{self.config.model_type} checkpoint matching its config.json?")
