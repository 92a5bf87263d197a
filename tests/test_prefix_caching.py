"""Prefix caching (``enable_prefix_caching``): the block pool's sharing, reference counts and eviction, the
scheduler's admission from cached blocks, and the engine's outputs, which must equal those computed without a
cache token for token (plain decoding and every kind of drafter, penalties, seeded sampling, preemption)."""
from __future__ import annotations

import collections
import sys

import pytest

from specray import LLM, SamplingParams
from specray.errors import WorkerDiedError
from specray.kv_blocks import BlockPool
from specray.scheduler.request import Request
from specray.scheduler.scheduler import Scheduler, SchedulerConfig

runs = sys.modules["specray_test_engine_runs"]

BS = 4


class Table:
    """A table of the pool, as a request holds one."""

    def __init__(self):
        self.block_ids: list[int] = []
        self.block_contents: list[int] = []


def computed(pool: BlockPool, tokens: list[int]) -> Table:
    """A table whose K/V for ``tokens`` is written, its full blocks registered."""
    t = Table()
    pool.allocate(t, len(tokens))
    pool.cache_blocks(t, tokens, len(tokens))
    return t


# ---- the block pool ---------------------------------------------------------------------------------------

def test_a_table_starts_from_the_cached_blocks_of_its_prefix():
    pool = BlockPool(16, BS, enable_caching=True)
    a = computed(pool, list(range(10)))  # blocks of [0..3], [4..7]; 8, 9 in a partial block
    assert pool.num_cached_blocks == 2
    b = Table()
    assert pool.take_cached(b, list(range(9)) + [99, 98], 10) == 8  # the two full blocks
    assert b.block_ids == a.block_ids[:2]
    c = Table()
    assert pool.take_cached(c, [0, 1, 2, 3, 7, 7, 7, 7, 7], 8) == 4  # diverges in the second block
    assert c.block_ids == a.block_ids[:1]
    d = Table()
    assert pool.take_cached(d, [5, 1, 2, 3, 4], 4) == 0
    e = Table()
    assert pool.take_cached(e, [0, 1, 2, 3, 4, 5, 6, 9, 8], 8) == 4  # every token of a block is compared


def test_the_last_token_is_never_a_hit():
    """A prompt that is all cached still computes its last token (its logits), so the hit stops a block short."""
    pool = BlockPool(16, BS, enable_caching=True)
    computed(pool, list(range(8)))
    t = Table()
    assert pool.take_cached(t, list(range(8)), 7) == 4


def test_shared_blocks_are_counted_and_all_come_back():
    pool = BlockPool(8, BS, enable_caching=True)
    a = computed(pool, list(range(8)))
    b = Table()
    pool.take_cached(b, list(range(9)), 8)
    pool.allocate(b, 9)  # its own third block
    assert pool.num_free_blocks == 8 - 3
    pool.free(a)
    assert pool.num_free_blocks == 8 - 3  # b still holds both shared blocks
    pool.free(b)
    assert pool.num_free_blocks == 8  # cached blocks count as free: a table can take them
    assert pool.num_cached_blocks == 2


def test_eviction_takes_the_least_recently_freed_and_table_ends_first():
    pool = BlockPool(4, BS, enable_caching=True)
    a = computed(pool, list(range(8)))  # contents A0, A1
    pool.free(a)  # freed end first: A1 is evicted before A0
    b = computed(pool, [50 + i for i in range(8)])  # takes the two free blocks
    assert pool.num_cached_blocks == 4
    c = Table()
    pool.allocate(c, 4)  # one more block: A1's goes
    t = Table()
    assert pool.take_cached(t, list(range(9)), 8) == 4  # A0 still there
    pool.free(t)
    pool.free(b)
    pool.free(c)
    assert pool.num_free_blocks == 4


