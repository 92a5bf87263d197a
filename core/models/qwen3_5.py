"""Hybrid linear-attention models: Qwen3.5 (``Qwen3_5ForCausalLM``, and the text of
``Qwen3_5ForConditionalGeneration``), Qwen3.5-MoE and Qwen3-Next, on the Llama plumbing (:mod:`specray.models.llama`:
weights, paged KV for the attention layers, the model interface).

Layers interleave (``layer_types``) Gated DeltaNet linear attention (:mod:`specray.models.gated_deltanet`: a
recurrent state per request, not a paged cache; on graph steps its fixed-shape form) with gated full attention (plain
:class:`PagedAttention` behind the gate, so decode and verify steps replay graphs: never captured on a GPU yet).
Where the full-attention layers differ from Qwen3's:

* ``q_proj`` gives each head a query and an output gate (``[q_h, gate_h]`` per head, 2 * head_dim rows); the
  attention's output is multiplied by ``sigmoid(gate)`` before ``o_proj``;
* q/k norms and every RMSNorm of the stack scale by ``1 + weight`` (zero-centred weights; the linear layers' gated
  norm keeps a plain weight);
* partial RoPE (``partial_rotary_factor``: the first quarter of each head rotates). Qwen3.5's multimodal RoPE
  (``mrope_section``) gives a text token the same position on its three axes, which is plain RoPE; a step with a
  multimodal release's images (:mod:`specray.models.qwen3_5_vision`) takes their rows (``meta.input_embeds``) and
  rotates by their interleaved positions (``meta.rope_positions``, ``RotaryEmbedding.multimodal``).

Each layer is ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``; the MLP is dense (Qwen3.5), a mixture of experts with
a gated shared expert on every layer (Qwen3.5-MoE) or on the ``decoder_sparse_step`` ones (Qwen3-Next).
Qwen3-Next's checkpoint fuses the linear layers' projections per key-head group (``in_proj_qkvz``, ``in_proj_ba``);
they are split into Qwen3.5's names as they load. A multimodal release's text model is read from its
``model.language_model.`` tensors; its vision tower and the multi-token-prediction layer (``mtp.``) are not loaded.

The releases' MTP layer (``mtp.*``, at the top level in the text and multimodal releases alike) serves
``method="mtp"``: :class:`~specray.models.draft_head.DraftHead`'s ``mtp`` layout, with this family's gated attention,
MLP (the experts with their gated shared expert in the MoE models) and ``1 + w`` norms (:meth:`mtp_layer_parts`,
:data:`MTP_NAMES`). It attends over its own paged cache only; the recurrent state is the target's alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.gated_deltanet import GatedDeltaNet, RecurrentModel, check_linear_heads_split
from specray.models.gemma3 import GemmaRMSNorm
from specray.models.kv_cache import FullAttentionSpec
from specray.models.layers import (QKVParallelLinear, RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding,
                                   apply_rotary, materialize, rope_parameters, rotary_dim)
from specray.models.llama import LlamaForCausalLM, LlamaMLP, StageModel, _head_dim
from specray.models.llama import _is_sparse as llama_is_sparse
from specray.models.moe import SparseMoE
from specray.parallel import PPGroup, TPGroup

LAYER_TYPES = ("linear_attention", "full_attention")
_SKIPPED = ("model.visual.", "mtp.", "model.language_model.visual.")  # a multimodal release's vision tower; MTP
# the release's MTP tensors (after ``mtp.``) -> the draft head's names: [norm(e); norm(h)] through ``fc``, one decoder
# layer of the family, a final norm (DeepSeek's enorm / hnorm / eh_proj / shared_head.norm under other names)
MTP_NAMES = (("fc.", "eh_proj."), ("pre_fc_norm_embedding.", "enorm."), ("pre_fc_norm_hidden.", "hnorm."),
             ("norm.", "norm."), ("layers.0.", "layers.0."))


def _is_sparse(config, layer: int) -> bool:
    """Qwen3.5-MoE: every layer's MLP is the experts'; Qwen3-Next: Qwen3-MoE's rule (every
    ``decoder_sparse_step``-th but ``mlp_only_layers``); Qwen3.5: none."""
    return config.model_type == "qwen3_5_moe_text" or llama_is_sparse(config, layer)


class ResidualGemmaRMSNorm(GemmaRMSNorm):
    """The ``1 + w`` RMSNorm with the draft head's fused form: given ``residual``, it adds it first and returns
    ``(normed, sum)`` (the head's layer calls its post-attention norm so, as :class:`~specray.models.layers.RMSNorm`
    allows)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return super().forward(x)
        x = residual + x
        return super().forward(x), x


