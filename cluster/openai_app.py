"""The OpenAI-compatible HTTP app (FastAPI), written against an engine client; no Ray here.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (and ``/v1/models/{id}``),
``GET /health``, ``GET /metrics`` (Prometheus text), and, with ``enable_debug_routes``, ``GET /v1/debug/kv`` (KV
blocks free/total and queue lengths, read in the engine thread: tests use it to check that every scenario gives its
blocks back).
With ``api_key`` set, every route but ``/health`` needs ``Authorization: Bearer <api_key>``.

One HTTP request with ``n`` choices (and, for completions, several prompts) fans out into one engine request
per choice. Leaving early (client disconnect, error) closes every engine stream, which aborts the engine
request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import time
import zlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specray.chat import check_template_text, render_chat, split_media
from specray.cluster import openai_protocol as proto
from specray.cluster import openai_responses as responses
from specray.cluster.metrics import ServerMetrics, engine_state
from specray.cluster.reasoning import ReasoningSplitter, reasoning_tokens, starts_thinking, tags_are_special
from specray.cluster.tool_parsers import (TOOL_CALL_PARSERS, ParsedToolCall, RequiredArrayStreamer, ToolCallStreamer,
                                         parse_tool_calls, tool_call_streamer)
from specray.drafters.prediction import METHOD as PREDICTION
from specray.errors import EngineError, WorkerDiedError
from specray.multimodal import (TEXT_ONLY, MultiModalInputs, audio_clips, check_placeholders, expand_prompt,
                                load_audio, load_image, load_video, video_frames)
from specray.lora import ADAPTER_CONFIG, ADAPTER_NAME, RUNTIME_IDS, LoRARequest, dynamic_lora_id, read_adapter
from specray.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SpecStats
from specray.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 2 ** 20
# A token's text is at most as long as the longest vocabulary entry; twice that leaves room for normalizers
# that drop characters, so the character bound never rejects a prompt that would fit.
_CHARS_PER_TOKEN_SLACK = 2
_FALLBACK_MAX_TOKEN_CHARS = 32  # a tokenizer that does not list its vocabulary


# ---- the engine client ---------------------------------------------------------------------------------

class EngineClient(Protocol):
    """What the app needs from an engine."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    # a vision-language model's image processor (specray.multimodal; an attribute), None for a text model
    image_processor: Any

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                 req_id: str | None = None, multimodal: MultiModalInputs | None = None
                 ) -> AsyncIterator[RequestOutput]: ...

    async def engine_state(self) -> dict: ...

    async def engine_metrics(self, unloaded: set[str] = frozenset()) -> bytes:
        """Prometheus text of the metrics the engine records itself, where they live apart from the app's
        (an engine in another process); empty when the app's own :class:`ServerMetrics` holds them. ``unloaded``:
        the runtime adapters unloaded now, whose series go (``ServerMetrics.record_engine_state``)."""
        ...

    async def is_healthy(self) -> bool:
        """Whether an engine can take requests now (``GET /health``)."""
        ...

    def down_reason(self) -> str:
        """Why :meth:`is_healthy` said no, for the 503's message: the engine still starting, or down."""
        ...


class EngineUnavailableError(EngineError):
    """No engine can take the request now (its loop stopped; the replica is being replaced): a fast 503 that
    tells the client to retry, rather than a wait or a 500."""


class AsyncEngineClient:
    """:class:`EngineClient` over a :class:`specray.async_engine.AsyncLLMEngine`."""

    def __init__(self, aengine, image_processor=None):
        self.aengine = aengine
        self.image_processor = image_processor  # a vision-language model's (specray.multimodal), else None

    @property
    def tokenizer(self):
        return self.aengine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.aengine.engine.max_model_len

    def generate(self, prompt_token_ids, params, prompt=None, req_id=None, multimodal=None):
        self._check_running()
        return self.aengine.generate(prompt_token_ids, params, prompt=prompt, req_id=req_id, multimodal=multimodal)

    async def engine_state(self) -> dict:
        self._check_running()
        return await self.aengine.call(engine_state)

    async def engine_metrics(self, unloaded: set[str] = frozenset()) -> bytes:
        return b""  # the engine runs in this process: the app's own metrics hold its step metrics

    def _check_running(self) -> None:
        if not self.aengine.is_running:  # a command would wait forever for a dead engine thread
            raise EngineUnavailableError("the engine loop is not running; retry shortly (Serve replaces an "
                                         "unhealthy replica on its own)")

    async def is_healthy(self) -> bool:
        return self.aengine.is_running

    def down_reason(self) -> str:
        return "the engine loop is not running"


@dataclass
class ServerConfig:
    served_model_name: str  # the name responses carry (model_aliases: other names requests may give)
    max_queue_len: int | None = None  # engine requests waiting for their first token; more get 503
    api_key: str | None = None  # when set, every route but /health needs "Authorization: Bearer <api_key>"
    enable_debug_routes: bool = False  # GET /v1/debug/kv: engine internals, for tests and operators
    max_request_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger bodies get 413
    # What one request may hold at once, so that one client cannot take the whole server: choices (n x prompts)
    # running in the engine together (the rest wait their turn), n, and the output tokens of all its choices.
    max_seats_per_request: int | None = None
    max_n: int = proto.MAX_N
    max_tokens_per_request: int | None = None
    reasoning_parser: str | None = None  # chat messages' <think> ... </think> in reasoning_content (vLLM's)
    # vLLM's: tool_choice "auto" (the default when a request gives tools), the calls read out of the answer by
    # tool_call_parser (specray.cluster.tool_parsers); named and "required" tool choices need neither
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # the Responses API's stored responses (``store``, ``previous_response_id``), kept in this replica's memory: at
    # most this many, least recently used out first (0: none kept)
    max_stored_responses: int = 0
    # what a request's unset sampling fields take (SamplingParams' names): the model's generation config's
    default_sampling: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None  # the template chat messages are rendered with (None: the tokenizer's)
    # vLLM's --trust-request-chat-template: a request's own chat_template is rendered (in transformers' sandboxed
    # Jinja) rather than refused
    trust_request_chat_template: bool = False
    # the engine drafts on the host, so a request's prediction (OpenAI's Predicted Outputs) is drafted from
    drafts_predictions: bool = False
    # vLLM's --allowed-origins: web pages of these origins may call the API from a browser (CORS; "*": any); none by
    # default (vLLM allows any), so a page the user visits cannot reach a server on their machine
    allowed_origins: tuple[str, ...] = ()
    # vLLM's --allowed-media-domains: the hosts an image URL may be fetched from (None: any; empty: data: URLs only)
    allowed_media_domains: frozenset[str] | None = None
    model_aliases: tuple[str, ...] = ()  # other names requests may give (vLLM's several --served-model-name)
    # vLLM's --lora-modules: adapters served under names of their own; a request whose "model" names one runs with it
    lora_modules: tuple[LoRARequest, ...] = ()
    # Ray Serve LLM's dynamic_lora_loading_path: a folder of adapter folders; a request whose model is
    # "<served model name>:<folder name>" runs with that adapter, read when first asked for (no restart, no list)
    lora_dir: str | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's flag: logprobs name tokens "token_id:<id>" unless asked not to
    # vLLM's runtime LoRA updating: POST /v1/load_lora_adapter and /v1/unload_lora_adapter name adapters while the
    # server runs (in the replica, or in one registry that several ingress replicas share)
    runtime_lora_updating: bool = False
    max_lora_rank: int = 16  # what an adapter loaded at run time may have (the engine's max_lora_rank)


# ---- one HTTP request's engine work --------------------------------------------------------------------

@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]
    # SamplingParams.prompt_logprobs, from the first of the prompt's choices whose output has them
    logprobs: PromptLogprobs | None = None
    multimodal: MultiModalInputs | None = None  # its images (specray.multimodal)


@dataclass
class _Choice:
    index: int
    prompt: _Prompt
    params: SamplingParams
    req_id: str
    output: CompletionOutput | None = None
    spec_stats: SpecStats = field(default_factory=SpecStats)
    num_cached_tokens: int = 0  # of its prompt, found in the prefix cache
    sent_chars: int = 0
    sent_tokens: int = 0
    predicted: bool = False  # it drafts from its prediction: its usage tells what came of it
    # where the next streamed token's text starts (completions logprobs' text_offset)
    logprob_text: proto.TextCursor = field(default_factory=proto.TextCursor)
    echoed: bool = False  # the prompt went out (completions with echo=true)
    reasoning: ReasoningSplitter | None = None  # a chat choice's split of its streamed text (reasoning_parser)
    tool_stream: ToolCallStreamer | None = None  # a chat choice's tool calls, read from its streamed answer
    tool_calls_sent: int = 0  # tool calls streamed so far (the next one's index)
    # with tools, blank content waits for words (a message with calls and blanks only has content null)
    blank_held: str = ""
    words_sent: bool = False
    prompt_ids_sent: bool = False  # with return_token_ids: its prompt's ids went out (a stream's first chunk)

    def update(self, out: RequestOutput) -> None:
        self.output = out.outputs[0]
        self.spec_stats = out.spec_stats
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt.logprobs = out.prompt_logprobs

    def take_delta(self) -> tuple[str, int, int]:
        """The new text (the engine reports none that a stop string may still take back), and the range of new
        output tokens."""
        out = self.output
        text = out.text[self.sent_chars:]
        self.sent_chars += len(text)
        start, self.sent_tokens = self.sent_tokens, len(out.token_ids)
        return text, start, self.sent_tokens


