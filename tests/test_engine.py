"""End to end on tiny random models: greedy speculative output equals greedy plain output and transformers'
`generate`, for every drafter, batch sizes 1 and 8, under preemption; bad input; stops; KV accounting."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from specray import LLM, SamplingParams, SpeculativeConfig
from specray.config import EngineArgs
from specray.engine.builder import build_engine
from specray_test_engine_runs import PROMPTS, VirtualClock, greedy, token_ids  # tests/engine_runs.py, via conftest

TESTS = Path(__file__).parent  # a folder that holds no config.json
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def hf_greedy(folder, llm, prompts, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    result = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p)])
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        result.append(out[0, ids.shape[1]:].tolist())
    return result


def free_blocks(llm):
    return llm.engine.scheduler.block_manager.num_free_blocks


def test_plain_matches_transformers(tiny_llama_dir, plain, plain_outputs):
    assert plain_outputs == hf_greedy(tiny_llama_dir, plain, PROMPTS, 24)


@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_qwen3_moe_dir", "tiny_gemma3_dir",
                                     "tiny_deepseek_dir", "tiny_llama4_dir", "tiny_mixtral_dir", "tiny_qwen2_moe_dir",
                                     "tiny_phi3_dir", "tiny_gemma2_dir", "tiny_granite_dir", "tiny_deepseek_v2_dir",
                                     "tiny_olmo2_dir", "tiny_glm4_moe_dir"])
def test_other_families_plain_and_ngram_match_transformers(request, fixture):
    folder = request.getfixturevalue(fixture)
    llm = LLM(model=str(folder), max_model_len=256)
    expected = hf_greedy(folder, llm, PROMPTS[:4], 16)
    assert token_ids(llm.generate(PROMPTS[:4], greedy(16), use_tqdm=False)) == expected
    # with prefix caching (every layer kind keeps all slots, so cached blocks serve windowed and chunked layers too):
    # the second run starts each prompt from its cached blocks
    spec = LLM(model=str(folder), max_model_len=256, speculative_config=NGRAM, enable_prefix_caching=True,
               block_size=4)
    assert token_ids(spec.generate(PROMPTS[:4], greedy(16), use_tqdm=False)) == expected
    again = spec.generate(PROMPTS[:4], greedy(16), use_tqdm=False)
    assert token_ids(again) == expected
    assert all(o.num_cached_tokens > 0 for o in again if len(o.prompt_token_ids) > 4)


def test_phi3_longrope_factors_follow_max_model_len(make_tiny_model, tmp_path):
    """Every rank builds Phi-3's LongRoPE for the engine's ``max_model_len``: served past the pretrained 32 positions
    (max_model_len 256), a prompt longer than them decodes as transformers decodes it (with the long factors, as
    the ranks do for every sequence), with and without n-gram drafts; within them (max_model_len 32), with the short
    ones, so the two differ."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.4, 2.0, 2.9, 4.0, 5.5, 7.0],
            "long_factor": [1.3, 2.7, 6.1, 12.0, 22.0, 35.0, 48.0, 60.0]}
    folder = make_tiny_model(tmp_path / "phi3", "phi3", seed=24, max_position_embeddings=512,
                             original_max_position_embeddings=32, rope_parameters=rope)
    prompt = [PROMPTS[3] + " " + PROMPTS[6]]
    llm = LLM(model=str(folder), max_model_len=256)
    assert len(llm.get_tokenizer().encode(prompt[0])) > 32
    expected = hf_greedy(folder, llm, prompt, 16)
    assert token_ids(llm.generate(prompt, greedy(16), use_tqdm=False)) == expected
    spec = LLM(model=str(folder), max_model_len=256, speculative_config=NGRAM)
    assert token_ids(spec.generate(prompt, greedy(16), use_tqdm=False)) == expected
    short = LLM(model=str(folder), max_model_len=32)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=0)
    long_first, short_first = (m.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].logprobs[0]
                               for m in (llm, short))
    assert long_first != short_first


def test_a_gpu_device_is_resolved_with_its_index(monkeypatch):
    """``torch.cuda.set_device`` refuses a bare "cuda" (the suite's first run on a GPU failed every engine there):
    the worker's device names the index the process sees as current; a named index is kept."""
    from specray.workers import worker

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert worker.resolve_device(None) == torch.device("cuda", 3)
    assert worker.resolve_device("cuda") == torch.device("cuda", 3)
    assert worker.resolve_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker.resolve_device(None) == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        worker.resolve_device("cuda")


@pytest.mark.parametrize("batch", [1, 8])
def test_ngram_greedy_equals_plain(tiny_llama_dir, plain_outputs, batch):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM)
    start = free_blocks(llm)
    if batch == 1:
        outs = [o for p in PROMPTS for o in llm.generate([p], greedy(), use_tqdm=False)]
    else:
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert token_ids(outs) == plain_outputs
    assert llm.spec_stats.drafts > 0 and llm.spec_stats.accepted_tokens > 0, llm.spec_stats
    assert free_blocks(llm) == start
    assert not llm.engine.policy._evidence and not llm.engine.tracked  # finished requests leave no state behind
    assert sum(o.spec_stats.drafts for o in outs) == llm.spec_stats.drafts  # one counter type, summed


@pytest.mark.parametrize("batch", [1, 8])
def test_draft_model_greedy_equals_plain(tiny_llama_dir, tiny_draft_dir, plain_outputs, batch):
    spec = {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec)
    prompts = PROMPTS if batch == 8 else PROMPTS[:3]
    outs = llm.generate(prompts, greedy(), use_tqdm=False) if batch == 8 else \
        [o for p in prompts for o in llm.generate([p], greedy(), use_tqdm=False)]
    assert token_ids(outs) == plain_outputs[: len(prompts)]
    assert llm.spec_stats.draft_tokens > 0


def test_self_drafting_accepts_everything(tiny_llama_dir, plain_outputs):
    """The target drafting for itself must have every greedy draft accepted: a check of KV rewind."""
    spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert token_ids(outs) == plain_outputs
    assert llm.spec_stats.acceptance_rate == 1.0


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_preemption_keeps_greedy_output(tiny_llama_dir, plain_outputs, spec, caplog):
    """A KV pool too small for all 8 requests at once forces preemption by recompute."""
    with caplog.at_level("WARNING", logger="specray.engine.builder"):
        llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec, block_size=4,
                  num_kv_blocks=40)
    # 160 slots, fewer than max_model_len: said at start
    assert any("holds 160 tokens, fewer than max_model_len=256" in r.getMessage() for r in caplog.records)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert token_ids(outs) == plain_outputs
    assert llm.engine.scheduler.num_preemptions > 0
    assert free_blocks(llm) == 40
    # what earlier owners left in the blocks (a request's NaN K/V, say) is never read: a block is zeroed when a step
    # first writes it (slots past a context are masked out, but 0 x NaN is NaN); short contexts pad with their own
    kv = llm.engine.executor.worker.runner.kv_cache
    for i in range(kv.num_layers):
        kv.layer(i).fill_(float("nan"))
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == plain_outputs


