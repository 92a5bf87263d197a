"""Cohere Compass's text model (``CohereCompassForCausalLM``; the text part of
``CohereCompassForConditionalGeneration``, its vision tower not read): Command R7B's parallel layer (one bias-free
LayerNorm before attention and MLP) with RoPE on the two halves of each head, each kind of layer rotated by its own
``rope_parameters[kind]`` or not at all (null), multimodal RoPE's tables (equal to plain RoPE for text: every section
reads the same position), biased attention where ``attention_bias``, logits scaled by ``logit_scale`` (none where
null). Against transformers on the same random tiny weights (fp32, max abs diff < 1e-4) over a prefill and over chunks
then single steps, for two tiny models built here (transformers' text config and causal-LM class, norms and biases
drawn away from their init): ``compass`` (sliding layers rotated, the global one NoPE, as Command R7B; biases; scale
0.25; tied head) and ``rotated`` (both kinds rotated, the global one by YaRN over another base; no biases; a null
scale; an untied head), and a multimodal release (transformers' whole model with a tiny vision tower, saved as it
saves it: the text under ``model.language_model.``) whose text model is served. The engine's greedy tokens with n-gram
drafts equal transformers' ``generate`` (the causal LM's, and the whole multimodal model's); two tensor-parallel ranks
and two pipeline stages equal one rank. Each distinctive part broken once moves the logits; configs transformers
cannot run are refused by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specray.models.cohere_compass import CohereCompassAttention, CohereCompassForCausalLM
from specray.models.layers import RotaryEmbedding
from specray.models.loader import load_hf_config, load_model, read_config
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, assert_ranks_match_one_rank, chunked_logits, max_diff, mutated_logits,
    prompt, reference_logits)

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
SLIDING, FULL = "sliding_attention", "full_attention"
# multimodal RoPE's sections (t, h, w) of the 8 frequencies of a 16-wide head (hidden 64 / 4 heads)
PLAIN = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
YARN = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mrope_section": [2, 3, 3]}
# 4 layers: three sliding over 8 tokens (a 40-token prompt reaches past the window), one global between them
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, layer_norm_eps=1e-5, initializer_range=0.1, sliding_window=8,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING])
MODELS = {"compass": dict(rope_parameters={SLIDING: PLAIN, FULL: None}, logit_scale=0.25, attention_bias=True,
                          tie_word_embeddings=True),
          "rotated": dict(rope_parameters={SLIDING: PLAIN, FULL: YARN}, logit_scale=None, attention_bias=False,
                          tie_word_embeddings=False)}
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              deepstack_visual_indexes=[0])


def _visible(model) -> None:
    """Norm weights (ones at init) and biases (zeros) drawn at random, so that a wrong norm or bias shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)


def build_tiny_compass(path: Path, kind: str, seed: int) -> Path:
    """transformers' CohereCompassForCausalLM at :data:`TEXT`'s sizes with ``kind``'s settings, random weights made
    visible, saved as transformers saves it with conftest's tiny tokenizer."""
    from transformers import CohereCompassForCausalLM as HFCompass, CohereCompassTextConfig

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path)
    config = CohereCompassTextConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                     bos_token_id=None, **TEXT, **MODELS[kind])
    torch.manual_seed(seed)
    model = HFCompass(config).float().eval()
    _visible(model)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def compass_dirs(tmp_path_factory) -> dict[str, Path]:
    return {kind: build_tiny_compass(tmp_path_factory.mktemp(f"tiny_cohere_compass_{kind}"), kind, seed)
            for seed, kind in enumerate(sorted(MODELS), start=71)}


@pytest.fixture(scope="session")
def compass_vision(tmp_path_factory, compass_dirs) -> tuple[Path, object]:
    """(folder, transformers' whole model) of a multimodal release: ``compass``'s text config under a tiny vision
    tower (DeepStack merger included), its own random weights, the whole config untying the head (the text config's
    own flag ties it), saved as transformers saves it: model.language_model.*, model.visual.*, lm_head.*."""
    from transformers import AutoConfig, CohereCompassConfig, CohereCompassForConditionalGeneration

    from tests.conftest import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny_cohere_compass_vision")
    build_tiny_tokenizer(path)
    text = AutoConfig.from_pretrained(compass_dirs["compass"]).to_dict()
    assert text["tie_word_embeddings"] is True
    torch.manual_seed(79)
    full = CohereCompassForConditionalGeneration(CohereCompassConfig(text_config=text, vision_config=VISION,
                                                                     tie_word_embeddings=False)).float().eval()
    _visible(full.model.language_model)
    full.save_pretrained(path)
    return path, full


def _reference(kind: str, compass_dirs, compass_vision) -> torch.Tensor:
    if kind == "vision":
        with torch.no_grad():
            return compass_vision[1](input_ids=torch.tensor([prompt()])).logits[0].float()
    return reference_logits(compass_dirs[kind])


