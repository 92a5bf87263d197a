"""DiffLlama (``DiffLlamaForCausalLM``): Llama with differential attention, on the Llama plumbing
(:mod:`specray.models.llama`).

Where it differs from Llama: each layer's attention output for head ``m`` of the first half of the query heads is
``(A_m - lambda * A_{m + H/2}) [v_j ; v_{j + Hkv/2}]`` (``j`` the KV head of ``m`` modulo Hkv/2, ``A`` a head's
softmax map over its own key head), RMS-normed over its ``2 D`` features (no weight), scaled by ``1 - lambda_init``
and projected by ``o_proj`` (``H/2`` heads of ``2 D``). ``lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init``
from four learned vectors per layer; ``lambda_init = 0.8 - 0.6 exp(-0.3 layer)``.

Both maps go through :class:`~specray.models.attention.PagedAttention` unchanged: KV heads ``p`` and ``p + Hkv/2``
are cached together as one "pair" head of ``2 D`` features (``[k_p ; k_{p+h}]``, ``[v_p ; v_{p+h}]``: the same bytes
as the two heads), and each query is widened to ``2 D`` with zeros over the other head's half (scale ``D^-1/2``),
so its scores are its own key head's and its output is its map times both value heads. Paging, chunked prefill,
drafts, trees, graph steps and an FP8 cache are the attention's as for any layer. The checkpoint's q/k/v rows are
put in pair order as they load (KV heads ``0, h, 1, h + 1, ...``, each query group after its KV head), so tensor
parallel ranks hold whole pairs and ``o_proj``'s input columns stay the checkpoint's."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.kv_cache import FullAttentionSpec
from specray.models.layers import _param, materialize
from specray.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, _head_dim
from specray.parallel import TPGroup

LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def lambda_init(layer: int) -> float:
    """The fixed part of layer ``layer``'s lambda (0-based layer index, as transformers counts)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer)


def check_config(config, tp: TPGroup) -> None:
    """What differential attention needs of the heads, and what this family does not serve, refused by name."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if kv % 2 or heads % kv:
        raise ValueError(f"num_key_value_heads={kv} (num_attention_heads={heads}): DiffLlama pairs KV head p with "
                         "p + num_key_value_heads/2, so it needs an even number of KV heads dividing the query heads")
    if (kv // 2) % tp.size:
        raise ValueError(f"tensor_parallel_size={tp.size} with num_key_value_heads={kv}: DiffLlama's ranks hold whole "
                         f"pairs of KV heads, so num_key_value_heads/2={kv // 2} must be a multiple of the ranks")
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout:
        raise ValueError(f"attention_dropout={dropout} is not supported for DiffLlama (inference has none); set 0.0")
    if getattr(config, "sliding_window", None) is not None:
        raise ValueError(f"sliding_window={config.sliding_window} is not supported for DiffLlama (transformers' "
                         "attends every earlier key); set it to null")


def pair_order(num_kv_heads: int, groups: int) -> tuple[list[int], list[int]]:
    """The checkpoint's query and KV head indices in pair order: KV heads ``0, h, 1, h + 1, ...`` (h = Hkv/2), and
    each KV head's ``groups`` query heads in that order."""
    h = num_kv_heads // 2
    kv = [p + s * h for p in range(h) for s in range(2)]
    return [j * groups + r for j in kv for r in range(groups)], kv


class DiffLlamaAttention(LlamaAttention):
    """Llama's projections and RoPE, the two maps of each output head attended over pair heads (module
    docstring)."""

    def __init__(self, config, tp: TPGroup, layer: int):
        check_config(config, tp)
        super().__init__(config, tp, layer)
        d = self.head_dim
        self.pairs = self.num_kv_heads // 2  # this rank's pair heads
        self.groups = self.num_heads // self.num_kv_heads
        for name in LAMBDAS:
            setattr(self, name, _param(d))
        self.lambda_init = lambda_init(layer)
        self.eps = config.rms_norm_eps
        spec = FullAttentionSpec(num_kv_heads=self.pairs, head_dim=2 * d,
                                 kv_head_start=self.qkv_proj.kv_head_start // 2)
        self.attn = PagedAttention(self.num_heads, spec, d**-0.5)

    def lambda_full(self, dtype: torch.dtype) -> torch.Tensor:
        """exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, the dot products in float32, the rest in ``dtype``."""
        one = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1, dtype=torch.float32)).to(dtype)
        two = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1, dtype=torch.float32)).to(dtype)
        return one - two + self.lambda_init

    def group_norm(self, out: torch.Tensor) -> torch.Tensor:
        """Each output head [..., 2 D] RMS-normed over its features, with no weight."""
        return F.rms_norm(out, (out.shape[-1],), eps=self.eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        q, k, v = self.project(x, cos, sin, meta)  # [T, Hq, D], [T, Hkv, D] in pair order
        t, d, p, g = x.shape[0], self.head_dim, self.pairs, self.groups
        q = q.view(t, p, 2, g, d)
        zeros = q.new_zeros(t, p, g, d)
        wide = torch.stack((torch.cat((q[:, :, 0], zeros), -1), torch.cat((zeros, q[:, :, 1]), -1)), dim=2)
        out = self.attn(wide.view(t, p * 2 * g, 2 * d), k.reshape(t, p, 2 * d), v.reshape(t, p, 2 * d), meta)
        out = out.view(t, p, 2, g, 2 * d)
        out = out[:, :, 0] - self.lambda_full(out.dtype) * out[:, :, 1]  # [T, P, g, 2D]: this rank's output heads
        out = self.group_norm(out) * (1 - self.lambda_init)
        return self.o_proj(out.reshape(t, p * g * 2 * d))


class DiffLlamaDecoderLayer(LlamaDecoderLayer):
    attention_class = DiffLlamaAttention


class DiffLlamaModel(LlamaModel):
    layer_class = DiffLlamaDecoderLayer


class DiffLlamaForCausalLM(LlamaForCausalLM):
    """DiffLlama for causal LM, sharded over ``tp`` (whole pairs of KV heads per rank) and ``pp`` as Llama is."""

    model_class = DiffLlamaModel
    # q/k/v load in pair order (an adapter's B would need the same permutation, which the LoRA loader does not do)
    lora_modules = ("o_proj", "gate_proj", "up_proj", "down_proj")

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        config = self.config
        d = _head_dim(config)
        q_order, kv_order = pair_order(config.num_key_value_heads,
                                       config.num_attention_heads // config.num_key_value_heads)
        for name, tensor in super()._unfused(weights):
            which = next((w for w in ("q_proj", "k_proj", "v_proj") if f".self_attn.{w}." in name), None)
            if which is None:
                yield name, tensor
                continue
            order = q_order if which == "q_proj" else kv_order
            value = materialize(tensor)
            yield name, value.view(len(order), d, *value.shape[1:])[order].reshape(value.shape)
