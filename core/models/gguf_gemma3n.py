"""GGUF files of Gemma 3n's text model (``general.architecture`` ``gemma3n``), as llama.cpp's converter writes them (its
Gemma3NModel over Gemma3Model and TextModel, from a release's ``Gemma3nForConditionalGeneration``: its
``model.language_model.`` tensors, ``language_model.`` dropped, the vision and audio towers left to the mmproj file),
turned back into the HF text checkpoint :mod:`specray.models.gemma3n` loads. transformers' GGUF mapping has no Gemma 3n,
so the config and every tensor are read here.

What the converter writes, read back here:

* the sizes (``embedding_length``, ``block_count``, ``attention.head_count``, ``attention.head_count_kv``: one count,
  the head size ``attention.key_length``), each layer's MLP width (``feed_forward_length``, an array), the layers'
  kinds (``attention.sliding_window_pattern``: a flag per layer, true where it slides) and window
  (``attention.sliding_window``), the full layers' RoPE base (``rope.freq_base``) and the sliding layers'
  (``rope.freq_base_swa``), ``context_length``, the RMSNorms' epsilon, the final logit soft cap
  (``final_logit_softcapping``);
* AltUp's streams and active stream (``altup.num_inputs``, ``altup.active_idx``), the per-layer inputs' width
  (``embedding_length_per_layer_input``), KV sharing (``attention.shared_kv_layers``: the last layers, each reading the
  K/V of the last earlier layer of its kind); LAuReL's rank from ``laurel_l``'s rows;
* activation sparsity as the standard normal's quantile of each layer's ``activation_sparsity_pattern`` entry
  (``activation_sparsity_scale``, float32; -inf for 0), turned back through the normal's CDF into the shortest
  decimal whose float32 quantile is the file's value (the cutoff the model computes from it is the file's, exactly);
* every tensor under the name gguf-py's tensor map gives the HF name (the map the converter renames by), the layers'
  ``altup.correct_output_scale`` under the ``.weight`` suffix the converter adds to a name ending ``_scale``; the
  norms as they are (Gemma 3n's scale by ``w``: the converter adds nothing); the LM head tied (the converter drops
  ``lm_head``, which has no ``language_model.`` in its name; a file with ``output`` has its head untied);
* AltUp's projections (``altup_projections.{i}``, ``altup_unembed_projections.{i}``, [H, H] each), which the converter
  stacks into ``altup_proj`` and ``altup_unembd_proj`` [streams - 1, H, H], one per stream again;
* the per-layer embedding table (``embed_tokens_per_layer``, ``vocab_size_per_layer_input`` rows), which the converter
  pads with zero rows to the vocabulary (``per_layer_token_embd``: the releases' 262144 rows to 262400), cut back:
  ``vocab_size_per_layer_input`` is its rows less its trailing all-zero ones (a table whose own last rows were all
  zeros, which no release's is, would be cut further). Ids past it (the multimodal placeholders) then read token 0's
  row, as transformers' model does; llama.cpp reads the zero rows (text prompts hold none of those ids);
* the KV-shared layers' ``attn_k``, ``attn_v`` and ``attn_k_norm``, which a release's checkpoint has (transformers
  4's Gemma 3n built them) and the converter writes, dropped: those layers read earlier layers' K/V (transformers 5's
  Gemma 3n has no such tensors).

What no key carries is set as llama.cpp's graph runs it: the per-layer inputs' gate takes the corrected active stream
times ``altup_correct_scale``'s tensor (``altup_correct_scale`` true); the prediction coefficients unclamped
(``altup_coef_clip``, which transformers applies only while training, left at its default). llama.cpp's graph fixes
some of what the file says -- it sparsifies the first 10 layers at 0.95, shares K/V from layer 20 on and soft-caps at
30, whatever the keys (each release's keys say the same) -- and takes the gate's deviation over n - 1 where
transformers takes it over n (as specray does); the keys are read here, and a file without one of them (no converter
omits them) gets llama.cpp's value: the first 10 layers at 0.95, sharing from layer 20, a soft cap of 30, every fifth
layer full (llama.cpp's default pattern), the sliding layers at the full layers' base (llama.cpp's default now; its
first Gemma 3n code fixed 10000). A RoPE scaling (``rope.scaling.*``, which no release has) is refused: llama.cpp
would scale the sliding layers with the full ones, transformers the full ones alone.

The tokenizer's end of turn (``<end_of_turn>``), which a GGUF does not list as an end-of-sequence id (the release's
generation config does), is added to ``eos_token_id`` where the vocabulary has it. Tensors of any llama.cpp type are
dequantized to float32; a layer's linears keep their integers (:mod:`specray.models.gguf_quant`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specray.models.gguf_read import (GGUFMeta, GGUFTensors, as_written, check_tensor_names, converted_groups,
                                      gguf_names, hf_tensor_names, read_model_gguf, rope_parameters)

GEMMA3N_GGUF_ARCHS = ("gemma3n",)
SLIDING, FULL = "sliding_attention", "full_attention"
_END_OF_TURN = "<end_of_turn>"
# the converter's stacks of AltUp's projections: GGUF name -> the HF projections' prefix (``{prefix}.{i}.weight``)
_STACKED = {"altup_proj.weight": "model.altup_projections",
            "altup_unembd_proj.weight": "model.altup_unembed_projections"}
_PER_LAYER_TABLE = "per_layer_token_embd.weight"
_SHARED_KV_EXTRA = ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight")  # a release's, on KV-shared layers
# what llama.cpp's Gemma 3n fixes where a file has no key for it
_LLAMA_CPP_SPARSE_LAYERS, _LLAMA_CPP_SPARSITY = 10, 0.95
_LLAMA_CPP_KV_FROM_START = 20
_LLAMA_CPP_SWA_PERIOD = 5
_LLAMA_CPP_SOFTCAP = 30.0
_ROWS_AT_ONCE = 256  # the per-layer table's rows read at a time, from its end, looking for its padding


def _refuse(get: GGUFMeta, what: str) -> ValueError:
    return ValueError(f"GGUF {str(get.gguf)!r} {what}; pass the model's HF checkpoint instead")


def _sliding(get: GGUFMeta, layers: int) -> list[bool]:
    """Each layer's kind: the converter's flag per layer (true: sliding), or a period (every ``n``-th layer full, as
    llama.cpp reads a number; llama.cpp's 5 where the key is missing)."""
    pattern = get("attention.sliding_window_pattern", _LLAMA_CPP_SWA_PERIOD)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise _refuse(get, f"has {len(pattern)} values of gemma3n.attention.sliding_window_pattern for {layers} "
                               "layers (block_count)")
        return [bool(s) for s in pattern]
    period = int(pattern)
    return [period == 0 or i % period < period - 1 for i in range(layers)]


def _sparsity(get: GGUFMeta, layers: int) -> list[float]:
    """``activation_sparsity_pattern`` from the converter's quantiles (``activation_sparsity_scale``), or llama.cpp's
    (its first 10 layers at 0.95) where the key is missing."""
    scales = get("activation_sparsity_scale", None)
    if scales is None:
        return [_LLAMA_CPP_SPARSITY if i < _LLAMA_CPP_SPARSE_LAYERS else 0.0 for i in range(layers)]
    scales = scales if isinstance(scales, list) else [scales]
    if len(scales) != layers:
        raise _refuse(get, f"has {len(scales)} values of gemma3n.activation_sparsity_scale for {layers} layers "
                           "(block_count)")
    return [_quantile_share(get, i, float(s)) for i, s in enumerate(scales)]


def _icdf32(share: float) -> float:
    """The standard normal's quantile of ``share`` as the converter and the model compute it (float32)."""
    normal = torch.distributions.Normal(torch.tensor(0.0, device="cpu"), torch.tensor(1.0, device="cpu"))
    return normal.icdf(torch.tensor(share, dtype=torch.float32, device="cpu")).item()


def _quantile_share(get: GGUFMeta, layer: int, scale: float) -> float:
    """The sparsity whose float32 quantile is ``scale`` (the file's float32): the shortest such decimal."""
    if scale == -math.inf:
        return 0.0  # (0's quantile: no sparsity)
    if not math.isfinite(scale):
        raise _refuse(get, f"has gemma3n.activation_sparsity_scale[{layer}]={scale}, the quantile of no sparsity "
                           "Gemma 3n serves (a share of the gate's activations in [0, 1); the converter writes 0 as "
                           "-inf)")
    share = 0.5 * math.erfc(-scale / math.sqrt(2.0))  # the normal's CDF
    candidates = [float(f"{share:.{digits}g}") for digits in range(1, 18)]
    return next((c for c in candidates if 0.0 < c < 1.0 and _icdf32(c) == scale), share)


def _table_rows(tensors: GGUFTensors) -> int:
    """The per-layer embedding table's rows before the converter's padding: its rows less its trailing all-zero ones,
    read from its end a few at a time (the table is the model's largest tensor)."""
    entry = dict(tensors.raw_items())[_PER_LAYER_TABLE]
    rows = tensors.shape(_PER_LAYER_TABLE)[0]
    while rows > 0:
        start = max(0, rows - _ROWS_AT_ONCE)
        if isinstance(entry, torch.Tensor):
            chunk = entry[start:rows]
        else:
            from gguf.quants import dequantize

            raw = entry.data.reshape(-1, entry.data.shape[-1])[start:rows]
            chunk = torch.from_numpy(dequantize(raw, entry.tensor_type).copy())
        nonzero = chunk.reshape(rows - start, -1).ne(0).any(dim=1).nonzero()
        if len(nonzero):
            return start + int(nonzero[-1]) + 1
        rows = start
    return 0


def _shape(get: GGUFMeta, tensors: GGUFTensors, name: str) -> tuple[int, ...]:
    if name not in tensors:
        raise ValueError(f"GGUF {str(get.gguf)!r} has no {name}, which llama.cpp's converter writes for every "
                         "Gemma 3n; convert the model again with a current llama.cpp, or pass its HF checkpoint")
    return tensors.shape(name)


def _streams(get: GGUFMeta, tensors: GGUFTensors, hidden: int) -> int:
    """AltUp's streams (``altup.num_inputs``; its stacked projections' count + 1 where the key is missing), checked
    against both stacks."""
    shapes = {name: _shape(get, tensors, name) for name in _STACKED}
    streams = int(get("altup.num_inputs", shapes["altup_proj.weight"][0] + 1))
    for name, shape in shapes.items():
        if shape != (streams - 1, hidden, hidden):
            raise _refuse(get, f"has {name} of shape {list(shape)} for gemma3n.altup.num_inputs={streams} streams of "
                               f"{hidden}; the converter stacks the projections of the streams past the first, "
                               f"[{streams - 1}, {hidden}, {hidden}]")
    return streams


def gemma3n_gguf_config(get: GGUFMeta, tensors: GGUFTensors, tokens: list[str] | None):
    """Gemma 3n's HF text config from what llama.cpp's converter writes (the module's docstring lists it)."""
    from transformers import Gemma3nTextConfig

    layers = int(get("block_count"))
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = set(get.per_layer("attention.head_count_kv", layers))
    if len(kv_heads) != 1:
        raise _refuse(get, f"has gemma3n.attention.head_count_kv={get('attention.head_count_kv')}; Gemma 3n has one "
                           "count of KV heads for every layer")
    head_dim = int(get("attention.key_length"))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise _refuse(get, f"has gemma3n.attention.value_length={get('attention.value_length')} for keys of "
                           f"{head_dim}; Gemma 3n's values are its keys' size")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise _refuse(get, f"has gemma3n.rope.dimension_count={get('rope.dimension_count')} for heads of {head_dim}; "
                           "Gemma 3n rotates whole heads")
    scaling = get("rope.scaling.type", "none")
    if scaling != "none":
        raise _refuse(get, f"has gemma3n.rope.scaling.type={scaling!r}; Gemma 3n's releases rotate unscaled, and "
                           "llama.cpp would scale its sliding layers with the full ones (transformers: the full ones "
                           "alone)")
    full = rope_parameters(get, None, head_dim)
    sliding_base = float(get("rope.freq_base_swa", full["rope_theta"]))
    streams = _streams(get, tensors, hidden)
    active = int(get("altup.active_idx", 0))
    if not 0 <= active < streams:
        raise _refuse(get, f"has gemma3n.altup.active_idx={active} for {streams} AltUp streams (altup.num_inputs)")
    table = _shape(get, tensors, _PER_LAYER_TABLE)
    per_layer = int(get("embedding_length_per_layer_input", table[1] // layers))
    if table[1] != per_layer * layers:
        raise _refuse(get, f"has {_PER_LAYER_TABLE} of {table[1]} columns for per-layer inputs of {per_layer} "
                           f"(embedding_length_per_layer_input) over {layers} layers")
    shared = int(get("attention.shared_kv_layers", max(0, layers - _LLAMA_CPP_KV_FROM_START)))
    ids = get.token_ids()
    eos_ids = [ids["eos_token_id"]] if ids["eos_token_id"] is not None else []
    if tokens and _END_OF_TURN in tokens and tokens.index(_END_OF_TURN) not in eos_ids:
        eos_ids.append(tokens.index(_END_OF_TURN))
    return Gemma3nTextConfig(
        architectures=["Gemma3nForCausalLM"], vocab_size=tensors.shape("token_embd.weight")[0],
        vocab_size_per_layer_input=_table_rows(tensors), hidden_size=hidden, hidden_size_per_layer_input=per_layer,
        intermediate_size=get.per_layer("feed_forward_length", layers), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads.pop(), head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=as_written(get("attention.layer_norm_rms_epsilon")),
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": sliding_base}, FULL: full},
        sliding_window=int(get("attention.sliding_window")),
        layer_types=[SLIDING if s else FULL for s in _sliding(get, layers)],
        final_logit_softcapping=as_written(get("final_logit_softcapping", _LLAMA_CPP_SOFTCAP)),
        altup_active_idx=active, altup_num_inputs=streams, altup_correct_scale=True, num_kv_shared_layers=shared,
        laurel_rank=_shape(get, tensors, "blk.0.laurel_l.weight")[0],
        activation_sparsity_pattern=_sparsity(get, layers), tie_word_embeddings="output.weight" not in tensors,
        **{**ids, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids or None})


def _gguf_names(config) -> dict[str, str]:
    """GGUF name -> HF name of every tensor of the model ``config`` describes but AltUp's stacked projections: gguf-py's
    tensor map over the HF model's names, as the converter renames them first (``.weight`` after ``_scale``)."""
    import gguf
    from transformers import Gemma3nForCausalLM

    names = hf_tensor_names(Gemma3nForCausalLM, config, skip=lambda n: n.startswith(tuple(_STACKED.values())))
    suffixed = {n + ".weight" if n.endswith("_scale") else n: n for n in names}
    return {g: suffixed[n] for g, n in gguf_names(gguf.MODEL_ARCH.GEMMA3N, config.num_hidden_layers, suffixed).items()}


def gemma3n_gguf_checkpoint(gguf: Path, arch: str) -> tuple[Any, Iterator[dict[str, torch.Tensor]]]:
    """The HF config of a Gemma 3n GGUF and its tensors, a group (the model's own, then a layer) at a time, read as
    the groups are taken."""
    from gguf import GGUFReader

    get, tensors = read_model_gguf(gguf, arch)
    field = GGUFReader(str(gguf)).fields.get("tokenizer.ggml.tokens")
    config = gemma3n_gguf_config(get, tensors, field.contents() if field is not None else None)
    names = _gguf_names(config)
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    dropped = [f"blk.{i}.{t}" for i in range(first_shared, config.num_hidden_layers) for t in _SHARED_KV_EXTRA]
    for name in dropped:  # (a release's; read by no layer)
        if name in tensors:
            del tensors[name]
    check_tensor_names(gguf, "Gemma 3n", set(names) | set(_STACKED), tensors)
    streams, rows = config.altup_num_inputs, config.vocab_size_per_layer_input

    def hf_tensors(gguf_name: str) -> dict[str, torch.Tensor]:
        value = tensors.pop(gguf_name)
        if gguf_name in _STACKED:  # [streams - 1, H, H]: one projection per stream past the first
            return {f"{_STACKED[gguf_name]}.{i}.weight": value[i].contiguous() for i in range(streams - 1)}
        if gguf_name == _PER_LAYER_TABLE:  # the converter's zero rows (to the vocabulary) cut off
            return {names[gguf_name]: value[:rows].contiguous()}
        return {names[gguf_name]: value}

    return config, converted_groups(tensors, hf_tensors)
