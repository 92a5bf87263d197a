"""A model folder's copy over a permuted vocabulary: every token id moved (the tokenizer's vocabulary and added tokens,
the embedding and LM-head rows, the config's special ids), the weights otherwise the same. The copy is the same model
under another tokenizer's ids: a draft model of another tokenizer that predicts exactly what the original does
(tests/test_vocab_translation.py, benchmarks/bench_vocab_translation.py)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch


def permuted_copy(folder: Path, out: Path, seed: int = 5, noise: float = 0.0) -> Path:
    """``folder`` (an HF folder: tokenizer.json, config.json, one safetensors file or shards) copied to ``out`` with
    its vocabulary permuted by ``seed``; ``noise`` > 0 also moves every weight by that many of its tensor's standard
    deviations times a standard normal draw (a model near the original, not equal to it). Returns ``out``."""
    from safetensors.torch import load_file, save_file

    folder, out = Path(folder), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = json.loads((folder / "tokenizer.json").read_text())
    base = len(spec["model"]["vocab"])
    size = base + len([t for t in spec["added_tokens"] if t["id"] >= base])
    order = list(range(size))
    random.Random(seed).shuffle(order)  # old id -> new id
    spec["model"]["vocab"] = {token: order[i] for token, i in spec["model"]["vocab"].items()}
    for added in spec["added_tokens"]:
        added["id"] = order[added["id"]]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    decoder = tokenizer_config.get("added_tokens_decoder", {})
    tokenizer_config["added_tokens_decoder"] = {str(order[int(i)]): token for i, token in decoder.items()}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = json.loads((folder / "config.json").read_text())
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if isinstance(config.get(key), int):
            config[key] = order[config[key]]
    (out / "config.json").write_text(json.dumps(config))
    for path in folder.iterdir():  # the rest as it is (an index of shards, a chat template, generation config)
        if path.is_file() and not (out / path.name).exists() and path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    index = torch.tensor(order)
    for path in sorted(folder.glob("*.safetensors")):
        weights = load_file(path)
        generator = torch.Generator().manual_seed(seed)
        for name, tensor in weights.items():
            if noise and tensor.is_floating_point() and tensor.numel() > 1:
                tensor = weights[name] = tensor + noise * tensor.float().std().to(tensor.dtype) * torch.randn(
                    tensor.shape, generator=generator).to(tensor.dtype)
            if tensor.shape[0] == config["vocab_size"] and ("embed" in name or "lm_head" in name):
                moved = tensor.clone()
                moved[index] = tensor[: len(order)]
                weights[name] = moved
        save_file(weights, out / path.name, metadata={"format": "pt"})
    return out
