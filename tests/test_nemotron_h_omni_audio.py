"""Nemotron 3 Nano Omni's audio (``NemotronH_Omni_Reasoning_V3`` with an ``audio_config``:
:mod:`specray.models.nemotron_h_omni_audio`), against transformers on the same tiny random fp32 weights and two
synthetic waveforms (numpy seed 0; 1.3 s, whose 130 valid mel frames leave every subsampled frame valid, and 2.24 s,
whose 224 leave its last subsampled frame masked). The feature extractor is transformers' own ParakeetFeatureExtractor
(torch and numpy only: no torchaudio, so no private check is needed); our expanded prompt (``<so_start>``, one
``<so_embedding>`` per embedding, ``<so_end>``) and features equal transformers'
``NemotronH_Omni_Reasoning_V3Processor`` (its image processor, torchvision-only, stood in for by ours, which
tests/test_nemotron_h_omni_images.py checks) for two audios and an image in one prompt; each audio's embeddings
equal ``get_audio_features``' (each alone, and the two batched as transformers' processor pads them), read in the
released names and in transformers' modules'; the Nemotron-H text model with the audio and image rows gives
transformers' whole model's logits over a prefill and over chunks splitting the audios' spans; each distinctive part
broken once moves the rows; what is not served is refused by name; two tensor-parallel ranks equal one; the engine's
greedy tokens (chunks splitting the audio, n-gram drafts) equal transformers' ``generate`` with an audio, with an
audio and an image, and through ``LLM.chat`` with an input_audio part. No GPU check here."""

from __future__ import annotations

import base64
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specray.models import nemotron_h_omni_audio as na
from specray.models.loader import iter_weights, load_image_encoder, load_image_processor, load_model, read_config, \
    resolve_model
from specray.multimodal import MultiModalInputs, expand_prompt
from specray_test_audio_checks import wav_bytes
from specray_test_image_checks import assert_ranks_equal_one_rank, config_with, image_logits, random_images
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the rows or logits at least this much
RATE = 16000
LENGTHS = [20800, 35877]  # 130 valid frames of 131 (17 tokens, all valid); 224 of 225 (29 tokens, the last masked)
TOKENS = [17, 29]
SO, SO_START, SO_END = na.AUDIO_TOKENS
PATCH = 4
IMAGE_SETTINGS = {"image_processor_type": "NemotronH_Omni_Reasoning_V3ImageProcessor", "patch_size": PATCH,
                  "downsample_ratio": 0.5, "min_num_patches": 16, "max_num_patches": 64, "max_model_len": 16384}
VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, mlp_ratio=2.0, patch_size=PATCH,
              max_img_size=32, num_cls_tokens=2, num_registers=2, video_temporal_patch_size=2, layer_norm_eps=1e-6)
# the release's Parakeet settings where they differ from ParakeetEncoderConfig's (no attention / feed-forward biases,
# no input scaling; biased convolutions and projector) at tiny sizes; an odd conv kernel of 5
AUDIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_kernel_size=5,
             subsampling_factor=8, subsampling_conv_channels=8, num_mel_bins=16, projection_hidden_size=40,
             projection_bias=True, attention_bias=False, scale_input=False, convolution_bias=True)
FEATURES = {"feature_extractor_type": "ParakeetFeatureExtractor", "feature_size": 16, "sampling_rate": RATE,
            "hop_length": 160, "n_fft": 512, "win_length": 400, "preemphasis": 0.97, "padding_value": 0.0}
PROCESSOR = {"processor_class": "NemotronH_Omni_Reasoning_V3Processor", "audio_sampling_rate": RATE,
             "audio_subsampling_factor": 8, "audio_hop_length": 160, "feature_extractor": FEATURES}
PROMPT = f"Hear {SO} then see <image> and hear {SO} the quick brown fox jumps"
ONE = f"Hello world! {SO} The quick brown fox jumps."


