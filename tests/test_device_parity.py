"""On a GPU, each family's logits equal its CPU logits (fp32, the same random tiny weights, a prefill and chunks +
decode steps over a paged cache): the CPU's are checked against transformers' in each family's own file, so this
carries that check to the device. A failure names the first module (in call order) whose output differs, for the
step where the logits first do. Skipped without CUDA. (A family whose tiny model is built in its own test file runs
the same check there: tests/model_checks.py's ``assert_logits_on_the_gpu_equal_the_cpu``.)"""
from __future__ import annotations

import pytest
import torch

from specray_test_model_checks import SCHEDULES, assert_logits_on_the_gpu_equal_the_cpu  # tests/model_checks.py

TOL = 1e-4
FIXTURES = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_qwen3_moe_dir", "tiny_mixtral_dir",
            "tiny_phi3_dir", "tiny_granite_dir", "tiny_olmo2_dir", "tiny_smollm3_dir", "tiny_olmo3_dir",
            "tiny_ernie4_5_dir", "tiny_seed_oss_dir", "tiny_glm4_dir", "tiny_ernie4_5_moe_dir", "tiny_dots1_dir",
            "tiny_exaone4_dir", "tiny_arcee_dir", "tiny_ministral_dir", "tiny_cohere2_dir",
            "tiny_hunyuan_v1_dense_dir", "tiny_qwen2_moe_dir", "tiny_gemma3_dir", "tiny_gemma2_dir",
            "tiny_deepseek_dir", "tiny_glm4_moe_dir", "tiny_deepseek_v2_dir", "tiny_minimax_m2_dir",
            "tiny_mistral4_dir", "tiny_glm4_moe_lite_dir", "tiny_solar_open_dir", "tiny_hy_v3_dir",
            "tiny_mimo_v2_flash_dir", "tiny_hy_v4_dir", "tiny_deepseek_v4_dir", "tiny_deepseek_v32_dir",
            "tiny_glm5_dir", "tiny_llama4_dir", "tiny_glm_dir", "tiny_gemma_dir", "tiny_olmoe_dir",
            "tiny_starcoder2_dir", "tiny_ministral3_dir", "tiny_exaone_moe_dir", "tiny_hunyuan_v1_moe_dir",
            "tiny_nemotron_dir", "tiny_cohere_dir", "tiny_granitemoe_dir", "tiny_apertus_dir",
            "tiny_phimoe_dir", "tiny_minicpm3_dir", "tiny_olmo_dir", "tiny_granitemoeshared_dir",
            "tiny_qwen3_5_model_dir", "tiny_bamba_dir", "tiny_granitemoehybrid_dir", "tiny_nemotron_h_dir",
            "tiny_falcon_h1_dir", "tiny_mamba2_dir", "tiny_lfm2_moe_dir", "tiny_jamba_dir", "tiny_falcon_mamba_dir",
            "tiny_zamba2_dir", "tiny_gpt_neox_dir", "tiny_gpt_neox_sequential_dir", "tiny_phi_dir", "tiny_gptj_dir",
            "tiny_stablelm_dir", "tiny_stablelm_parallel_dir", "tiny_gpt2_dir", "tiny_opt_dir", "tiny_falcon_dir",
            "tiny_falcon_7b_dir", "tiny_falcon2_dir", "tiny_falcon_sequential_dir", "tiny_lfm3_dir",
            "tiny_cohere2_moe_dir", "tiny_cohere2_moe_sigmoid_dir", "tiny_vaultgemma_dir", "tiny_jais2_dir",
            "tiny_cwm_dir", "tiny_youtu_dir", "tiny_helium_dir", "tiny_hyperclovax_dir", "tiny_axk1_dir",
            "tiny_kolibri1_dir", "tiny_afmoe_dir", "tiny_granite_swa_dir", "tiny_longcat_flash_dir",
            "tiny_granitemoe_swa_dir", "tiny_mellum_dir", "tiny_laguna_dir", "tiny_laguna_element_dir",
            "tiny_flint_dir", "tiny_nanochat_dir", "tiny_beam_dir", "tiny_minimax_dir", "tiny_bloom_dir",
            "tiny_bloom_post_ln_dir", "tiny_mpt_dir", "tiny_falcon_rw_dir", "tiny_gpt_bigcode_dir",
            "tiny_gpt_bigcode_mha_dir", "tiny_flex_olmo_dir", "tiny_dbrx_dir",
            "tiny_persimmon_dir"]
# prompts whose sparse-index picks have no exact tie at the boundary (which of tied entries ``topk`` keeps is the
# device's choice): V4's default prompt scores two entries exactly alike (ReLU zeros) in one query's pick
SEEDS = {"tiny_deepseek_v4_dir": 5}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fixture", FIXTURES)
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(request, fixture, schedule):
    assert_logits_on_the_gpu_equal_the_cpu(request.getfixturevalue(fixture), SCHEDULES[schedule], TOL,
                                           SEEDS.get(fixture, 0))
