"""Zamba2 (``Zamba2ForCausalLM``: Zyphra's Zamba2-1.2B / 2.7B / 7B): Mamba-2 layers (:mod:`specray.models.mamba2`,
a recurrent state per request) with a shared transformer block run at the ``hybrid`` layers.

* A ``mamba`` layer: ``x + mamba(rmsnorm(x))`` (no MLP).
* A ``hybrid`` layer: the shared block reads ``[x; e]`` (the stream and the token's embedding, 2 H wide):
  ``t = mlp(rmsnorm(attention(rmsnorm([x; e]))))`` with no residual inside, then ``x + mamba(rmsnorm(x +
  linear(t)))``. The block's weights are one of ``num_mem_blocks`` shared ones (invocation j runs block
  ``j % num_mem_blocks``); each invocation has K/V of its own (a paged spec per hybrid layer) and, with
  ``use_shared_attention_adapter``, low-rank adapters of its own on q, k and v; its MLP's fused gate / up always
  has one. Attention's heads are ``attention_head_dim`` wide (2 H / heads), its scale ``(head_dim / 2) ** -0.5``,
  RoPE where ``use_mem_rope`` says.

Checkpoint names (transformers'): a block's weights under the first hybrid layer that runs it
(``model.layers.{i}.shared_transformer.``), each invocation's adapters there too, by invocation
(``linear_q_adapter_list.{j}.{0,1}``, ``gate_up_proj_adapter_list.{j}.{0,1}``: A then B); a hybrid layer's own
``linear`` and ``mamba_decoder.`` (its norm and mixer). Here the blocks are ``model.blocks.{b}.`` and each
invocation's adapters live on its layer. Heads, key/value heads and the MLP's width split over tensor-parallel
ranks (the adapters' B as their projection's rows, their A whole). Over pipeline stages a stage holds the shared
blocks its hybrid layers run (a block run on two stages is on both, read from the same tensors) and hands the next
the stream and the tokens' embedding (its hybrid layers read both).

LoRA adapters adapt each layer's own projections (the Mamba mixers' ``in_proj`` and ``out_proj``, a hybrid layer's
``linear``); a shared block's are refused by name: transformers builds the block's module anew in each hybrid layer
(the weights tied), so a PEFT adapter holds one per run, which one shared module here does not apply."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.gated_deltanet import FusedColumnLinear, RecurrentModel
from specray.models.kv_cache import FullAttentionSpec
from specray.models.layers import (ColumnParallelLinear, QKVParallelLinear, RMSNorm, RotaryEmbedding,
                                   RowParallelLinear, VocabParallelEmbedding, apply_rotary, max_positions, on_stage,
                                   rope_parameters)
from specray.models.llama import LlamaForCausalLM, StageModel
from specray.models.mamba2 import Mamba2Mixer, check_mamba2_split
from specray.parallel import PPGroup, TPGroup

_ACTS = {"gelu": F.gelu, "silu": F.silu}
# the checkpoint's shared blocks (under the first hybrid layer that runs each) and each invocation's adapters
_SHARED = re.compile(r"^model\.layers\.(\d+)\.shared_transformer\.(.*)$")
_ADAPTER = re.compile(r"^(self_attn\.linear_([qkv])_adapter_list|feed_forward\.gate_up_proj_adapter_list)"
                      r"\.(\d+)\.([01])\.weight$")


def _low_rank(in_features: int, out_features: int | list[int], rank: int, tp: TPGroup) -> nn.Module:
    """An adapter ``b(a(x))``: ``a`` whole on every rank, ``b`` split by its output rows as the projection it adds to
    (a list of widths: a merged projection's parts, one checkpoint tensor)."""
    adapter = nn.Module()
    adapter.a = ColumnParallelLinear(in_features, rank, TPGroup.single())
    adapter.b = FusedColumnLinear(rank, out_features, tp) if isinstance(out_features, list) else \
        ColumnParallelLinear(rank, out_features, tp)
    return adapter


class Zamba2Block(nn.Module):
    """A shared transformer block's weights (norms, attention's projections, the MLP); each invocation runs it with
    its own K/V and adapters (:class:`Zamba2Invocation`)."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        h, wide = config.hidden_size, config.attention_hidden_size
        self.head_dim = d = config.attention_head_dim
        self.input_layernorm = RMSNorm(wide, config.rms_norm_eps)
        self.qkv_proj = QKVParallelLinear(wide, d, config.num_attention_heads, config.num_key_value_heads, tp)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, h, tp)
        self.pre_ff_layernorm = RMSNorm(h, config.rms_norm_eps)
        inter, bias = config.intermediate_size, bool(config.add_bias_linear)
        # gate | up, one checkpoint tensor (gate_up_proj there; named apart from a merged pair loaded part by part)
        self.gate_up = FusedColumnLinear(h, [inter, inter], tp, bias=bias)
        self.down_proj = RowParallelLinear(inter, h, tp, bias=bias)
        if config.hidden_act not in _ACTS:
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported for model_type='zamba2'; one of "
                             f"{sorted(_ACTS)}")
        self.act = _ACTS[config.hidden_act]


class Zamba2Invocation(nn.Module):
    """One hybrid layer's run of its shared block: its K/V (``attn``) and adapters; the block is passed in."""

    def __init__(self, config, tp: TPGroup, block: Zamba2Block):
        super().__init__()
        qkv = block.qkv_proj
        self.num_heads, self.num_kv_heads, self.head_dim = qkv.num_heads, qkv.num_kv_heads, block.head_dim
        spec = FullAttentionSpec(self.num_kv_heads, self.head_dim, qkv.kv_head_start)
        self.attn = PagedAttention(self.num_heads, spec, (self.head_dim / 2) ** -0.5)
        wide, rank = config.attention_hidden_size, config.adapter_rank
        self.qkv_adapters = None
        if config.use_shared_attention_adapter:
            self.qkv_adapters = nn.ModuleList([
                _low_rank(wide, config.num_attention_heads * self.head_dim, rank, tp),
                _low_rank(wide, config.num_key_value_heads * self.head_dim, rank, tp),
                _low_rank(wide, config.num_key_value_heads * self.head_dim, rank, tp)])
        self.gate_up_adapter = _low_rank(config.hidden_size, [config.intermediate_size] * 2, rank, tp)
        self.use_rope = bool(config.use_mem_rope)

    def forward(self, block: Zamba2Block, x: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x, embedded: [T, H] -> the block's output [T, H] (no residual)
        t, d = x.shape[0], self.head_dim
        h = block.input_layernorm(torch.cat((x, embedded), dim=-1))
        qkv = block.qkv_proj(h)
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.qkv_adapters is not None:
            q, k, v = (p + ad.b(ad.a(h)) for p, ad in zip((q, k, v), self.qkv_adapters))
        qk = torch.cat((q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d)), dim=1)
        if self.use_rope:
            qk = apply_rotary(qk, cos, sin)
        out = block.o_proj(self.attn(qk[:, : self.num_heads], qk[:, self.num_heads:],
                                     v.view(t, self.num_kv_heads, d), meta))
        h = block.pre_ff_layernorm(out)
        gate, up = (block.gate_up(h) + self.gate_up_adapter.b(self.gate_up_adapter.a(h))).chunk(2, dim=-1)
        return block.down_proj(block.act(gate) * up)


class Zamba2Layer(nn.Module):
    """A ``mamba`` layer, or a ``hybrid`` one: its shared block's invocation, ``linear``, then the Mamba layer."""

    def __init__(self, config, tp: TPGroup, layer: int, block: Zamba2Block | None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mamba = Mamba2Mixer(config, tp)
        self.mlp = None  # (no MLP of its own: the shared block's runs inside its invocation)
        if block is not None:  # (the block itself is the model's: not registered here, so its weights are one)
            self.self_attn = Zamba2Invocation(config, tp, block)
            self.linear = ColumnParallelLinear(config.hidden_size, config.hidden_size, TPGroup.single())

    def forward(self, x: torch.Tensor, embedded: torch.Tensor, block: Zamba2Block | None, cos: torch.Tensor,
                sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = x if block is None else x + self.linear(self.self_attn(block, x, embedded, cos, sin, meta))
        return x + self.mamba(self.input_layernorm(h), meta)


class Zamba2Model(StageModel):
    block_class: type[nn.Module] = Zamba2Block  # (Zamba's: its own block and layers, one block)
    layer_class: type[nn.Module] = Zamba2Layer

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__()
        kinds = list(config.layers_block_type)
        num_blocks = getattr(config, "num_mem_blocks", 1)
        self.hybrid = [i for i, kind in enumerate(kinds) if kind == "hybrid"]
        self.block_of = {layer: j % num_blocks for j, layer in enumerate(self.hybrid)}
        stage = (pp or PPGroup.single()).layers(config.num_hidden_layers)
        used = {b for layer, b in self.block_of.items() if layer in stage}  # the blocks this stage's layers run
        self.blocks = nn.ModuleList([on_stage(b in used, lambda: self.block_class(config, tp))
                                     for b in range(num_blocks)])
        self.build_stage(config, pp, lambda i: self.layer_class(config, tp, i, self._block(i)),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))
        rope = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(config.attention_head_dim, rope, max_positions(config))

    def _block(self, layer: int) -> Zamba2Block | None:
        return self.blocks[self.block_of[layer]] if layer in self.block_of else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # input_ids: [T] -> hidden [T, H], and the stream [T, H] entering each layer of aux_layers. A stage after
        # the first starts from the previous one's stream and embedding ``intermediate`` [2, T, H]; a stage before
        # the last hands on its own
        if intermediate is None:
            x = embedded = self.embed(input_ids)
        else:
            x, embedded = intermediate.unbind(0)
        self.rotary_emb.ensure(meta.max_position + 1)
        cos, sin = self.rotary_emb(meta.positions, x.dtype)
        aux: dict[int, torch.Tensor] = {}
        for i, layer in self.stage_layers():
            if i in aux_layers:
                aux[i] = x
            x = layer(x, embedded, self._block(i), cos, sin, meta)
        if not self.pp.is_last:
            return torch.stack((x, embedded)), [aux[i] for i in aux_layers]
        return self.norm(x), [aux[i] for i in aux_layers]


class Zamba2ForCausalLM(RecurrentModel, LlamaForCausalLM):
    """Zamba2 for causal LM, sharded over ``tp`` (module docstring)."""

    model_class = Zamba2Model
    # LoRA on each layer's own projections: the Mamba mixers' in_proj and out_proj and a hybrid layer's linear. Not the
    # shared blocks' (adapter_module refuses them by name): transformers builds a block's module anew in each hybrid
    # layer (its weights tied), so PEFT gives each run an adapter of its own, where the block here is one module
    lora_modules: tuple[str, ...] = ("in_proj", "out_proj", "linear")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(hf_config, tp, expert_parallel, pp)
        self.renames = ((re.compile(r"\.mamba_decoder\.mamba\."), ".mamba."),
                        (re.compile(r"\.mamba_decoder\.input_layernorm\."), ".input_layernorm."),
                        (re.compile(r"^model\.final_layernorm\."), "model.norm."))

    @staticmethod
    def check_split(config, tp: int, pp: int) -> None:
        check_mamba2_split(config, tp)
        if config.num_key_value_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not split this model's num_key_value_heads="
                             f"{config.num_key_value_heads} (each invocation's k and v adapters split as they do)")

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The shared blocks' tensors under ``model.blocks.{b}.``, each invocation's adapters on its layer."""
        for name, tensor in weights:
            yield self._shared_name(name), tensor

    def _shared_name(self, name: str) -> str:
        """A checkpoint name of a shared block's tensor (under the first hybrid layer that runs it) as ours:
        ``model.blocks.{b}.``, or an invocation's adapter on its own layer; other names as they are."""
        found = _SHARED.match(name)
        if found is None:
            return name
        rest = found.group(2)
        is_adapter = _ADAPTER.match(rest)
        if is_adapter is not None:
            kind, which, j, ab = is_adapter.groups()
            where = f"self_attn.qkv_adapters.{'qkv'.index(which)}" if which else "self_attn.gate_up_adapter"
            return f"model.layers.{self.model.hybrid[int(j)]}.{where}.{'ab'[int(ab)]}.weight"
        rest = rest.replace("self_attn.", "").replace("feed_forward.", "").replace("gate_up_proj", "gate_up")
        return f"model.blocks.{self.model.block_of[int(found.group(1))]}.{rest}"

    def adapter_module(self, name: str) -> str:
        """An adapter's module (the checkpoint's name) as ours; one of a shared block (its projections, its runs' own
        adapters) refused by name (``lora_modules``)."""
        if self._shared_name(name) != name:
            raise ValueError(f"the adapter adapts {name!r}, which specray does not apply LoRA to: a shared transformer "
                             "block's projection, which PEFT adapts in each hybrid layer apart (transformers builds "
                             "the block anew in each) where specray runs one module; train the adapter on "
                             f"target_modules={list(self.lora_modules)} (the layers' own projections)")
        return super().adapter_module(name)

    def reads_weight(self, name: str) -> bool:
        """A pipeline stage reads the shared blocks its layers run, wherever the checkpoint keeps them."""
        return super().reads_weight(self._shared_name(name))

