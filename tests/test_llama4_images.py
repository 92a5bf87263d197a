"""Llama 4's images (``Llama4ForConditionalGeneration``: :mod:`specray.models.llama4_vision` before the text model of
:mod:`specray.models.llama4`), against transformers on the same tiny random fp32 weights: our processor's expanded
prompt equals ``Llama4Processor``'s expansion for images of three tile grids (1 x 3 tiles and a global tile, 2 x 1 and
a global tile, a single tile) and its pixels equal transformers' ``Llama4ImageProcessor``'s (a torchvision image
processor: compared live where torchvision imports, and always against the digests of its output recorded with
torchvision 0.28); each image's embeddings equal ``get_image_features`` + ``multi_modal_projector``; the text model's
logits with those rows in place of the ``<|patch|>`` tokens equal transformers' whole model's for a prefill and for
chunks that split the images' spans (chunked local attention of 16 tokens, NoPE layers with temperature tuning, MoE);
the engine's greedy tokens with images (n-gram drafts, chunks splitting the spans) and ``LLM.chat`` with an image_url
part equal transformers' ``generate``; two tensor-parallel ranks equal one; each part of the tower broken once moves
the embeddings; what is not implemented is refused by name. No GPU check here."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache
from specray.multimodal import expand_prompt, step_rows
from specray_test_image_checks import (private_env, assert_ranks_equal_one_rank, config_with,  # tests/image_checks.py
                                       first_cut, random_images)
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the embeddings at least this much (a hundred times TOL)
TILE, PATCH = 28, 7  # 16 patches a tile, 4 <|patch|> tokens after the pixel shuffle
TOKENS = ("<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
          "<|tile_y_separator|>", "<|header_start|>", "<|header_end|>", "<|eot|>")
# (height, width): a 1 x 3 canvas (3 tiles and the global one), a 2 x 1 canvas (2 and the global), a single tile
SHAPES = ((30, 70), (50, 20), (20, 20))
GRIDS = ((1, 3), (2, 1), (1, 1))
# sha256 of each image's pixel_values as transformers' Llama4ImageProcessor (torchvision 0.28, on an AVX2 CPU) makes
# them (float32 bytes of its bfloat16 values)
DIGESTS = ("1c37973b24f34dba56deb2fe560ef00c7b317e84f5fe7e0f7047be30f8ba0d64",
           "1e4231e542a76fef27b2600d645978d57d62892e54ca009dea85f754a25251b9",
           "371f6f514d339bf30e074e60f41fc5bd4a5ccd1a4d6a7a41d3bfb052a67d4b01")
PROMPT = "Look at <|image|> and then <|image|>, the quick brown fox jumps"
TEXT = dict(hidden_size=64, intermediate_size=64, intermediate_size_mlp=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
            attention_chunk_size=16, no_rope_layer_interval=2, floor_scale=4, attn_scale=0.5,
            max_position_embeddings=512, rms_norm_eps=1e-5)
VISION = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=TILE,
              patch_size=PATCH, vision_output_dim=48, projector_input_dim=48, projector_output_dim=48,
              pixel_shuffle_ratio=0.5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
IMAGE_SETTINGS = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                  "image_processor_type": "Llama4ImageProcessor", "max_patches": 4, "resample": 2,
                  "rescale_factor": 1 / 255, "resize_to_max_canvas": False, "size": {"height": TILE, "width": TILE}}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def images() -> list:
    return random_images(SHAPES, legacy=True)


def build_tiny_llama4(path: Path, seed: int = 0) -> Path:
    """transformers' Llama4ForConditionalGeneration (4 text layers: RoPE + chunked attention and NoPE + temperature
    tuning alternating, MoE every other layer; a 2-layer vision model of 28-pixel tiles), conftest's tiny tokenizer
    with Llama 4's image tokens, and the processor's settings as ``Llama4Processor.save_pretrained`` writes them
    (written here: transformers' Llama 4 image processor needs torchvision to be built)."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=TOKENS)
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    config = Llama4Config(text_config={**TEXT, **ids}, vision_config=VISION,
                          image_token_index=tok.convert_tokens_to_ids("<|patch|>"),
                          boi_token_index=tok.convert_tokens_to_ids("<|image_start|>"),
                          eoi_token_index=tok.convert_tokens_to_ids("<|image_end|>"))
    torch.manual_seed(seed)
    model = Llama4ForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # the tower's and projector's weights at unit scale, norms and embeddings away from init
        for name, param in model.named_parameters():
            if name.startswith(("vision_model.", "multi_modal_projector.")):
                if param.dim() == 1:
                    param.normal_(0.3, 0.5)
                else:  # queries and keys larger: sharper attention, where the 2D RoPE shows
                    sharp = 3.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                    param.normal_(0.0, sharp * param.shape[-1] ** -0.5)
    model.save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps(
        {"fake_image_token": "<|image|>", "image_token": "<|image|>", "image_processor": IMAGE_SETTINGS,
         "patch_size": PATCH, "processor_class": "Llama4Processor"}, indent=2))
    return path


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory) -> Path:
    return build_tiny_llama4(tmp_path_factory.mktemp("tiny_llama4_images"))


@pytest.fixture(scope="module")
def hf_model(llama4_dir):
    from transformers import Llama4ForConditionalGeneration

    return Llama4ForConditionalGeneration.from_pretrained(llama4_dir, dtype=torch.float32).eval()


def our_processor(folder: Path):
    from specray.models.loader import read_config
    from specray.models.llama4_vision import Llama4ImageProcessor

    return Llama4ImageProcessor.from_pretrained(folder, read_config(str(folder)))


def our_encoder(folder: Path, dtype: torch.dtype = torch.float32):
    from specray.models.loader import load_image_encoder, read_config

    return load_image_encoder(str(folder), read_config(str(folder)), dtype, "cpu")


def expanded(folder: Path, text: str = PROMPT, imgs: list | None = None):
    from transformers import AutoTokenizer

    imgs = images()[:2] if imgs is None else imgs
    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text), imgs, our_processor(folder))


def transformers_expansion(folder: Path, text: str, grids, per_tile: int = 4) -> list[int]:
    """``Llama4Processor``'s expanded prompt ids for images of ``grids`` (its own replacement strings)."""
    from transformers import AutoTokenizer
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    pieces = text.split("<|image|>")
    assert len(pieces) == len(grids) + 1
    out = pieces[0]
    for grid, piece in zip(grids, pieces[1:]):
        out += Llama4Processor._prompt_split_image(None, grid, per_tile) + piece
    return AutoTokenizer.from_pretrained(folder).encode(out)


def pixels(mm) -> torch.Tensor:
    return torch.cat([torch.from_numpy(item.data["pixel_values"]) for item in mm.items])


# ---- the processor -------------------------------------------------------------------------------------------------

def test_processor_expands_as_llama4_processor(llama4_dir):
    """Three images of three grids: our expanded prompt equals Llama4Processor's (22 tokens for 1 x 3 tiles: start,
    3 x 4 patches, 2 x-separators, a y-separator, <|image|>, the global tile's 4, end; 17 for 2 x 1; 7 for one tile),
    only the <|patch|> rows take embeddings, in tile order (global last), and the tiles are as many."""
    text = "A <|image|> B <|image|> C <|image|> D"
    ids, mm = expanded(llama4_dir, text, images())
    assert ids == transformers_expansion(llama4_dir, text, GRIDS)
    patch = our_processor(llama4_dir).tokens["<|patch|>"]
    assert [item.length for item in mm.items] == [22, 17, 7]
    for item, (rows, cols) in zip(mm.items, GRIDS):
        span = ids[item.offset:item.end]
        assert item.embed_rows == [i for i, t in enumerate(span) if t == patch]
        tiles = rows * cols + (rows * cols > 1)
        assert item.num_embeds == 4 * tiles and item.data["pixel_values"].shape == (tiles, 3, TILE, TILE)
        assert not item.bidirectional and mm.rope_positions is None


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


def test_pixels_equal_recorded_transformers_digests(llama4_dir):
    """Each image's tiles hash to what transformers' Llama4ImageProcessor made of it (recorded with torchvision:
    see the live test below); and they are -1 where the canvas is padded."""
    import platform

    if not (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
            or platform.machine() in ("aarch64", "arm64")):
        pytest.skip("the digests were recorded where torchvision resizes uint8 natively (AVX2); this CPU resizes in "
                    "float32, as torchvision would here")
    _, mm = expanded(llama4_dir, "<|image|> <|image|> <|image|>", images())
    assert tuple(_digest(item.data["pixel_values"]) for item in mm.items) == DIGESTS
    first = mm.items[0].data["pixel_values"]  # 30 x 70 resized to 28 x 65 on an 84-wide canvas: the last columns pad
    assert (first[2, :, :, -19:] == -1).all() and not (first[2, :, :, :-19] == -1).all()


REFERENCE = textwrap.dedent("""
    import json, sys
    import numpy as np, torch
    from PIL import Image
    from transformers import AutoProcessor
    folder = sys.argv[1]
    rng = np.random.RandomState(0)
    imgs = [Image.fromarray(rng.randint(0, 255, (*s, 3), dtype=np.uint8)) for s in %r]
    out = AutoProcessor.from_pretrained(folder)(text="A <|image|> B <|image|> C <|image|> D", images=imgs,
                                                return_tensors="pt")
    np.save(sys.argv[2], out["pixel_values"].float().numpy())
    json.dump({"ids": out["input_ids"][0].tolist()}, open(sys.argv[3], "w"))
""" % (SHAPES,))


def test_processor_equals_transformers_live(llama4_dir, tmp_path):
    """Where torchvision imports (transformers' Llama 4 image processor needs it; ``LLAMA4_TORCHVISION_PATH`` may
    name a folder holding it), transformers' own processor over the three images gives our prompt and pixels."""
    env = private_env(["LLAMA4_TORCHVISION_PATH"], "torchvision", "transformers' Llama4ImageProcessor")
    script = tmp_path / "reference.py"
    script.write_text(REFERENCE)
    subprocess.run([sys.executable, str(script), str(llama4_dir), str(tmp_path / "px.npy"), str(tmp_path / "o.json")],
                   env=env, check=True, capture_output=True, timeout=120)
    want = json.loads((tmp_path / "o.json").read_text())
    ids, mm = expanded(llama4_dir, "A <|image|> B <|image|> C <|image|> D", images())
    assert ids == want["ids"]
    assert np.array_equal(pixels(mm).numpy(), np.load(tmp_path / "px.npy"))


# ---- the encoder ---------------------------------------------------------------------------------------------------

def transformers_rows(hf, pixel_values: torch.Tensor) -> torch.Tensor:
    """What transformers scatters over the <|patch|> tokens: the projector of get_image_features, flattened."""
    with torch.no_grad():
        features = hf.get_image_features(pixel_values=pixel_values).last_hidden_state
        return hf.multi_modal_projector(features.reshape(-1, features.shape[-1]))


def transformers_embeds(hf, ids: list[int], pixel_values: torch.Tensor) -> torch.Tensor:
    """transformers' whole model's input embeddings [1, L, H]: the prompt's, the image rows scattered over its
    ``image_token_index`` tokens, as its forward makes them (its forward then fails in transformers 5.24 on returning
    ``outputs.image_outputs``, which the text model's output lacks: the text model is run on these directly)."""
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        embeds = hf.get_input_embeddings()(input_ids)
        rows = transformers_rows(hf, pixel_values)
        return embeds.masked_scatter(hf.get_placeholder_mask(input_ids, embeds, rows), rows)


