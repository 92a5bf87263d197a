"""The short batch's Triton attention kernel (specray.models.triton_attention) against the SDPA path it replaces on a
GPU: every mask kind, a tree's ancestors, GQA, a soft cap, sinks, ALiBi's additive bias, head dims that are not a
power of two, blocks in any order, an FP8 cache, long contexts split in ranges; and greedy decoding through it equal
to transformers'. Without a GPU the kernel
runs in Triton's interpreter, on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported)."""
from __future__ import annotations

import os
import random

import pytest
import torch

from specray.models import triton_attention
from specray.models.alibi import AlibiAttention
from specray.models.attention import PagedAttention, build_attention_metadata
from specray.models.kv_cache import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCache, SlidingWindowSpec

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernel_on_cpu_too(monkeypatch):
    """The kernel on, on CPU tensors too (through the interpreter); as before after the test."""
    monkeypatch.setattr(triton_attention, "ON_CPU", True)
    monkeypatch.setattr(triton_attention, "ENABLED", True)
    assert triton_attention.interpreting() or DEVICE == "cuda"


@pytest.fixture
def kernel_on(monkeypatch):
    _kernel_on_cpu_too(monkeypatch)


def _spec(kind: str, hkv: int, d: int):
    if kind == "window":
        return SlidingWindowSpec(num_kv_heads=hkv, head_dim=d, sliding_window=7)
    if kind == "chunk":
        return ChunkedLocalAttentionSpec(num_kv_heads=hkv, head_dim=d, attention_chunk_size=6)
    return FullAttentionSpec(num_kv_heads=hkv, head_dim=d)


def _case(layer, spec, block_size: int, dtype, seed: int, tree: bool = False, query_lens=(1, 4, 2),
          starts=(37, 5, 60), fp8: torch.dtype | None = None, num_blocks: int = 64, shift: int = 0):
    """A filled cache bound to ``layer`` (its blocks handed out in a random order; ``fp8``: the values in that
    format, as bytes), the step's plan and its queries. ``shift``: every new token's position that many below its
    slot index (a chain's positions given explicitly)."""
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache([spec], num_blocks, block_size, dtype, DEVICE, fp8=fp8)
    layer.bind_cache(cache.layer(0), block_size, fp8)
    values = torch.randn(cache.layer(0).shape, generator=gen)
    cache.layer(0).copy_(values.to(dtype) if fp8 is None else values.to(fp8).view(torch.uint8))
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
    if shift:
        positions = [s + j - shift for s, q in zip(starts, query_lens) for j in range(q)]
    meta = build_attention_metadata(list(query_lens), list(starts), tables, block_size, DEVICE, positions=positions,
                                    ancestors=ancestors, read_in_place=False)  # long contexts too: the short path
    assert meta.short is not None and not meta.own
    q = torch.randn(sum(query_lens), layer.num_heads, layer.head_dim, generator=gen).to(dtype).to(DEVICE)
    return q, meta


def _kernel_and_sdpa(run, monkeypatch):
    """``run()`` through the kernel (on CPU tensors too), then through the SDPA path (the kernel switched off)."""
    _kernel_on_cpu_too(monkeypatch)
    ours = run()
    monkeypatch.setattr(triton_attention, "ENABLED", False)  # SDPA's path, on a GPU too
    return ours, run()


def _counted(monkeypatch, name: str) -> list:
    """Each call of ``triton_attention.<name>`` from now on appends to the list returned."""
    calls, real = [], getattr(triton_attention, name)
    monkeypatch.setattr(triton_attention, name, lambda *args: calls.append(1) or real(*args))
    return calls


def _both(layer, q, meta, monkeypatch):
    """The kernel's rows and the SDPA path's, [n, Hq*D] each (the padded rows dropped)."""
    _kernel_on_cpu_too(monkeypatch)
    assert triton_attention.runs(layer, q)
    ours, ref = _kernel_and_sdpa(lambda: layer._short(q, meta), monkeypatch)
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


