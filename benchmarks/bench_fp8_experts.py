"""One sparse MoE block with its experts kept in FP8 (block scales, dequantized expert by expert as tokens reach
them) or, with ``--kind int4``, in 4 bits (a GGUF's Q4_1 rows: two values a byte, a scale, zero point and offset per
32 columns) against the same block with the experts dequantized at load, at Qwen3-30B-A3B's expert shapes (hidden
2048, expert width 768, 128 experts, top 8; FP8 block [128, 128]): the experts' bytes and the forward time by token
count. Both compute in ``--dtype``; the outputs are checked equal. CPU figures are ratios, not a GPU's.

    python benchmarks/bench_fp8_experts.py --threads 2 [--kind int4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from specray.models import cpu_kernels
from specray.models.fp8 import Fp8Weight
from specray.models.gguf_quant import unpack
from specray.models.int_quant import gguf_quantization_config
from specray.models.moe import SparseMoE
from specray.parallel import TPGroup

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_forward's timer (scripts run standalone)
from bench_forward import timeit  # noqa: E402

BLOCK = (128, 128)


def config(kind: str | None, experts: int) -> SimpleNamespace:
    quant = {"fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)},
             "int4": gguf_quantization_config(), None: None}[kind]
    return SimpleNamespace(model_type="qwen3_moe", hidden_act="silu", hidden_size=2048, num_experts=experts,
                           num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                           quantization_config=quant)


def quantize_int4(w: torch.Tensor):
    """``w`` as Q4_1 rows (gguf-py's quantizer), read back as a converted GGUF's expert is."""
    import gguf
    from gguf.quants import quantize as gguf_quantize

    blocks = gguf_quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)
    return unpack(torch.from_numpy(blocks), "Q4_1")


def quantize(w: torch.Tensor) -> Fp8Weight:
    """``w`` [out, in] as an FP8 release stores it: e4m3 values and one float32 scale per block."""
    rows, cols = w.shape
    blocks = w.float().view(rows // BLOCK[0], BLOCK[0], cols // BLOCK[1], BLOCK[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    values = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(rows, cols)
    return Fp8Weight(values, scale, BLOCK)


def build(kind: str, kept: bool, experts: int, dtype: torch.dtype) -> SparseMoE:
    cpu_kernels.FP8_EXPERTS = cpu_kernels.INT4_WEIGHTS = kept  # kept as on a GPU (a CPU dequantizes them at load)
    torch.manual_seed(0)
    with torch.device("cpu"):
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            block = SparseMoE(config(kind, experts), TPGroup.single())
        finally:
            torch.set_default_dtype(old)
    block.gate.weight.data.normal_(0, 0.02)
    gen = torch.Generator().manual_seed(1)
    for e in range(experts):
        for part, shape in (("gate_proj", (768, 2048)), ("up_proj", (768, 2048)), ("down_proj", (2048, 768))):
            w = torch.randn(shape, generator=gen) * 0.02
            block.load_expert_tensor(f".mlp.experts.{e}.{part}.weight",
                                     quantize(w) if kind == "fp8" else quantize_int4(w))
    cpu_kernels.FP8_EXPERTS = cpu_kernels.INT4_WEIGHTS = False
    return block.eval()


def expert_bytes(block: SparseMoE) -> int:
    return sum(p.numel() * p.element_size() for name, p in block.named_parameters() if name.startswith(("w13", "w2")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kind", default="fp8", choices=["fp8", "int4"], help="the experts' format kept")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kept, full = build(args.kind, True, args.experts, dtype), build(args.kind, False, args.experts, dtype)
    if args.kind == "fp8":
        assert kept.fp8_block == BLOCK and full.fp8_block is None
    else:
        assert kept.int4_group == 32 and full.int4_group is None
    full.gate.weight.data.copy_(kept.gate.weight)
    name = {"fp8": "FP8", "int4": "4-bit"}[args.kind]
    print(f"experts' bytes: {name} kept {expert_bytes(kept) / 1e6:.0f} MB, dequantized at load "
          f"{expert_bytes(full) / 1e6:.0f} MB ({args.dtype})")
    print(f"| tokens | dequantized at load, ms | {name} kept, ms | ratio |")
    print("|---|---|---|---|")
    for t in (int(n) for n in args.tokens.split(",")):
        x = torch.randn(t, 2048, generator=torch.Generator().manual_seed(t)).to(dtype)
        with torch.no_grad():
            assert torch.equal(kept(x), full(x))
            a = timeit(lambda: full(x), args.repeats, warm=1)  # median ms
            b = timeit(lambda: kept(x), args.repeats, warm=1)
        print(f"| {t} | {a:.2f} | {b:.2f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
