"""More classic families on :mod:`specray.models.classic`'s pieces, against transformers on the same random tiny
weights (fp32, max abs diff < 1e-4) over a 40-token prompt, as a prefill and as chunks + single steps:

* OpenAI GPT (``OpenAIGPTLMHeadModel``): post-LayerNorm blocks, learned positions from row 0, Conv1D weights with
  q/k/v fused in thirds, GELU's tanh approximation for ``afn: gelu``, no norm after the last layer, a tied head.
* CTRL (``CTRLLMHeadModel``): sinusoidal positions (sin of the even features' angles, then cos of the odd ones'), the
  embedding scaled by sqrt(n_embd), pre-LayerNorms at eps 1e-6 and a final one at the config's (0.5 here, so that
  the two show), a ReLU MLP, a tied head with a bias.
* BioGPT (``BioGptForCausalLM``): learned positions from row ``position + 2``, the embedding scaled by
  sqrt(hidden_size), pre-LayerNorms at eps 1e-5 whatever ``layer_norm_eps`` says (0.5 here), a tied head.
* ModernBERT's decoder (``ModernBertDecoderForCausalLM``): global and local layers (full, local, local, full; a window
  of 8 positions), a RoPE per kind (bases 160k and 10k), bias-free LayerNorms after the embedding and before each
  block but layer 0's attention, a GeGLU MLP, a dense + GELU + norm prediction head before the tied decoder with a
  bias; and the fused ``attn.Wqkv`` layout of its checkpoints read as the split one.

Also: the engine's greedy tokens equal transformers' ``generate`` (n-gram chains eagerly, trees from graphs), two
tensor-parallel ranks or pipeline stages equal one, LoRA adapters of the projections against transformers with the
adapter merged, each distinctive part broken once moves the logits, and what is not served is refused by name. The
tiny models are built here (transformers' own classes, random weights with the norms and biases drawn away from their
init), not in conftest."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from specray.models import ctrl, openai_gpt
from specray.models.biogpt import BioGptForCausalLM
from specray.models.ctrl import CTRLLMHeadModel
from specray.models.kv_cache import CAUSAL, FullAttentionSpec, MaskKind, SlidingWindowSpec
from specray.models.modernbert_decoder import ModernBertDecoderForCausalLM
from specray.models.loader import load_model, read_config
from specray.models.openai_gpt import OpenAIGPTLMHeadModel
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, assert_ranks_match_one_rank, chunked_logits, max_diff, mutated_logits,
    prompt, reference_logits)

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
WINDOW = 8  # ModernBERT's decoder's local layers' window (local_attention 16) of a 40-token prompt


def _randomized(model, seed: int) -> None:
    """The norms' weights away from ones and every bias away from zeros (their init), so that each shows; the biases
    small (std 0.1), else they outweigh the tokens in the residual stream."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("norm" in name or ".ln_" in name) and name.endswith(".weight"):
                param.copy_(torch.rand(param.shape, generator=g) + 0.5)
            elif name.endswith(".bias"):
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


