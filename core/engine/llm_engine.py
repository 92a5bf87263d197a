"""The engine loop: draft, schedule, execute, verify, update, detokenize. One process; the Ray backend wraps
the executor and drafter in actors without changing this loop. Built by :func:`specray.engine.builder.build_engine`."""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from numbers import Real
from dataclasses import dataclass, field

from specray.contract import ScheduledChunk, StepPlan, StepResult
from specray.detokenizer import IncrementalDetokenizer, TokenTexts, find_stop
from specray.drafters.base import (DraftFailure, DraftRequest, Drafter, Proposal, propose_isolating_failures,
                                   proposes_cheaply)
from specray.drafters.prediction import METHOD as PREDICTION, PredictionDrafter
from specray.drafters.router import DrafterRouter, check_request_method
from specray.engine.step_future import StepFuture, resolved, start_step
from specray.errors import EngineError, RequestError, StepError, WorkerDiedError
from specray.lora import AdapterChecker
from specray.multimodal import MODALITIES, MultiModalInputs, check_image_prompt, check_mm_counts
from specray.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SpecStats
from specray.sampling_params import SamplingParams
from specray.scheduler.draft_policy import DraftLengthPolicy
from specray.scheduler.request import Request
from specray.scheduler.scheduler import Scheduler
from specray.structured_outputs import RequestGrammar, StructuredOutputs
from specray.tree import DraftTree, chain_parents, is_chain, kept_nodes, level_tree, trim_tree

logger = logging.getLogger(__name__)

FORCED_DRAFT_LIMIT = 16  # the most forced tokens (a grammar's) verified as drafts in one step


@dataclass
class _Tracked:
    """Engine-side state of one request: its prompt text and incremental detokenizer."""

    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer | None
    num_sent: int = 0  # output tokens already pushed through the detokenizer
    error: str | None = None  # why a step failed for this request (finish_reason "error")
    refused: bool = False  # ... because its own constraints cannot be met
    hold: int = 0  # characters of text left out of reports until it finishes: a stop string may begin there
    reported: bool = False  # a report went out (output_kind "delta": the prompt goes with the first only)
    reported_tokens: int = 0  # output tokens reported so far (output_kind "delta")
    reported_chars: int = 0  # characters of text reported so far (output_kind "delta")
    # SamplingParams.prompt_logprobs: [None] for the first prompt token, then one entry per later prompt token as
    # the prefill chunks answer them; None when the request asked for none
    prompt_logprobs: PromptLogprobs | None = None


