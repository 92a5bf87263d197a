"""llama.cpp's n-gram family: ngram_simple, ngram_map_k, ngram_map_k4v, ngram_mod, ngram_cache.

Worked examples derived by hand from the documented algorithms (each drafter's module docstring), incremental
state equal to a rebuild on random histories with rewinds, draft counts and trees, min-hits gating, the shared
constant-memory pool, the static cache file, options validation and llama.cpp-style statistics."""

import random

import pytest

from specray import SamplingParams, SpeculativeConfig
from specray.drafters import ngram_common
from specray.drafters.base import Drafter, DraftRequest, DrafterContext
from specray.drafters.ngram_cache import (NgramCacheDrafter, add_counts, build_static_cache, load_static_cache,
                                          save_static_cache)
from specray.drafters.ngram_map import KeyStats, NgramMapK4vDrafter, NgramMapKDrafter
from specray.drafters.ngram_mod import EMPTY, LCG_MULT, NgramModDrafter, ngram_hash
from specray.drafters.ngram_simple import NgramSimpleDrafter
from specray.drafters.registry import check, drafter_class, options_of
from specray.tree import check_parents

CTX = DrafterContext(target_model="x", vocab_size=100, max_model_len=4096, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0)
METHODS = ["ngram_simple", "ngram_map_k", "ngram_map_k4v", "ngram_mod", "ngram_cache"]
# small sizes so hand-made histories exercise every method
SMALL = {
    "ngram_simple": dict(ngram_size_n=2, ngram_size_m=3),
    "ngram_map_k": dict(ngram_size_n=2, ngram_size_m=2),
    "ngram_map_k4v": dict(ngram_size_n=2, ngram_size_m=2),
    "ngram_mod": dict(ngram_size_n=2, draft_min=1, draft_max=8, pool_size=1 << 12, reset_occupancy=0,
                      reset_low_streak=0),
    "ngram_cache": {},
}


def make(method, k=8, **options):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, adaptive=False, **{**SMALL[method], **options})
    return drafter_class(method)(spec, CTX)


def ask(drafter, history, k=8, req_id="r"):
    return drafter.propose([DraftRequest(req_id, history, k, GREEDY)])[0]


def draft(drafter, history, k=8, req_id="r"):
    return ask(drafter, history, k, req_id).token_ids


# ---------------------------------------------------------------------------------------------- registry


@pytest.mark.parametrize("method, cls", [("ngram_simple", NgramSimpleDrafter), ("ngram_map_k", NgramMapKDrafter),
                                         ("ngram_map_k4v", NgramMapK4vDrafter), ("ngram_mod", NgramModDrafter),
                                         ("ngram_cache", NgramCacheDrafter)])
def test_registry_and_protocol(method, cls):
    drafter = make(method)
    assert drafter_class(method) is cls and isinstance(drafter, Drafter) and drafter.cheap_proposals
    proposal = ask(drafter, [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3])
    assert proposal.token_ids and proposal.probs is None
    assert drafter.stats()["name"] == method


def test_llama_cpp_defaults():
    spec = lambda m: SpeculativeConfig(method=m)  # noqa: E731
    assert vars(options_of(spec("ngram_simple"))) == dict(ngram_size_n=12, ngram_size_m=48, check_rate=1)
    assert vars(options_of(spec("ngram_map_k"))) == dict(ngram_size_n=12, ngram_size_m=48, min_hits=1, check_rate=1)
    assert options_of(spec("ngram_map_k4v")).tree is True
    mod = options_of(spec("ngram_mod"))
    assert (mod.ngram_size_n, mod.draft_min, mod.draft_max, mod.pool_size) == (24, 48, 64, 4 << 20)
    assert (mod.reset_occupancy, mod.reset_low_streak) == (0.25, 0)  # the streak reset is opt-in (module doc)
    # one of draft_min / draft_max given alone moves the other's default (not a refusal naming a value not given)
    assert options_of(SpeculativeConfig(method="ngram_mod", draft_max=16)).draft_min == 16
    assert options_of(SpeculativeConfig(method="ngram_mod", draft_min=100)).draft_max == 100
    assert options_of(spec("ngram_cache")).static_cache_path is None
    assert options_of(spec("ngram_cache")).max_dynamic_ngrams == 1 << 20


