"""Draft heads that ship with specray (``core/heads/``), so a hidden-state method works out of the box on the
default model. Each folder is a public-layout checkpoint with a card (``README.md``: data, command, agreement)."""

from __future__ import annotations

from pathlib import Path

from specray.default_model import DEFAULT_MODEL_NAME

HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"
# (method, what the target's path or id contains) -> folder under HEADS_DIR
_BUNDLED = {("eagle3", DEFAULT_MODEL_NAME): "smollm2-135m-instruct-eagle3"}


def bundled_head(target_model: str, method: str) -> str:
    """The bundled ``method`` head for ``target_model``, or a ValueError saying how to get one."""
    for (m, name), folder in _BUNDLED.items():
        path = HEADS_DIR / folder
        if m == method and name.lower() in str(target_model).lower() and (path / "model.safetensors").is_file():
            return str(path)
    raise ValueError(f"speculative_config.model is required for method={method!r} with the target "
                     f"{target_model!r}: specray bundles a head only for {DEFAULT_MODEL_NAME}; give a head's "
                     "checkpoint folder, or train one with `specray train-draft --method "
                     f"{method} --model {target_model}`")
