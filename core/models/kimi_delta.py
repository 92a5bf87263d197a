"""Kimi Delta Attention (KDA: Moonshot's Kimi-Linear, transformers' ``KimiLinearDeltaAttention``): the gated delta
rule of :mod:`specray.models.gated_deltanet` on :class:`~specray.models.gated_deltanet.RecurrentMixer`'s slots,
replay, token trees and graph steps.

Where it differs from Qwen3-Next's Gated DeltaNet (per token t, H heads of d features, key width = value width = d):

* the decay is per key channel, not per head: ``g_t = -exp(A_log[h]) * softplus(f_b(f_a(x_t)) + dt_bias)``
  [H, d] (a low-rank forget gate, ``f_a_proj`` to d then ``f_b_proj`` to H * d), and the state's key rows decay
  each by its own ``exp(g_t[h, c])``: ``S <- diag(exp(g_t)) S`` before the delta update;
* q, k and v come from projections of their own (``q_proj``, ``k_proj``, ``v_proj``: here one fused projection,
  loaded part by part), each with a short conv of its own (``q_conv1d`` ...: here one conv), no bias, then silu;
  q and k L2-normed per head, q scaled by ``1 / sqrt(d)``; as many key heads as value heads;
* ``beta_t = sigmoid(b_proj(x_t))`` per head;
* the output gate is low-rank too (``g_a_proj`` to d, ``g_b_proj`` to H * d) and the gated norm multiplies by
  ``sigmoid(gate)`` (not silu), its weight applied in float32.

The decay and strength of a replayed draft must be at hand when the next chunk replays it, and the pending gates the
state keeps are one number per head; so the forget gate's low-rank input ``f_a(x)`` [d] and the strength's logits
``b_proj(x)`` [H] ride along with q, k and v as conv channels that the conv passes through (a weight of 1 on the
newest input, 0 on the others: exact in any dtype) and are turned into g and beta from the conv's output
(``gates_from_conv``, as Mamba-1 does). The silu is applied after the conv (``conv_activation`` off), to the q, k and
v channels only. A slot's conv inputs therefore hold 3 H d + d + H channels per row.

The delta rule runs token by token for short steps (:func:`~specray.models.gated_deltanet.gated_delta_scan` with g
[B, L, H, d]) and in a chunked form for long ones (:func:`chunked_kimi_delta`: the WY / UT form of the gated delta
rule with every pairwise decay taken per channel, as transformers' ``chunk_kimi_delta_attention``), the state carried
between 64-token chunks; token trees by :func:`~specray.models.gated_deltanet.gated_delta_tree` with per-channel g.

Heads split over tensor-parallel ranks (q, k, v, the convs, ``f_b_proj``, ``g_b_proj``, ``b_proj``, ``A_log``,
``dt_bias`` by head); ``f_a_proj`` and ``g_a_proj`` (d wide) are replicated; ``o_proj`` reduces once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.gated_deltanet import (CHUNK, CHUNKED_FROM, RecurrentMixer, _segment_sums,
                                           gated_delta_scan, gated_delta_tree, l2norm, rank_rows, to_chunks)
from specray.models.kv_cache import RecurrentStateSpec
from specray.models.layers import (ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear, _copy, _param,
                                   divide, materialize, narrow)
from specray.parallel import TPGroup


def chunked_kimi_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, keep_at: list[int] | torch.Tensor | None = None,
                       chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~specray.models.gated_deltanet.gated_delta_scan`'s results with a per-channel decay (g [B, L, H, dk];
    the other arguments and the padding rule as there) computed chunk by chunk, float32, plain torch.

    Per sequence and head, within a chunk from state S0, with ``G_t`` [dk] the cumulative log-decay per key channel
    and ``D[c, t, i] = exp(G_t[c] - G_i[c])`` for i <= t (summed directly: ``_segment_sums``), the scan
    ``S_t = diag(exp(g_t)) S_{t-1} + k_t u_t^T``, ``u_t = beta_t (v_t - (diag(exp(g_t)) S_{t-1})^T k_t)`` unrolls as
    in :func:`~specray.models.gated_deltanet.chunked_gated_delta` with each pairwise decay moved inside the product
    over channels: ``A[t, i] = beta_t sum_c k_t[c] k_i[c] D[c, t, i]`` (i < t), ``(I + A) U = diag(beta) V -
    diag(beta) (K * exp(G)) S0`` solved once per chunk (U = U~ - W S0), the outputs ``O = (Q * exp(G)) S0 + M U``
    with ``M[t, i] = sum_c q_t[c] k_i[c] D[c, t, i]`` (i <= t), and the state after token j ``diag(exp(G_j)) S0 +
    sum_{i<=j} (k_i * D[:, j, i]) u_i^T``. The [C, C, dk] decays are built one chunk at a time, so memory stays at
    one chunk's whatever the length."""
    b, length, h, dk = q.shape
    dv = v.shape[-1]
    chunk, (q, k, v, g, beta) = to_chunks(chunk, q, k, v, g, beta)  # [B, H, N, C(, d)]
    n = q.shape[2]
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    rows = torch.arange(b, device=q.device)
    at_chunk = at_token = None
    wanted: set[int] | None = None  # the chunks holding a kept state (None: any may, read on the device)
    if keep_at is not None:
        if isinstance(keep_at, torch.Tensor):  # -1: the state given (no chunk matches)
            at_chunk, at_token = keep_at.div(chunk, rounding_mode="floor"), keep_at.remainder(chunk)
        else:  # host lists: only the chunks that hold one are read, and no value goes back to the host
            wanted = {t // chunk for t in keep_at if t >= 0}
            at_chunk = torch.tensor([t // chunk if t >= 0 else -1 for t in keep_at], device=q.device)
            at_token = torch.tensor([t % chunk for t in keep_at], device=q.device)
        kept = state.clone()
    outputs = []
    for c in range(n):
        qc, kc, vc, gc, bc = q[:, :, c], k[:, :, c], v[:, :, c], g[:, :, c], beta[:, :, c]
        decay = _segment_sums(gc.transpose(-1, -2)).exp()  # D [B, H, dk, C(t), C(i)], 0 above the diagonal
        cum = gc.cumsum(-2)  # G [B, H, C, dk]
        kk = torch.einsum("bhtc,bhic,bhcti->bhti", kc, kc, decay)
        a = (bc[..., None] * kk).masked_fill(~strict, 0.0)  # A [B, H, C, C], strictly lower
        rhs = torch.cat((bc[..., None] * vc, bc[..., None] * kc * cum.exp()), -1)  # [B, H, C, dv + dk]
        u_free, w = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True).split([dv, dk], -1)
        u = u_free - w @ state  # U [B, H, C, dv]
        within = torch.einsum("bhtc,bhic,bhcti->bhti", qc, kc, decay)  # M (D is 0 above the diagonal)
        outputs.append((qc * cum.exp()) @ state + within @ u)
        if at_chunk is not None and (wanted is None or c in wanted):
            k_keep = kc * decay[rows, :, :, at_token].transpose(-1, -2)  # [B, H, C(i), dk]: k_i * D[:, j, i]
            start_keep = cum[rows, :, at_token].exp()[..., None]  # exp(G_j) [B, H, dk, 1]
            here = (at_chunk == c)[:, None, None, None]
            kept = torch.where(here, start_keep * state + k_keep.transpose(-1, -2) @ u, kept)
        k_end = kc * decay[..., -1, :].transpose(-1, -2)  # k_i * D[:, C - 1, i]: each write's decay to the end
        state = cum[:, :, -1, :, None].exp() * state + k_end.transpose(-1, -2) @ u
    out = torch.stack(outputs, 2).reshape(b, h, n * chunk, dv)[:, :, :length].transpose(1, 2)  # [B, L, H, dv]
    return out, (state if keep_at is None else kept)


class SigmoidGatedRMSNorm(nn.Module):
    """``rmsnorm(x) * weight * sigmoid(gate)`` over the last dimension, all in float32 (transformers'
    ``KimiLinearRMSNormGated``), rounded to x's dtype at the end."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(size)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate: [..., size] -> [..., size]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf * torch.sigmoid(gate.float())).to(x.dtype)


def check_kda_heads_split(config, tp: int, pp: int) -> None:
    """A family's ``check_split``: ``tp`` ranks split the KDA layers' heads (checked before any rank starts)."""
    if config.linear_num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not split this model's linear_num_heads="
                         f"{config.linear_num_heads}; choose a tensor_parallel_size that divides it")


class PartwiseColumnLinear(MergedColumnParallelLinear):
    """KDA's q | k | v projection: three checkpoint tensors (``q_proj`` ...) loaded part by part (``shard_id``), or
    one joined tensor (no ``shard_id``) as :class:`~specray.models.gated_deltanet.FusedColumnLinear` loads it; a LoRA
    adapter of each part keeps its own A (a merged projection's, not a fused tensor's one A)."""

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int | None = None) -> None:
        if shard_id is not None:
            super().weight_loader(param, loaded, shard_id)
            return
        start = 0
        for i, size in enumerate(self.output_sizes):
            super().weight_loader(param, narrow(loaded, 0, start, size), i)
            start += size


class KimiDeltaAttention(RecurrentMixer):
    """One KDA layer over this rank's heads (module docstring); the release's names under ``linear_attn.`` (the
    model renames its ``self_attn.``), q/k/v and their convs as parts of one each."""

    gates_from_conv = True  # g and beta from the passed-through channels of the conv's output
    conv_activation = False  # silu on q, k and v only, after the conv (_heads_and_gates)

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported for Kimi Delta Attention; 'silu' is")
        self.tp = tp
        total = config.linear_num_heads
        self.heads = divide(total, tp.size, "linear_num_heads")
        self.dk = self.dv = d = config.linear_head_dim
        self.kernel = config.linear_conv_kernel_dim
        h, width = config.hidden_size, total * d
        self.in_proj_qkv = PartwiseColumnLinear(h, [width] * 3, tp)  # q_proj | k_proj | v_proj
        self.gate_channels = self._build_gates(config, tp)  # the forget gate's input channels, riding the conv
        self.b_proj = ColumnParallelLinear(h, total, tp)
        self.dt_bias = rank_rows(tp, self.heads * d)  # [H * d], head-major
        self.dt_bias.data = self.dt_bias.data.float()  # kept in float32 whatever the model's dtype, as transformers
        self.A_log = _param(self.heads)  # the release's [1, 1, H, 1]: this rank's heads
        self.A_log.weight_loader = self._load_a_log
        self.qkv_channels = 3 * self.heads * d
        channels = self.qkv_channels + self.gate_channels + self.heads  # q | k | v | f_a(x) | b logits
        self.conv1d = nn.Module()
        self.conv1d.weight = _param(channels, self.kernel)
        self.conv1d.weight.weight_loader = self._load_conv
        with torch.no_grad():  # the gate channels pass the newest input through
            self.conv1d.weight[self.qkv_channels:] = 0.0
            self.conv1d.weight[self.qkv_channels:, -1] = 1.0
        self.o_norm = SigmoidGatedRMSNorm(d, config.rms_norm_eps)
        self.o_proj = RowParallelLinear(width, h, tp)

    def _build_gates(self, config, tp: TPGroup) -> int:
        """The forget gate's and the output gate's projections (Kimi's: low rank, the rank-d halves replicated, as
        every rank's heads read all of them); returns how many channels of the forget gate's input ride the conv."""
        h, d, one = config.hidden_size, self.dk, TPGroup.single()
        width = config.linear_num_heads * d
        self.f_a_proj = ColumnParallelLinear(h, d, one)
        self.f_b_proj = ColumnParallelLinear(d, width, tp)
        self.g_a_proj = ColumnParallelLinear(h, d, one)
        self.g_b_proj = ColumnParallelLinear(d, width, tp)
        return d

    def _gate_input(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the forget gate's input [T, gate_channels], carried through the conv."""
        return self.f_a_proj(x)

    def _output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the output norm's gate [T, Hl * d]."""
        return self.g_b_proj(self.g_a_proj(x))

    def _decay(self, f: torch.Tensor) -> torch.Tensor:
        """The forget gate's input as the conv passed it [N, gate_channels] -> the log decay [N, Hl, d] (float32)."""
        hl, d = self.heads, self.dk
        f = self.f_b_proj(f).float().view(-1, hl, d)
        return -self.A_log.float().exp()[:, None] * F.softplus(f + self.dt_bias.float().view(hl, d))

    def _load_a_log(self, param: nn.Parameter, loaded: Any) -> None:
        """This rank's heads of the release's A_log ([1, 1, H, 1], or [H])."""
        values = materialize(loaded).reshape(-1)
        _copy(param, narrow(values, 0, self.tp.rank * self.heads, self.heads))

    def _load_conv(self, param: nn.Parameter, loaded: Any, shard: int | None = None) -> None:
        """This rank's channels of the q, k or v conv (``shard`` 0, 1, 2: the release's ``q_conv1d`` ...), or of all
        three from one joined conv [3 H d, 1, K] (no ``shard``); the pass-through rows stay as they are."""
        local = self.heads * self.dk
        whole = local * self.tp.size
        parts = [shard] if shard is not None else [0, 1, 2]
        value = materialize(loaded)
        for i, part in enumerate(parts):
            piece = narrow(value, 0, i * whole + self.tp.rank * local, local)
            _copy(param[part * local: (part + 1) * local], piece.reshape(local, self.kernel))

    @property
    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(conv_dim=self.conv1d.weight.shape[0], conv_width=self.kernel - 1,
                                  num_heads=self.heads, key_dim=self.dk, value_dim=self.dv)

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        # x: [T, H] -> [T, H] (meta.recurrent: see RecurrentMixer.recurrence)
        t = x.shape[0]
        mixed = torch.cat((self.in_proj_qkv(x), self._gate_input(x), self.b_proj(x)), dim=-1)  # [T, C] before the conv
        unused = x.new_zeros(t, self.heads, dtype=torch.float32)  # g and beta come from the conv's output
        o = self.recurrence(mixed, unused, unused, meta)  # [T, Hl, d] float32
        gate = self._output_gate(x).view(t, self.heads, self.dv)
        return self.o_proj(self.o_norm(o.to(x.dtype), gate).reshape(t, -1))

    def _heads_and_gates(self, conv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """conv [B, L, C] -> q, k [B, L, Hl, d] (silu, L2-normed, q scaled), v [B, L, Hl, d], g [B, L, Hl * d] (one
        log decay per key channel, flat: the mixer's padding masks see one row of gates per token) and beta [B, L,
        Hl], float32."""
        b, length, _ = conv.shape
        hl, d = self.heads, self.dk
        qkv, f, logits = conv.split([self.qkv_channels, self.gate_channels, hl], dim=-1)
        q, k, v = F.silu(qkv).float().split([hl * d] * 3, dim=-1)
        q = l2norm(q.reshape(b, length, hl, d)) * d ** -0.5
        k = l2norm(k.reshape(b, length, hl, d))
        g = self._decay(f.reshape(b * length, self.gate_channels))
        beta = logits.float().sigmoid()
        return q, k, v.reshape(b, length, hl, d), g.reshape(b, length, hl * d), beta

    def _rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, keep_at: list[int] | torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        g = g.view(*g.shape[:2], self.heads, self.dk)
        if q.shape[1] >= CHUNKED_FROM:
            return chunked_kimi_delta(q, k, v, g, beta, state, keep_at)
        return gated_delta_scan(q, k, v, g, beta, state, keep_at)

    def _tree_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, parent_rows: list[int], keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        return gated_delta_tree(q, k, v, g.view(g.shape[0], self.heads, self.dk), beta, state, parent_rows, keep)
