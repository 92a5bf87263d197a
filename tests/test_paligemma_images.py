"""PaliGemma's images (``PaliGemmaForConditionalGeneration``, :mod:`specray.models.paligemma`) against transformers on
tiny random fp32 weights: a SigLIP tower (28-pixel images of 7-pixel patches: 16 tokens an image) and the linear
projector before a Gemma (PaliGemma) and before a Gemma 2 (PaliGemma 2: soft caps, a sliding window longer than the
prompts), a sentencepiece-style Gemma tokenizer with PaliGemmaProcessor's ``<image>`` and location tokens. Our
finished prompt (images, ``<bos>``, the text, ``"\\n"``) and pixels equal PaliGemmaProcessor's for one and two images;
the embeddings equal ``get_image_features``; the text model fed them, the whole prompt one span attending both ways,
equals the whole model's logits (transformers' ``token_type_ids`` prefix), then single steps; the text model alone
equals it without images; each distinctive part undone moves the logits or the prompt; ``LLM.generate`` with images
and n-gram drafts equals ``generate``, with prefix caching too (a prompt's cached blocks serve that prompt alone);
two tensor-parallel ranks equal one; refusals by name."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.multimodal import expand_prompt
from specray_test_image_checks import (assert_ranks_equal_one_rank, config_with, encode_items, image_logits,
                                       random_images)
from specray_test_model_checks import max_diff

TOL, MOVED = 1e-4, 1e-2
SIZE, PATCH, TOKENS = 28, 7, 16
KINDS = ("gemma", "gemma2")
PROMPTS = {1: "<image>caption en", 2: "<image><image>answer en what is the quick brown fox\n"}
SHAPES = ((20, 100), (40, 30))
EXTRA = [7, 300, 41, 5, 99]  # tokens past the prompt (decode steps, causal)
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rms_norm_eps=1e-6)
GEMMA2 = dict(sliding_window=64, final_logit_softcapping=5.0, attn_logit_softcapping=10.0, query_pre_attn_scalar=16)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=SIZE,
              patch_size=PATCH, layer_norm_eps=1e-6)


def images(count: int = 2) -> list:
    return random_images(SHAPES[:count])


def build(path: Path, kind: str, seed: int = 0) -> Path:
    """transformers' PaliGemmaForConditionalGeneration with a ``kind`` text model, saved with PaliGemmaProcessor
    (SigLIP's PIL image processor of 28 pixels, ``image_seq_length`` 16; the tiny Gemma tokenizer, ``<image>`` and
    the location / segmentation tokens added as the processor adds them)."""
    from transformers import (Gemma2Config, GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration,
                              PaliGemmaProcessor, SiglipVisionConfig)
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    from tests.conftest import build_spm_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    images_ = SiglipImageProcessorPil(size={"height": SIZE, "width": SIZE})
    images_.image_seq_length = TOKENS
    processor = PaliGemmaProcessor(image_processor=images_, tokenizer=build_spm_tokenizer(path, "gemma"))
    processor.save_pretrained(path)
    tok = processor.tokenizer
    ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id)
    text = GemmaConfig(**ids, **TEXT, tie_word_embeddings=False) if kind == "gemma" else \
        Gemma2Config(**ids, **TEXT, **GEMMA2, tie_word_embeddings=False)
    # (an untied head: a tied one makes these tiny models repeat the prompt's last token whatever the images)
    config = PaliGemmaConfig(text_config=text, vision_config=SiglipVisionConfig(**VISION), projection_dim=64,
                             image_token_index=processor.image_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = PaliGemmaForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith(".weight") and p.dim() == 1:
                p.uniform_(0.5, 1.5) if "vision_tower" in name else p.uniform_(-0.5, 0.5)
            elif name.endswith(("patch_embedding.bias", "projector.linear.bias")):
                p.normal_(0.0, 0.5)
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 0.1)
            elif name.endswith(("lm_head.weight", "projector.linear.weight")):
                p.normal_(0.0, p.shape[1] ** -0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_paligemma")
    return {kind: build(root / kind, kind) for kind in KINDS}


@pytest.fixture(scope="module")
def hf_models(folders) -> dict:
    from transformers import PaliGemmaForConditionalGeneration

    # eager attention: with SDPA transformers' PaliGemma (Gemma) drops the causal mask of a prompt without
    # token_type_ids and attends both ways over it; eager keeps it causal, as PaliGemma 2 (eager only) does
    return {kind: PaliGemmaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                                    attn_implementation="eager").eval()
            for kind, folder in folders.items()}


def hf_processor(folder: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder)


def hf_inputs(folder: Path, count: int = 2) -> dict:
    return hf_processor(folder)(text=[PROMPTS[count]], images=images(count), return_tensors="pt")


def ours(folder: Path, config=None):
    from specray.models.loader import load_image_encoder, load_image_processor, read_config

    config = config or read_config(str(folder))
    return load_image_encoder(str(folder), config, torch.float32, "cpu"), load_image_processor(str(folder), config)


def expanded(folder: Path, count: int = 2, bos: bool = False):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder).encode(PROMPTS[count])
    processor = ours(folder)[1]
    return expand_prompt(([processor.bos] if bos else []) + ids, images(count), processor)


def hf_logits(model, inputs, extra: list[int] = ()) -> torch.Tensor:
    """The whole model's logits over the prompt (its prefix, ``token_type_ids`` 0) and ``extra`` tokens after it
    (the suffix, 1: causal), as generate's first forward and its later steps see them."""
    ids = torch.cat([inputs["input_ids"], torch.tensor([list(extra)], dtype=torch.long)], dim=1)
    types = torch.cat([inputs["token_type_ids"], torch.ones(1, len(extra), dtype=torch.long)], dim=1)
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=inputs["pixel_values"], token_type_ids=types).logits[0]


