"""Offline speed of speculative decoding on SmolLM2-135M-Instruct (greedy; fp32 on CPU threads by default, or
``--device cuda``, where ``--dtype auto`` is bf16).

Compares transformers `generate` (plain and with prompt lookup), specray without speculation, specray `ngram`
and specray `draft_model` (SmolLM2 drafting for itself: a check of the mechanics, not a useful speed-up), for
one request at a time and for 8 concurrent requests, on input-grounded and open-ended prompts. Every system is
built once and timed ``--repeats`` times, the rows interleaved (this shared machine's speed drifts); the table
shows the median tokens/s, every run, the mean accepted length and each prompt's output length. Requests stop at
EOS or ``--max-tokens``; ``--ignore-eos`` forces ``--max-tokens`` tokens (then an input-grounded answer is
followed by text the model makes up after its EOS, which is no longer grounded in the input).

    python benchmarks/bench_offline.py --threads 2 --max-tokens 128 --num-spec-tokens 5,12
    python benchmarks/bench_offline.py --device cuda --skip-hf --spec 'eagle3={"method": "eagle3"}'
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time

import torch

KV_BYTES = 192 << 20  # per engine: 8 requests of ~300 tokens need far less; the default (1 GiB) x 8 engines OOMs
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
    # Added on 2026-11-23, before any was run, so that one prompt's quirks weigh less.
    "Add a docstring to this function and return the whole function:\n"
    "def clamp(value, low, high):\n    if value < low:\n        return low\n    if value > high:\n"
    "        return high\n    return value\n",
    "Convert this JavaScript function to Python:\n"
    "function greet(name) {\n  if (!name) {\n    return 'Hello, stranger!';\n  }\n"
    "  return 'Hello, ' + name + '!';\n}\n",
    "Add type hints to this Python code and return the whole code:\n"
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n",
    "List every date mentioned in this email, one per line, with what happens on it:\n"
    "Hi team, the design review moves to March 3. Code freeze is on March 10, and the release candidate "
    "ships on March 14. We will hold the retrospective on March 21.",
    "Extract the product names and prices from this text as a JSON list of objects with keys name and price:\n"
    "The store sells the Basic Kettle for $25, the Deluxe Kettle for $40, the Travel Mug for $12 and the "
    "Tea Sampler for $18.",
    "Turn these meeting notes into a bulleted list of action items with their owners:\n"
    "Maria will update the budget spreadsheet. Tom will book the venue for the conference. Priya will send the "
    "invitations to the speakers. Everyone will review the draft agenda by Friday.",
    "Summarize this product review in one sentence, reusing its words:\n"
    "The blender is powerful and easy to clean. It crushes ice in seconds and makes smooth soups. However, "
    "it is loud, and the lid sometimes leaks when the jar is full. Overall it is a good blender for the price.",
    "Rewrite this paragraph in the past tense:\n"
    "Every morning Sam walks to the bakery. He buys a loaf of bread and a coffee. Then he sits by the window "
    "and reads the newspaper before he goes to work.",
]
OPEN_ENDED = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a weekend trip in the mountains.",
    "What are the pros and cons of working from home?",
    # Added on 2026-11-23, before any was run.
    "Write a poem about the ocean at night.",
    "How do vaccines train the immune system?",
    "Describe your ideal city of the future.",
    "What should a beginner know before learning to play the guitar?",
]
# One task template applied to many inputs (where what earlier answers looked like predicts the next answer:
# suffix decoding's global tree), and follow-up turns that quote an earlier answer. Added on 2026-11-24 for the
# token-tree issue, before any was run.
_PEOPLE = [("Alice Martin", "Paris", "nurse"), ("Bob Chen", "Toronto", "teacher"), ("Carol Diaz", "Madrid", "pilot"),
           ("David Novak", "Prague", "chef"), ("Eve Tanaka", "Osaka", "lawyer"), ("Frank Okafor", "Lagos", "banker"),
           ("Grace Kim", "Seoul", "architect"), ("Hugo Silva", "Lisbon", "baker"), ("Ines Moreau", "Lyon", "dentist"),
           ("Jack Brown", "Leeds", "plumber"), ("Kara Singh", "Delhi", "engineer"), ("Liam Walsh", "Cork", "farmer")]
REPEATED_TASK = [
    f"Extract the person's name, city and job from this sentence as JSON with keys name, city and job:\n"
    f"{name} works as a {job} in {city} and has lived there for many years."
    for name, city, job in _PEOPLE
] + [
    "Earlier you wrote: \"The meeting is on Monday at 10 am in room 4. Bring the budget report and the slides.\" "
    "Repeat that note exactly, but change Monday to Tuesday.",
    "You answered: \"To reset the router, unplug it, wait thirty seconds, plug it back in, and wait for the light "
    "to turn green.\" Repeat those steps as a numbered list.",
    "Your last answer was: \"Paris is the capital of France. It is known for the Eiffel Tower and the Louvre.\" "
    "Repeat it and add one sentence about the Seine.",
    "Earlier you said: \"def square(x):\n    return x * x\" Repeat the function and add a docstring.",
]
PROMPT_SETS = {"input-grounded": GROUNDED, "open-ended": OPEN_ENDED, "repeated-task": REPEATED_TASK}


def chat_prompts(tokenizer, prompts):
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in prompts]


class SpecrayRun:
    """One specray configuration, built once and timed several times (interleaved with the others), one request
    at a time or all at once (up to 8 running)."""

    def __init__(self, model, spec, prompts, max_tokens, ignore_eos, device="cpu", dtype="auto", graphs=False):
        from specray import LLM, SamplingParams

        self.llm = LLM(model=model, speculative_config=spec, max_num_seqs=8, max_model_len=2048,
                       kv_cache_memory_bytes=KV_BYTES, device=device, dtype=dtype, enforce_eager=not graphs)
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        self.texts = chat_prompts(self.llm.get_tokenizer(), prompts)
        self.llm.generate(self.texts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
        # CUDA graphs are captured per step shape the first time it occurs: an untimed run of each batch mode first
        self.captures = graphs and torch.device(device).type == "cuda"

    def __call__(self, concurrent: bool):
        """tokens/s, mean accepted length (NaN without drafts), the outputs' token ids."""
        stats = self.llm.spec_stats
        before = stats.drafts, stats.accepted_tokens
        start = time.perf_counter()
        if concurrent:  # every prompt twice
            outs = self.llm.generate(self.texts * 2, self.params, use_tqdm=False)
        else:
            outs = [o for t in self.texts for o in self.llm.generate([t], self.params, use_tqdm=False)]
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        drafts, accepted = stats.drafts - before[0], stats.accepted_tokens - before[1]
        mal = 1 + accepted / drafts if drafts else float("nan")
        return tokens / elapsed, mal, [o.outputs[0].token_ids for o in outs]


