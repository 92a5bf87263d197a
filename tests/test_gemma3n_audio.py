"""Gemma 3n's audio (``Gemma3nForConditionalGeneration``, :mod:`specray.models.gemma3n_audio` and the text model of
:mod:`specray.models.gemma3n`) against transformers on tiny random fp32 weights: a 16-bin Gemma3nAudioFeatureExtractor,
a Conformer of two blocks (hidden 32, 4 heads, attention 4 frames back to 2 ahead, a logit cap of 3, clipping at 2,
reduction 2, a two-conv sub-sampling of 8 and 4 channels), 32 audio soft tokens, Gemma 3n's text model of
tests/test_gemma3n.py (its per-layer table covering every id, so an audio token's own per-layer row shows), a Gemma
tokenizer whose ``<end_of_image>`` / ``<image_soft_token>`` and ``<end_of_audio>`` / ``<audio_soft_token>`` lie at
the vision and audio ``vocab_offset``s as in the releases. transformers' vision tower needs timm: the reference
model is built with a stand-in for it (images are refused here). Two synthetic audios (1.28 s and 2.45 s at 16 kHz,
a fixed seed).

Checked: our expanded prompt and each audio's features equal Gemma3nProcessor's (newlines joined with the prompt's);
each audio's rows (soft tokens, padding rows, ``<end_of_audio>``) equal what the whole model puts into its
inputs_embeds; the text model fed them equals the whole model's logits over a prefill, chunks splitting an audio's
span and single steps (two audios: against transformers' forward with each audio's features made alone, as specray
makes them; transformers' feature extractor pads a batch's shorter audio and counts three more of its frames
valid); each distinctive part undone moves the rows or the logits; two tensor-parallel ranks equal one; refusals by
name; ``LLM.generate`` with an audio and n-gram drafts equals ``generate``; ``LLM.chat`` takes an ``input_audio``
part."""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from specray_test_audio_checks import RATE, hf_processor, ours, wav_bytes, waves
from specray_test_image_checks import assert_ranks_equal_one_rank, config_with, encode_items, first_cut, image_logits
from specray_test_model_checks import max_diff
from tests.test_gemma3n import GEMMA3N, randomize

TOL, MOVED = 1e-4, 1e-3
SOFT, MEL = 32, 16
# the special tokens, in id order: <start_of_image>, <start_of_audio> in the text vocabulary; then the vision ids
# (vocab_offset = <end_of_image>'s, 4 of them), then the audio ids (vocab_offset = <end_of_audio>'s, 4: the last two
# only in the model's vocabulary, the last one the padding rows' id)
SPECIAL = ["<start_of_image>", "<start_of_audio>", "<end_of_image>", "<image_soft_token>", "<unused_v2>",
           "<unused_v3>", "<end_of_audio>", "<audio_soft_token>"]
AUDIO = dict(hidden_size=32, input_feat_size=MEL, conf_num_attention_heads=4, conf_num_hidden_layers=2,
             conf_attention_chunk_size=4, conf_attention_context_left=5, conf_attention_context_right=2,
             conf_attention_logit_cap=3.0, conf_conv_kernel_size=5, conf_reduction_factor=2,
             sscp_conv_channel_size=[8, 4], gradient_clipping=2.0, rms_norm_eps=1e-3, vocab_size=4)
AUDIO_TOKEN = "<audio_soft_token>"
# a chat prompt's shape ("user\n" before the first audio) and two adjacent audios: newlines to join
PROMPT = (f"<start_of_turn>user\n{AUDIO_TOKEN}{AUDIO_TOKEN}Describe the quick brown fox<end_of_turn>\n"
          "<start_of_turn>model\n")
ONE = f"<start_of_turn>user\n{AUDIO_TOKEN}Describe it<end_of_turn>\n<start_of_turn>model\n"
EXTRA = [7, 300, 41, 5, 99]
# Gemma 3n's chat template, cut to what these prompts use (an audio part renders <audio_soft_token>)
TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + ('model' if message['role'] == "
            "'assistant' else message['role']) + '\n' }}{% if message['content'] is string %}{{ message['content'] | "
            "trim }}{% else %}{% for item in message['content'] %}{% if item['type'] == 'audio' %}"
            "{{ '<audio_soft_token>' }}{% elif item['type'] == 'image' %}{{ '<image_soft_token>' }}"
            "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}"
            "{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}"
            "{% endif %}")


