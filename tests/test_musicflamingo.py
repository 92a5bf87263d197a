"""Music Flamingo's audio (``MusicFlamingoForConditionalGeneration``, :mod:`specray.models.musicflamingo`) against
transformers on tiny random fp32 weights: Audio Flamingo 3's tiny encoder (2 s windows, 16 mel bins, hidden 32: a
rotary dimension of 6, 12 channels turned) with the rotary time embedding (``rope_theta`` 1200) and a Qwen2 text
model, a tiny tokenizer with ``<sound>``, ``<|sound_bos|>``, ``<|sound_eos|>``. Two synthetic audios (1.28 s: one
window; 3.08 s: two): our expanded prompts and windows equal MusicFlamingoProcessor's; each audio's embeddings equal
``get_audio_features``' rows; the text model fed them equals the whole model's logits over a prefill, chunks
splitting the two-window audio's span and single steps; the rotary embedding's parts undone move the embeddings; two
tensor-parallel ranks equal one; refusals by name; ``LLM.generate`` with audio and n-gram drafts equals
``generate``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import specray_test_audio_checks as audio_checks
from specray_test_audio_checks import hf_processor, ours, spread_weights, waves
from specray_test_image_checks import assert_ranks_equal_one_rank, config_with, encode_items, image_logits
from specray_test_model_checks import max_diff
from tests.test_audioflamingo3 import AUDIO, CHUNK, EXTRA, MEL, RATE, TEMPLATE, TEXT, audios, whole_inputs

TOL, MOVED = 1e-4, 1e-2
MAX_LEN = 4
PROMPT = ("<|im_start|>user\n<sound>Describe it, then <sound>compare the quick brown fox.<|im_end|>\n"
          "<|im_start|>assistant\n")
SINGLE = "<|im_start|>user\n<sound>Describe the music.<|im_end|>\n<|im_start|>assistant\n"
ENGINE_PROMPT = "<|im_start|>user\nListen: <sound>"


def build(path: Path, seed: int = 0) -> Path:
    from transformers import (MusicFlamingoConfig, MusicFlamingoForConditionalGeneration, MusicFlamingoProcessor,
                              Qwen2Config, WhisperFeatureExtractor)

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=("<sound>", "<|sound_bos|>", "<|sound_eos|>"))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    extractor = WhisperFeatureExtractor(feature_size=MEL, chunk_length=CHUNK)
    MusicFlamingoProcessor(feature_extractor=extractor, tokenizer=tok, chat_template=TEMPLATE,
                           max_audio_len=MAX_LEN).save_pretrained(path)
    text = Qwen2Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       bos_token_id=None, **TEXT)
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in
           (("audio_token_id", "<sound>"), ("audio_bos_token_id", "<|sound_bos|>"),
            ("audio_eos_token_id", "<|sound_eos|>"))}
    config = MusicFlamingoConfig(audio_config=dict(AUDIO), text_config=text, **ids)
    torch.manual_seed(seed)
    model = MusicFlamingoForConditionalGeneration(config).float().eval()
    spread_weights(model)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("tiny_musicflamingo") / "m")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import MusicFlamingoForConditionalGeneration

    return MusicFlamingoForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def expanded(folder: Path, text: str = PROMPT, given=None):
    return audio_checks.expanded(folder, text, audios() if given is None else given)


@torch.no_grad()
def hf_rows(hf, ids, mm) -> torch.Tensor:
    inputs = whole_inputs(ids, mm)
    return hf.get_audio_features(inputs["input_features"], inputs["input_features_mask"].bool(),
                                 inputs["input_ids"]).pooler_output


def test_processor_equals_transformers(folder):
    """Each audio's expanded prompt (<|sound_bos|>, its <sound> tokens, <|sound_eos|>) and windows equal
    MusicFlamingoProcessor's; the embeddings go to the <sound> rows only."""
    theirs = hf_processor(folder)(text=[SINGLE, SINGLE], audio=audios(), sampling_rate=RATE)
    features, start = theirs["input_features"].numpy(), 0
    for row, wave in enumerate(audios()):
        ids, mm = expanded(folder, SINGLE, [wave])
        assert ids == theirs["input_ids"][row][theirs["attention_mask"][row].bool()].tolist()
        (item,) = mm.items
        assert item.embed_rows == list(range(1, item.length - 1))
        windows = item.data["input_features"].shape[0]
        assert np.array_equal(item.data["input_features"], features[start: start + windows])
        start += windows
    assert start == features.shape[0] == 3