class HFRun:
    """transformers ``generate`` on the same dequantized weights, one prompt at a time."""

    def __init__(self, folder, prompts, max_tokens, ignore_eos, lookup, device="cpu", dtype=torch.float32):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        self.ids = [tok(t, return_tensors="pt").input_ids.to(device) for t in chat_prompts(tok, prompts)]
        self.kwargs = dict(max_new_tokens=max_tokens, do_sample=False)
        if ignore_eos:
            self.kwargs["min_new_tokens"] = max_tokens
        if lookup:
            self.kwargs["prompt_lookup_num_tokens"] = lookup
        self.model.generate(self.ids[0], max_new_tokens=8, do_sample=False)  # warm-up

    @torch.inference_mode()
    def __call__(self, concurrent: bool = False):
        tokens, outs, start = 0, [], time.perf_counter()
        for ids in self.ids:
            out = self.model.generate(ids, **self.kwargs)
            tokens += out.shape[1] - ids.shape[1]
            outs.append(out[0, ids.shape[1]:].tolist())
        return tokens / (time.perf_counter() - start), float("nan"), outs


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The options this script shares with bench_lockstep.py and bench_replay.py."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (every row's)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                        help="specray's dtype (auto: float32 on CPU, the checkpoint's half type on a GPU); the "
                             "transformers rows take the same, float32 for auto on CPU, bfloat16 on a GPU")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-spec-tokens", default="5", help="the ngram rows' K, or a comma list: 5,12")
    parser.add_argument("--prompt-lookup-min", default="2", help="the ngram rows' prompt_lookup_min, or a comma "
                        "list (each K runs with each)")


