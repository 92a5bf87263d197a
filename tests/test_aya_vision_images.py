"""Aya Vision's images (``AyaVisionForConditionalGeneration``: :mod:`specray.models.aya_vision`), against transformers
on the same tiny random fp32 weights: our processor's expansion of ``<image>`` (``<|START_OF_IMG|>``, ``TILE_<i>`` and
patch tokens per tile, ``TILE_GLOBAL`` and the thumbnail's, ``<|END_OF_IMG|>``) and tiles equal
``AyaVisionProcessor``'s for two images of different aspect; each image's embeddings equal ``get_image_features`` (max
abs diff < 1e-4); the Cohere2 text model's logits with those embeddings on the patch rows equal transformers' whole
model's for a prefill and for chunks that split the images' spans (the text config's ``logit_scale`` 0.5 unapplied, as
transformers' composite model leaves it); each distinctive part broken once moves the embeddings; what is not
implemented is refused by name; the engine's greedy tokens with images (n-gram drafts, chunks splitting the images)
equal transformers' ``generate``; two tensor-parallel ranks equal one. No GPU check here."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models.attention import build_attention_metadata
from specray.models.aya_vision import AyaVisionImageEncoder, AyaVisionImageProcessor, tokens_per_tile
from specray.models.internvl import pixel_shuffle
from specray.models.kv_cache import allocate_kv_cache
from specray.models.loader import load_image_encoder, load_image_processor, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import assert_ranks_equal_one_rank, random_images  # tests/image_checks.py
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2
TILE, PATCH, FACTOR = 28, 7, 2  # a 4 x 4 patch grid, 4 tokens a tile
PROMPT = "Look at <image> and then at <image>, the quick brown fox jumps"
SPECIAL = ("<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>")
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, logit_scale=0.5, sliding_window=16, tie_word_embeddings=True)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=TILE,
              patch_size=PATCH, layer_norm_eps=1e-6)


def _images() -> list:
    return random_images([(40, 64), (64, 48)], legacy=True)


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


def build_tiny_aya(path: Path, seed: int = 0, **changes) -> Path:
    """transformers' AyaVisionForConditionalGeneration (SigLIP tower, feature layer -2, a Cohere2 text model whose
    head is tied), saved with AyaVisionProcessor (GotOcr2's 28-pixel tiles, up to 4) and conftest's tiny tokenizer."""
    from transformers import (AyaVisionConfig, AyaVisionForConditionalGeneration, AyaVisionProcessor, Cohere2Config,
                              GotOcr2ImageProcessorPil, SiglipVisionConfig)

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=SPECIAL)
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    config = AyaVisionConfig(text_config=Cohere2Config(**ids, **TEXT), vision_config=SiglipVisionConfig(**VISION),
                             downsample_factor=FACTOR, image_token_index=tok.convert_tokens_to_ids("<|IMG_PATCH|>"),
                             vision_feature_layer=-2, alignment_intermediate_size=96, adapter_layer_norm_eps=1e-5,
                             **changes)
    torch.manual_seed(seed)
    model = AyaVisionForConditionalGeneration(config).float().eval()
    _visible(model)
    model.save_pretrained(path)
    AyaVisionProcessor(image_processor=GotOcr2ImageProcessorPil(size={"height": TILE, "width": TILE}, max_patches=4),
                       tokenizer=tok, patch_size=PATCH, img_size=TILE, downsample_factor=FACTOR).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_aya(tmp_path_factory) -> Path:
    return build_tiny_aya(tmp_path_factory.mktemp("tiny_aya"))


@pytest.fixture(scope="module")
def hf_model(tiny_aya):
    from transformers import AyaVisionForConditionalGeneration

    return AyaVisionForConditionalGeneration.from_pretrained(tiny_aya, dtype=torch.float32).eval()


def _hf_inputs(folder: Path, text: str = PROMPT) -> dict:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder)(text=text, images=_images(), return_tensors="pt")


def _expand(folder: Path, processor):
    from transformers import AutoTokenizer

    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(PROMPT), _images(), processor)


def test_processor_matches_transformers(tiny_aya):
    """Two images of different aspect (3 and 5 tiles): our expanded prompt equals AyaVisionProcessor's, the patch rows
    take the embeddings, the tiles equal transformers' pixel_values."""
    config = read_config(str(tiny_aya))
    processor = load_image_processor(str(tiny_aya), config)
    assert isinstance(processor, AyaVisionImageProcessor) and processor.patch_id == config.image_token_index
    want = _hf_inputs(tiny_aya)
    ids, mm = _expand(tiny_aya, processor)
    assert ids == want["input_ids"][0].tolist() and mm.rope_positions is None
    tiles = 0
    for item, count in zip(mm.items, (3, 5)):
        assert [ids[item.offset + r] for r in item.embed_rows] == [processor.patch_id] * (4 * count)
        pixels = item.data["pixel_values"]
        assert len(pixels) == count and np.array_equal(pixels, want["pixel_values"][tiles:tiles + count].numpy())
        tiles += count
    assert tiles == len(want["pixel_values"])


def _hf_features(hf, inputs) -> torch.Tensor:
    with torch.no_grad():
        return hf.model.get_image_features(inputs["pixel_values"]).pooler_output.flatten(0, 1)


def _encode(encoder, folder: Path) -> torch.Tensor:
    _, mm = _expand(folder, load_image_processor(str(folder)))
    with torch.no_grad():
        return torch.cat([encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()}) for item in mm.items])