# ---------------------------------------------------------------------------------------------- ngram_simple

# index:  0  1  2  3  4  5  6  7  8  9 10 11 12
H13 = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3]


def test_simple_worked_examples():
    # n=2: the current 2-gram (2, 3) occurred at 1 and 6, each followed by a token; the last one (6) wins and
    # its m=3 followers are tokens 8..10 = 4 6 1. The match extends back over 1 2 3 (tokens 5..7 vs 10..12),
    # and no further (token 4 = 5, token 9 = 6): key 3.
    proposal = ask(make("ngram_simple"), H13)
    assert (proposal.token_ids, proposal.key, proposal.parents) == ([4, 6, 1], 3, None)
    # n=3: (1, 2, 3) occurred at 0 and 5; m=2 after 5: tokens 8, 9.
    assert draft(make("ngram_simple", ngram_size_n=3, ngram_size_m=2), H13) == [4, 6]
    assert draft(make("ngram_simple"), H13, k=1) == [4]  # at most the draft count asked for
    assert draft(make("ngram_simple", k=2), H13, k=5) == [4, 6]  # ... and never more than num_speculative_tokens
    # (7, 8) occurred at 0, followed by 7 8 only (the continuation runs into the current n-gram).
    assert draft(make("ngram_simple"), [7, 8, 7, 8]) == [7, 8]
    assert draft(make("ngram_simple"), [1, 2, 3, 2, 4]) == []  # (2, 4) never occurred before
    assert draft(make("ngram_simple"), [5, 5]) == []  # the current n-gram itself is no match


def test_simple_check_rate():
    drafter = make("ngram_simple", check_rate=3)
    history = list(H13)
    assert draft(drafter, history) == [4, 6, 1]  # 13 tokens: a lookup (last check 13)
    history += [4, 6]
    assert draft(drafter, history[:14]) == []  # 14 < 13 + 3: skipped
    assert draft(drafter, history[:15]) == []  # 15: skipped
    history += [1, 2, 3]
    assert draft(drafter, history[:16]) != []  # 16 >= 13 + 3: a lookup (last check 16)
    assert draft(drafter, history[:17]) == []
    assert draft(drafter, H13) == [4, 6, 1]  # shorter than at the last check: a lookup


# ---------------------------------------------------------------------------------------------- ngram_map

# index:   0  1  2  3  4  5  6  7  8  9 10 11 12 13 14
THREE = [1, 2, 7, 7, 1, 2, 8, 8, 1, 2, 7, 7, 5, 1, 2]
# Key (1, 2) with n=2, m=2: complete occurrences at 0 (value 7 7), 4 (8 8), 8 (7 7); the one at 13 is the
# current key (no value after it). hits = 3; values: (7, 7) x 2, (8, 8) x 1.


def test_map_k_worked_example_and_min_hits():
    proposal = ask(make("ngram_map_k"), THREE)
    assert (proposal.token_ids, proposal.key) == ([7, 7], 3)  # the value after the most recent occurrence (8)
    assert draft(make("ngram_map_k", min_hits=3), THREE) == [7, 7]
    assert draft(make("ngram_map_k", min_hits=4), THREE) == []  # only 3 occurrences
    # Cut before the 3rd occurrence's value is complete: THREE[:11] holds occurrences 0 and 4 only (8 + 4 > 11)
    # and the current key is (2, 7), never complete before: nothing. THREE[:10] ends with key (1, 2): 0 and 4.
    assert draft(make("ngram_map_k"), THREE[:10]) == [8, 8]
    assert draft(make("ngram_map_k", min_hits=3), THREE[:10]) == []
    # An occurrence whose value is not complete yet does not count: in 5 1 1 1 the key (1, 1) at 1 needs
    # tokens 3 and 4 (ngram_simple drafts from it: 1). One more 1 completes it: value 1 1.
    assert draft(make("ngram_map_k"), [5, 1, 1, 1]) == []
    assert draft(make("ngram_simple"), [5, 1, 1, 1]) == [1]
    assert draft(make("ngram_map_k"), [5, 1, 1, 1, 1]) == [1, 1]


