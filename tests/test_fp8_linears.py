"""FP8 linears kept in FP8 (``specray.models.fp8_linear``: W8A8 through torch's scaled matmul, as vLLM runs the
``-FP8`` / ``-FP8-dynamic`` releases on GPUs with FP8 tensor cores). A GPU keeps them; this CPU keeps them when asked
(``cpu_kernels.FP8_WEIGHTS``), running the same math through torch's CPU kernel."""

from __future__ import annotations

import pytest
import torch

from specray.models.fp8_linear import FP8_MAX, Fp8Linear, Fp8Rows, keeps_fp8_linears, pack_fp8
from specray.models.layers import LinearBase
from specray.models.loader import load_model
from specray_test_checkpoints import write_fp8  # tests/checkpoints.py

IDS = list(range(3, 40))


@pytest.fixture
def fp8_weights(monkeypatch):
    """Keep FP8 linears on this CPU as a GPU does (on CPU they are dequantized at load by default)."""
    from specray.models import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "FP8_WEIGHTS", True)


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    from specray.models.attention import build_attention_metadata
    from specray.models.kv_cache import allocate_kv_cache

    blocks = -(-len(ids) // 4)
    allocate_kv_cache(model, blocks + 1, 4)
    meta = build_attention_metadata([len(ids)], [0], [list(range(blocks))[::-1]], 4, model.device)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids, device=model.device), meta))


def kept_linears(model) -> list:
    return [m for m in model.modules() if isinstance(getattr(m, "kept", None), Fp8Linear)]


def projections(model) -> list:
    return [m for name, m in model.named_modules() if name.endswith("proj") and isinstance(m, LinearBase)]


def rounded_activations(model):
    """``model`` (dense weights) with every projection's input rounded as the FP8 matmul rounds it: each row to
    e4m3 over its own scale max|x_row| / 448, then scaled back."""
    def round_rows(module, args):
        x = args[0]
        s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
        return ((x / s).to(torch.float8_e4m3fn).to(x.dtype) * s, *args[1:])

    for module in projections(model):
        module.register_forward_pre_hook(round_rows)
    return model


