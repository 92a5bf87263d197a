"""How well a hidden-state head's confidence predicts what the target keeps (calibration), served.

Runs a head with a fixed chain of K (not adaptive, so every draft is verified) over the benchmark prompts and
tallies, per tenth of [0, 1] of the head's probability for a draft, how often the target kept that draft given that
it kept the ones before it: the rate the draft policy's ``Confidence`` bins learn. A calibrated head's rate is the
bin's middle; greedy output is checked against plain decoding.

    python benchmarks/bench_confidence.py --kinds open-ended,input-grounded --batch 8 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_offline's prompts (scripts run standalone)
from bench_offline import KV_BYTES, PROMPT_SETS, chat_prompts  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kinds", default="open-ended,input-grounded")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--spec", default='{"method": "eagle3", "num_speculative_tokens": 4}',
                        help="the head's speculative_config (adaptive is forced off)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    from specray import LLM, SamplingParams
    from specray.default_model import default_model_path
    from specray.scheduler.draft_policy import CONFIDENCE_BINS, Confidence

    spec = {**json.loads(args.spec), "adaptive": False}
    model = default_model_path()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    plain = LLM(model=model, max_num_seqs=args.batch, max_model_len=2048, kv_cache_memory_bytes=KV_BYTES)
    head = LLM(model=model, speculative_config=spec, max_num_seqs=args.batch, max_model_len=2048,
               kv_cache_memory_bytes=KV_BYTES)
    policy = head.engine.policy
    tally: dict[int, list[int]] = {}  # bin -> [kept, verified]
    firsts: list[int] = [0] * CONFIDENCE_BINS  # the bins of each chain's first draft
    observe = policy.observe

    def counting(req, n, accepted, key=None, scores=None):
        if scores is not None:
            firsts[Confidence.of(key, scores[0]).bin] += 1
            for i, p in enumerate(scores[: min(accepted + 1, n)]):  # up to the first rejected draft
                counts = tally.setdefault(Confidence.of(key, p).bin, [0, 0])
                counts[0] += i < accepted
                counts[1] += 1
        observe(req, n, accepted, key, scores)

    policy.observe = counting
    print(f"# {spec}, batch {args.batch}, max_tokens {args.max_tokens}, {args.threads} threads\n")
    for kind in args.kinds.split(","):
        tally.clear()
        firsts[:] = [0] * CONFIDENCE_BINS
        prompts = chat_prompts(head.get_tokenizer(), PROMPT_SETS[kind])
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in head.generate(prompts, params, use_tqdm=False)]
        assert got == want, f"{kind}: outputs differ from plain decoding"
        print(f"| confidence ({kind}) | drafts verified | kept given the ones before | first drafts |\n"
              "|---|---|---|---|")
        for b in range(CONFIDENCE_BINS):
            kept, verified = tally.get(b, (0, 0))
            rate = f"{kept / verified:.2f}" if verified else "-"
            print(f"| {b / CONFIDENCE_BINS:.1f}-{(b + 1) / CONFIDENCE_BINS:.1f} | {verified} | {rate} | {firsts[b]} |")
        print()
    plain.shutdown()
    head.shutdown()


if __name__ == "__main__":
    main()
