"""InternVL's images (``InternVLForConditionalGeneration``: :mod:`specray.models.internvl`), against transformers on
the same tiny random fp32 weights: our processor's expanded prompt (``<img>``, the context tokens of each tile,
``</img>``) and tiles equal ``InternVLProcessor``'s for two images of different aspect (3 and 5 tiles of GotOcr2's
dynamic tiling, thumbnails included); each image's embeddings equal ``get_image_features`` (max abs diff < 1e-4), read
from what transformers 5 saves and from its modules' names; the text model's logits with those embeddings on the
context rows (``meta.input_embeds``) equal transformers' whole model's for a prefill and for chunks that split the
images' spans; each distinctive part broken once moves the embeddings; what is not implemented is refused by name.
Two tiny models: InternViT with LayerNorms, q/k/v biases and mean pooling (no final norm) before a Qwen2 whose head is
tied (InternVL3's shape), and InternViT with RMSNorms, q/k RMSNorms and its final LayerNorm before an untied Qwen3
(InternVL3.5's text). The engine's greedy tokens with images (chunks splitting their spans, n-gram drafts) equal
transformers' ``generate``; two tensor-parallel ranks equal one. No GPU check here."""

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
from specray.models.internvl import InternVLImageEncoder, InternVLImageProcessor, pixel_shuffle, tokens_per_tile
from specray.models.kv_cache import allocate_kv_cache
from specray.models.loader import load_image_encoder, load_image_processor, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import assert_ranks_equal_one_rank, config_with, random_images  # tests/image_checks.py
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the embeddings or logits at least this much
TILE, PATCH, SEQ = 28, 7, 4  # a 4 x 4 patch grid, pixel-shuffled to 4 tokens a tile
PROMPT = "Look at <IMG_CONTEXT> and then at <IMG_CONTEXT>, the quick brown fox jumps"
SPECIAL = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
           "video_token": "<video>"}
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-5)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=TILE,
              patch_size=PATCH, layer_norm_eps=1e-6)
KINDS = {"v3": dict(vision=dict(norm_type="layer_norm", attention_bias=True, use_mean_pooling=True), tied=True),
         "v35": dict(vision=dict(norm_type="rms_norm", use_qk_norm=True, use_mean_pooling=False), tied=False)}


def _images() -> list:
    return random_images([(40, 64), (64, 48)], legacy=True)


