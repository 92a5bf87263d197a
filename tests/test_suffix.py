"""The suffix-decoding drafter: its trie's counts against a brute-force count (built at once, token by token,
rewound, evicted), its proposal trees (shape, probabilities, budget), the global trie across requests, a request
that comes back, options and aliases, statistics."""

import random

import pytest

from specray import SamplingParams, SpeculativeConfig
from specray.drafters.base import Drafter, DraftRequest, DrafterContext
from specray.drafters.registry import drafter_class, options_of
from specray.drafters.suffix import _UNDO_WINDOW, SuffixCache, SuffixDrafter, SuffixTrie
from specray.tree import check_parents, path_scores, path_to

CTX = DrafterContext(target_model="x", vocab_size=5000, max_model_len=4096, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0)


def brute_counts(seqs, depth):
    """Every substring of at most ``depth`` tokens of every sequence -> how often it occurs."""
    out = {}
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                key = tuple(seq[i:j])
                out[key] = out.get(key, 0) + 1
    return out


def make(**kw) -> SuffixDrafter:
    kw.setdefault("num_speculative_tokens", 5)
    kw.setdefault("adaptive", False)
    return SuffixDrafter(SpeculativeConfig(method="suffix", **kw), CTX)


def propose(drafter, history, k=5, req_id="r", assumed=0):
    return drafter.propose([DraftRequest(req_id, history, k, GREEDY, num_assumed=assumed)])[0]


def best_path(proposal) -> list[int]:
    """Tokens along the likeliest path: nodes come best first, so each level's first child of the path."""
    path, node = [], -1
    while proposal.token_ids:
        nxt = next((i for i, p in enumerate(proposal.parents) if p == node), None)
        if nxt is None:
            return path
        path.append(proposal.token_ids[nxt])
        node = nxt
    return path


def assert_scores_are_conditional_counts(proposal, history, depth):
    """Each node's score is count(context + path) / the sum of the counts of its siblings-to-be (brute force)."""
    counts = brute_counts([history], depth)
    context = tuple(history[-proposal.key:])  # the match (keys are capped at 8: callers keep depth <= 9)
    for i in range(len(proposal.token_ids)):
        path = context + tuple(proposal.token_ids[j] for j in path_to(proposal.parents, i))
        total = sum(c for s, c in counts.items() if len(s) == len(path) and s[:-1] == path[:-1])
        assert proposal.scores[i] == pytest.approx(counts[path] / total)


def request_counts(drafter, req_id="r"):
    return drafter._requests[req_id].trie.substring_counts()


# ---------------------------------------------------------------------------------------------- the trie


def test_counts_equal_a_brute_force_count():
    rng = random.Random(0)
    for _ in range(150):
        depth, vocab = rng.randint(2, 6), rng.randint(1, 4)
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 40))] for _ in range(rng.randint(1, 4))]
        at_once, one_by_one = SuffixTrie(depth), SuffixTrie(depth)
        for key, seq in enumerate(seqs):
            at_once.extend(key, seq)
            for token in seq:
                one_by_one.extend(key, [token])
        expected = brute_counts(seqs, depth)
        assert at_once.substring_counts() == expected
        assert one_by_one.substring_counts() == expected
        assert at_once.num_tokens == sum(map(len, seqs))


def test_chains_keep_rarely_repeating_text_small():
    """Stored nodes: about one per token (plus the repeats) for text that does not repeat, not D per token."""
    rng = random.Random(1)
    trie = SuffixTrie(24)
    trie.extend(0, [rng.randrange(10**6) for _ in range(2000)])
    assert trie.num_nodes <= 2200  # a full trie: 24 per token


def test_undo_gives_back_exactly_the_rebuilt_trie():
    rng = random.Random(2)
    for _ in range(150):
        depth, vocab = rng.randint(2, 6), rng.randint(1, 3)
        trie, tokens = SuffixTrie(depth), []
        trie.extend(0, [], undo=True)
        for _ in range(rng.randint(1, 8)):
            new = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
            trie.extend(0, new, undo=True)
            tokens += new
            keep = rng.randint(max(0, len(tokens) - 10), len(tokens))
            assert trie.truncate(0, keep)
            del tokens[keep:]
        rebuilt = SuffixTrie(depth)
        rebuilt.extend(0, tokens)
        assert trie.tokens(0) == tokens
        assert trie.substring_counts() == brute_counts([tokens], depth)
        assert trie.num_nodes == rebuilt.num_nodes  # the same stored structure, not only the same counts


