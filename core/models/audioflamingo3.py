"""Audio Flamingo 3's audio (``AudioFlamingo3ForConditionalGeneration``, transformers' ``models/audioflamingo3``:
nvidia/audio-flamingo-3-hf): Qwen2-Audio's Whisper-style encoder with its average pool (:class:`specray.models.
whisper_audio.WhisperAudioTower`, its padded frames masked as keys) and a two-linear projector (``linear_2(act(
linear_1(x)))``, biases by ``projector_bias``, ``projector_hidden_act``) into the Qwen2 text model's embeddings, one
row per ``<sound>`` token.

An audio is cut into windows of the feature extractor's ``chunk_length`` (30 s) as ``AudioFlamingo3Processor`` cuts
it, each window's log-mel features padded to the full window with the mask of its frames; the windows' valid output
rows, in order, make the audio's embeddings, and its ``<sound>`` placeholder becomes ``((L - 1) // 2 + 1 - 2) // 2 +
1`` copies of itself for ``L`` valid mel frames over all its windows (the same count as the windows' rows summed).
The text model (a Qwen2, its ``text_config``) is served through ``registry._TEXT_PARTS`` (``language_model.model.*``
/ ``language_model.lm_head.*``, or transformers' modules' ``model.language_model.*`` / ``lm_head.*``).

Refused by name: an audio longer than the processor's ``max_audio_len`` (600 s; transformers' processor would keep
its first windows only), a feature extractor that does not fit the encoder, an unknown projector activation,
images."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from specray.models.vision_towers import Linear, vision_activation
from specray.models.whisper_audio import AudioTowerEncoder, WindowedAudioProcessor, load_feature_extractor
from specray.multimodal import read_json

ARCH = "AudioFlamingo3ForConditionalGeneration"
MAX_AUDIO_LEN = 600  # seconds: AudioFlamingo3Processor's default max_audio_len


class AudioFlamingo3Encoder(AudioTowerEncoder):
    """Audio Flamingo 3's encoder and projector, built from the whole checkpoint's config."""

    arch = ARCH
    mask_key = "input_features_mask"

    def __init__(self, config: Any):
        super().__init__(config, pool=True)
        text_hidden, bias = config.text_config.hidden_size, bool(getattr(config, "projector_bias", True))
        self.act = vision_activation(getattr(config, "projector_hidden_act", "gelu"), "projector_hidden_act")
        self.projector = nn.Module()
        self.projector.linear_1 = Linear(self.tower.hidden, text_hidden, bias)
        self.projector.linear_2 = Linear(text_hidden, text_hidden, bias)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.projector.linear_2(self.act(self.projector.linear_1(hidden)))


class AudioFlamingo3Processor(WindowedAudioProcessor):
    """Audio Flamingo 3's host side: 30 s windows (at most ``max_audio_len`` seconds in all), the ``<sound>``
    placeholder expanded to one token per embedding."""

    arch = ARCH
    default_max_audio_len = MAX_AUDIO_LEN

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any):
        return cls(load_feature_extractor(folder, config.audio_config, cls.arch), config,
                   read_json(Path(folder) / "processor_config.json").get("max_audio_len", cls.default_max_audio_len))
