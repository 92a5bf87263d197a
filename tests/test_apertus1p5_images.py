"""Apertus 1.5's images (``Apertus1p5ForConditionalGeneration``: :mod:`specray.models.apertus1p5_vision`), against
transformers on the same tiny random fp32 weights. An image becomes discrete codes (a VQGAN vision tokenizer, argmax
over its codebook) embedded by the text model's own embedding. Checked: our expanded prompt equals what
``Apertus1p5Processor`` writes (its own ``replace_image_token``: the grid header, rows of image tokens joined by the
end-of-line token) and our pixels transformers' image processor's (a torchvision processor: compared live where
torchvision imports, ``APERTUS_TORCHVISION_PATH`` may name a folder holding it, and always against pixel sums recorded
from it) for three images (shrunk into the pixel budget, left at its size, grown to the floor); each image's codes and
rows equal transformers' ``get_image_tokens`` / ``get_image_features``; the text model's logits with those rows
(``meta.input_embeds``) equal transformers' whole model's over a prefill and over chunks that split the images' spans;
each distinctive part of the tokenizer broken once moves the codes; what is not implemented is refused by name. The
engine's greedy tokens with images (chunks splitting their spans, n-gram drafts) equal transformers' ``generate``; two
tensor-parallel ranks equal one. No GPU check here."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from specray_test_image_checks import private_env  # tests/image_checks.py

from specray.models import apertus1p5_vision as av
from specray.models.apertus1p5_vision import Apertus1p5ImageEncoder, Apertus1p5ImageProcessor, smart_resize
from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache
from specray.models.loader import iter_weights, load_image_encoder, load_image_processor, load_model, read_config, \
    resolve_model
from specray.multimodal import expand_prompt
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2
PROMPT = "Look at <|image|> and then at <|image|>, or <|image|>, the quick brown fox jumps"
SHAPES = ((28, 40, 3), (36, 20, 3), (10, 14, 3))
FACTOR = 4  # three stages: two stride-2 downsamples
SETTINGS = {"image_processor_type": "Apertus1p5ImageProcessor", "spatial_factor": FACTOR,
            "size": {"min_pixels": 256, "max_pixels": 1024}}
SPECIAL = {"image_token": "<|image|>", "boi_token": "<|img_start|>", "eoi_token": "<|img_end|>",
           "image_wrapper_token": "<|img_grid|>", "eol_token": "<|img_eol|>", "audio_token": "<|audio|>",
           "boa_token": "<|audio_start|>", "eoa_token": "<|audio_end|>"}
VISION = dict(codebook_size=40, embed_dim=8, latent_channels=8, base_channels=32, channel_multiplier=[1, 1, 2],
              num_res_blocks=1, attn_resolutions=[8], resolution=32)  # attention in the third stage (32 / 4)
# what transformers' image processor (torchvision 0.28) made of images(): each image's size and its pixels' sum, sum of
# magnitudes and sum weighted by sin(flat index)
RECORDED = [((24, 36), (-39.6314, 874.353, -5.4054)), ((36, 20), (-15.5843, 1056.6981, -4.5117)),
            ((16, 20), (-28.4314, 387.0588, 18.7085))]


def images() -> list:
    from PIL import Image

    rng = np.random.RandomState(0)
    return [Image.fromarray(rng.randint(0, 255, shape, dtype=np.uint8)) for shape in SHAPES]


def build_tiny_apertus(path: Path, seed: int = 0) -> Path:
    """transformers' Apertus1p5ForConditionalGeneration: a two-layer Apertus 1.5 text model over the tiny tokenizer's
    ids plus 40 visual and 40 audio codes (its head pruned to the text ids), a three-stage vision tokenizer of 40
    codes and a small WavTokenizer encoder; saved with conftest's tiny tokenizer (the processor's special tokens
    named as attributes) and the image processor's settings (written: its class needs torchvision)."""
    from transformers import Apertus1p5Config, Apertus1p5ForConditionalGeneration, AutoTokenizer

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(path, extra_special_tokens=tuple(SPECIAL.values()))
    saved = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**saved, "extra_special_tokens": SPECIAL}))
    tok = AutoTokenizer.from_pretrained(path)
    n = len(tok)
    text = dict(vocab_size=n + 80, output_vocab_size=n, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, bos_token_id=None,
                rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "original_max_position_embeddings": 16, "high_freq_factor": 4.0})
    config = Apertus1p5Config(
        text_config=text, image_token_offset=n, audio_token_offset=n + 40, tie_word_embeddings=False,
        image_token_id=tok.convert_tokens_to_ids(SPECIAL["image_token"]),
        audio_token_id=tok.convert_tokens_to_ids(SPECIAL["audio_token"]), vision_config=VISION,
        audio_config=dict(model_type="wavtokenizer_encoder", num_filters=4, upsampling_ratios=[2, 2], hidden_size=8,
                          codebook_size=40, codebook_dim=8, num_lstm_layers=1))
    torch.manual_seed(seed)
    model = Apertus1p5ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif "norm" in name and name.endswith("bias"):
                param.normal_(0.0, 0.3)
            elif name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):
                param.normal_(0.0, 0.5)
        # the head a copy of the text rows of the embedding: greedy decoding falls into a loop after a few tokens, so
        # n-gram drafts are accepted in some steps and rejected in others
        model.lm_head.weight.copy_(model.get_input_embeddings().weight[:n])
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(SETTINGS))
    return path


