"""Replay: the real engine against the target's recorded greedy answers, timed by a cost curve; and the ceiling.

A paired run (``bench_lockstep.py``) takes minutes and still moves by a few percent. Greedy decoding is
deterministic, so the target's answers can be recorded once and replayed: the engine (scheduler, n-gram drafter,
draft-length policy, all of it real) runs against an executor that answers each step from the recording (a
draft is kept while it matches the recorded answer, then the recorded token follows) and charges the step what a
forward pass of its size cost when measured here. The engine's step timer is a virtual clock advanced by those
charges, so the policy's cost fit sees them too. Each replay takes seconds, and repeats exactly.

It also gives the ceiling of each drafter on the recording: an *oracle* that proposes what the drafter would,
cut to the tokens the target will accept (a token tree cut to its accepted path, verified as a chain), so no
drafted token is ever wasted and K never falls short of the match. No policy that sizes or shapes the same
proposals can beat it. A "fixed" row drafts every proposal whole (``adaptive=False``), for what the policy's sizing
buys. Trees are verified greedily against the recording (the first child holding the recorded token); lookahead
decoding cannot be replayed (it needs the target's tokens off the accepted path, which no recording holds).

Rows: the ngram grid of ``--num-spec-tokens`` x ``--prompt-lookup-min``, and any speculative_config with ``--spec
NAME=JSON`` (``--no-ngram-rows`` for those only). ``--once`` gives every prompt once, so drafters that learn across
requests (suffix's global tree, ngram_mod, ngram_cache) never see the same prompt's earlier answer; ``--host-time``
also charges each step the wall time the engine spent outside the executor (drafting, scheduling), measured while
replaying.

The cost curve is measured at the start (one sequence at context ~100: the model body for n tokens, and the
logits for m rows): a step costs body(tokens in the step) + logits(rows that sample), interpolated. It leaves
out the engine's own host work (scheduling, drafting, detokenizing: ~0.5% of a step at batch 1, measured).

    python benchmarks/bench_replay.py --batch 1,8 --num-spec-tokens 5,15 --prompt-lookup-min 2,1

``--cost-curve FILE`` replays on a curve from a file instead (one measured on other hardware, by ``cost_curve.py``
on a GPU from CUDA graphs, or saved by the same option; or a synthetic one such as
``benchmarks/cost_flat_synthetic.json``: a step that costs the same up to 64 tokens, as a memory-bound small model's
step does on a GPU; made up, not measured), to see how the policy sizes drafts where verification is nearly free.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import platform
import sys
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_offline's prompts (scripts run standalone)
from bench_offline import (KV_BYTES, PROMPT_SETS, add_common_args, add_spec_args, chat_prompts,  # noqa: E402
                           check_common_args, int_list, spec_rows)

from specray.contract import StepPlan, StepResult  # noqa: E402

GRID = (1, 2, 4, 8, 16, 32, 64, 128)


# ---- the cost curve ------------------------------------------------------------------------------------------
@dataclass
class CostCurve:
    """Seconds of a forward pass: body(n tokens) + logits(m rows), piecewise linear between measured points."""

    body: dict[int, float]
    logits: dict[int, float]

    def __call__(self, num_tokens: int, num_rows: int) -> float:
        return _interp(self.body, num_tokens) + (_interp(self.logits, num_rows) if num_rows else 0.0)


def _interp(points: dict[int, float], x: int) -> float:
    xs = sorted(points)
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)  # extrapolate past either end with the end segment
    x0, x1 = xs[i - 1], xs[i]
    return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


@torch.inference_mode()
def measure_cost(model_path: str, repeats: int = 15) -> CostCurve:
    from bench_forward import timeit

    from specray.models.attention import build_attention_metadata
    from specray.models.kv_cache import allocate_kv_cache
    from specray.models.loader import load_model

    block, ctx = 16, 100
    model = load_model(model_path)
    allocate_kv_cache(model, -(-(ctx + max(GRID)) // block), block)
    table = [list(range(-(-(ctx + max(GRID)) // block)))]
    ids = torch.randint(0, model.config.vocab_size, (ctx + max(GRID),), generator=torch.Generator().manual_seed(0))
    model(ids[:ctx], build_attention_metadata([ctx], [0], table, block))
    body, logits = {}, {}
    for n in GRID:
        hidden = model(ids[ctx:ctx + n], build_attention_metadata([n], [ctx], table, block))  # [n, hidden]
        body[n] = timeit(lambda n=n: model(ids[ctx:ctx + n], build_attention_metadata([n], [ctx], table, block)),
                         n=repeats, warm=2) / 1e3
        logits[n] = timeit(lambda h=hidden: model.compute_logits(h).argmax(-1).tolist(), n=repeats, warm=2) / 1e3
    return CostCurve(body, logits)


def load_cost(path: Path) -> CostCurve:
    data = json.loads(path.read_text())
    return CostCurve({int(n): float(t) for n, t in data["body"].items()},
                     {int(m): float(t) for m, t in data["logits"].items()})


# ---- recording and replaying --------------------------------------------------------------------------------
def record(model_path: str, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The target's greedy answers (the plain engine's)."""
    from specray import LLM, SamplingParams

    llm = LLM(model=model_path, max_num_seqs=8, max_model_len=2048, kv_cache_memory_bytes=KV_BYTES)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def agreed(drafts: list[int], future: list[int]) -> int:
    """How many leading drafts the recorded ``future`` confirms; never its last token, which the target must
    produce itself (a recording ends there: nothing past it is known)."""
    n = 0
    while n < len(drafts) and n < len(future) - 1 and drafts[n] == future[n]:
        n += 1
    return n


