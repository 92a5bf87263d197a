"""Emu3's images (``Emu3ForConditionalGeneration``: :mod:`specray.models.emu3_vision`), against transformers on the
same tiny random fp32 weights. An image becomes discrete codes (the VQ-VAE's encoder with its temporal convs, the
nearest code in L2), mapped to their visual tokens' ids with an end-of-line id per row, embedded by the text model's
own embedding. Checked: our expanded prompt and pixels equal ``Emu3Processor``'s (transformers' own, PIL backend) for
three images (left at its size, grown to the floor, shrunk into the budget); each image's ids equal transformers'
``get_image_tokens``; the text model's logits with those ids equal transformers' whole model's (pixels in) over a
prefill and over chunks that split the images' spans; each distinctive part of the encoder broken once moves the ids;
what is not implemented is refused by name. The engine's greedy tokens with an image (chunks splitting its span,
n-gram drafts) equal transformers' ``generate``; two tensor-parallel ranks equal one. No GPU check here."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models import emu3_vision as ev
from specray.models.attention import build_attention_metadata
from specray.models.emu3_vision import Emu3ImageEncoder, Emu3ImageProcessor
from specray.models.kv_cache import allocate_kv_cache
from specray.models.loader import iter_weights, load_image_encoder, load_image_processor, load_model, read_config, \
    resolve_model
from specray.multimodal import expand_prompt
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2
CODES = 32
SPECIAL = {"image_token": "<image>", "boi_token": "<|image start|>", "eoi_token": "<|image end|>",
           "image_wrapper_token": "<|image token|>", "eof_token": "<|extra_201|>"}
VISUALS = tuple(f"<|visual token {i:06d}|>" for i in range(CODES))
SETTINGS = {"image_processor_type": "Emu3ImageProcessor", "spatial_factor": 8, "min_pixels": 1024,
            "max_pixels": 2304}
VQ = dict(codebook_size=CODES, embed_dim=8, latent_channels=8, base_channels=32, channel_multiplier=[1, 1, 1, 1],
          num_res_blocks=1, attn_resolutions=[2, 3], hidden_size=32, num_attention_heads=2,
          temporal_downsample_factor=4)
# left at its size (40 x 56), grown to the 1024-pixel floor (30 x 20 -> 40 x 32), shrunk into 2304 (64 x 60 -> 48 x 40)
SHAPES = ((40, 56, 3), (30, 20, 3), (64, 60, 3))
# two images of one size after resizing (transformers pads a batch of images: its codes then depend on the padding)
SAME = ((40, 56, 3), (42, 54, 3))
BOS = "<|im_start|>"  # Emu3Processor writes the tokenizer's bos_token before the text
PROMPT = BOS + "Look at <image> and then at <image>, the quick brown fox jumps"


def images(shapes=SHAPES) -> list:
    from PIL import Image

    rng = np.random.RandomState(0)
    return [Image.fromarray(rng.randint(0, 255, shape, dtype=np.uint8)) for shape in shapes]


def build_tiny_emu3(path: Path, seed: int = 0) -> Path:
    """transformers' Emu3ForConditionalGeneration: a two-layer text model over conftest's tiny tokenizer (with the
    processor's special tokens, the end-of-line token and 32 visual tokens), a four-level VQ-VAE of 32 codes (attention
    in the last two levels and the middle, two heads; temporal factor 4: two temporal convs), its norms and BatchNorm
    statistics random; the head a copy of the embedding (greedy decoding loops, so n-gram drafts are accepted)."""
    from transformers import AutoTokenizer, Emu3Config, Emu3ForConditionalGeneration

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(path, extra_special_tokens=(*SPECIAL.values(), ev.EOL, *VISUALS))
    saved = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**saved, "extra_special_tokens": SPECIAL,
                                                                 "bos_token": BOS}))
    tok = AutoTokenizer.from_pretrained(path)
    n = len(tok)
    text = dict(vocab_size=n, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.1,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config = Emu3Config(text_config=text, vq_config=VQ, vocabulary_map=tok.get_vocab(), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Emu3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif "norm" in name and name.endswith("bias"):
                param.normal_(0.0, 0.3)
        for name, buf in model.named_buffers():
            if name.endswith("running_mean"):
                buf.normal_(0.0, 0.3)
            elif name.endswith("running_var"):
                buf.uniform_(0.5, 2.0)
        model.lm_head.weight.copy_(model.get_input_embeddings().weight)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(SETTINGS))
    return path


@pytest.fixture(scope="module")
def tiny_emu3(tmp_path_factory) -> Path:
    return build_tiny_emu3(tmp_path_factory.mktemp("tiny_emu3_images"))


@pytest.fixture(scope="module")
def hf_model(tiny_emu3):
    from transformers import Emu3ForConditionalGeneration

    return Emu3ForConditionalGeneration.from_pretrained(tiny_emu3, dtype=torch.float32).eval()


def hf_processor(folder: Path):
    from transformers import AutoTokenizer
    from transformers.models.emu3.image_processing_emu3 import Emu3ImageProcessor as Pixels
    from transformers.models.emu3.processing_emu3 import Emu3Processor

    return Emu3Processor(image_processor=Pixels.from_pretrained(folder),
                         tokenizer=AutoTokenizer.from_pretrained(folder))


def _expand(folder: Path, text: str = PROMPT, imgs: list | None = None):
    from transformers import AutoTokenizer

    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text), images(SAME) if imgs is None else imgs,
                         load_image_processor(str(folder)))


# ---- the processor -------------------------------------------------------------------------------------------------

def test_processor_matches_transformers(tiny_emu3):
    """Three images of three sizes: our prompt ids are Emu3Processor's (the grid header, rows * (cols + 1) image
    tokens, the eof and end markers), our pixels its batch cropped to each image's size; every image token takes a
    row."""
    folder = tiny_emu3
    config = read_config(str(folder))
    processor = load_image_processor(str(folder))
    assert isinstance(processor, Emu3ImageProcessor) and processor.image_token_id == config.image_token_id
    text = "A <image> B <image> C <image> D"
    ids, mm = _expand(folder, BOS + text, images())
    got = hf_processor(folder)(text=[text], images=images(), return_tensors="np")
    assert ids == got["input_ids"][0].tolist() and mm.rope_positions is None
    sizes = [tuple(s) for s in np.asarray(got["image_sizes"]).tolist()]
    assert sizes == [(40, 56), (40, 32), (48, 40)]
    for item, (h, w), padded in zip(mm.items, sizes, got["pixel_values"]):
        assert item.data["pixel_values"].dtype == np.float32
        assert np.array_equal(item.data["pixel_values"], padded[:, :h, :w])
        span = ids[item.offset:item.end]
        assert [span[r] for r in item.embed_rows] == [config.image_token_id] * len(item.embed_rows)
        assert len(item.embed_rows) == h // 8 * (w // 8 + 1)


# ---- the encoder -----------------------------------------------------------------------------------------------------

def _ours(encoder, folder: Path, imgs: list) -> torch.Tensor:
    _, mm = _expand(folder, " ".join(["<image>"] * len(imgs)), imgs)
    with torch.no_grad():
        return torch.cat([encoder.encode({k: torch.from_numpy(v) for k, v in i.data.items()}) for i in mm.items])


def _theirs(hf, folder: Path, imgs: list) -> torch.Tensor:
    """transformers' ``get_image_tokens`` of each image alone (a batch of one: no padding)."""
    _, mm = _expand(folder, " ".join(["<image>"] * len(imgs)), imgs)
    out = []
    with torch.no_grad():
        for item in mm.items:
            px = torch.from_numpy(item.data["pixel_values"])[None]
            out.append(hf.model.get_image_tokens(px, torch.tensor([list(px.shape[2:])])))
    return torch.cat(out)


