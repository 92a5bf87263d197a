"""OpenAI's Responses API (``POST /v1/responses``) over the chat machinery: a request becomes a chat completion
request (its ``input`` items messages, ``instructions`` a system message, ``text.format`` a response format,
flat function tools chat tools), and a chat choice's message becomes the response's output items (reasoning,
message, function calls) or, streamed, the API's typed events. Responses are kept (``store``, true by default as
OpenAI's) in the ingress replica's memory (:class:`ResponseStore`, bounded): a later request's
``previous_response_id`` continues that conversation (its input items, then its output items, before the new
input; instructions are not carried over, as OpenAI's are not), and ``GET``/``DELETE /v1/responses/{id}`` read and
drop one. ``background`` is refused. No Ray, no engine: the server (:mod:`specray.cluster.openai_app`) runs what
this module translates.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

from pydantic import Field, StrictBool

from specray.chat import tool_call_arguments
from specray.cluster import openai_protocol as proto

# sampling fields that pass through to the chat request as they are (OpenAI's, and vLLM's extras it accepts)
PASSTHROUGH = ("model", "temperature", "top_p", "user", "seed", "top_k", "min_p", "repetition_penalty",
               "presence_penalty", "frequency_penalty", "stop", "parallel_tool_calls", "metadata",
               "structured_outputs", "speculative")
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
STORE_MAX_CHARS = 256 << 20  # characters of JSON the stored responses of one store may hold, together


class ResponsesRequest(proto._Strict):
    """The fields of a Responses request this server reads; an unknown field is a 400, as on the other routes."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # false: this response is not kept (kept by default, as OpenAI's are)
    user: str | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None  # accepted: a reasoning model thinks as its template says
    # what the response adds (INCLUDABLE): "message.output_text.logprobs" (each output token's logprob,
    # top_logprobs' most likely tokens with it); the others name what this server never makes (web search calls,
    # files, encrypted reasoning)
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=proto.MAX_LOGPROBS)
    truncation: str | None = None
    # vLLM's extra sampling parameters
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: a constraint, or options of text.format's
    speculative: dict[str, Any] | None = None  # specray's per-request speculation, as on the chat route (checked there)


# OpenAI's values of ``include``: the output's logprobs, or what items this server never makes would carry
INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content", "message.input_image.image_url",
              "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs")


def parse(body: Any) -> ResponsesRequest:
    req = proto.parse_request(ResponsesRequest, body)
    for i, value in enumerate(req.include or ()):
        if value not in INCLUDABLE:
            raise proto.bad_request(f"include[{i}]={value!r:.80} is not one of {', '.join(map(repr, INCLUDABLE))}",
                                    f"include.{i}")
    if req.background:
        raise proto.bad_request("background=true is not supported: responses are answered (or streamed) while the "
                                "request is open; omit it", "background")
    if req.truncation not in (None, "disabled"):
        raise proto.bad_request(f"truncation={req.truncation!r} is not supported; an input longer than the context "
                                "is a 400 (truncation 'disabled', the default)", "truncation")
    return req


LOGPROBS = "message.output_text.logprobs"  # the include that asks for the output tokens' logprobs


def wants_logprobs(req: ResponsesRequest) -> bool:
    """The output text's logprobs: included (``include``), or their top tokens asked for (``top_logprobs``)."""
    return LOGPROBS in (req.include or ()) or req.top_logprobs is not None


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as a list of items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return list(req.input)


