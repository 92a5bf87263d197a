"""GGUF files of Phi-3.5-MoE (``phimoe``: :mod:`specray.models.gguf_phimoe`), written here from tiny HF models as
llama.cpp's converter lays them out (its PhiMoeModel over Phi3MiniModel: Phi-3's sizes, the LayerNorms' epsilon as the
RMS one, the window, LongRoPE as two factor tensors and one cos/sin scale, the experts stacked per projection, every
tensor renamed through gguf-py's map), convert back into the folders' own tensors, give transformers' logits on the
folders and the folders' greedy engine tokens under n-gram drafts; each of the converter's transforms, left out of the
file, makes the conversion differ; what the reader cannot build the model from is refused, naming the fix."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from specray.models import loader
from specray.models.gguf_read import as_written
from specray.models.loader import load_hf_config, load_model, resolve_model
from specray_test_checkpoints import gguf_blocks  # tests/checkpoints.py, via conftest
from tests.test_loader import (_block_type, _safetensors, _write_gguf_tokenizer, _write_out, assert_converted_as_folder,
                               assert_gguf_serves_as_its_folder, loaded_beside_dense)


@pytest.fixture(scope="module")
def gguf_cache(specray_cache):
    assert os.environ[loader.CACHE_ENV] == str(specray_cache)
    return specray_cache


def _add_tensor(w, types, gguf_name: str, tensor: torch.Tensor) -> None:
    """A tensor in float32, or in the llama.cpp type ``types`` names for it (rows of whole blocks)."""
    import gguf

    kind = _block_type(types, gguf_name, tensor.shape)
    if kind:
        w.add_tensor(gguf_name, gguf_blocks(tensor.reshape(-1, tensor.shape[-1]).numpy(), kind).reshape(
            *tensor.shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType[kind])
    else:
        w.add_tensor(gguf_name, tensor.float().contiguous().numpy())


def _write_tensors(w, types, folder: Path, names, experts_at: str, swapped: dict | None = None,
                   rename=lambda name: name) -> None:
    """Every tensor of ``folder`` renamed through gguf-py's map ``names`` (after ``rename``), in the type ``types``
    names for it; per-expert tensors (``model.layers.i.<block>.experts.e.<projection>.weight``) stacked per projection
    and written under ``experts_at.format(layer, projection)``, ``swapped``'s projections under each other's names."""
    from safetensors.torch import load_file

    stacked: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, value in load_file(str(folder / "model.safetensors")).items():
        if ".experts." in name:
            parts = name.split(".")
            stacked.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = value.float()
            continue
        gguf_name = names.get_name(rename(name), try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        _add_tensor(w, types, gguf_name, value.float())
    for (layer, projection), experts in sorted(stacked.items()):
        projection = (swapped or {}).get(projection, projection)
        gguf_name = names.get_name(experts_at.format(layer, projection), try_suffixes=(".weight",))
        _add_tensor(w, types, gguf_name, torch.stack([experts[e] for e in sorted(experts)]))


_GATE_UP_SWAPPED = {"gate_proj": "up_proj", "up_proj": "gate_proj"}  # gate and up under each other's names


# ---- Phi-3.5-MoE: llama.cpp's PhiMoeModel ---------------------------------------------------------------------------

# LongRoPE over 16 pretrained positions stretched to 64 (factors exact in float32), the cos/sin scale the converter
# computes for it, sqrt(1 + ln 4 / ln 16) (as the float32 the file holds), as both of the release's mscales (the file
# keeps one scale)
_PHIMOE_MSCALE = as_written(math.sqrt(1 + math.log(4) / math.log(16)))
PHIMOE_ROPE = {"rope_type": "longrope", "rope_theta": 500.0, "original_max_position_embeddings": 16,
               "short_factor": [1.0 + 0.25 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)],
               "short_mscale": _PHIMOE_MSCALE, "long_mscale": _PHIMOE_MSCALE}


def _phimoe_folder(path: Path, **overrides) -> Path:
    # conftest's tiny Phi-3.5-MoE (LayerNorms with biases, biased attention and LM head, 8 experts, 2 KV heads of 4)
    # with a window, an epsilon and a RoPE base apart from the defaults; the sparsemixer's threshold the release's
    # (0.01: the file does not carry it)
    from tests.conftest import build_tiny_model

    return build_tiny_model(path, "phimoe", seed=38, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                            intermediate_size=32, attention_bias=True, lm_head_bias=True, tie_word_embeddings=False,
                            rms_norm_eps=1e-3, sliding_window=24,
                            **{"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, **overrides})


@pytest.fixture(scope="module")
def phimoe_dir(tmp_path_factory) -> Path:
    return _phimoe_folder(tmp_path_factory.mktemp("phimoe_gguf"))


@pytest.fixture(scope="module")
def phimoe_longrope_dir(tmp_path_factory) -> Path:
    # LongRoPE (specray picks one set of factors per server, transformers per sequence length: compared by config
    # and tensors, not logits)
    return _phimoe_folder(tmp_path_factory.mktemp("phimoe_longrope_gguf"), max_position_embeddings=64,
                          rope_parameters=dict(PHIMOE_ROPE))


PHIMOE_TRANSFORMS = ("experts", "rope_factors")


def write_phimoe_gguf(folder: Path, out: Path, skip: str | None = None, keys: dict | None = None,
                      types=None) -> Path:
    """A GGUF of a Phi-3.5-MoE folder as llama.cpp's PhiMoeModel writes one: Phi3MiniModel's sizes (the LayerNorms'
    epsilon as ``attention.layer_norm_rms_epsilon``, the rotated dims, the RoPE base, the window or 0, LongRoPE's
    pretrained length, its factors as ``rope_factors_long`` / ``rope_factors_short`` and its cos/sin scale
    ``sqrt(1 + ln s / ln L0)`` as ``rope.scaling.attn_factor``), the experts' count and choice, each layer's experts
    stacked per projection (``w1``, ``w2``, ``w3`` merged), every tensor renamed through gguf-py's map. ``skip``: one of
    :data:`PHIMOE_TRANSFORMS` done wrong (gate and up stacked under each other's names; the factors under each other's
    names); ``keys``: metadata written besides; ``types``: a GGUF name's llama.cpp type."""
    import gguf

    cfg = json.loads((folder / "config.json").read_text())
    layers, heads, hidden = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["hidden_size"]
    rope, keys = cfg["rope_parameters"], dict(keys or {})
    w = gguf.GGUFWriter(str(out), "phimoe")
    w.add_context_length(cfg["max_position_embeddings"])
    if "original_max_position_embeddings" in rope:
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(keys.pop("rope.dimension_count", hidden // heads))
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(cfg["sliding_window"] or 0)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_count(cfg["num_local_experts"])
    for key, value in keys.items():
        w.add_uint32(f"phimoe.{key}", value)
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    if rope.get("long_factor"):
        old = rope["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / old
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(old)) if scale > 1 else 1.0)
        names = ("rope_factors_short", "rope_factors_long") if skip == "rope_factors" else \
            ("rope_factors_long", "rope_factors_short")
        for name, factors in zip(names, (rope["long_factor"], rope["short_factor"])):
            w.add_tensor(f"{name}.weight", torch.tensor(factors, dtype=torch.float32).numpy())
    _write_tensors(w, types, folder, gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHIMOE, layers),
                   "model.layers.{}.block_sparse_moe.experts.{}.weight",
                   {"w1": "w3", "w3": "w1"} if skip == "experts" else None)
    _write_out(w)
    return out