def waves() -> list[np.ndarray]:
    """Two mono float32 waveforms: tones with vibrato, noise and a fade (numpy seed 0)."""
    rng = np.random.default_rng(0)
    out = []
    for n in LENGTHS:
        t = np.arange(n) / RATE
        tones = sum(rng.uniform(0.05, 0.3) * np.sin(2 * np.pi * rng.uniform(80, 4000) * t + 3 * np.sin(t * f))
                    for f in (3.0, 5.0, 7.0))
        out.append(((tones + 0.05 * rng.standard_normal(n)) * np.linspace(1.0, 0.3, n)).astype(np.float32))
    return out


def images() -> list:
    return random_images([(28, 40)], legacy=True)


def _visible(model) -> None:
    """The audio side's parameters drawn away from their init (norms around one, BatchNorm statistics non-trivial,
    the attention's u / v biases and relative projection at a size where they show)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not name.startswith(("audio_tower.", "embed_audio.")) or name.endswith("inv_freq"):
                continue  # (the positions' frequencies are a buffer the checkpoint does not hold)
            if not p.is_floating_point():
                continue
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("running_var"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(("bias_u", "bias_v")):
                p.copy_(noise)
            elif p.dim() == 1 or name.endswith("running_mean"):
                p.copy_(0.1 * noise)
            else:
                fan_in = p[0].numel()
                p.copy_(noise / fan_in ** 0.5 * (3.0 if "relative_k_proj" in name else 1.0))


def build_tiny_omni(path: Path, audio: dict, seed: int = 0):
    """transformers' NemotronH_Omni_Reasoning_V3 with a C-RADIO tower, a Parakeet audio encoder and a Nemotron-H text
    model (tests/hybrid_models.py), saved (transformers writes the release's names: ``sound_encoder.encoder.*``,
    ``sound_projection.*``) with conftest's tiny tokenizer (the image and audio tokens among its special tokens), the
    image processor's settings (preprocessor_config.json) and the processor's with its feature extractor's
    (processor_config.json)."""
    from transformers import RadioConfig
    from transformers.models.nemotron_h_omni.configuration_nemotron_h_omni import NemotronH_Omni_Reasoning_V3_Config
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    from tests.conftest import build_tiny_tokenizer
    from tests.hybrid_models import mamba_config

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(path, extra_special_tokens=("<image>", "<img>", "</img>", SO, SO_START, SO_END))
    text = mamba_config("nemotron_h", vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id, num_nextn_predict_layers=0)
    config = NemotronH_Omni_Reasoning_V3_Config(
        vision_config=RadioConfig(**VISION).to_dict(), text_config=text.to_dict(), audio_config=dict(audio),
        projector_hidden_size=48, vision_hidden_size=32, image_token_id=tok.convert_tokens_to_ids("<image>"),
        audio_token_id=tok.convert_tokens_to_ids(SO))
    torch.manual_seed(seed)
    model = NemotronH_Omni_Reasoning_V3(config).float().eval()
    _visible(model)
    with torch.no_grad():  # unit-scale text; the head a doubled copy of the embedding (greedy loops: drafts accepted)
        for name, param in model.language_model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, param.shape[1] ** -0.5)
        embedding = model.language_model.get_input_embeddings().weight
        embedding.mul_(2.0)
        model.language_model.lm_head.weight.copy_(embedding)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(IMAGE_SETTINGS))
    (path / "processor_config.json").write_text(json.dumps(PROCESSOR))
    return path, model


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    return build_tiny_omni(tmp_path_factory.mktemp("omni_audio") / "release", AUDIO)


def prompt_ids(folder: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder)).encode(text)


def expand(folder: Path, text: str, audios: list, imgs: list = ()) -> tuple[list[int], MultiModalInputs]:
    return expand_prompt(prompt_ids(folder, text), list(imgs), load_image_processor(str(folder)),
                         audios=[(w, RATE) for w in audios])


class ImagesOf:
    """A stand-in for transformers' torchvision-only image processor: our patches and grids (equal to transformers',
    tests/test_nemotron_h_omni_images.py), with its ``downsample_ratio``."""

    downsample_ratio = 0.5

    def __init__(self, processor):
        self.processor = processor

    def __call__(self, images, **kwargs):
        from transformers import BatchFeature

        done = [self.processor.pixels(image) for image in images]
        return BatchFeature({"pixel_values": torch.from_numpy(np.concatenate([p for p, _ in done])),
                             "image_grid_hw": torch.tensor([list(g) for _, g in done])})


def hf_processor(folder: Path):
    """transformers' ``NemotronH_Omni_Reasoning_V3Processor`` over the folder's tokenizer, its own Parakeet feature
    extractor of the folder's settings and :class:`ImagesOf` (the class check of the stand-in skipped)."""
    from transformers import AutoTokenizer
    from transformers.models.nemotron_h_omni.processing_nemotron_h_omni import NemotronH_Omni_Reasoning_V3Processor
    from transformers.models.parakeet.feature_extraction_parakeet import ParakeetFeatureExtractor
    from transformers.processing_utils import ProcessorMixin

    settings = {k: v for k, v in FEATURES.items() if k != "feature_extractor_type"}
    kwargs = {k: v for k, v in PROCESSOR.items() if k.startswith("audio_")}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
        return NemotronH_Omni_Reasoning_V3Processor(
            image_processor=ImagesOf(load_image_processor(str(folder))), tokenizer=AutoTokenizer.from_pretrained(
                str(folder)), feature_extractor=ParakeetFeatureExtractor(**settings), **kwargs)


