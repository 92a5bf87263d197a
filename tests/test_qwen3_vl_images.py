"""Qwen3-VL's and Qwen3-VL-MoE's images (``specray.models.qwen3_vl_vision``): against transformers' whole
``Qwen3VLForConditionalGeneration`` / ``Qwen3VLMoeForConditionalGeneration`` on the same random tiny fp32 weights.
The processor's expanded prompt, pixels and grids equal transformers' ``Qwen3VLProcessor``'s for one and two images of
different sizes, and its multimodal RoPE positions equal Qwen3-VL's ``get_rope_index``; the learned position
table's taps and weights equal transformers' bit for bit; the encoder's embeddings and DeepStack features per image
equal transformers' (the table resampled to grids larger than it; ``deepstack_visual_indexes`` out of order); the
text model fed them (``meta.input_embeds``, ``meta.deepstack_embeds``) with those positions (interleaved sections)
gives transformers' logits over a prompt of two images with text between and after them, then more tokens: in one
prefill, and in chunks that split both images' spans followed by single decode steps; a text-only prompt runs as
plain RoPE. Two tensor-parallel ranks, and two pipeline stages, equal one; the engine's greedy tokens with images and
n-gram drafts equal transformers' ``generate``, and ``LLM.chat`` with an image_url part answers as its prompt does.
Each distinctive part broken once moves the logits; what is not served is refused by name (a pipeline split putting
a DeepStack layer past the first stage before any rank starts). The tiny releases are built here; on a CUDA device
the GPU's logits with images equal the CPU's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specray.models import llama, qwen3_vl_vision as q3
from specray.models.layers import mrope_axes
from specray.models.loader import load_image_encoder, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import (assert_expansion_equals_transformers,  # tests/image_checks.py
                                       assert_ranks_equal_one_rank, encoded, image_logits, random_images)
from specray_test_image_checks import grid_reference as reference
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
SPECIAL = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# the text models: Qwen3's layers (q/k norms), GQA, 16-wide heads whose 8 frequencies interleave the temporal, height
# and width positions (mrope_section [2, 3, 3]: height at 1, 4, 7, width at 2, 5); three layers, DeepStack after the
# first two
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
# the tower: 16-wide heads, 16-pixel patches, a 5 x 5 learned position table (resampled to grids of 4 x 6 and 6 x 8),
# DeepStack mergers after blocks 0 and 2 of 3 (block 1 between them)
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=16,
              num_position_embeddings=25, deepstack_visual_indexes=[2, 0], hidden_act="gelu_pytorch_tanh")
KINDS = ["qwen3_vl", "qwen3_vl_moe"]
# two images of different sizes, resized to 64 x 96 and 96 x 128 pixels: grids of 4 x 6 and 6 x 8 patches, 6 and 12
# tokens
SIZES = [(60, 100), (90, 140)]
TEXT_BEFORE, BETWEEN, AFTER = "Hello world!", " and then ", " The quick brown fox jumps."
GENERATED = [17, 42, 99, 75, 230, 61, 28, 150]  # tokens past the prompt (decode steps)
# a prefill; chunks that split both images' spans (tokens 10-15 and 24-35 of the 56-token prompt), then single steps
SCHEDULES = {"prefill": None, "chunked+decode": [12, 13, 6, 4]}
SPANS = [(10, 6), (24, 12)]  # each image's (offset, tokens) in the expanded prompt
PROMPT = 56


def images() -> list:
    return random_images(SIZES)


def build_release(kind: str, path: Path, seed: int) -> tuple[Path, object]:
    """transformers' whole ``kind`` model at :data:`TEXT` / :data:`VISION` sizes with random weights (every norm,
    bias and the tower's weights drawn away from their init so that each shows), saved with its processor (conftest's
    tiny tokenizer with the vision tokens, transformers' Qwen2-VL image processor at Qwen3-VL's settings)."""
    import transformers
    from transformers import Qwen2VLImageProcessorPil

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=SPECIAL)
    start, end, image, video = tok.convert_tokens_to_ids(list(SPECIAL))
    name = "Qwen3VL" if kind == "qwen3_vl" else "Qwen3VLMoe"
    text = {**TEXT, **(MOE if kind == "qwen3_vl_moe" else {}), "vocab_size": len(tok),
            "eos_token_id": tok.eos_token_id, "pad_token_id": None}
    config = getattr(transformers, f"{name}Config")(
        text_config=text, vision_config=VISION, image_token_id=image, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=False)
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
    Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(path)
    return path, model


def hf_processor(folder: Path):
    """transformers' ``Qwen3VLProcessor`` over the folder's image processor and tokenizer (its video processor needs
    torchvision, which is not installed: the class check of the absent one is skipped)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class",
                      lambda self, name, arg: None if arg is None else check(self, name, arg))
        return Qwen3VLProcessor(image_processor=AutoImageProcessor.from_pretrained(str(folder)),
                                tokenizer=AutoTokenizer.from_pretrained(str(folder)))


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    return {kind: build_release(kind, tmp_path_factory.mktemp(kind), seed) for seed, kind in enumerate(KINDS)}


