"""Load generator for the OpenAI-compatible server (``specray bench-serve``), also usable as a library:
``benchmark(base_url=..., prompts=[...], num_requests=100, concurrency=8)`` returns a dict.

Load is either closed-loop (``concurrency`` clients, each sending its next request when the last one ends) or
open-loop (Poisson arrivals at ``request_rate`` per second, optionally capped by ``concurrency``), for
``num_requests`` requests or ``duration_s`` seconds. Streaming requests measure time to first token (TTFT) and
time per output token after it (TPOT); every request measures end-to-end latency.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

MAX_ERROR_KINDS = 10


@dataclass
class RequestResult:
    prompt_index: int
    ok: bool
    text: str = ""
    output_tokens: int = 0
    finish_reason: str | None = None
    ttft: float | None = None  # seconds; streaming only
    e2e: float = 0.0
    error: str | None = None
    # speculation, from the response's usage.speculative (a specray extension; zeros from other servers)
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    spec_reported: bool = False  # the usage had the speculative field
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (OpenAI's): prompt tokens from the cache

    def read_usage(self, usage: dict) -> None:
        self.output_tokens = usage["completion_tokens"]
        self.prompt_tokens = usage.get("prompt_tokens", 0)
        self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        spec = usage.get("speculative") or {}
        self.spec_reported = "speculative" in usage
        self.drafts = spec.get("drafts", 0)
        self.draft_tokens = spec.get("draft_tokens", 0)
        self.accepted_tokens = spec.get("accepted_tokens", 0)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class BenchConfig:
    base_url: str
    # the served model name, or several (LoRA adapters, say: request i goes to model[i % n]); None: the first listed
    model: str | list[str] | None
    prompts: list[Any]  # strings, token-id lists, or {"prompt": ...}/{"prompt_token_ids": [...]} dicts
    num_requests: int | None = 100
    duration_s: float | None = None
    concurrency: int | None = None
    request_rate: float | None = None
    max_tokens: int = 64
    stream: bool = True
    chat: bool = False
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0
    extra_body: dict | None = None
    api_key: str | None = None  # sent as "Authorization: Bearer <api_key>" (a server started with --api-key)

    def validate(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={self.base_url!r} must start with http:// or https://, e.g. "
                             "--base-url http://127.0.0.1:8000")
        self.base_url = server_root(self.base_url)
        if not self.prompts:
            raise ValueError("no prompts: give --prompt or --input (a JSONL file of {\"prompt\": ...} lines)")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give num_requests or duration_s (how much load to send)")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests={self.num_requests} must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s={self.duration_s} must be > 0 seconds")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} must be >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0 seconds")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate={self.request_rate} must be > 0 requests per second")
        if isinstance(self.model, list) and (not self.model or not all(isinstance(m, str) and m for m in self.model)):
            raise ValueError(f"model={self.model!r} must be a served model name or a non-empty list of them")
        if self.chat and any(not isinstance(_prompt_value(p), str) for p in self.prompts):
            raise ValueError("--chat needs text prompts; token-id prompts only work with /v1/completions")


def _prompt_value(prompt: Any) -> str | list[int]:
    if isinstance(prompt, dict):
        return prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
    return prompt


def _payload(cfg: BenchConfig, prompt: Any, index: int = 0) -> dict:
    model = cfg.model[index % len(cfg.model)] if isinstance(cfg.model, list) else cfg.model
    body: dict[str, Any] = {"model": model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
                            "stream": cfg.stream}
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    if cfg.chat:
        body["messages"] = [{"role": "user", "content": _prompt_value(prompt)}]
    else:
        body["prompt"] = _prompt_value(prompt)
    body.update(cfg.extra_body or {})
    return body


# ---- one request ---------------------------------------------------------------------------------------

async def _send(session: aiohttp.ClientSession, cfg: BenchConfig, index: int) -> RequestResult:
    prompt_index = index % len(cfg.prompts)
    url = cfg.base_url.rstrip("/") + ("/v1/chat/completions" if cfg.chat else "/v1/completions")
    result = RequestResult(prompt_index, ok=False)
    start = time.perf_counter()
    try:
        async with session.post(url, json=_payload(cfg, cfg.prompts[prompt_index], index)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {_error_message(await resp.text())}"
            elif cfg.stream:
                await _read_stream(resp, result, start, cfg.chat)
            else:
                _read_body(await resp.json(), result, cfg.chat)
    except asyncio.TimeoutError:
        result.error = f"timed out after {cfg.timeout_s:g} s (--timeout)"
    except (aiohttp.ClientError, json.JSONDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
    result.e2e = time.perf_counter() - start
    result.ok = result.error is None
    return result


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return text[:200]


def _read_body(body: dict, result: RequestResult, chat: bool) -> None:
    choice = body["choices"][0]
    result.text = choice["message"]["content"] if chat else choice["text"]
    result.finish_reason = choice.get("finish_reason")
    result.read_usage(body["usage"])


async def _read_stream(resp: aiohttp.ClientResponse, result: RequestResult, start: float, chat: bool) -> None:
    parts: list[str] = []
    chunks = 0
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            continue  # read to the end of the body so the connection can be reused
        event = json.loads(data)
        if "error" in event:
            result.error = f"stream error: {event['error'].get('message')}"
            return
        if event.get("usage"):
            result.read_usage(event["usage"])
        for choice in event.get("choices", []):
            text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if text:
                if result.ttft is None:
                    result.ttft = time.perf_counter() - start
                parts.append(text)
                chunks += 1
            result.finish_reason = choice.get("finish_reason") or result.finish_reason
    result.text = "".join(parts)
    result.output_tokens = result.output_tokens or chunks


# ---- load patterns -------------------------------------------------------------------------------------

class _Budget:
    """Hands out request indices until num_requests are taken or the deadline passed."""

    def __init__(self, num_requests: int | None, duration_s: float | None):
        self.limit = num_requests
        self.deadline = None if duration_s is None else time.perf_counter() + duration_s
        self.taken = 0

    def take(self) -> int | None:
        if self.limit is not None and self.taken >= self.limit:
            return None
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return None
        self.taken += 1
        return self.taken - 1


async def _closed_loop(session, cfg: BenchConfig, budget: _Budget) -> list[RequestResult]:
    results: list[RequestResult] = []

    async def client() -> None:
        while (index := budget.take()) is not None:
            results.append(await _send(session, cfg, index))

    await asyncio.gather(*(client() for _ in range(cfg.concurrency or 1)))
    return results


async def _open_loop(session, cfg: BenchConfig, budget: _Budget) -> list[RequestResult]:
    rng = random.Random(cfg.seed)
    limit = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    tasks = []

    async def one(index: int) -> RequestResult:
        if limit is None:
            return await _send(session, cfg, index)
        async with limit:
            return await _send(session, cfg, index)

    while (index := budget.take()) is not None:
        tasks.append(asyncio.create_task(one(index)))
        await asyncio.sleep(rng.expovariate(cfg.request_rate))
    return list(await asyncio.gather(*tasks))


async def run_benchmark(cfg: BenchConfig, return_outputs: bool = False) -> dict:
    """Drive the server as ``cfg`` says and summarize; ``return_outputs`` adds every request's result."""
    cfg.validate()
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=headers) as session:
        if cfg.model is None:
            cfg.model = await served_model(session, cfg.base_url)
        budget = _Budget(cfg.num_requests, cfg.duration_s)
        start = time.perf_counter()
        load = _open_loop if cfg.request_rate else _closed_loop
        results = await load(session, cfg, budget)
        elapsed = time.perf_counter() - start
    summary = summarize(results, elapsed)
    if return_outputs:
        summary["outputs"] = [asdict(r) for r in results]
    return summary


