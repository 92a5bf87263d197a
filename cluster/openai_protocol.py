"""The OpenAI wire format: request and response models, error JSON, server-sent-event framing, and the
conversion of a request into per-choice :class:`~specray.sampling_params.SamplingParams`.

Pure data and formatting: no FastAPI, no Ray, no engine. Every validation failure becomes an
:class:`OpenAIError` that names the offending parameter, so the HTTP layer only has to serialize it.
"""

from __future__ import annotations

import codecs
import json
import re
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator,
                      model_serializer, model_validator)

from specray.chat import check_chat_options, tool_call_arguments
from specray.detokenizer import TokenTexts
from specray.outputs import Logprob, PromptLogprobs, SampleLogprobs, SpecStats
from specray.sampling_params import STRUCTURED_KINDS, SamplingParams, StructuredOutputsParams, choice_seed

MAX_N = 64  # choices per request
MAX_LOGPROBS = 20  # OpenAI's limit for logprobs / top_logprobs
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI clients expect a finite number
SSE_DONE = "data: [DONE]\n\n"
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1  # OpenAI's seed is a 64-bit integer; the engine's generators too
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's roles a chat template can render
TOOL_CHOICES = ("none", "auto", "required")  # OpenAI's tool_choice strings; a dict names one function


# ---- errors --------------------------------------------------------------------------------------------

