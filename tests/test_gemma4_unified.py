"""Gemma 4 Unified (specray.models.gemma4_unified): its text model (``Gemma4UnifiedForCausalLM``, Gemma 4's layers
without per-layer inputs or experts) against transformers on the same random tiny weights (fp32, max abs diff < 1e-4):
sliding and full layers of different head sizes, k = v full layers with the proportional RoPE, the last two layers
reading earlier layers' K/V with double-wide MLPs, the layer scalars and the final soft cap; a config.json naming
Gemma 4's per-layer inputs and experts, which transformers' Unified model ignores and so do we; each part broken once
moves the logits; the refusals; the encoder-free multimodal release's text part; TP 2 equal to one rank; the engine's
greedy output with n-gram drafts equal to transformers' ``generate``.

Then its assistant (``Gemma4UnifiedAssistantForCausalLM``, ``gemma4_unified_assistant``: transformers' Gemma 4
assistant class renamed) as ``method="gemma4_assistant"`` over a Unified target: every draft equals transformers'
assistant's as its candidate generator runs it (with ``lm_head`` and the centroid-masked head), greedy output with it
equals plain decoding with drafts accepted, seeded sampling keeps the target's distribution, and the refusals."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from specray import LLM
from specray.models.kv_cache import SharedKVSpec
from specray.models.layers import RotaryEmbedding
from specray.models.loader import load_hf_config, load_model
from specray_test_model_checks import (DIFF_WORKER, SCHEDULES, chunked_logits, max_diff, prompt,  # model_checks.py
                                       run_ranks)

TOL = 1e-4
MOVED = 1e-2
SLIDING, FULL = "sliding_attention", "full_attention"
ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 10000.0}}
# 6 layers, sliding (heads of 16, 2 KV heads, a window of 8) and full (heads of 32, one KV head, k = v) in turn; the
# last 2 read the K/V of layers 2 and 3 and have double-wide MLPs; the full layers' RoPE rotates a quarter of each
# head's frequencies; a soft cap on the logits
UNIFIED = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
               layer_types=[SLIDING, FULL] * 3, sliding_window=8, num_kv_shared_layers=2, use_double_wide_mlp=True,
               final_logit_softcapping=30.0, max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.1,
               bos_token_id=None, rope_parameters=ROPE)


def randomize(model) -> None:
    """Norms and layer scalars start at ones: random, so a wrong one shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)


def save_tiny(path: Path, seed: int, **overrides) -> Path:
    """transformers' Gemma4UnifiedForCausalLM with random weights and conftest's tiny tokenizer (the embedding
    doubled, so that greedy decoding loops now and then and drafts are accepted in some steps)."""
    from transformers import Gemma4UnifiedForCausalLM, Gemma4UnifiedTextConfig

    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(path)
    config = Gemma4UnifiedTextConfig(**{**UNIFIED, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                                        "pad_token_id": tok.pad_token_id, **overrides})
    torch.manual_seed(seed)
    model = Gemma4UnifiedForCausalLM(config).float().eval()
    randomize(model)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(2.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():  # every row (transformers skips the KV-shared layers' rows unless hidden states are asked)
        return hf(torch.tensor([prompt()]), output_hidden_states=True).logits[0].float()


@pytest.fixture(scope="module")
def tiny_unified_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny_gemma4_unified"), seed=50)


@pytest.fixture(scope="module")
def reference(tiny_unified_dir) -> torch.Tensor:
    return hf_logits(tiny_unified_dir)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(tiny_unified_dir, reference, schedule):
    """Every position's logits equal transformers', for a prefill and for chunks + decode steps through the paged
    cache (shuffled blocks), past the sliding window; layers 4 and 5 read layers 2 and 3's caches."""
    from specray.models.gemma4_unified import Gemma4UnifiedForCausalLM

    model = load_model(str(tiny_unified_dir))
    assert type(model) is Gemma4UnifiedForCausalLM and model.model.layers[0].moe is None and not model.model.per_layer
    specs = model.kv_cache_specs()
    assert specs[4] == SharedKVSpec(source=2) and specs[5] == SharedKVSpec(source=3)
    assert (specs[1].head_dim, specs[1].num_kv_heads) == (32, 1)
    assert model.model.layers[4].mlp.down_proj.in_local == 2 * UNIFIED["intermediate_size"]
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def test_gemma4_fields_in_the_config_are_ignored_as_transformers_does(tiny_unified_dir, reference, tmp_path,
                                                                     monkeypatch):
    """A config.json that names Gemma 4's per-layer inputs and experts: transformers' Unified config keeps them as
    plain attributes and its model builds neither, so the logits stay the checkpoint's; ours too. Without
    ``text_view`` (Gemma 4's class on that config) both would be built and find no weights."""
    from specray.models import gemma4_unified

    folder = tmp_path / "named"
    shutil.copytree(tiny_unified_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=config["vocab_size"],
                  enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    (folder / "config.json").write_text(json.dumps(config))
    assert max_diff(hf_logits(folder), reference) == 0.0
    model = load_model(str(folder))
    assert model.model.layers[0].moe is None and not model.model.per_layer
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), reference) < TOL
    def per_layer_inputs_kept(config):  # the view without its first part: Gemma 4's per-layer inputs built
        return type(config)(**{**vars(config), "enable_moe_block": False})

    monkeypatch.setattr(gemma4_unified, "text_view", per_layer_inputs_kept)
    with pytest.raises(ValueError, match=r"checkpoint is missing .*per_layer"):  # the per-layer inputs' weights
        load_model(str(folder))


