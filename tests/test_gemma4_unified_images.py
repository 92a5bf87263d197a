"""Gemma 4 Unified's images (``Gemma4UnifiedForConditionalGeneration``: :mod:`specray.models.gemma4_unified_images`
and the Unified text model, :mod:`specray.models.gemma4_unified`), against transformers on the same tiny random fp32
weights: our merged patches and positions equal transformers' torchvision-only ``Gemma4UnifiedImageProcessor``'s (live
in a subprocess where torchvision imports, else against digests recorded with torchvision 0.28) for an image scaled
up and one scaled down, and our resized sizes equal its ``get_aspect_ratio_preserving_size``'s; our expanded prompt
equals ``Gemma4UnifiedProcessor``'s (boi, one soft token per merged patch, eoi); each image's embeddings equal
``get_image_features`` (max abs diff < 1e-4); the text model's logits with those embeddings in the soft tokens' rows
(``meta.input_embeds``), each image's soft tokens seeing each other both ways in every layer (full ones too, as the
Unified model's forward masks them), equal transformers' whole model's with its ``mm_token_type_ids``, for a prefill
and for chunks ending at the images' edges; each distinctive part broken once moves the embeddings or the logits;
what is not implemented is refused by name; two tensor-parallel ranks equal one; the engine's greedy output with
n-gram drafts equals transformers' ``generate``, and so does ``LLM.chat`` with an image part (a minimal
template).

The tiny model: merged patches of 12 pixels (patches of 4, merged 3 x 3), a 32-wide embedder, a 4-layer Unified text
model (sliding window 64, not shorter than an image's 60 / 63 soft tokens: see the refusal; k = v full layers; the
last two layers reading the first two's K/V), a Gemma-style tokenizer with Gemma 4's image tokens. transformers'
processor runs in this venv with our pixels standing in for its torchvision-only image processor (checked against
the real one above). No GPU check here."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models import gemma4_unified_images as gu
from specray.models.loader import load_image_encoder, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import assert_ranks_equal_one_rank, config_with, random_images  # tests/image_checks.py
from specray_test_model_checks import max_diff  # tests/model_checks.py
from tests.test_gemma3_images import logits_with_images
from tests.test_gemma4_images import TEMPLATE

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the embeddings or logits at least this much (a hundred times TOL)
SLIDING, FULL = "sliding_attention", "full_attention"
IMAGE, BOI, EOI = "<|image|>", "<|image>", "<image|>"
SPECIALS = {"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE, "boa_token": "<|audio>", "eoa_token": "<audio|>",
            "audio_token": "<|audio|>", "video_token": "<|video|>"}
PROMPT = f"Look at {IMAGE} and then at {IMAGE}, the quick brown fox jumps over the lazy dog"
TEXT = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
            layer_types=[SLIDING, FULL, SLIDING, FULL], sliding_window=64, num_kv_shared_layers=2,
            final_logit_softcapping=30.0, max_position_embeddings=1024, rms_norm_eps=1e-5,
            use_bidirectional_attention="vision",
            rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                             FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 10000.0}})
VISION = dict(patch_size=4, pooling_kernel_size=3, mm_embed_dim=32, mm_posemb_size=80, output_proj_dims=32,
              rms_norm_eps=1e-6)
IMAGES = {"image_processor_type": "Gemma4UnifiedImageProcessor", "patch_size": 4, "pooling_kernel_size": 3,
          "max_soft_tokens": 70, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
          "do_normalize": False, "resample": 3, "do_convert_rgb": True, "image_mean": [0.0] * 3,
          "image_std": [1.0] * 3}
# a 40 x 64 image scaled up to 72 x 120 (6 x 10 merged patches), a 130 x 110 one scaled down to 108 x 84 (9 x 7)
SIZES = [(40, 64), (130, 110)]
TOKENS = [60, 63]
# transformers' merged patches of the two images (sha256 of the float32 bytes, padding dropped), recorded with
# torchvision 0.28 (test_pixels_equal_transformers_live)
DIGESTS = ["3fa5e0cb6ec04d552a5ac4ffe9668079873ec3bc0247e0307d8eeb469c7856a9",
           "49ac5ebce8a4b2b77feeac7e5a111772e3f664e0cf7af622cd72fab92db15a92"]
TORCHVISION_PATHS = ("GEMMA4_UNIFIED_TORCHVISION_PATH", "LLAMA4_TORCHVISION_PATH")


def _images() -> list:
    return random_images(SIZES)


def _tokenizer(path: Path):
    """conftest's Gemma-style tokenizer with Gemma 4's image, audio and video tokens and a minimal Gemma-turn chat
    template rendering an image part as ``<|image|>`` (Gemma 4's images test's: the release's was not available)."""
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
    """Norms, positions, the patch projection's bias and layer scalars away from their inits; the embedding doubled
    (greedy decoding then loops now and then, so n-gram drafts are accepted)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("norm" in name or "_ln" in name) and name.endswith(".weight"):
                param.uniform_(0.5, 1.5)
            elif ("norm" in name or "_ln" in name or "patch_dense" in name) and name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            elif name.endswith("pos_embedding"):
                param.normal_(0.0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
        model.get_input_embeddings().weight.mul_(2.0)


def build_tiny(path: Path, seed: int = 0, **text) -> Path:
    """transformers' Gemma4UnifiedForConditionalGeneration of :data:`TEXT` and :data:`VISION` (no audio), saved with
    :func:`_tokenizer`'s tokenizer and a processor_config.json holding the image processor's settings
    (:data:`IMAGES`)."""
    from transformers import (Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration, Gemma4UnifiedTextConfig,
                              Gemma4UnifiedVisionConfig)

    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(path)
    text_config = Gemma4UnifiedTextConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                          eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                          **{**TEXT, **text})
    config = Gemma4UnifiedConfig(text_config=text_config, vision_config=Gemma4UnifiedVisionConfig(**VISION),
                                 audio_config=None, boi_token_id=tok.boi_token_id, eoi_token_id=tok.eoi_token_id,
                                 image_token_id=tok.image_token_id, audio_token_id=tok.audio_token_id,
                                 video_token_id=tok.convert_tokens_to_ids("<|video|>"))
    torch.manual_seed(seed)
    model = Gemma4UnifiedForConditionalGeneration(config).float().eval()
    _visible(model)
    model.save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps({"image_processor": IMAGES, "image_seq_length": 70,
                                                            "processor_class": "Gemma4UnifiedProcessor"}))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny_gemma4_unified_images"))


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import Gemma4UnifiedForConditionalGeneration

    return Gemma4UnifiedForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def _processor(folder: Path, config=None) -> gu.Gemma4UnifiedImageProcessor:
    return gu.Gemma4UnifiedImageProcessor.from_pretrained(folder, config or read_config(str(folder)))


class PixelsOf:
    """A stand-in for transformers' torchvision-only ``Gemma4UnifiedImageProcessor`` (torchvision is not installed
    in this venv): our merged patches (checked against transformers' by :func:`test_pixels_equal_transformers` and
    its live twin), padded as it pads them (zeros at positions (-1, -1) up to ``max_soft_tokens``)."""

    model_input_names = ["pixel_values", "image_position_ids", "num_soft_tokens_per_image"]

    def __init__(self, ours: gu.Gemma4UnifiedImageProcessor):
        self.ours = ours

    def fetch_images(self, images):
        return images

    def __call__(self, images, **kwargs):
        from transformers import BatchFeature

        flat = []
        for image in images if isinstance(images, list) else [images]:  # a batch of lists of images, or images
            flat.extend(image if isinstance(image, list) else [image])
        made = [self.ours.pixels(image) for image in flat]
        total = self.ours.max_soft_tokens
        pixels = np.stack([np.pad(p, ((0, total - len(p)), (0, 0))) for p, _ in made])
        positions = np.stack([np.pad(q, ((0, total - len(q)), (0, 0)), constant_values=-1) for _, q in made])
        return BatchFeature({"pixel_values": pixels, "image_position_ids": positions,
                             "num_soft_tokens_per_image": [len(p) for p, _ in made]}, tensor_type="pt")


@contextlib.contextmanager
def _lenient_classes():
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: None
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def hf_processor(folder: Path):
    """transformers' ``Gemma4UnifiedProcessor`` (its prompt expansion, ``mm_token_type_ids``) over the folder's
    tokenizer and :class:`PixelsOf` (no feature extractor or video processor: both need what is not installed)."""
    from transformers import AutoTokenizer, Gemma4UnifiedProcessor

    with _lenient_classes():
        return Gemma4UnifiedProcessor(feature_extractor=None, image_processor=PixelsOf(_processor(folder)),
                                      tokenizer=AutoTokenizer.from_pretrained(folder), video_processor=None,
                                      image_seq_length=70)


def _hf_inputs(folder: Path, text: str = PROMPT) -> dict:
    return hf_processor(folder)(text=[text], images=_images(), return_tensors="pt")


def _expanded(folder: Path, text: str = PROMPT):
    from transformers import AutoTokenizer

    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text), _images(), _processor(folder))


# ---- the processor -------------------------------------------------------------------------------------------------

def test_processor_expands_as_transformers(folder):
    """Our expanded prompt equals Gemma4UnifiedProcessor's (boi, 60 and 63 soft tokens, eoi); each item's span is
    exactly its soft tokens (what mm_token_type_ids marks), attending both ways; ``finish_prompt`` is idempotent."""
    want = _hf_inputs(folder)
    ids, mm = _expanded(folder)
    assert ids == want["input_ids"][0].tolist()
    types = want["mm_token_type_ids"][0].tolist()
    assert [i for i, t in enumerate(types) if t] == [p for item in mm.items for p in range(item.offset, item.end)]
    config = read_config(str(folder))
    assert [item.length for item in mm.items] == TOKENS
    for item in mm.items:
        assert item.embed_rows is None and item.bidirectional
        assert (ids[item.offset - 1], ids[item.end]) == (config.boi_token_id, config.eoi_token_id)
        assert item.data["pixel_values"].shape == (item.length, 12 * 12 * 3)
    # the first image's merged grid: 10 columns by 6 rows, row-major
    assert mm.items[0].data["image_position_ids"][:12].tolist() == [[x, y] for y in (0, 1) for x in range(10)][:12]
    assert _processor(folder).finish_prompt(ids, mm.items) == (ids, mm.items)
    config.text_config.use_bidirectional_attention = None
    assert not _processor(folder, config).process(_images()[0]).bidirectional


def test_pixels_equal_transformers(folder):
    """The merged patches of the image scaled up and of the one scaled down equal transformers'
    ``Gemma4UnifiedImageProcessor``'s bit for bit: the digests recorded with torchvision 0.28."""
    _, mm = _expanded(folder)
    got = [hashlib.sha256(np.ascontiguousarray(item.data["pixel_values"]).tobytes()).hexdigest() for item in mm.items]
    assert got == DIGESTS


