"""The n-gram drafter and its pool on hand-written histories: exact proposals, longest match first, no self
match, continuations that grow, keep-all/use-oldest choices, public vs private pools, rewinds, finish()."""

import pytest

from specray import SamplingParams, SpeculativeConfig
from specray.drafters import ngram
from specray.drafters.base import Drafter, DraftRequest, DrafterContext
from specray.drafters.ngram import NgramDrafter, NgramPool
from specray.drafters.registry import drafter_class

CTX = DrafterContext(target_model="x", vocab_size=100, max_model_len=4096, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0)


def make(**kw) -> NgramDrafter:
    kw.setdefault("num_speculative_tokens", 4)
    kw.setdefault("adaptive", False)
    return NgramDrafter(SpeculativeConfig(method="ngram", **kw), CTX)


@pytest.fixture
def pure_python(monkeypatch):
    """Private pools as NgramPools (the path without the C index), for the tests that read a pool's state; the
    proposals of both paths are compared in test_ngram_native.py."""
    monkeypatch.setattr(ngram, "NgramIndex", None)


def draft(drafter, history, k=4, req_id="r"):
    return drafter.propose([DraftRequest(req_id, history, k, GREEDY)])[0].token_ids


def test_registry_and_protocol():
    drafter = make()
    assert drafter_class("ngram") is NgramDrafter
    assert isinstance(drafter, Drafter)
    proposal = drafter.propose([DraftRequest("r", [1, 2, 3, 1, 2], 4, GREEDY)])[0]
    assert proposal.token_ids == [3, 1, 2] and proposal.probs is None


def test_longest_match_wins():
    # The 1-gram [3] was last followed by 7, the 2-gram [2, 3] by 4 5, the 3-gram [1, 2, 3] by 9 9.
    history = [1, 2, 3, 9, 9, 8, 2, 3, 4, 5, 6, 3, 7, 0, 1, 2, 3]
    assert draft(make(prompt_lookup_min=1, prompt_lookup_max=3), history) == [9, 9, 8, 2]
    assert draft(make(prompt_lookup_min=1, prompt_lookup_max=2), history) == [9, 9, 8, 2]  # oldest [2, 3]
    assert draft(make(prompt_lookup_min=1, prompt_lookup_max=1), history) == [9, 9, 8, 2]
    assert draft(make(prompt_lookup_min=1, prompt_lookup_max=3, is_use_oldest=False), history) == [9, 9, 8, 2]
    assert draft(make(prompt_lookup_min=1, prompt_lookup_max=2, is_use_oldest=False), history) == [4, 5, 6, 3]
    assert draft(make(prompt_lookup_min=1, prompt_lookup_max=1, is_use_oldest=False), history) == [7, 0, 1, 2]


def test_proposal_key_is_the_match_length():
    """Each proposal tells the length of the match it continues (the policy's evidence is kept per length)."""
    history = [1, 2, 3, 9, 9, 8, 2, 3, 4, 5, 6, 3, 7, 0, 1, 2, 3]
    drafter = make(prompt_lookup_min=1, prompt_lookup_max=3, is_use_oldest=False)
    assert drafter.cheap_proposals
    for max_n, tokens in ((3, [9, 9, 8, 2]), (2, [4, 5, 6, 3]), (1, [7, 0, 1, 2])):
        pool = make(prompt_lookup_min=1, prompt_lookup_max=max_n, is_use_oldest=False)
        proposal = pool.propose([DraftRequest("r", history, 4, GREEDY)])[0]
        assert (proposal.token_ids, proposal.key) == (tokens, max_n)
    assert drafter.propose([DraftRequest("s", [5, 6, 7], 4, GREEDY)])[0].key is None  # no match


def test_min_length_respected():
    history = [5, 6, 7, 8, 1, 9, 1]  # only the 1-gram [1] matches earlier
    assert draft(make(prompt_lookup_min=2, prompt_lookup_max=3), history) == []
    assert draft(make(prompt_lookup_min=1, prompt_lookup_max=3), history) == [9, 1]


