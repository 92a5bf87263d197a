"""Three small 2026 text families of transformers 5.24, against transformers on the same random tiny weights (fp32, max
abs diff < 1e-4) over a prefill and over chunks and single steps, with the engine's greedy output under n-gram drafts
equal to transformers' ``generate``, two tensor-parallel ranks equal to one, each distinctive part broken once to
show in the logits, and what is not served refused by name:

* Apertus 1.5's text model (``Apertus1p5TextForCausalLM``, :mod:`specray.models.apertus1p5`): Apertus with an
  extended vocabulary and a pruned LM head (the pruned ids' logits -inf), and its multimodal release's text part.
* Dory (``DoryForCausalLM``, :mod:`specray.models.dory`): a looped nGPT, a KV cache per loop of its recurrent layers
  (n-gram chains, trees and graph steps exact), its L2 norms and learned scales; last_loop caching refused.
* HRM-Text (``HrmTextForCausalLM``, :mod:`specray.models.hrm_text`): L and H stacks run in nested cycles, a KV cache
  per run of a layer as transformers' cache slots (chains, trees and graph steps exact), gated attention, z_L's start.

The tiny models are built here (transformers' own classes, random weights made visible), not in conftest."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from specray.models.apertus import ApertusMLP
from specray.models import dory, hrm_text
from specray.models.apertus1p5 import Apertus1p5ForCausalLM
from specray.models.dory import DoryForCausalLM
from specray.models.hrm_text import HrmTextForCausalLM
from specray.models.kv_cache import CAUSAL, allocate_kv_cache
from specray.models.loader import load_model, read_config
from specray_test_model_checks import (DIFF_WORKER, SCHEDULES, chunked_logits,  # tests/model_checks.py
                                       max_diff, mutated_logits, prefill_logits, prompt, reference_logits, run_ranks)

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)


def _tokenizer(path: Path):
    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    return build_tiny_tokenizer(path)


def _copy_tokenizer(source: Path, path: Path) -> None:
    for file in source.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, path / file.name)


def _visible(model, norms: tuple[str, ...] = ("norm.weight",)) -> None:
    """Norm weights (ones at init) drawn from [0.5, 1.5], so that a norm read wrong shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(norms):
                param.uniform_(0.5, 1.5)


# ---- Apertus 1.5 -----------------------------------------------------------------------------------------------------

APERTUS_VOCAB = 400  # the tokenizer's 320 text ids, then 40 visual and 40 audio codes; the head keeps the 320
APERTUS_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
                    initializer_range=0.1, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                     "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0})


