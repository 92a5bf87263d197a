"""Inkling's text model (Thinking Machines: ``InklingForCausalLM``, model type ``inkling_text``; the text of the
multimodal ``InklingForConditionalGeneration``, whose vision and audio towers are not read) on the Llama plumbing
(:mod:`specray.models.llama`). Every layer is pre-norm attention then an MLP, with no RoPE; what is its own:

* **short convolutions with a residual**: four per layer, ``y = x + causal_conv(x)`` (depthwise, width
  ``conv_kernel_size``, no bias, no activation, in float32 and cast back): on each layer's keys and values as projected
  (before the key norm and the cache), on the attention block's output and on the MLP block's output, each before it
  joins the residual stream. Each is LFM2's :class:`~specray.models.lfm2.ShortConv` machinery (a
  :class:`~specray.models.gated_deltanet.RecurrentMixer` with no matrix): the conv's last K - 1 inputs per request in
  the recurrent state, drafts kept pending and replayed, token trees verified along each node's own path, graph steps
  in the fixed-shape form; so the model is a :class:`~specray.models.gated_deltanet.RecurrentModel` of four mixers a
  layer beside its paged attention;
* **relative logits** instead of positions: each query token projects ``r_proj(x)`` to ``d_rel`` values per head,
  which mix a learned bank of bias-vs-distance profiles (``rel_logits_proj.proj`` [d_rel, E]) into one bias per head
  and backward distance d = pos_q - pos_k, added to the score where 0 <= d < E (E: ``rel_extent``; a sliding layer's
  window), zero beyond. The bias depends on the query's hidden state, so each layer builds its own additive mask
  per step (:class:`RelativeAttention`, ALiBi's way of carrying a bias through SDPA, :mod:`specray.models.alibi`);
  distances are taken between positions, so a tree's nodes see their ancestors at their path's distances;
* q and k RMS-normed per head, scores scaled by ``1 / head_dim``; sliding layers (``layer_types`` "hybrid_sliding")
  with their own heads (``swa_*``) and window (``sliding_window_size``); with ``log_scaling_n_floor``, a full layer's
  queries and biases times ``1 + log_scaling_alpha * log(max((pos + 1) / n_floor, 1))``;
* the embedding RMS-normed (``embed_tokens.embed_norm``), the final hidden states divided by
  ``logits_mup_width_multiplier`` before the LM head (never tied), and the logits past ``unpadded_vocab_size`` (a head
  padded to ``vocab_size``) set to -inf, so they are never sampled and the softmax is over the real vocabulary;
* experts (``mlp_layer_types`` "sparse", else a dense SwiGLU times a learned ``global_scale``): the router scores the
  routed and the ``n_shared_experts`` shared experts (its weight's last rows) with sigmoids; the top k of routed score +
  ``e_score_correction_bias`` are chosen; the chosen and the shared ones' sigmoids renormalised together (the shared
  experts are a sink in that softmax of log-sigmoids), times ``route_scale`` and the router's ``global_scale``; each
  shared expert's output times its own weight. The routed experts are :class:`~specray.models.moe.SparseMoE`'s
  (``inkling_text`` row), the shared ones split by width over the ranks as a dense MLP is.

Checkpoints: transformers' module names (``InklingForCausalLM``'s save), or the release's own (what transformers'
``InklingForConditionalGeneration`` saves: ``model.llm.``, ``attn.wq_du``, ..., gate and up rows interleaved in
``w13`` tensors), renamed and de-interleaved as they load (:meth:`InklingForCausalLM._unfused`). The MTP layers
(``model.mtp.``) are not read: transformers does not run them either. LoRA adapts the attention's q/k/v/o. Refused
by name: a quantized checkpoint, ``shared_expert_sink`` false, no shared experts, another activation than silu,
unknown ``layer_types`` / ``mlp_layer_types``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.alibi import BIAS_ELEMENTS
from specray.models.attention import AttentionMetadata, PagedAttention, own_key_positions
from specray.models.gated_deltanet import RecurrentMixer, RecurrentModel
from specray.models.kv_cache import FullAttentionSpec, SlidingWindowSpec
from specray.models.layers import (ColumnParallelLinear, QKVParallelLinear, RMSNorm, RowParallelLinear,
                                   VocabParallelEmbedding, _copy, _param, divide, materialize, narrow, widen_to_vocab)
from specray.models.lfm2 import ShortConv
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel, norm_stream
from specray.models.moe import FAMILIES, MoEFamily, SparseMoE
from specray.parallel import PPGroup, TPGroup

SLIDING, FULL = "hybrid_sliding", "hybrid"

# the routed experts: sigmoid scores, the top k of score + correction bias (their weights: InklingMoE.route)
FAMILIES["inkling_text"] = MoEFamily("scored", "n_routed_experts", "moe_intermediate_size", scoring="sigmoid",
                                     scaling="route_scale")


def _fp32_param(*shape: int) -> nn.Parameter:
    """A parameter kept in float32 whatever the model's dtype (transformers keeps these so: the convs, the router's
    correction bias and scale)."""
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


class InklingShortConv(ShortConv):
    """``x + causal_conv(x)`` over ``channels`` channels (this rank's: the checkpoint's rows from ``start``), in
    float32 and cast back to x's dtype; the conv history per request is :class:`~specray.models.lfm2.ShortConv`'s
    (its state spec, its rules: the conv's output as it is). The conv's inputs are the model's dtype's values, so the
    history kept in that dtype holds them exactly."""

    def __init__(self, channels: int, kernel: int, start: int = 0):
        RecurrentMixer.__init__(self)  # (not ShortConv's: no gate, no projections)
        self.width, self.kernel = channels, kernel
        self.conv1d = nn.Module()  # the checkpoint's conv1d.weight [C, 1, K], as [C, K]
        self.conv1d.weight = _fp32_param(channels, kernel)
        self.conv1d.weight.weight_loader = lambda p, loaded: _copy(p, materialize(
            narrow(loaded, 0, start, channels)).reshape(p.shape))
        self.conv1d.bias = None

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        # x: [T, C] -> [T, C] (meta.recurrent: the step's RecurrentBatch, see RecurrentMixer.recurrence)
        t = x.shape[0]
        xf = x.float()
        none = xf.new_zeros(t, 0)  # no decay, no strength: the conv alone
        return (self.recurrence(xf, none, none, meta).reshape(t, -1).float() + xf).to(x.dtype)


class RelativeAttention(PagedAttention):
    """:class:`PagedAttention` whose scores get each query's relative logits (module docstring): ``forward`` takes
    ``table`` [T, Hq, E], each query token's bias per head at backward distances 0..E-1, and attends with an additive
    mask built from it per path (the short batch's over its folded rows, an own sequence's by blocks of rows so that
    a long chunk's bias stays within :data:`~specray.models.alibi.BIAS_ELEMENTS` values)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]; table: [T, Hq, E] -> [T, Hq*D]
        self._store(k, v, meta.slot_mapping)
        return self._by_path(q, meta, lambda: self._short_relative(q, table, meta),
                             lambda i: self._own_relative(q, k, v, table, meta, i))

    def _bias(self, table: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
        """table [..., Hq, Q, E], distance [..., Q, L] (long) -> the bias [..., Hq, Q, L] in float32: the table at
        each distance, 0 outside [0, E)."""
        extent = table.shape[-1]
        inside = (distance >= 0) & (distance < extent)
        index = distance.clamp(0, extent - 1).unsqueeze(-3).expand(*table.shape[:-1], distance.shape[-1])
        return table.float().gather(-1, index).masked_fill(~inside.unsqueeze(-3), 0.0)

    def _short_relative(self, q: torch.Tensor, table: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        sb = meta.short
        bs, q_len = sb.num_seqs, sb.max_query_len
        if sb.token_index is not None:
            q, table = q.index_select(0, sb.token_index), table.index_select(0, sb.token_index)
        k = self._read(self._gather(self.k_cache, sb.block_index, bs), q.dtype, self.k_scale)  # [Bs, Hkv, L, D]
        v = self._read(self._gather(self.v_cache, sb.block_index, bs), q.dtype, self.v_scale)
        distance = sb.query_positions[:, :, None] - meta.short_key_positions()[:, None, :]  # [Bs, Q, L]
        rows = table.view(bs, q_len, self.num_heads, -1).transpose(1, 2)  # [Bs, Hq, Q, E]
        bias = self._bias(rows, distance).view(bs, self.num_kv_heads, self.groups * q_len, -1)  # folded rows
        bias = bias.masked_fill(~meta.short_mask(self.groups, self.mask_kind), float("-inf")).to(q.dtype)
        return self._unfold(self._attend(self._fold(q, bs, q_len), k, v, bias), bs, q_len)

    def _own_relative(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                      meta: AttentionMetadata, i: int) -> torch.Tensor:
        seq = meta.own[i]
        ks, vs = self.own_keys_values(k, v, meta, i, q.dtype)  # [1, Hkv, ctx, D]
        k_pos = own_key_positions(meta, i)  # [ctx]
        block = max(1, BIAS_ELEMENTS // (self.num_heads * seq.context_len))
        out = []
        for a in range(0, seq.query_len, block):
            b = min(a + block, seq.query_len)
            keys = seq.start_pos + b  # later keys are later tokens (a tree lists parents first): no row here sees them
            distance = k_pos[seq.start_pos + a: keys, None] - k_pos[None, :keys]  # [r, keys]
            rows = table[seq.token_start + a: seq.token_start + b].transpose(0, 1)  # [Hq, r, E]
            allowed = meta.own_allowed(i, self.mask_kind, slice(a, b))[:, :keys]
            bias = self._bias(rows, distance).masked_fill(~allowed, float("-inf"))  # [Hq, r, keys]
            bias = bias.reshape(1, self.num_kv_heads, self.groups * (b - a), keys).to(q.dtype)
            o = self._attend(self._fold(q[seq.token_start + a: seq.token_start + b], 1, b - a), ks[:, :, :keys],
                             vs[:, :, :keys], bias)
            out.append(self._unfold(o, 1, b - a))
        return torch.cat(out)


class InklingAttention(nn.Module):
    """One layer's attention (module docstring) over this rank's heads: the key and value convs over this rank's KV
    heads' channels, the relative logits over its query heads."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__()
        kind = config.layer_types[layer]
        if kind not in (SLIDING, FULL):
            raise ValueError(f"layer_types[{layer}]={kind!r} is not supported for model_type='inkling_text'; "
                             f"{FULL!r} or {SLIDING!r}")
        sliding = kind == SLIDING
        prefix = "swa_" if sliding else ""
        self.head_dim = head_dim = getattr(config, f"{prefix}head_dim")
        heads = getattr(config, f"{prefix}num_attention_heads")
        h = config.hidden_size
        self.qkv_proj = QKVParallelLinear(h, head_dim, heads, getattr(config, f"{prefix}num_key_value_heads"), tp)
        self.o_proj = RowParallelLinear(heads * head_dim, h, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.d_rel = config.d_rel
        self.r_proj = ColumnParallelLinear(h, heads * config.d_rel, tp)
        kernel, kv_start = config.conv_kernel_size, self.qkv_proj.kv_head_start * head_dim
        self.k_sconv = InklingShortConv(self.qkv_proj.kv_size, kernel, kv_start)
        self.v_sconv = InklingShortConv(self.qkv_proj.kv_size, kernel, kv_start)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        extent = config.sliding_window_size if sliding else config.rel_extent
        self.rel_logits_proj = nn.Module()  # the bank of profiles, [d_rel, E], replicated
        self.rel_logits_proj.proj = _param(config.d_rel, extent)
        heads_spec = dict(num_kv_heads=self.num_kv_heads, head_dim=head_dim,
                          kv_head_start=self.qkv_proj.kv_head_start)
        spec = SlidingWindowSpec(**heads_spec, sliding_window=config.sliding_window_size) if sliding \
            else FullAttentionSpec(**heads_spec)
        self.attn = RelativeAttention(self.num_heads, spec, 1.0 / head_dim)
        floor = None if sliding else config.log_scaling_n_floor
        self.log_scaling = None if floor is None else (float(config.log_scaling_alpha), float(floor))

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], -1)
        k, v = self.k_sconv(k, meta), self.v_sconv(v, meta)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        table = self.r_proj(x).view(t, self.num_heads, self.d_rel) @ self.rel_logits_proj.proj  # [T, Hq, E]
        if self.log_scaling is not None:  # (in float32, then back: transformers' order)
            alpha, floor = self.log_scaling
            tau = 1.0 + alpha * torch.log(((meta.positions + 1).float() / floor).clamp(min=1.0))
            q = (q.float() * tau[:, None, None]).to(q.dtype)
            table = (table.float() * tau[:, None, None]).to(table.dtype)
        out = self.attn(q, k, v.reshape(t, self.num_kv_heads, self.head_dim), table, meta)
        return self.o_proj(out)


class InklingMLP(LlamaMLP):
    """The dense SwiGLU times a learned scalar ``global_scale``."""

    def __init__(self, config, tp: TPGroup):
        super().__init__(config, tp)
        self.global_scale = _param(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.global_scale


class InklingRouter(nn.Module):
    """The router (replicated): ``weight`` [E + S, H] scoring the routed then the shared experts,
    ``e_score_correction_bias`` [E] and ``global_scale`` [1], both float32."""

    def __init__(self, routed: int, shared: int, hidden_size: int):
        super().__init__()
        self.weight = _param(routed + shared, hidden_size)
        self.e_score_correction_bias = _fp32_param(routed)
        self.global_scale = _fp32_param(1)


class SharedExperts(nn.Module):
    """The ``n_shared_experts`` SwiGLU experts, each its intermediate width split over the ranks as a dense MLP's:
    checkpoint tensors ``gate_proj`` and ``up_proj`` [S, I, H], ``down_proj`` [S, H, I]."""

    def __init__(self, count: int, hidden_size: int, width: int, tp: TPGroup):
        super().__init__()
        self.local = local = divide(width, tp.size, "moe_intermediate_size")
        start = tp.rank * local
        self.gate_proj, self.up_proj = _param(count, local, hidden_size), _param(count, local, hidden_size)
        self.down_proj = _param(count, hidden_size, local)
        for param, dim in ((self.gate_proj, 1), (self.up_proj, 1), (self.down_proj, 2)):
            param.weight_loader = lambda p, loaded, dim=dim: _copy(p, narrow(loaded, dim, start, local))

    def partial(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's share [T, H] of sum_s weights[:, s] * expert_s(x) (x [T, H], weights [T, S]), each expert's
        output summed in float32 (transformers' order)."""
        xs = x.unsqueeze(0).expand(self.gate_proj.shape[0], -1, -1)  # [S, T, H]
        gate = torch.bmm(xs, self.gate_proj.transpose(1, 2))
        up = torch.bmm(xs, self.up_proj.transpose(1, 2))
        act = F.silu(gate) * up * weights.t().unsqueeze(-1)  # [S, T, I]
        return torch.bmm(act, self.down_proj.transpose(1, 2)).float().sum(0).to(x.dtype)


class InklingMoE(SparseMoE):
    """The sparse block (module docstring): SparseMoE's routed experts (its ``inkling_text`` row: storage, split over
    the ranks, the fused tensors' loading, dispatch) with Inkling's router and weighted shared experts."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False):
        shared = config.n_shared_experts
        if not shared or shared < 1:
            raise ValueError(f"n_shared_experts={shared!r} is not supported for model_type='inkling_text': its router "
                             "scores the shared experts as its softmax's sink; a release has at least one")
        if not config.shared_expert_sink:
            raise ValueError("shared_expert_sink=False is not supported for model_type='inkling_text' (transformers "
                             "5.24 always scores the shared experts with the routed ones); set it to true")
        super().__init__(config, tp, expert_parallel)
        self.num_shared = shared
        self.route_scale = float(config.route_scale)
        self.gate = InklingRouter(self.num_experts, shared, config.hidden_size)
        self.shared_experts = SharedExperts(shared, config.hidden_size, config.moe_intermediate_size, tp)

    def route_all(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (the routed weights [T, k], their expert ids [T, k], the shared experts' weights [T, S]), in
        x's dtype; computed in float32."""
        router = self.gate
        logits = F.linear(x.float(), router.weight.float())  # [T, E + S]
        routed, shared = logits[:, : self.num_experts], logits[:, self.num_experts:]
        ids = (routed.sigmoid() + router.e_score_correction_bias).topk(self.top_k, dim=-1).indices
        chosen = F.logsigmoid(torch.cat((routed.gather(1, ids), shared), dim=-1))  # [T, k + S]
        weights = torch.softmax(chosen, dim=-1) * (self.route_scale * router.global_scale)
        weights = weights.to(x.dtype)
        return weights[:, : self.top_k], ids, weights[:, self.top_k:]

    def forward(self, x: torch.Tensor, router_input: torch.Tensor | None = None,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        weights, ids, shared = self.route_all(x)
        out = self.experts_of(x, weights, ids)
        return self.tp.all_reduce(out + self.shared_experts.partial(x, shared))


class NormedEmbedding(VocabParallelEmbedding):
    """The token embedding then an RMSNorm (``embed_norm``)."""

    def __init__(self, config, tp: TPGroup):
        super().__init__(config.vocab_size, config.hidden_size, tp)
        self.embed_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(super().forward(ids))


class InklingLayer(LlamaDecoderLayer):
    """Attention then the MLP, each block's output through its own residual short conv before it joins the stream."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__(config, tp, layer, expert_parallel)
        self.attn_sconv = InklingShortConv(config.hidden_size, config.conv_kernel_size)
        self.mlp_sconv = InklingShortConv(config.hidden_size, config.conv_kernel_size)

    def build_mixer(self, config, tp: TPGroup, layer: int) -> None:
        self.self_attn = InklingAttention(config, tp, layer)

    @classmethod
    def build_mlp(cls, config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        kind = config.mlp_layer_types[layer]
        if kind not in ("dense", "sparse"):
            raise ValueError(f"mlp_layer_types[{layer}]={kind!r} is not supported for model_type='inkling_text'; "
                             "'dense' or 'sparse'")
        return InklingMoE(config, tp, expert_parallel) if kind == "sparse" else InklingMLP(config, tp)

    def convs(self) -> list[InklingShortConv]:
        """The layer's four recurrent mixers, in a fixed order (their state specs' and slots')."""
        return [self.self_attn.k_sconv, self.self_attn.v_sconv, self.attn_sconv, self.mlp_sconv]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos, sin,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H] (the residual stream added lazily, in the next norm); cos, sin: none (no RoPE)
        x, residual = norm_stream(self.input_layernorm, x, residual)
        x = self.attn_sconv(self.self_attn(x, meta), meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp_sconv(self.mlp(x), meta), residual


class InklingModel(LlamaModel):
    layer_class = InklingLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)  # (no RoPE tables: the relative logits place the tokens)
        self.build_stage(config, pp, lambda i: InklingLayer(config, tp, i, expert_parallel),
                         lambda: NormedEmbedding(config, tp), lambda: self.final_norm(config))

    def rope_tables(self, meta: AttentionMetadata, dtype: torch.dtype):
        return lambda layer: (None, None)


def _deinterleaved(tensor: Any, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A release ``w13`` tensor's gate and up rows, interleaved along ``dim`` (gate_i at 2i, up_i at 2i + 1)."""
    value = materialize(tensor)
    index = [slice(None)] * value.dim()
    index[dim] = slice(0, None, 2)
    gate = value[tuple(index)]
    index[dim] = slice(1, None, 2)
    return gate, value[tuple(index)]


# the release's tensor names (transformers' InklingForConditionalGeneration saves them) -> transformers' module names;
# its fused gate/up tensors are de-interleaved by _RELEASE_FUSED
_RELEASE_NAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^model\.llm\.embed\.", "model.embed_tokens."), (r"^model\.llm\.embed_norm\.", "model.embed_tokens.embed_norm."),
    (r"^model\.llm\.unembed\.", "lm_head."), (r"^model\.llm\.", "model."),
    (r"\.attn\.wq_du\.", ".self_attn.q_proj."), (r"\.attn\.wk_dv\.", ".self_attn.k_proj."),
    (r"\.attn\.wv_dv\.", ".self_attn.v_proj."), (r"\.attn\.wr_du\.", ".self_attn.r_proj."),
    (r"\.attn\.wo_ud\.", ".self_attn.o_proj."), (r"\.attn\.(q_norm|k_norm|rel_logits_proj)\.", r".self_attn.\1."),
    (r"\.attn\.(k_sconv|v_sconv)\.weight$", r".self_attn.\1.conv1d.weight"),
    (r"\.(attn_sconv|mlp_sconv)\.weight$", r".\1.conv1d.weight"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.mlp_norm\.", ".post_attention_layernorm."),
    (r"\.mlp\.gate\.bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.mlp\.experts\.w2_weight$", ".mlp.experts.down_proj"),
    (r"\.mlp\.shared_experts\.shared_w2_weight$", ".mlp.shared_experts.down_proj"),
    (r"\.mlp\.w2_md\.", ".mlp.down_proj.")))
# fused release tensor (after the renames) -> (the dimension its gate and up rows interleave along, gate's name, up's
# name; None: one tensor, gate rows then up rows)
_RELEASE_FUSED = {".mlp.experts.w13_weight": (1, ".mlp.experts.gate_up_proj", None),
                  ".mlp.shared_experts.shared_w13_weight": (1, ".mlp.shared_experts.gate_proj",
                                                            ".mlp.shared_experts.up_proj"),
                  ".mlp.w13_dn.weight": (0, ".mlp.gate_proj.weight", ".mlp.up_proj.weight")}


class InklingForCausalLM(RecurrentModel, LlamaForCausalLM):
    """Inkling's text model for causal LM, sharded over ``tp``: query and KV heads (with their convs' channels and
    relative logits), the experts' and MLPs' widths; the residual convs replicated on every rank."""

    model_class = InklingModel
    may_tie = False  # its embedding and LM head are separate tensors in every release (transformers never ties them)
    skipped = ("model.mtp.",)  # the MTP layers (transformers does not run them)
    # LoRA on the attention's q/k/v/o (the MLPs, experts, relative-logit projections and convs: refused)
    lora_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        if getattr(hf_config, "quantization_config", None):
            raise ValueError("quantization_config is not supported for model_type='inkling_text' (its release's "
                             "fused experts are de-interleaved as they load, written for full-precision tensors "
                             "only); load a bf16 or fp32 checkpoint")
        if hf_config.hidden_act != "silu":
            raise ValueError(f"hidden_act={hf_config.hidden_act!r} is not supported for model_type='inkling_text'; "
                             "'silu' is")
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.width_multiplier = float(hf_config.logits_mup_width_multiplier)
        self.unpadded_vocab = self.head_rows(hf_config)  # the head's real rows only (the checkpoint's cut at load)

    @classmethod
    def head_rows(cls, hf_config) -> int:
        unpadded = getattr(hf_config, "unpadded_vocab_size", None)
        return hf_config.vocab_size if unpadded is None else min(int(unpadded), hf_config.vocab_size)

    @classmethod
    def recurrent_layers(cls, config) -> bool:
        return True  # four short convs in every layer

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        for field in ("num_attention_heads", "swa_num_attention_heads"):
            if getattr(config, field) % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not split this model's {field}="
                                 f"{getattr(config, field)}; choose one that divides it")

    def _recurrent_mixers(self) -> list[RecurrentMixer]:
        return [conv for _, layer in self.model.stage_layers() for conv in layer.convs()]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> [N, V] float32: the head over hidden / logits_mup_width_multiplier; -inf past
        # unpadded_vocab_size
        return widen_to_vocab(self.lm_head(hidden / self.width_multiplier).float(), self.config.vocab_size)

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The head padded to ``vocab_size`` cut to its real rows; the rest as :meth:`_release_names` gives them."""
        for name, tensor in self._release_names(weights):
            if name == "lm_head.weight" and self.unpadded_vocab < self.config.vocab_size:
                tensor = narrow(tensor, 0, 0, self.unpadded_vocab)
            yield name, tensor

    def _release_names(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """Transformers' names as they are; the release's renamed, its fused gate/up tensors de-interleaved."""
        for name, tensor in weights:
            if not name.startswith("model.llm."):
                yield name, tensor
                continue
            for pattern, ours in _RELEASE_NAMES:
                name = pattern.sub(ours, name)
            piece = next((p for p in _RELEASE_FUSED if name.endswith(p)), None)
            if piece is None:
                yield name, tensor
                continue
            dim, gate_name, up_name = _RELEASE_FUSED[piece]
            gate, up = _deinterleaved(tensor, dim)
            base = name[: -len(piece)]
            if up_name is None:
                yield base + gate_name, torch.cat((gate, up), dim)
            else:
                yield base + gate_name, gate
                yield base + up_name, up
