"""The n-gram (prompt-lookup) drafter and the n-gram pool behind it. Torch-free.

A request's next tokens often repeat text it has already seen (code being edited, quoted documents, lists). The
drafter takes the last ``n`` tokens of the history, finds an earlier place where the same ``n`` tokens occurred,
and proposes what followed there. ``n`` runs from ``prompt_lookup_max`` down to ``prompt_lookup_min``: the
longest match wins, and with no match of at least ``prompt_lookup_min`` tokens it proposes nothing.

:class:`NgramPool` is the n-gram -> continuations store, kept apart from the drafter so one pool can be shared
(by all requests with ``is_public_pool``, and by engine replicas through a Ray actor). A request's private pool
with chain lookups (the default) is instead a C index, ``NgramIndex`` (``drafters/_ngram_index.c``), when the
package was built with a compiler: it answers as an ``NgramPool`` indexing the current history from scratch
would, for a fraction of the host time per step.

Pool design
-----------
The pool keeps its own copy of every sequence it indexes and, per n-gram (a tuple of ``n`` token ids), a list
of *references* to the places right after where it occurred, oldest first. A reference is one int,
``sid << 32 | pos``: sequence ``sid``, continuation starting at ``pos``. A continuation is read at lookup time,
``tokens[pos:pos + k]``, so it is always up to date: one recorded when only one token followed the n-gram grows
as the sequence grows, at no cost.

An n-gram is recorded only once a token follows it, so the n-gram ending a sequence (the suffix a lookup asks
for) is never in the pool as its own match, and every kept reference has a non-empty continuation.

* ``is_keep_all=True`` keeps every sighting of an n-gram; ``False`` keeps only the newest one.
* ``is_use_oldest=True`` proposes the continuation of the oldest kept sighting, ``False`` the newest. Both pick
  by the time the n-gram was seen; equal continuations seen twice are kept twice (they only cost capacity).
* A rewound sequence (its tokens replaced from some position on) drops the references into the replaced part
  and indexes the new tokens; references before it read the new tokens from then on.
* With ``max_pool_entries`` (the public pool) the pool keeps at most that many references: the oldest recorded
  go first (a FIFO of what was recorded), and a closed sequence's tokens are freed once nothing refers to them.

Cost: indexing is O(new tokens x (max - min + 1)) dict operations on tuples of at most ``max`` ids; a lookup
is at most ``max - min + 1`` dict lookups plus the slice it returns. Memory is about one reference per
indexed token per n (bounded by ``max_pool_entries`` where set) plus the tokens.

Trees: with ``num_branches > 1`` or a ``speculative_token_tree``, a lookup reads the continuations of up to
``max_tree_refs`` sightings of the longest matching n-gram (the preferred ones: oldest first with
``is_use_oldest``) into a trie with counts, and proposes a token tree of it (``specray.tree``): each node's score
is the share of the sightings through its parent that continue with it. Static shape (``speculative_token_tree``,
paths of candidate ranks) or dynamic (best-first by path share, ``num_branches`` children per node at most).

Shipping a pool: :meth:`NgramPool.snapshot` returns plain lists and dicts (the sequences' tokens; the table is
rebuilt on the other side) and :meth:`NgramPool.merge` folds one in, extending sequences it already has.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from specray.config import SpeculativeConfig
from specray.drafters.base import DraftRequest, DrafterContext, Proposal
from specray.drafters.registry import options_of
from specray.tree import DraftTree, dynamic_tree, parse_token_tree, static_tree

try:  # the per-request index in C (drafters/_ngram_index.c), built when the package is installed with a compiler
    from specray.drafters._ngram_index import MAX_N as NATIVE_MAX_N, NgramIndex
except ImportError:  # no compiler at install: NgramPool serves private pools as well (DEVELOPERS.md: one difference)
    NgramIndex, NATIVE_MAX_N = None, 0

logger = logging.getLogger(__name__)

DEFAULT_MAX_POOL_ENTRIES = 1 << 18  # references the public pool keeps unless max_pool_entries says otherwise
SNAPSHOT_VERSION = 2  # 2: the draft count is named num_speculative_tokens
_POS_BITS = 32
_POS_MASK = (1 << _POS_BITS) - 1
_CHUNK = 1024  # tokens compared per slice when looking for a common prefix
_BULK = 16  # new tokens from which indexing goes n-major (a prompt), where no FIFO keeps the text order


@dataclass
class NgramOptions:
    """``speculative_config`` keys of ``method="ngram"`` (vLLM's prompt lookup, TensorRT-LLM's pool flags)."""

    ALIASES: ClassVar[dict[str, str]] = {"max_matching_ngram_size": "prompt_lookup_max"}  # TensorRT-LLM's name

    prompt_lookup_min: int | None = None  # shortest match drafted from; None: 2, or prompt_lookup_max if smaller
    prompt_lookup_max: int | None = None  # longest match looked for (the longest wins); None: 4, or the min if larger
    is_public_pool: bool = False  # one pool for every request (and, with a pool_name, every replica)
    is_keep_all: bool = True  # keep every sighting of an n-gram (False: only the newest)
    is_use_oldest: bool = True  # propose the oldest sighting's continuation (False: the newest's)
    max_pool_entries: int | None = None  # cap on a public pool (oldest entries evicted first)
    # token trees: candidates per node (1: one chain, as TensorRT-LLM's pool), or a static shape of rank paths
    num_branches: int = 1
    speculative_token_tree: list | str | None = None
    max_tree_refs: int | None = None  # sightings of the matched n-gram a tree is read from; None: 32 (trees only)

    def __post_init__(self) -> None:
        if self.prompt_lookup_max is None:  # as vLLM: a min given alone is never refused for a max it did not give
            self.prompt_lookup_max = max(4, self.prompt_lookup_min) if _is_count(self.prompt_lookup_min) else 4
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = min(2, self.prompt_lookup_max) if _is_count(self.prompt_lookup_max) else 2
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if not _is_count(getattr(self, name)):
                raise ValueError(f"speculative_config.{name}={getattr(self, name)!r} must be an int >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} and prompt_lookup_max="
                             f"{self.prompt_lookup_max} must satisfy 1 <= min <= max")
        for name in ("is_public_pool", "is_keep_all", "is_use_oldest"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"speculative_config.{name}={getattr(self, name)!r} must be true or false")
        if self.max_pool_entries is not None and not _is_count(self.max_pool_entries):
            raise ValueError(f"speculative_config.max_pool_entries={self.max_pool_entries!r} must be an int >= 1 "
                             "(or None for the default cap)")
        if self.max_pool_entries is not None and not self.is_public_pool:
            raise ValueError(f"speculative_config.max_pool_entries={self.max_pool_entries!r} caps the public pool only "
                             "(a request's own pool holds its history); set is_public_pool=True, or remove it")
        refs_given = self.max_tree_refs is not None
        if not refs_given:
            self.max_tree_refs = 32
        for name in ("num_branches", "max_tree_refs"):
            if not _is_count(getattr(self, name)):
                raise ValueError(f"speculative_config.{name}={getattr(self, name)!r} must be an int >= 1")
        if self.speculative_token_tree is not None:
            self.speculative_token_tree = parse_token_tree(self.speculative_token_tree)
            if self.num_branches > 1:
                raise ValueError(f"speculative_config gives both num_branches={self.num_branches} and a "
                                 "speculative_token_tree: pick one (a dynamic tree of num_branches children per node, "
                                 "or the static tree)")
        if refs_given and not self.proposes_trees:
            raise ValueError(f"speculative_config.max_tree_refs={self.max_tree_refs} sizes token trees, which this "
                             "config does not draft (chains); set num_branches > 1 or a speculative_token_tree, "
                             "or remove it")

    @property
    def proposes_trees(self) -> bool:
        return self.num_branches > 1 or self.speculative_token_tree is not None

    @property
    def default_draft_count(self) -> int | None:
        """``num_speculative_tokens`` when it is not given: a static tree's nodes, every one of them (as the heads')."""
        return None if self.speculative_token_tree is None else len(self.speculative_token_tree)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def common_prefix(a: list[int], b: Sequence[int]) -> int:
    """Length of the common prefix of ``a`` and ``b``, comparing whole slices where they are equal."""
    n = min(len(a), len(b))
    lo = 0
    while lo < n:
        hi = min(lo + _CHUNK, n)
        if a[lo:hi] != list(b[lo:hi]):
            break
        lo = hi
    while lo < n and a[lo] == b[lo]:
        lo += 1
    return lo


class NgramPool:
    """N-grams of ``prompt_lookup_min..prompt_lookup_max`` tokens -> continuations of up to
    ``num_speculative_tokens``."""

    def __init__(
        self,
        prompt_lookup_min: int = 2,
        prompt_lookup_max: int = 4,
        num_speculative_tokens: int = 5,
        *,
        is_keep_all: bool = True,
        is_use_oldest: bool = True,
        max_pool_entries: int | None = None,
    ):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={prompt_lookup_min} and prompt_lookup_max={prompt_lookup_max} "
                             "must satisfy 1 <= min <= max")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1")
        if max_pool_entries is not None and max_pool_entries < 1:
            raise ValueError(f"max_pool_entries={max_pool_entries} must be >= 1 (or None for no bound)")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.num_speculative_tokens = num_speculative_tokens
        self.is_keep_all = is_keep_all
        self.is_use_oldest = is_use_oldest
        self.max_pool_entries = max_pool_entries
        self._uid = uuid.uuid4().hex[:12]
        self._names = itertools.count()
        self._sids = itertools.count()
        self._sid: dict[Hashable, int] = {}  # seq_key -> sid
        self._seq_key: dict[int, Hashable] = {}  # sid -> seq_key
        self._tokens: dict[int, list[int]] = {}  # sid -> the pool's own copy of the sequence
        self._closed: set[int] = set()  # sids whose tokens go once nothing refers to them
        self._table: dict[tuple[int, ...], list[int]] = {}  # n-gram -> references, oldest first
        # What was recorded, oldest first, and how many of those entries each sid has; only with a bound.
        self._fifo: deque[tuple[tuple[int, ...], int]] | None = deque() if max_pool_entries else None
        self._fifo_count: dict[int, int] = {}
        self.num_refs = 0  # references now held

    @classmethod
    def from_options(cls, options: NgramOptions, num_speculative_tokens: int,
                     max_pool_entries: int | None = None) -> "NgramPool":
        return cls(options.prompt_lookup_min, options.prompt_lookup_max, num_speculative_tokens,
                   is_keep_all=options.is_keep_all, is_use_oldest=options.is_use_oldest,
                   max_pool_entries=max_pool_entries)

    # ---- sequences -----------------------------------------------------------------------------------
    def new_key(self) -> str:
        """A sequence key unique across pools (so snapshots of different pools merge without clashes)."""
        return f"{self._uid}:{next(self._names)}"

    def __contains__(self, seq_key: Hashable) -> bool:
        return seq_key in self._sid

    @property
    def num_sequences(self) -> int:
        return len(self._tokens)

    @property
    def num_ngrams(self) -> int:
        return len(self._table)

    def num_tokens(self, seq_key: Hashable) -> int:
        sid = self._sid.get(seq_key)
        return 0 if sid is None else len(self._tokens[sid])

    def tokens(self, seq_key: Hashable) -> list[int]:
        """The pool's copy of a sequence (do not modify it)."""
        sid = self._sid.get(seq_key)
        return [] if sid is None else self._tokens[sid]

    def tail(self, seq_key: Hashable, n: int) -> list[int]:
        return self.tokens(seq_key)[-n:] if n > 0 else []

    def add(self, seq_key: Hashable, tokens: Sequence[int], start: int = 0) -> None:
        """Make sequence ``seq_key`` read ``tokens``, of which the first ``start`` are already indexed (the
        caller vouches they equal the pool's copy); anything the pool held from ``start`` on is replaced."""
        sid = self._sid.get(seq_key)
        if sid is None:
            sid = self._open(seq_key)
        stored = self._tokens[sid]
        if not 0 <= start <= min(len(stored), len(tokens)):
            raise ValueError(f"start={start} must be in [0, {min(len(stored), len(tokens))}]: the pool holds "
                             f"{len(stored)} tokens of sequence {seq_key!r} and {len(tokens)} were given")
        if start < len(stored):
            self._unindex(sid, start, len(stored))
            del stored[start:]
        self._append(sid, tokens[start:])

    def extend(self, seq_key: Hashable, new_tokens: Sequence[int]) -> None:
        """Append ``new_tokens`` to sequence ``seq_key`` (a new one if unknown) and index them."""
        sid = self._sid.get(seq_key)
        if sid is None:
            sid = self._open(seq_key)
        self._append(sid, new_tokens)

    def sync(self, seq_key: Hashable, tokens: Sequence[int]) -> int:
        """Like :meth:`add`, finding for itself how much of the pool's copy still holds (O(len(tokens)), in
        slice compares). Returns that common prefix length."""
        common = common_prefix(self.tokens(seq_key), tokens)
        self.add(seq_key, tokens, common)
        return common

    def publish(self, tokens: Sequence[int]) -> str:
        """Add finished text from elsewhere (a finished request, another replica); returns its new key."""
        key = self.new_key()
        self.extend(key, tokens)
        self.close(key)
        return key

    def close(self, seq_key: Hashable) -> None:
        """The sequence will not grow any more: its text stays for others to draft from, until its references
        are evicted (bounded pool only; without a bound it stays until :meth:`remove`)."""
        sid = self._sid.get(seq_key)
        if sid is None:
            return
        self._closed.add(sid)
        if self._fifo is not None and not self._fifo_count.get(sid):
            self._drop(sid)

    def remove(self, seq_key: Hashable) -> None:
        """Forget a sequence and every reference into it."""
        sid = self._sid.get(seq_key)
        if sid is None:
            return
        if len(self._tokens) == 1:
            self._clear()
            return
        self._unindex(sid, 0, len(self._tokens[sid]))
        self._drop(sid)

    def _open(self, seq_key: Hashable) -> int:
        sid = next(self._sids)
        self._sid[seq_key] = sid
        self._seq_key[sid] = seq_key
        self._tokens[sid] = []
        return sid

    def _drop(self, sid: int) -> None:
        del self._sid[self._seq_key.pop(sid)]
        del self._tokens[sid]
        self._closed.discard(sid)

    def _clear(self) -> None:
        self._sid.clear()
        self._seq_key.clear()
        self._tokens.clear()
        self._closed.clear()
        self._table.clear()
        self._fifo_count.clear()
        if self._fifo is not None:
            self._fifo.clear()
        self.num_refs = 0

    # ---- indexing ------------------------------------------------------------------------------------
    def _append(self, sid: int, new_tokens: Sequence[int]) -> None:
        stored = self._tokens[sid]
        old = len(stored)
        stored.extend(new_tokens)
        self._index(sid, old)

    def _index(self, sid: int, lo: int) -> None:
        """Record, for every position ``pos >= lo`` now holding a token, the n-grams ending just before it
        (position-major, so the FIFO evicts in text order). The hot loop (each decode step's few tokens):
        ``_insert`` inlined."""
        tokens, table, fifo, keep_all = self._tokens[sid], self._table, self._fifo, self.is_keep_all
        if fifo is None and len(tokens) - lo >= _BULK:
            self._index_bulk(sid, lo)
            return
        base, added, min_n, max_n = sid << _POS_BITS, 0, self.min_n, self.max_n
        lo = max(lo, 1)
        first = max(0, lo - max_n)
        seg = tuple(tokens[first:])  # every n-gram is a slice of it: one copy of the new part, not one per n-gram
        every_n = range(min_n, max_n + 1)
        queued = 0 if fifo is None else len(fifo)
        for pos in range(lo, len(tokens)):
            ref, i = base | pos, pos - first
            for n in every_n if pos >= max_n else range(min_n, pos + 1):  # near the start: the n-grams that fit
                gram = seg[i - n:i]
                refs = table.get(gram)
                if refs is None:
                    table[gram] = [ref]
                    added += 1
                elif keep_all:
                    refs.append(ref)
                    added += 1
                else:
                    refs[0] = ref
                if fifo is not None:
                    fifo.append((gram, ref))
        self.num_refs += added
        if fifo is not None and len(fifo) > queued:
            self._fifo_count[sid] = self._fifo_count.get(sid, 0) + len(fifo) - queued
            self._evict()

    def _index_bulk(self, sid: int, lo: int) -> None:
        """:meth:`_index` for many new tokens (a prompt) in a pool without a FIFO: n-major, the n-grams built by
        ``zip`` in C. Each n-gram's references still arrive in text order (all its sightings have the same n), so
        the table is the one position-major indexing builds."""
        tokens, table, keep_all = self._tokens[sid], self._table, self.is_keep_all
        base, added, end = sid << _POS_BITS, 0, len(tokens)
        for n in range(self.min_n, self.max_n + 1):
            start = max(lo, n)
            grams = zip(*(tokens[start - n + j:end - n + j] for j in range(n)))  # the n tokens before each pos
            for ref, gram in zip(range(base | start, base | end), grams):
                refs = table.get(gram)
                if refs is None:
                    table[gram] = [ref]
                    added += 1
                elif keep_all:
                    refs.append(ref)
                    added += 1
                else:
                    refs[0] = ref
        self.num_refs += added

    def _unindex(self, sid: int, lo: int, hi: int) -> None:
        """Drop the references at positions ``[lo, hi)`` of sequence ``sid`` (its tokens must still be there)."""
        tokens = self._tokens[sid]
        base = sid << _POS_BITS
        for pos in range(max(lo, 1), hi):
            for n in range(self.min_n, min(self.max_n, pos) + 1):
                self._discard(tuple(tokens[pos - n:pos]), base | pos)

    def _discard(self, gram: tuple[int, ...], ref: int) -> None:
        refs = self._table.get(gram)
        if refs is None:
            return
        for i in range(len(refs) - 1, -1, -1):  # the newest first: rewinds drop recent references
            if refs[i] == ref:
                self._delete(gram, refs, i)
                return

    def _delete(self, gram: tuple[int, ...], refs: list[int], i: int) -> None:
        del refs[i]
        self.num_refs -= 1
        if not refs:
            del self._table[gram]

    def _evict(self) -> None:
        """Forget the oldest recorded references beyond ``max_pool_entries``.

        Per n-gram, references sit in the order they were recorded, as in the FIFO; so when an entry leaves the
        FIFO its reference is either the n-gram's oldest or already gone (replaced, rewound or removed).
        """
        assert self._fifo is not None and self.max_pool_entries is not None
        while len(self._fifo) > self.max_pool_entries:
            gram, ref = self._fifo.popleft()
            refs = self._table.get(gram)
            if refs and refs[0] == ref:
                self._delete(gram, refs, 0)
            self._release(ref >> _POS_BITS)

    def _release(self, sid: int) -> None:
        left = self._fifo_count[sid] - 1
        if left:
            self._fifo_count[sid] = left
            return
        del self._fifo_count[sid]
        if sid in self._closed:
            self._drop(sid)

    # ---- lookup --------------------------------------------------------------------------------------
    def lookup(self, context_tail: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """The continuation of the longest n-gram ending ``context_tail`` (n from max down to min), at most
        ``min(max_tokens, num_speculative_tokens)`` tokens; ``[]`` when no n-gram of at least min tokens is known."""
        return self.lookup_match(context_tail, max_tokens)[0]

    def lookup_match(self, context_tail: Sequence[int], max_tokens: int | None = None) -> tuple[list[int], int]:
        """:meth:`lookup`, and the length n of the match it continues (0 when it found none)."""
        k = self.num_speculative_tokens if max_tokens is None else min(max_tokens, self.num_speculative_tokens)
        if k <= 0:
            return [], 0
        tail = tuple(context_tail[-self.max_n:])
        table = self._table
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            refs = table.get(tail[-n:])
            if refs:
                ref = refs[0] if self.is_use_oldest else refs[-1]
                pos = ref & _POS_MASK
                return self._tokens[ref >> _POS_BITS][pos:pos + k], n
        return [], 0

    def lookup_tree(self, context_tail: Sequence[int], max_nodes: int, num_branches: int, max_refs: int,
                    shape: list[tuple[int, ...]] | None = None) -> tuple[DraftTree, int]:
        """A token tree of what followed the longest n-gram ending ``context_tail`` in up to ``max_refs`` of its
        sightings (see the module docstring), at most ``max_nodes`` nodes and ``num_speculative_tokens`` deep,
        and the match length (0: no match, an empty tree)."""
        depth = min(max_nodes, self.num_speculative_tokens)
        tail = tuple(context_tail[-self.max_n:])
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            refs = self._table.get(tail[-n:])
            if refs:
                chosen = refs[:max_refs] if self.is_use_oldest else refs[: -max_refs - 1 : -1]
                trie = _Trie([self._tokens[r >> _POS_BITS][(r & _POS_MASK) : (r & _POS_MASK) + depth] for r in chosen])
                if shape is not None:
                    return static_tree(shape, trie.expand, max_nodes), n
                return dynamic_tree(trie.expand, max_nodes, num_branches, depth), n
        return DraftTree([], []), 0

    # ---- shipping ------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Plain data (lists, dicts, ints, the sequence keys) for another process's :meth:`merge`."""
        return {
            "version": SNAPSHOT_VERSION,
            "prompt_lookup_min": self.min_n,
            "prompt_lookup_max": self.max_n,
            "num_speculative_tokens": self.num_speculative_tokens,
            "sequences": [[self._seq_key[sid], list(tokens)] for sid, tokens in self._tokens.items()],
        }

    def merge(self, snapshot: dict[str, Any]) -> None:
        """Fold in another pool's :meth:`snapshot`: sequences new here are added closed (they go when evicted),
        ones already here are brought up to date (extended, or rewound where they differ)."""
        if snapshot.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"snapshot version {snapshot.get('version')!r} is not {SNAPSHOT_VERSION}; "
                             "snapshot and merge with the same specray version")
        for seq_key, tokens in snapshot["sequences"]:
            is_new = seq_key not in self._sid
            self.sync(seq_key, tokens)
            if is_new:
                self.close(seq_key)