def build_tiny_apertus1p5(path: Path, seed: int = 61) -> Path:
    """transformers' Apertus1p5TextForCausalLM at :data:`APERTUS_TINY`'s sizes, vocab 400, its head pruned to the
    tokenizer's ids; norms and each layer's xIELU scalars drawn away from their init."""
    from transformers import Apertus1p5TextConfig, Apertus1p5TextForCausalLM

    tok = _tokenizer(path)
    config = Apertus1p5TextConfig(vocab_size=APERTUS_VOCAB, output_vocab_size=len(tok),
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                                  **APERTUS_TINY)
    torch.manual_seed(seed)
    model = Apertus1p5TextForCausalLM(config).float().eval()
    _visible(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_apertus1p5_multimodal(text: Path, path: Path) -> Path:
    """transformers' Apertus1p5ForConditionalGeneration holding the text model in ``text`` beside a one-stage vision
    tokenizer and a small WavTokenizer encoder (their code ranges filling the vocabulary past the text ids), saved as
    transformers saves it."""
    from transformers import (Apertus1p5Config, Apertus1p5ForConditionalGeneration, Apertus1p5TextForCausalLM)

    hf_text = Apertus1p5TextForCausalLM.from_pretrained(text, dtype=torch.float32)
    kept = hf_text.config.output_vocab_size
    config = Apertus1p5Config(
        text_config=hf_text.config.to_dict(), image_token_offset=kept, audio_token_offset=kept + 40,
        image_token_id=300, audio_token_id=301, tie_word_embeddings=False,
        vision_config=dict(codebook_size=40, embed_dim=8, latent_channels=8, base_channels=32, channel_multiplier=[1],
                           num_res_blocks=1, attn_resolutions=[], resolution=32),
        audio_config=dict(model_type="wavtokenizer_encoder", num_filters=4, upsampling_ratios=[2, 2], hidden_size=8,
                          codebook_size=40, codebook_dim=8, num_lstm_layers=1))
    torch.manual_seed(0)
    model = Apertus1p5ForConditionalGeneration(config).float().eval()
    model.model.language_model.load_state_dict(hf_text.model.state_dict())
    model.lm_head.load_state_dict(hf_text.lm_head.state_dict())
    model.save_pretrained(path, safe_serialization=True)
    _copy_tokenizer(text, path)
    return path


@pytest.fixture(scope="module")
def tiny_apertus1p5_dir(tmp_path_factory) -> Path:
    return build_tiny_apertus1p5(tmp_path_factory.mktemp("tiny_apertus1p5"))


@pytest.fixture(scope="module")
def apertus1p5_reference(tiny_apertus1p5_dir) -> torch.Tensor:
    return reference_logits(tiny_apertus1p5_dir)


def _kept(logits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """The first ``reference.shape[-1]`` columns of ``logits`` (the head's ids), after checking the rest are -inf."""
    kept = reference.shape[-1]
    assert logits.shape[-1] == APERTUS_VOCAB and bool((logits[:, kept:] == float("-inf")).all())
    return logits[:, :kept]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_apertus1p5_logits_match_transformers(tiny_apertus1p5_dir, apertus1p5_reference, schedule):
    """Every position's logits equal transformers' over the head's 320 ids; the pruned 80 ids are -inf (the
    vocabulary's width, which the engine checks ids, masks and drafts against)."""
    model = load_model(str(tiny_apertus1p5_dir))
    assert isinstance(model, Apertus1p5ForCausalLM) and isinstance(model.model.layers[0].mlp, ApertusMLP)
    assert model.lm_head.weight.shape == (320, 64) and model.model.embed_tokens.weight.shape == (APERTUS_VOCAB, 64)
    got = chunked_logits(model, prompt(), SCHEDULES[schedule])
    assert max_diff(_kept(got, apertus1p5_reference), apertus1p5_reference) < TOL


def test_apertus1p5_multimodal_checkpoint_serves_its_text_model(tiny_apertus1p5_dir, apertus1p5_reference,
                                                                 tmp_path, caplog):
    """Apertus1p5ForConditionalGeneration's checkpoint: the text model is built from its text_config and reads its own
    tensors alone (the vision and audio tokenizers' are never offered to it); its logits equal the text model's."""
    from safetensors import safe_open

    folder = build_tiny_apertus1p5_multimodal(tiny_apertus1p5_dir, tmp_path / "mm")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert any(n.startswith("model.vision_tokenizer.") for n in names)
    assert any(n.startswith("model.audio_tokenizer.") for n in names)
    assert "model.language_model.layers.1.attention_layernorm.weight" in names and "lm_head.weight" in names
    config = read_config(str(folder))
    assert config.architectures == ["Apertus1p5ForConditionalGeneration"]
    with caplog.at_level("WARNING", logger="specray.models.llama"):
        model = load_model(str(folder))
    assert isinstance(model, Apertus1p5ForCausalLM) and model.config.model_type == "apertus1p5_text"
    assert "ignoring checkpoint tensor" not in caplog.text
    got = prefill_logits(model, prompt())
    assert max_diff(_kept(got, apertus1p5_reference), apertus1p5_reference) < TOL


def _apertus_no_qk_norm(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = None


def _apertus_head_from_embedding(model) -> None:
    """The head read as the embedding's first rows (a tied head), not its own tensor."""
    model.lm_head.weight.data.copy_(model.model.embed_tokens.weight[: model.head_rows(model.config)])


def _apertus_plain_xielu(model) -> None:
    """Every layer's xIELU at its init scalars, not the checkpoint's."""
    for layer in model.model.layers:
        layer.mlp.act_fn.alpha_p.data.zero_()
        layer.mlp.act_fn.alpha_n.data.zero_()


APERTUS_MUTATIONS = {"no-qk-norm": _apertus_no_qk_norm, "head-from-embedding": _apertus_head_from_embedding,
                     "plain-xielu": _apertus_plain_xielu}


@pytest.mark.parametrize("mutation", sorted(APERTUS_MUTATIONS))
def test_apertus1p5_each_part_shows_in_the_logits(tiny_apertus1p5_dir, apertus1p5_reference, mutation):
    """The q/k norms (turned on for this model type by its own attention), the pruned head's own tensor and the
    per-layer xIELU scalars, each broken once: the kept logits move by more than a hundred times the tolerance."""
    got = mutated_logits(tiny_apertus1p5_dir, None, APERTUS_MUTATIONS[mutation])
    assert max_diff(_kept(got, apertus1p5_reference), apertus1p5_reference) > MOVED


def _set(field, value):
    def edit(config):
        setattr(config, field, value)
    return edit


@pytest.mark.parametrize("edit,match", [
    (_set("tie_word_embeddings", True), r"tie_word_embeddings=True with output_vocab_size=320 < vocab_size=400"),
    (_set("output_vocab_size", 401), r"output_vocab_size=401 must be an int in \[1, vocab_size=400\]"),
    (_set("hidden_act", "silu"), r"hidden_act='silu' is not supported for model_type='apertus1p5_text'"),
], ids=["tied-pruned-head", "output_vocab_size", "hidden_act"])
def test_apertus1p5_inconsistent_configs_are_refused_by_name(tiny_apertus1p5_dir, edit, match):
    config = read_config(str(tiny_apertus1p5_dir))
    edit(config)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_apertus1p5_dir), config=config)


def test_apertus1p5_unpruned_head_matches_transformers(tiny_apertus1p5_dir, tmp_path):
    """output_vocab_size null: a head over the whole vocabulary (no -inf), as transformers builds it."""
    from transformers import Apertus1p5TextForCausalLM

    folder = tmp_path / "unpruned"
    shutil.copytree(tiny_apertus1p5_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["output_vocab_size"] = None
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    hf = Apertus1p5TextForCausalLM.from_pretrained(folder, dtype=torch.float32, ignore_mismatched_sizes=True)
    hf.save_pretrained(folder, safe_serialization=True)  # a fresh head of 400 rows
    model = load_model(str(folder))
    assert model.lm_head.weight.shape == (APERTUS_VOCAB, 64)
    got = chunked_logits(model, prompt(), SCHEDULES["chunked+decode"])
    assert bool(got.isfinite().all()) and max_diff(got, reference_logits(folder)) < TOL


def test_apertus1p5_engine_greedy_equals_transformers(tiny_apertus1p5_dir):
    """``specray.LLM``'s greedy tokens with n-gram drafts equal transformers' ``generate`` (drafts accepted)."""
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_ngram_greedy_equals_transformers(tiny_apertus1p5_dir)



# ---- Dory ------------------------------------------------------------------------------------------------------------

DORY_INIT = 0.1  # initializer_range: every nGPT scale is stored as s and used as s * s_init / initializer_range
DORY_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, n_input_layers=1, n_output_layers=1, n_recurrent_loops=3,
                 sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                "full_attention"],
                 initializer_range=DORY_INIT, ngpt_alpha_init=0.3, max_position_embeddings=1024,
                 tie_word_embeddings=False)