def _no_layer_scalar(model) -> None:
    for layer in model.model.layers:
        layer.layer_scalar.data.fill_(1.0)


def _plain_full_rope(model) -> None:  # the full layers rotated over whole heads, every frequency
    model.model.rotary[FULL] = RotaryEmbedding(32, {"rope_type": "default", "rope_theta": 10000.0}, 1024)


def _wrong_source(model) -> None:  # layer 5 reads layer 1's K/V (a full layer too, but not the last one)
    model.model.sources[5] = 1


def _no_softcap(model) -> None:
    model.final_logit_softcapping = None


def _values_as_keys(model) -> None:  # the full layers' values normed with the keys' scale (k = v, one projection)
    for layer in model.model.layers[1:4:2]:
        layer.self_attn.v_norm.weight = layer.self_attn.k_norm.weight


@pytest.mark.parametrize("ablate", [_no_layer_scalar, _plain_full_rope, _wrong_source, _no_softcap, _values_as_keys],
                         ids=["layer-scalar", "proportional-rope", "kv-source", "softcap", "k-eq-v-value-norm"])
def test_each_part_shows_in_the_logits(tiny_unified_dir, reference, ablate):
    """Without its layer scalars, its proportional RoPE, the right layer's K/V, the soft cap or the values' own
    unscaled norm the model is far from transformers': the comparison above sees each of them."""
    model = load_model(str(tiny_unified_dir))
    ablate(model)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), reference) > MOVED


@pytest.mark.parametrize("overrides, match", [
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
    (dict(num_kv_shared_layers=6), "num_kv_shared_layers=6"),
])
def test_unsupported_settings_are_named(overrides, match):
    from transformers import Gemma4UnifiedTextConfig

    from specray.models.gemma4_unified import Gemma4UnifiedForCausalLM

    with pytest.raises(ValueError, match=match):
        Gemma4UnifiedForCausalLM(Gemma4UnifiedTextConfig(**{**UNIFIED, "vocab_size": 64, **overrides}))


def test_multimodal_release_serves_its_text_model(tiny_unified_dir, reference, tmp_path):
    """The release is ``Gemma4UnifiedForConditionalGeneration`` (model_type gemma4_unified): the text model under
    ``model.language_model.`` beside the encoder-free vision and audio embedders (``model.embed_vision.``,
    ``model.embed_audio.``), a tied head. specray loads the text model, whose logits equal transformers' whole model's
    for a text-only prompt."""
    from transformers import AutoModelForCausalLM, Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration
    from safetensors.torch import load_file

    from specray.models.gemma4_unified import Gemma4UnifiedForCausalLM

    text = AutoModelForCausalLM.from_pretrained(tiny_unified_dir, dtype=torch.float32)
    config = Gemma4UnifiedConfig(text_config=text.config.to_dict(), audio_config={"audio_embed_dim": 16},
                                 vision_config={"patch_size": 2, "pooling_kernel_size": 2, "mm_embed_dim": 16,
                                                "mm_posemb_size": 8, "output_proj_dims": 64})
    full = Gemma4UnifiedForConditionalGeneration(config).float().eval()
    full.model.language_model.load_state_dict(text.model.state_dict())
    folder = tmp_path / "mm"
    full.save_pretrained(folder)
    for file in tiny_unified_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, folder / file.name)
    names = load_file(str(folder / "model.safetensors"))
    assert any(n.startswith("model.embed_vision.") for n in names) and any(n.startswith("model.embed_audio.")
                                                                           for n in names)
    ours = load_model(str(folder), pack=False)
    assert type(ours) is Gemma4UnifiedForCausalLM and ours.tie_word_embeddings
    assert load_hf_config(str(folder)).model_type == "gemma4_unified_text"
    with torch.no_grad():
        ref = full(input_ids=torch.tensor([prompt()]), output_hidden_states=True).logits[0].float()
    assert max_diff(ref, reference) < TOL
    assert max_diff(chunked_logits(ours, prompt(), SCHEDULES["chunked+decode"]), ref) < TOL


