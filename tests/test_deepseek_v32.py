"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) and GLM-5 (``GlmMoeDsaForCausalLM``): DeepSeek-V3's latent attention
and experts with DeepSeek Sparse Attention's indexer, each query attending only its ``index_topk`` best-scored keys
(GLM-5: its indexer's RoPE on interleaved pairs, and "shared" layers attending the keys the layer before picked),
against transformers on the same random tiny weights (fp32, max abs diff < 1e-4) with ``index_topk`` well under
the prompt's length, so that the selection decides the logits (shown: without it, or with each family's indexer
RoPE swapped for the other's, or a shared layer attending every key, they are far off). Every attention path (the
padded short batch, one sequence at a time, the unabsorbed form of a long chunk), tensor parallel 2 equal to one
rank, and the engine: greedy with n-gram drafts (chains and trees) and from graphs equal to plain decoding and to
transformers' ``generate``; an FP8 cache runs. Weights are drawn (seeds) so that no query's k-th and (k+1)-th
scores nearly tie: there the pick may differ between two exact implementations."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from specray.models import cpu_kernels
from specray.models.loader import load_model, read_config
from specray_test_model_checks import (SCHEDULES, WORKER_PRELUDE, chunked_logits, max_diff,  # tests/model_checks.py
                                       mutated_logits, prompt, run_ranks)

TOL = 1e-4
TOPK = 6  # (tests/conftest.py's DSA_TINY) of a 40-token prompt: most queries attend a few of their keys
FIXTURES = {"deepseek_v32": "tiny_deepseek_v32_dir", "glm5": "tiny_glm5_dir"}  # tests/conftest.py


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def family(request):
    """(the family, its tiny model's folder, transformers' logits of the prompt)."""
    folder = request.getfixturevalue(FIXTURES[request.param])
    return request.param, folder, hf_logits(folder, prompt())


@torch.no_grad()
def hf_logits(folder, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("path", ["batched", "batched-head-by-head", "own", "own-consecutive", "unabsorbed"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(family, monkeypatch, schedule, path):
    """Every position's logits equal transformers', for a prefill and for chunks + decode steps over shuffled
    blocks; short queries as the padded batch (the indexer's heads scored all at once or one per pass) or one
    sequence at a time (over blocks in order too, whose context is read as one view); and every chunk in the
    unabsorbed form."""
    name, folder, reference = family
    if path == "batched-head-by-head":  # the indexer's scores one head per pass (a long context's way)
        from specray.models import deepseek_v3

        monkeypatch.setattr(deepseek_v3, "INDEX_SCORE_ELEMENTS", 1)
    elif path != "batched":
        monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 0)
    model = load_model(str(folder))
    attns = [layer.self_attn.attn for layer in model.model.layers]
    assert all(a.index_topk == TOPK for a in attns)
    assert [a.index_dim for a in attns] == ([16, 0, 16] if name == "glm5" else [16] * 3)  # a shared layer: no keys
    if path == "unabsorbed":
        for attn in attns:
            attn.unabsorbed_from = 1
    logits = chunked_logits(model, prompt(), SCHEDULES[schedule], consecutive=path == "own-consecutive")
    assert max_diff(logits, reference) < TOL


def _no_selection(config) -> None:
    """Every key attended (the indexer keeping more than any context holds)."""
    config.index_topk = 1024


def _swap_indexer_rope(model) -> None:
    """Each family's indexer rotating as the other's does: V3.2's on interleaved pairs, GLM-5's on halves."""
    for layer in model.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.interleave = not layer.self_attn.indexer.interleave


def _shared_layers_see_all(model) -> None:
    """GLM-5's shared layers attending every key instead of the pick of the layer before."""
    shared = [layer.self_attn.attn for layer in model.model.layers if layer.self_attn.attn.shares_selection]
    assert len(shared) == 1
    shared[0].shares_selection = False


MUTATIONS = {"no-selection": (_no_selection, None), "indexer-rope-swapped": (None, _swap_indexer_rope),
             "shared-sees-all": (None, _shared_layers_see_all)}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_of_the_selection_shows_in_the_logits(family, mutation):
    name, folder, reference = family
    if mutation == "shared-sees-all" and name != "glm5":
        pytest.skip("only GLM-5 has layers that share a pick")
    assert max_diff(mutated_logits(folder, *MUTATIONS[mutation]), reference) > 1e-2


def test_inconsistent_configs_are_refused(family):
    name, folder, _ = family
    config = read_config(str(folder))
    config.q_lora_rank = None
    with pytest.raises(ValueError, match=r"index_topk=6 \(DeepSeek Sparse Attention\) needs q_lora_rank"):
        load_model(str(folder), config=config)
    if name == "glm5":
        config = read_config(str(folder))
        config.indexer_types = ["shared", "full", "full"]
        with pytest.raises(ValueError, match=r"indexer_types\[0\]='shared' but no layer before it has an indexer"):
            load_model(str(folder), config=config)


WORKER = WORKER_PRELUDE + textwrap.dedent("""

    diffs = []
    for folder in folders:
        model = load_model(folder, tp)
        diffs.append((logits(model) - logits(load_model(folder))).abs().max().item())
    del model  # gloo's threads end with the group only once nothing holds it
    gc.collect()
    dist.destroy_process_group()
    json.dump({"diffs": diffs}, open(f"{out}/{rank}.json", "w"))
""")


def test_tensor_parallel_ranks_match_one_rank(tmp_path, request):
    """Two ranks (each half the heads and the experts' width; the latent, its cache and the indexer replicated):
    every rank's logits equal one rank's, for both families."""
    folders = [str(request.getfixturevalue(fixture)) for _, fixture in sorted(FIXTURES.items())]
    for result in run_ranks(tmp_path, WORKER, 2, 1, folders):
        assert all(d < TOL for d in result["diffs"]), result


def test_engine_greedy_equals_transformers_with_drafts_and_graphs(family, no_host_sync):
    """``specray.LLM``'s greedy tokens equal transformers' ``generate``; so do they with n-gram chains and trees
    verified, from graphs (on CPU their padded static inputs; the selection syncs nothing with the host), and over
    an FP8 latent cache the run completes."""
    _, folder, _ = family
    runs = sys.modules["specray_test_engine_runs"]  # tests/engine_runs.py
    runs.assert_drafts_and_graphs_equal_transformers(folder, no_host_sync, 12, fp8=True)
