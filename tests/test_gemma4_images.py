"""Gemma 4's images (``Gemma4ForConditionalGeneration``: :mod:`specray.models.gemma4_images` and Gemma 4's text model,
:mod:`specray.models.gemma4`), against transformers on the same tiny random fp32 weights: our processor's expanded
prompt and patches equal ``Gemma4Processor``'s for two images of different shapes (different soft-token counts); each
image's embeddings equal ``get_image_features`` (max abs diff < 1e-4); the text model's logits with those embeddings in
the soft tokens' rows (``meta.input_embeds``), each image's soft tokens seeing each other both ways in the sliding
layers only (``use_bidirectional_attention="vision"``; the full layers stay causal) and the per-layer inputs reading
the pad token on those rows, equal transformers' whole model's with its ``mm_token_type_ids``, for a prefill and for
chunks ending at the images' edges; each distinctive part broken once moves the embeddings or the logits; what is not
implemented is refused by name; two tensor-parallel ranks equal one; the engine's greedy output with n-gram drafts
equals transformers' ``generate``, and so does ``LLM.chat`` with an image part (a minimal template). A second model
without ``use_bidirectional_attention`` (images causal, experts on) matches over chunks splitting an image.

The tiny model: a 2-layer vision model (patches of 4 pixels, 2 x 2 pooling, clipped linears, standardized output), a
4-layer Gemma 4 (sliding window 8, shorter than an image's ~60 soft tokens; k = v full layers; the last two layers
reading the first two's K/V; per-layer inputs), a Gemma-style tokenizer with Gemma 4's image tokens.
``Gemma4Processor`` is built without its video processor (which needs torchvision, not installed here). No GPU check
here."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models.gemma4_images import Gemma4ImageEncoder, Gemma4ImageProcessor
from specray.models.loader import load_image_encoder, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import assert_ranks_equal_one_rank, config_with, random_images  # tests/image_checks.py
from specray_test_model_checks import max_diff  # tests/model_checks.py
from tests.test_gemma3_images import logits_with_images

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the embeddings or logits at least this much (a hundred times TOL)
SLIDING, FULL = "sliding_attention", "full_attention"
IMAGE, BOI, EOI = "<|image|>", "<|image>", "<image|>"
SPECIALS = {"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE, "boa_token": "<|audio>", "eoa_token": "<audio|>",
            "audio_token": "<|audio|>"}
PROMPT = f"Look at {IMAGE} and then at {IMAGE}, the quick brown fox jumps over the lazy dog"
TEXT = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
            layer_types=[SLIDING, FULL, SLIDING, FULL], sliding_window=8, num_kv_shared_layers=2,
            hidden_size_per_layer_input=8, final_logit_softcapping=30.0, max_position_embeddings=1024,
            rms_norm_eps=1e-5, use_bidirectional_attention="vision",
            rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                             FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 10000.0}})
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=64, use_clipped_linears=True,
              standardize=True, rms_norm_eps=1e-6)
IMAGES = dict(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
# a minimal chat template of Gemma's turn shape that renders an image part as the placeholder Gemma4Processor expands
# (not the release's template, which was not available offline)
TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + ('model' if message['role'] == "
            "'assistant' else message['role']) + '\n' }}{% if message['content'] is string %}{{ message['content'] | "
            "trim }}{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}"
            "{{ '<|image|>' }}{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}"
            "{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}"
            "{% endif %}")


def _images() -> list:
    return random_images([(40, 64), (64, 48)], legacy=True)


def _tokenizer(path: Path):
    """conftest's Gemma-style tokenizer with Gemma 4's image (and audio) tokens."""
    from transformers import GemmaTokenizer

    from tests.conftest import build_spm_tokenizer

    base = build_spm_tokenizer(path, "gemma")
    model = json.loads(base.backend_tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = GemmaTokenizer(vocab=model["vocab"], merges=merges, add_bos_token=True, extra_special_tokens=SPECIALS)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return tok


def _visible(model) -> None:
    """Norms, positions and the standardization away from their inits, the clipping bounds where they bite, the
    embedding doubled (greedy decoding then loops now and then, so n-gram drafts are accepted)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith(".weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("position_embedding_table"):
                param.normal_(0.0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar") or name.endswith("std_scale"):
                buffer.uniform_(0.5, 1.5)
            elif name.endswith("std_bias"):
                buffer.normal_(0.0, 1.0)
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(1.0)
            elif name.endswith(("input_min", "output_min")):
                buffer.fill_(-1.0)
        model.get_input_embeddings().weight.mul_(2.0)


@contextlib.contextmanager
def _without_video_processor():
    """transformers' Gemma4Processor accepting ``video_processor=None`` (its video processor needs torchvision)."""
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def lenient(self, name, arg):
        return None if name == "video_processor" and arg is None else check(self, name, arg)
    ProcessorMixin.check_argument_for_proper_class = lenient
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def hf_processor(folder: Path):
    from transformers import AutoImageProcessor, AutoTokenizer, Gemma4AudioFeatureExtractor, Gemma4Processor

    with _without_video_processor():
        return Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(), video_processor=None,
                               image_processor=AutoImageProcessor.from_pretrained(folder),
                               tokenizer=AutoTokenizer.from_pretrained(folder), image_seq_length=70)


def build_tiny_gemma4(path: Path, seed: int = 0, **text) -> Path:
    """transformers' Gemma4ForConditionalGeneration of :data:`TEXT` and :data:`VISION` (no audio), saved with
    :func:`_tokenizer`'s tokenizer and a processor_config.json holding Gemma 4's image processor (:data:`IMAGES`)."""
    from transformers import (Gemma4Config, Gemma4ForConditionalGeneration, Gemma4ImageProcessorPil, Gemma4TextConfig,
                              Gemma4VisionConfig)

    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(path)
    text_config = Gemma4TextConfig(vocab_size=len(tok), vocab_size_per_layer_input=len(tok),
                                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                   bos_token_id=tok.bos_token_id, **{**TEXT, **text})
    config = Gemma4Config(text_config=text_config, vision_config=Gemma4VisionConfig(**VISION), audio_config=None,
                          boi_token_id=tok.boi_token_id, eoi_token_id=tok.eoi_token_id,
                          image_token_id=tok.image_token_id, audio_token_id=tok.audio_token_id)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).float().eval()
    _visible(model)
    model.save_pretrained(path)
    images = Gemma4ImageProcessorPil(**IMAGES).to_dict()
    (path / "processor_config.json").write_text(json.dumps({"image_processor": images, "image_seq_length": 70,
                                                            "processor_class": "Gemma4Processor"}))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny_gemma4(tmp_path_factory.mktemp("tiny_gemma4_images"))


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def _hf_inputs(folder: Path, text: str = PROMPT) -> dict:
    return hf_processor(folder)(text=[text], images=_images(), return_tensors="pt")


