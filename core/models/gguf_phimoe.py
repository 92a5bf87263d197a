"""GGUF files of Microsoft's Phi-3.5-MoE (``general.architecture`` ``phimoe``), as llama.cpp's converter (its
``PhiMoeModel`` over ``Phi3MiniModel``) writes them, turned back into the HF checkpoint :mod:`specray.models.phimoe`
loads. transformers' GGUF mapping has no Phi-3.5-MoE, so the config and every tensor are read here.

What the converter writes, read back here:

* Phi-3's sizes: ``embedding_length``, ``feed_forward_length`` (each expert's width), heads and KV heads, the
  LayerNorms' epsilon as ``attention.layer_norm_rms_epsilon`` (the release names it ``rms_norm_eps``), the rotated
  dims (``rope.dimension_count``: the whole head; a share of it is refused), the RoPE base, ``context_length``;
* the window as ``attention.sliding_window`` (0 where the release has none);
* LongRoPE, where the release has it, as two tensors of per-frequency factors (``rope_factors_short`` /
  ``rope_factors_long``), the pretrained length (``rope.scaling.original_context_length``) and one cos/sin scale
  (``rope.scaling.attn_factor``), read back as the release's ``short_factor`` / ``long_factor`` with that scale as both
  ``short_mscale`` and ``long_mscale`` (the converter keeps one scale, computed ``sqrt(1 + ln s / ln L0)``; the
  release's own mscales, where they differ, are not in the file);
* the experts stacked per projection (``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``: Mixtral's ``w1`` /
  ``w3`` / ``w2``), the router as ``ffn_gate_inp``; the LayerNorms' and projections' biases, and the LM head's bias
  (``output.bias``: ``lm_head_bias``), by their tensors' presence; no ``output``: the head tied to the embedding.

The sparsemixer's threshold (``router_jitter_noise``) is not in the file (llama.cpp routes a ``phimoe`` by a plain
softmax top-k): the release's (transformers' default, 0.01) is taken. Tensors of any llama.cpp type are dequantized
to float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import (GGUFMeta, GGUFTensors, as_written, check_tensor_names, converted_groups,
                                      gguf_names, per_expert, read_model_gguf)

PHIMOE_GGUF_ARCHS = ("phimoe",)
# the experts' projections as llama.cpp stacks them (the converter's merged names) -> Mixtral's per-expert names
_EXPERTS = ("w1", "w3", "w2")


def _refuse(get: GGUFMeta, what: str) -> ValueError:
    return ValueError(f"GGUF {str(get.gguf)!r} {what}; pass the model's HF checkpoint instead")


def _rope(get: GGUFMeta, tensors: GGUFTensors, head_dim: int) -> dict[str, Any]:
    """The RoPE: its base, and LongRoPE where the file has its factors (both, or neither)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    scaling = get("rope.scaling.type", "none")
    if scaling != "none":
        raise _refuse(get, f"has phimoe.rope.scaling.type={scaling!r}; a Phi-3.5-MoE GGUF carries LongRoPE as "
                           "rope_factors_short / rope_factors_long, or no scaling")
    present = [n for n in ("rope_factors_short.weight", "rope_factors_long.weight") if n in tensors]
    if not present:
        return rope
    if len(present) != 2:
        raise _refuse(get, f"has {present[0]} without the other LongRoPE factors (rope_factors_short and "
                           "rope_factors_long come together)")
    short, long = (tensors.pop(n) for n in ("rope_factors_short.weight", "rope_factors_long.weight"))
    if short.shape != (head_dim // 2,) or long.shape != (head_dim // 2,):
        raise _refuse(get, f"has LongRoPE factors of {short.numel()} / {long.numel()} frequencies for heads of "
                           f"{head_dim} dims (one factor per frequency: {head_dim // 2})")
    scale = as_written(float(get("rope.scaling.attn_factor", 1.0)))
    rope.update(rope_type="longrope", short_factor=[as_written(v) for v in short.tolist()],
                long_factor=[as_written(v) for v in long.tolist()], short_mscale=scale, long_mscale=scale,
                original_max_position_embeddings=int(get("rope.scaling.original_context_length")))
    return rope


def phimoe_gguf_config(get: GGUFMeta, tensors: GGUFTensors):
    """Phi-3.5-MoE's HF config from what llama.cpp's converter writes (the module's docstring lists it)."""
    from transformers import PhimoeConfig

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = hidden // heads  # (Phi-3's converter writes no head size)
    rotated = int(get("rope.dimension_count", head_dim))
    if rotated != head_dim:
        raise _refuse(get, f"rotates {rotated} of each head's {head_dim} dims (phimoe.rope.dimension_count); "
                           "Phi-3.5-MoE rotates the whole head")
    window = int(get("attention.sliding_window", 0))
    return PhimoeConfig(
        architectures=["PhimoeForCausalLM"], vocab_size=tensors.shape("token_embd.weight")[0], hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")), num_hidden_layers=get.model_layers(),
        num_attention_heads=heads, num_key_value_heads=int(get("attention.head_count_kv")), head_dim=head_dim,
        num_local_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
        max_position_embeddings=int(get("context_length")), rope_parameters=_rope(get, tensors, head_dim),
        rms_norm_eps=as_written(get("attention.layer_norm_rms_epsilon")), sliding_window=window or None,
        attention_bias="blk.0.attn_q.bias" in tensors, lm_head_bias="output.bias" in tensors,
        tie_word_embeddings="output.weight" not in tensors, **get.token_ids())


def _names(config) -> tuple[dict[str, str], dict[str, tuple[int, str]]]:
    """(GGUF name -> the release's name of every tensor but the experts'; GGUF name -> (layer, Mixtral's name) of the
    stacked experts), through gguf-py's map, as the converter renames them."""
    import gguf

    layers = config.num_hidden_layers
    names = ["model.embed_tokens.weight", "model.norm.weight", "model.norm.bias"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    if config.lm_head_bias:
        names.append("lm_head.bias")
    biases = ("weight", "bias") if config.attention_bias else ("weight",)
    for i in range(layers):
        prefix = f"model.layers.{i}."
        names += [f"{prefix}{norm}.{p}" for norm in ("input_layernorm", "post_attention_layernorm")
                  for p in ("weight", "bias")]
        names += [f"{prefix}self_attn.{proj}.{p}" for proj in ("q_proj", "k_proj", "v_proj", "o_proj") for p in biases]
        names.append(f"{prefix}block_sparse_moe.gate.weight")
    merged = {f"model.layers.{i}.block_sparse_moe.experts.{w}.weight": (i, w) for i in range(layers) for w in _EXPERTS}
    experts = {g: merged[n] for g, n in gguf_names(gguf.MODEL_ARCH.PHIMOE, layers, merged).items()}
    return gguf_names(gguf.MODEL_ARCH.PHIMOE, layers, names), experts


def phimoe_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """The HF config of a Phi-3.5-MoE GGUF and its tensors, a group (the model's own, then a layer) at a time, read
    as the groups are taken."""
    get, tensors = read_model_gguf(gguf, arch)
    config = phimoe_gguf_config(get, tensors)  # (takes the LongRoPE factors out of ``tensors``)
    plain, experts = _names(config)
    check_tensor_names(gguf, "Phi-3.5-MoE", set(plain) | set(experts), tensors)

    def hf_tensors(gguf_name: str) -> dict[str, torch.Tensor]:
        if gguf_name in experts:
            layer, projection = experts[gguf_name]
            return per_expert(tensors.pop(gguf_name), f"model.layers.{layer}.block_sparse_moe.experts.", projection)
        return {plain[gguf_name]: tensors.pop(gguf_name)}

    return config, converted_groups(tensors, hf_tensors)
