"""Audio Flamingo 3's audio (``AudioFlamingo3ForConditionalGeneration``, :mod:`specray.models.audioflamingo3` on the
shared Whisper-style encoder of :mod:`specray.models.whisper_audio`) against transformers on tiny random fp32
weights: 16 mel bins, 2 s windows (200 frames, 100 positions), two encoder layers, the two-linear projector, a Qwen2
text model, a tiny tokenizer with ``<sound>``. Two synthetic audios (1.28 s: one window; 3.08 s: two windows,
the second 1.08 s) from a fixed seed: our expanded prompts and windows' features equal AudioFlamingo3Processor's; each
audio's embeddings equal ``get_audio_features``; the text model fed them equals the whole model's logits over a
prefill, chunks splitting an audio's span and single steps; each distinctive part undone moves the embeddings; two
tensor-parallel ranks equal one; refusals by name; ``LLM.generate`` with a two-window audio and n-gram drafts equals
``generate``, and ``LLM.chat`` takes an ``input_audio`` part."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import specray_test_audio_checks as audio_checks
from specray.multimodal import MultiModalInputs
from specray_test_audio_checks import RATE, hf_processor, ours, spread_weights, wav_bytes, waves
from specray_test_image_checks import assert_ranks_equal_one_rank, config_with, encode_items, first_cut, image_logits
from specray_test_model_checks import max_diff

TOL, MOVED = 1e-4, 1e-2
MEL, CHUNK, MAX_LEN = 16, 2, 4
SECONDS = (1.28, 3.08)  # (64 rows after the stem; 100 and 54 in the two windows)
PROMPT = ("<|im_start|>user\n<sound>Describe it, then <sound>compare the quick brown fox.<|im_end|>\n"
          "<|im_start|>assistant\n")
SINGLE = "<|im_start|>user\n<sound>Transcribe the input speech.<|im_end|>\n<|im_start|>assistant\n"
ENGINE_PROMPT = "<|im_start|>user\nListen: <sound>"  # (ends with the audio: the tiny model's tokens then follow it)
EXTRA = [7, 300, 41, 5, 99]
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, rms_norm_eps=1e-6)
AUDIO = dict(model_type="audioflamingo3_encoder", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=64, num_mel_bins=MEL, max_source_positions=CHUNK * 50)
# a ChatML template writing <sound> for an audio part, before the turn's text
TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
            "{{ message['content'] }}{% else %}{% for content in message['content'] %}"
            "{% if content['type'] == 'audio' %}<sound>{% endif %}{% endfor %}"
            "{% for content in message['content'] %}{% if content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
            "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}")


def audios() -> list[np.ndarray]:
    return waves(SECONDS)


def build(path: Path, seed: int = 0) -> Path:
    """transformers' AudioFlamingo3ForConditionalGeneration saved with AudioFlamingo3Processor (a
    WhisperFeatureExtractor of 16 mel bins and 2 s windows, max_audio_len 4 s; the tiny tokenizer with <sound>)."""
    from transformers import (AudioFlamingo3Config, AudioFlamingo3ForConditionalGeneration, AudioFlamingo3Processor,
                              Qwen2Config, WhisperFeatureExtractor)

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=("<sound>",))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    extractor = WhisperFeatureExtractor(feature_size=MEL, chunk_length=CHUNK)
    AudioFlamingo3Processor(feature_extractor=extractor, tokenizer=tok, chat_template=TEMPLATE,
                            max_audio_len=MAX_LEN).save_pretrained(path)
    text = Qwen2Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       bos_token_id=None, **TEXT)
    config = AudioFlamingo3Config(audio_config=AUDIO, text_config=text,
                                  audio_token_id=tok.convert_tokens_to_ids("<sound>"))
    torch.manual_seed(seed)
    model = AudioFlamingo3ForConditionalGeneration(config).float().eval()
    spread_weights(model)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("tiny_audioflamingo3") / "m")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AudioFlamingo3ForConditionalGeneration

    return AudioFlamingo3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def expanded(folder: Path, text: str = PROMPT, given=None):
    return audio_checks.expanded(folder, text, audios() if given is None else given)


def whole_inputs(ids: list[int], mm) -> dict:
    """transformers' model inputs for our expanded prompt: its ids and the audios' windows in order (each sample's
    expansion and windows equal AudioFlamingo3Processor's: test_processor_equals_transformers)."""
    data = [item.data for item in mm.items]
    return {"input_ids": torch.tensor([ids]),
            "input_features": torch.from_numpy(np.concatenate([d["input_features"] for d in data])),
            "input_features_mask": torch.from_numpy(np.concatenate([d["input_features_mask"] for d in data]))}


@torch.no_grad()
def hf_rows(hf, mm) -> torch.Tensor:
    inputs = whole_inputs([0], mm)
    return hf.get_audio_features(inputs["input_features"], inputs["input_features_mask"].bool()).pooler_output


# ---- the processor and the encoder -----------------------------------------------------------------------------------

def test_processor_equals_transformers(folder):
    """Each audio's expanded prompt (one window; two windows, the second shorter), its windows' features and masks
    equal AudioFlamingo3Processor's over a batch of the two prompts."""
    theirs = hf_processor(folder)(text=[SINGLE, SINGLE], audio=audios(), sampling_rate=RATE)
    features, mask, start = theirs["input_features"].numpy(), theirs["input_features_mask"].numpy(), 0
    for row, wave in enumerate(audios()):
        ids, mm = expanded(folder, SINGLE, [wave])
        want = theirs["input_ids"][row][theirs["attention_mask"][row].bool()].tolist()
        assert ids == want
        (item,) = mm.items
        windows = item.data["input_features"].shape[0]
        assert windows == int(np.ceil(len(wave) / (RATE * CHUNK)))
        assert np.array_equal(item.data["input_features"], features[start: start + windows])
        assert np.array_equal(item.data["input_features_mask"], mask[start: start + windows])
        start += windows
    assert start == features.shape[0] == 3


def test_encoder_equals_get_audio_features(folder, hf):
    """Each audio's embeddings (the two-window one's rows: its windows' valid rows in order) equal
    get_audio_features' rows for its windows."""
    _, mm = expanded(folder)
    encoder = ours(folder)[0]
    got = encode_items(encoder, mm)
    assert [g.shape for g in got] == [(item.length, 64) for item in mm.items]
    assert mm.items[1].length == sum(encoder.tower.out_lengths(mm.items[1].data["input_features_mask"].sum(-1)))
    assert max_diff(torch.cat(got), hf_rows(hf, mm)) < TOL


# ---- the whole model -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cut", [None, 1, 2])
def test_logits_with_audio_equal_transformers(folder, hf, cut):
    """transformers' whole-model logits over a prompt with both audios and EXTRA tokens == our Qwen2 text model's
    with the encoder's rows in place: one prefill, or a first chunk ending inside the first audio's span, or inside
    the second's (between its windows' rows), then the rest, then single steps."""
    from specray.models.loader import load_model

    ids, mm = expanded(folder)
    sizes = [len(ids)]
    if cut == 1:
        sizes = [first_cut(mm), len(ids) - first_cut(mm)]
    elif cut == 2:
        inside = mm.items[1].offset + 30
        sizes = [inside, len(ids) - inside]
    got = image_logits(load_model(str(folder)), ids + EXTRA, mm, encode_items(ours(folder)[0], mm), sizes)
    inputs = whole_inputs(ids + EXTRA, mm)
    with torch.no_grad():
        want = hf(**inputs).logits[0]
    assert max_diff(got, want) < TOL


def test_text_model_alone_equals_transformers(folder, hf):
    from transformers import AutoTokenizer

    from specray.models.loader import load_model

    ids = AutoTokenizer.from_pretrained(folder).encode("The quick brown fox jumps over the lazy dog")
    got = image_logits(load_model(str(folder)), ids, MultiModalInputs([]), [], [5])
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    assert max_diff(got, want) < TOL


# ---- each part shows -------------------------------------------------------------------------------------------------

def _linear_projector(encoder):  # the projector's activation left out
    encoder.act = torch.nn.Identity()


def _no_projector_bias(encoder):
    encoder.projector.linear_1.bias.zero_()


def _windows_reversed(encoder):  # an audio's windows' rows in the other order
    encode = encoder.encode

    def reversed_encode(data):
        if data["input_features"].shape[0] == 1:
            return encode(data)
        parts = [encode({k: v[i: i + 1] for k, v in data.items()}) for i in range(data["input_features"].shape[0])]
        return torch.cat(parts[::-1])
    encoder.encode = reversed_encode


def _attend_padding(encoder):  # the second window's padded frames attended
    run = encoder.tower.forward
    encoder.tower.forward = lambda features, frames=None: run(features, None)


def _no_final_norm(encoder):
    encoder.tower.layer_norm = torch.nn.Identity()


MUTATIONS = {"linear-projector": _linear_projector, "no-projector-bias": _no_projector_bias,
             "windows-reversed": _windows_reversed, "attend-padding": _attend_padding,
             "no-final-norm": _no_final_norm}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_embeddings(folder, hf, mutation):
    _, mm = expanded(folder)
    encoder = ours(folder)[0]
    with torch.no_grad():
        MUTATIONS[mutation](encoder)
    got = torch.cat(encode_items(encoder, mm))
    assert max_diff(got, hf_rows(hf, mm)) > MOVED


# ---- refusals --------------------------------------------------------------------------------------------------------

def test_refusals(folder, tmp_path):
    """An audio longer than max_audio_len (its windows past it would be cut by transformers), a max_audio_len
    shorter than one window, an unknown projector activation, a config without audio_token_id, a checkpoint lacking
    a projector tensor, images: each refused by name."""
    from safetensors.torch import load_file

    from specray.models.audioflamingo3 import AudioFlamingo3Encoder, AudioFlamingo3Processor
    from specray.models.loader import read_config

    processor = ours(folder)[1]
    assert processor.max_windows == MAX_LEN // CHUNK
    assert processor.max_audio_samples == processor.max_windows * CHUNK * RATE  # the server's transcription clips
    with pytest.raises(ValueError, match="longer than this model takes"):
        processor.process_audio(np.zeros(processor.max_audio_samples + 1, np.float32))
    with pytest.raises(ValueError, match=r"4.50 s .* longer than this model takes \(4 s\)"):
        processor.process_audio(waves((4.5,))[0])
    with pytest.raises(ValueError, match="takes audio, not images"):
        processor.process(None)
    copy = shutil.copytree(folder, tmp_path / "m")
    path = copy / "processor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_audio_len": 1}))
    with pytest.raises(ValueError, match="max_audio_len=1"):
        AudioFlamingo3Processor.from_pretrained(copy, read_config(str(copy)))
    with pytest.raises(ValueError, match="audio_token_id"):
        AudioFlamingo3Processor.from_pretrained(folder, config_with(folder, audio_token_id=None))
    with pytest.raises(ValueError, match="projector_hidden_act='swish'"):
        AudioFlamingo3Encoder(config_with(folder, projector_hidden_act="swish"))
    encoder = AudioFlamingo3Encoder(read_config(str(folder)))
    tensors = load_file(str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="projector.linear_2.weight"):
        encoder.load_weights((n, t) for n, t in tensors.items() if n != "multi_modal_projector.linear_2.weight")


