"""Whisper-style audio encoders that audio-language releases put in front of their text models (Qwen2-Audio's,
Audio Flamingo 3's, and Whisper's own encoder as Voxtral-style releases reuse it), as transformers'
``WhisperEncoder`` / ``Qwen2AudioEncoder`` / ``AudioFlamingo3Encoder`` compute them.

A window of log-mel features [mel, frames] (``frames`` = 2 x ``max_source_positions``: transformers' feature extractor
pads every window to its ``chunk_length`` seconds) goes through a conv stem, ``gelu(conv1(x))`` (kernel 3, padding 1)
then ``gelu(conv2(x))`` (kernel 3, stride 2, padding 1: half the frames), plus a learned position table
(``embed_positions``, one row per downsampled frame), then pre-LayerNorm encoder layers (``x + attn(ln(x))``, ``x +
fc2(act(fc1(ln(x))))``; bidirectional multi-head attention with biases on q, v and out but none on k, queries scaled
by ``head_dim ** -0.5``), an optional average pool of each two rows (Qwen2-Audio's and Audio Flamingo 3's
``avg_pooler``) and the final ``layer_norm``.

The padded frames of a window: transformers' models pass the feature extractor's mask (``attention_mask`` over mel
frames) as a key mask after the stem, so a window whose audio fills ``L`` mel frames has ``c = (L - 1) // 2 + 1``
valid rows, the rest masked as keys, and (pooled) ``(c - 2) // 2 + 1`` output rows taken. Here each window runs only
as far as the longest window's valid rows need (the stem reads ``2c + 1`` mel frames for ``c`` rows, padded frames
included as transformers reads them; rows past ``c`` would only ever be masked keys), the shorter windows' rows past
their own ``c`` masked as keys: the valid rows equal transformers' over the whole padded window, at a fraction of the
cost for a short audio. Without lengths (a release that attends to the padding, as Whisper itself does) every frame
runs.

:class:`AudioTowerEncoder` is a release's whole encoder (:class:`specray.multimodal.ImageEncoder` for audio): this
tower and a projector of the release's own (a subclass's ``projector`` and :meth:`AudioTowerEncoder.project`),
reading the tower under ``audio_tower.`` (``model.audio_tower.`` as transformers' modules name it) and the projector
under ``multi_modal_projector.``. The tower is replicated on every tensor-parallel rank; ``dropout``s, ``layerdrop``
and ``scale_embedding`` play no part at inference (transformers' encoders compute an embedding scale from the latter
but never apply it)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.layers import LayerNorm, _param
from specray.models.registry import text_tensors
from specray.models.vision_towers import Linear, copy_weights, vision_activation
from specray.multimodal import MultiModalItem, ProcessedImage

LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm default, which transformers' Whisper-style encoders use


def _field(config: Any, *names: str) -> Any:
    """The first of ``names`` the audio config sets (Qwen2-Audio's ``d_model``, Audio Flamingo 3's ``hidden_size``,
    ...)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    raise ValueError(f"the audio config sets none of {list(names)}; the checkpoint's config.json is not a "
                     "Whisper-style audio encoder's")


