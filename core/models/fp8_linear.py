"""FP8 linears kept in FP8 (W8A8): a checkpoint's float8 weights with one scale per output row or per tensor
(llm-compressor's ``-FP8`` / ``-FP8-dynamic`` releases, ``strategy: channel`` or ``tensor``; ``quant_method: fp8``
without a block size) multiplied by torch's scaled matmul (``torch._scaled_mm``, row-wise scales), as vLLM runs
them on GPUs with FP8 tensor cores.

The math, per linear ``y = x W^T`` with ``W = Wq * s_w`` (``s_w`` [N], one per output row; a per-tensor scale is
that number on every row): each row of ``x`` is quantized at run time with its own scale ``s_x = max|x_row| / 448``
(e4m3's largest value), ``xq = x / s_x`` rounded to e4m3, and ``y = (xq Wq^T) * s_x * s_w^T``, the products summed in
float32 by the kernel. The activations' rounding (three mantissa bits, a row's scale set by its largest value) is
the accuracy this trades for the weights' half of bf16's bytes and FP8's matmul rate; each row's scale depends on
that row alone, so a token's output does not depend on the rows batched with it. A checkpoint's static
``input_scale`` is not used (every row gets its own scale, as the ``-FP8-dynamic`` releases have it).

Kept on CUDA devices of compute capability 8.9 or more (Ada, Hopper, Blackwell) in bfloat16 (the row-wise kernel's
output type), where both sides of the matmul are multiples of 16; on a CPU only when
:data:`specray.models.cpu_kernels.FP8_WEIGHTS` asks (the tests: torch's CPU kernel runs the same math); everywhere
else, and for weights with block scales (DeepSeek-V3's and Qwen3's ``-FP8`` releases: this kernel takes no blocks),
the weights are dequantized as they load (:mod:`specray.models.fp8`).
"""

from __future__ import annotations

import logging

import torch

from specray.models import cpu_kernels

logger = logging.getLogger(__name__)

FP8_MAX = 448.0  # e4m3's largest finite value
FP8_TILE = 16  # the scaled matmul takes both dims of a weight in multiples of this


class Fp8Rows:
    """One linear's float8 values ``weight`` [out, in] and their ``scale`` [out] (float32): ``W = weight * scale``
    by row. Read like a safetensors slice (``get_shape()``, ``w[index]``: the dequantized float32 weight), so a loader
    that wants a dense weight gets one; :meth:`rows` and :meth:`cols` cut it without dequantizing."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        self.weight, self.scale = weight, scale

    def get_shape(self) -> list[int]:
        return list(self.weight.shape)

    def get_dtype(self) -> str:
        return "F32"

    def dense(self) -> torch.Tensor:
        return self.weight.float() * self.scale[:, None]

    def __getitem__(self, index) -> torch.Tensor:
        return self.dense()[index]

    def rows(self, start: int, count: int) -> "Fp8Rows":
        return Fp8Rows(self.weight[start: start + count], self.scale[start: start + count])

    def cols(self, start: int, count: int) -> "Fp8Rows":
        return Fp8Rows(self.weight[:, start: start + count], self.scale)

    def staging(self, rows: int, cols: int) -> "Fp8Staging":
        return Fp8Staging(rows, cols)


class Fp8Staging:
    """A linear's float8 rows as its parts load (a merged linear's each at its rows), on the host, until kept."""

    def __init__(self, rows: int, cols: int):
        self.weight = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
        self.scale = torch.zeros(rows)

    def fits(self, w) -> bool:
        return isinstance(w, Fp8Rows) and w.weight.shape[1] == self.weight.shape[1]

    def put(self, offset: int, w: Fp8Rows) -> None:
        rows = slice(offset, offset + w.weight.shape[0])
        self.weight[rows], self.scale[rows] = w.weight.to(torch.float8_e4m3fn), w.scale

    def dense(self) -> torch.Tensor:
        return Fp8Rows(self.weight, self.scale).dense()

    def kept(self, device: torch.device, dtype: torch.dtype) -> "Fp8Linear | None":
        return pack_fp8(Fp8Rows(self.weight, self.scale), device, dtype)


class Fp8Linear(torch.nn.Module):
    """A linear's weight [N, K] kept in FP8 for the scaled matmul: ``weight`` float8 [N, K] and ``scale`` [1, N]
    float32 (module docstring)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, K] -> [M, N]: each row of x quantized with its own scale s_x = max|x_row| / 448, then
        # y = (xq Wq^T) * s_x * s_w, summed in float32 by the kernel
        x_scale = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX  # [M, 1]
        xq = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=x.dtype)


def pack_fp8(w: Fp8Rows, device: torch.device, dtype: torch.dtype) -> Fp8Linear | None:
    """``w`` kept for the scaled matmul on ``device`` in ``dtype``; None where its shape does not fit the kernel
    (both dims multiples of 16)."""
    n, k = w.weight.shape
    if n % FP8_TILE or k % FP8_TILE:
        return None
    return Fp8Linear(w.weight.to(device).contiguous(), w.scale.float().reshape(1, n).to(device).contiguous())


def keeps_fp8_linears(device: torch.device, dtype: torch.dtype, capability: tuple[int, int] | None = None) -> bool:
    """Whether a model of ``dtype`` on ``device`` keeps a checkpoint's row-scaled FP8 linears in FP8: on CUDA with
    FP8 tensor cores (``capability``, the device's, at least 8.9; not ROCm, whose FP8 types differ) in bfloat16, or on
    a CPU when asked to (:func:`specray.models.cpu_kernels.keeps_fp8_weights`); either way only where the kernel runs
    (:func:`scaled_mm_runs`), else the weights are dequantized at load."""
    if device.type == "cuda":
        if torch.version.hip is not None or dtype != torch.bfloat16:
            return False
        if (capability or torch.cuda.get_device_capability(device)) < (8, 9):
            return False
    elif not (device.type == "cpu" and cpu_kernels.keeps_fp8_weights() and dtype in (torch.float32, torch.bfloat16)):
        return False
    return scaled_mm_runs(device, dtype)


_RUNS: dict[tuple[str, torch.dtype], bool] = {}


def scaled_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch runs the row-scaled FP8 matmul on ``device`` with ``dtype`` outputs (tried once, on a 16 x 16
    weight): a torch or device without it has the weights dequantized at load, with a warning, rather than fail at
    the first step."""
    key = (str(device), dtype)
    if key not in _RUNS:
        w = torch.ones(FP8_TILE, FP8_TILE, device=device)
        kept = Fp8Linear(w.to(torch.float8_e4m3fn), torch.ones(1, FP8_TILE, device=device))
        try:
            _RUNS[key] = bool(torch.isfinite(kept.matmul(torch.ones(2, FP8_TILE, device=device, dtype=dtype))).all())
        except (RuntimeError, NotImplementedError, ValueError) as err:
            logger.warning("FP8 linears are dequantized at load on %s: torch %s's scaled matmul does not run there "
                           "(%s)", device, torch.__version__, str(err).splitlines()[0][:200])
            _RUNS[key] = False
    return _RUNS[key]


def random_fp8(rows: int, cols: int, limit: float, device: torch.device) -> Fp8Rows:
    """A random FP8 weight [rows, cols] of values in [-limit, limit]: a dummy model's (``load_format="dummy"``)
    linear kept in FP8 as a checkpoint's would be."""
    values = (torch.rand(rows, cols, device=device) * 2 - 1) * FP8_MAX
    return Fp8Rows(values.to(torch.float8_e4m3fn), torch.full((rows,), limit / FP8_MAX, device=device))
