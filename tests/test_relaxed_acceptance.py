"""Relaxed acceptance (TensorRT-LLM's, for a reasoning model's thinking phase; lossy and opt-in) through the engine:
inside the phase every kept token is one of the target's candidates there, outside it every token is the target's
argmax, and with no phase (or top-1) the output is plain greedy output. Its configuration and the scheduler's
phase tracking. The verification rule itself is tested in test_tree_verification.py."""

import pytest
import torch

from specray import LLM, SamplingParams, SpeculativeConfig
from specray.scheduler.request import Request
from specray_test_engine_runs import check_candidates  # tests/engine_runs.py (registered by conftest)

PROMPTS = [
    "def add(a, b):\n    return a + b\ndef add(a, b):\n    return",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Hello world! Hello world! Hello",
    "for i in range(10):\n    print(i)\nfor i in range(10):",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
TOPK, DELTA = 4, 2.0


def greedy(n=32):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_untied_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_untied_dir))


@pytest.fixture(scope="module")
def hf_model(tiny_llama_untied_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_untied_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_untied_dir):
    llm = LLM(model=str(tiny_llama_untied_dir), max_model_len=256)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]


def relaxed_llm(model_dir, **kw) -> LLM:
    spec = {**NGRAM, "acceptance": "relaxed", **kw}
    return LLM(model=str(model_dir), max_model_len=256, speculative_config=spec)


def phase_tokens(tokenizer, plain_outputs) -> tuple[int, int]:
    """A token every prompt holds (the phase begins in the prompt) and one the first plain output produces
    midway (it may end there)."""
    common = set.intersection(*(set(tokenizer.encode(p)) for p in PROMPTS))
    assert common, "the prompts share no token"
    begin = min(common)
    end = next(t for t in plain_outputs[0][8:] if t != begin)
    return begin, end


def test_relaxed_keeps_candidates_inside_the_thinking_phase_and_the_argmax_outside(tiny_llama_untied_dir, tokenizer,
                                                                                   hf_model, plain_outputs):
    """Every kept token inside the phase is a candidate there (and some are not the argmax: the relaxation ran),
    every token outside it the argmax; the phase ends and begins again as the output's own tokens say."""
    begin, end = phase_tokens(tokenizer, plain_outputs)
    llm = relaxed_llm(tiny_llama_untied_dir, relaxed_topk=TOPK, relaxed_delta=DELTA, begin_thinking_phase_token=begin,
                      end_thinking_phase_token=end)
    start = llm.engine.scheduler.block_manager.num_free_blocks
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
    off = sum(check_candidates(hf_model, tokenizer.encode(p), out, begin, end, TOPK, DELTA)
              for p, out in zip(PROMPTS, outs))
    assert off > 0 and outs != plain_outputs
    assert llm.spec_stats.accepted_tokens > 0
    assert llm.engine.scheduler.block_manager.num_free_blocks == start


@pytest.mark.parametrize("kw", [{"relaxed_topk": 1, "relaxed_delta": 5.0}, {"relaxed_topk": TOPK, "relaxed_delta": 0.0},
                                "no phase"], ids=["top-1", "delta-0", "no-phase"])
def test_relaxed_without_room_to_relax_is_plain_greedy(tiny_llama_untied_dir, tokenizer, plain_outputs, kw):
    """Top-1, a zero delta (only exact ties), or a phase that never begins (a token neither prompts nor outputs
    hold): token for token the plain greedy output."""
    begin, end = phase_tokens(tokenizer, plain_outputs)
    if kw == "no phase":
        seen = {t for p in PROMPTS for t in tokenizer.encode(p)} | {t for o in plain_outputs for t in o}
        begin = next(t for t in range(len(tokenizer)) if t not in seen)
        kw = {"relaxed_topk": TOPK, "relaxed_delta": DELTA}
    llm = relaxed_llm(tiny_llama_untied_dir, begin_thinking_phase_token=begin, end_thinking_phase_token=end, **kw)
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
    assert outs == plain_outputs
    assert llm.spec_stats.accepted_tokens > 0


