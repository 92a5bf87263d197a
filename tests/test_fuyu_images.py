"""Fuyu's images (``FuyuForCausalLM``: :mod:`specray.models.fuyu_images`), against transformers on the same tiny random
fp32 weights: our expansion of the ``|SPEAKER|`` placeholder (``|SPEAKER|`` rows closed by ``|NEWLINE|``, then
``<s>``) and our patches equal ``FuyuProcessor``'s for images that are resized and not, in both served prompt forms
(token ids, and a string whose tokenizer's leading piece is dropped); each image's embeddings equal
``get_image_features``; the Persimmon text model's logits with them on the ``|SPEAKER|`` rows equal transformers'
whole model's over a prefill and over chunks splitting the image; each distinctive part broken once moves the logits;
what is not served is refused by name; the engine's greedy tokens with an image (n-gram drafts, chunks splitting it)
equal transformers' ``generate``; two tensor-parallel ranks equal one.

transformers' ``FuyuProcessor`` patchifies torch tensors (its torchvision image processor's ``patchify_image``);
without torchvision (the venv's case) the reference here is ``FuyuProcessor`` over ``FuyuImageProcessorPil`` whose
numpy ``patchify_image`` is wrapped to take and give torch tensors; where torchvision imports (a folder named by
``FUYU_TORCHVISION_PATH`` or ``LLAMA4_TORCHVISION_PATH``), the torchvision processor itself is compared too.

The tiny tokenizer is a sentencepiece-style Unigram one as fuyu-8b's is (a ``▁`` prepended to the text, ``|SPEAKER|``
and ``|NEWLINE|`` ordinary pieces, the byte pieces ``<0x04>`` matched from text), so that ``FuyuProcessor``'s
tokenization (the leading ``▁`` it strips before the image tokens) runs as it does on the release."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models.fuyu_images import FuyuImageEncoder, FuyuImageProcessor
from specray.models.loader import load_image_encoder, load_image_processor, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import (assert_ranks_equal_one_rank, config_with, encode_items, image_logits,
                                       private_env, prompt_run, random_images)  # tests/image_checks.py
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2
SIZE = {"height": 90, "width": 120}  # the padded size (fuyu-8b's: 1080 x 1920), 30-pixel patches as the release's
TEXT = "Hello world, how are you?\n"
PROMPT = "|SPEAKER| " + TEXT + "<0x04>"  # the served string form (a space after the placeholder)
SHAPES = [(50, 70), (200, 130), (40, 250)]  # kept (2 x 3 patches), shrunk to 90 x 58 (3 x 2), to 19 x 120 (1 x 4)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
TORCHVISION_PATHS = ("FUYU_TORCHVISION_PATH", "LLAMA4_TORCHVISION_PATH")


def build_tokenizer(path: Path):
    """A Unigram tokenizer of fuyu-8b's shape: a ``▁`` prepended and spaces written as ``▁`` (no pre-tokenizer),
    byte fallback, ``|SPEAKER|`` / ``|NEWLINE|`` and the byte pieces ordinary vocabulary entries."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import _CORPUS

    specials = ["<unk>", "<s>", "</s>", "|ENDOFTEXT|"]
    words = sorted({w for line in _CORPUS + [TEXT] for w in line.replace("\n", " ").split(" ") if w})
    chars = sorted({c for line in _CORPUS for c in line.replace(" ", "\u2581")} | {"\u2581"})
    vocab = [(t, 0.0) for t in specials] + [("|SPEAKER|", -1.0), ("|NEWLINE|", -1.0)]
    vocab += [(f"<0x{b:02X}>", -2.0) for b in range(256)] + [("\u2581" + w, -3.0) for w in words]
    vocab += [(c, -8.0) for c in chars if c != "|"]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="|ENDOFTEXT|", unk_token="<unk>",
                                 pad_token="<unk>")
    hf.save_pretrained(path)
    return hf


