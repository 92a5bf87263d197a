"""Music Flamingo's audio (``MusicFlamingoForConditionalGeneration``, transformers' ``models/musicflamingo``:
nvidia/music-flamingo-2601-hf): Audio Flamingo 3's encoder, windows and projector (:mod:`specray.models.
audioflamingo3`) with a rotary time embedding between the encoder and the projector, and each audio's ``<sound>``
tokens between ``<|sound_bos|>`` and ``<|sound_eos|>`` as ``MusicFlamingoProcessor`` writes them (the embeddings on
the ``<sound>`` rows only).

The rotary time embedding (transformers' ``MusicFlamingoRotaryEmbedding``) turns the first ``4 x ceil(dim / 2)``
channels of each encoder output row (``dim = int(hidden x partial_rotary_factor)``: 512 of the release's 1280) in
interleaved pairs, in float64, by angles on two axes, each with the frequencies ``1 / rope_theta ** (2i / dim)``:
the row's window index within its audio over ``rope_theta`` (transformers' ``max_position_embeddings``), and the
row's index within its window as a fraction of a full turn over ``rope_theta`` rows; every angle is then scaled by
``-2 pi t``, ``t`` the row's time in seconds within the audio (``audio_frame_step`` x 4 a row: the stem's stride and
the pool). A window's rows are timed as transformers times them, over the whole padded window (``max_source_positions
/ 2`` rows), so the rows kept equal transformers' whatever the encoder trims.

Refused by name: a ``rope_parameters`` rope_type other than "default", a rotary table shorter than a window's rows
(``rope_theta`` below ``max_source_positions / 2``), more rotary channels than the encoder has, an audio longer than
``max_audio_len`` (1200 s), a tokenizer without the sound markers, and what Audio Flamingo 3 refuses."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from specray.models.audioflamingo3 import AudioFlamingo3Encoder, AudioFlamingo3Processor
from specray.multimodal import read_json, special_token_ids

ARCH = "MusicFlamingoForConditionalGeneration"
MAX_AUDIO_LEN = 1200  # seconds: MusicFlamingoProcessor's default max_audio_len


def rotary_settings(config: Any, hidden: int) -> tuple[float, int, float]:
    """(rope_theta, the rotary dimension ``int(hidden x partial_rotary_factor)``, audio_frame_step) of Music
    Flamingo's time embedding (its frequencies: one per two of the dimension, each turning two channels per axis)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"rope_parameters.rope_type={kind!r} is not supported for {ARCH}'s rotary time embedding; "
                         "only 'default' (the release's)")
    theta = float(params.get("rope_theta", 1200.0))
    factor = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 0.2))
    dim = int(hidden * factor)
    if not 1 <= dim or 4 * math.ceil(dim / 2) > hidden:
        raise ValueError(f"rope_parameters.partial_rotary_factor={factor} gives {4 * math.ceil(dim / 2)} rotary "
                         f"channels of the encoder's {hidden}; it must give 1 to {hidden} (the release's: 0.2)")
    return theta, dim, float(getattr(config, "audio_frame_step", 0.01))


class MusicFlamingoEncoder(AudioFlamingo3Encoder):
    """Audio Flamingo 3's encoder and projector with the rotary time embedding between them."""

    arch = ARCH

    def __init__(self, config: Any):
        super().__init__(config)
        self.theta, self.rotary_dim, self.frame_step = rotary_settings(config, self.tower.hidden)
        self.window_rows = self.tower.positions // 2  # (a whole padded window's rows after the pool)
        if int(self.theta) < self.window_rows:
            raise ValueError(f"rope_parameters.rope_theta={self.theta} is below a window's {self.window_rows} rows "
                             "(audio_config.max_source_positions / 2): transformers' rotary table would not cover "
                             "them")

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        dim = self.rotary_dim
        return 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))

    def time_rotation(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rotary time embedding of an audio's windows' rows ``hidden`` [W, rows, D] (window i the audio's i-th)."""
        windows, rows = hidden.shape[:2]
        device, full, step = hidden.device, self.window_rows, self.frame_step * 4
        inv = self.inv_freq(device)
        index = torch.arange(windows, device=device)
        stamps = (index[:, None] * full) * step + torch.arange(full, dtype=torch.float32, device=device) * step
        window_pos = torch.round(stamps[:, 0] / (step * full)) / self.theta
        window_freqs = (window_pos[:, None] * inv).repeat_interleave(2, dim=-1)[:, None, :]
        turns = torch.arange(int(self.theta), dtype=torch.float32, device=device)[:full] / self.theta * (2 * math.pi)
        time_freqs = (turns[:, None] * inv).repeat_interleave(2, dim=-1)[None]
        window_freqs, time_freqs = torch.broadcast_tensors(window_freqs, time_freqs)
        freqs = torch.cat((window_freqs, time_freqs), dim=-1) * (-stamps * 2 * math.pi)[..., None]
        wide = torch.float32 if device.type == "mps" else torch.float64  # (as transformers: MPS has no float64)
        cos, sin = freqs.cos()[:, :rows].to(wide), freqs.sin()[:, :rows].to(wide)
        x = hidden.to(wide)
        width = cos.shape[-1]
        turned, kept = x[..., :width], x[..., width:]
        pairs = turned.unflatten(-1, (-1, 2))
        half = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        return torch.cat((turned * cos + half * sin, kept), dim=-1).to(hidden.dtype)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().project(self.time_rotation(hidden))


class MusicFlamingoProcessor(AudioFlamingo3Processor):
    """Audio Flamingo 3's windows (up to ``max_audio_len`` 1200 s), each audio's ``<sound>`` tokens between
    ``<|sound_bos|>`` and ``<|sound_eos|>``."""

    arch = ARCH
    default_max_audio_len = MAX_AUDIO_LEN

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any):
        from transformers import AutoTokenizer

        processor = super().from_pretrained(folder, config)
        settings = read_json(Path(folder) / "processor_config.json")
        tokens = [settings.get("audio_bos_token", "<|sound_bos|>"), settings.get("audio_eos_token", "<|sound_eos|>")]
        processor.bos, processor.eos = special_token_ids(AutoTokenizer.from_pretrained(folder), tokens, folder,
                                                         "MusicFlamingoProcessor")
        return processor

    def replacement(self, count: int) -> list[int]:
        return [self.bos] + [self.audio_token_id] * count + [self.eos]
