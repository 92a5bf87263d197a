"""Tool calls in a chat choice's generated text (vLLM's ``--tool-call-parser``): the text becomes (content, tool
calls), whole or pushed delta by delta as it streams.

Parsers, for ``tool_choice="auto"`` (``--enable-auto-tool-choice --tool-call-parser NAME``):

- ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one or more; the text outside them is the content.
- ``llama3_json`` (Llama 3.1, 3.2): the whole output, optionally after ``<|python_tag|>``, is
  ``{"name": ..., "parameters": {...}}``, or several such objects separated by ``;``.
- ``mistral`` (Mistral, Mixtral, Ministral): content, then ``[TOOL_CALLS]`` and the calls: a JSON array of
  ``{"name": ..., "arguments": {...}}`` (tokenizers before v11) or ``name[ARGS]{...}``, each after its own
  ``[TOOL_CALLS]`` (v11 and later).
- ``pythonic`` (Llama 3.2 and 4, others prompted so): the whole output is a Python list of calls with keyword
  arguments of literal values, ``[get_weather(city="Paris"), get_time()]`` (read with :mod:`ast`, never run).
- ``qwen3_coder`` (Qwen3-Coder): ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function>
  </tool_call>``, values typed by the request's tool schemas.
- ``deepseek_v3`` (DeepSeek-V3, R1, V3.1): a ``<｜tool▁calls▁begin｜>`` section of ``<｜tool▁call▁begin｜>`` calls.
- ``kimi_k2`` (Kimi K2): a ``<|tool_calls_section_begin|>`` section of ``functions.NAME:INDEX`` calls.

And one the server uses for ``tool_choice="required"``, whose output the grammar holds to a JSON array of
``{"name": ..., "parameters": {...}}`` (:class:`RequiredArrayStreamer`).

Output that does not parse as calls is plain content, never an error. A streamer holds back text from the point a
tool call's start marker may begin until it resolves (as :class:`specray.cluster.reasoning.ReasoningSplitter` holds
a ``<think>`` tag back) and hands each call over once it is complete, so pushing a text in any pieces and then
finishing gives what parsing it whole gives (:func:`parse_tool_calls`). No Ray, no engine.
"""

from __future__ import annotations

import ast
import json
import math
import re
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


# ---- tagged calls: hermes, qwen3_coder, deepseek_v3, kimi_k2 -------------------------------------------

class _TaggedStreamer:
    """Calls between a start and an end marker (``START``, ``END``: one call's, or a section of calls), any number
    of such spans, among content. The text of a span is held until its end marker and read by ``_calls``; a span
    that does not read as calls stays in the content, markers and all; a span still open at the end of the text
    counts when its calls are complete (the output stopped at the end marker, a stop string)."""

    START = END = ""
    keeps_special_tokens = True  # the markers are special tokens in their models' vocabularies

    def __init__(self):
        self._inside = False
        self._held = ""

    def _calls(self, body: str) -> list[ParsedToolCall] | None:
        """The calls of one span's text between its markers, or None when it is not such calls."""
        raise NotImplementedError

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
            if at < 0:  # the span so far (a partial end marker with it) waits for the rest
                self._held = text
                break
            self._end_span(text[:at], True, content, calls)
            text = text[at + len(self.END):]
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        held, self._held = self._held, ""
        if not self._inside:
            return held, []
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        self._end_span(held, False, content, calls)
        return "".join(content), calls

    def _end_span(self, body: str, closed: bool, content: list[str], calls: list[ParsedToolCall]) -> None:
        self._inside = False
        found = self._calls(body)
        if found is not None:
            calls.extend(found)
        else:
            content.append(self.START + body + (self.END if closed else ""))


