"""Dory (``DoryForCausalLM``): a looped normalized transformer (nGPT) on the Llama plumbing
(:mod:`specray.models.llama`: weights, the interface) with a stack of its own. Where it differs from Llama:

* every norm is a weightless L2 norm (``x / sqrt(sum(x^2) + 1e-6)``, float32): hidden states live on the unit sphere,
  and a layer moves the normed stream towards each block's normed output at a learned rate per channel,
  ``h + |lambda * alpha_init / init| * (norm(block(h)) - h)``, instead of adding it;
* attention (Trinity's output gate, sliding and full layers by ``layer_types``, a RoPE per kind): queries and keys
  L2-normed per head before RoPE, the queries then scaled per feature by ``(sqk * sqrt(D) / init)^2``, the output gated
  by ``sigmoid(g * (s_gate * H^(1/4) / init)^2)`` and L2-normed over all heads before ``o_proj`` (over TP ranks: the
  squares summed by one all-reduce of [T, 1]);
* the SwiGLU MLP's gate and up scaled per feature (``suv_gate``, ``suv_up`` times ``sqrt(H)``) and its product L2-normed
  over the whole intermediate width before ``down_proj`` (the squares all-reduced likewise);
* ``n_input_layers`` layers, then the ``n_recurrent_layers`` after them run ``n_recurrent_loops`` times (each loop
  starting from ``norm(h) + norm(h_in)``, h_in the input section's output), then ``n_output_layers`` layers;
* the LM head's logits (float32) scaled per vocabulary entry by ``logit_scale / init``.

KV cache (``recurrent_kv_cache_mode``): ``"per_loop"`` (the default) gives each loop's run of a recurrent layer its own
K/V, which is an ordinary unrolled stack: each run is an attention layer of the cache (:meth:`kv_cache_specs` lists a
recurrent layer's loops one after another), so chunked prefill, prefix caching, preemption, drafts, trees and graph
steps are exact. ``"last_loop"`` is refused: there only the last loop writes the cache and the earlier loops attend to
that loop's K/V of earlier steps' tokens but to their own loop's K/V of the step's tokens, so a token's logits depend
on which tokens shared its step (a prefill in one chunk or several, a verified draft chain or one token at a time) and
no schedule-free answer exists to serve. Pipeline stages are refused (the loops run the recurrent section again after
later layers); so are hidden-state draft heads and LoRA (not written)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.kv_cache import KVCache, KVCacheSpec
from specray.models.layers import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                   VocabParallelEmbedding, _copy, _param, apply_rotary, divide, narrow,
                                   rope_parameters)
from specray.models.llama import LlamaForCausalLM, StageModel, _kv_spec, attention_projections
from specray.models.olmo3 import RopePerKind
from specray.parallel import PPGroup, TPGroup

L2_EPS = 1e-6  # transformers' DoryL2Norm



def _pair_collapsed(match: re.Match) -> str:
    """A release's block name (each layer an attention block ``layers.2i`` and an MLP block ``layers.2i+1``, their
    modules under ``mixer``, the rates ``attn_alpha`` / ``mlp_alpha``) as the layer's."""
    index, part = int(match[2]), match[3]
    name = {"attn_alpha": "lambda_1", "mlp_alpha": "lambda_2"}.get(part, ("self_attn", "mlp")[index % 2])
    return f"{match[1]}.layers.{index // 2}.{name}"


# checkpoint names for ours: the release's two blocks per layer, its ``backbone.`` and ``embeddings`` (also what
# transformers saves, which keeps one block per layer), and transformers' modules' name of the attention gate (whose
# ``gate_proj`` would read as the MLP's half of gate_up_proj; the release's ``g_proj`` is ours)
_RENAMES = ((re.compile(r"^(backbone|model)\.layers\.(\d+)\.(mixer|attn_alpha|mlp_alpha)(?=\.|$)"), _pair_collapsed),
            (re.compile(r"^backbone\."), "model."), (re.compile(r"^model\.embeddings\."), "model.embed_tokens."),
            (re.compile(r"\.self_attn\.gate_proj\."), ".self_attn.g_proj."))


def l2_normed(x: torch.Tensor, tp: TPGroup | None = None) -> torch.Tensor:
    """``x`` over its last dim divided by its L2 norm (float32, back to x's dtype); ``tp``: that dim is split over the
    ranks, whose squares are summed."""
    xf = x.float()
    squares = xf.square().sum(-1, keepdim=True)
    if tp is not None and tp.size > 1:
        squares = tp.all_reduce(squares)
    return (xf * torch.rsqrt(squares + L2_EPS)).to(x.dtype)


