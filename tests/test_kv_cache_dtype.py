"""An FP8 KV cache (vLLM's ``kv_cache_dtype="fp8"``): K/V stored one byte each. Our attention over it equals
attention over a full-precision cache holding the same rounded values (fake quantization), stays close to
transformers' logits, and a step's own tokens are read rounded too, so greedy speculative output still equals greedy
plain output (every drafter kind, steps from graphs, prefix caching, two tensor-parallel ranks in
tests/test_cluster.py); the same memory holds 4x (fp32) or 2x (bf16) the blocks."""

from __future__ import annotations

import pytest
import torch

import specray_test_draft_heads as draft_heads  # tests/draft_heads.py (registered by conftest)
import specray_test_engine_runs as runs  # tests/engine_runs.py

from specray import LLM
from specray.models.attention import PagedAttention, build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache
from specray.models.loader import load_model

BLOCK = 4


def _logits(model, prompts, steps: int = 3) -> list[torch.Tensor]:
    """A batch of prefills (in two chunks: 5 tokens, then the rest), then decodes of fixed tokens (whatever the
    logits say), over shuffled blocks: every row's logits."""
    tables = [[47 - 12 * i - j for j in range(12)] for i in range(len(prompts))]
    seqs, out = [list(p) for p in prompts], []
    with torch.no_grad():
        for step in range(steps + 1):
            if step == 0:
                chunks = [(p[:5], 0, t) for p, t in zip(prompts, tables)]
            elif step == 1:
                chunks = [(s[5:], 5, t) for s, t in zip(seqs, tables)]
            else:
                chunks = [(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables)]
            meta = build_attention_metadata([len(c[0]) for c in chunks], [c[1] for c in chunks],
                                            [c[2] for c in chunks], BLOCK, "cpu")
            logits = model.compute_logits(model(torch.tensor([t for c in chunks for t in c[0]]), meta))
            rows = logits.split([len(c[0]) for c in chunks])
            out.extend(rows)
            if step >= 1:
                for i, s in enumerate(seqs):
                    s.append((31 * i + 7 * step) % 250 + 3)
    return out


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir", "tiny_gemma3_dir", "tiny_llama4_dir",
                                     "tiny_deepseek_dir", "tiny_deepseek_dir-unabsorbed", "tiny_deepseek_v4_dir"])
def test_fp8_cache_equals_fake_quantized_attention(fixture, fmt, request, monkeypatch):
    """Logits over the FP8 cache (bytes, converted on read) equal logits over a full-precision cache into which the
    same values were rounded through the format, and differ from unrounded ones by what the rounding explains.
    DeepSeek's latent cache too, through its absorbed path and (every chunk made wide enough) its unabsorbed one;
    DeepSeek-V4's rows (keys, pooling inputs, the entries of windows closed in a step)."""
    from specray.models import deepseek_v3
    from specray.models.deepseek_v4 import DeepseekV4Attention

    base = request.getfixturevalue(fixture.removesuffix("-unabsorbed"))
    if fixture.endswith("-unabsorbed"):  # the long chunks unabsorbed, decodes absorbed
        monkeypatch.setattr(deepseek_v3, "unabsorbed_threshold", lambda *sizes: 2)
    # 30 tokens: a first chunk of 5, then one of 25, past the short-query path (own, with context)
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(30)] for i in range(3)]
    ours = load_model(base)
    allocate_kv_cache(ours, 48, BLOCK, fmt)
    got = _logits(ours, prompts)

    fp8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt]
    bound = torch.finfo(fp8).max
    monkeypatch.setattr(PagedAttention, "_stored",
                        lambda self, x, scale=1.0: x.clamp(-bound, bound).to(fp8).to(x.dtype))
    monkeypatch.setattr(DeepseekV4Attention, "_stored", lambda self, x: x.clamp(-bound, bound).to(fp8).to(x.dtype))
    reference = load_model(base)
    allocate_kv_cache(reference, 48, BLOCK)
    want = _logits(reference, prompts)
    assert all(torch.equal(g, w) for g, w in zip(got, want))

    monkeypatch.undo()
    exact = load_model(base)
    allocate_kv_cache(exact, 48, BLOCK)
    unrounded = _logits(exact, prompts)
    diff = max((g - u).abs().max().item() for g, u in zip(got, unrounded))
    spread = max((u.max() - u.min()).item() for u in unrounded)
    # rounded: not the same; and not garbage (bytes misread would be far off). The exact check is the one above:
    # a tiny random model's logits move by a tenth to a quarter of their spread under 2-3 mantissa bits; the tiny
    # DeepSeek-V4's by up to half (its pooling gates' softmax amplifies rounding: FP8 weights alone move them as far)
    assert 0 < diff < (0.5 if "v4" in fixture else 0.3) * spread, (diff, spread)


@pytest.fixture(scope="module")
def fp8_plain(tiny_llama_dir):
    """Plain greedy decoding over an FP8 cache: the reference for every drafter over one."""
    with LLM(model=str(tiny_llama_dir), max_model_len=256, kv_cache_dtype="fp8") as llm:
        return runs.token_ids(llm.generate(runs.PROMPTS, runs.greedy(), use_tqdm=False))