def hf_inputs(folder: Path, text: str, audios: list, imgs: list | None = None) -> dict:
    out = hf_processor(folder)(text=[text], audio=list(audios), images=imgs or None, return_tensors="pt")
    return {k: v for k, v in out.items() if k != "attention_mask"}


# ---- the processor ---------------------------------------------------------------------------------------------------

def test_processor_equals_transformers(omni):
    """Two audios and an image in one prompt: our expanded ids equal transformers' processor's (the audios' spans of
    17 and 29 ``<so_embedding>`` between ``<so_start>`` / ``<so_end>``, the image's ``<img>`` span between them),
    each audio's features and valid frames equal its feature extractor's for the audio alone (bit for bit) and its
    batch's (the shorter one zero-padded there); one processor object takes both kinds."""
    folder, _ = omni
    theirs = hf_processor(folder)
    want = theirs(text=[PROMPT], audio=waves(), images=images(), return_tensors="pt")
    ids, mm = expand(folder, PROMPT, waves(), images())
    assert ids == want["input_ids"][0].tolist()
    assert [item.modality for item in mm.items] == ["audio", "image", "audio"]
    audios = [item for item in mm.items if item.modality == "audio"]
    processor = load_image_processor(str(folder))
    assert isinstance(processor, na.NemotronHOmniProcessor) and processor.sampling_rate == RATE
    assert (processor.audio_token_id, processor.image_token_id) == (read_config(str(folder)).audio_token_id,
                                                                   read_config(str(folder)).image_token_id)
    for item, n, tokens, batched, valid in zip(audios, LENGTHS, TOKENS, want["input_features"],
                                               want["input_features_mask"]):
        assert item.length == tokens + 2 and item.embed_rows == list(range(1, tokens + 1))
        span = ids[item.offset:item.end]
        assert span == [processor.audio_start_id] + [processor.audio_token_id] * tokens + [processor.audio_end_id]
        alone = theirs.feature_extractor(waves()[LENGTHS.index(n)], sampling_rate=RATE, return_tensors="np")
        feats, mask = item.data["input_features"], item.data["input_features_mask"]
        assert feats.shape == (1 + n // 160, 16) and feats.dtype == np.float32
        assert np.array_equal(feats, alone["input_features"][0]) and np.array_equal(mask, alone["attention_mask"][0])
        assert int(mask.sum()) == n // 160 == int(valid.sum())
        assert np.allclose(feats, batched[:len(feats)].numpy(), atol=1e-5)
        assert not batched[len(feats):].any()


def test_audio_only_prompt_and_counts(omni):
    """A prompt with one audio expands as transformers' does; the counts follow its estimate
    (``1 + samples // hop`` frames, three halvings)."""
    folder, _ = omni
    want = hf_processor(folder)(text=[ONE], audio=waves()[1:], return_tensors="pt")
    ids, mm = expand(folder, ONE, waves()[1:])
    assert ids == want["input_ids"][0].tolist() and mm.rope_positions is None
    assert [na.subsampled(1 + n // 160, 8) for n in (320, 1279, 1280, 1281, 20800, 35877)] == [1, 1, 2, 2, 17, 29]


# ---- the encoder -----------------------------------------------------------------------------------------------------

def encoded(folder: Path, mm: MultiModalInputs, edit=None) -> list[torch.Tensor]:
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    if edit is not None:
        with torch.no_grad():
            edit(encoder)
    with torch.no_grad():
        return [encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()}) for item in mm.items]


def hf_rows(hf, item) -> torch.Tensor:
    """transformers' rows for one audio alone (its features and mask as its processor makes them for it)."""
    with torch.no_grad():
        return hf.get_audio_features(torch.from_numpy(item.data["input_features"])[None],
                                     torch.from_numpy(item.data["input_features_mask"].astype(bool))[None]
                                     ).pooler_output


def _as_modules(folder: Path, into: Path) -> Path:
    """``folder``'s checkpoint with transformers' modules' names for the audio side (``audio_tower.*``,
    ``embed_audio.*``) and a featurizer buffer of the release's (skipped)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, into)
    out = {}
    for name, tensor in load_file(str(into / "model.safetensors")).items():
        name = name.replace("sound_encoder.encoder.", "audio_tower.").replace("sound_projection.norm.",
                                                                             "embed_audio.layer_norm.")
        out[name.replace("sound_projection.linear1.", "embed_audio.linear_1.").replace(
            "sound_projection.linear2.", "embed_audio.linear_2.")] = tensor
    out["audio_tower.feature_extractor.featurizer.fb"] = torch.zeros(3)
    save_file(out, str(into / "model.safetensors"), metadata={"format": "pt"})
    return into


@pytest.mark.parametrize("layout", ["release", "modules"])
def test_encoder_equals_transformers_audio_features(omni, layout, tmp_path):
    """Each audio's rows [tokens, text hidden] equal ``get_audio_features``' for it alone (the longer one's last row
    attending evenly, as its masked frame does), and the two together equal transformers' batch of both (the shorter
    padded); the weights read as released and in transformers' modules' names."""
    folder, hf = omni
    if layout == "modules":
        folder = _as_modules(folder, tmp_path / "modules")
    _, mm = expand(folder, PROMPT, waves(), images())
    audios = MultiModalInputs([item for item in mm.items if item.modality == "audio"])
    ours = encoded(folder, audios)
    for item, rows, tokens in zip(audios.items, ours, TOKENS):
        want = hf_rows(hf, item)
        assert rows.shape == want.shape == (tokens, 64) and max_diff(rows, want) < TOL
    batch = hf_inputs(folder, PROMPT, waves(), images())
    with torch.no_grad():
        want = hf.get_audio_features(batch["input_features"], batch["input_features_mask"]).pooler_output
    assert max_diff(torch.cat(ours), want) < TOL and want.abs().max() > 0.5


def test_encoder_variant_with_biases_and_scaling(tmp_path):
    """ParakeetEncoderConfig's own defaults where the release differs (attention and feed-forward biases, inputs
    scaled by sqrt(hidden)), an unbiased projector and convolutions, a subsampling factor of 4: rows equal
    transformers'."""
    variant = {**AUDIO, "attention_bias": True, "scale_input": True, "convolution_bias": False,
               "projection_bias": False, "subsampling_factor": 4, "hidden_act": "gelu"}
    folder, hf = build_tiny_omni(tmp_path / "variant", variant, seed=3)
    (folder / "processor_config.json").write_text(json.dumps({**PROCESSOR, "audio_subsampling_factor": 4}))
    _, mm = expand(folder, ONE, waves()[1:])
    assert mm.items[0].length == 2 + 57
    rows = encoded(folder, mm)[0]
    assert max_diff(rows, hf_rows(hf, mm.items[0])) < TOL


