"""Videos (frames only) for Qwen2.5-Omni's and Qwen3-Omni-MoE's thinkers (``specray.models.omni_video``, served by
``qwen2_5_omni``'s / ``qwen3_omni_moe``'s processors and encoders): against transformers'
``Qwen2_5OmniThinkerForConditionalGeneration`` / ``Qwen3OmniMoeThinkerForConditionalGeneration`` on the same random
tiny fp32 weights. Each video's pixels and grid equal transformers' (``Qwen2_5OmniProcessor`` /
``Qwen3OmniMoeProcessor`` over their torchvision-only ``Qwen2VLVideoProcessor``: compared live where torchvision
imports, and always against digests recorded with torchvision 0.28), with the size the Omni processor passes its video
processor (not the folder's pixel budget) and ``video_second_per_grid`` at its fps for bare frames (2 / 1); the
expanded prompt (``<|VIDEO|>`` / ``<|video_pad|>`` t*h*w / merge² times beside an audio and an image) equals
transformers' processor's; TMRoPE positions (a video alone; two videos with an audio and an image; a video at its
own rate) equal ``get_rope_index`` (frame pairs ``position_id_per_seconds`` x ``second_per_grid`` apart, truncated
for Qwen2.5-Omni; the text after a video continuing past its last pair); each video's embeddings (Qwen3-Omni: and
DeepStack features) equal ``get_video_features``; the text model fed them gives the thinker's logits over a prefill
and over chunks splitting the videos; two tensor-parallel ranks equal one; the engine's greedy tokens
(``LLM.generate`` with ``{"video": frames}``, n-gram drafts; ``LLM.chat`` with a ``video_url`` MP4) equal
transformers' ``generate``. Each distinctive part broken once shows; what is not served is refused by name (a video
with its own sound, ``use_audio_in_video``, and Qwen3-Omni's fractional temporal positions among them)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import tests.test_qwen2_5_omni as omni25
from specray.models import omni_video as ov
from specray.models import qwen2_5_omni as qo
from specray.models import qwen2_vl_vision as qv
from specray.models.loader import load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import (private_env, encoded, image_logits, random_images,  # tests/image_checks.py
                                       rope_table)
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
AUDIO = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=48, d_model=32,
             n_window=10, output_dim=64, max_source_positions=1500)
# patches of 28 pixels (merge blocks of 56): the Omni processor's video size (128..768 blocks of 28 x 28 pixels) then
# makes ~36-40 tokens a frame pair; windows of 2 x 2 merge blocks, block 1 of 2 full attention
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, window_size=112,
              fullatt_block_indexes=[1], patch_size=28)
# (frames, height, width): 3 frames of 50 x 80, resized UP to 280 x 448 (the Omni size's 128 blocks of 28², over the
# folder's own budget; the third frame repeated: 2 frame pairs of 10 x 16 patches, 80 tokens) and 2 frames of 60 x 60
# (336 x 336: one pair of 12 x 12, 36 tokens)
VIDEOS = [(3, 50, 80), (2, 60, 60)]
GRIDS = [[2, 10, 16], [1, 12, 12]]
# sha256 of each video's pixel_values_videos (float32 bytes) as transformers' Qwen2_5OmniProcessor made them
# (torchvision 0.28, CPU): see test_processor_equals_transformers_live
DIGESTS = ["d9ccfe7a50db992bbb3e9a844dfe0bee287e1dd1cb4448cbca6b50264d47c7cc",
           "4fd17d4ac38658edc8f332e3688435ee05843b9646af3e06e3b2fa1763662ba1"]
SECONDS = 1.3  # the audio
PARTS = {"video": "<|vision_bos|><|VIDEO|><|vision_eos|>", "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
         "image": "<|vision_bos|><|IMAGE|><|vision_eos|>"}
ALONE = "Hello world!" + PARTS["video"] + " The fox jumps."
MIXED = ("Hello world!" + PARTS["video"] + " and then " + PARTS["audio"] + " then " + PARTS["image"] + " and "
         + PARTS["video"] + " The fox jumps.")
IMAGE_SIZES = [(90, 140)]
GENERATED = [17, 42, 99, 75, 230, 61, 28, 150]  # tokens past the prompt (decode steps)


# a ChatML template of the release's shape: a video part renders the video placeholder between the vision marks
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
                 "{% else %}{% for p in m.content %}{% if p.type == 'video' %}" + PARTS["video"] +
                 "{% elif p.type == 'audio' %}" + PARTS["audio"] + "{% elif p.type == 'image' %}" + PARTS["image"] +
                 "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def videos() -> list[list]:
    """Two videos (lists of RGB PIL frames) of :data:`VIDEOS`' sizes, seed 1."""
    from PIL import Image

    rng = np.random.default_rng(1)
    return [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(t)]
            for t, h, w in VIDEOS]


