"""Qwen3-VL's videos (``specray.models.qwen3_vl_video``, served by ``qwen3_vl_vision``'s processor and tower), and
Qwen3.5's (the same processor, ``qwen3_5_vision``'s tower): against transformers' whole
``Qwen3VLForConditionalGeneration`` / ``Qwen3VLMoeForConditionalGeneration`` / ``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration`` on the same random tiny fp32 weights. The expanded prompt (each frame pair's
``<t seconds>`` text and vision marks), the sampled frames, pixels and grids equal transformers' ``Qwen3VLProcessor``'s
(its torchvision-only video processor: compared live where torchvision imports, frames of a known rate too, and
always against digests recorded with torchvision 0.28); the multimodal RoPE positions equal ``get_rope_index``; each
video's embeddings and DeepStack features equal ``get_video_features``'; the text model fed them gives transformers'
logits with two videos and an image over a prefill and over chunks splitting every span; the engine's greedy tokens
(``LLM.generate`` with ``{"video": ...}``: frames, an array, a file's path; n-gram drafts) equal transformers'
``generate``. Each distinctive part broken once shows; what is not served is refused by name."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models import qwen3_vl_video as q3v
from specray.models.loader import load_model, read_config
from specray.models.qwen3_vl_vision import Qwen3VLImageProcessor
from specray.multimodal import expand_prompt
from specray_test_image_checks import (private_env, encoded, image_logits, random_images,  # tests/image_checks.py
                                       rope_table)
from specray_test_model_checks import max_diff  # tests/model_checks.py
from tests.test_qwen3_vl_images import build_release

TOL = 1e-4
SETTINGS = {"size": {"longest_edge": 4 * 64 * 96, "shortest_edge": 32 * 32}, "patch_size": 16,
            "temporal_patch_size": 2, "merge_size": 2, "image_mean": q3v.HALF, "image_std": q3v.HALF,
            "fps": 2, "min_frames": 4, "max_frames": 768, "video_processor_type": "Qwen3VLVideoProcessor"}
VIDEOS = [(6, 50, 80), (5, 90, 140)]  # sampled to 4 frames each (transformers' default at 24 fps)
PART = {"image": "<|vision_start|><|image_pad|><|vision_end|>", "video": "<|vision_start|><|video_pad|><|vision_end|>"}
PROMPT = "Hello world!" + PART["video"] + " and then " + PART["image"] + " then " + PART["video"] + " The fox."
MOVED = 1e-2
GRIDS = [[[2, 4, 4]], [[2, 2, 6]]]
# sha256 of each video's pixel_values_videos (float32 bytes) as transformers' Qwen3VLVideoProcessor made them
# (torchvision 0.28, CPU)
DIGESTS = ["6e59bbda64eaf04919a3889a2c3c79837904f75e5a134fb0100b175e9d352357",
           "e7d020e2136338eafe7f363ebe069e4e138c8eda4082e4de3d27ab75e99e0288"]
GENERATED = [17, 42, 99, 75, 230, 61, 28, 150]


def videos() -> list[list]:
    from PIL import Image

    rng = np.random.default_rng(1)
    return [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(t)]
            for t, h, w in VIDEOS]


KINDS = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """Each kind's tiny release (built when first asked for), with :data:`SETTINGS` as its video processor's."""
    import tests.test_qwen3_5_images as q35

    built = {}

    def get(kind: str):
        if kind not in built:
            make = build_release if kind.startswith("qwen3_vl") else q35.build_release
            # each kind's seed its own (not the order kinds are built in, which differs as workers share the tests)
            folder, model = make(kind, tmp_path_factory.mktemp(kind), KINDS.index(kind))
            (folder / "video_preprocessor_config.json").write_text(json.dumps(SETTINGS))
            built[kind] = folder, model
        return built[kind]
    return get


@pytest.fixture(scope="module")
def release(releases):
    return releases("qwen3_vl")


def expanded(folder: Path):
    from transformers import AutoTokenizer

    processor = Qwen3VLImageProcessor.from_pretrained(folder, read_config(str(folder)))
    ids = AutoTokenizer.from_pretrained(str(folder))(PROMPT)["input_ids"]
    ids, mm = expand_prompt(ids, random_images([(60, 100)]), processor, videos())
    return processor, ids, mm


REFERENCE = r"""
import sys, numpy as np, torch, json
from PIL import Image
from transformers import AutoProcessor
sys.path.insert(0, %r)
from image_checks import random_images
folder, out, prompt = sys.argv[1:4]
rng = np.random.default_rng(1)
vids = [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(t)] for t, h, w in %r]
proc = AutoProcessor.from_pretrained(folder)
got = proc(text=[prompt], images=random_images([(60, 100)]), videos=vids, return_tensors="pt")
np.save(out + "/videos.npy", got["pixel_values_videos"].numpy())
from transformers.video_utils import VideoMetadata
rng = np.random.default_rng(3)
clip = [Image.fromarray(rng.integers(0, 256, (32, 64, 3), dtype=np.uint8)) for _ in range(32)]
timed = proc(text=["Hi" + %r], videos=[clip], video_metadata=[VideoMetadata(total_num_frames=32, fps=3.1)],
             return_tensors="pt")