PHIMOE_FIELDS = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "hidden_size", "intermediate_size", "num_local_experts", "num_experts_per_tok",
                 "attention_bias", "lm_head_bias", "rms_norm_eps", "sliding_window", "rope_parameters",
                 "router_jitter_noise", "tie_word_embeddings", "vocab_size", "max_position_embeddings",
                 "eos_token_id")


def test_a_phimoe_gguf_serves_as_its_folder(phimoe_dir, tmp_path, gguf_cache):
    """A Phi-3.5-MoE GGUF as llama.cpp writes it reads back the folder's config (the window, the LayerNorms'
    epsilon, the biases, the RoPE base), converts into its tensors, gives transformers' logits on the folder and the
    folder's greedy engine tokens under n-gram drafts."""
    path = write_phimoe_gguf(phimoe_dir, tmp_path / "phimoe.gguf")
    assert_gguf_serves_as_its_folder(phimoe_dir, path, PHIMOE_FIELDS)


def test_a_phimoe_gguf_with_longrope_reads_back_its_factors(phimoe_longrope_dir, tmp_path, gguf_cache):
    """LongRoPE's factors (two tensors), pretrained length and cos/sin scale read back as the folder's
    ``rope_parameters`` (short and long factors, both mscales), and the factors leave no tensor behind."""
    path = write_phimoe_gguf(phimoe_longrope_dir, tmp_path / "phimoe-longrope.gguf")
    ours, theirs = load_hf_config(str(path)), load_hf_config(str(phimoe_longrope_dir))
    assert ours.rope_parameters["rope_type"] == "longrope"
    assert {f: getattr(ours, f, None) for f in PHIMOE_FIELDS} == {f: getattr(theirs, f, None) for f in PHIMOE_FIELDS}
    assert_converted_as_folder(phimoe_longrope_dir, path)


