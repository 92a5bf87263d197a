"""The incremental detokenizer: its direct backend decode equals ``tokenizer.decode``, token by token."""

import functools
import random

import pytest

from specray.detokenizer import IncrementalDetokenizer, _slow_decode, decoder_for
from tests.conftest import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from specray.default_model import default_model_path
    from specray.models.loader import load_tokenizer

    try:
        return load_tokenizer(default_model_path())
    except ValueError as err:
        pytest.skip(str(err))


def _texts(detok_factory, sequences):
    out = []
    for prompt, output in sequences:
        detok = detok_factory(prompt)
        out.append([detok.push(t) for t in output] + [detok.text])
    return out


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_fast_decode_matches_tokenizer_decode(request, which, skip):
    """Random ids (special tokens and partial UTF-8 byte tokens included): every pushed delta and the final text
    equal what the same detokenizer gives through ``tokenizer.decode``."""
    tokenizer = request.getfixturevalue("tokenizer" if which == "tiny" else "smollm2_tokenizer")
    rng = random.Random(0)
    # multi-byte characters split over byte tokens, and the special tokens (rare among random ids of a large vocab)
    extra = tokenizer.encode("héllo wörld 日本語 🙂 ok") + tokenizer.all_special_ids
    vocab = len(tokenizer)
    sequences = [([rng.randrange(vocab) for _ in range(rng.randint(1, 9))],
                  [rng.choice(extra) if rng.random() < 0.3 else rng.randrange(vocab) for _ in range(40)])
                 for _ in range(60)]

    def slow(prompt):
        detok = IncrementalDetokenizer(tokenizer, prompt, skip)
        detok._decode = functools.partial(_slow_decode, tokenizer, skip)
        return detok

    assert _texts(lambda p: IncrementalDetokenizer(tokenizer, p, skip), sequences) == _texts(slow, sequences)


def test_backend_decode_is_taken_only_when_exact(tokenizer):
    """The Rust backend is called directly for a generic fast tokenizer without space clean-up; a tokenizer that
    cleans up spaces (or overrides decode) keeps transformers' decode."""
    tokenizer.clean_up_tokenization_spaces = False
    assert decoder_for(tokenizer, True).func == tokenizer._tokenizer.decode
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert decoder_for(tokenizer, True).func is _slow_decode
    finally:
        tokenizer.clean_up_tokenization_spaces = False

    class Custom(type(tokenizer)):
        def decode(self, ids, **kwargs):
            return "custom"

    custom = Custom.__new__(Custom)
    custom.__dict__.update(tokenizer.__dict__)
    assert decoder_for(custom, True).func is _slow_decode


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_push_all_gives_the_text_of_pushing_one_at_a_time(request, which, skip):
    """An output decoded once at the end (``output_kind="final_only"``) has the text the token-by-token path gives:
    random ids with special tokens and multi-byte characters split over byte tokens, real text, pieces pushed in
    several bulks, and text that ends in an incomplete UTF-8 sequence."""
    tokenizer = request.getfixturevalue("tokenizer" if which == "tiny" else "smollm2_tokenizer")
    rng = random.Random(1)
    extra = tokenizer.encode("héllo wörld 日本語 🙂 ok")
    vocab = len(tokenizer)
    real = tokenizer.encode(" The quick brown fox, naïvely: 'jumps' over 42 lazy dogs.\n\tdef f(x): return x")
    sequences = [([rng.randrange(vocab) for _ in range(rng.randint(1, 9))],
                  [rng.choice(extra) if rng.random() < 0.3 else rng.randrange(vocab) for _ in range(40)])
                 for _ in range(60)]
    sequences += [(real[:3], real[3:]), (real[:1], real[1:] + extra[:-1]), ([], real)]
    bulk_ok = 0
    for prompt, output in sequences:
        one = IncrementalDetokenizer(tokenizer, prompt, skip)
        for t in output:
            one.push(t)
        cuts = sorted(rng.sample(range(len(output) + 1), 2))
        many = IncrementalDetokenizer(tokenizer, prompt, skip)
        for part in (output[: cuts[0]], output[cuts[0]: cuts[1]], output[cuts[1]:]):
            many.push_all(part, 4)
        assert many.text == one.text, (prompt, output)
        for piece in (32, 5):
            whole = IncrementalDetokenizer(tokenizer, prompt, skip)
            pushed = []
            whole.push = lambda t, push=whole.push: (pushed.append(t), push(t))[1]  # the fallback's
            whole.push_all(output, piece)
            assert whole.text == one.text, (prompt, output, piece)
            bulk_ok += len(pushed) < len(output)
    assert bulk_ok >= 20  # the two-decode path ran, not only the token-by-token fallback


@pytest.mark.parametrize("which", ["tiny", "spm", "smollm2"])
def test_logprob_bytes_join_into_the_text_and_offsets_point_into_it(request, tmp_path, which):
    """OpenAI's logprob ``bytes``: a token holding part of a character (its text alone U+FFFD) carries the bytes it
    stands for (a byte-level BPE piece's, a sentencepiece byte-fallback piece's), so the tokens' bytes join into the
    text; the legacy ``text_offset`` places each token where the characters it spells start, the same when the
    tokens come in chunks of a stream (one cursor carried over)."""
    from specray.outputs import Logprob
    from tests.conftest import build_spm_tokenizer

    from specray.cluster.openai_protocol import LogprobFormatter, TextCursor

    if which == "spm":
        tokenizer = build_spm_tokenizer(tmp_path, "llama")
    else:
        tokenizer = request.getfixturevalue("tokenizer" if which == "tiny" else "smollm2_tokenizer")
    text = "日本語の文章 Ünïcödé façade naïve 🙂 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    logprobs = [{i: Logprob(-0.5)} for i in ids]
    fmt = LogprobFormatter(tokenizer)
    content = fmt.chat(ids, logprobs, 1).content
    assert sum(c.token == "\ufffd" for c in content) >= 4  # the CJK characters and the emoji split over tokens
    whole = b"".join(bytes(c.bytes) for c in content).decode("utf-8")
    assert whole == (" " if which == "spm" else "") + text  # (a sentencepiece tokenizer's prefix space)
    legacy = fmt.completion(ids, logprobs, 1)
    offsets = legacy.text_offset
    assert offsets == sorted(offsets) and offsets[-1] < len(whole)
    for token, at in zip(legacy.tokens, offsets):
        if "\ufffd" not in token:
            assert token.strip() in whole[at: at + len(token) + 1], (token, at)
    cursor = TextCursor(7)
    streamed = [o for part in (slice(0, 5), slice(5, 11), slice(11, None))
                for o in fmt.completion(ids[part], logprobs[part], 1, cursor).text_offset]
    assert streamed == [o + 7 for o in offsets]
