"""Lookahead decoding (``method="lookahead"``) on tiny random models: the runner's node tokens against
transformers' argmax after each node's path (one host sync per step), the drafter's Jacobi window and pool with
hand-made node tokens, the all-or-nothing policy, greedy output equal to plain greedy output (batch 1 and 8,
per-request caps; preemption, chunked prefill and stop strings in test_trees), accepted pool n-grams, option
errors, and seeded sampling."""

import random

import pytest
import torch

from specray import LLM, SamplingParams
from specray.config import EngineArgs, SpeculativeConfig
from specray.drafters.base import DraftRequest, DrafterContext
from specray.drafters.lookahead import LOOKAHEAD_SCORE, LookaheadDrafter
from specray.engine.builder import build_engine
from specray.sampling_params import SamplingParams as SP
from specray.scheduler.draft_policy import DraftLengthPolicy
from specray.tree import DraftTree, kept_nodes, path_to, trim_tree
from specray_test_engine_runs import LOOKAHEAD, PROMPTS, PathCounter, generate_greedy, greedy, token_ids  # via conftest
from specray_test_host_sync import sync_recorder  # tests/host_sync.py (registered by conftest)


SPECS = {
    "default": LOOKAHEAD,
    "adaptive": {**LOOKAHEAD, "adaptive": True},
    # no num_speculative_tokens: the whole tree's 4 + 3 nodes
    "n2": {"method": "lookahead", "max_window_size": 5, "max_ngram_size": 2, "max_verification_set_size": 3,
           "adaptive": False},
    "n4-window-only-pool": {"method": "lookahead", "num_speculative_tokens": 20, "window_size": 3, "ngram_size": 4,
                            "verification_set_size": 2, "pool_from_history": False, "adaptive": False},
}
REPEAT = "one two three four five six seven eight nine ten " * 4


# ---- the runner's node tokens -----------------------------------------------------------------------------------

def _random_tree(rng: random.Random, size: int) -> list[int]:
    return [rng.randrange(-1, i) for i in range(size)]


def test_node_tokens_are_the_targets_argmax_after_each_path_in_one_host_sync(tiny_llama_dir, monkeypatch):
    """Three decoding requests: a random tree and a chain that want node tokens, and a tree that does not; the
    node tokens equal transformers' argmax on prefix + path to the node, and tree verification reads everything
    back with one host copy and no other sync."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).float().eval()
    engine = build_engine(EngineArgs(model=str(tiny_llama_dir), max_model_len=256))
    tok = engine.tokenizer
    ids = [engine.add_request(tok.encode(p), greedy()) for p in PROMPTS[:3]]
    engine.step()  # prefill: each request now decodes
    rng = random.Random(0)
    vocab = engine.vocab_size
    shapes = {ids[0]: (_random_tree(rng, 12), True), ids[1]: (list(range(-1, 4)), True),
              ids[2]: (_random_tree(rng, 5), False)}
    drafts = {rid: DraftTree([rng.randrange(vocab) for _ in parents], parents, None, want)
              for rid, (parents, want) in shapes.items()}
    engine.scheduler.update_draft_token_ids(drafts)
    plan = engine.scheduler.schedule()
    assert [c.want_node_tokens for c in plan.chunks] == [True, True, False]
    assert plan.chunks[1].draft_parents is None  # a chain goes as a chain, node tokens and all
    runner = engine.executor.worker.runner
    copies, syncs = _count_host_reads(monkeypatch, runner)
    result = engine.executor.execute(plan)
    assert copies == [1] and syncs == [[]]
    assert result.node_tokens[2] == []
    for chunk, nodes in zip(plan.chunks[:2], result.node_tokens[:2]):
        request = engine.scheduler.get_request(chunk.req_id)
        tree = drafts[chunk.req_id]
        assert len(nodes) == len(tree)
        for i in range(len(tree)):
            path = request.all_token_ids + [tree.token_ids[j] for j in path_to(tree.parents, i)]
            with torch.no_grad():
                logits = hf(torch.tensor([path])).logits[0, -1]
            top = logits.topk(2).values
            if top[0] - top[1] > 1e-3:  # not a near tie that float noise could flip
                assert nodes[i] == int(logits.argmax()), (chunk.req_id, i)


def _count_host_reads(monkeypatch, runner):
    """Wrap the runner's tree verification: per call, how many ``tolist`` copies it made and which other syncs."""
    copies, syncs = [], []
    original, tolist = runner._verify_trees, torch.Tensor.tolist

    def counted(*args):
        calls = [0]

        def counting_tolist(self):
            calls[0] += 1
            return tolist(self)

        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "tolist", counting_tolist)
            with sync_recorder() as rec:
                out = original(*args)
        copies.append(calls[0])
        syncs.append(rec.syncs)
        return out

    monkeypatch.setattr(runner, "_verify_trees", counted)
    return copies, syncs


