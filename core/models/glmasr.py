"""GLM-ASR's audio (``GlmAsrForConditionalGeneration``, transformers' ``models/glmasr``: GLM-ASR-Nano-2512): a
Whisper-style audio encoder with rotary positions, a two-layer projector, and a Llama text model served through
``registry._TEXT_PARTS``.

The host side (:class:`GlmAsrAudioProcessor`, transformers' ``GlmAsrProcessor``'s work for one audio): the waveform
is cut into windows of the feature extractor's ``chunk_length`` seconds (at most ``max_audio_len`` seconds of them:
a longer audio is refused, where transformers' processor keeps its first ``max_audio_len`` seconds;
:class:`specray.models.whisper_audio.WindowedAudioProcessor`, shared with Audio Flamingo 3), each window becomes its
log-mel features padded to the window's frames (transformers' ``WhisperFeatureExtractor`` of the folder, with the
frames' mask), and the placeholder (``audio_token``, ``<|pad|>``; ``config.audio_token_id``) becomes one copy of
itself per audio embedding: the audio's frames (summed over its windows) through the encoder's two convolutions
(stride 1, then 2) and the merge of four frames, ``((frames + 1) // 2 - 4) // 4 + 1``.

The device side (:class:`GlmAsrAudioEncoder`), per window (the windows of an audio a batch): ``gelu(conv1)``,
``gelu(conv2)`` (stride 2: frames halved), then pre-norm encoder layers (LayerNorm, bidirectional attention over the
window's frames with RoPE on the first ``partial_rotary_factor`` of each head (half), grouped key/value heads,
biases on q / v / o but not k; LayerNorm, ``fc2(act(fc1))``), a final LayerNorm; every four consecutive frames are
concatenated (``intermediate_size`` = 4 x ``hidden_size`` wide) and projected (``linear_2(act(linear_1(x)))``, into
the text hidden size); of each window the rows its mask's frames give are kept, windows in order. The encoder runs
over the padded frames of a window (as transformers' does: the padding's features shape the kept rows); every
window is padded to ``chunk_length``, so an audio's embeddings depend on its own samples only.

A prompt may hold several audios: each placeholder is expanded on its own and the model takes their rows in order, as
transformers' whole model does (its ``GlmAsrProcessor`` takes one audio per text only).

Compared with the Whisper-style encoders of :mod:`specray.models.whisper_audio` (Qwen2-Audio's, Audio Flamingo
3's): the same conv stem and pre-norm layers (GLM-ASR's tensors are Whisper's renamed: ``input_layernorm`` /
``post_attention_layernorm`` / ``mlp.fc1`` / ``o_proj``), but rotary positions in each attention instead of a
position table added after the stem, grouped key/value heads, the padded frames attended (transformers' GLM-ASR
masks no keys, so the whole padded window runs), no average pool, and the four-frame merge before the projector.

The checkpoint's tensors are read in either layout: the release's (``audio_tower.*``, ``multi_modal_projector.*``,
the text under ``language_model.model.*``, what transformers saves) and transformers' modules'
(``model.audio_tower.*``, ...). Refused by name: another rope type in the encoder, an ``intermediate_size`` other
than four hidden sizes (the merge), unknown activations, a feature extractor whose mel bins differ from the
encoder's or whose windows' frames are not a multiple of 8 (transformers' merge would not fit them), a processor
whose ``audio_token`` is not ``config.audio_token_id``, images, and an audio too short to give one embedding."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.layers import LayerNorm, RotaryEmbedding, _param, apply_rotary, rope_parameters, rotary_dim
from specray.models.registry import text_tensors
from specray.models.vision_towers import Linear, VisionMLP, copy_weights, vision_activation
from specray.models.whisper_audio import TOWER_AND_PROJECTOR, WindowedAudioProcessor

ARCH = "GlmAsrForConditionalGeneration"
MERGE = 4  # consecutive encoder frames concatenated into one projector input (transformers' merge_factor)
LAYER_NORM_EPS = 1e-5  # the encoder's LayerNorms (transformers' nn.LayerNorm default)

# the release's tensors (and what transformers saves): ``audio_tower.``, ``multi_modal_projector.``; transformers'
# modules': ``model.audio_tower.``, ``model.multi_modal_projector.``
def audio_embeds(frames: int) -> int:
    """The embeddings of ``frames`` log-mel frames: after conv1 (stride 1) and conv2 (stride 2, padding 1) and the
    merge of four frames (0 for an audio too short to fill one)."""
    halved = (frames - 1) // 2 + 1
    return max(0, (halved - MERGE) // MERGE + 1)


def _audio_config(config: Any) -> Any:
    audio = getattr(config, "audio_config", None)
    if audio is None:
        raise ValueError(f"{ARCH}'s config.json has no audio_config; the checkpoint is not a GLM-ASR release")
    hidden, heads = audio.hidden_size, audio.num_attention_heads
    if audio.intermediate_size != MERGE * hidden:
        raise ValueError(f"audio_config.intermediate_size={audio.intermediate_size} is not supported for {ARCH}: "
                         f"the projector reads {MERGE} merged frames of audio_config.hidden_size={hidden}, so it must "
                         f"be {MERGE * hidden} (transformers' merge would misalign otherwise)")
    kv = getattr(audio, "num_key_value_heads", None) or heads
    if heads % kv:
        raise ValueError(f"audio_config.num_attention_heads={heads} is not a multiple of audio_config."
                         f"num_key_value_heads={kv}; the checkpoint's audio config is inconsistent")
    params = rope_parameters(audio, partial=True)
    if params["rope_type"] != "default":
        raise ValueError(f"audio_config.rope_parameters rope_type={params['rope_type']!r} is not supported for "
                         f"{ARCH}'s audio encoder: only 'default' RoPE (GLM-ASR-Nano-2512's)")
    return audio


class GlmAsrAttention(nn.Module):
    """Bidirectional self-attention over a window's frames: RoPE on each head's first rotated features, grouped
    key/value heads, biases on q, v and o (none on k)."""

    def __init__(self, audio: Any):
        super().__init__()
        hidden = audio.hidden_size
        self.heads = audio.num_attention_heads
        self.kv_heads = getattr(audio, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(audio, "head_dim", None) or hidden // self.heads
        self.q_proj = Linear(hidden, self.heads * self.head_dim)
        self.k_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(hidden, self.kv_heads * self.head_dim)
        self.o_proj = Linear(self.heads * self.head_dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [W, T, C] (W windows of T frames); cos, sin: [T, 1, R/2] -> [W, T, C]
        w, t, _ = x.shape
        q = apply_rotary(self.q_proj(x).view(w, t, self.heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(w, t, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(w, t, self.kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             scale=self.head_dim ** -0.5, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(w, t, -1))


class GlmAsrEncoderLayer(nn.Module):
    """``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, audio: Any):
        super().__init__()
        hidden = audio.hidden_size
        self.input_layernorm = LayerNorm(hidden, LAYER_NORM_EPS)
        self.post_attention_layernorm = LayerNorm(hidden, LAYER_NORM_EPS)
        self.self_attn = GlmAsrAttention(audio)
        self.mlp = VisionMLP(hidden, audio.intermediate_size,
                             vision_activation(audio.hidden_act, "audio_config.hidden_act"))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class GlmAsrAudioTower(nn.Module):
    """The audio encoder (transformers' ``GlmAsrEncoder``): two convolutions, the layers, a final LayerNorm."""

    def __init__(self, audio: Any):
        super().__init__()
        hidden, mels = audio.hidden_size, audio.num_mel_bins
        self.conv1, self.conv2 = nn.Module(), nn.Module()
        self.conv1.weight, self.conv1.bias = _param(hidden, mels, 3), _param(hidden)
        self.conv2.weight, self.conv2.bias = _param(hidden, hidden, 3), _param(hidden)
        self.layers = nn.ModuleList(GlmAsrEncoderLayer(audio) for _ in range(audio.num_hidden_layers))
        self.norm = LayerNorm(hidden, LAYER_NORM_EPS)
        self.conv_act = F.gelu  # the convolutions' (exact GELU whatever hidden_act says, as transformers')
        params = rope_parameters(audio, partial=True)
        head_dim = self.layers[0].self_attn.head_dim if self.layers else hidden // audio.num_attention_heads
        self.rotary = RotaryEmbedding(rotary_dim(head_dim, params), params, audio.max_position_embeddings)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # features: [W, mels, F] -> [W, F / 2, hidden]
        x = self.conv_act(F.conv1d(features, self.conv1.weight, self.conv1.bias, padding=1))
        x = self.conv_act(F.conv1d(x, self.conv2.weight, self.conv2.bias, stride=2, padding=1)).transpose(1, 2)
        frames = x.shape[1]
        self.rotary.ensure(frames)
        cos, sin = self.rotary(torch.arange(frames, device=x.device), x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class GlmAsrAudioEncoder(nn.Module):
    """GLM-ASR's audio encoder and projector (:class:`specray.multimodal.ImageEncoder` for audio items), built from
    the whole checkpoint's config; replicated on every tensor-parallel rank."""

    deepstack_layers = 0

    def __init__(self, config: Any):
        super().__init__()
        audio = _audio_config(config)
        text_hidden = config.text_config.hidden_size
        self.tower = GlmAsrAudioTower(audio)
        self.projector = nn.Module()
        self.projector.linear_1 = Linear(audio.intermediate_size, 2 * text_hidden)
        self.projector.linear_2 = Linear(2 * text_hidden, text_hidden)
        self.act = vision_activation(getattr(config, "projector_hidden_act", "gelu"), "projector_hidden_act")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The audio tower's and the projector's tensors among the whole checkpoint's (either layout); a ValueError
        names any of ours missing."""
        missing = copy_weights(dict(self.named_parameters()), text_tensors(weights, TOWER_AND_PROJECTOR))
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) of {ARCH}'s audio encoder or projector "
                             f"(audio_tower.*, multi_modal_projector.*): {missing[:6]}; it does not match its "
                             "config.json's audio_config")

    @property
    def device(self) -> torch.device:
        return self.projector.linear_1.weight.device

    @staticmethod
    def merge(hidden: torch.Tensor) -> torch.Tensor:
        # [W, T, C] -> [W, T / 4, 4C]: each four consecutive frames side by side, the first leftmost
        return hidden.reshape(hidden.shape[0], -1, MERGE * hidden.shape[-1])

    def encode(self, data: dict[str, Any]) -> torch.Tensor:
        """One audio's ``input_features`` [windows, mels, frames] and ``input_features_mask`` [windows, frames] ->
        its embeddings [audio_embeds(frames), text hidden size], the windows' kept rows in order."""
        if "input_features" not in data:
            raise ValueError(f"{ARCH} takes audio only; this item holds {sorted(data)}")
        features, mask = data["input_features"], data["input_features_mask"]
        if features.dim() == 2:
            features, mask = features[None], mask[None]
        hidden = self.tower(features.to(self.projector.linear_1.weight.dtype))
        embeds = self.projector.linear_2(self.act(self.projector.linear_1(self.merge(hidden))))
        halved = (mask.sum(-1) - 1) // 2 + 1
        kept = (halved - MERGE) // MERGE + 1
        rows = torch.arange(embeds.shape[1], device=embeds.device)[None] < kept.to(embeds.device)[:, None]
        return embeds[rows]


class GlmAsrAudioProcessor(WindowedAudioProcessor):
    """GLM-ASR's host side: transformers' feature extractor of the checkpoint's folder makes each window's features;
    the placeholder ``config.audio_token_id`` becomes :func:`audio_embeds` copies of itself, as ``GlmAsrProcessor``
    writes them."""

    arch = ARCH
    # the user turn beside the audio in transformers' apply_transcription_request (the OpenAI server's transcriptions)
    transcription_instruction = "Please transcribe this audio into text"

    def __init__(self, feature_extractor: Any, config: Any, max_audio_len: float):
        super().__init__(feature_extractor, config, max_audio_len)
        frames = self.window // feature_extractor.hop_length
        if frames % (2 * MERGE):
            raise ValueError(f"the feature extractor's windows of chunk_length={feature_extractor.chunk_length} s "
                             f"hold {frames} frames (hop_length={feature_extractor.hop_length}), not a multiple of "
                             f"{2 * MERGE}: {ARCH}'s encoder halves them and merges {MERGE}, which would not fit; "
                             "use the release's chunk_length (30)")
        mels = _audio_config(config).num_mel_bins
        if feature_extractor.feature_size != mels:
            raise ValueError(f"the feature extractor's feature_size={feature_extractor.feature_size} differs from "
                             f"audio_config.num_mel_bins={mels}; the checkpoint's folder is inconsistent")

    @classmethod
    def from_pretrained(cls, folder: Path, config: Any) -> GlmAsrAudioProcessor:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(Path(folder))
        extractor = getattr(processor, "feature_extractor", None)
        if type(extractor).__name__ != "WhisperFeatureExtractor":
            raise ValueError(f"{ARCH}'s folder must hold GlmAsrProcessor with a WhisperFeatureExtractor, not "
                             f"{type(processor).__name__} with {type(extractor).__name__}")
        if processor.audio_token_id != config.audio_token_id:
            raise ValueError(f"the processor's audio_token {processor.audio_token!r} is token "
                             f"{processor.audio_token_id}, but config.json's audio_token_id={config.audio_token_id}: "
                             "transformers' model would refuse its prompts; make them agree")
        return cls(extractor, config, processor.max_audio_len)

    def count(self, mask: Any) -> int:
        count = audio_embeds(int(mask.sum()))
        if count == 0:
            raise ValueError(f"an audio of {int(mask.sum())} mel frames is too short for {ARCH}: it gives no audio "
                             "embedding; send a longer one")
        return count
