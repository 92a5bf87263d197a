"""Qwen2-VL's and Qwen2.5-VL's videos (``specray.models.qwen2_vl_video``, served by ``qwen2_vl_vision``'s processor and
tower): against transformers' whole ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` on
the same random tiny fp32 weights. Each video's pixels and grid equal transformers' ``Qwen2VLVideoProcessor``'s (a
torchvision-only processor: compared live where torchvision imports, and always against digests recorded with
torchvision 0.28), a video of an odd frame count (its last frame repeated) and one resized down; the expanded prompt
equals transformers' processor's, with ``second_per_grid_ts`` for Qwen2.5-VL; the multimodal RoPE positions of a
prompt holding two videos and an image equal ``get_rope_index``; each video's embeddings equal
``get_video_features``; the text model fed them gives transformers' logits over a prefill and over chunks splitting
the videos' spans; the engine's greedy tokens (``LLM.generate`` with ``{"video": frames}``, n-gram drafts) equal
transformers' ``generate``. Each distinctive part broken once shows; what is not served is refused by name."""

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

from specray.models import qwen2_vl_vision as qv
from specray.models import qwen2_vl_video as qvv
from specray.models.loader import load_image_encoder, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import private_env, image_logits, random_images, rope_table  # tests/image_checks.py
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
SPECIAL = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
# Qwen2.5-VL: windows of 2 x 2 merge blocks (a frame pair's 2 x 3 blocks cut short), block 1 of 3 full attention; 100
# tokens a second: at transformers' 24 fps for frames without metadata, frame pairs 8.33 positions apart (truncated;
# further apart than their tokens: positions pass the slot indices, and the text after the video)
VISION = {"qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, hidden_act="quick_gelu"),
          "qwen2_5_vl": dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                             window_size=56, fullatt_block_indexes=[1], hidden_act="silu", tokens_per_second=100)}
KINDS = sorted(VISION)
# the video processor's pixel budget per frame: 56 x 84 pixels at most, 56 x 56 at least
VIDEO_SETTINGS = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                  "do_sample_frames": False, "image_mean": qvv.CLIP_MEAN, "image_std": qvv.CLIP_STD, "merge_size": 2,
                  "patch_size": 14, "resample": 3, "rescale_factor": 1 / 255, "temporal_patch_size": 2,
                  "size": {"longest_edge": 56 * 84, "shortest_edge": 56 * 56},
                  "video_processor_type": "Qwen2VLVideoProcessor"}
# (frames, height, width): 5 frames of 50 x 80 (resized up to 56 x 84; the fifth repeated: 3 frame pairs of 4 x 6
# patches, 18 tokens) and 8 of 90 x 140 (resized down to 28 x 84: 4 pairs of 2 x 6 patches, 12 tokens; more pairs
# than merged rows or columns)
VIDEOS = [(5, 50, 80), (8, 90, 140)]
GRIDS = [[3, 4, 6], [4, 2, 6]]
# sha256 of each video's pixel_values_videos (float32 bytes) as transformers' Qwen2VLVideoProcessor made them
# (torchvision 0.28, CPU)
DIGESTS = ["b3cd0b2dad325b85969bd3ddbd803494118258725ee285da7c2f386927c744a7",
           "bbd0def6fbeefb19e6a04f18a6999fd19ce339f52f3c1190c7c318a9024d6379"]
# with cap_pixels_per_frame and max_video_tokens=23, a frame's budget is also int(23 * 28² * 0.9) * 2 / frames pixels:
# the second video's 8 frames take 4057 pixels each at most, resized to 28 x 56
CAPPED_TOKENS = 23
CAPPED_GRIDS = [[3, 4, 6], [4, 2, 4]]
CAPPED_DIGEST = "3cb40cd320f9864fce58b597a704e734eebb8728ef8c6710fd27982e61e12680"  # the second video's, capped
IMAGE_SIZES = [(50, 80)]
PART = {"image": "<|vision_start|><|image_pad|><|vision_end|>", "video": "<|vision_start|><|video_pad|><|vision_end|>"}
PROMPT = "Hello world!" + PART["video"] + " and then " + PART["image"] + " then " + PART["video"] + " The fox jumps."
GENERATED = [17, 42, 99, 75, 230, 61, 28, 150]  # tokens past the prompt (decode steps)