def test_truncate_refuses_to_reach_past_its_journal():
    trie = SuffixTrie(4)
    trie.extend(0, list(range(_UNDO_WINDOW + 10)), undo=True)
    assert not trie.truncate(0, 5)
    assert trie.tokens(0) == list(range(_UNDO_WINDOW + 10))  # untouched
    assert trie.truncate(0, 20)


def test_longest_match_is_the_longest_suffix_seen_with_a_continuation():
    rng = random.Random(8)
    for _ in range(200):
        depth, vocab = rng.randint(2, 8), rng.randint(1, 4)
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(1, 3))]
        cache = SuffixCache(depth, 10)
        for key, seq in enumerate(seqs):
            cache.add(key, seq)
        history = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        max_len = rng.randint(1, depth)
        followed = {s[:-1] for s in brute_counts(seqs, depth)}  # strings seen followed by a token
        expected = max((m for m in range(1, min(max_len, depth - 1, len(history)) + 1)
                        if tuple(history[-m:]) in followed), default=0)
        m, node, off = cache.trie.longest_match(history, max_len)
        assert m == expected and (node is None) == (m == 0)


# ---------------------------------------------------------------------------------------------- catching up


def test_drafter_follows_rewound_histories():
    rng = random.Random(3)
    drafter = make(max_tree_depth=5)
    history = [rng.randrange(4) for _ in range(60)]
    propose(drafter, history)
    replaced = history[:-3] + [3, 3, 1, 0]  # a new list whose end differs
    propose(drafter, replaced)
    assert request_counts(drafter) == brute_counts([replaced], 5)
    del replaced[-5:]  # the same list, rewound in place and grown again
    replaced += [2, 2, 2]
    proposal = propose(drafter, replaced)
    assert request_counts(drafter) == brute_counts([replaced], 5)
    fresh = make(max_tree_depth=5)
    assert propose(fresh, list(replaced)) == proposal
    deep = replaced[:10] + [1] * (_UNDO_WINDOW + 5)  # past the journal: rebuilt
    propose(drafter, deep)
    assert request_counts(drafter) == brute_counts([deep], 5)


def test_zero_drafts_still_follow_the_history():
    drafter = make()
    history = [1, 2, 3, 4, 1, 2]
    assert propose(drafter, history, k=0).token_ids == []
    assert drafter._requests["r"].trie.tokens(0) == history
    history += [3]
    assert propose(drafter, history, k=0).token_ids == []
    assert propose(drafter, history).token_ids[:2] == [4, 1]


# ---------------------------------------------------------------------------------------------- proposals


def test_registry_and_protocol():
    drafter = make()
    assert drafter_class("suffix") is SuffixDrafter
    assert isinstance(drafter, Drafter) and drafter.cheap_proposals
    proposal = propose(drafter, [7, 8, 9, 5, 7, 8])
    assert proposal.token_ids[:2] == [9, 5] and proposal.probs is None and proposal.key == 2
    assert propose(drafter, [1, 2, 3], req_id="s").token_ids == []  # nothing matches
    assert propose(drafter, [1, 2, 3], req_id="s").key is None


def test_proposals_are_valid_best_first_trees():
    rng = random.Random(4)
    for trial in range(60):
        min_prob = rng.choice([0.0, 0.05, 0.1, 0.3])
        depth = rng.randint(3, 9)
        drafter = make(max_tree_depth=depth, min_token_prob=min_prob, max_spec_factor=2.0)
        history = [rng.randrange(3) for _ in range(rng.randint(5, 200))]
        k = rng.randint(1, 12)
        proposal = propose(drafter, history, k=k)
        if not proposal.token_ids:
            continue
        check_parents(proposal.parents)
        assert len(proposal.token_ids) == len(proposal.parents) == len(proposal.scores) <= k
        assert all(0 < s <= 1 for s in proposal.scores)
        paths = path_scores(proposal.tree(), 1.0)
        assert all(a >= b - 1e-12 for a, b in zip(paths, paths[1:]))  # best first
        assert min(paths) >= min_prob - 1e-12
        assert 1 <= proposal.key <= 8
        assert_scores_are_conditional_counts(proposal, history, depth)


def test_repetitive_text_drafts_its_continuation():
    sentence = list(range(100, 130))
    history = sentence * 3 + sentence[:10]
    proposal = propose(make(), history)
    assert best_path(proposal) == sentence[10:15]
    assert proposal.scores == [1.0] * 5 and proposal.key == 8  # the match is longer than 8 tokens


