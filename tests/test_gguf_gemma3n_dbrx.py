"""GGUF files of Gemma 3n's text model (:mod:`specray.models.gguf_gemma3n`: ``gemma3n``) and DBRX
(:mod:`specray.models.gguf_classic`: ``dbrx``), written here from tiny HF models as llama.cpp's converter writes them
(its Gemma3NModel over Gemma3Model and TextModel, and its DbrxModel: their metadata, gguf-py's tensor names, Gemma 3n's
AltUp projections stacked, its per-layer table padded with zero rows to the vocabulary and ``_scale`` tensors suffixed,
a release's KV-shared layers' k/v written too; DBRX's fused experts viewed per expert, ``w2`` permuted), convert back
into the folders' own tensors and load to transformers' logits on the folders; their linears in Q8_0 load as the same
file converted dense; what the model cannot be built from is refused, naming the fix; a key llama.cpp fixes, missing,
gets llama.cpp's value."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from specray.models import loader
from specray.models.loader import load_hf_config, load_model, resolve_model
from specray_test_checkpoints import gguf_blocks  # tests/checkpoints.py, via conftest
from specray_test_model_checks import SCHEDULES, chunked_logits, max_diff, prompt  # tests/model_checks.py
from tests import test_gemma3n as gemma3n
from tests.test_loader import (_safetensors, _write_gguf_tokenizer, _write_out, assert_converted_as_folder,
                               assert_gguf_serves_as_its_folder, hf_model, loaded_beside_dense, prefill_logits,
                               requantized)


@pytest.fixture(scope="module")
def gguf_cache(specray_cache):
    assert os.environ[loader.CACHE_ENV] == str(specray_cache)
    return specray_cache


# Gemma 3n as the converter takes it: four AltUp streams (it asserts altup_num_inputs == 4), ids past the per-layer
# table in the prompts, two KV-shared layers; the second variant's active stream the second, sparsity 0.8 on its first
# layer alone and a tighter soft cap, written with the release's k/v tensors on its KV-shared layers
GEMMA3N_VARIANTS = {"e2b_like": dict(altup_num_inputs=4),
                    "active_1": dict(altup_num_inputs=4, altup_active_idx=1, final_logit_softcapping=5.0,
                                     activation_sparsity_pattern=[0.8, 0.0, 0.0, 0.0])}
# the config fields the file carries (altup_coef_clip, a training setting, it does not: left at its default)
GEMMA3N_FIELDS = ("model_type", "architectures", "vocab_size", "vocab_size_per_layer_input", "hidden_size",
                  "hidden_size_per_layer_input", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "layer_types", "sliding_window", "rope_parameters",
                  "num_kv_shared_layers", "altup_num_inputs", "altup_active_idx", "altup_correct_scale", "laurel_rank",
                  "activation_sparsity_pattern", "final_logit_softcapping", "max_position_embeddings", "rms_norm_eps",
                  "tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id", "hidden_activation")


@pytest.fixture(scope="module")
def gemma3n_dirs(tmp_path_factory) -> dict[str, Path]:
    return {case: gemma3n.save_tiny(tmp_path_factory.mktemp(f"gemma3n_{case}"), seed=50 + i, **overrides)
            for i, (case, overrides) in enumerate(sorted(GEMMA3N_VARIANTS.items()))}


# ---- what llama.cpp's converter writes ---------------------------------------------------------------------------


def _normal_quantile(share: float) -> float:
    """Gemma3NModel's activation_sparsity_scale entry: Normal(0, 1).icdf of the share in float32."""
    return torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(share, dtype=torch.float32)).item()


