"""The scheduler on CPU with hand-written worker results (no model): accept lengths and counters, rewind,
chunked prefill, continuous batching, preemption by recompute, stop conditions, draft trimming, block-table
deltas replayed by a fake worker over randomized runs, and bad input."""

import random

import pytest

from specray.contract import StepPlan, StepResult
from specray.sampling_params import SamplingParams
from specray.scheduler.request import Request, RequestStatus
from specray.scheduler.scheduler import Scheduler, SchedulerConfig

EOS = 1


def make_sched(num_blocks=64, block_size=4, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(block_size=block_size, num_blocks=num_blocks, **kw))


def truth(req_id: str, pos: int) -> int:
    """The token at position ``pos`` of request ``req_id``'s one true sequence (prompt, then output); never EOS."""
    seed = sum(map(ord, req_id))
    return 3 + (seed * 31 + pos * 17 + (pos * pos) % 7) % 90


def make_req(req_id, prompt_len, max_tokens=16, arrival=None, **kw) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    prompt = [truth(req_id, p) for p in range(prompt_len)]
    return Request(req_id, prompt, params, {EOS}, arrival)


def answer(plan: StepPlan, answers: dict | None = None) -> StepResult:
    """Per sampled chunk the given tokens, else no draft accepted and the true next token."""
    out = []
    for c in plan.chunks:
        if not c.sample:
            out.append([])
        elif answers and c.req_id in answers:
            out.append(answers[c.req_id])
        else:
            out.append([truth(c.req_id, c.start_pos + c.num_tokens - c.num_draft_tokens)])
    return StepResult(plan.step_id, [c.req_id for c in plan.chunks], out)


def step(sched: Scheduler, answers: dict | None = None):
    plan = sched.schedule()
    return plan, sched.update_from_output(plan, answer(plan, answers))


