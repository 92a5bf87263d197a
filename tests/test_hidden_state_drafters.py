"""Hidden-state drafters (EAGLE-1, EAGLE-3, MTP) through the engine, on a tiny random 6-layer target: greedy output
equals plain greedy output (batch 1 and 8, mixed per-request draft caps and max_tokens edges, preemption, chunked
prefill, stop strings); the drafts the worker returns equal the head run densely over each request's committed
tokens, and its K/V equals that run's; sampling keeps the target's distribution; no KV block leaks; a request cannot
pick another method on such an engine.

Two heads per method: a random one (``draft_heads.write_random_head``: ~0 acceptance, so every step verifies and
rejects) and one built to be often right (``draft_heads.write_accepting_head``), so that the accepted-drafts path
(the first pass over accepted rows, the head's K/V at accepted positions) really runs."""

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoTokenizer

from specray import LLM, SamplingParams
from specray.models.attention import build_attention_metadata
from specray.models.draft_head_loader import load_draft_head
from specray.models.kv_cache import allocate_kv_cache, slots_of
from specray.models.loader import load_hf_config, load_model
from specray.sampling import SamplingBatch, logits_to_probs
from specray.tree import parse_token_tree
import specray_test_draft_heads as draft_heads  # tests/draft_heads.py (tests/conftest.py registers it)
from specray_test_engine_runs import (PROMPTS, Recorder, check_candidates, greedy,  # tests/engine_runs.py
                                      siblings_reversed, token_ids)

CHAIN_METHODS = ("eagle", "eagle3", "mtp")
# EAGLE-2: the eagle3 head drafting dynamic trees (2 children per node, 3 levels, the best 5 nodes)
TREE = {"use_dynamic_tree": True, "dynamic_tree_max_topK": 2, "dynamic_tree_depth": 3}
WIDE_TREE = {"dynamic_tree_max_topK": 4, "dynamic_tree_depth": 6, "num_speculative_tokens": 24}
# "mtp3": three distinct MTP modules (num_nextn_predict_layers=3), each drafting one position further
# "-static": vLLM's static tree (speculative_token_tree, its Python-literal string): 2 nodes at depth 1, a rank left
# out at depth 2 (a greedy node's rank is not its place among its siblings), 5 nodes (all verified)
STATIC = "[(0,), (1,), (0, 0), (0, 2), (0, 0, 0)]"
METHODS = CHAIN_METHODS + ("mtp3", "eagle3-tree", "mtp-tree", "eagle3-static", "medusa", "redrafter",
                           "mlp_speculator")
# ReDrafter: 3 beams of 3 drafts each, merged into a prefix tree
BEAMS = {"redrafter_num_beams": 3, "redrafter_draft_len_per_beam": 3}
TREE_METHODS = {"eagle3-tree": TREE["dynamic_tree_max_topK"], "mtp-tree": TREE["dynamic_tree_max_topK"],
                "mtp3-tree": TREE["dynamic_tree_max_topK"], "eagle3-static": 2, "mtp-static": 2, "mtp3-static": 2,
                "medusa": 3,  # -> nodes at depth 1 of its tree
                "redrafter": BEAMS["redrafter_num_beams"]}


