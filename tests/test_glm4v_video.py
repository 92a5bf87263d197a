"""GLM-4.1V's and GLM-4.5V's videos (``specray.models.glm4v_video``, served by ``glm4v``'s processor and tower) against
transformers' whole ``Glm4vForConditionalGeneration`` / ``Glm4vMoeForConditionalGeneration`` on the same random tiny
fp32 weights. The expanded prompt (each frame pair's ``<|begin_of_image|>``, ``<|image|>`` tokens, ``<|end_of_image|>``
and whole-second time), the sampled frames, pixels and grids equal transformers' ``Glm4vProcessor``'s (its
torchvision-only video processor: compared live where torchvision imports, always against digests recorded with it);
the multimodal RoPE positions equal ``get_rope_index``; each video's embeddings equal ``get_video_features``'; the
text model fed them gives transformers' logits with two videos over a prefill and over chunks splitting both spans;
the engine's greedy tokens (``LLM.generate`` with ``{"video": ...}``, n-gram drafts) equal transformers'
``generate``. Each distinctive part broken once shows; what is not served is refused by name. (transformers places a
GLM-4V video's embeddings at its ``<|image|>`` tokens, as an image's, so it cannot take an image and a video in one
prompt: prompts here hold videos only.)"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models import glm4v_video as gv
from specray.models.glm4v import Glm4vImageProcessor
from specray.models.loader import load_model, read_config
from specray.multimodal import VideoFrames, expand_prompt
from specray_test_image_checks import private_env, encoded, image_logits, rope_table  # tests/image_checks.py
from specray_test_model_checks import max_diff  # tests/model_checks.py
from tests.test_glm4v import build_release

TOL = 1e-4
MOVED = 1e-2
SETTINGS = {"size": {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 2 * 64}, "patch_size": 14,
            "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "fps": 2,
            "video_processor_type": "Glm4vVideoProcessor"}
# a video of bare frames (taken as given: 5 frames, 3 pairs at 0 s) and one of 6 frames at 1 a second (all taken:
# pairs at 0, 2 and 4 s)
VIDEOS = [(5, 50, 80, None), (6, 60, 60, 1.0)]
VPART = "<|begin_of_video|><|video|><|end_of_video|>"
PROMPT = "Hello world!" + VPART + " and then " + VPART + " The fox."
GRIDS = [[[3, 4, 6]], [[3, 4, 4]]]
# sha256 of each video's pixel_values_videos (float32 bytes) as transformers' Glm4vVideoProcessor made them
# (torchvision 0.28, CPU; test_processor_equals_transformers_live)
DIGESTS = ["68b10cbc17ac9d81b2eb23ddf84d5096e7289d6c603b1c14ef4ce17f2487179f",
           "6389edd50e50fbc4df37b22eb4d56aefcc4bcd65ba4f50097fec22d76446ea56"]
GENERATED = [17, 42, 99, 75, 230, 61, 28, 150]
KINDS = ["glm4v", "glm4v_moe"]


def videos() -> list:
    from PIL import Image

    rng = np.random.default_rng(1)
    out = []
    for t, h, w, fps in VIDEOS:
        frames = VideoFrames(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(t))
        frames.fps = fps
        out.append(frames)
    return out


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    built = {}

    def get(kind: str):
        if kind not in built:
            folder, model = build_release(kind, tmp_path_factory.mktemp(kind), len(built))
            (folder / "video_preprocessor_config.json").write_text(json.dumps(SETTINGS))
            built[kind] = folder, model
        return built[kind]
    return get


def expanded(folder: Path, prompt: str = PROMPT, clips=None):
    from transformers import AutoTokenizer

    processor = Glm4vImageProcessor.from_pretrained(folder, read_config(str(folder)))
    ids = AutoTokenizer.from_pretrained(str(folder))(prompt)["input_ids"]
    ids, mm = expand_prompt(ids, [], processor, videos() if clips is None else clips)
    return processor, ids, mm


REFERENCE = r"""
import sys, numpy as np, json
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Glm4vProcessor, Glm4vVideoProcessor
from transformers.video_utils import VideoMetadata
folder, out, prompt, part = sys.argv[1:5]
rng = np.random.default_rng(1)
vids = [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(t)] for t, h, w, _ in %r]
proc = Glm4vProcessor(image_processor=AutoImageProcessor.from_pretrained(folder),
                      tokenizer=AutoTokenizer.from_pretrained(folder),
                      video_processor=Glm4vVideoProcessor.from_pretrained(folder))