def conv_lengths(frames: Sequence[int]) -> list[int]:
    """The rows after the conv stem (stride 2) of windows of ``frames`` valid mel frames each."""
    return [(n - 1) // 2 + 1 for n in frames]


def pooled_lengths(frames: Sequence[int]) -> list[int]:
    """The rows after the stem and the average pool of two (transformers' ``_get_feat_extract_output_lengths``)."""
    return [(c - 2) // 2 + 1 for c in conv_lengths(frames)]


class WhisperAudioAttention(nn.Module):
    """Bidirectional multi-head self-attention over a window's rows: biases on q, v and out, none on k."""

    def __init__(self, hidden: int, heads: int, field: str):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"{field}: the hidden size {hidden} is not divisible by the {heads} attention heads; the "
                             "checkpoint's audio config is inconsistent")
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.v_proj, self.out_proj = Linear(hidden, hidden), Linear(hidden, hidden), Linear(hidden, hidden)
        self.k_proj = Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
        # x: [W, N, C]; keys: [W, 1, 1, N] bool (True: a valid key) or None (all valid)
        w, n, _ = x.shape
        q, k, v = (p(x).view(w, n, self.heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keys, scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(w, n, -1))


class WhisperAudioLayer(nn.Module):
    """``x + attn(self_attn_layer_norm(x))``, then ``x + fc2(act(fc1(final_layer_norm(x))))``."""

    def __init__(self, hidden: int, heads: int, ffn: int, act, field: str):
        super().__init__()
        self.self_attn_layer_norm = LayerNorm(hidden, LAYER_NORM_EPS)
        self.self_attn = WhisperAudioAttention(hidden, heads, field)
        self.final_layer_norm = LayerNorm(hidden, LAYER_NORM_EPS)
        self.fc1, self.fc2, self.act = Linear(hidden, ffn), Linear(ffn, hidden), act

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), keys)
        x = x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # (kept finite, as transformers' layers keep them in float16)
            bound = torch.finfo(torch.float16).max - 1000
            x = x.clamp(-bound, bound)
        return x


class WhisperAudioTower(nn.Module):
    """The Whisper-style encoder of ``config`` (a release's audio config; ``field`` names it in errors), its
    parameters empty until :meth:`load_weights` (named as transformers' encoder names them: ``conv1.weight``,
    ``embed_positions.weight``, ``layers.<i>.self_attn.q_proj.weight``, ``layer_norm.weight``); ``pool``: the
    average pool of two rows before the final norm (Qwen2-Audio's, Audio Flamingo 3's)."""

    def __init__(self, config: Any, pool: bool, field: str = "audio_config"):
        super().__init__()
        hidden = int(_field(config, "d_model", "hidden_size"))
        heads = int(_field(config, "encoder_attention_heads", "num_attention_heads"))
        ffn = int(_field(config, "encoder_ffn_dim", "intermediate_size"))
        layers = int(_field(config, "encoder_layers", "num_hidden_layers"))
        self.mel_bins = int(_field(config, "num_mel_bins"))
        self.positions = int(_field(config, "max_source_positions"))
        act = vision_activation(getattr(config, "activation_function", "gelu"), f"{field}.activation_function")
        self.field, self.pool, self.hidden = field, pool, hidden
        self.stem_act = F.gelu  # (the conv stem's: exact GELU whatever activation_function says, as transformers')
        self.conv1, self.conv2 = nn.Module(), nn.Module()
        self.conv1.weight, self.conv1.bias = _param(hidden, self.mel_bins, 3), _param(hidden)
        self.conv2.weight, self.conv2.bias = _param(hidden, hidden, 3), _param(hidden)
        self.embed_positions = nn.Module()
        self.embed_positions.weight = _param(self.positions, hidden)
        self.layers = nn.ModuleList(WhisperAudioLayer(hidden, heads, ffn, act, field) for _ in range(layers))
        self.layer_norm = LayerNorm(hidden, LAYER_NORM_EPS)

    @property
    def frames(self) -> int:
        """The mel frames of a window (the feature extractor's padded length): two per position."""
        return 2 * self.positions

    def out_lengths(self, frames: Sequence[int]) -> list[int]:
        """The output rows of windows of ``frames`` valid mel frames each."""
        return pooled_lengths(frames) if self.pool else conv_lengths(frames)

    def forward(self, features: torch.Tensor, frames: Sequence[int] | None = None) -> torch.Tensor:
        """``features`` [W, mel, 2 x max_source_positions] (windows of log-mel features, each padded as the feature
        extractor pads it) and per window its valid mel frames (``frames``; None: every frame valid and attended,
        as Whisper attends) -> [W, N, hidden], window i's first ``out_lengths(frames)[i]`` rows its output (N: as
        many as the longest window's; the rest of the rows are not outputs)."""
        if features.dim() != 3 or features.shape[1] != self.mel_bins or features.shape[2] != self.frames:
            raise ValueError(f"audio features of shape {list(features.shape)} reached an encoder of {self.mel_bins} "
                             f"mel bins and {self.frames} frames a window ({self.field}.num_mel_bins, 2 x "
                             f"max_source_positions); the feature extractor's feature_size and chunk_length must "
                             "match them")
        if frames is not None and not 0 < min(frames) <= max(frames) <= self.frames:
            raise ValueError(f"audio windows of {list(frames)} valid mel frames: each must hold 1 to {self.frames}")
        rows = self.positions if frames is None else max(conv_lengths(frames))
        x = features[..., : 2 * rows + 1].to(self.conv1.weight.dtype)  # (the frames the first ``rows`` rows read)
        x = self.stem_act(F.conv1d(x, self.conv1.weight, self.conv1.bias, padding=1))
        x = self.stem_act(F.conv1d(x, self.conv2.weight, self.conv2.bias, stride=2, padding=1))
        x = x[..., :rows].transpose(1, 2) + self.embed_positions.weight[:rows]
        keys = None
        if frames is not None and min(conv_lengths(frames)) < rows:
            valid = torch.tensor(conv_lengths(frames), device=x.device)
            keys = (torch.arange(rows, device=x.device) < valid[:, None])[:, None, None, :]
        for layer in self.layers:
            x = layer(x, keys)
        if self.pool:
            x = F.avg_pool1d(x.transpose(1, 2), 2, 2).transpose(1, 2)
        return self.layer_norm(x)

    def load_weights(self, weights: Iterable[tuple[str, Any]], what: str) -> None:
        """Copy ``weights`` (named as transformers' encoder names its tensors) into the tower; a ValueError names
        those of its own no tensor came for (``what``: how the error names the tower)."""
        missing = copy_weights(dict(self.named_parameters()), weights)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of {what}: {missing[:6]}; it does not "
                             "match its config.json's audio_config")


