"""Mamba-2's mixer (Dao & Gu, "Transformers are SSMs", 2024), the recurrent layer of the hybrid families in
:mod:`specray.models.mamba_hybrid` (Bamba, Granite 4.0's hybrids, Nemotron-H), with tensor-parallel linears and the
recurrent state per request that Gated DeltaNet keeps (:class:`~specray.models.gated_deltanet.RecurrentMixer`:
slots, replay of accepted drafts, token trees, graph steps).

Per token t, with ``in_proj(x_t) = [z; x; B; C; dt]`` (z and x ``heads * head_dim`` wide, B and C ``groups * state``,
dt one per head):

* ``[x; B; C]_t = silu(causal_conv([x; B; C] inputs) + conv bias)``, a depthwise conv of width K;
* ``dt_t = clamp(softplus(dt_t + dt_bias), time_step_limit)`` per head, ``A = -exp(A_log)``;
* per head, with its group's B and C (each group serves ``heads / groups`` consecutive heads), on the state
  S [state, head_dim]: ``S <- exp(dt_t A) S + B_t (dt_t x_t)^T;  y_t = C_t^T S + D x_t``. This is the gated linear
  rule of :func:`~specray.models.gated_deltanet.gated_delta_scan` with ``delta=False``: q = C, k = B, v = x, the log
  decay g = dt A and the strength beta = dt; D x is the layer's skip (:meth:`Mamba2Mixer._skip`);
* ``out = out_proj(rmsnorm_groups(y * silu(z)) * w)``: the gate applied before the norm, the norm over each of the
  ``groups`` equal slices of the heads' outputs (Falcon-H1's options: the norm before the gate, or no norm).

Heads split over tensor-parallel ranks. The groups split with them where the ranks divide them; where there are
fewer groups than ranks (one group, as most releases have), each rank holds its heads' group whole (B and C
replicated) and the gated norm's sums of squares are summed over the ranks sharing a group (one all-reduce of a
[T, groups] tensor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.gated_deltanet import RecurrentMixer, _head_param, rank_rows
from specray.models.kv_cache import RecurrentStateSpec
from specray.models.layers import ColumnParallelLinear, RowParallelLinear, _copy, _param, divide, narrow
from specray.parallel import TPGroup


@dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba-2 mixer's sizes and flags, read from a family's config (:func:`mamba2_dims`)."""

    heads: int
    head_dim: int
    state: int
    groups: int
    kernel: int
    conv_bias: bool
    proj_bias: bool
    eps: float
    dt_limit: tuple[float, float]
    act: str
    out_bias: bool  # out_proj's bias (the projection bias but for Falcon-H1: projectors_bias)
    gated_norm: bool = True  # the gated norm; False: y * silu(z) alone (Falcon-H1's mamba_rms_norm false)
    norm_before_gate: bool = False  # rmsnorm(y) * w * silu(z) (Falcon-H1's option), else rmsnorm(y * silu(z)) * w

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim


# per family, its config's names for (heads, head_dim, state, groups, kernel, conv bias, projection bias, norm eps,
# activation) and the width its mixer claims (the expand factor times the hidden size, where it has one)
_FIELDS = {
    "bamba": ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv", "mamba_conv_bias",
              "mamba_proj_bias", "rms_norm_eps", "hidden_act", "mamba_expand"),
    "nemotron_h": ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
                   "use_conv_bias", "use_bias", "layer_norm_epsilon", "mamba_hidden_act", None),
}
_FIELDS["granitemoehybrid"] = _FIELDS["falcon_h1"] = _FIELDS["bamba"]
_FIELDS["zamba2"] = ("n_mamba_heads", "mamba_headdim", "mamba_d_state", "mamba_ngroups", "mamba_d_conv",
                     "use_conv_bias", "add_bias_linear", None, None, "mamba_expand")  # (its norm's eps, its act: fixed)
_FIELDS["mamba2"] = ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "use_conv_bias", "use_bias",
                     "layer_norm_epsilon", "hidden_act", "expand")


