"""Drafters as Ray actors, placed apart from the target (another node, or CPU only).

:class:`RemoteDrafter` is the engine's :class:`Drafter`: it sends each request's new tokens only (the actor
keeps every history), gets the proposals back, and when the actor is lost it drafts nothing (the engine then
decodes without speculation: slower, never wrong) while a replacement starts in the background.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import replace

from specray.cluster.ngram_pool import RayPoolLink, get_pool_actor
from specray.cluster.ray_env import ray
from specray.config import RayPlacement, SpeculativeConfig
from specray.drafters.base import DraftRequest, DrafterContext, Proposal
from specray.drafters.registry import drafter_class
from ray.exceptions import GetTimeoutError, RayError

logger = logging.getLogger(__name__)

DRAFT_TIMEOUT_S = 60.0  # a drafter slower than this is treated as lost
RESPAWN_BACKOFF_S = 5.0


class DrafterWorker:
    """The actor: one drafter and the token history of every request it drafts for."""

    def __init__(self, spec: SpeculativeConfig, ctx: DrafterContext, tokenizer_source: str,
                 pool_name: str | None = None):
        if ctx.target_tokenizer is None and spec.method == "draft_model":
            from specray.models.loader import load_tokenizer

            ctx = replace(ctx, target_tokenizer=load_tokenizer(tokenizer_source))
        self.drafter = drafter_class(spec.method)(spec, ctx)
        self.histories: dict[str, list[int]] = {}
        if pool_name is not None and spec.is_public_pool:
            link = RayPoolLink(get_pool_actor(pool_name), uuid.uuid4().hex)
            self.drafter.attach_pool_link(link)

    def propose(self, updates: list[tuple]) -> list[Proposal]:
        """``updates``: (req_id, start, token_ids[start:], max_draft_tokens, sampling_params) per request."""
        batch = []
        for req_id, start, tokens, max_draft, params in updates:
            history = self.histories.setdefault(req_id, [])
            del history[start:]
            history.extend(tokens)
            batch.append(DraftRequest(req_id, history, max_draft, params))
        return self.drafter.propose(batch)

    def finish(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            self.histories.pop(rid, None)
        self.drafter.finish(req_ids)

    def sync_pool(self) -> None:
        """Finish an exchange with the shared pool now (tests; normally it happens with every proposal)."""
        if getattr(self.drafter, "pool_link", None) is not None:
            self.drafter.sync_pool(wait=True)
            self.drafter.sync_pool(wait=True)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class RemoteDrafter:
    def __init__(self, spec: SpeculativeConfig, ctx: DrafterContext, placement: RayPlacement | None,
                 tokenizer_source: str):
        self.spec = spec
        self.placement = placement or RayPlacement()
        device = "cuda" if self.placement.drafter_num_gpus else "cpu"
        self.ctx = replace(ctx, target_tokenizer=None, device=device)
        self.tokenizer_source = tokenizer_source
        self.sent: dict[str, int] = {}  # req_id -> tokens of its history the actor has
        self.actor = self._spawn()
        try:
            ray.get(self.actor.node_id.remote())  # surfaces a user error (wrong vocabulary...) at start
        except RayError as err:
            ray.kill(self.actor)
            if isinstance(getattr(err, "cause", None), ValueError):
                raise ValueError(str(err.cause)) from None
            raise
        self.starting = None  # a replacement actor being brought up after a failure
        self.lost_at = 0.0

    def _spawn(self):
        options = dict(num_cpus=self.placement.drafter_num_cpus, num_gpus=self.placement.drafter_num_gpus,
                       max_restarts=0)
        if self.placement.drafter_resources:
            options["resources"] = dict(self.placement.drafter_resources)
        return ray.remote(DrafterWorker).options(**options).remote(
            self.spec, self.ctx, self.tokenizer_source, self.placement.pool_name)

    # ---- the Drafter protocol ------------------------------------------------------------------------------
    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        if self.actor is None and not self._replaced():
            return [Proposal([]) for _ in batch]
        updates = []
        for r in batch:
            start = min(self.sent.get(r.req_id, 0), len(r.token_ids))
            updates.append((r.req_id, start, list(r.token_ids[start:]), r.max_draft_tokens, r.sampling_params))
        try:
            proposals = ray.get(self.actor.propose.remote(updates), timeout=DRAFT_TIMEOUT_S)
        except (RayError, GetTimeoutError) as err:
            self._lost(err)
            return [Proposal([]) for _ in batch]
        for r in batch:
            self.sent[r.req_id] = len(r.token_ids)
        return proposals

    def finish(self, req_ids) -> None:
        req_ids = [r for r in req_ids if self.sent.pop(r, None) is not None]
        if req_ids and self.actor is not None:
            self.actor.finish.remote(req_ids)  # no wait: nothing depends on it

    def shutdown(self) -> None:
        for actor in (self.actor, self.starting):
            if actor is not None:
                ray.kill(actor)

    # ---- failure -------------------------------------------------------------------------------------------
    def _lost(self, err: BaseException) -> None:
        logger.warning("drafter actor lost (%s): decoding without speculation until a new one is up", err)
        ray.kill(self.actor)
        self.actor, self.sent, self.lost_at = None, {}, time.monotonic()

    def _replaced(self) -> bool:
        """Start a replacement (after a back-off) and switch to it once it answers; never blocks."""
        if self.starting is None:
            if time.monotonic() - self.lost_at < RESPAWN_BACKOFF_S:
                return False
            self.starting, self.ready_ref = self._spawn(), None
            self.ready_ref = self.starting.node_id.remote()
        ready, _ = ray.wait([self.ready_ref], timeout=0)
        if not ready:
            return False
        try:
            ray.get(self.ready_ref)
        except RayError as err:
            logger.warning("replacement drafter failed to start (%s)", err)
            self.starting, self.lost_at = None, time.monotonic()
            return False
        self.actor, self.starting = self.starting, None
        logger.info("drafter actor replaced: speculation resumes")
        return True
