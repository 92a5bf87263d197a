"""GGUF files of the hybrid linear-attention Qwens, as llama.cpp's converter writes them, turned back into the HF
checkpoint :mod:`specray.models.qwen3_5` loads: Qwen3.5 (``general.architecture`` ``qwen35``), Qwen3.5-MoE
(``qwen35moe``) and Qwen3-Next (``qwen3next``). transformers' GGUF mapping that the loader uses for the other
families (``load_gguf_checkpoint``) maps none of the three (its newer one maps the two Qwen3.5s, but into its own
modules holding the packed blocks, not into dense tensors), so the config and every tensor are read here.

What the converter did, undone here:

* the stack's RMSNorms (``attn_norm``, ``post_attention_norm``, ``output_norm``, ``attn_q_norm``, ``attn_k_norm``)
  are stored as the ``1 + w`` they scale by; the linear layers' gated norm (``ssm_norm``) as is;
* ``A_log`` is stored as ``A = -exp(A_log)`` (``ssm_a``, no ``.weight`` suffix), ``dt_bias`` as ``ssm_dt.bias``;
* the causal conv's weight ``[C, 1, K]`` is squeezed to ``[C, K]`` (``ssm_conv1d``);
* Qwen3.5's projections keep their HF split (``attn_qkv``: ``in_proj_qkv``, ``attn_gate``: ``in_proj_z``,
  ``ssm_beta`` / ``ssm_alpha``: ``in_proj_b`` / ``in_proj_a``), but every tensor indexed by value head has its heads
  reordered from grouped by key head (``k0v0 k0v1 k1v0 k1v1``) to tiled (``k0v0 k1v0 k0v1 k1v1``): the value rows of
  ``attn_qkv`` and the conv, the rows of ``attn_gate``, ``ssm_beta``, ``ssm_alpha``, ``ssm_a``, ``ssm_dt`` and the
  columns of ``ssm_out``;
* Qwen3-Next's ``in_proj_qkvz`` (per key head: q, k, its value heads' v, their z) is split into ``attn_qkv`` (all q,
  all k, all v) and ``attn_gate`` (all z), its ``in_proj_ba`` kept as ``ssm_ba``; no head is reordered;
* the experts are stacked per kind (``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]``, or fused as
  ``ffn_gate_up_exps`` ``[E, 2I, H]``, gate rows first; ``ffn_down_exps`` ``[E, H, I]``), the shared expert and its
  gate named ``*_shexp``;
* the layers' kinds are one number, ``full_attention_interval`` (layer ``i`` attends in full when ``i + 1`` is a
  multiple of it); a multi-token-prediction block, where written, is counted in ``block_count``
  (``nextn_predict_layers``) and left out here.

The full-attention layers' ``attn_q`` keeps the output gate folded in (``[q_h, gate_h]`` per head), as the HF
checkpoint has it: nothing to undo. Tensors of any llama.cpp type are dequantized to float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import GGUFMeta, read_model_gguf, rope_parameters, tensors_by_layer

# llama.cpp's architecture -> the HF config class and architecture its files stand for
QWEN3_5_GGUF_ARCHS = {"qwen35": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
                      "qwen35moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
                      "qwen3next": ("Qwen3NextConfig", "Qwen3NextForCausalLM")}

# GGUF names -> HF names (after ``model.layers.{i}.``) of the tensors that need no more than a rename (and, the
# norms, the offset)
_PLAIN = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
          "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
          "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
          "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
          "ssm_norm.weight": "linear_attn.norm.weight"}
_OFFSET_NORMS = {"attn_norm.weight": "input_layernorm.weight",
                 "post_attention_norm.weight": "post_attention_layernorm.weight",
                 "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj", "ffn_down_exps.weight": "down_proj"}


def qwen3_5_gguf_config(get: GGUFMeta, names, vocab_size: int):
    """The HF text config of a ``qwen35`` / ``qwen35moe`` / ``qwen3next`` GGUF from what llama.cpp's converter
    writes: sizes, the linear layers' heads (``ssm.group_count``: key heads, ``ssm.time_step_rank``: value heads,
    ``ssm.state_size``: key head size, ``ssm.inner_size``: all value heads' width, ``ssm.conv_kernel``), the kinds of
    layers (``full_attention_interval``), partial RoPE (``rope.dimension_count`` of ``attention.key_length``),
    the experts' counts and widths."""
    import transformers

    arch = get.arch
    config_name, architecture = QWEN3_5_GGUF_ARCHS[arch]
    head_dim = int(get("attention.key_length", 0) or int(get("embedding_length")) // int(get("attention.head_count")))
    value_heads = int(get("ssm.time_step_rank"))
    layers = int(get("block_count")) - int(get("nextn_predict_layers", 0))
    interval = int(get("full_attention_interval", 4))
    rotated = int(get("rope.dimension_count", head_dim))
    rope = {**rope_parameters(get, None, rotated), "partial_rotary_factor": rotated / head_dim}
    sections = get("rope.dimension_sections", None)
    if sections:  # Qwen3.5's multimodal RoPE (time, height, width; padded to 4): for text the same as plain RoPE
        rope.update(mrope_section=[int(s) for s in sections[:3]], mrope_interleaved=True)
    fields = dict(
        architectures=[architecture], vocab_size=vocab_size, hidden_size=int(get("embedding_length")),
        num_hidden_layers=layers, num_attention_heads=int(get("attention.head_count")),
        num_key_value_heads=int(get("attention.head_count_kv")), head_dim=head_dim,
        max_position_embeddings=int(get("context_length")), rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        linear_conv_kernel_dim=int(get("ssm.conv_kernel")), linear_key_head_dim=int(get("ssm.state_size")),
        linear_num_key_heads=int(get("ssm.group_count")), linear_num_value_heads=value_heads,
        linear_value_head_dim=int(get("ssm.inner_size")) // value_heads, rope_parameters=rope,
        tie_word_embeddings="output.weight" not in names, **get.token_ids())
    if get("feed_forward_length", None):
        fields["intermediate_size"] = int(get("feed_forward_length"))
    if arch != "qwen35":
        fields.update(num_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
                      moe_intermediate_size=int(get("expert_feed_forward_length")),
                      shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length")))
    if arch == "qwen3next":  # llama.cpp's Qwen3-Next has experts on every layer
        fields.update(decoder_sparse_step=1, mlp_only_layers=[])
    return getattr(transformers, config_name)(**fields)


def _untile(t: torch.Tensor, dim: int, key_heads: int, per_key: int, size: int) -> torch.Tensor:
    """Value heads along ``dim`` (``size`` wide each) from llama.cpp's tiled order (head ``r * key_heads + k``) back to
    the HF checkpoint's, grouped by key head (``k * per_key + r``)."""
    shape = t.shape
    t = t.reshape(*shape[:dim], per_key, key_heads, size, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _qwen3_next_qkvz(qkv: torch.Tensor, z: torch.Tensor, config) -> torch.Tensor:
    """Qwen3-Next's ``in_proj_qkvz`` (per key head: its q, k, then its value heads' v and z) from llama.cpp's
    ``attn_qkv`` (all q, all k, all v) and ``attn_gate`` (all z)."""
    nk, hk = config.linear_num_key_heads, config.linear_key_head_dim
    v_width = config.linear_num_value_heads // nk * config.linear_value_head_dim
    q, k, v = qkv.split([nk * hk, nk * hk, nk * v_width])
    parts = [q.reshape(nk, hk, -1), k.reshape(nk, hk, -1), v.reshape(nk, v_width, -1), z.reshape(nk, v_width, -1)]
    return torch.cat(parts, 1).reshape(-1, qkv.shape[-1])


def _linear_tensors(t: dict[str, torch.Tensor], config, arch: str) -> dict[str, torch.Tensor]:
    """One linear-attention layer's tensors (GGUF names after ``blk.{i}.``, popped from ``t``) in the HF layout."""
    nk, per_key = config.linear_num_key_heads, config.linear_num_value_heads // config.linear_num_key_heads
    hv, qk_rows = config.linear_value_head_dim, 2 * config.linear_num_key_heads * config.linear_key_head_dim
    tiled = arch != "qwen3next"

    def heads(x: torch.Tensor, dim: int = 0, size: int = 1) -> torch.Tensor:
        return _untile(x, dim, nk, per_key, size) if tiled else x

    def values(x: torch.Tensor) -> torch.Tensor:  # the value rows after q and k
        return torch.cat([x[:qk_rows], heads(x[qk_rows:], size=hv)])

    qkv, z = values(t.pop("attn_qkv.weight")), heads(t.pop("attn_gate.weight"), size=hv)
    out = {"linear_attn.A_log": heads(torch.log(-t.pop("ssm_a"))), "linear_attn.dt_bias": heads(t.pop("ssm_dt.bias")),
           "linear_attn.conv1d.weight": values(t.pop("ssm_conv1d.weight")).unsqueeze(1),
           "linear_attn.out_proj.weight": heads(t.pop("ssm_out.weight"), 1, hv)}
    if arch == "qwen3next":
        out["linear_attn.in_proj_qkvz.weight"] = _qwen3_next_qkvz(qkv, z, config)
        out["linear_attn.in_proj_ba.weight"] = t.pop("ssm_ba.weight")
    else:
        out |= {"linear_attn.in_proj_qkv.weight": qkv, "linear_attn.in_proj_z.weight": z,
                "linear_attn.in_proj_b.weight": heads(t.pop("ssm_beta.weight")),
                "linear_attn.in_proj_a.weight": heads(t.pop("ssm_alpha.weight"))}
    return out


def _layer_tensors(t: dict[str, torch.Tensor], config, arch: str, gguf: Path, layer: int) -> dict[str, torch.Tensor]:
    """One layer's tensors (GGUF names after ``blk.{layer}.``) under HF names after ``model.layers.{layer}.``."""
    out = {}
    if config.layer_types[layer] == "linear_attention":
        out |= _linear_tensors(t, config, arch)
    if arch != "qwen35" and "ffn_gate_inp.weight" not in t:
        raise ValueError(f"GGUF {str(gguf)!r} has no experts in layer {layer} (no blk.{layer}.ffn_gate_inp.weight); "
                         f"a {arch} model has them on every layer. Pass the model's HF checkpoint instead")
    if "ffn_gate_up_exps.weight" in t:
        t["ffn_gate_exps.weight"], t["ffn_up_exps.weight"] = t.pop("ffn_gate_up_exps.weight").chunk(2, dim=1)
    for name, kind in _EXPERTS.items():
        if name in t:
            for e, expert in enumerate(t.pop(name)):
                out[f"mlp.experts.{e}.{kind}.weight"] = expert.contiguous()
    if "ffn_gate_inp_shexp.weight" in t:
        out["mlp.shared_expert_gate.weight"] = t.pop("ffn_gate_inp_shexp.weight").reshape(1, -1)
    for name in [n for n in t if n in _OFFSET_NORMS]:
        out[_OFFSET_NORMS[name]] = t.pop(name) - 1
    for name in [n for n in t if n in _PLAIN]:
        out[_PLAIN[name]] = t.pop(name)
    if t:
        raise ValueError(f"GGUF {str(gguf)!r} has tensors specray cannot place in a {arch} model: "
                         f"{sorted(f'blk.{layer}.{n}' for n in t)[:5]}; pass the model's HF checkpoint instead")
    return out


def qwen3_5_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """The HF config of a GGUF of ``arch`` (``qwen35``, ``qwen35moe`` or ``qwen3next``) and its tensors, a group
    (the embeddings and the head, then a layer) at a time, read as the groups are taken."""
    get, tensors = read_model_gguf(gguf, arch)
    config = qwen3_5_gguf_config(get, set(tensors), tensors.shape("token_embd.weight")[0])

    def groups() -> Iterator[dict[str, torch.Tensor]]:
        yield {"model.embed_tokens.weight": tensors.pop("token_embd.weight"),
               "model.norm.weight": tensors.pop("output_norm.weight") - 1,
               **({"lm_head.weight": tensors.pop("output.weight")} if "output.weight" in tensors else {})}
        for layer, layer_tensors in sorted(tensors_by_layer(tensors, gguf, arch).items()):
            if layer >= config.num_hidden_layers:  # the multi-token-prediction block: not loaded from a GGUF
                continue
            yield {f"model.layers.{layer}.{k}": v
                   for k, v in _layer_tensors(layer_tensors, config, arch, gguf, layer).items()}

    return config, groups()