def test_map_k4v_worked_example_chain_rule():
    # tree=False, llama.cpp's rule: best (7, 7) x 2 >= 2 x the others (1): drafted.
    proposal = ask(make("ngram_map_k4v", tree=False), THREE)
    assert (proposal.token_ids, proposal.parents, proposal.key) == ([7, 7], None, 2)
    # One (7, 7) and one (8, 8): 1 < 2 x 1, no dominant value: nothing.
    tie = [1, 2, 7, 7, 1, 2, 8, 8, 5, 1, 2]
    assert draft(make("ngram_map_k4v", tree=False), tie) == []
    assert draft(make("ngram_map_k4v", tree=False, min_hits=3), THREE) == [7, 7]
    assert draft(make("ngram_map_k4v", tree=False, min_hits=4), THREE) == []


def test_map_k4v_worked_example_tree():
    # The trie of (7, 7) x 2 and (8, 8) x 1: 7 (2 of 3) -> 7 (2 of 2); 8 (1 of 3) -> 8 (1 of 1). Best first by
    # the share of all occurrences through a node: 7 (2/3), 7-7 (2/3), 8 (1/3), 8-8 (1/3).
    proposal = ask(make("ngram_map_k4v"), THREE, k=4)
    assert proposal.token_ids == [7, 7, 8, 8] and proposal.parents == [-1, 0, -1, 2]
    assert proposal.scores == pytest.approx([2 / 3, 1.0, 1 / 3, 1.0]) and proposal.key == 2
    cut = ask(make("ngram_map_k4v"), THREE, k=3)
    assert (cut.token_ids, cut.parents) == ([7, 7, 8], [-1, 0, -1])  # the best 3 nodes, still a tree
    # No dominant value: still a tree (ties go to the value seen first): 7, 8, 7-7, 8-8.
    tie = ask(make("ngram_map_k4v"), [1, 2, 7, 7, 1, 2, 8, 8, 5, 1, 2], k=4)
    assert (tie.token_ids, tie.parents) == ([7, 8, 7, 8], [-1, -1, 0, 1])


def test_map_k4v_counts_four_values_only():
    # n=1, m=1: key (9,) is followed by 1, 2, 3, 4, 5, 5: six hits, four value slots (1, 2, 3, 4 once each);
    # 5 came after the slots were full and is not counted.
    history = [9, 1, 9, 2, 9, 3, 9, 4, 9, 5, 9, 5, 9]
    k4v = make("ngram_map_k4v", ngram_size_n=1, ngram_size_m=1)
    proposal = ask(k4v, history)
    assert k4v._states["r"].keys[(9,)] == _key_stats([0, 2, 4, 6, 8, 10], [[(1,), 1], [(2,), 1], [(3,), 1], [(4,), 1]])
    assert (proposal.token_ids, proposal.parents) == ([1, 2, 3, 4], [-1, -1, -1, -1])
    assert proposal.scores == pytest.approx([0.25] * 4)
    assert draft(make("ngram_map_k", ngram_size_n=1, ngram_size_m=1), history) == [5]  # map-k: the last one
    assert draft(make("ngram_map_k4v", ngram_size_n=1, ngram_size_m=1, min_hits=7), history) == []


def _key_stats(starts, values):
    stats = KeyStats()
    stats.starts, stats.values = starts, values
    return stats


