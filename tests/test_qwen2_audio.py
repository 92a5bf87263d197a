"""Qwen2-Audio's audio (``Qwen2AudioForConditionalGeneration``, :mod:`specray.models.qwen2_audio` on the shared
Whisper-style encoder of :mod:`specray.models.whisper_audio`) against transformers on tiny random fp32 weights: 16
mel bins, a 3 s window (300 frames, 150 positions), two encoder layers, a Qwen2 text model, a tiny tokenizer with
``<|AUDIO|>`` / ``<|audio_bos|>`` / ``<|audio_eos|>``. Two synthetic audios (1.28 s and 2.45 s at 16 kHz, a fixed
seed): our expanded prompt and features equal Qwen2AudioProcessor's; each audio's embeddings equal the projector's
rows the whole model scatters; the text model fed them equals the whole model's logits over a prefill, chunks
splitting an audio's span and single steps; the shared encoder equals transformers' Qwen2AudioEncoder over whole
padded windows (with and without a mask); each distinctive part undone moves the embeddings; two tensor-parallel
ranks equal one; refusals by name; ``LLM.generate`` with audio and n-gram drafts equals
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
MEL, CHUNK = 16, 3
PROMPT = ("<|im_start|>user\nAudio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nAudio 2: <|audio_bos|><|AUDIO|>"
          "<|audio_eos|>\nWhat is the quick brown fox?<|im_end|>\n<|im_start|>assistant\n")
ONE = "<|audio_bos|><|AUDIO|><|audio_eos|>Generate the caption in English:"
# (the engine's prompt ends inside the second audio's span: the tiny model's greedy tokens then follow the audio)
ENGINE_PROMPT = "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nAudio 2: <|audio_bos|><|AUDIO|>"
EXTRA = [7, 300, 41, 5, 99]
SPECIALS = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, rms_norm_eps=1e-6)
AUDIO = dict(model_type="qwen2_audio_encoder", d_model=32, encoder_layers=2, encoder_attention_heads=4,
             encoder_ffn_dim=64, num_mel_bins=MEL, max_source_positions=CHUNK * 50)
# the release's template for audio parts (Qwen2AudioProcessor's default), its system turn left out
TEMPLATE = ("{% set audio_count = namespace(value=0) %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
            "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
            "{% for content in message['content'] %}{% if content['type'] == 'audio' %}"
            "{% set audio_count.value = audio_count.value + 1 %}"
            "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
            "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build(path: Path, seed: int = 0) -> Path:
    """transformers' Qwen2AudioForConditionalGeneration saved with Qwen2AudioProcessor (a WhisperFeatureExtractor of
    16 mel bins and 3 s windows; the tiny tokenizer with the audio tokens)."""
    from transformers import (Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor, Qwen2Config,
                              WhisperFeatureExtractor)

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=SPECIALS)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    extractor = WhisperFeatureExtractor(feature_size=MEL, chunk_length=CHUNK)
    Qwen2AudioProcessor(feature_extractor=extractor, tokenizer=tok, chat_template=TEMPLATE).save_pretrained(path)
    text = Qwen2Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       bos_token_id=None, **TEXT)
    config = Qwen2AudioConfig(audio_config=AUDIO, text_config=text,
                              audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"))
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config).float().eval()
    spread_weights(model)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("tiny_qwen2_audio") / "m")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import Qwen2AudioForConditionalGeneration

    return Qwen2AudioForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def hf_inputs(folder: Path, text: str = PROMPT, audios=None) -> dict:
    audios = waves() if audios is None else audios
    return hf_processor(folder)(text=[text], audio=audios, sampling_rate=RATE, return_tensors="pt")


def expanded(folder: Path, text: str = PROMPT, audios=None):
    return audio_checks.expanded(folder, text, waves() if audios is None else audios)


@torch.no_grad()
def hf_logits(hf, inputs, extra=()) -> torch.Tensor:
    ids = torch.cat([inputs["input_ids"], torch.tensor([list(extra)], dtype=torch.long)], dim=1)
    return hf(input_ids=ids, input_features=inputs["input_features"],
              feature_attention_mask=inputs["feature_attention_mask"]).logits[0]


@torch.no_grad()
def hf_audio_rows(hf, inputs) -> torch.Tensor:
    """The rows the whole model scatters into the <|AUDIO|> tokens (its projector's output at each audio's valid
    rows), caught from its forward."""
    caught = []
    hook = hf.model.multi_modal_projector.register_forward_hook(lambda m, a, out: caught.append(out))
    try:
        hf(**inputs)
    finally:
        hook.remove()
    frames = inputs["feature_attention_mask"].sum(-1)
    counts = hf.model.audio_tower._get_feat_extract_output_lengths(frames)[1]
    return torch.cat([rows[:n] for rows, n in zip(caught[0], counts.tolist())])


# ---- the processor and the encoder -----------------------------------------------------------------------------------

@pytest.mark.parametrize("count", [1, 2])
def test_processor_and_encoder_equal_transformers(folder, hf, count):
    """Our expanded prompt, features and masks equal Qwen2AudioProcessor's (one audio; two of different lengths);
    each audio's embeddings equal the rows the whole model scatters."""
    text, audios = (ONE, waves()[1:]) if count == 1 else (PROMPT, waves())
    theirs = hf_inputs(folder, text, audios)
    ids, mm = expanded(folder, text, audios)
    assert ids == theirs["input_ids"][0].tolist()
    assert [i.length for i in mm.items] == [((n - 1) // 2 + 1 - 2) // 2 + 1
                                           for n in theirs["feature_attention_mask"].sum(-1).tolist()]
    assert np.array_equal(np.concatenate([i.data["input_features"] for i in mm.items]),
                          theirs["input_features"].numpy())
    assert np.array_equal(np.concatenate([i.data["feature_attention_mask"] for i in mm.items]),
                          theirs["feature_attention_mask"].numpy())
    got = torch.cat(encode_items(ours(folder)[0], mm))
    assert got.shape == (sum(i.length for i in mm.items), 64)
    assert max_diff(got, hf_audio_rows(hf, theirs)) < TOL


@pytest.mark.parametrize("masked", [False, True])
def test_shared_tower_equals_transformers_encoder(folder, hf, masked):
    """The shared tower over two padded windows equals transformers' Qwen2AudioEncoder at every valid row: with the
    padded frames masked as keys (each window run only as far as the longer needs) and, without lengths, over the
    whole window attending to all of it (Whisper's way)."""
    from transformers.masking_utils import create_bidirectional_mask

    tower = ours(folder)[0].tower
    theirs = hf_inputs(folder)
    features, mask = theirs["input_features"], theirs["feature_attention_mask"]
    frames = mask.sum(-1).tolist()
    with torch.no_grad():
        keys = None
        if masked:
            rows = torch.arange(CHUNK * 50)[None] < torch.tensor([(n - 1) // 2 + 1 for n in frames])[:, None]
            keys = create_bidirectional_mask(config=hf.model.audio_tower.config,
                                             inputs_embeds=torch.zeros(2, CHUNK * 50, 1), attention_mask=rows.long())
        want = hf.model.audio_tower(features, attention_mask=keys).last_hidden_state
        got = tower(features, frames if masked else None)
    counts = tower.out_lengths(frames) if masked else [CHUNK * 25] * 2
    for i, n in enumerate(counts):
        assert max_diff(got[i, :n], want[i, :n]) < TOL


@pytest.mark.parametrize("kind", ["whisper", "voxtral"])
def test_shared_tower_equals_whisper_style_encoders(kind):
    """Without the pool and without lengths the shared tower is Whisper's encoder (and Voxtral's, the same): every
    row over two whole windows equals transformers' WhisperEncoder / VoxtralEncoder of random weights."""
    from transformers import VoxtralEncoderConfig, WhisperConfig
    from transformers.models.voxtral.modeling_voxtral import VoxtralEncoder
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    from specray.models.whisper_audio import WhisperAudioTower

    sizes = dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=MEL,
                 max_source_positions=40)
    config = WhisperConfig(**sizes) if kind == "whisper" else VoxtralEncoderConfig(**sizes)
    torch.manual_seed(0)
    theirs = (WhisperEncoder if kind == "whisper" else VoxtralEncoder)(config).float().eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.normal_(0.0, 0.3) if name.endswith(("q_proj.weight", "k_proj.weight", "embed_positions.weight")) else \
                p.uniform_(0.5, 1.5) if "norm" in name and name.endswith("weight") else p.normal_(0.0, 0.1)
    tower = WhisperAudioTower(config, pool=False)
    tower.load_weights(theirs.state_dict().items(), "the tower")
    features = torch.randn(2, MEL, 80)
    with torch.no_grad():
        assert max_diff(tower(features), theirs(features).last_hidden_state) < TOL


# ---- the whole model -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunked", [False, True])
def test_logits_with_audio_equal_transformers(folder, hf, chunked):
    """transformers' whole-model logits over the prompt with two audios and EXTRA tokens == our Qwen2 text model's
    (through _TEXT_PARTS) with the encoder's rows in place: one prefill, or a chunk ending inside the first audio's
    span, then the rest, then single steps."""
    from specray.models.loader import load_model

    ids, mm = expanded(folder)
    sizes = [first_cut(mm), len(ids) - first_cut(mm)] if chunked else [len(ids)]
    got = image_logits(load_model(str(folder)), ids + EXTRA, mm, encode_items(ours(folder)[0], mm), sizes)
    assert max_diff(got, hf_logits(hf, hf_inputs(folder), EXTRA)) < TOL


def test_text_model_alone_equals_transformers(folder, hf):
    from transformers import AutoTokenizer

    from specray.models.loader import load_model

    ids = AutoTokenizer.from_pretrained(folder).encode("The quick brown fox jumps over the lazy dog")
    got = image_logits(load_model(str(folder)), ids, MultiModalInputs([]), [], [5])
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    assert max_diff(got, want) < TOL


# ---- each part shows -------------------------------------------------------------------------------------------------

def _attend_padding(encoder):  # the padded frames attended, as Whisper attends them
    run = encoder.tower.forward
    encoder.tower.forward = lambda features, frames=None: run(features, None)


def _no_pool(encoder):  # every second row taken instead of the average of two
    from specray.models.whisper_audio import pooled_lengths

    encoder.tower.pool = False
    project = encoder.project
    encoder.project = lambda hidden: project(hidden[:, ::2])
    encoder.tower.out_lengths = pooled_lengths


def _no_final_norm(encoder):
    encoder.tower.layer_norm = torch.nn.Identity()


def _no_positions(encoder):
    encoder.tower.embed_positions.weight.zero_()


def _linear_stem(encoder):  # the conv stem without its GELUs
    encoder.tower.stem_act = torch.nn.Identity()


def _no_projector_bias(encoder):
    encoder.projector.linear.bias.zero_()


def _causal(encoder):  # each row attending to the rows before it only (the encoder attends both ways)
    from specray.models.whisper_audio import WhisperAudioAttention

    for layer in encoder.tower.layers:
        def forward(x, keys, attn=layer.self_attn):
            causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
            return WhisperAudioAttention.forward(attn, x, causal if keys is None else keys & causal)
        layer.self_attn.forward = forward


MUTATIONS = {"attend-padding": _attend_padding, "no-pool": _no_pool, "no-final-norm": _no_final_norm,
             "no-positions": _no_positions, "linear-stem": _linear_stem,
             "no-projector-bias": _no_projector_bias, "causal": _causal}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_embeddings(folder, hf, mutation):
    """Each part of the encoder done otherwise moves the embeddings away from the whole model's (two audios)."""
    theirs = hf_inputs(folder)
    _, mm = expanded(folder)
    encoder = ours(folder)[0]
    with torch.no_grad():
        MUTATIONS[mutation](encoder)
    got = torch.cat(encode_items(encoder, mm))
    assert max_diff(got, hf_audio_rows(hf, theirs)) > MOVED


# ---- refusals --------------------------------------------------------------------------------------------------------

def test_refusals(folder, tmp_path):
    """An audio longer than the window, an empty or 2-D one, a feature extractor that does not fit the encoder, a
    checkpoint lacking the projector, images: each refused by name."""
    from safetensors.torch import load_file

    from specray.models.loader import read_config
    from specray.models.qwen2_audio import Qwen2AudioEncoder, Qwen2AudioProcessor

    processor = ours(folder)[1]
    assert processor.max_audio_samples == 3 * RATE  # the server's transcriptions cut clips of it
    with pytest.raises(ValueError, match=r"3.10 s .* longer than this model takes \(3 s\)"):
        processor.process_audio(waves((3.1,))[0])
    with pytest.raises(ValueError, match="longer than this model takes"):
        processor.process_audio(np.zeros(3 * RATE + 1, np.float32))
    with pytest.raises(ValueError, match="2 mel frame.* too short .* at least 30 ms"):
        processor.process_audio(np.ones(300, np.float32))
    assert len(processor.process_audio(np.ones(321, np.float32)).replacement) == 1
    with pytest.raises(ValueError, match="non-empty 1-D waveform"):
        processor.process_audio(np.zeros((2, 100), np.float32))
    with pytest.raises(ValueError, match="takes audio, not images"):
        processor.process(None)
    copy = shutil.copytree(folder, tmp_path / "m")
    path = copy / "processor_config.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    target = saved.get("feature_extractor", saved)
    target["chunk_length"] = 2
    if path.is_file():
        path.write_text(json.dumps(saved))
    pre = copy / "preprocessor_config.json"
    if pre.is_file():
        pre.write_text(json.dumps({**json.loads(pre.read_text()), "chunk_length": 2}))
    with pytest.raises(ValueError, match="chunk_length=2"):
        Qwen2AudioProcessor.from_pretrained(copy, read_config(str(copy)))
    config = config_with(folder, audio_token_index=None)
    with pytest.raises(ValueError, match="audio_token_index"):
        Qwen2AudioProcessor.from_pretrained(folder, config)
    config = config_with(folder, audio_config__activation_function="swish")
    with pytest.raises(ValueError, match="audio_config.activation_function='swish'"):
        Qwen2AudioEncoder(config)
    encoder = Qwen2AudioEncoder(read_config(str(folder)))
    tensors = load_file(str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="projector.linear.bias"):
        encoder.load_weights((n, t) for n, t in tensors.items() if n != "multi_modal_projector.linear.bias")
    with pytest.raises(ValueError, match="layers.1.fc2.weight"):
        encoder.load_weights((n, t) for n, t in tensors.items() if n != "audio_tower.layers.1.fc2.weight")


# ---- tensor parallel and the engine ----------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(folder, tmp_path):
    """The text model split over two tensor-parallel ranks (the encoder whole on each) gives one rank's logits with
    the audio rows in place, a chunk ending inside the first audio's span, then single steps."""
    ids, mm = expanded(folder)
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids + EXTRA, mm, [first_cut(mm), len(ids) - first_cut(mm)])],
                                1, TOL)