class OpenAIError(Exception):
    """An error that goes to the client as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def model_not_found(name: str, served: str) -> OpenAIError:
    return OpenAIError(404, f"The model {name!r} does not exist; this server serves {served!r} (see /v1/models)",
                       "invalid_request_error", "model", "model_not_found")


def queue_full(max_queue_len: int) -> OpenAIError:
    return OpenAIError(503, f"The server is overloaded: {max_queue_len} requests are already waiting "
                            "(max_queue_len); retry later", "server_error", None, "queue_full")


def body_too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body is larger than this server accepts ({size} bytes or more; the "
                            f"limit is {limit}, max_request_body_bytes); shorten the request",
                       "invalid_request_error", None, "request_too_large")


def invalid_api_key() -> OpenAIError:
    return OpenAIError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>' with "
                            "the key the server was started with (--api-key or SPECRAY_API_KEY)",
                       "invalid_request_error", None, "invalid_api_key")


def server_error(message: str) -> OpenAIError:
    return OpenAIError(500, message, "server_error", None, "internal_error")


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict)$|[\[\-]")  # 'list[int]', 'function-after[...]'


def from_validation_error(err: ValidationError) -> OpenAIError:
    """The first pydantic error (our own validators' first) as a 400 naming its parameter
    (``messages.0.content`` for nested ones; the union-member tags pydantic puts in a location, such as
    ``stop.str``, are dropped)."""
    errors = err.errors()
    # in a union (content: str | list of parts) our own validators' errors say more than "not a string", and so
    # does the deepest error (an input_audio part's missing format) more than the shallow branch's
    first = next((e for e in errors if e["type"] == "value_error"), None) or max(errors, key=lambda e: len(e["loc"]))
    parts = [str(p) for p in first["loc"] if isinstance(p, int) or not _UNION_TAG.search(p)]
    param = ".".join(parts) or None
    if first["type"] == "extra_forbidden":
        return bad_request(f"{param} is not a supported parameter; remove it", param)
    got = first.get("input")
    return bad_request(f"{param}: {first['msg']} (got {got!r:.100})", param)


# SamplingParams fields that a request sets under another name: the client's name is the param to report
_REQUEST_PARAMS = {"prompt_token_ids": "prompt", "speculative_method": "speculative.method",
                   "num_speculative_tokens": "speculative.num_speculative_tokens", "lora_request": "model"}


# an engine/SamplingParams message about structured outputs: "structured_outputs.regex is not a valid ..."
_STRUCTURED_MESSAGE = re.compile(r"structured_outputs(?:\.\w+)?\b")


def from_value_error(err: ValueError, default_param: str | None = None,
                     structured_param: str | None = None) -> OpenAIError:
    """A 400 from an engine/SamplingParams ValueError, whose messages start with ``name=value`` or
    ``name contains``. One about structured outputs (``structured_outputs.<kind> ...``) names
    ``structured_param``, the request's own field for its constraint (``response_format``, ``guided_regex``, ...),
    message and param alike, where given."""
    message = str(err)
    structured = _STRUCTURED_MESSAGE.match(message)
    if structured:
        param = structured_param or structured.group(0)
        return bad_request(param + message[structured.end():], param)
    match = re.match(r"(\w+)(?:=| contains )", message)
    param = match.group(1) if match else default_param
    return bad_request(message, _REQUEST_PARAMS.get(param, param))


# ---- requests ------------------------------------------------------------------------------------------

def _valid_unicode(text: str) -> str:
    """Reject lone UTF-16 surrogates (JSON allows ``"\\ud800"``, but no tokenizer can encode one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"the text holds a lone UTF-16 surrogate at character {err.start} "
                         f"({text[err.start]!r}); send valid Unicode (a surrogate needs its pair)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]  # every string that reaches the tokenizer


class _Strict(BaseModel):
    """Unknown fields are errors (a typo such as ``max_token`` must not be silently ignored). Cross-field
    validators raise :class:`OpenAIError` directly, which pydantic lets through, to name the parameter. A field
    sent as null stands for its default, as OpenAI's optional parameters are nullable (the ``openai`` client sends
    an explicit ``None`` as null: ``n=None`` is ``n=1``)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(value is None for value in data.values()):
            return {key: value for key, value in data.items() if value is not None}
        return data


class SpeculativeOptions(_Strict):
    """Per-request speculation (a specray extension): ``{"enabled": false}``, ``{"num_speculative_tokens": k}``
    and ``{"method": "suffix"}`` (the request's own drafting method, ``SamplingParams.speculative_method``; the
    engine refuses one a request may not pick, a 400), alone or together."""

    enabled: bool = True
    num_speculative_tokens: int | None = Field(default=None, ge=0)
    method: str | None = Field(default=None, min_length=1)

    def num_tokens(self) -> int | None:
        """The engine's ``SamplingParams.num_speculative_tokens``: 0 off, k at most k, None the server's."""
        return 0 if not self.enabled else self.num_speculative_tokens


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


RESPONSE_FORMATS = ("text", "json_object", "json_schema")  # OpenAI's response_format types
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}  # vLLM's legacy extras -> StructuredOutputsParams' field
_CONSTRAINT_WAYS = "response_format, structured_outputs or one guided_* field"


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``. The ``schema`` goes to the engine; ``name``, ``description`` and
    ``strict`` are accepted and not used (as in vLLM: the grammar enforces the schema whatever ``strict`` says)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # "schema" would shadow BaseModel's
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON
    object) or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``."""

    type: str
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _known_type(self):
        if self.type not in RESPONSE_FORMATS:
            raise bad_request(f"response_format.type={self.type!r:.100} is not supported; use one of "
                              f"{', '.join(repr(t) for t in RESPONSE_FORMATS)}", "response_format.type")
        if self.type != "json_schema":
            if self.json_schema is not None:
                raise bad_request(f"response_format.json_schema is read only with type 'json_schema', not "
                                  f"{self.type!r}; set type to 'json_schema' or omit json_schema",
                                  "response_format.json_schema")
        elif self.json_schema is None:
            raise bad_request("response_format.json_schema is missing: type 'json_schema' needs "
                              "{'json_schema': {'name': ..., 'schema': {...}}}", "response_format.json_schema")
        elif self.json_schema.schema_ is None:
            raise bad_request("response_format.json_schema.schema is missing: give the JSON schema (an object) the "
                              "output must follow, as {'name': ..., 'schema': {'type': 'object', ...}}",
                              "response_format.json_schema.schema")
        return self


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs`` request field: the fields of
    :class:`~specray.sampling_params.StructuredOutputsParams`, one constraint (``json``: a schema or its JSON text,
    ``regex``, ``choice``, ``grammar``: Lark or GBNF, ``json_object``) and its options. With ``response_format``
    or a ``guided_*`` field giving the constraint, it may hold the options alone."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # "json" would shadow BaseModel's
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def constraint(self, kind: str) -> Any:
        """The value of StructuredOutputsParams' field ``kind``, None where unset (json_object=false too)."""
        value = self.json_ if kind == "json" else getattr(self, kind)
        return None if value is False else value


def _json_schema(param: str, value: dict | str) -> dict:
    """A JSON schema given as an object or as its JSON text, as an object; a 400 naming ``param`` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise bad_request(f"{param} is not valid JSON ({err}); give a JSON schema, as an object or its JSON "
                              "text", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param}={value!r:.100} is not a JSON schema; give an object such as "
                          "{'type': 'object', 'properties': {...}}", param)
    return value


class _GenerationRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    user: str | None = None
    safety_identifier: str | None = None  # OpenAI's successor of user: accepted, not used, as user
    # OpenAI's hint for its prompt cache: accepted; prefix caching finds shared prefixes by their tokens
    prompt_cache_key: str | None = None
    # vLLM's: the response's id is "<chatcmpl|cmpl>-<request_id>" (the engine's own ids stay unique)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    # vLLM's: the prompt's and each choice's token ids in the response (streamed: each chunk's new ones)
    return_token_ids: bool = False
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)  # vLLM's extra parameters: this and min_tokens
    min_tokens: int | None = Field(default=None, ge=0)
    logit_bias: dict[str, float] | None = None  # token id (a string of digits) -> bias; a dict of ints once parsed
    # vLLM's: the logprobs of every prompt token and the k most likely there (the response's prompt_logprobs)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: logprobs name each token "token_id:<id>" (the server's --return-tokens-as-token-ids sets it for all)
    return_tokens_as_token_ids: bool | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be generated
    # vLLM's too: the detokenizer's and the stop strings' options, and left truncation of the prompt
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    bad_words: list[Text] | None = None  # vLLM's: words the output must not contain
    # vLLM's: with prefix caching, reuse only blocks cached by requests with the same salt (tenant isolation)
    cache_salt: str | None = Field(default=None, min_length=1)
    priority: int = 0  # vLLM's: lower first, on a server started with --scheduling-policy priority
    # structured outputs, one way at most: OpenAI's response_format, vLLM's structured_outputs, or one of vLLM's
    # legacy guided_* fields (guided_json: a schema or its JSON text)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    # vLLM's parameters of what this server does not have, each with the values that leave it off (accepted) and why
    # another value is a 400; the chat route adds OpenAI's (_FEATURE_OFF)
    _OFF: ClassVar[dict[str, tuple[tuple, str]]] = {
        "use_beam_search": ((False,), "beam search is not served"),
        "length_penalty": ((1.0, 1), "it weighs beams, and beam search is not served"),
        "spaces_between_special_tokens": ((True,), "special tokens are decoded as the tokenizer joins them"),
    }

    @model_validator(mode="before")
    @classmethod
    def _drop_features_left_off(cls, data: Any) -> Any:
        """Parameters of features this server does not have, sent with the value that leaves the feature off (or
        null), are dropped; another value is a 400 naming the parameter and what is missing."""
        if not isinstance(data, dict) or not cls._OFF.keys() & data.keys():
            return data
        data = dict(data)
        for name, (off, why) in cls._OFF.items():
            value = data.pop(name, None)
            if value is not None and not any(value == v and type(value) is type(v) for v in off):
                raise bad_request(f"{name}={value!r:.100} is not supported: {why}; omit it", name)
        return data

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self):
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only for streamed responses; set stream=true or omit it",
                              "stream_options")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs is not available with stream=true; omit one of them (a streamed "
                              "completion with echo=true and logprobs gives the prompt's logprobs first)",
                              "prompt_logprobs")
        return self

    @model_validator(mode="after")
    def _one_output_constraint(self):
        self._check_tools()  # first: a forced tool call's constraint is read from them
        constraints = self._constraints()
        tool = self._tool_constraint()
        if tool is not None and constraints:
            param = constraints[0][0]
            raise bad_request(f"{param} constrains the output, and so does {tool[0]} (the tool calls follow the "
                              f"functions' parameters schemas); omit {param} (structured_outputs may still carry its "
                              "disable_* options for the calls' JSON), or set tool_choice to 'auto' or 'none'", param)
        if len(constraints) > 1:
            names = [param for param, _, _ in constraints]
            raise bad_request(f"{', '.join(names[:-1])} and {names[-1]} each constrain the output; give one "
                              f"constraint, through {_CONSTRAINT_WAYS}", names[1])
        if not constraints and tool is None and self.structured_outputs is not None:
            raise bad_request(f"structured_outputs sets none of {', '.join(STRUCTURED_KINDS)}: set one of them "
                              "(its disable_* options only adjust a constraint given here or by response_format), or "
                              "omit structured_outputs", "structured_outputs")
        for param, kind, value in constraints:
            if kind == "json":
                _json_schema(param, value)
        return self

    def _constraints(self) -> list[tuple[str, str, Any]]:
        """Each constraint on the output the request gives: (its field here, StructuredOutputsParams' field, the
        value)."""
        found = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", "json_object", True))
        if fmt is not None and fmt.type == "json_schema":
            found.append(("response_format.json_schema.schema", "json", fmt.json_schema.schema_))
        if self.structured_outputs is not None:
            found += [(f"structured_outputs.{kind}", kind, self.structured_outputs.constraint(kind))
                      for kind in STRUCTURED_KINDS if self.structured_outputs.constraint(kind) is not None]
        found += [(name, kind, getattr(self, name)) for name, kind in GUIDED_FIELDS.items()
                  if getattr(self, name) is not None]
        return found

    def _check_tools(self) -> None:
        """A 400 for tool parameters that do not go together (chat only)."""

    def _tool_constraint(self) -> tuple[str, str, Any] | None:
        """The constraint a forced tool call puts on the output, as :meth:`_constraints`' items (chat only)."""
        return None

    def _output_constraints(self) -> list[tuple[str, str, Any]]:
        tool = self._tool_constraint()
        return self._constraints() + ([tool] if tool is not None else [])

    def structured_outputs_param(self) -> str | None:
        """The field that gives the request's constraint on its output (None: no constraint): the one an error
        about it names."""
        constraints = self._output_constraints()
        return constraints[0][0] if constraints else None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The engine's ``SamplingParams.structured_outputs`` for this request, None for free text."""
        constraints = self._output_constraints()
        if not constraints:
            return None
        param, kind, value = constraints[0]
        options = self.structured_outputs
        return StructuredOutputsParams(
            **{kind: _json_schema(param, value) if kind == "json" else value},
            disable_any_whitespace=options is not None and options.disable_any_whitespace,
            disable_additional_properties=options is not None and options.disable_additional_properties)

    def num_prompt_logprobs(self) -> int | None:
        """What the engine computes per prompt token (``SamplingParams.prompt_logprobs``), None for nothing."""
        return self.prompt_logprobs

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("every stop sequence must be a non-empty string")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids_not_negative(cls, value):
        if value and any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_token_ids(cls, value):
        """OpenAI's keys are token ids written as strings: {"50256": -100}."""
        if value is None:
            return value
        out, keys = {}, {}
        for key, bias in value.items():
            if not key.strip().isdigit():
                raise ValueError(f"keys must be token ids (strings of digits), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias!r} for token {key}")
            token = int(key)
            if token in out:  # one bias would be dropped unseen
                raise ValueError(f"keys {keys[token]!r} and {key!r} both name token {token}; give each token once")
            out[token], keys[token] = bias, key
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_GenerationRequest):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (a BOS) around a text prompt
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        """One message for any other shape (pydantic's would name only the union's first member, a string)."""
        def token_ids(v) -> bool:
            return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

        if not (isinstance(value, str) or token_ids(value) or isinstance(value, list) and (
                all(isinstance(p, str) for p in value) or all(token_ids(p) for p in value))):
            raise ValueError("must be a string, a list of strings, a list of token ids (ints) or a list of token-id "
                             "lists")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value):
        if not value or (isinstance(value, list) and any(not p for p in value)):
            raise ValueError("the prompt is empty; give a non-empty string or token-id list")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix is not supported by this server; omit it")
        return value

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of={self.best_of} is not supported; omit it or set it equal to n={self.n}",
                              "best_of")
        return self

    def num_prompt_logprobs(self) -> int | None:
        """echo with logprobs shows the prompt's tokens with their logprobs before the completion's (OpenAI's
        legacy API), so the engine computes them too."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted, default=None)

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: strings and/or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


def check_template_options(req) -> None:
    """A 400 in the request's terms for chat options that cannot go together
    (:func:`specray.chat.check_chat_options`)."""
    try:
        check_chat_options(req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs)
    except ValueError as err:
        param = "chat_template_kwargs" if "chat_template_kwargs" in str(err) else "continue_final_message"
        raise bad_request(str(err), param) from None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    text: Text

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value != "text":
            raise ValueError(f"a content part of type {value!r} is not supported: the served models read text "
                             "only; send {'type': 'text', 'text': ...} parts or a string")
        return value


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    # OpenAI's; accepted, and every image is processed as the model's processor does
    detail: Literal["auto", "low", "high"] | None = None


class VideoURL(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str


class AudioURL(VideoURL):
    """vLLM's ``audio_url`` part's object (its own class: pydantic's errors name it)."""


class InputAudio(BaseModel):
    """OpenAI's audio content part: the file's bytes in base64 and its format (``wav``, ``mp3``, ...)."""

    model_config = ConfigDict(extra="forbid")
    data: str
    format: str


class ContentPart(BaseModel):
    """A chat message's content part: text, or (for a multimodal model) an image, a video (vLLM's ``video_url``)
    or an audio (vLLM's ``audio_url``) by URL (a ``data:`` URL, or an http(s) one the server fetches), or an audio
    in OpenAI's ``input_audio``."""

    model_config = ConfigDict(extra="forbid")
    type: str
    text: Text | None = None
    image_url: ImageURL | None = None
    video_url: VideoURL | None = None
    audio_url: AudioURL | None = None
    input_audio: InputAudio | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_part(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in ("text", "image_url", "video_url", "audio_url", "input_audio"):
            raise ValueError(f"a content part of type {kind!r} is not supported: the served models read text and "
                             "(multimodal models) images, videos and audio; send {'type': 'text', 'text': ...}, "
                             "{'type': 'image_url', 'image_url': {'url': ...}}, {'type': 'video_url', "
                             "'video_url': {'url': ...}} or {'type': 'input_audio', 'input_audio': {'data': ..., "
                             "'format': 'wav'}} parts, or a string")
        if data.get(kind) is None or set(data) - {"type", kind}:
            raise ValueError(f"a content part of type {kind!r} holds the field {kind!r} alone")
        return data


class Prediction(_Strict):
    """OpenAI's Predicted Outputs: ``{"type": "content", "content": ...}``, the output the client expects (a string
    or text parts)."""

    type: Literal["content"]
    content: Text | list[TextPart]

    def text(self) -> str:
        return joined_text(self.content)


def joined_text(content: str | list[TextPart]) -> str:
    """A string, or text parts' texts joined."""
    return content if isinstance(content, str) else "".join(part.text for part in content)


class MessageFunctionCall(BaseModel):
    """The function an earlier assistant turn called: its ``arguments`` (JSON text, as OpenAI sends them, or an
    object) reach the chat template as a dict, as HF templates expect (vLLM does the same)."""

    model_config = ConfigDict(extra="allow")
    name: Text
    arguments: dict[str, Any] | Text | None = None

    @field_validator("arguments")
    @classmethod
    def _arguments_object(cls, value):
        return tool_call_arguments(value)


class MessageToolCall(BaseModel):
    """One call of an assistant message's ``tool_calls``: ``{"id", "type": "function", "function": {"name",
    "arguments"}}``."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: str = "function"
    function: MessageFunctionCall

    @field_validator("type")
    @classmethod
    def _function_calls_only(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"a tool call of type {value!r} is not supported: only function calls are; send "
                             "{'type': 'function', 'function': {'name': ..., 'arguments': ...}}")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, ...: handed to the chat template as is
    role: str
    content: Text | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls (its content may then be null)
    tool_call_id: str | None = None  # a tool message's: the call it answers

    def check(self, index: int) -> None:
        """A 400 in OpenAI's terms for an unknown role or a message without content (an assistant message may
        omit it when it carries tool calls), before the chat template sees it."""
        if self.role not in CHAT_ROLES:
            raise bad_request(f"messages[{index}].role={self.role!r} is not a valid role; use one of "
                              f"{', '.join(repr(r) for r in CHAT_ROLES)}", f"messages.{index}.role")
        if self.tool_calls is not None and self.role != "assistant":
            raise bad_request(f"messages[{index}].tool_calls is for assistant messages, not {self.role!r} ones; the "
                              "result of a call goes in a 'tool' message with tool_call_id and content",
                              f"messages.{index}.tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise bad_request(f"messages[{index}].content is null; a {self.role!r} message needs content: a "
                              "string or a list of text parts", f"messages.{index}.content")

    def as_template_dict(self) -> dict:
        """The message as chat templates read it: text parts joined into a string, or where it holds media, its
        parts as text parts and ``image_url`` / ``video_url`` / ``audio_url`` / ``input_audio`` ones
        (:func:`specray.chat.split_media` makes them image, video and audio parts)."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(part.type != "text" for part in self.content):
                data["content"] = [{"type": "text", "text": p.text} if p.type == "text"
                                   else {"type": p.type, p.type: getattr(p, p.type).model_dump(exclude_none=True)}
                                   for p in self.content]
            else:
                data["content"] = "".join(part.text for part in self.content)
        return data


# OpenAI chat parameters for features this server does not have: the values that leave the feature off (what
# client libraries often send anyway; null too) are dropped, any other is a 400 saying what is missing
_FEATURE_OFF = {
    "functions": (([],), "OpenAI's deprecated functions are not served: declare them in tools (and pick one with "
                         "tool_choice) instead"),
    "function_call": (("none",), "OpenAI's deprecated function_call is not served: use tool_choice (with tools) "
                                 "instead"),
    "modalities": ((["text"],), "the served models write text only"),
    "audio": ((), "the served models write text only (no audio output)"),
    "service_tier": (("auto", "default"), "there is one service tier"),
}


class FunctionDefinition(_Strict):
    """A function the model may call: its ``parameters`` are a JSON schema of its arguments (an object);
    ``strict`` is accepted and not used (a forced call's arguments always follow the schema, as in vLLM)."""

    name: Text = Field(min_length=1)
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    """OpenAI's ``{"type": "function", "function": {"name", "description", "parameters", "strict"}}``."""

    type: str
    function: FunctionDefinition

    @field_validator("type")
    @classmethod
    def _functions_only(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"a tool of type {value!r} is not supported: this server calls functions only; send "
                             "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
        return value


def required_calls_schema(tools: list[ChatTool], single_call: bool = False) -> dict:
    """The JSON schema of ``tool_choice="required"``'s output (vLLM's): an array of at least one call (at most one
    with ``single_call``), each ``{"name": <one tool's name>, "parameters": <that tool's parameters schema>}`` and
    nothing else (an anyOf over the tools). Each tool's ``$defs`` move to the top, where their ``#/$defs/...``
    references point; every other local reference (``#`` itself, ``#/definitions/...``, ``#/properties/...``) is
    rewritten to point into its tool's branch, where it pointed in the tool's own schema."""
    defs: dict[str, Any] = {}
    branches = []
    for index, tool in enumerate(tools):
        parameters = _rebased_refs(dict(tool.function.parameters or {"type": "object", "properties": {}}),
                                   f"#/items/anyOf/{index}/properties/parameters")
        for key, value in (parameters.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise bad_request(f"tools[{index}].function.parameters.$defs.{key} differs from another tool's "
                                  f"definition of {key!r}; tool_choice='required' puts every tool's $defs in one "
                                  "schema: rename one of them", f"tools.{index}.function.parameters.$defs.{key}")
            defs[key] = value
        branches.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if single_call:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


# a schema's keywords whose values are JSON data, not schemas (a "$ref" key inside them is no reference), and those
# whose values map names (a property's, a definition's) to schemas
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebased_refs(schema: Any, base: str) -> Any:
    """``schema`` with each local ``$ref`` (``#`` and ``#/...``) that does not point into its top-level ``$defs``
    prefixed with ``base``, the pointer of where ``schema`` now sits inside a larger schema. The given dicts are not
    changed."""
    if isinstance(schema, list):
        return [_rebased_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")) and not (
                value == "#/$defs" or value.startswith("#/$defs/")):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased_refs(item, base) for name, item in value.items()}
        else:
            out[key] = _rebased_refs(value, base)
    return out


def _named_choice(choice: dict) -> str:
    """The function a dict ``tool_choice`` names, or a 400 saying how to name one."""
    shape = "{'type': 'function', 'function': {'name': ...}}"
    if choice.get("type") != "function":
        raise bad_request(f"tool_choice.type={choice.get('type')!r:.100} is not supported: name a function as "
                          f"{shape}, or use 'none', 'auto' or 'required'", "tool_choice.type")
    function = choice.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise bad_request(f"tool_choice.function.name is missing: name the function to call, as {shape}",
                          "tool_choice.function.name")
    for param, extra in (("tool_choice", set(choice) - {"type", "function"}),
                         ("tool_choice.function", set(function) - {"name"})):
        if extra:
            name = f"{param}.{sorted(extra)[0]}"
            raise bad_request(f"{name} is not a supported parameter; remove it (a named tool choice is {shape})",
                              name)
    return function["name"]


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # vLLM's: the last message (an assistant's start) is continued, not closed; needs add_generation_prompt=false
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables for the chat template (enable_thinking)
    # vLLM's: the tokenizer's special tokens added to the rendered chat too (the template writes its own: off)
    add_special_tokens: bool = False
    chat_template: Text | None = None  # vLLM's: this request's own template (a server trusting them renders it)
    documents: list[dict[str, Any]] | None = None  # vLLM's: documents for a RAG chat template (its variable)
    metadata: dict[str, str] | None = None  # OpenAI's tags for stored completions: accepted, nothing is stored
    store: bool = False
    # OpenAI's function calling: the functions (given to the chat template), which to call ("none", "auto": the
    # model decides, read by the server's tool call parser; "required": one or more; or one named), and whether
    # several calls may come at once (false: "required" makes one call)
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # OpenAI's Predicted Outputs: drafts come from it where the engine drafts on the host (SamplingParams.prediction)
    prediction: Prediction | None = None
    # OpenAI's, for reasoning models: the chat template gets it as its variable reasoning_effort (a template that
    # reads it, as gpt-oss's, sets the effort; others ignore it); chat_template_kwargs' own value wins
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    _OFF: ClassVar[dict[str, tuple[tuple, str]]] = {**_GenerationRequest._OFF, **_FEATURE_OFF}

    @model_validator(mode="after")
    def _one_way_to_end_the_prompt(self):
        check_template_options(self)
        if self.store:
            raise bad_request("store=true is not supported: this server keeps no completions; omit it", "store")
        return self

    @model_validator(mode="after")
    def _messages_are_renderable(self):
        for index, message in enumerate(self.messages):
            message.check(index)
        return self

    def _check_tools(self) -> None:
        """A 400 for a function declared twice, a tool_choice that is none of OpenAI's, one without tools, or one
        naming a function that tools do not declare."""
        declared: dict[str, int] = {}
        for index, tool in enumerate(self.tools or []):
            name = tool.function.name
            if name in declared:
                raise bad_request(f"tools[{index}].function.name={name!r} is declared twice (tools[{declared[name]}] "
                                  "too); give each function its own name", f"tools.{index}.function.name")
            declared[name] = index
        choice = self.tool_choice
        if isinstance(choice, str) and choice not in TOOL_CHOICES:
            raise bad_request(f"tool_choice={choice!r:.100} is not supported; use 'none', 'auto', 'required', or "
                              "{'type': 'function', 'function': {'name': ...}} to call one function", "tool_choice")
        name = _named_choice(choice) if isinstance(choice, dict) else None
        if choice not in (None, "none") and not self.tools:
            raise bad_request(f"tool_choice={choice!r:.100} needs tools: declare the functions the model may call, "
                              "as tools=[{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}], or "
                              "omit tool_choice", "tool_choice")
        if name is not None and name not in declared:
            raise bad_request(f"tool_choice.function.name={name!r:.100} names no function in tools (declared: "
                              f"{list(declared)}); name one of them", "tool_choice.function.name")

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's variables: ``chat_template_kwargs``, over ``reasoning_effort``."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def tool_mode(self) -> str:
        """What ``tool_choice`` asks for: "none", "auto", "required" or "named" (OpenAI's default: "auto" with
        tools, else "none")."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        return "named" if isinstance(choice, dict) else choice

    def named_function(self) -> tuple[int, FunctionDefinition] | None:
        """The function a named tool choice calls, with its index in ``tools``."""
        choice = self.tool_choice
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        return next(((i, t.function) for i, t in enumerate(self.tools or []) if t.function.name == name), None)

    def _tool_constraint(self) -> tuple[str, str, Any] | None:
        """A named function's arguments follow its parameters schema (any object without one); "required" gives
        an array of calls (:func:`required_calls_schema`)."""
        mode = self.tool_mode()
        if mode == "named":
            found = self.named_function()
            if found is None:
                return None
            index, function = found
            return f"tools.{index}.function.parameters", "json", function.parameters or {"type": "object"}
        if mode == "required" and self.tools:
            return "tools", "json", required_calls_schema(self.tools, single_call=self.parallel_tool_calls is False)
        return None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request(f"top_logprobs={self.top_logprobs} requires logprobs=true", "top_logprobs")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class LoadLoRAAdapterRequest(_Strict):
    """vLLM's POST /v1/load_lora_adapter (with --enable-runtime-lora-updating)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # vLLM's: replace an adapter already loaded under that name


class UnloadLoRAAdapterRequest(_Strict):
    """vLLM's POST /v1/unload_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; the name decides here


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a ``prompt``, or chat ``messages`` rendered by the chat template as a chat completion's."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # declared to the chat template, as a chat completion's
    add_special_tokens: bool = True  # for a prompt (a rendered chat holds its own)
    chat_template: Text | None = None  # as a chat completion's

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of prompt (a string) and messages (a chat)",
                              "prompt" if self.prompt is None else "messages")
        for index, message in enumerate(self.messages or []):
            message.check(index)
        if self.messages is not None:
            check_template_options(self)
        return self


class DetokenizeRequest(_Strict):
    """vLLM's /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int]


def template_tools(tools: list[ChatTool] | None) -> list[dict] | None:
    """A request's tools as the chat template takes them (OpenAI's dicts), None for none. They are rendered
    whatever tool_choice says, "none" too (vLLM's default: the prompt stays the same from turn to turn)."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


def parse_request(model_cls: type[BaseModel], body: Any) -> BaseModel:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model_cls.model_validate(body)
    except ValidationError as err:
        raise from_validation_error(err) from None


# ---- request -> SamplingParams -------------------------------------------------------------------------

def sampling_params(req: _GenerationRequest, max_tokens: int | None, logprobs: int | None,
                    choice: int, defaults: dict[str, Any] | None = None,
                    prediction: list[int] | None = None) -> SamplingParams:
    """The engine parameters of choice ``choice`` (0-based) of ``req``; a seed is offset by the choice so
    the n choices differ but each is reproducible. ``defaults``: what the fields ``req`` leaves unset take
    (the model's generation config's), over OpenAI's defaults. ``prediction``: the request's prediction as token
    ids (tokenized by the server, as prompts are)."""
    defaults = defaults or {}

    def given(name: str, fallback: Any) -> Any:
        value = getattr(req, name)
        return defaults.get(name, fallback) if value is None else value

    kwargs: dict[str, Any] = dict(
        temperature=given("temperature", 1.0),
        top_p=given("top_p", 1.0),
        top_k=0 if req.top_k == -1 else given("top_k", 0),
        min_p=given("min_p", 0.0),
        seed=None if req.seed is None else choice_seed(req.seed, choice),
        max_tokens=max_tokens,
        stop=req.stop_list(),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=given("repetition_penalty", 1.0),
        logit_bias=req.logit_bias or None,
        min_tokens=req.min_tokens or 0,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=list(req.bad_words or []),
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        cache_salt=req.cache_salt,
        priority=req.priority,
        structured_outputs=req.structured_outputs_params(),
        prediction=prediction,
    )
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    # a prompt's n choices share its logprobs: the first computes them, unless each echoes its prompt as it streams
    if req.num_prompt_logprobs() is not None and (choice == 0 or getattr(req, "echo", False)):
        kwargs["prompt_logprobs"] = req.num_prompt_logprobs()
    if req.speculative is not None and req.speculative.num_tokens() is not None:
        kwargs["num_speculative_tokens"] = req.speculative.num_tokens()
    if req.speculative is not None and req.speculative.method is not None:
        kwargs["speculative_method"] = req.speculative.method
    try:
        return SamplingParams(**kwargs)
    except ValueError as err:
        raise from_value_error(err, structured_param=req.structured_outputs_param()) from None


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, limit_param: str,
                  prompt_param: str = "prompt") -> None:
    """400 ``context_length_exceeded`` when the prompt (plus the requested output) does not fit; ``prompt_param``:
    the request's field that gave the prompt (a chat's ``messages``, an audio request's ``file``)."""
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt_tokens} tokens (at least one must be left to generate); shorten the prompt",
            prompt_param, "context_length_exceeded")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} to "
            f"generate); lower {limit_param} to at most {max_model_len - num_prompt_tokens} or shorten the prompt",
            limit_param, "context_length_exceeded")


