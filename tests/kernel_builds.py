"""Builds the Triton attention kernels for GPUs on a machine without one. The host code
(specray.models.triton_attention) is run for a set of layers and steps on the CPU with the kernels' launches recorded
instead of made: short batches and continued chunks; bf16, fp16, fp32 and both FP8 caches; sinks, a soft cap, ALiBi's
additive bias, a tree's mask, a sliding window, local chunks, MQA, head dims 64 to 256, DeepSeek's latent attention
(values 512 wide, keys 576), contexts split in ranges. Each recorded launch is then compiled by Triton for compute
capability 9.0 (and the first for 8.0 too), down to a cubin (Triton's wheel brings ptxas), and its shared memory is
held to that GPU's limit. Prints one JSON line per build. Run as a script without TRITON_INTERPRET
(tests/test_triton_attention.py runs it in a subprocess)."""
from __future__ import annotations

import json
import os
import random
import sys

assert not os.environ.get("TRITON_INTERPRET"), "compiling needs Triton without its interpreter"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from specray.models import triton_attention  # noqa: E402
from specray.models.alibi import AlibiAttention  # noqa: E402
from specray.models.attention import PagedAttention, build_attention_metadata  # noqa: E402
from specray.models.deepseek_v3 import LatentAttention  # noqa: E402
from specray.models.kv_cache import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCache,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

SHARED_LIMIT = {80: 166912, 90: 232448}  # bytes of shared memory a block may take (A100, H100 / H200)
POINTERS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
            torch.int32: "i32", torch.uint8: "u8"}


class Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.kernel, args, kwargs))


def source(kernel, args, kwargs) -> tuple[ASTSource, str]:
    """The kernel specialised as this launch would specialise it (pointer types, constexpr values), and a key of
    that specialisation."""
    values = dict(zip(kernel.arg_names, args)) | kwargs
    constexprs = {p.name for p in kernel.params if p.is_constexpr}
    signature, fixed = {}, {}
    for i, name in enumerate(kernel.arg_names):
        value = values[name]
        if name in constexprs:
            signature[name], fixed[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + POINTERS[value.dtype]
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    return ASTSource(fn=kernel, signature=signature, constexprs=fixed), repr((signature, sorted(fixed.items())))


def layer_and_cache(spec, heads: int, dtype, fp8=None, cls=PagedAttention, **kw):
    layer = cls(heads, spec, spec.head_dim**-0.5, **kw)
    cache = KVCache([spec], 80, 16, dtype, "cpu", fp8=fp8)
    layer.bind_cache(cache.layer(0), 16, fp8)
    if fp8 is not None:
        layer.set_kv_scales(0.5, 2.0)
    return layer


def latent():
    spec = MLAAttentionSpec(kv_lora_rank=512, qk_rope_head_dim=64)
    layer = LatentAttention(16, spec, 192**-0.5, nope=128, v_dim=128)
    cache = KVCache([spec], 80, 16, torch.bfloat16, "cpu", fp8=torch.float8_e4m3fn)
    layer.bind_cache(cache.layer(0), 16, torch.float8_e4m3fn)
    return layer


def step(query_lens, starts, tree: bool = False):
    free = random.Random(0).sample(range(1, 80), 79)
    tables = [[free.pop() for _ in range(-(-(s + q) // 16))] for s, q in zip(starts, query_lens)]
    positions = ancestors = None
    if tree:
        positions = [s + min(j, 1) for s, q in zip(starts, query_lens) for j in range(q)]
        ancestors = [torch.eye(q, dtype=torch.bool) | (torch.arange(q)[None, :] == 0) for q in query_lens]
    return build_attention_metadata(list(query_lens), list(starts), tables, 16, "cpu", positions=positions,
                                    ancestors=ancestors, read_in_place=False)


def cases():
    """(name, layer, meta, own sequence index or None for the short batch)."""
    full = FullAttentionSpec(num_kv_heads=8, head_dim=128)
    yield ("bf16 short, tree, window, sinks, soft cap, split",
           layer_and_cache(SlidingWindowSpec(num_kv_heads=8, head_dim=128, sliding_window=64), 32, torch.bfloat16,
                           softcap=30.0, sinks=True), step([5, 1], [700, 40], tree=True), None)
    yield ("fp16 short, MQA, head dim 256, local chunks",
           layer_and_cache(ChunkedLocalAttentionSpec(num_kv_heads=1, head_dim=256, attention_chunk_size=32), 8,
                           torch.float16), step([4, 4], [90, 10]), None)
    yield ("fp32 short, ALiBi's bias, head dim 64",
           layer_and_cache(FullAttentionSpec(num_kv_heads=2, head_dim=64), 8, torch.float32, cls=AlibiAttention,
                           slopes=[2.0 ** -i for i in range(1, 9)]), step([2, 3], [50, 20]), None)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        yield (f"bf16 short, {fp8} cache", layer_and_cache(full, 32, torch.bfloat16, fp8=fp8), step([1, 5], [60, 9]),
               None)
    yield ("bf16 short, DeepSeek's latent attention (512 + 64, 16 heads), FP8 cache, split", latent(),
           step([3, 2], [650, 30]), None)
    yield ("bf16 chunk, by position, window, split",
           layer_and_cache(SlidingWindowSpec(num_kv_heads=8, head_dim=128, sliding_window=256), 32, torch.bfloat16),
           step([64], [600]), 0)
    yield ("fp16 chunk, a tree's mask", layer_and_cache(FullAttentionSpec(num_kv_heads=4, head_dim=64), 16,
                                                        torch.float16), step([24], [100], tree=True), 0)


def main() -> None:
    kernels = triton_attention._triton()
    calls: list = []
    kernels.paged_attention = Recorder(kernels.paged_attention, calls)
    kernels.combine_splits = Recorder(kernels.combine_splits, calls)
    builds = []
    for name, layer, meta, own in cases():
        q = torch.zeros(meta.num_tokens, layer.num_heads, layer.head_dim, dtype=layer.k_cache.dtype
                        if layer.fp8 is None else torch.bfloat16)
        first = len(calls)
        with torch.inference_mode():
            out = (triton_attention.short_attention(layer, q, meta) if own is None
                   else triton_attention.own_attention(layer, q, meta, own))
        assert out is not None and len(calls) > first, name
        for kernel, args, kwargs in calls[first:]:
            archs = (90, 80) if not builds else (90,)
            builds += [(name, kernel, args, kwargs, arch) for arch in archs]
    seen = set()
    for name, kernel, args, kwargs, arch in builds:
        src, key = source(kernel, args, kwargs)
        key = (kernel.__name__, arch, key)
        if key in seen:
            continue
        seen.add(key)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
        shared = compiled.metadata.shared
        print(json.dumps({"case": name, "kernel": kernel.__name__, "arch": arch, "shared": shared,
                          "fits": shared <= SHARED_LIMIT[arch], "cubin": len(compiled.asm["cubin"])}), flush=True)
        if shared > SHARED_LIMIT[arch]:
            sys.exit(1)


if __name__ == "__main__":
    main()