@pytest.fixture(scope="module")
def tiny_apertus(tmp_path_factory) -> Path:
    return build_tiny_apertus(tmp_path_factory.mktemp("tiny_apertus1p5_images"))


@pytest.fixture(scope="module")
def hf_model(tiny_apertus):
    from transformers import Apertus1p5ForConditionalGeneration

    return Apertus1p5ForConditionalGeneration.from_pretrained(tiny_apertus, dtype=torch.float32).eval()


def _expand(folder: Path, text: str = PROMPT, imgs: list | None = None):
    from transformers import AutoTokenizer

    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text), images() if imgs is None else imgs,
                         load_image_processor(str(folder)))


def hf_inputs(folder: Path, text: str = PROMPT, imgs: list | None = None) -> dict:
    """transformers' model inputs for ``text`` with its images: the expanded ids and our pixels (transformers' image
    processor needs torchvision; the processor tests show ours equal its), zero-padded into one batch with their
    sizes, as its processor hands them."""
    ids, mm = _expand(folder, text, imgs)
    pixels = [item.data["pixel_values"] for item in mm.items]
    height, width = max(p.shape[1] for p in pixels), max(p.shape[2] for p in pixels)
    batch = np.zeros((len(pixels), 3, height, width), dtype=np.float32)
    for i, p in enumerate(pixels):
        batch[i, :, :p.shape[1], :p.shape[2]] = p
    return {"input_ids": torch.tensor([ids]), "pixel_values": torch.from_numpy(batch),
            "image_sizes": torch.tensor([list(p.shape[1:]) for p in pixels])}


# ---- the processor -------------------------------------------------------------------------------------------------

def test_processor_matches_transformers_text_and_recorded_pixels(tiny_apertus):
    """Three images: shrunk into the 1024-pixel budget (28 x 40 -> 24 x 36), left at its size (36 x 20), grown to the
    256-pixel floor (10 x 14 -> 16 x 20); pixels as transformers' image processor made them (recorded sums); the
    prompt is what Apertus1p5Processor writes (its own ``replace_image_token`` over those sizes, then the tokenizer
    over the whole text), the image-token rows taking the embeddings."""
    from transformers import AutoTokenizer
    from transformers.models.apertus1p5.processing_apertus1p5 import Apertus1p5Processor

    folder = tiny_apertus
    config = read_config(str(folder))
    processor = load_image_processor(str(folder))
    assert isinstance(processor, Apertus1p5ImageProcessor) and processor.image_token_id == config.image_token_id
    text = "A <|image|> B <|image|> C <|image|> D"
    ids, mm = _expand(folder, text)
    sizes = [item.data["pixel_values"].shape[1:] for item in mm.items]
    assert [(tuple(s), sums) for s, (_, sums) in zip(sizes, RECORDED)] == [(r[0], r[1]) for r in RECORDED]
    for item, (_, (total, magnitude, ordered)) in zip(mm.items, RECORDED):
        pixels = item.data["pixel_values"].astype(np.float64)
        assert item.data["pixel_values"].dtype == np.float32
        assert abs(pixels.sum() - total) < 1e-3 and abs(np.abs(pixels).sum() - magnitude) < 1e-3
        assert abs((pixels * np.sin(np.arange(pixels.size)).reshape(pixels.shape)).sum() - ordered) < 1e-3
        span = ids[item.offset:item.end]
        assert [span[r] for r in item.embed_rows] == [config.image_token_id] * len(item.embed_rows)
        assert len(item.embed_rows) == pixels.shape[1] * pixels.shape[2] // FACTOR ** 2
    tok = AutoTokenizer.from_pretrained(folder)
    writer = SimpleNamespace(image_processor=SimpleNamespace(spatial_factor=FACTOR),
                             **{attr: getattr(tok, attr) for attr in av.TOKENS})
    parts = text.split("<|image|>")
    written = parts[0] + "".join(Apertus1p5Processor.replace_image_token(writer, {"image_sizes": sizes}, i) + rest
                                 for i, rest in enumerate(parts[1:]))
    assert ids == tok.encode(written) and mm.rope_positions is None


