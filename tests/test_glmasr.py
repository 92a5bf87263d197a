"""GLM-ASR's audio (``GlmAsrForConditionalGeneration``, :mod:`specray.models.glmasr`) against transformers on the same
tiny random fp32 weights: our processor's expanded prompt, log-mel features and frame masks equal ``GlmAsrProcessor``'s
for two audios of different lengths (windows of 2 s here, so the 2.7 s audio takes two; also the release's 30 s
windows, and an audio cut at ``max_audio_len``); each audio's embeddings equal ``get_audio_features``' (fp32, max abs
diff < 1e-4), read from the release's layout and transformers' modules'; the Llama text model (the release's
``_TEXT_PARTS``) fed them (``meta.input_embeds``) gives transformers' whole model's logits over a prompt holding both
audios, in one prefill and in chunks splitting each audio's span, then decode steps. Two tensor-parallel ranks equal
one; the engine's greedy tokens with an audio (chunks splitting its span, n-gram drafts) equal transformers'
``generate``, and ``LLM.chat`` with an input_audio part (the release's chat template) answers as transformers'
``apply_transcription_request`` prompt does. Each distinctive part broken once moves the embeddings; what is not
served is refused by name. The tiny release is built here."""

from __future__ import annotations

import base64
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models import glmasr as ga
from specray.models.layers import RotaryEmbedding, rope_parameters
from specray.models.loader import load_image_encoder, load_image_processor, load_model, read_config
from specray.models.vision_towers import VISION_ACTIVATIONS
from specray.multimodal import expand_prompt
from specray_test_audio_checks import wav_bytes
from specray_test_image_checks import (assert_ranks_equal_one_rank, config_with, encode_items,  # tests/image_checks.py
                                       first_cut, image_logits)
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the embeddings or logits at least this much (a hundred times TOL)
SR = 16000
SPECIAL = ("<|system|>", "<|user|>", "<|assistant|>", "<|begin_of_audio|>", "<|end_of_audio|>", "<|pad|>")
# the encoder: 8-wide heads (half of each rotated), two key/value heads for four query heads, 16 mel bins
AUDIO = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             num_mel_bins=16)
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1)
WINDOW_S = 2  # the tiny feature extractor's chunk_length: 200 frames a window, 25 embeddings
SECONDS = (1.3, 2.7)  # 130 frames (16 embeddings); 200 + 70 frames in two windows (33 embeddings)
# GLM-ASR-Nano-2512's chat template (transformers' convert_glmasr_weights_to_hf.py writes it into the release): an
# audio part renders the placeholder between the audio marks, then a new user turn
TEMPLATE = """{%- macro to_text(content) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for item in content -%}
{%- if item is mapping and item.type == 'text' and item.text is defined -%}
{{- item.text -}}
{%- elif item is mapping and (item.type == 'audio' or 'audio' in item) -%}
<|begin_of_audio|><|pad|><|end_of_audio|><|user|>
{% elif item is string -%}
{{- item -}}
{%- endif -%}
{%- endfor -%}
{%- else -%}
{{- content -}}
{%- endif -%}
{%- endmacro -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
<|system|>
{{ to_text(m.content) | trim }}
{%- elif m.role == 'user' -%}
<|user|>
{{ to_text(m.content) | trim }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{{ to_text(m.content) | trim }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>
{% endif -%}"""
PART = "<|begin_of_audio|><|pad|><|end_of_audio|>"
ASK = "<|user|>\nPlease transcribe this audio into text<|assistant|>\n"
ONE = "<|user|>\n" + PART + ASK  # a prompt of one audio, as the template renders a transcription request
TWO = "<|user|>\n" + PART + " then " + PART + ASK  # two audios in one prompt (the model takes it; the processor not)
GENERATED = [17, 42, 99, 75, 230, 61]  # tokens past the prompt (decode steps)


