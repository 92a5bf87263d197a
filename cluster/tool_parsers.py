"""Tool calls in a chat choice's generated text (vLLM's ``--tool-call-parser``): the text becomes (content, tool
calls), whole or pushed delta by delta as it streams.

Parsers, for ``tool_choice="auto"`` (``--enable-auto-tool-choice --tool-call-parser NAME``):

- ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one or more; the text outside them is the content.
- ``llama3_json`` (Llama 3.1, 3.2): the whole output, optionally after ``<|python_tag|>``, is
  ``{"name": ..., "parameters": {...}}``, or several such objects separated by ``;``.

And one the server uses for ``tool_choice="required"``, whose output the grammar holds to a JSON array of
``{"name": ..., "parameters": {...}}`` (:class:`RequiredArrayStreamer`).

Output that does not parse as calls is plain content, never an error. A streamer holds back text from the point a
tool call's start marker may begin until it resolves (as :class:`specray.cluster.reasoning.ReasoningSplitter` holds
a ``<think>`` tag back) and hands each call over once it is complete, so pushing a text in any pieces and then
finishing gives what parsing it whole gives (:func:`parse_tool_calls`). No Ray, no engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol



@dataclass(frozen=True)
class ParsedToolCall:
    """One call found in the text: the function's name and its arguments as JSON text of an object."""

    name: str
    arguments: str


