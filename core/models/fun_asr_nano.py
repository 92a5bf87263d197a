"""Fun-ASR-Nano (``FunAsrNanoForConditionalGeneration``, transformers' ``models/fun_asr_nano``: FunAudioLLM's
Fun-ASR-Nano releases in transformers' layout): speech recognition as a Qwen3 text model reading SenseVoice's audio
encoder.

Host side (:class:`FunAsrNanoProcessor`): Kaldi's log mel filterbank (:func:`kaldi_fbank`, redone with torch:
``FunAsrNanoFeatureExtractor`` calls torchaudio's ``compliance.kaldi.fbank``, which the venv lacks) with the
extractor's settings (``preprocessor_config.json``, its defaults where absent): frames of ``frame_length`` ms every
``frame_shift`` ms that fit the audio, each less its mean, pre-emphasised (0.97, the first sample's predecessor
itself), windowed (``window``: Hamming by default), zero-padded to the next power of two; the power spectrum through
Kaldi's triangular mel bins from 20 Hz to Nyquist (``1127 ln(1 + f / 700)``), the log floored at float32's epsilon.
Then low frame rate stacking (``num_frames_lfr`` frames every ``stride_lfr``, the first and last frames repeated at
the ends) into [ceil(frames / stride_lfr), mel * num_frames_lfr]; one ``audio_token_id`` placeholder per stacked row.

Device side (:class:`FunAsrNanoEncoder`): the stacked rows times ``sqrt(hidden)`` plus sinusoidal positions counted
from one, then SAN-M layers (pre-norm attention whose value projection also feeds an FSMN: a depthwise convolution of
``fsmn_kernel_size`` over the frames, centred, plus its input, added to the attention's output; the first layer reads
the stacked width and keeps no residual; LayerNorms after the last transcription layer and after the last of all,
the timestamp layers included, as transformers' encoder runs them), then the projector (``linear_1``, the activation,
``linear_2``) and its adaptor layers (the same layer without FSMN) into the text width.

Each audio is processed and encoded alone (a batch's padding is masked where transformers batches them). The OpenAI
server's transcriptions write the release's own request (``transcription_messages``: the audio, the request's prompt
and its language as ``apply_transcription_request`` puts them in the user's turn; hotwords are not an OpenAI field).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.layers import LayerNorm, _param
from specray.models.vision_towers import Linear, load_audio_parts, vision_activation
from specray.multimodal import MultiModalItem, ProcessedImage

ARCH = "FunAsrNanoForConditionalGeneration"
FEATURES = "input_features"
# FunAsrNanoFeatureExtractor's defaults (its __init__'s)
FEATURE_DEFAULTS = {"feature_size": 80, "sampling_rate": 16000, "frame_length": 25, "frame_shift": 10,
                    "num_frames_lfr": 7, "stride_lfr": 6, "window": "hamming"}
WINDOWS = {"hamming": lambda n: torch.hamming_window(n, periodic=False, alpha=0.54, beta=0.46),
           "hanning": lambda n: torch.hann_window(n, periodic=False),
           "povey": lambda n: torch.hann_window(n, periodic=False).pow(0.85),
           "rectangular": torch.ones}
KALDI_LOW_HZ = 20.0  # torchaudio's kaldi.fbank defaults that FunAsrNanoFeatureExtractor keeps
PREEMPHASIS = 0.97


def kaldi_mel(hz):
    return 1127.0 * (1.0 + hz / 700.0).log() if isinstance(hz, torch.Tensor) else 1127.0 * math.log(1.0 + hz / 700.0)


def kaldi_fbank(wave: torch.Tensor, settings: dict[str, Any]) -> torch.Tensor:
    """Kaldi's log mel filterbank of a float32 waveform [n] -> [frames, feature_size] (see the module docstring)."""
    rate, bins = settings["sampling_rate"], settings["feature_size"]
    size = int(rate * settings["frame_length"] * 0.001)
    shift = int(rate * settings["frame_shift"] * 0.001)
    if wave.shape[0] < size:
        return wave.new_zeros(0, bins)
    count = 1 + (wave.shape[0] - size) // shift
    frames = wave.as_strided((count, size), (shift, 1))
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat((frames[:, :1], frames[:, :-1]), dim=1)
    frames = (frames - PREEMPHASIS * previous) * WINDOWS[settings["window"]](size).to(frames.dtype)
    padded = 1 << (size - 1).bit_length()
    power = torch.fft.rfft(F.pad(frames, (0, padded - size))).abs().pow(2.0)
    # triangular bins, evenly spaced in Kaldi's mel scale, over the FFT's bins but the last
    step = (kaldi_mel(0.5 * rate) - kaldi_mel(KALDI_LOW_HZ)) / (bins + 1)
    edge = torch.arange(bins).unsqueeze(1)
    left, centre, right = (kaldi_mel(KALDI_LOW_HZ) + (edge + k) * step for k in (0.0, 1.0, 2.0))
    mel = kaldi_mel(rate / padded * torch.arange(padded // 2)).unsqueeze(0)
    banks = torch.clamp(torch.minimum((mel - left) / (centre - left), (right - mel) / (right - centre)), min=0.0)
    banks = F.pad(banks, (0, 1)).to(power.dtype)
    return torch.max(power @ banks.T, torch.tensor(torch.finfo(torch.float).eps, dtype=power.dtype)).log()


def low_frame_rate(features: torch.Tensor, stack: int, stride: int) -> torch.Tensor:
    """Frames [T, mel] -> [ceil(T / stride), mel * stack]: ``stack`` frames every ``stride`` (the first and last
    frames repeated at the ends so that each window is centred and the last one whole), frame by frame."""
    frames = features.shape[0]
    left = (stack - 1) // 2
    rows = -(-frames // stride)
    need = (rows - 1) * stride + stack
    padded = torch.cat((features[:1].expand(left, -1), features,
                        features[-1:].expand(max(need - left - frames, stack - 1 - left), -1)))
    return padded.unfold(0, stack, stride)[:rows].transpose(1, 2).reshape(rows, -1)


def feature_settings(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "preprocessor_config.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    settings = {key: saved.get(key, value) for key, value in FEATURE_DEFAULTS.items()}
    if settings["window"] not in WINDOWS:
        raise ValueError(f"{path} window={settings['window']!r} is not supported; use one of {sorted(WINDOWS)}")
    return settings


class FunAsrNanoProcessor:
    """Fun-ASR-Nano's host side (:class:`specray.multimodal.ImageProcessor` for audio): see the module docstring."""

    image_token_id = None  # audio only

    def __init__(self, settings: dict[str, Any], config: Any):
        audio = config.audio_config
        check_audio_config(audio)
        if settings["feature_size"] != audio.num_mel_bins or settings["num_frames_lfr"] != audio.num_stacked_frames:
            raise ValueError(f"the feature extractor's feature_size={settings['feature_size']} and num_frames_lfr="
                             f"{settings['num_frames_lfr']} must be audio_config's num_mel_bins={audio.num_mel_bins} "
                             f"and num_stacked_frames={audio.num_stacked_frames}; use the release's "
                             "preprocessor_config.json")
        self.settings = settings
        self.audio_token_id = int(config.audio_token_id)
        self.sampling_rate = int(settings["sampling_rate"])

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> FunAsrNanoProcessor:
        return cls(feature_settings(folder), config)

    def process(self, image: Any) -> ProcessedImage:
        raise ValueError(f"{ARCH} takes audio only: send the prompt without images")

    def features(self, waveform: np.ndarray) -> np.ndarray:
        """One waveform's stacked rows [rows, mel * num_frames_lfr] (float32)."""
        fbank = kaldi_fbank(torch.from_numpy(np.ascontiguousarray(waveform, dtype=np.float32)), self.settings)
        if fbank.shape[0] == 0:
            least = int(self.sampling_rate * self.settings["frame_length"] * 0.001)
            raise ValueError(f"an audio of {np.shape(waveform)[0]} samples is shorter than one frame of the feature "
                             f"extractor ({least} samples); send a longer one")
        s = self.settings
        return low_frame_rate(fbank, s["num_frames_lfr"], s["stride_lfr"]).numpy()

    def process_audio(self, waveform: np.ndarray) -> ProcessedImage:
        wave = np.asarray(waveform, dtype=np.float32)
        if wave.ndim != 1:
            raise ValueError(f"an audio must be a mono waveform (1-D), not an array of shape {list(wave.shape)}")
        rows = self.features(wave)
        return ProcessedImage([self.audio_token_id] * rows.shape[0], {FEATURES: rows})

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE

    def transcription_messages(self, task: str, language: str | None, prompt: str | None) -> list[dict]:
        """A transcription request as ``FunAsrNanoProcessor.apply_transcription_request`` writes it: the audio, the
        request's prompt (context) as text, and its language as the template's ``language`` part, named as the
        release was trained (``zh``, ``en``, ``ja``: transformers' own table, imported on the host)."""
        if task != "transcribe":
            raise ValueError(f"{ARCH} transcribes only; it does not translate: use /v1/audio/transcriptions")
        content: list[dict] = [{"type": "audio"}]
        if prompt:
            content.append({"type": "text", "text": prompt})
        if language is not None:
            from transformers.models.fun_asr_nano.processing_fun_asr_nano import LANGUAGE_CODE_TO_NAME

            if language not in LANGUAGE_CODE_TO_NAME:
                raise ValueError(f"language={language!r} is not one {ARCH} takes; use one of "
                                 f"{sorted(k for k in LANGUAGE_CODE_TO_NAME if len(k) == 2)}, or leave it out")
            content.append({"type": "language", "language": LANGUAGE_CODE_TO_NAME[language]})
        return [{"role": "user", "content": content}]


# ---- the encoder -----------------------------------------------------------------------------------------------------

def check_audio_config(audio: Any) -> None:
    vision_activation(audio.hidden_act, "audio_config.hidden_act")
    if audio.num_timestamp_prediction_layers >= audio.num_hidden_layers:
        raise ValueError(f"audio_config.num_timestamp_prediction_layers={audio.num_timestamp_prediction_layers} "
                         f"leaves no transcription layer of num_hidden_layers={audio.num_hidden_layers}")


def sinusoids(length: int, channels: int) -> torch.Tensor:
    """[length, channels]: sin then cos of position times 10000 ** (-i / (channels / 2 - 1))."""
    scales = torch.exp(-math.log(10000.0) / (channels // 2 - 1) * torch.arange(channels // 2).float())
    angles = torch.arange(length)[:, None] * scales[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


class Attention(nn.Module):
    """Multi-head self-attention; with ``fsmn``, SAN-M's memory block over the projected values added to its
    output."""

    def __init__(self, width_in: int, width: int, heads: int, fsmn_kernel: int | None):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.q_proj, self.k_proj, self.v_proj = (Linear(width_in, width) for _ in range(3))
        self.o_proj = Linear(width, width)
        self.fsmn = None
        if fsmn_kernel is not None:
            self.fsmn = nn.Module()
            self.fsmn.conv = nn.Module()
            self.fsmn.conv.weight = _param(width, 1, fsmn_kernel)
            self.pad = ((fsmn_kernel - 1) // 2, fsmn_kernel - 1 - (fsmn_kernel - 1) // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        values = self.v_proj(x)
        q, k, v = (t.view(n, self.heads, self.head_dim).transpose(0, 1) for t in (self.q_proj(x), self.k_proj(x),
                                                                                    values))
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=self.head_dim ** -0.5)[0]
        out = self.o_proj(o.transpose(0, 1).reshape(n, -1))
        if self.fsmn is not None:
            w = self.fsmn.conv.weight
            memory = F.conv1d(F.pad(values.t()[None], self.pad), w, groups=w.shape[0])[0].t()
            out = out + memory + values
        return out


class Layer(nn.Module):
    def __init__(self, config: Any, width_in: int, fsmn: bool, final_norm: bool):
        super().__init__()
        width, eps = config.hidden_size, config.layer_norm_eps
        self.self_attn = Attention(width_in, width, config.num_attention_heads,
                                   config.fsmn_kernel_size if fsmn else None)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = Linear(width, config.intermediate_size), Linear(config.intermediate_size, width)
        self.input_layernorm = LayerNorm(width_in, eps)
        self.post_attention_layernorm = LayerNorm(width, eps)
        self.final_layernorm = LayerNorm(width, eps) if final_norm else None
        self.act = vision_activation(config.hidden_act, "hidden_act")
        self.residual = width_in == width  # (the first encoder layer reads the stacked width: no residual)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x))
        x = x + h if self.residual else h
        x = x + self.mlp.fc2(self.act(self.mlp.fc1(self.post_attention_layernorm(x))))
        return x if self.final_layernorm is None else self.final_layernorm(x)


class AudioTower(nn.Module):
    def __init__(self, audio: Any):
        super().__init__()
        check_audio_config(audio)
        width_in = audio.num_mel_bins * audio.num_stacked_frames
        last = audio.num_hidden_layers - 1
        norms = (last - audio.num_timestamp_prediction_layers, last)
        self.layers = nn.ModuleList(Layer(audio, width_in if i == 0 else audio.hidden_size, True, i in norms)
                                    for i in range(audio.num_hidden_layers))
        self.scale = audio.hidden_size ** 0.5
        self.register_buffer("positions", sinusoids(audio.max_position_embeddings, width_in), persistent=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        # rows: [n, mel * stacked] -> [n, hidden]; positions counted from one
        x = rows * self.scale + self.positions[1 : rows.shape[0] + 1].to(rows.dtype)
        for layer in self.layers:
            x = layer(x)
        return x


class Projector(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        adaptor = config.adaptor_config
        self.linear_1 = Linear(config.audio_config.hidden_size, adaptor.projector_hidden_size)
        self.linear_2 = Linear(adaptor.projector_hidden_size, adaptor.hidden_size)
        self.act = vision_activation(adaptor.projector_hidden_act, "adaptor_config.projector_hidden_act")
        self.layers = nn.ModuleList(Layer(adaptor, adaptor.hidden_size, False, False)
                                    for _ in range(adaptor.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear_2(self.act(self.linear_1(x)))
        for layer in self.layers:
            x = layer(x)
        return x


class FunAsrNanoEncoder(nn.Module):
    """SenseVoice's encoder and the projector (:class:`specray.multimodal.ImageEncoder` for audio), built from the
    whole checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        text_hidden = config.text_config.hidden_size
        if config.adaptor_config.hidden_size != text_hidden:
            raise ValueError(f"adaptor_config.hidden_size={config.adaptor_config.hidden_size} differs from the text "
                             f"model's hidden_size={text_hidden}: the audio rows could not replace its tokens")
        self.audio_tower = AudioTower(config.audio_config)
        self.multi_modal_projector = Projector(config)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        load_audio_parts(self, weights, ARCH)

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One audio's stacked rows [n, mel * stacked] -> its embeddings [n, text hidden]."""
        weight = self.multi_modal_projector.linear_1.weight
        rows = data[FEATURES].to(device=weight.device, dtype=weight.dtype)
        return self.multi_modal_projector(self.audio_tower(rows))