class LLMEngine:
    def __init__(self, scheduler: Scheduler, executor, tokenizer, vocab_size: int, max_model_len: int,
                 eos_token_ids: frozenset[int], drafter: Drafter | None = None,
                 policy: DraftLengthPolicy | None = None, router: DrafterRouter | None = None,
                 worker_method: str | None = None, worker_trees: bool = False,
                 worker_tree_shape: tuple[int, int] | None = None, reasoning_parser: str | None = None,
                 async_scheduling: bool = False, disable_by_batch_size: int | None = None,
                 adapters: AdapterChecker | None = None):
        self.scheduler = scheduler
        # requests' LoRA adapters, each checked when a request first names it (none without enable_lora)
        self.adapters = adapters or AdapterChecker(None, {})
        self.executor = executor  # execute(plan, draft_probs) -> StepResult
        self.tokenizer = tokenizer
        # the most images and videos a prompt may hold (None: any; the builder sets them for a release with images)
        self.mm_limits: dict[str, int | None] = dict.fromkeys(MODALITIES, 0)
        self.token_texts = None if tokenizer is None else TokenTexts(tokenizer)  # logprobs' decoded tokens
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.drafter = drafter
        self.policy = policy
        # becomes ``self.drafter`` (in front of the engine's own) once a request picks another method
        # (speculative_method): until then the engine asks its drafter directly, so nobody pays for routing
        self.router = router
        # the method of a drafter that runs in the target's driver rank (hidden-state heads): its drafts come back
        # with each step's result (``_worker_drafts``) and enter the scheduler before the next step
        self.worker_method = worker_method
        self.worker_trees = worker_trees  # it drafts token trees (EAGLE-2, Medusa): each a whole tree, then priced
        # a tree the worker drew from q (a sampled request's EAGLE-2 tree) is priced by the shape the worker grows
        # its trees in, not its own (``_as_priced``)
        self.worker_tree_shape = worker_tree_shape
        self._shape_tree = None if worker_tree_shape is None else level_tree(*worker_tree_shape)
        self._worker_drafts: dict[str, list[int] | DraftTree] = {}  # a chain, or a tree
        self._worker_probes: set[str] = set()  # requests whose drafts in the making are the policy's probe
        self.tracked: dict[str, _Tracked] = {}
        self.is_shut_down = False  # shutdown() released the workers: no more requests
        self.spec_stats = SpecStats()
        self.num_steps = 0
        self.clock = time.perf_counter  # times steps for the draft policy's cost fit (a replay sets a virtual one)
        # Requests come in batches whose total time is what counts (offline generate), not each request's
        # latency: once nothing waits, requests off the batch's critical path draft nothing (DraftLengthPolicy).
        self.closed_batches = False
        self._draft_keys: dict[str, int] = {}  # the kind of each request's pending drafts (cheap drafters)
        self._draft_trees: dict[str, DraftTree] = {}  # each request's pending token tree, as proposed
        self._draft_scores: dict[str, list[float]] = {}  # a scored chain's drafts' probabilities, as verified
        self._worker_scores: dict[str, list[float]] = {}  # with a chain the worker made, the head's confidence
        self.worker_scores_chains = False  # the worker's chains came with their drafts' probabilities
        self._ids = itertools.count()
        self._undrafted: set[str] = set()  # requests the drafter failed on: they decode without drafts
        self._head_failed: set[str] = set()  # requests the worker's drafter failed on: no head drafts (lookups stay)
        self.drafting_failures = 0  # how many requests the drafter failed on, since the engine started
        # structured outputs: each constrained request's grammar, and the requests verifying the grammar's forced
        # tokens this step (not a drafter's: the draft policy and the drafter learn nothing from them)
        self.structured = StructuredOutputs(tokenizer, vocab_size, eos_token_ids, reasoning_parser=reasoning_parser)
        self._grammars: dict[str, RequestGrammar] = {}
        # requests whose allowed_token_ids bad_words or min_tokens may ban whole: the output tokens checked so far
        self._bounded: dict[str, int] = {}
        self._forced: set[str] = set()
        self._kept_nodes: dict[str, list[int]] = {}  # a tree the grammar pruned: the proposal's nodes it kept
        self.forced_draft_limit = FORCED_DRAFT_LIMIT  # (0: none; benchmarks compare)
        # vLLM's name: each step's outputs are built while the executor computes the next step (see ``step``)
        self.async_scheduling = async_scheduling
        # vLLM's speculative_config.disable_by_batch_size: no drafting in a step while this many requests are in the
        # engine (running or waiting)
        self.disable_by_batch_size = disable_by_batch_size
        self._unreported: list[Request] = []  # the requests the last step touched, reported by the next
        self._carried: list[RequestOutput] = []  # outputs built in a step that then failed, for the next to return
        # an executor over pipeline stages keeps this many steps in flight, each over requests of its own (a
        # cohort: the scheduler's seats over the depth, EngineArgs.max_num_seqs), so that every stage computes
        # while the others do (``step``)
        self.pipeline_depth = max(1, int(getattr(executor, "pipeline_depth", 1)))
        self._in_flight: deque[_InFlight] = deque()
        self._last_done = 0.0  # when the last step in flight was answered (a pipeline's step cost)

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    req_id: str | None = None, multimodal: MultiModalInputs | None = None) -> str:
        """Queue one request; a bad one raises ValueError (the scheduler's admission checks) and changes
        nothing. ``multimodal``: its prompt's images (:func:`specray.multimodal.expand_prompt` made the prompt).
        The request keeps a copy of ``params`` (resolved: ``max_tokens`` for its prompt, ...): the caller's may be
        used again for another prompt."""
        if self.is_shut_down:
            raise EngineError("the engine is shut down (LLMEngine.shutdown()); build a new one")
        check_params_type(params)
        if isinstance(prompt_token_ids, (str, bytes)):
            raise ValueError(f"prompt_token_ids is text ({prompt_token_ids[:40]!r}), not token ids: tokenize it "
                             "first (tokenizer.encode), or give the text to LLM.generate")
        params = copy.copy(params)
        if params.n != 1:
            raise ValueError(f"n={params.n}: the engine runs one sequence per request; add one request per choice "
                             "(LLM.generate and the OpenAI server do)")
        req_id = req_id if req_id is not None else str(next(self._ids))
        if params.logprobs == -1:  # the whole vocabulary
            params.logprobs = self.vocab_size
        if params.prompt_logprobs == -1:
            params.prompt_logprobs = self.vocab_size
        if multimodal is not None:
            self._check_images(multimodal, prompt_token_ids, params)
        prompt_token_ids = params.prompt_tokens(prompt_token_ids)
        if params.max_tokens is None:
            params.max_tokens = max(self.max_model_len - len(prompt_token_ids), 1)
            if params.min_tokens > params.max_tokens:  # (not "raise max_tokens": the caller left it unset)
                raise ValueError(f"min_tokens={params.min_tokens} exceeds the {params.max_tokens} output tokens "
                                 f"max_model_len={self.max_model_len} leaves after the {len(prompt_token_ids)}-token "
                                 "prompt (max_tokens=None); lower min_tokens or shorten the prompt")
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = bad_word_sequences(self.tokenizer, params.bad_words)
        if params.lora_request is not None:
            self.adapters.check(params.lora_request)
        unused_prediction = self._admit_prediction(params)
        request = Request(req_id, list(prompt_token_ids), params, self.eos_token_ids, time.monotonic(), multimodal)
        routed = self._admit_method(params)
        grammar = (None if params.structured_outputs is None
                   else self.structured.grammar(params.structured_outputs, prompt_token_ids))
        _check_token_constraints(params, grammar, request.min_tokens_banned())
        self.scheduler.add_request(request)  # validates every field, the prediction's ids too
        if unused_prediction:  # not carried with the request's drafts every step
            params.prediction = None
        if grammar is not None:
            self._grammars[req_id] = grammar
        if params.allowed_token_ids is not None and (params.bad_words_token_ids or params.min_tokens):
            self._bounded[req_id] = 0
        if routed:
            self.drafter = self.router
        detok = None
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        hold = 0 if params.include_stop_str_in_output else max(map(len, params.stop), default=1) - 1
        self.tracked[req_id] = _Tracked(request, prompt, detok, hold=hold,
                                        prompt_logprobs=None if params.prompt_logprobs is None else [None])
        return req_id

    def _check_images(self, multimodal: MultiModalInputs, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_mm_counts(multimodal, self.mm_limits)
        check_image_prompt(multimodal, prompt_token_ids, params.truncate_prompt_tokens)

    def _admit_prediction(self, params: SamplingParams) -> bool:
        """A request's prediction (OpenAI's Predicted Outputs) as token ids, and who drafts from it: on an engine
        that drafts on the host, the ``prediction`` drafter (the request's method, routed), unless the request
        picked another method; on one whose head drafts in the worker, the ``prediction`` drafter beside the head
        (``combine_with: "prediction"``), whose proposals the engine weighs against the head's. True when nobody
        will (no speculation, a head without it): the prediction is then dropped once admission has checked it."""
        if params.prediction is None:
            return False
        if isinstance(params.prediction, str):
            if self.tokenizer is None:
                raise ValueError("prediction is text and this engine has no tokenizer; give its token ids")
            params.prediction = self.tokenizer.encode(params.prediction, add_special_tokens=False)
        params.prediction = list(params.prediction)
        if self.worker_method is not None:
            usable = isinstance(self.drafter, PredictionDrafter) and params.speculative_method in (
                None, self.worker_method)
        else:
            usable = self.router is not None and params.speculative_method in (None, PREDICTION)
        if not (usable and params.prediction):
            return True
        if self.worker_method is None:
            params.speculative_method = PREDICTION
        return False

    def _admit_method(self, params: SamplingParams) -> bool:
        """A request's own drafting method (``speculative_method``): a ValueError when it may not have it; True
        when it needs the router in front of the engine's drafter."""
        method = params.speculative_method
        if method is None:
            return False
        if self.worker_method is not None:
            if method != self.worker_method:
                raise ValueError(f"speculative_method={method!r}: this engine drafts with {self.worker_method!r} "
                                 "inside the target's worker, and a request cannot pick another method on it; "
                                 f"leave speculative_method out or give {self.worker_method!r}")
            return False
        check_request_method(method, None if self.router is None else self.router.spec)
        if method == self.router.method:
            return False
        self.router.prepare(method)
        return True

    def abort_request(self, req_ids: list[str]) -> list[RequestOutput]:
        """Finish these requests now and free their blocks; unknown or finished ids are ignored. Returns each
        aborted request's last output (``finish_reason="abort"``), for a caller still reading its stream."""
        live = [r for r in req_ids if r in self.tracked]
        outputs = [self._make_output(self.tracked[req.req_id]) for req in self.scheduler.abort_requests(live)]
        self._forget(live)
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Requests left to step, outputs a step has yet to report (``async_scheduling``, a failed step's), or
        steps still in flight (pipeline stages)."""
        return self.scheduler.has_unfinished_requests() or bool(self._unreported or self._carried or self._in_flight)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (vLLM's name), a draft model's own too; running requests keep the blocks
        they hold. True when the engine caches prefixes (``enable_prefix_caching``), else False."""
        if not self.scheduler.config.enable_prefix_caching:
            return False
        self.scheduler.reset_prefix_cache()
        reset = getattr(self.drafter, "reset_prefix_cache", None)  # a drafter with a cache of its own
        if reset is not None:
            reset()
        return True

    def shutdown(self) -> None:
        """Release the executor's workers and a remote drafter; every request the engine holds is dropped."""
        self.is_shut_down = True
        self.abort_request(list(self.tracked))
        try:
            if self.drafter is not None:
                self.drafter.shutdown()
        finally:  # a drafter's failing shutdown (a user-provided drafter's bug) still releases the workers
            self.executor.shutdown()

    # ---- the step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: draft, schedule, execute, verify, update; returns the outputs it reports. With
        ``async_scheduling`` a step's outputs are built (detokenized, stop strings looked for) while the next
        step computes, and come back from that next call: every request's tokens one step later, its host work
        hidden behind the device's. A stop string found then finishes its request one step late; that step's
        tokens for it are dropped, so outputs stay the same. Over pipeline stages (``pipeline_depth`` > 1) steps
        overlap instead: :meth:`_pipelined_step`."""
        if self.pipeline_depth > 1:
            return self._pipelined_step()
        outputs, self._carried = self._carried, []
        failed: dict[str, str] = {}  # req_id -> why drafting failed for it
        draft_probs = self._draft(failed)
        outputs += self._fail(failed)  # before scheduling: they take no part in this step
        plan = self.scheduler.schedule()
        self._mask_plan(plan)
        self._prefetch_drafts(plan)
        start = self.clock()
        running = start_step(self.executor, plan, draft_probs) if self.async_scheduling else None
        if running is not None:  # the last step's outputs, built while the executor computes this one
            outputs += self._report(self._unreported)
            self._unreported = []
        try:
            result, failed = self._execute(plan, draft_probs, running)
        except WorkerDiedError as err:
            self._carried = outputs  # reported by the next step: their callers hear of them still
            self._recover(err)
            raise
        if self.policy is not None and _is_decode_step(plan):
            self.policy.observe_step(plan.num_tokens, len(plan.chunks), self.clock() - start)
        outputs += self._fail(failed)
        touched, refused = self._apply(plan, result)
        outputs += self._fail(refused, refused=True)
        if running is not None:
            self._unreported = touched
        else:
            outputs += self._report(touched)
        self._forget([o.request_id for o in outputs if o.finished])
        return outputs

    def _pipelined_step(self) -> list[RequestOutput]:
        """A step over pipeline stages: while fewer than ``pipeline_depth`` steps are in flight, draft for and
        schedule the requests none of them holds (a cohort: at most the scheduler's seats over the depth) and start
        their step;
        then wait for the oldest and apply its result. Each rank computes its steps in order, a stage handing its
        part of one on and starting on the next, so the stages work at once on different requests. A request in
        flight is never scheduled, preempted or drafted for until its step's result is applied; with disjoint
        requests the results apply in any order, as the steps ran in order on every rank."""
        outputs, self._carried = self._carried, []
        if len(self._in_flight) < self.pipeline_depth:
            busy = frozenset(c.req_id for step in self._in_flight for c in step.plan.chunks)
            failed: dict[str, str] = {}
            draft_probs = self._draft(failed, busy)
            outputs += self._fail(failed)
            cohort = -(-self.scheduler.config.max_num_seqs // self.pipeline_depth)
            plan = self.scheduler.schedule(busy, cohort)
            if plan.chunks or _carries_state(plan) or not self._in_flight:
                self._mask_plan(plan)
                self._in_flight.append(_InFlight(plan, draft_probs, start_step(self.executor, plan, draft_probs),
                                                 self.clock()))
                if plan.chunks and len(self._in_flight) < self.pipeline_depth:
                    return outputs  # another cohort may start before the oldest step is waited for
        step = self._in_flight.popleft()
        try:
            result, failed = self._execute(step.plan, step.draft_probs, step.future)
        except WorkerDiedError as err:
            self._in_flight.clear()  # on the same dead group: its requests are failed with the others
            self._carried = outputs
            self._recover(err)
            raise
        now = self.clock()
        if self.policy is not None and _is_decode_step(step.plan):  # a step's cost: its share of the pipeline's time
            self.policy.observe_step(step.plan.num_tokens, len(step.plan.chunks), now - max(step.started,
                                                                                             self._last_done))
        self._last_done = now
        outputs += self._fail(failed)
        touched, refused = self._apply(step.plan, result)
        outputs += self._fail(refused, refused=True) + self._report(touched)
        self._forget([o.request_id for o in outputs if o.finished])
        return outputs

    def _apply(self, plan: StepPlan, result: StepResult) -> tuple[list[Request], dict[str, str]]:
        """A step's result into the scheduler and the engine's records; returns the requests it touched, and those
        whose grammar refused a token (req_id -> why: the caller fails them, :meth:`_fail`)."""
        touched = self.scheduler.update_from_output(plan, result)
        refused = self._advance_grammars(touched)
        refused.update(self._check_bounded(touched))
        self._keep_worker_drafts(result)
        self._stop_worker_drafting(result.drafting_failed)
        self._record_logprobs(plan, result)
        self._record_prompt_logprobs(plan, result)
        self._observe_acceptance(plan, result)
        self._observe_node_tokens(plan, result)
        self.num_steps += 1
        return touched, refused

    # ---- a step that failed for some of its requests ---------------------------------------------------
    def _execute(self, plan: StepPlan, draft_probs: dict, running: StepFuture | None = None
                 ) -> tuple[StepResult, dict[str, str]]:
        """Run ``plan`` (or wait for it: ``running``, started already); when it raises (not a dead worker: that
        propagates), run it again without the requests that caused it. Returns the plan's result and why each
        failed request failed (the others' tokens are in the result as if nothing happened)."""
        try:
            if running is not None:
                return running.result(), {}
            return self.executor.execute(plan, draft_probs), {}
        except WorkerDiedError:
            raise
        except Exception as err:  # one request's failure must not fail the others': isolate it
            return self._isolate(plan, draft_probs, err)

    def _isolate(self, plan: StepPlan, draft_probs: dict, err: Exception) -> tuple[StepResult, dict[str, str]]:
        """``plan`` raised ``err``: run its chunks again without the requests that caused it, and return the
        plan's result (the failed requests' entries empty) and why each failed request failed.

        A worker that names the bad requests (:class:`RequestError`, or a Ray rank's :class:`StepError`) has
        them dropped and the rest run again together; otherwise, or when that fails too, each chunk runs alone.
        Running a chunk again is safe: no token of the failed plan was counted and its KV slots are rewritten with
        the same values; the worker may hold any part of the plan's state, so every retry carries the requests'
        whole block tables. When no request of several runs even alone, nobody's input is to blame: ``err``
        propagates (the async engine then fails everything in flight, loudly)."""
        logger.error("step %d over %d requests failed (%r); running them again without the failing ones",
                     plan.step_id, len(plan.chunks), err, exc_info=err)
        for step in self._in_flight:  # their answers come first on the executor: take them before any retry
            step.future = resolved(step.future)
        preempted = set(self.scheduler.forget_worker_state(plan))  # their K/V was moving: they recompute it
        if not plan.chunks:  # no request to blame (it failed on the plan's bookkeeping): not a request's fault
            raise err
        failed = {}
        if isinstance(err, RequestError):
            failed = {rid: repr(err.cause) for rid in err.req_ids}
        elif isinstance(err, StepError):  # raised on a live rank of a Ray group; req_ids as the rank named them
            failed = {rid: f"{err.exc_type}: {err.exc_message}" for rid in err.req_ids}
        rest = [c for c in plan.chunks if c.req_id not in failed and c.req_id not in preempted]
        groups = [rest] if failed and rest else [[c] for c in rest]
        done: dict[str, tuple[list[int], list | None]] = {}
        undrafted: dict[str, str] = {}  # the retries' requests the worker's drafter failed on
        while groups:
            group = groups.pop()
            try:
                result = self.executor.execute(self.scheduler.retry_plan(plan, group), draft_probs)
            except WorkerDiedError:
                raise
            except Exception as again:  # the same isolation, one level down
                if len(group) > 1:
                    groups += [[c] for c in group]
                else:
                    failed[group[0].req_id] = repr(again)
                continue
            done.update(_by_request(result))
            undrafted.update(result.drafting_failed)
        if not done and len(rest) > 1 and not isinstance(err, (RequestError, StepError)):
            raise err  # every request fails, each on its own: the step is broken, not one request's input
        merged = _merge(plan, done)
        merged.drafting_failed = undrafted
        return merged, failed

    def _fail(self, failed: dict[str, str], refused: bool = False) -> list[RequestOutput]:
        """Finish the requests a step failed for (finish_reason "error") and report them to their callers;
        ``refused``: they failed because their own constraints cannot be met (a client's error)."""
        outputs = []
        for req in self.scheduler.abort_requests(list(failed), reason="error"):
            logger.error("request %s failed in a step and was finished with an error: %s", req.req_id,
                         failed[req.req_id])
            tracked = self.tracked[req.req_id]
            tracked.error, tracked.refused = failed[req.req_id], refused
            outputs.append(self._make_output(tracked))
        return outputs

    def _recover(self, err: WorkerDiedError) -> None:
        """A worker died mid-step: fail the requests that were running (their KV and sampling state lived on the
        dead group), free their blocks, and restart the group (the Ray executor does it in the background, so
        their callers hear at once). Waiting requests held nothing there: they stay queued and run on the new
        group (one preempted earlier recomputes its tokens, as after any preemption). The prefix cache is
        forgotten: its blocks' K/V were on the dead group, and the new group's cache starts empty."""
        err.req_ids = [r.req_id for r in self.scheduler.running]
        logger.error("worker failure (%s): failing %d running requests, keeping %d waiting, restarting the workers",
                     err, len(err.req_ids), self.scheduler.num_waiting)
        self.abort_request(err.req_ids)
        self.scheduler.reset_prefix_cache()
        self.executor.restart()

    def _draft(self, failed: dict[str, str], busy: frozenset[str] = frozenset()) -> dict:
        """Ask the drafter for each decoding request's next drafts, K sized by the policy (which caps it by the
        request's ``SamplingParams.num_speculative_tokens``; 0 asks for none), and hand them to the scheduler.
        A drafter that proposes cheaply (per request: behind a router, the drafter the request is routed to) is
        asked for the most each request may have, and the policy sizes K by the proposal's key. Returns the drafts'
        probabilities (a probabilistic drafter's q) by request id; a request the drafter fails on goes into
        ``failed``. ``busy``: requests in a step still in flight, left alone (their records stay for their result)."""
        self._forget_drafting_records(busy)
        running = [r for r in self.scheduler.running if r.req_id not in busy]
        limit = self.disable_by_batch_size
        if limit is not None and len(self.scheduler.running) + self.scheduler.num_waiting >= limit:
            # no drafter's drafts this step (a grammar's forced tokens still go); a worker's head drafts none next,
            # a request admitted now none after its prefill
            self._worker_drafts = {}
            lengths = None if self.worker_method is None else {
                r.req_id: 0 for r in [*running, *self.scheduler.waiting]}
            self._submit_drafts({}, {}, failed, lengths, busy=busy)
            return {}
        if self.worker_method is not None:
            self._hand_worker_drafts(failed, running, busy)
            return {}
        decoding = [] if self.drafter is None else [
            (r, off_path) for r, off_path in zip(running, self._off_critical_path(running))
            if r.num_computed_tokens == r.num_tokens - 1 and r.req_id not in self._undrafted]
        if not decoding:
            if self._grammars:
                self._submit_drafts({}, {}, failed, busy=busy)
            return {}
        cheaps = self._cheapness(decoding)
        # a drafter of the user's gets each history as a tuple: one that changed the request's own list in place
        # (appending its drafts to it) would corrupt the request
        history = (lambda r: r.all_token_ids) if _specray_drafter(self.drafter) else (lambda r: tuple(r.all_token_ids))
        batch = [DraftRequest(r.req_id, history(r), self._ask(r, len(running), off_path, cheap),
                              r.sampling_params, num_prompt_tokens=r.num_prompt_tokens)
                 for (r, off_path), cheap in zip(decoding, cheaps)]
        drafts, probs = {}, {}
        proposals = self._propose(batch)
        for (request, off_path), dreq, proposal, cheap in zip(decoding, batch, proposals, cheaps):
            if proposal is None:
                continue
            if proposal.parents is not None:
                drafts[request.req_id] = self._tree(request, dreq, proposal, len(running), off_path, cheap)
                continue
            tokens = proposal.token_ids[: dreq.num_speculative_tokens]
            if cheap and tokens:
                tokens = tokens[: self.policy.choose(request, len(running), off_path, proposal.key)]
                if proposal.key is not None:
                    self._draft_keys[request.req_id] = proposal.key
            drafts[request.req_id] = tokens
            if proposal.probs is not None and tokens:
                probs[dreq.req_id] = proposal.probs
        self._submit_drafts(drafts, probs, failed, busy=busy)
        return probs

    def _forget_drafting_records(self, busy: frozenset[str]) -> None:
        """A new step's drafting starts afresh, but for the requests of steps in flight (``busy``)."""
        if not busy:
            self._draft_keys, self._draft_trees, self._draft_scores = {}, {}, {}
            self._forced, self._kept_nodes = set(), {}
            return
        for records in (self._draft_keys, self._draft_trees, self._draft_scores, self._kept_nodes):
            for rid in [r for r in records if r not in busy]:
                del records[rid]
        self._forced &= busy

    def _hand_worker_drafts(self, failed: dict[str, str], running: list, busy: frozenset[str] = frozenset()
                            ) -> None:
        """The drafts the worker made after the last step go to verification, and the policy decides, once per
        decoding request and step, how many the worker should draft after this step for the next (none: the
        head's first pass for it is put off too, see :mod:`specray.workers.head_drafter`).

        A chain was sized when it was asked for; the evidence that came in since (the step between) may cut it
        shorter, but a probe is verified whole, as the policy learns only from verified drafts. A tree's nodes are
        priced now that the head's scores are known (``choose_tree``); the worker drafts the next tree while this
        one was worth verifying; once one is not, the next only as a probe (its best ``probe_k`` nodes verified).
        A request just out of prefill drafts the most, and until the engine has verified any of the head's drafts
        a tree is verified as a probe's (else its scores could keep the head from ever being tried). With a lookup
        drafter beside the head (``combine_with``), a request it proposes for takes whichever proposal pays more
        (:meth:`_combine`)."""
        drafts, lengths = {}, {}
        probes = {rid for rid in self._worker_probes if rid not in busy}
        self._worker_probes -= probes
        decoding = [(r, off_path) for r, off_path in zip(running, self._off_critical_path(running))
                    if r.num_computed_tokens == r.num_tokens - 1]  # prefilling: the worker drafts after its last chunk
        lookups = self._lookup_proposals(decoding) if self.drafter is not None else {}
        head_drafted = []  # requests that verify the head's drafts (a sampled one's q is on the worker)
        for request, off_path in decoding:
            rid = request.req_id
            made = self._worker_drafts.get(rid)
            if rid in lookups:
                drafts[rid], lengths[rid], from_head = self._combine(request, len(running), off_path, made,
                                                                     lookups[rid], rid in probes)
                if from_head:
                    head_drafted.append(rid)
                if rid in self._head_failed:  # the lookup's drafts alone from now on
                    lengths[rid] = 0
                continue
            if rid in self._head_failed:  # the worker's drafter failed on it: it drafts nothing for it again
                lengths[rid] = 0
                continue
            head = self.worker_method  # the key of the head's drafts
            if isinstance(made, DraftTree) and self.policy.adaptive and not off_path and not self.policy.knows(head):
                probes.add(rid)  # nothing of the head verified yet: its first tree is verified as a probe's
            if isinstance(made, DraftTree):
                if rid in probes:
                    n = min(len(made), self.policy.probe_k, self.policy.num_speculative_tokens_for(request))
                else:
                    n = self.policy.choose_tree(request, len(running), self._as_priced(made), off_path, head)
                tree = trim_tree(made, n)
                if len(tree):
                    self._draft_trees[rid] = tree
                drafts[rid] = tree
                k = n
            elif made is not None and rid in self._worker_scores:  # a chain with the head's confidence per draft
                drafts[rid], k = self._cut_scored_chain(request, len(running), off_path, made, rid in probes)
            else:
                if self.worker_trees or (made is None and self.worker_scores_chains):  # no scored proposal in hand
                    k = self.policy.wait_or_probe(request, off_path)
                else:
                    k = self.policy.choose(request, len(running), off_path, head)
                    drafts[rid] = [] if made is None else made if rid in probes else made[:k]
                if self.policy.evidence(rid).probing:
                    self._worker_probes.add(rid)  # the drafts the worker makes after this step are the probe
            if drafts.get(rid):
                self._draft_keys[rid] = head
                head_drafted.append(rid)
            if k and self.worker_trees:
                k = self.policy.num_speculative_tokens_for(request)  # the worker grows a whole tree
            lengths[rid] = min(k, self.scheduler.config.worker_draft_steps)  # the head's own count
        self._worker_drafts = {rid: d for rid, d in self._worker_drafts.items() if rid in busy}
        self._submit_drafts(drafts, {}, failed, lengths, head_drafted, busy)

    # ---- structured outputs -------------------------------------------------------------------------------
    def _submit_drafts(self, drafts: dict[str, list[int] | DraftTree], probs: dict, failed: dict[str, str],
                       lengths: dict[str, int] | None = None, from_worker: list[str] = (),
                       busy: frozenset[str] = frozenset()) -> None:
        """Hand this step's drafts to the scheduler, those of a request with a grammar cut to what it accepts
        (:meth:`RequestGrammar.constrain`), or replaced by the tokens the grammar forces next where the drafts do
        not already begin with them all (then ``probs`` loses the request's q, and the drafts are not a drafter's:
        ``_forced``)."""
        from_worker = list(from_worker)
        for rid, grammar in self._grammars.items():
            request = self.scheduler.get_request(rid)
            if (rid in failed or rid in busy or request is None
                    or request.num_computed_tokens != request.num_tokens - 1 or request.status.is_finished):
                continue
            made = drafts.get(rid)
            if made is not None and len(made):
                keep_refused = not request.sampling_params.greedy
                prefix_only = keep_refused or rid in from_worker or rid in probs
                made, kept = grammar.constrain(made, keep_refused, prefix_only)
                drafts[rid] = made
                self._constrained_bookkeeping(rid, made, kept)
            forced = self._forced_drafts(request, grammar)
            if forced and not _starts_with(made, forced):
                drafts[rid] = forced
                probs.pop(rid, None)
                if rid in from_worker:
                    from_worker.remove(rid)
                self._drop_proposal_records(rid)
                self._forced.add(rid)
        self.scheduler.update_draft_token_ids(drafts, lengths, from_worker=from_worker)

    def _constrained_bookkeeping(self, rid: str, made: list[int] | DraftTree, kept: list[int]) -> None:
        """The engine's records of a request's proposal after the grammar cut it to the nodes ``kept``."""
        if isinstance(made, DraftTree) and rid in self._draft_trees:
            self._draft_trees[rid] = made
            if kept != list(range(len(kept))):
                self._kept_nodes[rid] = kept
        scores = self._draft_scores.get(rid)
        if scores is not None:
            self._draft_scores[rid] = scores[: len(made)]
        if not len(made):
            self._drop_proposal_records(rid)

    def _drop_proposal_records(self, rid: str) -> None:
        """Forget what the engine noted of a request's proposal this step (it verifies none of it)."""
        for records in (self._draft_keys, self._draft_trees, self._draft_scores, self._kept_nodes):
            records.pop(rid, None)

    def _forced_drafts(self, request: Request, grammar: RequestGrammar) -> list[int]:
        """The tokens the grammar forces next, as many as the request may verify (none where it turned speculation
        off): at most ``forced_draft_limit``, and the drafter's count where there is one."""
        limit = self.forced_draft_limit
        if request.sampling_params.num_speculative_tokens is not None:
            limit = min(limit, request.sampling_params.num_speculative_tokens)
        elif self.policy is not None:
            limit = min(limit, self.policy.num_speculative_tokens_for(request))
        if limit <= 0:
            return []
        return grammar.forced()[:limit]

    def _mask_plan(self, plan: StepPlan) -> None:
        """The grammar's masks for every verified position of each sampled chunk of a request with one."""
        if not self._grammars:
            return
        chunks = [c for c in plan.chunks if c.sample and c.req_id in self._grammars]
        masks = self.structured.step_bitmasks([
            (self._grammars[c.req_id], c.token_ids[c.num_tokens - c.num_draft_tokens:], c.draft_parents)
            for c in chunks])
        plan.token_bitmasks.update((c.req_id, m) for c, m in zip(chunks, masks))

    def _advance_grammars(self, touched: list[Request]) -> dict[str, str]:
        """Feed each constrained request's new output tokens to its grammar; once the grammar is complete, the
        request finishes ("stop") with the tokens up to there (a step may have kept more after them: EOS as the
        target's own token after the last forced one, which decoding without speculation never samples). A token
        the grammar refuses (every token was masked: the request's own constraints, such as allowed_token_ids,
        left the grammar none) fails the request alone: returned as req_id -> why, for :meth:`_fail`."""
        refused: dict[str, str] = {}
        if not self._grammars:
            return refused
        for request in touched:
            grammar = self._grammars.get(request.req_id)
            if grammar is None or grammar.terminated:
                continue
            new = request.output_token_ids[grammar.num_tokens:]
            for token in new:
                if not grammar.advance([token]):
                    if request.status.is_finished and grammar.num_tokens == request.num_output_tokens:
                        break  # the stop token that ended the request (EOS): the grammar need not take it
                    logger.error("request %s: the grammar refused output token %d: %s", request.req_id, token,
                                 grammar.error)
                    why = grammar.error.strip().splitlines()[:1]  # (the matcher's state follows: logged above)
                    refused[request.req_id] = (
                        f"structured_outputs cannot be met with the request's other constraints: after "
                        f"{grammar.num_tokens - 1} output tokens, allowed_token_ids / bad_words left the grammar no "
                        f"token (token {token} came out: {''.join(why)}); allow the tokens the format needs")
                    break
                if grammar.terminated:
                    self.scheduler.finish_request(request.req_id, grammar.num_tokens)
                    break
        return refused

    def _check_bounded(self, touched: list[Request]) -> dict[str, str]:
        """Fail a request whose ``allowed_token_ids`` were all banned at a position (by ``bad_words`` sequences,
        or before ``min_tokens`` outputs by its ending tokens): no token had any probability there, and the step
        gave one outside them (token 0). Returned as req_id -> why, for :meth:`_fail`, as a grammar's refusals."""
        refused: dict[str, str] = {}
        if not self._bounded:
            return refused
        for request in touched:
            checked = self._bounded.get(request.req_id)
            if checked is None:
                continue
            params, output = request.sampling_params, request.output_token_ids
            allowed, enders = set(params.allowed_token_ids), set(request.min_tokens_banned())
            for i in range(checked, len(output)):
                token = output[i]
                banned = (i < params.min_tokens and token in enders) or any(
                    len(seq) <= i + 1 and output[i + 1 - len(seq): i + 1] == seq
                    for seq in params.bad_words_token_ids or ())
                if token not in allowed or banned:
                    by = ([f"bad_words={params.bad_words!r}"] if params.bad_words else []) + (
                        [f"min_tokens={params.min_tokens} (the tokens that end the request)"] if params.min_tokens
                        else [])
                    refused[request.req_id] = (
                        f"allowed_token_ids={list(params.allowed_token_ids)[:8]} were all banned after {i} output "
                        f"tokens by {' and '.join(by)}: nothing was left to sample (token {token} came out); allow "
                        "more tokens")
                    break
            self._bounded[request.req_id] = len(output)
        return refused

    def _as_priced(self, made: list[int] | DraftTree) -> list[int] | DraftTree:
        """What the policy prices for the head's drafts: a tree the worker drew from q (it carries no scores) by the
        shape the worker grows its trees in (:func:`specray.tree.level_tree`: each level's worth split among its
        nodes), whatever was drawn, as its own level sizes follow its draws (a q's support): pricing those could
        make which nodes are verified depend on the drawn tokens; anything else as it is."""
        if isinstance(made, DraftTree) and made.scores is None and self._shape_tree is not None:
            return self._shape_tree
        return made

    def _cut_scored_chain(self, request: Request, batch_size: int, off_path: bool, made: list[int], probe: bool
                          ) -> tuple[list[int], int]:
        """A chain the head made with its confidence in each draft: the first n worth verifying, priced draft by
        draft by the policy (a probe: all of it; until any of the head's drafts were verified, a probe's share), and
        how many the head should draft after this step: one more than this chain was worth (it may go on being
        sure), none when nothing in it was (then only as the probe)."""
        limit = self.policy.num_speculative_tokens_for(request)
        if off_path and self.policy.adaptive:
            return [], 0
        scores = self._worker_scores[request.req_id]
        if probe:
            n = len(made)
        elif self.policy.adaptive and not self.policy.knows(self.worker_method):  # none verified yet: a probe's
            n = min(len(made), self.policy.probe_k, limit)
        else:
            n = self.policy.price(request, batch_size, made, self.worker_method, scores)[0]
            n = self.policy.settle(request, n, min(len(made), limit))  # a probe of this chain when one is due
        if n:
            self._draft_scores[request.req_id] = scores[:n]
        return made[:n], min(n + 1, limit) if n else 0

    def _lookup_proposals(self, decoding: list[tuple[Request, bool]]) -> dict[str, Proposal]:
        """The lookup drafter's non-empty proposals for the decoding requests (it proposes cheaply: asked for the
        most each may have), by request id (none for a request it failed on: :meth:`_propose`)."""
        batch = [DraftRequest(r.req_id, r.all_token_ids,
                              0 if off_path and self.policy.adaptive else self.policy.num_speculative_tokens_for(r),
                              r.sampling_params, num_prompt_tokens=r.num_prompt_tokens) for r, off_path in decoding
                 if r.req_id not in self._undrafted]
        return {dreq.req_id: proposal for dreq, proposal in zip(batch, self._propose(batch))
                if proposal is not None and proposal.token_ids}

    def _combine(self, request: Request, batch_size: int, off_path: bool, made: list[int] | DraftTree | None,
                 proposal: Proposal, head_probe: bool) -> tuple[list[int] | DraftTree, int, bool]:
        """One request's drafts for this step when both the head (``made``, drafted after the last step) and the
        lookup drafter (``proposal``) may have some, how many the head should draft after this step, and whether
        the drafts are the head's.

        Each proposal is priced by the policy with the evidence of its own kind (the head's verifications under the
        head's method as key, the lookup's under its proposal's key): the best number of its drafts to verify and
        their expected tokens per unit cost; the better rate wins (the lookup on a tie). A head probe in hand is
        verified whole, and the head's first drafts as a probe's (until the engine has any evidence of the head, its
        prior could never beat a lookup's established acceptance). The head drafts next unless the lookup won this
        step (a match that pays tends to go on paying: copying), by its own evidence, or as a probe when the
        request's probe is due. A head that tells its confidence in each draft (a scored chain) is priced draft by
        draft, and drafts next only when it won with drafts worth verifying (one more than those), else as the
        probe."""
        if off_path:
            return [], 0, False
        head_key, limit = self.worker_method, self.policy.num_speculative_tokens_for(request)
        lookup = proposal.tree() if proposal.parents is not None else list(proposal.token_ids)
        scores = self._worker_scores.get(request.req_id) if isinstance(made, list) else None
        # (drafts, what the policy prices for them, their key, scores)
        options = [(lookup, lookup, proposal.key, None)]
        if made:
            options.append((made, self._as_priced(made), head_key, scores))
        probing = False
        if made and (head_probe or not self.policy.knows(head_key)):  # a probe, or the head never verified yet
            chosen, key, n = made, head_key, min(len(made), self.policy.probe_k)
        else:
            (chosen, _, key, _), (n, _) = max(((o, self.policy.price(request, batch_size, *o[1:])) for o in options),
                                              key=lambda pair: pair[1][1])
            n = self.policy.settle(request, n, min(len(chosen), limit))
            probing = self.policy.evidence(request.req_id).probing
        from_head = made is not None and chosen is made
        head_next = 0
        if probing and not made:
            head_next = self.policy.probe_k  # probe the head as well: its drafts come back as a probe
            self._worker_probes.add(request.req_id)
        elif self.worker_scores_chains:
            head_next = min(n + 1, limit) if key == head_key and n else 0
        elif key == head_key or n == 0:
            head_next = self.policy.best_k(self.policy.acceptance(request, head_key), batch_size, limit)
        if key == head_key and scores is not None and n:
            self._draft_scores[request.req_id] = scores[:n]
        if head_next and self.worker_trees:
            head_next = limit  # the worker grows a whole tree
        head_next = min(head_next, self.scheduler.config.worker_draft_steps)
        if isinstance(chosen, DraftTree):
            chosen = trim_tree(chosen, n)
            if len(chosen):
                self._draft_trees[request.req_id] = chosen
        else:
            chosen = chosen[:n]
        if n and key is not None:
            self._draft_keys[request.req_id] = key
        return chosen, head_next, from_head and n > 0

    def _keep_worker_drafts(self, result: StepResult) -> None:
        """The drafts the worker made after a step, for its requests' next step (each request's replacing what it
        had; a step in flight keeps its requests' own)."""
        if result.draft_token_ids is None:
            return
        for rid in result.req_ids:
            self._worker_drafts.pop(rid, None)
            self._worker_scores.pop(rid, None)
        if result.draft_parents is None:  # chains, and the head's confidence in each draft when it tells
            self._worker_drafts.update((rid, d) for rid, d in zip(result.req_ids, result.draft_token_ids) if d)
            scores = {rid: sc for rid, sc in zip(result.req_ids, result.draft_scores or ()) if sc}
            self._worker_scores.update(scores)
            self.worker_scores_chains |= bool(scores)
            return
        # a tree drawn from q (a sampled request's) carries no scores: the policy prices it by the worker's shape
        scores = result.draft_scores or [None] * len(result.req_ids)
        self._worker_drafts.update((rid, DraftTree(d, p, sc or None)) for rid, d, p, sc in
                                   zip(result.req_ids, result.draft_token_ids, result.draft_parents, scores) if d)

    def _cheapness(self, decoding: list[tuple[Request, bool]]) -> list[bool]:
        """Per decoding request: whether its drafter proposes cheaply (behind a router: the one it routes to)."""
        per_request = getattr(self.drafter, "proposes_cheaply_for", None)
        if per_request is None:
            return [proposes_cheaply(self.drafter)] * len(decoding)
        return [per_request(r.sampling_params) for r, _ in decoding]

    def _tree(self, request: Request, dreq: DraftRequest, proposal: Proposal, batch_size: int, off_path: bool,
              cheap: bool) -> DraftTree:
        """A proposed token tree, cut to the nodes worth verifying (the policy prices its first n nodes for a
        drafter that proposes cheaply, or all against none for a ``whole`` proposal; otherwise the n asked
        for)."""
        tree = proposal.tree()
        n = min(len(tree), dreq.num_speculative_tokens)
        if cheap and n:
            choose = self.policy.choose_whole if proposal.whole else self.policy.choose_tree
            n = choose(request, batch_size, tree, off_path, proposal.key)
        tree = trim_tree(tree, n)
        if len(tree):
            self._draft_trees[request.req_id] = tree
            if proposal.key is not None:
                self._draft_keys[request.req_id] = proposal.key
        return tree

    def _propose(self, batch: list[DraftRequest]) -> list[Proposal | None]:
        """The drafter's proposals, None for a request it failed on. Drafts only ever save target passes, so a
        drafter's failure (a user-provided drafter's bug) costs its request the drafts, never its output: when the
        batch raises, each request is asked alone (a drafter rewinds its state to each history it is given, so
        asking again is safe); one that still raises, or gets a proposal that is not one
        (:func:`_check_proposal`), decodes without drafts from then on (:meth:`_stop_drafting`)."""
        if not batch:
            return []
        proposals: list[Proposal | None] = propose_isolating_failures(self.drafter, batch)
        for i, (dreq, proposal) in enumerate(zip(batch, proposals)):
            if isinstance(proposal, DraftFailure):  # it raised (its traceback is logged)
                problem = proposal.why
            else:
                problem = None if proposal is None else _check_proposal(proposal, self.vocab_size)
            if problem is not None:
                self._stop_drafting(dreq.req_id, problem)
                proposals[i] = None
        return proposals

    def _stop_worker_drafting(self, failed: dict[str, str]) -> None:
        """The worker's drafter failed after a step (it logged why): the step's requests get none of its drafts
        from now on, as with :meth:`_stop_drafting` (a lookup drafter beside it, ``combine_with``, still drafts for
        them)."""
        new = [rid for rid in failed if rid not in self._head_failed and rid in self.tracked]
        if new:
            logger.error("the worker's drafter failed on %d requests (%s); they get no drafts of it from now on",
                         len(new), failed[new[0]])
            self._head_failed.update(new)
            self.drafting_failures += len(new)

    def _stop_drafting(self, req_id: str, why: str, err: Exception | None = None) -> None:
        """The drafter failed on this request: it decodes without drafts from now on (plain decoding's output;
        the drafter is not asked for it again)."""
        logger.error("drafting failed for request %s (%s); it decodes without drafts from now on", req_id, why,
                     exc_info=err)
        self._undrafted.add(req_id)
        self.drafting_failures += 1

    def _tell(self, hook, req_id: str, *args) -> None:
        """Call one of the drafter's optional hooks about a request; one that raises (a user-provided drafter's
        bug) costs the request its drafts, as a ``propose`` that raises for it does, not the step."""
        try:
            hook(req_id, *args)
        except Exception as err:
            if req_id not in self._undrafted:
                self._stop_drafting(req_id, f"its {getattr(hook, '__name__', 'hook')} raised {err!r}", err)

    def _ask(self, request: Request, batch_size: int, off_critical_path: bool, cheap: bool) -> int:
        """How many drafts to ask the drafter for: the policy's K, or for a cheap drafter the most allowed."""
        if not cheap:
            return self.policy.choose(request, batch_size, off_critical_path)
        return 0 if off_critical_path and self.policy.adaptive else self.policy.num_speculative_tokens_for(request)

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
            if not chunk.sample or request is None or chunk.draft_parents is not None or chunk.want_node_tokens:
                continue  # nothing to sample, a tree (no one history to draft ahead from), or a drafter that
                # learns from this step's node tokens
            limit = self.policy.num_speculative_tokens_for(request)
            if limit == 0:
                continue
            drafts = chunk.token_ids[chunk.num_tokens - chunk.num_draft_tokens:]
            batch.append(DraftRequest(request.req_id, request.all_token_ids + drafts, limit + 1,
                                      request.sampling_params, num_assumed=len(drafts),
                                      num_prompt_tokens=request.num_prompt_tokens))
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
                kept = tracked.request.extend_logprobs(entries)
                if tracked.detok is not None:  # vLLM's decoded_token, for a request that is detokenized
                    self.token_texts.name(kept)

    def _record_prompt_logprobs(self, plan: StepPlan, result: StepResult) -> None:
        """Keep the prompt logprobs a step's prefill chunks answered: a chunk's entries are those of prompt tokens
        start_pos + 1 on, so a prompt computed again after preemption adds nothing already kept."""
        if result.prompt_logprobs is None:
            return
        for chunk, entries in zip(plan.chunks, result.prompt_logprobs):
            tracked = self.tracked.get(chunk.req_id)
            if entries and tracked is not None and tracked.prompt_logprobs is not None:
                kept = tracked.prompt_logprobs
                assert len(kept) >= chunk.start_pos + 1, (chunk.req_id, len(kept), chunk.start_pos)  # chunks in order
                new = entries[len(kept) - chunk.start_pos - 1:]
                kept.extend(new)
                if tracked.detok is not None:
                    self.token_texts.name(new)

    def _observe_acceptance(self, plan: StepPlan, result: StepResult) -> None:
        stats = self.scheduler.last_step_stats
        self.spec_stats.merge(stats)
        if self.policy is None:
            return
        told = getattr(self.drafter, "observe_verification", None)  # optional: exact per-drafter statistics
        for chunk, kept in zip(plan.chunks, result.sampled_token_ids):
            if chunk.sample and chunk.num_draft_tokens and chunk.req_id not in self._forced:
                if told is not None and (self.worker_method is None or
                                         self._draft_keys.get(chunk.req_id) != self.worker_method):
                    self._tell(told, chunk.req_id, chunk.num_draft_tokens, max(len(kept) - 1, 0))  # its own drafts
                request = self.scheduler.get_request(chunk.req_id)
                if request is None:
                    continue
                key, accepted = self._draft_keys.get(chunk.req_id), max(len(kept) - 1, 0)
                if chunk.req_id in self._draft_trees:  # proposed as a tree (it may have been a chain)
                    self.policy.observe_tree(request, self._verified_tree(chunk), accepted, key)
                else:
                    self.policy.observe(request, chunk.num_draft_tokens, accepted, key,
                                        self._draft_scores.get(chunk.req_id))

    def _observe_node_tokens(self, plan: StepPlan, result: StepResult) -> None:
        """Hand a drafter that asked for them (``observe_node_tokens``) the target's argmax after each node it
        proposed, in its proposal's node order (-1: a node the scheduler cut)."""
        told = getattr(self.drafter, "observe_node_tokens", None)
        if told is None or result.node_tokens is None:
            return
        for chunk, tokens in zip(plan.chunks, result.node_tokens):
            proposed = self._draft_trees.get(chunk.req_id)
            if not (chunk.want_node_tokens and tokens and proposed is not None):
                continue
            parents = chunk.draft_parents if chunk.draft_parents is not None else chain_parents(len(tokens))
            kept = kept_nodes(proposed.parents, parents)
            pruned = self._kept_nodes.get(chunk.req_id)  # the grammar pruned the proposal to these nodes
            if pruned is not None:
                kept = [pruned[k] for k in kept]
            in_order = [-1] * (kept[-1] + 1)
            for node, token in zip(kept, tokens):
                in_order[node] = token
            self._tell(told, chunk.req_id, in_order)

    def _verified_tree(self, chunk: ScheduledChunk) -> DraftTree:
        """The tree a chunk verified, with the drafter's scores when the scheduler verified it whole."""
        proposed = self._draft_trees.get(chunk.req_id)
        if proposed is not None and len(proposed) == chunk.num_draft_tokens:
            return proposed
        parents = chunk.draft_parents if chunk.draft_parents is not None else chain_parents(chunk.num_draft_tokens)
        return DraftTree(chunk.token_ids[chunk.num_tokens - chunk.num_draft_tokens:], list(parents))

    # ---- outputs --------------------------------------------------------------------------------------
    def _report(self, touched: list[Request]) -> list[RequestOutput]:
        """The outputs of the requests this step touched: every one that reports each step (``output_kind``
        "cumulative"), and the finished ones. A request reported only at the end is detokenized each step only
        when it has stop strings to look for (a stop string may finish it now)."""
        outputs = []
        for request in touched:
            tracked = self.tracked.get(request.req_id)
            if tracked is None or tracked.error is not None:  # gone, or its final output went out failed (_fail)
                continue
            if request.sampling_params.output_kind == "final_only":
                if request.sampling_params.stop:
                    self._detokenize(tracked)
                if not request.status.is_finished:
                    continue
            outputs.append(self._make_output(tracked))
        return outputs

    def _make_output(self, tracked: _Tracked) -> RequestOutput:
        request = tracked.request
        kind = request.sampling_params.output_kind
        if kind == "final_only" and not request.sampling_params.stop:
            if tracked.detok is not None:  # decoded once, at the end
                tracked.detok.push_all(request.output_token_ids[tracked.num_sent:_text_end(request)])
            tracked.num_sent = len(request.output_token_ids)
        self._detokenize(tracked)
        text = tracked.detok.text if tracked.detok is not None else ""
        finished = request.status.is_finished
        # a stop string may still begin in the last hold characters: they wait until it finishes
        end = len(text) if finished or not tracked.hold else max(0, len(text) - tracked.hold)
        tokens, logprobs = request.output_token_ids, request.output_logprobs
        cumulative_logprob = None if logprobs is None else request.cumulative_logprob
        prompt, prompt_ids, prompt_logprobs = tracked.prompt, request.prompt_token_ids, tracked.prompt_logprobs
        if kind == "delta":  # what is new since the last report; the prompt once
            if tracked.reported:
                prompt, prompt_ids, prompt_logprobs = None, [], None
            start, tracked.reported = tracked.reported_tokens, True
            text = text[tracked.reported_chars:end]
            tracked.reported_chars += len(text)
            tokens = tokens[start:]
            logprobs = None if logprobs is None else logprobs[start:]
            tracked.reported_tokens = len(request.output_token_ids)
        else:
            text = text if end == len(text) else text[:end]
            tokens, logprobs = list(tokens), None if logprobs is None else list(logprobs)
        # positional arguments, in the dataclasses' field order: built for every request every step
        completion = CompletionOutput(0, text, tokens, cumulative_logprob, logprobs, request.finish_reason,
                                      request.stop_reason)
        if prompt_logprobs is not None and kind != "delta" and len(prompt_logprobs) < len(prompt_ids):
            prompt_logprobs = list(prompt_logprobs)  # still growing (mid-prefill): an output handed out never changes
        return RequestOutput(request.req_id, prompt, prompt_ids, [completion], finished, request.spec_stats.copy(),
                             tracked.error, prompt_logprobs, request.num_cached_tokens, tracked.refused)

    def _detokenize(self, tracked: _Tracked) -> None:
        """Push the new output tokens through the detokenizer (not the stop token that ended the request: vLLM's
        text leaves it out unless ``include_stop_str_in_output``, special or not); finish the request on a stop
        string."""
        request, detok = tracked.request, tracked.detok
        # an aborted request's text is what it has: a stop string in its last tokens finishes nothing
        stops = request.sampling_params.stop if request.finish_reason not in ("abort", "error") else None
        outputs = request.output_token_ids
        end = _text_end(request)
        while detok is not None and tracked.num_sent < end:
            new = detok.push(outputs[tracked.num_sent])
            tracked.num_sent += 1
            early = tracked.num_sent <= request.sampling_params.min_tokens  # no stop before min_tokens outputs
            hit = find_stop(detok.text, len(new), stops) if stops and new and not early else None
            if hit is not None:
                self._stop_on_string(tracked, *hit)
                return
        tracked.num_sent = len(outputs)

    def _stop_on_string(self, tracked: _Tracked, start: int, stop: str) -> None:
        keep = start + len(stop) if tracked.request.sampling_params.include_stop_str_in_output else start
        tracked.detok.text = tracked.detok.text[:keep]
        self.scheduler.finish_request(tracked.request.req_id, tracked.num_sent, stop)

    def _forget(self, req_ids: list[str]) -> None:
        # a drafter that learns from finished text (suffix decoding's global tree) may see each one's whole
        # history: the tokens of its last step reached no proposal
        # the requests are done: a drafter failing to hear it (a user-provided drafter's bug) is logged, not raised
        told = getattr(self.drafter, "observe_finished", None)
        for rid in req_ids:
            tracked = self.tracked.pop(rid, None)
            self._grammars.pop(rid, None)
            self._bounded.pop(rid, None)
            self._undrafted.discard(rid)
            self._head_failed.discard(rid)
            if told is not None and tracked is not None and tracked.request.finish_reason in ("stop", "length"):
                try:
                    told(rid, tracked.request.all_token_ids)
                except Exception:
                    logger.exception("the drafter's observe_finished failed for request %s; ignored", rid)
        if self.policy is not None:
            self.policy.forget(req_ids)
        if self.drafter is not None and req_ids:
            try:
                self.drafter.finish(req_ids)
            except Exception:
                logger.exception("the drafter's finish failed for requests %s; ignored (what it holds for them may "
                                 "stay)", list(req_ids)[:8])


def _text_end(request: Request) -> int:
    """How many of the request's output tokens its text holds: all but the stop token that ended it, unless it asks
    for that token's text (``include_stop_str_in_output``)."""
    n = len(request.output_token_ids)
    if request.ended_on_stop_token and not request.sampling_params.include_stop_str_in_output:
        return n - 1
    return n


def _starts_with(drafts: list[int] | DraftTree | None, forced: list[int]) -> bool:
    """Whether ``drafts`` (a chain, or a tree's first nodes as a chain) begin with all of ``forced``."""
    if drafts is None:
        return False
    if isinstance(drafts, DraftTree):
        if not is_chain(drafts.parents[:len(forced)]):
            return False
        drafts = drafts.token_ids
    return list(drafts[:len(forced)]) == forced


def check_params_type(params) -> None:
    """A request's params are a SamplingParams (a dict or None is a caller's slip: say how to build one)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__} {params!r:.60}; "
                         "build one: SamplingParams(**fields)")


def bad_word_sequences(tokenizer, words: list[str]) -> list[list[int]]:
    """``SamplingParams.bad_words`` as token sequences: each word as it reads alone and after a space (its
    leading spaces dropped first), each sequence once."""
    if tokenizer is None:
        raise ValueError(f"bad_words={words!r} needs the model's tokenizer, and this engine has none; pass token ids "
                         "to ban through logit_bias instead")
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


def _check_proposal(proposal: Proposal, vocab_size: int) -> str | None:
    """What is wrong with a drafter's proposal (None: nothing): not a Proposal, token ids that are not a list of
    integers (a tensor, None) or fall outside the vocabulary, a q (``probs``) that is not a float tensor of a row
    per token no wider than the vocabulary with each token in its width, a key that is not hashable or scores that
    are not numbers, or a tree that is not one (a parent that is not an earlier node, lengths that differ, or a
    tree with a drafter's q)."""
    if not isinstance(proposal, Proposal):
        return (f"the drafter returned {type(proposal).__name__} {proposal!r:.60} for a request; propose must return "
                "one specray.drafters.base.Proposal per request, such as Proposal(token_ids=[...])")
    tokens, parents = proposal.token_ids, proposal.parents
    if not isinstance(tokens, (list, tuple)) and (isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence)):
        return (f"the drafter proposed token_ids of type {type(tokens).__name__} ({tokens!r:.60}); give a list of "
                "ints (Proposal([]) for no drafts; a tensor's .tolist())")
    if tokens:  # min/max/sum: C loops, this runs every step
        try:
            integers = hasattr(sum(tokens), "__index__")  # a float among them makes the sum one
            outside = min(tokens) < 0 or max(tokens) >= vocab_size
        except TypeError:
            integers = False
        if not integers:
            return f"the drafter proposed token ids that are not integers: {list(tokens)[:8]!r:.80}"
        if outside:
            return f"the drafter proposed token ids outside the vocabulary [0, {vocab_size}): {list(tokens)[:8]}"
    if proposal.probs is not None:
        problem = _check_probs(proposal.probs, tokens, vocab_size)
        if problem is not None:
            return problem
    try:
        hash(proposal.key)
        numbers = proposal.scores is None or isinstance(sum(proposal.scores), Real)  # numpy's too
    except TypeError:
        numbers = False
    if not numbers:  # the draft policy keys its evidence by the key and prices the drafts by the scores
        return (f"the drafter proposed key={proposal.key!r:.40} and scores={proposal.scores!r:.60}; give an int key "
                "(or None) and a float score per token (or None)")
    if parents is None:
        return None
    if proposal.probs is not None:
        return "the drafter proposed a token tree with probs; a drafter with a distribution q proposes chains"
    if len(parents) != len(tokens) or (proposal.scores is not None and len(proposal.scores) != len(tokens)):
        return (f"the drafter's tree has {len(tokens)} tokens, {len(parents)} parents and "
                f"{None if proposal.scores is None else len(proposal.scores)} scores; give one of each per node")
    if any(not isinstance(p, int) or not -1 <= p < i for i, p in enumerate(parents)):
        return f"the drafter's tree parents {list(parents)[:16]} are not -1 or an earlier node for every node"
    return None


def _specray_drafter(drafter) -> bool:
    """Whether ``drafter`` is one of specray's own (behind a router: the router's own drafter too), which reads the
    histories it is handed without changing them."""
    own = getattr(drafter, "own", None) if isinstance(drafter, DrafterRouter) else None
    return type(drafter).__module__.startswith("specray.") and (own is None or _specray_drafter(own))


def _check_probs(probs, tokens, vocab_size: int) -> str | None:
    """What is wrong with a chain's q (None: nothing): it must be a float tensor [len(token_ids), V'] with V' <= the
    vocabulary (a draft vocabulary's first V' ids) and every token below V' (else its q is 0). Its values are the
    verifier's to check (on the device, without a sync: a row that is not a distribution over its token is
    verified as a deterministic draft)."""
    shape = getattr(probs, "shape", None)
    floating = getattr(probs, "is_floating_point", None)
    if shape is None or not callable(floating) or not floating() or len(shape) != 2:
        return (f"the drafter proposed probs of type {type(probs).__name__} {tuple(shape or ())}; give a float "
                "torch.Tensor [len(token_ids), vocab] (or None for drafts without a q)")
    rows, width = shape
    if rows < len(tokens) or not 0 < width <= vocab_size or (tokens and max(tokens) >= width):
        return (f"the drafter proposed {len(tokens)} tokens (the largest {max(tokens, default=None)}) with probs of "
                f"shape {tuple(shape)}; give one row per token, at most {vocab_size} wide, each token within it")
    return None


@dataclass
class _InFlight:
    """A step started and not yet answered (pipeline stages keep several)."""

    plan: StepPlan
    draft_probs: dict
    future: StepFuture
    started: float = field(default=0.0)


def _carries_state(plan: StepPlan) -> bool:
    """A plan without chunks that still tells the workers something (requests gone, new, moved or re-blocked)."""
    return bool(plan.finished_req_ids or plan.preempted_req_ids or plan.new_requests or plan.block_deltas
                or plan.kv_moves)


def _check_token_constraints(params: SamplingParams, grammar: RequestGrammar | None,
                             min_tokens_banned: list[int] = ()) -> None:
    """A ValueError for constraints that leave the first output token nothing to be: ``allowed_token_ids`` all banned
    by one-token ``bad_words``, or before ``min_tokens`` outputs by those and the tokens that would end the request
    (``min_tokens_banned``: its stop token ids, EOS unless ``ignore_eos``), or none of them allowed by the structured
    output's grammar (each of which would otherwise sample a token of no probability: one outside
    ``allowed_token_ids``, or fail the request after it started)."""
    allowed = params.allowed_token_ids
    if allowed is None:
        return
    banned = {seq[0] for seq in params.bad_words_token_ids or () if len(seq) == 1}
    if set(allowed) <= banned:
        raise ValueError(f"allowed_token_ids={list(allowed)[:8]} are all banned by bad_words={params.bad_words!r}: "
                         "nothing is left to sample; allow other tokens or drop those bad words")
    if set(allowed) <= banned | set(min_tokens_banned):
        raise ValueError(f"allowed_token_ids={list(allowed)[:8]} are all tokens that end the request (stop_token_ids, "
                         f"EOS unless ignore_eos{', or bad_words' if banned else ''}), which get no probability "
                         f"before min_tokens={params.min_tokens} outputs: nothing is left to sample; allow other "
                         "tokens, set min_tokens=0, or ignore_eos=True where EOS is what they allow")
    if grammar is None:
        return
    row = grammar.mask_row()  # bit t of word t // 32: the grammar allows token t first
    if not any(t < 32 * len(row) and (int(row[t >> 5]) >> (t & 31)) & 1 for t in allowed):
        raise ValueError(f"allowed_token_ids={list(allowed)[:8]} holds no token the structured output allows first "
                         "(its grammar would be left no token): allow the tokens the output format needs, or drop "
                         "allowed_token_ids")


def _is_decode_step(plan: StepPlan) -> bool:
    """Every chunk is one request's last token plus its drafts: the steps the draft policy prices. A prefill
    chunk's tokens cost far less each (one large matmul) and would bend the fitted cost line."""
    return not plan.is_empty and all(c.sample and c.num_tokens == 1 + c.num_draft_tokens for c in plan.chunks)


def _by_request(result: StepResult) -> dict[str, tuple]:
    """A step's answer per request id: its kept tokens, and their logprobs, its tree's accepted path, its node
    tokens, the worker's drafts for its next step and its prompt logprobs (each None when the step returned
    none)."""
    none = [None] * len(result.req_ids)
    return {rid: answer for rid, *answer in zip(result.req_ids, result.sampled_token_ids, result.logprobs or none,
                                                result.accepted_draft_indices or none, result.node_tokens or none,
                                                result.draft_token_ids or none, result.draft_parents or none,
                                                result.draft_scores or none, result.prompt_logprobs or none)}


def _merge(plan: StepPlan, done: dict[str, tuple]) -> StepResult:
    """One result for ``plan`` from the answers of its retried chunks; a failed chunk's entry is empty (the
    scheduler skips it: the request is finished by then). The optional fields stay None when no answer has them,
    else [] for the chunks without (a tree's path must come through: its K/V moves by it)."""
    chunks: list[ScheduledChunk] = plan.chunks
    answers = [done.get(c.req_id, ([], None, None, None, None, None, None, None)) for c in chunks]
    tokens, logprobs, paths, node_tokens, drafts, parents, scores, prompt_logprobs = (
        (list(column) for column in zip(*answers)) if answers else ([],) * 8)
    return StepResult(plan.step_id, [c.req_id for c in chunks], tokens, logprobs=_optional(logprobs),
                      accepted_draft_indices=_optional(paths), node_tokens=_optional(node_tokens),
                      draft_token_ids=_optional(drafts), draft_parents=_optional(parents),
                      draft_scores=_optional(scores), prompt_logprobs=_optional(prompt_logprobs))


def _optional(column: list) -> list | None:
    return [[] if v is None else v for v in column] if any(v is not None for v in column) else None
