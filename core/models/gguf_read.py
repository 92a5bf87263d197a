"""What the GGUF readers of our own (:mod:`specray.models.gguf_qwen3_5`, :mod:`specray.models.gguf_mamba2`) share:
the file read whole, its metadata looked up by key with an error naming what is missing, and its layers' tensors
grouped by layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def read_gguf(gguf: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The GGUF's metadata (arrays as lists, but for the tokenizer's vocabulary and merges) and its tensors,
    dequantized to float32 in their logical shape (slowest dim first)."""
    from gguf import GGUFReader, GGUFValueType
    from gguf.quants import dequantize

    reader = GGUFReader(str(gguf))
    meta = {key: f.contents() for key, f in reader.fields.items()
            if f.types and not (key.startswith("tokenizer.") and f.types[0] == GGUFValueType.ARRAY)}
    tensors = {}
    for t in reader.tensors:
        value = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        tensors[t.name] = value.reshape([int(n) for n in reversed(t.shape)])  # GGUF lists dims fastest first
    return meta, tensors


class GGUFMeta:
    """The GGUF's metadata of one architecture, read by key (without the ``{arch}.`` prefix)."""

    def __init__(self, meta: dict[str, Any], arch: str, gguf: Path):
        self.meta, self.arch, self.gguf = meta, arch, gguf

    def __call__(self, key: str, default: Any = ...) -> Any:
        value = self.meta.get(f"{self.arch}.{key}", default)
        if value is ...:
            raise ValueError(f"GGUF {str(self.gguf)!r} lacks {self.arch}.{key}, which llama.cpp writes for every "
                             f"{self.arch} model; convert the model again with a current llama.cpp, or pass its HF "
                             "checkpoint")
        return value

    def per_layer(self, key: str, layers: int) -> list[int]:
        """A per-layer value (an array, or one number for every layer)."""
        value = self(key)
        values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers
        if len(values) != layers:
            raise ValueError(f"GGUF {str(self.gguf)!r} has {len(values)} values of {self.arch}.{key} for {layers} "
                             "layers (block_count); convert the model again with a current llama.cpp, or pass its "
                             "HF checkpoint")
        return values

    def token_ids(self) -> dict[str, Any]:
        """The config's special token ids, as the file's tokenizer names them."""
        return {"eos_token_id": self.meta.get("tokenizer.ggml.eos_token_id"),
                "bos_token_id": self.meta.get("tokenizer.ggml.bos_token_id"),
                "pad_token_id": self.meta.get("tokenizer.ggml.padding_token_id")}


def tensors_by_layer(tensors: dict[str, torch.Tensor], gguf: Path, arch: str) -> dict[int, dict[str, torch.Tensor]]:
    """``blk.{i}.{name}`` tensors as ``{i: {name: tensor}}``; any other name left in ``tensors`` is refused."""
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        parts = name.split(".", 2)
        if parts[0] != "blk" or len(parts) != 3 or not parts[1].isdigit():
            raise ValueError(f"GGUF {str(gguf)!r} has a tensor {name!r} specray cannot place in a {arch} model; "
                             "pass the model's HF checkpoint instead")
        per_layer.setdefault(int(parts[1]), {})[parts[2]] = value
    return per_layer
