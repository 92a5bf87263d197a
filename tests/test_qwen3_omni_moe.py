"""Qwen3-Omni-MoE's thinker (``specray.models.qwen3_omni_moe``): against transformers'
``Qwen3OmniMoeThinkerForConditionalGeneration`` on the same random tiny fp32 weights. Its text model (a Qwen3-MoE
with interleaved multimodal RoPE) gives transformers' logits over a text prompt, from the thinker's checkpoint and
from the whole release's (``Qwen3OmniMoeForConditionalGeneration``: ``thinker.``-named tensors beside a talker's, the
thinker's config under ``thinker_config``). Audios: our expanded prompt (``<|audio_pad|>`` once per embedding) equals
transformers' ``Qwen3OmniMoeProcessor``'s, and each audio's log-mel features equal its for a prompt of that audio alone
(lengths on and off the hop grid, shorter than a window, longer than Whisper's 30 s); each audio's embeddings equal
``get_audio_features`` (three-conv windows, a short last window padded, attention spans of two windows); the text
model fed them gives transformers' logits over a prompt of two audios (and of an image and an audio: DeepStack, TMRoPE
positions equal to ``get_rope_index``) in one prefill and in chunks splitting the spans, then decode steps. Two
tensor-parallel ranks (and two pipeline stages) equal one; the engine's greedy tokens with audios (and an image),
n-gram drafts, equal transformers' ``generate``, from the thinker and from the whole release; ``LLM.chat`` takes an
``input_audio`` part. Each distinctive part broken once moves the logits; what is not served is refused by name
(audio inside videos among them; videos themselves: tests/test_omni_video.py). The tiny releases are built here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tests.test_qwen2_5_omni as omni25
from specray.models import qwen3_omni_moe as qo
from specray.models.layers import mrope_axes
from specray.models.loader import load_image_encoder, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import (assert_ranks_equal_one_rank, encoded, image_logits,  # tests/image_checks.py
                                       random_images, rope_table)
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
RATE = 16000
HOP = 160
SPECIAL = {"vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>", "image_token": "<|image_pad|>",
           "video_token": "<|video_pad|>", "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
           "audio_token": "<|audio_pad|>"}
# the text model: Qwen3-MoE layers (q/k norms, 4 experts, top 2), 16-wide heads whose 8 frequencies interleave the
# temporal, height and width positions (mrope_section [2, 3, 3]); three layers, DeepStack after the first two
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True, "interleaved": True},
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
# the audio tower: windows of 100 frames (13 rows after three convolutions of 8 channels, 128 mel bins -> 16 rows),
# attention spans of two windows (n_window_infer 200: 26 rows), two layers of 2 heads
AUDIO = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=48, d_model=32,
             n_window=50, n_window_infer=200, output_dim=64, max_source_positions=1500, downsample_hidden_size=8)
# Qwen3-VL's tower: 16-pixel patches, a 5 x 5 position table, DeepStack mergers after blocks 2 and 0 (out of order)
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=16,
              num_position_embeddings=25, deepstack_visual_indexes=[2, 0], hidden_act="gelu_pytorch_tanh")
# two audios on the hop grid (as transformers' processor expands a batch of them as each alone): 1.3 s (130 frames:
# a window and one of 30, padded to 100; 13 + 4 = 17 tokens, one span) and 2.3 s (230 frames: 13 + 13 + 4 = 30 tokens,
# spans of 26 and 4)
SECONDS = [1.3, 2.3]
TOKENS = [17, 30]
AUDIO_PART = "<|audio_start|><|audio_pad|><|audio_end|>"
IMAGE_PART = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = "Hello world!" + AUDIO_PART + " and then " + AUDIO_PART + " The quick brown fox jumps."
MIXED = "Hello world!" + IMAGE_PART + " and then " + AUDIO_PART + " The quick brown fox jumps."
IMAGE_SIZE = (90, 140)  # resized to 96 x 128: 6 x 8 patches, 12 tokens
GENERATED = [17, 42, 99, 75, 230, 61, 28, 150]  # tokens past the prompt (decode steps)
# a ChatML template of the release's shape: an audio part renders the audio placeholder between its marks
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
                 "{% else %}{% for p in m.content %}{% if p.type == 'audio' %}" + AUDIO_PART +
                 "{% elif p.type == 'image' %}" + IMAGE_PART + "{% else %}{{ p.text }}{% endif %}"
                 "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def waves(seconds=SECONDS) -> list[np.ndarray]:
    """Synthetic mono waveforms at 16 kHz (tones, a chirp and noise, seed 0) of ``seconds``."""
    rng = np.random.default_rng(0)
    out = []
    for i, s in enumerate(seconds):
        t = np.arange(int(round(s * RATE))) / RATE
        tone = 0.3 * np.sin(2 * np.pi * (220 + 110 * i) * t) + 0.1 * np.sin(2 * np.pi * 1250 * t * (1 + t))
        out.append((tone + 0.05 * rng.standard_normal(t.shape)).astype(np.float32))
    return out


def build_release(path: Path, seed: int = 0) -> tuple[Path, object]:
    """transformers' thinker at :data:`TEXT` / :data:`AUDIO` / :data:`VISION` sizes with random weights (norms,
    biases and the towers' weights drawn away from their init so that each shows), saved with its processor's parts
    (conftest's tiny tokenizer with Omni's special tokens; one preprocessor_config.json holding the Whisper feature
    extractor's and the Qwen2-VL image processor's settings, as the release's does); (folder, the model)."""
    from transformers import (Qwen2VLImageProcessorPil, Qwen3OmniMoeThinkerConfig,
                              Qwen3OmniMoeThinkerForConditionalGeneration, WhisperFeatureExtractor)

    tok, ids = omni25.omni_tokenizer(path, SPECIAL, CHAT_TEMPLATE)
    config = Qwen3OmniMoeThinkerConfig(
        text_config={**TEXT, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id}, audio_config=AUDIO,
        vision_config=VISION, image_token_id=ids["image_token"], video_token_id=ids["video_token"],
        audio_token_id=ids["audio_token"], audio_start_token_id=ids["audio_bos_token"],
        vision_start_token_id=ids["vision_bos_token"], position_id_per_seconds=13)
    torch.manual_seed(seed)
    model = Qwen3OmniMoeThinkerForConditionalGeneration(config).float().eval()
    omni25.spread_omni_weights(model)
    model.save_pretrained(path)
    settings = {**WhisperFeatureExtractor(feature_size=128).to_dict(),
                **Qwen2VLImageProcessorPil(patch_size=16, merge_size=2).to_dict(), "return_attention_mask": True}
    (path / "preprocessor_config.json").write_text(json.dumps(settings))
    return path, model


def build_whole_release(thinker_folder: Path, thinker, path: Path) -> Path:
    """The whole release's layout from the thinker: its tensors under ``thinker.`` (text under ``thinker.model.``, as
    the release names them), beside a talker tensor that must not be read, its config under ``thinker_config``."""
    import shutil

    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    for file in thinker_folder.iterdir():
        if file.name not in ("config.json", "model.safetensors"):
            shutil.copy(file, path / file.name)
    theirs = json.loads((thinker_folder / "config.json").read_text())
    config = {"architectures": ["Qwen3OmniMoeForConditionalGeneration"], "model_type": "qwen3_omni_moe",
              "enable_audio_output": False,
              "thinker_config": {k: v for k, v in theirs.items() if k != "architectures"}}
    (path / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file

    tensors = {"thinker." + n: t for n, t in load_file(str(thinker_folder / "model.safetensors")).items()}
    tensors["talker.model.layers.0.mlp.up_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, object]:
    return build_release(tmp_path_factory.mktemp("qwen3_omni_moe"))


def hf_processor(folder: Path):
    return omni25.hf_processor(folder, "Qwen3OmniMoeProcessor")


def expand(folder: Path, text: str, images=(), audios=()):
    return omni25.expand(folder, text, images, audios, qo.Qwen3OmniMoeProcessor)


def hf_inputs(folder: Path, text: str, images=(), audios=()) -> dict:
    """transformers' processor's inputs for ``text``, each audio's features as it makes them for that audio alone
    (for a batch it pads the others to the longest with silence, which moves their last frames)."""
    processor = hf_processor(folder)
    inputs = processor(text=[text], images=list(images) or None, audio=list(audios) or None, return_tensors="pt")
    if len(audios) > 1:
        alone = [processor(text=["x" + AUDIO_PART], audio=[a], return_tensors="pt") for a in audios]
        frames = [int(a["feature_attention_mask"].sum()) for a in alone]
        features = torch.zeros(len(audios), alone[0]["input_features"].shape[1], max(frames))
        for i, (a, n) in enumerate(zip(alone, frames)):
            features[i, :, :n] = a["input_features"][0, :, :n]
        inputs["input_features"] = features
        inputs["feature_attention_mask"] = (torch.arange(max(frames)) < torch.tensor(frames)[:, None]).long()
    return inputs


@torch.no_grad()
def reference(hf, inputs: dict, generated: list[int] = GENERATED) -> torch.Tensor:
    """transformers' thinker's logits [L, V] over the processor's prompt and ``generated`` after it."""
    kwargs = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    ids = torch.cat((inputs["input_ids"], torch.tensor([generated], dtype=torch.long)), dim=1)
    return hf(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits[0]


# ---- the text model --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["thinker", "whole release"])
def test_text_model_equals_transformers(release, tmp_path, layout):
    """The text model, as the engine loads it from the thinker's checkpoint or from the whole release's (its text
    config under thinker_config, its tensors under thinker.), gives the thinker's logits over a text prompt: a
    prefill, and chunks then decode steps (plain RoPE, which the thinker's three equal position ids give)."""
    from specray_test_model_checks import SCHEDULES as TEXT_SCHEDULES, chunked_logits, prompt

    folder, hf = release
    if layout != "thinker":
        folder = build_whole_release(folder, hf, tmp_path / "whole")
    ids = [t if t < 3 or t > 12 else 20 for t in prompt()]  # (no special tokens)
    model = load_model(str(folder))
    assert model.model.rotary_emb.mrope is not None
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    for sizes in TEXT_SCHEDULES.values():
        assert max_diff(chunked_logits(model, ids, sizes), want) < TOL
    if layout != "thinker":  # its encoders read the thinker.-named tensors
        ids, mm, inputs = prompt_case(folder, "image and audio")
        ours = image_logits(model, ids + GENERATED, mm, encoded(folder, mm), None)
        assert max_diff(ours, reference(hf, inputs)) < TOL


# ---- the processor ---------------------------------------------------------------------------------------------------

def test_processor_equals_transformers(release):
    """Our expanded prompt equals transformers' processor's for two audios, and for an image and an audio (its pixels
    too); each audio's log-mel features equal transformers' for a prompt of that audio alone, at lengths on and off
    the hop grid, under a window (50 frames), of one frame, and past Whisper's 30 s (no cut); TMRoPE positions equal
    ``get_rope_index`` over the prompt and tokens past it (audio positions consecutive: none needed without images)."""
    folder, hf = release
    processor = hf_processor(folder)
    rng = np.random.default_rng(1)
    lengths = [20851, 8000, 333, 31 * RATE + 77]
    for audio in waves() + [(0.2 * rng.standard_normal(n)).astype(np.float32) for n in lengths]:
        text = "Hi" + AUDIO_PART + "there"
        _, ids, mm = expand(folder, text, audios=[audio])
        want = processor(text=[text], audio=[audio], return_tensors="pt")
        frames = int(want["feature_attention_mask"].sum())
        assert ids == want["input_ids"][0].tolist() and frames == len(audio) // HOP
        assert mm.items[0].length == qo.audio_embeddings(frames) and mm.rope_positions is None
        assert np.array_equal(mm.items[0].data[qo.FEATURES], want["input_features"][0].numpy())
    for text, images, audios in ((PROMPT, [], waves()), (MIXED, random_images([IMAGE_SIZE]), waves()[:1])):
        _, ids, mm = expand(folder, text, images, audios)
        want = processor(text=[text], images=images or None, audio=audios, return_tensors="pt")
        assert ids == want["input_ids"][0].tolist()
        assert [item.length for item in mm.items if item.modality == "audio"] == TOKENS[:len(audios)]
        full = torch.tensor([ids + GENERATED])
        positions, delta = hf.model.get_rope_index(full, image_grid_thw=want.get("image_grid_thw"),
                                                   attention_mask=torch.ones_like(full),
                                                   audio_seqlens=want["feature_attention_mask"].sum(-1))
        if images:
            assert np.array_equal(mm.items[0].data["pixel_values"], want["pixel_values"].numpy())
            assert torch.equal(rope_table(mm, full.shape[1]), positions[:, 0].long()) and mm.rope_delta == int(delta)
            assert mm.rope_delta < 0
        else:
            assert mm.rope_positions is None
            assert torch.equal(positions[:, 0].long(), torch.arange(full.shape[1]).expand(3, -1))


# ---- the encoder and the whole model ---------------------------------------------------------------------------------

def test_encoder_equals_transformers_features(release):
    """Each audio's embeddings [tokens, text hidden] (with DeepStack's k zero additions after them) equal transformers'
    ``get_audio_features`` for it; an image's input embeddings and DeepStack features equal ``get_image_features``."""
    folder, hf = release
    processor = hf_processor(folder)
    audios = waves([1.3, 2.3, 0.5, 3.07])
    _, _, mm = expand(folder, "Hi" + AUDIO_PART * len(audios), audios=audios)
    for item, ours, audio in zip(mm.items, encoded(folder, mm), audios):
        want = processor(text=["x" + AUDIO_PART], audio=[audio], return_tensors="pt")
        with torch.no_grad():
            theirs = hf.model.get_audio_features(want["input_features"],
                                                 want["feature_attention_mask"]).last_hidden_state
        assert ours.shape == (3, item.length, TEXT["hidden_size"]) and not ours[1:].any()
        assert max_diff(ours[0], theirs) < TOL
    _, _, mm = expand(folder, "Hi" + IMAGE_PART, random_images([IMAGE_SIZE]))
    item = mm.items[0]
    with torch.no_grad():
        theirs = hf.model.get_image_features(torch.from_numpy(item.data["pixel_values"]),
                                             torch.from_numpy(item.data["image_grid_thw"]))
    ours = encoded(folder, mm)[0]
    assert ours.shape == (3, 12, TEXT["hidden_size"]) and max_diff(ours[0], theirs.pooler_output[0]) < TOL
    assert all(max_diff(ours[1 + j], theirs.deepstack_features[j][0]) < TOL for j in range(2))


# prompt -> schedules: one prefill; chunks splitting each span (two audios: tokens 10-26 and 35-64 of the prompt's
# 85; image and audio: the image's 10-21 and the audio's 30-46 of 67), then decode steps
SCHEDULES = {"audios": {"prefill": None, "chunked+decode": [14, 25, 20, 16]},
             "image and audio": {"prefill": None, "chunked+decode": [14, 20, 10, 15]}}
SPANS = {"audios": (85, [(10, 17), (35, 30)]), "image and audio": (67, [(10, 12), (30, 17)])}


def prompt_case(folder: Path, case: str):
    """(our expanded prompt's ids, its MultiModalInputs, transformers' processor's inputs) of a prompt case."""
    text, images, audios = ((PROMPT, [], waves()) if case == "audios"
                            else (MIXED, random_images([IMAGE_SIZE]), waves()[:1]))
    _, ids, mm = expand(folder, text, images, audios)
    return ids, mm, hf_inputs(folder, text, images, audios)


@pytest.mark.parametrize("schedule", ["prefill", "chunked+decode"])
@pytest.mark.parametrize("case", sorted(SCHEDULES))
def test_logits_with_audio_equal_transformers(release, case, schedule):
    """Our text model (as the engine loads it) with the audios' (and the image's, DeepStack included) embeddings and
    TMRoPE positions gives the thinker's logits over the prompt, then more tokens: one prefill, or chunks splitting
    the spans and decode steps."""
    folder, hf = release
    ids, mm, inputs = prompt_case(folder, case)
    assert (len(ids), [(item.offset, item.length) for item in mm.items]) == SPANS[case]
    ours = image_logits(load_model(str(folder)), ids + GENERATED, mm, encoded(folder, mm), SCHEDULES[case][schedule])
    assert max_diff(ours, reference(hf, inputs)) < TOL


# ---- each part matters -----------------------------------------------------------------------------------------------

def _unpadded_tail(tower, features, embed=qo.AudioTower.embed):  # the short last window through the convs alone
    whole = features.shape[1] // tower.window * tower.window
    (head, rows), (tail, _) = embed(tower, features[:, :whole]), embed(tower, features[:, whole:])
    return torch.cat((head, tail)), rows


def _unwindowed(tower, features, embed=qo.AudioTower.embed):  # the whole audio through the convs as one window
    h, rows = embed(tower, features)
    x = torch.nn.functional.pad(features, (0, -features.shape[1] % tower.window))[None, None]
    x = tower.conv2d3(tower.conv2d2(tower.conv2d1(x)))
    _, c, f, t = x.shape
    x = tower.conv_out(x.permute(0, 3, 1, 2).reshape(t, c * f)) + qo.q25.sinusoids(t, h.shape[1])
    return x[:h.shape[0]], rows


def _running_positions(tower, features, embed=qo.AudioTower.embed):  # positions counted over the whole audio
    h, rows = embed(tower, features)
    index = torch.arange(h.shape[0])
    return h - tower.positions[index % rows] + qo.q25.sinusoids(h.shape[0], h.shape[1]), rows


def _flipped_conv_out(encoder):  # conv_out reading (mel row, channel) where transformers flattens (channel, mel row)
    w = encoder.audio_tower.conv_out.weight
    w.copy_(w.view(w.shape[0], 8, 16).transpose(1, 2).reshape(w.shape))


ENCODER_PARTS = {  # part -> (what is patched, its replacement), or an edit of the loaded encoder
    "short window padded": (qo.AudioTower, "embed", _unpadded_tail),
    "windowed convolutions": (qo.AudioTower, "embed", _unwindowed),
    "positions per window": (qo.AudioTower, "embed", _running_positions),
    "attention spans": lambda encoder: setattr(encoder.audio_tower, "spans", 100),
    "sinusoidal positions": lambda encoder: encoder.audio_tower.positions.zero_(),
    "conv_out order": _flipped_conv_out,
    "ln_post": lambda encoder: setattr(encoder.audio_tower, "ln_post", torch.nn.Identity()),
    "projection activation": lambda encoder: setattr(encoder.audio_tower, "act", torch.nn.Identity()),
}
PARTS = sorted([*ENCODER_PARTS, "image positions", "interleaved sections", "DeepStack"])


@pytest.mark.parametrize("part", PARTS)
def test_each_part_shows_in_the_logits(release, part, monkeypatch):
    """Each distinctive part switched off moves the logits (chunks and decode steps) away from transformers'."""
    folder, hf = release
    case = "image and audio" if part in ("image positions", "interleaved sections", "DeepStack") else "audios"
    ids, mm, inputs = prompt_case(folder, case)
    ids = ids + GENERATED
    rope = None if mm.rope_positions is None else rope_table(mm, len(ids))
    model = load_model(str(folder))
    edit = ENCODER_PARTS.get(part)
    if isinstance(edit, tuple):
        monkeypatch.setattr(*edit)
        edit = None
    embeds = encoded(folder, mm, edit)
    if part == "image positions":
        rope = torch.arange(len(ids)).expand(3, -1)
    elif part == "interleaved sections":  # Qwen2-VL's contiguous sections
        model.model.rotary_emb.mrope = mrope_axes({"mrope_section": [2, 3, 3]}, 16)
    elif part == "DeepStack":
        embeds = [e[:1] for e in embeds]
    ours = image_logits(model, ids, mm, embeds, SCHEDULES[case]["chunked+decode"], rope)
    assert max_diff(ours, reference(hf, inputs)) > MOVED


# ---- refusals --------------------------------------------------------------------------------------------------------

REFUSED = {  # an edit of the thinker's config -> what the ValueError says
    "window": (lambda c: setattr(c.audio_config, "n_window", 40), r"audio_config\.n_window=40 is not supported"),
    "spans": (lambda c: setattr(c.audio_config, "n_window_infer", 50),
              r"audio_config\.n_window_infer=50 is less than one window"),
    "scaled inputs": (lambda c: setattr(c.audio_config, "scale_embedding", True),
                      r"audio_config\.scale_embedding=True is not supported"),
    "output width": (lambda c: setattr(c.audio_config, "output_dim", 48),
                     r"audio_config\.output_dim=48 differs from the text model's hidden_size=64"),
    "activation": (lambda c: setattr(c.audio_config, "activation_function", "swish"),
                   r"audio_config\.activation_function='swish' is not supported"),
    "heads": (lambda c: setattr(c.audio_config, "encoder_attention_heads", 3),
              r"audio_config: the hidden size 32 is not divisible by the 3 attention heads"),
    "contiguous sections": (lambda c: c.text_config.rope_parameters.update(mrope_interleaved=False),
                            r"rope_parameters\.mrope_interleaved=False"),
    "DeepStack layers": (lambda c: setattr(c.vision_config, "deepstack_visual_indexes", [0, 5]),
                         r"deepstack_visual_indexes=\[0, 5\] must name distinct blocks"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_settings_are_refused(release, case):
    folder, _ = release
    config = read_config(str(folder))
    edit, message = REFUSED[case]
    edit(config)
    with pytest.raises(ValueError, match=message):
        qo.Qwen3OmniMoeEncoder(config)


def test_mismatches_are_refused(release):
    """A feature extractor of other mel bins, an audio too short for one embedding or empty, features that do not fit
    the tower, a video with its own sound (audio inside a video), a pipeline split leaving a DeepStack layer off the
    first stage, a checkpoint lacking a tensor of a tower: each a ValueError by name."""
    folder, _ = release
    config = read_config(str(folder))
    config.audio_config.num_mel_bins = 80
    with pytest.raises(ValueError, match=r"feature_size=128\) is not the Whisper feature extractor of audio_config\."
                                         r"num_mel_bins=80"):
        qo.Qwen3OmniMoeProcessor.from_pretrained(folder, config)
    config = read_config(str(folder))
    config.audio_config.n_window = 100
    with pytest.raises(ValueError, match=r"audio_config\.n_window=100 is not supported"):
        qo.Qwen3OmniMoeProcessor.from_pretrained(folder, config)
    processor = qo.Qwen3OmniMoeProcessor.from_pretrained(folder, read_config(str(folder)))
    assert processor.sampling_rate == RATE and processor.video is not None  # (videos: tests/test_omni_video.py)
    assert processor.max_audio_samples is None  # any length (Qwen2.5-Omni's bound not inherited)
    for samples in (100, 200):  # under a hop; no room for the STFT's reflection
        with pytest.raises(ValueError, match=rf"an audio of {samples} samples is too short .*\(at least 201 samples"):
            processor.process_audio(np.zeros(samples, dtype=np.float32))
    assert len(processor.process_audio(np.ones(201, dtype=np.float32)).replacement) == 1
    with pytest.raises(ValueError, match=r"an audio of \[0\] samples"):
        processor.process_audio(np.zeros(0, dtype=np.float32))
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(folder))(  # (a video with its own sound)
        "Hi<|vision_start|><|audio_start|><|video_pad|><|audio_end|><|vision_end|>")["input_ids"]
    with pytest.raises(ValueError, match=r"use_audio_in_video=True\), which is not served"):
        expand_prompt(ids, [], processor, videos=[random_images([(64, 64)] * 2)])
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 leaves 1 of the text model's layers"):
        qo.Qwen3OmniMoeEncoder.check_split({"thinker_config": read_config(str(folder))}, 1, 3)
    qo.Qwen3OmniMoeEncoder.check_split(read_config(str(folder)), 2, 1)
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"input_features \(80, 40\) does not fit this audio tower \(\[128, frames"):
        encoder.encode({qo.FEATURES: torch.zeros(80, 40)})
    audio = [("thinker.audio_tower." + n, t) for n, t in encoder.audio_tower.state_dict().items()]
    vision = [("thinker.visual." + n.replace("deepstack_merger_list.", "merger_list.").replace(".norm.", ".ln_q.")
               .replace("linear_fc1", "mlp.0").replace("linear_fc2", "mlp.2") if "merger" in n else
               "thinker.visual." + n, t) for n, t in encoder.visual.state_dict().items()]
    encoder.load_weights(audio + vision)  # Omni's names all read
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) of the audio tower: \['audio_tower\.conv_out\.weight'"):
        encoder.load_weights([w for w in audio if "conv_out" not in w[0]] + vision)
    with pytest.raises(ValueError, match=r"lacks 2 tensor\(s\) of the vision tower: \['visual\.deepstack_merger_list"
                                         r"\.1\.norm\.bias', 'visual\.deepstack_merger_list\.1\.norm\.weight'\]"):
        encoder.load_weights(audio + [w for w in vision if "merger_list.1.ln_q" not in w[0]])


# ---- tensor and pipeline parallel ------------------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2])
def test_ranks_equal_one_rank(release, tmp_path, stages):
    """Two tensor-parallel ranks (the text model's heads, experts and vocabulary split, the encoders whole on each),
    or two pipeline stages (the rows and DeepStack features taken in on the first), give one rank's logits with two
    audios, and with an image and an audio: chunks splitting the spans, decode steps."""
    folder, _ = release
    runs = []
    for case in sorted(SCHEDULES):
        ids, mm, _ = prompt_case(folder, case)
        runs.append((folder, ids + GENERATED, mm, SCHEDULES[case]["chunked+decode"], {"first_stage_deepstack": True}))
    assert_ranks_equal_one_rank(tmp_path, runs, stages, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
GREEDY = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)


def test_engine_greedy_with_audio_equals_transformers(release):
    """``LLM.generate`` with two audios ((waveform, rate) pairs; prefill chunks of 16 tokens, which split both
    audios' spans; n-gram drafts) gives transformers' greedy ``generate`` tokens beside a text-only prompt, some
    drafts accepted, and transformers without the audios generates others; then a prompt with an image and an
    audio (DeepStack, TMRoPE positions past the prompt: slot + delta) gives transformers' tokens too."""
    from specray import LLM, SamplingParams

    folder, hf = release
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16,
              speculative_config=NGRAM)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf, None, PROMPT, [(w, RATE) for w in waves()],
                                                  modality="audio", inputs=hf_inputs(folder, PROMPT, audios=waves()))
    images, audios = random_images([IMAGE_SIZE]), waves()[:1]
    out = llm.generate([{"prompt": MIXED, "multi_modal_data": {"image": images, "audio": (audios[0], RATE)}}],
                       SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    inputs = hf_inputs(folder, MIXED, images, audios)
    with torch.no_grad():
        want = hf.generate(**inputs, **GREEDY)[0, inputs["input_ids"].shape[1]:].tolist()
    assert list(out[0].outputs[0].token_ids) == want


def test_chat_and_the_whole_release(release, tmp_path):
    """``LLM.chat`` with an OpenAI ``input_audio`` part (a WAV, base64) renders the release's audio text through the
    chat template and gives transformers' greedy tokens for that prompt and the decoded audio; the whole release
    (``Qwen3OmniMoeForConditionalGeneration``: the thinker's config under ``thinker_config``, its tensors under
    ``thinker.``, a talker's beside them) through ``LLM.generate`` with two audios gives the thinker's greedy tokens."""
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
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=32)
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}},
        {"type": "text", "text": "What is it?"}]}]
    got = llm.chat(messages, params, use_tqdm=False)[0]
    text = f"<|im_start|>user\n{AUDIO_PART}What is it?<|im_end|>\n<|im_start|>assistant\n"
    inputs = hf_inputs(folder, text, audios=[decoded])
    with torch.no_grad():
        want = hf.generate(**inputs, **GREEDY)
        blind = hf.generate(inputs["input_ids"], **GREEDY)  # the placeholders' own embeddings
    assert list(got.outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist()
    assert want.tolist() != blind.tolist()
    del llm
    whole = build_whole_release(folder, hf, tmp_path / "whole")
    llm = LLM(model=str(whole), max_model_len=256, block_size=4, max_num_batched_tokens=16)
    out = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"audio": [(w, RATE) for w in waves()]}}], params,
                       use_tqdm=False)
    inputs = hf_inputs(folder, PROMPT, audios=waves())
    with torch.no_grad():
        want = hf.generate(**inputs, **GREEDY)[0, inputs["input_ids"].shape[1]:].tolist()
    assert list(out[0].outputs[0].token_ids) == want
