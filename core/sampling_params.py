"""Per-request sampling parameters (vLLM's names and defaults). Plain data, torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from specray.lora import LoRARequest

# What a request's own random stream (torch.Generator.manual_seed) accepts: a signed or unsigned 64-bit int.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
TOP_K_MAX = (1 << 31) - 1  # the sampler packs top_k into a tensor; any k past the vocabulary means all of it
OUTPUT_KINDS = ("cumulative", "delta", "final_only")  # vLLM's RequestOutputKind


@dataclass
class SamplingParams:
    """How to sample one request.

    ``temperature == 0`` is greedy; a positive temperature however small samples among the largest logits (their
    ties), never overflowing. ``top_k`` of 0 or -1 disables top-k; ``top_p == 1`` disables top-p (however small, it
    keeps the most likely token); ``min_p == 0`` disables min-p. ``seed`` gives the request its own random stream,
    so the same seed gives the same output without speculation. With speculation, verification draws from the stream
    as many numbers as the step verifies drafts, so the output repeats when the drafts do: a fixed draft count
    (``adaptive=False``) and a drafter whose proposals depend on the request alone. Adaptive drafting sizes drafts
    by the measured cost of a step and what the engine has learnt, and a shared n-gram pool or suffix tree by other
    requests' text, so there a seeded request's output can differ from run to run (each one an exact sample of the
    target).

    ``logprobs=k`` (k >= 0, or -1 for the whole vocabulary, as vLLM's) returns, for every output token, a dict
    {token_id: :class:`~specray.outputs.Logprob`} holding the chosen token and the k most likely tokens, and
    ``cumulative_logprob``, the chosen tokens' sum. The values are vLLM's default "raw logprobs": log_softmax of the
    target model's raw logits at that position, before temperature, top-k/top-p/min-p (so they do not depend on
    the sampling parameters). None (the default) computes nothing.

    ``prompt_logprobs=k`` (vLLM's, k >= 0 or -1) returns the same for every prompt token:
    ``RequestOutput.prompt_logprobs`` holds None for the first token (nothing precedes it), then one entry per later
    prompt token, that token first, then the k most likely at its position (the target's raw log_softmax after the
    tokens before it). The prompt's logits are computed chunk by chunk and reduced on the device to these entries.

    ``presence_penalty``, ``frequency_penalty`` (OpenAI's, in [-2, 2]) and ``repetition_penalty`` (> 0, 1 is off)
    are vLLM's: with c_v the times token v occurs in the output so far, each logit drops by
    ``frequency_penalty * c_v + presence_penalty * [c_v > 0]``, and for every token of the prompt or the output
    so far a positive logit is divided by ``repetition_penalty`` and a negative one multiplied by it
    (transformers' ``repetition_penalty``). ``logit_bias`` (OpenAI's) adds ``{token_id: bias}`` (bias in
    [-100, 100]) to those logits first. They shape the distribution sampled from, greedy included; with
    speculation every verified position is penalized by the tokens before it, drafts included, so the output is
    the one decoding without speculation gives. Logprobs stay raw (before penalties).

    ``allowed_token_ids`` (vLLM's) gives every other token no probability. ``bad_words`` (vLLM's) are strings the
    output must not contain as tokens: each is tokenized at admission as it reads alone and after a space
    (``bad_words_token_ids``, filled by the engine), and a sequence's last token gets no probability where the
    output so far ends with the rest of it (a one-token word: everywhere). Like the penalties they apply at every
    verified position, drafts on the path counted, so greedy output is plain decoding's and sampled output follows
    the constrained distribution exactly.

    ``truncate_prompt_tokens=k`` (vLLM's) keeps only the prompt's last k tokens (left truncation; None keeps it
    whole).

    ``min_tokens`` (vLLM's) keeps a request from ending before it has that many output tokens: its stop token ids,
    and EOS unless ``ignore_eos``, get no probability until then, and stop strings are not looked for.

    ``num_speculative_tokens`` is a specray extension: the most draft tokens verified per step for this request.
    None follows the engine's ``speculative_config``; 0 turns speculation off for this request; k > 0 allows at
    most k, capped (silently, never an error) by the engine's ``num_speculative_tokens``. It has no effect on an
    engine without speculation, and greedy output is the same whatever its value.

    ``speculative_method`` is a specray extension too: the drafting method for this request. None follows the
    engine's ``speculative_config``; a name picks that method (``"suffix"``, ``"ngram_mod"``, ...), drafted with
    its default options and the engine's ``num_speculative_tokens``. A request may pick the engine's own method or
    a built-in method without a model of its own whose proposals are cheap (a lookup:
    ``specray.drafters.registry.request_methods()``); anything else, or any method on an engine without
    speculation, is refused at admission with a ValueError. Greedy output is the same whatever its value.

    ``cache_salt`` (vLLM's, which takes it on the prompt; ``LLM.generate`` accepts it there too, and the OpenAI
    server as a request field): with prefix caching on, a request reuses only blocks computed by requests with the
    same salt (None is a salt of its own), so tenants that do not share a salt cannot learn from the cache's timing
    what another sent.

    ``structured_outputs`` (vLLM's :class:`StructuredOutputsParams`): the output follows a JSON schema, a regex, one
    of a list of strings, or a grammar. Every verified position's logits keep only the tokens the grammar allows
    after the tokens before it (drafts on the path included), before temperature and the other warpers; drafts the
    grammar refuses are cut, and tokens the grammar forces are drafted for free. Greedy output is the one decoding
    without speculation gives, and sampled output follows the constrained distribution exactly. The request ends
    ("stop") when the grammar is complete and can take nothing more.

    ``prediction`` (OpenAI's Predicted Outputs): most of the output the caller expects (a file to come back with
    a few edits), as text or token ids. On an engine that drafts on the host (a lookup or a draft model) the request
    drafts from it (method ``"prediction"``, :mod:`specray.drafters.prediction`) unless it picks another
    ``speculative_method``; a draft head in the worker uses it when combined with it (``combine_with:
    "prediction"``); elsewhere (no speculation, a head without it) it is not used. The output is the same either
    way: every draft is verified. The engine turns text into token ids at admission.

    ``priority`` (vLLM's): on an engine with ``scheduling_policy="priority"`` waiting requests are admitted, and
    running ones given KV blocks, lowest value first (ties: first come, first served), and a request that must give
    its blocks back when they run out is the running one with the highest value (the newest among equals). An
    engine scheduling first come, first served refuses any value but 0.

    ``output_kind`` (vLLM's ``RequestOutputKind``): ``"cumulative"`` (the default) reports the request after every
    step it takes part in, with all its tokens and text so far; ``"delta"`` reports it as often, with only what is
    new since its last report (tokens, text, logprobs; the prompt in the first report only; see
    :class:`~specray.outputs.RequestOutput`): a stream's cost per step stays the size of the step, not of the
    output (the Serve app's engine replicas send deltas); ``"final_only"`` reports it once, when it finishes, and
    decodes its text once then (per step only when it has stop strings to look for): what ``LLM.generate`` asks
    for, as only finished outputs reach its caller. While a request has stop strings (and
    ``include_stop_str_in_output`` is off) and is not finished, its reported text leaves out the last
    ``max(len(stop)) - 1`` characters, where a stop string may still begin (vLLM's stop buffer), so text once
    reported is never taken back. The EOS or stop token id that ends a request stays in its token ids but not in
    its text, special or not (vLLM's), unless ``include_stop_str_in_output``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (no text, no logprobs' decoded tokens), as vLLM's
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] = field(default_factory=list)
    # bad_words as token sequences: filled by the engine at admission from its tokenizer (None until then)
    bad_words_token_ids: list[list[int]] | None = None
    num_speculative_tokens: int | None = None  # specray extension; see the class docstring
    speculative_method: str | None = None  # specray extension; see the class docstring
    output_kind: str = "cumulative"  # vLLM's RequestOutputKind: "cumulative", "delta" or "final_only"
    cache_salt: str | None = None  # vLLM's (on the prompt there): see the class docstring
    # OpenAI's Predicted Outputs: the output expected, as text or token ids (see the class docstring)
    prediction: str | list[int] | None = None
    # vLLM's: with scheduling_policy="priority", lower values are scheduled first (see the class docstring)
    priority: int = 0
    # vLLM's (an argument of generate there): the LoRA adapter this request runs with (specray.lora), None: none
    lora_request: LoRARequest | None = None
    # vLLM's: the output follows a JSON schema, a regex, a choice or a grammar (see StructuredOutputsParams)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.lora_request, dict):
            self.lora_request = LoRARequest(**self.lora_request)
        self.stop = _as_list("stop", self.stop, "a string or a list of strings")
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids, "a list of token ids", one_string=False)
        self.bad_words = _as_list("bad_words", self.bad_words, "a string or a list of strings")
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be an int >= 1 (the completions to return for the prompt)")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 means greedy)")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]; use 1 to disable top-p")
        if not is_int(self.top_k) or not 0 <= self.top_k <= TOP_K_MAX:
            raise ValueError(f"top_k={self.top_k!r} must be an int in [0, {TOP_K_MAX}], or -1/0 to disable top-k")
        if not _is_finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1]; use 0 to disable min-p")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an int >= 1 (or None for up to max_model_len)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r}: every stop string must be a non-empty string")
        if self.stop and self.detokenize is not True:
            raise ValueError(f"stop={self.stop!r} needs the output's text, and detokenize={self.detokenize!r}: set "
                             "detokenize=True, or stop on token ids (stop_token_ids)")
        for name in ("detokenize", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: every entry must be a token id >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < -1):
                raise ValueError(f"{name}={value!r} must be an int >= 0, -1 for the whole vocabulary, or None")
        if self.seed is not None:
            check_seed(self.seed, " or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}={value!r} must be a number in [-2, 2] (0 turns it off)")
        if not _is_finite(self.repetition_penalty) or not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be a number > 0 (1 turns it off; "
                             "above 1 discourages repeats)")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens!r} must be an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}; lower min_tokens or "
                             "raise max_tokens")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias={self.logit_bias!r} must map token ids to biases in [-100, 100]")
            for token, bias in self.logit_bias.items():
                if not is_int(token) or token < 0 or not _is_finite(bias) or not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias={{{token!r}: {bias!r}, ...}}: each key must be a token id >= 0 "
                                     "and each bias a number in [-100, 100]")
        if self.allowed_token_ids is not None and (not isinstance(self.allowed_token_ids, (list, tuple)) or
                                                   not self.allowed_token_ids or
                                                   any(not is_int(t) or t < 0 for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids={self.allowed_token_ids!r} must be a non-empty list of token ids >= 0 "
                             "(or None: every token allowed)")
        k = self.truncate_prompt_tokens
        if k is not None and (not is_int(k) or k < 1):
            raise ValueError(f"truncate_prompt_tokens={k!r} must be an int >= 1 (the prompt tokens to keep, from its "
                             "end) or None")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words={self.bad_words!r}: every bad word must be a string with a non-space "
                             "character")
        sequences = self.bad_words_token_ids
        if sequences is not None:
            if not self.bad_words:
                raise ValueError("bad_words_token_ids is filled by the engine from bad_words (as the tokenizer reads "
                                 "them); give the words in bad_words")
            if not isinstance(sequences, list) or any(not isinstance(s, list) or not s or not all(
                    is_int(t) and t >= 0 for t in s) for s in sequences):
                raise ValueError(f"bad_words_token_ids={sequences!r:.80} must be a list of token-id sequences "
                                 "(non-empty lists of ints >= 0), or None for the engine to fill")
        k = self.num_speculative_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
            raise ValueError(f"num_speculative_tokens={k!r} must be an int >= 0 (0 turns speculation off for this "
                             "request) or None (the engine's setting)")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind={self.output_kind!r} must be one of {list(OUTPUT_KINDS)} ('cumulative': "
                             "every step's output so far; 'delta': what each step added; 'final_only': the finished "
                             "output only)")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt={self.cache_salt!r} must be a non-empty string, or None (no salt)")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs={self.structured_outputs!r} must be a StructuredOutputsParams, "
                                 "a dict of its fields, or None")
            self.structured_outputs.check()
        prediction = self.prediction
        if prediction is not None and not isinstance(prediction, str) and (
                not isinstance(prediction, (list, tuple)) or any(not is_int(t) or t < 0 for t in prediction)):
            raise ValueError(f"prediction={prediction!r:.100} must be the expected output's text or its token ids "
                             "(ints >= 0), or None")
        if self.lora_request is not None and not isinstance(self.lora_request, LoRARequest):
            raise ValueError(f"lora_request={self.lora_request!r:.100} must be a specray.LoRARequest, a dict of its "
                             "fields, or None")
        if not is_int(self.priority):
            raise ValueError(f"priority={self.priority!r} must be an int (lower values are scheduled first)")
        method = self.speculative_method
        if method is not None and (not isinstance(method, str) or not method):
            raise ValueError(f"speculative_method={method!r} must be a drafting method's name, e.g. 'suffix', or "
                             "None (the engine's speculative_config)")

    def check(self, vocab_size: int | None = None) -> None:
        """Admission: validate again (a field may have changed since construction) and, given the model's
        ``vocab_size``, what needs the model: token ids inside its vocabulary, at most all of it as logprobs."""
        self._validate()
        if vocab_size is None:
            return
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids contains {bad[:5]} outside the vocabulary [0, {vocab_size}); drop them")
        bad = [t for t in self.logit_bias or {} if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias={{{bad[0]}: ...}} names token ids {bad[:5]} outside the vocabulary "
                             f"[0, {vocab_size}); drop them")
        bad = [t for seq in self.bad_words_token_ids or [] for t in seq if t >= vocab_size]
        if bad:
            raise ValueError(f"bad_words_token_ids contains {bad[:5]} outside the vocabulary [0, {vocab_size}); drop "
                             "them")
        bad = [t for t in self.allowed_token_ids or [] if t >= vocab_size]
        if bad:
            raise ValueError(f"allowed_token_ids contains {bad[:5]} outside the vocabulary [0, {vocab_size}); drop "
                             "them")
        if isinstance(self.prediction, (list, tuple)):
            bad = [t for t in self.prediction if t >= vocab_size]
            if bad:
                raise ValueError(f"prediction contains token ids {bad[:5]} outside the vocabulary [0, {vocab_size}); "
                                 "drop them")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(f"{name}={value} exceeds the vocabulary size {vocab_size}; ask for fewer")

    def prompt_tokens(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt the request runs on: its last ``truncate_prompt_tokens`` tokens, or all of it."""
        k = self.truncate_prompt_tokens
        return list(prompt_token_ids) if k is None else list(prompt_token_ids[-k:])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty, a logit bias, ``min_tokens``, ``allowed_token_ids`` or ``bad_words`` shapes this
        request's distribution."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.min_tokens > 0 or self.allowed_token_ids is not None
                or bool(self.bad_words))


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``; exactly one of the first five):

    - ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON value it accepts.
    - ``regex``: the output matches this regular expression whole.
    - ``choice``: the output is one of these strings.
    - ``grammar``: a context-free grammar in Lark syntax (llguidance's dialect), or in GBNF (llama.cpp's, told
      apart by its ``::=`` rules).
    - ``json_object``: True: the output is any JSON object (OpenAI's ``response_format={"type": "json_object"}``).

    ``disable_any_whitespace``: JSON without whitespace between its tokens (compact separators); by default any
    whitespace is allowed there, as in vLLM. ``disable_additional_properties``: objects in a JSON schema that do not
    say otherwise take no properties beyond the listed ones."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def _given(self, kind: str) -> bool:
        """Whether the constraint ``kind`` is set: not None (json_object: True; False is unset too), so that a
        wrong value such as ``json=False`` is named as wrong rather than taken for no constraint."""
        value = getattr(self, kind)
        return value is not None and not (kind == "json_object" and value is False)

    def check(self) -> None:
        given = [k for k in STRUCTURED_KINDS if self._given(k)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs sets {given or 'none'} of {list(STRUCTURED_KINDS)}: set exactly one "
                             "(json: a JSON schema, regex, choice: a list of strings, grammar: Lark or GBNF, or "
                             "json_object=True)")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json={self.json!r} must be a JSON schema: a dict or its JSON text")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}={value!r} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice={self.choice!r} must be a non-empty list of non-empty "
                             "strings")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object={self.json_object!r} must be True or None")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name}={getattr(self, name)!r} must be True or False")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if self._given(k))


def choice_seed(seed: int, choice: int) -> int:
    """The seed of a request's choice ``choice`` (0-based) when it asks for n > 1: ``seed + choice``, wrapped to
    stay in [SEED_MIN, SEED_MAX], so the choices differ and each is reproducible."""
    value = seed + choice
    return value if value <= SEED_MAX else value - (1 << 64)


def _as_list(name: str, value: Any, what: str, one_string: bool = True) -> list:
    """A list-valued field given as a list or tuple, None (empty) or, where ``one_string``, one string (one item);
    anything else is a ValueError."""
    if value is None:
        return []
    if isinstance(value, str) and one_string:
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"{name}={value!r} must be {what}")


def check_seed(seed: Any, also: str = "") -> None:
    """A seed a random stream accepts: an int in [SEED_MIN, SEED_MAX]; ``also`` names what else is allowed."""
    if not is_int(seed) or not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"seed={seed!r} must be an int in [{SEED_MIN}, {SEED_MAX}] (64 bits){also}")


def is_int(value) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    """A real number a step can turn into a float tensor (not NaN, not infinite, not too large for a float)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
