"""LFM2-VL's images (``Lfm2VlForConditionalGeneration``, :mod:`specray.models.lfm2_vl`) against transformers on tiny
random fp32 weights: a SigLIP2 NaFlex tower (4-pixel patches, a 4 x 4 position table resized to each tile's grid), the
2 x 2 pixel unshuffle and the LayerNorm + two-linear projector, before an LFM2 text model (short convs, attention).
Three images: one tiled (a 2 x 2 grid of 16-pixel tiles, the grid an aspect tie decides, and a 4 x 6-patch
thumbnail: row / column and thumbnail tokens), one shrunk by the smart-resize rule, one
whose 2 x 8 grid shrinks the position table's rows. transformers' image processor needs torchvision: our
prompt and pixels equal transformers' processor's live where torchvision imports (``LLAMA4_TORCHVISION_PATH`` may name
a folder holding it) and always the ids, grids and pixel sums recorded from it; each tile's embeddings equal
``get_image_features``; the text model fed them equals the whole model's logits over a prefill and over chunks that
split the images' spans (the conv history carried); each part broken moves the logits; ``LLM.generate`` with images
and n-gram drafts equals ``generate``; two tensor-parallel ranks equal one; refusals by name."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models import lfm2_vl as lv
from specray.models.loader import load_image_encoder, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import (assert_ranks_equal_one_rank, config_with, encode_items,  # tests/image_checks.py
                                       image_logits, private_env, random_images)
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL, MOVED = 1e-4, 1e-2
SHAPES = ((48, 72), (20, 28), (6, 30))  # the first's aspect ties a 2 x 1 grid's and a 2 x 2 grid's
PROMPT = "Look at <image> then <image> and <image>, the quick brown fox jumps over"
GENERATED = [7, 30, 41, 5, 99]
SEED = 3  # weights whose greedy tokens with the images repeat a little (n-gram drafts get accepted)
ROWS = [f"<|img_row_{r}_col_{c}|>" for r in range(1, 5) for c in range(1, 5)]
SPECIAL = ("<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>", *ROWS)
TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, full_attn_idxs=[1],
            norm_eps=1e-5, conv_L_cache=3, conv_bias=False, intermediate_size=144, block_multiple_of=16,
            block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True, max_position_embeddings=512)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_patches=16,
              patch_size=4, vision_use_head=False, layer_norm_eps=1e-6)
SETTINGS = {"image_processor_type": "Lfm2VlImageProcessor", "encoder_patch_size": 4, "downsample_factor": 2,
            "tile_size": 16, "min_image_tokens": 2, "max_image_tokens": 6, "min_tiles": 2, "max_tiles": 4,
            "max_pixels_tolerance": 2.0, "use_thumbnail": True, "do_image_splitting": True, "resample": 2,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
# what transformers' Lfm2VlProcessor (torchvision 0.28) made of the three images: each tile's patch grid, and each
# image's pixel sum and sum weighted by sin(flat index) (an order check)
RECORDED_GRIDS = [[4, 4], [4, 4], [4, 4], [4, 4], [4, 6], [4, 4], [2, 8]]
RECORDED_SUMS = [(24.071, -5.648), (-1.89, -6.138), (-5.035, -2.838)]


def images() -> list:
    return random_images(SHAPES)


def build(path: Path, seed: int = 0) -> Path:
    from transformers import Lfm2Config, Lfm2VlConfig, Lfm2VlForConditionalGeneration, Siglip2VisionConfig

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=SPECIAL)
    text = Lfm2Config(**TEXT, vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=None)
    config = Lfm2VlConfig(text_config=text, vision_config=Siglip2VisionConfig(**VISION), projector_hidden_size=48,
                          image_token_id=tok.convert_tokens_to_ids("<image>"), downsample_factor=2)
    torch.manual_seed(seed)
    model = Lfm2VlForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # every weight at unit scale (the text model's norms near one), vision norms away from init
        for name, p in model.named_parameters():
            if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
                p.normal_(0.3, 0.5) if p.dim() == 1 else p.normal_(0.0, p[0].numel() ** -0.5)
            elif p.dim() == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1 if "embed_tokens" in name else p[0].numel() ** -0.5)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(SETTINGS))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Lfm2VlProcessor"}))
    return path


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from transformers import Lfm2VlForConditionalGeneration

    folder = build(tmp_path_factory.mktemp("tiny_lfm2_vl"), SEED)
    return folder, Lfm2VlForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def expanded(folder: Path, text: str = PROMPT):
    from transformers import AutoTokenizer

    from specray.models.loader import load_image_processor

    processor = load_image_processor(str(folder))
    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text), images(), processor)


def hf_inputs(ids: list[int], mm) -> dict:
    """transformers' whole-model inputs for ``ids`` with our processor's tensors (equal to its own processor's)."""
    cat = lambda k: torch.from_numpy(np.concatenate([i.data[k] for i in mm.items]))  # noqa: E731
    return {"input_ids": torch.tensor([ids]), "pixel_values": cat("pixel_values"),
            "pixel_attention_mask": cat("pixel_attention_mask"), "spatial_shapes": cat("spatial_shapes")}


@torch.no_grad()
def hf_logits(hf, ids: list[int], mm) -> torch.Tensor:
    return hf(**hf_inputs(ids, mm)).logits[0]


def pixel_sums(mm) -> list[tuple[float, float]]:
    out = []
    for item in mm.items:
        px = torch.from_numpy(item.data["pixel_values"]).double().flatten()
        out.append((round(px.sum().item(), 3), round((px * torch.arange(px.numel()).double().sin()).sum().item(), 3)))
    return out


# ---- the processor ---------------------------------------------------------------------------------------------------

REFERENCE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor
    # stdin: the prompt and, per run, [checkpoint folder, output folder, call kwargs, image sizes]
    job = json.loads(sys.stdin.read())
    for folder, out, kwargs, shapes in job["runs"]:
        processor = AutoProcessor.from_pretrained(folder)
        rng = np.random.default_rng(0)
        pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in shapes]
        got = processor(text=[job["prompt"]], images=pictures, return_tensors="np", **kwargs)
        for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes"):
            np.save(f"{out}/{key}.npy", got[key])
        json.dump({"ids": got["input_ids"][0].tolist()}, open(f"{out}/o.json", "w"))
""")


def run_reference(tmp_path: Path, prompt: str, runs: list) -> None:
    """transformers' own processor (in a process where torchvision imports; skipped elsewhere) over ``runs``."""
    env = private_env(["LFM2_VL_TORCHVISION_PATH", "LLAMA4_TORCHVISION_PATH"], "torchvision",
                      "transformers' Lfm2VlImageProcessor")
    script = tmp_path / "reference.py"
    script.write_text(REFERENCE)
    job = json.dumps({"prompt": prompt, "runs": [[str(a), str(b), c, d] for a, b, c, d in runs]})
    subprocess.run([sys.executable, str(script)], env=env, check=True, capture_output=True, timeout=240,
                   input=job.encode())


def assert_reference(out: Path, ids: list[int], mm) -> None:
    assert ids == json.loads((out / "o.json").read_text())["ids"]
    for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes"):
        assert np.array_equal(np.concatenate([i.data[key] for i in mm.items]), np.load(out / f"{key}.npy")), key



def test_processor_equals_transformers_live(release, tmp_path):
    """Where torchvision imports, transformers' own Lfm2VlProcessor over the three images gives our prompt and
    tensors (pixels, masks and patch grids) exactly."""
    run_reference(tmp_path, PROMPT, [(release[0], tmp_path, {}, SHAPES)])
    assert_reference(tmp_path, *expanded(release[0]))


VARIANTS = {"no splitting": ({"do_image_splitting": False}, True), "no thumbnail": ({"use_thumbnail": False}, True),
            "no special tokens": ({}, False), "six tiles": ({"max_tiles": 6}, True)}
VARIANT_SHAPES = ((48, 72), (20, 28), (90, 30))  # the last a 1 x 3 grid (or, up to six tiles, 1 x 3 too)


def test_processor_settings_equal_transformers_live(release, tmp_path):
    """Where torchvision imports: with splitting or the thumbnail off, without the special tokens
    (``use_image_special_tokens``: transformers' per-call argument, our constructor's) or with more tiles allowed,
    our prompt and tensors still equal transformers'."""
    from transformers import AutoTokenizer

    prompt, runs = "A <image> B <image> C <image> D", []
    for i, (change, special) in enumerate(VARIANTS.values()):
        folder = tmp_path / f"v{i}"
        shutil.copytree(release[0], folder)
        (folder / "preprocessor_config.json").write_text(json.dumps({**SETTINGS, **change}))
        runs.append((folder, folder, {"use_image_special_tokens": special}, VARIANT_SHAPES))
    run_reference(tmp_path, prompt, runs)
    tok = AutoTokenizer.from_pretrained(release[0])
    for (folder, *_), (change, special) in zip(runs, VARIANTS.values()):
        processor = lv.Lfm2VlImageProcessor({**SETTINGS, **change}, tok, read_config(str(folder)), special)
        assert_reference(folder, *expand_prompt(tok.encode(prompt), random_images(VARIANT_SHAPES), processor))


def test_processor_matches_recorded_transformers(release):
    """The expansion (start / row-column / thumbnail / end tokens and the image tokens), the tiles' grids and pixel
    sums equal what transformers' processor made of them (recorded with torchvision)."""
    from transformers import AutoTokenizer

    folder = release[0]
    ids, mm = expanded(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    first = tok.convert_ids_to_tokens(ids[mm.items[0].offset:mm.items[0].offset + mm.items[0].length])
    assert [t for t in first if t != "<image>"] == ["<|image_start|>", "<|img_row_1_col_1|>", "<|img_row_1_col_2|>",
                                                    "<|img_row_2_col_1|>", "<|img_row_2_col_2|>", "<|img_thumbnail|>",
                                                    "<|image_end|>"]
    assert [(item.offset, item.length) for item in mm.items] == [(7, 29), (39, 6), (49, 6)]
    assert np.concatenate([i.data["spatial_shapes"] for i in mm.items]).tolist() == RECORDED_GRIDS
    assert pixel_sums(mm) == RECORDED_SUMS


def test_processor_config_special_tokens_flag_is_not_followed(release, tmp_path, caplog):
    """transformers' Lfm2VlProcessor.from_pretrained drops ``use_image_special_tokens`` from
    ``processor_config.json`` (only a per-call argument turns the tokens off): ours writes them too, and logs it."""
    folder = tmp_path / "release"
    shutil.copytree(release[0], folder)
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Lfm2VlProcessor",
                                                              "use_image_special_tokens": False}))
    with caplog.at_level("WARNING", logger="specray.models.lfm2_vl"):
        ids, mm = expanded(folder)
    assert ids == expanded(release[0])[0] and "use_image_special_tokens=false" in caplog.text


# ---- the encoder and the whole model ---------------------------------------------------------------------------------

def test_encoder_equals_transformers_image_features(release):
    """Each image's embeddings (its tiles' rows, the thumbnail last) equal ``get_image_features``' rows."""
    folder, hf = release
    _, mm = expanded(folder)
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    for item, ours in zip(mm.items, encode_items(encoder, mm)):
        inputs = {k: torch.from_numpy(v) for k, v in item.data.items()}
        with torch.no_grad():
            want = torch.cat(hf.model.get_image_features(**inputs).pooler_output)
        assert ours.shape == (item.num_embeds, TEXT["hidden_size"]) and max_diff(ours, want) < TOL


def test_encoder_in_bfloat16(release):
    """Built in bfloat16 (as the engine builds it for a bf16 model), the encoder takes the float32 pixels and gives
    bfloat16 embeddings within 5% (relative, max over the image) of float32's."""
    folder = release[0]
    _, mm = expanded(folder)
    config = read_config(str(folder))
    want = encode_items(load_image_encoder(str(folder), config, torch.float32, "cpu"), mm)
    got = encode_items(load_image_encoder(str(folder), config, torch.bfloat16, "cpu"), mm)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16 and max_diff(a.float(), b) < 5e-2 * b.abs().max()


SCHEDULES = {"prefill": None, "chunked+decode": [13, 29, 10]}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_with_images_equal_transformers(release, schedule):
    """The LFM2 text model with the images' rows gives the whole model's logits over the prompt and tokens after it:
    one prefill, or chunks whose ends fall inside each image's span (the conv history carried), then single steps."""
    folder, hf = release
    ids, mm = expanded(folder)
    sizes = SCHEDULES[schedule]
    if sizes:
        cuts = np.cumsum(sizes)
        assert all(any(it.offset < c < it.offset + it.length for c in cuts) for it in mm.items)
    ids = ids + GENERATED
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    ours = image_logits(load_model(str(folder)), ids, mm, encode_items(encoder, mm), sizes)
    assert max_diff(ours, hf_logits(hf, ids, mm)) < TOL


