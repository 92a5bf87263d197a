"""Zamba (``ZambaForCausalLM``: Zyphra's Zamba-7B-v1): Mamba-1 layers (:mod:`specray.models.mamba1`, a recurrent
state per request) with one shared transformer block run at the ``hybrid`` layers, Zamba2's layout
(:mod:`specray.models.zamba2`) with Zamba's own pieces:

* A ``mamba`` layer: ``x + mamba(rmsnorm(x))``; a ``hybrid`` one: ``x + mamba(rmsnorm(x + linear(t)))`` with
  ``t = mlp(rmsnorm(attention(rmsnorm([x; e]))))``, the block reading the stream beside the token's embedding (2 H
  wide). There is one block, run by every hybrid layer over K/V of its own; no adapters, no RoPE; attention's heads
  ``attention_head_dim`` wide (2 H / heads), scaled by ``(head_dim / 2) ** -0.5``; the MLP gated (``hidden_act``).
* Zamba's Mamba-1 mixer splits its channels into ``n_mamba_heads`` groups, each with its own ``x_proj`` and
  ``dt_proj`` (dt, B and C computed per group from that group's channels alone) and the group's B and C shared by its
  channels. Here each is one projection whose weight is the groups' block-diagonal matrix (built as the checkpoint
  loads), so the channels split over tensor-parallel ranks as Mamba-1's do whatever the groups (a group may span two
  ranks: ``x_proj`` is row-parallel and sums over them); the price is ``n_mamba_heads`` times those two small
  projections' weights and work. Each channel then reads its own group's B and C (:meth:`ZambaMambaMixer
  ._heads_and_gates`); conv, replay, trees and graph steps are Mamba-1's (:class:`~specray.models.gated_deltanet
  .RecurrentMixer`).

Checkpoint names (transformers'): the block under a hybrid layer (``model.layers.{i}.shared_transf.``: the first
that runs it, or each: every copy loads into ``model.blocks.0.``), a hybrid layer's ``linear`` and
``mamba_decoder.``; the mixer's ``in_proj`` rows interleave x and z channel by channel (de-interleaved as it loads),
its ``x_proj_weight`` [groups, R + 2 N, C / groups], ``dt_proj_weight`` [groups, C / groups, R], ``dt_proj_bias``,
``A_log`` and ``D`` per group (flattened over the channels as they load).

LoRA adapters as Zamba2's: the mixers' ``in_proj`` (an adapter's B de-interleaved as the weight is:
:meth:`ZambaForCausalLM.split_adapter`) and ``out_proj``, a hybrid layer's ``linear``; the shared block's projections
refused by name (transformers builds the block anew in each hybrid layer, so PEFT adapts each run apart)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.kv_cache import FullAttentionSpec
from specray.models.layers import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RMSNorm,
                                   RowParallelLinear, check_heads_split, materialize)
from specray.models.mamba1 import Mamba1Mixer, check_mamba1_split
from specray.models.zamba2 import Zamba2ForCausalLM, Zamba2Layer, Zamba2Model
from specray.parallel import PPGroup, TPGroup

_ACTS = {"gelu": F.gelu, "silu": F.silu}
_KINDS = ("hybrid", "linear_attention", "mamba")
_SHARED = re.compile(r"^model\.layers\.(\d+)\.shared_transf\.(.*)$")
_MIXER = re.compile(r"^(model\.layers\.\d+\.(?:mamba_decoder\.)?mamba\.)(in_proj\.(?:weight|bias)|x_proj_weight|"
                    r"dt_proj_weight|dt_proj_bias|A_log|D)$")


def check_zamba_config(config) -> None:
    """A ValueError naming the field for a Zamba setting specray does not implement."""
    kinds = list(config.layers_block_type)
    if len(kinds) != config.num_hidden_layers or any(k not in _KINDS for k in kinds):
        raise ValueError(f"layers_block_type={kinds} is not supported for model_type='zamba': give "
                         f"num_hidden_layers={config.num_hidden_layers} entries, each one of {list(_KINDS)}")
    if config.hidden_mamba_act != "silu":
        raise ValueError(f"hidden_mamba_act={config.hidden_mamba_act!r} is not supported for model_type='zamba' "
                         "(specray's Mamba conv is followed by silu); use 'silu'")
    if config.hidden_act not in _ACTS:
        raise ValueError(f"hidden_act={config.hidden_act!r} is not supported for model_type='zamba'; one of "
                         f"{sorted(_ACTS)}")
    inner = config.mamba_expand * config.hidden_size
    if inner % config.n_mamba_heads:
        raise ValueError(f"n_mamba_heads={config.n_mamba_heads} does not divide the Mamba layers' {inner} channels "
                         "(mamba_expand * hidden_size)")


class ZambaMambaMixer(Mamba1Mixer):
    """Mamba-1 whose channels form ``n_mamba_heads`` groups, each with its own ``x_proj`` and ``dt_proj`` (module
    docstring): both block-diagonal over the groups."""

    def __init__(self, config, tp: TPGroup):
        super().__init__(config, tp)
        d, groups = self.dims, config.n_mamba_heads
        self.groups = groups
        self.x_proj = RowParallelLinear(d.inner, groups * (d.dt_rank + 2 * d.state), tp)
        self.dt_proj = ColumnParallelLinear(groups * d.dt_rank, d.inner, tp, bias=True)
        channels = torch.arange(self.width) + tp.rank * self.width
        self.register_buffer("group_of", channels // (d.inner // groups), persistent=False)  # [C] local channels

    def _heads_and_gates(self, conv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """conv [B, L, C] -> q = C and k = B [B, L, C, state] (each channel its group's), v = x [B, L, C, 1],
        g = beta = dt [B, L, C], float32."""
        b, length, c = conv.shape
        d, g = self.dims, self.groups
        params = self.x_proj(conv.reshape(b * length, c)).view(b * length, g, d.dt_rank + 2 * d.state)
        dt, bm, cm = params.split([d.dt_rank, d.state, d.state], dim=-1)
        dt = F.softplus(self.dt_proj(dt.reshape(b * length, g * d.dt_rank)).float()).view(b, length, c)
        k, q = (m.float().index_select(1, self.group_of).view(b, length, c, d.state) for m in (bm, cm))
        return q, k, conv.float()[..., None], dt, dt


class ZambaBlock(nn.Module):
    """The shared transformer block's weights (Zamba2's block's names: norms, attention's projections, the MLP's)."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        h, wide = config.hidden_size, config.attention_hidden_size
        self.head_dim = d = config.attention_head_dim
        self.input_layernorm = RMSNorm(wide, config.rms_norm_eps)
        self.qkv_proj = QKVParallelLinear(wide, d, config.num_attention_heads, config.num_key_value_heads, tp)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, h, tp)
        self.pre_ff_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.gate_up_proj = MergedColumnParallelLinear(h, [config.intermediate_size] * 2, tp)
        self.down_proj = RowParallelLinear(config.intermediate_size, h, tp)
        self.act = _ACTS[config.hidden_act]


