"""Qwen3-Omni-MoE's thinker (``Qwen3OmniMoeThinkerForConditionalGeneration``, and the whole release,
``Qwen3OmniMoeForConditionalGeneration``, whose ``thinker.`` part it is and whose config keeps the thinker's under
``thinker_config``): text out only (its talker and code2wav, the speech output, are not served). Its text model is a
Qwen3-MoE with Qwen3-VL's interleaved multimodal RoPE (``qwen3_omni_moe_text``), served as Qwen3-VL-MoE's is
(``Qwen3MoeForCausalLM``, :mod:`specray.models.registry`'s ``_TEXT_PARTS`` with Qwen2.5-Omni's name patterns); this
module is the multimodal side, the two seams of :mod:`specray.multimodal`:

* :class:`Qwen3OmniMoeEncoder`: the audio tower (:class:`AudioTower`) and, for images, Qwen3-VL's vision tower with
  its DeepStack mergers (:class:`Qwen3OmniVisionEncoder`: :class:`specray.models.qwen3_vl_vision.Qwen3VLImageEncoder`
  reading Omni's names for its mergers, ``merger.ln_q`` / ``merger.mlp.0`` / ``merger.mlp.2`` and ``merger_list.``).
* :class:`Qwen3OmniMoeProcessor`: transformers' Whisper feature extractor of the folder, ``<|audio_pad|>`` repeated
  once per embedding the tower gives (as transformers' ``Qwen3OmniMoeProcessor`` writes it), images through Qwen2-VL's
  processor (:class:`~specray.models.qwen2_vl_vision.QwenVLImageProcessor`) and TMRoPE positions, all as
  :class:`specray.models.qwen2_5_omni.Qwen2_5OmniProcessor` (reused) but for the audio's features and count.

The audio tower: the log-mel features [mel, frames] are cut into windows of ``2 * n_window`` = 100 frames (the last
one shorter, zero-padded to the audio's longest window as transformers pads a batch of one audio), each window through
three 3 x 3 convolutions of stride 2 over (mel, time) with GELUs (100 frames -> 13), its channels and remaining mel
rows flattened into ``conv_out`` (no bias), plus sinusoidal positions counted from the window's start; the rows of the
windows kept (a short last window's first ones), pre-norm Whisper layers (q, k, v all with biases) attending within
spans of ``13 * (n_window_infer // 100)`` rows, then ``ln_post``, ``proj1``, the activation and ``proj2`` into the
text model's width: ``13 * (frames // 100)`` embeddings plus the last window's (no pooling).

An audio is processed ALONE, as transformers processes a prompt holding only it: its features are the extractor's
over its own samples (``padding="longest"`` of a batch of one: ``samples // hop`` frames), its short last window
padded to the audio's own longest. transformers' processor and audio tower given several audios at once pad each to
the batch's longest (zero samples past a shorter audio's end; a short audio's one window padded to 100 frames), which
moves a shorter audio's last frames; specray's result does not depend on what else a prompt holds (as prefix caching
needs).

TMRoPE (transformers' ``get_rope_index``): audio tokens take consecutive positions as text does (without an image a
prompt runs as plain RoPE); an image's tokens take Qwen3-VL's positions (its temporal index 0). Videos (frames only)
are :mod:`specray.models.omni_video`'s (``<|video_pad|>``, the same tower and DeepStack, frame pairs spaced by
``position_id_per_seconds``); audio inside videos (``use_audio_in_video``) is not served (refused by name).

The encoder is replicated on every tensor-parallel rank; it reads its tensors under ``audio_tower.`` / ``visual.``
(transformers' thinker saves them so), ``model.audio_tower.`` / ``model.visual.`` or ``thinker.audio_tower.`` /
``thinker.visual.`` (the whole release). With a vision tower its ``deepstack_layers`` is the tower's; an audio's
rows then come with zero DeepStack additions (transformers adds DeepStack features to image rows only)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models import qwen2_5_omni as q25
from specray.models.layers import LayerNorm, _param
from specray.models.qwen2_vl_vision import _field
from specray.models.qwen3_vl_vision import Qwen3VLImageEncoder
from specray.models.vision_towers import Linear, copy_weights, vision_activation
from specray.models.whisper_audio import LAYER_NORM_EPS, WhisperAudioLayer
from specray.multimodal import ProcessedImage

FEATURES = q25.FEATURES  # an audio item's data: its log-mel features [mel, frames]
N_WINDOW = 50  # half a window in feature frames: transformers' processor counts tokens with it, its tower assumes it
# Omni's merger names -> Qwen3-VL's (the DeepStack mergers: ``merger_list.i`` there, ``deepstack_merger_list.i`` here)
_MERGER = re.compile(r"^(merger|merger_list\.\d+)\.(ln_q|mlp\.0|mlp\.2)\.")
_MERGER_PARTS = {"ln_q": "norm", "mlp.0": "linear_fc1", "mlp.2": "linear_fc2"}


def halved(frames: int, times: int = 3) -> int:
    """The rows left of ``frames`` after ``times`` convolutions of kernel 3, stride 2 and padding 1."""
    for _ in range(times):
        frames = (frames - 1) // 2 + 1
    return frames


def audio_embeddings(frames: int, window: int = 2 * N_WINDOW) -> int:
    """How many embeddings the audio tower gives for ``frames`` feature frames (transformers'
    ``_get_feat_extract_output_lengths``): each whole window's, then the last one's."""
    whole, tail = divmod(frames, window)
    return whole * halved(window) + (halved(tail) if tail else 0)


class AudioLayer(WhisperAudioLayer):
    """The shared pre-norm Whisper layer (:class:`specray.models.whisper_audio.WhisperAudioLayer`), its keys with a
    bias too."""

    def __init__(self, dim: int, heads: int, ffn: int, act):
        super().__init__(dim, heads, ffn, act, "audio_config")
        self.self_attn.k_proj = Linear(dim, dim)


class _Conv(nn.Module):
    """A 3 x 3 convolution's weight [out, in, 3, 3] and bias (applied with stride 2, padding 1)."""

    def __init__(self, out: int, inp: int):
        super().__init__()
        self.weight, self.bias = _param(out, inp, 3, 3), _param(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(F.conv2d(x, self.weight, self.bias, stride=2, padding=1))


def _window(audio: Any) -> int:
    """The audio config's window in feature frames (``2 * n_window``), refusing what transformers cannot run."""
    n_window = _field(audio, "n_window", N_WINDOW)
    if n_window != N_WINDOW:
        raise ValueError(f"audio_config.n_window={n_window} is not supported: transformers' Qwen3OmniMoeProcessor "
                         f"counts an audio's tokens with n_window={N_WINDOW} and its audio encoder assumes "
                         f"{halved(2 * N_WINDOW)} embeddings per whole window; use n_window={N_WINDOW} as the release")
    return 2 * n_window


class AudioTower(nn.Module):
    """Qwen3-Omni's audio encoder (``audio_config``): windowed 2D convolutions, attention within spans of windows,
    projected into the text model's width (``output_dim``). ``whole_windows``: a short last window is zero-padded to
    a whole one even when the audio is shorter than one (Qwen3-ASR's feature extractor pads its mel frames so), not
    to the audio's own longest."""

    whole_windows = False

    def __init__(self, audio: Any, text_hidden: int):
        super().__init__()
        self.mel = _field(audio, "num_mel_bins", 128)
        dim = _field(audio, "d_model")
        self.window = _window(audio)
        rows = halved(self.window)  # a whole window's rows after the convolutions
        infer = _field(audio, "n_window_infer", 800)
        self.spans = infer // self.window  # windows per attention span
        if self.spans < 1:
            raise ValueError(f"audio_config.n_window_infer={infer} is less than one window ({self.window} frames, "
                             "2 * n_window): transformers' encoder would attend over spans of no rows; the "
                             "checkpoint's audio config is inconsistent")
        positions = _field(audio, "max_source_positions", 1500)
        if rows > positions:
            raise ValueError(f"a window's {rows} rows need more than audio_config.max_source_positions={positions} "
                             "sinusoidal positions; the checkpoint's audio config is inconsistent")
        out = _field(audio, "output_dim")
        if out != text_hidden:
            raise ValueError(f"audio_config.output_dim={out} differs from the text model's hidden_size={text_hidden}: "
                             "the audio embeddings could not replace the <|audio_pad|> tokens; the config is "
                             "inconsistent")
        if _field(audio, "scale_embedding", False):
            raise ValueError("audio_config.scale_embedding=True is not supported (transformers' Qwen3-Omni audio "
                             "encoder does not scale its inputs either); set it to false")
        act = vision_activation(_field(audio, "activation_function", "gelu"), "audio_config.activation_function")
        down = _field(audio, "downsample_hidden_size", 480)
        self.conv2d1, self.conv2d2, self.conv2d3 = _Conv(down, 1), _Conv(down, down), _Conv(down, down)
        self.conv_out = Linear(down * halved(self.mel), dim, bias=False)
        heads, ffn = _field(audio, "encoder_attention_heads"), _field(audio, "encoder_ffn_dim")
        self.layers = nn.ModuleList(AudioLayer(dim, heads, ffn, act) for _ in range(_field(audio, "encoder_layers")))
        self.ln_post = LayerNorm(dim, LAYER_NORM_EPS)
        self.proj1, self.act, self.proj2 = Linear(dim, dim), act, Linear(dim, out)
        self.register_buffer("positions", q25.sinusoids(rows, dim), persistent=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # features: [mel, frames] -> [audio_embeddings(frames), out]
        if features.dim() != 2 or features.shape[0] != self.mel or features.shape[1] < 1:
            raise ValueError(f"an audio of input_features {tuple(features.shape)} does not fit this audio tower "
                             f"([{self.mel}, frames >= 1]); process audio with the checkpoint's own feature "
                             "extractor")
        h, rows = self.embed(features)
        span = rows * self.spans
        lengths = [span] * (h.shape[0] // span) + ([h.shape[0] % span] if h.shape[0] % span else [])
        return self.proj2(self.act(self.proj1(self.ln_post(self.attend(h, lengths)))))

    # the layers over each span's rows alone (spans batched, a shorter last one's padding masked as keys)
    attend = q25.AudioTower.attend

    def embed(self, features: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The windows of ``features`` [mel, frames] (a short last one zero-padded to the audio's longest) through
        the convolutions, ``conv_out`` and the positions, each window's own rows kept: ([audio_embeddings(frames),
        dim], the rows of the audio's longest window)."""
        frames = features.shape[-1]
        whole, tail = divmod(frames, self.window)
        width = self.window if whole or self.whole_windows else tail
        count = whole + (1 if tail else 0)
        x = F.pad(features.to(self.conv_out.weight.dtype), (0, count * width - frames))
        x = x.reshape(self.mel, count, width).transpose(0, 1)[:, None]  # [windows, 1, mel, width]
        x = self.conv2d3(self.conv2d2(self.conv2d1(x)))  # [windows, channels, mel rows, time rows]
        n, c, f, t = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(n, t, c * f)) + self.positions[:t].to(x.dtype)
        return x.flatten(0, 1)[: audio_embeddings(frames, self.window)], t


class Qwen3OmniVisionEncoder(Qwen3VLImageEncoder):
    """Qwen3-VL's vision tower, merger and DeepStack mergers (the thinker's ``vision_config``) reading Omni's names."""

    release = "Qwen3-Omni"

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy the tower's tensors among ``weights`` (named within the tower, Omni's merger names); a ValueError
        names any of its own that did not come."""
        renamed = ((_MERGER.sub(lambda m: m.group(1).replace("merger_list", "deepstack_merger_list") + "."
                                + _MERGER_PARTS[m.group(2)] + ".", name), t) for name, t in weights)
        missing = copy_weights(dict(self.named_parameters()), renamed)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of the vision tower: "
                             f"{['visual.' + n for n in missing[:6]]}; it does not match its config.json's "
                             "vision_config")


class Qwen3OmniMoeEncoder(nn.Module):
    """Qwen3-Omni's thinker's encoders, built from the whole checkpoint's config (replicated on every rank):
    :meth:`encode` gives one audio's embeddings from its ``input_features``, or one image's from its ``pixel_values``
    and ``image_grid_thw`` or a video's from its ``pixel_values_videos`` and ``video_grid_thw`` (with DeepStack: [1 +
    k, n, text hidden], an audio's k additions zero)."""

    deepstack_layers = 0  # set per config: the vision tower's

    def __init__(self, config: Any):
        super().__init__()
        thinker = q25.thinker_config(config)
        audio, text = _field(thinker, "audio_config"), _field(thinker, "text_config")
        if audio is None or text is None:
            raise ValueError("the checkpoint's config has no thinker audio_config / text_config; it is not a "
                             "Qwen3-Omni release")
        self.audio_tower = AudioTower(audio, _field(text, "hidden_size"))
        self.visual = None
        if _field(thinker, "vision_config") is not None:
            self.visual = Qwen3OmniVisionEncoder(thinker)
            self.deepstack_layers = self.visual.deepstack_layers

    @staticmethod
    def check_split(config: Any, tp: int, pp: int) -> None:
        """Before any rank starts: DeepStack's layers on the first pipeline stage (Qwen3-VL's rule, the thinker's
        config)."""
        thinker = q25.thinker_config(config)
        if _field(thinker, "vision_config") is not None:
            Qwen3VLImageEncoder.check_split(thinker, tp, pp)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy the audio tower's and the vision tower's tensors among ``weights``; a ValueError names any of their
        own tensors that did not come. The talker's and code2wav's tensors are skipped."""
        audio, vision = [], []
        for name, tensor in weights:
            if (m := q25._AUDIO.match(name)) is not None:
                audio.append((m.group(1), tensor))
            elif (m := q25._VISUAL.match(name)) is not None:
                vision.append((m.group(1), tensor))
        missing = ["audio_tower." + n for n in copy_weights(dict(self.audio_tower.named_parameters()), audio)]
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of the audio tower: {missing[:6]}; it "
                             "does not match its config.json's audio_config")
        if self.visual is not None:
            self.visual.load_weights(vision)

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        if FEATURES in data:
            out = self.audio_tower(data[FEATURES])
            if self.deepstack_layers:  # the DeepStack additions of image rows only: none for an audio's
                out = torch.cat((out[None], out.new_zeros(self.deepstack_layers, *out.shape)))
            return out
        if self.visual is None:
            raise ValueError("this Qwen3-Omni checkpoint has no vision_config: send the prompt without images or "
                             "videos")
        return self.visual.encode(data)  # (an image's, or a video's pixel_values_videos / video_grid_thw)


class Qwen3OmniMoeProcessor(q25.Qwen2_5OmniProcessor):
    """Qwen3-Omni's host side: the folder's Whisper feature extractor for audios (``sampling_rate``, the placeholder
    ``<|audio_pad|>``), Qwen2-VL's image processor for images (``<|image_pad|>``), videos' frames (``<|video_pad|>``)
    and TMRoPE positions (Qwen2.5-Omni's processor's, reused, with Qwen3-Omni's video settings)."""

    audio_token = "<|audio_pad|>"
    extractor_needs = "hop_length"
    # videos (specray.models.omni_video) as transformers' Qwen3OmniMoeProcessor / get_rope_index: its video size,
    # 1 fps for frames given alone, temporal positions kept as floats (served where whole)
    video_size = {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}
    video_fps = 1.0
    video_truncate = False
    max_audio_samples = None  # any length (no truncation)

    @classmethod
    def check_audio_config(cls, audio: Any) -> None:
        _window(audio)

    def process_audio(self, waveform: np.ndarray) -> ProcessedImage:
        """One mono waveform at :attr:`sampling_rate` -> its ``<|audio_pad|>`` tokens and log-mel features [mel,
        frames]: transformers' processor's for a prompt holding this audio alone (``padding="longest"``, no
        truncation: ``samples // hop`` frames, any length)."""
        waveform = np.asarray(waveform, dtype=np.float32)
        if waveform.ndim != 1 or waveform.shape[0] == 0:
            raise ValueError(f"an audio of {list(waveform.shape)} samples: give a mono waveform (1-D, not empty)")
        least = max(int(self.features.hop_length), int(self.features.n_fft) // 2 + 1)  # a frame; the STFT's reflection
        if waveform.shape[0] < least:
            raise ValueError(f"an audio of {waveform.shape[0]} samples is too short for the feature extractor and the "
                             f"audio tower (at least {least} samples give an embedding); send a longer one")
        out = self.features([waveform], sampling_rate=self.sampling_rate, return_attention_mask=True,
                            padding="longest", truncation=False, return_tensors="np")
        frames = int(np.asarray(out["attention_mask"])[0].sum())
        tokens = audio_embeddings(frames)
        features = np.ascontiguousarray(np.asarray(out["input_features"], dtype=np.float32)[0, :, :frames])
        return ProcessedImage([self.audio_token_id] * tokens, {FEATURES: features})
