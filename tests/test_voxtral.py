"""Voxtral's audio (``VoxtralForConditionalGeneration``, :mod:`specray.models.voxtral` on the shared Whisper-style tower
of :mod:`specray.models.whisper_audio`) against transformers on tiny random fp32 weights: 16 mel bins, the release's
30 s windows (3000 frames, 1500 positions), two encoder layers, rows four at a time into the projector, a Llama text
model, and a tiny ``tekken.json`` (v7, the release's special-token ranks: [AUDIO] 24, [BEGIN_AUDIO] 25,
[TRANSCRIBE] 34; its audio section at 12.5 Hz) that transformers reads without mistral_common.

Two synthetic audios (1.28 s: one chunk; 31.5 s: two chunks) at 16 kHz. The host side against transformers'
VoxtralProcessor, which needs mistral_common: where ``VOXTRAL_MISTRAL_COMMON_PATH`` names a folder holding it (and
tiktoken, pydantic-extra-types, pycountry, soundfile: never the venv's), a subprocess runs its ``apply_chat_template``
with both audios and its ``apply_transcription_request``, and our expanded prompt ids and features equal its; else
the recorded ids and feature fingerprints of that run stand in. Each audio's embeddings equal
``get_audio_features``'; the text model (through ``_TEXT_PARTS``) fed them equals the whole model's logits over a prefill and chunks splitting an
audio's span; each distinctive part undone moves the embeddings; two tensor-parallel ranks equal one; refusals by
name; ``LLM.generate`` with both audios (chunks splitting their spans, n-gram drafts) equals ``generate``;
``LLM.chat`` with an ``input_audio`` part (a template rendering ``[AUDIO]`` as mistral_common's does) too."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models import voxtral as vx
from specray.multimodal import MultiModalInputs, expand_prompt
from specray_test_audio_checks import RATE, fingerprint, ours, same_features, spread_weights, waves
from specray_test_image_checks import assert_ranks_equal_one_rank, config_with, encode_items, first_cut, image_logits
from specray_test_model_checks import max_diff

TOL, MOVED = 1e-4, 1e-2
MEL, POSITIONS = 16, 1500
SECONDS = (1.28, 31.5)  # one 30 s chunk (375 [AUDIO]); two (750)
MC_PATH = "VOXTRAL_MISTRAL_COMMON_PATH"
AUDIO_ID, BEGIN_ID, TRANSCRIBE_ID = 24, 25, 34
SPECIALS = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]", 5: "[AVAILABLE_TOOLS]",
            6: "[/AVAILABLE_TOOLS]", 7: "[TOOL_RESULTS]", 8: "[/TOOL_RESULTS]", 9: "[TOOL_CALLS]", 10: "[IMG]",
            11: "<pad>", 12: "[IMG_BREAK]", 13: "[IMG_END]", 14: "[PREFIX]", 15: "[MIDDLE]", 16: "[SUFFIX]",
            17: "[SYSTEM_PROMPT]", 18: "[/SYSTEM_PROMPT]", 19: "[TOOL_CONTENT]", AUDIO_ID: "[AUDIO]",
            BEGIN_ID: "[BEGIN_AUDIO]", TRANSCRIBE_ID: "[TRANSCRIBE]"}
NUM_SPECIAL = 40
MERGES = [b"th", b"he", b"in", b"er", b"an", b" t", b" a", b"ou", b"is", b"at", b"the", b" the", b"en", b"on", b"es",
          b"ng", b"Wh", b"it", b" it", b" is"]
PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
           r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"
           r"\s+(?!\S)|\s+")
AUDIO_SECTION = {"sampling_rate": RATE, "frame_rate": 12.5, "chunk_length_s": 30.0,
                 "audio_encoding_config": {"num_mel_bins": MEL, "hop_length": 160, "window_size": 400}}
AUDIO = dict(model_type="voxtral_encoder", hidden_size=32, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_mel_bins=MEL, max_source_positions=POSITIONS)
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=1e6)
QUESTION = "What is it?"
# mistral_common's instruct format (tokenizer v7): a user turn of [audio, text, audio], and a transcription request
CHAT = f"<s>[INST][AUDIO]{QUESTION}[AUDIO][/INST]"
TRANSCRIBE = "<s>[INST][AUDIO][/INST]lang:en[TRANSCRIBE]"
EXTRA = [7, 300, 41, 5, 99]
BLOCKS = 320  # (cache blocks of 4 tokens for the 1130-token prompts)
# a tiny template of the release's shape (mistral_common's renders [AUDIO] for an input_audio / audio_url part; the
# seam hands the template an ``audio`` part)
TEMPLATE = ("<s>{% for m in messages %}{% if m['role'] == 'user' %}[INST]{% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
            "{% elif c['type'] in ['audio', 'input_audio', 'audio_url'] %}[AUDIO]{% endif %}{% endfor %}{% endif %}"
            "[/INST]{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}")
# transformers' VoxtralProcessor with mistral_common 1.13.1 (the live check below), recorded: its input_ids in
# runs of (token, count), and the fingerprint of its input_features (re-recorded 2026-11-30: a sha256 of the bytes
# differed between CPUs), for the chat with both audios and the transcription request of the second (its WAV written as
# 16-bit PCM by transformers, as decoded)
RECORDED = {"chat_ids": [[1, 1], [3, 1], [25, 1], [24, 375], [312, 1], [305, 1], [315, 1], [314, 1], [103, 1],
                         [25, 1], [24, 750], [4, 1]],
            "chat_features": [-44035.3059, 267.795, 110.3158, 11.3351, -84.9617],
            "transcription_ids": [[1, 1], [3, 1], [25, 1], [24, 750], [4, 1], [148, 1], [300, 1], [143, 1], [98, 1],
                                  [308, 1], [34, 1]],
            "transcription_features": [-6900.4055, -256.3705, -72.0097, 201.3682, -403.1027]}


def tekken() -> dict:
    vocab = [bytes([i]) for i in range(256)] + MERGES
    return {"config": {"pattern": PATTERN, "num_vocab_tokens": len(vocab),
                       "default_vocab_size": NUM_SPECIAL + len(vocab), "default_num_special_tokens": NUM_SPECIAL,
                       "version": "v7"},
            "vocab": [{"rank": r, "token_bytes": base64.b64encode(b).decode(), "token_str": None}
                      for r, b in enumerate(vocab)],
            "special_tokens": [{"rank": i, "token_str": SPECIALS.get(i, f"<SPECIAL_{i}>"), "is_control": True}
                               for i in range(NUM_SPECIAL)],
            "audio": AUDIO_SECTION}


def build(path: Path, seed: int = 0) -> Path:
    """transformers' VoxtralForConditionalGeneration saved beside the tiny tekken.json, a WhisperFeatureExtractor of
    16 mel bins and 30 s windows, and a chat template."""
    from transformers import LlamaConfig, VoxtralConfig, VoxtralForConditionalGeneration, WhisperFeatureExtractor

    path.mkdir(parents=True, exist_ok=True)
    raw = tekken()
    (path / "tekken.json").write_text(json.dumps(raw))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    WhisperFeatureExtractor(feature_size=MEL).save_pretrained(path)
    text = LlamaConfig(vocab_size=raw["config"]["default_vocab_size"], bos_token_id=1, eos_token_id=2,
                       pad_token_id=11, **TEXT)
    config = VoxtralConfig(audio_config=AUDIO, text_config=text.to_dict(), audio_token_id=AUDIO_ID,
                           projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = VoxtralForConditionalGeneration(config).float().eval()
    spread_weights(model)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("tiny_voxtral") / "m")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import VoxtralForConditionalGeneration

    return VoxtralForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def audios() -> list[np.ndarray]:
    return waves(SECONDS)


def tokenizer(folder: Path):
    from specray.models.loader import load_tokenizer

    return load_tokenizer(folder)


def expanded(folder: Path, text: str = CHAT, sounds=None) -> tuple[list[int], MultiModalInputs]:
    sounds = audios() if sounds is None else sounds
    return expand_prompt(tokenizer(folder).encode(text, add_special_tokens=False), [], ours(folder)[1],
                         audios=sounds)


def features(mm: MultiModalInputs) -> np.ndarray:
    return np.concatenate([i.data["input_features"] for i in mm.items])


def hf_inputs(ids: list[int], mm: MultiModalInputs) -> dict:
    """transformers' model inputs for our expanded prompt (the ids and features shown equal to transformers'
    VoxtralProcessor's below)."""
    return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            "input_features": torch.from_numpy(features(mm))}