def test_kept_nodes_recovers_what_trim_tree_kept():
    rng = random.Random(1)
    for _ in range(200):
        parents = _random_tree(rng, rng.randrange(1, 16))
        tree = DraftTree(list(range(len(parents))), parents)
        cut = trim_tree(tree, rng.randrange(1, len(parents) + 1), rng.choice([None, 1, 2, 3]))
        if len(cut):
            assert [tree.token_ids[i] for i in kept_nodes(parents, cut.parents)] == cut.token_ids


# ---- the drafter ------------------------------------------------------------------------------------------------

def _drafter(k: int = 20, **options) -> LookaheadDrafter:
    spec = SpeculativeConfig(method="lookahead", num_speculative_tokens=k, **options)
    return LookaheadDrafter(spec, DrafterContext("tiny", vocab_size=1000, max_model_len=256, max_num_seqs=8))


def _propose(drafter, history, k=20, rid="r"):
    return drafter.propose([DraftRequest(rid, list(history), k, SP(temperature=0.0))])[0]


def test_window_layout_jacobi_step_and_pool():
    """W=3, N=3: the tree is the trunk l0[1] -> l0[2] and the chains l1[c] under the root and each trunk node;
    the target's argmax at the last level becomes the new level and each column's n-gram enters the pool; a
    step that verified nothing only shifts."""
    d = _drafter(max_window_size=3, max_ngram_size=3, max_verification_set_size=2, pool_from_history=False)
    history = [100, 101, 102, 103, 104, 105, 106, 107]
    first = _propose(d, history)
    assert set(first.token_ids) <= set(history[1:])  # initialised from the history
    assert _propose(d, history) == first  # asked again for the same history: the same proposal
    state = d._states["r"]
    state.levels = [[107, 20, 21], [30, 31, 32]]  # l0 (l0[0]: the root), l1
    p = _propose(d, history)
    assert p.token_ids == [20, 21, 30, 31, 32] and p.parents == [-1, 0, -1, 0, 1]  # depth = position offset
    assert p.scores == [LOOKAHEAD_SCORE] * 5 and p.whole and p.wants_node_tokens
    d.observe_node_tokens("r", [900, 901, 500, 501, 502])  # the last level's nodes are 2, 3, 4
    second = _propose(d, history + [30])  # the target kept 30 (column 0's guess at P + 1)
    assert state.pool == {107: [(30, 500)], 20: [(31, 501)], 21: [(32, 502)]}
    assert state.levels == [[30, 31, 32], [500, 501, 502]]
    assert second.token_ids == [31, 32, 500, 501, 502]  # no n-gram starts with 30: the lookahead branch alone
    _propose(d, history + [30, 31])  # nothing verified (no node tokens): a shift, the new level 0 copied down
    assert state.levels == [[31, 501, 502], [500, 501, 502]] and len(state.pool) == 3


def test_pool_ngrams_are_verified_first_and_cut_columns_give_none():
    d = _drafter(max_window_size=3, max_ngram_size=3, max_verification_set_size=2, pool_from_history=False)
    history = [7, 8, 9, 10, 11, 12]
    _propose(d, history)
    state = d._states["r"]
    state.levels = [[12, 20, 21], [30, 31, 32]]
    _propose(d, history)
    d.observe_node_tokens("r", [-1, -1, 40, -1])  # the scheduler cut nodes 0, 1, 3 and everything after 3
    _propose(d, history + [55])
    assert state.pool == {12: [(30, 40)]}
    assert state.levels == [[55, 31, 32], [40, 31, 32]]  # cut columns take the new level 0's guess
    state.pool[99] = [(1, 2), (1, 3)]  # oldest first
    p = _propose(d, history + [55, 66, 99])
    assert p.token_ids[:3] == [1, 3, 2] and p.parents[:3] == [-1, 0, 0]  # a trie, newest first, then the window
    assert p.scores[:3] == [pytest.approx(2 / 3), pytest.approx(1 / 3), pytest.approx(1 / 3)]
    assert len(p.token_ids) == 3 + 5