def _visible(model) -> None:
    """Norm weights, layer scales, class token and position embeddings away from their init (ones, 0.1, zeros), the
    projector's and the text layers' weights at unit scale (a tied head then does not just repeat the last token),
    the tower's queries and keys large, so that every mistake shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            text_layer = name.startswith("model.language_model.layers.")
            if ("multi_modal_projector" in name or text_layer) and name.endswith(".weight") and param.dim() == 2:
                param.normal_(0.0, param.shape[1] ** -0.5)
            elif name.endswith(("lambda_1", "lambda_2")):
                param.uniform_(0.5, 1.5)
            elif name.endswith(("cls_token", "position_embeddings")):
                param.normal_(0.0, 1.0)
            elif "vision_tower" in name and name.endswith(("q_proj.weight", "k_proj.weight")):
                param.normal_(0.0, 3 * param.shape[1] ** -0.5)  # peaked attention: each token's part shows
            elif "vision_tower" in name and name.endswith("mlp.fc1.weight"):
                param.normal_(0.0, 2 * param.shape[1] ** -0.5)
            elif "norm" in name and name.endswith(".weight") and param.dim() == 1:
                param.uniform_(0.5, 1.5)
            elif "norm" in name and name.endswith(".bias"):
                param.normal_(0.0, 0.3)


def build_tiny_internvl(path: Path, kind: str, seed: int = 0) -> Path:
    """transformers' InternVLForConditionalGeneration of ``kind``, saved with conftest's tiny tokenizer (InternVL's
    image tokens among its special tokens, named as the releases' tokenizer_config.json names them) and GotOcr2's
    image processor (28-pixel tiles, up to 4 of them)."""
    from transformers import (GotOcr2ImageProcessorPil, InternVLConfig, InternVLForConditionalGeneration,
                              InternVLVisionConfig, Qwen2Config, Qwen3Config)

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=tuple(SPECIAL.values()))
    saved = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**saved, "extra_special_tokens": SPECIAL}))
    spec = KINDS[kind]
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    text = (Qwen2Config if kind == "v3" else Qwen3Config)(**ids, **TEXT, tie_word_embeddings=spec["tied"])
    config = InternVLConfig(text_config=text, vision_config=InternVLVisionConfig(**VISION, **spec["vision"]),
                            image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=SEQ,
                            tie_word_embeddings=spec["tied"])
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config).float().eval()
    _visible(model)
    model.save_pretrained(path)
    GotOcr2ImageProcessorPil(size={"height": TILE, "width": TILE}, max_patches=4).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_internvl(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_internvl")
    return {kind: build_tiny_internvl(root / kind, kind, seed) for seed, kind in enumerate(KINDS)}


@pytest.fixture(scope="module")
def hf_models(tiny_internvl) -> dict:
    from transformers import InternVLForConditionalGeneration

    return {kind: InternVLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
            for kind, folder in tiny_internvl.items()}


def hf_processor(folder: Path):
    """transformers' InternVLProcessor over the folder's image processor and tokenizer (its video processor needs
    torchvision, which is not installed: the class check of its absent video processor is skipped)."""
    from transformers import AutoImageProcessor, AutoTokenizer, InternVLProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class",
                      lambda self, name, arg: None if arg is None else check(self, name, arg))
        return InternVLProcessor(image_processor=AutoImageProcessor.from_pretrained(folder),
                                 tokenizer=AutoTokenizer.from_pretrained(folder), image_seq_length=SEQ)


def _hf_inputs(folder: Path, text: str = PROMPT) -> dict:
    return hf_processor(folder)(text=text, images=_images(), return_tensors="pt")


def _ours(folder: Path):
    config = read_config(str(folder))
    return (load_model(str(folder)), load_image_encoder(str(folder), config, torch.float32, "cpu"),
            load_image_processor(str(folder), config))


def _expand(folder: Path, processor):
    from transformers import AutoTokenizer

    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(PROMPT), _images(), processor)


# ---- the processor -------------------------------------------------------------------------------------------------

def test_processor_matches_transformers(tiny_internvl):
    """Two images of different aspect: our expanded prompt equals InternVLProcessor's (``<img>``, 4 context tokens a
    tile, ``</img>``; 3 and 5 tiles), each item's span is its image's, the context rows take the embeddings, its
    tiles equal transformers' pixel_values."""
    folder = tiny_internvl["v3"]
    config = read_config(str(folder))
    processor = load_image_processor(str(folder), config)
    assert isinstance(processor, InternVLImageProcessor) and processor.image_token_id == config.image_token_id
    want = _hf_inputs(folder)
    ids, mm = _expand(folder, processor)
    assert ids == want["input_ids"][0].tolist()
    assert [item.length for item in mm.items] == [3 * SEQ + 2, 5 * SEQ + 2] and mm.rope_positions is None
    tiles = 0
    for item in mm.items:
        span = ids[item.offset:item.end]
        assert span[0] == processor.start_id and span[-1] == processor.end_id
        assert [span[r] for r in item.embed_rows] == [config.image_token_id] * (item.length - 2)
        pixels = item.data["pixel_values"]
        assert np.array_equal(pixels, want["pixel_values"][tiles:tiles + len(pixels)].numpy())
        tiles += len(pixels)
    assert tiles == len(want["pixel_values"]) == 8


# ---- the encoder -----------------------------------------------------------------------------------------------------

def _hf_features(hf, inputs) -> torch.Tensor:
    with torch.no_grad():
        return hf.model.get_image_features(inputs["pixel_values"]).pooler_output.flatten(0, 1)


def _encode(encoder, folder: Path) -> torch.Tensor:
    """Our embeddings of both images, in prompt order: [tiles * SEQ, H]."""
    _, mm = _expand(folder, load_image_processor(str(folder)))
    with torch.no_grad():
        return torch.cat([encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()}) for item in mm.items])


def _as_modules(folder: Path, into: Path) -> Path:
    """``folder``'s checkpoint with transformers' modules' names (``model.vision_tower.``,
    ``model.multi_modal_projector.``, ``model.language_model.``, ``lm_head.``)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, into)
    renamed = {}
    for name, tensor in load_file(str(into / "model.safetensors")).items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model."):]
        elif name.startswith("language_model.lm_head."):
            name = name[len("language_model."):]
        else:
            name = "model." + name
        renamed[name] = tensor
    save_file(renamed, str(into / "model.safetensors"), metadata={"format": "pt"})
    return into


@pytest.mark.parametrize("kind,layout", [("v3", "saved"), ("v35", "saved"), ("v35", "modules")])
def test_encoder_matches_transformers(tiny_internvl, hf_models, tmp_path, kind, layout):
    """Each image's embeddings (all its tiles') equal transformers' ``get_image_features``, read from what
    transformers 5 saves and from its modules' names (then the text model's logits too)."""
    folder = tiny_internvl[kind] if layout == "saved" else _as_modules(tiny_internvl[kind], tmp_path / "modules")
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    assert isinstance(encoder, InternVLImageEncoder)
    assert (encoder.tower.layernorm is None) == (kind == "v3")  # mean pooling: no final norm
    got, want = _encode(encoder, folder), _hf_features(hf_models[kind], _hf_inputs(folder))
    assert got.shape == want.shape == (8 * SEQ, 64)
    assert max_diff(got, want) < TOL
    if layout == "modules":
        _logits_match(hf_models[kind], folder, [30, 100])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_earlier_feature_layer_matches_transformers(tiny_internvl, hf_models, kind):
    """``vision_feature_layer`` -2 (the first layer's raw output; the final norm unread): still transformers'."""
    folder = tiny_internvl[kind]
    config = read_config(str(folder))
    config.vision_feature_layer = -2
    encoder = InternVLImageEncoder(config)
    from specray.models.loader import iter_weights, resolve_model

    encoder.load_weights(iter_weights(resolve_model(str(folder))))
    assert len(encoder.tower.encoder.layer) == 1 and encoder.tower.layernorm is None
    inputs = _hf_inputs(folder)
    with torch.no_grad():
        want = hf_models[kind].model.get_image_features(inputs["pixel_values"], vision_feature_layer=-2)
    assert max_diff(_encode(encoder, folder), want.pooler_output.flatten(0, 1)) < TOL


def test_encoder_in_bfloat16(tiny_internvl, hf_models):
    """Built under bfloat16 the encoder lands within bf16's rounding of transformers' fp32 embeddings."""
    folder = tiny_internvl["v35"]
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.bfloat16, "cpu")
    assert {p.dtype for p in encoder.parameters()} == {torch.bfloat16}
    inputs = _hf_inputs(folder)
    with torch.no_grad():
        got = encoder.encode({"pixel_values": inputs["pixel_values"].to(torch.bfloat16)})
    want = _hf_features(hf_models["v35"], inputs)
    assert got.dtype == torch.bfloat16 and max_diff(got.float(), want) / want.abs().max().item() < 3e-2


def test_pixel_shuffle_order():
    """A 4 x 4 grid of channel-1 patches numbered row-major folds into four tokens, the 2 x 2 blocks row-major, each
    block's patches (r, c), (r, c + 1), (r + 1, c), (r + 1, c + 1): the order the encoder test checks against
    transformers', written out."""
    grid = torch.arange(16.0).reshape(1, 4, 4, 1)
    assert pixel_shuffle(grid, 2)[0].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]


# ---- the whole model -------------------------------------------------------------------------------------------------

@torch.no_grad()
def logits_with_images(model, ids: list[int], embeds: dict[int, torch.Tensor], sizes: list[int],
                       seed: int = 0) -> torch.Tensor:
    """``model``'s logits [L, V] of ``ids`` run in chunks of ``sizes`` (the last one cut to the prompt) over a paged
    cache of shuffled 4-token blocks, each chunk's image rows (``embeds``: prompt position -> embedding) handed in as
    ``meta.input_embeds``."""
    allocate_kv_cache(model, 64, 4)
    table = random.Random(seed).sample(range(64), -(-len(ids) // 4))
    out, start = [], 0
    for n in sizes:
        n = min(n, len(ids) - start)
        meta = build_attention_metadata([n], [start], [table], 4, model.device)
        rows = [p for p in range(start, start + n) if p in embeds]
        if rows:
            meta.input_embeds = (torch.tensor([p - start for p in rows]), torch.stack([embeds[p] for p in rows]))
        out.append(model.compute_logits(model(torch.tensor(ids[start:start + n]), meta)))
        start += n
    assert start == len(ids)
    return torch.cat(out)


def _embeds(encoder, mm) -> dict[int, torch.Tensor]:
    """Prompt position -> its image embedding (the context rows of every item)."""
    rows = {}
    for item in mm.items:
        with torch.no_grad():
            values = encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()})
        rows.update((item.offset + r, values[i]) for i, r in enumerate(item.embed_rows))
    return rows


def _logits_match(hf, folder: Path, sizes: list[int]) -> torch.Tensor:
    """Our logits of PROMPT with its two images equal transformers' whole model's; returns ours."""
    model, encoder, processor = _ours(folder)
    inputs = _hf_inputs(folder)
    ids, mm = _expand(folder, processor)
    assert ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        want = hf(**inputs).logits[0]
    got = logits_with_images(model, ids, _embeds(encoder, mm), sizes)
    assert max_diff(got, want) < TOL
    return got


# the images' spans are [7, 21) and [29, 51) of 69 tokens: chunks of 10 and 15 split the first, 20 the second, then
# single steps and the rest
SCHEDULES = {"prefill": [100], "chunked+decode": [10, 15, 20, 6] + [1] * 10 + [100]}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_with_images_match_transformers(tiny_internvl, hf_models, kind, schedule):
    """transformers' ``InternVLForConditionalGeneration(input_ids, pixel_values)`` logits == our text model's with the
    encoder's embeddings on the context rows, in one prefill and in chunks that split each image's span; without
    the embeddings they differ."""
    folder = tiny_internvl[kind]
    _, mm = _expand(folder, load_image_processor(str(folder)))
    assert [(i.offset, i.end) for i in mm.items] == [(7, 21), (29, 51)]
    got = _logits_match(hf_models[kind], folder, SCHEDULES[schedule])
    ids = _hf_inputs(folder)["input_ids"][0].tolist()
    plain = logits_with_images(load_model(str(folder)), ids, {}, [len(ids)])
    assert max_diff(plain[8:], got[8:]) > MOVED


# ---- each part shows -------------------------------------------------------------------------------------------------

def _no_layer_scale(encoder) -> None:
    for layer in encoder.tower.encoder.layer:
        layer.lambda_1.data.fill_(1.0)
        layer.lambda_2.data.fill_(1.0)


def _no_class_token(encoder) -> None:  # the patches alone through the tower
    embed, grid = encoder.tower.embed, encoder.tower.image_size // encoder.tower.patch
    encoder.tower.embed = lambda pixels: embed(pixels)[:, 1:]
    encoder.features = lambda pixels: pixel_shuffle(encoder.tower(pixels).reshape(len(pixels), grid, grid, -1),
                                                    encoder.fold)


def _no_positions(encoder) -> None:
    encoder.tower.embeddings.position_embeddings = None


def _no_qk_norm(encoder) -> None:
    for layer in encoder.tower.encoder.layer:
        layer.attention.q_norm = None


def _no_final_norm(encoder) -> None:
    encoder.tower.layernorm = None


def _shuffle_transposed(encoder) -> None:  # each 2 x 2 block's patches joined column-major
    grid = encoder.tower.image_size // encoder.tower.patch
    encoder.features = lambda pixels: pixel_shuffle(
        encoder.tower(pixels)[:, 1:].reshape(len(pixels), grid, grid, -1).transpose(1, 2), encoder.fold)


def _keep_class_token(encoder) -> None:  # the last patch dropped instead of the class token
    grid = encoder.tower.image_size // encoder.tower.patch
    encoder.features = lambda pixels: pixel_shuffle(
        encoder.tower(pixels)[:, :-1].reshape(len(pixels), grid, grid, -1), encoder.fold)


def _no_projector_norm(encoder) -> None:
    encoder.projector.layer_norm = torch.nn.Identity()


def _projector_relu(encoder) -> None:
    encoder.act = torch.relu


MUTATIONS = {"v3": ("no-layer-scale", "no-class-token", "no-positions", "shuffle-transposed", "keep-class-token",
                    "no-projector-norm", "projector-relu"),
             "v35": ("no-layer-scale", "no-qk-norm", "no-final-norm")}
BREAK = {"no-layer-scale": _no_layer_scale, "no-class-token": _no_class_token, "no-positions": _no_positions,
         "no-qk-norm": _no_qk_norm, "no-final-norm": _no_final_norm, "shuffle-transposed": _shuffle_transposed,
         "keep-class-token": _keep_class_token, "no-projector-norm": _no_projector_norm,
         "projector-relu": _projector_relu}


@pytest.mark.parametrize("kind,mutation", [(k, m) for k in sorted(MUTATIONS) for m in MUTATIONS[k]])
def test_each_part_shows_in_the_embeddings(tiny_internvl, hf_models, kind, mutation):
    """Each distinctive part switched off (or done the other way) moves the embeddings away from transformers'."""
    folder = tiny_internvl[kind]
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    BREAK[mutation](encoder)
    assert max_diff(_encode(encoder, folder), _hf_features(hf_models[kind], _hf_inputs(folder))) > MOVED


# ---- refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,words", [
    (dict(vision_config__model_type="siglip_vision_model"), "vision_config.model_type='siglip_vision_model'"),
    (dict(vision_feature_select_strategy="full"), "vision_feature_select_strategy='full'"),
    (dict(vision_feature_layer=[-1, -2]), "vision_feature_layer=[-1, -2]"),
    (dict(vision_feature_layer=3), "vision_feature_layer=3"),
    (dict(vision_config__norm_type="group_norm"), "vision_config.norm_type='group_norm'"),
    (dict(downsample_ratio=0.3), "downsample_ratio=0.3"),
    (dict(vision_config__image_size=[28, 21]), "vision_config.image_size=[28, 21]"),
    (dict(vision_config__hidden_act="swish_glu"), "vision_config.hidden_act='swish_glu'"),
    (dict(projector_hidden_act="swish_glu"), "projector_hidden_act='swish_glu'")])
def test_unsupported_settings_are_refused(tiny_internvl, change, words):
    with pytest.raises(ValueError) as err:
        InternVLImageEncoder(config_with(tiny_internvl["v3"], **change))
    assert words in str(err.value)


