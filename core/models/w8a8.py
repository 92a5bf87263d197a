"""Linears kept in 8 bits and multiplied in 8 bits (W8A8), as vLLM runs them: a checkpoint's FP8 weights with one
scale per output row or per tensor (llm-compressor's ``-FP8`` / ``-FP8-dynamic`` releases, ``strategy: channel`` or
``tensor``; ``quant_method: fp8`` without a block size) through torch's scaled matmul (``torch._scaled_mm``, row-wise
scales), and INT8 ones (llm-compressor's ``-quantized.w8a8`` releases, ``format: int-quantized``) through torch's
integer matmul (``torch._int_mm``, int32 sums).

The math, per linear ``y = x W^T`` with ``W = Wq * s_w`` (``s_w`` [N], one per output row; a per-tensor scale is
that number on every row): each row of ``x`` is quantized at run time with its own scale ``s_x = max|x_row| / R``
(R the format's largest value: 448 for e4m3, 127 for int8), ``xq = x / s_x`` rounded to the format, and
``y = (xq Wq^T) * s_x * s_w^T``, the products summed exactly (int8: in int32) or in float32 (FP8) by the kernel. The
activations' rounding (three mantissa bits, or 255 levels, over a row's largest value) is the accuracy this trades for
the weights' half of bf16's bytes and the 8-bit matmul rate; each row's scale depends on that row alone, so a token's
output does not depend on the rows batched with it. A release with static activation scales (llm-compressor's
``-FP8`` releases, ``input_activations.dynamic: false``; AutoFP8's ``activation_scheme: static``) has one calibrated
``X.input_scale`` per linear instead: every row is ``x / s_in`` rounded (values past ``R * s_in`` clamped), as vLLM
runs them, with the largest of a merged linear's parts' scales (q/k/v, gate/up) for all of them.

Kept on CUDA in bfloat16 (FP8: the row-wise kernel's output type; devices of compute capability 8.9 or more: Ada,
Hopper, Blackwell) or bfloat16 / float16 (INT8: 7.5 or more), where the weight's sides fit the kernel (multiples of
16), and only once the kernel has run there (:func:`kernel_runs`, tried once); on a CPU only when
:mod:`specray.models.cpu_kernels` asks (``FP8_WEIGHTS``, ``INT8_WEIGHTS``: the tests; torch's CPU kernels compute the
same math). Everywhere else, and for FP8 weights with block scales (DeepSeek-V3's and Qwen3's ``-FP8`` releases: these
kernels take no blocks), the weights are dequantized as they load (:mod:`specray.models.fp8`,
:mod:`specray.models.int_quant`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from specray.models import cpu_kernels

logger = logging.getLogger(__name__)

TILE = 16  # both sides of a kept weight are multiples of this (the FP8 kernel's and cuBLASLt int8's alignment)
INT_MM_MIN_ROWS = 17  # CUDA's integer matmul takes more than 16 rows: fewer are padded up to this


def _fp8_matmul(xq: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    # [M, K] e4m3 x [N, K] e4m3 -> [M, N]: the kernel sums in float32 and applies both scales
    return torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=dtype)


def _int8_matmul(xq: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    # [M, K] int8 x [N, K] int8 -> int32 sums [M, N] (exact), then both scales in float32
    m = xq.shape[0]
    if m < INT_MM_MIN_ROWS:  # (on every device, so that the padded path is the one tested)
        xq = F.pad(xq, (0, 0, 0, INT_MM_MIN_ROWS - m))
    sums = torch._int_mm(xq, w.t())[:m]
    return (sums.float() * x_scale * w_scale).to(dtype)


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn)  # (rounds to nearest)


def _to_int8(x: torch.Tensor) -> torch.Tensor:
    return x.round().to(torch.int8)


class Format(NamedTuple):
    """An 8-bit format: its torch dtype, its largest value, how values round into it and the matmul over it."""

    name: str
    dtype: torch.dtype
    max: float
    round: Callable[[torch.Tensor], torch.Tensor]
    matmul: Callable[..., torch.Tensor]


FP8 = Format("FP8", torch.float8_e4m3fn, 448.0, _to_fp8, _fp8_matmul)
INT8 = Format("INT8", torch.int8, 127.0, _to_int8, _int8_matmul)


def quantize_rows(x: torch.Tensor, fmt: Format, static: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (xq [M, K] in ``fmt``, s_x [M, 1] float32): each row over its own scale max|x_row| / R, or
    with ``static`` (a release's calibrated input scale, 0-d float32) every row over that one, values past it
    clamped."""
    if static is None:
        x_scale = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / fmt.max
    else:
        x_scale = static.reshape(1, 1).repeat(x.shape[0], 1)  # (the row-wise kernel's layout: strides (1, 1))
    return fmt.round((x.float() / x_scale).clamp(-fmt.max, fmt.max)).contiguous(), x_scale  # (kernels: row-major)


