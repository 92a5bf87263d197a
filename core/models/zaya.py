"""Zyphra's ZAYA (``ZayaForCausalLM``: ZAYA1-8B), a mixture-of-experts decoder whose attention takes its queries and
keys through a short convolution over the sequence (Compressed Convolutional Attention, CCA), on the Llama plumbing
(:mod:`specray.models.llama`) and the recurrent-state machinery of the hybrid families
(:mod:`specray.models.gated_deltanet`).

Each layer, with the residual stream kept in float32 (it starts as ``(embedding + input_hidden_states_bias) *
input_hidden_states_scale``):

* attention on the RMS-normed stream. ``q_proj`` and ``k_proj`` give q [Hq, D] and k [Hkv, D] per token; the queries
  and keys attended are ``conv(q | k) + residual``: a causal depthwise conv of width ``cca_time0`` over the q | k
  channels, then a causal conv of width ``cca_time1`` mixing the D channels of each head (one group per q or k head),
  both with biases, over zeros before the first token; the residual of query head h in KV group g is
  ``(q_h + k_g) / 2``, that of key g the mean of its group's query residuals. The values are the concatenation of
  ``v_proj_current`` of the token and ``v_proj_delayed`` of the token before it (its bias alone before the first
  token), the two halves of every KV head's value rows laid end to end. q and k are then scaled to length sqrt(D)
  per head, each key head times its learned ``temp``, rotated by partial RoPE (``rope_parameters`` per layer kind:
  ``hybrid``, ``hybrid_sliding`` over the last ``sliding_window`` positions) and attended with scale D^-1/2;
* the attention's output joins the stream as ``(out + b) * s + (stream + b') * s'`` (``post_attention_residual_scale``),
  and likewise the experts' (``post_mlp_residual_scale``);
* a mixture of SwiGLU experts, one expert per token, chosen by a router of its own: ``down_proj`` to
  ``router_hidden_size``, plus (after the first layer) the previous layer's router state times
  ``router_states_scale`` (that sum is this layer's router state, handed to the next layer: a per-token stream across
  layers), then an RMSNorm, two GELU layers and ``out_proj`` to ``num_experts + 1`` logits; the top one of
  softmax + ``balancing_biases`` is chosen and weighted by its softmax. The last class is a skip expert: a token that
  chooses it gets nothing from the experts.

The conv's state (the last ``(cca_time0 - 1) + (cca_time1 - 1)`` q | k inputs) and the delayed value projection (the
previous token's) are a per-request recurrent state: :class:`CCAProjection` is a
:class:`~specray.models.gated_deltanet.RecurrentMixer` with no matrix, as LFM2's short conv is
(:class:`~specray.models.lfm2.ShortConv`), whose conv inputs are q | k | the delayed value rows (the latter without
their bias, so the zeros before a sequence give the bias alone), so drafts are replayed, token trees verified (each
row's conv over its own path) and graph steps taken as there. The paged K/V cache holds the keys and values attended.

Tensor parallel: q and KV heads split over the ranks (whole groups each: the key residual averages a group's query
heads, so KV heads are never replicated), the convs with their heads, the values as the rows of this rank's KV heads
(which may be current, delayed or both), the experts by width (or whole, expert parallel); the router is replicated.
Refused by name: pipeline stages (the router state crosses every layer), more than one expert per token, layer kinds
other than ``hybrid`` / ``hybrid_sliding``, a sliding layer without ``sliding_window``, LoRA."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.gated_deltanet import ConvOnlyMixer, RecurrentModel, rank_rows
from specray.models.kv_cache import FullAttentionSpec, RecurrentStateSpec, SlidingWindowSpec
from specray.models.layers import (ColumnParallelLinear, QKVParallelLinear, RMSNorm, RotaryEmbedding,
                                   RowParallelLinear, VocabParallelEmbedding, _copy, _param, apply_rotary, divide,
                                   materialize, max_positions, narrow, rope_parameters, rotary_dim)
from specray.models.llama import _CHECKPOINT_NAMES, LlamaForCausalLM, LlamaModel
from specray.models.moe import FAMILIES, MoEFamily, SparseMoE
from specray.parallel import PPGroup, TPGroup

KINDS = ("hybrid", "hybrid_sliding")
# the experts' storage and dispatch (their router is ZayaRouter)
FAMILIES["zaya"] = MoEFamily("softmax", "num_experts", "moe_intermediate_size")
# the release's q/k projections and convs under ``self_attn.qkv_proj.`` are the recurrent mixer's, ``cca.``
_CHECKPOINT_NAMES["zaya"] = ((re.compile(r"\.self_attn\.qkv_proj\."), ".cca."),)
# the value's two halves, stacked into one v part of the q/k/v projection as they load (ZayaForCausalLM._unfused)
_V_HALVES = re.compile(r"\.self_attn\.qkv_proj\.v_proj_(current|delayed)\.(weight|bias)$")


def conv_history(config) -> int:
    """The inputs before a token its q/k/v read: the two convs' (``cca_time0 - 1 + cca_time1 - 1``), and at least the
    one token the delayed values come from."""
    return max(config.cca_time0 - 1 + config.cca_time1 - 1, 1)


def check_config(config) -> None:
    """What this module does not build, refused by field."""
    kinds = list(config.layer_types)
    if len(kinds) != config.num_hidden_layers or any(kind not in KINDS for kind in kinds):
        raise ValueError(f"layer_types={kinds} is not supported for model_type='zaya': give num_hidden_layers="
                         f"{config.num_hidden_layers} kinds, each one of {list(KINDS)}")
    if "hybrid_sliding" in kinds and not config.sliding_window:
        raise ValueError(f"sliding_window={config.sliding_window!r}: layer_types has 'hybrid_sliding' layers, which "
                         "need a window; set sliding_window")
    if config.num_experts_per_tok != 1:
        raise ValueError(f"num_experts_per_tok={config.num_experts_per_tok} is not supported for model_type='zaya' "
                         "(its router picks one expert per token, as transformers requires); use 1")
    if config.num_attention_heads % config.num_key_value_heads or (config.num_key_value_heads
                                                                    * config.head_dim) % 2:
        raise ValueError(f"num_attention_heads={config.num_attention_heads}, num_key_value_heads="
                         f"{config.num_key_value_heads}, head_dim={config.head_dim}: the query heads must form whole "
                         "KV groups and the value rows split in two halves")
    if min(config.cca_time0, config.cca_time1) < 1:
        raise ValueError(f"cca_time0={config.cca_time0}, cca_time1={config.cca_time1}: conv widths must be >= 1")


def check_kv_split(config, tp: int) -> None:
    """``tp`` ranks split the KV heads: each key's residual averages its whole group of query heads, so a rank holds
    whole groups (QKVParallelLinear's replicated KV heads would leave a group's query heads on other ranks)."""
    if config.num_key_value_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not split this model's num_key_value_heads="
                         f"{config.num_key_value_heads} (each key's residual averages its whole group of query heads, "
                         "so KV heads are not replicated); choose one that divides it")


class CCAProjection(ConvOnlyMixer):
    """ZAYA's q/k/v projection (module docstring) over this rank's heads: ``qkv_proj`` (q, k and the value rows of
    this rank's KV heads, the checkpoint's ``v_proj_current`` then ``v_proj_delayed`` stacked as one v), the two
    convs, and the conv state of a recurrent mixer with no matrix."""

    conv_activation = False
    delay = 1  # the delayed values' rows come from the token this many before

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        check_kv_split(config, tp.size)
        d = self.head_dim = config.head_dim
        bias = bool(config.attention_bias)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, tp, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.qk_size = self.q_size + self.kv_size
        # this rank's value rows are rows [start, start + kv_size) of current | delayed: the delayed ones come last
        start, half = self.qkv_proj.kv_head_start * d, config.num_key_value_heads * d // 2
        self.delayed = max(0, start + self.kv_size - max(start, half))
        self.width = conv_history(config)
        self.kernel = self.width + 1
        self.tp, self.total_q = tp, config.num_attention_heads * d
        self.conv_qk_depthwise = nn.Module()  # the checkpoint's [C, 1, t0] as this rank's [C_local, t0]
        self.conv_qk_depthwise.weight = self._conv_param(config.cca_time0)
        self.conv_qk_depthwise.bias = self._conv_param()
        self.conv_qk_grouped = nn.Module()  # [C, D, t1]: each head's D channels mixed (one group per head)
        self.conv_qk_grouped.weight = self._conv_param(d, config.cca_time1)
        self.conv_qk_grouped.bias = self._conv_param()

    def _conv_param(self, *rest: int) -> nn.Parameter:
        """A conv parameter over this rank's q | k channels, loading the rows of its q heads and of its KV heads."""
        param = _param(self.qk_size, *rest)

        def load(p: nn.Parameter, loaded: Any) -> None:
            q = narrow(loaded, 0, self.tp.rank * self.q_size, self.q_size)
            k = narrow(loaded, 0, self.total_q + self.qkv_proj.kv_head_start * self.head_dim, self.kv_size)
            _copy(p, torch.cat((q, k)).reshape(p.shape))

        param.weight_loader = load
        return param

    @property
    def state_spec(self) -> RecurrentStateSpec:
        # the q | k | delayed value inputs of the last `width` tokens; no matrix (no heads) and no gates
        return RecurrentStateSpec(conv_dim=self.qk_size + self.delayed, conv_width=self.width, num_heads=0,
                                  key_dim=1, value_dim=1)

    def _delayed_bias(self) -> torch.Tensor | None:
        bias = self.qkv_proj.bias
        return None if bias is None or not self.delayed else bias[bias.shape[0] - self.delayed:]

    def forward(self, x: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: [T, H] -> q [T, Hq, D], k and v [T, Hkv, D] (meta.recurrent: see RecurrentMixer.recurrence)
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        current, delayed = v.split([self.kv_size - self.delayed, self.delayed], dim=-1)
        bias = self._delayed_bias()
        if bias is not None:  # kept without its bias: the zeros before a sequence then give the bias alone
            delayed = delayed - bias
        none = x.new_zeros(t, 0, dtype=torch.float32)  # no decay, no strength: nothing but the conv
        mixed = self.recurrence(torch.cat((q, k, delayed), dim=-1), none, none, meta).reshape(t, -1).to(x.dtype)
        conv_q, conv_k, before = mixed.split([self.q_size, self.kv_size, self.delayed], dim=-1)
        if bias is not None:
            before = before + bias
        q_residual, k_residual = self._residuals(q, k)
        queries = conv_q.view(t, self.num_heads, d) + q_residual
        keys = conv_k.view(t, self.num_kv_heads, d) + k_residual
        return queries, keys, torch.cat((current, before), dim=-1).view(t, self.num_kv_heads, d)

    def _residuals(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq * D], k [T, Hkv * D] as projected -> what the convs' outputs are added to: each query head with
        its group's key, halved [T, Hq, D]; each key the mean of its group's [T, Hkv, D]."""
        t, d, group = q.shape[0], self.head_dim, self.num_heads // self.num_kv_heads
        residual = (q.view(t, self.num_kv_heads, group, d) + k.view(t, self.num_kv_heads, 1, d)) * 0.5
        return residual.view(t, self.num_heads, d), residual.mean(dim=2)

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        """window [B, W + L, C] (W = ``width`` inputs before the first output's token) -> [B, L, C]: the two convs
        over the q | k channels, and each token's previous delayed value row (no bias)."""
        length = window.shape[1] - self.width
        dw, grouped = self.conv_qk_depthwise, self.conv_qk_grouped
        qk = window[..., : self.qk_size].transpose(1, 2).to(dw.weight.dtype)  # [B, C, W + L]
        y = F.conv1d(qk, dw.weight[:, None, :], dw.bias, groups=self.qk_size)
        y = F.conv1d(y, grouped.weight, grouped.bias, groups=self.num_heads + self.num_kv_heads)
        y = y[..., y.shape[-1] - length:].transpose(1, 2).to(window.dtype)  # the last L outputs
        before = window[:, self.width - self.delay: self.width - self.delay + length, self.qk_size:]
        return torch.cat((y, before), dim=-1)

    def _tree_conv(self, rows: torch.Tensor) -> torch.Tensor:
        return self._conv(rows)[:, 0]  # each row's window a sequence of one output


class ZayaAttention(nn.Module):
    """Paged attention over the CCA projection's q, k, v (this rank's heads): q and k scaled to length sqrt(D) per
    head, k times its head's ``qk_norm.temp``, partial RoPE, ``o_proj``."""

    def __init__(self, config, tp: TPGroup, layer: int, cca: CCAProjection):
        super().__init__()
        d = self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = cca.num_heads, cca.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, tp,
                                        bias=bool(config.attention_bias))
        self.qk_norm = nn.Module()
        self.qk_norm.temp = rank_rows(tp, self.num_kv_heads)  # [Hkv]: this rank's heads of the checkpoint's
        self.root = math.sqrt(d)
        heads = dict(num_kv_heads=self.num_kv_heads, head_dim=d, kv_head_start=cca.qkv_proj.kv_head_start)
        spec = (SlidingWindowSpec(**heads, sliding_window=config.sliding_window)
                if config.layer_types[layer] == "hybrid_sliding" else FullAttentionSpec(**heads))
        self.attn = PagedAttention(self.num_heads, spec, d ** -0.5)

    def _unit(self, x: torch.Tensor) -> torch.Tensor:
        """Each head [..., D] scaled to length sqrt(D)."""
        return x * (self.root / x.norm(p=2, dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).eps))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q [T, Hq, D], k and v [T, Hkv, D]; cos, sin [T, 1, R/2] -> [T, H]
        k = self._unit(k) * self.qk_norm.temp[None, :, None].to(k.dtype)
        qk = apply_rotary(torch.cat((self._unit(q), k), dim=1), cos, sin)
        return self.o_proj(self.attn(qk[:, : self.num_heads], qk[:, self.num_heads:], v, meta))


