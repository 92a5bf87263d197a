"""Checkpoints the loader tests write from the tiny models: an FP8 release of one (block scales, as DeepSeek's and
Qwen3's FP8 checkpoints store them) or an integer one (GPTQ, AWQ, llm-compressor's packed) beside its dequantized
twin, and a mixture of experts' fused expert tensors split into one tensor per expert (the layout of DeepSeek's and
Qwen3-MoE's releases). Imported as ``specray_test_checkpoints`` (tests/conftest.py registers it)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

FP8_BLOCK = [16, 16]


def cpu_fp8_runs() -> bool:
    """Whether this torch's CPU FP8 matmul takes one scale per row (the pinned torch's does; torch 2.11's, a GPU
    image's, takes one per tensor, and the loader then dequantizes FP8 linears on the CPU, saying why)."""
    from specray.models.w8a8 import FP8, kernel_runs

    return kernel_runs(FP8, torch.device("cpu"), torch.float32)


def skip_without_cpu_fp8(kind: str = "fp8") -> None:
    """Skip a check of row-scaled FP8 linears kept on the CPU (``kind`` an FP8 one; block-scaled ones multiply
    without that kernel on a CPU) where :func:`cpu_fp8_runs` says no."""
    import pytest

    if "fp8" in kind and "block" not in kind and not cpu_fp8_runs():
        pytest.skip(f"torch {torch.__version__}'s CPU FP8 matmul takes no per-row scales")


def static_scales(names: list[str], static: float) -> dict[str, torch.Tensor]:
    """A static release's activation scales (``X.input_scale``, one per linear) for the weights ``names``: ``static``
    times 1, 1.25 or 1.5 by turns, so that a merged linear's parts differ."""
    return {name[: -len("weight")] + "input_scale": torch.tensor([static * (1 + (i % 3) / 4)])
            for i, name in enumerate(names)}


def write_fp8(src: Path, dst: Path, block: list[int] | None = FP8_BLOCK, strategy: str | None = None,
              static: float | None = None) -> tuple[Path, Path]:
    """``src``'s checkpoint as an FP8 release (every 2-D projection weight float8 e4m3 with a float32
    ``weight_scale_inv`` per ``block``, as DeepSeek's and Qwen3's FP8 checkpoints store them; without a block,
    AutoFP8's layout: one ``weight_scale`` per tensor), and beside it the same model with those weights dequantized by
    hand (block by block, in a loop): the reference. With ``strategy`` ("channel", "tensor" or "block"),
    llm-compressor's layout instead (compressed-tensors, float-quantized): ``weight_scale`` per output row, per tensor
    or per ``block``. Activations dynamic (per token), or with ``static`` a calibrated ``input_scale`` beside each
    weight (:func:`static_scales`)."""
    if strategy is not None:
        block = {"block": block or FP8_BLOCK, "channel": [1, None], "tensor": None}[strategy]
    from safetensors.torch import load_file, save_file

    fp8, ref = dst / "fp8", dst / "dequantized"
    for folder in (fp8, ref):
        shutil.copytree(src, folder)
    tensors = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        # the projections, DeepSeek-V3.2's indexer's too (its release keeps wq_b and wk in FP8)
        if not (name.endswith(("proj.weight", "indexer.wq_b.weight", "indexer.wk.weight")) and w.dim() == 2):
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
        if strategy is None and block:
            quantized[name], quantized[name + "_scale_inv"] = q, scales
        elif strategy is None:  # AutoFP8's: a per-tensor scale named as compressed-tensors names it
            quantized[name], quantized[name + "_scale"] = q, scales.reshape(())
        else:  # [rows, 1] per channel, [1] per tensor, [rows / b0, cols / b1] per block
            quantized[name], quantized[name + "_scale"] = q, scales if block else scales.reshape(1)
        dequantized[name] = back.to(w.dtype)
    if static is not None:
        quantized.update(static_scales([n for n, t in quantized.items() if t.dtype == torch.float8_e4m3fn], static))
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(dequantized, str(ref / "model.safetensors"))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic" if static is None else
                                     "static", **({"weight_block_size": block} if block else {})}
    if strategy is not None:
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
                   **({"block_structure": block} if strategy == "block" else {})}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations("float", static)}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, ref