def videos() -> list[list]:
    """Two videos (lists of RGB PIL frames) of :data:`VIDEOS`' sizes, seed 1."""
    from PIL import Image

    rng = np.random.default_rng(1)
    return [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(t)]
            for t, h, w in VIDEOS]


def build_release(kind: str, path: Path, seed: int) -> tuple[Path, object]:
    """transformers' whole ``kind`` model at tiny sizes with random weights (norms, biases and the tower drawn away
    from their init), saved with conftest's tiny tokenizer, transformers' Qwen2-VL image processor and the video
    processor's settings (written here: transformers' video processor needs torchvision to be built)."""
    import transformers
    from transformers import Qwen2VLImageProcessorPil

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=SPECIAL)
    start, end, image, video = tok.convert_tokens_to_ids(list(SPECIAL))
    name = "Qwen2VL" if kind == "qwen2_vl" else "Qwen2_5_VL"
    config = getattr(transformers, f"{name}Config")(
        text_config={**TEXT, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id, "pad_token_id": None},
        vision_config=VISION[kind], image_token_id=image, video_token_id=video, vision_start_token_id=start,
        vision_end_token_id=end, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "visual." in n:
                p.normal_(0.0, 0.2) if p.dim() > 1 else p.normal_(1.0 if n.endswith("weight") else 0.0, 0.2)
            elif n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil().save_pretrained(path)
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_SETTINGS, indent=2))
    return path, model


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    return {kind: build_release(kind, tmp_path_factory.mktemp(kind), seed) for seed, kind in enumerate(KINDS)}


def expanded(folder: Path, text: str = PROMPT, pictures=None, clips=None):
    """(our processor, the expanded prompt's ids, its MultiModalInputs) for ``text`` with the images and videos."""
    from transformers import AutoTokenizer

    processor = qv.QwenVLImageProcessor.from_pretrained(folder, read_config(str(folder)))
    ids = AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]
    ids, mm = expand_prompt(ids, random_images(IMAGE_SIZES) if pictures is None else pictures, processor,
                            videos() if clips is None else clips)
    return processor, ids, mm


def encoded(folder: Path, mm) -> list[torch.Tensor]:
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    with torch.no_grad():
        return [encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()}) for item in mm.items]


def hf_inputs(hf, ids: list[int], mm) -> dict:
    """transformers' model inputs for ``ids`` with the items' tensors (as its processor gives them)."""
    def cat(kind: str, key: str):
        arrays = [item.data[key] for item in mm.items if item.modality == kind and key in item.data]
        return torch.from_numpy(np.concatenate(arrays)) if arrays else None

    input_ids = torch.tensor([ids])
    types = (input_ids == hf.config.image_token_id).int() + 2 * (input_ids == hf.config.video_token_id).int()
    out = dict(input_ids=input_ids, mm_token_type_ids=types, pixel_values=cat("image", "pixel_values"),
               image_grid_thw=cat("image", "image_grid_thw"), pixel_values_videos=cat("video", "pixel_values_videos"),
               video_grid_thw=cat("video", "video_grid_thw"))
    seconds = cat("video", "second_per_grid_ts")
    if seconds is not None:
        out["second_per_grid_ts"] = seconds
    return {k: v for k, v in out.items() if v is not None}


@torch.no_grad()
def reference(hf, ids: list[int], mm) -> torch.Tensor:
    return hf(**hf_inputs(hf, ids, mm)).logits[0]


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