# a release's audio tensors -> ours: the releases' names (``audio_tower.``, ``multi_modal_projector.``, what
# transformers 5 saves) and transformers' modules' (``model.audio_tower.``, ``model.multi_modal_projector.``)
TOWER_AND_PROJECTOR = ((re.compile(r"^(?:model\.)?audio_tower\."), "tower."),
                       (re.compile(r"^(?:model\.)?multi_modal_projector\."), "projector."))


class AudioTowerEncoder(nn.Module):
    """A release's audio encoder (:class:`specray.multimodal.ImageEncoder` for audio items): a
    :class:`WhisperAudioTower` (``tower``) and a projector of the release's own. A subclass builds ``self.projector``
    (an ``nn.Module`` named as the checkpoint's ``multi_modal_projector``), implements :meth:`project`, and names
    ``arch`` and ``mask_key`` (the processor's name for the feature extractor's mask of an item's windows)."""

    deepstack_layers = 0
    arch = "a Whisper-style audio encoder"
    mask_key = "input_features_mask"

    def __init__(self, config: Any, pool: bool = True):
        super().__init__()
        audio = getattr(config, "audio_config", None)
        if audio is None:
            raise ValueError(f"{self.arch}'s config.json has no audio_config; the checkpoint is not an audio-language "
                             "release's")
        self.tower = WhisperAudioTower(audio, pool)

    @property
    def device(self) -> torch.device:
        return self.tower.conv1.weight.device

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The tower's tensors and the projector's among the whole checkpoint's; a ValueError names any missing."""
        ours = list(text_tensors(weights, TOWER_AND_PROJECTOR))
        self.tower.load_weights([(n[len("tower."):], t) for n, t in ours if n.startswith("tower.")],
                                f"{self.arch}'s audio encoder (audio_tower.*)")
        missing = copy_weights({n: p for n, p in self.named_parameters() if n.startswith("projector.")}, ours)
        if missing:
            raise ValueError(f"the checkpoint lacks {self.arch}'s projector tensor(s) {missing} "
                             "(multi_modal_projector.*); it does not match its config.json")

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One audio's windows (``input_features`` [W, mel, frames], the mask [W, frames] under ``mask_key``) ->
        its embeddings [rows, text hidden]: each window's valid output rows projected, in order."""
        features, mask = data["input_features"], data[self.mask_key]
        if features.dim() == 2:
            features, mask = features[None], mask[None]
        frames = mask.sum(-1).tolist()  # (once per audio, at its first prefill chunk)
        hidden = self.project(self.tower(features, frames))
        return torch.cat([h[:n] for h, n in zip(hidden, self.tower.out_lengths(frames))])