def waves(seconds=SECONDS) -> list[np.ndarray]:
    """One synthetic waveform per duration (three tones and noise, seed 0), float32 at 16 kHz."""
    rng = np.random.default_rng(0)
    out = []
    for s in seconds:
        t = np.arange(int(s * SR)) / SR
        amps, freqs, phases = rng.uniform(0.1, 0.4, 3), rng.uniform(100, 3000, 3), rng.uniform(0, 6.28, 3)
        tone = sum(a * np.sin(2 * np.pi * f * t + p) for a, f, p in zip(amps, freqs, phases))
        out.append((tone + 0.05 * rng.standard_normal(len(t))).astype(np.float32))
    return out


def save_processor(path: Path, tok, chunk_length: int = WINDOW_S, max_audio_len: int = 655) -> None:
    from transformers import GlmAsrProcessor, WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=AUDIO["num_mel_bins"], chunk_length=chunk_length)
    GlmAsrProcessor(feature_extractor=extractor, tokenizer=tok, chat_template=TEMPLATE,
                    max_audio_len=max_audio_len).save_pretrained(path)


def build_release(path: Path) -> tuple[Path, object]:
    """transformers' whole ``GlmAsrForConditionalGeneration`` at :data:`AUDIO` / :data:`TEXT` sizes (its head tied,
    as the release's) with random weights drawn where each part shows, saved with ``GlmAsrProcessor`` (conftest's
    tiny tokenizer with the release's special tokens, a Whisper feature extractor of 2 s windows, the template)."""
    from transformers import GlmAsrConfig, GlmAsrForConditionalGeneration

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=SPECIAL)
    config = GlmAsrConfig(audio_config=AUDIO, audio_token_id=tok.convert_tokens_to_ids("<|pad|>"),
                          text_config={**TEXT, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                                       "pad_token_id": tok.pad_token_id, "bos_token_id": None})
    torch.manual_seed(0)
    model = GlmAsrForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "audio_tower" not in name and "multi_modal_projector" not in name:
                continue
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
            else:  # unit-scale rows (q and k larger: attention far from uniform, where RoPE shows; fc1 larger:
                # its outputs over the range where the GELUs differ)
                wide = 2.0 if ("q_proj" in name or "k_proj" in name) else 2.0 if "fc1" in name else 1.0
                p.normal_(0.0, wide * p[0].numel() ** -0.5)
    model.save_pretrained(path)
    save_processor(path, tok)
    return path, model


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, object]:
    return build_release(tmp_path_factory.mktemp("glmasr"))


def hf_processor(folder: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(folder))


def ours(folder: Path):
    config = read_config(str(folder))
    return load_image_processor(str(folder), config), load_image_encoder(str(folder), config, torch.float32, "cpu")


def expanded(folder: Path, text: str, audios: list):
    """Our expanded prompt's ids and MultiModalInputs (the seam's expand_prompt with our processor)."""
    from transformers import AutoTokenizer

    processor = load_image_processor(str(folder))
    return expand_prompt(AutoTokenizer.from_pretrained(str(folder)).encode(text), [], processor, audios=audios)


# ---- the processor ---------------------------------------------------------------------------------------------------

def _assert_items_equal_transformers(folder: Path, audios: list, want_counts: list[int]) -> None:
    """Each audio alone in a prompt: our ids, features and masks equal GlmAsrProcessor's (one call per audio, and
    one batched call of all: its windows in order)."""
    theirs = hf_processor(folder)
    batch = theirs(text=[ONE] * len(audios), audio=audios)
    features, masks = [], []
    for audio, count in zip(audios, want_counts):
        want = theirs(text=[ONE], audio=[audio])
        ids, mm = expanded(folder, ONE, [audio])
        assert ids == want["input_ids"][0].tolist()
        (item,) = mm.items
        assert item.modality == "audio" and item.length == count and item.embed_rows is None
        assert set(ids[item.offset:item.end]) == {theirs.audio_token_id} and mm.rope_positions is None
        assert np.array_equal(item.data["input_features"], want["input_features"].numpy())
        assert np.array_equal(item.data["input_features_mask"], want["input_features_mask"].numpy())
        features.append(item.data["input_features"])
        masks.append(item.data["input_features_mask"])
    assert np.array_equal(np.concatenate(features), batch["input_features"].numpy())
    assert np.array_equal(np.concatenate(masks), batch["input_features_mask"].numpy())


