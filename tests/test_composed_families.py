"""Families made of others' parts, against transformers on the same random tiny weights (fp32, max abs diff < 1e-4),
with the engine's greedy output under n-gram drafts equal to transformers' ``generate``, and (TP 2) two ranks equal
to one:

* GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``): DeepSeek-V3's latent attention, RoPE on interleaved pairs and GLM-4.5's
  experts, each layer's kind named by ``mlp_layer_types``; served by the DeepSeek-V3 class.
* Solar Open (``SolarOpenForCausalLM``): Llama's attention without an o_proj bias, GLM-4.5's experts in every layer;
  served by GLM-4.5's class, as is dots.llm1 (``Dots1ForCausalLM``: Qwen3's attention with a sliding window on its
  last layer, DeepSeek-V3's experts; TP 2).
* Hunyuan 3 (``HYV3ForCausalLM``): Qwen3's q/k norms, MiniMax-M2's routing scaled, shared experts, its own names.
* MiMo-V2-Flash (``MiMoV2FlashForCausalLM``): values narrower than keys, sliding layers with sinks and twice the KV
  heads, each kind's partial RoPE, DeepSeek-V3's router without a shared expert (TP 2).
* GLM-4 (``Glm4ForCausalLM``): Llama's layers with q/k/v biases, RoPE on interleaved pairs of each head's first half,
  a norm after each block, the release's fused gate_up_proj (TP 2).
* ERNIE 4.5's MoE (``Ernie4_5_MoeForCausalLM``): ERNIE 4.5's attention, softmax-scored experts picked with a
  correction bias, shared experts, experts from ``moe_layer_start_index`` (TP 2).
* EXAONE 4.0 (``Exaone4ForCausalLM``): OLMo 2's post-norm layers around per-head q/k norms, sliding layers with RoPE
  and a global one without (TP 2).
* AFM (``ArceeForCausalLM``): Llama's attention and a gateless relu^2 MLP (TP 2).
* Ministral (``MinistralForCausalLM``): sliding layers by ``layer_types``.
* Command R7B / Command A (``Cohere2ForCausalLM``): one bias-free LayerNorm before parallel attention and MLP,
  interleaved RoPE on the sliding layers only, scaled logits, tied embeddings (TP 2).
* Hunyuan dense (``HunYuanDenseV1ForCausalLM``): q/k norms after RoPE, RoPE's base stretched by a fixed alpha (TP 2).
* GLM (``GlmForCausalLM``: GLM-4-9B-chat): GLM-4's attention and fused gate_up_proj in Llama's layer.
* Gemma (``GemmaForCausalLM``): Gemma 3's norms, scaled embedding and gated GELU in a pre-norm layer, every layer
  global, the releases' legacy ``hidden_act="gelu"`` read as the tanh approximation (TP 2).
* OLMoE (``OlmoeForCausalLM``): OLMo 2's attention, clamped q/k/v, softmax-routed experts in every layer (TP 2).
* FlexOlmo (``FlexOlmoForCausalLM``): OLMo 2's post-norm layer with OLMoE's experts, renormalised (TP 2).
* StarCoder2 (``Starcoder2ForCausalLM``): LayerNorms with biases, biased projections, a gateless GELU MLP, every
  layer sliding (TP 2).
* Ministral 3 (``Ministral3ForCausalLM``): Mistral's layers, YaRN, queries scaled by position (as Mistral 4's).
* K-EXAONE (``ExaoneMoeForCausalLM``): Llama's pre-norm layers with per-head q/k norms, RoPE on the sliding layers
  alone, dense or DeepSeek-V3's experts by ``mlp_layer_types`` (TP 2).
* Hunyuan's MoE (``HunYuanMoEV1ForCausalLM``): Hunyuan dense's attention, softmax-routed experts beside a shared MLP
  in every layer, the router under its release's name (TP 2).
* Nemotron (``NemotronForCausalLM``): LayerNorm1P norms, AFM's gateless relu^2 MLP, RoPE on half of each head (TP 2).
* Command R / R+ (``CohereForCausalLM``): Command R7B's layer rotated everywhere, each query and key head LayerNormed
  with its own weight (TP 2: each rank reading its heads' rows).
* Granite's MoE (``GraniteMoeForCausalLM``): Granite's multipliers, the top k router logits softmaxed, the release's
  fused ``input_linear`` / ``output_linear`` experts (TP 2).
* Apertus (``ApertusForCausalLM``): per-head q/k norms, a gateless MLP of the xIELU activation and its learned scalars,
  its norms' own names (TP 2).
* Phi-3.5-MoE (``PhimoeForCausalLM``): LayerNorms with biases, biased attention, the sparsemixer's two experts, an LM
  head with a bias (TP 2: each rank its slice of the bias).
* MiniCPM3 (``MiniCPM3ForCausalLM``): DeepSeek-V2's latent attention (RoPE on halves) in dense layers, with its
  scales of the embedding, the residual branches and the logits as Granite's multipliers; served by the DeepSeek-V3
  class (TP 2).
* OLMo (``OlmoForCausalLM``): Llama's layer with weightless LayerNorms, q/k/v clamped as projected (TP 2).
* Granite's shared MoE (``GraniteMoeSharedForCausalLM``): Granite's MoE with a shared MLP, its gate/up fused (TP 2).
* Command A+ (``Cohere2MoeForCausalLM``): Command R7B's parallel layer over a dense prefix (rotated where global) and
  experts weighted by the softmax or the sigmoids of their top logits, shared experts averaged or summed in,
  LayerNorms or RMSNorms (TP 2: experts split by width).
* VaultGemma (``VaultGemmaForCausalLM``): Gemma 2's layers without the norms on the blocks' outputs (TP 2).
* Jais 2 (``Jais2ForCausalLM``): LayerNorms with biases, biased attention, AFM's relu^2 MLP with biases (TP 2).
* CWM (``CwmForCausalLM``): Llama's layers with sliding ones by ``layer_types``, Llama 3's RoPE (TP 2).
* Youtu-LLM (``YoutuForCausalLM``): DeepSeek-V3's latent attention in dense Llama layers (TP 2).
* Helium (``HeliumForCausalLM``): Llama's layers with RoPE on interleaved pairs, q/k/v biases alone (TP 2).
* HyperCLOVA X SEED (``HyperCLOVAXForCausalLM``): Granite's multipliers, Peri-LN norms on the blocks' outputs, the
  logits multiplied by ``logits_scaling`` (TP 2).
* A.X-K1 (``AXK1ForCausalLM``): DeepSeek-V3 with each MoE layer's output RMS-normed (TP 2: experts by width).
* Kolibri-1 (``Kolibri1ForCausalLM``): GLM-4's sandwich norms, EXAONE 4.0's attention, experts chosen by logit +
  correction bias and weighted by sigmoids beside a shared MLP (TP 2: experts by width).
* Trinity (``AfmoeForCausalLM``): attention gated feature by feature with q/k norms and RoPE on the sliding layers,
  sandwich norms, a dense prefix, sigmoid-routed experts scaled by ``route_scale`` beside shared experts, muP's
  scaled embeddings (TP 2: experts by width).
* Granite SWA (``GraniteSWAForCausalLM``): Granite's multipliers, sliding layers, a sink logit per head, each layer's
  own RoPE base (0: NoPE) (TP 2: heads and sinks split); its MoE release (``GraniteMoeSWAForCausalLM``) over
  Granite's shared MoE (TP 2).
* Mellum 2 (``MellumForCausalLM``): Qwen3-MoE's layers with sliding ones, each kind's RoPE base, a dense prefix
  (TP 2: experts by width).
* Laguna (``LagunaForCausalLM``): each layer's own query heads, softplus output gates per head or per feature, q/k
  norms, each kind's RoPE, sigmoid-routed experts of soft-capped logits, scaled, beside a shared MLP (TP 2).
* Flint (``FlintForCausalLM``): Qwen3-MoE's layers with sinks, RoPE on the sliding layers alone, experts weighted by
  their top logits' sigmoids beside a shared MLP (TP 2).
* nanochat (``NanoChatForCausalLM``): weightless RMSNorms (the embeddings normed too), RoPE turning the other way
  before the q/k norms, a relu^2 MLP, soft-capped logits (TP 2).
* Beam (``BeamForCausalLM``): gated attention with q/k norms, RoPE on the sliding layers and position-scaled queries
  on the NoPE global ones, sandwich norms with depth-scaled residual adds, grouped sigmoid experts, capped logits
  (TP 2).
"""

