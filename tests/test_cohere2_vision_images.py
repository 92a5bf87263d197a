"""Command A Vision's images (``Cohere2VisionForConditionalGeneration``: :mod:`specray.models.cohere2_vision`),
against transformers on the same tiny random fp32 weights. transformers' ``Cohere2VisionImageProcessor`` exists only on
its torchvision backend (not installed here): our prompt (``<|IMG_PATCH|>`` written out as ``Cohere2VisionProcessor``
writes it: ``<|START_OF_IMG|>``, per tile its image tokens and ``<|IMG_LINE_BREAK|>``, ``<|END_OF_IMG|>``), our tiles
and our tile grids equal transformers' live where torchvision imports (``COHERE2_VISION_TORCHVISION_PATH`` or
``LLAMA4_TORCHVISION_PATH`` may name a folder holding it), else the tile counts, ids and sha256 digests recorded with
torchvision 0.28. Each image's embeddings equal ``get_image_features`` (max abs diff < 1e-4); the Cohere2 text model
fed them gives transformers' whole model's logits in one prefill and in chunks splitting the images' spans (the text
config's ``logit_scale`` 0.5 unapplied, as transformers' composite model leaves it); each distinctive part broken once
moves the embeddings or the pixels; what is not implemented is refused by name; the engine's greedy tokens with images
(n-gram drafts, chunks splitting the images) equal transformers' ``generate``; two tensor-parallel ranks equal one.
No GPU check here."""

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

from specray.models import cohere2_vision as cv
from specray.models.internvl import pixel_shuffle
from specray.models.loader import load_image_encoder, load_image_processor, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import (assert_ranks_equal_one_rank, encoded, image_logits,  # tests/image_checks.py
                                       private_env, random_images)
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2
TILE, PATCH, FACTOR = 28, 7, 2  # a 4 x 4 patch grid folded to 2 x 2: 4 tokens a tile (the processor's patch_size 2)
PROMPT = "Look at <|IMG_PATCH|> and then at <|IMG_PATCH|>, the quick brown fox jumps"
TOKENS = {"boi_token": "<|START_OF_IMG|>", "eoi_token": "<|END_OF_IMG|>", "image_token": "<|IMG_PATCH|>",
          "img_line_break_token": "<|IMG_LINE_BREAK|>"}
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, logit_scale=0.5, sliding_window=16, tie_word_embeddings=True)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=TILE,
              patch_size=PATCH, layer_norm_eps=1e-6)
PREPROCESSOR = {"image_processor_type": "Cohere2VisionImageProcessor", "size": {"height": TILE, "width": TILE},
                "patch_size": 2, "crop_to_patches": True, "min_patches": 1, "max_patches": 6, "resample": 3,
                "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
                "rescale_factor": 1 / 255, "image_mean": cv.CLIP_MEAN, "image_std": cv.CLIP_STD}
SIZES = [(40, 90), (70, 50)]  # wide and tall: 3 x 2 and 2 x 3 tiles, each with a thumbnail
TILES = [7, 7]
# transformers' tiles for the two images (sha256 of the float32 bytes), recorded with torchvision 0.28
DIGESTS = ["3abd116a3f2bfa0d27e5a57cff1c1496b90e8101b0f32ce372d8e7e4cf171eaa",
           "522d58833472f67148272d034b148b2e8d311249518b2f08996996a8d8433d59"]
# transformers' Cohere2VisionProcessor's input_ids for PROMPT and the two images (sha256 of their JSON list), recorded
IDS_DIGEST = "75a7ae381b523c21cbdaf5c7082735bdd02a8acbe3d5bc575c75229970d4e062"
# (height, width, max_patches) -> transformers' get_optimal_tiled_canvas (columns, rows) for 28-pixel tiles, recorded:
# one case of each of the 21 grids the live test's 196 cases give
CANVAS = {(1, 1, 1): (1, 1), (1, 50, 4): (2, 1), (1, 90, 4): (4, 1), (1, 400, 6): (6, 1), (1, 400, 12): (12, 1),
          (40, 1, 4): (1, 2), (40, 50, 4): (2, 2), (40, 90, 4): (3, 1), (40, 90, 6): (3, 2), (40, 90, 12): (4, 2),
          (40, 400, 12): (10, 1), (70, 1, 4): (1, 3), (70, 50, 6): (2, 3), (70, 90, 12): (4, 3),
          (70, 400, 12): (6, 2), (300, 1, 4): (1, 4), (300, 1, 6): (1, 6), (300, 1, 12): (1, 11),
          (300, 90, 12): (2, 6), (1000, 1, 12): (1, 12), (1000, 400, 12): (2, 5)}
