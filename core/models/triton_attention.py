"""Paged attention as one Triton kernel on a GPU: the short batch (decode, the last token and drafts, a token tree)
and chunks that continue a context (chunked prefill, a prefix-cache hit).

:class:`~specray.models.attention.PagedAttention`'s SDPA path gathers each short sequence's context out of the
paged cache, padded to the batch's longest, into a fresh tensor: every layer copies all the batch's keys and values
once more than attention reads them, and attends over the padding. A continued chunk gathers its context when its
blocks are not consecutive and attends under a [G*q, ctx] mask. This kernel reads the cache in place through the
block table instead, each sequence only up to its own context length.

One program per (sequence b, KV head h, tile of query rows). Its rows are the GQA-folded queries of that KV head
(row ``m = g * Q + j``: query j of query head ``h * G + g``, as ``PagedAttention._fold`` lays them out), so each key
is read once for all G heads that share it. It walks the context ``BLOCK_N`` slot indices at a time; slot index t
of sequence b lives in cache row ``block_table[b, t // block_size] * block_size + t % block_size``. Scores are
``s = scale * q.k`` in float32 (Gemma 2's soft cap: ``s = cap * tanh(s / cap)``), then masked. The short batch
takes the layer's own short mask as the SDPA path does (bool or additive as ALiBi's; PagedAttention's own read as
one row per query, before GQA folding), so every mask kind, a tree's ancestors and a family's own mask mean the
same here; under a sliding window or local chunks a sequence's keys before its lowest query's window or chunk are
skipped. A chunk in causal order at its slot indices is masked by position in the kernel (``MaskKind.allows``:
query j at ``q_start + j``), and a tile of rows skips the keys none of them sees (later ones; those before a
sliding window or the chunk of Llama 4's local attention); any other chunk takes its [q, ctx] mask. Softmax is
online (flash attention's): with ``m`` the running row maximum and ``l`` the running sum of ``exp(s - m)``, a new
tile rescales ``l`` and the output accumulator by ``exp(m_old - m_new)``. A sink logit (GPT-OSS) starts a row at
``m = sink, l = 1``: it joins the softmax's denominator and adds nothing to the output. An FP8 cache's bytes are
decoded to the model's dtype and times the checkpoint's scale as ``PagedAttention._read`` does. A layer says how
its rows are read (``kernel_widths``): DeepSeek's absorbed latent attention is one KV head whose keys are each row's
latent and RoPE part and whose values are the latent alone, so a row is read once for both, and each head's output
is its latent part (the RoPE part of ``out`` is left unwritten: ``LatentAttention._values`` drops it).

A context past ``SPLIT_TOKENS`` slot indices is attended in ranges of that many (flash decoding: a program per
range, so a small batch of long contexts still fills the GPU); each range leaves its unnormalised rows and its
``(m, l)``, and ``combine_splits`` weighs range r by ``exp(m_r - max m)``. The ranges are fixed positions of the
sequence's own context and an empty range weighs exactly 0, so a row's result depends on its own query and context
alone, not on the batch's other sequences (their lengths, the padding to the longest).

It runs where :func:`runs` says so (unless ``SPECRAY_TRITON_ATTENTION=0``): a CUDA tensor and Triton importable
(torch's CUDA wheels bring it), a layer that reads its cache as :class:`PagedAttention` does or says how
(``kernel_widths``), an FP8 cache only from compute capability 8.9, no sparse pick of keys (DeepSeek-V3.2's). A fresh
prefill keeps SDPA's causal kernel. On a CPU the SDPA path stays; the tests run this kernel there through Triton's
interpreter (``TRITON_INTERPRET=1`` before Triton is imported, and :data:`ON_CPU`), against the SDPA path, and
compile every launch it makes for compute capability 8.0 and 9.0 (``tests/kernel_builds.py``). It has never run on a
GPU."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

# SPECRAY_TRITON_ATTENTION=0 turns it off (the SDPA path everywhere): it has never run on a GPU
ENABLED = os.environ.get("SPECRAY_TRITON_ATTENTION", "1") != "0"
ON_CPU = False  # run on CPU tensors too, through Triton's interpreter (the tests; it needs TRITON_INTERPRET=1)
MAX_HEAD_DIM = 512  # the widest value row (DeepSeek's latent: 512) a program holds
MAX_EXTRA_DIM = 128  # key columns past it (the latent's RoPE part: 64)
SPLIT_TOKENS = 512  # longer contexts are attended in ranges of this many slot indices, a program each
# an FP8 cache's format -> the kernel's code for it (0: the model's dtype)
_FP8_CODES = {None: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
_UNBUILT: set[tuple] = set()  # the kernel configurations Triton refused on this machine (never tried again)
logger = logging.getLogger(__name__)
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


def runs(layer, q: torch.Tensor, own: bool = False) -> bool:
    """Whether ``layer`` (a :class:`~specray.models.attention.PagedAttention`) attends its short batch (``own``: a
    chunk that continues a context) with this kernel, for queries ``q`` [T, Hq, D]. A chunk needs the layer's
    mask of own sequences to be PagedAttention's."""
    if not ENABLED or not (q.is_cuda or (ON_CPU and q.device.type == "cpu" and interpreting())) or _triton() is None:
        return False
    value_dim, extra, _ = layer.kernel_widths()
    if q.dtype not in _DTYPES or value_dim > MAX_HEAD_DIM or extra > MAX_EXTRA_DIM or layer.fp8 not in _FP8_CODES:
        return False
    if layer.fp8 is not None and q.is_cuda and not _decodes_fp8(q.device):
        return False
    return _reads_as_paged_attention(type(layer)) and (not own or _keeps_the_base_mask(type(layer), "own_mask"))


