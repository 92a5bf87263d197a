"""The short-query batch's attention (decode, last token + drafts, a token tree) as one Triton kernel on a GPU.

:class:`~specray.models.attention.PagedAttention`'s padded path gathers each sequence's context out of the paged
cache, padded to the batch's longest, into a fresh tensor for SDPA: every layer copies all the batch's keys and
values once more than attention reads them, and attends over the padding. This kernel reads them in place through
the block table instead, each sequence only up to its own context length.

One program per (sequence b, KV head h, tile of query rows). Its rows are the GQA-folded queries of that KV head
(row ``m = g * Q + j``: query j of query head ``h * G + g``, as ``PagedAttention._fold`` lays them out), so each key
is read once for all G heads that share it. It walks the context ``BLOCK_N`` slot indices at a time; slot index t
of sequence b lives in cache row ``block_table[b, t // block_size] * block_size + t % block_size``. Scores are
``s = scale * q.k`` in float32 (Gemma 2's soft cap: ``s = cap * tanh(s / cap)``), then the layer's own short mask
(bool, or additive as ALiBi's) exactly as the SDPA path takes it, so every mask kind, a tree's ancestors and a
family's own mask mean the same here. Softmax is online (flash attention's): with ``m`` the running row maximum
and ``l`` the running sum of ``exp(s - m)``, a new tile rescales ``l`` and the output accumulator by ``exp(m_old -
m_new)``. A sink logit (GPT-OSS) starts a row at ``m = sink, l = 1``: it joins the softmax's denominator and adds
nothing to the output. Each row's result depends on its own query alone, so a token's attention does not change
with the batch or draft count it is verified in.

It runs where :func:`runs` says so (unless ``SPECRAY_TRITON_ATTENTION=0``): a CUDA tensor and Triton importable
(torch's CUDA wheels bring it), a layer that reads its cache as :class:`PagedAttention` does (no FP8 cache, no
latent cache of its own). On a CPU the SDPA path stays; the tests run this kernel there through Triton's interpreter
(``TRITON_INTERPRET=1`` before Triton is imported, and :data:`ON_CPU`), against the SDPA path. It has never run on a
GPU.
"""

from __future__ import annotations

import functools
import os

import torch

# SPECRAY_TRITON_ATTENTION=0 turns it off (the SDPA path everywhere): it has never run on a GPU
ENABLED = os.environ.get("SPECRAY_TRITON_ATTENTION", "1") != "0"
ON_CPU = False  # run on CPU tensors too, through Triton's interpreter (the tests; it needs TRITON_INTERPRET=1)
MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _triton():
    """Triton and the kernel, imported at the first use (None without Triton: CPU-only installs)."""
    try:
        from specray.models import _triton_attention_kernel
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        return None
    return _triton_attention_kernel


def interpreting() -> bool:
    """Whether Triton was imported with its interpreter on (kernels then run on CPU tensors, in numpy)."""
    kernels = _triton()
    return kernels is not None and bool(kernels.triton.knobs.runtime.interpret)


def runs(layer, q: torch.Tensor) -> bool:
    """Whether ``layer`` (a :class:`~specray.models.attention.PagedAttention`) attends its short batch with this
    kernel, for queries ``q`` [T, Hq, D]."""
    if not ENABLED or not (q.is_cuda or (ON_CPU and q.device.type == "cpu" and interpreting())) or _triton() is None:
        return False
    if layer.fp8 is not None or q.dtype not in _DTYPES or layer.head_dim > MAX_HEAD_DIM:
        return False
    return _reads_as_paged_attention(type(layer))


@functools.cache
def _reads_as_paged_attention(cls: type) -> bool:
    # a subclass that keeps or reads its cache otherwise (DeepSeek's latent cache) keeps its own path
    from specray.models.attention import PagedAttention

    return all(getattr(cls, name) is getattr(PagedAttention, name)
               for name in ("bind_cache", "_read", "_gather", "_attend", "_fold", "_unfold", "_short"))


def short_attention(layer, q: torch.Tensor, meta) -> torch.Tensor:
    """``layer``'s attention of the step's short batch: q [T, Hq, D] -> [Bs*Q, Hq*D], padded query rows included,
    as ``PagedAttention._short`` returns it."""
    sb = meta.short
    bs, q_len, groups, hkv, d = sb.num_seqs, sb.max_query_len, layer.groups, layer.num_kv_heads, layer.head_dim
    if q.stride(-1) != 1:
        q = q.contiguous()
    mask = layer.short_mask(meta, q.dtype)  # [Bs, 1 or Hkv, G*Q, L], bool or additive
    assert mask.shape[0] == bs and mask.shape[1] in (1, hkv) and mask.shape[2] == groups * q_len, (
        tuple(mask.shape), bs, hkv, groups, q_len)
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    ctx = meta.cached(("short-context-lens",), _context_lens)  # [Bs] int32
    kernels = _triton()
    triton = kernels.triton
    k_cache, v_cache = layer.k_cache, layer.v_cache  # [Hkv, slots, D]
    out = q.new_empty(bs * q_len, layer.num_heads * d)
    rows = groups * q_len
    block_m = min(64 if d <= 128 else 32, max(16, triton.next_power_of_2(rows)))  # the accumulator: registers
    block_d = max(16, triton.next_power_of_2(d))
    block_n = 64 if block_d <= 64 else 32
    token_index = sb.token_index
    sinks = getattr(layer, "sinks", None)
    grid = (bs, hkv, triton.cdiv(rows, block_m))
    kernels.paged_short_attention[grid](
        q, q.stride(0), q.stride(1),
        token_index if token_index is not None else ctx, token_index is not None,
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        sb.block_index, sb.num_ctx_blocks, meta.block_size, ctx,
        mask, mask.stride(0), mask.stride(1) if mask.shape[1] > 1 else 0, mask.stride(2), mask.stride(3),
        mask.dtype == torch.uint8,
        sinks if sinks is not None else ctx, sinks is not None,
        out, out.stride(0),
        float(layer.scale), float(layer.softcap or 0.0), layer.softcap is not None,
        q_len, groups, d, rows,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        # float32 products in float32 (no TF32: the tests' references are float32); Triton's interpreter cannot
        # multiply 16-bit floats, so there every product is float32
        FP32_DOT=q.dtype == torch.float32 or interpreting(),
    )
    return out


def _context_lens(meta) -> torch.Tensor:
    return torch.tensor([meta.context_lens[i] for i in meta.short.seq_ids], dtype=torch.int32,
                        device=meta.short.block_index.device)