REFERENCE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer
    from transformers.models.apertus1p5.image_processing_apertus1p5 import Apertus1p5ImageProcessor
    from transformers.models.apertus1p5.processing_apertus1p5 import Apertus1p5Processor
    from transformers.processing_utils import ProcessorMixin
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: None  # (no audio feature extractor)
    folder, out = sys.argv[1], sys.argv[2]
    settings = json.load(open(folder + "/preprocessor_config.json"))
    settings.pop("image_processor_type")
    rng = np.random.RandomState(0)
    imgs = [Image.fromarray(rng.randint(0, 255, s, dtype=np.uint8)) for s in %r]
    processor = Apertus1p5Processor(image_processor=Apertus1p5ImageProcessor(**settings),
                                    tokenizer=AutoTokenizer.from_pretrained(folder))
    got = processor(text=["A <|image|> B <|image|> C <|image|> D"], images=imgs, return_tensors="pt")
    np.save(out + "/px.npy", got["pixel_values"].numpy())
    json.dump({"ids": got["input_ids"][0].tolist(), "sizes": np.asarray(got["image_sizes"]).tolist()},
              open(out + "/o.json", "w"))
""" % (SHAPES,))


def test_processor_equals_transformers_live(tiny_apertus, tmp_path):
    """Where torchvision imports (``APERTUS_TORCHVISION_PATH`` may name a folder holding it), transformers' own
    processor over the three images gives our prompt ids and pixels exactly (its batch cropped to each size)."""
    env = private_env(["APERTUS_TORCHVISION_PATH"], "torchvision", "transformers' Apertus 1.5 image processor",
                      "the recorded sums")
    (tmp_path / "reference.py").write_text(REFERENCE)
    subprocess.run([sys.executable, str(tmp_path / "reference.py"), str(tiny_apertus), str(tmp_path)], env=env,
                   check=True, capture_output=True, timeout=120)
    want = json.loads((tmp_path / "o.json").read_text())
    ids, mm = _expand(tiny_apertus, "A <|image|> B <|image|> C <|image|> D")
    assert ids == want["ids"]
    batch = np.load(tmp_path / "px.npy")
    for item, (h, w), padded in zip(mm.items, want["sizes"], batch):
        assert np.array_equal(item.data["pixel_values"], padded[:, :h, :w])


def test_smart_resize_follows_transformers():
    """The size rule against transformers' own ``smart_resize`` (in a module that imports torchvision: compared where
    it imports) and its values written out."""
    cases = [(28, 40, 256, 1024), (36, 20, 256, 1024), (10, 14, 256, 1024), (300, 7, 256, 1024),
             (1000, 1500, 4096, 65536), (30, 22, 256, 1024), (26, 19, 256, 1024)]
    ours = [smart_resize(h, w, FACTOR, least, most) for h, w, least, most in cases]
    # (transformers' own values; the last two: sides rounded to the nearest multiple, halves to even)
    assert ours == [(24, 36), (36, 20), (16, 20), (208, 4), (208, 312), (32, 24), (24, 20)]
    try:
        from transformers.models.apertus1p5.image_processing_apertus1p5 import smart_resize as theirs
    except ImportError:  # (torchvision missing)
        return
    assert ours == [theirs(h, w, FACTOR, least, most) for h, w, least, most in cases]


# ---- the encoder -----------------------------------------------------------------------------------------------------

def _encode(encoder, folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Our codes and token ids (what ``encode`` gives) of the three images, in prompt order."""
    _, mm = _expand(folder)
    with torch.no_grad():
        codes = [encoder.image_codes(torch.from_numpy(i.data["pixel_values"])).flatten() for i in mm.items]
        ids = [encoder.encode({k: torch.from_numpy(v) for k, v in i.data.items()}) for i in mm.items]
    return torch.cat(codes), torch.cat(ids)