class _Trie:
    """Continuations with counts: node -> {token: child}; expand(path) -> children by count (ties: first seen)
    with their share of the parent's count."""

    def __init__(self, continuations: list[list[int]]):
        self.children: list[dict[int, int]] = [{}]
        self.counts = [len(continuations)]
        for tokens in continuations:
            node = 0
            for token in tokens:
                child = self.children[node].get(token)
                if child is None:
                    child = self.children[node][token] = len(self.counts)
                    self.children.append({})
                    self.counts.append(0)
                self.counts[child] += 1
                node = child

    def expand(self, path: list[int]) -> list[tuple[int, float]]:
        node = 0
        for token in path:
            node = self.children[node].get(token)
            if node is None:
                return []
        total = self.counts[node]
        ranked = sorted(self.children[node].items(), key=lambda item: -self.counts[item[1]])
        return [(token, self.counts[child] / total) for token, child in ranked]


class PoolLink(Protocol):
    """A channel to a pool shared with other engine replicas (the Ray backend's named pool actor)."""

    def exchange(self, updates: list[tuple[str, int, list[int]]], wait: bool = False) -> list[tuple[str, int, list[int]]]:
        """Publish ``(seq_key, start, tokens[start:])`` of this replica's sequences; return the other replicas'
        changes in the same form. May answer from an earlier call (links are asynchronous) unless ``wait``."""
        ...


