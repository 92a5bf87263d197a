"""Linears kept in 8 bits and multiplied in 8 bits (``specray.models.w8a8``: W8A8, as vLLM runs llm-compressor's
``-FP8-dynamic`` and ``-quantized.w8a8`` releases): FP8 through torch's scaled matmul, INT8 through its integer
matmul. A GPU keeps them; this CPU keeps them when asked (``cpu_kernels.FP8_WEIGHTS`` / ``INT8_WEIGHTS``), running
the same math through torch's CPU kernels."""

from __future__ import annotations

import pytest
import torch

from specray.models.layers import LinearBase
from specray.models.loader import load_model
from specray.models.w8a8 import (FP8, INT8, RowScaled, RowScaledStaging, W8A8Linear, keeps_w8a8, pack_w8a8,
                                 quantize_rows)
from specray_test_model_checks import prefill_logits  # tests/model_checks.py
from specray_test_checkpoints import skip_without_cpu_fp8, write_fp8, write_int8  # tests/checkpoints.py

IDS = list(range(3, 40))
FORMATS = {"fp8": FP8, "int8": INT8, "fp8-static": FP8, "autofp8-static": FP8, "int8-static": INT8}


@pytest.fixture
def w8a8_weights(monkeypatch):
    """Keep W8A8 linears on this CPU as a GPU does (on CPU they are dequantized at load by default)."""
    from specray.models import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "FP8_WEIGHTS", True)
    monkeypatch.setattr(cpu_kernels, "INT8_WEIGHTS", True)


def write(kind: str, src, dst, strategy: str = "channel"):
    """A release of ``kind`` ("fp8", "int8"; "-static": with static activation scales, "autofp8-static": AutoFP8's
    layout, a scale per tensor; "fp8-block": block-scaled) scaled by ``strategy``, and its dequantized twin."""
    static = 0.02 if kind.endswith("-static") else None
    if kind == "fp8-block":  # blocks of 16 rows by 32 columns (DeepSeek's layout; its blocks are 128 x 128)
        return write_fp8(src, dst, [16, 32])
    if kind == "autofp8-static":
        return write_fp8(src, dst, block=None, static=static)
    if kind.startswith("fp8"):
        return write_fp8(src, dst, strategy=strategy, static=static)
    return write_int8(src, dst, strategy, static=static)


def kept_linears(model) -> list:
    return [m for m in model.modules() if isinstance(getattr(m, "kept", None), W8A8Linear)]


def projections(model) -> list:
    return [m for name, m in model.named_modules() if name.endswith("proj") and isinstance(m, LinearBase)]


def rounded_activations(model, fmt, static: dict | None = None):
    """``model`` (dense weights) with every projection's input rounded as the 8-bit matmul rounds it: each row to
    ``fmt`` over its own scale max|x_row| / R, or over ``static``'s scale for its name, then scaled back."""
    def round_rows(scale):
        def hook(module, args):
            xq, s = quantize_rows(args[0], fmt, scale)
            return ((xq.float() * s).to(args[0].dtype), *args[1:])
        return hook

    for name, module in model.named_modules():
        if module in projections(model):
            module.register_forward_pre_hook(round_rows(None if static is None else static[name]))
    return model


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_the_matmul_is_the_stated_math(kind):
    """Each row of x is quantized with its own scale max|x_row| / R (448 for e4m3, 127 for int8) and
    y = (xq Wq^T) s_x s_w: equal to that formula computed by hand in float32, each row's output the same alone as in
    a batch (within float32's sums), within the activations' rounding of the dense product but not equal to it; a
    weight the kernel cannot take (a side not a multiple of 16) is not packed."""
    skip_without_cpu_fp8(kind)
    fmt = FORMATS[kind]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g)
    scale = w.abs().amax(1) / fmt.max
    rows = RowScaled(fmt.round(w / scale[:, None]), scale, fmt)
    kept = pack_w8a8(rows, torch.device("cpu"))
    x = torch.randn(5, 64, generator=g) * torch.tensor([[0.1], [1.0], [10.0], [3.0], [0.01]])
    y = kept.matmul(x)
    s_x = x.abs().amax(1, keepdim=True) / fmt.max
    xq = fmt.round(x / s_x).float()
    by_hand = (xq * s_x) @ rows.dense().t()
    assert (y - by_hand).abs().max() <= 1e-5 * by_hand.abs().max()
    assert all((kept.matmul(x[i: i + 1])[0] - y[i]).abs().max() <= 1e-6 * y[i].abs().max() for i in range(5))
    dense = x @ rows.dense().t()
    error = ((y - dense).abs().amax(1) / dense.abs().amax(1)).max()
    assert 0 < error < 0.1, error
    assert pack_w8a8(rows.rows(0, 40), torch.device("cpu")) is None  # 40 rows
    assert pack_w8a8(rows.cols(0, 24), torch.device("cpu")) is None  # 24 columns


