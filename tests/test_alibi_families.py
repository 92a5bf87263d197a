"""ALiBi's families (:mod:`specray.models.alibi`), against transformers on the same random tiny weights (fp32, max abs
diff < 1e-4) over a prefill and over chunks and single steps, with the engine's greedy output under n-gram drafts
equal to transformers' ``generate``, two tensor-parallel ranks (each its heads' slopes) or pipeline stages equal to
one, and graph steps of token trees equal to eager ones:

* BLOOM (``BloomForCausalLM``): six heads (slopes of four, and two between them), q/k/v fused head by head, a
  LayerNorm on the embeddings; and a release whose blocks' residuals are their normed inputs.
* MPT (``MptForCausalLM``): six heads, ``Wqkv`` fused, LayerNorms without biases, q/k/v clamped, its own score scale.
* Falcon-RW (``FalconForCausalLM`` with ``alibi``): the bias scaled with the scores, blocks in sequence.
"""

from __future__ import annotations

import sys

import pytest
import torch

from specray.models.alibi import alibi_slopes
from specray.models.bloom import BloomForCausalLM
from specray.models.falcon import FalconForCausalLM
from specray.models.loader import load_model
from specray.models.mpt import MptForCausalLM
from specray_test_model_checks import (  # tests/model_checks.py
    SCHEDULES, assert_ranks_match_one_rank, chunked_logits, max_diff, prompt,
    reference_logits)

TOL = 1e-4

