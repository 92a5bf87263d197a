"""Granite Speech's audio (``specray.models.granite_speech``): against transformers' whole
``GraniteSpeechForConditionalGeneration`` (and ``GraniteSpeechPlusForConditionalGeneration``) on the same tiny random
fp32 weights, two synthetic waveforms (fixed numpy seed, 1.3 s and 2.2 s at 16 kHz).
The features equal ``GraniteSpeechFeatureExtractor``'s (it needs torchaudio, not installed in the venv: live in a
subprocess where ``GRANITE_SPEECH_TORCHAUDIO_PATH`` names a folder holding torchaudio, else against fingerprints of
them recorded with torchaudio 2.11.1); the expanded prompt equals ``GraniteSpeechProcessor``'s (its own placeholder
expansion and token count, over our features); each audio's embeddings equal ``get_audio_features``' (times the
Granite text model's ``embedding_multiplier``, which transformers applies after scattering them), read from the
releases' layout and transformers' modules'; the Granite text model fed them gives transformers' logits over a prefill
and over chunks splitting an audio's span then decode steps (one audio: transformers' forward with
``input_features``; two audios: transformers' forward over ``inputs_embeds`` made from each audio's features, as
transformers' batch pads the shorter audio). Two tensor-parallel ranks equal one; each distinctive part broken once
moves the embeddings or the logits; what is not served is refused by name. The engine's greedy tokens with an audio
(chunks splitting its span) and n-gram drafts equal transformers' ``generate``, and ``LLM.chat`` with an input_audio
part (a WAV) answers as transformers does for the prompt it renders; the releases' LoRA adapter served as a LoRA
request with an audio prompt gives transformers' tokens with it merged. Granite Speech Plus (concatenated encoder
states) and a Granite 4.0 hybrid text model (``granitemoehybrid``) give transformers' rows and logits too. No GPU
check here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from specray.models import granite_speech as gs
from specray.models.attention import AttentionMetadata
from specray.models.loader import load_image_encoder, load_image_processor, load_model, read_config
from specray.models import registry
from specray.multimodal import MultiModalInputs, MultiModalItem, expand_prompt
from specray_test_audio_checks import fingerprint, same_features, wav_bytes
from specray_test_image_checks import assert_ranks_equal_one_rank, image_logits  # tests/image_checks.py
from specray_test_model_checks import max_diff  # tests/model_checks.py

TOL = 1e-4
MOVED = 1e-2  # a deliberate mistake moves the embeddings or logits at least this much (a hundred times TOL)
RATE = 16000
LENGTHS = [20800, 35500]  # 1.3 s (131 mel frames: the odd last one dropped) and ~2.2 s (222 frames)
TOKENS = [15, 24]  # ceil(65 / 15) * 3 and ceil(111 / 15) * 3
AUDIO = "<|audio|>"
TEXT = dict(model_type="granite", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, embedding_multiplier=3.0,
            residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0, initializer_range=0.1)
# the encoder: 4 blocks (self-conditioning after the 2nd), blocks of 16 frames (the 65- and 111-frame audios end in a
# partial block), a relative-position table wider than the block, an even conv kernel (asymmetric padding)
ENCODER = dict(input_dim=160, num_layers=4, hidden_dim=32, feedforward_mult=2, num_heads=4, dim_head=8, output_dim=12,
               context_size=16, max_pos_emb=20, dropout=0.0, conv_kernel_size=4, conv_expansion_factor=2)
QFORMER = dict(model_type="blip_2_qformer", hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
               intermediate_size=48, encoder_hidden_size=32, cross_attention_frequency=2, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12)
FEATURES = {"feature_extractor_type": "GraniteSpeechFeatureExtractor", "processor_class": "GraniteSpeechProcessor",
            "sampling_rate": RATE, "n_fft": 512, "win_length": 400, "hop_length": 160, "n_mels": 80,
            "projector_window_size": 15, "projector_downsample_rate": 5}
# transformers' input_features for each audio alone, recorded with torchaudio 2.11.1: sha256 digests of the float32
# bytes until 2026-11-30, when an AVX-512 VM's last bits differed; since, the fingerprints of the features there
# (ours, equal bit for bit to transformers' in the live check on that VM)
FINGERPRINTS = [[9645.084, -151.3741, 14.9634, -20.3602, -168.9433],
                [16457.8999, -62.2958, -189.5009, 72.2323, 165.0259]]
PLUS_CAT = [0, 2, 3]  # the plus model's concatenated states: the input projection's, after the mid block, block 3
BEFORE, BETWEEN, AFTER = "Hello world! ", " and then ", " The quick brown fox jumps."
GENERATED = [17, 42, 99, 75, 230, 61, 28, 150]  # tokens past the prompt (decode steps)
LAYOUTS = ("release", "modules")
TORCHAUDIO_PATH = "GRANITE_SPEECH_TORCHAUDIO_PATH"


def waves() -> list[np.ndarray]:
    """Two mono float32 waveforms: a few tones with vibrato, noise and a fade, numpy seed 0."""
    rng = np.random.default_rng(0)
    out = []
    for n in LENGTHS:
        t = np.arange(n) / RATE
        tones = sum(rng.uniform(0.05, 0.3) * np.sin(2 * np.pi * rng.uniform(80, 4000) * t + 3 * np.sin(t * f))
                    for f in (3.0, 5.0, 7.0))
        out.append(((tones + 0.05 * rng.standard_normal(n)) * np.linspace(1.0, 0.3, n)).astype(np.float32))
    return out


def _visible(model) -> None:
    """Every audio parameter drawn away from its init (LayerNorms around one, BatchNorm statistics non-trivial, the
    Q-former's queries and linears at a scale where each part shows)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not name.startswith(("model.encoder.", "model.projector.")) or not p.is_floating_point():
                continue
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("running_var"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif p.dim() == 1 or name.endswith("running_mean"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / max(p.shape[-1], 1) ** 0.5 * (2.0 if "rel_pos_emb" in name else 1.0))


def build_release(path: Path, plus: bool = False, seed: int = 0, hybrid: bool = False):
    """transformers' whole model at the tiny sizes with random weights, saved in the releases' layout (what
    transformers' ``save_pretrained`` writes: ``encoder.*``, ``projector.*``, ``language_model.*``) and in its
    modules' names, each folder with conftest's tiny tokenizer (``<|audio|>`` among its special tokens) and the
    feature extractor's settings."""
    from transformers import GraniteSpeechConfig, GraniteSpeechForConditionalGeneration

    from tests.conftest import build_tiny_tokenizer

    folders = {layout: path / layout for layout in LAYOUTS}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
        tok = build_tiny_tokenizer(folder, extra_special_tokens=(AUDIO,))
        (folder / "preprocessor_config.json").write_text(json.dumps(FEATURES))
    audio_id = tok.convert_tokens_to_ids(AUDIO)
    text = {**TEXT, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id, "pad_token_id": 0}
    if hybrid:  # Granite 4.0's hybrid text model (mamba, attention, mamba; experts beside the shared MLP)
        text = {**sys.modules["specray_test_hybrid_models"].mamba_config("granite").to_dict(),
                "vocab_size": len(tok), "eos_token_id": tok.eos_token_id, "pad_token_id": 0}
    kwargs = dict(text_config=text, encoder_config=dict(ENCODER), projector_config=dict(QFORMER),
                  audio_token_index=audio_id, has_lora_adapter=False, window_size=15, downsample_rate=5,
                  tie_word_embeddings=False)
    if plus:
        from transformers import GraniteSpeechPlusConfig, GraniteSpeechPlusForConditionalGeneration as cls

        kwargs["encoder_config"]["cat_hidden_layers"] = PLUS_CAT
        kwargs["projector_config"]["encoder_hidden_size"] = ENCODER["hidden_dim"] * (len(PLUS_CAT) + 1)
        config = GraniteSpeechPlusConfig(**kwargs)
    else:
        cls, config = GraniteSpeechForConditionalGeneration, GraniteSpeechConfig(**kwargs)
    torch.manual_seed(seed)
    model = cls(config).eval()
    _visible(model)
    model.save_pretrained(folders["release"])
    modules = folders["modules"]
    (modules / "config.json").write_text((folders["release"] / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(modules / "model.safetensors"))
    return folders, model


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return build_release(tmp_path_factory.mktemp("granite_speech"))


@pytest.fixture(scope="module")
def plus(tmp_path_factory):
    return build_release(tmp_path_factory.mktemp("granite_speech_plus"), plus=True, seed=1)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return build_release(tmp_path_factory.mktemp("granite_speech_hybrid"), seed=2, hybrid=True)


def prompt_ids(folder: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]


def processor_of(folder: Path) -> gs.GraniteSpeechAudioProcessor:
    return load_image_processor(str(folder))


def expand(folder: Path, text: str, audios: list[np.ndarray]) -> tuple[list[int], MultiModalInputs]:
    """The prompt with each ``<|audio|>`` replaced by its audio's tokens, and the items (the seam's
    ``expand_prompt`` with our processor)."""
    return expand_prompt(prompt_ids(folder, text), [], processor_of(folder), audios=[(w, RATE) for w in audios])


def encoded(folder: Path, mm: MultiModalInputs, edit=None) -> list[torch.Tensor]:
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    if edit is not None:
        with torch.no_grad():
            edit(encoder)
    with torch.no_grad():
        return [encoder.encode({k: torch.from_numpy(v) for k, v in item.data.items()}) for item in mm.items]


# ---- the features and the prompt -------------------------------------------------------------------------------------

class FeaturesOf:
    """A stand-in for transformers' torchaudio-only ``GraniteSpeechFeatureExtractor``: our features of each audio
    (checked against transformers' by :func:`test_features_equal_transformers`) and transformers' own token count
    (its ``_get_num_audio_features``, over the folder's settings)."""

    model_input_names = ["input_features"]
    sampling_rate = RATE

    def __init__(self, settings: dict):
        from transformers import GraniteSpeechFeatureExtractor

        self.settings = settings
        self.melspec_kwargs = {"hop_length": settings["hop_length"]}
        self.projector_window_size = settings["projector_window_size"]
        self.projector_downsample_rate = settings["projector_downsample_rate"]
        self.count = GraniteSpeechFeatureExtractor._get_num_audio_features

    def fetch_audio(self, audio, sampling_rate=None):
        return audio

    def __call__(self, audios, device="cpu"):
        from transformers import BatchFeature

        audios = list(audios) if isinstance(audios, (list, tuple)) else [audios]
        sizes = self.count(self, [len(a) for a in audios])
        feats = [gs.log_mel_features(a, self.settings) for a in audios]
        return BatchFeature({"input_features": torch.from_numpy(feats[0])[None] if len(feats) == 1 else None,
                             "audio_embed_sizes": sizes})


def hf_processor(folder: Path):
    """transformers' ``GraniteSpeechProcessor`` (its placeholder expansion) over the folder's tokenizer and
    :class:`FeaturesOf` (the class check of the stand-in skipped)."""
    from transformers import AutoTokenizer, GraniteSpeechProcessor
    from transformers.processing_utils import ProcessorMixin

    settings = processor_of(folder).settings
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
        return GraniteSpeechProcessor(audio_processor=FeaturesOf(settings),
                                      tokenizer=AutoTokenizer.from_pretrained(str(folder)))


def test_processor_expands_as_transformers(release):
    """Our expanded prompt (``<|audio|>`` repeated per projector output) equals ``GraniteSpeechProcessor``'s for one
    audio and for two of different lengths; the counts are the ones expected; the processor reads the folder's rate."""
    folder = release[0]["release"]
    theirs = hf_processor(folder)
    for text, audios in ((BEFORE + AUDIO + AFTER, waves()[1:]), (BEFORE + AUDIO + BETWEEN + AUDIO + AFTER, waves())):
        want = theirs(text=text, audio=audios, return_tensors="np")["input_ids"][0].tolist()
        ids, mm = expand(folder, text, audios)
        assert ids == want
        assert [item.length for item in mm.items] == TOKENS[-len(audios):]
        assert all(item.modality == "audio" and item.embed_rows is None for item in mm.items)
    processor = processor_of(folder)
    assert processor.sampling_rate == RATE and processor.image_token_id is None
    assert [gs.num_audio_tokens(n, 160, 15, 5) for n in (400, 4799, 4800, 4960)] == [3, 3, 3, 6]


def test_features_equal_recorded_transformers(release):
    """Each audio's features equal ``GraniteSpeechFeatureExtractor``'s up to float rounding: the fingerprints
    recorded (the live check, bit for bit: :func:`test_features_equal_transformers_live`); their shapes are [T / 2,
    160]."""
    processor = processor_of(release[0]["release"])
    feats = [processor.process_audio(w).data["input_features"] for w in waves()]
    assert [f.shape for f in feats] == [(65, 160), (111, 160)] and all(f.dtype == np.float32 for f in feats)
    assert all(same_features(f, want) for f, want in zip(feats, FINGERPRINTS)), [fingerprint(f) for f in feats]


REFERENCE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch
    from transformers import AutoTokenizer, GraniteSpeechFeatureExtractor, GraniteSpeechProcessor
    folder, out = sys.argv[1:3]
    waves = [np.load(f"{out}/w{i}.npy") for i in range(2)]
    processor = GraniteSpeechProcessor.from_pretrained(folder)
    assert isinstance(processor.audio_processor, GraniteSpeechFeatureExtractor)
    for i, w in enumerate(waves):
        np.save(f"{out}/f{i}.npy", processor.audio_processor(w)["input_features"][0].numpy())
    got = processor(text=sys.stdin.read(), audio=waves, return_tensors="np")
    json.dump({"ids": got["input_ids"][0].tolist(), "features": got["input_features"].shape[:2]},
              open(f"{out}/o.json", "w"))
""")


def test_features_equal_transformers_live(release, tmp_path):
    """Where torchaudio imports (``GRANITE_SPEECH_TORCHAUDIO_PATH`` may name a folder holding it: never the venv's),
    transformers' own ``GraniteSpeechProcessor`` (its ``GraniteSpeechFeatureExtractor``) gives our features of each
    audio alone (bit for bit) and our prompt with both."""
    env = dict(os.environ)
    if os.environ.get(TORCHAUDIO_PATH):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ[TORCHAUDIO_PATH], env.get("PYTHONPATH")) if p)
    if subprocess.run([sys.executable, "-c", "import torchaudio"], env=env, capture_output=True).returncode:
        pytest.skip("torchaudio does not import: transformers' GraniteSpeechFeatureExtractor cannot run (the recorded "
                    "fingerprints stand in)")
    folder = release[0]["release"]
    for i, w in enumerate(waves()):
        np.save(tmp_path / f"w{i}.npy", w)
    script = tmp_path / "reference.py"
    script.write_text(REFERENCE)
    text = BEFORE + AUDIO + BETWEEN + AUDIO + AFTER
    done = subprocess.run([sys.executable, str(script), str(folder), str(tmp_path)], env=env, capture_output=True,
                          timeout=120, input=text.encode())
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    want = json.loads((tmp_path / "o.json").read_text())
    ids, mm = expand(folder, text, waves())
    assert ids == want["ids"] and want["features"] == [2, 111]  # (the batch: both audios padded to the longer)
    for i, item in enumerate(mm.items):
        theirs = np.load(tmp_path / f"f{i}.npy")
        assert theirs.dtype == np.float32 and np.array_equal(item.data["input_features"], theirs)


# ---- the encoder and the whole model ---------------------------------------------------------------------------------

def hf_audio_rows(hf, item: MultiModalItem) -> torch.Tensor:
    """transformers' rows for one audio alone: ``get_audio_features``' projector output (which its Granite text
    model scales by ``embedding_multiplier`` after they are merged, as ours does)."""
    with torch.no_grad():
        return hf.get_audio_features(torch.from_numpy(item.data["input_features"])[None]).pooler_output[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_encoder_equals_transformers_audio_features(release, layout):
    """Each audio's embeddings [tokens, text hidden] equal transformers' (``get_audio_features``), the weights
    read in the releases' layout and in transformers' modules' names."""
    folders, hf = release
    _, mm = expand(folders[layout], BEFORE + AUDIO + BETWEEN + AUDIO + AFTER, waves())
    for item, ours in zip(mm.items, encoded(folders[layout], mm)):
        want = hf_audio_rows(hf, item)
        assert ours.shape == (item.length, TEXT["hidden_size"]) and max_diff(ours, want) < TOL
        assert want.abs().max() > 0.5  # (rows of a visible size)


def test_encoder_in_bfloat16(release):
    """Built in bfloat16 (as the engine builds it for a bf16 model), the encoder gives bfloat16 rows within 5%
    (relative to the largest) of float32's."""
    folder = release[0]["release"]
    _, mm = expand(folder, BEFORE + AUDIO + AFTER, waves()[1:])
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.bfloat16, "cpu")
    want = encoded(folder, mm)[0]
    with torch.no_grad():
        got = encoder.encode({k: torch.from_numpy(v) for k, v in mm.items[0].data.items()})
    assert got.dtype == torch.bfloat16 and max_diff(got.float(), want) < 5e-2 * want.abs().max()


@torch.no_grad()
def hf_logits(hf, ids: list[int], mm: MultiModalInputs) -> torch.Tensor:
    """transformers' whole model's logits over ``ids``: one audio through its forward with ``input_features``; more,
    through ``inputs_embeds`` with each audio's rows computed alone (its batch would pad the shorter audio)."""
    input_ids = torch.tensor([ids])
    if len(mm.items) == 1:
        return hf(input_ids=input_ids, input_features=torch.from_numpy(mm.items[0].data["input_features"])[None]
                  ).logits[0]
    rows = torch.cat([hf_audio_rows(hf, item) for item in mm.items])
    embeds = hf.get_input_embeddings()(torch.where(input_ids == hf.config.audio_token_id, 0, input_ids))
    embeds[input_ids == hf.config.audio_token_id] = rows
    return hf(inputs_embeds=embeds).logits[0]


PROMPTS = {"one": (BEFORE + AUDIO + AFTER, [1]), "two": (BEFORE + AUDIO + BETWEEN + AUDIO + AFTER, [0, 1])}
# a prefill; chunks ending inside the audios' spans, then single steps
SCHEDULES = {"prefill": None, "chunked+decode": [8, 10, 14, 9]}


def cases(folder: Path, which: str):
    text, picks = PROMPTS[which]
    ids, mm = expand(folder, text, [waves()[i] for i in picks])
    return ids + GENERATED, mm


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("which", sorted(PROMPTS))
def test_logits_with_audio_equal_transformers(release, which, schedule):
    """The Granite text model (as the engine loads the release's text part) with the audios' rows gives transformers'
    whole model's logits over the prompt then more tokens: one prefill, or chunks splitting the audios' spans and
    single decode steps."""
    folders, hf = release
    folder = folders["release"]
    ids, mm = cases(folder, which)
    if SCHEDULES[schedule]:
        cuts = np.cumsum(SCHEDULES[schedule])
        assert all(any(i.offset < c < i.end for c in cuts) for i in mm.items[:1])  # the first audio's span split
    ours = image_logits(load_model(str(folder)), ids, mm, encoded(folder, mm), SCHEDULES[schedule])
    assert max_diff(ours, hf_logits(hf, ids, mm)) < TOL


def test_plus_equals_transformers(plus):
    """Granite Speech Plus (``cat_hidden_layers`` [0, 2, 3]: the input projection's state, the mid block's after its
    self-conditioning, block 3's, then the last, concatenated before the projector): each audio's rows equal
    ``get_audio_features``', and the logits over a prompt with an audio, in chunks splitting it, transformers'."""
    folders, hf = plus
    folder = folders["release"]
    ids, mm = cases(folder, "two")
    for item, ours in zip(mm.items, encoded(folder, mm)):
        assert max_diff(ours, hf_audio_rows(hf, item)) < TOL
    ids, mm = cases(folder, "one")
    ours = image_logits(load_model(str(folder)), ids, mm, encoded(folder, mm), SCHEDULES["chunked+decode"])
    assert max_diff(ours, hf_logits(hf, ids, mm)) < TOL


# ---- each part matters -----------------------------------------------------------------------------------------------

def _no_cross(encoder):
    encoder.projector.qformer.encoder.layer[2].crossattention = None


def _no_query_norm(encoder):
    norm = encoder.projector.qformer.layernorm
    norm.weight.fill_(1.0)
    norm.bias.zero_()


def _plain_batch_norm(encoder):
    for layer in encoder.encoder.layers:
        layer.conv.batch_norm.running_mean.zero_()
        layer.conv.batch_norm.running_var.fill_(1.0)


def _blocks_of(size):
    def edit(encoder):
        for layer in encoder.encoder.layers:
            layer.attn.context = size
    return edit


def _mirrored_conv_padding(encoder):
    for layer in encoder.encoder.layers:
        left, right = layer.conv.depth_conv.padding
        layer.conv.depth_conv.padding = (right, left)


# part -> (a monkeypatch on the module, or None; an edit of the loaded encoder, or None)
PARTS = {
    "relative positions": (lambda mp: mp.setattr(gs, "relative_bias", lambda q, *a: torch.zeros(
        *q.shape[:-1], q.shape[-2])), None),
    "block-wise attention (blocks of 8)": (None, _blocks_of(8)),
    "last block's padding mask": (lambda mp: mp.setattr(gs.ConformerAttention, "mask_padding",
                                                        staticmethod(lambda bias, kept: bias)), None),
    "conv padding side": (None, _mirrored_conv_padding),
    "batch norm statistics": (None, _plain_batch_norm),
    "CTC self-conditioning": (lambda mp: mp.setattr(gs.CTCEncoder, "self_condition", lambda self, x: x), None),
    "feed-forward half steps": (lambda mp: mp.setattr(gs.ConformerBlock, "half_step", 1.0), None),
    "Q-former cross-attention (layer 2)": (None, _no_cross),
    "Q-former query norm": (None, _no_query_norm),
    "embedding multiplier on the rows": (lambda mp: mp.setattr(
        AttentionMetadata, "with_input_embeds", lambda meta, x, scale=1.0, real=AttentionMetadata.with_input_embeds:
        real(meta, x)), None),
    "unscaled logits (transformers' lm_head)": (lambda mp: mp.setitem(
        registry._TEXT_CONFIG_FIXES, "GraniteSpeechForConditionalGeneration", {}), None),
}


@pytest.mark.parametrize("part", sorted(PARTS))
def test_each_part_shows_in_the_logits(release, part, monkeypatch):
    """Each distinctive part switched off (or done otherwise) moves the logits over a prompt with an audio by at
    least :data:`MOVED` from transformers' (whose logits the unbroken model gives within :data:`TOL`)."""
    folders, hf = release
    folder = folders["release"]
    ids, mm = cases(folder, "one")
    patch, edit = PARTS[part]
    if patch is not None:
        patch(monkeypatch)
    ours = image_logits(load_model(str(folder)), ids, mm, encoded(folder, mm, edit), None)
    assert max_diff(ours, hf_logits(hf, ids, mm)) > MOVED


def test_plus_middle_state_is_taken_after_self_conditioning(plus, monkeypatch):
    """Granite Speech Plus keeps the middle block's state after its self-conditioning (transformers adds it in place
    to the tensor it keeps): taken before, the rows move."""
    folders, hf = plus
    folder = folders["release"]
    _, mm = cases(folder, "one")
    monkeypatch.setattr(gs.CTCEncoder, "cat_after_condition", False)
    assert max_diff(encoded(folder, mm)[0], hf_audio_rows(hf, mm.items[0])) > MOVED


# ---- refusals --------------------------------------------------------------------------------------------------------

REFUSED = {
    "encoder type": (lambda c: setattr(c.encoder_config, "model_type", "parakeet_encoder"),
                     r"encoder_config\.model_type='parakeet_encoder' is not supported"),
    "projector type": (lambda c: setattr(c.projector_config, "model_type", "q_former"),
                       r"projector_config\.model_type='q_former' is not supported"),
    "text type": (lambda c: setattr(c.text_config, "model_type", "granitemoe"),
                  r"text_config\.model_type='granitemoe' is not supported"),
    "window": (lambda c: setattr(c, "window_size", 16), r"window_size=16 must be a positive multiple of "
                                                        r"downsample_rate=5"),
    "context": (lambda c: setattr(c.encoder_config, "context_size", 30),
                r"encoder_config\.context_size=30 must be in \(0, encoder_config\.max_pos_emb=20\]"),
    "projector width": (lambda c: setattr(c.projector_config, "encoder_hidden_size", 64),
                        r"projector_config\.encoder_hidden_size=64 must equal the encoder's output width 32"),
    "activation": (lambda c: setattr(c.projector_config, "hidden_act", "swishy"),
                   r"projector_config\.hidden_act='swishy' is not supported"),
    "cat layers": (lambda c: setattr(c.encoder_config, "cat_hidden_layers", [4]),
                   r"encoder_config\.cat_hidden_layers=\[4\] must hold distinct block indices in \[0, 4\)"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_settings_are_refused(release, case):
    config = read_config(str(release[0]["release"]))
    edit, message = REFUSED[case]
    edit(config)
    with pytest.raises(ValueError, match=message):
        gs.GraniteSpeechAudioEncoder(config)
    with pytest.raises(ValueError, match=message):
        gs.GraniteSpeechAudioProcessor(FEATURES, config)


FEATURES_REFUSED = {
    "window": ({"projector_window_size": 10}, r"projector_window_size=10 disagrees with config\.json's window_size=15"),
    "rate": ({"projector_downsample_rate": 3}, r"projector_downsample_rate=3 disagrees with config\.json's "
                                               r"downsample_rate=5"),
    "mels": ({"n_mels": 64}, r"n_mels=64 gives frames of 128 features .* but encoder_config\.input_dim=160"),
    "window length": ({"win_length": 600}, r"win_length=600 exceeds n_fft=512"),
}


@pytest.mark.parametrize("case", sorted(FEATURES_REFUSED))
def test_unsupported_feature_settings_are_refused(release, case, tmp_path):
    folder = release[0]["release"]
    change, message = FEATURES_REFUSED[case]
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**FEATURES, **change}))
    with pytest.raises(ValueError, match=message):
        gs.GraniteSpeechAudioProcessor.from_pretrained(tmp_path, read_config(str(folder)))


def test_mismatches_are_refused(release):
    """Audio too short for the STFT, an image, a checkpoint lacking a tensor of the encoder: each a ValueError by
    name."""
    folder = release[0]["release"]
    processor = processor_of(folder)
    with pytest.raises(ValueError, match=r"too short .* more than n_fft // 2 = 256 samples"):
        processor.process_audio(np.zeros(200, np.float32))
    with pytest.raises(ValueError, match=r"takes audio only, no images"):
        processor.process(None)
    with pytest.raises(ValueError, match=r"takes no images \(only audio\)"):
        expand_prompt(prompt_ids(folder, BEFORE), [object()], processor)
    encoder = load_image_encoder(str(folder), read_config(str(folder)), torch.float32, "cpu")
    lost = "model.encoder.layers.1.attn.rel_pos_emb.weight"
    weights = [(n, t) for n, t in release[1].state_dict().items() if n != lost]
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) .*\['encoder\.layers\.1\.attn\.rel_pos_emb\.weight'\]"):
        encoder.load_weights(weights)


def test_text_part_is_served_alone(release):
    """The release's text model alone (``limit_mm_per_prompt`` of 0 aside): the Granite model the registry names,
    its head unscaled as the whole model's is."""
    config = read_config(str(release[0]["release"]))
    from specray.models.registry import text_part

    text, _ = text_part(config)
    assert text.model_type == "granite" and text.logits_scaling == 1.0 and text.embedding_multiplier == 3.0


# ---- tensor parallel and the engine ----------------------------------------------------------------------------------

def test_two_ranks_equal_one_rank(release, tmp_path):
    """Two tensor-parallel ranks (the Granite text model split, the audio encoder whole on each) give one rank's
    logits with two audios: chunks splitting an audio's span, then decode steps."""
    folder = release[0]["release"]
    ids, mm = cases(folder, "two")
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids, mm, SCHEDULES["chunked+decode"])], 1, TOL)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
# a chat template of the Granite Speech prompts' shape: the audio part as the placeholder the release's prompts hold
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for p in m.content %}{% if p.type == 'audio' %}" + AUDIO + "{% else %}{{ p.text }}{% endif %}"
            "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def test_engine_greedy_with_audio_equals_transformers(release):
    """``LLM.generate`` with an audio (at most 12 tokens a step: the prompt's chunks end inside its span; n-gram
    drafts) gives transformers' greedy ``generate`` tokens beside a text-only prompt; transformers without the audio
    generates other tokens. ``LLM.chat`` with an input_audio part (a WAV, base64) answers as transformers does for
    the prompt the template renders and the decoded audio."""
    import base64

    from specray import LLM, SamplingParams

    folders, hf = release
    folder = folders["release"]
    text = BEFORE + AUDIO + AFTER
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=12,
              speculative_config=NGRAM)
    ids, mm = expand(folder, text, waves()[1:])
    inputs = {"input_ids": torch.tensor([ids]),
              "input_features": torch.from_numpy(mm.items[0].data["input_features"])[None]}
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_images_greedy_equals_transformers(llm, hf, None, text, [(waves()[1], RATE)], modality="audio",
                                                  inputs=inputs)
    data = wav_bytes(waves()[0])
    decoded = np.frombuffer(data[44:], "<i2").astype(np.float32) / 32768.0
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}},
        {"type": "text", "text": AFTER}]}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                   chat_template=TEMPLATE)[0]
    # (jinja drops the template's trailing newline)
    ids, mm = expand(folder, f"<|im_start|>user\n{AUDIO}{AFTER}<|im_end|>\n<|im_start|>assistant", [decoded])
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), input_features=torch.from_numpy(mm.items[0].data["input_features"])[
            None], max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert list(out.outputs[0].token_ids) == want[0, len(ids):].tolist()


