"""Errors the engine raises past the user-input ``ValueError``s."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine could not serve a request for a reason of its own (not the request's)."""


class WorkerDiedError(EngineError):
    """A target worker (a TP rank) died or stopped answering; the step's requests cannot finish."""


class RequestError(EngineError):
    """A step failed because of these requests alone (a worker checked their inputs and refused them): the
    engine fails them and runs the others again."""

    def __init__(self, req_ids: list[str], cause: BaseException | str):
        super().__init__(f"requests {list(req_ids)} failed: {cause}")
        self.req_ids = list(req_ids)
        self.cause = cause


class RequestFailedError(EngineError):
    """This request was in flight when the engine failed; it was aborted and its KV blocks freed."""

    def __init__(self, req_id: str, cause: BaseException | str):
        super().__init__(f"request {req_id!r} failed: {cause}")
        self.req_id = req_id
        self.cause = cause
