"""What the classic GPT-style families share on the Llama plumbing (:mod:`specray.models.llama`): GPT-NeoX (Pythia),
GPT-2, OPT, Phi, GPT-J, StableLM and StarCoder2.

* :class:`GatelessMLP`: ``c_proj(act(c_fc(x)))`` with biases, a GELU (exact or tanh) or a ReLU;
* :class:`ParallelDecoderLayer`: attention and the MLP both read the stream entering the layer,
  ``h + attn(norm(h)) + mlp(norm'(h))``, with one norm for both (GPT-J, Phi, StableLM's parallel releases) or one each
  (GPT-NeoX);
* :class:`PositionFreeModel`: a stack without RoPE (ALiBi's: :mod:`specray.models.alibi`); and
  :class:`LearnedPositionsModel`, one whose input adds a learned embedding of each token's position (GPT-2, OPT; OPT's
  table starts ``position_offset`` rows in);
* :func:`llama_view`: a family's config with the fields the Llama plumbing reads (its own field names, defaults and
  flags mapped), a copy;
* :func:`split_grouped_qkv`: a fused q/k/v projection stored KV head by KV head (GPT-NeoX: ``[heads, 3, head_dim]``
  rows; Falcon: each KV head's queries, key and value) as the three projections.

Each family file says where it differs; the loading of their checkpoints' names is the family's ``renames``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata
from specray.models.layers import ColumnParallelLinear, LayerNorm, RowParallelLinear, _param, materialize, on_stage
from specray.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaModel, norm_stream
from specray.parallel import TPGroup

# a config's activation name -> the function (transformers' "gelu_new" and "gelu_fast" are GELU's tanh approximation)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_fast": functools.partial(F.gelu, approximate="tanh"), "relu": F.relu,
    "relu2": lambda x: F.relu(x).square()}  # (Persimmon's squared ReLU)


def activation(config) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's activation the config names (``hidden_act``), or a ValueError naming the supported ones."""
    name = config.hidden_act
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act={name!r} is not supported for model_type={config.model_type!r}; one of "
                         f"{sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatelessMLP(nn.Module):
    """``c_proj(act(c_fc(x)))``, ``c_fc`` split by columns and ``c_proj`` by rows over ``tp``; biases unless the
    config's ``use_bias`` is false (StarCoder2's flag)."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        self.act = activation(config)
        bias = bool(getattr(config, "use_bias", True))
        self.c_fc = ColumnParallelLinear(config.hidden_size, config.intermediate_size, tp, bias=bias)
        self.c_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, tp, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        return self.c_proj(self.act(self.c_fc(x)))


def layer_norm(config) -> nn.Module:
    """A LayerNorm with a bias over the hidden size, the config's ``layer_norm_eps``."""
    return LayerNorm(config.hidden_size, config.layer_norm_eps, bias=True)


class ParallelDecoderLayer(LlamaDecoderLayer):
    """``h + attn(input_layernorm(h)) + mlp(post_attention_layernorm(h))``: both blocks read the stream entering
    the layer; a family with one norm for both (``one_norm``) has no ``post_attention_layernorm``."""

    mlp_class = GatelessMLP
    build_norm = staticmethod(layer_norm)  # (the final norm too: LlamaModel.final_norm)
    one_norm = False

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__(config, tp, layer, expert_parallel)
        if self.one_norm:
            del self.post_attention_layernorm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H], the stream being x + residual (added in the next norm) -> both blocks' outputs and the
        # stream they join
        h, residual = norm_stream(self.input_layernorm, x, residual)
        mlp_in = h if self.one_norm else self.post_attention_layernorm(residual)
        return self.mix(h, cos, sin, meta) + self.mlp(mlp_in), residual


class PositionEmbedding(nn.Module):
    """A learned embedding per position, row ``position + offset`` of ``weight`` (whole on every rank)."""

    def __init__(self, num_positions: int, hidden_size: int, offset: int = 0):
        super().__init__()
        self.weight = _param(num_positions + offset, hidden_size)
        self.offset = offset

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        # positions: [T] -> [T, H]
        return F.embedding(positions + self.offset, self.weight)


class PositionFreeModel(LlamaModel):
    """A decoder stack whose attention has no RoPE (its attention sets ``use_rope = False``: learned positions,
    ALiBi), so it builds no RoPE tables."""

    def rope_tables(self, meta: AttentionMetadata, dtype: torch.dtype) -> Callable[[int], tuple[Any, Any]]:
        return lambda layer: (None, None)  # (no layer rotates)


class LearnedPositionsModel(PositionFreeModel):
    """A decoder stack whose input is each token's embedding plus a learned one of its position
    (:class:`PositionEmbedding`, on the stage holding the embedding; OPT's rows start ``position_offset`` in)."""

    position_offset = 0

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp=None):
        super().__init__(config, tp, expert_parallel, pp)
        self.embed_positions = on_stage(self.pp.holds_embedding, lambda: PositionEmbedding(
            config.max_position_embeddings, config.hidden_size, self.position_offset))
        self.last_position = config.max_position_embeddings - 1

    def embed_step(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, meta.positions: [T] -> [T, H]. A request's positions stay below max_model_len <= the table's
        # length (the engine's check); a graph's padding rows may lie past it, and read its last row instead
        return self.embed(input_ids) + self.embed_positions(meta.positions.clamp(max=self.last_position))


class NoRopeAttention(LlamaAttention):
    """Llama's attention without RoPE (a stack of :class:`LearnedPositionsModel`)."""

    def __init__(self, config, tp: TPGroup, layer: int):
        super().__init__(config, tp, layer)
        self.use_rope = False


def llama_view(config, **fields: Any):
    """A copy of ``config`` with ``fields`` set (the names the Llama plumbing reads: ``num_key_value_heads``,
    ``hidden_act``, ``attention_bias``, ``layer_norm_eps``...); the family's own fields stay as they are."""
    config = copy.copy(config)
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def sub_field(part: Any, name: str, default: Any = None) -> Any:
    """Field ``name`` of a nested config part (MPT's and DBRX's ``attn_config``, DBRX's ``ffn_config``): a dict in
    config.json, a config object once read."""
    return part.get(name, default) if isinstance(part, dict) else getattr(part, name, default)


def split_grouped_qkv(name: str, tensor: Any, fused: str, num_groups: int, q_per_group: int = 1
                      ) -> list[tuple[str, torch.Tensor]]:
    """A fused q/k/v weight or bias ``name`` stored group by group (its rows ``[groups, q_per_group + 2, head_dim]``:
    each KV head's queries, then its key, then its value; GPT-NeoX: one query per group, a group per head) as the three
    projections' tensors, named with ``fused`` replaced by ``.q_proj.``, ``.k_proj.`` and ``.v_proj.``."""
    value = materialize(tensor)
    rows, per = value.shape[0], q_per_group + 2
    if rows % (num_groups * per):
        raise ValueError(f"checkpoint tensor {name} has {rows} rows, not a multiple of {num_groups} KV heads times "
                         f"{per} heads each: the checkpoint does not match its config.json")
    grouped = value.reshape(num_groups, per, rows // (num_groups * per), *value.shape[1:])
    q, k, v = grouped[:, :q_per_group], grouped[:, -2], grouped[:, -1]
    return [(name.replace(fused, f".{p}_proj."), part.reshape(-1, *value.shape[1:]))
            for p, part in zip("qkv", (q, k, v))]


class ThirdsQKVAdapters:
    """LoRA adapters of a checkpoint's q/k/v fused as three equal parts in turn (GPT-2's ``c_attn``, MPT's ``Wqkv``),
    on a :class:`~specray.models.llama.LlamaForCausalLM` family of one KV head per query head: the fused projection's
    shape by its name (renamed as the weights are) for the adapter check, and an adapter's B split in three (A
    shared)."""

    fused_qkv_module = ".attn.c_attn"  # a layer's fused q/k/v, as the checkpoint names it under the layer

    def adapter_fusions(self) -> dict[str, tuple[int, int]]:
        hidden = self.config.hidden_size
        return {self.adapter_module(f"model.layers.{i}{self.fused_qkv_module}"): (3 * hidden, hidden)
                for i, _ in self.model.stage_layers()}

    def split_adapter(self, module: str, lora_b: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """An adapter's B of the fused projection [3 H, r] as q's, k's and v's rows (named with a trailing dot)."""
        leaf = self.fused_qkv_module.rsplit(".", 1)[1]
        if module.rsplit(".", 1)[-1] != leaf:
            return None
        return [(f"{module[:-len(leaf)]}{p}_proj.", b) for p, b in zip("qkv", lora_b.chunk(3))]


class FusedQKVAdapters:
    """A checkpoint's q/k/v fused KV head by KV head (``query_key_value``: GPT-NeoX's, Falcon's, BLOOM's; GPT-BigCode's
    ``c_attn``), on a :class:`~specray.models.llama.LlamaForCausalLM` family: the weight split at load into the three
    projections, and LoRA adapters of it: the fused projection's shape by its checkpoint name (renamed as the weights
    are) for the adapter check, and an adapter's B split as the weight is (A shared); the groups are the config
    view's KV heads (:meth:`qkv_groups`)."""

    fused_qkv = ".query_key_value."

    def qkv_groups(self) -> tuple[int, int]:
        """(KV heads, query heads per KV head) of the fused layout: the config view's (one group per head where each
        query head has its own KV head: GPT-NeoX, BLOOM, Persimmon; one group: multi-query)."""
        groups = self.config.num_key_value_heads
        return groups, self.config.num_attention_heads // groups

    def adapter_fusions(self) -> dict[str, tuple[int, int]]:
        shapes = {}
        for i, layer in self.model.stage_layers():
            qkv = layer.self_attn.qkv_proj
            name = self.adapter_module(f"model.layers.{i}.self_attn{self.fused_qkv}"[:-1])
            shapes[name] = (qkv.q_size + 2 * qkv.kv_size, qkv.in_features)
        return shapes

    def split_adapter(self, module: str, lora_b: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        if not f"{module}.".endswith(self.fused_qkv):
            return None
        return split_grouped_qkv(f"{module}.", lora_b, self.fused_qkv, *self.qkv_groups())

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in weights:
            if self.fused_qkv in name:  # (only the attention's projection has the name)
                yield from split_grouped_qkv(name, tensor, self.fused_qkv, *self.qkv_groups())
            else:
                yield name, tensor