@dataclass
class _RequestState:
    pool: NgramPool
    seq_key: str
    source: Sequence[int] | None = None  # the history object indexed last time
    sid: int = -1  # the pool's id of seq_key, and its copy of the history (read every step without a lookup)
    stored: list[int] | None = None


class NgramDrafter:
    """Prompt lookup: propose what followed the longest earlier occurrence of the history's last n tokens.

    Each request gets its own pool, or all share one with ``is_public_pool`` (so a request can draft from
    text another one produced; finished requests' text stays until evicted). Deterministic: ``probs`` is None.
    A proposal's ``key`` is the length of the match it continues: longer matches are accepted more often.
    """

    cheap_proposals = True  # a lookup: the engine asks for the most drafts and sizes k by the match

    def __init__(self, spec: SpeculativeConfig, ctx: DrafterContext):
        self.options: NgramOptions = options_of(spec)
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.ctx = ctx
        self.shared_pool: NgramPool | None = None
        if self.options.is_public_pool:
            cap = self.options.max_pool_entries or DEFAULT_MAX_POOL_ENTRIES
            self.shared_pool = self._new_pool(cap)
        self._requests: dict[str, _RequestState] = {}
        self.pool_link: PoolLink | None = None
        self._published: dict[str, int] = {}  # seq_key -> tokens of it sent through the link
        self._unsent: list[tuple[str, int, list[int]]] = []  # finished requests' last updates
        # Private pools with chain lookups (the common case) are one C index per request when it is built: the
        # same answers as a private NgramPool's, at a fraction of the host time per step.
        self._indexes: dict[str, Any] | None = None
        if (NgramIndex is not None and self.shared_pool is None and not self.options.proposes_trees
                and self.options.prompt_lookup_max <= NATIVE_MAX_N):
            self._indexes = {}
        # a kept sighting that is not the oldest is the newest (is_keep_all=False keeps only that one)
        self._use_newest = not (self.options.is_keep_all and self.options.is_use_oldest)

    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        if self._indexes is not None:
            return self._propose_native(batch)
        proposals = [self._propose_one(req) for req in batch]
        if self.pool_link is not None:
            self.sync_pool()
        return proposals

    def finish(self, req_ids: Sequence[str]) -> None:
        if self._indexes is not None:
            for req_id in req_ids:
                self._indexes.pop(req_id, None)
            return
        for req_id in req_ids:
            state = self._requests.pop(req_id, None)
            if state is not None and self.shared_pool is not None:
                if self.pool_link is not None:  # its last tokens go out with the next exchange
                    self._publish_one(state.seq_key, self._unsent)
                    self._published.pop(state.seq_key, None)
                self.shared_pool.close(state.seq_key)

    def shutdown(self) -> None:
        """Nothing to release: the pool lives in this process (a link to a shared pool is the actor's)."""

    # ---- sharing the pool with other replicas -----------------------------------------------------------
    def attach_pool_link(self, link: PoolLink) -> None:
        if self.shared_pool is None:
            raise ValueError("a shared n-gram pool needs speculative_config.is_public_pool=True")
        self.pool_link = link

    def sync_pool(self, wait: bool = False) -> None:
        """Send what our requests added since the last exchange; fold in what other replicas added."""
        updates, self._unsent = self._unsent, []
        for state in self._requests.values():
            self._publish_one(state.seq_key, updates)
        for key, start, tokens in self.pool_link.exchange(updates, wait=wait):
            self._merge_remote(key, start, tokens)

    def _publish_one(self, key: str, updates: list) -> None:
        sent, tokens = self._published.get(key, 0), self.shared_pool.tokens(key)
        if len(tokens) > sent:
            updates.append((key, sent, tokens[sent:]))
            self._published[key] = len(tokens)

    def _merge_remote(self, key: str, start: int, tokens: list[int]) -> None:
        pool = self.shared_pool
        if key in self._published or start != pool.num_tokens(key):
            return  # our own text, or a sequence whose start we evicted: nothing to add
        is_new = key not in pool
        pool.extend(key, tokens)
        if is_new:
            pool.close(key)

    def _propose_native(self, batch: list[DraftRequest]) -> list[Proposal]:
        """:meth:`_propose_one` over C indexes: each request's index syncs to its history (indexing what is new,
        undoing a rewind) and looks up its longest match."""
        indexes, most, proposals = self._indexes, self.num_speculative_tokens, []
        lo, hi = self.options.prompt_lookup_min, self.options.prompt_lookup_max
        for req in batch:
            index = indexes.get(req.req_id)
            if index is None:
                index = indexes[req.req_id] = NgramIndex(lo, hi, self._use_newest)
            if index.sync(req.token_ids):
                logger.debug("n-gram drafter: request %s's history changed; re-indexed from the change", req.req_id)
            k = req.num_speculative_tokens
            if k <= 0:
                proposals.append(Proposal([]))
                continue
            tokens, n = index.lookup(k if k < most else most)
            proposals.append(Proposal(tokens, key=n or None))
        return proposals

    def _propose_one(self, req: DraftRequest) -> Proposal:
        state = self._requests.get(req.req_id) or self._state(req.req_id)
        indexed = self._catch_up(state, req.token_ids)
        if req.num_speculative_tokens <= 0:
            return Proposal([])
        opts = self.options
        if opts.proposes_trees:
            tree, n = state.pool.lookup_tree(indexed, req.num_speculative_tokens, opts.num_branches,
                                             opts.max_tree_refs, opts.speculative_token_tree)
            return Proposal(tree.token_ids, key=n or None, parents=tree.parents, scores=tree.scores)
        tokens, n = state.pool.lookup_match(indexed, req.num_speculative_tokens)  # it reads only the last max_n
        return Proposal(tokens, key=n or None)

    def _state(self, req_id: str) -> _RequestState:
        state = self._requests.get(req_id)
        if state is None:
            pool = self.shared_pool or self._new_pool()
            state = self._requests[req_id] = _RequestState(pool, pool.new_key())
        return state

    def _new_pool(self, max_pool_entries: int | None = None) -> NgramPool:
        return NgramPool.from_options(self.options, self.num_speculative_tokens, max_pool_entries)

    def _catch_up(self, state: _RequestState, history: Sequence[int]) -> list[int]:
        """Index what is new in ``history``: O(new tokens) when it is the list seen last time, grown by
        appends; otherwise (a new list, or a shorter one) compare it with the pool's copy and re-index.
        Returns the pool's copy of the history (do not modify it)."""
        pool, stored = state.pool, state.stored
        if history is state.source and pool._tokens.get(state.sid) is stored:
            indexed = len(stored)
            lo = max(0, indexed - self.options.prompt_lookup_max)
            seen = history[lo:indexed]  # the last indexed tokens are still there (not a list rewound in place)
            if len(history) >= indexed and (seen if isinstance(seen, list) else list(seen)) == stored[lo:indexed]:
                if len(history) > indexed:
                    pool._append(state.sid, history[indexed:])
                return stored
        indexed = pool.num_tokens(state.seq_key)
        kept = pool.sync(state.seq_key, history)
        if kept < indexed:
            logger.debug("n-gram drafter: request history changed at token %d of %d; re-indexed from there",
                         kept, indexed)
        state.sid = pool._sid[state.seq_key]
        state.stored = pool._tokens[state.sid]
        state.source = history
        return state.stored
