"""``prediction``: drafts from the output the client expects (OpenAI's Predicted Outputs). Torch-free.

A request may carry a prediction (``SamplingParams.prediction``; the chat API's ``prediction`` field): most of the
text it expects back, such as a file to be returned with a few edits. The drafter keeps a cursor into the
prediction, the place the output has reached in it, and proposes the tokens that follow the cursor:

- while the output follows the prediction (every token the target kept since the last call is the prediction's
  next), the cursor moves along with it: the proposal's key is ``IN_STEP``;
- when the output departs from it (an edit), the drafter looks for the output's last ``n`` tokens in the
  prediction, ``n`` from ``max_match_len`` down to ``min_match_len``, and takes the occurrence nearest to the
  cursor, forward first (an edit rejoins the text after the part it replaced): the key is ``n``;
- out of step, it also looks up the request's own text, prompt lookup as ``ngram`` drafts, and proposes whichever
  match is longer (the prediction's on a tie; the own text's keys are ``("own", match length)``), so that a request
  whose prediction turns out wrong drafts about as it would without one.

Keys let the draft-length policy learn, per request mix, how far a proposal after a fresh 1-token match is worth
verifying compared with one in step. Every draft is verified by the target, so the output is the one decoding
without the prediction gives (greedy: token for token).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, replace

from specray.config import SpeculativeConfig
from specray.drafters.base import DraftRequest, DrafterContext, Proposal
from specray.drafters.ngram import NgramDrafter
from specray.drafters.ngram_common import check_int
from specray.drafters.registry import options_of

METHOD = "prediction"
_SCAN = 32  # occurrences of a match's first token looked at on each side of the cursor


@dataclass
class PredictionOptions:
    """``speculative_config`` keys of ``method="prediction"``."""

    min_match_len: int = 1  # the shortest end of the output looked up in the prediction after it departs
    max_match_len: int = 8  # the longest

    def __post_init__(self) -> None:
        check_int(METHOD, "min_match_len", self.min_match_len, 1)
        check_int(METHOD, "max_match_len", self.max_match_len, self.min_match_len,
                  what="at least min_match_len")


class _State:
    """One request's prediction, where each token occurs in it, and the cursor."""

    def __init__(self, prediction: Sequence[int]):
        self.prediction = list(prediction)
        self.where: dict[int, list[int]] = {}  # token -> its positions in the prediction, ascending
        for i, token in enumerate(self.prediction):
            self.where.setdefault(token, []).append(i)
        self.cursor = 0  # the prediction's index of the output's next token (or, lost, where it last was)
        self.lost = False  # the output's end matched nowhere at the last call
        self.seen = 0  # output tokens the cursor accounts for


class PredictionDrafter:
    """Proposes the continuation of each request's prediction from where its output stands in it."""

    cheap_proposals = True  # a lookup: the engine asks for the most drafts and sizes k by the key
    IN_STEP = 1_000  # the key of a proposal made while the output follows the prediction

    def __init__(self, spec: SpeculativeConfig, ctx: DrafterContext):
        self.options: PredictionOptions = options_of(spec)
        self.num_speculative_tokens = spec.num_speculative_tokens
        self._states: dict[str, _State] = {}
        # the request's own text, where its prediction has nothing to propose (ngram's defaults)
        self._own = NgramDrafter(SpeculativeConfig(method="ngram", num_speculative_tokens=self.num_speculative_tokens),
                                 ctx)

    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        proposals = [self._propose_one(dreq) for dreq in batch]
        rest = [i for i, (dreq, proposal) in enumerate(zip(batch, proposals))
                if proposal.key != self.IN_STEP and dreq.sampling_params.prediction and dreq.num_speculative_tokens > 0]
        if rest:  # out of step with the prediction: the longer match wins, the prediction's on a tie
            for i, own in zip(rest, self._own.propose([batch[i] for i in rest])):
                if own.token_ids and (not proposals[i].token_ids or own.key > proposals[i].key):
                    proposals[i] = replace(own, key=("own", own.key))
        return proposals

    def finish(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            self._states.pop(req_id, None)
        self._own.finish(req_ids)

    def shutdown(self) -> None:
        """Nothing to release."""

    def _propose_one(self, dreq: DraftRequest) -> Proposal:
        prediction = dreq.sampling_params.prediction
        k = min(dreq.num_speculative_tokens, self.num_speculative_tokens)
        if not prediction:
            return Proposal([])
        state = self._states.get(dreq.req_id)
        if state is None:
            state = self._states[dreq.req_id] = _State(prediction)
        key = self._follow(state, dreq.token_ids, dreq.num_prompt_tokens)
        if key is None or k <= 0:
            return Proposal([])
        return Proposal(state.prediction[state.cursor: state.cursor + k], key=key)

    def _follow(self, state: _State, tokens: Sequence[int], start: int) -> int | None:
        """Move the cursor to where the output (``tokens[start:]``) stands in the prediction; the proposal's key, or
        None when the output's end is nowhere in it (or the prediction is used up there). Reads only what came
        since the last call and, out of step, the output's last tokens: never the whole output."""
        pred, m = state.prediction, len(tokens) - start
        new = list(tokens[start + state.seen:]) if state.seen <= m else None
        if not state.lost and new is not None and pred[state.cursor: state.cursor + len(new)] == new:
            state.cursor += len(new)
            state.seen = m
            return self.IN_STEP if state.cursor < len(pred) else None
        state.seen = m
        top = min(self.options.max_match_len, m)
        for n in range(top, self.options.min_match_len - 1, -1):
            at = self._nearest(state, list(tokens[len(tokens) - n:]))
            if at is not None:
                state.cursor, state.lost = at + n, False
                return n
        state.lost = True
        return None

    @staticmethod
    def _nearest(state: _State, tail: list[int]) -> int | None:
        """The start of the occurrence of ``tail`` in the prediction nearest the cursor, forward first, with a
        token after it; None when none of the occurrences looked at is one."""
        pred, n = state.prediction, len(tail)
        starts = state.where.get(tail[0], ())
        here = bisect_left(starts, max(state.cursor - n, 0))
        forward = starts[here: here + _SCAN]
        backward = starts[max(here - _SCAN, 0): here][::-1]
        for start in (*forward, *backward):
            if start + n < len(pred) and pred[start: start + n] == tail:
                return start
        return None
