"""LLaVA-OneVision's images (``LlavaOnevisionForConditionalGeneration``, :mod:`specray.models.llava_onevision`) against
transformers on tiny random fp32 weights: a SigLIP tower (28-pixel tiles of 7-pixel patches: 16 features a tile)
before a Qwen2, grid pinpoints up to 3 x 3 tiles and ``vision_aspect_ratio`` "anyres_max_2" (a grid over 2 tiles'
worth of features by more than 1.1 squared is resampled). Our token count per image equals
``LlavaOnevisionProcessor._get_number_of_features`` over a sweep of sizes; our expanded prompt, tiles and
``image_sizes`` equal the processor's for one and three images (one grid kept, two resampled); each image's embeddings
equal ``get_image_features``; the text model fed them equals the whole model's logits (a prefill, chunks splitting the
images' spans, single steps) and, without images, its text-only logits; each distinctive part broken moves the
embeddings; ``LLM.generate`` with images (split spans, n-gram drafts) equals ``generate``; two tensor-parallel ranks
equal one; refusals by name."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.multimodal import expand_prompt
from specray_test_image_checks import (assert_ranks_equal_one_rank, config_with, encode_items, image_logits,
                                       prompt_run, random_images)
from specray_test_model_checks import max_diff

TOL, MOVED = 1e-4, 1e-2
TILE, PATCH = 28, 7
PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28], [84, 84], [56, 84], [84, 56]]
ASPECT = "anyres_max_2"
PROMPT = "Look at <image> and <image> then <image>, the quick brown fox jumps"
# (height, width): a wide one (1 x 3 tiles, its 4 x 12 features unpadded to 2 x 12: kept), a tall one (3 x 2 tiles,
# 12 x 8 features, resampled to 6 x 4), one of 2 x 2 tiles (8 x 8 features, resampled to 5 x 5)
SHAPES = ((20, 100), (100, 60), (50, 45))
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, rms_norm_eps=1e-5)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=TILE,
              patch_size=PATCH, layer_norm_eps=1e-5)


def images(count: int = 3) -> list:
    return random_images(SHAPES[:count])


@contextlib.contextmanager
def _without_video_processor():
    """transformers' LlavaOnevisionProcessor accepting ``video_processor=None`` (its video processor needs
    torchvision, not installed here)."""
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def lenient(self, name, arg):
        return None if name == "video_processor" and arg is None else check(self, name, arg)
    ProcessorMixin.check_argument_for_proper_class = lenient
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def hf_processor(folder: Path):
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaOnevisionProcessor

    with _without_video_processor():
        return LlavaOnevisionProcessor(image_processor=AutoImageProcessor.from_pretrained(folder), video_processor=None,
                                       tokenizer=AutoTokenizer.from_pretrained(folder), num_image_tokens=16,
                                       vision_feature_select_strategy="full", vision_aspect_ratio=ASPECT)


def build(path: Path, seed: int = 0) -> Path:
    """transformers' LlavaOnevisionForConditionalGeneration saved with the tiny tokenizer (``<image>``, ``<video>``
    special) and OneVision's PIL image processor (28-pixel tiles, PINPOINTS); the processor itself is built by
    :func:`hf_processor` (transformers cannot save it without a video processor)."""
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
            elif name.endswith("embed_tokens.weight"):  # (greedy tokens then follow both the text and the images)
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    LlavaOnevisionImageProcessorPil(size={"height": TILE, "width": TILE},
                                    image_grid_pinpoints=PINPOINTS).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("tiny_llava_onevision") / "m")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import LlavaOnevisionForConditionalGeneration

    return LlavaOnevisionForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def hf_inputs(folder: Path, text: str = PROMPT, count: int = 3) -> dict:
    return hf_processor(folder)(text=[text], images=images(count), return_tensors="pt")


def ours(folder: Path, config=None):
    """Our encoder and processor of ``folder`` (as the engine builds them)."""
    from specray.models.loader import load_image_encoder, load_image_processor, read_config

    config = config or read_config(str(folder))
    return load_image_encoder(str(folder), config, torch.float32, "cpu"), load_image_processor(str(folder), config)


def expanded(folder: Path, text: str = PROMPT, count: int = 3):
    from transformers import AutoTokenizer

    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text), images(count), ours(folder)[1])


def hf_features(model, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(model.get_image_features(pixel_values=inputs["pixel_values"],
                                             image_sizes=inputs["image_sizes"]).pooler_output)


# ---- the processor and the encoder -----------------------------------------------------------------------------------

def test_token_count_equals_transformers_processor(folder):
    """tokens_per_image equals LlavaOnevisionProcessor's count over 300 image sizes from 1 to 400 pixels a side (grids
    kept and resampled, unpadded by rows and by columns)."""
    from specray.models.llava_onevision import tokens_per_image
    from specray.models.loader import read_config

    processor, config = hf_processor(folder), read_config(str(folder))
    rng = random.Random(0)
    resampled = 0
    for h, w in [(49, 392), (188, 47)] + [(rng.randint(1, 400), rng.randint(1, 400)) for _ in range(300)]:
        want = processor._get_number_of_features(h, w, TILE, TILE)
        assert tokens_per_image(config, h, w) == want, (h, w)
        resampled += want < 16 + 32
    assert resampled > 0


@pytest.mark.parametrize("count", [1, 3])
def test_processor_and_encoder_equal_transformers(folder, hf, count):
    """Our expanded prompt equals LlavaOnevisionProcessor's (one image; three: 1 x 3, 3 x 2 and 2 x 2 tiles); each
    image's tiles and original size equal transformers' pixel_values / image_sizes; its embeddings equal
    get_image_features' (as many as the placeholder's copies)."""
    from specray.models.llava_onevision import LlavaOnevisionImageEncoder, LlavaOnevisionImageProcessor

    text = PROMPT if count == 3 else "Look at <image> please"
    theirs = hf_inputs(folder, text, count)
    encoder, processor = ours(folder)
    assert isinstance(encoder, LlavaOnevisionImageEncoder) and isinstance(processor, LlavaOnevisionImageProcessor)
    ids, mm = expanded(folder, text, count)
    assert ids == theirs["input_ids"][0].tolist()
    want = hf_features(hf, theirs)
    for i, (item, tiles, got) in enumerate(zip(mm.items, (4, 7, 5), encode_items(encoder, mm), strict=False)):
        assert set(ids[item.offset:item.end]) == {processor.image_token_id} and item.embed_rows is None
        assert item.data["pixel_values"].shape == (tiles, 3, TILE, TILE)
        assert np.array_equal(item.data["pixel_values"], theirs["pixel_values"][i, :tiles].numpy())
        assert item.data["image_sizes"].tolist() == list(SHAPES[i]) == theirs["image_sizes"][i].tolist()
        assert got.shape == want[i].shape == (item.length, 64)
        assert max_diff(got, want[i]) < TOL
    assert [item.length for item in mm.items] == [16 + 2 * 13, 16 + 6 * 5, 16 + 5 * 6][:count]


# ---- the whole model -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["prefill", "chunked+decode"])
def test_logits_with_images_equal_transformers(folder, hf, schedule):
    """transformers' LlavaOnevisionForConditionalGeneration(input_ids, pixel_values, image_sizes) logits == our text
    model's (Qwen2, served through _TEXT_PARTS) with the encoder's rows in place of the placeholders: one prefill, and
    chunks of 13 tokens (each image's span split) then single steps; without the rows they differ."""
    from specray.models.loader import load_model

    ids, mm = expanded(folder)
    model = load_model(str(folder))
    sizes = None if schedule == "prefill" else [13] * ((len(ids) - 4) // 13)
    assert any(item.offset % 13 and item.end % 13 for item in mm.items)
    embeds = encode_items(ours(folder)[0], mm)
    got = image_logits(model, ids, mm, embeds, sizes)
    with torch.no_grad():
        want = hf(**hf_inputs(folder)).logits[0]
    assert max_diff(got, want) < TOL
    assert max_diff(image_logits(model, ids, mm, [e * 0 for e in embeds], None), want) > MOVED


def test_text_model_alone_equals_transformers(folder, hf):
    """The release's text model (read through _TEXT_PARTS, no image tensors) gives transformers' whole model's logits
    over a text-only prompt."""
    from transformers import AutoTokenizer

    from specray.models.loader import load_model
    from specray.multimodal import MultiModalInputs

    ids = AutoTokenizer.from_pretrained(folder).encode("The quick brown fox jumps over the lazy dog")
    got = image_logits(load_model(str(folder)), ids, MultiModalInputs([]), [], [5])
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    assert max_diff(got, want) < TOL


# ---- each part shows -------------------------------------------------------------------------------------------------

def _no_newline(encoder, module):
    encoder.image_newline.data.zero_()


def _no_resampling(encoder, module):  # the grid kept whole, however large (LLaVA-NeXT's way)
    original = module.reduced
    module.reduced = lambda config, rows, cols: (rows, cols)
    return lambda: setattr(module, "reduced", original)


def _nearest(encoder, module):  # the grid resampled to the same size, nearest instead of bilinear
    original = module.F.interpolate
    module.F = type("F", (), {"interpolate": staticmethod(lambda x, size, mode: original(x, size, mode="nearest"))})
    return lambda: setattr(module, "F", torch.nn.functional)


def _corners_aligned(encoder, module):
    original = module.F.interpolate
    module.F = type("F", (), {"interpolate": staticmethod(lambda x, size, mode: original(x, size, mode=mode,
                                                                                         align_corners=True))})
    return lambda: setattr(module, "F", torch.nn.functional)


def _no_unpadding(encoder, module):  # (LLaVA-NeXT's encode, which OneVision's encoder runs, lays the tiles out)
    import specray.models.llava_next as next_module

    original = next_module.image_layout

    def padded(config, height, width):
        rows, cols, _ = original(config, height, width)
        return rows, cols, (0, rows * 4, 0, cols * 4)
    next_module.image_layout = padded
    return lambda: setattr(next_module, "image_layout", original)


def _base_last(encoder, module):
    encode_ = encoder.encode
    encoder.encode = lambda data: (lambda out: torch.cat([out[16:], out[:16]]))(encode_(data))


MUTATIONS = {"no-newline": _no_newline, "no-resampling": _no_resampling, "nearest": _nearest,
             "corners-aligned": _corners_aligned, "no-unpadding": _no_unpadding, "base-last": _base_last}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_embeddings(folder, hf, mutation):
    """Each part of OneVision's layout done otherwise moves some image's embeddings away from transformers' (or
    gives another number of them)."""
    import specray.models.llava_onevision as module

    _, mm = expanded(folder)
    encoder = ours(folder)[0]
    undo = MUTATIONS[mutation](encoder, module)
    try:
        diffs = []
        for item, want in zip(mm.items, hf_features(hf, hf_inputs(folder)), strict=True):
            try:
                got = encode_items(encoder, type(mm)([item]))[0]
            except (ValueError, RuntimeError):
                diffs.append(float("inf"))
                continue
            diffs.append(max_diff(got, want) if got.shape == want.shape else float("inf"))
    finally:
        if undo is not None:
            undo()
    assert max(diffs) > MOVED, mutation


# ---- refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,words", [
    (dict(vision_config__model_type="clip_vision_model"), "vision_config.model_type='clip_vision_model'"),
    (dict(vision_feature_select_strategy="default"), "vision_feature_select_strategy='default'"),
    (dict(vision_aspect_ratio="anyres"), "vision_aspect_ratio='anyres'"),
    (dict(vision_aspect_ratio="anyres_max_0"), "vision_aspect_ratio='anyres_max_0'"),
    (dict(image_grid_pinpoints=[[28, 50]]), r"image_grid_pinpoints=\[\[28, 50\]\] is not supported for LlavaOnevision"),
    (dict(vision_feature_layer=9), "vision_feature_layer=9")])
