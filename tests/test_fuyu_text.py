"""Fuyu's text model (``FuyuForCausalLM``, model type ``fuyu``: Persimmon behind a linear patch embedder), served
text-only through ``registry._TEXT_PARTS`` as :class:`specray.models.persimmon.PersimmonForCausalLM`: on a tiny random
release (fp32) the logits of a text-only prompt equal transformers' whole model's over a prefill and over chunks and
single steps, the patch embedder's tensors are not read, and the engine's greedy output with n-gram drafts equals
transformers' ``generate``."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from specray.models.loader import load_model
from specray.models.persimmon import PersimmonForCausalLM
from specray_test_model_checks import SCHEDULES, chunked_logits, max_diff, prompt, reference_logits  # model_checks.py

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_fuyu_dir(tmp_path_factory) -> Path:
    import transformers as tf

    from tests.conftest import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny_fuyu")
    tok = build_tiny_tokenizer(path)
    text = tf.PersimmonConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=256, partial_rotary_factor=0.5,
                              qk_layernorm=True, eos_token_id=tok.eos_token_id, initializer_range=0.1)
    config = tf.FuyuConfig(text_config=text.to_dict(), patch_size=4, num_channels=3, image_token_id=len(tok) - 1)
    torch.manual_seed(5)
    model = tf.FuyuForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # norms and biases random (ones / zeros at init), so a wrong one shows
        for name, param in model.named_parameters():
            if name.endswith(("layernorm.weight", "norm.weight")):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_text_logits_match_transformers_whole_model(tiny_fuyu_dir, schedule, caplog):
    from transformers import FuyuForCausalLM

    with caplog.at_level(logging.WARNING):
        model = load_model(str(tiny_fuyu_dir))
    assert isinstance(model, PersimmonForCausalLM)
    assert "ignoring checkpoint tensor" not in caplog.text
    want = reference_logits(tiny_fuyu_dir, FuyuForCausalLM)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), want) < TOL


def test_engine_greedy_with_ngram_drafts_equals_transformers(tiny_fuyu_dir):
    from transformers import FuyuForCausalLM

    sys.modules["specray_test_engine_runs"].assert_ngram_greedy_equals_transformers(tiny_fuyu_dir, FuyuForCausalLM)