def test_no_self_match():
    assert draft(make(prompt_lookup_min=1), [1, 2, 3, 4]) == []
    assert draft(make(prompt_lookup_min=2), [7, 7]) == []
    # Overlapping earlier occurrences are fine: [7, 7] occurred ending at index 2, followed by the last 7.
    assert draft(make(prompt_lookup_min=2), [7, 7, 7]) == [7]


def test_truncation_to_num_speculative_tokens():
    drafter = make(prompt_lookup_min=2, num_speculative_tokens=3)
    history = [1, 2, 10, 11, 12, 13, 14, 1, 2]
    assert draft(drafter, history, k=2) == [10, 11]
    assert draft(drafter, history, k=10) == [10, 11, 12]  # never more than num_speculative_tokens


def test_zero_draft_tokens_returns_empty_and_still_indexes(pure_python):
    drafter = make(prompt_lookup_min=2)
    history = [1, 2, 3, 4]
    assert draft(drafter, history, k=0) == []
    pool = drafter._requests["r"].pool
    assert pool.tokens(drafter._requests["r"].seq_key) == [1, 2, 3, 4]
    assert pool.lookup([1, 2]) == [3, 4]
    history += [9, 1, 2]
    assert draft(drafter, history) == [3, 4, 9, 1]


def test_continuation_extends_as_tokens_arrive():
    drafter = make(prompt_lookup_min=2, num_speculative_tokens=4)
    history = [1, 2, 3]
    assert draft(drafter, history) == []
    history.extend([1, 2])  # [1, 2] was followed only by 3 so far, then by 3 1 2
    assert draft(drafter, history) == [3, 1, 2]
    history.extend([5])
    assert draft(drafter, [8, 1, 2], req_id="other") == []  # private pools
    history.extend([6, 1, 2])  # the oldest [1, 2] now has 3 1 2 5 6 ... after it
    assert draft(drafter, history) == [3, 1, 2, 5]

    pool = NgramPool(2, 2, 4)
    pool.extend("a", [1, 2, 3])
    assert pool.lookup([1, 2]) == [3]
    pool.extend("a", [4, 5, 6])
    assert pool.lookup([1, 2]) == [3, 4, 5, 6]


# [1, 2] occurs three times: followed by 3 3, then by 4 4, then (last) by 5 before the suffix [1, 2].
TWO_WAYS = [1, 2, 3, 3, 0, 1, 2, 4, 4, 0, 1, 2, 5, 0, 1, 2]


@pytest.mark.parametrize("keep_all, use_oldest, expected", [
    (True, True, [3, 3, 0, 1]),  # every continuation kept, the oldest proposed
    (True, False, [5, 0, 1, 2]),  # every continuation kept, the newest proposed
    (False, True, [5, 0, 1, 2]),  # only the newest kept
    (False, False, [5, 0, 1, 2]),
])
def test_keep_all_and_use_oldest(keep_all, use_oldest, expected):
    drafter = make(prompt_lookup_min=2, prompt_lookup_max=2, is_keep_all=keep_all, is_use_oldest=use_oldest)
    assert draft(drafter, TWO_WAYS) == expected


def test_keep_all_false_holds_one_continuation_per_ngram():
    pool = NgramPool(2, 2, 4, is_keep_all=False)
    pool.extend("a", TWO_WAYS)
    assert pool.num_refs == pool.num_ngrams
    kept_all = NgramPool(2, 2, 4)
    kept_all.extend("a", TWO_WAYS)
    assert kept_all.num_refs == len(TWO_WAYS) - 2


def test_public_pool_shares_text_private_pools_do_not():
    for public in (True, False):
        drafter = make(prompt_lookup_min=2, is_public_pool=public)
        first = [10, 11]
        draft(drafter, first, req_id="a")
        first.extend([1, 2, 3, 4, 5])  # text only request "a" produced
        draft(drafter, first, req_id="a")
        second = [20, 21, 2, 3]
        assert draft(drafter, second, req_id="b") == ([4, 5] if public else [])
        drafter.finish(["a"])  # a finished request's text stays in the public pool
        assert draft(drafter, [30, 3, 4], req_id="c") == ([5] if public else [])


