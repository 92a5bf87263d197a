"""LLaVA-NeXT-Video (``LlavaNextVideoForConditionalGeneration``, :mod:`specray.models.llava_next_video`) against
transformers on tiny random fp32 weights: a CLIP tower of 28-pixel tiles and 7-pixel patches (class token dropped:
4 x 4 features a frame, pooled 2 x 2 before the projector) before a Llama, LLaVA-NeXT's image tiling beside. Each
video's pixels equal transformers' ``LlavaNextVideoVideoProcessor``'s (torchvision-only: compared live where
torchvision imports, always against digests recorded with torchvision 0.28): shorter side resized (down, up), centre
crop, and a shorter side under the tile (zero-padded crop); the expanded prompt (two videos and an image) equals
``LlavaNextVideoProcessor``'s; each video's embeddings equal ``get_video_features`` (average pooling, and max); the
text model fed them gives the whole model's logits over a prefill and over chunks splitting the videos' spans; two
tensor-parallel ranks equal one; ``LLM.generate`` with videos and an image (n-gram drafts) equals ``generate``; each
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

from specray.models import llava_next_video as nv
from specray.models import llava_onevision_video as ovv
from specray.multimodal import expand_prompt
from specray_test_image_checks import (private_env, assert_ranks_equal_one_rank, config_with, encode_items,
                                       image_logits, random_images)
from specray_test_model_checks import max_diff

TOL, MOVED = 1e-4, 1e-2
TILE, PATCH = 28, 7
PINPOINTS = [[28, 56], [56, 28], [56, 56]]
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, rms_norm_eps=1e-5)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=TILE,
              patch_size=PATCH, layer_norm_eps=1e-5)
VIDEO_SETTINGS = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                  "do_center_crop": True, "do_sample_frames": False, "image_mean": ovv.CLIP_MEAN,
                  "image_std": ovv.CLIP_STD, "resample": 3, "rescale_factor": 1 / 255,
                  "size": {"shortest_edge": TILE}, "crop_size": {"height": TILE, "width": TILE},
                  "video_processor_type": "LlavaNextVideoVideoProcessor"}
PROCESSOR = {"patch_size": PATCH, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1,
             "processor_class": "LlavaNextVideoProcessor"}
# (frames, height, width): shorter side resized down (28 x 42, cropped), up (37 x 28, cropped); 4 frames each: 16 tokens
VIDEOS = [(4, 40, 60), (4, 27, 20)]
PADDED = 20  # a shorter side resized to 20 (under the tile): the crop pads it with zeros
IMAGE_SIZES = [(30, 50)]
# sha256 of each video's pixel_values_videos (float32 bytes) as transformers' LlavaNextVideoVideoProcessor made them
# (torchvision 0.28, CPU), and of the first video's with shortest_edge PADDED
DIGESTS = ["16ee0e8799a6a9e148c50c0c6276d6b2d70443046d72b46392f779dcb3682539",
           "f71463f93605a44841f5fda2caa05deb08bf73911956b17a898a1e230261064b",
           "8d9a210d4ace0ed96e3598ab5d2fb630e8f572a75e5eb570e02e7aa70db68b5c"]
PROMPT = "Look at <video> and <image> then <video>, the quick brown fox jumps"
VIDEO_PROMPT = "Look at <video> then <video>, the quick brown fox jumps"
GENERATED = [17, 42, 99, 75, 30, 61, 28, 50]


def videos() -> list[list]:
    from PIL import Image

    rng = np.random.default_rng(1)
    return [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(t)]
            for t, h, w in VIDEOS]


def build(path: Path, seed: int = 0) -> tuple[Path, object]:
    """transformers' LlavaNextVideoForConditionalGeneration saved with the tiny tokenizer, LLaVA-NeXT's PIL image
    processor, the processor's and the video processor's settings (written here: both need torchvision to be
    saved)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextVideoConfig, LlavaNextVideoForConditionalGeneration
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=("<image>", "<video>"))
    text = LlamaConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       bos_token_id=None, **TEXT)
    config = LlavaNextVideoConfig(text_config=text, vision_config=CLIPVisionConfig(**VISION),
                                  image_grid_pinpoints=PINPOINTS, vision_feature_layer=-2,
                                  vision_feature_select_strategy="default",
                                  image_token_index=tok.convert_tokens_to_ids("<image>"),
                                  video_token_index=tok.convert_tokens_to_ids("<video>"))
    torch.manual_seed(seed)
    model = LlavaNextVideoForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "multi_modal_projector" in name and name.endswith(".weight"):
                p.normal_(0.0, p.shape[1] ** -0.5)
            elif "norm" in name and name.endswith(".weight") and p.dim() == 1:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("class_embedding", "patch_embedding.bias", "image_newline")):
                p.normal_(0.0, 1.0)
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    LlavaNextImageProcessorPil(size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE},
                               image_grid_pinpoints=PINPOINTS).save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps(PROCESSOR, indent=2))
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_SETTINGS, indent=2))
    return path, model


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, object]:
    return build(tmp_path_factory.mktemp("tiny_llava_next_video") / "m")


