"""EXAONE 4.5's images (``specray.models.exaone4_5_vision``): against transformers' whole
``Exaone4_5_ForConditionalGeneration`` on the same random tiny fp32 weights. The processor's expanded prompt, pixels
and grids equal transformers' ``Exaone4_5_Processor``'s for one and two images of different sizes, with no multimodal
positions; the encoder's embeddings per image equal transformers' image features (Qwen2.5-VL's tower with
grouped-query attention: 4 query heads over 2 key/value heads, windows cut short at the image's edges, a
full-attention block among windowed ones); the EXAONE 4.0 text model (a sliding layer of 8 tokens with RoPE, a global
one without) fed those embeddings (``meta.input_embeds``) gives transformers' logits over a prompt of two images with
text between and after them, then more tokens: in one prefill, and in chunks that split both images' spans followed
by single decode steps. Two tensor-parallel ranks (or two pipeline stages) equal one; the engine's greedy tokens with
images and n-gram drafts equal transformers' ``generate``. Each distinctive part broken once moves the logits; what
is not served is refused by name. The tiny release is built here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specray.models import exaone4_5_vision as ev
from specray.models import qwen2_vl_vision as qv
from specray.models.loader import load_image_encoder, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import (assert_expansion_equals_transformers,  # tests/image_checks.py
                                       assert_ranks_equal_one_rank, encoded, grid_reference, image_logits,
                                       random_images)
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
SPECIAL = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# the text model: EXAONE 4.0's post-norm layers with per-head q/k norms; layer 0 slides over 8 tokens with RoPE,
# layer 1 attends everything without RoPE
TEXT = dict(model_type="exaone4", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
            initializer_range=0.1, bos_token_id=None, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"])
# the tower: 8-wide heads (the 2D RoPE's 2 frequencies per axis), 4 query heads sharing 2 key/value heads; windows of
# 56 pixels (2 x 2 merge blocks: the images below have 2 x 3 and 3 x 5, so windows are cut short at the right and
# bottom edges), block 1 of 3 full attention
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, num_key_value_heads=2, out_hidden_size=64,
              window_size=56, fullatt_block_indexes=[1], hidden_act="silu")
# two images of different sizes, resized to 56 x 84 and 84 x 140 pixels: grids of 4 x 6 and 6 x 10 patches, 6 and 15
# tokens
SIZES = [(50, 80), (90, 140)]
TEXT_BEFORE, BETWEEN, AFTER = "Hello world!", " and then ", " The quick brown fox jumps."
PART = "<|vision_start|><|image_pad|><|vision_end|>"
GENERATED = [17, 42, 99, 75, 230, 61, 28, 150]  # tokens past the prompt (decode steps)
# a prefill; chunks that split both images' spans (tokens 10-15 and 24-38 of the 59-token prompt), then single steps
SCHEDULES = {"prefill": None, "chunked+decode": [12, 13, 6, 4]}
SPANS = [(10, 6), (24, 15)]  # each image's (offset, tokens) in the expanded prompt
PROMPT = 59


def images() -> list:
    return random_images(SIZES)


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, object]:
    """transformers' whole EXAONE 4.5 at :data:`TEXT` / :data:`VISION` sizes with random weights (norms, biases and
    the tower's weights drawn away from their init so that each shows), saved with its processor (conftest's tiny
    tokenizer with the vision tokens, transformers' Qwen2-VL image processor, EXAONE 4.5's auto class)."""
    from transformers import Exaone4_5_Config, Exaone4_5_ForConditionalGeneration, Qwen2VLImageProcessorPil

    from tests.conftest import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("exaone4_5")
    tok = build_tiny_tokenizer(path, extra_special_tokens=SPECIAL)
    image, video = tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    config = Exaone4_5_Config(
        text_config={**TEXT, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id, "pad_token_id": None},
        vision_config=VISION, image_token_id=image, video_token_id=video, tie_word_embeddings=False)
    torch.manual_seed(11)
    model = Exaone4_5_ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "visual." in n:
                p.normal_(0.0, 0.2) if p.dim() > 1 else p.normal_(1.0 if n.endswith("weight") else 0.0, 0.2)
            elif n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil().save_pretrained(path)
    return path, model


def hf_processor(folder: Path):
    """transformers' ``Exaone4_5_Processor`` over the folder's image processor and tokenizer. (Its video processor
    needs torchvision, which is not installed: the class check of its absent video processor is skipped.)"""
    from transformers import AutoImageProcessor, AutoTokenizer, Exaone4_5_Processor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class",
                      lambda self, name, arg: None if arg is None else check(self, name, arg))
        return Exaone4_5_Processor(image_processor=AutoImageProcessor.from_pretrained(str(folder)),
                                   tokenizer=AutoTokenizer.from_pretrained(str(folder)))


def expanded(folder: Path):
    """(our processor, the expanded prompt's ids, its MultiModalInputs)."""
    from transformers import AutoTokenizer

    processor = ev.Exaone4_5ImageProcessor.from_pretrained(folder, read_config(str(folder)))
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids, mm = expand_prompt(tok(TEXT_BEFORE + PART + BETWEEN + PART + AFTER)["input_ids"], images(), processor)
    return processor, ids, mm


# ---- the processor, the encoder and the whole model ------------------------------------------------------------------

def test_processor_equals_transformers(release):
    """Our expanded prompt (each placeholder repeated t*h*w / merge² times), pixels and grids equal transformers'
    ``Exaone4_5_Processor``'s for one and for two images of different sizes; no multimodal positions."""
    folder, _ = release
    theirs = hf_processor(folder)
    processor = ev.Exaone4_5ImageProcessor.from_pretrained(folder, read_config(str(folder)))
    cases = [(TEXT_BEFORE + PART + AFTER, images()[1:]), (TEXT_BEFORE + PART + BETWEEN + PART + AFTER, images())]
    assert_expansion_equals_transformers(theirs, processor, cases)


def test_encoder_equals_transformers_image_features(release):
    """Each image's embeddings [t*h*w / merge², text hidden] equal transformers' ``get_image_features`` for it."""
    folder, hf = release
    _, _, mm = expanded(folder)
    for item, ours in zip(mm.items, encoded(folder, mm)):
        with torch.no_grad():
            theirs = hf.model.get_image_features(torch.from_numpy(item.data["pixel_values"]),
                                                 torch.from_numpy(item.data["image_grid_thw"])).pooler_output[0]
        assert ours.shape == (item.length, TEXT["hidden_size"]) and max_diff(ours, theirs) < TOL


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_with_images_equal_transformers(release, schedule):
    """Our EXAONE 4.0 text model (the release's text part, as the engine loads it) with the images' embeddings gives
    transformers' whole model's logits over a prompt of two images and text (longer than the sliding window), then
    more tokens: one prefill, or chunks splitting both images' spans and single decode steps."""
    folder, hf = release
    _, ids, mm = expanded(folder)
    assert [(item.offset, item.length) for item in mm.items] == SPANS and len(ids) == PROMPT
    ids = ids + GENERATED
    ours = image_logits(load_model(str(folder)), ids, mm, encoded(folder, mm), SCHEDULES[schedule])
    assert max_diff(ours, grid_reference(hf, ids, mm, token_types=False)) < TOL


# ---- each part matters -----------------------------------------------------------------------------------------------

def _no_vision_rope(grid, merge, head_dim, theta, device):
    n = grid[0] * grid[1] * grid[2]
    return torch.ones(n, 1, head_dim // 2, device=device), torch.zeros(n, 1, head_dim // 2, device=device)


def _image_order(layout):
    def unordered(self, grid, device):
        order, full, windows = layout(self, grid, device)
        return torch.arange(len(order), device=device), full, windows  # windows of consecutive merge blocks
    return unordered


PARTS = ["key/value heads grouped", "vision 2D rope", "window attention", "full-attention block", "window order",
         "image embeddings"]


@pytest.mark.parametrize("part", PARTS)
def test_each_part_shows_in_the_logits(release, part, monkeypatch):
    """Each distinctive part switched off moves the logits (chunks and decode steps) away from transformers'."""
    folder, hf = release
    _, ids, mm = expanded(folder)
    ids = ids + GENERATED
    encoder = ev.Exaone4_5ImageEncoder
    if part == "key/value heads grouped":  # head j tiled (j, j + kv_heads, ...) instead of serving a run of queries
        monkeypatch.setattr(ev, "share_heads", lambda x, group: x.repeat(1, group, 1))
    elif part == "vision 2D rope":
        monkeypatch.setattr(qv, "vision_rope", _no_vision_rope)
    elif part == "window attention":
        monkeypatch.setattr(encoder, "_full", lambda self, block: True)
    elif part == "full-attention block":
        monkeypatch.setattr(encoder, "_full", lambda self, block: False)
    elif part == "window order":
        monkeypatch.setattr(encoder, "_layout", _image_order(encoder._layout))
    embeds = encoded(folder, mm)
    if part == "image embeddings":  # the placeholders' own embeddings
        mm = type(mm)(items=[])
    ours = image_logits(load_model(str(folder)), ids, mm, embeds, SCHEDULES["chunked+decode"])
    assert max_diff(ours, grid_reference(hf, ids, expanded(folder)[2], token_types=False)) > MOVED


# ---- refusals --------------------------------------------------------------------------------------------------------

REFUSED = {  # an edit of the whole config -> what the ValueError says
    "kv heads": (lambda c: setattr(c.vision_config, "num_key_value_heads", 3),
                 r"vision_config\.num_key_value_heads=3 must divide vision_config\.num_heads=4"),
    "activation": (lambda c: setattr(c.vision_config, "hidden_act", "swish"),
                   r"vision_config\.hidden_act='swish' is not supported"),
    "vision rope": (lambda c: setattr(c.vision_config, "rope_parameters", {"rope_type": "yarn"}),
                    r"vision_config\.rope_parameters\.rope_type='yarn' is not supported"),
    "full blocks": (lambda c: setattr(c.vision_config, "fullatt_block_indexes", [1, 3]),
                    r"vision_config\.fullatt_block_indexes names blocks \[3\] outside the tower's depth=3"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_settings_are_refused(release, case):
    folder, _ = release
    config = read_config(str(folder))
    edit, message = REFUSED[case]
    edit(config)
    with pytest.raises(ValueError, match=message):
        ev.Exaone4_5ImageEncoder(config)


def test_mismatches_are_refused(release):
    """A processor whose merge size differs from the tower's, a checkpoint lacking a tensor of the tower: each a
    ValueError by name."""
    folder, _ = release
    config = read_config(str(folder))
    config.vision_config.spatial_merge_size = 1
    with pytest.raises(ValueError, match=r"merge_size=2 differs from vision_config\.spatial_merge_size=1"):
        ev.Exaone4_5ImageProcessor.from_pretrained(folder, config)
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    weights = [(n, t) for n, t in encoder.state_dict().items() if n != "blocks.0.attn.qkv.bias"]
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) of the vision tower: \['visual\.blocks\.0\.attn\.qkv"):
        encoder.load_weights([("model.visual." + n, t) for n, t in weights])


# ---- tensor parallel -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2])
def test_ranks_equal_one_rank(release, tmp_path, stages):
    """Two tensor-parallel ranks (the text model's heads, MLP and vocabulary split, the encoder whole on each), or two
    pipeline stages (the image rows taken in on the first), give one rank's logits with images: chunks splitting the
    images' spans, then decode steps."""
    folder, _ = release
    _, ids, mm = expanded(folder)
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids + GENERATED, mm, SCHEDULES["chunked+decode"])], stages, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
# a chat template of the release's shape for an image part: the placeholder between vision tokens
TEMPLATE = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
            "{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p.text }}{% endif %}"
            "{% endfor %}{% endif %}{% endfor %}")


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_engine_greedy_with_images_equals_transformers(release, graphs):
    """``LLM.generate`` with two images (prefill chunks of 16 tokens, which split both images' spans; n-gram drafts)
    gives transformers' greedy ``generate`` tokens, token for token, beside a text-only prompt in the same batch; some
    drafts are accepted; transformers without the images generates other tokens. Eager, and with the steps' graphs
    (plain positions: the image request's steps share the text-only graphs). Eager: ``LLM.chat`` with an image_url
    part (a data: URL) answers the same as the prompt it renders."""
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
    """fp32 on CUDA: the text model's logits without images, the encoder's embeddings, and the text model's logits
    with them (chunks splitting the images, then decode steps) equal the CPU's."""
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
