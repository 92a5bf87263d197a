"""Hybrid linear-attention models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: specray.models.qwen3_5, gated_deltanet) against
transformers on the same random weights (fp32, max abs diff < 1e-4): one prefill, a prefill in chunks, decode steps
with the recurrent state carried, drafts replayed after verification; broken variants that must fail; the engine end to
end (plain greedy equals speculative greedy with n-gram drafts accepted and rejected, chunked prefill, preemption,
seeded sampling), the refusals, and TP 2 against one rank."""

from __future__ import annotations

import pytest
import torch

from specray.models.gated_deltanet import GatedDeltaNet, RecurrentBatch
from specray.models.loader import load_model
from specray_test_model_checks import run_ranks  # tests/model_checks.py
from specray_test_hybrid_models import (  # tests/hybrid_models.py
    NGRAM, PP_WORKER, TINY, TOL, TP_WORKER, Stepper, check_drafts_replayed, check_greedy_equals_transformers,
    branched, check_prefill_chunks_and_decode, generate, greedy, hf_logits, hf_pair, ours, recorded_batches, tokens,
    tree_graphs)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_prefill_chunks_and_decode_match_transformers(tmp_path, arch):
    """(check_prefill_chunks_and_decode, tests/hybrid_models.py)"""
    check_prefill_chunks_and_decode(*ours(tmp_path, arch))


def test_aux_layers_are_the_residual_streams_entering_those_layers(tmp_path):
    """EAGLE-3's features: ``forward(..., aux_layers)`` gives the residual stream entering each asked layer (linear
    and full attention ones, in the order asked) as the Llama stack does, over a prefill and a next chunk with the
    state carried: equal to transformers' ``hidden_states[i]`` (the input of layer i)."""
    model, hf = ours(tmp_path, "qwen3_5", seed=5)
    seq, aux = tokens(20, 6), (2, 0, 1)
    with torch.no_grad():
        want = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
    run, got = Stepper(model), []

    class Probe:  # the model as Stepper calls it, asking for aux_layers and keeping what they give
        def __call__(self, ids, meta):
            hidden, streams = model(ids, meta, aux_layers=aux)
            got.append(streams)
            return hidden

        compute_logits = model.compute_logits

    run.model = Probe()
    run.step([(0, seq[:12], 0, 0)])
    run.step([(0, seq[12:], 12, 0)])
    for j, layer in enumerate(aux):
        assert (torch.cat([streams[j] for streams in got]) - want[layer][0]).abs().max() < TOL, layer
    assert (got[0][0] - got[0][1]).abs().max() > 0.1  # the layers asked for differ: a wrong one would show


def test_drafts_are_replayed_as_accepted(tmp_path):
    """(check_drafts_replayed, tests/hybrid_models.py)"""
    check_drafts_replayed(*ours(tmp_path, "qwen3_5", seed=3))


def test_no_host_sync_in_a_step(tmp_path, no_host_sync):
    """A step with a replay, a verify chunk and a fresh prefill reads no tensor's value on the host."""
    model, _ = ours(tmp_path, "qwen3_5", seed=9)
    run = Stepper(model)
    seq = tokens(20, 10)
    run.step([(0, seq[:8], 0, 0)])
    run.step([(0, seq[8:11], 8, 2)])
    with no_host_sync():
        run.step([(0, seq[10:12], 10, 1), (1, seq[:5], 0, 0)])


def test_multimodal_release_serves_its_text_model(tmp_path):
    """Qwen3.5's multimodal release (``Qwen3_5ForConditionalGeneration``): its text model read from
    ``model.language_model.*`` and ``lm_head``, the vision tower left unread; logits equal the whole model's on
    text."""
    import transformers as tf

    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=1)
    torch.manual_seed(7)
    hf = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=dict(TINY), vision_config=vision)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name and "linear_attn" not in name:
                param.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    seq = tokens(12, 8)
    got = Stepper(model).step([(0, seq, 0, 0)])[0]
    assert (got - hf_logits(hf, seq)).abs().max() < TOL


