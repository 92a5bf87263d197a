"""Hunyuan 4 (``HYV4ForCausalLM``): latent attention with sparse selection (an indexer rotating its heads' last
features; a layer sharing the pick of the one before), a sink and a sigmoid output gate per head, two residual streams
mixed by independent hyper-connections, a dense layer then clamped experts, against transformers on the same random
tiny weights (fp32, max abs diff < 1e-4; the checkpoint in the release's names, as transformers saves it): every
attention path, each new part shown to matter, TP 2 and PP 2 equal to one rank, and the engine's greedy output with
n-gram chains and trees equal to transformers' ``generate``. The tiny model has 16 indexer heads and a seed whose
prompt keeps every query's 6th and 7th index scores apart: with few heads the ReLU'd scores often tie at 0, where two
exact implementations may pick different keys."""

from __future__ import annotations

import sys

import pytest

from specray.models import cpu_kernels
from specray.models.loader import load_model
from specray_test_model_checks import (SCHEDULES, chunked_logits, max_diff, mutated_logits,  # tests/model_checks.py
                                       prompt, reference_logits)

TOL = 1e-4


@pytest.fixture(scope="module")
def hy4(tiny_hy_v4_dir):
    """(the tiny model's folder, transformers' logits of the prompt)."""
    return tiny_hy_v4_dir, reference_logits(tiny_hy_v4_dir)


@pytest.mark.parametrize("path", ["batched", "own"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(hy4, monkeypatch, schedule, path):
    folder, reference = hy4
    if path == "own":
        monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 0)
    model = load_model(str(folder))
    assert [layer.self_attn.indexer is not None for layer in model.model.layers] == [True, False, True]
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def _no_sinks(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.attn.sinks.data.fill_(-1e4)


def _indexer_rope_first(model) -> None:
    for layer in model.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.rope_last = False


def _no_clamp(model) -> None:
    for layer in model.model.layers[1:]:
        layer.mlp.swiglu = (0.0, layer.mlp.swiglu[1])


MUTATIONS = {"no-sinks": _no_sinks, "indexer-rope-first": _indexer_rope_first, "no-clamp": _no_clamp}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_logits(hy4, mutation):
    folder, reference = hy4
    assert max_diff(mutated_logits(folder, None, MUTATIONS[mutation]), reference) > 1e-2



def test_engine_greedy_with_chains_and_trees_equals_transformers(tiny_hy_v4_dir):
    """Chains eagerly, trees from graphs (on CPU their padded static inputs); a hidden-state head is refused."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    llm = runs.assert_ngram_greedy_equals_transformers(tiny_hy_v4_dir)
    want = runs.token_ids(llm.generate(runs.PROMPTS[:4], runs.greedy(16), use_tqdm=False))
    trees = LLM(model=str(tiny_hy_v4_dir), max_model_len=256, block_size=4, enforce_eager=False,
                speculative_config={"method": "ngram", "num_speculative_tokens": 4, "num_branches": 2,
                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive": False})
    assert runs.token_ids(trees.generate(runs.PROMPTS[:4], runs.greedy(16), use_tqdm=False)) == want
    with pytest.raises(ValueError, match=r"method='mtp' \(a head reading the target's hidden states\)"):
        LLM(model=str(tiny_hy_v4_dir), max_model_len=256, speculative_config={"method": "mtp",
                                                                            "num_speculative_tokens": 1})
