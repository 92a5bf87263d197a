"""GGUF files of BitNet b1.58 (llama.cpp's ``bitnet``), turned back into the HF checkpoint of
:mod:`specray.models.bitnet` (model type ``bitnet``, its -bf16 release's layout: dense projections, no
``quantization_config``).

What a BitNet GGUF means is what llama.cpp's graph computes from it, which is not the packed HF release's:

* llama.cpp's converter (its ``BitnetModel``) writes every decoder projection already ternarized: the packed release's
  2-bit values unpacked and multiplied by its ``weight_scale``, the -bf16 release's master weights rounded to
  ``absmean * {-1, 0, 1}`` per tensor. Stored as F32 / F16 / BF16, or as the ternary types TQ1_0 / TQ2_0 (ternary
  values with an f16 scale per 256-value block), which dequantize to exactly ``value * scale``. Older files carry the
  scale apart, as a one-value ``blk.N.<projection>.scale`` tensor that llama.cpp's graph multiplies each projection's
  output by: folded into the weight here (``t * s`` of a ternary ``t`` is exact in any float type);
* llama.cpp's graph multiplies activations by these weights as they are, with no per-token int8 quantization of the
  activations (the packed release's ``BitLinear``): so the converted checkpoint is the plain (-bf16 style) model,
  whose projections are ordinary linears over the file's values, and no ``quantization_config`` is written;
* the names are gguf-py's (the sub-norms ``attn_sub_norm`` / ``ffn_sub_norm`` by hand: the installed gguf-py maps
  only 1bitLLM's names for them); q/k rows are the release's (llama.cpp rotates BitNet's by halves, NeoX's way, and
  the converter permutes nothing); the LM head is the embedding (llama.cpp's graph reads ``token_embd`` for it and
  loads no ``output``: a file with one is refused);
* the MLP's activation is ``hidden_activation`` (llama.cpp runs a file without it with SiLU, the 1bitLLM models';
  specray's BitNet serves the squared ReLU, ``relu2``, alone, so such a file is refused); the RoPE from
  ``rope.freq_base`` (the converter's linear scaling of factor 1 is no scaling).

Tensor types other than F32, F16, BF16, TQ1_0 and TQ2_0 are refused (a file requantized to another type is no
ternary model, and specray's kept-integer path does not reach BitNet's linears).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import (GGUFMeta, GGUFTensors, as_written, check_tensor_names, converted_groups,
                                      gguf_names, read_model_gguf, rope_parameters)

BITNET_GGUF_ARCHS = ("bitnet",)
TYPES = ("F32", "F16", "BF16", "TQ1_0", "TQ2_0")  # the tensor types a BitNet GGUF is read in
_PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_SUB_NORMS = {"attn_sub_norm": "self_attn.attn_sub_norm", "ffn_sub_norm": "mlp.ffn_sub_norm"}


def _refuse(get: GGUFMeta, what: str) -> ValueError:
    return ValueError(f"GGUF {str(get.gguf)!r} {what}; pass the model's HF checkpoint instead")


def bitnet_gguf_config(get: GGUFMeta, tensors: GGUFTensors):
    """The HF config (``BitNetConfig``, no quantization) of a BitNet GGUF (the module's docstring)."""
    from transformers import BitNetConfig

    act = get("hidden_activation", None)
    if act != "relu2":
        said = "lacks bitnet.hidden_activation (llama.cpp then runs the MLP with SiLU)" if act is None else \
            f"has bitnet.hidden_activation={act!r}"
        raise _refuse(get, f"{said}; specray's BitNet serves the squared ReLU ('relu2') alone")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    if heads * head_dim != hidden or int(get("attention.value_length", head_dim)) != head_dim or heads % kv:
        raise _refuse(get, f"has {heads} heads of {head_dim} over {kv} KV heads for bitnet.embedding_length={hidden}; "
                           "llama.cpp's BitNet has heads x head size = the width (attn_sub_norm's) and whole groups")
    rotated = int(get("rope.dimension_count", head_dim))
    if rotated != head_dim:
        raise _refuse(get, f"has bitnet.rope.dimension_count={rotated} for heads of {head_dim}; BitNet rotates whole "
                           "heads")
    rope = rope_parameters(get, None, head_dim)
    if rope["rope_type"] == "linear" and rope.pop("factor") == 1:  # (the converter's linear scaling of factor 1)
        rope["rope_type"] = "default"
    if "output.weight" in tensors:
        raise _refuse(get, "has output.weight; llama.cpp's BitNet reads its LM head from token_embd and loads no "
                           "output tensor")
    width = tensors.shape("blk.0.ffn_up.weight")[0] if "blk.0.ffn_up.weight" in tensors else None
    ffn = int(get("feed_forward_length"))
    if width != ffn:
        raise _refuse(get, f"has blk.0.ffn_up.weight of {width} rows for bitnet.feed_forward_length={ffn}")
    return BitNetConfig(architectures=["BitNetForCausalLM"], hidden_size=hidden, intermediate_size=ffn,
                        num_hidden_layers=get.model_layers(), num_attention_heads=heads, num_key_value_heads=kv,
                        hidden_act="relu2", max_position_embeddings=int(get("context_length")),
                        rms_norm_eps=as_written(get("attention.layer_norm_rms_epsilon")), rope_parameters=rope,
                        attention_bias=False, tie_word_embeddings=True,
                        vocab_size=tensors.shape("token_embd.weight")[0], **get.token_ids())


def _hf_names(layers: int) -> list[str]:
    at = "model.layers.{}."
    per_layer = ["input_layernorm", "post_attention_layernorm", *_PROJECTIONS.values()]
    return ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"{at.format(i)}{part}.weight" for i in range(layers) for part in per_layer]


