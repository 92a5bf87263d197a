"""``async_scheduling`` (vLLM's name): each step's outputs are built (detokenized, stop strings looked for, reported)
while the executor computes the next step, and come back from the next ``step()`` call. Outputs stay what they are
without it, token for token and character for character, for every drafter kind, stop strings (found one step late:
that step's tokens for the request are dropped), seeded sampling, per-request failures and a dead worker; the report
really runs while the step runs (the worker's step waits for it)."""

from __future__ import annotations

import threading

import pytest

from specray import LLM, SamplingParams
from specray.config import EngineArgs
from specray.engine.step_future import start_step
from specray.errors import WorkerDiedError
from specray_test_engine_runs import LOOKAHEAD, PROMPTS, greedy, token_ids  # tests/engine_runs.py

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
SPECS = {
    "plain": None,
    "ngram": NGRAM,
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},  # token trees
    "lookahead": LOOKAHEAD,  # trees, and node tokens the drafter learns from
    "draft_model": "draft_model",
}


def make(tiny_llama_dir, tiny_draft_dir, spec, **kw) -> LLM:
    if spec == "draft_model":  # a fixed draft count: seeded sampling over drafts with q follows it, and the
        # adaptive policy's choice follows timings
        spec = {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 3, "adaptive": False}
    return LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec, **kw)


def free_blocks(llm) -> int:
    return llm.engine.scheduler.block_manager.num_free_blocks


def completions(outs) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in (o.outputs[0] for o in outs)]


@pytest.mark.parametrize("name", list(SPECS))
def test_outputs_equal_those_without_it(tiny_llama_dir, tiny_draft_dir, plain_outputs, name):
    """Greedy at batch 8 and 1 equals plain greedy; a batch with stop strings (found one step late), seeded
    sampling and logprobs equals the same engine's without async scheduling, and no block leaks."""
    sync = make(tiny_llama_dir, tiny_draft_dir, SPECS[name])
    full = sync.generate(PROMPTS, greedy(24), use_tqdm=False)
    stops = [o.outputs[0].text[5:8] for o in full]
    mixed = [greedy(24, stop=[s]) if s.strip() else greedy(24) for s in stops[:4]] + [
        SamplingParams(temperature=0.9, seed=i, max_tokens=20, logprobs=1) for i in range(4)]
    want = completions(sync.generate(PROMPTS, mixed, use_tqdm=False))
    assert sum(c[2] == "stop" for c in want) >= 2, want  # the stop strings are met
    sync.shutdown()
    llm = make(tiny_llama_dir, tiny_draft_dir, SPECS[name], async_scheduling=True)
    start = free_blocks(llm)
    assert token_ids(llm.generate(PROMPTS, greedy(24), use_tqdm=False)) == plain_outputs
    assert [o.outputs[0].token_ids for p in PROMPTS[:3] for o in llm.generate([p], greedy(24), use_tqdm=False)] == (
        plain_outputs[:3])
    assert completions(llm.generate(PROMPTS, mixed, use_tqdm=False)) == want
    if name != "plain":
        assert llm.spec_stats.drafts > 0
    assert free_blocks(llm) == start and not llm.engine.tracked and not llm.engine.has_unfinished_requests()


def test_prefix_caching_and_structured_outputs(tiny_llama_dir, tiny_draft_dir):
    """A stop string found one step late finishes a request whose blocks the prefix cache then keeps (the late
    step's K/V lies past them), a second pass takes them from the cache, and a grammar advances with each step's
    update as before: the same outputs as without async scheduling, twice over."""
    regex = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs={"regex": r"(ab|cd|the ){2,6}x"})
    runs = {}
    for on in (False, True):
        llm = make(tiny_llama_dir, tiny_draft_dir, NGRAM, async_scheduling=on, enable_prefix_caching=True,
                   block_size=4)
        start = free_blocks(llm)
        full = llm.generate(PROMPTS, greedy(24), use_tqdm=False)
        stops = [o.outputs[0].text[5:8] for o in full[:6]]
        params = [greedy(24, stop=[s]) if s.strip() else greedy(24) for s in stops] + [regex, regex]
        first = llm.generate(PROMPTS, params, use_tqdm=False)
        again = llm.generate(PROMPTS, params, use_tqdm=False)
        assert sum(o.num_cached_tokens for o in again) > 0 and free_blocks(llm) == start
        runs[on] = completions(full) + completions(first) + completions(again)
        llm.shutdown()
    assert runs[True] == runs[False] and sum(c[2] == "stop" for c in runs[True]) >= 4


