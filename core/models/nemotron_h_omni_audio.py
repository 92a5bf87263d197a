"""Nemotron 3 Nano Omni's audio (``NemotronH_Omni_Reasoning_V3`` with an ``audio_config``, transformers'
``models/nemotron_h_omni`` over its ``models/parakeet`` encoder): a Parakeet (FastConformer) encoder and the sound
projector turn each audio into text embeddings of the Nemotron-H text model, which takes them as it takes the images'
(``meta.input_embeds``). This module adds the audio side to :mod:`specray.models.nemotron_h_omni_vision`: the classes
registered for the release, :class:`NemotronHOmniEncoder` and :class:`NemotronHOmniProcessor`, are its image encoder
and processor with the audio added (a checkpoint without ``audio_config`` takes images only, as before).

Host side: the log-mel features are transformers' own ``ParakeetFeatureExtractor`` of the folder (torch and numpy
only): pre-emphasis, a centred STFT with zero padding and a symmetric Hann window of ``win_length`` in ``n_fft``,
magnitudes squared, a Slaney mel filterbank, ``log(x + 2**-24)``, each mel normalised over the audio's valid frames
(``samples // hop`` of its ``1 + samples // hop``; the last one is zeroed). The prompt's ``<so_embedding>`` becomes
``<so_start>``, one ``<so_embedding>`` per embedding, ``<so_end>`` (``NemotronH_Omni_Reasoning_V3Processor``'s text),
the count transformers' processor estimates: ``1 + samples // hop`` frames through ``log2(subsampling_factor)``
halvings ``(n - 1) // 2 + 1``.

Device side (:class:`ParakeetEncoder`): the subsampling (a 3 x 3 stride-2 conv over time x mel, then depthwise
stride-2 + pointwise convs, ReLUs; frames past the audio's valid length zeroed after each conv), a linear over the
channels x mel of each frame, ``sqrt(hidden)`` scaling where ``scale_input``; then Conformer blocks: ``x + ff1 / 2``,
``x + attn``, ``x + conv``, ``x + ff2 / 2``, each on a LayerNorm of its input, and a LayerNorm out. The attention is
Transformer-XL's relative one: scores ``((q + u) . k + (q + v) . R[i - j]) / sqrt(d)``, ``R`` the sinusoids of the
distance (sines and cosines interleaved) through ``relative_k_proj``; where the last subsampled frame is past the
valid length (``samples // hop`` a multiple of the subsampling factor) it is masked as a key and, as a query, attends
evenly to every frame (its scores all at the dtype's minimum, as transformers' masked scores are). The conv module:
pointwise conv to twice the width, GLU, the masked frames zeroed, a depthwise conv (odd kernel, same padding), an
inference BatchNorm, the activation and a pointwise conv. The projector (``embed_audio``, the released
``sound_projection``): RMSNorm (eps 1e-5, in float32), linear, squared ReLU, linear, with ``projection_bias``.

Each audio is encoded alone: transformers' batch of several audios pads the shorter ones, which changes a shorter
audio's masked last frame (it attends evenly over the padded length); a lone audio's rows are what we give (equal to a
batch's wherever that frame is valid, and for the longest audio). The checkpoint is read as released
(``sound_encoder.encoder.*``, ``sound_projection.{norm,linear1,linear2}.*``; the featurizer's buffers under
``sound_encoder.encoder.feature_extractor.`` skipped) and as transformers' modules name it (``audio_tower.*``,
``embed_audio.*``). Refused by name: an even conv kernel, subsampling other than transformers' processor assumes
(kernel 3, stride 2, a power-of-two factor), mel bins the subsampling does not divide, processor or feature extractor
settings that disagree with the model (sampling rate, hop, mel bins, factor), an odd ``n_fft`` (the valid frames would
not give the counted tokens), an activation we lack, audio of under two hops."""

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

