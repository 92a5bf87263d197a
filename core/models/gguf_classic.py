"""GGUF files of the classic GPT families, as llama.cpp's converter writes them, turned back into the HF checkpoints
specray loads for them: GPT-2 (``gpt2``: :mod:`specray.models.gpt2`), StableLM (``stablelm``:
:mod:`specray.models.stablelm`), Phi-1 / 1.5 / 2 (``phi2``: :mod:`specray.models.phi`), Falcon's RoPE releases
(``falcon``: :mod:`specray.models.falcon`), GPT-NeoX / Pythia (``gptneox``: :mod:`specray.models.gpt_neox`), BLOOM
(``bloom``: :mod:`specray.models.bloom`), MPT (``mpt``: :mod:`specray.models.mpt`), GPT-BigCode / StarCoder
(``starcoder``: :mod:`specray.models.gpt_bigcode`) and DBRX (``dbrx``: :mod:`specray.models.dbrx`). transformers' GGUF
mapping has no Phi-2, GPT-NeoX, MPT, StarCoder or DBRX; of the others it leaves Falcon's q/k/v in the converter's order
(and its 40B layout unread), StableLM 2 12B's per-head q/k norms out and GPT-2's config without what specray's
conversion reads of it, so the config and every tensor are read here.

What the converter writes, read back here:

* the sizes (``embedding_length``, ``block_count``, ``attention.head_count``, ``attention.head_count_kv`` where it
  writes one: StableLM, Phi-2, Falcon, BLOOM, StarCoder, MPT where its config names ``kv_n_heads``; GPT-2's,
  GPT-NeoX's, BLOOM's and MPT's attention has a KV head per query head, and a file saying fewer is refused), the
  LayerNorms' epsilon (``attention.layer_norm_epsilon``), the context (``context_length``; GPT-2's and StarCoder's:
  their position table's rows); the MLP's width from ``ffn_up``'s rows (GPT-2's, Phi-2's, Falcon's, BLOOM's, MPT's
  and StarCoder's converters write 4 x the model's width as ``feed_forward_length``, whatever the checkpoint's);
* RoPE over a head's first ``rope.dimension_count`` features (StableLM, Phi-2, GPT-NeoX; Falcon rotates whole heads)
  at the base of ``rope.freq_base``, which none of these converters writes: llama.cpp's default, 10000, the releases'
  own; no row is reordered for it (llama.cpp rotates these as HF does, by halves);
* biases by their tensors' presence (StableLM's q/k/v, Falcon's, GPT-NeoX's attention's, MPT's); the LM head tied
  where the file has no ``output``;
* GPT-2's ``Conv1D`` weights (``c_attn``, ``c_proj``, ``c_fc``), which the converter transposes, transposed back;
* StableLM: its per-head q/k LayerNorms (StableLM 2 12B), stacked by the converter into ``attn_q_norm`` /
  ``attn_k_norm`` [heads, head_dim], one per head again; the layers parallel (StableLM 2 12B's one norm for both
  blocks) where they have no ``ffn_norm``, as llama.cpp decides (its ``use_parallel_residual`` key, True where a
  release's config says nothing, is not read);
* Phi-2: q/k/v as three tensors (``PhiForCausalLM``'s layout) or fused in ``attn_qkv`` (Microsoft's first layout's
  ``Wqkv``: q, k, v rows in turn), split; its LM head's bias;
* Falcon: the fused q/k/v, which the converter reorders from the release's KV head by KV head (each KV head's
  queries, then its key and value) into all queries, all keys, all values (``tensor_data_layout`` ``jploski``; a
  file naming another layout is refused), put back. The layout from the norms and KV heads: a second norm per layer
  (``attn_norm_2``) is the 40B / 180B layout (``new_decoder_architecture``, a norm each for attention and MLP); one
  KV head and one norm, Falcon-7B's (``multi_query``); more KV heads and one norm, Falcon 2's. llama.cpp runs every
  Falcon file with parallel attention and MLP, so do these configs;
* GPT-NeoX: the fused q/k/v, which the converter reorders from the release's head by head (each head's q, k, v)
  into all queries, all keys, all values, put back; ``use_parallel_residual``;
* BLOOM: the fused q/k/v, reordered by the converter as GPT-NeoX's (the release's head by head into all queries, all
  keys, all values), put back; the embeddings' LayerNorm (``token_embd_norm``: the converter strips ``transformer.``
  from BLOOM's names before gguf-py's map, which knows ``word_embeddings_layernorm`` only so); the context where it
  is not the converter's stand-in for a config without ``seq_length`` (the width: then unset, specray's default);
* MPT: ``Wqkv`` (q, k, v rows in turn, as the converter leaves it); ALiBi's ``attention.max_alibi_bias``
  (``alibi_bias_max``), ``attention.clamp_kqv`` (``clip_qkv``) where written, ``expansion_ratio`` from the MLP's
  width. What specray's MPT does not serve (no release has it) is refused: learned positions (the converter's
  ``max_alibi_bias`` 0, ``position_embd``), q/k LayerNorms (``attn_q_norm`` / ``attn_k_norm``: ``qk_ln``), grouped
  KV heads;
* StarCoder: ``c_attn`` as the release stores it (the converter reorders nothing). The converter writes
  ``head_count_kv`` 1 whatever the model, so multi-query attention is read from ``c_attn``'s rows: the width and
  one key and value head (``multi_query``: every release), or three times the width (a KV head per query head, each
  head's q, k, v in turn: a file llama.cpp's loader refuses, sizing the tensor for one KV head; read here as the
  release's); a ``head_count_kv`` of neither 1 nor the heads is refused;
* DBRX: ``Wqkv`` as the converter leaves it (``attn_qkv``: q, k, v rows in turn) over ``head_count_kv`` KV heads, the
  clamp of q, k and v (``attention.clamp_kqv``: ``attn_config.clip_qkv``; 0 none, as llama.cpp reads it), the RoPE
  base the converter takes from ``attn_config.rope_theta`` (``rope.freq_base``: the releases' 500000, set as both
  ``attn_config.rope_theta`` and ``rope_parameters``' base: specray's DBRX reads the one, transformers 5's the other),
  the experts' count, top k and width (``expert_count``, ``expert_used_count``, ``ffn_gate_exps``' rows); its
  LayerNorms' epsilon must be 1e-5 (DBRX's config names none: ``nn.LayerNorm``'s default, which the converter writes)
  and its head is never tied (a file without ``output`` is refused, as llama.cpp's loader and transformers' config
  refuse one). The experts the release fuses per layer, ``w1`` (gate), ``v1`` (up) and ``w2`` (down's transpose), each
  [experts * width, hidden], which the converter views as [experts, width, hidden] (``w2`` permuted to [experts,
  hidden, width]: the down projections) and writes as ``ffn_gate_exps``, ``ffn_up_exps`` and ``ffn_down_exps``, are
  fused back;
* GPT-J (``gptj``: :mod:`specray.models.gptj`): llama.cpp has the architecture's tensor names but no converter and no
  graph for it (its RoPE type for ``gptj`` is none), so a file is read as gguf-py's map names the release's tensors,
  nothing reordered (q/k rows in the release's interleaved-pair order): ``rope.dimension_count`` as ``rotary_dim``
  (the whole head where unwritten), a base other than GPT-J's 10000 or any scaling refused, a KV head per query head,
  the head untied with its bias (``output.bias``; a file without ``output`` refused).

What no key carries is set as the releases have it and llama.cpp's graph computes it: the MLP's activation (GPT-2's,
Phi-2's, BLOOM's and StarCoder's tanh GELU, Falcon's, Pythia's and MPT's exact one; llama.cpp computes each by the
tanh approximation), StableLM's gated SiLU; the scores scaled by 1 / sqrt(head size) (MPT's ``softmax_scale`` and
StarCoder's ``scale_attn_weights``, which a checkpoint may set otherwise though no release does, are not written:
such a file loads as llama.cpp runs it); BLOOM's residual the block's input
(``apply_residual_connection_post_layernorm`` is not written and llama.cpp's graph takes the stream: a checkpoint
setting it, which no release does, loads as llama.cpp runs it, not as the checkpoint); MPT's logits unscaled
(``logit_scale``); DBRX's SwiGLU experts (``ffn_act_fn`` SiLU) and their routing weights divided by their sum
(``moe_normalize_expert_weights`` 1, every release's: llama.cpp renormalizes the top k whatever a checkpoint's p-norm).

Tensors of any llama.cpp type are dequantized to float32 here; the conversion keeps the integers of those
:mod:`specray.models.gguf_quant` finds again, a layer's linears (``layers.N``, ``h.N``, ``blocks.N``), but GPT-2's:
its model takes ``Conv1D`` weights, [in, out], so their converted tensors are the file's transposed, whose rows are no
rows of the file (a quantized row's groups run along its inputs, which a transposed weight's columns are not), and a
quantized GPT-2 file's linears are stored and loaded dense (their values the file's, exactly). The fused q/k/v of
Falcon, GPT-NeoX, BLOOM, MPT and StarCoder keep their integers on disk and are dequantized as the model splits them
at load (a device keeping 4-bit weights keeps the attention's output and the MLP in 4 bits, q/k/v dense). DBRX keeps
its routers' integers alone: its attention's names (``norm_attn_norm.attn.*``) are not of the names kept, and its
fused experts are stored as the release fuses them, ``w2`` transposed (no rows of the file), all dense.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import (GGUFMeta, GGUFTensors, as_written, check_tensor_names, converted_groups,
                                      gguf_names, read_model_gguf, rope_parameters)

CLASSIC_GGUF_ARCHS = ("gpt2", "stablelm", "phi2", "falcon", "gptneox", "bloom", "mpt", "starcoder", "dbrx", "gptj")
_GPTJ_ROPE_BASE = 10000.0  # GPT-J's (its config names none)
_FALCON_LAYOUT = "jploski"  # the converter's name for its q/k/v order (all queries, all keys, all values)
_GPT2_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def _refuse(get: GGUFMeta, what: str) -> ValueError:
    return ValueError(f"GGUF {str(get.gguf)!r} {what}; pass the model's HF checkpoint instead")


def _heads(get: GGUFMeta, one_kv_per_head: bool) -> tuple[int, int, int]:
    """(query heads, KV heads, head size); a family whose attention has a KV head per query head (GPT-2, GPT-NeoX)
    refuses a file with fewer."""
    heads = int(get("attention.head_count"))
    kv = int(get("attention.head_count_kv", heads))
    if one_kv_per_head and kv != heads:
        raise _refuse(get, f"has {get.arch}.attention.head_count_kv={kv} for {heads} query heads; {get.arch}'s "
                           "attention has one KV head per query head")
    if not 0 < kv <= heads or heads % kv:
        raise _refuse(get, f"has {get.arch}.attention.head_count_kv={kv} for {heads} query heads, not a whole number "
                           "of query heads per KV head")
    return heads, kv, int(get("embedding_length")) // heads


def _rope(get: GGUFMeta, head_dim: int) -> dict[str, Any]:
    """The RoPE over a head's first ``rope.dimension_count`` features (all where it is not written, as llama.cpp
    rotates them), the share always set: StableLM's and GPT-NeoX's configs default to a quarter."""
    rotated = int(get("rope.dimension_count", head_dim))
    return {**rope_parameters(get, None, rotated), "partial_rotary_factor": rotated / head_dim}


def _common(get: GGUFMeta, tensors: GGUFTensors) -> dict[str, Any]:
    """The vocabulary, the special tokens, the LM head's tying."""
    return {"vocab_size": tensors.shape("token_embd.weight")[0], "tie_word_embeddings": "output.weight" not in tensors,
            **get.token_ids()}