@functools.cache
def _decodes_fp8(device: torch.device) -> bool:
    # Triton converts FP8 (e4m3's fp8e4nv) from compute capability 8.9 (Ada, Hopper, Blackwell)
    return torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _keeps_the_base_mask(cls: type, method: str = "short_mask") -> bool:
    # the layer's mask is PagedAttention's own (a subclass's may bias it: ALiBi, Doge)
    from specray.models.attention import PagedAttention

    return getattr(cls, method) is getattr(PagedAttention, method)


@functools.cache
def _reads_as_paged_attention(cls: type) -> bool:
    # a subclass that reads its cache otherwise keeps its own path; one that binds it otherwise must say how the
    # kernel reads its rows (kernel_widths: DeepSeek's latent cache)
    from specray.models.attention import PagedAttention

    names = ("_read", "_gather", "_attend", "_fold", "_unfold", "_short")
    if cls.kernel_widths is PagedAttention.kernel_widths:
        names += ("bind_cache",)
    return all(getattr(cls, name) is getattr(PagedAttention, name) for name in names)


@dataclass
class _Rows:
    """What one launch attends: ``bs`` sequences of ``q_len`` query rows each (the padded short batch, or one own
    sequence's chunk), sequence b's context in blocks ``table[b * num_blocks ..]``, ``ctx[b]`` slot indices long."""

    q: torch.Tensor  # [T, Hq, D]: the rows (token_index picks each padded row's; None: row r is q[r])
    token_index: torch.Tensor | None
    table: torch.Tensor  # [bs * num_blocks] int64 block ids
    num_blocks: int
    ctx: torch.Tensor  # [bs] int32 context lengths
    bs: int
    q_len: int
    mask: torch.Tensor | None  # [bs, 1 or Hkv, Q or G*Q, L] bool or additive; None: by position (``q_start``)
    unfolded: bool  # the mask's rows are queries (one for the G heads), not folded rows
    q_start: int = 0  # with no mask: query j sits at position q_start + j, keys at their slot index (causal, plain)
    first: torch.Tensor | None = None  # [bs] int32: each sequence's first key any of its queries may see


def short_attention(layer, q: torch.Tensor, meta) -> torch.Tensor | None:
    """``layer``'s attention of the step's short batch: q [T, Hq, D] -> [Bs*Q, Hq*D], padded query rows included,
    as ``PagedAttention._short`` returns it; None where the kernel does not build on this GPU for these shapes
    (Triton refused it: logged once, and the caller takes the SDPA path)."""
    sb = meta.short
    # PagedAttention's own mask is the same for a query's G folded rows: read its unfolded rows [Bs, 1, Q, L] (G
    # times fewer bytes); a subclass's own mask as it folds it, [Bs, 1 or Hkv, G*Q, L], bool or additive. (A graph
    # replays a tree step on a graph captured from a chain step: the mask is always a tensor here.)
    unfolded = _keeps_the_base_mask(type(layer))
    mask = meta.short_rows_mask(layer.mask_kind)[:, None] if unfolded else layer.short_mask(meta, q.dtype)
    ctx = meta.cached(("short-context-lens",), _context_lens)  # [Bs] int32
    kind = layer.mask_kind
    first = None  # a sliding window or local chunks: the keys before each sequence's are skipped, not masked
    if kind.window is not None or kind.chunk is not None:
        first = meta.cached(("short-first-keys", kind), lambda m: _first_keys(m, kind))
    return _attend(layer, _Rows(q, sb.token_index, sb.block_index, sb.num_ctx_blocks, ctx, sb.num_seqs,
                                sb.max_query_len, mask, unfolded, first=first), meta)


