"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; vLLM's ``method="suffix"``): model-free token trees drawn
from a suffix trie of the request's own text and one of recently finished requests' text. Torch-free.

Data structure: a depth-bounded suffix trie with counts
-------------------------------------------------------
Over a set of token sequences, the node of a string ``s`` (``1 <= |s| <= D``, ``D = max_tree_depth``) holds
``count(s)``, the number of places where ``s`` occurs (overlaps included; no occurrence spans two sequences). It is
the trie of every suffix of every sequence cut to D tokens, each inserted with +1 on every node it passes. Counts
only shrink going down: ``count(s + c) <= count(s)``.

*Implicit chains.* A node of count 1 has a single occurrence, so all of its subtree is one chain: the tokens
that follow that occurrence in its sequence. Such a node keeps no children but ``tail``, the place where that
chain goes on (``sid << 32 | pos``), and the chain is read from the sequence when asked. A node is stored only
once its parent's string has occurred twice, so text that rarely repeats costs a few nodes per token instead of
D, and an append walks only the suffixes that occurred before. The counts it stands for are exactly the full
trie's (the tests compare both with a brute-force count).

*Append* (token ``t`` at position ``q``, O(D)): the stored nodes of the suffixes ending at ``q - 1``, shortest
first (the "active" nodes, the root first), each count their child ``t``: a new child (count 1, tail ``q + 1``),
an increment, or a *split*: a count-1 child meeting its second occurrence gets count 2 and its first
occurrence's next token stored as a count-1 grandchild with a tail. The walk stops at the first active node
with a tail: its chain already reads ``t``, and every longer suffix lies in it.

*Undo* (a rewound history): each append journals the active nodes it started from and the splits it made, for
the last ``_UNDO_WINDOW`` appends; popping a token decrements the nodes it counted (deleting those back at 0)
and reverts its splits, which gives back exactly the trie before. A rewind deeper than the journal rebuilds.

*Removal* (eviction): each suffix of the sequence is walked from the root and uncounted; a node falling to 0
goes with its subtree (all of it counted only that occurrence). A node falling to count 1 keeps its stored
children (an explicit chain), which reads the same.

Drafting
--------
The match: the longest suffix of the history, ``m < D`` tokens, that occurred before followed by a token (in the
request's trie: the deepest active node with children; in the global trie: a binary search on ``m``, since
every shorter suffix of a match matches too). From the matched node a token tree is grown best first by path
probability (:func:`specray.tree.dynamic_tree`), with

    P(c | s) = count(s + c) / sum over c' of count(s + c')      (a chain node: 1)
    P(path)  = product of P along the path,

dropping candidates whose path probability is below ``min_token_prob``, at most ``D - m`` levels deep and at most

    budget(m) = min(k, ceil(max_spec_factor * m + max_spec_offset))