def test_map_stored_acceptance_caps_the_next_draft():
    # n=2, m=3: (1, 2) at 0 has value 3 4 5. The target keeps 3 and then says 9: 1 token of the value followed.
    drafter = make("ngram_map_k", ngram_size_m=3)
    history = [1, 2, 3, 4, 5, 1, 2]
    assert draft(drafter, history) == [3, 4, 5]
    history += [3, 9, 1, 2]  # (1, 2) again; its newest complete occurrence (5) has value 3 9 1
    assert draft(drafter, history) == [3]  # capped at the 1 token followed last time
    assert draft(make("ngram_map_k", ngram_size_m=3), history) == [3, 9, 1]  # a fresh drafter: no cap
    history += [3, 9, 5, 1, 2]  # 3 kept, then the target's 9 also matches the value: 2 followed, cap 2
    assert draft(drafter, history) == [3, 9]
    # k4v stores it per key and value: the tree's (3, 4, 5) branch is cut to what was followed.
    k4v = make("ngram_map_k4v", ngram_size_m=3)
    history = [1, 2, 3, 4, 5, 1, 2]
    assert draft(k4v, history) == [3, 4, 5]
    history += [3, 4, 0, 1, 2]  # 3 4 followed: cap 2 for ((1, 2), (3, 4, 5)); new value (3, 4, 0) uncapped
    proposal = ask(k4v, history)
    assert (proposal.token_ids, proposal.parents) == ([3, 4, 0], [-1, 0, 1])  # 3 4 shared; 5 cut, 0 kept


# ---------------------------------------------------------------------------------------------- ngram_mod


def test_mod_hash_is_llama_cpps_and_rolls():
    assert ngram_hash([3, 5]) == (3 * LCG_MULT + 5) % 2**64
    assert ngram_hash([3, 5, 7]) == ((3 * LCG_MULT + 5) * LCG_MULT + 7) % 2**64
    pool = make("ngram_mod", ngram_size_n=3).pool
    assert pool.roll(ngram_hash([9, 3, 5]), 9, 7) == ngram_hash([3, 5, 7])


def test_mod_worked_example():
    # n=2. The pool learns (1,2)->3, (2,3)->1, (3,1)->2, (1,2)->4 (overwrites), (2,4)->1, (4,1)->2. From the
    # last 2-gram (1, 2): 4, then (2, 4) -> 1, (4, 1) -> 2, (1, 2) -> 4, ... up to min(draft_max, k).
    history = [1, 2, 3, 1, 2, 4, 1, 2]
    assert draft(make("ngram_mod", draft_max=5), history) == [4, 1, 2, 4, 1]
    assert draft(make("ngram_mod"), history, k=3) == [4, 1, 2]
    assert ask(make("ngram_mod"), history).key is None
    assert draft(make("ngram_mod"), [1]) == []  # shorter than n


def test_mod_pool_is_shared_and_chains_break_at_draft_min():
    # Request a's text teaches (1,2)->3, (2,3)->4; request b = 8 1 2 follows it: 3, 4, then (3, 4) is EMPTY.
    for draft_min, expected in ((1, [3, 4]), (2, [3, 4]), (3, [])):
        drafter = make("ngram_mod", draft_min=draft_min)
        assert draft(drafter, [1, 2, 3, 4], req_id="a", k=0) == []
        assert draft(drafter, [8, 1, 2], req_id="b") == expected
    drafter = make("ngram_mod")
    draft(drafter, [1, 2, 3, 4], req_id="a", k=0)
    drafter.finish(["a"])  # a finished request's text stays in the pool
    assert draft(drafter, [8, 1, 2], req_id="b") == [3, 4]


def test_mod_memory_is_constant():
    drafter = make("ngram_mod", pool_size=1 << 10)
    pool, table_bytes = drafter.pool, drafter.pool.size_bytes
    assert table_bytes == 4 << 10
    rng = random.Random(0)
    for i in range(30):
        history = [rng.randrange(50) for _ in range(200)]
        draft(drafter, history, req_id=f"q{i}")
        drafter.finish([f"q{i}"])
    assert drafter.pool is pool and len(pool.table) == 1 << 10 and pool.size_bytes == table_bytes
    assert 0 < pool.used <= pool.size and drafter._states == {}
    assert drafter.stats()["pool_bytes"] == table_bytes


def test_mod_occupancy_reset_on_a_new_request():
    drafter = make("ngram_mod", pool_size=16, reset_occupancy=0.25)
    draft(drafter, [1, 2, 3, 4, 5, 6, 7, 8], req_id="a", k=0)  # 6 slots at most of 16 (> 4): over the threshold
    assert drafter.pool.used > 4
    draft(drafter, [9, 1, 2], req_id="b", k=0)  # a new request: the pool is cleared, then b's text goes in
    assert drafter.pool.used == 1 and drafter.pool.get(ngram_hash([9, 1])) == 2
    draft(drafter, [9, 1, 2, 3], req_id="b", k=0)  # b is not new: no reset
    assert drafter.pool.used == 2