# ---- the processor ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_video_items_and_positions_equal_transformers(releases, kind):
    """Each video's grid, tokens (t*h*w / merge² ``<|video_pad|>``) and ``second_per_grid_ts`` (Qwen2.5-VL: 2 / 24
    fps) are transformers'; the prompt's multimodal RoPE positions (two videos and an image between them) and the
    delta past it equal transformers' ``get_rope_index``."""
    folder, hf = releases[kind]
    _, ids, mm = expanded(folder)
    assert [item.modality for item in mm.items] == ["video", "image", "video"]
    grids = [item.data["video_grid_thw"].tolist()[0] for item in mm.items if item.modality == "video"]
    assert grids == GRIDS and [mm.items[0].length, mm.items[2].length] == [18, 12]
    assert all(ids[i.offset:i.end] == [hf.config.video_token_id] * i.length for i in mm.items if i.modality == "video")
    seconds = [item.data.get("second_per_grid_ts") for item in mm.items if item.modality == "video"]
    if kind == "qwen2_vl":
        assert seconds == [None, None]
    else:
        assert [s.tolist() for s in seconds] == [[np.float32(2 / 24)]] * 2
    inputs = hf_inputs(hf, ids + GENERATED, mm)
    inputs.pop("pixel_values"), inputs.pop("pixel_values_videos")
    positions, _ = hf.model.get_rope_index(inputs.pop("input_ids"), **inputs)
    assert torch.equal(rope_table(mm, len(ids) + len(GENERATED)), positions[:, 0])  # (the tokens past it: slot + delta)
    # (Qwen2.5-VL: the second video's temporal positions pass the text after it, which continues from its start +
    # max(rows, columns): the tokens past the prompt continue from the last position, as transformers' generate does,
    # not from the largest, as get_rope_index's delta would have them)
    top = max(max(axis) for axis in mm.rope_positions)
    assert (top > mm.rope_positions[0][-1]) == (kind == "qwen2_5_vl")
    temporal = mm.rope_positions[0][mm.items[0].offset:mm.items[0].end:6]  # each frame pair's first token
    start = mm.items[0].offset
    assert temporal == ([start, start + 1, start + 2] if kind == "qwen2_vl" else [start, start + 8, start + 16])


def test_pixels_equal_recorded_transformers_digests(releases):
    """Each video's pixels hash to what transformers' Qwen2VLVideoProcessor made of it (recorded with torchvision:
    see the live test below), and the second video's with ``cap_pixels_per_frame``."""
    _, _, mm = expanded(releases["qwen2_vl"][0])
    got = [_digest(item.data["pixel_values_videos"]) for item in mm.items if item.modality == "video"]
    assert got == DIGESTS
    frames = qvv.QwenVLVideoFrames({**VIDEO_SETTINGS, "cap_pixels_per_frame": True,
                                    "max_video_tokens": CAPPED_TOKENS}, VISION["qwen2_vl"])
    pixels, grid = frames.pixels(videos()[1])
    assert grid.tolist() == CAPPED_GRIDS[1:] and _digest(pixels) == CAPPED_DIGEST


REFERENCE = textwrap.dedent("""
    import json, sys
    import numpy as np, torch
    from PIL import Image
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer, AutoVideoProcessor
    kind, folder, out, text = sys.argv[1:5]
    rng = np.random.default_rng(1)
    videos = [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(t)] for t, h, w in %r]
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (*s, 3), dtype=np.uint8)) for s in %r]
    cls = getattr(transformers, "Qwen2VLProcessor" if kind == "qwen2_vl" else "Qwen2_5_VLProcessor")
    processor = cls(image_processor=AutoImageProcessor.from_pretrained(folder), tokenizer=AutoTokenizer.from_pretrained(
        folder), video_processor=AutoVideoProcessor.from_pretrained(folder))
    got = processor(text=[text], images=images, videos=videos, return_tensors="pt")
    np.save(out + "/videos.npy", got["pixel_values_videos"].numpy())
    capping = AutoVideoProcessor.from_pretrained(folder, cap_pixels_per_frame=True, max_video_tokens=%d)
    capped = capping(videos=videos, return_tensors="pt")
    np.save(out + "/capped.npy", capped["pixel_values_videos"].numpy())
    json.dump({"ids": got["input_ids"][0].tolist(), "grids": got["video_grid_thw"].tolist(),
               "seconds": got["second_per_grid_ts"].tolist() if "second_per_grid_ts" in got else None,
               "capped": capped["video_grid_thw"].tolist()}, open(out + "/o.json", "w"))
""" % (VIDEOS, IMAGE_SIZES, CAPPED_TOKENS))
TORCHVISION_PATHS = ("QWEN_VL_TORCHVISION_PATH", "LLAMA4_TORCHVISION_PATH")