def test_processor_matches_transformers(release, tmp_path):
    """Two audios of 1.3 s and 2.7 s: our expanded prompt, features [windows, 16, 200] and frame masks equal
    GlmAsrProcessor's (one window of 130 frames: 16 placeholders; two windows of 200 and 70 frames: 33); with the
    release's 30 s windows (3000 frames: one window each); with max_audio_len 2 s (one window) the 1.3 s audio as
    transformers' and the 2.7 s one refused (transformers would keep its first 2 s)."""
    folder, _ = release
    processor = load_image_processor(str(folder))
    assert isinstance(processor, ga.GlmAsrAudioProcessor) and processor.image_token_id is None
    assert processor.sampling_rate == SR and processor.audio_token_id == hf_processor(folder).audio_token_id
    _assert_items_equal_transformers(folder, waves(), [16, 33])
    assert [processor.process_audio(w).data["input_features"].shape for w in waves()] == [(1, 16, 200), (2, 16, 200)]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    for name, window, longest, served in [("release_windows", 30, 655, 2), ("cut", WINDOW_S, 2, 1)]:
        variant = tmp_path / name
        shutil.copytree(folder, variant)
        save_processor(variant, tok, window, longest)
        _assert_items_equal_transformers(variant, waves()[:served], [16, 33][:served])
    with pytest.raises(ValueError, match="an audio of 2.70 s .* is longer than this model takes \\(2 s\\)"):
        expanded(variant, ONE, waves()[1:])


def test_embedding_counts_equal_transformers(release):
    """Our count of an audio's embeddings equals GlmAsrProcessor's ``_get_audio_token_length`` over many lengths;
    the encoder's rows per window, summed, equal it when the windows hold a multiple of 8 frames."""
    theirs = hf_processor(release[0])
    frames = torch.arange(1, 700)
    want = theirs._get_audio_token_length(frames).clamp(min=0).tolist()
    assert [ga.audio_embeds(f) for f in range(1, 700)] == want
    assert all(ga.audio_embeds(200) + ga.audio_embeds(f) == ga.audio_embeds(200 + f) for f in range(1, 200))


# ---- the encoder -----------------------------------------------------------------------------------------------------

def hf_features(hf, data_list: list[dict]) -> torch.Tensor:
    """transformers' ``get_audio_features`` rows for the items' windows batched together."""
    features = torch.from_numpy(np.concatenate([d["input_features"] for d in data_list]))
    mask = torch.from_numpy(np.concatenate([d["input_features_mask"] for d in data_list]))
    with torch.no_grad():
        return hf.model.get_audio_features(features, mask).pooler_output


