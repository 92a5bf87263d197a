"""OpenAI's Predicted Outputs (``SamplingParams.prediction``, the ``prediction`` drafter): drafts follow the
expected output and find their place again after an edit; greedy and seeded output is plain decoding's whatever
the prediction; a prediction is dropped where the engine cannot draft from it; bad ones are refused."""

import dataclasses

import pytest

from specray import LLM, SamplingParams
from specray.config import SpeculativeConfig
from specray.drafters.base import DraftRequest, DrafterContext
from specray.drafters.prediction import PredictionDrafter
import specray_test_draft_heads as draft_heads  # tests/draft_heads.py, via conftest
from specray_test_engine_runs import PROMPTS, greedy, token_ids  # tests/engine_runs.py, via conftest

NGRAM = {"method": "ngram", "num_speculative_tokens": 6}


def drafter(**options) -> PredictionDrafter:
    spec = SpeculativeConfig(method="prediction", num_speculative_tokens=4, **options)
    return PredictionDrafter(spec, DrafterContext("m", vocab_size=100, max_model_len=256, max_num_seqs=4))


def ask(d: PredictionDrafter, prompt: list[int], output: list[int], prediction: list[int], k: int = 4):
    params = SamplingParams(prediction=prediction)
    proposal = d.propose([DraftRequest("r", prompt + output, k, params, num_prompt_tokens=len(prompt))])[0]
    return proposal.token_ids, proposal.key


def test_drafts_follow_the_prediction_and_find_it_again_after_an_edit():
    d = drafter()
    prediction = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 12, 13, 30, 31]
    prompt = [1, 2, 3]
    assert ask(d, prompt, [], prediction) == ([10, 11, 12, 13], d.IN_STEP)  # the output starts at the prediction
    assert ask(d, prompt, [10, 11, 12], prediction) == ([13, 14, 15, 16], d.IN_STEP)  # kept 2 + the target's own
    # an edit: 99 replaces 13 14; the output rejoins at 15 and the drafts follow from there
    assert ask(d, prompt, [10, 11, 12, 99], prediction) == ([], None)  # 99 is nowhere in the prediction
    assert ask(d, prompt, [10, 11, 12, 99, 15], prediction) == ([16, 17, 18, 19], 1)
    assert ask(d, prompt, [10, 11, 12, 99, 15, 16, 17], prediction) == ([18, 19, 20, 21], d.IN_STEP)
    # "12 13" occurs twice: the occurrence nearest the cursor, forward, is taken (its continuation is 30 31)
    out = [10, 11, 12, 99, 15, 16, 17, 18, 19, 20, 21, 50, 12, 13]
    assert ask(d, prompt, out, prediction) == ([30, 31], 2)
    assert ask(d, prompt, out + [30, 31], prediction) == ([], None)  # the prediction is used up
    assert ask(d, prompt, out + [30, 31], prediction, k=0) == ([], None)
    # min_match_len: a 1-token match is not enough
    strict = drafter(min_match_len=2)
    assert ask(strict, prompt, [], prediction)[0] == [10, 11, 12, 13]
    assert ask(strict, prompt, [10, 99, 15], prediction) == ([], None)
    assert ask(strict, prompt, [10, 99, 15, 16], prediction) == ([17, 18, 19, 20], 2)
    # a prediction that does not match: the request's own text drafts instead (prompt lookup), under keys of its own
    own = drafter()
    tokens, key = ask(own, prompt, [7, 8, 9, 7, 8], list(range(50, 60)))
    assert tokens[:2] == [9, 7] and key == ("own", 2)
    own.finish(["r"])
    assert not own._states and not own._own._indexes and not own._own._requests  # both forget the request
    d.finish(["r"])
    assert not d._states
    with pytest.raises(ValueError, match="max_match_len=1 must be an int >= 2"):
        drafter(min_match_len=2, max_match_len=1)


@pytest.fixture(scope="module")
def expected(plain):
    """Plain greedy outputs of the first four prompts (32 tokens each)."""
    return token_ids(plain.generate(PROMPTS[:4], greedy(32), use_tqdm=False))


def edited(ids: list[int]) -> list[int]:
    """A prediction that is the output with an edit in the middle and a different end."""
    return ids[:10] + [5, 6, 7] + ids[14:26]