def test_encoder_in_bfloat16(omni):
    """Built in bfloat16, the encoder's rows land within 5% (of the largest) of float32's."""
    folder, _ = omni
    _, mm = expand(folder, ONE, waves()[1:])
    want = encoded(folder, mm)[0]
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.bfloat16, "cpu")
    data = mm.items[0].data
    with torch.no_grad():
        got = encoder.encode({"input_features": torch.from_numpy(data["input_features"]).bfloat16(),
                              "input_features_mask": torch.from_numpy(data["input_features_mask"])})
    assert got.dtype == torch.bfloat16 and max_diff(got.float(), want) < 5e-2 * want.abs().max()


# ---- the whole model -------------------------------------------------------------------------------------------------

CASES = {"audio": (ONE, [1], False), "audio+image": (PROMPT, [0, 1], True)}
SCHEDULES = {"prefill": None, "chunked": [7, 9, 13, 20, 11]}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_with_audio_equal_transformers(omni, case, schedule):
    """The Nemotron-H text model with the audio (and image) rows in place gives transformers' whole model's logits
    (its forward with ``input_features`` / ``input_features_mask``, and ``pixel_values`` / ``image_grid_hw``) in one
    prefill and in chunks whose ends fall inside the audios' spans (then single steps; the Mamba-2 states carried)."""
    folder, hf = omni
    text, picks, with_image = CASES[case]
    audios, imgs = [waves()[i] for i in picks], images() if with_image else []
    ids, mm = expand(folder, text, audios, imgs)
    if SCHEDULES[schedule]:
        cuts = np.cumsum(SCHEDULES[schedule])
        assert all(any(i.offset < c < i.end for c in cuts) for i in mm.items if i.modality == "audio")
    with torch.no_grad():
        want = hf(**hf_inputs(folder, text, audios, imgs or None)).logits[0]
    ours = image_logits(load_model(str(folder)), ids, mm, encoded(folder, mm), SCHEDULES[schedule])
    assert max_diff(ours, want) < TOL
    plain = image_logits(load_model(str(folder)), ids, mm, [e * 0 for e in encoded(folder, mm)], None)
    assert max_diff(plain, want) > MOVED


