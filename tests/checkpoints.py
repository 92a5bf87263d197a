"""Checkpoints the loader tests write from the tiny models: an FP8 release of one (block scales, as DeepSeek's and
Qwen3's FP8 checkpoints store them) beside its by-hand dequantized twin, and a mixture of experts' fused expert
tensors split into one tensor per expert (the layout of DeepSeek's and Qwen3-MoE's releases). Imported as
``specray_test_checkpoints`` (tests/conftest.py registers it)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FP8_BLOCK = [16, 16]


def write_fp8(src: Path, dst: Path, block: list[int] | None = FP8_BLOCK, strategy: str | None = None
              ) -> tuple[Path, Path]:
    """``src``'s checkpoint as an FP8 release (every 2-D projection weight float8 e4m3 with a float32
    ``weight_scale_inv`` per ``block``, as DeepSeek's and Qwen3's FP8 checkpoints store them), and beside it the
    same model with those weights dequantized by hand (block by block, in a loop): the reference. With
    ``strategy`` ("channel", "tensor" or "block"), llm-compressor's layout instead (compressed-tensors,
    float-quantized): ``weight_scale`` per output row, per tensor or per ``block``, and a static ``input_scale``
    beside each weight."""
    if strategy is not None:
        block = {"block": block or FP8_BLOCK, "channel": [1, None], "tensor": None}[strategy]
    from safetensors.torch import load_file, save_file

    fp8, ref = dst / "fp8", dst / "dequantized"
    for folder in (fp8, ref):
        shutil.copytree(src, folder)
    tensors = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        if not (name.endswith("proj.weight") and w.dim() == 2):
            quantized[name] = dequantized[name] = w
            continue
        rows, cols = w.shape
        b0, b1 = (block[0], block[1] or cols) if block else (rows, cols)
        scales = torch.empty(-(-rows // b0), -(-cols // b1))
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        back = torch.empty(rows, cols)
        for i in range(scales.shape[0]):
            for j in range(scales.shape[1]):
                part = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float()
                scales[i, j] = part.abs().max().clamp_min(1e-12) / 448.0
                q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (part / scales[i, j]).to(torch.float8_e4m3fn)
                back[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = \
                    q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float() * scales[i, j]
        if strategy is None:
            quantized[name], quantized[name + "_scale_inv"] = q, scales if block else scales.reshape(())
        else:  # [rows, 1] per channel, [1] per tensor, [rows / b0, cols / b1] per block
            quantized[name], quantized[name + "_scale"] = q, scales if block else scales.reshape(1)
            quantized[name[: -len("weight")] + "input_scale"] = torch.tensor([0.05])
        dequantized[name] = back.to(w.dtype)
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(dequantized, str(ref / "model.safetensors"))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     **({"weight_block_size": block} if block else {})}
    if strategy is not None:
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
                   **({"block_structure": block} if strategy == "block" else {})}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": {
                "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, ref


def split_experts(src: Path, dst: Path) -> Path:
    """``src`` (transformers' fused ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I]) with
    one ``experts.{e}.{gate,up,down}_proj.weight`` per expert instead, as the released checkpoints name them."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors, out = load_file(str(src / "model.safetensors")), {}
    for name, w in tensors.items():
        if name.endswith(".experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], w.shape[1] // 2
            for e in range(w.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = w[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = w[e, inter:].contiguous()
        elif name.endswith(".experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(w.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = w[e].contiguous()
        else:
            out[name] = w
    save_file(out, str(dst / "model.safetensors"))
    return dst


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora(base: Path, dst: Path, rank: int = 4, alpha: float = 8.0, seed: int = 0,
               modules: tuple[str, ...] = LORA_MODULES, layers: tuple[int, ...] | None = None,
               use_rslora: bool = False, std: float = 0.2, config_extra: dict | None = None) -> Path:
    """A PEFT LoRA adapter for the model folder ``base`` (its config's shapes), as PEFT's ``save_pretrained``
    writes one: random A and B (B is zeros at PEFT's init; random here, so that the adapter changes the outputs).
    Returns ``dst``."""
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    tensors = {}
    for name, w in _projection_shapes(base).items():
        parts = name.split(".")
        if parts[-2] not in modules or (layers is not None and int(parts[2]) not in layers):
            continue
        g = torch.Generator().manual_seed(seed * 1000 + len(tensors))
        out_features, in_features = w
        module = name[: -len(".weight")]
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) * std
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * std
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora,
                      "target_modules": list(modules), "bias": "none", "base_model_name_or_path": str(base),
                      "task_type": "CAUSAL_LM", "model_type": config.get("model_type")}
    adapter_config.update(config_extra or {})
    (dst / "adapter_config.json").write_text(json.dumps(adapter_config))
    return dst


def _projection_shapes(base: Path) -> dict[str, tuple[int, int]]:
    from safetensors import safe_open

    with safe_open(str(base / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()
                if k.startswith("model.layers.") and k.endswith("proj.weight") and ".experts." not in k}


def merge_lora(base: Path, adapter: Path, dst: Path) -> Path:
    """``base`` with ``adapter`` merged into its weights (W + s B A, PEFT's merge_and_unload): the reference an
    adapted request's outputs must equal."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, dst)
    config = json.loads((adapter / "adapter_config.json").read_text())
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    weights = load_file(str(base / "model.safetensors"))
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        rank = a.shape[0]
        scale = config["lora_alpha"] / (rank ** 0.5 if config.get("use_rslora") else rank)
        name = key[len("base_model.model."):].replace(".lora_A.weight", ".weight")
        weights[name] = weights[name] + scale * (b @ a)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