bare = proc(text=["Hi" + part], videos=[vids[0]], do_sample_frames=False, return_tensors="np")
timed = proc(text=["Ho" + part], videos=[vids[1]], video_metadata=[VideoMetadata(total_num_frames=6, fps=1.0)],
             return_tensors="np")
rng = np.random.default_rng(3)
clip = [Image.fromarray(rng.integers(0, 256, (32, 64, 3), dtype=np.uint8)) for _ in range(32)]
long = proc(text=["Hi" + part], videos=[clip], video_metadata=[VideoMetadata(total_num_frames=32, fps=3.1)],
            return_tensors="np")
res = {}
for name, got in (("bare", bare), ("timed", timed), ("long", long)):
    np.save(out + "/" + name + ".npy", got["pixel_values_videos"])
    res[name] = {"ids": got["input_ids"][0].tolist(), "grid": got["video_grid_thw"].tolist()}
json.dump(res, open(out + "/o.json", "w"))
"""


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


def test_processor_equals_transformers_live(releases, tmp_path):
    """Where torchvision imports (a folder holding it named by ``LLAMA4_TORCHVISION_PATH``), transformers' own
    ``Glm4vProcessor`` with its ``Glm4vVideoProcessor`` gives our prompt ids, pixels and grids: bare frames (ours
    taken as given; transformers' with ``do_sample_frames=False``), frames at 1 a second, and 32 frames at 3.1 a
    second (sampled to 2 a second: 22 frames, whole-second times 0 to 10)."""
    from PIL import Image
    from transformers import AutoTokenizer

    env = private_env(["LLAMA4_TORCHVISION_PATH"], "torchvision", "transformers' Glm4vVideoProcessor", None)
    folder, _ = releases("glm4v")
    script = tmp_path / "reference.py"
    script.write_text(REFERENCE % (VIDEOS,))
    run = subprocess.run([sys.executable, str(script), str(folder), str(tmp_path), PROMPT, VPART], env=env,
                         capture_output=True, timeout=120, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    want = json.loads((tmp_path / "o.json").read_text())
    rng = np.random.default_rng(3)
    clip = VideoFrames(Image.fromarray(rng.integers(0, 256, (32, 64, 3), dtype=np.uint8)) for _ in range(32))
    clip.fps = 3.1
    cases = {"bare": ("Hi", videos()[0]), "timed": ("Ho", videos()[1]), "long": ("Hi", clip)}
    for name, (text, frames) in cases.items():
        _, ids, mm = expanded(folder, text + VPART, [frames])
        assert ids == want[name]["ids"], name
        assert mm.items[0].data["video_grid_thw"].tolist() == want[name]["grid"], name
        assert np.array_equal(mm.items[0].data["pixel_values_videos"], np.load(tmp_path / f"{name}.npy")), name
    assert want["long"]["grid"][0][0] == 11
    text = AutoTokenizer.from_pretrained(str(folder)).decode(want["long"]["ids"])
    assert "<|end_of_image|>10<|end_of_video|>" in text


def hf_inputs(hf, ids: list[int], mm) -> dict:
    """transformers' model inputs for ``ids`` with the videos' tensors and token types (as its processor gives)."""
    arrays = {key: [item.data[key] for item in mm.items] for key in ("pixel_values_videos", "video_grid_thw")}
    input_ids = torch.tensor([ids])
    inside = (torch.cumsum(input_ids == hf.config.video_start_token_id, 1)
              > torch.cumsum(input_ids == hf.config.video_end_token_id, 1))
    types = ((input_ids == hf.config.image_token_id) * torch.where(inside, 2, 1)).int()
    return dict(input_ids=input_ids, mm_token_type_ids=types,
                **{k: torch.from_numpy(np.concatenate(v)) for k, v in arrays.items()})


@torch.no_grad()
def reference(hf, ids: list[int], mm) -> torch.Tensor:
    return hf(**hf_inputs(hf, ids, mm)).logits[0]


def test_items_timestamps_and_positions(releases):
    """The two videos' spans (3 frame pairs each; the second's times 0, 2, 4 s), their pixels hash to what
    transformers' processor made, only their ``<|image|>`` rows take embeddings; the prompt's multimodal RoPE
    positions and the delta past it equal transformers' ``get_rope_index``."""
    from transformers import AutoTokenizer

    folder, hf = releases("glm4v")
    _, ids, mm = expanded(folder)
    assert [i.data["video_grid_thw"].tolist() for i in mm.items] == GRIDS
    assert [_digest(i.data["pixel_values_videos"]) for i in mm.items] == DIGESTS
    text = AutoTokenizer.from_pretrained(str(folder)).decode(ids[mm.items[1].offset:mm.items[1].end])
    pair = "<|begin_of_image|>" + "<|image|>" * 4 + "<|end_of_image|>"
    assert text.replace(" ", "") == pair + "0" + pair + "2" + pair + "4"
    for item in mm.items:
        assert [ids[item.offset + r] for r in item.embed_rows] == [hf.config.image_token_id] * len(item.embed_rows)
    inputs = hf_inputs(hf, ids + GENERATED, mm)
    inputs.pop("pixel_values_videos")
    positions, delta = hf.model.get_rope_index(inputs.pop("input_ids"), **inputs)
    assert torch.equal(rope_table(mm, len(ids) + len(GENERATED)), positions[:, 0])
    assert mm.rope_delta == int(delta)