def _hf(hf, folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = hf_inputs(folder)
    with torch.no_grad():
        out = hf.model.get_image_features(inputs["pixel_values"], inputs["image_sizes"])
    return torch.cat(out.image_tokens) - hf.config.image_token_offset, torch.cat(out.pooler_output)


def test_encoder_matches_transformers(tiny_apertus, hf_model):
    """Each image's codes equal transformers' ``get_image_tokens`` (54, 45 and 20 of them, not all one code);
    ``encode`` gives their vocabulary ids (int64), whose rows of the text model's embedding are transformers'
    ``get_image_features`` (what the text model embeds for them)."""
    encoder = load_image_encoder(str(tiny_apertus), read_config(str(tiny_apertus)), torch.float32, "cpu")
    assert isinstance(encoder, Apertus1p5ImageEncoder)
    (codes, ids), (want_codes, want_rows) = _encode(encoder, tiny_apertus), _hf(hf_model, tiny_apertus)
    assert codes.tolist() == want_codes.tolist() and len(codes) == 119 and len(set(codes.tolist())) > 10
    assert ids.dtype == torch.long and torch.equal(ids, codes + hf_model.config.image_token_offset)
    with torch.no_grad():
        assert max_diff(hf_model.get_input_embeddings()(ids), want_rows) < TOL


def test_encoder_in_bfloat16(tiny_apertus):
    """Built under bfloat16 the vision tokenizer stays float32 (transformers keeps it so: half precision flips codes)
    and gives the float32 codes."""
    folder = tiny_apertus
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.bfloat16, "cpu")
    assert {p.dtype for p in encoder.parameters()} == {torch.float32}
    full = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    (codes, ids), (want_codes, want_ids) = _encode(encoder, folder), _encode(full, folder)
    assert codes.tolist() == want_codes.tolist() and torch.equal(ids, want_ids)


# ---- the whole model -------------------------------------------------------------------------------------------------

@torch.no_grad()
def logits_with_images(model, ids: list[int], rows: dict[int, int], sizes: list[int]) -> torch.Tensor:
    """``model``'s logits [L, V] of ``ids`` in chunks of ``sizes`` over a paged cache of shuffled blocks, the image
    tokens' ids replaced by their codes' (prompt position -> id), as the runner writes them."""
    allocate_kv_cache(model, 80, 4)
    ids = [rows.get(p, t) for p, t in enumerate(ids)]
    table = random.Random(0).sample(range(80), -(-len(ids) // 4))
    out, start = [], 0
    for n in sizes:
        n = min(n, len(ids) - start)
        if n <= 0:
            break
        meta = build_attention_metadata([n], [start], [table], 4, "cpu")
        out.append(model.compute_logits(model(torch.tensor(ids[start:start + n]), meta)))
        start += n
    return torch.cat(out)


def image_rows(encoder, mm) -> dict[int, int]:
    """Prompt position -> the id of its image's code there."""
    rows = {}
    for item in mm.items:
        with torch.no_grad():
            values = encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()}).tolist()
        rows.update((item.offset + r, values[i]) for i, r in enumerate(item.embed_rows))
    return rows


