"""Qwen2-VL's and Qwen2.5-VL's images (``specray.models.qwen2_vl_vision``): against transformers' whole
``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` on the same random tiny fp32 weights.
The processor's expanded prompt, pixels and grids equal transformers' processor's for one and two images of different
sizes, and its multimodal RoPE positions equal ``get_rope_index``; the encoder's embeddings per image equal
transformers' image features (Qwen2.5-VL's windows cut short at the image's edges, a full-attention block among
windowed ones); the text model fed those embeddings (``meta.input_embeds``) and those positions
(``meta.rope_positions``) gives transformers' logits over a prompt of two images with text between and after them,
then more tokens: in one prefill, and in chunks that split both images' spans followed by single decode steps (slot +
delta on every axis); a text-only prompt still runs as plain RoPE. Two tensor-parallel ranks equal one; the engine's
greedy tokens with images and n-gram drafts equal transformers' ``generate``. Each distinctive part broken once moves
the logits; what is not served is refused by name. The tiny releases are built here (transformers' classes, its
image processor and conftest's tokenizer saved beside them), not in conftest."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specray.models import qwen2_vl_vision as qv
from specray.models.layers import RotaryEmbedding, mrope_axes
from specray.models.loader import load_image_encoder, load_model, read_config
from specray.multimodal import expand_prompt
from specray_test_image_checks import (assert_expansion_equals_transformers,  # tests/image_checks.py
                                       assert_ranks_equal_one_rank, encoded, image_logits, random_images,
                                       rope_table)
from specray_test_image_checks import grid_reference as reference
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the logits at least this much (a hundred times TOL)
SPECIAL = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# the text model: Qwen2's layers, GQA, 16-wide heads whose 8 frequencies multimodal RoPE splits 2 / 3 / 3 between the
# temporal, height and width positions
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
# the towers: 16-wide heads (the 2D RoPE's 4 frequencies per axis); Qwen2.5-VL's windows of 56 pixels (2 x 2 merge
# blocks: the images below have 2 x 3 and 3 x 5, so windows are cut short at the right and bottom edges), block 1 of 3
# full attention
VISION = {"qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, hidden_act="quick_gelu"),
          "qwen2_5_vl": dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                             window_size=56, fullatt_block_indexes=[1], hidden_act="silu")}
KINDS = sorted(VISION)
# two images of different sizes, resized to 56 x 84 and 84 x 140 pixels: grids of 4 x 6 and 6 x 10 patches, 6 and 15
# tokens
SIZES = [(50, 80), (90, 140)]
TEXT_BEFORE, BETWEEN, AFTER = "Hello world!", " and then ", " The quick brown fox jumps."
GENERATED = [17, 42, 99, 75, 230, 61, 28, 150]  # tokens past the prompt (decode steps)
# a prefill; chunks that split both images' spans (tokens 10-15 and 24-38 of the 59-token prompt), then single steps
SCHEDULES = {"prefill": None, "chunked+decode": [12, 13, 6, 4]}
SPANS = [(10, 6), (24, 15)]  # each image's (offset, tokens) in the expanded prompt
PROMPT = 59


def images() -> list:
    return random_images(SIZES)


def build_release(kind: str, path: Path, seed: int) -> tuple[Path, object]:
    """transformers' whole ``kind`` model at :data:`TEXT` / :data:`VISION` sizes with random weights (every norm,
    bias and the tower's weights drawn away from their init so that each shows), saved with its processor (conftest's
    tiny tokenizer with the vision tokens, transformers' Qwen2-VL image processor); (folder, the model)."""
    import transformers
    from transformers import Qwen2VLImageProcessorPil

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=SPECIAL)
    start, end, image, video = tok.convert_tokens_to_ids(list(SPECIAL))
    name = "Qwen2VL" if kind == "qwen2_vl" else "Qwen2_5_VL"
    config = getattr(transformers, f"{name}Config")(
        text_config={**TEXT, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id, "pad_token_id": None},
        vision_config=VISION[kind], image_token_id=image, video_token_id=video, vision_start_token_id=start,
        vision_end_token_id=end, tie_word_embeddings=False)
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
    Qwen2VLImageProcessorPil().save_pretrained(path)
    return path, model