def activations(kind: str, static: float | None) -> dict:
    """compressed-tensors' ``input_activations`` of 8-bit ``kind`` ("float", "int"): per token at run time, or with
    ``static`` one calibrated scale per tensor."""
    return {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "token" if static is None else "tensor",
            "dynamic": static is None}


def write_int8(src: Path, dst: Path, strategy: str = "channel", static: float | None = None) -> tuple[Path, Path]:
    """``src``'s checkpoint as llm-compressor's INT8 W8A8 release (compressed-tensors, int-quantized: every 2-D
    projection weight int8, symmetric, with a ``weight_scale`` per output row or per ``strategy="tensor"``; with
    ``static``, a calibrated ``input_scale`` beside it: :func:`static_scales`), and beside it the same model with those
    weights dequantized: the reference."""
    from safetensors.torch import load_file, save_file

    q8, ref = dst / "int8", dst / "dequantized"
    for folder in (q8, ref):
        shutil.copytree(src, folder)
    quantized, dequantized = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        quantized[name] = dequantized[name] = w
        if name.endswith("proj.weight") and w.dim() == 2:
            amax = w.float().abs().amax(1, keepdim=True) if strategy == "channel" else w.float().abs().amax()
            scale = (amax.clamp_min(1e-12) / 127.0).reshape(-1, 1)  # [rows, 1], or [1, 1]
            q = (w.float() / scale).round().clamp(-127, 127).to(torch.int8)
            quantized[name], quantized[name + "_scale"] = q, scale.to(torch.bfloat16)
            dequantized[name] = (q.float() * scale.to(torch.bfloat16).float()).to(w.dtype)
    if static is not None:
        quantized.update(static_scales([n for n, t in quantized.items() if t.dtype == torch.int8], static))
    save_file(quantized, str(q8 / "model.safetensors"))
    save_file(dequantized, str(ref / "model.safetensors"))
    config = json.loads((q8 / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": False},
            "input_activations": activations("int", static)}},
        "ignore": ["lm_head"]}
    (q8 / "config.json").write_text(json.dumps(config))
    return q8, ref


FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1's magnitudes (codes 0-7; 8-15 their negatives)


def write_nvfp4(src: Path, dst: Path, layout: str = "modelopt") -> tuple[Path, Path]:
    """``src``'s checkpoint as an NVFP4 release in ``layout`` ("modelopt": NVIDIA ModelOpt's ``X.weight`` codes,
    ``weight_scale``, ``weight_scale_2`` and ``input_scale``, with FP8 KV-cache scales ``self_attn.k_proj.k_scale`` /
    ``v_proj.v_scale``; "compressed-tensors": llm-compressor's ``weight_packed``, ``weight_scale``,
    ``weight_global_scale`` (divides) and ``input_global_scale``): every 2-D projection weight in FP4 codes two a byte,
    a float8 scale per 16 columns and one float32 number per tensor, and beside it the twin holding the values those
    stand for, computed in float64 here: the reference."""
    from safetensors.torch import load_file, save_file

    quantized, twin = dst / "nvfp4", dst / "dequantized"
    for folder in (quantized, twin):
        shutil.copytree(src, folder)
    grid = torch.tensor(FP4_GRID, dtype=torch.float64)
    packed, plain = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not (name.endswith("proj.weight") and w.dim() == 2):
            packed[name] = plain[name] = w
            continue
        rows, cols = w.shape
        groups = w.double().view(rows, cols // 16, 16)
        number = float(w.abs().max()) / (448.0 * 6.0)  # the tensor's: group scales within float8's range
        scales = (groups.abs().amax(-1) / 6.0 / number).to(torch.float8_e4m3fn)  # [rows, cols / 16]
        step = (scales.double() * number).clamp_min(1e-30)[..., None]
        magnitude = ((groups.abs() / step)[..., None] - grid).abs().argmin(-1)  # [rows, G, 16]: nearest e2m1
        codes = (magnitude + 8 * (groups < 0)).to(torch.uint8).view(rows, cols)
        stored = number if layout == "modelopt" else 1.0 / number  # ModelOpt multiplies, llm-compressor divides
        multiplier = float(torch.tensor(stored, dtype=torch.float32)) if layout == "modelopt" else \
            1.0 / float(torch.tensor(stored, dtype=torch.float32))
        signed = grid[magnitude] * torch.where(groups < 0, -1.0, 1.0).double()  # [rows, G, 16], in float64
        back = (signed * scales.double()[..., None] * multiplier).view(rows, cols)
        pairs = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()  # the even column in the low nibble
        base = name[: -len("weight")]
        if layout == "modelopt":
            packed.update({base + "weight": pairs, base + "weight_scale": scales,
                           base + "weight_scale_2": torch.tensor(stored), base + "input_scale": torch.tensor(0.5)})
        else:
            packed.update({base + "weight_packed": pairs, base + "weight_scale": scales,
                           base + "weight_global_scale": torch.tensor([stored]),
                           base + "input_global_scale": torch.tensor([2.0])})
        plain[name] = back.to(w.dtype)
        if layout == "modelopt" and name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            kind = "k" if ".k_proj." in name else "v"
            packed[base + f"{kind}_scale"] = torch.tensor(0.25 if kind == "k" else 0.125)
    save_file(packed, str(quantized / "model.safetensors"))
    save_file(plain, str(twin / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    if layout == "modelopt":
        config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                         "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    else:
        nvfp4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
                 "dynamic": False}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": nvfp4,
                                          "input_activations": {**nvfp4, "dynamic": "local"}}},
            "ignore": ["lm_head"]}
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, twin


FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _e8m0(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The smallest power of two by which ``amax`` fits under ``top`` (an E8M0 scale), as float32."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-30) / top)))


def write_v4_release(src: Path, dst: Path, block: int = 128) -> tuple[Path, Path]:
    """A tiny DeepSeek-V4 folder (``src``, saved by transformers) as DeepSeek-V4's release stores it, and beside it the
    same model with those weights dequantized by hand: the reference. Each 2-D weight of the attention (its
    projections, the compressors' and indexers'), of the shared experts and of an MTP module's fusion (``e_proj``,
    ``h_proj``) as float8 e4m3 with ``X.scale``, one
    E8M0 scale per ``block`` x ``block`` block; each routed expert's weight as FP4 (int8 [out, in / 2], two e2m1
    codes a byte, the even value in the low nibble) with ``X.scale``, one E8M0 scale per 32 values of a row, the
    nearest code to each value; ``quantization_config`` as the release's (``scale_fmt: ue8m0``, ``expert_dtype:
    fp4``)."""
    from safetensors.torch import load_file, save_file

    out, ref = dst / "release", dst / "dequantized"
    for folder in (out, ref):
        shutil.copytree(src, folder)
    quantized, dequantized = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        expert = re.search(r"\.experts\.\d+\.w[123]\.weight$", name) is not None
        linear = re.search(r"\.(attn|shared_experts)\..*\.weight$|\.[eh]_proj\.weight$", name) is not None \
            and w.dim() == 2 and not name.endswith("norm.weight")
        if not (expert or linear):
            quantized[name] = dequantized[name] = w
            continue
        w, base = w.float(), name[: -len(".weight")]
        rows, cols = w.shape
        if expert:  # FP4 codes, a scale per 32 values
            groups = w.view(rows, cols // 32, 32)
            scale = _e8m0(groups.abs().amax(-1), 6.0)  # [rows, G]
            codes = ((groups / scale[..., None])[..., None] - FP4_VALUES).abs().argmin(-1)  # the nearest (ties: first)
            back = (FP4_VALUES[codes] * scale[..., None]).view(rows, cols)
            codes = codes.view(rows, cols).to(torch.uint8)
            quantized[name] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
        else:  # FP8, a scale per block
            nb0, nb1 = -(-rows // block), -(-cols // block)
            scale = torch.empty(nb0, nb1)
            q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
            back = torch.empty(rows, cols)
            for i in range(nb0):
                for j in range(nb1):
                    part = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
                    scale[i, j] = _e8m0(part.abs().max(), 448.0)
                    q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (part / scale[i, j]).to(q.dtype)
                    back[i * block:(i + 1) * block, j * block:(j + 1) * block] = \
                        q[i * block:(i + 1) * block, j * block:(j + 1) * block].float() * scale[i, j]
            quantized[name] = q
        quantized[base + ".scale"] = scale.to(torch.float8_e8m0fnu)
        dequantized[name] = back.to(w.dtype)
    save_file(quantized, str(out / "model.safetensors"))
    save_file(dequantized, str(ref / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "scale_fmt": "ue8m0", "weight_block_size": [block, block], "expert_dtype": "fp4"}
    (out / "config.json").write_text(json.dumps(config))
    return out, ref


def write_modelopt_fp8(src: Path, dst: Path) -> tuple[Path, Path]:
    """``src``'s checkpoint as NVIDIA ModelOpt's FP8 release (``quant_algo: FP8``: every 2-D projection weight e4m3
    with one float32 ``weight_scale`` per tensor and a static ``input_scale``, :func:`static_scales`), and its
    dequantized twin."""
    fp8, ref = write_fp8(src, dst, block=None, static=0.02)
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": None,
                                     "exclude_modules": ["lm_head"]}
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, ref


def assert_refused(folder: Path, cases, dropped: str, dropped_match: str) -> None:
    """The quantized release in ``folder`` is refused with a ValueError matching each case's pattern when config.json
    has that case's ``quantization_config`` (``cases``: (config, pattern) pairs), and, its config restored, with
    ``dropped_match`` once its tensor ``dropped`` is gone."""
    import pytest
    from safetensors.torch import load_file, save_file

    from specray.models.loader import load_model

    config = json.loads((folder / "config.json").read_text())
    for quant_config, match in cases:
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant_config}))
        with pytest.raises(ValueError, match=match):
            load_model(folder)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({n: t for n, t in tensors.items() if n != dropped}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=dropped_match):
        load_model(folder)


