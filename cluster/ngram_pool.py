"""A named actor that relays text between engine replicas' drafters: the n-gram drafter's pool, suffix decoding's
global tree of finished outputs.

Every replica's drafter keeps its own index (lookups stay local and fast) and, through a :class:`RayPoolLink`,
sends the actor what its requests added and receives what the others added: deltas only,
``(seq_key, start, tokens[start:])``, so a growing sequence costs what it grew by. The actor keeps at most
``max_tokens`` tokens, dropping the oldest sequences first. It knows nothing of the drafters: each method gets
actors of its own (:func:`get_pool_actor`), so one method's records never reach another's drafter.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from specray.cluster.ray_env import ray
from ray.exceptions import RayError

logger = logging.getLogger(__name__)

POOL_NAMESPACE = "specray"  # one namespace, so replicas of any job or Serve app find the same pool
DEFAULT_MAX_TOKENS = 1 << 22


class NgramPoolActor:
    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS):
        self.max_tokens = max_tokens
        self.seqs: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()  # key -> (origin, tokens)
        self.sent: dict[str, dict[str, int]] = {}  # origin -> key -> tokens of it that origin has received
        self.num_tokens = 0

    def exchange(self, origin: str, updates: list[tuple[str, int, list[int]]]) -> list[tuple[str, int, list[int]]]:
        for key, start, tokens in updates:
            self._apply(origin, key, start, tokens)
        self._evict()
        return self._changes_for(origin)

    def _apply(self, origin: str, key: str, start: int, tokens: list[int]) -> None:
        _, stored = self.seqs.setdefault(key, (origin, []))
        if start > len(stored):  # we evicted its beginning: keep nothing of it
            return
        self.num_tokens += start + len(tokens) - len(stored)
        del stored[start:]
        stored.extend(tokens)
        self.seqs.move_to_end(key)

    def _evict(self) -> None:
        while self.num_tokens > self.max_tokens and self.seqs:
            key, (_, tokens) = self.seqs.popitem(last=False)
            self.num_tokens -= len(tokens)
            for sent in self.sent.values():
                sent.pop(key, None)

    def _changes_for(self, origin: str) -> list[tuple[str, int, list[int]]]:
        sent = self.sent.setdefault(origin, {})
        out = []
        for key, (source, tokens) in self.seqs.items():
            have = sent.get(key, 0)
            if source != origin and len(tokens) > have:
                out.append((key, have, tokens[have:]))
                sent[key] = len(tokens)
        return out

    def stats(self) -> dict:
        return {"sequences": len(self.seqs), "tokens": self.num_tokens, "replicas": len(self.sent)}


POOL_NUM_CPUS = 0.05  # a pool actor's CPU share (one per pool name and method on the cluster)


def pool_actor_name(name: str, method: str = "ngram") -> str:
    """The actor of pool ``name`` for drafting ``method``: replicas of one method share it, other methods that
    name the same pool get their own (their records mean different things)."""
    return f"specray-{method}-pool:{name}"


def get_pool_actor(name: str, method: str = "ngram"):
    """The pool actor called ``name`` for ``method``, created on first use (detached: it outlives any one
    replica)."""
    return ray.remote(NgramPoolActor).options(
        name=pool_actor_name(name, method), namespace=POOL_NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=POOL_NUM_CPUS,
    ).remote()


POOL_REPLY_TIMEOUT_S = 60.0  # a pool that has not answered an exchange in this long is treated as lost


class RayPoolLink:
    """The drafter's side: one exchange in flight at a time; updates made meanwhile wait for the next one. A pool
    that fails, or does not answer within ``reply_timeout_s`` (an actor the cluster cannot place), is given up:
    the drafter goes on with its own replica's text and nothing more is kept for the pool."""

    def __init__(self, actor, origin: str):
        self.actor = actor
        self.origin = origin
        self.pending = None  # ObjectRef of the exchange in flight
        self.sent_at = 0.0  # when it was sent (time.monotonic)
        self.buffered: list[tuple[str, int, list[int]]] = []
        self.failed = False
        self.reply_timeout_s = POOL_REPLY_TIMEOUT_S

    def exchange(self, updates, wait: bool = False):
        if self.failed:
            return []
        self.buffered.extend(updates)
        received = self._collect(wait)
        if self.pending is None and not self.failed:
            self.pending = self.actor.exchange.remote(self.origin, self.buffered)
            self.sent_at, self.buffered = time.monotonic(), []
            if wait:
                received += self._collect(True)
        return received

    def _collect(self, wait: bool) -> list:
        if self.pending is None:
            return []
        left = self.reply_timeout_s - (time.monotonic() - self.sent_at)
        ready, _ = ray.wait([self.pending], timeout=max(left, 0) if wait else 0)
        if not ready:
            if left <= 0 or wait:
                self._give_up(f"no answer in {self.reply_timeout_s:g} s: an actor the cluster could not place asks "
                              f"for {POOL_NUM_CPUS} CPU on some node")
            return []
        ref, self.pending = self.pending, None
        try:
            return ray.get(ref)
        except RayError as err:
            self._give_up(str(err))
            return []

    def _give_up(self, why: str) -> None:
        logger.warning("shared drafter pool unreachable (%s): drafting from this replica's text only", why)
        self.failed, self.pending, self.buffered = True, None, []
