"""What `LLM.generate` returns (vLLM's shapes) and speculation statistics. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's raw logprob at one position (log_softmax of the target's logits there, before any warper), as
    vLLM's ``Logprob``: ``rank`` is its place in the vocabulary by logprob (1 = the most likely; a token tied with
    others counts them all, as vLLM does), ``decoded_token`` its text alone (None when the request asked not to
    detokenize)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one {token_id: Logprob} per output token: that token first, then the k most likely
SampleLogprobs = list[dict[int, Logprob]]
# None for the first prompt token (nothing precedes it), then one {token_id: Logprob} per later prompt token
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)  # built for every request every step
class SpecStats:
    """Speculation counters. A *draft* is one verification of >= 1 draft token for one request.

    acceptance_rate = accepted_tokens / draft_tokens; mean_accepted_length = 1 + accepted_tokens / drafts
    (tokens the target keeps per drafted step, its own token included); per_position[i] = the fraction of
    drafts whose i-th token was accepted.
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verification of ``num_draft_tokens`` drafts of which the first ``num_accepted`` were kept
        (nothing when none was drafted)."""
        if num_draft_tokens == 0:
            return
        self.drafts += 1
        self.draft_tokens += num_draft_tokens
        self.accepted_tokens += num_accepted
        self._grow(num_draft_tokens)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: "SpecStats") -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self._grow(len(other.accepted_per_position))
        for i, n in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += n

    def copy(self) -> "SpecStats":
        return SpecStats(self.drafts, self.draft_tokens, self.accepted_tokens, list(self.accepted_per_position))

    def _grow(self, num_positions: int) -> None:
        missing = num_positions - len(self.accepted_per_position)
        if missing > 0:
            self.accepted_per_position.extend([0] * missing)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def per_position(self) -> list[float]:
        return [n / self.drafts for n in self.accepted_per_position] if self.drafts else []

    def as_dict(self) -> dict:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "per_position": self.per_position,
        }


@dataclass(slots=True)
class CompletionOutput:
    """One completion. With ``SamplingParams.logprobs = k``: ``logprobs[i]`` is {token_id: :class:`Logprob`} for
    output token i (that token first, then the k most likely), and ``cumulative_logprob`` = sum_i
    logprobs[i][token_ids[i]].logprob; else both None."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (see RequestOutput.error)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass(slots=True)
class RequestOutput:
    """One request's state after a step (the whole of it so far). ``finished`` with ``finish_reason == "error"``
    means a step failed for this request and ``error`` says why; the engine's other requests were unharmed.

    With ``SamplingParams.output_kind="delta"`` it holds what is new since the request's previous report: the
    outputs' ``token_ids``, ``text`` and ``logprobs`` are the new ones, ``prompt`` and ``prompt_token_ids`` come
    in the first report only (None and [] after it), and so do ``prompt_logprobs``; ``cumulative_logprob``, the
    reasons, ``finished``, ``error`` and ``spec_stats`` are the request's state at the report, as in a cumulative
    output. :func:`merge_deltas`
    joins two consecutive deltas; :func:`accumulate` turns the sequence back into cumulative outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    spec_stats: SpecStats = field(default_factory=SpecStats)
    # set when a step failed for this request alone: it finished with finish_reason "error" (the others went on)
    error: str | None = None
    # SamplingParams.prompt_logprobs: None for the first prompt token, then {token_id: Logprob} for each later one
    # (that token first, then the k most likely); None when the request asked for none
    prompt_logprobs: PromptLogprobs | None = None
    # prompt tokens found in the prefix cache when it was first scheduled (vLLM's; 0 with prefix caching off)
    num_cached_tokens: int = 0
    # with error: the request's own constraints cannot be met (a client's error, not the engine's)
    refused: bool = False


def merge_deltas(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One delta output for two consecutive ones of the same request (a reader that fell behind takes both as
    one): the new parts concatenated, the state (reasons, ``finished``, statistics) of ``newer``."""
    first = older if older.prompt_token_ids else newer
    return _joined(older, newer, first.prompt, first.prompt_token_ids, first.prompt_logprobs)


def accumulate(so_far: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """The cumulative output after ``delta``, given the cumulative output before it (None before the first
    delta, which carries the prompt). Builds new lists: outputs already handed out are never changed."""
    first = delta if so_far is None else so_far
    return _joined(so_far, delta, first.prompt, first.prompt_token_ids, first.prompt_logprobs)


def _joined(older: RequestOutput | None, newer: RequestOutput, prompt: str | None, prompt_token_ids: list[int],
            prompt_logprobs: PromptLogprobs | None) -> RequestOutput:
    completions = []
    for i, new in enumerate(newer.outputs):
        old = older.outputs[i] if older is not None else None
        if old is None:
            token_ids, text = list(new.token_ids), new.text
            logprobs = None if new.logprobs is None else list(new.logprobs)
        else:
            token_ids, text = old.token_ids + new.token_ids, old.text + new.text
            logprobs = None if new.logprobs is None else (old.logprobs or []) + new.logprobs
        completions.append(CompletionOutput(new.index, text, token_ids, new.cumulative_logprob, logprobs,
                                            new.finish_reason, new.stop_reason))
    return RequestOutput(newer.request_id, prompt, prompt_token_ids, completions, newer.finished,
                         newer.spec_stats, newer.error, prompt_logprobs, newer.num_cached_tokens, newer.refused)
