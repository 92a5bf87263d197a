"""Presence, frequency and repetition penalties: the math against a reference and transformers, every verified
position penalized by its own prefix (greedy speculative output equals greedy plain output, for chains, trees and
a draft model), the target's penalized distribution kept under sampling, and bad values refused."""

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specray import LLM, SamplingParams
from specray.engine.llm_engine import bad_word_sequences
from specray.penalties import penalize

PROMPTS = ["the cat sat on the mat and the cat", "one two three one two three one", "a b a b a b a",
           "hello world, hello world, hello"]
PENALTIES = [dict(repetition_penalty=1.6), dict(frequency_penalty=0.9), dict(presence_penalty=1.2),
             dict(repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=0.4),
             dict(logit_bias={5: 4.0, 9: -100.0, 12: 2.5}, frequency_penalty=0.5),
             dict(min_tokens=9, presence_penalty=0.3),
             dict(allowed_token_ids=list(range(0, 40, 3)) + [5, 7], frequency_penalty=0.3),
             dict(bad_words=["unused: the token ids below are given"], bad_words_token_ids=[[7], [3, 4], [5, 6, 2]],
                  presence_penalty=0.1)]
BANNED = [0, 3]  # the ending tokens of the min_tokens case


def reference(row: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
              banned: list[int] = ()) -> torch.Tensor:
    """One row penalized by vLLM's definitions, token by token."""
    row = row.clone()
    if len(output) < params.min_tokens:
        row[list(banned)] = float("-inf")
    for v, bias in (params.logit_bias or {}).items():
        row[v] += bias
    for v in set(prompt) | set(output):
        if params.repetition_penalty != 1.0:
            row[v] = row[v] / params.repetition_penalty if row[v] > 0 else row[v] * params.repetition_penalty
    for v in set(output):
        row[v] -= params.frequency_penalty * output.count(v) + params.presence_penalty
    if params.allowed_token_ids is not None:
        row[[v for v in range(row.shape[0]) if v not in params.allowed_token_ids]] = float("-inf")
    for seq in params.bad_words_token_ids or []:
        if len(output) >= len(seq) - 1 and output[len(output) - len(seq) + 1:] == seq[:-1]:
            row[seq[-1]] = float("-inf")
    return row


@pytest.mark.parametrize("kw", PENALTIES)
def test_every_row_is_penalized_by_its_own_prefix(kw):
    """Row 0 after the committed tokens, row i + 1 after them and node i's path (random trees, chains among them)."""
    rng = random.Random(3)
    params = SamplingParams(**kw)
    V = 40
    for trial in range(30):
        k = rng.randint(0, 6)
        parents = [rng.randint(-1, i - 1) for i in range(k)] if trial % 2 else list(range(-1, k - 1))
        drafts = [rng.randrange(V) for _ in range(k)]
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 8))]
        output = [rng.randrange(V) for _ in range(rng.randint(0, 8))]
        logits = torch.randn(k + 3, V) * 3
        rows = list(range(2, k + 3))
        got = logits.clone()
        penalize(got, rows, params, prompt, output, drafts, parents, BANNED)
        assert torch.equal(got[:2], logits[:2])  # other requests' rows untouched
        for j, row in enumerate(rows):
            path, node = [], j - 1
            while node >= 0:
                path.insert(0, drafts[node])
                node = parents[node]
            want = reference(logits[row], prompt, output + path, params, BANNED)
            torch.testing.assert_close(got[row], want, msg=f"trial {trial} row {j}")


def test_penalize_has_no_host_sync(no_host_sync):
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                            logit_bias={1: 2.0}, min_tokens=6, allowed_token_ids=[1, 2, 4, 7, 8],
                            bad_words=["w"], bad_words_token_ids=[[4, 7], [2]])
    logits = torch.randn(8, 30)
    with no_host_sync():
        penalize(logits, [3, 4, 5, 6], params, [1, 2, 3], [4, 4], [7, 8, 9], [-1, 0, 0], BANNED)


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    ids = torch.tensor([[3, 7, 7, 1, 9]])
    logits = torch.randn(1, 12) * 4
    want = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())
    got = logits.clone()
    penalize(got, [0], SamplingParams(repetition_penalty=1.7), [3, 7], [7, 1, 9], [], [])
    torch.testing.assert_close(got, want)


