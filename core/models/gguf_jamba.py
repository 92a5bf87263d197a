"""GGUF files of Jamba (``general.architecture`` ``jamba``), as llama.cpp's converter writes them, turned back into
the HF checkpoint :mod:`specray.models.mamba_hybrid` loads. transformers' GGUF mapping has no Jamba, so the config
and every tensor are read here.

What the converter writes, read back here:

* which layers attend: the per-layer ``attention.head_count_kv`` (0 on the Mamba layers), read back as
  ``attn_layer_offset`` / ``attn_layer_period``; which layers have experts: those with a router
  (``ffn_gate_inp``), read back as ``expert_layer_offset`` / ``expert_layer_period`` (none: one expert, dense MLPs);
* the Mamba sizes as ``ssm.*`` (``inner_size``: ``mamba_expand * hidden_size``, ``state_size``, ``conv_kernel``,
  ``time_step_rank``), the projections' and conv's biases by their tensors' presence;
* every tensor under the name gguf-py's tensor map gives the HF name; ``A_log`` stored as ``A = -exp(A_log)``
  (``ssm_a``), the conv's weight ``[C, 1, K]`` squeezed to ``[C, K]``, the experts stacked per projection
  (``ffn_{gate,up,down}_exps`` ``[E, ...]``).

Tensors of any llama.cpp type are dequantized to float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import (GGUFMeta, GGUFTensors, as_written, check_tensor_names, converted_groups,
                                      gguf_names, hf_tensor_names, per_expert, read_model_gguf, stacked_experts)

JAMBA_GGUF_ARCHS = ("jamba",)


def _periodic(layers: list[int], count: int, what: str, gguf: Path) -> tuple[int, int]:
    """(offset, period) of Jamba's ``(i - offset) % period == 0`` that picks exactly ``layers`` of ``count``."""
    offset = layers[0]
    period = layers[1] - layers[0] if len(layers) > 1 else count
    if layers != [i for i in range(offset, count) if (i - offset) % period == 0]:
        raise ValueError(f"GGUF {str(gguf)!r} has {what} {layers}, not every {period}th from {offset} as Jamba places "
                         "them; pass the model's HF checkpoint instead")
    return offset, period


def jamba_gguf_config(get: GGUFMeta, tensors: GGUFTensors):
    """Jamba's HF config from what llama.cpp's converter writes (the module's docstring lists it)."""
    from transformers import JambaConfig

    gguf, count = get.gguf, int(get("block_count"))
    kv_heads = get.per_layer("attention.head_count_kv", count)
    attention = [i for i, n in enumerate(kv_heads) if n]
    if not attention:
        raise ValueError(f"GGUF {str(gguf)!r} has no attention layer (jamba.attention.head_count_kv is 0 on every "
                         "layer); pass the model's HF checkpoint instead")
    attn_offset, attn_period = _periodic(attention, count, "attention layers", gguf)
    moe = [i for i in range(count) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    expert_offset, expert_period = _periodic(moe, count, "expert layers", gguf) if moe else (0, 1)
    hidden, inner = int(get("embedding_length")), int(get("ssm.inner_size"))
    if inner % hidden:
        raise ValueError(f"GGUF {str(gguf)!r} has jamba.ssm.inner_size={inner}, not a multiple of its "
                         f"embedding_length={hidden} (Jamba's mamba_expand); pass the model's HF checkpoint instead")
    mamba = next(i for i in range(count) if i not in attention)
    return JambaConfig(
        architectures=["JambaForCausalLM"], vocab_size=tensors.shape("token_embd.weight")[0], hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")), num_hidden_layers=count,
        num_attention_heads=int(get("attention.head_count")), num_key_value_heads=kv_heads[attention[0]],
        attn_layer_offset=attn_offset, attn_layer_period=attn_period, expert_layer_offset=expert_offset,
        expert_layer_period=expert_period, num_experts=int(get("expert_count")) if moe else 1,
        num_experts_per_tok=int(get("expert_used_count")) if moe else 1, mamba_d_state=int(get("ssm.state_size")),
        mamba_d_conv=int(get("ssm.conv_kernel")), mamba_expand=inner // hidden,
        mamba_dt_rank=int(get("ssm.time_step_rank")), mamba_conv_bias=f"blk.{mamba}.ssm_conv1d.bias" in tensors,
        mamba_proj_bias=f"blk.{mamba}.ssm_in.bias" in tensors,
        rms_norm_eps=as_written(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")), tie_word_embeddings="output.weight" not in tensors,
        **get.token_ids())


def _names(config) -> tuple[dict[str, str], dict[str, tuple[int, str]]]:
    """(GGUF name -> HF name of every tensor but the experts', GGUF name -> (layer, projection) of the stacked
    experts), as the converter names them."""
    import gguf
    from transformers import JambaForCausalLM

    names = hf_tensor_names(JambaForCausalLM, config, lambda n: ".experts." in n)
    arch, count = gguf.MODEL_ARCH.JAMBA, config.num_hidden_layers
    moe = [i for i in range(count) if config.num_experts > 1 and i >= config.expert_layer_offset
           and (i - config.expert_layer_offset) % config.expert_layer_period == 0]
    return gguf_names(arch, count, names), stacked_experts(arch, count, moe)


def jamba_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """The HF config of a Jamba GGUF and its tensors, a group (the model's own, then a layer) at a time, read as the
    groups are taken."""
    get, tensors = read_model_gguf(gguf, arch)
    config = jamba_gguf_config(get, tensors)
    plain, experts = _names(config)
    check_tensor_names(gguf, "Jamba", set(plain) | set(experts), tensors)

    def hf_tensors(gguf_name: str) -> dict[str, torch.Tensor]:
        value = tensors.pop(gguf_name)
        if gguf_name in experts:
            layer, projection = experts[gguf_name]
            return per_expert(value, f"model.layers.{layer}.feed_forward.experts.", projection)
        name = plain[gguf_name]
        if name.endswith("mamba.A_log"):
            value = torch.log(-value)
        elif name.endswith("mamba.conv1d.weight"):
            value = value.unsqueeze(1)
        return {name: value}

    return config, converted_groups(tensors, hf_tensors)
