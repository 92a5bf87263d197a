"""Token trees end to end on tiny random models: the scheduler's tree bookkeeping (trimming, K/V moves, a failed
plan that was moving K/V), the committed K/V after a non-leftmost path equal to a fresh prefill, and greedy output
of the tree drafters equal to plain greedy output (batch 1 and 8, preemption, chunked prefill, stop strings)."""

import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from specray import LLM, SamplingParams
from specray.config import EngineArgs
from specray.contract import StepResult
from specray.engine.builder import build_engine
from specray.sampling_params import SamplingParams as SP
from specray.scheduler.request import Request
from specray.scheduler.scheduler import Scheduler, SchedulerConfig
from specray.tree import DraftTree
from specray_test_engine_runs import (  # tests/engine_runs.py (registered by conftest)
    LOOKAHEAD, PROMPTS, PathCounter, generate_greedy, greedy, token_ids)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"specray_test_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probes = _load("probes")

NGRAM_TREE = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
              "num_branches": 3, "adaptive": False}
NGRAM_STATIC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                "speculative_token_tree": [[0, 0, 0, 0], [1, 0], [2], [0, 1]], "adaptive": False}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8, "max_spec_factor": 2.0, "min_token_prob": 0.05}
EXACTNESS_SPECS = {"ngram-tree": NGRAM_TREE, "lookahead": LOOKAHEAD}  # preemption, chunked prefill, stop strings
TREE_SPECS = {"ngram-tree": NGRAM_TREE, "ngram-static": NGRAM_STATIC,
              "ngram-tree-adaptive": {**NGRAM_TREE, "adaptive": True}, "suffix": SUFFIX,
              "suffix-fixed": {**SUFFIX, "adaptive": False}}


# ---- the scheduler --------------------------------------------------------------------------------------------

def _scheduler(**kw) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                                     num_blocks=kw.pop("num_blocks", 32), **kw))


def _decoding(sched: Scheduler, prompt=(1, 2, 3, 4, 5), max_tokens=20) -> Request:
    req = Request("r", list(prompt), SP(temperature=0.0, max_tokens=max_tokens))
    sched.add_request(req)
    plan = sched.schedule()
    sched.update_from_output(plan, StepResult(plan.step_id, ["r"], [[9]]))
    return req


