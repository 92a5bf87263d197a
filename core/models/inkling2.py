"""Inkling 2's text model (``Inkling2ForCausalLM``, ``model_type`` ``inkling2_text``; the text of
``Inkling2ForConditionalGeneration``, read through ``registry._TEXT_PARTS``), on the Llama plumbing
(:class:`~specray.models.llama.LlamaForCausalLM`: weights, the LM head, the interface) and the recurrent-state
machinery (:class:`~specray.models.gated_deltanet.RecurrentModel`: a conv history per request).

Each layer (``layer_types``: ``hybrid_sliding``, a window of ``sliding_window_size`` positions, or ``hybrid``,
global) is:

* a *block attention residual* in front of each block: the layer's input is not the residual stream but, per token,
  an attention of learned queries (``attention_input``: one, or three for a global layer, giving its q, k and v inputs;
  ``mlp_input``: one) over the stream's saved blocks and the current partial sum, each normed without weights (keys =
  values, float32). Every ``n_layers_per_attn_res_block``-th layer starts a new block: the stream entering it is saved
  and its partial sum restarts from the attention's output. ``final_input`` does the same after the last layer;
* attention with GQA (own head counts and head sizes per kind), no RoPE: q = clip(linear(x) * scale) (an L2 clip of
  each head to ``qk_l2_clip_threshold``; on global layers then times ``1 + alpha * log(max((pos + 1) / n_floor, 1))``),
  k = clip(conv(linear(x))), v = rmsnorm(conv(linear(x))) (no weight), where conv is a short causal depthwise conv with
  the current input added, ``(conv(x) + x) / sqrt(K + 1)``; on global layers its taps are static weights plus
  per-token ones projected from the layer's input (shared within a KV head), ``/ sqrt(2K + 1)``. Scores scaled by
  ``head_dim ** -0.5`` plus a relative position bias: each query's per-head states (``wr_du``, clipped like q) mix a
  learned bank of profiles over backward distance (``rel_logits_proj.proj`` [d_rel, extent]; zero at distances
  outside ``[0, extent)``; extent = the window on sliding layers, ``rel_extent`` on global ones); a sink logit per
  token and head (``attn_sink_proj``) joins each softmax; the output is gated by ``sigmoid(gate_attn(x))`` before
  ``wo_ud``;
* a short conv after the attention and after the MLP (``attn_sconv``, ``mlp_sconv``, the same residual form);
* a sparse MoE (sigmoid scores, the top k of score + correction bias, renormalised, times ``route_scale``) whose
  experts' SwiGLU is soft-capped: ``cap4(gate) * sigmoid(gate) * cap25(up)``, ``cap_c(x) = c * tanh(x / c)``.

The embedding is RMS-normed (``embed_norm``); the logits are soft-capped (``final_logit_softcapping``) and the LM
head has ``unpadded_vocab_size`` rows (the checkpoint's unembedding is padded to ``vocab_size``: the rows past are
dropped; the logits past them are the lowest float32, so that every engine part sized by ``vocab_size`` sees a
whole row).

Every conv is a :class:`~specray.models.gated_deltanet.RecurrentMixer` with no matrix, as LFM2's short conv is: its
history and pending drafts are kept per request, replayed after verification, and a token tree's rows read their own
paths (:meth:`Inkling2Conv._tree_conv`). The dynamic conv carries each token's projected taps as extra channels of
its input, so replayed drafts and tree rows find their own taps in their window. The relative bias is built per
layer from each step's key and query positions (a distance index cached per step, :meth:`AttentionMetadata.cached`)
and added to the scores (:func:`~specray.models.attention.explicit_attention`, which also takes the per-token sinks).

Checkpoint names are the release's (transformers saves them so): ``model.llm.*``, the unembedding
``model.llm.unembed``, the block queries under ``model.llm.attn_res.`` (renamed onto their layers here). The looped
release (``Inkling2LoopForCausalLM``, ``inkling2_loop_text``) is served only with ``loop_num_passes`` 1 (no loop):
its repeated passes over the middle layers, each with its own caches and message gates, are refused by name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.alibi import BIAS_ELEMENTS
from specray.models.attention import AttentionMetadata, PagedAttention, explicit_attention, own_key_positions
from specray.models.gated_deltanet import ConvOnlyMixer, RecurrentMixer, RecurrentModel, depthwise_conv, rank_rows
from specray.models.kv_cache import FullAttentionSpec, RecurrentStateSpec, SlidingWindowSpec
from specray.models.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, _copy, _param,
                                   divide, narrow, widen_to_vocab)
from specray.models.llama import LlamaForCausalLM, StageModel
from specray.models.moe import FAMILIES, MoEFamily, SparseMoE
from specray.parallel import PPGroup, TPGroup

KINDS = ("hybrid_sliding", "hybrid")
L2_EPS = 1e-6  # the clips divide by the norm + this
BLOCK_EPS = 1e-6  # the block attention residual's weightless norm

# sigmoid scores, the top k of score + correction bias, renormalised, times route_scale; gate/up interleaved by row
FAMILIES["inkling2_text"] = FAMILIES["inkling2_loop_text"] = MoEFamily(
    "scored", "n_routed_experts", "moe_intermediate_size", normalized=True, scoring="sigmoid", scaling="route_scale",
    interleaved=True)


class Norm(nn.Module):
    """RMSNorm in float32 with its weight applied in float32: returns float32 (the caller rounds), as transformers'
    norms over the float32 block residual do."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))


