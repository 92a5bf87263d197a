"""A draft model of another tokenizer (drafts translated through text), offline, on the default model.

The draft model is the target itself: once as it is (``self``: the same tokenizer, every greedy draft is the
target's own next token) and once over a permuted vocabulary (``translated``: another tokenizer's ids for the same
model, tests/vocabularies.py), so its drafts pass through the translation both ways
(:mod:`specray.drafters.vocab_translation`). What the translated run keeps of ``self``'s acceptance is what the
translation loses on real text; the host time spent translating is its cost. A draft as large as the target buys
no speed; this measures fidelity and overhead, not a speed-up.

Configurations, each run ``--rounds`` times, alternated: ``plain`` (no speculation), ``self``, ``translated``, and
with ``--temperature`` > 0 also ``translated-text`` (the drafter's sampled requests made to draft through text as
greedy ones do, their drafts without q verified by coupling, instead of drawing among the tokens both vocabularies
hold with q carried over); one batch of ``--requests`` chat prompts, ``--max-tokens`` each, greedy or sampled at
``--temperature`` with one seed. Per run: wall time, output tokens, drafted and accepted tokens, the translator's
host time, and whether the outputs equal plain decoding's (greedy: they must; sampled: coupling keeps a seeded
request's output, rejection sampling with q keeps its distribution only). One JSON line per run, then a summary with
the machine and commit.

    PYTHONSAFEPATH=1 python benchmarks/bench_vocab_translation.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specray import LLM, SamplingParams
from specray.default_model import default_model_path
from specray.drafters import vocab_translation
from specray.models.loader import convert_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from vocabularies import permuted_copy  # noqa: E402  (the suite's permuted copy of a model folder)

QUESTIONS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three tips for writing clear emails.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Give me a short recipe for pancakes.",
    "How does a hash table work?",
    "Write a haiku about autumn.",
]


class TranslatorClock:
    """Host seconds spent in the translator's two calls (wrapped on the class: the engine's drafter uses it)."""

    def __init__(self):
        self.seconds = 0.0
        for name in ("to_draft", "to_target"):
            real = getattr(vocab_translation.VocabTranslator, name)
            setattr(vocab_translation.VocabTranslator, name, self._timed(real))

    def _timed(self, real):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    target = default_model_path()
    folder = convert_gguf(Path(target))
    permuted = permuted_copy(folder, Path(tempfile.mkdtemp()) / "permuted")
    clock = TranslatorClock()
    configs = {
        "plain": None,
        "self": {"method": "draft_model", "model": str(folder), "num_speculative_tokens": args.k, "adaptive": False},
        "translated": {"method": "draft_model", "model": str(permuted), "num_speculative_tokens": args.k,
                       "adaptive": False},
    }
    if args.temperature > 0:
        configs["translated-text"] = configs["translated"]
    engines = {name: LLM(str(target), max_model_len=1024, max_num_seqs=args.requests, speculative_config=spec)
               for name, spec in configs.items()}
    if "translated-text" in engines:
        engines["translated-text"].engine.drafter._draws_twins = lambda: False
    assert engines["translated"].engine.drafter.translator is not None
    assert engines["self"].engine.drafter.translator is None
    messages = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(args.requests)]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=11, ignore_eos=True)
    plain_tokens = None
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for round_ in range(args.rounds):
        for name, llm in engines.items():
            before = llm.spec_stats.copy() if configs[name] else None
            clock.seconds = 0.0
            start = time.perf_counter()
            outs = llm.chat(messages, params, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            if name == "plain":
                plain_tokens = tokens if plain_tokens is None else plain_tokens
            row = {"config": name, "round": round_, "wall_s": round(wall, 3),
                   "output_tokens": sum(len(t) for t in tokens),
                   "equal_to_plain": tokens == plain_tokens}
            if before is not None:
                stats = llm.spec_stats
                drafted = stats.draft_tokens - before.draft_tokens
                accepted = stats.accepted_tokens - before.accepted_tokens
                row.update(drafted=drafted, accepted=accepted,
                           acceptance=round(accepted / drafted, 4) if drafted else None,
                           translator_s=round(clock.seconds, 4))
            results[name].append(row)
            print(json.dumps(row), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    summary = {"machine": platform.processor() or platform.machine(), "cpus": torch.get_num_threads(),
               "torch": torch.__version__, "commit": commit, "requests": args.requests,
               "max_tokens": args.max_tokens, "k": args.k, "temperature": args.temperature}
    for name, rows in results.items():
        summary[name] = {"wall_s_median": statistics.median(r["wall_s"] for r in rows),
                         "equal_to_plain": all(r["equal_to_plain"] for r in rows)}
        if configs[name]:
            summary[name].update(acceptance=rows[-1]["acceptance"],
                                 translator_s_median=statistics.median(r["translator_s"] for r in rows))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
