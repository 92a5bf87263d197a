"""GGUF files of BitNet b1.58 (:mod:`specray.models.gguf_bitnet`, llama.cpp's ``bitnet``) and GPT-J
(:mod:`specray.models.gguf_classic`, ``gptj``), written here from tiny HF models as llama.cpp lays them out, convert
back into the folders' tensors and load to transformers' logits on the folders.

BitNet: the file holds what llama.cpp's converter (``BitnetModel``) writes from the -bf16 release, each decoder
projection ternarized to ``absmean * {-1, 0, 1}`` (its ``weight_quant``; the absmean rounded to f16 here, so that the
ternary types hold it exactly), in F32 or llama.cpp's ternary types TQ1_0 / TQ2_0, or the older layout of ternary
weights with a separate one-value ``.scale`` tensor per projection; what llama.cpp runs on it is the plain BitNet
(no activation quantization) over those weights, which is transformers' BitNet on the ternarized folder. GPT-J: the
release's tensors under gguf-py's names (llama.cpp has no GPT-J converter or graph: nothing is reordered)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from specray.models import loader
from specray.models.loader import load_hf_config, load_model, resolve_model
from specray_test_checkpoints import gguf_blocks  # tests/checkpoints.py, via conftest
from tests.test_loader import (_safetensors, _write_gguf_tokenizer, _write_out, assert_converted_as_folder,
                               assert_gguf_serves_as_its_folder, assert_matches_hf, hf_model, loaded_beside_dense,
                               prefill_logits)

TOL = 1e-4
# 2 layers, 4 query heads of 64 over 2 KV heads, an MLP of 256: every projection's rows whole 256-value blocks of the
# ternary types
BITNET_256 = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.05,
                  tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SUB_NORMS = {"self_attn.attn_sub_norm": "attn_sub_norm", "mlp.ffn_sub_norm": "ffn_sub_norm"}


@pytest.fixture(scope="module")
def gguf_cache(specray_cache):
    assert os.environ[loader.CACHE_ENV] == str(specray_cache)
    return specray_cache


def _is_projection(name: str) -> bool:
    return name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in PROJECTIONS


def weight_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's BitnetModel.weight_quant, as (ternary values, the scale): ``absmean * round(w / absmean)``
    clamped to {-1, 0, 1}, the absmean rounded to f16 (what a ternary type's block scale holds exactly)."""
    scale = w.float().abs().mean().clamp(min=1e-5).half().float()
    return (w.float() / scale).round().clamp(-1, 1), scale


@pytest.fixture(scope="module")
def bitnet_release(tmp_path_factory) -> Path:
    """transformers' BitNet at :data:`BITNET_256`'s sizes, random weights (norms away from 1), saved as the -bf16
    release (dense master weights), with conftest's tiny tokenizer."""
    from transformers import BitNetConfig, BitNetForCausalLM as HFBitNet

    from tests.conftest import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("bitnet_gguf") / "release"
    path.mkdir()
    tok = build_tiny_tokenizer(path)
    config = BitNetConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          bos_token_id=None, **BITNET_256)
    torch.manual_seed(7)
    model = HFBitNet(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def bitnet_ternarized(bitnet_release) -> Path:
    """The release's folder with each decoder projection as llama.cpp's converter writes it (:func:`weight_quant`,
    ternary x scale): the model a BitNet GGUF of the release is, no quantization_config."""
    from safetensors.torch import load_file, save_file

    path = Path(shutil.copytree(bitnet_release, bitnet_release.parent / "ternarized"))
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if _is_projection(n)]:
        ternary, scale = weight_quant(tensors[name])
        tensors[name] = ternary * scale
    save_file(tensors, str(path / "model.safetensors"))
    return path


