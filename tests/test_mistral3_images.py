"""Mistral 3's images (specray.models.mistral3, specray.models.pixtral_vision): a tiny random
``Mistral3ForConditionalGeneration`` (Pixtral tower of 2 layers, 4-pixel patches merged 2 x 2, a Mistral text model)
against transformers: the processor's expansion of ``[IMG]`` into rows of ``[IMG]`` closed by ``[IMG_BREAK]`` /
``[IMG_END]`` and its pixels equal ``PixtralProcessor``'s for images of two sizes; the encoder's embeddings equal
``get_image_features`` (bf16 as close as transformers' own); the text model (a Mistral or a Ministral 3, either tensor
layout) fed them equals the whole model's logits (one prefill, and chunks that split an image's span); each part of the
encoder shown to matter; ``LLM.generate`` with images and n-gram drafts equals ``generate``; two tensor-parallel ranks
equal one; refusals."""

from __future__ import annotations

import json
import re
import shutil
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from specray.models.attention import build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache
from specray.multimodal import expand_prompt, step_rows
from specray_test_image_checks import assert_ranks_equal_one_rank, first_cut, random_images  # tests/image_checks.py
from specray_test_model_checks import max_diff

TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
LONGEST_EDGE = 40
PATCH, MERGE = 4, 2
TEXT = "Hello [IMG] world! How [IMG] are you today?"


def pixtral_processor_class():
    """transformers' ``PixtralProcessor`` (its module imports the torchvision image processor's for one helper, which
    the PIL backend's module defines too: stood in for while it imports where torchvision is missing)."""
    fast = "transformers.models.pixtral.image_processing_pixtral"
    try:
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
    except ModuleNotFoundError:
        from transformers.models.pixtral import image_processing_pil_pixtral as pil

        stub = types.ModuleType(fast)
        stub.get_resize_output_image_size = pil.get_resize_output_image_size
        sys.modules[fast] = stub
        try:
            from transformers.models.pixtral.processing_pixtral import PixtralProcessor
        finally:
            del sys.modules[fast]
    return PixtralProcessor


def images() -> list[Image.Image]:
    """A tall image (shrunk to 40 x 24: 5 x 3 merged patches) and a small wide one (grown to 24 x 40: 3 x 5)."""
    return random_images([(50, 30), (20, 37)])


def build(folder, seed: int = 0, text_type: str = "mistral", **overrides):
    """A tiny Mistral 3 folder: weights (random, norms around 1), tokenizer with the image tokens, processor; its
    text model a Mistral (Mistral Small 3.1 / 3.2) or a Ministral 3 (``text_type``: YaRN, the query scaling)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from tests.conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer(folder, extra_special_tokens=TOKENS)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, image_size=LONGEST_EDGE, patch_size=PATCH, hidden_act="silu",
                  rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
    text = dict(model_type=text_type, vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=None, rms_norm_eps=1e-5,
                max_position_embeddings=256, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = Mistral3Config(text_config=text, vision_config=vision, spatial_merge_size=MERGE, tie_word_embeddings=False,
                            image_token_index=tok.convert_tokens_to_ids("[IMG]"), **overrides)
    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    image_processor = PixtralImageProcessorPil(size={"longest_edge": LONGEST_EDGE}, patch_size=PATCH)
    pixtral_processor_class()(image_processor=image_processor, tokenizer=tok, patch_size=PATCH,
                              spatial_merge_size=MERGE).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def mistral3_dir(tmp_path_factory):
    return build(tmp_path_factory.mktemp("mistral3"))


@pytest.fixture(scope="module")
def ministral3_dir(tmp_path_factory):
    return build(tmp_path_factory.mktemp("ministral3"), seed=1, text_type="ministral3")


def transformers_model(folder):
    from transformers import Mistral3ForConditionalGeneration

    return Mistral3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_model(mistral3_dir):
    return transformers_model(mistral3_dir)


@pytest.fixture(scope="module")
def hf_inputs(mistral3_dir):
    """transformers' processor's outputs for TEXT with both images."""
    processor = pixtral_processor_class().from_pretrained(mistral3_dir)
    return processor(text=TEXT, images=images(), return_tensors="pt")


def our_processor(folder):
    from specray.models.loader import load_image_processor

    return load_image_processor(str(folder))


def our_encoder(folder, config=None):
    from specray.models.loader import load_image_encoder, read_config

    return load_image_encoder(str(folder), config or read_config(str(folder)), torch.float32, "cpu")


def expanded(folder, text: str = TEXT, count: int = 2):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder).encode(text)
    return expand_prompt(ids, images()[:count], our_processor(folder))


@pytest.mark.parametrize("count", [1, 2])
def test_processor_expands_and_pixels_equal_transformers(mistral3_dir, count):
    """Our prompt ids (each [IMG] as rows of [IMG] closed by [IMG_BREAK], the last by [IMG_END]) and each image's
    pixels equal transformers' PixtralProcessor's, for one image and for two of different sizes (one shrunk within
    longest_edge, one grown to whole merged patches); the image's embeddings go to its [IMG] rows only."""
    text = TEXT if count == 2 else "Hello [IMG] world!"
    theirs = pixtral_processor_class().from_pretrained(mistral3_dir)(text=text, images=images()[:count],
                                                                     return_tensors="pt")
    ids, mm = expanded(mistral3_dir, text, count)
    assert ids == theirs["input_ids"][0].tolist()
    ours = our_processor(mistral3_dir)
    image_id, break_id, end_id = ours.image_token_id, ours.break_token_id, ours.end_token_id
    shapes = [(5, 3), (3, 5)][:count]
    for item, (height, width), (rows, cols) in zip(mm.items, theirs["image_sizes"].tolist(), shapes, strict=True):
        pixels = item.data["pixel_values"]
        assert pixels.shape == (3, height, width) == (3, rows * PATCH * MERGE, cols * PATCH * MERGE)
        index = mm.items.index(item)
        assert np.array_equal(pixels, theirs["pixel_values"][index, :, :height, :width].numpy())
        span = ids[item.offset: item.end]
        assert item.length == rows * (cols + 1) and item.num_embeds == rows * cols
        assert [span[r] for r in item.embed_rows] == [image_id] * (rows * cols)
        assert [t for t in span if t != image_id] == [break_id] * (rows - 1) + [end_id]
        assert all(span[r * (cols + 1) + cols] in (break_id, end_id) for r in range(rows))