def test_tree_chunk_and_kv_move_of_a_non_leftmost_path():
    sched = _scheduler()
    req = _decoding(sched)  # 5 prompt tokens + 9: computed 5
    tree = DraftTree([10, 11, 12, 13], [-1, -1, 1, 1])  # 10 | 11 -> (12 | 13)
    sched.update_draft_token_ids({"r": tree})
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert chunk.token_ids == [9, 10, 11, 12, 13] and chunk.draft_parents == [-1, -1, 1, 1]
    assert chunk.num_draft_tokens == 4 and chunk.start_pos == 5
    table = list(req.block_ids)
    # the target kept 11, 13 (nodes 1 and 3) and added 7
    result = StepResult(plan.step_id, ["r"], [[11, 13, 7]], accepted_draft_indices=[[1, 3]])
    sched.update_from_output(plan, result)
    assert req.output_token_ids == [9, 11, 13, 7] and req.num_computed_tokens == 8
    nxt = sched.schedule()
    (move,) = nxt.kv_moves
    # node 1 sits at slot index 6 + 1 = 7 -> committed index 6; node 3 at 9 -> 7 (physical, through the old table)
    slot = lambda i: table[i // 4] * 4 + i % 4  # noqa: E731
    assert move.req_id == "r" and move.src == [slot(7), slot(9)] and move.dst == [slot(6), slot(7)]
    assert sched.schedule().kv_moves == []  # carried once


def test_leftmost_path_needs_no_move_and_a_chain_tree_is_a_chain():
    sched = _scheduler()
    _decoding(sched)
    sched.update_draft_token_ids({"r": DraftTree([10, 11, 12], [-1, 0, -1])})
    plan = sched.schedule()
    sched.update_from_output(plan, StepResult(plan.step_id, ["r"], [[10, 11, 5]], accepted_draft_indices=[[0, 1]]))
    assert sched.schedule().kv_moves == []
    sched.update_draft_token_ids({"r": DraftTree([1, 2], [-1, 0])})
    assert sched.schedule().chunks[0].draft_parents is None  # a chain is sent as one


def test_tree_is_trimmed_to_budget_and_to_what_max_tokens_allows():
    sched = _scheduler()
    req = _decoding(sched, max_tokens=3)  # 1 generated, 2 left: drafts at most 1 deep
    sched.update_draft_token_ids({"r": DraftTree([10, 11, 12, 13], [-1, 0, -1, 2])})
    chunk = sched.schedule().chunks[0]
    assert chunk.token_ids[1:] == [10, 12] and chunk.draft_parents == [-1, -1]
    assert req.num_computed_tokens == 5
    sched2 = _scheduler()
    _decoding(sched2)
    sched2.config.max_num_batched_tokens = 3  # the last token + 2 nodes
    sched2.update_draft_token_ids({"r": DraftTree([10, 11, 12, 13], [-1, -1, 0, 1])})
    assert sched2.schedule().chunks[0].token_ids == [9, 10, 11]


def test_failed_plan_that_moved_kv_preempts_the_request():
    sched = _scheduler()
    req = _decoding(sched)
    sched.update_draft_token_ids({"r": DraftTree([10, 11], [-1, -1])})
    plan = sched.schedule()
    sched.update_from_output(plan, StepResult(plan.step_id, ["r"], [[11, 3]], accepted_draft_indices=[[1]]))
    failed = sched.schedule()
    assert failed.kv_moves
    assert sched.forget_worker_state(failed) == ["r"]
    assert req.num_computed_tokens == 0 and req in sched.waiting  # recomputes its K/V
    again = sched.schedule()
    assert again.kv_moves == [] and again.new_requests[0].req_id == "r"


# ---- K/V after acceptance ---------------------------------------------------------------------------------------

def test_committed_kv_after_tree_paths_equals_a_fresh_prefill(tiny_llama_dir, plain):
    """A drafter proposing trees with the right token at random sibling ranks: once a step that accepted a
    non-leftmost path is followed by the next (whose plan carries the K/V moves), each such request's committed
    K/V equals a fresh prefill of its tokens; the output equals plain greedy output."""
    engine = build_engine(EngineArgs(model=str(tiny_llama_dir), max_model_len=256,
                                     speculative_config={"method": "ngram", "num_speculative_tokens": 9,
                                                         "adaptive": False}))
    reference = build_engine(EngineArgs(model=str(tiny_llama_dir), max_model_len=256))
    tok = plain.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:4]]
    want = token_ids(plain.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False))
    ids = [engine.add_request(p, greedy()) for p in prompts]
    engine.drafter = probes.NoisyTreeOracle({i: (len(p), w) for i, p, w in zip(ids, prompts, want)},
                                            engine.vocab_size, seed=3)
    engine.executor = counter = PathCounter(engine.executor)
    worker, pending, checked, done = counter.inner.worker, [], 0, {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        for rid, tokens in pending:  # the step after the move: the first len(tokens) slots are final
            if rid in worker.runner.block_tables:
                torch.testing.assert_close(probes.kv_snapshot(worker, rid, len(tokens)),
                                           _fresh_prefill_kv(reference, tokens), atol=1e-5, rtol=1e-4)
                checked += 1
        pending = [(r.req_id, r.all_token_ids[: r.num_computed_tokens]) for r in engine.scheduler.running
                   if r.req_id in counter.last_moved]
    assert [done[i] for i in ids] == want
    assert counter.moved > 0 and checked >= 3


class FailsAfterRunning:
    """Wraps an executor: from the third plan holding ``poisoned`` on, the plan runs whole (K/V written) and then
    raises, so the engine runs the others again and merges their answers."""

    def __init__(self, inner, poisoned: str):
        self.inner, self.poisoned, self.seen, self.raised = inner, poisoned, 0, 0

    def execute(self, plan, draft_probs=None):
        result = self.inner.execute(plan, draft_probs)
        self.seen += any(c.req_id == self.poisoned for c in plan.chunks)
        if self.seen >= 3 and any(c.req_id == self.poisoned for c in plan.chunks):
            self.raised += 1
            raise RuntimeError("injected fault")
        return result

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_tree_paths_survive_a_step_run_again_without_a_failing_request(tiny_llama_dir, plain):
    """A step fails for one request and the others run again: their trees' accepted paths come through the merged
    result (the K/V moves follow them), so their outputs still equal plain greedy output."""
    engine = build_engine(EngineArgs(model=str(tiny_llama_dir), max_model_len=256,
                                     speculative_config={"method": "ngram", "num_speculative_tokens": 9,
                                                         "adaptive": False}))
    tok = plain.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:4]]
    want = token_ids(plain.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False))
    ids = [engine.add_request(p, greedy()) for p in prompts]
    engine.drafter = probes.NoisyTreeOracle({i: (len(p), w) for i, p, w in zip(ids, prompts, want)},
                                            engine.vocab_size, seed=3)
    counter = PathCounter(engine.executor)
    engine.executor = faulty = FailsAfterRunning(counter, ids[0])
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert faulty.raised >= 1 and done[ids[0]].outputs[0].finish_reason == "error"
    assert [done[i].outputs[0].token_ids for i in ids[1:]] == want[1:]
    assert counter.moved > 0