def weightless_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def l2_clip(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Each vector of the last dimension (float32) scaled down to L2 norm ``threshold`` where longer."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x * (threshold / (norm + L2_EPS)).clamp(max=1.0)


def log_scale(positions: torch.Tensor, alpha: float, floor: int) -> torch.Tensor:
    """[T] positions -> [T, 1, 1] float32: ``1 + alpha * log(max((pos + 1) / floor, 1))``."""
    return (1.0 + alpha * torch.log(((positions + 1).float() / floor).clamp(min=1.0)))[:, None, None]


class BlockAttentionResidual(nn.Module):
    """Per token, ``queries`` learned queries attending over the saved blocks and the partial sum (normed without
    weights; keys = values), float32 (module docstring)."""

    def __init__(self, hidden: int, queries: int):
        super().__init__()
        self.query = _param(hidden) if queries == 1 else _param(queries, hidden)

    def forward(self, blocks: Sequence[torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # blocks: each [T, H]; x: [T, H] -> per query [T, H] float32
        sources = weightless_norm(torch.stack([*blocks, x], dim=1), BLOCK_EPS)  # [T, n, H]
        h = sources.shape[-1]
        q = self.query.float().view(-1, h)  # [nq, H]
        weights = torch.softmax(torch.einsum("tnh,qh->tqn", sources, q) * h ** -0.5, dim=-1)  # [T, nq, n]
        return (weights @ sources).unbind(1)


class Inkling2Conv(ConvOnlyMixer):
    """A short causal depthwise conv over ``channels`` with the current input added, ``(conv(x) + x) / sqrt(K + 1)``
    in float32; a recurrent mixer with no matrix (as LFM2's short conv), so its history is kept per request, drafts
    replayed and tree rows read their own paths. ``tp``: whose rows of the
    checkpoint's conv this holds (a single group: all)."""

    conv_activation = False

    def __init__(self, channels: int, kernel: int, tp: TPGroup):
        super().__init__()
        self.width, self.kernel = channels, kernel
        self.conv1d = depthwise_conv(tp, channels, kernel, False)

    @property
    def conv_dim(self) -> int:
        return self.width

    @property
    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(conv_dim=self.conv_dim, conv_width=self.kernel - 1, num_heads=0, key_dim=1,
                                  value_dim=1)

    def forward(self, x: torch.Tensor, meta, extra: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, C] (extra: [T, more] channels carried beside it) -> [T, C] in x's dtype
        t = x.shape[0]
        mixed = x if extra is None else torch.cat((x, extra.to(x.dtype)), dim=-1)
        none = x.new_zeros(t, 0, dtype=torch.float32)
        return self.recurrence(mixed, none, none, meta).reshape(t, -1).to(x.dtype)

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        # window [B, K - 1 + L, C_in] -> [B, L, C]
        return self._taps(window.unfold(1, self.kernel, 1).transpose(-1, -2))

    def _tree_conv(self, rows: torch.Tensor) -> torch.Tensor:
        return self._taps(rows)

    def _taps(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [..., K, C_in] (oldest first, the token itself last) -> its outputs [..., C] float32."""
        x = windows.float()
        out = (x * self.conv1d.weight.float().t()).sum(-2)
        return (out + x[..., -1, :]) / math.sqrt(self.kernel + 1)


class Inkling2DynamicConv(Inkling2Conv):
    """The global layers' key / value conv: taps = ``static_weight`` [K, C] (row = backward distance) + each token's
    own, ``weight_proj(input)`` [heads * K] shared within each KV head; ``/ sqrt(2K + 1)``. Each token's taps ride as
    extra channels of its conv input (read from the token's own row of its window)."""

    def __init__(self, heads: int, head_dim: int, kernel: int, hidden: int, tp: TPGroup):
        nn.Module.__init__(self)
        self.heads, self.head_dim, self.kernel = heads, head_dim, kernel
        self.width = heads * head_dim
        self.static_weight = _param(kernel, self.width)  # this rank's channels of the checkpoint's [K, C]
        self.static_weight.weight_loader = lambda p, loaded: _copy(p, narrow(loaded, 1, tp.rank * self.width,
                                                                             self.width))
        self.weight_proj = ColumnParallelLinear(hidden, heads * tp.size * kernel, tp)

    @property
    def conv_dim(self) -> int:
        return self.width + self.heads * self.kernel

    def forward(self, x: torch.Tensor, meta, extra: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, meta, self.weight_proj(extra))

    def _taps(self, windows: torch.Tensor) -> torch.Tensor:
        k, c = self.kernel, self.width
        x = windows[..., :c].float()  # [..., K, C]
        own = windows[..., -1, c:].float().view(*windows.shape[:-2], self.heads, 1, k)  # [..., Hkv, 1, K] by distance
        taps = (self.static_weight.float().t().reshape(self.heads, self.head_dim, k) + own).flip(-1)  # oldest first
        taps = taps.reshape(*windows.shape[:-2], c, k).transpose(-1, -2)  # [..., K, C]
        return ((x * taps).sum(-2) + x[..., -1, :]) / math.sqrt(2 * k + 1)


def _scaled(shape: tuple[int, int], tp: TPGroup) -> nn.Module:
    """A module holding a per-head ``scale`` [heads, dim] (this rank's heads)."""
    module = nn.Module()
    module.scale = rank_rows(tp, *shape)
    return module


class BiasedAttention(PagedAttention):
    """:class:`PagedAttention` with a per-token relative position bias and per-token sink logits (module
    docstring), attended explicitly on both paths; ``extent``: the distances the bias reaches."""

    def __init__(self, num_heads: int, kv_spec: FullAttentionSpec, scale: float, extent: int):
        super().__init__(num_heads, kv_spec, scale)
        self.extent = extent

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                profiles: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]; profiles: [T, Hq, extent] (each query's bias by distance); sinks [T, Hq]
        self._store(k, v, meta.slot_mapping)
        profiles = F.pad(profiles, (0, 1))  # column `extent`: the zero bias of every distance outside [0, extent)
        return self._by_path(q, meta, lambda: self._short_biased(q, meta, profiles, sinks),
                             lambda i: self._own_biased(q, k, v, meta, i, profiles, sinks))

    def _index(self, distance: torch.Tensor) -> torch.Tensor:
        inside = (distance >= 0) & (distance < self.extent)
        return torch.where(inside, distance, torch.full_like(distance, self.extent))

    def _short_biased(self, q, meta, profiles, sinks) -> torch.Tensor:
        sb = meta.short
        bs, q_len = sb.num_seqs, sb.max_query_len
        if sb.token_index is not None:
            q, profiles, sinks = (x.index_select(0, sb.token_index) for x in (q, profiles, sinks))
        k = self._read(self._gather(self.k_cache, sb.block_index, bs), q.dtype, self.k_scale)  # [Bs, Hkv, L, D]
        v = self._read(self._gather(self.v_cache, sb.block_index, bs), q.dtype, self.v_scale)
        index = meta.cached(("inkling2-short", self.extent), lambda m: self._index(
            m.short.query_positions[:, :, None] - m.short_key_positions()[:, None, :]))  # [Bs, Q, L]
        heads = self.num_heads
        rows = profiles.view(bs, q_len, heads, -1).transpose(1, 2)  # [Bs, Hq, Q, extent + 1]
        bias = rows.gather(-1, index[:, None].expand(bs, heads, q_len, index.shape[-1])).float()
        mask = bias.masked_fill(~meta.short_mask(1, self.mask_kind), float("-inf"))  # [Bs, Hq, Q, L]
        sink = sinks.view(bs, q_len, heads).transpose(1, 2)[..., None]
        qs = q.view(bs, q_len, heads, -1).transpose(1, 2)
        o = explicit_attention(qs, k, v, mask, self.scale, sinks=sink)  # [Bs, Hq, Q, D]
        return o.transpose(1, 2).reshape(bs * q_len, -1)

    def _own_biased(self, q, k, v, meta, i, profiles, sinks) -> torch.Tensor:
        seq = meta.own[i]
        ks, vs = self.own_keys_values(k, v, meta, i, q.dtype)  # [1, Hkv, ctx, D]
        index = meta.cached(("inkling2-own", i, self.extent), lambda m: self._own_index(m, i))  # [q, ctx]
        allowed = meta.own_allowed(i, self.mask_kind)
        heads, ctx = self.num_heads, index.shape[-1]
        block = max(1, BIAS_ELEMENTS // (heads * ctx))
        out = []
        for a in range(0, seq.query_len, block):
            b = min(a + block, seq.query_len)
            part = slice(seq.token_start + a, seq.token_start + b)
            bias = profiles[part].transpose(0, 1).gather(-1, index[None, a:b].expand(heads, b - a, ctx)).float()
            mask = bias.masked_fill(~allowed[a:b], float("-inf"))[None]  # [1, Hq, r, ctx]
            o = explicit_attention(q[part].transpose(0, 1)[None], ks, vs, mask, self.scale,
                                   sinks=sinks[part].t()[None, :, :, None])
            out.append(o[0].transpose(0, 1).reshape(b - a, -1))
        return torch.cat(out)

    def _own_index(self, meta: AttentionMetadata, i: int) -> torch.Tensor:
        k_pos = own_key_positions(meta, i)
        return self._index(k_pos[meta.own[i].start_pos:, None] - k_pos[None, :])


def _geometry(config, sliding: bool) -> tuple[int, int, int]:
    if sliding:
        return config.swa_num_attention_heads, config.swa_num_key_value_heads, config.swa_head_dim
    return config.num_attention_heads, config.num_key_value_heads, config.head_dim


class Inkling2Attention(nn.Module):
    """One layer's attention over this rank's heads (module docstring), under the release's names."""

    def __init__(self, config, tp: TPGroup, sliding: bool):
        super().__init__()
        heads, kv_heads, d = _geometry(config, sliding)
        h = config.hidden_size
        what = "swa_" if sliding else ""
        self.heads = divide(heads, tp.size, f"{what}num_attention_heads")
        self.kv_heads = divide(kv_heads, tp.size, f"{what}num_key_value_heads")
        self.head_dim, self.sliding, self.d_rel = d, sliding, config.d_rel
        self.eps = config.rms_norm_eps
        self.qk_clip, self.rel_clip = float(config.qk_l2_clip_threshold), float(config.rel_l2_clip_threshold)
        self.alpha, self.floor = float(config.log_scaling_alpha), int(config.log_scaling_n_floor)
        kernel = config.conv_kernel_size
        self.wq_du = ColumnParallelLinear(h, heads * d, tp)
        self.wk_dv = ColumnParallelLinear(h, kv_heads * d, tp)
        self.wv_dv = ColumnParallelLinear(h, kv_heads * d, tp)
        if sliding:
            self.k_sconv = Inkling2Conv(self.kv_heads * d, kernel, tp)
            self.v_sconv = Inkling2Conv(self.kv_heads * d, kernel, tp)
        else:
            self.k_sconv = Inkling2DynamicConv(self.kv_heads, d, kernel, h, tp)
            self.v_sconv = Inkling2DynamicConv(self.kv_heads, d, kernel, h, tp)
        self.q_l2_clip = _scaled((self.heads, d), tp)
        self.rel_l2_clip = _scaled((self.heads, config.d_rel), tp)
        self.wr_du = ColumnParallelLinear(h, heads * config.d_rel, tp)
        extent = config.sliding_window_size if sliding else config.rel_extent
        self.rel_logits_proj = nn.Module()
        self.rel_logits_proj.proj = _param(config.d_rel, extent)
        self.attn_sink_proj = ColumnParallelLinear(h, heads, tp)
        self.gate_attn = ColumnParallelLinear(h, heads * d, tp)
        self.wo_ud = RowParallelLinear(heads * d, h, tp)
        kv = dict(num_kv_heads=self.kv_heads, head_dim=d, kv_head_start=tp.rank * self.kv_heads)
        spec = SlidingWindowSpec(**kv, sliding_window=config.sliding_window_size) if sliding else \
            FullAttentionSpec(**kv)
        self.attn = BiasedAttention(self.heads, spec, d ** -0.5, extent)

    def _states(self, x: torch.Tensor, scale: torch.Tensor, threshold: float, positions: torch.Tensor) -> torch.Tensor:
        """Per-head states [T, heads, d] (x: the linear's output): times ``scale``, clipped, and on a global layer
        scaled by position; rounded to x's dtype between, as transformers does."""
        states = l2_clip(x.view(x.shape[0], self.heads, -1).float() * scale.float(), threshold).to(x.dtype)
        if self.sliding:
            return states
        return (states.float() * log_scale(positions, self.alpha, self.floor)).to(x.dtype)

    def forward(self, hq: torch.Tensor, hk: torch.Tensor, hv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # hq, hk, hv: [T, H] (the normed inputs of q, k, v; a sliding layer's all one) -> [T, H]
        t, dtype = hq.shape[0], hq.dtype
        q = self._states(self.wq_du(hq), self.q_l2_clip.scale, self.qk_clip, meta.positions)
        k = self.k_sconv(self.wk_dv(hk), meta, None if self.sliding else hk)
        k = l2_clip(k.view(t, self.kv_heads, -1).float(), self.qk_clip).to(dtype)
        v = self.v_sconv(self.wv_dv(hv), meta, None if self.sliding else hv)
        v = weightless_norm(v.view(t, self.kv_heads, -1), self.eps).to(dtype)
        rel = self._states(self.wr_du(hq), self.rel_l2_clip.scale, self.rel_clip, meta.positions)
        profiles = rel @ self.rel_logits_proj.proj.to(dtype)  # [T, heads, extent]
        out = self.attn(q, k, v, meta, profiles, self.attn_sink_proj(hq))  # [T, heads * D]
        gate = torch.sigmoid(self.gate_attn(hq).float())
        return self.wo_ud((out.float() * gate).to(dtype))


class Inkling2MoE(SparseMoE):
    """The sparse block (its row of ``moe.FAMILIES``) with the soft-capped SwiGLU (module docstring)."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False):
        super().__init__(config, tp, expert_parallel)
        self.gate_cap, self.up_cap = float(config.mlp_gate_softcap), float(config.mlp_up_softcap)

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.float().chunk(2, dim=-1)
        capped = torch.tanh(gate / self.gate_cap) * self.gate_cap
        return (capped * torch.sigmoid(gate) * torch.tanh(up / self.up_cap) * self.up_cap).to(h.dtype)


class Inkling2Layer(nn.Module):
    """One decoder layer (module docstring), under the release's names."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__()
        kind = config.layer_types[layer]
        if kind not in KINDS:
            raise ValueError(f"layer_types[{layer}]={kind!r} is not supported for model_type={config.model_type!r}; "
                             f"one of {list(KINDS)}")
        self.sliding = kind == "hybrid_sliding"
        self.boundary = layer % config.n_layers_per_attn_res_block == 0
        h, eps, kernel = config.hidden_size, config.rms_norm_eps, config.conv_kernel_size
        self.attention_input = BlockAttentionResidual(h, 1 if self.sliding else 3) if layer > 0 else None
        self.mlp_input = BlockAttentionResidual(h, 1)
        if self.sliding:
            self.attn_norm = Norm(h, eps)
        else:
            self.q_input_norm, self.k_input_norm, self.v_input_norm = Norm(h, eps), Norm(h, eps), Norm(h, eps)
        self.attn = Inkling2Attention(config, tp, self.sliding)
        single = TPGroup.single()  # the convs on the residual stream: every rank holds all of its channels
        self.attn_sconv = Inkling2Conv(h, kernel, single)
        self.mlp_norm = Norm(h, eps)
        self.mlp = Inkling2MoE(config, tp, expert_parallel)
        self.mlp_sconv = Inkling2Conv(h, kernel, single)

    def forward(self, x: torch.Tensor, blocks: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H] (the stream entering the layer); blocks: the saved blocks, each [T, H] -> [T, H]
        dtype = x.dtype
        if self.sliding:
            a = x if self.attention_input is None else self.attention_input(blocks, x)[0]
            a = self.attn_norm(a).to(dtype)
            out = self.attn(a, a, a, meta)
        else:
            q, k, v = (x, x, x) if self.attention_input is None else self.attention_input(blocks, x)
            out = self.attn(self.q_input_norm(q).to(dtype), self.k_input_norm(k).to(dtype),
                            self.v_input_norm(v).to(dtype), meta)
        out = self.attn_sconv(out, meta).float()
        if self.boundary:  # a new block: the stream entering this layer is saved, the partial sum restarts
            residual, blocks = out, [*blocks, x]
        else:
            residual = x.float() + out
        m = self.mlp_norm(self.mlp_input(blocks, residual)[0]).to(dtype)
        return (residual + self.mlp_sconv(self.mlp(m), meta).float()).to(dtype)


class Inkling2Model(StageModel):
    """The decoder stack: the normed embedding, the layers with their saved blocks, the final block attention and
    norm (one pipeline stage)."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.build_stage(config, pp, lambda i: Inkling2Layer(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, h, tp), lambda: Norm(h, eps))
        self.embed_norm = Norm(h, eps)
        self.final_input = BlockAttentionResidual(h, 1)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return self.embed_norm(x).to(x.dtype)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # input_ids: [T] -> hidden [T, H], and the stream [T, H] entering each layer of aux_layers
        x = self.embed(input_ids)
        blocks: list[torch.Tensor] = []
        aux: dict[int, torch.Tensor] = {}
        for i, layer in self.stage_layers():
            if i in aux_layers:
                aux[i] = x
            out = layer(x, blocks, meta)
            if layer.boundary:
                blocks = [*blocks, x]
            x = out
        if len(self.layers) in aux_layers:
            aux[len(self.layers)] = x
        hidden = self.norm(self.final_input(blocks, x)[0]).to(x.dtype)
        return hidden, [aux[i] for i in aux_layers]


# the release's names (what transformers saves) -> ours, after ``model.llm.`` -> ``model.``
_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^model\.embed\.weight$", "model.embed_tokens.weight"),
    (r"^model\.unembed\.", "lm_head."),
    (r"\.(k_sconv|v_sconv|attn_sconv|mlp_sconv)\.weight$", r".\1.conv1d.weight"),
    (r"\.(k_sconv|v_sconv)\.static_w$", r".\1.static_weight"),
    (r"\.(k_sconv|v_sconv)\.weight_proj$", r".\1.weight_proj.weight"),
    (r"\.mlp\.gate\.bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.mlp\.experts\.w13_weight$", ".mlp.experts.gate_up_proj"),
    (r"\.mlp\.experts\.w2_weight$", ".mlp.experts.down_proj"),
    (r"^model\.attn_res\.mlp_queries\.(\d+)$", r"model.layers.\1.mlp_input.query"),
    (r"^model\.attn_res\.output_query$", "model.final_input.query")))
_ATTN_QUERY = re.compile(r"^model\.attn_res\.attn_queries\.(\d+)$")  # layer N + 1's
_LOOP_TENSORS = ("_message_gate.", "controllers.", "middle_cycle_cross_pass", "message_input.")


class Inkling2ForCausalLM(RecurrentModel, LlamaForCausalLM):
    """Inkling 2's text model for causal LM, sharded over ``tp`` (each kind's heads and the experts' width split over
    the ranks; the convs on the residual stream replicated)."""

    model_class = Inkling2Model
    one_stage = "its layers read every saved block of the residual stream"
    may_tie = False  # the embedding and the unembedding are separate tensors in every release
    lora_modules: tuple[str, ...] = ()  # (not wired: the release's projections are named its own way)

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        check_config(hf_config)
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.unpadded = self.head_rows(hf_config)
        self.cap = float(hf_config.final_logit_softcapping or 0.0)

    @classmethod
    def head_rows(cls, hf_config) -> int:
        return int(getattr(hf_config, "unpadded_vocab_size", None) or hf_config.vocab_size)

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        for field in ("num_attention_heads", "num_key_value_heads", "swa_num_attention_heads",
                      "swa_num_key_value_heads"):
            if getattr(config, field) % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not split this model's {field}="
                                 f"{getattr(config, field)}; choose a tensor_parallel_size that divides it")

    def _a_norm(self) -> torch.Tensor:
        return self.model.layers[self.model.stage.start].mlp_norm.weight

    def _attention_layers(self) -> list[nn.Module]:
        return [layer.attn for _, layer in self.model.stage_layers()]

    def _recurrent_mixers(self) -> list[RecurrentMixer]:
        return [m for _, layer in self.model.stage_layers() for m in layer.modules() if isinstance(m, RecurrentMixer)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> [N, vocab_size] float32: the capped logits, -inf past unpadded_vocab_size
        logits = self.lm_head(hidden).float()
        if self.cap:
            logits = torch.tanh(logits / self.cap) * self.cap
        return widen_to_vocab(logits, self.config.vocab_size)

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in weights:
            if name.startswith(("model.llm.", "lm_head.")) and name.endswith(("_scale", "_scale_inv", "_amax")):
                raise ValueError(f"checkpoint tensor {name}: quantized weights (the release's MXFP8 / NVFP4 experts) "
                                 "are not supported for Inkling 2; use a bf16 checkpoint")
            if any(piece in name for piece in _LOOP_TENSORS):
                continue  # the looped release's message gates: unused with loop_num_passes 1
            if not name.startswith("model.llm."):
                raise ValueError(f"checkpoint tensor {name}: Inkling 2's text model is read from the release's names "
                                 "(model.llm.*, as transformers saves them); this checkpoint names it otherwise")
            name = "model." + name[len("model.llm."):]
            found = _ATTN_QUERY.match(name)
            if found:
                name = f"model.layers.{int(found.group(1)) + 1}.attention_input.query"
            for pattern, ours in _RENAMES:
                name = pattern.sub(ours, name)
            if name == "lm_head.weight":  # padded to vocab_size: the first unpadded_vocab_size rows
                tensor = narrow(tensor, 0, 0, self.unpadded)
            yield name, tensor


def check_config(config) -> None:
    """Refuse, by field, what this module does not build."""
    kinds = list(config.layer_types)
    if len(kinds) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries for num_hidden_layers={config.num_hidden_layers}")
    if int(config.n_layers_per_attn_res_block) < 1:
        raise ValueError(f"n_layers_per_attn_res_block={config.n_layers_per_attn_res_block} must be at least 1")
    for field in ("mlp_gate_softcap", "mlp_up_softcap"):
        if not float(getattr(config, field)) > 0:
            raise ValueError(f"{field}={getattr(config, field)!r} is not supported: the experts' soft cap must be > 0")
    passes = getattr(config, "loop_num_passes", None)
    if passes is not None and int(passes) != 1:
        raise ValueError(f"loop_num_passes={passes} is not supported for {config.model_type!r}: the looped passes over "
                         f"layers {config.loop_layer_index_start}..{config.loop_layer_index_end - 1} (each pass with "
                         "its own caches and message gates) are not implemented; only loop_num_passes=1 (no loop) is "
                         "served")


class Inkling2LoopForCausalLM(Inkling2ForCausalLM):
    """The looped release's text model, served only without its loop (``loop_num_passes`` 1; see module docstring)."""
