"""Where a decode step's time goes: wall time per step against the device's busy time and the kernels launched.

Plain greedy decoding of the default model (SmolLM2-135M-Instruct; or ``--model``, with ``--load-format dummy`` a
folder from ``benchmarks/dummy_model.py``: a real size's shapes, random weights), ``--batches`` requests at a time, each
generating ``--tokens`` tokens past EOS. A run's wall time is timed without the profiler; then one more run under
``torch.profiler`` counts the top-level aten ops the model and sampler dispatch (each is one or more kernel launches
on a GPU) and, on a GPU, the host's launch calls (a replayed graph is one) and the kernels' summed time (the GPU's
busy time: one stream, so the kernels do not overlap). Every figure is per *decode* step: the same measure of a run
of one token (the prefill step alone) is taken off and the rest divided by the decode steps, since a prefill always
runs eagerly and, over a few dozen tokens, its share would weigh on every step (a MoE's eager prefill runs each
expert its tokens reach apart: thousands of kernels). The prefill's own time is a column of its own. A step whose
wall time is many times the GPU's busy time is bound by the host: the Python and launch cost of every op, which
capturing the step in a CUDA graph removes: the ``graphs`` rows run with ``enforce_eager=False`` (on a GPU each
decode step is one graph launch; on a CPU the same padded steps run eagerly). On a CPU the GPU columns are empty and
the op count is the same proxy.

    python benchmarks/bench_gpu_step.py --device cuda --batches 1,8 --tokens 64 --modes eager,graphs
"""

from __future__ import annotations

import argparse
import logging
import platform
import time
from dataclasses import replace

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

PROMPTS = ["Write a short story about a robot who learns to paint.", "Explain why the sky is blue.",
           "Give me five ideas for a weekend trip.", "What are the pros and cons of working from home?",
           "Write a poem about the ocean at night.", "How do vaccines train the immune system?",
           "Describe your ideal city of the future.", "What should a beginner know about the guitar?"]


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def top_level_aten(events) -> int:
    """aten ops not called from inside another aten op: the ops Python dispatched."""
    return sum(1 for e in events if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    parser.add_argument("--batches", default="1,8", help="comma list of concurrent requests")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request (past EOS)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per batch; the median is shown")
    parser.add_argument("--modes", default="eager,graphs", help="comma list: eager (enforce_eager=True), graphs "
                        "(enforce_eager=False: CUDA graphs on a GPU, the same padded steps run eagerly on CPU)")
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                        help="dummy: random weights (a folder from benchmarks/dummy_model.py: a real size's shapes)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20,
                        help="the KV cache (default 256 MiB: the default model's batches; a larger model needs more)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e5m2"),
                        help="fp8: K/V stored one byte each, converted as attention reads them")
    parser.add_argument("--quantization", default=None, choices=("fp8",),
                        help="fp8: vLLM's online FP8 over an unquantized model (its linears quantized as they load, "
                        "W8A8; a GPU of compute capability 8.9 or more, bf16)")
    parser.add_argument("--profile-tokens", type=int, default=None,
                        help="tokens per request of the profiled run (default --tokens): fewer keep a real-size eager "
                        "step's profile (every expert's kernels, one host sync per layer) short")
    parser.add_argument("--top-kernels", type=int, default=0,
                        help="after each row, the N kernels of the most GPU time per step (on a GPU)")
    args = parser.parse_args()
    if min(args.tokens, args.profile_tokens or args.tokens) < 2:
        parser.error("--tokens and --profile-tokens must be at least 2: the figures are per decode step, past the "
                     "prefill's one token")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    from specray import LLM, SamplingParams
    from specray.default_model import default_model_path

    batches = [int(b) for b in args.batches.split(",")]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    profile_params = SamplingParams(temperature=0.0, max_tokens=args.profile_tokens or args.tokens, ignore_eos=True)
    header = False
    for mode in args.modes.split(","):
        llm = LLM(model=args.model or default_model_path(), device=args.device, dtype=args.dtype,
                  max_num_seqs=max(batches), max_model_len=1024, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                  enforce_eager=mode == "eager", load_format=args.load_format, kv_cache_dtype=args.kv_cache_dtype,
                  quantization=args.quantization)
        worker = llm.engine.executor.worker
        if not header:
            on_gpu = worker.device.type == "cuda"
            name = torch.cuda.get_device_name(worker.device) if on_gpu else platform.processor() or platform.machine()
            model = args.model or "the default model"
            print(f"# {model} ({args.load_format} weights), {name}, {worker.dtype}, torch {torch.__version__}, "
                  f"{args.threads} CPU threads, "
                  f"{time.strftime('%Y-%m-%d %H:%M')}, {args.tokens} tokens per request, median of {args.repeats}\n")
            print("| mode | batch | prefill ms | wall ms per decode step | GPU busy ms per decode step | launches per "
                  "decode step | aten ops per decode step | decode tokens/s |\n|---|---|---|---|---|---|---|---|")
            header = True
        run_mode(llm, mode, batches, params, profile_params, args, on_gpu)
        llm.shutdown()