def _fresh_prefill_kv(engine, tokens: list[int]) -> torch.Tensor:
    rid = engine.add_request(list(tokens), greedy(2))
    engine.step()  # the prefill and the first token
    kv = probes.kv_snapshot(engine.executor.worker, rid, len(tokens))
    engine.abort_request([rid])
    return kv


# ---- greedy output -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(TREE_SPECS))
@pytest.mark.parametrize("batch", [1, 8])
def test_tree_drafters_greedy_equal_plain(tiny_llama_dir, plain_outputs, name, batch):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=TREE_SPECS[name])
    llm.engine.executor = counter = PathCounter(llm.engine.executor)
    llm.engine.clock = counter.clock  # the adaptive policy prices by step costs that do not follow this CPU's load
    start = llm.engine.scheduler.block_manager.num_free_blocks
    outs = generate_greedy(llm, batch)
    assert token_ids(outs) == plain_outputs
    if TREE_SPECS[name].get("adaptive", True) and batch > 1:
        # a batch of a random model's text: the policy may rightly verify little beyond its probes
        assert llm.spec_stats.drafts > 0
    else:
        assert counter.trees > 0 and llm.spec_stats.accepted_tokens > 0
    assert llm.engine.scheduler.block_manager.num_free_blocks == start


@pytest.mark.parametrize("kw", [{"block_size": 4, "num_kv_blocks": 40}, {"max_num_batched_tokens": 16}],
                         ids=["preemption", "chunked-prefill"])
@pytest.mark.parametrize("spec", list(EXACTNESS_SPECS))
def test_tree_greedy_under_preemption_and_chunked_prefill(tiny_llama_dir, plain_outputs, kw, spec):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=EXACTNESS_SPECS[spec], **kw)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert token_ids(outs) == plain_outputs
    if "num_kv_blocks" in kw:
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.block_manager.num_free_blocks == 40


@pytest.mark.parametrize("spec", list(EXACTNESS_SPECS))
def test_tree_stop_string(tiny_llama_dir, plain, spec):
    fulls = [o.outputs[0] for o in plain.generate(PROMPTS, greedy(), use_tqdm=False)]
    full = max(fulls, key=lambda c: len(set(c.text)))
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    assert stop.strip(), full.text
    prompt = PROMPTS[fulls.index(full)]
    want = plain.generate(prompt, greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=EXACTNESS_SPECS[spec])
    got = llm.generate(prompt, greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert got.finish_reason == "stop"
    assert (got.text, got.token_ids) == (want.text, want.token_ids)


def test_sampled_tree_drafts_run_and_are_seeded(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM_TREE)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=5, ignore_eos=True)
    first = token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
    assert token_ids(llm.generate(PROMPTS[::-1], params, use_tqdm=False))[::-1] == first