def hf_greedy(model_dir, prompt_ids: list[int], n: int, params: SamplingParams) -> list[int]:
    """Greedy decoding with transformers' model and the reference penalties, no cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt_ids + out])).logits[0, -1].float()
            out.append(int(reference(logits, prompt_ids, out, params).argmax()))
    return out


@pytest.mark.parametrize("kw", PENALTIES[:2] + PENALTIES[3:5])
def test_plain_greedy_with_penalties_matches_transformers(tiny_llama_dir, plain, kw):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **kw)
    ids = plain.get_tokenizer().encode(PROMPTS[0])
    got = plain.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == hf_greedy(str(tiny_llama_dir), ids, 16, params)
    unpenalized = plain.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=16,
                                                                            ignore_eos=True), use_tqdm=False)
    if kw is not PENALTIES[3]:  # a penalty against repeats changed the tiny model's loop (the mixed one favours it)
        assert got != unpenalized[0].outputs[0].token_ids


SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
              "adaptive": False},
    "ngram-tree": {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                   "num_branches": 2, "adaptive": False},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False},
}


@pytest.mark.parametrize("spec", list(SPECS))
def test_speculative_greedy_with_penalties_equals_plain(tiny_llama_dir, tiny_draft_dir, plain, spec):
    """Batch 1 and 4, each request with its own penalties beside an unpenalized one; drafts are accepted and
    rejected (the draft model is another model)."""
    config = dict(SPECS[spec])
    if spec == "draft_model":
        config["model"] = str(tiny_draft_dir)
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=config, max_num_seqs=8)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2 if i < 2 else None, **kw)
              for i, kw in enumerate(PENALTIES)]
    params.append(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    plain_outs = plain.generate(prompts, params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in plain_outs]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    for got, ref in zip(outs[:2], plain_outs[:2]):  # raw logprobs at every position, drafted or not
        for a, b in zip(got.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    for i in (0, 3):
        assert llm.generate(prompts[i], params[i], use_tqdm=False)[0].outputs[0].token_ids == want[i]
    stats = llm.spec_stats
    assert stats.draft_tokens > stats.accepted_tokens > 0, stats


def test_logprobs_stay_raw_with_penalties(plain):
    """The sampled tokens follow the penalized distribution; their logprobs are the raw model's."""
    base = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    raw = plain.generate(PROMPTS[1], base, use_tqdm=False)[0].outputs[0]
    pen = plain.generate(PROMPTS[1], SamplingParams(**{**base.__dict__, "repetition_penalty": 3.0}),
                         use_tqdm=False)[0].outputs[0]
    first = raw.token_ids[0]
    assert pen.token_ids[0] == first and pen.logprobs[0] == raw.logprobs[0]  # no repeat yet at the first token
    # at every position the chosen token's logprob is the raw model's, which ranks its own argmax first
    assert any(max(v.logprob for v in lp.values()) > lp[t].logprob and lp[t].rank > 1
               for t, lp in zip(pen.token_ids, pen.logprobs))


SAMPLED = dict(temperature=0.8, top_k=3, max_tokens=3, ignore_eos=True, repetition_penalty=2.0,
               frequency_penalty=0.7)


