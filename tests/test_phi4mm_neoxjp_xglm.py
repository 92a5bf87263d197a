"""Phi-4-multimodal's text model (``Phi4MultimodalForCausalLM``), GPT-NeoX-Japanese (``GPTNeoXJapaneseForCausalLM``)
and XGLM (``XGLMForCausalLM``) against transformers on the same random tiny weights (fp32, max abs diff < 1e-4) over a
40-token prompt, as a prefill and as chunks + single steps:

* Phi-4-multimodal: transformers' whole multimodal model (tiny image and audio encoders beside the text model) on a
  prompt of text alone; Phi-3's fused qkv_proj / gate_up_proj, grouped KV heads, LongRoPE over 3/4 of each head and a
  window of 8 positions; also the release's own layout (``base_layer`` weights beside built-in vision and speech LoRA
  adapters, read as the base weights alone);
* GPT-NeoX-Japanese: q/k/v fused head by head, partial RoPE, Llama's order, the last layer's ``dense_bias``, a tied
  head;
* XGLM: sinusoidal positions from row ``position + 2``, the embedding scaled by sqrt(d_model), biases everywhere, a
  tied head.

Also: the engine's greedy tokens equal transformers' ``generate`` (n-gram chains eagerly, trees from graphs), two
tensor-parallel ranks or pipeline stages equal one, each distinctive part broken once moves the logits, and what is
not served is refused by name. The tiny models are built here (transformers' own classes, random weights with the
norms and biases drawn away from their init), not in conftest."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from specray.models import phi4_multimodal, xglm
from specray.models.classic import GatelessMLP
from specray.models.gpt_neox_japanese import GPTNeoXJapaneseForCausalLM
from specray.models.kv_cache import CAUSAL, FullAttentionSpec, SlidingWindowSpec
from specray.models.llama import LlamaMLP
from specray.models.loader import load_model, read_config
from specray.models.phi4_multimodal import Phi4MultimodalForCausalLM
from specray.models.xglm import XGLMForCausalLM
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, assert_ranks_match_one_rank, chunked_logits, max_diff, mutated_logits,
    prompt, reference_logits)

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
WINDOW = 8  # Phi-4-multimodal's sliding window (of a 40-token prompt)
# LongRoPE over 12 of each 16-feature head (partial_rotary_factor 0.75, the release's): 6 frequencies with their own
# short factors (served within the pretrained 512 positions) and a cos/sin scale
PHI4_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 2.1, 3.7, 4.4, 6.0],
             "long_factor": [1.2, 2.5, 6.0, 11.0, 17.0, 30.0], "partial_rotary_factor": 0.75,
             "attention_factor": 1.2}


def _randomized(model, seed: int) -> None:
    """The norms' weights away from ones and every bias away from zeros (their init), so that each shows; the biases
    small (std 0.1), else they outweigh the tokens in the residual stream."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith(".weight"):
                param.copy_(torch.rand(param.shape, generator=g) + 0.5)
            elif name.endswith(("bias", "dense_bias")):
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)


def _build(path: Path, config_class, model_class, seed: int, **fields) -> Path:
    """transformers' ``model_class`` at ``fields``' sizes with random weights, saved with conftest's tokenizer."""
    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path)
    config = config_class(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, **fields)
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    _randomized(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_phi4mm(path: Path, seed: int = 130) -> Path:
    """transformers' Phi4MultimodalForCausalLM: the text model with one-layer image and audio encoders (16 mel bins,
    2 past the subsampling: a config the audio encoder is built from)."""
    from transformers import Phi4MultimodalConfig, Phi4MultimodalForCausalLM as HFPhi4

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, crop_size=28)
    audio = dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2, ext_pw_out_channel=32,
                 depthwise_separable_out_channel=32, nemo_conv_channels=32, input_size=16, nemo_final_size=2)
    return _build(path, Phi4MultimodalConfig, HFPhi4, seed, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  original_max_position_embeddings=512, sliding_window=WINDOW, rope_parameters=dict(PHI4_ROPE),
                  vision_config=vision, audio_config=audio, tie_word_embeddings=False, initializer_range=0.1)