def test_the_scaled_matmul_is_the_stated_math():
    """Each row of x is quantized with its own scale max|x_row| / 448 and y = (xq Wq^T) s_x s_w: equal to that formula
    computed by hand in float32, each row's output the same alone as in a batch (within float32's sums), within the
    activations' rounding of the dense product but not equal to it; a weight the kernel cannot take (a side not a
    multiple of 16) is not packed."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g)
    scale = w.abs().amax(1) / FP8_MAX
    rows = Fp8Rows((w / scale[:, None]).to(torch.float8_e4m3fn), scale)
    kept = pack_fp8(rows, torch.device("cpu"), torch.float32)
    x = torch.randn(5, 64, generator=g) * torch.tensor([[0.1], [1.0], [10.0], [3.0], [0.01]])
    y = kept.matmul(x)
    s_x = x.abs().amax(1, keepdim=True) / FP8_MAX
    xq = (x / s_x).to(torch.float8_e4m3fn).float()
    by_hand = (xq * s_x) @ rows.dense().t()
    assert torch.allclose(y, by_hand, rtol=1e-5, atol=1e-6)
    assert all((kept.matmul(x[i: i + 1])[0] - y[i]).abs().max() <= 1e-6 * y[i].abs().max() for i in range(5))
    dense = x @ rows.dense().t()
    error = ((y - dense).abs().amax(1) / dense.abs().amax(1)).max()
    assert 0 < error < 0.1, error
    assert pack_fp8(rows.rows(0, 40), torch.device("cpu"), torch.float32) is None  # 40 rows
    assert pack_fp8(rows.cols(0, 24), torch.device("cpu"), torch.float32) is None  # 24 columns


def test_which_devices_keep_them(fp8_weights, monkeypatch, caplog):
    """CUDA with FP8 tensor cores (capability 8.9 and up) in bfloat16; not an older GPU or another dtype; a CPU
    only when asked (the fixture asks); anywhere only where torch's scaled matmul runs (tried once: a torch without
    it dequantizes them, saying why)."""
    import logging

    from specray.models import cpu_kernels, fp8_linear

    assert fp8_linear.scaled_mm_runs(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(fp8_linear, "_RUNS", {})

    def unsupported(*args, **kwargs):
        raise RuntimeError("scaled_mm is not supported here\nsecond line")

    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="specray.models.fp8_linear"):
        m.setattr(torch, "_scaled_mm", unsupported)
        assert not keeps_fp8_linears(torch.device("cpu"), torch.float32)
        assert not keeps_fp8_linears(torch.device("cpu"), torch.float32)
    assert [r.getMessage() for r in caplog.records] == [
        f"FP8 linears are dequantized at load on cpu: torch {torch.__version__}'s scaled matmul does not run there "
        "(scaled_mm is not supported here)"]
    monkeypatch.setattr(fp8_linear, "_RUNS", {})
    monkeypatch.setattr(fp8_linear, "scaled_mm_runs", lambda device, dtype: True)  # (no GPU here to try it on)
    cuda = torch.device("cuda")
    assert keeps_fp8_linears(cuda, torch.bfloat16, (9, 0)) and keeps_fp8_linears(cuda, torch.bfloat16, (8, 9))
    assert not keeps_fp8_linears(cuda, torch.bfloat16, (8, 0))
    assert not keeps_fp8_linears(cuda, torch.float16, (9, 0))
    assert keeps_fp8_linears(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(cpu_kernels, "FP8_WEIGHTS", False)
    assert not keeps_fp8_linears(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_moe_dir"])
def test_a_row_scaled_release_keeps_its_linears_in_fp8(request, tmp_path, fixture, strategy, fp8_weights,
                                                       monkeypatch):
    """An llm-compressor FP8 release scaled per output row or per tensor: every projection (a merged q/k/v's and
    gate/up's parts each with its own scale) is kept as the checkpoint stores it, no dense weight allocated, its
    values the stored float8 ones and its scales the stored ones by row; the logits equal, within float32's sums,
    those of the dequantized checkpoint with each projection's input rounded as the FP8 matmul rounds it, and differ
    from the plain dequantized checkpoint's by that rounding. Experts stay as they were (dequantized), the LM head is
    dense. Not asked to keep them, the CPU dequantizes them. A release with block scales is dequantized either way."""
    from safetensors.torch import load_file

    from specray.models import cpu_kernels

    fp8, ref = write_fp8(request.getfixturevalue(fixture), tmp_path, strategy=strategy)
    dequantized = prefill_logits(load_model(ref), IDS)
    want = prefill_logits(rounded_activations(load_model(ref)), IDS)
    model = load_model(fp8)
    kept = kept_linears(model)
    assert len(kept) >= 2 * model.config.num_hidden_layers and kept == projections(model)  # (experts: no modules)
    assert all(m.weight.numel() == 0 for m in kept)
    stored = load_file(str(fp8 / "model.safetensors"))
    o_proj = model.model.layers[0].self_attn.o_proj.kept
    assert torch.equal(o_proj.weight.view(torch.uint8),
                       stored["model.layers.0.self_attn.o_proj.weight"].view(torch.uint8))
    scale = stored["model.layers.0.self_attn.o_proj.weight_scale"].float().reshape(-1)
    assert torch.equal(o_proj.scale.reshape(-1), scale.expand(o_proj.weight.shape[0]))
    got = prefill_logits(model, IDS)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    assert (got - dequantized).abs().max() > 1e-2 * want.abs().max()
    monkeypatch.setattr(cpu_kernels, "FP8_WEIGHTS", False)
    assert not kept_linears(load_model(fp8))
    monkeypatch.setattr(cpu_kernels, "FP8_WEIGHTS", True)
    blocked, _ = write_fp8(request.getfixturevalue(fixture), tmp_path / "block", strategy="block")
    assert not kept_linears(load_model(blocked))


def test_engine_speculative_greedy_equals_plain_over_fp8_linears(tiny_llama_dir, tmp_path, fp8_weights):
    """The engine over kept FP8 linears: n-gram drafts (some accepted, some not) give plain greedy decoding's tokens
    (each row's activations are quantized with its own scale, so a verify chunk's rows are those plain decoding
    computes), eagerly and from step graphs; a dummy load keeps random FP8 linears as a checkpoint's would be."""
    from specray import LLM, SamplingParams

    fp8, _ = write_fp8(tiny_llama_dir, tmp_path, strategy="channel")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 5, 6, 7, 5, 6], list(range(20, 50)), [9, 9, 9, 9])]
    outs = {}
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False}
    for spec, eager in ((None, True), (ngram, True), (ngram, False)):
        with LLM(model=str(fp8), max_model_len=128, speculative_config=spec, enforce_eager=eager) as llm:
            outs[spec is None, eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            worker = llm.engine.executor.worker
            assert kept_linears(worker.model) and bool(worker.runner.graphs and worker.runner.graphs.graphs) != eager
            if spec is not None:
                assert 0 < llm.spec_stats.accepted_tokens < llm.spec_stats.draft_tokens, llm.spec_stats
    assert outs[True, True] == outs[False, True] == outs[False, False]
    assert len(kept_linears(load_model(fp8, load_format="dummy"))) == 8


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 matmuls need a GPU of compute capability 8.9 or more")
def test_a_gpu_keeps_them_by_default(tiny_llama_dir, tmp_path):
    """On a GPU with FP8 tensor cores, in bfloat16, a row-scaled FP8 release's linears stay FP8 without being asked,
    and the logits follow the rounded-activation reference (bfloat16's rounding on top)."""
    fp8, ref = write_fp8(tiny_llama_dir, tmp_path, strategy="channel")
    model = load_model(fp8, dtype=torch.bfloat16, device="cuda")
    assert kept_linears(model) == projections(model)
    want = prefill_logits(rounded_activations(load_model(ref, dtype=torch.bfloat16, device="cuda")), IDS)
    got = prefill_logits(model, IDS)
    assert (got.float() - want.float()).abs().max() < 0.05 * want.float().abs().max()