class ResponseStore:
    """The responses a server keeps (in its one replica, or in the store its replicas share), least recently used
    first out past ``max_entries`` or past ``max_chars`` characters of their JSON (so that no client can fill the
    memory through large stored requests): each one's conversation as input items (the input that produced it,
    then its output items) for a later request's ``previous_response_id``, and the response object for ``GET
    /v1/responses/{id}``. The newest is kept even alone past ``max_chars``. A conversation's earlier items are
    shared with the responses before it, and counted with each (a bound, not a measure)."""

    def __init__(self, max_entries: int, max_chars: int = STORE_MAX_CHARS):
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_stored_responses={max_entries!r} must be an int >= 1 (0 or None: keep none)")
        self.max_entries, self.max_chars = max_entries, max_chars
        self.chars = 0  # what the kept entries count, together
        self._entries: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, items: list[dict[str, Any]], response: dict[str, Any]) -> None:
        self.delete(response_id)
        size = len(json.dumps(items, ensure_ascii=False)) + len(json.dumps(response, ensure_ascii=False))
        self._entries[response_id] = (items, response, size)
        self.chars += size
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self.chars > self.max_chars):
            self.chars -= self._entries.popitem(last=False)[1][2]

    def get(self, response_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[0], entry[1]

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.chars -= entry[2]
        return entry is not None


class LocalResponseStore:
    """A :class:`ResponseStore` in this process behind the interface the server awaits (``get``, ``put``,
    ``delete``), which a store shared by several ingress replicas (``specray.cluster.serve``) has too."""

    def __init__(self, max_entries: int):
        self.store = ResponseStore(max_entries)

    async def get(self, response_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        return self.store.get(response_id)

    async def put(self, response_id: str, items: list[dict[str, Any]], response: dict[str, Any]) -> None:
        self.store.put(response_id, items, response)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)


def not_found(response_id: str, param: str | None = None) -> proto.OpenAIError:
    what = "Previous response" if param else "Response"
    return proto.OpenAIError(404, f"{what} with id {response_id!r:.80} not found (this server keeps the most recent "
                             "responses only, and none that was deleted or sent with store: false)",
                             "invalid_request_error",
                             param=param, code="previous_response_not_found" if param else "response_not_found")


def _text_of(content: Any, param: str, images: bool = False) -> str | list[dict[str, Any]]:
    """A message's content (a string, or text parts) as one string; with ``images`` (a message's content), its
    ``input_image`` parts too, as chat image parts (the content then a list of chat parts). A 400 for another part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise proto.bad_request(f"{param} must be a string or a list of input_text parts", param)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if images and kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            served = "input_text and (vision-language models) input_image parts with an image_url" if images else (
                "input_text parts")
            raise proto.bad_request(f"{param}[{i}] of type {kind!r} is not supported: send {served}, or a string",
                                    f"{param}.{i}.type")
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _messages(req: ResponsesRequest, prior: int = 0) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` and ``input``: messages, an assistant's function calls (consecutive
    ones in one message) and their outputs as tool messages; reasoning items are left out. The first ``prior``
    items are a stored conversation's (``previous_response_id``): an error names an item of the client's
    ``input`` by its index there. A function call's output must answer a call made before it in the
    conversation, as OpenAI requires."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    calls: set[str] = set()
    for n, item in enumerate(req.input):
        i = n - prior
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise proto.bad_request(f"input[{i}].role={role!r:.50} is not a valid role; use one of "
                                        f"{', '.join(repr(r) for r in _MESSAGE_ROLES)}", f"input.{i}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"input.{i}.content", images=True)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise proto.bad_request(f"input[{i}] (a function_call) needs name and call_id", f"input.{i}")
            try:
                tool_call_arguments(item.get("arguments"))
            except ValueError as err:
                if n < prior:  # a call the model made, cut short
                    raise proto.bad_request(f"the previous response's function_call {item['call_id']!r:.80} has "
                                            f"arguments that are not a JSON object ({err}); send the conversation in "
                                            "input with the call's arguments completed", "previous_response_id"
                                            ) from None
                raise proto.bad_request(f"input[{i}].arguments: {err}", f"input.{i}.arguments") from None
            calls.add(item["call_id"])
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or output is None:
                raise proto.bad_request(f"input[{i}] (a function_call_output) needs call_id and output", f"input.{i}")
            if item["call_id"] not in calls:
                raise proto.bad_request(f"input[{i}].call_id={item['call_id']!r:.80} answers no function_call "
                                        "before it in the conversation; send the function_call item (or the "
                                        "previous_response_id of the response that made it) before its output",
                                        f"input.{i}.call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(output, f"input.{i}.output")})
        elif kind != "reasoning":
            raise proto.bad_request(f"input[{i}].type={kind!r:.50} is not supported; send message, function_call "
                                    "and function_call_output items", f"input.{i}.type")
    if not messages:
        raise proto.bad_request("input has no message; send a string or at least one message item", "input")
    return messages


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat function tools (``{"type": "function", "name", "description", "parameters", "strict"}``) as chat
    tools; a built-in tool (web search, files, ...) is a 400."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise proto.bad_request(f"tools[{i}].type={tool.get('type')!r:.50} is not supported: this server calls "
                                    "functions only ({'type': 'function', 'name': ..., 'parameters': {...}})",
                                    f"tools.{i}.type")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise proto.bad_request(f"tool_choice={choice!r:.100} is not supported; use 'none', 'auto', 'required' "
                                    "or {'type': 'function', 'name': ...}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as a chat ``response_format``: text (none), json_object, or json_schema (its name, schema,
    strict and description)."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise proto.bad_request("text.format must be an object: {'type': 'text'}, {'type': 'json_object'} or "
                                "{'type': 'json_schema', 'name': ..., 'schema': {...}}", "text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise proto.bad_request(f"text.format.type={fmt.get('type')!r:.50} is not supported; use 'text', "
                            "'json_object' or 'json_schema'", "text.format.type")


# the chat request's parameter names an error may name, as the Responses request calls them
_RENAMED = [(re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
            (re.compile(r"\bresponse_format\.json_schema\b|\bresponse_format\b"), "text.format"),
            (re.compile(r"\bmessages\b(?:[.\[]\d+\]?)?"), "input"),
            (re.compile(r"\b(tools[.\[]\d+\]?)\.function\b"), r"\1"),
            (re.compile(r"\btool_choice\.function\b"), "tool_choice"),
            # a chat tool's or tool choice's shape, {'type': 'function', 'function': {'name': ...}}: flat here
            (re.compile(r"\{'type': 'function', 'function': \{(.*?)\}\}"), r"{'type': 'function', \1}"),
            (re.compile(r"\breasoning_effort\b"), "reasoning.effort")]


def in_responses_terms(err: proto.OpenAIError) -> proto.OpenAIError:
    """An error of the chat request that answers a Responses request, naming the Responses request's parameters."""
    def rename(text: str | None) -> str | None:
        for pattern, name in _RENAMED:
            text = None if text is None else pattern.sub(name, text)
        return text
    return proto.OpenAIError(err.status, rename(err.message), err.type, rename(err.param), err.code)


def chat_body(req: ResponsesRequest, prior: int = 0) -> dict[str, Any]:
    """The chat completion request that answers ``req``, whose first ``prior`` input items are a stored
    conversation's."""
    body: dict[str, Any] = {k: getattr(req, k) for k in PASSTHROUGH if getattr(req, k) is not None}
    body["messages"] = _messages(req, prior)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if wants_logprobs(req):
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    if req.tools:
        body["tools"] = _tools(req.tools)
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    response_format = _response_format(req.text)
    if response_format is not None:
        body["response_format"] = response_format
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:  # the chat template's reasoning_effort, as a chat request's
        body["reasoning_effort"] = effort
    body["stream"] = req.stream
    return body


# ---- the response --------------------------------------------------------------------------------------

def usage(chat: proto.Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    """A chat usage in the Responses API's names (the speculative figures kept, as on the other routes), with the
    output's thinking tokens (a reasoning parser's)."""
    return {"input_tokens": chat.prompt_tokens,
            "input_tokens_details": {"cached_tokens": chat.prompt_tokens_details.cached_tokens},
            "output_tokens": chat.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat.total_tokens, "speculative": chat.speculative.model_dump()}


def message_item(item_id: str, text: str, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A message item: "in_progress" (no content yet), "completed", or "incomplete" (its text cut by
    ``max_output_tokens``); ``logprobs``: its text's tokens' (asked for: ``include``), None when not asked."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [output_text(text, logprobs)]}


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(message: proto.AssistantMessage, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """A chat message as output items: its reasoning, its text (with ``logprobs``, the output's, when asked for),
    then its calls; with ``status`` "incomplete" (the output cut by ``max_output_tokens``) the last item, the one
    cut, says so."""
    items = []
    if message.reasoning_content:
        items.append(reasoning_item(proto.new_id("rs"), message.reasoning_content))
    if message.content:
        items.append(message_item(proto.new_id("msg"), message.content, logprobs=logprobs))
    items += [function_call_item(proto.new_id("fc"), c.id, c.function.name, c.function.arguments)
              for c in message.tool_calls]
    if items and "status" in items[-1]:
        items[-1]["status"] = status
    return items


def response_object(req: ResponsesRequest, response_id: str, created: int, model: str,
                    output: list[dict[str, Any]], status: str, usage_: dict[str, Any] | None,
                    stored: bool = False) -> dict[str, Any]:
    """The response: its output items, status ("in_progress", "completed", or "incomplete" when
    ``max_output_tokens`` cut it) and usage, with the request's settings echoed as OpenAI does."""
    reasoning = req.reasoning or {}
    return {"id": response_id, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": stored,
            "temperature": req.temperature, "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": req.top_p,
            "truncation": "disabled", "usage": usage_, "user": req.user, "metadata": req.metadata or {}}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"