@pytest.mark.parametrize("spec", [NGRAM, "draft_model"])
def test_contexts_read_in_place_keep_greedy_output(tiny_llama_dir, tiny_draft_dir, plain_outputs, spec, monkeypatch):
    """Every decode step attending one sequence at a time (contexts read in place from consecutive blocks, or
    gathered where the pool is fragmented), with drafts, rewinds and preemption, for the target and the drafter."""
    from specray.models import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 1)
    if spec == "draft_model":
        spec = {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec, block_size=4, num_kv_blocks=40)
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == plain_outputs
    assert llm.engine.scheduler.num_preemptions > 0 and llm.spec_stats.accepted_tokens > 0
    assert free_blocks(llm) == 40


def test_closed_batch_requests_off_the_critical_path_do_not_draft(tiny_llama_dir, plain_outputs):
    """Offline generate is a closed batch: once nothing waits, requests that finish before the longest one
    even without drafting draft nothing (their tokens would come sooner, the batch's end would not). A serving
    engine (closed_batches off) drafts for them; greedy output is the same either way."""
    spec = {**NGRAM, "adaptive": True}
    params = [greedy(24)] + [greedy(4)] * 3
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec)
    llm.engine.executor = clock = VirtualClock(llm.engine.executor)
    llm.engine.clock = clock.clock  # the policy prices drafts by step times: not by this machine's load
    assert llm.engine.closed_batches
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert token_ids(outs) == [plain_outputs[0]] + [ids[:4] for ids in plain_outputs[1:4]]
    assert [o.spec_stats.drafts for o in outs[1:]] == [0, 0, 0] and outs[0].spec_stats.drafts > 0
    llm.engine.closed_batches = False
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert token_ids(outs) == [plain_outputs[0]] + [ids[:4] for ids in plain_outputs[1:4]]
    assert sum(o.spec_stats.drafts for o in outs[1:]) > 0


def test_cheap_drafter_drafts_sized_by_the_kind_of_guess(tiny_llama_dir, plain_outputs):
    """A drafter with ``cheap_proposals`` is asked for the most drafts and tells each proposal's key; the policy
    sizes K by the evidence for that key. An oracle right on even output positions (key 2) and wrong on odd
    ones (key 1): after a few failures no request verifies key-1 drafts beyond probes; output is unchanged."""
    from specray.drafters.base import Proposal

    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config={**NGRAM, "adaptive": True})
    tok, vocab = llm.get_tokenizer(), llm.engine.vocab_size
    expected = {tuple(tok.encode(p)): out for p, out in zip(PROMPTS, plain_outputs)}

    class Oracle:
        cheap_proposals = True

        def shutdown(self):
            pass

        def propose(self, batch):
            proposals = []
            for req in batch:
                prompt = max((p for p in expected if tuple(req.token_ids[:len(p)]) == p), key=len)
                done = len(req.token_ids) - len(prompt)
                right = expected[prompt][done:done + req.num_speculative_tokens]
                wrong = Proposal([(t + 1) % vocab for t in right], key=1)
                proposals.append(wrong if done % 2 else Proposal(right, key=2))
            return proposals

        def finish(self, req_ids):
            pass

    llm.engine.drafter = Oracle()
    llm.engine.closed_batches = False  # every request drafts by its own evidence
    policy = llm.engine.policy
    for n in range(1, 41):  # a step's fixed cost dominates, as for real models (a tiny one's has none)
        policy.observe_step(n, 8, 0.05 + 0.001 * n)
    policy.observe_step = lambda *args: None
    verified, observe = [], policy.observe
    policy.observe = lambda req, n, acc, key=None, scores=None: (verified.append((key, n)),
                                                                 observe(req, n, acc, key, scores))
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == plain_outputs
    short = [n for key, n in verified if key == 1]
    assert sum(n for key, n in verified if key == 2) > 3 * sum(short) > 0
    late = [n for key, n in verified[len(verified) // 2:] if key == 1]
    assert all(n <= policy.probe_k for n in late), late


def test_preemption_keeps_seeded_sampled_output(tiny_llama_dir):
    """A preempted seeded request resumes its random stream where it stopped (the worker keeps its generator):
    the same tokens as with a pool large enough for no preemption."""
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    roomy = LLM(model=str(tiny_llama_dir), max_model_len=256, block_size=4)
    tight = LLM(model=str(tiny_llama_dir), max_model_len=256, block_size=4, num_kv_blocks=40)
    expected = token_ids(roomy.generate(PROMPTS, params, use_tqdm=False))
    assert token_ids(tight.generate(PROMPTS, params, use_tqdm=False)) == expected
    assert tight.engine.scheduler.num_preemptions > 0 and free_blocks(tight) == 40


def test_seeded_sampling_is_reproducible(plain):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    a = token_ids(plain.generate(PROMPTS[:2], params, use_tqdm=False))
    b = token_ids(plain.generate(PROMPTS[:2] + PROMPTS[2:5], params, use_tqdm=False))[:2]
    assert a == b
    c = token_ids(plain.generate(PROMPTS[:2], SamplingParams(temperature=0.8, seed=99, max_tokens=16,
                                                              ignore_eos=True), use_tqdm=False))
    assert c != a


def test_n_completions_per_prompt(plain, plain_outputs):
    """``n`` completions come back in one output per prompt: greedy ones all equal plain decoding's; seeded
    sampled ones equal n=1 requests seeded seed + i, so they differ and each is reproducible."""
    outs = plain.generate(PROMPTS[:2], greedy(n=3), use_tqdm=False)
    assert [[c.index for c in o.outputs] for o in outs] == [[0, 1, 2]] * 2
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[ids] * 3 for ids in plain_outputs[:2]]
    sampled = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    outs = plain.generate(PROMPTS[:2], SamplingParams(n=3, seed=2**64 - 2, **sampled), use_tqdm=False)
    for prompt, out in zip(PROMPTS[:2], outs):
        alone = [plain.generate(prompt, SamplingParams(seed=seed, **sampled), use_tqdm=False)[0].outputs[0]
                 for seed in (2**64 - 2, 2**64 - 1, 0)]  # the last seed wrapped past SEED_MAX
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone]
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    mixed = plain.generate(PROMPTS[:2], [greedy(n=2), greedy()], use_tqdm=False)
    assert [len(o.outputs) for o in mixed] == [2, 1]
    with pytest.raises(ValueError, match="n=2: the engine runs one sequence per request"):
        plain.engine.add_request([5, 6], greedy(n=2))
    for bad in (None, 5):
        with pytest.raises(ValueError, match="is not a prompt or a list of prompts"):
            plain.generate(bad, use_tqdm=False)
    with pytest.raises(ValueError, match="must be an int >= 1"):
        SamplingParams(n=0)
    assert not plain.engine.has_unfinished_requests()


def test_sampled_ngram_runs_and_is_seeded(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM)
    params = SamplingParams(temperature=0.7, seed=7, max_tokens=24, ignore_eos=True)
    a = token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
    b = token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
    assert a == b and all(len(t) == 24 for t in a)


