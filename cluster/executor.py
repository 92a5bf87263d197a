"""The Ray executor: one actor per rank of the target (``tensor_parallel_size`` ranks per pipeline stage), in one
placement group.

Ray places, starts and kills the ranks and carries their control calls; steps travel on the step channel
(:mod:`specray.cluster.step_channel`: the plan pickled once, the same bytes written to every rank's socket), since a
Ray call costs more than a small model's decode step. Only the driver (the last stage's first rank, which verifies
and samples) gets the drafter's probabilities and answers with the result. A rank that dies is noticed at once,
without waiting for the others (which may be stuck in a collective with it): the whole group is failed with
:class:`WorkerDiedError` and ``restart`` builds a fresh one in the background (the next step waits for it). A step
that raised on live ranks (a bug, a bad input) is a :class:`StepError`: the group is kept.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from specray.cluster.ray_env import ensure_ray, ray
from specray.cluster.step_channel import StepClient, StepServer
from specray.config import RayPlacement
from specray.contract import KVCacheInfo, StepPlan, StepResult
from specray.cluster import placement as placement_groups
from specray.cluster.placement import SETUP_TIMEOUT_S, rendezvous_address
from specray.cluster.remote_errors import raise_remote
from specray.errors import StepError, WorkerDiedError, log_error_detail
from specray.engine.executor import CacheConfig, plan_num_blocks
from specray.workers.worker import Worker, WorkerConfig
from ray.exceptions import GetTimeoutError, RayError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)

STEP_TIMEOUT_S = 600.0  # no step takes this long; a rank that does is treated as lost


def grouped_by_node(items: list, nodes: list[str]) -> list:
    """``items`` reordered so that those on one node (``nodes[i]`` is item i's) are consecutive, nodes in the order
    they first appear and items in their own order within a node."""
    first = {}
    for node in nodes:
        first.setdefault(node, len(first))
    return [items[i] for i in sorted(range(len(items)), key=lambda i: (first[nodes[i]], i))]


class TargetWorker:
    """The actor around one :class:`Worker`. Created empty so the group can agree on a rendezvous address
    before any rank blocks in ``init_process_group``."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.lock = threading.Lock()  # steps come on the channel's thread, other calls on the actor's

    def rendezvous(self) -> str:
        return rendezvous_address()

    def setup(self, config: WorkerConfig, rank: int, world_size: int, init_method: str) -> KVCacheInfo:
        self.worker = Worker(config, rank, world_size, init_method)
        return self.worker.kv_cache_info()

    def init_cache(self, num_blocks: int) -> None:
        self.worker.init_cache(num_blocks)

    def execute(self, plan: StepPlan, draft_probs: dict | None = None) -> StepResult | None:
        with self.lock:
            return self.worker.execute(plan, draft_probs)

    def open_step_channel(self) -> tuple[str, int, bytes]:
        """Listen for the engine's step channel; returns (host, port, token)."""
        self.step_server = StepServer(self.execute, ray.util.get_node_ip_address(), self.worker.bind_thread)
        return self.step_server.address

    def run(self, fn: Callable[..., Any], *args) -> Any:
        """``fn(worker, *args)`` on this rank's :class:`Worker`, between steps (``fn`` is pickled by the caller):
        inspection, debugging and tests without test hooks in the worker."""
        with self.lock:
            return fn(self.worker, *args)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class _ChannelStep:
    """A step the ranks are computing: ``result()`` reads their answers from the step channel."""

    def __init__(self, channel: StepClient, plan: StepPlan, what: str):
        self.channel, self.plan, self.what = channel, plan, what

    def result(self) -> StepResult:
        try:
            return self.channel.receive(STEP_TIMEOUT_S, self.what)
        except (StepError, WorkerDiedError) as err:
            log_error_detail(logger, self.plan, err)
            raise


class RayExecutor:
    def __init__(self, config: WorkerConfig, tp_size: int, cache: CacheConfig, placement: RayPlacement | None):
        self.config, self.tp_size, self.cache = config, tp_size, cache
        self.world_size = tp_size * config.pipeline_parallel_size
        self.driver = self.world_size - tp_size  # the last stage's first rank
        self.placement = placement or RayPlacement()
        ensure_ray(self.placement.address)
        self.workers: list = []
        self.pg = None
        self.channel: StepClient | None = None
        self._restarting: threading.Thread | None = None  # a fresh group coming up after a failure
        self._restart_error: BaseException | None = None
        self._start()

    # ---- the group ----------------------------------------------------------------------------------------
    def _start(self) -> None:
        self.pg = self._placement_group()
        actor_cls = ray.remote(TargetWorker)
        gpus = self._gpus_per_rank()
        self.workers = [
            actor_cls.options(
                num_cpus=self.placement.worker_num_cpus, num_gpus=gpus, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
            ).remote()
            for rank in range(self.world_size)
        ]
        if self.config.pipeline_parallel_size > 1 and not self.placement.worker_resources:
            # ranks numbered node by node, so that a stage's tensor-parallel ranks (consecutive ranks) share a node
            # wherever a node holds whole stages: its all-reduces stay on the node, only hand-offs cross nodes
            self.workers = grouped_by_node(self.workers, ray.get([w.node_id.remote() for w in self.workers]))
        config = self.config
        if gpus and config.device is None:
            config = WorkerConfig(**{**vars(config), "device": "cuda"})
        init_method = ray.get(self.workers[0].rendezvous.remote())
        setups = [w.setup.remote(config, rank, self.world_size, init_method) for rank, w in enumerate(self.workers)]
        try:
            infos = ray.get(setups, timeout=SETUP_TIMEOUT_S)
        except RayTaskError as err:  # a user error (e.g. heads not divisible by the TP size) stays a ValueError
            self._kill()
            raise_remote(err, lambda message: WorkerDiedError(f"loading the model failed: {message}"))
        except (GetTimeoutError, RayError) as err:
            self._kill()
            raise WorkerDiedError(f"loading the model failed: {err}") from err
        self.info = infos[self.driver]
        self.num_kv_blocks = plan_num_blocks(infos, self.cache)
        self._get([w.init_cache.remote(self.num_kv_blocks) for w in self.workers], SETUP_TIMEOUT_S, "KV cache")
        addresses = self._get([w.open_step_channel.remote() for w in self.workers], SETUP_TIMEOUT_S, "channel")
        self.channel = StepClient(addresses, driver=self.driver)
        logger.info("Ray executor: %d ranks (TP=%d x PP=%d, %s) up, %d KV blocks each", self.world_size, self.tp_size,
                    self.config.pipeline_parallel_size, self.placement.strategy, self.num_kv_blocks)

    def _gpus_per_rank(self) -> float:
        if self.placement.worker_num_gpus is not None:
            return self.placement.worker_num_gpus
        if self.config.device is not None:
            return 1.0 if self.config.device.startswith("cuda") else 0.0
        return 1.0 if ray.cluster_resources().get("GPU", 0) >= self.world_size else 0.0

    def _placement_group(self):
        extra = self.placement.worker_resources or [{} for _ in range(self.world_size)]
        if len(extra) != self.world_size:
            raise ValueError(f"ray_placement.worker_resources has {len(extra)} entries for {self.world_size} ranks "
                             f"(tensor_parallel_size={self.tp_size} x pipeline_parallel_size="
                             f"{self.config.pipeline_parallel_size}); give one dict per rank")
        gpus = self._gpus_per_rank()
        bundles = [{"CPU": self.placement.worker_num_cpus, **({"GPU": gpus} if gpus else {}), **e} for e in extra]
        return placement_groups.create(bundles, self.placement.strategy, "target",
                                       "lower tensor_parallel_size or pipeline_parallel_size, or "
                                       "ray_placement.worker_num_cpus/worker_num_gpus, "
                                       "or change ray_placement.strategy")

    def _kill(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
        placement_groups.remove(self.pg)
        self.pg = None

    def restart(self) -> None:
        """Kill the group now and bring up a fresh one in the background: the engine tells the failed requests at
        once and keeps the waiting ones queued; its next step waits for the new group."""
        logger.warning("restarting the target's %d ranks (in the background)", self.world_size)
        self._await_group(raise_error=False)
        self._kill()
        self._restart_error = None
        self._restarting = threading.Thread(target=self._start_in_background, name="specray-restart", daemon=True)
        self._restarting.start()

    def _start_in_background(self) -> None:
        try:
            self._start()
        except Exception as err:  # raised by the next step, which restarts again
            logger.error("restarting the target's ranks failed: %s", err)
            self._restart_error = err

    def _await_group(self, raise_error: bool = True) -> None:
        """Wait for a restart in progress; a restart that failed fails the step that waited for it."""
        if self._restarting is None:
            return
        self._restarting.join()
        self._restarting = None
        err, self._restart_error = self._restart_error, None
        if err is not None and raise_error:
            raise WorkerDiedError(f"restarting the target's {self.world_size} ranks failed: {err}") from err

    @property
    def pipeline_depth(self) -> int:
        """Steps the engine may keep in flight: one per pipeline stage (each rank answers its steps in order)."""
        return self.config.pipeline_parallel_size

    @property
    def restarting(self) -> bool:
        return self._restarting is not None and self._restarting.is_alive()

    def shutdown(self) -> None:
        self._await_group(raise_error=False)
        self._kill()

    # ---- steps --------------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan, draft_probs: dict | None = None) -> StepResult:
        """The driver's result. A rank that raised (every rank answered) raises :class:`StepError`, the group kept;
        a rank that is gone, or a group left out of step, raises :class:`WorkerDiedError`. Either way the plan
        and the remote traceback are logged first."""
        return self.execute_async(plan, draft_probs).result()

    def execute_async(self, plan: StepPlan, draft_probs: dict | None = None) -> "_ChannelStep":
        """Send the plan to every rank and return at once; ``result()`` waits for the answers (as ``execute``)."""
        # one message object, pickled once for every rank that gets it; a grammar's masks go to the driver rank
        # alone (the only one that samples)
        shared = (dataclasses.replace(plan, token_bitmasks={}) if plan.token_bitmasks else plan, None)
        messages = [shared] * self.world_size
        if draft_probs or plan.token_bitmasks:
            messages[self.driver] = (plan, draft_probs or None)
        what = f"step {plan.step_id}"
        try:
            self._await_group()
            self.channel.send(messages, what)
        except (StepError, WorkerDiedError) as err:
            log_error_detail(logger, plan, err)
            raise
        return _ChannelStep(self.channel, plan, what)

    def _get(self, refs: list, timeout: float, what: str) -> list:
        """Every result, failing fast: the first rank that errors fails the group, even while the others
        still wait on it inside a collective."""
        deadline = time.monotonic() + timeout
        pending = list(refs)
        while len(pending) > 1:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                raise WorkerDiedError(f"{what}: no answer from {len(pending)} target ranks in {timeout:.0f}s")
            self._check(ready[0], what)
        try:
            return ray.get(refs, timeout=max(deadline - time.monotonic(), 0))
        except GetTimeoutError as err:
            raise WorkerDiedError(f"{what}: no answer from a target rank in {timeout:.0f}s") from err
        except RayError as err:
            raise WorkerDiedError(f"{what}: a target rank failed: {err}") from err

    @staticmethod
    def _check(ref, what: str) -> None:
        try:
            ray.get(ref, timeout=0)
        except RayError as err:
            raise WorkerDiedError(f"{what}: a target rank failed: {err}") from err

    # ---- inspection ---------------------------------------------------------------------------------------
    def collective_rpc(self, fn: Callable[..., Any], *args) -> list:
        """``fn(worker, *args)`` on every rank, in rank order (vLLM's ``collective_rpc``); ``fn`` must be
        picklable. A function that runs a collective must run on every rank, as this does."""
        return ray.get([w.run.remote(fn, *args) for w in self.workers])