# (height, width, max_soft_tokens) of images kept, scaled up and down, long and thin (a side rounding to zero)
SIZE_CASES = [(72, 120, 70), (40, 64, 70), (130, 110, 70), (1000, 3000, 280), (10, 2000, 70), (3000, 9, 140),
              (224, 224, 1120), (33, 47, 560)]


def test_sizes_equal_transformers():
    """Our resized sizes equal transformers' ``get_aspect_ratio_preserving_size`` (``Gemma4UnifiedProcessor``'s copy:
    it imports without torchvision) for patches of 16 merged 3 x 3 and of 4."""
    from transformers.models.gemma4_unified.processing_gemma4_unified import get_aspect_ratio_preserving_size

    for h, w, tokens in SIZE_CASES:
        for patch in (4, 16):
            want = get_aspect_ratio_preserving_size(height=h, width=w, patch_size=patch, max_patches=tokens * 9,
                                                    pooling_kernel_size=3)
            assert gu.resized_size(h, w, patch, tokens * 9, 3) == want


REFERENCE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer, Gemma4UnifiedImageProcessor
    folder, out, *sizes = sys.argv[1:]
    settings = json.load(open(f"{folder}/processor_config.json"))["image_processor"]
    settings.pop("image_processor_type")
    processor = Gemma4UnifiedImageProcessor(**settings)
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in sizes]
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in shapes]
    got = processor(images=pictures, return_tensors="np")
    np.save(f"{out}/px.npy", got["pixel_values"])
    np.save(f"{out}/pos.npy", got["image_position_ids"])
    json.dump({"tokens": [int(n) for n in got["num_soft_tokens_per_image"]]}, open(f"{out}/o.json", "w"))
