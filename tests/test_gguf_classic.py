"""GGUF files of the classic GPT families (:mod:`specray.models.gguf_classic`: ``gpt2``, ``stablelm``, ``phi2``,
``falcon``, ``gptneox``, ``bloom``, ``mpt``, ``starcoder``), written here from the tests' tiny HF models as llama.cpp's
converter lays them out (its GPT2Model, StableLMModel, Phi2Model, FalconModel, GPTNeoXModel, BloomModel, MPTModel and
StarCoderModel: their metadata, gguf-py's tensor names, the q/k/v rows reordered, GPT-2's Conv1D weights transposed,
StableLM's per-head q/k norms stacked), convert back into the folders' own tensors and load to transformers' logits on
the folders (with what no key carries set as llama.cpp's graph runs it); their linears in Q8_0 load as the same file
converted dense; what the model cannot be built from is refused, naming the fix."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from specray.models import loader
from specray.models.loader import load_hf_config, load_model, resolve_model
from specray_test_checkpoints import gguf_blocks  # tests/checkpoints.py, via conftest
from tests.test_loader import (_block_type, _safetensors, _write_gguf_tokenizer, _write_out,
                               assert_converted_as_folder, assert_gguf_serves_as_its_folder, assert_matches_hf,
                               hf_model, loaded_beside_dense, prefill_logits)


@pytest.fixture(scope="module")
def gguf_cache(specray_cache):
    assert os.environ[loader.CACHE_ENV] == str(specray_cache)
    return specray_cache


@pytest.fixture(scope="module")
def tiny_phi2_dir(make_tiny_model, tmp_path_factory) -> Path:
    # phi-2's own layout: conftest's tiny_phi_dir without the q/k LayerNorms (phi's option, which no release sets and
    # llama.cpp's phi2 has no tensor for); RoPE on 0.4 of each head (6 of 16 features)
    return make_tiny_model(tmp_path_factory.mktemp("tiny_phi2"), "phi", seed=44, num_key_value_heads=4,
                           layer_norm_eps=1e-5, hidden_act="gelu_new", tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.4})


@pytest.fixture(scope="module")
def tiny_gpt_neox_sequential_10k_dir(make_tiny_model, tmp_path_factory) -> Path:
    # conftest's tiny_gpt_neox_sequential_dir at RoPE's base of 10000: llama.cpp's GPTNeoXModel writes no base (its
    # runtime's default, 10000, every release's), so a file of the fixture's 5000 would not say it
    return make_tiny_model(tmp_path_factory.mktemp("tiny_gpt_neox_seq10k"), "gpt_neox", seed=43, layer_norm_eps=1e-5,
                           use_parallel_residual=False, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.5})


@pytest.fixture(scope="module")
def tiny_stablelm_whole_heads_dir(make_tiny_model, tmp_path_factory) -> Path:
    # StableLM 2 1.6B's layout rotating whole heads: a file's rope.dimension_count equal to the head size is read as
    # such, not as StableLM's default share (a quarter)
    return make_tiny_model(tmp_path_factory.mktemp("tiny_stablelm_whole"), "stablelm", seed=54, use_qkv_bias=True,
                           layer_norm_eps=1e-5, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 1.0})


# ---- what llama.cpp's converter writes ---------------------------------------------------------------------------


def _falcon_kv_heads(cfg: dict) -> int:
    """The KV heads llama.cpp's FalconModel reads off the release's config: ``num_kv_heads`` (40B, 180B, Falcon 2),
    else 1 -- Falcon-7B's config names none (transformers 5 saves its default, the query heads, for a multi-query
    model: the release's would not)."""
    if cfg["new_decoder_architecture"]:
        return cfg["num_kv_heads"]
    return 1 if cfg["multi_query"] else cfg["num_attention_heads"]


def _rotated(cfg: dict, head_dim: int) -> int:
    return int(cfg["rope_parameters"]["partial_rotary_factor"] * head_dim)


