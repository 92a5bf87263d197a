"""Qwen3-ASR (``specray.models.qwen3_asr``): against transformers' whole ``Qwen3ASRForConditionalGeneration`` on the
same tiny random fp32 weights (a two-layer Qwen3 text model, a two-layer audio tower over 16 mel bins attending within
spans of two windows), synthetic waveforms from a fixed seed.

Our expanded prompts and features equal transformers' ``Qwen3ASRProcessor``'s for each audio alone (one shorter than
the feature extractor's ``min_length``, one shorter than a window, ones of several windows and of several attention
spans); each audio's embeddings equal ``get_audio_features``' (the short one's window padded whole, unlike
Qwen3-Omni's); the text model fed them gives the whole model's logits over a prompt with an audio, in chunks splitting
its span, then decode steps, and two tensor-parallel ranks one rank's; the engine's greedy tokens with an audio and
n-gram drafts equal transformers' ``generate``; the OpenAI server's transcription writes
``apply_transcription_request``'s prompt and keeps the transcript after the model's own language tag; what is not
served is refused by name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models import qwen3_asr as qa
from specray.models.loader import load_image_encoder, load_image_processor, load_model, read_config
from specray_test_audio_checks import draw_visible, expand_in, tone_waves
from specray_test_image_checks import (assert_ranks_equal_one_rank, config_with, encoded,  # tests/image_checks.py
                                      image_logits)
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2
RATE = 16000
MEL = 16
LENGTHS = [4000, 9600, 20800, 80123]  # below min_length (8,000 samples), under a window, 2 windows, 5 (3 spans)
TOKENS = [7, 8, 17, 65]
SPECIALS = ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>")
AUDIO = "<|audio_start|><|audio_pad|><|audio_end|>"
HIDDEN = 64
# a chat template of the release's shape: system, user turns with audio parts, the assistant's turn continued
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for p in m.content %}{% if p.type == 'audio' %}" + AUDIO + "{% else %}{{ p.text }}{% endif %}"
            "{% endfor %}{% endif %}{% if not loop.last %}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_end|>\n<|im_start|>assistant\n{% endif %}")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def waves() -> list[np.ndarray]:
    return tone_waves(LENGTHS)


def build_release(path: Path, seed: int = 0):
    """transformers' Qwen3ASRForConditionalGeneration at the tiny sizes, its audio weights drawn visible, saved with
    conftest's tiny tokenizer (the audio specials among its special tokens) and a Qwen3ASRFeatureExtractor of 16 mel
    bins."""
    from transformers import Qwen3ASRConfig, Qwen3ASRFeatureExtractor, Qwen3ASRForConditionalGeneration

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=SPECIALS)
    audio = dict(num_mel_bins=MEL, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, d_model=32,
                 output_dim=HIDDEN, n_window_infer=200, downsample_hidden_size=8)
    text = dict(model_type="qwen3", vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=1024, tie_word_embeddings=True, initializer_range=0.2)
    config = Qwen3ASRConfig(audio_config=audio, text_config=text, audio_token_id=tok.convert_tokens_to_ids(SPECIALS[1]),
                            pad_token_id=0, eos_token_id=tok.eos_token_id, initializer_range=0.2)
    torch.manual_seed(seed)
    model = Qwen3ASRForConditionalGeneration(config).float().eval()
    draw_visible(model, seed=seed + 1)
    model.save_pretrained(path)
    Qwen3ASRFeatureExtractor(feature_size=MEL).save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return build_release(tmp_path_factory.mktemp("qwen3_asr"))


def tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def hf_processor(folder: Path):
    """transformers' Qwen3ASRProcessor over the folder's feature extractor and tokenizer (named its audio tokens)."""
    from transformers import AutoFeatureExtractor, Qwen3ASRProcessor

    tok = tokenizer(folder)
    tok.audio_bos_token, tok.audio_token, tok.audio_eos_token = SPECIALS
    return Qwen3ASRProcessor(feature_extractor=AutoFeatureExtractor.from_pretrained(str(folder)), tokenizer=tok)


# ---- the processor and the encoder -----------------------------------------------------------------------------------

def test_processor_equals_transformers(release):
    """For each audio alone, our expanded prompt is Qwen3ASRProcessor's and our features its valid frames (the rest
    of its mel axis zeros: the padding to whole windows)."""
    folder, _ = release
    theirs = hf_processor(folder)
    text = "Hi " + AUDIO + " there"
    for wave, tokens in zip(waves(), TOKENS):
        want = theirs(text=[text], audio=[wave])
        ids, mm = expand_in(folder, text, [wave])
        assert ids == want["input_ids"][0].tolist() and mm.items[0].length == tokens
        frames = int(want["input_features_mask"][0].sum())
        features = want["input_features"][0].numpy()
        assert np.array_equal(mm.items[0].data["input_features"], features[:, :frames])
        assert not features[:, frames:].any() and features.shape[1] % 100 == 0


def test_encoder_equals_transformers_audio_features(release):
    """Each audio's embeddings equal ``get_audio_features``' pooled output for it alone (its padded features and
    mask as Qwen3ASRProcessor makes them)."""
    folder, hf = release
    theirs = hf_processor(folder)
    _, mm = expand_in(folder, AUDIO * len(LENGTHS), waves())
    for item, wave, ours in zip(mm.items, waves(), encoded(folder, mm)):
        want = theirs(text=[AUDIO], audio=[wave])
        with torch.no_grad():
            rows = hf.model.get_audio_features(want["input_features"], want["input_features_mask"]).pooler_output
        assert ours.shape == (item.length, HIDDEN) and max_diff(ours, rows) < TOL


def test_a_short_audio_is_padded_to_a_whole_window(release):
    """Qwen3-Omni's padding (a short last window only to the audio's longest) moves the rows of an audio shorter
    than a window away from transformers' Qwen3-ASR, whose extractor pads its mel frames to whole windows."""
    folder, _ = release
    _, mm = expand_in(folder, AUDIO, waves()[1:2])

    def omni(encoder):
        encoder.audio_tower.whole_windows = False

    assert max_diff(encoded(folder, mm, omni)[0], encoded(folder, mm)[0]) > MOVED


