"""The C n-gram index (drafters/_ngram_index.c) answers as the pure-Python NgramPool does, through appends,
prompts, in-place rewinds and new history lists; and the ngram drafter proposes the same with either."""

import os
import random

import pytest

from specray.config import SpeculativeConfig
from specray.drafters import ngram
from specray.drafters.base import DraftRequest, DrafterContext
from specray.drafters.ngram import NgramDrafter, NgramPool

# CI installs with a compiler, so the index must be there; SPECRAY_NO_NATIVE=1 is for a build without one.
needs_native = pytest.mark.skipif(ngram.NgramIndex is None and os.environ.get("SPECRAY_NO_NATIVE") == "1",
                                  reason="built without the C n-gram index (SPECRAY_NO_NATIVE=1)")


def test_the_c_index_is_built():
    if os.environ.get("SPECRAY_NO_NATIVE") == "1":
        pytest.skip("SPECRAY_NO_NATIVE=1: a build without a compiler")
    assert ngram.NgramIndex is not None, "drafters/_ngram_index.c was not built (pip install -e . with a C compiler)"


CTX = DrafterContext(target_model="unused", vocab_size=100, max_model_len=4096, max_num_seqs=8)
FLAGS = [(True, True), (True, False), (False, True), (False, False)]  # (is_keep_all, is_use_oldest)


@needs_native
@pytest.mark.parametrize("keep_all,use_oldest", FLAGS)
@pytest.mark.parametrize("seed", range(6))
def test_index_matches_the_pool_through_appends_and_rewinds(seed, keep_all, use_oldest):
    rng = random.Random(seed)
    lo = rng.randint(1, 3)
    hi = rng.randint(lo, 5)
    vocab = rng.choice([3, 6, 50])  # a small vocabulary repeats n-grams often
    index = ngram.NgramIndex(lo, hi, not (keep_all and use_oldest))
    pool = NgramPool(lo, hi, 8, is_keep_all=keep_all, is_use_oldest=use_oldest)
    history: list[int] = []
    for step in range(300):
        action = rng.random()
        if action < 0.7:  # a decode step: a few tokens appended to the same list
            history += [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        elif action < 0.78:  # a prompt-sized burst
            history += [rng.randrange(vocab) for _ in range(rng.randint(10, 80))]
        elif action < 0.9:  # rewound in place, then grown again
            del history[rng.randint(0, len(history)):]
            history += [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        else:  # a new list that differs from some position on
            cut = rng.randint(0, len(history))
            history = history[:cut] + [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        copy = index.tokens()
        dropped = index.sync(history)
        scratch = _from_scratch(history, lo, hi, keep_all, use_oldest)
        assert dropped == len(copy) - ngram.common_prefix(copy, history), step
        assert index.tokens() == history, step
        assert index.num_ngrams == scratch.num_ngrams, step
        for k in (1, 3, 8):
            assert index.lookup(k) == scratch.lookup_match(history, k), (step, k)
        if keep_all:  # the incremental pool reads as a fresh one (keeping only the newest sighting, a rewind
            pool.sync("s", history)  # may forget an older one the text still has: the C index does not)
            assert [pool.lookup_match(history, k) for k in (1, 3, 8)] == [index.lookup(k) for k in (1, 3, 8)]


def _from_scratch(history: list[int], lo: int, hi: int, keep_all: bool, use_oldest: bool) -> NgramPool:
    pool = NgramPool(lo, hi, 8, is_keep_all=keep_all, is_use_oldest=use_oldest)
    pool.extend("s", history)
    return pool


@needs_native
def test_index_rejects_bad_tokens_and_keeps_its_copy():
    index = ngram.NgramIndex(1, 3, False)
    history = [1, 2, 3, 1, 2]
    index.sync(history)
    with pytest.raises(ValueError, match="outside"):
        index.sync(history + [-1])
    with pytest.raises(TypeError, match="ints"):
        index.sync(history + ["a"])
    with pytest.raises(ValueError, match="outside"):
        index.sync(history + [2**40])
    assert index.tokens() == history
    pool = NgramPool(1, 3, 4)
    pool.sync("s", history + [3])
    index.sync(history + [3])
    assert index.lookup(4) == pool.lookup_match(history + [3], 4) == ([1, 2, 3], 3)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        ngram.NgramIndex(3, 2, False)


@needs_native
@pytest.mark.parametrize("keep_all,use_oldest", FLAGS)
def test_drafter_proposes_the_same_with_the_c_index(monkeypatch, keep_all, use_oldest):
    rng = random.Random(7)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                             prompt_lookup_min=1, prompt_lookup_max=3, is_keep_all=keep_all, is_use_oldest=use_oldest)
    native = NgramDrafter(spec, CTX)
    with monkeypatch.context() as patch:
        patch.setattr(ngram, "NgramIndex", None)
        pure = NgramDrafter(spec, CTX)
    assert native._indexes is not None and pure._indexes is None
    histories = {f"r{i}": [rng.randrange(5) for _ in range(rng.randint(5, 40))] for i in range(6)}
    for step in range(80):
        for rid, history in histories.items():  # the engine's lists: grown in place, now and then rewound
            if step % 17 == 5:
                del history[-rng.randint(1, 4):]
            history += [rng.randrange(5) for _ in range(rng.randint(1, 3))]
        if step % 23 == 11:  # one request's history comes as a new list
            histories["r0"] = histories["r0"][:-2] + [4, 4]
        batch = [DraftRequest(rid, history, rng.choice([0, 2, 4]), None) for rid, history in histories.items()]
        got = [(p.token_ids, p.key) for p in native.propose(batch)]
        fresh = [_from_scratch(r.token_ids, 1, 3, keep_all, use_oldest).lookup_match(r.token_ids,
                                                                                      r.num_speculative_tokens)
                 if r.num_speculative_tokens else ([], 0) for r in batch]
        assert got == [(tokens, n or None) for tokens, n in fresh], step
        if keep_all:  # see test_index_matches_the_pool_through_appends_and_rewinds
            assert got == [(p.token_ids, p.key) for p in pure.propose(batch)], step
    native.finish(list(histories))
    assert native._indexes == {}


@needs_native
def test_drafter_falls_back_to_the_pool_past_the_index_longest_n():
    spec = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2)
    assert NgramDrafter(SpeculativeConfig(**spec, prompt_lookup_max=ngram.NATIVE_MAX_N), CTX)._indexes is not None
    long = NgramDrafter(SpeculativeConfig(**spec, prompt_lookup_max=ngram.NATIVE_MAX_N + 1), CTX)
    assert long._indexes is None
    history = [1, 2, 3, 4, 1, 2]
    assert [p.token_ids for p in long.propose([DraftRequest("r", history, 3, None)])] == [[3, 4, 1]]
