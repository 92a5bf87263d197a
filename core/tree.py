"""Token trees of drafts (torch-free): shapes, checks, trimming, and the two ways a drafter grows one.

A request's drafts form a tree when its drafter offers several candidates per position. Node ``i`` (0..k-1) of a
tree holds one token and names its parent: ``-1`` is the root (the request's last kept token, the one the target
scores first), any other value an earlier node (``parents[i] < i``: nodes come in topological order). A chain of
k drafts is ``[-1, 0, 1, .., k-2]``. A node at depth d (the root's children have depth 1) gets the RoPE position
``P + d`` (P: the root's) and attends to the context and its own ancestors only; its K/V goes to its own scratch
slot, and after verification the accepted path's K/V moves to the committed slots (``specray.contract.KVMove``).

Shapes drafters grow into:

* **static** (Medusa's ``medusa_choices``, TensorRT-LLM's and vLLM's ``speculative_token_tree``): a list of paths
  of candidate ranks, e.g. ``[[0], [1], [0, 0], [0, 1]]`` = the best two first tokens, and under the best one the
  best two second tokens. A path's prefixes are nodes too; they may be left out ("paths only").
* **dynamic** (EAGLE-2): best-first expansion by the score of the whole path (the product of each node's
  probability given its parent), each node offering its ``top_k`` best candidates, until ``max_nodes``.

Both are built from an ``expand(path_tokens) -> [(token, prob), ...]`` callback, best first, so a drafter only
says what may follow a path. The nodes come out best-first (by path score) where the order is free, so cutting a
tree to its first n nodes keeps the n best and stays a tree (:func:`trim_tree`).
"""

from __future__ import annotations

import ast
import heapq
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Expand = Callable[[list[int]], Sequence[tuple[int, float]]]


@dataclass(slots=True)
class DraftTree:
    """One request's draft nodes: ``token_ids[i]`` with parent ``parents[i]`` (see the module docstring) and the
    drafter's estimate ``scores[i]`` of the probability that node i is accepted given its parent was (None: it
    tells none). ``wants_node_tokens``: the drafter wants the target's argmax after each node once verified
    (``specray.contract.StepResult.node_tokens``; lookahead decoding's Jacobi iterates)."""

    token_ids: list[int]
    parents: list[int]
    scores: list[float] | None = None
    wants_node_tokens: bool = False

    def __len__(self) -> int:
        return len(self.token_ids)


def chain_parents(k: int) -> list[int]:
    return list(range(-1, k - 1))


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def check_parents(parents: Sequence[int]) -> None:
    """Our own invariant (drafters build trees through this module): topological order, parents in range."""
    for i, p in enumerate(parents):
        assert isinstance(p, int) and -1 <= p < i, f"node {i} has parent {p}: parents must be -1 or an earlier node"


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node: 1 for the root's children."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node`` (inclusive)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def path_scores(tree: DraftTree, default: float) -> list[float]:
    """Per node, the estimated probability that the whole path to it is accepted: the product of its nodes'
    scores (``default`` per node when the drafter gave none)."""
    out: list[float] = []
    for i, p in enumerate(tree.parents):
        own = default if tree.scores is None else tree.scores[i]
        out.append(own * (1.0 if p < 0 else out[p]))
    return out


def level_tree(width: int, depth: int) -> DraftTree:
    """A tree of ``width`` nodes on each of ``depth`` levels, level by level (a level's nodes under the first of
    the level above), for pricing a tree grown level by level by its shape alone: each node's score makes its path
    worth 1/width of its level (the first level's nodes score 1/width, the others 1), so that with a per-level
    acceptance alpha a level adds alpha^depth in all, split evenly among its nodes (only one of them can be kept)."""
    parents = [-1] * width
    for level in range(1, depth):
        parents += [(level - 1) * width] * width
    return DraftTree([0] * len(parents), parents, [1.0 / width] * width + [1.0] * (len(parents) - width))


def trim_tree(tree: DraftTree, max_nodes: int, max_depth: int | None = None) -> DraftTree:
    """The first ``max_nodes`` nodes no deeper than ``max_depth``, renumbered (still topological: a kept node's
    parent comes before it and is kept, being shallower)."""
    keep: list[int] = []
    if max_nodes > 0:
        for i, d in enumerate(depths(tree.parents)):
            if max_depth is None or d <= max_depth:
                keep.append(i)
                if len(keep) == max_nodes:
                    break
    if len(keep) == len(tree):
        return tree
    new_index = {old: new for new, old in enumerate(keep)}
    return DraftTree([tree.token_ids[i] for i in keep],
                     [-1 if tree.parents[i] < 0 else new_index[tree.parents[i]] for i in keep],
                     None if tree.scores is None else [tree.scores[i] for i in keep], tree.wants_node_tokens)