# ---- each part shows -------------------------------------------------------------------------------------------------

def _layers(encoder):
    return encoder.audio_tower.layers


def _zero(*names):
    def edit(encoder):
        for layer in _layers(encoder):
            for name in names:
                getattr(layer.self_attn, name).zero_()
    return edit


def _plain_batch_norm(encoder):
    for layer in _layers(encoder):
        layer.conv.norm.running_mean.zero_()
        layer.conv.norm.running_var.fill_(1.0)


def _scaled_input(encoder):
    encoder.audio_tower.input_scale = encoder.audio_tower.hidden ** 0.5


def _no_projector_norm(encoder):
    encoder.embed_audio.layer_norm.weight.fill_(1.0)
    encoder.embed_audio.forward = lambda x: encoder.embed_audio.linear_2(
        torch.relu(encoder.embed_audio.linear_1(x)).square())


def _projector_relu(encoder):
    p = encoder.embed_audio
    p.forward = lambda x: p.linear_2(torch.relu(p.linear_1(torch.nn.functional.rms_norm(
        x, x.shape[-1:], p.layer_norm.weight, 1e-5))))


def _mel_major(encoder):  # each subsampled frame read mel-major instead of channel-major (the linear's columns)
    sub = encoder.audio_tower.subsampling
    weight, channels = sub.linear.weight, sub.layers[0].weight.shape[0]
    weight.copy_(weight.view(weight.shape[0], -1, channels).transpose(1, 2).reshape(weight.shape).clone())


