"""Fun-ASR-Nano (``specray.models.fun_asr_nano``): against transformers' whole ``FunAsrNanoForConditionalGeneration``
on the same tiny random fp32 weights (a two-layer Qwen3 text model, a four-layer SAN-M encoder over 16 mel bins whose
last layer is a timestamp layer, two adaptor layers), synthetic waveforms from a fixed seed.

The Kaldi filterbank equals torchaudio's ``compliance.kaldi.fbank`` (which ``FunAsrNanoFeatureExtractor`` calls) bit for
bit where ``FUN_ASR_NANO_TORCHAUDIO_PATH`` names a folder holding torchaudio (the venv has none; as Granite Speech's
check), else the fingerprints recorded from that check; the low frame rate stacking equals the extractor's own
``_apply_lfr``; each audio's embeddings equal ``get_audio_features``' over our features; the text model fed them gives
the whole model's logits over a prompt with an audio, in chunks splitting its span, then decode steps, and two
tensor-parallel ranks one rank's; the engine's greedy tokens with an audio and n-gram drafts equal transformers'
``generate``; what is not served is refused by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models import fun_asr_nano as fa
from specray.models.loader import load_image_processor, load_model
from specray.multimodal import MultiModalInputs
from specray_test_audio_checks import draw_visible, expand_in, same_features, tone_waves
from specray_test_image_checks import (assert_ranks_equal_one_rank, config_with, encoded,  # tests/image_checks.py
                                      image_logits)
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
RATE = 16000
MEL = 16
AUDIO = "<|object_ref_start|>"
HIDDEN = 64
LENGTHS = [20800, 35500]  # 1.3 s (128 frames: 22 stacked rows) and ~2.2 s (220 frames: 37 rows)
ROWS = [22, 37]
# torchaudio 2.11.1's kaldi.fbank of waves() at 16 mel bins (audio_checks.fingerprint), recorded 2026-11-30 where it
# equalled ours bit for bit
FBANK_FINGERPRINTS = [[3587.0325, -249.8905, -58.2563, -190.3044, -160.3246],
                      [5888.0601, -216.575, -503.8942, 206.1615, -266.8769]]
TORCHAUDIO_PATH = "FUN_ASR_NANO_TORCHAUDIO_PATH"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def waves() -> list[np.ndarray]:
    return tone_waves(LENGTHS)


def build_release(path: Path, seed: int = 0):
    """transformers' FunAsrNanoForConditionalGeneration at the tiny sizes, its audio weights drawn visible, saved with
    conftest's tiny tokenizer (the placeholder among its special tokens) and the extractor's settings (16 mel
    bins)."""
    from transformers import FunAsrNanoConfig, FunAsrNanoForConditionalGeneration

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=(AUDIO,))
    audio = dict(num_mel_bins=MEL, hidden_size=32, num_attention_heads=4, intermediate_size=48, num_hidden_layers=4,
                 num_timestamp_prediction_layers=1, hidden_dropout=0.0, attention_dropout=0.0, fsmn_kernel_size=5)
    adaptor = dict(hidden_size=HIDDEN, num_attention_heads=4, intermediate_size=HIDDEN // 4, num_hidden_layers=2,
                   projector_hidden_size=48)
    text = dict(model_type="qwen3", vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=1024, initializer_range=0.2)
    config = FunAsrNanoConfig(audio_config=audio, adaptor_config=adaptor, text_config=text, pad_token_id=0,
                              audio_token_id=tok.convert_tokens_to_ids(AUDIO), initializer_range=0.2)
    torch.manual_seed(seed)
    model = FunAsrNanoForConditionalGeneration(config).float().eval()
    draw_visible(model, seed=seed + 1)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({"feature_extractor_type": "FunAsrNanoFeatureExtractor",
                                                               "feature_size": MEL}))
    return path, model


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return build_release(tmp_path_factory.mktemp("fun_asr_nano"))


def hf_features(mm: MultiModalInputs, i: int = 0) -> dict:
    rows = torch.from_numpy(mm.items[i].data["input_features"])[None]
    return {"input_features": rows, "input_features_mask": torch.ones(1, rows.shape[1], dtype=torch.long)}


# ---- the features ----------------------------------------------------------------------------------------------------

REFERENCE = """
import sys, numpy as np, torch, torchaudio
out = sys.argv[1]
for i in range(2):
    w = np.load(f"{out}/w{i}.npy")
    fbank = torchaudio.compliance.kaldi.fbank(torch.from_numpy(w)[None], num_mel_bins=16, frame_length=25,
                                              frame_shift=10, sample_frequency=16000, window_type="hamming")
    np.save(f"{out}/f{i}.npy", fbank.numpy())