def write_gemma3n_gguf(folder: Path, out: Path, shared_kv_tensors: bool = False) -> Path:
    """A float32 GGUF of a Gemma 3n text folder as llama.cpp's converter writes one: TextModel's, Gemma3Model's and
    Gemma3NModel's metadata (per-layer MLP widths, both RoPE bases, the soft cap, the window, AltUp's streams, the
    per-layer inputs' width, KV sharing, the sparsity's normal quantiles, the sliding flags), the byte-level BPE
    tokenizer, every tensor under gguf-py's name after the converter's own steps: ``.weight`` after a name ending
    ``_scale``, the embedding tables padded with zero rows to the vocabulary, AltUp's projections stacked per kind,
    norms as they are, no ``lm_head``. ``shared_kv_tensors``: the KV-shared layers' k/v projections and k norm, which
    a release's checkpoint (transformers 4's) has and the converter writes, added (random)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder).to_dict()
    layers, rope = cfg["num_hidden_layers"], cfg["rope_parameters"]
    w = gguf.GGUFWriter(str(out), "gemma3n")
    # TextModel.set_gguf_parameters
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    # Gemma3Model.set_gguf_parameters (the config has no sliding_window_pattern: the window is written)
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    # Gemma3NModel.set_gguf_parameters
    w.add_altup_active_idx(cfg["altup_active_idx"])
    w.add_altup_num_inputs(cfg["altup_num_inputs"])
    w.add_embedding_length_per_layer_input(cfg["hidden_size_per_layer_input"])
    w.add_shared_kv_layers(cfg["num_kv_shared_layers"])
    w.add_activation_sparsity_scale([_normal_quantile(s) for s in cfg["activation_sparsity_pattern"]])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3N, layers)
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, value in load_file(str(folder / "model.safetensors")).items():
        value = value.float()
        if name == "lm_head.weight":  # (no language_model. in its name: skipped)
            continue
        if name.startswith(("model.altup_projections.", "model.altup_unembed_projections.")):
            prefix, index, _ = name.rsplit(".", 2)
            stacks.setdefault(prefix, {})[int(index)] = value
            continue
        if name.endswith(("embed_tokens.weight", "embed_tokens_per_layer.weight")) \
                and value.shape[0] < cfg["vocab_size"]:  # zero rows for the vision / audio ids
            value = torch.cat([value, value.new_zeros(cfg["vocab_size"] - value.shape[0], value.shape[1])])
        if name.endswith("_scale"):
            name += ".weight"
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), value.numpy())
    for prefix, parts in stacks.items():  # model.altup_projections.weight [3, H, H], ...
        stacked = torch.stack([parts[i] for i in range(len(parts))])
        w.add_tensor(names.get_name(f"{prefix}.weight", try_suffixes=(".weight",)), stacked.numpy())
    if shared_kv_tensors:
        generator = torch.Generator().manual_seed(7)
        kv_rows, head_dim = cfg["num_key_value_heads"] * cfg["head_dim"], cfg["head_dim"]
        for i in range(layers - cfg["num_kv_shared_layers"], layers):
            for kind, shape in (("attn_k", (kv_rows, cfg["hidden_size"])), ("attn_v", (kv_rows, cfg["hidden_size"])),
                                ("attn_k_norm", (head_dim,))):
                w.add_tensor(f"blk.{i}.{kind}.weight", torch.randn(shape, generator=generator).numpy())
    _write_out(w)
    return out


def write_dbrx_gguf(folder: Path, out: Path) -> Path:
    """A float32 GGUF of a DBRX folder as llama.cpp's DbrxModel writes one: its metadata (the RoPE base from
    ``attn_config.rope_theta``, ``clip_qkv`` as ``attention.clamp_kqv``, the experts' count and top k, the epsilon
    1e-5), the byte-level BPE tokenizer, ``Wqkv`` as ``attn_qkv`` and the fused experts viewed as [experts, width,
    hidden] (``w2`` permuted to [experts, hidden, width]) under gguf-py's names with ``.weight`` added."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    attn, ffn = cfg["attn_config"], cfg["ffn_config"]
    experts, width, hidden = ffn["moe_num_experts"], ffn["ffn_hidden_size"], cfg["d_model"]
    w = gguf.GGUFWriter(str(out), "dbrx")
    w.add_block_count(cfg["n_layers"])
    w.add_context_length(cfg["max_seq_len"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(width)
    w.add_head_count(cfg["n_heads"])
    w.add_head_count_kv(attn["kv_n_heads"])
    w.add_rope_freq_base(attn["rope_theta"])
    w.add_clamp_kqv(attn["clip_qkv"])
    w.add_expert_count(experts)
    w.add_expert_used_count(ffn["moe_top_k"])
    w.add_layer_norm_eps(1e-5)
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DBRX, cfg["n_layers"])
    for name, value in load_file(str(folder / "model.safetensors")).items():
        value = value.float()
        if ".ffn.experts.mlp." in name:
            value = value.view(experts, width, hidden)
            if name.endswith(".w2"):
                value = value.permute(0, 2, 1)
            name += ".weight"
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), value.contiguous().numpy())
    _write_out(w)
    return out