nodes (``k``: the request's ``num_speculative_tokens``). When the longest match leaves fewer levels than its
budget (``m + budget(m) > D``), the longest shorter match that does not is grown too. Of the trees grown from
both tries the one with the highest expected accepted length, the sum over its nodes of P(path), is proposed
(ties: the request's own, then the longer match); a tree scores at most its budget, so the global trie is not
searched when the request's own tree already scores k. ``Proposal.scores`` holds each node's P(c | s), ``key``
the match length (at most ``_MAX_KEY``).

Global trie
-----------
``finish`` moves a request's text into the :class:`SuffixCache`: its output plus the D tokens before its first
output token (the prompt's end, a chat template's assistant header for instance, so that the next request with the same
template drafts from its first output token; whole prompts are left out, they are long, mostly unique, and
already in each request's own trie). At most ``max_cached_requests`` such records are kept, the oldest removed
first, and a record is a plain ``(key, start, tokens)`` so caches can be shipped (:meth:`SuffixCache.snapshot`,
:meth:`SuffixCache.merge`) between engine replicas.

Within one engine every request already drafts from the one global trie. ``is_public_pool`` links it with the
global tries of other engine replicas that name the same pool (``RayPlacement.pool_name``, a drafter actor):
through a :class:`specray.drafters.ngram.PoolLink`, each record this drafter adds is published as
``(replica id:req_id, 0, tokens)``, and the records other replicas published are added as the newest, within
``max_cached_requests`` as any record (a record is never published again by a replica that received it).
Exchanges happen when proposing, one in flight, never waited for.

Cost: an append is O(stored suffixes ending at the token) <= D dict operations; a proposal is O(budget x depth)
for each tree grown plus, for the global trie, about log2(D) walks of at most D tokens. Memory: one ``_Node``
(about 70 bytes, plus a dict once it has children) per stored node, at most D per token: measured, about 2 per
token (0.4 KB) on text with some repeats, 1 on text without, 3 (0.9 KB) on text that repeats a lot.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from specray.config import SpeculativeConfig
from specray.drafters.base import DraftRequest, DrafterContext, Proposal
from specray.drafters.ngram import PoolLink, common_prefix
from specray.drafters.registry import options_of
from specray.drafters.stats import DrafterStats
from specray.tree import DraftTree, dynamic_tree, path_scores

logger = logging.getLogger(__name__)

_POS_BITS = 32
_POS_MASK = (1 << _POS_BITS) - 1
_EXPLICIT = -1  # the tail of a node whose subtree is stored as children
_CAPPED = -2  # the tail of a node at depth D: nothing below it
_UNDO_WINDOW = 64  # appends a request's trie can undo; a deeper rewind rebuilds it
_MAX_KEY = 8  # proposal keys (match lengths) are capped here: the policy keeps evidence per key
_TAIL_CHECK = 64  # tokens compared to trust a history that is the list seen last time
_EPS = 1e-9
SNAPSHOT_VERSION = 1


# ---------------------------------------------------------------------------------------------- options


@dataclass
class SuffixOptions:
    """``speculative_config`` keys of ``method="suffix"``; vLLM's ``suffix_decoding_*`` names are accepted."""

    ALIASES: ClassVar[dict[str, str]] = {
        "suffix_decoding_max_tree_depth": "max_tree_depth",
        "suffix_decoding_max_cached_requests": "max_cached_requests",
        "suffix_decoding_max_spec_factor": "max_spec_factor",
        "suffix_decoding_min_token_prob": "min_token_prob",
    }

    max_tree_depth: int = 24  # D: the longest match plus draft depth the tries hold
    max_cached_requests: int | None = None  # finished requests kept in the global trie (0: none); None: 10000
    max_spec_factor: float = 1.0  # drafts per matched token: budget = ceil(factor * m + offset)
    max_spec_offset: float = 0.0  # added to factor * m (negative: demand longer matches)
    min_token_prob: float = 0.1  # drop draft nodes whose path probability is below this
    use_global_tree: bool = True  # also draft from finished requests' text
    # link the global trie with other replicas naming the same ray_placement.pool_name (within one engine every
    # request shares it already)
    is_public_pool: bool = False

    def __post_init__(self) -> None:
        _check_int("max_tree_depth", self.max_tree_depth, 2,
                   "a match of one token needs one more level for what follows it; vLLM's default is 24")
        if self.max_cached_requests is not None and self.use_global_tree is False:
            raise ValueError(f"speculative_config.max_cached_requests={self.max_cached_requests!r} sizes the global "
                             "tree of finished requests, which use_global_tree=False turns off; remove it, or set "
                             "use_global_tree=True")
        if self.max_cached_requests is None:
            self.max_cached_requests = 10000
        _check_int("max_cached_requests", self.max_cached_requests, 0,
                   "0 keeps no finished requests; the global trie's memory grows with this bound")
        _check_real("max_spec_factor", self.max_spec_factor, 0.0, None, "e.g. 1.0: one draft per matched token")
        _check_real("max_spec_offset", self.max_spec_offset, None, None, "e.g. 0.0, or -2 to demand longer matches")
        _check_real("min_token_prob", self.min_token_prob, 0.0, 1.0, "e.g. 0.1")
        for name in ("use_global_tree", "is_public_pool"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"speculative_config.{name}={getattr(self, name)!r} must be true or false")
        if self.is_public_pool and not (self.use_global_tree and self.max_cached_requests > 0):
            raise ValueError("speculative_config.is_public_pool=True shares the global tree of finished requests, "
                             f"which use_global_tree={self.use_global_tree} and max_cached_requests="
                             f"{self.max_cached_requests} turn off; set use_global_tree=True and "
                             "max_cached_requests >= 1, or is_public_pool=False")
        most = self.max_spec_factor * (self.max_tree_depth - 1) + self.max_spec_offset
        if math.ceil(most - _EPS) < 1:
            raise ValueError(f"speculative_config.max_spec_factor={self.max_spec_factor!r} and max_spec_offset="
                             f"{self.max_spec_offset!r} allow no draft even for the longest match "
                             f"({self.max_tree_depth - 1} tokens); raise max_spec_factor (e.g. 1.0) or the offset")


def _check_int(name: str, value, lowest: int, hint: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
        raise ValueError(f"speculative_config.{name}={value!r} must be an int >= {lowest} ({hint})")


def _check_real(name: str, value, lo: float | None, hi: float | None, hint: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f" in [{lo}, {hi}]" if hi is not None else (f" >= {lo}" if lo is not None else "")
        raise ValueError(f"speculative_config.{name}={value!r} must be a finite number{bounds} ({hint})")


# ---------------------------------------------------------------------------------------------- the trie


class _Node:
    __slots__ = ("count", "kids", "tail", "ranked")

    def __init__(self, count: int, tail: int):
        self.count = count
        self.kids: dict[int, _Node] | None = None
        self.tail = tail  # >= 0: count 1, its subtree is the chain read from there; _EXPLICIT; _CAPPED
        self.ranked: list[tuple[int, float]] | None = None  # cached next-token distribution, best first


@dataclass(slots=True)
class _Seq:
    sid: int
    tokens: list[int]
    active: list[_Node] | None  # stored nodes of the suffixes ending at the last token, root first; None: sealed
    journal: deque | None  # per recent append: (the active nodes before it, its splits); None: no undo


def _by_prob(item: tuple[int, float]) -> tuple[float, int]:
    return -item[1], item[0]


class SuffixTrie:
    """A depth-bounded suffix trie with counts over sequences named by keys (see the module docstring)."""

    def __init__(self, max_depth: int, min_prob: float = 0.0):
        if max_depth < 2:
            raise ValueError(f"max_depth={max_depth} must be >= 2")
        self.max_depth = max_depth
        self.min_prob = min_prob  # next tokens rarer than this are left out of the cached distributions
        self.root = _Node(0, _EXPLICIT)
        self.num_nodes = 1
        self._sid: dict[Hashable, int] = {}
        self._seqs: dict[int, _Seq] = {}
        self._next_sid = 0

    # ---- sequences -----------------------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._sid

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def num_tokens(self) -> int:
        return self.root.count

    def tokens(self, key: Hashable) -> list[int]:
        """The trie's copy of a sequence (do not modify it)."""
        sid = self._sid.get(key)
        return [] if sid is None else self._seqs[sid].tokens

    def extend(self, key: Hashable, tokens: Sequence[int], undo: bool = False) -> None:
        """Append ``tokens`` to sequence ``key`` (new if unknown; ``undo``: journal appends so
        :meth:`truncate` can take them back)."""
        s = self._seqs.get(self._sid.get(key, -1)) or self._open(key, undo)
        if s.active is None:
            raise ValueError(f"sequence {key!r} is sealed: it takes no more tokens")
        for t in tokens:
            self._push(s, t)

    def seal(self, key: Hashable) -> None:
        """No more appends to ``key``: drop what appending needs."""
        s = self._seqs[self._sid[key]]
        s.active = s.journal = None

    def truncate(self, key: Hashable, n: int) -> bool:
        """Keep the first ``n`` tokens of ``key`` by undoing appends; False (nothing done) when the journal
        does not reach back that far (rebuild instead)."""
        s = self._seqs[self._sid[key]]
        drop = len(s.tokens) - n
        if drop <= 0:
            return True
        if s.journal is None or len(s.journal) < drop:
            return False
        for _ in range(drop):
            self._pop(s)
        return True

    def remove(self, key: Hashable) -> None:
        """Forget sequence ``key``: every suffix of it uncounted, nodes falling to 0 deleted."""
        sid = self._sid.pop(key, None)
        if sid is None:
            return
        tokens = self._seqs.pop(sid).tokens
        n, depth = len(tokens), self.max_depth
        self.root.count -= n
        for start in range(n):
            self._uncount(tokens, start, min(start + depth, n))

    def _open(self, key: Hashable, undo: bool) -> _Seq:
        sid, self._next_sid = self._next_sid, self._next_sid + 1
        self._sid[key] = sid
        s = self._seqs[sid] = _Seq(sid, [], [self.root], deque(maxlen=_UNDO_WINDOW) if undo else None)
        return s

    # ---- counting ------------------------------------------------------------------------------------
    def _push(self, s: _Seq, t: int) -> None:
        """Append ``t``: count every suffix ending at it (the hot loop of the drafter)."""
        active, depth = s.active, self.max_depth
        tail = (s.sid << _POS_BITS) | (len(s.tokens) + 1)  # a child made now: its chain goes on after t
        new, splits = [self.root], None
        for i, a in enumerate(active):
            if a.tail != _EXPLICIT:  # a chain that already reads t, or the depth cap
                break
            kids = a.kids
            if kids is None:
                kids = a.kids = {}
            c = kids.get(t)
            if c is None:
                c = kids[t] = _Node(1, tail if i + 1 < depth else _CAPPED)
                self.num_nodes += 1
            elif c.tail >= 0:
                splits = self._split(c, i + 1, splits)
            else:
                c.count += 1
            a.ranked = None
            new.append(c)
        self.root.count += 1
        s.tokens.append(t)
        if s.journal is not None:
            s.journal.append((active, splits))
        s.active = new

    def _split(self, c: _Node, depth: int, splits: list | None) -> list:
        """``c`` (count 1, a chain) meets its second occurrence: store its first occurrence's next token."""
        tail = c.tail
        old = self._seqs[tail >> _POS_BITS].tokens
        pos, token = tail & _POS_MASK, None
        if pos < len(old):
            token = old[pos]
            c.kids = {token: _Node(1, tail + 1 if depth + 1 < self.max_depth else _CAPPED)}
            self.num_nodes += 1
        c.tail, c.count, c.ranked = _EXPLICIT, 2, None
        if splits is None:
            splits = []
        splits.append((c, tail, token))
        return splits

    def _pop(self, s: _Seq) -> None:
        """Undo the last append exactly (LIFO, from the journal)."""
        before, splits = s.journal.pop()
        after, t = s.active, s.tokens[-1]
        for depth in range(len(after) - 1, 0, -1):
            c, parent = after[depth], before[depth - 1]
            c.count -= 1
            parent.ranked = None
            if c.count == 0:
                self._detach(parent, t)
        for c, tail, token in reversed(splits or ()):
            if token is not None:
                self._detach(c, token)
            c.tail, c.ranked = tail, None
        self.root.count -= 1
        s.tokens.pop()
        s.active = before

    def _uncount(self, tokens: list[int], lo: int, hi: int) -> None:
        """Uncount the occurrence ``tokens[lo:hi]`` and its prefixes (its path from the root)."""
        node = self.root
        for j in range(lo, hi):
            if node.tail >= 0:  # the rest was this count-1 node's chain (deleted with it): cannot happen
                return
            c = node.kids[tokens[j]]
            c.count -= 1
            node.ranked = None
            if c.count == 0:
                self._detach(node, tokens[j])
                return
            node = c

    def _detach(self, parent: _Node, token: int) -> None:
        kids = parent.kids
        gone = [kids.pop(token)]
        if not kids:
            parent.kids = None
        while gone:  # count the subtree out of num_nodes
            node = gone.pop()
            self.num_nodes -= 1
            if node.kids:
                gone.extend(node.kids.values())

    # ---- matching --------------------------------------------------------------------------------------
    def active_match(self, key: Hashable) -> tuple[int, _Node | None]:
        """(m, node): the longest suffix of sequence ``key`` that occurred before followed by a token
        (m = 0, None: none). O(1) in practice: the deepest active node with children."""
        active = self._seqs[self._sid[key]].active
        for m in range(len(active) - 1, 0, -1):
            if active[m].kids:
                return m, active[m]
        return 0, None

    def active_node(self, key: Hashable, m: int) -> _Node:
        """The node of the last ``m`` tokens of ``key`` (``m`` at most :meth:`active_match`'s)."""
        return self._seqs[self._sid[key]].active[m]

    def locate(self, pattern: Sequence[int]) -> tuple[_Node, int] | None:
        """Where ``pattern`` (at most D tokens) ends in the trie: (node, 0), or (node, off) ``off`` tokens down
        ``node``'s chain; None when it never occurred."""
        node, off = self.root, 0
        for t in pattern:
            if node.tail >= 0:
                tail = node.tail
                seq = self._seqs[tail >> _POS_BITS].tokens
                pos = (tail & _POS_MASK) + off
                if pos >= len(seq) or seq[pos] != t:
                    return None
                off += 1
            else:
                c = node.kids.get(t) if node.kids else None
                if c is None:
                    return None
                node = c
        return node, off

    def longest_match(self, history: Sequence[int], max_len: int) -> tuple[int, _Node | None, int]:
        """(m, node, off): the longest suffix of ``history``, at most ``max_len`` tokens, that occurs followed by
        a token (0, None, 0: none). Binary search: every suffix of a match is a match."""
        lo, hi, best = 0, min(max_len, len(history), self.max_depth - 1), None
        n = len(history)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            where = self.locate(history[n - mid:])
            if where is not None and self._continues(*where):
                lo, best = mid, where
            else:
                hi = mid - 1
        return (lo, *best) if best is not None else (0, None, 0)

    # ---- drafting --------------------------------------------------------------------------------------
    def draft(self, node: _Node, off: int, m: int, budget: int, min_prob: float) -> DraftTree:
        """The likeliest continuations of a match of ``m`` tokens ending at (node, off): at most ``budget``
        nodes, best first by path probability, none below ``min_prob``, no deeper than the trie allows."""

        calls = 0

        def expand(path: list[int]) -> list[tuple[int, float]]:
            nonlocal calls
            calls += 1
            if calls > budget:  # called for the budget-th node: the tree is full, its children go unused
                return []
            n, o = node, off
            for t in path:
                if n.tail >= 0:
                    o += 1
                else:
                    n = n.kids[t]
            return self._next(n, o)

        return dynamic_tree(expand, budget, budget, self.max_depth - m, min_prob)

    def _continues(self, node: _Node, off: int) -> bool:
        tail = node.tail
        if tail >= 0:
            return (tail & _POS_MASK) + off < len(self._seqs[tail >> _POS_BITS].tokens)
        return bool(node.kids)

    def _next(self, node: _Node, off: int) -> list[tuple[int, float]]:
        """What may follow (node, off), best first, with P(token | string)."""
        tail = node.tail
        if tail >= 0:
            seq = self._seqs[tail >> _POS_BITS].tokens
            pos = (tail & _POS_MASK) + off
            return [(seq[pos], 1.0)] if pos < len(seq) else []
        ranked = node.ranked
        if ranked is None:
            ranked = node.ranked = self._rank(node.kids)
        return ranked

    def _rank(self, kids: dict[int, _Node] | None) -> list[tuple[int, float]]:
        if not kids:
            return []
        total = sum(c.count for c in kids.values())
        floor = self.min_prob * total
        return sorted(((t, c.count / total) for t, c in kids.items() if c.count >= floor), key=_by_prob)

    # ---- inspection ------------------------------------------------------------------------------------
    def substring_counts(self) -> dict[tuple[int, ...], int]:
        """Every string the trie counts (stored or in a chain) -> its count. For tests: O(size)."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[tuple[int, ...], _Node]] = [((), self.root)]
        while stack:
            path, node = stack.pop()
            if node.tail >= 0:
                seq = self._seqs[node.tail >> _POS_BITS].tokens
                pos = node.tail & _POS_MASK
                for end in range(pos + 1, min(len(seq), pos + self.max_depth - len(path)) + 1):
                    out[path + tuple(seq[pos:end])] = 1
            for t, c in (node.kids or {}).items():
                out[path + (t,)] = c.count
                stack.append((path + (t,), c))
        return out


# ---------------------------------------------------------------------------------------------- global trie


class SuffixCache:
    """The global trie: text of recently finished requests, at most ``max_requests`` records, oldest out first.

    A record is ``(key, start, tokens)``: ``tokens`` are the request's history from position ``start`` on. Only
    plain data goes in and out, so replicas can share one through :meth:`snapshot` / :meth:`merge`."""

    def __init__(self, max_depth: int, max_requests: int, min_prob: float = 0.0):
        self.trie = SuffixTrie(max_depth, min_prob)
        self.max_requests = max_requests
        self._starts: OrderedDict[Hashable, int] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._starts)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._starts

    def start_of(self, key: Hashable) -> int | None:
        return self._starts.get(key)

    def add(self, key: Hashable, tokens: Sequence[int], start: int = 0) -> list[Hashable]:
        """Record ``tokens`` under ``key`` (replacing an earlier record of it) as the newest; returns the keys
        evicted to stay within ``max_requests``."""
        self.remove(key)
        if self.max_requests <= 0 or not tokens:
            return []
        self.trie.extend(key, tokens)
        self.trie.seal(key)
        self._starts[key] = start
        evicted = []
        while len(self._starts) > self.max_requests:
            old, _ = self._starts.popitem(last=False)
            self.trie.remove(old)
            evicted.append(old)
        return evicted

    def remove(self, key: Hashable) -> None:
        if self._starts.pop(key, None) is not None:
            self.trie.remove(key)

    def records(self) -> list[tuple[Hashable, int, list[int]]]:
        """Every record, oldest first."""
        return [(key, start, list(self.trie.tokens(key))) for key, start in self._starts.items()]

    def snapshot(self) -> dict[str, Any]:
        return {"version": SNAPSHOT_VERSION, "records": [list(r) for r in self.records()]}

    def merge(self, snapshot: dict[str, Any]) -> None:
        """Fold in another cache's :meth:`snapshot`: records new here, or changed, are added as the newest."""
        if snapshot.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"snapshot version {snapshot.get('version')!r} is not {SNAPSHOT_VERSION}; "
                             "snapshot and merge with the same specray version")
        for key, start, tokens in snapshot["records"]:
            if self._starts.get(key) != start or self.trie.tokens(key) != list(tokens):
                self.add(key, tokens, start)


# ---------------------------------------------------------------------------------------------- the drafter


@dataclass(slots=True)
class _RequestState:
    trie: SuffixTrie  # one sequence, key 0: the request's history as last seen
    prompt_len: int  # the history's length when first seen, less the output token it ended with
    source: Sequence[int] | None = None  # the history object read last time
    assumed: int = 0  # the last call's num_assumed (drafts still being checked)


class SuffixDrafter:
    """Suffix decoding: propose the likeliest continuations of the history's longest earlier match, as a token
    tree, from the request's own trie or the global one (see the module docstring). Deterministic (``probs``
    None); ``key`` is the match length. Its statistics: :meth:`stats`."""

    cheap_proposals = True  # lookups: the engine asks for the most drafts and sizes k by the key

    def __init__(self, spec: SpeculativeConfig, ctx: DrafterContext):
        self.options: SuffixOptions = options_of(spec)
        self.ctx = ctx
        opts = self.options
        self.cache: SuffixCache | None = None
        if opts.use_global_tree and opts.max_cached_requests > 0:
            self.cache = SuffixCache(opts.max_tree_depth, opts.max_cached_requests, opts.min_token_prob)
        self._requests: dict[str, _RequestState] = {}
        self._rooms: dict[int, int] = {}  # k -> _room(k)
        self._stats = DrafterStats("suffix")
        self.pool_link: PoolLink | None = None
        self._origin = uuid.uuid4().hex[:12]  # prefixes the keys this replica publishes
        self._unsent: list[tuple[str, int, list[int]]] = []  # records for the next exchange

    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        if self.pool_link is not None:  # before drafting: what other replicas finished may match already
            self.sync_pool()
        return [self._propose_one(req) for req in batch]

    def finish(self, req_ids: Sequence[str]) -> None:
        """Drop the requests' tries; their text goes into the global trie (a preempted request that comes back
        is rebuilt from its history, and its record is replaced when it finishes again)."""
        for req_id in req_ids:
            state = self._requests.pop(req_id, None)
            if state is not None and self.cache is not None:
                self._record(req_id, state)

    def observe_finished(self, req_id: str, token_ids: Sequence[int]) -> None:
        """A request finished with this whole history: its last tokens go into its trie before :meth:`finish`
        records it in the global tree."""
        state = self._requests.get(req_id)
        if state is not None:
            self._catch_up(state, token_ids)

    def observe_verification(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        """The engine's count of what the target kept of this request's last proposal (exact statistics)."""
        self._stats.verified(req_id, num_drafted, num_accepted)

    def shutdown(self) -> None:
        """Nothing beyond memory to release (a link to a shared pool is the actor's)."""
        self._requests.clear()

    # ---- sharing the global trie with other replicas ------------------------------------------------------
    def attach_pool_link(self, link: PoolLink) -> None:
        if not self.options.is_public_pool:
            raise ValueError("sharing suffix decoding's global tree needs speculative_config.is_public_pool=True")
        self.pool_link = link

    def sync_pool(self, wait: bool = False) -> None:
        """Send the records added since the last exchange; add the records other replicas published."""
        updates, self._unsent = self._unsent, []
        received = self.pool_link.exchange(updates, wait=wait)
        # only the newest max_cached_requests could stay: a replica joining late skips the older backlog
        for key, start, tokens in received[-self.cache.max_requests:]:
            self._merge_remote(key, start, tokens)

    def _merge_remote(self, key: str, start: int, tokens: list[int]) -> None:
        """``tokens`` continue the record ``key`` from ``start`` (0: a new record). Remote records are kept
        under ``("pool", key)``, apart from this replica's request ids."""
        local = ("pool", key)
        held = self.cache.trie.tokens(local)
        if start != len(held):
            return  # we evicted the record it continues
        self.cache.add(local, held + tokens if start else tokens)

    def stats(self) -> dict:
        return self._stats.as_dict()

    # ---- per request ---------------------------------------------------------------------------------
    def _propose_one(self, req: DraftRequest) -> Proposal:
        self._stats.begin_call()
        state = self._requests.get(req.req_id) or self._new_state(req)
        self._catch_up(state, req.token_ids)
        state.assumed = req.num_assumed
        if req.num_speculative_tokens <= 0:
            return Proposal([])
        with self._stats.timer("gen"):
            proposal = self._draft(state, req.num_speculative_tokens)
        self._stats.proposed(len(proposal.token_ids))
        return proposal

    def _new_state(self, req: DraftRequest) -> _RequestState:
        with self._stats.timer("begin"):
            trie = SuffixTrie(self.options.max_tree_depth, self.options.min_token_prob)
            trie.extend(0, req.token_ids, undo=True)
        state = _RequestState(trie, max(0, len(req.token_ids) - 1 - req.num_assumed), req.token_ids)
        self._requests[req.req_id] = state
        return state

    def _catch_up(self, state: _RequestState, history: Sequence[int]) -> None:
        """Bring the request's trie to ``history``: appends only, when it is the list read last time grown at
        its end; otherwise find where it differs, rewind there (undo, or rebuild) and append."""
        tokens = state.trie.tokens(0)
        n = len(tokens)
        if history is state.source and len(history) >= n and _tail_equal(tokens, history):
            keep = n
        else:
            keep = common_prefix(tokens, history)
            state.source = history
            if keep < n:
                self._rewind(state, keep)
        if len(history) > keep:
            with self._stats.timer("acc"):
                state.trie.extend(0, history[keep:], undo=True)

    def _rewind(self, state: _RequestState, keep: int) -> None:
        if state.trie.truncate(0, keep):
            return
        logger.debug("suffix drafter: history changed %d tokens back; rebuilding the request's trie",
                     len(state.trie.tokens(0)) - keep)
        with self._stats.timer("begin"):
            trie = SuffixTrie(self.options.max_tree_depth, self.options.min_token_prob)
            trie.extend(0, state.trie.tokens(0)[:keep], undo=True)
        state.trie = trie

    def _record(self, req_id: str, state: _RequestState) -> None:
        """The request's output and the last D prompt tokens before it, into the global trie."""
        tokens = state.trie.tokens(0)
        end = len(tokens) - state.assumed
        start = max(0, state.prompt_len - self.options.max_tree_depth)
        earlier = self.cache.start_of(req_id)  # preempted before: keep what that record started with
        if earlier is not None:
            start = min(start, earlier)
        if end > start:
            self.cache.add(req_id, tokens[start:end], start)
            if self.pool_link is not None:
                self._unsent.append((f"{self._origin}:{req_id}", 0, tokens[start:end]))

    # ---- proposing -----------------------------------------------------------------------------------
    def _draft(self, state: _RequestState, k: int) -> Proposal:
        """Grow a tree from each candidate match; keep the highest expected accepted length. A tree scores at
        most its budget (k), so the global trie is not searched when the request's own tree already scores k."""
        best: tuple[float, DraftTree, int] | None = None
        for matches in (self._local_matches, self._global_matches):
            if best is not None and best[0] >= k - _EPS:
                break
            for trie, m, node, off in matches(state, k):
                budget = self._budget(m, k)
                if budget <= 0 or (best is not None and best[0] >= budget - _EPS):
                    continue
                tree = trie.draft(node, off, m, budget, self.options.min_token_prob)
                score = sum(path_scores(tree, 1.0))
                if tree.token_ids and (best is None or score > best[0]):
                    best = (score, tree, m)
        if best is None:
            return Proposal([])
        _, tree, m = best
        return Proposal(tree.token_ids, key=min(m, _MAX_KEY), parents=tree.parents, scores=tree.scores)

    def _budget(self, m: int, k: int) -> int:
        opts = self.options
        return max(0, min(k, math.ceil(opts.max_spec_factor * m + opts.max_spec_offset - _EPS)))

    def _room(self, k: int) -> int:
        """The longest match m whose budget fits below it in the trie: m + budget(m) <= D (at least 1)."""
        room = self._rooms.get(k)
        if room is None:
            depth = self.options.max_tree_depth
            room = depth - 1
            while room > 1 and room + self._budget(room, k) > depth:
                room -= 1
            self._rooms[k] = room
        return room

    def _local_matches(self, state: _RequestState, k: int) -> Iterator[tuple[SuffixTrie, int, _Node, int]]:
        """(trie, m, node, off) to grow from in the request's trie: the longest match, and the longest shorter
        one that leaves room below it for its whole budget when the longest does not."""
        trie = state.trie
        m, node = trie.active_match(0)
        if m:
            yield trie, m, node, 0
            room = self._room(k)
            if m > room:
                yield trie, room, trie.active_node(0, room), 0

    def _global_matches(self, state: _RequestState, k: int) -> Iterator[tuple[SuffixTrie, int, _Node, int]]:
        """As :meth:`_local_matches`, in the global trie."""
        if self.cache is None or not len(self.cache):
            return
        history, trie = state.trie.tokens(0), self.cache.trie
        m, node, off = trie.longest_match(history, self.options.max_tree_depth - 1)
        if m:
            yield trie, m, node, off
            room = self._room(k)
            if m > room:
                yield trie, room, *trie.locate(history[len(history) - room:])


def _tail_equal(tokens: list[int], history: Sequence[int]) -> bool:
    """The last tokens read before are still where they were (a list rewound in place shows here)."""
    lo = max(0, len(tokens) - _TAIL_CHECK)
    seen = history[lo:len(tokens)]
    return (seen if isinstance(seen, list) else list(seen)) == tokens[lo:]