# ---- responses -----------------------------------------------------------------------------------------

class SpeculativeUsage(BaseModel):
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 1.0

    @classmethod
    def from_stats(cls, stats: SpecStats) -> "SpeculativeUsage":
        return cls(drafts=stats.drafts, draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted_tokens,
                   acceptance_rate=stats.acceptance_rate, mean_accepted_length=stats.mean_accepted_length)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens read from the prefix cache (enable_prefix_caching), not computed


class CompletionTokensDetails(BaseModel):
    """OpenAI's, with Predicted Outputs: the prediction's tokens the drafts took that the target kept, and those
    it did not (the latter cost steps as the completion's own tokens do)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | None = None  # only for a request with a prediction
    speculative: SpeculativeUsage

    @model_serializer(mode="wrap")
    def _without_absent_details(self, handler):
        data = handler(self)
        if data.get("completion_tokens_details") is None:
            data.pop("completion_tokens_details", None)
        return data


def make_usage(prompt_tokens: int, completion_tokens: int, stats: SpecStats, cached_tokens: int = 0,
               predicted: SpecStats | None = None) -> Usage:
    """``predicted``: the speculation counters of the choices that drafted from a prediction (None: no choice
    had one)."""
    details = None if predicted is None else CompletionTokensDetails(
        accepted_prediction_tokens=predicted.accepted_tokens,
        rejected_prediction_tokens=predicted.draft_tokens - predicted.accepted_tokens)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
                 completion_tokens_details=details, speculative=SpeculativeUsage.from_stats(stats))


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's shape of one entry of ``prompt_logprobs``: ``rank`` is the token's place in the vocabulary by
    logprob (1 the likeliest)."""

    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobsJSON = list[dict[str, PromptLogprob] | None]  # per prompt token: token id (a string) -> its entry


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token id that ended the choice (null: EOS, the length, or not ended yet)
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsJSON | None = None  # vLLM's, when asked for
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids (streamed: in the first chunk)
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids (streamed: the chunk's new ones)


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text of an object, as generated


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    # None: a reasoning model's thinking never ended, so no answer came (reasoning_parser), or tool calls only
    content: str | None
    reasoning_content: str | None = None  # vLLM's: the thinking, with a reasoning_parser
    tool_calls: list[ToolCall] = Field(default_factory=list)  # [] without calls, as vLLM answers


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's, as a completion choice's
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsJSON | None = None  # vLLM's, when asked for
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class ChatChunkChoice(BaseModel):
    index: int
    # {"role": ...} first, then {"content": ...} and/or {"tool_calls": [...]}, then {} with the finish reason
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's, in the chunk that finishes the choice
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids: the chunk's new ones


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids: in each choice's first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specray"
    max_model_len: int
    root: str | None = None  # an adapter's folder (vLLM's)
    parent: str | None = None  # an adapter's base model (vLLM's)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    """A completion's id (``chatcmpl-<hex>``, ``cmpl-<hex>``); the Responses API's objects join with an underscore
    as OpenAI's do (``resp_<hex>``, ``msg_<hex>``, ``rs_<hex>``, ``fc_<hex>``)."""
    return f"{prefix}{'_' if prefix in RESPONSES_ID_PREFIXES else '-'}{uuid.uuid4().hex}"


RESPONSES_ID_PREFIXES = frozenset({"resp", "msg", "rs", "fc"})


def new_tool_call_id() -> str:
    """A tool call's id, vLLM's form: ``chatcmpl-tool-<random hex>``."""
    return new_id("chatcmpl-tool")


def now() -> int:
    return int(time.time())


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    data = payload.model_dump() if isinstance(payload, BaseModel) else payload
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


# ---- logprobs ------------------------------------------------------------------------------------------

class TextCursor:
    """Where the next token's text starts in a completion's text (OpenAI's ``text_offset``): the characters the
    tokens so far complete, a token holding part of a character placed where that character starts (the bytes of a
    character begun and not finished wait in the decoder)."""

    def __init__(self, chars: int = 0):
        self.chars = chars
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, raw: bytes) -> int:
        """A token of bytes ``raw``: its offset; the cursor moves past the characters it completes."""
        at = self.chars
        self.chars += len(self._decoder.decode(raw))
        return at