def _rewritten(src: Path, out: Path, keys: dict[str, Any] | None = None, drop: tuple[str, ...] = (),
               q8: tuple[str, ...] = ()) -> Path:
    """``src`` (float32) written again with its ``{arch}.`` ``keys`` (without the prefix) set (a float, an int, a
    string or a list; None: the key dropped), the tensors named in ``drop`` left out and those in ``q8`` in Q8_0."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    keys = keys or {}
    w = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key.removeprefix(f"{arch}.") in keys:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for key, value in keys.items():
        if value is None:
            continue
        if isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        else:
            kind = (gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.STRING
                    if isinstance(value, str) else gguf.GGUFValueType.UINT32)
            w.add_key_value(f"{arch}.{key}", value, kind)
    for t in reader.tensors:
        if t.name in q8:
            w.add_tensor(t.name, gguf_blocks(np.array(t.data), "Q8_0"), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif t.name not in drop:
            w.add_tensor(t.name, t.data)
    _write_out(w)
    return out


# ---- Gemma 3n ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(GEMMA3N_VARIANTS))
def test_a_gemma3n_gguf_converts_to_its_folder_and_matches_transformers(gemma3n_dirs, tmp_path, gguf_cache, case):
    """A Gemma 3n GGUF as llama.cpp writes it converts into the folder's own tensors (every one, by the folder's names,
    equal in float32: AltUp's projections unstacked, the per-layer table's padding cut, the KV-shared layers' k/v of a
    release's file dropped), its config is the folder's, and our model on it gives transformers' logits on the folder
    over a prefill and over chunks and decode steps past the window (ids past the per-layer table among them)."""
    folder = gemma3n_dirs[case]
    path = write_gemma3n_gguf(folder, tmp_path / f"{case}.gguf", shared_kv_tensors=case == "active_1")
    ours, theirs = load_hf_config(str(path)), load_hf_config(str(folder))
    assert {f: getattr(ours, f, None) for f in GEMMA3N_FIELDS} == {f: getattr(theirs, f, None) for f in GEMMA3N_FIELDS}
    assert_converted_as_folder(folder, path)
    model = load_model(str(path), pack=False)
    assert max(prompt()) >= theirs.vocab_size_per_layer_input
    reference = gemma3n.hf_logits(folder)
    for schedule in SCHEDULES.values():
        assert max_diff(chunked_logits(model, prompt(), schedule), reference) < gemma3n.TOL


def test_a_gemma3n_gguf_serves_as_its_folder(gemma3n_dirs, tmp_path, gguf_cache):
    """The engine on the GGUF, its tokenizer read from the file: greedy output under n-gram drafts equals the
    folder's."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    folder = gemma3n_dirs["e2b_like"]
    path = write_gemma3n_gguf(folder, tmp_path / "gemma3n.gguf")
    prompts = ["The quick brown fox", "def add(a, b):"]
    llms = [LLM(model=str(m), max_model_len=128, speculative_config=gemma3n.NGRAM) for m in (folder, path)]
    outs = [runs.token_ids(llm.generate(prompts, runs.greedy(16), use_tqdm=False)) for llm in llms]
    assert outs[0] == outs[1]


def test_a_gemma3n_gguf_with_q8_0_linears_loads_as_its_dense_conversion(gemma3n_dirs, tmp_path, gguf_cache,
                                                                         monkeypatch):
    """Its layers' weights in Q8_0 (those of whole blocks) keep their integers through the conversion, and the model
    loads to the weights and logits of the same file converted dense, which are transformers' on the folder but for
    Q8_0's rounding. Its per-layer table in Q8_0 too: the converter's zero rows are found in its blocks and cut."""
    folder = gemma3n_dirs["e2b_like"]
    f32 = _rewritten(write_gemma3n_gguf(folder, tmp_path / "f32.gguf"), tmp_path / "table.gguf",
                     q8=("per_layer_token_embd.weight",))
    path = requantized(f32, tmp_path / "q8.gguf")
    dense_path = Path(shutil.copy(path, tmp_path / "dense.gguf"))
    assert load_hf_config(str(path)).vocab_size_per_layer_input == 256
    kept = sorted(n for n in _safetensors(resolve_model(str(path)).path) if n.endswith(".q_weight"))
    assert "model.layers.0.mlp.gate_proj.q_weight" in kept and "model.layers.1.self_attn.q_proj.q_weight" in kept
    model, ref = loaded_beside_dense(path, dense_path, monkeypatch)
    logits = chunked_logits(model, prompt(), SCHEDULES["prefill"])
    assert torch.equal(logits, chunked_logits(ref, prompt(), SCHEDULES["prefill"]))
    theirs = gemma3n.hf_logits(folder)
    # Q8_0's rounding, no more (through the tiny model's random AltUp routers, which amplify it: about 8%)
    assert 0 < (logits - theirs).abs().max() < 0.15 * theirs.abs().max()


