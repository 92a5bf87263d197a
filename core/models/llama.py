"""The Llama family (Llama 2/3, Mistral, SmolLM2, TinyLlama), Mixtral, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE and Phi-3,
written with tensor-parallel layers.

One class covers them all; the differences are config flags: q/k/v bias (Qwen2, ``attention_bias``), o_proj
bias (``attention_bias``), MLP bias (``mlp_bias``), an RMSNorm over each query and key head before RoPE (Qwen3),
sliding-window layers (Mistral and Phi-3 ``sliding_window``, Qwen2 and Qwen3 ``layer_types``), layers without RoPE
(SmolLM3's ``no_rope_layers``), tied embeddings, RoPE
scaling (Phi-3's LongRoPE) and partial RoPE (Phi-4-mini), RoPE on interleaved pairs and ``use_bias`` on every
projection (ERNIE 4.5), Seed-OSS's q/k/v biases without an o_proj one (``attention_out_bias``), checkpoint layouts
(Phi-3's fused q/k/v and gate/up; GLM's gate/up: GLM-4-9B-chat, ``GlmForCausalLM``, whose q/k/v biases and RoPE on
interleaved pairs of each head's first half are GLM-4's without its extra norms), and
Granite's multipliers (``embedding_multiplier``, ``attention_multiplier`` as the attention's scale,
``residual_multiplier`` on each block's output before it joins the residual stream, ``logits_scaling`` dividing the
logits).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.attention import AttentionMetadata, PagedAttention
from specray.models.int_quant import IntWeight
from specray.models.kv_cache import FullAttentionSpec, KVCache, KVCacheSpec, SlidingWindowSpec
from specray.models.moe import EXPERT_PARAMS, SparseMoE, is_expert_tensor
from specray.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
    materialize,
    max_positions,
    on_stage,
    other_stage_prefixes,
    position_query_scaling,
    rope_parameters,
    rotary_dim,
    scale_queries,
)
from specray.parallel import PPGroup, TPGroup

logger = logging.getLogger(__name__)

# checkpoint name piece -> (our merged module, shard id)
_STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


# a checkpoint's calibrated scales of an FP8 KV cache (llm-compressor's kv_cache_scheme; kv_scale: both, older)
KV_SCALE_NAMES = (".self_attn.k_scale", ".self_attn.v_scale", ".self_attn.kv_scale")

# an RMSNorm over each query and key head (head_dim wide) before RoPE (Qwen3-VL's text models are Qwen3's)
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_vl_text", "qwen3_vl_moe_text", "qwen3_omni_moe_text", "hy_v3",
                       "dots1", "exaone4", "exaone_moe", "apertus", "kolibri1", "afmoe", "mellum", "laguna", "flint",
                       "beam")
# q/k/v biases, none on o (Qwen2-VL's, Qwen2.5-VL's and Qwen2.5-Omni's text: Qwen2; GLM's and GLM-4's: their
# attention_bias)
QKV_BIAS_MODEL_TYPES = ("qwen2", "qwen2_moe", "qwen2_vl_text", "qwen2_5_vl_text", "qwen2_5_omni_text", "glm", "glm4")
# experts every decoder_sparse_step-th layer (Qwen3-Next: its own class, the same rule)
SPARSE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "qwen3_vl_moe_text", "qwen3_omni_moe_text", "qwen3_next", "flint")
# one use_bias flag biasing every projection: q/k/v, o and the MLP's (ERNIE 4.5; StarCoder2, whose MLP is its own)
USE_BIAS_MODEL_TYPES = ("ernie4_5", "ernie4_5_moe", "starcoder2")
# RoPE rotating the pairs (0, 1), (2, 3), ... of the rotated features, not their two halves
INTERLEAVED_ROPE_MODEL_TYPES = ("ernie4_5", "ernie4_5_moe", "glm", "glm4", "cohere", "cohere2", "cohere2_moe",
                                "helium")
# families whose layers are all softmax attention, full or sliding: another kind in layer_types (transformers fails on
# it) is refused by name rather than attended as full
PLAIN_LAYER_MODEL_TYPES = ("qwen2", "qwen3", "qwen2_moe", "ministral")
PLAIN_LAYER_TYPES = ("full_attention", "sliding_attention")
NO_ROPE_MODEL_TYPES = ("smollm3",)  # layers that leave RoPE out where no_rope_layers[i] is 0 (SmolLM3: every 4th)

# checkpoint names a family's releases use for our modules, as (pattern, our name) substitutions (Mixtral's sparse
# block and its experts' w1, w3, w2)
_CHECKPOINT_NAMES = {"mixtral": tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.block_sparse_moe\.", ".mlp."), (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
    (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."), (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj.")))}
# MiniMax-M2's release: Mixtral's names, and the router's correction bias on the block
_CHECKPOINT_NAMES["minimax_m2"] = _CHECKPOINT_NAMES["mixtral"] + (
    (re.compile(r"\.mlp\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),)
# Phi-3.5-MoE's release: Mixtral's names; transformers' own (a GGUF's, converted through its model's names) call the
# router ``router``
_CHECKPOINT_NAMES["phimoe"] = _CHECKPOINT_NAMES["mixtral"] + ((re.compile(r"\.mlp\.router\."), ".mlp.gate."),)
# Hunyuan-A13B's router: gate.wg
_CHECKPOINT_NAMES["hunyuan_v1_moe"] = ((re.compile(r"\.mlp\.gate\.wg\."), ".mlp.gate."),)
# Apertus: its norms' names for Llama's
_CHECKPOINT_NAMES["apertus"] = ((re.compile(r"\.attention_layernorm\."), ".input_layernorm."),
                                (re.compile(r"\.feedforward_layernorm\."), ".post_attention_layernorm."))
# Granite's MoE release: Mixtral's block name, the experts fused as input_linear ([E, 2I, H], gate then up) and
# output_linear ([E, H, I]), the router's weight under router.layer
_CHECKPOINT_NAMES["granitemoe"] = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.block_sparse_moe\.input_linear\.weight$", ".mlp.experts.gate_up_proj"),
    (r"\.block_sparse_moe\.output_linear\.weight$", ".mlp.experts.down_proj"),
    (r"\.block_sparse_moe\.router\.layer\.", ".mlp.router."), (r"\.block_sparse_moe\.", ".mlp.")))
# Granite's shared MoE: Granite's MoE names, and its shared MLP beside the block (its fused input_linear unfused
# first: FUSED_MODEL_TYPES)
_CHECKPOINT_NAMES["granitemoeshared"] = (
    (re.compile(r"\.shared_mlp\.(gate|up)_proj\."), r".mlp.shared_mlp.\1_proj."),
    (re.compile(r"\.shared_mlp\.output_linear\."), ".mlp.shared_mlp.down_proj."),
    *_CHECKPOINT_NAMES["granitemoe"])
# K-EXAONE's release (and transformers' save): the router's correction bias on the block
_CHECKPOINT_NAMES["exaone_moe"] = (
    (re.compile(r"\.mlp\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),)
# ERNIE 4.5's MoE release: the router's correction bias in moe_statics (transformers: under the gate)
_CHECKPOINT_NAMES["ernie4_5_moe"] = (
    (re.compile(r"\.mlp\.(?:gate\.)?moe_statics\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),)
# Hunyuan 3's release: the router, its correction bias and the shared experts under names of their own
_CHECKPOINT_NAMES["hy_v3"] = tuple((re.compile(pattern), ours) for pattern, ours in (
    (r"\.mlp\.router\.gate\.", ".mlp.gate."), (r"\.mlp\.(?:expert_bias|e_score_correction_bias)$",
                                                  ".mlp.gate.e_score_correction_bias"),
    (r"\.mlp\.shared_mlp\.", ".mlp.shared_experts.")))


# checkpoints storing projections fused: q/k/v as one qkv_proj and gate/up as one gate_up_proj (Phi-3), or gate/up
# alone (GLM, GLM-4; Granite's shared MoE its shared MLP's, as input_linear)
FUSED_MODEL_TYPES = {"phi3": (".qkv_proj.", ".gate_up_proj."), "glm": (".gate_up_proj.",),
                     "glm4": (".gate_up_proj.",), "granitemoeshared": (".shared_mlp.input_linear.",),
                     "granitemoe_swa": (".shared_mlp.input_linear.",),
                     "granitemoehybrid": (".shared_mlp.input_linear.",)}
# Granite's multipliers (module docstring)
SCALED_MODEL_TYPES = ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "hyperclovax", "granite_swa",
                      "granitemoe_swa")


def multiplier(config, name: str) -> float:
    """A Granite multiplier of ``config`` (1 for other families, which have none); MiniCPM3's scales as Granite's
    multipliers (``embedding_multiplier``: ``scale_emb``; ``residual_multiplier``: ``scale_depth / sqrt(layers)``;
    ``logits_scaling``: ``hidden_size / dim_model_base``)."""
    if config.model_type == "minicpm3":
        derived = {"embedding_multiplier": float(config.scale_emb),
                   "residual_multiplier": config.scale_depth / config.num_hidden_layers ** 0.5,
                   "logits_scaling": config.hidden_size / config.dim_model_base}
        return derived.get(name, 1.0)
    return float(getattr(config, name, 1.0)) if config.model_type in SCALED_MODEL_TYPES else 1.0


def fused_pieces(config) -> dict[str, tuple[tuple[str, int], ...]]:
    """A fused checkpoint's projections (Phi-3's, GLM-4's): its name piece -> the pieces it stacks, with each one's
    rows."""
    fused = FUSED_MODEL_TYPES.get(config.model_type, ())
    if not fused:  # (nor read the sizes: a heterogeneous config, Gemma 4's, has no global head_dim)
        return {}
    d, inter = _head_dim(config), config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shared = getattr(config, "shared_intermediate_size", 0)
    pieces = {".qkv_proj.": ((".q_proj.", q), (".k_proj.", kv), (".v_proj.", kv)),
              ".gate_up_proj.": ((".gate_proj.", inter), (".up_proj.", inter)),
              ".shared_mlp.input_linear.": ((".shared_mlp.gate_proj.", shared), (".shared_mlp.up_proj.", shared))}
    return {piece: parts for piece, parts in pieces.items() if piece in fused}


def unfuse(name: str, tensor: Any, pieces: dict[str, tuple[tuple[str, int], ...]]) -> list[tuple[str, Any]]:
    """A checkpoint tensor as the unfused ones it stacks along its rows (a fused projection's weight or bias, or a
    LoRA adapter's B), each named as an unfused checkpoint names it; any other tensor as it is."""
    for piece, parts in pieces.items():
        if piece not in name:
            continue
        rows = tensor.shape[0] if isinstance(tensor, torch.Tensor) else tensor.get_shape()[0]
        if rows != sum(n for _, n in parts):
            raise ValueError(f"checkpoint tensor {name} has {rows} rows where its config's heads and widths make "
                             f"{sum(n for _, n in parts)}: the checkpoint does not match its config.json")
        starts = [sum(n for _, n in parts[:i]) for i in range(len(parts))]
        cut = tensor.rows if isinstance(tensor, IntWeight) else lambda start, n: tensor[start: start + n]
        return [(name.replace(piece, part), cut(start, n)) for (part, n), start in zip(parts, starts)]
    return [(name, tensor)]


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _sliding_window(config, layer: int) -> int | None:
    """Mistral: every layer when ``sliding_window`` is set; Qwen2 (and configs with ``layer_types``): the
    "sliding_attention" layers; Llama: never (transformers' Llama ignores the field)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if config.model_type in PLAIN_LAYER_MODEL_TYPES and layer < len(layer_types or ()) \
            and layer_types[layer] not in PLAIN_LAYER_TYPES:
        raise ValueError(f"layer_types[{layer}]={layer_types[layer]!r} is not supported for model_type="
                         f"{config.model_type!r}; its layers are one of {list(PLAIN_LAYER_TYPES)} (a sliding one "
                         "attending sliding_window positions back)")
    if window is None or config.model_type == "llama":
        return None
    if layer_types is not None:
        return window if layer_types[layer] == "sliding_attention" else None
    return window


def _uses_bias(config) -> bool:
    """ERNIE 4.5's and StarCoder2's ``use_bias``: a bias on every projection of every layer."""
    return config.model_type in USE_BIAS_MODEL_TYPES and bool(getattr(config, "use_bias", False))


def _uses_rope(config, layer: int) -> bool:
    """Whether layer ``layer`` rotates q and k: always, but for SmolLM3's NoPE layers (``no_rope_layers``, one
    flag per layer, 1 where the layer uses RoPE), EXAONE 4.0's, K-EXAONE's and Kolibri-1's global layers where they
    have sliding ones, and Cohere2's, Trinity's and Flint's global layers (their sliding ones alone use RoPE; Command
    A+'s dense prefix too, when global)."""
    if config.model_type in ("exaone4", "exaone_moe", "kolibri1"):
        return getattr(config, "sliding_window", None) is None or _sliding_window(config, layer) is not None
    if config.model_type in ("cohere2", "afmoe", "flint"):
        return _sliding_window(config, layer) is not None
    if config.model_type == "cohere2_moe":  # (its dense prefix layers too where all of them are global)
        forced = config.mlp_layer_types[layer] == "dense" and config.prefix_dense_sliding_window_pattern == 1
        return _sliding_window(config, layer) is not None or forced
    if config.model_type == "granitemoehybrid":  # Granite 4.0's hybrids: NoPE unless position_embedding_type says
        return getattr(config, "position_embedding_type", None) == "rope"
    if config.model_type in ("nemotron_h", "jamba"):  # their attention layers have no positional encoding
        return False
    if config.model_type not in NO_ROPE_MODEL_TYPES:
        return True
    flags = config.no_rope_layers
    if len(flags) != config.num_hidden_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} flags for num_hidden_layers={config.num_hidden_layers}: "
                         "give one per layer (1: the layer uses RoPE, 0: it does not), or leave it out for one NoPE "
                         "layer every no_rope_layer_interval layers")
    return bool(flags[layer])


