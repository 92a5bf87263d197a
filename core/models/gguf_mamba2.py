"""GGUF files of the Mamba-2 hybrids, as llama.cpp's converter writes them, turned back into the HF checkpoints
:mod:`specray.models.mamba_hybrid` loads: IBM's Granite 4.0 hybrids and Bamba (``general.architecture``
``granitehybrid``: the converter writes both under it), NVIDIA's Nemotron-H (``nemotron_h``; with experts, as
Nemotron 3 has them, ``nemotron_h_moe``) and TII's Falcon-H1 (``falcon-h1``). transformers' GGUF mapping
(``load_gguf_checkpoint``) maps none of them, so the config and every tensor are read here.

What the converter did, undone here:

* Mamba-2's ``A_log`` is stored as ``A = -exp(A_log)`` and ``D`` as is, both ``[heads, 1]`` (``ssm_a``, ``ssm_d``, no
  ``.weight`` suffix); ``dt_bias`` as ``ssm_dt.bias``; the causal conv's weight ``[C, 1, K]`` squeezed to ``[C, K]``
  (``ssm_conv1d``, its bias kept); the gated norm's weight reshaped to ``[groups, inner / groups]`` (``ssm_norm``:
  the grouping is the HF one, nothing else to undo); ``in_proj`` (z, x, B, C, dt rows) and ``out_proj`` kept whole
  (``ssm_in``, ``ssm_out``);
* the attention layers' ``q_proj`` / ``k_proj`` rows are permuted per head for llama.cpp's RoPE (the halves of each
  head interleaved, over all of it) -- also where the model attends without RoPE (Granite 4.0's, Nemotron-H's);
* the kinds of layers are per-layer arrays: ``attention.head_count_kv`` (0 but for an attention layer) and,
  Nemotron-H's, ``feed_forward_length`` (0 but for an MLP layer: a layer with neither is a Mamba-2 layer);
* Granite's: its multipliers as ``embedding_scale``, ``residual_scale``, ``attention.scale`` and ``logit_scale`` (one
  not written -- Bamba's -- is llama.cpp's default: 1, or ``1/sqrt(head_dim)`` for the attention's); its experts'
  fused ``input_linear`` ``[E, 2I, H]`` split into ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]`` (gate rows
  first), ``output_linear`` as ``ffn_down_exps``, the router as ``ffn_gate_inp``, the shared MLP's fused
  ``input_linear`` split into ``ffn_gate_shexp`` / ``ffn_up_shexp`` (into ``ffn_gate`` / ``ffn_up``, its
  ``output_linear`` into ``ffn_down``, in the dense releases, which have no experts); whether the attention rotates
  (``rope.scaling.finetuned``: only Bamba's does, over ``rope.dimension_count`` of each head; a Granite 4.0 hybrid
  written by the converter never does, whatever its config said) -- a file that rotates is read as Bamba, whose MLP
  (``ffn_gate`` / ``ffn_up`` / ``ffn_down``) is its ``feed_forward``;
* Nemotron-H's head size as ``attention.key_length``, its norms' epsilon as ``attention.layer_norm_epsilon``; with
  experts, a layer of experts is marked by ``feed_forward_length`` (the experts' width; a dense MLP layer, which
  Nemotron 3 has none of, is not marked), its router as ``ffn_gate_inp``, the router's score bias as
  ``exp_probs_b.bias``, the experts stacked per kind (``ffn_up_exps`` / ``ffn_down_exps``, ``[E, ...]``), the shared
  expert as ``ffn_up_shexp`` / ``ffn_down_shexp``, the latent projections (Nemotron 3 Super's) as
  ``ffn_latent_down`` / ``ffn_latent_up``, the routing as ``expert_*`` (count, used, widths, shared count, norm,
  scale, groups and groups used) and ``moe_latent_size``;
* Falcon-H1's: every layer has attention beside its mixer, then an MLP (``ffn_gate`` / ``ffn_up`` / ``ffn_down``);
  its muP multipliers are folded into the weights (embedding, LM head, q/k/v/o, the MLP's gate and down, the mixer's
  out_proj and in_proj, whose z / x / B / C / dt rows each by its own): the config read back has them all 1, and the
  weights as the file has them; its q/k rows are not permuted (llama.cpp rotates them as HF does); no ``ssm_norm``
  where the release has no gated norm (``mamba_rms_norm`` false). A tied Falcon-H1's LM head is its scaled embedding
  in the file (the converter cannot scale a head it does not write), as llama.cpp runs it.

The vocabulary the converter pads to a multiple of 8 with unused tokens is left so (the embedding has the model's
rows). Tensors of any llama.cpp type are dequantized to float32. A multi-token-prediction block (the converter leaves
it out) and Jamba (``jamba``, Mamba-1) are not read here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import GGUFMeta, GGUFTensors, read_gguf, tensors_by_layer

# llama.cpp's architecture -> the families its files stand for
MAMBA2_GGUF_ARCHS = {"granitehybrid": "Granite 4.0 hybrid / Bamba", "nemotron_h": "Nemotron-H",
                     "nemotron_h_moe": "Nemotron-H MoE / Nemotron 3", "falcon-h1": "Falcon-H1"}

# a Mamba-2 mixer's GGUF tensors (after ``blk.{i}.``) that need no more than a rename -> HF names (after the mixer's
# prefix)
_MIXER = {"ssm_in.weight": "in_proj.weight", "ssm_in.bias": "in_proj.bias", "ssm_conv1d.bias": "conv1d.bias",
          "ssm_dt.bias": "dt_bias", "ssm_out.weight": "out_proj.weight", "ssm_out.bias": "out_proj.bias"}
_ATTENTION = {"attn_v.weight": "v_proj.weight", "attn_output.weight": "o_proj.weight", "attn_v.bias": "v_proj.bias",
              "attn_output.bias": "o_proj.bias"}


def _common(get: GGUFMeta, vocab_size: int, names) -> dict[str, Any]:
    """The config fields every family here shares: sizes, attention heads, the Mamba-2 mixers', tokens."""
    layers = int(get("block_count"))
    heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    return dict(vocab_size=vocab_size, hidden_size=int(get("embedding_length")), num_hidden_layers=layers,
                num_attention_heads=int(get("attention.head_count")),
                num_key_value_heads=max(get.per_layer("attention.head_count_kv", layers)),
                max_position_embeddings=int(get("context_length")), tie_word_embeddings="output.weight" not in names,
                **get.token_ids(), _heads=heads, _head_dim=inner // heads, _groups=int(get("ssm.group_count")),
                _state=int(get("ssm.state_size")), _conv=int(get("ssm.conv_kernel")), _inner=inner)