def test_mod_low_acceptance_streak_resets_the_pool():
    drafter = make("ngram_mod", reset_low_streak=2)
    pool = drafter.pool
    draft(drafter, [1, 2, 3, 4, 5, 6, 7], req_id="a", k=0)
    b = [9, 1, 2]
    assert draft(drafter, b, req_id="b", k=4) == [3, 4, 5, 6]
    b += [0]  # the target kept none of 3 4 5 6: a poor draft (1 in a row); (2, 0) is unknown
    assert draft(drafter, b, req_id="b") == []
    b += [3, 4]
    assert draft(drafter, b, req_id="b") == [5, 6, 7]  # still a's text: no reset after one poor draft
    b += [0]  # 2 in a row: the pool is cleared and b's history goes back in
    draft(drafter, b, req_id="b", k=0)
    assert pool.get(ngram_hash([5, 6])) == EMPTY  # a's text is gone
    assert pool.get(ngram_hash([9, 1])) == 2 and pool.get(ngram_hash([4, 0])) == EMPTY
    assert pool.get(ngram_hash([3, 4])) == 0  # b's own text: 3 4 was followed by 0


# ---------------------------------------------------------------------------------------------- ngram_cache


def test_cache_context_worked_examples():
    # 5 1 2 3 9 5 1 2: the 3-gram (5, 1, 2) was followed once by 3; a 3-gram needs 1 sample and 50%: 3. Then the
    # 4-grams (5,1,2,3) -> 9 and (1,2,3,9) -> 5, each seen once (4-grams: 1 sample, 50%).
    proposal = ask(make("ngram_cache"), [5, 1, 2, 3, 9, 5, 1, 2], k=3)
    assert (proposal.token_ids, proposal.key, proposal.scores) == ([3, 9, 5], 3, [1.0, 1.0, 1.0])
    # 1 2 3 1 2: (1, 2) -> 3 once, but a 2-gram needs 2 samples; (2,) -> 3 once, a 1-gram needs 2: nothing.
    assert draft(make("ngram_cache"), [1, 2, 3, 1, 2]) == []
    # 7 1 7 1 7 2 7: only the 1-gram (7,) is known: 1 x 2, 2 x 1; 2 of 3 = 67% >= 66%: 1. Then (7, 1) -> 7
    # twice: 7.
    proposal = ask(make("ngram_cache"), [7, 1, 7, 1, 7, 2, 7], k=2)
    assert proposal.token_ids == [1, 7] and proposal.key == 1
    assert proposal.scores == pytest.approx([2 / 3, 1.0])
    # 7 1 7 2 7: (7,) -> 1 once, 2 once: 50% < 66%: nothing.
    assert draft(make("ngram_cache"), [7, 1, 7, 2, 7]) == []


def test_cache_dynamic_learns_from_finished_requests_strictly():
    # a = 4 5 6 x 3 gives the dynamic table (4, 5) -> 6 x 3 (a 2-gram needs 3 samples and 66%), then
    # (4, 5, 6) -> 4 x 2 (3-gram: 2 samples), (4, 5, 6, 4) -> 5 x 2 (4-gram: 2 samples).
    for use_dynamic, expected in ((True, [6, 4, 5]), (False, [])):
        drafter = make("ngram_cache", use_dynamic_cache=use_dynamic)
        assert draft(drafter, [4, 5], req_id="b", k=3) == []
        draft(drafter, [4, 5, 6] * 3, req_id="a", k=0)
        assert draft(drafter, [4, 5], req_id="b", k=3) == []  # a has not finished yet
        drafter.finish(["a"])
        assert draft(drafter, [4, 5], req_id="b", k=3) == expected
    # twice 4 5 6 is not enough for the strict thresholds: (4, 5) -> 6 x 2 < 3, (5,) -> 6 x 2 < 4
    drafter = make("ngram_cache")
    draft(drafter, [4, 5, 6] * 2, req_id="a", k=0)
    drafter.finish(["a"])
    assert draft(drafter, [4, 5], req_id="b") == []