@pytest.mark.parametrize("kind", KINDS)
def test_processor_equals_transformers_live(releases, kind, tmp_path):
    """Where torchvision imports (``QWEN_VL_TORCHVISION_PATH`` or ``LLAMA4_TORCHVISION_PATH`` may name a folder
    holding it), transformers' own processor (its video processor loaded from the folder) over a prompt of two videos
    and an image gives our prompt, our videos' pixels and grids, and Qwen2.5-VL's ``second_per_grid_ts``; and with
    ``cap_pixels_per_frame`` (the second video's frames held to their share of ``max_video_tokens``) its pixels."""
    env = private_env(TORCHVISION_PATHS, "torchvision", "transformers' Qwen2VLVideoProcessor")
    folder, _ = releases[kind]
    script = tmp_path / "reference.py"
    script.write_text(REFERENCE)
    subprocess.run([sys.executable, str(script), kind, str(folder), str(tmp_path), PROMPT], env=env, check=True,
                   capture_output=True, timeout=120)
    want = json.loads((tmp_path / "o.json").read_text())
    _, ids, mm = expanded(folder)
    clips = [item for item in mm.items if item.modality == "video"]
    assert ids == want["ids"] and want["grids"] == GRIDS
    assert np.array_equal(np.concatenate([i.data["pixel_values_videos"] for i in clips]),
                          np.load(tmp_path / "videos.npy"))
    seconds = None if kind == "qwen2_vl" else [float(i.data["second_per_grid_ts"][0]) for i in clips]
    assert want["seconds"] == seconds
    frames = qvv.QwenVLVideoFrames({**VIDEO_SETTINGS, "cap_pixels_per_frame": True,
                                    "max_video_tokens": CAPPED_TOKENS}, read_config(str(folder)).vision_config)
    capped = [frames.pixels(clip) for clip in videos()]
    assert [grid.tolist()[0] for _, grid in capped] == want["capped"] == CAPPED_GRIDS
    assert np.array_equal(np.concatenate([pixels for pixels, _ in capped]), np.load(tmp_path / "capped.npy"))


# ---- the encoder and the whole model ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_encoder_equals_transformers_video_features(releases, kind):
    """Each video's embeddings [t*h*w / merge², text hidden] equal transformers' ``get_video_features`` for it."""
    folder, hf = releases[kind]
    _, _, mm = expanded(folder)
    for item, ours in zip(mm.items, encoded(folder, mm)):
        if item.modality != "video":
            continue
        with torch.no_grad():
            theirs = hf.model.get_video_features(torch.from_numpy(item.data["pixel_values_videos"]),
                                                 torch.from_numpy(item.data["video_grid_thw"])).pooler_output[0]
        assert ours.shape == (item.length, TEXT["hidden_size"]) and max_diff(ours, theirs) < TOL


# a prefill; chunks that split both videos' spans (tokens 10-27 and 47-58 of the 70-token prompt), then single steps
SCHEDULES = {"prefill": None, "chunked+decode": [14, 16, 19]}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("kind", KINDS)
def test_logits_with_videos_equal_transformers(releases, kind, schedule):
    """Our text model with the videos' and the image's embeddings and multimodal RoPE positions gives transformers'
    whole model's logits (``pixel_values_videos``, ``video_grid_thw``, Qwen2.5-VL's ``second_per_grid_ts``) over
    the prompt and more tokens: one prefill, or chunks splitting both videos' spans and single decode steps."""
    folder, hf = releases[kind]
    _, ids, mm = expanded(folder)
    assert [(item.offset, item.length) for item in mm.items] == [(10, 18), (36, 6), (47, 12)] and len(ids) == 70
    ids = ids + GENERATED
    ours = image_logits(load_model(str(folder)), ids, mm, encoded(folder, mm), SCHEDULES[schedule])
    assert max_diff(ours, reference(hf, ids, mm)) < TOL


# ---- each part matters -----------------------------------------------------------------------------------------------

def _one_segment(layout):
    def across_frames(self, grid, device):
        order, full, windows = layout(self, grid, device)
        n = grid[0] * grid[1] * grid[2]
        return order, [n], windows if order is not None else [n]  # the frame pairs attend to each other
    return across_frames


PARTS = ["temporal index", "time spacing", "attention within each frame pair"]
KIND_PARTS = [(kind, part) for kind in KINDS for part in PARTS if kind == "qwen2_5_vl" or part != "time spacing"]