def test_encoder_matches_transformers(tiny_emu3, hf_model):
    """Each image's ids (visual tokens and an end-of-line id per row) equal transformers' ``get_image_tokens`` (40, 25
    and 36 of them, many codes); also built under bfloat16, where the VQ-VAE stays float32."""
    config = read_config(str(tiny_emu3))
    encoder = load_image_encoder(str(tiny_emu3), config, torch.float32, "cpu")
    assert isinstance(encoder, Emu3ImageEncoder)
    ours, want = _ours(encoder, tiny_emu3, images()), _theirs(hf_model, tiny_emu3, images())
    assert ours.dtype == torch.long and ours.tolist() == want.tolist() and len(ours) == 40 + 25 + 36
    assert len(set(ours.tolist())) > 10 and (ours == config.vocabulary_map[ev.EOL]).sum() == 5 + 5 + 6
    half = load_image_encoder(str(tiny_emu3), config, torch.bfloat16, "cpu")
    assert {p.dtype for p in half.parameters()} == {torch.float32}
    assert _ours(half, tiny_emu3, images()).tolist() == want.tolist()


# ---- the whole model -------------------------------------------------------------------------------------------------

@torch.no_grad()
def logits_with_images(model, ids: list[int], rows: dict[int, int], sizes: list[int]) -> torch.Tensor:
    """``model``'s logits [L, V] of ``ids`` in chunks of ``sizes`` over a paged cache of shuffled blocks, the image
    tokens' ids replaced by the encoder's (prompt position -> id), as the runner writes them."""
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
    rows = {}
    for item in mm.items:
        with torch.no_grad():
            values = encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()}).tolist()
        rows.update((item.offset + r, values[i]) for i, r in enumerate(item.embed_rows))
    return rows