def _folder(kind: str, compass_dirs, compass_vision) -> Path:
    return compass_vision[0] if kind == "vision" else compass_dirs[kind]


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(compass_dirs, kind, schedule):
    """Our logits equal transformers' over a prefill, and over chunks (alone, then short queries over a context) and
    single steps through a paged cache in shuffled blocks; each kind of layer rotated as its rope_parameters say."""
    model = load_model(str(compass_dirs[kind]))
    assert type(model) is CohereCompassForCausalLM
    rotated = [layer.self_attn.use_rope for layer in model.model.layers]
    assert rotated == [True, True, MODELS[kind]["rope_parameters"][FULL] is not None, True]
    # RoPE on halves, no q/k norms (Command R+'s are not read)
    assert all(type(layer.self_attn) is CohereCompassAttention and not layer.self_attn.interleaved_rope
               and layer.self_attn.q_norm is None for layer in model.model.layers)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference_logits(compass_dirs[kind])) < TOL


def test_multimodal_release_serves_its_text_model(compass_vision):
    """A ``CohereCompassForConditionalGeneration`` release: its text model loads from under ``model.language_model.``
    (the vision tower and its mergers left unread), the head untied as the whole config says, and its logits on a
    text-only prompt equal those of transformers' whole multimodal model (its 3-D positions: three equal rows for
    text), over a prefill and over chunks then single steps."""
    from safetensors.torch import load_file

    folder, full = compass_vision
    names = load_file(str(folder / "model.safetensors"))
    assert any(n.startswith("model.visual.deepstack_merger_list.") for n in names) and "lm_head.weight" in names
    assert load_hf_config(str(folder)).model_type == "cohere_compass_text"
    model = load_model(str(folder))
    assert type(model) is CohereCompassForCausalLM and not model.tie_word_embeddings
    with torch.no_grad():
        reference = full(input_ids=torch.tensor([prompt()])).logits[0].float()
    for schedule in SCHEDULES.values():
        assert max_diff(chunked_logits(model, prompt(), schedule), reference) < TOL


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_multimodal_rope_is_plain_rope_for_text(compass_dirs, kind):
    """transformers' rotary embedding (Gemma 3's table per kind of layer, recomposed from Qwen3-VL's interleaved t/h/w
    sections) given one position per token in all three rows equals our plain table of that kind, cos and sin, on
    both halves of the head; rows that differ (an image's) give other tables, so the sections are real and only a
    text-only input makes them vanish."""
    from transformers import AutoConfig
    from transformers.models.cohere_compass.modeling_cohere_compass import CohereCompassRotaryEmbedding

    from specray.models.cohere_compass import kind_ropes

    config = AutoConfig.from_pretrained(compass_dirs[kind])
    theirs = CohereCompassRotaryEmbedding(config)
    ropes = {k: rope for k, rope in kind_ropes(config).items() if rope is not None}
    assert sorted(ropes) == sorted(theirs.rope_type)
    positions = torch.arange(600)
    x = torch.zeros(1, dtype=torch.float32)
    for layer_type, rope in ropes.items():
        ours = RotaryEmbedding(config.head_dim, rope, config.max_position_embeddings)
        ours.ensure(len(positions))
        cos, sin = ours(positions, torch.float32)  # [P, 1, D/2]
        their_cos, their_sin = theirs(x, positions.view(1, 1, -1).expand(3, 1, -1), layer_type)  # [1, P, D]
        for mine, them in ((cos, their_cos), (sin, their_sin)):
            assert max_diff(torch.cat((mine[:, 0], mine[:, 0]), dim=-1), them[0]) < 1e-6
        apart = torch.stack((positions, positions // 2, positions // 3)).view(3, 1, -1)  # t, h, w ids that differ
        assert max_diff(torch.cat((cos[:, 0], cos[:, 0]), dim=-1), theirs(x, apart, layer_type)[0][0]) > 0.1


@pytest.mark.parametrize("kind", ["compass", "vision"])
def test_engine_greedy_with_ngram_drafts_equals_transformers(compass_dirs, compass_vision, kind):
    """The engine's greedy tokens with n-gram drafts (some accepted) equal transformers' ``generate``: the causal LM's,
    and the whole multimodal model's for the release (its 3-D text positions through generation); a prompt carrying
    an image is served (tests/test_cohere_compass_images.py)."""
    from transformers import CohereCompassForConditionalGeneration

    runs = sys.modules["specray_test_engine_runs"]
    folder = _folder(kind, compass_dirs, compass_vision)
    runs.assert_ngram_greedy_equals_transformers(
        folder, CohereCompassForConditionalGeneration if kind == "vision" else None)


@pytest.mark.parametrize("stages", [1, 2])
def test_two_ranks_match_one_rank(compass_dirs, compass_vision, tmp_path, stages):
    """Two tensor-parallel ranks (stages 1: the heads and their biases split, o_proj's bias added once) or two
    pipeline stages (2: the residual stream handed on, each stage's kinds of layer rotated by their own tables):
    the last rank's logits equal one rank's, for both models and the multimodal release's text."""
    folders = [str(compass_dirs[k]) for k in sorted(MODELS)] + [str(compass_vision[0])]
    assert_ranks_match_one_rank(tmp_path, folders, stages, TOL)


# ---- each distinctive part, broken on purpose ------------------------------------------------------------------------

def _interleaved(model) -> None:
    """Cohere2's RoPE on interleaved pairs instead of the two halves."""
    for layer in model.model.layers:
        layer.self_attn.interleaved_rope = True


def _full_as_sliding(config) -> None:
    """The global kind rotated by the sliding kind's settings: where it is NoPE, rotated (Command R's every layer);
    where it has its own (YaRN, another base), one table for the stack."""
    config.rope_parameters[FULL] = dict(config.rope_parameters[SLIDING])


def _sliding_unrotated(config) -> None:
    config.rope_parameters[SLIDING] = None


def _unscaled(model) -> None:
    model.logits_scaling = 1.0


def _cohere2_default_scale(model) -> None:
    """A null logit_scale read as Cohere2's default (0.0625) instead of no scaling."""
    model.logits_scaling = 1.0 / 0.0625


def _no_window(config) -> None:
    config.sliding_window = 1024


def _head_tied_by_text_config(config) -> None:
    """The multimodal release's head tied as its text config says, not as the whole config does."""
    config.tie_word_embeddings = True


def _biases_dropped(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.qkv_proj.bias.data.zero_()


# name -> (the model it breaks, mutate_config, mutate)
MUTATIONS = {"rope-interleaved": ("compass", None, _interleaved),
             "global-layers-rotated": ("compass", _full_as_sliding, None),
             "sliding-layers-unrotated": ("compass", _sliding_unrotated, None),
             "one-rope-table-for-both-kinds": ("rotated", _full_as_sliding, None),
             "logits-unscaled": ("compass", None, _unscaled),
             "null-scale-read-as-cohere2-default": ("rotated", None, _cohere2_default_scale),
             "no-sliding-window": ("compass", _no_window, None),
             "qkv-biases-dropped": ("compass", None, _biases_dropped),
             "head-tied-by-text-config": ("vision", _head_tied_by_text_config, None)}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_logits(compass_dirs, compass_vision, mutation):
    """Each distinctive part broken once (RoPE on halves, which kinds rotate, each kind's own table, the logit scale
    and its null default, the sliding window, the attention biases, the multimodal release's untied head): the
    logits move by more than a hundred times the tolerance."""
    kind, mutate_config, mutate = MUTATIONS[mutation]
    folder = _folder(kind, compass_dirs, compass_vision)  # (unbroken, its logits equal transformers': above)
    moved = max_diff(mutated_logits(folder, mutate_config, mutate), _reference(kind, compass_dirs, compass_vision))
    assert moved > MOVED


# ---- what is refused -------------------------------------------------------------------------------------------------

def _flat_rope(config) -> None:
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}


def _missing_kind(config) -> None:
    config.rope_parameters = {SLIDING: dict(PLAIN)}


def _chunked_kind(config) -> None:
    config.layer_types = [SLIDING, SLIDING, "chunked_attention", SLIDING]
    config.rope_parameters = {SLIDING: dict(PLAIN), "chunked_attention": None}


def _partial(config) -> None:
    config.rope_parameters[SLIDING] = {**PLAIN, "partial_rotary_factor": 0.5}


def _zero_scale(config) -> None:
    config.logit_scale = 0.0


REFUSALS = {"flat-rope-parameters": (_flat_rope, r"has no entry for layer type\(s\) \['sliding_attention', "
                                                 r"'full_attention'\]"),
            "a-kind-without-rope-parameters": (_missing_kind, r"has no entry for layer type\(s\) \['full_attention'\]"),
            "a-kind-transformers-does-not-mask": (_chunked_kind, r"layer_types=.*must name one of"),
            "partial-rope": (_partial, r"rope_parameters\['sliding_attention'\] partial_rotary_factor=0.5 is not "
                                       r"supported.*remove partial_rotary_factor"),
            "zero-logit-scale": (_zero_scale, r"logit_scale=0 would make every logit 0")}


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_configs_transformers_cannot_run_are_refused_by_name(compass_dirs, refusal):
    """A config transformers' class fails on (rope_parameters not keyed by every kind of layer, a kind its masks do
    not know: a KeyError there), one whose RoPE it builds over the whole head whatever the factor, and a zero logit
    scale: a ValueError naming the field and the fix."""
    mutate, message = REFUSALS[refusal]
    config = read_config(str(compass_dirs["compass"]))
    mutate(config)
    with pytest.raises(ValueError, match=message):
        load_model(str(compass_dirs["compass"]), config=config)


# ---- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_on_the_gpu_equal_the_cpu(compass_dirs, kind, schedule):
    """tests/test_device_parity.py's check for this file's models (that file's list cannot reach a fixture defined
    here): fp32 logits on CUDA equal the CPU's."""
    checks = sys.modules["specray_test_model_checks"]  # tests/model_checks.py
    checks.assert_logits_on_the_gpu_equal_the_cpu(compass_dirs[kind], SCHEDULES[schedule])