@pytest.mark.parametrize("kind,part", KIND_PARTS)
def test_each_part_shows_in_the_logits(releases, kind, part, monkeypatch):
    """Each distinctive part of a video switched off moves the logits (chunks and decode steps) away from
    transformers': its frame pairs' temporal positions (all at the start), Qwen2.5-VL's spacing by time (the pair's
    index instead), the tower's attention within each frame pair (across the video instead)."""
    folder, hf = releases[kind]
    encoder = qv.Qwen2VLImageEncoder if kind == "qwen2_vl" else qv.Qwen2_5_VLImageEncoder
    if part == "temporal index":
        monkeypatch.setattr(qvv, "temporal_indices", lambda frames, data, tps: np.zeros(frames, dtype=np.int64))
    elif part == "time spacing":
        monkeypatch.setattr(qvv, "temporal_indices", lambda frames, data, tps: np.arange(frames))
    else:
        monkeypatch.setattr(encoder, "_layout", _one_segment(encoder._layout))
    _, ids, mm = expanded(folder)
    ids = ids + GENERATED
    ours = image_logits(load_model(str(folder)), ids, mm, encoded(folder, mm), SCHEDULES["chunked+decode"])
    assert max_diff(ours, reference(hf, ids, mm)) > MOVED


def test_each_pixel_step_shows(releases, monkeypatch):
    """The frames' resize without antialiasing, or the odd frame count padded with zeros instead of the last frame,
    changes the pixels (their digests no longer transformers')."""
    folder, _ = releases["qwen2_vl"]
    interpolate = qvv.F.interpolate
    cat = torch.cat
    for patch in ("antialias", "padding"):
        with monkeypatch.context() as m:
            if patch == "antialias":
                m.setattr(qvv.F, "interpolate", lambda x, **kw: interpolate(x, **{**kw, "antialias": False}))
            else:
                m.setattr(qvv.torch, "cat", lambda xs: cat((xs[0], torch.zeros_like(xs[1]))))
            _, _, mm = expanded(folder)
        got = [_digest(item.data["pixel_values_videos"]) for item in mm.items if item.modality == "video"]
        assert got[0] != DIGESTS[0], patch


# ---- tensor parallel -------------------------------------------------------------------------------------------------

def test_ranks_equal_one_rank(releases, tmp_path):
    """Two tensor-parallel ranks (the text model split, the tower whole on each) give one rank's logits with the
    videos and the image: chunks splitting both videos' spans, then decode steps."""
    from specray_test_image_checks import assert_ranks_equal_one_rank  # tests/image_checks.py

    runs = []
    for kind in KINDS:
        folder, _ = releases[kind]
        _, ids, mm = expanded(folder)
        runs.append((folder, ids + GENERATED, mm, SCHEDULES["chunked+decode"]))
    assert_ranks_equal_one_rank(tmp_path, runs, 1, TOL)


# ---- refusals --------------------------------------------------------------------------------------------------------