def test_which_devices_keep_them(w8a8_weights, monkeypatch, caplog):
    """CUDA in bfloat16 with FP8 tensor cores (capability 8.9 and up) for FP8; for INT8 from 7.5, bfloat16 or
    float16; not an older GPU or another dtype; a CPU only when asked (the fixture asks); anywhere only where torch's
    kernel runs (tried once: a torch without it dequantizes them, saying why)."""
    skip_without_cpu_fp8()
    import logging

    from specray.models import cpu_kernels, w8a8

    cpu = torch.device("cpu")
    assert w8a8.kernel_runs(FP8, cpu, torch.float32) and w8a8.kernel_runs(INT8, cpu, torch.float32)
    monkeypatch.setattr(w8a8, "_RUNS", {})

    def unsupported(*args, **kwargs):
        raise RuntimeError("scaled_mm is not supported here\nsecond line")

    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="specray.models.w8a8"):
        m.setattr(torch, "_scaled_mm", unsupported)
        assert not keeps_w8a8(FP8, cpu, torch.float32) and not keeps_w8a8(FP8, cpu, torch.float32)
        assert keeps_w8a8(INT8, cpu, torch.float32)
    assert [r.getMessage() for r in caplog.records] == [
        f"FP8 linears are dequantized at load on cpu: torch {torch.__version__}'s FP8 matmul does not run there "
        "(scaled_mm is not supported here)"]
    monkeypatch.setattr(w8a8, "_RUNS", {})
    monkeypatch.setattr(w8a8, "kernel_runs", lambda fmt, device, dtype: True)  # (no GPU here to try them on)
    cuda = torch.device("cuda")
    assert keeps_w8a8(FP8, cuda, torch.bfloat16, (9, 0)) and keeps_w8a8(FP8, cuda, torch.bfloat16, (8, 9))
    assert not keeps_w8a8(FP8, cuda, torch.bfloat16, (8, 0)) and not keeps_w8a8(FP8, cuda, torch.float16, (9, 0))
    assert keeps_w8a8(INT8, cuda, torch.float16, (8, 0)) and keeps_w8a8(INT8, cuda, torch.bfloat16, (7, 5))
    assert not keeps_w8a8(INT8, cuda, torch.float16, (7, 0)) and not keeps_w8a8(INT8, cuda, torch.float32, (9, 0))
    assert keeps_w8a8(FP8, cpu, torch.float32) and keeps_w8a8(INT8, cpu, torch.float32)
    monkeypatch.setattr(cpu_kernels, "FP8_WEIGHTS", False)
    assert not keeps_w8a8(FP8, cpu, torch.float32) and keeps_w8a8(INT8, cpu, torch.float32)


@pytest.mark.parametrize("kind,strategy", [("fp8", "channel"), ("fp8", "tensor"), ("int8", "channel"),
                                           ("int8", "tensor")])
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_moe_dir"])
def test_a_row_scaled_release_keeps_its_linears_in_8_bits(request, tmp_path, fixture, kind, strategy, w8a8_weights,
                                                          monkeypatch):
    """An llm-compressor FP8 or INT8 W8A8 release scaled per output row or per tensor: every projection (a merged
    q/k/v's and gate/up's parts each with its own scale) is kept as the checkpoint stores it, no dense weight
    allocated, its values the stored 8-bit ones and its scales the stored ones by row; the logits are those of the
    dequantized checkpoint with each projection's input rounded as the 8-bit matmul rounds it (a dense model's
    within a tenth of what that rounding changes, a mixture's within half), and differ from the plain dequantized
    checkpoint's by that rounding. Experts stay as they were, the LM
    head is dense. Not asked to keep them, the CPU dequantizes them, to the dequantized checkpoint's logits exactly.
    An FP8 release with block scales is dequantized either way."""
    skip_without_cpu_fp8(kind)
    from safetensors.torch import load_file

    from specray.models import cpu_kernels

    fmt = FORMATS[kind]
    folder, ref = write(kind, request.getfixturevalue(fixture), tmp_path, strategy)
    dequantized = prefill_logits(load_model(ref), IDS)
    want = prefill_logits(rounded_activations(load_model(ref), fmt), IDS)
    model = load_model(folder)
    kept = kept_linears(model)
    assert len(kept) >= 2 * model.config.num_hidden_layers and kept == projections(model)  # (experts: no modules)
    assert all(m.weight.numel() == 0 and m.kept.weight.dtype == fmt.dtype for m in kept)
    stored = load_file(str(folder / "model.safetensors"))
    o_proj = model.model.layers[0].self_attn.o_proj.kept
    assert torch.equal(o_proj.weight, stored["model.layers.0.self_attn.o_proj.weight"])
    scale = stored["model.layers.0.self_attn.o_proj.weight_scale"].float().reshape(-1)
    assert torch.equal(o_proj.scale.reshape(-1), scale.expand(o_proj.weight.shape[0]))
    got = prefill_logits(model, IDS)
    rounding = (got - dequantized).abs().max()  # what rounding the activations changes
    # (a mixture's router turns float32's last bits into a choice of experts: there an input a hair from a rounding
    # boundary, rounded the other way, may send a token elsewhere, so only the order of the difference holds)
    bound = 0.1 if fixture == "tiny_llama_dir" else 0.5
    assert (got - want).abs().max() < bound * rounding and rounding > 1e-3 * want.abs().max()
    monkeypatch.setattr(cpu_kernels, f"{fmt.name}_WEIGHTS", False)
    plain = load_model(folder)
    assert not kept_linears(plain) and torch.equal(prefill_logits(plain, IDS), dequantized)
    if kind == "fp8":
        monkeypatch.setattr(cpu_kernels, "FP8_WEIGHTS", True)
        blocked, _ = write_fp8(request.getfixturevalue(fixture), tmp_path / "block", strategy="block")
        assert not kept_linears(load_model(blocked))


