"""Qwen2.5-Omni's thinker (``specray.models.qwen2_5_omni``): against transformers'
``Qwen2_5OmniThinkerForConditionalGeneration`` on the same random tiny fp32 weights. Its text model (a Qwen2 with
multimodal RoPE) gives transformers' logits over a text prompt, from the thinker's checkpoint and from the whole
release's (``Qwen2_5OmniModel`` / ``Qwen2_5OmniForConditionalGeneration``: ``thinker.``-named tensors beside a
talker's, the thinker's config under ``thinker_config``). Audios: our expanded prompt (``<|AUDIO|>`` once per
embedding) and log-mel features equal transformers' ``Qwen2_5OmniProcessor``'s for one audio, two of different
lengths, and lengths at the extractor's edges (ours padded less far, frame for frame the same); each audio's
embeddings equal ``get_audio_features`` (windows cut short at the audio's end); the text model fed them gives
transformers' logits over a prompt of two audios (and of an image and an audio, with TMRoPE positions equal to
``get_rope_index``) in one prefill and in chunks splitting the spans, then decode steps. Two tensor-parallel ranks
equal one; the engine's greedy tokens with audios (and an image), n-gram drafts, eager and graphs, equal
transformers' ``generate``, from the thinker and from the whole release; ``LLM.chat`` takes an ``input_audio`` part.
Each distinctive part broken once moves the logits; what is not served is refused by name (audio inside videos among
them; videos themselves: tests/test_omni_video.py). The tiny releases are built here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models import qwen2_5_omni as qo
from specray.models.layers import mrope_axes
from specray.models.loader import load_image_encoder, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import (assert_ranks_equal_one_rank, encoded, image_logits,  # tests/image_checks.py
                                       random_images, rope_table)
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
RATE = 16000
SPECIAL = {"vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>", "image_token": "<|IMAGE|>",
           "video_token": "<|VIDEO|>", "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
           "audio_token": "<|AUDIO|>"}
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
# the audio tower: windows of 20 feature frames (10 after the convolutions), two layers of 2 heads
AUDIO = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=48, d_model=32,
             n_window=10, output_dim=64, max_source_positions=1500)
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, window_size=56,
              fullatt_block_indexes=[1])
# two audios: 1.3 s (130 frames: six whole windows and one of 10; 32 tokens) and 2.3 s (230 frames: eleven and one of
# 10; 57 tokens); transformers' processor pads each to the feature extractor's 5 s (padding="max_length")
SECONDS = [1.3, 2.3]
TOKENS = [32, 57]
CHUNK_SECONDS = 5
AUDIO_PART = "<|audio_bos|><|AUDIO|><|audio_eos|>"
IMAGE_PART = "<|vision_bos|><|IMAGE|><|vision_eos|>"
PROMPT = "Hello world!" + AUDIO_PART + " and then " + AUDIO_PART + " The quick brown fox jumps."
MIXED = "Hello world!" + IMAGE_PART + " and then " + AUDIO_PART + " The quick brown fox jumps."
GENERATED = [17, 42, 99, 75, 230, 61, 28, 150]  # tokens past the prompt (decode steps)


def waves() -> list[np.ndarray]:
    """Two synthetic mono waveforms at 16 kHz (tones and noise, seed 0) of :data:`SECONDS`."""
    rng = np.random.default_rng(0)
    out = []
    for i, seconds in enumerate(SECONDS):
        t = np.arange(int(seconds * RATE)) / RATE
        tone = 0.3 * np.sin(2 * np.pi * (220 + 110 * i) * t) + 0.1 * np.sin(2 * np.pi * 1250 * t * (1 + t))
        out.append((tone + 0.05 * rng.standard_normal(t.shape)).astype(np.float32))
    return out


def omni_tokenizer(path: Path, special: dict[str, str], template: str) -> tuple[object, dict[str, int]]:
    """conftest's tiny tokenizer with an Omni release's ``special`` tokens (by their processor's names) and chat
    template, saved in ``path`` and read back; (the tokenizer, the special tokens' ids by name)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    base = build_tiny_tokenizer(path, extra_special_tokens=tuple(special.values()))
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", extra_special_tokens=special)
    tok.chat_template = template
    tok.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    return tok, {name: tok.convert_tokens_to_ids(token) for name, token in special.items()}


@torch.no_grad()
def spread_omni_weights(model) -> None:
    """The towers' weights, the norms and the biases drawn away from their init, so that each part shows."""
    for n, p in model.named_parameters():
        if "visual." in n or "audio_tower." in n:
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.normal_(1.0 if "norm" in n and "weight" in n else 0.0, 0.2)
        elif n.endswith("norm.weight"):
            p.uniform_(0.5, 1.5)
        elif n.endswith("bias"):
            p.normal_(0.0, 0.1)


def build_release(path: Path, seed: int = 0) -> tuple[Path, object]:
    """transformers' thinker at :data:`TEXT` / :data:`AUDIO` / :data:`VISION` sizes with random weights (norms,
    biases and the towers' weights drawn away from their init so that each shows), saved with its processor's parts
    (conftest's tiny tokenizer with Omni's special tokens; one preprocessor_config.json holding the Whisper feature
    extractor's and the Qwen2-VL image processor's settings, as the release's does); (folder, the model)."""
    from transformers import (Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration,
                              Qwen2VLImageProcessorPil, WhisperFeatureExtractor)

    tok, ids = omni_tokenizer(path, SPECIAL, CHAT_TEMPLATE)
    config = Qwen2_5OmniThinkerConfig(
        text_config={**TEXT, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id}, audio_config=AUDIO,
        vision_config=VISION, image_token_index=ids["image_token"], video_token_index=ids["video_token"],
        audio_token_index=ids["audio_token"], audio_start_token_id=ids["audio_bos_token"],
        audio_end_token_id=ids["audio_eos_token"], vision_start_token_id=ids["vision_bos_token"],
        vision_end_token_id=ids["vision_eos_token"])
    torch.manual_seed(seed)
    model = Qwen2_5OmniThinkerForConditionalGeneration(config).float().eval()
    spread_omni_weights(model)
    model.save_pretrained(path)
    settings = {**WhisperFeatureExtractor(feature_size=128, chunk_length=CHUNK_SECONDS).to_dict(),
                **Qwen2VLImageProcessorPil().to_dict(), "return_attention_mask": True}
    (path / "preprocessor_config.json").write_text(json.dumps(settings))
    return path, model


# a ChatML template of the release's shape: an audio part renders the audio placeholder between its marks
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
                 "{% else %}{% for p in m.content %}{% if p.type == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
                 "{% elif p.type == 'image' %}<|vision_bos|><|IMAGE|><|vision_eos|>{% else %}{{ p.text }}{% endif %}"
                 "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def build_whole_release(thinker_folder: Path, thinker, path: Path, arch: str) -> Path:
    """The whole release's layout from the thinker: its tensors under ``thinker.`` (as the release names them: text
    under ``thinker.model.``), beside a talker tensor that must not be read, its config under ``thinker_config``."""
    import shutil

    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    for file in thinker_folder.iterdir():
        if file.name not in ("config.json", "model.safetensors"):
            shutil.copy(file, path / file.name)
    theirs = json.loads((thinker_folder / "config.json").read_text())
    config = {"architectures": [arch], "model_type": "qwen2_5_omni",
              "enable_audio_output": False, "thinker_config": {k: v for k, v in theirs.items() if k != "architectures"}}
    (path / "config.json").write_text(json.dumps(config))
    tensors = {"thinker." + n.replace("model.language_model.", "model.").replace("model.audio_tower.", "audio_tower.")
               .replace("model.visual.", "visual."): t.contiguous() for n, t in thinker.state_dict().items()}
    tensors["talker.model.layers.0.mlp.up_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, object]:
    return build_release(tmp_path_factory.mktemp("qwen2_5_omni"))


def hf_processor(folder: Path, name: str = "Qwen2_5OmniProcessor"):
    """transformers' Omni processor ``name`` over the folder's feature extractor, image processor and tokenizer (its
    video processor needs torchvision, which is not installed: the class check of the absent one is skipped)."""
    import transformers
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class",
                      lambda self, name, arg: None if arg is None else check(self, name, arg))
        return getattr(transformers, name)(image_processor=AutoImageProcessor.from_pretrained(str(folder)),
                                           feature_extractor=AutoFeatureExtractor.from_pretrained(str(folder)),
                                           tokenizer=AutoTokenizer.from_pretrained(str(folder)))


def expand(folder: Path, text: str, images=(), audios=(), ours=qo.Qwen2_5OmniProcessor):
    """(our processor, the expanded prompt's ids, its MultiModalInputs) for ``text`` with ``images`` and ``audios``."""
    from transformers import AutoTokenizer

    processor = ours.from_pretrained(folder, read_config(str(folder)))
    ids = AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]
    return (processor, *expand_prompt(ids, list(images), processor, audios=list(audios)))


def hf_inputs(folder: Path, text: str, images=(), audios=()) -> dict:
    return hf_processor(folder)(text=[text], images=list(images) or None, audio=list(audios) or None,
                                return_tensors="pt")


@torch.no_grad()
def reference(hf, inputs: dict, generated: list[int] = GENERATED) -> torch.Tensor:
    """transformers' thinker's logits [L, V] over the processor's prompt and ``generated`` after it."""
    kwargs = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    ids = torch.cat((inputs["input_ids"], torch.tensor([generated], dtype=torch.long)), dim=1)
    return hf(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits[0]


# ---- the text model --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["thinker", "Qwen2_5OmniModel", "Qwen2_5OmniForConditionalGeneration"])
def test_text_model_equals_transformers(release, tmp_path, layout):
    """The text model, as the engine loads it from the thinker's checkpoint or from the whole release's (its text
    config under thinker_config, its tensors under thinker.), gives the thinker's logits over a text prompt: a
    prefill, and chunks then decode steps (no multimodal positions: plain RoPE, which the thinker's three equal
    position ids give)."""
    from specray_test_model_checks import SCHEDULES as TEXT_SCHEDULES, chunked_logits, prompt

    folder, hf = release
    if layout != "thinker":  # the whole release, as its config.json names it or as transformers does
        folder = build_whole_release(folder, hf, tmp_path / "whole", layout)
    ids = [t if t < 3 or t > 12 else 20 for t in prompt()]  # (no special tokens)
    model = load_model(str(folder))
    assert model.model.rotary_emb.mrope is not None
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    for sizes in TEXT_SCHEDULES.values():
        assert max_diff(chunked_logits(model, ids, sizes), want) < TOL
    if layout != "thinker":  # its encoders read the thinker.-named tensors
        _, pids, mm = expand(folder, PROMPT, audios=waves())
        theirs = hf_inputs(folder, PROMPT, audios=waves())
        ours = image_logits(model, pids + GENERATED, mm, encoded(folder, mm), None)
        assert max_diff(ours, reference(hf, theirs)) < TOL


# ---- the processor ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["one audio", "two audios", "image and audio"])
def test_processor_equals_transformers(release, case):
    """Our expanded prompt (``<|AUDIO|>`` once per embedding the tower gives) and each audio's log-mel features (the
    extractor's padded features cut to its own frames) equal transformers' processor's; an image's expansion and
    pixels as Qwen2.5-VL's; TMRoPE positions equal transformers' ``get_rope_index`` over the prompt and tokens past it
    (an audio's positions consecutive: none needed without an image)."""
    folder, hf = release
    text, images, audios = {"one audio": (PROMPT.replace(AUDIO_PART, "", 1), [], waves()[1:]),
                            "two audios": (PROMPT, [], waves()),
                            "image and audio": (MIXED, random_images([(90, 140)]), waves()[:1])}[case]
    processor, ids, mm = expand(folder, text, images, audios)
    want = hf_inputs(folder, text, images, audios)
    assert ids == want["input_ids"][0].tolist()
    spoken = [item for item in mm.items if item.modality == "audio"]
    mask = want["feature_attention_mask"]
    assert [item.length for item in spoken] == [qo.audio_embeddings(int(n)) for n in mask.sum(-1)]
    assert [item.length for item in spoken] == TOKENS[-len(audios):] if case != "image and audio" else [TOKENS[0]]
    for item, features, frames in zip(spoken, want["input_features"], mask.sum(-1)):
        assert np.array_equal(item.data[qo.FEATURES], features[:, :int(frames)].numpy())
    full = torch.tensor([ids + GENERATED])
    positions, delta = hf.model.get_rope_index(
        full, image_grid_thw=want.get("image_grid_thw"), attention_mask=torch.ones_like(full),
        audio_seqlens=mask.sum(-1))
    if images:
        assert np.array_equal(mm.items[0].data["pixel_values"], want["pixel_values"].numpy())
        assert torch.equal(rope_table(mm, full.shape[1]), positions[:, 0]) and mm.rope_delta == int(delta) < 0
    else:
        assert mm.rope_positions is None and torch.equal(positions[:, 0], torch.arange(full.shape[1]).expand(3, -1))


def test_features_of_any_length_equal_transformers(release):
    """The features of audios whose lengths are no multiple of a hop, of the longest the extractor takes (no room
    left to pad) and of the shortest giving one embedding equal transformers' processor's (which pads each to the
    extractor's whole chunk), frame for frame, up to the last bit."""
    folder, _ = release
    rng = np.random.default_rng(1)
    lengths = [CHUNK_SECONDS * RATE, CHUNK_SECONDS * RATE - 50, 20851, 333]
    audios = [(0.2 * rng.standard_normal(n)).astype(np.float32) for n in lengths]
    text = "Hi" + AUDIO_PART * len(audios)
    _, ids, mm = expand(folder, text, audios=audios)
    want = hf_inputs(folder, text, audios=audios)
    assert ids == want["input_ids"][0].tolist() and mm.items[-1].length == 1
    for item, features, frames in zip(mm.items, want["input_features"], want["feature_attention_mask"].sum(-1)):
        # bit for bit on an AVX2 VM; on an AVX-512 one the STFT of the shorter padding rounds a few frames of the
        # shortest audio one ulp apart
        assert np.allclose(item.data[qo.FEATURES], features[:, :int(frames)].numpy(), rtol=0, atol=1e-6)


# ---- the encoder and the whole model ---------------------------------------------------------------------------------

def test_encoder_equals_transformers_audio_features(release):
    """Each audio's embeddings [tokens, text hidden] equal transformers' ``get_audio_features`` for it (its padded
    features and mask), and an image's equal ``get_image_features`` (Qwen2.5-VL's tower over Omni's q, k, v)."""
    folder, hf = release
    _, _, mm = expand(folder, MIXED.replace(IMAGE_PART, AUDIO_PART), [], waves())
    want = hf_inputs(folder, PROMPT, audios=waves())
    for i, (item, ours) in enumerate(zip(mm.items, encoded(folder, mm))):
        with torch.no_grad():
            theirs = hf.model.get_audio_features(want["input_features"][i:i + 1],
                                                 want["feature_attention_mask"][i:i + 1]).last_hidden_state
        assert ours.shape == (TOKENS[i], TEXT["hidden_size"]) and max_diff(ours, theirs) < TOL
    _, _, mm = expand(folder, MIXED.replace(AUDIO_PART, ""), random_images([(90, 140)]))
    item = mm.items[0]
    with torch.no_grad():
        theirs = hf.model.get_image_features(torch.from_numpy(item.data["pixel_values"]),
                                             torch.from_numpy(item.data["image_grid_thw"])).pooler_output[0]
    assert max_diff(encoded(folder, mm)[0], theirs) < TOL


# prompt -> schedules: one prefill; chunks splitting each span (two audios: tokens 10-41 and 50-106 of the prompt's
# 127; image and audio: the image's 10-24 and the audio's 33-64 of 85), then decode steps
SCHEDULES = {"audios": {"prefill": None, "chunked+decode": [20, 40, 40, 27]},
             "image and audio": {"prefill": None, "chunked+decode": [14, 30, 30, 11]}}
SPANS = {"audios": (127, [(10, 32), (50, 57)]), "image and audio": (85, [(10, 15), (33, 32)])}


def prompt_case(folder: Path, case: str):
    """(our expanded prompt's ids, its MultiModalInputs, transformers' processor's inputs) of a prompt case."""
    text, images, audios = (PROMPT, [], waves()) if case == "audios" else (MIXED, random_images([(90, 140)]),
                                                                            waves()[:1])
    _, ids, mm = expand(folder, text, images, audios)
    return ids, mm, hf_inputs(folder, text, images, audios)


@pytest.mark.parametrize("schedule", ["prefill", "chunked+decode"])
@pytest.mark.parametrize("case", sorted(SCHEDULES))
def test_logits_with_audio_equal_transformers(release, case, schedule):
    """Our text model (as the engine loads it) with the audios' (and image's) embeddings and TMRoPE positions gives
    the thinker's logits over the prompt, then more tokens: one prefill, or chunks splitting the spans and decode
    steps."""
    folder, hf = release
    ids, mm, inputs = prompt_case(folder, case)
    assert (len(ids), [(item.offset, item.length) for item in mm.items]) == SPANS[case]
    ours = image_logits(load_model(str(folder)), ids + GENERATED, mm, encoded(folder, mm), SCHEDULES[case][schedule])
    assert max_diff(ours, reference(hf, inputs)) < TOL


# ---- each part matters -----------------------------------------------------------------------------------------------

def _whole_convolutions(tower, features, embed=qo.AudioTower.embed):  # over the whole audio at once, not by window
    _, lengths = embed(tower, features)
    h = torch.nn.functional.gelu(torch.nn.functional.conv1d(features[None], tower.conv1_weight, tower.conv1_bias,
                                                             padding=1))
    h = torch.nn.functional.gelu(torch.nn.functional.conv1d(h, tower.conv2_weight, tower.conv2_bias, stride=2,
                                                            padding=1))[0].T
    return h + torch.cat([tower.positions[:n] for n in lengths]), lengths


def _running_positions(tower, features, embed=qo.AudioTower.embed):  # positions counted over the whole audio
    positions = tower.positions
    tower.positions = torch.zeros_like(positions)
    try:
        h, lengths = embed(tower, features)
    finally:
        tower.positions = positions
    return h + qo.sinusoids(h.shape[0], h.shape[1]), lengths


def _attend_whole(tower, h, lengths, attend=qo.AudioTower.attend):  # every row attending over the whole audio
    return attend(tower, h, [h.shape[0]])


ENCODER_PARTS = {  # part -> (what is patched, its replacement), or an edit of the loaded encoder
    "windowed convolutions": (qo.AudioTower, "embed", _whole_convolutions),
    "window attention": (qo.AudioTower, "attend", _attend_whole),
    "positions per window": (qo.AudioTower, "embed", _running_positions),
    "pairwise pooling": (qo.AudioTower, "pool", staticmethod(lambda h: h[0:2 * (h.shape[0] // 2):2])),
    "sinusoidal positions": lambda encoder: encoder.audio_tower.positions.zero_(),
    "ln_post": lambda encoder: setattr(encoder.audio_tower, "ln_post", torch.nn.Identity()),
}
PARTS = sorted([*ENCODER_PARTS, "image positions", "mrope sections"])


@pytest.mark.parametrize("part", PARTS)
def test_each_part_shows_in_the_logits(release, part, monkeypatch):
    """Each distinctive part switched off moves the logits (chunks and decode steps) away from transformers'."""
    folder, hf = release
    case = "image and audio" if part in ("image positions", "mrope sections") else "audios"
    ids, mm, inputs = prompt_case(folder, case)
    ids = ids + GENERATED
    rope = None if mm.rope_positions is None else rope_table(mm, len(ids))
    model = load_model(str(folder))
    edit = ENCODER_PARTS.get(part)
    if isinstance(edit, tuple):
        monkeypatch.setattr(*edit)
        edit = None
    if part == "image positions":
        rope = torch.arange(len(ids)).expand(3, -1)
    elif part == "mrope sections":
        model.model.rotary_emb.mrope = mrope_axes({"mrope_section": [6, 1, 1]}, 16)
    ours = image_logits(model, ids, mm, encoded(folder, mm, edit), SCHEDULES[case]["chunked+decode"], rope)
    assert max_diff(ours, reference(hf, inputs)) > MOVED


# ---- refusals --------------------------------------------------------------------------------------------------------

REFUSED = {  # an edit of the whole config -> what the ValueError says
    "scaled inputs": (lambda c: setattr(c.audio_config, "scale_embedding", True),
                      r"audio_config\.scale_embedding=True is not supported"),
    "output width": (lambda c: setattr(c.audio_config, "output_dim", 48),
                     r"audio_config\.output_dim=48 differs from the text model's hidden_size=64"),
    "window": (lambda c: setattr(c.audio_config, "n_window", 2000),
               r"audio_config\.n_window=2000 .* more than audio_config\.max_source_positions=1500"),
    "activation": (lambda c: setattr(c.audio_config, "activation_function", "swish"),
                   r"audio_config\.activation_function='swish' is not supported"),
    "heads": (lambda c: setattr(c.audio_config, "encoder_attention_heads", 3),
              r"audio_config: the hidden size 32 is not divisible by the 3 attention heads"),
    "interleaved sections": (lambda c: c.text_config.rope_parameters.update(mrope_interleaved=True),
                             r"rope_parameters\.mrope_interleaved=True .* not supported"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_settings_are_refused(release, case):
    folder, _ = release
    config = read_config(str(folder))
    edit, message = REFUSED[case]
    edit(config)
    with pytest.raises(ValueError, match=message):
        qo.Qwen2_5OmniEncoder(config)


def test_mismatches_are_refused(release):
    """A feature extractor of other mel bins, an audio longer than the extractor pads to or too short for one
    embedding, features that do not fit the tower, a video with its own sound (audio inside a video), a checkpoint
    lacking a tensor of the audio tower: each a ValueError by name."""
    folder, _ = release
    config = read_config(str(folder))
    config.audio_config.num_mel_bins = 80
    with pytest.raises(ValueError, match=r"feature_size=128\) is not the Whisper feature extractor of audio_config\."
                                         r"num_mel_bins=80"):
        qo.Qwen2_5OmniProcessor.from_pretrained(folder, config)
    processor = qo.Qwen2_5OmniProcessor.from_pretrained(folder, read_config(str(folder)))
    assert processor.sampling_rate == RATE and processor.video is not None  # (videos: tests/test_omni_video.py)
    assert processor.max_audio_samples == CHUNK_SECONDS * RATE  # the server's transcriptions cut clips of it
    with pytest.raises(ValueError, match=r"of \[80001\] samples: give a mono waveform of 1 to 80000 samples \(5 s"):
        processor.process_audio(np.zeros(CHUNK_SECONDS * RATE + 1, dtype=np.float32))
    with pytest.raises(ValueError, match=r"an audio of 300 samples is too short"):
        processor.process_audio(np.zeros(300, dtype=np.float32))
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(folder))("Hi<|vision_bos|><|audio_bos|><|VIDEO|><|audio_eos|><|vision_eos|>"
                                                     )["input_ids"]  # (a video with its own sound)
    with pytest.raises(ValueError, match=r"use_audio_in_video=True\), which is not served"):
        expand_prompt(ids, [], processor, videos=[random_images([(56, 56)] * 2)])
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"input_features \(80, 40\) does not fit this audio tower \(\[128, frames"):
        encoder.encode({qo.FEATURES: torch.zeros(80, 40)})
    weights = [("thinker.audio_tower." + n.replace("conv1_", "conv1.").replace("conv2_", "conv2."), t)
               for n, t in encoder.audio_tower.state_dict().items() if n != "ln_post.bias"]
    for name, tensor in encoder.visual.state_dict().items():  # (the release's q, k and v, block 0's k left out)
        split = zip("qkv", tensor.chunk(3)) if ".attn.qkv." in name else [(None, tensor)]
        weights += [("thinker.visual." + (name if part is None else name.replace(".qkv.", f".{part}.")), piece)
                    for part, piece in split if not (part == "k" and name.startswith("blocks.0."))]
    with pytest.raises(ValueError, match=r"lacks 3 tensor\(s\) .*\['audio_tower\.ln_post\.bias', 'visual\.blocks\.0"
                                         r"\.attn\.qkv\.bias', 'visual\.blocks\.0\.attn\.qkv\.weight'\]"):
        encoder.load_weights(weights)


# ---- tensor parallel -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2])
def test_ranks_equal_one_rank(release, tmp_path, stages):
    """Two tensor-parallel ranks (the text model's heads, MLP and vocabulary split, the encoders whole on each), or
    two pipeline stages (the rows taken in on the first, the positions used on both), give one rank's logits with two
    audios, and with an image and an audio: chunks splitting the spans, decode steps."""
    folder, _ = release
    runs = []
    for case in sorted(SCHEDULES):
        ids, mm, _ = prompt_case(folder, case)
        runs.append((folder, ids + GENERATED, mm, SCHEDULES[case]["chunked+decode"]))
    assert_ranks_equal_one_rank(tmp_path, runs, stages, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
GREEDY = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_engine_greedy_with_audio_equals_transformers(release, graphs):
    """``LLM.generate`` with two audios ((waveform, rate) pairs; prefill chunks of 16 tokens, which split both
    audios' spans; n-gram drafts) gives transformers' greedy ``generate`` tokens beside a text-only prompt, some
    drafts accepted, and transformers without the audios generates others; then a prompt with an image and an
    audio (TMRoPE positions past the prompt: slot + delta) gives transformers' tokens too."""
    from specray import LLM, SamplingParams

    folder, hf = release
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16,
              speculative_config=NGRAM, enforce_eager=not graphs)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf, None, PROMPT, [(w, RATE) for w in waves()],
                                                  modality="audio", inputs=hf_inputs(folder, PROMPT, audios=waves()))
    images, audios = random_images([(90, 140)]), waves()[:1]
    out = llm.generate([{"prompt": MIXED, "multi_modal_data": {"image": images, "audio": (audios[0], RATE)}}],
                       SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    inputs = hf_inputs(folder, MIXED, images, audios)
    with torch.no_grad():
        want = hf.generate(**inputs, **GREEDY)[0, inputs["input_ids"].shape[1]:].tolist()
    assert list(out[0].outputs[0].token_ids) == want


def test_chat_with_an_input_audio_part(release):
    """``LLM.chat`` with an OpenAI ``input_audio`` part (a WAV, base64) renders the release's audio text through the
    chat template and gives transformers' greedy tokens for that prompt and the decoded audio."""
    import base64
    import io
    import wave

    from specray import LLM, SamplingParams

    folder, hf = release
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(RATE)
        out.writeframes((waves()[0] * 32767).round().astype("<i2").tobytes())
    data = buf.getvalue()
    decoded = np.frombuffer(data[44:], "<i2").astype(np.float32) / 32768.0
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=32)
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}},
        {"type": "text", "text": "What is it?"}]}]
    got = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    text = f"<|im_start|>user\n{AUDIO_PART}What is it?<|im_end|>\n<|im_start|>assistant\n"
    inputs = hf_inputs(folder, text, audios=[decoded])
    with torch.no_grad():
        want = hf.generate(**inputs, **GREEDY)
        blind = hf.generate(inputs["input_ids"], **GREEDY)  # the placeholders' own embeddings
    assert list(got.outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist()
    assert want.tolist() != blind.tolist()


def test_engine_serves_the_whole_release(release, tmp_path):
    """The whole release as Qwen/Qwen2.5-Omni's config.json names it (``Qwen2_5OmniModel``: the thinker's config
    under ``thinker_config``, its tensors under ``thinker.``, a talker's beside them) through ``LLM.generate`` with two
    audios gives the thinker's greedy tokens."""
    from specray import LLM, SamplingParams

    folder, hf = release
    whole = build_whole_release(folder, hf, tmp_path / "whole", "Qwen2_5OmniModel")
    llm = LLM(model=str(whole), max_model_len=256, block_size=4, max_num_batched_tokens=16)
    out = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"audio": [(w, RATE) for w in waves()]}}],
                       SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    inputs = hf_inputs(folder, PROMPT, audios=waves())
    with torch.no_grad():
        want = hf.generate(**inputs, **GREEDY)[0, inputs["input_ids"].shape[1]:].tolist()
    assert list(out[0].outputs[0].token_ids) == want