def test_hybrid_text_model_equals_transformers(hybrid):
    """With Granite 4.0's hybrid text model (``granitemoehybrid``: Mamba-2 layers around an attention layer, experts,
    Granite's multipliers), the logits over a prompt with an audio, in chunks splitting it then decode steps, equal
    transformers'."""
    folders, hf = hybrid
    folder = folders["release"]
    ids, mm = cases(folder, "one")
    ours = image_logits(load_model(str(folder)), ids, mm, encoded(folder, mm), SCHEDULES["chunked+decode"])
    assert max_diff(ours, hf_logits(hf, ids, mm)) < TOL


def test_release_lora_adapter_as_a_lora_request(release, tmp_path, caplog):
    """The releases' LoRA adapter (PEFT's, on the text model's q_proj / v_proj under ``language_model.model.``, which
    transformers enables for prompts with audio) served as a LoRA request with the audio prompt gives transformers'
    greedy tokens with the adapter merged; a folder holding one (``has_lora_adapter``) is warned about at load."""
    import copy

    from specray import LLM, SamplingParams
    from specray.lora import LoRARequest

    folders, hf = release
    folder = folders["release"]
    adapter, rank, alpha = tmp_path / "adapter", 4, 8
    adapter.mkdir()
    g, tensors, merged = torch.Generator().manual_seed(5), {}, copy.deepcopy(hf)
    for i, layer in enumerate(merged.model.language_model.layers):
        for proj in ("q_proj", "v_proj"):
            linear = getattr(layer.self_attn, proj)
            a = torch.randn(rank, linear.in_features, generator=g) * 0.3
            b = torch.randn(linear.out_features, rank, generator=g) * 0.3
            tensors[f"base_model.model.language_model.model.layers.{i}.self_attn.{proj}.lora_A.weight"] = a
            tensors[f"base_model.model.language_model.model.layers.{i}.self_attn.{proj}.lora_B.weight"] = b
            with torch.no_grad():
                linear.weight += alpha / rank * b @ a
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": ["q_proj", "v_proj"], "bias": "none",
        "task_type": "CAUSAL_LM", "base_model_name_or_path": str(folder)}))
    text = BEFORE + AUDIO + AFTER
    ids, mm = expand(folder, text, waves()[:1])
    feats = torch.from_numpy(mm.items[0].data["input_features"])[None]
    greedy = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = merged.generate(torch.tensor([ids]), input_features=feats, **greedy)[0, len(ids):].tolist()
        plain = hf.generate(torch.tensor([ids]), input_features=feats, **greedy)[0, len(ids):].tolist()
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, enable_lora=True, max_lora_rank=rank)
    out = llm.generate({"prompt": text, "multi_modal_data": {"audio": (waves()[0], RATE)}},
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                       lora_request=LoRARequest("speech", 1, str(adapter)))[0]
    assert list(out.outputs[0].token_ids) == want != plain
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(FEATURES))
    (tmp_path / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    config = read_config(str(folder))
    config.has_lora_adapter = True
    with caplog.at_level("WARNING", logger=gs.__name__):
        gs.GraniteSpeechAudioProcessor.from_pretrained(tmp_path, config)
    assert "holds the release's LoRA adapter" in caplog.text