@pytest.mark.parametrize("skip", PHIMOE_TRANSFORMS)
def test_each_phimoe_transform_shows_in_the_conversion(phimoe_longrope_dir, tmp_path, gguf_cache, skip):
    """Each of the converter's transforms done otherwise (gate and up stacked under each other's names; the LongRoPE
    factors under each other's names) makes the conversion differ from the folder: the reader maps each one."""
    path = write_phimoe_gguf(phimoe_longrope_dir, tmp_path / f"phimoe-no-{skip}.gguf", skip=skip)
    same_rope = load_hf_config(str(path)).rope_parameters == load_hf_config(str(phimoe_longrope_dir)).rope_parameters
    with pytest.raises(AssertionError):
        assert_converted_as_folder(phimoe_longrope_dir, path)
        assert same_rope


def test_a_phimoe_gguf_with_q8_0_linears_loads_as_its_dense_conversion(phimoe_dir, tmp_path, gguf_cache,
                                                                      monkeypatch):
    """Q8_0 projections and experts keep their integers and load as the same file converted dense."""
    types = lambda name: "Q8_0" if name.startswith("blk.") and name.endswith(  # noqa: E731
        ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "_exps.weight")) else None
    path = write_phimoe_gguf(phimoe_dir, tmp_path / "phimoe-q8.gguf", types=types)
    dense = tmp_path / "phimoe-q8-dense.gguf"
    dense.write_bytes(path.read_bytes())
    kept = sorted(n for n in _safetensors(resolve_model(str(path)).path) if n.endswith(".q_weight"))
    assert any(".self_attn.q_proj." in n for n in kept) and any(".experts.1.w2." in n for n in kept), kept
    loaded_beside_dense(path, dense, monkeypatch)


def test_a_phimoe_gguf_of_a_partial_rope_is_refused(phimoe_dir, tmp_path, gguf_cache):
    """A file rotating a share of each head (Phi-3.5-MoE rotates all of it) is refused naming the key, before any
    conversion is left behind."""
    path = write_phimoe_gguf(phimoe_dir, tmp_path / "tiny-phimoe-refused.gguf", keys={"rope.dimension_count": 8})
    with pytest.raises(ValueError, match=r"rotates 8 of each head's 16 dims \(phimoe.rope.dimension_count\).*"
                                         r"pass the model's HF checkpoint instead"):
        resolve_model(str(path))
    assert not any((gguf_cache / "gguf").glob("tiny-phimoe-refused-*"))


# ---- Trinity: llama.cpp's AfmoeModel, a LlamaModel without its q/k reordering ---------------------------------------

@pytest.fixture(scope="module")
def afmoe_dir(make_tiny_model, tmp_path_factory) -> Path:
    # conftest's tiny Trinity (gated attention with q/k norms, sandwich norms, muP, a dense first layer, sigmoid-routed
    # experts with their correction bias beside a shared expert, scaled) with llama.cpp's layer kinds: three sliding
    # layers (RoPE) then a global one (none), the config's default for 4 layers
    return make_tiny_model(tmp_path_factory.mktemp("afmoe_gguf"), "afmoe", seed=74, num_hidden_layers=4, head_dim=16,
                           sliding_window=6, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           num_shared_experts=1, num_dense_layers=1, route_scale=1.5, mup_enabled=True,
                           rms_norm_eps=1e-3, rope_parameters={"rope_type": "default", "rope_theta": 500.0})