def test_bad_token_tree_is_a_clear_error(tiny_llama_dir):
    from specray.tree import parse_token_tree

    # vLLM's Python-literal string reads as the JSON and list forms do
    assert parse_token_tree("[(0,), (1,), (0, 0)]") == parse_token_tree("[[0], [1], [0, 0]]") == parse_token_tree(
        [[0, 0], [1]]) == [(0,), (1,), (0, 0)]
    for bad, match in [("[[0], [", "neither JSON .* nor a Python literal"), ([[0], [-1]], "ranks >= 0"),
                       ([], "non-empty"), ([[0], 3], "path")]:
        with pytest.raises(ValueError, match=match):
            LLM(model=str(tiny_llama_dir), max_model_len=256,
                speculative_config={**NGRAM_STATIC, "speculative_token_tree": bad})


# ---- every drafter of the n-gram family, and a user-provided one ----------------------------------------------

FAMILY = {
    "ngram_simple": {"ngram_size_n": 2, "ngram_size_m": 8},
    "ngram_map_k": {"ngram_size_n": 2, "ngram_size_m": 8, "min_hits": 1},
    "ngram_map_k4v": {"ngram_size_n": 2, "ngram_size_m": 8, "min_hits": 1},
    "ngram_mod": {"ngram_size_n": 3, "draft_min": 1, "draft_max": 8, "pool_size": 4096},
    "ngram_cache": {},
}


@pytest.mark.parametrize("method", list(FAMILY))
@pytest.mark.parametrize("batch", [1, 8])
def test_ngram_family_greedy_equals_plain(tiny_llama_dir, plain_outputs, method, batch):
    spec = {"method": method, "num_speculative_tokens": 6, **FAMILY[method]}
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec)
    start = llm.engine.scheduler.block_manager.num_free_blocks
    outs = generate_greedy(llm, batch)
    assert token_ids(outs) == plain_outputs
    stats = llm.engine.drafter.stats()
    assert stats["calls"] > 0 and stats["gen_tokens"] >= stats["acc_tokens"], stats
    assert stats["acc_tokens"] == llm.spec_stats.accepted_tokens  # the engine told it what was kept
    assert llm.engine.scheduler.block_manager.num_free_blocks == start


def test_user_provided_drafter_by_dotted_path(tiny_llama_dir, plain_outputs, tmp_path, monkeypatch):
    """The example in docs/ (a tree of what followed the last token) plugged in by its dotted path."""
    example = Path(__file__).parents[1] / "docs" / "examples" / "last_token_drafter.py"
    (tmp_path / "my_drafters.py").write_text(example.read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = {"method": "my_drafters:LastTokenDrafter", "num_speculative_tokens": 6, "lookback": 64}
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec)
    llm.engine.executor = counter = PathCounter(llm.engine.executor)
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == plain_outputs
    assert counter.trees > 0 and llm.spec_stats.accepted_tokens > 0


@pytest.mark.parametrize("method, match", [
    ("no_such_pkg.mod:Drafter", "cannot import"),
    ("json:JSONDecoder", "not a drafter class"),
    ("nonsense", "unknown"),
])
def test_bad_user_drafter_is_a_clear_error(tiny_llama_dir, method, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config={"method": method})


