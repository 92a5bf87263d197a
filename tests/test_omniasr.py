"""Omnilingual ASR's LLM recogniser (``specray.models.omniasr``): against transformers' whole
``OmniASRForConditionalGeneration`` on the same tiny random fp32 weights (a two-layer Llama text model, a wav2vec 2.0
encoder of three convolutions and two layers), synthetic waveforms from a fixed seed.

Our expanded prompts and normalised waveforms equal transformers' ``OmniASRProcessor``'s for each audio alone (one of
the fewest samples that give a frame, longer ones); each audio's embeddings equal ``get_audio_features``'; the text
model fed them gives the whole model's logits over a prompt with an audio, in chunks splitting its span, then decode
steps, and two tensor-parallel ranks one rank's; the engine's greedy tokens with an audio and n-gram drafts equal
transformers' ``generate``; the OpenAI server's transcription prompt is ``apply_transcription_request``'s; what is not
served is refused by name.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models import omniasr as om
from specray.models.loader import load_image_processor, load_model
from specray_test_audio_checks import draw_visible, expand_in, tone_waves
from specray_test_image_checks import (assert_ranks_equal_one_rank, config_with, encoded,  # tests/image_checks.py
                                      image_logits)
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
RATE = 16000
AUDIO = "<extra_id_1>"
HIDDEN = 64
KERNELS, STRIDES = [10, 3, 2], [5, 2, 2]
LENGTHS = [30, 1600, 20800]  # the fewest samples for one frame; 0.1 s; 1.3 s
FRAMES = [1, 79, 1039]
# the release's template's shape: the audio placeholder, then the language's token where the turn names one
TEMPLATE = ("{% for m in messages %}{% for p in m.content %}{% if p.type == 'audio' %}" + AUDIO + "{% elif p.type == "
            "'language' %}<|lang:{{ p.language }}|>{% else %}{{ p.text }}{% endif %}{% endfor %}{% endfor %}"
            "{% if add_generation_prompt %} =>{% endif %}")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def waves() -> list[np.ndarray]:
    return tone_waves(LENGTHS)


def build_release(path: Path, seed: int = 0):
    """transformers' OmniASRForConditionalGeneration at the tiny sizes, its audio weights drawn visible, saved with
    conftest's tiny tokenizer (the placeholder among its special tokens) and the feature extractor."""
    from transformers import OmniASRConfig, OmniASRFeatureExtractor, OmniASRForConditionalGeneration

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=(AUDIO, "<|lang:eng_latn|>"))
    audio = dict(hidden_size=32, conv_dim=[16, 16, 16], conv_kernel=KERNELS, conv_stride=STRIDES,
                 num_attention_heads=4, num_hidden_layers=2, num_conv_pos_embeddings=8,
                 num_conv_pos_embedding_groups=4, intermediate_size=64, hidden_dropout=0.0, activation_dropout=0.0,
                 layerdrop=0.0)
    text = dict(model_type="llama", vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                initializer_range=0.2)
    config = OmniASRConfig(audio_config=audio, text_config=text, audio_token_id=tok.convert_tokens_to_ids(AUDIO),
                           pad_token_id=0, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = OmniASRForConditionalGeneration(config).float().eval()
    draw_visible(model, seed=seed + 1)
    model.save_pretrained(path)
    OmniASRFeatureExtractor().save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return build_release(tmp_path_factory.mktemp("omniasr"))


def tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def hf_processor(folder: Path):
    from transformers import OmniASRFeatureExtractor, OmniASRProcessor

    return OmniASRProcessor(feature_extractor=OmniASRFeatureExtractor.from_pretrained(str(folder)),
                            tokenizer=tokenizer(folder), audio_token=AUDIO, conv_kernel=KERNELS, conv_stride=STRIDES)


def test_processor_and_encoder_equal_transformers(release):
    """For each audio alone: our expanded prompt is OmniASRProcessor's, our waveform its normalised one, our
    embeddings ``get_audio_features``'."""
    folder, hf = release
    theirs = hf_processor(folder)
    text = "Hi " + AUDIO + " there"
    for wave, frames in zip(waves(), FRAMES):
        want = theirs(text=[text], audio=[wave], return_tensors="pt")
        ids, mm = expand_in(folder, text, [wave])
        assert ids == want["input_ids"][0].tolist() and mm.items[0].length == frames
        assert np.array_equal(mm.items[0].data["input_values"], want["input_values"][0, 0].numpy())
        with torch.no_grad():
            rows = hf.model.get_audio_features(want["input_values"], want["padding_mask"]).pooler_output
        assert max_diff(encoded(folder, mm)[0], rows) < TOL
    assert load_image_processor(str(folder)).least_samples() == LENGTHS[0]


@torch.no_grad()
def test_logits_with_an_audio_equal_transformers(release):
    folder, hf = release
    text = "Hello " + AUDIO + " world"
    ids, mm = expand_in(folder, text, waves()[1:2])
    want_in = hf_processor(folder)(text=[text], audio=[waves()[1]], return_tensors="pt")
    extra = [17, 42, 99]
    want = hf(input_ids=torch.tensor([ids + extra]), input_values=want_in["input_values"],
              padding_mask=want_in["padding_mask"]).logits[0]
    first = mm.items[0].offset + 5
    got = image_logits(load_model(str(folder)), ids + extra, mm, encoded(folder, mm), [first, len(ids) - first])
    assert max_diff(got, want) < TOL


def test_two_ranks_equal_one_rank(release, tmp_path):
    folder, _ = release
    ids, mm = expand_in(folder, "Hi " + AUDIO + " and " + AUDIO, waves()[:2])
    first = mm.items[1].offset + 3
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids, mm, [first, len(ids) - first])], 1, TOL)


