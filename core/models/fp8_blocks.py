"""Block-scaled FP8 linears kept in FP8 and multiplied in FP8, as vLLM runs DeepSeek-V3/R1's and Qwen3's ``-FP8``
releases (``quant_method: fp8`` with ``weight_block_size: [128, 128]``; llm-compressor's ``strategy: block``).

The math, per linear ``y = x W^T``: the weight is stored as e4m3 values ``Wq`` [N, K] with one scale per block of
``b0`` rows by ``b1`` columns (``s_w`` [N / b0, K / b1]: ``W = Wq * s_w`` over each block). At run time each row of
``x`` is quantized per group of ``b1`` columns, the groups the weight's column blocks are: ``s_x = max|group| / 448``
([M, K / b1]), ``xq = x / s_x`` rounded to e4m3. Then for each column block ``j``, the exact products of the 8-bit
values are summed in float32 and scaled by both scales:
``y[m, n] = sum_j s_x[m, j] * s_w[n / b0, j] * sum_{k in block j} xq[m, k] Wq[n, k]``. A row's groups depend on that
row alone, so a token's output does not depend on the rows batched with it.

The kernel is torch's block-wise scaled matmul (``F.scaled_mm`` with ``BlockWise1x128`` activations and
``BlockWise128x128`` weights: cuBLASLt on Hopper and later, blocks of 128 only), used on a device only once it has
run there and matched :func:`reference_matmul` (:func:`kernel_runs`, tried once per device and dtype); a CUDA device
where it does not keeps these weights dequantized at load (dense matmuls), as before. :func:`reference_matmul`
computes the formula above with torch's generic ops, one column block at a time: on a CPU, when
:mod:`specray.models.cpu_kernels` asks (``FP8_WEIGHTS``: the tests, with blocks of any size), it is what runs; it is
the truth the kernel is checked against, not a fast path. A linear whose sides are not whole blocks, or whose share
on a TP rank (or part of a merged linear) does not start and end on a block's edge, is dequantized at load.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from specray.models import cpu_kernels

logger = logging.getLogger(__name__)

E4M3_MAX = 448.0
KERNEL_BLOCK = (128, 128)  # the only block torch's block-wise kernel takes
SCALE_ALIGN = 4  # the kernel reads the weight's scales with their column blocks padded to a multiple of this
ROW_ALIGN = 4  # and the activations' rows (their scales' leading dimension) padded to a multiple of this


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (K a multiple of ``group``) -> (xq [M, K] e4m3, s_x [M, K / group] float32): each group of
    ``group`` columns of a row over its own scale max|group| / 448."""
    m, k = x.shape
    groups = x.float().view(m, k // group, group)
    scale = groups.abs().amax(-1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    xq = (groups / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return xq.view(m, k), scale.view(m, k // group)


def reference_matmul(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The module docstring's formula: ``xq`` [M, K] e4m3 over ``x_scale`` [M, K / b1], ``w`` [N, K] e4m3 over
    ``w_scale`` [N / b0, K / b1] -> [M, N] in ``dtype``."""
    (m, k), n, (b0, b1) = xq.shape, w.shape[0], block
    out = torch.zeros(m, n, device=xq.device)
    row_scales = w_scale.float().repeat_interleave(b0, 0)  # [N, K / b1]: each row's scale in each column block
    for j in range(k // b1):
        cols = slice(j * b1, (j + 1) * b1)
        # the products of two e4m3 values are exact in float32; their sums are float32's, as the kernel's
        sums = xq[:, cols].float() @ w[:, cols].float().t()
        out += sums * x_scale[:, j: j + 1] * row_scales[:, j]
    return out.to(dtype)


def _kernel_matmul(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """torch's block-wise kernel: ``w_scale`` already in its layout (:func:`kernel_scales`); the activations' rows
    padded to a multiple of :data:`ROW_ALIGN` and their scales laid out with the rows outermost-fastest (the
    kernel's "outer-dim-major")."""
    m = xq.shape[0]
    if m % ROW_ALIGN:
        pad = ROW_ALIGN - m % ROW_ALIGN
        xq = F.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(xq.dtype)  # (zero rows: e4m3's zero is byte 0)
        x_scale = F.pad(x_scale, (0, 0, 0, pad), value=1.0)
    a_scale = x_scale.t().contiguous().t()  # [M, K / 128] with stride (1, M)
    out = F.scaled_mm(xq, w.t(), a_scale, F.ScalingType.BlockWise1x128, w_scale.t(), F.ScalingType.BlockWise128x128,
                      output_dtype=dtype)
    return out[:m]


def kernel_scales(w_scale: torch.Tensor) -> torch.Tensor:
    """A weight's block scales [N / 128, L] as the kernel reads them: the column blocks padded with zeros to a
    multiple of :data:`SCALE_ALIGN` ([N / 128, L4], contiguous; the kernel takes its transpose, L4 fastest)."""
    pad = -w_scale.shape[1] % SCALE_ALIGN
    return F.pad(w_scale.float(), (0, pad)).contiguous()


class BlockScaled:
    """One linear's e4m3 values ``weight`` [out, in] and their block scales ``scale`` [ceil(out / b0), ceil(in / b1)]
    (float32), as the checkpoint stores them. Read like a safetensors slice (``get_shape()``, ``w[index]``: the
    dequantized float32 weight), so a loader that wants a dense weight gets one; :meth:`rows` and :meth:`cols` cut
    it on blocks' edges without dequantizing (None where a cut is not on one)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
        self.weight, self.scale, self.block = weight, scale, tuple(block)

    def get_shape(self) -> list[int]:
        return list(self.weight.shape)

    def get_dtype(self) -> str:
        return "F32"

    def dense(self) -> torch.Tensor:
        (rows, cols), (b0, b1) = self.weight.shape, self.block
        full = self.scale.float().repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
        return self.weight.float() * full

    def __getitem__(self, index) -> torch.Tensor:
        return self.dense()[index]

    def rows(self, start: int, count: int) -> "BlockScaled | None":
        cut = _blocks(start, count, self.weight.shape[0], self.block[0])
        return None if cut is None else BlockScaled(self.weight[start: start + count], self.scale[cut], self.block)

    def cols(self, start: int, count: int) -> "BlockScaled | None":
        cut = _blocks(start, count, self.weight.shape[1], self.block[1])
        return None if cut is None else BlockScaled(self.weight[:, start: start + count], self.scale[:, cut],
                                                    self.block)

    def staging(self, rows: int, cols: int) -> "BlockScaledStaging":
        return BlockScaledStaging(rows, cols, self.block)


def _blocks(start: int, count: int, size: int, block: int) -> slice | None:
    """The blocks of ``block`` that rows (or columns) ``start .. start + count`` of ``size`` are, or None where the
    cut is not on blocks' edges (the last block of ``size`` may be partial)."""
    end = start + count
    if start % block or (end % block and end != size):
        return None
    return slice(start // block, -(-end // block))


class BlockScaledStaging:
    """A linear's e4m3 values and block scales as its parts load (a merged linear's each at its rows), until kept."""

    def __init__(self, rows: int, cols: int, block: tuple[int, int]):
        self.weight = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
        self.scale = torch.zeros(-(-rows // block[0]), -(-cols // block[1]))
        self.block = block

    def fits(self, w, offset: int) -> bool:
        """Whether ``w`` can sit at rows ``offset ..``: its block and width ours, and its rows whole blocks of
        ours (a part's partial last block only at our end)."""
        return (isinstance(w, BlockScaled) and w.block == self.block and w.weight.shape[1] == self.weight.shape[1]
                and _blocks(offset, w.weight.shape[0], self.weight.shape[0], self.block[0]) is not None)

    def put(self, offset: int, w: BlockScaled) -> None:
        self.weight[offset: offset + w.weight.shape[0]] = w.weight
        self.scale[_blocks(offset, w.weight.shape[0], self.weight.shape[0], self.block[0])] = w.scale.float()

    def dense(self) -> torch.Tensor:
        return BlockScaled(self.weight, self.scale, self.block).dense()

    def kept(self, device: torch.device, dtype: torch.dtype) -> "BlockFP8Linear | None":
        return pack_block_fp8(BlockScaled(self.weight, self.scale, self.block), device, dtype)


class BlockFP8Linear(torch.nn.Module):
    """A linear's weight [N, K] kept in FP8 with its block scales (module docstring): ``weight`` [N, K] e4m3,
    ``scale`` [N / b0, K / b1] float32, and for torch's kernel (``fast``) the scales in its layout
    (``kernel_scale``)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], fast: bool):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("kernel_scale", kernel_scales(scale) if fast else None)
        self.block, self.fast = block, fast

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return matmul_blocks(x, self.weight, self.scale, self.block, self.kernel_scale if self.fast else None)


def matmul_blocks(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int],
                  kernel_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] times a block-scaled FP8 weight ``w`` [N, K] (``w_scale`` [N / b0, K / b1]) -> [M, N] in x's
    dtype: each row's groups of b1 columns over their own scales, times the weight's blocks; through torch's kernel
    where ``kernel_scale`` (the scales in its layout, :func:`kernel_scales`) is given, else the reference."""
    xq, x_scale = quantize_groups(x, block[1])
    if kernel_scale is not None:
        return _kernel_matmul(xq, x_scale, w, kernel_scale, x.dtype)
    return reference_matmul(xq, x_scale, w, w_scale, block, x.dtype)


def pack_block_fp8(w: BlockScaled, device: torch.device, dtype: torch.dtype) -> BlockFP8Linear | None:
    """``w`` kept for the block-wise matmul on ``device`` (its kernel where it runs, :func:`kernel_runs`, else
    :func:`reference_matmul`); None where its sides are not whole blocks."""
    (n, k), (b0, b1) = w.weight.shape, w.block
    if n % b0 or k % b1:
        return None
    device = torch.device(device)
    fast = device.type == "cuda" and w.block == KERNEL_BLOCK and kernel_runs(device, dtype)  # (cuBLASLt's)
    return BlockFP8Linear(w.weight.to(device).contiguous(), w.scale.float().to(device).contiguous(), w.block, fast)


def keeps_block_fp8(block: tuple[int, int], device: torch.device, dtype: torch.dtype,
                    capability: tuple[int, int] | None = None) -> bool:
    """Whether a model of ``dtype`` on ``device`` keeps a block-scaled FP8 release's linears in FP8: on CUDA (not
    ROCm) of compute capability 9.0 or more in bfloat16, blocks of 128 x 128, where torch's block-wise kernel runs
    and matches the reference (:func:`kernel_runs`); on a CPU when :mod:`specray.models.cpu_kernels` asks (through
    :func:`reference_matmul`); elsewhere they are dequantized at load."""
    if device.type == "cuda":
        if torch.version.hip is not None or dtype != torch.bfloat16 or tuple(block) != KERNEL_BLOCK:
            return False
        return (capability or torch.cuda.get_device_capability(device)) >= (9, 0) and kernel_runs(device, dtype)
    return device.type == "cpu" and cpu_kernels.keeps_w8a8("FP8") and dtype in (torch.float32, torch.bfloat16)


_RUNS: dict[tuple[str, torch.dtype], bool] = {}


def kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's block-wise kernel runs on ``device`` with ``dtype`` outputs and gives
    :func:`reference_matmul`'s result (within ``dtype``'s rounding) on a random weight of two by two blocks and six
    rows (tried once): where it raises, or differs, the weights stay dequantized, with a warning saying why."""
    key = (str(device), dtype)
    if key not in _RUNS:
        g = torch.Generator().manual_seed(0)
        w = BlockScaled((torch.randn(256, 256, generator=g) * 64).to(torch.float8_e4m3fn),
                        torch.rand(2, 2, generator=g) / 64 + 1e-3, KERNEL_BLOCK)
        x = torch.randn(6, 256, generator=g).to(device, dtype)
        try:
            xq, x_scale = quantize_groups(x, KERNEL_BLOCK[1])
            weight, scale = w.weight.to(device), w.scale.to(device)
            got = _kernel_matmul(xq, x_scale, weight, kernel_scales(scale), dtype).float()
            want = reference_matmul(xq, x_scale, weight, scale, KERNEL_BLOCK, torch.float32)
            error = float((got - want).abs().max() / want.abs().max())
            _RUNS[key] = error < 2e-2
            if not _RUNS[key]:
                logger.warning("block-scaled FP8 linears are dequantized at load on %s: torch %s's block-wise scaled "
                               "matmul differs from the reference there (relative error %.3g)", device,
                               torch.__version__, error)
        except (RuntimeError, NotImplementedError, ValueError) as err:
            logger.warning("block-scaled FP8 linears are dequantized at load on %s: torch %s's block-wise scaled "
                           "matmul does not run there (%s)", device, torch.__version__,
                           str(err).splitlines()[0][:200])
            _RUNS[key] = False
    return _RUNS[key]


def random_block_fp8(rows: int, cols: int, limit: float, block: tuple[int, int], device: torch.device
                     ) -> BlockScaled:
    """A random block-scaled FP8 weight [rows, cols] of values in [-limit, limit]: a dummy model's
    (``load_format="dummy"``) linear kept as a block-scaled release's would be."""
    values = ((torch.rand(rows, cols, device=device) * 2 - 1) * E4M3_MAX).to(torch.float8_e4m3fn)
    scale = torch.full((-(-rows // block[0]), -(-cols // block[1])), limit / E4M3_MAX, device=device)
    return BlockScaled(values, scale, block)