# per prompt of the batch: draft caps (0: none for that request, 1, the engine's), max_tokens edges (1 and 2
# leave no room for a draft; 3 for one) and logprobs (of the tokens kept from accepted drafts too)
MIXED = [greedy(), greedy(num_speculative_tokens=0), greedy(1), greedy(2), greedy(3), greedy(num_speculative_tokens=1),
         greedy(logprobs=2), greedy(7)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def target_dir(make_tiny_model, tmp_path_factory) -> Path:
    # 6 layers: EAGLE-3's default target layers (2, 3, 3) exist
    return make_tiny_model(tmp_path_factory.mktemp("hs_target"), "llama", num_hidden_layers=6,
                           tie_word_embeddings=True)


@pytest.fixture(scope="module")
def heads(target_dir, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(kind, method) -> the head's folder (for MTP, the target's folder with the MTP layer added)."""
    out = {}
    for method in CHAIN_METHODS:
        out["random", method] = draft_heads.write_random_head(tmp_path_factory.mktemp(f"random_{method}"), method,
                                                              target_dir)
        out["accepting", method] = draft_heads.write_accepting_head(tmp_path_factory.mktemp(f"accepting_{method}"),
                                                                    method, target_dir)
    for kind, write in (("random", draft_heads.write_random_head), ("accepting", draft_heads.write_accepting_head)):
        out[kind, "mtp3"] = write(tmp_path_factory.mktemp(f"{kind}_mtp3"), "mtp", target_dir, num_modules=3)
    out["random", "medusa"] = draft_heads.write_medusa_heads(tmp_path_factory.mktemp("random_medusa"), target_dir)
    out["accepting", "medusa"] = draft_heads.write_medusa_heads(tmp_path_factory.mktemp("accepting_medusa"),
                                                                target_dir, accepting=True)
    out["random", "redrafter"] = draft_heads.write_redrafter(tmp_path_factory.mktemp("random_redrafter"), target_dir,
                                                             exit_dim=24)  # with input_proj
    out["accepting", "redrafter"] = draft_heads.write_redrafter(tmp_path_factory.mktemp("accepting_redrafter"),
                                                                target_dir, accepting=True)
    out["random", "mlp_speculator"] = draft_heads.write_mlp_speculator(tmp_path_factory.mktemp("random_mlp"),
                                                                       target_dir, inner_dim=24)
    out["accepting", "mlp_speculator"] = draft_heads.write_mlp_speculator(tmp_path_factory.mktemp("accepting_mlp"),
                                                                          target_dir, accepting=True)
    return out


def engine_kwargs(target_dir: Path, heads, kind: str, method: str, k: int = 3, **kw) -> dict:
    """``LLM`` arguments for ``method``'s ``kind`` head: MTP's layers live in the target's own (copied) folder."""
    method, _, lookup = method.partition("+")  # "eagle3+ngram": combined with a lookup drafter
    tree = method in TREE_METHODS
    shape = {"tree": TREE, "static": {"speculative_token_tree": STATIC}}.get(method.partition("-")[2], {})
    method = method.removesuffix("-tree").removesuffix("-static")
    folder = heads.get((kind, method))
    spec = {"method": method, "num_speculative_tokens": 5 if tree else k, "adaptive": False, **shape,
            **(BEAMS if method == "redrafter" else {})}
    if method == "mtp3":
        method = spec["method"] = "mtp"
        spec["num_nextn_predict_layers"] = 3
    if lookup:
        spec["combine_with"] = lookup
    if method == "mtp":
        model = folder
    else:
        model, spec["model"] = target_dir, str(heads[kind, method])
    return dict(model=str(model), max_model_len=256, speculative_config=spec, **kw)


def make_llm(target_dir, heads, kind, method, **kw) -> LLM:
    kwargs = engine_kwargs(target_dir, heads, kind, method, **kw)
    return LLM(kwargs.pop("model"), **kwargs)


@pytest.fixture(scope="module")
def plain(target_dir):
    return LLM(str(target_dir), max_model_len=256)


@pytest.fixture(scope="module")
def plain_completions(plain):
    return [o.outputs[0] for o in plain.generate(PROMPTS, greedy(), use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_outputs(plain_completions):
    return [c.token_ids for c in plain_completions]


@pytest.fixture(scope="module")
def plain_mixed(plain):
    return plain.generate(PROMPTS, MIXED, use_tqdm=False)


def free_blocks(llm) -> int:
    return llm.engine.scheduler.block_manager.num_free_blocks


# ---- greedy output ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["random", "accepting"])
def test_greedy_batch_of_8_with_mixed_caps_and_max_tokens_equals_plain(target_dir, heads, plain_mixed, kind, method):
    llm = make_llm(target_dir, heads, kind, method)
    llm.engine.executor = rec = Recorder(llm.engine.executor)
    start = free_blocks(llm)
    outs = llm.generate(PROMPTS, MIXED, use_tqdm=False)
    assert token_ids(outs) == token_ids(plain_mixed)
    assert [len(t) for t in token_ids(outs)] == [p.max_tokens for p in MIXED]
    got, want = outs[6].outputs[0], plain_mixed[6].outputs[0]
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert list(a) == list(b) and [v.logprob for v in a.values()] == pytest.approx(
            [v.logprob for v in b.values()], abs=1e-4)
    stats = [o.spec_stats for o in outs]
    assert stats[1].drafts == 0 and stats[2].drafts == 0 and stats[3].drafts == 0  # cap 0, max_tokens 1 and 2
    # max_tokens 3: one draft, once (a tree: siblings at depth 1)
    assert 0 < stats[4].draft_tokens <= TREE_METHODS.get(method, 1)
    assert stats[5].drafts > 0 and stats[5].draft_tokens == stats[5].drafts  # cap 1
    assert llm.spec_stats.drafts > 0
    if kind == "accepting":
        assert llm.spec_stats.accepted_tokens > 0, llm.spec_stats
        assert max(len(kept) for c, kept, _ in rec.chunks() if c.num_draft_tokens) > 2  # two drafts kept at once
    # the worker drafts what the scheduler asked for, and only that; every draft verified is one it made
    made = {}
    for chunk, kept, drafts in rec.chunks():
        verified = chunk.token_ids[chunk.num_tokens - chunk.num_draft_tokens:]
        assert verified == made.pop(chunk.req_id, [])[: len(verified)], chunk
        assert len(drafts) == (chunk.num_next_drafts if kept else 0), chunk
        if drafts:
            made[chunk.req_id] = drafts
    assert free_blocks(llm) == start
    assert not llm.engine.tracked and not llm.engine._worker_drafts


@pytest.mark.parametrize("method", METHODS)
def test_greedy_one_request_at_a_time_equals_plain(target_dir, heads, plain_outputs, method):
    llm = make_llm(target_dir, heads, "accepting", method)
    outs = [o for p in PROMPTS[:3] for o in llm.generate([p], greedy(16), use_tqdm=False)]
    assert token_ids(outs) == [t[:16] for t in plain_outputs[:3]]
    assert llm.spec_stats.accepted_tokens > 0


@pytest.mark.parametrize("method", METHODS)
def test_graph_steps_keep_greedy_output(target_dir, heads, plain_outputs, method):
    """``enforce_eager=False``: the target's decode and verify steps run from graphs (on CPU, their padded static
    inputs, eagerly), the aux layers' residual streams among the graph's outputs; batch 6 padded to 8, block size 4
    (padding past the requests' blocks). Chains and trees are verified through graphs (a tree's positions and
    ancestor masks loaded as the graph's data). The head drafts what it drafts after the eager forward (the same
    drafts, the same acceptance): a graph's residual streams are the rows the head should read, not padding's or a
    stale step's. A head of one module replays its passes too, a tree's levels among them (their nodes padded to
    the graph's rows, the masks and positions its data)."""
    runs, tree_passes = {}, []
    for eager in (True, False):
        llm = make_llm(target_dir, heads, "accepting", method, enforce_eager=eager, block_size=4, max_num_seqs=8)
        head_graphs = getattr(llm.engine.executor.worker.runner.drafter, "graphs", None)
        if head_graphs is not None:  # which of the head's replays were a tree's levels
            run = head_graphs.run
            head_graphs.run = lambda *a, **kw: tree_passes.append(kw.get("ancestors") is not None) or run(*a, **kw)
        outs = llm.generate(PROMPTS[:6], greedy(16), use_tqdm=False)
        assert token_ids(outs) == [t[:16] for t in plain_outputs[:6]]
        stats = llm.spec_stats
        runs[eager] = (stats.drafts, stats.draft_tokens, stats.accepted_tokens)
    assert runs[False] == runs[True] and runs[False][2] > 0, runs
    graphs = llm.engine.executor.worker.runner.graphs
    assert graphs.aux_layers == llm.engine.executor.worker.runner.drafter.aux_layers
    assert graphs.graphs, "no step ran from a graph"
    assert any(q > 1 for _, q, _ in graphs.graphs), list(graphs.graphs)  # verify steps too, trees' among them
    head_graphs = getattr(llm.engine.executor.worker.runner.drafter, "graphs", None)
    if method in CHAIN_METHODS:  # the head's passes too
        assert head_graphs is not None and head_graphs.graphs, "no draft step ran from a graph"
        queries = {q for _, q, _ in head_graphs.graphs}
        assert 1 in queries and max(queries) > 1, list(head_graphs.graphs)  # chain steps, and first passes
        assert not any(tree_passes)
    elif method in ("eagle3-tree", "mtp-tree", "eagle3-static"):  # first passes and a tree's levels
        assert head_graphs is not None and any(tree_passes) and not all(tree_passes), tree_passes
    elif method == "mtp3":  # each distinct module's passes from graphs of its own
        modules = llm.engine.executor.worker.runner.drafter.module_graphs
        assert head_graphs is None and len(modules) == 3 and all(g.graphs for g in modules), modules
    else:  # Medusa's heads, ReDrafter's beam search, the MLP speculator's chain: a graph per padded batch
        assert method in ("medusa", "redrafter", "mlp_speculator") and head_graphs.graphs and not any(tree_passes), (
            head_graphs.graphs)


def test_head_graph_padding_writes_only_scratch_blocks_and_loads_without_a_host_sync(target_dir, heads,
                                                                                     no_host_sync):
    """The head's chain steps from graphs: 3 requests padded to 4, block size 4. Every block a request can own holds
    in the head's cache what the eager engine's holds after the same requests (the padding sequence wrote only the
    head's scratch blocks, past the block manager's); a step's inputs load and the head runs on them with no host
    sync (a capture fails on one)."""
    runs = {}
    for eager in (True, False):
        llm = make_llm(target_dir, heads, "accepting", "eagle3", enforce_eager=eager, block_size=4, num_kv_blocks=64)
        outs = llm.generate(PROMPTS[:3], greedy(12), use_tqdm=False)
        runs[eager] = (llm, token_ids(outs))
    (eager, want), (llm, got) = runs[True], runs[False]
    assert got == want
    drafter = llm.engine.executor.worker.runner.drafter
    from specray.models.step_graphs import GRAPH_QUERY_MAX

    assert drafter.graphs.scratch == list(range(64, 64 + GRAPH_QUERY_MAX // 4)) and drafter.graphs.graphs
    owned = torch.arange(64 * 4)
    for a, b in zip(drafter.kv_cache.snapshot(owned),
                    eager.engine.executor.worker.runner.drafter.kv_cache.snapshot(owned)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert any(q > 1 for _, q, _ in drafter.graphs.graphs)  # first passes from graphs too
    key, graph = next((k, g) for k, g in drafter.graphs.graphs.items() if k[:2] == (4, 1))  # a chain step's
    end = (64 + GRAPH_QUERY_MAX // 4) * 4
    assert all(64 * 4 <= s < end for s in graph.meta.slot_mapping[3:].tolist())  # the padding sequence's slot
    scratch = drafter.graphs.scratch
    padded = build_attention_metadata([1] * 4, [5, 6, 7, 0], [[0, 1] + scratch, [2, 3] + scratch, [4, 5] + scratch,
                                                             scratch], 4, drafter.graphs.device,
                                      min_ctx_blocks=key[2], read_in_place=False)
    ids = torch.tensor([3, 4, 5, 0], device=drafter.graphs.device)  # on the device, as the drafter passes them
    feedback = torch.randn(4, drafter.head.hidden_size, device=drafter.graphs.device)
    with torch.inference_mode(), no_host_sync():
        drafter.graphs._load(graph, padded, ids, (feedback,))
        drafter.head(graph.input_ids, graph.inputs[0], graph.meta)


def test_a_tree_level_from_a_graph_equals_the_eager_pass_without_a_host_sync(target_dir, heads, no_host_sync):
    """One pass of the head over a tree's nodes so far (:meth:`HiddenStateDrafter._over_nodes`: 3 requests padded to
    4, 3 nodes each padded to 4 rows, two at depth 1 and a child of the first) replays a graph with no host sync
    (the node ids scattered and the ancestor masks padded on the device) and gives the eager pass's feedback and
    normed rows."""
    llm = make_llm(target_dir, heads, "accepting", "eagle3-tree", enforce_eager=False, block_size=4,
                   num_kv_blocks=64)
    llm.generate(PROMPTS[:2], greedy(4), use_tqdm=False)
    drafter = llm.engine.executor.worker.runner.drafter
    graphs, device, h = drafter.graphs, drafter.graphs.device, drafter.head.hidden_size
    gen = torch.Generator().manual_seed(0)
    tok = torch.randint(0, drafter.head.draft_vocab_size, (3, 3), generator=gen).to(device)
    features = torch.randn(3, 3, h, generator=gen).to(device)
    ancestors = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(3, 3, 3).to(device)
    args = (tok, features, ancestors, [1, 1, 2], [5, 9, 13], [list(range(5 * i, 5 * i + 5)) for i in range(3)])
    replays = []
    run = graphs.run
    graphs.run = lambda shape, *a, **kw: replays.append(shape) or run(shape, *a, **kw)
    with torch.inference_mode():
        drafter.graphs = None
        want = drafter._over_nodes(*args)
        drafter.graphs = graphs
        drafter._over_nodes(*args)  # captured here unless an earlier step's pass was (a capture syncs)
        with no_host_sync():
            got = drafter._over_nodes(*args)
    assert replays == [(4, 4, 8)] * 2 and (4, 4, 8) in graphs.graphs, replays  # roots + 4 rows: 5 blocks -> 8
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["eagle3", "eagle3-tree"])
def test_disable_by_batch_size_drafts_nothing_while_that_many_run(target_dir, heads, plain_outputs, method):
    """vLLM's ``disable_by_batch_size``: no step verifies drafts while 4 or more requests are in the engine, and the
    worker drafts none for them (not even after a prefill); fewer, the head drafts again; greedy output equals
    plain. Requests of staggered lengths, so that the batch shrinks."""
    kwargs = engine_kwargs(target_dir, heads, "accepting", method)
    kwargs["speculative_config"]["disable_by_batch_size"] = 4
    llm = LLM(kwargs.pop("model"), **kwargs)
    llm.engine.executor = rec = Recorder(llm.engine.executor)
    lengths = [4, 6, 8, 10, 16, 16]
    outs = llm.generate(PROMPTS[:6], [greedy(n) for n in lengths], use_tqdm=False)
    assert token_ids(outs) == [t[:n] for t, n in zip(plain_outputs, lengths)]
    for plan, result in rec.steps:
        decoding = [c for c in plan.chunks if c.sample]
        if len(plan.chunks) >= 4:
            assert not any(c.num_draft_tokens or c.num_next_drafts for c in decoding), plan
    assert llm.spec_stats.accepted_tokens > 0  # drafted once fewer ran


@pytest.mark.parametrize("method", ["eagle3", "mtp3", "eagle3-tree", "medusa"])
def test_async_scheduling_keeps_drafts_and_acceptance(target_dir, heads, plain_outputs, method):
    """``async_scheduling``: the worker's drafts for each next step still come back with each step's result, so
    the same drafts are verified and accepted as without it, and greedy output equals plain."""
    runs = {}
    for on in (False, True):
        llm = make_llm(target_dir, heads, "accepting", method, async_scheduling=on)
        outs = llm.generate(PROMPTS[:6], greedy(16), use_tqdm=False)
        assert token_ids(outs) == [t[:16] for t in plain_outputs[:6]]
        stats = llm.spec_stats
        runs[on] = (stats.drafts, stats.draft_tokens, stats.accepted_tokens)
        assert not llm.engine.tracked and not llm.engine._worker_drafts
    assert runs[False] == runs[True] and runs[True][2] > 0, runs


@pytest.mark.parametrize("method", METHODS)
def test_greedy_with_penalties_equals_plain(target_dir, heads, plain, method):
    """Penalized requests (each verified position penalized by its own prefix, drafts included) beside an
    unpenalized one, under preemption: the heads' drafts know no penalty, the output is plain decoding's."""
    params = [greedy(16, repetition_penalty=1.5), greedy(16, frequency_penalty=0.8, presence_penalty=0.3),
              greedy(16), greedy(16, repetition_penalty=0.8)]
    want = token_ids(plain.generate(PROMPTS[:4], params, use_tqdm=False))
    llm = make_llm(target_dir, heads, "accepting", method, block_size=4, num_kv_blocks=26)
    assert token_ids(llm.generate(PROMPTS[:4], params, use_tqdm=False)) == want
    assert llm.spec_stats.accepted_tokens > 0 and llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kw", [{"block_size": 4, "num_kv_blocks": 40}, {"max_num_batched_tokens": 16}],
                         ids=["preemption", "chunked-prefill"])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_under_preemption_and_chunked_prefill(target_dir, heads, plain_outputs, method, kw):
    llm = make_llm(target_dir, heads, "accepting", method, **kw)
    llm.engine.executor = rec = Recorder(llm.engine.executor)
    start = free_blocks(llm)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert token_ids(outs) == plain_outputs
    assert llm.spec_stats.accepted_tokens > 0
    if "num_kv_blocks" in kw:
        assert llm.engine.scheduler.num_preemptions > 0
        assert start == free_blocks(llm) == 40  # nothing leaked, reserved draft slots included
    else:
        assert any(c.next_token_id is not None for c, _, _ in rec.chunks())  # non-final prefill chunks ran
        assert free_blocks(llm) == start


@pytest.mark.parametrize("method", METHODS)
def test_prefix_caching_keeps_greedy_output(target_dir, heads, plain_outputs, method):
    """Requests that start from cached blocks: the head reads its own K/V there (written by the requests that
    computed them), drafts on from the rows the target computes, and the output stays plain decoding's."""
    llm = make_llm(target_dir, heads, "accepting", method, enable_prefix_caching=True, block_size=4)
    start = free_blocks(llm)
    first = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    accepted = llm.spec_stats.accepted_tokens
    again = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert token_ids(first) == token_ids(again) == plain_outputs
    assert all(o.num_cached_tokens > 0 for o in again if len(o.prompt_token_ids) > 4)
    # the head drafts as well from cached blocks as from its own prefill (equal counts when this was written)
    assert llm.spec_stats.accepted_tokens - accepted >= 0.9 * accepted > 0
    assert free_blocks(llm) == start


STRUCTURED = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs={"regex": r"(ab|cd|the ){2,6}x"}),
              SamplingParams(temperature=0.0, max_tokens=24, structured_outputs={
                  "json": {"type": "object", "properties": {"a": {"enum": ["yes", "no"]}, "b": {"type": "integer"}},
                           "required": ["a", "b"]}, "disable_any_whitespace": True})]


@pytest.mark.parametrize("method", METHODS + ("eagle3+ngram",))
def test_structured_outputs_keep_greedy_output(target_dir, heads, plain, method):
    """The head drafts what the unconstrained target would say: the grammar cuts its chains and trees (a tree's
    nodes as a prefix: the worker keeps state for the nodes it drafted), forced tokens replace them where they
    do not begin with them, and the output is plain decoding's under the same grammar."""
    llm = make_llm(target_dir, heads, "accepting", method)
    start = free_blocks(llm)
    for params in STRUCTURED:
        assert token_ids(llm.generate(PROMPTS, params, use_tqdm=False)) == \
            token_ids(plain.generate(PROMPTS, params, use_tqdm=False))
    assert llm.spec_stats.accepted_tokens > 0
    assert free_blocks(llm) == start and not llm.engine._grammars


def stop_strings(completions, tok) -> list[tuple[int, str]]:
    """(prompt index, stop string) pairs from plain outputs: two characters from the middle of the most varied text,
    and three times the text of a token an output repeats at least 5 times in a row (which the accepting heads
    draft, so the stop string completes inside a step's accepted drafts)."""
    full = max(completions, key=lambda c: len(set(c.text)))
    varied = full.text[len(full.text) // 2: len(full.text) // 2 + 2]
    assert varied.strip(), full.text
    for i, c in enumerate(completions):
        ids = c.token_ids
        for j in range(2, len(ids) - 4):
            text = tok.decode([ids[j]])
            if ids[j: j + 5] == [ids[j]] * 5 and text.strip() and text.isprintable() and "\ufffd" not in text:
                return [(completions.index(full), varied), (i, text * 3)]
    raise AssertionError("no output repeats a printable token 5 times")


@pytest.mark.parametrize("method", METHODS)
def test_stop_string(target_dir, heads, plain, plain_completions, method):
    """Stop strings, one completed inside a run of accepted drafts: each output ends where plain decoding's does
    (the tokens a step kept after it are dropped), with and without the stop string in the output."""
    stops = stop_strings(plain_completions, plain.get_tokenizer())
    prompts = [PROMPTS[i] for i, _ in stops]
    # room left after the run: the scheduler asks for no drafts the request could not use before max_tokens
    params = [greedy(stop=[stops[0][1]]), greedy(40, stop=[stops[1][1]], include_stop_str_in_output=True)]
    want = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = make_llm(target_dir, heads, "accepting", method)
    llm.engine.executor = rec = Recorder(llm.engine.executor)
    start = free_blocks(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [o.outputs[0] for o in outs]
    assert [(g.text, g.token_ids, g.finish_reason) for g in got] == [(w.text, w.token_ids, w.finish_reason)
                                                                    for w in want]
    assert [g.finish_reason for g in got] == ["stop", "stop"] and got[1].text.endswith(stops[1][1])
    kept = sum(len(k) for c, k, _ in rec.chunks() if c.req_id == outs[1].request_id)
    assert kept > len(got[1].token_ids)  # the step that completed it had kept more (accepted drafts)
    assert free_blocks(llm) == start


# ---- the worker's drafts against the head run densely over the committed tokens ---------------------------------

class DenseHead:
    """The target and the head loaded afresh (the public API: load_model, load_draft_head, allocate_kv_cache,
    build_attention_metadata), run from scratch over one sequence: a full prefill of the target for its features,
    then the head's first pass over every committed position and its draft steps."""

    def __init__(self, model: str, method: str, head_path: str):
        self.target = load_model(model)
        self.head = load_draft_head(method, head_path, self.target, load_hf_config(model))
        self.block_size, blocks = 16, 32
        self.table = list(range(blocks))
        allocate_kv_cache(self.target, blocks, self.block_size)
        self.cache = allocate_kv_cache(self.head, blocks, self.block_size)

    def _meta(self, n: int, start: int):
        return build_attention_metadata([n], [start], [self.table], self.block_size)

    @torch.inference_mode()
    def first_pass(self, tokens: list[int], n: int, kv_of: int | None = None):
        """The head over positions 0..n-1 of ``tokens`` (it reads ``tokens[1..n]``): (feedback, normed, K/V of
        the first ``kv_of`` positions, default n)."""
        ids = torch.tensor(tokens[:n])
        out = self.target(ids, self._meta(n, 0), aux_layers=self.head.aux_layers)
        hidden, aux = out if self.head.aux_layers else (out, [])
        features = self.head.target_features(hidden, aux)
        feedback, normed = self.head(torch.tensor(tokens[1: n + 1]), features, self._meta(n, 0))
        kv = self.cache.snapshot(torch.tensor(slots_of(self.table, range(n if kv_of is None else kv_of),
                                                       self.block_size)))
        return feedback, normed, kv

    @torch.inference_mode()
    def check_drafts(self, tokens: list[int], drafts: list[int], scores: list[float] | None = None,
                     params: SamplingParams | None = None, q: torch.Tensor | None = None) -> None:
        """``drafts`` (the worker's, made after ``tokens`` were committed) are the head's argmax at each draft
        step, fed the worker's own previous draft (a near tie, under 1e-4 apart, may go either way); ``scores``,
        where given, their probabilities under the head. For a sampled request (``params``), ``q`` (the worker's,
        kept for verification) is instead the request's warpers over the head's logits at each step, and each
        draft lies in its support."""
        n = len(tokens) - 1  # the last token has no target K/V yet: the head's first pass ends at n - 1
        feedback, normed, _ = self.first_pass(tokens, n)
        feedback, normed = feedback[-1:], normed[-1:]
        for step, token in enumerate(drafts):
            if step:
                feedback, normed = self.head(torch.tensor([drafts[step - 1]]), feedback, self._meta(1, n + step - 1))
            logits = self.head.full_vocab_logits(normed)[0]
            if params is not None:
                want = logits_to_probs(logits[None], SamplingBatch.build([params], [None], "cpu"))[0]
                torch.testing.assert_close(q[step].cpu(), want, atol=1e-5, rtol=1e-4)  # q: on the worker's device
                assert q[step, token] > 0, (step, token)
                continue
            best = int(logits.argmax())
            assert token == best or logits[best] - logits[token] < 1e-4, (step, tokens, drafts, best)
            if scores is not None:
                assert scores[step] == pytest.approx(float(logits.softmax(-1)[token]), abs=1e-5), (step, scores)


    def chain_after(self, tokens: list[int]):
        """After the committed ``tokens``: path (draft tokens) -> the head's logits [V] run densely as a chain
        along it from the root (each step fed the draft before it)."""
        n = len(tokens) - 1
        root = self.first_pass(tokens, n)[:2]

        @torch.inference_mode()
        def after(path: tuple[int, ...]) -> torch.Tensor:
            # the chain from the root again for every path: its K/V at n, n + 1, ... is this path's alone
            feedback, normed = root[0][-1:], root[1][-1:]
            for i, token in enumerate(path):
                feedback, normed = self.head(torch.tensor([token]), feedback, self._meta(1, n + i))
            return self.head.full_vocab_logits(normed)[0]

        return after

    @torch.inference_mode()
    def check_tree(self, tokens: list[int], drafts: list[int], parents: list[int], scores: list[float], top_k: int,
                   depth: int) -> None:
        """``drafts`` / ``parents`` / ``scores`` (the worker's greedy EAGLE-2 tree, made after ``tokens`` were
        committed) are EAGLE-2's tree recomputed densely: a node's distribution is the head run as a chain along its
        path (each step fed the draft before it, as the worker's one pass over the tree does with ancestor masks);
        the root's ``top_k`` best children; then ``depth - 1`` times every frontier node's ``top_k`` best children,
        the ``top_k`` best by path log-probability the next frontier; the best ``len(drafts)`` nodes kept. Compared
        as token paths with their probabilities under their parents (a near tie, under 1e-4 apart, may go either
        way)."""
        after = self.chain_after(tokens)

        def logp_after(path: tuple[int, ...]) -> torch.Tensor:
            return torch.log_softmax(after(path), -1)

        nodes: dict[tuple[int, ...], tuple[float, float]] = {}  # path -> (path log p, p under its parent)
        frontier = [()]
        for level in range(depth):
            candidates = []
            for path in frontier:
                lp = logp_after(path)
                own, ids = lp.topk(top_k)
                base = nodes[path][0] if path else 0.0
                candidates += [(base + float(o), path + (int(i),), float(o.exp())) for o, i in zip(own, ids)]
            candidates.sort(key=lambda c: -c[0])
            chosen = candidates[:top_k]
            nodes.update({path: (cum, p) for cum, path, p in chosen})
            frontier = [path for _, path, _ in chosen]
        best = sorted(nodes, key=lambda path: (-nodes[path][0], len(path)))
        paths = []
        for i, token in enumerate(drafts):
            paths.append((paths[parents[i]] if parents[i] >= 0 else ()) + (token,))
        want = best[: len(drafts)]
        if set(paths) != set(want):  # only a near tie may tell them apart
            cut = nodes[want[-1]][0]
            for path in set(paths) ^ set(want):
                got = nodes[path][0] if path in nodes else float(logp_after(path[:-1])[path[-1]]) + (
                    nodes[path[:-1]][0] if path[:-1] in nodes else 0.0)
                assert abs(got - cut) < 1e-4, (tokens, paths, want)
        for path, score in zip(paths, scores):
            if path in nodes:
                assert score == pytest.approx(nodes[path][1], abs=1e-5), (path, score, nodes[path])


    @torch.inference_mode()
    def check_static_tree(self, tokens: list[int], drafts: list[int], parents: list[int], scores: list[float],
                          shape: list[tuple[int, ...]]) -> None:
        """``drafts`` / ``parents`` / ``scores`` (the worker's greedy static tree, made after ``tokens`` were committed)
        are the first nodes of ``shape`` (paths of ranks, level by level) with node (r1, .., rd) the rd-th best token
        of the head run densely as a chain along its parent's path, scored by its probability there (a near tie,
        under 1e-4 apart, may go either way)."""
        after = self.chain_after(tokens)
        index = {path: i for i, path in enumerate(shape)}
        assert parents == [index[path[:-1]] if len(path) > 1 else -1 for path in shape[: len(drafts)]]
        for i, path in enumerate(shape[: len(drafts)]):
            probs = torch.softmax(after(tuple(drafts[index[path[:d]]] for d in range(1, len(path)))), -1)
            top, ids = probs.topk(path[-1] + 1)
            if drafts[i] != int(ids[-1]):
                assert abs(float(probs[drafts[i]]) - float(top[-1])) < 1e-4, (tokens, i, drafts, ids.tolist())
            assert scores[i] == pytest.approx(float(probs[drafts[i]]), abs=1e-5), (i, scores[i])

class DenseModules(DenseHead):
    """Distinct MTP modules (``num_modules`` of them) run densely from scratch: module k over the committed
    positions 0..n-1 reading the tokens k + 1 further (a path's drafts past the committed ones) and module k - 1's
    outputs (module 0: the target's features); the draft after a path of d tokens is module d's at position n - 1,
    as transformers' MTP chain."""

    def __init__(self, model: str, num_modules: int):
        self.target = load_model(model)
        self.head = load_draft_head("mtp", model, self.target, load_hf_config(model), num_modules=num_modules)
        self.block_size, blocks = 16, 32
        self.table = list(range(blocks))
        allocate_kv_cache(self.target, blocks, self.block_size)
        self.cache = allocate_kv_cache(self.head, blocks, self.block_size)

    def chain_after(self, tokens: list[int]):
        n = len(tokens) - 1
        with torch.inference_mode():
            features = self.head.target_features(self.target(torch.tensor(tokens[:n]), self._meta(n, 0)), [])

        @torch.inference_mode()
        def after(path: tuple[int, ...]) -> torch.Tensor:
            seq, feedback = list(tokens) + list(path), features
            for k in range(len(path) + 1):
                feedback, normed = self.head.module(k, torch.tensor(seq[k + 1: n + k + 1]), feedback,
                                                    self._meta(n, 0))
            return self.head.heads[0].full_vocab_logits(normed[-1:])[0]

        return after


def worker_head_kv(engine, req_id: str, n: int) -> list[torch.Tensor]:
    """The head's cached K/V of the request's first ``n`` positions, read through its block table on the worker."""
    runner = engine.executor.worker.runner
    slots = slots_of(runner.block_tables[req_id], range(n), runner.block_size)
    return [t.cpu() for t in runner.drafter.kv_cache.snapshot(torch.tensor(slots))]  # on the worker's device


@pytest.mark.parametrize("method", CHAIN_METHODS)
def test_worker_drafts_and_head_kv_equal_a_dense_recomputation(target_dir, heads, method):
    """After every step, for every running request: the head's K/V at its committed positions equals the head's
    first pass over them from scratch, and the drafts the worker returned for it equal the head's argmax from
    there (a sampled request's: q, the request's warpers over the head's logits, kept on the worker with its
    chain, which verification then reads). Small blocks, a pool that preempts and a token budget that chunks
    prefills: the checks run after non-final prefill chunks, after preemption and recompute, and after steps that
    accepted drafts."""
    kwargs = engine_kwargs(target_dir, heads, "accepting", method, block_size=4, num_kv_blocks=28,
                           max_num_batched_tokens=16, max_num_seqs=4)
    llm = LLM(kwargs.pop("model"), **kwargs)
    engine = llm.engine
    engine.executor = rec = Recorder(engine.executor)
    model = str(heads["accepting", "mtp"]) if method == "mtp" else str(target_dir)
    dense = DenseHead(model, method, model if method == "mtp" else str(heads["accepting", method]))
    tok = llm.get_tokenizer()
    params = [greedy(20), SamplingParams(temperature=0.8, top_k=5, max_tokens=20, ignore_eos=True, seed=1),
              greedy(20), SamplingParams(temperature=1.3, top_p=0.9, min_p=0.01, max_tokens=20, ignore_eos=True)]
    for prompt, sp in zip(PROMPTS[3:7], params):
        engine.add_request(tok.encode(prompt), sp)
    drafter = engine.executor.worker.runner.drafter
    verified_with_q = []
    verify = drafter.q_of
    drafter.q_of = lambda rid, d: verified_with_q.append(len(d)) or verify(rid, d)
    checked = {"kv": 0, "drafts": 0, "after a chunked prefill": 0, "after preemption": 0, "after acceptance": 0,
               "drawn": 0}
    while engine.has_unfinished_requests():
        engine.step()
        drafts, scores, chunks = rec.last_by_request()
        for req in engine.scheduler.running:
            n = req.num_computed_tokens
            if n == 0 or req.req_id not in drafts:
                continue  # not in this step: its head state was checked when it last ran
            held = engine.executor.worker.runner.drafter.held.get(req.req_id)
            written = n if held is None else held.start  # held positions get their first pass when it drafts
            assert held is None or (not drafts[req.req_id] and held.start + len(held.tokens) == n)
            _, _, want = dense.first_pass(req.all_token_ids, n, written)
            for got, ref in zip(worker_head_kv(engine, req.req_id, written), want):
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
            checked["kv"] += 1
            if drafts[req.req_id]:
                assert n == req.num_tokens - 1
                if req.sampling_params.greedy:
                    assert len(scores[req.req_id]) == len(drafts[req.req_id])  # the head's confidence in each
                    dense.check_drafts(req.all_token_ids, drafts[req.req_id], scores[req.req_id])
                else:  # drawn from q: no scores (the policy must not size the chain by what was drawn)
                    assert not scores[req.req_id]
                    q = verify(req.req_id, drafts[req.req_id])
                    dense.check_drafts(req.all_token_ids, drafts[req.req_id], params=req.sampling_params, q=q)
                    checked["drawn"] += 1
                chunk, kept = chunks[req.req_id]
                checked["drafts"] += 1
                checked["after a chunked prefill"] += chunk.start_pos > 0 and chunk.num_draft_tokens == 0 and \
                    chunk.num_tokens > 1
                checked["after preemption"] += req.num_preemptions > 0
                checked["after acceptance"] += len(kept) > 1
    assert engine.scheduler.num_preemptions > 0
    assert all(checked.values()) and checked["drafts"] >= 10 and checked["kv"] > checked["drafts"], checked
    assert any(verified_with_q), verified_with_q  # some drawn chain was verified against its q
    assert free_blocks(llm) == 28


@pytest.mark.parametrize("method,eager", [("eagle3-tree", True), ("mtp-tree", False), ("eagle3-static", False),
                                          ("mtp-static", True), ("eagle3-tree-wide", False), ("mtp3-tree", False),
                                          ("mtp3-static", True)])
def test_worker_trees_equal_a_dense_eagle2(target_dir, heads, method, eager):
    """After every step, each greedy request's EAGLE-2 tree (an EAGLE-3 head's, an MTP module's: one pass per level
    over every node so far, with ancestor masks) is EAGLE-2 recomputed with the head run densely as a chain along
    each node's path from the request's committed tokens (:meth:`DenseHead.check_tree`); static trees likewise
    (:meth:`DenseHead.check_static_tree`). Small blocks, a pool that preempts and a token budget that chunks
    prefills; each kind of tree once with its levels from graphs (``eager`` False: on CPU, the padded static inputs
    run eagerly), its nodes padded to the graph's rows; "-wide": 4 children a node and 6 levels (20 nodes by the
    last pass, past the eager path's short queries), from graphs of 32 rows, the target's verify steps too."""
    method, wide = method.removesuffix("-wide"), method.endswith("-wide")
    tree = {**TREE, **(WIDE_TREE if wide else {})}
    kwargs = engine_kwargs(target_dir, heads, "accepting", method, block_size=4, num_kv_blocks=36 if wide else 28,
                           max_num_batched_tokens=32 if wide else 16, max_num_seqs=4, enforce_eager=eager)
    kwargs["speculative_config"].update(WIDE_TREE if wide else {})
    llm = LLM(kwargs.pop("model"), **kwargs)
    engine = llm.engine
    runner = engine.executor.worker.runner
    drafter = runner.drafter
    head, _, kind = method.partition("-")
    graphs = drafter.module_graphs if head == "mtp3" else [drafter.graphs] * (drafter.graphs is not None)
    assert len(graphs) == (0 if eager else 3 if head == "mtp3" else 1)  # distinct modules: a graph each
    levels, replayed = [], []  # per pass over a tree's levels; per replay of the head's graphs, whether it was one
    over_nodes = drafter._over_nodes
    drafter._over_nodes = lambda *a, **kw: levels.append(1) or over_nodes(*a, **kw)
    for g in graphs:
        g.run = lambda *a, run=g.run, **kw: replayed.append((kw.get("ancestors") is not None, a[0].query_len)) or \
            run(*a, **kw)
    engine.executor = rec = Recorder(engine.executor)
    if head == "mtp3":  # level k + 1 from module k, densely as transformers' MTP chain
        dense = DenseModules(str(heads["accepting", "mtp3"]), 3)
    else:
        model = str(heads["accepting", "mtp"]) if head == "mtp" else str(target_dir)
        dense = DenseHead(model, head, model if head == "mtp" else str(heads["accepting", head]))
    tok = llm.get_tokenizer()
    for prompt in PROMPTS[3:7]:
        engine.add_request(tok.encode(prompt), greedy(20))
    checked = branched = 0
    while engine.has_unfinished_requests():
        engine.step()
        _, result = rec.steps[-1]
        made = {rid: (d, p, sc) for rid, d, p, sc in zip(result.req_ids, result.draft_token_ids or [],
                                                          result.draft_parents or [], result.draft_scores or [])}
        for req in engine.scheduler.running:
            drafts, parents, scores = made.get(req.req_id, ([], [], []))
            if drafts:
                assert req.num_computed_tokens == req.num_tokens - 1
                if kind == "static":
                    dense.check_static_tree(req.all_token_ids, drafts, parents, scores, parse_token_tree(STATIC))
                else:
                    dense.check_tree(req.all_token_ids, drafts, parents, scores, tree["dynamic_tree_max_topK"],
                                     tree["dynamic_tree_depth"])
                checked += 1
                branched += len(set(parents)) < len(parents)
    assert engine.scheduler.num_preemptions > 0
    assert checked >= 10 and branched > 0, (checked, branched)
    levels_replayed = [q for is_level, q in replayed if is_level]
    assert levels and len(levels_replayed) == (0 if eager else len(levels)), (levels, replayed)  # graphs: every level
    if wide:
        assert max(levels_replayed) == 32 and max(q for _, q, _ in runner.graphs.graphs) == 32
    assert free_blocks(llm) == llm.engine.scheduler.config.num_blocks


def trees_over_dense_hidden(target_dir, heads, kind: str, method: str, num_nodes: int, max_tokens: int,
                            eager: bool = True, options: dict | None = None):
    """Run four prompts (small blocks, so they are preempted) through ``method``'s ``kind`` head drafting up to
    ``num_nodes`` nodes (``eager`` False: the head's passes from graphs; ``options``: more of the method's keys);
    after every step, for every request that drafted: (its tokens, drafts, parents, scores, the target's hidden state
    at its last committed position recomputed densely from scratch, the dense target)."""
    kwargs = engine_kwargs(target_dir, heads, kind, method, block_size=4, num_kv_blocks=40, max_num_seqs=4,
                           enforce_eager=eager)
    kwargs["speculative_config"].update(options or {}, num_speculative_tokens=num_nodes)
    llm = LLM(kwargs.pop("model"), **kwargs)
    engine = llm.engine
    assert (engine.executor.worker.runner.drafter.graphs is None) == eager
    engine.executor = rec = Recorder(engine.executor)
    target = load_model(str(target_dir))
    allocate_kv_cache(target, 64, 16)
    tok = llm.get_tokenizer()
    for prompt in PROMPTS[3:7]:
        engine.add_request(tok.encode(prompt), greedy(max_tokens))
    while engine.has_unfinished_requests():
        engine.step()
        _, result = rec.steps[-1]
        none = [[]] * len(result.req_ids)
        for req_id, drafts, parents, scores in zip(result.req_ids, result.draft_token_ids or none,
                                                   result.draft_parents or none, result.draft_scores or none):
            req = engine.scheduler.requests.get(req_id)
            if not drafts or req is None:
                continue
            n = req.num_computed_tokens  # the last token (just sampled) has no hidden state yet
            with torch.inference_mode():
                hidden = target(torch.tensor(req.all_token_ids[:n]),
                                build_attention_metadata([n], [0], [list(range(64))], 16))
            yield list(req.all_token_ids), drafts, parents, scores, hidden[-1], target


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_medusa_drafts_equal_the_heads_over_a_dense_recomputation(target_dir, heads, eager):
    """After every step, each request's Medusa tree is its heads' top-k over the target's hidden state at the last
    committed position (recomputed densely from scratch), placed as medusa_choices says; greedy output is plain. The
    heads' pass eagerly, and from graphs (on CPU their padded static inputs, eagerly)."""
    from specray.drafters.hidden_state import DEFAULT_MEDUSA_CHOICES
    from specray.models.medusa import load_medusa_heads

    medusa = load_medusa_heads(str(heads["accepting", "medusa"]), load_hf_config(str(target_dir)), torch.float32,
                               "cpu")
    checked = 0
    for tokens, drafts, _, _, hidden, _ in trees_over_dense_hidden(target_dir, heads, "accepting", "medusa",
                                                                   len(DEFAULT_MEDUSA_CHOICES), 20, eager):
        with torch.inference_mode():
            probs = torch.softmax(medusa(hidden[None]), dim=-1)[0]  # [K, V]
        want = [int(probs[len(c) - 1].topk(4).indices[c[-1]]) for c in DEFAULT_MEDUSA_CHOICES[: len(drafts)]]
        assert drafts == want, (tokens, drafts, want)
        checked += 1
    assert checked >= 10


def reference_beams(drafter, embedding: torch.Tensor, context: torch.Tensor, first: int, width: int, length: int
                    ) -> list[tuple[list[int], list[float]]]:
    """ReDrafter's beam search one beam and one candidate at a time: the ``width`` best continuations by path
    log-probability, each (tokens, each token's log q given the ones before)."""
    beams = [([], [], torch.zeros(embedding.shape[1]), 0.0)]  # (tokens, log qs, state, path log q)
    for _ in range(length):
        candidates = []
        for tokens, lps, state, path in beams:
            state = drafter.step(state, embedding[(tokens or [first])[-1]])
            lp = drafter.log_probs(context, state)
            candidates += [(path + float(lp[v]), tokens + [v], lps + [float(lp[v])], state) for v in range(len(lp))]
        candidates.sort(key=lambda c: -c[0])
        beams = [(t, lps, st, path) for path, t, lps, st in candidates[:width]]
    return [(t, lps) for t, lps, _, _ in beams]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_redrafter_trees_equal_a_dense_beam_search(target_dir, heads, eager):
    """After every step, each request's tree is the prefix tree of the drafter's beams from the target's hidden
    state at the last committed position (recomputed densely from scratch) and the token it gave, searched one beam
    at a time: its best nodes by path log-probability, each scored with its q given its parent. The search eagerly,
    and from graphs (its batch padded to a power of two)."""
    from specray.models.redrafter import load_redrafter
    from specray.workers.redrafter_drafter import prefix_tree

    drafter = load_redrafter(str(heads["random", "redrafter"]), load_hf_config(str(target_dir)), torch.float32, "cpu")
    assert drafter.input_proj is not None and drafter.rnn
    checked = 0
    for tokens, drafts, parents, scores, hidden, target in trees_over_dense_hidden(target_dir, heads, "random",
                                                                                   "redrafter", 7, 16, eager):
        with torch.inference_mode():
            beams = reference_beams(drafter, target.embed(torch.arange(target.vocab_size)), hidden, tokens[-1],
                                    width=3, length=3)
        want = prefix_tree([b for b, _ in beams], [lps for _, lps in beams], len(drafts))
        assert (drafts, parents) == (want.token_ids, want.parents), (tokens, drafts, parents, want)
        assert scores == pytest.approx(want.scores, abs=1e-5)
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("method", ["medusa", "redrafter"])
def test_medusa_and_redrafter_passes_from_graphs_sync_nothing(target_dir, heads, no_host_sync, method):
    """Medusa's heads and ReDrafter's beam search from a graph (three rows padded to 4) read no tensor's value on the
    host (a capture fails on one) and give the eager pass's outputs."""
    llm = make_llm(target_dir, heads, "accepting", method, enforce_eager=False)
    graphs = llm.engine.executor.worker.runner.drafter.graphs
    size = json.loads((target_dir / "config.json").read_text())["hidden_size"]
    rows = torch.randn(3, size, generator=torch.Generator().manual_seed(0)).to(graphs.device)
    inputs = (rows, torch.tensor([5, 6, 7], device=graphs.device)) if method == "redrafter" else (rows,)
    with torch.inference_mode():
        want = graphs.fn(*inputs)
        graphs.run(*inputs)  # captured here
        with no_host_sync():
            got = graphs.run(*inputs)
    assert list(graphs.graphs) == [4]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_redrafter_prefix_tree_merges_shared_prefixes():
    """Beams that share a prefix share its nodes; nodes go best first by path log-probability, parents first."""
    from specray.workers.redrafter_drafter import prefix_tree

    beams = [[5, 6, 7], [5, 6, 8], [9, 1, 1]]
    lps = [[-0.1, -0.2, -0.3], [-0.1, -0.2, -0.5], [-1.0, -0.1, -0.1]]
    tree = prefix_tree(beams, lps, 10)
    assert tree.token_ids == [5, 6, 7, 8, 9, 1, 1] and tree.parents == [-1, 0, 1, 1, -1, 4, 5]
    assert tree.scores == pytest.approx([math.exp(x) for x in (-0.1, -0.2, -0.3, -0.5, -1.0, -0.1, -0.1)])
    assert prefix_tree(beams, lps, 3).token_ids == [5, 6, 7]


def test_redrafter_sampled_beams_are_drawn_from_q_one_beam_at_a_time(target_dir, heads):
    """A sampled request's tree: ``beams`` chains under the root, level by level, without scores; the first level
    distinct draws; each row's q (for verification) the request's warpers over the drafter's log q given that row's
    beam, recomputed one beam at a time (the last level's zero), every token with mass under its parent row's q;
    seeded, it repeats; over seeds it is not the beam search's tree every time. Beside it, a greedy request keeps
    the beam search's prefix tree."""
    from specray.contract import ScheduledChunk, StepPlan
    from specray.models.redrafter import load_redrafter
    from specray.workers.redrafter_drafter import ReDrafterDrafter, prefix_tree

    target = load_model(str(target_dir))
    head = load_redrafter(str(heads["random", "redrafter"]), load_hf_config(str(target_dir)), torch.float32, "cpu",
                          target=target)
    width, length, first = BEAMS["redrafter_num_beams"], BEAMS["redrafter_draft_len_per_beam"], 7
    hidden = torch.randn(2, head.hidden_size, generator=torch.Generator().manual_seed(0))
    plan = StepPlan(0, chunks=[ScheduledChunk(r, [5], start_pos=3, num_next_drafts=width * length) for r in "gs"])
    with torch.inference_mode():
        embedding = target.embed(torch.arange(target.vocab_size))
        beams = reference_beams(head, embedding, hidden[0], first, width, length)
        searched = prefix_tree([b for b, _ in beams], [lps for _, lps in beams], width * length)
        parents = [-1] * width + list(range(width * (length - 1)))
        differ = 0
        for seed in range(10):
            sp = SamplingParams(temperature=1.0, seed=seed)
            runs = [ReDrafterDrafter(head, width, length) for _ in range(2)]
            made = [d.draft(plan, {}, hidden, [], {0: [first], 1: [first]}, {}, {"g": greedy(), "s": sp})
                    for d in runs]
            assert (made[0][0].token_ids, made[0][0].parents) == (searched.token_ids, searched.parents)
            tree = made[0][1]
            assert tree.parents == parents and tree.scores is None and made[1][1].token_ids == tree.token_ids
            assert len(set(tree.token_ids[:width])) == width
            q = runs[0].q_of("s", tree.token_ids, tree.parents)
            batch = SamplingBatch.build([sp], [None], "cpu")
            start = head.step(torch.zeros(head.hidden_size), embedding[first])
            torch.testing.assert_close(q[0], logits_to_probs(head.log_probs(hidden[1], start)[None], batch)[0])
            for b in range(width):
                state, row = start, q[0]
                for level in range(length):
                    node = level * width + b
                    assert row[tree.token_ids[node]] > 0, (node, tree.token_ids)
                    state = head.step(state, embedding[tree.token_ids[node]])
                    row = q[node + 1]
                    want = (logits_to_probs(head.log_probs(hidden[1], state)[None], batch)[0]
                            if level < length - 1 else torch.zeros_like(row))
                    torch.testing.assert_close(row, want, atol=1e-5, rtol=1e-4)
            differ += tree.token_ids != searched.token_ids
    assert differ > 0


def raw_mlp_speculator(folder: Path):
    """IBM's MLP speculator written out from its checkpoint's raw tensors (Wertheimer et al.'s formula, apart from
    specray.models.mlp_speculator): (start(context) -> s_0, stage(k, s_k, token) -> (s_{k+1}, stage k's q))."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    raw = {name.removeprefix("speculator."): t.float()
           for name, t in load_file(str(folder / "model.safetensors")).items()}
    n, inner = config["n_predict"], config["inner_dim"] or config["emb_dim"]

    def weight(kind: str, k: int, part: str = "weight") -> torch.Tensor:  # a tied stage's: the first written
        for j in ([k] if not config["tie_weights"] else [k, 0] if kind != "proj" or k == 0 else [k, 1]):
            if f"{kind}.{j}.{part}" in raw:
                return raw[f"{kind}.{j}.{part}"]
        raise KeyError(kind, k)

    ws = 0.5 ** (0.5 / n)
    we = math.sqrt((1 - ws ** 2) * inner / 2)

    def start(context: torch.Tensor) -> torch.Tensor:
        state = context.float()
        return state / torch.sqrt(state.pow(2).mean() + 1e-6) / math.sqrt(2) if config["scale_input"] else state

    def stage(k: int, state: torch.Tensor, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = weight("proj", k) @ state + (we / ws) * weight("emb", k)[token]
        x = x / torch.sqrt(x.pow(2).mean() + 1e-6) * weight("ln", k) + weight("ln", k, "bias")
        state = torch.nn.functional.gelu(x)
        return state, torch.softmax(weight("head", k) @ state, dim=-1)

    return start, stage


def reference_mlp_stages(folder: Path, context: torch.Tensor, first: int, drawn: list[int] | None = None
                         ) -> tuple[list[int], list[float], list[torch.Tensor]]:
    """The speculator's stages one after another (:func:`raw_mlp_speculator`): each stage's argmax, its probability
    and the stage's distribution, each stage reading the token before (``drawn``: those tokens instead of the
    argmax)."""
    start, stage = raw_mlp_speculator(folder)
    state, token, tokens, probs, dists = start(context), first, [], [], []
    for k in range(json.loads((folder / "config.json").read_text())["n_predict"]):
        state, p = stage(k, state, token)
        token = int(p.argmax()) if drawn is None else drawn[k]
        tokens.append(int(p.argmax()))
        probs.append(float(p.max()))
        dists.append(p)
    return tokens, probs, dists


def reference_mlp_candidates(folder: Path, context: torch.Tensor, first: int, top: list[int], n: int, nodes: int):
    """IBM's candidate tree one path at a time: every path taking each stage's ``top[k]`` best tokens after it, the
    ``n`` best by path log q merged into a prefix tree (its first ``nodes`` nodes)."""
    from specray.workers.head_drafter import prefix_tree

    start, stage = raw_mlp_speculator(folder)
    paths = [((), (), start(context), first, 0.0)]  # (tokens, each one's log q, state, last token, path log q)
    for k, width in enumerate(top):
        grown = []
        for tokens, lps, state, token, total in paths:
            state, q = stage(k, state, token)
            values, ids = q.log().topk(width)
            grown += [(tokens + (int(t),), lps + (float(v),), state, int(t), total + float(v))
                      for v, t in zip(values, ids)]
        paths = grown
    best = sorted(paths, key=lambda path: -path[4])[:n]
    return prefix_tree([list(p[0]) for p in best], [list(p[1]) for p in best], nodes)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_mlp_speculator_candidate_trees_equal_a_dense_search(target_dir, heads, eager):
    """``candidate_tree``: after every step, each greedy request's tree is IBM's candidates searched one path at a time
    from the target's hidden state at the last committed position (recomputed densely from scratch): every path
    taking each stage's top 2 tokens, the 3 best by path log q merged into a prefix tree, best first, each node
    scored with its q given its parent; greedy output is plain. Eagerly, and from graphs."""
    options = {"candidate_tree": True, "top_k_tokens_per_head": [2, 2, 2], "n_candidates": 3}
    folder = heads["accepting", "mlp_speculator"]
    checked = branched = 0
    for tokens, drafts, parents, scores, hidden, _ in trees_over_dense_hidden(target_dir, heads, "accepting",
                                                                              "mlp_speculator", 8, 20, eager, options):
        want = reference_mlp_candidates(folder, hidden, tokens[-1], [2, 2, 2], 3, len(drafts))
        assert (drafts, parents) == (want.token_ids, want.parents), (tokens, drafts, parents, want)
        assert scores == pytest.approx(want.scores, rel=1e-4)
        checked += 1
        branched += len(set(parents)) < len(parents)
    assert checked >= 10 and branched > 0, (checked, branched)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_mlp_speculator_chains_equal_its_stages_over_a_dense_recomputation(target_dir, heads, eager):
    """After every step, each request's chain is the speculator's stages run one after another from the target's
    hidden state at the last committed position (recomputed densely from scratch) and the token it gave, each draft
    scored with its probability under its stage; greedy output is plain. The chain eagerly, and from graphs (on CPU
    their padded static inputs, eagerly)."""
    folder = heads["accepting", "mlp_speculator"]
    checked = 0
    for tokens, drafts, parents, scores, hidden, _ in trees_over_dense_hidden(target_dir, heads, "accepting",
                                                                              "mlp_speculator", 3, 20, eager):
        want, probs, _ = reference_mlp_stages(folder, hidden, tokens[-1])
        assert drafts == want[: len(drafts)] and not parents, (tokens, drafts, parents, want)  # a chain
        assert scores == pytest.approx(probs[: len(drafts)], rel=1e-4), (scores, probs)
        checked += 1
    assert checked >= 10


LAYOUTS = {"untied": {}, "tied": {"tie_weights": True}, "scaled-narrow": {"scale_input": True, "inner_dim": 24},
           "tied-every-stage-prefixed": {"tie_weights": True}}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mlp_speculator_checkpoint_layouts_load_as_written(target_dir, tmp_path, layout):
    """IBM's layouts (separate stages; tied weights: one embedding, norm and head, a projection after the first;
    scale_input's weightless norm of the target's state; an inner width of its own; a tied checkpoint that writes
    the shared tensors under every stage's index, names prefixed ``speculator.``) load to the stages the raw tensors
    give (:func:`reference_mlp_stages`), greedy and drawn alike: a sampled request's chain is drawn stage by stage
    from q, each draft's q the request's warpers over its stage's logits given the drawn tokens before it."""
    from safetensors.torch import load_file, save_file

    from specray.contract import ScheduledChunk, StepPlan
    from specray.models.mlp_speculator import load_mlp_speculator
    from specray.workers.mlp_speculator_drafter import MLPSpeculatorDrafter

    folder = draft_heads.write_mlp_speculator(tmp_path / layout, target_dir, n_predict=4, seed=3, std=0.5,
                                              **LAYOUTS[layout])
    if layout == "tied-every-stage-prefixed":
        raw = load_file(str(folder / "model.safetensors"))
        every = {f"speculator.{kind}.{k}.{part}": t.clone() for name, t in raw.items()
                 for kind, index, part in [name.split(".")] for k in range(4)
                 if kind != "proj" or (k == 0) == (index == "0")}
        save_file(every, str(folder / "model.safetensors"))
    head = load_mlp_speculator(str(folder), load_hf_config(str(target_dir)), torch.float32, "cpu")
    assert len(head.emb) == (1 if layout.startswith("tied") else 4)
    drafter = MLPSpeculatorDrafter(head)
    hidden = torch.randn(2, head.emb_dim, generator=torch.Generator().manual_seed(1))
    plan = StepPlan(0, chunks=[ScheduledChunk(r, [5], start_pos=3, num_next_drafts=4) for r in "gs"])
    sp = SamplingParams(temperature=0.9, top_k=20, seed=4)
    with torch.inference_mode():
        greedy_chain, sampled_chain = drafter.draft(plan, {}, hidden, [], {0: [7], 1: [7]}, {},
                                                    {"g": greedy(), "s": sp})
        want, probs, _ = reference_mlp_stages(folder, hidden[0], 7)
        assert greedy_chain.token_ids == want and greedy_chain.scores == pytest.approx(probs, rel=1e-4)
        assert sampled_chain.scores is None and 0 < len(sampled_chain.token_ids) <= 4
        q = drafter.q_of("s", sampled_chain.token_ids)
        _, _, dists = reference_mlp_stages(folder, hidden[1], 7, drawn=sampled_chain.token_ids + [0] * 4)
        batch = SamplingBatch.build([sp], [None], "cpu")
        for k, token in enumerate(sampled_chain.token_ids):
            row = logits_to_probs(dists[k].log()[None], batch)[0]
            torch.testing.assert_close(q[k], row, atol=1e-5, rtol=1e-4)
            assert row[token] > 0


def test_mlp_speculator_settings_are_checked(target_dir, heads, tmp_path):
    """A draft count past the stages, a checkpoint of another model or type, and no checkpoint: each a ValueError
    naming the fix, before any worker starts."""
    folder = heads["random", "mlp_speculator"]
    with pytest.raises(ValueError, match=r"num_speculative_tokens=4: the MLP speculator .* has 3 stages \(n_predict\)"):
        LLM(str(target_dir), speculative_config={"method": "mlp_speculator", "model": str(folder),
                                                 "num_speculative_tokens": 4})
    with pytest.raises(ValueError, match=r"method='mlp_speculator' needs the speculator's checkpoint"):
        LLM(str(target_dir), speculative_config={"method": "mlp_speculator"})
    other = Path(shutil.copytree(folder, tmp_path / "other"))
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "emb_dim": config["emb_dim"] + 8}))
    with pytest.raises(ValueError, match=r"emb_dim=\d+, vocab_size=\d+ but the target has hidden_size="):
        LLM(str(target_dir), speculative_config={"method": "mlp_speculator", "model": str(other)})
    (other / "config.json").write_text(json.dumps({**config, "model_type": "medusa"}))
    with pytest.raises(ValueError, match=r"model_type='medusa'; an MLP speculator checkpoint .* has 'mlp_speculator'"):
        LLM(str(target_dir), speculative_config={"method": "mlp_speculator", "model": str(other)})
    spec = {"method": "mlp_speculator", "model": str(folder)}
    with pytest.raises(ValueError, match=r"top_k_tokens_per_head shapes the candidate tree: give candidate_tree=True"):
        LLM(str(target_dir), speculative_config={**spec, "top_k_tokens_per_head": [2, 2, 2]})
    with pytest.raises(ValueError, match=r"top_k_tokens_per_head=\[2, 2\]: the candidate tree takes one int >= 1 per "
                                         r"stage .* \(3, n_predict\)"):
        LLM(str(target_dir), speculative_config={**spec, "candidate_tree": True, "top_k_tokens_per_head": [2, 2]})
    with pytest.raises(ValueError, match=r"n_candidates=9: the candidate tree keeps between 1 and 8 candidates"):
        LLM(str(target_dir), speculative_config={**spec, "candidate_tree": True, "top_k_tokens_per_head": [2, 2, 2],
                                                 "n_candidates": 9})


def test_mlp_speculator_candidate_trees_beside_drawn_chains(target_dir, heads, plain):
    """``candidate_tree`` with the checkpoint's own shape (written with one candidate a stage: a chain-shaped tree)
    and a given one: greedy requests verify candidate trees (the whole tree by default: its most nodes), sampled
    ones beside them chains drawn from q; greedy output is plain, a seed repeats."""
    folder = str(heads["accepting", "mlp_speculator"])
    for shape in ({}, {"top_k_tokens_per_head": [3, 2, 1], "n_candidates": 4}):
        llm = LLM(str(target_dir), max_model_len=256, speculative_config={
            "method": "mlp_speculator", "model": folder, "candidate_tree": True, "adaptive": False, **shape})
        assert llm.engine.policy.num_speculative_tokens == (3 if not shape else 3 + 4 + 4)
        params = [greedy(16), SamplingParams(seed=5, **{**SAMPLED, "max_tokens": 16})] * 2
        first = token_ids(llm.generate(PROMPTS[:4], params, use_tqdm=False))
        assert [first[0], first[2]] == token_ids(plain.generate([PROMPTS[0], PROMPTS[2]], greedy(16),
                                                                use_tqdm=False))
        assert token_ids(llm.generate(PROMPTS[:4], params, use_tqdm=False)) == first
        assert llm.spec_stats.accepted_tokens > 0


def on_off_policy(engine, pattern: str):
    """The engine's policy made to draft by ``pattern`` (one letter per step and request: "1" drafts the most,
    "0" nothing), cycling, so the head is switched off and on again and again."""
    policy, calls = engine.policy, {}

    def turn(req) -> bool:
        i = calls[req.req_id] = calls.get(req.req_id, -1) + 1
        return pattern[i % len(pattern)] == "1"

    policy.choose = lambda req, *a, **kw: policy.num_speculative_tokens_for(req) if turn(req) else 0
    policy.choose_tree = lambda req, batch, tree, *a, **kw: len(tree) if turn(req) else 0
    # a head that scores its chains: each is cut by price() and settle(), and with none in hand wait_or_probe()
    policy.settle = lambda req, n, limit: limit if turn(req) else 0
    policy.wait_or_probe = lambda req, *a, **kw: policy.num_speculative_tokens_for(req) if turn(req) else 0


@pytest.mark.parametrize("method", CHAIN_METHODS)
def test_head_switched_off_catches_up_when_it_drafts_again(target_dir, heads, plain_outputs, method):
    """Steps after which a request drafts nothing put its first pass off (its positions wait on the worker); when
    it drafts again the head's K/V over every committed position and its drafts equal the dense recomputation.
    Greedy output stays the plain output."""
    kwargs = engine_kwargs(target_dir, heads, "accepting", method, block_size=4, num_kv_blocks=64, max_num_seqs=4)
    llm = LLM(kwargs.pop("model"), **kwargs)
    engine = llm.engine
    engine.executor = rec = Recorder(engine.executor)
    on_off_policy(engine, "0010001")
    drafter = engine.executor.worker.runner.drafter
    model = str(heads["accepting", "mtp"]) if method == "mtp" else str(target_dir)
    dense = DenseHead(model, method, model if method == "mtp" else str(heads["accepting", method]))
    tok = llm.get_tokenizer()
    ids = {engine.add_request(tok.encode(p), greedy(24)): i for i, p in enumerate(PROMPTS[:4])}
    outputs, caught_up, most_held = {}, 0, 0
    while engine.has_unfinished_requests():
        was_held = {rid: len(h.tokens) for rid, h in drafter.held.items()}
        finished = set()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
                finished.add(out.request_id)
        # the worker drops a finished request's held positions with the next plan (which names it finished)
        assert set(drafter.held) <= {r.req_id for r in engine.scheduler.running} | finished
        plan, result = rec.steps[-1]
        most_held = max([most_held] + [len(h.tokens) for h in drafter.held.values()])
        for req_id, drafts in zip(result.req_ids, result.draft_token_ids or []):
            req = engine.scheduler.requests.get(req_id)
            if not drafts or req is None:
                continue
            n = req.num_computed_tokens
            assert req_id not in drafter.held
            _, _, want = dense.first_pass(req.all_token_ids, n)
            for got, ref in zip(worker_head_kv(engine, req_id, n), want):
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
            dense.check_drafts(req.all_token_ids, drafts)
            caught_up += was_held.get(req_id, 0) >= 2
    assert caught_up >= 4 and most_held >= 3, (caught_up, most_held)
    assert [outputs[rid] for rid in sorted(ids, key=ids.get)] == plain_outputs[:4]
    assert free_blocks(llm) == 64


@pytest.mark.parametrize("pattern", ["0011", "011"])  # a tree drafted on "1" is verified on the next "1"
def test_tree_head_switched_off_and_on_keeps_greedy_output(target_dir, heads, plain_outputs, pattern):
    llm = make_llm(target_dir, heads, "accepting", "eagle3-tree")
    start = free_blocks(llm)
    on_off_policy(llm.engine, pattern)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert token_ids(outs) == plain_outputs
    assert llm.engine.spec_stats.accepted_tokens > 0
    assert free_blocks(llm) == start


class FailingDraft:
    """Makes the worker's drafter raise on its ``at``-th drafting (after a step verified), noting that step's
    requests."""

    def __init__(self, drafter, at: int):
        self.inner, self.at, self.calls, self.failed_on = drafter.draft, at, 0, []
        drafter.draft = self

    def __call__(self, plan, *args):
        self.calls += 1
        if self.calls == self.at:
            self.failed_on = [c.req_id for c in plan.chunks]
            raise RuntimeError("injected head fault")
        return self.inner(plan, *args)


def run_to_end(engine, after_fault=None, fault=None) -> dict:
    """Every request's output by id; ``after_fault()`` once, right after the step the drafter failed in."""
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if after_fault is not None and fault.calls >= fault.at:
            after_fault()
            after_fault = None
    return done


@pytest.mark.parametrize("method, async_scheduling", [("eagle3", False), ("mtp3", False), ("eagle3-tree", False),
                                                       ("medusa", False), ("eagle3", True)])
def test_a_head_failing_after_a_step_costs_its_requests_their_drafts_not_their_tokens(target_dir, heads,
                                                                                      plain_outputs, method,
                                                                                      async_scheduling, caplog):
    """The worker's drafter raising after a step used to fail the step, and so (run again alone, failing again)
    every request in it. Now the step's verified tokens stand, its requests decode on without drafts (none asked
    of the head again), a request admitted later drafts as before, every output is plain decoding's and no block
    leaks; with ``async_scheduling`` too (the next step planned while this one runs: its requests are counted
    once)."""
    llm = make_llm(target_dir, heads, "accepting", method, async_scheduling=async_scheduling)
    engine, tok = llm.engine, llm.get_tokenizer()
    start = free_blocks(llm)
    fault = FailingDraft(engine.executor.worker.runner.drafter, at=3)
    engine.executor = rec = Recorder(engine.executor)
    ids = [engine.add_request(tok.encode(p), greedy(16)) for p in PROMPTS[:3]]
    late = []
    done = run_to_end(engine, lambda: late.append(engine.add_request(tok.encode(PROMPTS[3]), greedy(16))), fault)
    assert [done[rid].outputs[0].token_ids for rid in ids + late] == [t[:16] for t in plain_outputs[:4]]
    assert all(done[rid].error is None for rid in ids + late)
    assert sorted(fault.failed_on) == sorted(ids) and engine.drafting_failures == 3
    assert "injected head fault" in caplog.text
    if not async_scheduling:  # (its steps go by execute_async, which the recorder does not see)
        at = next(i for i, (_, result) in enumerate(rec.steps) if result.drafting_failed)
        after = [c for plan, _ in rec.steps[at + 1:] for c in plan.chunks]
        assert after and not any(c.num_draft_tokens or c.num_next_drafts for c in after if c.req_id in ids)
        assert any(c.num_draft_tokens for c in after if c.req_id in late)  # the head drafts for the late one
    assert free_blocks(llm) == start and not engine._head_failed


def test_a_failed_head_leaves_the_lookup_beside_it_drafting(target_dir, heads, plain_outputs):
    """With a lookup drafter beside the head (``combine_with``), the requests the head failed on still verify the
    lookup's drafts (and ask the head for none); output stays plain decoding's."""
    llm = make_llm(target_dir, heads, "accepting", "eagle3+ngram")
    engine, tok = llm.engine, llm.get_tokenizer()
    fault = FailingDraft(engine.executor.worker.runner.drafter, at=2)
    engine.executor = rec = Recorder(engine.executor)
    ids = [engine.add_request(tok.encode(p), greedy(24)) for p in PROMPTS[:3]]
    done = run_to_end(engine)
    assert [done[rid].outputs[0].token_ids for rid in ids] == plain_outputs[:3]
    assert sorted(fault.failed_on) == sorted(ids) and engine.drafting_failures == 3
    at = next(i for i, (_, result) in enumerate(rec.steps) if result.drafting_failed)
    after = [c for plan, _ in rec.steps[at + 1:] for c in plan.chunks]
    assert not any(c.num_next_drafts or c.worker_drafts for c in after)
    assert any(c.num_draft_tokens for c in after)  # the lookup's


def test_a_head_failing_in_a_step_run_again_without_a_failed_request(target_dir, heads, plain_outputs):
    """A step that raised for one request is run again without it; the head failing in that run costs the others
    their drafts alone (the run's result carries the failure to the engine)."""
    from specray.errors import RequestError

    llm = make_llm(target_dir, heads, "accepting", "eagle3")
    engine, tok = llm.engine, llm.get_tokenizer()
    fault = FailingDraft(engine.executor.worker.runner.drafter, at=3)
    ids = [engine.add_request(tok.encode(p), greedy(16)) for p in PROMPTS[:3]]
    inner, calls = engine.executor.execute, []

    def poisoned(plan, draft_probs=None):
        calls.append(len(plan.chunks))
        if len(calls) == 3:
            raise RequestError([ids[0]], "injected fault")
        return inner(plan, draft_probs)

    engine.executor.execute = poisoned
    done = run_to_end(engine)
    assert "injected fault" in done[ids[0]].error
    assert [done[rid].outputs[0].token_ids for rid in ids[1:]] == [t[:16] for t in plain_outputs[1:3]]
    assert calls[2:4] == [3, 2] and sorted(fault.failed_on) == sorted(ids[1:]) and engine.drafting_failures == 2


def test_adaptive_policy_probes_a_head_it_switched_off(target_dir, heads, plain_outputs):
    """A random head is soon switched off by the adaptive policy; after ``probe_after`` steps the policy probes it
    again, waiting longer after each probe that finds nothing, and the probe's drafts are verified (the policy
    learns only from verified drafts)."""
    kwargs = engine_kwargs(target_dir, heads, "random", "eagle3")
    kwargs["speculative_config"]["adaptive"] = True
    llm = LLM(kwargs.pop("model"), **kwargs)
    engine = llm.engine
    engine.executor = rec = Recorder(engine.executor)
    outs = llm.generate(PROMPTS[:1], greedy(80), use_tqdm=False)
    assert token_ids(outs)[0][:24] == plain_outputs[0]  # greedy(80) goes on where greedy() stopped at 24
    verified = [c.num_draft_tokens for c, _, _ in rec.chunks() if c.sample]
    gaps, run = [], 0
    for k in verified:
        if k:
            gaps.append((run, k))
            run = 0
        else:
            run += 1
    probes = [(gap, k) for gap, k in gaps if gap >= engine.policy.probe_after]
    assert len(probes) >= 3, gaps
    # probe_k drafts each (the last may be cut by the request's end), each wait at least as long as the one before
    assert {k for _, k in probes[:-1]} == {engine.policy.probe_k}, gaps
    assert [g for g, _ in probes[:3]] == sorted(g for g, _ in probes[:3]) and probes[2][0] > probes[0][0], gaps


@pytest.mark.parametrize("method", CHAIN_METHODS)
def test_adaptive_policy_cuts_a_head_chain_by_its_confidence(target_dir, heads, plain_outputs, method):
    """With the adaptive policy, each chain the head made is verified up to where the policy, reading each draft's
    confidence bin, prices it best (so some chains are verified short of their end), every bin the verified drafts
    reached gains evidence, and greedy output stays the plain output."""
    from specray.scheduler.draft_policy import Confidence

    kwargs = engine_kwargs(target_dir, heads, "accepting", method, k=5)
    kwargs["speculative_config"]["adaptive"] = True
    llm = LLM(kwargs.pop("model"), **kwargs)
    engine, policy = llm.engine, llm.engine.policy
    engine.executor = rec = Recorder(engine.executor)
    for n in (1, 2, 4, 8):  # a cost model where drafts are cheap against a step: price decides, not the step cost
        policy.observe_step(n, 8, 0.05 + 0.001 * n)
    policy.observe_step = lambda *args: None
    priced, price = [], policy.price

    def recorded(req, batch, drafts, key=None, scores=None):
        out = price(req, batch, drafts, key, scores)
        priced.append((list(drafts), scores, out[0]))
        return out

    policy.price = recorded
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert token_ids(outs) == plain_outputs
    made, cut, verified = {}, 0, 0
    for chunk, _, drafts in rec.chunks():
        n = chunk.num_draft_tokens
        if n:
            verified += 1
            cut += n < len(made[chunk.req_id])
        made.pop(chunk.req_id, None)
        if drafts:
            made[chunk.req_id] = drafts
    assert verified >= 10 and cut >= 1, (verified, cut)
    assert any(scores is not None and n < len(d) for d, scores, n in priced)  # a chain priced short of its end
    bins = {k.bin for k in policy._key_evidence if isinstance(k, Confidence) and k.source == engine.worker_method}
    assert len(bins) >= 2, bins
    assert llm.spec_stats.accepted_tokens > 0


@pytest.mark.parametrize("method", ["eagle3+ngram", "mtp+suffix", "eagle3-tree+suffix"])
def test_combined_with_a_lookup_keeps_greedy_output_and_drafts_with_both(target_dir, heads, plain_mixed, method):
    """``combine_with``: each step each request verifies the head's drafts or the lookup drafter's, whichever the
    policy prices higher (adaptive); greedy output is the plain output, both kinds of draft are verified and
    kept, and the lookup drafter is told only of its own drafts' verifications."""
    kwargs = engine_kwargs(target_dir, heads, "accepting", method)
    kwargs["speculative_config"]["adaptive"] = True
    llm = LLM(kwargs.pop("model"), **kwargs)
    engine, start = llm.engine, free_blocks(llm)
    head = method.split("+")[0].removesuffix("-tree")
    policy = engine.policy
    for n in range(1, 41):  # a step's fixed cost dominates, as for real models (a tiny one's has none)
        policy.observe_step(n, 8, 0.05 + 0.001 * n)
    policy.observe_step = lambda *args: None
    kept_by, observe = {}, policy.observe  # every verification's evidence (observe_tree's too) goes through it
    policy.observe = lambda req, n, acc, key=None, scores=None: (
        kept_by.setdefault("head" if key == head else "lookup", []).append(acc), observe(req, n, acc, key, scores))
    told, own = [], getattr(engine.drafter, "observe_verification", lambda *args: None)
    engine.drafter.observe_verification = lambda rid, n, acc: (told.append(n), own(rid, n, acc))
    outs = llm.generate(PROMPTS, MIXED, use_tqdm=False)
    assert token_ids(outs) == token_ids(plain_mixed)
    assert kept_by.get("head") and kept_by.get("lookup") and llm.spec_stats.accepted_tokens > 0, kept_by
    assert len(told) == len(kept_by["lookup"])
    assert free_blocks(llm) == start and not engine.tracked


def test_combined_mode_verifies_drawn_chains_against_their_q_beside_lookup_trees(target_dir, heads, plain_mixed):
    """Sampled requests beside greedy ones, the head combined with suffix decoding (whose drafts are trees): a
    sampled request's chain drawn from q is verified against that q (read from the drafter only for chunks marked
    ``worker_drafts``), a lookup's drafts never are, steps that mix such chains with trees verify both groups,
    and the greedy requests' output stays the plain output."""
    from specray.workers.head_drafter import HiddenStateDrafter

    kwargs = engine_kwargs(target_dir, heads, "accepting", "eagle3+suffix", k=6)  # fixed K: the lookup wins ties
    kwargs["speculative_config"]["combine_with"] = {"method": "suffix", "min_token_prob": 0.01,  # wide trees
                                                  "max_spec_factor": 4.0}
    llm = LLM(kwargs.pop("model"), **kwargs)
    engine, start = llm.engine, free_blocks(llm)
    price = engine.policy.price

    def half_on_the_head(req, batch, drafts, key=None, scores=None):  # sampled requests with an even seed take
        n, rate = price(req, batch, drafts, key, scores)          # the head's chains, the others the lookup's
        if not req.sampling_params.greedy:
            return (len(drafts), 1e9) if (key == engine.worker_method) == (req.sampling_params.seed % 2 == 0) \
                else (0, -1.0)
        return n, rate

    engine.policy.price = half_on_the_head
    varied = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=100 + i) for i in range(32)]
    llm.generate(PROMPTS * 4, varied, use_tqdm=False)  # the suffix trie learns branching continuations
    engine.executor = rec = Recorder(engine.executor)
    drafter = engine.executor.worker.runner.drafter
    read = []
    q_of = drafter.q_of

    def spy(rid, drafts):
        q = q_of(rid, drafts)
        if q is not None:
            read.append((len(rec.steps), rid))
        return q

    drafter.q_of = spy
    sampled = [SamplingParams(temperature=0.8, top_k=4, max_tokens=24, ignore_eos=True, seed=i) for i in range(8)]
    outs = llm.generate(PROMPTS * 2, MIXED + sampled, use_tqdm=False)
    assert token_ids(outs[:8]) == token_ids(plain_mixed)
    greedy_ids = {o.request_id for o in outs[:8]}
    counts = {"chain with q": 0, "lookup drafts of a sampled request": 0, "mixed step": 0, "trees": 0}
    for step, (plan, _) in enumerate(rec.steps):
        with_q = {rid for s, rid in read if s == step}
        marked = {c.req_id for c in plan.chunks if c.worker_drafts}
        assert with_q <= marked and not with_q & greedy_ids, (with_q, marked)
        counts["chain with q"] += len(with_q)
        counts["lookup drafts of a sampled request"] += sum(
            c.num_draft_tokens > 0 and not c.worker_drafts and c.req_id not in greedy_ids for c in plan.chunks)
        counts["mixed step"] += bool(with_q) and any(c.draft_parents is not None for c in plan.chunks)
        counts["trees"] += sum(c.draft_parents is not None for c in plan.chunks)
    assert all(counts.values()), counts
    runner = engine.executor.worker.runner  # the worker forgets a request with the plan after it finished
    assert isinstance(drafter, HiddenStateDrafter) and set(drafter.generators) <= set(runner.params)
    assert free_blocks(llm) == start and not engine.tracked