def test_stop_conditions(plain, plain_outputs):
    first = plain_outputs[0]
    out = plain.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[first[3]]),
                         use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == first[3]
    assert out.token_ids == first[: first.index(first[3]) + 1]
    out = plain.generate(PROMPTS[0], greedy(5), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


@pytest.mark.parametrize("kind", ["final_only", "cumulative", "delta"])
def test_the_stop_token_that_ends_a_request_is_left_out_of_its_text(plain, plain_outputs, kind):
    """vLLM's text leaves out the EOS or stop token id that ended the request, special or not, unless
    ``include_stop_str_in_output``; its id stays in token_ids."""
    tok = plain.get_tokenizer()

    def text_of(p, n):  # the text of prompt p's first n tokens, as the engine decodes them
        return plain.generate(PROMPTS[p], greedy(n), use_tqdm=False)[0].outputs[0].text if n else ""

    # a token that first occurs at i >= 1 of an output and adds text there
    p, i = next((p, i) for p, first in enumerate(plain_outputs) for i in range(1, len(first))
                if first[i] not in first[:i] and text_of(p, i + 1) != text_of(p, i))
    stop = plain_outputs[p][i]
    for include, text in ((False, text_of(p, i)), (True, text_of(p, i + 1))):
        params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], output_kind=kind,
                                include_stop_str_in_output=include)
        engine = plain.engine
        rid = engine.add_request(tok.encode(PROMPTS[p]), params)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.request_id == rid]
        got = "".join(o.outputs[0].text for o in outs) if kind == "delta" else outs[-1].outputs[0].text
        assert got == text and outs[-1].outputs[0].stop_reason == stop
    eos = tok.eos_token_id  # ended on EOS: left out even where skip_special_tokens=False would show it
    out = plain.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100},
                                                    skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.text == "" and out.finish_reason == "stop"


def test_stop_string(plain):
    full = plain.generate(PROMPTS[1], greedy(24), use_tqdm=False)[0].outputs[0]
    stop = full.text[4:7]
    assert stop.strip(), full.text
    out = plain.generate(PROMPTS[1], greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    assert free_blocks(plain) == plain.engine.scheduler.block_manager.num_blocks


def test_without_detokenizing_the_tokens_and_logprobs_are_the_same(tiny_llama_dir, plain_outputs):
    """vLLM's ``detokenize=False``: the same token ids and logprobs, no text and no decoded tokens, under
    speculation too; stop strings need the text, so they are refused with it."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM)
    text, ids = (llm.generate(PROMPTS, greedy(logprobs=1, detokenize=d), use_tqdm=False) for d in (True, False))
    assert token_ids(text) == token_ids(ids) == plain_outputs
    assert sum(o.spec_stats.accepted_tokens for o in ids) > 0 and any(o.outputs[0].text for o in text)
    for a, b in zip(text, ids):
        a, b = a.outputs[0], b.outputs[0]
        assert b.text == "" and a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-5)
        assert all(lp.decoded_token is not None for e in a.logprobs for lp in e.values())
        assert all(lp.decoded_token is None for e in b.logprobs for lp in e.values())
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_final_only_outputs_equal_the_cumulative_ones(tiny_llama_dir, plain):
    """``output_kind="final_only"`` (what ``LLM.generate`` asks for): a request is reported once, finished, with
    the tokens, text and reasons it has when reported every step; with stop strings too (looked for every step,
    so it stops where the cumulative one does), beside speculation."""
    full = plain.generate(PROMPTS[1], greedy(24), use_tqdm=False)[0].outputs[0]
    stop = full.text[4:7]
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM)
    engine = llm.engine
    kinds = {}
    for kind in ("cumulative", "final_only"):
        for i, params in enumerate([greedy(24), greedy(24, stop=[stop]), greedy(5),
                                    SamplingParams(temperature=0.9, seed=3, max_tokens=20)]):
            params.output_kind = kind
            kinds[engine.add_request(engine.tokenizer.encode(PROMPTS[1 if i == 1 else i]), params)] = (kind, i)
    reports: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            reports.setdefault(out.request_id, []).append(out)
    finals = {}
    for rid, (kind, i) in kinds.items():
        outs = reports[rid]
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert kind == "cumulative" and len(outs) > 1 or kind == "final_only" and len(outs) == 1
        c = outs[-1].outputs[0]
        finals.setdefault(i, []).append((c.token_ids, c.text, c.finish_reason, c.stop_reason))
    assert all(a == b for a, b in finals.values()), finals
    assert finals[1][0][2] == "stop" and finals[1][0][1] == full.text[: full.text.index(stop)]
    assert llm.generate(PROMPTS[1], greedy(24), use_tqdm=False)[0].outputs[0].text == full.text


def assert_same_report(a, b, where) -> None:
    """Two reports are equal, their logprobs within 1e-5: the two requests sit in different rows of the batch, and
    on some CPUs a row's float sums differ in the last bits with its place (seen: 2e-7)."""
    from dataclasses import replace

    assert replace(a, outputs=[]) == replace(b, outputs=[]), where
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert replace(x, logprobs=None, cumulative_logprob=None) == replace(y, logprobs=None,
                                                                            cumulative_logprob=None), where
        assert (x.cumulative_logprob is None) == (y.cumulative_logprob is None), where
        if x.cumulative_logprob is not None:
            assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-5), where
        assert (x.logprobs is None) == (y.logprobs is None) and len(x.logprobs or ()) == len(y.logprobs or ()), where
        for p, q in zip(x.logprobs or (), y.logprobs or ()):
            assert sorted(p) == sorted(q) and [p[t].logprob for t in sorted(p)] == pytest.approx(
                [q[t].logprob for t in sorted(q)], abs=1e-5), where
            assert [(p[t].rank, p[t].decoded_token) for t in p] == [(q[t].rank, q[t].decoded_token) for t in q], where


def test_delta_outputs_join_to_the_cumulative_ones(tiny_llama_dir, plain):
    """``output_kind="delta"`` reports as often as "cumulative", each report holding only what is new (tokens,
    text, logprobs; the prompt once): joined in order they equal the cumulative report of the same step, for
    stop strings (text a stop string may still take back is never reported), logprobs, sampling and speculation.
    Cumulative text only grows too, and the last report of each kind is the whole output."""
    from dataclasses import replace

    from specray.outputs import accumulate, merge_deltas

    full = plain.generate(PROMPTS[1], greedy(24), use_tqdm=False)[0].outputs[0]
    stop = full.text[6:10]
    assert stop.strip() and full.text.index(stop) == 6, full.text
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM)
    engine = llm.engine
    cases = [greedy(24), greedy(24, stop=[stop, "zz"]), greedy(24, stop=[stop], include_stop_str_in_output=True),
             greedy(12, logprobs=2), SamplingParams(temperature=0.9, seed=3, max_tokens=20, logprobs=1)]
    kinds = {}
    for kind in ("cumulative", "delta"):
        for i, params in enumerate(cases):
            params = SamplingParams(**{**params.__dict__, "output_kind": kind})
            prompt = engine.tokenizer.encode(PROMPTS[1 if i in (1, 2) else i % len(PROMPTS)])
            kinds[engine.add_request(prompt, params, prompt=f"prompt {i}")] = (kind, i)
    reports: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            reports.setdefault(kinds[out.request_id], []).append(out)
    for i, params in enumerate(cases):
        cumulative, deltas = reports[("cumulative", i)], reports[("delta", i)]
        assert len(cumulative) == len(deltas) > 1
        assert deltas[0].prompt == f"prompt {i}" and deltas[0].prompt_token_ids
        assert all(d.prompt is None and d.prompt_token_ids == [] for d in deltas[1:])
        so_far = None
        for step, (whole, delta) in enumerate(zip(cumulative, deltas)):
            so_far = accumulate(so_far, delta)
            assert_same_report(replace(so_far, request_id=whole.request_id), whole, (i, step))
            if step:
                assert whole.outputs[0].text.startswith(cumulative[step - 1].outputs[0].text), (i, step)
        merged = deltas[0]
        for delta in deltas[1:]:
            merged = merge_deltas(merged, delta)
        assert_same_report(replace(merged, request_id=cumulative[-1].request_id), cumulative[-1], i)
        assert (cumulative[-1].outputs[0].logprobs is None) == (params.logprobs is None)
    out = reports[("cumulative", 1)][-1].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == full.text[:6]
    assert reports[("cumulative", 2)][-1].outputs[0].text == full.text[:10]
    # while the stop string may still begin in them, the last len(stop) - 1 characters are held back
    early = [r.outputs[0].text for r in reports[("cumulative", 1)][:-1]]
    texts = [c.outputs[0].text for c in reports[("cumulative", 0)]]
    assert all(len(t) <= 6 for t in early) and any(texts[j] != early[j] for j in range(len(early)))


