"""Omnilingual ASR's LLM-based recognisers (``OmniASRForConditionalGeneration``, transformers' ``models/omniasr``:
facebook's omniASR-LLM releases in transformers' layout): a wav2vec 2.0 encoder over the raw waveform, one linear into
a Llama text model, one ``<extra_id_1>``-style placeholder (``audio_token_id``) per encoder frame.

Host side (:class:`OmniASRProcessor`): transformers' ``OmniASRFeatureExtractor`` of the folder normalises each audio
alone to zero mean and unit variance (over its own samples); the prompt's placeholder becomes one token per frame the
convolutions leave (``floor((n - kernel) / stride) + 1`` per conv of ``conv_kernel`` / ``conv_stride``). The OpenAI
server's transcriptions write the release's own request (``transcription_messages``: the audio and, where the request
names it, its language as the chat template's ``language`` part, an ISO 639-1 code mapped to the release's
``xxx_Script`` code as transformers' processor maps it).

Device side (:class:`OmniASREncoder`): the convolutional feature encoder (each conv, a LayerNorm over its channels,
the activation), a LayerNorm and a linear into the encoder's width, the positional convolution (grouped, its last
output dropped, the activation, added), pre-norm Transformer layers, a final LayerNorm, then the projector
(``multi_modal_projector``). Positions of the text model are plain RoPE.

Refused by name: an odd ``num_conv_pos_embeddings`` (transformers drops the positional conv's last output whatever
the kernel, which only fits an even one), an activation we lack, audio too short for one frame, images.
"""

from __future__ import annotations

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

ARCH = "OmniASRForConditionalGeneration"
VALUES = "input_values"  # an audio item's data: its normalised waveform [samples]
TORCH_LN_EPS = 1e-5  # the conv layers' nn.LayerNorm default (not configurable)


def frames_of(samples: int, kernels: list[int], strides: list[int]) -> int:
    """The encoder frames ``samples`` give: each conv's ``floor((n - kernel) / stride) + 1``."""
    for kernel, stride in zip(kernels, strides):
        samples = (samples - kernel) // stride + 1
    return samples


def check_audio_config(audio: Any) -> None:
    if audio.num_conv_pos_embeddings % 2:
        raise ValueError(f"audio_config.num_conv_pos_embeddings={audio.num_conv_pos_embeddings} is not supported: "
                         "transformers drops the positional convolution's last output, which fits an even kernel "
                         "only")
    if not len(audio.conv_dim) == len(audio.conv_kernel) == len(audio.conv_stride):
        raise ValueError(f"audio_config.conv_dim, conv_kernel and conv_stride must have one entry per conv, not "
                         f"{len(audio.conv_dim)}, {len(audio.conv_kernel)} and {len(audio.conv_stride)}")
    vision_activation(audio.hidden_act, "audio_config.hidden_act")


# ---- the encoder -----------------------------------------------------------------------------------------------------

class ConvLayer(nn.Module):
    def __init__(self, inp: int, out: int, kernel: int, stride: int, bias: bool, act):
        super().__init__()
        self.conv = nn.Module()
        self.conv.weight = _param(out, inp, kernel)
        self.conv.bias = _param(out) if bias else None
        self.layer_norm = LayerNorm(out, TORCH_LN_EPS)
        self.stride, self.act = stride, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [C, N] -> [C', N']
        y = F.conv1d(x[None], self.conv.weight, self.conv.bias, stride=self.stride)[0]
        return self.act(self.layer_norm(y.t()).t())


class Subsampling(nn.Module):
    def __init__(self, audio: Any, act):
        super().__init__()
        dims = [1, *audio.conv_dim]
        self.conv_layers = nn.ModuleList(ConvLayer(dims[i], dims[i + 1], k, s, audio.conv_bias, act)
                                         for i, (k, s) in enumerate(zip(audio.conv_kernel, audio.conv_stride)))
        self.layer_norm = LayerNorm(dims[-1], audio.layer_norm_eps)
        self.projection = Linear(dims[-1], audio.hidden_size)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        # wave: [samples] -> [frames, hidden]
        x = wave[None]
        for layer in self.conv_layers:
            x = layer(x)
        return self.projection(self.layer_norm(x.t()))


class PositionalConv(nn.Module):
    def __init__(self, audio: Any, act):
        super().__init__()
        width, self.kernel, self.groups = audio.hidden_size, audio.num_conv_pos_embeddings, \
            audio.num_conv_pos_embedding_groups
        self.conv = nn.Module()
        self.conv.weight = _param(width, width // self.groups, self.kernel)
        self.conv.bias = _param(width)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [frames, hidden]
        pos = F.conv1d(x.t()[None], self.conv.weight, self.conv.bias, padding=self.kernel // 2, groups=self.groups)
        return x + self.act(pos[0, :, :-1]).t()


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.heads, self.head_dim).transpose(0, 1) for p in (self.q_proj, self.k_proj,
                                                                                       self.v_proj))
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=self.head_dim ** -0.5)[0]
        return self.out_proj(o.transpose(0, 1).reshape(n, -1))


