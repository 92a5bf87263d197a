"""Audio in prompts, the seam's side (specray.multimodal, specray.chat, the server's content parts): the forms an
audio may take, decoding and resampling to the processor's rate, placeholders paired with audios, chat parts. The
families that read audio test their processors, encoders and engine runs in their own files."""

import base64
import io
import json
import zlib
import wave

import numpy as np
import pytest
import torch

from specray import LLM, SamplingParams
from specray.chat import split_media
from specray.multimodal import (AUDIO, MultiModalInputs, ProcessedImage, check_mm_counts, expand_prompt, load_audio,
                                media_of, text_only)

RATE = 16000
AUDIO_TOKEN, IMAGE_TOKEN = 7, 8


def _sine(freq: float, rate: int, seconds: float = 1.0, amplitude: float = 1.0) -> np.ndarray:
    return amplitude * np.sin(2 * np.pi * freq * np.arange(int(rate * seconds)) / rate)


def _wav(channels: list[np.ndarray], rate: int) -> bytes:
    """A 16-bit PCM WAV file of ``channels`` (each in [-1, 1])."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(len(channels))
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.stack(channels, 1) * 32767).round().astype("<i2").tobytes())
    return buf.getvalue()


def _near(wave_: np.ndarray, want: np.ndarray, tol: float, edge: int = 300) -> None:
    """Equal within ``tol`` away from the ends (a resampler's filter starts and ends on silence)."""
    assert wave_.shape == want.shape and wave_.dtype == np.float32
    assert np.abs(wave_ - want)[edge:-edge].max() < tol


def test_an_audio_takes_vllms_forms_and_several_make_a_list():
    pair, other = (_sine(440, 8000), 8000), (_sine(220, 8000), 8000)
    assert media_of({"audio": pair})["audio"] == [pair]
    assert media_of({"audio": [pair, other]})["audio"] == [pair, other]
    array = _sine(440, RATE)
    assert len(media_of({"audio": array})["audio"]) == 1 and len(media_of({"audio": [array, array]})["audio"]) == 2
    assert media_of({"audio": b"RIFF"})["audio"] == [b"RIFF"] and media_of({"image": []})["audio"] == []


def test_waveforms_are_resampled_scaled_and_made_mono():
    _near(load_audio((_sine(440, 8000), 8000), RATE), _sine(440, RATE), 1e-4)
    _near(load_audio((_sine(440, 48000), 48000.0), RATE), _sine(440, RATE), 1e-3)
    at_rate = _sine(300, RATE).astype(np.float64)
    assert np.array_equal(load_audio(at_rate, RATE), at_rate.astype(np.float32))  # a bare array: the model's rate
    ints = (_sine(300, RATE, amplitude=0.5) * 32768).astype(np.int16)
    _near(load_audio((ints, RATE), RATE), _sine(300, RATE, amplitude=0.5), 1e-4, edge=1)
    stereo = np.stack([_sine(300, RATE), np.zeros(RATE)], 1)  # [samples, channels] (soundfile's)
    _near(load_audio((stereo, RATE), RATE), _sine(300, RATE, amplitude=0.5), 1e-6, edge=1)
    _near(load_audio((stereo.T, RATE), RATE), _sine(300, RATE, amplitude=0.5), 1e-6, edge=1)  # (librosa's)


@pytest.mark.parametrize("rate", [16000, 22050])
def test_audio_files_decode_to_the_mean_of_their_channels(tmp_path, rate):
    """A stereo WAV (as bytes, a data: URL and a path) decodes to its channels' mean at the processor's rate
    (FFmpeg's own stereo downmix would scale it by 1/sqrt(2) more)."""
    data = _wav([_sine(300, rate, amplitude=0.8), _sine(300, rate, amplitude=0.4)], rate)
    want = _sine(300, RATE, amplitude=0.6)
    _near(load_audio(data, RATE), want, 2e-3)
    url = "data:audio/wav;base64," + base64.b64encode(data).decode()
    path = tmp_path / "a.wav"
    path.write_bytes(data)
    assert np.array_equal(load_audio(url, RATE), load_audio(data, RATE))
    assert np.array_equal(load_audio(str(path), RATE), load_audio(data, RATE))
    with pytest.raises(ValueError, match="data: URL .* or an http"):
        load_audio(str(path), RATE, local=False)  # a server's client names no local file


@pytest.mark.parametrize("audio, message", [
    ((np.zeros(0), RATE), "non-empty array of numbers"),
    ((np.array(["a"]), RATE), "non-empty array of numbers"),
    ((np.zeros((2, 2, 2)), RATE), "non-empty array of numbers"),
    ((np.zeros(10), 0), "sampling rate must be positive"),
    ((np.zeros(10), 8000.5), "give a whole rate in Hz"),
    ((np.full(10, np.nan), RATE), "NaN or infinite"),
    ((np.zeros(RATE * 3601, np.float32), RATE), "up to 3600 s"),
    (b"not an audio file", "could not be decoded"),
    ({"audio": 1}, "of type dict is not supported"),
    ("data:audio/wav,UklGRg==", r"must be 'data:audio/<type>;base64,<data>'"),  # (it said data:image/...)
])
def test_bad_audio_is_refused_by_name(audio, message):
    with pytest.raises(ValueError, match=message):
        load_audio(audio, RATE)


def test_a_file_without_sound_is_refused():
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, "PNG")
    with pytest.raises(ValueError, match="could not be decoded \\(no audio stream\\)"):
        load_audio(buf.getvalue(), RATE)


