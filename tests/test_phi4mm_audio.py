"""Phi-4-multimodal's audio (``specray.models.phi4_multimodal_audio``): against transformers' whole
``Phi4MultimodalForCausalLM`` on the same tiny random fp32 weights (its text model two Phi-3 layers, its audio encoder
two Conformer blocks with the releases' 80 mel bins and 8x subsampling), synthetic waveforms from a fixed seed.

Each audio's features and token count are transformers' ``Phi4MultimodalFeatureExtractor``'s for it alone; each audio's
embeddings equal the whole model's audio embedding (``audio_embed`` in speech mode) for it: a 1.3 s and a 2.2 s audio,
and a 41 s one whose 513 rows attend in two chunks of 500 (the second zero-padded); with a streaming mask
(``chunk_size`` > 0: transformers adds it to the bias rather than applying it) and a depthwise multiplier too. The text
model fed them gives the whole model's logits over a prompt with an audio, in chunks splitting its span, then decode
steps, and two tensor-parallel ranks one rank's; each distinctive part broken once moves the embeddings; what is not
served is refused by name; the engine's greedy tokens with an audio and n-gram drafts equal transformers' ``generate``.
No GPU check here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models import phi4_multimodal_audio as pa
from specray.models.loader import load_image_encoder, load_image_processor, load_model, read_config
from specray.multimodal import MultiModalInputs, expand_prompt
from specray_test_image_checks import assert_ranks_equal_one_rank, config_with, image_logits  # tests/image_checks.py
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the embeddings at least this much (a hundred times TOL)
RATE = 16000
LENGTHS = [20800, 35500]  # 1.3 s (128 frames: 16 rows) and ~2.2 s (220 frames: 28 rows)
LONG = 41 * RATE  # 4,098 frames: 513 rows, two chunks of 500
AUDIO = "<|audio|>"
HIDDEN = 64
AUDIO_CONFIG = dict(hidden_size=32, intermediate_size=48, num_blocks=2, num_attention_heads=4, ext_pw_out_channel=32,
                    depthwise_separable_out_channel=32, nemo_conv_channels=16, input_size=80, nemo_final_size=10,
                    bias_max_distance=8)  # distances past 8 rows clamp
VISION_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                     patch_size=14, crop_size=28)
BEFORE, AFTER = "Hello world! ", " The quick brown fox jumps."
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def waves(lengths=tuple(LENGTHS)) -> list[np.ndarray]:
    """Mono float32 waveforms: a few tones with vibrato and noise, numpy seed 0."""
    rng = np.random.default_rng(0)
    out = []
    for n in lengths:
        t = np.arange(n) / RATE
        tones = sum(rng.uniform(0.05, 0.3) * np.sin(2 * np.pi * rng.uniform(80, 4000) * t + 3 * np.sin(t * f))
                    for f in (3.0, 5.0))
        out.append((tones + 0.05 * rng.standard_normal(n)).astype(np.float32))
    return out


def _visible(model) -> None:
    """Every audio parameter drawn away from its init (LayerNorms around one, the feature normalisation, the GLU's
    biases and the relative bias non-trivial)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "audio_embed" not in name or not p.is_floating_point():
                continue
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("global_invstd"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif p.dim() == 1 or name.endswith(("b1", "b2", "global_mean")):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / max(p[0].numel(), 1) ** 0.5)


def build_release(path: Path, seed: int = 0, **audio):
    """transformers' Phi4MultimodalForCausalLM at the tiny sizes (``audio``: changes to its audio config) with random
    weights, saved with conftest's tiny tokenizer (``<|audio|>`` among its special tokens); no
    preprocessor_config.json (the feature extractor's defaults, the release's settings)."""
    from transformers import Phi4MultimodalConfig, Phi4MultimodalForCausalLM

    from tests.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=(AUDIO,))
    config = Phi4MultimodalConfig(
        vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=0,
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, vision_config=dict(VISION_CONFIG), tie_word_embeddings=False,
        audio_config={**AUDIO_CONFIG, "audio_token_id": tok.convert_tokens_to_ids(AUDIO), **audio},
        initializer_range=0.1)
    torch.manual_seed(seed)
    model = Phi4MultimodalForCausalLM(config).float().eval()
    _visible(model)
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return build_release(tmp_path_factory.mktemp("phi4mm_audio"))


def prompt_ids(folder: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]


def expand(folder: Path, text: str, audios: list[np.ndarray]) -> tuple[list[int], MultiModalInputs]:
    return expand_prompt(prompt_ids(folder, text), [], load_image_processor(str(folder)),
                         audios=[(w, RATE) for w in audios])


def encoded(folder: Path, mm: MultiModalInputs, config=None, edit=None) -> list[torch.Tensor]:
    encoder = load_image_encoder(str(folder), config or read_config(str(folder)), torch.float32, "cpu")
    if edit is not None:
        with torch.no_grad():
            edit(encoder)
    with torch.no_grad():
        return [encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()}) for item in mm.items]