class ToolCallStreamer(Protocol):
    """Reads one choice's text, pushed delta by delta."""

    def push(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """The content and the calls completed by ``text`` (after what earlier pushes held back)."""
        ...

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """What is still held, at the end of the text: the content and calls it makes."""
        ...


def parse_tool_calls(streamer: ToolCallStreamer, text: str) -> tuple[str, list[ParsedToolCall]]:
    """A whole text as (content, calls), read by a fresh ``streamer``."""
    content, calls = streamer.push(text)
    rest, more = streamer.finish()
    return content + rest, calls + more


def _arguments_text(value: Any) -> str | None:
    """A call's arguments as JSON text of an object (None, absent or "": no arguments), or None when they are
    not an object (nor JSON text of one)."""
    if value is None or value == "":
        value = {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def _call(obj: Any, argument_keys: tuple[str, ...]) -> ParsedToolCall | None:
    """``{"name": ..., <one of argument_keys>: {...}}`` as a call, None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    arguments = _arguments_text(None if key is None else obj[key])
    return None if arguments is None else ParsedToolCall(obj["name"], arguments)


def _marker_start(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper beginning of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


# ---- hermes --------------------------------------------------------------------------------------------

class HermesStreamer:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` calls (``parameters`` is read too), any number,
    among content. A call whose body is not such an object stays in the content, tags and all; a call still open at
    the end counts when its body is complete (the output stopped at ``</tool_call>``, a stop string)."""

    START, END = "<tool_call>", "</tool_call>"
    keeps_special_tokens = True  # the tags are special tokens in some vocabularies (vLLM's hermes parser too)

    def __init__(self):
        self._inside = False
        self._held = ""

    def push(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        text, self._held = self._held + text, ""
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        while text:
            if not self._inside:
                at = text.find(self.START)
                if at < 0:
                    keep = _marker_start(text, self.START)
                    content.append(text[:len(text) - keep])
                    self._held = text[len(text) - keep:]
                    break
                content.append(text[:at])
                text = text[at + len(self.START):]
                self._inside = True
                continue
            at = text.find(self.END)
            if at < 0:  # the body so far (a partial end tag with it) waits for the rest
                self._held = text
                break
            self._end_call(text[:at], True, content, calls)
            text = text[at + len(self.END):]
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        held, self._held = self._held, ""
        if not self._inside:
            return held, []
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        self._end_call(held, False, content, calls)
        return "".join(content), calls

    def _end_call(self, body: str, closed: bool, content: list[str], calls: list[ParsedToolCall]) -> None:
        self._inside = False
        try:
            call = _call(json.loads(body), ("arguments", "parameters"))
        except json.JSONDecodeError:
            call = None
        if call is not None:
            calls.append(call)
        else:
            content.append(self.START + body + (self.END if closed else ""))


# ---- llama3_json ---------------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> tuple[str, list[ParsedToolCall]]:
    """Llama 3's JSON calls: the whole text (leading whitespace and ``<|python_tag|>`` aside) is one or more
    ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``) separated by ``;``; anything else is content."""
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):]
    elif not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls: list[ParsedToolCall] = []
    at = _skip_space(body, 0)
    while True:
        try:
            obj, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        call = _call(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        at = _skip_space(body, at)
        if at == len(body):
            return "", calls
        if body[at] != ";":
            return text, []
        at = _skip_space(body, at + 1)
        if at == len(body):  # a trailing separator
            return "", calls


class Llama3JsonStreamer:
    """Streams :func:`parse_llama3_json`: text whose first non-blank characters begin neither ``{`` nor
    ``<|python_tag|>`` goes out as content at once; otherwise the text is held to the end, since one part that does
    not parse makes the whole text content."""

    keeps_special_tokens = False  # without <|python_tag|> (skipped as a special token) the calls start at "{"

    def __init__(self):
        self._held = ""
        self._plain = False

    def push(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        if self._plain:
            return text, []
        self._held += text
        body = self._held.lstrip()
        if body and not (body.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(body)):
            self._plain = True
            held, self._held = self._held, ""
            return held, []
        return "", []

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        held, self._held = self._held, ""
        return parse_llama3_json(held)


# ---- tool_choice="required" ----------------------------------------------------------------------------

class RequiredArrayStreamer:
    """``tool_choice="required"``: the text is a JSON array of ``{"name": ..., "parameters": {...}}`` (the grammar
    holds it to that); each item is a call as soon as it is complete. An array cut short (``max_tokens``) gives the
    items completed before the cut; a text with no item at all is content."""

    keeps_special_tokens = False

    def __init__(self):
        self._text = ""
        self._at = 0  # where reading goes on: past "[" and past each complete item with its separator
        self._state = "open"  # "open" (before "["), "item", "separator", "done"
        self._found = 0
        self._decoder = json.JSONDecoder()

    def push(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        self._text += text
        calls: list[ParsedToolCall] = []
        while self._state != "done":
            at = _skip_space(self._text, self._at)
            if at == len(self._text):
                break
            char = self._text[at]
            if self._state == "open":
                if char != "[":
                    self._state = "done"
                    break
                self._at, self._state = at + 1, "item"
            elif self._state == "separator":  # "]" ends the array; anything else is no array of calls
                self._at = at + 1
                self._state = "item" if char == "," else "done"
            elif char == "]":  # "[]", "[{...},]": what was found stands
                self._state = "done"
            else:
                try:
                    obj, end = self._decoder.raw_decode(self._text, at)
                except json.JSONDecodeError:
                    break  # incomplete (or malformed: then it never completes)
                call = _call(obj, ("parameters", "arguments"))
                if call is None:
                    self._state = "done"
                    break
                calls.append(call)
                self._found += 1
                self._at, self._state = end, "separator"
        return "", calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        text = self._text
        self._text, self._state = "", "done"
        return ("" if self._found else text), []


# ---- the registry --------------------------------------------------------------------------------------

TOOL_CALL_PARSERS: dict[str, type] = {"hermes": HermesStreamer, "llama3_json": Llama3JsonStreamer}


def check_tool_call_parser(name: str | None, enable_auto_tool_choice: bool = False) -> None:
    """ValueError for a parser that is not known, or for auto tool choice without a parser."""
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser={name!r} is not known; choose one of {list(TOOL_CALL_PARSERS)} (hermes: "
                         "<tool_call>{...}</tool_call>, as Hermes and Qwen write calls; llama3_json: Llama 3.1/3.2's "
                         "JSON calls) or leave it unset")
    if enable_auto_tool_choice and name is None:
        raise ValueError("enable_auto_tool_choice (--enable-auto-tool-choice) needs tool_call_parser "
                         f"(--tool-call-parser), the format the model writes its calls in: one of "
                         f"{list(TOOL_CALL_PARSERS)}")


def tool_call_streamer(name: str) -> ToolCallStreamer:
    """A fresh streamer of the parser ``name`` (one per choice)."""
    check_tool_call_parser(name)
    return TOOL_CALL_PARSERS[name]()