def _distance_flipped(scores):  # key j against query i at distance j - i
    frames = scores.shape[1]
    seq = torch.arange(frames)
    return scores.gather(-1, (seq[:, None] - seq[None, :] + frames - 1).expand(scores.shape[0], -1, -1))


# part -> (a monkeypatch on the module, or None; an edit of the loaded encoder, or None)
PARTS = {
    "relative positions": (None, lambda e: [layer.self_attn.relative_k_proj.weight.zero_() for layer in _layers(e)]),
    "content bias u": (None, _zero("bias_u")),
    "position bias v": (None, _zero("bias_v")),
    "distance sign (j - i)": (lambda mp: mp.setattr(na, "shifted", _distance_flipped), None),
    "sines and cosines not interleaved": (lambda mp: mp.setattr(na, "relative_positions", lambda f, w, d, dev: (
        lambda a: torch.cat((a.sin(), a.cos()), -1).to(d))(torch.arange(f - 1, -f, -1.0)[:, None] / (
            10000.0 ** (torch.arange(0, w, 2.0) / w)))), None),
    "subsampling's frame mask": (lambda mp: mp.setattr(na.Subsampling, "forward", _unmasked_subsampling), None),
    "masked last frame attends evenly": (lambda mp: mp.setattr(na, "pair_mask", lambda rows: rows[None, :].expand(
        len(rows), -1)), None),
    "conv module's frame mask": (lambda mp: mp.setattr(na.ConvModule, "forward", lambda self, x, rows: (
        _CONV(self, x, torch.ones_like(rows)))), None),
    "batch norm statistics": (None, _plain_batch_norm),
    "feed-forward half steps": (lambda mp: mp.setattr(na.ConformerBlock, "half_step", 1.0), None),
    "input scaling (off in the release)": (None, _scaled_input),
    "channel-major frames": (None, _mel_major),
    "projector norm": (None, _no_projector_norm),
    "projector squared relu": (None, _projector_relu),
}
_CONV = na.ConvModule.forward
_SUBSAMPLE = na.Subsampling.forward


def _unmasked_subsampling(self, features, valid):
    return _SUBSAMPLE(self, features, torch.tensor(features.shape[0]))


@pytest.mark.parametrize("part", sorted(PARTS))
def test_each_part_shows_in_the_rows(omni, part, monkeypatch):
    """Each distinctive part switched off (or done otherwise) moves the longer audio's rows (the one with a masked
    last frame) by at least :data:`MOVED` from transformers'."""
    folder, hf = omni
    _, mm = expand(folder, ONE, waves()[1:])
    patch, edit = PARTS[part]
    if patch is not None:
        patch(monkeypatch)
    rows = encoded(folder, mm, edit)[0]
    monkeypatch.undo()
    assert max_diff(rows, hf_rows(hf, mm.items[0])) > MOVED


# ---- refusals --------------------------------------------------------------------------------------------------------