class L2Norm(nn.Module):
    """The weightless L2 norm of a hidden state [T, H]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return l2_normed(x)


def rank_slice(size: int, start: int) -> nn.Parameter:
    """A per-feature parameter holding this rank's ``size`` features from ``start`` of the checkpoint's vector."""
    param = _param(size)

    def load(p: nn.Parameter, loaded: Any) -> None:
        _copy(p, narrow(loaded, 0, start, size))

    param.weight_loader = load
    return param


def check_config(config) -> None:
    """What the family serves of a config (ValueErrors naming the field and the fix)."""
    mode = getattr(config, "recurrent_kv_cache_mode", "per_loop")
    if mode != "per_loop":
        raise ValueError(f"recurrent_kv_cache_mode={mode!r} is not supported for model_type='dory': only the last loop "
                         "writes the cache there and earlier loops read its K/V of past steps' tokens but their own "
                         "of the current step's, so the logits depend on how tokens are grouped into steps (chunked "
                         "prefill, verified drafts) and cannot be served exactly; use 'per_loop' (one cache per loop)")
    sections = (config.n_input_layers, config.n_recurrent_layers, config.n_output_layers)
    if min(sections) < 0 or sum(sections) != config.num_hidden_layers or config.n_recurrent_loops < 1:
        raise ValueError(f"n_input_layers={sections[0]}, n_recurrent_layers={sections[1]}, n_output_layers="
                         f"{sections[2]}, n_recurrent_loops={config.n_recurrent_loops}: the sections must add up to "
                         f"num_hidden_layers={config.num_hidden_layers}, with at least one loop")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r} is not supported for model_type='dory'; 'silu' is")
    for kind in set(config.layer_types):
        rope_parameters(config, kind)  # (a partial_rotary_factor refused: Dory rotates the whole head)


class DoryAttention(nn.Module):
    """nGPT's gated attention; one paged attention (its own K/V) per run of the layer (``runs``: the loops of a
    recurrent layer, else 1), all sharing the projections."""

    def __init__(self, config, tp: TPGroup, layer: int, runs: int):
        super().__init__()
        head_dim = attention_projections(self, config, tp)
        self.tp = tp
        self.sizes = (self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size)
        width, start = config.num_attention_heads * head_dim, tp.rank * self.qkv_proj.q_size
        self.g_proj = ColumnParallelLinear(config.hidden_size, width, tp)
        self.sqk, self.s_gate = rank_slice(self.sizes[0], start), rank_slice(self.sizes[0], start)
        self.sqk_scale = head_dim**0.5 / config.initializer_range
        self.s_gate_scale = config.hidden_size**0.25 / config.initializer_range
        spec = _kv_spec(config, layer, self.qkv_proj)
        self.attns = nn.ModuleList([PagedAttention(self.num_heads, spec, head_dim**-0.5) for _ in range(runs)])

    @property
    def attn(self) -> PagedAttention:
        """The first run's attention."""
        return self.attns[0]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                run: int = 0) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, 1, D/2] -> [T, H], attending over run ``run``'s K/V
        t, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        qk = torch.cat((l2_normed(q.view(t, heads, d)), l2_normed(k.view(t, kv_heads, d))), dim=1)
        qk = apply_rotary(qk, cos, sin)
        q = qk[:, :heads] * (self.sqk * self.sqk_scale).square().view(heads, d)
        out = self.attns[run](q, qk[:, heads:], v.view(t, kv_heads, d), meta)  # [T, heads * D]
        out = out * torch.sigmoid(self.g_proj(x) * (self.s_gate * self.s_gate_scale).square())
        return self.o_proj(l2_normed(out, self.tp))