def build_tiny_dory(path: Path, seed: int = 62) -> Path:
    """transformers' DoryForCausalLM: one input layer, two recurrent layers looped three times, one output layer,
    sliding (window 8) and full layers with their own RoPE bases; every learned scale drawn away from its init (the
    rates and gates each feature its own, some rates negative, the head's scale per entry)."""
    from transformers import DoryConfig, DoryForCausalLM

    tok = _tokenizer(path)
    config = DoryConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                        bos_token_id=None, **DORY_TINY)
    torch.manual_seed(seed)
    model = DoryForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("lambda_1", "lambda_2")):
                param.normal_(0.0, DORY_INIT)
            elif name.endswith(("sqk", "s_gate")):
                param.uniform_(0.5 * DORY_INIT, 1.5 * DORY_INIT)
            elif name.endswith(("suv_gate", "suv_up")):
                param.uniform_(0.5, 1.5)
            elif name.endswith("logit_scale"):
                param.uniform_(5 * DORY_INIT, 15 * DORY_INIT)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def tiny_dory_dir(tmp_path_factory) -> Path:
    return build_tiny_dory(tmp_path_factory.mktemp("tiny_dory"))


@pytest.fixture(scope="module")
def dory_reference(tiny_dory_dir) -> torch.Tensor:
    return reference_logits(tiny_dory_dir)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_dory_logits_match_transformers(tiny_dory_dir, dory_reference, schedule):
    """Every position's logits equal transformers' (per_loop cache: each loop's run of a recurrent layer its own
    K/V), for a prefill and for chunks + decode steps over shuffled blocks; the release's doubled layer counts and
    (attention, mlp) layer_types read as transformers reads them."""
    model = load_model(str(tiny_dory_dir))
    assert isinstance(model, DoryForCausalLM) and model.config.num_hidden_layers == 4
    assert json.loads((tiny_dory_dir / "config.json").read_text())["num_hidden_layers"] == 8
    assert [len(layer.self_attn.attns) for layer in model.model.layers] == [1, 3, 3, 1]
    windows = [getattr(spec, "sliding_window", None) for spec in model.kv_cache_specs()]
    assert windows == [8] + [None] * 3 + [8] * 3 + [None]
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), dory_reference) < TOL



