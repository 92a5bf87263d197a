"""Gemma 3's images (``Gemma3ForConditionalGeneration``: :mod:`specray.models.gemma3_images` over the SigLIP tower of
:mod:`specray.models.vision_towers` and Gemma 3's text model), against transformers on the same tiny random fp32
weights: our processor's expanded prompt and pixels equal ``Gemma3Processor``'s for two images (its newlines joined
with the prompt's as its tokenizer joins them, after a chat template's ``user\\n`` and between adjacent images); each
image's embeddings equal ``get_image_features`` (max abs diff < 1e-4); the text model's logits with those embeddings
in place of the soft tokens (``meta.input_embeds``), the soft tokens of each image seeing each other both ways (an
ancestor mask, as the runner builds it for a ``bidirectional`` item), equal transformers' whole model's with its
``token_type_ids`` for a prefill and for chunks ending at the images' edges; each distinctive part broken once moves
the embeddings or the logits; what is not implemented is refused by name; two tensor-parallel ranks equal one. The
tiny model: a 2-layer SigLIP tower of 8 x 8 patches pooled to 16 tokens, a 4-layer Gemma 3 (sliding window 8, shorter
than an image's 16 soft tokens) with a Gemma-style tokenizer whose runs of newlines are single tokens. No GPU check
here."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models.attention import build_attention_metadata
from specray.models.gemma3_images import Gemma3ImageEncoder, Gemma3ImageProcessor
from specray.models.kv_cache import allocate_kv_cache
from specray.models.loader import load_image_encoder, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import assert_ranks_equal_one_rank, config_with, random_images  # tests/image_checks.py
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the embeddings or logits at least this much (a hundred times TOL)
IMAGE_SIZE, PATCH, TOKENS = 56, 7, 16  # 8 x 8 patches, averaged over 2 x 2 windows: 16 soft tokens an image
BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
PROMPT = f"Look at {BOI} and then at {BOI}, the quick brown fox jumps over the lazy dog"
# a chat template's shape ("user\n" before the first image) and two adjacent images: newlines to join
CHAT_PROMPT = f"<start_of_turn>user\n{BOI}{BOI}Summarize the text<end_of_turn>\n<start_of_turn>model\n"
# Gemma 3's chat template, cut to what these prompts use (an image part renders <start_of_image>)
TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + ('model' if message['role'] == "
            "'assistant' else message['role']) + '\n' }}{% if message['content'] is string %}{{ message['content'] | "
            "trim }}{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}"
            "{{ '<start_of_image>' }}{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}"
            "{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}"
            "{% endif %}")
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, query_pre_attn_scalar=16, sliding_window=8, max_position_embeddings=512,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE_SIZE,
              patch_size=PATCH, layer_norm_eps=1e-6, vision_use_head=False)


def _images() -> list:
    return random_images([(40, 64), (64, 48)], legacy=True)


def build_gemma_tokenizer(path: Path):
    """conftest's sentencepiece-style Gemma tokenizer with Gemma's runs of newlines as single tokens ("\\n\\n" ..
    "\\n\\n\\n\\n", merged as BPE merges them), its image tokens (``boi_token``, ``eoi_token``, ``image_token``) and
    turn markers, and :data:`TEMPLATE`."""
    from transformers import GemmaTokenizer

    from tests.conftest import build_spm_tokenizer

    base = build_spm_tokenizer(path, "gemma")
    model = json.loads(base.backend_tokenizer.to_str())["model"]
    vocab = dict(model["vocab"])
    for n in (2, 3, 4):
        vocab["\n" * n] = len(vocab)
    merges = [("\n", "\n"), ("\n\n", "\n"), ("\n\n", "\n\n")]
    merges += [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True,
                         extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": SOFT})
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return tok


def _visible(model) -> None:
    """Norm weights away from their init (zeros for Gemma's ``1 + w``, ones for SigLIP's LayerNorms), the projection
    at unit scale (its init of zeros embeds every image as zeros), the tower's MLP inputs over the range where GELUs
    differ."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mm_input_projection_weight"):
                param.normal_(0.0, param.shape[0] ** -0.5)
            elif name.endswith("mlp.fc1.weight"):
                param.normal_(0.0, 2 * param.shape[1] ** -0.5)
            elif "norm" in name and name.endswith(".weight") and param.dim() == 1:
                param.uniform_(-0.5, 0.5) if "vision" not in name else param.uniform_(0.5, 1.5)
            elif "norm" in name and name.endswith(".bias"):
                param.normal_(0.0, 0.3)
            elif name.endswith("patch_embedding.bias"):
                param.normal_(0.0, 1.0)