def wave() -> np.ndarray:
    """A synthetic mono waveform of :data:`SECONDS` at 16 kHz (a tone and noise, seed 0)."""
    rng = np.random.default_rng(0)
    t = np.arange(int(SECONDS * RATE)) / RATE
    return (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def build_release(path: Path, seed: int = 0) -> tuple[Path, object]:
    """transformers' thinker at tiny sizes with random weights (the towers, norms and biases drawn away from their
    init), saved with conftest's tiny tokenizer (Omni's special tokens) and one preprocessor_config.json holding the
    Whisper feature extractor's and the Qwen2-VL image processor's settings, as the release's does (its video
    processor reads them too)."""
    from transformers import (Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration,
                              Qwen2VLImageProcessorPil, WhisperFeatureExtractor)

    tok, ids = omni25.omni_tokenizer(path, SPECIAL, CHAT_TEMPLATE)
    config = Qwen2_5OmniThinkerConfig(
        text_config={**TEXT, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id}, audio_config=AUDIO,
        vision_config=VISION, image_token_index=ids["image_token"], video_token_index=ids["video_token"],
        audio_token_index=ids["audio_token"], audio_start_token_id=ids["audio_bos_token"],
        audio_end_token_id=ids["audio_eos_token"], vision_start_token_id=ids["vision_bos_token"],
        vision_end_token_id=ids["vision_eos_token"])
    torch.manual_seed(seed)
    model = Qwen2_5OmniThinkerForConditionalGeneration(config).float().eval()
    omni25.spread_omni_weights(model)
    model.save_pretrained(path)
    settings = {**WhisperFeatureExtractor(feature_size=128, chunk_length=5).to_dict(),
                **Qwen2VLImageProcessorPil(patch_size=28).to_dict(), "return_attention_mask": True,
                "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280}  # (the budget's older names, as the release's)
    (path / "preprocessor_config.json").write_text(json.dumps(settings))
    return path, model


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, object]:
    return build_release(tmp_path_factory.mktemp("qwen2_5_omni_video"))


def expand(folder: Path, text: str = MIXED, clips=None, images=None, audios=None):
    """(our processor, the expanded prompt's ids, its MultiModalInputs) for ``text`` with the videos (and, where the
    text holds their parts, the image and the audio)."""
    from transformers import AutoTokenizer

    processor = qo.Qwen2_5OmniProcessor.from_pretrained(folder, read_config(str(folder)))
    ids = AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]
    images = (random_images(IMAGE_SIZES) if PARTS["image"] in text else []) if images is None else images
    audios = ([wave()] if PARTS["audio"] in text else []) if audios is None else audios
    clips = videos()[:text.count(PARTS["video"])] if clips is None else clips
    return (processor, *expand_prompt(ids, images, processor, videos=clips, audios=audios))


def hf_inputs(hf, ids: list[int], mm) -> dict:
    """transformers' thinker inputs for ``ids`` with the items' tensors (an audio's features as its own frames, all
    valid)."""
    def cat(kind: str, key: str):
        arrays = [item.data[key] for item in mm.items if item.modality == kind]
        return torch.from_numpy(np.concatenate(arrays)) if arrays else None

    input_ids = torch.tensor([ids])
    out = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
               pixel_values=cat("image", "pixel_values"), image_grid_thw=cat("image", "image_grid_thw"),
               pixel_values_videos=cat("video", "pixel_values_videos"), video_grid_thw=cat("video", "video_grid_thw"),
               video_second_per_grid=cat("video", ov.SECONDS))
    audios = [item.data[qo.FEATURES] for item in mm.items if item.modality == "audio"]
    if audios:
        assert len(audios) == 1
        out["input_features"] = torch.from_numpy(audios[0])[None]
        out["feature_attention_mask"] = torch.ones(1, audios[0].shape[1], dtype=torch.long)
    return {k: v for k, v in out.items() if v is not None}


@torch.no_grad()
def reference(hf, ids: list[int], mm) -> torch.Tensor:
    return hf(**hf_inputs(hf, ids, mm)).logits[0]


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


