"""MiniCPM3 from a GGUF file as llama.cpp's converter writes it (its ``MiniCPM3Model``, architecture ``minicpm3``:
MiniCPM3-4B), turned back into the HF checkpoint specray loads (``MiniCPM3ForCausalLM``). transformers' GGUF mapping
has no ``minicpm3``, so the config and every tensor are read here.

What the converter writes, read back here: the sizes, heads and norms' epsilon; the latent attention's widths (the
query's and the latent's ranks, ``attention.q_lora_rank`` and ``attention.kv_lora_rank``; each head's key,
``attention.key_length``: nope + rope; the rotated share, ``rope.dimension_count``); LongRoPE's factors as the tensors
``rope_factors_short`` and ``rope_factors_long``. Every tensor keeps the release's layout (the converter permutes
none: ``kv_b_proj`` stays whole), under the name gguf-py's tensor map gives the HF name.

What no GGUF key carries, llama.cpp fixes for every MiniCPM3 and so does this reader (the releases' values): the
embedding scale (``scale_emb`` 12), the residual branches' (``scale_depth`` 1.4, over sqrt(layers)) and the logits'
(``dim_model_base`` 256 over the hidden size); each value head as wide as hidden / heads (llama.cpp's default without
``attention.value_length``); RoPE's base where the file has none, 10000; LongRoPE's pretrained length, the file's
context length (so its long factors apply past it). Tensors of any llama.cpp type are dequantized to float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import (GGUFMeta, GGUFTensors, as_written, by_layer, check_tensor_names, gguf_names,
                                      hf_tensor_names, read_model_gguf, rope_parameters)

MINICPM3_GGUF_ARCHS = ("minicpm3",)
# what llama.cpp's graph fixes for every MiniCPM3 (no GGUF key carries them), as MiniCPM3-4B sets them
SCALES = {"scale_emb": 12, "scale_depth": 1.4, "dim_model_base": 256}


def minicpm3_gguf_config(get: GGUFMeta, tensors: GGUFTensors):
    """MiniCPM3's HF config from its metadata as llama.cpp's converter writes it (the module's docstring lists it);
    the LongRoPE factors are taken from ``tensors``."""
    from transformers import MiniCPM3Config

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    rotated = int(get("rope.dimension_count"))
    context = int(get("context_length"))
    short, long = tensors.pop("rope_factors_short.weight", None), tensors.pop("rope_factors_long.weight", None)
    rope = rope_parameters(get, None, rotated)
    if (short is None) != (long is None) or short is not None and not short.shape == long.shape == (rotated // 2,):
        raise ValueError(f"GGUF {str(get.gguf)!r} has LongRoPE factors other than a short and a long list of "
                         f"{rotated // 2} (rope_factors_short / rope_factors_long) for {rotated} rotated dims; convert "
                         "the model again with a current llama.cpp, or pass its HF checkpoint")
    if short is not None:
        if rope["rope_type"] != "default":
            raise ValueError(f"GGUF {str(get.gguf)!r} has LongRoPE factors besides minicpm3.rope.scaling.type="
                             f"{rope['rope_type']!r}; pass the model's HF checkpoint instead")
        rope.update(rope_type="longrope", short_factor=[as_written(v) for v in short.tolist()],
                    long_factor=[as_written(v) for v in long.tolist()], original_max_position_embeddings=context)
    key = int(get("attention.key_length"))
    q_rank = get("attention.q_lora_rank", None)
    return MiniCPM3Config(
        architectures=["MiniCPM3ForCausalLM"], vocab_size=tensors.shape("token_embd.weight")[0], hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")), num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads, num_key_value_heads=int(get("attention.head_count_kv")),
        max_position_embeddings=context, rms_norm_eps=as_written(get("attention.layer_norm_rms_epsilon")),
        q_lora_rank=None if q_rank is None else int(q_rank), kv_lora_rank=int(get("attention.kv_lora_rank")),
        qk_nope_head_dim=key - rotated, qk_rope_head_dim=rotated, head_dim=rotated,
        v_head_dim=int(get("attention.value_length", hidden // heads)), rope_parameters=rope, **SCALES,
        tie_word_embeddings="output.weight" not in tensors, **get.token_ids())


def minicpm3_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """MiniCPM3's HF config and tensors from its GGUF, a group (the model's own, then a layer) at a time, read as
    the groups are taken."""
    import gguf as gguf_py
    from transformers import MiniCPM3ForCausalLM

    get, tensors = read_model_gguf(gguf, arch)
    config = minicpm3_gguf_config(get, tensors)
    names = gguf_names(gguf_py.MODEL_ARCH.MINICPM3, config.num_hidden_layers,
                       hf_tensor_names(MiniCPM3ForCausalLM, config))
    check_tensor_names(gguf, "MiniCPM3ForCausalLM", names, tensors)
    return config, ({names[name]: tensors.pop(name) for name in group} for group in by_layer(tensors))