def ours(folder: Path, config=None):
    from specray.models.loader import load_image_encoder, load_image_processor, read_config

    config = config or read_config(str(folder))
    return load_image_encoder(str(folder), config, torch.float32, "cpu"), load_image_processor(str(folder), config)


def expanded(folder: Path, text: str = PROMPT, clips=None, pictures=None, processor=None):
    from transformers import AutoTokenizer

    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text),
                         random_images(IMAGE_SIZES) if pictures is None else pictures,
                         processor or ours(folder)[1], videos() if clips is None else clips)


def hf_inputs(mm, ids: list[int]) -> dict:
    out = {"input_ids": torch.tensor([ids])}
    pictures = [item.data for item in mm.items if item.modality == "image"]
    clips = [item.data[ovv.VIDEO_KEY] for item in mm.items if item.modality == "video"]
    if pictures:
        out["pixel_values"] = torch.from_numpy(np.stack([d["pixel_values"] for d in pictures]))
        out["image_sizes"] = torch.from_numpy(np.stack([d["image_sizes"] for d in pictures]))
    if clips:
        out["pixel_values_videos"] = torch.from_numpy(np.stack(clips))
    return out


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


def _padded(processor):
    return nv.LlavaNextVideoFrames({**VIDEO_SETTINGS, "size": {"shortest_edge": PADDED}}, TILE)


# ---- the processor ---------------------------------------------------------------------------------------------------

def test_expansion_equals_transformers_processor(release):
    """Our prompt with two videos and an image equals LlavaNextVideoProcessor's (its video processor a stand-in
    handing back our pixels: each ``<video>`` 4 frames x 2 x 2 = 16 copies); the image's tiles equal its."""
    from transformers import AutoImageProcessor, AutoTokenizer, BatchFeature, LlavaNextVideoProcessor
    from transformers.processing_utils import ProcessorMixin

    folder, _ = release
    ids, mm = expanded(folder)
    clips = [item for item in mm.items if item.modality == "video"]
    assert [item.modality for item in mm.items] == ["video", "image", "video"]
    assert [item.length for item in clips] == [16, 16]
    assert all(item.data[ovv.VIDEO_KEY].shape == (4, 3, TILE, TILE) for item in clips)
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: (
        None if name == "video_processor" else check(self, name, arg))
    try:
        theirs = LlavaNextVideoProcessor(video_processor=None, image_processor=AutoImageProcessor.from_pretrained(
            folder), tokenizer=AutoTokenizer.from_pretrained(folder), patch_size=PATCH,
            vision_feature_select_strategy="default", num_additional_image_tokens=1)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check
    theirs.video_processor = lambda videos, **kw: BatchFeature(
        {"pixel_values_videos": torch.from_numpy(np.stack([item.data[ovv.VIDEO_KEY] for item in clips]))})
    want = theirs(text=[PROMPT], images=random_images(IMAGE_SIZES), videos=videos(), return_tensors="pt")
    assert ids == want["input_ids"][0].tolist()
    assert np.array_equal(mm.items[1].data["pixel_values"], want["pixel_values"][0].numpy())