class HermesStreamer(_TaggedStreamer):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` calls (``parameters`` is read too), any number,
    among content. A call whose body is not such an object stays in the content, tags and all."""

    START, END = "<tool_call>", "</tool_call>"  # special tokens in some vocabularies (vLLM's hermes parser keeps them)

    def _calls(self, body: str) -> list[ParsedToolCall] | None:
        try:
            call = _call(json.loads(body), ("arguments", "parameters"))
        except json.JSONDecodeError:
            return None
        return None if call is None else [call]


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


class Qwen3CoderStreamer(_TaggedStreamer):
    """Qwen3-Coder's XML calls (vLLM's ``qwen3_coder``): ``<tool_call><function=NAME><parameter=KEY>VALUE
    </parameter>...</function></tool_call>``. A value is text (one newline either side trimmed), typed by the
    function's JSON schema in the request's tools where it names the parameter's type (integer, number, boolean,
    object, array, null), else kept as a string."""

    START, END = "<tool_call>", "</tool_call>"
    uses_tool_schemas = True

    def __init__(self, tools: dict[str, dict] | None = None):
        super().__init__()
        self.tools = tools or {}  # function name -> its parameters' JSON schema

    def _calls(self, body: str) -> list[ParsedToolCall] | None:
        match = _XML_FUNCTION.fullmatch(body)
        if match is None:
            return None
        name, inner = match.group(1).strip(), match.group(2)
        properties = (self.tools.get(name) or {}).get("properties") or {}
        arguments = {}
        for key, value in _XML_PARAMETER.findall(inner):
            key = key.strip()
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key] = _typed(value, (properties.get(key) or {}).get("type"))
        rest = _XML_PARAMETER.sub("", inner)
        if rest.strip() or not name:  # anything but parameters inside the function: not such a call
            return None
        return [ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))]


def _typed(value: str, kind: Any) -> Any:
    """A parameter's text as its schema's type says (a list of types: the first that reads), else the text."""
    for kind in kind if isinstance(kind, list) else [kind]:
        try:
            if kind == "integer":
                return int(value.strip())
            if kind == "number":
                number = float(value.strip())
                return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() \
                    else number
            if kind == "boolean" and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            if kind in ("object", "array", "null"):
                return json.loads(value)
        except ValueError:
            continue
    return value


DS_CALLS_BEGIN, DS_CALLS_END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
DS_CALL_BEGIN, DS_CALL_END = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
DS_SEP = "<\uff5ctool\u2581sep\uff5c>"
_FENCED_JSON = re.compile(r"\s*```(?:json)?\s*\n(.*?)\n?```\s*", re.S)


class DeepSeekV3Streamer(_TaggedStreamer):
    """DeepSeek-V3 and R1's calls (vLLM's ``deepseek_v3``; V3.1's layout too): a section
    ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`` of calls ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>``, each
    ``function<｜tool▁sep｜>NAME`` and a fenced JSON block of its arguments (V3, R1), or ``NAME<｜tool▁sep｜>`` and the
    arguments' JSON (V3.1)."""

    START, END = DS_CALLS_BEGIN, DS_CALLS_END

    def _calls(self, body: str) -> list[ParsedToolCall] | None:
        return _section_calls(body, DS_CALL_BEGIN, DS_CALL_END, _deepseek_call)


def _deepseek_call(text: str) -> ParsedToolCall | None:
    left, sep, right = text.partition(DS_SEP)
    if not sep:
        return None
    if left.strip() == "function":  # V3 / R1: the name on the first line, then the fenced arguments
        name, _, rest = right.partition("\n")
        fenced = _FENCED_JSON.fullmatch(rest)
        arguments = fenced.group(1) if fenced is not None else rest
    else:  # V3.1: name, separator, arguments
        name, arguments = left, right
    arguments = _arguments_text(arguments.strip())
    name = name.strip()
    return None if arguments is None or not name else ParsedToolCall(name, arguments)


def _section_calls(body: str, begin: str, end: str, read) -> list[ParsedToolCall] | None:
    """The calls of a section: ``begin``-``end`` spans (the last may be open: the output stopped inside it), each
    read by ``read``, with nothing but blanks between them; None when the section is not that."""
    calls: list[ParsedToolCall] = []
    at = _skip_space(body, 0)
    while at < len(body):
        if not body.startswith(begin, at):
            return None
        stop = body.find(end, at)
        inner = body[at + len(begin): stop if stop >= 0 else len(body)]
        call = read(inner)
        if call is None:
            return None
        calls.append(call)
        at = _skip_space(body, len(body) if stop < 0 else stop + len(end))
    return calls or None


KIMI_CALLS_BEGIN, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
KIMI_ARGUMENTS = "<|tool_call_argument_begin|>"
_KIMI_ID = re.compile(r"\s*(?:functions\.)?([^:\s]+)(?::\d+)?\s*")


class KimiK2Streamer(_TaggedStreamer):
    """Kimi K2's calls (vLLM's ``kimi_k2``): a section ``<|tool_calls_section_begin|>...<|tool_calls_section_end|>``
    of calls ``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>``."""

    START, END = KIMI_CALLS_BEGIN, KIMI_CALLS_END

    def _calls(self, body: str) -> list[ParsedToolCall] | None:
        return _section_calls(body, KIMI_CALL_BEGIN, KIMI_CALL_END, _kimi_call)


def _kimi_call(text: str) -> ParsedToolCall | None:
    call_id, sep, arguments = text.partition(KIMI_ARGUMENTS)
    match = _KIMI_ID.fullmatch(call_id)
    arguments = _arguments_text(arguments.strip()) if sep else None
    return None if match is None or arguments is None else ParsedToolCall(match.group(1), arguments)


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


class _WholeTextStreamer:
    """Streams a parser of whole texts (``parse``): text whose first non-blank characters begin none of ``STARTS``
    goes out as content at once; otherwise the text is held to the end, since one part that does not parse makes
    the whole text content."""

    STARTS: tuple[str, ...] = ()
    keeps_special_tokens = False

    def __init__(self):
        self._held = ""
        self._plain = False

    @staticmethod
    def parse(text: str) -> tuple[str, list[ParsedToolCall]]:
        raise NotImplementedError

    def push(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        if self._plain:
            return text, []
        self._held += text
        body = self._held.lstrip()
        if body and not any(body.startswith(s) or s.startswith(body) for s in self.STARTS):
            self._plain = True
            held, self._held = self._held, ""
            return held, []
        return "", []

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        held, self._held = self._held, ""
        return self.parse(held)


class Llama3JsonStreamer(_WholeTextStreamer):
    """Streams :func:`parse_llama3_json`."""

    STARTS = ("{", PYTHON_TAG)  # without <|python_tag|> (skipped as a special token) the calls start at "{"
    parse = staticmethod(parse_llama3_json)


# ---- mistral -------------------------------------------------------------------------------------------

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_FUNCTION_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


def _mistral_calls(text: str) -> list[ParsedToolCall] | None:
    """The calls of ``text``, which starts at ``[TOOL_CALLS]``: one or more ``[TOOL_CALLS]`` sections, each a JSON
    array of calls or ``name[ARGS]{...}``; None unless all of it parses."""
    decoder = json.JSONDecoder()
    calls: list[ParsedToolCall] = []
    while text:
        if not text.startswith(TOOL_CALLS):
            return None
        body = text[len(TOOL_CALLS):].lstrip()
        if body.startswith("["):  # [{"name": ..., "arguments": {...}}, ...]
            try:
                items, end = decoder.raw_decode(body)
            except json.JSONDecodeError:
                return None
            found = [_call(item, ("arguments", "parameters")) for item in items] if isinstance(items, list) else []
            if not found or None in found:
                return None
            calls += found
        else:  # name[ARGS]{...}
            name, sep, after = body.partition(ARGS)
            if not sep or not _FUNCTION_NAME.fullmatch(name.strip()):
                return None
            body = after.lstrip()
            try:
                value, end = decoder.raw_decode(body)
            except json.JSONDecodeError:
                return None
            arguments = _arguments_text(value) if isinstance(value, dict) else None
            if arguments is None:
                return None
            calls.append(ParsedToolCall(name.strip(), arguments))
        text = body[end:].lstrip()
    return calls


def parse_mistral(text: str) -> tuple[str, list[ParsedToolCall]]:
    """Mistral's calls: the content, then from the first ``[TOOL_CALLS]`` to the end (whitespace aside) nothing but
    calls; if that part does not parse, the whole text is content."""
    at = text.find(TOOL_CALLS)
    calls = None if at < 0 else _mistral_calls(text[at:].rstrip())
    return (text, []) if not calls else (text[:at], calls)


class MistralStreamer:
    """Streams :func:`parse_mistral`: the content goes out as it comes (a partial ``[TOOL_CALLS]`` at its end held
    back); from ``[TOOL_CALLS]`` on the text is held to the end."""

    keeps_special_tokens = True  # [TOOL_CALLS] and [ARGS] are special tokens in Mistral's vocabularies

    def __init__(self):
        self._held = ""
        self._calling = False

    def push(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        self._held += text
        if self._calling:
            return "", []
        at = self._held.find(TOOL_CALLS)
        if at >= 0:
            self._calling = True
            content, self._held = self._held[:at], self._held[at:]
            return content, []
        keep = _marker_start(self._held, TOOL_CALLS)
        content, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return content, []

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        held, self._held = self._held, ""
        return parse_mistral(held)


# ---- pythonic ------------------------------------------------------------------------------------------

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    """A literal argument value as JSON data (Python's literals, and JSON's true/false/null); ValueError for
    anything else (a call, a name, an operation)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (bool, int, str)) or (
            isinstance(node.value, float) and math.isfinite(node.value))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        keys = [_literal(k) for k in node.keys]
        if all(isinstance(k, str) for k in keys):
            return dict(zip(keys, (_literal(v) for v in node.values)))
    raise ValueError("not a literal")


def _function_name(node: ast.expr) -> str | None:
    """``f`` or ``module.f`` as its dotted name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _function_name(node.value)
        return None if owner is None else f"{owner}.{node.attr}"
    return None


def parse_pythonic(text: str) -> tuple[str, list[ParsedToolCall]]:
    """Python-style calls: the whole text (whitespace, and ``<|python_start|>`` ... ``<|python_end|>``, aside) is a
    non-empty list of calls with keyword arguments of literal values; anything else is content."""
    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START):].removesuffix(PYTHON_END).strip()
    if not body.startswith("["):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):  # ValueError: a NUL character
        return text, []
    if not isinstance(tree, ast.List) or not tree.elts:
        return text, []
    calls: list[ParsedToolCall] = []
    for node in tree.elts:
        name = _function_name(node.func) if isinstance(node, ast.Call) else None
        if name is None or node.args or any(k.arg is None for k in node.keywords):
            return text, []
        try:
            arguments = {k.arg: _literal(k.value) for k in node.keywords}
        except (ValueError, RecursionError):
            return text, []
        calls.append(ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False)))
    return "", calls


class PythonicStreamer(_WholeTextStreamer):
    """Streams :func:`parse_pythonic`."""

    STARTS = ("[", PYTHON_START)  # Llama 4's tags are special tokens, skipped in its text unless kept
    parse = staticmethod(parse_pythonic)


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

TOOL_CALL_PARSERS: dict[str, type] = {"hermes": HermesStreamer, "llama3_json": Llama3JsonStreamer,
                                       "mistral": MistralStreamer, "pythonic": PythonicStreamer,
                                       "qwen3_coder": Qwen3CoderStreamer, "deepseek_v3": DeepSeekV3Streamer,
                                       "kimi_k2": KimiK2Streamer}


def check_tool_call_parser(name: str | None, enable_auto_tool_choice: bool = False) -> None:
    """ValueError for a parser that is not known, or for auto tool choice without a parser."""
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser={name!r} is not known; choose one of {list(TOOL_CALL_PARSERS)} (hermes: "
                         "<tool_call>{...}</tool_call>, as Hermes and Qwen write calls; llama3_json: Llama 3.1/3.2's "
                         "JSON calls; mistral: [TOOL_CALLS] calls; pythonic: [f(x=1)], Llama 3.2/4's Python "
                         "calls; qwen3_coder: Qwen3-Coder's XML calls; deepseek_v3: DeepSeek-V3/R1/V3.1's calls; "
                         "kimi_k2: Kimi K2's calls) or leave it unset")
    if enable_auto_tool_choice and name is None:
        raise ValueError("enable_auto_tool_choice (--enable-auto-tool-choice) needs tool_call_parser "
                         f"(--tool-call-parser), the format the model writes its calls in: one of "
                         f"{list(TOOL_CALL_PARSERS)}")


def tool_call_streamer(name: str, tools: dict[str, dict] | None = None) -> ToolCallStreamer:
    """A fresh streamer of the parser ``name`` (one per choice); ``tools``: the request's functions' parameter
    schemas by name, for a parser that types arguments by them."""
    check_tool_call_parser(name)
    cls = TOOL_CALL_PARSERS[name]
    return cls(tools) if getattr(cls, "uses_tool_schemas", False) else cls()
