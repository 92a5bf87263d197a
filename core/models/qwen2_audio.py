"""Qwen2-Audio's audio (``Qwen2AudioForConditionalGeneration``, transformers' ``models/qwen2_audio``: Qwen2-Audio-7B
and -7B-Instruct): a Whisper-style encoder with an average pool of two rows (:class:`specray.models.whisper_audio.
WhisperAudioTower`) and one linear projector (``multi_modal_projector.linear``, with a bias) into the Qwen2 text
model's embeddings, one row per ``<|AUDIO|>`` token.

The text model (a Qwen2, its ``text_config``) is served by its own class through ``registry._TEXT_PARTS``
(``language_model.model.*`` / ``language_model.lm_head.*`` as released and as transformers 5 saves it, or
``model.language_model.*`` / ``lm_head.*`` as its modules name it). :class:`Qwen2AudioProcessor` is the host side:
transformers' ``WhisperFeatureExtractor`` of the folder makes the log-mel features of the audio padded to its
``chunk_length`` (30 s) with the mask of the frames holding it, as ``Qwen2AudioProcessor`` asks it; the prompt's
``<|AUDIO|>`` placeholder (what the chat template writes between ``<|audio_bos|>`` and ``<|audio_eos|>``) becomes
``((L - 1) // 2 + 1 - 2) // 2 + 1`` copies of itself for ``L`` valid mel frames, each taking one embedding.

Refused by name: an audio longer than the feature extractor's window (transformers' processor would cut it to its
first 30 s: cut or split it yourself), a feature extractor that does not fit the encoder, a config without
``audio_token_index``, images."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specray.models.vision_towers import Linear
from specray.models.whisper_audio import (AudioTowerEncoder, audio_token_count, check_waveform,
                                          load_feature_extractor, window_features)
from specray.multimodal import MultiModalItem, ProcessedImage

ARCH = "Qwen2AudioForConditionalGeneration"


def audio_token_id(config: Any, field: str = "audio_token_index") -> int:
    """The placeholder token's id the config names (Qwen2-Audio's ``audio_token_index``)."""
    token = getattr(config, field, None)
    if token is None:
        raise ValueError(f"{ARCH}'s config.json sets no {field}: the id of the <|AUDIO|> placeholder is needed")
    return int(token)


class Qwen2AudioEncoder(AudioTowerEncoder):
    """Qwen2-Audio's encoder and projector (``linear(tower(x))``), built from the whole checkpoint's config."""

    arch = ARCH
    mask_key = "feature_attention_mask"

    def __init__(self, config: Any):
        super().__init__(config, pool=True)
        self.projector = nn.Module()
        self.projector.linear = Linear(self.tower.hidden, config.text_config.hidden_size, bias=True)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.projector.linear(hidden)


class Qwen2AudioProcessor:
    """Qwen2-Audio's host side (:class:`specray.multimodal.ImageProcessor` for audio): one window of log-mel features
    per audio (at most ``chunk_length`` seconds), the ``<|AUDIO|>`` placeholder expanded to one token per embedding."""

    image_token_id = None  # (an audio-only release: the seam refuses images by name)

    def __init__(self, extractor: Any, config: Any):
        self.extractor = extractor
        self.audio_token_id = audio_token_id(config)
        self.sampling_rate = int(extractor.sampling_rate)
        self.max_audio_samples = int(extractor.n_samples)  # the feature extractor's window

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> Qwen2AudioProcessor:
        return cls(load_feature_extractor(folder, config.audio_config, ARCH), config)

    def process_audio(self, waveform: np.ndarray) -> ProcessedImage:
        """One audio (1-D float32 at ``sampling_rate``) -> its ``<|AUDIO|>`` tokens and features."""
        wave = check_waveform(waveform, self.max_audio_samples, self.sampling_rate,
                              "split it into parts of at most that length, each its own audio (transformers' "
                              "Qwen2AudioProcessor would keep only its beginning)")
        out = window_features(self.extractor, [wave])
        count = audio_token_count(out["attention_mask"], self.extractor)
        data = {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}
        return ProcessedImage([self.audio_token_id] * count, data)

    def process(self, image: Any) -> ProcessedImage:
        raise ValueError(f"{ARCH} takes audio, not images: send the prompt without images")

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE
