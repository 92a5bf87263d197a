"""LLaVA-OneVision's videos (:mod:`specray.models.llava_onevision_video`, served by ``llava_onevision``'s processor and
encoder) against transformers' whole ``LlavaOnevisionForConditionalGeneration`` on tiny random fp32 weights: a SigLIP
tower of 35-pixel tiles and 7-pixel patches (5 x 5 features a frame: pooled bilinearly to 3 x 3, a resampling that is
not a plain 2 x 2 average) before a Qwen2. Each video's pixels equal transformers' ``LlavaOnevisionVideoProcessor``'s
(a torchvision-only processor: compared live where torchvision imports, always against digests recorded with
torchvision 0.28) for a video resized down and one resized up; the expanded prompt (two videos and an image) equals
``LlavaOnevisionProcessor``'s; each video's embeddings equal ``get_video_features``; the text model fed them gives the
whole model's logits over a prefill and over chunks splitting the videos' spans; two tensor-parallel ranks equal one;
``LLM.generate`` with ``{"video": frames}`` (and an image beside them; n-gram drafts) equals ``generate``. Each
distinctive part broken once shows; what is not served is refused by name."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models import llava_onevision_video as ovv
from specray.multimodal import expand_prompt
from specray_test_image_checks import (private_env, assert_ranks_equal_one_rank, encode_items, image_logits,
                                       random_images)
from specray_test_model_checks import max_diff

TOL, MOVED = 1e-4, 1e-2
TILE, PATCH = 35, 7  # 5 x 5 features a tile, 3 x 3 a pooled frame
PINPOINTS = [[35, 35], [35, 70], [70, 35], [70, 70], [35, 105], [105, 35]]
ASPECT = "anyres_max_2"
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, rms_norm_eps=1e-5)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=TILE,
              patch_size=PATCH, layer_norm_eps=1e-5)
VIDEO_SETTINGS = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                  "do_sample_frames": False, "image_mean": ovv.CLIP_MEAN, "image_std": ovv.CLIP_STD, "resample": 3,
                  "rescale_factor": 1 / 255, "size": {"height": TILE, "width": TILE},
                  "video_processor_type": "LlavaOnevisionVideoProcessor"}
# (frames, height, width): resized down, resized up (transformers batches videos of one frame count), kept as it is
VIDEOS = [(3, 50, 60), (3, 20, 30), (2, 35, 35)]
IMAGE_SIZES = [(30, 80)]
# sha256 of each video's pixel_values_videos (float32 bytes) as transformers' LlavaOnevisionVideoProcessor made them
# (torchvision 0.28, CPU)
DIGESTS = ["0747cac20bfdec56aa0cc0047a4f37eaf70b942c58ff5b2985d1fdf617678f56",
           "eb24559cf1436013a347c925f62456b7ede01bf720051219400d66495bb4466e",
           "954de43762b59b2c843aceaeffb6bae9f9c5e65e94c20c5b6c1b4d22de97c372"]
PROMPT = "Look at <video> and <image> then <video>, the quick brown fox jumps"
VIDEO_PROMPT = "Look at <video> then <video>, the quick brown fox jumps"
GENERATED = [17, 42, 99, 75, 30, 61, 28, 50]  # tokens past the prompt (decode steps)


def videos(shapes=VIDEOS) -> list[list]:
    """Videos (lists of RGB PIL frames) of ``shapes``' sizes, seed 1."""
    from PIL import Image

    rng = np.random.default_rng(1)
    return [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(t)]
            for t, h, w in shapes]


def build(path: Path, seed: int = 0) -> tuple[Path, object]:
    """transformers' LlavaOnevisionForConditionalGeneration saved with the tiny tokenizer, OneVision's PIL image
    processor and the video processor's settings (written here: transformers' video processor needs torchvision)."""
    from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, Qwen2Config,
                              SiglipVisionConfig)
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=("<image>", "<video>"))
    text = Qwen2Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       bos_token_id=None, **TEXT)
    config = LlavaOnevisionConfig(text_config=text, vision_config=SiglipVisionConfig(**VISION),
                                  image_grid_pinpoints=PINPOINTS, vision_feature_layer=-1,
                                  vision_feature_select_strategy="full", vision_aspect_ratio=ASPECT,
                                  image_token_index=tok.convert_tokens_to_ids("<image>"),
                                  video_token_index=tok.convert_tokens_to_ids("<video>"))
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "multi_modal_projector" in name and name.endswith(".weight"):
                p.normal_(0.0, p.shape[1] ** -0.5)
            elif "norm" in name and name.endswith(".weight") and p.dim() == 1:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("patch_embedding.bias", "image_newline")):
                p.normal_(0.0, 1.0)
            elif name.endswith("embed_tokens.weight"):  # (greedy tokens then follow both the text and the videos)
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    LlavaOnevisionImageProcessorPil(size={"height": TILE, "width": TILE},
                                    image_grid_pinpoints=PINPOINTS).save_pretrained(path)
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_SETTINGS, indent=2))
    return path, model


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, object]:
    return build(tmp_path_factory.mktemp("tiny_onevision_video") / "m", seed=3)  # (its greedy tokens follow the videos)