def write_afmoe_gguf(folder: Path, out: Path, skip: str | None = None, keys: dict | None = None,
                     types=None) -> Path:
    """A GGUF of a Trinity folder as llama.cpp's AfmoeModel writes one: LlamaModel's sizes (head size as
    ``attention.key_length`` and ``rope.dimension_count``, the RoPE base, the RMS epsilon, the experts' count and
    choice), its own keys (shared experts, their width, the dense first layers, ``expert_weights_norm`` from the
    release's ``route_norm``, ``expert_weights_scale``, the window), the experts stacked per projection, the router's
    ``expert_bias`` as ``expert_bias.bias``, every tensor renamed through gguf-py's map and none reordered (the
    converter calls ModelBase's renaming, past LlamaModel's q/k permutation). ``skip`` ``experts``: gate and up stacked
    under each other's names; ``keys``: metadata written instead (``None``: left out; ``norm``: the
    ``expert_weights_norm`` written)."""
    import gguf

    cfg = json.loads((folder / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(str(out), "afmoe")
    meta = {"block_count": layers, "context_length": cfg["max_position_embeddings"],
            "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": cfg["num_attention_heads"], "attention.head_count_kv": cfg["num_key_value_heads"],
            "attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"],
            "rope.dimension_count": cfg["head_dim"], "expert_count": cfg["num_experts"],
            "expert_used_count": cfg["num_experts_per_tok"], "expert_shared_count": cfg["num_shared_experts"],
            "expert_feed_forward_length": cfg["moe_intermediate_size"],
            "leading_dense_block_count": cfg["num_dense_layers"], "attention.sliding_window": cfg["sliding_window"]}
    keys = dict(keys or {})
    norm = keys.pop("norm", True)
    meta |= keys
    for key, value in meta.items():
        if value is not None:
            w.add_uint32(f"afmoe.{key}", value)
    w.add_float32("afmoe.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    w.add_float32("afmoe.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_bool("afmoe.expert_weights_norm", norm)  # the release's route_norm
    w.add_float32("afmoe.expert_weights_scale", cfg["route_scale"])
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    _write_tensors(w, types, folder, gguf.get_tensor_name_map(gguf.MODEL_ARCH.AFMOE, layers),
                   "model.layers.{}.mlp.experts.{}.weight", _GATE_UP_SWAPPED if skip == "experts" else None,
                   lambda name: name + ".bias" if name.endswith(".expert_bias") else name)
    _write_out(w)
    return out


AFMOE_FIELDS = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_experts",
                "num_experts_per_tok", "num_shared_experts", "num_dense_layers", "route_scale", "mup_enabled",
                "sliding_window", "layer_types", "global_attn_every_n_layers", "rms_norm_eps", "rope_parameters",
                "attention_bias", "tie_word_embeddings", "vocab_size", "max_position_embeddings", "eos_token_id")


def test_an_afmoe_gguf_serves_as_its_folder(afmoe_dir, tmp_path, gguf_cache):
    """A Trinity GGUF as llama.cpp writes it reads back the folder's config (the layers' kinds as llama.cpp fixes
    them, the window, muP, the experts' routing), converts into its tensors, gives transformers' logits on the folder
    and the folder's greedy engine tokens under n-gram drafts."""
    path = write_afmoe_gguf(afmoe_dir, tmp_path / "afmoe.gguf")
    assert load_hf_config(str(path)).layer_types[-1] == "full_attention"
    assert_gguf_serves_as_its_folder(afmoe_dir, path, AFMOE_FIELDS)


def test_an_afmoe_gguf_of_swapped_experts_converts_otherwise(afmoe_dir, tmp_path, gguf_cache):
    """The experts' stacks, gate and up under each other's names, make the conversion differ from the folder."""
    path = write_afmoe_gguf(afmoe_dir, tmp_path / "afmoe-no-experts.gguf", skip="experts")
    with pytest.raises(AssertionError):
        assert_converted_as_folder(afmoe_dir, path)


def test_an_afmoe_gguf_with_q8_0_linears_loads_as_its_dense_conversion(afmoe_dir, tmp_path, gguf_cache, monkeypatch):
    """Q8_0 projections (the attention's gate among them) and experts keep their integers and load as the same file
    converted dense."""
    types = lambda name: "Q8_0" if name.startswith("blk.") and name.endswith(  # noqa: E731
        ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_gate.weight", "attn_output.weight",
         "_exps.weight")) else None
    path = write_afmoe_gguf(afmoe_dir, tmp_path / "afmoe-q8.gguf", types=types)
    dense = tmp_path / "afmoe-q8-dense.gguf"
    dense.write_bytes(path.read_bytes())
    kept = sorted(n for n in _safetensors(resolve_model(str(path)).path) if n.endswith(".q_weight"))
    assert any(".self_attn.gate_proj." in n for n in kept) and any(".experts.1.down_proj." in n for n in kept), kept
    loaded_beside_dense(path, dense, monkeypatch)


@pytest.mark.parametrize("keys, match", [
    ({"expert_gating_func": 1}, r"afmoe.expert_gating_func=1"),
    ({"norm": False}, r"afmoe.expert_weights_norm=False"),
    ({"attention.sliding_window": None}, r"afmoe.attention.sliding_window=0"),
])
def test_an_afmoe_gguf_the_model_cannot_be_built_from_is_refused(afmoe_dir, tmp_path, gguf_cache, keys, match):
    """Another router (softmax, or the top k not renormalised) or no window (llama.cpp would rotate its sliding-
    pattern layers still, transformers' Trinity none) is refused naming the key, before any conversion is left."""
    path = write_afmoe_gguf(afmoe_dir, tmp_path / "tiny-afmoe-refused.gguf", keys=keys)
    with pytest.raises(ValueError, match=match + r".*Pass the model's HF checkpoint instead"):
        resolve_model(str(path))
    assert not any((gguf_cache / "gguf").glob("tiny-afmoe-refused-*"))


# ---- MiMo-V2-Flash: llama.cpp's MimoV2Model over TextModel -----------------------------------------------------

@pytest.fixture(scope="module")
def mimo2_dir(make_tiny_model, tmp_path_factory) -> Path:
    # conftest's tiny MiMo-V2-Flash (keys of 24, values of 16, scaled; a full layer then sliding ones with twice the KV
    # heads and sinks; a dense first layer then sigmoid-routed experts), routed as llama.cpp routes a ``mimo2`` file
    # (one group) and with a rotated share of each head a float32 round trip keeps (a half: 12 of 24)
    kinds = ["full_attention", "sliding_attention", "sliding_attention"]
    return make_tiny_model(tmp_path_factory.mktemp("mimo2_gguf"), "mimo_v2_flash", seed=97, num_hidden_layers=3,
                           head_dim=24, v_head_dim=16, num_key_value_heads=2, sliding_window=8, layer_types=kinds,
                           mlp_layer_types=["dense", "sparse", "sparse"], n_routed_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, n_group=1, topk_group=1, attention_value_scale=0.8,
                           rms_norm_eps=1e-3, tie_word_embeddings=False,
                           rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50000.0,
                                                               "partial_rotary_factor": 0.5},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                  "partial_rotary_factor": 0.5}})


def _mimo2_name(name: str) -> str:
    """The release's name as gguf-py's map knows it: the router's correction bias and the sinks as a tensor's parts."""
    name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    return name + ".weight" if name.endswith("attention_sink_bias") else name


def write_mimo2_gguf(folder: Path, out: Path, value_scale: bool = True, skip: str | None = None,
                     kv: list[int] | None = None, types=None) -> Path:
    """A GGUF of a MiMo-V2-Flash folder as llama.cpp's MimoV2Model writes one: TextModel's sizes (heads, head size
    and value size, the RMS epsilon, the experts' count and choice, the full layers' RoPE base and the sliding
    layers' as ``rope.freq_base_swa``), the layers' kinds as ``attention.sliding_window_pattern`` (the release's
    ``hybrid_layer_pattern``), the KV heads per layer, the window, the rotated dims ``int(head_dim * partial)``, the
    experts' width; the sinks (``attention_sink_bias``) as ``attn_sinks.weight``, the router's correction bias as a
    ``.bias``, the experts stacked per projection, every tensor renamed through gguf-py's map. ``value_scale``: the
    values' scale written (newer converters) or not (the first); ``skip`` ``experts``: gate and up stacked under each
    other's names; ``kv``: the KV heads per layer written instead; ``types``: a GGUF name's llama.cpp type."""
    import gguf

    cfg = json.loads((folder / "config.json").read_text())
    layers, rope = cfg["num_hidden_layers"], cfg["rope_parameters"]
    sliding = [kind == "sliding_attention" for kind in cfg["layer_types"]]
    w = gguf.GGUFWriter(str(out), "mimo2")
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(kv or [cfg["num_key_value_heads"] * (2 if s else 1) for s in sliding])
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_float32("mimo2.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["v_head_dim"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_sliding_window_pattern(sliding)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_rope_dimension_count(int(cfg["head_dim"] * rope["full_attention"]["partial_rotary_factor"]))
    if value_scale:
        w.add_float32("mimo2.attention.value_scale", cfg["attention_value_scale"])
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MIMO2, layers)
    _write_tensors(w, types, folder, names, "model.layers.{}.mlp.experts.{}.weight",
                   _GATE_UP_SWAPPED if skip == "experts" else None, _mimo2_name)
    _write_out(w)
    return out