def _write_params(w, cfg: dict, arch: str, layout: str) -> None:
    """The hyperparameters each converter writes (``set_gguf_parameters``): none of them writes RoPE's base, and
    GPT-2's, Phi-2's, Falcon's, BLOOM's, MPT's and StarCoder's write 4 x the width as the MLP's whatever the model's;
    BLOOM's the width as the context where the config has no ``seq_length``, StarCoder's one KV head whatever the
    model's, MPT's a fixed epsilon and ALiBi's maximum bias (0 for learned positions)."""
    if arch == "bloom":
        hidden, heads = cfg["hidden_size"], cfg["n_head"]
        w.add_context_length(cfg.get("seq_length", hidden))
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(4 * hidden)
        w.add_block_count(cfg["n_layer"])
        w.add_head_count(heads)
        w.add_head_count_kv(heads)
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
        return
    if arch == "mpt":
        attn = cfg["attn_config"]
        w.add_context_length(cfg["max_seq_len"])
        w.add_embedding_length(cfg["d_model"])
        w.add_block_count(cfg["n_layers"])
        w.add_feed_forward_length(4 * cfg["d_model"])
        w.add_head_count(cfg["n_heads"])
        if attn.get("kv_n_heads"):
            w.add_head_count_kv(attn["kv_n_heads"])
        w.add_layer_norm_eps(1e-5)
        if attn["clip_qkv"] is not None:
            w.add_clamp_kqv(attn["clip_qkv"])
        w.add_max_alibi_bias(attn["alibi_bias_max"] if attn["alibi"] else 0.0)
        return
    if arch == "starcoder":
        w.add_context_length(cfg["n_positions"])
        w.add_embedding_length(cfg["n_embd"])
        w.add_feed_forward_length(4 * cfg["n_embd"])
        w.add_block_count(cfg["n_layer"])
        w.add_head_count(cfg["n_head"])
        w.add_head_count_kv(1)
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
        return
    if arch == "gpt2":
        hidden, heads = cfg["n_embd"], cfg["n_head"]
        w.add_block_count(cfg["n_layer"])
        w.add_context_length(cfg["n_positions"])  # (its n_ctx, which the releases set to n_positions)
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(4 * hidden)
        w.add_head_count(heads)
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
        return
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = hidden // heads
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(hidden)
    w.add_head_count(heads)
    if arch == "falcon":
        w.add_context_length(2048)  # (not in the release's config: llama.cpp's FalconModel fixes it)
        w.add_tensor_data_layout(layout)
        w.add_feed_forward_length(4 * hidden)
        w.add_head_count_kv(_falcon_kv_heads(cfg))
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
        return
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    if arch == "phi2":
        w.add_feed_forward_length(4 * hidden)
        w.add_head_count_kv(heads)
        w.add_rope_dimension_count(int(cfg["rope_parameters"]["partial_rotary_factor"] * hidden) // heads)
        w.add_add_bos_token(False)
        return
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_rope_dimension_count(_rotated(cfg, head_dim))
    w.add_parallel_residual(cfg.get("use_parallel_residual", True))
    if arch == "stablelm":
        w.add_head_count_kv(cfg["num_key_value_heads"])


def _grouped_to_contiguous(t: torch.Tensor, kv: int, per_group: int) -> torch.Tensor:
    """llama.cpp's reordering of a fused q/k/v stored group by group (``[kv, per_group + 2, head_dim]`` rows: each
    group's queries, its key, its value) into all queries, all keys, all values (FalconModel's, its
    ``tensor_data_layout`` ``jploski``; GPTNeoXModel's, a group per head)."""
    rows = t.reshape(kv, per_group + 2, -1, *t.shape[1:])
    return torch.cat([rows[:, :-2].reshape(-1, *t.shape[1:]), rows[:, -2].reshape(-1, *t.shape[1:]),
                      rows[:, -1].reshape(-1, *t.shape[1:])]).reshape(t.shape)


def _converted(arch: str, cfg: dict, tensors: dict[str, torch.Tensor], wqkv: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as the converter's ``modify_tensors`` hands them on, under HF names gguf-py's tensor
    map knows (or, ``wqkv``: Phi-2's q/k/v fused as Microsoft's first layout held them, under their GGUF name)."""
    out: dict[str, torch.Tensor] = {}
    norms: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        t = t.float()
        if arch == "gpt2" and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):  # Conv1D [in, out]
            t = t.t().contiguous()
        if arch == "falcon" and name.endswith(("query_key_value.weight", "query_key_value.bias")):
            # (llama.cpp's FalconModel reorders the weight; no RoPE release has a bias, the tiny 40B's is reordered
            # the same way)
            kv = _falcon_kv_heads(cfg)
            t = _grouped_to_contiguous(t, kv, cfg["num_attention_heads"] // kv)
        if arch == "gptneox" and name.endswith(("query_key_value.weight", "query_key_value.bias")):
            t = _grouped_to_contiguous(t, cfg["num_attention_heads"], 1)
        if arch == "bloom" and name.endswith(("query_key_value.weight", "query_key_value.bias")):
            t = _grouped_to_contiguous(t, cfg["n_head"], 1)  # (BloomModel's as GPTNeoXModel's: head by head)
        if ".q_layernorm.norms." in name or ".k_layernorm.norms." in name:
            # StableLMModel: a layer's per-head norms stacked [heads, head_dim] under the merged name
            prefix, head = name.removesuffix(".weight").rsplit(".norms.", 1)
            norms.setdefault(f"{prefix}.weight", {})[int(head)] = t
            continue
        out[name] = t
    for name, heads in norms.items():
        out[name] = torch.stack([heads[h] for h in range(len(heads))])
    if wqkv:
        for i in range(cfg["num_hidden_layers"]):
            for kind in ("weight", "bias"):
                parts = [out.pop(f"model.layers.{i}.self_attn.{p}_proj.{kind}") for p in "qkv"]
                out[f"blk.{i}.attn_qkv.{kind}"] = torch.cat(parts)
    return out


def write_classic_gguf(folder: Path, out: Path, arch: str, types: Callable[[str], str | None] | None = None,
                       wqkv: bool = False, layout: str = "jploski") -> Path:
    """A float32 GGUF of the tiny HF model in ``folder`` as llama.cpp's converter writes ``arch`` (``gpt2``,
    ``stablelm``, ``phi2``, ``falcon``, ``gptneox``, ``bloom``, ``mpt``, ``starcoder``): its hyperparameters, the
    byte-level BPE tokenizer, its tensors under gguf-py's names in the converter's layout. ``types``: the llama.cpp
    type (``Q8_0``, ...) a tensor of that GGUF name is quantized to (None: float32); ``wqkv``: Phi-2's q/k/v in one
    tensor; ``layout``: Falcon's ``tensor_data_layout``."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), arch)
    _write_params(w, cfg, arch, layout)
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    arch_id = {name: value for value, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    layers = cfg.get("num_hidden_layers") or cfg.get("n_layer") or cfg["n_layers"]
    names = gguf.get_tensor_name_map(arch_id, layers)
    for name, tensor in _converted(arch, cfg, load_file(str(folder / "model.safetensors")), wqkv).items():
        spelled = name.replace("transformer.", "") if arch == "bloom" else name  # (BloomModel strips it first)
        gguf_name = name if name.startswith("blk.") else names.get_name(spelled, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        kind = _block_type(types, gguf_name, tensor.shape)
        if kind:
            w.add_tensor(gguf_name, gguf_blocks(tensor.numpy(), kind), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            w.add_tensor(gguf_name, tensor.numpy())
    _write_out(w)
    return out


# ---- the families ----------------------------------------------------------------------------------------------

# case -> (the folder's fixture, llama.cpp's architecture, Phi-2's fused q/k/v)
CASES = {
    "gpt2": ("tiny_gpt2_dir", "gpt2", False),  # learned positions, Conv1D weights, a tied head, n_inner = 2 x width
    "stablelm": ("tiny_stablelm_dir", "stablelm", False),  # StableLM 2 1.6B: Llama's order, q/k/v biases
    "stablelm_12b": ("tiny_stablelm_parallel_dir", "stablelm", False),  # parallel blocks, per-head q/k norms, GQA
    "stablelm_whole_heads": ("tiny_stablelm_whole_heads_dir", "stablelm", False),  # RoPE over every feature
    "phi2": ("tiny_phi2_dir", "phi2", False),  # PhiForCausalLM's q, k, v
    "phi2_wqkv": ("tiny_phi2_dir", "phi2", True),  # Microsoft's first layout: Wqkv
    "falcon_40b": ("tiny_falcon_dir", "falcon", False),  # 2 KV heads for 4, a norm each for attention and MLP
    "falcon_7b": ("tiny_falcon_7b_dir", "falcon", False),  # one KV head, one norm
    "falcon2": ("tiny_falcon2_dir", "falcon", False),  # 40B's grouped q/k/v, one norm
    "gptneox": ("tiny_gpt_neox_dir", "gptneox", False),  # Pythia: parallel residual, RoPE on a quarter of each head
    "gptneox_sequential": ("tiny_gpt_neox_sequential_10k_dir", "gptneox", False),  # Llama's order, half of each head
    "bloom": ("tiny_bloom_dir", "bloom", False),  # ALiBi over 6 heads, q/k/v head by head, the embeddings' norm
    "bloom_post_ln": ("tiny_bloom_post_ln_dir", "bloom", False),  # residual = normed input: not in the file
    "mpt": ("tiny_mpt_dir", "mpt", False),  # ALiBi, Wqkv clamped (clip_qkv), no biases; softmax_scale not in the file
    "starcoder": ("tiny_gpt_bigcode_dir", "starcoder", False),  # multi-query c_attn, learned positions, n_inner 2 x
    "starcoder_mha": ("tiny_gpt_bigcode_mha_dir", "starcoder", False),  # c_attn head by head, unscaled, untied head
}
# case -> what its folder's config sets that the converter writes no key for, as llama.cpp's graph runs the file
# instead (``a.b``: field b of config field a): the reference the file's conversion is held to
LLAMA_CPP_RUNS = {"bloom_post_ln": {"apply_residual_connection_post_layernorm": False},
                  "mpt": {"attn_config.softmax_scale": None},  # (scores scaled by 1 / sqrt(head size))
                  "starcoder_mha": {"scale_attn_weights": True}}


def _reference(folder: Path, case: str, tmp_path: Path) -> Path:
    """The folder a case's file is held to: ``folder``, or a copy whose config sets what the file cannot say as
    llama.cpp runs it (:data:`LLAMA_CPP_RUNS`)."""
    changes = LLAMA_CPP_RUNS.get(case)
    if not changes:
        return folder
    ref = Path(shutil.copytree(folder, tmp_path / f"{case}-as-llama-cpp-runs"))
    cfg = json.loads((ref / "config.json").read_text())
    for field, value in changes.items():
        *outer, key = field.split(".")
        at = cfg
        for part in outer:
            at = at[part]
        assert at.get(key) != value, (case, field)  # (the folder sets it otherwise: the case tests something)
        at[key] = value
    (ref / "config.json").write_text(json.dumps(cfg))
    return ref


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_classic_gguf_converts_to_its_folder_and_matches_transformers(request, tmp_path, gguf_cache, case):
    """Each family's GGUF, in each layout its converter writes, converts into the folder's own tensors (every one, by
    the folder's names, equal in float32: the q/k/v order, the Conv1D transposes and the per-head norms put back) and
    our model on it gives transformers' logits on the folder (with what no key carries as llama.cpp runs it:
    :data:`LLAMA_CPP_RUNS`)."""
    fixture, arch, wqkv = CASES[case]
    folder = request.getfixturevalue(fixture)
    path = write_classic_gguf(folder, tmp_path / f"{case}.gguf", arch, wqkv=wqkv)
    ref = _reference(folder, case, tmp_path)
    assert_converted_as_folder(ref, path)
    assert_matches_hf(load_model(str(path), pack=False), hf_model(ref))


@pytest.mark.parametrize("case, fields", [
    ("gpt2", ["n_positions", "n_inner", "layer_norm_epsilon", "tie_word_embeddings", "activation_function"]),
    ("falcon_40b", ["new_decoder_architecture", "num_kv_heads", "num_ln_in_parallel_attn", "bias", "ffn_hidden_size"]),
])
def test_a_classic_gguf_serves_as_its_folder(request, tmp_path, gguf_cache, case, fields):
    """GPT-2's (learned positions) and Falcon-40B's (grouped q/k/v) GGUFs through the engine, their tokenizers read
    from the files: the config has the folder's ``fields`` and greedy output under n-gram drafts equals the folder's."""
    fixture, arch, wqkv = CASES[case]
    folder = request.getfixturevalue(fixture)
    assert_gguf_serves_as_its_folder(folder, write_classic_gguf(folder, tmp_path / f"{case}.gguf", arch), fields)


# the families in one layout each: the q8 files' own integers kept where gguf_quant keeps a layer's linears
# (``layers.N``, ``h.N``, ``blocks.N``), but GPT-2's: its Conv1D weights are the file's transposed, no rows of it
Q8_CASES = {"gpt2": False, "stablelm_12b": True, "phi2": True, "falcon_40b": True, "gptneox": True, "bloom": True,
            "mpt": True, "starcoder": True}


@pytest.mark.parametrize("case", sorted(Q8_CASES))
def test_a_classic_gguf_with_q8_0_linears_loads_as_its_dense_conversion(request, tmp_path, gguf_cache, monkeypatch,
                                                                        case):
    """A family's GGUF with its layers' linears in Q8_0 converts (keeping their integers where the conversion keeps a
    layer's) and loads to the weights and logits of the same file converted dense, which are transformers' on the
    folder but for Q8_0's rounding."""
    fixture, arch, wqkv = CASES[case]
    folder = _reference(request.getfixturevalue(fixture), case, tmp_path)
    path = write_classic_gguf(folder, tmp_path / f"{case}.gguf", arch,
                              lambda name: "Q8_0" if name.startswith("blk.") and "norm" not in name else None)
    dense_path = Path(shutil.copy(path, tmp_path / f"{case}-dense.gguf"))
    kept = any(n.endswith(".q_weight") for n in _safetensors(resolve_model(str(path)).path))
    assert kept == Q8_CASES[case]
    model, ref = loaded_beside_dense(path, dense_path, monkeypatch)
    ids = list(range(3, 40))
    logits = prefill_logits(model, ids)
    assert torch.equal(logits, prefill_logits(ref, ids))
    with torch.no_grad():
        theirs = hf_model(folder)(torch.tensor([ids])).logits[0]
    assert 0 < (logits - theirs).abs().max() < 0.05 * theirs.abs().max()  # Q8_0's rounding, no more


@pytest.mark.parametrize("case", ["bloom", "falcon_40b", "mpt", "starcoder"])
def test_a_classic_gguf_with_q4_0_linears_keeps_them_in_4_bits(request, tmp_path, gguf_cache, monkeypatch, case):
    """The families whose checkpoints name their layers ``h.N`` / ``blocks.N``: a file with its layers' linears in
    Q4_0, on a device that keeps 4-bit weights (this CPU, asked to), keeps each layer's attention output and MLP in 4
    bits, their integers carried from the file through the conversion and the load; the fused q/k/v, kept as integers
    on disk, is dequantized as the model splits it and loads dense. The logits are those of the same file converted
    dense."""
    from specray.models import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "INT4_WEIGHTS", True)
    fixture, arch, wqkv = CASES[case]
    folder = _reference(request.getfixturevalue(fixture), case, tmp_path)
    path = write_classic_gguf(folder, tmp_path / f"{case}.gguf", arch,
                              lambda name: "Q4_0" if name.startswith("blk.") and "norm" not in name else None)
    dense_path = Path(shutil.copy(path, tmp_path / f"{case}-dense.gguf"))
    model = load_model(str(path))
    kept = sorted(name for name, m in model.named_modules() if getattr(m, "kept", None) is not None)
    assert kept == [f"model.layers.{i}.{p}" for i in range(2) for p in ("mlp.c_fc", "mlp.c_proj", "self_attn.o_proj")]
    index = loader.RowIndex
    monkeypatch.setattr(loader, "RowIndex", lambda tensors: index([]))
    ids = list(range(3, 40))
    want = prefill_logits(load_model(str(dense_path)), ids)
    assert (prefill_logits(model, ids) - want).abs().max() < 1e-5 * want.abs().max()


def test_a_falcon_gguf_of_another_qkv_layout_is_refused(tiny_falcon_7b_dir, tmp_path, gguf_cache):
    """A Falcon file whose ``tensor_data_layout`` is not the converter's q/k/v order is refused before any conversion,
    naming the field and the fix."""
    from specray import LLM

    path = write_classic_gguf(tiny_falcon_7b_dir, tmp_path / "falcon-old.gguf", "falcon", layout="Meta AI original pth")
    with pytest.raises(ValueError, match=r"falcon.tensor_data_layout='Meta AI original pth'.*'jploski'.*pass the "
                                         r"model's HF checkpoint instead"):
        LLM(model=str(path))
    assert not any((gguf_cache / "gguf").glob("falcon-old-*"))


def _rewritten(src: Path, out: Path, arch: str, keys: dict[str, Any], extra: dict[str, torch.Tensor] | None = None
               ) -> Path:
    """``src`` (a float32 GGUF of ``arch``) written again with ``keys`` (``{arch}.`` keys without the prefix, a float or
    an int each) set, and ``extra`` tensors added."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key.removeprefix(f"{arch}.") in keys:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for key, value in keys.items():
        kind = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
        w.add_key_value(f"{arch}.{key}", value, kind)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data)
    for name, t in (extra or {}).items():
        w.add_tensor(name, t.numpy())
    _write_out(w)
    return out


@pytest.mark.parametrize("case, keys, extra, match", [
    # GPT-2's attention has a KV head per query head
    ("gpt2", {"attention.head_count_kv": 2}, None, r"gpt2.attention.head_count_kv=2 for 4 query heads"),
    # the converter's 0 for an MPT of learned positions (attn_config.alibi false), which specray's MPT does not serve
    ("mpt", {"attention.max_alibi_bias": 0.0}, None, r"mpt.attention.max_alibi_bias=0.0 \(learned positions"),
    # MPT's q/k LayerNorms (qk_ln), which no release has
    ("mpt", {}, {"blk.0.attn_q_norm.weight": torch.ones(96)}, r"q/k LayerNorms.*qk_ln"),
    # GPT-BigCode has one KV head or one per query head, never a group of them
    ("starcoder", {"attention.head_count_kv": 2}, None, r"starcoder.attention.head_count_kv=2 for 4 query heads"),
])
def test_a_classic_gguf_the_model_cannot_be_built_from_is_refused(request, tmp_path, gguf_cache, case, keys, extra,
                                                                  match):
    """A file whose metadata or tensors say what the family's model cannot be (its KV heads, positions, norms) is
    refused, naming the field and the fix."""
    fixture, arch, wqkv = CASES[case]
    src = write_classic_gguf(request.getfixturevalue(fixture), tmp_path / "src.gguf", arch)
    path = _rewritten(src, tmp_path / f"{case}-refused.gguf", arch, keys, extra)
    with pytest.raises(ValueError, match=match + r".*pass the model's HF checkpoint instead"):
        load_model(str(path))


def test_classic_gguf_config_reads_what_the_converter_writes(request, tmp_path, gguf_cache):
    """The configs read back: Falcon's layout from its norms and KV heads (7B: multi-query, 40B: the new layout with
    two norms, Falcon 2: with one), the MLP's width from its tensor where the converter's key says 4 x the width,
    StableLM's rotated share and layout from its tensors, GPT-NeoX's residual from its key; BLOOM's context unset where
    the converter wrote the width for it, MPT's ALiBi and clamp from their keys and its softmax scale llama.cpp's,
    StarCoder's multi-query attention from c_attn's rows (its file says one KV head either way) and its scores
    scaled as llama.cpp scales them."""
    def read(case: str):
        fixture, arch, wqkv = CASES[case]
        return load_hf_config(str(write_classic_gguf(request.getfixturevalue(fixture), tmp_path / f"{case}.gguf",
                                                     arch)))

    seven, forty, two = read("falcon_7b"), read("falcon_40b"), read("falcon2")
    assert (seven.new_decoder_architecture, seven.multi_query, seven.parallel_attn) == (False, True, True)
    assert (forty.new_decoder_architecture, forty.num_kv_heads, forty.num_ln_in_parallel_attn) == (True, 2, 2)
    assert (two.new_decoder_architecture, two.num_kv_heads, two.num_ln_in_parallel_attn) == (True, 2, 1)
    assert seven.ffn_hidden_size == 128 and read("gpt2").n_inner == 128 and read("phi2").intermediate_size == 128
    stablelm, parallel = read("stablelm"), read("stablelm_12b")
    assert (stablelm.use_parallel_residual, stablelm.use_qkv_bias, stablelm.qk_layernorm) == (False, True, False)
    assert (parallel.use_parallel_residual, parallel.use_qkv_bias, parallel.qk_layernorm) == (True, False, True)
    assert stablelm.rope_parameters["partial_rotary_factor"] == 0.25
    assert read("stablelm_whole_heads").rope_parameters["partial_rotary_factor"] == 1.0
    assert read("phi2").rope_parameters["partial_rotary_factor"] == 6 / 16
    assert (read("gptneox").use_parallel_residual, read("gptneox_sequential").use_parallel_residual) == (True, False)
    bloom, post_ln = read("bloom"), read("bloom_post_ln")
    assert not hasattr(bloom, "max_position_embeddings") and bloom.tie_word_embeddings
    assert (bloom.n_head, post_ln.apply_residual_connection_post_layernorm) == (6, False)
    mpt = read("mpt")
    assert (mpt.attn_config.alibi_bias_max, mpt.attn_config.clip_qkv, mpt.attn_config.softmax_scale) == (8, 0.8, None)
    assert (mpt.no_bias, mpt.expansion_ratio, mpt.max_seq_len, mpt.n_heads) == (True, 4, 1024, 6)
    mqa, mha = read("starcoder"), read("starcoder_mha")
    assert (mqa.multi_query, mqa.n_inner, mqa.n_positions, mqa.tie_word_embeddings) == (True, 128, 1024, True)
    assert (mha.multi_query, mha.scale_attn_weights, mha.tie_word_embeddings) == (False, True, False)