def test_combine_with_names_a_lookup_drafter(target_dir, heads):
    for bad, why in [("draft_model", "lookup drafter only"), (5, "must be a method name"),
                     ({"num_speculative_tokens": 3}, "must be a method name"),
                     ({"method": "ngram", "prompt_lookup_minn": 1},
                      r"combine_with=\{'method': 'ngram', .*unknown keys"),
                     # the lookup's draft count, not the head's (which is 3)
                     ({"method": "suffix", "num_speculative_tokens": 0},
                      r"combine_with=\{'method': 'suffix', 'num_speculative_tokens': 0\}: .*=0 must be an int >= 1")]:
        kwargs = engine_kwargs(target_dir, heads, "accepting", "eagle3")
        kwargs["speculative_config"]["combine_with"] = bad
        with pytest.raises(ValueError, match=why):
            LLM(kwargs.pop("model"), **kwargs)


def test_typical_acceptance_is_opt_in_lossy_and_leaves_greedy_output_exact(target_dir, heads, plain_outputs):
    """``acceptance="typical"``: greedy requests keep the plain output; with no bar (posterior_threshold 0) every
    draft the target gives any probability is kept, where rejection sampling keeps fewer of the same heads'
    drafts: the mode is lossy by design, which is why it is opt-in."""
    def engine(**spec):
        kwargs = engine_kwargs(target_dir, heads, "random", "medusa")
        kwargs["speculative_config"].update(spec)
        return LLM(kwargs.pop("model"), **kwargs)

    typical = engine(acceptance="typical", posterior_threshold=0.0)
    assert token_ids(typical.generate(PROMPTS, greedy(), use_tqdm=False)) == plain_outputs
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=24) for i in range(len(PROMPTS))]
    stats = {}
    for name, llm in (("typical", engine(acceptance="typical", posterior_threshold=0.0)), ("rejection", engine())):
        llm.generate(PROMPTS, sampled, use_tqdm=False)
        stats[name] = llm.spec_stats
    assert stats["typical"].draft_tokens > 0
    typical_rate = stats["typical"].accepted_tokens / stats["typical"].draft_tokens
    rejection_rate = stats["rejection"].accepted_tokens / stats["rejection"].draft_tokens
    assert typical_rate > rejection_rate, stats
    for bad, why in [({"acceptance": "lenient"}, "must be one of"), ({"posterior_threshold": 1.5}, r"\[0, 1.0\)"),
                     ({"posterior_alpha": -1}, "posterior_alpha")]:
        with pytest.raises(ValueError, match=why):
            engine(**bad)


