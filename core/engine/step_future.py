"""A step started on an executor, answered later: what lets the engine build one step's outputs while the next
step computes (``LLMEngine(async_scheduling=True)``). Torch-free, as the engine loop is."""

from __future__ import annotations

from typing import Protocol

from specray.contract import StepPlan, StepResult


class StepFuture(Protocol):
    def result(self) -> StepResult: ...


class _Done:
    """A step that ran (or failed) when it was started: what an executor without ``execute_async`` gives."""

    def __init__(self, result: StepResult | None = None, error: Exception | None = None):
        self._result, self._error = result, error

    def result(self) -> StepResult:
        if self._error is not None:
            raise self._error
        return self._result


def resolved(future: StepFuture) -> StepFuture:
    """``future`` answered now: its result, or its error, kept for ``result()`` (a pipeline's engine takes the answers
    of the steps in flight before it runs a failed step's requests again)."""
    try:
        return _Done(future.result())
    except Exception as err:  # handed back by result(), as the step's own error
        return _Done(error=err)


def start_step(executor, plan: StepPlan, draft_probs: dict | None) -> StepFuture:
    """Start ``plan`` on ``executor`` and return at once where it computes apart from this thread (its
    ``execute_async``); otherwise run it now. Either way its errors come from ``result()``."""
    execute_async = getattr(executor, "execute_async", None)
    try:
        if execute_async is None:
            return _Done(executor.execute(plan, draft_probs))
        return execute_async(plan, draft_probs)
    except Exception as err:  # e.g. a rank gone before the plan reached it: the caller hears it from result()
        return _Done(error=err)