@pytest.fixture(scope="module")
def gemma3n_gguf(gemma3n_dirs, tmp_path_factory) -> Path:
    # (with a release's k/v on its KV-shared layers: what llama.cpp loads, and what a file read as sharing none needs)
    return write_gemma3n_gguf(gemma3n_dirs["e2b_like"], tmp_path_factory.mktemp("gemma3n_gguf") / "src.gguf",
                              shared_kv_tensors=True)


@pytest.mark.parametrize("keys, drop, match", [
    # its stacked projections say 4 streams
    ({"altup.num_inputs": 3}, (), r"altup_proj.weight of shape \[3, 64, 64\] for gemma3n.altup.num_inputs=3"),
    ({"altup.active_idx": 4}, (), r"gemma3n.altup.active_idx=4 for 4 AltUp streams"),
    # Gemma 3n has one count of KV heads
    ({"attention.head_count_kv": [2, 2, 1, 1]}, (), r"gemma3n.attention.head_count_kv=\[2, 2, 1, 1\]"),
    # a sparsity of 1 (+inf): no share Gemma 3n serves
    ({"activation_sparsity_scale": [float("inf"), 0.0, 0.0, 0.0]}, (), r"activation_sparsity_scale\[0\]=inf"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 8.0}, (), r"gemma3n.rope.scaling.type='linear'"),
    ({"attention.sliding_window_pattern": [1, 0, 1]}, (), r"3 values of gemma3n.attention.sliding_window_pattern"),
    ({}, ("blk.2.laurel_l.weight",), r"does not hold the tensors of the Gemma 3n.*missing \['blk.2.laurel_l.weight'\]"),
    ({}, ("altup_unembd_proj.weight",), r"has no altup_unembd_proj.weight"),
])
def test_a_gemma3n_gguf_the_model_cannot_be_built_from_is_refused(gemma3n_gguf, tmp_path, gguf_cache, keys, drop,
                                                                   match):
    """A file whose metadata or tensors say what Gemma 3n cannot be is refused before any tensor is converted, naming
    the key or tensor and the fix."""
    path = _rewritten(gemma3n_gguf, tmp_path / "refused.gguf", keys, drop)
    with pytest.raises(ValueError, match=match + r".*(pass the model's HF checkpoint|pass its HF checkpoint)"):
        load_model(str(path))
    assert not any((gguf_cache / "gguf").glob("refused-*"))


def test_gemma3n_gguf_config_takes_llama_cpp_s_values_where_a_key_is_missing(gemma3n_gguf, tmp_path, gguf_cache):
    """Without the keys llama.cpp's Gemma 3n fixes (no converter omits them), the config is llama.cpp's: its first 10
    layers sparse at 0.95, K/V shared from layer 20 (none of 4 layers), a soft cap of 30, every fifth layer full, the
    sliding layers at the full layers' base."""
    path = _rewritten(gemma3n_gguf, tmp_path / "bare.gguf", {
        "activation_sparsity_scale": None, "attention.shared_kv_layers": None, "final_logit_softcapping": None,
        "attention.sliding_window_pattern": None, "rope.freq_base_swa": None})
    config = load_hf_config(str(path))
    assert config.activation_sparsity_pattern == [0.95] * 4 and config.num_kv_shared_layers == 0
    assert config.final_logit_softcapping == 30.0 and config.layer_types == ["sliding_attention"] * 4
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 1e6
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6


def test_gemma3n_gguf_config_reads_the_sparsity_and_the_end_of_turn(gemma3n_gguf):
    """Each layer's sparsity is the shortest decimal whose float32 quantile is the file's (0.95 and 0.6 back, -inf: 0);
    the vocabulary's ``<end_of_turn>`` joins the end-of-sequence ids."""
    from specray.models.gguf_gemma3n import gemma3n_gguf_config
    from specray.models.gguf_read import read_model_gguf

    get, tensors = read_model_gguf(gemma3n_gguf, "gemma3n")
    config = gemma3n_gguf_config(get, tensors, None)
    assert config.activation_sparsity_pattern == [0.95, 0.6, 0.0, 0.0] and config.eos_token_id == 2
    tokens = [f"t{i}" for i in range(200)] + ["<end_of_turn>"]
    assert gemma3n_gguf_config(get, tensors, tokens).eos_token_id == [2, 200]


# ---- DBRX --------------------------------------------------------------------------------------------------------


