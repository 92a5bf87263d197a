"""A 4-bit release kept in 4 bits against the same weights dense, offline, greedy, on the default model (or
``--model``).

The model's projection weights are quantized here as an AWQ release (4 bits, groups of ``--group`` columns,
asymmetric, fp16 scales: the test suite's writer, ``tests/checkpoints.py``), beside its dequantized twin (the same
values, dense). Both load in ``--dtype``; the AWQ one keeps its linears in 4 bits (torch's weight-only kernel), the
twin runs dense ones. Reported: the bytes the linears hold each way, and the time to generate ``--max-tokens``
tokens (EOS ignored) for batches of ``--batches`` prompts, plain and with n-gram drafts, ``--rounds`` times,
alternated, in this process; and whether the two give the same tokens. One JSON line per run, then a summary with
the machine, torch version and commit. On CPU the figures are ratios for this machine, not a GPU's.

    PYTHONSAFEPATH=1 python benchmarks/bench_int4.py --rounds 2
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
from specray.models import cpu_kernels
from specray.models.layers import LinearBase
from specray.models.loader import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from checkpoints import INT_SCHEMES, write_int  # noqa: E402  (the suite's writer of integer releases)

PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is.", "Give three tips for sleeping well.",
           "What is the capital of France, and why is it famous?", "Describe a cat to someone who never saw one.",
           "List the planets of the solar system.", "How do I boil an egg?", "What does a compiler do?"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def linear_bytes(llm) -> int:
    """Bytes the model's linears hold (dense weights, or 4-bit ones with their scales)."""
    model = llm.engine.executor.worker.runner.model
    total = 0
    for module in model.modules():
        if isinstance(module, LinearBase) and not hasattr(module, "num_embeddings"):  # not the LM head
            tensors = list(module.kept.buffers()) if module.kept is not None else [module.weight]
            total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
            if module.packed is not None:  # a CPU fp32 weight in oneDNN's layout instead of its dense one
                total += module.packed.numel() * 4
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--group", type=int, default=32, choices=(32, 64, 128))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    cpu_kernels.INT4_WEIGHTS = True  # keep the 4 bits on CPU too (a CPU dequantizes them at load by default)
    folder = Path(resolve_model(args.model or default_model_path()).path)
    scheme = f"awq4-g{args.group}"
    INT_SCHEMES.setdefault(scheme, ("awq", 4, args.group, False, None))
    with tempfile.TemporaryDirectory() as tmp:
        quant, dense = write_int(folder, Path(tmp), scheme)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            for target in (quant, dense):
                if (folder / name).exists() and not (target / name).exists():
                    (target / name).write_bytes((folder / name).read_bytes())
        engines = {kind: LLM(model=str(path), dtype=args.dtype, max_model_len=512, max_num_seqs=8)
                   for kind, path in (("4-bit", quant), ("dense", dense))}
        spec = {kind: LLM(model=str(path), dtype=args.dtype, max_model_len=512, max_num_seqs=8,
                          speculative_config=NGRAM) for kind, path in (("4-bit", quant), ("dense", dense))}
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        times: dict[tuple, list[float]] = {}
        outputs: dict[tuple, list] = {}
        for _ in range(args.rounds):
            for batch in (int(b) for b in args.batches.split(",")):
                for drafts, llms in (("plain", engines), ("ngram", spec)):
                    for kind, llm in llms.items():
                        prompts = (PROMPTS * 8)[:batch]
                        start = time.perf_counter()
                        out = llm.generate(prompts, params, use_tqdm=False)
                        seconds = time.perf_counter() - start
                        key = (kind, drafts, batch)
                        times.setdefault(key, []).append(seconds)
                        outputs[key] = [o.outputs[0].token_ids for o in out]
                        print(json.dumps({"weights": kind, "drafts": drafts, "batch": batch, "seconds": seconds}))
        summary = {
            "linear_bytes": {kind: linear_bytes(llm) for kind, llm in engines.items()},
            "median_seconds": {f"{k} {d} x{b}": round(statistics.median(v), 3) for (k, d, b), v in times.items()},
            "same_tokens": {f"{d} x{b}": outputs[("4-bit", d, b)] == outputs[("dense", d, b)]
                            for (k, d, b) in times if k == "dense"},
            "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
            "torch": torch.__version__, "dtype": args.dtype, "group": args.group, "max_tokens": args.max_tokens,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip(),
        }
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