# ---- the host side: transformers' Whisper feature extractor over an audio's windows ----------------------------------

def load_feature_extractor(folder: Any, tower_config: Any, arch: str) -> Any:
    """transformers' feature extractor of the checkpoint's folder (``WhisperFeatureExtractor``: log-mel features
    padded to ``chunk_length`` seconds), checked against the encoder it feeds (``tower_config``: the audio config):
    as many mel bins, as many frames a window as two per position."""
    from transformers import AutoFeatureExtractor

    extractor = AutoFeatureExtractor.from_pretrained(folder)
    for name in ("chunk_length", "n_samples", "hop_length", "nb_max_frames", "sampling_rate", "feature_size"):
        if not hasattr(extractor, name):
            raise ValueError(f"the feature extractor of {folder} ({type(extractor).__name__}) is not a Whisper-style "
                             f"one (no {name}); {arch} is served with transformers' WhisperFeatureExtractor")
    mel = int(_field(tower_config, "num_mel_bins"))
    frames = 2 * int(_field(tower_config, "max_source_positions"))
    if extractor.feature_size != mel or extractor.nb_max_frames != frames:
        raise ValueError(f"the feature extractor of {folder} (feature_size={extractor.feature_size}, chunk_length="
                         f"{extractor.chunk_length} s: {extractor.nb_max_frames} frames) does not fit the audio "
                         f"encoder (audio_config.num_mel_bins={mel}, 2 x max_source_positions={frames} frames); fix "
                         "preprocessor_config.json to match config.json")
    return extractor


def window_features(extractor: Any, windows: list) -> dict[str, Any]:
    """The feature extractor's output for ``windows`` (1-D float32 waveforms of at most ``chunk_length`` seconds),
    each padded to the full window as transformers' audio processors ask it: ``input_features`` [W, mel, frames]
    (float32) and ``attention_mask`` [W, frames] (integers: 1 on the frames holding audio)."""
    import numpy as np

    out = extractor(windows, sampling_rate=extractor.sampling_rate, padding="max_length", return_attention_mask=True,
                    return_tensors="np")
    return {"input_features": np.ascontiguousarray(out["input_features"], dtype=np.float32),
            "attention_mask": np.ascontiguousarray(out["attention_mask"])}


def check_waveform(waveform: Any, most: int, rate: int, fix: str) -> Any:
    """``waveform`` as a 1-D float32 array of 1 to ``most`` samples at ``rate``; a ValueError otherwise (``fix``: what
    to do with a longer audio)."""
    import numpy as np

    wave = np.asarray(waveform, dtype=np.float32)
    if wave.ndim != 1 or not 0 < wave.shape[0]:
        raise ValueError(f"an audio must be a non-empty 1-D waveform (mono), not an array of shape {list(wave.shape)}")
    if wave.shape[0] > most:
        raise ValueError(f"an audio of {wave.shape[0] / rate:.2f} s ({wave.shape[0]} samples at {rate} Hz) is longer "
                         f"than this model takes ({most / rate:g} s); {fix}")
    return wave