def test_stop_string_with_speculation(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM)
    outs = llm.generate(PROMPTS, greedy(24), use_tqdm=False)
    full = max((o.outputs[0] for o in outs), key=lambda c: len(set(c.text)))
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    assert stop.strip(), full.text
    prompt = PROMPTS[[o.outputs[0] for o in outs].index(full)]
    out = llm.generate(prompt, greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]


def test_token_id_prompts_and_chat(plain, plain_outputs):
    ids = plain.get_tokenizer().encode(PROMPTS[0])
    out = plain.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain_outputs[0]
    tokenizer = plain.get_tokenizer()  # one token-id prompt, or vLLM's batch of them (beside text prompts)
    assert token_ids(plain.generate(ids, greedy(), use_tqdm=False)) == plain_outputs[:1]
    batch = [tokenizer.encode(PROMPTS[0]), PROMPTS[1], tuple(tokenizer.encode(PROMPTS[2]))]
    assert token_ids(plain.generate(batch, greedy(), use_tqdm=False)) == plain_outputs[:3]
    as_dict = dataclasses.asdict(greedy())  # sampling parameters as a dict of SamplingParams' fields, one or a list
    assert token_ids(plain.generate(PROMPTS[:2], as_dict, use_tqdm=False)) == plain_outputs[:2]
    assert token_ids(plain.generate(PROMPTS[:2], [as_dict, greedy()], use_tqdm=False)) == plain_outputs[:2]
    chat = plain.chat([{"role": "user", "content": "Hello"}], greedy(8), use_tqdm=False)[0]
    text = plain.get_tokenizer().apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                                     add_generation_prompt=True)
    assert chat.prompt == text and len(chat.outputs[0].token_ids) == 8
    two = plain.chat([[{"role": "user", "content": "Hello"}]] * 2, greedy(8), use_tqdm=False)  # conversations
    assert [o.outputs[0].token_ids for o in two] == [chat.outputs[0].token_ids] * 2
    for bad in ("Hello", ["Hello"], [[]], [[{"role": "user", "content": "Hello"}], "Hi"]):  # not message dicts
        with pytest.raises(ValueError, match="must be a conversation, a list of message dicts"):
            plain.chat(bad, greedy(8), use_tqdm=False)
    # OpenAI's text parts read as the string they join into, as the server reads them
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    assert plain.chat(parts, greedy(8), use_tqdm=False)[0].prompt == text
    for content, words in ((5, "must be a string or a list of content parts"),
                           ([{"type": "text"}], "without its text")):
        with pytest.raises(ValueError, match=words):
            plain.chat([{"role": "user", "content": content}], greedy(8), use_tqdm=False)