def own_attention(layer, q: torch.Tensor, meta, i: int) -> torch.Tensor | None:
    """``layer``'s attention of own sequence ``i``, a chunk that continues a context (not a fresh prefill):
    q [T, Hq, D] -> [q_len, Hq*D] as ``PagedAttention._own`` returns it, or None as :func:`short_attention`'s. Its
    context is read in place whether or not its blocks are consecutive; a chunk in causal order at its slot indices
    is masked by position in the kernel, which then skips keys no row of a tile sees (later ones; before a sliding
    window or the chunk of Llama 4's local attention), else by its [q, ctx] mask."""
    seq = meta.own[i]
    assert not seq.fresh, "a fresh prefill attends its own k/v (SDPA's causal kernel)"
    table = seq.block_index
    if table is None:  # consecutive blocks: their ids
        table = meta.cached(("own-blocks", i), lambda m: _consecutive_blocks(m, i))
    ctx = meta.cached(("own-context-len", i), lambda m: _own_context_len(m, i))
    mask = None  # by position
    if not meta.plain(seq.seq_id):  # [1, 1, q, ctx]
        mask = meta.cached(("own-rows", i, layer.mask_kind), lambda m: m.own_allowed(i, layer.mask_kind))[None, None]
    return _attend(layer, _Rows(q[seq.token_start : seq.token_end], None, table, table.shape[0], ctx, 1,
                                seq.query_len, mask, unfolded=True, q_start=seq.start_pos), meta)