def build_tiny_openai_gpt(path: Path, seed: int = 140) -> Path:
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel as HFOpenAIGPT

    return _build(path, OpenAIGPTConfig, HFOpenAIGPT, seed, n_embd=64, n_layer=3, n_head=4, n_positions=256,
                  afn="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.4)


def build_tiny_ctrl(path: Path, seed: int = 141) -> Path:
    from transformers import CTRLConfig, CTRLLMHeadModel as HFCTRL

    return _build(path, CTRLConfig, HFCTRL, seed, n_embd=64, n_layer=3, n_head=4, dff=128, n_positions=256,
                  resid_pdrop=0.0, embd_pdrop=0.0, layer_norm_epsilon=0.5, initializer_range=0.1)


def build_tiny_biogpt(path: Path, seed: int = 142) -> Path:
    from transformers import BioGptConfig, BioGptForCausalLM as HFBioGpt

    return _build(path, BioGptConfig, HFBioGpt, seed, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=256, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, layer_norm_eps=0.5, initializer_range=0.1)


def build_tiny_modernbert_decoder(path: Path, seed: int = 143) -> Path:
    from transformers import ModernBertDecoderConfig, ModernBertDecoderForCausalLM as HFModernBertDecoder

    return _build(path, ModernBertDecoderConfig, HFModernBertDecoder, seed, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=4, num_attention_heads=4, local_attention=2 * WINDOW, max_position_embeddings=256,
                  initializer_range=0.1)


@pytest.fixture(scope="session")
def tiny_ctrl_dir(tmp_path_factory) -> Path:
    return build_tiny_ctrl(tmp_path_factory.mktemp("tiny_ctrl"))


@pytest.fixture(scope="session")
def tiny_biogpt_dir(tmp_path_factory) -> Path:
    return build_tiny_biogpt(tmp_path_factory.mktemp("tiny_biogpt"))


@pytest.fixture(scope="session")
def tiny_modernbert_decoder_dir(tmp_path_factory) -> Path:
    return build_tiny_modernbert_decoder(tmp_path_factory.mktemp("tiny_modernbert_decoder"))


@pytest.fixture(scope="session")
def tiny_openai_gpt_dir(tmp_path_factory) -> Path:
    return build_tiny_openai_gpt(tmp_path_factory.mktemp("tiny_openai_gpt"))


FAMILIES = {"openai_gpt": ("tiny_openai_gpt_dir", OpenAIGPTLMHeadModel), "ctrl": ("tiny_ctrl_dir", CTRLLMHeadModel),
            "biogpt": ("tiny_biogpt_dir", BioGptForCausalLM),
            "modernbert_decoder": ("tiny_modernbert_decoder_dir", ModernBertDecoderForCausalLM)}


@pytest.fixture(scope="module")
def references(request) -> dict[str, torch.Tensor]:
    return {family: reference_logits(request.getfixturevalue(fixture)) for family, (fixture, _) in FAMILIES.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(request, references, caplog, family, schedule):
    """Every position's logits equal transformers', a prefill and chunks + decode steps over shuffled blocks; every
    checkpoint tensor is read, with no warning."""
    fixture, model_class = FAMILIES[family]
    with caplog.at_level("WARNING", logger="specray.models.llama"):
        model = load_model(str(request.getfixturevalue(fixture)))
    assert "ignoring checkpoint tensor" not in caplog.text
    assert isinstance(model, model_class)
    if family in ("openai_gpt", "ctrl", "biogpt"):
        assert model.kv_cache_specs() == [FullAttentionSpec(4, 16)] * 3
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert (model.lm_head.bias is not None) == (family == "ctrl")
    else:
        full, sliding = FullAttentionSpec(4, 16), SlidingWindowSpec(4, 16, sliding_window=WINDOW)
        assert model.kv_cache_specs() == [full, sliding, sliding, full]
        assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.bias is not None
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), references[family]) < TOL


# ---- each distinctive part, broken on purpose ------------------------------------------------------------------------

def _attns(model) -> list:
    return [layer.self_attn for layer in model.model.layers]


def _pre_norm(model) -> None:
    """GPT-2's pre-norm layers in place of the post-norm ones (the final norm still absent)."""
    from specray.models.llama import LlamaDecoderLayer

    for layer in model.model.layers:
        layer.forward = LlamaDecoderLayer.forward.__get__(layer)


def _unscaled_scores(model) -> None:
    for a in _attns(model):
        a.attn.scale = 1.0


def _positions_offset_2(model) -> None:
    model.model.embed_positions.offset = 2


def _no_positions(model) -> None:
    model.model.embed_positions.weight.data.zero_()


def _unscaled_embedding(model) -> None:
    model.model.embedding_multiplier = 1.0