FAMILIES = {"bloom": ("tiny_bloom_dir", BloomForCausalLM),
            "bloom_post_ln": ("tiny_bloom_post_ln_dir", BloomForCausalLM), "mpt": ("tiny_mpt_dir", MptForCausalLM),
            "falcon_rw": ("tiny_falcon_rw_dir", FalconForCausalLM)}


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 6, 8, 12, 16, 20, 32, 71, 112])
def test_slopes_are_bloom_and_mpt_ones(num_heads):
    """One rule for both families' slopes (BLOOM's powers of two with the between-slopes, MPT's interleaving of the
    next power of two's), as transformers computes each."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    ours = torch.tensor(alibi_slopes(num_heads))
    assert torch.allclose(ours, _get_alibi_slopes(num_heads, torch.device("cpu")), rtol=1e-6, atol=0)
    mpt = build_mpt_alibi_tensor(num_heads, 2)[:, 0, 0]  # [heads]: the bias one position back: -slope
    assert torch.allclose(ours.float(), -mpt, rtol=1e-6, atol=0)
    assert torch.allclose(torch.tensor(alibi_slopes(num_heads, 4.0)),
                          -build_mpt_alibi_tensor(num_heads, 2, alibi_bias_max=4)[:, 0, 0], rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(request, family, schedule):
    fixture, model_class = FAMILIES[family]
    folder = request.getfixturevalue(fixture)
    model = load_model(str(folder))
    assert isinstance(model, model_class)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference_logits(folder)) < TOL


def dense_alibi(q, k, v, allowed, q_pos, k_pos, slopes, scale):
    # q: [n, Hq, D]; k, v: [m, Hkv, D]; allowed: [n, m] bool; q_pos [n], k_pos [m] -> [n, Hq*D], written out by hand
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    bias = torch.tensor(slopes)[:, None, None] * (k_pos[None, None, :] - q_pos[None, :, None]).float()  # [Hq, n, m]
    scores = torch.einsum("nhd,mhd->hnm", q, k) * scale + bias
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hnm,mhd->nhd", probs, v).reshape(q.shape[0], -1)


@pytest.mark.parametrize("path", ["batched", "own-gathered", "own-in-place", "row-blocks"])
def test_bias_over_grouped_heads_and_trees_matches_a_dense_reference(monkeypatch, path):
    """ALiBi over a paged cache with two query heads per KV head (no release has them; the folded rows' slopes must
    follow their heads): a prefill (a long one attended on its own), then a mixed step (decode, last token + drafts, a
    long continued chunk), then a step of token trees (siblings at one depth, so positions differ from slots), through
    the padded batch or one sequence at a time (gathered or read in place; or with a bias budget so small that long
    sequences go by blocks of a few rows), equals dense attention with the bias written out by hand."""
    import random

    from specray.models import alibi, cpu_kernels
    from specray.models.alibi import AlibiAttention
    from specray.models.attention import build_attention_metadata
    from specray.models.kv_cache import FullAttentionSpec, KVCache

    if path != "batched":
        monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 0)
    if path == "row-blocks":  # 4 heads x 40 keys x 3 rows: blocks of 3 rows at the longest context
        monkeypatch.setattr(alibi, "BIAS_ELEMENTS", 4 * 40 * 3)
    block, spec, slopes = 4, FullAttentionSpec(num_kv_heads=2, head_dim=8), alibi_slopes(4)
    attn = AlibiAttention(4, spec, 8**-0.5, slopes)
    cache = KVCache([spec], 64, block, torch.float32, "cpu")
    attn.bind_cache(cache.layer(0), block)
    free = list(range(64)) if path == "own-in-place" else random.Random(1).sample(range(64), 64)
    gen = torch.Generator().manual_seed(0)
    lens = [24, 16, 44]
    full = [(torch.randn(n, 4, 8, generator=gen), torch.randn(n, 2, 8, generator=gen),
             torch.randn(n, 2, 8, generator=gen)) for n in lens]  # q, k, v of every slot
    tables = [[free.pop(0) for _ in range(-(-n // block))] for n in lens]
    for step in ([(0, 9), (0, 7), (0, 20)], [(9, 10), (7, 11), (20, 40)]):  # prefill, then decode/drafts/long
        meta = build_attention_metadata([b - a for a, b in step], [a for a, _ in step], tables, block)
        q, k, v = (torch.cat([full[i][j][a:b] for i, (a, b) in enumerate(step)]) for j in range(3))
        outs = attn(q, k, v, meta).split([b - a for a, b in step])
        for (a, b), out, (fq, fk, fv) in zip(step, outs, full):
            mask = torch.ones(b - a, b, dtype=torch.bool).tril(a)
            pos = torch.arange(b)
            torch.testing.assert_close(out, dense_alibi(fq[a:b], fk[:b], fv[:b], mask, pos[a:b], pos, slopes, 8**-0.5))
    # trees: a root and two children at depth 1 (the second child's own child at depth 2), after each sequence's
    # context; each node sees its ancestors and itself, at distances by depth
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    depth = [0, 1, 1, 2]
    step = [(10, 14), (11, 15), (40, 44)]
    meta = build_attention_metadata([4] * 3, [a for a, _ in step], tables, block,
                                    positions=[a + d for a, _ in step for d in depth], ancestors=[anc] * 3)
    q, k, v = (torch.cat([full[i][j][a:b] for i, (a, b) in enumerate(step)]) for j in range(3))
    outs = attn(q, k, v, meta).split(4)
    for (a, b), out, (fq, fk, fv) in zip(step, outs, full):
        mask = torch.cat([torch.ones(4, a, dtype=torch.bool), anc], dim=1)
        pos = torch.cat([torch.arange(a), a + torch.tensor(depth)])
        torch.testing.assert_close(out, dense_alibi(fq[a:b], fk[:b], fv[:b], mask, pos[a:], pos, slopes, 8**-0.5))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_greedy_with_ngram_drafts_equals_transformers(request, family):
    folder = request.getfixturevalue(FAMILIES[family][0])
    sys.modules["specray_test_engine_runs"].assert_ngram_greedy_equals_transformers(folder)


@pytest.mark.parametrize("stages", [1, 2])
def test_two_ranks_match_one_rank(request, tmp_path, stages):
    """Two tensor-parallel ranks (stages 1: each rank its three heads and their slopes) or two pipeline stages (2:
    BLOOM's embedding norm on the first): the last rank's logits equal one rank's."""
    fixtures = ("tiny_bloom_dir", "tiny_mpt_dir", "tiny_falcon_rw_dir", "tiny_bloom_post_ln_dir")
    folders = [str(request.getfixturevalue(f)) for f in fixtures]
    assert_ranks_match_one_rank(tmp_path, folders, stages, TOL)


@pytest.mark.parametrize("fixture", ["tiny_bloom_dir", "tiny_mpt_dir"])
def test_graph_steps_equal_eager_steps(request, fixture, no_host_sync):
    """Steps replayed from graphs (``enforce_eager=False``: padded static inputs, the bias among the graph's data,
    rebuilt from each step's positions) give the eager engine's tokens, with n-gram token trees (nodes at their depth's
    distance), a batch of four padded to eight and a lone request; prefix caching on. The forward a capture records
    syncs nothing with the host."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    spec = {"method": "ngram", "num_speculative_tokens": 6, "num_branches": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "adaptive": False}
    folder = str(request.getfixturevalue(fixture))
    kwargs = dict(max_model_len=256, block_size=4, speculative_config=spec)
    eager, graphs = LLM(model=folder, **kwargs), LLM(model=folder, enforce_eager=False, enable_prefix_caching=True,
                                                     **kwargs)
    for prompts in (runs.PROMPTS[:4], runs.PROMPTS[:1]):
        want = runs.token_ids(eager.generate(prompts, runs.greedy(), use_tqdm=False))
        assert runs.token_ids(graphs.generate(prompts, runs.greedy(), use_tqdm=False)) == want
    steps = graphs.engine.executor.worker.runner.graphs
    assert steps.graphs and graphs.spec_stats.accepted_tokens > 0
    graph = next(iter(steps.graphs.values()))
    with torch.inference_mode(), no_host_sync():
        steps._step(graph.input_ids, graph.meta, graph.inputs)


def test_draft_model_greedy_equals_transformers(tiny_bloom_dir):
    """BLOOM drafting for itself (bloom-560m for BLOOM-7B1): every draft accepted, the tokens transformers' greedy
    ones."""
    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    llm = LLM(model=str(tiny_bloom_dir), max_model_len=256, block_size=4,
              speculative_config={"method": "draft_model", "model": str(tiny_bloom_dir), "num_speculative_tokens": 3,
                                  "adaptive": False})
    got = runs.token_ids(llm.generate(runs.PROMPTS[:4], runs.greedy(16), use_tqdm=False))
    runs.assert_transformers_generates(tiny_bloom_dir, llm.get_tokenizer(), runs.PROMPTS[:4], got)
    assert 0 < llm.spec_stats.accepted_tokens == llm.spec_stats.draft_tokens, llm.spec_stats


@pytest.mark.parametrize("field, value, message", [
    ("attn_config", {"alibi": False}, "attn_config.alibi=False"),
    ("attn_config", {"qk_ln": True}, "attn_config.qk_ln=True"),
    ("attn_config", {"attn_type": "multiquery_attention"}, "attn_type='multiquery_attention'"),
    ("logit_scale", 0.5, "logit_scale=0.5"), ("norm_type", "rmsnorm", "norm_type='rmsnorm'")])
def test_mpt_settings_no_release_has_are_refused_by_name(tiny_mpt_dir, field, value, message):
    from specray.models.loader import load_hf_config

    config = load_hf_config(str(tiny_mpt_dir))
    if field == "attn_config":
        [(key, value)] = value.items()
        setattr(config.attn_config, key, value)
    else:
        setattr(config, field, value)
    with pytest.raises(ValueError, match=message):
        MptForCausalLM(config)


def test_falcon_alibi_with_parallel_blocks_is_refused(tiny_falcon_rw_dir):
    from specray.models.loader import load_hf_config

    config = load_hf_config(str(tiny_falcon_rw_dir))
    config.parallel_attn = True
    with pytest.raises(ValueError, match="parallel_attn=false"):
        FalconForCausalLM(config)
