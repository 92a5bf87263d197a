"""Continuous batching with chunked prefill, paged KV and speculative verification (torch-free).

One unified token budget per step (vLLM v1's design): every request simply needs ``num_tokens -
num_computed_tokens`` more tokens computed (a prefill remainder, or the one token sampled last step), plus the
drafts the engine wants verified. A step is planned in three passes:

1. RUNNING requests, oldest first (``scheduling_policy="priority"``: lowest priority value first, then oldest), get
   their required tokens (prefill chunks cut to the budget). When KV blocks run out, the last running request in
   that order is preempted by recompute (blocks freed, back to the front of the waiting queue, its output kept and
   recomputed as context later) until the request fits, or it is itself the last and preempts itself.
2. Their drafts, trimmed to the remaining budget, to ``max_model_len``, to what ``max_tokens`` still allows, and
   to the free blocks. Drafts never preempt anybody and never take the budget of another request's required
   token.
3. WAITING requests, first in first out (``"priority"``: by priority, then arrival), while seats, budget and
   blocks last (skipped in a step that preempted, so a request is never preempted and readmitted in one plan).

Worker-side state is tracked per request: how many block ids the worker holds and how much of that prefix is
still unchanged since the last plan (``rewind`` only cuts a table's end, ``allocate`` only appends), which is
exactly a :class:`BlockTableDelta`. ``StepPlan.finished_req_ids`` lists the requests the worker holds that
finished or were aborted since the last plan, ``StepPlan.preempted_req_ids`` those it must drop the block tables
of but whose sampling state it keeps; the worker handles both before ``new_requests``.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import Collection
from dataclasses import dataclass, field

from specray.config import SCHEDULING_POLICIES
from specray.contract import BlockTableDelta, KVMove, NewRequest, ScheduledChunk, StepPlan, StepResult
from specray.kv_blocks import BlockPool, slots_of
from specray.outputs import SpecStats
from specray.scheduler.request import FINISH_REASONS, Request, RequestStatus, check_prompt
from specray.tree import DraftTree, is_chain, trim_tree

logger = logging.getLogger(__name__)

_FINISH_STATUS = {reason: status for status, reason in FINISH_REASONS.items()}


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # most tokens of one request's prefill in a step (vLLM's name; 0: no bound): a long prompt then leaves budget
    # for requests that arrive after it, which otherwise wait until its whole prefill is done
    long_prefill_token_threshold: int = 0
    block_size: int = 16
    num_blocks: int = field(kw_only=True)
    vocab_size: int | None = field(default=None, kw_only=True)  # known: requests are checked against it
    # a drafter on the worker drafts up to this many tokens after each step (0: none); its slots are reserved:
    # m - 1 past the verified drafts for a chain of m, or m + 1 when it writes a block from the sampled token's
    # position on (``worker_block_slots``: DFlash), or ``worker_tree_slots`` when it grows token trees, or none
    # when its drafting writes no K/V (``worker_writes_kv`` False: Medusa's heads)
    worker_draft_steps: int = field(default=0, kw_only=True)
    worker_tree_slots: int = field(default=0, kw_only=True)
    worker_writes_kv: bool = field(default=True, kw_only=True)
    worker_block_slots: bool = field(default=False, kw_only=True)
    # (begin, end) token ids of a reasoning model's thinking phase, for relaxed acceptance: each chunk with drafts
    # says whether its request's committed tokens end inside it (ScheduledChunk.thinking); None: never
    thinking_tokens: tuple[int, int] | None = field(default=None, kw_only=True)
    # vLLM's automatic prefix caching: a request starts from the cached blocks its tokens share with earlier ones
    enable_prefix_caching: bool = field(default=False, kw_only=True)
    # vLLM's: "fcfs" (first come, first served) or "priority" (SamplingParams.priority, lowest first; ties by
    # arrival): the order of admission, of KV blocks for running requests, and of preemption (last first)
    scheduling_policy: str = field(default="fcfs", kw_only=True)
    # vLLM's: the most distinct LoRA adapters in one step (0: the engine serves none); a request whose adapter would
    # be one too many waits, in its place in the queue, while requests behind it go ahead
    max_loras: int = field(default=0, kw_only=True)
    # prefix caching on a model with linear attention (a recurrent state per request): how many states the worker
    # keeps at block boundaries (snapshot slots; 0: none). A prompt's prefill stops once at its last whole block,
    # whose state is kept; a later request starts from cached blocks only up to a boundary whose state is kept
    recurrent_snapshots: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        for name in ("worker_draft_steps", "worker_tree_slots", "max_loras", "recurrent_snapshots"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be an int >= 0")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold={self.long_prefill_token_threshold!r} must be an int "
                             ">= 0 (0: no bound)")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} must be one of {list(SCHEDULING_POLICIES)}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be true or false")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len!r} must be an int >= 2 "
                             "(one prompt token plus one generated token)")


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.block_manager = BlockPool(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache, and those found (vLLM's)
        self.prefix_cache_hits = 0
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted oldest first at each schedule()
        self.num_preemptions = 0  # preemptions since start, over all requests
        self.last_step_stats = SpecStats()
        self._step_ids = itertools.count()
        self._pool_slots = config.num_blocks * config.block_size
        self._worker_blocks: dict[str, int] = {}  # req_id -> length of the block table the worker holds
        self._kept_blocks: dict[str, int] = {}  # req_id -> prefix of it unchanged since the last plan, if cut
        self._dropped_ids: list[str] = []  # the next plan's finished_req_ids
        self._preempted_ids: list[str] = []  # the next plan's preempted_req_ids
        self._worker_requests: set[str] = set()  # requests whose sampling state the worker holds
        self._finished_unreported: list[Request] = []  # finished inside schedule(), returned by the next update
        # finished since the last update_from_output began: finish_request may still fix their outputs (a stop string
        # found when they are reported, after that update or, with async scheduling, after the next schedule)
        self._just_finished: dict[str, Request] = {}
        self._kv_moves: dict[str, KVMove] = {}  # accepted tree paths to move into committed slots (next plan)
        self._held_for_room = False  # this plan's oldest unscheduled request waits for blocks a step in flight holds
        # the order requests are served in: running ones get blocks in it and give them back in reverse; waiting
        # ones are admitted in it (first come, first served; or by priority, then arrival)
        self._order = (_arrival if config.scheduling_policy == "fcfs" else _priority_then_arrival)
        # recurrent-state snapshots (SchedulerConfig.recurrent_snapshots): the content id of the block each kept
        # state ends at -> its slot (least recently used first), the slots free, and per request the slot its next
        # chunk starts from and the (slot, boundary) its chunk in flight keeps; and per request a branch point: where
        # its prompt parts from cached blocks that no kept state ends (an earlier prompt's; the state there is kept
        # too, so that the prompts sharing that prefix after it start there)
        self._snapshots: OrderedDict[int, int] = OrderedDict()
        self._free_snapshots = list(range(config.recurrent_snapshots))
        self._restoring: dict[str, int] = {}
        self._saving: dict[str, tuple[int, int]] = {}
        self._branches: dict[str, int] = {}

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request; a bad one raises ValueError and changes nothing."""
        self._validate(req)
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def _validate(self, req: Request) -> None:
        """Admission: everything a step will touch is checked here, so a bad request cannot fail a step."""
        cfg, n = self.config, req.num_prompt_tokens
        if req.req_id in self.requests:
            raise ValueError(f"req_id={req.req_id!r} is already in use; give each request a unique id")
        check_prompt(req.prompt_token_ids, cfg.max_model_len, cfg.vocab_size)
        req.sampling_params.check(cfg.vocab_size)
        if req.sampling_params.priority != 0 and cfg.scheduling_policy != "priority":
            raise ValueError(f"priority={req.sampling_params.priority} needs an engine with scheduling_policy="
                             f"'priority' (this one serves requests first come, first served: "
                             f"{cfg.scheduling_policy!r}); start it with that policy or leave priority 0")
        lora = req.sampling_params.lora_request
        if lora is not None and not cfg.max_loras:
            raise ValueError(f"lora_request names adapter {lora.lora_name!r} but this engine serves no adapters; start "
                             "it with enable_lora=True")
        cap = self._prefill_cap()
        for item in req.multimodal.items if req.multimodal is not None else ():
            if item.bidirectional and item.length > cap:
                raise ValueError(f"an image of the prompt takes {item.length} tokens, computed in one step (its tokens "
                                 f"attend to each other both ways), more than a step computes for one request ({cap}: "
                                 "max_num_batched_tokens, or long_prefill_token_threshold when set); raise it")
        if n > self._pool_slots:
            raise ValueError(f"prompt_token_ids has {n} tokens but the KV cache holds only {self._pool_slots} "
                             f"(num_blocks={cfg.num_blocks} x block_size={cfg.block_size}); raise num_blocks "
                             "(num_kv_blocks) or shorten the prompt")
        assert req.status is RequestStatus.WAITING and not req.block_ids and req.num_computed_tokens == 0

    def abort_requests(self, req_ids: str | list[str], reason: str = "abort") -> list[Request]:
        """Finish these requests now with ``reason`` ("abort", or "error" when a step failed for them), free
        their blocks, and return them; unknown or finished ids are ignored."""
        done = []
        for req_id in [req_ids] if isinstance(req_ids, str) else req_ids:
            req = self.requests.get(req_id)
            if req is not None:
                req.status = _FINISH_STATUS[reason]
                self._retire(req)
                done.append(req)
        return done

    def update_draft_token_ids(self, drafts: dict[str, list[int] | DraftTree],
                               next_draft_lens: dict[str, int] | None = None,
                               from_worker: Collection[str] = ()) -> None:
        """The drafts each request should verify in the next step (the only way drafts come in): a chain of
        token ids, or a :class:`~specray.tree.DraftTree`. Ids of requests that are not running are ignored. A
        request not named keeps none. ``next_draft_lens``: with a drafter on the worker, how many drafts to have
        it make after the next step (a request not named gets the most, ``worker_draft_steps``). ``from_worker``:
        the requests whose drafts are (a prefix of) the chain the worker drafted for them (their chunks say so:
        ``ScheduledChunk.worker_drafts``)."""
        for req_id, n in (next_draft_lens or {}).items():
            req = self.requests.get(req_id)
            if req is not None:
                req.num_next_drafts = n
        for req_id, tokens in drafts.items():
            req = self.requests.get(req_id)
            if req is not None and req.status is RequestStatus.RUNNING:
                if isinstance(tokens, DraftTree):
                    req.draft_token_ids = list(tokens.token_ids)
                    req.draft_parents = None if is_chain(tokens.parents) else list(tokens.parents)
                    req.want_node_tokens = tokens.wants_node_tokens
                else:
                    req.draft_token_ids, req.draft_parents, req.want_node_tokens = list(tokens), None, False
                req.drafts_from_worker = req_id in from_worker

    def finish_request(self, req_id: str, num_output_tokens: int | None = None,
                       stop_reason: int | str | None = None, reason: str = "stop") -> None:
        """Finish a request from outside, typically on a stop string the engine found after detokenizing:
        keep only its first ``num_output_tokens`` output tokens (None keeps all; the tokens after the one that
        completed the stop string are dropped), set ``finish_reason``/``stop_reason`` and free its blocks now.

        Also accepted for a request that finished in the latest ``update_from_output`` or since (say it reached
        ``max_tokens`` in the step whose tokens complete a stop string): then only its output and reasons change.
        """
        status = _FINISH_STATUS.get(reason)
        if status is None:
            raise ValueError(f"reason={reason!r} is not a finish reason; use one of {sorted(_FINISH_STATUS)}")
        req = self.requests.get(req_id) or self._just_finished.get(req_id)
        if req is None:
            raise ValueError(f"req_id={req_id!r} is not a live request (never added, aborted, or finished before "
                             "the latest step); only finish requests the scheduler still holds")
        if num_output_tokens is not None:
            self._truncate(req, num_output_tokens)
        req.status, req.stop_reason = status, stop_reason
        if req_id in self.requests:
            self._retire(req)

    def _truncate(self, req: Request, num_output_tokens: int) -> None:
        if not isinstance(num_output_tokens, int) or not 0 <= num_output_tokens <= req.num_output_tokens:
            raise ValueError(f"num_output_tokens={num_output_tokens!r} must be an int in [0, "
                             f"{req.num_output_tokens}] (the output tokens of {req.req_id!r} to keep)")
        req.truncate_output(num_output_tokens)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def get_request(self, req_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self.requests.get(req_id)

    # ---- schedule -------------------------------------------------------------------------------------
    def schedule(self, busy: frozenset[str] = frozenset(), max_seqs: int | None = None) -> StepPlan:
        """The next step's plan. ``busy``: running requests in a step still in flight (pipeline stages keep several
        going), which this plan leaves alone: never scheduled, preempted or re-admitted, as their step's result will
        land on them. ``max_seqs``: the most requests in this plan (a pipeline's cohorts), else ``max_num_seqs``."""
        self.running.sort(key=self._order)
        if self._order is not _arrival and len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=self._order))
        budget = self.config.max_num_batched_tokens
        seats = max_seqs or self.config.max_num_seqs
        preemptions = self.num_preemptions
        self._held_for_room = False
        required = self._reserve_running(budget, busy, seats)
        budget -= sum(n for _, n in required)
        chunks = []
        for req, num_new in required:
            drafts, parents = self._drafts(req, num_new, budget)
            budget -= len(drafts)
            chunks.append(self._chunk(req, num_new, drafts, parents))
        if self.num_preemptions == preemptions and not self._held_for_room:
            chunks += self._admit_waiting(budget, seats - len(chunks))
        return self._make_plan(chunks)

    def _reserve_running(self, budget: int, busy: frozenset[str], seats: int) -> list[tuple[Request, int]]:
        """Pass 1: blocks and budget for each running request's required tokens (not the ``busy`` ones'; at most
        ``seats`` requests), preempting as needed."""
        required, i = [], 0
        cap = self._prefill_cap()
        while i < len(self.running) and budget > 0 and len(required) < seats:
            req = self.running[i]
            if req.req_id in busy:
                i += 1
                continue
            if self._beyond_pool(req):
                continue
            num_new = self._whole_images(req, self._to_snapshot(req, min(req.num_tokens - req.num_computed_tokens,
                                                                          budget, cap)), min(budget, cap))
            if not num_new:  # an image that must be computed whole does not fit what is left of the budget
                i += 1
                continue
            if not self._make_room(req, req.num_computed_tokens + num_new, busy):
                break
            required.append((req, num_new))
            budget -= num_new
            i += 1
        return required

    def _prefill_cap(self) -> int:
        """The most tokens one request computes in a step (its prefill's chunk; a decode computes one):
        ``long_prefill_token_threshold``, else the whole budget."""
        return self.config.long_prefill_token_threshold or self.config.max_num_batched_tokens

    def _make_room(self, req: Request, num_slots: int, busy: frozenset[str]) -> bool:
        """Preempt the newest running requests (none in a step in flight: ``busy``) until ``req`` covers
        ``num_slots`` slots; False if ``req`` cannot have them now: it was the newest and preempted itself, or
        newer requests hold the blocks in a step in flight, and it waits for their step to come back (then they
        are the ones preempted: an older request never gives way to a newer one)."""
        while not self.block_manager.can_fit(req, num_slots):
            victim = next(r for r in reversed(self.running) if r.req_id not in busy)  # req itself at the latest
            if victim is req and any(r.req_id in busy for r in self.running[self.running.index(req) + 1:]):
                self._held_for_room = True  # and nobody is admitted past it meanwhile
                return False
            self._preempt(victim)
            if victim is req:
                return False
        self.block_manager.allocate(req, num_slots)
        return True

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: drop its KV; it resumes later by prefilling its prompt and output again."""
        self.running.remove(req)
        self.block_manager.free(req)
        if self._forget_worker_blocks(req):
            self._preempted_ids.append(req.req_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        _drop_drafts(req)
        self._kv_moves.pop(req.req_id, None)  # its KV is recomputed
        self._drop_snapshot_work(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s (KV blocks exhausted): it will recompute %d tokens", req.req_id, req.num_tokens)

    def _beyond_pool(self, req: Request) -> bool:
        """Finish (as "length") a request that can no longer fit in the whole KV pool even alone; it would
        otherwise preempt itself forever. True if it was finished (and removed from its queue)."""
        if req.num_tokens <= self._pool_slots:
            return False
        logger.warning("request %s needs %d KV slots but the pool holds %d: finishing it (length); raise "
                       "num_blocks (num_kv_blocks) for longer outputs", req.req_id, req.num_tokens, self._pool_slots)
        req.status = RequestStatus.FINISHED_LENGTH
        self._retire(req)
        self._finished_unreported.append(req)
        return True

    def _drafts(self, req: Request, num_new: int, budget: int) -> tuple[list[int], list[int] | None]:
        """Pass 2: which of ``req``'s drafts to verify, and their tree's parents (None: a chain). A request with
        r tokens left to generate can use drafts at most r - 1 deep (the target adds one); every draft (tree
        node) takes one token of the budget and one slot, and drafts only take blocks that are free."""
        end = req.num_computed_tokens + num_new
        if not req.draft_token_ids or end < req.num_tokens:
            return [], None
        left = req.tokens_left(self.config.max_model_len)
        bm = self.block_manager
        free_slots = (len(req.block_ids) + bm.num_free_blocks) * bm.block_size - end
        max_nodes = max(0, min(budget, free_slots))
        if req.draft_parents is None:
            return req.draft_token_ids[: max(0, min(max_nodes, left - 1))], None
        tree = trim_tree(DraftTree(req.draft_token_ids, req.draft_parents), max_nodes, left - 1)
        return tree.token_ids, None if is_chain(tree.parents) else tree.parents

    def _chunk(self, req: Request, num_new: int, drafts: list[int] | None = None,
               parents: list[int] | None = None) -> ScheduledChunk:
        drafts = drafts or []
        start = req.num_computed_tokens
        end = start + num_new
        k = len(drafts)
        sample = end == req.num_tokens
        next_drafts = self._next_drafts(req, end, k) if sample and self.config.worker_draft_steps else 0
        self.block_manager.allocate(req, end + k + self._lookahead_slots(next_drafts))
        tokens = req.all_token_ids[start:end] + drafts
        chunk = ScheduledChunk(req.req_id, tokens, start, k, sample=sample, draft_parents=parents,
                               want_node_tokens=k > 0 and req.want_node_tokens, num_next_drafts=next_drafts,
                               worker_drafts=k > 0 and req.drafts_from_worker)
        if not sample and (self.config.worker_draft_steps or req.sampling_params.prompt_logprobs is not None):
            chunk.next_token_id = req.all_token_ids[end]  # the head reads it; so does the last prompt logprob
        if k and self.config.thinking_tokens is not None:
            chunk.thinking = req.inside(*self.config.thinking_tokens)
        if self.config.recurrent_snapshots:
            chunk.restore_state = self._restoring.pop(req.req_id, None)
            if end in self._snapshot_boundaries(req) and end > start and req.req_id not in self._saving:
                slot = self._snapshot_slot()
                if slot is not None:
                    chunk.save_state = slot
                    self._saving[req.req_id] = (slot, end)
        return chunk

    # ---- recurrent-state snapshots (prefix caching with linear attention) ----------------------------------

    def _snapshot_boundaries(self, req: Request) -> tuple[int, ...]:
        """Where ``req``'s state is kept: its branch point, if it has one, and the end of its prompt's last whole
        block (none without snapshots)."""
        if not (self.config.recurrent_snapshots and self._uses_prefix_cache(req)):
            return ()
        last = req.num_prompt_tokens // self.config.block_size * self.config.block_size
        branch = self._branches.get(req.req_id, 0)
        return (branch, last) if 0 < branch < last else (last,)

    def _to_snapshot(self, req: Request, num_new: int) -> int:
        """``num_new`` tokens of ``req``'s next chunk, stopped at its first snapshot boundary it would pass."""
        start = req.num_computed_tokens
        return next((b - start for b in self._snapshot_boundaries(req) if start < b < start + num_new), num_new)

    @staticmethod
    def _whole_images(req: Request, num_new: int, most: int) -> int:
        """``num_new`` tokens of ``req``'s next chunk, cut so that it never ends inside an image whose tokens attend
        to each other both ways (``MultiModalItem.bidirectional``): it stops before such an image, or, starting at
        or inside one, takes the rest of it if at most ``most`` tokens do (else 0: not now)."""
        mm = req.multimodal
        start = req.num_computed_tokens
        end = start + num_new
        for item in mm.items if mm is not None else ():
            if item.bidirectional and item.offset < end < item.end:
                end = item.offset if item.offset > start else item.end
                return end - start if end - start <= most else 0
        return num_new

    def _snapshot_slot(self) -> int | None:
        """A snapshot slot to keep a state in: a free one, else the least recently used one's (forgotten)."""
        if self._free_snapshots:
            return self._free_snapshots.pop()
        if self._snapshots:
            return self._snapshots.popitem(last=False)[1]
        return None  # every slot is being written by a chunk in flight

    def _snapshot_kept(self, req: Request) -> None:
        """``req``'s chunk that kept its state ran: the state now stands for the block that chunk ended at."""
        slot, end = self._saving.pop(req.req_id)
        index = end // self.config.block_size - 1
        if index >= len(req.block_contents):  # its block is not cached (it cannot be found): the slot is free
            self._free_snapshots.append(slot)
            return
        content = req.block_contents[index]
        old = self._snapshots.pop(content, None)
        if old is not None:
            self._free_snapshots.append(old)
        self._snapshots[content] = slot

    def _drop_snapshot_work(self, req: Request) -> None:
        """``req`` leaves (finished, aborted, preempted): a restore it had not run is forgotten, a slot its chunk
        was to write is free again."""
        self._restoring.pop(req.req_id, None)
        self._branches.pop(req.req_id, None)
        saving = self._saving.pop(req.req_id, None)
        if saving is not None:
            self._free_snapshots.append(saving[0])

    def _next_drafts(self, req: Request, end: int, k: int) -> int:
        """How many drafts a worker-side drafter makes for ``req`` after this step: what the engine asked (else the
        most), at most what the request can still use after this step even if all k drafts are kept, and the
        m - 1 slots past its drafts that drafting writes taken only from free blocks."""
        m = self.config.worker_draft_steps if req.num_next_drafts is None else req.num_next_drafts
        cap = req.sampling_params.num_speculative_tokens
        if cap is not None:
            m = min(m, cap)
        m = min(m, req.tokens_left(self.config.max_model_len) - k - 2)
        if m <= 0:
            return 0
        if not self.config.worker_writes_kv:
            return m
        bm = self.block_manager
        free_slots = (len(req.block_ids) + bm.num_free_blocks) * bm.block_size - (end + k)
        if self.config.worker_tree_slots:  # a tree needs all its slots, or is not drafted
            return m if free_slots >= self.config.worker_tree_slots else 0
        return max(0, min(m, free_slots - self._past_drafts))

    @property
    def _past_drafts(self) -> int:
        """Slots a chain's drafting writes past its m drafts' count: -1 (draft steps), or 1 (a block)."""
        return 1 if self.config.worker_block_slots else -1

    def _lookahead_slots(self, next_drafts: int) -> int:
        """Slots past a chunk's drafts that the worker's drafting writes (none when it drafts nothing)."""
        if next_drafts == 0 or not self.config.worker_writes_kv:
            return 0
        return self.config.worker_tree_slots or next_drafts + self._past_drafts

    def _admit_waiting(self, budget: int, seats: int) -> list[ScheduledChunk]:
        """Pass 3: first prefill chunks of waiting requests (new, or resumed after preemption). With prefix
        caching, a request whose next whole block a running request is still computing (the n choices of one
        prompt, a burst behind one system prompt) waits, in its place in the queue, until that block is cached."""
        chunks, cap, held = [], self._prefill_cap(), []
        adapters = self._running_adapters()
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(chunks) < seats):
            req = self.waiting[0]
            if self._beyond_pool(req):
                continue
            lora = req.sampling_params.lora_request
            if lora is not None and lora.lora_int_id not in adapters and len(adapters) >= self.config.max_loras:
                held.append(self.waiting.popleft())  # one adapter too many for this step: it waits
                continue
            hit = self._take_cached(req)
            if self._uses_prefix_cache(req) and self._prefix_in_flight(req, hit):
                self._give_back_hit(req, hit)
                held.append(self.waiting.popleft())
                continue
            num_new = self._whole_images(req, self._to_snapshot(req, min(req.num_tokens - req.num_computed_tokens,
                                                                          budget, cap)), min(budget, cap))
            if not num_new or not self.block_manager.can_fit(req, req.num_computed_tokens + num_new):
                self._give_back_hit(req, hit)  # its cached blocks stay cached until it fits
                break
            if self.config.enable_prefix_caching:
                self._count_lookup(req, hit)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if lora is not None:
                adapters.add(lora.lora_int_id)
            chunks.append(self._chunk(req, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(held))
        return chunks

    def _running_adapters(self) -> set[int]:
        if not self.config.max_loras:  # no adapters: nothing to count, every step
            return set()
        return {r.sampling_params.lora_request.lora_int_id for r in self.running
                if r.sampling_params.lora_request is not None}

    def _give_back_hit(self, req: Request, hit: int) -> None:
        self._branches.pop(req.req_id, None)  # (found again when it is admitted)
        if hit:
            self.block_manager.free(req)
            req.num_computed_tokens = 0
            self._restoring.pop(req.req_id, None)

    def _prefix_in_flight(self, req: Request, hit: int) -> bool:
        """Whether a running request is still to compute the whole block that follows ``req``'s hit, with the
        same tokens up to its end (it will be cached: ``req`` then computes less by waiting for it)."""
        end = hit + self.config.block_size
        if end > req.num_tokens - 1:
            return False
        prefix = req.cache_keys()[:end]
        salt = prefix_salt(req.sampling_params)
        return any(w.num_computed_tokens < end <= w.num_tokens and prefix_salt(w.sampling_params) == salt
                   and w.cache_keys()[:end] == prefix for w in self.running)

    def _uses_prefix_cache(self, req: Request) -> bool:
        """Prefix caching is on and ``req`` may start from cached blocks: not one that asked for its prompt's
        logprobs (they need every position computed)."""
        return self.config.enable_prefix_caching and req.sampling_params.prompt_logprobs is None

    def _take_cached(self, req: Request) -> int:
        """Prefix caching: start a request with no KV from the cached blocks its tokens begin with (all but its
        last token at most); returns the tokens they hold."""
        if req.num_computed_tokens or not self._uses_prefix_cache(req):
            return 0
        snapshots = self._snapshots if self.config.recurrent_snapshots else None  # resume where a state was kept
        self._branches.pop(req.req_id, None)
        hit = self.block_manager.take_cached(req, req.cache_keys(), req.num_tokens - 1,
                                             prefix_salt(req.sampling_params),
                                             None if snapshots is None else snapshots.__contains__)
        req.num_computed_tokens = hit
        if snapshots is not None:
            if hit:
                content = req.block_contents[-1]
                snapshots.move_to_end(content)
                self._restoring[req.req_id] = snapshots[content]
            else:  # cached blocks but no kept state: an earlier prompt shares them and went on. Keep the state
                # where this one parts from it too, for the next prompts that share them (a system prompt's); a
                # request that resumed from a kept state (a chat's next turn) keeps one, at its last whole block
                run = self.block_manager.cached_run(req.cache_keys(), req.num_tokens - 1,
                                                    prefix_salt(req.sampling_params))
                if run:
                    self._branches[req.req_id] = run
        return hit

    def _count_lookup(self, req: Request, hit: int) -> None:
        if not req.num_preemptions:  # its first admission: what the prompt found (vLLM's num_cached_tokens)
            req.num_cached_tokens = hit
        self.prefix_cache_queries += req.num_tokens
        self.prefix_cache_hits += hit

    def _cache_blocks(self, req: Request, limit: int | None = None) -> None:
        """Prefix caching: register the request's blocks that committed tokens with written K/V fill (before
        position ``limit``, where a tree's accepted path still waits to be moved into place)."""
        if self.config.enable_prefix_caching:
            n = req.num_computed_tokens if limit is None else min(limit, req.num_computed_tokens)
            if n // self.config.block_size > len(req.block_contents):  # a block filled up since the last call
                self.block_manager.cache_blocks(req, req.cache_keys(), n, prefix_salt(req.sampling_params))

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (vLLM's ``reset_prefix_cache``); running requests keep theirs. Returns
        how many were dropped."""
        return self.block_manager.reset_cache()

    def _make_plan(self, chunks: list[ScheduledChunk]) -> StepPlan:
        plan = StepPlan(next(self._step_ids), chunks=chunks, finished_req_ids=self._dropped_ids,
                        preempted_req_ids=self._preempted_ids, kv_moves=list(self._kv_moves.values()))
        self._dropped_ids, self._preempted_ids, self._kv_moves = [], [], {}
        for req in self.running:
            if req.req_id not in self._worker_blocks:
                plan.new_requests.append(_new_request(req))
                self._worker_requests.add(req.req_id)
            else:
                self._add_delta(plan, req)
            self._worker_blocks[req.req_id] = len(req.block_ids)
        return plan

    def _add_delta(self, plan: StepPlan, req: Request) -> None:
        held = self._worker_blocks[req.req_id]
        kept = self._kept_blocks.pop(req.req_id, held)
        if kept == held == len(req.block_ids):
            return
        plan.block_deltas.append(BlockTableDelta(req.req_id, kept, req.block_ids[kept:]))

    # ---- update ---------------------------------------------------------------------------------------
    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Apply one step's result; returns the requests that got new tokens or finished this step."""
        assert result.step_id == plan.step_id, (result.step_id, plan.step_id)
        assert result.req_ids == [c.req_id for c in plan.chunks], (result.req_ids, plan.chunks)
        touched, self._finished_unreported = self._finished_unreported, []
        self._just_finished = {}
        stats = SpecStats()
        paths = result.accepted_draft_indices or [None] * len(plan.chunks)
        for chunk, tokens, path in zip(plan.chunks, result.sampled_token_ids, paths):
            req = self.requests.get(chunk.req_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted or finished since the plan was made
            _drop_drafts(req)
            if chunk.sample:
                self._accept(req, chunk, tokens, path, stats)
                touched.append(req)
            else:
                assert not tokens, (chunk, tokens)
                req.num_computed_tokens += chunk.num_tokens
                self._cache_blocks(req)
            if chunk.save_state is not None and req.req_id in self._saving:  # (a finished one freed its slot)
                self._snapshot_kept(req)
        self.last_step_stats = stats
        return touched

    def _accept(self, req: Request, chunk: ScheduledChunk, tokens: list[int], path: list[int] | None,
                stats: SpecStats) -> None:
        """Keep the accepted drafts plus the target's token, stopping early on a stop condition. ``path``: the
        accepted tree nodes' draft indices (None or [] for a chain: its first drafts)."""
        k = chunk.num_draft_tokens
        accepted = len(tokens) - 1
        assert 0 <= accepted <= k, (chunk, tokens)
        moved = None  # the first committed position whose K/V a tree's accepted path moves there next step
        if k:
            first = chunk.num_tokens - k  # the first draft's index in the chunk
            if chunk.draft_parents is not None and path:
                drafts, path = chunk.token_ids[first:], list(path)
                assert len(path) == accepted and tokens[:accepted] == [drafts[i] for i in path], (drafts, path, tokens)
                moved = self._move_accepted(req, chunk.start_pos + first, path)
            else:  # a chain, or a tree accepted along its first drafts: they sit where they are
                assert tokens[:accepted] == chunk.token_ids[first:first + accepted], (chunk, tokens)
            req.spec_stats.record(k, accepted)
            stats.record(k, accepted)
        # The chunk's own tokens and the accepted drafts now have KV; the target's new token does not yet.
        req.num_computed_tokens += chunk.num_tokens - k + accepted
        finished = req.append_tokens(tokens, self.config.max_model_len)
        self._cache_blocks(req, moved)
        if finished:
            self._retire(req)
            return
        assert req.num_computed_tokens == req.num_tokens - 1, req
        self._rewind(req, req.num_computed_tokens)

    def _move_accepted(self, req: Request, base: int, path: list[int]) -> int | None:
        """An accepted tree path whose nodes are not the first drafts: their K/V (scratch slot indices base +
        node) moves to the committed slot indices base + j, in the next plan, before anything frees or reuses
        the blocks (physical slots, computed with the table as it is now, before the rewind). Returns the first
        slot index moved into (None: none)."""
        pairs = [(base + node, base + j) for j, node in enumerate(path) if node != j]
        if not pairs:
            return None
        table, bs = req.block_ids, self.config.block_size
        self._kv_moves[req.req_id] = KVMove(req.req_id, slots_of(table, [s for s, _ in pairs], bs),
                                            slots_of(table, [d for _, d in pairs], bs))
        return pairs[0][1]

    def _rewind(self, req: Request, num_tokens: int) -> None:
        """Free the blocks beyond the first ``num_tokens`` slots (only rejected drafts' KV was in them)."""
        self.block_manager.rewind(req, num_tokens)
        held = self._worker_blocks.get(req.req_id)
        if held is not None:
            kept = self._kept_blocks.get(req.req_id, held)
            self._kept_blocks[req.req_id] = min(kept, len(req.block_ids))

    # ---- a failed step ---------------------------------------------------------------------------------
    def forget_worker_state(self, plan: StepPlan) -> list[str]:
        """``plan`` failed on the worker, which may have applied any part of it: the next plan repeats its drops
        and sends every running request whole (a NewRequest with its full block table; the worker keeps the
        sampling state it holds). Nothing of the plan's tokens was counted, so its requests run again, except
        those whose K/V the plan was moving (a tree's accepted path): a move applied once or twice, or not at
        all, cannot be told apart, so they are preempted and recompute their KV. Returns those ids."""
        self._dropped_ids = list(plan.finished_req_ids) + self._dropped_ids
        self._preempted_ids = list(plan.preempted_req_ids) + self._preempted_ids
        self._worker_blocks.clear()
        self._kept_blocks.clear()
        moved = [m.req_id for m in plan.kv_moves if m.req_id in self.requests
                 and self.requests[m.req_id].status is RequestStatus.RUNNING]
        for req_id in moved:
            self._preempt(self.requests[req_id])
        return moved

    def retry_plan(self, plan: StepPlan, chunks: list[ScheduledChunk]) -> StepPlan:
        """A plan that runs again ``chunks`` (some of failed ``plan``'s), safe whatever part of ``plan`` the
        worker applied: it repeats the drops and gives each request its whole block table. Running a chunk
        twice only rewrites its KV slots with the same values."""
        new = [_new_request(self.requests[c.req_id]) for c in chunks]
        masks = {c.req_id: plan.token_bitmasks[c.req_id] for c in chunks if c.req_id in plan.token_bitmasks}
        return StepPlan(plan.step_id, new_requests=new, chunks=list(chunks),
                        finished_req_ids=list(plan.finished_req_ids), preempted_req_ids=list(plan.preempted_req_ids),
                        token_bitmasks=masks)

    # ---- bookkeeping ----------------------------------------------------------------------------------
    def _retire(self, req: Request) -> None:
        """A finished request leaves its queue and frees its blocks at once."""
        assert req.status.is_finished, req
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.block_manager.free(req)
        self._forget_worker_state(req)
        self._kv_moves.pop(req.req_id, None)
        self._drop_snapshot_work(req)
        _drop_drafts(req)
        del self.requests[req.req_id]
        self._just_finished[req.req_id] = req

    def _forget_worker_state(self, req: Request) -> None:
        """Tell the worker (in the next plan) to drop a request it holds, preempted or not."""
        self._forget_worker_blocks(req)
        if req.req_id in self._worker_requests:
            self._worker_requests.discard(req.req_id)
            self._dropped_ids.append(req.req_id)

    def _forget_worker_blocks(self, req: Request) -> bool:
        """Forget the block table the worker holds for ``req``; False if it holds none."""
        if self._worker_blocks.pop(req.req_id, None) is None:
            return False
        self._kept_blocks.pop(req.req_id, None)
        return True


def prefix_salt(params) -> str | None:
    """What a request's cached blocks are keyed by beside its tokens: its ``cache_salt`` and its LoRA adapter (an
    adapter's K/V differ from the base model's for the same tokens)."""
    lora = params.lora_request
    if lora is None:
        return params.cache_salt
    return lora.cache_key if params.cache_salt is None else f"{lora.cache_key}|{params.cache_salt}"


def _arrival(req: Request) -> tuple:
    return req.arrival_order


def _priority_then_arrival(req: Request) -> tuple:
    return req.sampling_params.priority, req.arrival_order


def _new_request(req: Request) -> NewRequest:
    """The worker's view of a request it does not hold a table for. A penalized request that starts from cached
    blocks also gets the tokens in them: its penalties count them, and its chunks will not bring them."""
    computed = (req.all_token_ids[:req.num_computed_tokens] if req.num_computed_tokens
                and req.sampling_params.penalized else None)
    return NewRequest(req.req_id, req.sampling_params, list(req.block_ids), req.num_prompt_tokens,
                      req.min_tokens_banned(), computed, req.multimodal)


def _drop_drafts(req: Request) -> None:
    req.draft_token_ids, req.draft_parents, req.want_node_tokens, req.drafts_from_worker = [], None, False, False
