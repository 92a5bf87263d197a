"""``lookahead``: lookahead (Jacobi) decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference
Using Lookahead Decoding"; TensorRT-LLM's ``LookaheadDecodingConfig``, llama.cpp's examples/lookahead), drafted
without a draft model and verified as one token tree. Torch-free.

Window. Per request, N - 1 levels (N = ``max_ngram_size``) of W columns (W = ``max_window_size``) of guessed
future tokens: with the root (the request's last kept token) at position P, level j column c guesses the token
at P + c + j; level 0 column 0 is the root itself. Each step the target runs the lookahead branch beside the
n-grams it verifies: column c's sequence root, l0[1..c], l1[c], .., l_{N-2}[c] at consecutive positions, laid out
as a tree (the trunk root -> l0[1] -> .. -> l0[W-1]; from the root, column 0, and from each trunk node l0[c] the
chain l1[c] -> .. -> l_{N-2}[c]), so a node's depth is its position offset and tree attention shows each node its
column's prefix. The target's argmax after column c's last-level node (``observe_node_tokens``; for N = 2 and
column 0, the root, it is the first kept token) is column c's next Jacobi iterate, a guess at P + c + N - 1.

Update (llama.cpp's rule), once the target kept tokens after the root: the first kept token takes one Jacobi
step: each column with an iterate gives the n-gram (l0[c], l1[c], .., l_{N-2}[c], iterate) to the pool, the levels
shift down (level j <- level j + 1) and the iterates become the last level; each further kept token shifts the
levels again, the new level 0 copied into the last level (nothing is known there). A column without an iterate
(the scheduler cut its node, the policy verified nothing, or it was left out) shifts the same way and gives no
n-gram. A shift keeps the window's positions relative to the new root: level j + 1 guessed P + c + j + 1.

Pool (llama.cpp's ngram_container): per request, per first token, a FIFO of at most G
(``max_verification_set_size``) (N - 1)-grams that followed it; an n-gram seen again moves to the newest place
rather than being stored twice. With ``pool_from_history`` (default) the request's own prompt and kept output feed
it as well (LADE's pool_from_prompt, extended to the output), so a stretch that repeats is verified as soon as its
first token recurs; without it the pool holds the window's n-grams only, as in the paper.

Tree: the verification branch first (the pool's n-grams after the root token, newest first, merged into a trie
under the root; node score count(node) / (count(parent) + 1), the n-grams through a node against those through its
parent), then the lookahead branch (trunk, then level by level; score ``LOOKAHEAD_SCORE``, which the draft
policy multiplies by the per-level acceptance it measures). The proposal is ``whole`` (the policy verifies all of it or nothing: the window is
an investment) and ``wants_node_tokens``. With fewer drafts allowed than the full tree (a request's
``num_speculative_tokens``) the verification branch shrinks first (the trie is cut where the room ends), then the
window's columns (the first w, whose w - 1 + w (N - 2) nodes fit); the columns left out shift without an iterate.
The scheduler may cut the tree further (a prefix by depth); the engine hands back the node tokens in proposal
order with -1 for cut nodes.

The window starts as random tokens of the request's history (llama.cpp's initialisation), drawn from a generator
seeded by the history itself: deterministic per request, no global RNG.
"""

from __future__ import annotations

import random
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

from specray.config import SpeculativeConfig
from specray.drafters.base import DrafterContext, Proposal
from specray.drafters.ngram_common import LookupDrafter, LookupState, check_bool, check_int
from specray.tree import DraftTree

METHOD = "lookahead"
LOOKAHEAD_SCORE = 0.1  # a lookahead node's prior P(accepted | parent accepted): a guess still being iterated
_ROOT = -1


