"""OLMo Hybrid (``OlmoHybridForCausalLM``: specray.models.olmo_hybrid): OLMo 3's post-norm attention layers among
pre-norm Gated DeltaNet layers with their own q/k/v, g, a and b projections and strengths doubled
(negative eigenvalues), against transformers on the same random tiny weights (fp32, max abs diff < 1e-4): one
prefill, a prefill in chunks, decode steps with the recurrent state carried, drafts replayed after verification; each
difference from Qwen3-Next's layer shown to matter; the engine's greedy output with n-gram drafts equal to
transformers', and with an EAGLE-3 head's drafts plain decoding's; prefix caching from kept states; TP 2 and two
pipeline stages equal to one rank."""

from __future__ import annotations

import pytest

from specray_test_model_checks import run_ranks  # tests/model_checks.py
from specray_test_hybrid_models import (  # tests/hybrid_models.py
    NGRAM, PP_WORKER, TOL, TP_WORKER, check_drafts_replayed, check_greedy_equals_transformers,
    check_eagle3_keeps_greedy, check_prefill_chunks_and_decode, check_prefix_caching_keeps_tokens, generate, greedy,
    hf_logits, hf_pair, ours, save, tokens)


def test_prefill_chunks_and_decode_match_transformers(tmp_path):
    """(check_prefill_chunks_and_decode, tests/hybrid_models.py)"""
    check_prefill_chunks_and_decode(*ours(tmp_path, "olmo_hybrid", seed=1))


def test_drafts_are_replayed_as_accepted(tmp_path):
    """(check_drafts_replayed, tests/hybrid_models.py)"""
    check_drafts_replayed(*ours(tmp_path, "olmo_hybrid", seed=2))


@pytest.mark.parametrize("change", ["strength", "gated-norm-eps", "rope"])
def test_each_difference_shows(tmp_path, change):
    """Without the doubled strength, with another epsilon in the gated norm (a large one, so that it shows), or
    without rotating q and k (a config with no rope_theta's way), the logits move (so the match above reads each)."""
    from specray.models import olmo_hybrid
    from specray.models.loader import load_model

    model, hf = ours(tmp_path, "olmo_hybrid", seed=3)
    seq = tokens(16, 5)
    want = hf_logits(hf, seq)
    if change == "strength":
        for _, layer in model.model.stage_layers():
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.beta_scale = 1.0
    elif change == "gated-norm-eps":
        for _, layer in model.model.stage_layers():
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.norm.eps = 0.5
    else:
        model.model.nope = True
    from specray_test_hybrid_models import Stepper

    got = Stepper(model).step([(0, seq, 0, 0)])[0]
    assert (got - want).abs().max() > 0.01 * (want.max() - want.min()), ((got - want).abs().max(), want.max())
    assert olmo_hybrid.GATED_NORM_EPS == 1e-5 and isinstance(load_model(tmp_path), olmo_hybrid.OlmoHybridForCausalLM)


def test_engine_greedy_equals_transformers(tmp_path):
    """n-gram drafts verified over the recurrent state (accepted and rejected) give transformers' greedy tokens."""
    from specray import LLM

    folder = save(tmp_path / "m", "olmo_hybrid", 4)
    llm = LLM(model=str(folder), max_model_len=128, speculative_config=NGRAM)
    outs = generate(llm, greedy())
    check_greedy_equals_transformers(folder, outs)
    assert llm.spec_stats.accepted_tokens > 0


def test_two_ranks_match_one(tmp_path):
    """TP 2 over gloo: the attention heads (q and k normed over all of them) and the linear-attention heads split."""
    _, hf = hf_pair("olmo_hybrid", 6)
    hf.save_pretrained(tmp_path / "m")
    for r, result in enumerate(run_ranks(tmp_path / "ranks", TP_WORKER, 2, 2, [str(tmp_path / "m")], timeout=240)):
        for folder, (diff, heads) in result.items():
            assert diff < TOL and heads == 2, (r, folder, diff, heads)  # 4 value heads, 2 a rank


def test_two_pipeline_stages_match_one_rank(tmp_path):
    """PP 2 over gloo (layers 0-1: a linear and an attention layer; 2-3: linear ones), each stage keeping its own
    recurrent states: the last stage's logits of prefills, a verify chunk and the replay after it equal one rank's."""
    _, hf = hf_pair("olmo_hybrid", 7)
    hf.save_pretrained(tmp_path / "m")
    folder = str(tmp_path / "m")
    first, last = run_ranks(tmp_path / "ranks", PP_WORKER, 2, 2, [folder], timeout=240)
    (first_layers, none), (last_layers, diff) = first[folder], last[folder]
    assert none is None and first_layers == [0, 1] and last_layers == [2, 3], (first, last)
    assert diff < TOL, diff


def test_prefix_caching_starts_from_kept_states(tmp_path):
    """Two turns of three conversations with prefix caching: the second turn starts behind cached blocks and kept
    Gated DeltaNet states, and gives an engine without prefix caching's tokens, with n-gram drafts."""
    check_prefix_caching_keeps_tokens(save(tmp_path / "m", "olmo_hybrid", 8))  # (tests/hybrid_models.py)


@pytest.mark.parametrize("arch", ["olmo_hybrid", "qwen3_5"])
def test_tp_must_split_the_linear_heads(arch):
    """The family refuses, before any rank starts, a tensor_parallel_size that does not divide the linear-attention
    layers' key heads (2 here) or value heads (4), and takes one that divides both."""
    from specray.engine.builder import check_family_split

    config = hf_pair(arch)[1].config
    check_family_split(config, 2, 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not split this model's linear_num_key_heads=2"):
        check_family_split(config, 4, 1)
    config.linear_num_key_heads, config.linear_num_value_heads = 4, 6
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not split this model's linear_num_value_heads=6"):
        check_family_split(config, 4, 1)


def test_an_eagle3_head_keeps_greedy_output(tmp_path):
    """An EAGLE-3 head drafting chains, then EAGLE-2 trees, over it (the streams entering three of its layers,
    post-norm and linear ones, handed out by the Llama stack): greedy output equals plain decoding's, its drafts
    accepted now and then."""
    check_eagle3_keeps_greedy(tmp_path, "olmo_hybrid")  # (tests/hybrid_models.py)
