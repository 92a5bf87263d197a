"""JetMoE (``JetMoeForCausalLM``: JetMoE-8B, JetMoE-8B-chat): a pre-norm decoder whose attention and MLP are both
sparse mixtures of experts, each with its own top-k router (the top k router logits, softmaxed among themselves).

* Attention is a mixture of attention heads (MoA): K and V come from one shared projection (``kv_proj``, fused
  [2 Hkv D, H]), and every token's query and output projections are those of the ``num_experts_per_tok`` experts its
  router picks (``experts.input_linear`` [E, Hkv D, H], ``experts.output_linear`` [E, H, Hkv D]). Choice j of a token
  gives Hkv query heads, query head (j, h) attending over KV head h, so a layer attends with k Hkv query heads over Hkv
  KV heads; the chosen experts' output projections of their heads' outputs, weighted by the router, are summed, and a
  bias [H] is added.
* The MLP is a mixture of SwiGLU experts (``input_linear`` [E, 2I, H], gate rows then up rows; ``output_linear``
  [E, H, I]) with the same kind of router, and a bias [H] added after the sum: :mod:`specray.models.moe`'s
  ``jetmoe`` row (Granite's MoE routing and fused layout), :class:`JetMoeMLP`.
* Each layer's two norms take eps 1e-6 whatever the config says (transformers builds them so); the final norm takes
  ``rms_norm_eps``.

Everything else is Llama's plumbing (:mod:`specray.models.llama`): the stack, RoPE, the paged K/V cache
(:class:`~specray.models.attention.PagedAttention` with the query heads ordered KV head by KV head, so its grouped
heads are MoA's), loading, pipeline stages.

The MoA's experts are computed densely on every path: every expert's query projection of every token in one matmul,
the chosen ones gathered; the outputs scattered (weighted) into an [T, E, Hkv D] buffer that is zero where an expert was
not chosen and projected back in one matmul. That is E / k times the FLOPs of the routed projections (4x for the 8B
release's 8 experts, top 2), but it is exact, has shapes fixed by T (no host sync: a graph step captures it) and needs
no grouping. Over tensor-parallel ranks the KV heads split, and with them each expert's query rows and output columns
(the router and the biases are replicated; the output is one all-reduce).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.fp8 import config_quantization
from specray.models.kv_cache import FullAttentionSpec
from specray.models.layers import (MergedColumnParallelLinear, RMSNorm, _copy, _param, apply_rotary, divide, linear,
                                   materialize, narrow, shape_of)
from specray.models.llama import _CHECKPOINT_NAMES, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from specray.models.moe import FAMILIES, MoEFamily, SparseMoE
from specray.parallel import PPGroup, TPGroup

logger = logging.getLogger(__name__)

# the MLP's experts: Granite's MoE routing (the top k router logits softmaxed) over num_local_experts SwiGLU experts
FAMILIES["jetmoe"] = MoEFamily("topk_softmax", "num_local_experts", "intermediate_size", router="router")
# the release's names -> ours: the attention module is ``self_attention``; both routers' weights sit under
# ``router.layer``; the MLP's fused experts are Granite's (input_linear [E, 2I, H], output_linear [E, H, I]); the MoA's
# expert projections are parameters of the MoA module itself
_CHECKPOINT_NAMES["jetmoe"] = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.self_attention\.", ".self_attn."),
    (r"\.router\.layer\.weight$", ".router.weight"),
    (r"\.mlp\.input_linear\.weight$", ".mlp.experts.gate_up_proj"),
    (r"\.mlp\.output_linear\.weight$", ".mlp.experts.down_proj"),
    (r"\.self_attn\.experts\.(input|output)_linear\.weight$", r".self_attn.experts.\1_linear")))

LAYER_NORM_EPS = 1e-6  # the layers' norms' eps in transformers' JetMoE (its rms_norm_eps reaches the final norm alone)


def _check_config(config) -> None:
    """Refuse what JetMoE's layers here do not implement, by field."""
    act = getattr(config, "activation_function", "silu")
    if act != "silu":
        raise ValueError(f"activation_function={act!r} is not supported for model_type='jetmoe': its experts are "
                         "SwiGLU with silu here (the releases' value); use 'silu'")
    quant = config_quantization(config)
    if quant is not None:
        raise ValueError(f"quantization_config={quant!r} is not supported for model_type='jetmoe' (its mixture of "
                         "attention heads keeps its expert projections in the model's dtype); load a full-precision "
                         "checkpoint")
    if not 0 < config.num_experts_per_tok <= config.num_local_experts:
        raise ValueError(f"num_experts_per_tok={config.num_experts_per_tok} with num_local_experts="
                         f"{config.num_local_experts}: each token takes 1 .. num_local_experts experts")
    heads = getattr(config, "num_attention_heads", None)
    if heads is not None and heads != config.num_key_value_heads * config.num_experts_per_tok:
        raise ValueError(f"num_attention_heads={heads}: JetMoE's query heads are num_key_value_heads * "
                         f"num_experts_per_tok = {config.num_key_value_heads * config.num_experts_per_tok}; leave it "
                         "out of config.json (transformers derives it)")