def test_a_static_scale_is_the_stated_math():
    """A release's static activation scale s_in: every row is x / s_in rounded to the format, values past R * s_in
    clamped, and y = (xq Wq^T) s_in s_w: equal to that formula by hand, a row's output the same alone as in a batch,
    and not what each row's own scale gives. A merged linear's parts staged with different scales keep the largest
    for all of them; a part without one does not fit beside them."""
    skip_without_cpu_fp8()
    g = torch.Generator().manual_seed(1)
    for fmt in (FP8, INT8):
        w = torch.randn(48, 64, generator=g)
        scale = w.abs().amax(1) / fmt.max
        rows = RowScaled(fmt.round(w / scale[:, None]), scale, fmt, torch.tensor(0.01))
        kept = pack_w8a8(rows, torch.device("cpu"))
        x = torch.randn(5, 64, generator=g) * torch.tensor([[0.1], [1.0], [10.0], [3.0], [0.01]])
        assert (x.abs() > fmt.max * 0.01).any()  # (some values clamped)
        y = kept.matmul(x)
        by_hand = (fmt.round((x / 0.01).clamp(-fmt.max, fmt.max)).float() * 0.01) @ rows.dense().t()
        assert (y - by_hand).abs().max() <= 1e-5 * by_hand.abs().max()
        assert all((kept.matmul(x[i: i + 1])[0] - y[i]).abs().max() <= 1e-6 * y[i].abs().max() for i in range(5))
        dynamic = pack_w8a8(RowScaled(rows.weight, scale, fmt), torch.device("cpu")).matmul(x)
        assert (dynamic - y).abs().max() > 1e-2 * y.abs().max()
    stage = RowScaledStaging(96, 64, FP8, static=True)
    for offset, s in ((0, 0.01), (48, 0.03)):
        stage.put(offset, RowScaled(torch.zeros(48, 64).to(FP8.dtype), torch.ones(48), FP8, torch.tensor(s)))
    assert float(stage.kept(torch.device("cpu"), torch.float32).input_scale) == pytest.approx(0.03)
    assert not stage.fits(RowScaled(torch.zeros(48, 64).to(FP8.dtype), torch.ones(48), FP8), 48)


