"""Voxtral's audio (``VoxtralForConditionalGeneration``, transformers' ``models/voxtral``: Voxtral-Mini-3B-2507 and
Voxtral-Small-24B-2507): Whisper's encoder without a pool and without a key mask (:class:`specray.models.whisper_audio.
WhisperAudioTower` run over whole 30 s windows, every padded frame attended, as transformers' ``VoxtralEncoder``
runs), then the projector ``multi_modal_projector``: the tower's rows taken ``intermediate_size / hidden_size`` (4) at
a time into one row of ``intermediate_size``, ``linear_2(act(linear_1(x)))`` (no biases) into the Llama / Mistral
text model's embeddings, one row per ``[AUDIO]`` token.

The text model (a Llama, its ``text_config``) is served by its own class through ``registry._TEXT_PARTS``
(``language_model.model.*`` / ``language_model.lm_head.*`` as released, ``model.language_model.*`` / ``lm_head.*``
as transformers 5 saves it).

The host side (:class:`VoxtralProcessor`) does what ``mistral_common``'s audio encoder does for transformers'
``VoxtralProcessor`` (``apply_chat_template`` with audio parts, ``apply_transcription_request``), without that
package: the audio is padded with zeros to a whole number of ``chunk_length_s`` (30 s) chunks; transformers'
``WhisperFeatureExtractor`` of the folder makes the log-mel features of the whole padded audio at once (frames near a
chunk's border see the next chunk's samples, and the log-mel floor is the whole audio's), cut into one window of
``2 x max_source_positions`` (3000) frames per chunk; the prompt's ``[AUDIO]`` placeholder (what mistral_common's
chat template writes for an ``input_audio`` / ``audio_url`` part, once per audio) becomes ``[BEGIN_AUDIO]`` and one
``[AUDIO]`` per embedding: ``ceil(frames / (sampling_rate / frame_rate / hop_length))`` of them, 375 per chunk.
The settings come from the ``audio`` section of the folder's ``tekken.json`` (sampling_rate, frame_rate,
chunk_length_s, its spectrogram's mel bins, hop and window) checked against the feature extractor and the encoder;
``[BEGIN_AUDIO]``'s id from its special tokens (or from the folder's tokenizer where there is no tekken.json).
transformers reads a ``tekken.json`` without mistral_common (its ``MistralConverter`` makes a tokenizers BPE of it:
the same ids as mistral_common's Tekkenizer for text and special tokens); the instruct format around the audio
(``<s>[INST]...[/INST]``, a transcription request's ``lang:xx[TRANSCRIBE]`` after it) is the prompt's text.

Refused by name: a streaming (Voxtral Realtime) audio section, audio settings of tekken.json that do not fit the
feature extractor or the encoder, an ``intermediate_size`` that is not a whole number of the encoder's rows, a
config without ``audio_token_id``, an audio longer than the text model's context could hold, images."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specray.models.vision_towers import Linear, vision_activation
from specray.models.whisper_audio import AudioTowerEncoder, _field, check_waveform, load_feature_extractor
from specray.multimodal import MultiModalItem, ProcessedImage

ARCH = "VoxtralForConditionalGeneration"
BEGIN_AUDIO = "[BEGIN_AUDIO]"


def rows_per_embedding(audio_config: Any) -> int:
    """How many of the tower's rows make one projector input (``intermediate_size / hidden_size``: 4 in the
    releases); a ValueError where that is not a whole number dividing a window's rows."""
    hidden = int(_field(audio_config, "d_model", "hidden_size"))
    inner = int(_field(audio_config, "intermediate_size", "encoder_ffn_dim"))
    positions = int(_field(audio_config, "max_source_positions"))
    if inner % hidden or positions % (inner // hidden):
        raise ValueError(f"audio_config.intermediate_size={inner} is not a whole number k of audio_config.hidden_size="
                         f"{hidden} rows with k dividing max_source_positions={positions}: Voxtral's projector takes "
                         "the encoder's rows k at a time; the checkpoint's config.json is not a Voxtral release's")
    return inner // hidden


class VoxtralEncoder(AudioTowerEncoder):
    """Voxtral's encoder and projector (``linear_2(act(linear_1(rows k at a time)))``), from the whole config."""

    arch = ARCH

    def __init__(self, config: Any):
        super().__init__(config, pool=False)
        self.group = rows_per_embedding(config.audio_config)
        text_hidden = int(config.text_config.hidden_size)
        self.act = vision_activation(getattr(config, "projector_hidden_act", "gelu"), "projector_hidden_act")
        self.projector = nn.Module()
        self.projector.linear_1 = Linear(self.group * self.tower.hidden, text_hidden, bias=False)
        self.projector.linear_2 = Linear(text_hidden, text_hidden, bias=False)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, self.group * hidden.shape[-1])  # (k consecutive rows of a window: one input)
        return self.projector.linear_2(self.act(self.projector.linear_1(rows)))

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One audio's windows (``input_features`` [W, mel, frames]) -> its embeddings [W x rows / k, text hidden]:
        every row of every window (no mask: the padding is attended, as transformers' VoxtralEncoder attends it)."""
        features = data["input_features"]
        if features.dim() == 2:
            features = features[None]
        return self.project(self.tower(features))


def _tekken_audio(folder: Path) -> tuple[dict | None, dict[str, int]]:
    """The ``audio`` section of the folder's tekken.json (None where it has none, or no tekken.json) and its special
    tokens' ids by name."""
    path = folder / "tekken.json"
    if not path.is_file():
        return None, {}
    raw = json.loads(path.read_text(encoding="utf-8"))
    specials = {str(t["token_str"]): int(t["rank"]) for t in raw.get("special_tokens") or ()}
    return raw.get("audio"), specials


class VoxtralProcessor:
    """Voxtral's host side (:class:`specray.multimodal.ImageProcessor` for audio): the audio padded to whole chunks,
    their log-mel windows, the ``[AUDIO]`` placeholder expanded to ``[BEGIN_AUDIO]`` and one ``[AUDIO]`` per
    embedding (as mistral_common's audio encoder expands it for transformers' VoxtralProcessor)."""

    image_token_id = None  # (an audio-only release: the seam refuses images by name)

    def __init__(self, extractor: Any, config: Any, begin_audio_id: int, tokens_per_chunk: int, most_chunks: int):
        token = getattr(config, "audio_token_id", None)
        if token is None:
            raise ValueError(f"{ARCH}'s config.json sets no audio_token_id: the id of its [AUDIO] placeholder is "
                             "needed")
        self.extractor = extractor
        self.audio_token_id, self.begin_audio_id = int(token), int(begin_audio_id)
        self.sampling_rate = int(extractor.sampling_rate)
        self.chunk = int(extractor.n_samples)
        self.frames = int(extractor.nb_max_frames)
        self.tokens_per_chunk, self.most_chunks = tokens_per_chunk, most_chunks
        self.max_audio_samples = most_chunks * self.chunk  # what the text model's context holds

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> VoxtralProcessor:
        folder = Path(folder)
        extractor = load_feature_extractor(folder, config.audio_config, ARCH)
        per_chunk = int(_field(config.audio_config, "max_source_positions")) // rows_per_embedding(config.audio_config)
        audio, specials = _tekken_audio(folder)
        if audio is not None:
            cls._check_tekken(audio, extractor, per_chunk)
        if BEGIN_AUDIO in specials:
            begin = specials[BEGIN_AUDIO]
        else:
            from specray.models.loader import load_tokenizer

            tokenizer = load_tokenizer(folder)
            begin = tokenizer.convert_tokens_to_ids(BEGIN_AUDIO)
            if not isinstance(begin, int) or tokenizer.convert_ids_to_tokens(begin) != BEGIN_AUDIO:
                raise ValueError(f"the tokenizer of {folder} has no {BEGIN_AUDIO} token (and the folder no tekken.json "
                                 f"naming it): {ARCH}'s audio needs it")
        context = int(getattr(config.text_config, "max_position_embeddings", 0) or 0)
        most = max(1, (context - 1) // per_chunk) if context else 1 << 20
        return cls(extractor, config, begin, per_chunk, most)

    @staticmethod
    def _check_tekken(audio: dict, extractor: Any, per_chunk: int) -> None:
        """tekken.json's audio settings (what mistral_common pads and counts with) against the feature extractor and
        the encoder; a ValueError naming the first that differs."""
        if str(audio.get("transcription_format", "instruct")).lower() != "instruct":
            raise ValueError(f"tekken.json's audio.transcription_format={audio['transcription_format']!r}: a "
                             f"streaming (Voxtral Realtime) release is not {ARCH}; only 'instruct' is served")
        spectrogram = audio.get("audio_encoding_config") or {}
        pairs = (("sampling_rate", audio.get("sampling_rate"), extractor.sampling_rate, "sampling_rate"),
                 ("chunk_length_s", audio.get("chunk_length_s"), extractor.chunk_length, "chunk_length"),
                 ("audio_encoding_config.num_mel_bins", spectrogram.get("num_mel_bins"), extractor.feature_size,
                  "feature_size"),
                 ("audio_encoding_config.hop_length", spectrogram.get("hop_length"), extractor.hop_length,
                  "hop_length"),
                 ("audio_encoding_config.window_size", spectrogram.get("window_size"), extractor.n_fft, "n_fft"))
        for name, theirs, ours, field in pairs:
            if theirs is None or float(theirs) != float(ours):
                raise ValueError(f"tekken.json's audio.{name}={theirs!r} differs from preprocessor_config.json's "
                                 f"{field}={ours!r}; the folder's audio settings disagree: fix one of them")
        frame_rate = float(audio.get("frame_rate") or 0)
        # (mistral_common: one token per int(sampling_rate // frame_rate / hop_length) mel frames, rounded up)
        per_token = int(int(audio["sampling_rate"] // frame_rate) / int(spectrogram["hop_length"])) if frame_rate else 0
        counted = math.ceil(extractor.nb_max_frames / per_token) if per_token > 0 else None
        if counted != per_chunk:
            raise ValueError(f"tekken.json's audio.frame_rate={audio.get('frame_rate')!r} gives {counted} [AUDIO] "
                             f"tokens a {extractor.chunk_length} s chunk, but the encoder gives {per_chunk} embeddings "
                             "(audio_config.max_source_positions / (intermediate_size / hidden_size)); the folder's "
                             "tekken.json does not fit its config.json")

    def features(self, wave: np.ndarray) -> np.ndarray:
        """The log-mel windows [chunks, mel, frames] of ``wave`` padded to whole chunks (features of the whole padded
        audio at once, then cut per chunk, as transformers' VoxtralProcessor asks its feature extractor)."""
        chunks = -(-wave.shape[0] // self.chunk)
        padded = np.pad(wave, (0, chunks * self.chunk - wave.shape[0]))
        out = self.extractor(padded, sampling_rate=self.sampling_rate, padding=True, truncation=False,
                             pad_to_multiple_of=self.chunk, return_tensors="np")["input_features"][0]
        mel = out.shape[0]
        windows = out.reshape(mel, chunks, self.frames).transpose(1, 0, 2)
        return np.ascontiguousarray(windows, dtype=np.float32)

    def process_audio(self, waveform: np.ndarray) -> ProcessedImage:
        """One audio (1-D float32 at ``sampling_rate``) -> ``[BEGIN_AUDIO]`` and its ``[AUDIO]`` tokens (those take
        the embeddings), and its windows' features."""
        wave = check_waveform(waveform, self.max_audio_samples, self.sampling_rate,
                              "split it into parts, each its own audio, or send it to a model of a longer context")
        features = self.features(wave)
        count = features.shape[0] * self.tokens_per_chunk
        tokens = [self.begin_audio_id] + [self.audio_token_id] * count
        return ProcessedImage(tokens, {"input_features": features}, list(range(1, count + 1)))

    def transcription_prompt(self, task: str, language: str | None, prompt: str | None) -> str:
        """The text of a transcription request as mistral_common writes it (``apply_transcription_request``): the
        audio's placeholder in an instruction turn, then ``lang:xx`` where the language is given and
        ``[TRANSCRIBE]`` (the OpenAI server's ``/v1/audio/transcriptions``)."""
        if task != "transcribe":
            raise ValueError(f"{ARCH} transcribes only (mistral_common's transcription request has no translation): "
                             "use /v1/audio/transcriptions, or the chat endpoint with an instruction")
        if prompt:
            raise ValueError(f"{ARCH}'s transcription request takes no prompt: leave it out")
        return f"<s>[INST][AUDIO][/INST]{'lang:' + language if language else ''}[TRANSCRIBE]"

    def process(self, image: Any) -> ProcessedImage:
        raise ValueError(f"{ARCH} takes audio, not images: send the prompt without images")

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE
