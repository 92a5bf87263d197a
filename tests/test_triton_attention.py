"""The short batch's Triton attention kernel (specray.models.triton_attention) against the SDPA path it replaces on a
GPU: every mask kind, a tree's ancestors, GQA, a soft cap, sinks, ALiBi's additive bias, head dims that are not a
power of two, blocks in any order; and greedy decoding through it equal to transformers'. Without a GPU the kernel
runs in Triton's interpreter, on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported)."""
from __future__ import annotations

import random

import pytest
import torch

from specray.models import triton_attention
from specray.models.alibi import AlibiAttention
from specray.models.attention import PagedAttention, build_attention_metadata
from specray.models.kv_cache import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCache, SlidingWindowSpec

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def kernel_on(monkeypatch):
    """The kernel also on CPU tensors (through the interpreter); off again after the test."""
    monkeypatch.setattr(triton_attention, "ON_CPU", True)
    assert triton_attention.interpreting() or DEVICE == "cuda"


def _spec(kind: str, hkv: int, d: int):
    if kind == "window":
        return SlidingWindowSpec(num_kv_heads=hkv, head_dim=d, sliding_window=7)
    if kind == "chunk":
        return ChunkedLocalAttentionSpec(num_kv_heads=hkv, head_dim=d, attention_chunk_size=6)
    return FullAttentionSpec(num_kv_heads=hkv, head_dim=d)


def _case(layer, spec, block_size: int, dtype, seed: int, tree: bool = False, query_lens=(1, 4, 2),
          starts=(37, 5, 60)):
    """A filled cache bound to ``layer`` (its blocks handed out in a random order), the step's plan and its
    queries."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    cache = KVCache([spec], num_blocks, block_size, dtype, DEVICE)
    layer.bind_cache(cache.layer(0), block_size)
    cache.layer(0).copy_(torch.randn(cache.layer(0).shape, generator=gen).to(dtype))
    free = random.Random(seed).sample(range(1, num_blocks), num_blocks - 1)
    tables = [[free.pop() for _ in range(-(-(s + q) // block_size))] for s, q in zip(starts, query_lens)]
    positions = ancestors = None
    if tree:  # each sequence's new tokens: a root and siblings at one depth (positions repeat), then a child
        positions, ancestors = [], []
        for s, q in zip(starts, query_lens):
            depth = [0] + [1] * (q - 1) if q < 3 else [0, 1, 1] + [2] * (q - 3)
            positions.extend(s + x for x in depth)
            anc = torch.eye(q, dtype=torch.bool)
            anc[:, 0] = True
            if q >= 3:
                anc[3:, 1] = True
            ancestors.append(anc)
    meta = build_attention_metadata(list(query_lens), list(starts), tables, block_size, DEVICE, positions=positions,
                                    ancestors=ancestors)
    assert meta.short is not None and not meta.own
    q = torch.randn(sum(query_lens), layer.num_heads, layer.head_dim, generator=gen).to(dtype).to(DEVICE)
    return q, meta


def _both(layer, q, meta, monkeypatch):
    """The kernel's rows and the SDPA path's, [n, Hq*D] each (the padded rows dropped)."""
    monkeypatch.setattr(triton_attention, "ON_CPU", True)
    assert triton_attention.runs(layer, q)
    ours = layer._short(q, meta)
    monkeypatch.setattr(triton_attention, "ENABLED", False)  # SDPA's path, on a GPU too
    ref = layer._short(q, meta)
    sb = meta.short
    real = sb.out_src if sb.out_src is not None else torch.arange(ours.shape[0], device=ours.device)
    return ours.index_select(0, real).float(), ref.index_select(0, real).float()


TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("kind", ["causal", "window", "chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_sdpa_for_each_mask_kind(kind, dtype, monkeypatch):
    """Three short sequences (decode, last token + 3 drafts, 2 tokens) of 4 query heads over 2 KV heads, blocks
    of 4 in a random order: the kernel's attention equals the padded SDPA path's."""
    spec = _spec(kind, 2, 32)
    layer = PagedAttention(4, spec, 32**-0.5).to(DEVICE)
    q, meta = _case(layer, spec, 4, dtype, seed=1)
    ours, ref = _both(layer, q, meta, monkeypatch)
    torch.testing.assert_close(ours, ref, **TOL[dtype])


@pytest.mark.parametrize("head_dim,heads,kv_heads,block_size", [(80, 6, 2, 16), (64, 5, 1, 8), (16, 2, 2, 32)])
def test_kernel_equals_sdpa_for_other_shapes(head_dim, heads, kv_heads, block_size, monkeypatch):
    """A head dim that is not a power of two (80), multi-query attention (5 heads on one KV head, 80 folded rows
    past one tile of 64), blocks of 8, 16 and 32, a context past a tile; with a tree's positions and ancestors."""
    spec = _spec("causal", kv_heads, head_dim)
    layer = PagedAttention(heads, spec, head_dim**-0.5).to(DEVICE)
    q, meta = _case(layer, spec, block_size, torch.float32, seed=2, tree=True, query_lens=(16, 1, 5),
                    starts=(70, 3, 129))
    ours, ref = _both(layer, q, meta, monkeypatch)
    torch.testing.assert_close(ours, ref, **TOL[torch.float32])