@pytest.mark.parametrize("kind", ["fp8-static", "autofp8-static", "int8-static"])
def test_a_static_release_rounds_activations_over_its_scales(tiny_llama_dir, tmp_path, kind, w8a8_weights,
                                                           monkeypatch):
    """A release with static activation scales (llm-compressor's ``-FP8`` and INT8 ones with ``dynamic: false``,
    AutoFP8's ``activation_scheme: static`` with a ``weight_scale`` per tensor): every kept linear holds its stored
    ``input_scale``, a merged one the largest of its parts'; the logits are those of the dequantized checkpoint with
    each projection's input rounded over that scale (within a tenth of what the rounding changes), nearer them than
    to rounding each row over its own scale. Not kept, it loads dequantized, to the dequantized logits exactly. A
    linear whose input_scale is missing is a ValueError naming it."""
    skip_without_cpu_fp8(kind)
    from safetensors.torch import load_file, save_file

    from specray.models import cpu_kernels

    fmt = FORMATS[kind]
    folder, ref = write(kind, tiny_llama_dir, tmp_path)
    model = load_model(folder)
    stored = load_file(str(folder / "model.safetensors"))
    layer = model.model.layers[0]

    def stored_scale(*names):
        return max(float(stored[f"model.layers.0.{n}.input_scale"]) for n in names)

    assert float(layer.self_attn.qkv_proj.kept.input_scale) == stored_scale(*(f"self_attn.{p}_proj" for p in "qkv"))
    assert float(layer.self_attn.o_proj.kept.input_scale) == stored_scale("self_attn.o_proj")
    assert float(layer.mlp.gate_up_proj.kept.input_scale) == stored_scale("mlp.gate_proj", "mlp.up_proj")
    assert stored_scale("mlp.gate_proj") != stored_scale("mlp.up_proj")
    kept = kept_linears(model)
    assert kept == projections(model) and all(m.kept.input_scale is not None for m in kept)
    static = {name: m.kept.input_scale for name, m in model.named_modules() if m in kept}
    dequantized = prefill_logits(load_model(ref), IDS)
    want = prefill_logits(rounded_activations(load_model(ref), fmt, static), IDS)
    per_row = prefill_logits(rounded_activations(load_model(ref), fmt), IDS)
    got = prefill_logits(model, IDS)
    rounding = (got - dequantized).abs().max()
    assert (got - want).abs().max() < 0.1 * rounding and rounding > 1e-3 * want.abs().max()
    assert (got - per_row).abs().max() > 2 * (got - want).abs().max()
    monkeypatch.setattr(cpu_kernels, f"{fmt.name}_WEIGHTS", False)
    plain = load_model(folder)
    assert not kept_linears(plain) and torch.equal(prefill_logits(plain, IDS), dequantized)
    monkeypatch.setattr(cpu_kernels, f"{fmt.name}_WEIGHTS", True)
    save_file({n: t for n, t in stored.items() if n != "model.layers.1.mlp.down_proj.input_scale"},
              str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj.*input"):
        load_model(folder)


@pytest.mark.parametrize("kind", ["fp8", "int8", "fp8-static", "fp8-block"])
def test_engine_speculative_greedy_equals_plain_over_8_bit_linears(tiny_llama_dir, tmp_path, w8a8_weights, kind):
    """The engine over kept 8-bit linears: n-gram drafts (some accepted, some not) give plain greedy decoding's tokens
    (each row's activations are quantized with its own scales, or a static release's, so a verify chunk's rows are
    those plain decoding computes), eagerly and from step graphs, block-scaled ones too; a dummy load keeps random
    8-bit linears as a checkpoint's would be."""
    skip_without_cpu_fp8(kind)
    from specray import LLM, SamplingParams

    folder, _ = write(kind, tiny_llama_dir, tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 5, 6, 7, 5, 6], list(range(20, 50)), [9, 9, 9, 9])]
    outs = {}
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False}
    for spec, eager in ((None, True), (ngram, True), (ngram, False)):
        # (on the CPU, where the fixture keeps them: a GPU keeps them in bf16 alone, test_a_gpu_keeps_them_by_default)
        with LLM(model=str(folder), max_model_len=128, speculative_config=spec, enforce_eager=eager,
                 device="cpu") as llm:
            outs[spec is None, eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            worker = llm.engine.executor.worker
            assert (block_kept(worker.model) if kind == "fp8-block" else kept_linears(worker.model))
            assert bool(worker.runner.graphs and worker.runner.graphs.graphs) != eager
            if spec is not None:
                assert 0 < llm.spec_stats.accepted_tokens < llm.spec_stats.draft_tokens, llm.spec_stats
    assert outs[True, True] == outs[False, True] == outs[False, False]
    dummy = load_model(folder, load_format="dummy")
    if kind == "fp8-block":
        assert len(block_kept(dummy)) == 8 and {m.kept.block for m in block_kept(dummy).values()} == {(16, 32)}
    else:
        assert len(kept_linears(dummy)) == 8 and {m.kept.fmt for m in kept_linears(dummy)} == {FORMATS[kind]}


def test_int8_releases_other_than_symmetric_rows_are_refused(tiny_llama_dir, tmp_path):
    """An INT8 W8A8 release whose weights are asymmetric or grouped is refused, naming what is supported."""
    import json

    folder, _ = write_int8(tiny_llama_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="int-quantized weights .*'symmetric': False.*, not 8-bit symmetric integers"):
        load_model(folder)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 matmuls need a GPU of compute capability 8.9 or more")
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_a_gpu_keeps_them_by_default(tiny_llama_dir, tmp_path, kind):
    """On a GPU with 8-bit tensor cores, in bfloat16, a row-scaled release's linears stay 8-bit without being asked;
    each kept linear's kernel gives the stated math (computed in float64 over the same rounded activations) within
    bfloat16's output rounding, and the logits follow the rounded-activation reference (a bfloat16 model: its
    roundings, and an activation landing on the other side of an 8-bit step, move them; an H200 measured 5.5% of the
    largest logit for FP8, where a rounding step is 1/16, on 2026-11-30)."""
    fmt = FORMATS[kind]
    folder, ref = write(kind, tiny_llama_dir, tmp_path)
    model = load_model(folder, dtype=torch.bfloat16, device="cuda")
    assert kept_linears(model) == projections(model)
    g = torch.Generator().manual_seed(0)
    for module in kept_linears(model):
        kept = module.kept
        x = torch.randn(7, kept.weight.shape[1], generator=g).to("cuda", torch.bfloat16)
        xq, s_x = quantize_rows(x, fmt)
        stated = (xq.double() * s_x.double()) @ (kept.weight.double() * kept.scale.double().reshape(-1, 1)).t()
        assert (kept.matmul(x).double() - stated).abs().max() < 8e-3 * stated.abs().max()  # (measured: 3.5e-3)
    reference = rounded_activations(load_model(ref, dtype=torch.bfloat16, device="cuda"), fmt)
    want, got = prefill_logits(reference, IDS).float(), prefill_logits(model, IDS).float()
    spread = float((got - want).abs().max() / want.abs().max())
    assert spread < (0.1 if kind == "fp8" else 0.05), spread


def test_online_fp8_quantizes_an_unquantized_checkpoint(tiny_llama_dir, tmp_path, w8a8_weights, monkeypatch):
    """vLLM's ``quantization="fp8"`` over an unquantized checkpoint: every projection quantized to FP8 with a scale per
    row at load (the LM head and the routers full precision) and kept for the FP8 matmul, each weight's values what
    the by-hand quantization gives; a mixture's experts kept in FP8 by row where FP8 experts are kept, dequantized as
    tokens reach them; the logits within the rounding of the full-precision model's. Through the engine, n-gram drafts
    give plain greedy decoding's tokens."""
    skip_without_cpu_fp8()
    from specray import LLM, SamplingParams
    from specray.models import cpu_kernels
    from specray.models.fp8 import ROW_SCALES
    from specray.models.moe import SparseMoE
    from specray.models.w8a8 import quantize_weight
    from tests.conftest import build_tiny_model

    monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", True)
    # 16 experts: a router the kernel could take (16 rows), which stays dense all the same
    mixture = build_tiny_model(tmp_path / "moe", "qwen3_moe", seed=4, num_hidden_layers=3, num_experts=16,
                               num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])
    for folder in (tiny_llama_dir, mixture):
        dense = load_model(folder, pack=False)
        model = load_model(folder, quantization="fp8")
        kept = kept_linears(model)
        assert kept == projections(model) and all(m.weight.numel() == 0 for m in kept)
        o_proj, dense_o = model.model.layers[0].self_attn.o_proj.kept, dense.model.layers[0].self_attn.o_proj.weight
        by_hand = quantize_weight(dense_o, FP8)
        assert torch.equal(o_proj.weight.view(torch.uint8), by_hand.weight.view(torch.uint8))
        blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
        assert all(b.fp8_block == ROW_SCALES and b.w13.dtype == torch.float8_e4m3fn for b in blocks)
        assert bool(blocks) == (folder == mixture)
        routers = [m for n, m in model.named_modules() if n.endswith(".gate")]  # (16 rows: the kernel takes them)
        assert len(routers) == 2 * (folder == mixture) and all(m.weight.dtype == torch.float32 for m in routers)
        want, got = prefill_logits(dense, IDS), prefill_logits(model, IDS)
        assert 0 < (got - want).abs().max() < 0.2 * want.abs().max()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 5, 6, 7, 5, 6], list(range(20, 50)))]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False}
    outs = []
    for spec in (None, ngram):
        with LLM(model=str(tiny_llama_dir), max_model_len=128, quantization="fp8", speculative_config=spec,
                 device="cpu") as llm:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            assert kept_linears(llm.engine.executor.worker.model)
    assert outs[0] == outs[1]


