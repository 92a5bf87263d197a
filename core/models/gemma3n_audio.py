"""Gemma 3n's audio (``Gemma3nForConditionalGeneration``, transformers' ``models/gemma3n``: Gemma 3n E2B / E4B): the
USM-style Conformer audio encoder (transformers' ``Gemma3nAudioEncoder``) and ``embed_audio`` (its
``Gemma3nMultimodalEmbedder``) into the rows of the audio soft tokens; the text model is Gemma 3n's own
(:mod:`specray.models.gemma3n`, through ``registry._TEXT_PARTS``), which puts these rows in place of the placeholders'
embeddings (``meta.with_input_embeds``, unscaled, after the scaled token embedding, as transformers scatters them).

:class:`Gemma3nAudioTower`, over one audio's log-mel frames [F, mel]:

* a sub-sampling conv projection: two ``Conv2d`` blocks over (time, mel) (no bias; time padded by ``kernel - 1``
  frames after the audio, mel by one bin a side; ``sscp_conv_stride_size``), each followed by a *cumulative* group
  norm (mean and variance over the channels and mel bins of all frames up to each frame, the squared deviations
  taken from each frame's own running mean; a scale, no bias) and a ReLU; the (time, mel x channels) rows projected
  to ``hidden_size``;
* ``conf_num_hidden_layers`` Conformer blocks: a half-step feed-forward (SiLU, four times wide, times
  ``conf_residual_weight``), local self-attention, a light conv module (GLU, a causal depthwise conv of
  ``conf_conv_kernel_size``, RMSNorm, SiLU), a second half-step feed-forward and an RMSNorm; each sub-layer's input
  and output clamped to +-``gradient_clipping`` as transformers clamps them at inference too;
* the local attention: each query sees the keys ``conf_attention_context_left - 1`` frames back to
  ``conf_attention_context_right`` ahead (transformers computes it over blocks of ``conf_attention_chunk_size``
  queries with their context; the same window is a band here), queries scaled by ``head_dim ** -0.5 / softplus(0) *
  softplus(per_dim_scale)``, logits ``q.k + q.pos_proj(sinusoid(q - k))`` (Transformer-XL's relative term without
  its biases), soft-capped by ``conf_attention_logit_cap`` (tanh), padded frames masked as keys;
* every ``conf_reduction_factor``-th row kept, padded rows (the mel mask at each row's first frame) zeroed.

:class:`Gemma3nAudioEncoder`: the tower, then ``embed_audio``'s soft path (RMSNorm, a projection to the text width,
an RMSNorm without a scale); the rows of padded frames and the rows up to ``audio_soft_tokens_per_image`` are
``embed_audio``'s hard embedding of the last text id (``text_config.vocab_size - 1``), as transformers pads every audio
to that count. It also returns the hard embedding of ``<end_of_audio>`` (``eoa_token_id``, an id past
``audio_config.vocab_offset``, which transformers embeds through ``embed_audio`` rather than the text table), so
each audio's replacement is embedded as transformers embeds it.

:class:`Gemma3nAudioProcessor`: transformers' ``Gemma3nAudioFeatureExtractor`` of the checkpoint's folder (numpy) makes
the features of each audio alone (padded to a multiple of 128 samples; every frame it gives is valid); the placeholder
a prompt holds once per audio is ``<audio_soft_token>`` (``audio_token_id``, what the chat template renders for an
audio part), replaced as ``Gemma3nProcessor`` replaces it, by the tokens of ``"\\n\\n<start_of_audio>" +
"<audio_soft_token>" * audio_seq_length + "<end_of_audio>\\n\\n"``, the soft tokens and ``<end_of_audio>`` taking
embeddings; its newlines joined with the prompt's neighbouring ones as Gemma 3's images' are
(:meth:`specray.models.gemma3_images.Gemma3ImageProcessor.finish_prompt`).

Several audios of one prompt are each processed alone: transformers' feature extractor pads a batch's shorter audios
to the longest and then counts a shorter audio's last frames (those the padding completes) as valid, so its rows for
such an audio differ from its rows for the same audio alone; specray gives each audio the rows it has alone.

Refused by name: images (Gemma 3n's vision tower is timm's MobileNetV5, not served here), an audio longer than the
feature extractor's ``max_length`` (it would cut it) or one giving more rows than ``audio_soft_tokens_per_image``,
one too short for a frame, a feature extractor with ``dither`` (random noise) or of another width than the encoder,
an ``audio_seq_length`` other than ``audio_soft_tokens_per_image``, a sub-sampling projection not of two convs, a
hidden size the heads do not divide."""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.gemma3_images import MAX_NEWLINES, Gemma3ImageProcessor
from specray.models.gemma4 import Gemma4RMSNorm
from specray.models.layers import _param
from specray.models.registry import text_tensors
from specray.models.vision_towers import Linear, copy_weights
from specray.multimodal import MultiModalItem, ProcessedImage

