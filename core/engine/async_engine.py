"""An asyncio front for :class:`LLMEngine`: many callers, one step loop.

The engine is not thread-safe and its step blocks (a forward pass, or a wait on remote workers), so one
background thread owns it: callers on any event loop hand it commands through a queue and read their request's
outputs from an ``asyncio.Queue`` the thread fills with ``call_soon_threadsafe``. Nothing else touches the
engine, so requests, aborts and steps never race; the one exception is a request's structured-outputs spec, compiled
in a worker thread of the caller's loop (``StructuredOutputs.compile`` is thread-safe and llguidance releases the
GIL while compiling) so that a large schema does not stall every stream's steps.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from specray.engine.llm_engine import LLMEngine, check_params_type
from specray.errors import EngineError, RequestFailedError, RequestRefusedError, WorkerDiedError
from specray.multimodal import MultiModalInputs
from specray.outputs import RequestOutput
from specray.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # the loop sleeps at most this long with nothing to do (a command wakes it at once)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput items, then possibly one exception

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand ``item`` to the caller's loop; False when that loop is closed (its caller is gone)."""
        return _on_loop(self.loop, self.queue.put_nowait, item)


class AsyncLLMEngine:
    """Runs ``engine`` in a background thread. ``generate`` is an async generator of a request's outputs
    (each the request's whole state so far); leaving it early aborts the request and frees its blocks."""

    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None):
        self.engine = engine
        self.on_step = on_step  # called in the engine thread after every step (metrics)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="specray-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any event loop) ------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                       req_id: str | None = None, multimodal: MultiModalInputs | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Queue one request and yield its outputs until it finishes. Bad input raises ValueError before the
        first output; an engine failure, or a step that failed for this request alone (its output's
        ``finish_reason == "error"``), raises :class:`RequestFailedError` (:class:`RequestRefusedError`, a
        ValueError too, where the request's own constraints cannot be met)."""
        check_params_type(params)  # (before its structured_outputs are read)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        if params.structured_outputs is not None:  # a new spec compiles here, not in the step loop's thread
            await stream.loop.run_in_executor(None, self.engine.structured.compile, params.structured_outputs)
        try:
            req_id = await self.call(lambda e: self._add(e, prompt_token_ids, params, prompt, req_id, stream,
                                                         multimodal))
        except asyncio.CancelledError:  # the add may still run: commands run in order, so this abort follows it
            self.submit(lambda e: self._abort(e, self._req_ids_of(stream)))
            raise
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the caller went away (client disconnect, cancellation): free its blocks
                self.submit(lambda e: self._abort(e, [req_id]))

    async def abort(self, req_id: str) -> None:
        """Abort a request: its stream ends with its last output (``finish_reason="abort"``)."""
        await self.call(lambda e: self._abort(e, [req_id]))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between two steps and return its result (or raise)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run(engine: LLMEngine) -> None:
            try:
                result = fn(engine)
            except Exception as exc:  # handed to the caller, who raises it
                _on_loop(loop, _set_exception, future, exc)
            else:
                _on_loop(loop, _set_result, future, result)

        self.submit(run)
        return await future

    def submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run ``fn(engine)`` in the engine thread, without waiting for it."""
        if self._stopped:
            raise EngineError("the engine is shut down")
        if not self._thread.is_alive():
            raise EngineError("the engine's thread has stopped (see the log for why); build a new engine")
        self._commands.put(fn)
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    # ---- engine thread ---------------------------------------------------------------------------------
    def _add(self, engine: LLMEngine, ids, params, prompt, req_id, stream: _Stream, multimodal=None) -> str:
        req_id = engine.add_request(ids, params, prompt=prompt, req_id=req_id, multimodal=multimodal)
        self._streams[req_id] = stream
        return req_id

    def _req_ids_of(self, stream: _Stream) -> list[str]:
        return [rid for rid, s in self._streams.items() if s is stream]

    def _abort(self, engine: LLMEngine, req_ids: list[str]) -> None:
        """Abort ``req_ids``; a caller still reading one's stream gets its last output (finished)."""
        for out in engine.abort_request(req_ids):
            stream = self._streams.pop(out.request_id, None)
            if stream is not None:
                stream.put(out)
        for rid in req_ids:
            self._streams.pop(rid, None)

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._drain()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                self._step()
        except Exception as err:  # our own bug: the thread ends, and its callers hear it instead of waiting
            logger.exception("the engine's thread failed")
            self._stopped = True
            self._fail_all(EngineError(f"the engine's thread failed: {err!r}"))
            return
        self._fail_all(EngineError("the engine is shut down"))

    def _drain(self) -> None:
        while True:
            try:
                fn = self._commands.get_nowait()
            except queue.Empty:
                return
            fn(self.engine)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except WorkerDiedError as err:  # the engine already aborted these requests and restarted its workers
            for rid in err.req_ids:
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    stream.put(RequestFailedError(rid, err))
            return
        except Exception as err:  # our own bug: fail what is in flight loudly rather than hang the callers
            logger.exception("engine step failed")
            self._fail_all(EngineError(f"engine step failed: {err!r}"))
            return
        gone = []  # requests whose caller's event loop is closed: nobody reads them
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            # a step failed for this request alone: its caller gets the error, the others go on
            item = out if out.error is None else (RequestRefusedError if out.refused else RequestFailedError)(
                out.request_id, out.error)
            delivered = stream.put(item)
            if out.finished or not delivered:
                del self._streams[out.request_id]
            if not delivered and not out.finished:
                gone.append(out.request_id)
        if gone:
            logger.warning("aborting %d requests whose caller's event loop closed: %s", len(gone), gone[:8])
            self.engine.abort_request(gone)
        if self.on_step is not None:
            self.on_step(self.engine, outputs)

    def _fail_all(self, err: EngineError) -> None:
        req_ids = list(self._streams)
        try:
            self.engine.abort_request(req_ids)
        finally:
            for rid in req_ids:
                self._streams.pop(rid).put(RequestFailedError(rid, err))


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> bool:
    """Run ``fn(*args)`` on ``loop`` (from another thread); False when the loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # "Event loop is closed": its caller is gone
        return False
    return True


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