def test_online_fp8_experts_split_by_width_scale_a_row_as_one_rank(w8a8_weights, monkeypatch):
    """Split by width over two ranks, each holds half of a down projection's row: quantized online, both scale it by
    the whole row's largest magnitude (gathered from the other rank), so their values and scales are one rank's."""
    from types import SimpleNamespace

    from specray.models import cpu_kernels, moe

    monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", True)
    config = SimpleNamespace(model_type="qwen3_moe", hidden_act="silu", hidden_size=64, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    whole = moe.SparseMoE(config, SimpleNamespace(size=1, rank=0), False)
    torch.manual_seed(0)
    with torch.no_grad():
        whole.w13.normal_(), whole.w2.normal_()
    w2 = whole.w2.data.clone()  # [E, 64, 32]
    shares = []
    for rank in (0, 1):
        def all_gather(x, dim, rank=rank):  # the other rank's share of each row's largest magnitude beside ours
            other = w2[:, :, 16 * (1 - rank): 16 * (2 - rank)].abs().amax(-1).float()[..., None]
            return torch.cat([x, other] if rank == 0 else [other, x], dim)

        block = moe.SparseMoE(config, SimpleNamespace(size=2, rank=rank, all_gather=all_gather), False)
        with torch.no_grad():
            block.w2.copy_(w2[:, :, 16 * rank: 16 * (rank + 1)])
            block.w13.copy_(torch.cat([whole.w13.data[:, 16 * rank: 16 * (rank + 1)],
                                       whole.w13.data[:, 32 + 16 * rank: 32 + 16 * (rank + 1)]], 1))
        assert block.quantize_experts(FP8)
        shares.append(block)
    assert whole.quantize_experts(FP8)
    assert all(torch.equal(s.w2_scale, whole.w2_scale) for s in shares)
    assert torch.equal(torch.cat([s.w2.view(torch.uint8) for s in shares], -1), whole.w2.view(torch.uint8))


@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8-block", "fp8-static", "int8-static"])
def test_kept_experts_multiply_in_8_bits_where_linears_do(tiny_qwen3_moe_dir, tmp_path, w8a8_weights, monkeypatch,
                                                          kind):
    """A mixture with a tensor per expert, INT8 W8A8, FP8 by row or FP8 in blocks: where 8-bit experts are kept (a
    GPU; here asked) they hold their 8-bit values and scales (half of bf16's bytes). Where the device also multiplies
    in 8 bits (a GPU; here asked) each expert's projection rounds its tokens' activations as the release's linears
    do, per row or per group of a block's columns, as vLLM's fused experts do (a static release's: over the largest
    of its experts' input scales for that projection, every expert's read): equal, expert by expert, to that
    rounding by hand times the dequantized weight, and the logits within that rounding of the release dequantized at
    load. Where it does not, an FP8 expert is dequantized as tokens reach it (an INT8 one at load): the logits equal
    the release dequantized at load exactly. A dummy load keeps random 8-bit experts within its weights' range."""
    skip_without_cpu_fp8(kind)
    from specray.models import cpu_kernels
    from specray.models.fp8 import ROW_SCALES
    from specray.models.fp8_blocks import quantize_groups
    from specray.models.loader import DUMMY_WEIGHT_RANGE
    from specray.models.moe import SparseMoE
    from specray_test_checkpoints import split_experts

    split = split_experts(tiny_qwen3_moe_dir, tmp_path / "split")
    folder, _ = write(kind, split, tmp_path / "q", "channel") if kind != "fp8-block" else \
        write_fp8(split, tmp_path / "q", [16, 16])
    values = torch.int8 if kind.startswith("int8") else torch.float8_e4m3fn
    monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", True)
    model = load_model(folder)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert blocks and all(b.matmul8 is not None and b.w13.dtype == b.w2.dtype == values for b in blocks)
    assert all((b.fp8_block == ROW_SCALES) == (kind != "fp8-block") for b in blocks)
    g = torch.Generator().manual_seed(0)
    block = blocks[0]
    statics = {"w13": None, "w2": None}
    if kind.endswith("-static"):
        from safetensors.torch import load_file

        stored = load_file(str(folder / "model.safetensors"))
        expert = "model.layers.0.mlp.experts.{}.{}.input_scale"
        statics = {"w13": max(float(stored[expert.format(e, p)]) for e in range(8) for p in ("gate_proj", "up_proj")),
                   "w2": max(float(stored[expert.format(e, "down_proj")]) for e in range(8))}
        assert (float(block.w13_input_scale), float(block.w2_input_scale)) == (statics["w13"], statics["w2"])
    for e in range(block.w13.shape[0]):
        for name, w, s in (("w13", block.w13, block.w13_scale), ("w2", block.w2, block.w2_scale)):
            x = torch.randn(5, w.shape[2], generator=g)
            if kind == "fp8-block":
                xq, scale = quantize_groups(x, 16)
                rounded = (xq.float().view(5, -1, 16) * scale[..., None]).view(x.shape)
            else:
                static = None if statics[name] is None else torch.tensor(statics[name])
                xq, scale = quantize_rows(x, FORMATS[kind], static)
                rounded = xq.float() * scale
            want = rounded @ block._weight(w, s, e, torch.float32).t()
            assert (block._project(x, w, s, e, None) - want).abs().max() <= 1e-5 * want.abs().max()
    got = prefill_logits(model, IDS)
    dummy = [b for b in load_model(folder, load_format="dummy").modules() if isinstance(b, SparseMoE)]
    decoded = torch.stack([b._weight(b.w2, b.w2_scale, e, torch.float32) for b in dummy for e in range(8)])
    assert all(b.w2.dtype == values for b in dummy)
    assert DUMMY_WEIGHT_RANGE / 2 < decoded.abs().max() <= DUMMY_WEIGHT_RANGE * (1 + 1e-6)
    monkeypatch.setattr(cpu_kernels, "FP8_WEIGHTS", False)
    monkeypatch.setattr(cpu_kernels, "INT8_WEIGHTS", False)
    model = load_model(folder)
    # (an INT8 release's experts come as int8 only to a model that keeps its linears in INT8: dequantized at load)
    kept = values if not kind.startswith("int8") else torch.float32
    assert all(b.matmul8 is None and b.w13.dtype == kept for b in model.modules() if isinstance(b, SparseMoE))
    dequantized_on_use = prefill_logits(model, IDS)
    monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", False)
    dequantized = prefill_logits(load_model(folder), IDS)
    assert torch.equal(dequantized_on_use, dequantized) and dequantized.std() > 0.01
    assert 0 < (got - dequantized).abs().max() < 0.2 * dequantized.abs().max()


def test_a_draft_model_takes_its_own_quantization(tiny_llama_dir, tmp_path, w8a8_weights):
    """vLLM's ``speculative_config.quantization`` for a draft model: ``"fp8"`` quantizes an unquantized draft's
    linears to FP8 as it loads (kept for the FP8 matmul), and greedy output stays the target's plain output; a
    method the draft checkpoint does not have, or an unknown one, is refused naming the option."""
    skip_without_cpu_fp8()
    from specray import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 5, 6, 7, 5, 6], list(range(20, 50)))]
    spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3, "adaptive": False}
    with LLM(model=str(tiny_llama_dir), max_model_len=128, device="cpu") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(model=str(tiny_llama_dir), max_model_len=128, speculative_config={**spec, "quantization": "fp8"},
             device="cpu") as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        assert kept_linears(llm.engine.drafter.model) and not kept_linears(llm.engine.executor.worker.model)
        assert llm.spec_stats.accepted_tokens > 0
    with pytest.raises(ValueError, match="speculative_config.quantization='awq' but the checkpoint has no"):
        LLM(model=str(tiny_llama_dir), max_model_len=128, speculative_config={**spec, "quantization": "awq"})
    with pytest.raises(ValueError, match=r"speculative_config.quantization='int4' is not supported; one of \['awq'"):
        LLM(model=str(tiny_llama_dir), max_model_len=128, speculative_config={**spec, "quantization": "int4"})