TORCHVISION_PATHS = ("COHERE2_VISION_TORCHVISION_PATH", "LLAMA4_TORCHVISION_PATH")


def _images() -> list:
    return random_images(SIZES)


def _visible(model) -> None:
    """Norms, projector and text layers away from their init, so that every mistake shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            text_layer = name.startswith("model.language_model.layers.")
            if ("multi_modal_projector" in name or text_layer) and name.endswith(".weight") and param.dim() == 2:
                param.normal_(0.0, param.shape[1] ** -0.5)
            elif "vision_tower" in name and name.endswith(("q_proj.weight", "k_proj.weight")):
                param.normal_(0.0, 3 * param.shape[1] ** -0.5)
            elif name.endswith(("position_embedding.weight", "patch_embedding.bias")):
                param.normal_(0.0, 1.0)
            elif "norm" in name and name.endswith(".weight") and param.dim() == 1:
                param.uniform_(0.5, 1.5)
            elif "norm" in name and name.endswith(".bias"):
                param.normal_(0.0, 0.3)


def build_tiny(path: Path, seed: int = 0, **changes) -> Path:
    """transformers' Cohere2VisionForConditionalGeneration (SigLIP tower, a Cohere2 text model whose head is tied),
    saved with conftest's tiny tokenizer naming the image tokens as the release's does and the image processor's
    settings written out (its class needs torchvision)."""
    from transformers import (AutoTokenizer, Cohere2Config, Cohere2VisionConfig, Cohere2VisionForConditionalGeneration,
                              SiglipVisionConfig)

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(path, extra_special_tokens=tuple(TOKENS.values()))
    tok = AutoTokenizer.from_pretrained(path, extra_special_tokens=TOKENS)
    tok.save_pretrained(path)
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    config = Cohere2VisionConfig(text_config=Cohere2Config(**ids, **TEXT), vision_config=SiglipVisionConfig(**VISION),
                                 downsample_factor=FACTOR, image_token_id=tok.image_token_id,
                                 alignment_intermediate_size=96, **changes)
    torch.manual_seed(seed)
    model = Cohere2VisionForConditionalGeneration(config).float().eval()
    _visible(model)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny_cohere2_vision"))


@pytest.fixture(scope="module")
def hf_model(tiny):
    from transformers import Cohere2VisionForConditionalGeneration

    return Cohere2VisionForConditionalGeneration.from_pretrained(tiny, dtype=torch.float32).eval()


def _expand(folder: Path, processor=None, text: str = PROMPT):
    from transformers import AutoTokenizer

    processor = processor or load_image_processor(str(folder))
    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text), _images(), processor)


def _inputs(folder: Path) -> dict:
    """transformers' model inputs for PROMPT and the two images: our expansion and tiles (checked against
    transformers' processor by the processor tests)."""
    ids, mm = _expand(folder)
    return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            "pixel_values": torch.from_numpy(np.concatenate([i.data["pixel_values"] for i in mm.items]))}


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype=np.float32).tobytes()).hexdigest()


def test_processor_expands_as_transformers(tiny):
    """The prompt's two ``<|IMG_PATCH|>`` written out as Cohere2VisionProcessor writes them (the ids equal its
    recorded ones), the image tokens taking the embeddings; the tiles (thumbnail last) equal transformers' recorded
    digests."""
    config = read_config(str(tiny))
    processor = load_image_processor(str(tiny), config)
    assert isinstance(processor, cv.Cohere2VisionImageProcessor) and processor.image_token_id == config.image_token_id
    ids, mm = _expand(tiny, processor)
    assert hashlib.sha256(json.dumps(ids).encode()).hexdigest() == IDS_DIGEST
    t = processor.ids
    for item, count in zip(mm.items, TILES):
        span = ids[item.offset:item.end]
        assert span == [t["boi_token"]] + ([t["image_token"]] * 4 + [t["img_line_break_token"]]) * count + [
            t["eoi_token"]]
        assert [span[r] for r in item.embed_rows] == [t["image_token"]] * (4 * count)
        assert item.data["pixel_values"].shape == (count, 3, TILE, TILE)
    assert [_digest(item.data["pixel_values"]) for item in mm.items] == DIGESTS
    assert mm.rope_positions is None