np.save(out + "/timed.npy", timed["pixel_values_videos"].numpy())
json.dump({"ids": got["input_ids"][0].tolist(), "grids": got["video_grid_thw"].tolist(),
           "timed": timed["input_ids"][0].tolist()}, open(out + "/o.json", "w"))
"""


def test_processor_equals_transformers_live(release, tmp_path):
    """Where torchvision imports (a folder holding it named by ``QWEN_VL_TORCHVISION_PATH`` or
    ``LLAMA4_TORCHVISION_PATH``), transformers' own
    ``Qwen3VLProcessor`` (its video processor loaded from the folder) over a prompt of two videos and an image gives
    our prompt (frame pairs' times included), our videos' pixels and grids; and for frames of a known rate
    (``video_metadata``; ours: ``VideoFrames.fps``) the same sampled frames, times and pixels."""
    env = private_env(["QWEN_VL_TORCHVISION_PATH", "LLAMA4_TORCHVISION_PATH"], "torchvision",
                      "transformers' Qwen3VLVideoProcessor", None)
    folder, _ = release
    script = tmp_path / "reference.py"
    script.write_text(REFERENCE % (str(Path(__file__).parent), VIDEOS, PART["video"]))
    run = subprocess.run([sys.executable, str(script), str(folder), str(tmp_path), PROMPT], env=env,
                         capture_output=True, timeout=120, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    want = json.loads((tmp_path / "o.json").read_text())
    _, ids, mm = expanded(folder)
    clips = [item for item in mm.items if item.modality == "video"]
    assert [c.data["video_grid_thw"].tolist()[0] for c in clips] == want["grids"]
    assert ids == want["ids"]
    assert np.array_equal(np.concatenate([c.data["pixel_values_videos"] for c in clips]),
                          np.load(tmp_path / "videos.npy"))
    # frames of a known rate (a decoded file's VideoFrames.fps; transformers' video_metadata): 20 of 32 taken at 3.1 a
    # second, their times from that rate
    from PIL import Image
    from transformers import AutoTokenizer

    from specray.multimodal import VideoFrames

    rng = np.random.default_rng(3)
    clip = VideoFrames(Image.fromarray(rng.integers(0, 256, (32, 64, 3), dtype=np.uint8)) for _ in range(32))
    clip.fps = 3.1
    processor = Qwen3VLImageProcessor.from_pretrained(folder, read_config(str(folder)))
    ids, mm = expand_prompt(AutoTokenizer.from_pretrained(str(folder))("Hi" + PART["video"])["input_ids"], [],
                            processor, [clip])
    assert ids == want["timed"] and mm.items[0].data["video_grid_thw"].tolist() == [[10, 2, 2]]
    assert np.array_equal(mm.items[0].data["pixel_values_videos"], np.load(tmp_path / "timed.npy"))



def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


def hf_inputs(hf, ids: list[int], mm) -> dict:
    """transformers' model inputs for ``ids`` with the items' tensors (as its processor gives them)."""
    def cat(kind: str, key: str):
        arrays = [item.data[key] for item in mm.items if item.modality == kind]
        return torch.from_numpy(np.concatenate(arrays)) if arrays else None

    input_ids = torch.tensor([ids])
    types = (input_ids == hf.config.image_token_id).int() + 2 * (input_ids == hf.config.video_token_id).int()
    out = dict(input_ids=input_ids, mm_token_type_ids=types, pixel_values=cat("image", "pixel_values"),
               image_grid_thw=cat("image", "image_grid_thw"), pixel_values_videos=cat("video", "pixel_values_videos"),
               video_grid_thw=cat("video", "video_grid_thw"))
    return {k: v for k, v in out.items() if v is not None}


@torch.no_grad()
def reference(hf, ids: list[int], mm) -> torch.Tensor:
    return hf(**hf_inputs(hf, ids, mm)).logits[0]


def test_items_timestamps_and_positions(release):
    """Each video sampled to 4 frames (2 frame pairs; the 6-frame one's frames 0, 2, 3, 5 at 24 fps: pairs at 0.04 s
    and 0.17 s, written "<0.0 seconds>" and "<0.2 seconds>"), its pixels hash to what transformers' processor made
    (recorded with torchvision 0.28: the live test below), only its ``<|video_pad|>`` rows take embeddings; the
    prompt's multimodal RoPE positions and the delta past it equal transformers' ``get_rope_index``."""
    from transformers import AutoTokenizer

    folder, hf = release
    _, ids, mm = expanded(folder)
    assert [(i.modality, i.offset, i.length) for i in mm.items] == [("video", 10, 38), ("image", 56, 6),
                                                                     ("video", 67, 36)] and len(ids) == 109
    assert [i.data["video_grid_thw"].tolist() for i in mm.items if i.modality == "video"] == GRIDS
    assert [_digest(i.data["pixel_values_videos"]) for i in mm.items if i.modality == "video"] == DIGESTS
    text = AutoTokenizer.from_pretrained(str(folder)).decode(ids[mm.items[0].offset:mm.items[0].end])
    assert text == ("<0.0 seconds><|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|><0.2 seconds>"
                    "<|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>")
    video = mm.items[0]
    assert [ids[video.offset + r] for r in video.embed_rows] == [hf.config.video_token_id] * 8
    inputs = hf_inputs(hf, ids + GENERATED, mm)
    for key in ("pixel_values", "pixel_values_videos"):
        inputs.pop(key)
    positions, delta = hf.model.get_rope_index(inputs.pop("input_ids"), **inputs)
    assert torch.equal(rope_table(mm, len(ids) + len(GENERATED)), positions[:, 0])
    assert mm.rope_delta == int(delta) < 0


def test_timestamps_from_a_known_frame_rate():
    """Frames of a known rate (a decoded file's ``VideoFrames.fps``): 2 frames a second taken of them and their times
    as transformers' ``sample_frames`` and ``Qwen3VLProcessor._calculate_timestamps`` give them."""
    from transformers import Qwen3VLProcessor

    frames = q3v.Qwen3VLVideoFrames(SETTINGS, {"patch_size": 16})
    indices = frames.indices(40, 8.0)  # 5 s at 8 fps: 10 frames, evenly spaced
    assert indices.tolist() == np.linspace(0, 39, 10).round().astype(int).tolist()
    want = Qwen3VLProcessor._calculate_timestamps(None, indices, 8.0, 2)
    assert frames.timestamps(indices, 8.0) == want
    assert frames.indices(3, None).tolist() == [0, 1, 2]  # (fewer than min_frames: all of them)


def test_encoder_equals_transformers_video_features(release):
    """Each video's embeddings and DeepStack features [1 + 2, t*h*w / merge², text hidden] equal transformers'
    ``get_video_features``'s."""
    folder, hf = release
    _, _, mm = expanded(folder)
    for item, ours in zip(mm.items, encoded(folder, mm)):
        if item.modality != "video":
            continue
        with torch.no_grad():
            out = hf.model.get_video_features(torch.from_numpy(item.data["pixel_values_videos"]),
                                              torch.from_numpy(item.data["video_grid_thw"]), return_dict=True)
        theirs = torch.stack([out.pooler_output[0], *(layer[0] for layer in out.deepstack_features)])
        assert ours.shape == (3, len(item.embed_rows), 64) and max_diff(ours, theirs) < TOL


# a prefill; chunks that split both videos' spans (10-47, 67-102) and the image's (56-61), then single steps
SCHEDULES = {"prefill": None, "chunked+decode": [14, 20, 25, 30]}


LOGIT_CASES = [("qwen3_vl", "prefill"), ("qwen3_vl", "chunked+decode"), ("qwen3_vl_moe", "chunked+decode"),
               ("qwen3_5", "prefill"), ("qwen3_5", "chunked+decode"), ("qwen3_5_moe", "chunked+decode")]


@pytest.mark.parametrize("kind,schedule", LOGIT_CASES)
def test_logits_with_videos_equal_transformers(releases, kind, schedule):
    """Our text model with the videos' and the image's embeddings, DeepStack features and multimodal RoPE positions
    gives transformers' whole model's logits over the prompt and more tokens: one prefill, or chunks splitting every
    span, then single decode steps. Qwen3-VL-MoE, and Qwen3.5 / Qwen3.5-MoE (hybrid text models, no DeepStack)
    alike."""
    folder, hf = releases(kind)
    _, ids, mm = expanded(folder)
    ids = ids + GENERATED
    ours = image_logits(load_model(str(folder)), ids, mm, encoded(folder, mm), SCHEDULES[schedule])
    assert max_diff(ours, reference(hf, ids, mm)) < TOL


PARTS = ["frames at their own start", "DeepStack of videos", "timestamps' text positions"]


@pytest.mark.parametrize("part", PARTS)
def test_each_part_shows_in_the_logits(release, part):
    """Each distinctive part of a video switched off moves the logits (chunks and decode steps) away from
    transformers': each frame pair at the video's start position (its pair index instead, as Qwen2-VL's), the
    DeepStack features of the video rows (zeros), three tokens of the text between the first video's frame pairs
    (at one position)."""
    folder, hf = release
    _, ids, mm = expanded(folder)
    ids = ids + GENERATED
    embeds = encoded(folder, mm)
    if part == "frames at their own start":
        rope = rope_table(mm, len(ids))
        for item in (i for i in mm.items if i.modality == "video"):
            rows = [item.offset + r for r in item.embed_rows]
            per = len(rows) // 2
            rope[0, rows[per:]] += 1
    elif part == "DeepStack of videos":
        rope = None
        embeds = [e if i.modality == "image" else torch.cat((e[:1], torch.zeros_like(e[1:])))
                  for i, e in zip(mm.items, embeds)]
    else:
        rope = rope_table(mm, len(ids))
        item = mm.items[0]
        gap = item.offset + item.embed_rows[4] - 2  # the second pair's time text: all at one position
        rope[:, gap - 3:gap] = rope[:, gap - 4:gap - 3]
    ours = image_logits(load_model(str(folder)), ids, mm, embeds, SCHEDULES["chunked+decode"], rope=rope)
    assert max_diff(ours, reference(hf, ids, mm)) > MOVED


def test_sampling_shows_in_the_pixels(release, tmp_path):
    """Without transformers' default frame sampling (every frame taken) the videos' grids and pixels differ."""
    import shutil

    folder = tmp_path / "release"
    shutil.copytree(release[0], folder)
    (folder / "video_preprocessor_config.json").write_text(json.dumps({**SETTINGS, "do_sample_frames": False}))
    _, _, mm = expanded(folder)
    grids = [i.data["video_grid_thw"].tolist() for i in mm.items if i.modality == "video"]
    assert [g[0][0] for g in grids] == [3, 3] and grids != GRIDS


def test_refusals(release, tmp_path):
    """num_frames sampling, a video shorter than a frame pair, and another family's videos: each refused by
    name (a release's images still served)."""
    import shutil

    from PIL import Image

    folder = tmp_path / "release"
    shutil.copytree(release[0], folder)
    (folder / "video_preprocessor_config.json").write_text(json.dumps({**SETTINGS, "num_frames": 8}))
    processor = Qwen3VLImageProcessor.from_pretrained(folder, read_config(str(folder)))
    with pytest.raises(ValueError, match=r"num_frames=8 is not supported"):
        processor.process_video(videos()[0])
    assert processor.process(random_images([(60, 100)])[0]).replacement
    processor = Qwen3VLImageProcessor.from_pretrained(release[0], read_config(str(release[0])))
    with pytest.raises(ValueError, match=r"a video of 1 frames is shorter than temporal_patch_size=2"):
        processor.process_video([Image.new("RGB", (64, 64))])
    config = read_config(str(release[0]))
    config.model_type = "glm4v"  # (a family whose processor derives from this one: its videos are not served)
    assert Qwen3VLImageProcessor.from_pretrained(release[0], config).video_token_id is None


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_5"])
def test_engine_greedy_with_videos_equals_transformers(releases, kind):
    """``LLM.generate`` with two videos (a list of frames, an array [T, H, W, 3]) and an image (prefill chunks of 16
    tokens splitting the spans; n-gram drafts verified at multimodal positions past the prompt) gives transformers'
    greedy ``generate`` tokens, token for token; the videos matter (transformers without them generates others)."""
    from specray import LLM, SamplingParams

    folder, hf = releases(kind)
    steps = 16
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16,
              speculative_config=NGRAM, enforce_eager=True)
    clips = videos()
    clips[1] = np.stack([np.asarray(frame) for frame in clips[1]])
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": random_images([(60, 100)]), "video": clips}}
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True),
                       use_tqdm=False)[0]
    _, ids, mm = expanded(folder)
    greedy = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(**hf_inputs(hf, ids, mm), **greedy)[0, len(ids):].tolist()
        blind = hf.generate(torch.tensor([ids]), **greedy)[0, len(ids):].tolist()
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == want != blind
    assert llm.spec_stats.accepted_tokens > 0