def test_user_drafter_options_are_checked(tiny_llama_dir, tmp_path, monkeypatch):
    example = Path(__file__).parents[1] / "docs" / "examples" / "last_token_drafter.py"
    (tmp_path / "my_drafters2.py").write_text(example.read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="lookbak"):
        LLM(model=str(tiny_llama_dir), max_model_len=256,
            speculative_config={"method": "my_drafters2:LastTokenDrafter", "lookbak": 3})
    (tmp_path / "my_drafters3.py").write_text("class NoArgs:\n    def __init__(self):\n        pass\n\n"
                                              "    propose = finish = shutdown = __init__\n")
    with pytest.raises(ValueError, match=r"cannot be built as NoArgs\(spec, ctx\)"):
        LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config={"method": "my_drafters3:NoArgs"})
    # Options that are not a dataclass, a prepare that returns no context: said so, not a TypeError of dataclasses'
    (tmp_path / "my_drafters4.py").write_text(
        "from my_drafters2 import LastTokenDrafter\n\n"
        "class DictOptions(LastTokenDrafter):\n    Options = dict\n\n"
        "class Unprepared(LastTokenDrafter):\n    @classmethod\n    def prepare(cls, spec, ctx):\n        pass\n")
    with pytest.raises(ValueError, match=r"DictOptions.Options=<class 'dict'> is not a dataclass"):
        LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config={"method": "my_drafters4:DictOptions"})
    with pytest.raises(ValueError, match=r"Unprepared.prepare returned NoneType; it must return the DrafterContext"):
        LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config={"method": "my_drafters4:Unprepared"})


class BadDrafter:
    """The engine's own drafter for every request but one, which gets a broken tree, an id outside the
    vocabulary, ids that are not integers (or None, or a tensor), a list in place of a Proposal, a q that is not a
    tensor of a row per draft with each draft within its width, a key that is no dict key or scores that are not
    numbers, a drafter actor's word that it raised for it, or (with the others) a list of the wrong length; or
    that appends to that request's history (a user's drafter is handed a tuple: it raises), or whose
    ``observe_verification`` raises for it; and whose ``finish`` raises for it."""

    def __init__(self, inner, bad_req: str, what: str):
        self.inner, self.bad_req, self.what, self.bad_calls = inner, bad_req, what, 0

    def __getattr__(self, name):  # the rest of the drafter protocol: the engine's own drafter's
        if name == "observe_verification" and self.what == "observe":
            return self.observe_verification_
        return getattr(self.inner, name)

    def observe_verification_(self, req_id, num_drafted, num_accepted):
        if req_id == self.bad_req:
            self.bad_calls += 1
            raise RuntimeError("observe_verification failed on purpose")

    def propose(self, batch):
        from specray.drafters.base import DraftFailure, Proposal

        for d in batch:
            if d.req_id == self.bad_req and self.what == "mutate":  # its drafts appended to the history it is given
                self.bad_calls += 1
                d.token_ids.append(5)
        out = self.inner.propose(batch)
        for i, d in enumerate(batch):
            if d.req_id != self.bad_req or self.what in ("mutate", "observe"):
                continue
            self.bad_calls += 1
            if self.what == "count":
                return out + [Proposal([])]
            out[i] = {"parents": Proposal([5, 6, 7], parents=[-1, 2, 0]), "vocab": Proposal([5, 10 ** 9]),
                      "floats": Proposal([5, 6.5]), "list": [5, 6], "none": Proposal(None),
                      "tensor": Proposal(torch.tensor([5, 6])), "probs_list": Proposal([5, 6], [[0.5, 0.5]] * 2),
                      "probs_rows": Proposal([5, 6], torch.full((1, 9), 1 / 9)),
                      "probs_narrow": Proposal([5, 9], torch.full((2, 9), 1 / 9)),
                      "key": Proposal([5, 6], key=[2]), "actor": DraftFailure("RuntimeError('boom')"),
                      "scores": Proposal([5, 6, 7], parents=[-1, 0, 0], scores=["high"] * 3)}[self.what]
        return out

    def finish(self, req_ids):
        self.inner.finish(req_ids)
        if self.bad_req in req_ids:
            raise RuntimeError("finish failed on purpose")


# (one that raises: test_engine.py)
@pytest.mark.parametrize("what", ["parents", "vocab", "floats", "list", "count", "none", "tensor", "probs_list",
                                  "probs_rows", "probs_narrow", "mutate", "key", "scores", "actor", "observe"])