@contextlib.contextmanager
def no_vision_tower():
    """transformers' Gemma3nModel with an empty stand-in for its vision tower (timm's MobileNetV5: timm is not
    installed; the audio path never touches it)."""
    from transformers.models.gemma3n import modeling_gemma3n

    real = modeling_gemma3n.AutoModel

    class Auto:
        @staticmethod
        def from_config(config, **kwargs):
            return nn.Module() if config.model_type == "gemma3n_vision" else real.from_config(config, **kwargs)

    modeling_gemma3n.AutoModel = Auto
    try:
        yield
    finally:
        modeling_gemma3n.AutoModel = real


def build_tokenizer(path: Path):
    """conftest's Gemma-style tokenizer with runs of newlines as single tokens and :data:`SPECIAL` after its
    vocabulary, named as Gemma3nProcessor reads them (``boa_token``, ``audio_token``, ...)."""
    from transformers import GemmaTokenizer

    from tests.conftest import build_spm_tokenizer

    base = build_spm_tokenizer(path, "gemma")
    model = json.loads(base.backend_tokenizer.to_str())["model"]
    vocab = dict(model["vocab"])
    for token in ["\n" * n for n in (2, 3, 4)] + SPECIAL:
        vocab[token] = len(vocab)
    merges = [("\n", "\n"), ("\n\n", "\n"), ("\n\n", "\n\n")]
    merges += [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    names = dict(boi_token=0, boa_token=1, eoi_token=2, image_token=3, eoa_token=6, audio_token=7)
    tok = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True,
                         extra_special_tokens={name: SPECIAL[i] for name, i in names.items()})
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>", *SPECIAL[4:6]]})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return tok


@torch.no_grad()
def _visible(model) -> None:
    """Norms away from ones, the attention's queries and keys and per-dim scale spread (the cap, band and relative
    term show), the embedding doubled (greedy decoding loops now and then: n-gram drafts are accepted)."""
    randomize(model)
    for name, p in model.named_parameters():
        if "norm" in name and name.endswith(".weight") and p.dim() == 1:
            p.uniform_(0.5, 1.5)
        elif "audio_tower" in name and name.endswith(("q_proj.weight", "k_proj.weight", "pos_proj.weight")):
            p.normal_(0.0, 0.5)
        elif name.endswith("per_dim_scale"):
            p.normal_(0.0, 1.0)
        elif "audio_tower" in name and name.endswith(("ffw_layer_1.weight", "linear_start.weight")):
            p.normal_(0.0, 2 * p.shape[1] ** -0.5)
        elif name.endswith("embed_audio.embedding_projection.weight"):
            p.normal_(0.0, p.shape[1] ** -0.5)
    model.get_input_embeddings().weight.mul_(2.0)


def build(path: Path, seed: int = 0) -> Path:
    from transformers import (Gemma3nAudioConfig, Gemma3nAudioFeatureExtractor, Gemma3nConfig,
                              Gemma3nForConditionalGeneration, Gemma3nProcessor, Gemma3nTextConfig,
                              Gemma3nVisionConfig, SiglipImageProcessorPil)

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    ids = dict(zip(SPECIAL, tok.convert_tokens_to_ids(SPECIAL)))
    vision_offset, audio_offset = ids["<end_of_image>"], ids["<end_of_audio>"]
    vocab = audio_offset + AUDIO["vocab_size"]
    text = Gemma3nTextConfig(**{**GEMMA3N, "vocab_size": vocab, "vocab_size_per_layer_input": vocab,
                                "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
                                "bos_token_id": tok.bos_token_id})
    vision = Gemma3nVisionConfig(hidden_size=16, vocab_size=audio_offset - vision_offset, vocab_offset=vision_offset)
    config = Gemma3nConfig(text_config=text, vision_config=vision.to_dict(),
                           audio_config=Gemma3nAudioConfig(**AUDIO, vocab_offset=audio_offset).to_dict(),
                           audio_soft_tokens_per_image=SOFT, vision_soft_tokens_per_image=4,
                           boi_token_id=ids["<start_of_image>"], eoi_token_id=vision_offset,
                           image_token_id=ids["<image_soft_token>"], boa_token_id=ids["<start_of_audio>"],
                           eoa_token_id=audio_offset, audio_token_id=ids[AUDIO_TOKEN])
    config.architectures = ["Gemma3nForConditionalGeneration"]
    torch.manual_seed(seed)
    with no_vision_tower():
        model = Gemma3nForConditionalGeneration(config).float().eval()
    _visible(model)
    model.save_pretrained(path)
    Gemma3nProcessor(feature_extractor=Gemma3nAudioFeatureExtractor(feature_size=MEL),
                     image_processor=SiglipImageProcessorPil(), tokenizer=tok, audio_seq_length=SOFT,
                     image_seq_length=4, chat_template=TEMPLATE).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("tiny_gemma3n_audio") / "m")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import Gemma3nForConditionalGeneration

    with no_vision_tower():
        return Gemma3nForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def hf_inputs(folder: Path, text: str, audios: list) -> dict:
    return hf_processor(folder)(text=[text], audio=audios, return_tensors="pt")


