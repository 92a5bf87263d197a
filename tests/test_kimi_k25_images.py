"""Kimi K2.5's images (``specray.models.kimi_k25_vision``): against transformers' whole
``Kimi_K25ForConditionalGeneration`` on the same random tiny fp32 weights. The processor's expanded prompt equals
transformers' ``Kimi_K25Processor``'s for one and two images (``<|media_pad|>`` once per merged token); its pixels
equal transformers' ``Kimi_K25ImageProcessor``'s (a torchvision-only processor: live where torchvision imports, else
against digests recorded with torchvision 0.28) for an image kept and one resized, and its sizes equal
``navit_resize``'s (recorded); the release's ``media_proc_cfg`` reads as transformers' keys. The encoder's embeddings
per image equal transformers' ``get_image_features`` with the weights under transformers' module names, the release's
(fused ``wqkv`` in the interleaved-pair rotation, the release's vision-config names beside transformers') and as
transformers' ``save_pretrained`` writes them; in bfloat16 they stay close. The DeepSeek-V3 text model fed them
(``meta.input_embeds``) gives transformers' logits over a prompt of two images and text then more tokens, in one
prefill and in chunks splitting both images' spans then decode steps. Two tensor-parallel ranks equal one; the
engine's greedy tokens with images and n-gram drafts equal transformers' ``generate``, and ``LLM.chat`` with an
image_url part answers as its prompt does. Each distinctive part broken once moves the logits; what is not served is
refused by name."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from specray.models import kimi_k25_vision as kv
from specray.models.loader import load_image_encoder, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import (private_env, assert_ranks_equal_one_rank, encoded,  # tests/image_checks.py
                                       grid_reference, image_logits, random_images)
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
SPECIAL = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>", "<|kimi_k25_video_placeholder|>")
TEXT = dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, max_position_embeddings=1024,
            initializer_range=0.1)
# the tower: 16-wide heads (4 RoPE frequencies), a 4 x 4 learned position table resampled to grids of 4 x 6 and 6 x 10
VISION = dict(num_attention_heads=2, num_hidden_layers=2, hidden_size=32, intermediate_size=48, pos_emb_height=4,
              pos_emb_width=4, pos_emb_time=2, patch_size=14)
# the image processor (transformers' keys) with a budget of 48 patches
PROCESSOR = {"image_processor_type": "Kimi_K25ImageProcessor", "max_patches": 48,
             "size": {"max_height": 512, "max_width": 512}, "patch_size": 14, "merge_size": 2, "resample": 3,
             "do_resize": True, "do_rescale": True, "do_normalize": True, "rescale_factor": 1 / 255,
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}
# the release's own names of the tower's sizes and parts (its config.json), and its processor's settings
RELEASE_VISION = {"vt_hidden_size": 32, "vt_intermediate_size": 48, "vt_num_hidden_layers": 2,
                  "vt_num_attention_heads": 2, "init_pos_emb_height": 4, "init_pos_emb_width": 4,
                  "init_pos_emb_time": 2,
                  "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger", "pos_emb_type": "divided_fixed",
                  "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5}
MEDIA = {"media_proc_cfg": {"in_patch_limit": 48, "patch_size": 14, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                            "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512}}
# two images: 50 x 80 kept (3 x 5 whole patches, within the budget) and padded to 56 x 84, a 4 x 6 grid (6 tokens);
# 90 x 140 (6 x 10 whole patches, over it) resized by sqrt(48 / 60) to 80 x 125 and padded to 84 x 140, a 6 x 10
# grid (15 tokens)
SIZES = [(50, 80), (90, 140)]
GRIDS = [[1, 4, 6], [1, 6, 10]]
# transformers' pixels for the two images (sha256 of the float32 bytes), recorded with torchvision 0.28
DIGESTS = ["9c0b9f98ce9f8d8ca07181989aee596583d4d99b5f253b2b9c89eeac1b487aa3",
           "a5e274cb5ee78d008d42c54357d8118d9bd3645e576a776c4aa8ad8a3468e990"]
TEXT_BEFORE, BETWEEN, AFTER = "Hello world!", " and then ", " The quick brown fox jumps."
GENERATED = [17, 42, 99, 75, 230, 61, 28, 150]  # tokens past the prompt (decode steps)
PART = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
# a prefill; chunks that split both images' spans (tokens 16-21 and 36-50 of the 71-token prompt), then single steps
SCHEDULES = {"prefill": None, "chunked+decode": [12, 6, 20, 8, 25]}
LAYOUTS = ("modules", "release", "saved")
TORCHVISION_PATHS = ("KIMI_K25_TORCHVISION_PATH", "LLAMA4_TORCHVISION_PATH")


def images() -> list:
    return random_images(SIZES)


def release_names(state: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """transformers' module names -> the release's (the inverse of transformers' conversion): the text under
    ``language_model.``, the tower's blocks under ``vision_tower.encoder.blocks.`` with q, k, v fused into ``wqkv``
    (q and k rows in the interleaved-pair rotation), the projector's ``proj.0`` / ``proj.2``."""
    def interleaved(w: torch.Tensor) -> torch.Tensor:  # per head, rows (j, j + half) -> (2j, 2j + 1)
        half = w.shape[0] // heads // 2
        return w.reshape(heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    out = {}
    renames = {"norm1": "norm0", "norm2": "norm1", "mlp.fc1": "mlp.fc0", "mlp.fc2": "mlp.fc1", "attn.proj": "wo"}
    for name, tensor in state.items():
        if name.startswith("model.language_model."):
            out["language_model.model." + name[len("model.language_model."):]] = tensor
        elif name.startswith("lm_head."):
            out["language_model." + name] = tensor
        elif name.startswith("model.vision_tower.layers."):
            i, rest = name[len("model.vision_tower.layers."):].split(".", 1)
            if rest.startswith("attn.q_proj."):
                kind = rest.rsplit(".", 1)[1]
                q, k, v = (state[f"model.vision_tower.layers.{i}.attn.{p}_proj.{kind}"] for p in "qkv")
                out[f"vision_tower.encoder.blocks.{i}.wqkv.{kind}"] = torch.cat((interleaved(q), interleaved(k), v))
            elif not rest.startswith(("attn.k_proj.", "attn.v_proj.")):
                module, kind = rest.rsplit(".", 1)
                out[f"vision_tower.encoder.blocks.{i}.{renames[module]}.{kind}"] = tensor
        elif name == "model.vision_tower.patch_embed.pos_emb.position_embeddings":
            out["vision_tower.patch_embed.pos_emb.weight"] = tensor
        elif name.startswith("model.vision_tower.patch_embed."):
            out[name[len("model."):]] = tensor
        elif name.startswith("model.vision_tower.final_layernorm."):
            out["vision_tower.encoder." + name[len("model.vision_tower."):]] = tensor
        elif name.startswith("model.mm_projector."):
            rest = name[len("model.mm_projector."):]
            out["mm_projector." + rest.replace("in_proj.", "proj.0.").replace("out_proj.", "proj.2.")] = tensor
        else:
            raise AssertionError(f"unexpected tensor {name}")
    return {k: v.contiguous() for k, v in out.items()}


def build_release(path: Path, seed: int = 0) -> tuple[dict[str, Path], object]:
    """transformers' whole model at :data:`TEXT` / :data:`VISION` sizes with random weights (the tower's and the
    projector's drawn away from their init so that each shows, the routers from zeros), saved in transformers' module
    names, in the release's, and by transformers' ``save_pretrained`` (:data:`LAYOUTS`), each folder with conftest's
    tiny tokenizer (Kimi's media tokens among its special ones) and :data:`PROCESSOR`."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    from tests.conftest import build_tiny_tokenizer

    folders = {layout: path / layout for layout in LAYOUTS}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
        tok = build_tiny_tokenizer(folder, extra_special_tokens=SPECIAL)
        (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    start, _, end, pad, video = tok.convert_tokens_to_ids(list(SPECIAL))
    config = Kimi_K25Config(text_config={**TEXT, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id},
                            vision_config=VISION, projection_hidden_size=VISION["hidden_size"], image_token_id=pad,
                            video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
                            tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "vision_tower" in n or "mm_projector" in n:
                p.normal_(0.0, 0.2) if p.dim() > 1 else p.normal_(1.0 if n.endswith("weight") else 0.0, 0.2)
            elif n.endswith("mlp.gate.weight"):  # the router from zeros: random, so routing matters
                p.normal_(0.0, 0.5)
    model.save_pretrained(folders["saved"])
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    config.architectures = ["Kimi_K25ForConditionalGeneration"]
    for layout, tensors in (("modules", state), ("release", release_names(state, VISION["num_attention_heads"]))):
        config.save_pretrained(folders[layout])
        save_file(tensors, str(folders[layout] / "model.safetensors"))
    # the release's config also names the tower's sizes and parts its own way and the architecture as its own code
    # does, and its processor settings are its own code's (media_proc_cfg)
    whole = json.loads((folders["release"] / "config.json").read_text())
    whole["vision_config"].update(RELEASE_VISION)
    whole["architectures"] = ["KimiK25ForConditionalGeneration"]
    (folders["release"] / "config.json").write_text(json.dumps(whole))
    (folders["release"] / "preprocessor_config.json").write_text(json.dumps(MEDIA))
    return folders, model


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[dict[str, Path], object]:
    return build_release(tmp_path_factory.mktemp("kimi_k25_images"))


def prompt_ids(folder: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]


def expanded(folder: Path, text: str = TEXT_BEFORE + PART + BETWEEN + PART + AFTER, pictures=None):
    """(our processor, the expanded prompt's ids, its MultiModalInputs)."""
    processor = kv.KimiK25ImageProcessor.from_pretrained(folder, read_config(str(folder)))
    ids, mm = expand_prompt(prompt_ids(folder, text), images() if pictures is None else pictures, processor)
    return processor, ids, mm


class PixelsOf:
    """A stand-in for transformers' torchvision-only ``Kimi_K25ImageProcessor`` (torchvision is not installed):
    our pixels (checked against transformers' by :func:`test_pixels_equal_transformers`), its attributes."""

    model_input_names = ["pixel_values", "image_grid_thw"]
    merge_size = 2

    def __init__(self, ours: kv.KimiK25ImageProcessor):
        self.ours = ours

    def fetch_images(self, images):
        return images

    def __call__(self, images, **kwargs):
        from transformers import BatchFeature

        made = [self.ours.pixels(image) for image in (images if isinstance(images, list) else [images])]
        return BatchFeature({"pixel_values": np.concatenate([m[0] for m in made]),
                             "image_grid_thw": np.concatenate([m[1] for m in made])}, tensor_type="pt")


def hf_processor(folder: Path):
    """transformers' ``Kimi_K25Processor`` (its prompt expansion) over the folder's tokenizer and :class:`PixelsOf`
    (the class checks of the stand-in and the absent video processor skipped)."""
    from transformers import AutoTokenizer, Kimi_K25Processor
    from transformers.processing_utils import ProcessorMixin

    ours = kv.KimiK25ImageProcessor.from_pretrained(folder, read_config(str(folder)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
        return Kimi_K25Processor(image_processor=PixelsOf(ours), tokenizer=AutoTokenizer.from_pretrained(str(folder)))


# ---- the processor and the encoder -----------------------------------------------------------------------------------

def test_processor_expands_as_transformers(release):
    """Our expanded prompt (``<|media_pad|>`` repeated h*w / merge² times in the image's part) equals
    ``Kimi_K25Processor``'s for one and for two images of different sizes; the grids are the ones expected."""
    folder = release[0]["modules"]
    theirs = hf_processor(folder)
    for text, pictures in ((TEXT_BEFORE + PART + AFTER, images()[1:]),
                           (TEXT_BEFORE + PART + BETWEEN + PART + AFTER, images())):
        want = theirs(text=[text], images=pictures, return_tensors="pt")
        _, ids, mm = expanded(folder, text, pictures)
        assert ids == want["input_ids"][0].tolist()
        assert [item.length for item in mm.items] == [int(g.prod()) // 4 for g in want["image_grid_thw"]]
        assert [item.data["image_grid_thw"].tolist()[0] for item in mm.items] == GRIDS[-len(pictures):]


def test_pixels_equal_transformers(release):
    """The pixels of an image kept (padded) and of one resized equal transformers' ``Kimi_K25ImageProcessor``'s
    (torchvision's uint8 bicubic antialiased resize) bit for bit: the recorded digests, made with torchvision 0.28."""
    _, _, mm = expanded(release[0]["modules"])
    got = [hashlib.sha256(np.ascontiguousarray(item.data["pixel_values"]).tobytes()).hexdigest() for item in mm.items]
    assert got == DIGESTS


# (height, width, max_patches, max side in patches) -> transformers' ``navit_resize`` ((resized), (padded)), recorded
# with torchvision importable: kept, budget-bound, side-bound and tiny images
NAVIT = {(90, 140, 48, 512): ((80, 125), (84, 140)), (13, 300, 48, 512): ((13, 300), (28, 308)),
         (333, 71, 48, 512): ((215, 45), (224, 56)), (999, 1000, 16384, 512): ((999, 1000), (1008, 1008)),
         (7000, 200, 16384, 512): ((7000, 200), (7000, 224)), (20000, 30, 16384, 512): ((7168, 10), (7168, 28)),
         (1, 1, 48, 512): ((1, 1), (28, 28)), (500, 700, 100, 9): ((90, 126), (112, 140)),
         (27, 29, 1, 512): ((19, 20), (28, 28))}


def test_sizes_equal_transformers():
    """Our resized and padded sizes equal transformers' ``navit_resize``'s (recorded: its module imports
    torchvision)."""
    for (h, w, budget, side), want in NAVIT.items():
        assert kv.navit_size(h, w, 14, 2, budget, side) == want


REFERENCE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer, Kimi_K25ImageProcessor, Kimi_K25Processor, Kimi_K25VideoProcessor
    folder, out, *sizes = sys.argv[1:]
    settings = json.load(open(f"{folder}/preprocessor_config.json"))
    settings.pop("image_processor_type")
    processor = Kimi_K25Processor(image_processor=Kimi_K25ImageProcessor(**settings),
                                  tokenizer=AutoTokenizer.from_pretrained(folder),
                                  video_processor=Kimi_K25VideoProcessor())
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in sizes]
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in shapes]
    text = sys.stdin.read()
    got = processor(text=[text], images=pictures, return_tensors="np")
    np.save(f"{out}/px.npy", got["pixel_values"])
    json.dump({"ids": got["input_ids"][0].tolist(), "grids": got["image_grid_thw"].tolist()},
              open(f"{out}/o.json", "w"))
""")


def test_pixels_equal_transformers_live(release, tmp_path):
    """Where torchvision imports (``KIMI_K25_TORCHVISION_PATH`` or ``LLAMA4_TORCHVISION_PATH`` may name a folder
    holding it), transformers' own processor over the two images gives our prompt and pixels."""
    env = private_env(TORCHVISION_PATHS, "torchvision", "transformers' Kimi_K25ImageProcessor")
    folder = release[0]["modules"]
    script = tmp_path / "reference.py"
    script.write_text(REFERENCE)
    text = TEXT_BEFORE + PART + BETWEEN + PART + AFTER
    subprocess.run([sys.executable, str(script), str(folder), str(tmp_path), *[f"{h}x{w}" for h, w in SIZES]],
                   env=env, check=True, capture_output=True, timeout=120, input=text.encode())
    want = json.loads((tmp_path / "o.json").read_text())
    _, ids, mm = expanded(folder, text)
    assert ids == want["ids"] and want["grids"] == GRIDS
    assert np.array_equal(np.concatenate([i.data["pixel_values"] for i in mm.items]), np.load(tmp_path / "px.npy"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_encoder_equals_transformers_image_features(release, layout):
    """Each image's embeddings [h*w / merge², text hidden] equal transformers' ``get_image_features``, the weights
    read under transformers' module names, the release's, or as transformers' ``save_pretrained`` writes them."""
    folders, hf = release
    _, _, mm = expanded(folders[layout])
    for item, ours in zip(mm.items, encoded(folders[layout], mm)):
        with torch.no_grad():
            out = hf.model.get_image_features(torch.from_numpy(item.data["pixel_values"]),
                                              torch.from_numpy(item.data["image_grid_thw"]))
        assert ours.shape == (item.length, TEXT["hidden_size"]) and max_diff(ours, out.pooler_output[0]) < TOL


def test_encoder_in_bfloat16(release):
    """Built in bfloat16 (as the engine builds it for a bf16 model), the encoder takes the float32 pixels and gives
    bfloat16 embeddings within 5% (relative, max over the image) of float32's."""
    folder = release[0]["release"]
    _, _, mm = expanded(folder)
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.bfloat16, "cpu")
    for item, want in zip(mm.items, encoded(folder, mm)):
        with torch.no_grad():
            got = encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()})
        assert got.dtype == torch.bfloat16 and max_diff(got.float(), want) < 5e-2 * want.abs().max()


# ---- the whole model -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_with_images_equal_transformers(release, schedule):
    """The text model (DeepSeek-V3's, as the engine loads the release's text part) with the images' embeddings gives
    transformers' whole model's logits over a prompt of two images and text, then more tokens: one prefill, or chunks
    splitting both images' spans and single decode steps."""
    folders, hf = release
    folder = folders["release"]
    _, ids, mm = expanded(folder)
    spans = [(item.offset, item.length) for item in mm.items]
    assert spans == [(16, 6), (36, 15)] and len(ids) == 71
    cuts = np.cumsum(SCHEDULES["chunked+decode"])
    assert all(any(o < c < o + n for c in cuts) for o, n in spans)  # each image's span split by a chunk
    ids = ids + GENERATED
    ours = image_logits(load_model(str(folder)), ids, mm, encoded(folder, mm), SCHEDULES[schedule])
    assert max_diff(ours, grid_reference(hf, ids, mm, token_types=False)) < TOL


# ---- each part matters -----------------------------------------------------------------------------------------------

def _rows_first(h, w, head_dim, theta, device):
    """The 2D RoPE's pairs the other way round (row, then column)."""
    cos, sin = ORIGINAL_ROPE(h, w, head_dim, theta, device)
    swap = lambda t: t.view(*t.shape[:-1], -1, 2).flip(-1).flatten(-2)  # noqa: E731
    return swap(cos), swap(sin)


def _halves(h, w, head_dim, theta, device):
    """GLM-4V's layout: all frequencies at the row first, then all at the column."""
    cos, sin = ORIGINAL_ROPE(h, w, head_dim, theta, device)
    back = lambda t: torch.cat((t[..., 1::2], t[..., 0::2]), dim=-1)  # noqa: E731
    return back(cos), back(sin)


def _column_major(x, h, w, kh, kw):
    """Each merge block's patches column-major."""
    return ORIGINAL_MERGE(x, h, w, kh, kw).view(-1, kh, kw, x.shape[-1]).transpose(1, 2).reshape(-1, kh * kw,
                                                                                                 x.shape[-1])


def _bilinear(self, h, w, interpolate=torch.nn.functional.interpolate,
              ours=kv.KimiK25ImageEncoder.position_embeddings):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "interpolate", lambda *a, **k: interpolate(*a, **{**k, "mode": "bilinear"}))
        return ours(self, h, w)


ORIGINAL_ROPE, ORIGINAL_MERGE = kv.vision_rope, kv.merge_blocks
PARTS = ["position table", "bicubic resampling", "vision rope", "rope pair order", "rope halves", "merge order",
         "projector pre_norm", "patch bias", "final norm", "release qk permutation"]


@pytest.mark.parametrize("part", PARTS)
def test_each_part_shows_in_the_logits(release, part, monkeypatch):
    """Each distinctive part switched off moves the logits (chunks and decode steps) away from transformers'."""
    folders, hf = release
    folder = folders["release"]
    if part == "position table":
        monkeypatch.setattr(kv.KimiK25ImageEncoder, "position_embeddings", lambda self, h, w: torch.zeros(()))
    elif part == "bicubic resampling":
        monkeypatch.setattr(kv.KimiK25ImageEncoder, "position_embeddings", _bilinear)
    elif part == "vision rope":
        monkeypatch.setattr(kv, "vision_rope", lambda h, w, d, theta, device: (torch.ones(h * w, 1, d // 2),
                                                                              torch.zeros(h * w, 1, d // 2)))
    elif part == "rope pair order":
        monkeypatch.setattr(kv, "vision_rope", _rows_first)
    elif part == "rope halves":
        monkeypatch.setattr(kv, "vision_rope", _halves)
    elif part == "merge order":
        monkeypatch.setattr(kv, "merge_blocks", _column_major)
    elif part == "release qk permutation":
        monkeypatch.setattr(kv, "release_qk_to_halves", lambda w, heads: w)
    _, ids, mm = expanded(folder)
    ids = ids + GENERATED
    edits = {"projector pre_norm": lambda e: setattr(e.mm_projector, "pre_norm", torch.nn.Identity()),
             "patch bias": lambda e: e.vision_tower.patch_embed.proj.bias.zero_(),
             "final norm": lambda e: setattr(e.vision_tower, "final_layernorm", torch.nn.Identity())}
    embeds = encoded(folder, mm, edits.get(part))
    ours = image_logits(load_model(str(folder)), ids, mm, embeds, SCHEDULES["chunked+decode"])
    assert max_diff(ours, grid_reference(hf, ids, mm, token_types=False)) > MOVED


# ---- refusals --------------------------------------------------------------------------------------------------------

REFUSED = {  # an edit of the whole config -> what the ValueError says
    "activation": (lambda c: setattr(c.vision_config, "hidden_act", "swish"),
                   r"vision_config\.hidden_act='swish' is not supported"),
    "vision rope": (lambda c: setattr(c.vision_config, "rope_parameters", {"rope_type": "default"}),
                    r"vision_config\.rope_parameters\.rope_type='default' is not supported"),
    "position table": (lambda c: setattr(c.vision_config, "pos_emb_width", 5),
                       r"vision_config\.pos_emb_height=4 differs from pos_emb_width=5"),
    "projection width": (lambda c: setattr(c, "projection_hidden_size", 64),
                         r"projection_hidden_size=64 differs from vision_config\.hidden_size=32"),
    "merge kernel": (lambda c: setattr(c.vision_config, "merge_kernel_size", [2]),
                     r"vision_config\.merge_kernel_size=\[2\] must be two positive ints"),
    "release width": (lambda c: setattr(c.vision_config, "vt_hidden_size", 1152),
                      r"vision_config\.vt_hidden_size=1152 \(the release's name\) differs from "
                      r"vision_config\.hidden_size=32"),
    "release merge": (lambda c: setattr(c.vision_config, "merge_type", "sd2"),
                      r"vision_config\.merge_type='sd2' is not supported"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_settings_are_refused(release, case):
    config = read_config(str(release[0]["modules"]))
    edit, message = REFUSED[case]
    edit(config)
    with pytest.raises(ValueError, match=message):
        kv.KimiK25ImageEncoder(config)


PROCESSOR_REFUSED = {
    "resample": ({"resample": 2}, r"resample=2 is not supported: only bicubic"),
    "do_resize": ({"do_resize": False}, r"do_resize=False is not supported"),
    "size": ({"size": {"max_height": 512, "max_width": 256}}, r"size=.* must hold max_height and max_width, equal"),
    "merge": ({"merge_size": 3}, r"merge_size=3 disagree with vision_config's patch_size=14, merge_kernel_size"),
    "fixed tokens": ({"media_proc_cfg": {"fixed_output_tokens": 64}}, r"media_proc_cfg\.fixed_output_tokens=64 is not"),
}


@pytest.mark.parametrize("case", sorted(PROCESSOR_REFUSED))
def test_unsupported_processor_settings_are_refused(release, case, tmp_path):
    folder = release[0]["modules"]
    change, message = PROCESSOR_REFUSED[case]
    settings = change if "media_proc_cfg" in change else {**PROCESSOR, **change}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match=message):
        kv.KimiK25ImageProcessor.from_pretrained(tmp_path, read_config(str(folder)))


def test_release_media_config_is_read(release):
    """The release's ``media_proc_cfg`` (its own processor's settings, the release folder's) gives the same prompt
    and pixels as transformers' keys for the same limits (the modules folder's)."""
    folders = release[0]
    ours, theirs = (kv.KimiK25ImageProcessor.from_pretrained(folders[layout], read_config(str(folders[layout])))
                    for layout in ("release", "modules"))
    assert json.loads((folders["release"] / "preprocessor_config.json").read_text()) == MEDIA
    for image in images():
        a, b = ours.process(image), theirs.process(image)
        assert a.replacement == b.replacement and all(np.array_equal(a.data[k], b.data[k]) for k in a.data)


def test_mismatches_are_refused(release):
    """An image whose pixels do not fit its grid, a checkpoint lacking a tensor of the projector, each a ValueError
    by name."""
    folder = release[0]["modules"]
    _, _, mm = expanded(folder)
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    data = {k: torch.from_numpy(v) for k, v in mm.items[0].data.items()}
    with pytest.raises(ValueError, match=r"image_grid_thw \(1, 4, 8\) does not fit"):
        encoder.encode({**data, "image_grid_thw": torch.tensor([[1, 4, 8]])})
    weights = [(n, t) for n, t in release[1].state_dict().items() if n != "model.mm_projector.in_proj.bias"]
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) .*\['model\.mm_projector\.in_proj\.bias'\]"):
        encoder.load_weights(weights)


# ---- tensor parallel -------------------------------------------------------------------------------------------------

def test_two_ranks_equal_one_rank(release, tmp_path):
    """Two tensor-parallel ranks (the text model's heads, experts and vocabulary split, the encoder whole on each)
    give one rank's logits with images: chunks splitting the images' spans, then decode steps."""
    folder = release[0]["release"]
    _, ids, mm = expanded(folder)
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids + GENERATED, mm, SCHEDULES["chunked+decode"])], 1, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
# a chat template of the release's shape for an image part: the placeholder inside its media tokens
TEMPLATE = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
            "{% if p.type == 'image' %}" + PART + "{% else %}{{ p.text }}{% endif %}"
            "{% endfor %}{% endif %}{% endfor %}")


def test_engine_greedy_with_images_equals_transformers(release):
    """``LLM.generate`` with two images (at most 20 tokens a step: the image prompt's chunks end inside its images'
    spans; n-gram drafts)
    gives transformers' greedy ``generate`` tokens, token for token, beside a text-only prompt in the same batch; some
    drafts are accepted; transformers without the images generates other tokens. ``LLM.chat`` with an image_url part
    (a data: URL) answers the same as the prompt it renders."""
    import base64
    import io

    from specray import LLM, SamplingParams

    folders, hf = release
    folder = folders["release"]
    text = TEXT_BEFORE + PART + BETWEEN + PART + AFTER
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=20,
              speculative_config=NGRAM)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf, hf_processor(folder), text, images())
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    buffer = io.BytesIO()
    images()[1].save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": TEXT_BEFORE},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": AFTER}]}]
    chat = llm.chat(messages, params, use_tqdm=False, chat_template=TEMPLATE)[0]
    alone = llm.generate({"prompt": TEXT_BEFORE + PART + AFTER, "multi_modal_data": {"image": images()[1]}},
                         params, use_tqdm=False)[0]
    assert list(chat.outputs[0].token_ids) == list(alone.outputs[0].token_ids)
