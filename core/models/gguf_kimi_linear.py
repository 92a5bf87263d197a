"""GGUF files of Moonshot's Kimi-Linear (``general.architecture`` ``kimi-linear``: Kimi-Linear-48B-A3B), as
llama.cpp's converter (its ``KimiLinearModel``) writes them, turned back into the HF checkpoint
:mod:`specray.models.kimi_linear` loads. transformers' GGUF mapping has no Kimi-Linear, so the config and every tensor
are read here.

What the converter writes, read back here:

* the layers' kinds as one KV-head count per layer (``attention.head_count_kv``: 0 for a Kimi Delta Attention layer,
  1 for a latent-attention one, MLA written as MQA), turned back into the release's ``linear_attn_config``
  (``kda_layers`` / ``full_attn_layers``, numbered from 1);
* the KDA layers' sizes: as many heads as the model's (``attention.head_count``: llama.cpp builds them so, no key of
  their own), each ``kda.head_dim`` wide, the short convs ``ssm.conv_kernel`` long;
* a KDA layer's tensors: ``q_proj`` / ``k_proj`` / ``v_proj`` as ``attn_q`` / ``attn_k`` / ``attn_v``, the short convs'
  ``[C, 1, K]`` weights reshaped to numpy ``(1, C, 1, K)`` (``ssm_conv1d_q`` / ``_k`` / ``_v``; a quantizer may drop
  the trailing 1), the low-rank forget gate (``ssm_f_a``, ``ssm_f_b``), ``b_proj`` (``ssm_beta``), the output gate
  (``ssm_g_a``, ``ssm_g_b``), its norm (``ssm_norm``), ``o_proj`` (``attn_output``); ``A_log`` ``[1, 1, H, 1]`` stored
  as ``A = -exp(A_log)`` (``ssm_a``, no ``.weight`` suffix), ``dt_bias`` as ``ssm_dt.bias``;
* the latent attention as DeepSeek-V3's (``attention.kv_lora_rank``, ``attention.q_lora_rank`` where a release has
  one, ``attention.key_length_mla``: nope + rope, ``rope.dimension_count``: the rope part,
  ``attention.value_length_mla``),
  ``kv_b_proj`` split per head into ``attn_k_b`` (its key rows transposed: ``[heads, kv_lora_rank, nope]``) and
  ``attn_v_b``, or, from older converters, whole as ``attn_kv_b``; no RoPE (the release's NoPE latent attention:
  llama.cpp rotates nothing, whatever ``rope.*`` says);
* the MLPs as DeepSeek-V3's: the dense first layers (``leading_dense_block_count``, ``feed_forward_length`` wide), then
  the experts stacked per projection (``expert_feed_forward_length`` wide), the shared experts (``expert_shared_count``)
  as ``*_shexp``, the router's correction bias as ``exp_probs_b.bias``, its scale ``expert_weights_scale``, its scoring
  ``expert_gating_func`` (sigmoid; any other refused). llama.cpp renormalises the chosen experts' weights and routes
  without groups whatever the file says; the converter writes neither a group count nor ``expert_weights_norm`` for
  Kimi-Linear (the release's keys are ``num_expert_group`` / ``moe_renormalize``), so one group and renormalisation
  are read unless a key says otherwise.

The tensors come back under the names transformers saves (the MLPs under ``block_sparse_moe.``, the experts as
Mixtral's ``w1`` / ``w3`` / ``w2``). Kimi K3's additions, which the converter writes under the same architecture (a
latent expert size, ``moe_latent_size``; the attention residuals' tensors), are refused. Tensors of any llama.cpp type
are dequantized to float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import (GGUFMeta, GGUFTensors, as_written, check_tensor_names, converted_groups,
                                      gguf_names, per_expert, read_model_gguf, stacked_experts)

KIMI_LINEAR_GGUF_ARCHS = ("kimi-linear",)
# a KDA layer's tensors (after ``model.layers.{i}.``), as the release names them
_KDA = tuple(f"self_attn.{name}" for name in (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
    "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight", "g_a_proj.weight", "g_b_proj.weight", "o_norm.weight",
    "o_proj.weight", "A_log", "dt_bias"))
_DENSE = ("gate_proj", "up_proj", "down_proj")
# the experts' projections as llama.cpp names them -> the release's per-expert names
_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _refuse(get: GGUFMeta, what: str) -> ValueError:
    return ValueError(f"GGUF {str(get.gguf)!r} {what}; pass the model's HF checkpoint instead")


def kimi_linear_gguf_config(get: GGUFMeta, tensors: GGUFTensors):
    """Kimi-Linear's HF config from what llama.cpp's converter writes (the module's docstring lists it)."""
    import gguf as gguf_py
    from transformers import KimiLinearConfig

    gating = int(get("expert_gating_func"))
    if gating != int(gguf_py.ExpertGatingFuncType.SIGMOID):
        raise _refuse(get, f"routes its experts by kimi-linear.expert_gating_func={gating}, not sigmoid "
                           f"({int(gguf_py.ExpertGatingFuncType.SIGMOID)}) as Kimi-Linear does")
    if get("moe_latent_size", None) is not None:
        raise _refuse(get, f"has kimi-linear.moe_latent_size={get('moe_latent_size')}: Kimi K3's latent experts, "
                           "which specray does not read from a GGUF")
    layers, heads = get.model_layers(), int(get("attention.head_count"))
    kv_heads = get.per_layer("attention.head_count_kv", layers)
    rope = int(get("rope.dimension_count"))
    q_lora = get("attention.q_lora_rank", None)
    shape = tensors.shape("token_embd.weight")
    context = get("context_length", None)
    return KimiLinearConfig(
        architectures=["KimiLinearForCausalLM"], vocab_size=shape[0], hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("feed_forward_length")),
        moe_intermediate_size=int(get("expert_feed_forward_length")), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=int(get("attention.kv_lora_rank")),
        q_lora_rank=int(q_lora) if q_lora else None, qk_rope_head_dim=rope,
        qk_nope_head_dim=int(get("attention.key_length_mla")) - rope,
        v_head_dim=int(get("attention.value_length_mla")), num_experts=int(get("expert_count")),
        num_experts_per_token=int(get("expert_used_count")), num_shared_experts=int(get("expert_shared_count", 0)),
        num_expert_group=int(get("expert_group_count", 1)), topk_group=int(get("expert_group_used_count", 1)),
        moe_renormalize=bool(get("expert_weights_norm", True)),
        routed_scaling_factor=as_written(float(get("expert_weights_scale", 1.0))),
        first_k_dense_replace=int(get("leading_dense_block_count", 0)),
        rms_norm_eps=as_written(get("attention.layer_norm_rms_epsilon")),
        linear_attn_config=dict(head_dim=int(get("kda.head_dim")), num_heads=heads,
                                short_conv_kernel_size=int(get("ssm.conv_kernel")),
                                kda_layers=[i + 1 for i in range(layers) if kv_heads[i] == 0],
                                full_attn_layers=[i + 1 for i in range(layers) if kv_heads[i] != 0]),
        tie_word_embeddings=False,  # transformers' Kimi-Linear ties nothing: a file without ``output`` has its head
        # written out from token_embd (llama.cpp's head where the file has none)
        **({"max_position_embeddings": int(context)} if context else {}), **get.token_ids())