def test_truncated_prompts_and_chat_template_kwargs(plain, plain_outputs):
    """truncate_prompt_tokens runs the request on its prompt's last tokens (a prompt past the context then fits);
    chat_template_kwargs reach the template as its variables."""
    ids = plain.get_tokenizer().encode(PROMPTS[0])
    out = plain.generate({"prompt_token_ids": [7] * 300 + ids}, greedy(truncate_prompt_tokens=len(ids)),
                         use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == plain_outputs[0]
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat = plain.chat([{"role": "user", "content": "Hello"}], greedy(2), use_tqdm=False, chat_template=template,
                      chat_template_kwargs={"greeting": "Hi! "})[0]
    assert chat.prompt == "Hi! Hello"
    with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
        plain.chat([{"role": "user", "content": "Hello"}], chat_template_kwargs={"tokenize": True})
    with pytest.raises(ValueError, match="chat_template_kwargs='x' must be a dict"):
        plain.chat([{"role": "user", "content": "Hello"}], chat_template_kwargs="x")
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


@pytest.mark.parametrize("make_bad, field", [
    (lambda llm: llm.generate("", greedy(), use_tqdm=False), "prompt"),
    (lambda llm: llm.generate({"prompt_token_ids": [1] * 300}, greedy(), use_tqdm=False), "max_model_len"),
    (lambda llm: llm.generate({"prompt_token_ids": [10**6]}, greedy(), use_tqdm=False), "vocabulary"),
    (lambda llm: llm.generate(["ok", "ok"], [greedy()], use_tqdm=False), "sampling_params"),
    (lambda llm: llm.generate("ok", "greedy", use_tqdm=False), "sampling_params must be a SamplingParams"),
    (lambda llm: llm.generate("ok", {"max_token": 4}, use_tqdm=False),
     r"sampling_params has unknown keys \['max_token'\] \(did you mean 'max_token' -> 'max_tokens'\?\)"),
    (lambda llm: SamplingParams(max_tokens=0), "max_tokens"),
    (lambda llm: SamplingParams(temperature=-1), "temperature"),
    (lambda llm: SamplingParams(top_p=0), "top_p"),
    (lambda llm: SamplingParams(top_p=1.5), "top_p"),
    (lambda llm: SamplingParams(num_speculative_tokens=-1), "num_speculative_tokens"),
    (lambda llm: SamplingParams(num_speculative_tokens=1.5), "num_speculative_tokens"),
    (lambda llm: build_engine(EngineArgs(llm.engine_args.model, speculative_config={"method": "medusa-ish"})),
     "method"),
    (lambda llm: build_engine(EngineArgs(llm.engine_args.model, speculative_config=SpeculativeConfig.from_any(
        {"method": "ngram", "num_spec": 3}))), r"unknown keys \['num_spec'\] for method='ngram'"),
    (lambda llm: LLM(llm.engine_args.model, speculative_config={"method": "ngram", "model": "x"}),
     r"^speculative_config.model is an option of method 'draft_model' / 'eagle' .*, not of method='ngram'; remove "
     r"it \(its keys: \['acceptance', 'adaptive', "),
    (lambda llm: LLM(llm.engine_args.model, speculative_config={"method": "eagle3", "medusa_choices": [[0]]}),
     r"^speculative_config.medusa_choices is an option of method 'medusa', not of method='eagle3'"),
    (lambda llm: llm.generate("ok", greedy(stop_token_ids=[10**6]), use_tqdm=False), "stop_token_ids"),
    (lambda llm: llm.generate("ok", greedy(logprobs=10**6), use_tqdm=False), "logprobs"),
    (lambda llm: llm.engine.add_request([5, 6], greedy(stop_token_ids=[10**6])), "stop_token_ids"),
    (lambda llm: SamplingParams(temperature=float("nan")), "temperature"),
    (lambda llm: SamplingParams(output_kind="deltas"), "output_kind"),
    (lambda llm: LLM(llm.engine_args.model, speculative_config={"method": "draft_model"}), "model is required"),
    (lambda llm: LLM(llm.engine_args.model, speculative_config={"method": "draft_model", "model": "/no/such"}),
     r"^speculative_config.model='/no/such' does not exist"),
    (lambda llm: LLM(llm.engine_args.model, speculative_config={"method": "draft_model", "model": "no/such"}),
     r"^speculative_config.model='no/such' is not a local path, and the hub could not provide it"),  # offline
    (lambda llm: LLM(llm.engine_args.model, speculative_config={"method": "draft_model", "model": 5}),
     r"^speculative_config.model=5 must be a path or hub id \(a string\)"),
    (lambda llm: LLM(llm.engine_args.model, speculative_config={"method": "draft_model", "model": str(TESTS)}),
     r"^speculative_config.model='.*tests' is a folder without config.json"),
    (lambda llm: LLM(llm.engine_args.model, speculative_config={"method": "eagle3", "model": __file__}),
     r"^speculative_config.model='.*test_engine.py' is a file but not a .gguf"),
    (lambda llm: LLM(llm.engine_args.model, speculative_config={"method": "ngram_cache",
                                                                "static_cache_path": "/no/such.bin"}),
     r"^speculative_config.static_cache_path='/no/such.bin' is not a file"),
    (lambda llm: LLM(llm.engine_args.model, max_model_len=64, speculative_config={"method": "ngram",
                                                                                 "num_speculative_tokens": 64}),
     r"^speculative_config.num_speculative_tokens=64 is not below max_model_len=64"),
    (lambda llm: LLM(llm.engine_args.model, tokenizer="/no/such"), r"^tokenizer='/no/such' does not exist"),
    (lambda llm: llm.generate({"prompt_token_ids": "abc"}, greedy(), use_tqdm=False),
     r"^prompt_token_ids='abc' must be a list of token ids \(ints\)"),
    (lambda llm: LLM(llm.engine_args.model, seed=2 ** 70), r"^seed=\d+ must be an int in \[-9223372036854775808, "),
    (lambda llm: SpeculativeConfig(num_speculative_tokens=3, max_draft_len=4), "twice"),
    (lambda llm: EngineArgs.from_dict({"model": "m", "max_num_seq": 3}), r"unknown keys \['max_num_seq'\]"),
    (lambda llm: LLM(llm.engine_args.model, max_num_seq=3),
     r"LLM\(...\) has unknown keys \['max_num_seq'\] \(did you mean 'max_num_seq' -> 'max_num_seqs'\?\)"),
    (lambda llm: LLM(llm.engine_args.model, speculative_config={"method": "ngram", "prompt_lookup_mx": 3}),
     r"did you mean 'prompt_lookup_mx' -> 'prompt_lookup_max'"),
])
def test_bad_input_is_a_clear_error_and_loses_nothing(plain, plain_outputs, make_bad, field):
    start = free_blocks(plain)
    with pytest.raises(ValueError, match=field):
        make_bad(plain)
    assert free_blocks(plain) == start
    assert not plain.engine.has_unfinished_requests()
    assert token_ids(plain.generate(PROMPTS[:2], greedy(), use_tqdm=False)) == plain_outputs[:2]


@pytest.mark.parametrize("spec, match", [
    ({"method": "ngram", "posterior_threshold": 0.5},
     r"gives \{'posterior_threshold': 0.5\} with acceptance='rejection'.*give acceptance='typical' too"),
    ({"method": "ngram", "acceptance": "typical", "relaxed_topk": 5}, r"acceptance='relaxed''s rule"),
    ({"method": "ngram", "begin_thinking_phase_token": 3}, r"acceptance='relaxed''s rule"),
    ({"method": "ngram", "num_branches": 3, "speculative_token_tree": "[(0,), (0, 0)]"},
     "both num_branches=3 and a speculative_token_tree"),
    ({"method": "eagle", "dynamic_tree_depth": 3}, "dynamic_tree_depth=3 shapes EAGLE-2's dynamic tree: give "
                                                   "use_dynamic_tree=True"),
    ({"method": "ngram", "options": {"prompt_lookup_min": 1}, "prompt_lookup_min": 2},
     r"\['prompt_lookup_min'\] both in options and as keys"),
])
def test_settings_that_would_have_no_effect_are_refused(spec, match):
    """An acceptance rule's settings without that rule, a dynamic tree's shape beside a static tree or without the
    dynamic tree, a key given twice: each would be dropped silently."""
    from specray.drafters import registry

    with pytest.raises(ValueError, match=match):
        registry.check(SpeculativeConfig.from_any(spec))
    typical = SpeculativeConfig(acceptance="typical", posterior_threshold=0.2)
    assert (typical.posterior_threshold, typical.posterior_alpha, SpeculativeConfig().posterior_threshold) == (
        0.2, 0.3, 0.09)
    assert SpeculativeConfig.from_any(typical.to_dict()) == typical


@pytest.mark.parametrize("combine, match", [
    ("draft_model", "a head can be combined with a lookup drafter only"),
    ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min=0"),
])
def test_a_heads_lookup_drafter_is_checked_before_anything_loads(combine, match):
    from specray.engine.builder import check_engine_args

    args = EngineArgs(model="/no/such/model", speculative_config={"method": "eagle", "combine_with": combine})
    with pytest.raises(ValueError, match=match):
        check_engine_args(args)


def test_bad_request_while_others_run(plain, plain_outputs):
    """A bad request added mid-flight raises; the running ones finish unharmed."""
    engine = plain.engine
    start = free_blocks(plain)
    ids = [engine.add_request(plain.get_tokenizer().encode(p), greedy()) for p in PROMPTS[:3]]
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request([], greedy())
    with pytest.raises(ValueError):
        engine.add_request([1] * 400, greedy())
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert [done[i].outputs[0].token_ids for i in ids] == plain_outputs[:3]
    assert free_blocks(plain) == start


def test_abort_frees_blocks(plain):
    engine = plain.engine
    start = free_blocks(plain)
    rid = engine.add_request(plain.get_tokenizer().encode(PROMPTS[3]), greedy(50))
    engine.step()
    engine.step()
    assert free_blocks(plain) < start
    engine.abort_request([rid])
    engine.step()
    assert free_blocks(plain) == start and not engine.has_unfinished_requests()


def test_a_generate_call_ended_early_leaves_no_request_behind(plain, plain_outputs, monkeypatch):
    """An error or Ctrl-C in the middle of ``LLM.generate`` aborts its requests still in flight: none keeps its
    seat or blocks, and the next call runs as if nothing had happened."""
    engine = plain.engine
    start = free_blocks(plain)
    step, calls = engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        plain.generate(PROMPTS[:3], greedy(), use_tqdm=False)
    monkeypatch.undo()
    assert not engine.tracked and not engine.has_unfinished_requests() and free_blocks(plain) == start
    assert [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:3], greedy(), use_tqdm=False)] == \
        plain_outputs[:3]


def test_draft_model_of_another_vocabulary_is_translated_or_refused(tiny_llama_dir, tmp_path, make_tiny_model,
                                                                    monkeypatch):
    """A draft model whose tokenizer is not the target's drafts through the translation
    (tests/test_vocab_translation.py); where a tokenizer cannot be translated, a ValueError says why and the fix."""
    from transformers import AutoTokenizer

    from specray.drafters import draft_model

    other = make_tiny_model(tmp_path / "other", "llama", vocab_size=400)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra_token_a>", "<extra_token_b>"])
    tok.save_pretrained(other)
    spec = {"method": "draft_model", "model": str(other)}
    assert LLM(model=str(tiny_llama_dir), speculative_config=spec).engine.drafter.translator is not None
    monkeypatch.setattr(draft_model, "translatable", lambda tokenizer: "no backend (a stand-in)")
    with pytest.raises(ValueError, match=r"uses another tokenizer than the target .* so its drafts would be translated "
                                         r"through text, but the tokenizer of the target .* cannot be: no backend \(a "
                                         r"stand-in\); pick a draft model with the target's tokenizer"):
        LLM(model=str(tiny_llama_dir), speculative_config=spec)