@dataclass
class LookaheadOptions:
    """``speculative_config`` keys of ``method="lookahead"`` (TensorRT-LLM's ``LookaheadDecodingConfig`` names)."""

    ALIASES: ClassVar[dict[str, str]] = {"window_size": "max_window_size", "ngram_size": "max_ngram_size",
                                         "verification_set_size": "max_verification_set_size"}

    max_window_size: int = 4  # W: the window's columns (the lookahead's reach, in tokens)
    max_ngram_size: int = 3  # N: n-gram length; the window has N - 1 levels
    max_verification_set_size: int = 4  # G: pool n-grams verified per step (and kept per first token)
    pool_from_history: bool = True  # the request's prompt and output feed the pool too

    def __post_init__(self) -> None:
        check_int(METHOD, "max_window_size", self.max_window_size, 1, 64, what="W, the window's columns")
        check_int(METHOD, "max_ngram_size", self.max_ngram_size, 2, 16, what="N, the n-gram length; N - 1 levels")
        check_int(METHOD, "max_verification_set_size", self.max_verification_set_size, 0, 64,
                  what="G, n-grams verified per step; 0 verifies none")
        check_bool(METHOD, "pool_from_history", self.pool_from_history)
        if self.lookahead_nodes == 0:
            raise ValueError("speculative_config.max_window_size=1 with max_ngram_size=2 leaves method='lookahead' "
                             "no lookahead branch (W - 1 + W * (N - 2) = 0 nodes); raise max_window_size to >= 2 "
                             "or max_ngram_size to >= 3")

    @property
    def lookahead_nodes(self) -> int:
        """The lookahead branch: W - 1 trunk nodes and a chain of N - 2 under the root and each trunk node."""
        W, N = self.max_window_size, self.max_ngram_size
        return W - 1 + W * (N - 2)

    @property
    def tree_size(self) -> int:
        """The whole tree: the lookahead branch and G n-grams of N - 1 tokens (fewer when they share a prefix)."""
        return self.lookahead_nodes + self.max_verification_set_size * (self.max_ngram_size - 1)

    # the options that size the tree (a draft count left unset: its default_draft_count)
    TREE_SIZED_BY: ClassVar[str] = "max_window_size, max_ngram_size or max_verification_set_size"

    @property
    def default_draft_count(self) -> int:
        """``num_speculative_tokens`` when it is not given: the whole tree."""
        return self.tree_size

    def check_budget(self, k: int) -> None:
        """The tree must fit ``k`` = ``num_speculative_tokens`` drafts (checked before anything starts)."""
        if k < self.tree_size:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={k} is smaller than method='lookahead''s tree of "
                f"{self.tree_size} nodes (W - 1 + W * (N - 2) + G * (N - 1) with max_window_size W="
                f"{self.max_window_size}, max_ngram_size N={self.max_ngram_size}, max_verification_set_size G="
                f"{self.max_verification_set_size}); raise num_speculative_tokens to {self.tree_size} (or leave it "
                "unset), or lower max_verification_set_size, max_window_size or max_ngram_size")

    @classmethod
    def fitted_to(cls, k: int) -> dict[str, int]:
        """Options whose tree fits ``k`` drafts, the defaults shrunk step by step until it does (the verification
        set first, then the window's columns, then the n-gram length): a per-request ``speculative_method`` on an
        engine whose ``num_speculative_tokens`` is below the default tree."""
        o = cls()
        while o.tree_size > k:
            G, W, N = o.max_verification_set_size, o.max_window_size, o.max_ngram_size
            if G > 1:
                step = {"max_verification_set_size": G - 1}
            elif W > 2:
                step = {"max_window_size": W - 1}
            elif G > 0:
                step = {"max_verification_set_size": G - 1}
            elif N > 2:
                step = {"max_ngram_size": N - 1}
            else:
                break
            o = replace(o, **step)
        return {"max_window_size": o.max_window_size, "max_ngram_size": o.max_ngram_size,
                "max_verification_set_size": o.max_verification_set_size}


@dataclass(slots=True)
class _Layout:
    """The pending proposal: the history length it was made at and, per column sent, its last-level node."""

    anchor: int
    columns: list[int]


class LookaheadState(LookupState):
    """A request's window, pool and pending proposal; ``anchor`` is the history length the window is aligned to
    (its root is ``tokens[anchor - 1]``)."""

    def __init__(self, options: LookaheadOptions):
        super().__init__()
        self.W, self.N, self.G = options.max_window_size, options.max_ngram_size, options.max_verification_set_size
        self.from_history = options.pool_from_history
        self.levels: list[list[int]] | None = None  # N - 1 levels of W guesses
        self.anchor = 0
        self.pool: dict[int, list[tuple[int, ...]]] = {}  # first token -> (N - 1)-grams, oldest first
        self.indexed = 0  # history n-grams starting before this were added to the pool
        self.layout: _Layout | None = None
        self.node_tokens: list[int] | None = None  # the target's argmax after each node of the pending proposal

    # ---- the history -----------------------------------------------------------------------------------
    def advance(self, start: int) -> None:
        if self.from_history and self.G:
            self._index_history()
        if self.levels is None:
            self.ready()
            return
        self._catch_up()
        self.levels[0][0] = self.tokens[-1]

    def rewind(self, kept: int) -> None:
        self.indexed = min(self.indexed, max(0, kept - self.N + 1))
        if kept < self.anchor:  # the window's root is gone: start it again from the history
            self.levels, self.layout, self.node_tokens = None, None, None

    def ready(self) -> None:
        """Start the window from the history when there is none."""
        if self.levels is not None:
            return
        tokens = self.tokens
        rng = random.Random(zlib.crc32(array("q", tokens).tobytes()))
        pick = tokens[1:] or tokens
        self.levels = [[pick[rng.randrange(len(pick))] for _ in range(self.W)] for _ in range(self.N - 1)]
        self.anchor = len(tokens)
        self.levels[0][0] = tokens[-1]

    def _index_history(self) -> None:
        tokens, N = self.tokens, self.N
        for i in range(self.indexed, len(tokens) - N + 1):
            self.add_ngram(tokens[i:i + N])
        self.indexed = max(self.indexed, len(tokens) - N + 1)

    def _catch_up(self) -> None:
        """The tokens kept since the anchor: one Jacobi step with the iterates, then plain shifts (after N of
        them every level is the same copy: more change nothing)."""
        new = len(self.tokens) - self.anchor
        iterates = self._iterates()
        for step in range(min(new, self.N)):
            self.jacobi_step(iterates if step == 0 else None)
        self.anchor = len(self.tokens)
        self.layout, self.node_tokens = None, None

    def _iterates(self) -> list[int | None] | None:
        """Per column the target's argmax after its last-level node, None where unknown; None when the pending
        proposal got no node tokens."""
        layout, told = self.layout, self.node_tokens
        if layout is None or told is None or layout.anchor != self.anchor:
            return None
        out: list[int | None] = [None] * self.W
        for c, node in enumerate(layout.columns):
            if node == _ROOT:
                out[c] = self.tokens[self.anchor]  # the root's own row: the first kept token
            elif node < len(told) and told[node] >= 0:
                out[c] = told[node]
        return out

    # ---- the window and the pool -----------------------------------------------------------------------
    def jacobi_step(self, iterates: Sequence[int | None] | None) -> None:
        """Shift the levels down one; the last level takes the iterates, where known, else the new level 0.
        Each column with an iterate gives its n-gram to the pool."""
        levels = self.levels
        fallback = levels[1] if len(levels) > 1 else levels[0]
        iterates = iterates or [None] * self.W
        if self.G:
            for c, token in enumerate(iterates):
                if token is not None:
                    self.add_ngram([level[c] for level in levels] + [token])
        last = [fallback[c] if token is None else token for c, token in enumerate(iterates)]
        self.levels = levels[1:] + [last]

    def add_ngram(self, gram: Sequence[int]) -> None:
        """(first token, then N - 1): the newest entry of its first token's FIFO of at most G."""
        rest = tuple(gram[1:])
        found = self.pool.setdefault(gram[0], [])
        if rest in found:
            found.remove(rest)
        found.append(rest)
        if len(found) > self.G:
            del found[0]