def test_sampled_output_keeps_the_penalized_target_distribution(tiny_llama_dir, tiny_draft_dir, plain):
    """A draft model (another model, its q penalized by its own logits) drafts every token: rejection sampling
    against the target's penalized p must give the first three tokens' joint distribution of penalized plain
    sampling."""
    from transformers import AutoModelForCausalLM

    from specray.sampling import SamplingBatch, logits_to_probs

    ids = plain.get_tokenizer().encode(PROMPTS[2])
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), torch_dtype=torch.float32).eval()
    params = SamplingParams(**SAMPLED)
    batch = SamplingBatch.build([params], [None], "cpu")

    @torch.no_grad()
    def probs(out: list[int]) -> np.ndarray:
        logits = reference(model(torch.tensor([ids + out])).logits[0, -1].float(), ids, out, params)
        return logits_to_probs(logits[None], batch)[0].double().numpy()

    expected = {}
    p0 = probs([])
    for a in np.flatnonzero(p0):
        p1 = probs([int(a)])
        for b in np.flatnonzero(p1):
            p2 = probs([int(a), int(b)])
            expected.update({(int(a), int(b), int(c)): p0[a] * p1[b] * p2[c] for c in np.flatnonzero(p2)})
    config = {**SPECS["draft_model"], "model": str(tiny_draft_dir)}
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=config, max_num_seqs=64)
    n = 900
    outs = llm.generate([{"prompt_token_ids": ids}] * n, [SamplingParams(seed=i, **SAMPLED) for i in range(n)],
                        use_tqdm=False)
    stats = llm.spec_stats
    assert stats.draft_tokens > stats.accepted_tokens > 0, stats
    triples = [tuple(o.outputs[0].token_ids) for o in outs]
    keys = sorted(set(expected) | set(triples))
    observed = np.array([triples.count(key) for key in keys], dtype=float)
    want = np.array([expected.get(key, 0.0) for key in keys])
    assert observed[want == 0].sum() == 0, "sampled a triple the penalized target gives no mass"
    cells = want / want.sum() * n
    big, small = cells >= 5, (cells > 0) & (cells < 5)
    if small.any():  # the cells expected to hold fewer than 5 pooled into one
        observed, cells = np.append(observed[big], observed[small].sum()), np.append(cells[big], cells[small].sum())
    else:
        observed, cells = observed[big], cells[big]
    pvalue = chisquare(observed, cells).pvalue
    assert pvalue > 1e-3, pvalue
    # the control: the target's unpenalized distribution is not what came out
    unpenalized = SamplingParams(**{**SAMPLED, "repetition_penalty": 1.0, "frequency_penalty": 0.0})
    assert not np.allclose(probs([int(np.flatnonzero(p0)[0])]),
                           _plain_probs(model, ids, [int(np.flatnonzero(p0)[0])], unpenalized))


def _plain_probs(model, ids, out, params) -> np.ndarray:
    from specray.sampling import SamplingBatch, logits_to_probs

    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0, -1].float()
    return logits_to_probs(logits[None], SamplingBatch.build([params], [None], "cpu"))[0].double().numpy()


@pytest.mark.parametrize("spec", [None, "ngram", "ngram-tree"])
def test_bad_words_and_allowed_token_ids_hold_with_speculation(plain, tiny_llama_dir, spec):
    """A two-token word of plain greedy output, banned: its tokens never follow each other again, and speculative
    output is plain output; allowed_token_ids keep every output token inside the set, sampled ones too."""
    tokenizer = plain.get_tokenizer()
    llm = plain if spec is None else LLM(model=str(tiny_llama_dir), max_model_len=256,
                                          speculative_config=SPECS[spec], max_num_seqs=8)
    greedy = dict(temperature=0.0, max_tokens=32, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, SamplingParams(**greedy), use_tqdm=False)]
    word = None
    for ids in base:  # a pair of tokens that reads back as the same two tokens
        for a, b in zip(ids, ids[1:]):
            text = tokenizer.decode([a, b])
            if text.strip() and tokenizer.encode(text.lstrip(), add_special_tokens=False) == [a, b]:
                word = text
                break
        if word:
            break
    assert word is not None
    params = SamplingParams(bad_words=[word], **greedy)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    want = plain.generate(PROMPTS, SamplingParams(bad_words=[word], **greedy), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    banned = bad_word_sequences(tokenizer, [word])
    assert [a, b] in banned and any(_contains(ids, [a, b]) for ids in base)  # it bit
    for out in outs:
        assert not any(_contains(out.outputs[0].token_ids, seq) for seq in banned), (word, banned)

    allowed = sorted({t for ids in base for t in ids[::3]})[:12]
    for sp in (SamplingParams(allowed_token_ids=allowed, **greedy),
               SamplingParams(allowed_token_ids=allowed, temperature=1.0, seed=5, max_tokens=32, ignore_eos=True)):
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs)
        if sp.temperature == 0:
            assert [o.outputs[0].token_ids for o in outs] == [
                o.outputs[0].token_ids for o in plain.generate(PROMPTS, sp, use_tqdm=False)]