def test_tensor_parallel_ranks_match_one_rank(tiny_unified_dir, tmp_path):
    """TP 2: each rank two of the 4 query heads, one of the sliding layers' 2 KV heads and the full layers' one KV
    head replicated, the shared layers reading their sources' shards: every rank's logits equal one rank's."""
    for result in run_ranks(tmp_path, DIFF_WORKER, 2, 1, [str(tiny_unified_dir)]):
        assert result["diffs"][0] < TOL, result


def test_engine_greedy_with_ngram_drafts_equals_transformers(tiny_unified_dir):
    """``specray.LLM``'s greedy tokens with n-gram drafts verified (some accepted) equal transformers' ``generate``."""
    runs = sys.modules["specray_test_engine_runs"]
    runs.assert_ngram_greedy_equals_transformers(tiny_unified_dir)


# ---- the assistant ---------------------------------------------------------------------------------------------------

K = 3  # drafts per step
# the assistant: 2 layers (sliding, then full) of its own width, with the target's head sizes (it reads their K/V)
ASSISTANT = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                 attention_k_eq_v=True, layer_types=[SLIDING, FULL], sliding_window=8, use_double_wide_mlp=False,
                 max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.2, rope_parameters=ROPE)
ORDERED = dict(use_ordered_embeddings=True, num_centroids=8, centroid_intermediate_top_k=2)