def _relayout(folder: Path, into: Path) -> Path:
    """``folder`` with its tensors named as transformers' modules name them (``model.audio_tower.``,
    ``model.multi_modal_projector.``, ``model.language_model.``)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, into)
    tensors = load_file(str(into / "model.safetensors"))
    renamed = {("model.language_model." + n[len("language_model.model."):]) if n.startswith("language_model.model.")
               else "model." + n: t for n, t in tensors.items()}
    save_file(renamed, str(into / "model.safetensors"), metadata={"format": "pt"})
    return into


@pytest.mark.parametrize("layout", ["release", "modules"])
def test_encoder_matches_transformers(release, tmp_path, layout):
    """Each audio's embeddings (16 and 33 rows: the second's two windows' kept rows in order) equal transformers'
    ``get_audio_features`` over both audios' windows batched; read from the release's tensor names and from
    transformers' modules' (then the text model too: its logits equal transformers')."""
    folder, hf = release
    if layout == "modules":
        folder = _relayout(folder, tmp_path / "modules")
    _, encoder = ours(folder)
    assert isinstance(encoder, ga.GlmAsrAudioEncoder)
    ids, mm = expanded(folder, TWO, waves())
    got = encode_items(encoder, mm)
    assert [g.shape for g in got] == [(16, 64), (33, 64)]
    want = hf_features(hf, [item.data for item in mm.items])
    assert max_diff(torch.cat(got), want) < TOL
    if layout == "modules":
        assert max_diff(image_logits(load_model(str(folder)), ids, mm, got, None), reference(hf, ids, mm)) < TOL


def test_encoder_in_bfloat16(release):
    """Built under bfloat16 (the runner hands it bf16 features, the mask as integers), the encoder lands within
    bf16's rounding of transformers' fp32 embeddings."""
    folder, hf = release
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.bfloat16, "cpu")
    _, mm = expanded(folder, TWO, waves())
    with torch.no_grad():
        got = [encoder.encode({"input_features": torch.from_numpy(i.data["input_features"]).bfloat16(),
                               "input_features_mask": torch.from_numpy(i.data["input_features_mask"])})
               for i in mm.items]
    want = hf_features(hf, [item.data for item in mm.items])
    assert got[0].dtype == torch.bfloat16
    assert max_diff(torch.cat(got).float(), want) / want.abs().max().item() < 5e-2


# ---- the whole model -------------------------------------------------------------------------------------------------

@torch.no_grad()
def reference(hf, ids: list[int], mm) -> torch.Tensor:
    """transformers' whole model's logits [L, V] over ``ids`` with the items' windows batched in order."""
    features = torch.from_numpy(np.concatenate([i.data["input_features"] for i in mm.items]))
    mask = torch.from_numpy(np.concatenate([i.data["input_features_mask"] for i in mm.items]))
    return hf(input_ids=torch.tensor([ids]), input_features=features, input_features_mask=mask).logits[0]


@pytest.mark.parametrize("schedule", ["prefill", "chunked+decode"])
def test_logits_with_audio_match_transformers(release, schedule):
    """transformers' ``GlmAsrForConditionalGeneration(input_ids, input_features, input_features_mask)`` logits over a
    prompt holding both audios (then decode steps) == our Llama text model's with the encoder's rows in place of the
    placeholders: one prefill, or chunks ending inside the first audio's span, inside the second's (between its two
    windows' rows) and past it, then single steps; without the rows (the placeholders' own embeddings) they differ."""
    folder, hf = release
    ids, mm = expanded(folder, TWO, waves())
    first, second = mm.items
    ids = ids + GENERATED
    sizes = None
    if schedule == "chunked+decode":
        cut = first_cut(mm, 5)
        sizes = [cut, second.offset + 27 - cut, second.end + 3 - second.offset - 27]
    model = load_model(str(folder))
    embeds = encode_items(ours(folder)[1], mm)
    got = image_logits(model, ids, mm, embeds, sizes)
    want = reference(hf, ids, mm)
    assert max_diff(got, want) < TOL
    plain = image_logits(model, ids, type(mm)([]), [], None)
    assert max_diff(plain[first.offset:], want[first.offset:]) > MOVED


# ---- each part shows -------------------------------------------------------------------------------------------------

def _no_rope(encoder) -> None:  # cos 1, sin 0 at every position
    table = encoder.tower.rotary.cos_sin
    half = table.shape[1] // 2
    table[:, :half], table[:, half:] = 1.0, 0.0


def _whole_head_rotated(encoder) -> None:  # RoPE over the whole head, not its first half
    audio = read_config(str(encoder.folder)).audio_config
    params = {**rope_parameters(audio, partial=True), "partial_rotary_factor": 1.0}
    encoder.tower.rotary = RotaryEmbedding(audio.hidden_size // audio.num_attention_heads, params, 1500)


def _kv_heads_swapped(encoder) -> None:  # query heads read the other group's keys and values
    for layer in encoder.tower.layers:
        for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
            for p in (proj.weight, proj.bias):
                if p is not None:
                    p.data = torch.cat(p.data.chunk(2)[::-1])


def _convs_without_gelu(encoder) -> None:
    encoder.tower.conv_act = lambda x: x


def _no_final_norm(encoder) -> None:
    encoder.tower.norm = torch.nn.Identity()


def _frames_merged_backwards(encoder) -> None:  # the four frames concatenated last first
    encoder.merge = lambda h: h.view(h.shape[0], -1, ga.MERGE, h.shape[-1]).flip(2).flatten(2)


def _quick_gelu_in_the_layers(encoder) -> None:  # (the tanh GELU moves them by 2e-4 only: too close to tell)
    for layer in encoder.tower.layers:
        layer.mlp.act = VISION_ACTIVATIONS["quick_gelu"]


def _projector_relu(encoder) -> None:
    encoder.act = torch.relu


def _padding_not_encoded(encoder) -> None:  # each window's frames cut to its audio (rounded up to 8) before encoding
    encode = encoder.encode

    def cut(data):
        frames = -(-int(data["input_features_mask"].sum(-1).max()) // 8) * 8
        return encode({"input_features": data["input_features"][..., :frames],
                       "input_features_mask": data["input_features_mask"][..., :frames]})
    encoder.encode = cut


MUTATIONS = {"no-rope": _no_rope, "whole-head-rotated": _whole_head_rotated, "kv-heads-swapped": _kv_heads_swapped,
             "convs-without-gelu": _convs_without_gelu, "no-final-norm": _no_final_norm,
             "frames-merged-backwards": _frames_merged_backwards, "quick-gelu-in-the-layers": _quick_gelu_in_the_layers,
             "projector-relu": _projector_relu, "padding-not-encoded": _padding_not_encoded}


def test_each_part_shows_in_the_embeddings(release):
    """Each distinctive part switched off (or done another way) moves the audios' embeddings away from
    transformers'; unchanged, they match."""
    folder, hf = release
    _, mm = expanded(folder, TWO, waves())
    want = hf_features(hf, [item.data for item in mm.items])
    moved = {}
    for name, mutate in {"none": lambda e: None, **MUTATIONS}.items():
        encoder = ours(folder)[1]
        encoder.folder = folder
        with torch.no_grad():
            mutate(encoder)
        moved[name] = max_diff(torch.cat(encode_items(encoder, mm)), want)
    assert moved.pop("none") < TOL
    assert min(moved.values()) > MOVED, moved


# ---- refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,words", [
    (dict(audio_config__intermediate_size=64), "audio_config.intermediate_size=64"),
    (dict(audio_config__rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                          "partial_rotary_factor": 0.5}), "rope_type='linear'"),
    (dict(audio_config__num_key_value_heads=3), "num_key_value_heads=3"),
    (dict(audio_config__hidden_act="swish_glu"), "audio_config.hidden_act='swish_glu'"),
    (dict(projector_hidden_act="swish_glu"), "projector_hidden_act='swish_glu'")])
def test_unsupported_settings_are_refused(release, change, words):
    with pytest.raises(ValueError) as err:
        ga.GlmAsrAudioEncoder(config_with(release[0], **change))
    assert words in str(err.value)


