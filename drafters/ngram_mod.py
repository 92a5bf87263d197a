"""``ngram_mod``: llama.cpp's ``--spec-type ngram-mod``, a hashed n-gram pool of constant memory shared by every
request of the engine. Torch-free.

Pool: a fixed table of ``pool_size`` int32 slots (16 MiB at the default 4M, as llama.cpp), all EMPTY at first.
An n-gram of ``ngram_size_n`` tokens hashes, as in llama.cpp, to ``h = sum(t_i * A^(n-1-i)) mod 2^64`` with the
LCG multiplier ``A = 6364136223846793005``, and to the slot ``h mod pool_size``; the slot holds the token that
last followed an n-gram hashing there (collisions overwrite: the pool is lossy by design). Being polynomial, the
hash rolls: sliding the window one token costs O(1) whatever ``n``.

Learning: every request adds each of its n-grams with the token after it, as its history grows (O(1) per token).
All requests share the pool, so a request drafts from text any other one produced, finished ones included.

Drafting (variable length, llama.cpp's rule): from the history's last ``n`` tokens, read the slot's token, append
it, slide the window, repeat, up to ``min(draft_max, k)`` tokens; at the first EMPTY slot stop, and if fewer than
``draft_min`` tokens were drafted by then propose nothing.

Resets, as llama.cpp's code: when a new request arrives and more than ``reset_occupancy`` of the slots are filled,
the pool is cleared (0 disables). Optionally (``reset_low_streak`` > 0; llama.cpp uses 3) after that many proposals
of one request in a row of which the target kept less than half, the pool is cleared and that request's history
is added again. Off by default here: the drafter reads what was kept from the history, and cannot tell a draft
the target rejected from one the engine's adaptive policy cut before verifying (llama.cpp verifies every draft
whole), so the streak would wipe a well-accepted shared pool.

Differences from llama.cpp (deliberate): n-grams are added as tokens arrive (llama.cpp adds them in chunks of 32
tokens), occupancy counts filled slots (llama.cpp's counter counts overwrites of filled slots), and the
occupancy reset happens before a new request's prompt is added (llama.cpp adds the prompt, then may clear it).
A rewound request re-adds its new tokens; what the pool learnt from the undone ones stays (nothing is removed
from a lossy table). ``key`` is None: every match is exactly ``n`` tokens long.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from specray.config import SpeculativeConfig
from specray.drafters.base import DrafterContext, Proposal
from specray.drafters.ngram_common import LookupDrafter, LookupState, check_fraction, check_int
from specray.drafters.stats import accepted_length

logger = logging.getLogger(__name__)

METHOD = "ngram_mod"
LCG_MULT = 6364136223846793005  # llama.cpp's common_ngram_mod::idx multiplier
MASK64 = (1 << 64) - 1
EMPTY = -1
DEFAULT_POOL_SIZE = 4 * 1024 * 1024  # slots (int32 each): 16 MiB


@dataclass
class NgramModOptions:
    """``speculative_config`` keys of ``method="ngram_mod"`` (llama.cpp's names; the defaults of its ngram-mod
    sample usage, ``--draft-min 48 --draft-max 64``, not its global ``--draft-min 0 --draft-max 16``)."""

    ngram_size_n: int = 24  # --spec-ngram-mod-n-match: tokens hashed per lookup (small n are not recommended)
    # --draft-min: a chain that breaks before this many tokens is dropped; None: 48, or draft_max if smaller
    draft_min: int | None = None
    # --draft-max: the longest chain (and at most the draft count asked for); None: 64, or draft_min if larger
    draft_max: int | None = None
    pool_size: int = DEFAULT_POOL_SIZE  # slots of the shared table (4 bytes each)
    reset_occupancy: float = 0.25  # clear the pool when a request arrives and more slots are filled (0: never)
    reset_low_streak: int = 0  # clear it after this many poorly accepted proposals in a row (0: never)

    def __post_init__(self) -> None:
        check_int(METHOD, "ngram_size_n", self.ngram_size_n, 1, 1024, what="llama.cpp's --spec-ngram-mod-n-match")
        # one of draft_min / draft_max given alone is never refused for the other's default, which follows it
        if self.draft_min is not None:
            check_int(METHOD, "draft_min", self.draft_min, 0, 1024, what="llama.cpp's --draft-min")
        if self.draft_max is not None:
            check_int(METHOD, "draft_max", self.draft_max, 1, 1024, what="llama.cpp's --draft-max")
        if self.draft_max is None:
            self.draft_max = max(64, self.draft_min or 0)
        if self.draft_min is None:
            self.draft_min = min(48, self.draft_max)
        if self.draft_min > self.draft_max:
            raise ValueError(f"speculative_config.draft_min={self.draft_min} and draft_max={self.draft_max} must "
                             f"satisfy draft_min <= draft_max for method={METHOD!r}")
        check_int(METHOD, "pool_size", self.pool_size, 1, 1 << 31, what="slots of the shared hash table")
        check_fraction(METHOD, "reset_occupancy", self.reset_occupancy, "0 never resets")
        check_int(METHOD, "reset_low_streak", self.reset_low_streak, 0, what="0 never resets")


def ngram_hash(tokens: Sequence[int]) -> int:
    """llama.cpp's n-gram hash: ``h = h * A + t`` over the tokens, modulo 2^64."""
    h = 0
    for token in tokens:
        h = (h * LCG_MULT + token) & MASK64
    return h