def test_public_pool_never_matches_own_suffix():
    drafter = make(prompt_lookup_min=1, is_public_pool=True)
    assert draft(drafter, [1, 2, 3], req_id="a") == []
    assert draft(drafter, [4, 2, 3], req_id="b") == []  # [2, 3] in "a" is followed by nothing yet
    assert draft(drafter, [1, 2, 3, 9], req_id="a") == []
    assert draft(drafter, [4, 2, 3], req_id="b") == [9]


def test_finish_frees_state():
    drafter = make(prompt_lookup_min=2)
    draft(drafter, [1, 2, 3, 1, 2], req_id="a")
    drafter.finish(["a", "unknown"])
    assert drafter._requests == {} and not drafter._indexes
    assert draft(drafter, [9, 1, 2], req_id="a") == []  # a new request "a" starts afresh

    shared = make(prompt_lookup_min=2, is_public_pool=True)
    draft(shared, [1, 2, 3], req_id="a")
    shared.finish(["a"])
    assert shared._requests == {} and shared.shared_pool.num_sequences == 1


def test_rewound_history_is_reindexed(pure_python):
    drafter = make(prompt_lookup_min=2, prompt_lookup_max=3)
    history = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert draft(drafter, history) == [3, 4, 5, 6]
    replaced = [1, 2, 9, 9, 1, 2]  # shorter, different tokens, a new list
    assert draft(drafter, replaced) == [9, 9, 1, 2]
    state = drafter._requests["r"]
    assert state.pool.tokens(state.seq_key) == replaced
    assert state.pool.lookup([3, 4]) == []  # the replaced text is gone
    fresh = NgramPool(2, 3, 4)
    fresh.extend("x", replaced)
    assert (state.pool.num_refs, state.pool.num_ngrams) == (fresh.num_refs, fresh.num_ngrams) == (7, 7)

    del history[2:]  # the same list rewound in place and grown past its old length
    history.extend([7, 7, 7, 7, 7, 7, 7, 7, 1, 2])
    assert draft(drafter, history) == [7, 7, 7, 7]
    assert state.pool.lookup([5, 6]) == []


def test_bounded_public_pool_evicts_oldest_and_frees_closed_text():
    pool = NgramPool(1, 2, 3, max_pool_entries=6)
    key = pool.publish([1, 2, 3, 4, 5])  # 4 positions x (1 + 2 grams, first position 1 gram) = 7 refs
    assert pool.num_refs == 6 and pool.lookup([1]) == [] and pool.lookup([2]) == [3, 4, 5]
    pool.publish([7, 8, 9, 10, 11, 12])  # 9 more refs: the first text's 6 go, then the oldest 3 of these
    assert pool.num_refs == 6
    assert key not in pool and pool.num_sequences == 1  # the closed first text is freed
    assert pool.lookup([2]) == [] and pool.lookup([7, 8]) == [] and pool.lookup([8]) == []
    assert pool.lookup([8, 9]) == [10, 11, 12] and pool.lookup([11]) == [12]


def test_snapshot_and_merge_ship_plain_data():
    import json

    source = NgramPool(2, 3, 4)
    source.publish([1, 2, 3, 4, 5])
    live = source.new_key()
    source.extend(live, [7, 8, 9])
    data = json.loads(json.dumps(source.snapshot()))  # plain data
    target = NgramPool(2, 3, 4, max_pool_entries=100)
    target.merge(data)
    assert target.lookup([1, 2]) == [3, 4, 5] and target.lookup([7, 8]) == [9]
    source.extend(live, [10, 11])
    target.merge(source.snapshot())  # the live sequence is brought up to date, not duplicated
    assert target.lookup([7, 8]) == [9, 10, 11] and target.num_sequences == 2
    with pytest.raises(ValueError, match="version"):
        target.merge({"version": 0, "sequences": []})


