"""GGUF files of Kimi-Linear (``kimi-linear``: :mod:`specray.models.gguf_kimi_linear`) and Jais 2 (``jais2``: a row of
:mod:`specray.models.gguf_llama_family`), written here from tiny HF models as llama.cpp's converter lays them out
(its KimiLinearModel: the layers' kinds as per-layer KV-head counts, MLA as MQA with ``kv_b_proj`` split per head,
the KDA convs as numpy ``(1, C, 1, K)``, ``A_log`` as ``-exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, the experts
stacked; its Jais2Model: a plain TextModel with LayerNorms' epsilon and biases), convert back into the folders' own
tensors, give transformers' logits on the folders (the recurrent state carried over chunks and decode steps) and the
folders' greedy engine tokens under n-gram drafts; each of the converter's transforms, left out of the file, makes the
conversion differ; what the reader cannot build the model from is refused, naming the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from specray.models import loader
from specray.models.loader import load_hf_config, load_model, resolve_model
from specray_test_checkpoints import gguf_blocks  # tests/checkpoints.py, via conftest
from tests.test_kimi_linear import hf_kimi
from tests.test_loader import (_block_type, _safetensors, _write_gguf_tokenizer, _write_out,
                               assert_gguf_serves_as_its_folder, hf_model, loaded_beside_dense,
                               prefill_logits)


@pytest.fixture(scope="module")
def gguf_cache(specray_cache):
    assert os.environ[loader.CACHE_ENV] == str(specray_cache)
    return specray_cache


def _kimi_folder(path: Path, **overrides) -> Path:
    """A tiny Kimi-Linear folder (tests/test_kimi_linear.py's, every part random) with a tokenizer, routed as
    llama.cpp routes a ``kimi-linear`` file: one group (the converter writes none; llama.cpp groups none)."""
    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path)
    hf = hf_kimi(3, vocab_size=len(tok), eos_token_id=tok.eos_token_id, num_expert_group=1, topk_group=1,
                 **overrides)
    hf.save_pretrained(path, safe_serialization=True)
    return path


def assert_kimi_converted_as_folder(folder: Path, path: Path) -> None:
    """:func:`tests.test_loader.assert_converted_as_folder` for Kimi-Linear: every tensor equal in float32, but
    ``A_log``, which comes back as ``log(-A)`` of the file's ``A = -exp(A_log)`` (within float32's rounding)."""
    source = {k: v.float() for k, v in _safetensors(folder).items()
              if not (k == "lm_head.weight" and load_hf_config(str(folder)).tie_word_embeddings)}
    converted = _safetensors(resolve_model(str(path)).path)
    assert sorted(converted) == sorted(source)
    assert [k for k, v in source.items() if not (torch.allclose(converted[k], v, rtol=1e-6, atol=1e-6)
                                                 if k.endswith(".A_log") else torch.equal(converted[k], v))] == []


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    return _kimi_folder(tmp_path_factory.mktemp("kimi_linear_gguf"))


# ---- what llama.cpp's KimiLinearModel writes ----------------------------------------------------------------------

# the converter's transforms that change values, each left out once (its conv reshape and renames change none)
KIMI_TRANSFORMS = ("A_log", "kv_b", "dense_mlp", "experts")


def write_kimi_gguf(folder: Path, out: Path, split_kv_b: bool = True, skip: str | None = None,
                    keys: dict | None = None, types=None) -> Path:
    """A GGUF of a Kimi-Linear folder as llama.cpp's KimiLinearModel writes one: MLA as MQA (one KV head, a count
    per layer: 0 marks a KDA layer), the KDA sizes (``kda.head_dim``, ``ssm.conv_kernel``), the latent attention's
    (``kv_lora_rank``, ``q_lora_rank`` where set, ``key_length_mla``, ``value_length_mla``, ``rope.dimension_count``),
    the router (sigmoid, its scale, the shared experts, the dense first layers); tensors renamed through gguf-py's
    map after the converter's own transforms: the convs as numpy ``(1, C, 1, K)``, ``A_log`` as ``-exp(A_log)``,
    ``dt_bias`` as ``dt_proj.bias``, ``kv_b_proj`` split per head into a transposed ``k_b`` and ``v_b`` (or, older
    converters, whole: ``split_kv_b`` False), the experts stacked per projection, the release's ``mlp.`` names of the
    dense MLP. ``skip``: one of :data:`KIMI_TRANSFORMS` left undone (the tensor written as the folder has it);
    ``keys``: metadata written besides (or, ``None`` values, left out); ``types``: a GGUF name's llama.cpp type."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    lin = cfg["linear_attn_config"]
    keys = keys or {}
    w = gguf.GGUFWriter(str(out), "kimi-linear")
    w.add_block_count(layers)
    w.add_context_length(cfg["model_max_length"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv([1 if i + 1 in lin["full_attn_layers"] else 0 for i in range(layers)])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_token"])
    if "expert_gating_func" not in keys:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_ssm_conv_kernel(lin["short_conv_kernel_size"])
    w.add_kda_head_dim(lin["head_dim"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(cfg["kv_lora_rank"])
    w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    w.add_key_length(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["num_shared_experts"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    for key, value in keys.items():
        if value is not None:
            w.add_uint32(f"kimi-linear.{key}", value)
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.KIMI_LINEAR, layers)

    def add(gguf_name: str, tensor: torch.Tensor) -> None:
        kind = _block_type(types, gguf_name, tensor.shape)
        if kind:
            w.add_tensor(gguf_name, gguf_blocks(tensor.reshape(-1, tensor.shape[-1]).numpy(), kind).reshape(
                *tensor.shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            w.add_tensor(gguf_name, tensor.float().contiguous().numpy())

    stacked: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, value in load_file(str(folder / "model.safetensors")).items():
        value = value.float()
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if ".experts." in name:  # model.layers.i.block_sparse_moe.experts.e.w1.weight: stacked per projection
            parts = name.split(".")
            stacked.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = value
            continue
        if name.endswith("kv_b_proj.weight") and split_kv_b and skip != "kv_b":
            kv_b = value.view(heads, cfg["qk_nope_head_dim"] + cfg["v_head_dim"], -1)
            k_b, v_b = kv_b.split([cfg["qk_nope_head_dim"], cfg["v_head_dim"]], dim=1)
            for part, tensor in (("k_b_proj", k_b.transpose(1, 2)), ("v_b_proj", v_b)):
                add(names.get_name(name.replace("kv_b_proj", part), try_suffixes=(".weight",)), tensor)
            continue
        if name.endswith("kv_b_proj.weight") and skip == "kv_b":  # split, k_b reshaped instead of transposed
            kv_b = value.view(heads, cfg["qk_nope_head_dim"] + cfg["v_head_dim"], -1)
            k_b, v_b = kv_b.split([cfg["qk_nope_head_dim"], cfg["v_head_dim"]], dim=1)
            layer = name.split(".")[2]
            add(f"blk.{layer}.attn_k_b.weight", k_b.reshape(heads, -1, k_b.shape[1]))
            add(f"blk.{layer}.attn_v_b.weight", v_b)
            continue
        if name.endswith("_conv1d.weight"):  # [C, 1, K] -> numpy (1, C, 1, K)
            value = value.reshape(1, value.shape[0], 1, value.shape[-1])
        if name.endswith(".A_log") and skip != "A_log":
            value = -torch.exp(value)
        if name.endswith(".dt_bias"):
            name = name.replace(".dt_bias", ".dt_proj.bias")
        if name.endswith("e_score_correction_bias"):
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if ".block_sparse_moe." in name and name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")) \
                and ".shared_experts." not in name:  # the dense MLP: the release's mlp.*
            name = name.replace(".block_sparse_moe.", ".mlp.")
            if skip == "dense_mlp":  # gate and up under each other's names
                name = name.replace("gate_proj", "@").replace("up_proj", "gate_proj").replace("@", "up_proj")
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        add(gguf_name, value)
    projections = {"w1": "gate", "w3": "up", "w2": "down"}
    if skip == "experts":  # gate and up stacked under each other's names
        projections = {"w1": "up", "w3": "gate", "w2": "down"}
    for (layer, projection), experts in stacked.items():
        add(f"blk.{layer}.ffn_{projections[projection]}_exps.weight",
            torch.stack([experts[e] for e in sorted(experts)]))
    _write_out(w)
    return out


KIMI_FIELDS = ("model_type", "architectures", "layer_types", "mlp_layer_types", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
               "qk_rope_head_dim", "v_head_dim", "linear_attn_config", "num_experts", "num_experts_per_token",
               "num_shared_experts", "num_expert_group", "topk_group", "moe_renormalize", "routed_scaling_factor",
               "first_k_dense_replace", "moe_intermediate_size", "intermediate_size", "tie_word_embeddings",
               "vocab_size", "eos_token_id", "max_position_embeddings")


def test_a_kimi_linear_gguf_serves_as_its_folder(kimi_dir, tmp_path, gguf_cache):
    """A Kimi-Linear GGUF as llama.cpp writes it reads back the folder's config and converts into its tensors (every
    one, by transformers' names, equal in float32); our model on it gives transformers' logits on the folder over one
    prefill, uneven chunks and decode steps (two sequences batched), and the engine's greedy tokens with n-gram drafts
    on it equal the folder's."""
    import specray_test_hybrid_models as hybrid  # tests/hybrid_models.py (registered by conftest)
    from specray import LLM

    path = write_kimi_gguf(kimi_dir, tmp_path / "kimi.gguf")
    ours, theirs = load_hf_config(str(path)), load_hf_config(str(kimi_dir))
    assert {f: getattr(ours, f, None) for f in KIMI_FIELDS} == {f: getattr(theirs, f, None) for f in KIMI_FIELDS}
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    assert_kimi_converted_as_folder(kimi_dir, path)
    hybrid.check_prefill_chunks_and_decode(load_model(str(path), pack=False), hf_model(kimi_dir))
    outs = [hybrid.generate(LLM(model=str(m), max_model_len=128, speculative_config=hybrid.NGRAM), hybrid.greedy(12))
            for m in (kimi_dir, path)]
    assert outs[0] == outs[1]


def test_a_kimi_linear_gguf_of_the_other_layouts_converts_to_its_folder(tmp_path, gguf_cache):
    """A release with a query LoRA (``attn_q_a`` / ``attn_q_a_norm`` / ``attn_q_b``), two dense layers, its latent
    attention's ``kv_b_proj`` whole (``attn_kv_b``, older converters) and its KDA layers first and last of five,
    convs 3 long, converts into the folder's tensors and gives transformers' logits; a file without an ``output``
    tensor (llama.cpp's head is then the embedding) converts with its head written out from ``token_embd``, untied
    (transformers' Kimi-Linear ties nothing)."""
    import specray_test_hybrid_models as hybrid  # tests/hybrid_models.py (registered by conftest)

    folder = _kimi_folder(tmp_path / "kimi_q_lora", q_lora_rank=24, num_hidden_layers=5, first_k_dense_replace=2,
                          linear_attn_config=dict(head_dim=8, num_heads=4, short_conv_kernel_size=3,
                                                  kda_layers=[1, 3, 5], full_attn_layers=[2, 4]))
    path = write_kimi_gguf(folder, tmp_path / "kimi_q_lora.gguf", split_kv_b=False)
    ours = load_hf_config(str(path))
    assert (ours.q_lora_rank, ours.first_k_dense_replace, ours.linear_attn_config["full_attn_layers"]) == \
        (24, 2, [2, 4])
    assert_kimi_converted_as_folder(folder, path)
    hybrid.check_prefill_chunks_and_decode(load_model(str(path), pack=False), hf_model(folder))
    tied = _kimi_folder(tmp_path / "kimi_tied", tie_word_embeddings=True)
    path = write_kimi_gguf(tied, tmp_path / "kimi_tied.gguf")
    assert not load_hf_config(str(path)).tie_word_embeddings
    converted = _safetensors(resolve_model(str(path)).path)
    assert torch.equal(converted["lm_head.weight"], converted["model.embed_tokens.weight"])
    assert torch.equal(converted["model.embed_tokens.weight"],
                       _safetensors(tied)["model.embed_tokens.weight"].float())


@pytest.mark.parametrize("skip", KIMI_TRANSFORMS)
def test_each_kimi_linear_transform_shows_in_the_conversion(kimi_dir, tmp_path, gguf_cache, skip):
    """Each of the converter's transforms left out of the file (the tensor written as the folder has it, or, the
    stacked MLPs, gate and up swapped) makes the conversion differ from the folder or be refused: the reader undoes
    each one, and the shapes are such that none is undone by luck."""
    path = write_kimi_gguf(kimi_dir, tmp_path / f"kimi-no-{skip}.gguf", skip=skip)
    with pytest.raises((AssertionError, ValueError, RuntimeError)):
        assert_kimi_converted_as_folder(kimi_dir, path)


def test_a_kimi_linear_gguf_with_q8_0_linears_loads_as_its_dense_conversion(kimi_dir, tmp_path, gguf_cache,
                                                                            monkeypatch):
    """Q8_0 projections and experts (the KDA layers' q/k/v, which our model fuses, among them) keep their integers
    and load as the same file converted dense."""
    types = lambda name: "Q8_0" if name.endswith((".attn_q.weight", ".attn_k.weight", ".attn_v.weight",  # noqa: E731
                                                  "_exps.weight", ".attn_output.weight")) else None
    path = write_kimi_gguf(kimi_dir, tmp_path / "kimi-q8.gguf", types=types)
    dense = tmp_path / "kimi-q8-dense.gguf"
    dense.write_bytes(path.read_bytes())
    kept = sorted(n for n in _safetensors(resolve_model(str(path)).path) if n.endswith(".q_weight"))
    assert any(".self_attn.q_proj." in n for n in kept) and any(".experts.1.w2." in n for n in kept), kept
    loaded_beside_dense(path, dense, monkeypatch)


@pytest.mark.parametrize("keys, match", [
    ({"expert_gating_func": 1}, r"routes its experts by kimi-linear.expert_gating_func=1, not sigmoid"),
    ({"moe_latent_size": 16}, r"kimi-linear.moe_latent_size=16: Kimi K3's latent experts"),
])
def test_a_kimi_linear_gguf_the_model_cannot_be_built_from_is_refused(kimi_dir, tmp_path, gguf_cache, keys, match):
    """A softmax router, or Kimi K3's latent experts under the same architecture, is refused naming the key and
    the way out, before any conversion is left behind."""
    path = write_kimi_gguf(kimi_dir, tmp_path / "tiny-kimi-refused.gguf", keys=keys)
    with pytest.raises(ValueError, match=match + r".*pass the model's HF checkpoint instead"):
        resolve_model(str(path))
    assert not any((gguf_cache / "gguf").glob("tiny-kimi-refused-*"))


# ---- Jais 2: llama.cpp's Jais2Model, a plain TextModel --------------------------------------------------------------


@pytest.fixture(scope="module")
def jais2_dir(make_tiny_model, tmp_path_factory) -> Path:
    # conftest's tiny Jais 2 with an epsilon and a RoPE base apart from the defaults (1e-5, 10000), so that the
    # file's are read: LayerNorms with biases, biased attention, a gateless relu^2 MLP with biases, 2 KV heads of 4
    return make_tiny_model(tmp_path_factory.mktemp("jais2_gguf"), "jais2", seed=65, layer_norm_eps=1e-2,
                           hidden_act="relu2", attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                           num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500.0})


def write_jais2_gguf(folder: Path, out: Path, types=None, eps: bool = True) -> Path:
    """A GGUF of a Jais 2 folder as llama.cpp's Jais2Model writes one: TextModel's sizes, RoPE base, LayerNorm
    epsilon (``attention.layer_norm_epsilon``) and head size, the rotated dims (the whole head), every tensor (biases
    too) under gguf-py's name, no q/k reordering. ``eps`` False: the epsilon left out."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), "jais2")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    if eps:
        w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.JAIS2, cfg["num_hidden_layers"])
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        kind = _block_type(types, gguf_name, tensor.shape)
        if kind:
            w.add_tensor(gguf_name, gguf_blocks(tensor.float().numpy(), kind),
                         raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            w.add_tensor(gguf_name, tensor.float().numpy())
    _write_out(w)
    return out


def test_a_jais2_gguf_serves_as_its_folder(jais2_dir, tmp_path, gguf_cache):
    """A Jais 2 GGUF reads back the folder's config (LayerNorms' epsilon, biases, head size, relu^2), converts into
    its tensors, gives transformers' logits and the folder's greedy engine tokens under n-gram drafts."""
    path = write_jais2_gguf(jais2_dir, tmp_path / "jais2.gguf")
    assert_gguf_serves_as_its_folder(jais2_dir, path, (
        "model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "hidden_act", "attention_bias", "mlp_bias", "layer_norm_eps", "intermediate_size", "tie_word_embeddings",
        "vocab_size", "rope_parameters", "max_position_embeddings"))


def test_a_jais2_gguf_with_q8_0_linears_loads_as_its_dense_conversion(jais2_dir, tmp_path, gguf_cache,
                                                                     monkeypatch):
    """Q8_0 linears keep their integers and load to the weights and logits of the same file converted dense, which
    are transformers' on the folder but for Q8_0's rounding."""
    types = lambda name: "Q8_0" if name.startswith("blk.") and name.endswith(".weight") else None  # noqa: E731
    path = write_jais2_gguf(jais2_dir, tmp_path / "jais2-q8.gguf", types=types)
    dense = tmp_path / "jais2-q8-dense.gguf"
    dense.write_bytes(path.read_bytes())
    assert any(n.endswith(".q_weight") for n in _safetensors(resolve_model(str(path)).path))
    model, ref = loaded_beside_dense(path, dense, monkeypatch)
    ids = list(range(3, 40))
    logits = prefill_logits(model, ids)
    assert torch.equal(logits, prefill_logits(ref, ids))
    with torch.no_grad():
        theirs = hf_model(jais2_dir)(torch.tensor([ids])).logits[0]
    assert 0 < (logits - theirs).abs().max() < 0.05 * theirs.abs().max()  # Q8_0's rounding, no more


def test_a_jais2_gguf_without_its_layer_norm_epsilon_is_refused(jais2_dir, tmp_path, gguf_cache):
    """Jais 2's LayerNorms' epsilon is read from the file (not a default): a file without it is refused, naming the
    key."""
    path = write_jais2_gguf(jais2_dir, tmp_path / "tiny-jais2-no-eps.gguf", eps=False)
    with pytest.raises(ValueError, match=r"lacks jais2.attention.layer_norm_epsilon, which llama.cpp writes"):
        resolve_model(str(path))