class RowScaled:
    """One linear's 8-bit values ``weight`` [out, in] (``fmt``'s dtype) and their ``scale`` [out] (float32):
    ``W = weight * scale`` by row; ``input_scale`` (0-d float32): a release's static activation scale, None where
    each row of activations gets its own. Read like a safetensors slice (``get_shape()``, ``w[index]``: the
    dequantized float32 weight), so a loader that wants a dense weight gets one; :meth:`rows` and :meth:`cols` cut it
    without dequantizing."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, fmt: Format,
                 input_scale: torch.Tensor | None = None):
        self.weight, self.scale, self.fmt, self.input_scale = weight, scale, fmt, input_scale

    def get_shape(self) -> list[int]:
        return list(self.weight.shape)

    def get_dtype(self) -> str:
        return "F32"

    def dense(self) -> torch.Tensor:
        return self.weight.float() * self.scale[:, None]

    def __getitem__(self, index) -> torch.Tensor:
        return self.dense()[index]

    def rows(self, start: int, count: int) -> "RowScaled":
        return RowScaled(self.weight[start: start + count], self.scale[start: start + count], self.fmt,
                         self.input_scale)

    def cols(self, start: int, count: int) -> "RowScaled":
        return RowScaled(self.weight[:, start: start + count], self.scale, self.fmt, self.input_scale)

    def staging(self, rows: int, cols: int) -> "RowScaledStaging":
        return RowScaledStaging(rows, cols, self.fmt, static=self.input_scale is not None)


class RowScaledStaging:
    """A linear's 8-bit rows as its parts load (a merged linear's each at its rows), on the host, until kept."""

    def __init__(self, rows: int, cols: int, fmt: Format, static: bool = False):
        self.weight = torch.zeros(rows, cols, dtype=fmt.dtype)
        self.scale = torch.zeros(rows)
        self.fmt = fmt
        # a static release's input scale: the largest of the parts' (one scale rounds the input for all of them)
        self.input_scale = torch.zeros((), device=self.weight.device) if static else None

    def fits(self, w, offset: int) -> bool:
        return (isinstance(w, RowScaled) and w.fmt == self.fmt and w.weight.shape[1] == self.weight.shape[1]
                and (w.input_scale is None) == (self.input_scale is None))

    def put(self, offset: int, w: RowScaled) -> None:
        rows = slice(offset, offset + w.weight.shape[0])
        self.weight[rows], self.scale[rows] = w.weight, w.scale
        if w.input_scale is not None:
            part = w.input_scale.float().reshape(()).to(self.input_scale.device)
            self.input_scale = torch.maximum(self.input_scale, part)

    def dense(self) -> torch.Tensor:
        return RowScaled(self.weight, self.scale, self.fmt).dense()

    def kept(self, device: torch.device, dtype: torch.dtype) -> "W8A8Linear | None":
        return pack_w8a8(RowScaled(self.weight, self.scale, self.fmt, self.input_scale), device)


class W8A8Linear(torch.nn.Module):
    """A linear's weight [N, K] kept in 8 bits: ``weight`` [N, K] in ``fmt``'s dtype and ``scale`` [1, N] float32;
    ``input_scale`` (0-d float32) a static release's activation scale, else None (module docstring)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, fmt: Format,
                 input_scale: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("input_scale", input_scale)
        self.fmt = fmt

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return matmul_rows(x, self.weight, self.scale, self.fmt, self.input_scale)


def matmul_rows(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, fmt: Format,
                static: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] times an 8-bit weight ``w`` [N, K] of ``fmt`` with its rows' scales ``w_scale`` [1, N]:
    y = (xq Wq^T) * s_x * s_w, each row of x over its own scale (or the ``static`` one) -> [M, N] in x's dtype."""
    xq, x_scale = quantize_rows(x, fmt, static)
    return fmt.matmul(xq, w, x_scale, w_scale, x.dtype)


def pack_w8a8(w: RowScaled, device: torch.device) -> W8A8Linear | None:
    """``w`` kept for its format's matmul on ``device``; None where its shape does not fit the kernel (both sides
    multiples of 16)."""
    n, k = w.weight.shape
    if n % TILE or k % TILE:
        return None
    static = None if w.input_scale is None else w.input_scale.float().reshape(()).to(device)
    return W8A8Linear(w.weight.to(device).contiguous(), w.scale.float().reshape(1, n).to(device).contiguous(), w.fmt,
                      static)