def write_bitnet_gguf(folder: Path, out: Path, kind: str = "F32", separate_scales: bool = False,
                      activation: str | None = "relu2", extra: dict[str, torch.Tensor] | None = None) -> Path:
    """A GGUF of the BitNet release in ``folder`` as llama.cpp's converter writes it: TextModel's hyperparameters,
    the linear RoPE scaling of factor 1, ``hidden_activation`` (``activation``; None: not written, as older
    converters), gguf-py's names (the sub-norms by their GGUF names), no ``output`` (the head is the embedding), each
    decoder projection ternarized (:func:`weight_quant`) and stored in ``kind`` (F32, F16, TQ1_0, TQ2_0, ...) or, with
    ``separate_scales``, as its ternary values with the scale apart (``blk.N.<projection>.scale``, one value);
    ``extra`` tensors added as given."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), "bitnet")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(1.0)
    if activation is not None:
        w.add_string("bitnet.hidden_activation", activation)
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BITNET, cfg["num_hidden_layers"])
    for name, t in load_file(str(folder / "model.safetensors")).items():
        if name == "lm_head.weight":
            continue
        sub = next((g for hf, g in SUB_NORMS.items() if f".{hf}." in name), None)
        gguf_name = f"blk.{name.split('.')[2]}.{sub}.weight" if sub else names.get_name(name, try_suffixes=(".weight",))
        assert gguf_name is not None, name
        t = t.float()
        if not _is_projection(name):
            w.add_tensor(gguf_name, t.numpy())
            continue
        ternary, scale = weight_quant(t)
        if separate_scales:
            w.add_tensor(gguf_name, gguf_blocks(ternary.numpy(), kind), raw_dtype=gguf.GGMLQuantizationType[kind])
            w.add_tensor(gguf_name.replace(".weight", ".scale"), scale.reshape(1).numpy())
        elif kind in ("F32", "F16"):
            w.add_tensor(gguf_name, (ternary * scale).numpy().astype("float16" if kind == "F16" else "float32"))
        else:
            w.add_tensor(gguf_name, gguf_blocks((ternary * scale).numpy(), kind),
                         raw_dtype=gguf.GGMLQuantizationType[kind])
    for name, t in (extra or {}).items():
        w.add_tensor(name, t.numpy())
    _write_out(w)
    return out


def _quantized_inputs(model) -> None:
    """Each decoder projection's input quantized per token to int8's range, as the packed release's BitLinear does
    (the semantics a GGUF BitNet does not have)."""
    from specray.models.bitnet import quantize_activations

    for name, m in model.named_modules():
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            def forward(x, f=m.forward):
                xq, scale = quantize_activations(x, None)
                return f(xq) / scale
            m.forward = forward


@pytest.mark.parametrize("kind, separate", [("F32", False), ("F16", False), ("TQ1_0", False), ("TQ2_0", False), ("TQ2_0", True)])
def test_a_bitnet_gguf_converts_to_its_ternary_weights_and_matches_transformers(bitnet_release, bitnet_ternarized,
                                                                                 tmp_path, gguf_cache, kind, separate):
    """Each layout of a BitNet GGUF (the converter's F32, the ternary types TQ1_0 / TQ2_0, ternary weights with a
    separate scale) converts into the ternarized folder's tensors exactly (ternary values x their scale; the sub-norms
    placed, no head) and our model on it gives transformers' logits on that folder, with the activations
    unquantized: quantizing them as the packed release does moves the logits."""
    path = write_bitnet_gguf(bitnet_release, tmp_path / f"bitnet-{kind}.gguf", kind, separate)
    assert_converted_as_folder(bitnet_ternarized, path)
    config = load_hf_config(str(path))
    assert getattr(config, "quantization_config", None) is None and config.model_type == "bitnet"
    model = load_model(str(path), pack=False)
    assert not model.packed_release
    assert_matches_hf(model, hf_model(bitnet_ternarized))
    ids = list(range(3, 40))
    with torch.no_grad():
        want = hf_model(bitnet_ternarized)(torch.tensor([ids])).logits[0]
    _quantized_inputs(model)
    assert (prefill_logits(model, ids) - want).abs().max() > 100 * TOL


def test_a_bitnet_gguf_serves_as_its_folder(bitnet_release, bitnet_ternarized, tmp_path, gguf_cache):
    """A TQ2_0 BitNet GGUF through the engine, its tokenizer read from the file: the config has the folder's sizes
    and RoPE, and greedy output under n-gram drafts equals the ternarized folder's."""
    path = write_bitnet_gguf(bitnet_release, tmp_path / "bitnet-tq2.gguf", "TQ2_0")
    fields = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
              "tie_word_embeddings", "hidden_act", "max_position_embeddings", "rope_parameters"]
    assert_gguf_serves_as_its_folder(bitnet_ternarized, path, fields)


