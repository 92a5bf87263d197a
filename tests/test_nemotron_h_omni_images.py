"""Nemotron 3 Nano Omni's images (``NemotronH_Omni_Reasoning_V3``: :mod:`specray.models.nemotron_h_omni_vision`),
against transformers on the same tiny random fp32 weights: our processor's expanded prompt (``<img>``, one ``<image>``
per merged token, ``</img>``) and patches equal transformers' (its image processor needs torchvision: compared live
where torchvision imports, ``NEMOTRON_OMNI_TORCHVISION_PATH`` may name a folder holding it, and always against the
grids, prompt ids and pixel sums recorded from it) for three images (resized up past the position table, resized to
an odd aspect, and one of exactly its grid, not resized); each image's embeddings equal ``get_image_features`` (max abs
diff < 1e-4), read as transformers saves the release (fused ``qkv``, ``mlp1``) and as its modules name them; the
Nemotron-H text model's logits with those rows (``meta.input_embeds``) equal transformers' whole model's over a prefill
and over chunks that split the images' spans (Mamba-2 states carried); each distinctive part broken once moves the
embeddings; what is not implemented is refused by name. Two tiny models: without, and with the final vision LayerNorm
(a text model with MTP layers). The engine's greedy tokens with images (chunks splitting their spans, n-gram drafts)
equal transformers' ``generate``; two tensor-parallel ranks equal one. No GPU check here."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models.attention import build_attention_metadata
from specray.models.gated_deltanet import RecurrentBatch
from specray.models.kv_cache import allocate_kv_cache, allocate_recurrent_state
from specray.models.loader import iter_weights, load_image_encoder, load_image_processor, load_model, read_config, \
    resolve_model
from specray.models.nemotron_h_omni_vision import NemotronHOmniImageEncoder, NemotronHOmniImageProcessor, patch_grid
from specray.multimodal import expand_prompt
from specray_test_image_checks import (private_env, assert_ranks_equal_one_rank, config_with,  # tests/image_checks.py
                                       random_images)
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the embeddings or logits at least this much
PROMPT = "Look at <image> and then at <image>, or <image>, the quick brown fox jumps"
SHAPES = ((28, 40, 3), (36, 20, 3), (32, 32, 3))
PATCH = 4
SETTINGS = {"image_processor_type": "NemotronH_Omni_Reasoning_V3ImageProcessor", "patch_size": PATCH,
            "downsample_ratio": 0.5, "min_num_patches": 16, "max_num_patches": 64, "max_model_len": 16384}
VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2.0, patch_size=PATCH,
              max_img_size=32, num_cls_tokens=2, num_registers=2, video_temporal_patch_size=2, layer_norm_eps=1e-6)
KINDS = {"plain": 0, "mtp": 1}  # the text model's num_nextn_predict_layers (1: the final vision LayerNorm is built)
# what transformers' processor (with torchvision 0.28) made of "A <image> B <image> C <image> D" and images():
# each image's grid and its pixels' sum, sum of magnitudes and sum weighted by sin(flat index) (an order check)
RECORDED_GRIDS = [(8, 8), (10, 6), (8, 8)]
RECORDED_SUMS = [(490.1521, 2010.7727, 1.1145), (502.0388, 2132.9755, -8.9112), (530.0389, 2880.1278, -51.0272)]
RECORDED_IDS = ([38, 226, 4] + [3] * 16 + [5, 226, 39, 226, 4] + [3] * 15 + [5, 226, 40, 226, 4] + [3] * 16
                + [5, 226, 41])


def images() -> list:
    return random_images(SHAPES, legacy=True)


def build_tiny_omni(path: Path, mtp: int, seed: int = 0) -> Path:
    """transformers' NemotronH_Omni_Reasoning_V3 (a C-RADIO tower of a 8 x 8 position table, a Nemotron-H text model
    of tests/hybrid_models.py), saved (transformers writes the release's names) with conftest's tiny tokenizer
    (``<image>``, ``<img>``, ``</img>`` among its special tokens) and the image processor's settings (written: its
    class needs torchvision)."""
    from transformers import RadioConfig
    from transformers.models.nemotron_h_omni.configuration_nemotron_h_omni import NemotronH_Omni_Reasoning_V3_Config
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    from tests.conftest import build_tiny_tokenizer
    from tests.hybrid_models import mamba_config

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=("<image>", "<img>", "</img>"))
    text = mamba_config("nemotron_h", vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id, num_nextn_predict_layers=mtp)
    config = NemotronH_Omni_Reasoning_V3_Config(
        vision_config=RadioConfig(**VISION).to_dict(), text_config=text.to_dict(), projector_hidden_size=48,
        vision_hidden_size=32, image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(seed)
    model = NemotronH_Omni_Reasoning_V3(config).float().eval()
    with torch.no_grad():  # norms, layer scales, prefix tokens, positions away from their init; unit-scale text
        for name, param in model.named_parameters():
            if name.endswith("lambda1") or ("norm" in name and name.endswith("weight")):
                param.uniform_(0.5, 1.5)
            elif "norm" in name and name.endswith("bias"):
                param.normal_(0.0, 0.3)
            elif name.endswith(("position_embedding", "cls_register_token")):
                param.normal_(0.0, 1.0 if name.endswith("position_embedding") else 4.0)
            elif "vision_model" in name and name.endswith(("q_proj.weight", "k_proj.weight")):
                param.normal_(0.0, 3 * param.shape[1] ** -0.5)  # peaked attention: each token's part shows
            elif ("multi_modal_projector" in name or "language_model" in name) and param.dim() == 2:
                param.normal_(0.0, param.shape[1] ** -0.5)
            elif name.endswith(("dt_bias", ".D")):
                param.normal_(0.0, 0.5)
        # the head a doubled copy of the embedding (as tests/hybrid_models.py's tied one): greedy decoding falls into
        # loops now and then, so n-gram drafts are accepted in some steps and rejected in others
        embedding = model.language_model.get_input_embeddings().weight
        embedding.mul_(2.0)
        model.language_model.lm_head.weight.copy_(embedding)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(SETTINGS))
    return path


@pytest.fixture(scope="module")
def tiny_omni(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_omni")
    return {kind: build_tiny_omni(root / kind, mtp, seed) for seed, (kind, mtp) in enumerate(KINDS.items())}


@pytest.fixture(scope="module")
def hf_models(tiny_omni) -> dict:
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    return {kind: NemotronH_Omni_Reasoning_V3.from_pretrained(folder, dtype=torch.float32).eval()
            for kind, folder in tiny_omni.items()}


def _expand(folder: Path, text: str = PROMPT, imgs: list | None = None):
    from transformers import AutoTokenizer

    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text), images() if imgs is None else imgs,
                         load_image_processor(str(folder)))


def hf_inputs(folder: Path, text: str = PROMPT, imgs: list | None = None) -> dict:
    """transformers' model inputs for ``text`` with its images: the expanded ids and our patches (transformers'
    processor needs torchvision; the processor tests show ours equal its), concatenated as its processor does."""
    ids, mm = _expand(folder, text, imgs)
    return {"input_ids": torch.tensor([ids]),
            "pixel_values": torch.from_numpy(np.concatenate([i.data["pixel_values"] for i in mm.items])),
            "image_grid_hw": torch.from_numpy(np.stack([i.data["image_grid_hw"] for i in mm.items]))}


# ---- the processor -------------------------------------------------------------------------------------------------

def test_processor_matches_recorded_transformers(tiny_omni):
    """Three images: the grids, prompt ids and pixels transformers' processor made (recorded with torchvision):
    an up-sized 28 x 40 (its 8 x 10 grid cut to the 64-patch budget), a 36 x 20 at 10 x 6 (9.5 rounds to 10), a
    32 x 32 of exactly its 8 x 8 grid (8.5 rounds to 8: not resized); each ``<image>`` becomes ``<img>``, one
    ``<image>`` per merged token, ``</img>``, the ``<image>`` rows taking the embeddings."""
    folder = tiny_omni["plain"]
    config = read_config(str(folder))
    ids, mm = _expand(folder, "A <image> B <image> C <image> D")
    processor = load_image_processor(str(folder))
    assert isinstance(processor, NemotronHOmniImageProcessor) and processor.image_token_id == config.image_token_id
    assert [tuple(i.data["image_grid_hw"].tolist()) for i in mm.items] == RECORDED_GRIDS
    for item, (total, magnitude, ordered), (rows, cols) in zip(mm.items, RECORDED_SUMS, RECORDED_GRIDS):
        pixels = item.data["pixel_values"].astype(np.float64)
        assert pixels.shape == (rows * cols, 3 * PATCH * PATCH) and item.data["pixel_values"].dtype == np.float32
        assert abs(pixels.sum() - total) < 1e-3 and abs(np.abs(pixels).sum() - magnitude) < 1e-3
        assert abs((pixels * np.sin(np.arange(pixels.size)).reshape(pixels.shape)).sum() - ordered) < 1e-3
        span = ids[item.offset:item.end]
        assert span[0] == processor.start_id and span[-1] == processor.end_id
        assert item.embed_rows == list(range(1, rows * cols // 4 + 1))
        assert [span[r] for r in item.embed_rows] == [config.image_token_id] * (rows * cols // 4)
    assert mm.rope_positions is None and ids == RECORDED_IDS


REFERENCE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer
    from transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3ImageProcessor as ImageProcessor)
    from transformers.models.nemotron_h_omni.processing_nemotron_h_omni import NemotronH_Omni_Reasoning_V3Processor
    from transformers.processing_utils import ProcessorMixin
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: None  # (no video processor)
    folder, out = sys.argv[1], sys.argv[2]
    settings = json.load(open(folder + "/preprocessor_config.json"))
    settings.pop("image_processor_type")
    rng = np.random.RandomState(0)
    imgs = [Image.fromarray(rng.randint(0, 255, s, dtype=np.uint8)) for s in %r]
    processor = NemotronH_Omni_Reasoning_V3Processor(image_processor=ImageProcessor(**settings),
                                                     tokenizer=AutoTokenizer.from_pretrained(folder))
    got = processor(text=["A <image> B <image> C <image> D"], images=imgs, return_tensors="pt")
    np.save(out + "/px.npy", got["pixel_values"].numpy())
    json.dump({"ids": got["input_ids"][0].tolist(), "grid": got["image_grid_hw"].tolist()}, open(out + "/o.json", "w"))
""" % (SHAPES,))


