"""GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``): DeepSeek-V3's latent attention (RoPE on interleaved pairs) and GLM-4.5's
experts (V3's router and shared experts), each layer's kind named by ``mlp_layer_types``, served by the DeepSeek-V3
class: against transformers on the same random tiny weights (fp32, max abs diff < 1e-4), and the engine's greedy output
with n-gram drafts equal to transformers' ``generate``."""

from __future__ import annotations

import sys

import pytest
import torch

from specray.models.deepseek_v3 import DeepseekV3ForCausalLM
from specray.models.llama import LlamaMLP
from specray.models.loader import load_model
from specray_test_model_checks import SCHEDULES, chunked_logits, max_diff, prompt  # tests/model_checks.py

TOL = 1e-4


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_glm4_moe_lite_dir, schedule):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_glm4_moe_lite_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(torch.tensor([prompt()])).logits[0].float()
    model = load_model(str(tiny_glm4_moe_lite_dir))
    assert isinstance(model, DeepseekV3ForCausalLM) and isinstance(model.model.layers[0].mlp, LlamaMLP)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def test_engine_greedy_with_ngram_drafts_equals_transformers(tiny_glm4_moe_lite_dir):
    sys.modules["specray_test_engine_runs"].assert_ngram_greedy_equals_transformers(tiny_glm4_moe_lite_dir)