def expanded(folder: Path, text: str, audios: list):
    from transformers import AutoTokenizer

    from specray.multimodal import expand_prompt

    return expand_prompt(AutoTokenizer.from_pretrained(folder).encode(text), [], ours(folder)[1], audios=audios)


@contextlib.contextmanager
def each_audio_alone(hf, features: list[torch.Tensor]):
    """transformers' forward with its audio features made per audio alone (``features``: each audio's
    ``input_features`` [1, F_i, mel] from the processor given that audio only), its own padding of them
    (invalid rows, up to ``audio_soft_tokens_per_image``) and scatter: the encoder's rows over each alone, the
    rows past an audio's own marked as padding."""
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nAudioEncoderModelOutput

    real = hf.model.get_audio_features

    def per_audio(input_features, input_features_mask, **kwargs):
        outs = [real(f, torch.zeros(f.shape[:2], dtype=torch.bool), return_dict=True) for f in features]
        longest = max(o.pooler_output.shape[1] for o in outs)
        rows = torch.zeros(len(outs), longest, outs[0].pooler_output.shape[-1])
        padded = torch.ones(len(outs), longest, dtype=torch.bool)
        for i, o in enumerate(outs):
            rows[i, : o.pooler_output.shape[1]] = o.pooler_output[0]
            padded[i, : o.pooler_output.shape[1]] = o.audio_mel_mask[0]
        return Gemma3nAudioEncoderModelOutput(pooler_output=rows, audio_mel_mask=padded)

    hf.model.get_audio_features = per_audio
    try:
        yield
    finally:
        del hf.model.get_audio_features


def alone_features(folder: Path, audios: list) -> list[torch.Tensor]:
    return [hf_processor(folder).feature_extractor([a], return_tensors="pt")["input_features"] for a in audios]


@torch.no_grad()
def hf_logits(hf, folder: Path, text: str, audios: list, extra=()) -> torch.Tensor:
    """transformers' logits over ``text`` with ``audios`` (one: its processor's output as it is; several: each
    audio's features made alone) and ``extra`` tokens."""
    inputs = hf_inputs(folder, text, audios)
    ids = torch.cat([inputs["input_ids"], torch.tensor([list(extra)], dtype=torch.long)], dim=1)
    args = dict(input_ids=ids, input_features=inputs["input_features"],
                input_features_mask=inputs["input_features_mask"])
    if len(audios) == 1:
        return hf(**args).logits[0]
    with each_audio_alone(hf, alone_features(folder, audios)):
        return hf(**args).logits[0]


@torch.no_grad()
def hf_embeds(hf, folder: Path, text: str, audios: list) -> torch.Tensor:
    """The inputs_embeds the whole model hands its language model (caught from its forward)."""
    caught = []
    hook = hf.model.language_model.register_forward_pre_hook(
        lambda m, args, kwargs: caught.append(kwargs["inputs_embeds"][0]), with_kwargs=True)
    try:
        hf_logits(hf, folder, text, audios)
    finally:
        hook.remove()
    return caught[0]


# ---- the processor and the encoder -----------------------------------------------------------------------------------