def build_tiny_fuyu(path: Path, seed: int = 0, **changes) -> Path:
    """transformers' FuyuForCausalLM (Persimmon text model, 30-pixel patches into the width 64), saved with
    FuyuImageProcessorPil (padded to 90 x 120) and the tokenizer above."""
    import transformers as tf
    from transformers.models.fuyu.image_processing_pil_fuyu import FuyuImageProcessorPil

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    text = tf.PersimmonConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=512, partial_rotary_factor=0.5,
                              qk_layernorm=True, eos_token_id=tok.eos_token_id, initializer_range=0.1)
    config = tf.FuyuConfig(text_config=text.to_dict(), patch_size=30, num_channels=3,
                           image_token_id=tok.convert_tokens_to_ids("|SPEAKER|"), **changes)
    torch.manual_seed(seed)
    model = tf.FuyuForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # norms, biases and the patch linear away from their init, so that every mistake shows
        for name, param in model.named_parameters():
            if name.endswith(("layernorm.weight", "norm.weight")):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.3)
            elif "vision_embed_tokens" in name or name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 1.0 if "language_model" in name else 2700 ** -0.5)
            elif param.dim() == 2:
                param.normal_(0.0, param.shape[1] ** -0.5)
    model.save_pretrained(path, safe_serialization=True)
    FuyuImageProcessorPil(size=SIZE).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_fuyu(tmp_path_factory) -> Path:
    return build_tiny_fuyu(tmp_path_factory.mktemp("tiny_fuyu_images"))


@pytest.fixture(scope="module")
def hf_model(tiny_fuyu):
    from transformers import FuyuForCausalLM

    return FuyuForCausalLM.from_pretrained(tiny_fuyu, dtype=torch.float32).eval()


def _theirs(folder: Path):
    """FuyuProcessor over the PIL image processor, its numpy patchify taking and giving torch tensors (what the
    torchvision backend's does)."""
    from transformers import AutoTokenizer, FuyuProcessor
    from transformers.models.fuyu.image_processing_pil_fuyu import FuyuImageProcessorPil

    class TorchPatches(FuyuImageProcessorPil):
        def patchify_image(self, image, patch_size=None):
            return torch.from_numpy(np.asarray(super().patchify_image(image.numpy(), patch_size)))

    return FuyuProcessor(image_processor=TorchPatches.from_pretrained(folder),
                         tokenizer=AutoTokenizer.from_pretrained(folder))


def _hf_inputs(folder: Path, image) -> dict:
    out = _theirs(folder)(text=TEXT, images=image, return_tensors="pt", return_legacy_image_output=False)
    return {k: out[k] for k in ("input_ids", "attention_mask", "pixel_values")}


def _ours(folder: Path, image, form: str = "string"):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    if form == "string":
        ids = tok.encode(PROMPT)
    else:  # FuyuProcessor's own form: the placeholder, then the text and <0x04> tokenized alone
        ids = [tok.convert_tokens_to_ids("|SPEAKER|")] + tok(TEXT + "<0x04>", add_special_tokens=False)["input_ids"]
    return expand_prompt(ids, [image], load_image_processor(str(folder)))


@pytest.mark.parametrize("form", ["string", "token_ids"])
def test_processor_matches_transformers(tiny_fuyu, form):
    """Our expanded prompt (image rows, newlines, BOS, text, <0x04>) and patches equal FuyuProcessor's for an image
    kept, one shrunk to the height and one to the width; the embeddings go on the |SPEAKER| rows only."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_fuyu)
    speaker, newline, bos = tok.convert_tokens_to_ids(["|SPEAKER|", "|NEWLINE|", "<s>"])
    grids = []
    for image in random_images(SHAPES):
        want = _hf_inputs(tiny_fuyu, image)
        ids, mm = _ours(tiny_fuyu, image, form)
        assert ids == want["input_ids"][0].tolist()
        assert np.array_equal(mm.items[0].data["pixel_values"], want["pixel_values"].numpy())
        item = mm.items[0]
        assert item.offset == 0 and ids[item.end - 1] == bos and ids[item.end:] != []
        assert [ids[r] for r in item.embed_rows] == [speaker] * len(want["pixel_values"])
        assert ids[:item.end].count(newline) + len(item.embed_rows) + 1 == item.length
        grids.append((ids[:item.end].count(newline), len(item.embed_rows) // ids[:item.end].count(newline)))
    assert grids == [(2, 3), (3, 2), (1, 4)]


def test_torchvision_processor_matches_ours(tiny_fuyu, tmp_path):
    """Where torchvision imports, transformers' default FuyuProcessor (the torchvision image processor) gives our ids,
    and our patches for an image it keeps; for a shrunk one (torchvision's bilinear resize, not PIL's) a few values
    differ by one 8-bit level (2/255 after the normalization to [-1, 1])."""
    env = private_env(TORCHVISION_PATHS, "torchvision", "transformers' torchvision FuyuImageProcessor",
                      "the PIL processor with torch patches")
    images = random_images(SHAPES)
    for i, image in enumerate(images):
        image.save(tmp_path / f"{i}.png")
    script = f"""