def _release_name(name: str) -> str:
    """transformers' saved name of a Dory tensor as the release lays it out: each layer an attention block
    ``layers.2i`` and an MLP block ``layers.2i+1``, their modules under ``mixer``, the rates as ``*_alpha``."""
    match = re.match(r"backbone\.layers\.(\d+)\.(self_attn|mlp|lambda_1|lambda_2)(.*)$", name)
    if match is None:
        return name
    i, part, rest = int(match[1]), match[2], match[3]
    block = 2 * i + (part in ("mlp", "lambda_2"))
    name = {"lambda_1": "attn_alpha", "lambda_2": "mlp_alpha"}.get(part, "mixer")
    return f"backbone.layers.{block}.{name}{rest}"


def test_dory_release_layout_matches_transformers(tiny_dory_dir, dory_reference, tmp_path, caplog):
    """The release's tensor layout (two blocks per layer under ``mixer``, ``attn_alpha`` / ``mlp_alpha``,
    ``backbone.embeddings``, the gate as ``g_proj``), which transformers reads back to the same logits: ours too,
    every tensor read."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "release"
    shutil.copytree(tiny_dory_dir, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    released = {_release_name(name): t for name, t in tensors.items()}
    assert "backbone.layers.7.mixer.down_proj.weight" in released and "backbone.layers.2.attn_alpha" in released
    save_file(released, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert max_diff(reference_logits(folder), dory_reference) < TOL
    with caplog.at_level("WARNING", logger="specray.models.llama"):
        model = load_model(str(folder))
    assert "ignoring checkpoint tensor" not in caplog.text
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), dory_reference) < TOL


def _dory_rms(monkeypatch) -> None:
    """RMS norms (the mean square) in place of L2 norms (the sum of squares)."""
    monkeypatch.setattr(dory, "l2_normed", lambda x, tp=None: torch.nn.functional.rms_norm(x, (x.shape[-1],),
                                                                                          eps=dory.L2_EPS))


def _dory_one_cache(model) -> None:
    """Every loop of a recurrent layer reading and writing one K/V (transformers' last_loop-like sharing)."""
    for layer in model.model.layers:
        attns = layer.self_attn.attns
        layer.self_attn.attns = torch.nn.ModuleList([attns[0]] * len(attns))
    allocate_kv_cache(model, 64, 4)  # bind again: the last binding of the shared module wins


def _dory_attns(model):
    return [layer.self_attn for layer in model.model.layers]


def _dory_plain_sqk(model) -> None:
    for a in _dory_attns(model):
        a.sqk.data.fill_(DORY_INIT)


def _dory_gate_unscaled(model) -> None:
    for a in _dory_attns(model):
        a.s_gate_scale = 1.0


def _dory_plain_suv(model) -> None:
    for layer in model.model.layers:
        layer.mlp.suv_gate.data.fill_(1.0)
        layer.mlp.suv_up.data.fill_(1.0)


def _dory_plain_logit_scale(model) -> None:
    model.lm_head.logit_scale.data.fill_(DORY_INIT)


def _dory_no_window(model) -> None:
    for a in _dory_attns(model):
        for attn in a.attns:
            attn.mask_kind = CAUSAL


def _dory_one_rope(model) -> None:
    model.model.rotary["sliding_attention"] = model.model.rotary["full_attention"]


def _dory_one_loop(config) -> None:
    config.n_recurrent_loops = 1


def _dory_signed_rates(monkeypatch) -> None:
    """The residual rates without their absolute value."""
    def forward(self, x, cos, sin, meta, run=0):
        x = dory.l2_normed(x)
        x = x + self.lambda_1 * self.lambda_scale * (dory.l2_normed(self.self_attn(x, cos, sin, meta, run)) - x)
        x = dory.l2_normed(x)
        return x + self.lambda_2 * self.lambda_scale * (dory.l2_normed(self.mlp(x)) - x)
    monkeypatch.setattr(dory.DoryDecoderLayer, "forward", forward)


DORY_MUTATIONS = {"rms-norms": (_dory_rms, None, None), "one-cache-for-all-loops": (None, None, _dory_one_cache),
                  "plain-sqk": (None, None, _dory_plain_sqk), "gate-unscaled": (None, None, _dory_gate_unscaled),
                  "plain-suv": (None, None, _dory_plain_suv),
                  "plain-logit-scale": (None, None, _dory_plain_logit_scale),
                  "no-window": (None, None, _dory_no_window), "one-rope": (None, None, _dory_one_rope),
                  "one-loop": (None, _dory_one_loop, None), "signed-rates": (_dory_signed_rates, None, None)}


@pytest.mark.parametrize("mutation", sorted(DORY_MUTATIONS))
def test_dory_each_part_shows_in_the_logits(tiny_dory_dir, dory_reference, monkeypatch, mutation):
    """Each distinctive part broken once (L2 norms, a cache per loop, the queries' and the MLP's per-feature scales,
    the gate's scale, the head's scale, the window, the RoPE per kind, the loops, the rates' absolute value): the
    logits move by more than a hundred times the tolerance."""
    patch, mutate_config, mutate = DORY_MUTATIONS[mutation]
    if patch is not None:
        patch(monkeypatch)
    assert max_diff(mutated_logits(tiny_dory_dir, mutate_config, mutate), dory_reference) > MOVED


def _dory_partial_rope(config) -> None:
    config.rope_parameters["full_attention"]["partial_rotary_factor"] = 0.5


@pytest.mark.parametrize("edit,match", [
    (_set("recurrent_kv_cache_mode", "last_loop"), r"recurrent_kv_cache_mode='last_loop' is not supported .*per_loop"),
    (_set("n_output_layers", 2), r"n_output_layers=2.* must add up to num_hidden_layers=4"),
    (_set("hidden_act", "gelu"), r"hidden_act='gelu' is not supported for model_type='dory'"),
    (_dory_partial_rope, r"partial_rotary_factor=0.5 is not supported for model_type='dory'"),
], ids=["last_loop", "sections", "hidden_act", "partial_rotary_factor"])
def test_dory_inconsistent_configs_are_refused_by_name(tiny_dory_dir, edit, match):
    config = read_config(str(tiny_dory_dir))
    edit(config)
    with pytest.raises(ValueError, match=match):
        load_model(str(tiny_dory_dir), config=config)


@pytest.mark.parametrize("family", ["dory", "hrm_text"])
def test_stages_heads_and_lora_are_refused_by_name(tiny_dory_dir, tiny_hrm_dir, family):
    """Two pipeline stages, a hidden-state draft head and LoRA are refused by name before any rank starts."""
    from specray import LLM
    from specray.config import EngineArgs
    from specray.engine.builder import check_model_args

    folder = str({"dory": tiny_dory_dir, "hrm_text": tiny_hrm_dir}[family])
    config = read_config(folder)
    with pytest.raises(ValueError, match=rf"pipeline_parallel_size=2 is not supported for model_type='{family}'"):
        check_model_args(EngineArgs(model=folder, pipeline_parallel_size=2), config)
    eagle = EngineArgs(model=folder, speculative_config={"method": "eagle3", "model": "x", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=rf"method='eagle3' .* not supported for model_type='{family}'"):
        check_model_args(eagle, config)
    with pytest.raises(ValueError, match=rf"LoRA adapters are not applied to {family} models"):
        LLM(model=folder, max_model_len=64, block_size=4, enable_lora=True)


def test_dory_engine_greedy_equals_transformers_with_drafts_and_graphs(tiny_dory_dir, no_host_sync):
    """``specray.LLM``'s greedy tokens equal transformers' ``generate``; so do they with n-gram chains verified
    eagerly and n-gram trees from graphs (each loop's K/V moved with the accepted path; nothing synced)."""
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_drafts_and_graphs_equal_transformers(tiny_dory_dir, no_host_sync, 12)



# ---- HRM-Text --------------------------------------------------------------------------------------------------------

HRM_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                H_cycles=2, L_cycles=2, initializer_range=0.1, attention_bias=True, max_position_embeddings=1024,
                tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})