def test_cache_preempted_request_is_merged_once():
    drafter = make("ngram_cache")
    history = [1, 2, 3, 1, 2, 4]
    draft(drafter, history, req_id="a")
    drafter.finish(["a"])  # preempted: merged
    history += [1, 2, 3]
    draft(drafter, history, req_id="a")  # back with the same id, its whole history
    drafter.finish(["a"])  # finished: only what it added since goes in
    expected = {}
    add_counts(expected, history, 0, range(1, 5))
    assert dict(drafter.dynamic) == expected
    draft(drafter, [9, 9], req_id="a")  # another request under the same id: all of it goes in
    drafter.finish(["a"])
    add_counts(expected, [9, 9], 0, range(1, 5))
    assert dict(drafter.dynamic) == expected


def test_cache_dynamic_is_bounded():
    drafter = make("ngram_cache", max_dynamic_ngrams=10)
    draft(drafter, list(range(20)), req_id="a", k=0)
    drafter.finish(["a"])
    assert len(drafter.dynamic) == 10 and (19,) not in drafter.dynamic and (18,) in drafter.dynamic


def test_static_cache_file_round_trip_and_drafts(tmp_path):
    counts = build_static_cache([[1, 2, 3], [1, 2, 3, 4], [5, 1, 2]])
    assert counts == {(1, 2): {3: 2}, (2, 3): {4: 1}, (5, 1): {2: 1}}
    path = tmp_path / "static.bin"
    save_static_cache(counts, path)
    assert path.stat().st_size == 20 + 4 * (3 * 3 + 2 * 3)  # the documented size
    assert load_static_cache(path) == (2, counts)
    # 8 1 2: nothing in the context; the static (1, 2) -> 3 x 2 (2 samples, 100%): 3; then (2, 3) -> 4 once,
    # fewer than 2 samples: stop.
    with_static = make("ngram_cache", static_cache_path=str(path))
    proposal = ask(with_static, [8, 1, 2])
    assert (proposal.token_ids, proposal.key) == ([3], 2)
    assert draft(make("ngram_cache"), [8, 1, 2]) == []
    assert with_static.stats()["static_ngrams"] == 3


def test_static_cache_weighs_the_context_candidates(tmp_path):
    # (1, 2, 3) was followed by 6 once and by 7 once. Alone the first seen wins (6); the static table's
    # (2, 3) -> 7 x 5 makes 7 weigh 1 x 500 against 6's 1 x 1.
    history = [1, 2, 3, 6, 1, 2, 3, 7, 1, 2, 3]
    assert draft(make("ngram_cache"), history, k=1) == [6]
    path = tmp_path / "static.bin"
    save_static_cache({(2, 3): {7: 5}}, path)
    assert draft(make("ngram_cache", static_cache_path=str(path)), history, k=1) == [7]


def test_static_cache_missing_or_corrupt_file(tmp_path):
    missing = tmp_path / "nope.bin"
    with pytest.raises(ValueError, match="static_cache_path=.*nope.bin.*cannot be read"):
        make("ngram_cache", static_cache_path=str(missing))
    good = tmp_path / "good.bin"
    save_static_cache({(1, 2): {3: 2, 4: 1}}, good)
    data = good.read_bytes()
    for name, content, problem in [("magic.bin", b"XXXXXXXX" + data[8:], "does not start with"),
                                   ("short.bin", data[:-4], "header promises"),
                                   ("tiny.bin", data[:10], "shorter than"),
                                   ("count.bin", data[:-4] + (0).to_bytes(4, "little"), "non-positive")]:
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=f"{name}.*corrupt: .*{problem}"):
            load_static_cache(bad)
    with pytest.raises(ValueError, match="one size"):
        save_static_cache({(1,): {2: 1}, (1, 2): {3: 1}}, tmp_path / "mixed.bin")


# ---------------------------------------------------------------------------------------------- all methods