def _cos_first(monkeypatch) -> None:
    real = ctrl.sinusoids

    def swapped(positions, rates):
        return real(positions, rates).roll(rates.shape[0] // 2, dims=-1)
    monkeypatch.setattr(ctrl, "sinusoids", swapped)


def _interleaved(monkeypatch) -> None:
    """sin and cos interleaved feature by feature (the table transformers builds before it concatenates)."""
    def interleaved(positions, rates):
        angles = positions.float()[:, None] * rates[None, :]
        return torch.where(torch.arange(rates.shape[0]) % 2 == 0, angles.sin(), angles.cos())
    monkeypatch.setattr(ctrl, "sinusoids", interleaved)


def _ctrl_offset_2(monkeypatch) -> None:
    real = ctrl.sinusoids
    monkeypatch.setattr(ctrl, "sinusoids", lambda positions, rates: real(positions + 2, rates))


def _ctrl_no_positions(monkeypatch) -> None:
    monkeypatch.setattr(ctrl, "sinusoids", lambda positions, rates: torch.zeros(rates.shape[0]))


def _no_head_bias(model) -> None:
    model.lm_head.bias.data.zero_()


def _layer_eps_from_config(monkeypatch) -> None:
    """The layers' LayerNorms at the config's eps (0.5) where transformers fixes theirs."""
    monkeypatch.setattr(ctrl, "LAYER_NORM_EPS", 0.5)


def _biogpt_reads_config_eps(monkeypatch) -> None:
    """The config's layer_norm_eps (0.5) read, where transformers' BioGPT keeps torch's 1e-5."""
    from specray.models import biogpt

    monkeypatch.setattr(biogpt, "LAYER_NORM_EPS", 0.5)


def _offset_0(model) -> None:
    model.model.embed_positions.offset = 0


def _local(model) -> list:
    return [a for a, kind in zip(_attns(model), model.model.layer_types) if kind == "sliding_attention"]


def _no_window(model) -> None:
    for a in _local(model):
        a.attn.mask_kind = CAUSAL


def _window_one_wider(model) -> None:
    for a in _local(model):
        a.attn.mask_kind = MaskKind(window=WINDOW + 1)


def _one_rope(model) -> None:
    """The global layers' RoPE (base 160k) for every layer."""
    model.model.rotary["sliding_attention"] = model.model.rotary["full_attention"]


def _no_embed_norm(model) -> None:
    model.model.embed_norm = torch.nn.Identity()


def _layer0_normed(model) -> None:
    """Layer 0's attention reading the stream through a LayerNorm (the next layer's) as the others do."""
    model.model.layers[0].input_layernorm = model.model.layers[1].input_layernorm


def _geglu_halves_swapped(model) -> None:
    for layer in model.model.layers:
        w = layer.mlp.gate_up_proj.weight.data
        w.copy_(torch.cat(w.chunk(2)[::-1]))


def _no_prediction_head(model) -> None:
    model.prediction_head = torch.nn.Identity()


def _no_head_act(model) -> None:
    model.prediction_head.act = lambda x: x


MUTATIONS = {"openai_gpt": {"pre-norm": (None, None, _pre_norm),
                            "unscaled-scores": (None, None, _unscaled_scores),
                            "positions-offset-2": (None, None, _positions_offset_2),
                            "no-positions": (None, None, _no_positions)},
             "ctrl": {"unscaled-embedding": (None, None, _unscaled_embedding), "cos-first": (_cos_first, None, None),
                      "interleaved": (_interleaved, None, None), "offset-2": (_ctrl_offset_2, None, None),
                      "no-positions": (_ctrl_no_positions, None, None), "no-head-bias": (None, None, _no_head_bias),
                      "layer-eps-from-config": (_layer_eps_from_config, None, None)},
             "biogpt": {"unscaled-embedding": (None, None, _unscaled_embedding), "offset-0": (None, None, _offset_0),
                        "no-positions": (None, None, _no_positions),
                        "eps-from-config": (_biogpt_reads_config_eps, None, None)},
             "modernbert_decoder": {"no-window": (None, None, _no_window),
                                    "window-one-wider": (None, None, _window_one_wider),
                                    "one-rope": (None, None, _one_rope), "no-embed-norm": (None, None, _no_embed_norm),
                                    "layer0-normed": (None, None, _layer0_normed),
                                    "geglu-halves-swapped": (None, None, _geglu_halves_swapped),
                                    "no-prediction-head": (None, None, _no_prediction_head),
                                    "no-head-act": (None, None, _no_head_act),
                                    "no-decoder-bias": (None, None, _no_head_bias)}}


@pytest.mark.parametrize("family,mutation", [(f, m) for f in sorted(MUTATIONS) for m in sorted(MUTATIONS[f])])
def test_each_part_shows_in_the_logits(request, references, monkeypatch, family, mutation):
    """Each distinctive part broken once (OpenAI GPT: post-norm blocks, the scores' scale, positions from
    row 0, the learned positions; CTRL: the embedding's scale, the sinusoids' order (sin block first, not
    interleaved), their offset 0, the positions themselves, the head's bias, the layers' fixed eps; BioGPT: the
    embedding's scale, the positions' offset 2, the positions themselves, the eps transformers uses; ModernBERT's
    decoder: the window and its width, a RoPE per kind, the embedding's norm, layer 0's unnormed attention input,
    GeGLU's halves, the prediction head and its activation, the decoder's bias): the logits move by more than a
    hundred times the tolerance."""
    patch, mutate_config, mutate = MUTATIONS[family][mutation]
    if patch is not None:
        patch(monkeypatch)
    folder = request.getfixturevalue(FAMILIES[family][0])
    assert max_diff(mutated_logits(folder, mutate_config, mutate), references[family]) > MOVED


def test_openai_gpt_activations_are_transformers():
    """Each ``afn`` is transformers' ACT_FNS function ("gelu": the tanh approximation, whose difference from
    the exact GELU, below 1e-3, is too small to show through the tiny model's logits, so it is checked here)."""
    import torch.nn.functional as F
    from transformers.models.openai.modeling_openai import ACT_FNS

    x = torch.linspace(-6, 6, 2001)
    assert set(openai_gpt.AFNS) == set(ACT_FNS)
    for afn, fn in openai_gpt.AFNS.items():
        assert (fn(x) - ACT_FNS[afn](x)).abs().max() < 1e-6, afn  # (gelu_new by its formula: rounding apart)
    assert (openai_gpt.AFNS["gelu"](x) - F.gelu(x)).abs().max() > 1e-4


# ---- LoRA ------------------------------------------------------------------------------------------------------------

# family -> (the checkpoint's projections an adapter names, whether they are Conv1D weights [in, out])
ADAPTED = {"openai_gpt": (("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"), True),
           "ctrl": (tuple(f"multi_head_attention.{p}" for p in ("Wq", "Wk", "Wv", "dense")) + ("ffn.0", "ffn.2"),
                    False),
           "biogpt": (tuple(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "out_proj")) + ("fc1", "fc2"),
                      False),
           "modernbert_decoder": (("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.Wo", "mlp.Wo"), False)}