class LookaheadDrafter(LookupDrafter):
    """Lookahead decoding: a Jacobi window run by the target beside the pool's n-grams, one tree per step."""

    name = METHOD

    def __init__(self, spec: SpeculativeConfig, ctx: DrafterContext):
        super().__init__(spec, ctx)
        self.options.check_budget(self.num_speculative_tokens)

    def observe_node_tokens(self, req_id: str, node_tokens: Sequence[int]) -> None:
        """The target's argmax after each node of this request's last proposal (-1: not verified)."""
        state = self._states.get(req_id)
        if state is not None:
            state.node_tokens = list(node_tokens)

    def _new_state(self) -> LookaheadState:
        return LookaheadState(self.options)

    def _draft(self, state: LookaheadState, k: int) -> Proposal:
        state.ready()
        columns, room = self._shape(k)
        tree = DraftTree([], [], [])
        if room:
            _add_verification(tree, state.pool.get(state.tokens[-1], ()), room)
        last = _add_lookahead(tree, state.levels, columns)
        if not len(tree):
            return Proposal([])
        state.layout, state.node_tokens = _Layout(state.anchor, last), None
        return Proposal(tree.token_ids, parents=tree.parents, scores=tree.scores, whole=True,
                        wants_node_tokens=True)

    def _shape(self, k: int) -> tuple[int, int]:
        """(window columns, verification nodes) for at most k nodes: the verification branch shrinks first,
        then the columns (w columns take w (N - 1) - 1 nodes)."""
        o = self.options
        if k >= o.lookahead_nodes:
            return o.max_window_size, k - o.lookahead_nodes
        return min(o.max_window_size, (k + 1) // (o.max_ngram_size - 1)), 0


def _add_node(tree: DraftTree, token: int, parent: int, score: float) -> int:
    tree.token_ids.append(token)
    tree.parents.append(parent)
    tree.scores.append(score)
    return len(tree) - 1


def _add_verification(tree: DraftTree, grams: Sequence[tuple[int, ...]], room: int) -> None:
    """The n-grams, newest first, as a trie under the root, cut at ``room`` nodes; scored by counts."""
    children: dict[tuple[int, int], int] = {}
    counts: list[int] = []
    grams = list(grams)[::-1]
    for gram in grams:
        parent = _ROOT
        for token in gram:
            node = children.get((parent, token))
            if node is None:
                if len(tree) >= room:
                    break
                node = children[(parent, token)] = _add_node(tree, token, parent, 0.0)
                counts.append(0)
            counts[node] += 1
            parent = node
    for i, p in enumerate(tree.parents):
        tree.scores[i] = counts[i] / ((len(grams) if p == _ROOT else counts[p]) + 1)


def _add_lookahead(tree: DraftTree, levels: list[list[int]], columns: int) -> list[int]:
    """The first ``columns`` columns of the window (trunk, then level by level); per column its last-level node
    (the root for column 0 of a one-level window)."""
    last = [_ROOT]
    for c in range(1, columns):
        last.append(_add_node(tree, levels[0][c], last[-1], LOOKAHEAD_SCORE))
    for level in levels[1:]:
        for c in range(columns):
            last[c] = _add_node(tree, level[c], last[c], LOOKAHEAD_SCORE)
    return last[:columns]
