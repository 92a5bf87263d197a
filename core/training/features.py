"""The target's features and labels for every token of the training text, computed once and kept on disk.

For each sample the target runs one teacher-forced prefill (specray's own model, paged attention) and keeps, per
position p: the features the head reads (EAGLE-3: the residual stream entering its three layers; EAGLE-1 and MTP:
the last hidden state) as float16, and the target's greedy next token ``argmax logits[p]`` as the label.

Files in the output folder (resumable: a stopped run goes on after the last sample it recorded):
``features.f16`` [N, F * H] and ``labels.i32`` [N] (raw arrays, N = every token of every sample, back to back)
and ``features.json`` (the layers, the width, and each sample's offset and length).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache

FEATURES_FILE = "features.f16"
LABELS_FILE = "labels.i32"
INDEX_FILE = "features.json"


@dataclass
class FeatureStore:
    """The features and labels on disk, memory-mapped."""

    folder: str
    layers: list[int]  # target layers whose input residual stream is kept; [] = the last hidden state
    hidden_size: int
    offsets: list[int]
    lengths: list[int]
    token_ids: list[list[int]]

    @property
    def width(self) -> int:
        return max(len(self.layers), 1) * self.hidden_size

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1] + self.lengths[-1] if self.offsets else 0

    def features(self) -> np.ndarray:
        return np.memmap(os.path.join(self.folder, FEATURES_FILE), dtype=np.float16, mode="r",
                         shape=(self.num_tokens, self.width))

    def labels(self) -> np.ndarray:
        return np.memmap(os.path.join(self.folder, LABELS_FILE), dtype=np.int32, mode="r", shape=(self.num_tokens,))

    @classmethod
    def open(cls, folder: str, samples: list[dict]) -> "FeatureStore":
        index = json.loads(open(os.path.join(folder, INDEX_FILE), encoding="utf-8").read())
        n = index["num_samples"]
        return cls(folder, index["layers"], index["hidden_size"], index["offsets"][:n], index["lengths"][:n],
                   [s["token_ids"] for s in samples[:n]])


def compute_features(target, samples: list[dict], layers: Sequence[int], folder: str, block_size: int = 16,
                     tokens_per_batch: int = 2048, progress=None) -> FeatureStore:
    """Features and labels for ``samples`` (records of ``samples.jsonl``) into ``folder``, resuming what is there.
    ``layers``: the target layers whose input residual stream to keep (EAGLE-3's three), or () for the last
    hidden state."""
    os.makedirs(folder, exist_ok=True)
    layers = list(layers)
    hidden = target.embed(torch.zeros(1, dtype=torch.long, device=target.device)).shape[-1]
    index_path = os.path.join(folder, INDEX_FILE)
    index = {"layers": layers, "hidden_size": hidden, "num_samples": 0, "offsets": [], "lengths": []}
    if os.path.exists(index_path):
        index = json.loads(open(index_path, encoding="utf-8").read())
        if index["layers"] != layers or index["hidden_size"] != hidden:
            raise ValueError(f"{index_path} holds features of layers {index['layers']} (width {index['hidden_size']}); "
                             f"this run wants {layers} ({hidden}): use another output folder")
    done = index["num_samples"]
    width = max(len(layers), 1) * hidden
    end = (index["offsets"][done - 1] + index["lengths"][done - 1]) if done else 0
    longest = max(len(s["token_ids"]) for s in samples)
    blocks = -(-max(longest, tokens_per_batch) // block_size) + 1
    allocate_kv_cache(target, blocks * 2, block_size)
    with open(os.path.join(folder, FEATURES_FILE), "r+b" if done else "wb") as ff, \
            open(os.path.join(folder, LABELS_FILE), "r+b" if done else "wb") as lf:
        ff.truncate(end * width * 2)
        lf.truncate(end * 4)
        ff.seek(0, os.SEEK_END)
        lf.seek(0, os.SEEK_END)
        i = done
        while i < len(samples):
            batch = [samples[i]["token_ids"]]
            while i + len(batch) < len(samples) and sum(map(len, batch)) + len(samples[i + len(batch)]["token_ids"]) \
                    <= tokens_per_batch:
                batch.append(samples[i + len(batch)]["token_ids"])
            feats, labels = _run(target, batch, layers, block_size)
            ff.write(feats.numpy().astype(np.float16).tobytes())
            lf.write(labels.numpy().astype(np.int32).tobytes())
            ff.flush()
            lf.flush()
            for ids in batch:
                index["offsets"].append(end)
                index["lengths"].append(len(ids))
                end += len(ids)
            i += len(batch)
            index["num_samples"] = i
            _write_json(index_path, index)
            if progress is not None:
                progress(i, len(samples))
    return FeatureStore.open(folder, samples)


@torch.inference_mode()
def _run(target, batch: list[list[int]], layers: list[int], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One teacher-forced prefill of several sequences (each in its own blocks) -> features [T, F*H], labels [T]."""
    tables, used = [], 0
    for ids in batch:
        n = -(-len(ids) // block_size)
        tables.append(list(range(used, used + n)))
        used += n
    device = target.device
    meta = build_attention_metadata([len(ids) for ids in batch], [0] * len(batch), tables, block_size, device)
    ids = torch.tensor([t for s in batch for t in s], dtype=torch.long, device=device)
    if layers:
        hidden, aux = target(ids, meta, aux_layers=layers)
        feats = torch.cat(aux, dim=-1)
    else:
        hidden = target(ids, meta)
        feats = hidden
    labels = torch.cat([target.compute_logits(chunk).argmax(-1) for chunk in hidden.split(512)])
    return feats.float().cpu(), labels.cpu()


def _write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)