def _rms_eps(get: GGUFMeta) -> float:
    eps = get("attention.layer_norm_rms_epsilon", None)
    return float(eps if eps is not None else get("attention.layer_norm_epsilon"))


def _granite_config(get: GGUFMeta, vocab_size: int, names):
    """A ``granitehybrid`` file's config: a Granite 4.0 hybrid's (GraniteMoeHybridConfig), or Bamba's (BambaConfig)
    where the attention rotates."""
    import transformers

    c = _common(get, vocab_size, names)
    layers, hidden, heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
    kv = get.per_layer("attention.head_count_kv", layers)
    attention = [i for i in range(layers) if kv[i] > 0]
    head_dim = hidden // heads
    if c["_inner"] % hidden or c["_inner"] // hidden * hidden != c["_heads"] * c["_head_dim"]:
        raise ValueError(f"GGUF {str(get.gguf)!r} has granitehybrid.ssm.inner_size={c['_inner']}, not a multiple of "
                         f"its embedding_length {hidden} that its {c['_heads']} heads divide; pass the model's HF "
                         "checkpoint instead")
    mamba = dict(mamba_n_heads=c["_heads"], mamba_d_head=c["_head_dim"], mamba_n_groups=c["_groups"],
                 mamba_d_state=c["_state"], mamba_d_conv=c["_conv"], mamba_expand=c["_inner"] // hidden,
                 mamba_conv_bias=any(n.endswith(".ssm_conv1d.bias") for n in names),
                 mamba_proj_bias=any(n.endswith(".ssm_in.bias") for n in names))
    fields = {k: v for k, v in c.items() if not k.startswith("_")}
    fields.update(rms_norm_eps=_rms_eps(get), intermediate_size=int(get("feed_forward_length")), **mamba,
                  attention_bias=any(n.endswith(".attn_q.bias") for n in names))
    rotates = bool(get("rope.scaling.finetuned", False))
    experts = int(get("expert_count", 0) or 0)
    multipliers = {k: get(key, None) for k, key in (("embedding_multiplier", "embedding_scale"),
                                                      ("residual_multiplier", "residual_scale"),
                                                      ("attention_multiplier", "attention.scale"),
                                                      ("logits_scaling", "logit_scale"))}
    rope = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    if rotates and not experts and all(v is None for v in multipliers.values()):  # Bamba
        rotated = int(get("rope.dimension_count", head_dim))
        if rotated * 2 != head_dim:
            raise ValueError(f"GGUF {str(get.gguf)!r} rotates {rotated} of each head's {head_dim} dims "
                             "(granitehybrid.rope.dimension_count); specray reads a rotating granitehybrid GGUF as "
                             "Bamba, which rotates half. Pass the model's HF checkpoint instead")
        return transformers.BambaConfig(**fields, attn_layer_indices=attention, architectures=["BambaForCausalLM"],
                                        rope_parameters={**rope, "partial_rotary_factor": 0.5})
    if rotates and int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"GGUF {str(get.gguf)!r} rotates part of each Granite head (granitehybrid.rope."
                         "dimension_count); Granite 4.0's hybrids rotate all of it or none. Pass the model's HF "
                         "checkpoint instead")
    shared = get("expert_shared_feed_forward_length", None)
    if shared is None:  # the dense releases' MLP (ffn_gate), or the MoE's shared one (ffn_gate_shexp)
        gate = next((names[n] for n in names if n.endswith((".ffn_gate.weight", ".ffn_gate_shexp.weight"))), None)
        shared = gate[0] if gate else fields["intermediate_size"]
    defaults = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0,
                "attention_multiplier": head_dim ** -0.5}  # llama.cpp's where the file has none
    fields.update({k: float(v if v is not None else defaults[k]) for k, v in multipliers.items()})
    fields.update(num_local_experts=experts, shared_intermediate_size=int(shared),
                  position_embedding_type="rope" if rotates else "nope", rope_parameters=rope,
                  layer_types=["full_attention" if i in attention else "linear_attention" for i in range(layers)],
                  architectures=["GraniteMoeHybridForCausalLM"])
    if experts:
        fields["num_experts_per_tok"] = int(get("expert_used_count"))
    return transformers.GraniteMoeHybridConfig(**fields)