def test_sampling_equals_transformers():
    """Frames of a known rate are sampled as transformers' ``sample_frames`` (short and past ``max_duration``)."""
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor  # (its sampling: no torchvision)
    from transformers.video_utils import VideoMetadata

    ours = gv.Glm4vVideoFrames({**SETTINGS, "max_duration": 20}, {})
    theirs = Glm4vVideoProcessor.__new__(Glm4vVideoProcessor)
    theirs.fps, theirs.max_duration = 2, 20
    for total, fps in ((32, 3.1), (41, 4.0), (7, 30.0), (300, 10.0), (90, 2.0), (6, 1.0), (20, 0.7)):
        want = theirs.sample_frames(VideoMetadata(total_num_frames=total, fps=fps))
        assert ours.indices(total, fps).tolist() == want.tolist(), (total, fps)
    assert ours.indices(5, None).tolist() == list(range(5))


def test_encoder_equals_transformers_video_features(releases):
    """Each video's embeddings [t*h*w / merge², text hidden] equal transformers' ``get_video_features``'s."""
    folder, hf = releases("glm4v")
    _, _, mm = expanded(folder)
    for item, ours in zip(mm.items, encoded(folder, mm)):
        with torch.no_grad():
            out = hf.model.get_video_features(torch.from_numpy(item.data["pixel_values_videos"]),
                                              torch.from_numpy(item.data["video_grid_thw"]), return_dict=True)
        assert ours.shape == (len(item.embed_rows), 64) and max_diff(ours, out.pooler_output[0]) < TOL


# a prefill; chunks that split both videos' spans (tokens 10-36 and 45-65 of 72), then single steps
SCHEDULES = {"prefill": None, "chunked+decode": [14, 20, 25]}


@pytest.mark.parametrize("kind,schedule", [("glm4v", "prefill"), ("glm4v", "chunked+decode"),
                                           ("glm4v_moe", "chunked+decode")])
def test_logits_with_videos_equal_transformers(releases, kind, schedule):
    """Our text model with the videos' embeddings and multimodal RoPE positions gives transformers' whole model's
    logits over the prompt and more tokens: one prefill, or chunks splitting both spans, then decode steps."""
    folder, hf = releases(kind)
    _, ids, mm = expanded(folder)
    ids = ids + GENERATED
    ours = image_logits(load_model(str(folder)), ids, mm, encoded(folder, mm), SCHEDULES[schedule])
    assert max_diff(ours, reference(hf, ids, mm)) < TOL


PARTS = ["frames at their own start", "time text", "frames as one image"]