class ReplayExecutor:
    """Answers each step from the recorded full sequences (prompt + answer) and advances a virtual clock."""

    def __init__(self, cost: CostCurve):
        self.cost = cost
        self.truth: dict[str, list[int]] = {}
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def shutdown(self) -> None:
        """Nothing to release (the engine shuts its executor down with it)."""

    def execute(self, plan: StepPlan, draft_probs: dict) -> StepResult:
        kept, paths, rows = [], [], 0
        for chunk in plan.chunks:
            tokens, path = self._kept(chunk) if chunk.sample else ([], [])
            kept.append(tokens)
            paths.append(path if chunk.draft_parents is not None else [])
            rows += (1 + chunk.num_draft_tokens) if chunk.sample else 0
        self.now += self.cost(plan.num_tokens, rows)
        trees = any(c.draft_parents is not None for c in plan.chunks)
        return StepResult(plan.step_id, [c.req_id for c in plan.chunks], kept,
                          accepted_draft_indices=paths if trees else None)

    def _kept(self, chunk) -> tuple[list[int], list[int]]:
        """The tokens the target keeps (the accepted path's drafts, then its own) and the path's node indices."""
        full = self.truth[chunk.req_id]
        nxt = chunk.start_pos + chunk.num_tokens - chunk.num_draft_tokens  # position of the first draft
        drafts = chunk.token_ids[chunk.num_tokens - chunk.num_draft_tokens:]
        path = accepted_path(drafts, chunk.draft_parents, full[nxt:])
        return [drafts[i] for i in path] + [full[nxt + len(path)]], path


def accepted_path(drafts: list[int], parents: list[int] | None, future: list[int]) -> list[int]:
    """Greedy verification against the recording: from the root, the first child holding the recorded next token,
    as long as there is one; a chain (``parents`` None) is the tree whose node i is node i-1's child."""
    if parents is None:
        return list(range(agreed(drafts, future)))
    path, node = [], -1
    while len(path) < len(future) - 1:
        child = next((i for i in range(node + 1, len(drafts)) if parents[i] == node and drafts[i] == future[len(path)]),
                     None)
        if child is None:
            break
        path.append(child)
        node = child
    return path


class OracleDrafter:
    """The drafter's proposals cut to what the target will accept (the recording tells): a tree becomes the chain
    of its accepted path, so no node is ever wasted."""

    cheap_proposals = True

    def __init__(self, inner, truth: dict[str, list[int]]):
        self.inner, self.truth = inner, truth

    def propose(self, batch):
        proposals = self.inner.propose(batch)
        for dreq, proposal in zip(batch, proposals):
            future = self.truth[dreq.req_id][len(dreq.token_ids):]
            path = accepted_path(proposal.token_ids, proposal.parents, future)
            proposal.token_ids = [proposal.token_ids[i] for i in path]
            proposal.parents = proposal.scores = None
        return proposals

    def finish(self, req_ids):
        self.inner.finish(req_ids)

    def shutdown(self):
        self.inner.shutdown()

    def __getattr__(self, name):  # the inner drafter's optional hooks (observe_verification, observe_finished)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def replay(model_path: str, spec: dict | None, batch: int, cost: CostCurve, prompt_ids, answers, max_tokens: int,
           oracle: bool = False, host_time: bool = False) -> dict:
    """Run the engine over the recording; its virtual seconds, tokens, steps and speculation stats. With
    ``host_time`` the clock also advances by the wall time of each step outside the executor (drafting, scheduling,
    detokenizing: the engine's own host work, measured as it runs here)."""
    from specray import LLM, SamplingParams

    if oracle:
        spec = {**spec, "adaptive": False}  # the oracle sizes its own proposals
    llm = LLM(model=model_path, speculative_config=spec, max_num_seqs=batch, max_model_len=2048,
              kv_cache_memory_bytes=KV_BYTES)  # kept alive: releasing it shuts its engine down
    engine = llm.engine
    executor = ReplayExecutor(cost)
    engine.executor, engine.clock = executor, executor.clock
    if oracle:
        engine.drafter = OracleDrafter(engine.drafter, executor.truth)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for prompt, answer in zip(prompt_ids, answers):
        executor.truth[engine.add_request(prompt, replace(params))] = prompt + answer
    tokens = steps = 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs = engine.step()
        if host_time:
            executor.now += time.perf_counter() - start
        for out in outs:
            if out.finished:
                assert list(out.outputs[0].token_ids) == executor.truth[out.request_id][len(out.prompt_token_ids):]
                tokens += len(out.outputs[0].token_ids)
        steps += 1
    return {"seconds": executor.now, "tokens": tokens, "steps": steps, "stats": engine.spec_stats}