class ZambaInvocation(nn.Module):
    """One hybrid layer's run of the block: its own K/V (``attn``); the block is passed in."""

    def __init__(self, config, tp: TPGroup, block: ZambaBlock):
        super().__init__()
        qkv = block.qkv_proj
        self.num_heads, self.num_kv_heads, self.head_dim = qkv.num_heads, qkv.num_kv_heads, block.head_dim
        spec = FullAttentionSpec(self.num_kv_heads, self.head_dim, qkv.kv_head_start)
        self.attn = PagedAttention(self.num_heads, spec, (self.head_dim / 2) ** -0.5)

    def forward(self, block: ZambaBlock, x: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x, embedded: [T, H] -> the block's output [T, H] (no residual; no RoPE: cos and sin go unread)
        t, d = x.shape[0], self.head_dim
        qkv = block.qkv_proj(block.input_layernorm(torch.cat((x, embedded), dim=-1)))
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        out = block.o_proj(self.attn(q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d),
                                     v.view(t, self.num_kv_heads, d), meta))
        gate, up = block.gate_up_proj(block.pre_ff_layernorm(out)).chunk(2, dim=-1)
        return block.down_proj(block.act(gate) * up)


class ZambaLayer(Zamba2Layer):
    """Zamba2's layer (its forward) with Zamba's mixer and block."""

    def __init__(self, config, tp: TPGroup, layer: int, block: ZambaBlock | None):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mamba = ZambaMambaMixer(config, tp)
        self.mlp = None
        if block is not None:  # (the block is the model's, not registered here)
            self.self_attn = ZambaInvocation(config, tp, block)
            self.linear = ColumnParallelLinear(config.hidden_size, config.hidden_size, TPGroup.single())


class ZambaModel(Zamba2Model):
    block_class = ZambaBlock
    layer_class = ZambaLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        check_zamba_config(config)
        super().__init__(config, tp, expert_parallel, pp)


def _block_diagonal(tensor: Any) -> torch.Tensor:
    """A per-group weight [groups, out, in] as the groups' block-diagonal matrix [groups * out, groups * in]."""
    return torch.block_diag(*materialize(tensor).unbind(0))


class ZambaForCausalLM(Zamba2ForCausalLM):
    """Zamba for causal LM, sharded over ``tp`` (module docstring): the Mamba layers' channels and the block's heads
    split over the ranks."""

    model_class = ZambaModel

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        check_mamba1_split(config, tp)
        check_heads_split(config, tp)

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The block's tensors under ``model.blocks.0.``; the mixers' in Mamba-1's layout (module docstring)."""
        for name, tensor in weights:
            found = _MIXER.match(name)
            if found is None:
                yield self._shared_name(name), tensor
                continue
            prefix, part = found.groups()
            if part.startswith("in_proj."):  # rows x0 z0 x1 z1 ... -> x rows then z rows
                value = materialize(tensor)
                rows = value.shape[0] // 2
                yield prefix + part, value.reshape(rows, 2, *value.shape[1:]).transpose(0, 1).reshape(value.shape)
            elif part == "x_proj_weight":
                yield prefix + "x_proj.weight", _block_diagonal(tensor)
            elif part == "dt_proj_weight":
                yield prefix + "dt_proj.weight", _block_diagonal(tensor)
            else:  # dt_proj_bias, A_log, D: per group -> per channel
                value = materialize(tensor)
                yield prefix + ("dt_proj.bias" if part == "dt_proj_bias" else part), value.reshape(
                    -1, *value.shape[2:])

    def split_adapter(self, module: str, lora_b: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """An adapter's B of a mixer's ``in_proj`` with its rows de-interleaved as the weight's are (x rows, then z
        rows; the name with a trailing dot, as :func:`specray.models.llama.unfuse` gives it), None for another."""
        if not module.endswith(".mamba.in_proj"):
            return None
        rows = lora_b.shape[0] // 2
        return [(f"{module}.", lora_b.reshape(rows, 2, -1).transpose(0, 1).reshape(lora_b.shape))]

    def _shared_name(self, name: str) -> str:
        """The block's checkpoint name (under any hybrid layer) as ours: ``model.blocks.0.``."""
        found = _SHARED.match(name)
        if found is None:
            return name
        rest = found.group(2).replace("self_attn.", "").replace("feed_forward.", "")
        return f"model.blocks.0.{rest}"