def _adapter(base: Path, dst: Path, merged: Path, modules: tuple[str, ...], conv1d: bool) -> None:
    """A PEFT adapter (rank 4, alpha 8: scale 2) of every ``modules`` projection of ``base``'s checkpoint, written to
    ``dst``, and ``base`` with it merged (W + 2 B A; a Conv1D weight [in, out] gets its transpose) written to
    ``merged``."""
    import json

    from safetensors.torch import load_file, save_file

    weights = load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    tensors = {}
    for name in sorted(weights):
        if not name.endswith(tuple(f".{m}.weight" for m in modules)):
            continue
        out_features, in_features = weights[name].shape[::-1] if conv1d else weights[name].shape
        a, b = torch.randn(4, in_features, generator=g) * 0.2, torch.randn(out_features, 4, generator=g) * 0.2
        module = name.removesuffix(".weight")
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
        delta = 2 * b @ a
        weights[name] = weights[name] + (delta.t() if conv1d else delta)
    dst.mkdir(parents=True)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    (dst / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
        "bias": "none", "task_type": "CAUSAL_LM"}))
    shutil.copytree(base, merged)
    save_file(weights, str(merged / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("family", sorted(ADAPTED))
def test_adapted_logits_match_transformers_with_the_adapter_merged(request, tmp_path, family):
    """An adapter of every projection as PEFT names them (fused q/k/v: its B split as the weight is), admitted by the
    engine's check against the model's shapes; its prefill's logits equal transformers' on the merged weights, and
    differ from the base's."""
    from transformers import AutoModelForCausalLM

    from specray.lora import LoRAConfig, LoRARequest, read_adapter
    from specray.models.attention import build_attention_metadata
    from specray.models.kv_cache import allocate_kv_cache
    from specray.models.lora import LoRASlots, adapter_shapes

    base = request.getfixturevalue(FAMILIES[family][0])
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    _adapter(base, adapter, merged, *ADAPTED[family])
    model = load_model(str(base))
    info = read_adapter(str(adapter), adapter_shapes(model), 4, model.adapter_module)  # (the admission check)
    assert info.scale(4) == 2.0
    slots = LoRASlots(model, LoRAConfig(max_loras=1, max_lora_rank=4), torch.device("cpu"))
    ids = prompt()[:20]
    slots.context.set_token_slots(torch.tensor(slots.slots_for([LoRARequest("a", 1, str(adapter))]) * len(ids)))
    allocate_kv_cache(model, 8, 4)
    meta = build_attention_metadata([len(ids)], [0], [list(range(8))[::-1]], 4, "cpu")
    with torch.no_grad():
        got = model.compute_logits(model(torch.tensor(ids), meta))
        want, plain = (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(
            torch.tensor([ids])).logits[0] for folder in (merged, base))
    assert max_diff(got, want) < TOL and max_diff(got, plain) > MOVED


# ---- what is refused -------------------------------------------------------------------------------------------------

def _set(field, value):
    def edit(config):
        setattr(config, field, value)
    return edit


def _rope_type(kind):
    def edit(config):
        config.rope_parameters = {**config.rope_parameters,
                                  "full_attention": {**config.rope_parameters["full_attention"], "rope_type": kind,
                                                     "factor": 2.0}}
    return edit


REFUSALS = {"openai-afn": ("openai_gpt", _set("afn", "tanh"), r"afn='tanh' is not supported for "
                                                             r"model_type='openai-gpt'"),
            "modernbert-act": ("modernbert_decoder", _set("hidden_activation", "swish"),
                               r"hidden_activation='swish' is not supported for model_type='modernbert-decoder'"),
            "modernbert-head-act": ("modernbert_decoder", _set("classifier_activation", "swish"),
                                    r"classifier_activation='swish' is not supported"),
            "modernbert-window": ("modernbert_decoder", _set("local_attention", None),
                                  r"local_attention=None with sliding_attention layers"),
            "modernbert-rope": ("modernbert_decoder", _rope_type("linear"),
                                r"rope_parameters\['full_attention'\] rope_type='linear' is not supported"),
            "biogpt-act": ("biogpt", _set("hidden_act", "swish"), r"hidden_act='swish' is not supported for "
                                                                  r"model_type='biogpt'")}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_unserved_configs_are_refused_by_name(request, case):
    family, edit, match = REFUSALS[case]
    folder = request.getfixturevalue(FAMILIES[family][0])
    config = read_config(str(folder))
    edit(config)
    with pytest.raises(ValueError, match=match):
        load_model(str(folder), config=config)


def test_modernbert_decoder_fused_wqkv_is_split(tiny_modernbert_decoder_dir, references, tmp_path, caplog):
    """A checkpoint with each layer's q/k/v fused in thirds as ``attn.Wqkv`` (ModernBERT's encoder layout) gives the
    same logits, every tensor read."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "wqkv"
    shutil.copytree(tiny_modernbert_decoder_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    for i in range(4):
        stem = f"model.layers.{i}.attn."
        weights[f"{stem}Wqkv.weight"] = torch.cat([weights.pop(f"{stem}{p}_proj.weight") for p in "qkv"])
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="specray.models.llama"):
        model = load_model(str(folder))
    assert "ignoring checkpoint tensor" not in caplog.text
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["prefill"]), references["modernbert_decoder"]) < TOL


# ---- ranks and stages ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2], ids=["tp2", "pp2"])
def test_two_ranks_match_one_rank(request, tmp_path, stages):
    """Two tensor-parallel ranks (heads, split q/k/v rows, MLP widths and biases) or two pipeline stages (positions,
    post-norm streams and the tied heads on their stages): the last rank's logits equal one rank's."""
    folders = [str(request.getfixturevalue(fixture)) for fixture, _ in FAMILIES.values()]
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
