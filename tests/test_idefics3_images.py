"""Idefics3's and SmolVLM's images (``Idefics3ForConditionalGeneration`` / ``SmolVLMForConditionalGeneration``:
:mod:`specray.models.idefics3` before a Llama text model), against transformers on the same tiny random fp32 weights:
our expanded prompt and pixels equal ``Idefics3Processor``'s for two images of two crop grids (1 x 2 and 2 x 1 crops,
each with its global image), and SmolVLM's (its image processor without splitting: the global image alone) equal its
image processor's and ``get_image_prompt_string``'s (SmolVLMProcessor itself needs num2words); each image's
embeddings equal ``get_image_features``; the text model (from ``model.text_model.*`` through _TEXT_PARTS) fed those
rows gives transformers' whole model's logits for a prefill and for chunks that split the images' spans; the engine's
greedy tokens with images (n-gram drafts, chunks splitting the spans) and ``LLM.chat`` with an image_url part under
SmolVLM's chat template equal transformers' ``generate``; two tensor-parallel ranks equal one; each part of the
vision model and connector broken once moves the embeddings; what is not implemented is refused by name. No GPU check
here."""

from __future__ import annotations

import base64
import io
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache
from specray.multimodal import expand_prompt, step_rows
from specray_test_image_checks import (assert_ranks_equal_one_rank, config_with, first_cut,  # tests/image_checks.py
                                       random_images)
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the embeddings at least this much
CROP, PATCH, SEQ = 28, 7, 4  # 16 patches a crop, 4 <image> tokens after the 2 x 2 pixel shuffle
TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
          *(f"<row_{r}_col_{c}>" for r in (1, 2, 3) for c in (1, 2, 3)))
SHAPES = ((30, 70), (50, 20), (20, 20))  # 1 x 2 crops and the global one, 2 x 1 and the global one, 2 x 2 and global
GRIDS = ((1, 2), (2, 1), (2, 2))
PROMPT = "User: look at <image> and then <image>, the quick brown fox jumps"
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=CROP,
              patch_size=PATCH)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def images() -> list:
    return random_images(SHAPES, legacy=True)


def build_tiny(path: Path, smolvlm: bool = False, seed: int = 0) -> Path:
    """transformers' Idefics3ForConditionalGeneration (or SmolVLM's: the same layout; its image processor not
    splitting), conftest's tiny tokenizer with the image tokens, the image processor (PIL backend) and
    ``processor_config.json``'s ``image_seq_len``."""
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                              SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessorPil)

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=TOKENS)
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    config_cls, model_cls = ((SmolVLMConfig, SmolVLMForConditionalGeneration) if smolvlm else
                             (Idefics3Config, Idefics3ForConditionalGeneration))
    config = config_cls(text_config={**TEXT, **ids}, vision_config=VISION, scale_factor=2,
                        image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():  # the vision model's and connector's weights at unit scale, norms away from init
        for name, param in model.named_parameters():
            if name.startswith(("model.vision_model.", "model.connector.")):
                if param.dim() == 1:
                    param.normal_(0.3, 0.5)
                else:
                    param.normal_(0.0, param[0].numel() ** -0.5)
    model.save_pretrained(path)
    settings = dict(size={"longest_edge": 2 * CROP}, max_image_size={"longest_edge": CROP})
    if smolvlm:
        SmolVLMImageProcessorPil(do_image_splitting=False, **settings).save_pretrained(path)
    else:
        Idefics3ImageProcessorPil(do_image_splitting=True, **settings).save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps(
        {"image_seq_len": SEQ, "processor_class": "SmolVLMProcessor" if smolvlm else "Idefics3Processor"}))
    return path


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny_idefics3"))


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny_smolvlm"), smolvlm=True, seed=1)


def hf_load(folder: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_model(idefics3_dir):
    return hf_load(idefics3_dir)


@pytest.fixture(scope="module")
def smolvlm_hf(smolvlm_dir):
    return hf_load(smolvlm_dir)


def our_processor(folder: Path):
    from specray.models.idefics3 import Idefics3ImageProcessor
    from specray.models.loader import read_config

    return Idefics3ImageProcessor.from_pretrained(folder, read_config(str(folder)))


def our_encoder(folder: Path, dtype: torch.dtype = torch.float32):
    from specray.models.loader import load_image_encoder, read_config

    return load_image_encoder(str(folder), read_config(str(folder)), dtype, "cpu")


def expanded(folder: Path, text: str = PROMPT, imgs: list | None = None):
    from transformers import AutoTokenizer

    imgs = images()[:2] if imgs is None else imgs
    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text), imgs, our_processor(folder))


def pixels(mm) -> torch.Tensor:
    """The items' crops as transformers' model takes them: [1, crops, C, S, S]."""
    return torch.cat([torch.from_numpy(item.data["pixel_values"]) for item in mm.items])[None]