# ---- the processor and the encoder -----------------------------------------------------------------------------------

@pytest.mark.parametrize("bos", [False, True])
@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_processor_and_encoder_equal_transformers(folders, hf_models, kind, count, bos):
    """Our finished prompt equals PaliGemmaProcessor's (with or without the tokenizer's leading <bos>; a prompt
    ending with a newline gets another), one item spans it whole, bidirectional, its rows the images' tokens; the
    pixels equal transformers' and the embeddings get_image_features'."""
    folder = folders[kind]
    theirs = hf_inputs(folder, count)
    ids, mm = expanded(folder, count, bos)
    assert ids == theirs["input_ids"][0].tolist() and theirs["token_type_ids"].sum() == 0
    (item,) = mm.items
    assert (item.offset, item.length, item.bidirectional) == (0, len(ids), True)
    assert item.embed_rows == list(range(TOKENS * count))
    assert np.array_equal(item.data["pixel_values"], theirs["pixel_values"].numpy())
    with torch.no_grad():
        want = hf_models[kind].model.get_image_features(theirs["pixel_values"]).pooler_output.flatten(0, 1)
    got = encode_items(ours(folder)[0], mm)[0]
    assert got.shape == (TOKENS * count, 64) and max_diff(got, want) < TOL


def test_prompt_hash_covers_the_text(folders):
    """The same image under another prompt is another item (its cached prefix attended to that prompt's text)."""
    from transformers import AutoTokenizer

    folder = folders["gemma"]
    tok, processor = AutoTokenizer.from_pretrained(folder), ours(folder)[1]
    hashes = {expand_prompt(tok.encode(text), images(1), processor)[1].items[0].hash
              for text in ("<image>caption en", "<image>caption es", "<image>caption en")}
    assert len(hashes) == 2


# ---- the whole model -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_with_images_equal_transformers(folders, hf_models, kind, count):
    """transformers' PaliGemmaForConditionalGeneration logits (the prompt its prefix, then EXTRA tokens causal) ==
    our text model's (Gemma / Gemma 2 through _TEXT_PARTS) with the encoder's rows in place and the prompt attending
    both ways in its one prefill chunk, then single steps."""
    from specray.models.loader import load_model

    folder = folders[kind]
    ids, mm = expanded(folder, count)
    got = image_logits(load_model(str(folder)), ids + EXTRA, mm, encode_items(ours(folder)[0], mm), [len(ids)],
                       bidirectional=True)
    assert max_diff(got, hf_logits(hf_models[kind], hf_inputs(folder, count), EXTRA)) < TOL


@pytest.mark.parametrize("kind", KINDS)
def test_text_model_alone_equals_transformers(folders, hf_models, kind):
    """The release's text model (read through _TEXT_PARTS, causal: the text config's use_bidirectional_attention
    set aside) gives transformers' whole model's logits over a text-only prompt, in two chunks."""
    from transformers import AutoTokenizer

    from specray.models.loader import load_model
    from specray.multimodal import MultiModalInputs

    ids = AutoTokenizer.from_pretrained(folders[kind]).encode("The quick brown fox jumps over the lazy dog")
    got = image_logits(load_model(str(folders[kind])), ids, MultiModalInputs([]), [], [5])
    with torch.no_grad():
        want = hf_models[kind](input_ids=torch.tensor([ids])).logits[0]
    assert max_diff(got, want) < TOL


