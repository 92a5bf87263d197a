"""User-facing configuration: :class:`SpeculativeConfig`. Torch-free."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class SpeculativeConfig:
    """How to speculate. Keys follow vLLM (``method``, ``num_speculative_tokens``, ``model``,
    ``prompt_lookup_min``/``prompt_lookup_max``) and TensorRT-LLM's n-gram pool (``max_draft_len``,
    ``max_matching_ngram_size``, ``is_public_pool``, ``is_keep_all``, ``is_use_oldest``), as aliases.

    ``num_speculative_tokens`` is the most drafts per step; with ``adaptive=True`` (default) the engine drafts
    fewer, or none, per request when the measured cost of a verification pass and the request's recent
    acceptance say more would not pay.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 5
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    is_public_pool: bool = False
    is_keep_all: bool = True
    is_use_oldest: bool = True
    max_pool_entries: int | None = None  # cap on a public n-gram pool (oldest entries evicted first)
    draft_tensor_parallel_size: int = 1
    adaptive: bool = True
    # TensorRT-LLM spellings; when given they override the vLLM ones.
    max_draft_len: int | None = None
    max_matching_ngram_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_draft_len is not None:
            self.num_speculative_tokens = self.max_draft_len
        if self.max_matching_ngram_size is not None:
            self.prompt_lookup_max = self.max_matching_ngram_size
            self.prompt_lookup_min = min(self.prompt_lookup_min, self.prompt_lookup_max)
        self.max_draft_len = self.num_speculative_tokens
        self.max_matching_ngram_size = self.prompt_lookup_max
        self._validate()

    def _validate(self) -> None:
        # the method itself is checked by the drafter registry (above this module) when the engine is built
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={self.num_speculative_tokens!r} must be an int >= 1"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} and prompt_lookup_max="
                f"{self.prompt_lookup_max} must satisfy 1 <= min <= max"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model is required for method='draft_model': a path to a "
                             "smaller model with the target's tokenizer")
        if not isinstance(self.draft_tensor_parallel_size, int) or self.draft_tensor_parallel_size < 1:
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={self.draft_tensor_parallel_size!r} "
                             "must be an int >= 1")
        if self.draft_tensor_parallel_size > 1 and self.method != "draft_model":
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={self.draft_tensor_parallel_size} "
                             f"applies to method='draft_model' only ({self.method!r} has no weights to split); use 1")

    @classmethod
    def from_any(cls, value: "SpeculativeConfig | dict[str, Any] | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a SpeculativeConfig or a dict, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known keys: {sorted(known)}")
        return cls(**value)


PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


@dataclass
class RayPlacement:
    """Where the Ray backend puts its actors. The target's TP ranks share one placement group (one bundle per
    rank, ``strategy`` over nodes); drafter actors are placed on their own, anywhere they fit."""

    # PACK: one node when the ranks fit on one, else several; STRICT_PACK: one node; STRICT_SPREAD: a node each
    strategy: str = "PACK"
    worker_num_cpus: float = 1.0  # per TP rank (fractions are fine; never more than a node has)
    worker_num_gpus: float | None = None  # None: 1 per rank when the cluster has GPUs, else 0
    worker_resources: list[dict[str, float]] | None = None  # extra custom resources, one dict per rank
    drafter_num_cpus: float = 0.5
    drafter_num_gpus: float = 0.0
    drafter_resources: dict[str, float] | None = None  # e.g. {"drafter_node": 0.1} to pin the drafter
    engine_num_cpus: float = 0.1  # the supervisor actor that runs the engine loop
    address: str | None = None  # the Ray cluster to join; None: the running one, else start a local one
    pool_name: str | None = None  # a named shared n-gram pool actor (is_public_pool): replicas share it
    # draft step t+1 while the target verifies step t (assuming step t's drafts are kept): pays when the drafter
    # has hardware of its own; on a small CPU node the two only fight for cores (docs/benchmarks.md)
    draft_ahead: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"ray_placement.strategy={self.strategy!r} is unknown; choose one of "
                             f"{list(PLACEMENT_STRATEGIES)}")
        for name in ("worker_num_cpus", "drafter_num_cpus", "drafter_num_gpus", "engine_num_cpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"ray_placement.{name}={getattr(self, name)} must be >= 0")
        if self.worker_num_gpus is not None and self.worker_num_gpus < 0:
            raise ValueError(f"ray_placement.worker_num_gpus={self.worker_num_gpus} must be >= 0 "
                             "(or None: 1 per rank when the cluster has GPUs)")

    @classmethod
    def from_any(cls, value: "RayPlacement | dict[str, Any] | None") -> "RayPlacement":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"ray_placement has unknown keys {unknown}; known keys: {sorted(known)}")
        return cls(**value)


EXECUTOR_BACKENDS = (None, "uni", "ray")


@dataclass
class EngineArgs:
    """The arguments of :class:`specray.LLM` (vLLM's names). Only ``specray.engine.build_engine`` reads this;
    every component gets its own small config from it."""

    model: str
    tokenizer: str | None = None
    speculative_config: SpeculativeConfig | dict | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None
    dtype: str = "auto"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides the size computed from kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None  # default: 1 GiB on CPU, 80% of free memory on a GPU
    device: str | None = None  # default: cuda when available, else cpu
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: "uni" (this process) at TP=1, else "ray"
    ray_placement: RayPlacement | dict | None = None
    num_threads: int | None = None  # torch CPU threads per target rank (None: torch's default)

    _DTYPES = ("auto", "float32", "float16", "bfloat16")

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "ray" if self.tensor_parallel_size > 1 else "uni"

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)
        self.ray_placement = RayPlacement.from_any(self.ray_placement)
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r} is unknown; "
                             f"choose one of {list(EXECUTOR_BACKENDS)}")
        if self.tensor_parallel_size > 1 and self.distributed_executor_backend == "uni":
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} needs several processes: use "
                             "distributed_executor_backend='ray' (or leave it None)")
        if not self.model:
            raise ValueError("model is required: a local HF folder, a .gguf file, or a hub id")
        spec = self.speculative_config
        if spec is not None and spec.draft_tensor_parallel_size > 1 and self.executor_backend != "ray":
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={spec.draft_tensor_parallel_size} "
                             "needs the Ray backend (its ranks are actors): set distributed_executor_backend='ray'")
        if self.dtype not in self._DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; choose one of {list(self._DTYPES)}")
        for name in ("max_num_seqs", "block_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1 (or None for the default)")