class FusedKVLinear(MergedColumnParallelLinear):
    """K and V projected in one matmul from the checkpoint's one fused ``kv_proj`` [2 Hkv D, H]: this rank's KV heads'
    rows of each half (its output: this rank's K, then its V)."""

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int | None = None) -> None:
        if shard_id is not None:
            super().weight_loader(param, loaded, shard_id)
            return
        rows, half = shape_of(loaded)[0], self.output_sizes[0]
        if rows != 2 * half:
            raise ValueError(f"kv_proj has {rows} rows where num_key_value_heads * kv_channels * 2 = {2 * half}: the "
                             "checkpoint does not match its config.json")
        for shard in (0, 1):
            super().weight_loader(param, narrow(loaded, 0, shard * half, half), shard)


class MixtureOfAttentionHeads(nn.Module):
    """MoA's router and expert projections, this rank's heads' share of each expert: ``input_linear``
    [E * Hkv_local * D, H] (expert by expert, each its heads' query rows) and ``output_linear`` [H, E * Hkv_local * D]
    (expert by expert, each its heads' input columns), so that one matmul runs every expert (module docstring)."""

    def __init__(self, config, tp: TPGroup, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.tp = tp
        self.num_experts, self.top_k = config.num_local_experts, config.num_experts_per_tok
        self.width = num_kv_heads * head_dim  # this rank's query width per expert
        self.start = tp.rank * self.width  # its first query row of an expert's projection
        h, e, n = config.hidden_size, self.num_experts, self.width
        self.input_linear = _param(e * n, h)
        self.output_linear = _param(h, e * n)
        self.input_linear.weight_loader = self._load_input
        self.output_linear.weight_loader = self._load_output
        self.router = nn.Module()
        self.router.weight = _param(e, h)  # replicated
        self.bias = _param(h)  # added once, after the sum over ranks

    def _load_input(self, param: nn.Parameter, loaded: Any) -> None:
        # [E, Hkv D, H]: each expert's rows of this rank's heads
        e, n, h = self.num_experts, self.width, param.shape[1]
        if shape_of(loaded)[0] != e or shape_of(loaded)[2] != h:
            raise ValueError(f"self_attention.experts.input_linear of shape {shape_of(loaded)} does not fit "
                             f"[num_local_experts={e}, num_key_value_heads * kv_channels, hidden_size={h}]")
        _copy(param.data.view(e, n, h), narrow(loaded, 1, self.start, n))

    def _load_output(self, param: nn.Parameter, loaded: Any) -> None:
        # [E, H, Hkv D]: each expert's columns of this rank's heads, laid expert after expert along ours
        e, n, h = self.num_experts, self.width, param.shape[0]
        if shape_of(loaded)[0] != e or shape_of(loaded)[1] != h:
            raise ValueError(f"self_attention.experts.output_linear of shape {shape_of(loaded)} does not fit "
                             f"[num_local_experts={e}, hidden_size={h}, num_key_value_heads * kv_channels]")
        value = materialize(narrow(loaded, 2, self.start, n))
        _copy(param.data.view(h, e, n), value.transpose(0, 1))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k]): the top k router logits, softmaxed."""
        logits, ids = linear(x, self.router.weight).float().topk(self.top_k, dim=-1)
        return torch.softmax(logits, dim=-1).to(x.dtype), ids

    def queries(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The chosen experts' queries [T, k, Hkv_local * D] of x [T, H] (choice j: expert ids[:, j]'s)."""
        every = linear(x, self.input_linear).view(x.shape[0], self.num_experts, self.width)
        return every.gather(1, ids[:, :, None].expand(-1, -1, self.width))

    def partial(self, out: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share [T, H] of the chosen experts' output projections of their heads' outputs ``out``
        [T, k, Hkv_local * D], weighted (before the sum over ranks and the bias)."""
        t = out.shape[0]
        spread = out.new_zeros(t, self.num_experts, self.width)  # expert e's input: zeros where not chosen
        spread.scatter_(1, ids[:, :, None].expand(-1, -1, self.width), out * weights[:, :, None])
        return linear(spread.view(t, -1), self.output_linear)


class JetMoeAttention(nn.Module):
    """JetMoE's mixture of attention heads over this rank's KV heads (module docstring): query heads ordered KV head
    by KV head (head h k + j: choice j over KV head h), as :class:`PagedAttention`'s grouped heads are."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__()
        _check_config(config)
        self.head_dim = d = config.kv_channels
        hkv = config.num_key_value_heads
        self.num_kv_heads = divide(hkv, tp.size, "num_key_value_heads")
        self.top_k = config.num_experts_per_tok
        self.num_heads = self.num_kv_heads * self.top_k
        self.tp = tp
        self.kv_proj = FusedKVLinear(config.hidden_size, [hkv * d, hkv * d], tp)
        self.experts = MixtureOfAttentionHeads(config, tp, self.num_kv_heads, d)
        spec = FullAttentionSpec(num_kv_heads=self.num_kv_heads, head_dim=d, kv_head_start=tp.rank * self.num_kv_heads)
        self.attn = PagedAttention(self.num_heads, spec, d ** -0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, 1, D/2] -> [T, H]
        t, hkv, k, d = x.shape[0], self.num_kv_heads, self.top_k, self.head_dim
        weights, ids = self.experts.route(x)
        q = self.experts.queries(x, ids).view(t, k, hkv, d).transpose(1, 2).reshape(t, hkv * k, d)
        key, v = self.kv_proj(x).view(t, 2, hkv, d).unbind(1)
        qk = apply_rotary(torch.cat((q, key), dim=1), cos, sin)  # q and k rotated in one go
        out = self.attn(qk[:, : hkv * k], qk[:, hkv * k:], v.contiguous(), meta)  # [T, Hkv k D]
        out = out.view(t, hkv, k, d).transpose(1, 2).reshape(t, k, hkv * d)  # back to choice by choice
        return self.tp.all_reduce(self.experts.partial(out, weights, ids)) + self.experts.bias


class JetMoeMLP(SparseMoE):
    """JetMoE's MLP: :class:`SparseMoE` (the ``jetmoe`` row) and a bias [H] added after the sum over ranks."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False):
        super().__init__(config, tp, expert_parallel)
        self.bias = _param(config.hidden_size)

    def forward(self, x: torch.Tensor, router_input: torch.Tensor | None = None,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, router_input, token_ids) + self.bias


class JetMoeDecoderLayer(LlamaDecoderLayer):
    attention_class = JetMoeAttention

    @staticmethod
    def build_norm(config) -> nn.Module:
        return RMSNorm(config.hidden_size, LAYER_NORM_EPS)

    @classmethod
    def build_mlp(cls, config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        return JetMoeMLP(config, tp, expert_parallel)


class JetMoeModel(LlamaModel):
    layer_class = JetMoeDecoderLayer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        _check_config(config)
        super().__init__(config, tp, expert_parallel, pp)

    @classmethod
    def final_norm(cls, config) -> nn.Module:
        return RMSNorm(config.hidden_size, config.rms_norm_eps)


class JetMoeForCausalLM(LlamaForCausalLM):
    """JetMoE for causal LM, sharded over ``tp`` (KV heads and each MoA expert's heads split; the MLP's experts split
    by width, or whole with ``expert_parallel``) and ``pp``."""

    model_class = JetMoeModel
    lora_modules = ()  # LoRA is not written for JetMoE's expert projections (enable_lora is refused by name)
