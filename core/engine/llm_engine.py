"""The engine loop: draft, schedule, execute, verify, update, detokenize. One process; the Ray backend wraps
the executor and drafter in actors without changing this loop. Built by :func:`specray.engine.builder.build_engine`."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from specray.contract import StepPlan, StepResult
from specray.detokenizer import IncrementalDetokenizer, find_stop
from specray.drafters.base import DraftRequest, Drafter, proposes_cheaply
from specray.errors import WorkerDiedError
from specray.outputs import CompletionOutput, RequestOutput, SpecStats
from specray.sampling_params import SamplingParams
from specray.scheduler.draft_policy import DraftLengthPolicy
from specray.scheduler.request import Request
from specray.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    """Engine-side state of one request: its prompt text and incremental detokenizer."""

    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer | None
    num_sent: int = 0  # output tokens already reported (for streaming deltas)


class LLMEngine:
    def __init__(self, scheduler: Scheduler, executor, tokenizer, vocab_size: int, max_model_len: int,
                 eos_token_ids: frozenset[int], drafter: Drafter | None = None,
                 policy: DraftLengthPolicy | None = None):
        self.scheduler = scheduler
        self.executor = executor  # execute(plan, draft_probs) -> StepResult
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.drafter = drafter
        self.policy = policy
        self.tracked: dict[str, _Tracked] = {}
        self.spec_stats = SpecStats()
        self.num_steps = 0
        self.clock = time.perf_counter  # times steps for the draft policy's cost fit (a replay sets a virtual one)
        # Requests come in batches whose total time is what counts (offline generate), not each request's
        # latency: once nothing waits, requests off the batch's critical path draft nothing (DraftLengthPolicy).
        self.closed_batches = False
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    req_id: str | None = None) -> str:
        """Validate and queue one request; a bad one raises ValueError and changes nothing."""
        req_id = req_id if req_id is not None else str(next(self._ids))
        if req_id in self.tracked:
            raise ValueError(f"request_id={req_id!r} is already in use; pass a unique request id")
        self._check_tokens(prompt_token_ids)
        if params.max_tokens is None:
            params.max_tokens = max(self.max_model_len - len(prompt_token_ids), 1)
        request = Request(req_id, list(prompt_token_ids), params, self.eos_token_ids, time.monotonic())
        self.scheduler.add_request(request)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.tracked[req_id] = _Tracked(request, prompt, detok)
        return req_id

    def _check_tokens(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty: give at least one token (prompt or prompt_token_ids)")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[:5]} outside the vocabulary [0, {self.vocab_size})")

    def abort_request(self, req_ids: list[str]) -> None:
        live = [r for r in req_ids if r in self.tracked]
        self.scheduler.abort_requests(live)
        self._forget(live)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        draft_probs = self._draft()
        plan = self.scheduler.schedule()
        self._prefetch_drafts(plan)
        start = self.clock()
        try:
            result = self.executor.execute(plan, draft_probs)
        except WorkerDiedError as err:
            self._recover(err)
            raise
        if self.policy is not None and _is_decode_step(plan):
            self.policy.observe_step(plan.num_tokens, len(plan.chunks), self.clock() - start)
        touched = self.scheduler.update_from_output(plan, result)
        self._record_logprobs(plan, result)
        self._observe_acceptance(plan, result)
        self.num_steps += 1
        outputs = [self._make_output(self.tracked[r.req_id]) for r in touched if r.req_id in self.tracked]
        self._forget([o.request_id for o in outputs if o.finished])
        return outputs

    def _recover(self, err: WorkerDiedError) -> None:
        """A worker died mid-step: fail every request the engine holds (their KV lived on the dead group),
        free their blocks, and bring up a fresh worker group so new requests are served."""
        err.req_ids = list(self.tracked)
        logger.error("worker failure (%s): failing %d requests and restarting the workers", err, len(err.req_ids))
        self.abort_request(err.req_ids)
        self.executor.restart()

    def _draft(self) -> dict:
        """Ask the drafter for each decoding request's next drafts, K sized by the policy (which caps it by the
        request's ``SamplingParams.num_speculative_tokens``; 0 asks for none). A drafter that proposes cheaply
        is asked for the most each request may have, and the policy sizes K by the proposal's key."""
        if self.drafter is None:
            return {}
        running = self.scheduler.running
        decoding = [(r, off) for r, off in zip(running, self._off_critical_path(running))
                    if r.num_computed_tokens == r.num_tokens - 1]
        if not decoding:
            return {}
        cheap = proposes_cheaply(self.drafter)
        batch = [DraftRequest(r.req_id, r.all_token_ids, self._ask(r, len(running), off, cheap), r.sampling_params)
                 for r, off in decoding]
        probs = {}
        for (request, off), dreq, proposal in zip(decoding, batch, self.drafter.propose(batch)):
            tokens = proposal.token_ids[: dreq.max_draft_tokens]
            if cheap and tokens:
                tokens = tokens[: self.policy.choose(request, len(running), off, proposal.key)]
            request.draft_token_ids = list(tokens)
            request.draft_key = proposal.key if cheap else None
            if proposal.probs is not None and request.draft_token_ids:
                probs[dreq.req_id] = proposal.probs
        return probs

    def _ask(self, request: Request, batch_size: int, idle: bool, cheap: bool) -> int:
        """How many drafts to ask the drafter for: the policy's K, or for a cheap drafter the most allowed."""
        if not cheap:
            return self.policy.choose(request, batch_size, idle)
        return 0 if idle and self.policy.adaptive else self.policy.max_k_for(request)

    def _off_critical_path(self, running: list[Request]) -> list[bool]:
        """Per running request: whether it would finish before its closed batch ends even without drafting."""
        if not self.closed_batches or self.scheduler.num_waiting or len(running) < 2:
            return [False] * len(running)
        budgets = [r.tokens_left(self.max_model_len) for r in running]
        return self.policy.off_critical_path(running, budgets, len(running))

    def _prefetch_drafts(self, plan: StepPlan) -> None:
        """A drafter that runs elsewhere and ``drafts_ahead`` starts drafting for the next step while the target
        verifies this one: each sampled request's history as if every draft is kept, with room for one more
        token, the drafter's guess of the target's own (see ``RemoteDrafter.prefetch``)."""
        if not getattr(self.drafter, "drafts_ahead", False):
            return
        batch = []
        for chunk in plan.chunks:
            request = self.scheduler.get_request(chunk.req_id)
            if not chunk.sample or request is None or self.policy.max_k_for(request) == 0:
                continue
            max_k = self.policy.max_k_for(request)
            drafts = chunk.token_ids[chunk.num_tokens - chunk.num_draft_tokens:]
            batch.append(DraftRequest(request.req_id, request.all_token_ids + drafts, max_k + 1,
                                      request.sampling_params, num_assumed=len(drafts)))
        if batch:
            self.drafter.prefetch(batch)

    def _record_logprobs(self, plan: StepPlan, result: StepResult) -> None:
        """Keep the logprobs of the output tokens the scheduler just appended (a prefix of each chunk's kept
        tokens); a recomputed (preempted) request appends only its new token, so nothing is recorded twice."""
        if result.logprobs is None:
            return
        for chunk, entries in zip(plan.chunks, result.logprobs):
            tracked = self.tracked.get(chunk.req_id)
            if chunk.sample and entries and tracked is not None:
                tracked.request.extend_logprobs(entries)

    def _observe_acceptance(self, plan: StepPlan, result: StepResult) -> None:
        stats = self.scheduler.last_step_stats
        self.spec_stats.merge(stats)
        if self.policy is None:
            return
        for chunk, kept in zip(plan.chunks, result.sampled_token_ids):
            if chunk.sample and chunk.num_draft_tokens:
                request = self.scheduler.get_request(chunk.req_id)
                if request is not None:
                    self.policy.observe(request, chunk.num_draft_tokens, max(len(kept) - 1, 0), request.draft_key)

    # ---- outputs --------------------------------------------------------------------------------------
    def _make_output(self, tracked: _Tracked) -> RequestOutput:
        request = tracked.request
        self._detokenize(tracked)
        text = tracked.detok.text if tracked.detok is not None else ""
        logprobs = request.output_logprobs
        # positional arguments, in the dataclasses' field order: built for every request every step
        completion = CompletionOutput(0, text, list(request.output_token_ids),
                                      None if logprobs is None else request.cumulative_logprob,
                                      None if logprobs is None else list(logprobs),
                                      request.finish_reason, request.stop_reason)
        return RequestOutput(request.req_id, tracked.prompt, request.prompt_token_ids, [completion],
                             request.status.is_finished, _request_spec_stats(request))

    def _detokenize(self, tracked: _Tracked) -> None:
        """Push the new output tokens through the detokenizer; finish the request on a stop string."""
        request, detok = tracked.request, tracked.detok
        stops = request.sampling_params.stop
        outputs = request.output_token_ids
        while detok is not None and tracked.num_sent < len(outputs):
            new = detok.push(outputs[tracked.num_sent])
            tracked.num_sent += 1
            hit = find_stop(detok.text, len(new), stops) if stops and new else None
            if hit is not None:
                self._stop_on_string(tracked, *hit)
                return
        tracked.num_sent = len(outputs)

    def _stop_on_string(self, tracked: _Tracked, start: int, stop: str) -> None:
        keep = start + len(stop) if tracked.request.sampling_params.include_stop_str_in_output else start
        tracked.detok.text = tracked.detok.text[:keep]
        self.scheduler.finish_request(tracked.request.req_id, tracked.num_sent, stop)

    def _forget(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            self.tracked.pop(rid, None)
        if self.drafter is not None and req_ids:
            self.drafter.finish(req_ids)


def _is_decode_step(plan: StepPlan) -> bool:
    """Every chunk is one request's last token plus its drafts: the steps the draft policy prices. A prefill
    chunk's tokens cost far less each (one large matmul) and would bend the fitted cost line."""
    return not plan.is_empty and all(c.sample and c.num_tokens == 1 + c.num_draft_tokens for c in plan.chunks)


def _request_spec_stats(request: Request) -> SpecStats:
    return SpecStats(request.num_drafts, request.num_draft_tokens, request.num_accepted_tokens,
                     list(request.accepted_per_position))
