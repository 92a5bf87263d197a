"""Cost of one forward pass (SmolLM2-135M, fp32, CPU threads): specray's paged model against transformers with
its KV cache, for 1 token and for 1+5 draft tokens per sequence, at batch 1 and 8, context 100.

    python benchmarks/bench_forward.py --threads 2
"""

import argparse
import inspect
import statistics
import time

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, DynamicCache, LlamaForCausalLM
from transformers.initialization import no_init_weights

from specray.default_model import default_model_path
from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache
from specray.models.loader import load_model, resolve_model

BS, CTX = 16, 100


def timeit(fn, n=30, warm=5):
    for _ in range(warm):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    torch.set_num_threads(parser.parse_args().threads)
    gguf = default_model_path()
    src = resolve_model(gguf)
    ours = load_model(gguf)
    config = AutoConfig.from_pretrained(src.path)
    with no_init_weights():
        hf = LlamaForCausalLM(config).float().eval()
    hf.load_state_dict(load_file(src.path / "model.safetensors"), strict=False)
    hf.tie_weights()
    allocate_kv_cache(ours, 8 * 8 + 8, BS)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(8)]
    prompts = torch.randint(0, config.vocab_size, (8, CTX + 6), generator=torch.Generator().manual_seed(0))
    ours(prompts[:, :CTX].reshape(-1), build_attention_metadata([CTX] * 8, [0] * 8, tables, BS))
    print("| batch | tokens/seq | specray ms | transformers ms |\n|---|---|---|---|")
    for b in (1, 8):
        for q in (1, 6):
            ids = prompts[:b, CTX:CTX + q].reshape(-1)

            def step():
                meta = build_attention_metadata([q] * b, [CTX] * b, tables[:b], BS)
                return ours.compute_logits(ours(ids, meta))

            cache = DynamicCache(config=config)
            kw = {"cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values": cache}
            hf(prompts[:b, :CTX], use_cache=True, **kw)
            pos = torch.arange(CTX, CTX + q)[None].expand(b, q)

            def hf_step():
                out = hf(prompts[:b, CTX:CTX + q], position_ids=pos, use_cache=True, **kw,
                         logits_to_keep=q)
                cache.crop(-q)
                return out.logits

            print(f"| {b} | {q} | {timeit(step):.1f} | {timeit(hf_step):.1f} |", flush=True)


if __name__ == "__main__":
    main()