# ---- the processor -------------------------------------------------------------------------------------------------

def test_processor_equals_idefics3_processor(idefics3_dir):
    """Three images of three crop grids: our expanded prompt and pixels equal Idefics3Processor's (its own tokens
    and pixel_values); only the <image> rows take embeddings, 4 per crop, the global image last."""
    from transformers import AutoImageProcessor, AutoTokenizer, Idefics3Processor

    text = "A <image> B <image> C <image> D"
    ids, mm = expanded(idefics3_dir, text, images())
    theirs = Idefics3Processor(AutoImageProcessor.from_pretrained(idefics3_dir),
                               AutoTokenizer.from_pretrained(idefics3_dir), image_seq_len=SEQ)
    want = theirs(text=text, images=images(), return_tensors="pt")
    assert ids == want["input_ids"][0].tolist()
    assert torch.equal(pixels(mm), want["pixel_values"]) and want["pixel_attention_mask"].all()
    image = our_processor(idefics3_dir).image_token_id
    fake = AutoTokenizer.from_pretrained(idefics3_dir).convert_tokens_to_ids("<fake_token_around_image>")
    for item, (rows, cols) in zip(mm.items, GRIDS, strict=True):
        span = ids[item.offset:item.end]
        assert span[0] == span[-1] == fake and ids[item.offset - 1] != fake
        assert item.embed_rows == [i for i, t in enumerate(span) if t == image]
        crops = rows * cols + 1
        assert item.num_embeds == SEQ * crops and item.data["pixel_values"].shape == (crops, 3, CROP, CROP)
        assert not item.bidirectional and mm.rope_positions is None


def test_smolvlm_processor_without_splitting(smolvlm_dir):
    """SmolVLM's image processor not splitting: one crop per image (the global image), the prompt as
    SmolVLMProcessor's get_image_prompt_string writes it, the pixels its image processor's."""
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    ids, mm = expanded(smolvlm_dir)
    tok = AutoTokenizer.from_pretrained(smolvlm_dir)
    head, middle, tail = PROMPT.split("<image>")
    one = get_image_prompt_string(0, 0, SEQ, "<fake_token_around_image>", "<image>", "<global-img>")
    assert ids == tok.encode(head + one + middle + one + tail)
    want = AutoImageProcessor.from_pretrained(smolvlm_dir)(images=[images()[:2]], return_tensors="np")
    assert np.array_equal(pixels(mm).numpy(), want["pixel_values"])
    assert [item.num_embeds for item in mm.items] == [SEQ, SEQ]


# ---- the encoder ---------------------------------------------------------------------------------------------------

def transformers_rows(hf, pixel_values: torch.Tensor) -> torch.Tensor:
    """What transformers scatters over an image's <image> tokens: get_image_features' pooled rows."""
    with torch.no_grad():
        return torch.cat(hf.model.get_image_features(pixel_values=pixel_values[None]).pooler_output)


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_encoder_equals_transformers_image_features(request, family):
    """Each image's embeddings (its crops, the global one last; SmolVLM's: the global image alone) equal
    transformers' rows for it."""
    folder = request.getfixturevalue(f"{family}_dir")
    hf_model = request.getfixturevalue("hf_model" if family == "idefics3" else "smolvlm_hf")
    _, mm = expanded(folder, "<image> <image> <image>", images())
    encoder = our_encoder(folder)
    assert encoder.deepstack_layers == 0
    for item in mm.items:
        data = torch.from_numpy(item.data["pixel_values"])
        with torch.no_grad():
            got = encoder.encode({"pixel_values": data})
        want = transformers_rows(hf_model, data)
        assert got.shape == want.shape == (item.num_embeds, 64)
        assert max_diff(got, want) < TOL


def test_encoder_in_bfloat16(idefics3_dir, hf_model):
    """Built under bfloat16 (the runner hands it bf16 pixels), within bf16's rounding of transformers' fp32 rows."""
    _, mm = expanded(idefics3_dir)
    encoder = our_encoder(idefics3_dir, torch.bfloat16)
    data = torch.from_numpy(mm.items[0].data["pixel_values"])
    with torch.no_grad():
        got = encoder.encode({"pixel_values": data.to(torch.bfloat16)})
    want = transformers_rows(hf_model, data)
    assert got.dtype == torch.bfloat16 and max_diff(got.float(), want) / want.abs().max().item() < 5e-2


def test_positions_beyond_the_crop_grid():
    """A crop of another size than image_size (transformers' bucketing, which we mirror): its patches take the grid
    cells their fractional places fall in."""
    from types import SimpleNamespace

    from specray.models.idefics3 import Idefics3Embeddings

    emb = Idefics3Embeddings(SimpleNamespace(hidden_size=4, patch_size=7, image_size=28))
    assert emb.positions(4, 4, torch.device("cpu")).tolist() == list(range(16))
    assert emb.positions(2, 3, torch.device("cpu")).tolist() == [0, 1, 2, 8, 9, 10]


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