SCHEDULES = {"prefill": [400], "chunked+decode": [20, 37, 50, 41] + [1] * 6 + [400]}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_with_images_match_transformers(tiny_apertus, hf_model, schedule):
    """transformers' ``Apertus1p5ForConditionalGeneration(input_ids, pixel_values, image_sizes)`` logits == our text
    model's (its pruned ids at -inf past them) with the encoder's codes in place of the image tokens, in one prefill
    and in chunks that split each image's span; without them they differ."""
    folder = tiny_apertus
    ids, mm = _expand(folder)
    spans = [(i.offset, i.end) for i in mm.items]
    cuts = np.cumsum(SCHEDULES["chunked+decode"][:4]).tolist()
    assert all(any(a < c < b for c in cuts) for a, b in spans), (spans, cuts)  # every image split
    model = load_model(str(folder))
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    with torch.no_grad():
        want = hf_model(**hf_inputs(folder)).logits[0]
    got = logits_with_images(model, ids, image_rows(encoder, mm), SCHEDULES[schedule])
    kept = want.shape[-1]
    assert got.shape[-1] == hf_model.config.text_config.vocab_size and bool(torch.isinf(got[:, kept:]).all())
    assert max_diff(got[:, :kept], want) < TOL
    plain = logits_with_images(model, ids, {}, [len(ids)])
    assert max_diff(plain[spans[0][0] + 8:, :kept], got[spans[0][0] + 8:, :kept]) > MOVED


# ---- each part shows -------------------------------------------------------------------------------------------------

def _no_attention(encoder) -> None:
    for stage in encoder.tokenizer.encoder.stages:
        for layer in stage.layers:
            layer.attention = None


def _no_mid_attention(encoder) -> None:
    encoder.tokenizer.encoder.mid.attn_1 = torch.nn.Identity()


def _pad_left_top(encoder) -> None:  # the downsample's zero pad before the rows and columns instead of after
    from specray.models.apertus1p5_vision import _apply

    for stage in encoder.tokenizer.encoder.stages:
        if stage.downsample is not None:
            conv = stage.downsample.conv
            stage.downsample = None
            layers = stage.layers
            stage.forward = (lambda x, layers=layers, conv=conv: _apply(
                conv, torch.nn.functional.pad(torch.nn.Sequential(*layers)(x), (1, 0, 1, 0)), stride=2, padding=0))


def _no_shortcut_conv(encoder) -> None:
    for stage in encoder.tokenizer.encoder.stages:
        for layer in stage.layers:
            if layer.resnet.nin_shortcut is not None:
                layer.resnet.nin_shortcut.weight.data.zero_()
                layer.resnet.nin_shortcut.bias.data.zero_()


def _no_quant_conv(encoder) -> None:
    conv = encoder.tokenizer.quant_conv
    conv.weight.data = torch.eye(conv.weight.shape[0])[:, :, None, None]
    conv.bias.data.zero_()


def _nearest_code(encoder) -> None:  # the code nearest in L2 (a VQ-VAE's rule) instead of the largest dot product
    tokenizer = encoder.tokenizer

    def nearest(pixels):
        x = tokenizer.latents(pixels)
        book = tokenizer.quantize.embedding.weight
        return torch.cdist(x.flatten(1).t(), book).argmin(-1).reshape(x.shape[1:])

    tokenizer.forward = nearest


def _offset_by_one(encoder) -> None:  # the codes' ids one later
    encoder.offset += 1


MUTATIONS = {"no-attention": _no_attention, "no-mid-attention": _no_mid_attention, "pad-left-top": _pad_left_top,
             "no-shortcut-conv": _no_shortcut_conv, "no-quant-conv": _no_quant_conv, "nearest-code": _nearest_code,
             "offset-by-one": _offset_by_one}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_rows(tiny_apertus, hf_model, mutation):
    """Each distinctive part switched off (or done another way) changes the ids from transformers' (the codes, or
    their offset)."""
    encoder = load_image_encoder(str(tiny_apertus), read_config(str(tiny_apertus)), torch.float32, "cpu")
    MUTATIONS[mutation](encoder)
    want = _hf(hf_model, tiny_apertus)[0] + hf_model.config.image_token_offset
    assert (_encode(encoder, tiny_apertus)[1] != want).sum() > 2


# ---- refusals --------------------------------------------------------------------------------------------------------

