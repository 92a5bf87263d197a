"""DeepSeek-V4 (``DeepseekV4ForCausalLM``): hyper-connections, a sliding window of one shared key/value head with
sinks, compressed sparse attention (overlapping windows pooled every 4 tokens, an indexer keeping 3 entries per query)
and heavily compressed attention (windows of 8), hash-routed and scored experts, against transformers on the same
random tiny weights (fp32, max abs diff < 1e-4; the checkpoint as transformers saves it, in DeepSeek's own names, and
as transformers' modules name it). Every attention path (the padded short batch, one sequence at a time over gathered
or consecutive blocks), each part shown to matter, tensor parallel 2 equal to one rank, and the engine: greedy with
n-gram chains and trees, suffix decoding, lookahead, a draft model and prefix caching equal to transformers'
``generate``; what it does not support is refused by name (its MTP module as a drafter:
tests/test_deepseek_v4_mtp.py). Weights are drawn (the seed) so that no query's 3rd and 4th index scores tie (ReLU
makes exact ties at 0 possible): there the pick may differ between two exact implementations."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specray.models import cpu_kernels, deepseek_v4
from specray.models.loader import load_model
from specray.tree import depths, path_to
from specray_test_model_checks import (SCHEDULES, chunked_logits, max_diff, mutated_logits,  # tests/model_checks.py
                                       prompt, reference_logits)

TOL = 1e-4


@pytest.fixture(scope="module")
def v4(tiny_deepseek_v4_dir):
    """(the tiny model's folder, transformers' logits of the prompt)."""
    return tiny_deepseek_v4_dir, reference_logits(tiny_deepseek_v4_dir)


@pytest.mark.parametrize("path", ["batched", "own", "own-consecutive", "own-in-pieces"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_match_transformers(v4, monkeypatch, schedule, path):
    """Every position's logits equal transformers', for a prefill and for chunks + decode steps over shuffled
    blocks; short queries as the padded batch or one sequence at a time (over blocks in order too, whose context is
    read as one view; or a few queries at a time)."""
    folder, reference = v4
    if path != "batched":
        monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 0)
    if path == "own-in-pieces":
        monkeypatch.setattr(deepseek_v4, "SCORE_ELEMENTS", 1)
    model = load_model(str(folder))
    kinds = [layer.self_attn.kv_spec for layer in model.model.layers]
    assert [(k.compress_rate, k.overlap, k.index_head_dim) for k in kinds] == [(0, False, 0), (4, True, 16),
                                                                               (8, False, 0), (4, True, 16)]
    logits = chunked_logits(model, prompt(), SCHEDULES[schedule], consecutive=path == "own-consecutive")
    assert max_diff(logits, reference) < TOL


PARENTS = [-1, -1, 0, 0, 1, 2, 2, 3, 5]  # depths 1, 1, 2, 2, 2, 3, 3, 3, 4


@pytest.mark.parametrize("path", ["batched", "own"])
def test_tree_nodes_match_transformers_on_their_paths(tiny_deepseek_v4_dir, monkeypatch, path):
    """A token tree after 13 cached tokens: the root (position 13) and nine nodes (positions 14..17), among them three
    depth-2 nodes that each close a window of both rates (position 15) over their own ancestors; every node's logits
    equal transformers' on prefix + its path, and once a path is kept (its rows moved to the slots after the root,
    as the engine moves them) the next token's do too."""
    from transformers import AutoModelForCausalLM

    from specray.models.attention import build_attention_metadata
    from specray.models.kv_cache import allocate_kv_cache, slots_of

    if path == "own":
        monkeypatch.setattr(cpu_kernels, "OWN_MIN_CONTEXT", 0)
    hf = AutoModelForCausalLM.from_pretrained(tiny_deepseek_v4_dir, dtype=torch.float32).eval()
    model = load_model(str(tiny_deepseek_v4_dir))
    cache = allocate_kv_cache(model, 16, 4)
    table = [7, 2, 11, 5, 9, 0, 14]
    ids, nodes = prompt()[:14], prompt(10)[: len(PARENTS)]  # (tokens whose index scores tie nowhere at the 3rd)
    levels = depths(PARENTS)
    mask = torch.zeros(1 + len(PARENTS), 1 + len(PARENTS), dtype=torch.bool)
    mask[:, 0] = True
    for i in range(len(PARENTS)):
        for j in path_to(PARENTS, i):
            mask[1 + i, 1 + j] = True

    def step(new: list[int], start: int, **plan) -> torch.Tensor:
        meta = build_attention_metadata([len(new)], [start], [table], 4, "cpu", **plan)
        with torch.no_grad():
            return model.compute_logits(model(torch.tensor(new), meta))

    def reference(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([tokens])).logits[0, -1].float()

    step(ids[:13], 0)
    out = step([ids[13]] + nodes, 13, positions=[13] + [13 + d for d in levels], ancestors=[mask])
    assert max_diff(out[0], reference(ids)) < TOL
    for i in range(len(PARENTS)):
        assert max_diff(out[1 + i], reference(ids + [nodes[j] for j in path_to(PARENTS, i)])) < TOL, i
    kept = path_to(PARENTS, 8)  # the deepest node's path, through a window-closing node
    cache.copy_slots(torch.tensor(slots_of(table, [14 + j for j in kept], 4)),
                     torch.tensor(slots_of(table, range(14, 14 + len(kept)), 4)))
    following = step([5], 14 + len(kept))
    assert max_diff(following[0], reference(ids + [nodes[j] for j in kept] + [5])) < TOL


