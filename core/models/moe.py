"""A sparse mixture-of-experts MLP (Qwen3-MoE's, DeepSeek-V3's), split over tensor-parallel ranks by either of two
rules.

Every token goes to its ``top_k`` experts, and its output is the routing-weighted sum of those experts' SwiGLU MLPs
(plus, DeepSeek, the shared experts' MLP, which every token takes). Routers:

* Qwen3-MoE: softmax over the experts, the top k (renormalised over the chosen ones with ``norm_topk_prob``);
  Mixtral: the same, always renormalised; DBRX: the same, the chosen ones divided by their p-norm
  (``moe_normalize_expert_weights``); Qwen2-MoE: the same, and a shared expert whose output a per-token gate
  scales by sigmoid(x . w);
* DeepSeek-V3 (and GLM-4.5; Mistral 4 with softmax scores and no bias): sigmoid scores; the choice adds
  ``e_score_correction_bias``, keeps the ``topk_group``
  best of ``n_group`` groups (a group's worth: its two best scores), and takes the top k there; the weights are the
  plain scores of the chosen, renormalised with ``norm_topk_prob``, times ``routed_scaling_factor``; in float32;
* Llama-4: the top k router logits, each through a sigmoid; the weight scales the expert's *input* (not its
  output), and a shared expert is added;
* DeepSeek-V4: each expert's score by the config's ``scoring_func`` (``sqrtsoftplus``: sqrt(softplus(logit)),
  ``sigmoid`` or ``softmax``), the top k of score + ``e_score_correction_bias`` (no groups), the chosen scores
  renormalised, times ``routed_scaling_factor``; its first layers are hash-routed (``mlp_layer_types``
  ``hash_moe``): a fixed table from token id to the k experts (``tid2eid``), the weights still the scores. Its
  experts and shared expert clamp SwiGLU's inputs at ``swiglu_limit`` (gate above, up both sides). MiniMax-M2: the
  same routing with sigmoid scores, unscaled;
* Nemotron-H (Nemotron 3): DeepSeek-V3's router; its experts and shared experts have no gate,
  ``down(relu(up(x))^2)``; with ``moe_latent_size`` (Super's) the routed experts work at a latent width, x projected
  down before them (``fc1_latent_proj``) and their sum back up after (``fc2_latent_proj``, linear: each rank
  projects its partial sum before the one all-reduce), the router and shared experts on x;
* GPT-OSS: the router has a bias; a softmax over the top k router logits (the chosen ones only). Its experts have
  biases (the down projection's added once: by one rank when split by width) and a clamped SwiGLU: with gate
  clamped above and up clamped both sides at ``swiglu_limit``, ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``;
  its fused ``gate_up_proj`` interleaves gate and up (gate, up, gate, ...) along its 2I features;
* Command A+: the top k router logits weighted by their softmax (GPT-OSS's) or by their sigmoids renormalised
  (``expert_selection_fn``), shared experts' output added or averaged with the experts' (``(routed + shared) / 2``).

A family may add zero-computation experts (``zero_experts``: LongCat-Flash's ``zero_expert_num``): the router scores
them after the routed ones, and a token's choice of one adds its weight times the token's input, with no matmul.

What differs by family (names, router, where the weight applies, the fused tensors' layout) is one row of
:data:`FAMILIES`.

The ranks all hold
every token (as everywhere in a tensor-parallel model); what they split is the experts' weights:

* tensor parallel (default): every rank holds every expert with its intermediate width split, as a dense MLP's
  (``gate_up`` by columns, ``down`` by rows); each rank's sum is partial and one all-reduce completes it;
* expert parallel (``expert_parallel``, vLLM's ``enable_expert_parallel``): each rank holds ``num_experts / size``
  whole experts and computes only the tokens routed to them; the same all-reduce sums the ranks' parts.

The router is replicated. Tokens are grouped by expert with one sort, and the group sizes are read back to the host
once per layer (the only host sync), then each local expert runs one matmul pair over its tokens. A shared expert
(split by width like a dense MLP) adds its share to the experts' before the block's one all-reduce.

A step replayed from a CUDA graph cannot read sizes back (a capture refuses a host sync), so within
:func:`sync_free_experts` (what :class:`~specray.models.step_graphs.StepGraphs` runs its forwards in) the experts
take a second path with fixed shapes: the (token, choice) pairs sorted by local expert on the device (another rank's
pairs last), each group's end found there, and one grouped matmul per projection over the stacked weights
(``torch._grouped_mm``; its output rows past the last group are left unwritten, and kept out of the sum by a
``where``). On CUDA the grouped matmul is free of host syncs only on its CUTLASS path (bf16 on compute capability
9.x or 10.x; its fallback copies the offsets to the host), and it needs 16-byte strides; where it cannot run so,
:meth:`SparseMoE.graph_blocker` says why and the model's steps run eagerly. Where it can, eager steps take it too
(:meth:`SparseMoE.grouped_eagerly`: a prefill's experts in a few launches, not a pair per expert); elsewhere, and on
a CPU, eager steps keep the loop. The grouped path has run on an H200 inside graphs (2026-11-27); in eager steps
never on a GPU yet.

From a block-FP8 checkpoint (DeepSeek-V3's release) the experts keep their FP8 weights and block scales: half a
bf16 model's bytes where nearly all of them are. An expert's weights are dequantized, block by block, when tokens
reach it (:func:`specray.models.fp8.dequantize_blocks`), to the same values a load-time dequantization gives. This
needs this rank's share of each weight to be whole blocks (for the split by width: ``moe_intermediate_size /
tensor_parallel_size`` a multiple of the block), and a GPU (on CPU, where converting float8 is slow, only with
``cpu_kernels.FP8_EXPERTS``); otherwise the experts are dequantized at load. A checkpoint scaled per row or per
tensor (llm-compressor's ``-FP8-dynamic`` releases) keeps its experts the same way, a scale per row
(:data:`specray.models.fp8.ROW_SCALES`), any share of rows or columns whole. Where the device also multiplies that
release's linears in 8 bits (:mod:`specray.models.w8a8`, :mod:`specray.models.fp8_blocks`), a kept expert's
projections are multiplied so too, its tokens' activations rounded per row or per group of a block's columns, as
vLLM's fused experts do (:meth:`SparseMoE._matmul8`), instead of dequantizing its weights.

From a 4-bit checkpoint in runs of columns (a GPTQ / AWQ / packed release with a tensor per expert, a GGUF's Q4 experts:
:mod:`specray.models.int_quant`, :mod:`specray.models.gguf_quant`) the experts keep their integers likewise, two a
byte with a float32 scale, zero point and offset per group, dequantized when tokens reach an expert to the values a
load-time dequantization gives: on a GPU, or on CPU with ``cpu_kernels.INT4_WEIGHTS``, unless
``$SPECRAY_DEQUANTIZE_INT4`` is set or this rank's share is not whole groups (each projection apart: a GGUF whose down
projections are 6-bit, as Q4_K_M makes some, keeps its gate/up in 4 bits and its down dense).

From an MXFP4 checkpoint (GPT-OSS's releases: :mod:`specray.models.mxfp4`) the experts keep their FP4 codes, two a
byte, and one E8M0 scale byte per group of 32 input columns (a quarter of bf16's bytes), decoded when tokens reach
an expert to the values a load-time dequantization gives: where FP8 experts are kept (a GPU, or on CPU with
``cpu_kernels.FP8_EXPERTS``) and this rank's share is whole groups (split by width: the width per rank a multiple of
32); otherwise dequantized at load. An NVFP4 checkpoint's experts (a tensor per expert: :mod:`specray.models.nvfp4`)
are kept likewise, FP4 codes two a byte and each group of 16 columns' float32 scale (its float8 scale times the
tensor's number), where this rank's share is whole groups of 16.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.cpu_kernels import keeps_fp8_experts
from specray.models.fp8 import (ROW_SCALES, Fp8Weight, config_quantization, dequantize_blocks, dtype_of, fp4_experts,
                                kept_block, w8a8_format)
from specray.models.fp8_blocks import KERNEL_BLOCK, keeps_block_fp8, kernel_scales, matmul_blocks
from specray.models.int_quant import IntWeight, dequantize_packed, experts_int4_group, group_terms, pack_nibbles
from specray.models.mxfp4 import SCALE_BIAS, Mxfp4Expert, Mxfp4Weight, decode as decode_mxfp4, is_mxfp4
from specray.models.nvfp4 import GROUP as NVFP4_GROUP, Nvfp4Weight, decode as decode_nvfp4, nvfp4_layout
from specray.models.w8a8 import FP8, INT8, TILE, RowScaled, keeps_w8a8, matmul_rows
from specray.models.layers import (ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear, _copy, _param,
                                   divide, materialize, narrow, shape_of)
from specray.parallel import TPGroup

logger = logging.getLogger(__name__)
_told_partial: set[str] = set()  # the kinds of kept experts whose warning below was given (once per process each)
# per thread: whether SparseMoE forwards take the sync-free path (a drafter's graphs may be captured in one thread
# while the target's eager steps run in another)
_sync_free = threading.local()
# torch._grouped_mm's kernel with no host sync: CUTLASS's, for bf16 on these compute capabilities' majors
GROUPED_MM_MAJORS = (9, 10)
GROUPED_MM_MAX_GROUPS = 1023  # the kernel's bound on the number of groups


@contextlib.contextmanager
def sync_free_experts():
    """Within it, every :class:`SparseMoE` forward on this thread takes the grouped path, whose shapes do not depend
    on the routing and which never syncs with the host (what a CUDA graph can capture)."""
    before = getattr(_sync_free, "on", False)
    _sync_free.on = True
    try:
        yield
    finally:
        _sync_free.on = before

# a checkpoint's expert tensors: one per expert (HF checkpoints) or all experts fused (transformers 5's own names;
# Llama-4's checkpoints), under the block's name (``mlp``, Llama-4's ``feed_forward``)
_PER_EXPERT = re.compile(r"\.(?:mlp|feed_forward)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_RELEASE_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")  # DeepSeek-V4's release names
MXFP4_GROUP = 32  # an MXFP4 weight's input columns per scale
FP4_MAX = 6.0  # the largest FP4 (e2m1) magnitude
_FUSED = re.compile(r"\.(?:mlp|feed_forward)\.experts\.(gate_up_proj|up_proj|down_proj)(_bias)?$")


@dataclass(frozen=True)
class MoEFamily:
    """How one family's sparse block is named, routed and stored."""

    # "softmax" (Qwen3-MoE), "grouped_sigmoid" (DeepSeek-V3), "topk_sigmoid" (Llama-4), "topk_softmax" (GPT-OSS),
    # "scaled_softmax" (DeepSeek-V2: the softmax's top k, optionally from the best groups, times routed_scaling_factor),
    # "scored" (DeepSeek-V4: the config's scoring_func, the top k of score + bias, renormalised and scaled),
    # "sparsemixer" (Phi-3.5-MoE's, at inference: see SparseMoE._route_sparsemixer)
    routing: str
    num_experts: str  # the config field that counts the routed experts
    expert_width: str  # the config field of one expert's intermediate width
    router: str = "gate"  # the router's module name in the checkpoint
    shared: str | None = None  # the shared expert's module name, if the family has one
    shared_width: str | None = None  # its width: a config field, times n_shared_experts when that exists
    scale_input: bool = False  # the routing weight scales the expert's input (Llama-4), else its output
    fused_in_out: bool = False  # fused tensors are [E, H, 2I] and [E, I, H] (Llama-4), else [E, 2I, H], [E, H, I]
    normalized: bool = False  # the top k weights renormalised when the config has no norm_topk_prob (Mixtral)
    shared_gate: str | None = None  # a gate scaling the shared expert's output by sigmoid(x . w) (Qwen2-MoE)
    biased: bool = False  # the router and the experts' projections have biases (GPT-OSS)
    interleaved: bool = False  # the fused gate_up interleaves gate and up features (GPT-OSS), else gate then up
    clamped: bool = False  # the clamped SwiGLU (swiglu_limit, swiglu_alpha: GPT-OSS), else silu(gate) * up
    gelu: bool = False  # gelu_tanh(gate) * up (Gemma 4), else as above
    clamp_only: bool = False  # silu(gate clamped above) * (up clamped both sides) at swiglu_limit (DeepSeek-V4)
    clamp_shared: bool = True  # with clamp_only, the shared expert's too (Hunyuan 4's is not)
    # the scores' function (SCORES): the "scored" routing's where the config names none (scoring_func), else
    # "sqrtsoftplus"; the grouped routing's ("softmax": Mistral 4, without a correction bias), else "sigmoid"
    scoring: str = ""
    scaling: str = "routed_scaling_factor"  # the config field scaling the "scored" routing's weights (absent: 1)
    # the config field counting the shared experts (their width's multiple; None: the width is the whole)
    shared_count: str | None = "n_shared_experts"
    top_k: str = "num_experts_per_tok"  # the config field of the experts each token takes
    # fused tensors in either layout, told apart by where the hidden size is (Qwen3-VL-MoE: released [E, H, 2I] and
    # [E, I, H], saved by transformers 5 as [E, 2I, H] and [E, H, I]; a square one read as the latter, as there)
    fused_by_shape: bool = False
    # experts and shared experts without a gate, down(relu(up(x))^2) (Nemotron-H's; ``mlp_hidden_act`` "relu2"): w13
    # holds the up rows alone
    gateless: bool = False
    latent: bool = False  # experts over a latent width (moe_latent_size) between two projections (Nemotron-H's)
    # a config field naming how the top k logits are weighted, "softmax" or "sigmoid" (the latter renormalised where
    # norm_topk_prob), in place of the routing's own (Command A+'s expert_selection_fn)
    selection: str | None = None
    # a config field saying how the shared experts' output joins the routed ones': "sum", or "average" (halved)
    shared_combination: str | None = None
    # the "scored" routing's choice: the top k of logit + correction bias (Kolibri-1's), else of score + bias
    bias_on_logits: bool = False
    # a config field capping the router's logits, cap * tanh(logit / cap), where it is > 0 (Laguna's)
    logit_softcap: str | None = None
    # a config field p: the softmax routing's top k weights divided by their p-norm where it is set (DBRX's
    # moe_normalize_expert_weights; p = 1 renormalises them), unless norm_topk_prob renormalises them
    weight_norm: str | None = None
    # a config field counting zero-computation (identity) experts past the routed ones (LongCat-Flash's
    # zero_expert_num): scored by the router with the others; one chosen adds its weight times the token's input
    zero_experts: str | None = None