def test_pixels_equal_recorded_transformers_digests(release):
    """Each video's pixels, and the first's with a shorter side under the tile, hash to what transformers' video
    processor made of them (recorded with torchvision: see the live test below)."""
    _, processor = ours(release[0])
    got = [_digest(processor.process_video(clip).data[ovv.VIDEO_KEY]) for clip in videos()]
    assert got + [_digest(_padded(processor).pixels(videos()[0]))] == DIGESTS


REFERENCE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, AutoVideoProcessor, LlavaNextVideoProcessor
    folder, out, text = sys.argv[1:4]
    rng = np.random.default_rng(1)
    videos = [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(t)] for t, h, w in %r]
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (*s, 3), dtype=np.uint8)) for s in %r]
    video_processor = AutoVideoProcessor.from_pretrained(folder)
    processor = LlavaNextVideoProcessor(video_processor=video_processor,
        image_processor=AutoImageProcessor.from_pretrained(folder), tokenizer=AutoTokenizer.from_pretrained(folder),
        patch_size=%d, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    got = processor(text=[text], images=images, videos=videos, return_tensors="pt")
    np.save(out + "/videos.npy", got["pixel_values_videos"].numpy())
    padded = AutoVideoProcessor.from_pretrained(folder, size={"shortest_edge": %d})
    np.save(out + "/padded.npy", padded(videos=videos[:1], return_tensors="pt")["pixel_values_videos"].numpy())
    json.dump({"ids": got["input_ids"][0].tolist(), "type": type(video_processor).__name__}, open(out + "/o.json", "w"))
""" % (VIDEOS, IMAGE_SIZES, PATCH, PADDED))
TORCHVISION_PATHS = ("QWEN_VL_TORCHVISION_PATH", "LLAMA4_TORCHVISION_PATH")


def test_processor_equals_transformers_live(release, tmp_path):
    """Where torchvision imports (``QWEN_VL_TORCHVISION_PATH`` or ``LLAMA4_TORCHVISION_PATH`` may name a folder
    holding it), transformers' own processor (its LlavaNextVideoVideoProcessor loaded from the folder) gives our
    prompt and our videos' pixels, and with a shorter side under the tile our padded crop."""
    env = private_env(TORCHVISION_PATHS, "torchvision", "transformers' LlavaNextVideoVideoProcessor")
    folder, _ = release
    script = tmp_path / "reference.py"
    script.write_text(REFERENCE)
    subprocess.run([sys.executable, str(script), str(folder), str(tmp_path), PROMPT], env=env, check=True,
                   capture_output=True, timeout=120)
    want = json.loads((tmp_path / "o.json").read_text())
    assert want["type"] == "LlavaNextVideoVideoProcessor"
    ids, mm = expanded(folder)
    assert ids == want["ids"]
    clips = [item.data[ovv.VIDEO_KEY] for item in mm.items if item.modality == "video"]
    assert np.array_equal(np.stack(clips), np.load(tmp_path / "videos.npy"))
    padded = _padded(ours(folder)[1]).pixels(videos()[0])
    assert np.array_equal(padded[None], np.load(tmp_path / "padded.npy"))


# ---- the encoder and the whole model ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["average", "max"])
def test_encoder_equals_transformers_video_features(release, mode):
    """Each video's embeddings [frames * 4, text hidden] equal transformers' ``get_video_features`` (its pooler
    averaging, or taking the max); the image's are still LLaVA-NeXT's."""
    folder, hf = release
    _, mm = expanded(folder)
    hf.model.vision_resampler.pool = torch.nn.MaxPool2d(2, 2) if mode == "max" else torch.nn.AvgPool2d(2, 2)
    encoder = ours(folder, config_with(folder, spatial_pool_mode=mode))[0]
    try:
        _compare_features(hf, mm, encoder)
    finally:
        hf.model.vision_resampler.pool = torch.nn.AvgPool2d(2, 2)


def _compare_features(hf, mm, encoder) -> None:
    for item, got in zip(mm.items, encode_items(encoder, mm), strict=True):
        with torch.no_grad():
            if item.modality == "video":
                want = hf.model.get_video_features(torch.from_numpy(item.data[ovv.VIDEO_KEY])[None],
                                                   vision_feature_layer=-2,
                                                   vision_feature_select_strategy="default").pooler_output[0]
            else:
                want = hf.model.get_image_features(torch.from_numpy(item.data["pixel_values"])[None],
                                                   torch.from_numpy(item.data["image_sizes"])[None],
                                                   vision_feature_layer=-2,
                                                   vision_feature_select_strategy="default").pooler_output[0]
        assert got.shape == want.shape == (item.length, TEXT["hidden_size"])
        assert max_diff(got, want) < TOL


SCHEDULES = {"prefill": None, "chunked+decode": [7] * 9}  # chunks of 7 split both videos' spans


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("kinds", ["videos", "videos+image"])
def test_logits_with_videos_equal_transformers(release, schedule, kinds):
    """Our text model (Llama, through _TEXT_PARTS) with the videos' (and the image's) rows gives transformers' whole
    model's logits: one prefill, or chunks splitting both videos' spans then decode steps; without the videos' rows
    they differ."""
    from specray.models.loader import load_model

    folder, hf = release
    text = PROMPT if kinds == "videos+image" else VIDEO_PROMPT
    ids, mm = expanded(folder, text, pictures=[] if kinds == "videos" else None)
    spans = [(item.offset, item.end) for item in mm.items if item.modality == "video"]
    assert all(start // 7 != (end - 1) // 7 for start, end in spans)
    ids = ids + GENERATED
    embeds = encode_items(ours(folder)[0], mm)
    model = load_model(str(folder))
    with torch.no_grad():
        want = hf(**hf_inputs(mm, ids)).logits[0]
    assert max_diff(image_logits(model, ids, mm, embeds, SCHEDULES[schedule]), want) < TOL
    blind = [e * 0 if item.modality == "video" else e for item, e in zip(mm.items, embeds)]
    assert max_diff(image_logits(model, ids, mm, blind, None), want) > MOVED


# ---- each part shows -------------------------------------------------------------------------------------------------

def _after_projector(self, data):  # pooled after the projector instead of before
    px = data[ovv.VIDEO_KEY]
    features = self.project(self.features(px))
    grid = features.view(px.shape[0], self.side, self.side, -1).permute(0, 3, 1, 2)
    return self.pool(grid, 2, 2).flatten(2).transpose(1, 2).reshape(-1, features.shape[-1])


MUTATIONS = {
    "max-pooling": lambda enc: setattr(enc, "pool", nv.POOLS["max"]),
    "pooled-after-projector": lambda enc: setattr(enc, "encode", lambda data: _after_projector(enc, data)),
    "class-token-kept": lambda enc: setattr(enc, "strategy", "full"),
    "frames-reversed": lambda enc: setattr(enc, "encode", (lambda encode: lambda data: encode(
        {ovv.VIDEO_KEY: data[ovv.VIDEO_KEY].flip(0)}))(enc.encode)),
    "newline-appended": lambda enc: setattr(enc, "encode", (lambda encode: lambda data: torch.cat(
        [encode(data)[:-1], enc.image_newline[None]]))(enc.encode)),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_embeddings(release, mutation):
    """Each part of a video's embeddings done otherwise (max for average, pooling after the projector, CLIP's class
    token kept, the frames' order, OneVision's closing newline) moves them away from ``get_video_features`` (or gives
    another number of them)."""
    folder, hf = release
    _, mm = expanded(folder, VIDEO_PROMPT, pictures=[])
    encoder = ours(folder)[0]
    MUTATIONS[mutation](encoder)
    for item in mm.items:
        try:
            got = encode_items(encoder, type(mm)([item]))[0]
        except (ValueError, RuntimeError):
            continue
        with torch.no_grad():
            want = hf.model.get_video_features(torch.from_numpy(item.data[ovv.VIDEO_KEY])[None],
                                               vision_feature_layer=-2,
                                               vision_feature_select_strategy="default").pooler_output[0]
        assert got.shape != want.shape or max_diff(got, want) > MOVED


def _corner_crop(self, x):  # the shorter side resized as transformers does, the crop from the top left corner
    height, width = x.shape[-2:]
    size = (int(TILE * height / width), TILE) if width <= height else (TILE, int(TILE * width / height))
    return ovv.scaled(x, *size)[..., :TILE, :TILE]


def test_each_pixel_step_shows(release, monkeypatch):
    """The crop taken from the corner instead of the centre, or the longer side's size rounded instead of truncated
    (37.8 pixels: 38, not 37), no longer gives transformers' pixels (their digests)."""
    folder, _ = release
    _, processor = ours(folder)
    with monkeypatch.context() as patch:
        patch.setattr(nv.LlavaNextVideoFrames, "resize", _corner_crop)
        assert _digest(processor.process_video(videos()[0]).data[ovv.VIDEO_KEY]) != DIGESTS[0]
    with monkeypatch.context() as patch:
        patch.setattr(nv, "int", round, raising=False)  # (the module's int() calls round instead)
        assert _digest(processor.process_video(videos()[1]).data[ovv.VIDEO_KEY]) != DIGESTS[1]


# ---- tensor parallel and the engine ----------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(release, tmp_path):
    """Two tensor-parallel ranks (the encoder replicated) give one rank's logits with the videos' and the image's
    rows, chunks splitting the videos' spans, then decode steps."""
    folder, _ = release
    ids, mm = expanded(folder)
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids + GENERATED, mm, SCHEDULES["chunked+decode"])], 1, TOL)


