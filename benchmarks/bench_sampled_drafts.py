"""Sampled requests with a hidden-state head: drafts drawn from the head's q against the head's argmax.

A sampled request's chain is drawn from q (its own temperature/top-k/top-p over the head's logits) and verified by
rejection sampling against that q (kept with probability min(1, p/q)); with the argmax as drafts, verification keeps
draft x with probability p(x). Both keep the target's distribution; they differ in how much they keep: sum_x min(p, q)
against sum_x q_argmax p. Steps in lockstep (``bench_lockstep.run_lockstep``, fresh engines every run): plain
sampled decoding, and the head with each kind of draft, at a fixed chain of K (every draft verified) and with the
adaptive policy. Prints each configuration's median ratio to plain and its mean accepted length.

With ``--tree TOPK,DEPTH`` the head drafts EAGLE-2 dynamic trees instead: a sampled request's tree drawn from q (each
row's children without replacement, verified against q by recursive rejection sampling) against EAGLE-2's best
nodes verified with a one-hot q ("argmax drafts").

With ``--head medusa --head-model HEADS`` (a Medusa checkpoint for the model: ``specray train-draft --method
medusa``) the heads fill the ``medusa_choices`` tree (the default's 10 nodes: ``--k 10``): a sampled request's tree
drawn from q (each node's children without replacement from q of the head at their depth) against the heads' top-k
tree verified with a one-hot q.

    python benchmarks/bench_sampled_drafts.py --batch 8 --repeats 2 --max-tokens 96 --temperatures 0.7,1.0
    python benchmarks/bench_sampled_drafts.py --tree 4,4 --k 16
    python benchmarks/bench_sampled_drafts.py --head medusa --head-model OUT/head --k 10 --temperatures 0.7
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_lockstep and bench_offline (run standalone)
from bench_lockstep import fresh_paired_runs  # noqa: E402
from bench_offline import PROMPT_SETS  # noqa: E402


def argmax_drafts(llm) -> None:
    """Make an engine's head draft its argmax (a tree: EAGLE-2's best nodes) for sampled requests too (verified
    with a one-hot q)."""
    llm.engine.executor.worker.runner.q_drafts = False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kinds", default="open-ended,input-grounded")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--head", default="eagle3")
    parser.add_argument("--head-model", default=None, help="the head's checkpoint (eagle3 on the default model: the "
                        "bundled head; medusa: required)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tree", default=None, help="TOPK,DEPTH: EAGLE-2 dynamic trees of that shape")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    from specray import SamplingParams
    from specray.default_model import default_model_path

    shape = {}
    if args.tree:
        top_k, depth = (int(x) for x in args.tree.split(","))
        shape = {"use_dynamic_tree": True, "dynamic_tree_max_topK": top_k, "dynamic_tree_depth": depth}
    if args.head_model is not None:
        shape["model"] = args.head_model
    fixed = {"method": args.head, "num_speculative_tokens": args.k, "adaptive": False, **shape}
    adaptive = {"method": args.head, "num_speculative_tokens": args.k, **shape}
    configs = {"plain": (None, False), f"K={args.k}, argmax drafts": (fixed, True),
               f"K={args.k}, drawn from q": (fixed, False), "adaptive, argmax drafts": (adaptive, True),
               "adaptive, drawn from q": (adaptive, False)}
    model = default_model_path()
    print(f"# {args.head}{' trees ' + args.tree if args.tree else ''}, batch {args.batch}, {args.threads} threads, "
          f"max_tokens {args.max_tokens}, top_p "
          f"{args.top_p}, {args.repeats} runs, fresh engines each\n")
    for temperature in (float(t) for t in args.temperatures.split(",")):
        params = SamplingParams(temperature=temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                                ignore_eos=True)
        for kind in args.kinds.split(","):
            print(f"| T={temperature}, {kind} | per run | median ratio to plain | mean accepted |\n|---|---|---|---|")
            fresh_paired_runs(model, {name: spec for name, (spec, _) in configs.items()}, args.batch,
                              PROMPT_SETS[kind], params, args.repeats, identical=False,
                              prepare=lambda llms: [argmax_drafts(llms[n]) for n, (_, am) in configs.items() if am])

if __name__ == "__main__":
    main()