def server_root(base_url: str) -> str:
    """The server's root from either spelling users give: ``http://host:port`` or, as OpenAI clients take it,
    ``http://host:port/v1``."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists at /v1/models."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url) as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]
    except aiohttp.ClientResponseError as err:
        if err.status == 401:
            raise ValueError(f"the server at {url} asks for an API key (401): pass --api-key KEY, or set "
                             "SPECRAY_API_KEY") from None
        raise ValueError(f"cannot list the models at {url} ({err.status} {err.message}); check --base-url, or pass "
                         "--model") from None
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError) as err:
        raise ValueError(f"cannot list the models at {url} ({type(err).__name__}: {err}); is the server running "
                         "(specray serve)? Check --base-url, or pass --model") from None


def benchmark(return_outputs: bool = False, **kwargs: Any) -> dict:
    """Synchronous :func:`run_benchmark` with :class:`BenchConfig`'s keywords."""
    return asyncio.run(run_benchmark(BenchConfig(**kwargs), return_outputs))


# ---- summary -------------------------------------------------------------------------------------------

def summarize(results: list[RequestResult], elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    errors = Counter(r.error for r in results if not r.ok)
    tokens = sum(r.output_tokens for r in ok)
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(errors.most_common(MAX_ERROR_KINDS)),
        "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed if elapsed > 0 else 0.0,
        "output_throughput": tokens / elapsed if elapsed > 0 else 0.0,
        "total_output_tokens": tokens,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None]),
        "e2e_ms": _stats([r.e2e for r in ok]),
        "speculation": _speculation(ok),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
    }


