"""Incremental detokenization and stop-string detection, one token at a time."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text without re-decoding the whole output every step.

    Decodes a short window ``tokens[prefix:]`` and emits the part beyond what the window's start already
    produced, holding back text that ends in an incomplete UTF-8 sequence (U+FFFD) until the next token.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = list(prompt_token_ids[-6:])  # a little context for leading spaces
        self.prefix = 0
        self.read = len(self.tokens)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

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


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Where the earliest stop string in ``text`` ends, looking only at matches that touch its last
    ``new_len`` characters. Returns (index where the stop string starts, the stop string) or None."""
    best = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_len - len(stop) + 1))
        if start != -1 and (best is None or start < best[0]):
            best = (start, stop)
    return best