@pytest.mark.parametrize("extra", ["softcap", "sinks", "alibi", "tree"])
def test_kernel_equals_the_layers_own_attention(extra, monkeypatch):
    """Gemma 2's soft cap, GPT-OSS's sinks (explicit attention on the SDPA path), ALiBi's additive bias per KV head
    (its own short mask) and a token tree's ancestor masks."""
    spec = _spec("window" if extra == "sinks" else "causal", 2, 32)
    if extra == "alibi":
        layer = AlibiAttention(6, spec, 32**-0.5, slopes=[2.0 ** -(i + 1) for i in range(6)])
    else:
        layer = PagedAttention(6, spec, 32**-0.5, softcap=5.0 if extra == "softcap" else None,
                               sinks=extra == "sinks")
        if extra == "sinks":
            layer.sinks.data.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5]))
    layer = layer.to(DEVICE)
    q, meta = _case(layer, spec, 4, torch.float32, seed=3, tree=extra == "tree", query_lens=(3, 1, 6))
    ours, ref = _both(layer, q, meta, monkeypatch)
    torch.testing.assert_close(ours, ref, **TOL[torch.float32])


def test_kernel_not_taken_where_the_layer_reads_otherwise(kernel_on, monkeypatch):
    """An FP8 cache, a head wider than the kernel's, a subclass with a cache of its own (DeepSeek's latent
    attention), the kernel switched off (SPECRAY_TRITON_ATTENTION=0) and a CPU tensor without the switch keep the
    SDPA path."""
    from specray.models.deepseek_v3 import LatentAttention

    q = torch.zeros(1, 4, 32, device=DEVICE)
    layer = PagedAttention(4, _spec("causal", 2, 32), 1.0)
    assert triton_attention.runs(layer, q)
    layer.fp8 = torch.float8_e4m3fn
    assert not triton_attention.runs(layer, q)
    wide = PagedAttention(4, _spec("causal", 2, 512), 1.0)
    assert not triton_attention.runs(wide, torch.zeros(1, 4, 512, device=DEVICE))
    assert not triton_attention._reads_as_paged_attention(LatentAttention)
    plain = PagedAttention(4, _spec("causal", 2, 32), 1.0)
    monkeypatch.setattr(triton_attention, "ENABLED", False)
    assert not triton_attention.runs(plain, q)
    monkeypatch.setattr(triton_attention, "ENABLED", True)
    monkeypatch.setattr(triton_attention, "ON_CPU", False)
    assert triton_attention.runs(plain, q) == (DEVICE == "cuda")


def test_greedy_through_the_kernel_equals_transformers(tiny_llama_dir, kernel_on, monkeypatch):
    """A tiny Llama's greedy tokens with every short batch attended by the kernel equal transformers' ``generate``
    for a batch of four: n-gram chains verified in eager steps, and n-gram trees verified from graph steps (their
    static plan's context lengths refreshed at every replay), drafts accepted."""
    from specray_test_engine_runs import CHAIN_NGRAM, PROMPTS, assert_transformers_generates, greedy, token_ids

    from specray import LLM

    calls = []
    real = triton_attention.short_attention
    monkeypatch.setattr(triton_attention, "short_attention", lambda *args: calls.append(1) or real(*args))
    for spec, eager in ((CHAIN_NGRAM, True), ({**CHAIN_NGRAM, "num_branches": 2}, False)):
        llm = LLM(model=str(tiny_llama_dir), max_model_len=256, block_size=4, speculative_config=spec,
                  enforce_eager=eager)
        got = token_ids(llm.generate(PROMPTS[:4], greedy(10), use_tqdm=False))
        assert_transformers_generates(tiny_llama_dir, llm.get_tokenizer(), PROMPTS[:4], got)
        assert llm.spec_stats.accepted_tokens > 0 and calls
        assert bool(llm.engine.executor.worker.runner.graphs) != eager
        calls.clear()