def _contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i : i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


@pytest.mark.parametrize("kw, match", [(dict(allowed_token_ids=[]), "allowed_token_ids"),
                                       (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
                                       (dict(bad_words=[" "]), "bad_words"), (dict(bad_words=[3]), "bad_words")])
def test_bad_allowed_token_ids_and_bad_words_are_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_allowed_token_ids_outside_the_vocabulary_are_refused_at_admission(plain):
    with pytest.raises(ValueError, match="allowed_token_ids contains"):
        plain.generate("hi", SamplingParams(allowed_token_ids=[1, 10_000]), use_tqdm=False)
    # allowed tokens that all end the request, banned before min_tokens outputs, leave nothing: refused (a step once
    # drew token 0, outside them); with ignore_eos, EOS is allowed from the start
    eos = plain.engine.eos_token_ids
    for kw in (dict(allowed_token_ids=sorted(eos)), dict(allowed_token_ids=[7], stop_token_ids=[7]),
               dict(allowed_token_ids=[7, *eos], stop_token_ids=[7], ignore_eos=False)):
        with pytest.raises(ValueError, match=r"allowed_token_ids=.* end the request.* min_tokens=3"):
            plain.generate("hi", SamplingParams(min_tokens=3, max_tokens=4, **kw), use_tqdm=False)
    assert not plain.engine.has_unfinished_requests()
    out = plain.generate("hi", SamplingParams(allowed_token_ids=sorted(eos), min_tokens=3, max_tokens=4,
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(eos) and len(out.token_ids) == 4
    # all of them banned later (a two-token bad word, and EOS before min_tokens): the request fails alone, refused,
    # where a step gave token 0, outside them, and went on
    words = dict(bad_words=["7 7"], bad_words_token_ids=[[7, 7]], max_tokens=4)
    outs = plain.generate(["hi", "hi"], [SamplingParams(allowed_token_ids=[7], ignore_eos=True, **words),
                                         SamplingParams(allowed_token_ids=[7, *eos], min_tokens=3, **words)],
                          use_tqdm=False)
    for out, by in zip(outs, ("bad_words", "min_tokens=3")):
        assert out.refused and out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids[0] == 7, out
        assert f"allowed_token_ids=[{7}" in out.error and "all banned after 1 output tokens by" in out.error, out
        assert by in out.error
    assert not plain.engine.has_unfinished_requests() and not plain.engine._bounded


@pytest.mark.parametrize("kw, field", [(dict(presence_penalty=2.5), "presence_penalty"),
                                       (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                                       (dict(repetition_penalty=0), "repetition_penalty"),
                                       (dict(repetition_penalty=-1.0), "repetition_penalty"),
                                       (dict(logit_bias={3: 101.0}), "logit_bias"),
                                       (dict(logit_bias={-1: 1.0}), "logit_bias"),
                                       (dict(logit_bias=[1, 2]), "logit_bias")])
def test_bad_penalties_are_clear_errors(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_logit_bias_outside_the_vocabulary_is_refused_at_admission(plain):
    with pytest.raises(ValueError, match=r"logit_bias=\{100000: \.\.\.\} names token ids \[100000\]"):
        plain.generate("hi", SamplingParams(logit_bias={100000: 1.0}), use_tqdm=False)
    assert not plain.engine.has_unfinished_requests()


def test_logit_bias_forces_and_bans_tokens(plain):
    """+100 on one token makes greedy pick it every time; -100 on the unbiased argmax bans it."""
    base = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = plain.generate(PROMPTS[0], base, use_tqdm=False)[0].outputs[0].token_ids
    forced = plain.generate(PROMPTS[0], SamplingParams(**{**base.__dict__, "logit_bias": {7: 100.0}}),
                            use_tqdm=False)[0].outputs[0].token_ids
    banned = plain.generate(PROMPTS[0], SamplingParams(**{**base.__dict__, "logit_bias": {first[0]: -100.0}}),
                            use_tqdm=False)[0].outputs[0].token_ids
    assert forced == [7] * 6 and first[0] not in banned


@pytest.mark.parametrize("spec", [None] + list(SPECS))
def test_min_tokens_keeps_ending_tokens_away_until_then(tiny_llama_dir, plain, spec):
    """EOS and stop token ids, pushed up by a logit bias, get no probability before min_tokens outputs (on every
    verified row: the drafts before it counted), then end the request at once; stop strings are not looked for
    before then; with ignore_eos, EOS is not banned. Speculative output equals plain output (the draft model's
    logits carry the bias but not the ban, so it drafts the banned tokens, which verification rejects)."""
    llm = plain
    if spec is not None:
        config = dict(SPECS[spec])
        if spec == "draft_model":
            config["model"] = str(tiny_llama_dir)
        llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=config, max_num_seqs=8)
    eos = plain.get_tokenizer().eos_token_id
    greedy = dict(temperature=0.0, max_tokens=12)
    cases = [SamplingParams(**greedy, logit_bias={eos: 100.0}, min_tokens=5),
             SamplingParams(**greedy, logit_bias={eos: 100.0}),
             SamplingParams(**greedy, logit_bias={9: 100.0}, stop_token_ids=[9], min_tokens=3),
             SamplingParams(**greedy, logit_bias={eos: 100.0}, min_tokens=4, ignore_eos=True)]
    eos_min, eos_plain, stop_min, ignoring = [o.outputs[0] for o in
                                              llm.generate([PROMPTS[0]] * len(cases), cases, use_tqdm=False)]
    assert eos not in eos_min.token_ids[:5] and len(eos_min.token_ids) <= 6 and eos_min.finish_reason == "stop"
    assert eos_plain.finish_reason == "stop" and len(eos_plain.token_ids) <= 1
    assert 9 not in stop_min.token_ids[:3] and stop_min.token_ids[3] == 9 and stop_min.stop_reason == 9
    assert ignoring.token_ids == [eos] * 12
    text = plain.generate(PROMPTS[1], SamplingParams(**greedy, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    late = llm.generate(PROMPTS[1], SamplingParams(**greedy, ignore_eos=True, stop=[text[:2]], min_tokens=12),
                        use_tqdm=False)[0].outputs[0]
    assert late.text == text and late.finish_reason == "length"  # the stop string came before min_tokens
    if spec is not None:
        want = [o.outputs[0].token_ids for o in plain.generate([PROMPTS[0]] * len(cases), cases, use_tqdm=False)]
        assert [eos_min.token_ids, eos_plain.token_ids, stop_min.token_ids, ignoring.token_ids] == want


def test_min_tokens_above_max_tokens_is_a_clear_error(plain):
    with pytest.raises(ValueError, match="min_tokens=5 exceeds max_tokens=4"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    # max_tokens left unset: the context's room, which the message names (not "raise max_tokens", never given)
    prompt = [5] * 200  # of max_model_len=256: 56 tokens left
    with pytest.raises(ValueError, match=r"min_tokens=60 exceeds the 56 output tokens max_model_len=256 leaves after "
                                         r"the 200-token prompt \(max_tokens=None\); lower min_tokens or shorten"):
        plain.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=None, min_tokens=60), use_tqdm=False)
    assert not plain.engine.has_unfinished_requests()


def test_the_draft_model_drafts_from_penalized_logits(tiny_llama_dir, plain):
    """A draft model equal to the target applies each request's penalties and logit bias to its own logits (its
    drafts before each one counted), so its greedy drafts are the penalized target's: nearly all are kept."""
    config = {**SPECS["draft_model"], "model": str(tiny_llama_dir)}
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=config, max_num_seqs=8)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw) for kw in PENALTIES[:5]]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in
                                                      plain.generate(prompts, params, use_tqdm=False)]
    assert llm.spec_stats.acceptance_rate > 0.95, llm.spec_stats
