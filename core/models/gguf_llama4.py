"""Llama 4's text model from a GGUF file as llama.cpp's converter writes it (its ``Llama4Model``, architecture
``llama4``: Scout, Maverick), turned back into the HF checkpoint specray loads (``Llama4ForCausalLM``).

What the converter writes, read back here: a Llama's metadata (sizes, heads, head size, the dense layers' width as
``feed_forward_length`` and the experts' as ``expert_feed_forward_length``, the experts' counts,
``interleave_moe_layer_step``), the RoPE (Llama 3's scaling as the per-frequency factors ``rope_freqs``:
:func:`~specray.models.gguf_read.rope_parameters`), every tensor under the name gguf-py's tensor map gives the HF name;
the experts' fused ``gate_up_proj`` ``[E, H, 2I]`` split into ``ffn_gate_exps`` and ``ffn_up_exps`` (each ``[E, I, H]``)
and ``down_proj`` ``[E, I, H]`` transposed into ``ffn_down_exps``, put back. The query and key rows stay in the
release's order (its RoPE rotates interleaved pairs, as llama.cpp's does).

What no GGUF key carries, llama.cpp fixes for every Llama 4 and so does this reader (the releases' values): RoPE on
three layers of four, the fourth without it (``no_rope_layers``, every 4th 0); chunked attention over 8192 positions on
the RoPE layers; the NoPE layers' query temperature (``attn_temperature_tuning``, ``floor_scale`` 8192, ``attn_scale``
0.1); q and k L2-normed on the RoPE layers unless the model has 128 experts (Maverick has none, Scout has them). A file
with ``attention.sliding_window`` 0 (llama.cpp's MobileLLM shape: no chunking, RoPE on all but the last layer) is
refused. Tensors of any llama.cpp type are dequantized to float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import (GGUFMeta, GGUFTensors, as_written, by_layer, check_tensor_names, gguf_names,
                                      hf_tensor_names, read_model_gguf, rope_parameters, stacked_experts)

LLAMA4_GGUF_ARCHS = ("llama4",)
# what llama.cpp fixes for every Llama 4 (no GGUF key carries it), as the releases set it
NO_ROPE_LAYER_STEP = 4
ATTENTION_CHUNK_SIZE = 8192
TEMPERATURE = {"attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1}
UNNORMED_EXPERT_COUNT = 128  # llama.cpp's Maverick (128 experts) has no q/k norm; every other Llama 4 has it


def llama4_gguf_config(get: GGUFMeta, tensors: GGUFTensors):
    """Llama 4's HF text config from its metadata as llama.cpp's converter writes it (the module's docstring lists
    it); ``rope_freqs`` is taken from ``tensors``."""
    from transformers import Llama4TextConfig

    window = get("attention.sliding_window", None)
    if window is not None and int(window) == 0:
        raise ValueError(f"GGUF {str(get.gguf)!r} has llama4.attention.sliding_window 0 (llama.cpp's MobileLLM shape: "
                         "no chunked attention, RoPE on all but the last layer), which specray does not read from a "
                         "GGUF; pass the model's HF checkpoint instead")
    hidden, heads, layers = int(get("embedding_length")), int(get("attention.head_count")), int(get("block_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rotated = int(get("rope.dimension_count", head_dim))
    if rotated != head_dim:
        raise ValueError(f"GGUF {str(get.gguf)!r} rotates {rotated} of each head's {head_dim} dims "
                         "(llama4.rope.dimension_count); Llama 4 rotates the whole head. Pass the model's HF "
                         "checkpoint instead")
    experts = int(get("expert_count"))
    return Llama4TextConfig(
        architectures=["Llama4ForCausalLM"], vocab_size=tensors.shape("token_embd.weight")[0], hidden_size=hidden,
        intermediate_size=int(get("expert_feed_forward_length")),
        intermediate_size_mlp=int(get("feed_forward_length")),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=int(get("attention.head_count_kv")),
        head_dim=head_dim, max_position_embeddings=int(get("context_length")),
        rms_norm_eps=as_written(get("attention.layer_norm_rms_epsilon")),
        rope_parameters=rope_parameters(get, tensors.pop("rope_freqs.weight", None), rotated),
        num_local_experts=experts, num_experts_per_tok=int(get("expert_used_count")),
        interleave_moe_layer_step=int(get("interleave_moe_layer_step")),
        no_rope_layers=[int((i + 1) % NO_ROPE_LAYER_STEP != 0) for i in range(layers)],
        attention_chunk_size=ATTENTION_CHUNK_SIZE, use_qk_norm=experts != UNNORMED_EXPERT_COUNT, **TEMPERATURE,
        tie_word_embeddings="output.weight" not in tensors, **get.token_ids())


def llama4_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """Llama 4's HF text config and tensors from its GGUF, a group (the model's own, then a layer) at a time, read as
    the groups are taken."""
    import gguf as gguf_py
    from transformers import Llama4ForCausalLM

    get, tensors = read_model_gguf(gguf, arch)
    config = llama4_gguf_config(get, tensors)
    hf_names = hf_tensor_names(Llama4ForCausalLM, config, lambda n: ".experts." in n)
    gguf_arch, layers = gguf_py.MODEL_ARCH.LLAMA4, config.num_hidden_layers
    names = gguf_names(gguf_arch, layers, hf_names)
    experts = stacked_experts(gguf_arch, layers, config.moe_layers)
    check_tensor_names(gguf, "Llama4ForCausalLM", set(names) | set(experts), tensors)

    def hf_tensors(group: list[str]) -> dict[str, torch.Tensor]:
        out, stacked = {}, {}
        for name in group:
            if name in experts:
                layer, projection = experts[name]
                stacked[projection] = tensors.pop(name)  # [E, I, H], the down projection [E, H, I]
            else:
                out[names[name]] = tensors.pop(name)
        if stacked:  # the release's layout: x @ gate_up_proj [E, H, 2I] (gate, then up), x @ down_proj [E, I, H]
            prefix = f"model.layers.{layer}.feed_forward.experts."
            out[prefix + "gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], 1).transpose(1, 2)
            out[prefix + "down_proj"] = stacked["down_proj"].transpose(1, 2)
        return {k: v.contiguous() for k, v in out.items()}

    return config, (hf_tensors(group) for group in by_layer(tensors))
