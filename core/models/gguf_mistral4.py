"""GGUF files of Mistral 4 (``general.architecture`` ``mistral4``), as llama.cpp's converter (its ``Mistral4Model``
over ``DeepseekV2Model``) writes them, turned back into the HF checkpoint specray serves with
:mod:`specray.models.deepseek_v3` (``Mistral4ForCausalLM``). transformers' GGUF mapping has no Mistral 4, so the config
and every tensor are read here.

What the converter writes, read back here (DeepSeek-V3's layout, :mod:`specray.models.gguf_deepseek`, but for the
router and the experts):

* multi-head latent attention as MQA: the latent and query ranks (``attention.kv_lora_rank``,
  ``attention.q_lora_rank``), the heads' widths (``attention.key_length_mla``, ``rope.dimension_count``,
  ``attention.value_length_mla``); ``kv_b_proj`` split per head into ``attn_k_b`` (transposed) and ``attn_v_b``, or
  whole (``attn_kv_b``, older converters);
* YaRN (``rope.scaling.*``; ``mscale_all_dim`` as ``yarn_log_multiplier / 0.1``, DeepSeek's legacy spelling;
  ``mscale`` taken equal to it, as in the releases) and the queries' scaling by position (``llama_4_scaling_beta``)
  as ``attention.temperature_scale`` where a file has it, else the releases' 0.1 (transformers' default: the converter
  writes none); a file without YaRN is refused (the queries' scaling is by YaRN's pretrained length);
* the experts as the release stores them, fused: ``ffn_gate_up_exps`` (``mlp.experts.gate_up_proj`` [E, 2I, H]) and
  ``ffn_down_exps`` (``mlp.experts.down_proj`` [E, H, I]), the shared experts as ``*_shexp``, the dense first layers
  (``leading_dense_block_count``);
* the router softmax-scored (a file naming another ``expert_gating_func`` is refused), its groups
  (``expert_group_count`` / ``expert_group_used_count``, else one), its scale (``expert_weights_scale``, else 1) and
  renormalisation (``expert_weights_norm``, which the converter writes only where the release renormalises: absent,
  none).

Tensors of any llama.cpp type are dequantized to float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import (GGUFMeta, GGUFTensors, as_written, check_tensor_names, converted_groups,
                                      gguf_names, hf_tensor_names, read_model_gguf)

MISTRAL4_GGUF_ARCHS = ("mistral4",)
LLAMA_4_SCALING_BETA = 0.1  # the releases' (transformers' default): the converter writes none


def _refuse(get: GGUFMeta, what: str) -> ValueError:
    return ValueError(f"GGUF {str(get.gguf)!r} {what}; pass the model's HF checkpoint instead")


def mistral4_gguf_config(get: GGUFMeta, tensors: GGUFTensors):
    """Mistral 4's HF config from what llama.cpp's converter writes (the module's docstring lists it)."""
    import gguf as gguf_py
    from transformers import Mistral4Config

    gating = int(get("expert_gating_func", int(gguf_py.ExpertGatingFuncType.SOFTMAX)))
    if gating != int(gguf_py.ExpertGatingFuncType.SOFTMAX):
        raise _refuse(get, f"has mistral4.expert_gating_func={gating}; Mistral 4 routes by softmax "
                           f"({int(gguf_py.ExpertGatingFuncType.SOFTMAX)})")
    scaling = get("rope.scaling.type", "none")
    if scaling != "yarn":
        raise _refuse(get, f"has mistral4.rope.scaling.type={scaling!r}; specray reads a Mistral 4 GGUF with YaRN, "
                           "whose pretrained length its queries' scaling by position counts in")
    rope_dim, head = int(get("rope.dimension_count")), int(get("attention.key_length_mla"))  # head: nope + rope
    mscale = as_written(float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1)
    rope = {"rope_type": "yarn", "rope_theta": float(get("rope.freq_base", 10000.0)),
            "factor": as_written(get("rope.scaling.factor")),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
            "mscale": mscale, "mscale_all_dim": mscale,
            "llama_4_scaling_beta": as_written(float(get("attention.temperature_scale", LLAMA_4_SCALING_BETA))),
            "partial_rotary_factor": rope_dim / head}
    for key, field in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if get(f"rope.scaling.{key}", None) is not None:
            rope[field] = as_written(get(f"rope.scaling.{key}"))
    heads, q_lora = int(get("attention.head_count")), get("attention.q_lora_rank", None)
    return Mistral4Config(
        architectures=["Mistral4ForCausalLM"], vocab_size=tensors.shape("token_embd.weight")[0],
        hidden_size=int(get("embedding_length")), intermediate_size=int(get("feed_forward_length")),
        moe_intermediate_size=int(get("expert_feed_forward_length")), num_hidden_layers=get.model_layers(),
        num_attention_heads=heads, num_key_value_heads=heads, n_shared_experts=int(get("expert_shared_count", 0)),
        n_routed_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
        routed_scaling_factor=as_written(float(get("expert_weights_scale", 1.0))),
        n_group=int(get("expert_group_count", 1)), topk_group=int(get("expert_group_used_count", 1)),
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        first_k_dense_replace=int(get("leading_dense_block_count", 0)),
        kv_lora_rank=int(get("attention.kv_lora_rank")), q_lora_rank=int(q_lora) if q_lora else None,
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=head - rope_dim, v_head_dim=int(get("attention.value_length_mla")),
        rope_parameters=rope, rms_norm_eps=as_written(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")), tie_word_embeddings="output.weight" not in tensors,
        **get.token_ids())


def mistral4_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """The HF config of a Mistral 4 GGUF and its tensors, a group (the model's own, then a layer) at a time, read as
    the groups are taken."""
    import gguf as gguf_py
    from transformers import Mistral4ForCausalLM

    get, tensors = read_model_gguf(gguf, arch)
    config = mistral4_gguf_config(get, tensors)
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    names = hf_tensor_names(Mistral4ForCausalLM, config, lambda n: n.endswith("kv_b_proj.weight"))
    # the fused experts (bare parameters) under the ``.weight`` the converter appends
    names = [n + ".weight" if ".mlp.experts." in n else n for n in names]
    plain = {g: n.removesuffix(".weight") if ".mlp.experts." in n else n
             for g, n in gguf_names(gguf_py.MODEL_ARCH.MISTRAL4, layers, names).items()}
    split = all(f"blk.{i}.attn_k_b.weight" in tensors for i in range(layers))
    kv_b = {f"blk.{i}.{part}.weight" for i in range(layers)
            for part in (("attn_k_b", "attn_v_b") if split else ("attn_kv_b",))}
    check_tensor_names(gguf, "Mistral 4", set(plain) | kv_b, tensors)

    def kv_b_proj(layer: int) -> torch.Tensor:
        """``kv_b_proj`` [heads * (nope + v), kv_lora_rank]: per head its key rows, then its value rows."""
        if not split:
            return tensors.pop(f"blk.{layer}.attn_kv_b.weight")
        k_b = tensors.pop(f"blk.{layer}.attn_k_b.weight").reshape(heads, config.kv_lora_rank, -1)
        v_b = tensors.pop(f"blk.{layer}.attn_v_b.weight").reshape(heads, -1, config.kv_lora_rank)
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, config.kv_lora_rank)

    def hf_tensors(gguf_name: str) -> dict[str, torch.Tensor]:
        if gguf_name in kv_b:
            layer = int(gguf_name.split(".")[1])
            return {f"model.layers.{layer}.self_attn.kv_b_proj.weight": kv_b_proj(layer)} \
                if gguf_name.endswith(("attn_k_b.weight", "attn_kv_b.weight")) else {}
        return {plain[gguf_name]: tensors.pop(gguf_name)}

    return config, converted_groups(tensors, hf_tensors)