PART = "<|vision_start|><|image_pad|><|vision_end|>"


def prompt_ids(folder: Path) -> list[int]:
    """The prompt's token ids with one placeholder per image (as a chat template renders image parts)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))(TEXT_BEFORE + PART + BETWEEN + PART + AFTER)["input_ids"]


def expanded(folder: Path):
    """(our processor, the expanded prompt's ids, its MultiModalInputs)."""
    processor = q3.Qwen3VLImageProcessor.from_pretrained(folder, read_config(str(folder)))
    ids, mm = expand_prompt(prompt_ids(folder), images(), processor)
    return processor, ids, mm


# ---- the processor and the encoder -----------------------------------------------------------------------------------

def test_processor_equals_transformers(releases):
    """Our expanded prompt (each placeholder repeated t*h*w / merge² times between the vision tokens), pixels and
    grids equal ``Qwen3VLProcessor``'s for one and for two images of different sizes; the multimodal RoPE positions
    equal Qwen3-VL's ``get_rope_index`` over the prompt and tokens past it (slot + delta there)."""
    folder, hf = releases["qwen3_vl"]
    theirs = hf_processor(folder)
    processor = q3.Qwen3VLImageProcessor.from_pretrained(folder, read_config(str(folder)))
    cases = [(TEXT_BEFORE + PART + AFTER, images()[1:]), (TEXT_BEFORE + PART + BETWEEN + PART + AFTER, images())]
    assert_expansion_equals_transformers(theirs, processor, cases, hf, GENERATED)


def test_position_taps_equal_transformers():
    """The learned position table's taps and weights per patch (merge-block order, frames repeated) equal, bit for
    bit, transformers' ``get_vision_interpolation_indices_and_weights`` (bilinear, aligned corners) for grids smaller
    and larger than the table, the releases' 48 x 48 among them."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights as theirs

    for side, t, h, w in ((5, 1, 4, 6), (5, 2, 2, 10), (5, 1, 8, 2), (48, 1, 34, 46), (48, 1, 96, 130)):
        want = theirs(torch.tensor([[t, h, w]]), side, mode="bilinear", align_corners=True, spatial_merge_size=2)
        got = q3.position_taps((t, h, w), 2, side, "cpu")
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (side, t, h, w)


@pytest.mark.parametrize("kind", KINDS)
def test_encoder_equals_transformers_image_features(releases, kind):
    """Each image's embeddings and DeepStack features [1 + 2, t*h*w / merge², text hidden] equal transformers'
    ``get_image_features`` (pooler output, then the deepstack features in ``deepstack_visual_indexes``' order)."""
    folder, hf = releases[kind]
    _, _, mm = expanded(folder)
    for item, ours in zip(mm.items, encoded(folder, mm)):
        with torch.no_grad():
            out = hf.model.get_image_features(torch.from_numpy(item.data["pixel_values"]),
                                              torch.from_numpy(item.data["image_grid_thw"]))
        theirs = torch.stack([out.pooler_output[0], *(f[0] for f in out.deepstack_features)])
        assert ours.shape == (3, item.length, TEXT["hidden_size"]) and max_diff(ours, theirs) < TOL


# ---- the whole model -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("kind", KINDS)
def test_logits_with_images_equal_transformers(releases, kind, schedule):
    """Our text model (the release's text part, as the engine loads it) with the images' embeddings, DeepStack
    features and interleaved multimodal RoPE positions gives transformers' whole model's logits over a prompt of two
    images and text, then more tokens: one prefill, or chunks splitting both images' spans and single decode steps."""
    folder, hf = releases[kind]
    _, ids, mm = expanded(folder)
    assert [(item.offset, item.length) for item in mm.items] == SPANS and len(ids) == PROMPT
    ids = ids + GENERATED
    model = load_model(str(folder))
    ours = image_logits(model, ids, mm, encoded(folder, mm), SCHEDULES[schedule])
    assert max_diff(ours, reference(hf, ids, mm)) < TOL


# ---- each part matters -----------------------------------------------------------------------------------------------

def _per_patch_norm(self, x, forward=q3.Qwen3VLMerger.forward):
    """A DeepStack merger's LayerNorm statistics over each patch rather than over the concatenated block."""
    if not self.post_shuffle:
        return forward(self, x)
    normed = torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=1e-6).reshape(-1, self.width)
    return self.linear_fc2(torch.nn.functional.gelu(self.linear_fc1(normed * self.norm.weight + self.norm.bias)))


def _no_rotation(grid, merge, head_dim, theta, device):
    n = grid[0] * grid[1] * grid[2]
    return torch.ones(n, 1, head_dim // 2, device=device), torch.zeros(n, 1, head_dim // 2, device=device)


def _nearest(index, size, side):
    src = (index.float() * (side - 1) / max(size - 1, 1)).round().long()
    return src[:, None].expand(-1, 2), torch.full((len(index), 2), 0.5)


def _one_layer_late(add=llama.add_deepstack):
    return lambda x, residual, i, meta, stage: add(x, residual, i - 1, meta, stage) if i else (x, residual)


# part -> how it is switched off
PARTS = ["interleaved sections", "deepstack", "deepstack order", "deepstack one layer late", "position table",
         "position interpolation", "patch bias", "post-shuffle norm", "vision rope"]


@pytest.mark.parametrize("part", PARTS)
def test_each_part_shows_in_the_logits(releases, part, monkeypatch):
    """Each distinctive part switched off moves the logits (chunks and decode steps) away from transformers'."""
    folder, hf = releases["qwen3_vl"]
    _, ids, mm = expanded(folder)
    ids = ids + GENERATED
    model = load_model(str(folder))
    if part == "interleaved sections":
        model.model.rotary_emb.mrope = mrope_axes({**model.model.rotary_emb.params, "mrope_interleaved": False}, 16)
    elif part == "deepstack one layer late":
        monkeypatch.setattr(llama, "add_deepstack", _one_layer_late())
    elif part == "position table":
        monkeypatch.setattr(q3.Qwen3VLImageEncoder, "position_embeddings",
                            lambda self, grid, dtype: torch.zeros((), dtype=dtype))
    elif part == "position interpolation":  # the nearest entry, not bilinear taps
        monkeypatch.setattr(q3, "_taps", _nearest)
    elif part == "post-shuffle norm":
        monkeypatch.setattr(q3.Qwen3VLMerger, "forward", _per_patch_norm)
    elif part == "vision rope":
        monkeypatch.setattr(q3, "vision_rope", _no_rotation)
    embeds = encoded(folder, mm, (lambda e: e.patch_embed.proj.bias.zero_()) if part == "patch bias" else None)
    if part == "deepstack":
        embeds = [e[:1] for e in embeds]
    elif part == "deepstack order":
        embeds = [e[[0, 2, 1]] for e in embeds]
    ours = image_logits(model, ids, mm, embeds, SCHEDULES["chunked+decode"])
    assert max_diff(ours, reference(hf, ids, mm)) > MOVED


@pytest.mark.parametrize("kind", KINDS)
def test_text_only_prompt_equals_transformers(releases, kind):
    """A prompt without images (no ``meta.rope_positions``, no DeepStack) runs as Qwen3's plain RoPE does, which is
    what transformers' whole model gives it: a prefill, and chunks then decode steps."""
    from specray_test_model_checks import SCHEDULES as TEXT_SCHEDULES, chunked_logits, prompt

    folder, hf = releases[kind]
    ids = [t if t != hf.config.image_token_id else 7 for t in prompt()]
    model = load_model(str(folder))
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    for sizes in TEXT_SCHEDULES.values():
        assert max_diff(chunked_logits(model, ids, sizes), want) < TOL


# ---- refusals --------------------------------------------------------------------------------------------------------

REFUSED = {  # an edit of the whole config -> what the ValueError says
    "not interleaved": (lambda c: c.text_config.rope_parameters.update(mrope_interleaved=False),
                        r"text_config\.rope_parameters\.mrope_interleaved=False: .* set mrope_interleaved: true"),
    "mrope sections": (lambda c: c.text_config.rope_parameters.update(mrope_section=[2, 3, 2]),
                       r"rope_parameters\.mrope_section=\[2, 3, 2\] must split the 8 rotated frequencies"),
    "two sections": (lambda c: c.text_config.rope_parameters.update(mrope_section=[4, 4]),
                     r"rope_parameters\.mrope_section=\[4, 4\] must have three sections"),
    "activation": (lambda c: setattr(c.vision_config, "hidden_act", "swish"),
                   r"vision_config\.hidden_act='swish' is not supported"),
    "vision rope": (lambda c: setattr(c.vision_config, "rope_parameters", {"rope_type": "default"}),
                    r"vision_config\.rope_parameters\.rope_type='default' is not supported"),
    "position table": (lambda c: setattr(c.vision_config, "num_position_embeddings", 24),
                       r"vision_config\.num_position_embeddings=24 is not a square"),
    "deepstack blocks": (lambda c: setattr(c.vision_config, "deepstack_visual_indexes", [0, 3]),
                         r"vision_config\.deepstack_visual_indexes=\[0, 3\] must name distinct blocks of the "
                         r"tower's depth=3"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_settings_are_refused(releases, case):
    folder, _ = releases["qwen3_vl"]
    config = read_config(str(folder))
    edit, message = REFUSED[case]
    edit(config)
    with pytest.raises(ValueError, match=message):
        q3.Qwen3VLImageEncoder(config)


def test_mismatches_are_refused(releases):
    """An image whose pixels do not fit its grid, a checkpoint lacking a tensor of the tower (a DeepStack merger's),
    each a ValueError by name."""
    folder, _ = releases["qwen3_vl"]
    _, _, mm = expanded(folder)
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    data = {k: torch.from_numpy(v) for k, v in mm.items[0].data.items()}
    with pytest.raises(ValueError, match=r"image_grid_thw \(1, 4, 8\) does not fit"):
        encoder.encode({**data, "image_grid_thw": torch.tensor([[1, 4, 8]])})
    weights = [(n, t) for n, t in encoder.state_dict().items() if n != "deepstack_merger_list.1.norm.bias"]
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) .*\['visual\.deepstack_merger_list\.1\.norm\.bias'\]"):
        encoder.load_weights([("model.visual." + n, t) for n, t in weights])


def test_deepstack_off_the_first_stage_is_refused_before_any_rank_starts(releases):
    """Three pipeline stages leave one of the three text layers on the first, which DeepStack's two need: the engine's
    builder refuses the split as it decides to serve images, before any rank starts (two stages, two layers on the
    first, pass; text alone passes any)."""
    from specray.config import EngineArgs
    from specray.engine.builder import serves_images

    folder, _ = releases["qwen3_vl"]
    config = read_config(str(folder))
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 leaves 1 of the text model's layers on the first "
                                         r"stage, but DeepStack adds image features after its first 2"):
        serves_images(EngineArgs(model=str(folder), pipeline_parallel_size=3), config)
    assert serves_images(EngineArgs(model=str(folder), pipeline_parallel_size=2), config)
    assert not serves_images(EngineArgs(model=str(folder), pipeline_parallel_size=3,
                                        limit_mm_per_prompt={"image": 0}), config)


# ---- tensor parallel and pipeline stages -----------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2])
def test_ranks_equal_one_rank(releases, tmp_path, stages):
    """Two tensor-parallel ranks (the text model's heads, MLP, experts and vocabulary split, the encoder whole on
    each), or two pipeline stages (the image rows and DeepStack features taken in on the first, which holds both
    DeepStack layers; the positions used on both), give one rank's logits with images: chunks splitting the images'
    spans, then decode steps."""
    runs = []
    for kind in KINDS:
        folder, _ = releases[kind]
        _, ids, mm = expanded(folder)
        runs.append((folder, ids + GENERATED, mm, SCHEDULES["chunked+decode"], {"first_stage_deepstack": True}))
    assert_ranks_equal_one_rank(tmp_path, runs, stages, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
# a chat template of the releases' shape for an image part: the placeholder between the vision tokens
TEMPLATE = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
            "{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p.text }}{% endif %}"
            "{% endfor %}{% endif %}{% endfor %}")


@pytest.mark.parametrize("kind", KINDS)
def test_engine_greedy_with_images_equals_transformers(releases, kind):
    """``LLM.generate`` with two images (prefill chunks of 16 tokens, which split both images' spans, DeepStack
    features taken in chunk by chunk; n-gram drafts verified with multimodal positions past the prompt) gives
    transformers' greedy ``generate`` tokens, token for token, beside a text-only prompt in the same batch; some drafts
    are accepted; transformers without the images generates other tokens. ``LLM.chat`` with an image_url part (a
    data: URL) answers the same as the prompt it renders."""
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
    if kind == "qwen3_vl":
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
    """fp32 on CUDA: the text model's logits without images, the encoder's embeddings and DeepStack features, and the
    text model's logits with them (chunks splitting the images, then decode steps) equal the CPU's."""
    from specray_test_model_checks import assert_logits_on_the_gpu_equal_the_cpu

    folder, _ = releases[kind]
    assert_logits_on_the_gpu_equal_the_cpu(folder, [12, 13, 6, 4])
    _, ids, mm = expanded(folder)
    ids = ids + GENERATED
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cuda")
    with torch.no_grad():
        gpu = [encoder.encode({k: torch.from_numpy(v).cuda() for k, v in item.data.items()}) for item in mm.items]
    cpu = encoded(folder, mm)
    assert all(max_diff(g.cpu(), c) < TOL for g, c in zip(gpu, cpu))
    sizes = SCHEDULES["chunked+decode"]
    want = image_logits(load_model(str(folder)), ids, mm, cpu, sizes)
    got = image_logits(load_model(str(folder), device="cuda"), ids, mm, gpu, sizes)
    assert max_diff(got.cpu(), want) < TOL
