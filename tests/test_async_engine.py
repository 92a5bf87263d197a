"""AsyncLLMEngine: many asyncio callers, one engine thread. Outputs equal the offline engine's; a caller that goes
away at any moment (before its add ran, mid-stream) leaves no request and no KV block behind."""

import asyncio
import contextlib
import threading

import pytest

from specray import LLM, SamplingParams
from specray.engine.async_engine import AsyncLLMEngine
from specray.errors import EngineError

PROMPT_IDS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18, 19, 20, 21], [22, 23]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), max_model_len=128,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def expected(llm):
    """The offline outputs of PROMPT_IDS, computed before any AsyncLLMEngine thread shares ``llm.engine`` (the
    engine is not thread-safe: that thread would step it too)."""
    return offline(llm, PROMPT_IDS)


@pytest.fixture
def aengine(llm):
    aeng = AsyncLLMEngine(llm.engine)
    yield aeng
    aeng.shutdown()


def free_blocks(engine) -> int:
    return engine.scheduler.block_manager.num_free_blocks


async def collect(aeng: AsyncLLMEngine, ids: list[int]) -> list[int]:
    last = None
    async for out in aeng.generate(ids, GREEDY):
        last = out
    assert last.finished
    return last.outputs[0].token_ids


def offline(llm, ids_list):
    outs = llm.generate([{"prompt_token_ids": ids} for ids in ids_list], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_concurrent_callers_match_offline(llm, expected, aengine):
    start = free_blocks(llm.engine)

    async def main():
        return await asyncio.gather(*(collect(aengine, ids) for ids in PROMPT_IDS))

    assert asyncio.run(main()) == expected
    assert free_blocks(llm.engine) == start


def test_leaving_early_aborts(llm, aengine):
    """Closing the stream (aclosing, or the generator's finalizer later) aborts the request at once."""
    start = free_blocks(llm.engine)

    async def main():
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        async with contextlib.aclosing(aengine.generate(PROMPT_IDS[2], params)) as stream:
            async for out in stream:
                if len(out.outputs[0].token_ids) >= 2:
                    break
        return await aengine.call(lambda e: (e.has_unfinished_requests(), free_blocks(e)))

    unfinished, free = asyncio.run(main())
    assert not unfinished and free == start


def test_cancelled_mid_stream_aborts(llm, aengine):
    """A client disconnect cancels the task that reads the stream."""
    start = free_blocks(llm.engine)

    async def main():
        got_one = asyncio.Event()

        async def reader():
            async for _ in aengine.generate(PROMPT_IDS[1], SamplingParams(max_tokens=100, ignore_eos=True)):
                got_one.set()

        task = asyncio.create_task(reader())
        await got_one.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await aengine.call(lambda e: (e.has_unfinished_requests(), free_blocks(e)))

    unfinished, free = asyncio.run(main())
    assert not unfinished and free == start


def test_cancel_before_the_add_runs(llm, aengine):
    """The caller is cancelled while its add still waits in the engine thread's queue: the add runs later, and
    the abort queued behind it removes the request."""
    start = free_blocks(llm.engine)
    gate = threading.Event()

    async def main():
        aengine.submit(lambda e: gate.wait(30))  # hold the engine thread
        task = asyncio.create_task(collect(aengine, PROMPT_IDS[0]))
        await asyncio.sleep(0.05)  # the add is queued behind the gate
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        return await aengine.call(lambda e: (e.has_unfinished_requests(), free_blocks(e)))

    unfinished, free = asyncio.run(main())
    assert not unfinished and free == start


def test_bad_request_does_not_disturb_others(llm, expected, aengine):

    async def bad():
        with pytest.raises(ValueError, match="max_tokens"):
            async for _ in aengine.generate([5, 6], SamplingParams(max_tokens=0)):
                pass

    async def main():
        results = await asyncio.gather(collect(aengine, PROMPT_IDS[0]), bad(), collect(aengine, PROMPT_IDS[1]))
        return [results[0], results[2]]

    assert asyncio.run(main()) == expected[:2]


def test_an_aborted_request_ends_its_stream(llm, aengine):
    """``abort(req_id)`` from another task: the request's reader gets its last output, finished with
    finish_reason "abort", and its blocks are free."""
    start = free_blocks(llm.engine)

    async def main():
        seen = []

        async def reader():
            async for out in aengine.generate(PROMPT_IDS[2], SamplingParams(max_tokens=100, ignore_eos=True),
                                              req_id="aborted"):
                seen.append(out)

        task = asyncio.create_task(reader())
        while not seen:
            await asyncio.sleep(0.01)
        await aengine.abort("aborted")
        await asyncio.wait_for(task, 10)
        return seen, await aengine.call(lambda e: (e.has_unfinished_requests(), free_blocks(e)))

    seen, (unfinished, free) = asyncio.run(main())
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert seen[-1].outputs[0].token_ids[:len(seen[0].outputs[0].token_ids)] == seen[0].outputs[0].token_ids
    assert not unfinished and free == start


def test_a_caller_whose_event_loop_closed_costs_only_its_request(llm, expected, aengine):
    """A caller's loop closes with its request in flight (nothing will read it): the engine thread aborts that
    request, frees its blocks and serves the next callers."""
    start = free_blocks(llm.engine)
    loop = asyncio.new_event_loop()
    stream = aengine.generate(PROMPT_IDS[1], SamplingParams(max_tokens=100, ignore_eos=True))
    loop.run_until_complete(stream.__anext__())
    loop.close()

    async def main():
        deadline = asyncio.get_running_loop().time() + 10
        while await aengine.call(lambda e: e.has_unfinished_requests()):
            assert asyncio.get_running_loop().time() < deadline, "the orphaned request still runs"
            await asyncio.sleep(0.02)
        return await collect(aengine, PROMPT_IDS[0]), await aengine.call(free_blocks)

    assert asyncio.run(main()) == (expected[0], start)
    assert aengine.is_running


@pytest.mark.parametrize("ids,params,match", [
    ("Hello", GREEDY, "prompt_token_ids is text"),
    ([5, 6, "7"], GREEDY, r"not token ids \(integers\)"),
    ([5, 6], {"max_tokens": 4}, "params must be a SamplingParams, got dict"),
    ([5, 6], None, "params must be a SamplingParams, got NoneType"),
])
def test_requests_of_the_wrong_types_are_clear_errors(aengine, ids, params, match):
    async def main():
        async for _ in aengine.generate(ids, params):
            pass

    with pytest.raises(ValueError, match=match):
        asyncio.run(main())


def test_after_shutdown_new_requests_fail_clearly(llm):
    aeng = AsyncLLMEngine(llm.engine)
    aeng.shutdown()
    assert not aeng.is_running

    async def main():
        async for _ in aeng.generate(PROMPT_IDS[0], GREEDY):
            pass

    with pytest.raises(EngineError, match="shut down"):
        asyncio.run(main())


def test_an_engine_that_was_shut_down_refuses_requests_clearly(tiny_llama_dir):
    """A new AsyncLLMEngine over an LLMEngine that was shut down: a clear error, not a failed step."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=64)
    llm.engine.shutdown()
    aeng = AsyncLLMEngine(llm.engine)

    async def main():
        async for _ in aeng.generate(PROMPT_IDS[0], GREEDY):
            pass

    try:
        with pytest.raises(EngineError, match="the engine is shut down"):
            asyncio.run(main())
    finally:
        aeng.shutdown()


def test_a_step_failing_for_one_caller_fails_only_that_caller(llm, expected, aengine):
    """The poisoned request's caller gets RequestFailedError; the other callers get their whole outputs."""
    from specray.errors import RequestFailedError

    engine, start = llm.engine, free_blocks(llm.engine)
    real = engine.executor

    class Faulty:  # runs every plan, then raises for one request's plans from its second one on
        seen = 0

        def execute(self, plan, draft_probs=None):
            result = real.execute(plan, draft_probs)
            if any(c.req_id == "poisoned" for c in plan.chunks):
                Faulty.seen += 1
                if Faulty.seen >= 2:
                    raise RuntimeError("injected fault")
            return result

    async def poisoned():
        with pytest.raises(RequestFailedError, match="injected fault"):
            async for _ in aengine.generate(PROMPT_IDS[0], GREEDY, req_id="poisoned"):
                pass
        return True

    async def main():
        return await asyncio.gather(poisoned(), *(collect(aengine, ids) for ids in PROMPT_IDS))

    engine.executor = Faulty()
    try:
        ok, *outs = asyncio.run(main())
    finally:
        engine.executor = real
    assert ok and outs == expected and Faulty.seen >= 2
    assert free_blocks(engine) == start and not engine.has_unfinished_requests()


def test_a_new_structured_spec_compiles_outside_the_engine_thread(llm, expected, aengine, monkeypatch):
    """A request's structured-outputs spec compiles in a worker thread of the caller's loop (a large schema would
    otherwise stall every stream's steps), once: the engine thread copies the compiled grammar. A bad spec raises
    ValueError before the first output and the others run on."""
    from specray import structured_outputs
    real = structured_outputs.grammar_text
    threads = []

    def compiling(params):  # every compilation starts from the spec's grammar text; a copy does not
        threads.append(threading.current_thread().name)
        return real(params)

    monkeypatch.setattr(structured_outputs, "grammar_text", compiling)
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}}, "required": ["a"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs={"json": schema,
                                                                                "disable_any_whitespace": True})

    async def constrained():
        last = None
        async for out in aengine.generate(PROMPT_IDS[2], params):
            last = out
        return last.outputs[0]

    async def bad():
        with pytest.raises(ValueError, match="regex"):
            async for _ in aengine.generate([5, 6], SamplingParams(structured_outputs={"regex": "(unclosed"})):
                pass

    async def main():
        return await asyncio.gather(collect(aengine, PROMPT_IDS[0]), constrained(), bad(),
                                    collect(aengine, PROMPT_IDS[1]))

    first, out, _, second = asyncio.run(main())
    assert [first, second] == expected[:2]
    assert out.text in ('{"a":"x"}', '{"a":"yy"}') and out.finish_reason == "stop"
    assert len(threads) == 2 and "specray-engine" not in threads  # the good spec and the bad one, once each
    assert free_blocks(llm.engine) == llm.engine.scheduler.block_manager.num_blocks