@pytest.mark.parametrize("count", [1, 2])
def test_processor_equals_transformers(folder, count):
    """Our expanded prompt equals Gemma3nProcessor's (the replacement's newlines joined with the chat prompt's, two
    adjacent audios' with each other); each audio's features and mask equal its processor's for that audio alone,
    and the first rows of its features in a batch of two (where the shorter's three last frames, completed by the
    padding, count as valid: our processor gives each audio its own)."""
    text, audios = (ONE, waves()[1:]) if count == 1 else (PROMPT, waves())
    theirs = hf_inputs(folder, text, audios)
    ids, mm = expanded(folder, text, audios)
    assert ids == theirs["input_ids"][0].tolist()
    config = json.loads((folder / "config.json").read_text())
    for item in mm.items:
        assert ids[item.offset: item.end] == [config["audio_token_id"]] * SOFT + [config["eoa_token_id"]]
    for i, (item, audio) in enumerate(zip(mm.items, audios)):
        alone = hf_inputs(folder, ONE, [audio])
        features, mask = item.data["input_features"], item.data["input_features_mask"]
        assert np.array_equal(features, alone["input_features"][0].numpy())
        assert np.array_equal(mask, alone["input_features_mask"][0].numpy()) and mask.all()
        assert np.array_equal(features, theirs["input_features"][i, : len(features)].numpy())
    if count == 2:
        assert theirs["input_features_mask"][0].sum() == len(mm.items[0].data["input_features"]) + 3


@pytest.mark.parametrize("count", [1, 2])
def test_encoder_rows_equal_transformers(folder, hf, count):
    """Each audio's rows (its soft tokens', the padding rows up to audio_soft_tokens_per_image, <end_of_audio>'s
    through embed_audio) equal what the whole model puts into the inputs_embeds at those tokens."""
    text, audios = (ONE, waves()[1:]) if count == 1 else (PROMPT, waves())
    ids, mm = expanded(folder, text, audios)
    want = hf_embeds(hf, folder, text, audios)
    rows = encode_items(ours(folder)[0], mm)
    for item, got in zip(mm.items, rows):
        assert got.shape == (SOFT + 1, 64)
        assert max_diff(got, want[item.offset: item.end]) < TOL


def test_encoder_equals_get_audio_features(folder, hf):
    """The tower and embed_audio's soft path equal transformers' get_audio_features (audio tower + embed_audio) at
    every valid row, over each audio alone."""
    encoder = ours(folder)[0]
    for features in alone_features(folder, waves()):
        mask = torch.ones(features.shape[:2], dtype=torch.bool)
        with torch.no_grad():
            want = hf.model.get_audio_features(features, ~mask, return_dict=True).pooler_output[0]
            hidden, valid = encoder.tower(features, mask)
            got = encoder.embedder.soft(hidden[0])
        assert valid.all() and got.shape == want.shape
        assert max_diff(got, want) < TOL


def test_tower_over_padded_frames_equals_transformers(folder, hf):
    """Over transformers' batch of two (the shorter audio's frames padded and masked) the tower equals
    get_audio_features at every row, padded ones included (the mask taken at each row's first frame, padded keys
    masked, padded rows zeroed before the light conv and at the end), and marks the same rows padded."""
    theirs = hf_inputs(folder, PROMPT, waves())
    features, mask = theirs["input_features"], theirs["input_features_mask"]
    encoder = ours(folder)[0]
    with torch.no_grad():
        want = hf.model.get_audio_features(features, ~mask, return_dict=True)
        hidden, valid = encoder.tower(features, mask)
        got = encoder.embedder.soft(hidden)
    assert torch.equal(valid, ~want.audio_mel_mask) and not valid[0].all()
    assert max_diff(got, want.pooler_output) < TOL


# ---- the whole model -------------------------------------------------------------------------------------------------