def test_processor_equals_transformers_live(tiny_omni, tmp_path):
    """Where torchvision imports (``NEMOTRON_OMNI_TORCHVISION_PATH`` may name a folder holding it), transformers'
    own processor over the three images gives our prompt ids and patches exactly."""
    env = private_env(["NEMOTRON_OMNI_TORCHVISION_PATH"], "torchvision", "transformers' Nemotron Omni image processor",
                      "the recorded grids, ids and sums")
    folder = tiny_omni["plain"]
    (tmp_path / "reference.py").write_text(REFERENCE)
    subprocess.run([sys.executable, str(tmp_path / "reference.py"), str(folder), str(tmp_path)], env=env, check=True,
                   capture_output=True, timeout=120)
    want = json.loads((tmp_path / "o.json").read_text())
    ids, mm = _expand(folder, "A <image> B <image> C <image> D")
    assert ids == want["ids"] and [list(i.data["image_grid_hw"]) for i in mm.items] == want["grid"]
    assert np.array_equal(np.concatenate([i.data["pixel_values"] for i in mm.items]), np.load(tmp_path / "px.npy"))


def test_patch_grid_follows_transformers():
    """The grid rule against transformers' own ``get_patch_grid_size`` (a torch-free function in a module that
    imports torchvision: compared where it imports) and its values written out: half-way sides round to even, the
    budget shrinks, the floor grows, odd sides round to the merge size (down past the budget, as transformers'
    does: the 8 x 300 image takes 96 patches)."""
    cases = [(28, 40, 16, 64), (36, 20, 16, 64), (32, 32, 16, 64), (8, 300, 16, 64), (4, 4, 16, 64), (64, 64, 4, 16),
             (1000, 30, 1024, 13312)]
    ours = [patch_grid(h, w, PATCH if most < 1000 else 16, 2, least, most) for h, w, least, most in cases]
    assert ours == [(8, 8), (10, 6), (8, 8), (2, 48), (4, 4), (4, 4), (180, 6)]  # (transformers' own values)
    try:
        from transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni import get_patch_grid_size
    except ImportError:  # (torchvision missing)
        return
    assert ours == [get_patch_grid_size(h, w, PATCH if most < 1000 else 16, 2, least, most)
                    for h, w, least, most in cases]