FAMILIES = {
    "qwen3_moe": MoEFamily("softmax", "num_experts", "moe_intermediate_size"),
    "qwen2_moe": MoEFamily("softmax", "num_experts", "moe_intermediate_size", shared="shared_expert",
                           shared_width="shared_expert_intermediate_size", shared_gate="shared_expert_gate"),
    "mixtral": MoEFamily("softmax", "num_local_experts", "intermediate_size", normalized=True),
    "olmoe": MoEFamily("softmax", "num_experts", "intermediate_size"),
    "deepseek_v3": MoEFamily("grouped_sigmoid", "n_routed_experts", "moe_intermediate_size", shared="shared_experts",
                             shared_width="moe_intermediate_size"),
    # GLM-4.5's experts are DeepSeek-V3's: the same router, names and shared experts
    "glm4_moe": MoEFamily("grouped_sigmoid", "n_routed_experts", "moe_intermediate_size", shared="shared_experts",
                          shared_width="moe_intermediate_size"),
    "deepseek_v2": MoEFamily("scaled_softmax", "n_routed_experts", "moe_intermediate_size", shared="shared_experts",
                             shared_width="moe_intermediate_size"),
    "llama4_text": MoEFamily("topk_sigmoid", "num_local_experts", "intermediate_size", router="router",
                             shared="shared_expert", shared_width="intermediate_size", scale_input=True,
                             fused_in_out=True),
    "gpt_oss": MoEFamily("topk_softmax", "num_local_experts", "intermediate_size", router="router",
                         fused_in_out=True, biased=True, interleaved=True, clamped=True),
    # Qwen3-VL-MoE's text model: Qwen3-MoE's experts, fused, renormalised (transformers' router always renormalises;
    # the releases' configs say norm_topk_prob: true, and a config without the field gets it)
    "qwen3_vl_moe_text": MoEFamily("softmax", "num_experts", "moe_intermediate_size", normalized=True,
                                   fused_by_shape=True),
}
# the hybrid linear-attention families' experts are Qwen2-MoE's (a gated shared expert); Qwen3.5-MoE's config has no
# norm_topk_prob and always renormalises
FAMILIES["qwen3_next"] = FAMILIES["qwen2_moe"]
FAMILIES["qwen3_omni_moe_text"] = FAMILIES["qwen3_vl_moe_text"]  # Qwen3-Omni's thinker's: Qwen3-VL-MoE's
# DeepSeek-V3.2's, GLM-5's and GLM-4.7-Flash's experts
FAMILIES["deepseek_v32"] = FAMILIES["glm_moe_dsa"] = FAMILIES["glm4_moe_lite"] = FAMILIES["deepseek_v3"]
FAMILIES["solar_open"] = FAMILIES["glm4_moe"]  # Solar Open's are GLM-4.5's
FAMILIES["dots1"] = FAMILIES["deepseek_v3"]  # dots.llm1's are DeepSeek-V3's
FAMILIES["flex_olmo"] = FAMILIES["olmoe"]  # FlexOlmo's are OLMoE's
# Phi-3.5-MoE: Mixtral's names and widths, the sparsemixer's two experts
FAMILIES["phimoe"] = MoEFamily("sparsemixer", "num_local_experts", "intermediate_size")
# Arcee's Trinity (AFMoE): sigmoid scores, the top k of score + expert bias, renormalised, times route_scale; shared
# experts as wide as num_shared_experts experts
FAMILIES["afmoe"] = MoEFamily("scored", "num_experts", "moe_intermediate_size", normalized=True, scoring="sigmoid",
                              scaling="route_scale", shared="shared_experts", shared_width="moe_intermediate_size",
                              shared_count="num_shared_experts")
# Laguna: sigmoid scores of soft-capped logits, the top k of score + correction bias, renormalised, scaled; a shared MLP
FAMILIES["laguna"] = MoEFamily("scored", "num_experts", "moe_intermediate_size", normalized=True, scoring="sigmoid",
                               scaling="moe_routed_scaling_factor", shared="shared_experts",
                               shared_width="shared_expert_intermediate_size", shared_count=None,
                               logit_softcap="moe_router_logit_softcapping")
# Kolibri-1: the top k of logit + correction bias, weighted by their sigmoids (renormalised with norm_topk_prob), a
# shared MLP of shared_expert_intermediate_size
FAMILIES["kolibri1"] = MoEFamily("scored", "num_experts", "moe_intermediate_size", shared="shared_experts",
                                 shared_width="shared_expert_intermediate_size", shared_count=None, scoring="sigmoid",
                                 bias_on_logits=True)
