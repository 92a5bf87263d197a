"""A request's own drafting method (``SamplingParams.speculative_method``): routed to that method's drafter, greedy
output unchanged, refused methods refused at admission without touching other requests, routed state freed."""

import pytest

from specray import LLM, SamplingParams
from specray.drafters.base import DraftRequest, Proposal
from specray.drafters.router import DrafterRouter
from specray.config import SpeculativeConfig
from specray_test_engine_runs import token_ids  # tests/engine_runs.py (registered by conftest)

REPEAT = "one two three four " * 4  # repeats a 24-gram: ngram_mod (24-grams) can draft
PROMPTS = [
    REPEAT,
    "def add(a, b):\n    return",
    REPEAT + "one two",
    "The quick brown fox",
    REPEAT + "one",
    "I am fine, thank you. Hello world! How are",
    REPEAT + "one two three",
    "for i in range(10):",
]
# lookahead's default tree (15 nodes) is fitted to the engine's K (4)
METHODS = [None, "suffix", "ngram_mod", "ngram", "lookahead", "suffix", "ngram_mod", "ngram"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def greedy(n=64, **kw):  # long enough for a tiny model's own loops to repeat 24-grams (ngram_mod)
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def plain_outputs(plain):  # this module's prompts and length (conftest's plain engine)
    return token_ids(plain.generate(PROMPTS, greedy(), use_tqdm=False))


def free_blocks(llm):
    return llm.engine.scheduler.block_manager.num_free_blocks


@pytest.fixture
def ngram_llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM)


def test_mixed_methods_greedy_equal_plain_and_draft_with_their_method(ngram_llm, plain_outputs):
    engine = ngram_llm.engine
    assert engine.drafter is not engine.router  # nobody picked a method yet: the plain drafter, no router
    outs = ngram_llm.generate(PROMPTS, [greedy(speculative_method=m) for m in METHODS], use_tqdm=False)
    assert token_ids(outs) == plain_outputs
    assert engine.drafter is engine.router
    stats = ngram_llm.drafter_stats  # by method: the n-gram drafter keeps none, the routed ones do
    assert set(stats) == {"suffix", "ngram_mod", "lookahead"}
    for method in ("suffix", "ngram_mod", "lookahead"):
        routed = [o.spec_stats for o, m in zip(outs, METHODS) if m == method]
        assert stats[method]["calls"] > 0 and stats[method]["gen_drafts"] > 0, stats
        assert sum(s.drafts for s in routed) > 0 and sum(s.accepted_tokens for s in routed) > 0
    own = [o.spec_stats for o, m in zip(outs, METHODS) if m in (None, "ngram")]
    assert sum(s.drafts for s in own) > 0
    # a routed drafter's keys are its method's own in the policy's evidence pooled over requests
    assert any(isinstance(k, tuple) and k[0] == "suffix" for k in engine.policy._key_evidence)
    assert not engine.router._owners and not engine.router._built["suffix"]._requests
    assert free_blocks(ngram_llm) == engine.scheduler.block_manager.num_blocks


def test_routed_requests_are_cheap_behind_a_drafter_that_is_not(tiny_llama_dir, tiny_draft_dir, plain_outputs):
    """A draft-model engine asks its drafter for the policy's K; a request routed to suffix is asked for the
    most it may have, as suffix's own engine would."""
    spec = {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec)
    methods = [None, "suffix", "draft_model", "suffix"]
    outs = llm.generate(PROMPTS[:4], [greedy(speculative_method=m) for m in methods], use_tqdm=False)
    assert token_ids(outs) == plain_outputs[:4]
    router = llm.engine.router
    assert router.proposes_cheaply_for(greedy(speculative_method="suffix"))
    assert not router.proposes_cheaply_for(greedy()) and not router.proposes_cheaply_for(greedy(
        speculative_method="draft_model"))
    assert llm.drafter_stats["suffix"]["calls"] > 0 and outs[0].spec_stats.drafts > 0


