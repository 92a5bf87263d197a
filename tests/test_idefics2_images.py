"""Idefics2's images (``Idefics2ForConditionalGeneration``: :mod:`specray.models.idefics2` before a Mistral text model),
against transformers on the same tiny random fp32 weights: our expanded prompt, pixels and pixel masks equal
``Idefics2Processor``'s (images split into quarters and the whole image, or not split; adjacent images sharing a fake
token; a word glued after an image spaced off); each image's embeddings (crops of different sizes padded to the
largest, the padded patches left out) equal ``get_image_features``; the text model (``model.text_model.*`` through
_TEXT_PARTS) fed those rows gives transformers' whole model's logits for a prefill and for chunks that split the
images' spans; the engine's greedy tokens with images (n-gram drafts, chunks splitting the spans) and ``LLM.chat``
with an image_url part equal transformers' ``generate``; two tensor-parallel ranks equal one; each part of the vision
model and connector broken once moves the embeddings; what is not implemented is refused by name. No GPU check."""

from __future__ import annotations

import base64
import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models.loader import load_image_encoder, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import (assert_ranks_equal_one_rank, config_with, encode_items,  # tests/image_checks.py
                                       first_cut, image_logits, random_images)
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the embeddings at least this much
SEQ = 3  # resampler_n_latents: <image> tokens per crop
TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>")
SHAPES = ((30, 70), (50, 20), (40, 40))
PROMPT = "User: look at <image> and then<image>, the quick brown fox jumps"
CASES = ("A <image> B <image> C <image> D", PROMPT, "A<image><image>B <image>\nC")
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=None)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28,
              patch_size=7)
PERCEIVER = dict(hidden_size=64, rms_norm_eps=1e-5, resampler_n_latents=SEQ, resampler_depth=2, resampler_n_heads=4,
                 resampler_head_dim=8, num_key_value_heads=2)
# the releases' chat template (idefics2-8b's tokenizer_config.json)
CHAT_TEMPLATE = ("{% for message in messages %}{{message['role'].capitalize()}}{% if message['content'][0]['type'] =="
                 " 'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type']"
                 " == 'text' %}{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
                 "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def images() -> list:
    return random_images(SHAPES, legacy=True)


def build_tiny(path: Path) -> Path:
    """transformers' Idefics2ForConditionalGeneration (a Mistral text model), conftest's tiny tokenizer with the image
    tokens, the image processor (PIL backend, splitting; edges 21..42 pixels) and processor_config.json."""
    from transformers import Idefics2Config, Idefics2ForConditionalGeneration, Idefics2ImageProcessorPil

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=TOKENS)
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    config = Idefics2Config(text_config={**TEXT, **ids}, vision_config=VISION, perceiver_config=PERCEIVER,
                            image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Idefics2ForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # the vision model's and connector's weights at unit scale, norms away from init
        for name, param in model.named_parameters():
            if name.startswith(("model.vision_model.", "model.connector.")):
                if param.dim() == 1:
                    param.normal_(0.3, 0.5)
                else:
                    param.normal_(0.0, param[0].numel() ** -0.5)
    model.save_pretrained(path)
    Idefics2ImageProcessorPil(do_image_splitting=True, size={"shortest_edge": 21, "longest_edge": 42}
                              ).save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": SEQ,
                                                            "processor_class": "Idefics2Processor"}))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny_idefics2"))


@pytest.fixture(scope="module")
def unsplit(folder, tmp_path_factory) -> Path:
    """The same checkpoint, its image processor not splitting (one crop per image)."""
    copy = shutil.copytree(folder, tmp_path_factory.mktemp("tiny_idefics2_unsplit") / "f")
    saved = json.loads((copy / "preprocessor_config.json").read_text())
    (copy / "preprocessor_config.json").write_text(json.dumps({**saved, "do_image_splitting": False}))
    return copy


@pytest.fixture(scope="module")
def hf_model(folder):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


def hf_processor(folder: Path):
    from transformers import AutoImageProcessor, AutoTokenizer, Idefics2Processor

    return Idefics2Processor(AutoImageProcessor.from_pretrained(folder), AutoTokenizer.from_pretrained(folder),
                             image_seq_len=SEQ)