def test_probabilities_are_counts_over_the_children_counts():
    # after [1, 2]: 3 three times, 4 once; after [1, 2, 3]: 9, 8, 6 once each
    history = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 7, 1, 2, 3, 6, 1, 2]
    proposal = propose(make(min_token_prob=0.2), history)  # match [1, 2]: budget 2
    assert (proposal.token_ids, proposal.parents, proposal.scores, proposal.key) == ([3, 4], [-1, -1], [0.75, 0.25], 2)
    proposal = propose(make(min_token_prob=0.3), history)
    assert (proposal.token_ids, proposal.scores) == ([3], [0.75])
    proposal = propose(make(min_token_prob=0.05, max_spec_factor=3.0), history)  # budget 5: grandchildren
    assert proposal.token_ids[:2] == [3, 4] and len(proposal.token_ids) == 5
    assert_scores_are_conditional_counts(proposal, history, 24)


def test_budget_follows_the_match_length():
    history = list(range(10, 20)) + [50, 12, 13, 14]  # the longest match: [12, 13, 14]
    for opts, expected in (({}, [15, 16, 17]), ({"max_spec_factor": 0.5}, [15, 16]),
                           ({"max_spec_offset": 1.0}, [15, 16, 17, 18]), ({"max_spec_offset": -2.0}, [15])):
        proposal = propose(make(**opts), history)
        assert (proposal.token_ids, proposal.key) == (expected, 3)


def test_long_matches_leave_room_for_the_budget():
    """A match of D - 1 tokens leaves one level; a shorter one is grown too and wins with a longer draft."""
    sentence = list(range(100, 140))
    history = sentence * 2 + sentence[:30]
    assert len(propose(make(max_tree_depth=12, num_speculative_tokens=8), history, k=8).token_ids) == 6  # m = 6
    assert len(propose(make(max_tree_depth=24, num_speculative_tokens=8), history, k=8).token_ids) == 8


# ---------------------------------------------------------------------------------------------- global trie


def _template_requests():
    rng = random.Random(5)
    template, answer = list(range(100, 112)), list(range(200, 220))
    prompts = [[rng.randrange(1000, 2000) for _ in range(50)] + template for _ in range(2)]
    return prompts, answer


def test_global_trie_drafts_a_template_from_the_first_output_token():
    prompts, answer = _template_requests()
    for opts, drafts in (({}, answer[1:6]), ({"use_global_tree": False}, []), ({"max_cached_requests": 0}, [])):
        drafter = make(**opts)
        propose(drafter, prompts[0] + answer[:1], req_id="a")
        propose(drafter, prompts[0] + answer, req_id="a")
        drafter.finish(["a"])
        proposal = propose(drafter, prompts[1] + answer[:1], req_id="b")
        assert best_path(proposal) == drafts
        if drafts:
            assert proposal.key == 8  # the template's 12 tokens and the first answer token matched


def test_global_record_is_the_output_and_the_prompts_end():
    prompts, answer = _template_requests()
    drafter = make(max_tree_depth=8)
    propose(drafter, prompts[0] + answer[:1], req_id="a")
    propose(drafter, prompts[0] + answer + [7, 7], req_id="a", assumed=2)  # two drafts still being checked
    drafter.finish(["a"])
    (key, start, tokens), = drafter.cache.records()
    assert (key, start, tokens) == ("a", len(prompts[0]) - 8, prompts[0][-8:] + answer)


def test_a_request_that_comes_back_replaces_its_record():
    prompts, answer = _template_requests()
    drafter = make(max_tree_depth=8)
    history = prompts[0] + answer[:3]
    propose(drafter, history, req_id="a")
    drafter.finish(["a"])  # preempted
    assert drafter.cache.records() == [("a", len(prompts[0]) + 2 - 8, history[len(prompts[0]) - 6:])]
    history = prompts[0] + answer
    propose(drafter, history, req_id="a")  # back: rebuilt from its whole history
    assert request_counts(drafter, "a") == brute_counts([history], 8)
    drafter.finish(["a"])
    assert drafter.cache.records() == [("a", len(prompts[0]) - 6, history[len(prompts[0]) - 6:])]
    drafter.finish(["a", "never-seen"])  # no state: nothing happens
    assert len(drafter.cache) == 1