# ---- block-scaled FP8 linears (specray.models.fp8_blocks: DeepSeek-V3's and Qwen3's -FP8 releases) -----------------

def block_kept(model) -> dict:
    """A model's linears kept in block-scaled FP8, by name."""
    from specray.models.fp8_blocks import BlockFP8Linear

    return {name: m for name, m in model.named_modules() if isinstance(getattr(m, "kept", None), BlockFP8Linear)}


def grouped_activations(model, names, group: int):
    """``model`` (dense weights) with the input of each projection in ``names`` rounded as the block-wise FP8 matmul
    rounds it: each row per group of ``group`` columns to e4m3 over the group's own scale, then scaled back."""
    from specray.models.fp8_blocks import quantize_groups
    from specray.models.layers import RowParallelLinear

    def rounded(x):
        xq, s = quantize_groups(x, group)
        return (xq.float().view(s.shape[0], s.shape[1], group) * s[..., None]).view(x.shape).to(x.dtype)

    for name, module in model.named_modules():
        if name in names and isinstance(module, RowParallelLinear):  # (a shared expert's sum calls .partial alone)
            module.partial = lambda x, partial=module.partial: partial(rounded(x))
        elif name in names:
            module.register_forward_pre_hook(lambda module, args: (rounded(args[0]), *args[1:]))
    return model


