"""Drafters as Ray actors, placed apart from the target (another node, or CPU only).

:class:`RemoteDrafter` is the engine's :class:`Drafter`: it sends each request's new tokens only (the actor
keeps every history) on a step channel (a socket, as the target's steps: a Ray call per step costs more than
an n-gram lookup), gets the proposals back, and when the actor is lost it drafts nothing (the engine then
decodes without speculation: slower, never wrong) while a replacement starts in the background.

The drafter's optional hooks (``observe_verification``, ``observe_finished``, ``observe_node_tokens``; see
:data:`HOOKS`) are exposed by :class:`RemoteDrafter` only when the actor's drafter has them (the engine calls
what ``getattr`` finds). The engine's calls are queued as events and ride the channel's next message (a proposal,
a prefetch, or the message ``finish`` sends), so the actor applies them in the order the engine made them, before
it drafts, and a step costs no extra round trip. A finished history travels as a delta against the actor's copy.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import replace

from specray.cluster import placement as placement_groups
from specray.cluster.placement import SETUP_TIMEOUT_S, rendezvous_address
from specray.cluster.ngram_pool import RayPoolLink, get_pool_actor
from specray.cluster.ray_env import ray
from specray.cluster.remote_errors import raise_remote
from specray.cluster.step_channel import StepClient, StepServer
from specray.config import RayPlacement, SpeculativeConfig
from specray.drafters.base import DraftRequest, DrafterContext, Proposal, prepared, propose_isolating_failures
from specray.drafters.registry import drafter_class, tensor_parallel_size, uses_public_pool
from specray.errors import StepError, WorkerDiedError
from ray.exceptions import RayError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)

DRAFT_TIMEOUT_S = 60.0  # a drafter slower than this is treated as lost
RESPAWN_BACKOFF_S = 5.0
DRAFTER_PEER = "drafter actor rank"  # how errors and logs name the drafter's ranks (not the target's)
# optional drafter hooks the engine calls (``getattr``); forwarded to the actor's drafter when it has them
HOOKS = ("observe_verification", "observe_finished", "observe_node_tokens", "reset_prefix_cache")


class DrafterWorker:
    """The actor: one drafter and the token history of every request it drafts for. ``propose`` comes on the
    step channel's thread, the rest as Ray calls on the actor's thread: a lock keeps them one at a time."""

    def __init__(self):
        self.drafter = None
        self.histories: dict[str, list[int]] = {}
        self.lock = threading.Lock()
        self.rank = 0
        self.world_size = 1
        self.handlers: dict[str, object] = {}  # event name -> what applies it

    def setup(self, spec: SpeculativeConfig, ctx: DrafterContext, pool_name: str | None = None,
              rank: int = 0, world_size: int = 1, init_method: str | None = None) -> list[str]:
        """Build the drafter (a method, not ``__init__``, so that a user error comes back as a ValueError).
        Returns the optional hooks it has (of :data:`HOOKS`, and ``stats``)."""
        self.rank, self.world_size = rank, world_size
        if world_size > 1:  # a draft model split over ranks: every rank runs the same drafter on its shard
            ctx = replace(ctx, tp_group=self._join(ctx, rank, world_size, init_method))
        self.drafter = drafter_class(spec.method)(spec, ctx)
        if pool_name is not None and uses_public_pool(spec):
            link = RayPoolLink(get_pool_actor(pool_name, spec.method), uuid.uuid4().hex)
            self.drafter.attach_pool_link(link)
        hooks = [h for h in (*HOOKS, "stats") if callable(getattr(self.drafter, h, None))]
        self.handlers = {h: getattr(self.drafter, h) for h in hooks if h in HOOKS}
        if "observe_finished" in self.handlers:  # the actor completes its copy of the history first
            self.handlers["observe_finished"] = self._observe_finished
        self.handlers["finish"] = self._finish
        return hooks

    @staticmethod
    def _join(ctx: DrafterContext, rank: int, world_size: int, init_method: str):
        import torch

        from specray.workers.worker import join_tp_group, resolve_device

        device = resolve_device(ctx.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.manual_seed(ctx.seed)  # unseeded requests sample the same tokens on every rank
        return join_tp_group(device, rank, world_size, init_method)

    def propose(self, updates: list[tuple], events: list[tuple] = ()) -> list[Proposal]:
        """``events``: the engine's hook calls and finishes since the last message, ``(name, *args)`` in order
        (see :meth:`RemoteDrafter._queue`), applied first. ``updates``: (req_id, start, token_ids[start:],
        num_speculative_tokens, sampling_params, num_prompt_tokens) per request (none: a message of events only).
        Every rank applies and drafts (the model's collectives need them all); rank 0 answers, the others answer
        nothing."""
        with self.lock:
            for name, *args in events:
                try:
                    self.handlers[name](*args)
                except Exception:  # a hook's or finish's failure (a user-provided drafter's bug): as in the engine
                    logger.exception("the drafter's %s failed; ignored", name)
            if not updates:
                return []
            batch = []
            for req_id, start, tokens, num_speculative_tokens, params, num_prompt in updates:
                history = self.histories.setdefault(req_id, [])
                del history[start:]
                history.extend(tokens)
                batch.append(DraftRequest(req_id, history, num_speculative_tokens, params,
                                          num_prompt_tokens=num_prompt))
            if self.world_size > 1:  # the ranks draft together (their collectives): one's failure is the actor's
                proposals = self.drafter.propose(batch)
            else:
                proposals = propose_isolating_failures(self.drafter, batch)
            return proposals if self.rank == 0 else []

    def _finish(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            self.histories.pop(rid, None)
        self.drafter.finish(req_ids)

    def _observe_finished(self, req_id: str, start: int, tokens: list[int]) -> None:
        """The finished history is the actor's copy up to ``start``, then ``tokens``."""
        history = self.histories.setdefault(req_id, [])
        del history[start:]
        history.extend(tokens)
        self.drafter.observe_finished(req_id, history)

    def stats(self) -> dict | None:
        """The drafter's statistics as plain data (None: it keeps none)."""
        with self.lock:
            stats = getattr(self.drafter, "stats", None)
            return dict(stats()) if callable(stats) else None

    def run(self, fn, *args):
        """``fn(drafter, *args)`` between proposals (``fn`` is pickled by the caller): inspection and tests."""
        with self.lock:
            return fn(self.drafter, *args)

    def sync_pool(self) -> None:
        """Finish an exchange with the shared pool now (tests; normally it happens with every proposal)."""
        with self.lock:
            if getattr(self.drafter, "pool_link", None) is not None:
                self.drafter.sync_pool(wait=True)
                self.drafter.sync_pool(wait=True)

    def rendezvous(self) -> str:
        return rendezvous_address()

    def open_step_channel(self) -> tuple[str, int, bytes]:
        """Serve ``propose`` on a socket; returns (host, port, token) for :class:`StepClient`."""
        # the channel's thread runs the drafter with this thread's torch thread count; a drafter that never
        # imported torch (n-gram, suffix) leaves this process without it (importing it is most of a start-up)
        torch = sys.modules.get("torch")
        threads = torch.get_num_threads() if torch is not None else None
        self.step_server = StepServer(self.propose, ray.util.get_node_ip_address(),
                                      None if torch is None else lambda: torch.set_num_threads(threads))
        return self.step_server.address

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class RemoteDrafter:
    def __init__(self, spec: SpeculativeConfig, ctx: DrafterContext, placement: RayPlacement | None):
        self.spec = spec
        self.placement = placement or RayPlacement()
        device = "cuda" if self.placement.drafter_num_gpus else "cpu"
        self.ctx = replace(prepared(drafter_class(spec.method), spec, ctx), target_tokenizer=None, device=device)
        # req_id -> (n, tail): the actor's copy of the history is its first n tokens, then ``tail`` (drafts a
        # prefetch assumed kept; they may turn out wrong)
        self.sent: dict[str, tuple[int, list[int]]] = {}
        self.pending, self.pending_ids = False, []  # a prefetch whose answer is still on the channel
        self.prefetched: dict[str, Proposal] = {}  # a prefetch's answer read early (``stats``), by request id
        self.events: list[tuple] = []  # hook calls and finishes for the channel's next message, in order
        self.unanswered: deque[bool] = deque()  # per message whose answer is unread: whether one waits for it
        self.num_prefetch_hits = 0
        self.drafts_ahead = self.placement.draft_ahead  # the engine then calls prefetch every step
        self.cheap_proposals = getattr(drafter_class(spec.method), "cheap_proposals", False)  # sized by key
        self.tp_size = tensor_parallel_size(spec)
        self.actors, self.pg, refs = self._spawn()
        try:  # surfaces a user error (wrong vocabulary, heads not divisible...) at start
            ready = ray.get(refs, timeout=SETUP_TIMEOUT_S)
            self.channel = StepClient(ready[self.tp_size:], peer=DRAFTER_PEER)
        except RayTaskError as err:
            self._kill(self.actors, self.pg)
            raise_remote(err)
        except (RayError, WorkerDiedError):
            self._kill(self.actors, self.pg)
            raise
        self._expose(ready[0])
        self.starting = None  # a replacement group being brought up after a failure: (actors, pg, ready refs)
        self.lost_at = 0.0

    def _expose(self, hooks: list[str]) -> None:
        """Take on the optional hooks the actor's drafter has, and only those: the engine calls a hook when
        ``getattr`` finds it, and a hook the drafter lacks would cost a queued event for nothing."""
        forwarders = {"observe_verification": self._observe_verification, "observe_finished": self._observe_finished,
                      "observe_node_tokens": self._observe_node_tokens, "stats": self._stats,
                      "reset_prefix_cache": self._reset_prefix_cache}
        for name in hooks:
            setattr(self, name, forwarders[name])

    @property
    def actor(self):
        """Rank 0's actor (the one that answers), or None while the drafter is lost."""
        return self.actors[0] if self.actors else None

    def _spawn(self) -> tuple[list, object | None, list]:
        """The drafter's actors (one per draft TP rank), their placement group (several ranks only), and the
        refs of their setups followed by their step channels' addresses."""
        options = dict(num_cpus=self.placement.drafter_num_cpus, num_gpus=self.placement.drafter_num_gpus,
                       max_restarts=0)
        if self.placement.drafter_resources:
            options["resources"] = dict(self.placement.drafter_resources)
        actor_cls = ray.remote(DrafterWorker)
        args = (self.spec, self.ctx, self.placement.pool_name)
        # a placement group even for one rank: one that can never be placed is an error at once, one that waits
        # too long an error after placement's timeout, each naming the options to change
        pg, in_bundle = self._placement_group(options)
        actors = [actor_cls.options(**options, scheduling_strategy=s).remote() for s in in_bundle]
        init_method = None
        if self.tp_size > 1:
            init_method = ray.get(actors[0].rendezvous.remote(), timeout=SETUP_TIMEOUT_S)
        setups = [a.setup.remote(*args, rank=rank, world_size=self.tp_size, init_method=init_method)
                  for rank, a in enumerate(actors)]
        return actors, pg, setups + [a.open_step_channel.remote() for a in actors]

    def _placement_group(self, options: dict) -> tuple[object, list]:
        bundle = {"CPU": options["num_cpus"], **({"GPU": options["num_gpus"]} if options["num_gpus"] else {}),
                  **options.pop("resources", {})}
        pg = placement_groups.create([bundle] * self.tp_size, self.placement.strategy, "draft",
                                     "lower speculative_config.draft_tensor_parallel_size or "
                                     "ray_placement.drafter_num_cpus/drafter_num_gpus")
        return pg, [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i) for i in range(self.tp_size)]

    @staticmethod
    def _kill(actors: list, pg) -> None:
        for actor in actors:
            ray.kill(actor)
        placement_groups.remove(pg)

    # ---- the Drafter protocol ------------------------------------------------------------------------------
    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        """Proposals for ``batch``: taken from the prefetch when it guessed right, else asked for now."""
        if self.actor is None and not self._replaced():
            return [Proposal([]) for _ in batch]
        self._collect_prefetch()
        prefetched, self.prefetched = self.prefetched, {}
        out: list[Proposal | None] = [self._prefetch_hit(r, prefetched.get(r.req_id)) for r in batch]
        misses = [r for r, p in zip(batch, out) if p is None]
        if misses and self._send(misses):
            fresh = self._receive()
            if fresh is None:
                return [Proposal([]) for _ in batch]
            fresh_iter = iter(fresh)
            out = [p if p is not None else next(fresh_iter) for p in out]
        self.num_prefetch_hits += len(batch) - len(misses)
        return [p if p is not None else Proposal([]) for p in out]

    def prefetch(self, batch: list[DraftRequest]) -> None:
        """Start drafting the next step now, while the target verifies this one. ``batch`` holds each request's
        history as it will be if the target keeps every draft; ``num_speculative_tokens`` counts one token more,
        the drafter's guess of the target's own token. The next ``propose`` uses a request's drafts only when the
        target did keep every draft and its own token is that guess, so the drafts follow the real history."""
        if not self.actors or self.pending:
            return
        if self._send(batch):
            self.pending = True
            self.pending_ids = [r.req_id for r in batch]

    # ---- the optional hooks (exposed by _expose when the actor's drafter has them) ----------------------------
    def _observe_verification(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        self._queue(("observe_verification", req_id, num_drafted, num_accepted))

    def _observe_node_tokens(self, req_id: str, node_tokens: list[int]) -> None:
        self._queue(("observe_node_tokens", req_id, list(node_tokens)))

    def _reset_prefix_cache(self) -> None:
        self._queue(("reset_prefix_cache",))  # every rank's draft model forgets its cached blocks

    def _observe_finished(self, req_id: str, token_ids) -> None:
        """Queued before the ``finish`` the engine calls next, so the actor completes the history it still
        holds: only what its copy lacks travels."""
        if not self.actors:
            return
        begin = self._held_prefix(req_id, token_ids)
        self._queue(("observe_finished", req_id, begin, list(token_ids[begin:])))
        self.sent[req_id] = (len(token_ids), [])  # the actor now holds it: ``finish`` releases it there

    def _stats(self) -> dict | None:
        """The actor's drafter's statistics, after it has applied every event queued so far (None while the
        drafter is lost; a replacement counts from zero)."""
        if not self.deliver():
            return None
        try:  # not ray.get: in the engine actor it would warn of blocking its event loop, which this is not on
            return self.actor.stats.remote().future().result(timeout=DRAFT_TIMEOUT_S)
        except (RayError, TimeoutError) as err:
            logger.warning("drafter statistics unavailable (%s)", err)
            return None

    def deliver(self) -> bool:
        """Send the queued events now and wait until the actor has applied them (before a Ray call that must
        see them: statistics, inspection, tests). False when the drafter is lost."""
        self._collect_prefetch()  # its answer comes first on the channel; ``propose`` still uses it
        return self._send([]) and self._receive() is not None

    def sync_pool(self) -> None:
        """Deliver the queued events, then finish an exchange with the shared pool (tests; normally one happens
        with every proposal)."""
        if self.deliver():
            ray.get(self.actor.sync_pool.remote(), timeout=DRAFT_TIMEOUT_S)

    def _queue(self, event: tuple) -> None:
        if self.actors:  # a replacement starts afresh: events for the lost actor are moot
            self.events.append(event)

    # ---- helpers -------------------------------------------------------------------------------------------
    def _send(self, batch: list[DraftRequest], wanted: bool = True) -> bool:
        """Send the queued events, the histories' new tokens (from where the actor's copy first differs) and
        the draft budgets. ``wanted``: someone will read the answer (else ``_receive`` drops it)."""
        if not self.actors:
            return False
        updates = []
        for r in batch:
            begin = self._synced_prefix(r)
            updates.append((r.req_id, begin, list(r.token_ids[begin:]), r.num_speculative_tokens,
                            r.sampling_params, r.num_prompt_tokens))
            real = len(r.token_ids) - r.num_assumed  # the actor's copy now ends in the assumed drafts, if any
            self.sent[r.req_id] = (real, list(r.token_ids[real:]))
        events, self.events = self.events, []
        try:
            message = (updates, events)  # one object: pickled once for every rank
            self.channel.send([message] * len(self.actors), "drafting")
        except WorkerDiedError as err:
            self._lost(err)
            return False
        self.unanswered.append(wanted)
        return True

    def _receive(self) -> list[Proposal] | None:
        """The answer to the oldest message someone waits for (answers to ``finish``'s messages are dropped)."""
        try:
            while True:
                wanted = self.unanswered.popleft()
                answer = self.channel.receive(DRAFT_TIMEOUT_S, "drafting")
                if wanted:
                    return answer
        except (WorkerDiedError, StepError) as err:  # a drafter that raised may hold half-updated histories
            self._lost(err)
            return None

    def _collect_prefetch(self) -> None:
        """Read a prefetch's answer, if one is on the way, into ``prefetched``."""
        if not self.pending:
            return
        self.pending = False
        proposals = self._receive()
        if proposals is not None:
            self.prefetched = dict(zip(self.pending_ids, proposals))

    def _prefetch_hit(self, r: DraftRequest, p: Proposal | None) -> Proposal | None:
        if p is None or not p.token_ids or r.num_speculative_tokens == 0:
            return None
        n0, tail = self.sent.get(r.req_id, (0, []))
        if len(r.token_ids) != n0 + len(tail) + 1 or list(r.token_ids[n0:]) != tail + p.token_ids[:1]:
            return None
        self.sent[r.req_id] = (n0 + len(tail), [])  # every token the actor holds turned out right
        k = r.num_speculative_tokens
        return Proposal(p.token_ids[1:1 + k], None if p.probs is None else p.probs[1:1 + k], p.key)

    def _synced_prefix(self, r: DraftRequest) -> int:
        """How many leading tokens of ``r``'s history the actor's copy already holds."""
        return self._held_prefix(r.req_id, r.token_ids)

    def _held_prefix(self, req_id: str, token_ids) -> int:
        """How many leading tokens of the history ``token_ids`` the actor's copy of ``req_id`` holds."""
        n0, tail = self.sent.get(req_id, (0, []))
        n0 = min(n0, len(token_ids))
        same = 0
        for a, b in zip(tail, token_ids[n0:]):
            if a != b:
                break
            same += 1
        return n0 + same

    def finish(self, req_ids) -> None:
        """Sent at once with the queued events (after any ``observe_finished`` of these requests) on the
        channel, in order with the proposals; nothing waits for the answer."""
        req_ids = [r for r in req_ids if self.sent.pop(r, None) is not None]
        if req_ids:
            self._queue(("finish", req_ids))
            self._send([], wanted=False)

    def shutdown(self) -> None:
        if self.actors:
            self.channel.close()
            self._kill(self.actors, self.pg)
        if self.starting is not None:
            self._kill(*self.starting[:2])
        self.actors, self.pg, self.starting = [], None, None

    # ---- failure -------------------------------------------------------------------------------------------
    def _lost(self, err: BaseException) -> None:
        remote = getattr(err, "remote_traceback", "")
        logger.warning("drafter actor lost (%s): decoding without speculation until a new one is up (the target's "
                       "ranks are unaffected)%s", err, f"\nremote traceback:\n{remote}" if remote else "")
        self.channel.close()
        self._kill(self.actors, self.pg)
        self.actors, self.pg, self.sent, self.lost_at = [], None, {}, time.monotonic()
        self.pending, self.pending_ids, self.prefetched = False, [], {}
        self.events, self.unanswered = [], deque()

    def _replaced(self) -> bool:
        """Start a replacement (after a back-off) and switch to it once every rank answers; never blocks."""
        if self.starting is None:
            if time.monotonic() - self.lost_at < RESPAWN_BACKOFF_S:
                return False
            self.starting = self._spawn()
        actors, pg, refs = self.starting
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if len(ready) < len(refs):
            return False
        try:
            channel = StepClient(ray.get(refs)[len(actors):], peer=DRAFTER_PEER)
        except (RayError, WorkerDiedError) as err:
            logger.warning("replacement drafter failed to start (%s)", err)
            self._kill(actors, pg)
            self.starting, self.lost_at = None, time.monotonic()
            return False
        self.actors, self.pg, self.channel, self.starting = actors, pg, channel, None
        logger.info("drafter actor replaced: speculation resumes")
        return True