# ---- the encoder -----------------------------------------------------------------------------------------------------

def _hf_rows(hf, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(hf.get_image_features(inputs["pixel_values"], inputs["image_grid_hw"]).pooler_output)


def _encode(encoder, folder: Path) -> torch.Tensor:
    _, mm = _expand(folder)
    with torch.no_grad():
        return torch.cat([encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()}) for item in mm.items])


def _as_modules(folder: Path, into: Path) -> Path:
    """``folder``'s checkpoint with transformers' modules' names (``vision_model.embeddings.``, ``vision_model.
    encoder.layer.<i>.attention.{q,k,v,o}_proj``, ``multi_modal_projector.``, ``vision_final_layernorm.``), the layer
    scales left out (C-RADIO's checkpoints have none: transformers then starts them at ``layerscale_value``)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, into)
    out = {}
    names = (("vision_model.radio_model.model.patch_generator.embedder.", "vision_model.embeddings.patch_projection."),
             ("vision_model.radio_model.model.patch_generator.pos_embed", "vision_model.embeddings.position_embedding"),
             ("vision_model.radio_model.model.patch_generator.cls_token.token",
              "vision_model.embeddings.cls_register_token"),
             ("vision_model.radio_model.model.blocks.", "vision_model.encoder.layer."),
             ("attn.proj.", "attention.o_proj."),
             ("mlp1.0.", "multi_modal_projector.layer_norm."), ("mlp1.1.", "multi_modal_projector.linear_1."),
             ("mlp1.3.", "multi_modal_projector.linear_2."), ("vision_projector.vision_final_layernorm.",
                                                               "vision_final_layernorm."))
    for name, tensor in load_file(str(into / "model.safetensors")).items():
        if "layer_scale" in name:
            continue
        for theirs, mine in names:
            name = name.replace(theirs, mine)
        if ".attn.qkv." in name:
            for part, chunk in zip("qkv", tensor.chunk(3)):
                out[name.replace(".attn.qkv.", f".attention.{part}_proj.")] = chunk.clone()
            continue
        out[name] = tensor
    save_file(out, str(into / "model.safetensors"), metadata={"format": "pt"})
    return into


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_encoder_matches_transformers(tiny_omni, hf_models, kind):
    """Each image's embeddings (47 rows: 16, 15 and 16) equal transformers' ``get_image_features``; the final
    vision LayerNorm is built only beside MTP layers."""
    folder = tiny_omni[kind]
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    assert isinstance(encoder, NemotronHOmniImageEncoder) and (encoder.final_norm is None) == (kind == "plain")
    got, want = _encode(encoder, folder), _hf_rows(hf_models[kind], hf_inputs(folder))
    assert got.shape == want.shape == (47, 64)
    assert max_diff(got, want) < TOL


def test_encoder_reads_transformers_module_names(tiny_omni, tmp_path):
    """The checkpoint named as transformers' modules name it, layer scales absent: our embeddings equal
    transformers' loading that folder (its layer scales then 1, ``layerscale_value``)."""
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    folder = _as_modules(tiny_omni["mtp"], tmp_path / "modules")
    hf = NemotronH_Omni_Reasoning_V3.from_pretrained(folder, dtype=torch.float32).eval()
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    assert all(bool((layer.lambda_1 == 1).all()) for layer in encoder.tower.layers)
    assert max_diff(_encode(encoder, folder), _hf_rows(hf, hf_inputs(folder))) < TOL