def save_assistant(path: Path, vocab_size: int, seed: int = 7, accepting_from: Path | None = None,
                   text: dict | None = None, **overrides) -> Path:
    """A random Gemma 4 Unified assistant in transformers' layout (``text``: its text config's changes from
    :data:`ASSISTANT`; ``overrides``: ORDERED's keys); ``accepting_from``
    (the target's folder): one that drafts "the token just read" again, which the target's runs of repeated tokens
    accept (its ``pre_projection`` copies that token's embedding into the stream, its layers add little, its head is
    the target's embedding)."""
    from transformers import Gemma4UnifiedAssistantConfig, Gemma4UnifiedAssistantForCausalLM

    backbone = UNIFIED["hidden_size"]
    text = {**ASSISTANT, "vocab_size": vocab_size, **({"hidden_size": backbone} if accepting_from else {}),
            **(text or {})}
    config = Gemma4UnifiedAssistantConfig(text_config={"model_type": "gemma4_unified_text", **text},
                                          backbone_hidden_size=backbone, **overrides)
    assert config.text_config.num_kv_shared_layers == 2
    torch.manual_seed(seed)
    model = Gemma4UnifiedAssistantForCausalLM(config).float().eval()
    randomize(model)
    with torch.no_grad():
        if config.use_ordered_embeddings:
            model.masked_embedding.token_ordering.copy_(torch.randperm(vocab_size))
        if accepting_from is not None:
            from safetensors.torch import load_file

            embedding = load_file(str(accepting_from / "model.safetensors"))["model.embed_tokens.weight"]
            model.lm_head.weight.copy_(embedding)  # tied: the assistant's own embedding too
            model.pre_projection.weight.zero_()
            model.pre_projection.weight[:, :backbone].copy_(torch.eye(backbone))
            for layer in model.model.layers:
                layer.post_attention_layernorm.weight.fill_(0.05)
                layer.post_feedforward_layernorm.weight.fill_(0.05)
                layer.layer_scalar.fill_(1.0)
            model.model.norm.weight.fill_(1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A target with a narrower sliding window (4) than the prompts, so the assistant's sliding layer sees part."""
    return save_tiny(tmp_path_factory.mktemp("g4u_target"), seed=51, sliding_window=4)


@pytest.fixture(scope="module")
def assistants(target_dir, tmp_path_factory) -> dict[str, Path]:
    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    return {"ordered": save_assistant(tmp_path_factory.mktemp("g4u_ordered"), vocab, seed=8, **ORDERED),
            "accepting": save_assistant(tmp_path_factory.mktemp("g4u_accepting"), vocab, accepting_from=target_dir)}


def spec(folder: Path, k: int = K, **extra) -> dict:
    return {"method": "gemma4_assistant", "model": str(folder), "num_speculative_tokens": k, "adaptive": False,
            **extra}


@pytest.mark.parametrize("kind", ["ordered", "accepting"])
def test_every_draft_equals_transformers_candidate_generator(target_dir, assistants, kind):
    """Each step's drafts (after a prefill, and after every verification, drafts accepted or not) equal transformers'
    Unified assistant's over the committed sequence, run as its ``SinglePositionMultiTokenCandidateGenerator`` runs
    it right after a prefill of that sequence (tests/test_gemma4_assistant.py's ``reference_drafts``, which says why
    not later)."""
    from transformers import Gemma4UnifiedAssistantForCausalLM

    from tests.test_gemma4_assistant import check_drafts_equal_transformers

    check_drafts_equal_transformers(target_dir, assistants[kind], Gemma4UnifiedAssistantForCausalLM,
                                    kind == "accepting")


def test_greedy_batch_equals_plain_decoding(target_dir, assistants):
    """A batch of 8 prompts with per-request draft caps and max_tokens edges: greedy output with the accepting
    assistant (the target's steps eager, and from graphs) equals plain decoding token for token, some drafts kept and
    some not, every KV block free again."""
    runs = sys.modules["specray_test_engine_runs"]
    mixed = [runs.greedy(), runs.greedy(num_speculative_tokens=0), runs.greedy(1), runs.greedy(2), runs.greedy(3),
             runs.greedy(num_speculative_tokens=1), runs.greedy(logprobs=2), runs.greedy(7)]
    plain = runs.token_ids(LLM(str(target_dir), max_model_len=128).generate(runs.PROMPTS, mixed, use_tqdm=False))
    for engine in ({}, {"enforce_eager": False}):  # the target's steps eager, and from graphs (on CPU: their inputs)
        llm = LLM(str(target_dir), max_model_len=128, speculative_config=spec(assistants["accepting"]), **engine)
        free = llm.engine.scheduler.block_manager.num_free_blocks
        assert runs.token_ids(llm.generate(runs.PROMPTS, mixed, use_tqdm=False)) == plain, engine
        stats = llm.spec_stats
        assert 0 < stats.accepted_tokens < stats.draft_tokens, (engine, stats)
        assert llm.engine.scheduler.block_manager.num_free_blocks == free


def test_sampled_output_keeps_the_target_distribution(target_dir, assistants):
    """Seeded sampled requests whose chains the accepting assistant draws from its q: the first three tokens' joint
    frequencies fit the target's (chi-square; a p-value under the threshold is decided by a second test on fresh
    seeds), and the same test fails against the target's distribution at temperature 1."""
    from tests.test_gemma4_assistant import check_sampled_distribution_kept

    check_sampled_distribution_kept(target_dir, assistants["accepting"])


@pytest.mark.parametrize("case, match", [
    ("llama", "the target's model_type is 'llama'"),
    ("heads", r"\(head_dim, num_key_value_heads\)=\(16, 1\) but the target's layer 2"),
    ("mtp", r"model_type 'gemma4_unified_assistant'\): use method='gemma4_assistant' with it"),
])
def test_refusals_name_the_field(target_dir, assistants, make_tiny_model, tmp_path, case, match):
    """A non-Gemma-4 target, a Unified assistant for another model (other KV heads), and the Unified assistant given
    to method='mtp': each a ValueError naming the field, before any worker starts."""
    model, config = str(target_dir), spec(assistants["accepting"])
    if case == "llama":
        model = str(make_tiny_model(tmp_path / "llama", "llama"))
    elif case == "heads":
        vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
        config = spec(save_assistant(tmp_path / "heads", vocab, text={"num_key_value_heads": 1}))
    elif case == "mtp":
        config = {**config, "method": "mtp"}
    with pytest.raises(ValueError, match=match):
        LLM(model, max_model_len=128, speculative_config=config)