def _speculation(results: list[RequestResult]) -> dict:
    """Drafted and accepted tokens over the completed requests: what speculation bought."""
    drafts = sum(r.drafts for r in results)
    drafted = sum(r.draft_tokens for r in results)
    accepted = sum(r.accepted_tokens for r in results)
    return {"reported_by": sum(r.spec_reported for r in results),
            "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1.0 + accepted / drafts if drafts else 1.0}


def _stats(values_s: list[float]) -> dict:
    values = sorted(v * 1000.0 for v in values_s)
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99)}


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of already sorted values."""
    pos = (len(sorted_values) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def format_report(summary: dict) -> str:
    lines = [
        f"requests: {summary['num_requests']}  completed: {summary['completed']}  failed: {summary['failed']}  "
        f"time: {summary['duration_s']:.2f} s",
        f"throughput: {summary['request_throughput']:.2f} req/s  {summary['output_throughput']:.1f} output tok/s  "
        f"({summary['total_output_tokens']} output tokens)",
    ]
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        s = summary[name]
        if s["p50"] is None:
            lines.append(f"{name[:-3].upper():5s} (ms): n/a")
        else:
            lines.append(f"{name[:-3].upper():5s} (ms): mean {s['mean']:.1f}  p50 {s['p50']:.1f}  "
                         f"p90 {s['p90']:.1f}  p99 {s['p99']:.1f}")
    spec = summary["speculation"]
    if spec["draft_tokens"]:
        lines.append(f"speculation: {spec['draft_tokens']} draft tokens in {spec['drafts']} drafts, "
                     f"{spec['accepted_tokens']} accepted (acceptance rate {spec['acceptance_rate']:.2f}, "
                     f"mean accepted length {spec['mean_accepted_length']:.2f} tokens per step)")
    elif spec["reported_by"]:
        lines.append("speculation: no tokens were drafted for these requests (speculation off, or the drafter "
                     "found nothing to propose)")
    elif not summary["completed"]:
        lines.append("speculation: no request completed, so none reported it")
    else:
        lines.append("speculation: not reported (a server without usage.speculative)")
    if summary.get("prompt_tokens"):
        lines.append(f"prefix cache: {summary['cached_prompt_tokens']} of {summary['prompt_tokens']} prompt tokens "
                     f"({summary['cached_prompt_tokens'] / summary['prompt_tokens']:.0%}) read from the cache")
    for message, count in summary["errors"].items():
        lines.append(f"error x{count}: {message}")
    return "\n".join(lines)
