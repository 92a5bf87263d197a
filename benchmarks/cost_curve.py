"""A cost curve for ``bench_replay.py --cost-curve FILE``, measured on any device and model (a real size's shapes
with ``--load-format dummy``): what one forward pass costs for n tokens of one sequence at context ~100 (the
model body), and the logits for m rows, in seconds, at n, m in 1, 2, 4 ... 128.

On a GPU each point is a CUDA graph of that pass replayed and timed by CUDA events (median of ``--repeats``), so the
curve is the device's time without the host's per-op cost, as engine steps replayed from graphs see it; a pass that
cannot be captured is timed eagerly (synchronized), and the output says which points were. On CPU the passes run
eagerly, as ``bench_replay.py`` measures its own curve. The replay then runs on the CPU against the default model's
recorded answers, charging each step from this curve: what a drafter and the draft-length policy would buy at that
device's costs (the engine's host work is left out; ``--host-time`` adds this machine's).

    python benchmarks/dummy_model.py --shape llama3-8b --out /tmp/llama3-8b
    python benchmarks/cost_curve.py --device cuda --model /tmp/llama3-8b --load-format dummy --out cost-8b.json
    python benchmarks/bench_replay.py --cost-curve cost-8b.json --batch 1,8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache
from specray.models.loader import load_model

GRID = (1, 2, 4, 8, 16, 32, 64, 128)  # bench_replay.py's
CONTEXT, BLOCK = 100, 16


def _timed(fn, device: torch.device, repeats: int) -> tuple[float, bool]:
    """Median seconds of ``fn()``, and whether it was replayed from a CUDA graph."""
    if device.type != "cuda":
        for _ in range(2):
            fn()
        return statistics.median(_wall(fn) for _ in range(repeats)), False
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up off the capture: lazy inits happen here
        fn()
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            fn()
        run, captured = graph.replay, True
    except RuntimeError:  # a pass with host work in it: timed eagerly
        torch.cuda.synchronize(device)
        run, captured = fn, False
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[2:]), captured


def _wall(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.inference_mode()
def measure(model_path: str, device: str, dtype: torch.dtype, load_format: str, repeats: int
            ) -> tuple[dict, list[str]]:
    """The curve ({"body": {n: s}, "logits": {m: s}}) and the points timed eagerly on a GPU."""
    dev = torch.device(device)
    model = load_model(model_path, dtype=dtype, device=dev, load_format=load_format)
    blocks = -(-(CONTEXT + max(GRID)) // BLOCK)
    allocate_kv_cache(model, blocks, BLOCK)
    table = [list(range(blocks))]
    ids = torch.randint(0, model.config.vocab_size, (CONTEXT + max(GRID),),
                        generator=torch.Generator().manual_seed(0)).to(dev)
    model(ids[:CONTEXT], build_attention_metadata([CONTEXT], [0], table, BLOCK, dev))
    body, logits, eager = {}, {}, []
    for n in GRID:
        meta = build_attention_metadata([n], [CONTEXT], table, BLOCK, dev)
        tokens = ids[CONTEXT:CONTEXT + n]
        body[n], captured = _timed(lambda: model(tokens, meta), dev, repeats)
        hidden = model(tokens, meta)  # [n, hidden]
        logits[n], captured_logits = _timed(lambda: model.compute_logits(hidden).argmax(-1), dev, repeats)
        eager += [f"body({n})"] * (dev.type == "cuda" and not captured)
        eager += [f"logits({n})"] * (dev.type == "cuda" and not captured_logits)
    return {"body": body, "logits": logits}, eager


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                        help="auto: bf16 on a GPU, fp32 on CPU")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--out", type=Path, required=True, help="the JSON curve bench_replay.py --cost-curve reads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from specray.default_model import default_model_path

    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    curve, eager = measure(args.model or default_model_path(), args.device, dtype, args.load_format, args.repeats)
    args.out.write_text(json.dumps(curve, indent=1))
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(f"# {args.model or 'the default model'} ({args.load_format} weights), {name}, {dtype}, torch "
          f"{torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}; ms, median of {args.repeats}"
          + (f"; timed eagerly: {', '.join(eager)}" if eager else "") + "\n")
    print("| n | body(n) | logits(n) |\n|---|---|---|")
    for n in GRID:
        print(f"| {n} | {curve['body'][n] * 1e3:.3f} | {curve['logits'][n] * 1e3:.3f} |")


if __name__ == "__main__":
    main()