def test_mismatches_are_refused(tiny_internvl, tmp_path):
    """A processor_config.json whose image_seq_length disagrees with the tower's count, a checkpoint missing a tensor
    of the tower or the projector, and a tile at another size than the tower's are refused by name."""
    folder = shutil.copytree(tiny_internvl["v3"], tmp_path / "m")
    assert tokens_per_tile(read_config(str(folder))) == SEQ
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_length": 16}))
    with pytest.raises(ValueError, match="image_seq_length=16"):
        load_image_processor(str(folder))
    encoder = InternVLImageEncoder(read_config(str(folder)))
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    for gone in ("vision_tower.encoder.layer.1.lambda_2", "multi_modal_projector.layer_norm.bias"):
        with pytest.raises(ValueError, match=gone.split(".", 1)[1]):
            encoder.load_weights((n, t) for n, t in tensors.items() if n != gone)
    with pytest.raises(ValueError, match="vision_config.image_size=28"):
        encoder.encode({"pixel_values": torch.zeros(1, 3, 35, 35)})


# ---- tensor parallel -------------------------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(tiny_internvl, tmp_path):
    """Both text models split over two tensor-parallel ranks (the encoder replicated on each) give one rank's logits
    with the images' rows in place: PROMPT's, a prefill of 15 tokens ending inside the first image's span, then the
    rest."""
    runs = []
    for kind in sorted(KINDS):
        ids, mm = _expand(tiny_internvl[kind], load_image_processor(str(tiny_internvl[kind])))
        runs.append((tiny_internvl[kind], ids, mm, [15, len(ids) - 15]))
    assert_ranks_equal_one_rank(tmp_path, runs, 1, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_engine_greedy_with_images_equals_transformers(tiny_internvl, hf_models, kind):
    """``LLM.generate`` with two images (a chunked prefill of 12-token steps, which split both images' spans; n-gram
    drafts) gives transformers' greedy ``generate`` tokens, token for token, beside a text-only prompt in the same
    batch; some drafts are accepted; transformers without the images generates other tokens."""
    from specray import LLM

    folder = tiny_internvl[kind]
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=12,
              speculative_config=NGRAM)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf_models[kind], hf_processor(folder), PROMPT, _images())


# InternVL3's chat template's shape (ChatML; an image part renders "<IMG_CONTEXT>\n" before the text)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% for p in m.content %}"
                 "{% if p.type == 'image' %}<IMG_CONTEXT>\n{% elif p.type == 'text' %}{{ p.text }}{% endif %}"
                 "{% endfor %}<|im_end|>\n{% endfor %}{{ '<|im_start|>assistant\n' }}")


def test_chat_with_an_image_url_equals_transformers(tiny_internvl, hf_models):
    """LLM.chat with an image_url part (a PNG data: URL) in a template of InternVL3's shape gives transformers'
    greedy generate of the rendered prompt with that image, token for token."""
    import base64
    import io

    from specray import LLM, SamplingParams

    folder, image = tiny_internvl["v3"], _images()[0]
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is the quick brown fox?"}]}]
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16)
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False,
                   chat_template=CHAT_TEMPLATE)[0]
    text = "<|im_start|>user\n<IMG_CONTEXT>\nWhat is the quick brown fox?<|im_end|>\n<|im_start|>assistant\n"
    inputs = hf_processor(folder)(text=text, images=[image], return_tensors="pt")
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        want = hf_models["v3"].generate(**inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
    assert list(out.outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist()


def test_a_one_tile_image_has_no_thumbnail(tiny_internvl):
    """A square image makes one tile and no thumbnail (GotOcr2 adds one only beside several tiles): one tile's context
    tokens between ``<img>`` and ``</img>``, as InternVLProcessor writes them."""
    from PIL import Image

    folder = tiny_internvl["v3"]
    image = Image.fromarray(np.random.RandomState(1).randint(0, 255, (30, 30, 3), dtype=np.uint8))
    processor = load_image_processor(str(folder))
    done = processor.process(image)
    want = hf_processor(folder)(text="<IMG_CONTEXT>", images=[image], return_tensors="np")
    assert done.replacement == want["input_ids"][0].tolist() and len(done.replacement) == SEQ + 2
    assert np.array_equal(done.data["pixel_values"], want["pixel_values"])