@pytest.mark.parametrize("extra", ["softcap", "sinks", "alibi", "tree", "shifted"])
def test_kernel_equals_the_layers_own_attention(extra, monkeypatch):
    """Gemma 2's soft cap, GPT-OSS's sinks (explicit attention on the SDPA path), ALiBi's additive bias per KV head
    (its own short mask), a token tree's ancestor masks, and new tokens at positions below their slots (with sinks,
    the tree and the shift, a sliding window: the keys before each sequence's lowest query's window are skipped)."""
    spec = _spec("window" if extra in ("sinks", "tree", "shifted") else "causal", 2, 32)
    if extra == "alibi":
        layer = AlibiAttention(6, spec, 32**-0.5, slopes=[2.0 ** -(i + 1) for i in range(6)])
    else:
        layer = PagedAttention(6, spec, 32**-0.5, softcap=5.0 if extra == "softcap" else None,
                               sinks=extra == "sinks")
        if extra == "sinks":
            layer.sinks.data.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5]))
    layer = layer.to(DEVICE)
    q, meta = _case(layer, spec, 4, torch.float32, seed=3, tree=extra == "tree", query_lens=(3, 1, 6),
                    shift=3 if extra == "shifted" else 0)
    ours, ref = _both(layer, q, meta, monkeypatch)
    torch.testing.assert_close(ours, ref, **TOL[torch.float32])


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_an_fp8_cache_as_the_sdpa_path(fmt, dtype, monkeypatch):
    """An FP8 cache in either format, with a checkpoint's K and V scales: the kernel decodes its bytes to the
    model's dtype and scales them as the SDPA path reads them."""
    spec = _spec("causal", 2, 32)
    layer = PagedAttention(4, spec, 32**-0.5).to(DEVICE)
    layer.set_kv_scales(0.5, 3.0)
    q, meta = _case(layer, spec, 4, dtype, seed=5, fp8=fmt)
    ours, ref = _both(layer, q, meta, monkeypatch)
    torch.testing.assert_close(ours, ref, **TOL[dtype])