def test_transformers_module_names_load(v4):
    """A checkpoint named as transformers' modules are (not DeepSeek's release names, as it saves them) loads alike."""
    from transformers import AutoModelForCausalLM

    folder, reference = v4
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = load_model(str(folder), load_format="dummy", pack=False)
    model.load_weights(hf.state_dict().items())
    assert max_diff(chunked_logits(model, prompt(), SCHEDULES["prefill"]), reference) < TOL


def _no_selection(config) -> None:
    config.index_topk = 1024  # every entry passed attended


def _entries_unseen(model) -> None:  # the compressed layers attending their window only
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.compressor is not None:
            pooled = attn._entries
            attn._entries = lambda *a, pooled=pooled: (lambda e, seen: (e, torch.zeros_like(seen)))(*pooled(*a))


def _one_stream(model) -> None:  # the streams' mixing matrix left as it comes, not the doubly stochastic one
    for layer in model.model.layers:
        for hc in (layer.attn_hc, layer.ffn_hc):
            hc.iters = 0


def _no_hash(model) -> None:
    model.model.layers[0].mlp.hash_routed = False
    model.model.layers[0].mlp.router_module.e_score_correction_bias = torch.zeros(8)


MUTATIONS = {"no-selection": (_no_selection, None), "entries-unseen": (None, _entries_unseen),
             "no-sinkhorn": (None, _one_stream), "no-hash-routing": (None, _no_hash)}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_part_shows_in_the_logits(v4, mutation):
    folder, reference = v4
    assert max_diff(mutated_logits(folder, *MUTATIONS[mutation]), reference) > 1e-2



NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
# the engine's prompts: three of the shared ones and a long one (68 tokens) with no tie at the indexer's pick over
# its 16 greedy tokens; the shared long ones have one or two, where torch.topk's pick among equal scores is the
# device's (on an H200 the shared 54-token prompt decoded differently from the CPU's, transformers' too)
TIE_FREE = "Translate to French: The quick brown fox jumps over the lazy dog. The dog does not move at all."


def test_engine_greedy_equals_transformers_with_drafts_and_graphs(tiny_deepseek_v4_dir, tiny_llama_dir, no_host_sync):
    """``specray.LLM``'s greedy tokens (a batch of prompts, each past several windows) equal transformers'
    ``generate``; so do they with n-gram chains and trees, suffix decoding's and lookahead's trees and a draft model
    verified (a tree node pools its ancestors' rows), a second batch behind cached prefixes, and chains' steps from
    graphs (on CPU their padded static inputs, every row's window pooled on the device with no host sync; trees'
    steps beside them eagerly)."""
    from specray import LLM

    folder = tiny_deepseek_v4_dir
    runs = sys.modules["specray_test_engine_runs"]
    prompts = runs.PROMPTS[:3] + [TIE_FREE]
    plain = LLM(model=str(folder), max_model_len=256, block_size=4)
    want = runs.token_ids(plain.generate(prompts, runs.greedy(16), use_tqdm=False))
    runs.assert_transformers_generates(folder, plain.get_tokenizer(), prompts, want)
    specs = [NGRAM, {**NGRAM, "num_branches": 3}, {"method": "suffix", "num_speculative_tokens": 6},
             {"method": "lookahead", "num_speculative_tokens": 15},
             {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3}]
    for spec in specs:
        llm = LLM(model=str(folder), max_model_len=256, block_size=4, speculative_config=spec,
                  enable_prefix_caching=spec is NGRAM, enforce_eager=spec["method"] not in ("ngram", "suffix"))
        for _ in range(2 if spec is NGRAM else 1):  # the second time behind the first's cached blocks
            assert runs.token_ids(llm.generate(prompts, runs.greedy(16), use_tqdm=False)) == want, spec
        # the lookups find the prompts' repeats; the random draft model's and lookahead's guesses may all be refused
        assert llm.spec_stats.accepted_tokens > 0 or spec["method"] not in ("ngram", "suffix"), spec
        if spec is NGRAM:
            assert llm.engine.scheduler.prefix_cache_hits > 0
            graphs = llm.engine.executor.worker.runner.graphs
            if runs.refused_on_this_gpu(llm):
                continue
            graph = next(iter(graphs.graphs.values()))  # it ran from graphs
            with torch.inference_mode(), no_host_sync():
                graphs._step(graph.input_ids, graph.meta, graph.inputs)  # the forward a capture records


