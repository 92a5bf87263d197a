"""What pipeline stages hold and cost (``pipeline_parallel_size``), on the default model (or ``--model``), greedy, on a
local Ray (the ranks are actors with ``--threads`` CPU threads each).

Configurations (``--configs``): ``tp1`` (one rank, Ray backend), ``pp2`` and ``pp3`` (two or three stages of one
rank), ``tp3`` (three tensor-parallel ranks: the default model has 9 heads). For each: every rank's parameter bytes,
the KV blocks the engine agreed under one per-rank budget (``--kv-bytes``), and the time of one batch of
``--requests`` prompts, ``--max-tokens`` tokens each (EOS ignored), with ``--spec`` drafting (``none`` or
``ngram``), best of ``--rounds``. Every configuration's tokens must equal the first's (greedy). Prints one JSON line
per configuration, then the machine, torch version and commit.

S stages keep S steps in flight, each over a cohort of up to ``--max-num-seqs`` requests, so they compute at once;
what they buy beside that is memory per rank (weights and KV).

    PYTHONSAFEPATH=1 python benchmarks/bench_pipeline.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch  # noqa: E402

from specray import SamplingParams  # noqa: E402
from specray.config import EngineArgs  # noqa: E402
from specray.default_model import default_model_path  # noqa: E402
from specray.engine.builder import build_engine  # noqa: E402

PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is.", "Give three tips for sleeping well.",
           "What is the capital of France, and why is it famous?", "Describe a cat to someone who never saw one.",
           "List the planets of the solar system.", "How do I boil an egg?", "What does a compiler do?"]
CONFIGS = {"tp1": (1, 1), "pp2": (1, 2), "pp3": (1, 3), "tp3": (3, 1)}


def param_bytes(worker) -> int:
    """This rank's weights (dense and CPU-packed copies alike)."""
    dense = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    packed = sum(m.packed.numel() * m.packed.element_size() for m in worker.model.modules()
                 if getattr(m, "packed", None) is not None)
    return dense + packed


def run_batch(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return time.perf_counter() - start, [done[i] for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--configs", default="tp1,pp2,pp3,tp3")
    ap.add_argument("--spec", default="ngram", choices=["none", "ngram"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=8, help="per step (over S stages: S x this in the engine)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-bytes", type=int, default=64 << 20)
    args = ap.parse_args()
    model = args.model or default_model_path()
    spec = None if args.spec == "none" else {"method": "ngram", "num_speculative_tokens": 4}
    first_tokens = None
    for name in args.configs.split(","):
        tp, pp = CONFIGS[name]
        engine = build_engine(EngineArgs(
            model=model, max_model_len=1024, max_num_seqs=args.max_num_seqs, tensor_parallel_size=tp,
            pipeline_parallel_size=pp, distributed_executor_backend="ray", num_threads=args.threads,
            kv_cache_memory_bytes=args.kv_bytes, speculative_config=spec,
            ray_placement={"worker_num_cpus": 0.25, "drafter_num_cpus": 0.1, "engine_num_cpus": 0.1}))
        try:
            prompts = [engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.requests)]
            run_batch(engine, prompts, 8)  # warm-up
            times, tokens = [], None
            for _ in range(args.rounds):
                elapsed, tokens = run_batch(engine, prompts, args.max_tokens)
                times.append(elapsed)
            first_tokens = first_tokens or tokens
            weights = engine.executor.collective_rpc(param_bytes)
            print(json.dumps({"config": name, "tp": tp, "pp": pp, "spec": args.spec,
                              "weights_mb_per_rank": [round(b / 2**20, 1) for b in weights],
                              "kv_blocks_per_rank": engine.executor.num_kv_blocks,
                              "best_s": round(min(times), 3),
                              "tokens_per_s": round(args.requests * args.max_tokens / min(times), 1),
                              "same_tokens_as_first": tokens == first_tokens}), flush=True)
        finally:
            engine.shutdown()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                      "torch": torch.__version__, "commit": commit}))


if __name__ == "__main__":
    main()