def test_encoder_matches_transformers(tiny_aya, hf_model):
    """Each image's embeddings (all its tiles') equal transformers' ``get_image_features``; the tower is built as
    deep as feature layer -2 (two of three layers)."""
    encoder = load_image_encoder(str(tiny_aya), read_config(str(tiny_aya)), torch.float32, "cpu")
    assert isinstance(encoder, AyaVisionImageEncoder) and len(encoder.tower.encoder.layers) == 2
    got, want = _encode(encoder, tiny_aya), _hf_features(hf_model, _hf_inputs(tiny_aya))
    assert got.shape == want.shape == (8 * 4, 64)
    assert max_diff(got, want) < TOL


@torch.no_grad()
def logits_with_images(model, ids: list[int], embeds: dict[int, torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """``model``'s logits of ``ids`` run in chunks of ``sizes`` (the last cut to the prompt) over a paged cache of
    shuffled 4-token blocks, the image rows (``embeds``) handed in as ``meta.input_embeds``."""
    allocate_kv_cache(model, 64, 4)
    table = random.Random(0).sample(range(64), -(-len(ids) // 4))
    out, start = [], 0
    for n in sizes:
        n = min(n, len(ids) - start)
        meta = build_attention_metadata([n], [start], [table], 4, model.device)
        rows = [p for p in range(start, start + n) if p in embeds]
        if rows:
            meta.input_embeds = (torch.tensor([p - start for p in rows]), torch.stack([embeds[p] for p in rows]))
        out.append(model.compute_logits(model(torch.tensor(ids[start:start + n]), meta)))
        start += n
    assert start == len(ids)
    return torch.cat(out)


SCHEDULES = {"prefill": [200], "chunked+decode": [10, 13, 25, 7] + [1] * 8 + [200]}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_with_images_match_transformers(tiny_aya, hf_model, schedule):
    """transformers' whole model's logits == our Cohere2's with the encoder's embeddings on the patch rows, in one
    prefill and in chunks that split the images' spans; without the embeddings they differ."""
    config = read_config(str(tiny_aya))
    model, encoder = load_model(str(tiny_aya)), load_image_encoder(str(tiny_aya), config, torch.float32, "cpu")
    inputs = _hf_inputs(tiny_aya)
    ids, mm = _expand(tiny_aya, load_image_processor(str(tiny_aya), config))
    assert ids == inputs["input_ids"][0].tolist()
    rows = {}
    for item in mm.items:
        with torch.no_grad():
            values = encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()})
        rows.update((item.offset + r, values[i]) for i, r in enumerate(item.embed_rows))
    assert any(10 < p < 23 for p in rows)  # the first chunks split an image's patch rows
    with torch.no_grad():
        want = hf_model(**inputs).logits[0]
    got = logits_with_images(model, ids, rows, SCHEDULES[schedule])
    assert max_diff(got, want) < TOL
    assert max_diff(logits_with_images(model, ids, {}, [len(ids)])[mm.items[0].end:], got[mm.items[0].end:]) > MOVED


def _shuffle_transposed(encoder) -> None:
    def features(pixels):
        x = torch.cat(encoder.tower.hidden_states(pixels, encoder.indices), dim=-1)
        return pixel_shuffle(x.reshape(len(pixels), encoder.grid, encoder.grid, -1).transpose(1, 2), encoder.fold)
    encoder.features = features


def _gate_halves_swapped(encoder) -> None:
    p = encoder.projector

    def project(features):
        gate, x = p.linear_1(p.layernorm(features)).chunk(2, dim=-1)
        return p.linear_2(torch.nn.functional.silu(gate) * x)
    encoder.project = project


def _no_projector_norm(encoder) -> None:
    encoder.projector.layernorm = torch.nn.Identity()


def _last_layer(encoder) -> None:  # feature layer -1 read instead of -2
    encoder.indices = [i + 1 for i in encoder.indices]
    encoder.tower.encoder.layers.append(encoder.tower.encoder.layers[-1])


MUTATIONS = {"shuffle-transposed": _shuffle_transposed, "gate-halves-swapped": _gate_halves_swapped,
             "no-projector-norm": _no_projector_norm, "last-layer": _last_layer}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_embeddings(tiny_aya, hf_model, mutation):
    encoder = load_image_encoder(str(tiny_aya), read_config(str(tiny_aya)), torch.float32, "cpu")
    MUTATIONS[mutation](encoder)
    assert max_diff(_encode(encoder, tiny_aya), _hf_features(hf_model, _hf_inputs(tiny_aya))) > MOVED


@pytest.mark.parametrize("change,words", [
    (("vision_config", "model_type", "clip_vision_model"), "vision_config.model_type='clip_vision_model'"),
    ((None, "vision_feature_select_strategy", "default"), "vision_feature_select_strategy='default'"),
    ((None, "downsample_factor", 3), "downsample_factor=3"),
    ((None, "alignment_intermediate_size", 95), "alignment_intermediate_size=95"),
    ((None, "vision_feature_layer", 7), "vision_feature_layer=7")])
def test_unsupported_settings_are_refused(tiny_aya, change, words):
    config = read_config(str(tiny_aya))
    part, field, value = change
    setattr(config if part is None else getattr(config, part), field, value)
    with pytest.raises(ValueError) as err:
        AyaVisionImageEncoder(config)
    assert words in str(err.value)


def test_mismatches_are_refused(tiny_aya, tmp_path):
    """A processor_config.json of another tile size, a config whose image_token_index is not the patch token, and a
    checkpoint missing a projector tensor are refused by name."""
    folder = shutil.copytree(tiny_aya, tmp_path / "m")
    saved = json.loads((folder / "processor_config.json").read_text())
    (folder / "processor_config.json").write_text(json.dumps({**saved, "img_size": 56}))
    with pytest.raises(ValueError, match="img_size=56"):
        load_image_processor(str(folder))
    config = read_config(str(tiny_aya))
    config.image_token_index = 7
    with pytest.raises(ValueError, match="image_token_index=7"):
        AyaVisionImageProcessor.from_pretrained(tiny_aya, config)
    from safetensors.torch import load_file

    tensors = load_file(str(tiny_aya / "model.safetensors"))
    with pytest.raises(ValueError, match="linear_2.bias"):
        AyaVisionImageEncoder(config).load_weights(
            (n, t) for n, t in tensors.items() if not n.endswith("multi_modal_projector.linear_2.bias"))
    assert tokens_per_tile(config) == 4


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def test_engine_greedy_with_images_equals_transformers(tiny_aya, hf_model):
    """``LLM.generate`` with two images (12-token prefill chunks splitting them, n-gram drafts) gives transformers'
    greedy ``generate`` tokens; transformers without the images generates other tokens."""
    from specray import LLM, SamplingParams

    llm = LLM(model=str(tiny_aya), max_model_len=256, block_size=4, max_num_batched_tokens=12,
              speculative_config=NGRAM)
    outs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": _images()}}],
                        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    inputs = _hf_inputs(tiny_aya)
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = hf_model.generate(**inputs, **kw)
        blind = hf_model.generate(inputs["input_ids"], **kw)
    assert list(outs[0].outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist()
    assert want[0].tolist() != blind[0].tolist()
    assert llm.spec_stats.accepted_tokens > 0


def test_tensor_parallel_two_ranks_equal_one(tiny_aya, tmp_path):
    """The Cohere2 text model split over two tensor-parallel ranks (the encoder replicated on each) gives one rank's
    logits with the images' rows in place, a prefill chunk (15 tokens) ending inside an image's span."""
    ids, mm = _expand(tiny_aya, load_image_processor(str(tiny_aya)))
    assert_ranks_equal_one_rank(tmp_path, [(tiny_aya, ids, mm, [15, len(ids) - 15])], 1, TOL)


def test_a_one_tile_image_has_no_thumbnail(tiny_aya):
    """A square image makes one tile and no thumbnail: ``TILE_GLOBAL`` and its patch tokens alone between the
    markers, as AyaVisionProcessor writes them."""
    from PIL import Image
    from transformers import AutoProcessor

    image = Image.fromarray(np.random.RandomState(1).randint(0, 255, (30, 30, 3), dtype=np.uint8))
    done = load_image_processor(str(tiny_aya)).process(image)
    want = AutoProcessor.from_pretrained(tiny_aya)(text="<image>", images=[image], return_tensors="np")
    assert done.replacement == want["input_ids"][0].tolist() and len(done.embed_rows) == 4
    assert np.array_equal(done.data["pixel_values"], want["pixel_values"])
