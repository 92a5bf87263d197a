"""RecurrentGemma (``RecurrentGemmaForCausalLM``: specray.models.recurrent_gemma) against transformers on the same
random tiny weights (fp32, max abs diff < 1e-4): a prefill and chunks then single steps with the conv history and the
RG-LRU state carried; two sequences batched in uneven chunks; a prefill long enough for several of the long-step
chunks; drafts replayed after verification; a token tree's rows each on its own path; each part of the family shown
to matter (broken once, the comparison fails); the engine's greedy tokens plain, with n-gram chains from graph steps
and with trees equal transformers'; TP 2 equal to one rank; the refusals; on a GPU, its logits equal the CPU's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import specray.models.recurrent_gemma as rg
from specray.models.loader import load_model, read_config
from specray_test_hybrid_models import (  # tests/hybrid_models.py
    TOL, TP_WORKER, check_drafts_replayed, check_graph_form_equals_eager, check_greedy_equals_transformers,
    check_long_prefill, check_ngram_replays_keep_greedy, check_no_host_sync_in_a_step, check_prefill_chunks_and_decode,
    check_prefix_caching_keeps_tokens, check_tree_rows_match_their_paths, generate, greedy, tokens)
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, chunked_logits, max_diff, mutated_logits, prompt, reference_logits, run_ranks)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# four layers (recurrent, recurrent, attention, recurrent: block_types repeated); 4 query heads of 12 and one KV head
# (RoPE on 6 of 12 features), a window of 6 positions; an RG-LRU of 64 channels in 4 gate blocks (2 a rank at TP 2),
# a conv of 4; hidden 48, whose sqrt rounds visibly in bfloat16 (6.928 -> 6.9375); a soft cap of 5 the logits reach
TINY_RG = dict(hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, lru_width=64,
               intermediate_size=64, attention_window_size=6, conv1d_width=4, logits_soft_cap=5.0,
               block_types=["recurrent", "recurrent", "attention"], bos_token_id=None, pad_token_id=None)


def build_rg(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random RecurrentGemma folder with conftest's tiny tokenizer. What transformers starts at 0 (norms, every
    bias, the gates' biases) drawn at random, the recurrence's parameter so that a = exp(-8 r softplus(p)) spreads over
    (0.1, 0.99); the embedding doubled, so that greedy decoding falls into loops (n-gram drafts then accepted in some
    steps, rejected in others)."""
    import transformers as tf

    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path)
    config = tf.RecurrentGemmaConfig(**{**TINY_RG, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                                        **overrides})
    torch.manual_seed(seed)
    model = tf.RecurrentGemmaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif name.endswith("recurrent_param"):
                param.uniform_(-4.0, -0.5)
            elif name.endswith("gate_weight"):
                param.normal_(0.0, 0.3)
        model.get_input_embeddings().weight.mul_(2.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_rg_dir(tmp_path_factory) -> Path:
    return build_rg(tmp_path_factory.mktemp("tiny_recurrent_gemma"), seed=1)


@pytest.fixture(scope="module")
def hf_rg(tiny_rg_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_rg_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(tiny_rg_dir):
    return reference_logits(tiny_rg_dir)


# ---- logits against transformers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_rg_dir, reference, schedule):
    """A 40-token prefill, and the same prompt in chunks (17, 9, 3) then single tokens, the recurrent state carried in
    slot 0: every logit row equals transformers'; the soft cap bites (some logits past half of it)."""
    model = load_model(str(tiny_rg_dir))
    assert type(model).__name__ == "RecurrentGemmaForCausalLM"
    got = chunked_logits(model, prompt(), SCHEDULES[schedule])
    assert max_diff(got, reference) < TOL
    assert got.abs().max() > 0.5 * TINY_RG["logits_soft_cap"]


def test_batched_chunks_long_prefill_and_replayed_drafts(tiny_rg_dir, hf_rg):
    """(tests/hybrid_models.py) two sequences batched in uneven chunks then decode steps; a 150-token prefill whole and
    in two chunks; verify chunks whose accepted drafts the next chunk replays through the conv and the RG-LRU."""
    model = load_model(str(tiny_rg_dir))
    check_prefill_chunks_and_decode(model, hf_rg)
    check_long_prefill(model, hf_rg)
    check_drafts_replayed(model, hf_rg)


def test_parallel_scan_of_long_steps_matches_transformers(tiny_rg_dir, hf_rg, monkeypatch):
    """The long-step form a GPU takes (the prefix scan over 64-token chunks, forced here on the CPU) over a 150-token
    prefill whole and in two chunks: transformers' logits, and the prefix scan did run."""
    runs, scan = [], rg.scanned_selective
    monkeypatch.setattr(rg, "scans_in_parallel", lambda device: True)
    monkeypatch.setattr(rg, "scanned_selective", lambda *a, **kw: runs.append(1) or scan(*a, **kw))
    check_long_prefill(load_model(str(tiny_rg_dir)), hf_rg)
    assert runs


def test_token_tree_rows_match_their_paths(tiny_rg_dir, hf_rg):
    """A verify chunk whose drafts form a tree (the real token, two children of it, a grandchild under each, a
    great-grandchild under the second branch): each row's logits equal transformers' for its own path alone (its conv
    and RG-LRU over its ancestors, its attention over them)."""
    check_tree_rows_match_their_paths(load_model(str(tiny_rg_dir)), hf_rg, tokens(16, 5), 10, 1, [-1, -1, 0, 1, 3],
                                      seed=5)


def _params(suffix: str, value: float):
    def mutate(model):
        for name, param in model.named_parameters():
            if name.endswith(suffix):
                param.data.fill_(value)
    return mutate


def _set(config, **fields):
    for field, value in fields.items():
        setattr(config, field, value)


def _unrounded_scale(model):
    model.model.embed_scale = TINY_RG["hidden_size"] ** 0.5


def _whole_heads(config):
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 1.0}


# name -> (mutate_config, mutate, monkeypatched (object, attribute, value) or None)
MUTATIONS = {
    "input gate left out": (None, None, (rg.RGLRU, "_input_gate", lambda self, blocks: 1.0)),
    "recurrence gate left out": (None, None, (rg.RGLRU, "_gate", lambda self, u, w, b: torch.ones_like(u).flatten(2))),
    "no sqrt(1 - a^2) scale": (None, None, (rg.RGLRU, "_normaliser", staticmethod(lambda log_a: 1.0))),
    "position 0 scaled as the rest": (None, None, (rg.RGLRU, "_first_rows", lambda self, b, n, d: None)),
    "decay not times 8": (None, None, (rg.RGLRU, "gate_scale", 1.0)),
    "conv bias left out": (None, _params("conv1d.bias", 0.0), None),
    "embedding scale not rounded to bfloat16": (None, _unrounded_scale, None),
    "no logit soft cap": (None, lambda m: setattr(m, "final_logit_softcapping", None), None),
    "no sliding window": (lambda c: _set(c, sliding_window=4096, attention_window_size=4096), None, None),
    "whole heads rotated": (_whole_heads, None, None),
    "o_proj bias left out": (None, _params("o_proj.bias", 0.0), None),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_part_shows_in_the_logits(tiny_rg_dir, reference, monkeypatch, name):
    """The comparison above can fail: each of RecurrentGemma's own parts (module docstring) broken once moves the
    chunked + decode schedule's logits past tolerance."""
    mutate_config, mutate, patch = MUTATIONS[name]
    if patch is not None:
        monkeypatch.setattr(*patch)
    got = mutated_logits(tiny_rg_dir, mutate_config, mutate)
    assert max_diff(got, reference) > 10 * TOL, name


@pytest.mark.parametrize("q_rows", [4, 16])
def test_the_graph_form_equals_the_eager_one(tiny_rg_dir, q_rows):
    """An RG-LRU layer's graph form (a RecurrentGraphBatch: freshness read on the device) against its eager form on
    random states and inputs: a sequence replaying drafts, a fresh one (its row 0 at position 0) over a slot holding
    an old state, one with drafts, and a padding sequence: the same outputs for every real row and the same committed
    state in each target slot."""
    layer = load_model(str(tiny_rg_dir)).model.layers[0].temporal_block
    check_graph_form_equals_eager(layer, q_rows, lambda st: (st.inputs.normal_(), st.matrix.normal_()), lambda rows: (
        torch.randn(rows, layer.width), torch.zeros(rows, layer.width), torch.zeros(rows, layer.width)))


def test_no_host_sync_in_a_step(tiny_rg_dir, no_host_sync):
    """(check_no_host_sync_in_a_step) a step with a replay, a verify chunk and a fresh prefill reads no tensor's value
    on the host."""
    check_no_host_sync_in_a_step(load_model(str(tiny_rg_dir)), no_host_sync)


# ---- the engine --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain(tiny_rg_dir) -> list[list[int]]:
    from specray import LLM

    return generate(LLM(model=str(tiny_rg_dir), max_model_len=128), greedy())


def test_plain_engine_equals_transformers(tiny_rg_dir, plain):
    """(check_greedy_equals_transformers) several requests at once, each in its own state slot."""
    check_greedy_equals_transformers(tiny_rg_dir, plain)


@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
def test_ngram_drafts_keep_greedy(tiny_rg_dir, plain, monkeypatch, tree):
    """(check_ngram_replays_keep_greedy) n-gram chains and trees of three branches from graph steps (the
    fixed-shape recurrence, its tree form for trees): plain greedy's tokens, drafts accepted and replayed."""
    check_ngram_replays_keep_greedy(tiny_rg_dir, plain, tree, monkeypatch)


def test_prefix_caching_keeps_tokens(tiny_rg_dir):
    """(check_prefix_caching_keeps_tokens) second turns behind cached blocks and kept recurrent states give the tokens
    an engine without prefix caching gives."""
    check_prefix_caching_keeps_tokens(tiny_rg_dir)


# ---- refusals ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, match", [
    (dict(block_types=["recurrent", "mlp"]), "block_types="),
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    (dict(lru_width=66), "lru_width=66"),
])
def test_config_refusals(tiny_rg_dir, change, match):
    config = read_config(str(tiny_rg_dir))
    _set(config, **change)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_rg_dir), config=config)