@torch.no_grad()
def hf_rows(hf, item) -> torch.Tensor:
    """The whole model's audio embedding (speech mode) of one audio alone: its rows [tokens, hidden]."""
    embed = hf.model.embed_tokens_extend.audio_embed
    size = item.length
    ids = torch.full((1, size), hf.config.audio_config.audio_token_id)
    features = torch.from_numpy(item.data["input_features"])[None]
    return embed(ids, torch.zeros(1, size, HIDDEN), features, [size], None, "speech")[0]


# ---- the processor and the encoder -----------------------------------------------------------------------------------

def test_features_and_counts_equal_transformers(release):
    """Each audio's features are the feature extractor's for it alone, and its <|audio|> becomes ceil(frames / 8)
    tokens (transformers' audio_embed_sizes) between the prompt's text."""
    from transformers import Phi4MultimodalFeatureExtractor

    folder, _ = release
    ids, mm = expand(folder, BEFORE + AUDIO + " and " + AUDIO + AFTER, waves())
    extractor = Phi4MultimodalFeatureExtractor()
    audio_id = read_config(str(folder)).audio_config.audio_token_id
    for item, wave, rows in zip(mm.items, waves(), (16, 28)):
        theirs = extractor(wave, sampling_rate=RATE, return_tensors="np")
        assert np.array_equal(item.data["input_features"], theirs["audio_input_features"][0])
        assert item.length == int(theirs["audio_embed_sizes"][0]) == rows
        assert ids[item.offset: item.end] == [audio_id] * rows
    assert len(ids) == len(prompt_ids(folder, BEFORE + AUDIO + " and " + AUDIO + AFTER)) - 2 + 16 + 28
    assert load_image_processor(str(folder)).image_token_id is None


def test_encoder_equals_transformers_audio_embedding(release):
    """Each audio's embeddings equal the whole model's audio embedding for it alone, the 41 s one's two chunks of
    500 rows too (the second zero-padded, its padding attended as transformers attends it)."""
    folder, hf = release
    _, mm = expand(folder, AUDIO + AUDIO + AUDIO, waves((*LENGTHS, LONG)))
    assert [i.length for i in mm.items] == [16, 28, 513]
    for ours, item in zip(encoded(folder, mm), mm.items):
        assert ours.shape == (item.length, HIDDEN) and max_diff(ours, hf_rows(hf, item)) < TOL


@pytest.mark.parametrize("variant", [dict(chunk_size=5, left_chunk=1), dict(depthwise_multiplier=2, kernel_size=4)],
                         ids=["streaming-mask", "multiplier"])
def test_encoder_variants_equal_transformers(tmp_path, variant):
    """A streaming mask (chunks of 5 rows seeing one chunk back; transformers adds the mask to the bias), a depthwise
    multiplier of 2 with a wider kernel: each audio's rows equal transformers'."""
    folder, hf = build_release(tmp_path / "m", seed=3, **variant)
    _, mm = expand(folder, AUDIO + AUDIO, waves())
    for ours, item in zip(encoded(folder, mm), mm.items):
        assert max_diff(ours, hf_rows(hf, item)) < TOL


def _no_plus_one(encoder) -> None:  # the streaming mask applied (masked keys at -inf), not added
    real = encoder.encoder.bias

    def bias(length, device):
        plain = real(length, device) - encoder.encoder.streaming_mask(length, device)[None, None].float()
        return plain.masked_fill(~encoder.encoder.streaming_mask(length, device), float("-inf"))

    encoder.encoder.bias = bias