def test_encoder_equals_get_audio_features(folder, hf):
    ids, mm = expanded(folder)
    got = encode_items(ours(folder)[0], mm)
    assert [g.shape[0] for g in got] == [item.length - 2 for item in mm.items]
    assert max_diff(torch.cat(got), hf_rows(hf, ids, mm)) < TOL


@pytest.mark.parametrize("cut", [None, 40])
def test_logits_with_audio_equal_transformers(folder, hf, cut):
    """The whole model's logits with both audios == our text model's with the rows in place: one prefill, or a first
    chunk ending 40 tokens into the two-window audio's span, then the rest, then single steps."""
    from specray.models.loader import load_model

    ids, mm = expanded(folder)
    sizes = [len(ids)] if cut is None else [mm.items[1].offset + cut, len(ids) - mm.items[1].offset - cut]
    got = image_logits(load_model(str(folder)), ids + EXTRA, mm, encode_items(ours(folder)[0], mm), sizes)
    with torch.no_grad():
        want = hf(**whole_inputs(ids + EXTRA, mm)).logits[0]
    assert max_diff(got, want) < TOL


def _no_rotation(encoder):
    encoder.time_rotation = lambda hidden: hidden


def _no_window_axis(encoder):  # every window timed as the audio's first
    rotate = encoder.time_rotation
    encoder.time_rotation = lambda hidden: torch.cat([rotate(h[None]) for h in hidden])


def _halved_turns(encoder):  # half the angles (rope_theta doubled: slower frequencies, a longer table)
    encoder.theta *= 2


MUTATIONS = {"no-rotation": _no_rotation, "no-window-axis": _no_window_axis, "other-theta": _halved_turns}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_embeddings(folder, hf, mutation):
    ids, mm = expanded(folder)
    encoder = ours(folder)[0]
    MUTATIONS[mutation](encoder)
    got = torch.cat(encode_items(encoder, mm))
    assert max_diff(got, hf_rows(hf, ids, mm)) > MOVED


def test_refusals(folder):
    from specray.models.musicflamingo import MusicFlamingoEncoder

    processor = ours(folder)[1]
    with pytest.raises(ValueError, match=r"longer than this model takes \(4 s\)"):
        processor.process_audio(waves((4.5,))[0])
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        MusicFlamingoEncoder(config_with(folder, rope_parameters={"rope_type": "yarn", "rope_theta": 1200.0}))
    with pytest.raises(ValueError, match="rope_theta=40.0"):
        MusicFlamingoEncoder(config_with(folder, rope_parameters={"rope_type": "default", "rope_theta": 40.0,
                                                                  "partial_rotary_factor": 0.2}))
    with pytest.raises(ValueError, match="partial_rotary_factor=0.9"):
        MusicFlamingoEncoder(config_with(folder, rope_parameters={"rope_type": "default", "rope_theta": 1200.0,
                                                                  "partial_rotary_factor": 0.9}))


def test_tensor_parallel_two_ranks_equal_one(folder, tmp_path):
    ids, mm = expanded(folder)
    inside = mm.items[1].offset + 40
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids + EXTRA, mm, [inside, len(ids) - inside])], 1, TOL)


def test_engine_greedy_with_audio_equals_transformers(folder, hf):
    from specray import LLM
    from specray_test_engine_runs import assert_images_greedy_equals_transformers

    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    wave = audios()[1]
    inputs = hf_processor(folder)(text=[ENGINE_PROMPT], audio=[wave], sampling_rate=RATE)
    assert_images_greedy_equals_transformers(llm, hf, hf_processor(folder), ENGINE_PROMPT, [(wave, RATE)],
                                             max_tokens=32, modality="audio", inputs=inputs)
