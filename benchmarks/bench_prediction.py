"""Predicted Outputs (OpenAI's ``prediction``), offline: code edits on the default model (or ``--model``), greedy.

Each request asks the model to make one small change to a Python file and return the whole file; the file is in
the prompt (as in OpenAI's own examples) and, for the prediction configurations, also the request's prediction.
One batch of ``--requests`` such edits (different files and changes), chat-templated; or, ``--workload
regenerate``, questions asked again in other words, each predicted by the plain answer to its first wording (an
expected output that is not in the prompt). Configurations, each run
``--rounds`` times, alternated, in this process:

- ``plain``: no speculation;
- ``ngram``: prompt lookup (``num_speculative_tokens`` ``--k``), which can copy the file from the prompt too;
- ``prediction``: the engine drafts only from predictions (``method="prediction"``);
- ``ngram + prediction``: an ngram engine; requests with a prediction draft from it (routed).

Per run: wall time, output tokens, target steps, mean tokens per request step (from the speculation counters)
and whether the outputs are token-identical to plain decoding's (they must be). Prints one JSON line per run,
then a summary with the machine, torch version and commit.

    PYTHONSAFEPATH=1 python benchmarks/bench_prediction.py --rounds 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import subprocess
import time

import torch

from specray import LLM, SamplingParams
from specray.default_model import default_model_path

FILES = [
    '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


def subtract(a, b):
    """Return a minus b."""
    return a - b


def multiply(a, b):
    """Return the product of a and b."""
    return a * b


def divide(a, b):
    """Return a divided by b."""
    if b == 0:
        raise ValueError("cannot divide by zero")
    return a / b
''',
    '''class Counter:
    def __init__(self):
        self.count = 0

    def increment(self):
        self.count += 1
        return self.count

    def decrement(self):
        self.count -= 1
        return self.count

    def reset(self):
        self.count = 0
''',
    '''import json


def load_config(path):
    with open(path) as f:
        return json.load(f)


def save_config(path, config):
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def merge_configs(base, override):
    merged = dict(base)
    merged.update(override)
    return merged
''',
    '''def fibonacci(n):
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b


def factorial(n):
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result
''',
]
CHANGES = ["Rename the function add to plus.", "Rename the class Counter to Tally.",
           "Change the indent in save_config from 2 to 4.", "Rename the variable result to product."]


def conversations(n: int) -> tuple[list[list[dict]], list[str]]:
    convs, files = [], []
    for i in range(n):
        code = FILES[i % len(FILES)]
        ask = f"{CHANGES[i % len(CHANGES)]} Reply with the whole file and nothing else.\n\n```python\n{code}```"
        convs.append([{"role": "user", "content": ask}])
        files.append(f"```python\n{code}```")
    return convs, files


# the "regenerate" workload: a question asked again in other words, the answer to the first wording its prediction
# (an expected output that is not in the prompt, where prompt lookup has nothing to copy)
QUESTIONS = [("Explain why the sky is blue to a ten-year-old.", "Tell a ten-year-old why the sky is blue."),
             ("Give me five ideas for a weekend trip in the mountains.",
              "List five ideas for a weekend trip to the mountains."),
             ("What are the pros and cons of working from home?", "What are the advantages and disadvantages of "
              "working from home?"),
             ("How do vaccines train the immune system?", "Explain how vaccines train the immune system."),
             ("Write a short poem about the ocean at night.", "Write a short poem about the sea at night."),
             ("What should a beginner know before learning the guitar?",
              "What does a beginner need to know before learning the guitar?"),
             ("Describe how a bicycle works.", "Explain how a bicycle works."),
             ("Give three tips for writing clear emails.", "Share three tips for writing clear emails.")]


def regenerate_conversations(llm: LLM, n: int, max_tokens: int) -> tuple[list[list[dict]], list[str]]:
    """The second wordings, each with the plain greedy answer to its first wording as the prediction."""
    first = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)][0]}] for i in range(n)]
    answers = llm.chat(first, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    convs = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)][1]}] for i in range(n)]
    return convs, [o.outputs[0].text for o in answers]


def run(llm: LLM, name: str, convs, params: list[SamplingParams]) -> dict:
    engine = llm.engine
    steps = engine.num_steps
    start = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts = sum(o.spec_stats.drafts for o in outs)
    accepted = sum(o.spec_stats.accepted_tokens for o in outs)
    return {"config": name, "seconds": round(elapsed, 3), "output_tokens": tokens, "steps": engine.num_steps - steps,
            "tokens_per_s": round(tokens / elapsed, 1), "drafts": drafts, "accepted_tokens": accepted,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens of the speculating engines")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workload", default="edit", choices=("edit", "regenerate"),
                    help="edit: code edits, the file in the prompt and the prediction; regenerate: a question asked "
                    "again in other words, the first answer the prediction (not in the prompt)")
    ap.add_argument("--enforce-eager", action="store_true", help="every step eager (default: the engine's: CUDA "
                    "graphs on a GPU)")
    args = ap.parse_args()
    model = args.model or str(default_model_path())
    common = dict(max_model_len=2048, max_num_seqs=args.requests, enforce_eager=args.enforce_eager or None)
    engines = {"plain": LLM(model, **common),
               "ngram": LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": args.k}, **common),
               "prediction": LLM(model, speculative_config={"method": "prediction", "num_speculative_tokens": args.k},
                                 **common)}
    if args.workload == "edit":
        convs, files = conversations(args.requests)
    else:
        convs, files = regenerate_conversations(engines["plain"], args.requests, args.max_tokens)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    predicted = [dataclasses.replace(greedy, prediction=f) for f in files]
    configs = [("plain", "plain", [greedy] * len(convs)), ("ngram", "ngram", [greedy] * len(convs)),
               ("prediction", "prediction", predicted), ("ngram + prediction", "ngram", predicted)]
    warm = len(convs) if torch.cuda.is_available() and not args.enforce_eager else 1
    for name, engine, params in configs:  # warm-up (on a GPU: every step shape's graph of a whole batch)
        engines[engine].chat(convs[:warm], params[:warm], use_tqdm=False)
    results: dict[str, list[dict]] = {name: [] for name, *_ in configs}
    reference = None
    for _ in range(args.rounds):
        for name, engine, params in configs:
            r = run(engines[engine], name, convs, params)
            if name == "plain":
                reference = r["token_ids"]
            r["equal_to_plain"] = r["token_ids"] == reference
            results[name].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "token_ids"}), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or platform.machine()
    print(f"\nworkload: {args.workload}; machine: {device}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, commit {commit}")
    base = statistics.median(r["seconds"] for r in results["plain"])
    for name, rs in results.items():
        secs = statistics.median(r["seconds"] for r in rs)
        last = rs[-1]
        per_step = 1 + last["accepted_tokens"] / last["drafts"] if last["drafts"] else 1.0
        print(f"{name:20s} median {secs:7.2f} s  {last['output_tokens'] / secs:7.1f} tok/s  {last['steps']:4d} steps  "
              f"{per_step:5.2f} tokens per drafted step  x{base / secs:4.2f} vs plain  "
              f"equal {all(r['equal_to_plain'] for r in rs)}")


if __name__ == "__main__":
    main()
