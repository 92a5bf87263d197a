"""One way to raise here what a Ray task or actor raised over there.

A user error raised remotely (a ``ValueError``: a bad argument, heads not divisible by the TP size) is raised here
as itself, so callers catch it as they would in one process; any other error becomes what the caller names (a
dead worker group, say). Either way the remote traceback is chained as the ``__cause__``: printing the error shows
where it really happened.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from specray.errors import RemoteTraceback


def remote_traceback(err: BaseException) -> RemoteTraceback:
    """The remote traceback a Ray error carries (its ``traceback_str``), or its own text when it has none."""
    return RemoteTraceback(getattr(err, "traceback_str", None) or str(err))


def raise_remote(err: BaseException, otherwise: Callable[[str], BaseException] | None = None) -> NoReturn:
    """Raise ``err`` (a ``RayTaskError`` or ``RayActorError``) as the error it stands for: its cause itself when
    that is a ValueError, else ``otherwise(message)`` (or ``err`` unchanged when no ``otherwise`` is given)."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, ValueError):
        raise cause.with_traceback(None) from remote_traceback(err)
    if otherwise is None:
        raise err
    raise otherwise(str(cause if cause is not None else err)) from remote_traceback(err)