def test_a_drafter_failing_one_request_costs_it_only_its_drafts(tiny_llama_dir, plain_outputs, what, caplog):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM_STATIC)
    engine, tok = llm.engine, llm.get_tokenizer()
    free = engine.scheduler.block_manager.num_free_blocks
    ids = [engine.add_request(tok.encode(p), greedy()) for p in PROMPTS[:3]]
    from specray.cluster.metrics import ServerMetrics, engine_state

    engine.drafter = bad = BadDrafter(engine.drafter, ids[1], what)
    done = {}
    with caplog.at_level(logging.ERROR, logger="specray"):
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
    assert [done[i].outputs[0].token_ids for i in ids] == plain_outputs[:3]
    assert all(done[i].outputs[0].finish_reason != "error" for i in ids)
    # asked once (alone once more after a batch it spoilt), never again; the others kept drafting
    assert bad.bad_calls == (2 if what in ("count", "mutate") else 1) and engine.drafting_failures == 1
    assert f"drafting failed for request {ids[1]}" in caplog.text and not engine._undrafted
    assert "the drafter's finish failed" in caplog.text and not engine.tracked  # logged, not raised
    assert llm.spec_stats.accepted_tokens > 0
    assert engine.scheduler.block_manager.num_free_blocks == free
    metrics = ServerMetrics("tiny")
    metrics.record_engine_state(engine_state(engine))
    assert 'specray_spec_drafting_failures_total{model="tiny"} 1.0' in metrics.render().decode()
    if what == "parents":  # a drafter whose shutdown raises: the error comes out, the workers are released still
        released, release = [], engine.executor.shutdown
        engine.executor.shutdown = lambda: released.append(release())

        def fails():
            raise RuntimeError("shutdown failed on purpose")

        bad.shutdown = fails
        with pytest.raises(RuntimeError, match="shutdown failed on purpose"):
            llm.shutdown()
        assert released


# ---- seeded sampling: the target samples each position alone, so drafts cannot change a seeded output ----------

SAMPLED_SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                           "prompt_lookup_max": 3, "adaptive": False},
                 "ngram-adaptive": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
                 "ngram-tree": NGRAM_TREE, "ngram-static": NGRAM_STATIC, "suffix": {**SUFFIX, "adaptive": False},
                 "lookahead": LOOKAHEAD,
                 "ngram_cache": {"method": "ngram_cache", "num_speculative_tokens": 6, "adaptive": False},
                 "ngram_map_k4v": {"method": "ngram_map_k4v", "num_speculative_tokens": 6, "ngram_size_n": 2,
                                   "adaptive": False}}

# (the other two find no match in these sampled texts: equality only)
KEEPS_SAMPLED_DRAFTS = {"ngram", "ngram-tree", "ngram-static", "suffix", "lookahead"}


def seeded(n: int = 24) -> list[SamplingParams]:
    """Sampled, one seed per prompt; cool enough that the tiny model's loops give the lookups matches."""
    return [SamplingParams(temperature=0.5, top_p=0.95, max_tokens=n, ignore_eos=True, seed=100 + i)
            for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def plain_seeded(plain):
    return token_ids(plain.generate(PROMPTS, seeded(), use_tqdm=False))


@pytest.mark.parametrize("name", list(SAMPLED_SPECS))
def test_seeded_sampled_output_equals_plain_token_for_token(tiny_llama_dir, plain_seeded, name):
    """Drafts without q are verified by coupling (the target samples its own token at each position, with a
    uniform keyed by the seed and the position; a draft is kept iff it is that token): a seeded request's output
    is plain decoding's, at batch 8 and batch 1, however many drafts the policy asked for and whatever else ran
    in between (a second pass after other traffic gives the same output)."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=SAMPLED_SPECS[name])
    outs = llm.generate(PROMPTS, seeded(), use_tqdm=False)
    assert token_ids(outs) == plain_seeded
    if name in KEEPS_SAMPLED_DRAFTS:  # the coupling was exercised: some drafts were kept
        assert sum(o.spec_stats.accepted_tokens for o in outs) > 0
    llm.generate(PROMPTS[::-1], greedy(40), use_tqdm=False)  # other traffic: the policy's evidence moves
    one_by_one = [token_ids(llm.generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(PROMPTS, seeded())]
    assert one_by_one == plain_seeded
