"""Prefix caching on a model with linear attention (Qwen3.5's hybrid layers: a recurrent state per request). A
prompt's prefill stops at its last whole block and the state there is kept (a snapshot slot), and also where it parts
from cached blocks no kept state ends (an earlier prompt's: a shared system prompt); a later request whose tokens
begin with those blocks starts from them and from the kept state (its conv history and delta-rule matrix), and
computes only the rest. Greedy tokens equal an engine without prefix caching, plain and with n-gram
drafts and with the release's MTP head, multi-turn (each turn's prompt the last one's prompt, answer and a new message), with fewer snapshot slots
than conversations (least recently used ones forgotten), under preemption, and from graphs."""

from __future__ import annotations

import pytest

from specray_test_hybrid_models import NGRAM, greedy  # tests/hybrid_models.py (registered by conftest)

BLOCK = 4


def conversations(n: int) -> list[list[int]]:
    """n opening prompts of different lengths (some a whole number of blocks), distinct from each other."""
    return [[30 + 17 * c + (i * 7 + c) % 11 for i in range(9 + 3 * c)] for c in range(n)]


def turns(llm, rounds: int, n: int, max_tokens: int = 6) -> tuple[list[list[list[int]]], list[int]]:
    """``rounds`` turns of ``n`` conversations, one request each per turn (the next turn's prompt: the prompt, its
    answer and two new tokens); every turn's answers, and the tokens each turn's requests found cached."""
    prompts, answers, cached = conversations(n), [], []
    for r in range(rounds):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens), use_tqdm=False)
        answers.append([o.outputs[0].token_ids for o in outs])
        cached.append(sum(o.num_cached_tokens for o in outs))
        prompts = [p + list(o.outputs[0].token_ids) + [3 + r, 4 + r] for p, o in zip(prompts, outs)]
    return answers, cached


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    import specray_test_hybrid_models as hybrid_models

    return hybrid_models.save(tmp_path_factory.mktemp("hybrid_prefix"), "qwen3_5", seed=3)


def engine(folder, **kw):
    from specray import LLM

    return LLM(model=str(folder), max_model_len=256, block_size=BLOCK, **kw)


@pytest.fixture(scope="module")
def hybrid_mtp(tmp_path_factory):
    """A hybrid target with its release's MTP layer (``mtp.*``), drafting "the same token again" mostly."""
    import specray_test_draft_heads as draft_heads

    root = tmp_path_factory.mktemp("hybrid_mtp")
    target = draft_heads.write_tiny_hybrid(root / "target", "qwen3_5")
    return draft_heads.write_qwen_mtp(root / "mtp", target)


@pytest.mark.parametrize("spec", [None, NGRAM, {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}],
                         ids=["plain", "ngram", "mtp"])
def test_turns_from_kept_states_equal_no_prefix_caching(request, hybrid, spec):
    """Three turns of three conversations: from the second turn on every request starts behind its conversation's
    cached blocks and kept state, and the greedy tokens equal an engine without prefix caching (with the MTP head,
    whose K/V of the cached blocks the request that computed them wrote)."""
    folder = request.getfixturevalue("hybrid_mtp") if spec and spec["method"] == "mtp" else hybrid
    want, none = turns(engine(folder, speculative_config=spec), 3, 3)
    llm = engine(folder, enable_prefix_caching=True, speculative_config=spec)
    got, cached = turns(llm, 3, 3)
    assert got == want and none == [0, 0, 0]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1], cached
    scheduler = llm.engine.scheduler
    assert scheduler.block_manager.num_free_blocks == scheduler.config.num_blocks
    if spec is not None:
        assert llm.spec_stats.accepted_tokens > 0


def test_prompts_sharing_a_system_prompt_start_where_they_part(hybrid):
    """Prompts that share a system prompt (two whole blocks) and part after it, one at a time: the first computes
    all of its own; the second finds the shared blocks cached but no kept state there (the first's is past where
    they part), computes them again and keeps the state where it parts from the first too; every later one starts
    there. The tokens equal an engine without prefix caching."""
    system = [40 + (i * 5) % 23 for i in range(10)]  # 2.5 blocks
    prompts = [{"prompt_token_ids": system + [100 + 7 * k + i for i in range(6 + k)]} for k in range(4)]
    want = [o.outputs[0].token_ids for o in engine(hybrid).generate(prompts, greedy(6), use_tqdm=False)]
    llm = engine(hybrid, enable_prefix_caching=True)
    outs = [llm.generate([p], greedy(6), use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [0, 0, 2 * BLOCK, 2 * BLOCK]
    scheduler = llm.engine.scheduler
    assert scheduler.block_manager.num_free_blocks == scheduler.config.num_blocks


def test_fewer_kept_states_than_conversations(hybrid):
    """Two seats keep two states: two conversations' turns find theirs, two others' turns then take the slots (the
    least recently used states forgotten), and the first two, back, start from scratch once and from their kept
    states again after; from graphs. The tokens stay those of an engine without prefix caching."""
    def run(llm):
        firsts, others = [conversations(4)[:2]], [conversations(4)[2:]]
        out = []
        for prompts in (firsts, others, firsts):
            answers, cached = [], []
            for r in range(2):
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts[-1]], greedy(6), use_tqdm=False)
                answers.append([o.outputs[0].token_ids for o in outs])
                cached.append(sum(o.num_cached_tokens for o in outs))
                prompts.append([p + list(o.outputs[0].token_ids) + [3 + r, 4 + r] for p, o in zip(prompts[-1], outs)])
            out.append((answers, cached))
        return out

    want = run(engine(hybrid, max_num_seqs=2))
    llm = engine(hybrid, max_num_seqs=2, enable_prefix_caching=True, enforce_eager=False)
    got = run(llm)
    assert [a for a, _ in got] == [a for a, _ in want]
    (_, first), (_, second), (_, again) = got
    assert first[1] > 0 and second[1] > 0 and again[1] > 0, got  # each pair's second turn from its kept states
    assert llm.engine.executor.worker.runner.graphs.graphs
    assert len(llm.engine.scheduler._snapshots) <= 2