@pytest.mark.parametrize("method", ["mtp", "eagle3-tree"])
def test_relaxed_acceptance_with_a_head_keeps_candidates_in_the_thinking_phase(target_dir, heads, plain_outputs,
                                                                               method):
    """``acceptance="relaxed"`` (TensorRT-LLM's, paired there with MTP) with a phase that begins at the first
    prompt token and never ends: every kept token is among the target's top 4 within 2.0 of its best logit (some
    not the best: the relaxation ran, so output differs from plain); with top-1 the output is plain."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()

    def engine(**spec):
        kwargs = engine_kwargs(target_dir, heads, "accepting", method)
        kwargs["speculative_config"].update(acceptance="relaxed", end_thinking_phase_token=0, **spec)
        return LLM(kwargs.pop("model"), **kwargs)

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    prompts = [tok.encode(p) for p in PROMPTS]
    off, outs = 0, []
    for prompt, ids in zip(PROMPTS, prompts):  # the phase begins at each prompt's first token
        llm = engine(relaxed_topk=4, relaxed_delta=2.0, begin_thinking_phase_token=ids[0])
        out = llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0].token_ids
        off += check_candidates(hf, ids, out, ids[0], 0, 4, 2.0)
        outs.append(out)
    assert off > 0 and outs != plain_outputs
    strict = engine(relaxed_topk=1, relaxed_delta=2.0, begin_thinking_phase_token=prompts[0][0])
    assert token_ids(strict.generate(PROMPTS, greedy(), use_tqdm=False)) == plain_outputs


@pytest.mark.parametrize("spec, match", [
    ({"num_speculative_tokens": 4}, r"num_speculative_tokens=4 with num_nextn_predict_layers=3.*<= 3"),
    ({"num_nextn_predict_layers": 0}, "num_nextn_predict_layers=0 must be an int >= 1"),
    ({"num_nextn_predict_layers": 4, "num_speculative_tokens": 2}, r"num_nextn_predict_layers=4 but the checkpoint "
                                                                   r".* has 3 MTP module"),
    ({**TREE, "dynamic_tree_depth": 4}, r"dynamic_tree_depth is 4 with num_nextn_predict_layers=3: .* at most 3 "
                                        r"levels, or num_nextn_predict_layers=1"),
    ({"speculative_token_tree": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 1]]},
     r"the speculative_token_tree's deepest path is 4 with num_nextn_predict_layers=3"),
    ({**TREE, "speculative_token_tree": [[0]], "num_nextn_predict_layers": 1}, "both use_dynamic_tree=True and a "
                                                                               "speculative_token_tree"),
    ({"speculative_token_tree": "[(0,), (x,)]", "num_nextn_predict_layers": 1}, "neither JSON .* nor a Python literal"),
])
def test_distinct_mtp_modules_settings_are_checked(target_dir, heads, spec, match):
    kwargs = engine_kwargs(target_dir, heads, "accepting", "mtp3")
    kwargs["speculative_config"].update(spec)
    with pytest.raises(ValueError, match=match):
        LLM(kwargs.pop("model"), **kwargs)



def test_static_tree_options_read_vllm_and_tensorrt_llm_forms():
    """vLLM's speculative_token_tree (its Python-literal string) and TensorRT-LLM's eagle_choices (paths only, their
    prefixes implied) name the same static tree; the draft count defaults to its nodes, and the slots the scheduler
    reserves past the root are its nodes above the deepest level (what the last level's pass reads). Medusa's and
    DFlash's trees take the string forms too."""
    from specray.config import SpeculativeConfig
    from specray.drafters import registry

    specs = [SpeculativeConfig.from_any({"method": "eagle3", "speculative_token_tree": STATIC}),
             SpeculativeConfig.from_any({"method": "eagle3", "eagle_choices": [[0, 0, 0], [0, 2], [1]]})]
    for spec in specs:
        registry.check(spec)
    assert [registry.options_of(spec).speculative_token_tree for spec in specs] == [
        [[0], [1], [0, 0], [0, 2], [0, 0, 0]]] * 2
    assert [spec.num_speculative_tokens for spec in specs] == [5, 5]
    assert registry.worker_drafts_trees(specs[0]) and registry.worker_lookahead_slots(specs[0]) == 4
    assert registry.worker_tree_shape(specs[0]) is None  # a drawn static tree is priced as it is, as Medusa's
    # Medusa's and DFlash's trees read the same string forms (their paths kept in the order given)
    from specray.drafters.hidden_state import DFlashOptions, MedusaOptions

    assert MedusaOptions(model="m", medusa_choices="[(0,), (0, 0), (1,)]").tree() == [[0], [0, 0], [1]]
    assert DFlashOptions(model="d", speculative_token_tree="[[0], [1], [0, 0]]").speculative_token_tree == [
        [0], [1], [0, 0]]
    with pytest.raises(ValueError, match=r"medusa_choices='\[\(0,' is neither JSON .* nor a Python literal"):
        MedusaOptions(model="m", medusa_choices="[(0,")
    # their draft count left unset is the tree's nodes too (it was 5: a larger tree cut to its first 5 nodes)
    six = "[(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0)]"
    for given in ({"method": "medusa", "model": "m", "medusa_choices": six},
                  {"method": "dflash", "model": "d", "speculative_token_tree": six},
                  {"method": "medusa", "model": "m", "medusa_choices": six, "num_speculative_tokens": 4}):
        spec = SpeculativeConfig.from_any(given)
        registry.check(spec)
        assert spec.num_speculative_tokens == given.get("num_speculative_tokens", 6)

def test_distinct_mtp_modules_write_no_kv_past_the_committed_tokens(target_dir, heads):
    """Module k drafts at the last committed position (it reads the draft before it as its token), so no slots
    are reserved past the verified drafts, unlike one module drafting K positions ahead. Their trees' level k + 1
    places the nodes of depths 1..k from k positions before the root's: past it only where they outnumber k."""
    from specray.config import SpeculativeConfig
    from specray.drafters import registry

    engines = {m: make_llm(target_dir, heads, "accepting", m).engine for m in ("mtp", "mtp3")}
    assert engines["mtp"].scheduler.config.worker_writes_kv and not engines["mtp3"].scheduler.config.worker_writes_kv
    for tree, slots in ((TREE, 2), ({**TREE, "dynamic_tree_max_topK": 1}, 0), ({"speculative_token_tree": STATIC}, 2),
                        ({"speculative_token_tree": [[0], [0, 0], [0, 0, 0]]}, 0)):
        spec = SpeculativeConfig.from_any({"method": "mtp", "num_nextn_predict_layers": 3, **tree})
        registry.check(spec)
        assert registry.worker_lookahead_slots(spec) == slots and registry.worker_writes_kv(spec) == (slots > 0)
        one = SpeculativeConfig.from_any({"method": "mtp", **tree})
        registry.check(one)
        assert registry.worker_lookahead_slots(one) > slots and registry.worker_writes_kv(one)  # one module's


# ---- sampling ----------------------------------------------------------------------------------------------------

def chi2_pvalue(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Goodness of fit, the cells expected to hold fewer than 5 pooled into one; a cell with probability 0 must be
    empty (else p = 0)."""
    if observed[expected_probs == 0].sum() > 0:
        return 0.0
    expected = expected_probs / expected_probs.sum() * observed.sum()
    small, big = (expected > 0) & (expected < 5), expected >= 5
    if small.any():
        return chisquare(np.append(observed[big], observed[small].sum()),
                         np.append(expected[big], expected[small].sum())).pvalue
    return chisquare(observed[big], expected[big]).pvalue


SAMPLED = dict(temperature=0.7, top_k=3, max_tokens=4, ignore_eos=True)


def looping_prompt_of(plain) -> list[int]:
    """A prompt that ends in a run of the token the target then repeats (which the accepting heads draft)."""
    prompt = plain.get_tokenizer().encode(PROMPTS[4])
    return prompt + plain.generate({"prompt_token_ids": prompt}, greedy(3), use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def looping_prompt(plain) -> list[int]:
    return looping_prompt_of(plain)


@pytest.fixture(scope="module")
def target_triples(target_dir, looping_prompt):
    return triples_of(target_dir, looping_prompt)


def triples_of(target_dir, looping_prompt, temperatures=(SAMPLED["temperature"], 1.0), last_logits=None):
    """temperature -> {(x0, x1, x2): p(x0) p(x1 | x0) p(x2 | x0 x1)} of the target's warped distributions (SAMPLED's
    top-k at that temperature) after ``looping_prompt``, from a fresh model (or from ``last_logits(tokens)`` [1, V],
    for a target this paged helper cannot run: a hybrid one's recurrent state)."""
    if last_logits is None:
        target = load_model(str(target_dir))
        allocate_kv_cache(target, 8, 16)

        def last_logits(tokens: list[int]) -> torch.Tensor:
            return target.compute_logits(target(torch.tensor(tokens), build_attention_metadata(
                [len(tokens)], [0], [list(range(8))], 16))[-1:])

    @torch.inference_mode()
    def probs(tokens: list[int], temperature: float) -> np.ndarray:
        logits = last_logits(tokens)
        batch = SamplingBatch.build([SamplingParams(**{**SAMPLED, "temperature": temperature})], [None], "cpu")
        return logits_to_probs(logits, batch)[0].double().numpy()

    def triples(temperature: float) -> dict[tuple[int, int, int], float]:
        out, prompt = {}, looping_prompt
        p0 = probs(prompt, temperature)
        for a in np.flatnonzero(p0):
            p1 = probs(prompt + [int(a)], temperature)
            for b in np.flatnonzero(p1):
                p2 = probs(prompt + [int(a), int(b)], temperature)
                out.update({(int(a), int(b), int(c)): p0[a] * p1[b] * p2[c] for c in np.flatnonzero(p2)})
        return out

    return {t: triples(t) for t in temperatures}


def sampled_pvalue(target_dir, heads, method, prompt, expected: dict, n: int = 800, depth: int = 3,
                   prepare=None, first_seed: int = 0, engine=None) -> float:
    """``n`` seeded requests for ``prompt`` sampled with SAMPLED through an engine with ``method``'s accepting head:
    the worker drafts two tokens after the first (a chain drawn from the head's q, which verification keeps with
    probability min(1, p/q) or replaces from the residual; a tree's nodes are the head's best, a one-hot q). The
    chi-square p-value of their first three tokens against ``expected`` (of the first ``depth``: its marginals).
    ``prepare(llm)`` adjusts the engine first; ``engine()``, when given, builds it (another target's)."""
    llm = make_llm(target_dir, heads, "accepting", method, max_num_seqs=64) if engine is None else engine()
    if prepare is not None:
        prepare(llm)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                        [SamplingParams(seed=first_seed + i, **SAMPLED) for i in range(n)], use_tqdm=False)
    stats = llm.spec_stats
    assert stats.drafts >= n and stats.draft_tokens > stats.accepted_tokens > 0, stats  # kept and rejected
    triples = [tuple(o.outputs[0].token_ids[:depth]) for o in outs]
    if depth < 3:
        marginals: dict[tuple, float] = {}
        for key, p in expected.items():
            marginals[key[:depth]] = marginals.get(key[:depth], 0.0) + p
        expected = marginals
    keys = sorted(set(expected) | set(triples))
    observed = np.array([triples.count(key) for key in keys], dtype=float)
    return chi2_pvalue(observed, np.array([expected.get(key, 0.0) for key in keys]))


@pytest.mark.parametrize("method", METHODS + ("eagle3+suffix", "mtp3-tree", "mtp3-static"))
def test_sampled_output_keeps_the_target_distribution(target_dir, heads, looping_prompt, target_triples, method):
    """The first three sampled tokens' joint frequencies fit p(x0) p(x1 | x0) p(x2 | x0 x1) of the target. Eight
    methods at a 1e-3 threshold fail somewhere by chance about once in 125 runs, and a device draws other streams
    from the same seeds (on CUDA, MTP's fell in the tail at 1.7e-4 and passed at 0.44-0.92 on 3,000 other seeds):
    a p-value under the threshold is decided by a second test on three times as many fresh seeds (a bias fails
    both; chance, about once in a million)."""
    expected = target_triples[SAMPLED["temperature"]]
    pvalue = sampled_pvalue(target_dir, heads, method, looping_prompt, expected)
    if pvalue <= 1e-3:
        pvalue = sampled_pvalue(target_dir, heads, method, looping_prompt, expected, n=2400, first_seed=800)
    assert pvalue > 1e-3


def test_sampled_output_keeps_the_target_distribution_with_glm4_moe_mtp(tiny_glm4_moe_dir, tmp_path):
    """GLM-4.5's own MTP layer (written to accept often) drafting for sampled requests: the first three sampled
    tokens' joint frequencies fit the GLM target's, as for the heads above (a p-value under the threshold decided by
    a second test on fresh seeds); and the same test fails against the target's distribution at temperature 1."""
    folder = draft_heads.write_deepseek_mtp(tmp_path / "mtp", tiny_glm4_moe_dir, bias_std=0.1)
    prompt = looping_prompt_of(LLM(str(tiny_glm4_moe_dir), max_model_len=256))
    triples = triples_of(tiny_glm4_moe_dir, prompt)
    expected = triples[SAMPLED["temperature"]]

    def engine() -> LLM:
        return LLM(str(folder), max_model_len=256, max_num_seqs=64,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 3, "adaptive": False})

    pvalue = sampled_pvalue(None, None, "mtp", prompt, expected, engine=engine)
    if pvalue <= 1e-3:
        pvalue = sampled_pvalue(None, None, "mtp", prompt, expected, n=2400, first_seed=800, engine=engine)
    assert pvalue > 1e-3
    assert sampled_pvalue(None, None, "mtp", prompt, triples[1.0], engine=engine) < 1e-3