# quantization schemes of write_int: (layout, bits, group size, act order, GPTQ's format)
INT_SCHEMES = {"gptq4-g32": ("gptq", 4, 32, False, "gptq"), "gptq4-act-order-v2": ("gptq", 4, 16, True, "gptq_v2"),
               "gptq8-channel": ("gptq", 8, -1, False, "gptq"), "awq4-g32": ("awq", 4, 32, False, None),
               "w4a16-g16": ("packed", 4, 16, False, None), "w4a16-g64": ("packed", 4, 64, False, None),
               "w8a16-channel": ("packed", 8, -1, False, None),
               "w4a16-act-order": ("packed", 4, 32, True, None)}
AWQ_SLOTS = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of its eight that each slot of an AWQ int32 holds


def write_int(src: Path, dst: Path, scheme: str, seed: int = 0) -> tuple[Path, Path]:
    """``src``'s checkpoint with every 2-D projection weight quantized to integers by ``scheme`` (INT_SCHEMES), laid
    out as GPTQ, AutoAWQ or llm-compressor's pack-quantized releases store them (round to nearest per group of input
    columns, fp16 scales; asymmetric with zero points for GPTQ and AWQ, symmetric for pack-quantized), and beside it
    the same model with those weights dequantized from the stored integers: the reference."""
    from safetensors.torch import load_file, save_file

    kind, bits, group, act_order, fmt = INT_SCHEMES[scheme]
    quant_dir, ref = dst / "int", dst / "dequantized"
    for folder in (quant_dir, ref):
        shutil.copytree(src, folder)
    quantized, dequantized = {}, {}
    gen = torch.Generator().manual_seed(seed)
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not (name.endswith("proj.weight") and w.dim() == 2) or name.startswith("lm_head"):
            quantized[name] = dequantized[name] = w
            continue
        base = name[: -len(".weight")]
        cols = w.shape[1]
        size = cols if group == -1 else group
        g_idx = (torch.randperm(cols, generator=gen) if act_order else torch.arange(cols)) // size
        q, scale, zero, back = _quantize(w.float(), g_idx, bits, symmetric=kind == "packed")
        quantized.update(_int_tensors(kind, base, q, scale, zero, g_idx, bits, act_order, fmt, w.shape))
        dequantized[name] = back.to(w.dtype)
    save_file(quantized, str(quant_dir / "model.safetensors"))
    save_file(dequantized, str(ref / "model.safetensors"))
    config = json.loads((quant_dir / "config.json").read_text())
    config["quantization_config"] = _int_config(kind, bits, group, act_order, fmt)
    (quant_dir / "config.json").write_text(json.dumps(config))
    return quant_dir, ref


