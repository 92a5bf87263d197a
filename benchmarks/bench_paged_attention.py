"""One layer's paged attention on a GPU: the Triton kernel that reads the cache in place
(specray.models.triton_attention) against the SDPA path it replaces there. A short batch (decode, or the last token
and drafts): the SDPA path gathers every sequence's context, padded to the batch's longest; a prompt's chunk that
continues a context (batch 1 rows): the SDPA path gathers that context (its blocks are not consecutive) and attends
under a [G*q, ctx] mask, the kernel masks by position. Layers: Llama 3.1 8B's (32 query heads on 8 KV heads of 128)
and DeepSeek-V3's absorbed latent attention on one of 8 TP ranks (16 heads over a latent row of 512 + 64), bf16,
blocks of 16 handed out in a random order; each context drawn between half the stated length and all of it, so the
padding the gather pays for shows. Per cell: the median time of a layer's attention (CUDA events) and the bytes the
SDPA path gathers; the kernel's rows are checked against SDPA's first. On a CPU the kernel runs in Triton's
interpreter (numbers meaningless; ``--check`` only).

    python benchmarks/bench_paged_attention.py --batches 1,8,64,256 --contexts 512,2048,8192 --queries 1,5 \
        --chunks 512
    TRITON_INTERPRET=1 python benchmarks/bench_paged_attention.py --device cpu --check  # a smoke run
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from specray.models import triton_attention
from specray.models.attention import SHORT_QUERY_MAX, PagedAttention, build_attention_metadata
from specray.models.deepseek_v3 import LatentAttention
from specray.models.kv_cache import FullAttentionSpec, KVCache, MLAAttentionSpec

BLOCK = 16


def llama3_8b() -> PagedAttention:
    """Llama 3.1 8B's layer: 32 query heads on 8 KV heads of 128."""
    spec = FullAttentionSpec(num_kv_heads=8, head_dim=128)
    return PagedAttention(32, spec, 128**-0.5)


def deepseek_v3() -> PagedAttention:
    """DeepSeek-V3's absorbed latent attention on one of 8 TP ranks: 16 heads over one latent row (512 + 64)."""
    spec = MLAAttentionSpec(kv_lora_rank=512, qk_rope_head_dim=64)
    return LatentAttention(16, spec, 192**-0.5, nope=128, v_dim=128)


LAYERS = {"llama3-8b": llama3_8b, "deepseek-v3": deepseek_v3}


def case(make, batch: int, context: int, queries: int, device: str, dtype: torch.dtype, seed: int = 0):
    """A layer bound to a filled cache and the step's plan and queries."""
    rng = random.Random(seed)
    lens = [rng.randint(context // 2, context) for _ in range(batch)]
    # short queries end their context; a longer chunk continues one (its context before it)
    starts = [n if queries > SHORT_QUERY_MAX else n - queries for n in lens]
    needed = [-(-(s + queries) // BLOCK) for s in starts]
    layer = make().to(device)
    cache = KVCache([layer.kv_spec], sum(needed) + 1, BLOCK, dtype, device)
    cache.layer(0).normal_()
    layer.bind_cache(cache.layer(0), BLOCK)
    free = rng.sample(range(1, sum(needed) + 1), sum(needed))
    tables = [[free.pop() for _ in range(n)] for n in needed]
    meta = build_attention_metadata([queries] * batch, starts, tables, BLOCK, device, read_in_place=False)
    q = torch.randn(batch * queries, layer.num_heads, layer.head_dim, device=device, dtype=dtype)
    return layer, meta, q


def timed(fn, device: str, repeats: int) -> float:
    """Median milliseconds of ``fn()``."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--contexts", default="512,2048,8192", help="longest context per sequence")
    parser.add_argument("--queries", default="1,5", help="new tokens per sequence (1: decode; 5: 4 drafts)")
    parser.add_argument("--chunks", default="512", help="new tokens of a prompt's chunk that continues a context "
                        "(batch 1 rows; '' for none)")
    parser.add_argument("--layers", default=",".join(LAYERS), help=f"comma list of {sorted(LAYERS)}")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--check", action="store_true", help="tiny shapes, compare only (a CPU's smoke run)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.device == "cpu":
        triton_attention.ON_CPU = True
    if args.check:
        args.batches, args.contexts, args.queries, args.chunks, args.repeats = "2", "64", "1,5", "40", 1
    print("| layer | batch | context | new tokens | kernel ms | SDPA path ms | speed-up | bytes the SDPA path gathers |"
          "\n|---|---|---|---|---|---|---|---|")
    cells = [(b, c, n) for b in map(int, args.batches.split(",")) for c in map(int, args.contexts.split(","))
             for n in map(int, args.queries.split(","))]
    cells += [(1, c, n) for c in map(int, args.contexts.split(",")) for n in map(int, filter(None,
                                                                                             args.chunks.split(",")))]
    with torch.inference_mode():
        for name, (batch, context, queries) in ((n, cell) for n in args.layers.split(",") for cell in cells):
            layer, meta, q = case(LAYERS[name], batch, context, queries, args.device, dtype)
            own = queries > SHORT_QUERY_MAX
            assert triton_attention.runs(layer, q, own), "the kernel does not run here (no Triton, or a CPU)"
            step = (lambda: layer._own(q, None, None, meta, 0)) if own else (lambda: layer._short(q, meta))
            ms, rows = {}, {}
            for kernel in (True, False):  # the kernel, then SDPA's path (the kernel switched off)
                triton_attention.ENABLED = kernel
                rows[kernel] = step()
                ms[kernel] = float("nan") if args.check else timed(step, args.device, args.repeats)
            triton_attention.ENABLED = True
            width = layer.kernel_widths()[0]  # each head's output (the latent's part for latent attention)
            ours, ref = (rows[k].view(-1, layer.num_heads, layer.head_dim)[..., :width].float() for k in (True, False))
            torch.testing.assert_close(ours, ref, atol=2e-2, rtol=2e-2)
            slots = meta.own[0].context_len if own else meta.short.num_ctx_blocks * BLOCK
            gathered = 2 * batch * slots * layer.num_kv_heads * layer.head_dim * q.element_size()
            print(f"| {name} | {batch} | {context} | {queries} | {ms[True]:.3f} | {ms[False]:.3f} | "
                  f"{ms[False] / ms[True]:.2f}x | {gathered / 2**20:.1f} MiB |")

if __name__ == "__main__":
    main()
