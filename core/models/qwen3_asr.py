"""Qwen3-ASR (``Qwen3ASRForConditionalGeneration``, transformers' ``models/qwen3_asr``: Qwen/Qwen3-ASR-0.6B-hf and
-1.7B-hf): speech recognition as a Qwen3 text model reading an audio.

Its audio encoder is Qwen3-Omni's (:class:`specray.models.qwen3_omni_moe.AudioTower`: windows of ``2 * n_window``
mel frames through three strided 3 x 3 convolutions, sinusoidal positions per window, Whisper layers attending within
spans of ``n_window_infer`` frames, ``ln_post``), its two-layer projector (``multi_modal_projector.linear_1``, the
activation, ``linear_2``: Qwen3-Omni's ``proj1`` / ``proj2`` moved out of the tower) into the text width. One
difference: ``Qwen3ASRFeatureExtractor`` pads the mel frames with zeros to whole windows, so an audio shorter than a
window is padded to a whole one (Qwen3-Omni pads a batch's windows only to its longest).

Host side (:class:`Qwen3ASRProcessor`): the folder's ``Qwen3ASRFeatureExtractor`` over each audio alone, as
``Qwen3ASRProcessor`` calls it (``padding=True``: no padding of one audio's samples but its own ``min_length``,
counted as audio as the release's library counts it); the valid frames' features kept; ``<|audio_pad|>``
(``audio_token_id``) repeated once per embedding (``13`` per whole window, then the last window's). Positions are
plain RoPE. The OpenAI server's transcriptions write the release's own request (``transcription_messages``: the
request's prompt as the system turn, the audio as the user's, the assistant's turn begun with ``language
<Name><asr_text>`` where the language is given, as ``apply_transcription_request``) and keep the text after the
model's own ``language <Name><asr_text>`` where it detects the language itself (``transcription_text``).

The text model is Qwen3 (:mod:`specray.models.llama`) under ``model.language_model.`` and ``lm_head.`` (tied as the
whole config says), served through ``registry._TEXT_PARTS``; the encoder reads ``model.audio_tower.*`` and
``model.multi_modal_projector.*`` and is replicated on every tensor-parallel rank. Forced alignment
(``Qwen3ASRForTokenClassification``) is not served.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specray.models.qwen2_vl_vision import _field
from specray.models.qwen3_omni_moe import FEATURES, AudioTower, _window, audio_embeddings
from specray.models.vision_towers import copy_weights
from specray.multimodal import MultiModalItem, ProcessedImage

ARCH = "Qwen3ASRForConditionalGeneration"
MARKER = "<asr_text>"  # the text before it is the model's "language <Name>"; the transcript follows it
# Qwen3ASRProcessor's names of the languages it forces (the release was trained with them after "language ")
LANGUAGES = {"ar": "Arabic", "yue": "Cantonese", "zh": "Chinese", "cs": "Czech", "da": "Danish", "nl": "Dutch",
             "en": "English", "fil": "Filipino", "fi": "Finnish", "fr": "French", "de": "German", "el": "Greek",
             "hi": "Hindi", "hu": "Hungarian", "id": "Indonesian", "it": "Italian", "ja": "Japanese", "ko": "Korean",
             "mk": "Macedonian", "ms": "Malay", "fa": "Persian", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian",
             "ru": "Russian", "es": "Spanish", "sv": "Swedish", "th": "Thai", "tr": "Turkish", "vi": "Vietnamese"}
_RENAMES = (("multi_modal_projector.linear_1.", "audio_tower.proj1."),
            ("multi_modal_projector.linear_2.", "audio_tower.proj2."))


class Qwen3ASRAudioTower(AudioTower):
    """Qwen3-Omni's audio tower over windows always padded whole (Qwen3-ASR's feature extractor pads so)."""

    whole_windows = True


class Qwen3ASREncoder(nn.Module):
    """Qwen3-ASR's audio tower and projector (:class:`specray.multimodal.ImageEncoder` for audio), built from the
    whole checkpoint's config."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        self.audio_tower = Qwen3ASRAudioTower(config.audio_config, _field(config.text_config, "hidden_size"))

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The tower's and projector's tensors under ``model.`` (transformers' layout) or at the top; a ValueError
        names any missing."""
        def renamed():
            for name, tensor in weights:
                name = name.removeprefix("model.")
                for theirs, ours in _RENAMES:
                    if name.startswith(theirs):
                        name = ours + name[len(theirs):]
                if name.startswith("audio_tower."):
                    yield name, tensor

        missing = copy_weights(dict(self.named_parameters()), renamed())
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of {ARCH}'s audio tower or projector: "
                             f"{missing[:6]} (ours; model.audio_tower.* / model.multi_modal_projector.* in "
                             "transformers' layout); it does not match its config.json's audio_config")

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One audio's valid ``input_features`` [mel, frames] -> its embeddings [audio_embeddings(frames), text
        hidden]."""
        return self.audio_tower(data[FEATURES])


class Qwen3ASRProcessor:
    """Qwen3-ASR's host side (:class:`specray.multimodal.ImageProcessor` for audio): see the module docstring."""

    image_token_id = None  # audio only

    def __init__(self, extractor: Any, config: Any):
        window = _window(config.audio_config)
        if getattr(extractor, "n_window", None) != window // 2:
            raise ValueError(f"the feature extractor ({type(extractor).__name__}, n_window="
                             f"{getattr(extractor, 'n_window', None)}) does not pad the mel frames to audio_config's "
                             f"windows of {window}; use the release's preprocessor_config.json "
                             "(Qwen3ASRFeatureExtractor)")
        mel = _field(config.audio_config, "num_mel_bins", 128)
        if extractor.feature_size != mel:
            raise ValueError(f"the feature extractor's feature_size={extractor.feature_size} differs from "
                             f"audio_config.num_mel_bins={mel}; use the release's preprocessor_config.json")
        self.extractor = extractor
        self.audio_token_id = int(config.audio_token_id)
        self.sampling_rate = int(extractor.sampling_rate)

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> Qwen3ASRProcessor:
        from transformers import AutoFeatureExtractor

        return cls(AutoFeatureExtractor.from_pretrained(str(folder)), config)

    def process(self, image: Any) -> ProcessedImage:
        raise ValueError(f"{ARCH} takes audio only: send the prompt without images")

    def process_audio(self, waveform: np.ndarray) -> ProcessedImage:
        """One mono waveform at :attr:`sampling_rate` -> its ``<|audio_pad|>`` tokens and its valid log-mel
        frames [mel, frames] (the feature extractor's for it alone, as Qwen3ASRProcessor calls it)."""
        wave = np.asarray(waveform, dtype=np.float32)
        if wave.ndim != 1 or wave.shape[0] == 0:
            raise ValueError(f"an audio of {list(wave.shape)} samples: give a mono waveform (1-D, not empty)")
        out = self.extractor(wave, sampling_rate=self.sampling_rate, padding=True, truncation=False,
                             return_attention_mask=True, return_tensors="np")
        frames = int(np.asarray(out["attention_mask"])[0].sum())
        if frames < 1:
            raise ValueError(f"an audio of {wave.shape[0]} samples gives no feature frame; send a longer one")
        features = np.ascontiguousarray(np.asarray(out["input_features"], dtype=np.float32)[0, :, :frames])
        return ProcessedImage([self.audio_token_id] * audio_embeddings(frames), {FEATURES: features})

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE

    # ---- the OpenAI server's transcriptions ----

    def transcription_messages(self, task: str, language: str | None, prompt: str | None) -> list[dict]:
        """The chat of a transcription request as ``Qwen3ASRProcessor.apply_transcription_request`` writes it: the
        request's prompt (context, hotwords) as the system turn, the audio as the user's, and the assistant's turn
        begun with ``language <Name><asr_text>`` where the language is given (the template continues it)."""
        if task != "transcribe":
            raise ValueError(f"{ARCH} transcribes only; it does not translate: use /v1/audio/transcriptions")
        if language is not None and language not in LANGUAGES:
            raise ValueError(f"language={language!r} is not one {ARCH} takes; use one of {sorted(LANGUAGES)}, or "
                             "leave it out for the model to detect it")
        messages = [] if prompt is None else [{"role": "system", "content": [{"type": "text", "text": prompt}]}]
        begun = "" if language is None else f"language {LANGUAGES[language]}{MARKER}"
        return [*messages, {"role": "user", "content": [{"type": "audio"}]},
                {"role": "assistant", "content": [{"type": "text", "text": begun}]}]

    @staticmethod
    def transcription_text(text: str) -> str:
        """The transcript in a generation's ``text`` so far: what follows the model's own ``language <Name>
        <asr_text>`` (its leading spaces dropped; nothing while the model may still be writing that), else the text
        as it is."""
        if MARKER in text:
            return text.split(MARKER, 1)[1].lstrip()
        head = "language "
        return "" if text.startswith(head) or head.startswith(text) else text
