"""Executors run step plans on the target's ranks. The engine sees one interface::

    executor.num_kv_blocks            # blocks every rank allocated (the scheduler's pool)
    executor.info                     # rank 0's KVCacheInfo (dtype, device, vocab_size)
    executor.execute(plan, draft_probs) -> StepResult     # raises WorkerDiedError when a rank is lost
    executor.execute_async(plan, draft_probs) -> future   # optional: the step runs while the caller goes on;
                                                          # future.result() is execute's answer (or raise)
    executor.restart()                # a fresh group (after a failure); every request is gone
    executor.collective_rpc(fn, *args) -> list             # fn(worker, *args) on every rank
    executor.shutdown()

``uni`` runs one rank in this process (registered here); other backends (``ray``: one Ray actor per TP rank)
register through :mod:`specray.engine.plugins`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from specray.contract import KVCacheInfo, StepPlan, StepResult
from specray.engine import plugins
from specray.workers.worker import Worker, WorkerConfig


@dataclass
class CacheConfig:
    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_kv_blocks: int | None = None  # overrides the size computed from the ranks' memory budgets


def plan_num_blocks(infos: list[KVCacheInfo], cache: CacheConfig) -> int:
    """Enough blocks for every seat at full length, capped by the tightest rank's KV memory budget (a model with no
    paged layer, Mamba-2's, pays nothing per block: its blocks are the scheduler's bookkeeping alone)."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    wanted = cache.max_num_seqs * (-(-cache.max_model_len // cache.block_size) + 1)
    fits = min(info.budget_bytes // info.bytes_per_block if info.bytes_per_block else wanted for info in infos)
    if fits < 1:
        worst = min(infos, key=lambda i: i.budget_bytes // i.bytes_per_block)
        raise ValueError(f"kv_cache_memory_bytes={worst.budget_bytes} holds no KV block of "
                         f"{worst.bytes_per_block} bytes; raise it")
    return min(wanted, fits)


def executor_class(backend: str):
    return plugins.lookup("executor", backend)


class LocalExecutor:
    """One rank (tensor_parallel_size=1) in this process."""

    def __init__(self, config: WorkerConfig, tp_size: int, cache: CacheConfig, placement=None):
        if tp_size != 1 or config.pipeline_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={tp_size} x pipeline_parallel_size="
                             f"{config.pipeline_parallel_size} ranks need distributed_executor_backend='ray'")
        self.config, self.cache = config, cache
        self._thread: ThreadPoolExecutor | None = None  # runs execute_async's steps, made on first use
        self._start()

    def _start(self) -> None:
        self.worker = Worker(self.config)
        self.info = self.worker.kv_cache_info()
        self.num_kv_blocks = plan_num_blocks([self.info], self.cache)
        self.worker.init_cache(self.num_kv_blocks)

    def execute(self, plan: StepPlan, draft_probs: dict | None = None) -> StepResult:
        return self.worker.execute(plan, draft_probs)

    def execute_async(self, plan: StepPlan, draft_probs: dict | None = None) -> Future:
        """Run the step in this executor's one step thread (bound as the worker's constructing thread is) and
        return at once: the caller's host work overlaps the step where the step leaves the GIL (a GPU's kernels
        and its one sync; a CPU's torch ops). Steps never run concurrently: the engine waits for each result
        before it starts the next."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="specray-step", initializer=self.worker.bind_thread)
        return self._thread.submit(self.worker.execute, plan, draft_probs)

    def collective_rpc(self, fn: Callable[..., Any], *args) -> list:
        """``fn(worker, *args)`` on every rank (here the one), in rank order: for inspection and tests."""
        return [fn(self.worker, *args)]

    def restart(self) -> None:
        self._stop_thread()
        self._start()

    def shutdown(self) -> None:
        self._stop_thread()
        self.worker.shutdown()

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None


plugins.register("executor", "uni", LocalExecutor)
