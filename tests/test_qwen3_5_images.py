"""Qwen3.5's and Qwen3.5-MoE's images (``specray.models.qwen3_5_vision`` on the hybrid text models of
``specray.models.qwen3_5``): against transformers' whole ``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration`` on the same random tiny fp32 weights. The processor's expanded prompt, pixels
and grids equal transformers' ``Qwen3VLProcessor``'s (the releases' processor) for one and two images of different
sizes, and its multimodal RoPE positions equal Qwen3.5's ``get_rope_index``; the encoder's embeddings per image equal
``get_image_features``' (no DeepStack); the hybrid text model fed them (``meta.input_embeds``) with those positions
(partial RoPE, interleaved sections) gives transformers' logits over a prompt of two images with text between and
after them, then more tokens: in one prefill, and in chunks splitting both images' spans (the linear layers' state
carried across) followed by single decode steps; a text-only prompt runs as plain RoPE. Two tensor-parallel ranks,
and two pipeline stages, equal one; the engine's greedy tokens with images and n-gram drafts (graph steps with
multimodal positions, accepted drafts replayed into the state, a prefix-cache hit past the images) equal transformers'
``generate``, and ``LLM.chat`` with an image_url part answers as its prompt does. Each distinctive part broken once
moves the logits; what is not served is refused by name. On a CUDA device the GPU's logits with images equal the
CPU's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specray.models import qwen3_vl_vision as q3
from specray.models.layers import mrope_axes
from specray.models.loader import load_image_encoder, load_model, read_config
from specray.models.qwen3_5_vision import Qwen3_5ImageEncoder, Qwen3_5ImageProcessor
from specray.multimodal import expand_prompt
from specray_test_hybrid_models import Stepper  # tests/hybrid_models.py
from specray_test_image_checks import (assert_expansion_equals_transformers,  # tests/image_checks.py
                                       assert_ranks_equal_one_rank, encoded, image_logits, random_images)
from specray_test_image_checks import grid_reference as reference
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
SPECIAL = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# the text models: linear, full, linear attention layers (Qwen3.5's gated attention with 32-wide heads, of which
# partial_rotary_factor 0.5 rotates 16: 8 frequencies interleaving the temporal, height and width positions,
# mrope_section [2, 3, 3]: height at 1, 4, 7, width at 2, 5)
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"], num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=512,
            rms_norm_eps=1e-5, initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 3, 3], "mrope_interleaved": True})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
# the tower: 16-wide heads, 16-pixel patches, a 5 x 5 learned position table (resampled to grids of 4 x 6 and 6 x 8)
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=16,
              num_position_embeddings=25, hidden_act="gelu_pytorch_tanh")
KINDS = ["qwen3_5", "qwen3_5_moe"]
# two images of different sizes, resized to 64 x 96 and 96 x 128 pixels: grids of 4 x 6 and 6 x 8 patches, 6 and 12
# tokens
SIZES = [(60, 100), (90, 140)]
TEXT_BEFORE, BETWEEN, AFTER = "Hello world!", " and then ", " The quick brown fox jumps."
GENERATED = [17, 42, 99, 75, 230, 61, 28, 150]  # tokens past the prompt (decode steps)
# a prefill; chunks that split both images' spans (tokens 10-15 and 24-35 of the 56-token prompt), then single steps
SCHEDULES = {"prefill": None, "chunked+decode": [12, 13, 6, 4]}
SPANS = [(10, 6), (24, 12)]  # each image's (offset, tokens) in the expanded prompt
PROMPT = 56
PART = "<|vision_start|><|image_pad|><|vision_end|>"


def images() -> list:
    return random_images(SIZES)


def build_release(kind: str, path: Path, seed: int) -> tuple[Path, object]:
    """transformers' whole ``kind`` model at :data:`TEXT` / :data:`VISION` sizes with random weights (the ``1 + w``
    norms, the gated norm, gates, biases and the tower's weights drawn away from their init so that each shows; the
    LM head tied to the embedding),
    saved with its processor (conftest's tiny tokenizer with the vision tokens, transformers' Qwen2-VL image
    processor at the releases' settings)."""
    import transformers
    from transformers import Qwen2VLImageProcessorPil

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=SPECIAL)
    start, end, image, video = tok.convert_tokens_to_ids(list(SPECIAL))
    name = "Qwen3_5" if kind == "qwen3_5" else "Qwen3_5Moe"
    text = {**TEXT, **(MOE if kind == "qwen3_5_moe" else {}), "vocab_size": len(tok),
            "eos_token_id": tok.eos_token_id, "pad_token_id": None, "bos_token_id": None}
    config = getattr(transformers, f"{name}Config")(
        text_config=text, vision_config=VISION, image_token_id=image, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "visual." in n:
                p.normal_(0.0, 0.2) if p.dim() > 1 else p.normal_(1.0 if n.endswith("weight") else 0.0, 0.2)
            elif n.endswith("linear_attn.norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith("norm.weight"):  # 1 + w
                p.normal_(0.0, 0.3)
            elif n.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "dt_bias")):
                p.normal_(0.0, 0.5)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.1)
        model.get_input_embeddings().weight.mul_(2.0)  # (tied and doubled: greedy loops now and then, so n-gram
        # drafts are accepted in some steps; a random head's greedy tokens almost never repeat)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(path)
    return path, model