def build_tiny_neoxjp(path: Path, seed: int = 131) -> Path:
    from transformers import GPTNeoXJapaneseConfig, GPTNeoXJapaneseForCausalLM as HFNeoXJp

    return _build(path, GPTNeoXJapaneseConfig, HFNeoXJp, seed, hidden_size=64, num_hidden_layers=3,
                  num_attention_heads=4, intermediate_multiple_size=2, max_position_embeddings=256,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                  attention_dropout=0.0, initializer_range=0.1)


def build_tiny_xglm(path: Path, seed: int = 132) -> Path:
    """(Its layers' weights drawn wider, std 0.3: the embedding scaled by sqrt(64) = 8 and the head tied, narrower ones
    leave each input token the greedy choice, a weak check of the engine's tokens.)"""
    from transformers import XGLMConfig, XGLMForCausalLM as HFXGLM

    return _build(path, XGLMConfig, HFXGLM, seed, d_model=64, num_layers=3, attention_heads=4, ffn_dim=128,
                  max_position_embeddings=256, dropout=0.0, attention_dropout=0.0, init_std=0.3)


@pytest.fixture(scope="session")
def tiny_phi4mm_dir(tmp_path_factory) -> Path:
    return build_tiny_phi4mm(tmp_path_factory.mktemp("tiny_phi4mm"))


@pytest.fixture(scope="session")
def tiny_neoxjp_dir(tmp_path_factory) -> Path:
    return build_tiny_neoxjp(tmp_path_factory.mktemp("tiny_neoxjp"))


@pytest.fixture(scope="session")
def tiny_xglm_dir(tmp_path_factory) -> Path:
    return build_tiny_xglm(tmp_path_factory.mktemp("tiny_xglm"))


FAMILIES = {"phi4mm": ("tiny_phi4mm_dir", Phi4MultimodalForCausalLM),
            "neoxjp": ("tiny_neoxjp_dir", GPTNeoXJapaneseForCausalLM), "xglm": ("tiny_xglm_dir", XGLMForCausalLM)}


@pytest.fixture(scope="module")
def references(tiny_phi4mm_dir, tiny_neoxjp_dir, tiny_xglm_dir) -> dict[str, torch.Tensor]:
    return {"phi4mm": reference_logits(tiny_phi4mm_dir), "neoxjp": reference_logits(tiny_neoxjp_dir),
            "xglm": reference_logits(tiny_xglm_dir)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(request, references, caplog, family, schedule):
    """Every position's logits equal transformers', a prefill and chunks + decode steps over shuffled blocks; every
    checkpoint tensor is read or deliberately skipped (Phi-4-multimodal's encoders) with no warning."""
    fixture, model_class = FAMILIES[family]
    with caplog.at_level("WARNING", logger="specray.models.llama"):
        model = load_model(str(request.getfixturevalue(fixture)))
    assert "ignoring checkpoint tensor" not in caplog.text
    assert isinstance(model, model_class)
    layers = model.model.layers
    if family == "phi4mm":
        assert model.kv_cache_specs() == [SlidingWindowSpec(2, 16, sliding_window=WINDOW)] * 3
        assert isinstance(layers[0].mlp, LlamaMLP) and model.lm_head.weight is not model.model.embed_tokens.weight
    else:
        assert model.kv_cache_specs() == [FullAttentionSpec(4, 16)] * 3 and isinstance(layers[0].mlp, GatelessMLP)
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if family == "neoxjp":  # the last layer's attention output alone has a bias; nothing else has one
        assert [layer.self_attn.o_proj.bias is not None for layer in layers] == [False, False, True]
        assert layers[0].self_attn.qkv_proj.bias is None and layers[0].mlp.c_fc.bias is None
        assert layers[0].mlp.c_fc.weight.shape[0] == 128  # intermediate_multiple_size 2
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), references[family]) < TOL


# ---- Phi-4-multimodal's release layout -------------------------------------------------------------------------------

