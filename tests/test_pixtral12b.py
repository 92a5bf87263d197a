"""Pixtral-12B's images (``mistral-community/pixtral-12b``: a ``LlavaForConditionalGeneration`` whose vision tower is
Pixtral's): :mod:`specray.models.llava` picks :mod:`specray.models.pixtral_vision`'s tower for a ``pixtral``
vision_config and keeps LLaVA's two-linear projector; the processor is Mistral 3's (PixtralProcessor's ``[IMG]`` rows
closed by ``[IMG_BREAK]`` / ``[IMG_END]``, no patch merging). A tiny random model (a Pixtral tower of 2 layers, 4-pixel
patches, a Mistral text model) against transformers: the expanded prompt and pixels equal PixtralProcessor's, each
image's embeddings equal ``get_image_features`` (with ``image_sizes``), the text model fed them equals the whole
model's logits (one prefill, chunks splitting the images' spans), each part shown to matter, ``LLM.generate`` with
images and n-gram drafts equals ``generate``, two tensor-parallel ranks equal one, refusals."""

from __future__ import annotations

import pytest
import torch

from specray.multimodal import expand_prompt
from specray_test_image_checks import random_images  # tests/image_checks.py
from specray_test_model_checks import max_diff
from tests.test_mistral3_images import TEXT, TOKENS, images, pixtral_processor_class, run_with_images

LONGEST_EDGE, PATCH = 24, 4