def _all_rows(item, start, stop):  # every row of the span taking an embedding (the separators' too)
    from dataclasses import replace

    return step_rows(replace(item, embed_rows=list(range(item.num_embeds))), start, stop)


@pytest.mark.parametrize("schedule", ["prefill", "chunked+decode"])
def test_logits_with_images_equal_transformers(idefics3_dir, hf_model, schedule):
    """The text model (served from the whole checkpoint through _TEXT_PARTS) fed the encoder's rows equals
    transformers' whole model over the expanded prompt with both images: one prefill, and chunks that start and end
    inside the images' spans, then single steps; the rows put on the span's first rows, or left out, differ."""
    from specray.models.loader import load_model

    ids, mm = expanded(idefics3_dir)
    first, second = mm.items
    cuts = [first.offset + 5, second.offset + 9 - (first.offset + 5), 2]  # inside image 1, inside image 2, past it
    sizes = [len(ids)] if schedule == "prefill" else cuts + [1] * (len(ids) - sum(cuts))
    model, encoder = load_model(str(idefics3_dir)), our_encoder(idefics3_dir)
    got = run_with_images(model, encoder, ids, mm, sizes)
    with torch.no_grad():
        want = hf_model(input_ids=torch.tensor([ids]), pixel_values=pixels(mm)).logits[0]
    assert max_diff(got, want) < TOL
    if schedule == "prefill":
        assert max_diff(run_with_images(model, encoder, ids, mm, sizes, _all_rows), want) > MOVED
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


def _plain_positions(encoder, monkeypatch):  # positions reversed: the grid's cells in another order
    emb = encoder.tower.embeddings
    real = emb.positions
    monkeypatch.setattr(emb, "positions", lambda r, c, d: real(r, c, d).flip(0))


def _row_major_shuffle(encoder, monkeypatch):  # 4 consecutive patches of a row folded, not a 2 x 2 block
    import specray.models.idefics3 as module

    monkeypatch.setattr(module, "pixel_shuffle", lambda x, s: x.reshape(x.shape[0], -1, x.shape[-1] * s * s))


def _columns_outer(encoder, monkeypatch):  # a block's columns outer, its rows inner
    import specray.models.idefics3 as module

    real = module.pixel_shuffle

    def shuffle(x, s):
        b, n, d = x.shape
        side = round(n ** 0.5)
        return real(x.reshape(b, side, side, d).transpose(1, 2).reshape(b, n, d), s).reshape(b, -1, s, s, d) \
            .transpose(2, 3).reshape(b, -1, s * s * d)
    monkeypatch.setattr(module, "pixel_shuffle", shuffle)


def _quick_gelu(encoder, monkeypatch):  # CLIP's sigmoid GELU for the tanh one
    for layer in encoder.tower.encoder.layers:
        layer.mlp.act = lambda x: x * torch.sigmoid(1.702 * x)


MUTATIONS = {"patch conv bias": _zero("tower.embeddings.patch_embedding.bias"),
             "position embedding": _zero("tower.embeddings.position_embedding.weight"),
             "position ids": _plain_positions, "post_layernorm": _identity("tower.post_layernorm"),
             "pixel shuffle's 2 x 2 blocks": _row_major_shuffle, "pixel shuffle's block order": _columns_outer,
             "tanh GELU": _quick_gelu, "attention biases": _zero("tower.encoder.layers.0.self_attn.q_proj.bias")}


@pytest.mark.parametrize("part", sorted(MUTATIONS))
def test_each_part_shows_in_the_embeddings(idefics3_dir, hf_model, monkeypatch, part):
    """Each distinctive part of the vision model and connector switched off (or done another way) moves the
    embeddings away from transformers'."""
    _, mm = expanded(idefics3_dir)
    data = torch.from_numpy(mm.items[0].data["pixel_values"])
    encoder = our_encoder(idefics3_dir)
    MUTATIONS[part](encoder, monkeypatch)
    with torch.no_grad():
        got = encoder.encode({"pixel_values": data})
    assert max_diff(got, transformers_rows(hf_model, data)) > MOVED


# ---- refusals ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,words", [
    (dict(vision_config__model_type="siglip_vision_model"), "vision_config.model_type='siglip_vision_model'"),
    (dict(vision_config__hidden_act="swish"), "vision_config.hidden_act='swish'"),
    (dict(scale_factor=3), "scale_factor=3"),
    (dict(vision_config__image_size=21), "image_size=21"),
    (dict(scale_factor=2.0), "scale_factor=2.0")])
