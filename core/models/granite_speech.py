"""Granite Speech's audio (``GraniteSpeechForConditionalGeneration``, transformers' ``models/granite_speech``: IBM's
granite-speech-3.x releases; and ``GraniteSpeechPlusForConditionalGeneration``, ``models/granite_speech_plus``: the
"plus" releases, whose projector also reads chosen intermediate encoder states).

Host side (:class:`GraniteSpeechAudioProcessor`): the log-mel features of ``GraniteSpeechFeatureExtractor`` redone
with torch (transformers' needs torchaudio): a centred, reflect-padded STFT with a periodic Hann window of
``win_length`` inside ``n_fft``, power 2, an HTK mel filterbank (no area norm) from 0 Hz to Nyquist, ``log10`` clipped
at 1e-10, floored at the audio's maximum less 8, then ``/ 4 + 1``; an odd last frame dropped and frames stacked in
pairs ([T / 2, 2 * n_mels]). The prompt's ``<|audio|>`` (``audio_token_index``) becomes one token per projector output,
as ``GraniteSpeechProcessor`` writes it: ``ceil(((samples // hop) + 1) // 2 / window_size) * (window_size //
downsample_rate)``.

Device side (:class:`GraniteSpeechAudioEncoder`): the CTC Conformer encoder (``input_linear``; per block ``x + ff1/2``,
``x + attn``, ``x + conv``, ``x + ff2/2`` then a LayerNorm; after block ``num_layers // 2`` the states gain
``out_mid(softmax(out(x)))``, the self-conditioning of its CTC head) and the windowed Q-former projector. The
attention is block-wise: the frames cut into blocks of ``context_size`` attending within their block only (the last
block's padding masked as keys), with Shaw's relative positions: a learned embedding per clamped distance ``i - j``
whose product with the query joins the scores (``(q.k + q.r_ij) * dim_head ** -0.5``). The conv module is pointwise
up-projection, GLU, a depthwise conv (kernel ``conv_kernel_size``, padded ``k // 2`` left and ``k // 2 - (k + 1) % 2``
right), an inference BatchNorm, SiLU and a pointwise down-projection. The projector zero-pads the encoder's frames to
whole windows of ``window_size`` and runs BLIP-2's Q-former (``blip_2_qformer``: post-norm BERT layers over
``window_size // downsample_rate`` learned queries, cross-attending to their window every ``cross_attention_frequency``
layers) per window, then one linear into the text width. The Granite text model scales the rows by its
``embedding_multiplier`` as its tokens' (``LlamaModel.embed_step``: transformers' Granite scales its whole
``inputs_embeds`` after the audio is scattered in). Each audio is encoded alone (transformers'
processor zero-pads the shorter audios of a batch, which changes the frames at their end: a lone audio's features are
what we give).

The text model is Granite (:mod:`specray.models.llama`) or Granite 4.0's hybrid (``granitemoehybrid``,
:mod:`specray.models.mamba_hybrid`) through ``registry._TEXT_PARTS`` (the releases'
``language_model.model.*`` / ``language_model.lm_head.*``, or transformers' modules' names). The releases' LoRA
adapter (``has_lora_adapter``: transformers enables it, via peft, for prompts with audio) is not applied here by
itself: a warning says so where the folder holds one; served as a LoRA request with the audio prompts it gives
transformers' outputs. The whole model's ``lm_head`` does not divide by the text config's ``logits_scaling``
(``registry._TEXT_CONFIG_FIXES`` sets it to 1, as transformers computes the logits).

Refused by name: another encoder, projector or text model type, a window not a multiple of the downsample rate, a
context wider than the relative-position table, a projector width not matching the encoder's (plus: with its
concatenated layers), a feature extractor whose window, rate or mel count disagrees with the model's, and audio too
short for the STFT's reflect padding.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specray.models.layers import LayerNorm, _param
from specray.models.vision_towers import Conv1x1, Linear, copy_weights, vision_activation
from specray.multimodal import MultiModalItem, ProcessedImage

logger = logging.getLogger(__name__)

ARCH = "GraniteSpeechForConditionalGeneration"
PLUS_ARCH = "GraniteSpeechPlusForConditionalGeneration"
ENCODER_TYPES = ("granite_speech_encoder", "granite_speech_plus_encoder")
PROJECTOR_TYPE = "blip_2_qformer"
TEXT_TYPES = ("granite", "granitemoehybrid")  # Granite 3.x; Granite 4.0 (its hybrids and their dense releases)
# GraniteSpeechFeatureExtractor's defaults (its __init__'s)
FEATURE_DEFAULTS = {"sampling_rate": 16000, "n_fft": 512, "win_length": 400, "hop_length": 160, "n_mels": 80,
                    "projector_window_size": 15, "projector_downsample_rate": 5}
TORCH_LN_EPS = 1e-5  # the encoder's nn.LayerNorm / nn.BatchNorm1d eps (transformers' defaults, not configurable)


# ---- the config ------------------------------------------------------------------------------------------------------

def _arch(config: Any) -> str:
    return PLUS_ARCH if PLUS_ARCH in (getattr(config, "architectures", None) or []) else ARCH


def _sub(config: Any, name: str, kinds: tuple[str, ...]) -> Any:
    sub = getattr(config, name, None)
    kind = getattr(sub, "model_type", None)
    if kind not in kinds:
        raise ValueError(f"{name}.model_type={kind!r} is not supported for {_arch(config)}: only {list(kinds)} "
                         f"(the Granite Speech releases'); serve this checkpoint's text alone with its text model")
    return sub


def cat_layers(config: Any) -> list[int]:
    """The plus releases' ``encoder_config.cat_hidden_layers`` (encoder states concatenated before the projector: 0
    the input projection's output, i block i's), checked; [] for the base releases."""
    encoder = config.encoder_config
    layers = list(getattr(encoder, "cat_hidden_layers", None) or [])
    if any(not isinstance(i, int) or not 0 <= i < encoder.num_layers for i in layers) or len(set(layers)) < len(
            layers):
        raise ValueError(f"encoder_config.cat_hidden_layers={layers!r} must hold distinct block indices in "
                         f"[0, {encoder.num_layers}) (encoder_config.num_layers={encoder.num_layers})")
    return sorted(layers)


def check_config(config: Any) -> None:
    """The settings this module serves (a ValueError naming the field, its value and the fix otherwise)."""
    encoder = _sub(config, "encoder_config", ENCODER_TYPES)
    projector = _sub(config, "projector_config", (PROJECTOR_TYPE,))
    _sub(config, "text_config", TEXT_TYPES)
    window, rate = int(config.window_size), int(config.downsample_rate)
    if window <= 0 or rate <= 0 or window % rate:
        raise ValueError(f"window_size={window} must be a positive multiple of downsample_rate={rate} (transformers' "
                         "projector reshapes each window's queries so); fix config.json")
    if not 0 < encoder.context_size <= encoder.max_pos_emb:
        raise ValueError(f"encoder_config.context_size={encoder.context_size} must be in (0, encoder_config."
                         f"max_pos_emb={encoder.max_pos_emb}] (its relative-position table)")
    if projector.hidden_size % projector.num_attention_heads:
        raise ValueError(f"projector_config.hidden_size={projector.hidden_size} is not divisible by projector_config."
                         f"num_attention_heads={projector.num_attention_heads}; the config is inconsistent")
    width = encoder.hidden_dim * (len(cat_layers(config)) + 1)
    if projector.encoder_hidden_size != width:
        raise ValueError(f"projector_config.encoder_hidden_size={projector.encoder_hidden_size} must equal the "
                         f"encoder's output width {width} (encoder_config.hidden_dim={encoder.hidden_dim}, times 1 + "
                         "len(cat_hidden_layers)); fix config.json")
    vision_activation(projector.hidden_act, "projector_config.hidden_act")


def num_audio_tokens(samples: int, hop: int, window: int, rate: int) -> int:
    """The projector's outputs (and the prompt's audio tokens) for ``samples`` of audio, as
    ``GraniteSpeechFeatureExtractor`` counts them: mel frames ``samples // hop + 1``, stacked in pairs, in whole
    windows of ``window`` frames giving ``window // rate`` each."""
    encoder_frames = (samples // hop + 1) // 2
    return math.ceil(encoder_frames / window) * (window // rate)


# ---- the features ----------------------------------------------------------------------------------------------------

def hz_to_mel(hz: float) -> float:
    return 2595.0 * math.log10(1.0 + hz / 700.0)  # HTK


def mel_filterbank(n_freqs: int, n_mels: int, sample_rate: int) -> torch.Tensor:
    """[n_freqs, n_mels]: triangular HTK-mel filters from 0 Hz to Nyquist, unnormalized (torchaudio's
    ``melscale_fbanks`` with its MelSpectrogram's defaults), in float32."""
    freqs = torch.linspace(0, sample_rate // 2, n_freqs)
    mels = torch.linspace(hz_to_mel(0.0), hz_to_mel(sample_rate / 2), n_mels + 2)
    edges = 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    widths = edges[1:] - edges[:-1]
    offsets = edges[None, :] - freqs[:, None]  # [n_freqs, n_mels + 2]
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    return torch.clamp(torch.minimum(rising, falling), min=0.0)


def log_mel_features(wave: np.ndarray, settings: dict[str, int]) -> np.ndarray:
    """One mono waveform [L] -> ``GraniteSpeechFeatureExtractor``'s ``input_features`` of it alone: [T / 2, 2 *
    n_mels] float32 (frames stacked in pairs, an odd last one dropped)."""
    n_fft, hop, win, n_mels = (settings[k] for k in ("n_fft", "hop_length", "win_length", "n_mels"))
    audio = torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32))
    if audio.ndim != 1 or audio.shape[0] <= n_fft // 2:
        raise ValueError(f"an audio of {tuple(audio.shape)} samples is too short (or not mono) for Granite Speech's "
                         f"features: it needs more than n_fft // 2 = {n_fft // 2} samples at "
                         f"{settings['sampling_rate']} Hz (the STFT's reflect padding); send a longer audio")
    with torch.no_grad():
        spec = torch.stft(audio, n_fft, hop, win, torch.hann_window(win), center=True, pad_mode="reflect",
                          normalized=False, onesided=True, return_complex=True).abs().pow(2.0)  # [n_fft/2+1, T]
        bank = mel_filterbank(n_fft // 2 + 1, n_mels, settings["sampling_rate"])
        mel = torch.matmul(spec.transpose(-1, -2), bank)  # [T, n_mels]
        logmel = mel.clamp(min=1e-10).log10()
        logmel = torch.maximum(logmel, logmel.max() - 8.0) / 4 + 1
        frames = logmel.shape[0] - logmel.shape[0] % 2
        return logmel[:frames].reshape(frames // 2, 2 * n_mels).numpy()


def feature_settings(folder: Path, config: Any) -> dict[str, int]:
    """The folder's ``preprocessor_config.json`` (GraniteSpeechFeatureExtractor's keys, its defaults where absent),
    checked against the model's window, downsample rate and input width."""
    path = Path(folder) / "preprocessor_config.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    settings = {**FEATURE_DEFAULTS, **saved.get("melspec_kwargs", {}), **saved}
    if "sample_rate" in saved.get("melspec_kwargs", {}):
        settings.setdefault("sampling_rate", saved["melspec_kwargs"]["sample_rate"])
    settings = {k: int(settings[k]) for k in FEATURE_DEFAULTS}
    model = {"projector_window_size": int(config.window_size),
             "projector_downsample_rate": int(config.downsample_rate)}
    for key, want in model.items():
        if settings[key] != want:
            raise ValueError(f"{path} {key}={settings[key]} disagrees with config.json's "
                             f"{'window_size' if 'window' in key else 'downsample_rate'}={want}: the prompt would get "
                             "another number of audio tokens than the projector gives; fix preprocessor_config.json")
    width = config.encoder_config.input_dim
    if 2 * settings["n_mels"] != width:
        raise ValueError(f"{path} n_mels={settings['n_mels']} gives frames of {2 * settings['n_mels']} features (two "
                         f"stacked) but encoder_config.input_dim={width}; fix preprocessor_config.json")
    if settings["win_length"] > settings["n_fft"]:
        raise ValueError(f"{path} win_length={settings['win_length']} exceeds n_fft={settings['n_fft']}")
    return settings


class GraniteSpeechAudioProcessor:
    """Granite Speech's host side (:class:`specray.multimodal.ImageProcessor`, audio only): each audio's log-mel
    features (:func:`log_mel_features`) and ``<|audio|>`` repeated :func:`num_audio_tokens` times, every one taking an
    embedding."""

    image_token_id = None  # audio only
    # the user turn beside the audio in the releases' model cards (the OpenAI server's transcriptions)
    transcription_instruction = "can you transcribe the speech into a written format?"

    def __init__(self, settings: dict[str, int], config: Any):
        check_config(config)
        self.settings = settings
        self.audio_token_id = int(config.audio_token_index)
        self.sampling_rate = settings["sampling_rate"]

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> GraniteSpeechAudioProcessor:
        folder = Path(folder)
        if getattr(config, "has_lora_adapter", False) and (folder / "adapter_config.json").is_file():
            logger.warning("%s holds the release's LoRA adapter (has_lora_adapter), which transformers enables for "
                           "prompts with audio; specray does not apply it by itself: pass it as a LoRA request with "
                           "the audio prompts (enable_lora) to serve them as the release does", folder)
        return cls(feature_settings(folder, config), config)

    def process(self, image: Any) -> ProcessedImage:
        raise ValueError("Granite Speech takes audio only, no images: send the prompt without images")

    def process_audio(self, waveform: np.ndarray) -> ProcessedImage:
        features = log_mel_features(waveform, self.settings)
        s = self.settings
        count = num_audio_tokens(int(np.shape(waveform)[0]), s["hop_length"], s["projector_window_size"],
                                 s["projector_downsample_rate"])
        return ProcessedImage([self.audio_token_id] * count, {"input_features": features})

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE


# ---- the encoder -----------------------------------------------------------------------------------------------------

class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int):
        super().__init__()
        self.pre_norm = LayerNorm(dim, TORCH_LN_EPS)
        self.up_proj, self.down_proj = Linear(dim, dim * mult), Linear(dim * mult, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(self.pre_norm(x))))


def relative_bias(q: torch.Tensor, table: torch.Tensor, context: int, max_pos: int) -> torch.Tensor:
    """Shaw's term [B, h, c, c]: each query row ``i`` times the embedding of its clamped distance ``i - j`` to key
    ``j`` (``q``: [B, h, c, d]; ``table``: [2 * max_pos + 1, d])."""
    seq = torch.arange(context, device=q.device)
    dists = (seq[:, None] - seq[None, :]).clamp(-context, context) + max_pos
    return torch.einsum("bhid,ijd->bhij", q, table[dists])


class ConformerAttention(nn.Module):
    """Block-wise self-attention with Shaw's relative positions (see the module's docstring)."""

    def __init__(self, config: Any):
        super().__init__()
        dim, self.heads, self.head_dim = config.hidden_dim, config.num_heads, config.dim_head
        inner = self.heads * self.head_dim
        self.context, self.max_pos = config.context_size, config.max_pos_emb
        self.pre_norm = LayerNorm(dim, TORCH_LN_EPS)
        self.to_q, self.to_kv = Linear(dim, inner, bias=False), Linear(dim, 2 * inner, bias=False)
        self.to_out = Linear(inner, dim)
        self.rel_pos_emb = nn.Module()
        self.rel_pos_emb.weight = _param(2 * self.max_pos + 1, self.head_dim)

    @staticmethod
    def mask_padding(bias: torch.Tensor, kept: int) -> torch.Tensor:
        """The last block's padding frames (past its first ``kept``) are no keys."""
        if kept < bias.shape[-1]:
            bias[-1, :, :, kept:] = torch.finfo(bias.dtype).min
        return bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, D] (one audio's frames) -> [N, D]
        n, c = x.shape[0], self.context
        blocks = -(-n // c)
        x = F.pad(self.pre_norm(x), (0, 0, 0, blocks * c - n))
        q = self.to_q(x).view(blocks, c, self.heads, self.head_dim).transpose(1, 2)
        k, v = (t.reshape(blocks, c, self.heads, self.head_dim).transpose(1, 2) for t in self.to_kv(x).chunk(2, -1))
        scale = self.head_dim ** -0.5
        bias = relative_bias(q, self.rel_pos_emb.weight, c, self.max_pos) * scale
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask_padding(bias, n - (blocks - 1) * c),
                                             scale=scale)
        return self.to_out(out.transpose(1, 2).reshape(blocks * c, -1)[:n])


class DepthwiseConv(nn.Module):
    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.conv = nn.Module()
        self.conv.weight = _param(channels, 1, kernel)
        self.padding = (kernel // 2, kernel // 2 - (kernel + 1) % 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [C, N] -> [C, N]
        w = self.conv.weight
        return F.conv1d(F.pad(x, self.padding)[None], w, groups=w.shape[0])[0]


class BatchNorm(nn.Module):
    """``nn.BatchNorm1d`` at inference: the checkpoint's running statistics."""

    def __init__(self, channels: int):
        super().__init__()
        self.weight, self.bias = _param(channels), _param(channels)
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [C, N]
        return F.batch_norm(x[None], self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                            TORCH_LN_EPS)[0]


class ConvModule(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        dim = config.hidden_dim
        inner = dim * config.conv_expansion_factor
        self.norm = LayerNorm(dim, TORCH_LN_EPS)
        self.up_conv, self.down_conv = Conv1x1(dim, 2 * inner), Conv1x1(inner, dim)
        self.depth_conv = DepthwiseConv(inner, config.conv_kernel_size)
        self.batch_norm = BatchNorm(inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, D] -> [N, D]
        y = F.glu(self.up_conv(self.norm(x)), dim=-1)
        y = F.silu(self.batch_norm(self.depth_conv(y.t())))
        return self.down_conv(y.t())


class ConformerBlock(nn.Module):
    half_step = 0.5  # the feed-forwards' residual weight (the Conformer's "macaron" halves)

    def __init__(self, config: Any):
        super().__init__()
        self.ff1, self.ff2 = FeedForward(config.hidden_dim, config.feedforward_mult), FeedForward(
            config.hidden_dim, config.feedforward_mult)
        self.attn, self.conv = ConformerAttention(config), ConvModule(config)
        self.post_norm = LayerNorm(config.hidden_dim, TORCH_LN_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.half_step * self.ff1(x)
        x = x + self.attn(x)
        x = x + self.conv(x)
        x = x + self.half_step * self.ff2(x)
        return self.post_norm(x)


class CTCEncoder(nn.Module):
    """The Conformer encoder (``encoder.*``): frames [N, input_dim] -> [N, hidden_dim], or for the plus releases
    the concatenation of ``cat_hidden_layers``' states and the last ([N, hidden_dim * (k + 1)])."""

    def __init__(self, config: Any, cat: list[int]):
        super().__init__()
        enc = config.encoder_config
        self.input_linear = Linear(enc.input_dim, enc.hidden_dim)
        self.layers = nn.ModuleList(ConformerBlock(enc) for _ in range(enc.num_layers))
        self.out, self.out_mid = Linear(enc.hidden_dim, enc.output_dim), Linear(enc.output_dim, enc.hidden_dim)
        self.mid, self.cat = enc.num_layers // 2, cat

    # a plus release's state of the middle block is taken after its self-conditioning (transformers adds that in place
    # to the very tensor it keeps)
    cat_after_condition = True

    def self_condition(self, x: torch.Tensor) -> torch.Tensor:
        """After the middle block: the CTC head's posteriors fed back."""
        return x + self.out_mid(torch.softmax(self.out(x), dim=-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input_linear(x)
        kept = [x] if 0 in self.cat else []
        for i, layer in enumerate(self.layers, start=1):
            x = before = layer(x)
            if i == self.mid:
                x = self.self_condition(x)
            if i in self.cat:
                kept.append(x if self.cat_after_condition else before)
        return torch.cat([*kept, x], dim=-1) if kept else x


class QFormerAttention(nn.Module):
    """BERT's attention (biases on q/k/v) and its output: ``LayerNorm(dense(attn) + x)``."""

    def __init__(self, hidden: int, source: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.attention = nn.Module()
        self.attention.query = Linear(hidden, hidden)
        self.attention.key, self.attention.value = Linear(source, hidden), Linear(source, hidden)
        self.output = nn.Module()
        self.output.dense, self.output.LayerNorm = Linear(hidden, hidden), LayerNorm(hidden, eps)

    def forward(self, x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        # x: [B, Q, H]; source: [B, S, E] -> [B, Q, H]
        a = self.attention
        b, d = x.shape[0], x.shape[-1] // self.heads
        q = a.query(x).view(b, -1, self.heads, d).transpose(1, 2)
        k, v = (p(source).view(b, -1, self.heads, d).transpose(1, 2) for p in (a.key, a.value))
        out = F.scaled_dot_product_attention(q, k, v, scale=d ** -0.5).transpose(1, 2).reshape(x.shape)
        return self.output.LayerNorm(self.output.dense(out) + x)


class QFormerLayer(nn.Module):
    def __init__(self, config: Any, cross: bool, act):
        super().__init__()
        hidden, heads, eps = config.hidden_size, config.num_attention_heads, config.layer_norm_eps
        self.attention = QFormerAttention(hidden, hidden, heads, eps)
        self.crossattention = QFormerAttention(hidden, config.encoder_hidden_size, heads, eps) if cross else None
        self.intermediate_query = nn.Module()
        self.intermediate_query.dense = Linear(hidden, config.intermediate_size)
        self.output_query = nn.Module()
        self.output_query.dense = Linear(config.intermediate_size, hidden)
        self.output_query.LayerNorm = LayerNorm(hidden, eps)
        self.act = act

    def forward(self, x: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, x)
        if self.crossattention is not None:
            x = self.crossattention(x, windows)
        out = self.output_query
        return out.LayerNorm(out.dense(self.act(self.intermediate_query.dense(x))) + x)


class Projector(nn.Module):
    """The windowed Q-former projector (``projector.*``): encoder frames [N, E] -> [ceil(N / window) * queries, text
    hidden]."""

    def __init__(self, config: Any):
        super().__init__()
        qf = config.projector_config
        self.window, self.queries = int(config.window_size), int(config.window_size) // int(config.downsample_rate)
        self.query = _param(1, self.queries, qf.hidden_size)
        self.qformer = nn.Module()
        self.qformer.layernorm = LayerNorm(qf.hidden_size, qf.layer_norm_eps)
        act = vision_activation(qf.hidden_act, "projector_config.hidden_act")
        self.qformer.encoder = nn.Module()
        self.qformer.encoder.layer = nn.ModuleList(QFormerLayer(qf, i % qf.cross_attention_frequency == 0, act)
                                                   for i in range(qf.num_hidden_layers))
        self.linear = Linear(qf.hidden_size, config.text_config.hidden_size)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        n, width = frames.shape
        blocks = -(-n // self.window)
        windows = F.pad(frames, (0, 0, 0, blocks * self.window - n)).view(blocks, self.window, width)
        x = self.qformer.layernorm(self.query.to(frames.dtype)).expand(blocks, -1, -1)
        for layer in self.qformer.encoder.layer:
            x = layer(x, windows)
        return self.linear(x.reshape(blocks * self.queries, -1))


class GraniteSpeechAudioEncoder(nn.Module):
    """Granite Speech's encoder and projector (:class:`specray.multimodal.ImageEncoder` for audio), built from the
    whole checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        check_config(config)
        self.arch = _arch(config)
        self.encoder = CTCEncoder(config, cat_layers(config))
        self.projector = Projector(config)

    @property
    def device(self) -> torch.device:
        return self.projector.linear.weight.device

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The encoder's and projector's tensors (the releases' ``encoder.*`` / ``projector.*`` or transformers'
        modules' ``model.encoder.*`` / ``model.projector.*``); a ValueError names any of ours missing. The
        BatchNorms' ``num_batches_tracked`` and a Q-former's text-input layers are not read."""
        ours = dict(self.named_parameters())
        ours.update((n, b) for n, b in self.named_buffers() if n.endswith(("running_mean", "running_var")))

        def renamed():
            for name, tensor in weights:
                if name.startswith("model."):
                    name = name[len("model."):]
                if name.startswith(("encoder.", "projector.")):
                    yield name, tensor

        missing = copy_weights(ours, renamed())
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of {self.arch}'s audio encoder or "
                             f"projector: {missing[:8]}; it does not match its config.json (encoder_config, "
                             "projector_config, window_size, downsample_rate)")

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One audio's ``input_features`` [T, 2 * n_mels] (or [1, T, 2 * n_mels]) -> its embeddings [tokens, text
        hidden] (the Granite text model scales them by its ``embedding_multiplier`` as its tokens')."""
        features = data["input_features"]
        if features.dim() == 3:
            features = features[0]
        dtype = self.projector.linear.weight.dtype
        return self.projector(self.encoder(features.to(dtype)))