@pytest.mark.parametrize("case, match", [
    ("no_activation", r"lacks bitnet.hidden_activation \(llama.cpp then runs the MLP with SiLU\).*'relu2'"),
    ("silu", r"bitnet.hidden_activation='silu'"),
    ("output", r"has output.weight; llama.cpp's BitNet reads its LM head from token_embd"),
    ("q8_0", r"has blk.0.\w+.weight in Q8_0; specray reads a BitNet GGUF's tensors in F32, F16, BF16, TQ1_0, TQ2_0"),
    ("two_scales", r"blk.0.attn_q.scale of 2 values"),
])
def test_a_bitnet_gguf_specray_does_not_serve_is_refused(bitnet_release, tmp_path, gguf_cache, case, match):
    """What the file says specray's BitNet is not (SiLU's MLP, a head of its own, another tensor type, a scale that
    is not one value) is refused before any conversion, naming the field and the fix."""
    import gguf

    kw: dict = {"no_activation": {"activation": None}, "silu": {"activation": "silu"},
                "output": {"extra": {"output.weight": torch.zeros(320, 256)}}}.get(case, {})
    path = tmp_path / f"bitnet-{case}.gguf"
    if case in ("q8_0", "two_scales"):
        write_bitnet_gguf(bitnet_release, path, "Q8_0" if case == "q8_0" else "TQ2_0", separate_scales=True)
        if case == "two_scales":  # one scale rewritten with two values
            src = Path(shutil.copy(path, tmp_path / "src.gguf"))
            reader = gguf.GGUFReader(str(src))
            w = gguf.GGUFWriter(str(path), "bitnet")
            for key, field in reader.fields.items():
                if key.startswith("GGUF.") or key == "general.architecture":
                    continue
                sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
            for t in reader.tensors:
                data = t.data if t.name != "blk.0.attn_q.scale" else torch.ones(2).numpy()
                w.add_tensor(t.name, data, raw_dtype=t.tensor_type if t.name != "blk.0.attn_q.scale" else None)
            _write_out(w)
    else:
        write_bitnet_gguf(bitnet_release, path, "TQ2_0", **kw)
    with pytest.raises(ValueError, match=match + r".*pass the model's HF checkpoint instead"):
        load_model(str(path))
    assert not any((gguf_cache / "gguf").glob(f"bitnet-{case}-*"))


# ---- GPT-J -------------------------------------------------------------------------------------------------------