REFUSED = {
    "even conv kernel": (dict(audio_config__conv_kernel_size=4), r"audio_config\.conv_kernel_size=4"),
    "subsampling kernel": (dict(audio_config__subsampling_conv_kernel_size=5),
                           r"subsampling_conv_kernel_size=5, subsampling_conv_stride=2"),
    "factor": (dict(audio_config__subsampling_factor=6), r"audio_config\.subsampling_factor=6"),
    "mel bins": (dict(audio_config__num_mel_bins=20), r"audio_config\.num_mel_bins=20 is not a multiple"),
    "activation": (dict(audio_config__hidden_act="swishy"), r"audio_config\.hidden_act='swishy'"),
    "heads": (dict(audio_config__num_attention_heads=3), r"audio_config\.hidden_size=32 must be an even multiple"),
    "projector": (dict(audio_config__projection_hidden_size=None), r"audio_config\.projection_hidden_size=None"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_settings_are_refused(omni, case):
    change, message = REFUSED[case]
    with pytest.raises(ValueError, match=message):
        na.NemotronHOmniEncoder(config_with(omni[0], **change))


PROCESSOR_REFUSED = {
    "rate": ({"audio_sampling_rate": 8000}, r"audio_sampling_rate=8000 disagrees with the feature extractor's "
                                            r"sampling_rate=16000"),
    "hop": ({"audio_hop_length": 128}, r"audio_hop_length=128 disagrees with the feature extractor's hop_length=160"),
    "factor": ({"audio_subsampling_factor": 4}, r"audio_subsampling_factor=4 disagrees with "
                                                r"audio_config\.subsampling_factor=8"),
    "mels": ({"feature_extractor": {**FEATURES, "feature_size": 32}}, r"feature_size=32 disagrees with "
                                                                      r"audio_config\.num_mel_bins=16"),
    "odd n_fft": ({"feature_extractor": {**FEATURES, "n_fft": 511}}, r"n_fft=511 is odd"),
    "type": ({"feature_extractor": {**FEATURES, "feature_extractor_type": "WhisperFeatureExtractor"}},
             r"is 'WhisperFeatureExtractor', not .*ParakeetFeatureExtractor"),
}


@pytest.mark.parametrize("case", sorted(PROCESSOR_REFUSED))
def test_unsupported_processor_settings_are_refused(omni, case, tmp_path):
    folder = shutil.copytree(omni[0], tmp_path / "m")
    change, message = PROCESSOR_REFUSED[case]
    (folder / "processor_config.json").write_text(json.dumps({**PROCESSOR, **change}))
    with pytest.raises(ValueError, match=message):
        load_image_processor(str(folder))


def test_mismatches_are_refused(omni, tmp_path):
    """Audio under two hops, a checkpoint lacking an audio tensor, features of another width, and audio sent to a
    checkpoint without an audio_config are each refused by name."""
    folder, _ = omni
    processor = load_image_processor(str(folder))
    with pytest.raises(ValueError, match=r"too short: .* at least 320 samples"):
        processor.process_audio(np.zeros(300, np.float32))
    encoder = na.NemotronHOmniEncoder(read_config(str(folder)))
    tensors = list(iter_weights(resolve_model(str(folder))))
    lost = "sound_encoder.encoder.layers.1.self_attn.bias_v"
    with pytest.raises(ValueError, match=r"audio_tower\.layers\.1\.self_attn\.bias_v"):
        encoder.load_weights((n, t) for n, t in tensors if n != lost)
    with pytest.raises(ValueError, match=r"input_features \(10, 8\) .* \[frames, 16\]"):
        encoder.encode({"input_features": torch.zeros(10, 8), "input_features_mask": torch.ones(10)})
    # images only (the images test's checkpoints): no audio side, audio refused by the seam by name
    images_only = shutil.copytree(folder, tmp_path / "images_only")
    config = json.loads((images_only / "config.json").read_text())
    config.pop("audio_config")
    (images_only / "config.json").write_text(json.dumps(config))
    plain = load_image_processor(str(images_only))
    assert plain.audio_token_id is None and plain.image_token_id is not None
    with pytest.raises(ValueError, match=r"takes no audio \(only images\)"):
        expand_prompt(prompt_ids(images_only, ONE), [], plain, audios=[(waves()[0], RATE)])
    bare = na.NemotronHOmniEncoder(read_config(str(images_only)))
    assert bare.audio_tower is None
    with pytest.raises(ValueError, match=r"has no audio_config"):
        bare.encode({"input_features": torch.zeros(10, 16), "input_features_mask": torch.ones(10)})


# ---- tensor parallel and the engine ----------------------------------------------------------------------------------

def test_two_ranks_equal_one_rank(omni, tmp_path):
    """Two tensor-parallel ranks (Nemotron-H split; the encoders whole on each) give one rank's logits with two
    audios and an image, in chunks splitting the audios' spans."""
    folder, _ = omni
    ids, mm = expand(folder, PROMPT, waves(), images())
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids, mm, SCHEDULES["chunked"])], 1, TOL)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
# a chat template of the release's shape for audio parts: the <so_embedding> placeholder where an audio goes
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for p in m.content %}{% if p.type == 'audio' %}" + SO + "{% elif p.type == 'image' %}<image>"
            "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
