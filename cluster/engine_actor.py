"""The central scheduler as one Ray actor: a supervisor that runs the engine loop and owns the target's worker
actors and the drafter actors (they are created from inside it, so killing it tears the whole tree down).

Callers reach it concurrently: ``generate`` streams one request's outputs; ``run_batch`` runs many and streams
each final output as it finishes (what :class:`specray.LLM` uses with ``distributed_executor_backend="ray"``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

from specray.engine.async_engine import AsyncLLMEngine
from specray.cluster.ray_env import ensure_ray, ray
from specray.cluster import placement as placement_groups
from specray.cluster.ngram_pool import POOL_NAMESPACE, get_pool_actor, pool_actor_name
from specray.cluster.remote_errors import raise_remote
from specray.config import EngineArgs
from specray.drafters.registry import uses_public_pool
from specray.engine.builder import build_engine
from specray.outputs import RequestOutput, SpecStats
from specray.sampling_params import SamplingParams
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 60.0  # the engine finishing its step and releasing its actors; then it is killed regardless


class EngineActor:
    def __init__(self) -> None:
        self.aengine: AsyncLLMEngine | None = None

    async def start(self, args: EngineArgs) -> dict:
        """Build the engine (workers, drafter); a bad argument raises ValueError to the caller."""
        engine = await asyncio.to_thread(build_engine, args)
        self.aengine = AsyncLLMEngine(engine)
        return await self.describe()

    async def describe(self) -> dict:
        def read(engine):
            return {"vocab_size": engine.vocab_size, "max_model_len": engine.max_model_len,
                    "num_kv_blocks": engine.scheduler.block_manager.num_blocks,
                    "num_free_blocks": engine.scheduler.block_manager.num_free_blocks,
                    "num_unfinished": len(engine.tracked)}

        return await self.aengine.call(read)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                       req_id: str | None = None, multimodal=None):
        async for out in self.aengine.generate(prompt_token_ids, params, prompt, req_id, multimodal):
            yield out

    async def run_batch(self, requests: list[tuple]):
        """Yields ``(index, final RequestOutput or the exception that failed it)`` as each request finishes."""
        done: asyncio.Queue = asyncio.Queue()

        async def one(i: int, ids, params, prompt, multimodal) -> None:
            final = None
            try:
                async for final in self.aengine.generate(ids, params, prompt, multimodal=multimodal):
                    pass
            except Exception as err:  # handed back to the caller, which raises it
                final = err
            done.put_nowait((i, final))

        tasks = [asyncio.create_task(one(i, *r)) for i, r in enumerate(requests)]
        try:
            for _ in tasks:
                yield await done.get()
        finally:
            for t in tasks:
                t.cancel()

    async def abort(self, req_id: str) -> None:
        await self.aengine.abort(req_id)

    async def spec_stats(self) -> SpecStats:
        return await self.aengine.call(lambda engine: engine.spec_stats)

    async def drafter_stats(self) -> dict | None:
        """The drafter's own statistics (a drafter actor's come back as plain data), when it keeps them."""

        def read(engine):
            stats = getattr(engine.drafter, "stats", None)
            return stats() if callable(stats) else None

        return await self.aengine.call(read)

    async def reset_prefix_cache(self) -> bool:
        return await self.aengine.call(lambda engine: engine.reset_prefix_cache())

    async def call(self, fn):
        """Run ``fn(engine)`` in the engine thread (tests and debugging)."""
        return await self.aengine.call(fn)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def shutdown(self) -> None:
        """Stop the loop, then release what the engine holds: the target's ranks and the drafter's actors and
        their placement groups (a group created here would outlive this actor: it lives as long as the job)."""
        if self.aengine is None:
            return
        aengine, self.aengine = self.aengine, None
        await asyncio.to_thread(aengine.shutdown)
        engine = aengine.engine
        for part in (engine.drafter, engine.executor):
            if part is not None and hasattr(part, "shutdown"):
                await asyncio.to_thread(part.shutdown)


class RayEngineClient:
    """The driver's handle on an :class:`EngineActor`, with what :class:`specray.LLM` needs. ``shutdown`` (or
    losing the last reference: :class:`specray.LLM` calls it on garbage collection) releases every actor and
    placement group the engine created."""

    def __init__(self, args: EngineArgs):
        ensure_ray(args.ray_placement.address)
        self.pool = claim_pool(args)
        self.actor = ray.remote(EngineActor).options(
            num_cpus=args.ray_placement.engine_num_cpus, max_restarts=0).remote()
        try:
            info = ray.get(self.actor.start.remote(args))
        except RayTaskError as err:
            self.shutdown()
            raise_remote(err)
        self.vocab_size = info["vocab_size"]
        self.max_model_len = info["max_model_len"]

    @property
    def spec_stats(self) -> SpecStats:
        return ray.get(self.actor.spec_stats.remote())

    def drafter_stats(self) -> dict | None:
        return ray.get(self.actor.drafter_stats.remote())

    def reset_prefix_cache(self) -> bool:
        return ray.get(self.actor.reset_prefix_cache.remote())

    def describe(self) -> dict:
        return ray.get(self.actor.describe.remote())

    def run_batch(self, requests: list[tuple]) -> Iterator[tuple[int, RequestOutput]]:
        """Each request's final output as it finishes; a call that ends early (a request's error, Ctrl-C, a caller
        that stops reading) cancels the batch on the actor, which aborts the requests still in flight."""
        batch = self.actor.run_batch.remote(requests)
        left = len(requests)
        try:
            for ref in batch:
                i, out = ray.get(ref)
                left -= 1
                if isinstance(out, BaseException):
                    raise out
                yield i, out
        finally:
            if left and ray.is_initialized():
                ray.cancel(batch)

    def shutdown(self) -> None:
        """Ask the engine actor to release its workers, drafters and placement groups, kill it, and remove any
        group it left behind (it may be dead or stuck). Idempotent; a no-op once Ray itself is shut down."""
        actor, self.actor = self.actor, None
        if actor is None or not ray.is_initialized():
            return
        owner = actor._actor_id.hex()
        try:
            ray.get(actor.shutdown.remote(), timeout=SHUTDOWN_TIMEOUT_S)
        except (RayError, GetTimeoutError) as err:
            logger.warning("engine actor did not shut down cleanly (%s): killing it", err)
        ray.kill(actor)
        placement_groups.remove_owned(owner)
        pool, self.pool = self.pool, None
        if pool is not None:
            ray.kill(pool)


def claim_pool(args: EngineArgs):
    """The shared drafter pool's actor (``ray_placement.pool_name``) when this engine creates it: the engine's
    :meth:`RayEngineClient.shutdown` removes it (detached, it would outlive the job). None when the engine uses no
    pool, or joins one that runs already (a server's, another job's: theirs to remove)."""
    spec, name = args.speculative_config, args.ray_placement.pool_name
    if spec is None or name is None or not uses_public_pool(spec):
        return None
    try:
        ray.get_actor(pool_actor_name(name, spec.method), namespace=POOL_NAMESPACE)
        return None
    except ValueError:  # none yet
        return get_pool_actor(name, spec.method)
