"""GGUF files of the families llama.cpp's converter writes in a Llama's layout under an architecture of their own, which
transformers' GGUF mapping does not know: Gemma, the first (``gemma``: its norms' weights written as the ``1 + w`` they
scale by, put back; RoPE's base, which the converter leaves out, Gemma's 10000), SmolLM3 (``smollm3``), Arcee's AFM
(``arcee``), the first OLMo (``olmo``: no norm tensors, its LayerNorms having no weights; the q/k/v clamp as
``attention.clamp_kqv``), Granite 3's dense models (``granite``) and MoE models (``granitemoe``: the experts' and the
shared MLP's gate/up, which the converter splits, fused back), Ministral 3 (``mistral3``: YaRN with its log multiplier,
the queries' scaling by position) and Apertus (``apertus``: no RoPE reordering; its xIELU scalars as metadata arrays,
one value per layer, put back as the release's tensors) through its ``LlamaModel``, OLMo 2 (``olmo2``) and OLMo 3 (an
``olmo2`` with sliding-window layers), OLMoE (``olmoe``), Seed-OSS (``seed_oss``), ERNIE 4.5 (``ernie4_5``; its MoE
models as ``ernie4_5-moe``, without the MTP layers the converter leaves out), GLM-4 (``glm4``: its rotated share of each
head as ``rope.dimension_count``), EXAONE 4.0 (``exaone4``: its window and sliding layers as
``attention.sliding_window`` and ``attention.sliding_window_pattern``), Hunyuan's dense models (``hunyuan-dense``: q/k
norms; the RoPE base the converter writes already stretched by the release's NTK alpha, as the release's config would
stretch it) and its MoE models (``hunyuan-moe``: the experts stacked, one shared MLP, both as wide as the file's
``feed_forward_length``), dots.llm1 (``dots1``: a Qwen2-MoE's layout with DeepSeek-V3's sigmoid router, its correction
bias and shared experts), K-EXAONE (``exaone-moe``: EXAONE 4.0's windows, pre-norm layers, DeepSeek-V3's router and
shared experts; the MTP layers the converter keeps, after the model's own, left out), Command R / R+ (``command-r``) and
Command R7B / Command A (``cohere2``: one LayerNorm per layer before parallel attention and MLP, the logit scale, the
window), Jais 2 (``jais2``: LayerNorms with biases, their epsilon as ``attention.layer_norm_epsilon``, the gateless
relu^2 MLP with biases), Trinity (``afmoe``: llama.cpp's fixed pattern of three sliding layers to one global, muP's
embedding scale, its sigmoid-routed, renormalised experts; its converter skips LlamaModel's q/k reordering) and the
text models of Qwen2-VL / Qwen2.5-VL (``qwen2vl``), Qwen3-VL (``qwen3vl``) and
Qwen3-VL-MoE (``qwen3vlmoe``) -- a Qwen2, a Qwen3 and a Qwen3-MoE whose multimodal RoPE (``rope.dimension_sections``)
rotates a text-only sequence as plain RoPE does; the image embeddings, their deepstack layers included, are not read
-- through its plain ``TextModel``, turned back into the HF checkpoints specray loads for them. Experts (OLMoE's,
Qwen3-VL-MoE's, ERNIE 4.5's) are stacked per projection in the file and split back per expert, as the releases name
them.

What the converter writes, read back here: a Llama's metadata (sizes, heads, head size, RoPE base and scaling:
linear, YaRN or Llama 3's per-frequency factors, :func:`~specray.models.gguf_read.rope_parameters`);
for the ``LlamaModel`` families the query and key rows (and biases) of each head in llama.cpp's order for its RoPE
(the two halves interleaved), put back; biases by their tensors' presence; every tensor under the name gguf-py's
tensor map gives the HF name (AFM's gateless MLP has no ``ffn_gate``; OLMo 2's norms come after attention and MLP);
Granite's four multipliers as ``attention.scale``, ``embedding_scale``, ``residual_scale`` and ``logit_scale``.
SmolLM3's NoPE layers are not in the file: llama.cpp fixes them at every 4th layer (``(i + 1) % 4 == 0``), as
SmolLM3's config does (``no_rope_layer_interval`` 4), and so does this reader. OLMo 3's sliding layers rotate by
plain RoPE (the base of ``rope.freq_base_swa``, else the file's one base), as llama.cpp runs them, its full layers by
the file's (YaRN in the long-context releases). Tensors of any llama.cpp type are dequantized to float32.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import (GGUFMeta, GGUFTensors, as_written, by_layer, check_tensor_names, gguf_names,
                                      hf_tensor_names, per_expert, read_model_gguf, rope_parameters, stacked_experts)

logger = logging.getLogger(__name__)

NO_ROPE_LAYER_STEP = 4  # llama.cpp's for SmolLM3 (no GGUF key carries it)
COHERE2_GLOBAL_LAYER_STEP = 4  # llama.cpp's for Cohere2: every 4th layer global (no GGUF key carries it)


def _granite(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, float]:
    """Granite's multipliers (the converter writes each one the config sets; 1, none, where it sets none)."""
    keys = {"attention_multiplier": "attention.scale", "embedding_multiplier": "embedding_scale",
            "residual_multiplier": "residual_scale", "logits_scaling": "logit_scale"}
    return {field: as_written(get(key)) for field, key in keys.items() if get(key, None) is not None}


