"""granite-vision-3.x's layout (``LlavaNextForConditionalGeneration`` with a Granite text model,
:mod:`specray.models.llava_next`) against transformers on tiny random fp32 weights: a SigLIP tower ("full" strategy)
whose hidden states at several ``vision_feature_layer`` indices are concatenated before LLaVA's projector, LLaVA-NeXT's
tiles, unpadding and newlines, and a Granite text model with multipliers other than 1 (``embedding_multiplier``,
``attention_multiplier``, ``residual_multiplier``, ``logits_scaling``).

transformers' Granite base model multiplies its whole ``inputs_embeds`` by ``embedding_multiplier`` after LLaVA-NeXT
has put the image features in it, so the image rows (and the newlines) are scaled too; our text model scales only the
token embeddings, so the encoder scales its rows. The composite model's ``lm_head`` is a plain linear: its logits are
not divided by ``logits_scaling``. Checked: each image's rows equal transformers' merged ``inputs_embeds`` as its
Granite model scales them; the whole model's logits over a prefill and over chunks splitting the images; the engine's
greedy tokens (n-gram drafts, an image just before the first generated token); two tensor-parallel ranks equal one;
LLaVA 1.5's layout with a Granite text model scales its rows too; each of those parts switched off moves the logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specray.models.attention import AttentionMetadata
from specray.multimodal import expand_prompt
from specray_test_image_checks import (assert_ranks_equal_one_rank, encode_items, image_logits,  # tests/image_checks.py
                                       prompt_run, random_images)
from specray_test_model_checks import max_diff

TOL, MOVED = 1e-4, 1e-2
TILE, PATCH = 28, 7
PINPOINTS = [[28, 56], [56, 28], [56, 56], [84, 28]]
PROMPT = "Look at <image> and <image> then the quick brown fox jumps over"
# the last image's rows just before the first generated token: their scale shows in the greedy tokens
ENGINE_PROMPT = "Look at <image> then the quick brown fox jumps over <image>"
# granite-vision-3.2-2b's text: embedding 12, attention 0.015625, residual 0.22, logits 8 (smaller model, other values)
MULTIPLIERS = dict(embedding_multiplier=6.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=4.0)
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.15, **MULTIPLIERS)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, image_size=TILE,
              patch_size=PATCH, layer_norm_eps=1e-5)
SHAPES = ((20, 100), (60, 40))  # 1 x 2 tiles (unpadded by rows), 2 x 2 tiles (unpadded by columns)


def images(count: int = 2) -> list:
    return random_images(SHAPES[:count])


def _randomised(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "multi_modal_projector" in name and name.endswith(".weight"):
                p.normal_(0.0, p.shape[1] ** -0.5)
            elif "norm" in name and name.endswith(".weight") and p.dim() == 1:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("patch_embedding.bias", "image_newline")):
                p.normal_(0.0, 1.0)


def build(path: Path, kind: str) -> Path:
    """transformers' granite-vision-shaped model (``kind`` "next": LLaVA-NeXT, granite-vision's; "llava": LLaVA 1.5's
    layout with the same Granite text model) saved with the tiny tokenizer and its processor."""
    from transformers import (GraniteConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaNextConfig,
                              LlavaNextForConditionalGeneration, LlavaNextProcessor, LlavaProcessor,
                              SiglipImageProcessorPil, SiglipVisionConfig)
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=("<image>",))
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    common = dict(text_config=GraniteConfig(**ids, **TEXT), vision_config=SiglipVisionConfig(**VISION),
                  image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=[-4, -2, -1],
                  vision_feature_select_strategy="full", tie_word_embeddings=True)
    torch.manual_seed(0)
    if kind == "next":
        model = LlavaNextForConditionalGeneration(LlavaNextConfig(image_grid_pinpoints=PINPOINTS, **common))
        pixels = LlavaNextImageProcessorPil(size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE},
                                            image_grid_pinpoints=PINPOINTS)
        processor = LlavaNextProcessor(image_processor=pixels, tokenizer=tok, patch_size=PATCH,
                                       vision_feature_select_strategy="full", num_additional_image_tokens=0)
    else:
        model = LlavaForConditionalGeneration(LlavaConfig(**common))
        pixels = SiglipImageProcessorPil(size={"height": TILE, "width": TILE})
        processor = LlavaProcessor(image_processor=pixels, tokenizer=tok, patch_size=PATCH,
                                   vision_feature_select_strategy="full", num_additional_image_tokens=0)
    model = model.float().eval()
    _randomised(model)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_granite_vision")
    return {kind: build(root / kind, kind) for kind in ("next", "llava")}


@pytest.fixture(scope="module")
def hf_models(folders) -> dict:
    from transformers import AutoModelForImageTextToText

    return {kind: AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
            for kind, folder in folders.items()}


def hf_inputs(folder: Path, count: int = 2) -> dict:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder)(text=PROMPT, images=images(count), return_tensors="pt")


def expanded(folder: Path, count: int = 2):
    from transformers import AutoTokenizer

    from specray.models.loader import load_image_processor

    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(PROMPT), images(count),
                         load_image_processor(str(folder)))


def our_rows(folder: Path, mm) -> list[torch.Tensor]:
    from specray.models.loader import load_image_encoder, read_config

    return encode_items(load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu"), mm)


def test_config_is_granite_visions_shape(folders):
    """The tiny checkpoints have what makes granite-vision distinctive here: a Granite text model with multipliers
    other than 1, several feature layers, SigLIP's tower with every patch kept."""
    from specray.models.loader import read_config

    for folder in folders.values():
        config = read_config(str(folder))
        assert config.text_config.model_type == "granite"
        assert all(getattr(config.text_config, k) == v != 1.0 for k, v in MULTIPLIERS.items())
        assert list(config.vision_feature_layer) == [-4, -2, -1]
        assert config.vision_config.model_type == "siglip_vision_model"


@pytest.mark.parametrize("kind", ["next", "llava"])
def test_rows_equal_what_transformers_first_layer_sees(folders, hf_models, kind):
    """Each image's rows (tiles, unpadding, newlines, several feature layers) times embedding_multiplier (as our
    Granite text model scales them with its tokens') == the hidden states transformers' first Granite decoder layer
    gets at the image's positions (its merged inputs_embeds times embedding_multiplier)."""
    folder, hf = folders[kind], hf_models[kind]
    ids, mm = expanded(folder)
    inputs = hf_inputs(folder)
    assert ids == inputs["input_ids"][0].tolist()
    seen = []

    def grab(module, args, kwargs):
        seen.append(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    hook = hf.model.language_model.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            hf(**inputs)
    finally:
        hook.remove()
    for item, mine in zip(mm.items, our_rows(folder, mm), strict=True):
        assert max_diff(mine * MULTIPLIERS["embedding_multiplier"], seen[0][0, item.offset:item.end]) < TOL


@pytest.mark.parametrize("schedule", ["prefill", "chunked+decode"])
@pytest.mark.parametrize("kind", ["next", "llava"])
def test_logits_with_images_equal_transformers(folders, hf_models, kind, schedule):
    """transformers' whole model's logits (image rows scaled with the tokens', lm_head not divided by logits_scaling)
    == our text model's with the encoder's rows in place: a prefill, and chunks of 11 tokens splitting the images'
    spans then single steps."""
    from specray.models.loader import load_model

    folder = folders[kind]
    ids, mm = expanded(folder)
    sizes = None if schedule == "prefill" else [11] * ((len(ids) - 4) // 11)
    if sizes:
        assert any(item.offset % 11 and item.end % 11 for item in mm.items)
    got = image_logits(load_model(str(folder)), ids, mm, our_rows(folder, mm), sizes)
    with torch.no_grad():
        want = hf_models[kind](**hf_inputs(folder)).logits[0]
    assert max_diff(got, want) < TOL


# ---- each part shows in the logits -----------------------------------------------------------------------------------

def _rows_unscaled(monkeypatch, rows, model):  # the image rows left as the projector makes them
    real = AttentionMetadata.with_input_embeds
    monkeypatch.setattr(AttentionMetadata, "with_input_embeds", lambda meta, x, scale=1.0: real(meta, x))
    return rows, model


def _logits_divided(monkeypatch, rows, model):  # the text model's logits_scaling applied (its causal LM's head)
    model.logits_scaling = MULTIPLIERS["logits_scaling"]
    return rows, model


def _last_feature_layer(monkeypatch, rows, model):  # one feature layer (the last, three times) not three
    import specray.models.llava as llava

    real = llava.feature_indices
    monkeypatch.setattr(llava, "feature_indices", lambda layers, depth, name: [real(layers, depth, name)[-1]] * 3)
    return None, model


MUTATIONS = {"rows-unscaled": _rows_unscaled, "logits-divided": _logits_divided,
             "last-feature-layer": _last_feature_layer}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_logits(folders, hf_models, monkeypatch, mutation):
    """Each of granite-vision's parts switched off moves our logits away from transformers'."""
    from specray.models.loader import load_model

    folder = folders["next"]
    ids, mm = expanded(folder)
    rows, model = MUTATIONS[mutation](monkeypatch, our_rows(folder, mm), load_model(str(folder)))
    rows = our_rows(folder, mm) if rows is None else rows
    with torch.no_grad():
        want = hf_models["next"](**hf_inputs(folder)).logits[0]
    assert max_diff(image_logits(model, ids, mm, rows, None), want) > MOVED


# ---- tensor parallel and the engine ----------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(folders, tmp_path):
    """The Granite text model split over two ranks (the encoder replicated) gives one rank's logits with the images'
    rows in place, a prefill chunk ending inside the first image's span."""
    assert_ranks_equal_one_rank(tmp_path, [prompt_run(folders["next"], PROMPT, images(), blocks=128)], 1, TOL)


def test_engine_greedy_with_images_equals_transformers(folders, hf_models):
    """LLM.generate with two images (prefill chunks of 16 tokens splitting their spans, n-gram drafts) gives
    transformers' greedy generate's tokens, beside a text-only prompt; without the images transformers differs."""
    from transformers import AutoProcessor

    from specray import LLM
    from specray_test_engine_runs import assert_images_greedy_equals_transformers

    folder = folders["next"]
    llm = LLM(model=str(folder), max_model_len=512, block_size=4, max_num_batched_tokens=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    assert_images_greedy_equals_transformers(llm, hf_models["next"], AutoProcessor.from_pretrained(folder),
                                             ENGINE_PROMPT, images(), max_tokens=12)