def test_split_and_lora_refusals(tiny_rg_dir):
    """Pipeline stages, TP that splits the RG-LRU's gate blocks unevenly: refused before any rank starts (LoRA is
    served: tests/test_lora_hybrids.py)."""
    from specray import LLM

    for kw, match in ((dict(pipeline_parallel_size=2), "pipeline_parallel_size=2"),
                      (dict(tensor_parallel_size=8), "num_attention_heads")):
        with pytest.raises(ValueError, match=match):
            LLM(model=str(tiny_rg_dir), max_model_len=128, **kw)


# ---- tensor parallelism --------------------------------------------------------------------------------------------

def test_tensor_parallel_shards_match_one_rank(tiny_rg_dir, tmp_path):
    """TP 2 over gloo: the query heads (the one KV head replicated), the RG-LRU's channels by whole gate blocks, its
    conv and the MLP split over the ranks; logits of prefills, a verify chunk and the replay after it equal one
    rank's."""
    folder = str(tiny_rg_dir)
    for r, result in enumerate(run_ranks(tmp_path, TP_WORKER, 2, 2, [folder], timeout=240)):
        diff, heads = result[folder]
        assert diff < TOL and heads == TINY_RG["lru_width"] // 2, (r, diff, heads)


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(tiny_rg_dir, schedule):
    """tests/test_device_parity.py's check for this file's fixture: fp32 logits on CUDA equal the CPU's."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    checks.assert_logits_on_the_gpu_equal_the_cpu(tiny_rg_dir, SCHEDULES[schedule])