def runs(ids: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for t in ids:
        if out and out[-1][0] == t:
            out[-1][1] += 1
        else:
            out.append([t, 1])
    return out


# ---- the tokenizer and the host side against transformers' VoxtralProcessor ------------------------------------------

def test_tekken_read_without_mistral_common(folder):
    """The venv has no mistral_common; transformers reads tekken.json itself (its MistralConverter): the special
    tokens at their ranks, the text in the BPE's ids (a merge, a byte), the chat template of the folder."""
    with pytest.raises(ImportError):
        __import__("mistral_common")
    tok = tokenizer(folder)
    assert tok.convert_ids_to_tokens([1, 3, 4, AUDIO_ID, BEGIN_ID, TRANSCRIBE_ID]) == [
        "<s>", "[INST]", "[/INST]", "[AUDIO]", "[BEGIN_AUDIO]", "[TRANSCRIBE]"]
    def bpe(*pieces: bytes) -> list[int]:  # a byte's id, or a merge's (after the special tokens)
        return [NUM_SPECIAL + (p[0] if len(p) == 1 else 256 + MERGES.index(p)) for p in pieces]
    assert tok.encode(TRANSCRIBE, add_special_tokens=False) == [1, 3, AUDIO_ID, 4, *bpe(b"l", b"an", b"g", b":", b"en"),
                                                                TRANSCRIBE_ID]
    assert tok.chat_template == TEMPLATE


REFERENCE = r"""
import base64, io, json, sys
import numpy as np, soundfile as sf, torch
import mistral_common
from transformers import AutoProcessor
folder, out = sys.argv[1], sys.argv[2]
waves = [np.load(f"{out}/w{i}.npy") for i in range(2)]
processor = AutoProcessor.from_pretrained(folder)
def b64(w):
    buf = io.BytesIO()
    sf.write(buf, w, 16000, format="WAV", subtype="FLOAT")  # (float samples: the waveform exactly)
    return base64.b64encode(buf.getvalue()).decode()
chat = [{"role": "user", "content": [{"type": "audio", "base64": b64(waves[0])}, {"type": "text", "text": sys.argv[3]},
                                     {"type": "audio", "base64": b64(waves[1])}]}]
got = processor.apply_chat_template(chat, tokenize=True, return_dict=True, return_tensors="pt")
np.save(f"{out}/chat_features.npy", got["input_features"].numpy())
tr = processor.apply_transcription_request(audio=[waves[1]], model_id="tiny", language="en", sampling_rate=16000,
                                           format=["wav"], tokenize=True, return_dict=True, return_tensors="pt")
np.save(f"{out}/transcription_features.npy", tr["input_features"].numpy())
buf = io.BytesIO(); sf.write(buf, waves[1], 16000, format="WAV"); buf.seek(0)
np.save(f"{out}/decoded.npy", sf.read(buf, dtype="float32")[0])
json.dump({"chat_ids": got["input_ids"][0].tolist(), "transcription_ids": tr["input_ids"][0].tolist(),
           "version": mistral_common.__version__,
           "tokenizer": type(processor.tokenizer).__name__}, open(f"{out}/o.json", "w"))
"""


def reference(folder: Path, out: Path) -> dict | None:
    """transformers' VoxtralProcessor over the chat and the transcription request, run where mistral_common imports
    from ``VOXTRAL_MISTRAL_COMMON_PATH`` (None elsewhere)."""
    extra = os.environ.get(MC_PATH)
    if not extra:
        return None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (extra, os.environ.get("PYTHONPATH")) if p))
    probe = "import mistral_common, soundfile, tiktoken"
    if subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode:
        return None
    for i, w in enumerate(audios()):
        np.save(out / f"w{i}.npy", w)
    script = out / "reference.py"
    script.write_text(REFERENCE)
    subprocess.run([sys.executable, str(script), str(folder), str(out), QUESTION], env=env, check=True,
                   capture_output=True, timeout=240)
    got = json.loads((out / "o.json").read_text())
    for name in ("chat_features", "transcription_features"):
        got[name] = np.load(out / f"{name}.npy")
    got["decoded"] = np.load(out / "decoded.npy")
    return got