def answers_key(kind: str, max_tokens: int) -> str:
    """Where ``--answers`` keeps a prompt set's answers: per --max-tokens too, so that a run never replays answers
    recorded at another length (an earlier file's answers, keyed by the set alone, are recorded again)."""
    return f"{kind}, max_tokens={max_tokens}"


def main():
    parser = argparse.ArgumentParser()
    add_common_args(parser)
    parser.add_argument("--kinds", default="input-grounded,open-ended")
    parser.add_argument("--batch", default="1,8", help="max_num_seqs, or a comma list; every prompt is given twice")
    parser.add_argument("--once", action="store_true", help="every prompt once (drafters that learn across requests "
                        "never see the same prompt's earlier answer)")
    add_spec_args(parser)
    parser.add_argument("--host-time", action="store_true", help="charge each step's host work too (drafting, "
                        "scheduling: the wall time of a step outside the executor, measured while replaying)")
    parser.add_argument("--answers", type=Path, help="a JSON file of recorded answers, by prompt set "
                        "and --max-tokens: those it holds are read, the others recorded and added (record once, "
                        "replay many times)")
    parser.add_argument("--cost-curve", type=Path, help="a JSON cost curve ({\"body\": {tokens: seconds}, "
                        "\"logits\": {rows: seconds}}): read if it exists (say, one measured on other hardware, or "
                        "a synthetic one), else measured here and written")
    args = parser.parse_args()
    check_common_args(parser, args)
    int_list(parser, "--batch", args.batch)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    from specray.default_model import default_model_path
    from specray.models.loader import load_tokenizer

    model = default_model_path()
    if args.cost_curve and args.cost_curve.exists():
        cost, source = load_cost(args.cost_curve), f"read from {args.cost_curve}"
    else:
        cost, source = measure_cost(model), "measured here"
        if args.cost_curve:
            args.cost_curve.write_text(json.dumps({"body": cost.body, "logits": cost.logits}, indent=1))
    copies = "every prompt once" if args.once else "every prompt twice"
    host = ", host work charged" if args.host_time else ""
    print(f"# {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, max_tokens={args.max_tokens}, stop at EOS, {copies}{host}\n"
          f"# cost curve ({source}; ms), body(n): " + ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in cost.body.items())
          + "; logits(m): " + ", ".join(f"{m}: {t * 1e3:.1f}" for m, t in cost.logits.items()) + "\n")
    specs = spec_rows(args)
    recorded = json.loads(args.answers.read_text()) if args.answers and args.answers.exists() else {}
    new_answers = False
    print("| prompts | batch | system | replayed tokens/s | steps | mean accepted length | ratio to plain |\n"
          "|---|---|---|---|---|---|---|")
    tokenizer = load_tokenizer(model)
    for kind in args.kinds.split(","):
        prompt_ids = [tokenizer.encode(t) for t in chat_prompts(tokenizer, PROMPT_SETS[kind])]
        key = answers_key(kind, args.max_tokens)
        if key not in recorded:
            recorded[key] = record(model, prompt_ids, args.max_tokens)
            new_answers = True
        copies = 1 if args.once else 2
        prompt_ids, answers = prompt_ids * copies, recorded[key] * copies
        run = partial(replay, model, prompt_ids=prompt_ids, answers=answers, max_tokens=args.max_tokens,
                      cost=cost, host_time=args.host_time)
        for batch in (int(b) for b in args.batch.split(",")):
            plain = run(None, batch)
            rows = [("specray (no speculation)", plain)]
            for name, spec in specs.items():
                rows.append((name, run(spec, batch)))
                rows.append((f"{name}, fixed", run({**spec, "adaptive": False}, batch)))
                rows.append((f"{name}, oracle", run(spec, batch, oracle=True)))
            for name, r in rows:
                mal = r["stats"].mean_accepted_length if r["stats"].drafts else float("nan")
                print(f"| {kind} | {batch} | {name} | {r['tokens'] / r['seconds']:.1f} | {r['steps']} | {mal:.2f} | "
                      f"{plain['seconds'] / r['seconds']:.3f} |", flush=True)
    if args.answers and new_answers:
        args.answers.write_text(json.dumps(recorded))


if __name__ == "__main__":
    main()