def _granite_moe(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, Any]:
    """Granite 3 MoE's multipliers and experts (in every layer, each ``feed_forward_length`` wide) and, with its
    shared MLP, that MLP's width."""
    shared = get("expert_shared_feed_forward_length", None)
    return {**_granite(get, tensors), "num_local_experts": int(get("expert_count")),
            "num_experts_per_tok": int(get("expert_used_count")),
            **({"shared_intermediate_size": int(shared)} if shared else {})}


def _apertus(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, str]:
    """Apertus's gateless MLP's activation (the converter writes none: the release's, xIELU)."""
    return {"hidden_act": "xielu"}


def _seed_oss(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, bool]:
    """Seed-OSS's output projection's bias, apart from q/k/v's."""
    return {"attention_out_bias": "blk.0.attn_output.bias" in tensors}


def _olmoe(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, int]:
    """OLMoE's experts (every layer has them; ``intermediate_size`` is each expert's width, as the file's
    ``feed_forward_length``)."""
    return {"num_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count"))}


def _ernie(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, bool]:
    """ERNIE 4.5's one switch for every linear layer's bias."""
    return {"use_bias": "blk.0.attn_q.bias" in tensors}


def _windows(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, Any]:
    """The sliding-window layers: with a window, the sliding ones as ``attention.sliding_window_pattern`` marks them
    (EXAONE 4.0's 32B: RoPE there alone, the global layers have none; OLMo 3: a RoPE per kind of layer); without one
    (EXAONE 4.0's 1.2B), every layer global."""
    layers = get.model_layers()
    window = get("attention.sliding_window", None)
    if not window:
        return {"sliding_window": None, "layer_types": ["full_attention"] * layers}
    pattern = get("attention.sliding_window_pattern")
    if len(pattern) != layers:
        raise ValueError(f"GGUF {str(get.gguf)!r} marks {len(pattern)} layers in "
                         f"{get.arch}.attention.sliding_window_pattern for {layers} layers (block_count); convert the "
                         "model again with a current llama.cpp, or pass its HF checkpoint")
    return {"sliding_window": int(window),
            "layer_types": ["sliding_attention" if sliding else "full_attention" for sliding in pattern]}