class _Fanout:
    """Runs the engine requests of one HTTP request concurrently, at most ``seats`` at once (so that one request
    with many choices cannot hold every engine seat). ``next()`` returns the choice that just got a new output
    (already applied to it), None when all finished, and raises the first error. ``close()`` cancels what is
    still running, which closes those engine streams (the engine aborts them and frees their blocks).

    Queue accounting: a choice is queued from the moment it holds a seat until its first output; the first
    ``seats`` choices were counted at admission (``reserved``), later ones count when a seat frees up, and each
    change goes to ``on_queue`` as +1/-1."""

    def __init__(self, client: EngineClient, choices: list[_Choice], arrival: float, metrics: ServerMetrics,
                 on_queue: Callable[[int], None], seats: int, live: set[_Fanout] | None = None):
        """``live``: the server's open fanouts; this one is in it until closed."""
        self._client = client
        self._live_set = live if live is not None else set()
        self._live_set.add(self)
        self._metrics = metrics
        self._arrival = arrival
        self._on_queue = on_queue
        self._seats = asyncio.Semaphore(seats)
        self._reserved = min(seats, len(choices))
        self._queued: set[int] = set()  # choices holding a seat with no output yet
        self._events: asyncio.Queue = asyncio.Queue()
        self._live = len(choices)
        self._tasks = [asyncio.create_task(self._pump(c)) for c in choices]

    async def next(self) -> _Choice | None:
        while self._live:
            choice, item = await self._events.get()
            if item is None:
                self._live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                choice.update(item)
                return choice
        return None

    def fail(self, err: BaseException) -> None:
        """End the request with ``err``: ``next()`` raises it (its handler then closes this fanout)."""
        self._events.put_nowait((None, err))

    def close(self) -> None:
        self._live_set.discard(self)
        for task in self._tasks:
            task.cancel()
        for index in list(self._queued):  # a task cancelled before it ran never reaches its finally
            self._started(index)
        if self._reserved:
            self._on_queue(-self._reserved)
            self._reserved = 0

    def _enqueued(self, index: int) -> None:
        if self._reserved:
            self._reserved -= 1
        else:
            self._on_queue(1)
        self._queued.add(index)

    def _started(self, index: int) -> None:
        if index in self._queued:
            self._queued.discard(index)
            self._on_queue(-1)

    async def _pump(self, choice: _Choice) -> None:
        first = None
        try:
            async with self._seats:
                self._enqueued(choice.index)
                stream = self._client.generate(choice.prompt.token_ids, choice.params, prompt=choice.prompt.text,
                                               req_id=choice.req_id, multimodal=choice.prompt.multimodal)
                async with contextlib.aclosing(stream):
                    async for out in stream:
                        if first is None:
                            first = time.monotonic()
                            self._started(choice.index)
                        self._events.put_nowait((choice, out))
                        if out.finished:
                            self._record(choice, out, first)
        except Exception as exc:  # handed to next(), which raises it in the request handler
            self._events.put_nowait((choice, exc))
        finally:
            self._started(choice.index)
            self._events.put_nowait((choice, None))

    def _record(self, choice: _Choice, out: RequestOutput, first: float) -> None:
        end = time.monotonic()
        self._metrics.record_choice(first - self._arrival, end - self._arrival, len(out.prompt_token_ids),
                                    len(out.outputs[0].token_ids))
        if choice.predicted:
            stats = out.spec_stats
            self._metrics.record_prediction(stats.accepted_tokens, stats.draft_tokens - stats.accepted_tokens)


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body and runs ``on_close``, also when the client went away
    (Starlette leaves a cancelled body generator suspended)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self.body_iterator.aclose()


# ---- response formats ----------------------------------------------------------------------------------

class _Format:
    """How one endpoint writes choices, stream chunks and usage."""

    def __init__(self, request_id: str, model: str, logprobs: proto.LogprobFormatter, num_logprobs: int | None,
                 num_prompt_logprobs: int | None = None, return_token_ids: bool = False):
        self.request_id = request_id
        self.return_token_ids = return_token_ids  # vLLM's: the prompt's and the output's token ids go out too
        self.model = model
        self.created = proto.now()
        self.logprob_fmt = logprobs
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs  # vLLM's prompt_logprobs field, when the request asked

    async def flush(self) -> None:
        """Finish what must happen before the client hears the response is finished (a stored response's store)."""

    def _prompt_logprobs(self, choice: _Choice) -> proto.PromptLogprobsJSON | None:
        if self.num_prompt_logprobs is None or choice.prompt.logprobs is None:
            return None
        return self.logprob_fmt.prompt_logprobs(choice.prompt.logprobs, self.num_prompt_logprobs)

    def _token_ids(self, choice: _Choice, start: int, end: int) -> list[int] | None:
        """With return_token_ids, the choice's output token ids [start, end)."""
        return list(choice.output.token_ids[start:end]) if self.return_token_ids else None

    def _prompt_ids(self, choice: _Choice) -> list[int] | None:
        """With return_token_ids, the choice's prompt token ids, once (a stream sends them in its first chunk)."""
        if not self.return_token_ids or choice.prompt_ids_sent:
            return None
        choice.prompt_ids_sent = True
        return list(choice.prompt.token_ids)

    def _quiet(self, text: str, finish: str | None, start: int, end: int) -> bool:
        """Nothing for a chunk to say: no text, no finish, and no new tokens whose logprobs or ids go out."""
        return not text and finish is None and (
            start == end or (self.num_logprobs is None and not self.return_token_ids))

    def _token_slice(self, choice: _Choice, start: int, end: int):
        out = self.num_logprobs is not None and choice.output.logprobs is not None
        if not out:
            return None
        return choice.output.token_ids[start:end], choice.output.logprobs[start:end]

    def opening(self, choices: list[_Choice]) -> list[dict]:
        return []

    # a stream: what goes out first, per engine output, and last, each payload one server-sent event
    done: str | None = proto.SSE_DONE  # the line that ends the stream

    def sse(self, payload: Any) -> str:
        return proto.sse(payload)

    def stream_opening(self, choices: list[_Choice], continuous_usage: bool = False) -> list[Any]:
        """What goes out first (a chat's role chunk per choice); ``continuous_usage``: each with its choice's usage
        so far, none of its tokens yet (vLLM's)."""
        chunks = self.opening(choices)
        if continuous_usage:
            cached = _cached_tokens(choices)  # the first output has come: its prompt's cache hit is known
            for chunk, choice in zip(chunks, choices):
                chunk.usage = proto.make_usage(len(choice.prompt.token_ids), 0, SpecStats(), cached[id(choice.prompt)])
        return chunks

    def stream_chunk(self, choice: _Choice, continuous_usage: bool = False) -> list[Any]:
        """The chunk of ``choice``'s new output, if any; ``continuous_usage``: with the choice's usage so far."""
        chunk = self.chunk(choice)
        if chunk is not None and continuous_usage:
            chunk.usage = _usage([choice])
        return [] if chunk is None else [chunk]

    def stream_closing(self, choices: list[_Choice], include_usage: bool) -> list[Any]:
        return [self.usage_chunk(_usage(choices))] if include_usage else []

    def stream_error(self, err: proto.OpenAIError) -> list[Any]:
        return [err.body()]


