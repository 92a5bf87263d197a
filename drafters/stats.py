"""Per-drafter statistics in llama.cpp's terms (``statistics ngram_mod: #calls = .., #gen drafts = .., ..``).

The engine tells an in-process drafter what each verification kept (``observe_verification(req_id, num_drafted,
num_accepted)``: exact, after the policy and the scheduler cut the proposal); :meth:`DrafterStats.verified` counts
it. (A proposal the policy cut to nothing was never verified: guessing acceptance from the next history would
count it as if it had been.)

* ``calls``: proposals asked for (one per request per step)
* ``gen_drafts`` / ``gen_tokens``: non-empty proposals / the tokens (tree nodes) in them
* ``acc_drafts`` / ``acc_tokens``: proposals of which the target kept at least one token / the tokens it kept
* ``dur_begin_ms``, ``dur_gen_ms``, ``dur_acc_ms``: time spent indexing new prompts, proposing, and learning
  from accepted tokens (the drafter measures these around its own code)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from specray.tree import DraftTree

_COUNTERS = ("calls", "gen_drafts", "acc_drafts", "gen_tokens", "acc_tokens")


def accepted_length(tree: DraftTree, continuation: Sequence[int]) -> int:
    """How many tokens of ``continuation`` (the history after the proposal's root) follow one path of ``tree``."""
    node, depth = -1, 0
    children: dict[int, dict[int, int]] = {}
    for i, (token, parent) in enumerate(zip(tree.token_ids, tree.parents)):
        children.setdefault(parent, {}).setdefault(token, i)
    for token in continuation:
        nxt = children.get(node, {}).get(token)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


@dataclass
class DrafterStats:
    name: str
    calls: int = 0
    gen_drafts: int = 0
    acc_drafts: int = 0
    gen_tokens: int = 0
    acc_tokens: int = 0
    dur_begin_s: float = 0.0
    dur_gen_s: float = 0.0
    dur_acc_s: float = 0.0

    def begin_call(self) -> None:
        """Count a call (one request asked for a proposal)."""
        self.calls += 1

    def proposed(self, num_tokens: int) -> None:
        """Count a proposal of ``num_tokens`` tokens (tree nodes); empty ones are not drafts."""
        if num_tokens:
            self.gen_drafts += 1
            self.gen_tokens += num_tokens

    def verified(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        """The engine's exact count of one verification of this drafter's proposal for ``req_id``."""
        if num_drafted:
            self.acc_tokens += num_accepted
            self.acc_drafts += num_accepted > 0

    def timer(self, which: str) -> "_Timer":
        """``with stats.timer("gen"): ...`` adds the block's wall time to ``dur_gen_s`` (begin, gen or acc)."""
        return _Timer(self, f"dur_{which}_s")

    def as_dict(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = {"name": self.name}
        out.update({k: getattr(self, k) for k in _COUNTERS})
        out.update({f"dur_{k}_ms": round(getattr(self, f"dur_{k}_s") * 1e3, 3) for k in ("begin", "gen", "acc")})
        return out

    def __str__(self) -> str:
        d = self.as_dict()
        return (f"statistics {self.name}: #calls = {d['calls']}, #gen drafts = {d['gen_drafts']}, #acc drafts = "
                f"{d['acc_drafts']}, #gen tokens = {d['gen_tokens']}, #acc tokens = {d['acc_tokens']}, "
                f"dur(b,g,a) = {d['dur_begin_ms']:.3f}, {d['dur_gen_ms']:.3f}, {d['dur_acc_ms']:.3f} ms")


class _Timer:
    __slots__ = ("stats", "attr", "start")

    def __init__(self, stats: DrafterStats, attr: str):
        self.stats, self.attr = stats, attr

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        setattr(self.stats, self.attr, getattr(self.stats, self.attr) + time.perf_counter() - self.start)