def test_engine_greedy_with_videos_equals_transformers(release):
    """``LLM.generate`` with two videos (a list of frames, an array) and an image (chunks of 16 tokens splitting the
    videos' spans; n-gram drafts) gives transformers' greedy ``generate`` beside a text-only prompt; some drafts
    accepted; the videos matter."""
    from specray import LLM, SamplingParams

    folder, hf = release
    steps = 24
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    clips = videos()
    clips[1] = np.stack([np.asarray(frame) for frame in clips[1]])
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": random_images(IMAGE_SIZES), "video": clips}}
    outs = llm.generate([prompt, "The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=steps,
                                                                       ignore_eos=True), use_tqdm=False)
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

REFUSED = {
    "sampling": ({"do_sample_frames": True}, r"do_sample_frames=True is not supported"),
    "no crop": ({"do_center_crop": False}, r"do_center_crop=False\) is not supported"),
    "crop size": ({"crop_size": {"height": 56, "width": 56}}, r"crop_size=\{'height': 56, 'width': 56\}"),
    "size": ({"size": {"height": 28, "width": 28}}, r"size=\{'height': 28, 'width': 28\} is not supported"),
    "resample": ({"resample": 2}, r"resample=2 is not supported: only bicubic \(3\), LLaVA-NeXT-Video's"),
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


@pytest.mark.parametrize("change,words", [
    (dict(spatial_pool_mode="conv"), "spatial_pool_mode='conv' is not supported"),
    (dict(spatial_pool_stride=4), "spatial_pool_stride=4 with 4 features"),
    (dict(vision_config__image_size=35, image_grid_pinpoints=[[35, 70]]), "spatial_pool_stride=2 with 5 features")])
def test_unsupported_settings_are_refused(release, change, words):
    """Poolers the processor's count does not match (or whose weights are not read) refuse the release by name."""
    folder, _ = release
    config = config_with(folder, **change)
    with pytest.raises(ValueError, match=words):
        nv.LlavaNextVideoEncoder(config)
    with pytest.raises(ValueError, match=words):
        nv.LlavaNextVideoProcessor.from_pretrained(folder, config)


def test_text_only_release_and_mismatches(release):
    """A config without ``video_token_index`` takes no videos (images still); placeholders and videos differing in
    number are refused."""
    folder, _ = release
    config = config_with(folder, video_token_index=None)
    _, processor = ours(folder, config)
    with pytest.raises(ValueError, match=r"takes no videos \(only images\)"):
        expanded(folder, "A <image>", clips=videos()[:1], processor=processor)
    with pytest.raises(ValueError, match=r"holds 2 video placeholder token\(s\) .* but 1 video\(s\) were given"):
        expanded(folder, clips=videos()[:1])