def mamba2_dims(config) -> Mamba2Dims:
    """The mixer's sizes from ``config`` (Bamba's, Granite 4.0's and Falcon-H1's ``mamba_*`` names, Nemotron-H's,
    Mamba-2's own), with a ValueError for what the mixer does not support."""
    names = _FIELDS.get(config.model_type)
    if names is None:
        raise ValueError(f"model_type={config.model_type!r} has no Mamba-2 layers specray reads; one of "
                         f"{sorted(_FIELDS)}")
    heads, head_dim, state, groups, kernel, conv_bias, proj_bias, eps, act, expand = names
    limit = tuple(float(x) for x in getattr(config, "time_step_limit", (0.0, float("inf"))))
    if config.model_type in ("nemotron_h", "zamba2"):  # transformers' clamp from time_step_min, whatever the limit
        limit = (float(config.time_step_min), float("inf"))
    falcon = config.model_type == "falcon_h1"
    dims = Mamba2Dims(getattr(config, heads), getattr(config, head_dim), getattr(config, state),
                      getattr(config, groups), getattr(config, kernel), bool(getattr(config, conv_bias)),
                      bool(getattr(config, proj_bias)), float(getattr(config, eps)) if eps else 1e-5, limit,
                      getattr(config, act) if act else "silu",
                      bool(config.projectors_bias) if falcon else bool(getattr(config, proj_bias)),
                      bool(config.mamba_rms_norm) if falcon else True,
                      bool(config.mamba_norm_before_gate) if falcon else False)
    if dims.act != "silu":
        raise ValueError(f"{act}={dims.act!r} is not supported for a Mamba-2 layer; 'silu' is")
    if falcon and getattr(config, "mamba_d_ssm", None) is not None:  # Falcon-H1: the width given outright
        if config.mamba_d_ssm != dims.inner:
            raise ValueError(f"mamba_d_ssm={config.mamba_d_ssm} must equal {heads} * {head_dim} = {dims.inner}")
    elif expand is not None and int(getattr(config, expand) * config.hidden_size) != dims.inner:
        raise ValueError(f"{expand} * hidden_size = {int(getattr(config, expand) * config.hidden_size)} must equal "
                         f"{heads} * {head_dim} = {dims.inner} (the mixer's width)")
    if dims.heads % dims.groups:
        raise ValueError(f"{heads}={dims.heads} must be a multiple of {groups}={dims.groups}: each group of B and C "
                         "serves a run of heads")
    return dims


def check_mamba2_split(config, tp: int) -> None:
    """A ValueError unless ``tp`` ranks split the mixer's heads, and its groups either split too or are fewer and
    divide the ranks (checked before any rank starts)."""
    dims = mamba2_dims(config)
    heads, groups = _FIELDS[config.model_type][0], _FIELDS[config.model_type][3]
    if dims.heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not split this model's {heads}={dims.heads}; choose a "
                         "tensor_parallel_size that divides it")
    if dims.groups % tp and tp % dims.groups:
        raise ValueError(f"tensor_parallel_size={tp} neither splits this model's {groups}={dims.groups} nor is a "
                         "multiple of it; choose one that is either")


class RowsColumnLinear(ColumnParallelLinear):
    """A column-parallel projection whose rank holds given row ranges of the checkpoint's tensor (``parts``: (start,
    size) each, concatenated in order), so that some parts may split over the ranks and others repeat on each."""

    def __init__(self, in_features: int, parts: list[tuple[int, int]], tp: TPGroup, bias: bool = False):
        self.parts = list(parts)
        super().__init__(in_features, sum(size for _, size in parts) * tp.size, tp, bias)

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        offset = 0
        for start, size in self.parts:
            self._load_rows(param, loaded, offset, size, start)
            offset += size


class GroupedGatedRMSNorm(nn.Module):
    """``rmsnorm(y * silu(z)) * w`` over each norm group (``group_size`` wide) of this rank's ``width`` outputs
    (float32 math, the weight applied in the output dtype, as transformers does). ``whole``: this rank holds its
    norm groups whole; else its outputs are part of norm group ``group`` (of ``groups``), which spans ranks: its sum
    of squares is placed in that column of a [T, groups] tensor and summed over the TP group."""

    def __init__(self, width: int, group_size: int, eps: float, tp: TPGroup, groups: int, group: int,
                 whole: bool, before_gate: bool = False):
        super().__init__()
        self.weight = rank_rows(tp, width)
        self.group_size, self.eps, self.tp = group_size, eps, tp
        self.groups, self.group, self.whole, self.before_gate = groups, group, whole, before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # y, z: [T, width] -> [T, width] in dtype; before_gate (Falcon-H1's option): rmsnorm(y) * w * silu(z)
        t = y.shape[0]
        h = y.float() if self.before_gate else y.float() * F.silu(z.float())
        if self.whole:
            parts = h.view(t, -1, self.group_size)
            h = (parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + self.eps)).view(t, -1)
        else:
            sums = h.new_zeros(t, self.groups)
            sums[:, self.group] = h.pow(2).sum(-1)
            total = self.tp.all_reduce(sums)[:, self.group: self.group + 1]
            h = h * torch.rsqrt(total / self.group_size + self.eps)
        if self.before_gate:
            return (self.weight * h * F.silu(z.float())).to(dtype)
        return self.weight * h.to(dtype)