# ---- each part shows -------------------------------------------------------------------------------------------------

def _causal(ids, mm, embeds):  # the prompt causal, as a plain LLM prompt
    return ids, mm, embeds, False


def _images_only(ids, mm, embeds):  # only the image tokens both ways (Gemma 3's way), the text causal
    item = mm.items[0]
    return ids, type(mm)([dataclasses.replace(item, length=len(item.embed_rows), embed_rows=None)]), embeds, True


def _scaled_rows(ids, mm, embeds):  # the image rows divided by sqrt(hidden), as older transformers did first
    return ids, mm, [e / 8.0 for e in embeds], True


def _rows_scaled_up(ids, mm, embeds):  # the image rows scaled by sqrt(hidden) as the tokens' embeddings are
    return ids, mm, [e * 8.0 for e in embeds], True


LOGIT_MUTATIONS = {"causal-prompt": _causal, "images-only-bidirectional": _images_only, "rows-divided": _scaled_rows,
                   "rows-scaled": _rows_scaled_up}


@pytest.mark.parametrize("mutation", sorted(LOGIT_MUTATIONS) + ["no-post-norm", "no-projector-bias"])
def test_each_part_shows_in_the_logits(folders, hf_models, mutation):
    """Each part of PaliGemma done otherwise moves the logits away from transformers' (PaliGemma 2, two images)."""
    from specray.models.loader import load_model

    folder = folders["gemma2"]
    ids, mm = expanded(folder)
    encoder = ours(folder)[0]
    if mutation == "no-post-norm":
        encoder.tower.post_layernorm = None
    elif mutation == "no-projector-bias":
        encoder.projector.linear.bias.data.zero_()
    embeds, bidirectional = encode_items(encoder, mm), True
    if mutation in LOGIT_MUTATIONS:
        ids, mm, embeds, bidirectional = LOGIT_MUTATIONS[mutation](ids, mm, embeds)
    got = image_logits(load_model(str(folder)), ids + EXTRA, mm, embeds, [len(ids)], bidirectional=bidirectional)
    assert max_diff(got, hf_logits(hf_models["gemma2"], hf_inputs(folder), EXTRA)) > MOVED


@pytest.mark.parametrize("part", ["bos", "newline", "joined-newline"])
def test_each_prompt_part_shows(folders, part, monkeypatch):
    """The <bos> after the images and the closing newline (joined with a run of newlines where the vocabulary has
    it) are each needed for PaliGemmaProcessor's prompt."""
    folder = folders["gemma"]
    processor = ours(folder)[1]
    tok = hf_processor(folder).tokenizer
    if part == "joined-newline":  # a vocabulary with "\n\n": transformers' tokenizer would give it for "...\n" + "\n"
        assert 2 not in processor.newlines
        processor.newlines[2] = 99
        processor.runs[99] = 2
        ids, _ = expand_prompt(tok.encode(PROMPTS[2]), images(2), processor)
        assert ids[-1] == 99 and ids[-2] != processor.newlines[1]
        return
    theirs = hf_inputs(folder)["input_ids"][0].tolist()
    if part == "bos":
        monkeypatch.setattr(processor, "bos", -1)
    else:
        monkeypatch.setattr(processor, "newlines", {1: tok.pad_token_id})
    ids, _ = expand_prompt(tok.encode(PROMPTS[2]), images(2), processor)
    assert ids != theirs


# ---- refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,words", [
    (dict(vision_config__model_type="clip_vision_model"), "vision_config.model_type='clip_vision_model'"),
    (dict(text_config__model_type="llama"), "text_config.model_type='llama'"),
    (dict(projection_dim=32), "projection_dim=32")])
def test_unsupported_settings_are_refused(folders, change, words):
    from specray.models.paligemma import PaliGemmaImageEncoder, PaliGemmaImageProcessor

    config = config_with(folders["gemma"], **change)
    with pytest.raises(ValueError, match=words):
        PaliGemmaImageEncoder(config)
    with pytest.raises(ValueError, match=words):
        PaliGemmaImageProcessor.from_pretrained(folders["gemma"], config)