LORA_MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _release_layout(tiny: Path, folder: Path) -> Path:
    """``tiny``'s checkpoint in the release's own layout (microsoft/Phi-4-multimodal-instruct's main branch): each
    projection's weight as ``X.base_layer.weight`` beside random built-in adapters ``X.lora_A.{vision,speech}.weight``
    / ``X.lora_B...`` (of other ranks, as the release's), its config naming Phi4MMForCausalLM / phi4mm."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny, folder)
    weights = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    for name in list(weights):
        if name.startswith("model.layers.") and name.endswith(tuple(f"{m}.weight" for m in LORA_MODULES)):
            stem = name.removesuffix(".weight")
            w = weights.pop(name)
            weights[f"{stem}.base_layer.weight"] = w
            for mode, rank in (("vision", 4), ("speech", 6)):
                weights[f"{stem}.lora_A.{mode}.weight"] = torch.randn(rank, w.shape[1], generator=g)
                weights[f"{stem}.lora_B.{mode}.weight"] = torch.randn(w.shape[0], rank, generator=g)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_the_release_layout_serves_the_base_weights(tiny_phi4mm_dir, references, tmp_path, caplog):
    """The release's names: ``base_layer`` read as each projection's weight (and split as Phi-3's fused ones are),
    the built-in adapters and the encoders not read (nor handed to the model: ``reads_weight``), the logits equal
    transformers' on the base weights alone (its text mode unsets the adapters)."""
    folder = _release_layout(tiny_phi4mm_dir, tmp_path / "release")
    config = read_config(str(folder))
    config.architectures, config.model_type = ["Phi4MMForCausalLM"], "phi4mm"  # (its config class is remote code)
    with caplog.at_level("WARNING", logger="specray.models.llama"):
        model = load_model(str(folder), config=config)
    assert "ignoring checkpoint tensor" not in caplog.text and isinstance(model, Phi4MultimodalForCausalLM)
    assert not model.reads_weight("model.layers.0.self_attn.qkv_proj.lora_A.vision.weight")
    assert not model.reads_weight("model.embed_tokens_extend.image_embed.img_projection_up.weight")
    assert model.reads_weight("model.layers.0.self_attn.qkv_proj.base_layer.weight")
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), references["phi4mm"]) < TOL


def test_the_built_in_adapters_would_move_the_logits(tiny_phi4mm_dir, references, tmp_path):
    """The adapters in the release-layout checkpoint are not negligible: merged into the base weights (what the
    vision mode would run), the logits move far from transformers' text-only ones, so reading them would show."""
    from safetensors.torch import load_file, save_file

    folder = _release_layout(tiny_phi4mm_dir, tmp_path / "release")
    weights = load_file(str(folder / "model.safetensors"))
    for name in [n for n in weights if n.endswith(".base_layer.weight")]:
        stem = name.removesuffix(".base_layer.weight")
        weights[name] = weights[name] + 0.01 * weights[f"{stem}.lora_B.vision.weight"] @ weights[
            f"{stem}.lora_A.vision.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = read_config(str(folder))
    assert max_diff(chunked_logits(load_model(str(folder), config=config), prompt(), SCHEDULES["prefill"]),
                    references["phi4mm"]) > MOVED


# ---- each distinctive part, broken on purpose ------------------------------------------------------------------------

def _attns(model) -> list:
    return [layer.self_attn for layer in model.model.layers]


def _no_window(model) -> None:
    for a in _attns(model):
        a.attn.mask_kind = CAUSAL


def _long_factors(config) -> None:
    """The long factors where the short ones serve."""
    config.rope_parameters = {**config.rope_parameters, "short_factor": PHI4_ROPE["long_factor"]}


def _gate_up_swapped(monkeypatch) -> None:
    real = phi4_multimodal.fused_pieces

    def swapped(config):
        pieces = real(config)
        pieces[".gate_up_proj."] = pieces[".gate_up_proj."][::-1]
        return pieces
    monkeypatch.setattr(phi4_multimodal, "fused_pieces", swapped)


def _rope_on_whole_heads(config) -> None:
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 1.0}


def _no_dense_bias(model) -> None:
    model.model.layers[-1].self_attn.o_proj.bias.data.zero_()


def _parallel_blocks(model) -> None:
    """GPT-NeoX's parallel residual: the MLP reads the stream entering the layer."""
    from specray.models.classic import ParallelDecoderLayer

    for layer in model.model.layers:
        layer.forward = ParallelDecoderLayer.forward.__get__(layer)
        layer.one_norm = False


def _unscaled_embedding(model) -> None:
    model.model.embedding_multiplier = 1.0


def _offset_zero(monkeypatch) -> None:
    monkeypatch.setattr(xglm, "POSITION_OFFSET", 0)


def _no_positions(monkeypatch) -> None:
    monkeypatch.setattr(xglm, "sinusoids", lambda positions, inv_freq, width, offset: torch.zeros(width))


