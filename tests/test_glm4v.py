"""GLM-4.1V's and GLM-4.5V's text models and images (``specray.models.glm4v``): against transformers' whole
``Glm4vForConditionalGeneration`` / ``Glm4vMoeForConditionalGeneration`` on the same random tiny fp32 weights.
Text: the release's text part (GLM-4's class for GLM-4.1V, GLM-4.5's for GLM-4.5V, each on a view of the text config)
gives transformers' logits for a text-only prompt in a prefill and in chunks then decode steps. Images: the
processor's expanded prompt, pixels and grids equal ``Glm4vProcessor``'s for one and two images of different sizes, and
its multimodal RoPE positions equal ``get_rope_index``; the encoder's embeddings per image equal transformers' image
features (the learned position table resampled to grids larger and smaller than it); the text model fed them
(``meta.input_embeds``) with those positions (``meta.rope_positions``: GLM-4.1V's sections over interleaved pairs,
GLM-4.5V's over halves) gives transformers' logits over a prompt of two images with text between and after them,
then more tokens: in one prefill, and in chunks that split both images' spans followed by single decode steps. Two
tensor-parallel ranks equal one; the engine's greedy tokens with images and n-gram drafts equal transformers'
``generate``, and ``LLM.chat`` with an image_url part answers as its prompt does. Each distinctive part broken once
moves the logits; what is not served is refused by name. The tiny releases are built here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specray.models import glm4v as g4
from specray.models.layers import mrope_axes
from specray.models.loader import load_image_encoder, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import (assert_expansion_equals_transformers,  # tests/image_checks.py
                                       assert_ranks_equal_one_rank, encoded, image_logits, random_images)
from specray_test_image_checks import grid_reference as reference
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
SPECIAL = ("<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>",
           "<|video|>")
# the text models: 32-wide heads, half of each rotated (16 features, 8 frequencies), which multimodal RoPE splits
# 2 / 3 / 3 between the temporal, height and width positions; GLM-4.5V's experts after one dense layer
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "partial_rotary_factor": 0.5})
MOE = dict(head_dim=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
           first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True)
# the tower: 16-wide heads, 14-pixel patches, a 5 x 5 learned position table (resampled to grids of 4 x 6 and 6 x 10:
# fewer rows than it, and more)
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
              image_size=70, spatial_merge_size=2, temporal_patch_size=2, hidden_act="silu", attention_bias=True)
KINDS = ["glm4v", "glm4v_moe"]
# two images of different sizes, resized to 56 x 84 and 84 x 140 pixels: grids of 4 x 6 and 6 x 10 patches, 6 and 15
# tokens
SIZES = [(50, 80), (90, 140)]
TEXT_BEFORE, BETWEEN, AFTER = "Hello world!", " and then ", " The quick brown fox jumps."
GENERATED = [17, 42, 99, 75, 230, 61, 28, 150]  # tokens past the prompt (decode steps)
# a prefill; chunks that split both images' spans (tokens 10-15 and 24-38 of the 59-token prompt), then single steps
SCHEDULES = {"prefill": None, "chunked+decode": [12, 13, 6, 4]}
PART = "<|begin_of_image|><|image|><|end_of_image|>"


def images() -> list:
    return random_images(SIZES)


def build_release(kind: str, path: Path, seed: int) -> tuple[Path, object]:
    """transformers' whole ``kind`` model at :data:`TEXT` / :data:`VISION` sizes with random weights (norms, biases
    and the tower's weights drawn away from their init so that each shows), saved with its processor (conftest's tiny
    tokenizer with the vision tokens, transformers' GLM-4V image processor)."""
    import transformers
    from transformers import Glm4vImageProcessorPil

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=SPECIAL)
    start, end, image, vstart, vend, video = tok.convert_tokens_to_ids(list(SPECIAL))
    name = "Glm4v" if kind == "glm4v" else "Glm4vMoe"
    text = {**TEXT, **(MOE if kind == "glm4v_moe" else {}), "vocab_size": len(tok),
            "eos_token_id": tok.eos_token_id, "pad_token_id": None}
    config = getattr(transformers, f"{name}Config")(
        text_config=text, vision_config=VISION, image_token_id=image, video_token_id=video,
        image_start_token_id=start, image_end_token_id=end, video_start_token_id=vstart, video_end_token_id=vend,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "visual." in n:
                p.normal_(0.0, 0.2) if p.dim() > 1 else p.normal_(1.0 if n.endswith("weight") else 0.0, 0.2)
            elif n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    Glm4vImageProcessorPil(size={"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 2 * 64},
                           image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(path)
    return path, model


def hf_processor(folder: Path):
    """transformers' ``Glm4vProcessor`` over the folder's image processor and tokenizer (its video processor needs
    torchvision, which is not installed: the class check of the absent one is skipped)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Glm4vProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class",
                      lambda self, name, arg: None if arg is None else check(self, name, arg))
        return Glm4vProcessor(image_processor=AutoImageProcessor.from_pretrained(str(folder)),
                              tokenizer=AutoTokenizer.from_pretrained(str(folder)))


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    return {kind: build_release(kind, tmp_path_factory.mktemp(kind), seed) for seed, kind in enumerate(KINDS)}


def prompt_ids(folder: Path) -> list[int]:
    """The prompt's token ids with one placeholder per image (as the chat template renders image parts)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))(TEXT_BEFORE + PART + BETWEEN + PART + AFTER)["input_ids"]


def expanded(folder: Path):
    """(our processor, the expanded prompt's ids, its MultiModalInputs)."""
    processor = g4.Glm4vImageProcessor.from_pretrained(folder, read_config(str(folder)))
    ids, mm = expand_prompt(prompt_ids(folder), images(), processor)
    return processor, ids, mm


# ---- the text models -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_text_only_prompt_equals_transformers(releases, kind):
    """The release's text part (GLM-4's class, GLM-4.5's) gives transformers' whole model's logits for a prompt without
    images (no ``meta.rope_positions``): a prefill, and chunks then decode steps."""
    from specray_test_model_checks import SCHEDULES as TEXT_SCHEDULES, chunked_logits, prompt

    folder, hf = releases[kind]
    ids = [t if t != hf.config.image_token_id else 7 for t in prompt()]
    model = load_model(str(folder))
    assert type(model).__name__ == ("Glm4vTextForCausalLM" if kind == "glm4v" else "Glm4vMoeTextForCausalLM")
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    for sizes in TEXT_SCHEDULES.values():
        assert max_diff(chunked_logits(model, ids, sizes), want) < TOL


@pytest.mark.parametrize("kind", KINDS)
def test_sections_default_as_transformers(kind):
    """A text config naming no ``mrope_section`` (GLM-4V's text rotary takes [8, 12, 12] then) is read with
    transformers' default sections: a release-sized head (128 wide, half of it rotated: 32 frequencies)."""
    import importlib

    import transformers

    name = "Glm4vTextConfig" if kind == "glm4v" else "Glm4vMoeTextConfig"
    config = getattr(transformers, name)(hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5},
                                         **({"head_dim": 128} if kind == "glm4v_moe" else {}))
    modeling = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    rotary = getattr(modeling, "Glm4vTextRotaryEmbedding" if kind == "glm4v" else "Glm4vMoeTextRotaryEmbedding")(config)
    view = g4.text_view(config, "glm4" if kind == "glm4v" else "glm4_moe")
    assert view.rope_parameters["mrope_section"] == rotary.mrope_section == [8, 12, 12]
    assert view.model_type == ("glm4" if kind == "glm4v" else "glm4_moe")


# ---- the processor and the encoder -----------------------------------------------------------------------------------

def test_processor_equals_transformers(releases):
    """Our expanded prompt (``<|image|>`` repeated t*h*w / merge² times between the image tokens), pixels and grids
    equal ``Glm4vProcessor``'s for one and for two images of different sizes; the multimodal RoPE positions equal
    GLM-4V's ``get_rope_index`` over the prompt and tokens past it (slot + delta there)."""
    folder, hf = releases["glm4v"]
    theirs = hf_processor(folder)
    processor = g4.Glm4vImageProcessor.from_pretrained(folder, read_config(str(folder)))
    cases = [(TEXT_BEFORE + PART + AFTER, images()[1:]), (TEXT_BEFORE + PART + BETWEEN + PART + AFTER, images())]
    assert_expansion_equals_transformers(theirs, processor, cases, hf, GENERATED)


@pytest.mark.parametrize("kind", KINDS)
def test_encoder_equals_transformers_image_features(releases, kind):
    """Each image's embeddings [t*h*w / merge², text hidden] equal transformers' ``get_image_features``."""
    folder, hf = releases[kind]
    _, _, mm = expanded(folder)
    for item, ours in zip(mm.items, encoded(folder, mm)):
        with torch.no_grad():
            out = hf.model.get_image_features(torch.from_numpy(item.data["pixel_values"]),
                                              torch.from_numpy(item.data["image_grid_thw"]))
        assert ours.shape == (item.length, TEXT["hidden_size"]) and max_diff(ours, out.pooler_output[0]) < TOL


# ---- the whole model -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("kind", KINDS)
def test_logits_with_images_equal_transformers(releases, kind, schedule):
    """Our text model (the release's text part, as the engine loads it) with the images' embeddings and multimodal
    RoPE positions gives transformers' whole model's logits over a prompt of two images and text, then more tokens:
    one prefill, or chunks splitting both images' spans and single decode steps."""
    folder, hf = releases[kind]
    _, ids, mm = expanded(folder)
    assert [(item.offset, item.length) for item in mm.items] == [(10, 6), (24, 15)] and len(ids) == 59
    ids = ids + GENERATED
    ours = image_logits(load_model(str(folder)), ids, mm, encoded(folder, mm), SCHEDULES[schedule])
    assert max_diff(ours, reference(hf, ids, mm)) < TOL


# ---- each part matters -----------------------------------------------------------------------------------------------

def _no_rotation(grid, merge, head_dim, theta, device):
    n = grid[0] * grid[1] * grid[2]
    return torch.ones(n, 1, head_dim // 2, device=device), torch.zeros(n, 1, head_dim // 2, device=device)


def _bilinear(self, grid, dtype, sample=torch.nn.functional.grid_sample,
              ours=g4.Glm4vImageEncoder.position_embeddings):
    """The position table resampled bilinearly rather than bicubically."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "grid_sample", lambda *a, **k: sample(*a, **{**k, "mode": "bilinear"}))
        return ours(self, grid, dtype)


def _plain_positions(self, token_ids, items):
    """Every token at its slot on all three axes (plain RoPE's positions)."""
    return [list(range(len(token_ids)))] * 3, 0


# part -> how it is switched off (on GLM-4.1V's release; "halves" on GLM-4.5V's)
PARTS = ["mrope sections", "multimodal positions", "interleaved pairs", "halves", "position table",
         "bicubic resampling", "post-conv norm", "downsample bias", "merger norm", "vision rope", "patch bias"]


@pytest.mark.parametrize("part", PARTS)
def test_each_part_shows_in_the_logits(releases, part, monkeypatch):
    """Each distinctive part switched off moves the logits (chunks and decode steps) away from transformers'."""
    kind = "glm4v_moe" if part == "halves" else "glm4v"
    folder, hf = releases[kind]
    if part == "multimodal positions":
        monkeypatch.setattr(g4.Glm4vImageProcessor, "rope_positions", _plain_positions)
    _, ids, mm = expanded(folder)
    ids = ids + GENERATED
    model = load_model(str(folder))
    attn = [layer.self_attn for layer in model.model.layers]
    if part == "mrope sections":  # Qwen3-VL's interleaved sections instead of contiguous ones
        model.model.rotary_emb.mrope = mrope_axes({**model.model.rotary_emb.params, "mrope_interleaved": True}, 16)
    elif part in ("interleaved pairs", "halves"):
        for a in attn:
            a.interleaved_rope = not a.interleaved_rope
    elif part == "position table":
        monkeypatch.setattr(g4.Glm4vImageEncoder, "position_embeddings",
                            lambda self, grid, dtype: torch.zeros((), dtype=dtype))
    elif part == "bicubic resampling":
        monkeypatch.setattr(g4.Glm4vImageEncoder, "position_embeddings", _bilinear)
    elif part == "vision rope":
        monkeypatch.setattr(g4, "vision_rope", _no_rotation)
    edits = {"post-conv norm": lambda e: setattr(e, "post_conv_layernorm", torch.nn.Identity()),
             "downsample bias": lambda e: e.downsample.bias.zero_(),
             "merger norm": lambda e: setattr(e.merger, "post_projection_norm", torch.nn.Identity()),
             "patch bias": lambda e: e.patch_embed.proj.bias.zero_()}
    embeds = encoded(folder, mm, edits.get(part))
    ours = image_logits(model, ids, mm, embeds, SCHEDULES["chunked+decode"])
    assert max_diff(ours, reference(hf, ids, mm)) > MOVED


# ---- refusals --------------------------------------------------------------------------------------------------------

REFUSED = {  # an edit of the whole config -> what the ValueError says
    "interleaved sections": (lambda c: c.text_config.rope_parameters.update(mrope_interleaved=True),
                             r"text_config\.rope_parameters\.mrope_interleaved=True is not supported"),
    "mrope sections": (lambda c: c.text_config.rope_parameters.update(mrope_section=[2, 3, 2]),
                       r"rope_parameters\.mrope_section=\[2, 3, 2\] must split the 8 rotated frequencies"),
    "head_dim": (lambda c: setattr(c.text_config, "head_dim", 16),
                 r"text_config\.head_dim=16 differs from hidden_size / num_attention_heads = 32"),
    "activation": (lambda c: setattr(c.vision_config, "hidden_act", "swish"),
                   r"vision_config\.hidden_act='swish' is not supported"),
    "vision rope": (lambda c: setattr(c.vision_config, "rope_parameters", {"rope_type": "default"}),
                    r"vision_config\.rope_parameters\.rope_type='default' is not supported"),
    "position table": (lambda c: setattr(c.vision_config, "image_size", 72),
                       r"vision_config\.image_size=72 must be a whole number of patch_size=14"),
    "output width": (lambda c: setattr(c.vision_config, "out_hidden_size", 32),
                     r"vision_config\.out_hidden_size=32 differs from text_config\.hidden_size=64"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_settings_are_refused(releases, case):
    folder, _ = releases["glm4v"]
    config = read_config(str(folder))
    edit, message = REFUSED[case]
    edit(config)
    with pytest.raises(ValueError, match=message):
        g4.Glm4vImageEncoder(config)


def test_mismatches_are_refused(releases):
    """An image whose pixels do not fit its grid, a checkpoint lacking a tensor of the tower (the downsample's bias),
    each a ValueError by name."""
    folder, _ = releases["glm4v"]
    _, _, mm = expanded(folder)
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    data = {k: torch.from_numpy(v) for k, v in mm.items[0].data.items()}
    with pytest.raises(ValueError, match=r"image_grid_thw \(1, 4, 8\) does not fit"):
        encoder.encode({**data, "image_grid_thw": torch.tensor([[1, 4, 8]])})
    weights = [(n, t) for n, t in encoder.state_dict().items() if n != "downsample.bias"]
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) .*\['visual\.downsample\.bias'\]"):
        encoder.load_weights([("model.visual." + n, t) for n, t in weights])


# ---- tensor parallel and pipeline stages -----------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2])
def test_ranks_equal_one_rank(releases, tmp_path, stages):
    """Two tensor-parallel ranks (the text model's heads, MLP, experts and vocabulary split, the encoder whole on
    each), or two pipeline stages (the image rows taken in on the first, the positions used on both), give one rank's
    logits with images: chunks splitting the images' spans, then decode steps."""
    runs = []
    for kind in KINDS:
        folder, _ = releases[kind]
        _, ids, mm = expanded(folder)
        runs.append((folder, ids + GENERATED, mm, SCHEDULES["chunked+decode"]))
    assert_ranks_equal_one_rank(tmp_path, runs, stages, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
# a chat template of the releases' shape for an image part: the placeholder between the image tokens
TEMPLATE = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
            "{% if p.type == 'image' %}<|begin_of_image|><|image|><|end_of_image|>{% else %}{{ p.text }}{% endif %}"
            "{% endfor %}{% endif %}{% endfor %}")


@pytest.mark.parametrize("kind", KINDS)
def test_engine_greedy_with_images_equals_transformers(releases, kind):
    """``LLM.generate`` with two images (prefill chunks of 16 tokens, which split both images' spans; n-gram drafts
    verified with multimodal positions past the prompt) gives transformers' greedy ``generate`` tokens, token for
    token, beside a text-only prompt in the same batch; some drafts are accepted; transformers without the images
    generates other tokens. ``LLM.chat`` with an image_url part (a data: URL) answers the same as the prompt it
    renders."""
    import base64
    import io

    from specray import LLM, SamplingParams

    folder, hf = releases[kind]
    text, plain_text = TEXT_BEFORE + PART + BETWEEN + PART + AFTER, "The quick brown fox"
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16,
              speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf, hf_processor(folder), text, images(), plain_text)
    if kind == "glm4v":
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


# ---- the GPU ---------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_images_on_the_gpu_equal_the_cpu(releases, kind):
    """fp32 on CUDA: the text model's logits without images, the encoder's embeddings, and the text model's logits
    with them (chunks splitting the images, then decode steps) equal the CPU's."""
    from specray_test_model_checks import assert_logits_on_the_gpu_equal_the_cpu, first_module_divergence

    folder, _ = releases[kind]
    assert_logits_on_the_gpu_equal_the_cpu(folder, [12, 13, 6, 4])
    _, ids, mm = expanded(folder)
    ids = ids + GENERATED
    encoders = [load_image_encoder(str(folder), read_config(str(folder)), torch.float32, d) for d in ("cpu", "cuda")]

    def encode(encoder):  # each item's rows, on the encoder's device
        device = next(encoder.parameters()).device
        return [encoder.encode({k: torch.from_numpy(v).to(device) for k, v in item.data.items()}) for item in mm.items]

    with torch.no_grad():
        gpu = encode(encoders[1])
    cpu = encoded(folder, mm)
    diffs = [max_diff(g.cpu(), c) for g, c in zip(gpu, cpu)]
    assert max(diffs) < TOL, (diffs, first_module_divergence(*encoders, encode, TOL))
    sizes = SCHEDULES["chunked+decode"]
    want = image_logits(load_model(str(folder)), ids, mm, cpu, sizes)
    got = image_logits(load_model(str(folder), device="cuda"), ids, mm, gpu, sizes)
    assert max_diff(got.cpu(), want) < TOL, max_diff(got.cpu(), want)