@pytest.mark.parametrize("extra", ["plain", "sinks", "tree"])
def test_long_contexts_split_in_ranges_equal_sdpa(extra, monkeypatch):
    """Contexts of two and three ranges past SPLIT_TOKENS beside a short one, attended in ranges and combined:
    equal to the SDPA path; with sinks counted once over a sliding window (most ranges masked whole), and with a
    tree's masks."""
    spec = _spec("window" if extra == "sinks" else "causal", 2, 32)
    layer = PagedAttention(4, spec, 32**-0.5, sinks=extra == "sinks").to(DEVICE)
    if extra == "sinks":
        layer.sinks.data.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE))
    split = triton_attention.SPLIT_TOKENS
    q, meta = _case(layer, spec, 16, torch.float32, seed=6, tree=extra == "tree", query_lens=(1, 5, 3),
                    starts=(split + 90, 40, 2 * split + 7), num_blocks=2 + 4 * split // 16)
    assert meta.short.num_ctx_blocks * 16 > 2 * split  # three ranges
    ours, ref = _both(layer, q, meta, monkeypatch)
    torch.testing.assert_close(ours, ref, **TOL[torch.float32])


def test_a_rows_attention_does_not_depend_on_the_batch(kernel_on):
    """A short sequence's rows, and a long one's, are the same bits alone as beside a longer sequence that makes the
    step split every context into more ranges (the ranges are fixed positions of each sequence's own context)."""
    spec = _spec("causal", 2, 32)
    layer = PagedAttention(4, spec, 32**-0.5).to(DEVICE)
    split = triton_attention.SPLIT_TOKENS
    starts = (30, split + 50, 3 * split + 10)
    q, meta = _case(layer, spec, 16, torch.float32, seed=7, query_lens=(2, 2, 2), starts=starts,
                    num_blocks=2 + 6 * split // 16)
    tables = [[int(x) for x in row] for row in meta.short.block_index.view(3, -1).tolist()]
    together = triton_attention.short_attention(layer, q, meta)
    for i in (0, 1):  # each alone: fewer ranges (one for the short one: no split at all)
        used = -(-(starts[i] + 2) // 16)
        alone = build_attention_metadata([2], [starts[i]], [tables[i][:used]], 16, DEVICE, read_in_place=False)
        rows = triton_attention.short_attention(layer, q[2 * i: 2 * i + 2], alone)
        assert torch.equal(rows, together[2 * i: 2 * i + 2])


def _own_rows(layer, q, meta, monkeypatch):
    """Each own sequence's rows from the kernel and from the SDPA path, [q, Hq*D] each."""
    _kernel_on_cpu_too(monkeypatch)
    assert triton_attention.runs(layer, q, own=True)
    pairs = [_kernel_and_sdpa(lambda: layer._own(q, None, None, meta, i), monkeypatch) for i in range(len(meta.own))]
    return [(ours.float(), ref.float()) for ours, ref in pairs]


@pytest.mark.parametrize("kind", ["causal", "window", "chunk"])
@pytest.mark.parametrize("consecutive", [True, False])
def test_continued_chunks_equal_sdpa(kind, consecutive, kernel_on, monkeypatch):
    """Chunks of 40 and 24 tokens that continue contexts of 100 and 600 slot indices (the second split in ranges),
    their blocks consecutive (a view on SDPA's path) or not (gathered there): masked by position in the kernel,
    keys skipped past the causal bound and before a sliding window or a chunk, equal to the SDPA path."""
    spec = _spec(kind, 2, 32)
    layer = PagedAttention(4, spec, 32**-0.5).to(DEVICE)
    gen = torch.Generator().manual_seed(9)
    block, lens, starts = 16, [40, 24], [100, 600]
    cache = KVCache([spec], 64, block, torch.float32, DEVICE)
    layer.bind_cache(cache.layer(0), block)
    cache.layer(0).copy_(torch.randn(cache.layer(0).shape, generator=gen))
    order = list(range(1, 64)) if consecutive else random.Random(9).sample(range(1, 64), 63)
    tables = [[order.pop(0) for _ in range(-(-(s + n) // block))] for s, n in zip(starts, lens)]
    meta = build_attention_metadata(lens, starts, tables, block, DEVICE)
    assert not meta.short and len(meta.own) == 2 and (meta.own[0].first_slot is not None) == consecutive
    q = torch.randn(sum(lens), 4, 32, generator=gen).to(DEVICE)
    for ours, ref in _own_rows(layer, q, meta, monkeypatch):
        torch.testing.assert_close(ours, ref, **TOL[torch.float32])


@pytest.mark.parametrize("extra", ["tree", "sinks", "bf16"])
def test_continued_chunks_with_a_tree_sinks_or_bf16_equal_sdpa(extra, kernel_on, monkeypatch):
    """A chunk of 20 tree nodes (positions repeat, its [q, ctx] mask read), GPT-OSS's sinks over a chunk split in
    ranges, and a bf16 chunk with a model of 3 heads on one KV head: equal to the SDPA path."""
    heads, hkv = (3, 1) if extra == "bf16" else (4, 2)
    spec = _spec("window" if extra == "sinks" else "causal", hkv, 32)
    layer = PagedAttention(heads, spec, 32**-0.5, sinks=extra == "sinks").to(DEVICE)
    if extra == "sinks":
        layer.sinks.data.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE))
    dtype = torch.bfloat16 if extra == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(10)
    block, n, start = 16, 20, 530
    cache = KVCache([spec], 64, block, dtype, DEVICE)
    layer.bind_cache(cache.layer(0), block)
    cache.layer(0).copy_(torch.randn(cache.layer(0).shape, generator=gen).to(dtype))
    table = random.Random(10).sample(range(1, 64), -(-(start + n) // block))
    positions = ancestors = None
    if extra == "tree":  # a root, then pairs of siblings, each pair's parent the previous pair's first
        depth = [0] + [1 + (j - 1) // 2 for j in range(1, n)]
        positions = [start + x for x in depth]
        anc = torch.eye(n, dtype=torch.bool)
        for j in range(1, n):
            parent = 0 if j < 3 else 2 * ((j - 1) // 2) - 1
            anc[j] |= anc[parent]
        ancestors = [anc]
    meta = build_attention_metadata([n], [start], [table], block, DEVICE, positions=positions, ancestors=ancestors)
    assert meta.plain(0) == (extra != "tree")
    q = torch.randn(n, heads, 32, generator=gen).to(dtype).to(DEVICE)
    (ours, ref), = _own_rows(layer, q, meta, monkeypatch)
    torch.testing.assert_close(ours, ref, **TOL[dtype])


def test_kernel_not_taken_where_the_layer_reads_otherwise(kernel_on, monkeypatch):
    """An FP8 format the kernel does not decode, a head wider than the kernel's, a subclass that binds its cache
    otherwise without saying how the kernel reads it (``kernel_widths``; DeepSeek's latent attention says so) or
    reads it otherwise, the kernel switched off (SPECRAY_TRITON_ATTENTION=0) and a CPU tensor without the switch
    keep the SDPA path."""
    from specray.models.deepseek_v3 import LatentAttention

    class BindsOtherwise(PagedAttention):
        def bind_cache(self, cache, block_size, fp8=None):
            super().bind_cache(cache, block_size, fp8)

    class ReadsOtherwise(PagedAttention):
        def _read(self, x, dtype, scale=1.0):
            return super()._read(x, dtype, scale)

    q = torch.zeros(1, 4, 32, device=DEVICE)
    layer = PagedAttention(4, _spec("causal", 2, 32), 1.0)
    assert triton_attention.runs(layer, q)
    layer.fp8 = torch.float8_e4m3fnuz  # a format the kernel does not decode
    assert not triton_attention.runs(layer, q)
    wide = PagedAttention(4, _spec("causal", 2, 1024), 1.0)
    assert not triton_attention.runs(wide, torch.zeros(1, 4, 1024, device=DEVICE))
    assert triton_attention._reads_as_paged_attention(LatentAttention)
    assert not triton_attention._reads_as_paged_attention(BindsOtherwise)
    assert not triton_attention._reads_as_paged_attention(ReadsOtherwise)
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

    calls = _counted(monkeypatch, "short_attention")
    for spec, eager in ((CHAIN_NGRAM, True), ({**CHAIN_NGRAM, "num_branches": 2}, False)):
        llm = LLM(model=str(tiny_llama_dir), max_model_len=256, block_size=4, speculative_config=spec,
                  enforce_eager=eager)
        got = token_ids(llm.generate(PROMPTS[:4], greedy(10), use_tqdm=False))
        assert_transformers_generates(tiny_llama_dir, llm.get_tokenizer(), PROMPTS[:4], got)
        assert llm.spec_stats.accepted_tokens > 0 and calls
        assert bool(llm.engine.executor.worker.runner.graphs) != eager
        calls.clear()


class _AnyGrid:
    """A launcher as a Triton kernel is one: ``kernel[grid](...)`` calls ``fn``."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def test_a_kernel_triton_refuses_on_a_gpu_falls_back_to_sdpa(kernel_on, monkeypatch, caplog):
    """Where Triton refuses the kernel for a GPU (it does not compile, or does not fit), those short batches attend
    by SDPA, the refusal logged once and not tried again; in the interpreter (the tests) the failure is raised."""
    from triton.runtime.errors import OutOfResources

    spec = _spec("causal", 2, 32)
    layer = PagedAttention(4, spec, 32**-0.5).to(DEVICE)
    q, meta = _case(layer, spec, 4, torch.float32, seed=8)
    monkeypatch.setattr(triton_attention, "ENABLED", False)
    ref = layer._short(q, meta)
    monkeypatch.setattr(triton_attention, "ENABLED", True)
    tries = []

    def refused(*args, **kwargs):
        tries.append(1)
        raise OutOfResources(300_000, 232_448, "shared memory")

    monkeypatch.setattr(triton_attention._triton(), "paged_attention", _AnyGrid(refused))
    monkeypatch.setattr(triton_attention, "_UNBUILT", set())
    with pytest.raises(OutOfResources):
        layer._short(q, meta)
    monkeypatch.setattr(triton_attention, "interpreting", lambda: False)  # as on a GPU (the kernel taken still)
    monkeypatch.setattr(triton_attention, "runs", lambda layer, q: True)
    with caplog.at_level("WARNING", logger=triton_attention.__name__):
        assert torch.equal(layer._short(q, meta), ref)
        assert torch.equal(layer._short(q, meta), ref)
    assert len(tries) == 2 and len(caplog.records) == 1 and "does not build" in caplog.text


def test_chunked_prefill_through_the_kernel_equals_transformers(tiny_llama_dir, kernel_on, monkeypatch):
    """Long prompts prefilled in chunks of at most 48 tokens, the chunks after the first attended by the kernel
    (masked by position), then decoded through it: greedy tokens equal transformers' ``generate``."""
    from specray_test_engine_runs import PROMPTS, assert_transformers_generates, greedy, token_ids

    from specray import LLM

    calls = _counted(monkeypatch, "own_attention")
    prompts = [" ".join(PROMPTS[i:] + PROMPTS[:i]) for i in (0, 3)]
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, block_size=4, max_num_batched_tokens=48,
              enforce_eager=True)
    assert all(len(llm.get_tokenizer().encode(p)) > 96 for p in prompts)  # three chunks each at least
    got = token_ids(llm.generate(prompts, greedy(6), use_tqdm=False))
    assert_transformers_generates(tiny_llama_dir, llm.get_tokenizer(), prompts, got)
    assert len(calls) >= 2 * 2 * llm.engine.executor.worker.runner.model.config.num_hidden_layers


def test_the_kernels_build_for_gpus():
    """Every launch the host code makes for a set of layers and steps (tests/kernel_builds.py: short batches and
    continued chunks in bf16, fp16, fp32 and FP8 caches, with sinks, a soft cap, ALiBi, a tree, windows, local
    chunks, MQA, head dims 64 to 256, DeepSeek's latent attention, splits) compiles down to a cubin for compute
    capability 9.0 (the first also for 8.0) within the GPU's shared memory: the paths the interpreter cannot run
    (16-bit products) are built."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("kernel_builds.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    builds = [json.loads(line) for line in done.stdout.splitlines()]
    assert all(b["fits"] and b["cubin"] > 0 for b in builds), builds
    assert {b["arch"] for b in builds} == {80, 90} and {b["kernel"] for b in builds} == {"paged_attention",
                                                                                         "combine_splits"}
    assert len({b["case"] for b in builds}) == 8, builds


def _latent_layer(fp8=None):
    """DeepSeek's latent attention at a tiny size (latent 32, RoPE part 16, 4 heads) bound to a filled cache."""
    from specray.models.deepseek_v3 import LatentAttention
    from specray.models.kv_cache import MLAAttentionSpec

    spec = MLAAttentionSpec(kv_lora_rank=32, qk_rope_head_dim=16)
    layer = LatentAttention(4, spec, 48**-0.5, nope=16, v_dim=16).to(DEVICE)
    cache = KVCache([spec], 80, 16, torch.float32, DEVICE, fp8=fp8)
    layer.bind_cache(cache.layer(0), 16, fp8)
    values = torch.randn(cache.layer(0).shape, generator=torch.Generator().manual_seed(11))
    cache.layer(0).copy_(values if fp8 is None else values.to(fp8).view(torch.uint8))
    return layer


@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn])
def test_latent_attention_equals_sdpa(fp8, kernel_on, monkeypatch):
    """DeepSeek's absorbed latent attention (one KV head of latent + RoPE part, the latent its values too, read
    once): a short batch with a context split in ranges and a tree, and a continued chunk below the unabsorbed
    threshold, equal to the SDPA path on every head's latent part (the RoPE part of its output is not read)."""
    layer = _latent_layer(fp8)
    assert triton_attention.runs(layer, torch.zeros(1, 4, 48, device=DEVICE))
    gen = torch.Generator().manual_seed(12)
    free = random.Random(12).sample(range(1, 80), 79)
    lens, starts = [5, 1, 24], [700, 30, 200]
    tables = [[free.pop() for _ in range(-(-(s + n) // 16))] for s, n in zip(starts, lens)]
    positions = [s + min(j, 1) for s, n in zip(starts, lens) for j in range(n)]
    ancestors = [torch.eye(n, dtype=torch.bool) | (torch.arange(n)[None, :] == 0) for n in lens]
    meta = build_attention_metadata(lens, starts, tables, 16, DEVICE, positions=positions, ancestors=ancestors,
                                    read_in_place=False)
    assert len(meta.own) == 1 and meta.short.num_seqs == 2 and 24 < layer.unabsorbed_from
    q = torch.randn(sum(lens), 4, 48, generator=gen).to(DEVICE)
    short = _both(layer, q, meta, monkeypatch)
    (own,) = _own_rows(layer, q, meta, monkeypatch)
    for ours, ref in (short, own):
        torch.testing.assert_close(ours.view(-1, 4, 48)[..., :32], ref.view(-1, 4, 48)[..., :32],
                                   **TOL[torch.float32])


def test_deepseek_greedy_through_the_kernel_equals_transformers(tiny_deepseek_dir, kernel_on, monkeypatch):
    """A tiny DeepSeek-V3's greedy tokens with its latent attention's short batches attended by the kernel equal
    transformers' ``generate``, n-gram drafts accepted."""
    from specray_test_engine_runs import assert_ngram_greedy_equals_transformers

    calls = _counted(monkeypatch, "short_attention")
    assert_ngram_greedy_equals_transformers(tiny_deepseek_dir, max_tokens=8)
    assert calls