def keeps_w8a8(fmt: Format, device: torch.device, dtype: torch.dtype,
               capability: tuple[int, int] | None = None) -> bool:
    """Whether a model of ``dtype`` on ``device`` keeps a checkpoint's row-scaled linears of ``fmt`` in 8 bits: on
    CUDA (not ROCm, whose FP8 types differ) of compute capability (``capability``: the device's) 8.9 or more in
    bfloat16 for FP8, 7.5 or more in bfloat16 or float16 for INT8; on a CPU when asked to
    (:mod:`specray.models.cpu_kernels`); either way only where the kernel runs (:func:`kernel_runs`), else the
    weights are dequantized at load."""
    if device.type == "cuda":
        fp8 = fmt is FP8
        dtypes = (torch.bfloat16,) if fp8 else (torch.bfloat16, torch.float16)
        if torch.version.hip is not None or dtype not in dtypes:
            return False
        if (capability or torch.cuda.get_device_capability(device)) < ((8, 9) if fp8 else (7, 5)):
            return False
    elif not (device.type == "cpu" and cpu_kernels.keeps_w8a8(fmt.name) and dtype in (torch.float32, torch.bfloat16)):
        return False
    return kernel_runs(fmt, device, dtype)


_RUNS: dict[tuple[str, str, torch.dtype], bool] = {}


def kernel_runs(fmt: Format, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch runs ``fmt``'s matmul on ``device`` with ``dtype`` outputs (tried once, on a 16 x 16
    weight and two rows): a torch or device without it has the weights dequantized at load, with a warning, rather
    than fail at the first step."""
    key = (fmt.name, str(device), dtype)
    if key not in _RUNS:
        kept = W8A8Linear(torch.ones(TILE, TILE, device=device).to(fmt.dtype), torch.ones(1, TILE, device=device), fmt)
        try:
            _RUNS[key] = bool(torch.isfinite(kept.matmul(torch.ones(2, TILE, device=device, dtype=dtype))).all())
        except (RuntimeError, NotImplementedError, ValueError) as err:
            logger.warning("%s linears are dequantized at load on %s: torch %s's %s matmul does not run there (%s)",
                           fmt.name, device, torch.__version__, fmt.name, str(err).splitlines()[0][:200])
            _RUNS[key] = False
    return _RUNS[key]


def row_scales(scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A weight of ``shape`` [out, in]'s ``scale`` (one, or one per output row) as one per row [out] float32."""
    if scale.numel() not in (1, shape[0]):
        raise ValueError(f"a weight of shape {tuple(shape)} needs one scale, or one per output row, not "
                         f"{tuple(scale.shape)}: the checkpoint does not match its config")
    return scale.float().reshape(-1).expand(shape[0]).contiguous()


def row_scaled(weight: torch.Tensor, scale: torch.Tensor, fmt: Format,
               input_scale: torch.Tensor | None = None) -> RowScaled:
    """An 8-bit weight [out, in] with one scale, or one per output row, as :class:`RowScaled` (a scale per row);
    ``input_scale``: a static release's activation scale (one number)."""
    if input_scale is not None:
        if input_scale.numel() != 1:
            raise ValueError(f"a static activation scale (input_scale) of shape {tuple(input_scale.shape)}: one per "
                             "linear is supported (strategy 'tensor')")
        input_scale = input_scale.float().reshape(())
    return RowScaled(weight, row_scales(scale, tuple(weight.shape)), fmt, input_scale)


def quantize_weight(weight: torch.Tensor, fmt: Format, row_max: torch.Tensor | None = None) -> RowScaled:
    """A dense weight [out, in] in ``fmt`` with one scale per row, max|row| / R (``row_max`` [out]: the rows' largest
    magnitudes where this is one rank's share of wider rows, so that every rank scales a row alike): vLLM's online
    quantization (``quantization="fp8"`` over an unquantized checkpoint)."""
    amax = weight.abs().amax(1).float() if row_max is None else row_max.float()
    scale = amax.clamp_min(1e-12) / fmt.max
    return RowScaled(fmt.round((weight.float() / scale[:, None]).clamp(-fmt.max, fmt.max)), scale, fmt)


def random_w8a8(rows: int, cols: int, limit: float, fmt: Format, device: torch.device) -> RowScaled:
    """A random 8-bit weight [rows, cols] of values in [-limit, limit]: a dummy model's (``load_format="dummy"``)
    linear kept in 8 bits as a checkpoint's would be."""
    values = fmt.round((torch.rand(rows, cols, device=device) * 2 - 1) * fmt.max)
    return RowScaled(values, torch.full((rows,), limit / fmt.max, device=device), fmt)
