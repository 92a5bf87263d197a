"""Translated's Lara Mini (``LaraMiniForCausalLM``, model_type ``lara_mini``): a hybrid of Gated DeltaNet
linear-attention layers (:mod:`specray.models.gated_deltanet`: a recurrent state per request) and attention layers,
on Qwen3.5's hybrid stack (:mod:`specray.models.qwen3_5`), with Flint's mixture of experts on every layer.

Where it differs from Qwen3-Next:

* three kinds of layer (``layer_types``, the releases' period of five: linear, sliding, linear, full, sliding): Gated
  DeltaNet, sliding-window attention (``sliding_window``) rotated by RoPE over the whole head, and global attention
  with no positional encoding at all (NoPE);
* the attention layers are Qwen3's: ``q_proj`` gives the queries alone (no output gate), an RMSNorm over each query
  and key head;
* every RMSNorm scales by its plain weight, applied in float32 before the cast back (Helium's), not by ``1 + weight``;
  the linear layers' gated norm applies its weight and its ``silu(z)`` gate in float32 too (GLM-5-Next's);
* every layer's MLP is Flint's sparse block with Lara's router: a softmax over the experts of router logits computed
  in float32, the top k renormalised where ``norm_topk_prob``, and a shared expert added whole (no sigmoid gate);
* the releases fuse each linear layer's input projections into one ``in_proj`` (rows ``[q | k | v | z | b | a]``) and
  name its gated norm ``out_norm`` (transformers splits and renames them as it loads, and fuses them back as it saves):
  split and renamed here as they load. There is no MTP layer.

Otherwise the layers are Qwen3.5's (``x + mixer(norm(x))``, then ``x + mlp(norm(x))``), and the model is served as the
family's: n-gram chains and trees over the recurrent state, chunked prefill, preemption, prefix caching with state
snapshots, TP over the heads of both kinds of layer and the experts' widths.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.gated_deltanet import GatedDeltaNet, GatedRMSNorm
from specray.models.layers import (RMSNorm, RotaryEmbedding, VocabParallelEmbedding, materialize, max_positions,
                                   rope_parameters)
from specray.models.llama import LlamaAttention, _head_dim
from specray.models.moe import FAMILIES, MoEFamily, SparseMoE
from specray.models.qwen3_5 import HybridDecoderLayer, HybridModel, Qwen3_5ForCausalLM
from specray.parallel import PPGroup, TPGroup

LAYER_TYPES = ("linear_attention", "sliding_attention", "full_attention")
# the router's softmax top k (route, below, computes it in float32) and a shared expert added whole: Flint's block
FAMILIES["lara_mini"] = MoEFamily("softmax", "num_experts", "moe_intermediate_size", shared="shared_expert",
                                  shared_width="shared_expert_intermediate_size", shared_count=None)
# the release's gated norm of the linear layers -> ours
_RENAMES = ((re.compile(r"\.linear_attn\.out_norm\."), ".linear_attn.norm."),)
# the release's fused ``in_proj`` rows, in order: our projections (their sizes: _in_proj_sizes)
IN_PROJ_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


class Fp32RMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies in float32 before the cast back to the input's dtype (Helium's; the plain
    :class:`~specray.models.layers.RMSNorm` casts first, then multiplies in the input's dtype: equal in float32)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., H] -> [..., H]
        if x.dtype == torch.float32:
            return super()._norm(x)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class Fp32GatedRMSNorm(GatedRMSNorm):
    """``rmsnorm(x) * weight * silu(gate)`` all in float32, cast back once at the end (GLM-5-Next's gated norm)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate: [..., size] -> [..., size]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf * F.silu(gate.float())).to(x.dtype)


class LaraGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's Gated DeltaNet with the float32 gated norm."""

    def __init__(self, config, tp: TPGroup):
        super().__init__(config, tp)
        self.norm = Fp32GatedRMSNorm(self.dv, config.rms_norm_eps)


class LaraMiniAttention(LlamaAttention):
    """Qwen3's attention (q/k norms over each head, no output gate) over this rank's heads: a sliding window and RoPE
    on the ``sliding_attention`` layers, neither on the ``full_attention`` ones."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)  # (its sliding window by layer_types: _sliding_window)
        self.q_norm = Fp32RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Fp32RMSNorm(self.head_dim, config.rms_norm_eps)
        self.use_rope = config.layer_types[layer] == "sliding_attention"


class LaraMiniMoE(SparseMoE):
    """Flint's sparse block (experts and a shared expert added whole: the ``lara_mini`` row) with Lara's router."""

    def route(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k]): the top k of softmax(x W^T), the logits
        computed in float32 (Qwen3-Next's are in x's dtype), renormalised over the chosen where norm_topk_prob."""
        probs = F.softmax(F.linear(x.float(), self.router_module.weight.float()), dim=-1)  # [T, E]
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class LaraMiniDecoderLayer(HybridDecoderLayer):
    """Qwen3.5's hybrid layer with Lara's mixers, norms and experts (module docstring)."""

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        nn.Module.__init__(self)
        self.layer_type = config.layer_types[layer]
        if self.layer_type == "linear_attention":
            self.linear_attn = LaraGatedDeltaNet(config, tp)
        else:
            self.self_attn = LaraMiniAttention(config, tp, layer)
        self.mlp = LaraMiniMoE(config, tp, expert_parallel)
        self.input_layernorm = Fp32RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Fp32RMSNorm(config.hidden_size, config.rms_norm_eps)


def check_config(config) -> None:
    """ValueError for a Lara Mini config this module does not build (what to change in it)."""
    kinds = list(config.layer_types or [])
    if len(kinds) != config.num_hidden_layers or not set(kinds) <= set(LAYER_TYPES):
        raise ValueError(f"layer_types={kinds} must name one of {list(LAYER_TYPES)} for each of the "
                         f"num_hidden_layers={config.num_hidden_layers} layers; fix config.json's layer_types")
    if "sliding_attention" in kinds and not getattr(config, "sliding_window", None):
        raise ValueError(f"sliding_window={getattr(config, 'sliding_window', None)!r} but layer_types has "
                         "'sliding_attention' layers: give config.json a sliding_window (512 in the releases)")
    if not getattr(config, "num_experts", 0):
        raise ValueError(f"num_experts={getattr(config, 'num_experts', None)!r}: every Lara Mini layer's MLP is a "
                         "mixture of experts; give config.json num_experts >= num_experts_per_tok")


class LaraMiniModel(HybridModel):
    """The decoder stack: Qwen3.5's (:class:`~specray.models.qwen3_5.HybridModel`'s forward), Lara's layers and final
    norm, and one RoPE table over the whole head (the sliding layers' alone read it)."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)
        check_config(config)
        self.build_stage(config, pp, lambda i: LaraMiniDecoderLayer(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: Fp32RMSNorm(config.hidden_size, config.rms_norm_eps))
        # transformers' Lara builds its table for the whole head whatever else rope_parameters says: a partial
        # factor is refused here (rope_parameters' ValueError) rather than read otherwise
        self.rotary_emb = RotaryEmbedding(_head_dim(config), rope_parameters(config), max_positions(config))


class LaraMiniForCausalLM(Qwen3_5ForCausalLM):
    """Lara Mini for causal LM, sharded over ``tp`` (the linear layers' key and value heads, the attention heads and
    the experts' widths, or whole experts with expert parallelism) and ``pp`` (Qwen3.5's stages)."""

    model_class = LaraMiniModel
    # LoRA on the attention layers' q/k/v/o, the linear layers' projections (an adapter of the release's fused
    # in_proj has its B split as the weight is: adapter_fusions, split_adapter) and out_proj, and the shared experts:
    # all of them plain linears; not conv1d, the router or the experts
    lora_modules: tuple[str, ...] = Qwen3_5ForCausalLM.lora_modules

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.renames = _RENAMES

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False) -> tuple[nn.Module, nn.Module]:
        raise ValueError("model_type='lara_mini' has no multi-token-prediction layer (its releases ship none): "
                         "method='mtp' cannot draft for it; use method='ngram' (chains or trees)")

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The checkpoint's tensors, each linear layer's fused ``in_proj`` split into our projections (a folder whose
        projections are already apart passes as it is)."""
        for name, tensor in weights:
            if ".linear_attn.in_proj." in name:
                yield from self._split_in_proj(name, materialize(tensor))
            else:
                yield name, tensor

    def _in_proj_sizes(self) -> list[int]:
        c = self.config
        key, value = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
        return [2 * key + value, value, c.linear_num_value_heads, c.linear_num_value_heads]

    def _split_in_proj(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The release's ``in_proj`` [2 key + 2 value + 2 Hv, H] (rows q | k | v | z | b | a) as ``in_proj_qkv``,
        ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``."""
        sizes = self._in_proj_sizes()
        if w.shape[0] != sum(sizes):
            raise ValueError(f"{name} has {w.shape[0]} rows but the config's linear heads need {sum(sizes)} (q, k, v, "
                             f"z, b, a: {sizes}); the checkpoint does not match its config.json's linear_num_key_heads"
                             ", linear_num_value_heads, linear_key_head_dim or linear_value_head_dim")
        for part, rows in zip(IN_PROJ_PARTS, w.split(sizes)):
            yield name.replace(".in_proj.", f".{part}."), rows

    # ---- LoRA adapters of the release's fused in_proj: their B split as the weight is (A is shared)

    def adapter_fusions(self) -> dict[str, tuple[int, int]]:
        """Each linear layer's fused checkpoint ``in_proj`` an adapter may name, with its weight's (out, in) shape
        (built whole, one rank): :func:`specray.models.lora.adapter_shapes` adds them."""
        shapes = {}
        for i, layer in self.model.stage_layers():
            attn = getattr(layer, "linear_attn", None)
            if attn is not None:
                shapes[f"model.layers.{i}.linear_attn.in_proj"] = (sum(self._in_proj_sizes()),
                                                                   attn.in_proj_z.in_features)
        return shapes

    def split_adapter(self, module: str, lora_b: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """An adapter's B of a fused ``in_proj`` as its parts' (our projections' names, with a trailing dot, as
        :func:`specray.models.llama.unfuse` names them), or None for any other module."""
        if not module.endswith(".linear_attn.in_proj"):
            return None
        return list(self._split_in_proj(f"{module}.", lora_b))  # (names as "....in_proj_qkv.")