MIMO2_FIELDS = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "v_head_dim", "hidden_size", "intermediate_size", "moe_intermediate_size",
                "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob",
                "routed_scaling_factor", "attention_value_scale", "layer_types", "mlp_layer_types", "sliding_window",
                "rms_norm_eps", "rope_parameters", "attention_bias", "tie_word_embeddings", "vocab_size",
                "max_position_embeddings", "eos_token_id")


def test_a_mimo2_gguf_serves_as_its_folder(mimo2_dir, tmp_path, gguf_cache):
    """A MiMo-V2-Flash GGUF as llama.cpp writes it reads back the folder's config (the layers' kinds and KV heads,
    keys and values of their own widths, the values' scale, each kind's RoPE base, the dense and expert layers),
    converts into its tensors (the sinks under the release's name), gives transformers' logits on the folder and
    the folder's greedy engine tokens under n-gram drafts."""
    path = write_mimo2_gguf(mimo2_dir, tmp_path / "mimo2.gguf")
    assert_gguf_serves_as_its_folder(mimo2_dir, path, MIMO2_FIELDS)


def test_a_mimo2_gguf_of_the_first_converter_takes_the_releases_value_scale(mimo2_dir, tmp_path, gguf_cache):
    """A file without the values' scale (the first converter wrote none) reads the releases' (transformers'
    default), not the folder's."""
    from transformers import MiMoV2FlashConfig

    path = write_mimo2_gguf(mimo2_dir, tmp_path / "mimo2-no-scale.gguf", value_scale=False)
    assert load_hf_config(str(path)).attention_value_scale == MiMoV2FlashConfig().attention_value_scale != 0.8


def test_a_mimo2_gguf_of_swapped_experts_converts_otherwise(mimo2_dir, tmp_path, gguf_cache):
    """The experts' stacks, gate and up under each other's names, make the conversion differ from the folder."""
    path = write_mimo2_gguf(mimo2_dir, tmp_path / "mimo2-no-experts.gguf", skip="experts")
    with pytest.raises(AssertionError):
        assert_converted_as_folder(mimo2_dir, path)


def test_a_mimo2_gguf_with_q8_0_linears_loads_as_its_dense_conversion(mimo2_dir, tmp_path, gguf_cache, monkeypatch):
    """Q8_0 projections and experts keep their integers and load as the same file converted dense."""
    types = lambda name: "Q8_0" if name.startswith("blk.") and name.endswith(  # noqa: E731
        ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "_exps.weight")) else None
    path = write_mimo2_gguf(mimo2_dir, tmp_path / "mimo2-q8.gguf", types=types)
    dense = tmp_path / "mimo2-q8-dense.gguf"
    dense.write_bytes(path.read_bytes())
    kept = sorted(n for n in _safetensors(resolve_model(str(path)).path) if n.endswith(".q_weight"))
    assert any(".self_attn.q_proj." in n for n in kept) and any(".experts.1.down_proj." in n for n in kept), kept
    loaded_beside_dense(path, dense, monkeypatch)


def test_a_mimo2_gguf_of_kv_heads_transformers_cannot_build_is_refused(mimo2_dir, tmp_path, gguf_cache):
    """Sliding layers with other than twice the full layers' KV heads are refused naming the key, before any
    conversion is left behind."""
    path = write_mimo2_gguf(mimo2_dir, tmp_path / "tiny-mimo2-refused.gguf", kv=[2, 2, 2])
    with pytest.raises(ValueError, match=r"has \[2, 2, 2\] KV heads \(mimo2.attention.head_count_kv\).*twice.*"
                                         r"pass the model's HF checkpoint instead"):
        resolve_model(str(path))
    assert not any((gguf_cache / "gguf").glob("tiny-mimo2-refused-*"))