def test_spec_stats_shape(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM)
    out = llm.generate(PROMPTS[6], greedy(32), use_tqdm=False)[0]
    s = out.spec_stats
    assert s.drafts > 0 and 0 <= s.accepted_tokens <= s.draft_tokens
    assert s.mean_accepted_length == pytest.approx(1 + s.accepted_tokens / s.drafts)
    assert len(s.per_position) <= 4 and all(0 <= p <= 1 for p in s.per_position)
    assert s.per_position == sorted(s.per_position, reverse=True)


def test_per_request_num_speculative_tokens(tiny_llama_dir, plain_outputs):
    """0 drafts nothing for that request while its neighbours draft; k caps its drafts per step; a k above the
    engine's is capped, not an error; greedy output is unchanged."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM)
    params = [greedy(num_speculative_tokens=k) for k in (0, None, 1, 100)] * 2
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert token_ids(outs) == plain_outputs
    stats = [o.spec_stats for o in outs]
    assert all(s.drafts == 0 for s in stats[0::4])
    assert sum(s.drafts for s in stats[1::4]) > 0
    assert sum(s.drafts for s in stats[2::4]) > 0 and all(s.draft_tokens == s.drafts for s in stats[2::4])
    assert sum(s.draft_tokens for s in stats[3::4]) > 0 and all(len(s.per_position) <= 4 for s in stats[3::4])


def test_disable_by_batch_size_drafts_nothing_while_that_many_run(tiny_llama_dir, plain_outputs):
    """vLLM's ``speculative_config.disable_by_batch_size``: no step verifies drafts while 4 or more requests are in
    the engine (running or waiting); fewer, the drafter drafts again; greedy output equals plain; the option is
    checked and kept in to_dict."""
    spec = {**NGRAM, "disable_by_batch_size": 4}
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec)
    steps = []
    execute = llm.engine.executor.execute
    llm.engine.executor.execute = lambda plan, probs=None: steps.append(plan) or execute(plan, probs)
    lengths = [4, 6, 8, 10, 12, 16, 24, 24]
    outs = llm.generate(PROMPTS, [greedy(n) for n in lengths], use_tqdm=False)
    assert token_ids(outs) == [t[:n] for t, n in zip(plain_outputs, lengths)]
    assert all(not c.num_draft_tokens for plan in steps if len(plan.chunks) >= 4 for c in plan.chunks)
    assert any(c.num_draft_tokens for plan in steps for c in plan.chunks)  # drafted once fewer ran
    assert SpeculativeConfig(**spec).to_dict()["disable_by_batch_size"] == 4
    with pytest.raises(ValueError, match="disable_by_batch_size=0 must be an int >= 1"):
        SpeculativeConfig(method="ngram", disable_by_batch_size=0)


def test_policy_caps_draft_length_per_request():
    from specray.scheduler.draft_policy import DraftLengthPolicy
    from specray.scheduler.request import Request

    def req(k):
        r = Request(str(k), [1, 2, 3], SamplingParams(temperature=0.0, num_speculative_tokens=k))
        ev = policy.evidence(r.req_id)
        ev.accepts, ev.rejects = 100.0, 0.0  # alpha ~ 1: the policy wants the most drafts
        return r

    for adaptive in (False, True):
        policy = DraftLengthPolicy(5, adaptive=adaptive)
        assert [policy.choose(req(k), batch_size=1) for k in (None, 0, 2, 9)] == [5, 0, 2, 5]


def test_draft_policy_prices_decode_steps_only(tiny_llama_dir):
    """Prefill chunks cost far less per token than decode tokens; the policy's cost line is fitted on steps of
    last tokens plus drafts only (two requests here: at most 2 * (1 + K) tokens a step)."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM)
    llm.generate([PROMPTS[0] * 3, PROMPTS[1]], greedy(16), use_tqdm=False)  # prefills of 20-60 tokens
    sizes = {n for n, _ in llm.engine.policy._samples}
    assert sizes and max(sizes) <= 2 * (1 + NGRAM["num_speculative_tokens"]), sizes


def test_steps_are_timed_by_the_engine_clock(tiny_llama_dir):
    """The policy's cost fit reads ``engine.clock``: a virtual clock that only the executor advances (as a replay
    of recorded answers uses) is what the fit sees, not wall time."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM)
    engine, now = llm.engine, [0.0]
    execute = engine.executor.execute

    def charged(plan, draft_probs):
        now[0] += 0.25 + 0.01 * plan.num_tokens
        return execute(plan, draft_probs)

    engine.executor.execute, engine.clock = charged, lambda: now[0]
    llm.generate([PROMPTS[0] * 3, PROMPTS[1]], greedy(16), use_tqdm=False)
    samples = list(engine.policy._samples)
    assert samples and all(t == pytest.approx(0.25 + 0.01 * n) for n, t in samples), samples


# ---- one request cannot fail everyone's ------------------------------------------------------------------------
class FaultyExecutor:
    """A test wrapper around the real executor: a plan holding a poisoned request raises, from the third such
    plan on, either after the worker ran it whole (KV and random streams written: the hardest case to run again)
    or before it ran at all; as a plain error, or as a RequestError naming the request."""

    def __init__(self, inner, poisoned: str, when: str, typed: bool):
        self.inner, self.poisoned, self.when, self.typed = inner, poisoned, when, typed
        self.seen = self.raised = 0

    def execute(self, plan, draft_probs=None):
        hit = any(c.req_id == self.poisoned for c in plan.chunks)
        self.seen += hit
        fail = hit and self.seen >= 3
        if fail and self.when == "before":
            self._raise()
        result = self.inner.execute(plan, draft_probs)
        if fail:
            self._raise()
        return result

    def _raise(self):
        from specray.errors import RequestError

        self.raised += 1
        if self.typed:
            raise RequestError([self.poisoned], "injected fault")
        raise RuntimeError("injected fault")

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
@pytest.mark.parametrize("when, typed", [("after", False), ("before", False), ("after", True)])
def test_a_step_failing_for_one_request_fails_only_that_one(tiny_llama_dir, plain_outputs, spec, when, typed):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec)
    engine, tok = llm.engine, llm.get_tokenizer()
    start = free_blocks(llm)
    ids = [engine.add_request(tok.encode(p), greedy()) for p in PROMPTS]
    engine.executor = FaultyExecutor(engine.executor, ids[3], when, typed)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.executor.raised >= 1
    bad = done.pop(ids[3])
    assert bad.outputs[0].finish_reason == "error" and "injected fault" in bad.error
    assert [done[i].outputs[0].token_ids for i in ids if i != ids[3]] == plain_outputs[:3] + plain_outputs[4:]
    assert all(o.error is None for o in done.values())
    assert free_blocks(llm) == start and not engine.tracked
    assert token_ids(llm.generate(PROMPTS[:2], greedy(), use_tqdm=False)) == plain_outputs[:2]  # still serving


class BrokenExecutor:
    """Every step raises, whatever it holds: a broken step, not one request's input."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def execute(self, plan, draft_probs=None):
        self.calls += 1
        raise RuntimeError("broken step")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_step_that_fails_for_every_request_alone_is_raised_not_blamed_on_each(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256)
    engine, tok = llm.engine, llm.get_tokenizer()
    for p in PROMPTS[:3]:
        engine.add_request(tok.encode(p), greedy())
    engine.executor = BrokenExecutor(engine.executor)
    with pytest.raises(RuntimeError, match="broken step"):
        engine.step()
    assert engine.executor.calls == 1 + 3  # the step, then each request alone
    assert len(engine.tracked) == 3  # nobody was finished with an "error" that is not theirs