@pytest.mark.parametrize("kw, match", [
    ({}, "begin_thinking_phase_token"),  # the tiny tokenizer has no <think>
    ({"begin_thinking_phase_token": 5}, "end_thinking_phase_token"),
    ({"begin_thinking_phase_token": 5, "end_thinking_phase_token": 10 ** 6}, "outside the model's vocabulary"),
])
def test_relaxed_needs_the_thinking_phase_tokens(tiny_llama_untied_dir, kw, match):
    with pytest.raises(ValueError, match=match):
        relaxed_llm(tiny_llama_untied_dir, **kw)


class FakeTokenizer:
    def get_vocab(self):
        return {"<think>": 7, "</think>": 8, "a": 9}


def test_thinking_tokens_default_to_the_tokenizers():
    from specray.engine.builder import thinking_tokens

    spec = SpeculativeConfig(acceptance="relaxed")
    assert thinking_tokens(spec, FakeTokenizer(), 10) == (7, 8)
    assert thinking_tokens(SpeculativeConfig(acceptance="relaxed", end_thinking_phase_token=9), FakeTokenizer(),
                           10) == (7, 9)
    assert thinking_tokens(SpeculativeConfig(), FakeTokenizer(), 10) is None  # rejection: no phase tracked
    with pytest.raises(ValueError, match="same token"):
        thinking_tokens(SpeculativeConfig(acceptance="relaxed", end_thinking_phase_token=7), FakeTokenizer(), 10)


@pytest.mark.parametrize("kw, match", [
    ({"relaxed_topk": 0}, "relaxed_topk=0"), ({"relaxed_topk": True}, "relaxed_topk=True"),
    ({"relaxed_delta": -0.1}, "relaxed_delta=-0.1"), ({"relaxed_delta": "1"}, "relaxed_delta='1'"),
    ({"begin_thinking_phase_token": -1}, "begin_thinking_phase_token=-1"),
    ({"begin_thinking_phase_token": 3, "end_thinking_phase_token": 3}, "both 3"),
    ({"acceptance": "lenient"}, "acceptance='lenient'"),
    ({"use_relaxed_acceptance_for_thinking": True, "acceptance": "typical"}, "use_relaxed_acceptance_for_thinking"),
    ({"use_relaxed_acceptance_for_thinking": "yes"}, "use_relaxed_acceptance_for_thinking='yes'"),
])
def test_bad_relaxed_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(method="ngram", **kw)


def test_relaxed_settings_round_trip_and_tensorrt_llm_spelling():
    spec = SpeculativeConfig.from_any({"method": "mtp", "max_draft_len": 3, "use_relaxed_acceptance_for_thinking": True,
                                       "relaxed_topk": 10, "relaxed_delta": 0.6, "begin_thinking_phase_token": 5,
                                       "end_thinking_phase_token": 6})
    assert spec.acceptance == "relaxed" and spec.relaxed_acceptance == (10, 0.6)
    assert SpeculativeConfig.from_any(spec.to_dict()).to_dict() == spec.to_dict()
    assert spec.to_dict()["end_thinking_phase_token"] == 6
    assert SpeculativeConfig(use_relaxed_acceptance_for_thinking=False).acceptance == "rejection"
    assert SpeculativeConfig().relaxed_acceptance is None


def test_request_tracks_the_span_incrementally_and_after_truncation():
    req = Request("r", [1, 5, 2], SamplingParams(temperature=0.0))
    assert req.inside(5, 6)
    for token, want in ((3, True), (6, False), (4, False), (5, True)):
        req.append_tokens([token], 1024)
        assert req.inside(5, 6) == want, token
    req.truncate_output(2)  # [1, 5, 2, 3, 6]: the span ended
    assert not req.inside(5, 6)
    req.truncate_output(1)  # [1, 5, 2, 3]
    assert req.inside(5, 6)
    assert not Request("s", [1, 2], SamplingParams()).inside(5, 6)
