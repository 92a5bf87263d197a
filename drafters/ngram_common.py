"""What the llama.cpp n-gram family (``ngram_simple``, ``ngram_map_k``, ``ngram_map_k4v``, ``ngram_mod``,
``ngram_cache``) shares: the per-request copy of the history, caught up incrementally; the drafter skeleton
(per-request states, statistics, feedback from the previous proposal); option checks. Torch-free.

Per request, a drafter keeps a :class:`LookupState`: its own copy of the history and what it derived from it.
Each call the drafter is given the request's whole history; :meth:`LookupState.sync` finds how much of the copy
still holds (a compare of its last 64 tokens when it is the list seen last time, grown by appends; a full
compare only when the list is new or was rewound in place), lets the state *undo* the tokens that no longer hold (``rewind``, newest first) and
*index* the new ones (``advance``). So a step costs O(new tokens), and a rewound history (shorter, or changed
from some position on) leaves the state exactly as if the current history had been indexed from scratch.

Feedback: after a non-empty proposal the state remembers the history length it was made at (its root). At the
next call whose history has grown past the root (and still holds up to it) the drafter's ``_learn`` sees what the
target kept (``tokens[root:]``): the accepted drafts plus the target's own next token.

``finish`` forgets a request. It is also called for a preempted request, which may come back later with the same
id and its history: it is then indexed afresh, as a new request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, ClassVar

from specray.config import SpeculativeConfig
from specray.drafters.base import DraftRequest, DrafterContext, Proposal
from specray.drafters.ngram import common_prefix
from specray.drafters.registry import options_of
from specray.drafters.stats import DrafterStats
from specray.sampling_params import is_int

logger = logging.getLogger(__name__)

KEY_CAP = 32  # proposal keys (match strengths) are capped, so the draft-length policy sees few kinds of guess
_TAIL_CHECK = 64  # tokens of the copy compared with a history list seen before (an in-place rewind shows there)


# ---------------------------------------------------------------------------------------------- option checks


def check_int(method: str, name: str, value, minimum: int, maximum: int | None = None, what: str = "") -> None:
    """A ValueError naming the option, its value and the range it must lie in."""
    if is_int(value) and value >= minimum and (maximum is None or value <= maximum):
        return
    bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    hint = f" ({what})" if what else ""
    raise ValueError(f"speculative_config.{name}={value!r} must be an int {bound} for method={method!r}{hint}")


def check_bool(method: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"speculative_config.{name}={value!r} must be true or false for method={method!r}")


def check_fraction(method: str, name: str, value, what: str = "") -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0):
        hint = f" ({what})" if what else ""
        raise ValueError(f"speculative_config.{name}={value!r} must be a number in [0, 1] for method={method!r}{hint}")


# ---------------------------------------------------------------------------------------------- small helpers


def suffix_match_length(tokens: Sequence[int], end_a: int, end_b: int, limit: int) -> int:
    """How many tokens (at most ``limit``) end both ``tokens[:end_a]`` and ``tokens[:end_b]``."""
    limit = min(limit, end_a, end_b)
    length = 0
    while length < limit and tokens[end_a - 1 - length] == tokens[end_b - 1 - length]:
        length += 1
    return length


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two short sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------------------- per-request state


class LookupState:
    """A request's copy of its history (``tokens``) and what a drafter derived from it; subclasses index it in
    :meth:`advance` and undo it in :meth:`rewind`."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.source: Sequence[int] | None = None  # the history object synced last
        self.pending_root = -1  # history length at the last non-empty proposal (-1: none to learn from)
        self.pending: Any = None  # what the drafter needs to learn from that proposal
        self.last_check = 0  # history length at the last lookup (llama.cpp's idx_last_check, for check_rate)

    def advance(self, start: int) -> None:
        """Index ``tokens[start:]`` (just appended)."""

    def rewind(self, kept: int) -> None:
        """Undo the indexing of ``tokens[kept:]`` (still there; they go right after)."""

    def sync(self, history: Sequence[int]) -> int:
        """Make the copy read ``history``; returns how many leading tokens of the old copy still held."""
        kept = self._still_holds(history)
        if kept < len(self.tokens):
            logger.debug("%s: history changed at token %d of %d; rewinding", type(self).__name__, kept,
                         len(self.tokens))
            self.rewind(kept)
            del self.tokens[kept:]
        if len(history) > kept:
            self.tokens.extend(history[kept:])
            self.advance(kept)
        self.source = history
        return kept

    def _still_holds(self, history: Sequence[int]) -> int:
        tokens = self.tokens
        n = len(tokens)
        if history is self.source and len(history) >= n:
            lo = max(0, n - _TAIL_CHECK)
            tail = history[lo:n]
            if (tail if isinstance(tail, list) else list(tail)) == tokens[lo:]:
                return n
        return common_prefix(tokens, history)

    def check_due(self, check_rate: int) -> bool:
        """llama.cpp's ``--spec-ngram-check-rate``: look up only when ``check_rate`` tokens came since the last
        lookup (or the history got shorter)."""
        length = len(self.tokens)
        if self.last_check + check_rate > length and length > self.last_check:
            return False
        self.last_check = length
        return True


