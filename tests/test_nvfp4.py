"""NVFP4 releases (``specray.models.nvfp4``): NVIDIA ModelOpt's (``quant_method: modelopt``, ``quant_algo: NVFP4``)
and llm-compressor's (``nvfp4-pack-quantized``) load dequantized, to the values their FP4 codes, float8 group scales
and per-tensor numbers stand for; ModelOpt's FP8 releases load as AutoFP8's do (a scale per tensor, static
activation scales)."""

from __future__ import annotations

import json

import pytest
import torch

from specray.models.loader import load_model
from specray_test_model_checks import prefill_logits  # tests/model_checks.py
from specray_test_checkpoints import (assert_refused, cpu_fp8_runs, split_experts,  # tests/checkpoints.py
                                      write_modelopt_fp8, write_nvfp4)

IDS = list(range(3, 40))


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_moe_dir"])
def test_an_nvfp4_release_loads_as_its_dequantized_twin(request, tmp_path, fixture, layout):
    """Every projection (a mixture's experts one tensor each) stored as FP4 codes two a byte, a float8 scale per 16
    columns and a float32 number per tensor (ModelOpt's multiplies, llm-compressor's divides): the logits equal those
    of the twin holding the values they stand for (computed in float64 there: within float32's last bits), and differ
    from the unquantized model's; the activation scales are dropped, and ModelOpt's KV-cache scales reach the
    attention."""
    src = request.getfixturevalue(fixture)
    if fixture == "tiny_qwen3_moe_dir":
        src = split_experts(src, tmp_path / "split")
    quantized, twin = write_nvfp4(src, tmp_path / "q", layout)
    model = load_model(quantized)
    got, want = prefill_logits(model, IDS), prefill_logits(load_model(twin), IDS)
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    assert (got - prefill_logits(load_model(src), IDS)).abs().max() > 1e-3
    attn = model.model.layers[0].self_attn.attn
    assert (attn.k_scale, attn.v_scale) == ((0.25, 0.125) if layout == "modelopt" else (1.0, 1.0))


def test_nvfp4_errors_name_the_fix(tiny_llama_dir, tmp_path):
    """A linear without its per-tensor number, another ModelOpt algorithm, groups other than 16: ValueErrors naming
    what is wrong."""
    quantized, _ = write_nvfp4(tiny_llama_dir, tmp_path / "q")
    quant = json.loads((quantized / "config.json").read_text())["quantization_config"]
    assert_refused(quantized, (({**quant, "quant_algo": "W4A8_AWQ"}, "quant_algo='W4A8_AWQ'"),
                               ({**quant, "group_size": 32}, "group_size=32: NVFP4 groups are 16")),
                   "model.layers.1.mlp.down_proj.weight_scale_2",
                   r"without all their tensors.*model\.layers\.1\.mlp\.down_proj.*weight_scale_2")


def test_modelopt_fp8_loads_as_autofp8(tiny_llama_dir, tmp_path, monkeypatch):
    """ModelOpt's FP8 release (a float8 weight with one scale per tensor, a static input_scale): dequantized, its
    logits are its twin's exactly; where FP8 linears are kept (a GPU; here asked), they are, each with its release's
    static activation scale; an older export's config in hf_quant_config.json alone too. ``quantization="modelopt"``
    names it."""
    from specray.models import cpu_kernels
    from specray.models.loader import check_quantization, read_config
    from specray.models.w8a8 import W8A8Linear

    fp8, ref = write_modelopt_fp8(tiny_llama_dir, tmp_path)
    assert torch.equal(prefill_logits(load_model(fp8), IDS), prefill_logits(load_model(ref), IDS))
    monkeypatch.setattr(cpu_kernels, "FP8_WEIGHTS", True)
    count = 8 if cpu_fp8_runs() else 0  # (a torch whose CPU FP8 matmul takes no per-row scales dequantizes them)
    kept = [m.kept for m in load_model(fp8).modules() if isinstance(getattr(m, "kept", None), W8A8Linear)]
    assert len(kept) == count and all(k.input_scale is not None for k in kept)
    check_quantization("modelopt", read_config(fp8))
    with pytest.raises(ValueError, match="quantization='gptq' but the checkpoint has quantization_config.quant_method"):
        check_quantization("gptq", read_config(fp8))
    # an older export: the config in hf_quant_config.json alone
    config = json.loads((fp8 / "config.json").read_text())
    quant = config.pop("quantization_config")
    (fp8 / "config.json").write_text(json.dumps(config))
    (fp8 / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.19.0"},
                                                          "quantization": {k: v for k, v in quant.items()
                                                                           if k != "quant_method"}}))
    kept = [m.kept for m in load_model(fp8).modules() if isinstance(getattr(m, "kept", None), W8A8Linear)]
    assert len(kept) == count and all(k.input_scale is not None for k in kept)
    check_quantization("modelopt", read_config(fp8))  # (read as config.json's would be)


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_nvfp4_experts_stay_nvfp4_where_experts_are_kept(tiny_qwen3_moe_dir, tmp_path, monkeypatch, layout):
    """Where quantized experts are kept (a GPU; here asked: ``cpu_kernels.FP8_EXPERTS``), an NVFP4 mixture's experts
    (a tensor each) hold their FP4 codes as stored and each group's float32 scale (its float8 scale times the tensor's
    number), decoded as tokens reach an expert: the logits equal those of the release dequantized at load, exactly.
    Split by width over two ranks, each keeps its half of every expert (whole groups of 16): rank 1's decoded weights
    are exactly its share of the dequantized ones. A dummy load keeps random codes within its range."""
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from specray.models import cpu_kernels
    from specray.models.loader import DUMMY_WEIGHT_RANGE, read_config
    from specray.models.moe import SparseMoE
    from specray.models.nvfp4 import Nvfp4Weight

    quantized, _ = write_nvfp4(split_experts(tiny_qwen3_moe_dir, tmp_path / "split"), tmp_path / "q", layout)
    monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", True)
    model = load_model(quantized)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert blocks and all(b.nvfp4 and b.w13.dtype == torch.uint8 and b.w13_scale.dtype == torch.float32
                          for b in blocks)
    assert "NVFP4" in blocks[0].graph_blocker()
    stored = load_file(str(quantized / "model.safetensors"))
    codes = "weight" if layout == "modelopt" else "weight_packed"
    assert torch.equal(blocks[0].w2[3], stored[f"model.layers.0.mlp.experts.3.down_proj.{codes}"])
    got = prefill_logits(model, IDS)
    dummy = [b for b in load_model(quantized, load_format="dummy").modules() if isinstance(b, SparseMoE)]
    decoded = torch.stack([b._weight(b.w2, b.w2_scale, e, torch.float32) for b in dummy for e in range(8)])
    assert DUMMY_WEIGHT_RANGE / 4 < decoded.abs().max() <= DUMMY_WEIGHT_RANGE
    # rank 1 of 2, split by width: its half of each expert, kept and dequantized alike
    config = read_config(quantized)
    names = {kind: f"model.layers.0.mlp.experts.{{}}.{kind}.weight" for kind in ("gate_proj", "up_proj", "down_proj")}
    suffix = ("weight_scale", "weight_scale_2") if layout == "modelopt" else ("weight_scale", "weight_global_scale")
    weights = {}
    for keep in (True, False):
        monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", keep)
        block = SparseMoE(config, SimpleNamespace(size=2, rank=1), False)
        assert block.nvfp4 == keep and block.inter_local == 16
        for e in range(8):
            for kind, name in names.items():
                base = name.format(e)[: -len("weight")]
                number = float(stored[base + suffix[1]].reshape(-1)[0])
                block.load_expert_tensor(name.format(e), Nvfp4Weight(
                    stored[base + codes], stored[base + suffix[0]], number if layout == "modelopt" else 1.0 / number))
        weights[keep] = [block._weight(w, s, e, torch.float32) for e in range(8)
                         for w, s in ((block.w13, block.w13_scale), (block.w2, block.w2_scale))]
    assert all(torch.equal(a, b) for a, b in zip(weights[True], weights[False]))
    monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", False)
    assert torch.equal(got, prefill_logits(load_model(quantized), IDS))
