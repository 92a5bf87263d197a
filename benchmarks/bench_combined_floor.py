"""What the combined mode (a head with ``combine_with`` a lookup drafter) costs beside the lookup drafter alone.

Steps in lockstep (``bench_lockstep.run_lockstep``, fresh engines every run): plain decoding, the lookup drafter
alone, the head combined with it, and the same combination with the head forced off (it never drafts, is never
probed: only the lookup's proposals are priced and verified). The last row is the floor of the combination: what
the head's machinery costs when it brings nothing (the residual streams it captures, the lookup's proposals priced
against an empty head). Prints each run's ratio to plain, the median, and mean accepted lengths.

    python benchmarks/bench_combined_floor.py --batch 1 --repeats 3 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_lockstep and bench_offline (run standalone)
from bench_lockstep import fresh_paired_runs  # noqa: E402
from bench_offline import PROMPT_SETS  # noqa: E402


def head_off(engine) -> None:
    """Make a combined engine's head draft nothing, ever: each step prices only the lookup's proposal, and no
    probe asks the head for drafts."""
    combine = engine._combine
    engine._combine = lambda request, batch, off_path, made, proposal, probe: (
        combine(request, batch, off_path, None, proposal, False)[0], 0, False)
    engine.policy.wait_or_probe = lambda *args, **kwargs: 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kinds", default="open-ended,input-grounded")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--head", default="eagle3")
    parser.add_argument("--lookup", default='{"method": "ngram", "num_speculative_tokens": 5}')
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    from specray import SamplingParams
    from specray.default_model import default_model_path

    lookup = json.loads(args.lookup)
    combined = {"method": args.head, "num_speculative_tokens": 4, "combine_with": lookup}
    specs = {"plain": None, "lookup": lookup, "combined": combined, "combined, head off": combined}
    model = default_model_path()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print(f"# batch {args.batch}, {args.threads} threads, max_tokens {args.max_tokens}, lookup {lookup}, "
          f"head {args.head}, {args.repeats} runs, fresh engines each\n")
    for kind in args.kinds.split(","):
        print(f"| {kind} | per run | median ratio to plain | mean accepted |\n|---|---|---|---|")
        fresh_paired_runs(model, specs, args.batch, PROMPT_SETS[kind], params, args.repeats,
                          prepare=lambda llms: head_off(llms["combined, head off"].engine))

if __name__ == "__main__":
    main()