class AudioProcessor:
    """A stand-in audio family's host side: an audio becomes one token per 1,000 samples, its waveform the data."""

    image_token_id = None
    audio_token_id = AUDIO_TOKEN
    sampling_rate = RATE

    def process_audio(self, waveform: np.ndarray) -> ProcessedImage:
        assert waveform.dtype == np.float32 and waveform.ndim == 1
        return ProcessedImage([AUDIO_TOKEN] * (len(waveform) // 1000), {"input_features": waveform})

    def rope_positions(self, token_ids, items):
        return None


class ImageAndAudioProcessor(AudioProcessor):
    image_token_id = IMAGE_TOKEN

    def process(self, image) -> ProcessedImage:
        return ProcessedImage([IMAGE_TOKEN] * 2, {"pixel_values": np.asarray(image, np.float32)})


def test_a_long_audio_is_cut_at_its_quiet_points():
    """audio_clips: clips of at most ``most`` samples whose concatenation is the audio, each cut in the quietest
    window of its last second (here the pauses between tones), at the latest of equally quiet ones (silence), and
    one clip, the audio itself, when it fits."""
    from specray.multimodal import CLIP_WINDOW_SECONDS, audio_clips

    tone = _sine(440, RATE, 0.3).astype(np.float32)
    pauses = [3.5, 6.9, 10.4]  # seconds: the middle of a 0.2 s pause in the tones, each in a clip's last second
    wave = np.tile(tone, 50)  # 15 s
    for p in pauses:
        wave[int((p - 0.1) * RATE): int((p + 0.1) * RATE)] *= 1e-3
    most = 4 * RATE
    clips = audio_clips(wave, most, RATE)
    assert np.array_equal(np.concatenate(clips), wave) and all(0 < len(c) <= most for c in clips)
    cuts = np.cumsum([len(c) for c in clips])[:-1] / RATE
    assert len(clips) == 5 and np.allclose(cuts[:3], pauses, atol=0.06), cuts  # 3.5 in [3, 4], 6.9 in [6.5, 7.5], ...
    assert cuts[2] + 3 < cuts[3] <= cuts[2] + 4  # no pause in its last second: the quietest of the tones' windows
    silent = np.zeros(10 * RATE, np.float32)
    width = int(CLIP_WINDOW_SECONDS * RATE)
    assert [len(c) for c in audio_clips(silent, most, RATE)[:2]] == [most - width + width // 2 + 1] * 2
    whole = audio_clips(wave[:most], most, RATE)
    assert len(whole) == 1 and np.array_equal(whole[0], wave[:most])
    assert [len(c) for c in audio_clips(np.ones(9, np.float32), 4, RATE)] == [4, 4, 1]


def test_placeholders_pair_with_audios_in_order():
    from PIL import Image

    short, long = (_sine(300, 8000, 0.5), 8000), _sine(300, RATE, 2.0)
    ids, mm = expand_prompt([1, AUDIO_TOKEN, IMAGE_TOKEN, 2, AUDIO_TOKEN, 3], [Image.new("RGB", (2, 2))],
                            ImageAndAudioProcessor(), audios=[short, long])
    assert [(i.modality, i.offset, i.length) for i in mm.items] == [("audio", 1, 8), ("image", 9, 2),
                                                                    ("audio", 12, 32)]
    assert ids == [1] + [AUDIO_TOKEN] * 8 + [IMAGE_TOKEN] * 2 + [2] + [AUDIO_TOKEN] * 32 + [3]
    assert len(mm.items[0].data["input_features"]) == 8000  # resampled to the processor's rate
    assert mm.items[0].hash != expand_prompt([AUDIO_TOKEN], [], AudioProcessor(), audios=[(_sine(301, 8000, 0.5),
                                                                                            8000)])[1].items[0].hash
    with pytest.raises(ValueError, match="holds 1 audio placeholder token.*but 2 audio"):
        expand_prompt([AUDIO_TOKEN], [], AudioProcessor(), audios=[long, long])
    with pytest.raises(ValueError, match="takes no images \\(only audio\\)"):
        expand_prompt([IMAGE_TOKEN], [Image.new("RGB", (2, 2))], AudioProcessor())
    with pytest.raises(ValueError, match="takes no audio \\(only images\\)"):
        expand_prompt([AUDIO_TOKEN], [], type("Images", (), {"image_token_id": IMAGE_TOKEN})(), audios=[long])


def test_limits_on_audio():
    mm = MultiModalInputs(expand_prompt([AUDIO_TOKEN, AUDIO_TOKEN], [], AudioProcessor(),
                                        audios=[_sine(1, RATE), _sine(2, RATE)])[1].items)
    check_mm_counts(mm, {AUDIO: None})
    with pytest.raises(ValueError, match="holds 2 audio items; this engine takes at most 1"):
        check_mm_counts(mm, {AUDIO: 1})
    with pytest.raises(ValueError, match="this engine takes no audio"):
        check_mm_counts(mm, {AUDIO: 0})
    assert text_only({"audio": 0}) and text_only({"image": 0}) and text_only({"image": 0, "audio": 0})
    assert not text_only(None) and not text_only({}) and not text_only({"image": 0, "audio": 2})


def test_chat_audio_parts_become_the_templates_audio_parts():
    """OpenAI's input_audio (base64 data and format) becomes a data: URL, vLLM's audio_url its URL; in order."""
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "text", "text": "and"}, {"type": "audio_url", "audio_url": {"url": "https://h/a.mp3"}}]}]
    out, media = split_media(messages)
    assert media["audio"] == ["data:audio/wav;base64,UklGRg==", "https://h/a.mp3"]
    assert out[0]["content"] == [{"type": "audio"}, {"type": "text", "text": "and"}, {"type": "audio"}]
    for bad in [{"data": "UklGRg=="}, {"format": "wav"}, {"data": "x", "format": "w/av"}, "UklGRg=="]:
        with pytest.raises(ValueError, match="content\\[0\\].input_audio must hold the audio's base64 'data'"):
            split_media([{"role": "user", "content": [{"type": "input_audio", "input_audio": bad}]}])