def transformers_generate(hf, ids: list[int], pixel_values: torch.Tensor, steps: int) -> list[int]:
    """transformers' greedy tokens after the prompt with its images (its text model's ``generate`` from the whole
    model's input embeddings)."""
    with torch.no_grad():
        out = hf.language_model.generate(inputs_embeds=transformers_embeds(hf, ids, pixel_values),
                                         max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)
    return out[0, -steps:].tolist()


def test_encoder_equals_transformers_image_features(llama4_dir, hf_model):
    """Each image's embeddings (its tiles, the global one last) equal transformers' rows for it."""
    _, mm = expanded(llama4_dir, "<|image|> <|image|> <|image|>", images())
    encoder = our_encoder(llama4_dir)
    assert encoder.deepstack_layers == 0
    for item in mm.items:
        data = torch.from_numpy(item.data["pixel_values"])
        with torch.no_grad():
            got = encoder.encode({"pixel_values": data})
        want = transformers_rows(hf_model, data)
        assert got.shape == want.shape == (item.num_embeds, 64)
        assert max_diff(got, want) < TOL


def test_encoder_in_bfloat16(llama4_dir, hf_model):
    """Built under bfloat16 (the runner hands it bf16 pixels), within bf16's rounding of transformers' fp32 rows."""
    _, mm = expanded(llama4_dir)
    encoder = our_encoder(llama4_dir, torch.bfloat16)
    data = torch.from_numpy(mm.items[0].data["pixel_values"])
    with torch.no_grad():
        got = encoder.encode({"pixel_values": data.to(torch.bfloat16)})
    want = transformers_rows(hf_model, data)
    assert got.dtype == torch.bfloat16 and max_diff(got.float(), want) / want.abs().max().item() < 5e-2


# ---- the whole model -----------------------------------------------------------------------------------------------

