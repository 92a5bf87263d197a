"""PARD (``method="draft_model"`` with ``parallel_drafting``): the draft model drafts all K tokens in one forward,
the history followed by K - 1 pard tokens. Every proposal equals a dense reference (transformers' draft model over
the history and the pard tokens, its argmax at the last K rows; a sampled request's q its warpers over them);
greedy output equals plain decoding (mixed batches, one at a time, preemption, penalties, a grammar); the target
drafting for itself has its first draft of every step accepted (the catch-up and rewind are exact); sampling keeps
the target's distribution; a checkpoint without a pard token is refused."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specray import LLM, SamplingParams
from specray.sampling import SamplingBatch, logits_to_probs
from specray_test_engine_runs import PROMPTS, check_sampled_distribution, greedy, token_ids  # tests/engine_runs.py

K = 3


def with_pard_token(source: Path, folder: Path) -> Path:
    """A copy of the model in ``source`` whose config names its last token id as the pard token."""
    if not folder.exists():
        shutil.copytree(source, folder)
        config = json.loads((folder / "config.json").read_text())
        config["pard_token"] = config["vocab_size"] - 1
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def pard_dir(tiny_draft_dir, tmp_path_factory) -> Path:
    return with_pard_token(tiny_draft_dir, tmp_path_factory.mktemp("pard") / "draft")


@pytest.fixture(scope="module")
def self_pard_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return with_pard_token(tiny_llama_dir, tmp_path_factory.mktemp("self_pard") / "target")


def spec(draft: Path, **kw) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K, "adaptive": False,
            "parallel_drafting": True, **kw}


def test_proposals_equal_the_dense_reference(tiny_llama_dir, pard_dir):
    """Every proposal the engine's drafter makes (after catch-ups over accepted and rejected drafts, greedy and
    sampled requests, mixed draft counts) equals transformers' draft model run over the request's history followed by
    K - 1 pard tokens: its argmax at the history's last token and at each pard token (a near tie may go either way);
    a sampled request's q is the request's warpers over those rows, and each draft lies in its support."""
    llm = LLM(str(tiny_llama_dir), max_model_len=256, speculative_config=spec(pard_dir))
    drafter = llm.engine.drafter
    seen = []
    propose = drafter.propose
    # (each request's history as it was asked: a DraftRequest reads the request's growing token list)
    drafter.propose = lambda batch: seen.append(([replace(d, token_ids=list(d.token_ids)) for d in batch],
                                                 out := propose(batch))) or out
    params = [greedy(20), SamplingParams(temperature=0.9, top_k=6, max_tokens=20, ignore_eos=True, seed=3),
              greedy(20, num_speculative_tokens=2), SamplingParams(temperature=1.2, top_p=0.9, max_tokens=20,
                                                                   ignore_eos=True, seed=4)]
    llm.generate(PROMPTS[:4], params, use_tqdm=False)
    dense = AutoModelForCausalLM.from_pretrained(str(pard_dir), dtype=torch.float32).eval()
    pard = json.loads((pard_dir / "config.json").read_text())["pard_token"]
    checked = drawn = 0
    for batch, proposals in seen:
        for d, p in zip(batch, proposals):
            if not p.token_ids:
                continue
            k = len(p.token_ids)
            assert k == d.num_speculative_tokens
            with torch.inference_mode():
                logits = dense(torch.tensor([list(d.token_ids) + [pard] * (k - 1)])).logits[0, -k:].float()
            if d.sampling_params.greedy:
                for i, token in enumerate(p.token_ids):
                    best = int(logits[i].argmax())
                    assert token == best or logits[i, best] - logits[i, token] < 1e-4, (i, p.token_ids, best)
            else:
                want = logits_to_probs(logits, SamplingBatch.build([d.sampling_params] * k, [None] * k, "cpu"))
                torch.testing.assert_close(p.probs.cpu()[:, : want.shape[1]], want, atol=1e-5, rtol=1e-4)
                assert all(p.probs[i, t] > 0 for i, t in enumerate(p.token_ids))
                drawn += 1
            checked += 1
    assert checked >= 20 and drawn >= 5, (checked, drawn)


MIXED = [greedy(), greedy(num_speculative_tokens=0), greedy(1), greedy(2), greedy(3), greedy(num_speculative_tokens=1),
         greedy(logprobs=2), greedy(7)]


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_equals_plain(tiny_llama_dir, pard_dir, plain, batch):
    want = plain.generate(PROMPTS, MIXED, use_tqdm=False)
    llm = LLM(str(tiny_llama_dir), max_model_len=256, speculative_config=spec(pard_dir))
    got = llm.generate(PROMPTS, MIXED, use_tqdm=False) if batch == 8 else \
        [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(PROMPTS, MIXED)]
    assert token_ids(got) == token_ids(want)
    assert llm.spec_stats.draft_tokens > 0


def test_self_drafting_accepts_every_first_draft(tiny_llama_dir, self_pard_dir, plain_outputs):
    """The target as its own PARD drafter (untrained for pard tokens): its first draft of every step is read at the
    history's last token, so it is the target's own next token and always kept; the later ones are guesses. Under
    preemption too (the drafter's cache rewound and caught up)."""
    llm = LLM(str(self_pard_dir), max_model_len=256, speculative_config=spec(self_pard_dir), block_size=4,
              num_kv_blocks=40)
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == plain_outputs
    stats = llm.spec_stats
    assert stats.accepted_per_position[0] == stats.drafts > 0, stats
    assert llm.engine.scheduler.num_preemptions > 0


def test_penalties_and_a_grammar_keep_greedy_output(tiny_llama_dir, pard_dir, plain):
    """Each row's logits shaped by the request's penalties (the drafts before it counted) and by its grammar (each row
    masked after the drafts before it), as the sequential drafter does."""
    params = [greedy(repetition_penalty=1.3, presence_penalty=0.4), greedy(frequency_penalty=0.5),
              greedy(structured_outputs={"regex": "[a-z ]{5,20}"})]
    want = plain.generate(PROMPTS[:3], params, use_tqdm=False)
    llm = LLM(str(tiny_llama_dir), max_model_len=256, speculative_config=spec(pard_dir))
    assert token_ids(llm.generate(PROMPTS[:3], params, use_tqdm=False)) == token_ids(want)


def test_sampled_output_keeps_the_target_distribution(tiny_llama_dir, self_pard_dir, plain):
    """Seeded sampled requests through the target drafting for itself in parallel (its first draft drawn from the
    target's own q, the later ones from the pard rows' q): the first three tokens fit the target's distribution, and
    not the target's at T=1."""
    prompt = plain.get_tokenizer().encode(PROMPTS[4])
    llm = LLM(str(self_pard_dir), max_model_len=256, max_num_seqs=64, speculative_config=spec(self_pard_dir))
    check_sampled_distribution(llm, tiny_llama_dir, prompt, max_tokens=6)  # room for a chain of K after token 1


def test_a_checkpoint_without_a_pard_token_is_refused(tiny_llama_dir, tiny_draft_dir):
    with pytest.raises(ValueError, match=r"parallel_drafting=true needs a PARD draft model: .* pard_token=None"):
        LLM(str(tiny_llama_dir), speculative_config=spec(tiny_draft_dir))
    with pytest.raises(ValueError, match=r"parallel_drafting='yes' must be a bool"):
        LLM(str(tiny_llama_dir), speculative_config=spec(tiny_draft_dir, parallel_drafting="yes"))