def test_the_servers_content_parts_take_audio():
    pytest.importorskip("pydantic")  # (the server's; not in a GPU image)
    from specray.cluster import openai_protocol as proto

    message = proto.ChatMessage(role="user", content=[
        {"type": "text", "text": "hi"}, {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "mp3"}},
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,UklGRg=="}}])
    out, media = split_media([message.as_template_dict()])
    assert media["audio"] == ["data:audio/mp3;base64,UklGRg==", "data:audio/wav;base64,UklGRg=="]
    with pytest.raises(ValueError, match="holds the field 'input_audio' alone"):
        proto.ChatMessage(role="user", content=[{"type": "input_audio", "input_audio": {"data": "x", "format": "wav"},
                                                 "text": "x"}])
    with pytest.raises(ValueError, match="type 'audio' is not supported"):
        proto.ChatMessage(role="user", content=[{"type": "audio", "audio": "x"}])


def test_an_audio_form_holds_one_non_empty_file():
    """A transcription form's 'file' field sent empty is a 400 saying so (it said the field was missing), and two
    'file' fields are a 400 (the last was transcribed, the first dropped unsaid)."""
    pytest.importorskip("pydantic")  # (the server's; not in a GPU image)
    from specray.cluster import openai_protocol as proto

    form = "multipart/form-data; boundary=specray-form"
    wav = _wav([_sine(300, RATE, 0.1)], RATE)
    assert proto.parse_audio_form(_form({"model": "m"}, wav), form, "transcribe")[1] == wav
    two = _form({}, wav)[: -len("--specray-form--\r\n")] + _form({}, wav)
    for body, says in ((_form({"model": "m"}, None), "has no 'file' field"),
                       (_form({}, b""), r"'file' field is empty \(0 bytes\)"), (two, "more than one 'file' field")):
        with pytest.raises(proto.OpenAIError, match=says) as err:
            proto.parse_audio_form(body, form, "transcribe")
        assert (err.value.status, err.value.param) == (400, "file")


# -- through the engine and the server, with a stand-in audio family on the tiny Llama ---------------------------------

CHAT_AUDIO = 3  # "<audio>": the tiny tokenizer's fourth special token
AUDIO_TEMPLATE = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
                  "{% if p.type == 'audio' %}<audio>{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
                  "{% endfor %}")