class EncoderLayer(nn.Module):
    def __init__(self, audio: Any, act):
        super().__init__()
        width = audio.hidden_size
        self.attention = Attention(width, audio.num_attention_heads)
        self.layer_norm = LayerNorm(width, audio.layer_norm_eps)
        self.feed_forward = nn.Module()
        self.feed_forward.intermediate_dense = Linear(width, audio.intermediate_size)
        self.feed_forward.output_dense = Linear(audio.intermediate_size, width)
        self.final_layer_norm = LayerNorm(width, audio.layer_norm_eps)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.layer_norm(x))
        ff = self.feed_forward
        return x + ff.output_dense(self.act(ff.intermediate_dense(self.final_layer_norm(x))))


class AudioModel(nn.Module):
    """transformers' ``OmniASRAudioModel`` for one audio: a normalised waveform [samples] -> frames [n, hidden]."""

    def __init__(self, audio: Any):
        super().__init__()
        check_audio_config(audio)
        act = vision_activation(audio.hidden_act, "audio_config.hidden_act")
        self.subsampling = Subsampling(audio, act)
        self.encode_positions = PositionalConv(audio, act)
        self.layers = nn.ModuleList(EncoderLayer(audio, act) for _ in range(audio.num_hidden_layers))
        self.layer_norm = LayerNorm(audio.hidden_size, audio.layer_norm_eps)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        x = self.encode_positions(self.subsampling(wave))
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class OmniASREncoder(nn.Module):
    """The wav2vec 2.0 encoder and projector (:class:`specray.multimodal.ImageEncoder` for audio), built from the
    whole checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        self.audio_tower = AudioModel(config.audio_config)
        self.multi_modal_projector = Linear(config.audio_config.hidden_size, config.text_config.hidden_size)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        load_audio_parts(self, weights, ARCH)

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One audio's normalised ``input_values`` [samples] -> its embeddings [frames, text hidden]."""
        weight = self.multi_modal_projector.weight
        return self.multi_modal_projector(self.audio_tower(data[VALUES].to(device=weight.device, dtype=weight.dtype)))


# ---- the host side ---------------------------------------------------------------------------------------------------

class OmniASRProcessor:
    """OmniASR's host side (:class:`specray.multimodal.ImageProcessor` for audio): see the module docstring."""

    image_token_id = None  # audio only

    def __init__(self, extractor: Any, config: Any):
        audio = config.audio_config
        check_audio_config(audio)
        self.extractor = extractor
        self.kernels, self.strides = list(audio.conv_kernel), list(audio.conv_stride)
        self.audio_token_id = int(config.audio_token_id)
        self.sampling_rate = int(extractor.sampling_rate)

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> OmniASRProcessor:
        from transformers import OmniASRFeatureExtractor

        return cls(OmniASRFeatureExtractor.from_pretrained(str(folder)), config)

    def process(self, image: Any) -> ProcessedImage:
        raise ValueError(f"{ARCH} takes audio only: send the prompt without images")

    def process_audio(self, waveform: np.ndarray) -> ProcessedImage:
        """One mono waveform at :attr:`sampling_rate` -> one placeholder token per encoder frame and the waveform
        as the feature extractor normalises it alone."""
        wave = np.asarray(waveform, dtype=np.float32)
        frames = frames_of(wave.shape[0], self.kernels, self.strides) if wave.ndim == 1 else 0
        if frames < 1:
            raise ValueError(f"an audio of {list(wave.shape)} samples gives no encoder frame: send a mono waveform "
                             f"of at least {self.least_samples()} samples")
        out = self.extractor(wave, sampling_rate=self.sampling_rate, return_tensors="pt")
        values = np.ascontiguousarray(out[VALUES][0, 0].numpy(), dtype=np.float32)
        return ProcessedImage([self.audio_token_id] * frames, {VALUES: values})

    def least_samples(self) -> int:
        """The fewest samples that give one encoder frame."""
        samples = 1
        for kernel, stride in reversed(list(zip(self.kernels, self.strides))):
            samples = (samples - 1) * stride + kernel
        return samples

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE

    def transcription_messages(self, task: str, language: str | None, prompt: str | None) -> list[dict]:
        """A transcription request as ``OmniASRProcessor.apply_transcription_request`` writes it: the audio and,
        where given, its language (an ISO 639-1 code, mapped to the release's code as transformers' processor maps
        it) in the user's turn; no prompt (the release takes none)."""
        if task != "transcribe":
            raise ValueError(f"{ARCH} transcribes only; it does not translate: use /v1/audio/transcriptions")
        if prompt:
            raise ValueError(f"{ARCH} takes no prompt with the audio; leave prompt out")
        content: list[dict] = [{"type": "audio"}]
        if language is not None:
            from transformers.models.omniasr.processing_omniasr import ISO_639_1_TO_LANGUAGE

            if language not in ISO_639_1_TO_LANGUAGE:
                raise ValueError(f"language={language!r} has no code among {ARCH}'s languages; give another ISO "
                                 "639-1 code, or leave it out for its language-agnostic mode")
            content.append({"type": "language", "language": ISO_639_1_TO_LANGUAGE[language]})
        return [{"role": "user", "content": content}]