# ---- Mistral 4: llama.cpp's Mistral4Model over DeepseekV2Model ------------------------------------------------------

@pytest.fixture(scope="module")
def mistral4_dir(make_tiny_model, tmp_path_factory) -> Path:
    # conftest's tiny Mistral 4 (DeepSeek-V3's latent attention on interleaved pairs, a dense first layer, then
    # softmax-scored grouped experts beside a shared one, scaled and renormalised; YaRN; the queries scaled past
    # position 16 by llama_4_scaling_beta, the releases' 0.1)
    return make_tiny_model(tmp_path_factory.mktemp("mistral4_gguf"), "mistral4", seed=81, num_key_value_heads=4,
                           moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                           n_group=4, topk_group=2, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
                           qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, routed_scaling_factor=1.5,
                           tie_word_embeddings=False,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                            "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                                            "llama_4_scaling_beta": 0.1})


def write_mistral4_gguf(folder: Path, out: Path, split_kv_b: bool = True, skip: str | None = None,
                        keys: dict | None = None, types=None) -> Path:
    """A GGUF of a Mistral 4 folder as llama.cpp's Mistral4Model (a DeepseekV2Model) writes one: MLA as MQA (one KV
    head; the latent and heads' widths), YaRN with ``mscale_all_dim`` as ``0.1 * yarn_log_multiplier``, the router
    (its groups, scale and, where the release renormalises, ``expert_weights_norm``; no gating function: the release
    names none), the dense first layers, the shared experts; ``kv_b_proj`` split per head into a transposed
    ``attn_k_b`` and ``attn_v_b`` (or whole: ``split_kv_b`` False), the fused experts written as they are
    (``gate_up_proj`` / ``down_proj`` + ``.weight``), every tensor renamed through gguf-py's map. ``skip``: ``kv_b``
    (``k_b`` reshaped, not transposed); ``keys``: metadata written besides; ``types``: a GGUF name's llama.cpp type."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    layers, heads, rope = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["rope_parameters"]
    w = gguf.GGUFWriter(str(out), "mistral4")
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(cfg["kv_lora_rank"])
    w.add_key_length(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    w.add_value_length(cfg["kv_lora_rank"])
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg["norm_topk_prob"]:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    for key, value in (keys or {}).items():
        w.add_uint32(f"mistral4.{key}", value)
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MISTRAL4, layers)
    for name, value in load_file(str(folder / "model.safetensors")).items():
        value = value.float()
        if name.endswith("kv_b_proj.weight") and split_kv_b:
            kv_b = value.view(heads, cfg["qk_nope_head_dim"] + cfg["v_head_dim"], -1)
            k_b, v_b = kv_b.split([cfg["qk_nope_head_dim"], cfg["v_head_dim"]], dim=1)
            k_b = k_b.reshape(heads, -1, k_b.shape[1]) if skip == "kv_b" else k_b.transpose(1, 2)
            for part, tensor in (("k_b_proj", k_b), ("v_b_proj", v_b)):
                _add_tensor(w, types, names.get_name(name.replace("kv_b_proj", part), try_suffixes=(".weight",)),
                            tensor)
            continue
        if name.endswith((".experts.down_proj", ".experts.gate_up_proj")):
            name += ".weight"
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        _add_tensor(w, types, gguf_name, value)
    _write_out(w)
    return out


MISTRAL4_FIELDS = ("model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                   "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
                   "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "moe_intermediate_size",
                   "intermediate_size", "rms_norm_eps", "tie_word_embeddings", "vocab_size", "max_position_embeddings",
                   "eos_token_id")
MISTRAL4_ROPE = ("rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                 "mscale", "mscale_all_dim", "llama_4_scaling_beta", "partial_rotary_factor")


def test_a_mistral4_gguf_serves_as_its_folder(mistral4_dir, tmp_path, gguf_cache):
    """A Mistral 4 GGUF as llama.cpp writes it reads back the folder's config (the latent attention's widths, YaRN
    and the queries' scaling, the softmax router's groups, scale and renormalisation), converts into its tensors (the
    fused experts as stored), gives transformers' logits on the folder and the folder's greedy engine tokens under
    n-gram drafts."""
    path = write_mistral4_gguf(mistral4_dir, tmp_path / "mistral4.gguf")
    ours, theirs = (load_hf_config(str(p)).rope_parameters for p in (path, mistral4_dir))
    assert {k: ours.get(k) for k in MISTRAL4_ROPE} == {k: theirs.get(k) for k in MISTRAL4_ROPE}
    # (assert_gguf_serves_as_its_folder's, with transformers' Mistral 4 named: AutoModelForCausalLM has none;
    # compared as tests/test_mistral4.py compares the folder)
    import sys

    from specray_test_model_checks import SCHEDULES, chunked_logits, max_diff, prompt, reference_logits
    from transformers import Mistral4ForCausalLM

    from specray import LLM

    ours, theirs = load_hf_config(str(path)), load_hf_config(str(mistral4_dir))
    assert {f: getattr(ours, f, None) for f in MISTRAL4_FIELDS} == \
        {f: getattr(theirs, f, None) for f in MISTRAL4_FIELDS}
    assert_converted_as_folder(mistral4_dir, path)
    model, reference = load_model(str(path)), reference_logits(mistral4_dir, Mistral4ForCausalLM)
    assert all(max_diff(chunked_logits(model, prompt(), schedule), reference) < 1e-4 for schedule in SCHEDULES.values())
    runs = sys.modules["specray_test_engine_runs"]
    prompts = ["The quick brown fox", "def add(a, b):"]
    llms = [LLM(model=str(m), max_model_len=128, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
            for m in (mistral4_dir, path)]
    outs = [runs.token_ids(llm.generate(prompts, runs.greedy(12), use_tqdm=False)) for llm in llms]
    assert outs[0] == outs[1]


def test_a_mistral4_gguf_of_older_converters_or_a_wrong_kv_b_converts_accordingly(mistral4_dir, tmp_path,
                                                                                  gguf_cache):
    """``kv_b_proj`` whole (``attn_kv_b``, older converters) converts into the folder's tensors; ``k_b`` reshaped
    instead of transposed does not (the reader undoes the transposition, and the shapes let no wrong one pass)."""
    assert_converted_as_folder(mistral4_dir, write_mistral4_gguf(mistral4_dir, tmp_path / "m4-whole.gguf",
                                                                 split_kv_b=False))
    with pytest.raises(AssertionError):
        assert_converted_as_folder(mistral4_dir, write_mistral4_gguf(mistral4_dir, tmp_path / "m4-no-kv_b.gguf",
                                                                     skip="kv_b"))


def test_a_mistral4_gguf_with_q8_0_linears_loads_as_its_dense_conversion(mistral4_dir, tmp_path, gguf_cache,
                                                                        monkeypatch):
    """Q8_0 projections and fused experts keep their integers and load as the same file converted dense."""
    types = lambda name: "Q8_0" if name.startswith("blk.") and name.endswith(  # noqa: E731
        ("attn_q_a.weight", "attn_q_b.weight", "attn_output.weight", "_exps.weight")) else None
    path = write_mistral4_gguf(mistral4_dir, tmp_path / "mistral4-q8.gguf", types=types)
    dense = tmp_path / "mistral4-q8-dense.gguf"
    dense.write_bytes(path.read_bytes())
    kept = sorted(n for n in _safetensors(resolve_model(str(path)).path) if n.endswith(".q_weight"))
    assert any(".self_attn.q_b_proj." in n for n in kept) and any(".experts." in n for n in kept), kept
    loaded_beside_dense(path, dense, monkeypatch)


def test_a_mistral4_gguf_of_a_sigmoid_router_is_refused(mistral4_dir, tmp_path, gguf_cache):
    """A router of another gating function than Mistral 4's softmax is refused naming the key, before any
    conversion is left behind."""
    path = write_mistral4_gguf(mistral4_dir, tmp_path / "tiny-mistral4-refused.gguf", keys={"expert_gating_func": 2})
    with pytest.raises(ValueError, match=r"mistral4.expert_gating_func=2; Mistral 4 routes by softmax.*"
                                         r"pass the model's HF checkpoint instead"):
        resolve_model(str(path))
    assert not any((gguf_cache / "gguf").glob("tiny-mistral4-refused-*"))
