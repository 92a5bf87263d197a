"""Phi-4-multimodal's audio (``Phi4MultimodalForCausalLM``, transformers' layout of
microsoft/Phi-4-multimodal-instruct: ``model.embed_tokens_extend.audio_embed.*``): speech in prompts for its text
model (:mod:`specray.models.phi4_multimodal`).

Host side (:class:`Phi4MultimodalAudioProcessor`): transformers' ``Phi4MultimodalFeatureExtractor`` of the folder
(its defaults, which are the release's settings, where the folder has none) gives each audio's log-mel frames [T,
``input_size``] alone (it pads a batch to its longest); the prompt's ``<|audio|>`` (``audio_config.audio_token_id``)
becomes ``ceil(T / audio_compression_rate)`` tokens, as the extractor's ``audio_embed_sizes`` counts them.

Device side (:class:`Phi4MultimodalAudioEncoder`): the frames normalised by the checkpoint's ``global_mean`` /
``global_invstd``, then NeMo's convolutional subsampling (a 3x3 conv of stride 2, then per further halving a depthwise
3x3 conv of stride 2 and a pointwise one, ``time_reduction`` in all; the channels and the remaining mel bins flattened
into one linear), then Conformer blocks: ``x + ff_in(x) / 2``, a LayerNorm, ``+ attention``, ``+ conv``, ``+ ff_out /
2``, a LayerNorm. The feed-forwards are pre-normed gated linears (``up * act(gate)``); the attention is bidirectional
with a learned bias per head and clamped relative distance (``bias_max_distance``); the conv
module is a pre-normed pointwise GLU with its own two biases, a causal depthwise conv (``kernel_size``), the
activation and a pointwise conv. The rows attend in chunks of 500 (transformers' ``max_seq_len``): a longer audio is
zero-padded to whole chunks and each chunk, its padding included, attends within itself. Then the speech projector
(``up_proj_for_speech``, GELU, ``down_proj_for_speech``) into the text width.

transformers' quirks kept, so that the rows equal its: the attention's mask is its boolean streaming mask *added* to
the relative bias (so an allowed key gets +1, a masked one +0: nothing is masked; for one audio with ``chunk_size``
-1, the releases', every key is allowed and the +1 cancels in the softmax), and padded rows of the last chunk are keys
as any other. The release's speech LoRA adapter (its ``speech-lora`` folder) is not applied by itself: transformers'
model runs without it unless one loads it; serve it as a LoRA request with the audio prompts, as the release's own
code applies it.

Refused by name: ``downsample_rate`` other than 1 (transformers' projector would not fit its encoder), a symmetric
bias table (transformers indexes one row past it for distant rows), widths of the
conv module other than the hidden size, a ``nemo_final_size`` the subsampling does not give, a ``time_reduction``
that is no power of two, an activation we lack, audio too short for one frame (``win_length`` samples), images
(Phi-4-multimodal's vision is not served).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.layers import LayerNorm, _param
from specray.models.vision_towers import VISION_ACTIVATIONS, Conv1x1, Linear, copy_weights
from specray.multimodal import MultiModalItem, ProcessedImage

ARCH = "Phi4MultimodalForCausalLM"
PREFIX = "model.embed_tokens_extend.audio_embed."  # the audio encoder and its projectors in the checkpoint
CHUNK_ROWS = 500  # transformers' max_seq_len: longer audio attends in chunks of this many subsampled rows
TORCH_LN_EPS = 1e-5  # nn.LayerNorm's default, which the encoder keeps
ACTIVATIONS = {**VISION_ACTIVATIONS, "swish": F.silu, "sigmoid": torch.sigmoid}


def _activation(config: Any, field: str):
    name = getattr(config, field)
    if name not in ACTIVATIONS:
        raise ValueError(f"audio_config.{field}={name!r} is not supported for {ARCH}; use one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def subsampled_bins(bins: int, halvings: int) -> int:
    """The mel bins left after ``halvings`` convs of kernel 3, stride 2, padding 1."""
    for _ in range(halvings):
        bins = (bins - 1) // 2 + 1
    return bins


def check_audio_config(config: Any) -> Any:
    """The whole config's ``audio_config``, or a ValueError for what transformers' encoder and projector would not
    run."""
    audio = getattr(config, "audio_config", None)
    if audio is None:
        raise ValueError(f"{ARCH}'s config.json has no audio_config: its audio encoder cannot be built")
    if audio.downsample_rate != 1:
        raise ValueError(f"audio_config.downsample_rate={audio.downsample_rate} is not supported: transformers' speech "
                         "projector reads hidden_size * downsample_rate features from an encoder that gives "
                         "hidden_size; only 1 runs")
    for field in ("ext_pw_out_channel", "depthwise_separable_out_channel"):
        if getattr(audio, field) != audio.hidden_size:
            raise ValueError(f"audio_config.{field}={getattr(audio, field)} must equal audio_config.hidden_size="
                             f"{audio.hidden_size}: the conv module's widths meet the residual stream")
    reduction = audio.time_reduction
    if reduction < 2 or reduction & (reduction - 1):
        raise ValueError(f"audio_config.time_reduction={reduction} must be a power of two >= 2 (the subsampling halves "
                         "the frames once per conv)")
    bins = subsampled_bins(audio.input_size, int(math.log2(reduction)))
    if bins != audio.nemo_final_size:
        raise ValueError(f"audio_config.nemo_final_size={audio.nemo_final_size} but the subsampling leaves {bins} of "
                         f"input_size={audio.input_size} mel bins; set it to {bins}")
    if audio.bias_symmetric:
        raise ValueError("audio_config.bias_symmetric=true is not supported: transformers' table of max_distance rows "
                         "is indexed by |distance| up to max_distance, one past its end, once an audio's rows reach "
                         "that far (the releases' table is asymmetric)")
    for field in ("activation", "conv_activation", "conv_glu_type", "nemo_activation"):
        _activation(audio, field)
    return audio


# ---- the host side ---------------------------------------------------------------------------------------------------

class Phi4MultimodalAudioProcessor:
    """Phi-4-multimodal's host side for audio (:class:`specray.multimodal.ImageProcessor`): see the module
    docstring."""

    image_token_id = None  # its vision tower is not served: the seam refuses images by name

    def __init__(self, extractor: Any, config: Any):
        audio = check_audio_config(config)
        if extractor.feature_size != audio.input_size:
            raise ValueError(f"the feature extractor's feature_size={extractor.feature_size} differs from "
                             f"audio_config.input_size={audio.input_size}; use the release's preprocessor_config.json")
        if extractor.audio_compression_rate != audio.time_reduction or extractor.audio_downsample_rate != 1:
            raise ValueError(f"the feature extractor's audio_compression_rate={extractor.audio_compression_rate} and "
                             f"audio_downsample_rate={extractor.audio_downsample_rate} must be audio_config."
                             f"time_reduction={audio.time_reduction} and 1: the prompt would hold another number of "
                             "audio tokens than the encoder gives rows")
        self.extractor = extractor
        self.audio_token_id = int(audio.audio_token_id)
        self.sampling_rate = int(extractor.sampling_rate)

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> Phi4MultimodalAudioProcessor:
        from transformers import Phi4MultimodalFeatureExtractor

        folder = Path(folder)
        if (folder / "preprocessor_config.json").is_file():
            extractor = Phi4MultimodalFeatureExtractor.from_pretrained(str(folder))
        else:  # its defaults are the release's settings
            extractor = Phi4MultimodalFeatureExtractor(feature_size=check_audio_config(config).input_size)
        return cls(extractor, config)

    def process(self, image: Any) -> ProcessedImage:
        raise ValueError(f"{ARCH}'s images are not served (only its audio): send the prompt without images")

    def process_audio(self, waveform: np.ndarray) -> ProcessedImage:
        """One audio (1-D float32 at ``sampling_rate``) -> its ``<|audio|>`` tokens and features [T, input_size]."""
        wave = np.asarray(waveform, dtype=np.float32)
        least = int(self.extractor.win_length)
        if wave.ndim != 1 or wave.shape[0] < least:
            raise ValueError(f"an audio of {list(wave.shape)} samples: give a mono waveform of at least {least} "
                             f"samples ({least / self.sampling_rate * 1000:g} ms, one frame of the feature extractor)")
        out = self.extractor(wave, sampling_rate=self.sampling_rate, return_tensors="np")
        features = np.ascontiguousarray(out["audio_input_features"][0], dtype=np.float32)
        count = int(out["audio_embed_sizes"][0])
        return ProcessedImage([self.audio_token_id] * count, {"input_features": features})

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE


# ---- the encoder -----------------------------------------------------------------------------------------------------

class Subsampling(nn.Module):
    """NeMo's striding subsampling: frames [T, F] -> rows [ceil(T / time_reduction), hidden]."""

    def __init__(self, audio: Any):
        super().__init__()
        channels, self.act = audio.nemo_conv_channels, _activation(audio, "nemo_activation")
        self.conv = nn.Module()  # transformers' Sequential: conv at 0, then per halving (depthwise, pointwise, act)
        first = nn.Module()
        first.weight, first.bias = _param(channels, 1, 3, 3), _param(channels)
        self.conv.add_module("0", first)
        self.halvings = int(math.log2(audio.time_reduction))
        for i in range(1, self.halvings):
            depthwise = nn.Module()
            depthwise.weight, depthwise.bias = _param(channels, 1, 3, 3), _param(channels)
            self.conv.add_module(str(3 * i - 1), depthwise)
            self.conv.add_module(str(3 * i), Conv1x1(channels, channels, dims=2))
        self.out = Linear(channels * audio.nemo_final_size, audio.hidden_size)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        first = self.conv.get_submodule("0")
        x = self.act(F.conv2d(frames[None, None], first.weight, first.bias, stride=2, padding=1))  # [1, C, T, F]
        for i in range(1, self.halvings):
            depthwise = self.conv.get_submodule(str(3 * i - 1))
            x = F.conv2d(x, depthwise.weight, depthwise.bias, stride=2, padding=1, groups=x.shape[1])
            x = self.act(self.conv.get_submodule(str(3 * i))(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))
        t = x.shape[2]
        return self.out(x[0].transpose(0, 1).reshape(t, -1))  # channels then bins, per row


class FeedForward(nn.Module):
    def __init__(self, audio: Any):
        super().__init__()
        self.layer_norm = LayerNorm(audio.hidden_size, TORCH_LN_EPS)
        self.gate_up_proj = Linear(audio.hidden_size, 2 * audio.intermediate_size)
        self.down_proj = Linear(audio.intermediate_size, audio.hidden_size)
        self.act = _activation(audio, "activation")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.gate_up_proj(self.layer_norm(x)).chunk(2, dim=-1)
        return self.down_proj(up * self.act(gate))


class Attention(nn.Module):
    def __init__(self, audio: Any):
        super().__init__()
        width, self.heads = audio.hidden_size, audio.num_attention_heads
        self.head_dim = width // self.heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # x: [N, L, H]; bias: [1, heads, L, L] (the relative bias, plus transformers' +1 of its mask)
        n, length, _ = x.shape
        q, k, v = (p(x).view(n, length, self.heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=self.head_dim ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(n, length, -1))


class GluPointwise(nn.Module):
    def __init__(self, audio: Any):
        super().__init__()
        width = audio.ext_pw_out_channel
        self.ext_pw_conv_1d = Conv1x1(audio.hidden_size, 2 * width)
        self.b1, self.b2 = _param(1, width, 1), _param(1, width, 1)
        self.act = _activation(audio, "conv_glu_type")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.ext_pw_conv_1d(x).chunk(2, dim=-1)
        return (a + self.b1[0, :, 0]) * self.act(b + self.b2[0, :, 0])


class ConvModule(nn.Module):
    def __init__(self, audio: Any):
        super().__init__()
        width, self.kernel = audio.hidden_size, audio.kernel_size
        self.layer_norm = LayerNorm(width, TORCH_LN_EPS)
        self.glu = GluPointwise(audio)
        self.dw_sep_conv_1d = nn.Module()
        self.dw_sep_conv_1d.dw_conv = nn.Module()
        inner = width * audio.depthwise_multiplier
        self.dw_sep_conv_1d.dw_conv.weight = _param(inner, 1, self.kernel)
        self.dw_sep_conv_1d.dw_conv.bias = _param(inner)
        self.dw_sep_conv_1d.pw_conv = Conv1x1(inner, audio.depthwise_separable_out_channel)
        self.act = _activation(audio, "conv_activation")
        self.ext_pw_conv_1d = Conv1x1(audio.hidden_size, audio.ext_pw_out_channel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, L, H]; the depthwise conv causal: padded k - 1 on the left (transformers pads both sides, then drops
        # the last k - 1 outputs)
        y = self.glu(self.layer_norm(x)).transpose(1, 2)  # [N, H, L]
        dw = self.dw_sep_conv_1d.dw_conv
        y = F.conv1d(F.pad(y, (self.kernel - 1, 0)), dw.weight, dw.bias, groups=y.shape[1]).transpose(1, 2)
        return self.ext_pw_conv_1d(self.act(self.dw_sep_conv_1d.pw_conv(y)))


class ConformerBlock(nn.Module):
    def __init__(self, audio: Any):
        super().__init__()
        self.feed_forward_in, self.feed_forward_out = FeedForward(audio), FeedForward(audio)
        self.self_attn = Attention(audio)
        self.conv = ConvModule(audio)
        self.layer_norm_att = LayerNorm(audio.hidden_size, TORCH_LN_EPS)
        self.layer_norm = LayerNorm(audio.hidden_size, TORCH_LN_EPS)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        residual = x + 0.5 * self.feed_forward_in(x)
        x = residual + self.self_attn(self.layer_norm_att(residual), bias)
        x = x + self.conv(x)
        x = x + 0.5 * self.feed_forward_out(x)
        return self.layer_norm(x)


class AudioModel(nn.Module):
    """transformers' ``Phi4MultimodalAudioModel`` for one audio: frames [T, input_size] -> rows [ceil(T /
    time_reduction), hidden]."""

    def __init__(self, audio: Any):
        super().__init__()
        self.encoder_embedding = nn.Module()
        self.encoder_embedding.register_buffer("global_mean", torch.zeros(audio.input_size))
        self.encoder_embedding.register_buffer("global_invstd", torch.ones(audio.input_size))
        self.embed = Subsampling(audio)
        self.relative_attention_bias_layer = nn.Module()
        self.relative_attention_bias_layer.bias_values = nn.Embedding(2 * audio.bias_max_distance,
                                                                      audio.num_attention_heads)
        self.relative_attention_bias_layer.bias_values.weight.requires_grad_(False)
        self.encoders = nn.ModuleList(ConformerBlock(audio) for _ in range(audio.num_blocks))
        self.max_distance = audio.bias_max_distance
        self.chunk_size, self.left_chunk = audio.chunk_size, audio.left_chunk

    def bias(self, length: int, device: torch.device) -> torch.Tensor:
        """[1, heads, L, L]: each head's learned bias of the distance ``j - i`` clamped to [-max_distance,
        max_distance), plus transformers' +1 where its streaming mask allows the pair (added, not applied: see the
        module docstring)."""
        pos = torch.arange(length, device=device)
        distance = (pos[None, :] - pos[:, None]).clamp(-self.max_distance, self.max_distance - 1)
        bias = self.relative_attention_bias_layer.bias_values(distance + self.max_distance).permute(2, 0, 1)[None]
        return self.streaming_mask(length, device)[None, None] + bias

    def streaming_mask(self, length: int, device: torch.device) -> torch.Tensor:
        """transformers' ``adaptive_enc_mask`` [L, L] bool for chunks of ``chunk_size`` rows seeing ``left_chunk``
        chunks back (``chunk_size`` < 1: one chunk, all True)."""
        if self.chunk_size < 1:
            return torch.ones(length, length, dtype=torch.bool, device=device)
        chunk = torch.arange(length, device=device) // self.chunk_size
        return (chunk[None, :] >= (chunk[:, None] - self.left_chunk).clamp(min=0)) & (chunk[None, :] <= chunk[:, None])

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        norm = self.encoder_embedding
        x = self.embed((frames - norm.global_mean) * norm.global_invstd)  # [T', H]
        rows = x.shape[0]
        length = min(rows, CHUNK_ROWS)
        chunks = -(-rows // length)
        x = F.pad(x, (0, 0, 0, chunks * length - rows)).view(chunks, length, -1)
        bias = self.bias(length, x.device)
        for block in self.encoders:
            x = block(x, bias)
        return x.reshape(chunks * length, -1)[:rows]


class Phi4MultimodalAudioEncoder(nn.Module):
    """Phi-4-multimodal's audio encoder and speech projector (:class:`specray.multimodal.ImageEncoder` for audio),
    built from the whole checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        audio = check_audio_config(config)
        self.encoder = AudioModel(audio)
        self.up_proj_for_speech = Linear(audio.hidden_size, config.hidden_size)
        self.down_proj_for_speech = Linear(config.hidden_size, config.hidden_size)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The encoder's and speech projector's tensors under ``model.embed_tokens_extend.audio_embed.`` (the
        vision-speech projector and the image encoder not read); a ValueError names any of ours missing."""
        ours = dict(self.named_parameters())
        ours.update(self.named_buffers())
        missing = copy_weights(ours, ((n[len(PREFIX):], t) for n, t in weights if n.startswith(PREFIX)))
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of {ARCH}'s audio encoder or speech "
                             f"projector: {missing[:8]} (under {PREFIX}); it does not match its config.json's "
                             "audio_config")

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One audio's ``input_features`` [T, input_size] -> its embeddings [ceil(T / time_reduction), text
        hidden]."""
        frames = data["input_features"]
        weight = self.down_proj_for_speech.weight
        rows = self.encoder(frames.to(device=weight.device, dtype=weight.dtype))
        return self.down_proj_for_speech(F.gelu(self.up_proj_for_speech(rows)))
