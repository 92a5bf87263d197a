"""LLaVA's images (``LlavaForConditionalGeneration``: :mod:`specray.models.llava` over the CLIP and SigLIP towers of
:mod:`specray.models.vision_towers`), against transformers on the same tiny random fp32 weights: our processor's
expanded prompt and pixels equal ``LlavaProcessor``'s for two images of different sizes (CLIP's image processor,
LLaVA's padding one, SigLIP's); each image's embeddings equal ``get_image_features`` (max abs diff < 1e-4), read from
each of the checkpoint layouts (the releases', what transformers 5 saves, transformers' modules'); the text model's
logits with those embeddings in place of the placeholders (``meta.input_embeds``) equal transformers' whole model's
for a prefill and for chunks that split the images' spans; each distinctive part broken once moves the embeddings or
the logits; what is not implemented is refused by name. Two tiny models: a CLIP tower (its class token, pre-norm,
quick GELU; feature layer -2, the "default" strategy dropping the class token) before a Llama, and a SigLIP tower
(patch bias, no class token; feature layers [-1, 1] concatenated, the "full" strategy, a bias-free projector) before
a Qwen2 (also with its head tied to its embedding). The engine's greedy tokens with images (chunks splitting their
spans, n-gram drafts) equal transformers' ``generate``; two tensor-parallel ranks equal one. No GPU check here."""

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
from specray.models.kv_cache import allocate_kv_cache
from specray.models.llava import LlavaImageEncoder, LlavaImageProcessor, tokens_per_image
from specray.models.loader import (iter_weights, load_image_encoder, load_image_processor, load_model, read_config,
                                   resolve_model)
from specray.models.vision_towers import CLIP, VISION_ACTIVATIONS
from specray.multimodal import expand_prompt
from specray_test_image_checks import assert_ranks_equal_one_rank, config_with, random_images  # tests/image_checks.py
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the embeddings or logits at least this much (a hundred times TOL)
IMAGE_SIZE, PATCH = 56, 14  # 16 patches an image
PROMPT = "Look at <image> and then at <image>, the quick brown fox jumps"
# the CLIP model's text: 2 Llama layers, GQA; the SigLIP model's: 2 Qwen2 layers (q/k/v biases)
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-5)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              image_size=IMAGE_SIZE, patch_size=PATCH, layer_norm_eps=1e-5)
KINDS = {"clip": dict(vision_feature_layer=-2, vision_feature_select_strategy="default"),
         "siglip": dict(vision_feature_layer=[-1, 1], vision_feature_select_strategy="full",
                        multimodal_projector_bias=False, projector_hidden_act="gelu_pytorch_tanh")}


def _images() -> list:
    return random_images([(40, 64), (64, 48)], legacy=True)


def _visible(model) -> None:
    """LayerNorm weights and biases and the class embedding away from their init (ones, zeros), the projector's
    weights at unit scale (their init of 0.02 makes embeddings of 0.01, where every mistake looks small), the
    tower's MLP inputs spread over the range where the GELUs differ."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "multi_modal_projector" in name and name.endswith(".weight"):
                param.normal_(0.0, param.shape[1] ** -0.5)
            elif name.endswith("mlp.fc1.weight"):  # the tower's activations over a range where GELUs differ
                param.normal_(0.0, 2 * param.shape[1] ** -0.5)
            elif "norm" in name and name.endswith(".weight") and param.dim() == 1:
                param.uniform_(0.5, 1.5)
            elif "norm" in name and name.endswith(".bias"):
                param.normal_(0.0, 0.3)
            elif name.endswith(("class_embedding", "patch_embedding.bias")):
                param.normal_(0.0, 1.0)


def build_tiny_llava(path: Path, kind: str, seed: int = 0, tied: bool = False) -> Path:
    """transformers' LlavaForConditionalGeneration (a CLIP tower before a Llama, or a SigLIP tower before a Qwen2,
    ``tied``: its head tied to its embedding, as llava-interleave-qwen's), saved with conftest's tiny tokenizer
    (``<image>`` a special token) and ``LlavaProcessor`` (its image processor resizing to 56 x 56)."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor, Qwen2Config, SiglipImageProcessor,
                              SiglipVisionConfig)

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=("<image>",))
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    if kind == "clip":
        text, vision = LlamaConfig(**ids, **TEXT), CLIPVisionConfig(**VISION)
        images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                    crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    else:
        text, vision = Qwen2Config(**ids, **{**TEXT, "tie_word_embeddings": tied}), SiglipVisionConfig(**VISION)
        images = SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("<image>"),
                         tie_word_embeddings=tied, **KINDS[kind])
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).float().eval()
    _visible(model)
    model.save_pretrained(path)
    strategy = KINDS[kind]["vision_feature_select_strategy"]
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=PATCH, vision_feature_select_strategy=strategy,
                   num_additional_image_tokens=int(kind == "clip")).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_llava")
    return {kind: build_tiny_llava(root / kind, kind) for kind in KINDS}