REFUSED = {  # a change of the video processor's settings -> what the ValueError says
    "sampling": ({"do_sample_frames": True}, r"do_sample_frames=True is not supported"),
    "resample": ({"resample": 2}, r"resample=2 is not supported: only bicubic"),
    "no resize": ({"do_resize": False}, r"do_resize=False is not supported"),
    "patch": ({"patch_size": 16}, r"patch_size=16 differs from vision_config\.patch_size=14"),
    "size": ({"size": {"height": 56, "width": 56}}, r"size=\{'height': 56, 'width': 56\} must hold shortest_edge"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_video_settings_are_refused(releases, case, tmp_path):
    """A video processor setting not served refuses the release's videos by name (its images are still served)."""
    import shutil

    folder = tmp_path / "release"
    shutil.copytree(releases["qwen2_5_vl"][0], folder)
    change, message = REFUSED[case]
    (folder / "video_preprocessor_config.json").write_text(json.dumps({**VIDEO_SETTINGS, **change}))
    _, ids, mm = expanded(folder, "A " + PART["image"], clips=[])
    assert [item.modality for item in mm.items] == ["image"]
    with pytest.raises(ValueError, match=message):
        expanded(folder)


def test_mismatches_are_refused(releases):
    """Videos for a release without a video token (or of a family whose processor derives from this one), frames of
    two sizes, and a prompt whose video placeholders and videos differ in number: each a ValueError by name."""
    from PIL import Image

    folder, _ = releases["qwen2_vl"]
    config = read_config(str(folder))
    config.video_token_id = None
    processor = qv.QwenVLImageProcessor.from_pretrained(folder, config)
    with pytest.raises(ValueError, match=r"takes no videos \(only images\)"):
        expand_prompt([1, 2], [], processor, videos()[:1])
    config = read_config(str(folder))
    config.model_type = "glm4v"  # (a family whose processor derives from Qwen2-VL's: its videos are not served)
    assert qv.QwenVLImageProcessor.from_pretrained(folder, config).video_token_id is None
    frames = [Image.new("RGB", (56, 56)), Image.new("RGB", (84, 56))]
    with pytest.raises(ValueError, match=r"frames must share one size"):
        qv.QwenVLImageProcessor.from_pretrained(folder, read_config(str(folder))).video.pixels(frames)
    with pytest.raises(ValueError, match=r"holds 2 video placeholder token\(s\) .* but 1 video\(s\) were given"):
        expanded(folder, clips=videos()[:1])


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("kind", KINDS)
def test_engine_greedy_with_videos_equals_transformers(releases, kind, graphs):
    """``LLM.generate`` with two videos (a list of frames, an array) and an image (prefill chunks of 16 tokens, which
    split the first video's span; n-gram drafts verified at multimodal positions past the prompt) gives transformers'
    greedy ``generate`` tokens, token for token, beside a text-only prompt; some drafts are accepted; the videos
    matter (transformers without them generates other tokens). Eager, and with graphs (the decode steps holding
    the video request, their positions shifted by its delta, replay from graphs of their own)."""
    from specray import LLM, SamplingParams

    folder, hf = releases[kind]
    steps = 16
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16,
              speculative_config=NGRAM, enforce_eager=not graphs)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    clips = videos()
    clips[1] = np.stack([np.asarray(frame) for frame in clips[1]])  # (a video as an array [T, H, W, 3] of uint8)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": random_images(IMAGE_SIZES), "video": clips}}
    outs = llm.generate([prompt, "The quick brown fox"], params, use_tqdm=False)
    _, ids, mm = expanded(folder)
    greedy = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(**hf_inputs(hf, ids, mm), **greedy)[0, len(ids):].tolist()
        plain = llm.get_tokenizer().encode("The quick brown fox")
        plain_want = hf.generate(torch.tensor([plain]), **greedy)[0, len(plain):].tolist()
        blind = hf.generate(torch.tensor([ids]), **greedy)[0, len(ids):].tolist()
    assert list(outs[0].outputs[0].token_ids) == want != blind
    assert list(outs[1].outputs[0].token_ids) == plain_want
    assert llm.spec_stats.accepted_tokens > 0
    runner = llm.engine.executor.worker.runner  # (with graphs, the video request's decode steps replay their own)
    assert graphs == any(key[-1] == "rope" for key in (runner.graphs.graphs if runner.graphs else ()))


def test_a_video_file_is_spaced_by_its_own_frame_rate(releases, tmp_path):
    """A video file (an MP4 of 41 frames at 4 a second: 32 frames taken evenly over its 10 s, 31 gaps) gives
    Qwen2.5-VL's ``second_per_grid_ts`` from the taken frames' own rate (2 / 3.1 s), not transformers' default for
    bare frames; ``LLM.generate`` with the file's path gives transformers' greedy tokens for those inputs."""
    from specray import LLM, SamplingParams
    from specray.multimodal import load_video
    from tests.test_multimodal import _mp4

    folder, hf = releases["qwen2_5_vl"]
    path = tmp_path / "clip.mp4"
    path.write_bytes(_mp4(41, size=(56, 28)))
    frames = load_video(str(path))
    assert len(frames) == 32 and frames.fps == pytest.approx(3.1)
    text = "Hello world!" + PART["video"] + " The fox jumps."
    _, ids, mm = expanded(folder, text, pictures=[], clips=[frames])
    assert float(mm.items[0].data["second_per_grid_ts"][0]) == pytest.approx(2 / 3.1)
    llm = LLM(model=str(folder), max_model_len=512, block_size=4, max_num_batched_tokens=64)
    out = llm.generate([{"prompt": text, "multi_modal_data": {"video": str(path)}}],
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    greedy = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(**hf_inputs(hf, ids, mm), **greedy)[0, len(ids):].tolist()
    assert out.prompt_token_ids == ids and list(out.outputs[0].token_ids) == want