@pytest.mark.parametrize("kind", draft_heads.DRAFTER_KINDS)
def test_greedy_speculative_output_over_an_fp8_cache_equals_plain(kind, fp8_plain, tiny_llama_dir, tiny_draft_dir,
                                                                   tmp_path):
    config = draft_heads.speculative_config(kind, tiny_llama_dir, tiny_draft_dir, tmp_path)
    with LLM(model=str(tiny_llama_dir), max_model_len=256, kv_cache_dtype="fp8", speculative_config=config) as llm:
        assert runs.token_ids(llm.generate(runs.PROMPTS, runs.greedy(), use_tqdm=False)) == fp8_plain
        assert llm.spec_stats.accepted_tokens > 0
        # a drafter with a KV cache of its own keeps it in the same format (vLLM's kv_cache_dtype covers the draft)
        runner = llm.engine.executor.worker.runner
        own = runner.drafter.kv_cache if kind == "eagle3" else getattr(llm.engine.drafter, "kv_cache", None)
        assert (own is None) == (kind in ("ngram", "suffix"))
        assert own is None or (own.fp8 == torch.float8_e4m3fn and own.layer(0).dtype == torch.uint8)


def test_fp8_cache_from_graphs_with_prefix_caching_and_small_chunks(fp8_plain, tiny_llama_dir):
    """Steps from graphs' static inputs, prompts split into chunks of 8 tokens, cached prefixes taken, batch 1: the
    same tokens (the rounding does not depend on how tokens meet in steps)."""
    with LLM(model=str(tiny_llama_dir), max_model_len=256, kv_cache_dtype="fp8", enforce_eager=False,
             enable_prefix_caching=True, max_num_batched_tokens=8, max_num_seqs=2,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        for _ in range(2):
            assert runs.token_ids(llm.generate(runs.PROMPTS, runs.greedy(), use_tqdm=False)) == fp8_plain
        assert runs.token_ids([llm.generate([p], runs.greedy(), use_tqdm=False)[0]
                               for p in runs.PROMPTS]) == fp8_plain


def test_fp8_cache_holds_more_blocks_and_bad_names_are_refused(tiny_llama_dir):
    budget = 1 << 17  # fewer blocks than the engine's cap (max_model_len x max_num_seqs) in both
    counts = {}
    for dtype in ("auto", "fp8_e5m2"):
        with LLM(model=str(tiny_llama_dir), max_model_len=256, kv_cache_dtype=dtype,
                 kv_cache_memory_bytes=budget) as llm:
            counts[dtype] = llm.engine.scheduler.config.num_blocks
    assert counts["fp8_e5m2"] == 4 * counts["auto"]  # fp32 on CPU: four bytes to one
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' must be one of"):
        LLM(model=str(tiny_llama_dir), kv_cache_dtype="int8")


def test_kv_cache_dtype_and_hf_overrides_flags_reach_the_engine(tiny_llama_dir):
    """`--kv-cache-dtype` and `--hf-overrides` on `specray generate` and `specray serve` (vLLM's flags)."""
    pytest.importorskip("ray")  # the server's modules import Ray and FastAPI (a GPU image may lack them)
    from specray.cluster.cli import build_parser, engine_kwargs, serve_app_args
    from specray.cluster.serve import ServeArgs

    parser = build_parser()
    args = parser.parse_args(["generate", "--model", str(tiny_llama_dir), "--kv-cache-dtype", "fp8_e5m2",
                              "--prompt", "hi"])
    assert engine_kwargs(args)["kv_cache_dtype"] == "fp8_e5m2"
    args = parser.parse_args(["serve", "--model", str(tiny_llama_dir), "--kv-cache-dtype", "fp8",
                              "--hf-overrides", '{"max_position_embeddings": 512}'])
    engine_args = ServeArgs.from_dict(serve_app_args(args)).engine_args()
    assert engine_args.kv_cache_dtype == "fp8" and engine_args.hf_overrides == {"max_position_embeddings": 512}


def test_latent_cache_in_fp8_keeps_greedy_speculative_output(tiny_deepseek_dir):
    """DeepSeek-V3's latent cache in FP8: n-gram drafts verified over it give plain decoding's tokens over it
    (DeepSeek-V4's rows in FP8: tests/test_deepseek_v4_mtp.py, under its MTP module's drafts)."""
    outs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4}):
        with LLM(model=str(tiny_deepseek_dir), max_model_len=128, kv_cache_dtype="fp8",
                 speculative_config=spec) as llm:
            outs[spec is None] = runs.token_ids(llm.generate(runs.PROMPTS, runs.greedy(), use_tqdm=False))
    assert outs[True] == outs[False]


def test_checkpoint_kv_scales_divide_what_an_fp8_cache_stores(tiny_llama_dir, tmp_path, monkeypatch):
    """A checkpoint's calibrated K/V scales (llm-compressor's kv_cache_scheme: self_attn.k_scale / v_scale): an FP8
    cache stores k / k_scale and v / v_scale and multiplies them back as it reads, equal to fake quantization with
    those scales; a cache in the model's dtype ignores them."""
    import shutil

    from safetensors.torch import load_file, save_file

    scaled = tmp_path / "scaled"
    shutil.copytree(tiny_llama_dir, scaled)
    tensors = load_file(str(scaled / "model.safetensors"))
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.004 * (layer + 1))
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.002)
    save_file(tensors, str(scaled / "model.safetensors"))
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(30)] for i in range(3)]

    def logits(folder, kv_cache_dtype="fp8"):
        model = load_model(folder)
        allocate_kv_cache(model, 48, BLOCK, kv_cache_dtype)
        return _logits(model, prompts)

    got = logits(scaled)
    plain = logits(tiny_llama_dir)
    assert max((g - p).abs().max().item() for g, p in zip(got, plain)) > 0  # the scales change what is stored
    assert all(torch.equal(a, b) for a, b in zip(logits(scaled, "auto"), logits(tiny_llama_dir, "auto")))
    fp8, bound = torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max
    monkeypatch.setattr(PagedAttention, "_stored", lambda self, x, scale=1.0: (
        (x / scale).clamp(-bound, bound).to(fp8).to(x.dtype) * scale))
    want = logits(scaled, "auto")
    assert all(torch.equal(g, w) for g, w in zip(got, want))