def _processor(folder: Path, config=None) -> Gemma4ImageProcessor:
    return Gemma4ImageProcessor.from_pretrained(folder, config or read_config(str(folder)))


def _expanded(folder: Path, text: str = PROMPT):
    from transformers import AutoTokenizer

    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text), _images(), _processor(folder))


# ---- the processor -------------------------------------------------------------------------------------------------

def test_processor_matches_transformers(folder):
    """Two images of different shapes: our expanded prompt equals Gemma4Processor's (boi, 60 and 63 soft tokens, eoi),
    each item's span is exactly its soft tokens (what mm_token_type_ids marks), attending both ways; its patches and
    positions are transformers' without the padding (zeros at positions (-1, -1))."""
    want = _hf_inputs(folder)
    ids, mm = _expanded(folder)
    assert ids == want["input_ids"][0].tolist()
    types = want["mm_token_type_ids"][0].tolist()
    assert [i for i, t in enumerate(types) if t] == [p for item in mm.items for p in range(item.offset, item.end)]
    config = read_config(str(folder))
    assert [item.length for item in mm.items] == [60, 63]
    for i, item in enumerate(mm.items):
        assert item.embed_rows is None and item.bidirectional
        assert (ids[item.offset - 1], ids[item.end]) == (config.boi_token_id, config.eoi_token_id)
        pixels, positions = want["pixel_values"][i].numpy(), want["image_position_ids"][i].numpy()
        n = item.data["pixel_values"].shape[0]
        assert n == 4 * item.length and (positions[n:] == -1).all() and not pixels[n:].any()
        assert np.array_equal(item.data["pixel_values"], pixels[:n])
        assert np.array_equal(item.data["image_position_ids"], positions[:n])
    assert mm.items[0].hash != mm.items[1].hash and mm.rope_positions is None