def hf_processor(folder: Path):
    """transformers' ``Qwen3VLProcessor`` (the Qwen3.5 releases' processor) over the folder's image processor and
    tokenizer (its video processor needs torchvision, which is not installed: the class check of the absent one is
    skipped)."""
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


def prompt_ids(folder: Path) -> list[int]:
    """The prompt's token ids with one placeholder per image (as a chat template renders image parts)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))(TEXT_BEFORE + PART + BETWEEN + PART + AFTER)["input_ids"]


def expanded(folder: Path):
    """(our processor, the expanded prompt's ids, its MultiModalInputs)."""
    processor = Qwen3_5ImageProcessor.from_pretrained(folder, read_config(str(folder)))
    ids, mm = expand_prompt(prompt_ids(folder), images(), processor)
    return processor, ids, mm


# ---- the processor and the encoder -----------------------------------------------------------------------------------

def test_processor_equals_transformers(releases):
    """Our expanded prompt (each placeholder repeated t*h*w / merge² times between the vision tokens), pixels and
    grids equal ``Qwen3VLProcessor``'s for one and for two images of different sizes; the multimodal RoPE positions
    equal Qwen3.5's ``get_rope_index`` over the prompt and tokens past it (slot + delta there)."""
    folder, hf = releases["qwen3_5"]
    theirs = hf_processor(folder)
    processor = Qwen3_5ImageProcessor.from_pretrained(folder, read_config(str(folder)))
    cases = [(TEXT_BEFORE + PART + AFTER, images()[1:]), (TEXT_BEFORE + PART + BETWEEN + PART + AFTER, images())]
    assert_expansion_equals_transformers(theirs, processor, cases, hf, GENERATED)


@pytest.mark.parametrize("kind", KINDS)
def test_encoder_equals_transformers_image_features(releases, kind):
    """Each image's embeddings [t*h*w / merge², text hidden] equal transformers' ``get_image_features``' (the
    merger's output: no DeepStack features)."""
    folder, hf = releases[kind]
    _, _, mm = expanded(folder)
    for item, ours in zip(mm.items, encoded(folder, mm)):
        with torch.no_grad():
            out = hf.model.get_image_features(torch.from_numpy(item.data["pixel_values"]),
                                              torch.from_numpy(item.data["image_grid_thw"]))
        assert ours.shape == (item.length, TEXT["hidden_size"]) and max_diff(ours, out.pooler_output[0]) < TOL
    assert load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu").deepstack_layers == 0


# ---- the whole model -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("kind", KINDS)
def test_logits_with_images_equal_transformers(releases, kind, schedule):
    """Our hybrid text model (the release's text part, as the engine loads it) with the images' embeddings and
    interleaved multimodal RoPE positions gives transformers' whole model's logits over a prompt of two images and
    text, then more tokens: one prefill, or chunks splitting both images' spans (the linear layers' state carried
    from chunk to chunk) and single decode steps."""
    folder, hf = releases[kind]
    _, ids, mm = expanded(folder)
    assert [(item.offset, item.length) for item in mm.items] == SPANS and len(ids) == PROMPT
    ids = ids + GENERATED
    model = load_model(str(folder))
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    ours = image_logits(model, ids, mm, encoded(folder, mm), SCHEDULES[schedule])
    assert max_diff(ours, reference(hf, ids, mm)) < TOL


# ---- each part matters -----------------------------------------------------------------------------------------------

def _no_rotation(grid, merge, head_dim, theta, device):
    n = grid[0] * grid[1] * grid[2]
    return torch.ones(n, 1, head_dim // 2, device=device), torch.zeros(n, 1, head_dim // 2, device=device)


# part -> how it is switched off
PARTS = ["interleaved sections", "image positions", "image rows", "state across an image", "position table",
         "patch bias", "vision rope"]


@pytest.mark.parametrize("part", PARTS)
def test_each_part_shows_in_the_logits(releases, part, monkeypatch):
    """Each distinctive part switched off moves the logits (chunks and decode steps) away from transformers':
    Qwen3-VL's contiguous sections instead of the interleaved ones, plain positions for the images' tokens, the
    placeholders' own embeddings instead of the image rows, the linear layers' state dropped at each chunk (which
    splits the images), the learned position table, the patch embedding's bias, the tower's 2D RoPE."""
    folder, hf = releases["qwen3_5"]
    _, ids, mm = expanded(folder)
    ids = ids + GENERATED
    model = load_model(str(folder))
    rope = None
    if part == "interleaved sections":
        model.model.rotary_emb.mrope = mrope_axes({**model.model.rotary_emb.params, "mrope_interleaved": False}, 16)
    elif part == "image positions":
        rope = torch.arange(len(ids)).expand(3, -1)
    elif part == "position table":
        monkeypatch.setattr(q3.Qwen3VLImageEncoder, "position_embeddings",
                            lambda self, grid, dtype: torch.zeros((), dtype=dtype))
    elif part == "vision rope":
        monkeypatch.setattr(q3, "vision_rope", _no_rotation)
    embeds = encoded(folder, mm, (lambda e: e.patch_embed.proj.bias.zero_()) if part == "patch bias" else None)
    if part == "image rows":
        embeds = []  # no chunk takes image rows: the placeholders' embeddings stay
    ours = image_logits(model, ids, mm, embeds, SCHEDULES["chunked+decode"], rope,
                        forget=part == "state across an image")
    assert max_diff(ours, reference(hf, ids, expanded(folder)[2])) > MOVED


def test_text_only_prompt_equals_transformers(releases):
    """A prompt without images (no ``meta.rope_positions``) runs as plain RoPE, which is what transformers' whole
    model gives it: chunks, then decode steps."""
    folder, hf = releases["qwen3_5_moe"]
    ids = [t if t != hf.config.image_token_id else 7 for t in prompt_ids(folder)] + GENERATED
    model = load_model(str(folder))
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]

    run = Stepper(model)  # tests/hybrid_models.py: chunks over a paged cache and a state slot, no rope_positions
    plain = torch.cat([run.step([(0, ids[s:e], s, 0)])[0] for s, e in ((0, 9), (9, 14), *(
        (i, i + 1) for i in range(14, len(ids))))])
    assert max_diff(plain, want) < TOL


# ---- refusals --------------------------------------------------------------------------------------------------------

REFUSED = {  # an edit of the whole config -> what the ValueError says
    "not interleaved": (lambda c: c.text_config.rope_parameters.update(mrope_interleaved=False),
                        r"text_config\.rope_parameters\.mrope_interleaved=False: Qwen3\.5's text model interleaves "
                        r".* set mrope_interleaved: true"),
    "mrope sections": (lambda c: c.text_config.rope_parameters.update(mrope_section=[4, 4, 4]),
                       r"rope_parameters\.mrope_section=\[4, 4, 4\] must split the 8 rotated frequencies"),
    "activation": (lambda c: setattr(c.vision_config, "hidden_act", "swish"),
                   r"vision_config\.hidden_act='swish' is not supported"),
    "vision rope": (lambda c: setattr(c.vision_config, "rope_parameters", {"rope_type": "default"}),
                    r"vision_config\.rope_parameters\.rope_type='default' is not supported; Qwen3\.5's vision"),
    "position table": (lambda c: setattr(c.vision_config, "num_position_embeddings", 24),
                       r"vision_config\.num_position_embeddings=24 is not a square"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_settings_are_refused(releases, case):
    folder, _ = releases["qwen3_5"]
    config = read_config(str(folder))
    edit, message = REFUSED[case]
    edit(config)
    with pytest.raises(ValueError, match=message):
        Qwen3_5ImageEncoder(config)


def test_mismatches_are_refused_and_deepstack_indexes_unread(releases):
    """An image whose pixels do not fit its grid, a checkpoint lacking a tensor of the tower, each a ValueError by
    name; a ``deepstack_visual_indexes`` left in the vision config is not read (transformers' Qwen3.5 tower has no
    DeepStack mergers) and any pipeline split serves images."""
    folder, _ = releases["qwen3_5"]
    _, _, mm = expanded(folder)
    config = read_config(str(folder))
    encoder = load_image_encoder(str(folder), config, torch.float32, "cpu")
    data = {k: torch.from_numpy(v) for k, v in mm.items[0].data.items()}
    with pytest.raises(ValueError, match=r"image_grid_thw \(1, 4, 8\) does not fit"):
        encoder.encode({**data, "image_grid_thw": torch.tensor([[1, 4, 8]])})
    weights = [(n, t) for n, t in encoder.state_dict().items() if n != "merger.norm.bias"]
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) .*\['visual\.merger\.norm\.bias'\]"):
        encoder.load_weights([("model.visual." + n, t) for n, t in weights])
    config.vision_config.deepstack_visual_indexes = [0, 1]
    listed = Qwen3_5ImageEncoder(config)
    assert listed.deepstack_layers == 0 and not any("deepstack" in n for n, _ in listed.named_parameters())
    Qwen3_5ImageEncoder.check_split(config, 1, 3)  # no DeepStack: nothing to keep on the first stage


# ---- tensor parallel and pipeline stages -----------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2])
def test_ranks_equal_one_rank(releases, tmp_path, stages):
    """Two tensor-parallel ranks (the text model's attention and linear heads, MLP, experts and vocabulary split, the
    encoder whole on each), or two pipeline stages (the image rows taken in on the first, the positions used on
    both), give one rank's logits with images: chunks splitting the images' spans, then decode steps."""
    runs = []
    for kind in KINDS:
        folder, _ = releases[kind]
        _, ids, mm = expanded(folder)
        runs.append((folder, ids + GENERATED, mm, SCHEDULES["chunked+decode"]))
    assert_ranks_equal_one_rank(tmp_path, runs, stages, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
# a chat template of the releases' shape for an image part: the placeholder between the vision tokens
TEMPLATE = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
            "{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p.text }}{% endif %}"
            "{% endfor %}{% endif %}{% endfor %}")


@pytest.mark.parametrize("kind", KINDS)
def test_engine_greedy_with_images_equals_transformers(releases, kind, monkeypatch):
    """``LLM.generate`` with two images (prefill chunks of 16 tokens, which split both images' spans, the linear
    layers' state carried between them; n-gram drafts verified with multimodal positions past the prompt, the
    accepted ones replayed into the state) gives transformers' greedy ``generate`` tokens, token for token, beside a
    text-only prompt in the same batch; some drafts are accepted; transformers without the images generates other
    tokens; its decode and verify steps ran as graph steps with multimodal positions (on the CPU their padded static
    inputs run eagerly) and replayed accepted drafts into the state. The same prompt again (prefix caching) restores
    a state kept past both images and answers the same; the images swapped hit no block past the text before them.
    ``LLM.chat`` with an image_url part (a data: URL) answers the same as the prompt it renders."""
    import base64
    import io

    from specray import LLM, SamplingParams
    from specray.models.step_graphs import StepGraphs
    from specray.workers.model_runner import RecurrentSlots

    replays, real_batch = [], RecurrentSlots.batch
    monkeypatch.setattr(RecurrentSlots, "batch", lambda self, chunks: replays.append(real_batch(self, chunks)) or
                        replays[-1])
    graphs, real_run = [], StepGraphs.run
    monkeypatch.setattr(StepGraphs, "run", lambda self, shape, *a, **kw: graphs.append(
        kw.get("rope_positions") is not None) or real_run(self, shape, *a, **kw))

    folder, hf = releases[kind]
    text, plain_text = TEXT_BEFORE + PART + BETWEEN + PART + AFTER, "The quick brown fox"
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16,
              speculative_config=NGRAM, enforce_eager=False, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf, hf_processor(folder), text, images(), plain_text)
    assert any(graphs) != runs.refused_on_this_gpu(llm), graphs  # (experts in fp32 on a GPU: eager steps)
    assert any(n > 0 for batch in replays for n in batch.replay), replays
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": images()}}, params, use_tqdm=False)[0]
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": images()}}, params, use_tqdm=False)[0]
    swapped = llm.generate({"prompt": text, "multi_modal_data": {"image": images()[::-1]}}, params,
                           use_tqdm=False)[0]
    # the second run restores a kept state past both images; other images share no block past the text before them
    assert again.num_cached_tokens > SPANS[1][0] and swapped.num_cached_tokens <= SPANS[0][0]
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    if kind == "qwen3_5":
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
    """fp32 on CUDA: the encoder's embeddings, and the hybrid text model's logits with them (chunks splitting the
    images, then decode steps), equal the CPU's."""
    folder, _ = releases[kind]
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