def build_tiny_gemma3(path: Path, seed: int = 0) -> Path:
    """transformers' Gemma3ForConditionalGeneration of :data:`TEXT` and :data:`VISION`, saved with
    :func:`build_gemma_tokenizer`'s tokenizer and ``Gemma3Processor`` (its image processor resizing to 56 x 56)."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor,
                              Gemma3TextConfig, SiglipVisionConfig)

    path.mkdir(parents=True, exist_ok=True)
    tok = build_gemma_tokenizer(path)
    text = Gemma3TextConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                            bos_token_id=tok.bos_token_id, **TEXT)
    config = Gemma3Config(text_config=text, vision_config=SiglipVisionConfig(**VISION), mm_tokens_per_image=TOKENS,
                          boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
                          image_token_index=tok.image_token_id)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).float().eval()
    _visible(model)
    model.save_pretrained(path)
    images = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=TOKENS,
                    chat_template=TEMPLATE).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3_images"))


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def _hf_inputs(folder: Path, text: str = PROMPT) -> dict:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder)(text=text, images=_images(), return_tensors="pt")


def _processor(folder: Path) -> Gemma3ImageProcessor:
    return Gemma3ImageProcessor.from_pretrained(folder, read_config(str(folder)))


def _expanded(folder: Path, text: str = PROMPT):
    """Our prompt ids and items of ``text`` with its two images: expanded, its newlines joined and the items
    narrowed to the soft tokens (the processor's ``finish_prompt``)."""
    from transformers import AutoTokenizer

    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text), _images(), _processor(folder))


# ---- the processor -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [PROMPT, CHAT_PROMPT], ids=["plain", "chat-adjacent"])
def test_processor_matches_transformers(folder, text):
    """Two images of different sizes: our expanded prompt equals Gemma3Processor's (each image "\\n\\n", <boi>, 16
    soft tokens, <eoi>, "\\n\\n", the newlines joined with the prompt's: "user\\n" + "\\n\\n" and the two adjacent
    images' "\\n\\n" + "\\n\\n" become one token each), each item's span is exactly its image's soft tokens (those
    transformers' token_type_ids mark, attending both ways), its pixels equal transformers' pixel_values."""
    want = _hf_inputs(folder, text)
    ids, mm = _expanded(folder, text)
    assert ids == want["input_ids"][0].tolist()
    types = want["token_type_ids"][0].tolist()
    assert [i for i, t in enumerate(types) if t] == [p for item in mm.items for p in range(item.offset, item.end)]
    config = read_config(str(folder))
    for i, item in enumerate(mm.items):
        assert item.length == TOKENS and item.embed_rows is None and item.bidirectional
        assert (ids[item.offset - 1], ids[item.end]) == (config.boi_token_index, config.eoi_token_index)
        assert np.array_equal(item.data["pixel_values"], want["pixel_values"][i].numpy())
    assert mm.items[0].hash != mm.items[1].hash and mm.rope_positions is None


def test_expansion_before_finishing(folder):
    """What ``process`` gives: each placeholder becomes the 20 tokens of its image's text, the soft rows taking
    embeddings and attending both ways; for PROMPT (no newline beside a placeholder) the seam's expansion is
    transformers' prompt with or without the hook, for CHAT_PROMPT the hook joins two pairs of newlines; finishing a
    finished prompt changes nothing."""
    from transformers import AutoTokenizer

    processor, tok = _processor(folder), AutoTokenizer.from_pretrained(folder)
    assert processor.image_token_id == tok.boi_token_id
    done = processor.process(_images()[0])
    assert tok.convert_ids_to_tokens(done.replacement) == ["\n\n", BOI] + [SOFT] * TOKENS + [EOI, "\n\n"]
    assert done.embed_rows == list(range(2, 2 + TOKENS)) and done.bidirectional
    ids, _ = expand_prompt(tok.encode(PROMPT), _images(), processor)
    assert ids == _hf_inputs(folder)["input_ids"][0].tolist()
    chat, _ = expand_prompt(tok.encode(CHAT_PROMPT), _images(), processor)
    assert len(chat) == len(_hf_inputs(folder, CHAT_PROMPT)["input_ids"][0])
    ids, mm = _expanded(folder, CHAT_PROMPT)
    assert processor.finish_prompt(ids, mm.items) == (ids, mm.items)


