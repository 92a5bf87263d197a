"""CPU-specific choices of the model layers, in one place so that the layers stay plain.

* Linears. A decode step multiplies a handful of rows by every weight, so on CPU it streams the weights from
  memory. Best first: (1) oneDNN with each weight reordered once, at load, into its blocked layout
  (:func:`pack_weight`): its narrow-M kernels neither repack W on every call (as MKL's gemm does) nor fall back to
  a one-thread gemv, and their cost grows smoothly with the rows, so no padding; (2) unpacked fp32 weights (no
  oneDNN, or a model used before :func:`pack_linear_weights`): ``W @ x^T`` with ``x^T`` as a narrow right-hand
  side, padded to a row count MKL runs fast (:func:`padded_rows`), since ``x @ W^T`` for a few rows does not use
  the memory bandwidth well and MKL's narrow gemm is fast only at some widths. Weights under ``SMALL_WEIGHT``
  values (a small head's layers, tiny test models) take neither: both cost a fixed overhead per call larger than
  so small a matmul, so they run plain ``F.linear``.
* Attention. The padded short-query batch gathers every sequence's context, padded to the longest; on CPU that
  copy costs more than attending once contexts are long, so from ``OWN_MIN_CONTEXT`` tokens short queries attend
  one sequence at a time, reading consecutive blocks in place (:func:`reads_in_place`).
* FP8 experts. PyTorch converts float8 to float one value at a time on CPU, which costs several times an expert's
  matmuls (``benchmarks/bench_fp8_experts.py``), so on CPU a block-FP8 checkpoint's experts are dequantized at
  load unless ``FP8_EXPERTS`` says to keep them (:func:`keeps_fp8_experts`); a GPU keeps them in FP8. The same
  switch keeps an INT8 W8A8 release's experts in int8 (row-scaled 8-bit experts alike).
* Mamba-1's selective scan. Its parallel prefix scan (``gated_deltanet.scanned_selective``) does log2(chunk) times
  the token loop's work to replace one step a token by a few a chunk: on a GPU, where each step is a kernel launch,
  that is the trade to make; on CPU, where a step costs its work alone, the token loop is cheaper at every length
  (docs/benchmarks.md, "Linear attention"), so on CPU long steps keep it (:func:`scans_in_parallel`).
* W8A8 linears. A GPU keeps a row-scaled FP8 release's linears in FP8 (with FP8 tensor cores) and an INT8 W8A8
  release's in INT8, and multiplies them in 8 bits (:mod:`specray.models.w8a8`); on CPU they are dequantized at load
  unless ``FP8_WEIGHTS`` / ``INT8_WEIGHTS`` say to keep them (the tests do, to run that path: torch's CPU kernels
  compute the same math).
* 4-bit weights. PyTorch's CPU kernel for 4-bit weight-only matmuls runs fp32 activations many times slower than
  the dense matmul (``benchmarks/bench_int4.py``), so on CPU a 4-bit release's linears are dequantized at load unless
  ``INT4_WEIGHTS`` says to keep them (:func:`keeps_int4_weights`); a GPU keeps them (tinygemm).

``benchmarks/bench_rows.py`` and ``benchmarks/bench_long_context.py`` measure these thresholds; ``docs/`` keeps
the results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_WEIGHT = 1 << 16  # weights with fewer values run plain F.linear (unpacked, unpadded)
PACK_ROWS_HINT = 8  # the row count oneDNN tunes the blocked layout for (1 was slower at decode batch sizes)
SMALL_BATCH_ROWS = 128  # past this many rows plain x @ W^T is as fast, and later faster
FAST_ROWS = (2, 4, 5, 6, 8, 9, 16)  # row counts MKL's narrow-gemm kernels run fast (AVX2); then multiples of 8
OWN_MIN_CONTEXT = 512  # on CPU, short queries attend one sequence at a time from this longest context
# on CPU, keep a quantized checkpoint's experts as stored (FP8, INT8 W8A8, MXFP4, NVFP4: smaller, slower)
FP8_EXPERTS = False
INT4_WEIGHTS = False  # on CPU, keep a 4-bit release's linears in 4 bits (smaller, far slower: benchmarks/bench_int4.py)
# on CPU, keep an FP8 release's linears in FP8 (the tests: W8A8 as a GPU runs it; block-scaled ones through the
# kernel's reference, fp8_blocks)
FP8_WEIGHTS = False
INT8_WEIGHTS = False  # on CPU, keep an INT8 W8A8 release's linears in INT8 (the tests, likewise)


def keeps_fp8_experts(device: torch.device) -> bool:
    """Whether a mixture of experts on ``device`` keeps a quantized checkpoint's experts as stored (FP8, INT8, MXFP4,
    NVFP4), decoding an expert as tokens reach it."""
    return device.type != "cpu" or FP8_EXPERTS


# ---------------------------------------------------------------------------------------------- linears


def can_pack(device: str, dtype: str) -> bool:
    """Whether weights of this device and dtype get oneDNN's blocked layout (fp32 on a CPU with oneDNN)."""
    return device == "cpu" and dtype == "float32" and torch.backends.mkldnn.is_available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of ``weight`` [N, K] (an opaque mkldnn tensor that only ``cpu_linear`` reads)."""
    assert can_pack(weight.device.type, str(weight.dtype).removeprefix("torch.")), (weight.device, weight.dtype)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def pack_linear(module: nn.Module, keep_dense: bool = False) -> None:
    """Give a linear (any module with ``weight`` and a ``packed`` slot) its blocked copy; drop the dense weight
    unless ``keep_dense`` (a weight tied elsewhere). Load weights before packing: the parameter is gone after."""
    module.packed = pack_weight(module.weight)
    if not keep_dense:
        module.weight = None


def pack_linear_weights(model: nn.Module) -> None:
    """Pack every linear of a loaded fp32 CPU ``model``: the modules with a ``packed`` slot, but for those under
    ``SMALL_WEIGHT`` values. Those that say ``keeps_dense_weight`` (an LM head, whose weight may be the tied
    embedding's) keep it too."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        # (an empty weight: a linear kept in 4 bits)
        if hasattr(module, "packed") and weight is not None and weight.numel() >= SMALL_WEIGHT:
            pack_linear(module, keep_dense=getattr(module, "keeps_dense_weight", False))


def padded_rows(m: int) -> int:
    """The row count ``cpu_linear`` runs ``m`` rows as on unpacked weights: the next of ``FAST_ROWS``, then the
    next multiple of 8 (up to ``SMALL_BATCH_ROWS``; past it, ``m``); zero rows fill the rest. MKL's gemv (one
    row) runs on one thread, and its narrow gemm is fast only at some widths."""
    for rows in FAST_ROWS:
        if m <= rows:
            return rows
    padded = -(-m // 8) * 8
    return padded if padded <= SMALL_BATCH_ROWS else m


def rows_for(device: str, dtype: str):
    """The ``padded_rows`` rule where linears pad (fp32 on CPU, unpacked: no oneDNN), else None (tokens are
    rows): the draft-length policy prices a step by the rows it really runs."""
    return padded_rows if device == "cpu" and dtype == "float32" and not torch.backends.mkldnn.is_available() else None


def cpu_linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
               packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for 2-D ``x`` on CPU: through ``packed`` (``pack_weight(weight)``) when given, else
    ``W @ x^T`` at the row counts of ``padded_rows`` for fp32 decode-sized inputs (on weights of at least
    ``SMALL_WEIGHT`` values)."""
    # x: [M, K]; weight: [N, K] -> [M, N]
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    m = x.shape[0]
    if m > SMALL_BATCH_ROWS or x.dtype != torch.float32 or x.dim() != 2 or weight.numel() < SMALL_WEIGHT:
        return F.linear(x, weight, bias)
    pad = padded_rows(m) - m
    rhs = (F.pad(x, (0, 0, 0, pad)) if pad else x).t()  # [K, padded_rows(M)]
    y = torch.mm(weight, rhs)[:, :m].t().contiguous()  # [M, N]
    return y if bias is None else y + bias


def keeps_int4_weights() -> bool:
    """Whether a CPU model keeps 4-bit weights: asked to (``INT4_WEIGHTS``), with torch's CPU 4-bit weight-only
    matmul there (``_weight_int4pack_mm_for_cpu``)."""
    return INT4_WEIGHTS and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def keeps_w8a8(name: str) -> bool:
    """Whether a CPU model keeps W8A8 linears of format ``name`` ("FP8", "INT8") in 8 bits: asked to
    (``FP8_WEIGHTS``, ``INT8_WEIGHTS``), with torch's CPU kernel for it there."""
    if name == "FP8":
        return FP8_WEIGHTS and hasattr(torch, "_scaled_mm")
    return name == "INT8" and INT8_WEIGHTS and hasattr(torch, "_int_mm")


def int4_pack(q: torch.Tensor, n: int) -> torch.Tensor | None:
    """4-bit values ``q`` [N, K] (uint8) in the CPU kernel's layout; None unless N is a multiple of 16 (its tiles)."""
    if n % 16:
        return None
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    # x: [M, K] -> [M, N], W = (q - 8) s + m per group of K
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, group_size, scales_and_zeros)


# ---------------------------------------------------------------------------------------------- attention


def scans_in_parallel(device: torch.device | str) -> bool:
    """Whether a long Mamba-1 step on ``device`` runs the parallel prefix scan rather than the token loop."""
    return torch.device(device).type != "cpu"


def reads_in_place(device: torch.device | str, context_lens: list[int]) -> bool:
    """Whether short queries attend one sequence at a time, reading contexts in place (CPU, long contexts). The
    padded batch gathers every sequence's context padded to the longest, so the longest decides."""
    return torch.device(device).type == "cpu" and max(context_lens) >= OWN_MIN_CONTEXT