class StandInAudio(AudioProcessor):
    """One token per 1,000 samples (16 a second), each taking a random projection of its samples."""

    audio_token_id = CHAT_AUDIO

    @classmethod
    def from_pretrained(cls, folder, config):
        return cls()

    def process_audio(self, waveform: np.ndarray) -> ProcessedImage:
        n = len(waveform) // 1000
        return ProcessedImage([CHAT_AUDIO] * n, {"frames": waveform[: n * 1000].reshape(n, 1000)})


class StandInAudioEncoder(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        g = torch.Generator().manual_seed(99)
        self.proj = torch.nn.Parameter(torch.randn(1000, config.hidden_size, generator=g, device="cpu").to(
            torch.get_default_device()) / 4)  # (a host seed, on the device the loader builds on)

    def load_weights(self, weights) -> None:
        for _ in weights:  # its weights are its own
            pass

    def encode(self, data):
        return data["frames"] @ self.proj


@pytest.fixture
def audio_family(tmp_path, monkeypatch):
    import specray.engine.builder as builder
    import specray.models.loader as loader
    from tests.conftest import build_tiny_model

    def classes(config):
        return StandInAudioEncoder, StandInAudio

    monkeypatch.setattr(loader, "multimodal_classes", classes)
    monkeypatch.setattr(builder, "multimodal_classes", classes)
    return build_tiny_model(tmp_path / "tiny", "llama", extra_special_tokens=("<audio>",))


def _reference(folder, ids: list[int], items, max_tokens: int) -> list[int]:
    """transformers' greedy tokens from the prompt's embeddings with each audio's rows in place."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    encoder = StandInAudioEncoder(AutoConfig.from_pretrained(folder))
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor([ids]))
        for item in items:
            embeds[0, item.offset:item.end] = encoder.encode({"frames": torch.from_numpy(item.data["frames"])})
        out = model.generate(inputs_embeds=embeds, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    return out[0].tolist()


def test_audio_through_the_engine_equals_transformers(audio_family):
    """Two audios (a pair at 8 kHz resampled, a WAV file) in one prompt beside a text prompt: greedy with n-gram
    drafts and prefill chunks of 5 tokens (each audio split over chunks) equals transformers' from the prompt's
    embeddings with the audio rows in place; the audio matters; limit_mm_per_prompt caps audio."""
    llm = LLM(model=str(audio_family), max_model_len=128, max_num_batched_tokens=5,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    tok = llm.get_tokenizer()
    prompt = tok.encode("The quick") + [CHAT_AUDIO] + tok.encode(" brown fox") + [CHAT_AUDIO]
    audios = [(_sine(300, 8000, 0.5), 8000), _wav([_sine(200, RATE, 0.75)], RATE)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"audio": audios}},
                         {"prompt_token_ids": tok.encode("The quick brown fox")}], params, use_tqdm=False)
    ids, mm = expand_prompt(prompt, [], StandInAudio(), audios=audios)
    assert outs[0].prompt_token_ids == ids and [i.length for i in mm.items] == [8, 12]
    want = _reference(audio_family, ids, mm.items, 12)
    assert list(outs[0].outputs[0].token_ids) == want
    assert want != _reference(audio_family, ids, [], 12) and llm.spec_stats.draft_tokens > 0
    with pytest.raises(ValueError, match="cannot cut a prompt with images, videos or audio"):  # (said "images")
        llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"audio": audios}},
                     SamplingParams(max_tokens=2, truncate_prompt_tokens=4), use_tqdm=False)
    capped = LLM(model=str(audio_family), max_model_len=128, limit_mm_per_prompt={"audio": 1})
    with pytest.raises(ValueError, match="holds 2 audio items; this engine takes at most 1"):
        capped.generate({"prompt_token_ids": prompt, "multi_modal_data": {"audio": audios}}, params)
    text_only_llm = LLM(model=str(audio_family), max_model_len=128, limit_mm_per_prompt={"audio": 0})
    with pytest.raises(ValueError, match="reads text only"):
        text_only_llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"audio": audios}}, params)


def test_server_chat_with_input_audio_equals_llm_chat(audio_family):
    """An OpenAI chat request with an input_audio part (base64 WAV) and one with an audio_url part answer what
    LLM.chat answers for the same messages; an undecodable audio is a 400 naming messages."""
    pytest.importorskip("uvicorn")  # (the server's; not in a GPU image)
    from specray_test_openai_helpers import chat_equals, http_json, serving  # tests/openai_helpers.py

    from specray.cluster.openai_app import AsyncEngineClient, ServerConfig, build_openai_app
    from specray.engine.async_engine import AsyncLLMEngine

    data = base64.b64encode(_wav([_sine(300, 22050, 0.6), _sine(150, 22050, 0.6)], 22050)).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "The quick"},
                                             {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
                                             {"type": "text", "text": " brown fox"}]}]
    llm = LLM(model=str(audio_family), max_model_len=64)
    assert llm.get_tokenizer().convert_tokens_to_ids("<audio>") == CHAT_AUDIO
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = llm.chat(messages, params, use_tqdm=False, chat_template=AUDIO_TEMPLATE)[0]
    assert want.prompt_token_ids.count(CHAT_AUDIO) == 9  # 0.6 s at 16 kHz: 9 tokens of 1,000 samples
    aengine = AsyncLLMEngine(llm.engine)
    app = build_openai_app(AsyncEngineClient(aengine, image_processor=StandInAudio()),
                           ServerConfig("tiny", chat_template=AUDIO_TEMPLATE))
    try:
        with serving(app) as base:
            chat, body = chat_equals(base, messages, want)
            url = {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{data}"}}
            as_url = [{**messages[0], "content": [messages[0]["content"][0], url, messages[0]["content"][2]]}]
            status, got = http_json(chat, {**body, "messages": as_url})
            assert status == 200 and got["choices"][0]["token_ids"] == want.outputs[0].token_ids, got
            bad = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
            status, err = http_json(chat, {**body, "messages": [{"role": "user", "content": [bad]}]})
            assert status == 400 and err["error"]["param"] == "messages", err
            assert "audio could not be decoded" in err["error"]["message"]
    finally:
        aengine.shutdown()


def _form(fields: dict[str, str], audio: bytes | None, boundary: str = "specray-form") -> bytes:
    """A multipart/form-data body of text ``fields`` and the audio as its ``file`` field."""
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    if audio is not None:
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
                     "Content-Type: audio/wav\r\n\r\n".encode() + audio + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode()


def test_server_transcribes_audio_files(audio_family):
    """OpenAI's /v1/audio/transcriptions and /v1/audio/translations, through the openai client (a multipart form):
    the text LLM.chat gives for the chat template's user turn of the audio and the task's instruction (the
    language's code and the request's prompt after it), with its usage in tokens; ``response_format="text"`` the
    text alone; what is not served a 400 naming its field."""
    pytest.importorskip("openai")  # (the test's client and the server; not in a GPU image)
    pytest.importorskip("uvicorn")
    import urllib.error
    import urllib.request

    import openai
    from specray_test_openai_helpers import serving  # tests/openai_helpers.py

    from specray.cluster.openai_app import AsyncEngineClient, ServerConfig, audio_instruction, build_openai_app
    from specray.engine.async_engine import AsyncLLMEngine

    data = _wav([_sine(300, 22050, 0.6)], 22050)
    url = f"data:audio/wav;base64,{base64.b64encode(data).decode()}"
    llm = LLM(model=str(audio_family), max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=64 - 20)

    def chat(instruction: str):
        return llm.chat([{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": url}},
                                                      {"type": "text", "text": instruction}]}],
                        params, use_tqdm=False, chat_template=AUDIO_TEMPLATE)[0]

    assert audio_instruction(StandInAudio(), "transcribe", "fr", "Bonjour.") == (
        "Transcribe the audio. Its language: fr.\nBonjour.")
    assert audio_instruction(type("Own", (), {"transcription_instruction": "Write it down."})(), "transcribe", None,
                             None) == "Write it down."
    assert audio_instruction(StandInAudio(), "translate", None, None) == "Translate the audio into English."
    want = chat("Transcribe the audio. Its language: en.")
    translated = chat("Translate the audio into English.")
    aengine = AsyncLLMEngine(llm.engine)
    app = build_openai_app(AsyncEngineClient(aengine, image_processor=StandInAudio()),
                           ServerConfig("tiny", chat_template=AUDIO_TEMPLATE))
    try:
        with serving(app) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
            got = client.audio.transcriptions.create(model="tiny", file=("a.wav", data), language="en")
            assert got.text == want.outputs[0].text and got.text
            usage = got.usage.model_dump()
            assert (usage["type"], usage["input_tokens"], usage["output_tokens"]) == (
                "tokens", len(want.prompt_token_ids), len(want.outputs[0].token_ids))
            assert usage["speculative"]["drafts"] >= 0
            text = client.audio.transcriptions.create(model="tiny", file=("a.wav", data), language="en",
                                                      response_format="text")
            assert text == want.outputs[0].text
            got = client.audio.translations.create(model="tiny", file=("a.wav", data))
            assert got.text == translated.outputs[0].text

            def post(path: str, body: bytes, content_type: str = "multipart/form-data; boundary=specray-form"):
                req = urllib.request.Request(f"{base}/v1/audio/{path}", data=body,
                                             headers={"Content-Type": content_type})
                try:
                    with urllib.request.urlopen(req, timeout=60) as resp:
                        return resp.status, resp.read()
                except urllib.error.HTTPError as err:
                    return err.code, json.loads(err.read())["error"]

            for path, body, param, says in [
                ("transcriptions", _form({"model": "tiny"}, None), "file", "no 'file' field"),
                ("transcriptions", _form({"response_format": "diarized_json"}, data), "response_format",
                 "'diarized_json' is not served"),
                ("transcriptions", _form({"timestamp_granularities[]": "word", "response_format": "verbose_json"},
                                         data), "timestamp_granularities", "'word' is not served"),
                ("transcriptions", _form({"timestamp_granularities[]": "segment"}, data), "timestamp_granularities",
                 "needs response_format 'verbose_json'"),
                ("transcriptions", _form({"response_format": "srt", "stream": "true"}, data), "stream", "'srt'"),
                ("transcriptions", _form({"include[]": "logprobs"}, data), "include", "not served"),
                ("transcriptions", _form({"language": "English"}, data), "language", "ISO-639-1"),
                ("transcriptions", _form({"temperature": "3"}, data), "temperature", "2"),
                ("transcriptions", _form({"max_tokens": "3"}, data), "max_tokens", "max_tokens"),
                ("translations", _form({"language": "de"}, data), "language", "always into English"),
                ("transcriptions", _form({}, b"not audio"), "file", "could not be decoded"),
            ]:
                status, err = post(path, body)
                assert status == 400 and err["param"] == param and says in err["message"], (path, err)
            status, err = post("transcriptions", b'{"file": "x"}', "application/json")
            assert status == 400 and "multipart/form-data" in err["message"], err
            status, _ = post("transcriptions", _form({"model": "tiny"}, data))
            assert status == 200
    finally:
        aengine.shutdown()


class ClippedAudio(StandInAudio):
    """The stand-in that takes at most a second of audio in one placeholder (as Qwen2-Audio takes 30 s)."""

    max_audio_samples = RATE


def test_server_transcribes_a_long_audio_in_clips(audio_family):
    """An audio longer than the model takes is transcribed clip by clip (audio_clips: cut at its pauses), each
    clip's text what LLM.generate gives for the transcription prompt of that clip, joined in order, the usage their
    sum; streamed (OpenAI's transcript.text.delta events, then transcript.text.done), the same text; as
    verbose_json, one segment per clip timed by where the clip lies in the audio, with its text, tokens, their mean
    log-probability and the text's compression ratio, and as SubRip and WebVTT cues of those segments; the output
    bound per request shared by the clips, and an audio of more clips than it allows tokens a 400 naming file. A
    model with no bound of its own cuts an audio whose prompt would take over half the context into halves, down to
    clips of a second, each prompt within half the context."""
    pytest.importorskip("openai")  # (the test's client and the server; not in a GPU image)
    pytest.importorskip("uvicorn")
    import openai
    from specray_test_openai_helpers import http_json, serving  # tests/openai_helpers.py

    from specray.chat import render_chat
    from specray.cluster.openai_app import AsyncEngineClient, ServerConfig, build_openai_app
    from specray.engine.async_engine import AsyncLLMEngine
    from specray.multimodal import audio_clips

    tone = _sine(300, RATE, 0.1)
    wave = np.tile(tone, 25)  # 2.5 s, quiet from 0.75 to 0.85 s and 1.6 to 1.7 s: three clips of at most 1 s
    wave[int(0.75 * RATE): int(0.85 * RATE)] = 0.0
    wave[int(1.6 * RATE): int(1.7 * RATE)] = 0.0
    data = _wav([wave], RATE)
    clips = audio_clips(load_audio(data, RATE), RATE, RATE)
    assert len(clips) == 3 and np.allclose(np.cumsum([len(c) for c in clips[:2]]) / RATE, [0.8, 1.65], atol=0.01)
    llm = LLM(model=str(audio_family), max_model_len=64)
    tok = llm.get_tokenizer()
    text = render_chat(tok, [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": (
        "Transcribe the audio. Its language: en.")}]}], True, False, chat_template=AUDIO_TEMPLATE)
    ids = tok.encode(text, add_special_tokens=False)
    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"audio": clip}} for clip in clips]
    cap = 15  # max_tokens_per_request: 5 a clip, within what the longest clip's prompt leaves of 64
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=cap // 3, logprobs=0), use_tqdm=False)
    want = outs[0].outputs[0].text
    for out in outs[1:]:  # the server's join: a space where neither side has one
        more = out.outputs[0].text
        want += " " + more if want and more and not want[-1].isspace() and not more[0].isspace() else more
    assert want and all(o.outputs[0].text for o in outs)
    aengine = AsyncLLMEngine(llm.engine)
    app = build_openai_app(AsyncEngineClient(aengine, image_processor=ClippedAudio()),
                           ServerConfig("tiny", chat_template=AUDIO_TEMPLATE, max_tokens_per_request=cap))
    try:
        with serving(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            got = client.audio.transcriptions.create(model="tiny", file=("a.wav", data), language="en")
            assert got.text == want
            usage = got.usage.model_dump()
            assert (usage["input_tokens"], usage["output_tokens"]) == (
                sum(len(o.prompt_token_ids) for o in outs), sum(len(o.outputs[0].token_ids) for o in outs))
            events = list(client.audio.transcriptions.create(model="tiny", file=("a.wav", data), language="en",
                                                             stream=True))
            assert [e.type for e in events[-1:]] == ["transcript.text.done"] and len(events) > 3
            assert "".join(e.delta for e in events[:-1]) == events[-1].text == want
            verbose = client.audio.transcriptions.create(model="tiny", file=("a.wav", data), language="en",
                                                         response_format="verbose_json",
                                                         timestamp_granularities=["segment"])
            ends = np.cumsum([len(c) for c in clips]) / RATE
            assert (verbose.text, verbose.language, verbose.duration) == (want, "en", pytest.approx(2.5, abs=1e-3))
            assert len(verbose.segments) == 3
            for i, (seg, out, start, end) in enumerate(zip(verbose.segments, outs, [0.0, *ends[:-1]], ends)):
                text, tokens = out.outputs[0].text, out.outputs[0].token_ids
                assert (seg.id, seg.text, seg.tokens, seg.temperature) == (i, text, tokens, 0.0)
                assert (seg.start, seg.end, seg.seek) == (pytest.approx(start), pytest.approx(end), round(start * 100))
                assert seg.avg_logprob == pytest.approx(out.outputs[0].cumulative_logprob / len(tokens), abs=1e-4)
                assert seg.compression_ratio == pytest.approx(len(text.encode()) / len(zlib.compress(text.encode())))
            srt = client.audio.transcriptions.create(model="tiny", file=("a.wav", data), language="en",
                                                     response_format="srt")
            vtt = client.audio.transcriptions.create(model="tiny", file=("a.wav", data), language="en",
                                                     response_format="vtt")
            def stamp(seconds: float, sep: str) -> str:  # (under a minute here)
                return f"00:00:{round(seconds * 1000) // 1000:02d}{sep}{round(seconds * 1000) % 1000:03d}"

            cues = srt.strip().split("\n\n")
            assert len(cues) == 3
            assert cues[1].split("\n")[:2] == ["2", f"{stamp(ends[0], ',')} --> {stamp(ends[1], ',')}"]
            assert [c.split("\n", 2)[2] for c in cues] == [o.outputs[0].text.strip() for o in outs]
            assert vtt.startswith(f"WEBVTT\n\n00:00:00.000 --> {stamp(ends[0], '.')}\n")
            assert f"{stamp(ends[1], '.')} --> {stamp(ends[2], '.')}\n{outs[2].outputs[0].text.strip()}" in vtt
            assert events[-1].usage.output_tokens == usage["output_tokens"]
            status, err = http_json(f"{url}/v1/audio/transcriptions", _form({}, _wav([np.tile(tone, 200)], RATE)),
                                    headers={"Content-Type": "multipart/form-data; boundary=specray-form"})
            assert status == 400 and err["error"]["param"] == "file", err
            assert "clips" in err["error"]["message"] and "max_tokens_per_request" in err["error"]["message"]
        from specray.cluster import openai_protocol as proto

        unbounded = build_openai_app(AsyncEngineClient(aengine, image_processor=StandInAudio()),
                                     ServerConfig("tiny", chat_template=AUDIO_TEMPLATE)).state.serving
        form, audio = proto.parse_audio_form(_form({}, _wav([np.tile(tone, 30)], RATE)),
                                             "multipart/form-data; boundary=specray-form", "transcribe")
        halved, spans = unbounded._encode_audio_prompts(form, audio, "transcribe")  # 3 s: 48 audio tokens, 1.5 s: 24
        assert len(halved) > 2 and all(2 * len(p.token_ids) <= 64 for p in halved)
        assert len(spans) == len(halved) and spans[0][0] == 0.0 and spans[-1][1] == pytest.approx(3.0, abs=1e-3)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # consecutive clips
        assert sum(p.multimodal.items[0].data["frames"].size for p in halved) >= 3 * RATE - 1000 * len(halved)
    finally:
        aengine.shutdown()