def test_encoder_in_bfloat16(tiny_omni, hf_models):
    """Built under bfloat16 the encoder lands within bf16's rounding of transformers' fp32 embeddings."""
    folder = tiny_omni["mtp"]
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.bfloat16, "cpu")
    _, mm = _expand(folder)
    with torch.no_grad():
        got = torch.cat([encoder.encode({"pixel_values": torch.from_numpy(i.data["pixel_values"]).bfloat16(),
                                         "image_grid_hw": torch.from_numpy(i.data["image_grid_hw"])})
                         for i in mm.items])
    want = _hf_rows(hf_models["mtp"], hf_inputs(folder))
    assert got.dtype == torch.bfloat16 and max_diff(got.float(), want) / want.abs().max().item() < 3e-2


# ---- the whole model -------------------------------------------------------------------------------------------------

@torch.no_grad()
def logits_with_images(model, ids: list[int], rows: dict[int, torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """``model``'s logits [L, V] of ``ids`` in chunks of ``sizes`` (the last cut to the prompt) over a paged cache of
    shuffled blocks and a recurrent state slot, each chunk's image rows (prompt position -> embedding) handed in as
    ``meta.input_embeds``."""
    allocate_kv_cache(model, 64, 4)
    allocate_recurrent_state(model, 2, 4, torch.float32)
    table = random.Random(0).sample(range(64), -(-len(ids) // 4))
    out, start = [], 0
    for n in sizes:
        n = min(n, len(ids) - start)
        if n <= 0:
            break
        meta = build_attention_metadata([n], [start], [table], 4, "cpu")
        meta.recurrent = RecurrentBatch([1], [start == 0], [0], [0])
        mine = [p for p in range(start, start + n) if p in rows]
        if mine:
            meta.input_embeds = (torch.tensor([p - start for p in mine]), torch.stack([rows[p] for p in mine]))
        out.append(model.compute_logits(model(torch.tensor(ids[start:start + n]), meta)))
        start += n
    return torch.cat(out)


def image_rows(encoder, mm) -> dict[int, torch.Tensor]:
    rows = {}
    for item in mm.items:
        with torch.no_grad():
            values = encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()})
        rows.update((item.offset + r, values[i]) for i, r in enumerate(item.embed_rows))
    return rows


# the images' spans are [7, 25), [33, 50) and [54, 72) of 90 tokens: chunks of 10 and 26 split the first two, 20 the
# third, then single steps and the rest
SCHEDULES = {"prefill": [200], "chunked+decode": [10, 26, 20, 9] + [1] * 6 + [200]}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_with_images_match_transformers(tiny_omni, hf_models, kind, schedule):
    """transformers' ``NemotronH_Omni_Reasoning_V3(input_ids, pixel_values, image_grid_hw)`` logits == our
    Nemotron-H's with the encoder's rows in place, in one prefill and in chunks that split each image's span (the
    Mamba-2 states carried over); without the rows they differ."""
    folder = tiny_omni[kind]
    ids, mm = _expand(folder)
    assert [(i.offset, i.end) for i in mm.items] == [(7, 25), (33, 50), (54, 72)] and len(ids) == 90
    model = load_model(str(folder))
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    with torch.no_grad():
        want = hf_models[kind](**hf_inputs(folder)).logits[0]
    got = logits_with_images(model, ids, image_rows(encoder, mm), SCHEDULES[schedule])
    assert max_diff(got, want) < TOL
    plain = logits_with_images(model, ids, {}, [len(ids)])
    assert max_diff(plain[8:], got[8:]) > MOVED


# ---- each part shows -------------------------------------------------------------------------------------------------

def _no_layer_scale(encoder) -> None:
    for layer in encoder.tower.layers:
        layer.lambda_1.data.fill_(1.0)
        layer.lambda_2.data.fill_(1.0)


def _no_positions(encoder) -> None:
    encoder.tower.positions = lambda rows, cols, dtype: 0.0


def _positions_cropped(encoder) -> None:  # the table cropped (or zero-padded) to the grid, not resampled
    tower = encoder.tower

    def positions(rows, cols, dtype):
        table = tower.position_embedding.reshape(tower.side, tower.side, -1)
        padded = torch.zeros(max(rows, tower.side), max(cols, tower.side), table.shape[-1])
        padded[:tower.side, :tower.side] = table
        return padded[:rows, :cols].reshape(rows * cols, -1)

    tower.positions = positions


def _no_prefix_tokens(encoder) -> None:  # the patches attend among themselves only
    tower = encoder.tower
    tower.cls_register_token = torch.nn.Parameter(tower.cls_register_token[:0].clone())
    tower.num_prefix = 0


def _keep_prefix(encoder) -> None:  # the last patches dropped instead of the class and register tokens
    tower, forward = encoder.tower, encoder.tower.forward

    def keep(patches, rows, cols):
        tower.num_prefix = 0
        try:
            x = forward(patches, rows, cols)
        finally:
            tower.num_prefix = 4
        return x[:rows * cols]

    tower.forward = keep


def _no_final_norm(encoder) -> None:
    encoder.final_norm = None


def _shuffle_transposed(encoder) -> None:  # the grid's rows and columns swapped before the shuffle
    from specray.models.internvl import pixel_shuffle

    def features(patches, rows, cols):
        x = encoder.tower(patches, rows, cols)
        x = x if encoder.final_norm is None else encoder.final_norm(x)
        return pixel_shuffle(x.reshape(1, rows, cols, -1).transpose(1, 2).contiguous(), 2)[0]

    encoder.features = features


def _projector_relu(encoder) -> None:  # relu where the projector squares it
    p = encoder.projector
    encoder.project = lambda f: p.linear_2(torch.relu(p.linear_1(torch.nn.functional.rms_norm(
        f, f.shape[-1:], p.layer_norm.weight, 1e-5))))


def _no_projector_norm(encoder) -> None:
    p = encoder.projector
    encoder.project = lambda f: p.linear_2(torch.relu(p.linear_1(f)).square())


MUTATIONS = {"plain": ("no-layer-scale", "no-positions", "positions-cropped", "no-prefix-tokens", "keep-prefix",
                       "shuffle-transposed", "projector-relu", "no-projector-norm"),
             "mtp": ("no-final-norm",)}
BREAK = {"no-layer-scale": _no_layer_scale, "no-positions": _no_positions, "positions-cropped": _positions_cropped,
         "no-prefix-tokens": _no_prefix_tokens, "keep-prefix": _keep_prefix, "no-final-norm": _no_final_norm,
         "shuffle-transposed": _shuffle_transposed, "projector-relu": _projector_relu,
         "no-projector-norm": _no_projector_norm}


@pytest.mark.parametrize("kind,mutation", [(k, m) for k in sorted(MUTATIONS) for m in MUTATIONS[k]])
def test_each_part_shows_in_the_embeddings(tiny_omni, hf_models, kind, mutation):
    """Each distinctive part switched off (or done another way) moves the embeddings away from transformers'."""
    folder = tiny_omni[kind]
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    BREAK[mutation](encoder)
    assert max_diff(_encode(encoder, folder), _hf_rows(hf_models[kind], hf_inputs(folder))) > MOVED


# ---- refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,words", [
    (dict(vision_config__model_type="siglip_vision_model"), "vision_config.model_type='siglip_vision_model'"),
    (dict(vision_config__use_swiglu_ffn=True), "vision_config.use_swiglu_ffn=True"),
    (dict(vision_config__hidden_act="swish_glu"), "vision_config.hidden_act='swish_glu'"),
    (dict(downsample_ratio=0.25), "downsample_ratio=0.25"),
    (dict(vision_hidden_size=48), "vision_hidden_size=48")])