class GatedAttention(nn.Module):
    """Full attention with an output gate per head, q/k norms (``1 + w``) and partial RoPE."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        d = self.head_dim = _head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        # q_proj's rows are (query, gate) per head: as 2 * heads "query heads" of head_dim, each rank gets its heads'
        # pairs, and k/v split (or replicate) as usual
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, 2 * config.num_attention_heads,
                                          config.num_key_value_heads, tp, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, tp, bias=bias)
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        spec = FullAttentionSpec(self.num_kv_heads, d, self.qkv_proj.kv_head_start)
        self.attn = PagedAttention(self.num_heads, spec, d ** -0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, 1, R/2] -> [T, H]
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        q_gate, kv = qkv[:, : 2 * self.num_heads * d], qkv[:, 2 * self.num_heads * d:]
        q_gate = q_gate.view(t, self.num_heads, 2 * d)
        q, gate = self.q_norm(q_gate[..., :d]), q_gate[..., d:].reshape(t, self.num_heads * d)
        k = self.k_norm(kv[:, : self.num_kv_heads * d].view(t, self.num_kv_heads, d))
        v = kv[:, self.num_kv_heads * d:].view(t, self.num_kv_heads, d)
        qk = apply_rotary(torch.cat((q, k), dim=1), cos, sin)
        out = self.attn(qk[:, : self.num_heads], qk[:, self.num_heads:], v, meta)  # [T, heads * D]
        return self.o_proj(out * torch.sigmoid(gate))


class HybridDecoderLayer(nn.Module):
    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__()
        self.layer_type = config.layer_types[layer]
        if self.layer_type not in LAYER_TYPES:
            raise ValueError(f"layer_types[{layer}]={self.layer_type!r} is not supported; one of {list(LAYER_TYPES)}")
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, tp)
        else:
            self.self_attn = GatedAttention(config, tp)
        self.mlp = SparseMoE(config, tp, expert_parallel) if _is_sparse(config, layer) else LlamaMLP(config, tp)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: the residual stream [T, H] -> the next layer's
        h = self.input_layernorm(x)
        h = self.linear_attn(h, meta) if self.layer_type == "linear_attention" else self.self_attn(h, cos, sin, meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridModel(StageModel):
    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__()
        self.build_stage(config, pp, lambda i: HybridDecoderLayer(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps))
        rope = rope_parameters(config, partial=True)
        self.rotary_emb = RotaryEmbedding(rotary_dim(_head_dim(config), rope), rope, config.max_position_embeddings)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # input_ids: [T] -> hidden [T, H], and the residual stream [T, H] entering each layer of aux_layers. A stage
        # after the first starts from the previous stage's residual stream ``intermediate`` [1, T, H]; a stage before
        # the last ends there, returning its own
        # the first stage takes a multimodal release's image rows (meta.input_embeds) in place of their placeholders'
        x = meta.with_input_embeds(self.embed(input_ids)) if intermediate is None else intermediate[0]
        self.rotary_emb.ensure(meta.max_position + 1)
        if meta.rope_positions is not None:  # Qwen3.5's images: interleaved multimodal RoPE (three ids per token)
            cos, sin = self.rotary_emb.multimodal(meta.rope_positions, x.dtype)
        else:
            cos, sin = self.rotary_emb(meta.positions, x.dtype)
        aux: dict[int, torch.Tensor] = {}
        for i, layer in self.stage_layers():
            if i in aux_layers:
                aux[i] = x
            x = layer(x, cos, sin, meta)
        if not self.pp.is_last:
            return x[None], [aux[i] for i in aux_layers]
        return self.norm(x), [aux[i] for i in aux_layers]


class Qwen3_5ForCausalLM(RecurrentModel, LlamaForCausalLM):
    """Qwen3.5 / Qwen3.5-MoE / Qwen3-Next for causal LM, sharded over ``tp`` (linear-attention heads split like
    attention heads). Its attention layers cache K/V in the paged cache (:meth:`kv_cache_specs`); its linear layers
    keep a recurrent state per request (:meth:`recurrent_state_specs`), which the runner allocates and binds."""

    model_class = HybridModel
    stage_width = 1
    # LoRA on the attention layers' q/k/v/o (q_proj's rows hold each head's query and gate, loaded as its weight is),
    # the linear layers' projections (Qwen3.5's names; an adapter of Qwen3-Next's fused in_proj_qkvz / in_proj_ba has
    # its B split as the weights are: adapter_fusions, split_adapter), the dense MLPs and the shared experts: all of
    # them plain linears; not conv1d, the router or the experts
    lora_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                     "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")

    check_split = staticmethod(check_linear_heads_split)

    mtp_norm = ResidualGemmaRMSNorm  # the MTP head's norms scale by 1 + w, as every norm of the stack does
    mtp_names = MTP_NAMES  # the MTP layer's tensors are the release's ``mtp.*`` (DeepSeek's layout is the default)

    @staticmethod
    def mtp_layer_parts(config, tp: TPGroup, expert_parallel: bool = False) -> tuple[nn.Module, nn.Module]:
        """The MTP layer's block (``mtp.layers.0``): gated full attention and the MLP a layer 0 of the family has
        (vLLM and transformers' MtpModel number it 0): the experts with a gated shared expert in Qwen3.5-MoE and
        Qwen3-Next, dense in Qwen3.5; split over ``tp`` as the target's layers are."""
        mlp = SparseMoE(config, tp, expert_parallel) if _is_sparse(config, 0) else LlamaMLP(config, tp)
        return GatedAttention(config, tp), mlp

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The checkpoint's tensors under our names: a multimodal release's text model renamed, its vision tower and
        MTP layers dropped, Qwen3-Next's fused projections split."""
        for name, tensor in weights:
            if name.startswith(_SKIPPED):
                continue
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model."):]
            if ".linear_attn.in_proj_qkvz." in name:
                yield from self._split_qkvz(name, materialize(tensor))
            elif ".linear_attn.in_proj_ba." in name:
                yield from self._split_ba(name, materialize(tensor))
            else:
                yield name, tensor

    def _split_qkvz(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """Qwen3-Next's ``in_proj_qkvz`` [key_heads * (2 dk + 2 r dv), H], grouped by key head (q, k, then its r
        value heads' v and z), as ``in_proj_qkv`` (all q, all k, all v) and ``in_proj_z``."""
        c = self.config
        nk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
        rv = c.linear_num_value_heads // nk * dv
        q, k, v, z = w.reshape(nk, 2 * dk + 2 * rv, -1).split([dk, dk, rv, rv], dim=1)
        flat = [part.reshape(-1, w.shape[-1]) for part in (q, k, v, z)]
        yield name.replace("in_proj_qkvz", "in_proj_qkv"), torch.cat(flat[:3])
        yield name.replace("in_proj_qkvz", "in_proj_z"), flat[3]

    # ---- LoRA adapters of Qwen3-Next's fused projections: their B split as the weights are (A is shared)

    _FUSED = {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}

    def adapter_fusions(self) -> dict[str, tuple[int, int]]:
        """Qwen3-Next's fused checkpoint projections an adapter may name (``...linear_attn.in_proj_qkvz`` and
        ``in_proj_ba``), by checkpoint name, with their weights' (out, in) shape (the parts' rows summed; built whole,
        one rank): :func:`specray.models.lora.adapter_shapes` adds them."""
        if self.config.model_type != "qwen3_next":
            return {}
        shapes = {}
        for i, layer in self.model.stage_layers():
            attn = getattr(layer, "linear_attn", None)
            if attn is None:
                continue
            for fused, parts in self._FUSED.items():
                modules = [getattr(attn, part) for part in parts]
                shapes[f"model.layers.{i}.linear_attn.{fused}"] = (sum(m.out_local for m in modules),
                                                                   modules[0].in_features)
        return shapes

    def split_adapter(self, module: str, lora_b: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """An adapter's B of a fused projection ``module`` as its parts' (named as our projections, with a trailing
        dot, as :func:`specray.models.llama.unfuse` names them), or None for any other module."""
        leaf = module.rsplit(".", 1)[-1]
        if self.config.model_type != "qwen3_next" or leaf not in self._FUSED:
            return None
        split = self._split_qkvz if leaf == "in_proj_qkvz" else self._split_ba
        return [(name + ".", b) for name, b in split(module, lora_b)]

    def _split_ba(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """Qwen3-Next's ``in_proj_ba`` [key_heads * 2r, H] (per key head its r value heads' b, then their a) as
        ``in_proj_b`` and ``in_proj_a``."""
        c = self.config
        nk = c.linear_num_key_heads
        r = c.linear_num_value_heads // nk
        b, a = w.reshape(nk, 2 * r, -1).split([r, r], dim=1)
        yield name.replace("in_proj_ba", "in_proj_b"), b.reshape(-1, w.shape[-1])
        yield name.replace("in_proj_ba", "in_proj_a"), a.reshape(-1, w.shape[-1])
