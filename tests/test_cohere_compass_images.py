"""Cohere Compass's images (``specray.models.cohere_compass_vision``): against transformers' whole
``CohereCompassForConditionalGeneration`` on the same random tiny fp32 weights. The processor's expanded prompt, pixels
and grids equal transformers' ``CohereCompassProcessor``'s (``<|IMAGE_PAD|>`` between ``<|VISION_START|>`` and
``<|VISION_END|>``) for one and two images of different sizes, and its multimodal RoPE positions equal the release's
``get_rope_index``; the encoder's embeddings and DeepStack features per image equal transformers' (Qwen3-VL's tower);
the Compass text model (Command R7B's parallel layers: two sliding layers rotated by one RoPE and its sections, a
global layer by YaRN over another base and other sections) fed them (``meta.input_embeds``, ``meta.deepstack_embeds``)
with those positions (``meta.rope_positions``) gives transformers' logits over a prompt of two images with text between
and after them, then more tokens: in one prefill, and in chunks that split both images' spans followed by single
decode steps. Two tensor-parallel ranks, and two pipeline stages, equal one; the engine's greedy tokens with images
and n-gram drafts equal transformers' ``generate``. Each distinctive part broken once moves the logits; what is not
served is refused by name. The tiny release is built here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specray.models import cohere_compass_vision as cv, llama
from specray.models.layers import mrope_axes
from specray.models.loader import load_image_encoder, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import (assert_expansion_equals_transformers,  # tests/image_checks.py
                                       assert_ranks_equal_one_rank, encoded, image_logits, random_images,
                                       rope_table)
from specray_test_image_checks import grid_reference as reference
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
SPECIAL = ("<|VISION_START|>", "<|VISION_END|>", "<|IMAGE_PAD|>", "<|VIDEO_PAD|>")
SLIDING, FULL = "sliding_attention", "full_attention"
# the text model: 16-wide heads (8 frequencies); the sliding layers' sections [2, 3, 3] (height at 1, 4, 7, width at
# 2, 5), the global layer's [4, 0, 4] (no height, width at 2, 5) by YaRN over another base; DeepStack after the first
# two of three layers (sliding, global, sliding over 8 tokens); biases, logits scaled by 0.25
PLAIN = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
YARN = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mrope_section": [4, 0, 4]}
TEXT = dict(model_type="cohere_compass_text", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, layer_norm_eps=1e-5,
            initializer_range=0.1, sliding_window=8, layer_types=[SLIDING, FULL, SLIDING],
            rope_parameters={SLIDING: PLAIN, FULL: YARN}, logit_scale=0.25, attention_bias=True, bos_token_id=None)
# the tower (Qwen3-VL's): 16-wide heads, 16-pixel patches, a 5 x 5 learned position table, DeepStack mergers after
# blocks 0 and 2 of 3
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=16,
              num_position_embeddings=25, deepstack_visual_indexes=[0, 2], hidden_act="gelu_pytorch_tanh")
# two images of different sizes, resized to 64 x 96 and 96 x 128 pixels: grids of 4 x 6 and 6 x 8 patches, 6 and 12
# tokens
SIZES = [(60, 100), (90, 140)]
TEXT_BEFORE, BETWEEN, AFTER = "Hello world!", " and then ", " The quick brown fox jumps."
PART = "<|VISION_START|><|IMAGE_PAD|><|VISION_END|>"
GENERATED = [17, 42, 99, 75, 230, 61, 28, 150]  # tokens past the prompt (decode steps)
# a prefill; chunks that split both images' spans (tokens 10-15 and 24-35 of the 56-token prompt), then single steps
SCHEDULES = {"prefill": None, "chunked+decode": [12, 13, 6, 4]}
SPANS = [(10, 6), (24, 12)]  # each image's (offset, tokens) in the expanded prompt
PROMPT = 56


def images() -> list:
    return random_images(SIZES)


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, object]:
    """transformers' whole Cohere Compass at :data:`TEXT` / :data:`VISION` sizes with random weights (norms, biases
    and the tower's weights drawn away from their init so that each shows), saved with its processor (conftest's tiny
    tokenizer with the vision tokens, transformers' Compass image processor at 16-pixel patches)."""
    from transformers import (CohereCompassConfig, CohereCompassForConditionalGeneration,
                              CohereCompassImageProcessorPil)

    from tests.conftest import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("cohere_compass_images")
    tok = build_tiny_tokenizer(path, extra_special_tokens=SPECIAL)
    start, end, image, video = tok.convert_tokens_to_ids(list(SPECIAL))
    config = CohereCompassConfig(
        text_config={**TEXT, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id, "pad_token_id": None},
        vision_config=VISION, image_token_id=image, video_token_id=video, vision_start_token_id=start,
        vision_end_token_id=end, tie_word_embeddings=False)
    torch.manual_seed(13)
    model = CohereCompassForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "visual." in n:
                p.normal_(0.0, 0.2) if p.dim() > 1 else p.normal_(1.0 if n.endswith("weight") else 0.0, 0.2)
            elif n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    CohereCompassImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(path)
    return path, model


def hf_processor(folder: Path):
    """transformers' ``CohereCompassProcessor`` over the folder's image processor and tokenizer (its video processor
    needs torchvision, which is not installed: the class check of the absent one is skipped)."""
    from transformers import AutoImageProcessor, AutoTokenizer, CohereCompassProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class",
                      lambda self, name, arg: None if arg is None else check(self, name, arg))
        return CohereCompassProcessor(image_processor=AutoImageProcessor.from_pretrained(str(folder)),
                                      tokenizer=AutoTokenizer.from_pretrained(str(folder)))


def expanded(folder: Path):
    """(our processor, the expanded prompt's ids, its MultiModalInputs)."""
    from transformers import AutoTokenizer

    processor = cv.CohereCompassImageProcessor.from_pretrained(folder, read_config(str(folder)))
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids, mm = expand_prompt(tok(TEXT_BEFORE + PART + BETWEEN + PART + AFTER)["input_ids"], images(), processor)
    return processor, ids, mm


# ---- the processor, the encoder and the whole model ------------------------------------------------------------------

def test_processor_equals_transformers(release):
    """Our expanded prompt (each placeholder repeated t*h*w / merge² times between the vision tokens), pixels and
    grids equal ``CohereCompassProcessor``'s for one and for two images of different sizes; the multimodal RoPE
    positions equal the release's ``get_rope_index`` over the prompt and tokens past it (slot + delta there)."""
    folder, hf = release
    theirs = hf_processor(folder)
    processor = cv.CohereCompassImageProcessor.from_pretrained(folder, read_config(str(folder)))
    assert processor.image_token_id == theirs.tokenizer.convert_tokens_to_ids("<|IMAGE_PAD|>")
    cases = [(TEXT_BEFORE + PART + AFTER, images()[1:]), (TEXT_BEFORE + PART + BETWEEN + PART + AFTER, images())]
    assert_expansion_equals_transformers(theirs, processor, cases, hf, GENERATED)


def test_encoder_equals_transformers_image_features(release):
    """Each image's embeddings and DeepStack features [1 + 2, t*h*w / merge², text hidden] equal transformers'
    ``get_image_features`` (pooler output, then the DeepStack features)."""
    folder, hf = release
    _, _, mm = expanded(folder)
    for item, ours in zip(mm.items, encoded(folder, mm)):
        with torch.no_grad():
            out = hf.model.get_image_features(torch.from_numpy(item.data["pixel_values"]),
                                              torch.from_numpy(item.data["image_grid_thw"]))
        theirs = torch.stack([out.pooler_output[0], *(f[0] for f in out.deepstack_features)])
        assert ours.shape == (3, item.length, TEXT["hidden_size"]) and max_diff(ours, theirs) < TOL


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_with_images_equal_transformers(release, schedule):
    """Our Compass text model (the release's text part, as the engine loads it) with the images' embeddings, DeepStack
    features and multimodal positions (each kind of layer by its own RoPE and sections) gives transformers' whole
    model's logits over a prompt of two images and text, then more tokens: one prefill, or chunks splitting both
    images' spans and single decode steps."""
    folder, hf = release
    _, ids, mm = expanded(folder)
    assert [(item.offset, item.length) for item in mm.items] == SPANS and len(ids) == PROMPT
    ids = ids + GENERATED
    ours = image_logits(load_model(str(folder)), ids, mm, encoded(folder, mm), SCHEDULES[schedule])
    assert max_diff(ours, reference(hf, ids, mm)) < TOL


# ---- each part matters -----------------------------------------------------------------------------------------------

def _one_layer_late(add=llama.add_deepstack):
    return lambda x, residual, i, meta, stage: add(x, residual, i - 1, meta, stage) if i else (x, residual)


PARTS = ["multimodal positions", "delta past the prompt", "interleaved sections", "sections per kind", "deepstack",
         "deepstack one layer late", "image embeddings"]


@pytest.mark.parametrize("part", PARTS)
def test_each_part_shows_in_the_logits(release, part, monkeypatch):
    """Each distinctive part switched off moves the logits (chunks and decode steps) away from transformers'."""
    folder, hf = release
    _, ids, mm = expanded(folder)
    ids = ids + GENERATED
    rope = rope_table(mm, len(ids))
    model = load_model(str(folder))
    rotary = model.model.rotary
    if part == "multimodal positions":
        rope = torch.arange(len(ids)).expand(3, -1)
    elif part == "delta past the prompt":
        rope[:, len(ids) - len(GENERATED):] = torch.arange(len(ids) - len(GENERATED), len(ids))
    elif part == "interleaved sections":  # contiguous sections, as Qwen2-VL's
        for kind in rotary:
            rotary[kind].mrope = mrope_axes({**rotary[kind].params, "mrope_interleaved": False}, 16)
    elif part == "sections per kind":  # the global layer's table by the sliding layers' sections
        rotary[FULL].mrope = rotary[SLIDING].mrope
    elif part == "deepstack one layer late":
        monkeypatch.setattr(llama, "add_deepstack", _one_layer_late())
    embeds = encoded(folder, mm)
    if part == "deepstack":
        embeds = [e[:1] for e in embeds]
    elif part == "image embeddings":  # the placeholders' own embeddings in the image rows (DeepStack kept)
        own = model.model.embed_tokens.weight[hf.config.image_token_id]
        embeds = [torch.cat((own.expand(1, e.shape[1], -1), e[1:])) for e in embeds]
    ours = image_logits(model, ids, mm, embeds, SCHEDULES["chunked+decode"], rope)
    # (the global kind's sections differ from the sliding kinds' in one frequency pair of one layer, under logits
    # scaled by 0.25: that mistake moves the logits less, still ten times TOL)
    assert max_diff(ours, reference(hf, ids, mm)) > (10 * TOL if part == "sections per kind" else MOVED)


# ---- refusals --------------------------------------------------------------------------------------------------------

REFUSED = {  # an edit of the whole config -> what the ValueError says
    "sections": (lambda c: c.text_config.rope_parameters[FULL].update(mrope_section=[2, 3, 2]),
                 r"text_config\.rope_parameters\['full_attention'\]: rope_parameters\.mrope_section=\[2, 3, 2\] must "
                 r"split the 8 rotated frequencies"),
    "default sections": (lambda c: c.text_config.rope_parameters[SLIDING].pop("mrope_section"),
                         r"rope_parameters\['sliding_attention'\]: rope_parameters\.mrope_section=\[24, 20, 20\] "
                         r"must split the 8 rotated frequencies"),
    "two sections": (lambda c: c.text_config.rope_parameters[FULL].update(mrope_section=[4, 4]),
                     r"mrope_section=\[4, 4\] must have three sections"),
    "activation": (lambda c: setattr(c.vision_config, "hidden_act", "swish"),
                   r"vision_config\.hidden_act='swish' is not supported"),
    "position table": (lambda c: setattr(c.vision_config, "num_position_embeddings", 24),
                       r"vision_config\.num_position_embeddings=24 is not a square"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_settings_are_refused(release, case):
    folder, _ = release
    config = read_config(str(folder))
    edit, message = REFUSED[case]
    edit(config)
    with pytest.raises(ValueError, match=message):
        cv.CohereCompassImageEncoder(config)


def test_mismatches_are_refused(release):
    """A processor whose patch size differs from the tower's, a checkpoint lacking a tensor of the tower (a DeepStack
    merger's): each a ValueError by name."""
    folder, _ = release
    config = read_config(str(folder))
    config.vision_config.patch_size = 14
    with pytest.raises(ValueError, match=r"patch_size=16 differs from vision_config\.patch_size=14"):
        cv.CohereCompassImageProcessor.from_pretrained(folder, config)
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    weights = [(n, t) for n, t in encoder.state_dict().items() if n != "deepstack_merger_list.1.norm.bias"]
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) .*\['visual\.deepstack_merger_list\.1\.norm\.bias'\]"):
        encoder.load_weights([("model.visual." + n, t) for n, t in weights])


def test_deepstack_off_the_first_stage_is_refused_before_any_rank_starts(release):
    """Three pipeline stages leave one of the three text layers on the first, which DeepStack's two need: the engine's
    builder refuses the split as it decides to serve images, before any rank starts (two stages pass; text alone
    passes any)."""
    from specray.config import EngineArgs
    from specray.engine.builder import serves_images

    folder, _ = release
    config = read_config(str(folder))
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 leaves 1 of the text model's layers on the first "
                                         r"stage, but DeepStack adds image features after its first 2"):
        serves_images(EngineArgs(model=str(folder), pipeline_parallel_size=3), config)
    assert serves_images(EngineArgs(model=str(folder), pipeline_parallel_size=2), config)
    assert not serves_images(EngineArgs(model=str(folder), pipeline_parallel_size=3,
                                        limit_mm_per_prompt={"image": 0}), config)