def build_tiny_hrm(path: Path, seed: int = 63) -> Path:
    """transformers' HrmTextForCausalLM: two layers per stack, two H cycles of two L cycles each (12 runs of a layer a
    token), biased attention and gates, ``z_L_init`` drawn away from its zeros; saved as transformers saves it (the
    attention's gate/q/k/v fused as ``attn.gqkv_proj``, the MLP's ``gate_up_proj``)."""
    from transformers import HrmTextConfig, HrmTextForCausalLM

    tok = _tokenizer(path)
    config = HrmTextConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                           bos_token_id=None, **HRM_TINY)
    torch.manual_seed(seed)
    model = HrmTextForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".bias", "z_L_init")):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def tiny_hrm_dir(tmp_path_factory) -> Path:
    return build_tiny_hrm(tmp_path_factory.mktemp("tiny_hrm"))


@pytest.fixture(scope="module")
def hrm_reference(tiny_hrm_dir) -> torch.Tensor:
    return reference_logits(tiny_hrm_dir)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_hrm_logits_match_transformers(tiny_hrm_dir, hrm_reference, schedule):
    """Every position's logits equal transformers' (each run of a stack's layer over its own K/V: the L stack's
    layers 4 runs each, the H stack's 2, 12 cache layers as transformers' cache slots), for a prefill and for chunks
    + decode steps over shuffled blocks, from the fused checkpoint transformers saves."""
    from safetensors import safe_open

    with safe_open(str(tiny_hrm_dir / "model.safetensors"), "pt") as f:
        assert "model.H_module.layers.1.attn.gqkv_proj.weight" in set(f.keys())
    model = load_model(str(tiny_hrm_dir))
    assert isinstance(model, HrmTextForCausalLM) and model.config.num_hidden_layers == 12
    assert [len(layer.self_attn.attns) for layer in model.model.layers] == [4, 4, 2, 2]
    assert len(model.kv_cache_specs()) == 12
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), hrm_reference) < TOL