def audio_token_count(mask: Any, extractor: Any) -> int:
    """The embeddings (placeholder tokens) of one audio whose windows' masks are ``mask`` [W, frames] (the count from
    all its valid mel frames, as transformers' audio processors count it); a ValueError for an audio too short to
    give one (transformers' processors would leave its placeholder with no token at all)."""
    frames = int(mask.sum())
    count = pooled_lengths([frames])[0]
    if count < 1:
        least = 3 * extractor.hop_length / extractor.sampling_rate
        raise ValueError(f"an audio of {frames} mel frame(s) is too short to give this model's encoder one embedding; "
                         f"send at least {least * 1000:g} ms of audio")
    return count


class WindowedAudioProcessor:
    """The host side (:class:`specray.multimodal.ImageProcessor` for audio) of a release whose processor cuts an
    audio into windows of the feature extractor's ``chunk_length`` seconds (the last one shorter; at most
    ``max_audio_len`` seconds in all: a longer audio is refused, where transformers' processors keep its first
    ``max_audio_len`` seconds), each window's features padded to the whole window (:func:`window_features`), and the
    placeholder ``config.audio_token_id`` expanded to one token per embedding (:meth:`count`, :meth:`replacement`).
    A subclass names its ``arch`` and reads its folder (``from_pretrained``)."""

    image_token_id = None  # an audio-only release: the seam refuses images by name
    arch = ""

    def __init__(self, extractor: Any, config: Any, max_audio_len: float):
        token = getattr(config, "audio_token_id", None)
        if token is None:
            raise ValueError(f"{self.arch}'s config.json sets no audio_token_id: the id of its audio placeholder is "
                             "needed")
        self.extractor = extractor
        self.audio_token_id = int(token)
        self.sampling_rate = int(extractor.sampling_rate)
        self.window = int(self.sampling_rate * extractor.chunk_length)
        self.max_windows = int(max_audio_len // extractor.chunk_length)
        if self.max_windows < 1:
            raise ValueError(f"max_audio_len={max_audio_len} (processor_config.json) is shorter than one window of "
                             f"chunk_length={extractor.chunk_length} s; set it to a multiple of chunk_length")
        self.max_audio_samples = self.max_windows * self.window

    def windows(self, waveform: Any) -> list:
        """The audio cut into windows of ``chunk_length`` seconds (the last one shorter), as transformers' processor
        cuts it; a ValueError for more than ``max_audio_len`` seconds' windows."""
        wave = check_waveform(waveform, self.max_audio_samples, self.sampling_rate,
                              "split it into parts, each its own audio (transformers' processor would keep only its "
                              "first max_audio_len seconds)")
        return [wave[start: start + self.window] for start in range(0, wave.shape[0], self.window)]

    def count(self, mask: Any) -> int:
        """The audio's embeddings from its windows' frame masks [W, frames]."""
        return audio_token_count(mask, self.extractor)

    def replacement(self, count: int) -> list[int]:
        return [self.audio_token_id] * count

    def process_audio(self, waveform: Any) -> ProcessedImage:
        """One audio (1-D float32 at ``sampling_rate``) -> its placeholder's tokens and its windows' features
        (``input_features`` [W, mel, frames], ``input_features_mask`` [W, frames])."""
        out = window_features(self.extractor, self.windows(waveform))
        count = self.count(out["attention_mask"])
        tokens = self.replacement(count)
        rows = None if len(tokens) == count else [i for i, t in enumerate(tokens) if t == self.audio_token_id]
        return ProcessedImage(tokens, {"input_features": out["input_features"],
                                       "input_features_mask": out["attention_mask"]}, rows)

    def process(self, image: Any) -> ProcessedImage:
        raise ValueError(f"{self.arch} takes audio, not images: send the prompt without images")

    def rope_positions(self, token_ids: list[int], items: list[MultiModalItem]) -> None:
        return None  # plain RoPE