def test_tile_grids_equal_transformers():
    """Our tile grids equal transformers' ``get_optimal_tiled_canvas``'s (recorded: its module imports torchvision):
    upscaled, downscaled, square, extreme and one-tile cases."""
    for (h, w, most), want in CANVAS.items():
        assert cv.tile_grid(h, w, TILE, most) == tuple(want), (h, w, most)


REFERENCE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer, Cohere2VisionImageProcessor, Cohere2VisionProcessor
    from transformers.models.cohere2_vision.image_processing_cohere2_vision import get_optimal_tiled_canvas
    folder, out, *sizes = sys.argv[1:]
    settings = json.load(open(f"{folder}/preprocessor_config.json"))
    settings.pop("image_processor_type")
    processor = Cohere2VisionProcessor(image_processor=Cohere2VisionImageProcessor(**settings),
                                       tokenizer=AutoTokenizer.from_pretrained(folder))
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in sizes]
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in shapes]
    got = processor(text=[sys.stdin.read()], images=pictures, return_tensors="np")
    np.save(f"{out}/px.npy", got["pixel_values"])
    rgba = Image.fromarray(rng.integers(0, 256, (30, 70, 4), dtype=np.uint8), "RGBA")
    np.save(f"{out}/rgba.npy", processor.image_processor(images=[rgba], return_tensors="np")["pixel_values"])
    canvas = {f"{h}x{w}x{m}": list(get_optimal_tiled_canvas((h, w), (28, 28), 1, m))
              for h in (1, 20, 28, 40, 70, 300, 1000) for w in (1, 20, 28, 50, 90, 400, 3000) for m in (1, 4, 6, 12)}
    json.dump({"ids": got["input_ids"][0].tolist(), "canvas": canvas}, open(f"{out}/o.json", "w"))
""")


def _reference(folder: Path, out: Path) -> dict:
    env = private_env(TORCHVISION_PATHS, "torchvision", "transformers' Cohere2VisionImageProcessor")
    script = out / "reference.py"
    script.write_text(REFERENCE)
    subprocess.run([sys.executable, str(script), str(folder), str(out), *[f"{h}x{w}" for h, w in SIZES]], env=env,
                   check=True, capture_output=True, timeout=120, input=PROMPT.encode())
    return {**json.loads((out / "o.json").read_text()), "pixels": np.load(out / "px.npy"),
            "rgba": np.load(out / "rgba.npy")}


def test_processor_equals_transformers_live(tiny, tmp_path):
    """Where torchvision imports, transformers' own Cohere2VisionProcessor over the two images gives our prompt, our
    tiles and our tile grids; an RGBA image's tiles (transparency onto white) equal its image processor's."""
    from PIL import Image

    want = _reference(tiny, tmp_path)
    ids, mm = _expand(tiny)
    assert ids == want["ids"]
    assert np.array_equal(np.concatenate([i.data["pixel_values"] for i in mm.items]), want["pixels"])
    rng = np.random.default_rng(0)
    [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SIZES]  # the reference's draws before the RGBA one
    rgba = Image.fromarray(rng.integers(0, 256, (30, 70, 4), dtype=np.uint8), "RGBA")
    assert np.array_equal(load_image_processor(str(tiny)).tiles(rgba), want["rgba"])
    for key, grid in want["canvas"].items():
        h, w, most = (int(v) for v in key.split("x"))
        assert cv.tile_grid(h, w, TILE, most) == tuple(grid), key


def _hf_features(hf, folder: Path) -> torch.Tensor:
    with torch.no_grad():
        return hf.model.get_image_features(_inputs(folder)["pixel_values"]).pooler_output.flatten(0, 1)


def test_encoder_matches_transformers(tiny, hf_model):
    """Each image's embeddings (all its tiles') equal transformers' ``get_image_features``."""
    encoder = load_image_encoder(str(tiny), read_config(str(tiny)), torch.float32, "cpu")
    assert isinstance(encoder, cv.Cohere2VisionImageEncoder) and encoder.tower.post_layernorm is not None
    _, mm = _expand(tiny)
    got, want = torch.cat(encoded(tiny, mm)), _hf_features(hf_model, tiny)
    assert got.shape == want.shape == (sum(TILES) * 4, 64)
    assert max_diff(got, want) < TOL