@pytest.fixture(scope="module")
def hf_models(tiny_llava) -> dict:
    from transformers import LlavaForConditionalGeneration

    return {kind: LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
            for kind, folder in tiny_llava.items()}


def _hf_inputs(folder: Path, text: str = PROMPT) -> dict:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder)(text=text, images=_images(), return_tensors="pt")


def _ours(folder: Path):
    """Our text model, encoder and processor of ``folder`` (as the engine loads them)."""
    config = read_config(str(folder))
    return (load_model(str(folder)), load_image_encoder(str(folder), config, torch.float32, "cpu"),
            load_image_processor(str(folder), config))


# ---- the processor -------------------------------------------------------------------------------------------------

def _with_padding_processor(folder: Path, into: Path) -> Path:
    """``folder`` with LLaVA's own image processor (pads to a square before resizing) in its processor."""
    from transformers import AutoProcessor, LlavaImageProcessor

    shutil.copytree(folder, into)
    processor = AutoProcessor.from_pretrained(into)
    processor.image_processor = LlavaImageProcessor(size={"shortest_edge": IMAGE_SIZE}, do_pad=True,
                                                    crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor.save_pretrained(into)
    return into


@pytest.mark.parametrize("variant", ["clip", "siglip", "clip-padded"])
def test_processor_matches_transformers(tiny_llava, tmp_path, variant):
    """Two images of different sizes: our expanded prompt equals LlavaProcessor's (16 tokens an image: CLIP's 16
    patches + class token - 1 under "default", SigLIP's 16 under "full"), each item's span is its image's run of
    placeholders, its pixels equal transformers' pixel_values."""
    folder = tiny_llava[variant.split("-")[0]]
    if variant == "clip-padded":
        folder = _with_padding_processor(folder, tmp_path / "padded")
    config = read_config(str(folder))
    processor = load_image_processor(str(folder), config)
    assert isinstance(processor, LlavaImageProcessor) and processor.image_token_id == config.image_token_index
    assert type(processor.image_processor).__name__.startswith(
        {"clip": "CLIP", "siglip": "Siglip", "clip-padded": "Llava"}[variant])
    want = _hf_inputs(folder)
    from transformers import AutoTokenizer

    ids, mm = expand_prompt(AutoTokenizer.from_pretrained(folder).encode(PROMPT), _images(), processor)
    assert ids == want["input_ids"][0].tolist()
    assert [item.length for item in mm.items] == [16, 16] and mm.rope_positions is None
    for i, item in enumerate(mm.items):
        assert set(ids[item.offset:item.end]) == {processor.image_token_id} and item.embed_rows is None
        assert np.array_equal(item.data["pixel_values"], want["pixel_values"][i].numpy())
    assert mm.items[0].hash != mm.items[1].hash


def test_token_counts_follow_the_tower_and_the_strategy(tiny_llava):
    """CLIP's class token counts unless "default" drops it; SigLIP has none, and "default" drops its first patch."""
    config = read_config(str(tiny_llava["clip"]))
    assert tokens_per_image(config, 56, 56) == 16
    config.vision_feature_select_strategy = "full"
    assert tokens_per_image(config, 56, 56) == 17
    siglip = read_config(str(tiny_llava["siglip"]))
    assert tokens_per_image(siglip, 56, 56) == 16
    siglip.vision_feature_select_strategy = "default"
    assert tokens_per_image(siglip, 56, 56) == 15


# ---- the encoder -----------------------------------------------------------------------------------------------------

def _hf_features(hf, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(hf.model.get_image_features(inputs["pixel_values"]).pooler_output)


def _encode(encoder, pixel_values: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return [encoder.encode({"pixel_values": p}) for p in pixel_values]


def _relayout(folder: Path, into: Path, layout: str) -> Path:
    """``folder``'s checkpoint with its tensors renamed into ``layout``: "release" (llava-hf's: ``vision_tower.
    vision_model.``, ``language_model.model.``), "modules" (transformers' modules': ``model.vision_tower.``,
    ``model.multi_modal_projector.``, ``model.language_model.``, ``lm_head.``)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, into)
    tensors = load_file(str(into / "model.safetensors"))
    renamed = {}
    for name, tensor in tensors.items():
        if layout == "release":
            name = name.replace("vision_tower.", "vision_tower.vision_model.", 1)
        elif name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model."):]
        elif name.startswith("language_model.lm_head."):
            name = name[len("language_model."):]
        else:
            name = "model." + name
        renamed[name] = tensor
    save_file(renamed, str(into / "model.safetensors"), metadata={"format": "pt"})
    return into


@pytest.mark.parametrize("kind,layout", [("clip", "saved"), ("clip", "release"), ("clip", "modules"),
                                         ("siglip", "saved")])
def test_encoder_matches_transformers(tiny_llava, hf_models, tmp_path, kind, layout):
    """Each image's embeddings equal transformers' ``get_image_features`` (fp32), read from each checkpoint layout
    (transformers 5 saves ``vision_tower.*`` and ``language_model.model.*``); the tower is built only as deep as the
    deepest feature layer (-2 of CLIP's 3: two layers), SigLIP's 3 layers for -1."""
    folder = tiny_llava[kind] if layout == "saved" else _relayout(tiny_llava[kind], tmp_path / layout, layout)
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    assert isinstance(encoder, LlavaImageEncoder)
    assert len(encoder.tower.encoder.layers) == {"clip": 2, "siglip": 3}[kind]
    inputs = _hf_inputs(folder)
    got, want = _encode(encoder, inputs["pixel_values"]), _hf_features(hf_models[kind], inputs)
    assert [g.shape for g in got] == [w.shape for w in want] == [(16, 64)] * 2
    assert max(max_diff(g, w) for g, w in zip(got, want)) < TOL
    if layout == "modules":  # the text model too, from model.language_model.* and lm_head.*
        _logits_match(hf_models[kind], folder, [len(inputs["input_ids"][0])])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_encoder_in_bfloat16(tiny_llava, hf_models, kind):
    """Built under bfloat16 (as the engine builds it for a bf16 model; the runner hands it bf16 pixels), the encoder
    computes in bf16 (its norms in float32) and lands within bf16's rounding of transformers' fp32 embeddings."""
    folder = tiny_llava[kind]
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.bfloat16, "cpu")
    assert {p.dtype for p in encoder.parameters()} == {torch.bfloat16}
    inputs = _hf_inputs(folder)
    got = _encode(encoder, inputs["pixel_values"].to(torch.bfloat16))
    want = _hf_features(hf_models[kind], inputs)
    assert all(g.dtype == torch.bfloat16 for g in got)
    assert max(max_diff(g.float(), w) / w.abs().max().item() for g, w in zip(got, want)) < 3e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_encoder_on_the_gpu_equals_the_cpu(tiny_llava, kind):
    """fp32 on CUDA: each image's embeddings equal the CPU's (the patch embedding is one linear,
    ``vision_towers.patch_rows``: no cuDNN convolution taking TF32 products); a failure names the first module."""
    from specray_test_model_checks import first_module_divergence

    folder = tiny_llava[kind]
    pixels = _hf_inputs(folder)["pixel_values"]
    encoders = [load_image_encoder(str(folder), read_config(str(folder)), torch.float32, d) for d in ("cpu", "cuda")]

    def encode(encoder):
        return _encode(encoder, pixels.to(next(encoder.parameters()).device))

    diff = max(max_diff(g.cpu(), c) for g, c in zip(encode(encoders[1]), encode(encoders[0])))
    assert diff < 1e-4, (diff, first_module_divergence(*encoders, encode, 1e-4))


# ---- the whole model -------------------------------------------------------------------------------------------------

@torch.no_grad()
def logits_with_images(model, ids: list[int], embeds: dict[int, torch.Tensor], sizes: list[int],
                       seed: int = 0) -> torch.Tensor:
    """``model``'s logits [L, V] of ``ids`` run in chunks of ``sizes`` over a paged cache of shuffled 4-token blocks,
    each chunk's image rows (``embeds``: prompt position -> embedding) handed in as ``meta.input_embeds``."""
    allocate_kv_cache(model, 64, 4)
    table = random.Random(seed).sample(range(64), -(-len(ids) // 4))
    out, start = [], 0
    for n in sizes:
        meta = build_attention_metadata([n], [start], [table], 4, model.device)
        rows = [p for p in range(start, start + n) if p in embeds]
        if rows:
            meta.input_embeds = (torch.tensor([p - start for p in rows]), torch.stack([embeds[p] for p in rows]))
        out.append(model.compute_logits(model(torch.tensor(ids[start:start + n]), meta)))
        start += n
    assert start == len(ids)
    return torch.cat(out)


def _embeds(encoder, mm) -> dict[int, torch.Tensor]:
    """Prompt position -> its image embedding, for every item of ``mm``."""
    rows = {}
    for item in mm.items:
        with torch.no_grad():
            values = encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()})
        rows.update((item.offset + i, values[i]) for i in range(item.length))
    return rows


def _schedules(length: int) -> dict[str, list[int]]:
    # the images' spans are [7, 23) and [31, 47) of 65 tokens: chunks of 10 and 9 split the first, the next 16 hold its
    # end and the second's start, 26 the rest of the prompt, then single steps
    return {"prefill": [length], "chunked+decode": [10, 9, 16, length - 39] + [1] * 4}


def _logits_match(hf, folder: Path, sizes: list[int] | None = None) -> torch.Tensor:
    """Our logits of PROMPT with its two images equal transformers' whole model's; returns ours."""
    from transformers import AutoTokenizer

    model, encoder, processor = _ours(folder)
    inputs = _hf_inputs(folder)
    ids, mm = expand_prompt(AutoTokenizer.from_pretrained(folder).encode(PROMPT), _images(), processor)
    assert ids == inputs["input_ids"][0].tolist() and [i.offset for i in mm.items] == [7, 31]
    with torch.no_grad():
        want = hf(**inputs).logits[0]
    got = logits_with_images(model, ids, _embeds(encoder, mm), sizes or [len(ids)])
    assert max_diff(got, want) < TOL
    return got


@pytest.mark.parametrize("schedule", ["prefill", "chunked+decode"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_with_images_match_transformers(tiny_llava, hf_models, kind, schedule):
    """transformers' ``LlavaForConditionalGeneration(input_ids, pixel_values)`` logits == our text model's with the
    encoder's embeddings in place of the placeholders, in one prefill and in chunks that split each image's span;
    without the embeddings (the placeholders' own) they differ."""
    folder = tiny_llava[kind]
    length = len(_hf_inputs(folder)["input_ids"][0])
    got = _logits_match(hf_models[kind], folder, _schedules(length)[schedule])
    model = load_model(str(folder))
    inputs = _hf_inputs(folder)
    plain = logits_with_images(model, inputs["input_ids"][0].tolist(), {}, [length])
    assert max_diff(plain[3:], got[3:]) > MOVED


def test_a_tied_head_matches_transformers(tmp_path):
    """A release whose head is tied to its text embedding (tie_word_embeddings, llava-interleave-qwen's: no
    ``lm_head`` tensor saved): its logits with images equal transformers'."""
    from transformers import LlavaForConditionalGeneration

    folder = build_tiny_llava(tmp_path / "tied", "siglip", tied=True)
    assert not any("lm_head" in name for name, _ in iter_weights(resolve_model(str(folder))))
    hf = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    _logits_match(hf, folder)


# ---- each part shows -------------------------------------------------------------------------------------------------

def _no_class_token(encoder) -> None:
    encoder.tower.embeddings.class_embedding.data.zero_()


def _no_positions(encoder) -> None:
    encoder.tower.embeddings.position_embedding.weight.data.zero_()


def _no_pre_norm(encoder) -> None:
    encoder.tower.pre_layrnorm = torch.nn.Identity()


def _no_patch_bias(encoder) -> None:
    encoder.tower.embeddings.patch_embedding.bias = None


def _other_gelu_in_the_tower(encoder) -> None:  # CLIP's quick GELU as the exact GELU, SigLIP's tanh GELU as quick
    act = torch.nn.functional.gelu if encoder.tower.kind == CLIP else VISION_ACTIVATIONS["quick_gelu"]
    for layer in encoder.tower.encoder.layers:
        layer.mlp.act = act


def _one_layer_earlier(encoder) -> None:  # transformers' hidden-state index read one layer off
    encoder.indices = [i - 1 for i in encoder.indices]


def _swapped_feature_layers(encoder) -> None:  # [-1, 1] concatenated the other way round
    encoder.indices = encoder.indices[::-1]


def _drop_the_last_token(encoder) -> None:  # "default" dropping the last token, not the first (class token)
    encoder.features = lambda pixels: encoder.tower.hidden_states(pixels, encoder.indices)[0][:, :-1]


def _projector_relu(encoder) -> None:
    encoder.act = torch.relu


def _no_mutation(encoder) -> None:
    pass


MUTATIONS = {"clip": {"no-class-token": _no_class_token, "no-positions": _no_positions, "no-pre-norm": _no_pre_norm,
                      "other-gelu": _other_gelu_in_the_tower, "one-layer-earlier": _one_layer_earlier,
                      "drop-last-token": _drop_the_last_token, "projector-relu": _projector_relu},
             "siglip": {"no-positions": _no_positions, "no-patch-bias": _no_patch_bias,
                        "other-gelu": _other_gelu_in_the_tower, "swapped-feature-layers": _swapped_feature_layers,
                        "projector-relu": _projector_relu}}


@pytest.mark.parametrize("kind,mutation", [(k, m) for k in sorted(MUTATIONS) for m in sorted(MUTATIONS[k])])
def test_each_part_shows_in_the_embeddings(tiny_llava, hf_models, kind, mutation):
    """Each distinctive part switched off (or done the other way) moves the embeddings away from transformers'."""
    folder = tiny_llava[kind]
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    MUTATIONS[kind][mutation](encoder)
    inputs = _hf_inputs(folder)
    got, want = _encode(encoder, inputs["pixel_values"]), _hf_features(hf_models[kind], inputs)
    assert max(max_diff(g, w) for g, w in zip(got, want)) > MOVED


# ---- refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,words", [
    (dict(vision_config__model_type="qwen2_vl"), "vision_config.model_type='qwen2_vl'"),
    (dict(vision_feature_select_strategy="cls"), "vision_feature_select_strategy='cls'"),
    (dict(vision_feature_layer=3 + 1), "vision_feature_layer=4"),
    (dict(vision_feature_layer=[]), "vision_feature_layer=[]"),
    (dict(vision_config__hidden_act="swish_glu"), "vision_config.hidden_act='swish_glu'"),
    (dict(projector_hidden_act="swish_glu"), "projector_hidden_act='swish_glu'")])
def test_unsupported_settings_are_refused(tiny_llava, change, words):
    with pytest.raises(ValueError) as err:
        LlavaImageEncoder(config_with(tiny_llava["clip"], **change))
    assert words in str(err.value)


def test_mismatches_are_refused(tiny_llava, tmp_path):
    """A processor_config.json counting other tokens than the model embeds, a checkpoint missing a tensor of the
    tower or the projector, and an image at another size than the tower's are refused by name."""
    folder = shutil.copytree(tiny_llava["clip"], tmp_path / "m")
    saved = json.loads((folder / "processor_config.json").read_text())
    (folder / "processor_config.json").write_text(json.dumps({**saved, "num_additional_image_tokens": 0}))
    with pytest.raises(ValueError, match="num_additional_image_tokens=0"):
        load_image_processor(str(folder))
    encoder = LlavaImageEncoder(read_config(str(folder)))
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    for gone in ("vision_tower.encoder.layers.1.mlp.fc2.bias", "multi_modal_projector.linear_2.weight"):
        with pytest.raises(ValueError, match=gone.split(".", 1)[1]):
            encoder.load_weights((n, t) for n, t in tensors.items() if n != gone)
    with pytest.raises(ValueError, match="vision_config.image_size=56"):
        encoder.encode({"pixel_values": torch.zeros(3, 42, 42)})


# ---- tensor parallel -------------------------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(tiny_llava, tmp_path):
    """Both text models split over two tensor-parallel ranks (the encoder replicated on each) give one rank's logits
    with the images' rows in place: PROMPT's, a prefill of 30 tokens ending inside the first image's span, then the
    rest."""
    from transformers import AutoTokenizer

    runs = []
    for kind in sorted(KINDS):
        folder = tiny_llava[kind]
        ids, mm = expand_prompt(AutoTokenizer.from_pretrained(folder).encode(PROMPT), _images(),
                                load_image_processor(str(folder)))
        runs.append((folder, ids, mm, [30, len(ids) - 30]))
    assert_ranks_equal_one_rank(tmp_path, runs, 1, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_engine_greedy_with_images_equals_transformers(tiny_llava, hf_models, kind):
    """``LLM.generate`` with two images (a chunked prefill of 20-token steps, which split both images' spans; n-gram
    drafts) gives transformers' greedy ``generate`` tokens, token for token, beside a text-only prompt in the same
    batch; some drafts are accepted; transformers without the images generates other tokens."""
    from transformers import AutoProcessor

    from specray import LLM

    folder = tiny_llava[kind]
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=20,
              speculative_config=NGRAM)
    # a placeholder without its image, before any image built the processor (the config names the placeholder)
    with pytest.raises(ValueError, match="holds 1 image placeholder token.*but 0 image"):
        llm.generate({"prompt": "Look at <image> here"}, use_tqdm=False)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf_models[kind], AutoProcessor.from_pretrained(folder), PROMPT,
                                                  _images())