# ---- tensor parallel and pipeline stages -----------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2])
def test_ranks_equal_one_rank(release, tmp_path, stages):
    """Two tensor-parallel ranks (the text model's heads, MLP and vocabulary split, the encoder whole on each), or two
    pipeline stages (the image rows and DeepStack features taken in on the first, both of its layers there; the
    positions used on both), give one rank's logits with images: chunks splitting the images' spans, then decode
    steps."""
    folder, _ = release
    _, ids, mm = expanded(folder)
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids + GENERATED, mm, SCHEDULES["chunked+decode"])], stages, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
# a chat template of the release's shape for an image part: the placeholder between the vision tokens
TEMPLATE = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
            "{% if p.type == 'image' %}<|VISION_START|><|IMAGE_PAD|><|VISION_END|>{% else %}{{ p.text }}{% endif %}"
            "{% endfor %}{% endif %}{% endfor %}")


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_engine_greedy_with_images_equals_transformers(release, graphs):
    """``LLM.generate`` with two images (prefill chunks of 16 tokens, which split both images' spans; n-gram drafts
    verified with multimodal positions past the prompt) gives transformers' greedy ``generate`` tokens, token for
    token, beside a text-only prompt in the same batch; some drafts are accepted; transformers without the images
    generates other tokens. Eager: ``LLM.chat`` with an image_url part (a data: URL) answers the same as the prompt
    it renders."""
    import base64
    import io

    from specray import LLM, SamplingParams

    folder, hf = release
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16,
              speculative_config=NGRAM, enforce_eager=not graphs)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf, hf_processor(folder), TEXT_BEFORE + PART + BETWEEN + PART
                                                  + AFTER, images(), "The quick brown fox")
    if not graphs:  # LLM.chat with an image_url part (a data: URL) answers as the prompt it renders
        buffer = io.BytesIO()
        images()[1].save(buffer, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        messages = [{"role": "user", "content": [{"type": "text", "text": TEXT_BEFORE},
                                                 {"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": AFTER}]}]
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        chat = llm.chat(messages, params, use_tqdm=False, chat_template=TEMPLATE)[0]
        alone = llm.generate({"prompt": TEXT_BEFORE + PART + AFTER, "multi_modal_data": {"image": images()[1]}},
                             params, use_tqdm=False)[0]
        assert list(chat.outputs[0].token_ids) == list(alone.outputs[0].token_ids)


# ---- the GPU ---------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_images_on_the_gpu_equal_the_cpu(release):
    """fp32 on CUDA: the text model's logits without images, the encoder's embeddings and DeepStack features, and the
    text model's logits with them and their positions (chunks splitting the images, then decode steps) equal the
    CPU's."""
    from specray_test_model_checks import assert_logits_on_the_gpu_equal_the_cpu

    folder, _ = release
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