from __future__ import annotations

import sys

import pytest

from specray.models.deepseek_v3 import DeepseekV3ForCausalLM
from specray.models.apertus import ApertusForCausalLM, ApertusMLP
from specray.models.arcee import ArceeForCausalLM, ReluSquaredMLP
from specray.models.cohere2 import Cohere2ForCausalLM, CohereForCausalLM
from specray.models.cohere2_moe import Cohere2MoeForCausalLM
from specray.models.gemma2 import VaultGemmaForCausalLM
from specray.models.jais2 import Jais2ForCausalLM
from specray.models.afmoe import AfmoeForCausalLM
from specray.models.axk1 import AXK1ForCausalLM
from specray.models.beam import BeamForCausalLM
from specray.models.granite_swa import GraniteMoeSWAForCausalLM, GraniteSWAForCausalLM
from specray.models.helium import HeliumForCausalLM
from specray.models.kolibri1 import Kolibri1ForCausalLM
from specray.models.flint import FlintForCausalLM
from specray.models.laguna import LagunaForCausalLM
from specray.models.mellum import MellumForCausalLM
from specray.models.nanochat import NanoChatForCausalLM
from specray.models.hyperclovax import HyperCLOVAXForCausalLM
from specray.models.hunyuan_v1 import HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM
from specray.models.exaone4 import Exaone4ForCausalLM
from specray.models.gemma import GemmaForCausalLM
from specray.models.gemma3 import Gemma3MLP
from specray.models.nemotron import NemotronForCausalLM
from specray.models.olmo import OlmoForCausalLM
from specray.models.olmoe import OlmoeForCausalLM
from specray.models.phimoe import PhimoeForCausalLM
from specray.models.starcoder2 import Starcoder2ForCausalLM
from specray.models.classic import GatelessMLP
from specray.models.glm4 import Glm4ForCausalLM
from specray.models.glm4_moe import Glm4MoeForCausalLM
from specray.models.hy_v3 import HYV3ForCausalLM
from specray.models.mimo_v2 import MiMoV2FlashForCausalLM
from specray.models.llama import LlamaForCausalLM, LlamaMLP
from specray.models.flex_olmo import FlexOlmoForCausalLM
from specray.models.moe import SparseMoE
from specray.models.loader import load_model
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, assert_ranks_match_one_rank, chunked_logits, max_diff, prompt,
    reference_logits)

