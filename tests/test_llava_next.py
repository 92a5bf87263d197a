"""LLaVA-NeXT's images (``LlavaNextForConditionalGeneration``, :mod:`specray.models.llava_next`) against transformers on
tiny random fp32 weights: two models, a CLIP tower (class token dropped: "default") before a Llama and a SigLIP tower
("full") before a Mistral, each tile 28 pixels (16 features), grid pinpoints of 1 x 2, 2 x 1, 2 x 2 and 3 x 1 tiles.
Our token count per image equals ``LlavaNextProcessor._get_number_of_features``' over a sweep of image sizes; our
expanded prompt, tiles and ``image_sizes`` equal the processor's for one and for three images of different shapes
(three grids, unpadding by rows and by columns); each image's embeddings (base, unpadded tiles, a newline per row)
equal ``get_image_features``; the text model fed them equals the whole model's logits (a prefill, chunks splitting the
images' spans); each distinctive part broken moves the embeddings; ``LLM.generate`` with images (split spans, n-gram
drafts) equals ``generate``; two tensor-parallel ranks equal one; refusals by name."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache
from specray.multimodal import expand_prompt
from specray_test_image_checks import (assert_ranks_equal_one_rank, config_with, prompt_run,  # tests/image_checks.py
                                       random_images)
from specray_test_model_checks import max_diff

TOL, MOVED = 1e-4, 1e-2
TILE, PATCH = 28, 7
PINPOINTS = [[28, 56], [56, 28], [56, 56], [84, 28]]
PROMPT = "Look at <image> and <image> then <image>, the quick brown fox jumps"
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, rms_norm_eps=1e-5)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=TILE,
              patch_size=PATCH, layer_norm_eps=1e-5)
KINDS = {"clip": dict(vision_feature_layer=-2, vision_feature_select_strategy="default"),
         "siglip": dict(vision_feature_layer=[-1, 1], vision_feature_select_strategy="full",
                        projector_hidden_act="gelu_pytorch_tanh")}
# (height, width): a wide one (1 x 2 tiles, its 4 x 8 features unpadded to 2 rows), a tall one (3 x 1 tiles, 12 x 4
# features unpadded to 2 columns), one of 2 x 2 tiles (8 x 8 features unpadded to 6 columns)
SHAPES = ((20, 100), (100, 18), (60, 40))


def images(count: int = 3) -> list:
    return random_images(SHAPES[:count], legacy=True)


def build(path: Path, kind: str, seed: int = 0) -> Path:
    """transformers' LlavaNextForConditionalGeneration of ``kind`` saved with the tiny tokenizer (``<image>``
    special) and LlavaNextProcessor (its PIL image processor: 28-pixel tiles, PINPOINTS)."""
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration,
                              LlavaNextProcessor, MistralConfig, SiglipVisionConfig)
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=("<image>",))
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    if kind == "clip":
        text, vision = LlamaConfig(**ids, **TEXT), CLIPVisionConfig(**VISION)
    else:
        text, vision = MistralConfig(**ids, **TEXT, sliding_window=None), SiglipVisionConfig(**VISION)
    config = LlavaNextConfig(text_config=text, vision_config=vision, image_grid_pinpoints=PINPOINTS,
                             image_token_index=tok.convert_tokens_to_ids("<image>"), **KINDS[kind])
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "multi_modal_projector" in name and name.endswith(".weight"):
                p.normal_(0.0, p.shape[1] ** -0.5)
            elif "norm" in name and name.endswith(".weight") and p.dim() == 1:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("class_embedding", "patch_embedding.bias", "image_newline")):
                p.normal_(0.0, 1.0)
    model.save_pretrained(path)
    images_ = LlavaNextImageProcessorPil(size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE},
                                         image_grid_pinpoints=PINPOINTS)
    strategy = KINDS[kind]["vision_feature_select_strategy"]
    LlavaNextProcessor(image_processor=images_, tokenizer=tok, patch_size=PATCH,
                       vision_feature_select_strategy=strategy,
                       num_additional_image_tokens=int(kind == "clip")).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_llava_next")
    return {kind: build(root / kind, kind) for kind in KINDS}


@pytest.fixture(scope="module")
def hf_models(folders) -> dict:
    from transformers import LlavaNextForConditionalGeneration

    return {kind: LlavaNextForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
            for kind, folder in folders.items()}


def hf_processor(folder: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder)


def hf_inputs(folder: Path, text: str = PROMPT, count: int = 3) -> dict:
    return hf_processor(folder)(text=text, images=images(count), return_tensors="pt")


def ours(folder: Path, config=None):
    """Our encoder and processor of ``folder`` (as the engine builds them)."""
    from specray.models.loader import load_image_encoder, read_config
    from specray.models.registry import multimodal_classes

    config = config or read_config(str(folder))
    processor = multimodal_classes(config)[1].from_pretrained(folder, config)
    return load_image_encoder(str(folder), config, torch.float32, "cpu"), processor


def expanded(folder: Path, text: str = PROMPT, count: int = 3):
    from transformers import AutoTokenizer

    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text), images(count), ours(folder)[1])


def encode(encoder, item) -> torch.Tensor:
    with torch.no_grad():
        return encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()})


def hf_features(model, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(model.get_image_features(pixel_values=inputs["pixel_values"],
                                             image_sizes=inputs["image_sizes"]).pooler_output)


# ---- the processor -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(KINDS))
def test_token_count_equals_transformers_processor(folders, kind):
    """tokens_per_image equals LlavaNextProcessor's count (``_get_number_of_features``, less one under "default")
    over 300 image sizes from 1 to 400 pixels a side, any aspect, and two whose unpadding turns on the rounding of a
    float just below a whole number (49 x 392, 188 x 47: its 7th decimal)."""
    from specray.models.llava_next import tokens_per_image

    processor, config = hf_processor(folders[kind]), ours(folders[kind])[1].config
    rng = random.Random(0)
    for h, w in [(49, 392), (188, 47)] + [(rng.randint(1, 400), rng.randint(1, 400)) for _ in range(300)]:
        want = processor._get_number_of_features(h, w, TILE, TILE) - int(kind == "clip")
        assert tokens_per_image(config, h, w) == want, (h, w)


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_processor_and_encoder_equal_transformers(folders, hf_models, kind, count):
    """Our expanded prompt equals LlavaNextProcessor's (one image; three of different shapes: 1 x 2, 3 x 1 and 2 x 2
    tiles); each image's tiles and original size equal transformers' pixel_values / image_sizes; its embeddings
    equal get_image_features' (as many as the placeholder's copies)."""
    from specray.models.llava_next import LlavaNextImageEncoder, LlavaNextImageProcessor

    folder = folders[kind]
    text = PROMPT if count == 3 else "Look at <image> please"
    theirs = hf_inputs(folder, text, count)
    encoder, processor = ours(folder)
    assert isinstance(encoder, LlavaNextImageEncoder) and isinstance(processor, LlavaNextImageProcessor)
    ids, mm = expanded(folder, text, count)
    assert ids == theirs["input_ids"][0].tolist()
    want = hf_features(hf_models[kind], theirs)
    for i, (item, tiles) in enumerate(zip(mm.items, (3, 4, 5), strict=False)):
        assert set(ids[item.offset:item.end]) == {processor.image_token_id} and item.embed_rows is None
        assert item.data["pixel_values"].shape == (tiles, 3, TILE, TILE)
        assert np.array_equal(item.data["pixel_values"], theirs["pixel_values"][i, :tiles].numpy())
        assert item.data["image_sizes"].tolist() == list(SHAPES[i]) == theirs["image_sizes"][i].tolist()
        got = encode(encoder, item)
        assert got.shape == want[i].shape == (item.length, 64)
        assert max_diff(got, want[i]) < TOL


def test_bf16_encoder_is_as_close_as_transformers_bf16(folders, hf_models):
    """In bfloat16 (the releases' dtype; the pixels cast as the runner casts them, ``image_sizes`` kept integer) each
    image's embeddings are about as close to transformers' float32 ones as transformers' own bfloat16 ones are."""
    from transformers import LlavaNextForConditionalGeneration

    from specray.models.loader import load_image_encoder, read_config

    folder = folders["clip"]
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.bfloat16, "cpu")
    bf16 = LlavaNextForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
    inputs = hf_inputs(folder)
    want = hf_features(hf_models["clip"], inputs)
    theirs = hf_features(bf16, {**inputs, "pixel_values": inputs["pixel_values"].bfloat16()})
    _, mm = expanded(folder)
    for item, w, t in zip(mm.items, want, theirs, strict=True):
        with torch.no_grad():
            got = encoder.encode({"pixel_values": torch.from_numpy(item.data["pixel_values"]).bfloat16(),
                                  "image_sizes": torch.from_numpy(item.data["image_sizes"])})
        assert got.dtype == torch.bfloat16
        assert max_diff(got.float(), w) <= 1.5 * max_diff(t.float(), w) + 1e-3