def run_with_images(model, encoder, ids, mm, sizes, rows_of=None) -> torch.Tensor:
    """Our text model's logits of ``ids`` in chunks of ``sizes`` over a paged cache, each step's image rows taking
    the encoder's embeddings (``meta.input_embeds``) as the runner hands them (``rows_of``: a mistake in which rows)."""
    embeds = [encoder.encode({"pixel_values": torch.from_numpy(item.data["pixel_values"])}) for item in mm.items]
    allocate_kv_cache(model, 64, 4)
    table = random.Random(0).sample(range(64), -(-len(ids) // 4))
    out, start = [], 0
    for n in sizes:
        meta = build_attention_metadata([n], [start], [table], 4, model.device)
        rows, values = [], []
        for item, embed in zip(mm.items, embeds):
            positions, indices = (rows_of or step_rows)(item, start, start + n)
            rows += [p - start for p in positions]
            values.append(embed[indices])
        if rows:
            meta.input_embeds = (torch.tensor(rows), torch.cat(values))
        with torch.no_grad():
            out.append(model.compute_logits(model(torch.tensor(ids[start: start + n]), meta)))
        start += n
    assert start == len(ids)
    return torch.cat(out)


def _shifted_rows(item, start, stop):  # each embedding one row late (onto the separators and <|image_end|>)
    positions, indices = step_rows(item, start - 1, stop - 1)
    return [p + 1 for p in positions], indices


@pytest.mark.parametrize("schedule", ["prefill", "chunked+decode"])
def test_logits_with_images_equal_transformers(llama4_dir, hf_model, schedule):
    """The text model (served from the whole checkpoint through _TEXT_PARTS) fed the encoder's rows equals
    transformers' whole model over the expanded prompt with both images: one prefill, and chunks that start and end
    inside the images' spans, then single steps; the rows one token off, or left out, differ."""
    from specray.models.loader import load_model

    ids, mm = expanded(llama4_dir)
    first, second = mm.items
    cuts = [first.offset + 5, second.offset + 9 - (first.offset + 5), 2]  # inside image 1, inside image 2, past it
    sizes = [len(ids)] if schedule == "prefill" else cuts + [1] * (len(ids) - sum(cuts))
    model, encoder = load_model(str(llama4_dir)), our_encoder(llama4_dir)
    got = run_with_images(model, encoder, ids, mm, sizes)
    with torch.no_grad():
        want = hf_model.language_model(inputs_embeds=transformers_embeds(hf_model, ids, pixels(mm))).logits[0]
    assert len(ids) > 2 * 16 and max_diff(got, want) < TOL  # spans more than two attention chunks
    if schedule == "prefill":
        assert max_diff(run_with_images(model, encoder, ids, mm, sizes, _shifted_rows), want) > MOVED
        assert max_diff(run_with_images(model, encoder, ids, mm, sizes, lambda *a: ([], [])), want) > MOVED


# ---- each part shows -----------------------------------------------------------------------------------------------

def _zero(name):
    def mutate(encoder, monkeypatch):
        encoder.get_parameter(name).data.zero_()
    return mutate


def _identity(path):
    def mutate(encoder, monkeypatch):
        parent, name = path.rsplit(".", 1)
        setattr(encoder.get_submodule(parent), name, torch.nn.Identity())
    return mutate


def _rope(offset: int = 1, swapped: bool = False):
    def mutate(encoder, monkeypatch):
        from specray.models.llama4_vision import rope_angles

        tower = encoder.vision
        angles = rope_angles(TILE // PATCH, VISION["hidden_size"] // VISION["num_attention_heads"], 10000.0, offset)
        if swapped:  # rows first, columns second
            half = angles.shape[-1] // 2
            angles = torch.cat([angles[..., half:], angles[..., :half]], dim=-1)
        tower.rope_cos, tower.rope_sin = angles.cos(), angles.sin()
    return mutate


def _no_rope(encoder, monkeypatch):
    encoder.vision.rope_cos.fill_(1.0)
    encoder.vision.rope_sin.zero_()


def _class_token_first(encoder, monkeypatch):  # the class token in front of the patches (CLIP's place)
    tower = encoder.vision

    def forward(pixel_values):  # the tower's forward with the class token first, dropped from the front
        x = tower.patch_embedding.linear(torch.nn.functional.unfold(pixel_values, PATCH, stride=PATCH).transpose(1, 2))
        x = torch.cat([tower.class_embedding.expand(x.shape[0], 1, -1), x], dim=1) + tower.positional_embedding_vlm
        x = tower._ln(tower.layernorm_pre, x)
        for layer in tower.model.layers:
            x = layer(x, tower.rope_cos, tower.rope_sin)
        return tower.vision_adapter(tower._ln(tower.layernorm_post, x)[:, 1:])
    monkeypatch.setattr(tower, "forward", forward)


def _plain_shuffle(encoder, monkeypatch):  # 4 consecutive patches of a row folded, not a 2 x 2 block
    import specray.models.llama4_vision as module

    monkeypatch.setattr(module, "pixel_shuffle", lambda x, ratio: x.reshape(x.shape[0], -1, x.shape[-1] * 4))


def _no_last_gelu(encoder, monkeypatch):
    from specray.models.llama4_vision import pixel_shuffle

    adapter = encoder.vision.vision_adapter
    mlp = adapter.mlp
    monkeypatch.setattr(adapter, "forward", lambda x: mlp.fc2(torch.nn.functional.gelu(mlp.fc1(pixel_shuffle(x, 0.5)))))


def _quick_gelu(encoder, monkeypatch):  # CLIP's sigmoid GELU for the exact one (tower and adapter)
    import specray.models.llama4_vision as module

    monkeypatch.setattr(module, "_exact_gelu", lambda x: x * torch.sigmoid(1.702 * x))
    for layer in encoder.vision.model.layers:
        layer.mlp.act = module._exact_gelu


MUTATIONS = {"class embedding": _zero("vision.class_embedding"), "class token first": _class_token_first,
             "position embedding": _zero("vision.positional_embedding_vlm"), "2D RoPE": _no_rope,
             "RoPE axes (columns first)": _rope(swapped=True), "RoPE from 0 (not 1)": _rope(offset=0),
             "layernorm_pre": _identity("vision.layernorm_pre"), "layernorm_post": _identity("vision.layernorm_post"),
             "pixel shuffle's 2 x 2 blocks": _plain_shuffle, "adapter's last GELU": _no_last_gelu,
             "exact GELU": _quick_gelu, "attention biases": _zero("vision.model.layers.0.self_attn.k_proj.bias")}


@pytest.mark.parametrize("part", sorted(MUTATIONS))
def test_each_part_shows_in_the_embeddings(llama4_dir, hf_model, monkeypatch, part):
    """Each distinctive part of the tower switched off (or done another way) moves the embeddings away from
    transformers'."""
    _, mm = expanded(llama4_dir)
    data = torch.from_numpy(mm.items[1].data["pixel_values"])
    encoder = our_encoder(llama4_dir)
    MUTATIONS[part](encoder, monkeypatch)
    with torch.no_grad():
        got = encoder.encode({"pixel_values": data})
    assert max_diff(got, transformers_rows(hf_model, data)) > MOVED


# ---- refusals ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,words", [
    (dict(vision_config__model_type="clip_vision_model"), "vision_config.model_type='clip_vision_model'"),
    (dict(vision_config__hidden_act="silu"), "vision_config.hidden_act='silu'"),
    (dict(vision_config__multi_modal_projector_bias=True), "multi_modal_projector_bias=True"),
    (dict(vision_config__pixel_shuffle_ratio=0.3), "pixel_shuffle_ratio=0.3"),
    (dict(vision_config__image_size=30), "image_size=30"),
    (dict(vision_config__rope_parameters={"rope_type": "linear", "rope_theta": 1.0}), "rope_type='linear'")])
def test_unsupported_model_settings_are_refused(llama4_dir, change, words):
    from specray.models.llama4_vision import Llama4ImageEncoder

    with pytest.raises(ValueError) as err:
        Llama4ImageEncoder(config_with(llama4_dir, **change))
    assert words in str(err.value)


@pytest.mark.parametrize("settings,words", [
    ({"size": {"height": 32, "width": 32}}, "size={'height': 32, 'width': 32}"),
    ({"resample": 3}, "resample=3"),
    ({"do_resize": False}, "do_resize=False"),
    ({"patch_size": 14}, "patch_size=14"),
    ({"image_token_index": 0}, "image_token_index=0")])
def test_unsupported_processor_settings_are_refused(llama4_dir, tmp_path, settings, words):
    from specray.models.llama4_vision import Llama4ImageProcessor

    folder = shutil.copytree(llama4_dir, tmp_path / "f")
    saved = json.loads((folder / "processor_config.json").read_text())
    config = config_with(folder)
    if "patch_size" in settings:
        saved.update(settings)
    elif "image_token_index" in settings:
        config.image_token_index = settings["image_token_index"]
    else:
        saved["image_processor"].update(settings)
    (folder / "processor_config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError) as err:
        Llama4ImageProcessor.from_pretrained(folder, config)
    assert words in str(err.value)


def test_inconsistent_adapter_widths_refuse_images_only(llama4_dir):
    """An adapter whose widths cannot take the pixel shuffle's output (transformers builds it and fails on an image):
    the encoder is built (the engine still serves the text), its processor and its encode refuse by name."""
    from specray.models.llama4_vision import Llama4ImageEncoder, Llama4ImageProcessor

    config = config_with(llama4_dir, vision_config__intermediate_size=96)
    encoder = Llama4ImageEncoder(config)
    with pytest.raises(ValueError, match="intermediate_size=96"):
        Llama4ImageProcessor.from_pretrained(llama4_dir, config)
    with pytest.raises(ValueError, match="intermediate_size=96"):
        encoder.encode({"pixel_values": torch.zeros(1, 3, TILE, TILE)})


def test_missing_tensors_and_wrong_tiles_are_refused(llama4_dir):
    from safetensors.torch import load_file

    from specray.models.llama4_vision import Llama4ImageEncoder

    encoder = Llama4ImageEncoder(config_with(llama4_dir))
    tensors = load_file(str(llama4_dir / "model.safetensors"))
    for gone in ("vision_model.model.layers.1.mlp.fc2.bias", "multi_modal_projector.linear_1.weight",
                 "vision_model.vision_adapter.mlp.fc1.weight"):
        with pytest.raises(ValueError, match=gone.replace(".", r"\.")):
            encoder.load_weights((n, t) for n, t in tensors.items() if n != gone)
    encoder.load_weights(tensors.items())
    with pytest.raises(ValueError, match="vision_config.image_size=28"):
        encoder.encode({"pixel_values": torch.zeros(2, 3, 42, 42)})


# ---- the engine ----------------------------------------------------------------------------------------------------

def test_engine_with_images_equals_transformers_generate(llama4_dir, hf_model):
    """LLM.generate with images (prefill chunks of 7 tokens, so every image's span is split; n-gram drafts; prefix
    caching) gives transformers' greedy generate of the whole model, token for token; the same prompt with the
    images swapped gets its own output."""
    from specray import LLM, SamplingParams

    llm = LLM(model=str(llama4_dir), max_model_len=160, block_size=4, max_num_batched_tokens=7,
              enable_prefix_caching=True, speculative_config=NGRAM)
    a, b, c = images()
    prompts = [(PROMPT, [a, b]), ("Hello <|image|> world!", [c]), (PROMPT, [b, a])]
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in prompts],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for (text, imgs), out in zip(prompts, outs, strict=True):
        ids, mm = expanded(llama4_dir, text, imgs)
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == transformers_generate(hf_model, ids, pixels(mm), 24), text
    assert outs[0].outputs[0].token_ids != outs[2].outputs[0].token_ids
    assert llm.spec_stats.accepted_tokens > 0


def test_chat_with_an_image_url_equals_transformers_generate(llama4_dir, hf_model):
    """LLM.chat with an image_url part (a data: URL) under the release's chat template (Llama4Processor's) renders
    the <|image|> placeholder where the part is and answers what transformers' generate answers for that prompt."""
    from transformers.models.llama4.processing_llama4 import chat_template

    from specray import LLM, SamplingParams

    buffer = io.BytesIO()
    images()[0].save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in"},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": " the picture?"}]}]
    llm = LLM(model=str(llama4_dir), max_model_len=160, block_size=4, max_num_batched_tokens=16)
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                   chat_template=chat_template)[0]
    from PIL import Image

    image = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "What is in"},
                                                                 {"type": "image"},
                                                                 {"type": "text", "text": " the picture?"}]}],
                                   chat_template=chat_template, tokenize=False, add_generation_prompt=True)
    ids, mm = expanded(llama4_dir, text, [image])
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == transformers_generate(hf_model, ids, pixels(mm), 8)


# ---- tensor parallel -----------------------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(llama4_dir, tmp_path):
    """The text model split over two tensor-parallel ranks (the encoder replicated on each) gives one rank's logits
    with the images' rows in place: PROMPT's with two images, a prefill chunk ending inside the first image's span,
    then the rest."""
    ids, mm = expanded(llama4_dir)
    cut = first_cut(mm)
    assert_ranks_equal_one_rank(tmp_path, [(llama4_dir, ids, mm, [cut, len(ids) - cut])], 1, TOL)