def test_encoder_equals_transformers_image_features(mistral3_dir, hf_model, hf_inputs):
    """Each image's embeddings equal transformers' get_image_features for it (transformers runs both images as one
    padded batch with a block mask; ours one image at a time)."""
    with torch.no_grad():
        theirs = hf_model.get_image_features(pixel_values=hf_inputs["pixel_values"],
                                             image_sizes=hf_inputs["image_sizes"]).pooler_output
    _, mm = expanded(mistral3_dir)
    encoder = our_encoder(mistral3_dir)
    for item, want in zip(mm.items, theirs, strict=True):
        got = encoder.encode({"pixel_values": torch.from_numpy(item.data["pixel_values"])})
        assert got.shape == want.shape == (item.num_embeds, 64)
        assert max_diff(got, want) < 1e-4


def run_with_images(model, encoder, ids, mm, sizes) -> torch.Tensor:
    """Our text model's logits of ``ids`` in chunks of ``sizes`` over a paged cache, each step's image rows taking
    the encoder's embeddings (``meta.input_embeds``), as the runner hands them."""
    embeds = [encoder.encode({"pixel_values": torch.from_numpy(item.data["pixel_values"])}) for item in mm.items]
    allocate_kv_cache(model, 64, 4)
    table = list(range(63, 63 - -(-len(ids) // 4), -1))
    out, start = [], 0
    for n in sizes:
        meta = build_attention_metadata([n], [start], [table], 4, model.device)
        rows, values = [], []
        for item, embed in zip(mm.items, embeds):
            positions, indices = step_rows(item, start, start + n)
            rows += [p - start for p in positions]
            values.append(embed[indices])
        if rows:
            meta.input_embeds = (torch.tensor(rows), torch.cat(values))
        with torch.no_grad():
            out.append(model.compute_logits(model(torch.tensor(ids[start: start + n]), meta)))
        start += n
    assert start == len(ids)
    return torch.cat(out)


@pytest.mark.parametrize("text", ["mistral", "ministral3"])
@pytest.mark.parametrize("schedule", ["prefill", "chunked+decode"])
def test_logits_with_images_equal_transformers(request, hf_inputs, text, schedule):
    """The text model (served from the whole checkpoint through _TEXT_PARTS: a Mistral, or a Ministral 3) fed the
    encoder's rows equals transformers' whole model over the expanded prompt with both images: one prefill, and
    chunks that start and end inside the images' spans, then single steps."""
    from specray.models.loader import load_model

    folder = request.getfixturevalue("mistral3_dir" if text == "mistral" else "ministral3_dir")
    hf = request.getfixturevalue("hf_model") if text == "mistral" else transformers_model(folder)
    ids, mm = expanded(folder)
    first, second = mm.items
    cuts = [first.offset + 3, second.offset + 5 - (first.offset + 3), 2]  # inside image 1, inside image 2, past it
    sizes = [len(ids)] if schedule == "prefill" else cuts + [1] * (len(ids) - sum(cuts))
    got = run_with_images(load_model(str(folder)), our_encoder(folder), ids, mm, sizes)
    with torch.no_grad():
        want = hf(**hf_inputs).logits[0]
    assert max_diff(got, want) < 1e-4


def _no_rope(encoder):
    encoder.vision_tower.inv_freq_rows.zero_()
    encoder.vision_tower.inv_freq_cols.zero_()


def _swapped_axes(encoder):
    tower = encoder.vision_tower
    tower.inv_freq_rows, tower.inv_freq_cols = tower.inv_freq_cols.clone(), tower.inv_freq_rows.clone()


def _patch_major_merge(encoder):
    merger = encoder.multi_modal_projector.patch_merger

    def forward(x, rows, cols):
        m, c = merger.merge, x.shape[-1]
        grid = x.view(rows // m, m, cols // m, m, c).permute(0, 2, 1, 3, 4)
        return merger.merging_layer(grid.reshape(-1, c * m * m))
    merger.forward = forward


def _identity(path):
    def mutate(encoder):
        parent, name = path.rsplit(".", 1)
        setattr(encoder.get_submodule(parent), name, torch.nn.Identity())
    return mutate


@pytest.mark.parametrize("part,mutate,config_change", [
    ("2D RoPE", _no_rope, None),
    ("RoPE axes (rows: even frequencies)", _swapped_axes, None),
    ("merger's channel-major order", _patch_major_merge, None),
    ("ln_pre", _identity("vision_tower.ln_pre"), None),
    ("projector norm", _identity("multi_modal_projector.norm"), None),
    ("feed-forward norm", _identity("vision_tower.transformer.layers.0.ffn_norm"), None),
    ("vision_feature_layer", None, {"vision_feature_layer": -2}),
    ("projector_hidden_act", None, {"projector_hidden_act": "silu"}),
])
def test_each_part_shows_in_the_embeddings(mistral3_dir, hf_model, hf_inputs, part, mutate, config_change):
    """Each distinctive part of the encoder switched off (or a config setting changed) moves the embeddings away
    from transformers': the comparison above sees every one of them."""
    from specray.models.loader import read_config

    config = read_config(str(mistral3_dir))
    for key, value in (config_change or {}).items():
        setattr(config, key, value)
    encoder = our_encoder(mistral3_dir, config)
    if mutate is not None:
        mutate(encoder)
    with torch.no_grad():
        want = hf_model.get_image_features(pixel_values=hf_inputs["pixel_values"],
                                           image_sizes=hf_inputs["image_sizes"]).pooler_output[0]
    _, mm = expanded(mistral3_dir)
    got = encoder.encode({"pixel_values": torch.from_numpy(mm.items[0].data["pixel_values"])})
    assert max_diff(got, want) > 1e-2, part


def test_transformers_module_names_load(mistral3_dir, hf_model, tmp_path):
    """A checkpoint named as transformers' modules name it (``model.language_model.``, ``lm_head.``,
    ``model.vision_tower.``, ``model.multi_modal_projector.``) loads text model and encoder alike."""
    from safetensors.torch import load_file, save_file

    from specray.models.loader import load_model

    folder = tmp_path / "module_names"
    shutil.copytree(mistral3_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    renamed = {re.sub(r"^language_model\.model\.", "model.language_model.",
                      re.sub(r"^language_model\.lm_head\.", "lm_head.",
                             re.sub(r"^(vision_tower|multi_modal_projector)\.", r"model.\1.", k))): v
               for k, v in tensors.items()}
    assert any(k.startswith("model.language_model.") for k in renamed) and "lm_head.weight" in renamed
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    ids, mm = expanded(folder)
    got = run_with_images(load_model(str(folder)), our_encoder(folder), ids, mm, [len(ids)])
    with torch.no_grad():
        want = hf_model(**pixtral_processor_class().from_pretrained(folder)(text=TEXT, images=images(),
                                                                            return_tensors="pt")).logits[0]
    assert max_diff(got, want) < 1e-4


def _edit_json(folder, name, **changes):
    path = folder / name
    data = json.loads(path.read_text())
    for key, value in changes.items():
        target = data
        *parents, last = key.split(".")
        for p in parents:
            target = target[p]
        target[last] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("file,changes,match", [
    ("config.json", {"vision_feature_layer": [-1, -2]}, "vision_feature_layer"),
    ("config.json", {"vision_config.rope_parameters": {"rope_type": "linear", "rope_theta": 100.0,
                                                     "factor": 2.0}}, "rope_type='linear'"),
    ("config.json", {"projector_hidden_act": "swish_gated"}, "projector_hidden_act='swish_gated'"),
    ("config.json", {"vision_config.hidden_act": "swish_gated"}, "vision_config.hidden_act='swish_gated'"),
    ("config.json", {"image_token_index": 7}, "image_token_index=7"),
    ("processor_config.json", {"spatial_merge_size": 1}, "spatial_merge_size=1"),
    ("processor_config.json", {"image_end_token": "[NOPE]"}, r"\[NOPE\]"),
])
def test_refusals(mistral3_dir, tmp_path, file, changes, match):
    """Settings we do not implement (or that would mismatch tokens and embeddings) are refused by name."""
    from specray.models.loader import load_image_encoder, load_image_processor, read_config

    folder = tmp_path / "edited"
    shutil.copytree(mistral3_dir, folder)
    _edit_json(folder, file, **changes)
    with pytest.raises(ValueError, match=match):
        config = read_config(str(folder))
        load_image_encoder(str(folder), config, torch.float32, "cpu")
        load_image_processor(str(folder), config)


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_missing_or_unknown_tensors_are_refused(mistral3_dir, tmp_path, change):
    """The encoder names a tensor of its own that the checkpoint lacks, or one it does not read (a quantized
    tower's scale)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / change
    shutil.copytree(mistral3_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    if change == "missing":
        del tensors["multi_modal_projector.linear_2.weight"]
    else:
        tensors["vision_tower.transformer.layers.1.attention.q_proj.weight_scale"] = torch.ones(1)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="linear_2.weight" if change == "missing" else "weight_scale"):
        our_encoder(folder)


def test_engine_with_images_equals_transformers_generate(mistral3_dir, hf_model):
    """LLM.generate with images (prompt text and multi_modal_data; prefill chunks of 7 tokens, so both images' spans
    are split; n-gram drafts; prefix caching) gives transformers' greedy generate of the whole model, token for token;
    the same prompt again with the images swapped gets its own output."""
    from specray import LLM, SamplingParams

    llm = LLM(model=str(mistral3_dir), max_model_len=128, block_size=4, max_num_batched_tokens=7,
              enable_prefix_caching=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    processor = pixtral_processor_class().from_pretrained(mistral3_dir)
    a, b = images()
    prompts = [(TEXT, [a, b]), ("Hello [IMG] world!", [b]), (TEXT, [b, a])]
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for (text, imgs), out in zip(prompts, outs, strict=True):
        inputs = processor(text=text, images=imgs, return_tensors="pt")
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        with torch.no_grad():
            want = hf_model.generate(**inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
        assert list(out.outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist(), text
    assert outs[0].outputs[0].token_ids != outs[2].outputs[0].token_ids
    assert llm.spec_stats.accepted_tokens > 0


def test_tensor_parallel_two_ranks_equal_one(mistral3_dir, tmp_path):
    """The text model split over two tensor-parallel ranks (the encoder replicated on each) gives one rank's logits
    with the images' rows in place: TEXT's with both images, a prefill chunk ending inside the first image's span,
    then the rest."""
    ids, mm = expanded(mistral3_dir)
    cut = first_cut(mm)
    assert_ranks_equal_one_rank(tmp_path, [(mistral3_dir, ids, mm, [cut, len(ids) - cut])], 1, 1e-4)


def test_bf16_encoder_is_as_close_as_transformers_bf16(mistral3_dir, hf_model, hf_inputs):
    """In bfloat16 (the releases' dtype) our embeddings are as close to transformers' float32 ones as transformers'
    own bfloat16 ones are (dtype handling: the pixels cast, norms and RoPE tables in float32 where transformers'
    are)."""
    from transformers import Mistral3ForConditionalGeneration

    from specray.models.loader import load_image_encoder, read_config

    _, mm = expanded(mistral3_dir)
    bf16 = Mistral3ForConditionalGeneration.from_pretrained(mistral3_dir, dtype=torch.bfloat16).eval()
    encoder = load_image_encoder(str(mistral3_dir), read_config(str(mistral3_dir)), torch.bfloat16, "cpu")
    with torch.no_grad():
        want = hf_model.get_image_features(pixel_values=hf_inputs["pixel_values"],
                                           image_sizes=hf_inputs["image_sizes"]).pooler_output[0]
        theirs = bf16.get_image_features(pixel_values=hf_inputs["pixel_values"],
                                         image_sizes=hf_inputs["image_sizes"]).pooler_output[0].float()
        ours = encoder.encode({"pixel_values": torch.from_numpy(mm.items[0].data["pixel_values"]).bfloat16()})
    assert ours.dtype == torch.bfloat16
    assert max_diff(ours.float(), want) <= 1.5 * max_diff(theirs, want)
