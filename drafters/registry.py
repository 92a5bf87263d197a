"""The one registry from ``speculative_config.method`` to a drafter class."""

from __future__ import annotations

from importlib import import_module

# method name -> "module:Class"; modules import lazily (the draft model needs torch, the n-gram drafter not).
_DRAFTERS = {
    "ngram": "specray.drafters.ngram:NgramDrafter",
    "draft_model": "specray.drafters.draft_model:DraftModelDrafter",
}


def drafter_names() -> list[str]:
    return list(_DRAFTERS)


def drafter_class(method: str):
    if method not in _DRAFTERS:
        raise ValueError(f"speculative_config.method={method!r} is unknown; choose one of {sorted(_DRAFTERS)}")
    module, cls = _DRAFTERS[method].split(":")
    return getattr(import_module(module), cls)
