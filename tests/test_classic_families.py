"""The classic GPT-style families (:mod:`specray.models.classic`), against transformers on the same random tiny
weights (fp32, max abs diff < 1e-4) over a prefill and over chunks and single steps, with the engine's greedy output
under n-gram drafts equal to transformers' ``generate``, and two tensor-parallel ranks or pipeline stages equal to one:

* GPT-NeoX (``GPTNeoXForCausalLM``: Pythia): both blocks reading the stream through a LayerNorm each, RoPE on a
  quarter of each head, q/k/v fused head by head; and a release without the parallel residual, RoPE on half of each
  head at another base.
* Phi (``PhiForCausalLM``: phi-2): one LayerNorm before parallel attention and MLP, q/k LayerNorms, RoPE on 0.4 of each
  head, an LM head with a bias.
* GPT-J (``GPTJForCausalLM``): one LayerNorm before parallel blocks, RoPE on interleaved pairs of half of each head,
  unbiased attention, an LM head with a bias, its own names.
* StableLM (``StableLmForCausalLM``): StableLM 2 1.6B's Llama order with LayerNorms and q/k/v biases, and 12B's
  parallel blocks under one norm with a LayerNorm per query and key head (GQA).
* GPT-2 (``GPT2LMHeadModel``): learned positions, no RoPE, Conv1D weights with q/k/v fused, a tied head.
* OPT (``OPTForCausalLM``): learned positions from row 2 of the table, a ReLU MLP, its names; and OPT-350M's layout
  (norms after the blocks, embeddings projected in and out).
* Falcon (``FalconForCausalLM``): 40B's grouped q/k/v and two norms, 7B's one KV head and one norm, Falcon 2's
  grouped q/k/v and one norm, and blocks in sequence with a KV head per query head.
* GPT-BigCode (``GPTBigCodeForCausalLM``: StarCoder): GPT-2's layout with multi-query attention (q, k, v stacked in
  ``c_attn``), and a release with a KV head per query head, unscaled scores and an untied head.
* Persimmon (``PersimmonForCausalLM``): Phi's q/k LayerNorms and partial RoPE in Llama's order, q/k/v fused head by
  head, a squared-ReLU MLP.
"""

from __future__ import annotations

import sys

import pytest

from specray.models.classic import GatelessMLP
from specray.models.gpt_neox import GPTNeoXForCausalLM
from specray.models.falcon import FalconForCausalLM
from specray.models.gpt2 import GPT2LMHeadModel
from specray.models.gpt_bigcode import GPTBigCodeForCausalLM
from specray.models.gptj import GPTJForCausalLM
from specray.models.opt import OPTForCausalLM
from specray.models.llama import LlamaMLP
from specray.models.persimmon import PersimmonForCausalLM
from specray.models.phi import PhiForCausalLM
from specray.models.stablelm import StableLmForCausalLM
from specray.models.loader import load_model
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, assert_ranks_match_one_rank, chunked_logits, max_diff, prompt,
    reference_logits)

TOL = 1e-4

FAMILIES = {"gpt_neox": ("tiny_gpt_neox_dir", GPTNeoXForCausalLM, GatelessMLP),
            "gpt_neox_sequential": ("tiny_gpt_neox_sequential_dir", GPTNeoXForCausalLM, GatelessMLP),
            "phi": ("tiny_phi_dir", PhiForCausalLM, GatelessMLP),
            "gptj": ("tiny_gptj_dir", GPTJForCausalLM, GatelessMLP),
            "stablelm": ("tiny_stablelm_dir", StableLmForCausalLM, LlamaMLP),
            "stablelm_parallel": ("tiny_stablelm_parallel_dir", StableLmForCausalLM, LlamaMLP),
            "gpt2": ("tiny_gpt2_dir", GPT2LMHeadModel, GatelessMLP),
            "opt": ("tiny_opt_dir", OPTForCausalLM, GatelessMLP),
            "opt_350m": ("tiny_opt_350m_dir", OPTForCausalLM, GatelessMLP),
            "falcon": ("tiny_falcon_dir", FalconForCausalLM, GatelessMLP),
            "falcon_7b": ("tiny_falcon_7b_dir", FalconForCausalLM, GatelessMLP),
            "falcon2": ("tiny_falcon2_dir", FalconForCausalLM, GatelessMLP),
            "falcon_sequential": ("tiny_falcon_sequential_dir", FalconForCausalLM, GatelessMLP),
            "gpt_bigcode": ("tiny_gpt_bigcode_dir", GPTBigCodeForCausalLM, GatelessMLP),
            "gpt_bigcode_mha": ("tiny_gpt_bigcode_mha_dir", GPTBigCodeForCausalLM, GatelessMLP),
            "persimmon": ("tiny_persimmon_dir", PersimmonForCausalLM, GatelessMLP)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(request, family, schedule):
    fixture, model_class, mlp_class = FAMILIES[family]
    folder = request.getfixturevalue(fixture)
    model = load_model(str(folder))
    assert isinstance(model, model_class) and isinstance(model.model.layers[0].mlp, mlp_class)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference_logits(folder)) < TOL


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_greedy_with_ngram_drafts_equals_transformers(request, family):
    folder = request.getfixturevalue(FAMILIES[family][0])
    sys.modules["specray_test_engine_runs"].assert_ngram_greedy_equals_transformers(folder)


