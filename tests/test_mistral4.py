"""Mistral 4 (``Mistral4ForCausalLM``): DeepSeek-V3's latent attention (RoPE on interleaved pairs, YaRN's softmax
scale) and experts (grouped routing, shared experts) with softmax scores and no correction bias, and queries scaled by
position (``llama_4_scaling_beta``), against transformers on the same random tiny weights (fp32, max abs diff < 1e-4);
the scaling and the softmax scores shown to matter, tensor parallel 2 equal to one rank, and the engine's greedy
output with n-gram drafts equal to transformers' ``generate``."""

from __future__ import annotations

import sys

import pytest

from specray.models import moe
from specray.models.loader import load_model
from specray_test_model_checks import (SCHEDULES, chunked_logits, max_diff, mutated_logits,  # tests/model_checks.py
                                       prompt, reference_logits)

TOL = 1e-4


@pytest.fixture(scope="module")
def m4(tiny_mistral4_dir):
    """(the tiny model's folder, transformers' logits of the prompt)."""
    from transformers import Mistral4ForCausalLM  # (not among AutoModelForCausalLM's)

    return tiny_mistral4_dir, reference_logits(tiny_mistral4_dir, Mistral4ForCausalLM)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(m4, schedule):
    folder, reference = m4
    model = load_model(str(folder))
    assert model.model.layers[1].self_attn.query_scaling == (0.1, 16)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def _no_query_scaling(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.query_scaling = None


def _sigmoid_scores(model) -> None:
    for layer in model.model.layers[1:]:
        layer.mlp.family = moe.FAMILIES["deepseek_v3"]


@pytest.mark.parametrize("mutation", [_no_query_scaling, _sigmoid_scores])
def test_each_difference_shows_in_the_logits(m4, mutation):
    folder, reference = m4
    assert max_diff(mutated_logits(folder, None, mutation), reference) > 1e-2



def test_engine_greedy_with_ngram_drafts_equals_transformers(tiny_mistral4_dir):
    from transformers import Mistral4ForCausalLM

    runs = sys.modules["specray_test_engine_runs"]
    runs.assert_ngram_greedy_equals_transformers(tiny_mistral4_dir, Mistral4ForCausalLM)