ARCH = "Gemma3nForConditionalGeneration"
NORM_EPS = 1e-6  # transformers' Gemma3nRMSNorm default, which most of the Conformer's norms keep
PAD_MULTIPLE = 128  # samples: Gemma3nAudioFeatureExtractor's pad_to_multiple_of
MAX_SAMPLES = 480_000  # its max_length (longer audio is cut)


def _audio_config(config: Any) -> Any:
    audio = getattr(config, "audio_config", None)
    if audio is None:
        raise ValueError(f"{ARCH}'s config.json has no audio_config: its audio encoder cannot be built")
    return audio


def _clip(x: torch.Tensor, bound: float) -> torch.Tensor:
    return torch.clamp(x, -bound, bound)


class CumulativeGroupNorm(nn.Module):
    """A group norm over channels and mel bins whose statistics run over time: at frame t the mean of all values of
    frames 0..t, and the mean of each frame's squared deviations from its own running mean, up to t (as transformers'
    ``Gemma3nAudioCumulativeGroupNorm``); a per-channel scale, no bias."""

    def __init__(self, channels: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, T, F, C]
        xf = x.float()
        count = torch.cumsum(torch.full((x.shape[1],), float(x.shape[2] * x.shape[3]), device=x.device), 0)
        count = count.clamp(min=1.0).view(1, -1, 1, 1)
        mean = torch.cumsum(xf.sum(dim=(2, 3), keepdim=True), dim=1) / count
        var = torch.cumsum((xf - mean).pow(2).sum(dim=(2, 3), keepdim=True), dim=1) / count
        return ((xf - mean) * torch.rsqrt(var + self.eps) * self.weight.float()).to(x.dtype)