def test_process_and_finish(folder):
    """``process`` gives boi, the soft tokens (taking embeddings) and eoi; ``finish_prompt`` narrows the items to the
    soft tokens and changes nothing more when run again; without ``use_bidirectional_attention`` "vision" the images
    are causal."""
    processor = _processor(folder)
    config = read_config(str(folder))
    done = processor.process(_images()[0])
    assert done.replacement == [config.boi_token_id] + [config.image_token_id] * 60 + [config.eoi_token_id]
    assert done.embed_rows == list(range(1, 61)) and done.bidirectional
    ids, mm = _expanded(folder)
    assert processor.finish_prompt(ids, mm.items) == (ids, mm.items)
    config.text_config.use_bidirectional_attention = None
    assert not _processor(folder, config).process(_images()[0]).bidirectional


# ---- the encoder -----------------------------------------------------------------------------------------------------

def _hf_features(hf, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(hf.model.get_image_features(inputs["pixel_values"], inputs["image_position_ids"]).pooler_output)


def _embeds(encoder, mm) -> list[torch.Tensor]:
    with torch.no_grad():
        return [encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()}) for item in mm.items]


def _encoder(folder: Path, dtype=torch.float32) -> Gemma4ImageEncoder:
    return load_image_encoder(str(folder), read_config(str(folder)), dtype, "cpu")


def test_encoder_matches_transformers(folder, hf):
    """Each image's embeddings equal transformers' ``get_image_features`` (fp32; padding dropped here, masked there)."""
    encoder = _encoder(folder)
    assert isinstance(encoder, Gemma4ImageEncoder) and encoder.deepstack_layers == 0
    _, mm = _expanded(folder)
    got, want = _embeds(encoder, mm), _hf_features(hf, _hf_inputs(folder))
    assert [g.shape for g in got] == [w.shape for w in want] == [(60, 64), (63, 64)]
    assert max(max_diff(g, w) for g, w in zip(got, want)) < TOL


def test_encoder_in_bfloat16(folder, hf):
    """Built under bfloat16, the encoder computes in bf16 and lands within bf16's rounding of transformers' fp32."""
    encoder = _encoder(folder, torch.bfloat16)
    _, mm = _expanded(folder)
    with torch.no_grad():
        got = [encoder.encode({k: torch.from_numpy(v).to(torch.bfloat16 if v.dtype == np.float32 else None)
                               for k, v in item.data.items()}) for item in mm.items]
    want = _hf_features(hf, _hf_inputs(folder))
    assert all(g.dtype == torch.bfloat16 for g in got)
    assert max(max_diff(g.float(), w) / w.abs().max().item() for g, w in zip(got, want)) < 3e-2


def _no_clipping(encoder) -> None:
    for module in encoder.modules():
        if hasattr(module, "clipped"):
            module.clipped = False


def _no_standardize(encoder) -> None:
    encoder.standardize = False


def _no_root_scale(encoder) -> None:
    encoder.root_size = 1.0


def _no_positions(encoder) -> None:
    encoder.tower.patch_embedder.position_embedding_table.data.zero_()


def _swapped_positions(encoder) -> None:  # rows' table for columns and the other way round
    table = encoder.tower.patch_embedder.position_embedding_table.data
    table.copy_(table.flip(0))


def _no_rope(encoder) -> None:
    encoder.theta = float("inf")


def _rope_axes_swapped(encoder) -> None:
    rope = encoder.rope
    encoder.rope = lambda positions, dtype: rope(positions.flip(-1), dtype)


def _column_major_pooling(encoder) -> None:
    pool = encoder.pool
    encoder.pool = lambda x, positions: pool(x, positions.flip(-1))


def _no_pixel_rescale(encoder) -> None:  # pixels kept in [0, 1]
    encode = encoder.encode
    encoder.encode = lambda data: encode({**data, "pixel_values": data["pixel_values"] / 2 + 0.5})


def _no_v_norm(encoder) -> None:
    for layer in encoder.tower.encoder.layers:
        layer.self_attn.v_norm = torch.nn.Identity()


def _no_pre_projection_norm(encoder) -> None:
    encoder.embedder.embedding_pre_projection_norm = torch.nn.Identity()


MUTATIONS = {"no-clipping": _no_clipping, "no-standardize": _no_standardize, "no-root-scale": _no_root_scale,
             "no-positions": _no_positions, "swapped-position-tables": _swapped_positions, "no-rope": _no_rope,
             "rope-axes-swapped": _rope_axes_swapped, "column-major-pooling": _column_major_pooling,
             "no-pixel-rescale": _no_pixel_rescale, "no-v-norm": _no_v_norm,
             "no-pre-projection-norm": _no_pre_projection_norm}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_embeddings(folder, hf, mutation):
    """Each distinctive part of the encoder switched off (or done the other way) moves the embeddings."""
    encoder = _encoder(folder)
    MUTATIONS[mutation](encoder)
    _, mm = _expanded(folder)
    got, want = _embeds(encoder, mm), _hf_features(hf, _hf_inputs(folder))
    assert max(max_diff(g, w) for g, w in zip(got, want)) > MOVED


