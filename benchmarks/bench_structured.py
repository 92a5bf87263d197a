"""Structured outputs, offline: JSON-schema extraction on the default model (or ``--model``), chat-templated, greedy.

``--requests`` short texts, each asking for a JSON object of a fixed schema (names, an enum, numbers, a list), sent
as one batch. Configurations, each run ``--rounds`` times, alternated, in this process:

- ``free``: no schema (the same prompts, unconstrained): what the mask and the grammar cost is measured against.
- ``schema, no forced drafts``: the schema, its forced tokens not drafted (``forced_draft_limit = 0``): one target
  step per output token, as a constrained decoder without speculation takes.
- ``schema``: the schema; the grammar's forced tokens (keys, quotes, separators) verified as drafts.
- ``schema + <spec>``: the schema with a drafter (``--spec``, default ngram), forced tokens too.

Per run: wall time of the batch, output tokens, target steps (of the whole batch), and for the schema runs whether the
outputs are token-identical to those without forced drafts (they must be) and how many are valid JSON of the
schema. Prints one JSON line per run, then a summary with the machine, torch version and commit.

    PYTHONSAFEPATH=1 python benchmarks/bench_structured.py --rounds 2
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

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["engineer", "teacher", "doctor", "artist", "other"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "city", "age", "role", "hobbies"],
    "additionalProperties": False,
}
TEXTS = ["Maria Lopez is a 34 year old engineer from Madrid who loves hiking and chess.",
         "Tom Becker, 52, teaches physics in Berlin. He paints and plays the cello on weekends.",
         "Aiko Tanaka is a doctor in Osaka. She is 41 and enjoys running and photography.",
         "Lucas Martin, a 27 year old artist from Lyon, spends his time sketching and cycling.",
         "Priya Shah is a 45 year old teacher in Mumbai. Her hobbies are gardening and reading.",
         "Olu Adeyemi, 38, is a software engineer in Lagos who plays football and the drums.",
         "Sofia Rossi is a 29 year old doctor from Rome who likes swimming and cooking.",
         "Jan Novak, 61, is a retired teacher in Prague who collects stamps and goes fishing."]


def conversations(n: int) -> list[list[dict]]:
    ask = ("Extract the person's details as JSON with the keys name, city, age, role (engineer, teacher, doctor, "
           "artist or other) and hobbies.\n\n")
    return [[{"role": "user", "content": ask + TEXTS[i % len(TEXTS)]}] for i in range(n)]


def valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    try:
        import jsonschema
    except ImportError:
        return isinstance(value, dict) and set(value) == set(SCHEMA["required"])
    try:
        jsonschema.validate(value, SCHEMA)
        return True
    except jsonschema.ValidationError:
        return False


def run(llm: LLM, name: str, convs, params: SamplingParams, forced: bool) -> dict:
    engine = llm.engine
    engine.forced_draft_limit = 16 if forced else 0
    steps = engine.num_steps
    start = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = engine.num_steps - steps
    return {"config": name, "seconds": round(elapsed, 3), "output_tokens": tokens, "steps": steps,
            "tokens_per_s": round(tokens / elapsed, 1),
            "valid_json": sum(valid(o.outputs[0].text) for o in outs), "requests": len(outs),
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spec", default="ngram", help="the drafter of the last configuration")
    ap.add_argument("--enforce-eager", action="store_true", help="every step eager (default: the engine's: CUDA "
                    "graphs on a GPU)")
    args = ap.parse_args()
    model = args.model or str(default_model_path())
    common = dict(max_model_len=2048, max_num_seqs=args.requests, enforce_eager=args.enforce_eager or None)
    plain = LLM(model, **common)
    spec = LLM(model, speculative_config={"method": args.spec, "num_speculative_tokens": 5}, **common)
    convs = conversations(args.requests)
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    schema = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA})
    configs = [("free", plain, free, False), ("schema, no forced drafts", plain, schema, False),
               ("schema", plain, schema, True), (f"schema + {args.spec}", spec, schema, True)]
    # warm-up: compiled grammar, tokenizer, first-call costs; on a GPU every step shape's CUDA graph (captured the
    # first time the shape occurs), so a whole batch of each configuration
    warm = convs if torch.cuda.is_available() and not args.enforce_eager else convs[:1]
    for llm in (plain, spec):
        for params in (free, schema):
            llm.chat(warm, params, use_tqdm=False)
    results: dict[str, list[dict]] = {name: [] for name, *_ in configs}
    reference = None
    for _ in range(args.rounds):
        for name, llm, params, forced in configs:
            r = run(llm, name, convs, params, forced)
            if name == "schema, no forced drafts":
                reference = r["token_ids"]
            if params is schema:
                r["equal_to_no_forced"] = reference is None or r["token_ids"] == reference
            results[name].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "token_ids"}), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"\nmachine: {platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, commit {commit}")
    base = statistics.median(r["seconds"] for r in results["schema, no forced drafts"])
    for name, rs in results.items():
        secs = statistics.median(r["seconds"] for r in rs)
        tokens, steps = rs[-1]["output_tokens"], rs[-1]["steps"]
        print(f"{name:28s} median {secs:7.2f} s  {tokens / secs:7.1f} tok/s  {steps:4d} steps  "
              f"x{base / secs:4.2f} vs no forced drafts  valid {rs[-1]['valid_json']}/{rs[-1]['requests']}  "
              f"equal {all(r.get('equal_to_no_forced', True) for r in rs)}")


if __name__ == "__main__":
    main()
