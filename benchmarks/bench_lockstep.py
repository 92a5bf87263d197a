"""Paired offline speed: several engines stepped in lockstep, so that this shared machine's drifts hit all alike.

``bench_offline.py`` times whole runs one after another, and on this machine the speed of runs a minute apart
differs by 10-27%: too much to tell a 5% difference. Here every engine (specray without speculation, and each
``ngram`` K) gets the same requests, as ``LLM.generate`` gives them (a closed batch, up to 8 running), and the
engines take turns one step at a time. An engine's time is the sum of its own steps (drafting, scheduling, the
forward pass, verification, detokenization: all of ``LLMEngine.step``), so a slow second slows the step that
ran in it, whichever engine's it was, and consecutive steps of two engines share the same conditions. Prints
tokens/s by that time, every run, and each run's ratio to the plain engine's; outputs must be token-identical.

    python benchmarks/bench_lockstep.py --kinds open-ended,input-grounded --num-spec-tokens 5,15 --repeats 5
    python benchmarks/bench_lockstep.py --batch 1 --num-spec-tokens 15 --prompt-lookup-min 2,1
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_offline's prompts (scripts run standalone)
from bench_offline import (KV_BYTES, PROMPT_SETS, add_common_args, add_spec_args, chat_prompts,  # noqa: E402
                           check_common_args, spec_rows)


def build(model, spec, batch):
    """An LLM, warmed up; the caller steps its engine (and keeps the LLM: releasing it shuts the engine down)."""
    from specray import LLM, SamplingParams

    llm = LLM(model=model, speculative_config=spec, max_num_seqs=batch, max_model_len=2048,
              kv_cache_memory_bytes=KV_BYTES)
    llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    return llm


def fresh_paired_runs(model, specs: dict, batch: int, prompts: list[str], params, repeats: int, prepare=None,
                      identical: bool = True) -> None:
    """``repeats`` runs with fresh engines, one per ``specs`` row (``"plain"`` among them), stepped in lockstep over
    ``prompts`` (chat-templated); ``prepare(llms)`` adjusts the engines first; ``identical``: every row's outputs must
    equal plain's (greedy). Prints each row's ratio to plain per run, the median and the mean accepted length."""
    ratios: dict[str, list[float]] = {name: [] for name in specs}
    accepted: dict[str, list[float]] = {name: [] for name in specs}
    for _ in range(repeats):
        llms = {name: build(model, spec, batch) for name, spec in specs.items()}
        if prepare is not None:
            prepare(llms)
        engines = {name: llm.engine for name, llm in llms.items()}
        tokenizer = engines["plain"].tokenizer
        prompt_ids = [tokenizer.encode(t) for t in chat_prompts(tokenizer, prompts)]
        results = run_lockstep(engines, prompt_ids, params)
        plain_seconds, reference = results["plain"]
        for name, (seconds, outputs) in results.items():
            assert not identical or outputs == reference, f"{name}: outputs differ from the plain engine's"
            ratios[name].append(plain_seconds / seconds)
            if engines[name].spec_stats.drafts:
                accepted[name].append(engines[name].spec_stats.mean_accepted_length)
        del engines, llms
    for name in specs:
        tau = f"{statistics.mean(accepted[name]):.2f}" if accepted[name] else "-"
        print(f"| {name} | {', '.join(f'{r:.3f}' for r in ratios[name])} | {statistics.median(ratios[name]):.3f} | "
              f"{tau} |", flush=True)
    print()


def run_lockstep(engines: dict, prompt_ids: list[list[int]], params, trace: dict | None = None) -> dict:
    """Give every engine the same requests, step them in turn; per engine: (seconds of its steps, outputs). With
    ``trace``, each engine's decode steps are appended to ``trace[name]`` as (seconds, drafts verified, drafts
    accepted, tokens kept)."""
    from dataclasses import replace

    ids = {name: [engine.add_request(p, replace(params)) for p in prompt_ids] for name, engine in engines.items()}
    seconds = dict.fromkeys(engines, 0.0)
    outputs = {name: {} for name in engines}
    plans = {name: _watch_plans(engine) for name, engine in engines.items()} if trace is not None else {}
    while any(engine.has_unfinished_requests() for engine in engines.values()):
        for name, engine in engines.items():
            if not engine.has_unfinished_requests():
                continue
            start = time.perf_counter()
            outs = engine.step()
            elapsed = time.perf_counter() - start
            seconds[name] += elapsed
            outputs[name].update((o.request_id, o.outputs[0].token_ids) for o in outs if o.finished)
            plan = plans[name][-1] if plans.get(name) else None
            if plan is not None and plan.chunks and all(c.sample and c.num_tokens == 1 + c.num_draft_tokens
                                                        for c in plan.chunks):
                stats = engine.scheduler.last_step_stats
                trace.setdefault(name, []).append((elapsed, stats.draft_tokens, stats.accepted_tokens,
                                                   stats.accepted_tokens + len(plan.chunks)))
    return {name: (seconds[name], [outputs[name][rid] for rid in ids[name]]) for name in engines}


def _watch_plans(engine) -> list:
    """The plans ``engine`` executes, newest last (the executor's execute, wrapped)."""
    seen, execute = [], engine.executor.execute

    def recording(plan, *args, **kwargs):
        seen[:] = [plan]
        return execute(plan, *args, **kwargs)

    engine.executor.execute = recording
    return seen


def oracle_ceiling(trace: dict, fixed: str, costed: list[str], plain: str) -> dict:
    """How fast the drafter of row ``fixed`` (a fixed K, never adaptive: every step shows how many of K drafts the
    target keeps) could be with an oracle that drafts exactly the drafts that will be kept, none at a miss: each
    step then costs ``a + b * kept`` (a, b fitted by least squares over the decode steps of rows ``costed``: the
    same drafter at various K, first pass and drafting included) and keeps ``kept + 1`` tokens per request. Against
    the plain row's seconds per token."""
    points = [(drafted, secs) for name in costed for secs, drafted, _, _ in trace.get(name, [])]
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    a = my - b * mx
    steps = trace[fixed]
    oracle_tokens = sum(tokens for _, _, _, tokens in steps)
    oracle_seconds = sum(a + b * accepted for _, _, accepted, _ in steps)
    plain_steps = trace[plain]
    plain_rate = sum(t for *_, t in plain_steps) / sum(s for s, *_ in plain_steps)
    measured_rate = oracle_tokens / sum(s for s, *_ in steps)
    return {"fit_a_ms": 1e3 * a, "fit_b_ms_per_draft": 1e3 * b, "oracle_ratio": oracle_tokens / oracle_seconds / plain_rate,
            "fixed_ratio": measured_rate / plain_rate, "steps": len(steps)}


def main():
    parser = argparse.ArgumentParser()
    add_common_args(parser)
    parser.add_argument("--kinds", default="open-ended,input-grounded")
    parser.add_argument("--batch", type=int, default=8, help="max_num_seqs; every prompt is given twice")
    parser.add_argument("--repeats", type=int, default=5)
    add_spec_args(parser)
    parser.add_argument("--fresh", action="store_true",
                        help="every prompt once, and new engines for every run: drafters that learn across requests "
                             "(suffix's global tree, ngram_mod, ngram_cache, a public pool) never see the same "
                             "prompt's earlier output")
    parser.add_argument("--ceiling", default=None, metavar="FIXED_ROW:COSTED_ROW[,COSTED_ROW]",
                        help="print the oracle ceiling of the --spec row FIXED_ROW (a fixed K, adaptive false), its "
                             "step cost fitted on the COSTED rows (the same drafter at other K), decode steps only")
    args = parser.parse_args()
    check_common_args(parser, args)
    if args.batch < 1 or args.repeats < 1:
        parser.error("--batch and --repeats take 1 or more")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    from specray import SamplingParams
    from specray.default_model import default_model_path

    model = default_model_path()
    specs = {"specray (no speculation)": None, **spec_rows(args)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print(f"# {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, batch {args.batch} ({'every prompt once, new engines every run' if args.fresh else 'every prompt twice'}), max_tokens="
          f"{args.max_tokens}, stop at EOS, engines stepped in lockstep, {args.repeats} runs\n")
    print("| system | prompts | tokens/s (median) | runs | ratio to plain, per run | median ratio | mean accepted |\n"
          "|---|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        prompts = PROMPT_SETS[kind]
        llms = {name: build(model, spec, args.batch) for name, spec in specs.items()}
        engines = {name: llm.engine for name, llm in llms.items()}
        tokenizer = next(iter(engines.values())).tokenizer
        prompt_ids = [tokenizer.encode(t) for t in chat_prompts(tokenizer, prompts)] * (1 if args.fresh else 2)
        rates = {name: [] for name in engines}
        trace = {} if args.ceiling else None
        for run in range(args.repeats):
            if args.fresh and run:
                del engines, llms
                llms = {name: build(model, spec, args.batch) for name, spec in specs.items()}
                engines = {name: llm.engine for name, llm in llms.items()}
            results = run_lockstep(engines, prompt_ids, params, trace)
            reference = results["specray (no speculation)"][1]
            for name, (seconds, outputs) in results.items():
                assert outputs == reference, f"{name}: outputs differ from the plain engine's"
                rates[name].append(sum(map(len, outputs)) / seconds)
        plain = rates["specray (no speculation)"]
        for name, rs in rates.items():
            ratios = [r / p for r, p in zip(rs, plain)]
            stats = engines[name].spec_stats  # over this kind's runs (the engines of the last run with --fresh)
            tau = f"{stats.mean_accepted_length:.2f}" if stats.drafts else "-"
            print(f"| {name} | {kind} | {statistics.median(rs):.1f} | {', '.join(f'{r:.1f}' for r in rs)} | "
                  f"{', '.join(f'{q:.3f}' for q in ratios)} | {statistics.median(ratios):.3f} | {tau} |", flush=True)
        if args.ceiling:
            fixed, _, costed = args.ceiling.partition(":")
            names = [f"specray {n}" for n in [fixed, *costed.split(",")] if n]
            print(f"\noracle ceiling ({kind}): {oracle_ceiling(trace, names[0], names, 'specray (no speculation)')}\n",
                  flush=True)
        del engines, llms


if __name__ == "__main__":
    main()