def test_expand_prompt_joins_newlines(folder):
    """The seam's expansion of a chat prompt (through the hook) is transformers' prompt."""
    from transformers import AutoTokenizer

    ids, _ = expand_prompt(AutoTokenizer.from_pretrained(folder).encode(CHAT_PROMPT), _images(), _processor(folder))
    assert ids == _hf_inputs(folder, CHAT_PROMPT)["input_ids"][0].tolist()


# ---- the encoder -----------------------------------------------------------------------------------------------------

def _hf_features(hf, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(hf.model.get_image_features(inputs["pixel_values"]).pooler_output)


def _encode(encoder, pixel_values: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return [encoder.encode({"pixel_values": p}) for p in pixel_values]


def _relayout(folder: Path, into: Path, layout: str) -> Path:
    """``folder``'s checkpoint with its vision tensors renamed: "release" (google's: ``vision_tower.vision_model.``)
    or "modules" (transformers' modules': ``model.vision_tower.``, ``model.multi_modal_projector.``)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, into)
    tensors = load_file(str(into / "model.safetensors"))
    renamed = {}
    for name, tensor in tensors.items():
        if name.startswith("vision_tower."):
            name = ("vision_tower.vision_model." + name[len("vision_tower."):] if layout == "release"
                    else "model." + name)
        elif name.startswith("multi_modal_projector.") and layout == "modules":
            name = "model." + name
        renamed[name] = tensor
    save_file(renamed, str(into / "model.safetensors"), metadata={"format": "pt"})
    return into


@pytest.mark.parametrize("layout", ["saved", "release", "modules"])
def test_encoder_matches_transformers(folder, hf, tmp_path, layout):
    """Each image's embeddings equal transformers' ``get_image_features`` (fp32), read from each layout."""
    source = folder if layout == "saved" else _relayout(folder, tmp_path / layout, layout)
    encoder = load_image_encoder(str(source), read_config(str(source)), torch.float32, "cpu")
    assert isinstance(encoder, Gemma3ImageEncoder) and encoder.deepstack_layers == 0
    inputs = _hf_inputs(folder)
    got, want = _encode(encoder, inputs["pixel_values"]), _hf_features(hf, inputs)
    assert [g.shape for g in got] == [w.shape for w in want] == [(TOKENS, 64)] * 2
    assert max(max_diff(g, w) for g, w in zip(got, want)) < TOL


def test_encoder_in_bfloat16(folder, hf):
    """Built under bfloat16 (as the engine builds it for a bf16 model), the encoder computes in bf16 and lands within
    bf16's rounding of transformers' fp32 embeddings."""
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.bfloat16, "cpu")
    inputs = _hf_inputs(folder)
    got = _encode(encoder, inputs["pixel_values"].to(torch.bfloat16))
    want = _hf_features(hf, inputs)
    assert all(g.dtype == torch.bfloat16 for g in got)
    assert max(max_diff(g.float(), w) / w.abs().max().item() for g, w in zip(got, want)) < 3e-2


# ---- the whole model -------------------------------------------------------------------------------------------------

def _ancestors(items, start: int, n: int, widen: int = 0) -> torch.Tensor | None:
    """[n, n] bool among the chunk ``[start, start + n)``'s tokens: causal, and each image's soft tokens (its span,
    ``widen`` more each side: a mutation) seeing each other; None where no image lies in the chunk."""
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    touched = False
    for item in items:
        a, b = max(item.offset - widen, start) - start, min(item.end + widen, start + n) - start
        if a < b:
            assert item.offset - widen >= start and item.end + widen <= start + n, "a chunk splits an image"
            mask[a:b, a:b] = True
            touched = True
    return mask if touched else None


@torch.no_grad()
def logits_with_images(model, ids: list[int], mm, embeds: list[torch.Tensor], sizes: list[int],
                       bidirectional: bool = True, widen: int = 0, seed: int = 0) -> torch.Tensor:
    """``model``'s logits [L, V] of ``ids`` run in chunks of ``sizes`` over a paged cache of shuffled 4-token blocks,
    each chunk's image rows handed in as ``meta.input_embeds`` and (``bidirectional``) each image's soft tokens seeing
    each other through the chunk's ancestor mask, as the runner does for a bidirectional item."""
    allocate_kv_cache(model, 64, 4)
    table = random.Random(seed).sample(range(64), -(-len(ids) // 4))
    rows = {item.offset + i: embeds[k][i] for k, item in enumerate(mm.items) for i in range(item.length)}
    out, start = [], 0
    for n in sizes:
        anc = _ancestors(mm.items, start, n, widen) if bidirectional else None
        meta = build_attention_metadata([n], [start], [table], 4, model.device, ancestors=[anc])
        mine = [p for p in range(start, start + n) if p in rows]
        if mine:
            meta.input_embeds = (torch.tensor([p - start for p in mine]), torch.stack([rows[p] for p in mine]))
        out.append(model.compute_logits(model(torch.tensor(ids[start:start + n]), meta)))
        start += n
    assert start == len(ids)
    return torch.cat(out)


def _schedules(mm, length: int) -> dict[str, list[int]]:
    # prefill; chunks ending right before the first image's soft tokens, 3 past its end, right after the second's
    # end, then single steps for the last 4 prompt tokens
    first, second = mm.items
    cuts = [first.offset, first.end + 3, second.end, length - 4]
    return {"prefill": [length], "chunked+decode": [b - a for a, b in zip([0] + cuts, cuts)] + [1] * 4}


def _embeds(encoder, mm) -> list[torch.Tensor]:
    with torch.no_grad():
        return [encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()}) for item in mm.items]


@pytest.fixture(scope="module")
def ours(folder):
    """Our text model (through ``_TEXT_PARTS``), PROMPT's ids and items and its images' embeddings."""
    ids, mm = _expanded(folder)
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    return load_model(str(folder)), ids, mm, _embeds(encoder, mm)


@pytest.fixture(scope="module")
def reference(folder, hf) -> torch.Tensor:
    with torch.no_grad():
        return hf(**_hf_inputs(folder)).logits[0]


@pytest.mark.parametrize("schedule", ["prefill", "chunked+decode"])
def test_logits_with_images_match_transformers(ours, reference, schedule):
    """transformers' ``Gemma3ForConditionalGeneration(input_ids, pixel_values, token_type_ids)`` logits == our text
    model's with the encoder's embeddings in the soft tokens' rows and each image's soft tokens seeing each other, in
    one prefill and in chunks ending at the images' edges (then single steps)."""
    model, ids, mm, embeds = ours
    got = logits_with_images(model, ids, mm, embeds, _schedules(mm, len(ids))[schedule])
    assert max_diff(got, reference) < TOL


@pytest.mark.parametrize("part", ["causal-images", "boi-eoi-bidirectional", "scaled-image-rows", "no-image-rows"])
def test_each_part_shows_in_the_logits(ours, reference, part):
    """Images attended causally (no bidirectional block), the block widened over <boi> / <eoi>, the image rows scaled
    by sqrt(hidden) as the tokens' embeddings are, or the placeholders' own embeddings: the logits move."""
    model, ids, mm, embeds = ours
    hidden = model.model.embed_scale
    kwargs = {"causal-images": dict(bidirectional=False), "boi-eoi-bidirectional": dict(widen=1),
              "scaled-image-rows": dict(embeds=[e * hidden for e in embeds]),
              "no-image-rows": dict(mm=type(mm)([]))}[part]
    args = {"mm": mm, "embeds": embeds, **kwargs}
    got = logits_with_images(model, ids, args.pop("mm"), args.pop("embeds"), [len(ids)], **args)
    assert max_diff(got, reference) > MOVED


def _no_post_norm(encoder) -> None:
    encoder.tower.post_layernorm = torch.nn.Identity()


def _plain_norm_weight(encoder) -> None:  # x * w instead of Gemma's x * (1 + w)
    encoder.projector.mm_soft_emb_norm.weight.data -= 1.0


def _no_soft_emb_norm(encoder) -> None:
    encoder.projector.mm_soft_emb_norm = torch.nn.Identity()


def _column_major_pooling(encoder) -> None:
    project = encoder.project

    def transposed(states):
        b, n, d = states.shape
        side = encoder.patches
        return project(states.view(b, side, side, d).transpose(1, 2).reshape(b, n, d))
    encoder.project = transposed


def _max_pooling(encoder) -> None:
    encoder.project = lambda states: encoder.projector.mm_soft_emb_norm(torch.nn.functional.max_pool2d(
        states.transpose(1, 2).reshape(states.shape[0], -1, encoder.patches, encoder.patches), encoder.window)
        .flatten(2).transpose(1, 2)) @ encoder.projector.mm_input_projection_weight


def _no_positions(encoder) -> None:
    encoder.tower.embeddings.position_embedding.weight.data.zero_()


MUTATIONS = {"no-post-layernorm": _no_post_norm, "plain-norm-weight": _plain_norm_weight,
             "no-soft-emb-norm": _no_soft_emb_norm, "column-major-pooling": _column_major_pooling,
             "max-pooling": _max_pooling, "no-positions": _no_positions}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_embeddings(folder, hf, mutation):
    """Each distinctive part of the encoder switched off (or done the other way) moves the embeddings."""
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    MUTATIONS[mutation](encoder)
    inputs = _hf_inputs(folder)
    got, want = _encode(encoder, inputs["pixel_values"]), _hf_features(hf, inputs)
    assert max(max_diff(g, w) for g, w in zip(got, want)) > MOVED


# ---- refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,words", [
    (dict(vision_config__model_type="clip_vision_model"), "vision_config.model_type='clip_vision_model'"),
    (dict(mm_tokens_per_image=15), "mm_tokens_per_image=15"),
    (dict(mm_tokens_per_image=9), "mm_tokens_per_image=9")])