class NgramModPool:
    """The fixed table of ``size`` slots mapping an n-gram's hash to the token that last followed it."""

    def __init__(self, n: int, size: int):
        self.n, self.size = n, size
        self.table = array("i", [EMPTY]) * size
        self.used = 0  # filled slots
        self._lead = pow(LCG_MULT, n - 1, 1 << 64)  # A^(n-1): the weight of the token leaving the window

    def roll(self, h: int, leaving: int, entering: int) -> int:
        """The hash of the window slid by one token."""
        return ((h - leaving * self._lead) * LCG_MULT + entering) & MASK64

    def add(self, h: int, token: int) -> None:
        slot = h % self.size
        if self.table[slot] == EMPTY:
            self.used += 1
        self.table[slot] = token

    def get(self, h: int) -> int:
        return self.table[h % self.size]

    def reset(self) -> None:
        self.table = array("i", [EMPTY]) * self.size
        self.used = 0

    @property
    def occupancy(self) -> float:
        return self.used / self.size

    @property
    def size_bytes(self) -> int:
        return self.table.itemsize * len(self.table)


class ModState(LookupState):
    """A request's place in the shared pool: ``h`` is the hash of its last ``n`` tokens (when it has that many)."""

    def __init__(self, pool: NgramModPool):
        super().__init__()
        self.pool = pool
        self.h = 0
        self.low_streak = 0

    def advance(self, start: int) -> None:
        tokens, n, pool = self.tokens, self.pool.n, self.pool
        if len(tokens) < n:
            return
        if start < n:
            start, self.h = n, ngram_hash(tokens[:n])
        h, roll, add = self.h, pool.roll, pool.add
        for t in range(start, len(tokens)):  # the n-gram ending before t was followed by tokens[t]
            add(h, tokens[t])
            h = roll(h, tokens[t - n], tokens[t])
        self.h = h

    def rewind(self, kept: int) -> None:
        n = self.pool.n
        self.h = ngram_hash(self.tokens[kept - n:kept]) if kept >= n else 0

    def chain(self, limit: int, minimum: int) -> list[int]:
        """llama.cpp's variable-length draft: follow the pool from the last n tokens (see the module docstring)."""
        n, pool = self.pool.n, self.pool
        if len(self.tokens) < n:
            return []
        window = self.tokens[-n:]
        h, out = self.h, []
        for i in range(limit):
            token = pool.get(h)
            if token == EMPTY:
                return [] if i < minimum else out
            out.append(token)
            window.append(token)
            h = pool.roll(h, window[i], token)
        return out


class NgramModDrafter(LookupDrafter):
    """Draft by following one hashed n-gram pool shared by every request of the engine."""

    name = METHOD

    def __init__(self, spec: SpeculativeConfig, ctx: DrafterContext):
        super().__init__(spec, ctx)
        self.pool = NgramModPool(self.options.ngram_size_n, self.options.pool_size)

    def _new_state(self) -> ModState:
        return ModState(self.pool)

    def _begin(self, state: ModState) -> None:
        threshold = self.options.reset_occupancy
        if threshold and self.pool.occupancy > threshold:
            logger.warning("ngram_mod: pool occupancy %.2f exceeds %.2f; clearing it", self.pool.occupancy, threshold)
            self.pool.reset()

    def _draft(self, state: ModState, k: int) -> Proposal:
        draft = state.chain(min(self.options.draft_max, k), self.options.draft_min)
        if draft:
            state.pending = draft
        return Proposal(draft)

    def _learn(self, state: ModState, root: int) -> None:
        """llama.cpp's low-acceptance streak: clear the pool after ``reset_low_streak`` poor proposals in a row."""
        draft = state.pending
        kept = accepted_length(Proposal(draft).tree(), state.tokens[root:root + len(draft)])
        if 2 * kept >= len(draft):
            state.low_streak = 0
            return
        state.low_streak += 1
        if self.options.reset_low_streak and state.low_streak >= self.options.reset_low_streak:
            logger.info("ngram_mod: %d poorly accepted drafts in a row; clearing the pool", state.low_streak)
            self.pool.reset()
            state.low_streak = 0
            state.advance(0)  # this request's history goes back in (llama.cpp's i_last = 0)

    def _extra_stats(self) -> dict:
        return {"pool_slots": self.pool.size, "pool_used": self.pool.used, "pool_bytes": self.pool.size_bytes}