def test_the_block_matmul_is_the_stated_math():
    """Each row of x quantized per group of b1 columns over the group's own scale (max / 448), each column block's
    products summed and scaled by both scales: equal to dequantizing both sides and multiplying, by hand in float64,
    for a non-square block and DeepSeek's 128 x 128; a row's output the same alone as in a batch; within the
    activations' rounding of the dense product but not equal to it. A weight cut on blocks' edges keeps its blocks'
    scales, one cut elsewhere is None, and a part that would share a block with another does not fit."""
    from specray.models.fp8_blocks import BlockScaled, BlockScaledStaging, pack_block_fp8

    g = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    for (n, k), block in (((64, 96), (16, 32)), ((256, 256), (128, 128))):
        w = torch.randn(n, k, generator=g)
        scale = torch.rand(n // block[0], k // block[1], generator=g) / 100 + 1e-3
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        stored = BlockScaled((w / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale, block)
        kept = pack_block_fp8(stored, cpu, torch.float32)
        assert not kept.fast  # (torch's block-wise kernel is CUDA's)
        x = torch.randn(5, k, generator=g) * torch.tensor([[0.1], [1.0], [10.0], [3.0], [0.01]])
        x[1, :block[1]] *= 50  # one group of one row far larger than the rest of it
        y = kept.matmul(x)
        groups = x.double().view(5, -1, block[1])
        s_x = groups.abs().amax(-1, keepdim=True) / 448
        xq = (groups / s_x).to(torch.float8_e4m3fn).double() * s_x
        by_hand = xq.view(5, k) @ (stored.weight.double() * full.double()).t()
        assert (y.double() - by_hand).abs().max() <= 1e-5 * by_hand.abs().max()
        assert all((kept.matmul(x[i: i + 1])[0] - y[i]).abs().max() <= 1e-6 * y[i].abs().max() for i in range(5))
        dense = x @ stored.dense().t()
        error = ((y - dense).abs().amax(1) / dense.abs().amax(1)).max()
        assert 0 < error < 0.1, error
    stored = BlockScaled(torch.zeros(64, 96).to(torch.float8_e4m3fn), torch.arange(12.0).view(4, 3), (16, 32))
    assert torch.equal(stored.rows(16, 32).scale, stored.scale[1:3])
    assert torch.equal(stored.cols(32, 64).scale, stored.scale[:, 1:3])
    assert stored.rows(8, 16) is None and stored.cols(0, 48) is None and stored.rows(48, 16) is not None
    stage = BlockScaledStaging(96, 96, (16, 32))
    part = stored.rows(0, 16)
    assert stage.fits(part, 16) and not stage.fits(part, 8)
    assert pack_block_fp8(BlockScaled(stored.weight[:40], stored.scale[:3], (16, 32)), cpu, torch.float32) is None


def test_which_devices_keep_block_scaled_linears(w8a8_weights, monkeypatch, caplog):
    """CUDA with compute capability 9.0 or more, in bfloat16, blocks of 128 x 128, where torch's block-wise kernel
    runs and matches the reference (tried once: one that raises, or differs, leaves the weights dequantized, saying
    why); a CPU only when asked, through the reference."""
    import logging

    from specray.models import cpu_kernels, fp8_blocks

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fp8_blocks.keeps_block_fp8((16, 32), cpu, torch.float32)
    monkeypatch.setattr(cpu_kernels, "FP8_WEIGHTS", False)
    assert not fp8_blocks.keeps_block_fp8((16, 32), cpu, torch.float32)
    with caplog.at_level(logging.WARNING, logger="specray.models.fp8_blocks"):
        assert not fp8_blocks.kernel_runs(cpu, torch.bfloat16)  # (this torch's kernel is CUDA's alone)
        reference = fp8_blocks.reference_matmul
        for factor, runs in ((1.0, True), (1.1, False)):
            monkeypatch.setattr(fp8_blocks, "_RUNS", {})
            monkeypatch.setattr(fp8_blocks, "_kernel_matmul", lambda xq, xs, w, ws, dtype, f=factor: f * reference(
                xq, xs, w, ws[:, :xs.shape[1]], fp8_blocks.KERNEL_BLOCK, dtype))
            assert fp8_blocks.kernel_runs(cpu, torch.bfloat16) == runs
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "does not run there" in messages[0] and "differs from the reference" in messages[1]
    monkeypatch.setattr(fp8_blocks, "kernel_runs", lambda device, dtype: True)  # (no GPU here to try it on)
    assert fp8_blocks.keeps_block_fp8((128, 128), cuda, torch.bfloat16, (9, 0))
    assert fp8_blocks.keeps_block_fp8((128, 128), cuda, torch.bfloat16, (10, 0))
    assert not fp8_blocks.keeps_block_fp8((128, 128), cuda, torch.bfloat16, (8, 9))
    assert not fp8_blocks.keeps_block_fp8((128, 128), cuda, torch.float16, (9, 0))
    assert not fp8_blocks.keeps_block_fp8((64, 128), cuda, torch.bfloat16, (9, 0))


@pytest.mark.parametrize("fixture,block", [("tiny_llama_dir", [16, 32]), ("tiny_deepseek_dir", [16, 16])])
def test_a_block_scaled_release_keeps_its_linears_in_fp8(request, tmp_path, fixture, block, w8a8_weights,
                                                         monkeypatch):
    """A block-scaled FP8 release (DeepSeek's layout): every linear whose sides, and whose parts' rows, are whole
    blocks keeps the stored e4m3 values and block scales (no dense weight), the rest (DeepSeek's 24-wide latent
    projections, its kv_b_proj read as a matrix) are dequantized, and experts stay as they were. Each kept linear
    gives the dequantized checkpoint's weight times its input rounded per group of b1 columns (a merged q/k/v's and
    gate/up's parts each at its rows), and the logits are those of the dequantized checkpoint with each kept
    projection's input so rounded, within half of what that rounding changes (an input a hair from a rounding
    boundary, its float32 sums a bit apart, may round a step the other way, and later tokens attend to it). Not
    asked, the CPU dequantizes them, to the dequantized checkpoint's logits exactly."""
    from safetensors.torch import load_file

    from specray.models import cpu_kernels
    from specray.models.fp8_blocks import quantize_groups

    folder, ref = write_fp8(request.getfixturevalue(fixture), tmp_path, block)
    model = load_model(folder)
    kept = block_kept(model)
    assert kept and all(m.weight.numel() == 0 and m.kept.block == tuple(block) for m in kept.values())
    if fixture == "tiny_llama_dir":
        assert list(kept.values()) == projections(model)
    else:
        assert "model.layers.0.self_attn.o_proj" in kept and "model.layers.0.self_attn.q_a_proj" not in kept
        assert "model.layers.0.self_attn.kv_b_proj" not in kept
        assert "model.layers.1.mlp.shared_experts.down_proj" in kept
    stored = load_file(str(folder / "model.safetensors"))
    o_proj = kept["model.layers.0.self_attn.o_proj"].kept
    stored_o = stored["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(o_proj.weight.view(torch.uint8), stored_o.view(torch.uint8))
    assert torch.equal(o_proj.scale, stored["model.layers.0.self_attn.o_proj.weight_scale_inv"])
    dense = dict(load_model(ref, pack=False).named_modules())
    g = torch.Generator().manual_seed(0)
    for name, m in kept.items():
        x = torch.randn(5, m.kept.weight.shape[1], generator=g)
        xq, s = quantize_groups(x, block[1])
        rounded = (xq.float().view(5, -1, block[1]) * s[..., None]).view(x.shape)
        want = rounded @ dense[name].weight.t()
        assert (m.kept.matmul(x) - want).abs().max() <= 1e-5 * want.abs().max(), name
    dequantized = prefill_logits(load_model(ref), IDS)
    want = prefill_logits(grouped_activations(load_model(ref), set(kept), block[1]), IDS)
    got = prefill_logits(model, IDS)
    rounding = (got - dequantized).abs().max()
    assert (got - want).abs().max() < 0.5 * rounding and rounding > 1e-3 * want.abs().max()
    monkeypatch.setattr(cpu_kernels, "FP8_WEIGHTS", False)
    plain = load_model(folder)
    assert not block_kept(plain) and torch.equal(prefill_logits(plain, IDS), dequantized)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="block-wise FP8 matmuls need a GPU of compute capability 9.0 or more")
def test_a_gpu_keeps_block_scaled_linears_by_default(tmp_path):
    """On a Hopper-class GPU in bfloat16, a release with DeepSeek's 128 x 128 blocks keeps its linears in FP8 through
    torch's block-wise kernel (checked against the reference at load) without being asked, and the logits follow
    those of the same weights through the reference matmul (bfloat16's rounding on top)."""
    from tests.conftest import build_tiny_model

    src = build_tiny_model(tmp_path / "wide", "llama", hidden_size=256, intermediate_size=512, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=128)
    folder, ref = write_fp8(src, tmp_path / "q", [128, 128])
    from specray.models.fp8_blocks import quantize_groups

    model = load_model(folder, dtype=torch.bfloat16, device="cuda")
    kept = block_kept(model)
    assert list(kept.values()) == projections(model) and all(m.kept.fast for m in kept.values())
    g = torch.Generator().manual_seed(0)
    for module in kept.values():  # each kernel against the stated math in float64 (measured within 3.5e-3)
        w = module.kept
        (_, k), (b0, b1) = w.weight.shape, w.block
        x = torch.randn(7, k, generator=g).to("cuda", torch.bfloat16)
        xq, s_x = quantize_groups(x, b1)
        rows = (xq.double().view(7, k // b1, b1) * s_x.double()[..., None]).view(7, k)
        full = w.scale.double().repeat_interleave(b0, 0).repeat_interleave(b1, 1)
        stated = rows @ (w.weight.double() * full).t()
        assert (w.matmul(x).double() - stated).abs().max() < 8e-3 * stated.abs().max()
    got = prefill_logits(model, IDS).float()
    for m in kept.values():
        m.kept.fast = False  # the same weights through the reference, on the same GPU
    want = prefill_logits(model, IDS).float()
    # (bfloat16 outputs: a linear's last bit, then an activation's rounding, may fall the other way; an H200
    # measured a median row's largest difference of 6.2% of the largest logit on 2026-11-30)
    spread = float((got - want).abs().amax(1).median() / want.abs().max())
    agree = float((got.argmax(1) == want.argmax(1)).float().mean())
    assert spread < 0.1 and agree > 0.8, (spread, agree)


def test_every_rank_takes_the_largest_static_scale_of_all_experts(monkeypatch):
    """Expert parallel, rank 1 of 2 (experts 4-7): a static release's activation scales are the largest over every
    expert's, those of rank 0's experts included, so both ranks round a token alike."""
    from types import SimpleNamespace

    from transformers import Qwen3MoeConfig

    from specray.models import cpu_kernels
    from specray.models.fp8 import ROW_SCALES, Fp8Weight
    from specray.models.moe import SparseMoE

    monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", True)
    quant = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}
    config = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                            quantization_config=quant)
    block = SparseMoE(config, SimpleNamespace(size=2, rank=1), True)
    assert block.fp8_block == ROW_SCALES and block.expert_start == 4
    for e in range(8):
        for kind, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
            scale = 0.5 if (e, kind) == (1, "up_proj") else 0.25 if (e, kind) == (2, "down_proj") else 0.01 * (e + 1)
            block.load_expert_tensor(f"model.layers.0.mlp.experts.{e}.{kind}.weight", Fp8Weight(
                torch.ones(shape).to(torch.float8_e4m3fn), torch.ones(shape[0], 1), ROW_SCALES, torch.tensor(scale)))
    assert (float(block.w13_input_scale), float(block.w2_input_scale)) == (0.5, 0.25)