@pytest.mark.parametrize("part", PARTS)
def test_each_part_shows_in_the_logits(releases, part, monkeypatch):
    """Each distinctive part switched off moves the logits away from transformers': each frame pair at the video's
    start (its pair index instead, as Qwen2-VL's), the times' text (all written 0), the frame pairs encoded as one
    grid's position rows (a tower fed a grid of one frame pair holding all of them)."""
    folder, hf = releases("glm4v")
    _, ids, mm = expanded(folder)
    want = reference(hf, ids + GENERATED, mm)
    if part == "time text":
        monkeypatch.setattr(gv.Glm4vVideoFrames, "timestamps", lambda self, i, fps, pairs: [0] * pairs)
        _, ids, mm = expanded(folder)
    ids = ids + GENERATED
    embeds = encoded(folder, mm)
    rope = None
    if part == "frames at their own start":
        rope = rope_table(mm, len(ids))
        for item in mm.items:
            rows = [item.offset + r for r in item.embed_rows]
            per = len(rows) // 3
            rope[0, rows[per:]] += 1
    elif part == "frames as one image":
        import dataclasses
        import types

        flat = []
        for item in mm.items:
            t, h, w = item.data["video_grid_thw"][0]
            data = {**item.data, "video_grid_thw": np.array([[1, t * h, w]])}
            flat.append(dataclasses.replace(item, data=data))
        embeds = encoded(folder, types.SimpleNamespace(items=flat))
    ours = image_logits(load_model(str(folder)), ids, mm, embeds, SCHEDULES["chunked+decode"], rope=rope)
    assert max_diff(ours, want) > MOVED


def test_refusals(releases, tmp_path):
    """A video shorter than a frame pair, unsupported video settings (images still served), a config without the
    image marks: each refused by name."""
    import shutil

    from PIL import Image

    folder, _ = releases("glm4v")
    processor = Glm4vImageProcessor.from_pretrained(folder, read_config(str(folder)))
    with pytest.raises(ValueError, match=r"a video of 1 frames is shorter than temporal_patch_size=2"):
        processor.process_video([Image.new("RGB", (64, 64))])
    copy = tmp_path / "release"
    shutil.copytree(folder, copy)
    (copy / "video_preprocessor_config.json").write_text(json.dumps({**SETTINGS, "resample": 2}))
    processor = Glm4vImageProcessor.from_pretrained(copy, read_config(str(copy)))
    with pytest.raises(ValueError, match=r"resample=2 is not supported"):
        processor.process_video(videos()[0])
    assert processor.process(Image.new("RGB", (60, 100))).replacement
    config = read_config(str(folder))
    config.image_start_token_id = None
    with pytest.raises(ValueError, match=r"lacks image_start_token_id"):
        Glm4vImageProcessor.from_pretrained(folder, config).process_video(videos()[0])


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


@pytest.mark.parametrize("kind", KINDS)
def test_engine_greedy_with_videos_equals_transformers(releases, kind):
    """``LLM.generate`` with two videos (bare frames as an array [T, H, W, 3]; frames of a known rate) in prefill
    chunks of 16 tokens splitting the spans, n-gram drafts verified at multimodal positions past the prompt, gives
    transformers' greedy ``generate`` tokens; the videos matter (transformers without them generates others)."""
    from specray import LLM, SamplingParams

    folder, hf = releases(kind)
    steps = 16
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16,
              speculative_config=NGRAM, enforce_eager=True)
    clips = videos()
    clips[0] = np.stack([np.asarray(frame) for frame in clips[0]])
    out = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"video": clips}}],
                       SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True), use_tqdm=False)[0]
    _, ids, mm = expanded(folder)
    greedy = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(**hf_inputs(hf, ids, mm), **greedy)[0, len(ids):].tolist()
        blind = hf.generate(torch.tensor([ids]), **greedy)[0, len(ids):].tolist()
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == want != blind
    assert llm.spec_stats.accepted_tokens > 0


def test_ranks_equal_one_rank(releases, tmp_path):
    """Two tensor-parallel ranks (the text model split, the tower whole on each) give one rank's logits with the
    videos, GLM-4.1V and GLM-4.5V: chunks splitting both spans, then decode steps."""
    from specray_test_image_checks import assert_ranks_equal_one_rank  # tests/image_checks.py

    runs = []
    for kind in KINDS:
        folder, _ = releases(kind)
        _, ids, mm = expanded(folder)
        runs.append((folder, ids + GENERATED, mm, SCHEDULES["chunked+decode"]))
    assert_ranks_equal_one_rank(tmp_path, runs, 1, TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_videos_on_the_gpu_equal_the_cpu(releases):
    """fp32 on CUDA: the videos' embeddings, and the text model's logits with them (chunks splitting both spans,
    then decode steps), equal the CPU's."""
    from specray.models.loader import load_image_encoder
    from specray_test_model_checks import first_module_divergence

    folder, _ = releases("glm4v")
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