def write_gptj_gguf(folder: Path, out: Path, types=None, keys: dict | None = None, head: bool = True) -> Path:
    """A GGUF of the tiny GPT-J in ``folder`` laid out by gguf-py's ``gptj`` names (llama.cpp has no converter for
    it): the standard hyperparameters, ``rope.dimension_count`` its ``rotary_dim``, the tensors as the release has
    them; ``types``: a GGUF name -> llama.cpp type (None: float32); ``keys``: ``gptj.`` keys set otherwise;
    ``head``: the LM head written (``output``)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    keys = {"context_length": cfg["n_positions"], "embedding_length": cfg["n_embd"], "block_count": cfg["n_layer"],
            "feed_forward_length": cfg["n_inner"] or 4 * cfg["n_embd"], "attention.head_count": cfg["n_head"],
            "attention.head_count_kv": cfg["n_head"], "attention.layer_norm_epsilon": cfg["layer_norm_epsilon"],
            "rope.dimension_count": cfg["rotary_dim"], **(keys or {})}
    w = gguf.GGUFWriter(str(out), "gptj")
    for key, value in keys.items():
        kind = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
        w.add_key_value(f"gptj.{key}", value, kind)
    _write_gguf_tokenizer(w, cfg, json.loads((folder / "tokenizer.json").read_text()))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPTJ, cfg["n_layer"])
    for name, t in load_file(str(folder / "model.safetensors")).items():
        if name.startswith("lm_head.") and not head:
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        kind = types(gguf_name) if types and t.dim() == 2 else None
        if kind:
            w.add_tensor(gguf_name, gguf_blocks(t.float().numpy(), kind), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            w.add_tensor(gguf_name, t.float().numpy())
    _write_out(w)
    return out


def test_a_gptj_gguf_serves_as_its_folder(tiny_gptj_dir, tmp_path, gguf_cache):
    """GPT-J's GGUF converts into the folder's tensors (every one, the head's bias too), our model on it gives
    transformers' logits on the folder, and the engine's greedy output with n-gram drafts equals the folder's; its
    config has the folder's rotary_dim, MLP width, epsilon and untied head."""
    path = write_gptj_gguf(tiny_gptj_dir, tmp_path / "gptj.gguf")
    assert_gguf_serves_as_its_folder(tiny_gptj_dir, path, ["n_embd", "n_head", "n_layer", "rotary_dim", "n_inner",
                                                           "layer_norm_epsilon", "tie_word_embeddings",
                                                           "activation_function", "n_positions"])


def test_a_gptj_gguf_with_q8_0_linears_loads_as_its_dense_conversion(tiny_gptj_dir, tmp_path, gguf_cache,
                                                                      monkeypatch):
    """GPT-J's layers' linears in Q8_0 keep their integers (``h.N``) through the conversion and load to the weights
    and logits of the same file converted dense, transformers' but for Q8_0's rounding."""
    path = write_gptj_gguf(tiny_gptj_dir, tmp_path / "gptj-q8.gguf",
                           lambda name: "Q8_0" if name.startswith("blk.") and "norm" not in name else None)
    dense_path = Path(shutil.copy(path, tmp_path / "gptj-q8-dense.gguf"))
    assert any(n.endswith(".q_weight") for n in _safetensors(resolve_model(str(path)).path))
    model, ref = loaded_beside_dense(path, dense_path, monkeypatch)
    ids = list(range(3, 40))
    logits = prefill_logits(model, ids)
    assert torch.equal(logits, prefill_logits(ref, ids))
    with torch.no_grad():
        theirs = hf_model(tiny_gptj_dir)(torch.tensor([ids])).logits[0]
    assert 0 < (logits - theirs).abs().max() < 0.05 * theirs.abs().max()


@pytest.mark.parametrize("keys, head, match", [
    ({"rope.freq_base": 50000.0}, True, r"gptj.rope.freq_base=50000.0.*base 10000 and no scaling"),
    ({"attention.head_count_kv": 2}, True, r"gptj.attention.head_count_kv=2 for 4 query heads"),
    ({"rope.dimension_count": 7}, True, r"gptj.rope.dimension_count=7 for heads of 16"),
    ({}, False, r"has no output.weight; GPT-J's LM head"),
])
def test_a_gptj_gguf_the_model_cannot_be_built_from_is_refused(tiny_gptj_dir, tmp_path, gguf_cache, keys, head,
                                                              match):
    """A GPT-J file whose RoPE, KV heads or head GPT-J cannot have is refused, naming the field and the fix."""
    path = write_gptj_gguf(tiny_gptj_dir, tmp_path / "gptj-refused.gguf", keys=keys, head=head)
    with pytest.raises(ValueError, match=match + r".*pass the model's HF checkpoint instead"):
        load_model(str(path))


def test_gptj_gguf_config_reads_the_whole_head_where_no_rotary_dim_is_written(tiny_gptj_dir, tmp_path, gguf_cache):
    """Without ``rope.dimension_count`` the whole head rotates (llama.cpp's default), so a file of a rotary_dim 8
    model that leaves it out is read as rotary_dim 16 -- and its logits then differ from the folder's (the key is
    what places the RoPE)."""
    import gguf

    src = write_gptj_gguf(tiny_gptj_dir, tmp_path / "gptj-src.gguf")
    reader = gguf.GGUFReader(str(src))
    path = tmp_path / "gptj-whole.gguf"
    w = gguf.GGUFWriter(str(path), "gptj")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "gptj.rope.dimension_count"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data)
    _write_out(w)
    assert load_hf_config(str(path)).rotary_dim == 16
    ids = list(range(3, 40))
    with torch.no_grad():
        theirs = hf_model(tiny_gptj_dir)(torch.tensor([ids])).logits[0]
    assert (prefill_logits(load_model(str(path), pack=False), ids) - theirs).abs().max() > 100 * TOL