def test_hrm_module_names_load(tiny_hrm_dir, hrm_reference, tmp_path, caplog):
    """A checkpoint in transformers' module names (the projections apart, the gate as ``self_attn.gate_proj``)
    reads to the same logits, every tensor read."""
    from safetensors.torch import save_file
    from transformers import HrmTextForCausalLM as HFHrm

    folder = tmp_path / "modules"
    shutil.copytree(tiny_hrm_dir, folder)
    state = HFHrm.from_pretrained(tiny_hrm_dir, dtype=torch.float32).state_dict()
    assert "model.L_module.layers.0.self_attn.gate_proj.bias" in state
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="specray.models.llama"):
        model = load_model(str(folder))
    assert "ignoring checkpoint tensor" not in caplog.text
    assert max_diff(prefill_logits(model, prompt()), hrm_reference) < TOL


def _hrm_layers(model):
    return model.model.layers


def _hrm_one_cache(model) -> None:
    """Every run of a layer reading and writing one K/V (a cache slot per layer, not per run)."""
    for layer in _hrm_layers(model):
        attns = layer.self_attn.attns
        layer.self_attn.attns = torch.nn.ModuleList([attns[0]] * len(attns))
    allocate_kv_cache(model, 64, 4)  # bind again: the last binding of the shared module wins


def _hrm_ungated(model) -> None:
    for layer in _hrm_layers(model):
        layer.self_attn.g_proj.bias.data.fill_(30.0)  # sigmoid 1


def _hrm_no_z_init(model) -> None:
    model.model.z_L_init.data.zero_()


def _hrm_unscaled_embedding(model) -> None:
    model.model.embedding_scale = 1.0


def _hrm_no_stack_norm(model) -> None:
    model.model.L_module.final_norm = torch.nn.Identity()


def _hrm_one_l_cycle(config) -> None:
    config.L_cycles = 1


def _hrm_one_h_cycle(config) -> None:
    config.H_cycles = 1