def _kv_spec(config, layer: int, qkv: QKVParallelLinear) -> FullAttentionSpec:
    """What layer ``layer`` caches on this rank: its KV heads, and a sliding window where it has one."""
    heads = dict(num_kv_heads=qkv.num_kv_heads, head_dim=qkv.head_dim, kv_head_start=qkv.kv_head_start)
    window = _sliding_window(config, layer)
    return FullAttentionSpec(**heads) if window is None else SlidingWindowSpec(**heads, sliding_window=window)


def attention_projections(module: nn.Module, config, tp: TPGroup) -> int:
    """Give an attention ``module`` of the config's heads (``attention_bias`` on q/k/v and o) its ``qkv_proj`` and
    ``o_proj`` over ``tp``, and its ``num_heads``, ``num_kv_heads`` (this rank's) and ``head_dim``; returns
    ``head_dim``."""
    head_dim = _head_dim(config)
    bias = bool(getattr(config, "attention_bias", False))
    module.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                        config.num_key_value_heads, tp, bias=bias)
    module.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, tp, bias=bias)
    module.num_heads, module.num_kv_heads = module.qkv_proj.num_heads, module.qkv_proj.num_kv_heads
    module.head_dim = head_dim
    return head_dim


class LlamaAttention(nn.Module):
    use_rope = True  # whether q and k are rotated (SmolLM3's NoPE layers: not; subclasses building their own keep it)
    interleaved_rope = False  # whether RoPE rotates the pairs (0, 1), (2, 3), ... (ERNIE 4.5), else the two halves
    query_scaling: tuple[float, int] | None = None  # (beta, L0): queries scaled by position (Ministral 3)
    clip_qkv: float | None = None  # q, k and v clamped to +-clip_qkv as projected (OLMo)

    def __init__(self, config, tp: TPGroup, layer: int, input_size: int | None = None):
        # input_size: the width q/k/v are projected from (the hidden size; an EAGLE-3 head's first layer: twice it)
        super().__init__()
        head_dim = _head_dim(config)
        is_qwen2 = config.model_type in QKV_BIAS_MODEL_TYPES  # q/k/v biases (Qwen2-MoE's: its qkv_bias)
        attention_bias = bool(getattr(config, "attention_bias", False)) or _uses_bias(config)
        qkv_bias = attention_bias or (is_qwen2 and bool(getattr(config, "qkv_bias", True)))
        o_bias = bool(getattr(config, "attention_out_bias", attention_bias))  # Seed-OSS: o's own flag (off)
        self.qkv_proj = QKVParallelLinear(input_size or config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, tp, bias=qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, tp,
                                        bias=o_bias and not is_qwen2)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        qk_norm = config.model_type in QK_NORM_MODEL_TYPES
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        scale = multiplier(config, "attention_multiplier") if config.model_type in SCALED_MODEL_TYPES \
            else head_dim**-0.5
        self.attn = PagedAttention(self.num_heads, _kv_spec(config, layer, self.qkv_proj), scale)
        self.use_rope = _uses_rope(config, layer)
        self.interleaved_rope = config.model_type in INTERLEAVED_ROPE_MODEL_TYPES
        self.query_scaling = position_query_scaling(config)  # Ministral 3's queries scaled by position
        self.clip_qkv = getattr(config, "clip_qkv", None)
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ValueError(f"clip_qkv={self.clip_qkv} must be a positive number, or null for no clamp")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, 1, D/2] -> [T, H]
        return self.o_proj(self.attn(*self.project(x, cos, sin, meta), meta))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] of the rows ``x`` [T, H], normed and rotated as the layer does."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        qk = qkv[:, : q_size + kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # each head normed over its D before RoPE (Qwen3)
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        if self.use_rope:
            if self.interleaved_rope:  # pair (2i, 2i + 1) of the R rotated features is the de-interleaved pair
                r = 2 * cos.shape[-1]  # (i, R/2 + i): q and k permuted alike, q.k is unchanged
                qk = torch.cat((qk[..., 0:r:2], qk[..., 1:r:2], qk[..., r:]), dim=-1)
            qk = apply_rotary(qk, cos, sin)  # rotate q and k in one go
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if self.query_scaling is not None:
            q = scale_queries(q, meta.positions, self.query_scaling)
        v = qkv[:, q_size + kv_size :].view(t, self.num_kv_heads, self.head_dim)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, config, tp: TPGroup, intermediate_size: int | None = None):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported; the Llama family uses 'silu'")
        bias = bool(getattr(config, "mlp_bias", False)) or _uses_bias(config)
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], tp, bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, tp, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def _is_sparse(config, layer: int) -> bool:
    """Qwen3-MoE and Qwen2-MoE: a layer whose MLP is the experts' (every ``decoder_sparse_step``-th, except
    ``mlp_only_layers``); Mixtral: every layer; ERNIE 4.5's MoE: every ``moe_layer_interval``-th from
    ``moe_layer_start_index`` to ``moe_layer_end_index``; K-EXAONE: the layers ``mlp_layer_types`` names "sparse"."""
    if config.model_type in ("mixtral", "granitemoe", "granitemoeshared", "granitemoe_swa", "phimoe"):
        return True
    if config.model_type == "exaone_moe":
        return config.mlp_layer_types[layer] == "sparse"
    if config.model_type == "granitemoehybrid":  # its dense releases: no experts (the shared MLP alone)
        return bool(getattr(config, "num_local_experts", 0))
    if config.model_type == "ernie4_5_moe":
        end = config.moe_layer_end_index
        end = config.num_hidden_layers - 1 if end == -1 else end
        sparse = (layer + 1) % config.moe_layer_interval == 0 and config.moe_layer_start_index <= layer <= end
        if sparse and _uses_bias(config):
            raise ValueError("use_bias=True with experts is not supported for model_type='ernie4_5_moe' (the shared "
                             "experts' biases); load a release without use_bias")
        return sparse
    if config.model_type not in SPARSE_MODEL_TYPES or not getattr(config, "num_experts", 0):
        return False
    return layer not in (config.mlp_only_layers or []) and (layer + 1) % config.decoder_sparse_step == 0


