"""Server metrics: requests, latency, queue, KV blocks and speculation.

Every metric is kept twice: in a private ``prometheus_client`` registry that the app renders at ``/metrics``
(works with or without Ray), and, inside a Ray Serve replica, in ``ray.util.metrics`` (exported by Ray's
metrics agent on its own port and aggregated over replicas). Ray is imported only when asked for.

Acceptance rate = accepted_tokens / draft_tokens and mean accepted length = 1 + accepted_tokens / drafts are
derived from the counters (and also exported as gauges for convenience).

The metrics fall into two groups: ``request`` metrics, recorded where HTTP requests are served, and ``engine``
metrics (scheduler/KV gauges, speculation counters), recorded where the engine steps. In one process a
:class:`ServerMetrics` holds both; on Ray Serve the ingress holds the first and the engine replica the second,
and ``/metrics`` renders the two registries one after the other (no metric is in both, so the text stays valid).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


def engine_state(engine) -> dict:
    """Scheduler and KV-cache occupancy; call it in the engine thread (``AsyncLLMEngine.call``)."""
    scheduler = engine.scheduler
    blocks = scheduler.block_manager
    return {
        "free_blocks": blocks.num_free_blocks,
        "total_blocks": blocks.num_blocks,
        "used_blocks": blocks.num_blocks - blocks.num_free_blocks,
        "cached_blocks": blocks.num_cached_blocks,  # prefix caching: registered blocks, held by tables or not
        "num_waiting": scheduler.num_waiting,
        "num_running": scheduler.num_running,
        "prefix_cache_queries": scheduler.prefix_cache_queries,  # totals since the engine started
        "prefix_cache_hits": scheduler.prefix_cache_hits,
        "drafting_failures": engine.drafting_failures,
        "lora_requests": _lora_requests(scheduler),
    }


def _lora_requests(scheduler) -> dict[str, dict[str, int]]:
    """Per LoRA adapter (by name), its requests running and waiting; {} for an engine without adapters."""
    if not scheduler.config.max_loras:
        return {}
    out: dict[str, dict[str, int]] = {}
    for state, requests in (("running", scheduler.running), ("waiting", scheduler.waiting)):
        for req in requests:
            lora = req.sampling_params.lora_request
            if lora is not None:
                counts = out.setdefault(lora.lora_name, {"running": 0, "waiting": 0})
                counts[state] += 1
    return out


class _Metric:
    """One metric in our registry and, optionally, its twin in Ray's."""

    _PROM = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
    _METHOD = {"counter": "inc", "gauge": "set", "histogram": "observe"}

    def __init__(self, kind: str, name: str, doc: str, labels: tuple[str, ...], registry: CollectorRegistry,
                 use_ray: bool, buckets: tuple[float, ...] | None = None):
        extra = {"buckets": buckets} if buckets else {}
        self.kind = kind
        self.labels = labels
        self.prom = self._PROM[kind](name, doc, labels, registry=registry, **extra)
        self.ray = _ray_metric(kind, name, doc, labels, buckets) if use_ray else None

    def remove(self, labels: dict[str, str]) -> None:
        """Drop one series from our registry (Ray's metrics keep theirs: a gauge there is left at 0)."""
        self.prom.remove(*(labels[name] for name in self.labels))
        if self.ray is not None and self.kind == "gauge":
            self.ray.set(0, tags=labels)

    def record(self, value: float, labels: dict[str, str]) -> None:
        if self.kind == "counter" and value <= 0:
            return  # Ray's counters reject 0; nothing to add anyway
        method = self._METHOD[self.kind]
        getattr(self.prom.labels(**labels), method)(value)
        if self.ray is not None:
            getattr(self.ray, method)(value, tags=labels)


def _ray_metric(kind: str, name: str, doc: str, labels: tuple[str, ...], buckets):
    from ray.util import metrics as ray_metrics

    if kind == "histogram":
        return ray_metrics.Histogram(name, doc, boundaries=list(buckets), tag_keys=labels)
    cls = ray_metrics.Counter if kind == "counter" else ray_metrics.Gauge
    return cls(name, doc, tag_keys=labels)


REQUEST_METRICS = "request"
ENGINE_METRICS = "engine"
ALL_METRICS = frozenset({REQUEST_METRICS, ENGINE_METRICS})