def test_unsupported_settings_are_refused(folder, change, words):
    with pytest.raises(ValueError) as err:
        Gemma3ImageEncoder(config_with(folder, **change))
    assert words in str(err.value)


def test_mismatches_are_refused(folder, tmp_path):
    """Pan-and-scan turned on, a processor_config.json whose image_seq_length differs from mm_tokens_per_image, and a
    checkpoint missing a tensor of the tower or the projector are refused by name."""
    copy = shutil.copytree(folder, tmp_path / "m")
    saved = json.loads((copy / "processor_config.json").read_text())
    saved["image_processor"]["do_pan_and_scan"] = True
    (copy / "processor_config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="do_pan_and_scan=True"):
        _processor(copy)
    saved["image_processor"]["do_pan_and_scan"] = False
    (copy / "processor_config.json").write_text(json.dumps({**saved, "image_seq_length": 64}))
    with pytest.raises(ValueError, match="image_seq_length=64"):
        _processor(copy)
    from safetensors.torch import load_file

    encoder = Gemma3ImageEncoder(read_config(str(folder)))
    tensors = load_file(str(folder / "model.safetensors"))
    for gone in ("vision_tower.post_layernorm.weight", "multi_modal_projector.mm_soft_emb_norm.weight"):
        with pytest.raises(ValueError, match=gone.split(".", 1)[1]):
            encoder.load_weights((n, t) for n, t in tensors.items() if n != gone)


# ---- tensor parallel -------------------------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(folder, tmp_path):
    """The text model split over two tensor-parallel ranks (the encoder replicated on each) gives one rank's logits
    with the images' rows in place and their soft tokens seeing each other: PROMPT's, in chunks at the images' edges
    then single steps."""
    ids, mm = _expanded(folder)
    runs = [(folder, ids, mm, _schedules(mm, len(ids))["chunked+decode"], {"bidirectional": True})]
    assert_ranks_equal_one_rank(tmp_path, runs, 1, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
GREEDY = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)


def test_engine_greedy_with_images_equals_transformers(folder, hf):
    """``LLM.generate`` with two images (steps of at most 24 tokens, so the prefill stops before each image and takes
    it whole; n-gram drafts) gives transformers' greedy ``generate`` tokens, beside a text-only prompt in the same
    batch; some drafts are accepted; transformers without the images generates other tokens."""
    from transformers import AutoProcessor

    from specray import LLM

    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=24,
              speculative_config=NGRAM)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf, AutoProcessor.from_pretrained(folder), PROMPT, _images())


def test_engine_chat_with_an_image_equals_transformers(folder, hf):
    """``LLM.chat`` with an image_url part (Gemma 3's template renders <start_of_image> after "user\\n") gives
    transformers' greedy tokens for the same conversation through its processor."""
    import base64
    import io

    from transformers import AutoProcessor

    from specray import LLM, SamplingParams

    buffer = io.BytesIO()
    _images()[0].save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=24)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Summarize the text"}]}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    processor = AutoProcessor.from_pretrained(folder)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text":
                                           "Summarize the text"}]}], add_generation_prompt=True, tokenize=False)
    from PIL import Image

    inputs = processor(text=text, images=[Image.open(buffer).convert("RGB")], return_tensors="pt",
                       add_special_tokens=False)
    with torch.no_grad():
        want = hf.generate(**inputs, **{**GREEDY, "max_new_tokens": 8, "min_new_tokens": 8})
    assert list(out[0].outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist()