SCHEDULES = {"prefill": [400], "chunked+decode": [9, 20, 30, 11] + [1] * 6 + [400]}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_with_images_match_transformers(tiny_emu3, hf_model, schedule):
    """transformers' ``Emu3ForConditionalGeneration(input_ids, pixel_values, image_sizes)`` logits (two images of one
    size) == our text model's with the encoder's ids in place of the image tokens, in one prefill and in chunks that
    split each image's span; without them they differ."""
    folder = tiny_emu3
    ids, mm = _expand(folder)
    spans = [(i.offset, i.end) for i in mm.items]
    cuts = np.cumsum(SCHEDULES["chunked+decode"][:4]).tolist()
    assert all(any(a < c < b for c in cuts) for a, b in spans), (spans, cuts)  # every image split
    got = hf_processor(folder)(text=[PROMPT.removeprefix(BOS)], images=images(SAME), return_tensors="pt")
    assert got["input_ids"][0].tolist() == ids
    with torch.no_grad():
        want = hf_model(**got).logits[0]
    model = load_model(str(folder))
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    ours = logits_with_images(model, ids, image_rows(encoder, mm), SCHEDULES[schedule])
    assert max_diff(ours, want) < TOL
    plain = logits_with_images(model, ids, {}, [len(ids)])
    assert max_diff(plain[spans[0][0] + 8:], ours[spans[0][0] + 8:]) > MOVED


# ---- each part shows -------------------------------------------------------------------------------------------------

def _levels(encoder):
    return encoder.vq.encoder.down_block.down


def _no_level_attention(encoder, monkeypatch) -> None:
    for level in _levels(encoder):
        level.attn, level.attn_norms = torch.nn.ModuleList(), torch.nn.ModuleList()


def _no_mid_attention(encoder, monkeypatch) -> None:
    mid = encoder.vq.encoder.middle_block.attn_1
    mid.out_proj.weight.data.zero_()
    mid.out_proj.bias.data.zero_()


def _one_head(encoder, monkeypatch) -> None:
    for module in encoder.modules():
        if isinstance(module, ev.Attention):
            module.heads = 1


def _pad_left_top(encoder, monkeypatch) -> None:  # the downsample's zero pad before the rows and columns
    real = ev.F.pad
    monkeypatch.setattr(ev.F, "pad", lambda x, pad, *a, **k: real(x, (1, 0, 1, 0) if tuple(pad) == (0, 1, 0, 1)
                                                                     else pad, *a, **k))


