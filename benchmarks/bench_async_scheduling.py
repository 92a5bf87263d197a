"""``async_scheduling`` with a real model: each step's outputs built while the executor computes the next step.

The engine loop of a Serve engine replica without Ray: ``batch`` requests streamed as deltas
(``output_kind="delta"``, what the engine replicas report: every request detokenized and reported each step),
``max_tokens`` each with EOS ignored, through ``LLMEngine.step`` with the local executor, whose step runs in a
thread of its own under async scheduling (torch leaves the GIL while it computes, so the report runs beside it).
It reports output tokens/s and wall ms per step with async scheduling off and on, alternated round by round, and
checks that both gave the same tokens. The model is a 2-layer random llama with SmolLM2's vocabulary and tokenizer
(``--model`` for another): a step of a few milliseconds, as a small model's is on a GPU, so the host's share is
what it would be there. On a CPU the model's threads and the host's report share the cores: ``--threads`` (torch
threads of the worker, default 1) leaves the rest to the host.

    PYTHONSAFEPATH=1 python benchmarks/bench_async_scheduling.py --batch 32,64 --max-tokens 256 --rounds 3
    PYTHONSAFEPATH=1 python benchmarks/bench_async_scheduling.py --device cuda --model PATH   # on a GPU
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

from specray.config import EngineArgs
from specray.engine.builder import build_engine
from specray.sampling_params import SamplingParams

PROMPT = "Rewrite the following text in the past tense, keeping every detail: "


def tiny_model(folder: Path) -> str:
    """A 2-layer random llama with SmolLM2's vocabulary and tokenizer (its text and detokenizing are real)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specray.default_model import default_model_path
    from specray.models.loader import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def run(model: str, batch: int, on: bool, args) -> tuple[float, float, list[list[int]]]:
    """(output tokens/s, median wall ms per step, each request's tokens) for one engine, after a warm-up batch."""
    spec = None if args.spec == "none" else {"method": args.spec, "num_speculative_tokens": 4}
    engine = build_engine(EngineArgs(model=model, max_num_seqs=batch, max_model_len=args.max_tokens + 512,
                                     num_threads=args.threads, device=args.device, speculative_config=spec,
                                     async_scheduling=on))
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, output_kind="delta")
    try:
        for warm in (True, False):
            prompts = [tok.encode(f"{PROMPT}{i} little pigs went to market on day {i}.") for i in range(batch)]
            ids = [engine.add_request(p, params) for p in prompts]
            tokens: dict[str, list[int]] = {rid: [] for rid in ids}
            steps, start = [], time.perf_counter()
            while engine.has_unfinished_requests():
                t = time.perf_counter()
                for out in engine.step():
                    tokens[out.request_id] += out.outputs[0].token_ids
                steps.append(time.perf_counter() - t)
            elapsed = time.perf_counter() - start
        total = sum(len(t) for t in tokens.values())
        return total / elapsed, statistics.median(steps) * 1e3, [tokens[rid] for rid in ids]
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the tiny random llama)")
    parser.add_argument("--batch", default="32,64", help="comma list of batch sizes (all requests at once)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="off and on alternated, this many times each")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the worker (CPU)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--spec", default="none", help="a drafter name (K=4), or none")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_model(Path(tmp) / "tiny")
        print(f"# {platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}; model "
              f"{args.model or 'tiny random llama (SmolLM2 vocabulary)'}; {args.max_tokens} tokens per request, delta "
              f"outputs; drafter {args.spec}; {args.threads} worker thread(s)\n")
        print("| batch | async scheduling | tokens/s by round | median tokens/s | median ms per step |")
        print("|---|---|---|---|---|")
        for batch in (int(b) for b in args.batch.split(",")):
            rates: dict[bool, list[float]] = {False: [], True: []}
            steps: dict[bool, list[float]] = {False: [], True: []}
            outputs = {}
            for _ in range(args.rounds):
                for on in (False, True):
                    rate, step_ms, tokens = run(model, batch, on, args)
                    rates[on].append(rate)
                    steps[on].append(step_ms)
                    outputs.setdefault(on, tokens)
            assert outputs[False] == outputs[True], "async scheduling changed the tokens"
            for on in (False, True):
                print(f"| {batch} | {'on' if on else 'off'} | {', '.join(f'{r:.0f}' for r in rates[on])} | "
                      f"{statistics.median(rates[on]):.0f} | {statistics.median(steps[on]):.2f} |", flush=True)


if __name__ == "__main__":
    main()