def _ffn(get: GGUFMeta, tensors: GGUFTensors) -> int:
    """The MLP's width: ``ffn_up``'s rows (the key some converters write is 4 x the model's width, whatever it is)."""
    return _shape(get, tensors, "blk.0.ffn_up.weight")[0]


def _shape(get: GGUFMeta, tensors: GGUFTensors, name: str) -> tuple[int, ...]:
    if name not in tensors:
        raise ValueError(f"GGUF {str(get.gguf)!r} has no {name}, which llama.cpp's converter writes for every "
                         f"{get.arch} model; convert the model again with a current llama.cpp, or pass its HF "
                         "checkpoint")
    return tensors.shape(name)


def _eps(get: GGUFMeta) -> float:
    return as_written(get("attention.layer_norm_epsilon"))


# ---------------------------------------------------------------------------------------------- configs


def _gpt2_config(get: GGUFMeta, tensors: GGUFTensors):
    from transformers import GPT2Config

    heads, _, _ = _heads(get, one_kv_per_head=True)
    positions = _shape(get, tensors, "position_embd.weight")[0]
    return GPT2Config(architectures=["GPT2LMHeadModel"], n_positions=positions, n_embd=int(get("embedding_length")),
                      n_layer=get.model_layers(), n_head=heads, n_inner=_ffn(get, tensors),
                      activation_function="gelu_new", layer_norm_epsilon=_eps(get), **_common(get, tensors))