def _quantize(w: torch.Tensor, g_idx: torch.Tensor, bits: int, symmetric: bool):
    """w [out, in] -> q [out, in] (unsigned, in [0, 2^bits)), fp16 scales and integer zero points [out, groups],
    and w back from them; each (row, group of columns) quantized on its own, the scale stored in fp16 first."""
    groups = int(g_idx.max()) + 1
    top = (1 << bits) - 1
    scale, zero = torch.empty(w.shape[0], groups), torch.empty(w.shape[0], groups)
    for k in range(groups):
        part = w[:, g_idx == k]
        if symmetric:
            scale[:, k] = part.abs().amax(1).clamp_min(1e-6) / (top // 2)
            zero[:, k] = (top + 1) // 2
        else:
            lo, hi = part.amin(1).clamp_max(0), part.amax(1).clamp_min(0)
            scale[:, k] = ((hi - lo) / top).clamp_min(1e-6)
            zero[:, k] = (-lo / scale[:, k].half().float()).round().clamp(0, top)
    scale = scale.half()
    s, z = scale.float()[:, g_idx], zero[:, g_idx]
    q = (w / s).round().add(z).clamp(0, top)
    return q.long(), scale, zero.long(), (q - z) * s


def _pack(values: torch.Tensor, bits: int, dim: int, slots=None) -> torch.Tensor:
    """Unsigned ``values`` packed 32 / bits per int32 along ``dim``, the i-th slot (lowest bits first) holding value
    ``slots[i]`` of each run (default: in order)."""
    per = 32 // bits
    values = values.movedim(dim, -1)
    runs = values.reshape(*values.shape[:-1], values.shape[-1] // per, per).long()
    packed = torch.zeros(runs.shape[:-1], dtype=torch.long)
    for i, j in enumerate(slots or range(per)):
        packed |= runs[..., j] << (bits * i)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed)  # as int32 holds those bits
    return packed.to(torch.int32).movedim(-1, dim).contiguous()


def _int_tensors(kind, base, q, scale, zero, g_idx, bits, act_order, fmt, shape) -> dict[str, torch.Tensor]:
    if kind == "packed":
        out = {f"{base}.weight_packed": _pack(q, bits, 1), f"{base}.weight_scale": scale,
               f"{base}.weight_shape": torch.tensor(list(shape))}
        return out | ({f"{base}.weight_g_idx": g_idx.int()} if act_order else {})
    stored_zero = zero - (1 if fmt == "gptq" else 0)  # GPTQ's first format stores z - 1
    if kind == "awq":
        return {f"{base}.qweight": _pack(q.t(), bits, 1, AWQ_SLOTS),
                f"{base}.qzeros": _pack(zero.t(), bits, 1, AWQ_SLOTS), f"{base}.scales": scale.t().contiguous()}
    return {f"{base}.qweight": _pack(q.t(), bits, 0), f"{base}.qzeros": _pack(stored_zero.t(), bits, 1),
            f"{base}.scales": scale.t().contiguous(), f"{base}.g_idx": g_idx.int()}


def _int_config(kind, bits, group, act_order, fmt) -> dict:
    if kind == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": False,
                "checkpoint_format": fmt}
    if kind == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group" if group > 0 else "channel",
               "group_size": group if group > 0 else None, "actorder": "group" if act_order else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}, "ignore": ["lm_head"]}


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
        if parts[-2] not in modules or (layers is not None and _layer_of(name) not in layers):
            continue
        g = torch.Generator().manual_seed(seed * 1000 + len(tensors))
        out_features, in_features = w[::-1] if _is_conv1d(config, name) else w
        module = name[: -len(".weight")]
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) * std
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * std
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    # (modules=(): the config of tensors the caller writes, of any linear layers)
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora,
                      "target_modules": list(modules) or "all-linear", "bias": "none",
                      "base_model_name_or_path": str(base), "task_type": "CAUSAL_LM",
                      "model_type": config.get("model_type")}
    adapter_config.update(config_extra or {})
    (dst / "adapter_config.json").write_text(json.dumps(adapter_config))
    return dst