def _column_major(self, x, rows, cols):
    k = self.k
    return x.view(rows // k, k, cols // k, k, -1).permute(0, 2, 3, 1, 4).reshape((rows // k) * (cols // k), -1)


def _unwidened(size, grid):
    """Bilinear weights without the antialiasing (the triangle not widened where shrinking)."""
    centre = (torch.arange(size, dtype=torch.float32) + 0.5) * grid / size - 0.5
    w = (1 - (torch.arange(grid, dtype=torch.float32) - centre[:, None]).abs()).clamp(min=0)
    return w / w.sum(-1, keepdim=True)


PARTS = ["position table", "antialiased resize", "unshuffle order", "projector norm", "post norm", "conv history"]


@pytest.mark.parametrize("part", PARTS)
def test_each_part_shows_in_the_logits(release, part, monkeypatch):
    """Each distinctive part switched off moves the logits (chunks splitting the images, then steps)."""
    folder, hf = release
    if part == "position table":
        monkeypatch.setattr(lv.NaflexTower, "positions", lambda self, r, c: torch.zeros(()))
    elif part == "antialiased resize":
        monkeypatch.setattr(lv, "_axis_weights", _unwidened)
    elif part == "unshuffle order":
        monkeypatch.setattr(lv.Lfm2VlProjector, "unshuffle", _column_major)
    ids, mm = expanded(folder)
    ids = ids + GENERATED
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    if part == "projector norm":
        encoder.projector.layer_norm = None
    elif part == "post norm":
        encoder.tower.post_layernorm = torch.nn.Identity()
    ours = image_logits(load_model(str(folder)), ids, mm, encode_items(encoder, mm), SCHEDULES["chunked+decode"],
                        forget=part == "conv history")
    assert max_diff(ours, hf_logits(hf, ids, mm)) > MOVED


def test_two_ranks_equal_one_rank(release, tmp_path):
    """Two tensor-parallel ranks (the convs' channels and the heads split, the encoder whole on each) give one
    rank's logits with images over chunks splitting their spans, then steps."""
    folder = release[0]
    ids, mm = expanded(folder)
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids + GENERATED, mm, SCHEDULES["chunked+decode"])], 1, TOL)


# ---- refusals --------------------------------------------------------------------------------------------------------

REFUSED = {
    "tower": (dict(vision_config__model_type="siglip_vision_model"), r"model_type='siglip_vision_model' is not"),
    "activation": (dict(projector_hidden_act="swish"), r"projector_hidden_act='swish' is not supported"),
    "position table": (dict(vision_config__num_patches=15), r"num_patches=15 is not a square"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_settings_are_refused(release, case):
    changes, message = REFUSED[case]
    with pytest.raises(ValueError, match=message):
        lv.Lfm2VlImageEncoder(config_with(release[0], **changes))


PROCESSOR_REFUSED = {
    "resample": ({"resample": 3}, r"resample=3 is not supported: only bilinear"),
    "pad": ({"do_pad": False}, r"do_pad=False is not supported"),
    "patch": ({"encoder_patch_size": 8}, r"encoder_patch_size=8, downsample_factor=2 disagree"),
    "tiles": ({"min_tiles": 5}, r"min_tiles=5 exceeds max_tiles=4"),
}


@pytest.mark.parametrize("case", sorted(PROCESSOR_REFUSED))
def test_unsupported_processor_settings_are_refused(release, case, tmp_path):
    from transformers import AutoTokenizer

    folder = release[0]
    change, message = PROCESSOR_REFUSED[case]
    with pytest.raises(ValueError, match=message):
        lv.Lfm2VlImageProcessor({**SETTINGS, **change}, AutoTokenizer.from_pretrained(folder),
                                read_config(str(folder)))


# ---- the engine ------------------------------------------------------------------------------------------------------

# a chat template of the release's shape for an image part: ``<image>`` where the part is
TEMPLATE = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
            "{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}{% endfor %}")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def test_engine_greedy_with_images_equals_transformers(release):
    """``LLM.generate`` with the three images (at most 12 tokens a step: chunks end inside their spans; n-gram
    drafts) gives transformers' greedy ``generate`` tokens beside a text-only prompt; some drafts are accepted;
    without the images transformers generates other tokens. ``LLM.chat`` with an image_url part (a data: URL)
    answers the same as the prompt it renders."""
    import base64
    import io

    from specray import LLM, SamplingParams

    folder, hf = release
    ids, mm = expanded(folder)
    inputs = hf_inputs(ids, mm)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=12, speculative_config=NGRAM)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf, None, PROMPT, images(), max_tokens=32, inputs=inputs)
    buffer = io.BytesIO()
    images()[0].save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look at "},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": " the quick brown fox"}]}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    chat = llm.chat(messages, params, use_tqdm=False, chat_template=TEMPLATE)[0]
    alone = llm.generate({"prompt": "Look at <image> the quick brown fox", "multi_modal_data": {"image": images()[0]}},
                         params, use_tqdm=False)[0]
    assert list(chat.outputs[0].token_ids) == list(alone.outputs[0].token_ids)