def add_deepstack(x: torch.Tensor, residual: torch.Tensor, layer: int, meta: AttentionMetadata,
                  stage: range) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepStack (Qwen3-VL's images): after layer ``layer`` < k the image rows (``meta.input_embeds``' rows) add
    that layer's features ``meta.deepstack_embeds[layer]`` [n, H] to their hidden states, as transformers does to the
    layer's output. The stream is summed first (``x + residual``: the layers add the residual lazily) and handed on
    whole as the residual, with x zero, so the addition lands where transformers' does, in its order."""
    embeds = meta.deepstack_embeds
    assert stage.start > 0 or embeds.shape[0] <= len(stage), "the encoder's check_split refuses such a split"
    if layer >= embeds.shape[0]:
        return x, residual
    stream = (x + residual).index_add(0, meta.input_embeds[0], embeds[layer].to(x.dtype))
    return torch.zeros_like(x), stream


def norm_stream(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's input: the stream ``x + residual`` (``x`` alone at the first layer) normed, and the stream."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


class LlamaDecoderLayer(nn.Module):
    residual_multiplier = 1.0  # Granite's (the families built on this layer's forward keep 1)
    attention_class: type[nn.Module] = LlamaAttention  # (a family with Llama's layer and its own attention: that)
    mlp_class: type[nn.Module] = LlamaMLP  # a dense layer's MLP, built from (config, tp) (a family's own: that)

    def __init__(self, config, tp: TPGroup, layer: int, expert_parallel: bool = False):
        super().__init__()
        self.build_mixer(config, tp, layer)
        self.mlp = self.build_mlp(config, tp, layer, expert_parallel)
        self.input_layernorm = self.build_norm(config)
        self.post_attention_layernorm = self.build_norm(config)
        self.residual_multiplier = multiplier(config, "residual_multiplier")

    def build_mixer(self, config, tp: TPGroup, layer: int) -> None:
        """Give the layer its token mixer (:meth:`mix` runs it): attention, ``self_attn`` (a hybrid family's
        recurrent layers give theirs: :mod:`specray.models.mamba_hybrid`, :mod:`specray.models.lfm2`)."""
        self.self_attn = self.attention_class(config, tp, layer)

    @staticmethod
    def build_norm(config) -> nn.Module:
        """The norm before each block, and after the last layer (a family with another kind of norm gives its own)."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    @classmethod
    def build_mlp(cls, config, tp: TPGroup, layer: int, expert_parallel: bool) -> nn.Module:
        """Layer ``layer``'s MLP: the experts where the config makes it sparse, else the dense one."""
        return SparseMoE(config, tp, expert_parallel) if _is_sparse(config, layer) else cls.mlp_class(config, tp)

    def mix(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The layer's token mixer on the normed stream [T, H]: attention (a hybrid family's recurrent layers give
        their own: :mod:`specray.models.mamba_hybrid`)."""
        return self.self_attn(x, cos, sin, meta)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, H]; each block's output joins the residual stream (in the next norm) times the multiplier
        x, residual = norm_stream(self.input_layernorm, x, residual)
        x = self.mix(x, cos, sin, meta)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        return (x if self.residual_multiplier == 1.0 else x * self.residual_multiplier), residual


class StageModel(nn.Module):
    """A decoder stack's pipeline-stage plumbing: this stage's layers (the others' are
    :class:`~specray.models.layers.OtherStage` placeholders), the embedding on the first stage, the final norm on the
    last (one stage: all of it)."""

    def build_stage(self, config, pp: PPGroup | None, layer: Callable[[int], nn.Module],
                    embed: Callable[[], nn.Module], norm: Callable[[], nn.Module]) -> None:
        self.pp = pp or PPGroup.single()
        self.stage = self.pp.layers(config.num_hidden_layers)  # the layer indices this stage runs
        self.embed_tokens = on_stage(self.pp.holds_embedding, embed)
        self.layers = nn.ModuleList([on_stage(i in self.stage, lambda i=i: layer(i))
                                     for i in range(config.num_hidden_layers)])
        self.norm = on_stage(self.pp.is_last, norm)

    def stage_layers(self) -> list[tuple[int, nn.Module]]:
        return [(i, self.layers[i]) for i in self.stage]


class LlamaModel(StageModel):
    embedding_multiplier = 1.0  # Granite's (the families built on this stack's forward keep 1)
    layer_class: type[nn.Module] = LlamaDecoderLayer  # a family with other layers on this stack gives its own

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, pp: PPGroup | None = None):
        super().__init__()
        self.build_stage(config, pp, lambda i: self.layer_class(config, tp, i, expert_parallel),
                         lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp),
                         lambda: self.final_norm(config))
        rope = rope_parameters(config, partial=True)
        self.rotary_emb = RotaryEmbedding(rotary_dim(self.rope_head_dim(config), rope), rope, max_positions(config))
        self.embedding_multiplier = multiplier(config, "embedding_multiplier")

    @staticmethod
    def rope_head_dim(config) -> int:
        """The head size the RoPE tables are built for (a stack with no attention layer gives any)."""
        return _head_dim(config)

    @classmethod
    def final_norm(cls, config) -> nn.Module:
        """The norm after the last layer: the layers' kind (their ``build_norm``), else an RMSNorm."""
        build = getattr(cls.layer_class, "build_norm", None)
        return build(config) if build is not None else RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, H], scaled by Granite's multiplier
        x = self.embed_tokens(input_ids)
        return x if self.embedding_multiplier == 1.0 else x * self.embedding_multiplier

    def embed_step(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's input [T, H]: the tokens' embeddings (a family with learned positions adds theirs), image
        embeddings in place of their placeholders' (``meta.input_embeds``), scaled as the tokens' by Granite's
        multiplier (transformers' Granite multiplies its whole input embeddings, images' and audios' rows included:
        granite-vision, Granite Speech)."""
        return meta.with_input_embeds(self.embed(input_ids), self.embedding_multiplier)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # input_ids: [T] -> hidden [T, H], and the residual stream [T, H] entering each layer of aux_layers. A stage
        # after the first starts from the previous stage's (x, residual) ``intermediate`` [2, T, H]; a stage before
        # the last ends there, returning its own (unnormed)
        if intermediate is None:
            x, residual = self.embed_step(input_ids, meta), None
        else:
            x, residual = intermediate.unbind(0)
        rope = self.rope_tables(meta, x.dtype)
        aux: dict[int, torch.Tensor] = {}
        for i, layer in self.stage_layers():
            if i in aux_layers:
                aux[i] = x if residual is None else x + residual  # the layers add the residual lazily
            x, residual = layer(x, residual, *rope(i), meta)
            if meta.deepstack_embeds is not None:
                x, residual = add_deepstack(x, residual, i, meta, self.stage)
        if not self.pp.is_last:
            return torch.stack((x, residual)), [aux[i] for i in aux_layers]
        if len(self.layers) in aux_layers:  # the residual stream past the last layer, before the norm (aux_past_end)
            aux[len(self.layers)] = x if residual is None else x + residual
        x, _ = self.norm(x, residual)
        return x, [aux[i] for i in aux_layers]


    def rope_tables(self, meta: AttentionMetadata, dtype: torch.dtype) -> Callable[[int], tuple[torch.Tensor, ...]]:
        """Layer index -> its RoPE (cos, sin) at the step's positions: one table for every layer here (a family
        whose kinds of layer rotate differently gives each kind its own: OLMo 3)."""
        self.rotary_emb.ensure(meta.max_position + 1)
        if meta.rope_positions is not None:  # multimodal RoPE (Qwen2-VL's images): three position ids per token
            tables = self.rotary_emb.multimodal(meta.rope_positions, dtype)
        else:
            tables = self.rotary_emb(meta.positions, dtype)
        return lambda layer: tables


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE for causal LM, sharded over ``tp`` (a MoE's experts split by
    width, or whole experts per rank with ``expert_parallel``). Build it under ``torch.device(...)`` and the
    default dtype you want (see :func:`specray.models.loader.load_model`), then :meth:`load_weights`."""

    model_class: type[nn.Module] = LlamaModel  # the decoder stack (a family with other layers gives its own)
    stage_width: int = 2  # tensors [T, H] one pipeline stage hands the next: the layer output and the residual
    stacked: dict[str, tuple[str, Any]] = _STACKED  # checkpoint names merged into one parameter
    # the decoder layers' projections that take LoRA adapters (their checkpoint names; specray.models.lora)
    lora_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    may_tie = True  # whether tie_word_embeddings makes the embedding the head (Nemotron-H's never is, as transformers)
    one_stage: str | None = None  # why the family runs on one pipeline stage only (refuse_stages), or None
    skipped: tuple[str, ...] = ()  # checkpoint names never read into the model (a release's MTP modules: the drafter's)
    # whether a drafter may ask for aux layer num_hidden_layers: the residual past the last layer, where an MTP layer
    # of DeepSeek-V4's reads its streams (on the last pipeline stage)
    aux_past_end = False
    caps_logits = False  # whether the config's final_logit_softcapping caps the logits (Gemma 2 / 3, Beam, nanochat)

    @classmethod
    def head_rows(cls, hf_config) -> int:
        """How many ids the LM head scores: the whole vocabulary (a family whose head scores only the vocabulary's
        first ids says how many, and widens its logits back with :func:`~specray.models.layers.widen_to_vocab`)."""
        return hf_config.vocab_size

    @classmethod
    def refuse_stages(cls, config, pp: int) -> None:
        """A family that runs on one stage only (``one_stage`` says why) refuses ``pp`` > 1 by name: the engine's
        split check calls it before any rank starts, and the constructor for a model loaded directly."""
        if pp > 1 and cls.one_stage:
            raise ValueError(f"pipeline_parallel_size={pp} is not supported for model_type={config.model_type!r} "
                             f"({cls.one_stage}); use pipeline_parallel_size=1")

    def __init__(self, hf_config, tp: TPGroup | None = None, expert_parallel: bool = False,
                 pp: PPGroup | None = None):
        super().__init__()
        self.refuse_stages(hf_config, (pp or PPGroup.single()).size)
        tp = tp or TPGroup.single()
        self.config = hf_config
        self.tp = tp
        self.pp = pp = pp or PPGroup.single()
        self.model = self.model_class(hf_config, tp, expert_parallel, pp)
        bias = bool(getattr(hf_config, "lm_head_bias", False))  # Phi-3.5-MoE's
        self.lm_head = on_stage(pp.is_last, lambda: ParallelLMHead(self.head_rows(hf_config), hf_config.hidden_size,
                                                                   tp, bias=bias))
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False)) and self.may_tie
        # tied on a stage holding both: the embedding is the head; a last stage without the embedding loads the
        # embedding's tensor into a head of its own
        self.shares_embedding = self.tie_word_embeddings and pp.holds_embedding and pp.is_last
        if self.shares_embedding:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.other_stage = other_stage_prefixes(self)  # checkpoint names this stage skips
        self.renames = _CHECKPOINT_NAMES.get(hf_config.model_type, ())
        self.fused = fused_pieces(hf_config)
        self.logits_scaling = multiplier(hf_config, "logits_scaling")
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None) if self.caps_logits else None
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:  # (0: NaN logits)
            raise ValueError(f"final_logit_softcapping={self.final_logit_softcapping} must be a positive number, or "
                             "null for no cap")
        self.kv_cache_allocated = False

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return max_positions(self.config)

    @property
    def dtype(self) -> torch.dtype:
        return self._a_norm().dtype

    @property
    def device(self) -> torch.device:
        return self._a_norm().device

    def _a_norm(self) -> torch.Tensor:
        """A weight every stage holds in the model's dtype (linears may be packed, experts kept in FP8)."""
        return self.model.layers[self.model.stage.start].input_layernorm.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] int64 -> [T, H]
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """The final hidden states; with ``aux_layers`` also the residual stream entering those layers (see
        :class:`specray.models.interface.CausalLM`)."""
        # input_ids: [T] int64 -> hidden [T, H] (and [T, H] per aux layer)
        if not self.kv_cache_allocated:
            raise ValueError("the KV cache is not allocated: call specray.models.kv_cache.allocate_kv_cache(model, "
                             "num_blocks, block_size) before the first forward")
        num_layers = len(self.model.layers) + self.aux_past_end
        if any(not 0 <= i < num_layers for i in aux_layers):
            raise ValueError(f"aux_layers={tuple(aux_layers)}: layer indices must lie in [0, {num_layers})")
        if self.pp.size == 1:
            hidden, aux = self.model(input_ids, meta, aux_layers)
        else:
            out = self._stage_forward(input_ids, meta, aux_layers)
            if out is None:
                return None
            hidden, aux = out
        return (hidden, aux) if aux_layers else hidden

    def _stage_forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, aux_layers: Sequence[int]
                       ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """One pipeline stage's part: receive the previous stage's output (every rank knows its shape from the plan
        and ``aux_layers``), run this stage's layers, and hand the result on, with the residual stream entering each
        of ``aux_layers`` so far; the last stage returns (hidden, aux) as one stage would, the others None."""
        stage, width = self.model.stage, self.stage_width
        carried = sorted(i for i in set(aux_layers) if i < stage.start)  # from earlier stages, in layer order
        past_end = len(self.model.layers) if self.pp.is_last else None  # the residual after the last layer
        mine = sorted(i for i in set(aux_layers) if i in stage or i == past_end)
        intermediate = None
        if not self.pp.is_first:
            shape = (width + len(carried), input_ids.shape[0], self.config.hidden_size)
            intermediate = self.pp.recv(shape, self.dtype, self.device)
        hidden, own = self.model(input_ids, meta, mine, None if intermediate is None else intermediate[:width])
        if not self.pp.is_last:  # [width + carried + own, T, H], the streams in layer order
            parts = [hidden] + ([intermediate[width:]] if carried else []) + ([torch.stack(own)] if own else [])
            self.pp.send(torch.cat(parts) if len(parts) > 1 else hidden)
            return None
        streams = dict(zip(carried, intermediate[width:])) if carried else {}
        streams.update(zip(mine, own))
        return hidden, [streams[i] for i in aux_layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> [N, V] float32, full vocab on every rank (Granite's divided by its logits_scaling; a family
        # with caps_logits capped by its config's final_logit_softcapping, cap * tanh(logits / cap))
        logits = self.lm_head(hidden).float()
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        cap = self.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    # ------------------------------------------------------------------------------------------ KV cache

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One spec per attention layer, in layer order: what each caches on this rank."""
        return [layer.self_attn.attn.kv_spec for _, layer in self.model.stage_layers()]

    def bind_kv_cache(self, cache: KVCache) -> None:
        """Attend over ``cache`` (allocated for :meth:`kv_cache_specs` by its owner, see
        :func:`specray.models.kv_cache.allocate_kv_cache`)."""
        assert cache.specs == self.kv_cache_specs(), "the cache was allocated for another model's specs"
        for j, (_, layer) in enumerate(self.model.stage_layers()):
            layer.self_attn.attn.bind_cache(cache.layer(j), cache.block_size, cache.fp8)
        self.kv_cache_allocated = True

    # ------------------------------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load HF-named checkpoint tensors (torch tensors or safetensors slices), keeping this rank's shard."""
        if any(getattr(m, "packed", None) is not None for m in self.modules()):
            raise ValueError("this model's linear weights are packed for CPU inference (load_model packs them); "
                             "load weights into a fresh model, or build it with load_model(..., pack=False)")
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        kv_scales: dict[int, dict[str, float]] = {}  # layer -> the checkpoint's K/V scales (an FP8 KV cache's)
        unused: list[str] = []  # checkpoint tensors with no place in the model
        past_end: dict[int, list[str]] = {}  # layer past the config's last -> its checkpoint tensors
        for name, tensor in self._unfused(weights):
            if name.startswith(self.skipped):
                continue
            theirs, name = name, self._our_name(name)
            if "rotary_emb.inv_freq" in name:
                continue
            if _layer_index(name) >= len(self.model.layers):  # an MTP layer (DeepSeek's layout: the MTP drafter's,
                past_end.setdefault(_layer_index(name), []).append(theirs)  # not ours), or one the config lacks
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding is the head
            if (name == "model.embed_tokens.weight" and self.tie_word_embeddings and self.pp.is_last
                    and not self.shares_embedding):  # a later pipeline stage's head of its own
                loaded.add(load_param(params["lm_head.weight"], "lm_head.weight", tensor, None))
            if name.startswith(self.other_stage):
                continue  # another pipeline stage's (the loader reads only what reads_weight names)
            if name.endswith(KV_SCALE_NAMES):
                kv_scales.setdefault(_layer_index(name), {})[name.rsplit(".", 1)[-1]] = float(materialize(tensor))
                continue
            if is_expert_tensor(name):
                layer = _layer_index(name)
                loaded.update(f"model.layers.{layer}.mlp.{key}"
                              for key in self.model.layers[layer].mlp.load_expert_tensor(name, tensor))
                continue
            target, shard = _map_name(name, self.stacked)
            param = params.get(target)
            if param is None:
                unused.append(theirs)
                continue
            loaded.add(load_param(param, target, tensor, shard))
        self._warn_unused(unused, past_end)  # (first: what it names may explain what is missing)
        self._check_loaded(loaded, params)
        for layer, scales in kv_scales.items():
            both = scales.get("kv_scale", 1.0)
            self.model.layers[layer].self_attn.attn.set_kv_scales(scales.get("k_scale", both),
                                                                  scales.get("v_scale", both))

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in weights:
            yield from unfuse(name, tensor, self.fused) if self.fused else ((name, tensor),)

    def _our_name(self, name: str) -> str:
        """A checkpoint tensor's name as our modules name it (a family's own names renamed)."""
        for theirs, ours in self.renames:
            name = theirs.sub(ours, name)
        return name

    def adapter_module(self, name: str) -> str:
        """A LoRA adapter's module name (the checkpoint's, ``model.layers.0.feed_forward.w1``) as our modules name it
        (``model.layers.0.mlp.gate_proj``: a merged projection's part, by the checkpoint's piece)."""
        return self._our_name(f"{name}.weight").removesuffix(".weight")

    def reads_weight(self, name: str) -> bool:
        """Whether :meth:`load_weights` uses checkpoint tensor ``name`` (or its scale): a pipeline stage skips the
        other stages' layers, embedding, norm and head, but a later stage's own LM head reads a tied embedding."""
        if name.startswith(self.skipped):
            return False
        ours = self._our_name(name)
        if ours.startswith("model.embed_tokens.") and self.tie_word_embeddings and self.pp.is_last:
            return True
        return not ours.startswith(self.other_stage)

    def _warn_unused(self, unused: list[str], past_end: dict[int, list[str]]) -> None:
        """One warning naming the checkpoint tensors the model has no place for (as transformers warns): those of
        no parameter, and the layers past the config's last but for MTP layers (DeepSeek's layout: an ``eh_proj``
        among their tensors), which the MTP drafter reads."""
        extra = [name for names in past_end.values() if not any(".eh_proj." in n for n in names) for name in names]
        if not unused and not extra:
            return
        layers = (f"; the checkpoint has layers past config.json's num_hidden_layers={len(self.model.layers)}: "
                  "does the config match the checkpoint?") if extra else ""
        names = unused + extra
        logger.warning("ignoring checkpoint tensors %s has no place for: %d, e.g. %s%s", type(self).__name__,
                       len(names), names[:5], layers)

    def _check_loaded(self, loaded: set[str], params: dict[str, nn.Parameter]) -> None:
        expected = expected_keys(n for n in params if not (n == "lm_head.weight" and self.shares_embedding)
                                 and not n.endswith(EXPERT_PARAMS))  # experts: by expert, below
        for i, layer in self.model.stage_layers():
            if isinstance(layer.mlp, SparseMoE):
                expected.update(f"model.layers.{i}.mlp.{key}" for key in layer.mlp.expected_keys())
        missing = checkpoint_names(expected - loaded, self.stacked)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}; is it a complete "
                             f"{self.config.model_type} checkpoint matching its config.json?")