class ResidualScaling(nn.Module):
    """A block's output joining the (float32) stream: ``(x + hidden_states_bias) * hidden_states_scale + (stream +
    residual_bias) * residual_scale``."""

    def __init__(self, size: int):
        super().__init__()
        self.hidden_states_scale, self.hidden_states_bias = _param(size), _param(size)
        self.residual_scale, self.residual_bias = _param(size), _param(size)

    def forward(self, x: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        return ((x + self.hidden_states_bias) * self.hidden_states_scale
                + (stream + self.residual_bias) * self.residual_scale)


def _replicated(in_features: int, out_features: int, bias: bool) -> ColumnParallelLinear:
    return ColumnParallelLinear(in_features, out_features, TPGroup.single(), bias=bias)


class ZayaRouter(nn.Module):
    """ZAYA's router (module docstring), replicated on every rank: -> (weights [T, 1], ids [T, 1], router state [T,
    R]); a token choosing the skip expert gets weight 0 on expert 0."""

    def __init__(self, config, layer: int):
        super().__init__()
        h, r = config.hidden_size, config.router_hidden_size
        self.num_experts = config.num_experts
        self.down_proj = _replicated(h, r, bias=True)
        # the previous layer's router state's weight (the first layer has none)
        self.router_states_scale = _param(r) if layer else None
        self.router_mlp = nn.Module()
        self.router_mlp.norm = RMSNorm(r, config.rms_norm_eps)
        self.router_mlp.fc1 = _replicated(r, r, bias=True)
        self.router_mlp.fc2 = _replicated(r, r, bias=True)
        self.router_mlp.out_proj = _replicated(r, self.num_experts + 1, bias=False)  # the routed experts, then skip
        # added to the probabilities for the choice alone; a checkpoint without them keeps transformers' initial
        # ones (0, and -1 for the skip class)
        self.balancing_biases = _param(self.num_experts + 1)
        with torch.no_grad():
            self.balancing_biases.zero_()[-1] = -1.0

    def forward(self, x: torch.Tensor, previous: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        state = self.down_proj(x)  # [T, R]
        if self.router_states_scale is not None and previous is not None:
            state = state + previous * self.router_states_scale
        mlp = self.router_mlp
        logits = mlp.out_proj(F.gelu(mlp.fc2(F.gelu(mlp.fc1(mlp.norm(state))))))  # [T, E + 1]
        return *self._choose(torch.softmax(logits, dim=-1)), state

    def _choose(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """probs [T, E + 1] -> (weights, ids) [T, 1]: the top class of probs + balancing biases, its probability
        its weight; the skip class as weight 0 on expert 0."""
        ids = (probs.float() + self.balancing_biases.float()).topk(1, dim=-1).indices
        skip = ids == self.num_experts
        return probs.gather(1, ids).masked_fill(skip, 0.0), ids.masked_fill(skip, 0)


class ZayaMoE(SparseMoE):
    """ZAYA's experts on :class:`~specray.models.moe.SparseMoE` (the fused ``gate_up_proj`` [E, 2I, H] and
    ``down_proj`` [E, H, I], split over ranks, both dispatch paths) with :class:`ZayaRouter` as ``gate``."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool, layer: int):
        super().__init__(config, tp, expert_parallel)  # moe.py's zaya row
        del self.gate  # (the plain router SparseMoE builds)
        self.gate = ZayaRouter(config, layer)

    def forward(self, x: torch.Tensor, previous: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # x [T, H], previous: the last layer's router state [T, R] or None -> ([T, H], this layer's router state)
        weights, ids, state = self.gate(x, previous)
        return self.tp.all_reduce(self.experts_of(x, weights, ids)), state


class ZayaLayer(nn.Module):
    """One decoder layer (module docstring); ``cca`` is its recurrent mixer, ``self_attn`` its paged attention."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__()
        self.layer_type = config.layer_types[layer]
        self.cca = CCAProjection(config, tp)
        self.self_attn = ZayaAttention(config, tp, layer, self.cca)
        self.mlp = ZayaMoE(config, tp, expert_parallel, layer)
        self.input_layernorm = self.build_norm(config)
        self.post_attention_layernorm = self.build_norm(config)
        self.post_attention_residual_scale = ResidualScaling(config.hidden_size)
        self.post_mlp_residual_scale = ResidualScaling(config.hidden_size)

    @staticmethod
    def build_norm(config) -> nn.Module:
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, stream: torch.Tensor, router: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # stream [T, H] float32, router: the last layer's router state -> (stream, router state)
        dtype = self.input_layernorm.weight.dtype
        x = self.self_attn(*self.cca(self.input_layernorm(stream.to(dtype)), meta), cos, sin, meta)
        stream = self.post_attention_residual_scale(x, stream)
        x, router = self.mlp(self.post_attention_layernorm(stream.to(dtype)), router)
        return self.post_mlp_residual_scale(x, stream), router


class ZayaModel(LlamaModel):
    layer_class = ZayaLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)
        self.layer_types = list(config.layer_types)
        self.rotary = nn.ModuleDict()
        for kind in sorted(set(self.layer_types)):
            rope = rope_parameters(config, kind, partial=True)
            self.rotary[kind] = RotaryEmbedding(rotary_dim(config.head_dim, rope), rope, max_positions(config))
        self.build_stage(config, pp, lambda i: ZayaLayer(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: self.final_norm(config))
        self.input_hidden_states_scale = _param(config.hidden_size)
        self.input_hidden_states_bias = _param(config.hidden_size)

    def rope_tables(self, meta: AttentionMetadata, dtype: torch.dtype) -> Callable[[int], tuple]:
        """Layer index -> the (cos, sin) of its kind's table."""
        tables = {}
        for kind, rotary in self.rotary.items():
            rotary.ensure(meta.max_position + 1)
            tables[kind] = rotary(meta.positions, dtype)
        return lambda layer: tables[self.layer_types[layer]]

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # input_ids: [T] -> hidden [T, H], and the stream [T, H] entering each layer of aux_layers (one stage only)
        assert intermediate is None, "ZAYA runs as one pipeline stage (one_stage)"
        x = self.embed(input_ids)
        stream = ((x + self.input_hidden_states_bias) * self.input_hidden_states_scale).float()
        rope = self.rope_tables(meta, x.dtype)
        aux: dict[int, torch.Tensor] = {}
        router = None
        for i, layer in self.stage_layers():
            if i in aux_layers:
                aux[i] = stream.to(x.dtype)
            stream, router = layer(stream, router, *rope(i), meta)
        if len(self.layers) in aux_layers:
            aux[len(self.layers)] = stream.to(x.dtype)
        return self.norm(stream.to(x.dtype)), [aux[i] for i in aux_layers]


class ZayaForCausalLM(RecurrentModel, LlamaForCausalLM):
    """ZAYA for causal LM, sharded over ``tp`` (module docstring)."""

    model_class = ZayaModel
    one_stage = "its router state passes from every layer to the next"
    # the q/k/v parts of each CCA projection (the value's halves stacked first: _unfused)
    stacked = {".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v")}
    lora_modules: tuple[str, ...] = ()  # not yet (the value's two projections are one stacked part here)

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        check_config(hf_config)
        if pp is not None and pp.size > 1:
            raise ValueError(f"pipeline_parallel_size={pp.size} is not supported for model_type='zaya' (its router "
                             "state passes from every layer to the next); use 1")
        super().__init__(hf_config, tp, expert_parallel, pp)

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        check_kv_split(config, tp)
        divide(config.num_attention_heads, tp, "num_attention_heads")

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """Each layer's ``v_proj_current`` and ``v_proj_delayed`` (weight or bias) stacked, in that order, as one
        ``v_proj`` (the value rows of all KV heads), once both have come."""
        held: dict[str, dict[str, Any]] = {}
        for name, tensor in super()._unfused(weights):
            found = _V_HALVES.search(name)
            if found is None:
                yield name, tensor
                continue
            stacked = f"{name[: found.start()]}.self_attn.qkv_proj.v_proj.{found.group(2)}"
            halves = held.setdefault(stacked, {})
            halves[found.group(1)] = tensor
            if len(halves) == 2:
                del held[stacked]
                yield stacked, torch.cat((materialize(halves["current"]), materialize(halves["delayed"])))
        if held:
            raise ValueError(f"checkpoint has {sorted(held)[:3]} with only one of v_proj_current and v_proj_delayed; "
                             "is it a complete zaya checkpoint?")

    def _check_loaded(self, loaded: set[str], params: dict[str, nn.Parameter]) -> None:
        # the routers' balancing biases may be absent (ZayaRouter: transformers' initial ones then)
        super()._check_loaded(loaded | {name for name in params if name.endswith(".balancing_biases")}, params)