def test_processor_equals_transformers_live(folder, tmp_path):
    """Where mistral_common imports (``VOXTRAL_MISTRAL_COMMON_PATH``), transformers' VoxtralProcessor's
    ``apply_chat_template`` (a user turn of audio, text, audio) and ``apply_transcription_request`` (the second
    audio, language en) give our expanded prompts and features exactly (the recorded runs agree)."""
    want = reference(folder, tmp_path)
    if want is None:
        pytest.skip(f"mistral_common does not import ({MC_PATH} unset or its folder incomplete): transformers' "
                    "VoxtralProcessor cannot run (the recorded ids and fingerprints stand in)")
    assert want["tokenizer"] == "MistralCommonBackend"
    ids, mm = expanded(folder)
    assert ids == want["chat_ids"]
    assert np.array_equal(features(mm), want["chat_features"])
    ids, mm = expanded(folder, TRANSCRIBE, [want["decoded"]])
    assert ids == want["transcription_ids"]
    assert np.array_equal(features(mm), want["transcription_features"])
    recorded = {"chat_ids": runs(want["chat_ids"]), "chat_features": fingerprint(want["chat_features"]),
                "transcription_ids": runs(want["transcription_ids"]),
                "transcription_features": fingerprint(want["transcription_features"])}
    assert {k: v for k, v in recorded.items() if "ids" in k} == {k: v for k, v in RECORDED.items() if "ids" in k}
    assert all(same_features(want[k], RECORDED[k]) for k in recorded if "features" in k), json.dumps(recorded)