def test_unsupported_settings_are_refused(tiny_apertus, tmp_path):
    """A code range past the vocabulary, a width the GroupNorms cannot split, processor settings that disagree with
    the tokenizer or the model, a checkpoint missing a tensor of the tokenizer or the embedding: refused by name."""
    config = read_config(str(tiny_apertus))
    config.image_token_offset = config.text_config.vocab_size - 10
    with pytest.raises(ValueError, match=f"image_token_offset={config.image_token_offset}"):
        Apertus1p5ImageEncoder(config)
    config = read_config(str(tiny_apertus))
    config.vision_config.base_channels = 24
    with pytest.raises(ValueError, match="multiple of the GroupNorms' 32 groups"):
        Apertus1p5ImageEncoder(config)
    folder = shutil.copytree(tiny_apertus, tmp_path / "m")
    for change, words in ((dict(spatial_factor=8), "spatial_factor=8"), (dict(do_resize=False), "do_resize=False"),
                          (dict(resample=2), "resample=2")):
        (folder / "preprocessor_config.json").write_text(json.dumps({**SETTINGS, **change}))
        with pytest.raises(ValueError, match=words):
            load_image_processor(str(folder))
    config = read_config(str(folder))
    config.image_token_id = 7
    with pytest.raises(ValueError, match="image_token_id=7"):
        Apertus1p5ImageProcessor.from_pretrained(folder, config)
    encoder = Apertus1p5ImageEncoder(read_config(str(folder)))
    tensors = list(iter_weights(resolve_model(str(folder))))
    gone = "model.vision_tokenizer.quant_conv.weight"
    with pytest.raises(ValueError, match=gone.replace("model.vision_tokenizer.", "")):
        encoder.load_weights((n, t) for n, t in tensors if n != gone)


# ---- tensor parallel -------------------------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(tiny_apertus, tmp_path):
    """The text model split over two tensor-parallel ranks (the encoder replicated on each) gives one rank's logits
    with the images' rows in place, a prefill chunk ending inside an image's span."""
    checks = sys.modules["specray_test_image_checks"]  # tests/image_checks.py
    checks.assert_ranks_equal_one_rank(tmp_path, [checks.prompt_run(tiny_apertus, PROMPT, images(), first=30)], 1, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def test_engine_greedy_with_images_equals_transformers(tiny_apertus, hf_model):
    """``LLM.generate`` with three images (prefill chunks of 24 tokens, which split their spans; n-gram drafts) gives
    transformers' greedy ``generate`` tokens, token for token, beside a text-only prompt in the same batch; some
    drafts are accepted; transformers without the images generates other tokens."""
    from specray import LLM

    llm = LLM(model=str(tiny_apertus), max_model_len=384, block_size=4, max_num_batched_tokens=24,
              speculative_config=NGRAM)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py

    def processor(text, images, return_tensors):  # transformers' processor's output (its pixels: see above)
        return hf_inputs(tiny_apertus, text[0], images)

    runs.assert_images_greedy_equals_transformers(llm, hf_model, processor, PROMPT, images())


def test_a_hidden_state_head_embeds_the_image_codes(tiny_apertus, tmp_path, monkeypatch):
    """An EAGLE head drafting for Apertus 1.5 with images: where its row reads an image token (position p reads the
    token at p + 1), it takes the target's embedding of that image's code (the encoder gives codes, which the head
    embeds through the target as the runner's ids are); greedy output equals plain greedy output (lossless)."""
    from specray import LLM, SamplingParams
    from specray_test_draft_heads import record_head_rows, write_random_head  # tests/draft_heads.py

    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text(json.dumps(json.loads((tiny_apertus / "config.json").read_text())["text_config"]))
    head = write_random_head(tmp_path / "eagle", "eagle", text)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "hidden_act": "silu"}))  # (a Llama layer's MLP)
    kw = dict(model=str(tiny_apertus), max_model_len=384, block_size=4, max_num_batched_tokens=24)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": images()}}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = LLM(**kw).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    seen = record_head_rows(monkeypatch)
    drafted = LLM(**kw, speculative_config={"method": "eagle", "model": str(head), "num_speculative_tokens": 3})
    assert drafted.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
    ids, mm = _expand(tiny_apertus)
    encoder = load_image_encoder(str(tiny_apertus), read_config(str(tiny_apertus)), torch.float32, "cpu")
    codes = image_rows(encoder, mm)
    with torch.no_grad():
        rows = load_model(str(tiny_apertus)).embed(torch.tensor([codes.get(p, t) for p, t in enumerate(ids)]))
    checked = 0
    for positions, e in seen:
        for j, p in enumerate(positions):
            if p + 1 < len(ids):
                torch.testing.assert_close(e[j], rows[p + 1], atol=1e-5, rtol=1e-5)
                checked += p + 1 in codes
    assert checked == len(codes)
