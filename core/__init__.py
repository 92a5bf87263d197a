"""specray: LLM serving with speculative decoding, distributed on Ray.

Public names resolve lazily, so torch-free modules (``specray.contract``, ``specray.scheduler``) import
without pulling in torch.
"""

from importlib import import_module

__version__ = "0.1.0"

_PUBLIC = {
    "LLM": "specray.llm",
    "SamplingParams": "specray.sampling_params",
    "StructuredOutputsParams": "specray.sampling_params",
    "SpeculativeConfig": "specray.config",
    "LoRARequest": "specray.lora",
    "RequestOutput": "specray.outputs",
    "CompletionOutput": "specray.outputs",
    "Logprob": "specray.outputs",
    "SpecStats": "specray.outputs",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'specray' has no attribute {name!r}")
