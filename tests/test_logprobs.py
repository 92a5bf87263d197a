"""Logprobs (``SamplingParams.logprobs``): the target's raw log_softmax at each output token, with and without
speculation, against transformers; top-k; truncation under stops and max_tokens; preemption; no host sync.
Prompt logprobs (``SamplingParams.prompt_logprobs``): the same for every prompt token, over chunked prefill,
preemption, delta outputs and n > 1."""

import pytest
import torch

from specray import LLM, SamplingParams
from specray.scheduler.request import Request
from specray.outputs import Logprob, accumulate
from specray.verification import prompt_logprob_entries, target_logprobs, unpad_with_logprobs
from specray_test_engine_runs import PROMPTS as ENGINE_PROMPTS, greedy  # tests/engine_runs.py (via conftest)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

PROMPTS = [p for i, p in enumerate(ENGINE_PROMPTS) if i not in (5, 7)]  # the six without names or a greeting

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
TOL = 1e-4


@pytest.fixture(scope="module")
def ngram(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """[n, V]: log_softmax of transformers' logits at the positions that chose each of the n output tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0]  # [P + n, V]
    return logits[len(prompt_ids) - 1 : -1].float().log_softmax(-1)


def values(entry: dict[int, Logprob]) -> list[float]:
    return [lp.logprob for lp in entry.values()]


def assert_entry(entry: dict[int, Logprob], token: int, row: torch.Tensor, k: int, tokenizer=None) -> None:
    """One position's entry against the reference log_softmax ``row`` [V]: the chosen token first, then exactly
    the top-k, every logprob equal to the reference, the top-k ranked 1..k in order, the chosen token's rank its
    place in the vocabulary (ties counted, within the tolerance), and with a tokenizer each decoded token."""
    assert next(iter(entry)) == token  # the chosen token first
    top = row.topk(k)
    assert set(entry) == {token, *top.indices.tolist()}
    for t, lp in entry.items():
        assert lp.logprob == pytest.approx(row[t].item(), abs=TOL)
        if tokenizer is not None:
            assert lp.decoded_token == tokenizer.decode([t], skip_special_tokens=False)
    assert sorted((entry[t].logprob for t in top.indices.tolist()), reverse=True) == pytest.approx(
        top.values.tolist(), abs=TOL)  # the k largest
    ranked = [t for t in entry if t != token or t in top.indices.tolist()]
    assert sorted(entry[t].rank for t in ranked) == list(range(1, len(ranked) + 1))
    value = row[token].item()
    assert int((row > value + TOL).sum()) + 1 <= entry[token].rank <= int((row >= value - TOL).sum())


def assert_matches_reference(out, ref: torch.Tensor, k: int, tokenizer=None) -> None:
    """Each entry holds the chosen token's logprob and exactly the top-k, all equal to the reference."""
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids) == ref.shape[0]
    for i, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        assert_entry(entry, token, ref[i], k, tokenizer)
    assert comp.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)))
    assert comp.cumulative_logprob == pytest.approx(ref.gather(1, torch.tensor(comp.token_ids)[:, None]).sum().item(),
                                                    abs=TOL * len(comp.token_ids))


@pytest.mark.parametrize("engine", ["plain", "ngram"])
@pytest.mark.parametrize("params", [greedy(logprobs=3),
                                    SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=24, ignore_eos=True,
                                                   logprobs=5)], ids=["greedy", "sampled"])
def test_logprobs_match_transformers(request, hf_model, engine, params):
    llm = request.getfixturevalue(engine)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        assert_matches_reference(out, hf_logprobs(hf_model, out.prompt_token_ids, out.outputs[0].token_ids),
                                 params.logprobs, llm.get_tokenizer())
    if engine == "ngram":
        assert sum(o.spec_stats.accepted_tokens for o in outs) > 0  # some came from accepted drafts' rows