def int_list(parser: argparse.ArgumentParser, flag: str, text: str, allowed=None) -> list[int]:
    """A comma list of ints >= 1 (or of ``allowed``), else the parser's error naming the flag."""
    items = text.split(",")
    if not all(i.strip().isdigit() and int(i) >= 1 for i in items) or (
            allowed and not set(map(int, items)) <= set(allowed)):
        parser.error(f"{flag} {text}: give a comma list of "
                     + (" or ".join(map(str, allowed)) if allowed else "whole numbers >= 1"))
    return [int(i) for i in items]


def check_common_args(parser: argparse.ArgumentParser, args) -> None:
    """The shared options (and ``--kinds``, ``--spec``) checked before any model loads: a bad one is the parser's
    error naming it, not a traceback later or a row that measures something else than it names."""
    unknown = sorted(set(args.kinds.split(",")) - set(PROMPT_SETS))
    if unknown:
        parser.error(f"--kinds {args.kinds}: unknown {unknown}; give a comma list of {', '.join(PROMPT_SETS)}")
    if args.max_tokens < 1 or args.threads < 1:
        parser.error("--max-tokens and --threads take 1 or more")
    int_list(parser, "--num-spec-tokens", args.num_spec_tokens)
    int_list(parser, "--prompt-lookup-min", args.prompt_lookup_min)
    for row in getattr(args, "spec", []):
        name, eq, config = row.partition("={")
        try:
            value = json.loads("{" + config) if eq and name else None
        except json.JSONDecodeError as err:
            parser.error(f"--spec {row}: not a JSON object after NAME= ({err})")
        if not isinstance(value, dict):
            parser.error(f"--spec {row}: give NAME=JSON, e.g. 'suffix={{\"method\": \"suffix\"}}'")


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    """Rows beyond the ngram grid (bench_lockstep.py and bench_replay.py)."""
    parser.add_argument("--spec", action="append", default=[], metavar="NAME=JSON",
                        help="one more row: a speculative_config, e.g. 'suffix={\"method\": \"suffix\", "
                             "\"num_speculative_tokens\": 12}' (repeatable)")
    parser.add_argument("--no-ngram-rows", action="store_true", help="only the --spec rows (and plain)")


def spec_rows(args) -> dict[str, dict]:
    """The speculative rows by name: the ngram grid (unless --no-ngram-rows), then each --spec."""
    specs = {} if args.no_ngram_rows else ngram_specs(args)
    for row in args.spec:
        name, _, config = row.partition("={")  # the name may hold "=" (K=8); the JSON starts at "{"
        specs[f"specray {name}"] = json.loads("{" + config)
    return specs