def ours(folder: Path, config=None):
    """Our encoder and processor of ``folder`` (as the engine builds them)."""
    from specray.models.loader import load_image_encoder, load_image_processor, read_config

    config = config or read_config(str(folder))
    return load_image_encoder(str(folder), config, torch.float32, "cpu"), load_image_processor(str(folder), config)


def expanded(folder: Path, text: str = PROMPT, clips=None, pictures=None, processor=None):
    from transformers import AutoTokenizer

    processor = processor or ours(folder)[1]
    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text),
                         random_images(IMAGE_SIZES) if pictures is None else pictures, processor,
                         videos(VIDEOS[:2]) if clips is None else clips)


def hf_processor(folder: Path, pixels: list[np.ndarray] | None = None):
    """transformers' LlavaOnevisionProcessor, its video processor a stand-in handing back ``pixels`` (ours: its own
    needs torchvision; the live test below runs it), so its expansion of ``<video>`` is what is compared."""
    from transformers import AutoImageProcessor, AutoTokenizer, BatchFeature, LlavaOnevisionProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: (
        None if name == "video_processor" else check(self, name, arg))
    try:
        processor = LlavaOnevisionProcessor(
            image_processor=AutoImageProcessor.from_pretrained(folder), video_processor=None,
            tokenizer=AutoTokenizer.from_pretrained(folder), num_image_tokens=(TILE // PATCH) ** 2,
            vision_feature_select_strategy="full", vision_aspect_ratio=ASPECT)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check
    processor.video_processor = lambda videos, **kw: BatchFeature(
        {"pixel_values_videos": torch.from_numpy(np.stack(pixels))})
    return processor


def hf_inputs(mm, ids: list[int]) -> dict:
    """transformers' model inputs for ``ids`` with the items' tensors (as its processor batches them)."""
    out = {"input_ids": torch.tensor([ids])}
    pictures = [item.data for item in mm.items if item.modality == "image"]
    clips = [item.data[ovv.VIDEO_KEY] for item in mm.items if item.modality == "video"]
    if pictures:
        most = max(d["pixel_values"].shape[0] for d in pictures)
        out["pixel_values"] = torch.stack([torch.nn.functional.pad(torch.from_numpy(d["pixel_values"]),
                                                                   (0, 0, 0, 0, 0, 0, 0, most - len(d["pixel_values"])))
                                           for d in pictures])
        out["image_sizes"] = torch.from_numpy(np.stack([d["image_sizes"] for d in pictures]))
    if clips:
        out["pixel_values_videos"] = torch.from_numpy(np.stack(clips))
    return out


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


# ---- the processor ---------------------------------------------------------------------------------------------------

def test_expansion_equals_transformers_processor(release):
    """Our prompt with two videos and an image equals LlavaOnevisionProcessor's (each ``<video>`` expanded to 3
    frames x 3 x 3 pooled features + a newline = 28 copies; the image as OneVision's images); the videos' pixels are
    [3, 3, 35, 35] and their items hold them alone."""
    folder, _ = release
    ids, mm = expanded(folder)
    assert [item.modality for item in mm.items] == ["video", "image", "video"]
    clips = [item for item in mm.items if item.modality == "video"]
    assert [item.length for item in clips] == [28, 28]
    assert all(set(item.data) == {ovv.VIDEO_KEY} and item.data[ovv.VIDEO_KEY].shape == (3, 3, TILE, TILE)
               for item in clips)
    theirs = hf_processor(folder, [item.data[ovv.VIDEO_KEY] for item in clips])
    want = theirs(text=[PROMPT], images=random_images(IMAGE_SIZES), videos=videos(VIDEOS[:2]), return_tensors="pt")
    assert ids == want["input_ids"][0].tolist()
    assert np.array_equal(mm.items[1].data["pixel_values"], want["pixel_values"][0].numpy())


def test_pixels_equal_recorded_transformers_digests(release):
    """Each video's pixels (one resized down, one up, one kept) hash to what transformers' video processor made of
    it (recorded with torchvision: see the live test below)."""
    _, processor = ours(release[0])
    assert [_digest(processor.process_video(clip).data[ovv.VIDEO_KEY]) for clip in videos()] == DIGESTS


REFERENCE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, AutoVideoProcessor, LlavaOnevisionProcessor
    folder, out, text = sys.argv[1:4]
    rng = np.random.default_rng(1)
    videos = [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(t)] for t, h, w in %r]
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (*s, 3), dtype=np.uint8)) for s in %r]
    video_processor = AutoVideoProcessor.from_pretrained(folder)
    processor = LlavaOnevisionProcessor(image_processor=AutoImageProcessor.from_pretrained(folder),
        tokenizer=AutoTokenizer.from_pretrained(folder), video_processor=video_processor, num_image_tokens=%d,
        vision_feature_select_strategy="full", vision_aspect_ratio=%r)
    got = processor(text=[text], images=images, videos=videos[:2], return_tensors="pt")
    np.save(out + "/videos.npy", got["pixel_values_videos"].numpy())
    np.save(out + "/kept.npy", video_processor(videos=videos[2:], return_tensors="pt")["pixel_values_videos"].numpy())
    json.dump({"ids": got["input_ids"][0].tolist(), "type": type(video_processor).__name__}, open(out + "/o.json", "w"))