def test_engine_greedy_with_audio_equals_transformers(folder, hf):
    """LLM.generate with two audios (chunks of 16 tokens split their spans; n-gram drafts) gives transformers' greedy
    generate's tokens beside a text-only prompt; without the audio transformers generates other tokens."""
    from specray import LLM
    from specray_test_engine_runs import assert_images_greedy_equals_transformers

    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    audios = [(w, RATE) for w in waves()]
    assert_images_greedy_equals_transformers(llm, hf, hf_processor(folder), ENGINE_PROMPT, audios, max_tokens=32,
                                             modality="audio", inputs=hf_inputs(folder, ENGINE_PROMPT))


def test_chat_with_an_input_audio_part(folder, hf):
    """LLM.chat with an OpenAI input_audio part (a WAV, base64) renders the release's audio text through the chat
    template and gives transformers' greedy tokens for that prompt and the decoded audio."""
    from specray import LLM, SamplingParams

    data = wav_bytes(waves()[0])
    decoded = np.frombuffer(data[44:], "<i2").astype(np.float32) / 32768.0
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=32)
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}},
        {"type": "text", "text": "What is it?"}]}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    text = ("<|im_start|>user\nAudio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nWhat is it?<|im_end|>\n"
            "<|im_start|>assistant\n")
    inputs = hf_inputs(folder, text, [decoded])
    with torch.no_grad():
        want = hf.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
    assert list(out.outputs[0].token_ids) == want
