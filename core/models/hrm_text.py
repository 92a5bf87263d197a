"""Sapient's HRM-Text (``HrmTextForCausalLM``, model type ``hrm_text``: HRM-Text-1B), a hierarchical recurrent model on
the Llama plumbing (:mod:`specray.models.llama`: weights, the interface) with a stack of its own. Two stacks of
``num_layers_per_stack`` pre-norm layers each (weightless RMSNorms, nanochat's; multi-head attention with RoPE, its
output gated feature by feature by ``sigmoid(gate_proj(x))`` as Trinity's; Llama's SwiGLU MLP; a weightless RMSNorm
after the stack's last layer): the fast L stack and the slow H stack. With the embeddings scaled by
``embedding_scale`` as ``z_H`` and the learned ``z_L_init`` as ``z_L``, each of ``H_cycles`` cycles runs the L stack
``L_cycles`` times, ``z_L = L(z_L + z_H)``, then the H stack once, ``z_H = H(z_H + z_L)``; the LM head reads the last
``z_H``.

KV cache: transformers gives every run of a stack's layer its own cache slot (``cycle_offset``; its config's
``num_hidden_layers`` is that count, ``num_layers_per_stack * H_cycles * (L_cycles + 1)``), and each run attends
causally over its own K/V of every earlier token. So the recurrence is across depth within one token's step, never
across tokens: a token's K/V in run r follow from the tokens up to it alone, and the whole is an unrolled stack of
that many attention layers with shared weights. Here each run is a paged attention layer of its own
(:class:`specray.models.dory.RunsKVCache`: an L-stack layer's ``H_cycles * L_cycles`` runs, an H-stack layer's
``H_cycles``), so chunked prefill, prefix caching, preemption, rejected drafts, token trees (their K/V moved run by run
like any layer's) and graph steps are exact.

``prefix_lm`` lets transformers attend bidirectionally within a block of instruction tokens marked by
``token_type_ids``; a request here carries token ids alone, so every token is served causally, as transformers runs the
model without ``token_type_ids``. ``L_bp_cycles`` only routes gradients in training. Refused: pipeline stages (the
stacks run again after each other in every step), hidden-state draft heads and LoRA (not written).

The checkpoint: transformers' modules' names (``self_attn.{gate,q,k,v}_proj``, ``mlp.{gate,up}_proj``) or what
transformers saves, each attention's ``attn.gqkv_proj`` (gate, q, k and v stacked by rows), ``attn.o_proj`` and the
MLP's ``gate_up_proj`` (gate, then up)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.dory import RunsKVCache
from specray.models.layers import (ColumnParallelLinear, RotaryEmbedding, VocabParallelEmbedding, _param,
                                   apply_rotary, max_positions, rope_parameters)
from specray.models.llama import LlamaForCausalLM, LlamaMLP, _head_dim, _kv_spec, attention_projections
from specray.models.nanochat import WeightlessRMSNorm
from specray.models.plain_config import PlainConfig, plain_config
from specray.parallel import PPGroup, TPGroup

# transformers' saved names for ours (the fused projections are cut apart first: HrmTextForCausalLM.fused)
_RENAMES = ((re.compile(r"\.attn\.o_proj\."), ".self_attn.o_proj."),
            (re.compile(r"\.self_attn\.gate_proj\."), ".self_attn.g_proj."))


def hrm_view(config) -> PlainConfig:
    """A copy of ``config`` with the fields Llama's pieces read: every head a KV head (multi-head attention;
    transformers' config has no ``num_key_value_heads``)."""
    view = PlainConfig(**vars(plain_config(config)))
    view.num_key_value_heads = view.num_attention_heads
    return view


def check_config(config) -> None:
    """The cycles and stacks the family serves (ValueErrors naming the field and the fix)."""
    per_stack, high, low = config.num_layers_per_stack, config.H_cycles, config.L_cycles
    if not (isinstance(per_stack, int) and per_stack >= 1 and high >= 1 and low >= 0):
        raise ValueError(f"num_layers_per_stack={per_stack}, H_cycles={high}, L_cycles={low}: HRM-Text needs at least "
                         "one layer per stack, one H cycle and no negative L cycles")


class HrmTextAttention(nn.Module):
    """Multi-head attention with RoPE and a sigmoid gate per output feature; one paged attention (its own K/V) per
    run of the layer, all sharing the projections."""

    def __init__(self, config, tp: TPGroup, layer: int, runs: int):
        super().__init__()
        head_dim = attention_projections(self, config, tp)
        self.sizes = (self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size)
        self.g_proj = ColumnParallelLinear(config.hidden_size, config.num_attention_heads * head_dim, tp,
                                           bias=bool(getattr(config, "attention_bias", False)))
        spec = _kv_spec(config, layer, self.qkv_proj)
        self.attns = nn.ModuleList([PagedAttention(self.num_heads, spec, head_dim**-0.5) for _ in range(runs)])

    @property
    def attn(self) -> PagedAttention:
        """The first run's attention."""
        return self.attns[0]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                run: int) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, 1, D/2] -> [T, H], attending over run ``run``'s K/V
        t, heads, d = x.shape[0], self.num_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        qk = apply_rotary(torch.cat((q.view(t, heads, d), k.view(t, self.num_kv_heads, d)), dim=1), cos, sin)
        out = self.attns[run](qk[:, :heads], qk[:, heads:], v.view(t, self.num_kv_heads, d), meta)  # [T, heads * D]
        return self.o_proj(out * torch.sigmoid(self.g_proj(x)))


class HrmTextDecoderLayer(nn.Module):
    """A pre-norm layer with weightless RMSNorms: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``."""

    def __init__(self, config, tp: TPGroup, layer: int, runs: int):
        super().__init__()
        self.self_attn = HrmTextAttention(config, tp, layer, runs)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = WeightlessRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = WeightlessRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                run: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, run)
        return x + self.mlp(self.post_attention_layernorm(x))


class HrmTextStack(nn.Module):
    """One stack (L or H): its layers, then a weightless RMSNorm."""

    def __init__(self, config, tp: TPGroup, first: int, runs: int):
        super().__init__()
        self.layers = nn.ModuleList([HrmTextDecoderLayer(config, tp, first + i, runs)
                                     for i in range(config.num_layers_per_stack)])
        self.final_norm = WeightlessRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                run: int) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, cos, sin, meta, run)
        return self.final_norm(x)


class HrmTextModel(nn.Module):
    """The embedding, the L and H stacks and ``z_L_init``; one stage. Layer index i (for the cache's order) is the L
    stack's i-th layer below ``num_layers_per_stack``, the H stack's above."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__()
        check_config(config)
        self.high, self.low = config.H_cycles, config.L_cycles
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.embedding_scale = float(config.embedding_scale)
        self.L_module = HrmTextStack(config, tp, 0, self.high * self.low)
        self.H_module = HrmTextStack(config, tp, config.num_layers_per_stack, self.high)
        self.z_L_init = _param(config.hidden_size)
        rope = rope_parameters(config, partial=True)
        self.rotary_emb = RotaryEmbedding(_head_dim(config), rope, max_positions(config))

    @property
    def layers(self) -> list[HrmTextDecoderLayer]:
        """Every layer, the L stack's then the H stack's (a plain list: their parameters are the stacks')."""
        return [*self.L_module.layers, *self.H_module.layers]

    def stage_layers(self) -> list[tuple[int, HrmTextDecoderLayer]]:
        return list(enumerate(self.layers))

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # input_ids: [T] -> the last z_H [T, H] (normed by the H stack)
        if aux_layers:
            raise ValueError(f"aux_layers={tuple(aux_layers)}: HRM-Text hands no hidden states to a draft head")
        z_high = self.embed_tokens(input_ids) * self.embedding_scale
        self.rotary_emb.ensure(meta.max_position + 1)
        cos, sin = self.rotary_emb(meta.positions, z_high.dtype)
        z_low = self.z_L_init.to(z_high.dtype).expand_as(z_high)
        for cycle in range(self.high):
            for step in range(self.low):
                z_low = self.L_module(z_low + z_high, cos, sin, meta, cycle * self.low + step)
            z_high = self.H_module(z_high + z_low, cos, sin, meta, cycle)
        return z_high, []


class HrmTextForCausalLM(RunsKVCache, LlamaForCausalLM):
    """HRM-Text for causal LM, sharded over ``tp`` (heads, the MLP's width, the head's rows); one pipeline stage."""

    model_class = HrmTextModel
    one_stage = "its L and H stacks run in turn H_cycles times in every step"
    serves_heads = False  # no hidden-state draft head (specray.engine.builder.check_heads_served)
    lora_modules = ()  # LoRA is not written for HRM-Text (enable_lora is refused by name)

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        self.check_split(hf_config, (tp or TPGroup.single()).size, (pp or PPGroup.single()).size)
        view = hrm_view(hf_config)
        super().__init__(view, tp, expert_parallel, pp)
        self.renames = _RENAMES
        d, inter = _head_dim(view), view.intermediate_size
        width = view.num_attention_heads * d
        self.fused = {".attn.gqkv_proj.": tuple((f".self_attn.{p}_proj.", width) for p in ("g", "q", "k", "v")),
                      ".mlp.gate_up_proj.": ((".mlp.gate_proj.", inter), (".mlp.up_proj.", inter))}

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        """Cycles the family serves (before any rank starts; one pipeline stage: one_stage)."""
        check_config(config)

    def _a_norm(self) -> torch.Tensor:
        return self.model.z_L_init