def _evolve(rng, steps=40, vocab=4):
    """Histories of one request: appends in place, in-place rewinds (del + new tokens), new lists."""
    history = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
    for _ in range(steps):
        op = rng.random()
        if op < 0.6:
            history.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 5)))
        elif op < 0.8:
            del history[rng.randrange(len(history) + 1):]
            history.extend(rng.randrange(vocab) for _ in range(rng.randrange(0, 6)))
        else:
            history = list(history)
            if history:
                history[rng.randrange(len(history))] = rng.randrange(vocab)
        yield history


def _index(method, state):
    return {"ngram_simple": lambda: state.starts, "ngram_map_k": lambda: state.keys,
            "ngram_map_k4v": lambda: state.keys, "ngram_cache": lambda: state.counts,
            "ngram_mod": lambda: state.h}[method]()


@pytest.mark.parametrize("method", METHODS)
def test_incremental_state_equals_a_rebuild(method):
    rng = random.Random(hash(method) % 1000)
    for trial in range(4):
        drafter = make(method, ngram_size_m=3) if "map" in method else make(method)
        for history in _evolve(rng):
            draft(drafter, history, k=rng.randrange(0, 6))
            fresh = make(method, ngram_size_m=3) if "map" in method else make(method)
            draft(fresh, list(history), k=0)
            state, rebuilt = drafter._states["r"], fresh._states["r"]
            assert state.tokens == list(history)
            assert _index(method, state) == _index(method, rebuilt), (trial, history)


@pytest.mark.parametrize("method", ["ngram_simple", "ngram_map_k", "ngram_map_k4v", "ngram_cache"])
def test_proposals_after_rewinds_equal_a_fresh_drafters(method):
    # m=1 for the maps: a stored acceptance (>= 1 token) then never shortens a value
    options = {"ngram_size_m": 1} if "map" in method else {}
    rng = random.Random(7)
    drafter = make(method, **options)
    proposed = 0
    for history in _evolve(rng, steps=150):
        got = ask(drafter, history, k=5)
        want = ask(make(method, **options), list(history), k=5)
        assert (got.token_ids, got.parents, got.key) == (want.token_ids, want.parents, want.key), history
        proposed += bool(got.token_ids)
    assert proposed > 20


def test_mod_incremental_pool_equals_a_rebuild_on_appends():
    rng = random.Random(3)
    drafter = make("ngram_mod", ngram_size_n=3)
    history = [rng.randrange(6) for _ in range(5)]
    for _ in range(60):
        history += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        got = draft(drafter, history, k=5)
        fresh = make("ngram_mod", ngram_size_n=3)
        assert got == draft(fresh, list(history), k=5)
        assert fresh.pool.table == drafter.pool.table and fresh.pool.used == drafter.pool.used
        assert drafter._states["r"].h == ngram_hash(history[-3:])


@pytest.mark.parametrize("method", METHODS)
def test_draft_count_and_trees(method):
    rng = random.Random(11)
    drafter = make(method, k=6, **({"ngram_size_m": 8} if method in ("ngram_simple", "ngram_map_k") else {}))
    sizes = set()
    for history in _evolve(rng, steps=150, vocab=3):
        k = rng.randrange(0, 9)
        proposal = ask(drafter, history, k=k)
        tree = proposal.tree()
        assert len(tree) <= min(k, 6)
        check_parents(tree.parents)
        assert proposal.scores is None or len(proposal.scores) == len(tree)
        if method != "ngram_map_k4v":
            assert proposal.parents is None  # chains
        sizes.add(len(tree))
    assert max(sizes) == 6  # drafts do reach the limit


@pytest.mark.parametrize("method", METHODS)
def test_appends_never_rescan_the_history(method, monkeypatch):
    calls = []
    real = ngram_common.common_prefix
    monkeypatch.setattr(ngram_common, "common_prefix", lambda a, b: calls.append(len(b)) or real(a, b))
    drafter = make(method)
    history = [1, 2, 3] * 100
    draft(drafter, history)
    calls.clear()
    for token in [1, 2, 3] * 20:  # the engine's list, appended in place
        history.append(token)
        draft(drafter, history)
    assert calls == []
    del history[-5:]  # rewound in place: found by the tail check, then one full compare
    history += [9, 9, 9, 9, 9, 9]
    draft(drafter, history)
    assert len(calls) == 1
    assert drafter._states["r"].tokens == history