def test_engine_greedy_with_audio_equals_transformers(release):
    from specray import LLM

    folder, hf = release
    text = "Hello " + AUDIO + " world"
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=12, speculative_config=NGRAM)
    inputs = dict(hf_processor(folder)(text=[text], audio=[waves()[1]], return_tensors="pt"))
    inputs.pop("attention_mask")
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf, None, text, [(waves()[1], RATE)], modality="audio",
                                                  inputs=inputs, max_tokens=40)


def test_transcription_requests_are_the_releases(release):
    """``transcription_messages`` renders as ``apply_transcription_request`` writes (the audio, then the language's
    code mapped from ISO 639-1); a translation, a prompt or an unknown language are refused."""
    from specray.chat import render_chat

    folder, _ = release
    processor = load_image_processor(str(folder))
    theirs = hf_processor(folder)
    for language in (None, "en"):
        ours = render_chat(tokenizer(folder), processor.transcription_messages("transcribe", language, None), True,
                           False, chat_template=TEMPLATE)
        want = theirs.apply_transcription_request(waves()[1], language=language, tokenize=False,
                                                  chat_template=TEMPLATE)
        assert ours == (want[0] if isinstance(want, list) else want)
    assert ours == AUDIO + "<|lang:eng_latn|> =>"
    for args, says in [(("translate", None, None), "transcribes only"), (("transcribe", None, "Hi"), "no prompt"),
                       (("transcribe", "xx", None), "language='xx' has no code")]:
        with pytest.raises(ValueError, match=says):
            processor.transcription_messages(*args)


def test_refusals(release):
    folder, _ = release
    processor = load_image_processor(str(folder))
    with pytest.raises(ValueError, match="takes audio only"):
        processor.process(None)
    with pytest.raises(ValueError, match="gives no encoder frame: send a mono waveform of at least 30 samples"):
        processor.process_audio(np.zeros(29, np.float32))
    with pytest.raises(ValueError, match="num_conv_pos_embeddings=7 is not supported"):
        om.OmniASREncoder(config_with(folder, audio_config__num_conv_pos_embeddings=7))
    with pytest.raises(ValueError, match="hidden_act='swishy' is not supported"):
        om.OmniASREncoder(config_with(folder, audio_config__hidden_act="swishy"))
