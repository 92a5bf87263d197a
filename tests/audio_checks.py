"""Shared pieces of the audio families' tests (Qwen2-Audio, Audio Flamingo 3, Music Flamingo): synthetic audios,
WAV bytes, the tiny releases' weight spread, our encoder, processor and expanded prompt for a folder, and the
fingerprints that stand in for a reference's features recorded where it cannot run."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np
import torch

from specray.multimodal import MultiModalInputs, expand_prompt

RATE = 16000


def waves(seconds=(1.28, 2.45)) -> list[np.ndarray]:
    """Synthetic audios: a few tones and noise from a fixed seed, each ``seconds`` long at 16 kHz."""
    rng = np.random.default_rng(0)
    out = []
    for s in seconds:
        t = np.arange(int(s * RATE)) / RATE
        tones = sum(rng.uniform(0.1, 0.4) * np.sin(2 * np.pi * rng.uniform(100, 4000) * t) for _ in range(3))
        out.append((tones + 0.05 * rng.standard_normal(t.shape)).astype(np.float32))
    return out


def wav_bytes(samples: np.ndarray, rate: int = RATE) -> bytes:
    """A mono 16-bit PCM WAV file of ``samples`` (in [-1, 1])."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


@torch.no_grad()
def spread_weights(model) -> None:
    """Random weights whose parts show: norms away from 1, biases and positions away from 0, attention scores far
    from uniform (the mask and its direction show), projectors and embeddings of unit-ish scale."""
    for name, p in model.named_parameters():
        if "norm" in name and name.endswith(".weight") and p.dim() == 1:
            p.uniform_(0.5, 1.5)
        elif name.endswith(".bias") and ("audio_tower" in name or "projector" in name):
            p.normal_(0.0, 0.2)
        elif "audio_tower" in name and name.endswith(("q_proj.weight", "k_proj.weight")):
            p.normal_(0.0, 0.3)
        elif name.endswith("embed_positions.weight"):
            p.normal_(0.0, 0.5)
        elif "projector" in name and name.endswith(".weight"):
            p.normal_(0.0, p.shape[1] ** -0.5)
        elif name.endswith("embed_tokens.weight"):
            p.normal_(0.0, 0.2)


def hf_processor(folder: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder)


def ours(folder: Path, config=None):
    """Our audio encoder (fp32, CPU) and processor of the release in ``folder``."""
    from specray.models.loader import load_image_encoder, load_image_processor, read_config

    config = config or read_config(str(folder))
    return load_image_encoder(str(folder), config, torch.float32, "cpu"), load_image_processor(str(folder), config)


def expand_audio(ids: list[int], audios: list, processor) -> tuple[list[int], MultiModalInputs]:
    """The prompt with each audio placeholder replaced by its tokens, and the audio items."""
    return expand_prompt(ids, [], processor, audios=audios)


def expanded(folder: Path, text: str, audios: list) -> tuple[list[int], MultiModalInputs]:
    """:func:`expand_audio` of ``text`` in the folder's tokenizer."""
    from transformers import AutoTokenizer

    return expand_audio(AutoTokenizer.from_pretrained(folder).encode(text), audios, ours(folder)[1])


def fingerprint(a: np.ndarray) -> list[float]:
    """Features told apart without their last bits: their sum and projections on four fixed random directions (a
    sha256 of the float32 bytes told CPUs apart: the log-mel's FFT rounds its last bit by the CPU's SIMD path). A
    change of ``d`` moves a projection by about ``|d|``, float rounding by about 1e-4."""
    a = np.asarray(a, dtype=np.float64).ravel()
    directions = np.random.default_rng(7).standard_normal((4, a.shape[0]))
    return [round(float(a.sum()), 4), *(round(float(x), 4) for x in directions @ a)]


def same_features(got: np.ndarray, recorded: list[float]) -> bool:
    return np.allclose(fingerprint(got), recorded, rtol=0, atol=2e-3)


def tone_waves(lengths) -> list[np.ndarray]:
    """Synthetic audios of ``lengths`` samples at 16 kHz: three tones and noise, numpy seed 0."""
    rng = np.random.default_rng(0)
    out = []
    for n in lengths:
        t = np.arange(n) / RATE
        tones = sum(rng.uniform(0.05, 0.3) * np.sin(2 * np.pi * rng.uniform(80, 4000) * t) for _ in range(3))
        out.append((tones + 0.05 * rng.standard_normal(n)).astype(np.float32))
    return out


def draw_visible(model, parts: tuple[str, ...] = ("audio_tower", "multi_modal_projector"), seed: int = 1) -> None:
    """Every parameter of ``model`` under ``parts`` drawn away from its init, so that each of them shows in the
    outputs: norm weights around one, vectors small, matrices at unit gain."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in parts):
                noise = torch.randn(p.shape, generator=gen)
                norm = ("norm" in name or "ln_" in name) and name.endswith("weight")
                p.copy_(1.0 + 0.2 * noise if norm else 0.1 * noise if p.dim() == 1
                        else noise / max(p[0].numel(), 1) ** 0.5)


def expand_in(folder: Path, text: str, audios: list, rate: int = RATE) -> tuple[list[int], MultiModalInputs]:
    """``text`` in the folder's tokenizer with each audio placeholder expanded by the checkpoint's processor (as the
    engine loads it), the audios given at ``rate``."""
    from transformers import AutoTokenizer

    from specray.models.loader import load_image_processor

    return expand_prompt(AutoTokenizer.from_pretrained(str(folder)).encode(text), [],
                         load_image_processor(str(folder)), audios=[(w, rate) for w in audios])