class Mamba2Mixer(RecurrentMixer):
    """One Mamba-2 layer over this rank's heads (module docstring); its checkpoint names are transformers' (under
    ``mamba.``: Bamba, Granite 4.0; ``mixer.``: Nemotron-H)."""

    delta_rule = False

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        d = self.dims = mamba2_dims(config)
        check_mamba2_split(config, tp.size)
        self.heads = divide(d.heads, tp.size, "mamba heads")
        if d.groups % tp.size == 0:
            self.groups_here = d.groups // tp.size
            group_start = tp.rank * self.groups_here
        else:  # fewer groups than ranks: this rank's heads lie in one group, held whole on each of its ranks
            self.groups_here, group_start = 1, tp.rank // (tp.size // d.groups)
        self.kernel = d.kernel
        width, gn, n = self.heads * d.head_dim, self.groups_here * d.state, d.groups * d.state
        b_start, c_start = 2 * d.inner + group_start * d.state, 2 * d.inner + n + group_start * d.state
        self.in_proj = RowsColumnLinear(config.hidden_size, [
            (tp.rank * width, width), (d.inner + tp.rank * width, width), (b_start, gn), (c_start, gn),
            (2 * d.inner + 2 * n + tp.rank * self.heads, self.heads)], tp, bias=d.proj_bias)
        self.conv_parts = [(tp.rank * width, width), (d.inner + group_start * d.state, gn),
                           (d.inner + n + group_start * d.state, gn)]
        self.conv1d = nn.Module()  # the checkpoint's conv1d.weight [C, 1, K] (and bias [C]): this rank's channels
        self.conv1d.weight = _param(width + 2 * gn, d.kernel)
        self.conv1d.weight.weight_loader = self._load_conv
        self.conv1d.bias = None
        if d.conv_bias:
            self.conv1d.bias = _param(width + 2 * gn)
            self.conv1d.bias.weight_loader = self._load_conv
        self.dt_bias = _head_param(d.heads, tp)
        self.A_log = _head_param(d.heads, tp)
        self.D = _head_param(d.heads, tp)
        whole = d.groups % tp.size == 0
        self.norm = GroupedGatedRMSNorm(width, d.inner // d.groups, d.eps, tp, d.groups, group_start, whole,
                                        d.norm_before_gate) if d.gated_norm else None
        self.out_proj = RowParallelLinear(d.inner, config.hidden_size, tp, bias=d.out_bias)
        self.width, self.gn = width, gn

    def _load_conv(self, param: nn.Parameter, loaded: Any) -> None:
        """This rank's channels of x, B and C (the rows its ``in_proj`` holds of them)."""
        rows = torch.cat([narrow(loaded, 0, start, size) for start, size in self.conv_parts])
        _copy(param, rows.reshape(param.shape))

    @property
    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(conv_dim=self.width + 2 * self.gn, conv_width=self.kernel - 1,
                                  num_heads=self.heads, key_dim=self.dims.state, value_dim=self.dims.head_dim)

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        # x: [T, H] -> [T, H] (meta.recurrent: see RecurrentMixer.recurrence)
        t = x.shape[0]
        z, xbc, dt = self.in_proj(x).split([self.width, self.width + 2 * self.gn, self.heads], dim=-1)
        low, high = self.dims.dt_limit
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(low, high)  # [T, h]
        g = -self.A_log.float().exp() * dt  # log decay dt * A
        y = self.recurrence(xbc, g, dt, meta).reshape(t, -1)  # [T, h * head_dim], float32, D x added
        if self.norm is None:  # (Falcon-H1 without its norm: the gate alone)
            return self.out_proj((y * F.silu(z.float())).to(x.dtype))
        return self.out_proj(self.norm(y, z, x.dtype))

    def _split_heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv [B, L, C] -> q = C and k = B [B, L, h, state] (each group's repeated over its heads), v = x [B, L,
        h, head_dim], float32."""
        b, length, _ = conv.shape
        x, bm, cm = conv.float().split([self.width, self.gn, self.gn], dim=-1)
        g, n = self.groups_here, self.dims.state
        per = self.heads // g
        k, q = (m.reshape(b, length, g, 1, n).expand(b, length, g, per, n).reshape(b, length, self.heads, n)
                for m in (bm, cm))
        return q, k, x.reshape(b, length, self.heads, self.dims.head_dim)

    def _skip(self, out: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """y = C^T S + D x per head."""
        return out + self.D.float()[:, None] * v