def test_eviction_keeps_a_sixteenth_of_the_pool_free_in_runs():
    """Once every block is cached, a table's growth evicts the oldest blocks ahead of need (a sixteenth of the
    pool), so that the blocks after it are free and it grows in place rather than block by block elsewhere."""
    pool = BlockPool(32, BS, enable_caching=True)
    old = [computed(pool, [100 * i + j for j in range(16)]) for i in range(8)]  # 8 tables of 4 cached blocks
    for t in old:
        pool.free(t)
    assert pool.num_free_blocks == 32 and pool.num_cached_blocks == 32
    t = Table()
    pool.allocate(t, 4)  # needs 1, and 2 (32 // 16) stay free: 3 evicted, the first table's, its end first
    assert pool.num_cached_blocks == 29 and pool._num_free == 2
    pool.allocate(t, 8)  # grows into the free block after it; a batch of 2 more is evicted to keep the reserve
    assert t.block_ids[1] == t.block_ids[0] + 1 and pool.num_cached_blocks == 27 and pool._num_free == 3
    pool.free(t)


def test_an_evicted_parent_does_not_make_its_stale_child_a_hit():
    """Contents chain by content id, never reused: a block that held a parent and now holds other tokens does not
    lead to the old parent's children."""
    pool = BlockPool(3, BS, enable_caching=True)
    a = computed(pool, [1] * 4 + [2] * 4)  # P = [1]*4, its child C = [2]*4
    pool.free(a)
    x = Table()
    pool.allocate(x, 4)  # the third block, never used
    pool.allocate(x, 12)  # two more: both of a's blocks are evicted, P's and C's
    pool.free(x)
    y = computed(pool, [3] * 4)  # Q registered in one of the old blocks
    pool.free(y)
    t = Table()
    assert pool.take_cached(t, [3] * 4 + [2] * 4 + [0], 8) == 4  # Q, then no C
    pool.free(t)


def test_the_same_content_computed_twice_keeps_one_block():
    pool = BlockPool(8, BS, enable_caching=True)
    tokens = list(range(8))
    a = computed(pool, tokens)
    b = computed(pool, tokens)  # computed apart (admitted before a registered): its blocks stay private
    assert pool.num_cached_blocks == 2 and b.block_contents == a.block_contents
    pool.free(b)
    assert pool.num_free_blocks == 8 - 2  # b's copies are plain free blocks again
    pool.free(a)
    assert pool.num_free_blocks == 8


def test_reset_forgets_every_content():
    pool = BlockPool(8, BS, enable_caching=True)
    a = computed(pool, list(range(8)))
    b = computed(pool, list(range(10, 18)))
    pool.free(b)
    assert pool.reset_cache() == 4 and pool.num_cached_blocks == 0
    t = Table()
    assert pool.take_cached(t, list(range(9)), 8) == 0
    pool.free(a)
    assert pool.num_free_blocks == 8