def test_a_stop_string_in_the_step_that_reaches_max_tokens(tiny_llama_dir, plain):
    """A request reaches max_tokens in the step whose token completes its stop string: it is reported (and the stop
    string found) after the next step was scheduled, and still finishes on the stop string, as without async
    scheduling."""
    cases = []
    for prompt in PROMPTS[:4]:
        text = plain.generate(prompt, greedy(24), use_tqdm=False)[0].outputs[0].text
        stop = text[4:6]
        if not stop.strip():
            continue
        # the fewest tokens whose text holds the stop string: max_tokens ends the request in that step
        need = next(m for m in range(1, 25)
                    if stop in plain.generate(prompt, greedy(m), use_tqdm=False)[0].outputs[0].text)
        cases.append((prompt, greedy(need, stop=[stop]), stop, text[: text.index(stop)]))
    assert len(cases) >= 2, cases
    for on in (False, True):
        llm = LLM(model=str(tiny_llama_dir), max_model_len=256, async_scheduling=on)
        outs = llm.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
        assert [(o.outputs[0].finish_reason, o.outputs[0].stop_reason, o.outputs[0].text) for o in outs] == [
            ("stop", stop, text) for _, _, stop, text in cases], on
        assert not llm.engine.tracked and not llm.engine.scheduler.has_unfinished_requests()


@pytest.mark.parametrize("kind", ["delta", "cumulative"])
def test_streamed_reports_equal_those_without_it_one_step_later(tiny_llama_dir, plain, kind):
    """Reported every step (the server's engines report deltas): the same reports in the same order, each one
    step later; the stop string's request reports exactly what it reports without async scheduling."""
    full = plain.generate(PROMPTS[1], greedy(24), use_tqdm=False)[0].outputs[0]
    stop = full.text[6:10]
    runs = {}
    for on in (False, True):
        llm = LLM(model=str(tiny_llama_dir), max_model_len=256, async_scheduling=on,
                  speculative_config={**NGRAM, "adaptive": False})  # the same drafts in both: K not fitted to timings
        engine, tok = llm.engine, llm.get_tokenizer()
        order = {}
        for i, params in enumerate([greedy(24), greedy(24, stop=[stop]), greedy(5)]):
            params.output_kind = kind
            order[engine.add_request(tok.encode(PROMPTS[1 if i == 1 else i]), params)] = i
        reports, steps = {i: [] for i in order.values()}, []
        while engine.has_unfinished_requests():
            outs = engine.step()
            steps.append(sorted(order[o.request_id] for o in outs))
            for o in outs:
                c = o.outputs[0]
                reports[order[o.request_id]].append((c.token_ids, c.text, c.finish_reason, c.stop_reason, o.finished))
        runs[on] = reports, steps
    (want, want_steps), (got, got_steps) = runs[False], runs[True]
    assert got == want
    assert got_steps[0] == [] and got_steps[1:] == want_steps  # one step later, every report
    assert want[1][-1][2:4] == ("stop", stop)


class _Overlap:
    """Makes the worker's step wait until the engine reports the last step's outputs: a step that finishes at all
    (within the timeout) has run beside the report. Counts the steps that did."""

    def __init__(self, engine):
        self.engine, self.reported, self.beside, self.steps = engine, threading.Event(), 0, 0
        inner_report, inner_execute = engine._report, engine.executor.worker.execute

        def report(touched):
            self.reported.set()
            return inner_report(touched)

        def execute(plan, draft_probs=None):
            self.steps += 1
            self.beside += self.reported.wait(timeout=5)
            self.reported.clear()
            return inner_execute(plan, draft_probs)

        engine._report, engine.executor.worker.execute = report, execute


def test_the_report_runs_while_the_step_computes(tiny_llama_dir, plain_outputs):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM, async_scheduling=True)
    probe = _Overlap(llm.engine)
    assert token_ids(llm.generate(PROMPTS, greedy(24), use_tqdm=False)) == plain_outputs
    assert probe.steps > 10 and probe.beside == probe.steps  # every step computed while the last one was reported
    assert threading.current_thread() is threading.main_thread()


class _FailingFuture:
    def __init__(self, err):
        self.err = err

    def result(self):
        raise self.err