import json, sys
import numpy as np
from PIL import Image
from transformers import AutoTokenizer, FuyuImageProcessor, FuyuProcessor
folder = {str(tiny_fuyu)!r}
ip = FuyuImageProcessor.from_pretrained(folder)
assert "Pil" not in type(ip).__name__, type(ip)
proc = FuyuProcessor(image_processor=ip, tokenizer=AutoTokenizer.from_pretrained(folder))
out = {{}}
for i in range({len(images)}):
    got = proc(text={TEXT!r}, images=Image.open(f"{tmp_path}/{{i}}.png").convert("RGB"), return_tensors="pt",
               return_legacy_image_output=False)
    np.save(f"{tmp_path}/{{i}}.npy", got["pixel_values"].numpy())
    out[i] = got["input_ids"][0].tolist()
print(json.dumps(out))
"""
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    for i, image in enumerate(images):
        ids, mm = _ours(tiny_fuyu, image)
        assert ids == theirs[str(i)]
        diff = np.abs(mm.items[0].data["pixel_values"] - np.load(tmp_path / f"{i}.npy"))
        if SHAPES[i][0] <= SIZE["height"] and SHAPES[i][1] <= SIZE["width"]:
            assert diff.max() < 1e-6
        else:
            assert diff.max() < 2 / 255 + 1e-6 and (diff > 1e-6).mean() < 0.05, ((diff > 1e-6).mean(), diff.max())


def test_encoder_matches_get_image_features(tiny_fuyu, hf_model):
    encoder = load_image_encoder(str(tiny_fuyu), read_config(str(tiny_fuyu)), torch.float32, "cpu")
    for image in random_images(SHAPES):
        _, mm = _ours(tiny_fuyu, image)
        pixels = torch.from_numpy(mm.items[0].data["pixel_values"])
        with torch.no_grad():
            want = hf_model.model.get_image_features(pixels[None]).last_hidden_state[0]
        assert max_diff(encode_items(encoder, mm)[0], want) < TOL


def _want(hf_model, ids, mm) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([ids]),
                        pixel_values=torch.from_numpy(mm.items[0].data["pixel_values"])[None]).logits[0]


@pytest.mark.parametrize("sizes", [None, [5, 4, 7]], ids=["prefill", "chunks-splitting-the-image"])
def test_logits_with_an_image_match_transformers(tiny_fuyu, hf_model, sizes):
    """transformers' whole model's logits == our Persimmon's with the patch rows in place, in one prefill and in
    chunks (5, 4, 7 tokens, then single steps) that split the image's rows; without the rows they differ."""
    model = load_model(str(tiny_fuyu))
    encoder = load_image_encoder(str(tiny_fuyu), read_config(str(tiny_fuyu)), torch.float32, "cpu")
    ids, mm = _ours(tiny_fuyu, random_images(SHAPES)[1])  # 3 rows of 2 patches: 10 tokens with the BOS
    want = _want(hf_model, ids, mm)
    embeds = encode_items(encoder, mm)
    assert max_diff(image_logits(model, ids, mm, embeds, sizes), want) < TOL
    plain = image_logits(model, ids, mm.__class__([]), [], None)
    assert max_diff(plain[mm.items[0].end:], want[mm.items[0].end:]) > MOVED


def _newline_as_image(ids, mm, embeds, tok):  # the row-closing token written as another |SPEAKER|
    return [tok["|SPEAKER|"] if t == tok["|NEWLINE|"] else t for t in ids], mm, embeds


def _no_bos_after_image(ids, mm, embeds, tok):  # the <s> after the image written as |NEWLINE|
    ids = list(ids)
    ids[mm.items[0].end - 1] = tok["|NEWLINE|"]
    return ids, mm, embeds


def _patch_channels_first(ids, mm, embeds, tok):  # each patch flattened (channels, rows, columns)
    item = mm.items[0]
    pixels = item.data["pixel_values"]
    moved = pixels.reshape(len(pixels), 30, 30, 3).transpose(0, 3, 1, 2).reshape(len(pixels), -1)
    return ids, mm, [embeds[1](moved)]


def _patches_column_major(ids, mm, embeds, tok):  # the 3 x 2 grid's patches read down the columns
    order = torch.arange(6).reshape(3, 2).T.reshape(-1)
    return ids, mm, [embeds[0][order]]


def _no_patch_bias(ids, mm, embeds, tok):
    return ids, mm, [embeds[0] - embeds[2].vision_embed_tokens.bias]