# ---- tensor parallel and the engine ----------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(folder, tmp_path):
    ids, mm = expanded(folder)
    inside = mm.items[1].offset + 30
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids + EXTRA, mm, [inside, len(ids) - inside])], 1, TOL)


def test_engine_greedy_with_audio_equals_transformers(folder, hf):
    """LLM.generate with the two-window audio (chunks of 16 tokens split its span; n-gram drafts) gives
    transformers' greedy generate's tokens beside a text-only prompt; without the audio it generates other tokens."""
    from specray import LLM
    from specray_test_engine_runs import assert_images_greedy_equals_transformers

    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    wave = audios()[1]
    inputs = hf_processor(folder)(text=[ENGINE_PROMPT], audio=[wave], sampling_rate=RATE)
    assert_images_greedy_equals_transformers(llm, hf, hf_processor(folder), ENGINE_PROMPT, [(wave, RATE)],
                                             max_tokens=32, modality="audio", inputs=inputs)


def test_chat_with_an_input_audio_part(folder, hf):
    """LLM.chat with an OpenAI input_audio part (a WAV, base64) renders <sound> through the chat template and gives
    transformers' greedy tokens for that prompt and the decoded audio."""
    from specray import LLM, SamplingParams

    data = wav_bytes(audios()[1])
    decoded = np.frombuffer(data[44:], "<i2").astype(np.float32) / 32768.0
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=32)
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}},
        {"type": "text", "text": "What is it?"}]}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    text = "<|im_start|>user\n<sound>What is it?<|im_end|>\n<|im_start|>assistant\n"
    inputs = hf_processor(folder)(text=[text], audio=[decoded], sampling_rate=RATE)
    with torch.no_grad():
        want = hf.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
    assert list(out.outputs[0].token_ids) == want