def test_sampled_output_keeps_the_target_distribution_when_drawn_chains_and_trees_share_steps(
        target_dir, heads, looping_prompt, target_triples):
    """The head combined with suffix decoding, the choice forced so that even-seeded requests verify the head's
    drawn chains (against their q) and odd-seeded ones the lookup's proposals, trees among them: steps mix the two,
    each group verified apart, and the first three tokens still fit the target's distribution."""
    mixed = []

    def prepare(llm):
        engine = llm.engine
        price = engine.policy.price

        def half_on_the_head(req, batch, drafts, key=None, scores=None):
            n, rate = price(req, batch, drafts, key, scores)
            if (key == engine.worker_method) == (req.sampling_params.seed % 2 == 0):
                return len(drafts), 1e9
            return 0, -1.0

        engine.policy.price = half_on_the_head
        execute = engine.executor.execute

        def watch(plan, draft_probs=None):
            mixed.append(any(c.worker_drafts for c in plan.chunks)
                         and any(c.draft_parents is not None for c in plan.chunks))
            return execute(plan, draft_probs)

        engine.executor.execute = watch

    pvalue = sampled_pvalue(target_dir, heads, "eagle3+suffix", looping_prompt, target_triples[SAMPLED["temperature"]],
                            prepare=prepare)
    assert sum(mixed) >= 5, sum(mixed)
    assert pvalue > 1e-3


@pytest.mark.parametrize("method", ["eagle3-tree", "mtp-tree", "eagle3-static", "medusa", "redrafter", "mtp3-tree"])
def test_sampled_requests_trees_are_drawn_from_q_and_verified_against_it(target_dir, heads, looping_prompt,
                                                                         monkeypatch, method):
    """EAGLE-2's (an EAGLE-3 head's, an MTP module's), a static tree's, Medusa's and ReDrafter's trees for sampled
    requests beside greedy ones: the sampled ones' rows carry the q their children were drawn from (each a distribution,
    and every child's token has mass under its row's q), the greedy ones' none; greedy output stays plain output."""
    from specray.workers import model_runner

    seen = []
    verify = model_runner.verify_tree

    def spy(padded, batch, *args):
        if padded.draft_probs is not None:
            seen.append((padded, batch.greedy.clone()))
        return verify(padded, batch, *args)

    monkeypatch.setattr(model_runner, "verify_tree", spy)
    llm = make_llm(target_dir, heads, "accepting", method, max_num_seqs=16)
    sampled = [SamplingParams(seed=i, **{**SAMPLED, "max_tokens": 12}) for i in range(6)]
    outs = llm.generate([{"prompt_token_ids": looping_prompt}] * 6 + PROMPTS[:2], sampled + [greedy(12)] * 2,
                        use_tqdm=False)
    plain = LLM(str(target_dir), max_model_len=256).generate(PROMPTS[:2], greedy(12), use_tqdm=False)
    assert token_ids(outs[6:]) == token_ids(plain)
    assert seen, "no tree was verified against a drafter's q"
    branched = 0
    for padded, greedy_rows in seen:
        # q for the sampled requests' trees only (compared on the host: the worker's tensors may be on a GPU)
        drafted = torch.tensor(padded.draft_counts) > 0
        assert bool((padded.has_q.cpu() == (~greedy_rows.cpu() & drafted)).all())
        for b in padded.has_q.nonzero().flatten().tolist():
            k = padded.draft_counts[b]
            kids = padded.children[b]
            for row in range(k + 1):
                children = [c for c in kids[row].tolist() if c >= 0]
                if not children:
                    continue
                q = padded.draft_probs[b, row]
                assert abs(q.sum().item() - 1.0) < 1e-4
                tokens = [padded.draft_token_ids[b, c - 1].item() for c in children]
                assert len(set(tokens)) == len(tokens) and all(q[t] > 0 for t in tokens)
                branched += len(children) > 1
    assert branched > 0


def test_a_drawn_tree_is_priced_by_its_shape_not_by_what_was_drawn(target_dir, heads, looping_prompt):
    """The policy sizes a sampled request's drawn tree (no scores) from the worker's level-by-level shape: the same
    tree, however its levels came out, gets the same count; a greedy request's scored tree is priced as it is."""
    from specray.tree import DraftTree, level_tree

    llm = make_llm(target_dir, heads, "accepting", "eagle3-tree")
    engine = llm.engine
    assert engine.worker_tree_shape == (TREE["dynamic_tree_max_topK"], TREE["dynamic_tree_depth"])
    priced = []
    choose = engine.policy.choose_tree

    def spy(req, batch, tree, *args):
        priced.append((req.sampling_params.greedy, tree))
        return choose(req, batch, tree, *args)

    engine.policy.choose_tree = spy
    llm.generate([{"prompt_token_ids": looping_prompt}] * 3 + PROMPTS[:1],
                 [SamplingParams(seed=i, **{**SAMPLED, "max_tokens": 10}) for i in range(3)] + [greedy(10)],
                 use_tqdm=False)
    shape = level_tree(TREE["dynamic_tree_max_topK"], TREE["dynamic_tree_depth"])
    assert any(g for g, _ in priced) and any(not g for g, _ in priced)
    for was_greedy, tree in priced:
        assert (tree.scores is not None and tree != shape) if was_greedy else tree == shape
    assert level_tree(2, 3) == DraftTree([0] * 6, [-1, -1, 0, 0, 2, 2], [0.5, 0.5, 1.0, 1.0, 1.0, 1.0])
    assert isinstance(shape, DraftTree)