def hf_processor(kind: str, folder: Path):
    """transformers' processor of ``kind`` over the folder's image processor and tokenizer. (Its video processor
    needs torchvision, which is not installed: the class check of its absent video processor is skipped.)"""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class",
                      lambda self, name, arg: None if arg is None else check(self, name, arg))
        cls = getattr(transformers, "Qwen2VLProcessor" if kind == "qwen2_vl" else "Qwen2_5_VLProcessor")
        return cls(image_processor=AutoImageProcessor.from_pretrained(str(folder)),
                   tokenizer=AutoTokenizer.from_pretrained(str(folder)))


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    return {kind: build_release(kind, tmp_path_factory.mktemp(kind), seed) for seed, kind in enumerate(KINDS)}


def prompt_ids(folder: Path) -> list[int]:
    """The prompt's token ids with one placeholder per image (as a chat template renders image parts)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    part = "<|vision_start|><|image_pad|><|vision_end|>"
    return tok(TEXT_BEFORE + part + BETWEEN + part + AFTER)["input_ids"]


def expanded(folder: Path):
    """(our processor, the expanded prompt's ids, its MultiModalInputs)."""
    processor = qv.QwenVLImageProcessor.from_pretrained(folder, read_config(str(folder)))
    ids, mm = expand_prompt(prompt_ids(folder), images(), processor)
    return processor, ids, mm


# ---- the processor ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_processor_equals_transformers(releases, kind):
    """Our expanded prompt (each placeholder repeated t*h*w / merge² times), pixels and grids equal transformers'
    processor's for one and for two images of different sizes; the multimodal RoPE positions equal transformers'
    ``get_rope_index`` over the prompt and tokens past it (slot + delta there)."""
    folder, hf = releases[kind]
    theirs = hf_processor(kind, folder)
    processor = qv.QwenVLImageProcessor.from_pretrained(folder, read_config(str(folder)))
    part = "<|vision_start|><|image_pad|><|vision_end|>"
    cases = [(TEXT_BEFORE + part + AFTER, images()[1:]), (TEXT_BEFORE + part + BETWEEN + part + AFTER, images())]
    assert_expansion_equals_transformers(theirs, processor, cases, hf, GENERATED, types_from_ids=True)


# ---- the encoder and the whole model ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_encoder_equals_transformers_image_features(releases, kind):
    """Each image's embeddings [t*h*w / merge², text hidden] equal transformers' ``get_image_features`` for it."""
    folder, hf = releases[kind]
    _, _, mm = expanded(folder)
    for item, ours in zip(mm.items, encoded(folder, mm)):
        with torch.no_grad():
            theirs = hf.model.get_image_features(torch.from_numpy(item.data["pixel_values"]),
                                                 torch.from_numpy(item.data["image_grid_thw"])).pooler_output[0]
        assert ours.shape == (item.length, TEXT["hidden_size"]) and max_diff(ours, theirs) < TOL


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("kind", KINDS)
def test_logits_with_images_equal_transformers(releases, kind, schedule):
    """Our text model (the release's text part, as the engine loads it) with the images' embeddings and multimodal
    RoPE positions gives transformers' whole model's logits over a prompt of two images and text, then more tokens:
    one prefill, or chunks splitting both images' spans and single decode steps."""
    folder, hf = releases[kind]
    _, ids, mm = expanded(folder)
    assert [(item.offset, item.length) for item in mm.items] == SPANS and len(ids) == PROMPT
    ids = ids + GENERATED
    model = load_model(str(folder))
    ours = image_logits(model, ids, mm, encoded(folder, mm), SCHEDULES[schedule])
    assert max_diff(ours, reference(hf, ids, mm)) < TOL


@pytest.mark.parametrize("kind", KINDS)
def test_text_only_prompt_equals_transformers(releases, kind):
    """A prompt without images (no ``meta.rope_positions``) runs as Qwen2's plain RoPE does, which is what
    transformers' whole model gives it (its three position ids equal): a prefill, and chunks then decode steps."""
    from specray_test_model_checks import SCHEDULES as TEXT_SCHEDULES, chunked_logits, prompt

    folder, hf = releases[kind]
    ids = [t if t != hf.config.image_token_id else 7 for t in prompt()]
    model = load_model(str(folder))
    assert model.model.rotary_emb.mrope is not None  # the sections are there, unused without image positions
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    for sizes in TEXT_SCHEDULES.values():
        assert max_diff(chunked_logits(model, ids, sizes), want) < TOL


# ---- each part matters -----------------------------------------------------------------------------------------------

def _raster_rope(grid, merge, head_dim, theta, device, rope=qv.vision_rope):
    return rope(grid, 1, head_dim, theta, device)  # the patches' rotations in raster order, not merge-block order


def _no_vision_rope(grid, merge, head_dim, theta, device):
    n = grid[0] * grid[1] * grid[2]
    return torch.ones(n, 1, head_dim // 2, device=device), torch.zeros(n, 1, head_dim // 2, device=device)


def _image_order(layout):
    def unordered(self, grid, device):
        order, full, windows = layout(self, grid, device)
        return torch.arange(len(order), device=device), full, windows  # windows of consecutive merge blocks
    return unordered


# part -> how it is switched off: (the rope table's edit, the model's, the encoder class's attribute, the encoder's)
PARTS = {
    "multimodal positions": "rope", "delta past the prompt": "rope", "mrope sections": "model",
    "vision 2D rope": "encoder", "vision rope in merge-block order": "encoder", "QuickGELU": "encoder",
    "window attention": "encoder", "full-attention block": "encoder", "window order": "encoder",
}
KIND_PARTS = [(kind, part) for kind in KINDS for part in PARTS
              if kind == "qwen2_5_vl" or part not in ("window attention", "full-attention block", "window order")
              if kind == "qwen2_vl" or part != "QuickGELU"]


@pytest.mark.parametrize("kind,part", KIND_PARTS)
def test_each_part_shows_in_the_logits(releases, kind, part, monkeypatch):
    """Each distinctive part switched off moves the logits (chunks and decode steps) away from transformers'."""
    folder, hf = releases[kind]
    _, ids, mm = expanded(folder)
    ids = ids + GENERATED
    rope = rope_table(mm, len(ids))
    model = load_model(str(folder))
    encoder = qv.Qwen2VLImageEncoder if kind == "qwen2_vl" else qv.Qwen2_5_VLImageEncoder
    if part == "multimodal positions":
        rope = torch.arange(len(ids)).expand(3, -1)
    elif part == "delta past the prompt":
        rope[:, PROMPT:] = torch.arange(PROMPT, len(ids))
    elif part == "mrope sections":
        model.model.rotary_emb.mrope = mrope_axes({"mrope_section": [3, 3, 2]}, 16)
    elif part == "vision 2D rope":
        monkeypatch.setattr(qv, "vision_rope", _no_vision_rope)
    elif part == "vision rope in merge-block order":
        monkeypatch.setattr(qv, "vision_rope", _raster_rope)
    elif part == "QuickGELU":
        monkeypatch.setattr(qv, "vision_activation", lambda name, field: torch.nn.functional.gelu)
    elif part == "window attention":
        monkeypatch.setattr(encoder, "_full", lambda self, block: True)
    elif part == "full-attention block":
        monkeypatch.setattr(encoder, "_full", lambda self, block: False)
    else:
        monkeypatch.setattr(encoder, "_layout", _image_order(encoder._layout))
    ours = image_logits(model, ids, mm, encoded(folder, mm), SCHEDULES["chunked+decode"], rope)
    # (QuickGELU and GELU differ by 0.02 at most anywhere: that mistake moves the logits less, still ten times TOL)
    assert max_diff(ours, reference(hf, ids, mm)) > (10 * TOL if part == "QuickGELU" else MOVED)


# ---- refusals --------------------------------------------------------------------------------------------------------

REFUSED = {  # an edit of the whole config -> what the ValueError says
    "mrope sections": (lambda c: c.text_config.rope_parameters.update(mrope_section=[2, 3, 2]),
                       r"rope_parameters\.mrope_section=\[2, 3, 2\] must split the 8 rotated frequencies"),
    "interleaved": (lambda c: c.text_config.rope_parameters.update(mrope_interleaved=True),
                    r"rope_parameters\.mrope_interleaved=True .* not supported"),
    "activation": (lambda c: setattr(c.vision_config, "hidden_act", "swish"),
                   r"vision_config\.hidden_act='swish' is not supported"),
    "vision rope": (lambda c: setattr(c.vision_config, "rope_parameters", {"rope_type": "yarn"}),
                    r"vision_config\.rope_parameters\.rope_type='yarn' is not supported"),
    "window": (lambda c: setattr(c.vision_config, "window_size", 14),
               r"vision_config\.window_size=14 is narrower than one merge block"),
    "full blocks": (lambda c: setattr(c.vision_config, "fullatt_block_indexes", [1, 3]),
                    r"vision_config\.fullatt_block_indexes names blocks \[3\] outside the tower's depth=3"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_settings_are_refused(releases, case):
    folder, _ = releases["qwen2_5_vl"]
    config = read_config(str(folder))
    edit, message = REFUSED[case]
    edit(config)
    with pytest.raises(ValueError, match=message):
        qv.Qwen2_5_VLImageEncoder(config)


def test_mismatches_are_refused(releases):
    """A processor whose merge size differs from the tower's, an image whose pixels do not fit its grid, a checkpoint
    lacking a tensor of the tower, image positions for a text model without sections: each a ValueError by name."""
    from specray.models.layers import RotaryEmbedding

    folder, _ = releases["qwen2_vl"]
    config = read_config(str(folder))
    config.vision_config.spatial_merge_size = 1
    with pytest.raises(ValueError, match=r"merge_size=2 differs from vision_config\.spatial_merge_size=1"):
        qv.QwenVLImageProcessor.from_pretrained(folder, config)
    processor, _, mm = expanded(folder)
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    data = {k: torch.from_numpy(v) for k, v in mm.items[0].data.items()}
    with pytest.raises(ValueError, match=r"image_grid_thw \(1, 4, 8\) does not fit"):
        encoder.encode({**data, "image_grid_thw": torch.tensor([[1, 4, 8]])})
    weights = [(n, t) for n, t in encoder.state_dict().items() if n != "merger.ln_q.bias"]
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) of the vision tower: \['visual\.merger\.ln_q\.bias'\]"):
        encoder.load_weights([("visual." + n, t) for n, t in weights])
    rotary = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 1e4}, 64)
    with pytest.raises(ValueError, match=r"rope_parameters\.mrope_section=None must split"):
        rotary.multimodal(torch.zeros(3, 2, dtype=torch.long), torch.float32)


# ---- tensor parallel -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2])
def test_ranks_equal_one_rank(releases, tmp_path, stages):
    """Two tensor-parallel ranks (the text model's heads, MLP and vocabulary split, the encoder whole on each), or two
    pipeline stages (the image rows taken in on the first, the positions used on both), give one rank's logits with
    images: chunks splitting the images' spans, then decode steps."""
    runs = []
    for kind in KINDS:
        folder, _ = releases[kind]
        _, ids, mm = expanded(folder)
        runs.append((folder, ids + GENERATED, mm, SCHEDULES["chunked+decode"]))
    assert_ranks_equal_one_rank(tmp_path, runs, stages, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("kind", KINDS)
def test_engine_greedy_with_images_equals_transformers(releases, kind, graphs):
    """``LLM.generate`` with two images (prefill chunks of 16 tokens, which split both images' spans; n-gram drafts
    verified with multimodal positions past the prompt) gives transformers' greedy ``generate`` tokens, token for
    token, beside a text-only prompt in the same batch; some drafts are accepted; transformers without the images
    generates other tokens. With graphs, the decode steps holding the image request (their positions shifted by its
    delta) replay from graphs of their own."""
    from specray import LLM

    folder, hf = releases[kind]
    part = "<|vision_start|><|image_pad|><|vision_end|>"
    text, plain_text = TEXT_BEFORE + part + BETWEEN + part + AFTER, "The quick brown fox"
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16,
              speculative_config=NGRAM, enforce_eager=not graphs)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf, hf_processor(kind, folder), text, images(), plain_text)
    runner = llm.engine.executor.worker.runner
    assert graphs == any(key[-1] == "rope" for key in (runner.graphs.graphs if runner.graphs else ()))