# ---- the processor and the positions ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["a video alone", "videos, an audio and an image"])
def test_items_and_positions_equal_transformers(release, case):
    """Each video's grid (the Omni size: resized up past the folder's own budget), ``<|VIDEO|>`` tokens and
    ``video_second_per_grid`` (2 / 2 fps) are transformers'; the prompt's TMRoPE positions over it and the tokens past
    it equal ``get_rope_index`` (a video's frame pairs 25 positions apart; the text after it continuing from its last
    pair's positions + 1), and so does the delta."""
    folder, hf = release
    text = ALONE if case == "a video alone" else MIXED
    _, ids, mm = expand(folder, text)
    kinds = [item.modality for item in mm.items]
    assert kinds == (["video"] if case == "a video alone" else ["video", "audio", "image", "video"])
    clips = [item for item in mm.items if item.modality == "video"]
    assert [c.data["video_grid_thw"].tolist()[0] for c in clips] == GRIDS[:len(clips)]
    assert [c.length for c in clips] == [80, 36][:len(clips)]
    assert all(ids[c.offset:c.end] == [hf.config.video_token_id] * c.length for c in clips)
    assert all(c.data[ov.SECONDS].tolist() == [1.0] for c in clips)
    inputs = hf_inputs(hf, ids + GENERATED, mm)
    lengths = inputs["feature_attention_mask"].sum(-1) if "input_features" in inputs else None
    positions, _ = hf.model.get_rope_index(
        inputs["input_ids"], image_grid_thw=inputs.get("image_grid_thw"), video_grid_thw=inputs["video_grid_thw"],
        attention_mask=inputs["attention_mask"], audio_seqlens=lengths, second_per_grids=inputs[
            "video_second_per_grid"])
    assert torch.equal(rope_table(mm, len(ids) + len(GENERATED)), positions[:, 0])
    _, delta = hf.model.get_rope_index(torch.tensor([ids]), image_grid_thw=inputs.get("image_grid_thw"),
                                       video_grid_thw=inputs["video_grid_thw"],
                                       attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       audio_seqlens=lengths, second_per_grids=inputs["video_second_per_grid"])
    assert mm.rope_delta == int(delta)
    first = clips[0]
    temporal = mm.rope_positions[0][first.offset:first.end:40]  # each frame pair's first token
    assert temporal == [first.offset, first.offset + 25]
    assert mm.rope_positions[0][first.end] == first.offset + 26  # (past the last pair: its temporal position + 1)


REFERENCE = textwrap.dedent("""
    import json, sys
    import numpy as np, torch
    from PIL import Image
    import transformers
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer, Qwen2VLVideoProcessor
    folder, out, text, name = sys.argv[1:5]
    rng = np.random.default_rng(1)
    videos = [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(t)] for t, h, w in %r]
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (*s, 3), dtype=np.uint8)) for s in %r]
    rng = np.random.default_rng(0)
    t = np.arange(int(%r * 16000)) / 16000
    audio = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)
    processor = getattr(transformers, name)(image_processor=AutoImageProcessor.from_pretrained(folder),
                                            video_processor=Qwen2VLVideoProcessor.from_pretrained(folder),
                                            feature_extractor=AutoFeatureExtractor.from_pretrained(folder),
                                            tokenizer=AutoTokenizer.from_pretrained(folder))
    got = processor(text=[text], images=images, videos=videos, audio=[audio], return_tensors="pt")
    np.save(out + "/videos.npy", got["pixel_values_videos"].numpy())
    np.save(out + "/features.npy", got["input_features"][0, :, :int(got["feature_attention_mask"].sum())].numpy())
    json.dump({"ids": got["input_ids"][0].tolist(), "grids": got["video_grid_thw"].tolist(),
               "seconds": torch.as_tensor(got["video_second_per_grid"]).tolist(),
               "own": Qwen2VLVideoProcessor.from_pretrained(folder)(videos=videos)["video_grid_thw"].tolist()},
              open(out + "/o.json", "w"))
""" % (VIDEOS, IMAGE_SIZES, SECONDS))
TORCHVISION_PATHS = ("QWEN_VL_TORCHVISION_PATH", "LLAMA4_TORCHVISION_PATH")


