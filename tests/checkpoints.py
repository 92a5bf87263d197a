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


def write_fp8(src: Path, dst: Path, block: list[int] | None = FP8_BLOCK) -> tuple[Path, Path]:
    """``src``'s checkpoint as an FP8 release (every 2-D projection weight float8 e4m3 with a float32
    ``weight_scale_inv`` per ``block``, as DeepSeek's and Qwen3's FP8 checkpoints store them), and beside it the
    same model with those weights dequantized by hand (block by block, in a loop): the reference."""
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
        b0, b1 = block or (rows, cols)
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
        quantized[name], quantized[name + "_scale_inv"] = q, scales if block else scales.reshape(())
        dequantized[name] = back.to(w.dtype)
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(dequantized, str(ref / "model.safetensors"))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     **({"weight_block_size": block} if block else {})}
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