""")


def _torchvision_env() -> dict | None:
    env = dict(os.environ)
    extra = next((os.environ[v] for v in TORCHVISION_PATHS if os.environ.get(v)), None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, env.get("PYTHONPATH")) if p)
    if subprocess.run([sys.executable, "-c", "import torchvision"], env=env, capture_output=True).returncode:
        return None
    return env


def test_pixels_equal_transformers_live(folder, tmp_path):
    """Where torchvision imports (a folder holding it named by ``GEMMA4_UNIFIED_TORCHVISION_PATH`` or
    ``LLAMA4_TORCHVISION_PATH``), transformers' own ``Gemma4UnifiedImageProcessor`` over
    the two images gives our merged patches, positions and counts (its padding aside)."""
    env = _torchvision_env()
    if env is None:
        pytest.skip("torchvision does not import: transformers' Gemma4UnifiedImageProcessor cannot run (the recorded "
                    "digests stand in)")
    script = tmp_path / "reference.py"
    script.write_text(REFERENCE)
    subprocess.run([sys.executable, str(script), str(folder), str(tmp_path), *[f"{h}x{w}" for h, w in SIZES]],
                   env=env, check=True, capture_output=True, timeout=120)
    pixels, positions = np.load(tmp_path / "px.npy"), np.load(tmp_path / "pos.npy")
    assert json.loads((tmp_path / "o.json").read_text())["tokens"] == TOKENS
    _, mm = _expanded(folder)
    for i, item in enumerate(mm.items):
        n = item.length
        assert (positions[i, n:] == -1).all() and not pixels[i, n:].any()
        assert np.array_equal(item.data["pixel_values"], pixels[i, :n])
        assert np.array_equal(item.data["image_position_ids"], positions[i, :n])


# ---- the encoder -----------------------------------------------------------------------------------------------------

def _hf_features(hf, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(hf.model.get_image_features(inputs["pixel_values"], inputs["image_position_ids"]).pooler_output)


def _embeds(encoder, mm) -> list[torch.Tensor]:
    with torch.no_grad():
        return [encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()}) for item in mm.items]


def _encoder(folder: Path, dtype=torch.float32) -> gu.Gemma4UnifiedImageEncoder:
    return load_image_encoder(str(folder), read_config(str(folder)), dtype, "cpu")


def test_encoder_matches_transformers(folder, hf):
    """Each image's embeddings equal transformers' ``get_image_features`` (fp32; padding dropped here, stripped
    there); built under bfloat16 the encoder computes in bf16 and lands within its rounding."""
    encoder = _encoder(folder)
    assert isinstance(encoder, gu.Gemma4UnifiedImageEncoder) and encoder.deepstack_layers == 0
    _, mm = _expanded(folder)
    got, want = _embeds(encoder, mm), _hf_features(hf, _hf_inputs(folder))
    assert [g.shape for g in got] == [w.shape for w in want] == [(60, 64), (63, 64)]
    assert max(max_diff(g, w) for g, w in zip(got, want)) < TOL
    half = _encoder(folder, torch.bfloat16)
    with torch.no_grad():
        low = [half.encode({k: torch.from_numpy(v) for k, v in item.data.items()}) for item in mm.items]
    assert all(g.dtype == torch.bfloat16 for g in low)
    assert max(max_diff(g.float(), w) / w.abs().max().item() for g, w in zip(low, want)) < 3e-2


def test_module_names_load_too(folder):
    """The embedder's tensors under transformers' module names (``model.embed_vision.patch_*``,
    ``...multimodal_embedder.embedding_projection``) load as the saved names (``model.vision_embedder.*``,
    ``model.embed_vision.embedding_projection``) do."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {n.replace("model.vision_embedder.", "model.embed_vision.").replace(
        "embed_vision.embedding_projection", "embed_vision.multimodal_embedder.embedding_projection"): t
        for n, t in tensors.items()}
    assert set(renamed) != set(tensors)
    encoder = gu.Gemma4UnifiedImageEncoder(read_config(str(folder)))
    encoder.load_weights(renamed.items())
    saved = _encoder(folder)
    assert all(torch.equal(p, dict(saved.named_parameters())[n]) for n, p in encoder.named_parameters())