SCHEDULES = {"prefill": None, "chunked+decode": [10, 13, 25, 7]}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_with_images_match_transformers(tiny, hf_model, schedule):
    """transformers' whole model's logits == our Cohere2's (through ``_TEXT_PARTS``) with the encoder's embeddings on
    the image-token rows, in one prefill and in chunks that split the images' spans then single steps; without the
    embeddings they differ."""
    model = load_model(str(tiny))
    assert type(model).__name__ == "Cohere2ForCausalLM"
    ids, mm = _expand(tiny)
    assert any(10 < item.offset + r < 23 for item in mm.items for r in item.embed_rows)  # a chunk splits an image
    with torch.no_grad():
        want = hf_model(**_inputs(tiny)).logits[0]
    embeds = encoded(tiny, mm)
    got = image_logits(model, ids, mm, embeds, SCHEDULES[schedule])
    assert max_diff(got, want) < TOL
    blind = image_logits(model, ids, mm, [torch.zeros_like(e) for e in embeds], None)
    assert max_diff(blind[mm.items[0].end:], got[mm.items[0].end:]) > MOVED


def _shuffle_transposed(encoder) -> None:
    def features(pixels):
        x = encoder.tower(pixels)
        return pixel_shuffle(x.reshape(len(pixels), encoder.grid, encoder.grid, -1).transpose(1, 2), encoder.fold)
    encoder.features = features


def _gate_halves_swapped(encoder) -> None:
    p = encoder.projector

    def project(features):
        gate, x = p.linear_1(features).chunk(2, dim=-1)
        return p.linear_2(torch.nn.functional.silu(gate) * x)
    encoder.project = project


def _no_post_norm(encoder) -> None:
    encoder.tower.post_layernorm = None


def _one_layer_short(encoder) -> None:  # the hidden state before the last layer, post-normed
    del encoder.tower.encoder.layers[-1]


MUTATIONS = {"shuffle-transposed": _shuffle_transposed, "gate-halves-swapped": _gate_halves_swapped,
             "no-post-layernorm": _no_post_norm, "one-layer-short": _one_layer_short}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_embeddings(tiny, hf_model, mutation):
    _, mm = _expand(tiny)
    got = torch.cat(encoded(tiny, mm, MUTATIONS[mutation]))
    assert max_diff(got, _hf_features(hf_model, tiny)) > MOVED


def _tiles_column_major(processor) -> None:
    tiles = processor.tiles

    def swapped(image):
        out = tiles(image)
        return np.concatenate([out[:-1][::-1], out[-1:]])
    processor.tiles = swapped


def _thumbnail_first(processor) -> None:
    tiles = processor.tiles
    processor.tiles = lambda image: np.roll(tiles(image), 1, axis=0)


def _bilinear(processor, monkeypatch) -> None:
    def resize(x, h, w):
        return torch.nn.functional.interpolate(x[None].float(), size=[h, w], mode="bilinear",
                                               antialias=True)[0].round().to(torch.uint8)
    monkeypatch.setattr(cv, "bicubic_resize", resize)


def _unfused_normalize(processor) -> None:  # rescaled to [0, 1] first, then normalized
    processor.mean, processor.std = processor.mean / 255, processor.std / 255
    tiles = processor.tiles

    def two_steps(image):
        mean, std = processor.mean, processor.std
        processor.mean, processor.std = torch.zeros(3), torch.full((3,), 255.0)
        try:
            x = torch.from_numpy(tiles(image))
        finally:
            processor.mean, processor.std = mean, std
        return ((x - mean[:, None, None]) / std[:, None, None]).numpy()
    processor.tiles = two_steps


PIXEL_MUTATIONS = {"tiles-reversed": _tiles_column_major, "thumbnail-first": _thumbnail_first,
                   "bilinear": _bilinear, "rescale-then-normalize": _unfused_normalize}