def our_processor(folder: Path):
    from specray.models.idefics2 import Idefics2ImageProcessor

    return Idefics2ImageProcessor.from_pretrained(folder, read_config(str(folder)))


def expanded(folder: Path, text: str = PROMPT, imgs: list | None = None):
    from transformers import AutoTokenizer

    imgs = images()[:text.count("<image>")] if imgs is None else imgs
    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text), imgs, our_processor(folder))


# ---- the processor -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("text", CASES)
def test_processor_equals_idefics2_processor(folder, unsplit, split, text):
    """Our expanded prompt equals Idefics2Processor's ids (fake tokens shared by adjacent images, a glued word
    spaced off); each image's pixels and masks equal its image processor's for that image alone; only the <image>
    rows take embeddings, SEQ per crop."""
    where = folder if split else unsplit
    imgs = images()[:text.count("<image>")]
    ids, mm = expanded(where, text, imgs)
    want = hf_processor(where)(text=text, images=imgs, return_tensors="np")
    assert ids == want["input_ids"][0].tolist()
    ours = our_processor(where)
    crops = 5 if split else 1
    for item, image in zip(mm.items, imgs, strict=True):
        span = ids[item.offset:item.end]
        assert span[-1] == ours.fake_token_id and item.embed_rows == [
            i for i, t in enumerate(span) if t == ours.image_token_id]
        assert item.num_embeds == SEQ * crops
        alone = ours.image_processor(images=[[image]], return_tensors="np")
        assert np.array_equal(item.data["pixel_values"], alone["pixel_values"][0])
        assert np.array_equal(item.data["pixel_attention_mask"], alone["pixel_attention_mask"][0])
        assert item.data["pixel_values"].shape[0] == crops and not item.bidirectional
    assert mm.rope_positions is None
    if split:  # the quarters of a 30 x 70 image and the whole one differ in size: padded, masked
        assert not mm.items[0].data["pixel_attention_mask"].all()


# ---- the encoder ---------------------------------------------------------------------------------------------------

def transformers_rows(hf, data: dict) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(hf.model.get_image_features(
            pixel_values=torch.from_numpy(data["pixel_values"])[None],
            pixel_attention_mask=torch.from_numpy(data["pixel_attention_mask"])[None]).pooler_output)


def our_encoder(folder: Path, dtype: torch.dtype = torch.float32):
    return load_image_encoder(str(folder), read_config(str(folder)), dtype, "cpu")


@pytest.mark.parametrize("split", [True, False])
def test_encoder_equals_transformers_image_features(folder, unsplit, hf_model, split):
    """Each image's embeddings (its padded crops' real patches only) equal transformers' rows for it."""
    where = folder if split else unsplit
    _, mm = expanded(where, "<image> <image> <image>")
    encoder = our_encoder(where)
    assert encoder.deepstack_layers == 0
    for item, got in zip(mm.items, encode_items(encoder, mm), strict=True):
        want = transformers_rows(hf_model, item.data)
        assert got.shape == want.shape == (item.num_embeds, 64)
        assert max_diff(got, want) < TOL


def test_encoder_in_bfloat16(folder, hf_model):
    """Built under bfloat16, within bf16's rounding of transformers' fp32 rows."""
    _, mm = expanded(folder)
    item = mm.items[0]
    with torch.no_grad():
        got = our_encoder(folder, torch.bfloat16).encode(
            {"pixel_values": torch.from_numpy(item.data["pixel_values"]).bfloat16(),
             "pixel_attention_mask": torch.from_numpy(item.data["pixel_attention_mask"])})
    want = transformers_rows(hf_model, item.data)
    assert got.dtype == torch.bfloat16 and max_diff(got.float(), want) / want.abs().max().item() < 5e-2


# ---- the whole model -----------------------------------------------------------------------------------------------