def _exaone_moe(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, Any]:
    """K-EXAONE's: EXAONE 4.0's windows; experts after its dense layers (``leading_dense_block_count``) routed as the
    release routes them, by DeepSeek-V3's sigmoid scores plus the correction bias (a file naming another gating
    function is refused), in its groups, the top k renormalised where ``expert_weights_norm`` says and scaled, beside
    its shared experts (``expert_shared_count`` of them, together ``expert_shared_feed_forward_length`` wide)."""
    import gguf as gguf_py

    gating = get("expert_gating_func", None)
    if gating is not None and int(gating) != int(gguf_py.ExpertGatingFuncType.SIGMOID):
        raise ValueError(f"GGUF {str(get.gguf)!r} has exaone-moe.expert_gating_func={gating}; K-EXAONE routes by "
                         "sigmoid. Pass the model's HF checkpoint instead")
    layers, dense = get.model_layers(), int(get("leading_dense_block_count", 0))
    width, shared = int(get("expert_feed_forward_length")), int(get("expert_shared_count", 0))
    if shared and int(get("expert_shared_feed_forward_length", width * shared)) != width * shared:
        raise ValueError(f"GGUF {str(get.gguf)!r} has {shared} shared experts "
                         f"{get('expert_shared_feed_forward_length')} wide together, not {shared} x {width} as "
                         "K-EXAONE's are; convert the model again with a current llama.cpp, or pass its HF checkpoint")
    return {**_windows(get, tensors), "num_experts": int(get("expert_count")),
            "num_experts_per_tok": int(get("expert_used_count")), "moe_intermediate_size": width,
            "num_shared_experts": shared, "first_k_dense_replace": dense,
            "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(layers)],
            "routed_scaling_factor": as_written(get("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(get("expert_weights_norm", False)),
            "n_group": int(get("expert_group_count", 1)), "topk_group": int(get("expert_group_used_count", 1))}


def _ernie_moe(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, Any]:
    """ERNIE 4.5's experts: dense first layers (``leading_dense_block_count``), then a MoE layer every
    ``interleave_moe_layer_step`` to the last, each with its shared experts (as wide as ``moe_intermediate_size``
    times their count, which the file's tensors must show) and the router's correction bias."""
    layers, start = get.model_layers(), int(get("leading_dense_block_count"))
    width, shared = int(get("expert_feed_forward_length")), int(get("expert_shared_count", 0))
    shexp = f"blk.{start}.ffn_gate_shexp.weight"
    if shared and (shexp not in tensors or tensors.shape(shexp)[0] != width * shared):
        raise ValueError(f"GGUF {str(get.gguf)!r} has {shared} shared experts (ernie4_5-moe.expert_shared_count) "
                         f"whose {shexp} is not {shared} x {width} wide, as ERNIE 4.5's are; convert the model again "
                         "with a current llama.cpp, or pass its HF checkpoint")
    return {**_ernie(get, tensors), "moe_num_experts": int(get("expert_count")),
            "moe_k": int(get("expert_used_count")),
            "moe_intermediate_size": width, "moe_num_shared_experts": shared, "moe_layer_start_index": start,
            "moe_layer_interval": int(get("interleave_moe_layer_step")), "moe_layer_end_index": layers - 1}


def _jais2(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, float]:
    """Jais 2's LayerNorms' epsilon (its gateless relu^2 MLP is its config's default: the converter writes no
    activation, llama.cpp fixes it)."""
    return {"layer_norm_eps": as_written(get("attention.layer_norm_epsilon"))}


def _cohere_norms(get: GGUFMeta) -> dict[str, float]:
    """Both Cohere families': their LayerNorms' epsilon and the logit scale."""
    return {"layer_norm_eps": as_written(get("attention.layer_norm_epsilon")),
            "logit_scale": as_written(get("logit_scale"))}


def _cohere(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, Any]:
    """Command R / R+'s norms and logit scale, and (R+) its per-head q/k LayerNorms (their tensors' presence, as
    llama.cpp tells)."""
    return {**_cohere_norms(get), "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors}


def _cohere2(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, Any]:
    """Command R7B / Command A's: Command R's norms and logit scale; three layers of four sliding over the window
    (with RoPE), the fourth global (without), as llama.cpp fixes it for every Cohere2 (no key carries the pattern)."""
    layers = get.model_layers()
    return {**_cohere_norms(get), "sliding_window": int(get("attention.sliding_window")),
            "layer_types": ["sliding_attention" if (i + 1) % COHERE2_GLOBAL_LAYER_STEP else "full_attention"
                            for i in range(layers)]}


def _ministral3_rope(get: GGUFMeta, rope: dict[str, Any]) -> None:
    """Ministral 3's RoPE, besides its YaRN: the log multiplier (``yarn_log_multiplier``: the release's
    ``mscale_all_dim``) with the ``mscale`` llama.cpp takes to be 1, as both are in the releases (llama.cpp's graph
    leaves the cos/sin unscaled, as transformers does with the two equal; a file of another multiplier is refused),
    and its queries scaled by position, ``1 + beta ln(1 + floor(p / L0))`` (``attention.temperature_scale``: the
    release's ``llama_4_scaling_beta``; L0 the YaRN's pretrained length)."""
    if rope.get("mscale_all_dim", 1.0) != 1.0:
        raise ValueError(f"GGUF {str(get.gguf)!r} has mistral3.rope.scaling.yarn_log_multiplier="
                         f"{rope['mscale_all_dim']}; specray reads a Ministral 3 GGUF with the releases' 1 (llama.cpp "
                         "assumes a matching mscale). Pass the model's HF checkpoint instead")
    if rope["rope_type"] == "yarn":
        rope.update(mscale=1.0, mscale_all_dim=1.0)
    beta = get("attention.temperature_scale", None)
    if beta:
        rope["llama_4_scaling_beta"] = as_written(beta)


def _olmo(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, Any]:
    """The first OLMo's clamp of q, k and v as projected (``attention.clamp_kqv``; none where the file has none)."""
    clamp = get("attention.clamp_kqv", None)
    return {"clip_qkv": None if clamp is None else as_written(clamp)}


def _dots1(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, Any]:
    """dots.llm1's experts after its dense layers (``leading_dense_block_count``): DeepSeek-V3's sigmoid scores with
    the router's correction bias, the top k renormalised where ``expert_weights_norm`` says, scaled, beside its shared
    experts; its groups where the converter wrote the release's (``expert_group_count`` and
    ``expert_group_used_count``), else one. A file routing by anything but sigmoid is refused."""
    import gguf as gguf_py

    gating = int(get("expert_gating_func", int(gguf_py.ExpertGatingFuncType.SOFTMAX)))
    if gating != int(gguf_py.ExpertGatingFuncType.SIGMOID):
        raise ValueError(f"GGUF {str(get.gguf)!r} has dots1.expert_gating_func={gating}; dots.llm1 routes by sigmoid "
                         f"({int(gguf_py.ExpertGatingFuncType.SIGMOID)}). Convert the model again with a current "
                         "llama.cpp, or pass its HF checkpoint")
    return {"n_routed_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": int(get("expert_feed_forward_length")),
            "n_shared_experts": int(get("expert_shared_count")),
            "first_k_dense_replace": int(get("leading_dense_block_count")),
            "routed_scaling_factor": as_written(get("expert_weights_scale")),
            "norm_topk_prob": bool(get("expert_weights_norm", False)),
            "n_group": int(get("expert_group_count", 1)), "topk_group": int(get("expert_group_used_count", 1))}


def _hunyuan_moe(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, int]:
    """Hunyuan's MoE experts (in every layer; the top k softmaxed and renormalised) beside its one shared MLP, which
    transformers' Hunyuan builds as wide as each expert (``intermediate_size``), as the release has them: a file of
    other widths, or of several shared experts, is refused."""
    width, shared = int(get("feed_forward_length")), int(get("expert_shared_count", 1))
    expert, shared_width = int(get("expert_feed_forward_length")), int(get("expert_shared_feed_forward_length", width))
    if expert != width or shared_width != width or shared != 1:
        raise ValueError(f"GGUF {str(get.gguf)!r} has experts {expert} wide beside a shared MLP {shared_width} wide "
                         f"({shared} shared; feed_forward_length {width}): specray's Hunyuan MoE, as transformers', "
                         "has one shared MLP as wide as each expert. Pass the model's HF checkpoint instead")
    return {"num_experts": int(get("expert_count")), "moe_topk": int(get("expert_used_count"))}


def _qwen3_moe(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, Any]:
    """Qwen3-MoE's experts (in every layer; llama.cpp renormalises the top k's weights, as the releases do)."""
    return {"num_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": int(get("expert_feed_forward_length")), "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": []}


AFMOE_GLOBAL_LAYER_STEP = 4  # llama.cpp's for Trinity: every 4th layer global, without RoPE (no GGUF key carries it)


def _afmoe(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, Any]:
    """Trinity's (llama.cpp's ``afmoe``): three layers of four sliding over the window (with RoPE), the fourth global
    (without), as llama.cpp fixes it; its dense first layers (``leading_dense_block_count``), then experts routed by
    sigmoid scores plus the correction bias, the top k renormalised and scaled (``expert_weights_scale``), beside its
    shared experts. What transformers' Trinity cannot run (no window, another gating, no renormalisation) is refused."""
    import gguf as gguf_py

    gating = int(get("expert_gating_func", int(gguf_py.ExpertGatingFuncType.SIGMOID)))  # (llama.cpp's default)
    refused = ("afmoe.expert_gating_func", gating) if gating != int(gguf_py.ExpertGatingFuncType.SIGMOID) else \
        ("afmoe.expert_weights_norm", False) if not get("expert_weights_norm", True) else \
        ("afmoe.attention.sliding_window", 0) if not get("attention.sliding_window", 0) else None
    if refused:
        raise ValueError(f"GGUF {str(get.gguf)!r} has {refused[0]}={refused[1]}; specray reads Trinity's (sigmoid "
                         "routing, renormalised, sliding layers with a window). Pass the model's HF checkpoint instead")
    layers = get.model_layers()
    return {"num_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": int(get("expert_feed_forward_length")),
            "num_shared_experts": int(get("expert_shared_count", 0)),
            "num_dense_layers": int(get("leading_dense_block_count", 0)),
            "route_scale": as_written(get("expert_weights_scale", 1.0)),
            "sliding_window": int(get("attention.sliding_window")),
            "layer_types": ["sliding_attention" if (i + 1) % AFMOE_GLOBAL_LAYER_STEP else "full_attention"
                            for i in range(layers)]}


@dataclass(frozen=True)
class _Family:
    config: str  # transformers' config class
    architecture: str  # the HF architecture
    permuted: bool = True  # the converter put q/k rows in llama.cpp's RoPE order (its LlamaModel)
    fixed: dict = field(default_factory=dict)  # what the file cannot say, as llama.cpp fixes it
    own: Callable[[GGUFMeta, GGUFTensors], dict] | None = None  # what the family's own keys and tensors say
    partial_rope: bool = False  # RoPE over a share of each head (``rope.dimension_count`` below the head size)
    windows: bool = False  # sliding-window layers, read by ``own``
    rope_per_kind: bool = False  # the sliding layers' RoPE plain (``rope.freq_base_swa``), the others' as the file's
    # transformers' module names -> the release's, where they differ (transformers renames them as it loads)
    checkpoint_names: tuple[tuple[str, str], ...] = ()
    log_multiplier: str | None = None  # the HF field the converter wrote as YaRN's log multiplier
    # a layer's tensors the converter split or renamed where gguf-py's map cannot say the release's layout: the
    # release's name (after ``model.layers.{i}.``) -> (the GGUF tensors, after ``blk.{i}.``, joined along ``dim``);
    # the transformers modules under ``fused_modules`` are read this way alone, those under ``fused_optional`` only
    # where the file has them
    fused: dict[str, tuple[tuple[str, ...], int]] = field(default_factory=dict)
    fused_modules: tuple[str, ...] = ()
    fused_optional: tuple[str, ...] = ()
    # a layer's tensors the converter wrote as metadata, one value per layer: the release's name (after
    # ``model.layers.{i}.``) -> (the key, without the architecture's prefix, and the tensor's shape)
    from_keys: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    rope_extra: Callable[[GGUFMeta, dict], None] | None = None  # what else of the RoPE the family's own keys say
    norm_shift: float = 0.0  # what the converter added to every norm's weight (Gemma's scale by 1 + w)


# llama.cpp's architecture -> its family
_FAMILIES = {"gemma": _Family("GemmaConfig", "GemmaForCausalLM", permuted=False, norm_shift=1.0),
             "smollm3": _Family("SmolLM3Config", "SmolLM3ForCausalLM",
                                fixed={"no_rope_layer_interval": NO_ROPE_LAYER_STEP, "use_sliding_window": False}),
             "arcee": _Family("ArceeConfig", "ArceeForCausalLM"),
             "granite": _Family("GraniteConfig", "GraniteForCausalLM", own=_granite),
             "olmo": _Family("OlmoConfig", "OlmoForCausalLM", own=_olmo),
             "olmo2": _Family("Olmo2Config", "Olmo2ForCausalLM", permuted=False),
             "olmoe": _Family("OlmoeConfig", "OlmoeForCausalLM", permuted=False, own=_olmoe),
             "seed_oss": _Family("SeedOssConfig", "SeedOssForCausalLM", permuted=False, own=_seed_oss),
             "ernie4_5": _Family("Ernie4_5Config", "Ernie4_5ForCausalLM", permuted=False, own=_ernie),
             "glm4": _Family("Glm4Config", "Glm4ForCausalLM", permuted=False, partial_rope=True),
             "exaone4": _Family("Exaone4Config", "Exaone4ForCausalLM", permuted=False, own=_windows, windows=True),
             "exaone-moe": _Family("ExaoneMoeConfig", "ExaoneMoeForCausalLM", permuted=False, own=_exaone_moe,
                                   windows=True, checkpoint_names=((".mlp.gate.e_score_correction_bias",
                                                                    ".mlp.e_score_correction_bias"),)),
             # the text models of Qwen2-VL / Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE: a Qwen2, a Qwen3, a Qwen3-MoE
             "qwen2vl": _Family("Qwen2Config", "Qwen2ForCausalLM", permuted=False),
             "qwen3vl": _Family("Qwen3Config", "Qwen3ForCausalLM", permuted=False),
             "qwen3vlmoe": _Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", permuted=False, own=_qwen3_moe),
             "ernie4_5-moe": _Family("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", permuted=False, own=_ernie_moe,
                                     checkpoint_names=((".mlp.gate.moe_statics.", ".mlp.moe_statics."),)),
             "command-r": _Family("CohereConfig", "CohereForCausalLM", permuted=False, own=_cohere),
             "cohere2": _Family("Cohere2Config", "Cohere2ForCausalLM", permuted=False, own=_cohere2, windows=True),
             "mistral3": _Family("Ministral3Config", "Ministral3ForCausalLM", log_multiplier="mscale_all_dim",
                                 rope_extra=_ministral3_rope),
             "hunyuan-dense": _Family("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", permuted=False),
             "hunyuan-moe": _Family("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", permuted=False,
                                    own=_hunyuan_moe),
             "dots1": _Family("Dots1Config", "Dots1ForCausalLM", permuted=False, own=_dots1),
             # Apertus: the xIELU activation's four scalars per layer as metadata arrays
             "apertus": _Family("ApertusConfig", "ApertusForCausalLM", permuted=False, own=_apertus,
                                from_keys={f"mlp.act_fn.{name}": (f"xielu.{name}", shape) for name, shape in
                                           (("alpha_n", (1,)), ("alpha_p", (1,)), ("beta", ()), ("eps", ()))}),
             # Jais 2: LayerNorms with biases, AFM's gateless relu^2 MLP (its TextModel: no q/k reordering)
             "jais2": _Family("Jais2Config", "Jais2ForCausalLM", permuted=False, own=_jais2),
             # Trinity: gated attention with q/k norms, sandwich norms, muP's embedding scale (llama.cpp always
             # scales), its windows and experts (its converter skips LlamaModel's q/k reordering)
             "afmoe": _Family("AfmoeConfig", "AfmoeForCausalLM", permuted=False, own=_afmoe, windows=True,
                              fixed={"mup_enabled": True, "global_attn_every_n_layers": AFMOE_GLOBAL_LAYER_STEP})}
# Granite 3's MoE (``granitemoe``), and with a shared expert (GraniteMoeShared): its fused gate/up experts
# (``input_linear`` [E, 2I, H]) split by the converter into ``ffn_gate_exps`` and ``ffn_up_exps``, its shared MLP's
# (``shared_mlp.input_linear`` [2S, H]) into ``ffn_gate_shexp`` and ``ffn_up_shexp``
_GRANITE_MOE_FUSED = {"block_sparse_moe.router.layer.weight": (("ffn_gate_inp.weight",), 0),
                      "block_sparse_moe.input_linear.weight": (("ffn_gate_exps.weight", "ffn_up_exps.weight"), 1),
                      "block_sparse_moe.output_linear.weight": (("ffn_down_exps.weight",), 0),
                      "shared_mlp.input_linear.weight": (("ffn_gate_shexp.weight", "ffn_up_shexp.weight"), 0),
                      "shared_mlp.output_linear.weight": (("ffn_down_shexp.weight",), 0)}
_GRANITE_MOE_SHARED = _Family("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", own=_granite_moe,
                              fused=_GRANITE_MOE_FUSED, fused_modules=("block_sparse_moe.", "shared_mlp."))
_FAMILIES["granitemoe"] = _Family("GraniteMoeConfig", "GraniteMoeForCausalLM", own=_granite_moe,
                                  fused=_GRANITE_MOE_FUSED, fused_modules=("block_sparse_moe.", "shared_mlp."),
                                  fused_optional=("shared_mlp.",))
LLAMA_FAMILY_GGUF_ARCHS = tuple(_FAMILIES)
# OLMo 3, which llama.cpp writes as an OLMo 2 with sliding-window layers: their RoPE is plain, the full layers' YaRN
_OLMO3 = _Family("Olmo3Config", "Olmo3ForCausalLM", permuted=False, own=_windows, windows=True, rope_per_kind=True)


def _family(get: GGUFMeta, tensors: GGUFTensors) -> _Family:
    if get.arch == "olmo2" and get("attention.sliding_window", None):
        return _OLMO3
    if get.arch == "granitemoe" and "blk.0.ffn_gate_shexp.weight" in tensors:
        return _GRANITE_MOE_SHARED
    return _FAMILIES[get.arch]


def llama_family_gguf_config(get: GGUFMeta, tensors: GGUFTensors):
    """The HF config of a family in a Llama's layout from its metadata as llama.cpp's converter writes it."""
    import transformers

    gguf, arch = get.gguf, get.arch
    family = _family(get, tensors)
    if get("attention.sliding_window", None) and not family.windows:
        raise ValueError(f"GGUF {str(gguf)!r} has sliding-window layers ({arch}.attention.sliding_window), which "
                         f"specray does not read from a {arch} GGUF; pass the model's HF checkpoint instead")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rotated = int(get("rope.dimension_count", head_dim))
    if rotated != head_dim and not family.partial_rope:
        raise ValueError(f"GGUF {str(gguf)!r} rotates {rotated} of each head's {head_dim} dims, which specray does not "
                         f"read for {arch}; pass the model's HF checkpoint instead")
    rope = rope_parameters(get, tensors.pop("rope_freqs.weight", None), rotated, family.log_multiplier)
    if family.rope_extra:
        family.rope_extra(get, rope)
    if family.partial_rope:
        rope["partial_rotary_factor"] = rotated / head_dim
    if family.rope_per_kind:  # as llama.cpp runs the sliding layers: no scaling
        sliding = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", rope["rope_theta"]))}
        rope = {"full_attention": rope, "sliding_attention": sliding}
    eps = get("attention.layer_norm_rms_epsilon", None)  # (none in a family of LayerNorms: Cohere's)
    rms_eps = {} if eps is None else {"rms_norm_eps": as_written(eps)}
    config = getattr(transformers, family.config)(
        architectures=[family.architecture], vocab_size=tensors.shape("token_embd.weight")[0], hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")), num_hidden_layers=get.model_layers(),
        num_attention_heads=heads, num_key_value_heads=int(get("attention.head_count_kv")),
        max_position_embeddings=int(get("context_length")),
        rope_parameters=rope, **rms_eps,
        tie_word_embeddings="output.weight" not in tensors, **family.fixed,
        **(family.own(get, tensors) if family.own else {}), **get.token_ids())
    if hasattr(config, "head_dim") or head_dim != hidden // heads:  # (OLMo 2's config has none: hidden / heads)
        config.head_dim = head_dim
    for name, bias in (("attention_bias", "blk.0.attn_q.bias"), ("mlp_bias", "blk.0.ffn_up.bias")):
        if hasattr(config, name):  # (ERNIE 4.5 has one switch of its own: use_bias)
            setattr(config, name, bias in tensors)
    return config


def _per_layer_values(get: GGUFMeta, key: str, layers: int) -> list[float]:
    """A key of one value per layer (written without the architecture's prefix), as float32 values."""
    values = get.meta.get(key)
    if not isinstance(values, list) or len(values) != layers:
        raise ValueError(f"GGUF {str(get.gguf)!r} has {key}={values!r}, not one value for each of its {layers} "
                         "layers as llama.cpp's converter writes it; convert the model again with a current llama.cpp, "
                         "or pass its HF checkpoint")
    return [float(v) for v in values]


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """A query or key projection's rows (or bias) back from llama.cpp's RoPE order: per head, the rows of its
    first and second halves interleaved -> the halves one after the other."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def llama_family_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """The HF config of a GGUF of a family in a Llama's layout and its tensors, a group (the model's own, then a
    layer) at a time, read as the groups are taken."""
    import gguf as gguf_py
    import transformers

    get, tensors = read_model_gguf(gguf, arch)
    family = _family(get, tensors)
    config = llama_family_gguf_config(get, tensors)
    mtp = [name for name in tensors if name.startswith("blk.") and int(name.split(".")[1]) >= config.num_hidden_layers]
    if mtp:
        logger.info("GGUF %s: its %d MTP layers are not read (specray serves no MTP of %s)", gguf,
                    get.mtp_layers(), family.architecture)
        for name in mtp:
            del tensors[name]
    model_class = getattr(transformers, family.architecture)
    hf_names = hf_tensor_names(model_class, config, lambda n: ".mlp.experts." in n
                               or any(f".{module}" in n for module in family.fused_modules)
                               or any(n.endswith(f".{release}") for release in family.from_keys))
    for module_name, checkpoint_name in family.checkpoint_names:
        hf_names = [n.replace(module_name, checkpoint_name) for n in hf_names]
    gguf_arch = {name: value for value, name in gguf_py.MODEL_ARCH_NAMES.items()}[arch]
    layers = config.num_hidden_layers
    names = gguf_names(gguf_arch, layers, hf_names)
    experts = stacked_experts(gguf_arch, layers,
                              [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" in tensors])
    fused = {f"blk.{i}.{part}": (i, release) for i in range(layers) for release, (parts, _) in family.fused.items()
             for part in parts
             if not (release.startswith(family.fused_optional) and f"blk.{i}.{parts[0]}" not in tensors)}
    check_tensor_names(gguf, family.architecture, set(names) | set(experts) | set(fused), tensors)

    keyed = {release: _per_layer_values(get, key, layers) for release, (key, _) in family.from_keys.items()}

    def joined(group: list[str]) -> dict[str, torch.Tensor]:
        """A layer's tensors of ``family.fused``, joined back into the release's, and of ``family.from_keys``."""
        parts = {name: tensors.pop(name) for name in group if name in fused}
        out = {f"model.layers.{i}.{release}": torch.tensor(keyed[release][i]).reshape(shape)
               for i in {int(n.split(".")[1]) for n in group if n.startswith("blk.")}
               for release, (_, shape) in family.from_keys.items()}
        for i, release in {fused[name] for name in parts}:
            names_in_file, dim = family.fused[release]
            out[f"model.layers.{i}.{release}"] = torch.cat([parts[f"blk.{i}.{n}"] for n in names_in_file], dim)
        return out

    def hf_tensors(gguf_name: str) -> dict[str, torch.Tensor]:
        if gguf_name in experts:
            layer, projection = experts[gguf_name]
            return per_expert(tensors.pop(gguf_name), f"model.layers.{layer}.mlp.experts.", projection)
        return {names[gguf_name]: hf_tensor(gguf_name)}

    def hf_tensor(gguf_name: str) -> torch.Tensor:
        value = tensors.pop(gguf_name)
        if family.norm_shift and gguf_name.endswith("norm.weight"):
            return value - family.norm_shift
        if not family.permuted:
            return value
        if ".attn_q." in gguf_name:
            return _unpermute(value, config.num_attention_heads)
        if ".attn_k." in gguf_name:
            return _unpermute(value, config.num_key_value_heads)
        return value

    def groups() -> Iterator[dict[str, torch.Tensor]]:
        for group in by_layer(tensors):
            yield {**joined(group), **{k: v for n in group if n not in fused for k, v in hf_tensors(n).items()}}

    return config, groups()