def test_broken_state_handling_fails(tmp_path, monkeypatch):
    """The tests can fail: the state dropped between chunks, the conv history off by one token, and drafts
    committed as if all were accepted each change the logits past tolerance."""
    model, hf = ours(tmp_path, "qwen3_5", seed=5)
    seq = tokens(20, 6)
    ref = hf_logits(hf, seq)

    def chunked_error() -> float:
        run = Stepper(model)
        got = [run.step([(0, seq[s:e], s, 0)])[0] for s, e in ((0, 8), (8, 14), (14, 20))]
        return (torch.cat(got) - ref).abs().max().item()

    assert chunked_error() < TOL
    real = GatedDeltaNet._recurrence

    def forgetting(self, mixed, g, beta, batch, query_lens):  # every chunk starts from zeros
        return real(self, mixed, g, beta, RecurrentBatch(batch.slots, [True] * len(batch.slots),
                                                         [0] * len(batch.slots), batch.drafts), query_lens)

    monkeypatch.setattr(GatedDeltaNet, "_recurrence", forgetting)
    assert chunked_error() > 100 * TOL
    monkeypatch.undo()
    import specray.models.gated_deltanet as gdn

    conv = gdn.causal_conv
    monkeypatch.setattr(gdn, "causal_conv", lambda window, weight, bias=None, act=True: conv(  # the history one
        torch.cat((window[:, :1] * 0, window[:, :-1]), dim=1), weight, bias, act))  # input short
    assert chunked_error() > 100 * TOL
    monkeypatch.undo()
    run = Stepper(model)  # drafts never pending: the next chunk replays nothing, as if all were committed
    run.step([(0, seq[:10], 0, 0)])
    run.step([(0, [seq[10], 7, 8], 10, 0)])  # claims no drafts: its wrong tokens go into the state
    run.base[0] = (11, 0)
    out = run.step([(0, seq[11:13], 11, 0)])[0]
    assert (out - ref[11:13]).abs().max() > 100 * TOL


# ---- the engine --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_greedy(tiny_qwen3_5_dir):
    from specray import LLM

    return generate(LLM(model=str(tiny_qwen3_5_dir), max_model_len=128), greedy())


def test_plain_engine_equals_transformers_greedy(tiny_qwen3_5_dir, plain_greedy):
    check_greedy_equals_transformers(tiny_qwen3_5_dir, plain_greedy)


@pytest.mark.parametrize("case", ["batched", "chunked-prefill", "preemption", "async"])
def test_ngram_greedy_equals_plain(tiny_qwen3_5_dir, plain_greedy, case):
    """n-gram drafts (some accepted, some rejected: the replay of accepted drafts) give plain greedy decoding's
    tokens, with prefills in small chunks, and with a KV pool so small that requests are preempted and recompute
    their state from token 0."""
    from specray import LLM

    kw = {"chunked-prefill": dict(max_num_batched_tokens=8, long_prefill_token_threshold=5),
          "preemption": dict(block_size=4, num_kv_blocks=24), "async": dict(async_scheduling=True)}.get(case, {})
    llm = LLM(model=str(tiny_qwen3_5_dir), max_model_len=128, speculative_config=NGRAM, **kw)
    assert generate(llm, greedy()) == plain_greedy
    stats = llm.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, stats
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


def test_engine_comparison_can_fail(tiny_qwen3_5_dir, plain_greedy, monkeypatch):
    """The comparison above can fail: replaying no accepted draft (the state left where the last verify chunk began)
    changes the output."""
    from specray import LLM
    from specray.workers.model_runner import RecurrentSlots

    real = RecurrentSlots.batch

    def no_replay(self, chunks):
        batch = real(self, chunks)
        batch.replay = [0] * len(batch.replay)
        return batch

    monkeypatch.setattr(RecurrentSlots, "batch", no_replay)
    llm = LLM(model=str(tiny_qwen3_5_dir), max_model_len=128, speculative_config=NGRAM)
    out = generate(llm, greedy())
    assert all(len(o) == 24 for o in out) and out != plain_greedy  # every request ran to its end, differently