def _hrm_low_state_reset(monkeypatch) -> None:
    """z_L restarted from z_L_init in each H cycle, not carried over."""
    def forward(self, input_ids, meta, aux_layers=(), intermediate=None):
        z_high = self.embed_tokens(input_ids) * self.embedding_scale
        self.rotary_emb.ensure(meta.max_position + 1)
        cos, sin = self.rotary_emb(meta.positions, z_high.dtype)
        for cycle in range(self.high):
            z_low = self.z_L_init.to(z_high.dtype).expand_as(z_high)
            for step in range(self.low):
                z_low = self.L_module(z_low + z_high, cos, sin, meta, cycle * self.low + step)
            z_high = self.H_module(z_high + z_low, cos, sin, meta, cycle)
        return z_high, []
    monkeypatch.setattr(hrm_text.HrmTextModel, "forward", forward)


HRM_MUTATIONS = {"one-cache-per-layer": (None, None, _hrm_one_cache), "ungated": (None, None, _hrm_ungated),
                 "no-z-L-init": (None, None, _hrm_no_z_init),
                 "unscaled-embedding": (None, None, _hrm_unscaled_embedding),
                 "no-stack-norm": (None, None, _hrm_no_stack_norm), "one-L-cycle": (None, _hrm_one_l_cycle, None),
                 "one-H-cycle": (None, _hrm_one_h_cycle, None), "low-state-reset": (_hrm_low_state_reset, None, None)}


@pytest.mark.parametrize("mutation", sorted(HRM_MUTATIONS))
def test_hrm_each_part_shows_in_the_logits(tiny_hrm_dir, hrm_reference, monkeypatch, mutation):
    """Each distinctive part broken once (a cache per run, the output gate, z_L's learned start, the embedding scale,
    a stack's final norm, the cycle counts, z_L carried across H cycles): the logits move by more than a hundred times
    the tolerance."""
    patch, mutate_config, mutate = HRM_MUTATIONS[mutation]
    if patch is not None:
        patch(monkeypatch)
    assert max_diff(mutated_logits(tiny_hrm_dir, mutate_config, mutate), hrm_reference) > MOVED


def test_hrm_inconsistent_config_is_refused_by_name(tiny_hrm_dir):
    config = read_config(str(tiny_hrm_dir))
    config.H_cycles = 0
    with pytest.raises(ValueError, match=r"num_layers_per_stack=2, H_cycles=0, L_cycles=2: HRM-Text needs"):
        load_model(str(tiny_hrm_dir), config=config)


def test_hrm_engine_greedy_equals_transformers_with_drafts_and_graphs(tiny_hrm_dir, no_host_sync):
    """``specray.LLM``'s greedy tokens equal transformers' ``generate``; so do they with n-gram chains verified
    eagerly and n-gram trees from graphs (each run's K/V moved with the accepted path; nothing synced)."""
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_drafts_and_graphs_equal_transformers(tiny_hrm_dir, no_host_sync, 12)


# ---- ranks -----------------------------------------------------------------------------------------------------------

def test_two_ranks_match_one_rank(tiny_apertus1p5_dir, tiny_dory_dir, tiny_hrm_dir, tmp_path):
    """Two tensor-parallel ranks (each half of the heads, the MLP's width and the head's rows; Apertus 1.5's
    embedding split over the whole vocabulary; Dory's L2 norms over all heads and the whole MLP width summing their
    squares over the ranks; HRM-Text's heads, gates and every run's K/V): every rank's logits equal one rank's."""
    folders = [str(tiny_apertus1p5_dir), str(tiny_dory_dir), str(tiny_hrm_dir)]
    results = run_ranks(tmp_path, DIFF_WORKER, 2, 1, folders)
    assert all(len(r["diffs"]) == len(folders) and max(r["diffs"]) < TOL for r in results), results


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fixture", ["tiny_apertus1p5_dir", "tiny_dory_dir", "tiny_hrm_dir"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(request, fixture, schedule):
    """tests/test_device_parity.py's check for this file's fixtures (that file's list cannot reach a fixture defined
    here): fp32 logits on CUDA equal the CPU's (Apertus 1.5's -inf columns compare equal: the check subtracts them,
    so Apertus 1.5 is compared here with equal entries counting 0)."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    folder = request.getfixturevalue(fixture)
    if fixture == "tiny_apertus1p5_dir":
        cpu, gpu = load_model(str(folder)), load_model(str(folder), device="cuda")
        want, got = (chunked_logits(m, prompt(), SCHEDULES[schedule]) for m in (cpu, gpu))
        assert max_diff(got, want) < TOL
        return
    checks.assert_logits_on_the_gpu_equal_the_cpu(folder, SCHEDULES[schedule])