class LogprobFormatter:
    """Turns the engine's per-token ``{token_id: Logprob}`` maps into OpenAI's two logprob formats and vLLM's
    ``prompt_logprobs``. A token's string is its ``decoded_token`` (the engine's), else decoded here (cached)."""

    def __init__(self, tokenizer, as_token_ids: bool = False):
        self.tokenizer = tokenizer
        self.token = TokenTexts(tokenizer)
        # vLLM's return_tokens_as_token_ids: every token named "token_id:<id>" (text offsets then count those
        # names, as vLLM's do), for clients that must tell apart tokens whose texts are alike or not valid UTF-8
        self.as_token_ids = as_token_ids

    def _name(self, token_id: int, logprob: Logprob | None) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        text = None if logprob is None else logprob.decoded_token
        return self.token(token_id) if text is None else text

    def _bytes(self, token_id: int, name: str) -> bytes:
        """A token's bytes: those it stands for (a part of a character's too, whose name is U+FFFD), or with
        ``as_token_ids`` its name's."""
        return name.encode("utf-8") if self.as_token_ids else self.token.bytes_of(token_id)

    def completion(self, token_ids: list[int], logprobs: SampleLogprobs, num: int,
                   cursor: TextCursor | None = None) -> CompletionLogprobs:
        """Legacy format: each token, its logprob, the top ``num`` alternatives plus the chosen token, and each
        token's character offset in the generated text, from ``cursor`` on (a stream's, carried from its earlier
        chunks; else from 0), which it advances."""
        cursor = TextCursor() if cursor is None else cursor
        out = CompletionLogprobs()
        for token_id, entry in zip(token_ids, logprobs):
            chosen = entry.get(token_id)
            text = self._name(token_id, chosen)
            top = _ranked(entry)[:num]
            if chosen is not None and token_id not in (t for t, _ in top):
                top.append((token_id, chosen))
            out.tokens.append(text)
            out.token_logprobs.append(_finite(chosen))
            out.top_logprobs.append({self._name(t, lp): _finite(lp) for t, lp in top})
            out.text_offset.append(cursor.advance(self._bytes(token_id, text)))
        return out

    def echoed_prompt(self, token_ids: list[int], logprobs: PromptLogprobs, num: int,
                      cursor: TextCursor | None = None) -> CompletionLogprobs:
        """The legacy format for an echoed prompt: as :meth:`completion`, but the first token has no logprob and
        no alternatives (null), as nothing precedes it."""
        cursor = TextCursor() if cursor is None else cursor
        first = self._name(token_ids[0], None)
        offset = cursor.advance(self._bytes(token_ids[0], first))
        out = self.completion(token_ids[1:], logprobs[1:], num, cursor)
        return CompletionLogprobs(tokens=[first] + out.tokens, token_logprobs=[None] + out.token_logprobs,
                                  top_logprobs=[None] + out.top_logprobs, text_offset=[offset] + out.text_offset)

    def prompt_logprobs(self, logprobs: PromptLogprobs, num: int) -> PromptLogprobsJSON:
        """vLLM's ``prompt_logprobs``: per prompt token null (the first) or {token id: {logprob, rank,
        decoded_token}} for the token itself and the ``num`` most likely."""
        out: PromptLogprobsJSON = []
        for entry in logprobs:
            if entry is None:
                out.append(None)
                continue
            token_id = next(iter(entry))  # the prompt token comes first
            ranked = _ranked(entry)[:num]
            chosen = [] if token_id in (t for t, _ in ranked) else [(token_id, entry[token_id])]
            out.append({str(t): PromptLogprob(logprob=_finite(lp), rank=lp.rank, decoded_token=self._name(t, lp))
                        for t, lp in chosen + ranked})
        return out

    def chat(self, token_ids: list[int], logprobs: SampleLogprobs, num: int) -> ChatLogprobs:
        """Chat format: per token {token, logprob, bytes, top_logprobs (the best ``num``)}."""
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            content.append(TokenLogprob(
                **self._top(token_id, entry.get(token_id)).model_dump(),
                top_logprobs=[self._top(t, lp) for t, lp in _ranked(entry)[:num]],
            ))
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: Logprob | None) -> TopLogprob:
        text = self._name(token_id, logprob)
        return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(self._bytes(token_id, text)))