def test_unsupported_settings_are_refused(folder, change, words):
    from specray.models.llava_onevision import LlavaOnevisionImageEncoder, LlavaOnevisionImageProcessor

    config = config_with(folder, **change)
    with pytest.raises(ValueError, match=words):
        LlavaOnevisionImageEncoder(config)
    if "vision_feature_layer" not in change:
        with pytest.raises(ValueError, match=words):
            LlavaOnevisionImageProcessor.from_pretrained(folder, config)


def test_mismatches_are_refused(folder, tmp_path):
    """A processor_config.json counting other tokens or resampling otherwise, an image processor tiling by other
    pinpoints, a checkpoint without image_newline, and tiles that do not match the image's grid are refused by name."""
    from safetensors.torch import load_file

    from specray.models.llava_onevision import LlavaOnevisionImageEncoder, LlavaOnevisionImageProcessor
    from specray.models.loader import read_config

    copy = shutil.copytree(folder, tmp_path / "m")
    config = read_config(str(copy))
    for field, value in (("num_image_tokens", 729), ("vision_aspect_ratio", "anyres_max_9")):
        (copy / "processor_config.json").write_text(json.dumps({field: value}))
        with pytest.raises(ValueError, match=f"{field}={value!r}"):
            LlavaOnevisionImageProcessor.from_pretrained(copy, config)
    (copy / "processor_config.json").unlink()
    path = copy / "preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "image_grid_pinpoints": [[56, 56]]}))
    with pytest.raises(ValueError, match=r"image_grid_pinpoints=\[\[56, 56\]\]"):
        LlavaOnevisionImageProcessor.from_pretrained(copy, config)
    encoder = LlavaOnevisionImageEncoder(config)
    tensors = load_file(str(copy / "model.safetensors"))
    with pytest.raises(ValueError, match="image_newline"):
        encoder.load_weights((n, t) for n, t in tensors.items() if n != "image_newline")
    encoder.load_weights(tensors.items())
    with pytest.raises(ValueError, match="its base image and 3x1 tiles"):
        encoder.encode({"pixel_values": torch.zeros(5, 3, TILE, TILE), "image_sizes": torch.tensor([90, 25])})


