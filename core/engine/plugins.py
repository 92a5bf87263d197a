"""Backends that live above the engine plug in here, so the core never names them.

Three kinds, each keyed by ``distributed_executor_backend``:

* ``executor``: runs step plans on the target's ranks (``executor.execute(plan, draft_probs)``);
* ``remote_drafter``: the engine's drafter when drafting runs out of this process (``None``: in-process);
* ``engine_client``: what :class:`specray.LLM` talks to when the engine loop itself runs elsewhere.

In-process ones register in code (:func:`register`); a package above the core declares Python entry points
(groups ``specray.executors``, ``specray.remote_drafters``, ``specray.engine_clients`` in ``pyproject.toml``),
read once when first asked for, so importing the core never imports them.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

GROUPS = {
    "executor": "specray.executors",
    "remote_drafter": "specray.remote_drafters",
    "engine_client": "specray.engine_clients",
}

_registered: dict[str, dict[str, Any]] = {kind: {} for kind in GROUPS}


def register(kind: str, name: str, obj: Any) -> None:
    """Make ``obj`` the ``kind`` for backend ``name`` (in-process backends, and tests)."""
    _registered[kind][name] = obj


def names(kind: str) -> list[str]:
    """Every backend that has a ``kind``, registered in code or declared as an entry point."""
    return sorted(set(_registered[kind]) | {ep.name for ep in entry_points(group=GROUPS[kind])})


def find(kind: str, name: str) -> Any | None:
    """The ``kind`` registered for backend ``name``, loading its entry point on first use; None if none is."""
    found = _registered[kind].get(name)
    if found is not None:
        return found
    for ep in entry_points(group=GROUPS[kind], name=name):
        found = _registered[kind][name] = ep.load()
        return found
    return None


def lookup(kind: str, name: str, field: str = "distributed_executor_backend") -> Any:
    """:func:`find`, or a ValueError naming the field, the value and the backends there are."""
    found = find(kind, name)
    if found is None:
        raise ValueError(f"{field}={name!r} has no {kind.replace('_', ' ')}; choose one of {names(kind)} "
                         f"(a backend in another package is found through its entry points in the "
                         f"{GROUPS[kind]!r} group: reinstall specray, `pip install -e .`, after changing them)")
    return found