# ---- the whole model -------------------------------------------------------------------------------------------------

@torch.no_grad()
def logits_with_images(model, ids: list[int], rows: dict[int, torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """``model``'s logits of ``ids`` in chunks of ``sizes`` over a paged cache of shuffled 4-token blocks, each
    chunk's image rows (``rows``: prompt position -> embedding) handed in as ``meta.input_embeds``."""
    allocate_kv_cache(model, 128, 4)
    table = random.Random(0).sample(range(128), -(-len(ids) // 4))
    out, start = [], 0
    for n in sizes:
        meta = build_attention_metadata([n], [start], [table], 4, model.device)
        mine = [p for p in range(start, start + n) if p in rows]
        if mine:
            meta.input_embeds = (torch.tensor([p - start for p in mine]), torch.stack([rows[p] for p in mine]))
        out.append(model.compute_logits(model(torch.tensor(ids[start:start + n]), meta)))
        start += n
    assert start == len(ids)
    return torch.cat(out)


def image_rows(encoder, mm) -> dict[int, torch.Tensor]:
    rows = {}
    for item in mm.items:
        values = encode(encoder, item)
        rows.update((item.offset + i, values[i]) for i in range(item.length))
    return rows


@pytest.mark.parametrize("schedule", ["prefill", "chunked+decode"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_with_images_equal_transformers(folders, hf_models, kind, schedule):
    """transformers' LlavaNextForConditionalGeneration(input_ids, pixel_values, image_sizes) logits == our text
    model's with the encoder's rows in place of the placeholders: one prefill, and chunks of 13 tokens (each image's
    span split) then single steps; without the rows they differ."""
    from specray.models.loader import load_model

    folder = folders[kind]
    ids, mm = expanded(folder)
    model = load_model(str(folder))
    sizes = [len(ids)] if schedule == "prefill" else [13] * ((len(ids) - 4) // 13) + [1] * ((len(ids) - 4) % 13 + 4)
    assert any(item.offset % 13 and item.end % 13 for item in mm.items)
    got = logits_with_images(model, ids, image_rows(ours(folder)[0], mm), sizes)
    with torch.no_grad():
        want = hf_models[kind](**hf_inputs(folder)).logits[0]
    assert max_diff(got, want) < TOL
    assert max_diff(logits_with_images(model, ids, {}, [len(ids)]), want) > MOVED


def test_module_names_load(folders, hf_models, tmp_path):
    """A checkpoint named as transformers' modules name it (``model.vision_tower.vision_model.``,
    ``model.multi_modal_projector.``, ``model.image_newline``, ``model.language_model.``, ``lm_head.``) gives the same
    logits with images as transformers."""
    from safetensors.torch import load_file, save_file

    from specray.models.loader import load_model

    folder = shutil.copytree(folders["clip"], tmp_path / "modules")
    tensors = load_file(str(folder / "model.safetensors"))
    renames = ((r"^language_model\.model\.", "model.language_model."), (r"^language_model\.lm_head\.", "lm_head."),
               (r"^vision_tower\.(?:vision_model\.)?", "model.vision_tower.vision_model."),
               (r"^(multi_modal_projector\.|image_newline$)", r"model.\1"))
    renamed = {}
    for name, tensor in tensors.items():
        for pattern, new in renames:
            name = re.sub(pattern, new, name)
        renamed[name] = tensor
    assert "model.image_newline" in renamed and "lm_head.weight" in renamed
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    ids, mm = expanded(folder)
    got = logits_with_images(load_model(str(folder)), ids, image_rows(ours(folder)[0], mm), [len(ids)])
    with torch.no_grad():
        want = hf_models["clip"](**hf_inputs(folder)).logits[0]
    assert max_diff(got, want) < TOL


# ---- each part shows -------------------------------------------------------------------------------------------------

def _no_newline(encoder):
    encoder.image_newline.data.zero_()


def _base_last(encoder):  # the base image's features after the tiles' instead of before
    encode_ = encoder.encode

    def swapped(data):
        out = encode_(data)
        base = encoder.side ** 2
        return torch.cat([out[base:], out[:base]])
    encoder.encode = swapped


def _no_unpadding(encoder):  # the padded grid kept whole: a layout whose span covers the padding too
    import specray.models.llava_next as module

    original = module.unpadded_span
    module.unpadded_span = lambda h, w, rows, cols: (0, rows, 0, cols)
    return lambda: setattr(module, "unpadded_span", original)


def _tiles_column_major(encoder):
    pixels_key = "pixel_values"
    encode_ = encoder.encode

    def transposed(data):
        pixels = data[pixels_key]
        tiles = pixels[1:]
        height, width = data["image_sizes"].tolist()
        import specray.models.llava_next as module

        rows, cols, _ = module.image_layout(encoder.config, height, width)
        tiles = tiles.view(rows, cols, *tiles.shape[1:]).transpose(0, 1).reshape(tiles.shape)
        return encode_({**data, pixels_key: torch.cat([pixels[:1], tiles])})
    encoder.encode = transposed


def _first_pinpoint(encoder):  # the grid of the first pinpoint, not the best one (the count then differs too)
    import specray.models.llava_next as module

    original = module.best_resolution
    module.best_resolution = lambda h, w, pinpoints: tuple(pinpoints[0])
    return lambda: setattr(module, "best_resolution", original)


MUTATIONS = {"no-newline": _no_newline, "base-last": _base_last, "no-unpadding": _no_unpadding,
             "tiles-column-major": _tiles_column_major, "first-pinpoint": _first_pinpoint}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_embeddings(folders, hf_models, mutation):
    """Each part of LLaVA-NeXT's layout done otherwise moves some image's embeddings away from transformers' (or
    fails to give as many as transformers)."""
    folder = folders["clip"]
    _, mm = expanded(folder)
    encoder = ours(folder)[0]
    undo = MUTATIONS[mutation](encoder)
    try:
        diffs = []
        for item, want in zip(mm.items, hf_features(hf_models["clip"], hf_inputs(folder)), strict=True):
            try:
                got = encode(encoder, item)
            except (ValueError, RuntimeError):
                diffs.append(float("inf"))
                continue
            diffs.append(max_diff(got, want) if got.shape == want.shape else float("inf"))
    finally:
        if undo is not None:
            undo()
    assert max(diffs) > MOVED, mutation


# ---- refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,change,words", [
    ("clip", dict(vision_config__model_type="pixtral"), "vision_config.model_type='pixtral'"),
    ("clip", dict(vision_feature_select_strategy="full"), "vision_feature_select_strategy='full'"),
    ("siglip", dict(vision_feature_select_strategy="default"), "vision_feature_select_strategy='default'"),
    ("clip", dict(vision_feature_select_strategy="cls"), "vision_feature_select_strategy='cls'"),
    ("clip", dict(image_grid_pinpoints=[[28, 50]]), r"image_grid_pinpoints=\[\[28, 50\]\]"),
    ("clip", dict(image_grid_pinpoints=[]), r"image_grid_pinpoints=\[\]"),
    ("clip", dict(vision_feature_layer=9), "vision_feature_layer=9")])
def test_unsupported_settings_are_refused(folders, kind, change, words):
    from specray.models.llava_next import LlavaNextImageEncoder, LlavaNextImageProcessor

    config = config_with(folders[kind], **change)
    with pytest.raises(ValueError, match=words):
        LlavaNextImageEncoder(config)
    if "vision_feature_layer" not in change:
        with pytest.raises(ValueError, match=words):
            LlavaNextImageProcessor.from_pretrained(folders[kind], config)


def test_mismatches_are_refused(folders, tmp_path):
    """An image processor tiling by other pinpoints than the model's, a processor_config.json counting other tokens,
    a checkpoint without image_newline, and tiles that do not match the image's grid are refused by name."""
    from safetensors.torch import load_file

    from specray.models.llava_next import LlavaNextImageEncoder, LlavaNextImageProcessor
    from specray.models.loader import read_config

    folder = shutil.copytree(folders["clip"], tmp_path / "m")
    config = read_config(str(folder))
    path = folder / "processor_config.json"  # transformers 5 keeps the image processor's settings in it too
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "image_processor": {**saved["image_processor"],
                                                             "image_grid_pinpoints": [[56, 56]]}}))
    with pytest.raises(ValueError, match=r"image_grid_pinpoints=\[\[56, 56\]\]"):
        LlavaNextImageProcessor.from_pretrained(folder, config)
    path.write_text(json.dumps({**saved, "num_additional_image_tokens": 0}))
    with pytest.raises(ValueError, match="num_additional_image_tokens=0"):
        LlavaNextImageProcessor.from_pretrained(folder, config)
    encoder = LlavaNextImageEncoder(config)
    tensors = load_file(str(folder / "model.safetensors"))
    newline = next(name for name in tensors if name.endswith("image_newline"))
    with pytest.raises(ValueError, match="image_newline"):
        encoder.load_weights((n, t) for n, t in tensors.items() if n != newline)
    encoder.load_weights(tensors.items())
    with pytest.raises(ValueError, match="its base image and 3x1 tiles"):
        encoder.encode({"pixel_values": torch.zeros(5, 3, TILE, TILE), "image_sizes": torch.tensor([90, 25])})


# ---- tensor parallel -------------------------------------------------------------------------------------------------

def assert_two_ranks_equal_one(tmp_path: Path, prompt: str, images: list, folders: list[Path], tol: float) -> None:
    """Each folder's text model split over two tensor-parallel ranks (its encoder replicated on each) gives one
    rank's logits within ``tol`` over ``prompt`` with ``images``: a prefill chunk ending inside the first image's span,
    then the rest."""
    runs = [prompt_run(folder, prompt, images, blocks=128) for folder in folders]
    assert_ranks_equal_one_rank(tmp_path, runs, 1, tol)


def test_tensor_parallel_two_ranks_equal_one(folders, tmp_path):
    """Both text models split over two ranks (encoders replicated) give one rank's logits with the images' rows in
    place, a prefill chunk ending inside the first image's span."""
    assert_two_ranks_equal_one(tmp_path, PROMPT, images(), [folders[kind] for kind in sorted(KINDS)], TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(KINDS))
def test_engine_greedy_with_images_equals_transformers(folders, hf_models, kind):
    """LLM.generate with three images (prefill chunks of 24 tokens splitting their spans, n-gram drafts) gives
    transformers' greedy generate's tokens, beside a one-image prompt in the same batch; some drafts accepted."""
    from specray import LLM, SamplingParams

    folder = folders[kind]
    llm = LLM(model=str(folder), max_model_len=512, block_size=4, max_num_batched_tokens=24,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    prompts = [(PROMPT, images()), ("Look at <image> please", images(1))]
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for (text, imgs), out in zip(prompts, outs, strict=True):
        inputs = hf_processor(folder)(text=text, images=imgs, return_tensors="pt")
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        with torch.no_grad():
            want = hf_models[kind].generate(**inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                            eos_token_id=None, pad_token_id=0)
        assert list(out.outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist(), text
    assert llm.spec_stats.accepted_tokens > 0


# llava-v1.6-mistral's chat template's shape: "[INST] <image>\n... [/INST]" (the image part first)
CHAT_TEMPLATE = ("{% for m in messages %}{% if m.role == 'user' %}[INST] {% for p in m.content %}"
                 "{% if p.type == 'image' %}<image>\n{% endif %}{% endfor %}{% for p in m.content %}"
                 "{% if p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %} [/INST]{% endif %}{% endfor %}")


def test_chat_with_an_image_url_equals_transformers(folders, hf_models):
    """LLM.chat with an image_url part (a PNG data: URL) in a template of llava-v1.6-mistral's shape gives
    transformers' greedy generate of the rendered prompt with that image, token for token."""
    import base64
    import io

    from specray import LLM, SamplingParams

    folder, image = folders["clip"], images(3)[2]
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is the quick brown fox?"}]}]
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16)
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False,
                   chat_template=CHAT_TEMPLATE)[0]
    inputs = hf_processor(folder)(text="[INST] <image>\nWhat is the quick brown fox? [/INST]", images=[image],
                                  return_tensors="pt")
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        want = hf_models["clip"].generate(**inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)
    assert list(out.outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist()
