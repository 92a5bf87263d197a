"""The engine layer: the step loop (:class:`LLMEngine`), its wiring from :class:`specray.config.EngineArgs`
(:func:`build_engine`), the executors that run a step on the target's ranks, the asyncio front
(:class:`AsyncLLMEngine`), and :mod:`specray.engine.plugins`, where backends above the core (the cluster
package's executor, remote drafter and engine client) register. Imports point down only: nothing below this
package imports it (``tests/test_layout.py``).

Names resolve lazily, so ``import specray.engine`` costs nothing until one is used.
"""

from importlib import import_module

_PUBLIC = {
    "LLMEngine": "specray.engine.llm_engine",
    "build_engine": "specray.engine.builder",
    "AsyncLLMEngine": "specray.engine.async_engine",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'specray.engine' has no attribute {name!r}")