def _attend(layer, r: _Rows, meta) -> torch.Tensor | None:
    groups, hkv = layer.groups, layer.num_kv_heads
    d, extra, v_is_k = layer.kernel_widths()  # the values' width (each head's output), key columns past it
    q = r.q if r.q.stride(-1) == 1 else r.q.contiguous()
    mask = r.mask
    if mask is not None:
        assert mask.shape[0] == r.bs and mask.shape[1] in (1, hkv), (tuple(mask.shape), r.bs, hkv)
        assert mask.shape[2] == (1 if r.unfolded else groups) * r.q_len, (tuple(mask.shape), groups, r.q_len)
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)
    kernels = _triton()
    triton = kernels.triton
    k_cache, v_cache = layer.k_cache, layer.v_cache  # [Hkv, slots, D]
    out = q.new_empty(r.bs * r.q_len, layer.num_heads * layer.head_dim)  # a head's extra columns left unwritten
    rows = groups * r.q_len
    # the accumulator [BLOCK_M, BLOCK_D] in float32 stays in registers; the K tile [BLOCK_N, BLOCK_D] in shared memory
    block_d = max(16, triton.next_power_of_2(d))
    block_m = min(64 if block_d <= 128 else 32 if block_d <= 256 else 16, max(16, triton.next_power_of_2(rows)))
    block_n = 64 if block_d <= 64 else 32 if block_d <= 256 else 16
    row_tiles = triton.cdiv(rows, block_m)
    # contexts past SPLIT_TOKENS go in ranges of that many slot indices, a program each, then combine_splits: the
    # ranges are fixed positions of each sequence's own context, so its rows do not depend on the batch's longest
    length = r.num_blocks * meta.block_size  # the longest context's blocks (a range past a context is empty: 0)
    splits = triton.cdiv(length, SPLIT_TOKENS) if length > SPLIT_TOKENS else 1
    part = stats = out  # (unused without splits)
    if splits > 1:
        part = torch.empty(splits, r.bs * r.q_len, layer.num_heads * d, dtype=torch.float32, device=q.device)
        stats = torch.empty(splits, r.bs * r.q_len, layer.num_heads, 2, dtype=torch.float32, device=q.device)
    sinks = getattr(layer, "sinks", None)
    scaled = layer.fp8 is not None and (layer.k_scale != 1.0 or layer.v_scale != 1.0)
    kind = layer.mask_kind
    positional = mask is None
    config = (q.dtype, k_cache.dtype, layer.fp8, None if positional else mask.dtype, r.unfolded, block_m, block_n,
              block_d, extra, v_is_k, splits > 1, sinks is not None, layer.softcap is not None, scaled,
              r.first is not None)
    if config in _UNBUILT:
        return None
    dummy = r.ctx  # (a pointer the kernel does not read)
    try:
        kernels.paged_attention[(r.bs, hkv * row_tiles, splits)](
            q, q.stride(0), q.stride(1),
            dummy if r.token_index is None else r.token_index, r.token_index is not None,
            k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), v_is_k,
            extra, extra > 0, max(16, triton.next_power_of_2(extra)),
            _FP8_CODES[layer.fp8], float(layer.k_scale), float(layer.v_scale), scaled,
            r.table, r.num_blocks, meta.block_size, r.ctx, dummy if r.first is None else r.first, r.first is not None,
            dummy if positional else mask, *((0, 0, 0, 0) if positional else (
                mask.stride(0), mask.stride(1) if mask.shape[1] > 1 else 0, mask.stride(2), mask.stride(3))),
            not positional and mask.dtype == torch.uint8, r.unfolded,
            positional, r.q_start, kind.window or 0, kind.window is not None, kind.chunk or 0, kind.chunk is not None,
            dummy if sinks is None else sinks, sinks is not None,
            out, out.stride(0), layer.head_dim,
            part, stats, part.stride(0), part.stride(1) if splits > 1 else 0, stats.stride(0),
            stats.stride(1) if splits > 1 else 0, SPLIT_TOKENS, splits > 1,
            float(layer.scale), float(layer.softcap or 0.0), layer.softcap is not None,
            r.q_len, groups, d, rows, row_tiles,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
            # float32 products in float32 (no TF32: the tests' references are float32); Triton's interpreter
            # cannot multiply 16-bit floats, so there every product is float32
            FP32_DOT=q.dtype == torch.float32 or interpreting(),
        )
        if splits > 1:
            kernels.combine_splits[(r.bs * r.q_len, layer.num_heads)](
                part, stats, part.stride(0), part.stride(1), stats.stride(0), stats.stride(1),
                out, out.stride(0), layer.head_dim, splits, d, BLOCK_S=16, BLOCK_D=block_d)
    except triton.errors.TritonError as e:  # compiling (or fitting) it for this GPU failed
        if interpreting():  # the tests: a fault of the kernel's, not a GPU's limit
            raise
        _UNBUILT.add(config)
        logger.warning("the Triton attention kernel does not build for %s on %s (%s); such steps attend by SDPA "
                       "instead", config, q.device, e)
        return None
    return out


def _context_lens(meta) -> torch.Tensor:
    return torch.tensor([meta.context_lens[i] for i in meta.short.seq_ids], dtype=torch.int32,
                        device=meta.short.block_index.device)


def _first_keys(meta, kind) -> torch.Tensor:
    """[Bs] int32: per short sequence, the first slot index any of its queries may see under ``kind`` (the lowest
    query position's window or chunk; cached keys sit at their slot index), never past its first new token."""
    firsts = []
    for i in meta.short.seq_ids:
        start = meta.start_positions[i]
        lowest = min(meta.seq_positions[i]) if meta.seq_positions is not None else start
        bound = lowest - kind.window + 1 if kind.window is not None else 0
        if kind.chunk is not None:
            bound = max(bound, lowest // kind.chunk * kind.chunk)
        firsts.append(min(start, max(0, bound)))
    return torch.tensor(firsts, dtype=torch.int32, device=meta.short.block_index.device)


def _own_context_len(meta, i: int) -> torch.Tensor:
    return torch.tensor([meta.own[i].context_len], dtype=torch.int32, device=meta.positions.device)


def _consecutive_blocks(meta, i: int) -> torch.Tensor:
    seq = meta.own[i]
    first = seq.first_slot // meta.block_size
    return torch.arange(first, first + -(-seq.context_len // meta.block_size), device=meta.positions.device)