def test_processor_equals_recorded_transformers(folder):
    """Our expanded prompts and features equal transformers' VoxtralProcessor's as recorded: [BEGIN_AUDIO] then 375
    [AUDIO] per 30 s chunk, the features of the whole padded audio cut into 3000-frame windows."""
    ids, mm = expanded(folder)
    assert runs(ids) == RECORDED["chat_ids"] and same_features(features(mm), RECORDED["chat_features"])
    assert [i.length for i in mm.items] == [376, 751] and [i.data["input_features"].shape for i in mm.items] == [
        (1, MEL, 2 * POSITIONS), (2, MEL, 2 * POSITIONS)]
    # (the 16-bit WAV transformers writes, as libsndfile 1.2 in soundfile 0.14 writes and reads it back)
    decoded = (np.clip(np.floor(audios()[1].astype(np.float64) * 32768), -32768, 32767) / 32768).astype(np.float32)
    ids, mm = expanded(folder, TRANSCRIBE, [decoded])
    assert runs(ids) == RECORDED["transcription_ids"]
    assert same_features(features(mm), RECORDED["transcription_features"])
    # the OpenAI server's /v1/audio/transcriptions writes that request's text (no translation, no prompt)
    processor = ours(folder)[1]
    assert processor.transcription_prompt("transcribe", "en", None) == TRANSCRIBE
    with pytest.raises(ValueError, match="transcribes only"):
        processor.transcription_prompt("translate", None, None)
    with pytest.raises(ValueError, match="takes no prompt"):
        processor.transcription_prompt("transcribe", "en", "Hello")


def test_features_are_the_whole_padded_audios(folder):
    """Each chunk's window is cut from the features of the whole padded audio: features made per chunk differ (the
    frames at the border, the log-mel floor), so the cut is not a per-chunk extraction."""
    processor = ours(folder)[1]
    wave = audios()[1]
    whole = processor.features(wave)
    per_chunk = np.concatenate([processor.features(wave[:processor.chunk]), processor.features(wave[processor.chunk:])])
    assert whole.shape == per_chunk.shape and not np.allclose(whole, per_chunk, atol=1e-3)
    assert not same_features(per_chunk, fingerprint(whole))  # (the recorded fingerprints see such a difference)


def test_folder_without_tekken(folder, tmp_path):
    """A folder holding the tokenizer as tokenizer.json instead of tekken.json: [BEGIN_AUDIO] from the tokenizer, the
    same expansion; a tokenizer without [BEGIN_AUDIO] is refused by name."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from specray.models.loader import read_config

    copy = shutil.copytree(folder, tmp_path / "m")
    tokenizer(folder).save_pretrained(copy)
    (copy / "tekken.json").unlink()
    processor = vx.VoxtralProcessor.from_pretrained(copy, read_config(str(copy)))
    assert processor.process_audio(audios()[0]).replacement == [BEGIN_ID] + [AUDIO_ID] * 375
    bare = tmp_path / "bare"
    shutil.copytree(copy, bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink(missing_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")),
                            unk_token="<unk>").save_pretrained(bare)
    with pytest.raises(ValueError, match=r"no \[BEGIN_AUDIO\] token"):
        vx.VoxtralProcessor.from_pretrained(bare, read_config(str(bare)))


# ---- the encoder and the whole model ---------------------------------------------------------------------------------

def test_encoder_equals_get_audio_features(folder, hf):
    """Each audio's embeddings (all its windows' rows, four at a time through the projector) equal
    get_audio_features' pooler output for its windows."""
    _, mm = expanded(folder)
    got = encode_items(ours(folder)[0], mm)
    for item, rows in zip(mm.items, got):
        with torch.no_grad():
            want = hf.get_audio_features(torch.from_numpy(item.data["input_features"])).pooler_output
        assert rows.shape == (len(item.embed_rows), TEXT["hidden_size"]) and max_diff(rows, want) < TOL


@pytest.mark.parametrize("chunked", [False, True])
def test_logits_with_audio_equal_transformers(folder, hf, chunked):
    """transformers' whole-model logits over the chat prompt with both audios and EXTRA tokens == our Llama text
    model's (through _TEXT_PARTS) with the encoder's rows in place: one prefill, or a chunk ending inside the first
    audio's span, one ending inside the second's, then the rest and single steps."""
    from specray.models.loader import load_model

    ids, mm = expanded(folder)
    second = mm.items[1].offset + 100
    sizes = [first_cut(mm), second - first_cut(mm), len(ids) - second] if chunked else [len(ids)]
    got = image_logits(load_model(str(folder)), ids + EXTRA, mm, encode_items(ours(folder)[0], mm), sizes,
                       blocks=BLOCKS)
    inputs = hf_inputs(ids + EXTRA, mm)
    with torch.no_grad():
        want = hf(input_ids=inputs["input_ids"], input_features=inputs["input_features"]).logits[0]
    assert max_diff(got, want) < TOL


# ---- each part shows -------------------------------------------------------------------------------------------------

