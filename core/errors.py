"""Errors the engine raises past the user-input ``ValueError``s."""

from __future__ import annotations

import logging
from typing import Any


class EngineError(RuntimeError):
    """The engine could not serve a request for a reason of its own (not the request's)."""


class WorkerDiedError(EngineError):
    """A target worker (a TP rank) died or stopped answering; the step's requests cannot finish. ``req_ids``:
    the requests the engine failed because of it (set by the engine when it recovers)."""

    def __init__(self, *args: object):
        super().__init__(*args)
        self.req_ids: list[str] = []


class RequestError(EngineError):
    """A step failed because of these requests alone (a worker checked their inputs and refused them): the
    engine fails them and runs the others again."""

    def __init__(self, req_ids: list[str], cause: BaseException | str):
        super().__init__(f"requests {list(req_ids)} failed: {cause}")
        self.req_ids = list(req_ids)
        self.cause = cause


class StepError(EngineError):
    """A step raised on a rank that is alive (a bug, or an input the step could not handle). Every rank answered,
    so the group is intact and is not restarted; the step's requests did not advance. The rank's exception does
    not travel (it may not unpickle here): its type name, message and formatted traceback do. ``req_ids`` names
    the requests the rank attributed the error to (an exception raised there with a ``req_ids`` attribute), or
    is empty when the error concerns the whole step."""

    def __init__(self, what: str, rank: int, exc_type: str, exc_message: str, remote_traceback: str = "",
                 req_ids: list[str] | tuple[str, ...] = ()):
        super().__init__(f"{what}: rank {rank} raised {exc_type}: {exc_message}")
        self.what, self.rank = what, rank
        self.exc_type, self.exc_message = exc_type, exc_message
        self.remote_traceback = remote_traceback
        self.req_ids = list(req_ids)

    def __reduce__(self):  # crosses Ray (engine actor -> driver) with every field
        return (type(self), (self.what, self.rank, self.exc_type, self.exc_message, self.remote_traceback,
                             self.req_ids))


class RemoteTraceback(Exception):
    """The traceback of an exception raised in another process, as text; chained as the ``__cause__`` of the
    exception raised here, so that printing it shows where the error really happened."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n\n{self.text.rstrip()}"


class RequestFailedError(EngineError):
    """This request was in flight when the engine failed; it was aborted and its KV blocks freed."""

    def __init__(self, req_id: str, cause: BaseException | str):
        super().__init__(f"request {req_id!r} failed: {cause}")
        self.req_id = req_id
        self.cause = cause

    def __reduce__(self):
        return (type(self), (self.req_id, self.cause))


class RequestRefusedError(RequestFailedError, ValueError):
    """This request failed mid-output because its own constraints cannot be met (structured outputs with
    ``allowed_token_ids`` that leave the grammar no token): the client's error, reported as the cause alone."""

    def __str__(self) -> str:
        return str(self.cause)


def describe_plan(plan: Any, max_requests: int = 16) -> str:
    """A one-line summary of a step plan for an error log: step id, and per scheduled request its id, chunk
    size, start position and draft count, plus the plan's new, finished and preempted ids (vLLM's
    ``log_error_detail``). Bounded, so that a batch of hundreds stays one readable line."""
    chunks = [f"{c.req_id}(+{c.num_tokens}@{c.start_pos}, drafts={c.num_draft_tokens}"
              f"{'' if c.sample else ', no sample'})" for c in plan.chunks[:max_requests]]
    more = len(plan.chunks) - len(chunks)
    if more > 0:
        chunks.append(f"... {more} more")
    extra = {"new": [r.req_id for r in plan.new_requests], "finished": list(plan.finished_req_ids),
             "preempted": list(plan.preempted_req_ids)}
    shown = ", ".join(f"{k}={v[:max_requests]}" for k, v in extra.items() if v)
    return f"step {plan.step_id}: {len(plan.chunks)} chunks [{', '.join(chunks)}]" + (f"; {shown}" if shown else "")


def log_error_detail(logger: logging.Logger, plan: Any, err: BaseException) -> None:
    """Log the plan a step failed on and the remote traceback (if the error carries one), before re-raising."""
    remote = getattr(err, "remote_traceback", "") or ""
    logger.error("step failed: %s\nplan: %s%s", err, describe_plan(plan),
                 f"\nremote traceback:\n{remote.rstrip()}" if remote else "")