class DoryMLP(nn.Module):
    """``down(norm(silu(gate * s_gate) * (up * s_up)))``, the norm over the whole intermediate width."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        inter, bias = config.intermediate_size, bool(getattr(config, "mlp_bias", False))
        self.tp = tp
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], tp, bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, tp, bias=bias)
        local = divide(inter, tp.size, "intermediate_size")
        self.suv_gate, self.suv_up = rank_slice(local, tp.rank * local), rank_slice(local, tp.rank * local)
        self.suv_scale = config.hidden_size**0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        h = F.silu(gate * (self.suv_gate * self.suv_scale)) * (up * (self.suv_up * self.suv_scale))
        return self.down_proj(l2_normed(h, self.tp))


class DoryDecoderLayer(nn.Module):
    """nGPT's layer: the normed stream moved towards each block's normed output at a learned rate per channel."""

    def __init__(self, config, tp: TPGroup, layer: int, runs: int):
        super().__init__()
        self.self_attn = DoryAttention(config, tp, layer, runs)
        self.mlp = DoryMLP(config, tp)
        self.lambda_1, self.lambda_2 = _param(config.hidden_size), _param(config.hidden_size)
        self.lambda_scale = config.ngpt_alpha_init / config.initializer_range

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                run: int = 0) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        x = l2_normed(x)
        x = x + (self.lambda_1 * self.lambda_scale).abs() * (l2_normed(self.self_attn(x, cos, sin, meta, run)) - x)
        x = l2_normed(x)
        return x + (self.lambda_2 * self.lambda_scale).abs() * (l2_normed(self.mlp(x)) - x)


class DoryModel(RopePerKind, StageModel):
    """The input layers, the recurrent ones looped, the output layers, an L2 norm; one stage."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        nn.Module.__init__(self)
        check_config(config)
        self.build_ropes(config)
        start, count = config.n_input_layers, config.n_recurrent_layers
        self.recurrent, self.loops = range(start, start + count), config.n_recurrent_loops
        self.build_stage(config, pp, lambda i: DoryDecoderLayer(config, tp, i, self.runs(i)),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp), L2Norm)

    def runs(self, layer: int) -> int:
        """How many times layer ``layer`` runs in a step (each run with its own K/V)."""
        return self.loops if layer in self.recurrent else 1

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # input_ids: [T] -> hidden [T, H] (normed)
        if aux_layers:
            raise ValueError(f"aux_layers={tuple(aux_layers)}: Dory hands no hidden states to a draft head")
        rope = self.rope_tables(meta, self.layers[0].lambda_1.dtype)
        x = self.embed_tokens(input_ids)
        first = self.recurrent.start
        for i in range(first):
            x = self.layers[i](x, *rope(i), meta)
        entry = l2_normed(x)  # each loop restarts from the input section's output
        for run in range(self.loops):
            x = l2_normed(x) + entry
            for i in self.recurrent:
                x = self.layers[i](x, *rope(i), meta, run)
        for i in range(self.recurrent.stop, len(self.layers)):
            x = self.layers[i](x, *rope(i), meta)
        return self.norm(x), []


class DoryLMHead(ParallelLMHead):
    """The head with a learned scale per vocabulary entry (``logit_scale``, whole on every rank), float32 logits."""

    def __init__(self, config, tp: TPGroup):
        super().__init__(config.vocab_size, config.hidden_size, tp)
        self.logit_scale = _param(config.vocab_size)
        self.logit_scale_factor = 1 / config.initializer_range

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> [N, V] float32
        return super().forward(hidden).float() * (self.logit_scale.float() * self.logit_scale_factor)


class RunsKVCache:
    """A model whose attention layers run several times a step, each run over its own K/V (its layers'
    ``self_attn.attns``, one paged attention per run): an unrolled stack to the cache (Dory's loops, HRM-Text's
    cycles)."""

    def _runs(self) -> list[PagedAttention]:
        return [attn for _, layer in self.model.stage_layers() for attn in layer.self_attn.attns]

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One spec per run of an attention layer: layer by layer, a layer's runs in order."""
        return [attn.kv_spec for attn in self._runs()]

    def bind_kv_cache(self, cache: KVCache) -> None:
        assert cache.specs == self.kv_cache_specs(), "the cache was allocated for another model's specs"
        for j, attn in enumerate(self._runs()):
            attn.bind_cache(cache.layer(j), cache.block_size, cache.fp8)
        self.kv_cache_allocated = True


class DoryForCausalLM(RunsKVCache, LlamaForCausalLM):
    """Dory for causal LM, sharded over ``tp`` (heads, the MLP's width, the head's rows); one pipeline stage."""

    model_class = DoryModel
    one_stage = "its recurrent section runs again after later layers in every step (n_recurrent_loops)"
    serves_heads = False  # no hidden-state draft head (specray.engine.builder.check_heads_served)
    lora_modules = ()  # LoRA is not written for Dory (enable_lora is refused by name)

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        self.check_split(hf_config, (tp or TPGroup.single()).size, (pp or PPGroup.single()).size)
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.renames = _RENAMES
        tied = self.shares_embedding
        self.lm_head = DoryLMHead(hf_config, self.tp)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        """A config the family serves (before any rank starts; one pipeline stage: one_stage)."""
        check_config(config)

    def _a_norm(self) -> torch.Tensor:
        return self.model.layers[0].lambda_1