_DEFINITIONS = [
    # attribute, kind, name, doc, extra labels, buckets (the group: see _ENGINE_ATTRS)
    ("requests", "counter", "specray_requests", "HTTP generation requests by outcome (HTTP status, or "
     "'cancelled' for a client that went away)", ("status",), None),
    ("ttft", "histogram", "specray_time_to_first_token_seconds", "Time from arrival to the first output token",
     (), LATENCY_BUCKETS),
    ("tpot", "histogram", "specray_time_per_output_token_seconds", "Time per output token after the first",
     (), TOKEN_LATENCY_BUCKETS),
    ("e2e", "histogram", "specray_e2e_request_latency_seconds", "Time from arrival to the last token", (),
     LATENCY_BUCKETS),
    ("prompt_tokens", "counter", "specray_prompt_tokens", "Prompt tokens of finished choices", (), None),
    ("generation_tokens", "counter", "specray_generation_tokens", "Generated tokens of finished choices", (),
     None),
    ("prediction_tokens", "counter", "specray_prediction_tokens", "Predicted Outputs: prediction tokens drafted "
     "for finished choices, by outcome (accepted by the target, or rejected)", ("outcome",), None),
    ("waiting", "gauge", "specray_num_requests_waiting", "Engine requests waiting to be scheduled", (), None),
    ("running", "gauge", "specray_num_requests_running", "Engine requests running", (), None),
    ("kv_used", "gauge", "specray_kv_blocks_used", "KV-cache blocks in use", (), None),
    ("kv_total", "gauge", "specray_kv_blocks_total", "KV-cache blocks in the pool", (), None),
    ("lora_requests", "gauge", "specray_lora_requests", "Engine requests of each LoRA adapter, running or waiting "
     "(an adapter whose requests are all done reads 0)", ("adapter", "state"), None),
    ("prefix_queries", "counter", "specray_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
     (), None),
    ("prefix_hits", "counter", "specray_prefix_cache_hits", "Prompt tokens found in the prefix cache", (), None),
    ("drafting_failures", "counter", "specray_spec_drafting_failures", "Requests the drafter failed on (they get "
     "no drafts of it from then on; a hidden-state head's: none of the head's)", (), None),
    ("drafts", "counter", "specray_spec_drafts", "Verifications of >= 1 draft token (one request, one step)",
     (), None),
    ("draft_tokens", "counter", "specray_spec_draft_tokens", "Draft tokens proposed and verified", (), None),
    ("accepted", "counter", "specray_spec_accepted_tokens", "Draft tokens accepted", (), None),
    ("accepted_per_position", "counter", "specray_spec_accepted_tokens_per_position",
     "Drafts whose i-th draft token (0-based position) was accepted", ("position",), None),
    ("acceptance_rate", "gauge", "specray_spec_acceptance_rate", "accepted_tokens / draft_tokens", (), None),
    ("mean_accepted_length", "gauge", "specray_spec_mean_accepted_length",
     "1 + accepted_tokens / drafts: tokens kept per verification", (), None),
]
_ENGINE_ATTRS = frozenset({"waiting", "running", "kv_used", "kv_total", "lora_requests", "prefix_queries",
                           "prefix_hits", "drafting_failures", "drafts", "draft_tokens", "accepted",
                           "accepted_per_position", "acceptance_rate", "mean_accepted_length"})


def _group(attr: str) -> str:
    return ENGINE_METRICS if attr in _ENGINE_ATTRS else REQUEST_METRICS