def _is_conv1d(config: dict, name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a GPT-2 Conv1D weight, stored [in, out]."""
    return config.get("model_type") == "gpt2" and re.search(r"\.(?:c_attn|c_proj|c_fc)\.weight$", name) is not None


def _layer_of(name: str) -> int:
    """The decoder layer of a checkpoint name (``model.layers.3.``, ``transformer.h.3.``, ``decoder.layers.3.``,
    ``transformer.blocks.3.``)."""
    return int(re.search(r"\.(?:layers|h|blocks)\.(\d+)\.", name).group(1))


# the names of the projections an adapter may adapt: Llama's (*proj; Granite's shared MLP: *_linear), Phi's, GPT-J's,
# OPT's, GPT-NeoX's, Falcon's, BLOOM's, GPT-2's and MPT's own
_PROJECTIONS = re.compile(r"^(?:model\.(?:decoder\.)?layers|transformer\.(?:h|blocks)|gpt_neox\.layers)\.\d+\..*(?:proj"
                          r"|_linear|\.dense|\.fc1|\.fc2|\.fc_in|\.fc_out|\.query_key_value|\.dense_h_to_4h"
                          r"|\.dense_4h_to_h|\.c_attn|\.c_fc|\.Wqkv)"
                          r"\.weight$")


def _projection_shapes(base: Path) -> dict[str, tuple[int, int]]:
    from safetensors import safe_open

    with safe_open(str(base / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()
                if _PROJECTIONS.match(k) and ".experts." not in k and ".block_sparse_moe." not in k}


def merge_lora(base: Path, adapter: Path, dst: Path) -> Path:
    """``base`` with ``adapter`` merged into its weights (W + s B A, PEFT's merge_and_unload): the reference an
    adapted request's outputs must equal."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, dst)
    config = json.loads((adapter / "adapter_config.json").read_text())
    base_config = json.loads((base / "config.json").read_text())
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    weights = load_file(str(base / "model.safetensors"))
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        rank = a.shape[0]
        scale = config["lora_alpha"] / (rank ** 0.5 if config.get("use_rslora") else rank)
        name = key[len("base_model.model."):].replace(".lora_A.weight", ".weight")
        delta = scale * (b @ a)
        weights[name] = weights[name] + (delta.t() if _is_conv1d(base_config, name) else delta)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def gguf_blocks(x, type_name: str):
    """``x`` [rows, cols] (float32 numpy) as llama.cpp stores it in ``type_name`` (uint8 [rows, bytes]): gguf-py's
    quantizer where it has one (Q4_0, Q4_1, Q8_0, ...), else (Q4_K, which gguf-py cannot write) :func:`q4_k_blocks`."""
    import gguf
    from gguf import quants

    if type_name == "Q4_K":
        return q4_k_blocks(x)
    return quants.quantize(x, gguf.GGMLQuantizationType[type_name])


def q4_k_blocks(x):
    """``x`` [rows, cols] (float32 numpy, cols a multiple of 256) in llama.cpp's Q4_K blocks, rounded to nearest (a
    plain quantizer of our own: llama.cpp's searches its scales; what the tests need is a valid file): each run of
    32 columns gets a 6-bit scale and min of its super-block's f16 ``d`` and ``dmin``, ``x ~ d sc q - dmin mn``."""
    import numpy as np

    rows = x.shape[0]
    sub = x.reshape(rows, -1, 8, 32).astype(np.float32)  # [rows, supers, sub-block, column]
    low = np.minimum(sub.min(-1), 0)  # the mins are subtracted: at most 0
    step = np.maximum((sub.max(-1) - low) / 15, 1e-8)
    d = (step.max(-1) / 63).astype(np.float16)  # [rows, supers]
    dmin = (np.maximum(-low.min(-1), 1e-8) / 63).astype(np.float16)
    sc = np.clip(np.rint(step / d[..., None].astype(np.float32)), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / dmin[..., None].astype(np.float32)), 0, 63).astype(np.uint8)
    scale = d[..., None].astype(np.float32) * sc
    offset = dmin[..., None].astype(np.float32) * mn
    q = np.clip(np.rint((sub + offset[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    packed = np.zeros((rows, q.shape[1], 12), dtype=np.uint8)  # sub-blocks 0-3 whole, 4-7 split over the bytes
    packed[..., 0:4] = sc[..., :4] | (sc[..., 4:] >> 4) << 6
    packed[..., 4:8] = mn[..., :4] | (mn[..., 4:] >> 4) << 6
    packed[..., 8:12] = (sc[..., 4:] & 15) | (mn[..., 4:] & 15) << 4
    chunks = q.reshape(rows, -1, 4, 2, 32)  # each 64-column chunk: its first 32 in the low bits, next 32 high
    qs = (chunks[..., 0, :] | chunks[..., 1, :] << 4).reshape(rows, -1, 128)
    heads = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8)], axis=-1)
    return np.concatenate([heads.reshape(rows, -1, 4), packed, qs], axis=-1).reshape(rows, -1)