def _ranked(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    """An entry's tokens, most likely first (the chosen token may stand among them)."""
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)


def _finite(logprob: Logprob | None) -> float:
    value = None if logprob is None else logprob.logprob
    if value is None or value != value:  # missing or NaN
        return LOGPROB_FLOOR
    return max(float(value), LOGPROB_FLOOR)


# ---- audio transcriptions and translations (OpenAI's /v1/audio/*: multipart forms) -------------------------------

AUDIO_TASKS = {"transcriptions": "transcribe", "translations": "translate"}
AUDIO_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")  # OpenAI's, for an audio's text
SEGMENT_FORMATS = ("verbose_json", "srt", "vtt")  # the formats that give segments: the audio's clips, timed


class TranscriptionRequest(_Strict):
    """OpenAI's audio transcription (``/v1/audio/transcriptions``) and translation (``/v1/audio/translations``, into
    English) form, less its ``file``: the text fields as sent (forms carry strings)."""

    model: str | None = None
    language: str | None = None  # ISO-639-1 ("en"), transcriptions only
    prompt: str | None = None  # text the transcript continues or whose style it follows
    response_format: str = "json"
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    stream: bool = False
    # "segment" (with verbose_json), from the form's timestamp_granularities[] fields
    timestamp_granularities: list[str] = Field(default_factory=list)

    @field_validator("response_format")
    @classmethod
    def _served_format(cls, value: str) -> str:
        if value not in AUDIO_FORMATS:
            raise bad_request(f"response_format={value!r} is not served: send one of "
                              f"{', '.join(repr(f) for f in AUDIO_FORMATS)}", "response_format")
        return value

    @model_validator(mode="after")
    def _segments(self) -> "TranscriptionRequest":
        if self.stream and self.response_format in SEGMENT_FORMATS:
            raise bad_request(f"stream=true writes the text as it comes (response_format 'json' or 'text'), not "
                              f"{self.response_format!r}, whose segments come once every clip is done; leave stream "
                              "out", "stream")
        for granularity in self.timestamp_granularities:
            if granularity == "word":
                raise bad_request("timestamp_granularities 'word' is not served: the models served here write no "
                                  "timestamps of their own; 'segment' gives the times of the clips the audio is cut "
                                  "into", "timestamp_granularities")
            if granularity != "segment":
                raise bad_request(f"timestamp_granularities {granularity!r} is neither 'segment' nor 'word'",
                                  "timestamp_granularities")
            if self.response_format != "verbose_json":
                raise bad_request("timestamp_granularities needs response_format 'verbose_json' (as OpenAI's does)",
                                  "timestamp_granularities")
        return self

    @field_validator("language")
    @classmethod
    def _language_code(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[a-z]{2,3}", value):
            raise bad_request(f"language={value!r} must be an ISO-639-1 code such as 'en'", "language")
        return value


def parse_audio_form(raw: bytes, content_type: str | None, task: str) -> tuple[TranscriptionRequest, bytes]:
    """An audio request's form (``multipart/form-data``, as OpenAI's clients send it): its fields and the audio
    file's bytes; 400s naming what is missing or not served."""
    import email.parser
    import email.policy

    if not content_type or not content_type.lower().startswith("multipart/form-data"):
        raise bad_request("an audio request must be a multipart/form-data form with the audio as its 'file' field "
                          "(as OpenAI's clients send it)")
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + raw)
    if not message.is_multipart():
        raise bad_request("the request body is not a multipart form: send the audio as its 'file' field")
    fields: dict[str, Any] = {}
    audio = None
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        data = part.get_payload(decode=True) or b""
        if name == "file":
            if audio is not None:  # (else the last would be transcribed, the others dropped unsaid)
                raise bad_request("the form has more than one 'file' field: send one audio per request", "file")
            audio = data
        elif name in ("include[]", "include"):
            raise bad_request("include is not served: this server writes no logprobs of a transcript; leave it out",
                              "include")
        elif name in ("timestamp_granularities[]", "timestamp_granularities"):
            fields.setdefault("timestamp_granularities", []).append(data.decode(errors="replace"))
        elif name:
            try:
                fields[name] = data.decode()
            except UnicodeDecodeError:
                raise bad_request(f"the form field {name!r} is not UTF-8 text", name) from None
    if audio is None:
        raise bad_request("the form has no 'file' field holding the audio (a WAV, MP3, FLAC, Ogg, ... file)", "file")
    if not audio:
        raise bad_request("the form's 'file' field is empty (0 bytes): send the audio file's bytes in it", "file")
    if task == "translate" and "language" in fields:
        raise bad_request("language is not a translation's field: a translation is always into English; leave it "
                          "out", "language")
    return parse_request(TranscriptionRequest, fields), audio