class FakeWorker:
    """Replays plans like a model runner over a simulated paged KV cache: applies finished ids, new requests and
    block-table deltas; checks each chunk feeds the right tokens and reads only KV this incarnation of the request
    wrote; and accepts the drafts that match the request's true sequence, plus the true next token."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.cache = [None] * (num_blocks * block_size)
        self.tables: dict[str, list[int]] = {}
        self.incarnation: dict[str, int] = {}
        self.known: set[str] = set()  # requests whose (sampling) state the worker holds

    def apply(self, plan: StepPlan) -> None:
        for rid in plan.finished_req_ids:
            self.tables.pop(rid, None)  # a preempted request may finish (abort) while it waits
            self.known.discard(rid)
        for rid in plan.preempted_req_ids:
            del self.tables[rid]
            assert rid in self.known
        for new in plan.new_requests:
            assert new.req_id not in self.tables
            self.known.add(new.req_id)
            self.tables[new.req_id] = list(new.block_ids)
            self.incarnation[new.req_id] = self.incarnation.get(new.req_id, 0) + 1
        for delta in plan.block_deltas:
            table = self.tables[delta.req_id]
            assert delta.num_kept_blocks <= len(table)
            self.tables[delta.req_id] = table[: delta.num_kept_blocks] + delta.new_block_ids

    def run(self, plan: StepPlan) -> StepResult:
        out = [self._chunk(c) for c in plan.chunks]
        return StepResult(plan.step_id, [c.req_id for c in plan.chunks], out)

    def _slot(self, rid: str, pos: int) -> int:
        table = self.tables[rid]
        assert pos // self.block_size < len(table), f"{rid}: no block for position {pos}"
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _chunk(self, c) -> list[int]:
        rid, tag = c.req_id, (c.req_id, self.incarnation[c.req_id])
        for p in range(c.start_pos):
            assert self.cache[self._slot(rid, p)] == (tag, truth(rid, p)), f"{rid}: bad KV at position {p}"
        n = c.num_tokens - c.num_draft_tokens
        assert c.token_ids[:n] == [truth(rid, c.start_pos + j) for j in range(n)]
        for j, token in enumerate(c.token_ids):
            self.cache[self._slot(rid, c.start_pos + j)] = (tag, token)
        if not c.sample:
            return []
        pos, kept = c.start_pos + n, []
        for d in c.token_ids[n:]:
            if d != truth(rid, pos):
                break
            kept.append(d)
            pos += 1
        return kept + [truth(rid, pos)]


def worker_step(sched: Scheduler, worker: FakeWorker):
    plan = sched.schedule()
    worker.apply(plan)
    assert worker.tables == {r.req_id: r.block_ids for r in sched.running}
    return plan, sched.update_from_output(plan, worker.run(plan))


def run_to_end(sched: Scheduler, worker: FakeWorker, max_steps=500) -> dict[str, Request]:
    done = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        _, touched = worker_step(sched, worker)
        done.update({r.req_id: r for r in touched if r.is_finished})
    worker.apply(sched.schedule())  # the last finished ids
    assert not worker.tables and not sched.has_unfinished_requests()
    return done


# ---- accept lengths, counters, rewind ------------------------------------------------------------------
def test_accept_lengths_and_counters():
    sched = make_sched(block_size=4)
    r = make_req("a", 6, max_tokens=20)
    sched.add_request(r)
    plan, touched = step(sched, {"a": [50]})
    (chunk,) = plan.chunks
    assert (chunk.token_ids, chunk.start_pos, chunk.num_draft_tokens, chunk.sample) == (r.prompt_token_ids, 0, 0, True)
    assert [n.req_id for n in plan.new_requests] == ["a"] and plan.new_requests[0].block_ids == [0, 1]
    assert touched == [r] and r.output_token_ids == [50] and r.num_computed_tokens == 6

    sched.update_draft_token_ids({r.req_id: [51, 52, 53]})
    plan, touched = step(sched, {"a": [51, 52, 60]})
    (chunk,) = plan.chunks
    assert (chunk.token_ids, chunk.start_pos, chunk.num_draft_tokens) == ([50, 51, 52, 53], 6, 3)
    assert r.output_token_ids == [50, 51, 52, 60] and r.all_token_ids[-4:] == [50, 51, 52, 60]
    assert (r.num_computed_tokens, r.num_tokens, r.num_output_tokens) == (9, 10, 4)
    own = r.spec_stats
    assert (own.drafts, own.draft_tokens, own.accepted_tokens) == (1, 3, 2)
    assert own.accepted_per_position == [1, 1, 0] and r.draft_token_ids == []
    stats = sched.last_step_stats
    assert (stats.drafts, stats.draft_tokens, stats.accepted_tokens, stats.accepted_per_position) == (1, 3, 2, [1, 1, 0])

    sched.update_draft_token_ids({r.req_id: [61, 62]})
    step(sched, {"a": [61, 70]})
    assert (own.drafts, own.draft_tokens, own.accepted_tokens, own.accepted_per_position) == (2, 5, 3, [2, 1, 0])
    step(sched)  # no drafts: not a "draft"
    assert own.drafts == 2 and sched.last_step_stats.drafts == 0


def test_drafts_come_in_only_for_running_requests():
    sched = make_sched()
    r, w = make_req("a", 3), make_req("w", 3)
    sched.add_request(r)
    step(sched)
    sched.add_request(w)  # waiting: drafts for it (or for an unknown id) are ignored
    sched.update_draft_token_ids({"a": [5, 6], "w": [7], "gone": [8]})
    assert r.draft_token_ids == [5, 6] and w.draft_token_ids == []
    plan, _ = step(sched)
    assert [c.num_draft_tokens for c in plan.chunks] == [2, 0]


def test_rewind_frees_exactly_the_blocks_without_accepted_tokens():
    sched = make_sched(num_blocks=16, block_size=4)
    bm = sched.block_manager
    r = make_req("a", 7, max_tokens=50)
    sched.add_request(r)
    step(sched)  # prefill 7 slots: blocks 0, 1; token at position 7 not in KV
    assert r.block_ids == [0, 1] and r.num_computed_tokens == 7

    sched.update_draft_token_ids({r.req_id: [90, 91, 92, 93, 94]})  # slots 7..12 -> 4 blocks
    plan = sched.schedule()
    assert r.block_ids == [0, 1, 2, 3] and bm.num_free_blocks == 12
    assert [(d.num_kept_blocks, d.new_block_ids) for d in plan.block_deltas] == [(2, [2, 3])]
    sched.update_from_output(plan, answer(plan))  # all rejected: KV valid for slots < 8
    assert r.num_computed_tokens == 8 and r.block_ids == [0, 1] and bm.num_free_blocks == 14

    # 4 right (slots 9..12), 1 wrong (slot 13)
    sched.update_draft_token_ids({r.req_id: [truth("a", p) for p in range(9, 13)] + [0]})
    plan = sched.schedule()  # the freed blocks 2, 3 are the table's contiguous extension again
    assert [(d.num_kept_blocks, d.new_block_ids) for d in plan.block_deltas] == [(2, [2, 3])]
    sched.update_from_output(plan, answer(plan, {"a": r.draft_token_ids[:4] + [truth("a", 13)]}))
    assert r.num_computed_tokens == 13 and r.block_ids == [0, 1, 2, 3]  # slot 12 holds an accepted draft
    assert r.spec_stats.accepted_per_position == [1, 1, 1, 1, 0]

    sched.update_draft_token_ids({r.req_id: [0, 0, 0]})  # slots 13..16 -> a fifth block, then rejected
    plan, _ = step(sched)
    assert r.num_computed_tokens == 14 and r.block_ids == [0, 1, 2, 3]
    plan = sched.schedule()  # no new block needed for slot 14, but the worker's table shrank
    assert [(d.num_kept_blocks, d.new_block_ids) for d in plan.block_deltas] == [(4, [])]
    sched.update_from_output(plan, answer(plan))
    sched.abort_requests(["a"])
    assert bm.num_free_blocks == 16


# ---- chunked prefill, continuous batching ---------------------------------------------------------------
def test_chunked_prefill_over_several_steps():
    sched = make_sched(block_size=4, max_num_batched_tokens=4)
    r = make_req("a", 10)
    sched.add_request(r)
    seen = []
    for i in range(4):
        # ignored: that chunk does not reach the end of the prompt
        sched.update_draft_token_ids({r.req_id: [0, 0] if i == 1 else []})
        plan, touched = step(sched)
        c = plan.chunks[0]
        seen.append((c.start_pos, c.num_tokens, c.sample, len(plan.new_requests), len(plan.block_deltas)))
        assert c.token_ids == r.all_token_ids[c.start_pos:c.start_pos + c.num_tokens]
    assert seen == [(0, 4, False, 1, 0), (4, 4, False, 0, 1), (8, 2, True, 0, 1), (10, 1, True, 0, 0)]
    assert r.num_output_tokens == 2 and r.num_computed_tokens == 11


def test_running_prefill_has_priority_and_waiting_gets_the_rest():
    sched = make_sched(block_size=4, max_num_batched_tokens=6)
    a, b = make_req("a", 9, arrival=0.0), make_req("b", 5, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    plan, _ = step(sched)
    assert [(c.req_id, c.num_tokens, c.sample) for c in plan.chunks] == [("a", 6, False)]
    plan, _ = step(sched)
    assert [(c.req_id, c.num_tokens, c.sample) for c in plan.chunks] == [("a", 3, True), ("b", 3, False)]


def test_long_prefill_token_threshold_lets_a_later_request_start_beside_a_long_prompt():
    def first_steps(threshold):
        sched = make_sched(block_size=4, max_num_batched_tokens=8, long_prefill_token_threshold=threshold)
        sched.add_request(make_req("long", 20, arrival=0.0))
        step(sched)
        sched.add_request(make_req("short", 2, 3, arrival=1.0))
        return [[(c.req_id, c.num_tokens, c.sample) for c in step(sched)[0].chunks] for _ in range(3)]

    # no bound: the short request waits while the long prompt takes the whole budget
    assert first_steps(0) == [[("long", 8, False)], [("long", 4, True), ("short", 2, True)],
                              [("long", 1, True), ("short", 1, True)]]
    # at most 5 prefill tokens of one request a step: the short one starts at once and decodes beside it
    assert first_steps(5) == [[("long", 5, False), ("short", 2, True)], [("long", 5, False), ("short", 1, True)],
                              [("long", 5, True), ("short", 1, True)]]


def test_continuous_batching_respects_max_num_seqs():
    sched = make_sched(max_num_seqs=2)
    a, b, c = make_req("a", 5, 2, arrival=0.0), make_req("b", 6, 5, arrival=1.0), make_req("c", 4, 3, arrival=2.0)
    for r in (a, b, c):
        sched.add_request(r)
    plan, _ = step(sched)
    assert [ch.req_id for ch in plan.chunks] == ["a", "b"] and sched.num_waiting == 1 and sched.num_running == 2
    plan, touched = step(sched)
    assert a.finish_reason == "length" and a in touched and sched.num_running == 1
    assert sched.block_manager.num_free_blocks == 64 - len(b.block_ids)
    plan, _ = step(sched)  # c joins while b decodes
    assert [(ch.req_id, ch.start_pos, ch.num_tokens) for ch in plan.chunks] == [("b", 7, 1), ("c", 0, 4)]
    assert plan.finished_req_ids == ["a"] and [n.req_id for n in plan.new_requests] == ["c"]
    while sched.has_unfinished_requests():
        plan, _ = step(sched)
        assert len(plan.chunks) <= 2
    assert (b.num_output_tokens, c.num_output_tokens) == (5, 3)
    assert sched.block_manager.num_free_blocks == 64


# ---- preemption --------------------------------------------------------------------------------------
def two_requests_in_five_blocks():
    """a and b (newer) have prefilled 2 blocks of 4 each; 1 block is free, so a's next block preempts b."""
    sched = make_sched(num_blocks=5, block_size=4)
    worker = FakeWorker(5, 4)
    a, b = make_req("a", 8, 6, arrival=0.0), make_req("b", 8, 4, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    worker_step(sched, worker)
    return sched, worker, a, b


def test_preemption_by_recompute():
    sched, worker, a, b = two_requests_in_five_blocks()
    b_out = list(b.output_token_ids)
    plan, touched = worker_step(sched, worker)  # a takes the last block; b (newest) must preempt itself
    assert [c.req_id for c in plan.chunks] == ["a"] and plan.preempted_req_ids == ["b"]
    assert not plan.finished_req_ids  # the worker keeps b's sampling state
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert list(sched.waiting) == [b] and b.num_preemptions == 1 and sched.num_preemptions == 1
    assert b.output_token_ids == b_out and touched == [a]
    resumed = None
    while resumed is None:
        plan, _ = worker_step(sched, worker)
        resumed = next((c for c in plan.chunks if c.req_id == "b"), None)
    assert "b" in [n.req_id for n in plan.new_requests]
    assert resumed.start_pos == 0 and resumed.token_ids == b.prompt_token_ids + b_out and resumed.sample
    run_to_end(sched, worker)
    assert a.output_token_ids == [truth("a", 8 + i) for i in range(6)]
    assert b.output_token_ids == [truth("b", 8 + i) for i in range(4)] and b.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == 5


def test_a_preempted_request_aborted_while_waiting_is_dropped_by_the_worker():
    sched, worker, _, _ = two_requests_in_five_blocks()
    plan, _ = worker_step(sched, worker)
    assert plan.preempted_req_ids == ["b"] and "b" in worker.known
    sched.abort_requests("b")
    plan, _ = worker_step(sched, worker)
    assert plan.finished_req_ids == ["b"] and "b" not in worker.known
    run_to_end(sched, worker)
    assert not worker.known and sched.block_manager.num_free_blocks == 5


def test_preemption_takes_the_newest_running_request_first():
    sched = make_sched(num_blocks=6, block_size=4)
    reqs = [make_req(name, 8, 30, arrival=t) for name, t in (("old", 0.0), ("new", 2.0), ("mid", 1.0))]
    for r in reqs:
        sched.add_request(r)
    step(sched)  # 3 x 2 blocks, 0 free
    plan, _ = step(sched)  # "old" needs a block: "new" (arrived last) goes, then "mid" gets the freed blocks
    assert plan.preempted_req_ids == ["new"] and [c.req_id for c in plan.chunks] == ["old", "mid"]
    assert list(sched.waiting) == [reqs[1]] and not plan.new_requests  # no readmission in a preempting step


def test_priority_scheduling_admits_serves_and_preempts_by_priority():
    """scheduling_policy="priority" (vLLM's): waiting requests are admitted lowest priority value first (ties by
    arrival), running ones get blocks in that order and the last of them gives its blocks back first, even when it
    is the oldest; outputs are still each request's own."""
    sched = make_sched(num_blocks=64, block_size=4, max_num_seqs=2, scheduling_policy="priority")
    for name, t, prio in (("low", 0.0, 5), ("mid", 1.0, 0), ("high", 2.0, -1), ("mid2", 3.0, 0)):
        sched.add_request(make_req(name, 4, 3, arrival=t, priority=prio))
    plan, _ = step(sched)
    assert [c.req_id for c in plan.chunks] == ["high", "mid"]
    order = []
    while sched.has_unfinished_requests():
        plan, _ = step(sched)
        order += [n.req_id for n in plan.new_requests]
    assert order == ["mid2", "low"]

    sched = make_sched(num_blocks=6, block_size=4, scheduling_policy="priority")
    worker = FakeWorker(6, 4)
    reqs = [make_req(name, 8, 12, arrival=t, priority=prio)
            for name, t, prio in (("old", 0.0, 1), ("new", 2.0, 0), ("mid", 1.0, 0))]
    for r in reqs:
        sched.add_request(r)
    worker_step(sched, worker)  # 3 x 2 blocks, 0 free
    plan, _ = worker_step(sched, worker)  # "mid" needs a block: "old" (priority 1, oldest) goes
    assert plan.preempted_req_ids == ["old"] and [c.req_id for c in plan.chunks] == ["mid", "new"]
    done = run_to_end(sched, worker)
    assert len(done) == 3 and reqs[0].num_preemptions >= 1
    assert all(r.output_token_ids == [truth(r.req_id, 8 + i) for i in range(12)] for r in done.values())


def test_first_come_first_served_refuses_a_priority():
    sched = make_sched()
    with pytest.raises(ValueError, match="priority=3 needs an engine with scheduling_policy='priority'"):
        sched.add_request(make_req("a", 3, priority=3))
    assert not sched.requests
    sched.add_request(make_req("b", 3, priority=0))
    with pytest.raises(ValueError, match="scheduling_policy='lifo' must be one of"):
        make_sched(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="priority='1' must be an int"):
        SamplingParams(priority="1")


def test_drafts_never_preempt():
    sched = make_sched(num_blocks=5, block_size=4)
    a, b = make_req("a", 7, 30, arrival=0.0), make_req("b", 8, 30, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a: 2 blocks, b: 2 blocks, 1 free
    sched.update_draft_token_ids({a.req_id: [0] * 8})
    plan = sched.schedule()  # a's slot 7 fits its block; b needs the free block for slot 8; drafts get none
    assert [(c.req_id, c.num_draft_tokens) for c in plan.chunks] == [("a", 0), ("b", 0)]
    assert sched.num_preemptions == 0 and sched.block_manager.num_free_blocks == 0
    sched.update_from_output(plan, answer(plan))
    sched.abort_requests(["a", "b"])
    assert sched.block_manager.num_free_blocks == 5


# ---- stop conditions ---------------------------------------------------------------------------------
def prefilled(sched, name, prompt_len=6, **kw) -> Request:
    r = make_req(name, prompt_len, **kw)
    sched.add_request(r)
    step(sched, {name: [40]})
    return r


def test_eos_mid_accepted_run_drops_the_rest_and_frees_blocks():
    sched = make_sched()
    r = prefilled(sched, "a", max_tokens=20)
    sched.update_draft_token_ids({r.req_id: [5, EOS, 7]})
    _, touched = step(sched, {"a": [5, EOS, 7, 8]})
    assert r.output_token_ids == [40, 5, EOS] and r.finish_reason == "stop" and r.stop_reason is None
    assert touched == [r] and r.block_ids == [] and sched.block_manager.num_free_blocks == 64
    assert r.spec_stats.accepted_tokens == 3  # the verifier's verdict, before the stop cut
    assert sched.schedule().finished_req_ids == ["a"] and sched.get_request("a") is None


def test_ignore_eos_keeps_going():
    sched = make_sched()
    r = prefilled(sched, "a", max_tokens=20, ignore_eos=True)
    sched.update_draft_token_ids({r.req_id: [5, EOS, 7]})
    step(sched, {"a": [5, EOS, 7, 8]})
    assert r.output_token_ids == [40, 5, EOS, 7, 8] and r.status is RequestStatus.RUNNING


def test_stop_token_ids():
    sched = make_sched()
    r = prefilled(sched, "a", max_tokens=20, stop_token_ids=[7])
    sched.update_draft_token_ids({r.req_id: [5, 7, 9]})
    step(sched, {"a": [5, 7, 9, 2]})
    assert r.output_token_ids == [40, 5, 7] and r.finish_reason == "stop" and r.stop_reason == 7


def test_max_tokens_trims_drafts_and_ends_on_length():
    sched = make_sched()
    r = prefilled(sched, "a", max_tokens=4)
    sched.update_draft_token_ids({r.req_id: [5, 6, 7, 8, 9]})
    plan = sched.schedule()
    assert plan.chunks[0].num_draft_tokens == 2  # 3 tokens left: at most 2 drafts + the target's own
    sched.update_from_output(plan, answer(plan, {"a": [5, 6, 10]}))
    assert r.output_token_ids == [40, 5, 6, 10] and r.finish_reason == "length" and r.stop_reason is None


def test_max_model_len_trims_drafts_and_ends_on_length():
    sched = make_sched(max_model_len=12)
    r = prefilled(sched, "a", prompt_len=8, max_tokens=None)
    sched.update_draft_token_ids({r.req_id: [5, 6, 7, 8, 9]})
    plan = sched.schedule()
    assert plan.chunks[0].num_draft_tokens == 2 and plan.chunks[0].start_pos + plan.chunks[0].num_tokens == 12 - 1
    sched.update_from_output(plan, answer(plan, {"a": [5, 6, 10]}))
    assert r.num_tokens == 12 and r.finish_reason == "length"


def test_draft_trimming_by_budget():
    sched = make_sched(max_num_batched_tokens=4)
    a, b = make_req("a", 3, 30, arrival=0.0), make_req("b", 1, 30, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    sched.update_draft_token_ids({"a": [0] * 5, "b": [0] * 5})
    plan = sched.schedule()  # 1 + 1 required tokens first, then a's drafts take the 2 left
    assert [(c.req_id, c.num_tokens, c.num_draft_tokens) for c in plan.chunks] == [("a", 3, 2), ("b", 1, 0)]
    sched.update_from_output(plan, answer(plan))
    assert a.draft_token_ids == [] and b.draft_token_ids == []


# ---- external finishes -------------------------------------------------------------------------------
def test_finish_request_on_a_stop_string_drops_trailing_tokens():
    sched = make_sched()
    r = prefilled(sched, "a", max_tokens=20)
    sched.update_draft_token_ids({r.req_id: [5, 6, 7]})
    step(sched, {"a": [5, 6, 7, 8]})
    sched.finish_request("a", 2, "xy")  # the engine's call: keep 2 output tokens, stop string "xy"
    assert r.output_token_ids == [40, 5] and r.all_token_ids == r.prompt_token_ids + [40, 5]
    assert (r.finish_reason, r.stop_reason, r.block_ids) == ("stop", "xy", [])
    assert sched.block_manager.num_free_blocks == 64 and not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == ["a"]


def test_finish_request_corrects_a_request_that_just_finished_on_length():
    sched = make_sched()
    r = prefilled(sched, "a", max_tokens=3)
    sched.update_draft_token_ids({r.req_id: [5, 6]})  # 2 tokens left: one draft is used
    _, touched = step(sched, {"a": [5, 7]})
    assert touched == [r] and r.finish_reason == "length"
    sched.finish_request("a", 2, "stop!")
    assert r.output_token_ids == [40, 5] and r.finish_reason == "stop" and r.stop_reason == "stop!"
    assert sched.block_manager.num_free_blocks == 64
    plan = sched.schedule()
    assert plan.finished_req_ids == ["a"]
    # async scheduling reports a step's requests after the next schedule: still accepted there
    sched.finish_request("a", 1, "later")
    assert r.output_token_ids == [40] and r.stop_reason == "later"
    sched.update_from_output(plan, answer(plan, {}))
    with pytest.raises(ValueError, match="req_id"):  # not after the next step's update
        sched.finish_request("a", 1, "too late")


def test_abort_running_and_waiting():
    sched = make_sched(max_num_seqs=1)
    a, b = make_req("a", 5, arrival=0.0), make_req("b", 5, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    sched.abort_requests(["a", "b", "unknown"])
    assert a.finish_reason == b.finish_reason == "abort"
    assert sched.block_manager.num_free_blocks == 64 and not sched.has_unfinished_requests()
    plan = sched.schedule()
    assert plan.finished_req_ids == ["a"] and plan.is_empty  # b never reached the worker


def test_request_beyond_the_kv_pool_finishes_on_length():
    sched = make_sched(num_blocks=2, block_size=4)  # 8 slots
    r = make_req("a", 6, max_tokens=10)
    sched.add_request(r)
    for _ in range(3):
        step(sched)
    assert r.num_tokens == 9 and r.status is RequestStatus.RUNNING
    plan, touched = step(sched)
    assert plan.is_empty and touched == [r] and r.finish_reason == "length" and r.num_output_tokens == 3
    assert sched.block_manager.num_free_blocks == 2


# ---- randomized: deltas, KV integrity, outputs ----------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_randomized_runs_replay_exactly_on_a_fake_worker(seed):
    rng = random.Random(seed)
    num_blocks, block_size, max_model_len = 20, 4, 48
    policy = "priority" if seed % 2 else "fcfs"  # odd seeds: random priorities reorder admission and preemption
    sched = make_sched(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                       max_num_seqs=4, max_num_batched_tokens=rng.choice([8, 16, 64]),
                       long_prefill_token_threshold=[0, 3, 0, 7, 0, 5][seed], scheduling_policy=policy)
    worker = FakeWorker(num_blocks, block_size)
    pending = [make_req(f"r{seed}-{i}", rng.randint(1, 30), rng.randint(1, 40), arrival=float(i),
                        priority=rng.randint(-2, 2) if policy == "priority" else 0) for i in range(14)]
    quality = {r.req_id: rng.random() for r in pending}
    done, aborted, cut = {}, set(), set()
    for _ in range(2000):
        if not pending and not sched.has_unfinished_requests():
            break
        if pending and rng.random() < 0.3:
            sched.add_request(pending.pop(0))
        for r in sched.running:
            if r.num_computed_tokens == r.num_tokens - 1:
                pos = r.num_tokens
                sched.update_draft_token_ids({r.req_id: [truth(r.req_id, pos + i) if rng.random() < quality[r.req_id]
                                                         else 0 for i in range(rng.randint(0, 5))]})
        if sched.requests and rng.random() < 0.01:
            victim = rng.choice(sorted(sched.requests))
            sched.abort_requests([victim])
            aborted.add(victim)
        plan, touched = worker_step(sched, worker)
        used = [b for r in sched.running for b in r.block_ids]
        assert len(used) == len(set(used)) and len(used) + sched.block_manager.num_free_blocks == num_blocks
        for r in touched:
            if not r.is_finished and r.num_output_tokens >= 2 and rng.random() < 0.03:
                sched.finish_request(r.req_id, r.num_output_tokens - 1, "<stop>")
                cut.add(r.req_id)
            if r.is_finished:
                done[r.req_id] = r
    worker.apply(sched.schedule())
    assert not worker.tables and sched.block_manager.num_free_blocks == num_blocks
    assert not pending and not sched.has_unfinished_requests()
    for rid, r in done.items():
        expected = [truth(rid, r.num_prompt_tokens + i) for i in range(r.num_output_tokens)]
        assert r.output_token_ids == expected
        limit = min(r.max_tokens, max_model_len - r.num_prompt_tokens)
        if rid in cut:
            assert r.finish_reason == "stop" and r.num_output_tokens < limit
        else:
            assert r.finish_reason == "length" and r.num_output_tokens == limit
    assert set(done) | aborted == {f"r{seed}-{i}" for i in range(14)}


def test_randomized_runs_do_preempt():
    """The randomized setting above really exercises preemption (else it proves less than it claims)."""
    sched = make_sched(num_blocks=20, block_size=4, max_model_len=48, max_num_seqs=4, max_num_batched_tokens=64)
    worker = FakeWorker(20, 4)
    for i in range(6):
        sched.add_request(make_req(f"p{i}", 20, 25, arrival=float(i)))
    done = run_to_end(sched, worker)
    assert sched.num_preemptions > 0 and len(done) == 6
    assert all(r.output_token_ids == [truth(r.req_id, 20 + i) for i in range(25)] for r in done.values())


# ---- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len, match", [(0, "prompt_token_ids is empty"), (32, "max_model_len=32"),
                                               (31, "num_blocks")])
def test_bad_requests_raise_and_leak_nothing(prompt_len, match):
    sched = make_sched(num_blocks=4, block_size=4, max_model_len=32)
    sched.add_request(make_req("ok", 3))
    with pytest.raises(ValueError, match=match):
        sched.add_request(make_req("bad", prompt_len))
    assert sched.num_waiting == 1 and sched.get_request("bad") is None
    step(sched)
    assert sched.num_running == 1 and sched.block_manager.num_free_blocks == 3


def test_duplicate_id_and_bad_finish_calls_raise():
    sched = make_sched()
    sched.add_request(make_req("a", 3))
    with pytest.raises(ValueError, match="req_id='a' is already in use"):
        sched.add_request(make_req("a", 3))
    step(sched)
    with pytest.raises(ValueError, match="reason="):
        sched.finish_request("a", 1, None, reason="done")
    with pytest.raises(ValueError, match="num_output_tokens=5"):
        sched.finish_request("a", 5, "x")
    with pytest.raises(ValueError, match="req_id='zz'"):
        sched.finish_request("zz")
    assert sched.get_request("a").status is RequestStatus.RUNNING


@pytest.mark.parametrize("kw, match", [({"num_blocks": 0}, "num_blocks=0"), ({"num_blocks": 4, "block_size": 0},
                                       "block_size=0"), ({"num_blocks": 4, "max_num_seqs": 0}, "max_num_seqs=0"),
                                       ({"num_blocks": 4, "max_model_len": 1}, "max_model_len=1"),
                                       ({"num_blocks": 4, "max_num_batched_tokens": -1}, "max_num_batched_tokens"),
                                       ({"num_blocks": 4, "long_prefill_token_threshold": -1},
                                        "long_prefill_token_threshold=-1")])
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kw)


# ---- a failed step ---------------------------------------------------------------------------------------------
class ResendingWorker(FakeWorker):
    """A FakeWorker that takes a NewRequest for a request whose table it holds as the real runner does: the table
    is replaced, the KV stays (a plan re-sent after a failure, not a readmission)."""

    def apply(self, plan: StepPlan) -> None:
        resent = {n.req_id: n for n in plan.new_requests if n.req_id in self.tables}
        for rid in resent:
            del self.tables[rid]
        super().apply(plan)
        for rid in resent:
            self.incarnation[rid] -= 1  # the same KV, not a new incarnation


@pytest.mark.parametrize("applied", ["none", "state", "all"])
def test_a_failed_plan_runs_again_whatever_part_the_worker_applied(applied):
    """The engine's retry after a failed step: the scheduler forgets what the worker holds and re-sends whole
    tables; the retried chunks and every later step replay exactly on the worker, whether it applied none of
    the failed plan, its state only, or all of it. The failed plan carries a table cut (r2's rejected drafts)
    for a request it does not schedule (r0's prefill takes the budget), so only forgetting reaches it."""
    sched, worker = make_sched(num_blocks=40, block_size=4, max_num_batched_tokens=8), ResendingWorker(40, 4)
    r1, r2 = make_req("r1", 5, max_tokens=12, arrival=1.0), make_req("r2", 5, max_tokens=12, arrival=2.0)
    sched.add_request(r1)
    sched.add_request(r2)
    while not all(r.num_computed_tokens == r.num_tokens - 1 for r in (r1, r2)):
        worker_step(sched, worker)
    sched.add_request(make_req("r0", 40, max_tokens=12, arrival=0.0))  # first in line once admitted
    sched.update_draft_token_ids({"r2": [0] * 5})  # all wrong: a block grown, then cut
    worker_step(sched, worker)
    plan = sched.schedule()
    assert [c.req_id for c in plan.chunks] == ["r0"] and "r2" in [d.req_id for d in plan.block_deltas]
    if applied != "none":
        worker.apply(plan)
    if applied == "all":
        worker.run(plan)  # KV written, tokens never counted
    sched.forget_worker_state(plan)
    sched.abort_requests(["r1"], reason="error")  # the request the step failed for
    retry = sched.retry_plan(plan, plan.chunks)
    worker.apply(retry)
    result = worker.run(retry)
    sched.update_from_output(plan, StepResult(plan.step_id, result.req_ids, result.sampled_token_ids))
    assert r1.finish_reason == "error"
    done = run_to_end(sched, worker)
    assert sorted(done) == ["r0", "r2"] and "r1" not in worker.tables
    assert all(r.output_token_ids == [truth(r.req_id, r.num_prompt_tokens + i) for i in range(12)]
               for r in done.values())
    assert sched.block_manager.num_free_blocks == 40


def test_a_step_holds_at_most_max_loras_adapters():
    """max_loras=1: of requests under adapters 1, 2, 1 and none, a step admits adapter 1's and the base model's; the
    adapter-2 request waits in its place (the ones behind it go ahead) until adapter 1 has no running request. An
    adapter on an engine without LoRA is refused."""
    from specray.lora import LoRARequest

    one, two = LoRARequest("one", 1, "/a"), LoRARequest("two", 2, "/b")
    sched = make_sched(max_loras=1)
    reqs = [make_req("a", 5, max_tokens=2, lora_request=one), make_req("b", 5, max_tokens=6, lora_request=two),
            make_req("c", 5, max_tokens=3, lora_request=one), make_req("d", 5, max_tokens=6)]
    for r in reqs:
        sched.add_request(r)
    seen = []
    while sched.has_unfinished_requests():
        plan, _ = step(sched)
        ids = {c.req_id for c in plan.chunks}
        adapters = {r.sampling_params.lora_request.lora_int_id for r in reqs
                    if r.req_id in ids and r.sampling_params.lora_request is not None}
        assert len(adapters) <= 1, (ids, adapters)
        seen.append(ids)
    assert seen[0] == {"a", "c", "d"}
    assert any("b" in ids for ids in seen) and all("b" not in ids for ids in seen[:3])
    with pytest.raises(ValueError, match="enable_lora"):
        make_sched().add_request(make_req("e", 5, lora_request=one))


def test_recurrent_snapshots_stop_prefills_at_a_boundary_and_restore_only_kept_states():
    """Prefix caching with kept recurrent states (a hybrid model's): a prompt's prefill stops once at its last whole
    block, whose chunk asks for the state there to be kept; a slot a chunk in flight writes is never given out; a
    later request extending the prompt starts behind those blocks only (not the prompt's later cached blocks), from
    that slot; an aborted request's slot is free again."""
    sched = make_sched(enable_prefix_caching=True, recurrent_snapshots=1, max_num_batched_tokens=64)
    first = make_req("a", 11, max_tokens=2)
    sched.add_request(first)
    sched.add_request(make_req("b", 10, max_tokens=2))
    plan = sched.schedule()
    assert [(c.req_id, c.start_pos, c.num_tokens, c.save_state, c.sample) for c in plan.chunks] == [
        ("a", 0, 8, 0, False), ("b", 0, 8, None, False)]  # the one slot is a's while its chunk is in flight
    while sched.requests:
        sched.update_from_output(plan, answer(plan))
        plan = sched.schedule()
    assert list(sched._snapshots.values()) == [0]
    follow = Request("c", first.all_token_ids[:12] + [5, 6], SamplingParams(temperature=0.0, max_tokens=1), {EOS})
    sched.add_request(follow)
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert (chunk.start_pos, chunk.restore_state) == (8, 0)  # behind a's first 8 tokens (a kept state), not 12
    sched.abort_requests("c")
    sched.add_request(make_req("d", 9, max_tokens=1))
    plan = sched.schedule()
    assert plan.chunks[0].save_state == 0  # the least recently used state forgotten for it
    sched.abort_requests("d")  # before its result: the slot is free again, the state never mapped
    assert sched._free_snapshots == [0] and not sched._snapshots