def _no_norm(name):
    def mutate(encoder):
        setattr(encoder, name, torch.nn.Identity())
    return mutate


def _no_positions(encoder) -> None:
    encoder.pos_embedding.data.zero_()


def _swapped_position_axes(encoder) -> None:  # the rows' table for columns and the other way round
    encoder.pos_embedding.data.copy_(encoder.pos_embedding.data.flip(1))


def _no_pre_projection_norm(encoder) -> None:
    encoder.multimodal_embedder.embedding_pre_projection_norm = torch.nn.Identity()


def _no_dense_bias(encoder) -> None:
    encoder.patch_dense.bias.data.zero_()


def _channels_first(encoder) -> None:  # each merged patch read as [3, s, s] rather than [s, s, 3]
    encode = encoder.encode

    def channels_first(data):
        x = data["pixel_values"]
        return encode({**data, "pixel_values": x.view(-1, 12, 12, 3).permute(0, 3, 1, 2).reshape(x.shape)})
    encoder.encode = channels_first


ENCODER_MUTATIONS = {"no-patch-ln1": _no_norm("patch_ln1"), "no-patch-ln2": _no_norm("patch_ln2"),
                     "no-pos-norm": _no_norm("pos_norm"), "no-positions": _no_positions,
                     "swapped-position-axes": _swapped_position_axes,
                     "no-pre-projection-norm": _no_pre_projection_norm, "no-dense-bias": _no_dense_bias,
                     "channels-first-patches": _channels_first}