""" % (VIDEOS, IMAGE_SIZES, (TILE // PATCH) ** 2, ASPECT))
TORCHVISION_PATHS = ("QWEN_VL_TORCHVISION_PATH", "LLAMA4_TORCHVISION_PATH")


def test_processor_equals_transformers_live(release, tmp_path):
    """Where torchvision imports (``QWEN_VL_TORCHVISION_PATH`` or ``LLAMA4_TORCHVISION_PATH`` may name a folder
    holding it), transformers' own processor (its LlavaOnevisionVideoProcessor loaded from the folder) over the
    prompt of two videos and an image gives our prompt and our videos' pixels, and a video of the tile's size is kept
    as ours is."""
    env = private_env(TORCHVISION_PATHS, "torchvision", "transformers' LlavaOnevisionVideoProcessor")
    folder, _ = release
    script = tmp_path / "reference.py"
    script.write_text(REFERENCE)
    subprocess.run([sys.executable, str(script), str(folder), str(tmp_path), PROMPT], env=env, check=True,
                   capture_output=True, timeout=120)
    want = json.loads((tmp_path / "o.json").read_text())
    assert want["type"] == "LlavaOnevisionVideoProcessor"
    ids, mm = expanded(folder)
    assert ids == want["ids"]
    clips = [item.data[ovv.VIDEO_KEY] for item in mm.items if item.modality == "video"]
    assert np.array_equal(np.stack(clips), np.load(tmp_path / "videos.npy"))
    kept = ours(folder)[1].process_video(videos()[2]).data[ovv.VIDEO_KEY]
    assert np.array_equal(kept[None], np.load(tmp_path / "kept.npy"))


# ---- the encoder and the whole model ---------------------------------------------------------------------------------

def hf_video_features(hf, pixels: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return hf.model.get_video_features(torch.from_numpy(pixels)[None], vision_feature_layer=-1,
                                           vision_feature_select_strategy="full").pooler_output[0]


def test_encoder_equals_transformers_video_features(release):
    """Each video's embeddings [frames * 9 + 1, text hidden] equal transformers' ``get_video_features`` (the frames'
    pooled features, the newline last); an image's are still OneVision's (its own path)."""
    folder, hf = release
    _, mm = expanded(folder)
    encoder = ours(folder)[0]
    for item, got in zip(mm.items, encode_items(encoder, mm), strict=True):
        if item.modality == "video":
            want = hf_video_features(hf, item.data[ovv.VIDEO_KEY])
        else:
            with torch.no_grad():
                want = hf.model.get_image_features(torch.from_numpy(item.data["pixel_values"])[None],
                                                   torch.from_numpy(item.data["image_sizes"])[None]).pooler_output[0]
        assert got.shape == want.shape == (item.length, TEXT["hidden_size"])
        assert max_diff(got, want) < TOL


# a prefill; chunks of 11 tokens splitting both videos' spans, then single steps
SCHEDULES = {"prefill": None, "chunked+decode": [11] * 8}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("kinds", ["videos", "videos+image"])
def test_logits_with_videos_equal_transformers(release, schedule, kinds):
    """Our text model with the videos' (and the image's) embeddings in place of the placeholders gives transformers'
    whole model's logits (``pixel_values_videos``, ``pixel_values``, ``image_sizes``) over the prompt and tokens past
    it: one prefill, or chunks splitting both videos' spans and single decode steps; without the videos' rows the
    logits differ."""
    from specray.models.loader import load_model

    folder, hf = release
    text = PROMPT if kinds == "videos+image" else VIDEO_PROMPT
    ids, mm = expanded(folder, text, pictures=[] if kinds == "videos" else None)
    spans = [(item.offset, item.end) for item in mm.items if item.modality == "video"]
    assert all(start // 11 != (end - 1) // 11 for start, end in spans)  # (each video's span split over chunks)
    ids = ids + GENERATED
    embeds = encode_items(ours(folder)[0], mm)
    model = load_model(str(folder))
    got = image_logits(model, ids, mm, embeds, SCHEDULES[schedule])
    with torch.no_grad():
        want = hf(**hf_inputs(mm, ids)).logits[0]
    assert max_diff(got, want) < TOL
    blind = [e * 0 if item.modality == "video" else e for item, e in zip(mm.items, embeds)]
    assert max_diff(image_logits(model, ids, mm, blind, None), want) > MOVED


# ---- each part shows -------------------------------------------------------------------------------------------------

def _interpolate(**forced):
    original = torch.nn.functional.interpolate
    return lambda x, size, mode, align_corners: original(x, size=size, **{"mode": mode, **forced})


def _average(x, size, mode, align_corners):  # a plain 2 x 2 average (ceil mode), not the bilinear resampling
    return torch.nn.functional.avg_pool2d(x, 2, ceil_mode=True, count_include_pad=False)


ENCODE = ovv.encode_video
MUTATIONS = {  # a part of the video's layout done otherwise: (what is patched, its stand-in)
    "nearest": ("F.interpolate", _interpolate(mode="nearest")),
    "corners-aligned": ("F.interpolate", _interpolate(align_corners=True)),
    "average-pooling": ("F.interpolate", _average),
    "pooled-before-projector": ("encode_video", lambda enc, px: torch.cat([
        enc.project(ovv.pool(enc.features(px), enc.side)).reshape(-1, enc.image_newline.shape[0]),
        enc.image_newline[None]])),
    "newline-first": ("encode_video", lambda enc, px: (lambda e: torch.cat([e[-1:], e[:-1]]))(
        ENCODE(enc, px))),
    "frames-reversed": ("encode_video", lambda enc, px: ENCODE(enc, px.flip(0))),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_embeddings(release, mutation, monkeypatch):
    """Each part of a video's embeddings done otherwise (the pooling's mode, corner alignment or a plain average, the
    pooling after the projector, the newline last, the frames' order) moves them away from ``get_video_features``."""
    folder, hf = release
    _, mm = expanded(folder, VIDEO_PROMPT, pictures=[])
    target, stand_in = MUTATIONS[mutation]
    if target == "F.interpolate":
        monkeypatch.setattr(ovv, "F", type("F", (), {"interpolate": staticmethod(stand_in)}))
    else:
        monkeypatch.setattr(ovv, target, stand_in)
    encoder = ours(folder)[0]
    for item, got in zip(mm.items, encode_items(encoder, mm), strict=True):
        want = hf_video_features(hf, item.data[ovv.VIDEO_KEY])
        assert got.shape != want.shape or max_diff(got, want) > MOVED