# ---------------------------------------------------------------------------------------------- the drafter skeleton


class LookupDrafter:
    """The skeleton of a lookup drafter: per-request :class:`LookupState` s kept in step with each history,
    llama.cpp-style :class:`~specray.drafters.stats.DrafterStats`, and feedback from the previous proposal.

    A subclass sets ``name``, and implements ``_new_state`` and ``_draft(state, k) -> Proposal`` (at most ``k``
    nodes); it may implement ``_begin`` (a request seen for the first time), ``_learn`` (what the target kept of
    the last proposal) and ``_on_finish``. Deterministic: ``probs`` is always None.
    """

    cheap_proposals = True  # a lookup: the engine asks for the most drafts and sizes k by the proposal's key
    name: ClassVar[str] = "lookup"

    def __init__(self, spec: SpeculativeConfig, ctx: DrafterContext):
        self.options = options_of(spec)
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.ctx = ctx
        self._states: dict[str, LookupState] = {}
        self._stats = DrafterStats(self.name)

    # ---- the protocol ----------------------------------------------------------------------------------
    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        return [self._propose_one(req) for req in batch]

    def finish(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            state = self._states.pop(req_id, None)
            if state is not None:
                self._on_finish(req_id, state)

    def shutdown(self) -> None:
        """Nothing to release: every table lives in this process."""

    def stats(self) -> dict:
        """llama.cpp-style statistics (``#calls``, ``#gen drafts``, ...; see ``specray.drafters.stats``)."""
        return {**self._stats.as_dict(), **self._extra_stats()}

    def observe_verification(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        """The engine's count of what the target kept of this request's last proposal (exact statistics)."""
        self._stats.verified(req_id, num_drafted, num_accepted)

    # ---- one request -----------------------------------------------------------------------------------
    def _propose_one(self, req: DraftRequest) -> Proposal:
        history = req.token_ids
        self._stats.begin_call()
        state = self._states.get(req.req_id)
        fresh = state is None
        if fresh:
            state = self._states[req.req_id] = self._new_state()
        with self._stats.timer("begin" if fresh else "acc"):
            if fresh:
                self._begin(state)
            self._settle(state, state.sync(history))
        k = min(req.num_speculative_tokens, self.num_speculative_tokens)
        if k <= 0:
            return Proposal([])
        with self._stats.timer("gen"):
            proposal = self._draft(state, k)
        tree = proposal.tree()
        if len(tree):
            state.pending_root = len(state.tokens)
            self._stats.proposed(len(tree))
        return proposal

    def _settle(self, state: LookupState, kept: int) -> None:
        """Learn from the previous proposal once the history has grown past its root (and still holds to it)."""
        root = state.pending_root
        if root < 0:
            return
        if kept < root:
            state.pending_root, state.pending = -1, None  # rewound before the proposal: nothing to learn
        elif len(state.tokens) > root:
            self._learn(state, root)
            state.pending_root, state.pending = -1, None

    # ---- hooks -------------------------------------------------------------------------------------------
    def _new_state(self) -> LookupState:
        raise NotImplementedError

    def _draft(self, state: LookupState, k: int) -> Proposal:
        raise NotImplementedError

    def _begin(self, state: LookupState) -> None:
        """A request seen for the first time (its state is still empty)."""

    def _learn(self, state: LookupState, root: int) -> None:
        """``state.tokens[root:]`` followed the last proposal (its record is ``state.pending``)."""

    def _on_finish(self, req_id: str, state: LookupState) -> None:
        """``req_id`` finished (or was preempted): its state is dropped after this."""

    def _extra_stats(self) -> dict:
        return {}