def _centred_time(encoder, monkeypatch) -> None:  # the 3D convs padded one frame each side instead of two before
    real = ev._causal

    def centred(conv, x, stride=1):
        kw = conv.conv.weight.shape[-1]
        pad = (kw - 1) // 2, (kw - 1) // 2, (kw - 1) // 2, (kw - 1) // 2, 1, 1
        return ev.F.conv3d(ev.F.pad(x, pad), conv.conv.weight, conv.conv.bias, stride=(stride, 1, 1))

    assert real is not centred
    monkeypatch.setattr(ev, "_causal", centred)


def _no_time_blocks(encoder, monkeypatch) -> None:
    encoder.vq.encoder.time_res_stack = torch.nn.ModuleList()


def _no_running_stats(encoder, monkeypatch) -> None:  # BatchNorm as if its statistics were 0 and 1
    for block in encoder.vq.encoder.time_res_stack:
        for norm in (block.norm1, block.norm2):
            norm.running_mean.data.zero_()
            norm.running_var.data.fill_(1.0)


def _dot_product_code(encoder, monkeypatch) -> None:  # the largest dot product (IBQ's rule) instead of L2
    vq = encoder.vq

    def largest(pixels):
        z = vq.latents(pixels)
        return (z @ vq.quantize.embedding.weight.t()).argmax(1).reshape(pixels.shape[-2] // 8, pixels.shape[-1] // 8)

    vq.forward = largest


def _no_end_of_line(encoder, monkeypatch) -> None:  # each row ended with the first code's id instead
    encoder.eol = int(encoder.code_ids[0])


# the encoder's parts, shown in its latents (the quantizer's input; on tiny random weights a part may move few codes)
LATENT_MUTATIONS = {"no-level-attention": _no_level_attention, "no-mid-attention": _no_mid_attention,
                    "one-head": _one_head, "pad-left-top": _pad_left_top, "centred-time-pad": _centred_time,
                    "no-time-blocks": _no_time_blocks, "no-running-stats": _no_running_stats}
# the quantizer's and the id mapping's, shown in the ids
ID_MUTATIONS = {"dot-product-code": _dot_product_code, "no-end-of-line": _no_end_of_line}


def _their_latents(hf, pixels: torch.Tensor) -> torch.Tensor:
    """transformers' quantizer input [h * w, D] for one image's pixels [3, H, W] (the frame repeated in time)."""
    vq = hf.model.vqmodel
    frames = pixels[None, None].repeat(1, vq.config.temporal_downsample_factor, 1, 1, 1)
    with torch.no_grad():
        x = vq.quant_conv(vq.encoder(frames).permute(0, 2, 1, 3, 4))  # [1, D, 1, h, w]
    return x[0, :, 0].flatten(1).t()


@pytest.mark.parametrize("mutation", sorted(LATENT_MUTATIONS) + sorted(ID_MUTATIONS))
def test_each_part_shows(tiny_emu3, hf_model, mutation, monkeypatch):
    """Each distinctive part switched off (or done another way) moves the latents from transformers' (unbroken they
    agree), or, for the quantizer and the id mapping, changes the ids."""
    encoder = load_image_encoder(str(tiny_emu3), read_config(str(tiny_emu3)), torch.float32, "cpu")
    _, mm = _expand(tiny_emu3, "<image>", images()[:1])
    pixels = torch.from_numpy(mm.items[0].data["pixel_values"])
    want, want_ids = _their_latents(hf_model, pixels), _theirs(hf_model, tiny_emu3, images()[:1])
    with torch.no_grad():
        assert max_diff(encoder.vq.latents(pixels[None]), want) < TOL
    if mutation in LATENT_MUTATIONS:
        LATENT_MUTATIONS[mutation](encoder, monkeypatch)
        with torch.no_grad():
            assert max_diff(encoder.vq.latents(pixels[None]), want) > MOVED
    else:
        ID_MUTATIONS[mutation](encoder, monkeypatch)
        got = _ours(encoder, tiny_emu3, images()[:1])
        assert got.shape == want_ids.shape and (got != want_ids).sum() > 2


# ---- refusals --------------------------------------------------------------------------------------------------------

def test_unsupported_settings_are_refused(tiny_emu3, tmp_path):
    """A downsampling other than 8, a double latent, a temporal factor not a power of two, an attention width other
    than its level's, a code without its visual token, processor settings that disagree, a tokenizer whose image
    token is not vocabulary_map's, a checkpoint missing a tensor: refused by name."""
    for field, value, words in (("channel_multiplier", [1, 1, 1], "channel_multiplier=\\[1, 1, 1\\]"),
                                ("double_latent", True, "double_latent=True"),
                                ("temporal_downsample_factor", 3, "temporal_downsample_factor=3"),
                                ("hidden_size", 64, "hidden_size=64")):
        config = read_config(str(tiny_emu3))
        setattr(config.vq_config, field, value)
        with pytest.raises(ValueError, match=words):
            Emu3ImageEncoder(config)
    config = read_config(str(tiny_emu3))
    config.vocabulary_map = {k: v for k, v in config.vocabulary_map.items() if k != VISUALS[5]}
    with pytest.raises(ValueError, match="visual tokens of codes \\[5\\]"):
        Emu3ImageEncoder(config)
    folder = shutil.copytree(tiny_emu3, tmp_path / "m")
    for change, words in ((dict(spatial_factor=16), "spatial_factor=16"), (dict(do_resize=False), "do_resize=False")):
        (folder / "preprocessor_config.json").write_text(json.dumps({**SETTINGS, **change}))
        with pytest.raises(ValueError, match=words):
            load_image_processor(str(folder))
    (folder / "preprocessor_config.json").write_text(json.dumps(SETTINGS))
    config = read_config(str(folder))
    config.vocabulary_map = {**config.vocabulary_map, "<image>": 7}
    with pytest.raises(ValueError, match="vocabulary_map\\['<image>'\\]=7"):
        Emu3ImageProcessor.from_pretrained(folder, config)
    encoder = Emu3ImageEncoder(read_config(str(folder)))
    tensors = list(iter_weights(resolve_model(str(folder))))
    gone = "vqmodel.encoder.time_res_stack.0.norm1.running_mean"  # (the decoder's own is not read)
    assert gone in dict(tensors)
    with pytest.raises(ValueError, match=gone.removeprefix("vqmodel.")):
        encoder.load_weights((n, t) for n, t in tensors if n != gone)


# ---- tensor parallel -------------------------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(tiny_emu3, tmp_path):
    """The text model split over two tensor-parallel ranks (the encoder replicated on each) gives one rank's logits
    with the images' ids in place, a prefill chunk ending inside the first image's span."""
    checks = sys.modules["specray_test_image_checks"]  # tests/image_checks.py
    checks.assert_ranks_equal_one_rank(tmp_path, [checks.prompt_run(tiny_emu3, PROMPT, images(SAME), first=12)], 1, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def test_engine_greedy_with_images_equals_transformers(tiny_emu3, hf_model):
    """``LLM.generate`` with two images (prefill chunks of 16 tokens, which split their spans; n-gram drafts) gives
    transformers' greedy ``generate`` tokens, token for token, beside a text-only prompt in the same batch; some
    drafts are accepted; transformers without the images generates other tokens."""
    from specray import LLM

    llm = LLM(model=str(tiny_emu3), max_model_len=384, block_size=4, max_num_batched_tokens=16,
              speculative_config=NGRAM)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    processor = hf_processor(tiny_emu3)

    def process(text, images, return_tensors):
        return processor(text=[t.removeprefix(BOS) for t in text], images=images, return_tensors=return_tensors)

    runs.assert_images_greedy_equals_transformers(llm, hf_model, process, PROMPT, images(SAME))
