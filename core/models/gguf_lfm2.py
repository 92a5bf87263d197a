"""GGUF files of LFM2-MoE (``general.architecture`` ``lfm2moe``: LFM2-8B-A1B, LFM2.5-8B-A1B, LFM2-24B-A2B), as
llama.cpp's converter writes them, turned back into the HF checkpoint :mod:`specray.models.lfm2` loads.
transformers' GGUF mapping has LFM2 but not LFM2-MoE, so the config and every tensor are read here.

What the converter writes, read back here:

* which layers attend: the per-layer ``attention.head_count_kv`` (0 on the short-conv layers), as ``layer_types``;
  the conv's width (``shortconv.l_cache``) and, by its tensor's presence, its bias;
* the dense first layers (``leading_dense_block_count``, ``feed_forward_length`` wide) and the experts
  (``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``), routed by sigmoid scores
  (``expert_gating_func``: another is refused), chosen with the scores plus the router's bias (``exp_probs_b``,
  the release's ``expert_bias``, present or not: ``use_expert_bias``);
* every tensor under the name gguf-py's tensor map gives the HF name: the final norm as ``token_embd_norm``, the
  conv's weight ``[C, 1, K]`` squeezed to ``[C, K]``, the experts stacked per projection
  (``ffn_{gate,up,down}_exps`` ``[E, ...]``, the release's ``w1``, ``w3``, ``w2``).

What no key carries is set as llama.cpp's graph fixes it: the chosen experts' weights normalized to sum 1
(``norm_topk_prob``), scaled by ``expert_weights_scale`` where the file has one, else not at all
(``routed_scaling_factor`` 1: LFM2-8B-A1B's).

Tensors of any llama.cpp type are dequantized to float32 here (the conversion keeps the integers of those
:mod:`specray.models.gguf_quant` finds again).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import (GGUFMeta, GGUFTensors, as_written, check_tensor_names, converted_groups,
                                      gguf_names, hf_tensor_names, per_expert, read_model_gguf, stacked_experts)

LFM2_GGUF_ARCHS = ("lfm2moe",)
_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
_RELEASE_PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # the release's names per expert


def lfm2_moe_gguf_config(get: GGUFMeta, tensors: GGUFTensors):
    """LFM2-MoE's HF config from what llama.cpp's converter writes (the module's docstring lists it)."""
    from transformers import Lfm2MoeConfig

    gguf, count = get.gguf, get.model_layers()
    kv_heads = get.per_layer("attention.head_count_kv", count)
    attention = [i for i, n in enumerate(kv_heads) if n]
    if not attention:
        raise ValueError(f"GGUF {str(gguf)!r} has no attention layer ({get.arch}.attention.head_count_kv is 0 on every "
                         "layer); pass the model's HF checkpoint instead")
    gating = int(get("expert_gating_func"))
    if gating != _SIGMOID:
        raise ValueError(f"GGUF {str(gguf)!r} routes its experts by {get.arch}.expert_gating_func={gating}; LFM2-MoE's "
                         f"router is sigmoid ({_SIGMOID}). Pass the model's HF checkpoint instead")
    dense = int(get("leading_dense_block_count"))
    conv = next((i for i in range(count) if i not in attention), None)
    scale = float(get("expert_weights_scale", 0.0))
    return Lfm2MoeConfig(
        architectures=["Lfm2MoeForCausalLM"], vocab_size=tensors.shape("token_embd.weight")[0],
        hidden_size=int(get("embedding_length")), intermediate_size=int(get("feed_forward_length")),
        moe_intermediate_size=int(get("expert_feed_forward_length")), num_hidden_layers=count,
        num_attention_heads=int(get("attention.head_count")), num_key_value_heads=kv_heads[attention[0]],
        layer_types=["full_attention" if n else "conv" for n in kv_heads], conv_L_cache=int(get("shortconv.l_cache")),
        conv_bias=conv is not None and f"blk.{conv}.shortconv.conv.bias" in tensors, num_dense_layers=dense,
        num_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
        norm_topk_prob=True, routed_scaling_factor=as_written(scale) if scale else 1.0,
        use_expert_bias=dense < count and f"blk.{dense}.exp_probs_b.bias" in tensors,
        norm_eps=as_written(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")),
        rope_parameters={"rope_type": "default", "rope_theta": float(get("rope.freq_base"))},
        tie_word_embeddings="output.weight" not in tensors, **get.token_ids())


def _names(config) -> tuple[dict[str, str], dict[str, tuple[int, str]]]:
    """(GGUF name -> HF name of every tensor but the experts', GGUF name -> (layer, projection) of the stacked
    experts), as the converter names them."""
    import gguf
    from transformers import Lfm2MoeForCausalLM

    names = hf_tensor_names(Lfm2MoeForCausalLM, config, lambda n: ".experts." in n)
    arch, count = gguf.MODEL_ARCH.LFM2MOE, config.num_hidden_layers
    return gguf_names(arch, count, names), stacked_experts(arch, count, range(config.num_dense_layers, count))


def lfm2_moe_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """The HF config of an LFM2-MoE GGUF and its tensors, a group (the model's own, then a layer) at a time, read as
    the groups are taken."""
    get, tensors = read_model_gguf(gguf, arch)
    config = lfm2_moe_gguf_config(get, tensors)
    plain, experts = _names(config)
    check_tensor_names(gguf, "LFM2-MoE", set(plain) | set(experts), tensors)

    def hf_tensors(gguf_name: str) -> dict[str, torch.Tensor]:
        value = tensors.pop(gguf_name)
        if gguf_name in experts:
            layer, projection = experts[gguf_name]
            return per_expert(value, f"model.layers.{layer}.feed_forward.experts.", _RELEASE_PROJECTIONS[projection])
        name = plain[gguf_name]
        if name.endswith("conv.conv.weight"):
            value = value.unsqueeze(1)
        return {name: value}

    return config, converted_groups(tensors, hf_tensors)