def _dbrx_fields(config) -> dict[str, Any]:
    attn, ffn = config.attn_config, config.ffn_config
    return {"d_model": config.d_model, "n_heads": config.n_heads, "n_layers": config.n_layers,
            "max_seq_len": config.max_seq_len, "vocab_size": config.vocab_size, "rope": config.rope_parameters,
            "tie": config.tie_word_embeddings, "clip_qkv": attn.clip_qkv, "kv_n_heads": attn.kv_n_heads,
            "rope_theta": attn.rope_theta, "experts": ffn.moe_num_experts, "top_k": ffn.moe_top_k,
            "width": ffn.ffn_hidden_size, "normalize": ffn.moe_normalize_expert_weights,
            "act": (ffn.ffn_act_fn or {}).get("name", "silu"), "eos": config.eos_token_id}


def test_a_dbrx_gguf_serves_as_its_folder(tiny_dbrx_dir, tmp_path, gguf_cache):
    """DBRX's GGUF: its config is the folder's (the RoPE base of 500000 in attn_config and rope_parameters alike,
    clip_qkv, the experts), it converts into the folder's own tensors (the experts fused back, w2 transposed back), our
    model on it gives transformers' logits on the folder, and the engine's greedy output on it with n-gram drafts
    equals the folder's."""
    path = write_dbrx_gguf(tiny_dbrx_dir, tmp_path / "dbrx.gguf")
    ours = _dbrx_fields(load_hf_config(str(path)))
    assert ours == _dbrx_fields(load_hf_config(str(tiny_dbrx_dir)))
    assert ours["rope_theta"] == ours["rope"]["rope_theta"] == 500000.0
    assert_gguf_serves_as_its_folder(tiny_dbrx_dir, path, ["model_type", "architectures"])


def test_a_dbrx_gguf_with_q8_0_linears_loads_as_its_dense_conversion(tiny_dbrx_dir, tmp_path, gguf_cache,
                                                                      monkeypatch):
    """Its layers' linears and experts in Q8_0 load to the weights and logits of the same file converted dense, which
    are transformers' on the folder but for Q8_0's rounding; the routers keep their integers (the attention's names
    and the fused experts are stored dense: gguf_classic's docstring)."""
    path = requantized(write_dbrx_gguf(tiny_dbrx_dir, tmp_path / "f32.gguf"), tmp_path / "q8.gguf")
    dense_path = Path(shutil.copy(path, tmp_path / "dense.gguf"))
    kept = sorted(n for n in _safetensors(resolve_model(str(path)).path) if n.endswith(".q_weight"))
    assert kept == [f"transformer.blocks.{i}.ffn.router.layer.q_weight" for i in range(2)]
    model, ref = loaded_beside_dense(path, dense_path, monkeypatch)
    ids = list(range(3, 40))
    logits = prefill_logits(model, ids)
    assert torch.equal(logits, prefill_logits(ref, ids))
    with torch.no_grad():
        theirs = hf_model(tiny_dbrx_dir)(torch.tensor([ids])).logits[0]
    # Q8_0's rounding, no more (a token's top 2 experts of 8 may change with it: about 6%)
    assert 0 < (logits - theirs).abs().max() < 0.1 * theirs.abs().max()


@pytest.fixture(scope="module")
def dbrx_gguf(tiny_dbrx_dir, tmp_path_factory) -> Path:
    return write_dbrx_gguf(tiny_dbrx_dir, tmp_path_factory.mktemp("dbrx_gguf") / "src.gguf")


@pytest.mark.parametrize("keys, drop, match", [
    # DBRX's LayerNorms take nn.LayerNorm's epsilon
    ({"attention.layer_norm_epsilon": 1e-6}, (), r"dbrx.attention.layer_norm_epsilon=1e-06"),
    # its experts' stack says 8
    ({"expert_count": 4}, (), r"blk.0.ffn_gate_exps.weight of shape \[8, 32, 64\] for dbrx.expert_count=4"),
    ({"rope.dimension_count": 8}, (), r"dbrx.rope.dimension_count=8 for heads of 16"),
    # llama.cpp's loader needs the clamp
    ({"attention.clamp_kqv": None}, (), r"lacks dbrx.attention.clamp_kqv"),
    # DBRX's head is never tied
    ({}, ("output.weight",), r"does not hold the tensors of the DBRX.*missing \['output.weight'\]"),
])
def test_a_dbrx_gguf_the_model_cannot_be_built_from_is_refused(dbrx_gguf, tmp_path, gguf_cache, keys, drop, match):
    """A DBRX file whose metadata or tensors say what DBRX cannot be is refused, naming the key or tensor and the
    fix."""
    path = _rewritten(dbrx_gguf, tmp_path / "refused.gguf", keys, drop)
    with pytest.raises(ValueError, match=match + r".*(pass the model's HF checkpoint|pass its HF checkpoint)"):
        load_model(str(path))
