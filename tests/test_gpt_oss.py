"""GPT-OSS (``GptOssForCausalLM``) against transformers on the same random tiny weights (fp32, max abs diff < 1e-4):
attention sinks, alternating sliding-window layers, YaRN, the biased router and experts with the clamped SwiGLU;
tensor-parallel ranks and pipeline stages equal one rank; an MXFP4 release loads as its dequantized twin; the engine's
greedy output, plain and with n-gram drafts, equals transformers' ``generate``."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from specray.models import cpu_kernels
from specray.models.loader import load_model
from specray.models.mxfp4 import FP4_VALUES, SCALE_BIAS, dequantized
from specray_test_model_checks import (SCHEDULES, chunked_logits, max_diff, prompt,  # tests/model_checks.py
                                       run_ranks, WORKER_PRELUDE)

TOL = 1e-4
# 3 layers (sliding, full, sliding; a window of 6), 4 experts of width 32 (top 2), a SwiGLU limit of 1 that the
# gates and ups of these weights cross, YaRN (factor 4, untruncated correction range) within the positions run here
GPT_OSS_TINY = dict(num_hidden_layers=3, head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                    sliding_window=6, swiglu_limit=1.0, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 256})


@pytest.fixture(scope="module")
def tiny_gpt_oss_dir(make_tiny_model, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_gpt_oss"), "gpt_oss", seed=30, **GPT_OSS_TINY)


@pytest.fixture(scope="module")
def reference(tiny_gpt_oss_dir) -> torch.Tensor:
    """transformers' logits [PROMPT_LEN, V] of the prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_gpt_oss_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([prompt()])).logits[0].float()




@pytest.mark.parametrize("path", ["batched", "own"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_gpt_oss_dir, reference, monkeypatch, schedule, path):
    """Every position's logits equal transformers', for a prefill and for chunks + decode steps through the paged
    cache; short queries as the padded batch or one sequence at a time (sinks on folded GQA rows either way)."""
    if path == "own":
        monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 0)
    model = load_model(str(tiny_gpt_oss_dir))
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def _no_sinks(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.attn.sinks = None


def _no_clamp(model) -> None:
    for layer in model.model.layers:
        layer.mlp.swiglu = (float("inf"), layer.mlp.swiglu[1])


def _no_router_bias(model) -> None:
    for layer in model.model.layers:
        layer.mlp.router.bias = None


@pytest.mark.parametrize("ablate", [_no_sinks, _no_clamp, _no_router_bias], ids=["sinks", "clamp", "router-bias"])
def test_each_difference_from_llama_shows_in_the_logits(tiny_gpt_oss_dir, reference, ablate):
    """Without its sinks (plain SDPA), its SwiGLU clamp or its router's bias the model is far from transformers':
    the test above sees each of them."""
    model = load_model(str(tiny_gpt_oss_dir))
    ablate(model)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), reference) > 1e-2


# ---- MXFP4 ---------------------------------------------------------------------------------------------------------


def _quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' layout [E, cols, rows] -> (blocks [E, rows, cols / 32, 16] uint8, scales [E, rows, cols / 32]
    uint8, the values they stand for in the same layout as ``w``): each group of 32 scaled by the power of two that
    brings its largest magnitude within FP4's 6, each value rounded to the nearest FP4 value."""
    rows_first = w.transpose(1, 2).float()
    e, rows, cols = rows_first.shape
    groups = rows_first.reshape(e, rows, cols // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0))  # [E, rows, G]
    grid = torch.tensor(FP4_VALUES)
    codes = ((groups / torch.exp2(exponent)[..., None])[..., None] - grid).abs().argmin(-1)  # [E, rows, G, 32]
    values = grid[codes] * torch.exp2(exponent)[..., None]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # the even value in the low nibble
    scales = (exponent + SCALE_BIAS).to(torch.uint8)
    return blocks, scales, values.reshape(e, rows, cols).transpose(1, 2).contiguous()


def write_mxfp4(src: Path, dst: Path) -> tuple[Path, Path]:
    """``src``'s checkpoint as an MXFP4 release (the experts' fused weights as ``_blocks`` and ``_scales``, the
    rest as it is, ``quant_method: mxfp4`` in config.json), and its twin holding the values those stand for."""
    from safetensors.torch import load_file, save_file

    quantized, twin = dst / "mxfp4", dst / "dequantized"
    for folder in (quantized, twin):
        shutil.copytree(src, folder)
    packed, plain = {}, {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name] = plain[name] = tensor
            continue
        packed[name + "_blocks"], packed[name + "_scales"], plain[name] = _quantize_mxfp4(tensor)
    save_file(packed, str(quantized / "model.safetensors"))
    save_file(plain, str(twin / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, twin


def test_mxfp4_release_loads_as_its_dequantized_twin(tiny_gpt_oss_dir, tmp_path):
    """The experts' FP4 codes and power-of-two scales dequantize to the values they stand for: an MXFP4 release's
    logits equal (exactly) those of its twin holding those values, which differ from the unquantized model's."""
    quantized, twin = write_mxfp4(tiny_gpt_oss_dir, tmp_path)
    schedule = SCHEDULES["chunked+decode"]
    got = chunked_logits(load_model(str(quantized)), prompt(), schedule)
    assert max_diff(got, chunked_logits(load_model(str(twin)), prompt(), schedule)) < 1e-6
    assert max_diff(got, chunked_logits(load_model(str(tiny_gpt_oss_dir)), prompt(), schedule)) > 1e-3


def test_mxfp4_experts_stay_mxfp4_where_experts_are_kept(tiny_gpt_oss_dir, tmp_path, monkeypatch):
    """Where quantized experts are kept (a GPU; here asked: ``cpu_kernels.FP8_EXPERTS``), an MXFP4 release's experts
    hold its FP4 codes and E8M0 scales as stored (gate and up de-interleaved), a quarter of bf16's bytes, decoded as
    tokens reach an expert: the logits equal those of the release dequantized at load, exactly, and the engine's graph
    steps run eagerly (no grouped matmul over them). A dummy load keeps random codes over scales within its range."""
    from safetensors.torch import load_file

    from specray.models.loader import DUMMY_WEIGHT_RANGE
    from specray.models.moe import SparseMoE

    monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", True)
    quantized, _ = write_mxfp4(tiny_gpt_oss_dir, tmp_path)
    model = load_model(str(quantized))
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert len(blocks) == 3 and all(b.mxfp4 and b.w13.dtype == b.w2.dtype == torch.uint8 for b in blocks)
    assert all(b.w13.shape == (4, 64, 32) and b.w2_scale.shape == (4, 64, 1) for b in blocks)  # [E, 2I, H / 2] ...
    assert "MXFP4" in blocks[0].graph_blocker()
    stored = load_file(str(quantized / "model.safetensors"))
    fused = stored["model.layers.1.mlp.experts.gate_up_proj_blocks"][2].flatten(1)  # [2I, H / 2]: gate, up, ...
    assert torch.equal(blocks[1].w13[2], torch.cat((fused[0::2], fused[1::2])))
    assert torch.equal(blocks[1].w2[2], stored["model.layers.1.mlp.experts.down_proj_blocks"][2].flatten(1))
    schedule = SCHEDULES["chunked+decode"]
    got = chunked_logits(model, prompt(), schedule)
    dummy = [b for b in load_model(str(quantized), load_format="dummy").modules() if isinstance(b, SparseMoE)]
    decoded = torch.stack([b._weight(b.w2, b.w2_scale, e, torch.float32) for b in dummy for e in range(4)])
    assert all(b.mxfp4 for b in dummy) and DUMMY_WEIGHT_RANGE / 4 < decoded.abs().max() <= DUMMY_WEIGHT_RANGE
    monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", False)
    plain = load_model(str(quantized))
    assert not any(b.mxfp4 for b in plain.modules() if isinstance(b, SparseMoE))
    assert torch.equal(got, chunked_logits(plain, prompt(), schedule))


def test_a_rank_keeps_its_share_of_mxfp4_experts(monkeypatch):
    """Split by width over two ranks, each keeps its half of every expert's intermediate width (whole groups of 32):
    rank 1's decoded gate, up and down weights are exactly its share of the dequantized ones; a share that is not
    whole groups (16 of 32 per rank) is dequantized at load."""
    from types import SimpleNamespace

    from transformers import GptOssConfig

    from specray.models.moe import SparseMoE
    from specray.models.mxfp4 import Mxfp4Weight

    monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", True)
    g = torch.Generator().manual_seed(0)
    tensors = {"gate_up_proj": (torch.randint(0, 256, (4, 128, 2, 16), generator=g, dtype=torch.uint8),
                                torch.randint(120, 134, (4, 128, 2), generator=g, dtype=torch.uint8)),
               "down_proj": (torch.randint(0, 256, (4, 64, 2, 16), generator=g, dtype=torch.uint8),
                             torch.randint(120, 134, (4, 64, 2), generator=g, dtype=torch.uint8))}
    weights = {}
    for keep in (True, False):
        monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", keep)
        config = GptOssConfig(hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                              quantization_config={"quant_method": "mxfp4"})
        block = SparseMoE(config, SimpleNamespace(size=2, rank=1), False)
        assert block.mxfp4 == keep
        for kind, (codes, scales) in tensors.items():
            block.load_expert_tensor(f"model.layers.0.mlp.experts.{kind}", Mxfp4Weight(codes, scales))
        weights[keep] = [block._weight(w, s, e, torch.float32) for e in range(4)
                         for w, s in ((block.w13, block.w13_scale), (block.w2, block.w2_scale))]
    assert all(torch.equal(a, b) for a, b in zip(weights[True], weights[False]))
    narrow = GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                          quantization_config={"quant_method": "mxfp4"})
    monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", True)
    assert not SparseMoE(narrow, SimpleNamespace(size=2, rank=1), False).mxfp4


def test_mxfp4_blocks_without_scales_are_refused():
    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"without their blocks or scales: \['x.experts.down_proj'\]"):
        list(dequantized([("x.experts.down_proj_blocks", blocks), ("x.norm.weight", torch.ones(2))]))
    with pytest.raises(ValueError, match=r"expected uint8 \[E, rows, G, 16\]"):
        list(dequantized([("y_blocks", blocks), ("y_scales", torch.zeros(1, 2, 2, dtype=torch.uint8))]))


# ---- tensor parallel ranks and pipeline stages over gloo -------------------------------------------------------------

# one rank of two: argv is its rank, the stages (1: tensor parallel), the rendezvous port, the result's folder and the
# model folders; it writes {folder: [its layers, its heads' sinks, the diff to one rank's logits or None]}
WORKER = WORKER_PRELUDE + textwrap.dedent("""

    result = {}
    for folder in folders:  # a folder named *-ep: the experts split whole over the ranks
        cpu_kernels.FP8_EXPERTS = "-kept" in folder  # (an MXFP4 release's experts kept in MXFP4, as on a GPU)
        model = load_model(folder, tp, expert_parallel=folder.endswith("-ep"), pp=pp)
        mine = logits(model)
        diff = None if mine is None else (mine - logits(load_model(folder))).abs().max().item()
        first = model.model.layers[model.model.stage.start]
        result[folder] = [list(model.model.stage), first.self_attn.attn.sinks.shape[0], diff]
    del model, first  # gloo's threads end with the group only once nothing holds it
    gc.collect()
    dist.destroy_process_group()
    json.dump(result, open(f"{out}/{rank}.json", "w"))
""")


def _ranks(tmp_path: Path, folders: list[str], stages: int) -> list[dict]:
    """Two ranks over gloo: tensor parallel (``stages`` 1) or two pipeline stages of one rank each."""
    return run_ranks(tmp_path, WORKER, 2, stages, folders)


def test_tensor_parallel_ranks_and_pipeline_stages_match_one_rank(tiny_gpt_oss_dir, tmp_path):
    """TP 2: each rank two of the 4 heads (and their sinks), one of the 2 KV heads, the experts split by width (the
    down projection's bias added once) or whole (2 per rank), an MXFP4 release among them (dequantized, and its
    experts kept in MXFP4 whole per rank); PP 2: layers 0-1 and 2. Every rank's (the last stage's) logits equal one
    rank's."""
    ep = tmp_path / "tiny-ep"
    ep.symlink_to(tiny_gpt_oss_dir, target_is_directory=True)
    quantized, _ = write_mxfp4(tiny_gpt_oss_dir, tmp_path / "q")
    kept = tmp_path / "mxfp4-kept-ep"
    kept.symlink_to(quantized, target_is_directory=True)
    folders = [str(tiny_gpt_oss_dir), str(ep), str(quantized), str(kept)]
    (tmp_path / "tp").mkdir()
    for result in _ranks(tmp_path / "tp", folders, 1):
        for folder in folders:
            layers, heads, diff = result[folder]
            assert layers == [0, 1, 2] and heads == 2 and diff < TOL, (folder, result[folder])
    (tmp_path / "pp").mkdir()
    first, last = (r[folders[0]] for r in _ranks(tmp_path / "pp", folders[:1], 2))
    assert first == [[0, 1], 4, None] and last[:2] == [[2], 4] and last[2] < TOL, (first, last)


# ---- the engine ----------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def test_engine_greedy_with_ngram_drafts_equals_plain_and_transformers(tiny_gpt_oss_dir):
    """``specray.LLM``'s greedy tokens, with n-gram drafts verified and without, equal transformers' ``generate``
    token for token."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    plain = LLM(model=str(tiny_gpt_oss_dir), max_model_len=256)
    plain_ids = runs.token_ids(plain.generate(runs.PROMPTS, runs.greedy(), use_tqdm=False))
    spec = LLM(model=str(tiny_gpt_oss_dir), max_model_len=256, speculative_config=NGRAM)
    assert runs.token_ids(spec.generate(runs.PROMPTS, runs.greedy(), use_tqdm=False)) == plain_ids
    runs.assert_transformers_generates(tiny_gpt_oss_dir, plain.get_tokenizer(), runs.PROMPTS, plain_ids)
