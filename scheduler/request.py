"""One generation request as the scheduler sees it: its tokens, its KV bookkeeping, and its counters. Only the
scheduler mutates a :class:`Request`; the others read it (drafts come in through
``Scheduler.update_draft_token_ids``, the draft policy keeps its evidence itself).

Token bookkeeping (see ``specray.contract``): ``all_token_ids`` is the prompt followed by every kept output
token; ``num_computed_tokens`` of them have valid KV in the cache. While decoding, the newest token is never in
the cache yet (``num_computed_tokens == num_tokens - 1``): it is the first token the next step feeds.
"""

from __future__ import annotations

import enum
import itertools
import math
import time

from specray.multimodal import MultiModalInputs
from specray.outputs import SampleLogprobs, SpecStats
from specray.sampling_params import SamplingParams

_creation_order = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # a step failed for this request alone (the others went on)

    @property
    def is_finished(self) -> bool:
        return self in FINISH_REASONS


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(self, req_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: set[int] | frozenset = frozenset(), arrival_time: float | None = None,
                 multimodal: MultiModalInputs | None = None):
        self.req_id = req_id
        self.multimodal = multimodal  # its prompt's images (specray.multimodal), None for a text prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_order = (self.arrival_time, next(_creation_order))  # sort key; ties by creation
        self.output_token_ids: list[int] = []
        # One {token_id: Logprob} per output token when the request asked for logprobs (the engine appends
        # them after each step), else None. truncate_output keeps it the same length as output_token_ids.
        self.output_logprobs: SampleLogprobs | None = [] if sampling_params.logprobs is not None else None
        self.all_token_ids: list[int] = list(self.prompt_token_ids)  # appended in place, never rebuilt
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_contents: list[int] = []  # prefix caching: the content id of each registered block of the table
        self.num_cached_tokens = 0  # prompt tokens its first admission found in the prefix cache
        self.draft_token_ids: list[int] = []  # drafts to verify next (Scheduler.update_draft_token_ids)
        self.draft_parents: list[int] | None = None  # they form this token tree (specray.tree); None: a chain
        self.want_node_tokens = False  # the drafter wants the target's argmax after each of them (lookahead)
        self.drafts_from_worker = False  # they are the chain a worker-side drafter made (ScheduledChunk.worker_drafts)
        self.num_next_drafts: int | None = None  # a worker-side drafter makes this many after its step (None: most)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.spec_stats = SpecStats()  # this request's verifications
        self._stop_token_ids = frozenset(sampling_params.stop_token_ids)
        # the tokens that end it (stop ids, and EOS unless ignored) and the length its output may reach
        self._enders = self._stop_token_ids | (frozenset() if sampling_params.ignore_eos else self.eos_token_ids)
        self._end_len = math.inf if self.max_tokens is None else self.num_prompt_tokens + self.max_tokens
        self._span = (0, False)  # (tokens scanned by inside(), whether they end inside the span)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def cache_keys(self) -> list:
        """What prefix caching keys its blocks by: its tokens, each image's first one replaced by the image's
        content hash (its placeholder tokens are the same for every image)."""
        return self.all_token_ids if self.multimodal is None else self.multimodal.cache_keys(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def tokens_left(self, max_model_len: int) -> int:
        """The most output tokens this request may still produce (``max_tokens``, ``max_model_len``); EOS or a
        stop may end it sooner."""
        left = max_model_len - self.num_tokens
        if self.max_tokens is not None:
            left = min(left, self.max_tokens - self.num_output_tokens)
        return left

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_tokens(self, token_ids: list[int], max_model_len: int) -> bool:
        """Append a step's kept tokens one at a time, stopping at the first that finishes the request
        (:meth:`check_stop` decides how); returns whether one did."""
        out, every, enders = self.output_token_ids, self.all_token_ids, self._enders
        end_len = min(self._end_len, max_model_len)
        for token in token_ids:
            out.append(token)
            every.append(token)
            if token in enders or len(every) >= end_len:
                return self.check_stop(max_model_len)
        return False

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep only the first ``num_output_tokens`` output tokens (and their logprobs)."""
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens:]
        if self.output_logprobs is not None:
            del self.output_logprobs[num_output_tokens:]

    def inside(self, begin: int, end: int) -> bool:
        """Whether the tokens so far end inside a ``begin`` ... ``end`` span (a reasoning model's thinking phase):
        the later of the last ``begin`` and the last ``end`` is ``begin``. Scans only the tokens appended since the
        last call (all of them again after a truncation)."""
        scanned, state = self._span
        if scanned > self.num_tokens:
            scanned, state = 0, False
        for token in self.all_token_ids[scanned:]:
            state = True if token == begin else False if token == end else state
        self._span = (self.num_tokens, state)
        return state

    def extend_logprobs(self, entries: SampleLogprobs) -> SampleLogprobs:
        """Record the logprobs of the output tokens appended since the last call: ``entries`` are those of the
        tokens the target kept this step, of which the scheduler appended a prefix (it stops at a stop token or
        max_tokens), so exactly the first (num_output_tokens - recorded) of them are kept. Returns those."""
        missing = self.num_output_tokens - len(self.output_logprobs)
        assert 0 <= missing <= len(entries), (self.req_id, missing, len(entries))
        kept = entries[:missing]
        self.output_logprobs.extend(kept)
        return kept

    @property
    def cumulative_logprob(self) -> float | None:
        """sum_i log p(output token i), over the recorded logprobs; None when the request asked for none."""
        if self.output_logprobs is None:
            return None
        return sum(lp[t].logprob for t, lp in zip(self.output_token_ids, self.output_logprobs))

    def min_tokens_banned(self) -> list[int]:
        """The token ids the worker bans before ``min_tokens`` outputs (those that would end the request), or []
        when the request has no ``min_tokens``."""
        if not self.sampling_params.min_tokens:
            return []
        eos = frozenset() if self.sampling_params.ignore_eos else self.eos_token_ids
        return sorted(self._stop_token_ids | eos)

    @property
    def ended_on_stop_token(self) -> bool:
        """It finished on its last output token being EOS (unless ``ignore_eos``) or one of its stop token ids: a
        token whose text the output leaves out unless ``include_stop_str_in_output`` (vLLM's)."""
        return (self.status is RequestStatus.FINISHED_STOPPED and not isinstance(self.stop_reason, str)
                and bool(self.output_token_ids) and self.output_token_ids[-1] in self._enders)

    def check_stop(self, max_model_len: int) -> bool:
        """After appending a token: finish the request if that token ends it (vLLM's order: EOS, stop token
        ids, then length). Returns whether it finished."""
        token = self.output_token_ids[-1]
        if not self.sampling_params.ignore_eos and token in self.eos_token_ids:
            return self._finish(RequestStatus.FINISHED_STOPPED, None)
        if token in self._stop_token_ids:
            return self._finish(RequestStatus.FINISHED_STOPPED, token)
        out_of_tokens = self.max_tokens is not None and self.num_output_tokens >= self.max_tokens
        if out_of_tokens or self.num_tokens >= max_model_len:
            return self._finish(RequestStatus.FINISHED_LENGTH, None)
        return False

    def _finish(self, status: RequestStatus, stop_reason: int | str | None) -> bool:
        self.status = status
        self.stop_reason = stop_reason
        return True

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids})")


def check_prompt(prompt_token_ids: list[int], max_model_len: int, vocab_size: int | None = None) -> None:
    """The one check of a prompt against the model: not empty, every id a token of the vocabulary (when
    ``vocab_size`` is known), and room for at least one generated token. Raises an actionable ValueError."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt_token_ids is empty: give at least one prompt token (prompt or prompt_token_ids)")
    if vocab_size is not None:
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            where = (f"outside the vocabulary [0, {vocab_size})" if all(type(t) is int for t in bad)
                     else "that are not token ids (integers)")
            raise ValueError(f"prompt_token_ids contains {bad[:5]!r:.80} {where}; pass token ids of this model's "
                             "tokenizer")
    if n >= max_model_len:
        raise ValueError(f"prompt_token_ids has {n} tokens but max_model_len={max_model_len} must leave room for "
                         f"at least one generated token; shorten the prompt to <= {max_model_len - 1} tokens or "
                         "raise max_model_len")