@pytest.mark.parametrize("mutation", sorted(ENCODER_MUTATIONS))
def test_each_part_shows_in_the_embeddings(folder, hf, mutation):
    """Each part of the embedder switched off (or done the other way) moves the embeddings."""
    encoder = _encoder(folder)
    ENCODER_MUTATIONS[mutation](encoder)
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
    """transformers' ``Gemma4UnifiedForConditionalGeneration(input_ids, pixel_values, image_position_ids,
    mm_token_type_ids)`` logits == our text model's with the embedder's rows in the soft tokens' rows, each image's soft
    tokens seeing each other in every layer, in one prefill and in chunks ending at the images' edges (then single
    steps)."""
    model, ids, mm, embeds = ours
    got = logits_with_images(model, ids, mm, embeds, _schedules(mm, len(ids))[schedule])
    assert max_diff(got, reference) < TOL


@pytest.fixture
def full_layers_causal(ours, monkeypatch):
    """Our full layers attending the image causally (Gemma 4's way)."""
    from specray.models.kv_cache import CAUSAL, CAUSAL_KEYS

    model = ours[0]
    full = [layer.self_attn.attn for layer in model.model.layers if layer.self_attn.layer_type == FULL]
    assert full and all(attn.mask_kind == CAUSAL for attn in full)
    for attn in full:
        monkeypatch.setattr(attn, "mask_kind", CAUSAL_KEYS)


@pytest.mark.parametrize("part", ["causal-images", "full-layers-causal", "boi-eoi-bidirectional", "scaled-image-rows",
                                  "no-image-rows"])