@pytest.mark.parametrize("method", ["eagle", "eagle3-tree"])
def test_a_multimodal_rope_head_takes_the_targets_position_ids(releases, tmp_path, monkeypatch, method):
    """A hidden-state head whose config rotates by multimodal RoPE (its ``mrope_section``, as heads for the Qwen VLs
    have) drafts for a request with images at the target's position ids: the prompt's table columns on its first
    passes, past the prompt each position plus the request's delta on every axis (its chain steps, its tree's
    nodes); greedy output equals plain greedy output (lossless)."""
    import json

    from specray import LLM, SamplingParams
    from specray.models.draft_head import DraftHead
    from specray_test_draft_heads import write_random_head  # tests/draft_heads.py

    folder, _ = releases["qwen2_vl"]
    method, tree = method.removesuffix("-tree"), method.endswith("-tree")
    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text(json.dumps(json.loads((folder / "config.json").read_text())["text_config"]))
    head = write_random_head(tmp_path / method, method, text, **({"aux_layers": [0, 1]} if method == "eagle3" else {}))
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "rope_parameters": TEXT["rope_parameters"]}))
    seen, rotated = [], []
    forward, multimodal = DraftHead.forward, RotaryEmbedding.multimodal

    def record(self, input_ids, features, meta):  # the ids each head pass gets, and that its layer rotates by them
        seen.append((meta.positions.tolist(), None if meta.rope_positions is None else meta.rope_positions.tolist()))
        rotated.clear()
        out = forward(self, input_ids, features, meta)
        assert rotated == [self.rotary_emb]
        return out

    monkeypatch.setattr(RotaryEmbedding, "multimodal", lambda self, *a: rotated.append(self) or multimodal(self, *a))

    spec = {"method": method, "model": str(head), "num_speculative_tokens": 5 if tree else 3, "adaptive": False,
            **({"use_dynamic_tree": True, "dynamic_tree_max_topK": 2, "dynamic_tree_depth": 3} if tree else {})}
    prompt = {"prompt_token_ids": prompt_ids(folder), "multi_modal_data": {"image": images()}}
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kw = dict(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16, enforce_eager=True)
    want = LLM(**kw).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setattr(DraftHead, "forward", record)
    drafted = LLM(**kw, speculative_config=spec)
    assert drafted.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
    _, ids, mm = expanded(folder)
    assert mm.rope_delta != 0
    past = 0
    for positions, rope in seen:
        assert rope is not None
        for j, p in enumerate(positions):
            expect = [axis[p] for axis in mm.rope_positions] if p < len(ids) else [p + mm.rope_delta] * 3
            assert [axis[j] for axis in rope] == expect, (p, j)
            past += p >= len(ids) + 1  # a chain step's or a tree node's row
    assert past > 0