# ---- tensor parallel and the engine ----------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(folder, tmp_path):
    """The text model split over two tensor-parallel ranks (the encoder replicated on each) gives one rank's logits
    with the images' rows in place, a prefill chunk ending inside the first image's span."""
    assert_ranks_equal_one_rank(tmp_path, [prompt_run(folder, PROMPT, images())], 1, TOL)


def test_engine_greedy_with_images_equals_transformers(folder, hf):
    """LLM.generate with three images (prefill chunks of 24 tokens splitting their spans, n-gram drafts) gives
    transformers' greedy generate's tokens, beside a text-only prompt in the same batch; some drafts accepted."""
    from specray import LLM
    from specray_test_engine_runs import assert_images_greedy_equals_transformers

    llm = LLM(model=str(folder), max_model_len=512, block_size=4, max_num_batched_tokens=24,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    assert_images_greedy_equals_transformers(llm, hf, hf_processor(folder), PROMPT, images(), max_tokens=32)


# llava-onevision-qwen2's chat template's shape: "<|im_start|>user <image>\n...<|im_end|>" (image parts first)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {% for p in m.content %}{% if p.type == 'image' %}"
                 "<image>\n{% endif %}{% endfor %}{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}"
                 "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}{{ '<|im_start|>assistant\n' }}")


def test_chat_with_an_image_url_equals_transformers(folder, hf):
    """LLM.chat with an image_url part (a PNG data: URL) in a template of the release's shape gives transformers'
    greedy generate of the rendered prompt with that image, token for token."""
    import base64
    import io

    from specray import LLM, SamplingParams

    image = images(2)[1]
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is the quick brown fox?"}]}]
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16)
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False,
                   chat_template=CHAT_TEMPLATE)[0]
    text = "<|im_start|>user <image>\nWhat is the quick brown fox?<|im_end|>\n<|im_start|>assistant\n"
    inputs = hf_processor(folder)(text=[text], images=[image], return_tensors="pt")
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        want = hf.generate(**inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    assert list(out.outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist()
