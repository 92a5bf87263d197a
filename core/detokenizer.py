"""Incremental detokenization and stop-string detection, one token at a time."""

from __future__ import annotations

import functools
from collections.abc import Callable

# The transformers modules whose ``decode``/``_decode`` are the generic ones: a fast tokenizer's ``decode`` is its
# Rust backend's, plus an optional space clean-up (transformers 5's TokenizersBackend, 4.x's PreTrainedTokenizerFast).
_GENERIC_DECODE = {"transformers.tokenization_utils_base"}
_GENERIC_BACKEND_DECODE = {"transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast"}


def decoder_for(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=...)``, calling the Rust backend directly when that is
    what ``decode`` would do: the detokenizer decodes two short windows per generated token, and transformers'
    generic wrapper around the backend costs several times the decode itself."""
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    generic = (getattr(cls.decode, "__module__", None) in _GENERIC_DECODE
               and getattr(getattr(cls, "_decode", None), "__module__", None) in _GENERIC_BACKEND_DECODE)
    if backend is None or not generic or getattr(tokenizer, "clean_up_tokenization_spaces", True) is not False:
        return functools.partial(_slow_decode, tokenizer, skip_special_tokens)
    return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)


def _slow_decode(tokenizer, skip_special_tokens: bool, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text without re-decoding the whole output every step.

    Decodes a short window ``tokens[prefix:]`` and emits the part beyond what the window's start already
    produced, holding back text that ends in an incomplete UTF-8 sequence (U+FFFD) until the next token.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self._decode = decoder_for(tokenizer, skip_special_tokens)
        self.tokens: list[int] = list(prompt_token_ids[-6:])  # a little context for leading spaces
        self.prefix = 0
        self.read = len(self.tokens)
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the new text it completes (possibly empty)."""
        self.tokens.append(token_id)
        before = self._decode(self.tokens[self.prefix : self.read])
        after = self._decode(self.tokens[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before) :]
        self.prefix, self.read = self.read, len(self.tokens)
        self.text += new
        return new

    def push_all(self, token_ids: list[int], piece: int = 32) -> None:
        """Add many tokens at once (an output decoded only when it finishes), ``piece`` at a time: each piece's text
        from two decodes instead of two per token. A piece whose text would not be what pushing its tokens one at a
        time gives (it holds an incomplete UTF-8 sequence, U+FFFD, or the window's text is not a prefix of the
        longer one) is pushed one token at a time."""
        for start in range(0, len(token_ids), piece):
            part = token_ids[start : start + piece]
            if not self._push_piece(part):
                for token_id in part:
                    self.push(token_id)

    def _push_piece(self, token_ids: list[int]) -> bool:
        tokens = self.tokens + list(token_ids)
        before = self._decode(self.tokens[self.prefix : self.read])
        after = self._decode(tokens[self.prefix :])
        new = after[len(before) :]
        if not after.startswith(before) or "\ufffd" in new:
            return False
        self.tokens, self.text = tokens, self.text + new
        self.prefix, self.read = max(0, len(tokens) - 6), len(tokens)  # a little context, as at the start
        return True


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's), character -> byte: the printable Latin-1 bytes stand for themselves and
    the other 68 bytes, in order, for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_ALPHABET = _byte_alphabet()


def _piece_bytes(piece: str | None, partial: bool) -> bytes | None:
    """A vocabulary piece's bytes where the piece spells them: a sentencepiece piece (its spaces spelled U+2581), a
    byte-fallback piece (``<0xE3>``), or for a token holding part of a character (``partial``) a byte-level BPE
    piece (every character in its alphabet); None otherwise."""
    if not piece:
        return None
    if "\u2581" in piece:
        return piece.replace("\u2581", " ").encode("utf-8")
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    if partial and all(c in _BYTE_ALPHABET for c in piece):
        return bytes(_BYTE_ALPHABET[c] for c in piece)
    return None


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Where the earliest stop string in ``text`` ends, looking only at matches that touch its last
    ``new_len`` characters. Returns (index where the stop string starts, the stop string) or None."""
    best = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_len - len(stop) + 1))
        if start != -1 and (best is None or start < best[0]):
            best = (start, stop)
    return best


class TokenTexts:
    """Each token id's text alone (special tokens kept), decoded once and cached: what a logprob names its token
    by (vLLM's ``decoded_token``, OpenAI's ``token``). A single token may be part of a multi-byte character; its
    text is then what the tokenizer makes of it alone."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decode = decoder_for(tokenizer, skip_special_tokens=False)
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode([token_id])
        return text

    def bytes_of(self, token_id: int) -> bytes:
        """The token's own bytes (OpenAI's logprob ``bytes``), so that a completion's tokens' bytes join into its
        text: its piece's where the piece spells them (:func:`_piece_bytes`: a byte-level BPE piece, a
        sentencepiece piece with the spaces that decoding it alone drops, a byte-fallback piece), else its text's.
        Cached."""
        raw = self._bytes.get(token_id)
        if raw is None:
            text = self(token_id)
            piece = None
            if "\ufffd" in text or text[:1] != " ":  # part of a character, or a space decoding may have dropped
                piece = _piece_bytes(self.tokenizer.convert_ids_to_tokens(token_id), "\ufffd" in text)
            raw = self._bytes[token_id] = text.encode("utf-8") if piece is None else piece
        return raw

    def name(self, entries) -> None:
        """Set ``decoded_token`` on every :class:`specray.outputs.Logprob` of ``entries`` (an iterable of
        {token_id: Logprob} maps; None entries, a prompt's first, are passed over)."""
        for entry in entries:
            if entry is not None:
                for token_id, logprob in entry.items():
                    logprob.decoded_token = self(token_id)
