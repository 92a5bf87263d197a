"""Mamba-1's mixer (Gu & Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", 2023): the
recurrent layer of Jamba, Mamba and Falcon-Mamba (:mod:`specray.models.mamba_hybrid`), with tensor-parallel linears
and the recurrent state per request that Gated DeltaNet and Mamba-2 keep
(:class:`~specray.models.gated_deltanet.RecurrentMixer`).

Per token t, with ``in_proj(x_t) = [x; z]`` (each ``intermediate`` wide):

* ``x_t = silu(causal_conv(x inputs) + conv bias)``, a depthwise conv of width K;
* ``[dt_raw; B; C] = x_proj(x_t)`` (``time_step_rank``, ``state``, ``state`` wide), each RMS-normed in Jamba (with
  weights) and Falcon-Mamba (without); ``dt_t = softplus(dt_proj(dt_raw))``, one per channel;
* per channel d, on its state h [state]: ``h <- exp(dt A[d]) * h + dt B x_d;  y_d = C . h + D_d x_d``, A = -exp(A_log)
  [intermediate, state]: every channel is a head of one value and the state's rows decay each at their own rate
  (:func:`~specray.models.gated_deltanet.gated_delta_scan`'s ``decay_by``; q = C, k = B, v = x, g = beta = dt);
* ``out = out_proj(y * silu(z))``.

dt, B and C come from the conv's output, so they are computed inside the recurrence (``gates_from_conv``): a replayed
draft's are recomputed from its replayed conv output. The decay differs per state row, which the chunked form does not
take: short steps run the token scan, long ones on a GPU a parallel prefix scan per chunk of tokens
(:func:`~specray.models.gated_deltanet.scanned_selective`: log2(chunk) steps a chunk; never timed on a GPU; on CPU the
token loop, cheaper there: :mod:`~specray.models.cpu_kernels`). Channels
split over tensor-parallel ranks: the conv, the scan and the gate are local; ``x_proj`` reads every channel, so its
output is summed over the ranks (a row-parallel projection, one all-reduce per layer and step), and ``out_proj``
reduces once."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from specray.models.gated_deltanet import (CHUNKED_FROM, FusedColumnLinear, RecurrentMixer, _head_param,
                                           depthwise_conv, gated_delta_scan, gated_delta_tree, rank_rows,
                                           scanned_selective)
from specray.models.cpu_kernels import scans_in_parallel
from specray.models.kv_cache import RecurrentStateSpec
from specray.models.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, divide
from specray.parallel import TPGroup


@dataclass(frozen=True)
class Mamba1Dims:
    inner: int
    state: int
    kernel: int
    dt_rank: int
    conv_bias: bool
    proj_bias: bool
    norms: str | None  # "weighted" (Jamba), "weightless" (Falcon-Mamba) or None (Mamba)
    eps: float


def mamba1_dims(config) -> Mamba1Dims:
    """The mixer's sizes from ``config`` (Jamba's ``mamba_*`` names; Mamba's and Falcon-Mamba's own)."""
    if config.model_type in ("jamba", "zamba"):  # (Zamba's: Jamba's names, dt, B and C not normed)
        return Mamba1Dims(config.mamba_expand * config.hidden_size, config.mamba_d_state, config.mamba_d_conv,
                          config.mamba_dt_rank, bool(config.mamba_conv_bias), bool(config.mamba_proj_bias),
                          "weighted" if config.model_type == "jamba" else None, float(config.rms_norm_eps))
    if config.model_type in ("mamba", "falcon_mamba"):
        falcon = config.model_type == "falcon_mamba"
        return Mamba1Dims(config.intermediate_size, config.state_size, config.conv_kernel, config.time_step_rank,
                          bool(config.use_conv_bias), bool(config.use_bias), "weightless" if falcon else None,
                          float(config.mixer_rms_eps) if falcon else 0.0)
    raise ValueError(f"model_type={config.model_type!r} has no Mamba-1 layers specray reads; one of "
                     "['falcon_mamba', 'jamba', 'mamba', 'zamba']")


def check_mamba1_split(config, tp: int) -> None:
    """A ValueError unless ``tp`` ranks split the Mamba-1 layers' channels (checked before any rank starts)."""
    inner = mamba1_dims(config).inner
    if inner % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not split this model's Mamba layers' {inner} channels; "
                         "choose a tensor_parallel_size that divides it")


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Mamba1Mixer(RecurrentMixer):
    """One Mamba-1 layer over this rank's channels (module docstring); its checkpoint names are transformers'
    (``mamba.``: Jamba; ``mixer.``: Mamba, Falcon-Mamba)."""

    delta_rule = False
    gates_from_conv = True

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        d = self.dims = mamba1_dims(config)
        self.width = divide(d.inner, tp.size, "the Mamba layers' intermediate size")
        self.kernel = d.kernel
        h = config.hidden_size
        self.in_proj = FusedColumnLinear(h, [d.inner, d.inner], tp, bias=d.proj_bias)  # x | z, one checkpoint tensor
        self.conv1d = depthwise_conv(tp, self.width, d.kernel, d.conv_bias)
        self.x_proj = RowParallelLinear(d.inner, d.dt_rank + 2 * d.state, tp)
        self.dt_proj = ColumnParallelLinear(d.dt_rank, d.inner, tp, bias=True)
        self.A_log = rank_rows(tp, self.width, d.state)
        self.D = _head_param(d.inner, tp)
        if d.norms == "weighted":
            self.dt_layernorm = RMSNorm(d.dt_rank, d.eps)
            self.b_layernorm = RMSNorm(d.state, d.eps)
            self.c_layernorm = RMSNorm(d.state, d.eps)
        self.out_proj = RowParallelLinear(d.inner, h, tp, bias=d.proj_bias)

    @property
    def state_spec(self) -> RecurrentStateSpec:
        # each channel a head: its state [state, 1]
        return RecurrentStateSpec(conv_dim=self.width, conv_width=self.kernel - 1, num_heads=self.width,
                                  key_dim=self.dims.state, value_dim=1)

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        # x: [T, H] -> [T, H] (meta.recurrent: see RecurrentMixer.recurrence)
        t = x.shape[0]
        xs, z = self.in_proj(x).split(self.width, dim=-1)
        unused = x.new_zeros(t, self.width, dtype=torch.float32)  # dt comes from the conv's output (gates_from_conv)
        y = self.recurrence(xs, unused, unused, meta).reshape(t, -1)  # [T, C] float32, D x added
        return self.out_proj((y * F.silu(z.float())).to(x.dtype))

    def _heads_and_gates(self, conv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """conv [B, L, C] -> q = C and k = B [B, L, C, state] (one per token, every channel's), v = x [B, L, C, 1],
        g = beta = dt [B, L, C], float32."""
        b, length, c = conv.shape
        d = self.dims
        dt, bm, cm = self.x_proj(conv.reshape(b * length, c)).split([d.dt_rank, d.state, d.state], dim=-1)
        if d.norms == "weighted":
            dt, bm, cm = self.dt_layernorm(dt), self.b_layernorm(bm), self.c_layernorm(cm)
        elif d.norms == "weightless":
            dt, bm, cm = _rms(dt, d.eps), _rms(bm, d.eps), _rms(cm, d.eps)
        dt = F.softplus(self.dt_proj(dt).float()).view(b, length, c)
        k, q = (m.float().view(b, length, 1, d.state).expand(b, length, c, d.state) for m in (bm, cm))
        return q, k, conv.float()[..., None], dt, dt

    def _decay(self) -> torch.Tensor:
        return -self.A_log.float().exp()  # A [C, state]

    def _rule(self, q, k, v, g, beta, state, keep_at):
        parallel = q.shape[1] >= CHUNKED_FROM and scans_in_parallel(q.device)  # (the same results either way)
        scan = scanned_selective if parallel else partial(gated_delta_scan, delta=False)
        return scan(q, k, v, g, beta, state, keep_at, decay_by=self._decay())

    def _tree_rule(self, q, k, v, g, beta, state, parent_rows, keep):
        return gated_delta_tree(q, k, v, g, beta, state, parent_rows, keep, delta=False, decay_by=self._decay())

    def _skip(self, out: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """y = C . h + D x per channel."""
        return out + self.D.float()[:, None] * v