def run_mode(llm, mode: str, batches: list[int], params, profile_params, args, on_gpu: bool) -> None:
    if mode == "graphs" and on_gpu:  # whether decode steps replay graphs at all (a model may be refused them)
        from specray.models.step_graphs import graph_safe

        runner = llm.engine.executor.worker.runner
        why = graph_safe(llm.engine.executor.worker.model)
        print(f"  - graphs: {'none (' + why + ')' if runner.graphs is None else 'kept by the runner'}", flush=True)
    first = replace(params, max_tokens=1)  # the prefill step alone (and its token's sampling)
    for batch in batches:  # a first run per batch captures its graphs (and warms the eager path alike)
        llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(batch)], params, use_tqdm=False)
    for batch in batches:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        wall, prefill = (median_wall(llm, prompts, p, args.repeats) for p in (params, first))
        steps = profile_params.max_tokens - 1  # decode steps: the profiled run's less the prefill's one
        (whole, events), (alone, prefill_events) = (profiled(llm, prompts, p, on_gpu) for p in (profile_params, first))
        # per decode step: the whole run's less the prefill run's (both end with one token's sampling and output)
        busy, launches, replays, ops = ((a - b) / steps for a, b in zip(whole, alone))
        gpu = (f"{busy:.2f}", f"{launches:.0f}") if on_gpu else ("-", "-")
        decode_wall = (wall - prefill) / (params.max_tokens - 1)
        print(f"| {mode} | {batch} | {prefill * 1e3:.2f} | {decode_wall * 1e3:.2f} | {gpu[0]} | {gpu[1]} | {ops:.0f} | "
              f"{batch / decode_wall:.1f} |", flush=True)
        # a replayed step is one graph launch; the other launches ran outside any graph
        device = (f"{launches - replays:.0f} kernels and {replays:.2f} graphs launched per decode step; the prefill "
                  f"step's {alone[1] - alone[2]:.0f} and {alone[2]:.0f}, {alone[0]:.2f} GPU ms, ") if on_gpu else ""
        print(f"  - {device}{alone[3]} aten ops in the prefill step", flush=True)
        if on_gpu and args.top_kernels:
            print(top_kernels(events, prefill_events, steps, args.top_kernels), flush=True)


def median_wall(llm, prompts: list[str], params, repeats: int) -> float:
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - start)
    return sorted(walls)[len(walls) // 2]


def profiled(llm, prompts: list[str], params, on_gpu: bool) -> tuple[tuple[float, int, int, int], list]:
    """One run of ``params`` under the profiler: (the GPU's busy ms, the host's launch calls, its graph replays, the
    top-level aten ops), and its events."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    events = prof.events()
    busy = sum(e.time_range.elapsed_us() for e in events if e.device_type == DeviceType.CUDA) / 1e3
    launches = sum(1 for e in events if e.name in LAUNCHES)
    replays = sum(1 for e in events if e.name == "cudaGraphLaunch")
    return (busy, launches, replays, top_level_aten(events)), events


def top_kernels(events, prefill_events, steps: int, n: int) -> str:
    """The ``n`` kernels of the most summed GPU time per decode step (``events``' less ``prefill_events``', over
    ``steps``), as a note under the row: where a decode step's GPU time goes."""
    time_by_name: dict[str, float] = {}
    calls: dict[str, int] = {}
    for sign, run in ((1, events), (-1, prefill_events)):
        for e in run:
            if e.device_type == DeviceType.CUDA:
                time_by_name[e.name] = time_by_name.get(e.name, 0.0) + sign * e.time_range.elapsed_us() / 1e3
                calls[e.name] = calls.get(e.name, 0) + sign
    total = sum(time_by_name.values()) or 1.0
    lines = [f"  - {ms / steps:.3f} ms/step ({100 * ms / total:.0f}%), {calls[name] / steps:.1f} calls/step: "
             f"{name[:100]}" for name, ms in sorted(time_by_name.items(), key=lambda kv: -kv[1])[:n]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