def test_unsupported_settings_are_refused(tiny_omni, change, words):
    with pytest.raises(ValueError) as err:
        NemotronHOmniImageEncoder(config_with(tiny_omni["plain"], **change))
    assert words in str(err.value)


def test_mismatches_are_refused(tiny_omni, tmp_path):
    """Processor settings that disagree with the model, another resampling, a checkpoint missing a tensor of the
    tower or the projector, and patches that do not fill their grid are refused by name."""
    folder = shutil.copytree(tiny_omni["plain"], tmp_path / "m")
    for change, words in ((dict(patch_size=8), "patch_size=8"), (dict(resample=2), "resample=2"),
                          (dict(downsample_ratio=0.25), "downsample_ratio=0.25")):
        (folder / "preprocessor_config.json").write_text(json.dumps({**SETTINGS, **change}))
        with pytest.raises(ValueError, match=words):
            load_image_processor(str(folder))
    config = read_config(str(folder))
    config.image_token_id = 7
    with pytest.raises(ValueError, match="image_token_id=7"):
        NemotronHOmniImageProcessor.from_pretrained(folder, config)
    encoder = NemotronHOmniImageEncoder(read_config(str(folder)))
    tensors = list(iter_weights(resolve_model(str(folder))))
    for gone, words in (("vision_model.radio_model.model.patch_generator.pos_embed", "tower.position_embedding"),
                        ("mlp1.1.weight", "projector.linear_1.weight")):
        with pytest.raises(ValueError, match=words):
            encoder.load_weights((n, t) for n, t in tensors if n != gone)
    with pytest.raises(ValueError, match=r"image_grid_hw=\(4, 6\)"):
        encoder.encode({"pixel_values": torch.zeros(16, 48), "image_grid_hw": torch.tensor([4, 6])})