def test_the_release_layout_loads_fp8_linears_and_fp4_experts(v4, tmp_path, monkeypatch):
    """DeepSeek-V4's release (the attention's and shared experts' weights FP8 with E8M0 block scales named
    ``X.scale``, the routed experts FP4 with an E8M0 scale per 32 values; blocks of 16 here, so a weight has several):
    the logits equal transformers' on the same weights dequantized by hand, and differ from the unquantized model's
    (the quantization shows); so too where quantized experts are kept (a GPU; here asked), which keeps the FP4
    experts as stored (codes two a byte, a scale byte per 32) and decodes an expert as tokens reach it; in the engine
    too."""
    from specray import LLM

    folder, reference = v4
    release, twin = sys.modules["specray_test_checkpoints"].write_v4_release(folder, tmp_path, block=16)
    want = reference_logits(twin)
    assert max_diff(want, reference) > 1e-3
    assert max_diff(chunked_logits(load_model(str(release)), prompt(), SCHEDULES["prefill"]), want) < TOL
    monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", True)
    kept = load_model(str(release))
    for layer in kept.model.layers:  # [E, 2I, H / 2] codes, [E, 2I, H / 32] scales; [E, H, I / 2], [E, H, I / 32]
        moe = layer.mlp
        assert moe.mxfp4 and moe.fp8_block is None and moe.w13.dtype == moe.w13_scale.dtype == torch.uint8
        assert moe.w13.shape[1:] == (64, 32) and moe.w13_scale.shape[1:] == (64, 2) and moe.w2.shape[1:] == (64, 16)
    assert max_diff(chunked_logits(kept, prompt(), SCHEDULES["prefill"]), want) < TOL
    monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", False)
    runs = sys.modules["specray_test_engine_runs"]
    llm = LLM(model=str(release), max_model_len=256, block_size=4)
    got = runs.token_ids(llm.generate([TIE_FREE], runs.greedy(8), use_tqdm=False))
    runs.assert_transformers_generates(twin, llm.get_tokenizer(), [TIE_FREE], got)


def test_a_dummy_release_keeps_its_linears_and_experts(v4, tmp_path, monkeypatch):
    """``load_format="dummy"`` on the release's config where quantized weights are kept (a GPU's; here asked): FP8
    linears and FP4 experts of random values (``benchmarks/dummy_model.py --quantization v4-release`` times them on
    a GPU), whose logits are finite."""
    from specray.models.fp8_blocks import BlockFP8Linear

    folder, _ = v4
    release, _ = sys.modules["specray_test_checkpoints"].write_v4_release(folder, tmp_path, block=16)
    monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", True)
    monkeypatch.setattr(cpu_kernels, "FP8_WEIGHTS", True)
    model = load_model(str(release), load_format="dummy")
    assert all(layer.mlp.mxfp4 and isinstance(layer.self_attn.q_b_proj.kept, BlockFP8Linear)
               for layer in model.model.layers)
    assert torch.isfinite(chunked_logits(model, prompt(), SCHEDULES["prefill"])).all()


def test_an_fp8_cache_reads_a_steps_entries_as_later_steps_do(v4):
    """Over an FP8 cache a prefill of 20 tokens in one step (windows closing inside it, read by the rows after them)
    gives the logits of the same tokens a step each: a step reads the entries it pools rounded, as the cache keeps
    them (else a verify step's rows would see what plain decoding's later steps do not)."""
    from specray.models.attention import build_attention_metadata
    from specray.models.kv_cache import allocate_kv_cache

    folder, _ = v4
    ids, table = prompt()[:20], [3, 0, 4, 1, 2]

    def run(sizes: list[int]) -> torch.Tensor:
        model = load_model(str(folder))
        allocate_kv_cache(model, 8, 4, "fp8")
        out, start = [], 0
        with torch.no_grad():
            for size in sizes:
                meta = build_attention_metadata([size], [start], [table], 4, "cpu")
                out.append(model.compute_logits(model(torch.tensor(ids[start: start + size]), meta)))
                start += size
        return torch.cat(out)

    assert max_diff(run([20]), run([4] + [1] * 16)) < TOL


def test_other_quantizations_are_refused(tiny_deepseek_v4_dir, tmp_path):
    import json
    import shutil

    folder = Path(shutil.copytree(tiny_deepseek_v4_dir, tmp_path / "gptq"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"DeepSeek-V4 with quantization_config.quant_method='gptq' is not supported"):
        load_model(str(folder))




def test_output_groups_must_split_over_the_ranks(tiny_deepseek_v4_dir):
    """Checked before any rank starts (the builder's family check)."""
    from specray.engine.builder import check_family_split
    from specray.models.loader import read_config

    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide DeepSeek-V4's o_groups=2"):
        check_family_split(read_config(str(tiny_deepseek_v4_dir)), 4, 1)