def test_a_drawn_trees_level_goes_to_the_best_promises_as_prefixes_of_each_parents_draws():
    """_slots: child (f, j) promises cum(f) + log(q_f's j-th largest); the k best win, listed parent by parent, each
    parent's first c_f draws; an empty parent and q's empty tail fill nothing."""
    from specray.workers.head_drafter import _slots

    cum = torch.tensor([[0.0, -0.7, float("-inf")]])
    q = torch.tensor([[[0.5, 0.3, 0.2, 0.0], [0.9, 0.1, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    pairs, filled = _slots(cum, q)
    # promises: f0: log .5, log .3, log .2; f1: -.7 + log .9 = -.805, -.7 + log .1; f2: -inf
    # best three: f0 j0 (-.69), f1 j0 (-.81), f0 j1 (-1.20) -> f0 gets 2, f1 gets 1, listed (0,0) (0,1) (1,0)
    assert pairs.tolist() == [[0, 1, 3]] and filled.tolist() == [[True, True, True]]
    sparse = torch.tensor([[[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]])
    pairs, filled = _slots(torch.tensor([[0.0, float("-inf"), float("-inf")]]), sparse)
    assert pairs[0, 0].item() == 0 and filled.tolist() == [[True, False, False]]  # one child: q's support


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampled_output_repeats_with_a_fixed_draft_count(target_dir, heads, looping_prompt, method):
    """With adaptive=False nothing the engine learns changes how many drafts a step verifies (a tree head's first
    tree was cut to a probe's size until the engine had verified one), so a seed gives the same output every time,
    the first request on a fresh engine included."""
    llm = make_llm(target_dir, heads, "accepting", method)
    params = [SamplingParams(seed=3 + i, **{**SAMPLED, "max_tokens": 16}) for i in range(3)]
    prompts = [{"prompt_token_ids": looping_prompt}] * 3
    first = token_ids(llm.generate(prompts, params, use_tqdm=False))
    assert llm.spec_stats.drafts > 0
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == first


def test_the_distribution_test_can_fail(target_dir, heads, looping_prompt, target_triples, monkeypatch):
    """Negative controls: the same samples do not fit the target at T=1, and a verifier with the classic bug (after
    a rejection, resample from p instead of the residual norm(max(0, p - q))) fails the test on the first drafted
    token (the second sampled: the first is the target's alone), with more samples to see it (drafts drawn from q
    lie close to p, so the bug shifts little)."""
    from specray import verification

    expected = target_triples[SAMPLED["temperature"]]
    assert sampled_pvalue(target_dir, heads, "eagle3", looping_prompt, target_triples[1.0]) < 1e-3
    monkeypatch.setattr(verification, "_residual", lambda p, q: p)
    assert sampled_pvalue(target_dir, heads, "eagle3", looping_prompt, expected, n=1600, depth=2) < 1e-3


@pytest.mark.parametrize("method", ["medusa", "redrafter"])
def test_the_distribution_test_can_fail_for_drawn_medusa_and_redrafter_trees(target_dir, heads, looping_prompt,
                                                                             target_triples, monkeypatch, method):
    """Negative control of test_sampled_output_keeps_the_target_distribution[medusa/redrafter]: their drawn trees
    verified against the wrong q (uniform over each row's support instead of the q the children were drawn from) no
    longer fit the target. (The accepting Medusa heads are all alike, so another head's q would be the same q.)"""
    from specray.workers.head_drafter import DrawsFromQ

    q_of = DrawsFromQ.q_of

    def uniform(self, req_id, drafts, *parents):
        q = q_of(self, req_id, drafts, *parents)
        return None if q is None else (q > 0).float() / (q > 0).sum(-1, keepdim=True).clamp_min(1)

    monkeypatch.setattr(DrawsFromQ, "q_of", uniform)
    assert sampled_pvalue(target_dir, heads, method, looping_prompt, target_triples[SAMPLED["temperature"]]) < 1e-3


# ---- a tensor-parallel target's embedding and LM head, whole on the driver rank ----------------------------------

def test_whole_target_reads_what_the_target_reads(target_dir):
    """What a head reads of a tensor-parallel target (:func:`whole_target`; tests/test_cluster.py runs it over two
    ranks) equals the target's own embedding (exactly) and logits (here over one rank, where both exist)."""
    from specray.workers.head_drafter import whole_target

    target = load_model(str(target_dir))
    assert whole_target(target, keep=False, chunk=20) is None
    whole = whole_target(target, keep=True, chunk=20)  # several chunks of ids, and of unit vectors
    ids = torch.arange(target.vocab_size)
    hidden = torch.randn(5, whole.embedding.shape[1])
    with torch.inference_mode():
        assert torch.equal(whole.embed(ids), target.embed(ids))
        torch.testing.assert_close(whole.compute_logits(hidden), target.compute_logits(hidden), atol=1e-5, rtol=1e-5)
    assert (whole.vocab_size, whole.dtype, whole.device) == (target.vocab_size, target.dtype, target.device)


# ---- a request's own method -----------------------------------------------------------------------------------

def test_request_cannot_pick_another_method_on_a_worker_drafting_engine(target_dir, heads, plain_outputs):
    """On an EAGLE-3 engine a request's ``speculative_method`` other than "eagle3" is a ValueError that leaves
    nothing queued (not even the good requests of its batch); "eagle3" itself is fine."""
    llm = make_llm(target_dir, heads, "accepting", "eagle3")
    for other in ("ngram", "eagle", "mtp", "suffix"):
        with pytest.raises(ValueError, match="inside the target's worker"):
            llm.generate(PROMPTS[0], greedy(speculative_method=other), use_tqdm=False)
        assert not llm.engine.has_unfinished_requests() and not llm.engine.tracked
    with pytest.raises(ValueError, match="inside the target's worker"):  # a bad one among good ones: none run
        llm.generate(PROMPTS[:3], [greedy(), greedy(speculative_method="ngram"), greedy()], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.tracked
    outs = llm.generate(PROMPTS[:2], greedy(speculative_method="eagle3"), use_tqdm=False)
    assert token_ids(outs) == plain_outputs[:2]
    assert llm.spec_stats.drafts > 0


def test_eagle3_on_llama4_keeps_greedy_output(tiny_llama4_dir, tmp_path):
    """An EAGLE-3 head over a Llama-4 target (its residual stream read at layers 2, 3 and 3, across chunked RoPE
    layers, a NoPE layer and experts): greedy output equals plain decoding at batch 8, drafts accepted."""
    head = draft_heads.write_accepting_head(tmp_path / "eagle3", "eagle3", tiny_llama4_dir)
    plain = LLM(str(tiny_llama4_dir), max_model_len=256).generate(PROMPTS, MIXED, use_tqdm=False)
    llm = LLM(str(tiny_llama4_dir), max_model_len=256, speculative_config={
        "method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "adaptive": False})
    start = free_blocks(llm)
    assert token_ids(llm.generate(PROMPTS, MIXED, use_tqdm=False)) == token_ids(plain)
    assert llm.spec_stats.accepted_tokens > 0 and free_blocks(llm) == start


# ---- a family's own MTP module (DeepSeek-V3's block: latent attention and experts; GLM-4.5's: its attention) ----

def assert_first_drafts_are_mtp_models(llm, outs, rec, hf, mtp, num_checked: int = 12) -> None:
    """Every first draft of the first ``num_checked`` steps that drafted (``rec``: a Recorder of the run that gave
    ``outs`` for PROMPTS) equals transformers' ``mtp`` (an ``MtpModel`` over the target ``hf``) run over the
    request's committed sequence from scratch."""
    tok = llm.get_tokenizer()
    committed = {o.request_id: tok.encode(prompt) for o, prompt in zip(outs, PROMPTS)}  # the prompt, then kept
    checked = 0
    for plan, result in rec.steps:
        for chunk, kept, drafts in zip(plan.chunks, result.sampled_token_ids, result.draft_token_ids or []):
            if not kept or chunk.req_id not in committed:
                continue
            seq = committed[chunk.req_id] = committed[chunk.req_id][: chunk.start_pos + chunk.num_tokens
                                                                   - chunk.num_draft_tokens] + list(kept)
            if not drafts or checked >= num_checked:
                continue
            n = len(seq) - 1
            with torch.no_grad():
                hidden = hf.model(torch.tensor([seq[:n]])).last_hidden_state
                draft, _, _ = mtp(input_ids=torch.tensor([seq[1:]]), last_hidden_states=hidden,
                                  attention_mask=None, position_ids=torch.arange(1, n + 1)[None], mtp_cache=None)
            assert drafts[0] == int(draft[0, 0]), (chunk.req_id, drafts, draft)
            checked += 1
    assert checked >= num_checked



@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "deepseek_v32", "glm_moe_dsa", "hy_v3",
                                    "glm4_moe_lite", "minimax_m2"])
def test_family_mtp_module_drafts_with_its_own_block(request, tmp_path, family):
    """``method="mtp"`` on a DeepSeek-V3 or GLM-4.5 checkpoint reads its MTP module at ``model.layers.{L}``, whose block
    is the family's (DeepSeek: latent attention over its own latent cache; GLM: grouped-query attention with q/k norms
    and half of each head rotated; both with experts and a shared one): greedy output equals plain decoding (batch of
    8, mixed caps and max_tokens), with chains and with EAGLE-2 trees (each level's nodes reversed), drafts are
    accepted, no block leaks; every first draft equals transformers'
    ``MtpModel`` (built on the target's own layer class) run over the committed sequence from scratch. DeepSeek-V3.2
    and GLM-5: the MTP layer's latent attention has its own indexer (its keys in its latent rows) picking its keys
    (GLM-5's first drafts unchecked: transformers' MtpModel cannot run its layer). Hunyuan 3: its attention's q/k
    norms, its experts under the release's names, ``final_layernorm`` for DeepSeek's ``shared_head.norm``.
    GLM-4.7-Flash: DeepSeek-V3's layout and block (latent attention, GLM's experts) as vLLM reads it. MiniMax-M2:
    its block (q/k normed over all heads, partial RoPE, experts under the release's names) in that layout."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    from specray.models.deepseek_v3 import MLAttention
    from specray.models.glm4_moe import Glm4MoeAttention
    from specray.models.kv_cache import FullAttentionSpec, MLAAttentionSpec
    from specray.models.moe import SparseMoE

    from specray.models.llama import LlamaAttention

    target = request.getfixturevalue({"deepseek_v3": "tiny_deepseek_dir", "glm4_moe": "tiny_glm4_moe_dir",
                                      "deepseek_v32": "tiny_deepseek_v32_dir", "glm_moe_dsa": "tiny_glm5_dir",
                                      "hy_v3": "tiny_hy_v3_dir", "glm4_moe_lite": "tiny_glm4_moe_lite_dir",
                                      "minimax_m2": "tiny_minimax_m2_dir"}[family])
    glm_spec = FullAttentionSpec(num_kv_heads=2, head_dim=24)
    from specray.models.olmo2 import Olmo2Attention

    attention, spec, rotated = {"hy_v3": (LlamaAttention, FullAttentionSpec(num_kv_heads=2, head_dim=16), 16),
                                "minimax_m2": (Olmo2Attention, FullAttentionSpec(num_kv_heads=2, head_dim=16), 8),
                                "glm4_moe_lite": (MLAttention, MLAAttentionSpec(32, 8), 8),
                                "deepseek_v3": (MLAttention, MLAAttentionSpec(16, 8), 8),
                                "glm4_moe": (Glm4MoeAttention, glm_spec, 12),  # 12: half of each head
                                # sparse attention: the MTP layer's own indexer, its keys in the latent rows
                                "deepseek_v32": (MLAttention, MLAAttentionSpec(16, 8, 16), 8),
                                "glm_moe_dsa": (MLAttention, MLAAttentionSpec(16, 8, 16), 8)}[family]
    folder = draft_heads.write_deepseek_mtp(tmp_path / "mtp", target, bias_std=0.0 if family == "deepseek_v3" else 0.1)
    plain = LLM(str(target), max_model_len=256).generate(PROMPTS, MIXED, use_tqdm=False)
    llm = LLM(str(folder), max_model_len=256,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False})
    drafter = llm.engine.executor.worker.runner.drafter
    layer = drafter.head.layers[0]
    assert isinstance(layer.self_attn, attention) and isinstance(layer.mlp, SparseMoE)
    assert drafter.head.kv_cache_specs() == [spec] and drafter.head.rotary_emb.head_dim == rotated
    llm.engine.executor = rec = Recorder(llm.engine.executor)
    start = free_blocks(llm)
    outs = llm.generate(PROMPTS, MIXED, use_tqdm=False)
    assert token_ids(outs) == token_ids(plain)
    # (the module drafts "the same token again", which this tiny GLM-4.7-Flash never says: its drafts are checked
    # against transformers' below)
    assert (llm.spec_stats.accepted_tokens > 0 or family == "glm4_moe_lite") and free_blocks(llm) == start
    # EAGLE-2 trees from the module: each level one pass over every node so far (ancestor masks in its attention,
    # latent or sparse alike), the kept path's K/V moved into place
    trees = LLM(str(folder), max_model_len=256, speculative_config={
        "method": "mtp", "num_speculative_tokens": 4, "adaptive": False, **TREE})
    siblings_reversed(trees.engine.executor.worker.runner)
    assert token_ids(trees.generate(PROMPTS, MIXED, use_tqdm=False)) == token_ids(plain)
    assert (trees.spec_stats.accepted_tokens > 0 or family == "glm4_moe_lite") and free_blocks(trees) == start
    if family == "glm_moe_dsa":  # transformers' MtpModel cannot run GLM-5's layer (it returns its pick beside the
        return  # hidden states): the greedy equality above is this family's check
    # the first drafts against transformers' MTP module over each committed sequence
    sparse = family in ("deepseek_v32", "glm_moe_dsa")
    # sparse attention's indexer reads the causal mask itself: eager attention materialises it (SDPA may skip it)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                              attn_implementation="eager" if sparse else None).eval()
    hf.config.num_mtp_layers = 1
    if sparse:  # the MTP layer's own per-layer entries (indexed from 0); its mask as a full-attention layer's, the
        # kind transformers' MtpModel builds masks for (an "indexed_attention" layer's is the same causal mask)
        hf.config.mtp_layer_types, hf.config.mtp_mlp_layer_types = ["full_attention"], ["sparse"]
    if family in ("hy_v3", "glm4_moe_lite"):  # a layer with experts (the stack's first is dense)
        hf.config.mtp_mlp_layer_types = ["sparse"]
    mtp = MtpModel(hf, 1).float().eval()
    from safetensors.torch import load_file

    p = f"model.layers.{hf.config.num_hidden_layers}."
    state = {}
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        if name.startswith(p):
            rest = name[len(p):]
            last = next((n for n in ("shared_head.norm.", "final_layernorm.") if rest.startswith(n)), None)
            key = (f"layers.0.{rest}" if rest.startswith(("enorm.", "hnorm.", "eh_proj.")) else
                   "layers.0.post_norm." + rest[len(last):] if last is not None else f"layers.0.mtp_block.{rest}")
            state[key] = tensor
    missing, unexpected = mtp.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight", "shared_head.weight"}, (missing, unexpected)
    assert_first_drafts_are_mtp_models(llm, outs, rec, hf, mtp)


@pytest.mark.parametrize("kind", ["sliding_attention", "full_attention"])
def test_k_exaone_mtp_module_drafts_as_transformers_mtp_model(tiny_exaone_moe_dir, tmp_path, kind):
    """K-EXAONE's release keeps its MTP module under ``mtp.`` (``fc``, ``pre_fc_norm_*``, ``layers.0``, ``norm``): a
    layer of the kind ``mtp_layer_types`` names (sliding, rotated; or global, not: as the stack's layers of that
    kind) with a dense MLP. Greedy output equals plain decoding (batch of 8, mixed caps), no block leaks; every first
    draft equals transformers' ``MtpModel`` (built on K-EXAONE's layer class) over the committed sequence."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    from specray.models.kv_cache import FullAttentionSpec, SlidingWindowSpec
    from specray.models.llama import LlamaMLP

    folder = draft_heads.write_exaone_mtp(tmp_path / "mtp", tiny_exaone_moe_dir, kind)
    plain = LLM(str(tiny_exaone_moe_dir), max_model_len=256).generate(PROMPTS, MIXED, use_tqdm=False)
    llm = LLM(str(folder), max_model_len=256,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False})
    head = llm.engine.executor.worker.runner.drafter.head
    spec = head.kv_cache_specs()[0]
    assert isinstance(head.layers[0].mlp, LlamaMLP)
    assert isinstance(spec, SlidingWindowSpec) if kind == "sliding_attention" else type(spec) is FullAttentionSpec
    llm.engine.executor = rec = Recorder(llm.engine.executor)
    start = free_blocks(llm)
    outs = llm.generate(PROMPTS, MIXED, use_tqdm=False)
    assert token_ids(outs) == token_ids(plain) and free_blocks(llm) == start
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    hf.config.num_mtp_layers = 1
    hf.config.mtp_layer_types, hf.config.mtp_mlp_layer_types = [kind], ["dense"]
    mtp = MtpModel(hf, 1).float().eval()
    names = {"fc.": "eh_proj.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.",
             "norm.": "post_norm.", "layers.0.": "mtp_block."}
    state = {}
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        if name.startswith("mtp."):
            rest = name[len("mtp."):]
            theirs = next(t for t in names if rest.startswith(t))
            state["layers.0." + names[theirs] + rest[len(theirs):]] = tensor
    missing, unexpected = mtp.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight", "shared_head.weight"}, (missing, unexpected)
    assert_first_drafts_are_mtp_models(llm, outs, rec, hf, mtp)


def test_ernie_mtp_module_reads_the_residual_and_the_targets_norm(tiny_ernie4_5_moe_dir, tmp_path):
    """ERNIE 4.5's MTP module, as Baidu's training code runs it: it reads the target's residual stream past its last
    layer (before the final norm), fuses it with the next token's embedding (``mtp_linear_proj`` over
    ``[mtp_emb_norm(e); mtp_hidden_norm(h)]``), runs its dense block, and goes through the target's own final norm
    and LM head. Its logits over a sequence equal a reference built from transformers' modules (the residual hooked
    before the norm; the block as transformers' ERNIE layer); greedy output equals plain decoding."""
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.masking_utils import create_causal_mask

    folder = draft_heads.write_ernie_mtp(tmp_path / "mtp", tiny_ernie4_5_moe_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    config = draft_heads.ernie_mtp_config(folder)
    layers = config.num_hidden_layers - 1
    block = AutoModelForCausalLM.from_config(config).float().eval().model.layers[layers]
    file = load_file(str(folder / "model.safetensors"))
    block.load_state_dict({n[len("model.mtp_block.0."):]: t for n, t in file.items()
                           if n.startswith("model.mtp_block.0.")})
    seq = list(range(5, 25))
    captured = {}
    hook = hf.model.norm.register_forward_pre_hook(lambda m, args: captured.setdefault("h", args[0]))
    with torch.no_grad():
        hf(torch.tensor([seq]))
        hook.remove()
        h = captured["h"][0, :-1]
        rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * w  # noqa: E731
        e = hf.model.embed_tokens(torch.tensor(seq[1:]))
        x = F.linear(torch.cat([rms(e, file["model.mtp_emb_norm.0.weight"]),
                                rms(h, file["model.mtp_hidden_norm.0.weight"])], -1),
                     file["model.mtp_linear_proj.0.weight"])[None]
        positions = torch.arange(len(seq) - 1)[None]
        mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=positions)
        out = block(x, attention_mask=mask, position_ids=positions,
                    position_embeddings=hf.model.rotary_emb(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        want = hf.lm_head(hf.model.norm(out))[0]
    model = load_model(str(folder))
    head = load_draft_head("mtp", str(folder), model, load_hf_config(str(folder)))
    assert head.aux_layers == (layers,)
    allocate_kv_cache(model, 16, 4)
    allocate_kv_cache(head, 16, 4)
    with torch.no_grad():
        hidden, aux = model(torch.tensor(seq), build_attention_metadata([20], [0], [[3, 1, 4, 0, 2]], 4),
                            aux_layers=head.aux_layers)
        got = head.draft_logits(head(torch.tensor(seq[1:]), head.target_features(hidden, aux)[:-1],
                                     build_attention_metadata([19], [0], [[3, 1, 4, 0, 2]], 4))[1])
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
    plain = LLM(str(folder), max_model_len=256).generate(PROMPTS, MIXED, use_tqdm=False)
    llm = LLM(str(folder), max_model_len=256,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False})
    assert token_ids(llm.generate(PROMPTS, MIXED, use_tqdm=False)) == token_ids(plain)


# ---- MiMo-V2-Flash's MTP modules (model.mtp.layers.{k}: a sliding-window layer with sinks, a dense MLP) -------------

@pytest.mark.parametrize("num_modules, accepting", [(1, False), (2, True)], ids=["one-random", "two-accepting"])
def test_mimo_v2_flash_mtp_modules_draft_as_transformers_mtp_model(tiny_mimo_v2_flash_dir, tmp_path, num_modules,
                                                                    accepting, caplog):
    """``method="mtp"`` on a MiMo-V2-Flash release reads its MTP modules under ``model.mtp.layers.{k}`` (one reused for
    every draft step, or two chained): each a sliding-window layer of the family (twice the KV heads, a sink per
    head, the sliding layers' partial RoPE) with a dense MLP. Greedy output equals plain decoding (batch of 8, mixed
    caps and max_tokens), no block leaks, an accepting module's drafts are accepted; every first draft equals
    transformers' ``MtpModel`` (built on the target's own layer class) run over the committed sequence from scratch
    (checked on a random module too, whose drafts hang on every part of the layer)."""
    from safetensors.torch import load_file

    from specray.models.kv_cache import SlidingWindowSpec
    from specray.models.llama import LlamaMLP
    from specray.models.mimo_v2 import MiMoV2Attention

    target = tiny_mimo_v2_flash_dir
    folder = draft_heads.write_mimo_mtp(tmp_path / "mtp", target, num_modules=2, accepting=accepting)
    plain = LLM(str(target), max_model_len=256).generate(PROMPTS, MIXED, use_tqdm=False)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    if num_modules > 1:
        spec["num_nextn_predict_layers"] = num_modules
    llm = LLM(str(folder), max_model_len=256, speculative_config=spec)
    drafter = llm.engine.executor.worker.runner.drafter
    heads = list(getattr(drafter.head, "heads", [drafter.head]))
    assert len(heads) == num_modules
    for head in heads:
        layer = head.layers[0]
        assert isinstance(layer.self_attn, MiMoV2Attention) and isinstance(layer.mlp, LlamaMLP)
        assert head.kv_cache_specs() == [SlidingWindowSpec(num_kv_heads=4, head_dim=24, sliding_window=8)]
        assert head.rotary_emb.head_dim == 8  # the sliding layers' partial RoPE: 0.334 of 24
    llm.engine.executor = rec = Recorder(llm.engine.executor)
    start = free_blocks(llm)
    outs = llm.generate(PROMPTS, MIXED, use_tqdm=False)
    assert token_ids(outs) == token_ids(plain)
    assert free_blocks(llm) == start and (llm.spec_stats.accepted_tokens > 0 or not accepting)
    assert "ignoring checkpoint tensor" not in caplog.text  # the target reads none of the MTP modules' tensors
    # the first drafts against transformers' MTP module 0 over each committed sequence
    mtp, hf = draft_heads.mimo_mtp_model(target, 1)
    release = {name: t for name, t in load_file(str(folder / "model.safetensors")).items()
               if name.startswith("model.mtp.layers.0.")}
    state = {draft_heads.mimo_mtp_model_name(name, 0): tensor for name, tensor in release.items()}
    missing, unexpected = mtp.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight", "shared_head.weight"}, (missing, unexpected)
    # module 0's normed output over a sequence longer than the window, on shuffled blocks: transformers' (the pair
    # (t[p+1], h[p]) at RoPE position p + 1 there, p here: the same relative positions)
    ours = load_draft_head("mtp", folder, load_model(str(target)), load_hf_config(str(target)))
    allocate_kv_cache(ours, 16, 4)
    seq = torch.randint(0, hf.config.vocab_size, (22,), generator=torch.Generator().manual_seed(5))
    n = len(seq) - 1
    with torch.no_grad():
        hidden = hf.model(seq[None, :n]).last_hidden_state
        want = mtp.forward_layer(0, hidden, torch.arange(1, n + 1)[None], None, input_ids=seq[None, 1:])[0]
        meta = build_attention_metadata([n], [0], [[9, 2, 14, 5, 11, 0]], 4)
        got = ours(seq[1:], hidden[0], meta)[1]
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
    assert_first_drafts_are_mtp_models(llm, outs, rec, hf, mtp)


@pytest.mark.parametrize("accepting", [False, True], ids=["random", "accepting"])
def test_nemotron_3_mtp_module_drafts_as_its_two_blocks(tmp_path, accepting, caplog):
    """``method="mtp"`` on a Nemotron 3 release (a Nemotron-H hybrid with latent experts) reads its MTP module
    (``mtp.layers.0``: the fusion and an attention block; ``mtp.layers.1``: an experts block and the final norm) as
    one layer whose attention and MLP halves are the two blocks. Its normed output over a sequence equals
    ``final_layernorm`` of transformers' own two Nemotron-H blocks over the fusion; greedy output equals plain
    decoding (batch of 8, mixed caps), no block leaks, an accepting module's drafts are accepted."""
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from specray.models.llama import LlamaAttention
    from specray.models.moe import SparseMoE

    target = sys.modules["specray_test_hybrid_models"].save(tmp_path / "target", "nemotron_h_moe", 3)
    folder = draft_heads.write_nemotron_mtp(tmp_path / "mtp", target, accepting=accepting)
    plain = LLM(str(folder), max_model_len=256).generate(PROMPTS, MIXED, use_tqdm=False)  # (the MTP left unread)
    llm = LLM(str(folder), max_model_len=256,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False})
    layer = llm.engine.executor.worker.runner.drafter.head.layers[0]
    assert isinstance(layer.self_attn, LlamaAttention) and not layer.self_attn.use_rope
    assert isinstance(layer.mlp, SparseMoE)
    start = free_blocks(llm)
    outs = llm.generate(PROMPTS, MIXED, use_tqdm=False)
    assert token_ids(outs) == token_ids(plain)
    assert free_blocks(llm) == start and (llm.spec_stats.accepted_tokens > 0 or not accepting)
    assert "ignoring checkpoint tensor" not in caplog.text  # the target reads none of the MTP module's tensors
    # the head's normed output against transformers' blocks
    release = load_file(str(folder / "model.safetensors"))
    blocks, _ = draft_heads.nemotron_mtp_blocks(AutoConfig.from_pretrained(target), {
        k: v for k, v in release.items() if k.startswith(("mtp.layers.0.norm.", "mtp.layers.0.mixer.",
                                                           "mtp.layers.1.norm.", "mtp.layers.1.mixer."))})
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours = load_draft_head("mtp", folder, load_model(str(folder)), load_hf_config(str(folder)))
    allocate_kv_cache(ours, 16, 4)
    seq = torch.randint(0, hf.config.vocab_size, (14,), generator=torch.Generator().manual_seed(5))
    n = len(seq) - 1

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf.config.layer_norm_epsilon) * release[name]

    with torch.no_grad():
        hidden = hf.get_decoder()(seq[None, :n]).last_hidden_state
        e = hf.get_input_embeddings()(seq[None, 1:])
        x = F.linear(torch.cat([rms(e, "mtp.layers.0.enorm.weight"), rms(hidden, "mtp.layers.0.hnorm.weight")], -1),
                     release["mtp.layers.0.eh_proj.weight"])
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = blocks[1](blocks[0](x, attention_mask=causal, position_ids=torch.arange(n)[None]))
        want = rms(x, "mtp.layers.1.final_layernorm.weight")[0]
        got = ours(seq[1:], hidden[0], build_attention_metadata([n], [0], [[9, 2, 14, 5]], 4))[1]
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
    if not accepting:  # another pattern of blocks is refused, naming the way out
        raw = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**raw, "mtp_layers_block_type": ["full_attention", "mlp"]}))
        with pytest.raises(ValueError, match=r"mtp_layers_block_type=\['full_attention', 'mlp'\].*another speculative"):
            LLM(str(folder), max_model_len=256, speculative_config={"method": "mtp", "num_speculative_tokens": 2})


# each rank's share of a family's MTP head over the target's split embedding: its normed output over a sequence
# (past MiMo's window of 8) against one rank's, for each of ``folders``
MTP_HEAD_RANKS = """
from specray.models.draft_head_loader import load_draft_head
from specray.models.loader import load_hf_config

diffs = []
for folder in folders:
    config = load_hf_config(folder)
    width = config.hidden_size * getattr(config, "hc_mult", 1)  # DeepSeek-V4's module reads the target's streams
    features = torch.randn(19, width, generator=torch.Generator().manual_seed(1))
    outs = []
    for group in (tp, None):
        head = load_draft_head("mtp", folder, load_model(folder, group), config, tp=group)
        allocate_kv_cache(head, 32, 4)
        with torch.no_grad():
            outs.append(head(ids[1:20], features, plan([19], [0], [tables[0]], 4))[1])
    diffs.append((outs[0] - outs[1]).abs().max().item())
del head
gc.collect()
dist.destroy_process_group()
json.dump({"diffs": diffs}, open(f"{out}/{rank}.json", "w"))
"""


def test_mtp_heads_split_over_two_ranks_match_one_rank(tiny_mimo_v2_flash_dir, tiny_deepseek_v4_dir, tiny_hy_v3_dir,
                                                       tiny_exaone_moe_dir, tmp_path):
    """MiMo-V2-Flash's MTP module (its sliding layer's doubled KV heads and sinks split), Nemotron 3's (its
    attention block split by head, its latent experts by width), DeepSeek-V4's (query heads, sinks and output
    groups split, experts by width, over the streams), Hunyuan 3's (heads with their q/k norms, experts by width)
    and K-EXAONE's (a sliding layer's heads, a dense MLP) over two tensor-parallel ranks (gloo): each rank's normed
    output equals one rank's."""
    from specray_test_model_checks import WORKER_PRELUDE, run_ranks  # tests/model_checks.py

    nemotron = sys.modules["specray_test_hybrid_models"].save(tmp_path / "nemotron", "nemotron_h_moe", 3)
    folders = [draft_heads.write_mimo_mtp(tmp_path / "mimo_mtp", tiny_mimo_v2_flash_dir, num_modules=1,
                                          accepting=False),
               draft_heads.write_nemotron_mtp(tmp_path / "nemotron_mtp", nemotron, accepting=False),
               draft_heads.write_deepseek_v4_mtp(tmp_path / "v4_mtp", tiny_deepseek_v4_dir),
               draft_heads.write_deepseek_mtp(tmp_path / "hy_v3_mtp", tiny_hy_v3_dir, accepting=False),
               draft_heads.write_exaone_mtp(tmp_path / "exaone_mtp", tiny_exaone_moe_dir)]
    results = run_ranks(tmp_path / "ranks", WORKER_PRELUDE + MTP_HEAD_RANKS, 2, 1, [str(f) for f in folders])
    for result in results:
        assert all(d < 1e-5 for d in result["diffs"]), results