@pytest.mark.parametrize("mutation", sorted(PIXEL_MUTATIONS))
def test_each_pixel_step_shows_in_the_digests(tiny, mutation, monkeypatch):
    """Each step of the torch redo of transformers' image processor, done otherwise, changes the tiles' bits."""
    processor = load_image_processor(str(tiny))
    step = PIXEL_MUTATIONS[mutation]
    step(processor, monkeypatch) if mutation == "bilinear" else step(processor)
    _, mm = _expand(tiny, processor)
    assert [_digest(item.data["pixel_values"]) for item in mm.items] != DIGESTS


@pytest.mark.parametrize("change,words", [
    (("vision_config", "model_type", "siglip2_vision_model"), "vision_config.model_type='siglip2_vision_model'"),
    ((None, "downsample_factor", 3), "downsample_factor=3"),
    ((None, "alignment_intermediate_size", 95), "alignment_intermediate_size=95")])
def test_unsupported_settings_are_refused(tiny, change, words):
    config = read_config(str(tiny))
    part, field, value = change
    setattr(config if part is None else getattr(config, part), field, value)
    with pytest.raises(ValueError) as err:
        cv.Cohere2VisionImageEncoder(config)
    assert words in str(err.value)


@pytest.mark.parametrize("setting,words", [
    ({"size": {"height": 56, "width": 56}}, "size="), ({"size": {"height": 28, "width": 56}}, "size="),
    ({"patch_size": 4}, "patch_size=4"), ({"resample": 2}, "resample=2"), ({"do_normalize": False}, "do_normalize"),
    ({"do_resize": False}, "do_resize")])
def test_unsupported_processor_settings_are_refused(tiny, tmp_path, setting, words):
    folder = shutil.copytree(tiny, tmp_path / "m")
    (folder / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, **setting}))
    with pytest.raises(ValueError) as err:
        load_image_processor(str(folder))
    assert words in str(err.value)


def test_mismatches_are_refused(tiny):
    """A config whose image_token_id is not the tokenizer's image token, and a checkpoint missing a projector or
    post-norm tensor, are refused by name."""
    from safetensors.torch import load_file

    config = read_config(str(tiny))
    config.image_token_id = 7
    with pytest.raises(ValueError, match="image_token_id=7"):
        cv.Cohere2VisionImageProcessor.from_pretrained(tiny, config)
    tensors = load_file(str(tiny / "model.safetensors"))
    for gone in ("multi_modal_projector.linear_2.bias", "post_layernorm.weight"):
        with pytest.raises(ValueError, match=gone.split(".")[-2]):
            cv.Cohere2VisionImageEncoder(config).load_weights(
                (n, t) for n, t in tensors.items() if not n.endswith(gone))
    assert cv.tokens_per_tile(config) == 4


def test_a_one_tile_image_has_no_thumbnail(tiny):
    """A square image smaller than a tile makes one tile and no thumbnail; ``crop_to_patches`` off makes one tile of
    any image."""
    from PIL import Image

    processor = load_image_processor(str(tiny))
    square = Image.fromarray(np.random.RandomState(1).randint(0, 255, (20, 20, 3), dtype=np.uint8))
    done = processor.process(square)
    assert done.data["pixel_values"].shape == (1, 3, TILE, TILE) and len(done.replacement) == 1 + 5 + 1
    processor.crop = False
    assert processor.process(_images()[0]).data["pixel_values"].shape == (1, 3, TILE, TILE)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def test_engine_greedy_with_images_equals_transformers(tiny, hf_model):
    """``LLM.generate`` with two images (12-token prefill chunks splitting them, n-gram drafts) gives transformers'
    greedy ``generate`` tokens; without the images transformers generates other tokens."""
    from specray import LLM
    from specray_test_engine_runs import assert_images_greedy_equals_transformers  # tests/engine_runs.py

    llm = LLM(model=str(tiny), max_model_len=256, block_size=4, max_num_batched_tokens=12, speculative_config=NGRAM)
    assert_images_greedy_equals_transformers(llm, hf_model, None, PROMPT, _images(), inputs=_inputs(tiny))


def test_tensor_parallel_two_ranks_equal_one(tiny, tmp_path):
    """The Cohere2 text model split over two tensor-parallel ranks (the encoder replicated on each) gives one rank's
    logits with the images' rows in place, a prefill chunk (15 tokens) ending inside an image's span."""
    ids, mm = _expand(tiny)
    assert_ranks_equal_one_rank(tmp_path, [(tiny, ids, mm, [15, len(ids) - 15])], 1, TOL)