def _stablelm_config(get: GGUFMeta, tensors: GGUFTensors):
    from transformers import StableLmConfig

    heads, kv, head_dim = _heads(get, one_kv_per_head=False)
    return StableLmConfig(architectures=["StableLmForCausalLM"], hidden_size=int(get("embedding_length")),
                          intermediate_size=_ffn(get, tensors), num_hidden_layers=get.model_layers(),
                          num_attention_heads=heads, num_key_value_heads=kv, hidden_act="silu",
                          max_position_embeddings=int(get("context_length")), layer_norm_eps=_eps(get),
                          rope_parameters=_rope(get, head_dim), use_qkv_bias="blk.0.attn_q.bias" in tensors,
                          qk_layernorm="blk.0.attn_q_norm.weight" in tensors,
                          use_parallel_residual="blk.0.ffn_norm.weight" not in tensors, **_common(get, tensors))


def _phi2_config(get: GGUFMeta, tensors: GGUFTensors):
    from transformers import PhiConfig

    heads, kv, head_dim = _heads(get, one_kv_per_head=False)
    return PhiConfig(architectures=["PhiForCausalLM"], hidden_size=int(get("embedding_length")),
                     intermediate_size=_ffn(get, tensors), num_hidden_layers=get.model_layers(),
                     num_attention_heads=heads, num_key_value_heads=kv, hidden_act="gelu_new",
                     max_position_embeddings=int(get("context_length")), layer_norm_eps=_eps(get),
                     rope_parameters=_rope(get, head_dim), qk_layernorm=False, **_common(get, tensors))


def _falcon_config(get: GGUFMeta, tensors: GGUFTensors):
    from transformers import FalconConfig

    layout = get("tensor_data_layout", _FALCON_LAYOUT)
    if layout != _FALCON_LAYOUT:
        raise _refuse(get, f"has falcon.tensor_data_layout={layout!r}; specray reads the q/k/v order llama.cpp's "
                           f"converter writes ({_FALCON_LAYOUT!r})")
    heads, kv, head_dim = _heads(get, one_kv_per_head=False)
    rope = _rope(get, head_dim)
    if rope.pop("partial_rotary_factor") != 1:
        raise _refuse(get, f"has falcon.rope.dimension_count={get('rope.dimension_count')} for heads of {head_dim}; "
                           "Falcon rotates whole heads")
    if "blk.0.attn_norm_2.weight" in tensors:  # 40B / 180B: a norm each for attention and MLP
        kind = dict(new_decoder_architecture=True, num_kv_heads=kv, num_ln_in_parallel_attn=2)
    elif kv == 1:  # 7B: one KV head (multi-query), one norm for both blocks
        kind = dict(new_decoder_architecture=False, multi_query=True)
    else:  # Falcon 2: the new layout's grouped KV heads with one norm for both blocks
        kind = dict(new_decoder_architecture=True, num_kv_heads=kv, num_ln_in_parallel_attn=1)
    return FalconConfig(architectures=["FalconForCausalLM"], hidden_size=int(get("embedding_length")),
                        ffn_hidden_size=_ffn(get, tensors), num_hidden_layers=get.model_layers(),
                        num_attention_heads=heads, parallel_attn=True, alibi=False, activation="gelu",
                        bias="blk.0.attn_qkv.bias" in tensors, max_position_embeddings=int(get("context_length")),
                        layer_norm_epsilon=_eps(get), rope_parameters=rope, **kind, **_common(get, tensors))


def _gptneox_config(get: GGUFMeta, tensors: GGUFTensors):
    from transformers import GPTNeoXConfig

    heads, _, head_dim = _heads(get, one_kv_per_head=True)
    return GPTNeoXConfig(architectures=["GPTNeoXForCausalLM"], hidden_size=int(get("embedding_length")),
                         intermediate_size=_ffn(get, tensors), num_hidden_layers=get.model_layers(),
                         num_attention_heads=heads, hidden_act="gelu",
                         max_position_embeddings=int(get("context_length")), layer_norm_eps=_eps(get),
                         rope_parameters=_rope(get, head_dim), attention_bias="blk.0.attn_qkv.bias" in tensors,
                         use_parallel_residual=bool(get("use_parallel_residual", True)), **_common(get, tensors))


def _bloom_config(get: GGUFMeta, tensors: GGUFTensors):
    from transformers import BloomConfig

    heads, _, _ = _heads(get, one_kv_per_head=True)
    hidden = int(get("embedding_length"))
    ffn = _ffn(get, tensors)
    if ffn != 4 * hidden:
        raise _refuse(get, f"has blk.0.ffn_up.weight of {ffn} rows for a width of {hidden}; BLOOM's MLP is 4 x its "
                           "width")
    # the context: the release's seq_length, which the converter writes where the config has one, else the width
    context = int(get("context_length"))
    length = {} if context == hidden else {"max_position_embeddings": context}
    return BloomConfig(architectures=["BloomForCausalLM"], hidden_size=hidden, n_layer=get.model_layers(),
                       n_head=heads, layer_norm_epsilon=_eps(get), apply_residual_connection_post_layernorm=False,
                       **length, **_common(get, tensors))