def build(folder, seed: int = 0, **overrides):
    """A tiny Pixtral-12B folder: LlavaForConditionalGeneration (a Pixtral tower, a Mistral), the tokenizer with
    the three image tokens, PixtralProcessor (patch 4, no merging, longest edge 24)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(folder, extra_special_tokens=TOKENS)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=2, image_size=LONGEST_EDGE, patch_size=PATCH, hidden_act="silu",
                  rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
    text = dict(model_type="mistral", vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=None, rms_norm_eps=1e-5,
                max_position_embeddings=512, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    settings = dict(vision_feature_layer=-1, vision_feature_select_strategy="full", projector_hidden_act="gelu",
                    tie_word_embeddings=False, image_token_index=tok.convert_tokens_to_ids("[IMG]"))
    config = LlavaConfig(text_config=text, vision_config=vision, **{**settings, **overrides})
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "multi_modal_projector" in name and name.endswith("weight"):
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    image_processor = PixtralImageProcessorPil(size={"longest_edge": LONGEST_EDGE}, patch_size=PATCH)
    pixtral_processor_class()(image_processor=image_processor, tokenizer=tok, patch_size=PATCH,
                              spatial_merge_size=1).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pixtral_dir(tmp_path_factory):
    return build(tmp_path_factory.mktemp("pixtral12b"))


@pytest.fixture(scope="module")
def hf_model(pixtral_dir):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(pixtral_dir, dtype=torch.float32).eval()


def hf_inputs(folder, text: str = TEXT, count: int = 2):
    return pixtral_processor_class().from_pretrained(folder)(text=text, images=images()[:count], return_tensors="pt")


def ours(folder, config=None):
    from specray.models.loader import load_image_encoder, read_config
    from specray.models.registry import multimodal_classes

    config = config or read_config(str(folder))
    processor = multimodal_classes(config)[1].from_pretrained(folder, config)
    return load_image_encoder(str(folder), config, torch.float32, "cpu"), processor


def expanded(folder, text: str = TEXT, count: int = 2):
    from transformers import AutoTokenizer

    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text), images()[:count], ours(folder)[1])


def hf_features(model, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(model.get_image_features(pixel_values=inputs["pixel_values"],
                                             image_sizes=inputs["image_sizes"]).pooler_output)


@pytest.mark.parametrize("count", [1, 2])
def test_processor_and_encoder_equal_transformers(pixtral_dir, hf_model, count):
    """Our expanded prompt equals PixtralProcessor's (each [IMG] as rows of [IMG] closed by [IMG_BREAK] /
    [IMG_END], one image and two of different sizes: 6 x 4 and 3 x 6 patches); each image's pixels equal
    transformers' (cropped to its size); its embeddings (on the [IMG] rows only) equal get_image_features'."""
    from specray.models.llava import LlavaImageEncoder
    from specray.models.mistral3 import Mistral3Processor

    text = TEXT if count == 2 else "Hello [IMG] world!"
    theirs = hf_inputs(pixtral_dir, text, count)
    ids, mm = expanded(pixtral_dir, text, count)
    encoder, processor = ours(pixtral_dir)
    assert isinstance(encoder, LlavaImageEncoder) and isinstance(processor, Mistral3Processor)
    assert ids == theirs["input_ids"][0].tolist()
    want = hf_features(hf_model, theirs)
    for i, (item, (height, width), shape) in enumerate(zip(mm.items, theirs["image_sizes"].tolist(),
                                                           [(6, 4), (3, 6)], strict=False)):
        rows, cols = height // PATCH, width // PATCH
        assert (rows, cols) == shape and item.length == rows * (cols + 1) and item.num_embeds == rows * cols
        assert torch.equal(torch.from_numpy(item.data["pixel_values"]), theirs["pixel_values"][i, :, :height, :width])
        with torch.no_grad():
            got = encoder.encode({"pixel_values": torch.from_numpy(item.data["pixel_values"])})
        assert got.shape == want[i].shape == (rows * cols, 64)
        assert max_diff(got, want[i]) < 1e-4


@pytest.mark.parametrize("schedule", ["prefill", "chunked+decode"])
def test_logits_with_images_equal_transformers(pixtral_dir, hf_model, schedule):
    """The text model (the Mistral under ``language_model.``) fed the encoder's rows equals transformers' whole
    LlavaForConditionalGeneration over the prompt with both images: one prefill, and chunks that end inside each
    image's span, then single steps; without the images' rows the logits differ."""
    from specray.models.loader import load_model

    ids, mm = expanded(pixtral_dir)
    first, second = mm.items
    cuts = [first.offset + 3, second.offset + 5 - (first.offset + 3), 2]
    sizes = [len(ids)] if schedule == "prefill" else cuts + [1] * (len(ids) - sum(cuts))
    encoder = ours(pixtral_dir)[0]
    with torch.no_grad():
        got = run_with_images(load_model(str(pixtral_dir)), encoder, ids, mm, sizes)
        want = hf_model(**hf_inputs(pixtral_dir)).logits[0]
    assert max_diff(got, want) < 1e-4
    with torch.no_grad():
        blind = hf_model(input_ids=torch.tensor([ids])).logits[0]
    assert max_diff(blind, want) > 1e-2


def _no_rope(encoder):
    encoder.tower.inv_freq_rows.zero_()
    encoder.tower.inv_freq_cols.zero_()


def _identity(path):
    def mutate(encoder):
        parent, name = path.rsplit(".", 1)
        setattr(encoder.get_submodule(parent), name, torch.nn.Identity())
    return mutate


@pytest.mark.parametrize("part,mutate,config_change", [
    ("Pixtral's 2D RoPE", _no_rope, None),
    ("ln_pre", _identity("tower.ln_pre"), None),
    ("vision_feature_layer", None, {"vision_feature_layer": -2}),
    ("projector_hidden_act", None, {"projector_hidden_act": "silu"}),
    ("projector's biases", lambda e: e.projector.linear_1.bias.data.zero_(), None),
])
def test_each_part_shows_in_the_embeddings(pixtral_dir, hf_model, part, mutate, config_change):
    """Each part switched off (or a config setting changed) moves the first image's embeddings away from
    transformers'."""
    from specray.models.loader import read_config

    config = read_config(str(pixtral_dir))
    for key, value in (config_change or {}).items():
        setattr(config, key, value)
    encoder = ours(pixtral_dir, config)[0]
    if mutate is not None:
        mutate(encoder)
    want = hf_features(hf_model, hf_inputs(pixtral_dir))[0]
    _, mm = expanded(pixtral_dir)
    with torch.no_grad():
        got = encoder.encode({"pixel_values": torch.from_numpy(mm.items[0].data["pixel_values"])})
    assert max_diff(got, want) > 1e-2, part