# Command A+: the top k logits weighted by their softmax or sigmoids (expert_selection_fn), shared experts as wide as
# num_shared_experts dense MLPs, added or averaged (shared_expert_combination_strategy)
FAMILIES["cohere2_moe"] = MoEFamily("topk_softmax", "num_experts", "intermediate_size", shared="shared_experts",
                                    shared_width="intermediate_size", shared_count="num_shared_experts",
                                    selection="expert_selection_fn",
                                    shared_combination="shared_expert_combination_strategy")
# Granite's MoE: the top k router logits softmaxed (GPT-OSS's routing, no biases), Mixtral's widths
FAMILIES["granitemoe"] = MoEFamily("topk_softmax", "num_local_experts", "intermediate_size", router="router")
# Granite's shared MoE: Granite's MoE and a shared MLP of shared_intermediate_size (0: none)
FAMILIES["granitemoeshared"] = MoEFamily("topk_softmax", "num_local_experts", "intermediate_size", router="router",
                                         shared="shared_mlp", shared_width="shared_intermediate_size")
FAMILIES["granitemoehybrid"] = FAMILIES["granitemoeshared"]  # Granite 4.0's hybrids' MoE releases
FAMILIES["granitemoe_swa"] = FAMILIES["granitemoeshared"]  # Granite SWA's MoE releases
# Nemotron-H's (Nemotron 3 Nano): DeepSeek-V3's router, gateless squared-ReLU experts and shared experts (one width)
FAMILIES["nemotron_h"] = MoEFamily("grouped_sigmoid", "n_routed_experts", "moe_intermediate_size",
                                   shared="shared_experts", shared_width="moe_shared_expert_intermediate_size",
                                   shared_count=None, gateless=True, latent=True)
# LFM2-MoE (LFM2-8B-A1B): sigmoid scores, the top k of score + expert bias, renormalised, scaled
FAMILIES["lfm2_moe"] = MoEFamily("scored", "num_experts", "moe_intermediate_size", normalized=True, scoring="sigmoid")
# Jamba: softmax over the experts, the top k as they are (not renormalised), its router named router
FAMILIES["jamba"] = MoEFamily("softmax", "num_experts", "intermediate_size", router="router")
# Hunyuan-A13B: softmax top moe_topk renormalised, one shared MLP as wide as each expert
FAMILIES["hunyuan_v1_moe"] = MoEFamily("softmax", "num_experts", "intermediate_size", shared="shared_mlp",
                                       shared_width="intermediate_size", top_k="moe_topk", normalized=True)
# K-EXAONE: DeepSeek-V3's router and shared experts, counted by num_experts and num_shared_experts
FAMILIES["exaone_moe"] = MoEFamily("grouped_sigmoid", "num_experts", "moe_intermediate_size", shared="shared_experts",
                                   shared_width="moe_intermediate_size", shared_count="num_shared_experts")
# MiMo-V2-Flash: DeepSeek-V3's router, no shared expert
FAMILIES["mimo_v2_flash"] = MoEFamily("grouped_sigmoid", "n_routed_experts", "moe_intermediate_size")
# Hunyuan 4: DeepSeek-V3's router and shared experts; its routed experts' SwiGLU clamped (swiglu_limit > 0)
FAMILIES["hy_v4"] = MoEFamily("grouped_sigmoid", "n_routed_experts", "moe_intermediate_size", shared="shared_experts",
                              shared_width="moe_intermediate_size", clamp_only=True, clamp_shared=False)
# Mistral 4: DeepSeek-V3's grouped routing and shared experts over softmax scores, with no correction bias
FAMILIES["mistral4"] = MoEFamily("grouped_sigmoid", "n_routed_experts", "moe_intermediate_size",
                                 shared="shared_experts", shared_width="moe_intermediate_size", scoring="softmax")
# Gemma 4's block beside its dense MLP: gated GELU experts, fused tensors [E, 2I, H] and [E, H, I]; its router (on the
# residual stream, with per-expert scales) is its own (specray.models.gemma4.Gemma4Experts.route)
FAMILIES["gemma4_text"] = MoEFamily("softmax", "num_experts", "moe_intermediate_size", normalized=True, gelu=True,
                                    top_k="top_k_experts")
FAMILIES["deepseek_v4"] = MoEFamily("scored", "n_routed_experts", "moe_intermediate_size", shared="shared_experts",
                                    shared_width="moe_intermediate_size", clamp_only=True)
# MiniMax-M2: sigmoid scores, the top k of score + correction bias, renormalised, unscaled; no shared expert
FAMILIES["minimax_m2"] = MoEFamily("scored", "num_local_experts", "intermediate_size", normalized=True,
                                   scoring="sigmoid")
# Hunyuan 3: MiniMax-M2's routing scaled by router_scaling_factor, and num_shared_experts shared experts
FAMILIES["hy_v3"] = MoEFamily("scored", "num_experts", "moe_intermediate_size", shared="shared_experts",
                              shared_width="moe_intermediate_size", normalized=True, scoring="sigmoid",
                              scaling="router_scaling_factor", shared_count="num_shared_experts")
# ERNIE 4.5's MoE: softmax scores, the top k of score + correction bias, renormalised, unscaled; shared experts
# (moe_num_shared_experts of them)
FAMILIES["ernie4_5_moe"] = MoEFamily("scored", "num_experts", "moe_intermediate_size", shared="shared_experts",
                                     shared_width="moe_intermediate_size", normalized=True, scoring="softmax",
                                     shared_count="moe_num_shared_experts")
FAMILIES["qwen3_5_moe_text"] = MoEFamily("softmax", "num_experts", "moe_intermediate_size", shared="shared_expert",
                                         shared_width="shared_expert_intermediate_size",
                                         shared_gate="shared_expert_gate", normalized=True)
# DBRX: softmax top moe_top_k, divided by their moe_normalize_expert_weights-norm; its router named router
FAMILIES["dbrx"] = MoEFamily("softmax", "moe_num_experts", "ffn_hidden_size", router="router", top_k="moe_top_k",
                             weight_norm="moe_normalize_expert_weights")
# LongCat-Flash: softmax scores over the routed and zero-computation experts, the top k of score + correction bias,
# not renormalised, times routed_scaling_factor; its router named router (the release's router.classifier, renamed)
FAMILIES["longcat_flash"] = MoEFamily("scored", "n_routed_experts", "expert_ffn_hidden_size", router="router",
                                      scoring="softmax", top_k="moe_topk", zero_experts="zero_expert_num")

SWIGLU_ALPHA = 1.702  # GPT-OSS's sigmoid gain where a config predates the swiglu_alpha field
# DeepSeek-V4's scoring_func: each expert's score from its router logit (float32)
SCORES = {"sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(), "sigmoid": torch.sigmoid,
          "softmax": lambda logits: F.softmax(logits, dim=-1)}


def swiglu_limited(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's SwiGLU: silu(gate) * up with gate clamped above and up both sides at ``limit`` (none where the
    limit is not positive: Hunyuan 4's switch)."""
    if limit <= 0:
        return F.silu(gate) * up
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class GatedMLP(nn.Module):
    """A SwiGLU MLP of width ``intermediate_size`` split over ``tp`` (the shared experts). ``partial`` gives this
    rank's share before the sum over ranks, which the MoE block adds to its experts' and reduces once. ``limit``:
    its inputs clamped as :func:`swiglu_limited` does (DeepSeek-V4)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup, limit: float | None = None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp)
        self.limit = limit

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj.partial(F.silu(gate) * up if self.limit is None else swiglu_limited(gate, up, self.limit))


class SquaredReluMLP(nn.Module):
    """``down(relu(up(x))^2)`` of width ``intermediate_size`` split over ``tp`` (Nemotron-H's shared experts), with
    :class:`GatedMLP`'s ``partial``."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.partial(torch.relu(self.up_proj(x)).square())


class Router(nn.Module):
    """The router's weight [E, H] (and DeepSeek's ``e_score_correction_bias`` [E], GPT-OSS's ``bias`` [E]),
    replicated."""

    def __init__(self, num_experts: int, hidden_size: int, correction_bias: bool, bias: bool = False,
                 hash_table: tuple[int, int] | None = None):
        super().__init__()
        self.weight = _param(num_experts, hidden_size)
        self.e_score_correction_bias = _param(num_experts) if correction_bias else None
        if correction_bias:  # [E]; ERNIE 4.5's releases store it as [1, E]
            self.e_score_correction_bias.weight_loader = _load_reshaped
        self.bias = _param(num_experts) if bias else None
        # DeepSeek-V4's hash routing: [vocab, k] expert ids per token id
        self.tid2eid = None if hash_table is None else nn.Parameter(torch.zeros(hash_table, dtype=torch.long),
                                                                    requires_grad=False)


def _topk_method(config) -> str:
    """DeepSeek-V2's ``topk_method``: "greedy" (the top k of every expert) or "group_limited_greedy"."""
    method = getattr(config, "topk_method", None) or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"topk_method={method!r} is not supported for model_type={config.model_type!r}; "
                         "'greedy' or 'group_limited_greedy' is")
    return method


def _load_reshaped(param: nn.Parameter, tensor: Any) -> None:
    """A parameter from a checkpoint tensor of as many values in any shape (a [1, H] weight from [1, H], [H],
    [1, 1, H]; an [E] bias from [1, E])."""
    value = materialize(tensor)
    if value.numel() != param.numel():
        raise ValueError(f"checkpoint tensor of shape {tuple(value.shape)} does not fit parameter of shape "
                         f"{tuple(param.shape)}: the checkpoint does not match its config.json")
    param.data.copy_(value.reshape(param.shape))


def _config_choice(config, field: str, options: tuple[str, ...]) -> str:
    """The config's ``field``, one of ``options``, or a ValueError naming them."""
    value = getattr(config, field)
    if value not in options:
        raise ValueError(f"{field}={value!r} is not supported for model_type={config.model_type!r}; one of "
                         f"{list(options)}")
    return value


class SparseMoE(nn.Module):
    """A sparse MLP block over ``tp`` (see the module docstring), the family's by ``config.model_type``;
    ``hash_routed``: the experts are chosen by token id (DeepSeek-V4's ``hash_moe`` layers)."""

    def __init__(self, config, tp: TPGroup, expert_parallel: bool = False, hash_routed: bool = False):
        super().__init__()
        self.family = family = FAMILIES[config.model_type]
        self.family_name = config.model_type
        if family.gateless:
            if config.mlp_hidden_act != "relu2":
                raise ValueError(f"mlp_hidden_act={config.mlp_hidden_act!r} is not supported for model_type="
                                 f"{config.model_type!r}'s experts; 'relu2' is")
        elif not family.gelu and getattr(config, "hidden_act", "silu") != "silu":  # (LFM2's config names none)
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported for experts; 'silu' is")
        self.tp = tp
        self._eager_path: tuple = (None, False)  # ((device, dtype) of the weights, whether eager steps go grouped)
        self.num_experts = getattr(config, family.num_experts)
        self.top_k = getattr(config, family.top_k)
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", family.normalized))
        self.grouped = family.routing == "grouped_sigmoid"
        # DeepSeek-V2's top k from the topk_group best groups (each group worth its best expert's probability)
        self.group_limited = family.routing == "scaled_softmax" and _topk_method(config) == "group_limited_greedy"
        if family.routing in ("grouped_sigmoid", "scaled_softmax"):
            self.routed_scaling_factor = float(config.routed_scaling_factor)
        if family.routing == "sparsemixer":
            if self.top_k != 2:
                raise ValueError(f"num_experts_per_tok={self.top_k} is not supported for model_type="
                                 f"{config.model_type!r}: its sparsemixer routing picks 2 experts; use 2")
            self.jitter_eps = float(config.router_jitter_noise)
        self.topk_sigmoid = (family.routing == "topk_sigmoid" if family.selection is None
                             else _config_choice(config, family.selection, ("softmax", "sigmoid")) == "sigmoid")
        self.shared_average = (family.shared_combination is not None
                               and _config_choice(config, family.shared_combination, ("sum", "average")) == "average")
        self.logit_cap = float(getattr(config, family.logit_softcap, 0.0) or 0.0) if family.logit_softcap else 0.0
        self.weight_norm = getattr(config, family.weight_norm, None) if family.weight_norm else None
        if self.weight_norm is not None and not float(self.weight_norm) > 0:
            raise ValueError(f"{family.weight_norm}={self.weight_norm!r} is not supported: the experts' weights are "
                             "divided by their p-norm for a p > 0 (1 in DBRX's releases), or null for none")
        if family.routing == "scored":
            self.routed_scaling_factor = float(getattr(config, family.scaling, None) or 1.0)
            self.scoring = getattr(config, "scoring_func", None) or family.scoring or "sqrtsoftplus"
            if self.scoring not in SCORES:
                raise ValueError(f"scoring_func={self.scoring!r} is not supported; supported: {sorted(SCORES)}")
        self.hash_routed = hash_routed
        # zero-computation experts: router outputs past the routed ones, ids num_experts.. (none of a rank's)
        self.zero_experts = int(getattr(config, family.zero_experts, 0) or 0) if family.zero_experts else 0
        if self.zero_experts < 0:
            raise ValueError(f"{family.zero_experts}={self.zero_experts} must be >= 0 (0 or null: no zero-computation "
                             "experts)")
        if isinstance(self.top_k, int) and not 0 < self.top_k <= self.num_experts + self.zero_experts:
            raise ValueError(f"{family.top_k}={self.top_k} must be between 1 and the {self.num_experts} experts "
                             f"({family.num_experts}) a token can be routed to"
                             + (f", with {self.zero_experts} zero-computation experts" if self.zero_experts else ""))
        if self.grouped or self.group_limited:
            self.n_group, self.topk_group = config.n_group, config.topk_group
            if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ValueError(f"n_routed_experts={self.num_experts}, n_group={self.n_group}, topk_group="
                                 f"{self.topk_group}: the experts must split into n_group groups and 0 < topk_group "
                                 "<= n_group")
        self.expert_parallel = expert_parallel
        inter, h = getattr(config, family.expert_width), config.hidden_size
        if expert_parallel:
            if self.num_experts % tp.size:
                raise ValueError(f"num_experts={self.num_experts} is not divisible by tensor_parallel_size={tp.size} "
                                 "with enable_expert_parallel: choose a tensor_parallel_size that divides "
                                 "num_experts, or turn expert parallelism off (experts split by width)")
            self.local_experts = self.num_experts // tp.size
            self.inter_local = inter
        else:
            self.local_experts = self.num_experts
            self.inter_local = divide(inter, tp.size, family.expert_width)
        self.expert_start = tp.rank * self.local_experts if expert_parallel else 0
        bias = (self.grouped and family.scoring != "softmax") or (family.routing == "scored" and not hash_routed)
        table = (config.vocab_size, self.top_k) if hash_routed else None
        self.add_module(family.router, Router(self.num_experts + self.zero_experts, h, correction_bias=bias,
                                              bias=family.biased, hash_table=table))
        if family.clamped or family.clamp_only:
            self.swiglu = (float(config.swiglu_limit), float(getattr(config, "swiglu_alpha", None) or SWIGLU_ALPHA))
        e, i = self.local_experts, self.inter_local
        # the experts' input and output width: the hidden size, or a latent one between two projections around them
        # (Nemotron-H's moe_latent_size: fc1 before the experts, fc2 after, the router and shared experts on x)
        latent = getattr(config, "moe_latent_size", None) if family.latent else None
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if latent:  # replicated (one rank's linears): every rank's experts take the whole latent vector
            if getattr(config, "mlp_bias", False):
                raise ValueError(f"moe_latent_size={latent} with mlp_bias=True is not supported for model_type="
                                 f"{config.model_type!r} (the latent projections' biases); load a release without")
            self.fc1_latent_proj = ColumnParallelLinear(h, latent, TPGroup.single())
            self.fc2_latent_proj = ColumnParallelLinear(latent, h, TPGroup.single())
        x_dim = latent or h
        self.parts = 1 if family.gateless else 2  # w13's parts: gate and up, or up alone
        block = kept_block(config)  # (ROW_SCALES: a scale per row, any share of rows or columns whole)
        fp4 = fp4_experts(config_quantization(config))  # DeepSeek-V4's release: linears block FP8, experts FP4
        if fp4:
            block = None
        fmt = w8a8_format(config_quantization(config))  # what kept 8-bit experts hold: FP8, or INT8 W8A8's int8
        self.values_dtype = torch.float8_e4m3fn if fmt is None else fmt.dtype
        if block is not None and block[1] and (i % block[0] or i % block[1] or x_dim % block[0] or x_dim % block[1]):
            _tell_partial("FP8", f"{list(block)} blocks", i, x_dim, split=not expert_parallel and tp.size > 1)
            block = None  # this rank's shares are not whole blocks: dequantized at load
        if block is not None and not keeps_fp8_experts(torch.empty(0).device):
            block = None  # a CPU: dequantized at load
        self.fp8_block = block
        self.dtype = torch.get_default_dtype()  # the model's: what the experts compute in
        self.x_dim = x_dim
        group = None if block is not None else experts_int4_group(getattr(config, "quantization_config", None),
                                                                   torch.empty(0).device)
        if group is not None and (x_dim % group or i % group):
            _tell_partial("4-bit", f"the checkpoint's {group}-column groups", i, x_dim,
                          split=not expert_parallel and tp.size > 1)
            group = None  # this rank's shares are not whole groups: dequantized at load
        self.int4_group = group
        # an MXFP4 release's experts: FP4 codes two a byte and an E8M0 scale per 32 input columns (mxfp4)
        self.mxfp4 = (block is None and group is None and (is_mxfp4(config_quantization(config)) or fp4)
                      and keeps_fp8_experts(torch.empty(0).device))
        if self.mxfp4 and (x_dim % MXFP4_GROUP or i % MXFP4_GROUP):
            _tell_partial("MXFP4", f"{MXFP4_GROUP}-column groups", i, x_dim, split=not expert_parallel and tp.size > 1)
            self.mxfp4 = False  # this rank's shares are not whole groups: dequantized at load
        # an NVFP4 release's: FP4 codes two a byte and a float32 scale per 16 input columns (nvfp4)
        self.nvfp4 = (block is None and group is None and not self.mxfp4
                      and nvfp4_layout(config_quantization(config)) is not None
                      and keeps_fp8_experts(torch.empty(0).device))
        if self.nvfp4 and (x_dim % NVFP4_GROUP or i % NVFP4_GROUP):
            _tell_partial("NVFP4", f"{NVFP4_GROUP}-column groups", i, x_dim, split=not expert_parallel and tp.size > 1)
            self.nvfp4 = False  # this rank's shares are not whole groups: dequantized at load
        if self.mxfp4 or self.nvfp4:
            per_scale = MXFP4_GROUP if self.mxfp4 else NVFP4_GROUP
            scale = _uint8_param if self.mxfp4 else _param  # E8M0 bytes, or float32 scales
            self.w13 = _uint8_param(e, self.parts * i, x_dim // 2)
            self.w2 = _uint8_param(e, x_dim, i // 2)
            self.w13_scale = scale(e, self.parts * i, x_dim // per_scale)
            self.w2_scale = scale(e, x_dim, i // per_scale)
        elif group is not None:  # 4-bit values two a byte, a scale, zero point and offset per group (int_quant)
            self.w13 = _uint8_param(e, self.parts * i, x_dim // 2)
            self.w2 = _uint8_param(e, x_dim, i // 2)
            self.w13_scale = nn.Parameter(torch.empty(e, self.parts * i, x_dim // group, 3), requires_grad=False)
            self.w2_scale = nn.Parameter(torch.empty(e, x_dim, i // group, 3), requires_grad=False)
        elif block is None:
            self.w13 = _param(e, self.parts * i, x_dim)  # gate rows, then up rows (gateless: up rows)
            self.w2 = _param(e, x_dim, i)
            self.w13_scale = self.w2_scale = None
        else:  # 8-bit values (float8, or int8) and one float32 scale per (b0, b1) block (per row: [rows, 1])
            b0, b1 = block
            self.w13 = _values_param(self.values_dtype, e, self.parts * i, x_dim)
            self.w2 = _values_param(self.values_dtype, e, x_dim, i)
            self.w13_scale = nn.Parameter(torch.empty(e, self.parts * i // b0, x_dim // b1 if b1 else 1,
                                                      dtype=torch.float32), requires_grad=False)
            self.w2_scale = nn.Parameter(torch.empty(e, x_dim // b0, i // b1 if b1 else 1, dtype=torch.float32),
                                         requires_grad=False)
        # the experts' biases (GPT-OSS): gate then up [E, 2I], down [E, H] (added by one rank when split by width)
        self.w13_bias = _param(e, 2 * i) if family.biased else None
        self.w2_bias = _param(e, x_dim) if family.biased else None
        self.adds_down_bias = expert_parallel or tp.rank == 0
        count = getattr(config, family.shared_count, None) if family.shared_count else None
        # (a count of 0: none, as transformers builds them, 0 wide; None or no such field: the width is the whole)
        width = 0 if family.shared is None else getattr(config, family.shared_width) * (1 if count is None else count)
        if width and family.gateless:
            self.add_module(family.shared, SquaredReluMLP(h, width, tp))
        elif width:  # (Granite's shared MoE: a width of 0 for none)
            limit = self.swiglu[0] if family.clamp_only and family.clamp_shared else None
            self.add_module(family.shared, GatedMLP(h, width, tp, limit))
        if family.shared_gate is not None:  # replicated, as the router is
            gate = Router(1, h, correction_bias=False)
            gate.weight.weight_loader = _load_reshaped  # [1, H]; llama.cpp's GGUFs store it as [H]
            self.add_module(family.shared_gate, gate)
        # a static release's activation scales for the kept experts' 8-bit matmuls: the largest over every expert's
        # gate/up, and over every down (vLLM's; every rank reads them all, so the ranks agree)
        self.register_buffer("w13_input_scale", None)
        self.register_buffer("w2_input_scale", None)
        self.matmul8 = self._matmul8()

    def _matmul8(self):
        """How kept 8-bit experts multiply where this device multiplies in 8 bits, as the linears of the same release
        do (vLLM's fused experts do too): ``f(x, values, scales, static)`` of one expert's projection, its tokens'
        activations rounded per row (a scale per row: :mod:`specray.models.w8a8`) or per group of a block's columns
        (block FP8: :mod:`specray.models.fp8_blocks`), or over a static release's one scale (``static``); None where
        its weights are dequantized as tokens reach them instead."""
        block, device, dtype = self.fp8_block, self.w13.device, self.dtype
        if block is None:
            return None
        if block == ROW_SCALES:
            fmt = FP8 if self.values_dtype == torch.float8_e4m3fn else INT8
            if self.inter_local % TILE or self.x_dim % TILE or not keeps_w8a8(fmt, device, dtype):
                return None
            return lambda x, values, scales, static: matmul_rows(x, values, scales.reshape(1, -1), fmt, static)
        if not keeps_block_fp8(block, device, dtype):
            return None
        fast = device.type == "cuda" and block == KERNEL_BLOCK  # (keeps_block_fp8 ran cuBLASLt's kernel there)
        return lambda x, values, scales, static: matmul_blocks(x, values, scales, block,
                                                               kernel_scales(scales) if fast else None)

    @property
    def router_module(self) -> Router:
        return getattr(self, self.family.router)

    @property
    def shared(self) -> GatedMLP | SquaredReluMLP | None:
        return None if self.family.shared is None else getattr(self, self.family.shared, None)

    # ------------------------------------------------------------------------------------------ forward

    def route(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k]) as the family's router picks them
        (``token_ids`` [T]: what a hash-routed block picks by)."""
        if self.grouped:
            return self._route_grouped(x)
        if self.family.routing == "scored":
            return self._route_scored(x, token_ids)
        if self.family.routing == "sparsemixer":
            return self._route_sparsemixer(x)
        router = self.router_module
        if self.family.routing in ("topk_sigmoid", "topk_softmax"):  # the top k logits, then each one's weight
            logits, ids = F.linear(x, router.weight, router.bias).topk(self.top_k, dim=-1)
            if not self.topk_sigmoid:
                return F.softmax(logits, dim=-1, dtype=torch.float32).to(x.dtype), ids
            weights = torch.sigmoid(logits.float())
            if self.norm_topk_prob:  # (Command A+'s; Llama-4's config has no norm_topk_prob)
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights.to(x.dtype), ids
        if self.family.routing == "scaled_softmax":
            return self._route_scaled(x)
        probs = F.softmax(F.linear(x, router.weight), dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        elif self.weight_norm is not None:
            weights = weights / torch.linalg.vector_norm(weights, float(self.weight_norm), dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def _route_scaled(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V2: p = softmax(x W^T) in float32 over every expert; the top k of p (group-limited: of the experts
        in the topk_group groups with the best max p, the others' p taken as 0), each weight p * routed_scaling_factor
        (not renormalised)."""
        probs = F.softmax(F.linear(x.float(), self.router_module.weight.float()), dim=-1)  # [T, E]
        if self.group_limited:
            t, e, g = x.shape[0], self.num_experts, self.n_group
            groups = probs.view(t, g, e // g).amax(dim=-1).topk(self.topk_group, dim=-1).indices  # [T, topk_group]
            allowed = torch.zeros(t, g, dtype=torch.bool, device=x.device).scatter_(1, groups, True)
            probs = probs.view(t, g, e // g).masked_fill(~allowed[:, :, None], 0.0).view(t, e)
        weights, ids = probs.topk(self.top_k, dim=-1)
        return (weights * self.routed_scaling_factor).to(x.dtype), ids

    def _route_sparsemixer(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Phi-3.5-MoE's sparsemixer at inference: the expert of the best logit s1, weighted by its softmax among the
        experts whose logit s lies near it, ``(s1 - s) / max(|s|, s1) <= 2 * router_jitter_noise``; then the best of
        the others, weighted likewise among the others near it."""
        scores = F.linear(x, self.router_module.weight).float()  # [T, E]
        left, weights, ids = scores, [], []
        for _ in range(2):
            best, index = left.max(dim=-1, keepdim=True)
            near = (best - scores) / scores.abs().clamp(min=best) <= 2 * self.jitter_eps
            weights.append(left.masked_fill(~near, float("-inf")).softmax(dim=-1).gather(1, index))
            ids.append(index)
            left = left.scatter(1, index, float("-inf"))
        return torch.cat(weights, dim=1).to(x.dtype), torch.cat(ids, dim=1)

    def _route_scored(self, x: torch.Tensor, token_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V4: scores s = scoring_func(x W^T) in float32; the experts the token's hash row names (a
        hash-routed block) or the top k of s + e_score_correction_bias (Kolibri-1: of x W^T + the bias); their s
        renormalised, times routed_scaling_factor."""
        router = self.router_module
        logits = F.linear(x.float(), router.weight.float())  # [T, E]
        if self.logit_cap:
            logits = torch.tanh(logits / self.logit_cap) * self.logit_cap
        scores = SCORES[self.scoring](logits)
        if self.hash_routed:
            if token_ids is None:
                raise ValueError("a hash-routed expert block picks its experts by token id: pass token_ids")
            ids = router.tid2eid.index_select(0, token_ids)  # [T, k]
        else:
            choice = logits if self.family.bias_on_logits else scores
            ids = (choice + router.e_score_correction_bias.float()).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.routed_scaling_factor).to(x.dtype), ids

    def _route_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, e, g = x.shape[0], self.num_experts, self.n_group
        scores = SCORES[self.family.scoring or "sigmoid"](F.linear(x.float(), self.router_module.weight.float()))
        bias = self.router_module.e_score_correction_bias
        choice = scores if bias is None else scores + bias.float()  # [T, E]
        group_worth = choice.view(t, g, e // g).topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        groups = group_worth.topk(self.topk_group, dim=-1).indices  # [T, topk_group]
        allowed = torch.zeros_like(group_worth, dtype=torch.bool).scatter_(1, groups, True)
        # masked per group by broadcasting: repeat_interleave's int form reaches a dispatch mode whole under inference
        # mode, where the tests' sync check (rightly wary of its tensor form) refuses it
        choice = choice.view(t, g, e // g).masked_fill(~allowed[:, :, None], float("-inf")).view(t, e)
        ids = choice.topk(self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.routed_scaling_factor).to(x.dtype), ids

    def forward(self, x: torch.Tensor, router_input: torch.Tensor | None = None,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, H] -> [T, H]; router_input: what the router reads when not x (Gemma 4's: the residual stream);
        # token_ids [T]: a hash-routed block's (DeepSeek-V4)
        weights, ids = self.route(x if router_input is None else router_input, token_ids)
        routed = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)  # (a latent MoE's experts' input)
        out = self.experts_of(routed, weights, ids)
        if self.fc2_latent_proj is not None:  # linear, so it may take this rank's partial sums before the reduce
            out = self.fc2_latent_proj(out)
        if self.zero_experts and self.tp.rank == 0:  # x times the zero experts' weights, added once over the ranks
            out = out + x * weights.masked_fill(ids < self.num_experts, 0.0).sum(dim=-1, keepdim=True)
        if self.shared is not None:  # its share joins the experts' before the one sum over ranks
            shared = self.shared.partial(x)
            if self.family.shared_gate is not None:  # each token's gate, the same on every rank
                shared = shared * torch.sigmoid(F.linear(x, getattr(self, self.family.shared_gate).weight))
            out = out + shared if not self.shared_average else (out + shared) * 0.5
        return self.tp.all_reduce(out)

    def experts_of(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the routed experts' weighted sum for x [T, H] (weights, ids [T, k]): the grouped path
        within :func:`sync_free_experts` (a graph step's) or where eager steps take it too
        (:meth:`grouped_eagerly`), else the looped one; a family with a router of its own calls it after routing."""
        grouped = getattr(_sync_free, "on", False) or self.grouped_eagerly()
        return self._experts_grouped(x, weights, ids) if grouped else self._experts_looped(x, weights, ids)

    def grouped_eagerly(self) -> bool:
        """Whether eager steps (prefills, long verify steps, ``enforce_eager=True``) take the grouped path too: on
        CUDA wherever it runs with no host sync (:meth:`graph_blocker`), as vLLM's fused experts serve every step.
        There the loop launches a matmul pair and its elementwise work for each expert a step's tokens reach (a
        prefill of a dozen tokens reaches most of 128 experts: thousands of launches over 48 layers) and syncs with
        the host once per layer; the grouped path launches the same few kernels whatever the routing. On a CPU the
        loop stays: it computes only the experts with tokens, and torch's grouped matmul there is itself a loop.
        Decided once per device and dtype of the weights."""
        key = (self.w13.device, self.w13.dtype)
        if self._eager_path[0] != key:
            self._eager_path = (key, key[0].type == "cuda" and self.graph_blocker() is None)
        return self._eager_path[1]

    def _experts_looped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts' share [T, H] of tokens ``x`` [T, H] routed by ``weights``, ``ids`` [T, k]: one matmul
        pair per local expert over its tokens, the group sizes read back to the host."""
        flat = ids.flatten()  # [T*k]: token t's j-th expert at t*k + j
        order = flat.argsort(stable=True)  # grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        before = counts[: self.expert_start].sum().reshape(1)  # pairs routed to earlier ranks' experts
        skip, *sizes = torch.cat((before, counts[self.expert_start: self.expert_start + self.local_experts])).tolist()
        rows = order[skip: skip + sum(sizes)]  # the (token, slot) pairs routed to this rank's experts (one sync)
        tokens = rows // self.top_k
        out = torch.zeros_like(x)
        if rows.numel():
            w = weights.flatten().index_select(0, rows)[:, None]  # each (token, slot) pair's routing weight
            routed = x.index_select(0, tokens)
            if self.family.scale_input:
                routed = routed * w
            y = torch.cat([self._expert(e, xe) for e, xe in enumerate(routed.split(sizes)) if xe.shape[0]])
            out.index_add_(0, tokens, y if self.family.scale_input else y * w)
        return out

    def _experts_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """As :meth:`_experts_looped`, with no host sync and shapes fixed by ``x``'s: every (token, choice) pair gets
        a row, the rows sorted by local expert on the device (pairs routed to another rank's experts, or to zero
        experts, last), and one grouped matmul per projection runs each local expert over its rows. The rows past
        the last group are left unwritten by the kernel and never reach the sum."""
        assert self.w13_scale is None and self.w2_scale is None, \
            "experts kept quantized have no grouped path (graph_blocker refuses them)"
        t, k = ids.shape
        n, e = t * k, self.local_experts
        key = ids.flatten()  # [n]: each pair's expert
        # when this rank holds every expert and no zero experts exist, each pair's key is its expert as it stands
        every_row_local = e == self.num_experts and not self.zero_experts
        if not every_row_local:
            local = key - self.expert_start
            key = torch.where((local >= 0) & (local < e), local, e)
        key, rows = key.sort(stable=True)  # rows: pair indices (t*k + j) grouped by expert, as the loop's
        offs = torch.searchsorted(key, torch.arange(e, device=x.device), right=True, out_int32=True)  # group ends
        tokens = rows // k
        w = weights.flatten().index_select(0, rows)[:, None]  # [n, 1]: each row's routing weight
        routed = x.index_select(0, tokens)  # [n, H]
        if self.family.scale_input:
            routed = routed * w
        biased = self.w13_bias is not None or (self.w2_bias is not None and self.adds_down_bias)
        expert = key.clamp(max=e - 1) if biased else None  # each row's expert, for its biases (past the groups: any)
        h = torch._grouped_mm(routed, self.w13.transpose(1, 2), offs=offs)  # [n, 2I] (gateless: [n, I])
        if self.w13_bias is not None:
            h = h + self.w13_bias.index_select(0, expert)
        y = torch._grouped_mm(self._activate(h).contiguous(), self.w2.transpose(1, 2), offs=offs)  # [n, H]
        if self.w2_bias is not None and self.adds_down_bias:
            y = y + self.w2_bias.index_select(0, expert)
        if not self.family.scale_input:
            y = y * w
        if not every_row_local:
            # rows past the last group hold whatever the kernel left there (NaN, inf): selected away, never summed
            y = torch.where((torch.arange(n, device=x.device) < offs[-1])[:, None], y, 0.0)
        return torch.zeros_like(x).index_add_(0, tokens, y)

    def graph_blocker(self) -> str | None:
        """None when :meth:`_experts_grouped` runs as it is where this block's weights are (on CUDA: with no host
        sync, so inside a CUDA graph), else why not."""
        weights = self.w13
        if not hasattr(torch, "_grouped_mm"):
            return "this torch has no torch._grouped_mm (the experts' grouped matmul)"
        if self.w13_scale is not None or self.w2_scale is not None:
            kept = ("MXFP4" if self.mxfp4 else "NVFP4" if self.nvfp4 else "4 bits" if self.fp8_block is None else
                    "FP8" if self.values_dtype.is_floating_point else "INT8")
            return (f"its experts are kept in {kept} and dequantized expert by expert as tokens reach them, which the "
                    "grouped matmul of a graph step does not do")
        size = weights.element_size()
        for name, width in (("hidden_size", weights.shape[-1]), ("the expert width on this rank", self.inter_local)):
            if width * size % 16:
                return (f"its {name} {width} in {weights.dtype} is not a multiple of 16 bytes, the row stride "
                        "torch._grouped_mm needs for the experts' grouped matmul")
        return grouped_mm_blocker(weights.device, weights.dtype, self.local_experts)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``e``'s MLP of its tokens ``x`` [n, H] (this rank's share when split by width)."""
        b13 = None if self.w13_bias is None else self.w13_bias[e]
        b2 = self.w2_bias[e] if self.w2_bias is not None and self.adds_down_bias else None
        h = self._project(x, self.w13, self.w13_scale, e, b13)
        return self._project(self._activate(h), self.w2, self.w2_scale, e, b2)

    def _project(self, x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor | None, e: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` [n, in] through local expert ``e``'s projection ``weights`` [E, out, in]: multiplied in 8 bits where
        kept 8-bit experts are (:meth:`_matmul8`), else dequantized (if kept) and multiplied in ``x``'s dtype."""
        if scales is None or self.matmul8 is None:
            return F.linear(x, self._weight(weights, scales, e, x.dtype), bias)
        static = self.w13_input_scale if weights is self.w13 else self.w2_input_scale
        y = self.matmul8(x, weights[e], scales[e], static)
        return y if bias is None else y + bias

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        """The experts' activation of their first projection's output ``h`` [n, 2I] (gate then up; gateless: [n, I],
        up alone) -> [n, I]."""
        if self.family.gateless:
            return torch.relu(h).square()
        gate, up = h.chunk(2, dim=-1)
        if self.family.gelu:
            return F.gelu(gate, approximate="tanh") * up
        if self.family.clamp_only:
            return swiglu_limited(gate, up, self.swiglu[0])
        if not self.family.clamped:
            return F.silu(gate) * up
        limit, alpha = self.swiglu
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(alpha * gate)

    def _weight(self, weights: torch.Tensor, scales: torch.Tensor | None, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Local expert ``e``'s weight, dequantized to ``dtype`` when the experts are kept in 8 or 4 bits."""
        if scales is None:
            return weights[e]
        if self.mxfp4:
            return decode_mxfp4(weights[e], scales[e], dtype)
        if self.nvfp4:
            return decode_nvfp4(weights[e], scales[e], dtype)
        if self.int4_group is not None:
            return dequantize_packed(weights[e], scales[e]).to(dtype)
        return dequantize_blocks(weights[e], scales[e], self.fp8_block).to(dtype)

    # ------------------------------------------------------------------------------------------ weights

    def load_expert_tensor(self, name: str, tensor: Any) -> list[str]:
        """Load one checkpoint tensor of this block's experts (either naming); returns the keys it filled (none
        when it belongs to another rank's experts)."""
        found = _PER_EXPERT.search(name)
        if found:
            expert, kind = int(found.group(1)), found.group(2)
            self._note_input_scale(kind, getattr(tensor, "input_scale", None))  # (every expert's: see __init__)
            local = expert - self.expert_start
            if not 0 <= local < self.local_experts:
                return []
            self._load_one(local, kind, tensor)
            if kind == "gate_proj" and self.family.gateless:
                raise ValueError(f"checkpoint tensor {name}: model_type={self.family_name!r}'s experts have no gate; "
                                 "the checkpoint does not match its config.json")
            return [f"w13:{expert}:0" if kind == "gate_proj" else f"w13:{expert}:1" if kind == "up_proj"
                    else f"w2:{expert}"]
        found = _FUSED.search(name)
        assert found, name
        if found.group(2):
            return self._load_biases(found.group(1), materialize(tensor))
        if found.group(1) == ("gate_up_proj" if self.family.gateless else "up_proj"):
            raise ValueError(f"checkpoint tensor {name}: model_type={self.family_name!r}'s experts have "
                             f"{'no gate (up_proj and down_proj)' if self.family.gateless else 'a fused gate_up_proj'}"
                             "; the checkpoint does not match its config.json")
        if isinstance(tensor, Mxfp4Weight):
            if self.mxfp4:
                return self._load_mxfp4(found.group(1), tensor)
            tensor = tensor.dequantized()
        elif self.mxfp4:  # full-precision fused experts in an MXFP4 checkpoint: the block keeps full precision
            self._keep_full_precision()
        value = materialize(tensor)
        if self._inputs_first(found.group(1), value):  # [E, H, 2I] and [E, I, H]: as [E, 2I, H] and [E, H, I]
            value = value.transpose(1, 2)
        keys = []
        for local in range(self.local_experts):
            expert = self.expert_start + local
            if found.group(1) == "up_proj":  # gateless: [E, I, H]
                self._load_one(local, "up_proj", value[expert])
                keys.append(f"w13:{expert}:1")
            elif found.group(1) == "gate_up_proj":  # [E, 2I, H]: gate rows then up rows (or interleaved)
                gate, up = self._gate_up(value[expert])
                self._load_one(local, "gate_proj", gate)
                self._load_one(local, "up_proj", up)
                keys += [f"w13:{expert}:0", f"w13:{expert}:1"]
            else:
                self._load_one(local, "down_proj", value[expert])
                keys.append(f"w2:{expert}")
        return keys

    def _inputs_first(self, kind: str, value: torch.Tensor) -> bool:
        """Whether fused tensor ``kind`` (gate_up_proj, down_proj) ``value`` is stored [E, H, 2I] / [E, I, H]: as its
        family stores them, or (``fused_by_shape``) where the hidden size is not where [E, 2I, H] / [E, H, I] has it."""
        if not self.family.fused_by_shape:
            return self.family.fused_in_out
        hidden = self.x_dim
        return value.shape[-1] != hidden if kind == "gate_up_proj" else value.shape[1] != hidden

    def _gate_up(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's fused gate/up [2I, ...] as (gate [I, ...], up [I, ...])."""
        if self.family.interleaved:
            return fused[0::2], fused[1::2]
        inter = shape_of(fused)[0] // 2
        return fused[:inter], fused[inter:]

    def _load_biases(self, kind: str, value: torch.Tensor) -> list[str]:
        """The experts' fused biases (gate_up [E, 2I]: this rank's width of each half; down [E, H]: whole)."""
        if self.w13_bias is None:
            raise ValueError(f"the checkpoint has expert biases ({kind}_bias), which this model_type's experts do "
                             "not have: the checkpoint does not match its config.json")
        start = 0 if self.expert_parallel else self.tp.rank * self.inter_local
        keys = []
        for local in range(self.local_experts):
            expert = self.expert_start + local
            if kind == "down_proj":
                _copy(self.w2_bias.data[local], value[expert])
                keys.append(f"b2:{expert}")
                continue
            for half, part in enumerate(self._gate_up(value[expert])):
                offset = half * self.inter_local
                rows = slice(offset, offset + self.inter_local)
                _copy(self.w13_bias.data[local][rows], part[start: start + self.inter_local])
            keys.append(f"b13:{expert}")
        return keys

    def _load_one(self, local: int, kind: str, tensor: Any) -> None:
        # gate/up [I, H]: this rank's rows of the intermediate width; down [H, I]: its columns
        start = 0 if self.expert_parallel else self.tp.rank * self.inter_local
        if isinstance(tensor, Nvfp4Weight):
            if self.nvfp4:
                self._load_nvfp4(local, kind, tensor, start)
                return
            tensor = tensor.dequantized()
        if isinstance(tensor, Mxfp4Expert):  # one expert's MXFP4 codes and scales (DeepSeek-V4's release)
            if self.mxfp4:
                self._load_fp4_codes(local, kind, tensor.kept(), start, MXFP4_GROUP)
                return
            tensor = tensor.dequantized()
        if isinstance(tensor, RowScaled) and self.fp8_block == ROW_SCALES and tensor.weight.dtype == self.values_dtype:
            # an INT8 W8A8 expert (or one named as Mixtral's), kept so
            tensor = Fp8Weight(tensor.weight, tensor.scale[:, None], ROW_SCALES, tensor.input_scale)
        if isinstance(tensor, Fp8Weight):
            if self.fp8_block is None or tensor.block != self.fp8_block:
                tensor = tensor.dequantized()  # kept in the model's dtype (shares of partial blocks)
            else:
                self._load_fp8(local, kind, tensor, start)
                return
        elif self.fp8_block is not None or self.mxfp4 or self.nvfp4:
            self._keep_full_precision()  # a full-precision expert in a quantized checkpoint: the block keeps them so
        projection = "w2" if kind == "down_proj" else "w13"
        if self.int4_group is not None and getattr(self, projection + "_scale") is not None:
            if isinstance(tensor, IntWeight) and (tensor.bits, tensor.group_size) == (4, self.int4_group):
                self._load_int4(local, kind, tensor, start)
                return
            # an expert's projection stored otherwise (a Q4_K_M GGUF's 6-bit ffn_down_exps): the block's projection
            self._keep_full_precision((projection,))
        whole, dim = self.inter_local * (1 if self.expert_parallel else self.tp.size), int(kind == "down_proj")
        if shape_of(tensor)[dim] != whole:  # (a wider expert was read in part, silently)
            raise ValueError(f"checkpoint tensor of shape {shape_of(tensor)} does not fit an expert's {kind} of "
                             f"{self.family.expert_width}={whole}: the checkpoint does not match its config.json")
        if kind == "down_proj":
            _copy(self.w2.data[local], narrow(tensor, 1, start, self.inter_local))
            return
        rows = self.w13.data[local]
        offset = 0 if kind == "gate_proj" or self.family.gateless else self.inter_local
        _copy(rows[offset: offset + self.inter_local], narrow(tensor, 0, start, self.inter_local))

    @torch.no_grad()
    def quantize_experts(self, fmt) -> bool:
        """Online FP8 (:func:`specray.models.layers.quantize_linears`): full-precision experts kept in FP8 with a
        scale per row (``fmt``: :data:`specray.models.w8a8.FP8`), dequantized when tokens reach them as an FP8
        release's are, where this device keeps FP8 experts; split by width, each rank scales its share of a down
        projection's rows by the whole row's largest magnitude (gathered over the ranks). False where they stay."""
        if (fmt.dtype != torch.float8_e4m3fn or self.w13_scale is not None or self.w2_scale is not None
                or not self.w13.is_floating_point() or not keeps_fp8_experts(self.w13.device)):
            return False
        for name in ("w13", "w2"):
            w = getattr(self, name)  # [E, rows, cols]
            amax = w.abs().amax(-1).float()  # [E, rows]
            if name == "w2" and not self.expert_parallel and self.tp.size > 1:  # each rank holds a share of a row
                amax = self.tp.all_gather(amax[..., None], -1).amax(-1)
            scale = amax.clamp_min(1e-12) / fmt.max
            values = torch.empty(w.shape, dtype=fmt.dtype, device=w.device)
            for e in range(w.shape[0]):  # an expert at a time: no float32 copy of them all
                values[e] = fmt.round((w[e].float() / scale[e][:, None]).clamp(-fmt.max, fmt.max))
            setattr(self, name, nn.Parameter(values, requires_grad=False))
            setattr(self, name + "_scale", nn.Parameter(scale[..., None].contiguous(), requires_grad=False))
        self.fp8_block = ROW_SCALES
        self.matmul8 = self._matmul8()
        return True

    def _keep_full_precision(self, names: tuple[str, ...] = ("w13", "w2")) -> None:
        """Store this block's experts' projections ``names`` in the model's dtype from now on (those loaded so far
        dequantized)."""
        dtype = self.dtype
        for name in names:
            values, scales = getattr(self, name), getattr(self, name + "_scale")
            full = torch.stack([self._weight(values, scales, e, dtype) for e in range(values.shape[0])])
            setattr(self, name, nn.Parameter(full, requires_grad=False))
            setattr(self, name + "_scale", None)
        if self.w13_scale is None and self.w2_scale is None:
            self.fp8_block = self.int4_group = None
            self.mxfp4 = self.nvfp4 = False
            self.matmul8 = None

    def _load_int4(self, local: int, kind: str, w: IntWeight, start: int) -> None:
        """As :meth:`_load_one`, the integers packed and their groups' terms as kept (``start`` whole groups)."""
        inter = self.inter_local
        if kind == "down_proj":  # [H, I]: this rank's columns
            values, terms, part = self.w2.data[local], self.w2_scale.data[local], w.cols(start, inter)
        else:  # [I, H]: this rank's rows
            offset = 0 if kind == "gate_proj" or self.family.gateless else inter
            rows = slice(offset, offset + inter)
            values, terms, part = self.w13.data[local][rows], self.w13_scale.data[local][rows], w.rows(start, inter)
        assert part is not None, "this rank's columns are whole groups (checked when the block was built)"
        _copy(values, pack_nibbles(part.q))
        _copy(terms, group_terms(part))

    @torch.no_grad()
    def random_kept(self, limit: float) -> None:
        """Kept MXFP4 or 8-bit experts of random values, their scales those that keep them within ``limit`` (a dummy
        model's: ``load_format="dummy"``): FP4 codes over the power of two, 8-bit values over their format's
        largest. Experts kept otherwise, or not kept, are left as they are."""
        for values, scales in ((self.w13, self.w13_scale), (self.w2, self.w2_scale)):
            if scales is None or not (self.mxfp4 or self.nvfp4 or self.fp8_block is not None):
                continue
            if self.mxfp4 or self.nvfp4:
                values.random_(0, 256)
                scales.fill_(SCALE_BIAS + math.floor(math.log2(limit / FP4_MAX)) if self.mxfp4 else limit / FP4_MAX)
                continue
            largest = 448.0 if values.dtype == torch.float8_e4m3fn else 127.0
            values.copy_(((torch.rand(values.shape, device=values.device) * 2 - 1) * largest).to(values.dtype))
            scales.fill_(limit / largest)

    def _note_input_scale(self, kind: str, scale: torch.Tensor | None) -> None:
        """A static release's expert ``kind``'s activation scale: the projection's keeps the largest."""
        if scale is None:
            return
        name = "w2_input_scale" if kind == "down_proj" else "w13_input_scale"
        held, scale = getattr(self, name), scale.float().reshape(()).to(self.w13.device)
        setattr(self, name, scale if held is None else torch.maximum(held, scale))

    def _load_mxfp4(self, kind: str, w: Mxfp4Weight) -> list[str]:
        """A fused MXFP4 weight (gate_up_proj: rows 2I, gate and up as the family lays them; down_proj: rows H, its
        columns I in groups of 32): this rank's experts' codes and scales as stored, its share of the width (whole
        groups: checked when the block was built). Returns the keys it filled."""
        codes, scales = w.codes()  # [E, rows, cols / 2], [E, rows, cols / 32]
        start, inter = (0 if self.expert_parallel else self.tp.rank * self.inter_local), self.inter_local
        keys = []
        for local in range(self.local_experts):
            expert = self.expert_start + local
            if kind == "down_proj":  # [H, I]: this rank's columns
                _copy(self.w2.data[local], codes[expert][:, start // 2: (start + inter) // 2])
                _copy(self.w2_scale.data[local],
                      scales[expert][:, start // MXFP4_GROUP: (start + inter) // MXFP4_GROUP])
                keys.append(f"w2:{expert}")
                continue
            if kind == "up_proj":  # a gateless family's: [I, H]
                parts = [(codes[expert], scales[expert])]
            else:  # gate, then up: [I, ...] each
                parts = list(zip(self._gate_up(codes[expert]), self._gate_up(scales[expert])))
            for half, (part_codes, part_scales) in enumerate(parts):
                rows = slice(half * inter, (half + 1) * inter)
                _copy(self.w13.data[local][rows], part_codes[start: start + inter])
                _copy(self.w13_scale.data[local][rows], part_scales[start: start + inter])
            keys += [f"w13:{expert}:1"] if kind == "up_proj" else [f"w13:{expert}:0", f"w13:{expert}:1"]
        return keys

    def _load_nvfp4(self, local: int, kind: str, w: Nvfp4Weight, start: int) -> None:
        """As :meth:`_load_one`, an NVFP4 expert's codes and its groups' float32 scales as kept (``start`` and the
        width whole groups: checked when the block was built)."""
        self._load_fp4_codes(local, kind, w.kept(), start, NVFP4_GROUP)

    def _load_fp4_codes(self, local: int, kind: str, kept: tuple[torch.Tensor, torch.Tensor], start: int,
                        group: int) -> None:
        """As :meth:`_load_one`, one expert's FP4 codes [rows, cols / 2] and its scales [rows, cols / group] as
        kept (NVFP4's, or MXFP4's per expert)."""
        (codes, scales), inter = kept, self.inter_local
        if kind == "down_proj":  # [H, I]: this rank's columns
            _copy(self.w2.data[local], codes[:, start // 2: (start + inter) // 2])
            _copy(self.w2_scale.data[local], scales[:, start // group: (start + inter) // group])
            return
        offset = 0 if kind == "gate_proj" or self.family.gateless else inter  # [I, H]: this rank's rows
        _copy(self.w13.data[local][offset: offset + inter], codes[start: start + inter])
        _copy(self.w13_scale.data[local][offset: offset + inter], scales[start: start + inter])

    def _load_fp8(self, local: int, kind: str, tensor: Fp8Weight, start: int) -> None:
        """As :meth:`_load_one`, the values and their scales as stored (``start`` a whole number of blocks)."""
        (b0, b1), inter = self.fp8_block, self.inter_local
        if dtype_of(tensor.weight) != self.values_dtype:
            raise ValueError(f"an expert's {kind} weight is {dtype_of(tensor.weight)} where the checkpoint's experts "
                             f"are {self.values_dtype} (float8 e4m3: DeepSeek's and Qwen3's FP8 releases; int8: INT8 "
                             "W8A8 ones); load a bf16 version of the checkpoint")
        if kind == "down_proj":  # [H, I]: this rank's columns (a scale per row: every row's)
            _copy(self.w2.data[local], narrow(tensor.weight, 1, start, inter))
            _copy(self.w2_scale.data[local], narrow(tensor.scale, 1, start // b1, inter // b1) if b1 else tensor.scale)
            return
        offset = 0 if kind == "gate_proj" or self.family.gateless else inter  # [I, H]: this rank's rows
        _copy(self.w13.data[local][offset: offset + inter], narrow(tensor.weight, 0, start, inter))
        _copy(self.w13_scale.data[local][offset // b0: (offset + inter) // b0],
              narrow(tensor.scale, 0, start // b0, inter // b0))

    def expected_keys(self) -> set[str]:
        experts = range(self.expert_start, self.expert_start + self.local_experts)
        keys = {f"w13:{e}:{s}" for e in experts for s in ((1,) if self.family.gateless else (0, 1))}
        keys |= {f"w2:{e}" for e in experts}
        return keys | ({f"b{w}:{e}" for e in experts for w in (13, 2)} if self.w13_bias is not None else set())


def grouped_mm_blocker(device: torch.device, dtype: torch.dtype, groups: int,
                       capability: tuple[int, int] | None = None) -> str | None:
    """None when ``torch._grouped_mm`` of ``groups`` groups in ``dtype`` on ``device`` runs with no host sync, else
    why not. On CUDA its CUTLASS kernel (bf16, compute capability 9.x or 10.x; ``capability`` the device's, asked
    for when None) reads the group offsets on the device; every other case takes torch's fallback, a loop over the
    groups that copies the offsets to the host, which a CUDA graph's capture refuses. On CPU the fallback syncs
    with nothing (the suite's graph steps run there eagerly)."""
    if device.type == "cpu":
        return None
    if device.type != "cuda" or torch.version.hip is not None:
        return f"torch._grouped_mm on {device.type} (not CUDA) has no path without a host sync that we know of"
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if dtype != torch.bfloat16 or capability[0] not in GROUPED_MM_MAJORS:
        return (f"torch._grouped_mm runs without a host sync only in bfloat16 on compute capability 9.x or 10.x (its "
                f"CUTLASS kernel); in {dtype} on {capability[0]}.{capability[1]} its fallback copies the experts' "
                "group offsets to the host, which a CUDA graph cannot capture")
    if groups > GROUPED_MM_MAX_GROUPS:
        return f"{groups} experts on this rank: torch._grouped_mm's kernel takes at most {GROUPED_MM_MAX_GROUPS}"
    return None


# a block's expert parameters (checked as loaded expert by expert: :meth:`SparseMoE.expected_keys`)
EXPERT_PARAMS = (".mlp.w13", ".mlp.w2", ".mlp.w13_scale", ".mlp.w2_scale", ".mlp.w13_bias", ".mlp.w2_bias",
                 ".feed_forward.w13", ".feed_forward.w2", ".feed_forward.w13_scale", ".feed_forward.w2_scale")


def is_expert_tensor(name: str) -> bool:
    return bool(_PER_EXPERT.search(name) or _FUSED.search(name))


def is_per_expert_tensor(name: str) -> bool:
    """One expert's own weight (``...experts.3.gate_proj.weight``; DeepSeek-V4's release: ``...ffn.experts.3.w1
    .weight``, before the model renames it): what a quantized checkpoint's experts keep as stored."""
    return bool(_PER_EXPERT.search(name) or _RELEASE_EXPERT.search(name))


def _tell_partial(kept: str, units: str, inter: int, hidden: int, split: bool) -> None:
    """Once per process and ``kept`` format (FP8, 4-bit): why a checkpoint's experts are not kept in it, this rank's
    share of them not whole ``units`` (its blocks or groups; ``split``: split by width)."""
    if kept in _told_partial:
        return
    _told_partial.add(kept)
    advice = "" if not split else (" choose a tensor_parallel_size that leaves each rank whole blocks of the expert "
                                   "width, or set enable_expert_parallel=True (whole experts per rank)")
    logger.warning("%s experts dequantized at load: each rank's expert width %d or the hidden size %d is not a whole "
                   "number of %s;%s", kept, inter, hidden, units, advice)


def _uint8_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)


def _values_param(dtype: torch.dtype, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