MUTATIONS = {"newline-as-image-token": _newline_as_image, "no-bos-after-image": _no_bos_after_image,
             "patch-channels-first": _patch_channels_first, "patches-column-major": _patches_column_major,
             "no-patch-bias": _no_patch_bias}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_logits(tiny_fuyu, hf_model, mutation):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_fuyu).get_vocab()
    model = load_model(str(tiny_fuyu))
    encoder = load_image_encoder(str(tiny_fuyu), read_config(str(tiny_fuyu)), torch.float32, "cpu")
    ids, mm = _ours(tiny_fuyu, random_images(SHAPES)[1])
    want = _want(hf_model, ids, mm)

    def encode(pixels):
        with torch.no_grad():
            return encoder.encode({"pixel_values": torch.from_numpy(np.ascontiguousarray(pixels))})
    embeds = encode_items(encoder, mm)
    bad_ids, bad_mm, bad = MUTATIONS[mutation](ids, mm, [embeds[0], encode, encoder], tok)
    assert max_diff(image_logits(model, bad_ids, bad_mm, bad[:1], None), want) > MOVED


def test_refusals(tiny_fuyu, tmp_path):
    """One image per prompt, first; the config's image token, patch size and channels; the patch linear's tensors;
    an image processor that does not pad to whole patches; a tokenizer without |NEWLINE|."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_fuyu)
    processor = load_image_processor(str(tiny_fuyu))
    image = random_images(SHAPES)[0]
    with pytest.raises(ValueError, match="takes one image per prompt"):
        expand_prompt(tok.encode("|SPEAKER| a |SPEAKER| b"), [image, image], processor)
    with pytest.raises(ValueError, match="must come first"):
        expand_prompt(tok.encode("Hello |SPEAKER| world"), [image], processor)
    with pytest.raises(ValueError, match="image_token_id=5 .* set image_token_id to 4"):
        FuyuImageProcessor.from_pretrained(tiny_fuyu, config_with(tiny_fuyu, image_token_id=5))
    with pytest.raises(ValueError, match=r"patch_size=\(30, 30\) .* patch_size=16"):
        FuyuImageProcessor.from_pretrained(tiny_fuyu, config_with(tiny_fuyu, patch_size=16))
    with pytest.raises(ValueError, match="num_channels=1 .* set num_channels to 3"):
        FuyuImageEncoder(config_with(tiny_fuyu, num_channels=1))
    encoder = FuyuImageEncoder(read_config(str(tiny_fuyu)))
    with pytest.raises(ValueError, match=r"lacks .*'vision_embed_tokens.bias'"):
        encoder.load_weights([("model.vision_embed_tokens.weight", torch.zeros(64, 2700))])
    processor.image_processor.do_pad = False  # a 50 x 70 image, not padded: not whole patches
    with pytest.raises(ValueError, match="set do_pad true"):
        processor.process(image)
    with pytest.raises(ValueError, match=re.escape("has no '|NEWLINE|' token")):
        from transformers import PreTrainedTokenizerFast
        folder = tmp_path / "no_newline"
        folder.mkdir()
        for name in ("config.json", "preprocessor_config.json"):
            (folder / name).write_bytes((tiny_fuyu / name).read_bytes())
        data = json.loads((tiny_fuyu / "tokenizer.json").read_text())
        data["model"]["vocab"] = [[p, s] if p != "|NEWLINE|" else ["|NEWLINX|", s] for p, s in data["model"]["vocab"]]
        (folder / "tokenizer.json").write_text(json.dumps(data))
        PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), unk_token="<unk>",
                                bos_token="<s>").save_pretrained(folder)
        FuyuImageProcessor.from_pretrained(folder, read_config(str(tiny_fuyu)))


def test_engine_greedy_with_an_image_equals_transformers(tiny_fuyu, hf_model):
    """``LLM.generate`` with the string form (8-token prefill chunks splitting the image, n-gram drafts) gives
    transformers' greedy ``generate`` from FuyuProcessor's inputs; a plain prompt in the same batch too; without the
    image transformers generates other tokens."""
    from specray import LLM

    llm = LLM(model=str(tiny_fuyu), max_model_len=256, block_size=4, max_num_batched_tokens=8,
              speculative_config=NGRAM)
    image = random_images(SHAPES)[1]
    sys.modules["specray_test_engine_runs"].assert_images_greedy_equals_transformers(
        llm, hf_model, None, PROMPT, [image], plain_text="Hello world, how are", max_tokens=24,
        inputs=_hf_inputs(tiny_fuyu, image))


def test_tensor_parallel_two_ranks_equal_one(tiny_fuyu, tmp_path):
    """Persimmon split over two tensor-parallel ranks (the patch linear whole on each) gives one rank's logits with
    the image's rows in place, a prefill chunk ending inside the image's rows."""
    run = prompt_run(tiny_fuyu, PROMPT, random_images(SHAPES)[1:2], first=4)
    assert_ranks_equal_one_rank(tmp_path, [run], 1, TOL)