def test_a_salt_shares_only_with_its_own_salt():
    pool = BlockPool(16, BS, enable_caching=True)
    tokens = list(range(9))
    computed(pool, tokens)  # unsalted
    salted = Table()
    pool.allocate(salted, 9)
    pool.cache_blocks(salted, tokens, 9, salt="tenant-a")
    for salt, hit in ((None, 8), ("tenant-a", 8), ("tenant-b", 0)):
        t = Table()
        assert pool.take_cached(t, tokens, 8, salt) == hit, salt
        if salt == "tenant-a":
            assert t.block_ids == salted.block_ids[:2]
        pool.free(t)


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_the_pool_consistent(seed):
    """Random tables over a small vocabulary (so prefixes recur) take cached blocks, grow, register, rewind and
    free; after every operation: each block's count is the number of tables holding it, every block is free,
    cached or held (once), a table holds no block twice, and every hit's blocks hold exactly the tokens asked for
    (checked against what each block was computed with)."""
    import random

    rng = random.Random(seed)
    pool = BlockPool(24, BS, enable_caching=True)
    written: dict[int, tuple[int, ...]] = {}  # block -> the whole token prefix its K/V was computed for
    live: list[tuple[Table, list[int]]] = []

    def check():
        held = collections.Counter(b for t, _ in live for b in t.block_ids)
        assert all(len(set(t.block_ids)) == len(t.block_ids) for t, _ in live)
        for b in range(pool.num_blocks):
            assert pool._refs[b] == held[b], (b, pool._refs[b], held[b])
            states = [pool._is_free[b] == 1, b in pool._evictable, held[b] > 0]
            assert sum(states) == 1, (b, states)
            assert (b in pool._evictable) <= (b in pool._key_of)
        assert pool.num_free_blocks == pool.num_blocks - len(held)

    for _ in range(300):
        op = rng.random()
        if op < 0.35 and pool.num_free_blocks >= 4:  # a new table: its cached prefix, then computed to its length
            tokens = [rng.choice([1, 2]) for _ in range(rng.randint(2, 12))]
            t = Table()
            hit = pool.take_cached(t, tokens, len(tokens) - 1)
            for i, b in enumerate(t.block_ids):
                assert written[b] == tuple(tokens[:(i + 1) * BS]), "a hit holds other tokens"
            if not pool.can_fit(t, len(tokens)):
                pool.free(t)
                continue
            pool.allocate(t, len(tokens))
            for i in range(hit // BS, pool.blocks_for(len(tokens))):
                written[t.block_ids[i]] = tuple(tokens[:(i + 1) * BS])
            pool.cache_blocks(t, tokens, len(tokens))
            live.append((t, tokens))
        elif op < 0.6 and live:  # grow by a few tokens, computed and registered
            t, tokens = rng.choice(live)
            more = [rng.choice([1, 2]) for _ in range(rng.randint(1, 5))]
            if pool.can_fit(t, len(tokens) + len(more)):
                first = len(tokens) // BS
                tokens.extend(more)
                pool.allocate(t, len(tokens))
                for i in range(first, pool.blocks_for(len(tokens))):
                    if i >= len(t.block_contents):  # never rewrite a registered (maybe shared) block
                        written[t.block_ids[i]] = tuple(tokens[:(i + 1) * BS])
                pool.cache_blocks(t, tokens, len(tokens))
        elif op < 0.75 and live:  # rewind past its registered blocks (rejected drafts)
            t, tokens = rng.choice(live)
            keep = max(len(t.block_contents) * BS, len(tokens) - rng.randint(0, 4), 1)
            del tokens[keep:]
            pool.rewind(t, keep)
        elif op < 0.97 and live:
            t, _ = live.pop(rng.randrange(len(live)))
            pool.free(t)
        else:
            pool.reset_cache()
        check()
    for t, _ in live:
        pool.free(t)
    assert pool.num_free_blocks == pool.num_blocks


def test_without_caching_nothing_is_registered():
    pool = BlockPool(8, BS)
    t = Table()
    pool.allocate(t, 8)
    pool.free(t)
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == 8


# ---- the scheduler ----------------------------------------------------------------------------------------

def _scheduler(**kw) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=BS,
                                     num_blocks=kw.pop("num_blocks", 16), enable_prefix_caching=True, **kw))


def _run_prefill(sched: Scheduler, req: Request) -> None:
    """Admit ``req`` and run steps until its prompt is computed (every token the target samples is 7)."""
    from specray.contract import StepResult

    sched.add_request(req)
    while req.num_computed_tokens < req.num_prompt_tokens:
        plan = sched.schedule()
        sampled = [[7] if c.sample else [] for c in plan.chunks]
        sched.update_from_output(plan, StepResult(plan.step_id, [c.req_id for c in plan.chunks], sampled))


def test_a_request_is_admitted_from_the_cache_and_counts_its_hit():
    sched = _scheduler()
    params = SamplingParams(temperature=0.0, max_tokens=4)
    _run_prefill(sched, Request("a", list(range(10)), params))
    b = Request("b", list(range(9)) + [40, 41], params)
    sched.add_request(b)
    plan = sched.schedule()
    chunk = next(c for c in plan.chunks if c.req_id == "b")
    assert chunk.start_pos == 8 and chunk.token_ids == [8, 40, 41]
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == sched.requests["a"].block_ids[:2]
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (10 + 11, 8)


def test_prompt_logprobs_requests_compute_every_position():
    sched = _scheduler()
    _run_prefill(sched, Request("a", list(range(10)), SamplingParams(temperature=0.0, max_tokens=4)))
    b = Request("b", list(range(10)), SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1))
    sched.add_request(b)
    plan = sched.schedule()
    assert next(c for c in plan.chunks if c.req_id == "b").start_pos == 0 and b.num_cached_tokens == 0


