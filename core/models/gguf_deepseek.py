"""GGUF files of DeepSeek-V3 (and the models of its layout: DeepSeek-R1, Kimi K2, GLM-4.7-Flash;
``general.architecture`` ``deepseek2``) and of GLM-5 (``glm-dsa``), as llama.cpp's converter writes them, turned
back into the HF checkpoint :mod:`specray.models.deepseek_v3` loads. transformers' GGUF mapping has neither, so the
config and every tensor are read here.

What the converter writes, read back here:

* multi-head latent attention as MQA (``attention.head_count_kv`` 1): the latent width (``attention.kv_lora_rank``),
  the query's (``attention.q_lora_rank``; none: a plain ``q_proj``), the heads' widths (``attention.key_length_mla``:
  nope + rope, ``rope.dimension_count``: rope, ``attention.value_length_mla``: v);
* ``kv_b_proj`` split per head into ``attn_k_b`` (its key rows, transposed: ``[heads, kv_lora_rank, nope]``) and
  ``attn_v_b`` (``[heads, v, kv_lora_rank]``), or, from older converters, kept whole as ``attn_kv_b``;
* the router (``expert_count``, ``expert_used_count``, ``expert_group_count`` / ``expert_group_used_count``,
  ``expert_gating_func`` sigmoid, ``expert_weights_scale``, ``expert_weights_norm``), its correction bias as
  ``exp_probs_b.bias``, the experts stacked per projection, the shared experts (``expert_shared_count``) as
  ``*_shexp``, the leading dense layers (``leading_dense_block_count``);
* YaRN (``rope.scaling.*``; ``mscale_all_dim`` as ``yarn_log_multiplier / 0.1``; ``mscale``, which the file does not
  carry, taken equal to it, as in the releases);
* no MTP layer in a ``deepseek2`` file (the converter leaves them out): ``method="mtp"`` needs the HF checkpoint;
* GLM-5's besides (its GlmMoeDsaModel): the sparse attention's indexer, its sizes as ``attention.indexer.head_count``,
  ``key_length`` and ``top_k``, its tensors (``indexer.attn_q_b``, ``attn_k``, ``k_norm``, ``proj``) on the layers
  that have their own, none on a layer that shares the previous one's choice (``indexer_types`` "shared"), and the
  MTP layers kept (``nextn_predict_layers``, counted in ``block_count``: each a block of experts with its
  ``nextn.*`` tensors), so ``method="mtp"`` drafts from a GLM-5 GGUF.

A softmax router (DeepSeek-V2's) is refused. Tensors of any llama.cpp type are dequantized to float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import (GGUFMeta, GGUFTensors, as_written, check_tensor_names, converted_groups,
                                      gguf_names, hf_tensor_names, per_expert, read_model_gguf, stacked_experts)

DEEPSEEK_GGUF_ARCHS = ("deepseek2", "glm-dsa")
# a GLM-5 MTP layer's own tensors (after ``model.layers.{L}.``), beside its block's
_NEXTN = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight", "shared_head.head.weight",
          "embed_tokens.weight")


def deepseek_gguf_config(get: GGUFMeta, tensors: GGUFTensors):
    """DeepSeek-V3's HF config from what llama.cpp's converter writes (the module's docstring lists it)."""
    import gguf as gguf_py
    from transformers import DeepseekV3Config

    gguf = get.gguf
    gating = int(get("expert_gating_func", int(gguf_py.ExpertGatingFuncType.SOFTMAX)))
    if gating != int(gguf_py.ExpertGatingFuncType.SIGMOID):
        raise ValueError(f"GGUF {str(gguf)!r} routes its experts by softmax (deepseek2.expert_gating_func={gating}: "
                         "DeepSeek-V2's router); specray reads DeepSeek-V3's (sigmoid) from a deepseek2 GGUF. Pass "
                         "the model's HF checkpoint instead")
    rope_dim = int(get("rope.dimension_count"))
    rope = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    scaling = get("rope.scaling.type", "none")
    if scaling == "yarn":
        mscale = as_written(float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1)
        rope.update(rope_type="yarn", factor=float(get("rope.scaling.factor")),
                    original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
                    mscale=mscale, mscale_all_dim=mscale)
        for key, field in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if get(f"rope.scaling.{key}", None) is not None:
                rope[field] = float(get(f"rope.scaling.{key}"))
    elif scaling != "none":
        raise ValueError(f"GGUF {str(gguf)!r} has deepseek2.rope.scaling.type={scaling!r}; specray reads a deepseek2 "
                         "GGUF with YaRN or no RoPE scaling. Pass the model's HF checkpoint instead")
    heads = int(get("attention.head_count"))
    q_lora = get("attention.q_lora_rank", None)
    # GLM-5's MTP layers, after the model's own (a DeepSeek-V3 file has none)
    nextn, layers = get.mtp_layers(), get.model_layers()
    if get.arch == "glm-dsa":
        from transformers import GlmMoeDsaConfig

        # its indexer on every layer that has its tensors; the others reuse the previous one's choice ("shared")
        types = ["full" if f"blk.{i}.indexer.attn_k.weight" in tensors else "shared" for i in range(layers)]
        model = dict(config_class=GlmMoeDsaConfig, architectures=["GlmMoeDsaForCausalLM"], indexer_types=types,
                     index_n_heads=int(get("attention.indexer.head_count")),
                     index_head_dim=int(get("attention.indexer.key_length")),
                     index_topk=int(get("attention.indexer.top_k")), num_nextn_predict_layers=nextn)
    else:
        model = dict(config_class=DeepseekV3Config, architectures=["DeepseekV3ForCausalLM"])
    return model.pop("config_class")(
        **model, vocab_size=tensors.shape("token_embd.weight")[0],
        hidden_size=int(get("embedding_length")), intermediate_size=int(get("feed_forward_length")),
        moe_intermediate_size=int(get("expert_feed_forward_length")), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, n_shared_experts=int(get("expert_shared_count", 0)),
        n_routed_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
        routed_scaling_factor=as_written(float(get("expert_weights_scale", 1.0))),
        n_group=int(get("expert_group_count", 1)), topk_group=int(get("expert_group_used_count", 1)),
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        first_k_dense_replace=int(get("leading_dense_block_count", 0)),
        kv_lora_rank=int(get("attention.kv_lora_rank")), q_lora_rank=int(q_lora) if q_lora else None,
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=int(get("attention.key_length_mla")) - rope_dim,
        v_head_dim=int(get("attention.value_length_mla")), rope_parameters=rope,
        rms_norm_eps=as_written(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")), tie_word_embeddings="output.weight" not in tensors,
        **get.token_ids())


def _blocks(config) -> int:
    """The file's blocks: the model's layers and, in a GLM-5 file, its MTP layers after them (a DeepSeek-V3 config
    may carry the release's ``num_nextn_predict_layers``, whose layers a ``deepseek2`` file leaves out)."""
    nextn = getattr(config, "num_nextn_predict_layers", 0) if config.model_type == "glm_moe_dsa" else 0
    return config.num_hidden_layers + nextn


def _names(config, tensors: GGUFTensors) -> tuple[dict[str, str], dict[str, tuple[int, str]]]:
    """(GGUF name -> HF name of every tensor but the experts' and ``kv_b_proj``, GLM-5's MTP layers' included;
    GGUF name -> (layer, projection) of the stacked experts), as the converter names them."""
    import copy

    import gguf
    import transformers

    layers, count = config.num_hidden_layers, _blocks(config)
    deeper = copy.deepcopy(config)  # the MTP layers' blocks are layers of experts past the model's own
    deeper.num_hidden_layers = count
    for field, kind in (("mlp_layer_types", "sparse"), ("indexer_types", "full")):  # per-layer lists, one per block
        kinds = getattr(deeper, field, None)
        if isinstance(kinds, list):
            setattr(deeper, field, kinds + [kind] * (count - layers))
    names = hf_tensor_names(getattr(transformers, config.architectures[0]), deeper,
                            lambda n: ".mlp.experts." in n or n.endswith("kv_b_proj.weight"))
    names += [f"model.layers.{i}.{n}" for i in range(layers, count) for n in _NEXTN]
    arch = gguf.MODEL_ARCH.GLM_DSA if config.model_type == "glm_moe_dsa" else gguf.MODEL_ARCH.DEEPSEEK2
    plain = {g: n for g, n in gguf_names(arch, count, names).items()
             if not g.startswith("blk.") or ".nextn." not in g or g in tensors}  # nextn tensors a release may omit
    return plain, stacked_experts(arch, count, range(config.first_k_dense_replace, count))


def deepseek_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """The HF config of a DeepSeek-V3 GGUF and its tensors, a group (the model's own, then a layer) at a time, read
    as the groups are taken."""
    get, tensors = read_model_gguf(gguf, arch)
    config = deepseek_gguf_config(get, tensors)
    plain, experts = _names(config, tensors)
    count = _blocks(config)
    split = all(f"blk.{i}.attn_k_b.weight" in tensors for i in range(count))
    kv_b = {f"blk.{i}.{part}.weight" for i in range(count)
            for part in (("attn_k_b", "attn_v_b") if split else ("attn_kv_b",))}
    expected = set(plain) | set(experts) | kv_b
    check_tensor_names(gguf, config.architectures[0], expected, tensors)

    def kv_b_proj(layer: int) -> torch.Tensor:
        """``kv_b_proj`` [heads * (nope + v), kv_lora_rank] from the file's halves: per head its key rows, then
        its value rows."""
        if not split:
            return tensors.pop(f"blk.{layer}.attn_kv_b.weight")
        k_b = tensors.pop(f"blk.{layer}.attn_k_b.weight")  # [heads, kv_lora_rank, nope]
        v_b = tensors.pop(f"blk.{layer}.attn_v_b.weight")  # [heads, v, kv_lora_rank]
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, config.kv_lora_rank)

    def hf_tensors(gguf_name: str) -> dict[str, torch.Tensor]:
        if gguf_name in experts:
            layer, projection = experts[gguf_name]
            return per_expert(tensors.pop(gguf_name), f"model.layers.{layer}.mlp.experts.", projection)
        if gguf_name in kv_b:
            layer = int(gguf_name.split(".")[1])
            return {f"model.layers.{layer}.self_attn.kv_b_proj.weight": kv_b_proj(layer)} \
                if gguf_name.endswith(("attn_k_b.weight", "attn_kv_b.weight")) else {}
        return {plain[gguf_name]: tensors.pop(gguf_name)}

    return config, converted_groups(tensors, hf_tensors)
