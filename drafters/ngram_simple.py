"""``ngram_simple``: llama.cpp's ``--spec-type ngram-simple``. Torch-free.

Algorithm: take the last ``n`` tokens of the history (the current n-gram, ``ngram_size_n``); find the most recent
earlier place where the same ``n`` tokens occurred and were followed by at least one token; propose the (up to)
``m`` tokens that followed there (``ngram_size_m``, and at most the draft count asked for). The continuation may
run into the current n-gram itself (a repeating pattern proposes its next period). With ``check_rate`` R a
lookup happens only when R tokens came since the last one (llama.cpp's ``--spec-ngram-check-rate``).

Incremental index: n-gram -> the start positions of its occurrences that a token follows, oldest first; each new
token adds the occurrence it completes, a rewind pops the occurrences of the undone tokens (newest first). A
lookup is one dict lookup plus the slice it returns.

Differences from llama.cpp (deliberate): llama.cpp scans the history backwards on every lookup (O(history)); we
keep the index. It also ignores an occurrence at position 0, needs more than ``n + m + 1`` tokens of history
before drafting and drops drafts shorter than ``n``; we draft from any earlier occurrence, as documented
("the m tokens following the matched n-gram", fewer when fewer follow).

A proposal's ``key`` is the match length: how many tokens before the two occurrences agree, the n-gram
included, capped at ``max(n, KEY_CAP)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from specray.drafters.base import Proposal
from specray.drafters.ngram_common import KEY_CAP, LookupDrafter, LookupState, check_int, suffix_match_length

METHOD = "ngram_simple"


@dataclass
class NgramSimpleOptions:
    """``speculative_config`` keys of ``method="ngram_simple"`` (llama.cpp's names and defaults)."""

    ngram_size_n: int = 12  # --spec-ngram-size-n: length of the n-gram looked up
    ngram_size_m: int = 48  # --spec-ngram-size-m: the most tokens drafted after a match
    check_rate: int = 1  # --spec-ngram-check-rate: look up every R tokens

    def __post_init__(self) -> None:
        check_int(METHOD, "ngram_size_n", self.ngram_size_n, 1, what="llama.cpp's --spec-ngram-size-n")
        check_int(METHOD, "ngram_size_m", self.ngram_size_m, 1, what="llama.cpp's --spec-ngram-size-m")
        check_int(METHOD, "check_rate", self.check_rate, 1, what="look up every check_rate tokens")


class SimpleState(LookupState):
    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> starts of its occurrences a token follows

    def advance(self, start: int) -> None:
        tokens, n, starts = self.tokens, self.n, self.starts
        for t in range(max(start, n), len(tokens)):  # token t completes the occurrence at t - n
            gram = tuple(tokens[t - n:t])
            found = starts.get(gram)
            if found is None:
                starts[gram] = [t - n]
            else:
                found.append(t - n)

    def rewind(self, kept: int) -> None:
        tokens, n, starts = self.tokens, self.n, self.starts
        for t in range(len(tokens) - 1, max(kept, n) - 1, -1):
            gram = tuple(tokens[t - n:t])
            found = starts[gram]
            found.pop()
            if not found:
                del starts[gram]

    def lookup(self) -> int | None:
        """Start of the most recent earlier occurrence of the current n-gram (None: there is none)."""
        if len(self.tokens) <= self.n:
            return None
        found = self.starts.get(tuple(self.tokens[-self.n:]))
        return found[-1] if found else None


class NgramSimpleDrafter(LookupDrafter):
    """Propose the ``m`` tokens that followed the last earlier occurrence of the history's last ``n`` tokens."""

    name = METHOD

    def _new_state(self) -> SimpleState:
        return SimpleState(self.options.ngram_size_n)

    def _draft(self, state: SimpleState, k: int) -> Proposal:
        if not state.check_due(self.options.check_rate):
            return Proposal([])
        start = state.lookup()
        if start is None:
            return Proposal([])
        n, tokens = state.n, state.tokens
        begin = start + n
        draft = tokens[begin:begin + min(self.options.ngram_size_m, k)]
        key = suffix_match_length(tokens, begin, len(tokens), max(n, KEY_CAP))
        return Proposal(draft, key=key)
