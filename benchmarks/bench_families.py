"""Our forward pass against transformers', per model family, at a small random size on this CPU (fp32, same
weights): a 128-token prefill and one decode step after it (batch 1). For the mixture-of-experts families, also
our decode step against a dense model of the same family whose MLP is as wide as the experts a token activates
(top-k x expert width; shared experts kept), which is what the routing costs.

    python benchmarks/bench_families.py --threads 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from specray.models import get_model_class
from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache
from specray.parallel import TPGroup

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_forward's timer (scripts run standalone)
from bench_forward import timeit  # noqa: E402

SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
             max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
PROMPT = 128


def families() -> dict[str, tuple]:
    """name -> (config class, transformers model class, overrides, dense overrides or None)."""
    from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                              Llama4ForCausalLM, Llama4TextConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    moe = dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=1)
    deepseek = dict(first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2,
                    n_shared_experts=1, moe_intermediate_size=128, kv_lora_rank=64, q_lora_rank=96,
                    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, intermediate_size=512,
                    num_key_value_heads=8)
    llama4 = dict(head_dim=32, no_rope_layers=[1, 1, 1, 0], attention_chunk_size=64, interleave_moe_layer_step=1,
                  num_local_experts=16, num_experts_per_tok=1, intermediate_size=256, intermediate_size_mlp=512)
    return {
        "llama": (LlamaConfig, LlamaForCausalLM, dict(intermediate_size=512), None),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(intermediate_size=512, head_dim=32), None),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(intermediate_size=512, head_dim=32,
                                                              query_pre_attn_scalar=32, sliding_window=64), None),
        "qwen3-moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(head_dim=32, **moe),
                      dict(head_dim=32, **{**moe, "mlp_only_layers": [0, 1, 2, 3], "intermediate_size": 256})),
        "deepseek-v3": (DeepseekV3Config, DeepseekV3ForCausalLM, deepseek,
                        dict(deepseek, first_k_dense_replace=4, intermediate_size=384)),
        "llama4": (Llama4TextConfig, Llama4ForCausalLM, llama4, dict(llama4, moe_layers=[])),
    }


def build(cfg_cls, hf_cls, overrides: dict):
    config = cfg_cls(**{**SMALL, **overrides})
    torch.manual_seed(0)
    hf = hf_cls(config).float().eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("mlp.gate.weight", "feed_forward.router.weight")):
                param.normal_(0.0, 0.5)
    ours = get_model_class(config)(config, TPGroup.single())
    ours.load_weights(hf.state_dict().items())
    ours.eval()
    return config, hf, ours


@torch.inference_mode()
def ours_times(ours) -> tuple[float, float]:
    allocate_kv_cache(ours, 64, 16)
    table = list(range(64))
    ids = torch.randint(0, SMALL["vocab_size"], (PROMPT + 1,), generator=torch.Generator().manual_seed(1))

    def prefill():
        ours.compute_logits(ours(ids[:PROMPT], build_attention_metadata([PROMPT], [0], [table], 16))[-1:])

    def decode():
        ours.compute_logits(ours(ids[PROMPT:], build_attention_metadata([1], [PROMPT], [table], 16)))

    prefill_ms = timeit(prefill)
    return prefill_ms, timeit(decode)


@torch.inference_mode()
def hf_times(hf) -> tuple[float, float]:
    from transformers import DynamicCache

    ids = torch.randint(0, SMALL["vocab_size"], (1, PROMPT + 1), generator=torch.Generator().manual_seed(1))
    prefill_ms = timeit(lambda: hf(ids[:, :PROMPT], logits_to_keep=1))
    cache = DynamicCache(config=hf.config)
    hf(ids[:, :PROMPT], cache=cache)

    def decode():  # the context grows by one token a call (23 calls: negligible beside 128)
        hf(ids[:, PROMPT:], cache=cache, logits_to_keep=1)

    return prefill_ms, timeit(decode)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default=None, help="comma-separated family names")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    chosen = families()
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    print(f"# hidden 256, 4 layers, {PROMPT}-token prompt, batch 1, fp32, {args.threads} threads, torch "
          f"{torch.__version__}\n")
    print("| family | prefill: ours / transformers (ms) | decode step: ours / transformers (ms) | decode, ours: "
          "MoE / dense of the active width (ms) |\n|---|---|---|---|")
    for name, (cfg_cls, hf_cls, overrides, dense) in chosen.items():
        _, hf, ours = build(cfg_cls, hf_cls, overrides)
        (op, od), (hp, hd) = ours_times(ours), hf_times(hf)
        moe = "-"
        if dense is not None:
            _, _, dense_ours = build(cfg_cls, hf_cls, dense)
            moe = f"{od:.2f} / {ours_times(dense_ours)[1]:.2f}"
        print(f"| {name} | {op:.2f} / {hp:.2f} | {od:.2f} / {hd:.2f} | {moe} |", flush=True)


if __name__ == "__main__":
    main()