def test_drafter_failing_for_one_request_costs_it_only_its_drafts(tiny_llama_dir, plain_outputs):
    """A drafter that raises for one request mid-generation: that request decodes on without drafts (the drafter
    is not asked for it again), the others keep theirs; every output is plain decoding's."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM)
    engine, tok = llm.engine, llm.get_tokenizer()
    ids = [engine.add_request(tok.encode(p), greedy()) for p in PROMPTS[:4]]
    propose = engine.drafter.propose

    asked_after_fault = []

    def faulty(batch):
        if any(d.req_id == ids[1] and len(d.token_ids) > 8 for d in batch):
            asked_after_fault.append(len(batch))
            raise RuntimeError("injected drafter fault")
        return propose(batch)

    engine.drafter.propose = faulty
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert [done[i].outputs[0].token_ids for i in ids] == plain_outputs[:4]
    assert all(done[i].error is None for i in ids)
    assert asked_after_fault[-1] == 1 and len(asked_after_fault) == 2  # the batch, then that request alone
    assert engine.drafting_failures == 1 and llm.spec_stats.accepted_tokens > 0


def test_seed_outside_64_bits_is_refused_at_admission(plain):
    """A seed a torch.Generator cannot take used to pass validation and fail the whole step (every request)."""
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**70)
    params = greedy(seed=1)
    params.seed = 2**70  # changed after validation: admission checks again
    with pytest.raises(ValueError, match="seed"):
        plain.engine.add_request([5, 6, 7], params)
    assert not plain.engine.has_unfinished_requests()
    for seed in (-(2**63), 2**64 - 1):  # the edges of the range run
        out = plain.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, seed=seed), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_the_engine_keeps_its_own_copy_of_a_request_s_params(plain):
    """What admission resolves (max_tokens for this prompt, logprobs -1 as the vocabulary) stays with the request:
    the caller's params, used again for a longer prompt, still mean "up to max_model_len"."""
    engine = plain.engine
    params = SamplingParams(max_tokens=None, logprobs=-1, temperature=0.0)
    engine.abort_request([engine.add_request([5] * 200, params)])
    assert (params.max_tokens, params.logprobs) == (None, -1)
    rid = engine.add_request([5, 6, 7], params)
    assert engine.tracked[rid].request.sampling_params.max_tokens == 256 - 3
    engine.abort_request([rid])


def test_draft_model_takes_the_largest_seed(tiny_llama_dir, tiny_draft_dir):
    """The draft model's own stream is seeded seed + 1: kept inside 64 bits for seed = 2**64 - 1."""
    spec = {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=spec)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, seed=2**64 - 1, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6 and out[0].error is None


# ---- one configuration path ----------------------------------------------------------------------------------
def test_speculative_config_forms_and_aliases():
    from specray.drafters.registry import options_of

    flat = SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_min=2)
    assert flat == SpeculativeConfig.from_any({"method": "ngram", "num_speculative_tokens": 5,
                                               "prompt_lookup_min": 2})
    assert options_of(flat).prompt_lookup_min == 2 and options_of(flat).prompt_lookup_max == 4
    trt = SpeculativeConfig.from_any({"method": "ngram", "max_draft_len": 3, "max_matching_ngram_size": 2})
    assert trt.num_speculative_tokens == 3 and options_of(trt).prompt_lookup_max == 2
    assert SpeculativeConfig.from_any(trt.to_dict()) == trt


def test_misplaced_option_fails_before_any_actor_starts(tiny_llama_dir):
    """The Ray backend checks the options in this process, before its engine actor starts."""
    with pytest.raises(ValueError,
                       match=r"prompt_lookup_min is an option of method 'ngram'.*not of method='draft_model'"):
        LLM(str(tiny_llama_dir), distributed_executor_backend="ray",
            speculative_config={"method": "draft_model", "model": str(tiny_llama_dir), "prompt_lookup_min": 1})
    heads = json.loads((tiny_llama_dir / "config.json").read_text())["num_attention_heads"]
    with pytest.raises(ValueError, match=f"tensor_parallel_size={heads + 1} does not split this model's heads"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=heads + 1)  # said here, not by the ranks once placed


@pytest.mark.parametrize("spec, tp, match", [
    ({"method": "eagle3", "draft_tensor_parallel_size": 3}, 2, r"draft_tensor_parallel_size=3: .* 1 or 2 here"),
    ({"method": "mtp", "draft_tensor_parallel_size": 2}, 1, r"draft_tensor_parallel_size=2: .* 1 here"),
    ({"method": "redrafter", "model": "drafter", "draft_tensor_parallel_size": 3}, 2, r"1 or 2 here"),
    ({"method": "eagle", "draft_tensor_parallel_size": 0}, 2, r"draft_tensor_parallel_size=0 must be an int >= 1"),
])
def test_a_heads_draft_tensor_parallel_size_is_checked_before_anything_starts(tiny_llama_dir, spec, tp, match):
    """A head runs with the target's ranks: split over all of them or whole on the driver (vLLM's
    draft_tensor_parallel_size, 1 or the target's); Medusa and ReDrafter stay whole."""
    from specray.engine.builder import check_engine_args

    args = EngineArgs.from_dict({"model": str(tiny_llama_dir), "tensor_parallel_size": tp,
                                 "distributed_executor_backend": "ray", "speculative_config": spec})
    with pytest.raises(ValueError, match=match):
        check_engine_args(args)


def test_a_head_whose_heads_do_not_split_is_refused_before_anything_starts(tiny_llama_dir, tmp_path):
    from specray.engine.builder import check_engine_args

    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"num_attention_heads": 3, "num_key_value_heads": 3}))
    args = {"model": str(tiny_llama_dir), "tensor_parallel_size": 2, "distributed_executor_backend": "ray",
            "speculative_config": {"method": "eagle3", "model": str(head)}}
    with pytest.raises(ValueError, match=r"eagle3 head's num_attention_heads=3 .* set "
                                         r"speculative_config.draft_tensor_parallel_size=1"):
        check_engine_args(EngineArgs.from_dict(args))
    args["speculative_config"]["draft_tensor_parallel_size"] = 1  # whole on rank 0: nothing to split
    check_engine_args(EngineArgs.from_dict(args))