RANK_CHECKS = {1: ("tiny_gpt_neox_dir", "tiny_gpt_neox_sequential_dir", "tiny_phi_dir", "tiny_gptj_dir",
                   "tiny_stablelm_dir", "tiny_stablelm_parallel_dir", "tiny_gpt2_dir", "tiny_opt_dir",
                   "tiny_falcon_dir", "tiny_falcon_7b_dir", "tiny_falcon_sequential_dir", "tiny_opt_350m_dir",
                   "tiny_gpt_bigcode_dir", "tiny_gpt_bigcode_mha_dir", "tiny_persimmon_dir"),
               2: ("tiny_gpt_neox_dir", "tiny_phi_dir", "tiny_stablelm_parallel_dir", "tiny_gpt2_dir", "tiny_opt_dir",
                   "tiny_falcon_dir", "tiny_opt_350m_dir", "tiny_gpt_bigcode_dir")}


@pytest.mark.parametrize("stages", sorted(RANK_CHECKS))
def test_two_ranks_match_one_rank(request, tmp_path, stages):
    """Two tensor-parallel ranks (stages 1: heads, MLP widths and biases split) or two pipeline stages (2): the last
    rank's logits equal one rank's."""
    folders = [str(request.getfixturevalue(f)) for f in RANK_CHECKS[stages]]
    assert_ranks_match_one_rank(tmp_path, folders, stages, TOL)


# the pairs people draft with (OPT-125M for OPT-6.7B, Pythia-70M for Pythia-1B): a draft model of the same family
# (itself: every draft must be accepted, so its own learned positions and partial RoPE are read right) and of another
# (GPT-2 for OPT: a drafter's family need not be the target's, only its tokenizer)
DRAFT_PAIRS = {"opt+opt": ("tiny_opt_dir", "tiny_opt_dir"), "opt+gpt2": ("tiny_opt_dir", "tiny_gpt2_dir"),
               "gpt_neox+gpt_neox": ("tiny_gpt_neox_dir", "tiny_gpt_neox_dir"),
               "gpt_neox+gpt_neox_sequential": ("tiny_gpt_neox_dir", "tiny_gpt_neox_sequential_dir"),
               "gpt_bigcode+gpt_bigcode": ("tiny_gpt_bigcode_dir", "tiny_gpt_bigcode_dir")}


@pytest.mark.parametrize("pair", sorted(DRAFT_PAIRS))
def test_draft_model_greedy_equals_transformers(request, pair):
    """A classic family's draft model for a classic target (batch of four): the target's greedy tokens, as
    transformers' ``generate`` gives them; a target drafting for itself has every draft accepted."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    target, draft = (request.getfixturevalue(f) for f in DRAFT_PAIRS[pair])
    llm = LLM(model=str(target), max_model_len=256, block_size=4,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
                                  "adaptive": False})
    got = runs.token_ids(llm.generate(runs.PROMPTS[:4], runs.greedy(16), use_tqdm=False))
    runs.assert_transformers_generates(target, llm.get_tokenizer(), runs.PROMPTS[:4], got)
    stats = llm.spec_stats
    assert stats.draft_tokens > 0
    if target == draft:
        assert stats.accepted_tokens == stats.draft_tokens, stats


@pytest.mark.parametrize("fixture", ["tiny_gpt2_dir", "tiny_gpt_neox_dir", "tiny_gpt_bigcode_dir"])
def test_graph_steps_equal_eager_steps(request, fixture):
    """Steps replayed from graphs (``enforce_eager=False``: padded static inputs, positions among the graph's data)
    give the eager engine's tokens, with n-gram token trees (nodes at their depth's learned position or RoPE
    angle), a batch of four padded to eight and a lone request; prefix caching on."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    spec = {"method": "ngram", "num_speculative_tokens": 6, "num_branches": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "adaptive": False}
    folder = str(request.getfixturevalue(fixture))
    kwargs = dict(max_model_len=256, block_size=4, speculative_config=spec)
    eager, graphs = LLM(model=folder, **kwargs), LLM(model=folder, enforce_eager=False, enable_prefix_caching=True,
                                                     **kwargs)
    for prompts in (runs.PROMPTS[:4], runs.PROMPTS[:1]):
        want = runs.token_ids(eager.generate(prompts, runs.greedy(), use_tqdm=False))
        assert runs.token_ids(graphs.generate(prompts, runs.greedy(), use_tqdm=False)) == want
    assert graphs.engine.executor.worker.runner.graphs.graphs and graphs.spec_stats.accepted_tokens > 0