def reference(hf, ids: list[int], mm) -> torch.Tensor:
    """transformers' whole model over the expanded prompt with all the images (padded together, as it batches)."""
    crops = [torch.from_numpy(item.data["pixel_values"]) for item in mm.items]
    masks = [torch.from_numpy(item.data["pixel_attention_mask"]) for item in mm.items]
    h, w = max(c.shape[-2] for c in crops), max(c.shape[-1] for c in crops)
    pixels = torch.cat([torch.nn.functional.pad(c, (0, w - c.shape[-1], 0, h - c.shape[-2])) for c in crops])
    mask = torch.cat([torch.nn.functional.pad(m, (0, w - m.shape[-1], 0, h - m.shape[-2])) for m in masks])
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids]), pixel_values=pixels[None], pixel_attention_mask=mask[None]).logits[0]


@pytest.mark.parametrize("schedule", ["prefill", "chunked+decode"])
def test_logits_with_images_equal_transformers(folder, hf_model, schedule):
    """The text model (from the whole checkpoint through _TEXT_PARTS) fed the encoder's rows equals transformers'
    whole model over the expanded prompt with both images: one prefill, and chunks that start and end inside the
    images' spans, then single steps; the rows left out differ."""
    ids, mm = expanded(folder)
    first, second = mm.items
    cuts = [first.offset + 5, second.offset + 9 - (first.offset + 5), 2]
    sizes = None if schedule == "prefill" else cuts
    model = load_model(str(folder))
    embeds = encode_items(our_encoder(folder), mm)
    want = reference(hf_model, ids, mm)
    with torch.no_grad():
        assert max_diff(image_logits(model, ids, mm, embeds, sizes), want) < TOL
        if schedule == "prefill":
            blind = [torch.zeros_like(e) for e in embeds]
            assert max_diff(image_logits(model, ids, mm, blind, sizes), want) > MOVED


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


def _padded_patches(encoder, monkeypatch):  # every crop whole, its padding's patches in the attention
    real = encoder.encode
    monkeypatch.setattr(encoder, "encode", lambda data: real({"pixel_values": data["pixel_values"]}))


def _context_only(encoder, monkeypatch):  # the latents' keys and values from the context alone
    for layer in encoder.connector.perceiver_resampler.layers:
        for name in ("k_proj", "v_proj"):
            proj = getattr(layer.self_attn, name)
            monkeypatch.setattr(proj, "forward", lambda x, real=proj.forward: real(x[:-SEQ]))


def _tiled_groups(encoder, monkeypatch):  # key/value heads tiled (0, 1, 0, 1) instead of grouped (0, 0, 1, 1)
    real = torch.Tensor.repeat_interleave
    monkeypatch.setattr(torch.Tensor, "repeat_interleave",
                        lambda t, n, dim=0: t.repeat(n, 1, 1) if dim == 0 else real(t, n, dim=dim))


def _plain_activation(encoder, monkeypatch):  # the projection's SiLU gate as GELU
    encoder.connector.modality_projection.act = torch.nn.functional.gelu


MUTATIONS = {"post_layernorm": _identity("tower.post_layernorm"),
             "position embedding": _zero("tower.embeddings.position_embedding.weight"),
             "padded patches left out": _padded_patches,
             "latents among the keys": _context_only, "grouped key/value heads": _tiled_groups,
             "context norm": _identity("connector.perceiver_resampler.layers.0.input_context_norm"),
             "latents norm": _identity("connector.perceiver_resampler.layers.0.input_latents_norm"),
             "resampler's final norm": _identity("connector.perceiver_resampler.norm"),
             "perceiver MLP": _zero("connector.perceiver_resampler.layers.1.mlp.down_proj.weight"),
             "projection activation": _plain_activation}


@pytest.mark.parametrize("part", sorted(MUTATIONS))
def test_each_part_shows_in_the_embeddings(folder, hf_model, monkeypatch, part):
    """Each distinctive part of the vision model and connector switched off (or done another way) moves the first
    image's embeddings (crops of two sizes, padded) away from transformers'."""
    _, mm = expanded(folder)
    item = mm.items[0]
    encoder = our_encoder(folder)
    MUTATIONS[part](encoder, monkeypatch)
    with torch.no_grad():
        got = encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()})
    monkeypatch.undo()
    assert max_diff(got, transformers_rows(hf_model, item.data)) > MOVED