def test_a_head_is_split_over_the_targets_ranks_unless_told_otherwise(monkeypatch):
    from specray.drafters.registry import worker_drafter_config
    from specray.models import draft_head_loader

    monkeypatch.setattr(draft_head_loader, "read_head_config", lambda path: None)  # no head folders here

    def split(method: str, tp: int, **options) -> bool:
        model = {"medusa": "heads", "redrafter": "drafter"}.get(method, "head")
        return worker_drafter_config(SpeculativeConfig(method=method, model=model, **options), "target", tp)["split"]

    assert split("eagle3", 2) and split("mtp", 4) and split("eagle", 2, draft_tensor_parallel_size=2)
    assert not split("eagle3", 1) and not split("eagle3", 2, draft_tensor_parallel_size=1)
    assert split("medusa", 2) and not split("medusa", 2, draft_tensor_parallel_size=1) and split("redrafter", 2)


def test_engine_args_pass_through_as_plain_data(tiny_llama_dir):
    import json

    from specray.engine.builder import engine_args_schema

    args = EngineArgs.from_dict({"model": str(tiny_llama_dir), "max_num_seqs": 4,
                                 "speculative_config": {"method": "ngram", "is_public_pool": True},
                                 "ray_placement": {"pool_name": "shared"}})
    assert EngineArgs.from_dict(json.loads(json.dumps(args.to_dict()))) == args
    schema = json.loads(json.dumps(engine_args_schema()))  # JSON-able
    assert schema["max_num_seqs"] == {"type": "int", "default": 8} and schema["model"]["required"]
    spec_keys = schema["speculative_config"]["keys"]
    assert set(spec_keys["common"]) == {"method", "num_speculative_tokens", "adaptive", "acceptance",
                                        "posterior_threshold", "posterior_alpha", "relaxed_topk", "relaxed_delta",
                                        "begin_thinking_phase_token", "end_thinking_phase_token",
                                        "disable_by_batch_size"}
    assert "is_public_pool" in spec_keys["methods"]["ngram"] and "model" in spec_keys["methods"]["draft_model"]
    assert "pool_name" in schema["ray_placement"]["keys"]


def test_engine_shutdown_drops_requests_and_releases_the_executor(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, speculative_config=NGRAM)
    engine, released = llm.engine, []
    engine.add_request([5, 6, 7], greedy())
    engine.step()
    shutdown = engine.executor.shutdown
    engine.executor.shutdown = lambda: released.append(shutdown())
    engine.shutdown()
    assert released and not engine.tracked and not engine.has_unfinished_requests()
    assert free_blocks(llm) == engine.scheduler.block_manager.num_blocks
    llm.shutdown()
    with pytest.raises(RuntimeError, match="this LLM was shut down"):
        llm.generate("ok", greedy(), use_tqdm=False)


def test_priority_scheduling_admits_by_priority_and_keeps_outputs(tiny_llama_dir, plain, plain_outputs):
    """scheduling_policy="priority" with LLM.generate's priority (vLLM's): greedy outputs are plain decoding's;
    the lowest values are admitted first; an engine that serves first come, first served refuses a priority."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, max_num_seqs=2, scheduling_policy="priority",
              speculative_config=NGRAM)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False, priority=[3, 2, 1, 0, -1, -2, -3, -4])
    assert token_ids(outs) == plain_outputs
    engine, tok = llm.engine, llm.get_tokenizer()
    ids = [engine.add_request(tok.encode(p), greedy(4, priority=value))
           for p, value in zip(PROMPTS[:4], [2, 0, 1, -1])]
    engine.step()
    assert sorted(r.req_id for r in engine.scheduler.running) == sorted([ids[3], ids[1]])
    engine.abort_request(ids)
    with pytest.raises(ValueError, match="priority=.* must be a list of one int per prompt"):
        llm.generate(PROMPTS[:2], greedy(), use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="priority=1 needs an engine with scheduling_policy='priority'"):
        plain.generate(PROMPTS[:2], greedy(), use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="scheduling_policy='lottery' must be 'fcfs'"):
        EngineArgs(model="m", scheduling_policy="lottery")


def test_dtype_takes_vllm_s_aliases():
    """vLLM's dtype names: ``half`` (float16) and ``float`` (float32) beside the full ones; another is refused,
    listing them all."""
    assert EngineArgs(model="m", dtype="half").dtype == "float16"
    assert EngineArgs(model="m", dtype="float").dtype == "float32"
    assert [EngineArgs(model="m", dtype=d).dtype for d in ("auto", "bfloat16")] == ["auto", "bfloat16"]
    with pytest.raises(ValueError, match=r"dtype='float64' is not supported; choose one of \['auto', 'float32', "
                                         r"'float16', 'bfloat16', 'float', 'half'\]"):
        EngineArgs(model="m", dtype="float64")


def test_gpu_memory_utilization_sizes_the_kv_cache():
    """vLLM's gpu_memory_utilization: the KV cache gets GPU_KV_CACHE_FRACTION of the share of the GPU's total memory
    the engine may use less what is in use already (None: of what is free); a share used up by the weights is a
    ValueError that says so; out-of-range values are refused up front."""
    from specray.workers.worker import GPU_KV_CACHE_FRACTION, gpu_kv_budget

    gib = 1 << 30
    assert gpu_kv_budget(60 * gib, 80 * gib, None) == int(60 * gib * GPU_KV_CACHE_FRACTION)
    assert gpu_kv_budget(60 * gib, 80 * gib, 1.0) == int(60 * gib * GPU_KV_CACHE_FRACTION)
    assert gpu_kv_budget(60 * gib, 80 * gib, 0.5) == int(20 * gib * GPU_KV_CACHE_FRACTION)  # 40 allowed, 20 used
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.2 allows 16.00 GiB .* 20.00 GiB are in use"):
        gpu_kv_budget(60 * gib, 80 * gib, 0.2)
    for bad in (0, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="gpu_memory_utilization=.* must be a number in"):
            EngineArgs(model="m", gpu_memory_utilization=bad)


@pytest.mark.parametrize("name", ["max_model_len", "max_num_seqs", "block_size", "max_num_batched_tokens",
                                  "num_kv_blocks", "kv_cache_memory_bytes"])
def test_engine_sizes_must_be_ints(name):
    """A size given as text (a config file's "100") or a float is a ValueError naming it, not a TypeError deep in
    the engine's arithmetic."""
    for bad in ("100", 2.5, True, 0):
        with pytest.raises(ValueError, match=f"{name}={bad!r} must be an int >= 1"):
            EngineArgs(model="m", **{name: bad})


def test_ray_placements_custom_resources_are_checked_before_ray_starts():
    """worker_resources is one dict per target rank: a bare dict (which a TP-1 engine's ranks unpacked as a string),
    a count that is not the ranks' or CPUs given there are ValueErrors naming it; drafter_resources is one dict."""
    for bad in ({"node1": 1}, [{"node1": "x"}, {}], [{"CPU": 2}, {}], []):
        with pytest.raises(ValueError, match=r"ray_placement.worker_resources=.* must be a list of one dict per"):
            EngineArgs(model="m", tensor_parallel_size=2, ray_placement={"worker_resources": bad})
    with pytest.raises(ValueError, match=r"worker_resources has 1 dicts for 2 target ranks .*one dict per rank"):
        EngineArgs(model="m", pipeline_parallel_size=2, ray_placement={"worker_resources": [{"node1": 1}]})
    with pytest.raises(ValueError, match=r"ray_placement.drafter_resources=\[.* must be a dict of custom"):
        EngineArgs(model="m", ray_placement={"drafter_resources": [{"node1": 1}]})
    EngineArgs(model="m", tensor_parallel_size=2, ray_placement={"worker_resources": [{"node0": 1}, {"node1": 0.5}],
                                                                 "drafter_resources": {"node2": 0.01}})