class ServerMetrics:
    """The metrics of one server (one replica). ``record_step`` runs in the engine thread, the rest in the
    event loop; prometheus_client is thread-safe and the speculation totals are guarded by a lock."""

    content_type = CONTENT_TYPE_LATEST  # of :meth:`render`

    def __init__(self, model_name: str, use_ray: bool = False, groups: frozenset[str] = ALL_METRICS,
                 replica: str | None = None):
        """``replica``: the Serve replica's id, a label on every series, so that with several replicas (each
        ``/metrics`` scrape answered by one of them) every series stays one replica's, never a counter that seems
        to reset as scrapes alternate."""
        self.registry = CollectorRegistry()
        self._labels = {"model": model_name} | ({"replica": replica} if replica is not None else {})
        self.groups = groups
        for attr, kind, name, doc, labels, buckets in _DEFINITIONS:
            if _group(attr) not in groups:
                continue
            setattr(self, attr, _Metric(kind, name, doc, (*self._labels, *labels), self.registry, use_ray, buckets))
        self._lock = threading.Lock()
        self._seen = (0, 0, 0, [])  # engine.spec_stats already counted: drafts, draft tokens, accepted, per pos
        self._seen_totals = (0, 0, 0)  # engine totals already counted: prefix queries, hits, drafting failures
        self._adapters: set[str] = set()  # LoRA adapters with a gauge (set to 0 once they have no request)

    @property
    def has_engine_metrics(self) -> bool:
        return ENGINE_METRICS in self.groups

    # ---- event loop ------------------------------------------------------------------------------------
    def record_request(self, status: str) -> None:
        self.requests.record(1, {**self._labels, "status": status})

    def record_choice(self, ttft: float, e2e: float, prompt_tokens: int, completion_tokens: int) -> None:
        """One finished engine request (one choice)."""
        self.ttft.record(ttft, self._labels)
        self.e2e.record(e2e, self._labels)
        if completion_tokens > 1:
            self.tpot.record((e2e - ttft) / (completion_tokens - 1), self._labels)
        self.prompt_tokens.record(prompt_tokens, self._labels)
        self.generation_tokens.record(completion_tokens, self._labels)

    def record_prediction(self, accepted: int, rejected: int) -> None:
        """One finished choice that drafted from its prediction (OpenAI's Predicted Outputs)."""
        self.prediction_tokens.record(accepted, {**self._labels, "outcome": "accepted"})
        self.prediction_tokens.record(rejected, {**self._labels, "outcome": "rejected"})

    def record_engine_state(self, state: dict, unloaded: set[str] = frozenset()) -> None:
        """Gauges from :func:`engine_state`. An adapter's series read 0 once it has no request, and are dropped
        once it has none and is among ``unloaded`` (adapters unloaded at runtime: their series would linger)."""
        for metric, key in ((self.waiting, "num_waiting"), (self.running, "num_running"),
                            (self.kv_used, "used_blocks"), (self.kv_total, "total_blocks")):
            metric.record(state[key], self._labels)
        lora = state.get("lora_requests", {})
        with self._lock:
            for name in self._adapters | set(lora):
                for which in ("running", "waiting"):
                    labels = {**self._labels, "adapter": name, "state": which}
                    if name in unloaded and name not in lora:
                        self.lora_requests.remove(labels)
                    else:
                        self.lora_requests.record(lora.get(name, {}).get(which, 0), labels)
            self._adapters = (self._adapters | set(lora)) - (set(unloaded) - set(lora))
            # counters: the growth of the engine's totals (a restarted engine starts again from 0)
            totals = tuple(state.get(key, 0) for key in ("prefix_cache_queries", "prefix_cache_hits",
                                                         "drafting_failures"))
            seen = self._seen_totals if all(t >= p for t, p in zip(totals, self._seen_totals)) else (0, 0, 0)
            for metric, total, before in zip((self.prefix_queries, self.prefix_hits, self.drafting_failures), totals,
                                             seen):
                metric.record(total - before, self._labels)
            self._seen_totals = totals

    def render(self) -> bytes:
        """Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    # ---- engine thread ---------------------------------------------------------------------------------
    def record_step(self, engine: Any, outputs: list | None = None) -> None:
        """``AsyncLLMEngine``'s ``on_step`` hook: speculation counters (the growth of ``engine.spec_stats``
        since the last call) and the scheduler/KV gauges."""
        try:
            self._record_speculation(engine.spec_stats)
            self.record_engine_state(engine_state(engine))
        except Exception:  # metrics must never break the engine loop
            logger.exception("recording step metrics failed")

    def _record_speculation(self, stats) -> None:
        with self._lock:
            drafts, draft_tokens, accepted, per_pos = self._seen
            labels = self._labels
            self.drafts.record(stats.drafts - drafts, labels)
            self.draft_tokens.record(stats.draft_tokens - draft_tokens, labels)
            self.accepted.record(stats.accepted_tokens - accepted, labels)
            for pos, count in enumerate(stats.accepted_per_position):
                seen = per_pos[pos] if pos < len(per_pos) else 0
                self.accepted_per_position.record(count - seen, {**labels, "position": str(pos)})
            self._seen = (stats.drafts, stats.draft_tokens, stats.accepted_tokens,
                          list(stats.accepted_per_position))
            if stats.draft_tokens:
                self.acceptance_rate.record(stats.acceptance_rate, labels)
                self.mean_accepted_length.record(stats.mean_accepted_length, labels)