def ngram_specs(args) -> dict[str, dict]:
    """One ngram speculative_config per (K, prompt_lookup_min) of the options, by row name."""
    specs = {}
    for k in (int(k) for k in args.num_spec_tokens.split(",")):
        for lookup_min in (int(m) for m in args.prompt_lookup_min.split(",")):
            name = f"specray ngram (K={k})" if lookup_min == 2 else f"specray ngram min {lookup_min} (K={k})"
            specs[name] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup_min}
    return specs


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    add_common_args(parser)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate exactly max-tokens per request (past EOS); default: stop at EOS")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row, interleaved; the median is shown")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--no-draft-model-row", action="store_true", help="skip the self-drafting draft_model row")
    parser.add_argument("--modes", default=None, help="comma list: eager (enforce_eager=True), graphs "
                        "(enforce_eager=False: CUDA graphs on a GPU); each specray row runs in each mode (default: "
                        "the engine's, graphs on a GPU, eager on CPU)")
    parser.add_argument("--graphs", action="store_true", help="the same as --modes graphs")
    add_spec_args(parser)
    parser.add_argument("--only", default=None, help="comma list of rows to run, e.g. 'specray ngram'")
    parser.add_argument("--kinds", default="input-grounded,open-ended")
    parser.add_argument("--batches", default="1,8", help="the specray rows' batch modes: 1, 8 or 1,8")
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    int_list(parser, "--batches", args.batches, allowed=(1, 8))
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more")
    if args.modes and not set(args.modes.split(",")) <= {"eager", "graphs"}:
        parser.error(f"--modes {args.modes}: give a comma list of eager, graphs")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    from specray.default_model import default_model_path
    from specray.models.loader import resolve_model

    model = default_model_path()
    folder = resolve_model(model).path  # the dequantized, cached HF folder
    ks = [int(k) for k in args.num_spec_tokens.split(",")]
    modes = ["graphs"] if args.graphs else (args.modes or ("graphs" if args.device.startswith("cuda") else "eager")
                                            ).split(",")
    specs = {"specray (no speculation)": None}
    specs.update(spec_rows(args))
    if not args.no_draft_model_row:
        specs["specray draft_model (self-draft, K=3)"] = {"method": "draft_model", "model": model,
                                                          "num_speculative_tokens": 3}
    names = {*specs, *(() if args.skip_hf else ("transformers generate", f"transformers prompt lookup (K={ks[0]})"))}
    unknown = set(args.only.split(",")) - names - {f"{n}, {m}" for n in names for m in modes} if args.only else ()
    if unknown:
        parser.error(f"--only {args.only}: no row named {sorted(unknown)}; the rows: {sorted(names)}")
    hf_dtype = torch.float32 if args.dtype == "auto" and args.device == "cpu" else (
        torch.bfloat16 if args.dtype == "auto" else getattr(torch, args.dtype))
    device = ""
    if args.device.startswith("cuda"):
        device = f"{torch.cuda.get_device_name(torch.device(args.device))}, {args.dtype} (transformers {hf_dtype}), "
    print(f"# {device}{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, max_tokens={args.max_tokens}, "
          f"{'ignore_eos' if args.ignore_eos else 'stop at EOS'}, median of {args.repeats}"
          f", modes {','.join(modes)}\n")
    print("| system | prompts | batch | tokens/s | runs | mean accepted length | output tokens | outputs unlike the "
          "first row's |\n|---|---|---|---|---|---|---|---|")
    only = args.only.split(",") if args.only else None
    for kind in args.kinds.split(","):
        prompts = PROMPT_SETS[kind]
        builders = {}
        if not args.skip_hf:
            for name, lookup in (("transformers generate", None), (f"transformers prompt lookup (K={ks[0]})", ks[0])):
                builders[name] = (lambda lookup=lookup: HFRun(folder, prompts, args.max_tokens, args.ignore_eos,
                                                              lookup, args.device, hf_dtype), [1])
        for name, spec in specs.items():
            for mode in modes:
                row = name if len(modes) == 1 else f"{name}, {mode}"
                builders[row] = (lambda spec=spec, mode=mode: SpecrayRun(
                    model, spec, prompts, args.max_tokens, args.ignore_eos, args.device, args.dtype,
                    mode == "graphs"), [int(b) for b in args.batches.split(",")])
        runs = {name: (make(), batches) for name, (make, batches) in builders.items()
                if not only or name in only or name.rsplit(", ", 1)[0] in only}
        results = {(name, b): [] for name, (_, batches) in runs.items() for b in batches}
        for run, batches in runs.values():
            for b in batches if getattr(run, "captures", False) else ():
                run(b == 8)
        for _ in range(args.repeats):
            for name, (run, batches) in runs.items():
                for b in batches:
                    results[name, b].append(run(b == 8))
        reference = None
        for (name, batch), rs in results.items():
            tps = sorted(r[0] for r in rs)
            outputs = rs[0][2][:len(prompts)]
            reference = reference or outputs
            diff = sum(o != r for o, r in zip(outputs, reference))
            mal = rs[0][1]
            print(f"| {name} | {kind} | {batch} | {statistics.median(tps):.1f} | "
                  f"{', '.join(f'{t:.1f}' for t in tps)} | {'-' if mal != mal else f'{mal:.2f}'} | "
                  f"{sum(len(o) for o in outputs)} | {diff} |", flush=True)
        print(f"<!-- {kind} output tokens per prompt: {[len(o) for o in reference]} -->", flush=True)
        del runs


if __name__ == "__main__":
    main()
