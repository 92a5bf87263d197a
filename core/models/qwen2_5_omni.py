"""Qwen2.5-Omni's thinker (``Qwen2_5OmniThinkerForConditionalGeneration``, and the whole release,
``Qwen2_5OmniModel`` as its config.json names it or ``Qwen2_5OmniForConditionalGeneration`` as transformers does,
whose ``thinker.`` part it is): text out only (its talker and token2wav, the speech output, are not served). Its
text model is a Qwen2 with Qwen2.5-VL's multimodal RoPE (``mrope_section``), served as Qwen2.5-VL's is
(``Qwen2ForCausalLM``, :mod:`specray.models.registry`'s ``_TEXT_PARTS``); this module is the multimodal side, the two
seams of :mod:`specray.multimodal`:

* :class:`Qwen2_5OmniEncoder`: the audio tower (:class:`AudioTower`) and, for images, Qwen2.5-VL's vision tower
  (:class:`specray.models.qwen2_vl_vision.Qwen2_5_VLImageEncoder`, reused: Omni's tower is that one with its
  attention's q, k and v as three linears, concatenated here into the ``qkv`` it reads).
* :class:`Qwen2_5OmniProcessor`: transformers' Whisper feature extractor of the folder (the log-mel features of
  the audio's own frames, as transformers' Qwen2_5OmniProcessor makes them), the ``<|AUDIO|>`` placeholder repeated
  once per embedding the tower gives, images through Qwen2.5-VL's processor
  (:class:`~specray.models.qwen2_vl_vision.QwenVLImageProcessor`) and the prompt's TMRoPE positions.

The audio tower (Whisper's encoder, windowed): the features [mel, frames] are cut into windows of ``2 * n_window``
frames (the last one shorter), each run alone through two convolutions (kernel 3; the second of stride 2, halving the
frames) with GELUs, plus sinusoidal positions counted from the window's start; pre-norm encoder layers attend within
each window only; then the whole audio's frames are averaged in pairs, LayerNormed (``ln_post``) and projected
(``proj``) into the text model's width: ``((frames - 1) // 2 + 1 - 2) // 2 + 1`` embeddings per audio (25 a second).

TMRoPE (transformers' ``get_rope_index``): an audio's tokens, like text, take consecutive positions on all three axes
(without a video, an audio needs no multimodal positions: a prompt of text and audios runs as plain RoPE); an image's
tokens take Qwen2.5-VL's (its start, start + row, start + column), the tokens after it continuing from start +
max(rows, columns). Videos (frames only) are :mod:`specray.models.omni_video`'s (``<|VIDEO|>``, the same vision
tower, frame pairs spaced by ``position_id_per_seconds``); audio inside videos (``use_audio_in_video``: audio and
frames interleaved per ``seconds_per_chunk``) is not served (refused by name).

The encoder is replicated on every tensor-parallel rank; it reads its tensors under ``audio_tower.`` / ``visual.``,
``model.audio_tower.`` / ``model.visual.`` (transformers 5's modules) or ``thinker.audio_tower.`` / ``thinker.visual.``
(the whole release). Each audio's window layout comes from its features' shape on the host (no device reads)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.layers import LayerNorm, _param
from specray.models.qwen2_vl_vision import Qwen2_5_VLImageEncoder, QwenVLImageProcessor, _field
from specray.models.vision_towers import Linear, copy_weights, vision_activation
from specray.models.whisper_audio import LAYER_NORM_EPS, WhisperAudioLayer
from specray.multimodal import MultiModalItem, ProcessedImage

# a tensor of the audio tower / of the vision tower: the thinker's names, transformers 5's modules', the whole release's
_AUDIO = re.compile(r"^(?:thinker\.)?(?:model\.)?audio_tower\.(.+)$")
_VISUAL = re.compile(r"^(?:thinker\.)?(?:model\.)?visual\.(.+)$")
_QKV = re.compile(r"^(blocks\.\d+\.attn\.)([qkv])\.(weight|bias)$")
FEATURES = "input_features"  # an audio item's data: its log-mel features [mel, frames]


def thinker_config(config: Any) -> Any:
    """The thinker's config: the whole release's ``thinker_config``, or the thinker checkpoint's config itself."""
    return _field(config, "thinker_config") or config


