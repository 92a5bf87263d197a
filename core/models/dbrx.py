"""Databricks' DBRX (``DbrxForCausalLM``: dbrx-base, dbrx-instruct), on the Llama plumbing
(:mod:`specray.models.llama`) with :mod:`specray.models.moe`'s experts. Where it differs from Llama:

* q/k/v fused as ``Wqkv`` (q's rows, then k's, then v's; grouped-query, ``attn_config.kv_n_heads`` KV heads), split at
  load; q, k and v clamped to ``attn_config.clip_qkv`` as projected;
* RoPE at the base ``attn_config.rope_theta`` where the config sets it (the releases' 500000, as DBRX's own code,
  transformers 4 and vLLM read it; transformers 5 reads only ``rope_parameters``, which a release's config.json
  lacks, and so rotates at its default 10000), else ``rope_parameters``';
* LayerNorms without biases (eps 1e-5, ``nn.LayerNorm``'s: the config names none) before each block and after the
  last layer;
* experts in every layer (``ffn_config``): the top ``moe_top_k`` of a softmax over ``moe_num_experts``, the chosen
  weights divided by their p-norm for p = ``moe_normalize_expert_weights`` where set (1 in the releases: the
  renormalisation), no shared expert (:mod:`specray.models.moe`'s ``dbrx`` row). A layer's experts are stored fused,
  ``w1`` (gate), ``v1`` (up) and ``w2`` (down's transpose), each [experts * ffn_hidden_size, hidden]: split by expert
  at load, each rank reading only its experts' rows (and, split by width, its share of them);
* its names: ``transformer.wte``, ``transformer.blocks.N`` (``norm_attn_norm.norm_1``, ``norm_attn_norm.attn.Wqkv``,
  ``norm_attn_norm.attn.out_proj``, ``norm_attn_norm.norm_2``, ``ffn.router.layer``, ``ffn.experts.mlp.w1`` /
  ``v1`` / ``w2``), ``transformer.norm_f``, ``lm_head``; its length ``max_seq_len``.

LoRA adapts the attention: an adapter's ``Wqkv`` split as the weight is (A shared), and ``out_proj``. Refused by
name: an expert activation other than SiLU (``ffn_config.ffn_act_fn``; every release's is SiLU).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from specray.models.classic import llama_view, sub_field
from specray.models.layers import LayerNorm, materialize, shape_of
from specray.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from specray.models.moe import SparseMoE
from specray.parallel import PPGroup, TPGroup

logger = logging.getLogger(__name__)

EPS = 1e-5  # transformers' nn.LayerNorm default (DBRX's config names no eps)
_RENAMES = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"^transformer\.wte\.", "model.embed_tokens."), (r"^transformer\.norm_f\.", "model.norm."),
    (r"^transformer\.blocks\.", "model.layers."), (r"\.norm_attn_norm\.norm_1\.", ".input_layernorm."),
    (r"\.norm_attn_norm\.norm_2\.", ".post_attention_layernorm."),
    (r"\.norm_attn_norm\.attn\.out_proj\.", ".self_attn.o_proj."), (r"\.norm_attn_norm\.attn\.", ".self_attn."),
    (r"\.ffn\.router\.layer\.", ".mlp.router."), (r"\.ffn\.experts\.", ".mlp.experts.")))
# a layer's fused experts: the checkpoint's name -> (the per-expert projection it holds, stored transposed)
_FUSED_EXPERTS = re.compile(r"^transformer\.blocks\.(\d+)\.ffn\.experts\.mlp\.(w1|v1|w2)$")
EXPERT_PARTS = {"w1": ("gate_proj", False), "v1": ("up_proj", False), "w2": ("down_proj", True)}


def llama_fields(hf_config) -> dict[str, Any]:
    """The fields the Llama plumbing and the experts read, from DBRX's ``attn_config`` and ``ffn_config``; a
    ValueError for an expert activation no release has."""
    attn, ffn = hf_config.attn_config, hf_config.ffn_config
    act = sub_field(ffn, "ffn_act_fn") or {"name": "silu"}
    if act.get("name", "silu") != "silu":
        raise ValueError(f"ffn_config.ffn_act_fn={act!r} is not supported for model_type='dbrx': its experts are "
                         "SwiGLU's; use {'name': 'silu'} (every release's)")
    rope = dict(getattr(hf_config, "rope_parameters", None) or {"rope_type": "default"})
    theta = sub_field(attn, "rope_theta")
    if theta is not None:  # the release's base (module docstring)
        if rope.get("rope_theta", theta) != theta:
            logger.info("DBRX: RoPE at attn_config.rope_theta=%s, not rope_parameters' %s", theta, rope["rope_theta"])
        rope["rope_theta"] = theta
    return dict(num_key_value_heads=sub_field(attn, "kv_n_heads", 1), head_dim=None,
                clip_qkv=sub_field(attn, "clip_qkv"), rope_parameters=rope, sliding_window=None, attention_bias=False,
                hidden_act="silu",
                moe_num_experts=sub_field(ffn, "moe_num_experts"), moe_top_k=sub_field(ffn, "moe_top_k"),
                ffn_hidden_size=sub_field(ffn, "ffn_hidden_size"),
                moe_normalize_expert_weights=sub_field(ffn, "moe_normalize_expert_weights", 1.0))


def dbrx_norm(config) -> nn.Module:
    """DBRX's LayerNorm: a weight, no bias."""
    return LayerNorm(config.hidden_size, EPS, bias=False)


class DbrxDecoderLayer(LlamaDecoderLayer):
    build_norm = staticmethod(dbrx_norm)  # (the final norm too: LlamaModel.final_norm)

    @staticmethod
    def build_mlp(config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        return SparseMoE(config, tp, expert_parallel)


class DbrxModel(LlamaModel):
    layer_class = DbrxDecoderLayer


class ExpertRows:
    """One expert's ``rows`` rows [rows, hidden] of a fused [experts * rows, hidden] checkpoint tensor (a tensor or a
    safetensors slice) from row ``start``, as [hidden, rows] where ``transposed`` (DBRX's ``w2``); read only when
    indexed, as :func:`specray.models.layers.narrow` does, so a rank reads its share alone."""

    def __init__(self, fused: Any, start: int, rows: int, transposed: bool):
        self.fused, self.start, self.rows, self.transposed = fused, start, rows, transposed

    def get_shape(self) -> list[int]:
        hidden = shape_of(self.fused)[1]
        return [hidden, self.rows] if self.transposed else [self.rows, hidden]

    def __getitem__(self, index: Any) -> torch.Tensor:
        # index: Ellipsis, or a slice per dimension of get_shape()
        rows, cols = (slice(None), slice(None)) if index is Ellipsis else index
        if self.transposed:
            rows, cols = cols, rows
        first, last, step = rows.indices(self.rows)
        assert step == 1, "a share of an expert is a run of rows"
        part = materialize(self.fused[self.start + first: self.start + last, cols])
        return part.t() if self.transposed else part


class DbrxForCausalLM(LlamaForCausalLM):
    """DBRX for causal LM, sharded over ``tp`` (experts by width, or whole with expert parallelism) and ``pp``."""

    model_class = DbrxModel
    lora_modules = ("q_proj", "k_proj", "v_proj", "o_proj")  # the attention (an adapter's Wqkv split in three)

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__(llama_view(hf_config, **llama_fields(hf_config)), tp, expert_parallel, pp)
        self.renames = _RENAMES
        config = self.config
        kv = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
        # Wqkv's rows (and a LoRA adapter's B's): q's, then k's, then v's
        self.fused = {".Wqkv.": ((".q_proj.", config.hidden_size), (".k_proj.", kv), (".v_proj.", kv))}

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in super()._unfused(weights):
            found = _FUSED_EXPERTS.match(name)
            if found is None:
                yield name, tensor
            else:
                yield from self._experts(int(found.group(1)), found.group(2), name, tensor)

    def _experts(self, layer: int, kind: str, name: str, fused: Any) -> Iterator[tuple[str, Any]]:
        """A layer's fused expert tensor ``kind`` (w1, v1, w2) as this rank's experts' own tensors, named as a
        per-expert checkpoint names them (``...ffn.experts.3.gate_proj.weight``); none on another pipeline stage."""
        block = getattr(self.model.layers[layer], "mlp", None) if layer < len(self.model.layers) else None
        if not isinstance(block, SparseMoE):
            return  # another stage's layer (or none: the load's check of the layers' keys says so)
        width = self.config.ffn_hidden_size
        if shape_of(fused)[0] != block.num_experts * width:
            raise ValueError(f"checkpoint tensor {name} has {shape_of(fused)[0]} rows where ffn_config's "
                             f"moe_num_experts={block.num_experts} times ffn_hidden_size={width} make "
                             f"{block.num_experts * width}: the checkpoint does not match its config.json")
        piece, transposed = EXPERT_PARTS[kind]
        prefix = name[: -len(".mlp." + kind)]
        for expert in range(block.expert_start, block.expert_start + block.local_experts):
            yield f"{prefix}.{expert}.{piece}.weight", ExpertRows(fused, expert * width, width, transposed)

    def adapter_fusions(self) -> dict[str, tuple[int, int]]:
        """Each layer's ``Wqkv`` by its checkpoint name (renamed as the weights are) with its shape, for the adapter
        check (its parts are our ``qkv_proj``'s)."""
        shapes = {}
        for i, layer in self.model.stage_layers():
            qkv = layer.self_attn.qkv_proj
            name = self.adapter_module(f"transformer.blocks.{i}.norm_attn_norm.attn.Wqkv")
            shapes[name] = (qkv.q_size + 2 * qkv.kv_size, qkv.in_features)
        return shapes