@pytest.mark.parametrize("method", METHODS)
def test_finish_forgets_and_a_preempted_request_comes_back(method):
    drafter = make(method)
    history = list(H13)
    first = draft(drafter, history)
    drafter.finish(["r", "unknown"])
    assert drafter._states == {}
    assert drafter.stats()["calls"] == 1
    assert draft(drafter, history) == first  # back with the same id: indexed afresh
    assert drafter._states["r"].tokens == history


@pytest.mark.parametrize("method, options, message", [
    ("ngram_simple", {"ngram_size_n": 0}, r"ngram_size_n=0 must be an int >= 1 for method='ngram_simple'"),
    ("ngram_simple", {"ngram_size_m": 2.5}, r"ngram_size_m=2.5 must be an int >= 1"),
    ("ngram_simple", {"prompt_lookup_max": 3}, r"prompt_lookup_max"),
    ("ngram_map_k", {"min_hits": 0}, r"min_hits=0 must be an int >= 1 .*--spec-ngram-min-hits"),
    ("ngram_map_k", {"check_rate": True}, r"check_rate=True must be an int >= 1"),
    ("ngram_map_k", {"tree": True}, r"tree"),
    ("ngram_map_k4v", {"tree": "yes"}, r"tree='yes' must be true or false"),
    ("ngram_mod", {"draft_min": 10, "draft_max": 5}, r"draft_min=10 and draft_max=5 must satisfy"),
    ("ngram_mod", {"pool_size": 0}, r"pool_size=0 must be an int in \[1, 2147483648\]"),
    ("ngram_mod", {"reset_occupancy": 1.5}, r"reset_occupancy=1.5 must be a number in \[0, 1\]"),
    ("ngram_mod", {"ngram_size_n": 2000}, r"ngram_size_n=2000 must be an int in \[1, 1024\]"),
    ("ngram_cache", {"static_cache_path": 5}, r"static_cache_path=5 must be the path"),
    ("ngram_cache", {"max_dynamic_ngrams": 0}, r"max_dynamic_ngrams=0 must be an int >= 1"),
    ("ngram_cache", {"max_dynamic_ngrams": 5, "use_dynamic_cache": False}, r"max_dynamic_ngrams=5 bounds the dynamic"),
])
def test_options_validation(method, options, message):
    with pytest.raises(ValueError, match=message):
        check(SpeculativeConfig(method=method, **options))


def test_statistics_count_llama_cpp_style():
    drafter = make("ngram_simple")
    history = [1, 2, 3, 4, 1, 2]
    assert draft(drafter, history, k=3) == [3, 4, 1]  # call 1: a draft of 3
    history += [3, 4, 9]  # the target kept 3 4, then said 9: the engine tells the drafter
    drafter.observe_verification("r", 3, 2)
    assert draft(drafter, history, k=3) == []  # call 2: (4, 9) unknown
    history += [1, 2]
    assert draft(drafter, history, k=0) == []  # call 3: no draft asked for
    assert draft(drafter, history, k=2) == [3, 4]  # call 4: (1, 2) last at 4, followed by 3 4 9
    history += [5]  # none kept
    drafter.observe_verification("r", 2, 0)
    draft(drafter, history, k=2)
    stats = drafter.stats()
    assert {k: stats[k] for k in ("calls", "gen_drafts", "acc_drafts", "gen_tokens", "acc_tokens")} == \
        dict(calls=5, gen_drafts=2, acc_drafts=1, gen_tokens=5, acc_tokens=2)
    assert stats["dur_gen_ms"] > 0 and stats["dur_begin_ms"] > 0 and stats["dur_acc_ms"] > 0
    # a tree's nodes all count as generated tokens
    k4v = make("ngram_map_k4v")
    ask(k4v, THREE, k=4)
    assert (k4v.stats()["gen_drafts"], k4v.stats()["gen_tokens"]) == (1, 4)