def _layer_names(config, layer: int, split_kv_b: bool) -> tuple[dict[str, str], set[str]]:
    """(the release's name -> the name gguf-py's map knows it by, of layer ``layer``'s tensors but the experts' and
    ``kv_b_proj``; the GGUF names of its ``kv_b_proj``'s parts)."""
    prefix = f"model.layers.{layer}."
    names = {f"{prefix}{n}": f"{prefix}{n}" for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
    if config.layer_types[layer] == "linear_attention":
        names |= {f"{prefix}{n}": f"{prefix}{n}" for n in _KDA}
        names[f"{prefix}self_attn.dt_bias"] = f"{prefix}self_attn.dt_proj.bias"  # (the converter's rename)
        kv_b = set()
    else:
        q = ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight") if config.q_lora_rank else ("q_proj.weight",)
        names |= {f"{prefix}self_attn.{n}": f"{prefix}self_attn.{n}"
                  for n in (*q, "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "o_proj.weight")}
        kv_b = {f"blk.{layer}.{part}.weight" for part in (("attn_k_b", "attn_v_b") if split_kv_b else ("attn_kv_b",))}
    if config.mlp_layer_types[layer] == "dense":  # the release's mlp.*, which transformers saves as block_sparse_moe.*
        names |= {f"{prefix}block_sparse_moe.{p}.weight": f"{prefix}mlp.{p}.weight" for p in _DENSE}
    else:
        moe = f"{prefix}block_sparse_moe."
        names |= {f"{moe}gate.weight": f"{moe}gate.weight",
                  f"{moe}gate.e_score_correction_bias": f"{moe}gate.e_score_correction_bias"}
        if config.num_shared_experts:
            names |= {f"{moe}shared_experts.{p}.weight": f"{moe}shared_experts.{p}.weight" for p in _DENSE}
    return names, kv_b


def kimi_linear_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """The HF config of a Kimi-Linear GGUF and its tensors, a group (the model's own, then a layer) at a time, read as
    the groups are taken."""
    import gguf as gguf_py

    get, tensors = read_model_gguf(gguf, arch)
    config = kimi_linear_gguf_config(get, tensors)
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    full = [i for i in range(layers) if config.layer_types[i] == "full_attention"]
    split = all(f"blk.{i}.attn_k_b.weight" in tensors for i in full)
    spelled = {n: n for n in ("model.embed_tokens.weight", "model.norm.weight")}
    headless = "output.weight" not in tensors
    if not headless:
        spelled["lm_head.weight"] = "lm_head.weight"
    kv_b: set[str] = set()
    for layer in range(layers):
        names, parts = _layer_names(config, layer, split)
        spelled |= names
        kv_b |= parts
    release = {mapped: name for name, mapped in spelled.items()}
    plain = {g: release[n] for g, n in gguf_names(gguf_py.MODEL_ARCH.KIMI_LINEAR, layers, list(release)).items()}
    experts = stacked_experts(gguf_py.MODEL_ARCH.KIMI_LINEAR, layers,
                              [i for i in range(layers) if config.mlp_layer_types[i] == "sparse"])
    check_tensor_names(gguf, "Kimi-Linear", set(plain) | set(experts) | kv_b, tensors)
    kda = config.linear_attn_config
    width, kernel = kda["num_heads"] * kda["head_dim"], kda["short_conv_kernel_size"]

    def kv_b_proj(layer: int) -> torch.Tensor:
        """``kv_b_proj`` [heads * (nope + v), kv_lora_rank]: per head its key rows, then its value rows."""
        if not split:
            return tensors.pop(f"blk.{layer}.attn_kv_b.weight")
        k_b = tensors.pop(f"blk.{layer}.attn_k_b.weight").reshape(heads, config.kv_lora_rank, -1)
        v_b = tensors.pop(f"blk.{layer}.attn_v_b.weight").reshape(heads, -1, config.kv_lora_rank)
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, config.kv_lora_rank)

    def hf_tensors(gguf_name: str) -> dict[str, torch.Tensor]:
        if gguf_name in experts:
            layer, projection = experts[gguf_name]
            return per_expert(tensors.pop(gguf_name), f"model.layers.{layer}.block_sparse_moe.experts.",
                              _EXPERT_NAMES[projection])
        if gguf_name in kv_b:
            layer = int(gguf_name.split(".")[1])
            return {f"model.layers.{layer}.self_attn.kv_b_proj.weight": kv_b_proj(layer)} \
                if gguf_name.endswith(("attn_k_b.weight", "attn_kv_b.weight")) else {}
        name, value = plain[gguf_name], tensors.pop(gguf_name)
        if headless and name == "model.embed_tokens.weight":  # llama.cpp's head is then the embedding
            return {name: value, "lm_head.weight": value.clone()}
        if name.endswith("_conv1d.weight"):  # numpy (1, C, 1, K) or, quantized, (C, 1, K): the release's [C, 1, K]
            value = value.reshape(width, 1, kernel)
        elif name.endswith(".A_log"):  # A = -exp(A_log), [1, 1, H, 1]
            value = torch.log(-value).reshape(1, 1, kda["num_heads"], 1)
        return {name: value}

    return config, converted_groups(tensors, hf_tensors)