def test_a_penalized_request_from_the_cache_tells_the_worker_the_cached_tokens():
    sched = _scheduler()
    _run_prefill(sched, Request("a", list(range(10)), SamplingParams(temperature=0.0, max_tokens=4)))
    b = Request("b", list(range(10)), SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=1.3))
    c = Request("c", list(range(10)), SamplingParams(temperature=0.0, max_tokens=4))
    sched.add_request(b)
    sched.add_request(c)
    plan = sched.schedule()
    new = {n.req_id: n for n in plan.new_requests}
    assert new["b"].computed_token_ids == list(range(8)) and new["c"].computed_token_ids is None


def test_a_request_waits_for_the_blocks_a_running_request_is_computing():
    """Two requests with one 10-token prefix admitted together: the second waits a step (in its place, others
    pass it) and then starts from the first's blocks; one without the prefix goes at once."""
    from specray.contract import StepResult

    sched = _scheduler()
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for rid, prompt in (("a", list(range(10)) + [20]), ("b", list(range(10)) + [30]), ("c", [50] * 6)):
        sched.add_request(Request(rid, prompt, params))
    plan = sched.schedule()
    assert [c.req_id for c in plan.chunks] == ["a", "c"] and [r.req_id for r in sched.waiting] == ["b"]
    sched.update_from_output(plan, StepResult(plan.step_id, ["a", "c"], [[7], [7]]))
    plan = sched.schedule()
    chunk = next(c for c in plan.chunks if c.req_id == "b")
    assert chunk.start_pos == 8 and sched.requests["b"].num_cached_tokens == 8


def test_a_request_that_does_not_fit_gives_its_hit_back():
    """Admission fails for want of blocks: the cached blocks it took go back to the cache, still registered."""
    sched = _scheduler(num_blocks=6)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    _run_prefill(sched, Request("a", list(range(9)), params))  # 3 blocks, 2 registered
    sched.abort_requests("a")
    big = Request("big", [60] * 12, params)  # 3 full blocks, and a fourth for its decode
    _run_prefill(sched, big)
    b = Request("b", list(range(8)) + [30] * 12, params)  # hits a's 2, needs 3 more: none is left
    sched.add_request(b)
    sched.schedule()
    assert b.status.name == "WAITING" and not b.block_ids and b.num_computed_tokens == 0
    assert sched.block_manager.num_free_blocks == 6 - 4 and sched.block_manager.num_cached_blocks == 2 + 3


# ---- the engine: outputs equal those computed without a cache ---------------------------------------------

SHARED = "You are a helpful assistant who answers in one short sentence, precisely and politely. "
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "def add(a, b):\n    return",
             "The quick brown fox", "Hello", "Summarize: the cat sat on the mat."]
# the last differs from the first by one word inside the shared part: a hit past it would change its output
CACHED_PROMPTS = [SHARED + q for q in QUESTIONS] + [SHARED.replace("short", "long") + QUESTIONS[0]]


@pytest.fixture(scope="module")
def uncached(plain):
    """Plain greedy outputs of the shared-prefix prompts, without a cache: the reference."""
    return runs.token_ids(plain.generate(CACHED_PROMPTS, runs.greedy(16), use_tqdm=False))


def _twice(llm: LLM, params) -> tuple[list, list]:
    """One request, then the batch: the batch finds the shared prefix (and the first prompt whole) cached."""
    first = llm.generate(CACHED_PROMPTS[:1], params, use_tqdm=False)
    rest = llm.generate(CACHED_PROMPTS, params, use_tqdm=False)
    return first, rest


SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 6, "num_branches": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "draft_model": "draft",
}


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_outputs_with_the_cache_equal_those_without(name, tiny_llama_dir, tiny_draft_dir, uncached):
    spec = SPECS[name]
    if spec == "draft":
        spec = {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 3}
    with LLM(str(tiny_llama_dir), max_model_len=256, speculative_config=spec, enable_prefix_caching=True) as llm:
        first, rest = _twice(llm, runs.greedy(16))
        assert runs.token_ids(first) == uncached[:1]
        assert runs.token_ids(rest) == uncached
        shared = len(llm.get_tokenizer().encode(SHARED)) // 16 * 16
        assert first[0].num_cached_tokens == 0
        assert rest[0].num_cached_tokens >= shared > 0  # the whole first prompt's blocks but its last token's
        assert all(o.num_cached_tokens >= shared for o in rest[:-1])
        blocks = llm.engine.scheduler.block_manager
        assert blocks.num_free_blocks == blocks.num_blocks