# ---- the whole model -------------------------------------------------------------------------------------------------

@torch.no_grad()
def test_logits_with_an_audio_equal_transformers(release):
    """The text model fed the audio's rows gives the whole model's logits over a prompt with an audio (chunks
    splitting its span, then decode steps)."""
    folder, hf = release
    text = "Hello " + AUDIO + " world"
    ids, mm = expand_in(folder, text, waves()[2:3])
    want_in = hf_processor(folder)(text=[text], audio=[waves()[2]])
    extra = [17, 42, 99]
    want = hf(input_ids=torch.tensor([ids + extra]), input_features=want_in["input_features"],
              input_features_mask=want_in["input_features_mask"]).logits[0]
    first = mm.items[0].offset + 5
    got = image_logits(load_model(str(folder)), ids + extra, mm, encoded(folder, mm), [first, len(ids) - first])
    assert max_diff(got, want) < TOL


def test_two_ranks_equal_one_rank(release, tmp_path):
    folder, _ = release
    ids, mm = expand_in(folder, "Hi " + AUDIO + " and " + AUDIO, waves()[1:3])
    first = mm.items[0].offset + 3
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids, mm, [first, len(ids) - first])], 1, TOL)


def test_engine_greedy_with_audio_equals_transformers(release):
    """``LLM.generate`` with an audio (at most 12 tokens a step: chunks ending inside its span; n-gram drafts) gives
    transformers' greedy ``generate`` tokens beside a text-only prompt; without the audio transformers generates
    others."""
    from specray import LLM

    folder, hf = release
    text = "Hello " + AUDIO + " world"
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=12, speculative_config=NGRAM)
    inputs = dict(hf_processor(folder)(text=[text], audio=[waves()[2]]))
    inputs.pop("attention_mask")
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf, None, text, [(waves()[2], RATE)], modality="audio",
                                                  inputs=inputs)


# ---- transcriptions --------------------------------------------------------------------------------------------------

def test_transcription_requests_are_the_releases(release):
    """``transcription_messages`` renders as ``apply_transcription_request`` writes (the prompt as the system turn,
    the assistant's turn begun with the forced language); ``transcription_text`` keeps what follows the model's own
    ``language <Name><asr_text>`` and nothing while it may still be writing it."""
    from specray.chat import render_chat

    folder, _ = release
    processor = load_image_processor(str(folder))
    theirs = hf_processor(folder)
    tok = tokenizer(folder)
    for language, prompt in ((None, None), ("en", "Names: Ada."), ("yue", None)):
        messages = processor.transcription_messages("transcribe", language, prompt)
        ours = render_chat(tok, messages, False, True, chat_template=TEMPLATE)
        want = theirs.apply_transcription_request(waves()[0], language=language, prompt=prompt, tokenize=False,
                                                  chat_template=TEMPLATE)
        assert ours == (want[0] if isinstance(want, list) else want)
    assert ours.endswith("<|im_start|>assistant\nlanguage Cantonese<asr_text>")
    with pytest.raises(ValueError, match="transcribes only"):
        processor.transcription_messages("translate", None, None)
    with pytest.raises(ValueError, match="language='xx' is not one"):
        processor.transcription_messages("transcribe", "xx", None)
    text = qa.Qwen3ASRProcessor.transcription_text
    shown = [text(t) for t in ("lang", "language Eng", "language English<asr", "language English<asr_text>",
                               "language English<asr_text> Hi", "language English<asr_text> Hi there")]
    assert shown == ["", "", "", "", "Hi", "Hi there"]
    assert text("Hello world") == "Hello world"  # (forced language: the transcript alone)


def test_server_transcribes_as_the_release_asks(release):
    """/v1/audio/transcriptions with a language: the text ``LLM.generate`` gives for the release's request with that
    language forced; streamed, the same; without one, the model's text past its own language tag (here none: the
    text as it is)."""
    pytest.importorskip("openai")  # (the test's client and the server; not in a GPU image)
    pytest.importorskip("uvicorn")
    import openai

    from specray import LLM, SamplingParams
    from specray.chat import render_chat
    from specray.cluster.openai_app import AsyncEngineClient, ServerConfig, build_openai_app
    from specray.engine.async_engine import AsyncLLMEngine
    from specray_test_audio_checks import wav_bytes
    from specray_test_openai_helpers import serving  # tests/openai_helpers.py

    folder, _ = release
    processor = load_image_processor(str(folder))
    llm = LLM(model=str(folder), max_model_len=128)
    data = wav_bytes(waves()[2])
    decoded = np.frombuffer(data[44:], "<i2").astype(np.float32) / 32768.0
    want = {}
    for language in ("en", None):
        text = render_chat(tokenizer(folder), processor.transcription_messages("transcribe", language, None), False,
                           True, chat_template=TEMPLATE)
        ids, mm = expand_in(folder, text, [decoded])
        out = llm.generate({"prompt_token_ids": tokenizer(folder).encode(text), "multi_modal_data": {
            "audio": [decoded]}}, SamplingParams(temperature=0.0, max_tokens=128 - len(ids)), use_tqdm=False)[0]
        want[language] = processor.transcription_text(out.outputs[0].text)
    aengine = AsyncLLMEngine(llm.engine)
    app = build_openai_app(AsyncEngineClient(aengine, image_processor=processor),
                           ServerConfig("tiny", chat_template=TEMPLATE))
    try:
        with serving(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            got = client.audio.transcriptions.create(model="tiny", file=("a.wav", data), language="en")
            assert got.text == want["en"] and got.text
            events = list(client.audio.transcriptions.create(model="tiny", file=("a.wav", data), language="en",
                                                             stream=True))
            assert "".join(e.delta for e in events[:-1]) == events[-1].text == want["en"]
            assert client.audio.transcriptions.create(model="tiny", file=("a.wav", data)).text == want[None]
            with pytest.raises(openai.BadRequestError, match="not one Qwen3ASRForConditionalGeneration takes"):
                client.audio.transcriptions.create(model="tiny", file=("a.wav", data), language="xx")
    finally:
        aengine.shutdown()


def test_refusals(release, tmp_path):
    """Images, an n_window other than the release's, a feature extractor of other mel bins or windows, a checkpoint
    lacking a projector tensor: each refused by name."""
    from safetensors.torch import load_file, save_file

    folder, _ = release
    processor = load_image_processor(str(folder))
    with pytest.raises(ValueError, match="takes audio only"):
        processor.process(None)
    with pytest.raises(ValueError, match="n_window=40 is not supported"):
        qa.Qwen3ASREncoder(config_with(folder, audio_config__n_window=40))
    copy = tmp_path / "m"
    copy.mkdir()
    for f in folder.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    settings = json.loads((folder / "preprocessor_config.json").read_text())
    (copy / "preprocessor_config.json").write_text(json.dumps({**settings, "feature_size": 8}))
    with pytest.raises(ValueError, match="feature_size=8 differs from audio_config.num_mel_bins=16"):
        load_image_processor(str(copy))
    (copy / "preprocessor_config.json").write_text(json.dumps({**settings, "n_window": 25}))
    with pytest.raises(ValueError, match="n_window=25\\) does not pad the mel frames"):
        load_image_processor(str(copy))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if "linear_2" not in k}, str(copy / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 2 tensor\(s\).*proj2"):
        load_image_encoder(str(copy), read_config(str(copy)), torch.float32, "cpu")