@pytest.mark.parametrize("kind", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_processor_equals_transformers_live(request, kind, tmp_path):
    """Where torchvision imports (``QWEN_VL_TORCHVISION_PATH`` or ``LLAMA4_TORCHVISION_PATH`` may name a folder
    holding it), transformers' ``Qwen2_5OmniProcessor`` / ``Qwen3OmniMoeProcessor`` (its video processor loaded from
    the folder) over a prompt of two videos, an audio and an image gives our prompt, our videos' pixels, grids and
    ``video_second_per_grid``, and the audio's features; its video processor called alone (the folder's own pixel
    budget) makes other grids, which the Omni processor's size overrides."""
    env = private_env(TORCHVISION_PATHS, "torchvision", "transformers' Qwen2VLVideoProcessor")
    qwen3 = kind == "qwen3_omni_moe"
    folder, _ = request.getfixturevalue("release3" if qwen3 else "release")
    script = tmp_path / "reference.py"
    script.write_text(REFERENCE)
    name = "Qwen3OmniMoeProcessor" if qwen3 else "Qwen2_5OmniProcessor"
    run = subprocess.run([sys.executable, str(script), str(folder), str(tmp_path), MIXED3 if qwen3 else MIXED, name],
                         env=env, capture_output=True, timeout=120, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    want = json.loads((tmp_path / "o.json").read_text())
    _, ids, mm = expand3(folder) if qwen3 else expand(folder)
    clips = [item for item in mm.items if item.modality == "video"]
    assert ids == want["ids"] and want["grids"] == (GRIDS3 if qwen3 else GRIDS) and want["own"] != want["grids"]
    pixels = np.load(tmp_path / "videos.npy")
    assert np.array_equal(np.concatenate([c.data["pixel_values_videos"] for c in clips]), pixels)
    assert want["seconds"] == [float(c.data[ov.SECONDS][0]) for c in clips] == ([2.0] * 2 if qwen3 else [1.0] * 2)
    spoken = next(item for item in mm.items if item.modality == "audio")
    assert np.array_equal(spoken.data[qo.FEATURES], np.load(tmp_path / "features.npy"))


def test_pixels_equal_recorded_transformers_digests(release, release3):
    """Each video's pixels hash to what transformers' Qwen2_5OmniProcessor / Qwen3OmniMoeProcessor made of them
    (recorded with torchvision: see the live test above)."""
    for (_, _, mm), want in ((expand(release[0]), DIGESTS), (expand3(release3[0]), DIGESTS3)):
        assert [_digest(item.data["pixel_values_videos"]) for item in mm.items if item.modality == "video"] == want


# ---- the encoder and the whole model ---------------------------------------------------------------------------------

def test_encoder_equals_transformers_video_features(release):
    """Each video's embeddings [t*h*w / merge², text hidden] equal the thinker's ``get_video_features`` for it
    (Qwen2.5-VL's tower over its frame pairs, Omni's q, k, v)."""
    folder, hf = release
    _, _, mm = expand(folder)
    for item, ours in zip(mm.items, encoded(folder, mm)):
        if item.modality != "video":
            continue
        with torch.no_grad():
            theirs = hf.model.get_video_features(torch.from_numpy(item.data["pixel_values_videos"]),
                                                 torch.from_numpy(item.data["video_grid_thw"])).pooler_output[0]
        assert ours.shape == (item.length, TEXT["hidden_size"]) and max_diff(ours, theirs) < TOL


# one prefill; chunks splitting both videos' spans (tokens 10-89 and 145-180 of the 192-token prompt) and the audio's,
# then decode steps
SCHEDULES = {"prefill": None, "chunked+decode": [30, 50, 40, 40, 30]}
SPANS = (192, [(10, 80), (98, 32), (135, 4), (145, 36)])


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_with_videos_equal_transformers(release, schedule):
    """Our text model with two videos', an audio's and an image's embeddings and TMRoPE positions gives the thinker's
    logits (``pixel_values_videos``, ``video_grid_thw``, ``video_second_per_grid``) over the prompt and more tokens:
    one prefill, or chunks splitting the spans and decode steps."""
    folder, hf = release
    _, ids, mm = expand(folder)
    assert (len(ids), [(item.offset, item.length) for item in mm.items]) == SPANS
    ids = ids + GENERATED
    ours = image_logits(load_model(str(folder)), ids, mm, encoded(folder, mm), SCHEDULES[schedule], blocks=128)
    assert max_diff(ours, reference(hf, ids, mm)) < TOL



def test_a_video_at_its_own_rate_is_spaced_by_it(release):
    """A video whose frames carry their rate (a decoded file's, 2.9 a second: ``video_second_per_grid`` = 2 / 2.9)
    takes positions equal to ``get_rope_index``'s: its 4 frame pairs 17.24 positions apart, truncated (0, 17, 34, 51:
    rounding would give 52)."""
    from specray.multimodal import VideoFrames

    folder, hf = release
    clip = VideoFrames((videos()[0] * 3)[:8])
    clip.fps = 2.9
    _, ids, mm = expand(folder, ALONE, clips=[clip])
    item = mm.items[0]
    assert float(item.data[ov.SECONDS][0]) == np.float32(2 / 2.9) and item.length == 160
    inputs = hf_inputs(hf, ids, mm)
    positions, delta = hf.model.get_rope_index(inputs["input_ids"], video_grid_thw=inputs["video_grid_thw"],
                                               attention_mask=inputs["attention_mask"],
                                               second_per_grids=inputs["video_second_per_grid"])
    assert torch.equal(rope_table(mm, len(ids)), positions[:, 0]) and mm.rope_delta == int(delta)
    assert mm.rope_positions[0][item.offset:item.end:40] == [item.offset + k for k in (0, 17, 34, 51)]


# ---- each part matters -----------------------------------------------------------------------------------------------

def _one_segment(layout):
    def across_frames(self, grid, device):
        order, full, windows = layout(self, grid, device)
        n = grid[0] * grid[1] * grid[2]
        return order, [n], windows if order is not None else [n]  # the frame pairs attend to each other
    return across_frames


MUTATIONS = {  # part -> (what is patched, its replacement)
    "temporal index": (ov, "temporal_index", lambda pairs, seconds, per_second, truncate: torch.zeros(pairs)),
    "time spacing": (ov, "temporal_index", lambda pairs, seconds, per_second, truncate: torch.arange(pairs)),
    # the text after a video continuing from its start + max(rows, columns), as Qwen2.5-VL's get_rope_index does
    "continuation past the last pair": (ov, "after", lambda grid: int(grid[1:].max()) + 1),
    "attention within each frame pair": (qv.Qwen2_5_VLImageEncoder, "_layout",
                                         _one_segment(qv.Qwen2_5_VLImageEncoder._layout)),
}


@pytest.mark.parametrize("part", sorted(MUTATIONS))
def test_each_part_shows_in_the_logits(release, part, monkeypatch):
    """Each distinctive part of a video switched off moves the logits (chunks and decode steps) away from the
    thinker's: its frame pairs' temporal positions (all at the start), their spacing by time (the pair's index
    instead), the text after it continuing past its last pair (from its start + max(rows, columns) instead), the
    tower's attention within each frame pair (across the video instead)."""
    folder, hf = release
    monkeypatch.setattr(*MUTATIONS[part])
    _, ids, mm = expand(folder)
    ids = ids + GENERATED
    ours = image_logits(load_model(str(folder)), ids, mm, encoded(folder, mm), SCHEDULES["chunked+decode"],
                        blocks=128)
    assert max_diff(ours, reference(hf, ids, mm)) > MOVED


def test_the_omni_video_size_shows(release, monkeypatch):
    """The video processor's size the Omni processor passes (not the folder's own pixel budget, which its video
    processor alone would use: 3136..12845056 pixels) sets the grids."""
    folder, _ = release
    monkeypatch.setattr(qo.Qwen2_5OmniProcessor, "video_size", {"shortest_edge": 3136, "longest_edge": 12845056})
    _, _, mm = expand(folder)
    assert [item.data["video_grid_thw"].tolist()[0] for item in mm.items if item.modality == "video"] != GRIDS


# ---- tensor parallel -------------------------------------------------------------------------------------------------

def test_ranks_equal_one_rank(release, release3, tmp_path):
    """Two tensor-parallel ranks (the text model split, the encoders whole on each) give one rank's logits with two
    videos, an audio and an image, for Qwen2.5-Omni and for Qwen3-Omni (its experts and DeepStack): chunks splitting
    the spans, then decode steps."""
    from specray_test_image_checks import assert_ranks_equal_one_rank  # tests/image_checks.py

    runs = []
    for (folder, _), expanded, sizes in ((release, expand, SCHEDULES), (release3, expand3, SCHEDULES3)):
        _, ids, mm = expanded(folder)
        runs.append((folder, ids + GENERATED, mm, sizes["chunked+decode"], {"blocks": 128}))
    assert_ranks_equal_one_rank(tmp_path, runs, 1, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


@pytest.mark.parametrize("kind,graphs", [("qwen2_5_omni", False), ("qwen2_5_omni", True), ("qwen3_omni_moe", False)],
                         ids=["qwen2_5_omni-eager", "qwen2_5_omni-graphs", "qwen3_omni_moe-eager"])
def test_engine_greedy_with_videos_equals_transformers(request, kind, graphs):
    """``LLM.generate`` with two videos (a list of frames, an array [T, H, W, 3]), an audio and an image (prefill
    chunks of 32 tokens, which split the videos' spans; n-gram drafts) gives the thinker's greedy ``generate``
    tokens beside a text-only prompt, some drafts accepted; the videos matter (transformers without them generates
    other tokens). Qwen2.5-Omni eager and with graphs, Qwen3-Omni eager."""
    from specray import LLM, SamplingParams

    qwen3 = kind == "qwen3_omni_moe"
    folder, hf = request.getfixturevalue("release3" if qwen3 else "release")
    steps = 16
    llm = LLM(model=str(folder), max_model_len=320, block_size=4, max_num_batched_tokens=32,
              speculative_config=NGRAM, enforce_eager=not graphs)
    clips = videos()
    clips[1] = np.stack([np.asarray(frame) for frame in clips[1]])
    prompt = {"prompt": MIXED3 if qwen3 else MIXED,
              "multi_modal_data": {"video": clips, "audio": (wave(), RATE), "image": random_images(IMAGE_SIZES)}}
    outs = llm.generate([prompt, "The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=steps,
                                                                        ignore_eos=True), use_tqdm=False)
    _, ids, mm = expand3(folder) if qwen3 else expand(folder)
    assert outs[0].prompt_token_ids == ids
    greedy = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(**hf_inputs(hf, ids, mm), **greedy)[0, len(ids):].tolist()
        plain = llm.get_tokenizer().encode("The quick brown fox")
        plain_want = hf.generate(torch.tensor([plain]), **greedy)[0, len(plain):].tolist()
        blind = hf.generate(torch.tensor([ids]), **greedy)[0, len(ids):].tolist()
    assert list(outs[0].outputs[0].token_ids) == want != blind
    assert list(outs[1].outputs[0].token_ids) == plain_want
    assert llm.spec_stats.accepted_tokens > 0


def test_chat_with_a_video_file(release):
    """``LLM.chat`` with a ``video_url`` part (an MP4 of 6 frames at 4 a second, as a data: URL) renders the video's
    text through the chat template; the decoded frames keep their rate (``video_second_per_grid`` 2 / 4 s: frame
    pairs 12.5 positions apart, truncated to 0, 12, 25 as ``get_rope_index``), and the greedy tokens equal the
    thinker's ``generate`` for that prompt and those frames."""
    import base64

    from specray import LLM, SamplingParams
    from specray.multimodal import load_video
    from tests.test_multimodal import _mp4

    folder, hf = release
    data = _mp4(6, size=(56, 28))
    frames = load_video(data)
    assert len(frames) == 6 and frames.fps == pytest.approx(4.0)
    llm = LLM(model=str(folder), max_model_len=320, block_size=4, max_num_batched_tokens=32)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "What happens?"}]}]
    got = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    text = f"<|im_start|>user\n{PARTS['video']}What happens?<|im_end|>\n<|im_start|>assistant\n"
    _, ids, mm = expand(folder, text, clips=[frames])
    item = mm.items[0]
    assert got.prompt_token_ids == ids and float(item.data[ov.SECONDS][0]) == 0.5
    assert mm.rope_positions[0][item.offset:item.end:item.length // 3] == [item.offset + k for k in (0, 12, 25)]
    greedy = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(**hf_inputs(hf, ids, mm), **greedy)[0, len(ids):].tolist()
    assert list(got.outputs[0].token_ids) == want


# ---- refusals --------------------------------------------------------------------------------------------------------

REFUSED = {  # a change of the folder's video settings -> what the ValueError says
    "sampling": ({"do_sample_frames": True}, r"do_sample_frames=True is not supported"),
    "resample": ({"resample": 2}, r"resample=2 is not supported: only bicubic"),
    "patch": ({"patch_size": 14}, r"patch_size=14 differs from vision_config\.patch_size=28"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_video_settings_are_refused(release, case, tmp_path):
    """A video processor setting not served refuses the release's videos by name (its images and audios are still
    served)."""
    import shutil

    folder = tmp_path / "release"
    shutil.copytree(release[0], folder)
    change, message = REFUSED[case]
    (folder / "video_preprocessor_config.json").write_text(json.dumps({
        **json.loads((folder / "preprocessor_config.json").read_text()), **change}))
    text = "A " + PARTS["image"] + PARTS["audio"]
    _, ids, mm = expand(folder, text)
    assert [item.modality for item in mm.items] == ["image", "audio"]
    with pytest.raises(ValueError, match=message):
        expand(folder)


def test_mismatches_are_refused(release):
    """A video with its own sound (``use_audio_in_video``: the prompt's video right after the audio's start mark),
    a release without a video token, a prompt whose video placeholders and videos differ in number: each a
    ValueError by name."""
    folder, _ = release
    sounding = "Hi<|vision_bos|><|audio_bos|><|VIDEO|><|audio_eos|><|vision_eos|>"
    with pytest.raises(ValueError, match=r"its own sound \(use_audio_in_video=True\), which is not served"):
        expand(folder, sounding, clips=videos()[:1])
    config = read_config(str(folder))
    config.video_token_id = None
    processor = qo.Qwen2_5OmniProcessor.from_pretrained(folder, config)
    assert processor.video_token_id is None and processor.image_token_id is not None
    with pytest.raises(ValueError, match=r"takes no videos \(only images and audio\)"):
        expand_prompt([1, 2], [], processor, videos=videos()[:1])
    with pytest.raises(ValueError, match=r"holds 2 video placeholder token\(s\) .* but 1 video\(s\) were given"):
        expand(folder, clips=videos()[:1])



# ---- Qwen3-Omni-MoE --------------------------------------------------------------------------------------------------
# Qwen3-VL's tower (DeepStack after blocks 2 and 0) with 32-pixel patches: the Qwen3-Omni processor's video size
# (128..768 blocks of 32 x 32 pixels) makes the same 40- and 36-token frame pairs; position_id_per_seconds 13 at its
# 1 fps for bare frames: frame pairs 26 positions apart

PARTS3 = {"video": "<|vision_start|><|video_pad|><|vision_end|>", "audio": "<|audio_start|><|audio_pad|><|audio_end|>",
          "image": "<|vision_start|><|image_pad|><|vision_end|>"}
MIXED3 = ("Hello world!" + PARTS3["video"] + " and then " + PARTS3["audio"] + " then " + PARTS3["image"] + " and "
          + PARTS3["video"] + " The fox jumps.")
GRIDS3 = [[2, 10, 16], [1, 12, 12]]
# one prefill; chunks splitting both videos' spans (tokens 10-89 and 128-163 of the 175-token prompt) and the audio's,
# then single steps
SCHEDULES3 = {"prefill": None, "chunked+decode": [30, 50, 40, 40]}
SPANS3 = (175, [(10, 80), (98, 17), (120, 2), (128, 36)])
DIGESTS3 = ["de6f763b089c3117ff3911a278a4b8af7884fddf313f8317cdf1a5fe41d2dcd8",
            "b85c7572fc65807026bf805eda141896d874a9f3470a21c9543c4429364ce3cb"]  # (as DIGESTS: Qwen3OmniMoeProcessor)


def build_release3(path: Path, seed: int = 3) -> tuple[Path, object]:
    """transformers' Qwen3-Omni-MoE thinker at tests/test_qwen3_omni_moe.py's sizes but 32-pixel patches, random
    weights drawn as there, saved the same way (one preprocessor_config.json for the Whisper extractor and the image
    processor, the budget's older names included)."""
    from transformers import (AutoTokenizer, PreTrainedTokenizerFast, Qwen2VLImageProcessorPil,
                              Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration,
                              WhisperFeatureExtractor)

    from tests import test_qwen3_omni_moe as omni3
    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    base = build_tiny_tokenizer(path, extra_special_tokens=tuple(omni3.SPECIAL.values()))
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", extra_special_tokens=omni3.SPECIAL)
    tok.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in omni3.SPECIAL.items()}
    config = Qwen3OmniMoeThinkerConfig(
        text_config={**omni3.TEXT, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id},
        audio_config=omni3.AUDIO, vision_config={**omni3.VISION, "patch_size": 32},
        image_token_id=ids["image_token"], video_token_id=ids["video_token"], audio_token_id=ids["audio_token"],
        audio_start_token_id=ids["audio_bos_token"], vision_start_token_id=ids["vision_bos_token"],
        position_id_per_seconds=13)
    torch.manual_seed(seed)
    model = Qwen3OmniMoeThinkerForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "visual." in n or "audio_tower." in n:
                p.normal_(0.0, 0.2) if p.dim() > 1 else p.normal_(1.0 if "norm" in n and "weight" in n else 0.0, 0.2)
            elif n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    settings = {**WhisperFeatureExtractor(feature_size=128).to_dict(),
                **Qwen2VLImageProcessorPil(patch_size=32, merge_size=2).to_dict(), "return_attention_mask": True,
                "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280}
    (path / "preprocessor_config.json").write_text(json.dumps(settings))
    return path, model


@pytest.fixture(scope="module")
def release3(tmp_path_factory) -> tuple[Path, object]:
    return build_release3(tmp_path_factory.mktemp("qwen3_omni_video"))


def expand3(folder: Path, text: str = MIXED3, clips=None):
    from transformers import AutoTokenizer

    from specray.models import qwen3_omni_moe as q3

    processor = q3.Qwen3OmniMoeProcessor.from_pretrained(folder, read_config(str(folder)))
    ids = AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]
    images = random_images(IMAGE_SIZES) if PARTS3["image"] in text else []
    audios = [wave()] if PARTS3["audio"] in text else []
    clips = videos()[:text.count(PARTS3["video"])] if clips is None else clips
    return (processor, *expand_prompt(ids, images, processor, videos=clips, audios=audios))


def test_qwen3_items_and_positions_equal_transformers(release3):
    """Qwen3-Omni: each video's grid (its processor's size), ``<|video_pad|>`` tokens and ``video_second_per_grid``
    (2 / 1 fps) are transformers'; the TMRoPE positions of two videos, an audio and an image (and the tokens past
    them) equal ``get_rope_index``'s (floats there: whole numbers here), frame pairs 26 apart."""
    folder, hf = release3
    _, ids, mm = expand3(folder)
    assert [item.modality for item in mm.items] == ["video", "audio", "image", "video"]
    clips = [item for item in mm.items if item.modality == "video"]
    assert [c.data["video_grid_thw"].tolist()[0] for c in clips] == GRIDS3 and [c.length for c in clips] == [80, 36]
    assert all(c.data[ov.SECONDS].tolist() == [2.0] for c in clips)
    inputs = hf_inputs(hf, ids + GENERATED, mm)
    positions, _ = hf.model.get_rope_index(
        inputs["input_ids"], image_grid_thw=inputs["image_grid_thw"], video_grid_thw=inputs["video_grid_thw"],
        attention_mask=inputs["attention_mask"], audio_seqlens=inputs["feature_attention_mask"].sum(-1),
        second_per_grids=inputs["video_second_per_grid"])
    assert torch.equal(rope_table(mm, len(ids) + len(GENERATED)).float(), positions[:, 0])
    first = clips[0]
    assert mm.rope_positions[0][first.offset:first.end:40] == [first.offset, first.offset + 26]


def test_qwen3_encoder_equals_transformers_video_features(release3):
    """Qwen3-Omni: each video's embeddings and DeepStack features [1 + 2, t*h*w / merge², hidden] equal the thinker's
    ``get_video_features`` (Qwen3-VL's tower over the frame pairs)."""
    folder, hf = release3
    _, _, mm = expand3(folder)
    for item, ours in zip(mm.items, encoded(folder, mm)):
        if item.modality != "video":
            continue
        with torch.no_grad():
            out = hf.model.get_video_features(torch.from_numpy(item.data["pixel_values_videos"]),
                                              torch.from_numpy(item.data["video_grid_thw"]))
        theirs = torch.stack([out.pooler_output[0], *[f[0] for f in out.deepstack_features]])
        assert ours.shape == (3, item.length, 64) and max_diff(ours, theirs) < TOL


@pytest.mark.parametrize("schedule", sorted(SCHEDULES3))
def test_qwen3_logits_with_videos_equal_transformers(release3, schedule):
    """Qwen3-Omni: our text model (interleaved multimodal RoPE, DeepStack on the video and image rows) with two
    videos', an audio's and an image's embeddings gives the thinker's logits over a prefill, and over chunks
    splitting the spans then decode steps."""
    folder, hf = release3
    _, ids, mm = expand3(folder)
    assert (len(ids), [(item.offset, item.length) for item in mm.items]) == SPANS3
    ids = ids + GENERATED
    ours = image_logits(load_model(str(folder)), ids, mm, encoded(folder, mm), SCHEDULES3[schedule], blocks=128)
    assert max_diff(ours, reference(hf, ids, mm)) < TOL


def _no_video_deepstack(encoder):  # the DeepStack additions of the video rows zeroed (transformers adds them)
    encode = encoder.encode

    def encode_video(data):
        out = encode(data)
        return torch.cat((out[:1], torch.zeros_like(out[1:]))) if "pixel_values_videos" in data else out
    encoder.encode = encode_video


@pytest.mark.parametrize("part", ["time spacing", "DeepStack on the video rows"])
def test_qwen3_each_part_shows_in_the_logits(release3, part, monkeypatch):
    """Qwen3-Omni: the frame pairs' spacing by time (the pair's index instead) and the DeepStack features of the video
    rows (none instead), each switched off, move the logits (chunks and decode steps) away from the thinker's."""
    folder, hf = release3
    if part == "time spacing":
        monkeypatch.setattr(ov, "temporal_index", lambda pairs, seconds, per_second, truncate: torch.arange(pairs))
    _, ids, mm = expand3(folder)
    ids = ids + GENERATED
    embeds = encoded(folder, mm, _no_video_deepstack if part != "time spacing" else None)
    ours = image_logits(load_model(str(folder)), ids, mm, embeds, SCHEDULES3["chunked+decode"], blocks=128)
    assert max_diff(ours, reference(hf, ids, mm)) > MOVED


def test_qwen3_times_frames_at_its_processors_rate(release3):
    """Qwen3-Omni keeps a video's temporal positions as floats, so it times a video's frame pairs at its processor's
    rate (1 a second: 26 positions a pair) whatever the file's own, as transformers' processor does without an fps
    (a file's 3.1 a second would give 13 x 2 / 3.1 = 8.39 a pair, which whole-number positions cannot hold)."""
    from specray.multimodal import VideoFrames

    folder, _ = release3
    for rate in (3.1, 2.0, None):
        clip = VideoFrames(videos()[0] * 2)
        clip.fps = rate
        _, _, mm = expand3(folder, "Hi" + PARTS3["video"], clips=[clip])
        item = mm.items[0]
        assert mm.rope_positions[0][item.offset:item.end:40] == [item.offset + k for k in (0, 26, 52)]