class _DiesOnce:
    """The real executor, asynchronous, until the given step: that step's rank dies (``WorkerDiedError``)."""

    def __init__(self, inner, die_at: int):
        self.inner, self.die_at, self.calls = inner, die_at, 0

    def execute_async(self, plan, draft_probs=None):
        self.calls += 1
        if self.calls == self.die_at:
            return _FailingFuture(WorkerDiedError("target rank 0 died (injected)"))
        return self.inner.execute_async(plan, draft_probs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_dead_worker_loses_no_report(tiny_llama_dir, plain_outputs):
    """The step that dies had the last step's outputs built already: a request that finished in that last step is
    still reported (by the next step), the running ones fail, and the engine serves on."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, async_scheduling=True)
    engine, tok = llm.engine, llm.get_tokenizer()
    short = engine.add_request(tok.encode(PROMPTS[0]), greedy(3))
    long = engine.add_request(tok.encode(PROMPTS[1]), greedy(24))
    engine.executor = _DiesOnce(engine.executor, die_at=4)  # steps 1-3 bring `short` to 3 tokens: it finishes
    finished = {}
    with pytest.raises(WorkerDiedError) as info:
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert info.value.req_ids == [long] and short not in finished
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished[short].outputs[0].token_ids == plain_outputs[0][:3]
    assert not engine.tracked
    assert token_ids(llm.generate(PROMPTS[:2], greedy(), use_tqdm=False)) == plain_outputs[:2]


class _Poisoned:
    """Every step holding the poisoned request raises from its third on, started (``execute_async``: its result
    never comes) or run again alone (``execute``)."""

    def __init__(self, inner, poisoned: str):
        self.inner, self.poisoned, self.seen = inner, poisoned, 0

    def execute(self, plan, draft_probs=None):
        return self.execute_async(plan, draft_probs).result()

    def execute_async(self, plan, draft_probs=None):
        if any(c.req_id == self.poisoned for c in plan.chunks):
            self.seen += 1
            if self.seen >= 3:
                return _FailingFuture(RuntimeError("injected fault"))
        return self.inner.execute_async(plan, draft_probs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_step_failing_for_one_request_fails_only_that_one(tiny_llama_dir, plain_outputs):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM, async_scheduling=True)
    engine, tok = llm.engine, llm.get_tokenizer()
    start = free_blocks(llm)
    ids = [engine.add_request(tok.encode(p), greedy()) for p in PROMPTS]
    engine.executor = _Poisoned(engine.executor, ids[3])
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    bad = done.pop(ids[3])
    assert bad.outputs[0].finish_reason == "error" and "injected fault" in bad.error
    assert [done[i].outputs[0].token_ids for i in ids if i != ids[3]] == plain_outputs[:3] + plain_outputs[4:]
    assert free_blocks(llm) == start and not engine.tracked


def test_an_executor_without_execute_async_runs_each_step_at_once():
    class Sync:
        def __init__(self):
            self.ran = []

        def execute(self, plan, draft_probs=None):
            self.ran.append(plan)
            if plan == "bad":
                raise ValueError("bad plan")
            return "result"

    ex = Sync()
    done = start_step(ex, "plan", None)
    assert ex.ran == ["plan"] and done.result() == "result"
    failed = start_step(ex, "bad", None)  # the error comes from result(), where a step's errors are expected
    with pytest.raises(ValueError, match="bad plan"):
        failed.result()


def test_the_flag_is_checked_and_reaches_the_engine(tiny_llama_dir):
    pytest.importorskip("ray")  # the server's modules import Ray and FastAPI (a GPU image may lack them)
    from specray.cluster.cli import build_parser, engine_kwargs, serve_app_args
    from specray.cluster.serve import ServeArgs

    with pytest.raises(ValueError, match="async_scheduling='yes' must be true or false"):
        EngineArgs(model=str(tiny_llama_dir), async_scheduling="yes")
    for flags, want in (([], None), (["--async-scheduling"], True)):
        gen = build_parser().parse_args(["generate", "--model", str(tiny_llama_dir), "--prompt", "x", *flags])
        assert engine_kwargs(gen).get("async_scheduling") is want
        serve = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), *flags])
        assert ServeArgs.from_dict(serve_app_args(serve)).engine_args().async_scheduling is bool(want)


def test_concurrent_streams_through_the_async_engine(tiny_llama_dir, plain_outputs):
    """The server's path: callers stream deltas from an AsyncLLMEngine whose engine schedules asynchronously; each
    stream's joined deltas are the plain greedy output, and one caller leaving mid-stream frees its blocks."""
    import asyncio

    from specray.engine.async_engine import AsyncLLMEngine

    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM, async_scheduling=True)
    tok, start = llm.get_tokenizer(), free_blocks(llm)
    aeng = AsyncLLMEngine(llm.engine)

    async def stream(prompt, leave_after=None):
        params = greedy(24)
        params.output_kind = "delta"
        tokens = []
        async for out in aeng.generate(tok.encode(prompt), params):
            tokens += out.outputs[0].token_ids
            if leave_after is not None and len(tokens) >= leave_after:
                break
        return tokens

    async def main():
        return await asyncio.gather(*(stream(p) for p in PROMPTS[:4]), stream(PROMPTS[4], leave_after=3))

    try:
        got = asyncio.run(main())
        assert got[:4] == plain_outputs[:4] and got[4] == plain_outputs[4][:len(got[4])]
        deadline = 50
        while (llm.engine.tracked or free_blocks(llm) != start) and deadline:  # the abort runs between steps
            threading.Event().wait(0.1)
            deadline -= 1
        assert free_blocks(llm) == start and not llm.engine.tracked
    finally:
        aeng.shutdown()
