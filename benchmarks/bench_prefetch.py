"""Drafting ahead during verification (Ray backend, ``ray_placement.draft_ahead``): tokens/s with it and without.

The target (one Ray actor) and the drafter (another) run SmolLM2-135M-Instruct; with ``draft_model`` the target
drafts for itself (a mechanics check: every greedy draft is kept and every guess is right, the best case for the
prefetch), with ``ngram`` the prompts are input-grounded. Greedy, fp32, one torch thread per actor.

    python benchmarks/bench_prefetch.py --max-tokens 64
"""

from __future__ import annotations

import argparse
import time

from specray.cluster.ray_env import apply_ray_env  # imports no ray

apply_ray_env()  # before anything imports ray

from specray.config import EngineArgs  # noqa: E402
from specray.default_model import default_model_path  # noqa: E402
from specray.engine.builder import build_engine  # noqa: E402
from specray.sampling_params import SamplingParams  # noqa: E402

PROMPTS = [
    "Rewrite in the past tense: I walk to the shop, I buy some bread and milk, and then I walk home again.",
    "List the cities in this sentence, one per line: We flew from Paris to Rome, took a train to Milan and "
    "drove to Zurich.",
]


def tokens_per_s(spec: dict, prefetch: bool, max_tokens: int) -> tuple[float, int, float]:
    model = default_model_path()
    engine = build_engine(EngineArgs(
        model=model, dtype="float32", max_model_len=512, num_threads=1, distributed_executor_backend="ray",
        speculative_config=spec,
        ray_placement={"worker_num_cpus": 0.5, "drafter_num_cpus": 0.5, "draft_ahead": prefetch}))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        tok = engine.tokenizer
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         tokenize=False) for p in PROMPTS]
        ids = [tok.encode(t, add_special_tokens=False) for t in texts]
        start, generated = time.perf_counter(), 0
        for prompt in ids:  # one request at a time
            engine.add_request(prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
            generated += max_tokens  # ignore_eos: every request runs to max_tokens
        elapsed = time.perf_counter() - start
        return generated / elapsed, engine.drafter.num_prefetch_hits, engine.spec_stats.mean_accepted_length
    finally:
        engine.drafter.shutdown()
        engine.executor.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=64)
    opts = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    specs = {"draft_model (self-draft, K=3)": {"method": "draft_model", "model": default_model_path(),
                                               "num_speculative_tokens": 3},
             "ngram (K=5)": {"method": "ngram", "num_speculative_tokens": 5}}
    print("| drafter | prefetch | tokens/s | prefetch hits | mean accepted length |\n|---|---|---|---|---|")
    for name, spec in specs.items():
        for prefetch in (False, True, False, True):
            tps, hits, mal = tokens_per_s(spec, prefetch, opts.max_tokens)
            print(f"| {name} | {'on' if prefetch else 'off'} | {tps:.1f} | {hits} | {mal:.2f} |")
    ray.shutdown()


if __name__ == "__main__":
    main()