def test_each_part_shows_in_the_logits(ours, reference, request, part):
    """Images attended causally, the full layers attending them causally (as Gemma 4's do), the block widened over
    boi / eoi, the image rows scaled by sqrt(hidden) as the tokens' embeddings are, or the placeholders' own
    embeddings: the logits move."""
    model, ids, mm, embeds = ours
    if part == "full-layers-causal":
        request.getfixturevalue("full_layers_causal")
    kwargs = {"causal-images": dict(bidirectional=False), "boi-eoi-bidirectional": dict(widen=1),
              "scaled-image-rows": dict(embeds=[e * model.model.embed_scale for e in embeds]),
              "no-image-rows": dict(mm=type(mm)([]))}.get(part, {})
    args = {"mm": mm, "embeds": embeds, **kwargs}
    got = logits_with_images(model, ids, args.pop("mm"), args.pop("embeds"), [len(ids)], **args)
    assert max_diff(got, reference) > MOVED


def test_causal_images_match_transformers(tmp_path):
    """A release without ``use_bidirectional_attention`` (images attended causally) and a shorter window: the items
    are not bidirectional, and the logits over chunks splitting the first image equal transformers'."""
    from transformers import Gemma4UnifiedForConditionalGeneration

    folder = build_tiny(tmp_path / "causal", seed=1, use_bidirectional_attention=None, sliding_window=16,
                        num_kv_shared_layers=0)
    ids, mm = _expanded(folder)
    assert not any(item.bidirectional for item in mm.items)
    hf = Gemma4UnifiedForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
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
    (dict(vision_config__model_type="gemma4_vision"), "vision_config.model_type='gemma4_vision'"),
    (dict(vision_config__output_proj_dims=64), "vision_config.output_proj_dims=64")])
def test_unsupported_settings_are_refused(folder, change, words):
    with pytest.raises(ValueError) as err:
        gu.Gemma4UnifiedImageEncoder(config_with(folder, **change))
    assert words in str(err.value)


@pytest.mark.parametrize("setting,words", [
    (dict(pooling_kernel_size=2), "pooling_kernel_size=2"), (dict(patch_size=8), "patch_size=8"),
    (dict(max_soft_tokens=100), "max_soft_tokens=100"), (dict(max_soft_tokens=140), "mm_posemb_size=80"),
    (dict(resample=2), "resample=2"), (dict(do_normalize=True), "do_normalize=True"),
    (dict(do_resize=False), "do_resize=False")])
def test_unsupported_processor_settings_are_refused(folder, tmp_path, setting, words):
    copy = tmp_path / "m"
    copy.mkdir()
    (copy / "processor_config.json").write_text(json.dumps({"image_processor": {**IMAGES, **setting}}))
    with pytest.raises(ValueError, match=words):
        _processor(copy, read_config(str(folder)))


def test_mismatches_are_refused(folder):
    """An image of more soft tokens than the sliding window (bidirectional), a prompt holding an audio placeholder,
    and a checkpoint missing one of the embedder's tensors are refused by name."""
    from safetensors.torch import load_file

    with pytest.raises(ValueError, match="sliding_window=32"):
        _processor(folder, config_with(folder, text_config__sliding_window=32)).process(_images()[0])
    config = read_config(str(folder))
    ids, mm = _expanded(folder)
    with pytest.raises(ValueError, match=f"audio_token_id={config.audio_token_id}"):
        _processor(folder).finish_prompt(ids + [config.audio_token_id], mm.items)
    encoder = gu.Gemma4UnifiedImageEncoder(config)
    tensors = load_file(str(folder / "model.safetensors"))
    for gone in ("model.vision_embedder.pos_embedding", "model.embed_vision.embedding_projection.weight"):
        with pytest.raises(ValueError, match=gone[len("model."):]):
            encoder.load_weights((n, t) for n, t in tensors.items() if n != gone)


# ---- tensor parallel -------------------------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(folder, tmp_path):
    """The text model split over two tensor-parallel ranks (the embedder replicated on each) gives one rank's logits
    with the images' rows in place and their soft tokens seeing each other."""
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
    """``LLM.chat`` with an image_url part (the template renders ``<|image|>``) gives transformers' greedy tokens for
    the same conversation through Gemma4UnifiedProcessor."""
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
    assert inputs["input_ids"].shape[1] > TOKENS[1]
    with torch.no_grad():
        want = hf.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    assert list(out[0].outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist()
