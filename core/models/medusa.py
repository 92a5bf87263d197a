"""Medusa heads (Cai et al., 2024): K small heads on the target's last hidden state. At a position whose logits
give the token x the target samples next, head k (0-based) guesses the token k + 1 places after x. Each head is
``num_layers`` residual blocks ``h + SiLU(W h + b)`` and an LM head of its own [V, H]; there is no attention, so
no KV cache and no pass over earlier positions: one batched call per step over one row per request.

Checkpoint layouts, both read by :func:`load_medusa_heads` (and written by :func:`save_medusa_heads`):

* FasterDecoding/Medusa: ``medusa_lm_head.safetensors`` (or ``.pt``) with ``{k}.{j}.linear.weight``/``.bias`` for
  block j of head k and ``{k}.{num_layers}.weight`` for its LM head (names may carry a ``medusa_head.`` prefix);
  ``config.json`` gives ``medusa_num_heads`` and ``medusa_num_layers``.
* vLLM's: ``blocks.{k}.layers.{j}.weight``/``.bias`` and ``lm_heads.{k}.weight``; ``config.json`` gives
  ``num_heads`` and ``num_hidden_layers``.

The heads and block counts come from the tensors present; sizes that do not fit the target are a ValueError.

Over a target's tensor-parallel ranks (``tp``) each rank holds its rows of every LM head (the vocabulary split as the
target's LM head is, padded to a multiple of the ranks) and the blocks whole (H x H each); the logits are
all-gathered, so every rank sees them all.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specray.models.layers import gather_vocab, materialize, shape_of, shard_vocab_rows, vocab_shard
from specray.models.loader import head_tensors, load_frozen
from specray.parallel import TPGroup

_FASTER = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")
_VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")


class MedusaHeads(nn.Module):
    """K heads over the target's hidden states: ``forward(hidden [B, H]) -> logits [B, K, V]`` (float32)."""

    aux_layers: tuple[int, ...] = ()  # reads the last hidden state only

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int, tp: TPGroup | None = None):
        super().__init__()
        self.num_heads, self.num_layers, self.vocab_size = num_heads, num_layers, vocab_size
        self.tp = tp or TPGroup.single()
        rows = vocab_shard(self.tp, vocab_size)[1]  # this rank's rows of each LM head
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
                                    for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, rows, bias=False) for _ in range(num_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = []
        for blocks, lm_head in zip(self.blocks, self.lm_heads):
            x = hidden
            for block in blocks:
                x = x + nn.functional.silu(block(x))
            out.append(lm_head(x))
        return gather_vocab(torch.stack(out, dim=1), self.tp, self.vocab_size).float()  # [B, K, rows] -> [B, K, V]

    def kv_cache_specs(self) -> list:
        return []  # no attention: nothing cached


def _canonical(name: str) -> tuple[str, int, int | None, str] | None:
    """(kind, head, block, param) of a checkpoint name: kind "block" or "lm_head" (block None), else None."""
    found = _VLLM_BLOCK.match(name)
    if found:
        return "block", int(found[1]), int(found[2]), found[3]
    found = _VLLM_HEAD.match(name)
    if found:
        return "lm_head", int(found[1]), None, "weight"
    found = _FASTER.match(name)
    if found:
        head, index, param = int(found[1]), int(found[2]), found[3]
        return ("block", head, index, param) if ".linear." in name else ("lm_head", head, None, param)
    return None


def load_medusa_heads(path: str | os.PathLike | None, target_config, dtype: torch.dtype,
                      device: torch.device | str, tp: TPGroup | None = None) -> MedusaHeads:
    """The Medusa heads in ``path`` (a folder with ``config.json``), checked against the target's sizes; with
    ``tp``, this rank's share (its rows of each LM head)."""
    if path is None:
        raise ValueError("speculative_config.model is required for method='medusa': the heads' checkpoint folder")
    folder, tensors = head_tensors(path, "medusa", ("medusa_lm_head.pt",))
    parts: dict[tuple[str, int, int | None, str], Any] = {}
    for name, tensor in tensors.items():
        key = _canonical(name)
        if key is not None:
            parts[key] = tensor
    heads = sorted({k[1] for k in parts if k[0] == "lm_head"})
    if not heads or heads != list(range(len(heads))):
        raise ValueError(f"the medusa checkpoint {str(folder)!r} has no LM heads numbered 0..K-1 (found {heads}); "
                         "expected FasterDecoding's {k}.{j}.linear.* / {k}.{L}.weight or vLLM's blocks.* / "
                         "lm_heads.* names")
    num_layers = len({k[2] for k in parts if k[0] == "block" and k[1] == 0})
    h, v = target_config.hidden_size, target_config.vocab_size
    lm = parts["lm_head", 0, None, "weight"]
    if tuple(shape_of(lm)) != (v, h):
        raise ValueError(f"the medusa heads' LM head is {tuple(shape_of(lm))} but the target needs {(v, h)} "
                         f"(vocab_size={v}, hidden_size={h}): the heads were trained for another model")
    with torch.device(device):
        module = MedusaHeads(len(heads), num_layers, h, v, tp).to(dtype)
    state = {}
    for (kind, head, block, param), tensor in parts.items():
        name = f"lm_heads.{head}.{param}" if kind == "lm_head" else f"blocks.{head}.{block}.{param}"
        state[name] = (shard_vocab_rows(tensor, module.tp, v) if kind == "lm_head" else materialize(tensor)).to(dtype)
    return load_frozen(module, state, f"the medusa checkpoint {str(folder)!r} does not fit {len(heads)} heads of "
                                      f"{num_layers} blocks")


def save_medusa_heads(heads: MedusaHeads, folder: str | os.PathLike, layout: str = "medusa",
                      extra_config: dict[str, Any] | None = None) -> None:
    """Write ``heads`` in FasterDecoding's layout (``layout="medusa"``: ``medusa_lm_head.safetensors``) or vLLM's
    (``"vllm"``: ``model.safetensors``), with a ``config.json`` in that layout's names."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, config = {}, dict(extra_config or {})
    for k in range(heads.num_heads):
        for j, block in enumerate(heads.blocks[k]):
            for param in ("weight", "bias"):
                name = f"{k}.{j}.linear.{param}" if layout == "medusa" else f"blocks.{k}.layers.{j}.{param}"
                tensors[name] = getattr(block, param)
        name = f"{k}.{heads.num_layers}.weight" if layout == "medusa" else f"lm_heads.{k}.weight"
        tensors[name] = heads.lm_heads[k].weight
    hidden, vocab = heads.lm_heads[0].weight.shape[1], heads.lm_heads[0].weight.shape[0]
    if layout == "medusa":
        config.update(medusa_num_heads=heads.num_heads, medusa_num_layers=heads.num_layers)
        file = "medusa_lm_head.safetensors"
    elif layout == "vllm":
        config.update(model_type="medusa", num_heads=heads.num_heads, num_hidden_layers=heads.num_layers,
                      hidden_size=hidden, vocab_size=vocab)
        file = "model.safetensors"
    else:
        raise ValueError(f"layout={layout!r}: one of 'medusa' (FasterDecoding) or 'vllm'")
    save_file({k: t.detach().contiguous().cpu() for k, t in tensors.items()}, str(folder / file))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