@pytest.mark.parametrize("method,words", [
    ("draft_model", ["speculative_method='draft_model'", "'suffix'", "'ngram'"]),
    ("bogus", ["speculative_method='bogus'", "'suffix'"]),
    ("specray.drafters.suffix:SuffixDrafter", ["speculative_method=", "user-provided"]),
    ("", ["speculative_method=''"]),
])
def test_refused_method_leaves_other_requests_unharmed(ngram_llm, plain_outputs, method, words):
    engine = ngram_llm.engine
    rid = engine.add_request(ngram_llm.get_tokenizer().encode(PROMPTS[1]), greedy(speculative_method="suffix"))
    engine.step()
    engine.step()
    params = greedy()
    params.speculative_method = method  # past construction's checks: admission must catch it
    with pytest.raises(ValueError) as info:
        engine.add_request([1, 2, 3], params)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert set(engine.tracked) == {rid} and len(engine.scheduler.requests) == 1
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs[rid].outputs[0].token_ids == plain_outputs[1]
    assert free_blocks(ngram_llm) == engine.scheduler.block_manager.num_blocks


def test_a_method_needs_an_engine_that_speculates(plain):
    with pytest.raises(ValueError, match="speculative_method='suffix' needs an engine that speculates"):
        plain.generate(["Hello", "Hi"], [greedy(), greedy(speculative_method="suffix")], use_tqdm=False)
    assert not plain.engine.tracked and not plain.engine.scheduler.requests
    assert free_blocks(plain) == plain.engine.scheduler.block_manager.num_blocks


def test_construction_checks_the_type():
    with pytest.raises(ValueError, match="speculative_method=3"):
        SamplingParams(speculative_method=3)


def test_finish_and_abort_free_the_routed_drafters_state(ngram_llm):
    engine = ngram_llm.engine
    ids = ngram_llm.get_tokenizer().encode(PROMPTS[0])
    kept = engine.add_request(ids, greedy(speculative_method="suffix"))
    gone = engine.add_request(ids, greedy(speculative_method="ngram_mod"))
    for _ in range(3):
        engine.step()
    router = engine.router
    suffix, mod = router._built["suffix"], router._built["ngram_mod"]
    assert set(router._owners) == {kept, gone} and kept in suffix._requests and gone in mod._states
    engine.abort_request([gone])
    assert set(router._owners) == {kept} and gone not in mod._states
    while engine.has_unfinished_requests():
        engine.step()
    assert not router._owners and kept not in suffix._requests


class _Remote:
    """An engine drafter that drafts ahead (as the Ray backend's RemoteDrafter does) and keeps no hooks."""

    drafts_ahead = True

    def __init__(self):
        self.prefetched, self.finished, self.shut = [], [], False

    def propose(self, batch):
        return [Proposal([7]) for _ in batch]

    def prefetch(self, batch):
        self.prefetched += [d.req_id for d in batch]

    def finish(self, req_ids):
        self.finished += list(req_ids)

    def shutdown(self):
        self.shut = True


def test_router_prefetches_own_requests_only_and_forwards_hooks_to_the_owner():
    from specray.drafters.base import DrafterContext

    own = _Remote()
    router = DrafterRouter(own, SpeculativeConfig(method="ngram", num_speculative_tokens=3),
                           DrafterContext("m", vocab_size=100, max_model_len=64, max_num_seqs=4))
    assert router.drafts_ahead and not router.cheap_proposals
    batch = [DraftRequest("a", [1, 2, 1, 2, 1], 3, greedy()),
             DraftRequest("b", [1, 2, 1, 2, 1], 3, greedy(speculative_method="suffix"))]
    own_proposal, routed = router.propose(batch)
    assert own_proposal.token_ids == [7] and routed.token_ids and routed.key[0] == "suffix"
    router.prefetch(batch)
    assert own.prefetched == ["a"]
    router.observe_verification("a", 1, 1)  # the own drafter has no such hook: nothing to tell
    router.observe_verification("b", len(routed.token_ids), 1)
    assert router.stats()["suffix"]["acc_tokens"] == 1
    router.finish(["a", "b"])
    assert own.finished == ["a"] and not router._built["suffix"]._requests and not router._owners
    router.shutdown()
    assert own.shut