class _CompletionFormat(_Format):
    def __init__(self, *args, echo: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.echo = echo  # each choice's text (and logprobs) starts with its prompt's

    def _logprobs(self, choice: _Choice, start: int, end: int) -> proto.CompletionLogprobs | None:
        sliced = self._token_slice(choice, start, end)
        if sliced is None:
            return None
        return self.logprob_fmt.completion(*sliced, self.num_logprobs, choice.logprob_text)

    def _echo(self, choice: _Choice, text: str, logprobs: proto.CompletionLogprobs | None
              ) -> tuple[str, proto.CompletionLogprobs | None]:
        """With echo, the first text (and logprobs) of a choice put its prompt's before the completion's."""
        if not self.echo or choice.echoed:
            return text, logprobs
        choice.echoed = True
        prompt = choice.prompt
        if prompt.text is None:  # a token-id prompt: its text as the tokenizer decodes it
            prompt.text = self.logprob_fmt.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
        if logprobs is None or prompt.logprobs is None:
            return prompt.text + text, logprobs
        prompt_text = proto.TextCursor()
        head = self.logprob_fmt.echoed_prompt(prompt.token_ids, prompt.logprobs, self.num_logprobs, prompt_text)
        shift = prompt_text.chars
        choice.logprob_text.chars += shift  # the completion's later tokens follow the prompt's text
        return prompt.text + text, proto.CompletionLogprobs(
            tokens=head.tokens + logprobs.tokens, token_logprobs=head.token_logprobs + logprobs.token_logprobs,
            top_logprobs=head.top_logprobs + logprobs.top_logprobs,
            text_offset=head.text_offset + [o + shift for o in logprobs.text_offset])

    def _choice(self, choice: _Choice, text: str, start: int, end: int) -> proto.CompletionChoice:
        text, logprobs = self._echo(choice, text, self._logprobs(choice, start, end))
        return proto.CompletionChoice(index=choice.index, text=text, finish_reason=choice.output.finish_reason,
                                      stop_reason=choice.output.stop_reason, logprobs=logprobs,
                                      prompt_logprobs=self._prompt_logprobs(choice),
                                      prompt_token_ids=self._prompt_ids(choice),
                                      token_ids=self._token_ids(choice, start, end))

    def response(self, choices: list[_Choice], usage: proto.Usage) -> dict:
        items = [self._choice(c, c.output.text, 0, len(c.output.token_ids)) for c in choices]
        return proto.Completion(id=self.request_id, created=self.created, model=self.model, choices=items,
                                usage=usage).model_dump()

    def chunk(self, choice: _Choice) -> proto.Completion | None:
        text, start, end = choice.take_delta()
        finish = choice.output.finish_reason
        if self._quiet(text, finish, start, end) and (choice.echoed or not self.echo):
            return None
        return proto.Completion(id=self.request_id, created=self.created, model=self.model,
                                choices=[self._choice(choice, text, start, end)])

    def usage_chunk(self, usage: proto.Usage) -> proto.Completion:
        return proto.Completion(id=self.request_id, created=self.created, model=self.model, choices=[],
                                usage=usage)


@dataclass(frozen=True)
class _ToolOutput:
    """How a chat request's tool calls come out of each choice's answer (its text after any reasoning):
    "named": the answer is the arguments of the function ``name`` (the grammar holds it to its schema);
    "required": a JSON array of calls (:class:`RequiredArrayStreamer`); "auto": what the tool call parser
    ``parser`` finds in it, only the first call with ``single_call`` (``parallel_tool_calls: false``; vLLM's:
    the calls after it are dropped)."""

    mode: str
    name: str | None = None
    parser: str | None = None
    schemas: dict[str, dict] | None = None  # the request's functions' parameter schemas, by name
    single_call: bool = False

    def streamer(self) -> ToolCallStreamer:
        return RequiredArrayStreamer() if self.mode == "required" else tool_call_streamer(self.parser, self.schemas)


def _tool_call(call: ParsedToolCall) -> proto.ToolCall:
    return proto.ToolCall(id=proto.new_tool_call_id(), function=proto.FunctionCall(name=call.name,
                                                                                   arguments=call.arguments))


def _finish_with_calls(finish: str | None, called: bool) -> str | None:
    """A choice that made tool calls ends with "tool_calls" (OpenAI's and vLLM's) where it ended normally."""
    return "tool_calls" if called and finish in ("stop", "length") else finish


class _ChatFormat(_Format):
    def __init__(self, *args, reasoning_parser: str | None = None, tools: _ToolOutput | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.reasoning_parser = reasoning_parser
        self.tools = tools

    def _splitter(self, choice: _Choice) -> ReasoningSplitter | None:
        if self.reasoning_parser is None:
            return None
        if choice.reasoning is None:
            choice.reasoning = ReasoningSplitter(starts_thinking(self.reasoning_parser, choice.prompt.text))
        return choice.reasoning

    def _logprobs(self, choice: _Choice, start: int, end: int) -> proto.ChatLogprobs | None:
        sliced = self._token_slice(choice, start, end)
        return None if sliced is None else self.logprob_fmt.chat(*sliced, self.num_logprobs)

    def response(self, choices: list[_Choice], usage: proto.Usage) -> dict:
        items = []
        for c in choices:
            message, finish = self._message(c)
            items.append(proto.ChatChoice(index=c.index, message=message, finish_reason=finish,
                                          stop_reason=c.output.stop_reason,
                                          logprobs=self._logprobs(c, 0, len(c.output.token_ids)),
                                          token_ids=self._token_ids(c, 0, len(c.output.token_ids))))
        return proto.ChatCompletion(id=self.request_id, created=self.created, model=self.model, choices=items,
                                    usage=usage, prompt_logprobs=self._prompt_logprobs(choices[0]),
                                    prompt_token_ids=self._prompt_ids(choices[0])).model_dump()

    def _message(self, choice: _Choice) -> tuple[proto.AssistantMessage, str | None]:
        """A whole choice's message and finish reason: the reasoning apart (reasoning_parser), then the answer's
        tool calls apart (content null when nothing else is left)."""
        finish = choice.output.finish_reason
        splitter = self._splitter(choice)
        reasoning, content = (None, choice.output.text) if splitter is None else splitter.split(choice.output.text)
        tools = self.tools
        if tools is None or content is None:
            return proto.AssistantMessage(content=content, reasoning_content=reasoning), finish
        if tools.mode == "named":  # OpenAI's and vLLM's finish reason for a forced call: "stop"
            call = _tool_call(ParsedToolCall(tools.name, content))
            return proto.AssistantMessage(content=None, reasoning_content=reasoning, tool_calls=[call]), finish
        content, calls = parse_tool_calls(tools.streamer(), content)
        if tools.single_call:
            calls = calls[:1]
        message = proto.AssistantMessage(content=None if calls and not content.strip() else content,
                                         reasoning_content=reasoning, tool_calls=[_tool_call(c) for c in calls])
        return message, _finish_with_calls(finish, bool(calls))

    def _delta(self, choice: _Choice, text: str, finished: bool) -> dict[str, Any]:
        """The chunk's delta for new ``text``: its content, or with a reasoning parser its reasoning and its
        content apart (a tail that may begin a tag waits for the next chunk, or the last); with tools, the calls
        out of the content (:meth:`_tool_delta`)."""
        splitter = self._splitter(choice)
        reasoning, content = "", text
        if splitter is not None:
            reasoning, content = splitter.push(text)
            if finished:
                r, c = splitter.finish()
                reasoning, content = reasoning + r, content + c
        delta: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
        if self.tools is not None:
            return {**delta, **self._tool_delta(choice, content, finished)}
        return {**delta, "content": content} if content else delta

    def _tool_delta(self, choice: _Choice, text: str, finished: bool) -> dict[str, Any]:
        """The delta of the answer's new ``text`` with tools: a named call's id, type and name with its first
        arguments, then its arguments as they come; otherwise content as the parser lets it out (blanks wait for
        words, so that a message of calls and blanks streams no content, as it has none whole) and each call once
        it is complete, whole (OpenAI's ``delta.tool_calls``: index, id, type, function name and arguments)."""
        tools = self.tools
        if tools.mode == "named":
            if choice.tool_calls_sent:
                return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
            thinking = choice.reasoning is not None and choice.reasoning.thinking  # no answer yet, maybe never
            if not text and (not finished or thinking):
                return {}
            choice.tool_calls_sent = 1
            return {"tool_calls": [{"index": 0, "id": proto.new_tool_call_id(), "type": "function",
                                    "function": {"name": tools.name, "arguments": text}}]}
        if choice.tool_stream is None:
            choice.tool_stream = tools.streamer()
        content, calls = choice.tool_stream.push(text)
        if finished:
            rest, more = choice.tool_stream.finish()
            content, calls = content + rest, calls + more
        if tools.single_call:
            calls = calls[:max(0, 1 - choice.tool_calls_sent)]
        if not choice.words_sent:  # blanks so far: held until words come, dropped if only calls come
            content, choice.blank_held = choice.blank_held + content, ""
            choice.words_sent = bool(content.strip())
            plain_end = finished and not choice.tool_calls_sent and not calls
            if not choice.words_sent and not plain_end:
                content, choice.blank_held = "", content
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            first, choice.tool_calls_sent = choice.tool_calls_sent, choice.tool_calls_sent + len(calls)
            delta["tool_calls"] = [{"index": first + i, **_tool_call(call).model_dump()}
                                   for i, call in enumerate(calls)]
        return delta

    def _chunk(self, choices: list[proto.ChatChunkChoice], usage: proto.Usage | None = None):
        return proto.ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                         choices=choices, usage=usage)

    def opening(self, choices: list[_Choice]) -> list[proto.ChatCompletionChunk]:
        chunks = []
        for c in choices:
            chunk = self._chunk([proto.ChatChunkChoice(index=c.index, delta={"role": "assistant", "content": ""})])
            chunk.prompt_token_ids = self._prompt_ids(c)
            chunks.append(chunk)
        return chunks

    def chunk(self, choice: _Choice) -> proto.ChatCompletionChunk | None:
        text, start, end = choice.take_delta()
        finish = choice.output.finish_reason
        delta = self._delta(choice, text, finish is not None)
        if self.tools is not None and self.tools.mode != "named":
            finish = _finish_with_calls(finish, choice.tool_calls_sent > 0)
        if not delta and self._quiet("", finish, start, end):
            return None
        item = proto.ChatChunkChoice(index=choice.index, delta=delta, finish_reason=finish,
                                     stop_reason=choice.output.stop_reason,
                                     logprobs=self._logprobs(choice, start, end),
                                     token_ids=self._token_ids(choice, start, end))
        return self._chunk([item])

    def usage_chunk(self, usage: proto.Usage) -> proto.ChatCompletionChunk:
        return self._chunk([], usage)


class _ResponsesFormat(_ChatFormat):
    """OpenAI's Responses API over one chat choice (the API has no ``n``): the whole response, or streamed as its
    typed events (each output item added, its text or arguments in deltas, done; then ``response.completed``)."""

    done = None  # response.completed (or incomplete) ends the stream

    def __init__(self, *args, request: responses.ResponsesRequest, on_response=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.request = request
        self.on_response = on_response  # awaited with the finished response object (the server stores it)
        self.finished: dict | None = None  # the finished response, until flush() hands it to on_response
        self.sequence = 0
        self.output: list[dict] = []  # the items done so far
        self.open: dict | None = None  # the item being streamed: kind, id, output index, text (and a call's)
        # logprobs asked for: the output tokens' not yet sent with a text delta (their text held back, or
        # reasoning's or a call's: they go out with the message text after them)
        self.pending_logprobs: list[dict] = []

    def _response(self, status: str, usage: dict | None = None, output: list[dict] | None = None) -> dict:
        return responses.response_object(self.request, self.request_id, self.created, self.model,
                                         list(self.output if output is None else output), status, usage,
                                         stored=self.on_response is not None)

    def _finished(self, response: dict) -> dict:
        self.finished = response
        return response

    async def flush(self) -> None:
        """Store the finished response (``on_response``), before the client hears that it is finished: a request
        that names it next finds it."""
        finished, self.finished = self.finished, None
        if self.on_response is not None and finished is not None:
            await self.on_response(finished)

    def _logprob_entries(self, choice: _Choice, start: int, end: int) -> list[dict] | None:
        """Output tokens start..end's logprobs in the API's form (None: not asked for)."""
        logprobs = self._logprobs(choice, start, end)
        return None if logprobs is None else [entry.model_dump() for entry in logprobs.content or ()]

    def _reasoning_tokens(self, choice: _Choice, reasoning: str | None) -> int:
        """How many of the output's tokens are its thinking (a reasoning parser's; usage's reasoning_tokens)."""
        if self.reasoning_parser is None:
            return 0
        return reasoning_tokens(self.logprob_fmt.tokenizer, choice.output.token_ids, reasoning,
                                starts_thinking(self.reasoning_parser, choice.prompt.text))

    def response(self, choices: list[_Choice], usage: proto.Usage) -> dict:
        message, _ = self._message(choices[0])
        status = responses.status_of(choices[0].output.finish_reason)
        logprobs = self._logprob_entries(choices[0], 0, len(choices[0].output.token_ids))
        usage_ = responses.usage(usage, self._reasoning_tokens(choices[0], message.reasoning_content or None))
        return self._finished(self._response(status, usage_, responses.output_items(message, status, logprobs)))

    def sse(self, event: dict) -> str:
        event = {"type": event["type"], "sequence_number": self.sequence, **event}
        self.sequence += 1
        return f"event: {event['type']}\n" + proto.sse(event)

    def stream_opening(self, choices: list[_Choice], continuous_usage: bool = False) -> list[dict]:
        return [{"type": "response.created", "response": self._response("in_progress")},
                {"type": "response.in_progress", "response": self._response("in_progress")}]

    def stream_chunk(self, choice: _Choice, continuous_usage: bool = False) -> list[dict]:
        text, start, end = choice.take_delta()
        self.pending_logprobs += self._logprob_entries(choice, start, end) or []
        delta = self._delta(choice, text, choice.output.finish_reason is not None)
        events = self._text_events("reasoning", delta.get("reasoning_content", ""))
        events += self._text_events("message", delta.get("content", ""))
        for call in delta.get("tool_calls", []):
            events += self._call_events(call)
        return events

    def stream_closing(self, choices: list[_Choice], include_usage: bool) -> list[dict]:
        status = responses.status_of(choices[0].output.finish_reason)
        closed = self._close(status)  # the item open when the output ends is the one a cut cuts
        thought = "".join(item["content"][0]["text"] for item in self.output if item["type"] == "reasoning")
        reasoning = thought if any(item["type"] == "reasoning" for item in self.output) else None
        usage = responses.usage(_usage(choices), self._reasoning_tokens(choices[0], reasoning))
        return closed + [{"type": f"response.{status}", "response": self._finished(self._response(status, usage))}]

    def stream_error(self, err: proto.OpenAIError) -> list[dict]:
        """The API's error event, then ``response.failed`` (its error, the items done before it): the stream
        ends on a response event, as one that completes does."""
        error = {k: v for k, v in err.body()["error"].items() if k != "type"}
        failed = self._response("failed")
        failed["error"] = {"code": error["code"] or "server_error", "message": error["message"]}
        return [{"type": "error", **error}, {"type": "response.failed", "response": failed}]

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": self.open["index"]}

    def _text_events(self, kind: str, text: str) -> list[dict]:
        """A message's or the reasoning's new text: the item (and its one content part) opened first when it is not
        the one being streamed (closing that one), then the delta."""
        if not text:
            return []
        events = []
        if self.open is None or self.open["kind"] != kind:
            events = self._close()
            item_id, index = proto.new_id("msg" if kind == "message" else "rs"), len(self.output)
            item = responses.message_item(item_id, "", "in_progress") if kind == "message" else {
                "type": "reasoning", "id": item_id, "summary": [], "content": []}
            part = responses.output_text("") if kind == "message" else {"type": "reasoning_text", "text": ""}
            self.open = {"kind": kind, "id": item_id, "index": index, "text": "", "logprobs": []}
            events += [{"type": "response.output_item.added", "output_index": index, "item": item},
                       {"type": "response.content_part.added", **self._where(), "content_index": 0, "part": part}]
        self.open["text"] += text
        if kind == "reasoning":
            return events + [{"type": "response.reasoning_text.delta", **self._where(), "content_index": 0,
                              "delta": text}]
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        self.open["logprobs"] += logprobs
        return events + [{"type": "response.output_text.delta", **self._where(), "content_index": 0, "delta": text,
                          "logprobs": logprobs}]

    def _call_events(self, call: dict) -> list[dict]:
        """A chat tool-call delta: one with an id opens a function_call item (closing the open one); arguments
        come as deltas."""
        function = call.get("function", {})
        events = []
        if "id" in call:
            events = self._close()
            item_id, index = proto.new_id("fc"), len(self.output)
            self.open = {"kind": "function_call", "id": item_id, "index": index, "text": "", "call_id": call["id"],
                         "name": function["name"]}
            item = responses.function_call_item(item_id, call["id"], function["name"], "", "in_progress")
            events.append({"type": "response.output_item.added", "output_index": index, "item": item})
        if function.get("arguments"):
            self.open["text"] += function["arguments"]
            events.append({"type": "response.function_call_arguments.delta", **self._where(),
                           "delta": function["arguments"]})
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        """The open item's done events, its status ``status`` (reasoning items carry none); the item joins the
        output."""
        item, self.open = self.open, None
        if item is None:
            return []
        where, text = {"item_id": item["id"], "output_index": item["index"]}, item["text"]
        if item["kind"] == "function_call":
            done = responses.function_call_item(item["id"], item["call_id"], item["name"], text, status)
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": text}]
        else:
            message = item["kind"] == "message"
            logprobs = item["logprobs"] if self.num_logprobs is not None else None
            done = responses.message_item(item["id"], text, status, logprobs) if message else \
                responses.reasoning_item(item["id"], text)
            part = done["content"][0]
            events = [{"type": f"response.{part['type']}.done", **where, "content_index": 0, "text": text,
                       **({"logprobs": item["logprobs"]} if message else {})},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
        self.output.append(done)
        return events + [{"type": "response.output_item.done", "output_index": item["index"], "item": done}]


def _cached_tokens(choices: list[_Choice]) -> dict[int, int]:
    """Per prompt (by id: n choices share one), the most of it any of its choices found in the prefix cache."""
    cached: dict[int, int] = {}
    for c in choices:
        cached[id(c.prompt)] = max(cached.get(id(c.prompt), 0), c.num_cached_tokens)
    return cached


def _usage(choices: list[_Choice]) -> proto.Usage:
    prompts = {id(c.prompt): len(c.prompt.token_ids) for c in choices}
    stats = SpecStats()
    predicted = SpecStats() if any(c.predicted for c in choices) else None
    for c in choices:
        stats.merge(c.spec_stats)
        if c.predicted:
            predicted.merge(c.spec_stats)
    return proto.make_usage(sum(prompts.values()), sum(len(c.output.token_ids) for c in choices), stats,
                            sum(_cached_tokens(choices).values()), predicted)


class _AudioTextFormat(_Format):
    """OpenAI's transcription answer: the text, and the usage in tokens (with the speculation counters); streamed,
    ``transcript.text.delta`` events, then ``transcript.text.done`` with the whole text and the usage. The choices
    are an audio's clips in order (one unless the model takes no audio that long): their texts join with a space
    where neither side has one, and a stream tells a clip's text once every clip before it is done. ``transcript``:
    the transcript in a generation's text so far (a processor's ``transcription_text``: Qwen3-ASR's drops the
    language it writes first), each one extending the last; None: the text as it is. ``segments``: the answer is
    ``verbose_json``'s (:class:`_Segments`)."""

    done = None  # transcript.text.done ends the stream

    def __init__(self, *args, transcript: Callable[[str], str] | None = None,
                 segments: _Segments | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.transcript = transcript
        self.segments = segments
        self.clips: list[_Choice] = []
        self.current = 0  # the clip being streamed (those before it are done)
        self.text = ""  # what the stream has told

    def _transcript(self, choice: _Choice) -> str:
        return choice.output.text if self.transcript is None else self.transcript(choice.output.text)

    def response(self, choices: list[_Choice], usage: proto.Usage) -> dict:
        texts, text = [self._transcript(choice) for choice in choices], ""
        for clip in texts:
            text += _clip_text(text, clip)
        if self.segments is None:
            return {"text": text, "usage": _audio_usage(usage)}
        return {**self.segments.verbose(text, texts, [c.output for c in choices]), "usage": _audio_usage(usage)}

    def sse(self, event: dict) -> str:
        return f"event: {event['type']}\n" + proto.sse(event)

    def stream_opening(self, choices: list[_Choice], continuous_usage: bool = False) -> list[dict]:
        self.clips = choices
        return []

    def stream_chunk(self, choice: _Choice, continuous_usage: bool = False) -> list[dict]:
        delta = ""  # the current clip's new text, and past each clip that is done the next one's
        while self.current < len(self.clips) and self.clips[self.current].output is not None:
            clip = self.clips[self.current]
            shown = self._transcript(clip)
            text, first = shown[clip.sent_chars:], clip.sent_chars == 0
            clip.sent_chars = len(shown)
            delta += _clip_text(self.text + delta, text) if first else text
            if clip.output.finish_reason is None:
                break
            self.current += 1
        self.text += delta
        return [{"type": "transcript.text.delta", "delta": delta}] if delta else []

    def stream_closing(self, choices: list[_Choice], include_usage: bool) -> list[dict]:
        return [{"type": "transcript.text.done", "text": self.text, "usage": _audio_usage(_usage(choices))}]


@dataclass
class _Segments:
    """OpenAI's ``verbose_json`` of a transcription: its segments are the clips the audio was cut into (the models
    served here write no timestamps of their own), each timed by where it lies in the audio (``spans``, seconds)."""

    task: str  # "transcribe" or "translate"
    language: str | None  # the request's (a translation's: "en", what it is written in)
    duration: float  # the audio's, in seconds
    spans: list[tuple[float, float]]  # each clip's start and end
    temperature: float  # the request's

    def verbose(self, text: str, texts: list[str], outputs: list[CompletionOutput]) -> dict:
        """The answer's body less its usage: the whole text, then per clip its text, time, tokens, the mean
        log-probability of its tokens under the model and its text's gzip compression ratio (Whisper's fields; no
        ``no_speech_prob``: nothing here estimates it)."""
        segments = []
        for i, (clip, out, (start, end)) in enumerate(zip(texts, outputs, self.spans)):
            raw, n = clip.encode(), len(out.token_ids)
            mean = out.cumulative_logprob / n if n and out.cumulative_logprob is not None else None
            segments.append({"id": i, "seek": round(start * 100), "start": start, "end": end, "text": clip,
                             "tokens": list(out.token_ids), "temperature": self.temperature, "avg_logprob": mean,
                             "compression_ratio": len(raw) / len(zlib.compress(raw)) if raw else 0.0})
        return {"task": self.task, "language": self.language, "duration": self.duration, "text": text,
                "segments": segments}


def subtitles(body: dict, kind: str) -> str:
    """A ``verbose_json`` body's segments as SubRip (``kind`` "srt") or WebVTT ("vtt") cues."""
    def stamp(seconds: float) -> str:
        ms = round(seconds * 1000)
        return (f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}"
                f"{',' if kind == 'srt' else '.'}{ms % 1000:03d}")

    cues = [f"{stamp(seg['start'])} --> {stamp(seg['end'])}\n{seg['text'].strip()}\n" for seg in body["segments"]]
    if kind == "srt":
        return "\n".join(f"{i + 1}\n{cue}" for i, cue in enumerate(cues))
    return "WEBVTT\n\n" + "\n".join(cues)


def _clip_text(before: str, text: str) -> str:
    """A clip's text as it follows the text of the clips before it: after a space where neither side has one."""
    return " " + text if before and text and not before[-1].isspace() and not text[0].isspace() else text


def _audio_usage(usage: proto.Usage) -> dict:
    return {"type": "tokens", "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "speculative": usage.speculative.model_dump()}


def audio_instruction(processor: Any, task: str, language: str | None, prompt: str | None) -> str:
    """The user turn's text beside the audio in a chat-templated transcription (``task`` "transcribe") or
    translation ("translate") prompt: the processor's ``transcription_instruction`` (a release's own wording)
    or a plain one, the language's code where given, and the request's ``prompt`` (text the transcript continues)."""
    if task == "translate":
        text = "Translate the audio into English."
    else:
        text = getattr(processor, "transcription_instruction", None) or "Transcribe the audio."
        if language:
            text += f" Its language: {language}."
    return text if not prompt else f"{text}\n{prompt}"


# ---- the serving logic ---------------------------------------------------------------------------------

class RuntimeAdapters:
    """vLLM's runtime-loaded LoRA adapters (``POST /v1/load_lora_adapter``): served name -> LoRARequest, each load
    with an id of its own (from ``RUNTIME_IDS``), so an engine never sees one id name two folders. In the replica's
    memory; with several ingress replicas one deployment of it serves them all (``specray.cluster.serve``), behind
    the same awaited interface."""

    def __init__(self) -> None:
        self.adapters: dict[str, LoRARequest] = {}
        self.ids = itertools.count(RUNTIME_IDS)

    async def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    async def names(self) -> list[str]:
        return list(self.adapters)

    async def load(self, name: str, path: str, base_model: str, inplace: bool) -> bool:
        """Serve the adapter at ``path`` as ``name``; False (nothing changed) when ``name`` is loaded already and
        ``inplace`` does not say to replace it."""
        if name in self.adapters and not inplace:
            return False
        self.adapters[name] = LoRARequest(name, next(self.ids), path, base_model)
        return True

    async def unload(self, name: str) -> bool:
        return self.adapters.pop(name, None) is not None


class OpenAIServing:
    def __init__(self, client: EngineClient, config: ServerConfig, metrics: ServerMetrics, response_store=None,
                 runtime_adapters=None):
        self.client = client
        self.config = config
        self.metrics = metrics
        self.logprob_fmt = proto.LogprobFormatter(client.tokenizer)
        self.logprob_ids_fmt = proto.LogprobFormatter(client.tokenizer, as_token_ids=True)
        # a reasoning model whose <think> tags are special tokens: chat text keeps them for the split (vLLM's
        # reasoning parsers' adjust_request), unless a request asks for skip_special_tokens itself
        self.keep_reasoning_tags = config.reasoning_parser is not None and tags_are_special(client.tokenizer)
        # adapters loaded through /v1/load_lora_adapter: the replica's own, or one registry several replicas share
        self.runtime_adapters = runtime_adapters if runtime_adapters is not None else RuntimeAdapters()
        self._runtime_seen: set[str] = set()  # every adapter name seen loaded at runtime (a load here, a scrape)
        self.num_queued = 0  # engine requests admitted that have not produced their first output yet
        self._fanouts: set[_Fanout] = set()  # the requests generating now (until their handlers close them)
        self._stopping = False  # the server is shutting down: every request is answered _shutting_down()
        self.max_prompt_chars = client.max_model_len * _CHARS_PER_TOKEN_SLACK * max_token_chars(client.tokenizer)
        # Templating and tokenizing a long prompt takes a while: off the event loop that streams the other
        # requests. One thread: a fast tokenizer's encode is not safe to call concurrently on one instance.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specray-tokenize")
        # the Responses API's stored responses: the replica's own, or one store that several replicas share
        self.response_store = response_store if response_store is not None else (
            responses.LocalResponseStore(config.max_stored_responses) if config.max_stored_responses else None)

    # ---- routes ----------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, self._completions)

    async def responses(self, request: Request) -> Response:
        return await self._handle(request, self._responses)

    async def get_response(self, response_id: str) -> Response:
        """A stored response (``GET /v1/responses/{id}``), or a 404 in OpenAI's shape."""
        try:
            entry = None if self.response_store is None else await self.response_store.get(response_id)
        except proto.OpenAIError as err:
            return error_response(err)
        if entry is None:
            return error_response(responses.not_found(response_id))
        return JSONResponse(entry[1])

    async def delete_response(self, response_id: str) -> Response:
        try:
            deleted = self.response_store is not None and await self.response_store.delete(response_id)
        except proto.OpenAIError as err:
            return error_response(err)
        if not deleted:
            return error_response(responses.not_found(response_id))
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def transcriptions(self, request: Request) -> Response:
        return await self._handle(request, lambda body, arrival: self._audio_text(body, arrival, "transcribe"),
                                  read=_form_body)

    async def translations(self, request: Request) -> Response:
        return await self._handle(request, lambda body, arrival: self._audio_text(body, arrival, "translate"),
                                  read=_form_body)

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, self._chat_completions)

    async def load_lora_adapter(self, request: Request) -> Response:
        return await self._handle(request, self._load_lora_adapter, generation=False)

    async def unload_lora_adapter(self, request: Request) -> Response:
        return await self._handle(request, self._unload_lora_adapter, generation=False)

    async def _load_lora_adapter(self, body: Any, arrival: float) -> Response:
        """vLLM's runtime LoRA loading: the adapter at ``lora_path`` served as ``lora_name`` from now on (its
        folder, config and rank checked here; its modules when a request first names it)."""
        req = proto.parse_request(proto.LoadLoRAAdapterRequest, body)
        config = self.config
        name = req.lora_name
        if name in (*self._base_names(), *(a.lora_name for a in config.lora_modules)):
            raise proto.bad_request(f"lora_name {name!r} is already served (a model name or a --lora-modules "
                                    "adapter); choose another", "lora_name")
        try:
            await self._off_loop(lambda: read_adapter(req.lora_path, None, config.max_lora_rank))
        except ValueError as err:
            raise proto.bad_request(str(err), "lora_path") from None
        if not await self.runtime_adapters.load(name, req.lora_path, config.served_model_name, req.load_inplace):
            raise proto.bad_request(f"The lora adapter {name!r} has already been loaded; unload it first, or send "
                                    "load_inplace: true to replace it", "lora_name")
        self._runtime_seen.add(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_lora_adapter(self, body: Any, arrival: float) -> Response:
        """vLLM's runtime LoRA unloading: later requests naming it get a 404; running ones finish with it."""
        req = proto.parse_request(proto.UnloadLoRAAdapterRequest, body)
        if not await self.runtime_adapters.unload(req.lora_name):
            raise proto.OpenAIError(404, f"The lora adapter {req.lora_name!r} cannot be found (only adapters loaded "
                                         "through /v1/load_lora_adapter can be unloaded)", "NotFoundError",
                                    "lora_name", "lora_not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def tokenize(self, request: Request) -> Response:
        return await self._handle(request, self._tokenize, generation=False)

    async def detokenize(self, request: Request) -> Response:
        return await self._handle(request, self._detokenize, generation=False)

    async def models(self) -> dict:
        cards = [self._model_card(name, await self._adapter(name)) for name in await self._names()]
        return proto.ModelList(data=cards).model_dump(exclude_none=True)

    async def model(self, model_id: str) -> Response:
        """OpenAI's retrieve-model route: the served model's card, or a 404 in OpenAI's shape."""
        try:
            lora = await self._resolve_model(model_id)
        except proto.OpenAIError as err:
            return error_response(err)
        return JSONResponse(self._model_card(model_id, lora).model_dump(exclude_none=True))

    def _base_names(self) -> tuple[str, ...]:
        """The names the base model is served under (vLLM's several --served-model-name), the first the main one."""
        return (self.config.served_model_name, *self.config.model_aliases)

    async def _names(self) -> tuple[str, ...]:
        """Every name the model is served under (vLLM's several --served-model-name), the first the main one,
        then the adapters' (--lora-modules, then those of the adapter folder, as they are now)."""
        config = self.config
        dynamic = ()
        if config.lora_dir is not None:
            folder = Path(config.lora_dir)
            found = sorted(p.name for p in folder.iterdir() if ADAPTER_NAME.fullmatch(p.name) and
                           (p / ADAPTER_CONFIG).is_file()) if folder.is_dir() else []
            dynamic = tuple(f"{config.served_model_name}:{name}" for name in found)
        runtime = await self.runtime_adapters.names() if config.runtime_lora_updating else ()
        return (*self._base_names(), *(a.lora_name for a in config.lora_modules), *runtime, *dynamic)

    def _model_card(self, name: str, lora: LoRARequest | None = None) -> proto.ModelCard:
        return proto.ModelCard(id=name, created=proto.now(), max_model_len=self.client.max_model_len,
                               root=None if lora is None else lora.lora_path,
                               parent=None if lora is None else lora.base_model_name)

    async def _adapter(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model): one of --lora-modules, or
        "<model>:<adapter>" with an adapter folder of that name in ``lora_dir``."""
        config = self.config
        named = next((a for a in config.lora_modules if a.lora_name == name), None)
        if named is None and name is not None and config.runtime_lora_updating:
            named = await self.runtime_adapters.get(name)
        if named is not None or config.lora_dir is None or name is None:
            return named
        base, _, adapter = name.partition(":")
        if base not in self._base_names() or not ADAPTER_NAME.fullmatch(adapter):
            return None
        folder = Path(config.lora_dir) / adapter
        if not (folder / ADAPTER_CONFIG).is_file():
            return None
        return LoRARequest(name, dynamic_lora_id(adapter), str(folder), config.served_model_name)

    def _logprob_format(self, req) -> proto.LogprobFormatter:
        """How the request's logprobs name tokens: by their text, or "token_id:<id>" (vLLM's
        return_tokens_as_token_ids, the request's or the server's)."""
        as_ids = req.return_tokens_as_token_ids
        return self.logprob_ids_fmt if (self.config.return_tokens_as_token_ids if as_ids is None else as_ids) \
            else self.logprob_fmt

    def _response_model(self, lora: LoRARequest | None) -> str:
        """The ``model`` a response carries: the adapter's name for a request that ran with one (vLLM's)."""
        return self.config.served_model_name if lora is None else lora.lora_name

    async def version(self) -> dict:
        """vLLM's ``GET /version``: the server's version."""
        from specray import __version__

        return {"version": __version__}

    async def health(self) -> Response:
        if self._stopping:
            return error_response(_shutting_down())
        if await self.client.is_healthy():
            return JSONResponse({"status": "ok"})
        return error_response(proto.OpenAIError(503, self.client.down_reason(), "server_error",
                                                code="engine_unavailable"))

    async def prometheus(self) -> Response:
        engine_text = b""
        try:
            unloaded = await self._unloaded_adapters()
            if self.metrics.has_engine_metrics:
                self.metrics.record_engine_state(await self.client.engine_state(), unloaded)
            engine_text = await self.client.engine_metrics(unloaded)
        except EngineError as err:  # still serve the counters; /health reports the dead engine
            logger.warning("metrics without fresh engine state: %s", err)
        return Response(self.metrics.render() + engine_text, media_type=self.metrics.content_type)

    async def shut_down(self, timeout: float) -> int:
        """The server is going away (``specray serve`` got Ctrl-C): end every request that is generating with a
        503 (an open stream with an error event, then ``[DONE]``), refuse new ones the same way, and wait up to
        ``timeout`` seconds for their handlers to have answered. Returns how many requests it ended."""
        self._stopping = True
        ended = list(self._fanouts)
        for fanout in ended:
            fanout.fail(_shutting_down())
        deadline = time.monotonic() + timeout
        while self._fanouts and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._fanouts:
            logger.warning("%d requests had not answered %.1f s after the server began to shut down",
                           len(self._fanouts), timeout)
        return len(ended)

    async def _unloaded_adapters(self) -> set[str]:
        """The adapters loaded at runtime (seen loaded here) that are unloaded now, through any replica when they
        share them: the metrics drop their series."""
        if not self.config.runtime_lora_updating:
            return set()
        loaded = set(await self.runtime_adapters.names())
        self._runtime_seen |= loaded
        return self._runtime_seen - loaded

    async def debug_kv(self) -> Response:
        try:
            state = await self.client.engine_state()
        except EngineError as err:  # a 503 while the engine replica is down, as the other routes answer
            return error_response(to_openai_error(err))
        return JSONResponse({**state, "num_queued": self.num_queued})

    # ---- request handling ------------------------------------------------------------------------------
    async def _handle(self, request: Request, endpoint, read=None, generation: bool = True) -> Response:
        """``endpoint(body, arrival)``'s response, or its error in OpenAI's JSON; a generation route's outcome is
        counted in ``specray_requests_total`` (``generation=False``: /tokenize, /detokenize, LoRA loading)."""
        arrival = time.monotonic()
        record = self.metrics.record_request if generation else (lambda status: None)
        try:
            body = await (read or _json_body)(request, self.config.max_request_body_bytes)
            response = await endpoint(body, arrival)
        except asyncio.CancelledError:
            record("cancelled")
            raise
        except Exception as exc:
            err = to_openai_error(exc)
            record(str(err.status))
            return error_response(err)
        if not isinstance(response, StreamingResponse):  # a stream records its own outcome when it ends
            record("200")
        return response

    async def _completions(self, body: Any, arrival: float) -> Response:
        req = proto.parse_request(proto.CompletionRequest, body)
        lora = await self._resolve_model(req.model)
        self._check_request_size(req, len(req.prompts()), req.max_tokens, "max_tokens")
        prompts = await self._off_loop(lambda: [self._encode_completion_prompt(p, req.add_special_tokens)
                                                for p in req.prompts()])
        prompts = [_truncated(p, req.truncate_prompt_tokens) for p in prompts]
        for prompt in prompts:
            proto.check_context(len(prompt.token_ids), req.max_tokens, self.client.max_model_len, "max_tokens")
        request_id = proto.new_id("cmpl")
        choices = self._choices(req, prompts, req.max_tokens, req.logprobs, request_id, lora=lora)
        fmt = _CompletionFormat(_response_id(req, request_id, "cmpl"), self._response_model(lora),
                                self._logprob_format(req), req.logprobs, req.prompt_logprobs,
                                return_token_ids=req.return_token_ids, echo=req.echo)
        return await self._run(req, choices, fmt, arrival)

    async def _chat_completions(self, body: Any, arrival: float, responses_req=None, on_response=None) -> Response:
        """A chat completion; or, with ``responses_req`` (``body`` its chat request), a Responses API answer."""
        req = proto.parse_request(proto.ChatCompletionRequest, body)
        lora = await self._resolve_model(req.model)
        tools = self._tool_output(req)
        # a tool-call parser's or a reasoning parser's tags may be special tokens: kept in the text for the parser
        if (tools is not None and tools.mode == "auto" and TOOL_CALL_PARSERS[tools.parser].keeps_special_tokens) or (
                self.keep_reasoning_tags and "skip_special_tokens" not in req.model_fields_set):
            req = req.model_copy(update={"skip_special_tokens": False})
        limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        self._check_request_size(req, 1, req.output_limit(), limit_param)
        prompt = _truncated(await self._off_loop(lambda: self._encode_chat_prompt(req, req.add_special_tokens)),
                            req.truncate_prompt_tokens)
        proto.check_context(len(prompt.token_ids), req.output_limit(), self.client.max_model_len, limit_param,
                            "messages")
        prediction = None
        if req.prediction is not None and self.config.drafts_predictions:  # else the engine would drop it
            prediction = await self._off_loop(lambda: self._encode_prediction(req.prediction.text()))
        request_id = proto.new_id("chatcmpl" if responses_req is None else "resp")
        choices = self._choices(req, [prompt], req.output_limit(), req.num_logprobs(), request_id, prediction, lora)
        kind, extra = (_ChatFormat, {}) if responses_req is None else (
            _ResponsesFormat, {"request": responses_req, "on_response": on_response})
        response_id = request_id if responses_req is not None else _response_id(req, request_id, "chatcmpl")
        fmt = kind(response_id, self._response_model(lora), self._logprob_format(req), req.num_logprobs(),
                   req.prompt_logprobs, return_token_ids=req.return_token_ids,
                   reasoning_parser=self.config.reasoning_parser, tools=tools, **extra)
        return await self._run(req, choices, fmt, arrival, "messages")

    async def _audio_text(self, body: tuple[bytes, str | None], arrival: float, task: str) -> Response:
        """OpenAI's audio transcription (``task`` "transcribe") or translation into English ("translate") of the
        form's audio file: a greedy-by-default generation from the model's transcription prompt with the audio in
        it, answered as ``{"text": ..., "usage": ...}`` or as the text alone (``response_format`` "text"), or
        streamed as OpenAI's ``transcript.text.*`` events. An audio longer than the model takes in one prompt (its
        processor's ``max_audio_samples``) is cut into clips (:func:`~specray.multimodal.audio_clips`), each a
        generation of its own, run as a request's choices are (``max_seats_per_request`` at once); their texts
        join in order, and the usage counts them all. ``verbose_json`` adds the clips as timed segments
        (:class:`_Segments`), ``srt`` and ``vtt`` write them as subtitle cues (:func:`subtitles`)."""
        form, audio = proto.parse_audio_form(*body, task)
        lora = await self._resolve_model(form.model)
        prompts, spans = await self._off_loop(lambda: self._encode_audio_prompts(form, audio, task))
        longest = max(len(p.token_ids) for p in prompts)
        proto.check_context(longest, None, self.client.max_model_len, "file", "file")
        limit = self.client.max_model_len - longest
        cap = self.config.max_tokens_per_request
        if cap is not None:  # the request's whole output, shared by its clips
            if cap < len(prompts):
                raise proto.bad_request(
                    f"the audio is cut into {len(prompts)} clips, each the longest this model takes, and this server "
                    f"allows {cap} output tokens per request (max_tokens_per_request), fewer than one a clip; send "
                    "a shorter audio", "file")
            limit = min(limit, cap // len(prompts))
        # the sampling fields a chat request would carry (its messages unused: the prompt is the audio's)
        verbose = form.response_format in proto.SEGMENT_FORMATS
        req = proto.parse_request(proto.ChatCompletionRequest, {
            "messages": [{"role": "user", "content": ""}], "temperature": form.temperature, "max_tokens": limit,
            "stream": form.stream})
        request_id = proto.new_id("trsc")
        # (segments: each token's log-probability, for their avg_logprob)
        choices = self._choices(req, prompts, limit, 0 if verbose else None, request_id, lora=lora)
        transcript = getattr(getattr(self.client, "image_processor", None), "transcription_text", None)
        segments = None if not verbose else _Segments(
            task, "en" if task == "translate" else form.language, spans[-1][1] if spans else 0.0, spans,
            form.temperature)
        fmt = _AudioTextFormat(request_id, self._response_model(lora), self._logprob_format(req), None,
                               transcript=transcript, segments=segments)
        response = await self._run(req, choices, fmt, arrival, "file")
        if form.stream or form.response_format in ("json", "verbose_json"):
            return response
        answer = json.loads(response.body)
        return PlainTextResponse(answer["text"] if form.response_format == "text"
                                 else subtitles(answer, form.response_format))

    def _encode_audio_prompts(self, form: proto.TranscriptionRequest, audio: bytes, task: str
                              ) -> tuple[list[_Prompt], list[tuple[float, float]]]:
        """The prompts of an audio request, one per clip of the audio (one clip where the model takes it whole), and
        each clip's start and end in the audio (seconds). A prompt is the processor's own (``transcription_prompt``:
        Voxtral's), or the chat template's rendering of the processor's chat (``transcription_messages``: Qwen3-ASR's,
        its last turn, the assistant's, continued; OmniASR's, Fun-ASR-Nano's) or of a user turn holding the audio and
        the task's instruction (the processor's ``transcription_instruction`` where it names one), the clip in its
        placeholder. Clips are halved, down to a second, while a clip's prompt would take more than half the context."""
        processor = getattr(self.client, "image_processor", None)
        if processor is None or getattr(processor, "audio_token_id", None) is None:
            raise proto.bad_request("this model reads no audio: send audio to a model that takes it (the README's "
                                    "rows \"with audio\")", "file")
        try:
            wave = load_audio(audio, processor.sampling_rate)
        except ValueError as err:
            raise proto.bad_request(f"file: {err}", "file") from None
        tokenizer = self.client.tokenizer
        own = getattr(processor, "transcription_prompt", None)
        if own is not None:
            text = own(task, form.language, form.prompt)
        else:
            template = self.config.chat_template
            if template is None and not getattr(tokenizer, "chat_template", None):
                raise proto.bad_request("this model's tokenizer has no chat template to write a transcription "
                                        "prompt with; start the server with --chat-template FILE", "file")
            chat = getattr(processor, "transcription_messages", None)
            if chat is not None:
                try:
                    messages = chat(task, form.language, form.prompt)
                except ValueError as err:
                    raise proto.bad_request(str(err), "language" if task == "transcribe" else None) from None
            else:
                instruction = audio_instruction(processor, task, form.language, form.prompt)
                messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": instruction}]}]
            answer_begun = messages[-1]["role"] == "assistant"  # (continued: Qwen3-ASR's forced language)
            with _user_text_errors("prompt"):
                text = render_chat(tokenizer, messages, not answer_begun, answer_begun, chat_template=template)
        with _user_text_errors("prompt"):
            ids = tokenizer.encode(text, add_special_tokens=False)
        rate, most = processor.sampling_rate, getattr(processor, "max_audio_samples", None)
        while True:
            clips = [wave] if most is None else audio_clips(wave, most, rate)
            prompts = []
            for clip in clips:
                try:
                    clip_ids, mm = expand_prompt(ids, [], processor, [], [clip])
                except ValueError as err:
                    raise proto.bad_request(f"file: {err}", "file") from None
                prompts.append(_Prompt(text, clip_ids, multimodal=mm))
            # a clip's prompt leaves at least half the context to its text (clips half as long where one at the
            # model's bound would not: Voxtral's fills its context), down to clips of a second
            longest = max(len(c) for c in clips)
            if 2 * max(len(p.token_ids) for p in prompts) <= self.client.max_model_len or longest <= rate:
                ends = list(itertools.accumulate(len(c) for c in clips))
                return prompts, [(a / rate, b / rate) for a, b in zip([0, *ends[:-1]], ends)]
            most = max(rate, longest // 2)

    async def _responses(self, body: Any, arrival: float) -> Response:
        """OpenAI's Responses API: the request as a chat completion (:mod:`specray.cluster.openai_responses`)."""
        req = responses.parse(body)
        store = self.response_store
        items = responses.input_items(req)
        prior = 0
        if req.previous_response_id is not None:  # that conversation (its input and output items), then this input
            if store is None:
                raise proto.bad_request("previous_response_id needs stored responses, and this server keeps none "
                                        "(max_stored_responses 0: start it with --max-stored-responses N); send "
                                        "the conversation so far in input instead",
                                        "previous_response_id")
            entry = await store.get(req.previous_response_id)
            if entry is None:
                raise responses.not_found(req.previous_response_id, "previous_response_id")
            items, prior = entry[0] + items, len(entry[0])
            req = req.model_copy(update={"input": items})
        keep = None
        if store is not None and req.store is not False:
            async def keep(response: dict) -> None:  # the finished response (whole, or its stream's last event)
                await store.put(response["id"], items + response["output"], response)
        try:
            return await self._chat_completions(responses.chat_body(req, prior), arrival, responses_req=req,
                                                on_response=keep)
        except proto.OpenAIError as err:
            raise responses.in_responses_terms(err) from None

    def _tool_output(self, req: proto.ChatCompletionRequest) -> _ToolOutput | None:
        """How the request's tool calls come out (None: it makes none); "auto" needs the server's tool call
        parser, a 400 saying how to start the server otherwise."""
        mode = req.tool_mode()
        if mode == "none":
            return None
        if mode == "named":
            return _ToolOutput("named", name=req.named_function()[1].name)
        if mode == "required":
            return _ToolOutput("required")
        config = self.config
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            default = " (the default when tools are given)" if req.tool_choice is None else ""
            raise proto.bad_request(
                f"tool_choice='auto'{default} needs the server started with --enable-auto-tool-choice "
                f"--tool-call-parser NAME (NAME: {' or '.join(TOOL_CALL_PARSERS)}, the format the model writes its "
                "calls in; in a Serve config, enable_auto_tool_choice: true and tool_call_parser: NAME); or send "
                "tool_choice 'required', a named function {'type': 'function', 'function': {'name': ...}}, or 'none'",
                "tool_choice")
        schemas = {tool.function.name: tool.function.parameters or {} for tool in req.tools or []}
        return _ToolOutput("auto", parser=config.tool_call_parser, schemas=schemas,
                           single_call=req.parallel_tool_calls is False)

    async def _tokenize(self, body: Any, arrival: float) -> Response:
        """vLLM's /tokenize: the token ids the engine would get for a prompt or a chat, their count and the
        context length."""
        req = proto.parse_request(proto.TokenizeRequest, body)
        await self._resolve_model(req.model)
        tokenizer = self.client.tokenizer

        def encode() -> list[int]:
            if req.messages is not None:
                return self._encode_chat_prompt(req).token_ids
            with _user_text_errors("prompt"):
                return list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))

        tokens = await self._off_loop(encode)
        return JSONResponse({"count": len(tokens), "max_model_len": self.client.max_model_len, "tokens": tokens})

    async def _detokenize(self, body: Any, arrival: float) -> Response:
        """vLLM's /detokenize: the text of token ids of this model's vocabulary."""
        req = proto.parse_request(proto.DetokenizeRequest, body)
        await self._resolve_model(req.model)
        tokenizer = self.client.tokenizer
        vocab = len(tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise proto.bad_request(f"tokens contains {bad[:5]} outside the vocabulary [0, {vocab})", "tokens")
        text = await self._off_loop(lambda: tokenizer.decode(req.tokens))
        return JSONResponse({"prompt": text})

    async def _resolve_model(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names, None for the base model (or no name); a 404 for a name this
        server does not serve."""
        if name is None or name in self._base_names():
            return None
        lora = await self._adapter(name)
        if lora is None:
            raise proto.model_not_found(name, self.config.served_model_name)
        return lora

    async def _off_loop(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn)

    def _check_request_size(self, req, num_prompts: int, max_tokens: int | None, limit_param: str) -> None:
        """400 when one request asks for more than one client may hold (ServerConfig's per-request caps)."""
        config = self.config
        if req.n > config.max_n:
            raise proto.bad_request(f"n={req.n} is more than this server allows per request ({config.max_n}); "
                                    "send several requests or lower n", "n")
        cap = config.max_tokens_per_request
        default = config.default_sampling.get("max_tokens", self.client.max_model_len)
        total = req.n * num_prompts * (max_tokens if max_tokens is not None else default)
        if cap is not None and total > cap:
            per_choice = f"{limit_param}'s default, {default}" if max_tokens is None else limit_param
            raise proto.bad_request(
                f"this request may generate {total} tokens (n={req.n} x {num_prompts} prompt(s) x {per_choice}); "
                f"this server allows {cap} per request (max_tokens_per_request): lower n or {limit_param}",
                limit_param)

    def _check_prompt_chars(self, text: str, param: str) -> None:
        """A prompt so long that it cannot fit even at the longest tokens is refused before it is tokenized."""
        if len(text) > self.max_prompt_chars:
            raise proto.bad_request(
                f"This model's maximum context length is {self.client.max_model_len} tokens, but the prompt has "
                f"{len(text)} characters, more than that many tokens can hold; shorten the prompt", param,
                "context_length_exceeded")

    def _encode_completion_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> _Prompt:
        if isinstance(prompt, str):
            self._check_prompt_chars(prompt, "prompt")
            with _user_text_errors("prompt"):
                encoded = _Prompt(prompt, self.client.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        else:
            encoded = _Prompt(None, list(prompt))
        self._check_no_placeholders(encoded.token_ids, "prompt")
        return encoded

    def _check_no_placeholders(self, token_ids: list[int], param: str) -> None:
        """A 400 for a prompt sent without images (videos, audios) that holds their placeholders."""
        processor = getattr(self.client, "image_processor", None)
        if processor is not None:
            try:
                check_placeholders(token_ids, processor)
            except ValueError as err:
                raise proto.bad_request(f"{param}: {err}", param) from None

    def _encode_chat_prompt(self, req: proto.ChatCompletionRequest | proto.TokenizeRequest,
                            add_special_tokens: bool = False) -> _Prompt:
        """The chat's rendered text and its tokens (the tokenizer's special tokens added only with
        ``add_special_tokens``: the template writes its own)."""
        tokenizer = self.client.tokenizer
        template = self._request_template(req) or self.config.chat_template
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise proto.bad_request("this model's tokenizer has no chat template; use /v1/completions instead, or "
                                    "start the server with --chat-template FILE", "messages")
        try:
            messages, media = split_media([m.as_template_dict() for m in req.messages])
        except ValueError as err:  # a media part without its data or URL: it names the part
            raise proto.bad_request(str(err), "messages") from None
        processor = getattr(self.client, "image_processor", None)
        if any(media.values()) and processor is None:
            raise proto.bad_request(TEXT_ONLY, "messages")
        with _user_text_errors("messages"):
            text = render_chat(tokenizer, messages, req.add_generation_prompt,
                               req.continue_final_message, chat_template=template,
                               chat_template_kwargs=_template_kwargs(req), tools=proto.template_tools(req.tools),
                               documents=getattr(req, "documents", None))
        self._check_prompt_chars(text, "messages")
        with _user_text_errors("messages"):
            ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not any(media.values()):
            self._check_no_placeholders(ids, "messages")
            return _Prompt(text, ids)
        try:
            domains = self.config.allowed_media_domains
            rate = getattr(processor, "sampling_rate", None)  # (none: expand_prompt refuses audio by name)
            images = [load_image(url, local=False, domains=domains) for url in media["image"]]
            frames = video_frames(processor)
            videos = [load_video(url, local=False, domains=domains, num_frames=frames) for url in media["video"]]
            audios = [url if rate is None else load_audio(url, rate, local=False, domains=domains)
                      for url in media["audio"]]
            ids, mm = expand_prompt(ids, images, processor, videos, audios)
        except ValueError as err:
            raise proto.bad_request(f"messages: {err}", "messages") from None
        return _Prompt(text, ids, multimodal=mm)

    def _request_template(self, req) -> str | None:
        """A request's own chat_template (vLLM's): refused unless the server trusts requests' templates."""
        template = getattr(req, "chat_template", None)
        if template is None:
            return None
        if not self.config.trust_request_chat_template:
            raise proto.bad_request("chat_template in a request is refused by this server: start it with "
                                    "--trust-request-chat-template to render requests with their own templates "
                                    "(vLLM's flag), or omit it", "chat_template")
        try:
            return check_template_text(template)
        except ValueError as err:
            raise proto.bad_request(str(err), "chat_template") from None

    def _encode_prediction(self, text: str) -> list[int]:
        with _user_text_errors("prediction"):
            return list(self.client.tokenizer.encode(text, add_special_tokens=False))

    def _choices(self, req, prompts: list[_Prompt], max_tokens: int | None, logprobs: int | None,
                 request_id: str, prediction: list[int] | None = None, lora: LoRARequest | None = None
                 ) -> list[_Choice]:
        """One engine request per prompt and choice. ``max_tokens`` None: the model's default max_tokens (its
        generation config's max_new_tokens) where it has one, cut to what the prompt's context leaves."""
        choices = []
        defaults = self.config.default_sampling
        method = req.speculative.method if req.speculative is not None else None
        predicted = prediction is not None and method in (None, PREDICTION)
        for p, prompt in enumerate(prompts):
            limit = max_tokens
            if limit is None and "max_tokens" in defaults:
                limit = min(defaults["max_tokens"], self.client.max_model_len - len(prompt.token_ids))
            for i in range(req.n):
                index = p * req.n + i
                params = proto.sampling_params(req, limit, logprobs, i, defaults, prediction)
                if lora is not None:
                    params.lora_request = lora
                choices.append(_Choice(index, prompt, params, f"{request_id}-{index}", predicted=predicted))
        return choices

    async def _run(self, req, choices: list[_Choice], fmt: _Format, arrival: float,
                   prompt_param: str = "prompt") -> Response:
        """The request's choices through the engine, answered in ``fmt``; an engine's refusal of its input names
        ``prompt_param``, the request's field that gave the prompt (a chat's ``messages``)."""
        seats = min(len(choices), self.config.max_seats_per_request or len(choices))
        if self._stopping:
            raise _shutting_down()
        self._admit(seats)
        fanout = _Fanout(self.client, choices, arrival, self.metrics, self._queue_changed, seats, self._fanouts)
        try:
            first = await fanout.next()  # errors before any output (bad input) become a plain error response
        except BaseException as exc:
            fanout.close()
            if isinstance(exc, ValueError):  # refused at admission (a regex or schema the engine cannot compile)
                raise to_openai_error(self._as_client_sees(exc), req.structured_outputs_param(),
                                      prompt_param) from None
            raise
        if req.stream:
            body = self._stream(fanout, choices, fmt, first, req.include_usage, req.continuous_usage)
            return _ClosingStreamingResponse(body, on_close=fanout.close)
        try:
            while first is not None:
                first = await fanout.next()
        except ValueError as exc:  # its own constraints cannot be met (RequestRefusedError)
            raise to_openai_error(self._as_client_sees(exc), req.structured_outputs_param(), prompt_param) from None
        finally:
            fanout.close()
        body = fmt.response(choices, _usage(choices))
        await fmt.flush()
        return JSONResponse(body)

    def _as_client_sees(self, err: ValueError) -> ValueError:
        """A refusal as its client reads it: an adapter of the adapter folder (``lora_dir``) named by its name there,
        not by the server's path to it (the log keeps the path)."""
        if self.config.lora_dir is None:
            return err
        folder, message = str(Path(self.config.lora_dir)), str(err)
        if folder not in message:
            return err
        logger.info("refused a request: %s", message)
        return ValueError(message.replace(folder + "/", "").replace(folder, "the adapter folder"))

    def _admit(self, num_requests: int) -> None:
        """Count a request's first engine requests as queued, or 503 when they would not fit the queue (the
        first request into an empty queue is always admitted, however many seats it takes)."""
        limit = self.config.max_queue_len
        if limit is not None and (limit == 0 or (self.num_queued and self.num_queued + num_requests > limit)):
            raise proto.queue_full(limit)
        self.num_queued += num_requests

    def _queue_changed(self, delta: int) -> None:
        self.num_queued += delta

    async def _stream(self, fanout: _Fanout, choices: list[_Choice], fmt, first: _Choice | None,
                      include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
        status = "200"
        try:
            for payload in fmt.stream_opening(choices, continuous_usage):
                yield fmt.sse(payload)
            choice = first
            while choice is not None:
                for payload in fmt.stream_chunk(choice, continuous_usage):
                    yield fmt.sse(payload)
                choice = await fanout.next()
            closing = fmt.stream_closing(choices, include_usage)
            await fmt.flush()
            for payload in closing:
                yield fmt.sse(payload)
            if fmt.done:
                yield fmt.done
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        except Exception as exc:  # the headers are sent: report the error in the stream, OpenAI style
            err = to_openai_error(exc)
            status = str(err.status)
            for payload in fmt.stream_error(err):
                yield fmt.sse(payload)
            if fmt.done:
                yield fmt.done
        finally:
            fanout.close()
            self.metrics.record_request(status)


def _response_id(req, request_id: str, kind: str) -> str:
    """The response's id: vLLM's ``<kind>-<request_id>`` when the request names one, else the engine's own
    (unique) id, which its choices' engine requests are named after either way."""
    return f"{kind}-{req.request_id}" if req.request_id is not None else request_id


def _template_kwargs(req) -> dict[str, Any] | None:
    """A chat request's variables for the chat template (a /tokenize request's are its chat_template_kwargs)."""
    own = getattr(req, "template_kwargs", None)
    return own() if own is not None else req.chat_template_kwargs


def _truncated(prompt: _Prompt, keep: int | None) -> _Prompt:
    """vLLM's truncate_prompt_tokens: the prompt's last ``keep`` tokens (its text then comes from them)."""
    if keep is None or len(prompt.token_ids) <= keep:
        return prompt
    if prompt.multimodal is not None:
        raise proto.bad_request(f"truncate_prompt_tokens={keep} would cut a prompt with images, videos or audio (of "
                                f"{len(prompt.token_ids)} tokens): it could cut their tokens; leave it unset",
                                "truncate_prompt_tokens")
    return _Prompt(None, prompt.token_ids[-keep:])


# ---- errors --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _user_text_errors(param: str):
    """The chat template and the tokenizer fail on what the client sent (a template's own ``raise_exception``,
    text a tokenizer cannot encode): a 400 naming ``param``, not a 500."""
    try:
        yield
    except (TemplateError, ValueError, TypeError, UnicodeError) as err:
        logger.info("rejected %s: %r", param, err)
        raise proto.bad_request(f"{param} could not be tokenized: {err}; check the text and the roles",
                                param) from None


# Exception types that mean the client went away mid-request (the hosting layer names its own: Ray Serve's
# cancellation); such a request is logged as a departure, not as an unexpected error.
_CLIENT_GONE: tuple[type[BaseException], ...] = ()


def register_client_gone(*types: type[BaseException]) -> None:
    global _CLIENT_GONE
    _CLIENT_GONE = tuple(dict.fromkeys(_CLIENT_GONE + types))


def to_openai_error(exc: BaseException, structured_param: str | None = None,
                    prompt_param: str = "prompt") -> proto.OpenAIError:
    """``exc`` in OpenAI's terms; an engine's refusal of a request's structured outputs names
    ``structured_param``, the request's own field for them (see :func:`proto.from_value_error`), and one of its
    input names ``prompt_param`` unless it names a field itself."""
    if isinstance(exc, proto.OpenAIError):
        return exc
    if isinstance(exc, _CLIENT_GONE):
        logger.info("the client left before its response ended (%s)", type(exc).__name__)
        return proto.OpenAIError(499, "the client closed the request", "invalid_request_error", None,
                                 "client_closed_request")
    if isinstance(exc, ValidationError):
        return proto.from_validation_error(exc)
    if isinstance(exc, ValueError):  # the engine rejected the request's input
        return proto.from_value_error(exc, prompt_param, structured_param)
    if isinstance(exc, EngineUnavailableError):
        return proto.OpenAIError(503, str(exc), "server_error", None, "engine_unavailable")
    if isinstance(exc, WorkerDiedError) or isinstance(getattr(exc, "cause", None), WorkerDiedError):
        logger.warning("engine error: %s", exc)  # the engine restarts its workers: a 503 that clients retry
        return proto.OpenAIError(503, f"a worker of the engine died while serving this request ({exc}); the engine "
                                 "restarts its workers: retry it", "server_error", None, "engine_unavailable")
    if isinstance(exc, EngineError):
        logger.warning("engine error: %s", exc)
        return proto.server_error(f"the engine failed this request: {exc}; retry it")
    logger.error("unexpected error while serving a request", exc_info=exc)
    return proto.server_error(f"internal server error: {exc!r}")


def _shutting_down() -> proto.OpenAIError:
    return proto.OpenAIError(503, "the server is shutting down; retry on another server or later", "server_error",
                             code="server_shutting_down")


def error_response(err: proto.OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def max_token_chars(tokenizer) -> int:
    """The most characters one token can stand for: the longest vocabulary entry (byte-level and SentencePiece
    vocabularies spell a token with at least one character per character it decodes to)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return _FALLBACK_MAX_TOKEN_CHARS
    return max((len(token) for token in get_vocab()), default=_FALLBACK_MAX_TOKEN_CHARS)


async def _read_body(request: Request, limit: int | None) -> bytes:
    """The body, or 413 as soon as it is known to exceed ``limit`` (from Content-Length, else while reading)."""
    if limit is None:
        return await request.body()
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise proto.body_too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise proto.body_too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


# how deeply a request body's arrays and objects may nest: far past any real request (a JSON schema of a few dozen
# levels), and well inside what the JSON parser, the grammar compiler and Ray's pickling of the request can take
MAX_JSON_DEPTH = 128


async def _json_body(request: Request, limit: int | None) -> Any:
    raw = await _read_body(request, limit)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise proto.bad_request(f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise _too_deep() from None
    _check_depth(body)
    return body


async def _form_body(request: Request, limit: int | None) -> tuple[bytes, str | None]:
    """A form's raw body (within ``limit``: a 413 past it) and its content type, for the audio endpoints."""
    return await _read_body(request, limit), request.headers.get("content-type")


def _too_deep() -> proto.OpenAIError:
    return proto.bad_request(f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep; "
                             "flatten it (a JSON schema can name repeated parts with $defs and $ref)")


def _check_depth(body: Any) -> None:
    """400 if ``body``'s arrays and objects nest more than ``MAX_JSON_DEPTH`` deep (walked without recursion)."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth >= MAX_JSON_DEPTH:
                    raise _too_deep()
                stack.append((child, depth + 1))


def _install_error_handlers(app: FastAPI) -> None:
    async def on_validation(_request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return error_response(proto.bad_request(f"{param}: {first['msg']}", param))

    async def on_http(_request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(proto.OpenAIError(exc.status_code, str(exc.detail), kind))

    async def on_unexpected(_request: Request, exc: Exception) -> Response:
        return error_response(to_openai_error(exc))

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)


class _ApiKeyMiddleware:
    """ASGI middleware: a 401 in OpenAI's shape unless the request carries ``Authorization: Bearer <key>``
    (paths in ``open_paths`` excepted, so a load balancer can probe health without the key). Plain ASGI rather
    than Starlette's BaseHTTPMiddleware, which would sit between a streaming response and the client."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str]):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self._open_paths and not self._authorized(scope):
            await error_response(proto.invalid_api_key())(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(given, self._expected)


def build_openai_app(client: EngineClient, config: ServerConfig, metrics: ServerMetrics | None = None,
                     response_store=None, runtime_adapters=None) -> FastAPI:
    """The FastAPI app serving ``client`` under OpenAI's routes (see the module docstring). ``response_store``: the
    Responses API's stored responses when several replicas share them (default: this replica's own, sized by
    ``config.max_stored_responses``); ``runtime_adapters``: the adapters loaded at runtime when several replicas
    share them (default: this replica's own :class:`RuntimeAdapters`)."""
    serving = OpenAIServing(client, config, metrics or ServerMetrics(config.served_model_name), response_store,
                            runtime_adapters)
    app = FastAPI(title="specray", description="OpenAI-compatible LLM server with speculative decoding")
    app.state.serving = serving
    _install_error_handlers(app)
    app.add_api_route("/v1/completions", serving.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", serving.chat_completions, methods=["POST"])
    app.add_api_route("/v1/responses", serving.responses, methods=["POST"])
    app.add_api_route("/v1/audio/transcriptions", serving.transcriptions, methods=["POST"])
    app.add_api_route("/v1/audio/translations", serving.translations, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", serving.get_response, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", serving.delete_response, methods=["DELETE"])
    app.add_api_route("/v1/models", serving.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", serving.model, methods=["GET"])  # ids may hold "/"
    app.add_api_route("/tokenize", serving.tokenize, methods=["POST"])  # vLLM's paths
    app.add_api_route("/detokenize", serving.detokenize, methods=["POST"])
    app.add_api_route("/health", serving.health, methods=["GET"])
    app.add_api_route("/version", serving.version, methods=["GET"])
    app.add_api_route("/metrics", serving.prometheus, methods=["GET"])
    if config.enable_debug_routes:
        app.add_api_route("/v1/debug/kv", serving.debug_kv, methods=["GET"])
    if config.runtime_lora_updating:
        app.add_api_route("/v1/load_lora_adapter", serving.load_lora_adapter, methods=["POST"])
        app.add_api_route("/v1/unload_lora_adapter", serving.unload_lora_adapter, methods=["POST"])
    if config.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=config.api_key, open_paths=frozenset({"/health"}))
    if config.allowed_origins:  # added last: outermost, so a browser's preflight needs no key
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app