from specray.models.granite_speech import BatchNorm
from specray.models.layers import LayerNorm, _param
from specray.models.nemotron_h_omni_vision import ARCH, NemotronHOmniImageEncoder, NemotronHOmniImageProcessor
from specray.models.vision_towers import Linear, copy_weights, vision_activation
from specray.multimodal import ProcessedImage, read_json, special_token_ids

FEATURES, MASK = "input_features", "input_features_mask"  # an audio item's data: [frames, mel] and [frames] (0/1)
TORCH_LN_EPS = 1e-5  # the encoder's nn.LayerNorm / nn.BatchNorm1d (torch's default eps, not configurable)
PROJECTOR_EPS = 1e-5  # the sound projector's RMSNorm
# NemotronH_Omni_Reasoning_V3Processor's defaults and fixed values (its __init__ / _estimate_audio_num_embeddings)
PROCESSOR_DEFAULTS = {"audio_sampling_rate": 16000, "audio_subsampling_factor": 8, "audio_hop_length": 160}
COUNT_KERNEL, COUNT_STRIDE = 3, 2  # the subsampling convs the processor's token count assumes
AUDIO_TOKENS = ("<so_embedding>", "<so_start>", "<so_end>")  # the placeholder and the tokens around its expansion
FEATURE_EXTRACTOR = "ParakeetFeatureExtractor"

# the checkpoint's names of the audio tensors -> ours: as released, then as transformers' modules name them
_AUDIO_NAMES = ((re.compile(r"^sound_encoder\.encoder\.feature_extractor\."), None),
                (re.compile(r"^sound_encoder\.encoder\."), "audio_tower."),
                (re.compile(r"^sound_projection\.norm\."), "embed_audio.layer_norm."),
                (re.compile(r"^sound_projection\.linear1\."), "embed_audio.linear_1."),
                (re.compile(r"^sound_projection\.linear2\."), "embed_audio.linear_2."),
                (re.compile(r"^(?:model\.)?audio_tower\.feature_extractor\."), None),
                (re.compile(r"^(?:model\.)?audio_tower\."), "audio_tower."),
                (re.compile(r"^(?:model\.)?embed_audio\."), "embed_audio."))