def _masked(encoder):  # the padded frames masked as keys (Qwen2-Audio's way), not attended
    from specray.models.whisper_audio import WhisperAudioTower, conv_lengths

    sounds = audios()
    frames = {1: [len(sounds[0]) // 160], 2: [3000, (len(sounds[1]) - 480000) // 160]}

    def forward(f, lengths=None):
        out = WhisperAudioTower.forward(encoder.tower, f).clone()  # (the rows past the audio as they were)
        masked = WhisperAudioTower.forward(encoder.tower, f, frames[f.shape[0]])
        for i, n in enumerate(conv_lengths(frames[f.shape[0]])):
            out[i, :n] = masked[i, :n]
        return out
    encoder.tower.forward = forward


def _causal(encoder):  # each row attending to the rows before it only (the encoder attends both ways)
    from specray.models.whisper_audio import WhisperAudioAttention

    for layer in encoder.tower.layers:
        def forward(x, keys, attn=layer.self_attn):
            causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
            return WhisperAudioAttention.forward(attn, x, causal if keys is None else keys & causal)
        layer.self_attn.forward = forward


def _linear_stem(encoder):  # the conv stem without its GELUs
    encoder.tower.stem_act = torch.nn.Identity()


def _interleaved(encoder):  # rows grouped across the window (row i with i + N/4, ...) rather than consecutive ones
    project = type(encoder).project

    def mixed(hidden):
        w, n, c = hidden.shape
        return project(encoder, hidden.reshape(w, encoder.group, n // encoder.group, c).transpose(1, 2).contiguous())
    encoder.project = mixed


def _no_act(encoder):
    encoder.act = torch.nn.Identity()


def _no_final_norm(encoder):
    encoder.tower.layer_norm = torch.nn.Identity()


def _no_positions(encoder):
    encoder.tower.embed_positions.weight.zero_()


MUTATIONS = {"masked-padding": _masked, "causal": _causal, "interleaved-groups": _interleaved,
             "linear-stem": _linear_stem, "no-projector-act": _no_act, "no-final-norm": _no_final_norm,
             "no-positions": _no_positions}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_embeddings(folder, hf, mutation):
    """Each part of the encoder done otherwise moves the embeddings away from get_audio_features' (both audios)."""
    _, mm = expanded(folder)
    encoder = ours(folder)[0]
    with torch.no_grad():
        MUTATIONS[mutation](encoder)
        got = torch.cat(encode_items(encoder, mm))
        want = torch.cat([hf.get_audio_features(torch.from_numpy(i.data["input_features"])).pooler_output
                          for i in mm.items])
    assert got.shape == want.shape and max_diff(got, want) > MOVED


def test_replacement_is_begin_audio_then_audio_tokens(folder):
    """One audio's replacement: [BEGIN_AUDIO] (no embedding) then 375 [AUDIO] per 30 s chunk (the embeddings)."""
    processor = ours(folder)[1]
    for wave, chunks in zip(audios(), (1, 2)):
        out = processor.process_audio(wave)
        assert out.replacement == [BEGIN_ID] + [AUDIO_ID] * (375 * chunks)
        assert out.embed_rows == list(range(1, 375 * chunks + 1))


# ---- refusals --------------------------------------------------------------------------------------------------------

def _tekken_edit(folder: Path, tmp_path: Path, **audio) -> Path:
    copy = shutil.copytree(folder, tmp_path / f"m{len(list(tmp_path.iterdir()))}")
    raw = json.loads((copy / "tekken.json").read_text())
    for key, value in audio.items():
        *path, last = key.split("__")
        target = raw["audio"]
        for p in path:
            target = target[p]
        target[last] = value
    (copy / "tekken.json").write_text(json.dumps(raw))
    return copy


def test_refusals(folder, tmp_path):
    """tekken.json audio settings that do not fit the folder, a streaming section, an intermediate_size that is not
    whole rows, an activation we lack, a missing projector tensor, no audio_token_id, an audio longer than the
    context holds, an empty one, images: each refused by name."""
    from safetensors.torch import load_file

    from specray.models.loader import read_config

    config = read_config(str(folder))
    cases = [({"frame_rate": 25.0}, "frame_rate=25.0 gives 750"), ({"sampling_rate": 24000}, "sampling_rate=24000"),
             ({"chunk_length_s": 15.0}, "chunk_length_s=15.0"), ({"audio_encoding_config__hop_length": 320},
                                                                  "hop_length=320"),
             ({"transcription_format": "streaming"}, "streaming .*Voxtral Realtime")]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            vx.VoxtralProcessor.from_pretrained(_tekken_edit(folder, tmp_path, **change), config)
    with pytest.raises(ValueError, match="audio_token_id"):
        vx.VoxtralProcessor.from_pretrained(folder, config_with(folder, audio_token_id=None))
    with pytest.raises(ValueError, match="intermediate_size=80 is not a whole number"):
        vx.VoxtralEncoder(config_with(folder, audio_config__intermediate_size=80))
    with pytest.raises(ValueError, match="projector_hidden_act='swishy'"):
        vx.VoxtralEncoder(config_with(folder, projector_hidden_act="swishy"))
    encoder = vx.VoxtralEncoder(config)
    tensors = load_file(str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="projector.linear_2.weight"):
        encoder.load_weights((n, t) for n, t in tensors.items() if "linear_2" not in n)
    processor = ours(folder)[1]
    assert processor.max_audio_samples == 150 * RATE  # the server's transcriptions cut clips of it
    with pytest.raises(ValueError, match=r"longer than this model takes \(150 s\)"):
        processor.process_audio(np.zeros(151 * RATE, np.float32))
    with pytest.raises(ValueError, match="non-empty 1-D waveform"):
        processor.process_audio(np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="takes audio, not images"):
        processor.process(None)


# ---- tensor parallel and the engine ----------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(folder, tmp_path):
    """The text model split over two tensor-parallel ranks (the encoder whole on each) gives one rank's logits with
    the audio rows in place (a transcription request of the shorter audio), a chunk ending inside its span, then the
    rest and single steps."""
    ids, mm = expanded(folder, TRANSCRIBE, audios()[:1])
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids + EXTRA, mm, [first_cut(mm), len(ids) - first_cut(mm)],
                                            {"blocks": BLOCKS})], 1, TOL)


def test_engine_greedy_with_audio_equals_transformers(folder, hf):
    """LLM.generate with both audios (chunks of 128 tokens split their spans; n-gram drafts) gives transformers'
    greedy generate's tokens beside a text-only prompt; without the audio transformers generates other tokens."""
    from specray import LLM
    from specray_test_engine_runs import assert_images_greedy_equals_transformers

    llm = LLM(model=str(folder), max_model_len=1536, block_size=16, max_num_batched_tokens=128,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    ids, mm = expanded(folder)
    assert_images_greedy_equals_transformers(llm, hf, None, CHAT, [(w, RATE) for w in audios()], max_tokens=24,
                                             modality="audio", inputs=hf_inputs(ids, mm),
                                             plain_text="<s>[INST]The quick brown fox[/INST]")


def test_chat_with_an_input_audio_part(folder, hf):
    """LLM.chat with an OpenAI input_audio part (a 16-bit WAV, base64) renders [AUDIO] through the chat template and
    gives transformers' greedy tokens for the prompt mistral_common would make and the decoded audio."""
    from specray import LLM, SamplingParams
    from specray_test_audio_checks import wav_bytes

    data = wav_bytes(audios()[0])
    decoded = np.frombuffer(data[44:], "<i2").astype(np.float32) / 32768.0
    llm = LLM(model=str(folder), max_model_len=1024, block_size=16, max_num_batched_tokens=256)
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}},
        {"type": "text", "text": QUESTION}]}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    ids, mm = expanded(folder, f"<s>[INST][AUDIO]{QUESTION}[/INST]", [decoded])
    with torch.no_grad():
        want = hf.generate(**hf_inputs(ids, mm), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert list(out.outputs[0].token_ids) == want