def test_a_draft_model_reuses_its_own_cached_blocks(tiny_llama_dir, tiny_draft_dir, uncached):
    """The draft model's own KV cache caches prefixes too: requests behind a cached prefix feed the draft model
    only what follows it."""
    spec = {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 3}
    with LLM(str(tiny_llama_dir), max_model_len=256, speculative_config=spec, enable_prefix_caching=True) as llm:
        drafter = llm.engine.drafter
        fed = []
        forward = drafter._forward
        drafter._forward = lambda states, feeds: fed.append(sum(map(len, feeds))) or forward(states, feeds)
        llm.generate(CACHED_PROMPTS[:1], runs.greedy(16), use_tqdm=False)
        first = sum(fed)
        fed.clear()
        again = llm.generate(CACHED_PROMPTS[:1], runs.greedy(16), use_tqdm=False)
        assert runs.token_ids(again) == uncached[:1] and drafter.blocks.num_cached_blocks > 0
        assert sum(fed) < first - 48  # the prompt's cached blocks are not fed again
        assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks
        assert llm.reset_prefix_cache() and drafter.blocks.num_cached_blocks == 0  # its cache is forgotten too


def test_trees_moved_into_place_are_cached_after_their_move(tiny_llama_dir, uncached):
    """A tree's accepted path is moved into its committed slots in the next plan: those blocks are registered
    only then, so a request that finds them cached reads the moved K/V (outputs equal the uncached ones)."""
    spec = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "num_branches": 3, "adaptive": False}
    with LLM(str(tiny_llama_dir), max_model_len=256, speculative_config=spec, enable_prefix_caching=True,
             block_size=4) as llm:
        counter = llm.engine.executor = runs.PathCounter(llm.engine.executor)
        llm.engine.clock = counter.clock
        params = runs.greedy(16)
        done = llm.generate(CACHED_PROMPTS, params, use_tqdm=False)
        assert counter.moved > 0  # paths off the first nodes were accepted and moved
        prompts = [p + llm.get_tokenizer().decode(o.outputs[0].token_ids) for p, o in zip(CACHED_PROMPTS, done)]
        again = llm.generate(prompts, params, use_tqdm=False)  # the first run's whole outputs are cached now
        # some find blocks of the first run's output cached (the K/V its trees' paths moved into place)
        lengths = [len(llm.get_tokenizer().encode(p)) for p in CACHED_PROMPTS]
        assert any(o.num_cached_tokens > n for o, n in zip(again, lengths))
    with LLM(str(tiny_llama_dir), max_model_len=256, speculative_config=spec, block_size=4) as ref:
        assert runs.token_ids(again) == runs.token_ids(ref.generate(prompts, params, use_tqdm=False))
    assert runs.token_ids(done) == uncached


def test_penalties_and_seeded_sampling_equal_their_uncached_outputs(tiny_llama_dir):
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5,
                             frequency_penalty=0.5),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)]
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    outs = {}
    for cache in (False, True):
        with LLM(str(tiny_llama_dir), max_model_len=256, speculative_config=spec, enable_prefix_caching=cache) as llm:
            for p in params:
                llm.generate(CACHED_PROMPTS[:1], p, use_tqdm=False)
                outs[cache, p.seed] = runs.token_ids(llm.generate(CACHED_PROMPTS, p, use_tqdm=False))
            hits = llm.engine.scheduler.prefix_cache_hits
        assert (hits > 0) == cache
    assert outs[True, None] == outs[False, None]
    assert outs[True, 11] == outs[False, 11]


def test_preempted_requests_resume_from_their_cached_blocks(tiny_llama_dir, uncached):
    """A pool too small for the batch: requests are preempted and evicted under pressure, outputs unchanged and
    every block back."""
    with LLM(str(tiny_llama_dir), max_model_len=256, enable_prefix_caching=True, num_kv_blocks=14,
             max_num_seqs=6) as llm:
        outs = llm.generate(CACHED_PROMPTS, runs.greedy(16), use_tqdm=False)
        sched = llm.engine.scheduler
        assert sched.num_preemptions > 0 and sched.prefix_cache_hits > 0
        assert runs.token_ids(outs) == uncached
        assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
        assert llm.reset_prefix_cache() and sched.block_manager.num_cached_blocks == 0


