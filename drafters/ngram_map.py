"""``ngram_map_k`` and ``ngram_map_k4v``: llama.cpp's ``--spec-type ngram-map-k`` / ``ngram-map-k4v``. Torch-free.

Both keep, per request, a map from *key* n-grams (``ngram_size_n`` tokens) to what followed them. An occurrence
of a key counts once the ``m`` tokens after it (its *value* m-gram, ``ngram_size_m``) are in the history. The key
looked up is the history's last ``n`` tokens; it is used only when it occurred at least ``min_hits`` times
(llama.cpp's ``--spec-ngram-min-hits``), and only every ``check_rate`` tokens (``--spec-ngram-check-rate``).

* ``ngram_map_k``: propose the value that followed the key's most recent occurrence.
* ``ngram_map_k4v``: per key, count up to four distinct values (the first four seen; later new ones are not
  counted). With ``tree=False``, llama.cpp's rule: propose the most frequent value only if it occurred at least
  twice as often as all the others together, else nothing. With ``tree=True`` (default) propose a token tree of
  the values (``specray.tree.dynamic_tree`` over their trie): a node's score is the share of the counted
  occurrences through it among those through its parent, nodes best first by the share of all occurrences
  through them, so a dominant value's chain comes first and the others branch off it as the budget allows.

"The number of accepted tokens is stored for each used n-gram": after a proposal, the drafter reads from the
history how many tokens of each used value the target followed (the accepted drafts plus its own next token) and
proposes at most that many (at least one) of that value next time (llama.cpp's ``n_accepted``, per key for
``ngram_map_k``, per key and value for ``k4v``). A value the target followed further than proposed grows by one.

Incremental index: each new token completes at most one occurrence (the key ending ``m`` tokens earlier); a
rewind undoes occurrences newest first, which restores exactly the earlier counts and value slots. A lookup is a
dict lookup (plus a trie of at most 4 values of ``m`` tokens for k4v).

Differences from llama.cpp (deliberate): ``min_hits`` counts the key's occurrences in the history, as documented
(llama.cpp counts its own lookups that found the key, and its map-k skips the check); the key is found through
the index, not by a backward scan; k4v drafts the chosen value's tokens (llama.cpp copies the tokens after the
most recent occurrence, whichever value they are); the stored acceptance is floored at one token and may grow
back (llama.cpp's can reach zero and never grow); occurrences at position 0 count (llama.cpp skips them).

``key`` of a proposal: the key's occurrence count (map-k) or its best value's count (k4v), capped at KEY_CAP.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from specray.drafters.base import Proposal
from specray.drafters.ngram_common import (KEY_CAP, LookupDrafter, LookupState, check_bool, check_int,
                                          common_prefix_length)
from specray.tree import dynamic_tree

MAX_VALUES = 4  # llama.cpp's COMMON_NGRAM_MAX_VALUES
DOMINANCE = 2  # k4v without a tree: the best value must occur DOMINANCE times as often as the others together


@dataclass
class NgramMapOptions:
    """``speculative_config`` keys of ``method="ngram_map_k"`` (llama.cpp's names and defaults)."""

    ngram_size_n: int = 12  # --spec-ngram-size-n: length of the key n-gram
    ngram_size_m: int = 48  # --spec-ngram-size-m: length of the value m-gram (the most tokens drafted)
    min_hits: int = 1  # --spec-ngram-min-hits: occurrences of the key needed before it is drafted from
    check_rate: int = 1  # --spec-ngram-check-rate: look up every R tokens

    METHOD = "ngram_map_k"

    def __post_init__(self) -> None:
        method = self.METHOD
        check_int(method, "ngram_size_n", self.ngram_size_n, 1, what="llama.cpp's --spec-ngram-size-n")
        check_int(method, "ngram_size_m", self.ngram_size_m, 1, what="llama.cpp's --spec-ngram-size-m")
        check_int(method, "min_hits", self.min_hits, 1, what="llama.cpp's --spec-ngram-min-hits")
        check_int(method, "check_rate", self.check_rate, 1, what="look up every check_rate tokens")


@dataclass
class NgramMapK4vOptions(NgramMapOptions):
    """``speculative_config`` keys of ``method="ngram_map_k4v"``: those of ``ngram_map_k`` and ``tree``."""

    tree: bool = True  # propose a tree of the key's values (False: llama.cpp's dominant value only)

    METHOD = "ngram_map_k4v"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool(self.METHOD, "tree", self.tree)


class KeyStats:
    """One key n-gram: the starts of its counted occurrences (oldest first) and its values ``[m-gram, count]``
    in the order first seen (k4v only)."""

    __slots__ = ("starts", "values")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.values: list[list] = []

    def __eq__(self, other) -> bool:
        return isinstance(other, KeyStats) and (self.starts, self.values) == (other.starts, other.values)

    def __repr__(self) -> str:
        return f"KeyStats(starts={self.starts}, values={self.values})"


class MapState(LookupState):
    def __init__(self, n: int, m: int, count_values: bool):
        super().__init__()
        self.n, self.m, self.count_values = n, m, count_values
        self.keys: dict[tuple[int, ...], KeyStats] = {}
        self.caps: dict[Hashable, int] = {}  # most tokens to draft of a key (map-k) or (key, value) (k4v)

    def advance(self, start: int) -> None:
        span = self.n + self.m
        for t in range(max(start, span - 1), len(self.tokens)):  # token t completes the occurrence at t+1-span
            self._count(t + 1 - span)

    def rewind(self, kept: int) -> None:
        span = self.n + self.m
        for t in range(len(self.tokens) - 1, max(kept, span - 1) - 1, -1):
            self._uncount(t + 1 - span)

    def _count(self, j: int) -> None:
        tokens, n = self.tokens, self.n
        gram = tuple(tokens[j:j + n])
        stats = self.keys.get(gram)
        if stats is None:
            stats = self.keys[gram] = KeyStats()
        stats.starts.append(j)
        if self.count_values:
            value = tuple(tokens[j + n:j + n + self.m])
            for slot in stats.values:
                if slot[0] == value:
                    slot[1] += 1
                    return
            if len(stats.values) < MAX_VALUES:
                stats.values.append([value, 1])

    def _uncount(self, j: int) -> None:
        tokens, n = self.tokens, self.n
        gram = tuple(tokens[j:j + n])
        stats = self.keys[gram]
        assert stats.starts[-1] == j, (stats.starts, j)
        stats.starts.pop()
        if self.count_values:
            value = tuple(tokens[j + n:j + n + self.m])
            for slot in stats.values:
                if slot[0] == value:
                    slot[1] -= 1
                    if not slot[1]:
                        stats.values.remove(slot)
                    break
        if not stats.starts:
            del self.keys[gram]

    def current_key(self) -> tuple[tuple[int, ...], KeyStats | None]:
        gram = tuple(self.tokens[-self.n:]) if len(self.tokens) >= self.n else ()
        return gram, self.keys.get(gram)


class NgramMapDrafter(LookupDrafter):
    """The shared class of ``ngram_map_k`` (``count_values=False``) and ``ngram_map_k4v`` (True)."""

    count_values = False

    def _new_state(self) -> MapState:
        return MapState(self.options.ngram_size_n, self.options.ngram_size_m, self.count_values)

    def _draft(self, state: MapState, k: int) -> Proposal:
        if not state.check_due(self.options.check_rate):
            return Proposal([])
        gram, stats = state.current_key()
        if stats is None or len(stats.starts) < self.options.min_hits:
            return Proposal([])
        return self._draft_values(state, gram, stats, k)

    def _draft_values(self, state: MapState, gram: tuple[int, ...], stats: KeyStats, k: int) -> Proposal:
        """map-k: the value after the key's most recent occurrence."""
        begin = stats.starts[-1] + state.n
        value = tuple(state.tokens[begin:begin + state.m])
        state.pending = [(gram, value)]
        return Proposal(list(value[:min(state.caps.get(gram, state.m), k)]), key=min(len(stats.starts), KEY_CAP))

    def _learn(self, state: MapState, root: int) -> None:
        """Store how many tokens of each used value the target followed (at least one)."""
        for cap_id, value in state.pending:
            followed = common_prefix_length(state.tokens[root:root + len(value)], value)
            state.caps[cap_id] = max(1, followed)


class NgramMapKDrafter(NgramMapDrafter):
    name = "ngram_map_k"


class NgramMapK4vDrafter(NgramMapDrafter):
    name = "ngram_map_k4v"
    count_values = True

    def _draft_values(self, state: MapState, gram: tuple[int, ...], stats: KeyStats, k: int) -> Proposal:
        values = [(value, count, state.caps.get((gram, value), state.m)) for value, count in stats.values]
        best = max(range(len(values)), key=lambda i: values[i][1])  # the first of the most frequent
        best_count = values[best][1]
        if not self.options.tree:
            others = sum(count for _, count, _ in values) - best_count
            if others and best_count < DOMINANCE * others:
                return Proposal([])
            value, _, cap = values[best]
            state.pending = [((gram, value), value)]
            return Proposal(list(value[:min(cap, k)]), key=min(best_count, KEY_CAP))
        tree = value_tree([(value[:cap], count) for value, count, cap in values], k)
        used = {tree.token_ids[i] for i, p in enumerate(tree.parents) if p < 0}
        state.pending = [((gram, value), value) for value, _, _ in values if value[0] in used]
        return Proposal(tree.token_ids, key=min(best_count, KEY_CAP), parents=tree.parents, scores=tree.scores)


def value_tree(values: list[tuple[tuple[int, ...], int]], max_nodes: int):
    """A best-first token tree of at most ``max_nodes`` nodes over ``values`` (m-grams with their counts): the
    trie of the values, each node scored by the share of the counts through it among those through its parent."""
    children: list[dict[int, int]] = [{}]  # trie node -> {token: child node}; node 0 is the root
    weight = [0]  # counts through each node
    for value, count in values:
        node = 0
        weight[0] += count
        for token in value:
            nxt = children[node].get(token)
            if nxt is None:
                nxt = children[node][token] = len(weight)
                children.append({})
                weight.append(0)
            weight[nxt] += count
            node = nxt

    def expand(path: list[int]) -> list[tuple[int, float]]:
        node = 0
        for token in path:
            node = children[node][token]
        kids = sorted(children[node].items(), key=lambda item: -weight[item[1]])  # stable: first seen first
        return [(token, weight[child] / weight[node]) for token, child in kids]

    depth = max((len(value) for value, _ in values), default=0)
    return dynamic_tree(expand, max_nodes, top_k=MAX_VALUES, max_depth=depth)