def test_a_video_file_is_timed_by_its_own_frame_rate(release, tmp_path):
    """A video file (an MP4 of 41 frames at 4 a second: 32 frames taken evenly over it, 3.1 a second) is sampled at 2
    frames a second of its own rate (20 of the 32) and its pairs' times are written from that rate, not transformers'
    default for bare frames; ``LLM.generate`` with the file's path gives transformers' greedy tokens for those
    inputs."""
    from transformers import AutoTokenizer

    from specray import LLM, SamplingParams
    from specray.multimodal import load_video
    from tests.test_multimodal import _mp4

    folder, hf = release
    path = tmp_path / "clip.mp4"
    path.write_bytes(_mp4(41, size=(64, 32)))
    frames = load_video(str(path))
    assert len(frames) == 32 and frames.fps == pytest.approx(3.1)
    text = "Hello world!" + PART["video"] + " The fox."
    processor = Qwen3VLImageProcessor.from_pretrained(folder, read_config(str(folder)))
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids, mm = expand_prompt(tok(text)["input_ids"], [], processor, [frames])
    taken = np.linspace(0, 31, 20).round().astype(int)
    assert mm.items[0].data["video_grid_thw"].tolist()[0][0] == 10
    assert f"<{(taken[2] + taken[3]) / 2 / 3.1:.1f} seconds>" in tok.decode(ids)
    llm = LLM(model=str(folder), max_model_len=512, block_size=4, max_num_batched_tokens=64, enforce_eager=True)
    out = llm.generate([{"prompt": text, "multi_modal_data": {"video": str(path)}}],
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    greedy = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(**hf_inputs(hf, ids, mm), **greedy)[0, len(ids):].tolist()
    assert out.prompt_token_ids == ids and list(out.outputs[0].token_ids) == want


def test_ranks_equal_one_rank(releases, tmp_path):
    """Two tensor-parallel ranks (the text model split, the tower whole on each) give one rank's logits with the
    videos and the image, Qwen3-VL and Qwen3.5: chunks splitting every span, then decode steps."""
    from specray_test_image_checks import assert_ranks_equal_one_rank  # tests/image_checks.py

    runs = []
    for kind in ("qwen3_vl", "qwen3_5"):
        folder, _ = releases(kind)
        _, ids, mm = expanded(folder)
        runs.append((folder, ids + GENERATED, mm, SCHEDULES["chunked+decode"]))
    assert_ranks_equal_one_rank(tmp_path, runs, 1, TOL)
