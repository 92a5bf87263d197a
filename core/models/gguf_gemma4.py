"""GGUF files of Gemma 4 (``general.architecture`` ``gemma4``), as llama.cpp's converter writes them, turned back into
the HF text checkpoint :mod:`specray.models.gemma4` loads. transformers' GGUF mapping reads a few sizes of such a file
and leaves the rest of Gemma 4's config at its defaults (one release's), so the config and every tensor are read here.

What the converter writes, read back here:

* the layers' kinds as a per-layer flag (``attention.sliding_window_pattern``), the KV heads per layer
  (``attention.head_count_kv``: the sliding layers' count and the full layers' ``num_global_key_value_heads``), the
  two head sizes (``attention.key_length``: the full layers' ``global_head_dim``; ``attention.key_length_swa``: the
  sliding layers' ``head_dim``), the two RoPE bases (``rope.freq_base``: the full layers'; ``rope.freq_base_swa``)
  and the sliding layers' rotated width (``rope.dimension_count_swa``);
* the full layers' "proportional" RoPE as a tensor of frequency factors (``rope_freqs``: 1 for each rotated
  frequency, 1e30 for each frequency left unrotated): its share of ones is ``partial_rotary_factor``;
* KV sharing (``attention.shared_kv_layers``: the last layers, which have no ``attn_k`` / ``attn_v``), their
  double-wide MLPs (``feed_forward_length`` per layer, twice as wide on those layers), per-layer inputs
  (``embedding_length_per_layer_input``), the experts' counts and width (``expert_*``); a full layer without
  ``attn_v`` (and not sharing K/V) uses its keys as values (``attention_k_eq_v``);
* every tensor under the name gguf-py's tensor map gives the HF name (the map the converter itself uses), the
  layers' ``layer_scalar`` and the experts' stacked projections with a ``.weight`` suffix, the router's ``scale`` as
  ``ffn_gate_inp.scale`` and its ``per_expert_scale`` as ``ffn_down_exps.scale``; the norms as they are (Gemma 4's
  scale by ``w``, not ``1 + w``); the embedding cut to the tokenizer's vocabulary.

The tokenizer's end-of-turn tokens (``<turn|>``, ``<|tool_response>``), which a GGUF does not list as end-of-sequence
ids (the HF release's generation config does), are added to ``eos_token_id`` where the vocabulary has them.
Tensors of any llama.cpp type are dequantized to float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import (GGUFMeta, GGUFTensors, as_written, by_layer, check_tensor_names, gguf_names,
                                      hf_tensor_names, read_model_gguf)

GEMMA4_GGUF_ARCHS = ("gemma4",)
SLIDING, FULL = "sliding_attention", "full_attention"
_END_OF_TURN = ("<turn|>", "<|tool_response>")  # end a turn in the chat template, as <eos> ends the text


def gemma4_gguf_config(get: GGUFMeta, tensors: GGUFTensors, tokens: list[str] | None):
    """Gemma 4's HF text config from what llama.cpp's converter writes (the module's docstring lists it)."""
    from transformers import Gemma4TextConfig

    layers = int(get("block_count"))
    sliding = [bool(s) for s in get("attention.sliding_window_pattern")]
    if len(sliding) != layers:
        raise ValueError(f"GGUF {str(get.gguf)!r} has {len(sliding)} values of gemma4.attention.sliding_window_pattern "
                         f"for {layers} layers; convert the model again with a current llama.cpp, or pass its HF "
                         "checkpoint")
    kv_heads = get.per_layer("attention.head_count_kv", layers)
    kv_sliding = next((n for n, s in zip(kv_heads, sliding) if s), kv_heads[0])
    kv_full = next((n for n, s in zip(kv_heads, sliding) if not s), kv_sliding)
    widths = get.per_layer("feed_forward_length", layers)
    shared = int(get("attention.shared_kv_layers", 0))
    first_shared = layers - shared
    head_full = int(get("attention.key_length"))
    head_sliding = int(get("attention.key_length_swa", head_full))
    rope_full = {"rope_type": "proportional", "rope_theta": float(get("rope.freq_base")),
                 "partial_rotary_factor": _rotated_share(tensors, head_full, get.gguf)}
    rope_sliding = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", get("rope.freq_base")))}
    rotated = int(get("rope.dimension_count_swa", head_sliding))
    if rotated != head_sliding:
        rope_sliding["partial_rotary_factor"] = rotated / head_sliding
    k_eq_v = [i for i in range(first_shared) if not sliding[i] and f"blk.{i}.attn_v.weight" not in tensors]
    if k_eq_v and len(k_eq_v) != sum(not s for s in sliding[:first_shared]):
        raise ValueError(f"GGUF {str(get.gguf)!r} has attn_v on some full-attention layers and not on others "
                         f"({k_eq_v}); Gemma 4 has it on all or none. Pass the model's HF checkpoint instead")
    if not k_eq_v and kv_full != kv_sliding:  # (transformers' Gemma 4 gives full layers KV heads of their own only
        raise ValueError(f"GGUF {str(get.gguf)!r} gives its full-attention layers {kv_full} KV heads and its sliding "
                         f"ones {kv_sliding}, but has attn_v on the full layers; a Gemma 4 has its own count on full "
                         "layers only where their keys are their values. Pass the model's HF checkpoint instead")
    experts = int(get("expert_count", 0))
    per_layer_width = int(get("embedding_length_per_layer_input", 0))
    ids = get.token_ids()
    eos_ids = [ids["eos_token_id"]] if ids["eos_token_id"] is not None else []
    index = {t: i for i, t in enumerate(tokens or ()) if t in _END_OF_TURN}
    eos_ids += [index[t] for t in _END_OF_TURN if t in index and index[t] not in eos_ids]
    fields = dict(
        architectures=["Gemma4ForCausalLM"], vocab_size=tensors.shape("token_embd.weight")[0],
        hidden_size=int(get("embedding_length")), num_hidden_layers=layers,
        num_attention_heads=int(get("attention.head_count")), num_key_value_heads=kv_sliding,
        head_dim=head_sliding, global_head_dim=head_full,
        attention_k_eq_v=bool(k_eq_v), intermediate_size=widths[0],
        use_double_wide_mlp=bool(shared) and widths[-1] == 2 * widths[0], num_kv_shared_layers=shared,
        layer_types=[SLIDING if s else FULL for s in sliding], sliding_window=int(get("attention.sliding_window")),
        rope_parameters={SLIDING: rope_sliding, FULL: rope_full}, max_position_embeddings=int(get("context_length")),
        rms_norm_eps=as_written(get("attention.layer_norm_rms_epsilon")),
        final_logit_softcapping=get("final_logit_softcapping", None),
        hidden_size_per_layer_input=per_layer_width, enable_moe_block=experts > 0,
        tie_word_embeddings="output.weight" not in tensors,
        **{**ids, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids or None})
    if k_eq_v:
        fields["num_global_key_value_heads"] = kv_full
    if per_layer_width:
        fields["vocab_size_per_layer_input"] = tensors.shape("per_layer_token_embd.weight")[0]
    if experts:
        fields.update(num_experts=experts, top_k_experts=int(get("expert_used_count")),
                      moe_intermediate_size=int(get("expert_feed_forward_length")))
    return Gemma4TextConfig(**fields)


def _rotated_share(tensors: GGUFTensors, head_dim: int, gguf: Path) -> float:
    """The full layers' ``partial_rotary_factor`` from ``rope_freqs`` (one factor per frequency of a head: 1 where
    it rotates, 1e30 where it does not); without the tensor, whole heads rotate."""
    if "rope_freqs.weight" not in tensors:
        return 1.0
    factors = tensors.pop("rope_freqs.weight")
    rotated = int((factors == 1.0).sum())
    if factors.numel() != head_dim // 2 or not bool(((factors == 1.0) | (factors >= 1e29)).all()) \
            or not bool((factors[:rotated] == 1.0).all()):
        raise ValueError(f"GGUF {str(gguf)!r} has rope_freqs that are not Gemma 4's proportional RoPE (ones for the "
                         "rotated frequencies, then 1e30); pass the model's HF checkpoint instead")
    return 2 * rotated / head_dim


def _gguf_names(config) -> dict[str, str]:
    """GGUF name -> HF name of every tensor of the model ``config`` describes: gguf-py's tensor map over the HF
    model's names, as llama.cpp's converter maps them (suffixes added where it adds them; the router's two scales
    under names of their own)."""
    import gguf
    from transformers import Gemma4ForCausalLM

    names = hf_tensor_names(Gemma4ForCausalLM, config)
    out = {f"blk.{n.split('.')[2]}.{'ffn_gate_inp' if n.endswith('router.scale') else 'ffn_down_exps'}.scale": n
           for n in names if n.endswith(("router.scale", "router.per_expert_scale"))}
    plain = [n for n in names if n not in out.values()]
    suffixed = {n if n.endswith((".weight", ".bias")) else n + ".weight": n for n in plain}  # the converter's renames
    return out | {g: suffixed[n] for g, n in gguf_names(gguf.MODEL_ARCH.GEMMA4, config.num_hidden_layers,
                                                       suffixed).items()}


def gemma4_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """The HF config of a Gemma 4 GGUF and its tensors, a group (the model's own, then a layer) at a time, read as
    the groups are taken."""
    from gguf import GGUFReader

    get, tensors = read_model_gguf(gguf, arch)
    field = GGUFReader(str(gguf)).fields.get("tokenizer.ggml.tokens")
    config = gemma4_gguf_config(get, tensors, field.contents() if field is not None else None)
    names = _gguf_names(config)
    check_tensor_names(gguf, "Gemma 4", names, tensors)

    def groups() -> Iterator[dict[str, torch.Tensor]]:
        for group in by_layer(tensors):
            yield {names[n]: tensors.pop(n) for n in group}

    return config, groups()
