"""Write a model folder of a real model's shapes with no weights, for ``load_format="dummy"`` (vLLM's): its config.json
(built here from transformers' config classes, no download) and the default model's tokenizer (its 49,152 ids are
all inside these vocabularies; ids past them decode to nothing). A GPU session measures a real size's step times
with it without the checkpoint:

    python benchmarks/dummy_model.py --shape llama3-8b --out /tmp/llama3-8b
    python benchmarks/bench_gpu_step.py --model /tmp/llama3-8b --load-format dummy --device cuda --batches 1,8,64

``--quantization awq`` writes the config of an AutoAWQ release of the shape (4 bits in groups of 128, as the
released AWQ Llama 3.1 8B): its dummy linears hold random integers kept in 4 bits on a GPU (bf16), so the same
command times torch's 4-bit kernel against the dense model; ``--quantization fp8-dynamic`` an llm-compressor FP8
release's (a scale per channel): on a GPU of compute capability 8.9 or more (bf16) its dummy linears hold random FP8
values kept in FP8, timing the scaled matmul (W8A8, :mod:`specray.models.w8a8`); ``--quantization int8-w8a8`` an
INT8 W8A8 release's (compute capability 7.5 or more), timing the integer matmul; ``--quantization fp8-block`` a
block-scaled FP8 release's (DeepSeek-V3's and Qwen3's layout, blocks of 128 x 128: compute capability 9.0 or more),
timing torch's block-wise scaled matmul (:mod:`specray.models.fp8_blocks`); ``--shape gpt-oss-120b --quantization
mxfp4`` GPT-OSS's release, its experts kept in MXFP4 on a GPU (decoded expert by expert); ``--shape
deepseek-v4-flash-4l --quantization v4-release`` DeepSeek-V4's (block FP8 linears, FP4 experts kept so).

The weights are random (``specray.models.loader.DUMMY_WEIGHT_RANGE``): outputs mean nothing and speculation accepts
nothing it would with the real weights, so only plain decoding's step times (and drafting's costs) are real.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

SHAPES = {
    # Llama 3.1 8B: 32 layers of width 4096, grouped-query attention 32/8, MLP 14336
    "llama3-8b": ("llama", dict(
        architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    # Qwen3 8B (dense): 36 layers of width 4096, 32/8 heads of 128, q/k norms, MLP 12288
    "qwen3-8b": ("qwen3", dict(
        architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=8192, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # Qwen3-30B-A3B: 48 MoE layers of width 2048, 128 experts of width 768, 8 per token (61 GB in bf16: an H200)
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, max_position_embeddings=8192,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # DeepSeek-V2-Lite: 27 layers of width 2048 (the first dense), multi-head latent attention (16 heads, latent 512,
    # no query latent), 64 routed experts of width 1408, 6 per token, 2 shared (31 GB in bf16)
    "deepseek-v2-lite": ("deepseek_v2", dict(
        architectures=["DeepseekV2ForCausalLM"], hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6,
        n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
        routed_scaling_factor=1.0, vocab_size=102400, max_position_embeddings=8192, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
    # DeepSeek-V4-Flash's widths over 4 of its 43 layers (heavily compressed, heavily compressed, compressed sparse,
    # heavily compressed; the first 3 hash-routed): width 4096, 64 query heads over one key/value head of 512, query
    # latent 1024, 8 output groups of 1024, 256 experts of width 2048, 6 per token, 1 shared (about 54 GB in bf16)
    "deepseek-v4-flash-4l": ("deepseek_v4", dict(
        architectures=["DeepseekV4ForCausalLM"], hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=4,
        num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024, n_routed_experts=256,
        num_experts_per_tok=6, n_shared_experts=1, o_groups=8, o_lora_rank=1024, index_n_heads=64,
        index_head_dim=128, index_topk=512, sliding_window=128, hc_mult=4, vocab_size=129280,
        max_position_embeddings=65536, tie_word_embeddings=False,
        layer_types=["heavily_compressed_attention", "heavily_compressed_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"])),
    # gpt-oss-120b: 36 layers of width 2880 (sliding windows of 128 alternating with full attention), 64/8 heads of
    # 64 with sinks, 128 experts of width 2880, 4 per token (about 230 GB in bf16; with --quantization mxfp4 its
    # experts kept in MXFP4 on a GPU, about 65 GB in all)
    "gpt-oss-120b": ("gpt_oss", dict(
        architectures=["GptOssForCausalLM"], hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4,
        sliding_window=128, vocab_size=201088, max_position_embeddings=131072, swiglu_limit=7.0,
        layer_types=["sliding_attention", "full_attention"] * 18, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})),
}


QUANTIZATIONS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    # GPT-OSS's releases: the experts in MXFP4 (FP4 values, a power-of-two scale per 32), the rest in bf16
    "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    # llm-compressor's FP8-dynamic (RedHatAI's -FP8-dynamic releases): weights per channel, activations per token
    "fp8-dynamic": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
        "ignore": ["lm_head"]},
    # DeepSeek-V3's and Qwen3's -FP8 releases: weights in blocks of 128 x 128, activations per group of 128 columns
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "weight_block_size": [128, 128]},
    # DeepSeek-V4's release: its linears FP8 in blocks of 128 x 128 with E8M0 scales, its routed experts FP4 (MXFP4's
    # values, kept so on a GPU)
    "v4-release": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "ue8m0",
                   "weight_block_size": [128, 128], "expert_dtype": "fp4"},
    # llm-compressor's INT8 W8A8 (RedHatAI's -quantized.w8a8 releases): weights per channel, activations per token
    "int8-w8a8": {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True,
                                  "dynamic": True}}},
        "ignore": ["lm_head"]},
}


def write(shape: str, out: Path, quantization: str | None = None) -> Path:
    from transformers import AutoConfig

    from specray.default_model import default_model_path
    from specray.models.loader import resolve_model

    model_type, fields = SHAPES[shape]
    out.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model(model_type, **fields).save_pretrained(out)
    if quantization is not None:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = QUANTIZATIONS[quantization]
        (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer_folder = resolve_model(default_model_path(), weights=False).path
    for file in tokenizer_folder.iterdir():
        if file.is_file() and (file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges"))):
            shutil.copy(file, out / file.name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quantization", choices=sorted(QUANTIZATIONS), default=None,
                    help="write a quantized release's config (its dummy weights random in that form)")
    args = ap.parse_args()
    print(write(args.shape, args.out, args.quantization))


if __name__ == "__main__":
    main()