def _nemotron_h_config(get: GGUFMeta, vocab_size: int, names):
    """A ``nemotron_h`` / ``nemotron_h_moe`` file's config (NemotronHConfig): each layer a Mamba-2 mixer, attention,
    or a squared-ReLU MLP (``nemotron_h``) or experts (``nemotron_h_moe``: its dense MLPs, had it any, the converter
    does not mark)."""
    import transformers

    c = _common(get, vocab_size, names)
    layers, moe = c["num_hidden_layers"], get.arch == "nemotron_h_moe"
    kv, ff = get.per_layer("attention.head_count_kv", layers), get.per_layer("feed_forward_length", layers)
    kinds = ["full_attention" if kv[i] else ("moe" if moe else "mlp") if ff[i] else "linear_attention"
             for i in range(layers)]
    fields = {k: v for k, v in c.items() if not k.startswith("_") and k != "num_hidden_layers"}
    if moe:  # the experts' counts, widths, routing (sigmoid scores, grouped: fixed in llama.cpp) and latent width
        fields.update(n_routed_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
                      moe_intermediate_size=int(get("expert_feed_forward_length")),
                      moe_shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length")),
                      n_shared_experts=int(get("expert_shared_count", 1)),
                      norm_topk_prob=bool(get("expert_weights_norm", False)),
                      routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
                      n_group=int(get("expert_group_count", 1)), topk_group=int(get("expert_group_used_count", 1)),
                      moe_latent_size=get("moe_latent_size", None))
    else:
        fields["intermediate_size"] = max(ff) or 1
    fields.update(layers_block_type=kinds, layer_norm_epsilon=_rms_eps(get),
                  head_dim=int(get("attention.key_length", c["hidden_size"] // c["num_attention_heads"])),
                  mamba_num_heads=c["_heads"], mamba_head_dim=c["_head_dim"], n_groups=c["_groups"],
                  ssm_state_size=c["_state"], conv_kernel=c["_conv"],
                  use_conv_bias=any(n.endswith(".ssm_conv1d.bias") for n in names),
                  mamba_proj_bias=any(n.endswith(".ssm_in.bias") for n in names),
                  attention_bias=any(n.endswith(".attn_q.bias") for n in names),
                  mlp_bias=any(n.endswith(".ffn_up.bias") for n in names), architectures=["NemotronHForCausalLM"])
    return transformers.NemotronHConfig(**fields)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows (``heads`` heads) from llama.cpp's RoPE order (each head's halves interleaved) back to HF's."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _mixer(t: dict[str, torch.Tensor], prefix: str, norm: bool = True) -> dict[str, torch.Tensor]:
    """A Mamba-2 mixer's tensors (GGUF names after ``blk.{i}.``, popped from ``t``) under HF names after ``prefix``
    (its gated ``norm``: Falcon-H1's may have none)."""
    out = {prefix + "A_log": torch.log(-t.pop("ssm_a").reshape(-1)), prefix + "D": t.pop("ssm_d").reshape(-1),
           prefix + "conv1d.weight": t.pop("ssm_conv1d.weight").unsqueeze(1)}
    if norm:
        out[prefix + "norm.weight"] = t.pop("ssm_norm.weight").reshape(-1)
    for name in [n for n in t if n in _MIXER]:
        out[prefix + _MIXER[name]] = t.pop(name)
    return out


def _attention(t: dict[str, torch.Tensor], prefix: str, config, permuted: bool = True) -> dict[str, torch.Tensor]:
    """An attention layer's tensors (popped from ``t``) under HF names after ``prefix``, q and k rows unpermuted
    (where the converter ``permuted`` them)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    out = {}
    for kind, n in (("q", heads), ("k", kv_heads)):
        for part in ("weight", "bias"):
            if f"attn_{kind}.{part}" in t:
                w = t.pop(f"attn_{kind}.{part}")
                out[f"{prefix}{kind}_proj.{part}"] = _unpermute(w, n) if permuted else w
    for name in [n for n in t if n in _ATTENTION]:
        out[prefix + _ATTENTION[name]] = t.pop(name)
    return out


def _granite_layer(t: dict[str, torch.Tensor], config, layer: int) -> dict[str, torch.Tensor]:
    """One ``granitehybrid`` layer's tensors (GGUF names after ``blk.{layer}.``) under HF names after
    ``model.layers.{layer}.``."""
    bamba = config.model_type == "bamba"
    out = {"input_layernorm.weight": t.pop("attn_norm.weight"),
           ("pre_ff_layernorm.weight" if bamba else "post_attention_layernorm.weight"): t.pop("ffn_norm.weight")}
    if "ssm_a" in t:
        out |= _mixer(t, "mamba.")
    else:
        out |= _attention(t, "self_attn.", config)
    if bamba:
        out |= {f"feed_forward.{kind}_proj.weight": t.pop(f"ffn_{kind}.weight") for kind in ("gate", "up", "down")}
        return out
    if "ffn_gate_inp.weight" in t:
        out["block_sparse_moe.router.layer.weight"] = t.pop("ffn_gate_inp.weight")
        out["block_sparse_moe.input_linear.weight"] = torch.cat([t.pop("ffn_gate_exps.weight"),
                                                                 t.pop("ffn_up_exps.weight")], 1)
        out["block_sparse_moe.output_linear.weight"] = t.pop("ffn_down_exps.weight")
    shared = "_shexp" if "ffn_gate_shexp.weight" in t else ""
    out["shared_mlp.input_linear.weight"] = torch.cat([t.pop(f"ffn_gate{shared}.weight"),
                                                       t.pop(f"ffn_up{shared}.weight")])
    out["shared_mlp.output_linear.weight"] = t.pop(f"ffn_down{shared}.weight")
    return out


def _nemotron_h_layer(t: dict[str, torch.Tensor], config, layer: int) -> dict[str, torch.Tensor]:
    """One ``nemotron_h`` layer's tensors under HF names after ``backbone.layers.{layer}.``."""
    out = {"norm.weight": t.pop("attn_norm.weight")}
    kind = config.layers_block_type[layer]
    if kind == "linear_attention":
        out |= _mixer(t, "mixer.")
    elif kind == "full_attention":
        out |= _attention(t, "mixer.", config)
    elif kind == "moe":  # the router and its score bias, the stacked experts, the shared one, the latent projections
        out |= {"mixer.gate.weight": t.pop("ffn_gate_inp.weight"),
                "mixer.gate.e_score_correction_bias": t.pop("exp_probs_b.bias")}
        for k in ("up", "down"):
            out |= {f"mixer.experts.{e}.{k}_proj.weight": w.contiguous()
                    for e, w in enumerate(t.pop(f"ffn_{k}_exps.weight"))}
            out[f"mixer.shared_experts.{k}_proj.weight"] = t.pop(f"ffn_{k}_shexp.weight")
        for gguf_name, hf_name in (("ffn_latent_down", "fc1_latent_proj"), ("ffn_latent_up", "fc2_latent_proj")):
            if f"{gguf_name}.weight" in t:
                out[f"mixer.{hf_name}.weight"] = t.pop(f"{gguf_name}.weight")
    else:
        out |= {f"mixer.{k}_proj.{part}": t.pop(f"ffn_{k}.{part}") for k in ("up", "down")
                for part in ("weight", "bias") if f"ffn_{k}.{part}" in t}
    return out


def _falcon_h1_config(get: GGUFMeta, vocab_size: int, names):
    """A ``falcon-h1`` file's config (FalconH1Config): every layer attention and a Mamba-2 mixer side by side, then a
    SwiGLU MLP. The converter folds every muP multiplier into the weights (the embedding's, the LM head's, the
    attention's in / key / out, the SSM's in / out and its in_proj's five parts, the MLP's gate / down): they are 1
    here."""
    import transformers

    c = _common(get, vocab_size, names)
    fields = {k: v for k, v in c.items() if not k.startswith("_")}
    fields.update(intermediate_size=int(get("feed_forward_length")), rms_norm_eps=_rms_eps(get),
                  head_dim=int(get("attention.key_length", c["hidden_size"] // c["num_attention_heads"])),
                  rope_parameters={"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))},
                  mamba_d_ssm=c["_inner"], mamba_n_heads=c["_heads"], mamba_d_head=c["_head_dim"],
                  mamba_n_groups=c["_groups"], mamba_d_state=c["_state"], mamba_d_conv=c["_conv"],
                  mamba_rms_norm=any(n.endswith(".ssm_norm.weight") for n in names), mamba_norm_before_gate=False,
                  mamba_conv_bias=any(n.endswith(".ssm_conv1d.bias") for n in names),
                  mamba_proj_bias=any(n.endswith(".ssm_in.bias") for n in names),
                  attention_bias=any(n.endswith(".attn_q.bias") for n in names),
                  mlp_bias=any(n.endswith(".ffn_up.bias") for n in names),
                  projectors_bias=any(n.endswith(".ssm_out.bias") for n in names),
                  lm_head_multiplier=1.0, embedding_multiplier=1.0, mlp_multipliers=[1.0, 1.0], key_multiplier=1.0,
                  attention_out_multiplier=1.0, attention_in_multiplier=1.0, ssm_multipliers=[1.0] * 5,
                  ssm_in_multiplier=1.0, ssm_out_multiplier=1.0, architectures=["FalconH1ForCausalLM"])
    return transformers.FalconH1Config(**fields)


def _falcon_h1_layer(t: dict[str, torch.Tensor], config, layer: int) -> dict[str, torch.Tensor]:
    """One ``falcon-h1`` layer's tensors under HF names after ``model.layers.{layer}.`` (its attention's q/k rows are
    not permuted: llama.cpp rotates Falcon-H1's as HF does)."""
    # (gguf-py's name map gives the pre-MLP norm no ``.weight`` suffix: "model.layers.{bid}.pre_ff_layernorm.weight"
    # is one of its keys; files written with a fixed map would have it)
    ffn_norm = t.pop("ffn_norm.weight") if "ffn_norm.weight" in t else t.pop("ffn_norm")
    out = {"input_layernorm.weight": t.pop("attn_norm.weight"), "pre_ff_layernorm.weight": ffn_norm}
    out |= _mixer(t, "mamba.", norm="ssm_norm.weight" in t) | _attention(t, "self_attn.", config, permuted=False)
    out |= {f"feed_forward.{k}_proj.{part}": t.pop(f"ffn_{k}.{part}") for k in ("gate", "up", "down")
            for part in ("weight", "bias") if f"ffn_{k}.{part}" in t}
    return out


# llama.cpp's architecture -> (its config, one layer's tensors, the HF names of the embedding, final norm and layers)
_FAMILIES = {"granitehybrid": (_granite_config, _granite_layer, "model."),
             "nemotron_h": (_nemotron_h_config, _nemotron_h_layer, "backbone."),
             "nemotron_h_moe": (_nemotron_h_config, _nemotron_h_layer, "backbone."),
             "falcon-h1": (_falcon_h1_config, _falcon_h1_layer, "model.")}


def mamba2_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """The HF config of a GGUF of ``arch`` (``granitehybrid``, ``nemotron_h``, ``nemotron_h_moe`` or
    ``falcon-h1``) and its tensors, a group (the embeddings and the head, then a layer) at a time, read as the
    groups are taken. What can be checked without reading a tensor is checked before this returns."""
    meta, tensors = read_gguf(gguf)
    if "token_embd.weight" not in tensors or "output_norm.weight" not in tensors:
        raise ValueError(f"GGUF {str(gguf)!r} has no token_embd.weight or output_norm.weight; pass a complete {arch} "
                         "GGUF")
    make_config, make_layer, base = _FAMILIES[arch]
    config = make_config(GGUFMeta(meta, arch, gguf), tensors.shape("token_embd.weight")[0],
                         {n: tensors.shape(n) for n in tensors})
    embed, norm = ("embeddings", "norm_f") if arch.startswith("nemotron_h") else \
        ("embed_tokens", "final_layernorm" if config.model_type in ("bamba", "falcon_h1") else "norm")
    head = {f"{base}{embed}.weight": "token_embd.weight", f"{base}{norm}.weight": "output_norm.weight"}
    head |= {f"lm_head.{part}": f"output.{part}" for part in ("weight", "bias") if f"output.{part}" in tensors}
    head_tensors = tensors.split(head.values())
    per_layer = tensors_by_layer(tensors, gguf, arch)
    beyond = sorted(layer for layer in per_layer if layer >= config.num_hidden_layers)
    if beyond:
        raise ValueError(f"GGUF {str(gguf)!r} has a tensor of layer {beyond[0]} (blk.{beyond[0]}.*) beyond its "
                         f"{config.num_hidden_layers} layers, which specray cannot place in a {arch} model; pass the "
                         "model's HF checkpoint instead")

    def groups() -> Iterator[dict[str, torch.Tensor]]:
        yield {name: head_tensors.pop(gguf_name) for name, gguf_name in head.items()}
        for layer in range(config.num_hidden_layers):
            t = per_layer.get(layer, GGUFTensors({}))
            try:
                layer_tensors = make_layer(t, config, layer)
            except KeyError as err:
                raise ValueError(f"GGUF {str(gguf)!r} lacks blk.{layer}.{err.args[0]}, which a {arch} layer of its "
                                 "kind has; convert the model again with a current llama.cpp, or pass its HF "
                                 "checkpoint") from None
            if t:
                raise ValueError(f"GGUF {str(gguf)!r} has tensors specray cannot place in a {arch} model: "
                                 f"{sorted(f'blk.{layer}.{n}' for n in t)[:5]}; pass the model's HF checkpoint "
                                 "instead")
            yield {f"{base}layers.{layer}.{k}": v for k, v in layer_tensors.items()}
            del layer_tensors  # this layer's tensors are the writer's now: not held while the next one is read

    return config, groups()
