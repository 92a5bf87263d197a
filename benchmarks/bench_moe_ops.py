"""What one expert block dispatches: the looped path (eager steps on a CPU, and on a GPU where the grouped matmul
would sync) against the grouped one (graph steps; eager steps on CUDA where it runs with no host sync), per block
forward of T tokens. The top-level aten ops are counted (each one or more kernel launches on a GPU, or none for a
view), and on a GPU the kernels the device ran; with how many of the block's experts the tokens reached, which the
loop's count follows. The shapes are a release's expert counts and widths with Qwen3-MoE's router (softmax, the top
k renormalised) and random weights; the counts do not depend on the weights but through which experts are reached.

    python benchmarks/bench_moe_ops.py --shapes qwen3-30b-a3b,deepseek-v2-lite --tokens 1,12,128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from specray.models.moe import SparseMoE
from specray.parallel import TPGroup

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_gpu_step's op count (scripts run standalone)
from bench_gpu_step import top_level_aten  # noqa: E402

# name: (experts, experts per token, hidden size, expert width)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408)}


def counts(block: SparseMoE, x: torch.Tensor, grouped: bool) -> tuple[int, int]:
    """(top-level aten ops, kernels on the device) of one forward through the path asked for (this router's
    block: routing, then the routed experts), after a warm-up one."""
    path = block._experts_grouped if grouped else block._experts_looped
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.device.type == "cuda" else [])
    with torch.no_grad():
        path(x, *block.route(x))
        with profile(activities=activities) as prof:
            path(x, *block.route(x))
    events = prof.events()
    return top_level_aten(events), sum(1 for e in events if e.device_type == DeviceType.CUDA)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {sorted(SHAPES)}")
    parser.add_argument("--tokens", default="1,12,128", help="comma list of tokens per forward")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print("| shape | tokens | experts reached | loop: aten ops | grouped: aten ops | loop: kernels | grouped: kernels |"
          "\n|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        experts, k, hidden, width = SHAPES[name]
        config = SimpleNamespace(model_type="qwen3_moe", hidden_act="silu", hidden_size=hidden, num_experts=experts,
                                 num_experts_per_tok=k, moe_intermediate_size=width, norm_topk_prob=True)
        torch.manual_seed(0)
        block = SparseMoE(config, TPGroup())
        with torch.no_grad():
            for param in block.parameters():
                param.normal_(0.0, 0.02)
        block = block.to(device, dtype).eval()
        for t in (int(n) for n in args.tokens.split(",")):
            x = torch.randn(t, hidden, device=device, dtype=dtype)
            with torch.no_grad():
                reached = block.route(x)[1].unique().numel()
            (loop_ops, loop_kernels), (grouped_ops, grouped_kernels) = (counts(block, x, g) for g in (False, True))
            kernels = (loop_kernels, grouped_kernels) if device.type == "cuda" else ("-", "-")
            print(f"| {name} | {t} | {reached} of {experts} | {loop_ops} | {grouped_ops} | {kernels[0]} | "
                  f"{kernels[1]} |", flush=True)


if __name__ == "__main__":
    main()
