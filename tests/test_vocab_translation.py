"""A draft model with another tokenizer than the target's (``specray.drafters.vocab_translation``): each request's
history in the draft's tokens equals the draft tokenizer's own encoding of its text however the history grew or
shrank; greedy drafts come back as the target tokenizer's encoding of their text; the engine's greedy output is plain
greedy output with a draft model whose vocabulary is the target's permuted (the target's own weights over a
vocabulary of characters: every greedy draft kept) and with one of a sentencepiece tokenizer (random drafts, all
verified); sampled requests' drafts, drawn among the shared tokens with q carried over, keep the target's
distribution."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from specray import LLM, SamplingParams
from specray.drafters import vocab_translation
from specray.drafters.vocab_translation import VocabTranslator, translatable
from specray_test_engine_runs import check_sampled_distribution, greedy, token_ids  # tests/engine_runs.py
from specray_test_vocabularies import permuted_copy  # tests/vocabularies.py
from tests.conftest import build_spm_tokenizer, build_tiny_model, build_tiny_tokenizer

TEXT = "Hello world! How are  you today?\nfor i in range(10): print(i) ünïcødé 日本語 done."
PROMPTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox", "Hello world! How are you today?",
           "for i in range(10):"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tokenizers")
    return {"bpe": build_tiny_tokenizer(root / "bpe"), "llama": build_spm_tokenizer(root / "llama", "llama"),
            "gemma": build_spm_tokenizer(root / "gemma", "gemma")}


@pytest.mark.parametrize("target,draft,marks", [("bpe", "llama", None), ("llama", "bpe", None),
                                                ("gemma", "bpe", None), ("llama", "gemma", None), ("bpe", "llama", 2)])
def test_a_history_in_the_drafts_tokens_is_their_own_encoding(tokenizers, target, draft, marks, monkeypatch):
    """A history that grows by a few tokens a step and sometimes forgets its last ones (rejected prefetched drafts):
    after every step the draft's tokens are the draft tokenizer's encoding of the history's text (byte-level BPE
    and sentencepiece pieces with byte fallback both ways, characters of several bytes split across steps), that
    text a prefix of the whole text, all of it but a held-back character at the end; ``marks``: only that many of
    the target's updates kept to roll back to (a rollback past them decodes from the start)."""
    if marks is not None:
        monkeypatch.setattr(vocab_translation, "_MARKS", marks)
    target_tok, draft_tok = tokenizers[target], tokenizers[draft]
    ids = target_tok._tokenizer.encode(TEXT, add_special_tokens=True).ids
    translator = VocabTranslator(target_tok, draft_tok)
    for seed in range(4):
        rng, n, steps = random.Random(seed), 1, 0
        while n <= len(ids):
            got = translator.to_draft(str(seed), ids[:n])
            text = translator._requests[str(seed)][0].text
            assert TEXT.startswith(text), (n, text)
            assert got == draft_tok._tokenizer.encode(text, add_special_tokens=True).ids, (n, text)
            back = rng.random() < 0.3 and n > 4
            n += -rng.randint(1, 3) if back else rng.randint(1, 4)
            steps += 1
        translator.to_draft(str(seed), ids)
        assert translator._requests[str(seed)][0].text == TEXT and steps > 10


@pytest.mark.parametrize("target,draft", [("bpe", "llama"), ("llama", "bpe"), ("gemma", "bpe")])
def test_drafts_come_back_as_the_targets_encoding_of_their_text(tokenizers, target, draft):
    """Drafts (the draft tokenizer's encoding of the text that follows the history) come back as the target
    tokenizer's encoding of it after the history, a leading space kept; a draft past the draft's special tokens
    (its end of text) is dropped; a history ending inside a character gets no drafts."""
    target_tok, draft_tok = tokenizers[target], tokenizers[draft]
    ids = target_tok._tokenizer.encode(TEXT, add_special_tokens=True).ids
    translator = VocabTranslator(target_tok, draft_tok)
    for word in (" How", " print", " ünïcødé"):
        history = next(ids[:k] for k in range(len(ids)) if len(target_tok.decode(ids[:k], skip_special_tokens=True))
                       >= TEXT.index(word))
        translator.to_draft(word, history)
        rest = TEXT[len(translator._requests[word][0].text):]
        assert rest.startswith(word)
        drafts = draft_tok._tokenizer.encode(rest, add_special_tokens=False).ids
        assert translator.to_target(word, drafts, history) == ids[len(history):]
        end = draft_tok.convert_tokens_to_ids(draft_tok.eos_token)
        cut = translator.to_target(word, drafts[:3] + [end] + drafts[3:], history)
        assert cut == translator.to_target(word, drafts[:3], history) and 0 < len(cut) < len(ids) - len(history)
    inside = next(k for k in range(len(ids)) if target_tok.decode(ids[:k]).endswith("\ufffd"))
    translator.to_draft("inside", ids[:inside])
    assert translator.to_target("inside", [draft_tok._tokenizer.encode(" x").ids[-1]], ids[:inside]) == []