MUTATIONS = {
    "no-feature-norm": lambda e: e.encoder.encoder_embedding.global_invstd.fill_(1.0),
    "no-relative-bias": lambda e: e.encoder.relative_attention_bias_layer.bias_values.weight.zero_(),
    "no-glu-biases": lambda e: [b.zero_() for b in (e.encoder.encoders[0].conv.glu.b1,
                                                    e.encoder.encoders[0].conv.glu.b2)],
    "conv-taps-reversed": lambda e: e.encoder.encoders[0].conv.dw_sep_conv_1d.dw_conv.weight.copy_(
        e.encoder.encoders[0].conv.dw_sep_conv_1d.dw_conv.weight.flip(-1)),
    "ff-out-whole-step": lambda e: e.encoder.encoders[1].feed_forward_out.down_proj.weight.mul_(2.0),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_distinctive_part_moves_the_embeddings(release, mutation):
    """The feature normalisation, the relative bias, the GLU's own biases, the depthwise conv's order in time, the
    feed-forwards' half steps: each broken once moves the rows."""
    folder, _ = release
    _, mm = expand(folder, AUDIO, waves()[1:])
    assert max_diff(encoded(folder, mm, edit=MUTATIONS[mutation])[0], encoded(folder, mm)[0]) > MOVED


def test_an_applied_streaming_mask_would_move_the_embeddings(tmp_path):
    """With chunk_size > 0, masking the keys outside a row's chunks (what the mask means) moves the rows away from
    transformers', which adds the mask to the bias: ours keep transformers'."""
    folder, hf = build_release(tmp_path / "m", seed=4, chunk_size=5, left_chunk=1)
    _, mm = expand(folder, AUDIO, waves()[1:])
    assert max_diff(encoded(folder, mm)[0], hf_rows(hf, mm.items[0])) < TOL
    assert max_diff(encoded(folder, mm, edit=_no_plus_one)[0], hf_rows(hf, mm.items[0])) > MOVED


# ---- the whole model -------------------------------------------------------------------------------------------------

@torch.no_grad()
def test_logits_with_an_audio_equal_transformers(release):
    """The text model fed the audio's rows gives the whole model's logits over a prompt with an audio, in chunks
    that split its span, then decode steps."""
    folder, hf = release
    ids, mm = expand(folder, BEFORE + AUDIO + AFTER, waves()[1:])
    extra = [17, 42, 99, 75]
    item = mm.items[0]
    want = hf(input_ids=torch.tensor([ids + extra]), audio_input_features=torch.from_numpy(
        item.data["input_features"])[None], audio_embed_sizes=torch.tensor([item.length])).logits[0]
    first = item.offset + 5
    got = image_logits(load_model(str(folder)), ids + extra, mm, encoded(folder, mm), [first, len(ids) - first])
    assert max_diff(got, want) < TOL


def test_two_ranks_equal_one_rank(release, tmp_path):
    """Two tensor-parallel ranks (the text model split, the audio encoder whole on each) give one rank's logits with
    two audios: a chunk ending inside the first's span, then the rest."""
    folder, _ = release
    ids, mm = expand(folder, BEFORE + AUDIO + " and " + AUDIO + AFTER, waves())
    first = mm.items[0].offset + 5
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids, mm, [first, len(ids) - first])], 1, TOL)


def test_engine_greedy_with_audio_equals_transformers(release):
    """``LLM.generate`` with an audio (at most 12 tokens a step: the prompt's chunks end inside its span; n-gram
    drafts) gives transformers' greedy ``generate`` tokens beside a text-only prompt; transformers without the audio
    generates other tokens."""
    import sys

    from specray import LLM

    folder, hf = release
    text = BEFORE + AUDIO + AFTER
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=12, speculative_config=NGRAM)
    ids, mm = expand(folder, text, waves()[1:])
    item = mm.items[0]
    inputs = {"input_ids": torch.tensor([ids]), "audio_input_features": torch.from_numpy(
        item.data["input_features"])[None], "audio_embed_sizes": torch.tensor([item.length])}
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf, None, text, [(waves()[1], RATE)], modality="audio",
                                                  inputs=inputs)


# ---- refusals --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, says", [
    (dict(audio_config__downsample_rate=2), "downsample_rate=2 is not supported"),
    (dict(audio_config__ext_pw_out_channel=16), "ext_pw_out_channel=16 must equal audio_config.hidden_size=32"),
    (dict(audio_config__nemo_final_size=8), "nemo_final_size=8 but the subsampling leaves 10"),
    (dict(audio_config__time_reduction=6), "time_reduction=6 must be a power of two"),
    (dict(audio_config__conv_activation="mish"), "conv_activation='mish' is not supported"),
    (dict(audio_config__bias_symmetric=True), "bias_symmetric=true is not supported"),
], ids=["downsample", "conv-width", "final-size", "reduction", "activation", "symmetric"])
def test_unsupported_settings_are_refused(release, change, says):
    folder, _ = release
    with pytest.raises(ValueError, match=says):
        pa.Phi4MultimodalAudioEncoder(config_with(folder, **change))


def test_refusals(release, tmp_path):
    """Audio shorter than a frame, images, a feature extractor of other mel bins or compression, a checkpoint lacking
    a tensor of the encoder: each refused by name."""
    from safetensors.torch import load_file, save_file

    folder, _ = release
    processor = load_image_processor(str(folder))
    with pytest.raises(ValueError, match="at least 400 samples"):
        processor.process_audio(np.zeros(399, np.float32))
    assert processor.process_audio(np.zeros(400, np.float32)).replacement == [processor.audio_token_id]
    with pytest.raises(ValueError, match="images are not served"):
        processor.process(None)
    with pytest.raises(ValueError, match="takes no images"):
        expand_prompt([1, 2], ["x"], processor)
    (copy := tmp_path / "m").mkdir()
    for f in folder.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    (copy / "preprocessor_config.json").write_text(json.dumps({"feature_extractor_type": "Phi4MultimodalFeature"
                                                               "Extractor", "feature_size": 64}))
    with pytest.raises(ValueError, match="feature_size=64 differs from audio_config.input_size=80"):
        load_image_processor(str(copy))
    (copy / "preprocessor_config.json").write_text(json.dumps({"feature_extractor_type": "Phi4MultimodalFeature"
                                                               "Extractor", "audio_compression_rate": 4}))
    with pytest.raises(ValueError, match="audio_compression_rate=4"):
        load_image_processor(str(copy))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if "encoders.1.conv.glu.b1" not in k}, str(copy / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*encoders\.1\.conv\.glu\.b1"):
        load_image_encoder(str(copy), read_config(str(copy)), torch.float32, "cpu")