def test_unsupported_model_settings_are_refused(idefics3_dir, change, words):
    from specray.models.idefics3 import Idefics3ImageEncoder

    with pytest.raises(ValueError) as err:
        Idefics3ImageEncoder(config_with(idefics3_dir, **change))
    assert words in str(err.value)


@pytest.mark.parametrize("settings,words", [
    ({"image_seq_len": 9}, "image_seq_len=9"),
    ({"max_image_size": {"longest_edge": 56}}, "max_image_size={'longest_edge': 56}"),
    ({"image_token_id": 0}, "image_token_id=0")])
def test_unsupported_processor_settings_are_refused(idefics3_dir, tmp_path, settings, words):
    from specray.models.idefics3 import Idefics3ImageProcessor

    folder = shutil.copytree(idefics3_dir, tmp_path / "f")
    config = config_with(folder)
    if "image_seq_len" in settings:
        (folder / "processor_config.json").write_text(json.dumps(settings))
    elif "image_token_id" in settings:
        config.image_token_id = settings["image_token_id"]
    else:
        saved = json.loads((folder / "preprocessor_config.json").read_text())
        (folder / "preprocessor_config.json").write_text(json.dumps({**saved, **settings}))
    with pytest.raises(ValueError) as err:
        Idefics3ImageProcessor.from_pretrained(folder, config)
    assert words in str(err.value)


def test_missing_tensors_are_refused(idefics3_dir):
    from safetensors.torch import load_file

    from specray.models.idefics3 import Idefics3ImageEncoder

    encoder = Idefics3ImageEncoder(config_with(idefics3_dir))
    tensors = load_file(str(idefics3_dir / "model.safetensors"))
    for gone in ("model.vision_model.encoder.layers.1.mlp.fc2.bias", "model.connector.modality_projection.proj.weight",
                 "model.vision_model.post_layernorm.weight"):
        with pytest.raises(ValueError, match=gone.replace(".", r"\.")):
            encoder.load_weights((n, t) for n, t in tensors.items() if n != gone)
    encoder.load_weights(tensors.items())


# ---- the engine ----------------------------------------------------------------------------------------------------

def transformers_generate(hf, ids: list[int], pixel_values: torch.Tensor, steps: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixel_values, max_new_tokens=steps,
                          min_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_engine_with_images_equals_transformers_generate(idefics3_dir, hf_model):
    """LLM.generate with images (prefill chunks of 7 tokens, so every image's span is split; n-gram drafts; prefix
    caching) gives transformers' greedy generate of the whole model, token for token; the same prompt with the
    images swapped gets its own output."""
    from specray import LLM, SamplingParams

    llm = LLM(model=str(idefics3_dir), max_model_len=160, block_size=4, max_num_batched_tokens=7,
              enable_prefix_caching=True, speculative_config=NGRAM)
    a, b, c = images()
    prompts = [(PROMPT, [a, b]), ("Hello <image> world!", [c]), (PROMPT, [b, a])]
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in prompts],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for (text, imgs), out in zip(prompts, outs, strict=True):
        ids, mm = expanded(idefics3_dir, text, imgs)
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == transformers_generate(hf_model, ids, pixels(mm), 24), text
    assert outs[0].outputs[0].token_ids != outs[2].outputs[0].token_ids
    assert llm.spec_stats.accepted_tokens > 0


def test_smolvlm_chat_with_an_image_url_equals_transformers_generate(smolvlm_dir, smolvlm_hf):
    """SmolVLM: LLM.chat with an image_url part (a data: URL) under SmolVLM's chat template renders <image> where
    the part is ("User:<image>..." for a message opening with the image) and answers what transformers' generate
    answers for that prompt."""
    from PIL import Image
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    from specray import LLM, SamplingParams

    buffer = io.BytesIO()
    images()[0].save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is in the picture?"}]}]
    llm = LLM(model=str(smolvlm_dir), max_model_len=128, block_size=4, max_num_batched_tokens=5,
              speculative_config=NGRAM)
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False,
                   chat_template=DEFAULT_CHAT_TEMPLATE)[0]
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                 {"type": "text", "text": "What is in the picture?"}]}],
                                   chat_template=DEFAULT_CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>User:<image>What is in the picture?<end_of_utterance>\nAssistant:"
    image = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    ids, mm = expanded(smolvlm_dir, text, [image])
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == transformers_generate(smolvlm_hf, ids, pixels(mm), 10)


# ---- tensor parallel -----------------------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(idefics3_dir, tmp_path):
    """The text model split over two tensor-parallel ranks (the encoder replicated on each) gives one rank's logits
    with the images' rows in place: PROMPT's with two images, a prefill chunk ending inside the first image's span,
    then the rest."""
    ids, mm = expanded(idefics3_dir)
    cut = first_cut(mm)
    assert_ranks_equal_one_rank(tmp_path, [(idefics3_dir, ids, mm, [cut, len(ids) - cut])], 1, TOL)