def test_two_kept_tokens_take_a_jacobi_step_then_a_shift_and_the_history_feeds_the_pool():
    d = _drafter(max_window_size=2, max_ngram_size=3, max_verification_set_size=3)
    history = [1, 2, 3, 1, 2, 4]
    _propose(d, history)
    state = d._states["r"]
    assert state.pool == {1: [(2, 3), (2, 4)], 2: [(3, 1)], 3: [(1, 2)]}
    state.levels = [[4, 10], [11, 12]]
    p = _propose(d, history)
    assert p.token_ids == [10, 11, 12] and p.parents == [-1, -1, 0]
    d.observe_node_tokens("r", [7, 8, 9])
    _propose(d, history + [5, 6])
    assert state.pool == {1: [(2, 3), (2, 4)], 2: [(3, 1), (4, 5)], 3: [(1, 2)], 4: [(5, 6), (11, 8)],
                          10: [(12, 9)]}
    assert state.levels == [[6, 9], [8, 9]]


@pytest.mark.parametrize("k, total, pooled", [(20, 9, 2), (9, 9, 2), (8, 8, 1), (7, 7, 0), (6, 5, 0), (2, 1, 0),
                                              (0, 0, 0)])
def test_fewer_drafts_shrink_the_pool_then_the_window(k, total, pooled):
    """W=4, N=3: the window takes 7 nodes, the root's one n-gram 2; below 7, w columns take 2w - 1."""
    d = _drafter(20)
    history = list(range(50, 80)) * 2  # the root 79 was followed by 50, 51
    p = _propose(d, history, k=k)
    assert len(p.token_ids) == total
    assert sum(s != LOOKAHEAD_SCORE for s in p.scores or []) == pooled


@pytest.mark.parametrize("options, match", [
    ({"max_ngram_size": 1}, "max_ngram_size=1"),
    ({"max_window_size": 0}, "max_window_size=0"),
    ({"max_verification_set_size": -1}, "max_verification_set_size=-1"),
    ({"max_window_size": 1, "max_ngram_size": 2}, "no lookahead branch"),
    ({"pool_from_history": "yes"}, "pool_from_history"),
    ({"window_size": 3, "max_window_size": 4}, "give max_window_size only"),
    ({"num_speculative_tokens": 5}, r"num_speculative_tokens=5 is smaller .* raise num_speculative_tokens to 15"),
])
def test_bad_options_are_clear_errors(tiny_llama_dir, options, match):
    spec = {"method": "lookahead", "num_speculative_tokens": 64, **options}
    with pytest.raises(ValueError, match=match):
        LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec)


def test_a_draft_count_left_unset_is_the_methods_own():
    """Unset, ``num_speculative_tokens`` is lookahead's whole tree (W - 1 + W(N - 2) + G(N - 1)) and one draft per
    MTP module when there are several; given, it stays as given; elsewhere the default 5."""
    from specray.drafters import registry

    def settled(**spec) -> int:
        config = SpeculativeConfig.from_any(spec)
        registry.check(config)
        return config.num_speculative_tokens

    assert settled(method="lookahead") == 15
    assert settled(method="lookahead", max_window_size=5, max_ngram_size=2, max_verification_set_size=3) == 7
    assert settled(method="lookahead", num_speculative_tokens=20) == 20
    assert settled(method="mtp", num_nextn_predict_layers=3) == 3
    assert settled(method="mtp", num_nextn_predict_layers=3, num_speculative_tokens=2) == 2
    assert settled(method="mtp") == settled(method="ngram") == 5
    with pytest.raises(ValueError, match=r"num_speculative_tokens=5 is smaller .* 15 nodes"):
        settled(method="lookahead", num_speculative_tokens=5)  # before any engine is built (the server's check)
    assert settled(**SpeculativeConfig.from_any({"method": "lookahead"}).to_dict()) == 15  # unset travels unset
    assert settled(**SpeculativeConfig.from_any({"method": "lookahead", "num_speculative_tokens": 15}).to_dict()) == 15
    # a tree too large for the context names the options that size it, not only the count it set
    from specray.engine.builder import check_draft_count

    config = SpeculativeConfig.from_any({"method": "lookahead", "max_window_size": 16})
    registry.check(config)
    with pytest.raises(ValueError, match=r"=39 is not below max_model_len=32.* tree of 39 nodes: lower max_window"):
        check_draft_count(config, 32)


def test_a_tree_fitted_to_fewer_drafts_shrinks_the_defaults_least():
    """What a per-request lookahead runs with on an engine whose K is below the default tree: a tree within K, the
    verification set shrunk first, then the window, then the n-gram length."""
    from specray.drafters.lookahead import LookaheadOptions

    assert LookaheadOptions.fitted_to(15) == {"max_window_size": 4, "max_ngram_size": 3, "max_verification_set_size": 4}
    assert LookaheadOptions.fitted_to(5) == {"max_window_size": 2, "max_ngram_size": 3, "max_verification_set_size": 1}
    for k in range(1, 40):
        options = LookaheadOptions(**LookaheadOptions.fitted_to(k))
        assert 0 < options.tree_size <= k and (k < 15 or options.tree_size == 15), (k, options)


# ---- the policy: all or nothing ----------------------------------------------------------------------------------

class _Req:
    def __init__(self, cap=None):
        self.req_id, self.sampling_params = "r", SP(num_speculative_tokens=cap)


def test_whole_proposals_are_priced_all_or_nothing_with_probes():
    tree = DraftTree([1] * 10, [-1] + list(range(9)), [0.05] * 10)
    policy = DraftLengthPolicy(16, probe_after=2)
    req = _Req()
    assert [policy.choose_whole(req, 8, tree) for _ in range(3)] == [0, 0, 10]  # a probe: the whole tree
    sure = DraftTree([1] * 10, [-1] + list(range(9)), [1.0] * 10)
    assert policy.choose_whole(req, 1, sure) == 10
    assert policy.choose_whole(_Req(cap=4), 1, sure) == 4  # the request's cap: a prefix
    assert policy.choose_whole(req, 1, sure, off_critical_path=True) == 0
    assert DraftLengthPolicy(16, adaptive=False).choose_whole(req, 8, tree) == 10


# ---- end to end -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("batch", [1, 8])
def test_lookahead_greedy_equals_plain(tiny_llama_dir, plain_outputs, name, batch):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=SPECS[name])
    llm.engine.executor = counter = PathCounter(llm.engine.executor)
    start = llm.engine.scheduler.block_manager.num_free_blocks
    assert token_ids(generate_greedy(llm, batch)) == plain_outputs
    assert counter.trees > 0 and llm.spec_stats.accepted_tokens > 0
    assert llm.engine.scheduler.block_manager.num_free_blocks == start
    stats = llm.engine.drafter.stats()
    assert stats["acc_tokens"] == llm.spec_stats.accepted_tokens
    assert not llm.engine.drafter._states  # finished requests are forgotten


def test_per_request_caps_shrink_the_tree(tiny_llama_dir, plain_outputs):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=LOOKAHEAD)
    params = [greedy(num_speculative_tokens=k) for k in (0, 1, 2, 3, 5, 8, 15, None)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert token_ids(outs) == plain_outputs
    assert outs[0].spec_stats.draft_tokens == 0 and llm.spec_stats.accepted_tokens > 0


@pytest.mark.parametrize("from_history", [True, False])
def test_pool_ngrams_get_accepted_on_repetitive_text(tiny_llama_dir, plain, from_history):
    """Nodes of the verification branch (the pool's n-grams, scored unlike the lookahead nodes) are on accepted
    paths: from the history's n-grams, and from the window's alone."""
    spec = {**LOOKAHEAD, "pool_from_history": from_history}
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec)
    engine = llm.engine
    pooled, inner = [0], engine.executor.execute

    def execute(plan, draft_probs=None):
        result = inner(plan, draft_probs)
        for chunk, path in zip(plan.chunks, result.accepted_draft_indices or []):
            proposed = engine._draft_trees.get(chunk.req_id)
            if path and proposed is not None and len(proposed) == chunk.num_draft_tokens:
                pooled[0] += proposed.scores[path[0]] != LOOKAHEAD_SCORE
        return result

    engine.executor.execute = execute
    want = plain.generate(REPEAT, greedy(48), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(REPEAT, greedy(48), use_tqdm=False)[0].outputs[0].token_ids == want
    assert llm.spec_stats.accepted_tokens > 0 and pooled[0] > 0


def test_sampled_lookahead_runs_and_is_seeded(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=LOOKAHEAD)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=5, ignore_eos=True)
    first = token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
    again = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=LOOKAHEAD)
    assert token_ids(again.generate(PROMPTS, params, use_tqdm=False)) == first
    assert all(len(t) == 24 for t in first) and llm.spec_stats.draft_tokens > 0