def test_ngram_logprobs_equal_plain(plain, ngram):
    a = plain.generate(PROMPTS, greedy(logprobs=2), use_tqdm=False)
    b = ngram.generate(PROMPTS, greedy(logprobs=2), use_tqdm=False)
    assert sum(o.spec_stats.accepted_tokens for o in b) > 0
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for ex, ey in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert list(ex) == list(ey) and values(ex) == pytest.approx(values(ey), abs=TOL)
            assert [lp.rank for lp in ex.values()] == [lp.rank for lp in ey.values()]
        assert x.outputs[0].cumulative_logprob == pytest.approx(y.outputs[0].cumulative_logprob, abs=TOL * 24)


def test_the_whole_vocabulary_with_minus_one(plain, hf_model):
    """vLLM's ``logprobs=-1`` and ``prompt_logprobs=-1``: every token of the vocabulary at every position, ranked
    1..V, equal to transformers'."""
    vocab = plain.engine.vocab_size
    out = plain.generate(PROMPTS[0], greedy(4, logprobs=-1, prompt_logprobs=-1), use_tqdm=False)[0]
    assert all(len(e) == vocab for e in out.outputs[0].logprobs)
    assert all(len(e) == vocab for e in out.prompt_logprobs[1:])
    assert_matches_reference(out, hf_logprobs(hf_model, out.prompt_token_ids, out.outputs[0].token_ids), vocab)
    assert_prompt_logprobs(hf_model, out, vocab)
    with pytest.raises(ValueError, match="-1 for the whole vocabulary"):
        SamplingParams(logprobs=-2)


def test_logprobs_zero_and_none(plain):
    outs = plain.generate(PROMPTS[:3], [greedy(logprobs=0), greedy(), greedy(logprobs=1)], use_tqdm=False)
    zero, none, one = (o.outputs[0] for o in outs)
    assert [list(e) for e in zero.logprobs] == [[t] for t in zero.token_ids]  # only the chosen token
    assert none.logprobs is None and none.cumulative_logprob is None
    assert all(1 <= len(e) <= 2 for e in one.logprobs) and len(one.logprobs) == len(one.token_ids)