def _cos_first(monkeypatch) -> None:
    real = xglm.sinusoids

    def swapped(positions, inv_freq, width, offset):
        return real(positions, inv_freq, width, offset).roll(width // 2, dims=-1)
    monkeypatch.setattr(xglm, "sinusoids", swapped)


MUTATIONS = {"phi4mm": {"no-window": (None, None, _no_window), "long-factors": (None, _long_factors, None),
                        "gate-up-swapped": (_gate_up_swapped, None, None)},
             "neoxjp": {"rope-on-whole-heads": (None, _rope_on_whole_heads, None),
                        "no-dense-bias": (None, None, _no_dense_bias),
                        "parallel-blocks": (None, None, _parallel_blocks)},
             "xglm": {"unscaled-embedding": (None, None, _unscaled_embedding), "offset-0": (_offset_zero, None, None),
                      "no-positions": (_no_positions, None, None), "cos-first": (_cos_first, None, None)}}


@pytest.mark.parametrize("family,mutation", [(f, m) for f in sorted(MUTATIONS) for m in sorted(MUTATIONS[f])])
def test_each_part_shows_in_the_logits(request, references, monkeypatch, family, mutation):
    """Each distinctive part broken once (Phi-4-multimodal: the window, LongRoPE's short factors, the fused gate/up
    order; GPT-NeoX-Japanese: partial RoPE, the last layer's dense_bias, Llama's order; XGLM: the embedding's scale,
    the positions' offset, the positions themselves, sin before cos): the logits move by more than a hundred times
    the tolerance."""
    patch, mutate_config, mutate = MUTATIONS[family][mutation]
    if patch is not None:
        patch(monkeypatch)
    folder = request.getfixturevalue(FAMILIES[family][0])
    assert max_diff(mutated_logits(folder, mutate_config, mutate), references[family]) > MOVED


# ---- what is refused -------------------------------------------------------------------------------------------------

def _set(field, value):
    def edit(config):
        setattr(config, field, value)
    return edit


@pytest.mark.parametrize("family,edit,match", [
    ("phi4mm", _set("hidden_act", "gelu"), r"hidden_act='gelu' is not supported"),
    ("neoxjp", _set("intermediate_multiple_size", 0), r"intermediate_multiple_size=0 must be a positive number"),
    ("neoxjp", _set("hidden_act", "swish"), r"hidden_act='swish' is not supported for model_type='gpt_neox_japanese'"),
    ("xglm", _set("add_cross_attention", True), r"add_cross_attention=True is not supported for model_type='xglm'"),
    ("xglm", _set("activation_function", "swish"), r"hidden_act='swish' is not supported for model_type='xglm'"),
], ids=["phi4mm-act", "neoxjp-width", "neoxjp-act", "xglm-cross", "xglm-act"])
def test_unserved_configs_are_refused_by_name(request, family, edit, match):
    folder = request.getfixturevalue(FAMILIES[family][0])
    config = read_config(str(folder))
    edit(config)
    with pytest.raises(ValueError, match=match):
        load_model(str(folder), config=config)


# ---- ranks and stages ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2], ids=["tp2", "pp2"])
def test_two_ranks_match_one_rank(tiny_phi4mm_dir, tiny_neoxjp_dir, tiny_xglm_dir, tmp_path, stages):
    """Two tensor-parallel ranks (heads, Phi-4's grouped KV heads, fused q/k/v rows, MLP widths, the last layer's
    dense_bias split as a row-parallel bias) or two pipeline stages (XGLM's sinusoids and the tied heads on their
    stages): the last rank's logits equal one rank's."""
    folders = [str(tiny_phi4mm_dir), str(tiny_neoxjp_dir), str(tiny_xglm_dir)]
    assert_ranks_match_one_rank(tmp_path, folders, stages, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_greedy_equals_transformers_with_drafts_and_graphs(request, no_host_sync, family):
    """``specray.LLM``'s greedy tokens equal transformers' ``generate``; so do they with n-gram chains verified
    eagerly and n-gram trees from graphs, their forward syncing nothing with the host."""
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_drafts_and_graphs_equal_transformers(request.getfixturevalue(FAMILIES[family][0]), no_host_sync, 12)


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(request, family, schedule):
    """tests/test_device_parity.py's check for this file's fixtures: fp32 logits on CUDA equal the CPU's."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    checks.assert_logits_on_the_gpu_equal_the_cpu(request.getfixturevalue(FAMILIES[family][0]), SCHEDULES[schedule])