@pytest.mark.parametrize("changes,match", [
    ({"vision_feature_select_strategy": "default"}, "vision_feature_select_strategy='default'"),
    ({"vision_feature_layer": [-1, -2]}, r"vision_feature_layer=\[-1, -2\]"),
    ({"vision_feature_layer": 9}, "vision_feature_layer=9"),
])
def test_refusals(pixtral_dir, changes, match):
    """Settings the Pixtral path does not implement are refused by name, by the encoder and the processor alike."""
    from specray.models.llava import LlavaImageEncoder, LlavaImageProcessor
    from specray.models.loader import read_config

    config = read_config(str(pixtral_dir))
    for key, value in changes.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=match):
        LlavaImageEncoder(config)
    if "vision_feature_select_strategy" in changes:
        with pytest.raises(ValueError, match=match):
            LlavaImageProcessor.from_pretrained(pixtral_dir, config)


def test_engine_with_images_equals_transformers_generate(pixtral_dir, hf_model):
    """LLM.generate with images (prefill chunks of 7 tokens, so the images' spans are split; n-gram drafts) gives
    transformers' greedy generate of the whole model, token for token, for two prompts; some drafts accepted."""
    from specray import LLM, SamplingParams

    llm = LLM(model=str(pixtral_dir), max_model_len=128, block_size=4, max_num_batched_tokens=7,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    a, b = images()
    prompts = [(TEXT, [a, b]), ("Hello [IMG] world!", [b])]
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    processor = pixtral_processor_class().from_pretrained(pixtral_dir)
    for (text, imgs), out in zip(prompts, outs, strict=True):
        inputs = processor(text=text, images=imgs, return_tensors="pt")
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        with torch.no_grad():
            want = hf_model.generate(**inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
        assert list(out.outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist(), text
    assert llm.spec_stats.accepted_tokens > 0


def test_tensor_parallel_two_ranks_equal_one(pixtral_dir, tmp_path):
    """The text model over two tensor-parallel ranks (the encoder replicated) equals one rank with the images' rows
    in place (LLaVA-NeXT's check: TEXT with two images, a prefill chunk ending inside the first image's span)."""
    from tests.test_llava_next import assert_two_ranks_equal_one

    assert_two_ranks_equal_one(tmp_path, TEXT, random_images([(50, 30), (20, 37)], legacy=True), [pixtral_dir], 1e-4)


def test_bf16_encoder_is_as_close_as_transformers_bf16(pixtral_dir, hf_model):
    """In bfloat16 each image's embeddings are about as close to transformers' float32 ones as transformers' own
    bfloat16 ones are."""
    from transformers import LlavaForConditionalGeneration

    from specray.models.loader import load_image_encoder, read_config

    encoder = load_image_encoder(str(pixtral_dir), read_config(str(pixtral_dir)), torch.bfloat16, "cpu")
    bf16 = LlavaForConditionalGeneration.from_pretrained(pixtral_dir, dtype=torch.bfloat16).eval()
    inputs = hf_inputs(pixtral_dir)
    want = hf_features(hf_model, inputs)
    theirs = hf_features(bf16, {**inputs, "pixel_values": inputs["pixel_values"].bfloat16()})
    _, mm = expanded(pixtral_dir)
    for item, w, t in zip(mm.items, want, theirs, strict=True):
        with torch.no_grad():
            got = encoder.encode({"pixel_values": torch.from_numpy(item.data["pixel_values"]).bfloat16()})
        assert got.dtype == torch.bfloat16
        assert max_diff(got.float(), w) <= 1.5 * max_diff(t.float(), w) + 1e-3