GREEDY = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)


def test_engine_greedy_with_audio_equals_transformers(omni):
    """``LLM.generate`` with an audio (at most 12 tokens a step: chunks end inside its span; n-gram drafts over the
    Mamba-2 hybrid) gives transformers' greedy ``generate`` beside a text-only prompt; with two audios and an image
    too; ``LLM.chat`` with an input_audio part (a WAV, base64) answers as transformers does for the rendered prompt."""
    from specray import LLM, SamplingParams

    folder, hf = omni
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=12,
              speculative_config=NGRAM)
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf, None, ONE, [(waves()[1], RATE)], modality="audio",
                                                  inputs=hf_inputs(folder, ONE, waves()[1:]))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"audio": [(w, RATE) for w in waves()],
                                                               "image": images()}}, params, use_tqdm=False)[0]
    inputs = hf_inputs(folder, PROMPT, waves(), images())
    with torch.no_grad():
        want = hf.generate(**inputs, **GREEDY)[0, inputs["input_ids"].shape[1]:].tolist()
    assert list(out.outputs[0].token_ids) == want
    data = wav_bytes(waves()[0])
    decoded = np.frombuffer(data[44:], "<i2").astype(np.float32) / 32768.0
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}},
        {"type": "text", "text": " The quick brown fox jumps."}]}]
    out = llm.chat(messages, params, use_tqdm=False, chat_template=TEMPLATE)[0]
    text = f"<|im_start|>user\n{SO} The quick brown fox jumps.<|im_end|>\n<|im_start|>assistant"  # (jinja trims)
    inputs = hf_inputs(folder, text, [decoded])
    with torch.no_grad():
        want = hf.generate(**inputs, **GREEDY)[0, inputs["input_ids"].shape[1]:].tolist()
    assert list(out.outputs[0].token_ids) == want


def test_the_releases_config_json_reads(omni, tmp_path):
    """The release's config.json names the sound encoder's config ``sound_config`` with ``"model_type": "parakeet"``
    (no registered type: transformers 5.24 cannot read it, and read_config drops it first); it then reads as the
    config transformers saved, and its audio is served alike."""
    import shutil

    from transformers import AutoConfig

    from specray.models.loader import read_config

    folder, _ = omni
    release = tmp_path / "release"
    shutil.copytree(folder, release)
    config = json.loads((folder / "config.json").read_text())
    config["sound_config"] = {**config.pop("audio_config"), "model_type": "parakeet"}
    (release / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="parakeet"):
        AutoConfig.from_pretrained(release)
    ours, saved = read_config(str(release)), read_config(str(folder))
    assert vars(ours.audio_config) == vars(saved.audio_config)
    assert ours.audio_token_id == saved.audio_token_id and ours.architectures == saved.architectures
    (ids, mm), (want_ids, want) = (expand(f, ONE, waves()[:1]) for f in (release, folder))
    assert ids == want_ids and [i.hash for i in mm.items] == [i.hash for i in want.items]