TOL = 1e-4


FAMILIES = {"glm4_moe_lite": ("tiny_glm4_moe_lite_dir", DeepseekV3ForCausalLM, LlamaMLP),
            "solar_open": ("tiny_solar_open_dir", Glm4MoeForCausalLM, SparseMoE),
            "hy_v3": ("tiny_hy_v3_dir", HYV3ForCausalLM, LlamaMLP),
            "mimo_v2_flash": ("tiny_mimo_v2_flash_dir", MiMoV2FlashForCausalLM, LlamaMLP),
            "glm4": ("tiny_glm4_dir", Glm4ForCausalLM, LlamaMLP),
            "ernie4_5_moe": ("tiny_ernie4_5_moe_dir", LlamaForCausalLM, LlamaMLP),
            "dots1": ("tiny_dots1_dir", Glm4MoeForCausalLM, LlamaMLP),
            "exaone4": ("tiny_exaone4_dir", Exaone4ForCausalLM, LlamaMLP),
            "arcee": ("tiny_arcee_dir", ArceeForCausalLM, ReluSquaredMLP),
            "ministral": ("tiny_ministral_dir", LlamaForCausalLM, LlamaMLP),
            "cohere2": ("tiny_cohere2_dir", Cohere2ForCausalLM, LlamaMLP),
            "hunyuan_v1_dense": ("tiny_hunyuan_v1_dense_dir", HunYuanDenseV1ForCausalLM, LlamaMLP),
            "glm": ("tiny_glm_dir", LlamaForCausalLM, LlamaMLP),
            "gemma": ("tiny_gemma_dir", GemmaForCausalLM, Gemma3MLP),
            "olmoe": ("tiny_olmoe_dir", OlmoeForCausalLM, SparseMoE),
            "flex_olmo": ("tiny_flex_olmo_dir", FlexOlmoForCausalLM, SparseMoE),
            "starcoder2": ("tiny_starcoder2_dir", Starcoder2ForCausalLM, GatelessMLP),
            "ministral3": ("tiny_ministral3_dir", LlamaForCausalLM, LlamaMLP),
            "exaone_moe": ("tiny_exaone_moe_dir", LlamaForCausalLM, LlamaMLP),
            "hunyuan_v1_moe": ("tiny_hunyuan_v1_moe_dir", HunYuanMoEV1ForCausalLM, SparseMoE),
            "nemotron": ("tiny_nemotron_dir", NemotronForCausalLM, ReluSquaredMLP),
            "cohere": ("tiny_cohere_dir", CohereForCausalLM, LlamaMLP),
            "granitemoe": ("tiny_granitemoe_dir", LlamaForCausalLM, SparseMoE),
            "apertus": ("tiny_apertus_dir", ApertusForCausalLM, ApertusMLP),
            "phimoe": ("tiny_phimoe_dir", PhimoeForCausalLM, SparseMoE),
            "minicpm3": ("tiny_minicpm3_dir", DeepseekV3ForCausalLM, LlamaMLP),
            "olmo": ("tiny_olmo_dir", OlmoForCausalLM, LlamaMLP),
            "granitemoeshared": ("tiny_granitemoeshared_dir", LlamaForCausalLM, SparseMoE),
            "cohere2_moe": ("tiny_cohere2_moe_dir", Cohere2MoeForCausalLM, LlamaMLP),
            "cohere2_moe_sigmoid": ("tiny_cohere2_moe_sigmoid_dir", Cohere2MoeForCausalLM, LlamaMLP),
            "vaultgemma": ("tiny_vaultgemma_dir", VaultGemmaForCausalLM, Gemma3MLP),
            "jais2": ("tiny_jais2_dir", Jais2ForCausalLM, ReluSquaredMLP),
            "cwm": ("tiny_cwm_dir", LlamaForCausalLM, LlamaMLP),
            "youtu": ("tiny_youtu_dir", DeepseekV3ForCausalLM, LlamaMLP),
            "helium": ("tiny_helium_dir", HeliumForCausalLM, LlamaMLP),
            "hyperclovax": ("tiny_hyperclovax_dir", HyperCLOVAXForCausalLM, LlamaMLP),
            "axk1": ("tiny_axk1_dir", AXK1ForCausalLM, LlamaMLP),
            "kolibri1": ("tiny_kolibri1_dir", Kolibri1ForCausalLM, SparseMoE),
            "afmoe": ("tiny_afmoe_dir", AfmoeForCausalLM, LlamaMLP),
            "granite_swa": ("tiny_granite_swa_dir", GraniteSWAForCausalLM, LlamaMLP),
            "granitemoe_swa": ("tiny_granitemoe_swa_dir", GraniteMoeSWAForCausalLM, SparseMoE),
            "mellum": ("tiny_mellum_dir", MellumForCausalLM, LlamaMLP),
            "laguna": ("tiny_laguna_dir", LagunaForCausalLM, LlamaMLP),
            "laguna_element": ("tiny_laguna_element_dir", LagunaForCausalLM, LlamaMLP),
            "flint": ("tiny_flint_dir", FlintForCausalLM, LlamaMLP),
            "nanochat": ("tiny_nanochat_dir", NanoChatForCausalLM, ReluSquaredMLP),
            "beam": ("tiny_beam_dir", BeamForCausalLM, LlamaMLP)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(request, family, schedule):
    fixture, model_class, first_mlp = FAMILIES[family]
    folder = request.getfixturevalue(fixture)
    reference = reference_logits(folder)
    model = load_model(str(folder))
    assert isinstance(model, model_class) and isinstance(model.model.layers[0].mlp, first_mlp)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_greedy_with_ngram_drafts_equals_transformers(request, family):
    folder = request.getfixturevalue(FAMILIES[family][0])
    sys.modules["specray_test_engine_runs"].assert_ngram_greedy_equals_transformers(folder)


# every family here and in the newer families' files whose ranks have no check of their own, in one launch per split
RANK_CHECKS = {1: ("tiny_deepseek_v4_dir", "tiny_hy_v4_dir", "tiny_minimax_m2_dir", "tiny_mistral4_dir",
                   "tiny_mimo_v2_flash_dir", "tiny_glm4_dir", "tiny_ernie4_5_moe_dir", "tiny_dots1_dir",
                   "tiny_exaone4_dir", "tiny_arcee_dir", "tiny_cohere2_dir", "tiny_hunyuan_v1_dense_dir",
                   "tiny_gemma_dir", "tiny_olmoe_dir", "tiny_starcoder2_dir", "tiny_exaone_moe_dir",
                   "tiny_hunyuan_v1_moe_dir", "tiny_nemotron_dir", "tiny_cohere_dir", "tiny_granitemoe_dir",
                   "tiny_apertus_dir", "tiny_phimoe_dir", "tiny_minicpm3_dir", "tiny_olmo_dir",
                   "tiny_granitemoeshared_dir", "tiny_cohere2_moe_dir", "tiny_cohere2_moe_sigmoid_dir",
                   "tiny_vaultgemma_dir", "tiny_jais2_dir", "tiny_cwm_dir", "tiny_youtu_dir", "tiny_helium_dir",
                   "tiny_hyperclovax_dir", "tiny_axk1_dir", "tiny_kolibri1_dir", "tiny_afmoe_dir",
                   "tiny_granite_swa_dir", "tiny_granitemoe_swa_dir", "tiny_mellum_dir", "tiny_laguna_dir",
                   "tiny_laguna_element_dir", "tiny_flint_dir", "tiny_nanochat_dir", "tiny_beam_dir",
                   "tiny_flex_olmo_dir"),
               2: ("tiny_deepseek_v4_dir", "tiny_hy_v4_dir", "tiny_gemma_dir", "tiny_cohere_dir", "tiny_starcoder2_dir",
                   "tiny_granitemoe_dir", "tiny_apertus_dir", "tiny_hunyuan_v1_moe_dir")}


@pytest.mark.parametrize("stages", sorted(RANK_CHECKS))
def test_two_ranks_match_one_rank(request, tmp_path, stages):
    """Two tensor-parallel ranks (stages 1: each family's heads, sinks, output groups and experts split) or two
    pipeline stages (2: the residual streams handed on, for DeepSeek-V4, Hunyuan 4, Gemma, Command R+, StarCoder2,
    Granite's MoE, Apertus and Hunyuan's MoE): the last rank's logits equal one rank's, for DeepSeek-V4,
    Hunyuan 4, MiniMax-M2 (its q/k norms' mean squares summed over the ranks), Mistral 4, MiMo-V2-Flash (both kinds
    of KV heads and the sinks split), GLM-4, ERNIE 4.5's MoE and dots.llm1 (experts split by width), EXAONE 4.0, AFM,
    Command R7B, Hunyuan dense, Gemma, OLMoE (its q/k norms over the ranks, experts split by width), StarCoder2 (its
    biases added once), K-EXAONE, Hunyuan's MoE, Nemotron, Command R+, Granite's MoE, Apertus, Phi-3.5-MoE, MiniCPM3,
    OLMo and Granite's shared MoE."""
    folders = [str(request.getfixturevalue(f)) for f in RANK_CHECKS[stages]]
    assert_ranks_match_one_rank(tmp_path, folders, stages, TOL)


def test_hunyuan_moe_reads_per_layer_lists_that_agree(tiny_hunyuan_v1_moe_dir):
    """Hunyuan's MoE release writes some counts per layer: where every layer agrees they are read (the same logits as
    one value); where layers differ the model is refused by name (transformers' class keeps one value)."""
    from specray.models.loader import read_config

    folder = tiny_hunyuan_v1_moe_dir
    config = read_config(str(folder))
    layers = config.num_hidden_layers
    config.num_experts, config.moe_topk = [8] * layers, [2] * layers
    config.moe_intermediate_size = [config.intermediate_size] * layers
    model = load_model(str(folder), config=config)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["prefill"]), reference_logits(folder)) < TOL
    config.moe_topk = [2] + [1] * (layers - 1)
    with pytest.raises(ValueError, match=r"moe_topk=\[2, 1\] is not supported for model_type='hunyuan_v1_moe'"):
        load_model(str(folder), config=config)