# ---- refusals ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,words", [
    (dict(vision_config__model_type="siglip_vision_model"), "vision_config.model_type='siglip_vision_model'"),
    (dict(vision_config__hidden_act="swish"), "vision_config.hidden_act='swish'"),
    (dict(perceiver_config__hidden_act="swish"), "perceiver_config.hidden_act='swish'"),
    (dict(perceiver_config__num_key_value_heads=3), "perceiver_config.num_key_value_heads=3"),
    (dict(perceiver_config__hidden_size=32), "perceiver_config.hidden_size=32")])
def test_unsupported_model_settings_are_refused(folder, change, words):
    from specray.models.idefics2 import Idefics2ImageEncoder

    with pytest.raises(ValueError) as err:
        Idefics2ImageEncoder(config_with(folder, **change))
    assert words in str(err.value)


@pytest.mark.parametrize("settings,words", [({"image_seq_len": 9}, "image_seq_len=9"),
                                            ({"image_token_id": 0}, "image_token_id=0")])
def test_unsupported_processor_settings_are_refused(folder, tmp_path, settings, words):
    from specray.models.idefics2 import Idefics2ImageProcessor

    copy = shutil.copytree(folder, tmp_path / "f")
    config = config_with(copy)
    if "image_seq_len" in settings:
        (copy / "processor_config.json").write_text(json.dumps(settings))
    else:
        config.image_token_id = settings["image_token_id"]
    with pytest.raises(ValueError) as err:
        Idefics2ImageProcessor.from_pretrained(copy, config)
    assert words in str(err.value)


def test_missing_tensors_are_refused(folder):
    from safetensors.torch import load_file

    from specray.models.idefics2 import Idefics2ImageEncoder

    encoder = Idefics2ImageEncoder(config_with(folder))
    tensors = load_file(str(folder / "model.safetensors"))
    for gone in ("model.vision_model.encoder.layers.1.mlp.fc2.bias", "model.connector.perceiver_resampler.latents",
                 "model.connector.modality_projection.gate_proj.weight"):
        with pytest.raises(ValueError, match=gone.replace(".", r"\.")):
            encoder.load_weights((n, t) for n, t in tensors.items() if n != gone)
    encoder.load_weights(tensors.items())


# ---- the engine ----------------------------------------------------------------------------------------------------

def test_engine_with_images_equals_transformers_generate(folder, hf_model):
    """LLM.generate with two images (prefill chunks of 7 tokens, so every image's span is split; n-gram drafts)
    gives transformers' greedy generate of the whole model with Idefics2Processor's inputs, token for token, and a
    plain prompt in the same batch its own; LLM.chat with an image_url part under the release's chat template renders
    "User:<image>What..." (the word glued to the image) and answers what transformers answers for it."""
    from PIL import Image

    from specray import LLM, SamplingParams

    llm = LLM(model=str(folder), max_model_len=160, block_size=4, max_num_batched_tokens=7,
              speculative_config=NGRAM)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf_model, hf_processor(folder), PROMPT, images()[:2])
    buffer = io.BytesIO()
    images()[2].save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    question = "What is in the picture?"
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": question}]}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False,
                   chat_template=CHAT_TEMPLATE)[0]
    text = f"User:<image>{question}<end_of_utterance>\nAssistant:"
    image = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    inputs = hf_processor(folder)(text=text, images=[image], return_tensors="pt")
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        want = hf_model.generate(**inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
    assert list(out.outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist()


# ---- tensor parallel -----------------------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(folder, tmp_path):
    """The text model split over two tensor-parallel ranks (the encoder replicated on each) gives one rank's logits
    with the images' rows in place: a prefill chunk ending inside the first image's span, then the rest."""
    ids, mm = expanded(folder)
    cut = first_cut(mm)
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids, mm, [cut, len(ids) - cut])], 1, TOL)