def test_seeded_sampling_with_ngram_equals_plain(tiny_qwen3_5_dir):
    """n-gram drafts of a seeded sampled request are verified by coupling: the same tokens as without them."""
    from specray import LLM, SamplingParams

    params = SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    plain = generate(LLM(model=str(tiny_qwen3_5_dir), max_model_len=128), params)
    spec = LLM(model=str(tiny_qwen3_5_dir), max_model_len=128, speculative_config=NGRAM)
    assert generate(spec, params) == plain
    assert spec.spec_stats.accepted_tokens > 0


@pytest.mark.parametrize("kw, match", [
    (dict(speculative_config={"method": "gemma4_assistant", "model": "nowhere", "num_speculative_tokens": 4}),
     "method='gemma4_assistant'"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3"),
])
def test_refusals(tiny_qwen3_5_dir, kw, match):
    from specray import LLM

    with pytest.raises(ValueError, match=match):
        LLM(model=str(tiny_qwen3_5_dir), max_model_len=128, **kw)


def test_requests_may_pick_the_lookups_and_trees_of_their_own(tiny_qwen3_5_dir, plain_greedy):
    """A request's own drafting method (``speculative_method``) on a linear-attention model: the lookups, whose
    chains and token trees its state verifies (suffix decoding's trees, a chain lookup), keep greedy output equal to
    plain, as the engine's own method does; so does lookahead decoding's Jacobi window as the engine's method."""
    from dataclasses import replace

    from specray import LLM

    llm = LLM(model=str(tiny_qwen3_5_dir), max_model_len=128, speculative_config=NGRAM)
    for method in ("suffix", "ngram_simple"):
        assert generate(llm, replace(greedy(), speculative_method=method)) == plain_greedy, method
    assert generate(llm, greedy()) == plain_greedy
    assert llm.spec_stats.accepted_tokens > 0
    lookahead = LLM(model=str(tiny_qwen3_5_dir), max_model_len=128,
                    speculative_config={"method": "lookahead", "num_speculative_tokens": 15, "adaptive": False})
    assert generate(lookahead, greedy()) == plain_greedy and lookahead.spec_stats.accepted_tokens > 0


# keys of one token: over the test prompts some have several values, which k4v proposes as a token tree
K4V = {"method": "ngram_map_k4v", "num_speculative_tokens": 6, "ngram_size_n": 1, "ngram_size_m": 3, "adaptive": False}


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_k4v_trees_and_a_user_drafter_keep_greedy(tiny_qwen3_5_dir, plain_greedy, tmp_path, monkeypatch, eager):
    """llama.cpp's ``ngram_map_k4v`` (a token tree of a key's values) and a user-provided drafter (docs/examples'
    tree of what followed the last token's earlier occurrences) on a linear-attention target: their chains and token
    trees verified by the recurrent state (each draft's state from its own path), eagerly and from graphs (the
    recurrence's tree form): plain greedy's tokens, drafts accepted, trees among the steps."""
    from pathlib import Path

    from specray import LLM

    example = Path(__file__).parents[1] / "docs" / "examples" / "last_token_drafter.py"
    (tmp_path / "hybrid_drafters.py").write_text(example.read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    user = {"method": "hybrid_drafters:LastTokenDrafter", "num_speculative_tokens": 6, "adaptive": False}
    for spec in (K4V, user):
        batches = recorded_batches(monkeypatch)
        llm = LLM(model=str(tiny_qwen3_5_dir), max_model_len=128, speculative_config=spec, enforce_eager=eager)
        assert generate(llm, greedy()) == plain_greedy, spec["method"]
        assert llm.spec_stats.accepted_tokens > 0 and branched(batches), (spec["method"], llm.spec_stats)
        assert eager or tree_graphs(llm)


def test_a_hybrid_draft_model_is_refused(tiny_qwen3_5_dir, tiny_llama_dir):
    from specray import LLM

    with pytest.raises(ValueError, match="linear-attention layers"):
        LLM(model=str(tiny_llama_dir), max_model_len=128,
            speculative_config={"method": "draft_model", "model": str(tiny_qwen3_5_dir), "num_speculative_tokens": 2})


def test_graphs_allowed_for_linear_attention(tiny_qwen3_5_dir):
    """The dense model's steps may replay graphs: its linear-attention layers run a fixed-shape recurrence there
    (tests/test_graphs_hybrid.py) and its gated attention is plain paged attention."""
    from specray.models.step_graphs import graph_safe

    assert graph_safe(load_model(tiny_qwen3_5_dir)) is None


# ---- tensor parallelism ------------------------------------------------------------------------------------------

def test_tensor_parallel_shards_match_one_rank(tmp_path):
    """TP 2 over gloo: the linear layers' key and value heads split over the ranks (their projections, conv
    channels, decays and states), the gated attention's heads and (Qwen3-Next) the fused checkpoint projections and
    experts split by width; logits of prefills, a verify chunk and the replay after it equal one rank's."""
    folders = []
    for arch, seed in (("qwen3_5", 31), ("qwen3_next", 32)):
        _, hf = hf_pair(arch, seed)
        hf.save_pretrained(tmp_path / arch)
        folders.append(str(tmp_path / arch))
    for r, result in enumerate(run_ranks(tmp_path, TP_WORKER, 2, 2, folders, timeout=240)):
        for folder, (diff, heads) in result.items():
            assert diff < TOL, (r, folder, diff)
            assert heads == TINY["linear_num_value_heads"] // 2, folder


def test_pipeline_stages_match_one_rank(tmp_path):
    """Two pipeline stages over gloo (layers 0-1 and 2: each stage keeps the recurrent states of its own linear
    layers, the last stage its attention's K/V too): the last stage's logits of prefills, a verify chunk and the
    replay after it equal one rank's."""
    folders = []
    for arch, seed in (("qwen3_5", 33), ("qwen3_next", 34)):
        _, hf = hf_pair(arch, seed)
        hf.save_pretrained(tmp_path / arch)
        folders.append(str(tmp_path / arch))
    first, last = run_ranks(tmp_path / "ranks", PP_WORKER, 2, 2, folders, timeout=240)
    for folder in folders:
        (first_layers, none), (last_layers, diff) = first[folder], last[folder]
        assert none is None and first_layers == [0, 1] and last_layers == [2], (first[folder], last[folder])
        assert diff < TOL, (folder, diff)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_ngram_token_trees_equal_plain_decoding(tiny_qwen3_5_dir, eager):
    """n-gram token trees (three branches) verified on a hybrid model: each draft's state follows its own path
    (its conv over its ancestors' inputs, its delta rule from its parent's state), the accepted path's pending
    inputs are put in path order by the next plan's K/V move and replayed; greedy tokens equal plain decoding's,
    with paths other than the first branch accepted (K/V moves made), tree steps eager beside chain steps from
    graphs."""
    from specray import LLM

    spec = {**NGRAM, "num_speculative_tokens": 6, "num_branches": 3}
    plain = generate(LLM(model=str(tiny_qwen3_5_dir), max_model_len=128), greedy())
    llm = LLM(model=str(tiny_qwen3_5_dir), max_model_len=128, speculative_config=spec, block_size=4,
              enforce_eager=eager)
    moves = []
    apply = llm.engine.executor.worker.runner.apply_plan_state

    def recording(plan):
        moves.extend(plan.kv_moves)
        return apply(plan)

    llm.engine.executor.worker.runner.apply_plan_state = recording
    assert generate(llm, greedy()) == plain
    assert llm.spec_stats.accepted_tokens > 0 and moves, (llm.spec_stats, len(moves))