# ---- the whole model -------------------------------------------------------------------------------------------------

def _schedules(mm, length: int) -> dict[str, list[int]]:
    # prefill; chunks ending right before the first image's soft tokens, 3 past its end, right after the second's
    # end, then single steps for the last 4 prompt tokens
    first, second = mm.items
    cuts = [first.offset, first.end + 3, second.end, length - 4]
    return {"prefill": [length], "chunked+decode": [b - a for a, b in zip([0] + cuts, cuts)] + [1] * 4}


@pytest.fixture(scope="module")
def ours(folder):
    """Our text model (through ``_TEXT_PARTS``), PROMPT's ids and items and its images' embeddings."""
    ids, mm = _expanded(folder)
    return load_model(str(folder)), ids, mm, _embeds(_encoder(folder), mm)


@pytest.fixture(scope="module")
def reference(folder, hf) -> torch.Tensor:
    with torch.no_grad():
        return hf(**_hf_inputs(folder)).logits[0]


@pytest.mark.parametrize("schedule", ["prefill", "chunked+decode"])
def test_logits_with_images_match_transformers(ours, reference, schedule):
    """transformers' ``Gemma4ForConditionalGeneration(input_ids, pixel_values, image_position_ids, mm_token_type_ids)``
    logits == our text model's with the encoder's embeddings in the soft tokens' rows, each image's soft tokens seeing
    each other in the sliding layers, in one prefill and in chunks ending at the images' edges (then single steps)."""
    model, ids, mm, embeds = ours
    got = logits_with_images(model, ids, mm, embeds, _schedules(mm, len(ids))[schedule])
    assert max_diff(got, reference) < TOL


@pytest.fixture
def full_layers_bidirectional(ours, monkeypatch):
    """Our full layers letting the image block see itself both ways too (Gemma 3's way)."""
    from specray.models.kv_cache import CAUSAL, CAUSAL_KEYS

    full = [layer.self_attn.attn for layer in ours[0].model.layers if layer.self_attn.attn.mask_kind == CAUSAL_KEYS]
    assert full
    for attn in full:
        monkeypatch.setattr(attn, "mask_kind", CAUSAL)


@pytest.fixture
def image_ids_per_layer(ours, monkeypatch):
    """The per-layer inputs reading the placeholder's own per-layer embedding, not the pad token's."""
    model = ours[0]
    monkeypatch.setattr(model.model, "text_ids", lambda input_ids, meta: input_ids)


@pytest.mark.parametrize("part", ["causal-images", "full-layers-bidirectional", "boi-eoi-bidirectional",
                                  "scaled-image-rows", "image-ids-per-layer", "no-image-rows"])
def test_each_part_shows_in_the_logits(ours, reference, request, part):
    """Images attended causally, the full layers letting them see each other both ways, the block widened over boi /
    eoi, the image rows scaled by sqrt(hidden) as the tokens' embeddings are, the per-layer inputs reading the
    placeholder's own id, or the placeholders' own embeddings: the logits move."""
    model, ids, mm, embeds = ours
    if part in ("full-layers-bidirectional", "image-ids-per-layer"):
        request.getfixturevalue(part.replace("-", "_"))
    kwargs = {"causal-images": dict(bidirectional=False), "boi-eoi-bidirectional": dict(widen=1),
              "scaled-image-rows": dict(embeds=[e * model.model.embed_scale for e in embeds]),
              "no-image-rows": dict(mm=type(mm)([]))}.get(part, {})
    args = {"mm": mm, "embeds": embeds, **kwargs}
    got = logits_with_images(model, ids, args.pop("mm"), args.pop("embeds"), [len(ids)], **args)
    assert max_diff(got, reference) > MOVED