def test_trt_spelled_config_keys():
    spec = SpeculativeConfig(method="ngram", max_draft_len=2, max_matching_ngram_size=2, prompt_lookup_min=1)
    drafter = NgramDrafter(spec, CTX)
    history = [1, 2, 3, 4, 5, 0, 1, 2, 3]
    # max 2-gram [2, 3] -> 4 5; a 3-gram would be no different here, but 2 tokens is the draft cap.
    assert draft(drafter, history, k=8) == [4, 5]
    assert NgramDrafter(SpeculativeConfig(method="ngram", max_matching_ngram_size=1, prompt_lookup_min=1),
                        CTX).options.prompt_lookup_max == 1
    assert spec.num_speculative_tokens == 2 and "max_draft_len" not in spec.to_dict()  # input aliases only
    assert draft(NgramDrafter(SpeculativeConfig(method="ngram", max_matching_ngram_size=1, prompt_lookup_min=1),
                              CTX), [1, 5, 2, 9, 1, 6, 2]) == [9, 1, 6, 2]


def test_a_lookup_bound_given_alone_moves_the_other_default():
    """As vLLM: prompt_lookup_min above the default max (4) raises the max to it, rather than a refusal naming a
    max the user did not give; a max below the default min (2) lowers the min."""
    drafter = make(prompt_lookup_min=5)
    assert (drafter.options.prompt_lookup_min, drafter.options.prompt_lookup_max) == (5, 5)
    assert draft(drafter, [1, 2, 3, 4, 5, 9, 0, 2, 3, 4, 5]) == []  # a 4-gram match is shorter than min
    assert draft(drafter, [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5]) == [9, 1, 2, 3]
    assert make(prompt_lookup_max=1).options.prompt_lookup_min == 1
    assert make(prompt_lookup_min=3).options.prompt_lookup_max == 4
    with pytest.raises(ValueError, match="prompt_lookup_min=5 and prompt_lookup_max=4"):
        make(prompt_lookup_min=5, prompt_lookup_max=4)


def test_a_static_tree_is_drafted_whole_when_the_draft_count_is_not_given():
    """As the heads' speculative_token_tree: num_speculative_tokens left unset is the tree's node count (it was 5,
    which cut an 8-node tree to 5 nodes); given, it stays the cap."""
    from specray.drafters.registry import check

    tree = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0), (0, 0, 0, 0), (1, 0, 0, 0)]"
    history = [1, 2, 3, 10, 11, 12, 13, 14, 1, 2, 3, 20, 21, 22, 23, 24, 1, 2, 3]
    for given, nodes in ((None, 8), (5, 5)):
        spec = SpeculativeConfig.from_any({"method": "ngram", "speculative_token_tree": tree, "adaptive": False,
                                           **({} if given is None else {"num_speculative_tokens": given})})
        check(spec)
        assert spec.num_speculative_tokens == nodes
        proposal = NgramDrafter(spec, CTX).propose([DraftRequest("r", history, nodes, GREEDY)])[0]
        assert len(proposal.token_ids) == nodes and proposal.token_ids[:2] == [10, 20]


def test_bad_pool_settings():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramPool(3, 2, 4)
    with pytest.raises(ValueError, match="max_pool_entries=10 caps the public pool only"):
        make(max_pool_entries=10)  # a private pool would ignore it
    assert make(max_pool_entries=10, is_public_pool=True).shared_pool.max_pool_entries == 10
    with pytest.raises(ValueError, match="max_tree_refs=3 sizes token trees"):
        make(max_tree_refs=3)  # chains would ignore it
    assert make(max_tree_refs=3, num_branches=2).options.max_tree_refs == 3 and make().options.max_tree_refs == 32
    with pytest.raises(ValueError, match="max_pool_entries"):
        NgramPool(1, 2, 4, max_pool_entries=0)
    pool = NgramPool(1, 2, 4)
    pool.extend("a", [1, 2])
    with pytest.raises(ValueError, match="start=3"):
        pool.add("a", [1, 2, 3, 4], start=3)


def _naive(history, lo, hi, k, use_oldest):
    """The definition, by brute force: the oldest/newest earlier occurrence of the longest suffix n-gram."""
    for n in range(min(hi, len(history) - 1), lo - 1, -1):
        suffix = history[-n:]
        starts = [i for i in range(len(history) - n) if history[i:i + n] == suffix]
        if starts:
            i = (starts[0] if use_oldest else starts[-1]) + n
            return history[i:i + k]
    return []


