"""GGUF files of GLM-4.5 / 4.6 / 4.7 (``general.architecture`` ``glm4moe``), as llama.cpp's converter writes them,
turned back into the HF checkpoint :mod:`specray.models.glm4_moe` loads, its MTP layers included: a GGUF of GLM-4.5
serves ``method="mtp"``. transformers' GGUF mapping has no GLM-4.5, so the config and every tensor are read here.

What the converter writes, read back here:

* ``block_count`` counts the MTP layers too (``nextn_predict_layers`` of them, after the model's own), each with the
  block of a layer of experts and its ``nextn.*`` tensors (``eh_proj``, ``enorm``, ``hnorm``,
  ``shared_head_norm``, and where the release has them ``shared_head_head`` and ``embed_tokens``);
* the heads' size (``attention.key_length``) and the rotated share of each (``rope.dimension_count``: the
  ``partial_rotary_factor`` of a head; llama.cpp's rotation is NeoX's, as the release's, so no row is reordered); q/k/v
  biases and q/k norms by their tensors' presence;
* the router (``expert_count``, ``expert_used_count``, ``expert_group_count`` / ``expert_group_used_count``,
  ``expert_weights_scale``, ``expert_weights_norm``; sigmoid), its correction bias as ``exp_probs_b.bias``, the experts
  stacked per projection, the shared experts (``expert_shared_count``) as ``*_shexp``, the leading dense layers
  (``leading_dense_block_count``);
* every tensor under the name gguf-py's tensor map gives the HF name.

Tensors of any llama.cpp type are dequantized to float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import (GGUFMeta, GGUFTensors, as_written, check_tensor_names, converted_groups,
                                      gguf_names, hf_tensor_names, per_expert, read_model_gguf, rope_parameters,
                                      stacked_experts)

GLM4_MOE_GGUF_ARCHS = ("glm4moe",)
# an MTP layer's own tensors (after ``model.layers.{L}.``), beside its block's
_NEXTN = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight", "shared_head.head.weight",
          "embed_tokens.weight")


def glm4_moe_gguf_config(get: GGUFMeta, tensors: GGUFTensors):
    """GLM-4.5's HF config from what llama.cpp's converter writes (the module's docstring lists it)."""
    from transformers import Glm4MoeConfig

    nextn = get.mtp_layers()
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rotated = int(get("rope.dimension_count", head_dim))
    rope = {**rope_parameters(get, None, rotated), "partial_rotary_factor": rotated / head_dim}
    return Glm4MoeConfig(
        architectures=["Glm4MoeForCausalLM"], vocab_size=tensors.shape("token_embd.weight")[0], hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")), moe_intermediate_size=int(get("expert_feed_forward_length")),
        num_hidden_layers=get.model_layers(), num_nextn_predict_layers=nextn,
        num_attention_heads=heads, num_key_value_heads=int(get("attention.head_count_kv")), head_dim=head_dim,
        n_routed_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
        n_shared_experts=int(get("expert_shared_count", 0)), n_group=int(get("expert_group_count", 1)),
        topk_group=int(get("expert_group_used_count", 1)),
        routed_scaling_factor=as_written(float(get("expert_weights_scale", 1.0))),
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        first_k_dense_replace=int(get("leading_dense_block_count", 0)), rope_parameters=rope,
        attention_bias="blk.0.attn_q.bias" in tensors, use_qk_norm="blk.0.attn_q_norm.weight" in tensors,
        rms_norm_eps=as_written(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")), tie_word_embeddings="output.weight" not in tensors,
        **get.token_ids())


def _names(config, tensors: GGUFTensors) -> tuple[dict[str, str], dict[str, tuple[int, str]]]:
    """(GGUF name -> HF name of every tensor but the experts', the MTP layers' included; GGUF name -> (layer,
    projection) of the stacked experts), as the converter names them."""
    import copy

    import gguf
    from transformers import Glm4MoeForCausalLM

    layers, count = config.num_hidden_layers, config.num_hidden_layers + config.num_nextn_predict_layers
    deeper = copy.deepcopy(config)  # the MTP layers' blocks are layers of experts past the model's own
    deeper.num_hidden_layers = count
    names = hf_tensor_names(Glm4MoeForCausalLM, deeper, lambda n: ".mlp.experts." in n)
    names += [f"model.layers.{i}.{n}" for i in range(layers, count) for n in _NEXTN]
    arch = gguf.MODEL_ARCH.GLM4_MOE
    plain = {g: n for g, n in gguf_names(arch, count, names).items()
             if not g.startswith("blk.") or ".nextn." not in g or g in tensors}  # nextn tensors a release may omit
    return plain, stacked_experts(arch, count, range(config.first_k_dense_replace, count))


def glm4_moe_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """The HF config of a GLM-4.5 GGUF and its tensors (its MTP layers' too), a group (the model's own, then a
    layer) at a time, read as the groups are taken."""
    get, tensors = read_model_gguf(gguf, arch)
    config = glm4_moe_gguf_config(get, tensors)
    plain, experts = _names(config, tensors)
    check_tensor_names(gguf, "GLM-4.5", set(plain) | set(experts), tensors)

    def hf_tensors(gguf_name: str) -> dict[str, torch.Tensor]:
        if gguf_name in experts:
            layer, projection = experts[gguf_name]
            return per_expert(tensors.pop(gguf_name), f"model.layers.{layer}.mlp.experts.", projection)
        return {plain[gguf_name]: tensors.pop(gguf_name)}

    return config, converted_groups(tensors, hf_tensors)