def _mpt_config(get: GGUFMeta, tensors: GGUFTensors):
    from transformers import MptConfig

    heads, _, _ = _heads(get, one_kv_per_head=True)
    hidden = int(get("embedding_length"))
    max_bias = as_written(get("attention.max_alibi_bias"))
    if max_bias <= 0 or "position_embd.weight" in tensors:
        learned = f"mpt.attention.max_alibi_bias={max_bias}" if max_bias <= 0 else "position_embd.weight"
        raise _refuse(get, f"has {learned} (learned positions, attn_config.alibi false); specray serves MPT with "
                           "ALiBi, as every release has it")
    if max_bias != int(max_bias):
        raise _refuse(get, f"has mpt.attention.max_alibi_bias={max_bias}; MPT's alibi_bias_max is a whole number "
                           "(8 in every release)")
    if "blk.0.attn_q_norm.weight" in tensors or "blk.0.attn_k_norm.weight" in tensors:
        raise _refuse(get, "has q/k LayerNorms (blk.0.attn_q_norm, attn_k_norm: attn_config.qk_ln true); specray "
                           "serves MPT's releases, which have none")
    ffn = _ffn(get, tensors)
    if ffn % hidden:
        raise _refuse(get, f"has blk.0.ffn_up.weight of {ffn} rows, not a whole multiple of the width {hidden}; "
                           "MPT's MLP is expansion_ratio x its width")
    clip = get("attention.clamp_kqv", None)
    attn = {"alibi": True, "alibi_bias_max": int(max_bias), "clip_qkv": None if clip is None else as_written(clip),
            "softmax_scale": None, "qk_ln": False, "attn_type": "multihead_attention"}
    return MptConfig(architectures=["MptForCausalLM"], d_model=hidden, n_heads=heads, n_layers=get.model_layers(),
                     expansion_ratio=ffn // hidden, max_seq_len=int(get("context_length")),
                     layer_norm_epsilon=_eps(get), no_bias="blk.0.attn_qkv.bias" not in tensors, attn_config=attn,
                     **_common(get, tensors))


def _starcoder_config(get: GGUFMeta, tensors: GGUFTensors):
    from transformers import GPTBigCodeConfig

    heads, kv, head_dim = _heads(get, one_kv_per_head=False)
    hidden = int(get("embedding_length"))
    if kv not in (1, heads):
        raise _refuse(get, f"has starcoder.attention.head_count_kv={kv} for {heads} query heads; GPT-BigCode's "
                           "attention has one KV head (multi_query) or one per query head")
    # the converter writes head_count_kv 1 whatever the model: c_attn's rows say which
    rows = _shape(get, tensors, "blk.0.attn_qkv.weight")[0]
    if rows not in (hidden + 2 * head_dim, 3 * hidden):
        raise _refuse(get, f"has blk.0.attn_qkv.weight of {rows} rows for {heads} heads of {head_dim}; GPT-BigCode's "
                           f"c_attn has {hidden + 2 * head_dim} (multi-query) or {3 * hidden}")
    positions = _shape(get, tensors, "position_embd.weight")[0]
    return GPTBigCodeConfig(architectures=["GPTBigCodeForCausalLM"], n_positions=positions, n_embd=hidden,
                            n_layer=get.model_layers(), n_head=heads, n_inner=_ffn(get, tensors),
                            activation_function="gelu_pytorch_tanh", layer_norm_epsilon=_eps(get),
                            multi_query=rows == hidden + 2 * head_dim, scale_attn_weights=True,
                            **_common(get, tensors))


def _dbrx_config(get: GGUFMeta, tensors: GGUFTensors):
    from transformers import DbrxConfig

    heads, kv, head_dim = _heads(get, one_kv_per_head=False)
    if _eps(get) != 1e-5:
        raise _refuse(get, f"has dbrx.attention.layer_norm_epsilon={_eps(get)}; DBRX's LayerNorms take 1e-5 (its "
                           "config names none)")
    rotated = int(get("rope.dimension_count", head_dim))
    if rotated != head_dim:
        raise _refuse(get, f"has dbrx.rope.dimension_count={rotated} for heads of {head_dim}; DBRX rotates whole heads")
    rope = rope_parameters(get, None, head_dim)
    experts, width, hidden = _shape(get, tensors, "blk.0.ffn_gate_exps.weight")
    if experts != int(get("expert_count")) or hidden != int(get("embedding_length")):
        raise _refuse(get, f"has blk.0.ffn_gate_exps.weight of shape {[experts, width, hidden]} for "
                           f"dbrx.expert_count={get('expert_count')} experts of width {get('embedding_length')}")
    clip = as_written(get("attention.clamp_kqv"))  # (llama.cpp's loader needs it too)
    attn = {"clip_qkv": clip if clip > 0 else None, "kv_n_heads": kv, "rope_theta": rope["rope_theta"]}
    ffn = {"ffn_act_fn": {"name": "silu"}, "ffn_hidden_size": width, "moe_num_experts": experts,
           "moe_top_k": int(get("expert_used_count")), "moe_normalize_expert_weights": 1.0}
    return DbrxConfig(architectures=["DbrxForCausalLM"], d_model=hidden, n_heads=heads, n_layers=get.model_layers(),
                      max_seq_len=int(get("context_length")), attn_config=attn, ffn_config=ffn, rope_parameters=rope,
                      **{**_common(get, tensors), "tie_word_embeddings": False})


def _gptj_config(get: GGUFMeta, tensors: GGUFTensors):
    from transformers import GPTJConfig

    heads, _, head_dim = _heads(get, one_kv_per_head=True)
    rotated = int(get("rope.dimension_count", head_dim))
    if not 0 < rotated <= head_dim or rotated % 2:
        raise _refuse(get, f"has gptj.rope.dimension_count={rotated} for heads of {head_dim}; GPT-J rotates an even "
                           "number of a head's first features (rotary_dim)")
    base = float(get("rope.freq_base", _GPTJ_ROPE_BASE))
    if base != _GPTJ_ROPE_BASE or get("rope.scaling.type", "none") != "none":
        raise _refuse(get, f"has gptj.rope.freq_base={base} / rope.scaling.type={get('rope.scaling.type', 'none')!r}; "
                           f"GPT-J's RoPE has the base {_GPTJ_ROPE_BASE:g} and no scaling")
    if "output.weight" not in tensors:
        raise _refuse(get, "has no output.weight; GPT-J's LM head (with its bias) is never tied to the embedding")
    return GPTJConfig(architectures=["GPTJForCausalLM"], n_positions=int(get("context_length")),
                      n_embd=int(get("embedding_length")), n_layer=get.model_layers(), n_head=heads,
                      rotary_dim=rotated, n_inner=_ffn(get, tensors), activation_function="gelu_new",
                      layer_norm_epsilon=_eps(get), **{**_common(get, tensors), "tie_word_embeddings": False})


# ---------------------------------------------------------------------------------------------- names


def _weights(prefix: str, bias: bool) -> list[str]:
    return [f"{prefix}.weight"] + ([f"{prefix}.bias"] if bias else [])


def _gpt2_names(config, i: int | None) -> list[str]:
    if i is None:
        return ["transformer.wte.weight", "transformer.wpe.weight", *_weights("transformer.ln_f", True)]
    return [n for part in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
            for n in _weights(f"transformer.h.{i}.{part}", True)]


def _stablelm_names(config, i: int | None) -> list[str]:
    if i is None:
        return ["model.embed_tokens.weight", *_weights("model.norm", True)]
    at = f"model.layers.{i}."
    names = _weights(f"{at}input_layernorm", True) + [f"{at}self_attn.o_proj.weight"]
    names += [n for p in "qkv" for n in _weights(f"{at}self_attn.{p}_proj", config.use_qkv_bias)]
    names += [f"{at}mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    if not config.use_parallel_residual:
        names += _weights(f"{at}post_attention_layernorm", True)
    if config.qk_layernorm:  # the converter's name of the per-head norms stacked (split per head as read)
        names += [f"{at}self_attn.q_layernorm.weight", f"{at}self_attn.k_layernorm.weight"]
    return names


def _phi2_names(config, i: int | None) -> list[str]:
    if i is None:
        return ["model.embed_tokens.weight", *_weights("model.final_layernorm", True), "lm_head.bias"]
    at = f"model.layers.{i}."
    return [n for part in ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                           "self_attn.dense", "mlp.fc1", "mlp.fc2") for n in _weights(at + part, True)]


def _falcon_names(config, i: int | None) -> list[str]:
    if i is None:
        return ["transformer.word_embeddings.weight", *_weights("transformer.ln_f", True)]
    at = f"transformer.h.{i}."
    norms = ("ln_attn", "ln_mlp") if config.new_decoder_architecture and config.num_ln_in_parallel_attn == 2 \
        else ("input_layernorm",)
    return [n for norm in norms for n in _weights(at + norm, True)] + [
        n for part in ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h",
                       "mlp.dense_4h_to_h") for n in _weights(at + part, config.bias)]


def _gptneox_names(config, i: int | None) -> list[str]:
    if i is None:
        return ["gpt_neox.embed_in.weight", *_weights("gpt_neox.final_layer_norm", True)]
    at = f"gpt_neox.layers.{i}."
    return [n for norm in ("input_layernorm", "post_attention_layernorm") for n in _weights(at + norm, True)] + [
        n for part, bias in (("attention.query_key_value", config.attention_bias),
                             ("attention.dense", config.attention_bias), ("mlp.dense_h_to_4h", True),
                             ("mlp.dense_4h_to_h", True)) for n in _weights(at + part, bias)]


