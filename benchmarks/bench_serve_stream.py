"""Streaming throughput through the Serve app (ingress + engine replica) with long outputs, and what one step's
outputs weigh on the hop between the engine replica and the ingress.

The engine replica reports each request's output every step and the ingress turns it into SSE chunks. How much
travels per step decides what the hop costs once outputs are long: whole outputs (``output_kind="cumulative"``)
grow with every token, deltas (``"delta"``, what the engine replica sends) stay the size of a step. This runs a
tiny random llama (SmolLM2's vocabulary and tokenizer, so the text and the sizes are real) behind the real app,
``concurrency`` streaming clients that ask for ``max_tokens`` tokens each (``ignore_eos``), and reports output
tokens/s and time per output token. It also pickles one step's batch of outputs both ways, for requests
``max_tokens / 2`` tokens in, to show the bytes per step:

    PYTHONSAFEPATH=1 python benchmarks/bench_serve_stream.py --max-tokens 512 --concurrency 32

Compare commits by running it on each, alternately, on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from specray.cluster.ray_env import apply_ray_env  # imports no ray

apply_ray_env()  # before anything imports ray

from specray.outputs import CompletionOutput, RequestOutput  # noqa: E402


def tiny_model(folder: Path) -> str:
    """A 2-layer random llama with SmolLM2's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specray.default_model import default_model_path
    from specray.models.loader import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def step_bytes(batch: int, prompt_len: int, output_len: int, tokens_per_step: int = 2) -> dict[str, int]:
    """Pickled bytes of one step's outputs for ``batch`` requests ``output_len`` tokens in: whole, and deltas."""
    def output(n_tokens: int, with_prompt: bool) -> RequestOutput:
        tokens = [1000 + i % 40000 for i in range(n_tokens)]
        completion = CompletionOutput(0, " word" * n_tokens, tokens)
        return RequestOutput("req-0123456789abcdef", "prompt " * prompt_len if with_prompt else None,
                             list(range(prompt_len)) if with_prompt else [], [completion], False)

    whole = {f"r{i}": output(output_len, True) for i in range(batch)}
    deltas = {f"r{i}": output(tokens_per_step, False) for i in range(batch)}
    return {"cumulative": len(pickle.dumps(whole)), "delta": len(pickle.dumps(deltas))}


def run(model: str, args) -> dict:
    from ray import serve

    from specray.cluster.bench_serve import benchmark
    from specray.cluster.serve import run_server

    run_server({"model": model, "max_model_len": args.prompt_len + args.max_tokens + 64,
                "max_num_seqs": args.concurrency, "spec_method": args.spec_method, "num_spec_tokens": 3,
                "max_queue_len": 1000}, port=args.port, blocking=False)
    prompts = [" ".join(f"item {i} of list {j}" for i in range(args.prompt_len // 6)) for j in range(8)]
    common = dict(base_url=f"http://127.0.0.1:{args.port}", model=None, prompts=prompts, max_tokens=args.max_tokens,
                  stream=True, extra_body={"ignore_eos": True}, concurrency=args.concurrency)
    benchmark(num_requests=args.concurrency, **common)  # warm up
    summary = benchmark(num_requests=None, duration_s=args.duration, **common)
    serve.shutdown()
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=128, help="about this many tokens per prompt")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds measured, after a warm-up round")
    parser.add_argument("--spec-method", default="ngram")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--port", type=int, default=8000, help="the server's port on 127.0.0.1")
    args = parser.parse_args()
    for flag in ("max_tokens", "prompt_len", "concurrency", "duration", "repeats", "port"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    import ray

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    print(f"# {platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}, commit {commit} (+ working tree); "
          f"{args.concurrency} streaming clients x {args.max_tokens} tokens, {args.duration:g} s, "
          f"spec {args.spec_method}")
    sizes = step_bytes(args.concurrency, args.prompt_len, args.max_tokens // 2)
    print(f"one step's outputs for {args.concurrency} requests {args.max_tokens // 2} tokens in, pickled: "
          f"cumulative {sizes['cumulative']:,} B, delta {sizes['delta']:,} B")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp) / "tiny")
        rates, tpots = [], []
        for _ in range(args.repeats):
            s = run(model, args)
            rates.append(s["output_throughput"])
            tpots.append(s["tpot_ms"].get("p50", float("nan")))
            print(json.dumps({"output_tok_s": round(s["output_throughput"], 1), "tpot_ms": s["tpot_ms"],
                              "completed": s["completed"], "failed": s["failed"]}), flush=True)
        print(f"median output tokens/s {statistics.median(rates):.1f}, median TPOT {statistics.median(tpots):.2f} ms")
    ray.shutdown()


if __name__ == "__main__":
    main()