"""


def test_filterbank_equals_torchaudio(tmp_path):
    """Our Kaldi filterbank of each audio: torchaudio's bit for bit where torchaudio imports (in a subprocess), its
    recorded fingerprints otherwise."""
    ours = [fa.kaldi_fbank(torch.from_numpy(w), {**fa.FEATURE_DEFAULTS, "feature_size": MEL}).numpy()
            for w in waves()]
    assert [f.shape for f in ours] == [(128, MEL), (220, MEL)]
    assert all(same_features(f, want) for f, want in zip(ours, FBANK_FINGERPRINTS))
    env = dict(os.environ)
    if os.environ.get(TORCHAUDIO_PATH):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ[TORCHAUDIO_PATH], env.get("PYTHONPATH")) if p)
    if subprocess.run([sys.executable, "-c", "import torchaudio"], env=env, capture_output=True).returncode:
        pytest.skip("torchaudio does not import: the recorded fingerprints stand in")
    for i, w in enumerate(waves()):
        np.save(tmp_path / f"w{i}.npy", w)
    done = subprocess.run([sys.executable, "-c", REFERENCE, str(tmp_path)], env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert all(np.array_equal(f, np.load(tmp_path / f"f{i}.npy")) for i, f in enumerate(ours))


def test_low_frame_rate_equals_the_extractors():
    """The stacking equals FunAsrNanoFeatureExtractor's own ``_apply_lfr`` (called on a stand-in: the extractor itself
    needs torchaudio) for frame counts around multiples of the stride."""
    from transformers.models.fun_asr_nano.feature_extraction_fun_asr_nano import FunAsrNanoFeatureExtractor

    stand_in = types.SimpleNamespace(num_frames_lfr=7, stride_lfr=6)
    for frames in (1, 5, 6, 7, 12, 13, 128):
        features = torch.randn(frames, MEL, generator=torch.Generator().manual_seed(frames))
        assert torch.equal(fa.low_frame_rate(features, 7, 6), FunAsrNanoFeatureExtractor._apply_lfr(stand_in, features))


# ---- the encoder and the whole model ---------------------------------------------------------------------------------

def test_encoder_equals_transformers_audio_features(release):
    """Each audio's placeholder becomes one token per stacked row; its embeddings equal ``get_audio_features``'
    pooled output over the same rows."""
    folder, hf = release
    ids, mm = expand_in(folder, "Hi " + AUDIO + " and " + AUDIO, waves())
    assert [i.length for i in mm.items] == ROWS
    for i, ours in enumerate(encoded(folder, mm)):
        with torch.no_grad():
            theirs = hf.model.get_audio_features(**hf_features(mm, i)).pooler_output
        assert max_diff(ours, theirs) < TOL


@torch.no_grad()
def test_logits_with_an_audio_equal_transformers(release):
    folder, hf = release
    ids, mm = expand_in(folder, "Hello " + AUDIO + " world", waves()[:1])
    extra = [17, 42, 99]
    want = hf(input_ids=torch.tensor([ids + extra]), **hf_features(mm)).logits[0]
    first = mm.items[0].offset + 5
    got = image_logits(load_model(str(folder)), ids + extra, mm, encoded(folder, mm), [first, len(ids) - first])
    assert max_diff(got, want) < TOL


def test_two_ranks_equal_one_rank(release, tmp_path):
    folder, _ = release
    ids, mm = expand_in(folder, "Hi " + AUDIO + " and " + AUDIO, waves())
    first = mm.items[0].offset + 3
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids, mm, [first, len(ids) - first])], 1, TOL)


def test_engine_greedy_with_audio_equals_transformers(release):
    from specray import LLM

    folder, hf = release
    text = "Hello " + AUDIO + " world"
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=12, speculative_config=NGRAM)
    ids, mm = expand_in(folder, text, waves()[:1])
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf, None, text, [(waves()[0], RATE)], modality="audio",
                                                  inputs={"input_ids": torch.tensor([ids]), **hf_features(mm)},
                                                  max_tokens=40)


def test_transcription_requests_are_the_releases(release):
    """``transcription_messages`` renders as ``apply_transcription_request`` writes (the audio, the prompt, the
    language's name as the release was trained); a translation or another language is refused."""
    from transformers import AutoTokenizer, FunAsrNanoProcessor
    from transformers.processing_utils import ProcessorMixin

    from specray.chat import render_chat

    folder, _ = release
    processor = load_image_processor(str(folder))
    tok = AutoTokenizer.from_pretrained(str(folder))
    template = ("{% for m in messages %}{% for p in m.content %}{% if p.type == 'audio' %}" + AUDIO + "{% elif "
                "p.type == 'language' %}[{{ p.language }}]{% else %}{{ p.text }}{% endif %}{% endfor %}{% endfor %}"
                "{% if add_generation_prompt %} =>{% endif %}")
    with pytest.MonkeyPatch.context() as patch:  # (its feature extractor needs torchaudio: a stand-in, unchecked)
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
        theirs = FunAsrNanoProcessor(feature_extractor=types.SimpleNamespace(), tokenizer=tok, audio_token=AUDIO)
        for language, prompt in ((None, None), ("en", "Names: Ada."), ("zh", None)):
            ours = render_chat(tok, processor.transcription_messages("transcribe", language, prompt), True, False,
                               chat_template=template)
            want = theirs.apply_transcription_request(waves()[0], language=language, prompt=prompt, tokenize=False,
                                                      chat_template=template)
            assert ours == (want[0] if isinstance(want, list) else want)
    assert ours == AUDIO + "[中文] =>"
    with pytest.raises(ValueError, match="transcribes only"):
        processor.transcription_messages("translate", None, None)
    with pytest.raises(ValueError, match="language='fr' is not one"):
        processor.transcription_messages("transcribe", "fr", None)


def test_refusals(release, tmp_path):
    folder, _ = release
    processor = load_image_processor(str(folder))
    with pytest.raises(ValueError, match="takes audio only"):
        processor.process(None)
    with pytest.raises(ValueError, match="shorter than one frame of the feature extractor \\(400 samples\\)"):
        processor.process_audio(np.zeros(399, np.float32))
    assert processor.process_audio(np.zeros(400, np.float32)).replacement == [processor.audio_token_id]
    with pytest.raises(ValueError, match="num_timestamp_prediction_layers=4 leaves no transcription layer"):
        fa.FunAsrNanoEncoder(config_with(folder, audio_config__num_timestamp_prediction_layers=4))
    with pytest.raises(ValueError, match="hidden_act='swishy' is not supported"):
        fa.FunAsrNanoEncoder(config_with(folder, audio_config__hidden_act="swishy"))
    copy = tmp_path / "m"
    copy.mkdir()
    for f in folder.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    (copy / "preprocessor_config.json").write_text(json.dumps({"feature_size": 80}))
    with pytest.raises(ValueError, match="feature_size=80 and num_frames_lfr=7 must be audio_config's num_mel_bins=16"):
        load_image_processor(str(copy))
    (copy / "preprocessor_config.json").write_text(json.dumps({"feature_size": MEL, "window": "kaiser"}))
    with pytest.raises(ValueError, match="window='kaiser' is not supported"):
        load_image_processor(str(copy))