def kept_nodes(parents: Sequence[int], kept_parents: Sequence[int]) -> list[int]:
    """The indices (in the tree of ``parents``) of the nodes :func:`trim_tree` kept when it left a tree with
    ``kept_parents``: the first ``len(kept_parents)`` nodes no deeper than its deepest node. (trim_tree kept the
    first m nodes no deeper than some D >= that depth; they are also the first m no deeper than it.)"""
    m = len(kept_parents)
    if m == len(parents):
        return list(range(m))
    deepest = max(depths(kept_parents), default=0)
    return [i for i, d in enumerate(depths(parents)) if d <= deepest][:m]


# ---------------------------------------------------------------------------------------------- static shapes


def read_tree(value, field: str):
    """A tree option as given: a string read as JSON, or as a Python literal as vLLM takes it ("[(0,), (1,), (0, 0)]"),
    anything else as it is; a ValueError naming ``field`` for a string that is neither."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raise ValueError(f"{field}={value!r} is neither JSON ({err}) nor a Python literal; give a list of paths "
                             "such as [[0], [1], [0, 0]] or [(0,), (1,), (0, 0)]") from None


def parse_token_tree(value) -> list[tuple[int, ...]]:
    """A ``speculative_token_tree`` (a list of paths of candidate ranks, or a string of one: JSON, or a Python
    literal as vLLM takes it) -> every node's path, prefixes included, sorted by depth then rank (a topological
    order). Raises an actionable ValueError."""
    field = "speculative_config.speculative_token_tree"
    value = read_tree(value, field)
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{field}={value!r} must be a non-empty list of paths of candidate ranks, e.g. "
                         "[[0], [1], [0, 0]] (Medusa's medusa_choices)")
    nodes: set[tuple[int, ...]] = set()
    for path in value:
        if (not isinstance(path, (list, tuple)) or not path
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)):
            raise ValueError(f"{field} holds {path!r}: every path must be a non-empty list of ranks >= 0 "
                             "(0 = the best candidate at that depth)")
        nodes.update(tuple(path[:d]) for d in range(1, len(path) + 1))
    return sorted(nodes, key=lambda path: (len(path), path))


def static_tree(shape: Sequence[tuple[int, ...]], expand: Expand, max_nodes: int | None = None) -> DraftTree:
    """Grow the nodes of ``shape`` (from :func:`parse_token_tree`) whose candidate exists: node (r_1 .. r_d) is
    the r_d-th best candidate after the tokens of (r_1 .. r_{d-1}). A node whose parent is missing is skipped."""
    index: dict[tuple[int, ...], int] = {(): -1}
    tree = DraftTree([], [], [])
    cache: dict[tuple[int, ...], Sequence[tuple[int, float]]] = {}
    for path in shape:
        parent = index.get(path[:-1])
        if parent is None or (max_nodes is not None and len(tree) >= max_nodes):
            continue
        tokens = [tree.token_ids[i] for i in path_to(tree.parents, parent)] if parent >= 0 else []
        if path[:-1] not in cache:
            cache[path[:-1]] = expand(tokens)
        candidates = cache[path[:-1]]
        if path[-1] < len(candidates):
            token, prob = candidates[path[-1]]
            index[path] = len(tree)
            tree.token_ids.append(token)
            tree.parents.append(parent)
            tree.scores.append(prob)
    return tree


# ---------------------------------------------------------------------------------------------- dynamic shapes


def dynamic_tree(expand: Expand, max_nodes: int, top_k: int, max_depth: int, min_prob: float = 0.0) -> DraftTree:
    """EAGLE-2-style: repeatedly take the frontier candidate whose whole path is likeliest (the product of its
    nodes' probabilities), add it as a node and offer its own ``top_k`` best candidates, until ``max_nodes``
    nodes (or no candidate's path probability reaches ``min_prob``). Nodes come out best first."""
    tree = DraftTree([], [], [])
    frontier: list[tuple[float, int, int, int, float]] = []  # (-path prob, tie, parent, token, own prob)
    tie = 0

    def offer(parent: int, path_prob: float, path_tokens: list[int]) -> None:
        nonlocal tie
        for token, prob in list(expand(path_tokens))[:top_k]:
            if path_prob * prob >= min_prob and prob > 0:
                heapq.heappush(frontier, (-path_prob * prob, tie, parent, token, prob))
                tie += 1

    offer(-1, 1.0, [])
    node_tokens: list[list[int]] = []
    while frontier and len(tree) < max_nodes:
        neg_prob, _, parent, token, prob = heapq.heappop(frontier)
        tokens = (node_tokens[parent] if parent >= 0 else []) + [token]
        tree.token_ids.append(token)
        tree.parents.append(parent)
        tree.scores.append(prob)
        node_tokens.append(tokens)
        if len(tokens) < max_depth:
            offer(len(tree) - 1, -neg_prob, tokens)
    return tree