def test_greedy_output_is_plains_with_any_prediction(tiny_llama_dir, expected):
    """A batch mixing exact, edited, unrelated and no predictions, as text and as ids, on an engine drafting with
    ngram (requests with a prediction are routed to it) and on one whose method is prediction itself: each output
    is plain decoding's; an exact prediction is accepted whole."""
    for spec in (NGRAM, {"method": "prediction", "num_speculative_tokens": 6}):
        llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec)
        text = llm.get_tokenizer().decode(expected[1])
        predictions = [expected[0], edited(expected[1]), list(range(40, 60)), None]
        params = [greedy(32, prediction=p) for p in predictions] + [greedy(32, prediction=text)]
        outs = llm.generate(PROMPTS[:4] + PROMPTS[1:2], params, use_tqdm=False)
        assert token_ids(outs) == expected + expected[1:2]
        exact = outs[0].spec_stats
        assert exact.draft_tokens > 0 and exact.accepted_tokens == exact.draft_tokens
        assert outs[1].spec_stats.accepted_tokens > 0
        own = spec["method"] == "prediction"
        predicting = llm.engine.drafter if own else llm.engine.router._built["prediction"]
        assert isinstance(predicting, PredictionDrafter) and not predicting._states  # every request's state freed


def test_seeded_sampling_is_plains_with_a_prediction(tiny_llama_dir, plain):
    """Drafts without a q are verified by coupling: a seeded sampled request's output is plain decoding's,
    token for token, whatever the prediction."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=32, ignore_eos=True)
    want = token_ids(plain.generate(PROMPTS[:3], params, use_tqdm=False))
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM)
    with_prediction = [dataclasses.replace(params, prediction=edited(ids)) for ids in want]
    outs = llm.generate(PROMPTS[:3], with_prediction, use_tqdm=False)
    assert token_ids(outs) == want
    assert sum(o.spec_stats.accepted_tokens for o in outs) > 0


def test_a_head_combined_with_the_prediction_drafter(make_tiny_model, tmp_path_factory):
    """An EAGLE-3 head with ``combine_with: "prediction"``: a request with a prediction verifies whichever drafts
    the policy prices higher, the head's or the prediction's, and one without has the head's alone; greedy output
    is plain decoding's. The head here is random (its drafts are almost never kept), so the exact prediction's
    request keeps many drafts only through the prediction; without combine_with the prediction is dropped."""
    target = make_tiny_model(tmp_path_factory.mktemp("target"), "llama", num_hidden_layers=6,
                             tie_word_embeddings=True)
    head = draft_heads.write_random_head(tmp_path_factory.mktemp("eagle3"), "eagle3", target)
    want = token_ids(LLM(model=str(target), max_model_len=256).generate(PROMPTS[:4], greedy(32), use_tqdm=False))
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 4}
    predictions = [want[0], edited(want[1]), None, list(range(40, 60))]
    for combined in (True, False):
        llm = LLM(model=str(target), max_model_len=256,
                  speculative_config={**spec, "combine_with": "prediction"} if combined else spec)
        policy = llm.engine.policy
        for n in range(1, 41):  # a step's fixed cost dominates, as for real models (a tiny one's has none)
            policy.observe_step(n, 8, 0.05 + 0.001 * n)
        policy.observe_step = lambda *args: None
        for _ in range(2):  # the second time the policy knows from the first what each kind of draft is worth
            outs = llm.generate(PROMPTS[:4], [greedy(32, prediction=p) for p in predictions], use_tqdm=False)
            assert token_ids(outs) == want
        kept = outs[0].spec_stats.accepted_tokens
        assert kept >= 8 if combined else kept <= 2, (combined, [o.spec_stats.as_dict() for o in outs])


def test_a_prediction_is_dropped_where_it_cannot_be_drafted_from(tiny_llama_dir, plain, expected):
    """No speculation, or the request's own other method: the prediction is dropped, the output unchanged."""
    outs = plain.generate(PROMPTS[:1], greedy(32, prediction=expected[0]), use_tqdm=False)
    assert token_ids(outs) == expected[:1] and outs[0].spec_stats.drafts == 0
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM)
    engine = llm.engine
    rid = engine.add_request(llm.get_tokenizer().encode(PROMPTS[0]),
                             greedy(32, prediction=expected[0], speculative_method="suffix"))
    params = engine.tracked[rid].request.sampling_params  # the engine's copy
    assert params.prediction is None and params.speculative_method == "suffix"
    rid = engine.add_request(llm.get_tokenizer().encode(PROMPTS[0]), greedy(32, prediction=expected[0]))
    params = engine.tracked[rid].request.sampling_params
    assert params.speculative_method == "prediction" and params.prediction == expected[0]


def test_bad_predictions_are_refused(plain):
    with pytest.raises(ValueError, match="prediction=.* must be the expected output's text or its token ids"):
        SamplingParams(prediction=[1, -2])
    with pytest.raises(ValueError, match="prediction=.* must be"):
        SamplingParams(prediction={"type": "content"})
    with pytest.raises(ValueError, match="prediction contains token ids \\[999999\\] outside the vocabulary"):
        plain.generate(["Hi"], greedy(4, prediction=[1, 999999]), use_tqdm=False)
    assert plain.generate(["Hi"], greedy(4), use_tqdm=False)[0].outputs[0].token_ids  # nothing else disturbed