@pytest.mark.parametrize("keep_all, use_oldest", [(True, True), (True, False), (False, False)])
def test_matches_brute_force_under_appends_and_rewinds(keep_all, use_oldest):
    """With is_keep_all=False a rewind forgets the older continuation its newest one replaced, so that case
    only appends."""
    import random

    rng = random.Random(0)
    drafter = make(prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens=5, is_keep_all=keep_all,
                   is_use_oldest=use_oldest)
    history = [rng.randrange(4) for _ in range(3)]
    for step in range(300):
        roll = rng.random() if keep_all else 1.0
        if roll < 0.05:
            history = history[: rng.randrange(1, len(history) + 1)] + [rng.randrange(4)]  # a new, rewound list
        elif roll < 0.1:
            del history[rng.randrange(1, len(history) + 1):]  # rewound in place
            history.extend(rng.randrange(4) for _ in range(rng.randrange(1, 6)))
        else:
            history.extend(rng.randrange(4) for _ in range(rng.randrange(0, 3)))
        k = rng.randrange(0, 7)
        expected = _naive(history, 1, 3, min(k, 5), use_oldest) if k else []
        assert draft(drafter, history, k=k) == expected, (step, history)


@pytest.mark.parametrize("keep_all", [True, False])
@pytest.mark.parametrize("lookup_min, lookup_max", [(1, 3), (2, 4), (3, 3)])
def test_bulk_indexing_builds_the_table_token_by_token_indexing_builds(keep_all, lookup_min, lookup_max):
    """A prompt is indexed n-major in one go (``_index_bulk``); the table, reference order included, must be
    the one that appending the same tokens a few at a time (position-major ``_index``) builds."""
    import random

    rng = random.Random(lookup_min * 10 + lookup_max)
    tokens = [rng.randrange(6) for _ in range(300)]
    bulk = NgramPool(lookup_min, lookup_max, 5, is_keep_all=keep_all)
    bulk.extend("s", tokens[:200])  # bulk
    bulk.extend("s", tokens[200:203])  # then a few at a time, as decoding does
    bulk.extend("s", tokens[203:])  # bulk again, from the middle of the text
    stepwise = NgramPool(lookup_min, lookup_max, 5, is_keep_all=keep_all)
    for i in range(0, len(tokens), 3):
        stepwise.extend("s", tokens[i:i + 3])
    assert bulk._table == stepwise._table and bulk.num_refs == stepwise.num_refs


@pytest.mark.parametrize("keep_all", [True, False])
def test_incremental_state_equals_indexing_the_whole_history(keep_all, pure_python):
    """The drafter indexes only what each step appends; under appends, in-place rewinds (a stop string), new
    list objects and skipped steps (a preempted request is not asked), its copy and table must equal those of a
    pool that indexes the whole current history at once."""
    import random

    rng = random.Random(1)
    drafter = make(prompt_lookup_min=1, prompt_lookup_max=3, is_keep_all=keep_all)
    history = [rng.randrange(5) for _ in range(40)]
    for step in range(400):
        roll = rng.random()
        if roll < 0.05 and keep_all:
            del history[rng.randrange(1, len(history) + 1):]  # rewound in place
        elif roll < 0.1 and keep_all:
            history = list(history[: rng.randrange(1, len(history) + 1)])  # a new list
        if rng.random() < 0.2:
            history.extend(rng.randrange(5) for _ in range(rng.randrange(1, 4)))
            continue  # not asked this step (preempted, or waiting): the next ask sees several new tokens
        history.extend(rng.randrange(5) for _ in range(rng.randrange(0, 3)))
        draft(drafter, history, k=rng.randrange(0, 5))
        state = drafter._requests["r"]
        whole = NgramPool(1, 3, 4, is_keep_all=keep_all)
        whole.extend("w", history)
        assert state.pool.tokens(state.seq_key) == history, step
        assert state.pool._table == whole._table and state.pool.num_refs == whole.num_refs, step