def test_causal_images_with_experts_match_transformers(tmp_path):
    """A release without ``use_bidirectional_attention`` (images attended causally, as transformers' smaller Gemma 4
    models do), with the experts beside each MLP and no KV sharing: the items are not bidirectional, and the logits
    over chunks splitting the first image equal transformers'."""
    from transformers import Gemma4ForConditionalGeneration

    folder = build_tiny_gemma4(tmp_path / "causal", seed=1, use_bidirectional_attention=None, enable_moe_block=True,
                               num_experts=4, top_k_experts=2, moe_intermediate_size=32, num_kv_shared_layers=0)
    ids, mm = _expanded(folder)
    assert not any(item.bidirectional for item in mm.items)
    hf = Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(**_hf_inputs(folder)).logits[0]
    first = mm.items[0]
    cut = first.offset + first.length // 2  # inside the first image
    sizes = [cut, len(ids) - cut - 4, 1, 1, 1, 1]
    got = logits_with_images(load_model(str(folder)), ids, mm, _embeds(_encoder(folder), mm), sizes,
                             bidirectional=False)
    assert max_diff(got, want) < TOL


# ---- refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,words", [
    (dict(vision_config__model_type="siglip_vision_model"), "vision_config.model_type='siglip_vision_model'"),
    (dict(vision_config__hidden_activation="gelu"), "vision_config.hidden_activation='gelu'"),
    (dict(vision_config__rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
     "rope_parameters.rope_type='default'")])
def test_unsupported_settings_are_refused(folder, change, words):
    with pytest.raises(ValueError) as err:
        Gemma4ImageEncoder(config_with(folder, **change))
    assert words in str(err.value)


def test_mismatches_are_refused(folder, tmp_path):
    """An image processor whose pooling differs from the vision config's, per-layer inputs without a pad token, a
    prompt holding an audio placeholder, and a checkpoint missing one of the encoder's tensors are refused by name."""
    from safetensors.torch import load_file

    copy = shutil.copytree(folder, tmp_path / "m")
    saved = json.loads((copy / "processor_config.json").read_text())
    saved["image_processor"]["pooling_kernel_size"] = 3
    (copy / "processor_config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="pooling_kernel_size=3"):
        _processor(copy)
    with pytest.raises(ValueError, match="pad_token_id=None"):
        _processor(folder, config_with(folder, text_config__pad_token_id=None))
    config = read_config(str(folder))
    ids, mm = _expanded(folder)
    with pytest.raises(ValueError, match=f"audio_token_id={config.audio_token_id}"):
        _processor(folder).finish_prompt(ids + [config.audio_token_id], mm.items)
    encoder = Gemma4ImageEncoder(config)
    tensors = load_file(str(folder / "model.safetensors"))
    for gone in ("model.vision_tower.encoder.layers.1.self_attn.q_proj.output_max",
                 "model.embed_vision.embedding_projection.weight"):
        with pytest.raises(ValueError, match=gone[len("model."):]):
            encoder.load_weights((n, t) for n, t in tensors.items() if n != gone)


# ---- tensor parallel -------------------------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(folder, tmp_path):
    """The text model split over two tensor-parallel ranks (the encoder replicated on each) gives one rank's logits
    with the images' rows in place and their soft tokens seeing each other (Gemma 3's check: items are the soft
    tokens alone here too)."""
    ids, mm = _expanded(folder)
    runs = [(folder, ids, mm, _schedules(mm, len(ids))["chunked+decode"], {"bidirectional": True})]
    assert_ranks_equal_one_rank(tmp_path, runs, 1, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def test_engine_greedy_with_images_equals_transformers(folder, hf):
    """``LLM.generate`` with two images (steps of at most 80 tokens, so the prefill stops before each image and takes
    it whole; n-gram drafts) gives transformers' greedy ``generate`` tokens, beside a text-only prompt."""
    from specray import LLM
    from specray_test_engine_runs import assert_images_greedy_equals_transformers

    llm = LLM(model=str(folder), max_model_len=512, block_size=4, max_num_batched_tokens=80,
              speculative_config=NGRAM)
    assert_images_greedy_equals_transformers(llm, hf, hf_processor(folder), PROMPT, _images())


def test_engine_chat_with_an_image_equals_transformers(folder, hf):
    """``LLM.chat`` with an image_url part (the template renders ``<|image|>`` after "user\\n") gives transformers'
    greedy tokens for the same conversation through Gemma4Processor."""
    import base64
    import io

    from PIL import Image

    from specray import LLM, SamplingParams

    buffer = io.BytesIO()
    _images()[1].save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    llm = LLM(model=str(folder), max_model_len=512, block_size=4, max_num_batched_tokens=80)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Summarize the text"}]}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    processor = hf_processor(folder)
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Summarize the text"}]}],
        add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[Image.open(buffer).convert("RGB")], return_tensors="pt",
                       add_special_tokens=False)
    with torch.no_grad():
        want = hf.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    assert list(out[0].outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist()
