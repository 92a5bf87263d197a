"""Tiny random draft-head checkpoints in the public layouts (EAGLE-1, EAGLE-3, DeepSeek-style MTP), for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _layer(prefix: str, h: int, inter: int, heads: int, kv_heads: int, head_dim: int, qkv_in: int,
           input_norm: bool, hidden_norm: bool, gen: torch.Generator, std: float) -> dict[str, torch.Tensor]:
    def w(*shape):
        return torch.randn(*shape, generator=gen) * std

    def norm():
        return 1.0 + 0.1 * torch.randn(h, generator=gen)

    out = {
        f"{prefix}self_attn.q_proj.weight": w(heads * head_dim, qkv_in),
        f"{prefix}self_attn.k_proj.weight": w(kv_heads * head_dim, qkv_in),
        f"{prefix}self_attn.v_proj.weight": w(kv_heads * head_dim, qkv_in),
        f"{prefix}self_attn.o_proj.weight": w(h, heads * head_dim),
        f"{prefix}post_attention_layernorm.weight": norm(),
        f"{prefix}mlp.gate_proj.weight": w(inter, h),
        f"{prefix}mlp.up_proj.weight": w(inter, h),
        f"{prefix}mlp.down_proj.weight": w(h, inter),
    }
    if input_norm:
        out[f"{prefix}input_layernorm.weight"] = norm()
    if hidden_norm:
        out[f"{prefix}hidden_norm.weight"] = norm()
    return out


def head_config(target_config: dict, **extra) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "max_position_embeddings", "vocab_size", "rope_theta", "hidden_act")
    config = {k: target_config[k] for k in keys if k in target_config}
    config.update(model_type="llama", num_hidden_layers=1, **extra)
    return config


def write_random_head(folder: Path, method: str, target_dir: Path, seed: int = 0, std: float = 0.2,
                      draft_vocab_size: int = 96, midlayer: bool = True, with_lm_head: bool = True,
                      aux_layers: list[int] | None = None) -> Path:
    """A random ``method`` head for the target in ``target_dir``, written as its public layout: a folder of its
    own for EAGLE-1/EAGLE-3; for MTP, a copy of the target's folder with ``model.layers.{L}.*`` added."""
    from safetensors.torch import load_file, save_file

    target = json.loads((target_dir / "config.json").read_text())
    h, inter = target["hidden_size"], target["intermediate_size"]
    heads, kv = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = h // heads
    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    if method == "eagle":
        tensors = {"fc.weight": torch.randn(h, 2 * h, generator=gen) * std, "fc.bias": torch.randn(h, generator=gen) * std}
        tensors.update(_layer("layers.0.", h, inter, heads, kv, head_dim, h, False, False, gen, std))
        (folder / "config.json").write_text(json.dumps(head_config(target, architectures=["EagleLlamaForCausalLM"])))
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    if method == "eagle3":
        vocab = target["vocab_size"]
        ids = torch.randperm(vocab, generator=gen)[:draft_vocab_size].sort().values
        aux = aux_layers or [2, target["num_hidden_layers"] // 2, target["num_hidden_layers"] - 3]
        tensors = {"fc.weight": torch.randn(h, len(aux) * h, generator=gen) * std,
                   "norm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
                   "d2t": ids - torch.arange(draft_vocab_size),
                   "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)}
        if with_lm_head:
            tensors["lm_head.weight"] = torch.randn(draft_vocab_size, h, generator=gen) * std
        prefix = "midlayer." if midlayer else "layers.0."
        tensors.update(_layer(prefix, h, inter, heads, kv, head_dim, 2 * h, True, True, gen, std))
        extra = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab_size}
        if aux_layers is not None:
            extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
        (folder / "config.json").write_text(json.dumps(head_config(target, **extra)))
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    assert method == "mtp", method
    import shutil

    shutil.copytree(target_dir, folder, dirs_exist_ok=True)
    weights = load_file(str(folder / "model.safetensors"))
    p = f"model.layers.{target['num_hidden_layers']}."
    weights.update({f"{p}enorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
                    f"{p}hnorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
                    f"{p}eh_proj.weight": torch.randn(h, 2 * h, generator=gen) * std,
                    f"{p}shared_head.norm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen)})
    weights.update(_layer(p, h, inter, heads, kv, head_dim, h, True, False, gen, std))
    save_file(weights, str(folder / "model.safetensors"))
    return folder