def audio_embeddings(frames: int) -> int:
    """How many embeddings the audio tower gives for ``frames`` feature frames (the stride-2 convolution, then the
    pairwise average pool)."""
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's sinusoidal positions [length, channels]: sines then cosines of position / timescale, the timescales
    geometric from 1 to ``max_timescale`` (float32, on the default device)."""
    step = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-step * torch.arange(channels // 2, dtype=torch.float32))
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat((angles.sin(), angles.cos()), dim=1)


class AudioTower(nn.Module):
    """Qwen2.5-Omni's audio encoder (``audio_config``): windowed convolutions and attention, pooled and projected
    into the text model's width (``output_dim``)."""

    def __init__(self, audio: Any, text_hidden: int):
        super().__init__()
        self.mel = _field(audio, "num_mel_bins", 128)
        dim = _field(audio, "d_model")
        self.window = 2 * _field(audio, "n_window", 100)  # feature frames per window
        positions = _field(audio, "max_source_positions", 1500)
        if self.window // 2 > positions:
            raise ValueError(f"audio_config.n_window={self.window // 2} gives windows of {self.window // 2} frames "
                             f"after the convolutions, more than audio_config.max_source_positions={positions} "
                             "sinusoidal positions; the checkpoint's audio config is inconsistent")
        out = _field(audio, "output_dim")
        if out != text_hidden:
            raise ValueError(f"audio_config.output_dim={out} differs from the text model's hidden_size={text_hidden}: "
                             "the audio embeddings could not replace the <|AUDIO|> tokens; the config is inconsistent")
        if _field(audio, "scale_embedding", False):
            raise ValueError("audio_config.scale_embedding=True is not supported (transformers' Qwen2.5-Omni audio "
                             "encoder does not scale its inputs either); set it to false")
        act = vision_activation(_field(audio, "activation_function", "gelu"), "audio_config.activation_function")
        self.conv1_weight, self.conv1_bias = _param(dim, self.mel, 3), _param(dim)
        self.conv2_weight, self.conv2_bias = _param(dim, dim, 3), _param(dim)
        heads, ffn = _field(audio, "encoder_attention_heads"), _field(audio, "encoder_ffn_dim")
        self.layers = nn.ModuleList(WhisperAudioLayer(dim, heads, ffn, act, "audio_config")
                                    for _ in range(_field(audio, "encoder_layers")))
        self.ln_post = LayerNorm(dim, LAYER_NORM_EPS)
        self.proj = Linear(dim, out)
        self.register_buffer("positions", sinusoids(self.window // 2, dim), persistent=False)

    def checkpoint_names(self) -> dict[str, nn.Parameter]:
        """Our parameters by their checkpoint names (``conv1.weight`` for ``conv1_weight``)."""
        return {re.sub(r"^(conv\d)_", r"\1.", name): p for name, p in self.named_parameters()}

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # features: [mel, frames] -> [audio_embeddings(frames), out]
        h, lengths = self.embed(features)
        return self.proj(self.ln_post(self.pool(self.attend(h, lengths))))

    def attend(self, h: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The encoder layers over each window's rows alone (``h`` [N, dim], windows of ``lengths`` consecutive):
        the windows batched, a shorter last one padded and its padding masked as keys."""
        n = max(lengths)
        batch = torch.nn.utils.rnn.pad_sequence(list(h.split(lengths)), batch_first=True)
        keys = None if min(lengths) == n else (torch.arange(n, device=h.device)
                                               < torch.tensor(lengths, device=h.device)[:, None])[:, None, None, :]
        for layer in self.layers:
            batch = layer(batch, keys)
        return torch.cat([rows[:m] for rows, m in zip(batch, lengths)])

    def embed(self, features: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Each window of ``features`` [mel, frames] through the convolutions alone (zero padding at its edges), plus
        positions from its start: ([ceil(frames / 2), dim], each window's length after the convolutions)."""
        frames = features.shape[-1]
        full, tail = divmod(frames, self.window)
        x = features.to(self.conv1_weight.dtype)
        windows = [x[:, :full * self.window].reshape(self.mel, full, self.window).transpose(0, 1)] if full else []
        if tail:
            windows.append(x[None, :, full * self.window:])
        rows, lengths = [], []
        for batch in windows:  # [n, mel, w]: the whole windows as one batch, then the last one
            h = F.gelu(F.conv1d(batch, self.conv1_weight, self.conv1_bias, padding=1))
            h = F.gelu(F.conv1d(h, self.conv2_weight, self.conv2_bias, stride=2, padding=1)).transpose(1, 2)
            rows.append((h + self.positions[: h.shape[1]].to(h.dtype)).flatten(0, 1))
            lengths += [h.shape[1]] * h.shape[0]
        return torch.cat(rows), lengths

    @staticmethod
    def pool(h: torch.Tensor) -> torch.Tensor:
        """The whole audio's frames averaged in pairs (an odd last one dropped): [N, dim] -> [N // 2, dim]."""
        pairs = h.shape[0] // 2
        return (h[0:2 * pairs:2] + h[1:2 * pairs:2]) / 2


class Qwen2_5OmniEncoder(nn.Module):
    """Qwen2.5-Omni's thinker's encoders, built from the whole checkpoint's config (replicated on every rank):
    :meth:`encode` gives one audio's embeddings [audio_embeddings(frames), text hidden] from its ``input_features``,
    or one image's [t*h*w / merge², text hidden] from its ``pixel_values`` and ``image_grid_thw`` (a video's from
    its ``pixel_values_videos`` and ``video_grid_thw``)."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        thinker = thinker_config(config)
        audio, text = _field(thinker, "audio_config"), _field(thinker, "text_config")
        if audio is None or text is None:
            raise ValueError("the checkpoint's config has no thinker audio_config / text_config; it is not a "
                             "Qwen2.5-Omni release")
        self.audio_tower = AudioTower(audio, _field(text, "hidden_size"))
        self.visual = Qwen2_5_VLImageEncoder(thinker)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy the audio tower's and the vision tower's tensors among ``weights`` (the vision attention's q, k and v
        concatenated into its qkv); a ValueError names any of their own tensors that did not come. Its unused
        ``audio_bos_eos_token`` and the talker's and token2wav's tensors are skipped."""
        audio, vision, parts = [], [], {}
        for name, tensor in weights:
            if (m := _AUDIO.match(name)) is not None:
                audio.append((m.group(1), tensor))
            elif (m := _VISUAL.match(name)) is not None:
                if (q := _QKV.match(m.group(1))) is not None:
                    parts[(q.group(1) + "qkv." + q.group(3), q.group(2))] = tensor
                else:
                    vision.append((m.group(1), tensor))
        for (name, which), tensor in list(parts.items()):
            if which == "q" and all((name, o) in parts for o in "kv"):
                vision.append((name, torch.cat([torch.as_tensor(parts[(name, o)][...]) for o in "qkv"])))
        missing = ["audio_tower." + n for n in copy_weights(self.audio_tower.checkpoint_names(), audio)]
        missing += ["visual." + n for n in copy_weights(dict(self.visual.named_parameters()), vision)]
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of the thinker's encoders: {missing[:6]}; "
                             "it does not match its config.json's audio_config / vision_config")

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        if FEATURES in data:
            features = data[FEATURES]
            if features.dim() != 2 or features.shape[0] != self.audio_tower.mel or features.shape[1] < 3:
                raise ValueError(f"an audio of input_features {tuple(features.shape)} does not fit this audio tower "
                                 f"([{self.audio_tower.mel}, frames >= 3]); process audio with the checkpoint's own "
                                 "feature extractor")
            return self.audio_tower(features)
        return self.visual.encode(data)  # (an image's, or a video's pixel_values_videos / video_grid_thw)


class Qwen2_5OmniProcessor:
    """Qwen2.5-Omni's host side: the folder's Whisper feature extractor for audios (``sampling_rate``, the placeholder
    ``<|AUDIO|>``), Qwen2.5-VL's image processor for images (``<|IMAGE|>``), videos' frames
    (:class:`specray.models.omni_video.OmniVideo`, ``<|VIDEO|>``), and TMRoPE positions."""

    def __init__(self, features: Any, audio_token_id: int, images: QwenVLImageProcessor | None,
                 video_token_id: int | None = None, video: Any = None, video_problem: str | None = None):
        self.features = features
        self.audio_token_id = audio_token_id
        self.sampling_rate = int(features.sampling_rate)
        self.images = images
        self.image_token_id = None if images is None else images.image_token_id
        # videos (specray.models.omni_video.OmniVideo): the placeholder, the frames' side, why they are refused
        self.video_token_id, self.video, self.video_problem = video_token_id, video, video_problem

    audio_token = "<|AUDIO|>"  # (named in errors)
    # videos as transformers' Qwen2_5OmniProcessor / get_rope_index: the video processor's size it passes on every
    # call, the fps of frames given alone, temporal positions truncated to integers
    video_size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}
    video_fps = 2.0
    video_truncate = True
    extractor_needs = "n_samples"  # a member the feature extractor must have (a Whisper-style one)

    @classmethod
    def check_audio_config(cls, audio: Any) -> None:
        """A ValueError for audio settings the encoder does not take (a subclass's)."""

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> Qwen2_5OmniProcessor:
        from transformers import AutoFeatureExtractor

        thinker = thinker_config(config)
        if _field(thinker, "audio_token_id") is None:
            raise ValueError(f"the checkpoint's config has no audio_token_id (the {cls.audio_token} token's id); "
                             "set it")
        cls.check_audio_config(_field(thinker, "audio_config"))
        features = AutoFeatureExtractor.from_pretrained(str(folder))
        mel = _field(_field(thinker, "audio_config"), "num_mel_bins", 128)
        if getattr(features, "feature_size", None) != mel or not hasattr(features, cls.extractor_needs):
            raise ValueError(f"the folder's feature extractor ({type(features).__name__}, feature_size="
                             f"{getattr(features, 'feature_size', None)}) is not the Whisper feature extractor of "
                             f"audio_config.num_mel_bins={mel} mel bins; use the release's preprocessor_config.json")
        images, video = None, {}
        if _field(thinker, "vision_config") is not None and _field(thinker, "image_token_id") is not None:
            from specray.models.omni_video import OmniVideo

            images = QwenVLImageProcessor.from_pretrained(folder, thinker)
            video = OmniVideo.side(folder, thinker, cls.video_size, cls.video_fps, cls.video_truncate)
        return cls(features, int(_field(thinker, "audio_token_id")), images, **video)

    @property
    def max_audio_samples(self) -> int | None:
        """The longest audio one placeholder takes: the feature extractor's ``n_samples``."""
        return int(self.features.n_samples)

    def process(self, image: Any) -> ProcessedImage:
        if self.images is None:
            raise ValueError("this Qwen2.5-Omni checkpoint has no vision tower settings: send the prompt without "
                             "images")
        return self.images.process(image)

    def process_audio(self, waveform: np.ndarray) -> ProcessedImage:
        """One mono waveform at :attr:`sampling_rate` -> its ``<|AUDIO|>`` tokens and its log-mel features [mel,
        frames]: transformers' processor's, which pads every audio with silence to the extractor's ``n_samples``
        (``padding="max_length"``) and keeps the audio's frames. Padded here only a few hops past the audio (one
        more than half the STFT's window spans): every frame computed reads the same samples as with full padding
        (the reflection at the end mirrors silence), and the frames of silence that full padding adds sit at the
        log-mel's floor, below the maximum that sets its range; so each frame of the audio is the same (to the
        FFT's last bit, which some CPUs round otherwise for a shorter padding), at a fraction of the cost (a release
        pads to 300 s)."""
        waveform = np.asarray(waveform, dtype=np.float32)
        limit = self.max_audio_samples
        if waveform.ndim != 1 or not 0 < waveform.shape[0] <= limit:
            raise ValueError(f"an audio of {list(waveform.shape)} samples: give a mono waveform of 1 to {limit} "
                             f"samples ({limit / self.sampling_rate:g} s at {self.sampling_rate} Hz, the feature "
                             "extractor's chunk_length, which transformers' processor would cut it to); cut a longer "
                             "one")
        hop = int(self.features.hop_length)
        padded = min(limit, hop * (-(-waveform.shape[0] // hop) - (-(self.features.n_fft // 2) // hop) + 1))
        out = self.features(waveform, sampling_rate=self.sampling_rate, return_attention_mask=True,
                            padding="max_length", max_length=padded, return_tensors="np")
        frames = int(np.asarray(out["attention_mask"])[0].sum())
        tokens = audio_embeddings(frames)
        if tokens < 1:
            raise ValueError(f"an audio of {waveform.shape[0]} samples is too short for the audio tower (it gives no "
                             "embedding); send a longer one")
        features = np.ascontiguousarray(np.asarray(out["input_features"], dtype=np.float32)[0, :, :frames])
        return ProcessedImage([self.audio_token_id] * tokens, {FEATURES: features})

    def process_video(self, frames: list) -> ProcessedImage:
        """One video's frames -> its video placeholder tokens and tensors (:class:`specray.models.omni_video.OmniVideo`;
        frames only: the video's own sound is not taken)."""
        if self.video is None:
            raise ValueError(self.video_problem or "this checkpoint's videos are not served; send the prompt without "
                             "videos")
        return self.video.process(frames)

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> tuple[list[list[int]], int] | None:
        """TMRoPE (transformers' ``get_rope_index``, :func:`specray.models.omni_video.rope_positions`): audios take
        consecutive positions as text does, so a prompt without images or videos takes plain positions (None); an
        image's or a video's tokens their merged grid's, a video's frame pairs spaced by time."""
        from specray.models.omni_video import rope_positions

        video = self.video
        merge = None if self.images is None else self.images.merge  # (an image's temporal index is 0 at any rate)
        return rope_positions(token_ids, items, merge, 25 if video is None else video.per_second, self.video_truncate,
                              None if video is None else video.audio_start)
