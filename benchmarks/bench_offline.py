"""Offline speed of speculative decoding on SmolLM2-135M-Instruct (fp32, CPU threads, greedy).

Compares transformers `generate` (plain and with prompt lookup), specray without speculation, specray `ngram`
and specray `draft_model` (SmolLM2 drafting for itself: a check of the mechanics, not a useful speed-up), for
one request at a time and for 8 concurrent requests, on input-grounded and open-ended prompts. Prints a
markdown table of tokens/s and mean accepted length.

    python benchmarks/bench_offline.py --threads 2 --max-tokens 128
"""

from __future__ import annotations

import argparse
import logging
import platform
import time

import torch

GROUNDED = [
    "Rename the variable `x` to `count` everywhere in this code and return the whole code:\n"
    "def tally(items):\n    x = 0\n    for item in items:\n        if item:\n            x += 1\n    return x\n\n"
    "def main():\n    x = tally([1, 0, 2])\n    print(x)\n",
    "Extract every person's name and city from this text as a list of 'name - city' lines:\n"
    "Alice Martin lives in Paris. Bob Chen moved to Toronto last year. Carol Diaz works in Madrid, "
    "and her brother David Diaz stayed in Seville. Eve Novak is from Prague.",
    "Summarize this paragraph in two sentences, reusing its wording:\n"
    "The city council approved the new budget on Tuesday. The budget increases funding for public transport "
    "by ten percent and for schools by five percent. It also cuts spending on road construction. The mayor "
    "said the budget reflects the priorities of residents, who asked for better buses and schools.",
    "Fix the bug in this function and return the corrected function:\n"
    "def average(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(value)\n",
]
OPEN_ENDED = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a weekend trip in the mountains.",
    "What are the pros and cons of working from home?",
]


def chat_prompts(tokenizer, prompts):
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in prompts]


def bench_specray(model, prompts, spec, max_tokens, concurrent):
    from specray import LLM, SamplingParams

    llm = LLM(model=model, speculative_config=spec, max_num_seqs=8, max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    texts = chat_prompts(llm.get_tokenizer(), prompts)
    llm.generate(texts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    before = llm.spec_stats.drafts, llm.spec_stats.accepted_tokens
    start = time.perf_counter()
    if concurrent:
        outs = llm.generate(texts, params, use_tqdm=False)
    else:
        outs = [o for t in texts for o in llm.generate([t], params, use_tqdm=False)]
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts = llm.spec_stats.drafts - before[0]
    accepted = llm.spec_stats.accepted_tokens - before[1]
    mal = 1 + accepted / drafts if drafts else float("nan")
    return tokens / elapsed, mal, [o.outputs[0].token_ids for o in outs]


def bench_hf(folder, prompts, max_tokens, lookup):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    texts = chat_prompts(tok, prompts)
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup
    ids = tok(texts[0], return_tensors="pt").input_ids
    model.generate(ids, max_new_tokens=8, do_sample=False)  # warm-up
    tokens, start = 0, time.perf_counter()
    outs = []
    for t in texts:
        ids = tok(t, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, **kwargs)
        tokens += out.shape[1] - ids.shape[1]
        outs.append(out[0, ids.shape[1]:].tolist())
    return tokens / (time.perf_counter() - start), outs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-spec-tokens", type=int, default=5)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--only", default=None, help="comma list of rows to run, e.g. 'specray ngram'")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    from specray.default_model import default_model_path
    from specray.models.loader import resolve_model

    model = default_model_path()
    folder = resolve_model(model).folder  # the dequantized, cached HF folder
    k = args.num_spec_tokens
    rows = {
        "specray (no speculation)": None,
        "specray ngram": {"method": "ngram", "num_speculative_tokens": k},
        "specray draft_model (self-draft)": {"method": "draft_model", "model": model, "num_speculative_tokens": 3},
    }
    print(f"# {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, max_tokens={args.max_tokens}\n")
    print("| system | prompts | batch | tokens/s | mean accepted length |\n|---|---|---|---|---|")
    only = args.only.split(",") if args.only else None
    for kind, prompts in (("input-grounded", GROUNDED), ("open-ended", OPEN_ENDED)):
        if not args.skip_hf:
            for name, lookup in (("transformers generate", None), (f"transformers prompt lookup (K={k})", k)):
                if only and name not in only:
                    continue
                tps, _ = bench_hf(folder, prompts, args.max_tokens, lookup)
                print(f"| {name} | {kind} | 1 | {tps:.1f} | - |", flush=True)
        for name, spec in rows.items():
            if only and name not in only:
                continue
            for concurrent in (False, True):
                tps, mal, _ = bench_specray(model, prompts * (2 if concurrent else 1), spec, args.max_tokens,
                                            concurrent)
                batch = 8 if concurrent else 1
                mal_s = "-" if spec is None else f"{mal:.2f}"
                print(f"| {name} | {kind} | {batch} | {tps:.1f} | {mal_s} |", flush=True)


if __name__ == "__main__":
    main()