# ---- tensor parallel -------------------------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(tiny_omni, tmp_path):
    """Both text models split over two tensor-parallel ranks (the encoder replicated on each; the Mamba-2 layers'
    state in a slot) give one rank's logits with the images' rows in place: PROMPT's, a prefill of 15 tokens ending
    inside the first image's span, then the rest."""
    runs = []
    for kind in sorted(KINDS):
        ids, mm = _expand(tiny_omni[kind])
        runs.append((tiny_omni[kind], ids, mm, [15, len(ids) - 15]))
    assert_ranks_equal_one_rank(tmp_path, runs, 1, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def test_engine_greedy_with_images_equals_transformers(tiny_omni, hf_models):
    """``LLM.generate`` with three images (prefill chunks of 12 tokens, which split their spans; n-gram drafts over a
    Mamba-2 hybrid) gives transformers' greedy ``generate`` tokens, token for token, beside a text-only prompt in the
    same batch; some drafts are accepted; transformers without the images generates other tokens."""
    from specray import LLM

    folder = tiny_omni["mtp"]
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=12,
              speculative_config=NGRAM)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py

    def processor(text, images, return_tensors):  # transformers' processor's output (its pixels: see above)
        return hf_inputs(folder, text[0], images)

    runs.assert_images_greedy_equals_transformers(llm, hf_models["mtp"], processor, PROMPT, images())