def test_a_tokenizer_without_a_fast_backend_cannot_translate():
    assert "not a fast tokenizer" in translatable(object())


@pytest.fixture(scope="module")
def spm_draft_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_spm_draft"), "llama", seed=4, spm="llama",
                            num_hidden_layers=1)


def test_the_permuted_copy_is_the_same_model(tiny_char_dir, tiny_char_permuted_dir):
    """The fixture's own check: the permuted copy's greedy text is the model's."""
    kwargs = dict(max_model_len=128, device="cpu")
    want, got = ([o.outputs[0].text for o in LLM(str(folder), **kwargs).generate(PROMPTS, greedy(16), use_tqdm=False)]
                 for folder in (tiny_char_dir, tiny_char_permuted_dir))
    assert got == want and any(want)


@pytest.mark.parametrize("draft", ["permuted", "spm"])
def test_translated_drafts_keep_greedy_output(request, draft):
    """Greedy output equals plain greedy output, batches of 4 with prefix caching on: the permuted copy drafting for
    its own model (the target's own predictions through two tokenizers: every greedy draft kept) and a random draft
    model of a sentencepiece tokenizer for a byte-level BPE target (its drafts verified, few kept). Sampled requests
    draft too (among the tokens both vocabularies hold, q carried over: the permuted copy's q is the target's p, so
    nearly every drawn draft is kept). Every draft-side state is gone once the requests finish."""
    target = request.getfixturevalue("tiny_char_dir" if draft == "permuted" else "tiny_llama_dir")
    folder = request.getfixturevalue("tiny_char_permuted_dir" if draft == "permuted" else "spm_draft_dir")
    spec = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(str(target), max_model_len=256, speculative_config=spec, enable_prefix_caching=True)
    plain = LLM(str(target), max_model_len=256)
    drafter = llm.engine.drafter
    assert drafter.translator is not None and drafter._draws_twins()
    assert token_ids(llm.generate(PROMPTS, greedy(32), use_tqdm=False)) == \
        token_ids(plain.generate(PROMPTS, greedy(32), use_tqdm=False))
    stats = llm.spec_stats.copy()
    assert stats.draft_tokens > 40
    if draft == "permuted":
        assert stats.accepted_tokens == stats.draft_tokens, stats
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    llm.generate(PROMPTS, sampled, use_tqdm=False)
    drawn, kept = (llm.spec_stats.draft_tokens - stats.draft_tokens, llm.spec_stats.accepted_tokens -
                   stats.accepted_tokens)
    assert drawn > 20 and (draft != "permuted" or kept >= 0.9 * drawn), (drawn, kept)
    assert not drafter.translator._requests and not drafter.states


def test_drawn_translated_drafts_keep_the_target_distribution(tiny_char_dir, tmp_path):
    """The target's weights moved by noise over a permuted character vocabulary (a draft near the target, not equal:
    some drafts kept, some not): sampled requests draw their drafts among the shared tokens and hand q over in the
    target's ids; the first three tokens' joint frequencies fit the target's p(x0) p(x1 | x0) p(x2 | x0 x1) (and, a
    negative control, not the target's at T=1)."""
    draft = permuted_copy(tiny_char_dir, tmp_path / "near", noise=0.05)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(tiny_char_dir), max_model_len=64, max_num_seqs=64, speculative_config=spec)
    check_sampled_distribution(llm, tiny_char_dir, llm.get_tokenizer().encode("The quick brown"))