@pytest.mark.parametrize("engine", ["plain", "ngram"])
def test_logprobs_truncated_with_the_tokens(request, engine):
    """Stop tokens, max_tokens and stop strings (the engine truncates through finish_request) all leave exactly
    one entry per output token, the same as the full run's prefix."""
    llm = request.getfixturevalue(engine)
    full = [o.outputs[0] for o in llm.generate(PROMPTS, greedy(24, logprobs=1), use_tqdm=False)]
    stops = [c.text[len(c.text) // 2 : len(c.text) // 2 + 2] for c in full]
    cases = [[greedy(24, logprobs=1, stop_token_ids=[c.token_ids[10]]) for c in full],
             [greedy(7, logprobs=1)] * len(full),
             [greedy(24, logprobs=1, stop=[s] if s.strip() else []) for s in stops]]
    for params in cases:
        for comp, got, sp in zip(full, llm.generate(PROMPTS, params, use_tqdm=False), params):
            got = got.outputs[0]
            assert len(got.logprobs) == len(got.token_ids)
            stopped = bool(sp.stop or sp.stop_token_ids)
            assert got.finish_reason == ("stop" if stopped else "length"), (got, sp)
            assert got.token_ids == comp.token_ids[: len(got.token_ids)]
            for a, b in zip(got.logprobs, comp.logprobs):
                assert list(a) == list(b) and values(a) == pytest.approx(values(b), abs=TOL)


def test_stop_token_inside_an_accepted_run(tiny_llama_dir, hf_model, monkeypatch):
    """The target drafting for itself keeps 4 tokens a step. A stop token that is not the last of a step's kept
    tokens makes the scheduler drop the rest, and their logprobs must go with them."""
    spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec)
    steps: list[list[int]] = []
    execute = llm.engine.executor.execute

    def spy(plan, draft_probs=None):
        result = execute(plan, draft_probs)
        steps.extend(t for t in result.sampled_token_ids if t)
        return result

    monkeypatch.setattr(llm.engine.executor, "execute", spy)
    found = 0
    for prompt in PROMPTS:
        steps.clear()
        full = llm.generate(prompt, greedy(24, logprobs=1), use_tqdm=False)[0]
        assert_matches_reference(full, hf_logprobs(hf_model, full.prompt_token_ids, full.outputs[0].token_ids), 1)
        ids = full.outputs[0].token_ids
        starts = [sum(len(s) for s in steps[:i]) for i in range(len(steps))]
        cut = next((p + j for p, s in zip(starts, steps) for j in range(len(s) - 1) if s[j] not in ids[: p + j]), None)
        if cut is None:
            continue
        got = llm.generate(prompt, greedy(24, logprobs=1, stop_token_ids=[ids[cut]]), use_tqdm=False)[0].outputs[0]
        assert got.token_ids == ids[: cut + 1] and len(got.logprobs) == cut + 1
        assert [list(e) for e in got.logprobs] == [list(e) for e in full.outputs[0].logprobs[: cut + 1]]
        found += 1
    assert found > 0


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_preemption_does_not_duplicate_logprobs(tiny_llama_dir, hf_model, spec):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec, block_size=4, num_kv_blocks=30)
    outs = llm.generate(PROMPTS, greedy(24, logprobs=2), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        assert_matches_reference(out, hf_logprobs(hf_model, out.prompt_token_ids, out.outputs[0].token_ids), 2)


# ---- prompt logprobs --------------------------------------------------------------------------------------------


def assert_prompt_logprobs(hf_model, out, k: int, tokenizer=None) -> None:
    """None for the first prompt token, then each later one's entry: that token first, then exactly the top-k, all
    equal to transformers' log_softmax at the position before it."""
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [P, V]
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None
    for j in range(1, len(ids)):
        assert_entry(got[j], ids[j], ref[j - 1], k, tokenizer)


@pytest.mark.parametrize("engine_kw", [{}, {"max_num_batched_tokens": 8}, {"speculative_config": NGRAM}],
                         ids=["one-chunk", "chunked-prefill", "ngram"])
def test_prompt_logprobs_match_transformers(tiny_llama_dir, hf_model, engine_kw):
    """Chunked prefill splits the prompt over steps (a chunk's last row predicts the next chunk's first token);
    requests without them and with sampled outputs share the steps; a one-token prompt has only its None."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, **engine_kw)
    params = [greedy(8, prompt_logprobs=3), greedy(8), greedy(8, prompt_logprobs=0, logprobs=1),
              SamplingParams(temperature=0.9, seed=4, max_tokens=8, prompt_logprobs=2)]
    outs = llm.generate(PROMPTS[:4] + [{"prompt_token_ids": [7]}],
                        params + [greedy(4, prompt_logprobs=1)], use_tqdm=False)
    for out, sp in zip(outs, params):
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert_prompt_logprobs(hf_model, out, sp.prompt_logprobs, llm.get_tokenizer())
    assert [list(e) for e in outs[2].prompt_logprobs[1:]] == [[t] for t in outs[2].prompt_token_ids[1:]]  # k = 0
    assert outs[4].prompt_logprobs == [None]
    blocks = llm.engine.scheduler.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def test_prompt_logprobs_once_under_preemption_deltas_and_n(tiny_llama_dir, hf_model):
    """A preempted request computes its prompt again: the entries stay one per token. A delta stream carries them
    in its first report only, and accumulating gives them back; n > 1 computes them once, for the first choice."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, block_size=4, num_kv_blocks=30,
              speculative_config=NGRAM)
    outs = llm.generate(PROMPTS, greedy(24, prompt_logprobs=2), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        assert_prompt_logprobs(hf_model, out, 2)

    engine = llm.engine
    engine.add_request(outs[3].prompt_token_ids, greedy(6, prompt_logprobs=2, output_kind="delta"), req_id="d")
    reports = []
    while engine.has_unfinished_requests():
        reports += [o for o in engine.step() if o.request_id == "d"]
    assert reports[0].prompt_logprobs is not None and all(r.prompt_logprobs is None for r in reports[1:])
    so_far = None
    for r in reports:
        so_far = accumulate(so_far, r)
    assert so_far.prompt_logprobs == outs[3].prompt_logprobs

    seen = []
    execute = engine.executor.execute

    def spy(plan, draft_probs=None):
        result = execute(plan, draft_probs)
        seen.append(sum(len(entries) for entries in result.prompt_logprobs or []))
        return result

    engine.executor.execute = spy
    two = llm.generate(PROMPTS[0], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert len(two.outputs) == 2 and sum(seen) == len(two.prompt_token_ids) - 1  # computed once
    assert_prompt_logprobs(hf_model, two, 1)


@pytest.mark.parametrize("bad", [-2, 1.5, True])
def test_prompt_logprobs_are_checked(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="prompt_logprobs=400 exceeds the vocabulary"):
        SamplingParams(prompt_logprobs=400).check(vocab_size=320)


def test_prompt_logprob_entries_in_slices():
    """Rows reduced a slice at a time give the entries the whole [N, V] would (one host sync at the end)."""
    torch.manual_seed(0)
    hidden = torch.randn(10, 17)
    calls = []

    def logits_of(rows):
        calls.append(len(rows))
        return hidden[torch.tensor(rows)]

    rows, ids, tops = [0, 2, 3, 5, 9], [1, 16, 4, 0, 7], [2, 0, 3, 1, 2]
    entries = prompt_logprob_entries(logits_of, rows, ids, tops, rows_per_pass=2)
    assert calls == [2, 2, 1]
    ref = hidden.log_softmax(-1)
    for r, t, k, entry in zip(rows, ids, tops, entries):
        assert_entry(entry, t, ref[r], k)
    assert prompt_logprob_entries(logits_of, [], [], []) == []


# ---- units ----------------------------------------------------------------------------------------------------


def test_request_keeps_one_entry_per_output_token():
    req = Request("r", [1, 2], SamplingParams(logprobs=1))
    req.append_tokens([5], 1024)
    req.append_tokens([6], 1024)
    five, six, seven, eight = ({t: Logprob(lp, 1)} for t, lp in ((5, -0.1), (6, -0.2), (7, -0.3), (8, -0.5)))
    assert req.extend_logprobs([five, six, seven]) == [five, six]  # the third token was dropped (a stop token)
    assert req.output_logprobs == [five, six] and req.cumulative_logprob == pytest.approx(-0.3)
    req.append_tokens([8], 1024)
    req.extend_logprobs([eight])
    req.truncate_output(1)
    assert req.output_logprobs == [five] and req.cumulative_logprob == pytest.approx(-0.1)
    assert Request("s", [1], SamplingParams()).output_logprobs is None


def test_target_logprobs_and_unpad():
    torch.manual_seed(0)
    B, K, V = 3, 2, 11
    logits = torch.randn(B, K + 1, V)
    tokens = torch.tensor([[4, 7, -1], [2, -1, -1], [1, 3, 9]])  # 2, 1 and 3 kept tokens
    n = torch.tensor([1, 0, 2])
    lp = target_logprobs(logits, tokens, [2, None, 0])
    kept, entries = unpad_with_logprobs(tokens, n, lp)
    assert kept == [[4, 7], [2], [1, 3, 9]]
    ref = logits.log_softmax(-1)
    assert entries[1] == [] and [list(e) for e in entries[2]] == [[1], [3], [9]]
    for j, t in enumerate(kept[0]):
        assert_entry(entries[0][j], t, ref[0, j], 2)
    for j, t in enumerate(kept[2]):
        assert_entry(entries[2][j], t, ref[2, j], 0)
    assert target_logprobs(logits, tokens, [None] * B) is None
    assert unpad_with_logprobs(tokens, n, None) == (kept, None)


@pytest.mark.parametrize("device", DEVICES)
def test_target_logprobs_has_no_host_sync(no_host_sync, device):
    logits = torch.randn(4, 3, 30, device=device)
    tokens = torch.randint(30, (4, 3), device=device)
    with no_host_sync():
        target_logprobs(logits, tokens, [3, None, 0, 5])
        target_logprobs(logits, tokens, [1, 1, 1, 1])