def test_eviction_bounds_memory_and_keeps_the_rebuilt_counts():
    rng = random.Random(6)
    depth = 5
    cache = SuffixCache(depth, 3)
    for i in range(40):
        cache.add(f"k{rng.randrange(8)}", [rng.randrange(3) for _ in range(rng.randint(1, 30))], start=i)
        kept = [tokens for _, _, tokens in cache.records()]
        assert len(cache) == len(kept) <= 3 and cache.trie.num_sequences == len(kept)
        assert cache.trie.substring_counts() == brute_counts(kept, depth)
        assert cache.trie.num_nodes <= 1 + depth * sum(map(len, kept))  # bounded by what is kept
        assert cache.trie.num_tokens == sum(map(len, kept))
    for key, _, _ in cache.records():
        cache.remove(key)
    assert cache.trie.num_nodes == 1 and cache.trie.substring_counts() == {}


def test_drafter_keeps_the_newest_finished_requests():
    drafter = make(max_cached_requests=2)
    for i in range(5):
        history = [1000 + i] * 3 + [i, i + 1]
        propose(drafter, history, req_id=f"q{i}")
        drafter.finish([f"q{i}"])
    assert [key for key, _, _ in drafter.cache.records()] == ["q3", "q4"]


def test_cache_snapshots_merge_into_another_cache():
    rng = random.Random(7)
    source, target = SuffixCache(6, 10), SuffixCache(6, 10)
    for i in range(4):
        source.add(f"s{i}", [rng.randrange(4) for _ in range(20)], start=i)
    target.add("t", [1, 2, 3])
    target.merge(source.snapshot())
    kept = [tokens for _, _, tokens in target.records()]
    assert len(kept) == 5 and target.trie.substring_counts() == brute_counts(kept, 6)
    with pytest.raises(ValueError, match="version"):
        target.merge({"version": 0, "records": []})


# ---------------------------------------------------------------------------------------------- options, stats


@pytest.mark.parametrize("key, value", [
    ("max_tree_depth", 1), ("max_tree_depth", True), ("max_tree_depth", "24"),
    ("max_cached_requests", -1), ("max_cached_requests", 1.5),
    ("max_spec_factor", -0.5), ("max_spec_factor", float("nan")), ("max_spec_offset", float("inf")),
    ("min_token_prob", 1.5), ("min_token_prob", -0.1), ("use_global_tree", "yes"),
])
def test_options_are_checked(key, value):
    with pytest.raises(ValueError, match=key):
        options_of(SpeculativeConfig(method="suffix", **{key: value}))


def test_options_that_never_draft_are_refused():
    with pytest.raises(ValueError, match="allow no draft"):
        options_of(SpeculativeConfig(method="suffix", max_spec_factor=0.0))
    with pytest.raises(ValueError, match="max_cached_requests=5 sizes the global tree"):  # it would be ignored
        options_of(SpeculativeConfig(method="suffix", use_global_tree=False, max_cached_requests=5))
    assert options_of(SpeculativeConfig(method="suffix")).max_cached_requests == 10000
    with pytest.raises(ValueError, match="prompt_lookup_max is an option of method 'ngram'"):
        options_of(SpeculativeConfig(method="suffix", prompt_lookup_max=3))


def test_vllm_names_are_aliases():
    opts = options_of(SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=8,
                                        suffix_decoding_max_cached_requests=5, suffix_decoding_max_spec_factor=2.0,
                                        suffix_decoding_min_token_prob=0.2))
    given = (opts.max_tree_depth, opts.max_cached_requests, opts.max_spec_factor, opts.min_token_prob)
    assert given == (8, 5, 2.0, 0.2)
    assert opts.max_spec_offset == 0.0 and opts.use_global_tree
    with pytest.raises(ValueError, match="alias"):
        options_of(SpeculativeConfig(method="suffix", max_tree_depth=8, suffix_decoding_max_tree_depth=9))


def test_stats_count_calls_drafts_and_accepted_tokens():
    drafter = make()
    sentence = list(range(100, 130))
    history = sentence * 2 + sentence[:10]
    first = propose(drafter, history)
    assert first.token_ids == sentence[10:15]
    history = history + sentence[10:12] + [999]  # two drafts kept, then the target's own token
    drafter.observe_verification("r", 5, 2)  # the engine tells it so
    assert propose(drafter, history).token_ids == []  # 999 is new: nothing to draft
    propose(drafter, history + [5], k=0)
    stats = drafter.stats()
    assert stats["name"] == "suffix"
    assert [stats[k] for k in ("calls", "gen_drafts", "gen_tokens", "acc_drafts", "acc_tokens")] == [3, 1, 5, 1, 2]
    assert stats["dur_gen_ms"] > 0 and stats["dur_begin_ms"] > 0
    drafter.finish(["r"])
    assert drafter.stats()["calls"] == 3