def _get(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def check_audio(config: Any) -> None:
    """Refuse (ValueError naming the field) what the audio encoder does not implement."""
    audio = config.audio_config
    kernel = int(_get(audio, "conv_kernel_size", 9))
    if kernel % 2 == 0:
        raise ValueError(f"audio_config.conv_kernel_size={kernel} is not supported for {ARCH}: transformers' "
                         "Parakeet conv module pads (kernel - 1) // 2 on each side, which keeps the frames only for "
                         "odd kernels; fix config.json")
    sub_kernel = int(_get(audio, "subsampling_conv_kernel_size", COUNT_KERNEL))
    stride = int(_get(audio, "subsampling_conv_stride", COUNT_STRIDE))
    if (sub_kernel, stride) != (COUNT_KERNEL, COUNT_STRIDE):
        raise ValueError(f"audio_config.subsampling_conv_kernel_size={sub_kernel}, subsampling_conv_stride={stride} "
                         f"are not supported for {ARCH}: transformers' processor counts the <so_embedding> tokens for "
                         f"kernel {COUNT_KERNEL}, stride {COUNT_STRIDE} (the release's); fix config.json")
    factor = int(_get(audio, "subsampling_factor", 8))
    if factor < 2 or factor & (factor - 1):
        raise ValueError(f"audio_config.subsampling_factor={factor} is not supported for {ARCH}: it must be a power "
                         "of two (log2 of it stride-2 convs); fix config.json")
    mel = int(_get(audio, "num_mel_bins", 80))
    if mel % factor:
        raise ValueError(f"audio_config.num_mel_bins={mel} is not a multiple of audio_config.subsampling_factor="
                         f"{factor}: the subsampled mel axis would not fit the subsampling's linear; fix config.json")
    hidden, heads = int(_get(audio, "hidden_size")), int(_get(audio, "num_attention_heads"))
    if hidden % heads or (hidden // heads) % 2:
        raise ValueError(f"audio_config.hidden_size={hidden} must be an even multiple of audio_config."
                         f"num_attention_heads={heads}; the audio config is inconsistent")
    vision_activation(_get(audio, "hidden_act", "silu"), "audio_config.hidden_act")


def subsampled(frames: int, factor: int) -> int:
    """How many frames the subsampling gives for ``frames`` (``log2(factor)`` halvings ``(n - 1) // 2 + 1``: the
    kernel-3, stride-2, padding-1 convs; transformers' processor's count and the model's lengths)."""
    for _ in range(int(math.log2(factor))):
        frames = (frames - 1) // 2 + 1
    return frames


# ---- the encoder -----------------------------------------------------------------------------------------------------

class Conv2d(nn.Module):
    """An ``nn.Conv2d`` of empty parameters (weight [out, in / groups, k, k], a bias)."""

    def __init__(self, channels_in: int, channels_out: int, kernel: int, stride: int, groups: int = 1):
        super().__init__()
        self.weight, self.bias = _param(channels_out, channels_in // groups, kernel, kernel), _param(channels_out)
        self.stride, self.padding, self.groups = stride, (kernel - 1) // 2, groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, groups=self.groups)


class Subsampling(nn.Module):
    """The stride-2 conv stack over [time, mel] and the linear over each frame's channels x mels; frames past the
    valid length are zeroed after every conv (transformers' masking)."""

    def __init__(self, audio: Any):
        super().__init__()
        channels, factor = int(_get(audio, "subsampling_conv_channels", 256)), int(_get(audio, "subsampling_factor"))
        self.factor = factor
        layers: list[nn.Module] = [Conv2d(1, channels, COUNT_KERNEL, COUNT_STRIDE), nn.ReLU()]
        for _ in range(int(math.log2(factor)) - 1):  # (ReLU's place keeps the checkpoint's indices)
            layers += [Conv2d(channels, channels, COUNT_KERNEL, COUNT_STRIDE, groups=channels),
                       Conv2d(channels, channels, 1, 1), nn.ReLU()]
        self.layers = nn.ModuleList(layers)
        self.linear = Linear(channels * (int(_get(audio, "num_mel_bins")) // factor), int(_get(audio, "hidden_size")))

    def forward(self, features: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        # features: [T, mel]; valid: the valid frames (a 0-d integer tensor) -> [T', hidden]
        x = features[None, None]
        for layer in self.layers:
            x = layer(x)
            if isinstance(layer, Conv2d):
                if layer.stride != 1:
                    valid = (valid + 2 * layer.padding - COUNT_KERNEL) // layer.stride + 1
                x = x * (torch.arange(x.shape[2], device=x.device) < valid)[None, None, :, None]
        return self.linear(x[0].transpose(0, 1).flatten(1))


def relative_positions(frames: int, width: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """[2 * frames - 1, width]: the sinusoids of the distances frames - 1 down to -(frames - 1), sine and cosine of
    each frequency interleaved (frequencies ``10000 ** (-2i / width)``), computed in float32."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, width, 2, dtype=torch.float32, device=device) / width))
    angles = torch.arange(frames - 1, -frames, -1, device=device, dtype=torch.float32)[:, None] * inv
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(1).to(dtype)


def shifted(scores: torch.Tensor) -> torch.Tensor:
    """[h, T, 2T - 1] (query i against distance ``T - 1 - p``) -> [h, T, T] (query i against key j: distance
    ``i - j``, at ``p = T - 1 - i + j``)."""
    frames = scores.shape[1]
    seq = torch.arange(frames, device=scores.device)
    index = (seq[None, :] - seq[:, None] + frames - 1).expand(scores.shape[0], -1, -1)
    return scores.gather(-1, index)


def pair_mask(valid_rows: torch.Tensor) -> torch.Tensor:
    """[T, T]: query i may see key j where both frames are valid (transformers' mask; a masked frame's query row is
    all masked: its scores all at the dtype's minimum, it attends evenly to every frame)."""
    return valid_rows[:, None] & valid_rows[None, :]


class RelativeAttention(nn.Module):
    """Transformer-XL's relative self-attention (see the module's docstring)."""

    def __init__(self, audio: Any):
        super().__init__()
        hidden, bias = int(_get(audio, "hidden_size")), bool(_get(audio, "attention_bias", True))
        self.heads = int(_get(audio, "num_attention_heads"))
        self.head_dim = hidden // self.heads
        self.q_proj, self.k_proj = Linear(hidden, hidden, bias), Linear(hidden, hidden, bias)
        self.v_proj, self.o_proj = Linear(hidden, hidden, bias), Linear(hidden, hidden, bias)
        self.relative_k_proj = Linear(hidden, hidden, bias=False)
        self.bias_u, self.bias_v = _param(self.heads, self.head_dim), _param(self.heads, self.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; positions: [2T - 1, hidden]; keep: [T, T] (both frames valid) -> [T, hidden]
        frames = x.shape[0]
        q, k, v = (p(x).view(frames, self.heads, self.head_dim).transpose(0, 1)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        r = self.relative_k_proj(positions).view(-1, self.heads, self.head_dim).transpose(0, 1)
        scale = self.head_dim ** -0.5
        bias = shifted((q + self.bias_v[:, None]) @ r.transpose(1, 2)) * scale
        bias = bias.masked_fill(~keep, torch.finfo(bias.dtype).min)
        out = F.scaled_dot_product_attention(q + self.bias_u[:, None], k, v, attn_mask=bias, scale=scale)
        return self.o_proj(out.transpose(0, 1).reshape(frames, -1))


class Conv1d(nn.Module):
    """An ``nn.Conv1d`` of empty parameters over frames [T, C_in] -> [T, C_out] (``groups`` = C: depthwise)."""

    def __init__(self, channels_in: int, channels_out: int, kernel: int, bias: bool, groups: int = 1):
        super().__init__()
        self.weight = _param(channels_out, channels_in // groups, kernel)
        self.bias = _param(channels_out) if bias else None
        self.padding, self.groups = (kernel - 1) // 2, groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x.t()[None], self.weight, self.bias, padding=self.padding, groups=self.groups)[0].t()


class ConvModule(nn.Module):
    """Pointwise conv, GLU, masked frames zeroed, depthwise conv, inference BatchNorm, activation, pointwise conv."""

    def __init__(self, audio: Any, act):
        super().__init__()
        hidden, bias = int(_get(audio, "hidden_size")), bool(_get(audio, "convolution_bias", True))
        kernel = int(_get(audio, "conv_kernel_size", 9))
        self.pointwise_conv1 = Conv1d(hidden, 2 * hidden, 1, bias)
        self.depthwise_conv = Conv1d(hidden, hidden, kernel, bias, groups=hidden)
        self.norm = BatchNorm(hidden)
        self.pointwise_conv2 = Conv1d(hidden, hidden, 1, bias)
        self.act = act

    def forward(self, x: torch.Tensor, valid_rows: torch.Tensor) -> torch.Tensor:
        y = F.glu(self.pointwise_conv1(x), dim=-1) * valid_rows[:, None]
        y = self.act(self.norm(self.depthwise_conv(y).t()).t())
        return self.pointwise_conv2(y)


class FeedForward(nn.Module):
    def __init__(self, audio: Any, act):
        super().__init__()
        hidden, inner = int(_get(audio, "hidden_size")), int(_get(audio, "intermediate_size"))
        bias = bool(_get(audio, "attention_bias", True))
        self.linear1, self.linear2, self.act = Linear(hidden, inner, bias), Linear(inner, hidden, bias), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.act(self.linear1(x)))


class ConformerBlock(nn.Module):
    half_step = 0.5  # the feed-forwards' residual weight (the Conformer's macaron halves)

    def __init__(self, audio: Any, act):
        super().__init__()
        hidden = int(_get(audio, "hidden_size"))
        self.feed_forward1, self.feed_forward2 = FeedForward(audio, act), FeedForward(audio, act)
        self.self_attn, self.conv = RelativeAttention(audio), ConvModule(audio, act)
        for name in ("norm_feed_forward1", "norm_self_att", "norm_conv", "norm_feed_forward2", "norm_out"):
            setattr(self, name, LayerNorm(hidden, TORCH_LN_EPS))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                valid_rows: torch.Tensor) -> torch.Tensor:
        x = x + self.half_step * self.feed_forward1(self.norm_feed_forward1(x))
        x = x + self.self_attn(self.norm_self_att(x), positions, keep)
        x = x + self.conv(self.norm_conv(x), valid_rows)
        x = x + self.half_step * self.feed_forward2(self.norm_feed_forward2(x))
        return self.norm_out(x)


class ParakeetEncoder(nn.Module):
    """The FastConformer encoder over one audio's features [T, mel] -> [T', hidden] (see the module's docstring)."""

    def __init__(self, audio: Any):
        super().__init__()
        act = vision_activation(_get(audio, "hidden_act", "silu"), "audio_config.hidden_act")
        self.hidden, self.mel = int(_get(audio, "hidden_size")), int(_get(audio, "num_mel_bins"))
        self.input_scale = math.sqrt(self.hidden) if _get(audio, "scale_input", True) else 1.0
        self.subsampling = Subsampling(audio)
        self.layers = nn.ModuleList(ConformerBlock(audio, act) for _ in range(int(_get(audio, "num_hidden_layers"))))

    def forward(self, features: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = self.subsampling(features, valid) * self.input_scale
        frames = x.shape[0]
        positions = relative_positions(frames, self.hidden, x.dtype, x.device)
        for _ in range(int(math.log2(self.subsampling.factor))):  # the valid frames after the subsampling
            valid = (valid - 1) // 2 + 1
        valid_rows = torch.arange(frames, device=x.device) < valid
        keep = pair_mask(valid_rows)
        for layer in self.layers:
            x = layer(x, positions, keep, valid_rows.to(x.dtype))
        return x


class SoundProjector(nn.Module):
    """``linear_2(relu(linear_1(rms_norm(x))) ** 2)`` (the norm in float32, eps 1e-5; biases by
    ``projection_bias``)."""

    def __init__(self, width: int, inner: int, out: int, bias: bool):
        super().__init__()
        self.layer_norm = nn.Module()
        self.layer_norm.weight = _param(width)
        self.linear_1, self.linear_2 = Linear(width, inner, bias), Linear(inner, out, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + PROJECTOR_EPS)
        x = (self.layer_norm.weight.float() * xf).to(x.dtype)
        return self.linear_2(F.relu(self.linear_1(x)).square())


class NemotronHOmniEncoder(NemotronHOmniImageEncoder):
    """Nemotron 3 Nano Omni's encoders (:class:`specray.multimodal.ImageEncoder`): the image encoder of
    :mod:`specray.models.nemotron_h_omni_vision` and, where the config has an ``audio_config``, the Parakeet encoder
    and the sound projector; replicated on every tensor-parallel rank. :meth:`encode` tells an audio by its
    ``input_features``."""

    def __init__(self, config: Any):
        super().__init__(config)
        audio = getattr(config, "audio_config", None)
        self.audio_tower = self.embed_audio = None
        if audio is not None:
            check_audio(config)
            inner, bias = _get(audio, "projection_hidden_size"), _get(audio, "projection_bias")
            if inner is None or bias is None:
                raise ValueError(f"audio_config.projection_hidden_size={inner}, projection_bias={bias}: {ARCH}'s sound "
                                 "projector needs both (the release's config.json sets them); fix config.json")
            self.audio_tower = ParakeetEncoder(audio)
            self.embed_audio = SoundProjector(int(_get(audio, "hidden_size")), int(inner),
                                              config.text_config.hidden_size, bool(bias))

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The image side's tensors as :class:`NemotronHOmniImageEncoder` reads them, and the audio side's (see the
        module's docstring); a ValueError names any of ours missing. BatchNorms' ``num_batches_tracked`` are not
        read."""
        rest, audio = [], []
        for name, tensor in weights:
            for pattern, ours in _AUDIO_NAMES:
                if pattern.match(name):
                    if ours is not None:
                        audio.append((pattern.sub(ours, name, count=1), tensor))
                    break
            else:
                rest.append((name, tensor))
        super().load_weights(rest)
        if self.audio_tower is None:
            return
        params = {n: p for n, p in self.named_parameters() if n.startswith(("audio_tower.", "embed_audio."))}
        params.update((n, b) for n, b in self.named_buffers() if n.endswith(("running_mean", "running_var")))
        missing = copy_weights(params, audio)
        if missing:
            raise ValueError(f"the checkpoint lacks {ARCH}'s audio tensor(s) {missing[:6]} (sound_encoder.encoder.* "
                             "/ audio_tower.*, sound_projection.* / embed_audio.*); it does not match its "
                             "config.json's audio_config")

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One audio's ``input_features`` [T, mel] and ``input_features_mask`` [T] -> its embeddings [T', text
        hidden] (T' = the subsampled frames); an image as the image encoder takes it."""
        if FEATURES not in data:
            return super().encode(data)
        if self.audio_tower is None:
            raise ValueError(f"this {ARCH} checkpoint has no audio_config (no audio encoder): send the prompt without "
                             "audio")
        features, mask = data[FEATURES], data.get(MASK)
        mel = self.audio_tower.mel
        if features.dim() != 2 or features.shape[1] != mel or mask is None or mask.shape != features.shape[:1]:
            raise ValueError(f"an audio of input_features {tuple(features.shape)} (and input_features_mask "
                             f"{None if mask is None else tuple(mask.shape)}) does not fit this audio encoder: "
                             f"[frames, {mel}] and [frames]; process audio with the checkpoint's own processor")
        valid = mask.to(torch.long).sum()
        dtype = self.embed_audio.linear_1.weight.dtype
        return self.embed_audio(self.audio_tower(features.to(dtype), valid))


# ---- the host side ---------------------------------------------------------------------------------------------------

def feature_extractor_settings(folder: Path) -> dict:
    """The folder's ParakeetFeatureExtractor settings as transformers finds them: ``processor_config.json``'s
    ``feature_extractor`` (or ``audio_processor``) entry, else ``preprocessor_config.json`` where it names that
    class; a ValueError where neither does."""
    processor = read_json(folder / "processor_config.json")
    settings = processor.get("feature_extractor") or processor.get("audio_processor")
    if settings is None:
        settings = read_json(folder / "preprocessor_config.json")
    kind = settings.get("feature_extractor_type")
    if kind != FEATURE_EXTRACTOR:
        raise ValueError(f"the feature extractor of {folder} is {kind!r}, not {ARCH}'s {FEATURE_EXTRACTOR}: put its "
                         "settings (feature_extractor_type, feature_size, ...) under processor_config.json's "
                         "'feature_extractor', as the release's processor writes them")
    return settings


class NemotronHOmniProcessor(NemotronHOmniImageProcessor):
    """Nemotron 3 Nano Omni's host side (:class:`specray.multimodal.ImageProcessor`): its images as
    :class:`NemotronHOmniImageProcessor` makes them and, where the config has an ``audio_config``, its audio
    (``audio_token_id``, ``sampling_rate``, :meth:`process_audio`)."""

    audio_token_id = None
    sampling_rate = None

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> NemotronHOmniProcessor:
        processor = super().from_pretrained(folder, config)
        if getattr(config, "audio_config", None) is not None:
            processor.add_audio(Path(folder), config)
        return processor

    def add_audio(self, folder: Path, config: Any) -> None:
        """The audio side from the folder's feature extractor, processor settings and tokenizer."""
        from transformers import AutoTokenizer
        from transformers.models.parakeet.feature_extraction_parakeet import ParakeetFeatureExtractor

        check_audio(config)
        audio = config.audio_config
        settings = {**PROCESSOR_DEFAULTS, **{k: v for k, v in read_json(folder / "processor_config.json").items()
                                             if k in PROCESSOR_DEFAULTS}}
        self.features = ParakeetFeatureExtractor(**{k: v for k, v in feature_extractor_settings(folder).items()
                                                    if k not in ("feature_extractor_type", "processor_class")})
        rate, hop = int(settings["audio_sampling_rate"]), int(settings["audio_hop_length"])
        factor = int(settings["audio_subsampling_factor"])
        model_factor, mel = int(_get(audio, "subsampling_factor", 8)), int(_get(audio, "num_mel_bins", 80))
        disagree = [(f"the processor's audio_sampling_rate={rate}", "the feature extractor's sampling_rate",
                     self.features.sampling_rate),
                    (f"the processor's audio_hop_length={hop}", "the feature extractor's hop_length",
                     self.features.hop_length),
                    (f"the processor's audio_subsampling_factor={factor}", "audio_config.subsampling_factor",
                     model_factor),
                    (f"the feature extractor's feature_size={self.features.feature_size}", "audio_config.num_mel_bins",
                     mel)]
        for ours, theirs, value in disagree:
            if ours.rsplit("=", 1)[1] != str(value):
                raise ValueError(f"{ours} disagrees with {theirs}={value}: the prompt would hold another number of "
                                 "<so_embedding> tokens than the model embeds (or transformers refuses the audio); fix "
                                 "processor_config.json")
        if self.features.n_fft % 2:
            raise ValueError(f"the feature extractor's n_fft={self.features.n_fft} is odd: its valid frames would not "
                             "give the tokens transformers' processor counts; use an even n_fft")
        tok = AutoTokenizer.from_pretrained(folder)
        ids = special_token_ids(tok, [getattr(tok, "audio_token", None) or AUDIO_TOKENS[0], *AUDIO_TOKENS[1:]],
                                folder, f"{ARCH}'s processor")
        if ids[0] != int(config.audio_token_id or -1):
            raise ValueError(f"the tokenizer's audio token is id {ids[0]} but audio_token_id={config.audio_token_id}: "
                             "transformers fills audio_token_id's rows with the audio; fix config.json or the "
                             "tokenizer")
        self.audio_token_id, self.audio_start_id, self.audio_end_id = ids
        self.sampling_rate, self.hop, self.factor = rate, hop, factor

    def process_audio(self, waveform: np.ndarray) -> ProcessedImage:
        """One mono waveform at :attr:`sampling_rate` -> ``<so_start>``, one ``<so_embedding>`` per embedding,
        ``<so_end>``, and its features [1 + samples // hop, mel] with their valid frames' mask."""
        waveform = np.asarray(waveform, dtype=np.float32)
        if waveform.ndim != 1 or waveform.shape[0] < 2 * self.hop:
            raise ValueError(f"an audio of {list(waveform.shape)} samples is too short: the feature extractor "
                             f"normalises over its samples // {self.hop} frames, which needs at least {2 * self.hop} "
                             f"samples ({2 * self.hop / self.sampling_rate:g} s); send a longer one")
        out = self.features(waveform, sampling_rate=self.sampling_rate, return_tensors="np")
        features = np.ascontiguousarray(np.asarray(out[FEATURES], dtype=np.float32)[0])
        mask = np.asarray(out["attention_mask"])[0].astype(np.int64)
        count = max(1, subsampled(1 + waveform.shape[0] // self.hop, self.factor))  # (transformers' estimate)
        kept = subsampled(int(mask.sum()) + 1, self.factor)  # the rows transformers' model keeps
        assert count == kept == subsampled(features.shape[0], self.factor), (count, kept, features.shape)
        replacement = [self.audio_start_id] + [self.audio_token_id] * count + [self.audio_end_id]
        return ProcessedImage(replacement, {FEATURES: features, MASK: mask}, embed_rows=list(range(1, count + 1)))