PIXEL_MUTATIONS = {  # a step of the frames' processing done otherwise -> the video it shows in
    "no-antialias": ("interpolate", 0),
    "image-mean": ("settings", 0),
}


@pytest.mark.parametrize("mutation", sorted(PIXEL_MUTATIONS))
def test_each_pixel_step_shows(release, mutation, monkeypatch):
    """The frames resized without antialiasing, or normalized with the SigLIP images' mean and std (0.5) instead of
    the video processor's, no longer give transformers' pixels (their digests)."""
    folder, _ = release
    _, processor = ours(folder)
    if mutation == "no-antialias":
        original = ovv.F.interpolate
        monkeypatch.setattr(ovv, "F", type("F", (), {"interpolate": staticmethod(
            lambda x, **kw: original(x, **{**kw, "antialias": False}))}))
    else:
        processor.video = ovv.OnevisionVideoFrames({**VIDEO_SETTINGS, "image_mean": [0.5] * 3,
                                                   "image_std": [0.5] * 3}, TILE)
    got = [_digest(processor.process_video(clip).data[ovv.VIDEO_KEY]) for clip in videos()]
    assert got[0] != DIGESTS[0] and got[1] != DIGESTS[1]


# ---- tensor parallel and the engine ----------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(release, tmp_path):
    """The text model split over two tensor-parallel ranks (the encoder replicated on each) gives one rank's logits
    with the videos' and the image's rows in place, chunks splitting the videos' spans, then decode steps."""
    folder, _ = release
    ids, mm = expanded(folder)
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids + GENERATED, mm, SCHEDULES["chunked+decode"])], 1, TOL)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def test_engine_greedy_with_videos_equals_transformers(release):
    """``LLM.generate`` with two videos (a list of frames, an array [T, H, W, 3]) and an image (prefill chunks of 16
    tokens splitting the videos' spans; n-gram drafts) gives transformers' greedy ``generate`` tokens beside a
    text-only prompt; some drafts accepted; the videos matter (transformers without them generates others)."""
    from specray import LLM, SamplingParams

    folder, hf = release
    steps = 24
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16,
              speculative_config=NGRAM)
    clips = videos(VIDEOS[:2])
    clips[1] = np.stack([np.asarray(frame) for frame in clips[1]])  # (a video as an array of uint8)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": random_images(IMAGE_SIZES), "video": clips}}
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    outs = llm.generate([prompt, "The quick brown fox"], params, use_tqdm=False)
    ids, mm = expanded(folder)
    greedy = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(**hf_inputs(mm, ids), **greedy)[0, len(ids):].tolist()
        plain = llm.get_tokenizer().encode("The quick brown fox")
        plain_want = hf.generate(torch.tensor([plain]), **greedy)[0, len(plain):].tolist()
        no_videos = {k: v for k, v in hf_inputs(mm, ids).items() if k != "pixel_values_videos"}
        no_videos["input_ids"] = torch.where(no_videos["input_ids"] == hf.config.video_token_index, 0,
                                             no_videos["input_ids"])
        blind = hf.generate(**no_videos, **greedy)[0, len(ids):].tolist()
    assert outs[0].prompt_token_ids == ids
    assert list(outs[0].outputs[0].token_ids) == want != blind
    assert list(outs[1].outputs[0].token_ids) == plain_want
    assert llm.spec_stats.accepted_tokens > 0


# ---- refusals --------------------------------------------------------------------------------------------------------

REFUSED = {  # a change of the video processor's settings -> what the ValueError says
    "sampling": ({"do_sample_frames": True}, r"do_sample_frames=True is not supported"),
    "crop": ({"do_center_crop": True}, r"do_center_crop=True is not supported"),
    "resample": ({"resample": 2}, r"resample=2 is not supported: only bicubic"),
    "no normalize": ({"do_normalize": False}, r"do_normalize=False is not supported"),
    "size": ({"size": {"height": 70, "width": 70}}, r"size=\{'height': 70, 'width': 70\} is not supported"),
    "shortest edge": ({"size": {"shortest_edge": 35}}, r"size=\{'shortest_edge': 35\} is not supported"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_video_settings_are_refused(release, case, tmp_path):
    """A video processor setting not served refuses the release's videos by name; its images are still served."""
    folder = shutil.copytree(release[0], tmp_path / "m")
    change, message = REFUSED[case]
    (folder / "video_preprocessor_config.json").write_text(json.dumps({**VIDEO_SETTINGS, **change}))
    _, mm = expanded(folder, "A <image>", clips=[])
    assert [item.modality for item in mm.items] == ["image"]
    with pytest.raises(ValueError, match=message):
        expanded(folder)


def test_mismatches_are_refused(release):
    """Videos for a config without ``video_token_index``, frames of two sizes, frames of another size than the tile
    handed to the encoder, and a prompt whose ``<video>`` placeholders and videos differ in number: each a
    ValueError by name."""
    from PIL import Image

    from specray.models.loader import read_config

    folder, _ = release
    config = read_config(str(folder))
    config.video_token_index = None
    encoder, processor = ours(folder, config)
    assert processor.video_token_id is None
    with pytest.raises(ValueError, match=r"takes no videos \(only images\)"):
        expanded(folder, "A <image>", clips=videos()[:1], processor=processor)
    _, processor = ours(folder)
    with pytest.raises(ValueError, match=r"frames must share one size"):
        processor.process_video([Image.new("RGB", (35, 35)), Image.new("RGB", (70, 35))])
    with pytest.raises(ValueError, match=r"pixel_values_videos of shape \(2, 3, 28, 28\)"):
        encoder.encode({ovv.VIDEO_KEY: torch.zeros(2, 3, 28, 28)})
    with pytest.raises(ValueError, match=r"holds 2 video placeholder token\(s\) .* but 1 video\(s\) were given"):
        expanded(folder, clips=videos()[:1])