CASES = {"one-prefill": (ONE, 1, False), "one-chunked": (ONE, 1, True), "two-chunked": (PROMPT, 2, True)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_with_audio_equal_transformers(folder, hf, case):
    """transformers' whole-model logits over the prompt with its audio(s) and EXTRA tokens == our Gemma 3n text
    model's (through _TEXT_PARTS) with the encoder's rows in place: one prefill, or a chunk ending inside the first
    audio's span, then the rest, then single steps."""
    from specray.models.loader import load_model

    text, count, chunked = CASES[case]
    audios = waves()[1:] if count == 1 else waves()
    ids, mm = expanded(folder, text, audios)
    sizes = [first_cut(mm), len(ids) - first_cut(mm)] if chunked else None
    got = image_logits(load_model(str(folder)), ids + EXTRA, mm, encode_items(ours(folder)[0], mm), sizes)
    assert max_diff(got, hf_logits(hf, folder, text, audios, EXTRA)) < TOL


# ---- each part shows -------------------------------------------------------------------------------------------------

def _per_frame_norm(encoder):  # the group norm's statistics over each frame alone, not cumulative over time
    from specray.models.gemma3n_audio import CumulativeGroupNorm

    def forward(x, norm):
        xf = x.float()
        mean = xf.mean(dim=(2, 3), keepdim=True)
        var = (xf - mean).pow(2).mean(dim=(2, 3), keepdim=True)
        return ((xf - mean) * torch.rsqrt(var + norm.eps) * norm.weight).to(x.dtype)
    for m in encoder.modules():
        if isinstance(m, CumulativeGroupNorm):
            m.forward = lambda x, norm=m: forward(x, norm)


def _attention(encoder, **changes):
    from specray.models.gemma3n_audio import LocalAttention

    for m in encoder.modules():
        if isinstance(m, LocalAttention):
            for name, value in changes.items():
                setattr(m, name, value)
                if name in ("left", "right"):  # the relative term's distances too
                    setattr(m.relative_position_embedding, name, value)


def _no_relative_term(encoder):
    for block in encoder.tower.conformer:
        block.attention.attn.relative_position_embedding.pos_proj.weight.zero_()


def _no_per_dim_scale(encoder):  # softplus(per_dim_scale) = softplus(0), the queries' initial scale
    for block in encoder.tower.conformer:
        block.attention.attn.per_dim_scale.zero_()


def _no_clipping(encoder):
    for m in encoder.modules():
        if hasattr(m, "clip") and isinstance(m.clip, float):
            m.clip = float("inf")


def _symmetric_conv(encoder):  # the light conv centred, not causal
    import torch.nn.functional as F

    for block in encoder.tower.conformer:
        conv = block.lconv1d
        k = conv.kernel

        def depthwise(h, layer=conv.depthwise_conv1d, k=k):
            return F.conv1d(F.pad(h[..., k - 1:], ((k - 1) // 2, k - 1 - (k - 1) // 2)), layer.weight,
                            groups=layer.groups)
        conv.depthwise_conv1d.forward = depthwise


def _full_residual(encoder):  # the feed-forwards' half steps as whole ones
    for block in encoder.tower.conformer:
        block.ffw_layer_start.scale = block.ffw_layer_end.scale = 1.0


def _no_reduction(encoder):  # every row kept, the first audio_soft_tokens_per_image taken
    encoder.tower.reduction = 1


def _zero_padding_rows(encoder):  # the rows past the audio's as zeros, not embed_audio's last id
    encode = encoder.encode

    def zeroed(data):
        rows = encode(data)
        count = encoder.tower(data["input_features"][None], data["input_features_mask"][None])[0].shape[1]
        rows[count:-1] = 0.0
        return rows
    encoder.encode = zeroed


def _soft_norm_as_hard(encoder):  # the soft tokens normed by the hard embeddings' norm
    encoder.embedder.soft_embedding_norm = encoder.embedder.hard_embedding_norm


ENCODER_MUTATIONS = {
    "per-frame-group-norm": _per_frame_norm, "no-relative-term": _no_relative_term,
    "no-logit-cap": lambda e: _attention(e, cap=1e9), "no-per-dim-scale": _no_per_dim_scale,
    "no-right-context": lambda e: _attention(e, right=0), "wider-left-context": lambda e: _attention(e, left=8),
    "no-clipping": _no_clipping, "centred-light-conv": _symmetric_conv, "full-residual": _full_residual,
    "no-reduction": _no_reduction, "zero-padding-rows": _zero_padding_rows, "soft-norm-as-hard": _soft_norm_as_hard,
}


@pytest.mark.parametrize("mutation", sorted(ENCODER_MUTATIONS))
def test_each_encoder_part_shows_in_the_rows(folder, hf, mutation):
    """Each part of the encoder done otherwise moves the rows away from the whole model's (the longer audio)."""
    _, mm = expanded(folder, ONE, waves()[1:])
    encoder = ours(folder)[0]
    with torch.no_grad():
        ENCODER_MUTATIONS[mutation](encoder)
    got = encode_items(encoder, mm)[0]
    item = mm.items[0]
    assert max_diff(got, hf_embeds(hf, folder, ONE, waves()[1:])[item.offset: item.end]) > MOVED


def _pad_id_per_layer(model):  # the per-layer inputs' token half reading the pad id at audio rows (Gemma 4's way)
    from specray.models.gemma4 import Gemma4Model

    inner, real = model.model, model.model.per_layer_inputs

    def forward(input_ids, meta, *args, **kwargs):
        inner.per_layer_inputs = lambda ids, x: real(Gemma4Model.text_ids(inner, input_ids, meta), x)
        return type(inner).forward(inner, input_ids, meta, *args, **kwargs)
    inner.forward = forward


def _per_layer_from_table(model):  # the per-layer inputs' projected half from the token table, not the audio rows
    inner, real = model.model, model.model.per_layer_inputs
    inner.per_layer_inputs = lambda ids, x: real(ids, inner.embed(ids))


def _scaled_rows(model):  # the audio rows scaled by sqrt(hidden) as the token embeddings are
    inner = model.model

    def forward(input_ids, meta, *args, **kwargs):
        if meta.input_embeds is not None:
            rows, values = meta.input_embeds
            meta.input_embeds = (rows, values * inner.embed_scale)
        return type(inner).forward(inner, input_ids, meta, *args, **kwargs)
    inner.forward = forward


MODEL_MUTATIONS = {"pad-id-per-layer": _pad_id_per_layer, "per-layer-from-table": _per_layer_from_table,
                   "scaled-audio-rows": _scaled_rows, "end-of-audio-from-text-table": None}


@pytest.mark.parametrize("mutation", sorted(MODEL_MUTATIONS))
def test_each_model_part_shows_in_the_logits(folder, hf, mutation):
    """How the text model takes the rows, done otherwise, moves the logits away from transformers'."""
    from specray.models.loader import load_model

    ids, mm = expanded(folder, ONE, waves()[1:])
    model = load_model(str(folder))
    rows = encode_items(ours(folder)[0], mm)
    if MODEL_MUTATIONS[mutation] is None:  # <end_of_audio> embedded from the text table, as before this module
        import dataclasses

        mm.items[0] = dataclasses.replace(mm.items[0], length=SOFT)
        rows = [r[:SOFT] for r in rows]
    else:
        MODEL_MUTATIONS[mutation](model)
    got = image_logits(model, ids + EXTRA, mm, rows, None)
    assert max_diff(got, hf_logits(hf, folder, ONE, waves()[1:], EXTRA)) > MOVED


# ---- refusals --------------------------------------------------------------------------------------------------------

def test_refusals(folder, tmp_path):
    """Images, an audio giving more rows than audio_soft_tokens_per_image, one longer than the feature extractor
    keeps, one too short for a frame, a 2-D one; a processor_config.json whose audio_seq_length differs, a feature
    extractor with dither or of another width; a sub-sampling of three convs, heads not dividing the width; a
    checkpoint lacking a tensor of the tower or embed_audio: each refused by name."""
    from safetensors.torch import load_file

    from specray.models.gemma3n_audio import Gemma3nAudioEncoder, Gemma3nAudioProcessor
    from specray.models.loader import read_config

    processor = ours(folder)[1]
    with pytest.raises(ValueError, match="34 rows, more than audio_soft_tokens_per_image=32"):
        processor.process_audio(waves((2.7,))[0])
    assert len(processor.process_audio(waves((2.55,))[0]).embed_rows) == SOFT + 1
    most = processor.max_audio_samples  # the longest it takes (the server's transcriptions cut clips of it)
    assert 2.55 * RATE < most < 2.7 * RATE
    assert len(processor.process_audio(np.zeros(most, np.float32)).embed_rows) == SOFT + 1
    with pytest.raises(ValueError, match="more than audio_soft_tokens_per_image"):
        processor.process_audio(np.zeros(most + 1, np.float32))
    with pytest.raises(ValueError, match=r"longer than .* \(30 s"):
        processor.process_audio(np.zeros(480_001, np.float32))
    with pytest.raises(ValueError, match="too short for one frame"):
        processor.process_audio(np.ones(400, np.float32))
    with pytest.raises(ValueError, match="non-empty 1-D waveform"):
        processor.process_audio(np.zeros((2, 100), np.float32))
    with pytest.raises(ValueError, match="images are not served .*MobileNetV5"):
        processor.process(None)
    assert processor.image_token_id is None
    config = read_config(str(folder))
    copy = shutil.copytree(folder, tmp_path / "m")
    saved = json.loads((copy / "processor_config.json").read_text())
    (copy / "processor_config.json").write_text(json.dumps({**saved, "audio_seq_length": 30}))
    with pytest.raises(ValueError, match="audio_seq_length=30 but config.json's audio_soft_tokens_per_image=32"):
        Gemma3nAudioProcessor.from_pretrained(copy, config)
    extractor = processor.extractor
    with pytest.raises(ValueError, match="dither=0.5"):
        extractor.dither = 0.5
        Gemma3nAudioProcessor(extractor, config, processor.replacement, processor.newlines)
    extractor.dither = 0.0
    with pytest.raises(ValueError, match="input_feat_size=8"):
        Gemma3nAudioProcessor(extractor, config_with(folder, audio_config__input_feat_size=8), processor.replacement,
                              processor.newlines)
    with pytest.raises(ValueError, match="sscp_conv_channel_size=.*two convs"):
        Gemma3nAudioEncoder(config_with(folder, audio_config__sscp_conv_channel_size=[8, 4, 4]))
    with pytest.raises(ValueError, match="hidden_size=32 must be even and divisible by conf_num_attention_heads=5"):
        Gemma3nAudioEncoder(config_with(folder, audio_config__conf_num_attention_heads=5))
    encoder = Gemma3nAudioEncoder(config)
    tensors = load_file(str(folder / "model.safetensors"))
    for name in ("model.embed_audio.soft_embedding_norm.weight",
                 "model.audio_tower.conformer.1.attention.attn.per_dim_scale"):
        with pytest.raises(ValueError, match=name.split(".", 2)[2].split(".", 1)[1]):
            encoder.load_weights((n, t) for n, t in tensors.items() if n != name)


# ---- tensor parallel and the engine ----------------------------------------------------------------------------------

def test_tensor_parallel_two_ranks_equal_one(folder, tmp_path):
    """The text model split over two tensor-parallel ranks (the encoder whole on each) gives one rank's logits with
    two audios' rows in place, a chunk ending inside the first audio's span, then single steps."""
    ids, mm = expanded(folder, PROMPT, waves())
    assert_ranks_equal_one_rank(tmp_path, [(folder, ids + EXTRA, mm, [first_cut(mm), len(ids) - first_cut(mm)])],
                                1, TOL)


def test_engine_greedy_with_audio_equals_transformers(folder, hf):
    """LLM.generate with an audio (chunks of 16 tokens split its span; n-gram drafts) gives transformers' greedy
    generate's tokens beside a text-only prompt; without the audio transformers generates other tokens."""
    from specray import LLM
    from specray_test_engine_runs import assert_images_greedy_equals_transformers

    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    audio = waves()[1]
    assert_images_greedy_equals_transformers(llm, hf, hf_processor(folder), ONE, [(audio, RATE)], max_tokens=24,
                                             modality="audio", inputs=hf_inputs(folder, ONE, [audio]))


def test_chat_with_an_input_audio_part(folder, hf):
    """LLM.chat with an OpenAI input_audio part (a WAV, base64) renders <audio_soft_token> through the chat template
    and gives transformers' greedy tokens for that prompt and the decoded audio."""
    from specray import LLM, SamplingParams

    data = wav_bytes(waves()[0])
    decoded = np.frombuffer(data[44:], "<i2").astype(np.float32) / 32768.0
    llm = LLM(model=str(folder), max_model_len=256, block_size=4, max_num_batched_tokens=32)
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}},
        {"type": "text", "text": "Describe it"}]}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    inputs = hf_inputs(folder, ONE, [decoded])  # (its tokenizer adds the <bos> the template renders)
    with torch.no_grad():
        want = hf.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
    assert list(out.prompt_token_ids) == inputs["input_ids"][0].tolist()  # one <bos>, the audio expanded
    assert list(out.outputs[0].token_ids) == want