def _check_types(get: GGUFMeta, tensors: GGUFTensors) -> None:
    from gguf import GGMLQuantizationType

    for name, entry in tensors.raw_items():
        kind = GGMLQuantizationType(entry.tensor_type).name
        if kind not in TYPES:
            raise _refuse(get, f"has {name} in {kind}; specray reads a BitNet GGUF's tensors in {', '.join(TYPES)} "
                               "(llama.cpp's ternary types and the float ones)")


def bitnet_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """The HF config of a BitNet GGUF and its checkpoint's tensors, a group (the model's own, then a layer) at a
    time, each projection's separate scale (where the file has one) folded into its weight."""
    import gguf as gguf_py

    get, tensors = read_model_gguf(gguf, arch)
    _check_types(get, tensors)
    config = bitnet_gguf_config(get, tensors)
    layers = config.num_hidden_layers
    names = gguf_names(gguf_py.MODEL_ARCH.BITNET, layers, _hf_names(layers))
    names.update({f"blk.{i}.{g}.weight": f"model.layers.{i}.{hf}.weight" for i in range(layers)
                  for g, hf in _SUB_NORMS.items()})
    scales = {f"blk.{i}.{p}.scale": f"blk.{i}.{p}.weight" for i in range(layers) for p in _PROJECTIONS
              if f"blk.{i}.{p}.scale" in tensors}
    check_tensor_names(gguf, "BitNet", set(names) | set(scales), tensors)
    held = {scales[name]: tensors.pop(name) for name in list(scales)}  # (one value each)
    for weight, scale in held.items():
        if scale.numel() != 1:
            raise _refuse(get, f"has {weight.removesuffix('.weight')}.scale of {scale.numel()} values; llama.cpp's "
                               "BitNet scales a projection by one")

    def hf_tensors(gguf_name: str) -> dict[str, torch.Tensor]:
        value = tensors.pop(gguf_name)
        if gguf_name in held:  # llama.cpp: (W x) * s
            value = value * held[gguf_name].reshape(())
        return {names[gguf_name]: value}

    return config, converted_groups(tensors, hf_tensors)