def test_mimo_v2_flash_mtp_refusals(tiny_mimo_v2_flash_dir, tmp_path):
    """A release without its MTP modules, or fewer modules than asked to chain: a ValueError naming the way out."""
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"no MTP layer \(model\.mtp\.layers\.0\.\*\).*another speculative method"):
        LLM(str(tiny_mimo_v2_flash_dir), max_model_len=256, speculative_config=spec)
    folder = draft_heads.write_mimo_mtp(tmp_path / "mtp", tiny_mimo_v2_flash_dir, num_modules=2)
    with pytest.raises(ValueError, match="num_nextn_predict_layers=3 but .* has 2 MTP module"):
        LLM(str(folder), max_model_len=256, speculative_config={**spec, "num_nextn_predict_layers": 3})


# ---- the hybrid family's own MTP layer (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: gated attention, 1 + w norms) -----------

HYBRID_IDS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], list(range(40, 70)), [11, 12, 11, 12, 11, 12, 13, 11, 12],
              [7, 7, 7, 7, 7, 7], list(range(200, 237)) + list(range(200, 210)), [3, 1, 4, 1, 5, 9, 2, 6]]
HYBRID_MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    """arch -> (target folder, the same with an accepting MTP layer, with a random one), built once per arch."""
    made = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp(arch)
            target = draft_heads.write_tiny_hybrid(root / "target", arch)
            made[arch] = (target, draft_heads.write_qwen_mtp(root / "accepting", target),
                          draft_heads.write_qwen_mtp(root / "random", target, seed=12, accepting=False))
        return made[arch]

    return get


def hybrid_generate(llm, params=None, ids=HYBRID_IDS) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in ids]
    return token_ids(llm.generate(prompts, params or greedy(20), use_tqdm=False))


def watch_recurrent_state(runner) -> list[bool]:
    """Wrap the runner's drafter so that each draft call records whether it changed the target's recurrent state
    (every layer's conv inputs, pending gates and matrix state); returns the record."""
    draft, touched = runner.drafter.draft, []

    def draft_watched(*args, **kwargs):
        before = [t.clone() for s in runner.recurrent_state.layers for t in (s.inputs, s.gates, s.matrix)]
        out = draft(*args, **kwargs)
        after = [t for s in runner.recurrent_state.layers for t in (s.inputs, s.gates, s.matrix)]
        touched.append(any(not torch.equal(a, b) for a, b in zip(before, after)))
        return out

    runner.drafter.draft = draft_watched
    return touched


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_hybrid_mtp_layer_drafts_with_its_own_block(hybrid_dirs, arch):
    """``method="mtp"`` on a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next release reads its ``mtp.*`` layer, whose block is the
    family's (gated attention with q/k norms and partial RoPE; dense MLP, or experts with a gated shared expert; 1 + w
    norms): with the accepting layer and a random one, greedy output equals plain decoding (6 requests at once), no
    block leaks, drafting leaves the target's recurrent state as it found it, and every first draft equals
    transformers' own ``MtpModel`` loaded from the release (``MtpModel.from_pretrained``: its mapping of the
    ``mtp.*`` names) run over the committed sequence from scratch; the accepting layer's drafts are accepted."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    from specray.models.llama import LlamaMLP
    from specray.models.moe import SparseMoE
    from specray.models.qwen3_5 import GatedAttention, ResidualGemmaRMSNorm

    target, *folders = hybrid_dirs(arch)
    plain = hybrid_generate(LLM(str(target), max_model_len=128))
    for folder in folders:
        llm = LLM(str(folder), max_model_len=128, speculative_config=HYBRID_MTP)
        runner = llm.engine.executor.worker.runner
        head = runner.drafter.head
        layer = head.layers[0]
        assert isinstance(layer.self_attn, GatedAttention) and isinstance(head.norm, ResidualGemmaRMSNorm)
        assert isinstance(layer.mlp, LlamaMLP if arch == "qwen3_5" else SparseMoE)
        assert head.rotary_emb.head_dim == 4  # a quarter of each 16-wide head rotates, as the target's layers do
        touched = watch_recurrent_state(runner)
        llm.engine.executor = rec = Recorder(llm.engine.executor)
        start = free_blocks(llm)
        assert hybrid_generate(llm) == plain
        assert free_blocks(llm) == start
        assert touched and not any(touched)
        assert folder.name != "accepting" or llm.spec_stats.accepted_tokens > 0, llm.spec_stats
        # the first drafts against transformers' MTP module, loaded from the release by transformers' own mapping
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        hf.config.num_mtp_layers, hf.config.mtp_layer_types = 1, ["full_attention"]
        mtp = MtpModel.from_pretrained(hf).float().eval()
        committed: dict[str, list[int]] = {}  # each request's tokens so far, from its chunks and what they kept
        checked = 0
        for chunk, kept, drafts in rec.chunks():
            real = chunk.token_ids[: chunk.num_tokens - chunk.num_draft_tokens]
            seq = committed[chunk.req_id] = committed.get(chunk.req_id, [])[: chunk.start_pos] + real + list(kept)
            if not kept or not drafts or checked >= 12:
                continue
            n = len(seq) - 1
            with torch.no_grad():
                hidden = hf.model(torch.tensor([seq[:n]])).last_hidden_state
                want, _, _ = mtp(input_ids=torch.tensor([seq[1:]]), last_hidden_states=hidden, attention_mask=None,
                                 position_ids=torch.arange(1, n + 1)[None], mtp_cache=None)
            assert drafts[0] == int(want[0, 0]), (folder.name, chunk.req_id, drafts, want)
            checked += 1
        assert checked >= 12


@pytest.mark.parametrize("case", ["random", "chunked-prefill", "preemption"])
def test_hybrid_mtp_greedy_equals_plain(hybrid_dirs, case):
    """Qwen3.5 with its MTP layer: a random layer (drafts mostly rejected), and the accepting one with prefills in
    small chunks (the head's first pass over each chunk's committed rows) and with a KV pool so small that requests
    are preempted (the target recomputes its recurrent state from token 0, the head its K/V): plain greedy output."""
    target, accepting, random = hybrid_dirs("qwen3_5")
    plain = hybrid_generate(LLM(str(target), max_model_len=128))
    kw = {"chunked-prefill": dict(max_num_batched_tokens=8, long_prefill_token_threshold=5),
          "preemption": dict(block_size=4, num_kv_blocks=24)}.get(case, {})
    llm = LLM(str(random if case == "random" else accepting), max_model_len=128, speculative_config=HYBRID_MTP, **kw)
    start = free_blocks(llm)
    assert hybrid_generate(llm) == plain
    stats = llm.spec_stats
    assert stats.draft_tokens > stats.accepted_tokens and (case == "random" or stats.accepted_tokens > 0), stats
    assert free_blocks(llm) == start
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


def test_hybrid_mtp_comparison_can_fail(hybrid_dirs, monkeypatch):
    """The comparisons above can fail: a head whose drafting wrote into the target's recurrent state (here: it halves
    every slot's state matrix after drafting) changes the output, as the watch in the test above would see."""
    from specray.workers.head_drafter import HiddenStateDrafter

    target, accepting, _ = hybrid_dirs("qwen3_5")
    plain = hybrid_generate(LLM(str(target), max_model_len=128))
    real = HiddenStateDrafter.draft
    runners = []

    def meddling(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        for state in runners[0].recurrent_state.layers:
            state.matrix.mul_(0.5)
        return out

    monkeypatch.setattr(HiddenStateDrafter, "draft", meddling)
    llm = LLM(str(accepting), max_model_len=128, speculative_config=HYBRID_MTP)
    runners.append(llm.engine.executor.worker.runner)
    out = hybrid_generate(llm)
    assert all(len(o) == 20 for o in out) and out != plain


@pytest.mark.parametrize("shape", ["chains", "trees"])
def test_sampled_output_keeps_the_target_distribution_with_hybrid_mtp(hybrid_dirs, shape):
    """Qwen3.5's own MTP layer (written to accept often) drafting chains, or EAGLE-2 trees, drawn from its q for
    sampled requests (a tree's siblings without replacement, verified by recursive rejection sampling, each node's
    recurrent state from its parent's): the first three sampled tokens' joint frequencies fit transformers' target
    distribution (a p-value under the threshold decided by a second test on fresh seeds); the same test fails against
    the distribution at temperature 1."""
    from transformers import AutoModelForCausalLM

    target, accepting, _ = hybrid_dirs("qwen3_5")
    plain = LLM(str(target), max_model_len=128)
    prompt = [7, 7, 7, 7, 7, 7]
    prompt = prompt + hybrid_generate(plain, greedy(3), [prompt])[0]  # ends in a run the accepting layer drafts
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    triples = triples_of(None, prompt, last_logits=lambda tokens: hf(torch.tensor([tokens])).logits[0, -1:].float())
    expected = triples[SAMPLED["temperature"]]

    spec = HYBRID_MTP if shape == "chains" else {**HYBRID_MTP, **TREE, "num_speculative_tokens": 5}

    def engine() -> LLM:
        return LLM(str(accepting), max_model_len=128, max_num_seqs=64, speculative_config=spec)

    pvalue = sampled_pvalue(None, None, "mtp", prompt, expected, engine=engine)
    if pvalue <= 1e-3:
        pvalue = sampled_pvalue(None, None, "mtp", prompt, expected, n=2400, first_seed=800, engine=engine)
    assert pvalue > 1e-3
    assert sampled_pvalue(None, None, "mtp", prompt, triples[1.0], engine=engine) < 1e-3


def test_hybrid_mtp_refusals(hybrid_dirs, tmp_path):
    """What the hybrid family's MTP cannot do is refused with the way out: a release without ``mtp.*``, more than its
    one MTP layer; a head these targets cannot serve (Gemma 4's assistant) is refused by method. A lookup's token
    trees beside the head (suffix decoding's) are verified: greedy output equals plain decoding's."""
    target, accepting, _ = hybrid_dirs("qwen3_5")
    beside = LLM(str(accepting), max_model_len=128, speculative_config={
        **HYBRID_MTP, "combine_with": {"method": "suffix", "num_speculative_tokens": 6}})
    plain = LLM(str(accepting), max_model_len=128)
    prompts = [{"prompt_token_ids": ids} for ids in HYBRID_IDS]
    assert token_ids(beside.generate(prompts, greedy(24), use_tqdm=False)) == token_ids(
        plain.generate(prompts, greedy(24), use_tqdm=False))
    assert beside.spec_stats.accepted_tokens > 0
    (tmp_path / "config.json").write_text("{}")  # a head's folder as far as its path goes: the method is refused
    for model, extra, match in [
            (target, {}, "no MTP layer"),
            (accepting, {"num_nextn_predict_layers": 2, "num_speculative_tokens": 2}, "num_nextn_predict_layers=2"),
            (accepting, {"method": "gemma4_assistant", "model": str(tmp_path)}, "method='gemma4_assistant'")]:
        with pytest.raises(ValueError, match=match):
            LLM(str(model), max_model_len=128, speculative_config={**HYBRID_MTP, **extra})


# ---- EAGLE-1 / EAGLE-3 heads on a hybrid target: chains over its linear and attention layers' hidden rows ---------

@pytest.fixture(scope="module")
def hybrid_eagle(hybrid_dirs, tmp_path_factory):
    """(Qwen3.5 target folder, its plain greedy outputs, {(kind, method): head folder}): accepting EAGLE-1 and EAGLE-3
    heads (EAGLE-3's reading the streams entering layers 0, 2 and 3: linear, linear, full attention) and a random
    EAGLE-3 head at the default layers."""
    target = hybrid_dirs("qwen3_5")[0]
    root = tmp_path_factory.mktemp("hybrid_eagle")
    folders = {("accepting", m): draft_heads.write_accepting_head(root / f"accepting_{m}", m, target)
               for m in ("eagle", "eagle3")}
    folders["random", "eagle3"] = draft_heads.write_random_head(root / "random_eagle3", "eagle3", target)
    return target, hybrid_generate(LLM(str(target), max_model_len=128)), folders


def hybrid_eagle_llm(hybrid_eagle, kind: str, method: str, **kw) -> LLM:
    target, _, folders = hybrid_eagle
    spec = {"method": method, "model": str(folders[kind, method]), "num_speculative_tokens": 3, "adaptive": False}
    return LLM(str(target), max_model_len=128, speculative_config=spec, **kw)


@pytest.mark.parametrize("case", ["eagle", "eagle3", "eagle3-random", "eagle3-chunked-prefill"])
def test_eagle_heads_on_a_hybrid_target_keep_greedy_output(hybrid_eagle, case):
    """EAGLE-1 and EAGLE-3 drafting chains for Qwen3.5 (Gated DeltaNet layers beside gated attention): the head
    reads the verify pass's hidden rows (EAGLE-3: the residual streams entering its three layers, which the hybrid
    stack hands out as the Llama stack does) and keeps its own K/V; six requests at once, an accepting head and a
    random one, and prefills in small chunks (the head's first pass over each chunk's committed rows): greedy output
    equals plain decoding, the accepting heads' drafts are accepted, no block leaks, and drafting leaves the
    target's recurrent state as it found it."""
    method, _, variant = case.partition("-")
    kw = dict(max_num_batched_tokens=8, long_prefill_token_threshold=5) if variant == "chunked-prefill" else {}
    llm = hybrid_eagle_llm(hybrid_eagle, "random" if variant == "random" else "accepting", method, **kw)
    runner = llm.engine.executor.worker.runner
    if method == "eagle3":
        assert tuple(runner.aux_layers) == ((0, 2, 3) if variant != "random" else (2, 2, 1)), runner.aux_layers
    touched = watch_recurrent_state(runner)
    start = free_blocks(llm)
    assert hybrid_generate(llm) == hybrid_eagle[1]
    assert free_blocks(llm) == start
    assert touched and not any(touched)
    stats = llm.spec_stats
    assert stats.draft_tokens > stats.accepted_tokens and (variant == "random" or stats.accepted_tokens > 0), stats


def test_sampled_output_keeps_the_target_distribution_with_eagle3_on_a_hybrid_target(hybrid_eagle):
    """The accepting EAGLE-3 head drafting chains drawn from its q for sampled requests on Qwen3.5: the first three
    sampled tokens' joint frequencies fit transformers' target distribution (a p-value under the threshold decided
    by a second test on fresh seeds); the same test fails against the distribution at temperature 1."""
    from transformers import AutoModelForCausalLM

    target = hybrid_eagle[0]
    prompt = [7, 7, 7, 7, 7, 7]
    prompt = prompt + hybrid_generate(LLM(str(target), max_model_len=128), greedy(3), [prompt])[0]
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    triples = triples_of(None, prompt, last_logits=lambda tokens: hf(torch.tensor([tokens])).logits[0, -1:].float())

    def engine() -> LLM:
        return hybrid_eagle_llm(hybrid_eagle, "accepting", "eagle3", max_num_seqs=64)

    pvalue = sampled_pvalue(None, None, "eagle3", prompt, triples[SAMPLED["temperature"]], engine=engine)
    if pvalue <= 1e-3:
        pvalue = sampled_pvalue(None, None, "eagle3", prompt, triples[SAMPLED["temperature"]], n=2400,
                                first_seed=800, engine=engine)
    assert pvalue > 1e-3
    assert sampled_pvalue(None, None, "eagle3", prompt, triples[1.0], engine=engine) < 1e-3


# ---- heads' token trees on a hybrid target: each node's recurrent state from its parent's, the accepted path kept ----

@pytest.fixture(scope="module")
def hybrid_tree_heads(hybrid_dirs, hybrid_eagle, tmp_path_factory):
    """case -> (model folder, speculative_config, plain greedy outputs) of a head drafting trees for Qwen3.5: its own
    MTP layer growing EAGLE-2 trees and a static one, the EAGLE-3 head growing EAGLE-2 trees, Medusa's heads,
    ReDrafter's beams, DFlash's static tree (on its own copy of the target, whose mask token's row embeds to zero);
    every head written to accept often."""
    target, accepting, _ = hybrid_dirs("qwen3_5")
    root = tmp_path_factory.mktemp("hybrid_trees")
    plain = hybrid_eagle[1]
    tree = {**TREE, "num_speculative_tokens": 5, "adaptive": False}
    dflash_target = draft_heads.zero_mask_row(Path(shutil.copytree(target, root / "dflash_target")))
    dflash = draft_heads.write_dflash(root / "dflash", dflash_target, num_layers=3, block_size=4,
                                      target_layer_ids=[0, 2], accepting=True)
    return {
        "mtp-tree": (accepting, {"method": "mtp", **tree}, plain),
        "mtp-static": (accepting, {"method": "mtp", "speculative_token_tree": STATIC, "adaptive": False}, plain),
        "eagle3-tree": (target, {"method": "eagle3", "model": str(hybrid_eagle[2]["accepting", "eagle3"]), **tree},
                        plain),
        "medusa": (target, {"method": "medusa", "num_speculative_tokens": 5, "adaptive": False,
                            "model": str(draft_heads.write_medusa_heads(root / "medusa", target, accepting=True))},
                   plain),
        "redrafter": (target, {"method": "redrafter", "num_speculative_tokens": 5, "adaptive": False, **BEAMS,
                               "model": str(draft_heads.write_redrafter(root / "redrafter", target, accepting=True))},
                      plain),
        "dflash-tree": (dflash_target, {"method": "dflash", "model": str(dflash), "num_speculative_tokens": 5,
                                        "adaptive": False,
                                        "speculative_token_tree": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]},
                        hybrid_generate(LLM(str(dflash_target), max_model_len=128)))}


@pytest.mark.parametrize("case", ["mtp-tree", "mtp-tree-chunked-prefill", "mtp-tree-preemption", "mtp-static",
                                  "eagle3-tree", "medusa", "redrafter", "dflash-tree"])
def test_head_trees_on_a_hybrid_target_keep_greedy_output(hybrid_tree_heads, case):
    """Every head's token trees verified on Qwen3.5 (Gated DeltaNet layers beside gated attention): each node's
    recurrent state runs from its parent's, the accepted path's pending inputs are put in path order by the next
    plan's K/V move, and the head drafts its next tree from that path's hidden rows. With six requests at once, with
    prefills in small chunks and with a KV pool so small that requests are preempted: greedy output equals plain
    decoding, branching trees are verified and (each level's nodes reversed: :func:`siblings_reversed`) paths other
    than the first accepted (K/V moves made), no block leaks, and drafting leaves the target's recurrent state as
    it found it."""
    variant = case.partition("-tree")[2]
    model, spec, plain = hybrid_tree_heads[case.removesuffix(variant)]
    kw = {"-chunked-prefill": dict(max_num_batched_tokens=8, long_prefill_token_threshold=5),
          "-preemption": dict(block_size=4, num_kv_blocks=24)}.get(variant, {})
    llm = LLM(str(model), max_model_len=128, speculative_config=spec, **kw)
    runner = llm.engine.executor.worker.runner
    touched = watch_recurrent_state(runner)
    siblings_reversed(runner)
    moves, apply = [], runner.apply_plan_state
    runner.apply_plan_state = lambda plan: moves.extend(plan.kv_moves) or apply(plan)
    llm.engine.executor = rec = Recorder(llm.engine.executor)
    start = free_blocks(llm)
    assert hybrid_generate(llm) == plain
    assert free_blocks(llm) == start
    assert touched and not any(touched)
    assert llm.spec_stats.accepted_tokens > 0, llm.spec_stats
    assert any(c.draft_parents and len(set(c.draft_parents)) < len(c.draft_parents) for c, _, _ in rec.chunks())
    assert moves, "every accepted path was the tree's first"
    if variant == "-preemption":
        assert llm.engine.scheduler.num_preemptions > 0