def load_param(param: nn.Parameter, name: str, tensor: Any, shard: Any) -> str:
    """Load one checkpoint tensor into parameter ``name`` (this rank's shard of it; ``shard``: which part of a merged
    parameter, or None). Returns the key :func:`expected_keys` names it by."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        _copy_full(param, tensor)
    elif shard is None:
        loader(param, tensor)
    else:
        loader(param, tensor, shard)
    return name if shard is None else f"{name}:{shard}"


def expected_keys(names) -> set[str]:
    """What a complete checkpoint loads into parameters ``names``: one key each, a merged one's parts apart."""
    expected = set()
    for name in names:
        if ".qkv_proj." in name:
            expected.update(f"{name}:{s}" for s in "qkv")
        elif ".gate_up_proj." in name:
            expected.update(f"{name}:{s}" for s in (0, 1))
        else:
            expected.add(name)
    return expected


def checkpoint_names(keys: Iterable[str], stacked: dict[str, tuple[str, Any]] = _STACKED) -> list[str]:
    """Keys of :func:`expected_keys` (missing ones, for a message) as the checkpoint names its tensors, sorted: a
    merged parameter's part by its own name (``gate_proj``, not ``gate_up_proj`` part 0)."""
    names = set()
    for key in keys:
        name, _, part = key.partition(":")
        piece = next((piece for piece, (merged, shard) in stacked.items() if merged in name and str(shard) == part),
                     None) if part else None
        names.add(name.replace(stacked[piece][0], piece) if piece else key)
    return sorted(names)


def _layer_index(name: str) -> int:
    """The decoder layer a checkpoint name belongs to (-1: none)."""
    if not name.startswith("model.layers."):
        return -1
    index = name[len("model.layers."):].split(".", 1)[0]
    return int(index) if index.isdigit() else -1


def _map_name(name: str, stacked: dict[str, tuple[str, Any]] = _STACKED) -> tuple[str, Any]:
    for piece, (merged, shard) in stacked.items():
        if piece in name:
            return name.replace(piece, merged), shard
    return name, None


def _copy_full(param: nn.Parameter, tensor: Any) -> None:
    value = materialize(tensor)
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(value.shape)} does not fit parameter of shape "
                         f"{tuple(param.shape)}: the checkpoint does not match its config.json")
    param.data.copy_(value)