def test_prompts_and_mismatches_are_refused(folders, tmp_path):
    """Text before or between the images, a Gemma 2 prompt longer than its sliding window, an image processor of
    another token count, and a checkpoint lacking the projector are refused by name."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from specray.models.loader import read_config
    from specray.models.paligemma import PaliGemmaImageEncoder, PaliGemmaImageProcessor

    folder = folders["gemma2"]
    tok, processor = AutoTokenizer.from_pretrained(folder), ours(folder)[1]
    with pytest.raises(ValueError, match="before its first image"):
        expand_prompt(tok.encode("caption <image>"), images(1), processor)
    with pytest.raises(ValueError, match="text between its images"):
        expand_prompt(tok.encode("<image> and <image>"), images(2), processor)
    with pytest.raises(ValueError, match="text_config.sliding_window=64"):
        expand_prompt(tok.encode("<image><image>" + " the quick brown fox" * 8), images(2), processor)
    copy = shutil.copytree(folder, tmp_path / "m")
    path = copy / "processor_config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "image_processor": {**saved["image_processor"], "image_seq_length": 64}}))
    with pytest.raises(ValueError, match="image_seq_length=64"):
        PaliGemmaImageProcessor.from_pretrained(copy, read_config(str(copy)))
    encoder = PaliGemmaImageEncoder(read_config(str(copy)))
    tensors = load_file(str(copy / "model.safetensors"))
    with pytest.raises(ValueError, match="projector.linear.bias"):
        encoder.load_weights((n, t) for n, t in tensors.items() if n != "multi_modal_projector.linear.bias")


# ---- tensor parallel and the engine ----------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(folders, tmp_path):
    """Both text models split over two tensor-parallel ranks (the encoder replicated on each) give one rank's logits
    with the images' rows in place, the prompt one chunk attending both ways, then single steps."""
    runs = []
    for kind in KINDS:
        ids, mm = expanded(folders[kind])
        runs.append((folders[kind], ids + EXTRA, mm, [len(ids)], {"bidirectional": True}))
    assert_ranks_equal_one_rank(tmp_path, runs, 1, TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_engine_greedy_with_images_equals_transformers(folders, hf_models, kind):
    """LLM.generate with two images (the prompt one step: it attends both ways; n-gram drafts) gives transformers'
    greedy generate's tokens, beside a text-only prompt in the same batch; without the images transformers generates
    other tokens. PaliGemma 2's tiny model repeats itself, so some drafts are accepted there (the shared check);
    PaliGemma's generates 48 distinct tokens, which no n-gram draft matches, so it is checked here without that."""
    from specray import LLM, SamplingParams
    from specray_test_engine_runs import assert_images_greedy_equals_transformers

    llm = LLM(model=str(folders[kind]), max_model_len=256, block_size=4, max_num_batched_tokens=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    processor, hf = hf_processor(folders[kind]), hf_models[kind]
    if kind == "gemma2":
        assert_images_greedy_equals_transformers(llm, hf, processor, PROMPTS[2], images(), max_tokens=48)
        return
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt": PROMPTS[2], "multi_modal_data": {"image": images()}}, "The quick brown fox"],
                        params, use_tqdm=False)
    inputs = hf_inputs(folders[kind])
    greedy = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    plain = llm.get_tokenizer().encode("The quick brown fox")
    with torch.no_grad():
        want = hf.generate(**inputs, **greedy)[0, inputs["input_ids"].shape[1]:].tolist()
        blind = hf.generate(inputs["input_ids"], **greedy)[0, inputs["input_ids"].shape[1]:].tolist()
        text = hf.generate(torch.tensor([plain]), **greedy)[0, len(plain):].tolist()
    assert list(outs[0].outputs[0].token_ids) == want != blind
    assert list(outs[1].outputs[0].token_ids) == text


def test_prefix_cache_keeps_prompts_with_one_image_apart(folders, hf_models):
    """With prefix caching, a prompt with the same images as an earlier one but other text reuses none of the earlier
    prompt's cached blocks (they attended to that prompt's text both ways), the same prompt again reuses them; the
    greedy tokens equal transformers' each time."""
    from specray import LLM, SamplingParams

    folder, hf = folders["gemma2"], hf_models["gemma2"]
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=64,
              enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    greedy = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    cached = []
    for animal in ("fox", "dog", "dog"):
        text = f"<image><image>answer en the {animal}"
        out = llm.generate([{"prompt": text, "multi_modal_data": {"image": images()}}], params, use_tqdm=False)[0]
        inputs = hf_processor(folder)(text=[text], images=images(), return_tensors="pt")
        with torch.no_grad():
            want = hf.generate(**inputs, **greedy)[0, inputs["input_ids"].shape[1]:].tolist()
        assert list(out.outputs[0].token_ids) == want, text
        cached.append(out.num_cached_tokens)
    assert cached[:2] == [0, 0] and cached[2] > 2 * TOKENS
