"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): DeepSeek-V3's latent attention with DeepSeek Sparse Attention's
indexer, each query attending only its ``index_topk`` best-scored keys, against transformers on the same random
tiny weights (fp32, max abs diff < 1e-4) with ``index_topk`` well under the prompt's length, so that the selection
decides the logits (shown: without it, or with the indexer's RoPE on pairs, they are far off). Every attention path
(the padded short batch, one sequence at a time, the unabsorbed form of a long chunk), tensor parallel 2 equal to
one rank, and the engine: greedy with n-gram drafts (chains and trees) and from graphs equal to plain decoding and
to transformers' ``generate``; an FP8 cache runs."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from specray.models import cpu_kernels
from specray.models.loader import load_model, read_config
from specray_test_model_checks import (SCHEDULES, WORKER_PRELUDE, chunked_logits, max_diff,  # tests/model_checks.py
                                       prompt, run_ranks)

TOL = 1e-4
TOPK = 6  # of a 40-token prompt: most queries attend a few of their keys
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
        "mscale": 1.0, "mscale_all_dim": 1.0}
V32_TINY = dict(num_hidden_layers=2, first_k_dense_replace=2, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4, index_n_heads=16, index_head_dim=16,
                index_topk=TOPK, rope_parameters=YARN, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def v32_dir(tmp_path_factory, make_tiny_model):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_v32"), "deepseek_v32", seed=42, initializer_range=0.05,
                           **V32_TINY)


@torch.no_grad()
def hf_logits(folder, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def reference(v32_dir) -> torch.Tensor:
    return hf_logits(v32_dir, prompt())


@pytest.mark.parametrize("path", ["batched", "own", "unabsorbed"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(v32_dir, reference, monkeypatch, schedule, path):
    """Every position's logits equal transformers', for a prefill and for chunks + decode steps over shuffled
    blocks; short queries as the padded batch or one sequence at a time; and every chunk in the unabsorbed form."""
    if path != "batched":
        monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 0)
    model = load_model(str(v32_dir))
    attns = [layer.self_attn.attn for layer in model.model.layers]
    assert all(a.index_topk == TOPK and a.index_dim == 16 for a in attns)
    if path == "unabsorbed":
        for attn in attns:
            attn.unabsorbed_from = 1
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES[schedule]), reference) < TOL


def _no_selection(config) -> None:
    """Every key attended (the indexer keeping more than any context holds)."""
    config.index_topk = 1024


def _indexer_rope_on_pairs(model) -> None:
    """The indexer's queries and keys rotated on interleaved pairs, as MLA's are."""
    from specray.models.layers import apply_rotary

    for layer in model.model.layers:
        indexer = layer.self_attn.indexer

        def paired(x, q_latent, cos, sin, ix=indexer):
            r, d = 2 * cos.shape[-1], ix.dim
            pairs = torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, d)))
            queries = apply_rotary(ix.wq_b(q_latent).view(x.shape[0], ix.heads, d)[..., pairs], cos, sin)
            keys = apply_rotary(ix.k_norm(ix.wk(x))[:, None, pairs], cos, sin)[:, 0]
            return keys, queries.float(), ix.weights_proj(x).float() * (ix.heads * d) ** -0.5

        indexer.forward = paired


@pytest.mark.parametrize("mutate_config,mutate", [(_no_selection, None), (None, _indexer_rope_on_pairs)],
                         ids=["no-selection", "indexer-rope-on-pairs"])
def test_the_selection_shows_in_the_logits(v32_dir, reference, mutate_config, mutate):
    config = read_config(str(v32_dir))
    if mutate_config is not None:
        mutate_config(config)
    model = load_model(str(v32_dir), config=config)
    if mutate is not None:
        mutate(model)
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["chunked+decode"]), reference) > 1e-2


def test_the_indexer_needs_the_query_latent(v32_dir):
    config = read_config(str(v32_dir))
    config.q_lora_rank = None
    with pytest.raises(ValueError, match=r"index_topk=6 \(DeepSeek Sparse Attention\) needs q_lora_rank"):
        load_model(str(v32_dir), config=config)


WORKER = WORKER_PRELUDE + textwrap.dedent("""

    model = load_model(folders[0], tp)
    one = logits(load_model(folders[0]))
    diff = (logits(model) - one).abs().max().item()
    del model  # gloo's threads end with the group only once nothing holds it
    gc.collect()
    dist.destroy_process_group()
    json.dump({"diff": diff}, open(f"{out}/{rank}.json", "w"))
""")


def test_tensor_parallel_ranks_match_one_rank(tmp_path, v32_dir):
    """Two ranks (each half the heads; the latent, its cache and the indexer replicated): every rank's logits
    equal one rank's."""
    for result in run_ranks(tmp_path, WORKER, 2, 1, [str(v32_dir)]):
        assert result["diff"] < TOL, result


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def test_engine_greedy_equals_transformers_with_drafts_and_graphs(v32_dir, no_host_sync):
    """``specray.LLM``'s greedy tokens equal transformers' ``generate``; so do they with n-gram chains and trees
    verified, from graphs (on CPU their padded static inputs; the selection syncs nothing with the host), and over
    an FP8 latent cache the run completes."""
    from transformers import AutoModelForCausalLM

    from specray import LLM

    runs = sys.modules["specray_test_engine_runs"]
    prompts = runs.PROMPTS[:4]
    plain = LLM(model=str(v32_dir), max_model_len=256, block_size=4)
    want = runs.token_ids(plain.generate(prompts, runs.greedy(12), use_tqdm=False))
    hf = AutoModelForCausalLM.from_pretrained(v32_dir, dtype=torch.float32).eval()
    tok = plain.get_tokenizer()
    for text, ours in zip(prompts, want):
        ids = torch.tensor([tok.encode(text)])
        out = hf.generate(ids, max_new_tokens=len(ours), min_new_tokens=len(ours), do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        assert out[0, ids.shape[1]:].tolist() == ours, text
    for spec, eager in ((NGRAM, True), ({**NGRAM, "num_branches": 2}, False)):
        llm = LLM(model=str(v32_dir), max_model_len=256, block_size=4, speculative_config=spec,
                  enforce_eager=eager)
        assert runs.token_ids(llm.generate(prompts, runs.greedy(12), use_tqdm=False)) == want
        assert llm.spec_stats.accepted_tokens > 0
    graph = next(iter(llm.engine.executor.worker.runner.graphs.graphs.values()))  # the second ran from graphs
    with torch.inference_mode(), no_host_sync():
        llm.engine.executor.worker.model(graph.input_ids, graph.meta)
    fp8 = LLM(model=str(v32_dir), max_model_len=256, block_size=4, kv_cache_dtype="fp8")
    assert [len(ids) for ids in runs.token_ids(fp8.generate(prompts, runs.greedy(12), use_tqdm=False))] == [12] * 4
