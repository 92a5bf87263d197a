"""Per-request sampling parameters (vLLM's names and defaults). Plain data, torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to sample one request.

    ``temperature == 0`` is greedy. ``top_k`` of 0 or -1 disables top-k; ``top_p == 1`` disables top-p;
    ``min_p == 0`` disables min-p. ``seed`` gives the request its own random stream, so the same seed gives the
    same output.
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
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        if self.n != 1:
            raise ValueError(f"n={self.n}: only n=1 is supported per request; submit the prompt n times instead")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; use 1 to disable top-p")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0, or -1/0 to disable top-k")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]; use 0 to disable min-p")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1 (or None for up to max_model_len)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r}: every stop string must be a non-empty string")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: every entry must be a token id >= 0")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs={self.logprobs} must be >= 0 or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