class _FreshGroupAfterDeath:
    """The executor, until its next step: that step's rank dies, and the restarted group's KV cache is empty."""

    def __init__(self, inner):
        self.inner, self.died = inner, False

    def execute(self, plan, draft_probs=None):
        if not self.died:
            self.died = True
            raise WorkerDiedError("target rank 0 died (injected)")
        return self.inner.execute(plan, draft_probs)

    def restart(self):
        self.inner.restart()
        self.inner.collective_rpc(lambda w: [t.zero_() for t, _, _ in w.runner.kv_cache._groups])

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_restarted_worker_group_starts_with_no_cached_blocks(tiny_llama_dir, uncached):
    """The cached blocks' K/V lived on the group that died: a request after the restart computes its prompt again
    (reading the new group's empty cache as the old one's would give other tokens)."""
    with LLM(str(tiny_llama_dir), max_model_len=256, enable_prefix_caching=True) as llm:
        llm.generate(CACHED_PROMPTS[:1], runs.greedy(16), use_tqdm=False)
        llm.engine.executor = _FreshGroupAfterDeath(llm.engine.executor)
        with pytest.raises(WorkerDiedError):
            llm.generate(CACHED_PROMPTS[1:2], runs.greedy(16), use_tqdm=False)
        again = llm.generate(CACHED_PROMPTS[:1], runs.greedy(16), use_tqdm=False)
        assert again[0].num_cached_tokens == 0 and runs.token_ids(again) == uncached[:1]


def test_cache_salt_on_the_prompt_or_the_params_separates_tenants(tiny_llama_dir, uncached):
    with LLM(str(tiny_llama_dir), max_model_len=256, enable_prefix_caching=True) as llm:
        params = runs.greedy(16)
        llm.generate([{"prompt": CACHED_PROMPTS[0], "cache_salt": "a"}], params, use_tqdm=False)
        other = llm.generate([{"prompt": CACHED_PROMPTS[0], "cache_salt": "b"}, CACHED_PROMPTS[0]], params,
                             use_tqdm=False)
        same = llm.generate(CACHED_PROMPTS[0], SamplingParams(**{**params.__dict__, "cache_salt": "a"}),
                            use_tqdm=False)
        assert [o.num_cached_tokens for o in other] == [0, 0] and same[0].num_cached_tokens > 0
        assert runs.token_ids(other + same) == [uncached[0]] * 3
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_the_n_choices_of_a_prompt_compute_it_once(tiny_llama_dir):
    """n=4 choices (four engine requests of one prompt, admitted together): the first computes the prompt, the
    others start from its blocks; a seeded request's choices are unchanged by it."""
    params = SamplingParams(n=4, temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    outs = {}
    for cache in (False, True):
        with LLM(str(tiny_llama_dir), max_model_len=256, enable_prefix_caching=cache) as llm:
            outs[cache] = llm.generate(CACHED_PROMPTS[:2], params, use_tqdm=False)
    for on, off in zip(outs[True], outs[False]):
        assert [c.token_ids for c in on.outputs] == [c.token_ids for c in off.outputs]
    # the first prompt's first choice computed it; the second prompt waited for the shared system prompt's blocks
    assert outs[True][0].num_cached_tokens == 0 and outs[True][1].num_cached_tokens >= 64
    with LLM(str(tiny_llama_dir), max_model_len=256, enable_prefix_caching=True) as llm:
        llm.generate(CACHED_PROMPTS[0], params, use_tqdm=False)
        sched = llm.engine.scheduler
        n = len(llm.get_tokenizer().encode(CACHED_PROMPTS[0]))
        assert sched.prefix_cache_hits == 3 * ((n - 1) // 16 * 16)  # choices 1..3, whole blocks before the last token


def test_reset_without_caching_says_so(plain):
    assert plain.reset_prefix_cache() is False