# ---------------------------------------------------------------------------------------------- shared across replicas


def Relay():
    """The pool actor's class in process (no Ray): relays (key, start, tokens) deltas between linked drafters, and
    records what each sent. The pool's module imports Ray: without it (a GPU image) these tests skip."""
    pytest.importorskip("ray")
    from specray.cluster.ngram_pool import NgramPoolActor

    class _Relay(NgramPoolActor):
        def __init__(self):
            super().__init__()
            self.published: list[tuple[str, str, int]] = []  # (origin, key, start) of every update received

        def link(self, origin: str) -> "RelayLink":
            return RelayLink(self, origin)

        def exchange(self, origin, updates):
            self.published.extend((origin, key, start) for key, start, _ in updates)
            return super().exchange(origin, updates)

    return _Relay()


class RelayLink:
    def __init__(self, relay, origin: str):
        self.relay, self.origin = relay, origin

    def exchange(self, updates, wait=False):
        return self.relay.exchange(self.origin, updates)


def test_linked_replicas_draft_each_others_finished_answers():
    """is_public_pool with a link: replica B drafts the answer replica A finished; an unlinked replica drafts
    nothing from its empty global tree; B never publishes back what it received, A never gets its own back."""
    prompts, answer = _template_requests()
    relay = Relay()
    a, b, alone = make(is_public_pool=True), make(is_public_pool=True), make(is_public_pool=True)
    a.attach_pool_link(relay.link("A"))
    b.attach_pool_link(relay.link("B"))
    propose(a, prompts[0] + answer[:1], req_id="x")
    propose(a, prompts[0] + answer, req_id="x")
    a.finish(["x"])
    a.sync_pool(wait=True)
    assert [(origin, start) for origin, _, start in relay.published] == [("A", 0)]
    key = relay.published[0][1]
    assert key.endswith(":x") and key != "x"  # unique per replica: prefixed by the replica's id
    for drafter, drafts in ((b, answer[1:6]), (alone, [])):
        proposal = propose(drafter, prompts[1] + answer[:1], req_id="x")  # the same req_id: no clash
        assert best_path(proposal) == drafts
    assert [k for k, _, _ in b.cache.records()] == [("pool", key)]
    (_, _, tokens), = b.cache.records()
    assert tokens == a.cache.records()[0][2]  # the whole record: the prompt's end and the answer
    b.finish(["x"])
    b.sync_pool(wait=True)
    a.sync_pool(wait=True)
    assert [origin for origin, _, _ in relay.published] == ["A", "B"]  # B's own request only
    theirs = relay.published[1][1]
    assert theirs != key and [k for k, _, _ in a.cache.records()] == ["x", ("pool", theirs)]


def test_remote_records_respect_the_global_trees_bound():
    relay = Relay()
    a, b = make(is_public_pool=True, max_cached_requests=3), make(is_public_pool=True, max_cached_requests=2)
    a.attach_pool_link(relay.link("A"))
    b.attach_pool_link(relay.link("B"))
    for i in range(4):
        propose(a, [1000 + i] * 3 + [i, i + 1], req_id=f"q{i}")
        a.finish([f"q{i}"])
    a.sync_pool(wait=True)
    b.sync_pool(wait=True)
    assert [k[1].split(":")[1] for k, _, _ in b.cache.records()] == ["q2", "q3"]  # the newest two
    assert b.cache.trie.substring_counts() == brute_counts([t for _, _, t in b.cache.records()], 24)


def test_public_pool_options_are_checked():
    with pytest.raises(ValueError, match="is_public_pool"):
        options_of(SpeculativeConfig(method="suffix", is_public_pool="yes"))
    with pytest.raises(ValueError, match="is_public_pool=True.*use_global_tree=False"):
        options_of(SpeculativeConfig(method="suffix", is_public_pool=True, use_global_tree=False))
    with pytest.raises(ValueError, match="max_cached_requests=0"):
        options_of(SpeculativeConfig(method="suffix", is_public_pool=True, max_cached_requests=0))
    with pytest.raises(ValueError, match="is_public_pool=True"):
        make().attach_pool_link(Relay().link("A"))
