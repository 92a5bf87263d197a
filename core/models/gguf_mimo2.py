"""GGUF files of Xiaomi's MiMo-V2-Flash (``general.architecture`` ``mimo2``), as llama.cpp's converter (its
``MimoV2Model`` over ``TextModel``) writes them, turned back into the HF checkpoint :mod:`specray.models.mimo_v2`
loads. transformers' GGUF mapping has no MiMo-V2-Flash, so the config and every tensor are read here.

What the converter writes, read back here:

* the layers' kinds as ``attention.sliding_window_pattern`` (one flag per block: sliding or full), the window
  (``attention.sliding_window``), and the KV heads per block (``attention.head_count_kv``): transformers' MiMo-V2-Flash
  gives a sliding layer twice the full layers' KV heads, so a file of other counts is refused;
* keys of ``attention.key_length`` and values of ``attention.value_length``; the rotated dims
  (``rope.dimension_count``: the ``partial_rotary_factor`` of a head, the same for both kinds of layer, as the
  converter writes one), the full layers' RoPE base (``rope.freq_base``, its scaling by
  :func:`~specray.models.gguf_read.rope_parameters`) and the sliding layers' (``rope.freq_base_swa``, plain);
* the sliding layers' sink logits (``attention_sink_bias`` as ``attn_sinks.weight``), on the layers that have them;
* each layer's MLP dense or of experts by its tensors (``ffn_gate_inp`` marks a layer of experts: ``mlp_layer_types``),
  the experts stacked per projection, the router's correction bias as ``exp_probs_b.bias``;
* newer converters: the values' scale (``attention.value_scale``) and the MTP layers after the model's own
  (``nextn_predict_layers``, counted in ``block_count``), which are not read (specray's MiMo-V2-Flash MTP drafter
  needs the HF checkpoint).

What the converter leaves out is taken as llama.cpp runs it or, where llama.cpp's graph drops it, as the releases have
it: the router sigmoid, ungrouped (``n_group`` 1; ``expert_group_count`` where a file has it) and renormalised
(``norm_topk_prob``; ``expert_weights_norm`` where written), unscaled (``routed_scaling_factor`` 1;
``expert_weights_scale`` where written); the values' scale, where the file has none, the releases' (transformers'
default, 0.707), which llama.cpp's first ``mimo2`` graph did not apply. Tensors of any llama.cpp type are dequantized
to float32.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import (GGUFMeta, GGUFTensors, as_written, check_tensor_names, converted_groups,
                                      gguf_names, hf_tensor_names, per_expert, read_model_gguf, rope_parameters,
                                      stacked_experts)

logger = logging.getLogger(__name__)

MIMO2_GGUF_ARCHS = ("mimo2",)
# the sinks: transformers' parameter, and the name the releases (and transformers' saved files) give it
_SINKS, _SAVED_SINKS = ".self_attn.sinks", ".self_attn.attention_sink_bias"


def _refuse(get: GGUFMeta, what: str) -> ValueError:
    return ValueError(f"GGUF {str(get.gguf)!r} {what}; pass the model's HF checkpoint instead")


def mimo2_gguf_config(get: GGUFMeta, tensors: GGUFTensors):
    """MiMo-V2-Flash's HF config from what llama.cpp's converter writes (the module's docstring lists it)."""
    import gguf as gguf_py
    from transformers import MiMoV2FlashConfig

    blocks, layers = int(get("block_count")), get.model_layers()
    pattern = get("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) not in (blocks, layers):
        raise _refuse(get, f"marks {len(pattern) if isinstance(pattern, list) else pattern} layers in "
                           f"mimo2.attention.sliding_window_pattern for {layers} layers")
    kinds = ["sliding_attention" if sliding else "full_attention" for sliding in pattern[:layers]]
    kv = get.per_layer("attention.head_count_kv", len(pattern))[:layers]
    full = {kv[i] for i in range(layers) if kinds[i] == "full_attention"}
    sliding = {kv[i] for i in range(layers) if kinds[i] == "sliding_attention"}
    if len(full) != 1 or sliding - {2 * min(full)}:
        raise _refuse(get, f"has {kv} KV heads (mimo2.attention.head_count_kv) for layers {kinds}: transformers' "
                           "MiMo-V2-Flash gives each sliding layer twice the KV heads of the full ones, which are "
                           "alike")
    gating = int(get("expert_gating_func", int(gguf_py.ExpertGatingFuncType.SIGMOID)))
    if gating != int(gguf_py.ExpertGatingFuncType.SIGMOID):
        raise _refuse(get, f"has mimo2.expert_gating_func={gating}; MiMo-V2-Flash routes by sigmoid "
                           f"({int(gguf_py.ExpertGatingFuncType.SIGMOID)})")
    head_dim = int(get("attention.key_length"))
    rotated = int(get("rope.dimension_count"))
    full_rope = {**rope_parameters(get, None, rotated), "partial_rotary_factor": rotated / head_dim}
    sliding_rope = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", full_rope["rope_theta"])),
                    "partial_rotary_factor": rotated / head_dim}
    scale = get("attention.value_scale", None)
    return MiMoV2FlashConfig(
        architectures=["MiMoV2FlashForCausalLM"], vocab_size=tensors.shape("token_embd.weight")[0],
        hidden_size=int(get("embedding_length")), intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=layers, num_attention_heads=int(get("attention.head_count")),
        num_key_value_heads=min(full), head_dim=head_dim, v_head_dim=int(get("attention.value_length")),
        layer_types=kinds, sliding_window=int(get("attention.sliding_window")),
        rope_parameters={"full_attention": full_rope, "sliding_attention": sliding_rope},
        mlp_layer_types=["sparse" if f"blk.{i}.ffn_gate_inp.weight" in tensors else "dense" for i in range(layers)],
        n_routed_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
        moe_intermediate_size=int(get("expert_feed_forward_length")),
        n_group=int(get("expert_group_count", 1)), topk_group=int(get("expert_group_used_count", 1)),
        norm_topk_prob=bool(get("expert_weights_norm", True)),
        routed_scaling_factor=as_written(float(get("expert_weights_scale", 1.0))),
        **({} if scale is None else {"attention_value_scale": as_written(float(scale))}),
        attention_bias="blk.0.attn_q.bias" in tensors,
        rms_norm_eps=as_written(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")), tie_word_embeddings="output.weight" not in tensors,
        **get.token_ids())


def mimo2_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """The HF config of a MiMo-V2-Flash GGUF and its tensors, a group (the model's own, then a layer) at a time,
    read as the groups are taken."""
    import gguf as gguf_py
    from transformers import MiMoV2FlashForCausalLM

    get, tensors = read_model_gguf(gguf, arch)
    config = mimo2_gguf_config(get, tensors)
    layers = config.num_hidden_layers
    mtp = [n for n in tensors if n.startswith("blk.") and int(n.split(".")[1]) >= layers]
    if mtp:
        logger.info("GGUF %s: its %d MTP layers are not read (the MTP drafter needs the HF checkpoint)", gguf,
                    get.mtp_layers())
        for name in mtp:
            del tensors[name]
    names = hf_tensor_names(MiMoV2FlashForCausalLM, config, lambda n: ".mlp.experts." in n)
    # the sinks as saved, with the ``.weight`` the converter appends to the bare parameter
    names = [n.replace(_SINKS, _SAVED_SINKS + ".weight") if n.endswith(_SINKS) else n for n in names]
    plain = {g: n.removesuffix(".weight") if _SAVED_SINKS in n else n
             for g, n in gguf_names(gguf_py.MODEL_ARCH.MIMO2, layers, names).items()}
    experts = stacked_experts(gguf_py.MODEL_ARCH.MIMO2, layers,
                              [i for i in range(layers) if config.mlp_layer_types[i] == "sparse"])
    check_tensor_names(gguf, "MiMo-V2-Flash", set(plain) | set(experts), tensors)

    def hf_tensors(gguf_name: str) -> dict[str, torch.Tensor]:
        if gguf_name in experts:
            layer, projection = experts[gguf_name]
            return per_expert(tensors.pop(gguf_name), f"model.layers.{layer}.mlp.experts.", projection)
        return {plain[gguf_name]: tensors.pop(gguf_name)}

    return config, converted_groups(tensors, hf_tensors)