def test_mismatched_processors_are_refused(release):
    """A folder whose processor disagrees with the model, windows the merge cannot take, a max_audio_len shorter
    than a window, an audio too short for one embedding, images, a checkpoint lacking an encoder tensor: each a
    ValueError by name."""
    from transformers import WhisperFeatureExtractor

    folder, _ = release
    config = read_config(str(folder))
    with pytest.raises(ValueError, match=r"audio_token '<\|pad\|>' is token \d+, but config.json's audio_token_id=5"):
        ga.GlmAsrAudioProcessor.from_pretrained(folder, config_with(folder, audio_token_id=5))
    with pytest.raises(ValueError, match="feature_size=16 differs from audio_config.num_mel_bins=32"):
        ga.GlmAsrAudioProcessor.from_pretrained(folder, config_with(folder, audio_config__num_mel_bins=32))
    extractor = WhisperFeatureExtractor(feature_size=16, chunk_length=1)
    with pytest.raises(ValueError, match=r"chunk_length=1 s hold 100 frames"):
        ga.GlmAsrAudioProcessor(extractor, config, 655)
    with pytest.raises(ValueError, match=r"max_audio_len=1 .* chunk_length=2"):
        ga.GlmAsrAudioProcessor(WhisperFeatureExtractor(feature_size=16, chunk_length=2), config, 1)
    processor = load_image_processor(str(folder))
    with pytest.raises(ValueError, match="too short"):
        processor.process_audio(np.zeros(960, dtype=np.float32))
    assert processor.process_audio(np.zeros(961, dtype=np.float32)).replacement == [config.audio_token_id]
    with pytest.raises(ValueError, match="takes no images"):
        expand_prompt([5, 6], ["image"], processor)
    encoder = ours(folder)[1]
    weights = [("audio_tower." + n[len("tower."):], t) for n, t in encoder.state_dict().items()
               if n.startswith("tower.") and n != "tower.norm.bias"]
    with pytest.raises(ValueError, match=r"lacks 5 tensor\(s\) .*'projector.linear_1.bias'.*'tower.norm.bias'"):
        encoder.load_weights(weights)


# ---- tensor parallel -------------------------------------------------------------------------------------------------

def test_two_ranks_equal_one_rank(release, tmp_path):
    """Two tensor-parallel ranks (the text model split, the encoder whole on each) give one rank's logits over both
    audios: chunks splitting the first audio's span, then decode steps."""
    folder, _ = release
    ids, mm = expanded(folder, TWO, waves())
    cut = first_cut(mm, 5)
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids + GENERATED, mm, [cut, len(ids) - cut])], 1, TOL)


# ---- the engine ------------------------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def test_engine_greedy_with_audio_equals_transformers(release):
    """``LLM.generate`` with the 2.7 s audio (prefill chunks of 16 tokens splitting its 33 rows; n-gram drafts) gives
    transformers' greedy ``generate`` tokens beside a text-only prompt in the same batch, some drafts accepted;
    transformers without the audio generates other tokens. ``LLM.chat`` with an input_audio part (a 16-bit WAV, the
    release's template) gives the tokens transformers' ``generate`` gives for ``apply_transcription_request`` of the
    same samples."""
    from specray import LLM, SamplingParams

    folder, hf = release
    theirs = hf_processor(folder)
    audio = waves()[1]
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16,
              speculative_config=NGRAM)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf, theirs, ONE, [(audio, SR)], modality="audio",
                                                  inputs=theirs(text=[ONE], audio=[audio]))
    data = wav_bytes(waves()[0])
    pcm = np.frombuffer(data[44:], "<i2")  # (the WAV's samples, after its 44-byte header)
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}},
        {"type": "text", "text": "Please transcribe this audio into text"}]}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    chat = llm.chat(messages, params, use_tqdm=False, chat_template=TEMPLATE)[0]
    inputs = theirs.apply_transcription_request(pcm.astype(np.float32) / 32768)
    assert inputs["input_ids"][0].tolist() == chat.prompt_token_ids
    with torch.no_grad():
        want = hf.generate(**inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    assert list(chat.outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist()


def test_the_servers_transcription_instruction_is_the_releases(release):
    """The instruction the OpenAI server's /v1/audio/transcriptions puts beside the audio in the chat template is the
    one ``apply_transcription_request`` writes (the engine test above checks that turn against transformers)."""
    pytest.importorskip("fastapi")  # (the server's app; not in a GPU image)
    from specray.cluster.openai_app import audio_instruction

    folder, _ = release
    assert audio_instruction(load_image_processor(str(folder)), "transcribe", None, None) == \
        "Please transcribe this audio into text"