def _bloom_names(config, i: int | None) -> list[str]:
    if i is None:
        return ["transformer.word_embeddings.weight", *_weights("transformer.word_embeddings_layernorm", True),
                *_weights("transformer.ln_f", True)]
    return [n for part in ("input_layernorm", "self_attention.query_key_value", "self_attention.dense",
                           "post_attention_layernorm", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
            for n in _weights(f"transformer.h.{i}.{part}", True)]


def _mpt_names(config, i: int | None) -> list[str]:
    bias = not config.no_bias
    if i is None:
        return ["transformer.wte.weight", *_weights("transformer.norm_f", bias)]
    return [n for part in ("norm_1", "attn.Wqkv", "attn.out_proj", "norm_2", "ffn.up_proj", "ffn.down_proj")
            for n in _weights(f"transformer.blocks.{i}.{part}", bias)]


def _dbrx_names(config, i: int | None) -> list[str]:
    if i is None:
        return ["transformer.wte.weight", "transformer.norm_f.weight"]
    at = f"transformer.blocks.{i}."
    return [f"{at}norm_attn_norm.{part}.weight" for part in ("norm_1", "attn.Wqkv", "attn.out_proj", "norm_2")] + [
        f"{at}ffn.router.layer.weight", *(f"{at}ffn.experts.mlp.{w}" for w in ("w1", "v1", "w2"))]


def _gptj_names(config, i: int | None) -> list[str]:
    if i is None:  # (the head, never tied, with its bias)
        return ["transformer.wte.weight", *_weights("transformer.ln_f", True), "lm_head.bias"]
    at = f"transformer.h.{i}."
    return [*_weights(f"{at}ln_1", True), *(f"{at}attn.{p}_proj.weight" for p in ("q", "k", "v", "out")),
            *_weights(f"{at}mlp.fc_in", True), *_weights(f"{at}mlp.fc_out", True)]


# ---------------------------------------------------------------------------------------------- tensors


def _rows(value: torch.Tensor, expected: int, name: str, gguf: Path, family: str) -> None:
    if value.shape[0] != expected:
        raise ValueError(f"GGUF {str(gguf)!r} has {name} of {value.shape[0]} rows, not the {expected} its metadata "
                         f"gives a {family} (heads, KV heads, head size); convert the model again with a current "
                         "llama.cpp, or pass its HF checkpoint")


def _dbrx_fused(value: torch.Tensor, name: str, config, gguf_name: str, get: GGUFMeta) -> torch.Tensor:
    """One of a DBRX layer's expert stacks as the converter writes it (``w1``, ``v1``: [experts, width, hidden];
    ``w2``: [experts, hidden, width], the release's permuted) fused as the release stores it, [experts * width,
    hidden]."""
    experts, width, hidden = (config.ffn_config.moe_num_experts, config.ffn_config.ffn_hidden_size, config.d_model)
    down = name.endswith(".w2")
    shape = (experts, hidden, width) if down else (experts, width, hidden)
    if tuple(value.shape) != shape:
        raise _refuse(get, f"has {gguf_name} of shape {list(value.shape)}, not the {list(shape)} its metadata gives a "
                           "DBRX (expert_count, the experts' width, embedding_length)")
    return (value.transpose(1, 2) if down else value).reshape(experts * width, hidden).contiguous()


def _qkv_grouped(value: torch.Tensor, heads: int, kv: int, head_dim: int) -> torch.Tensor:
    """A fused q/k/v weight or bias from the converter's order (all queries, all keys, all values) back to the
    release's grouped one: per KV group, its queries, then its key and its value (GPT-NeoX: a group per head, one
    query each)."""
    rest = value.shape[1:]
    q, k, v = value.split([heads * head_dim, kv * head_dim, kv * head_dim])
    grouped = [q.reshape(kv, heads // kv, head_dim, *rest), k.reshape(kv, 1, head_dim, *rest),
               v.reshape(kv, 1, head_dim, *rest)]
    return torch.cat(grouped, dim=1).reshape(value.shape)


@dataclass(frozen=True)
class _Family:
    name: str  # as the errors name it
    config: Callable[[GGUFMeta, GGUFTensors], Any]
    names: Callable[[Any, int | None], list[str]]  # the HF checkpoint's names of the model's own (None) or layer i
    head: str = "lm_head.weight"  # the LM head's HF name (written by the converter as ``output`` unless tied)
    spelled: Callable[[str], str] = str  # an HF name as the converter hands it to gguf-py's map


_FAMILIES = {"gpt2": _Family("GPT-2", _gpt2_config, _gpt2_names),
             "stablelm": _Family("StableLM", _stablelm_config, _stablelm_names),
             "phi2": _Family("Phi-2", _phi2_config, _phi2_names),
             "falcon": _Family("Falcon", _falcon_config, _falcon_names),
             "gptneox": _Family("GPT-NeoX", _gptneox_config, _gptneox_names, "embed_out.weight"),
             # BloomModel strips ``transformer.`` (gguf-py maps BLOOM's embedding norm by its bare name alone)
             "bloom": _Family("BLOOM", _bloom_config, _bloom_names, spelled=lambda n: n.replace("transformer.", "")),
             "mpt": _Family("MPT", _mpt_config, _mpt_names),
             "starcoder": _Family("StarCoder", _starcoder_config, _gpt2_names),  # (GPT-2's names, Linear weights)
             # DbrxModel maps the fused experts (no ``.weight`` in the release) with the suffix added
             "dbrx": _Family("DBRX", _dbrx_config, _dbrx_names,
                             spelled=lambda n: f"{n}.weight" if ".ffn.experts.mlp." in n else n),
             "gptj": _Family("GPT-J", _gptj_config, _gptj_names)}


def classic_gguf_config(get: GGUFMeta, tensors: GGUFTensors):
    """The HF config of a classic family's GGUF, from what llama.cpp's converter writes (the module's docstring)."""
    return _FAMILIES[get.arch].config(get, tensors)


def classic_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """The HF config of a GGUF of a classic GPT family and its checkpoint's tensors, a group (the model's own, then a
    layer) at a time, read as the groups are taken."""
    import gguf as gguf_py

    family = _FAMILIES[arch]
    get, tensors = read_model_gguf(gguf, arch)
    config = classic_gguf_config(get, tensors)
    layers = config.num_hidden_layers
    hf_names = family.names(config, None) + [n for i in range(layers) for n in family.names(config, i)]
    if not config.tie_word_embeddings:
        hf_names.append(family.head)
    gguf_arch = {name: value for value, name in gguf_py.MODEL_ARCH_NAMES.items()}[arch]
    spelled = {family.spelled(n): n for n in hf_names}
    names = {gguf_name: spelled[n] for gguf_name, n in gguf_names(gguf_arch, layers, spelled).items()}
    # Phi-2's q/k/v fused in one tensor (Microsoft's first layout, Wqkv), split into the three
    fused = {f"blk.{i}.attn_qkv.{kind}": f"model.layers.{i}.self_attn.{{}}_proj.{kind}"
             for i in range(layers) for kind in ("weight", "bias")
             if arch == "phi2" and f"blk.{i}.attn_qkv.weight" in tensors}
    for gguf_name in fused:
        for p in "qkv":
            del names[gguf_name.replace("attn_qkv", f"attn_{p}")]
    check_tensor_names(gguf, family.name, set(names) | set(fused), tensors)
    heads, kv, head_dim = _heads(get, one_kv_per_head=False)  # (what the config was built from)
    qkv_rows = (heads + 2 * kv) * head_dim

    def hf_tensors(gguf_name: str) -> dict[str, torch.Tensor]:
        value = tensors.pop(gguf_name)
        if gguf_name in fused:
            _rows(value, qkv_rows, gguf_name, gguf, family.name)
            parts = value.split([heads * head_dim, kv * head_dim, kv * head_dim])
            return {fused[gguf_name].format(p): part.contiguous() for p, part in zip("qkv", parts)}
        name = names[gguf_name]
        if arch == "gpt2" and name.endswith(_GPT2_CONV1D):  # the converter's [out, in] -> Conv1D's [in, out]
            return {name: value.t().contiguous()}
        if name.endswith(("query_key_value.weight", "query_key_value.bias")):  # Falcon's, GPT-NeoX's, BLOOM's
            _rows(value, qkv_rows, gguf_name, gguf, family.name)
            return {name: _qkv_grouped(value, heads, kv, head_dim)}
        if name.endswith((".Wqkv.weight", ".Wqkv.bias")):  # MPT's, DBRX's: q, k, v in turn, as the converter left them
            _rows(value, qkv_rows, gguf_name, gguf, family.name)
        if arch == "dbrx" and ".ffn.experts.mlp." in name:  # stacked per expert -> the release's [E * width, hidden]
            return {name: _dbrx_fused(value, name, config, gguf_name, get)}
        if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):  # StableLM's [heads, head_dim]: one per head
            prefix = name.removesuffix(".weight")
            return {f"{prefix}.norms.{h}.weight": w.contiguous() for h, w in enumerate(value)}
        return {name: value}

    return config, converted_groups(tensors, hf_tensors)