class SubsampleConvBlock(nn.Module):
    """Conv2d over (time, mel) (time padded after the audio by ``kernel - 1`` frames, mel by one bin a side), the
    cumulative group norm, ReLU."""

    def __init__(self, cin: int, cout: int, kernel: tuple[int, int], stride: tuple[int, int], eps: float):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, bias=False)
        self.norm = CumulativeGroupNorm(cout, eps)
        self.padding = (1, 1, 0, kernel[0] - 1)  # (mel left, mel right, time before, time after)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, C, T, mel] -> [B, C', T', mel']
        x = self.conv(F.pad(x, self.padding))
        return torch.relu(self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


class SubsampleConvProjection(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        channels, kernels = list(config.sscp_conv_channel_size), [tuple(k) for k in config.sscp_conv_kernel_size]
        strides = [tuple(s) for s in config.sscp_conv_stride_size]
        if not len(channels) == len(kernels) == len(strides) == 2:
            raise ValueError(f"audio_config.sscp_conv_channel_size={channels}, sscp_conv_kernel_size={kernels} and "
                             f"sscp_conv_stride_size={strides} must each name two convs (transformers' sub-sampling "
                             "projection has two)")
        mel = int(config.input_feat_size)
        for i in range(2):
            mel = (mel + 2 - kernels[i][1]) // strides[i][1] + 1
        eps = float(config.sscp_conv_group_norm_eps)
        self.conv_0 = SubsampleConvBlock(1, channels[0], kernels[0], strides[0], eps)
        self.conv_1 = SubsampleConvBlock(channels[0], channels[1], kernels[1], strides[1], eps)
        self.input_proj_linear = Linear(mel * channels[1], config.hidden_size, bias=False)
        self.time_stride = strides[0][0] * strides[1][0]

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # features: [B, T, mel] -> [B, T', hidden]
        x = self.conv_1(self.conv_0(features[:, None]))
        b, c, t, f = x.shape
        return self.input_proj_linear(x.permute(0, 2, 3, 1).reshape(b, t, f * c))


class RelativePositionEmbedding(nn.Module):
    """The relative term's keys: ``pos_proj`` of the sinusoids of the distances ``left`` (farthest back) down to
    ``-right``."""

    def __init__(self, hidden: int, heads: int, left: int, right: int):
        super().__init__()
        self.pos_proj = Linear(hidden, hidden, bias=False)
        self.heads, self.left, self.right, self.hidden = heads, left, right, hidden

    def forward(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # -> [N, D, span]: column f is the distance (query - key) left - f
        half = self.hidden // 2
        inv = torch.exp(torch.arange(half, device=device, dtype=torch.float32) *
                        -(math.log(1.0e4) / max(half - 1, 1)))
        distances = torch.arange(self.left, -self.right - 1, -1, device=device, dtype=torch.float32)
        angles = distances[:, None] * inv[None]
        signal = torch.cat((torch.sin(angles), torch.cos(angles)), dim=-1).to(dtype)
        return self.pos_proj(signal).view(-1, self.heads, self.hidden // self.heads).permute(1, 2, 0)


class LocalAttention(nn.Module):
    """Self-attention over a band of frames (``left`` back to ``right`` ahead), with the relative term and a tanh cap
    (see the module docstring); returns [B, T, hidden]."""

    def __init__(self, config: Any):
        super().__init__()
        hidden, heads = int(config.hidden_size), int(config.conf_num_attention_heads)
        if hidden % heads or hidden % 2:
            raise ValueError(f"audio_config.hidden_size={hidden} must be even and divisible by "
                             f"conf_num_attention_heads={heads}; the checkpoint's audio config is inconsistent")
        self.heads, self.head_dim = heads, hidden // heads
        self.left = max(0, int(config.conf_attention_context_left) - 1)
        self.right = int(config.conf_attention_context_right)
        self.cap = float(config.conf_attention_logit_cap)
        self.relative_position_embedding = RelativePositionEmbedding(hidden, heads, self.left, self.right)
        self.per_dim_scale = _param(self.head_dim)
        self.q_proj = Linear(hidden, hidden, bias=False)
        self.k_proj = Linear(hidden, hidden, bias=False)
        self.v_proj = Linear(hidden, hidden, bias=False)
        self.q_scale = self.head_dim ** -0.5 / F.softplus(torch.tensor(0.0, device="cpu")).item()

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        # x: [B, T, hidden]; valid: [B, T] bool (False: a padded frame)
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # [B, N, T, D]
        q = q * self.q_scale * F.softplus(self.per_dim_scale)
        rel = torch.matmul(q, self.relative_position_embedding(q.dtype, x.device))  # [B, N, T, span]
        pos = torch.arange(t, device=x.device)
        distance = pos[:, None] - pos[None, :]  # query - key
        band = (distance <= self.left) & (distance >= -self.right)
        index = (self.left - distance).clamp(0, self.left + self.right).expand(b, self.heads, t, t)
        logits = torch.matmul(q, k.transpose(-1, -2)) + torch.gather(rel, -1, index)
        logits = torch.tanh(logits / self.cap) * self.cap
        allowed = band[None, None] & valid[:, None, None, :]
        logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(v.dtype)
        return torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1)


class ConformerAttention(nn.Module):
    def __init__(self, config: Any, clip: float):
        super().__init__()
        hidden = int(config.hidden_size)
        self.pre_attn_norm = Gemma4RMSNorm(hidden, NORM_EPS)
        self.attn = LocalAttention(config)
        self.post = Linear(hidden, hidden, bias=False)
        self.post_norm = Gemma4RMSNorm(hidden, NORM_EPS)
        self.clip = clip

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        a = self.attn(self.pre_attn_norm(_clip(x, self.clip)), valid)
        return x + self.post_norm(_clip(self.post(a), self.clip))


class ConformerFeedForward(nn.Module):
    def __init__(self, config: Any, clip: float):
        super().__init__()
        hidden = int(config.hidden_size)
        self.pre_layer_norm = Gemma4RMSNorm(hidden, NORM_EPS)
        self.ffw_layer_1 = Linear(hidden, 4 * hidden, bias=False)
        self.ffw_layer_2 = Linear(4 * hidden, hidden, bias=False)
        self.post_layer_norm = Gemma4RMSNorm(hidden, NORM_EPS)
        self.clip, self.scale = clip, float(config.conf_residual_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ffw_layer_2(F.silu(self.ffw_layer_1(self.pre_layer_norm(_clip(x, self.clip)))))
        return x + self.post_layer_norm(_clip(h, self.clip)) * self.scale


class ConformerLightConv(nn.Module):
    def __init__(self, config: Any, clip: float):
        super().__init__()
        hidden, eps, kernel = int(config.hidden_size), float(config.rms_norm_eps), int(config.conf_conv_kernel_size)
        self.pre_layer_norm = Gemma4RMSNorm(hidden, eps)
        self.linear_start = Linear(hidden, 2 * hidden, bias=False)
        self.depthwise_conv1d = nn.Conv1d(hidden, hidden, kernel, groups=hidden, bias=False)
        self.conv_norm = Gemma4RMSNorm(hidden, eps)
        self.linear_end = Linear(hidden, hidden, bias=False)
        self.clip, self.kernel = clip, kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1).transpose(1, 2)  # [B, hidden, T]
        h = self.depthwise_conv1d(F.pad(h, (self.kernel - 1, 0))).transpose(1, 2)  # causal
        return x + self.linear_end(F.silu(self.conv_norm(_clip(h, self.clip))))


class ConformerBlock(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        clip = float(config.gradient_clipping)
        self.ffw_layer_start = ConformerFeedForward(config, clip)
        self.attention = ConformerAttention(config, clip)
        self.lconv1d = ConformerLightConv(config, clip)
        self.ffw_layer_end = ConformerFeedForward(config, clip)
        self.norm = Gemma4RMSNorm(int(config.hidden_size), NORM_EPS)
        self.clip = clip

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = self.attention(self.ffw_layer_start(x), valid)
        x = self.lconv1d(x * valid[..., None].to(x.dtype))  # padded frames zeroed before the causal conv
        return self.norm(_clip(self.ffw_layer_end(x), self.clip))


class Gemma3nAudioTower(nn.Module):
    """transformers' ``Gemma3nAudioEncoder`` (see the module docstring), named as its tensors are."""

    def __init__(self, config: Any):
        super().__init__()
        self.subsample_conv_projection = SubsampleConvProjection(config)
        self.conformer = nn.ModuleList(ConformerBlock(config) for _ in range(int(config.conf_num_hidden_layers)))
        self.reduction = int(config.conf_reduction_factor)
        if self.reduction < 1:
            raise ValueError(f"audio_config.conf_reduction_factor={self.reduction} must be a positive integer")

    def forward(self, features: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # features: [B, F, mel]; valid: [B, F] bool -> rows [B, T, hidden] (padded ones zero), their validity [B, T]
        x = self.subsample_conv_projection(features)
        first = (torch.arange(x.shape[1], device=x.device) * self.subsample_conv_projection.time_stride).clamp(
            max=valid.shape[1] - 1)
        valid = valid[:, first]  # each row's first frame
        for block in self.conformer:
            x = block(x, valid)
        x, valid = x[:, ::self.reduction], valid[:, ::self.reduction]
        return x * valid[..., None].to(x.dtype), valid


class Gemma3nAudioEmbedder(nn.Module):
    """``embed_audio`` (transformers' ``Gemma3nMultimodalEmbedder``): soft tokens (the tower's rows) or hard ones (ids
    at or past ``vocab_offset``) normed, projected to the text width and normed without a scale."""

    def __init__(self, audio: Any, text_hidden: int):
        super().__init__()
        hidden, eps = int(audio.hidden_size), float(audio.rms_norm_eps)
        self.vocab_offset, self.vocab_size = int(audio.vocab_offset), int(audio.vocab_size)
        self.embedding = nn.Embedding(self.vocab_size, hidden, _weight=_param(self.vocab_size, hidden))
        self.hard_embedding_norm = Gemma4RMSNorm(hidden, eps)
        self.soft_embedding_norm = Gemma4RMSNorm(hidden, eps)
        self.embedding_projection = Linear(hidden, text_hidden, bias=False)
        self.embedding_post_projection_norm = Gemma4RMSNorm(text_hidden, eps, scaled=False)

    def soft(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_post_projection_norm(self.embedding_projection(self.soft_embedding_norm(x)))

    def hard(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.hard_embedding_norm(self.embedding(ids - self.vocab_offset))
        return self.embedding_post_projection_norm(self.embedding_projection(e))


# the checkpoint's audio tensors -> ours (as released and as transformers' modules name them)
_AUDIO_PARTS = ((re.compile(r"^(?:model\.)?audio_tower\."), "tower."),
                (re.compile(r"^(?:model\.)?embed_audio\."), "embedder."))


class Gemma3nAudioEncoder(nn.Module):
    """Gemma 3n's audio encoder (:class:`specray.multimodal.ImageEncoder` for audio items): the tower, ``embed_audio``
    and the padding to ``audio_soft_tokens_per_image`` rows, then ``<end_of_audio>``'s row (see the module
    docstring), built from the whole checkpoint's config."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        audio, text = _audio_config(config), config.text_config
        self.tower = Gemma3nAudioTower(audio)
        self.embedder = Gemma3nAudioEmbedder(audio, int(text.hidden_size))
        self.soft_tokens = int(getattr(config, "audio_soft_tokens_per_image", 188))
        self.pad_id, self.eoa_id = int(text.vocab_size) - 1, int(config.eoa_token_id)
        for field, token in (("text_config.vocab_size - 1", self.pad_id), ("eoa_token_id", self.eoa_id)):
            if not 0 <= token - self.embedder.vocab_offset < self.embedder.vocab_size:
                raise ValueError(f"{field}={token} lies outside embed_audio's ids (audio_config.vocab_offset="
                                 f"{self.embedder.vocab_offset}, vocab_size={self.embedder.vocab_size}); transformers "
                                 "embeds it there: the checkpoint's config.json is inconsistent")

    @property
    def device(self) -> torch.device:
        return self.embedder.embedding.weight.device

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The audio tower's and ``embed_audio``'s tensors among the whole checkpoint's; a ValueError names any
        missing (the vision tower's and ``embed_vision``'s are not read)."""
        missing = copy_weights(dict(self.named_parameters()), text_tensors(weights, _AUDIO_PARTS))
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of {ARCH}'s audio encoder "
                             f"(model.audio_tower.*, model.embed_audio.*): {missing[:6]}; it does not match its "
                             "config.json's audio_config")

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One audio's ``input_features`` [F, mel] and ``input_features_mask`` [F] (True: a frame of the audio) ->
        its rows [audio_soft_tokens_per_image + 1, text hidden]: the soft tokens', then ``<end_of_audio>``'s."""
        features, valid = data["input_features"], data["input_features_mask"].to(torch.bool)
        if features.dim() == 2:
            features, valid = features[None], valid[None]
        hidden, valid = self.tower(features, valid)
        rows, valid = self.embedder.soft(hidden[0]), valid[0]
        pad, eoa = self.embedder.hard(torch.tensor([self.pad_id, self.eoa_id], device=rows.device))
        rows = torch.where(valid[:, None], rows, pad.to(rows.dtype))[: self.soft_tokens]
        extra = pad.to(rows.dtype).expand(self.soft_tokens - rows.shape[0], -1)
        return torch.cat((rows, extra, eoa[None].to(rows.dtype)))


# ---- the host side ---------------------------------------------------------------------------------------------------

def sub_rows(frames: int, config: Any) -> int:
    """The tower's rows for ``frames`` mel frames (each conv's time output, then the reduction)."""
    t = frames
    for kernel, stride in zip(config.sscp_conv_kernel_size, config.sscp_conv_stride_size):
        t = (t + kernel[0] - 1 - kernel[0]) // stride[0] + 1
    return -(-t // int(config.conf_reduction_factor))


class Gemma3nAudioProcessor:
    """Gemma 3n's host side for audio (:class:`specray.multimodal.ImageProcessor`): see the module docstring."""

    image_token_id = None  # images need the MobileNetV5 tower (timm), not served: the seam refuses them by name
    # Gemma 3's: the replacement's edge newlines joined with the prompt's neighbours, items narrowed to their rows
    _joined = Gemma3ImageProcessor._joined
    finish_prompt = Gemma3ImageProcessor.finish_prompt

    def __init__(self, extractor: Any, config: Any, replacement: list[int], newlines: dict[int, int]):
        self.extractor, self.config = extractor, config
        self.audio = _audio_config(config)
        self.audio_token_id = int(config.audio_token_id)
        self.sampling_rate = int(extractor.sampling_rate)
        self.soft_tokens = int(getattr(config, "audio_soft_tokens_per_image", 188))
        if float(getattr(extractor, "dither", 0.0) or 0.0) != 0.0:
            raise ValueError(f"the feature extractor's dither={extractor.dither} adds random noise to each audio; "
                             "set dither to 0.0 (the releases' value) in preprocessor_config.json")
        if int(extractor.feature_size) != int(self.audio.input_feat_size):
            raise ValueError(f"the feature extractor's feature_size={extractor.feature_size} differs from "
                             f"audio_config.input_feat_size={self.audio.input_feat_size}; fix "
                             "preprocessor_config.json to match config.json")
        soft, eoa = self.audio_token_id, int(config.eoa_token_id)
        rows = [i for i, t in enumerate(replacement) if t == soft]
        if len(rows) != self.soft_tokens or rows != list(range(rows[0], rows[0] + len(rows))) or \
                replacement[rows[-1] + 1] != eoa:
            raise ValueError(f"the tokenizer turns one audio's text into {replacement[:4]}... without one run of "
                             f"audio_soft_tokens_per_image={self.soft_tokens} audio_token_id={soft} tokens then "
                             f"eoa_token_id={eoa}; its boa/audio/eoa tokens do not match config.json")
        self.embed_rows = rows + [rows[-1] + 1]  # the soft tokens, then <end_of_audio>
        self.replacement = replacement
        self.newlines = dict(newlines)
        self.runs = {t: n for n, t in self.newlines.items()}

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> Gemma3nAudioProcessor:
        from transformers import AutoFeatureExtractor, AutoTokenizer

        folder = Path(folder)
        soft = int(getattr(config, "audio_soft_tokens_per_image", 188))
        path = folder / "processor_config.json"
        saved = json.loads(path.read_text()) if path.is_file() else {}
        if saved.get("audio_seq_length", soft) != soft:
            raise ValueError(f"{path} sets audio_seq_length={saved['audio_seq_length']} but config.json's "
                             f"audio_soft_tokens_per_image={soft}; fix processor_config.json to match config.json")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        boa, token, eoa = tokenizer.convert_ids_to_tokens([int(config.boa_token_id), int(config.audio_token_id),
                                                           int(config.eoa_token_id)])
        replacement = tokenizer.encode(f"\n\n{boa}{token * soft}{eoa}\n\n", add_special_tokens=False)
        vocab = tokenizer.get_vocab()
        newlines = {n: vocab["\n" * n] for n in range(1, MAX_NEWLINES + 1) if "\n" * n in vocab}
        return cls(AutoFeatureExtractor.from_pretrained(folder), config, replacement, newlines)

    @functools.cached_property
    def max_audio_samples(self) -> int:
        """The longest audio it takes: at most ``MAX_SAMPLES``, and no more rows than ``audio_soft_tokens_per_image``
        (the feature extractor's frames of ``frame_length + 1`` samples every ``hop_length``, over the audio padded
        to a multiple of ``PAD_MULTIPLE``)."""
        size, hop = int(self.extractor.frame_length) + 1, int(self.extractor.hop_length)

        def rows(samples: int) -> int:
            padded = -(-samples // PAD_MULTIPLE) * PAD_MULTIPLE
            return sub_rows(max(0, (padded - size) // hop + 1), self.audio)

        lo, hi = 1, MAX_SAMPLES  # the most samples whose rows fit: rows() grows with the samples
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if rows(mid) <= self.soft_tokens else (lo, mid - 1)
        return lo

    def process_audio(self, waveform: np.ndarray) -> ProcessedImage:
        """One audio (1-D float32 at ``sampling_rate``) -> its replacement tokens and features."""
        wave = np.asarray(waveform, dtype=np.float32)
        if wave.ndim != 1 or not wave.shape[0]:
            raise ValueError(f"an audio must be a non-empty 1-D waveform (mono), not an array of shape "
                             f"{list(wave.shape)}")
        rate = self.sampling_rate
        if wave.shape[0] > MAX_SAMPLES:
            raise ValueError(f"an audio of {wave.shape[0] / rate:.2f} s is longer than {ARCH} takes "
                             f"({MAX_SAMPLES / rate:g} s: transformers' feature extractor would cut it); split it "
                             "into parts, each its own audio")
        out = self.extractor([wave], return_tensors="np")
        features = np.ascontiguousarray(out["input_features"][0], dtype=np.float32)
        mask = np.ascontiguousarray(out["input_features_mask"][0], dtype=bool)
        if features.shape[0] < 1:
            raise ValueError(f"an audio of {wave.shape[0]} samples is too short for one frame of the feature "
                             f"extractor ({self.extractor.frame_length + 1} samples); send a longer one")
        rows = sub_rows(features.shape[0], self.audio)
        if rows > self.soft_tokens:
            raise ValueError(f"an audio of {wave.shape[0] / rate:.2f} s gives {rows} rows, more than "
                             f"audio_soft_tokens_per_image={self.soft_tokens} (transformers would fail on it); "
                             "split it into shorter parts, each its own audio")
        return ProcessedImage(list(self.replacement), {"input_features": features, "input_features_mask": mask},
                              list(self.embed_rows))

    def process(self, image: Any) -> ProcessedImage:
        raise ValueError(f"{ARCH}'s images are not served (its vision tower is timm's MobileNetV5): send the prompt "
                         "without images; its audio and text are served")

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE
