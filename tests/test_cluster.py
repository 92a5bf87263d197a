"""The Ray backend on a simulated three-node cluster: tensor-parallel target actors (gloo), drafter actors,
the shared n-gram pool, failures, and placement across nodes."""

import asyncio
import dataclasses
import json
import importlib.util
import os
import random
import shutil
import time
from collections import deque
from pathlib import Path

import pytest
import torch

from specray import LLM, SamplingParams
from specray.config import EngineArgs, SpeculativeConfig
from specray.drafters.base import DraftRequest, DrafterContext, Proposal
from specray.engine.builder import build_engine
from specray.engine.llm_engine import LLMEngine
from specray.errors import RequestFailedError

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _load_probes():
    """tests/probes.py under a name outside sys.modules, so cloudpickle ships its functions to the ranks by value."""
    spec = importlib.util.spec_from_file_location("specray_test_probes", Path(__file__).with_name("probes.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probes = _load_probes()  # fn(worker, *args) probes run on every rank through collective_rpc / TargetWorker.run


import specray_test_draft_heads as draft_heads  # noqa: E402  tests/draft_heads.py (tests/conftest.py registers it)

HALF_CPU = {"worker_num_cpus": 0.5, "drafter_num_cpus": 0.25, "engine_num_cpus": 0.1}
MAX_TOKENS = 20


def engine_for(model, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 8)
    return build_engine(EngineArgs(model=str(model), **kw))


def prompts_for(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def run_to_end(engine: LLMEngine, prompts, params=None) -> list[list[int]]:
    """Greedy outputs of ``prompts``, all queued at once; ``params``: one SamplingParams for all, or one each."""
    params = params or SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    each = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, each)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


class NoisyOracle:
    """Drafts the known greedy continuation, corrupted at a random position half the time: random accept
    lengths (0..k) at every step."""

    def __init__(self, references: dict[str, tuple[int, list[int]]], vocab_size: int, seed: int = 0):
        self.references = references  # req_id -> (prompt length, greedy output)
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        out = []
        for d in batch:
            plen, ref = self.references[d.req_id]
            draft = list(ref[len(d.token_ids) - plen: len(d.token_ids) - plen + d.num_speculative_tokens])
            if draft and self.rng.random() < 0.5:
                j = self.rng.randrange(len(draft))
                draft[j] = (draft[j] + 1) % self.vocab_size
            out.append(Proposal(draft))
        return out

    def finish(self, req_ids) -> None:
        pass


# ---- tensor parallelism: step-by-step equality with one rank -------------------------------------------------

def replay_on(executor, plan, probs):
    """Run ``plan`` on every rank of a Ray executor; rank 0's (result, logits)."""
    import ray

    refs = [w.run.remote(probes.execute_with_logits, plan, probs if i == 0 else None)
            for i, w in enumerate(executor.workers)]
    return ray.get(refs)[0]


def assert_kv_matches(reference_worker, executor, live: list[tuple[str, int]], heads) -> None:
    """Every rank's cached k/v for the live positions of each request equal one rank's, head by head."""
    per_rank = executor.collective_rpc(probes.kv_snapshots, live)
    for i, (req_id, num_tokens) in enumerate(live):
        full = probes.kv_snapshot(reference_worker, req_id, num_tokens)  # per layer [2, n, Hkv, D] or [n, W]
        for shards, (start, count) in zip(per_rank, heads):
            for shard, layer in zip(shards[i], full, strict=True):
                want = layer[:, :, start:start + count] if layer.dim() == 4 else layer  # a latent: replicated
                torch.testing.assert_close(shard, want, atol=1e-5, rtol=0)


# two ranks splitting the KV heads; three ranks replicating one KV head (biases and the other families' layers
# against one rank: tests/test_models.py)
TP_CASES = [("llama", 2, {}), ("llama", 3, {"num_attention_heads": 6, "num_key_value_heads": 1, "hidden_size": 96,
                                            "intermediate_size": 192})]


@pytest.mark.parametrize("arch,tp,overrides", TP_CASES, ids=["llama-tp2", "llama-tp3-kv1"])
def test_tp_matches_one_rank_step_by_step(make_tiny_model, tmp_path, arch, tp, overrides):
    """One rank runs a batch of 1 plain and batches of 8 with randomly accepted drafts (chains, and on two ranks
    token trees whose accepted paths move K/V); every plan is replayed on a TP group: same tokens, logits within
    1e-4, and every shard's live KV slots equal to one rank's."""
    model = make_tiny_model(tmp_path / arch, arch, seed=7, tie_word_embeddings=False, **overrides)
    executor = engine_for(model, tensor_parallel_size=tp, ray_placement=HALF_CPU, num_kv_blocks=96).executor
    try:
        cases = [(1, False), (8, True)] + ([(8, "tree")] if overrides == {} else [])
        for batch, speculate in cases:
            compare_run(model, executor, prompts_for(batch, seed=batch), speculate)
    finally:
        executor.shutdown()


# one of each cache and expert layout (every family's layers against one rank, both expert splits: test_models.py)
FAMILY_CASES = [("tiny_gemma3_dir", False), ("tiny_deepseek_dir", True), ("tiny_llama4_dir", True),
                ("tiny_mixtral_dir", False)]


@pytest.mark.parametrize("fixture,expert_parallel", FAMILY_CASES,
                         ids=["gemma3", "deepseek-v3-ep", "llama4-ep", "mixtral"])
def test_tp_matches_one_rank_step_by_step_for_every_family(request, fixture, expert_parallel):
    """The same over two Ray ranks for the newer families (Gemma 3's sliding and global layers; experts split by
    width, or whole with enable_expert_parallel; DeepSeek's latent cache replicated on both): plain at batch 1, and
    with randomly accepted drafts at batch 8: same tokens, logits within 1e-4, every rank's live cache equal to one
    rank's."""
    model = request.getfixturevalue(fixture)
    executor = engine_for(model, tensor_parallel_size=2, ray_placement=HALF_CPU, num_kv_blocks=96,
                          enable_expert_parallel=expert_parallel).executor
    try:
        for batch, speculate in [(1, False), (8, True)]:
            compare_run(model, executor, prompts_for(batch, seed=batch), speculate)
    finally:
        executor.shutdown()


def compare_run(model, tp_executor, prompts, speculate: bool) -> None:
    plain = engine_for(model, num_kv_blocks=96)
    references = run_to_end(plain, prompts)
    spec = {"method": "ngram", "num_speculative_tokens": 4} if speculate else None
    engine = engine_for(model, num_kv_blocks=96, speculative_config=spec)
    worker = engine.executor.worker
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ids = [engine.add_request(p, params) for p in prompts]
    oracle = probes.NoisyTreeOracle if speculate == "tree" else NoisyOracle  # trees: K/V moves on every rank
    if speculate:
        engine.drafter = oracle({i: (len(p), r) for i, p, r in zip(ids, prompts, references)}, engine.vocab_size)
    assert replay_steps(engine, worker, tp_executor) > 0
    assert not engine.has_unfinished_requests()
    if speculate:
        assert engine.spec_stats.draft_tokens > engine.spec_stats.accepted_tokens > 0  # mixed accept/reject


def replay_steps(engine: LLMEngine, worker, tp_executor) -> int:
    """Step the one-rank engine; after each step run the same plan on the TP group and compare."""
    steps = 0
    original = engine.executor.execute

    def recording_execute(plan, draft_probs=None):
        result, logits = probes.execute_with_logits(worker, plan, draft_probs)
        tp_result, tp_logits = replay_on(tp_executor, plan, draft_probs)
        assert tp_result.sampled_token_ids == result.sampled_token_ids
        if logits is not None:
            assert (tp_logits - logits).abs().max().item() < 1e-4
        return result

    engine.executor.execute = recording_execute
    heads = tp_executor.collective_rpc(probes.kv_head_range)
    try:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            live = [(r.req_id, r.num_computed_tokens) for r in engine.scheduler.running if r.num_computed_tokens]
            if live:
                assert_kv_matches(worker, tp_executor, live, heads)
    finally:
        engine.executor.execute = original
    return steps


def test_lookahead_node_tokens_cross_the_ray_executor(tiny_llama_dir):
    """Lookahead decoding on two tensor-parallel ranks: the node tokens come back through the step channel with
    the verdict, the drafter (in this process) iterates on them, and greedy output equals one rank's."""
    from specray.drafters.lookahead import LookaheadDrafter

    prompts = prompts_for(8, seed=5)
    references = run_to_end(engine_for(tiny_llama_dir), prompts)
    spec = {"method": "lookahead", "num_speculative_tokens": 15, "adaptive": False}
    engine = engine_for(tiny_llama_dir, tensor_parallel_size=2, ray_placement=HALF_CPU, speculative_config=spec)
    try:
        engine.drafter.shutdown()  # the drafter actor: replaced by one in this process, to watch its hook
        engine.drafter = drafter = LookaheadDrafter(SpeculativeConfig(**spec), DrafterContext(
            str(tiny_llama_dir), engine.vocab_size, 256, 8))
        told = []
        hook = drafter.observe_node_tokens
        drafter.observe_node_tokens = lambda rid, tokens: (told.append(tokens), hook(rid, tokens))
        assert run_to_end(engine, prompts) == references
        assert told and engine.spec_stats.accepted_tokens > 0
    finally:
        engine.shutdown()


def test_graphs_over_two_ranks_and_a_step_they_cannot_run(tiny_llama_dir, caplog):
    """``enforce_eager=False`` over two tensor-parallel ranks: each rank replays its decode and verify steps from
    graphs of its own share (on CPU the padded static inputs, gloo's all-reduces inside), picking the same shapes
    from the same plans in lockstep; greedy output with n-gram drafts equals one eager rank's.

    Then a plan the ranks cannot run (a block-table delta for a request they never saw) raises KeyError on every
    rank: that is a StepError with the remote traceback, the plan is logged, and the same ranks go on serving."""
    from specray.contract import BlockTableDelta, StepPlan
    from specray.errors import StepError, WorkerDiedError

    prompts = prompts_for(6, seed=3)
    references = run_to_end(engine_for(tiny_llama_dir), prompts)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "adaptive": False}
    engine = engine_for(tiny_llama_dir, tensor_parallel_size=2, ray_placement=HALF_CPU, speculative_config=spec,
                        enforce_eager=False, block_size=4)
    try:
        assert run_to_end(engine, prompts) == references
        first, second = engine.executor.collective_rpc(probes.graph_shapes)
        assert first == second and any(b == 8 for b, _, _ in first) and any(q > 1 for _, q, _ in first), first
        assert engine.spec_stats.accepted_tokens > 0

        workers = list(engine.executor.workers)
        bad = StepPlan(10_000, block_deltas=[BlockTableDelta("ghost", 0, [1])])
        with caplog.at_level("ERROR", logger="specray.cluster.executor"):
            with pytest.raises(StepError, match="KeyError") as info:
                engine.executor.execute(bad)
        assert not isinstance(info.value, WorkerDiedError)
        assert "apply_plan_state" in info.value.remote_traceback
        assert "step 10000: 0 chunks" in caplog.text and "remote traceback" in caplog.text
        assert engine.executor.workers == workers  # not restarted
        assert run_to_end(engine, prompts[:2]) == references[:2]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_lora_adapters_and_an_fp8_cache_on_two_ranks_equal_one_rank(tiny_llama_dir, tmp_path, parallel):
    """LoRA over tensor parallelism: each rank loads its shard of an adapter (B's rows of the column-parallel
    projections, A's columns of the row-parallel ones, the delta added before the all-reduce); each rank's KV heads
    in an FP8 cache. Over pipeline stages: each stage loads the adapter's tensors of its own layers (the others'
    skipped) and caches its layers' K/V in FP8. A batch mixing two adapters and the base model, with n-gram drafts,
    gives one rank's greedy outputs."""
    from specray.lora import LoRARequest
    import specray_test_checkpoints as checkpoints

    first = checkpoints.write_lora(tiny_llama_dir, tmp_path / "first", rank=4, seed=1)
    second = checkpoints.write_lora(tiny_llama_dir, tmp_path / "second", rank=8, seed=2, modules=("k_proj", "o_proj"))
    loras = [LoRARequest("first", 1, str(first)), LoRARequest("second", 2, str(second)), None]
    prompts = prompts_for(6, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, lora_request=loras[i % 3]) for i in range(6)]
    kw = dict(enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_dtype="fp8",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    references = run_to_end(engine_for(tiny_llama_dir, **kw), prompts, params)
    assert references != run_to_end(engine_for(tiny_llama_dir), prompts)
    engine = engine_for(tiny_llama_dir, ray_placement=HALF_CPU, **parallel, **kw)
    try:
        assert run_to_end(engine, prompts, params) == references
    finally:
        engine.shutdown()


# ---- pipeline parallelism: stages of ranks, greedy output equal to one rank's ------------------------------------

# two stages of one rank (n-gram drafts): test_llm_ray_backend_matches_local_and_transformers and the LoRA test
# above; a draft model's actor beside a target's ranks: test_tp_ranks_on_two_nodes_and_the_draft_model_on_a_third
PP_CASES = [(2, 2, "ngram"), (3, 1, "suffix")]


@pytest.mark.parametrize("stages,tp,method", PP_CASES, ids=["pp2-tp2-ngram", "pp3-suffix"])
def test_pipeline_stages_keep_one_ranks_greedy_output(make_tiny_model, tmp_path, stages, tp, method):
    """A target split into pipeline stages (each on its own tensor-parallel ranks) answers from its last stage:
    speculative greedy output at batch 8 equals one rank's plain output, and more KV blocks fit each rank (it
    holds only its stage's layers). With two stages of two ranks spread over the three nodes (Ray may put a
    placement group's bundles on nodes in any order), the ranks are numbered node by node, so that a stage's
    tensor-parallel ranks share a node wherever a node holds whole stages."""
    import ray

    from specray.cluster.executor import grouped_by_node

    model = make_tiny_model(tmp_path / "m", "llama", seed=21, num_hidden_layers=3, tie_word_embeddings=True)
    prompts = prompts_for(8, seed=stages + tp)
    budget = dict(kv_cache_memory_bytes=1 << 20)
    one_rank = engine_for(model, **budget)
    references = run_to_end(one_rank, prompts)
    spec = {"method": method, "num_speculative_tokens": 3}
    spread = dict(strategy="SPREAD") if tp > 1 else {}
    engine = engine_for(model, pipeline_parallel_size=stages, tensor_parallel_size=tp,
                        ray_placement=dict(HALF_CPU, **spread), speculative_config=spec, **budget)
    try:
        assert engine.executor.world_size == stages * tp and engine.executor.driver == (stages - 1) * tp
        assert engine.executor.collective_rpc(probes.rank) == list(range(stages * tp))
        if spread:
            nodes = ray.get([w.node_id.remote() for w in engine.executor.workers])  # in rank order
            assert len(set(nodes)) > 1 and nodes == grouped_by_node(nodes, nodes), nodes
        assert engine.executor.num_kv_blocks > one_rank.executor.num_kv_blocks
        layers = engine.executor.collective_rpc(probes.stage_layers)
        assert [i for stage in layers[::tp] for i in stage] == [0, 1, 2] and layers == sorted(layers)
        assert run_to_end(engine, prompts) == references
        assert engine.spec_stats.accepted_tokens > 0
    finally:
        engine.shutdown()
        one_rank.shutdown()


def test_ranks_are_grouped_node_by_node():
    """Ranks in placement order, regrouped so that each node's are consecutive, nodes in order of first appearance."""
    from specray.cluster.executor import grouped_by_node

    assert grouped_by_node(list("abcdef"), ["n1", "n2", "n1", "n3", "n2", "n1"]) == list("acfbed")


def head_case(request, method: str, tiny_llama_dir, tmp_path) -> tuple[Path, Path, dict]:
    """(the target's folder, the model folder to serve, the speculative_config) of a hidden-state drafter case: EAGLE-3
    (chains; ``-tree``: EAGLE-2 trees; ``-whole``: unsplit), three MTP modules on the tiny
    Llama, DeepSeek-V3's own MTP module (``-ep``: experts whole per rank), GLM-4.5's (also ``-ep``), Qwen3.5's (a hybrid
    linear-attention target), Medusa, ReDrafter; heads written to accept often."""
    if method.startswith("deepseek-mtp"):
        target = request.getfixturevalue("tiny_deepseek_dir")
        return target, draft_heads.write_deepseek_mtp(tmp_path / "ds_mtp", target), {
            "method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
    if method.startswith("glm-mtp"):
        target = request.getfixturevalue("tiny_glm4_moe_dir")
        return target, draft_heads.write_deepseek_mtp(tmp_path / "glm_mtp", target, bias_std=0.1), {
            "method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
    if method == "mimo-mtp":  # two chained modules under model.mtp.layers.{k}: sliding-window layers with sinks
        target = request.getfixturevalue("tiny_mimo_v2_flash_dir")
        return target, draft_heads.write_mimo_mtp(tmp_path / "mimo_mtp", target, num_modules=2), {
            "method": "mtp", "num_nextn_predict_layers": 2, "num_speculative_tokens": 2, "adaptive": False}
    if method.startswith("qwen3_5-mtp"):  # a hybrid linear-attention target (a recurrent state per request), its mtp.*
        target = draft_heads.write_tiny_hybrid(tmp_path / "qwen3_5", "qwen3_5")
        spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
        if "-tree" in method:  # EAGLE-2 trees from the MTP layer
            spec.update(use_dynamic_tree=True, dynamic_tree_max_topK=2, dynamic_tree_depth=3, num_speculative_tokens=5)
        return target, draft_heads.write_qwen_mtp(tmp_path / "qwen3_5_mtp", target), spec
    if method.startswith("dflash"):  # its own copy of the target: the mask token's row embeds to zero
        target = draft_heads.zero_mask_row(Path(shutil.copytree(tiny_llama_dir, tmp_path / "dflash_target")))
        head = draft_heads.write_dflash(tmp_path / "dflash", target, num_layers=3, block_size=4,
                                        target_layer_ids=[0], accepting=True)
        spec = {"method": "dflash", "model": str(head), "num_speculative_tokens": 3, "adaptive": False}
        if method.endswith("-whole"):
            spec.update(draft_tensor_parallel_size=1)
        if method.endswith("-tree"):
            spec.update(speculative_token_tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]], num_speculative_tokens=5)
        return target, target, spec
    if method.startswith("eagle3"):
        head = draft_heads.write_accepting_head(tmp_path / "eagle3", "eagle3", tiny_llama_dir)
        model, spec = tiny_llama_dir, {"method": "eagle3", "model": str(head)}
        if method == "eagle3-tree":
            spec.update(use_dynamic_tree=True, dynamic_tree_max_topK=2, dynamic_tree_depth=3)
    elif method == "medusa":
        head = draft_heads.write_medusa_heads(tmp_path / "medusa", tiny_llama_dir, accepting=True)
        model, spec = tiny_llama_dir, {"method": "medusa", "model": str(head)}
    elif method.startswith("redrafter"):
        head = draft_heads.write_redrafter(tmp_path / "redrafter", tiny_llama_dir, accepting=True)
        model, spec = tiny_llama_dir, {"method": "redrafter", "model": str(head), "redrafter_num_beams": 3,
                                       "redrafter_draft_len_per_beam": 3}
    elif method == "mlp_speculator":
        head = draft_heads.write_mlp_speculator(tmp_path / "mlp_speculator", tiny_llama_dir, accepting=True)
        model, spec = tiny_llama_dir, {"method": "mlp_speculator", "model": str(head)}
    else:  # the target's folder with its MTP modules added
        model = draft_heads.write_accepting_head(tmp_path / "mtp3", "mtp", tiny_llama_dir, num_modules=3)
        spec = {"method": "mtp", "num_nextn_predict_layers": 3}
        if method == "mtp3-tree":  # EAGLE-2 trees, level k + 1 from module k
            spec.update(use_dynamic_tree=True, dynamic_tree_max_topK=2, dynamic_tree_depth=3)
    if method.endswith("-whole"):
        spec.update(draft_tensor_parallel_size=1)
    spec.update(num_speculative_tokens=3, adaptive=False)
    return tiny_llama_dir, model, spec


# one case per way a head reads the target across stages: EAGLE-3's residual streams of earlier stages' layers (chains
# over stages of two ranks), an MTP block with its own cache (DeepSeek's, experts whole per rank, over stages of two
# ranks; Qwen3.5's over a hybrid target, EAGLE-2 trees), three distinct MTP modules chained (EAGLE-2 trees, a level
# from each module), the target's embedding on the last stage (ReDrafter), the last hidden state alone (the MLP
# speculator), DFlash's stream of the first stage's layer with its own cache
PP_HEAD_CASES = [("eagle3", 2), ("mtp3-tree", 1), ("deepseek-mtp-ep", 2),
                 ("qwen3_5-mtp-tree", 1), ("redrafter", 1), ("mlp_speculator", 1), ("dflash", 1)]


@pytest.mark.parametrize("method,tp", PP_HEAD_CASES, ids=[f"{m}-tp{tp}" for m, tp in PP_HEAD_CASES])
def test_heads_on_the_last_pipeline_stage_keep_greedy_output(request, tiny_llama_dir, tmp_path, method, tp):
    """A hidden-state drafter over two pipeline stages (DeepSeek with MTP, EAGLE-3 across nodes; Qwen3.5's
    MTP over a hybrid target, each stage keeping its linear layers' recurrent states): the
    head lives on the last stage, which also holds the target's embedding for it; EAGLE-3's residual streams of the
    first stage's layers travel with its output. With tp=2 each stage is two ranks and the head splits over the last
    stage's. The
    same drafts are made and kept as on one rank, greedy output equals one rank's plain output, no block leaks."""
    prompts = prompts_for(8, seed=4)
    target, model, spec = head_case(request, method, tiny_llama_dir, tmp_path)
    references = run_to_end(engine_for(target), prompts)
    one_rank = engine_for(model, speculative_config=spec)
    assert run_to_end(one_rank, prompts) == references
    engine = engine_for(model, pipeline_parallel_size=2, tensor_parallel_size=tp, ray_placement=HALF_CPU,
                        speculative_config=spec, enable_expert_parallel=method.endswith("-ep"))
    try:
        blocks = engine.scheduler.block_manager
        assert run_to_end(engine, prompts) == references
        assert engine.spec_stats.accepted_tokens > 0, engine.spec_stats
        assert (engine.spec_stats.draft_tokens, engine.spec_stats.accepted_tokens) == (
            one_rank.spec_stats.draft_tokens, one_rank.spec_stats.accepted_tokens)
        assert blocks.num_free_blocks == blocks.num_blocks
        shares = engine.executor.collective_rpc(probes.head_share)
        assert shares[:tp] == [None] * tp and all(share is not None for share in shares[tp:]), shares
    finally:
        engine.shutdown()


# DeepSeek-V3's and GLM-4.5's MTP blocks are one module: its experts split by width on GLM's, whole on DeepSeek's.
# (EAGLE-3's chains split over two ranks: test_heads_on_the_last_pipeline_stage_keep_greedy_output's eagle3-tp2.)
# (Chains of distinct MTP modules split over two ranks: MiMo's; DFlash's chains over pipeline stages above; a static
# tree split over two ranks, drawn from q too: Medusa's.)
HEAD_CASES = ["eagle3-tree", "eagle3-whole", "mtp3-tree", "deepseek-mtp-ep", "glm-mtp",
              "qwen3_5-mtp-tree", "qwen3_5-mtp-tree-graphs", "mimo-mtp", "medusa", "redrafter", "mlp_speculator",
              "dflash-tree"]
# a sampled request's tree (or MLP speculator's chain) drawn from q (checked sampled too)
DRAWN_TREES = ("eagle3-tree", "mtp3-tree", "qwen3_5-mtp-tree", "medusa", "redrafter", "mlp_speculator",
               "dflash-tree")


@pytest.mark.parametrize("method", HEAD_CASES)
def test_head_with_two_target_ranks_keeps_greedy_output(request, tiny_llama_dir, tmp_path, method):
    """Every hidden-state drafter split over two tensor-parallel ranks, as vLLM runs them: EAGLE-3 (EAGLE-2 trees; its
    chains over the last pipeline stage's two ranks above), three distinct MTP modules
    (num_nextn_predict_layers=3; EAGLE-2 trees a level per module), DeepSeek-V3's own MTP module (its
    block's latent attention, experts whole per rank with the target's enable_expert_parallel), GLM-4.5's (its block's
    grouped-query attention split by head, partial RoPE, experts split by width), Qwen3.5's drafting EAGLE-2 trees over
    a hybrid target whose linear layers' recurrent state splits by head too (its gated attention split by head),
    MiMo-V2-Flash's two chained modules (sliding-window layers with sinks, their KV heads split), Medusa's heads,
    ReDrafter's recurrent drafter (beams merged into a tree) and IBM's MLP speculator (each rank its rows of the LM
    heads), DFlash's block drafter (its layers split by head, its context projection whole on every rank). Each rank
    holds its half of the head (and its heads' share of the head's KV), reads the target's own split embedding and LM
    head, and drafts in lockstep with the driver from the verdict the driver sends it. The drafts are one rank's: with a
    fixed draft count the same drafts are made and kept as on one rank; greedy output equals one rank's plain output; no
    block leaked; the ranks' processes never import transformers. EAGLE-2 (EAGLE-3's, distinct MTP modules', Qwen3.5's
    MTP's), Medusa's static and ReDrafter's trees and the MLP speculator's chains also for sampled requests, drawn
    from q and verified against it on rank 0: the same seeds give the same tokens as one rank, and unseeded ones (each
    rank draws from a stream seeded alike) finish. ``-whole`` (draft_tensor_parallel_size=1): the head whole on rank
    0, reading the target's embedding and LM head gathered whole once; rank 1 holds nothing of it. ``-graphs``: every
    rank's steps and head passes from graphs, asked for (enforce_eager=False; on CPU their padded static inputs run
    eagerly, each rank picking the same shapes): Qwen3.5's tree verify steps in the recurrence's tree form, its MTP
    layer's tree levels."""
    prompts = prompts_for(8, seed=3)
    target, model, spec = head_case(request, method, tiny_llama_dir, tmp_path)
    deepseek = method.startswith("deepseek")
    references = run_to_end(engine_for(target), prompts)
    split = not method.endswith("-whole")
    graphs = {"enforce_eager": False} if method.endswith("-graphs") else {}
    one_rank = engine_for(model, speculative_config=spec, **graphs)
    assert run_to_end(one_rank, prompts) == references
    engine = engine_for(model, tensor_parallel_size=2, ray_placement=HALF_CPU, speculative_config=spec,
                        enable_expert_parallel=method.endswith("-ep"), **graphs)
    sampled = SamplingParams(temperature=0.8, top_k=5, seed=11, max_tokens=MAX_TOKENS)
    try:
        blocks = engine.scheduler.block_manager
        assert run_to_end(engine, prompts) == references
        assert engine.spec_stats.accepted_tokens > 0, engine.spec_stats
        if split:  # the same drafts made and kept as on one rank, step by step
            assert (engine.spec_stats.draft_tokens, engine.spec_stats.accepted_tokens) == (
                one_rank.spec_stats.draft_tokens, one_rank.spec_stats.accepted_tokens)
        assert blocks.num_free_blocks == blocks.num_blocks
        if graphs:  # both ranks replayed the tree form's graphs and their head's, the same ones
            kinds = engine.executor.collective_rpc(probes.graph_kinds)
            assert kinds[0] == kinds[1] and kinds[0][0] and kinds[0][1] > 0, kinds
        shares = engine.executor.collective_rpc(probes.head_share)
        # the engine read the target's and the head's configs: the ranks never import transformers
        assert engine.executor.collective_rpc(probes.imported, "transformers") == [False, False]
        if method in DRAWN_TREES:
            drawn = run_to_end(engine, prompts[:3], sampled)
            unseeded = SamplingParams(**{**sampled.__dict__, "seed": None})
            assert all(run_to_end(engine, prompts[3:6], unseeded))
            assert blocks.num_free_blocks == blocks.num_blocks
    finally:
        engine.shutdown()
    whole = probes.head_share(one_rank.executor.worker)
    if split:  # half of the layer's weights and of its KV on each rank, the fusion's projection and norms whole
        # Medusa and the MLP speculator read no target; ReDrafter reads the target's embedding
        assert all(share is not None and share[2] == (method not in ("medusa", "mlp_speculator")) for share in shares)
        assert all(whole[0] / 2 < share[0] < whole[0] for share in shares), (shares, whole)
        assert all(share[3] == method.endswith("-ep") for share in shares)  # experts as the target's
        latent = deepseek  # latent attention's cache is the same on every rank
        assert all(share[1] * (1 if latent else 2) == whole[1] for share in shares), (shares, whole)
    else:
        assert shares[0] is not None and not shares[0][2] and shares[1] is None
    if method in DRAWN_TREES:
        assert run_to_end(one_rank, prompts[:3], sampled) == drawn


def test_a_verification_failing_on_the_driver_leaves_no_rank_of_a_split_head_waiting(tiny_llama_dir, tmp_path,
                                                                                     caplog):
    """With the head split over two ranks, rank 1 drafts only once rank 0 has sent its verdict. When rank 0's
    verification raises after the forward both ran, rank 0 still tells rank 1 (nothing to draft) before the error
    goes up: rank 1 does not sit in the broadcast until the collective timeout, the engine runs the step again
    request by request, and greedy output equals one rank's plain output."""
    prompts = prompts_for(4, seed=6)
    references = run_to_end(engine_for(tiny_llama_dir), prompts)
    head = draft_heads.write_accepting_head(tmp_path / "eagle3", "eagle3", tiny_llama_dir)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "adaptive": False}
    engine = engine_for(tiny_llama_dir, tensor_parallel_size=2, ray_placement=HALF_CPU, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    try:
        blocks = engine.scheduler.block_manager
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        for _ in range(3):  # into decoding, drafts in hand
            done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        engine.executor.collective_rpc(probes.fail_next_verification)
        start = time.monotonic()
        with caplog.at_level("ERROR", logger="specray.engine.llm_engine"):
            done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        assert time.monotonic() - start < 30
        assert "injected verification fault" in caplog.text  # the step failed on rank 0 and was run again
        while engine.has_unfinished_requests():
            done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        assert [done[i] for i in ids] == references
        assert engine.spec_stats.accepted_tokens > 0 and blocks.num_free_blocks == blocks.num_blocks
    finally:
        engine.shutdown()


# ---- end to end through the engine actor ---------------------------------------------------------------------

@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_llm_ray_backend_matches_local_and_transformers(tiny_llama_dir, parallel):
    """Through the engine actor over two tensor-parallel ranks, or two pipeline stages: greedy, penalized and
    grammar-constrained outputs, prompt logprobs, prefix caching and concurrent streams equal one rank's."""
    from transformers import AutoModelForCausalLM

    prompts = prompts_for(8, seed=11)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    one_rank = LLM(str(tiny_llama_dir), max_model_len=256)
    local = one_rank.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    # penalized requests beside plain ones: the driver rank penalizes each verified position by its prefix
    # (and prompt logprobs, whose logits every rank computes)
    penalized = [SamplingParams(**{**sp.__dict__, "repetition_penalty": 1.5, "frequency_penalty": 0.5}) if i % 2
                 else SamplingParams(**{**sp.__dict__, "prompt_logprobs": 2}) for i in range(len(prompts))]
    local_penalized = one_rank.generate([{"prompt_token_ids": p} for p in prompts], penalized, use_tqdm=False)
    # with prefix caching: the penalized requests start from the blocks the first batch cached (the driver rank
    # learns the tokens in them), those asking for prompt logprobs compute their prompts whole
    llm = LLM(str(tiny_llama_dir), max_model_len=256, ray_placement=HALF_CPU, **parallel,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3}, enable_prefix_caching=True,
              block_size=4)
    try:
        remote = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in remote] == [o.outputs[0].token_ids for o in local]
        assert llm.spec_stats.drafts > 0
        remote_penalized = llm.generate([{"prompt_token_ids": p} for p in prompts], penalized, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in remote_penalized] == [o.outputs[0].token_ids for o in local_penalized]
        cached = [o.num_cached_tokens for o in remote_penalized]
        assert all(c for c, p in zip(cached[1::2], prompts[1::2]) if len(p) > 4) and not any(cached[::2]), cached
        assert any(cached)
        for a, b in zip(remote_penalized[::2], local_penalized[::2]):
            assert len(a.prompt_logprobs) == len(b.prompt_logprobs) and a.prompt_logprobs[0] is None
            for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                assert list(x) == list(y) and [v.logprob for v in x.values()] == pytest.approx(
                    [v.logprob for v in y.values()], abs=1e-4)
                assert [(v.rank, v.decoded_token) for v in x.values()] == [
                    (v.rank, v.decoded_token) for v in y.values()]
        streams = asyncio.run(stream_concurrently(llm.engine.actor, prompts[:4], sp))
        for items, ref in zip(streams, local):
            assert len(items) > 1 and items[-1].finished and not any(i.finished for i in items[:-1])
            assert items[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        assert llm.engine.describe()["num_free_blocks"] == llm.engine.describe()["num_kv_blocks"]
        assert llm.reset_prefix_cache()
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate({"prompt_token_ids": [5] * 300}, sp)
        # structured outputs: the plan carries the grammar's masks to the driver rank
        regex = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs={"regex": r"(ab|cd|the ){2,6}x"})
        as_prompts = [{"prompt_token_ids": p} for p in prompts]
        assert [o.outputs[0].token_ids for o in llm.generate(as_prompts, regex, use_tqdm=False)] == \
            [o.outputs[0].token_ids for o in one_rank.generate(as_prompts, regex, use_tqdm=False)]
        with pytest.raises(ValueError, match="regex"):
            llm.generate(as_prompts[:1], SamplingParams(structured_outputs={"regex": "(unclosed"}))
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    out = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS)
    assert out[0, len(prompts[0]):].tolist() == remote[0].outputs[0].token_ids


async def stream_concurrently(actor, prompts, params):
    """Several callers at once, each reading its own request's outputs as they stream from the engine actor."""

    async def one(prompt):
        return [await ref async for ref in actor.generate.remote(prompt, params)]

    return await asyncio.gather(*(one(p) for p in prompts))


def live_groups() -> set[str]:
    """Every placement group of the cluster that is not removed (named or not)."""
    import ray

    return {pg_id for pg_id, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"}


def test_llm_releases_its_actors_and_placement_groups(tiny_llama_dir):
    """The end of a ``with`` block (shutdown(), idempotent) and garbage collection each release the engine actor,
    its rank and the rank's placement group. The rank's bundle asks for the custom resource ``node0``, which the
    cluster has once: a group left behind would keep the next LLM waiting (and failing after PLACEMENT_TIMEOUT_S)."""
    import gc

    import ray

    kw = dict(max_model_len=256, distributed_executor_backend="ray",
              ray_placement=dict(HALF_CPU, worker_resources=[{"node0": 1}]))
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": prompts_for(1, seed=2)[0]}
    before = live_groups()
    with LLM(str(tiny_llama_dir), **kw) as llm:
        actor = llm.engine.actor
        assert len(live_groups() - before) == 1
        first = llm.generate(prompt, sp, use_tqdm=False)

        # a call that ends early (its caller stops reading, as on Ctrl-C) aborts what it left on the actor, whose
        # steps are slowed here so that the long request could not finish meanwhile by itself
        def slowed(engine):
            step = engine.step

            def slow():
                time.sleep(0.05)
                return step()

            engine.step = slow

        ray_get(actor.call.remote(slowed))
        batch = llm.engine.run_batch([(prompt["prompt_token_ids"], SamplingParams(max_tokens=n, ignore_eos=True),
                                       None, None) for n in (1, 200)])
        assert next(batch)[0] == 0
        batch.close()
        deadline = time.monotonic() + 5
        while ray_get(actor.call.remote(lambda engine: len(engine.tracked))):
            assert time.monotonic() < deadline, "the request left on the actor still runs"
            time.sleep(0.1)
    assert live_groups() == before
    llm.shutdown()  # idempotent
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.describe.remote(), timeout=30)
    start = time.monotonic()
    llm = LLM(str(tiny_llama_dir), **kw)
    assert time.monotonic() - start < 50  # started at once: not after waiting on a leftover group
    assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    del llm
    gc.collect()
    assert live_groups() == before


def test_bad_tp_size_is_a_clear_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="num_attention_heads|divisible"):
        engine_for(tiny_llama_dir, tensor_parallel_size=3, ray_placement=HALF_CPU)
    with pytest.raises(ValueError, match="cannot place"):
        engine_for(tiny_llama_dir, tensor_parallel_size=2, ray_placement={"worker_num_cpus": 64})


def test_could_ever_fit_packs_bundles_into_the_nodes():
    from specray.cluster.placement import could_ever_fit, custom_resources, missing_resources

    two, one_gpu = {"CPU": 2}, {"CPU": 4, "GPU": 1}
    assert could_ever_fit([{"CPU": 1}] * 2, "PACK", [two])
    assert not could_ever_fit([{"CPU": 1}] * 3, "PACK", [two])  # each fits a node, all three never do
    assert could_ever_fit([{"CPU": 1.5}] * 3, "SPREAD", [two] * 3)
    assert not could_ever_fit([{"CPU": 1.5}] * 4, "PACK", [two] * 3)
    assert could_ever_fit([{"CPU": 2}, {"CPU": 1}, {"CPU": 1}], "PACK", [{"CPU": 3}, {"CPU": 1}])
    assert not could_ever_fit([{"CPU": 1}] * 2, "STRICT_SPREAD", [{"CPU": 8}])
    assert not could_ever_fit([{"CPU": 1}] * 3, "STRICT_PACK", [two, two])
    assert not could_ever_fit([{"CPU": 1, "GPU": 1}] * 2, "PACK", [one_gpu, two])
    assert not could_ever_fit([{"CPU": 0.5, "node5": 0.01}], "PACK", [two])
    # a resource no node was started with (a typo, a node not up yet) is named as such (placement.create), not
    # advised away by CPU counts that would never help
    nodes = [{"CPU": 2, "node0": 1, "node:127.0.0.1": 1, "memory": 1e9}, {"CPU": 2, "GPU": 1, "node1": 0}]
    assert missing_resources([{"CPU": 0.5, "gpu_node": 1}, {"CPU": 0.5, "node1": 1}], nodes) == ["gpu_node"]
    assert missing_resources([{"CPU": 8, "GPU": 2, "node1": 1}], nodes) == []  # too few of these: a size's error
    assert custom_resources(nodes) == ["node0", "node1"]


def test_a_group_the_cluster_can_never_hold_fails_at_once(tiny_llama_dir, monkeypatch):
    """Four ranks of 2 CPUs each: every rank fits a node, but the three 2-CPU nodes can never hold all four. With
    no autoscaler that is a ValueError at once, naming the options to change; with one, it waits (up to the
    placement timeout) for nodes to be added."""
    from specray.cluster import placement

    start = time.monotonic()
    with pytest.raises(ValueError, match="could never hold them.*ray_placement.worker_num_cpus"):
        engine_for(tiny_llama_dir, tensor_parallel_size=4, ray_placement=dict(HALF_CPU, worker_num_cpus=2))
    assert time.monotonic() - start < 10
    monkeypatch.setenv(placement.AUTOSCALING_ENV, "1")
    monkeypatch.setattr(placement, "PLACEMENT_TIMEOUT_S", 1.0)
    with pytest.raises(ValueError, match="still not placed after 1s"):
        engine_for(tiny_llama_dir, tensor_parallel_size=4, ray_placement=dict(HALF_CPU, worker_num_cpus=2))


def test_what_the_placing_actor_holds_is_no_room_for_its_groups(ray_cluster):
    """An actor (the engine's supervisor, a Serve engine replica) holds its own resources for as long as the
    groups it places live: a group that fits its node only with them can never be placed, and says so at once."""
    import ray

    @ray.remote(num_cpus=0.01, resources={"node1": 0.6})
    class Placer:
        def place(self) -> str:
            from specray.cluster import placement

            try:
                group = placement.create([{"CPU": 0.01, "node1": 0.5}], "PACK", "test", "hold less")
            except ValueError as err:
                return str(err)
            placement.remove(group)
            return "placed"

    placer = Placer.remote()
    try:
        start = time.monotonic()
        message = ray.get(placer.place.remote(), timeout=120)
        assert "could never hold them" in message and "hold less" in message, message
        assert time.monotonic() - start < 30
    finally:
        ray.kill(placer)


def test_the_groups_an_actor_placed_are_no_room_for_its_next_one(ray_cluster):
    """An actor's groups live as long as it does: a second group (the drafter's, after the target's) that fits
    the node only with the first one's bundles can never be placed, and says so at once; one that fits beside
    them is placed."""
    import ray

    @ray.remote(num_cpus=0.01)
    class Placer:
        def place(self) -> list[str]:
            from specray.cluster import placement

            first = placement.create([{"CPU": 0.01, "node1": 0.3}] * 2, "PACK", "target", "")
            out = []
            for need in (0.5, 0.4):
                try:
                    placement.remove(placement.create([{"CPU": 0.01, "node1": need}], "PACK", "draft", "hold less"))
                    out.append("placed")
                except ValueError as err:
                    out.append(str(err))
            placement.remove(first)
            return out

    placer = Placer.remote()
    try:
        start = time.monotonic()
        too_big, fits = ray.get(placer.place.remote(), timeout=120)
        assert "could never hold them" in too_big and "hold less" in too_big, too_big
        assert fits == "placed" and time.monotonic() - start < 30
    finally:
        ray.kill(placer)


def test_a_drafter_actor_the_cluster_can_never_hold_fails_at_once(tiny_llama_dir):
    """A one-rank drafter actor asking for more CPUs than any node has is refused at once too (it used to wait
    for its setup's long timeout), and what the engine had started is released."""
    from ray.util import placement_group_table

    before = sum(g["state"] != "REMOVED" for g in placement_group_table().values())
    start = time.monotonic()
    with pytest.raises(ValueError, match="could never hold them.*drafter_num_cpus"):
        engine_for(tiny_llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                   distributed_executor_backend="ray", ray_placement=dict(HALF_CPU, drafter_num_cpus=3))
    assert time.monotonic() - start < 30
    assert sum(g["state"] != "REMOVED" for g in placement_group_table().values()) == before


# ---- failures ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_killed_worker_fails_running_requests_at_once_keeps_waiting_ones_and_serves(tiny_llama_dir, parallel):
    """A rank killed mid-run: the running requests fail at once (while the group is still restarting in the
    background), the request that was only waiting for a seat (max_num_seqs=1: one seat, or one per pipeline stage,
    whose two cohorts are both in flight; no KV on the dead group) stays queued and completes on the new group, and
    so does a request sent afterwards."""
    import ray
    from specray.engine.async_engine import AsyncLLMEngine

    seats = parallel.get("pipeline_parallel_size", 1)
    prompts = prompts_for(seats + 1, seed=5)
    *running, other = prompts
    references = run_to_end(engine_for(tiny_llama_dir), prompts)
    engine = engine_for(tiny_llama_dir, ray_placement=HALF_CPU, max_num_seqs=1, **parallel)
    aengine = AsyncLLMEngine(engine)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    async def last(stream):
        final = None
        async for final in stream:
            pass
        return final

    async def fails(stream) -> float:
        start = time.monotonic()
        with pytest.raises(RequestFailedError, match="target rank"):
            await last(stream)
        return time.monotonic() - start

    async def scenario():
        streams = [aengine.generate(p, long) for p in running]
        for stream in streams:
            await stream.__anext__()  # each request is running (a cohort each over stages)
        waiting = asyncio.create_task(last(aengine.generate(other, greedy)))
        while await aengine.call(lambda e: e.scheduler.num_waiting) == 0:
            await asyncio.sleep(0.01)
        ray.kill(engine.executor.workers[1])
        failed_after = max(await asyncio.gather(*(fails(s) for s in streams)))
        restarting = engine.executor.restarting
        return failed_after, restarting, await waiting, await last(aengine.generate(running[0], greedy))

    try:
        failed_after, restarting, waited, final = asyncio.run(scenario())
        assert failed_after < 10 and restarting  # told before the new group was up
        assert waited.outputs[0].token_ids == references[-1]
        assert final.outputs[0].token_ids == references[0]
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        aengine.shutdown()
        engine.executor.shutdown()


def kill_and_wait(actor, timeout: float = 60.0) -> None:
    """Kill ``actor`` and block until its process is gone, or fail after ``timeout`` seconds. Ray reports the
    actor dead before its process exits: on a loaded machine the process (and the step channel it serves) could
    go on answering for a while."""
    import ray

    pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=timeout)
    ray.kill(actor)
    deadline = time.monotonic() + timeout
    while process_runs(pid):
        assert time.monotonic() < deadline, f"the killed actor {actor} (pid {pid}) still runs after {timeout:.0f}s"
        time.sleep(0.05)


def process_runs(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (on Linux, whose /proc says)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def test_drafter_actor_loss_falls_back_to_plain_decoding(tiny_llama_dir, monkeypatch, caplog):
    from specray.cluster import drafter_actor

    monkeypatch.setattr(drafter_actor, "RESPAWN_BACKOFF_S", 0.0)
    prompts = prompts_for(4, seed=3)
    references = run_to_end(engine_for(tiny_llama_dir), prompts)
    # (fixed drafts: an adaptive policy on a loaded machine may stop asking the drafter before it is seen gone)
    engine = engine_for(tiny_llama_dir, distributed_executor_backend="ray", ray_placement=HALF_CPU,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        ids = [engine.add_request(p, params) for p in prompts]
        for _ in range(3):
            engine.step()
        actor = engine.drafter.actor
        kill_and_wait(actor)
        done = {}
        with caplog.at_level("WARNING", logger="specray.cluster.drafter_actor"):
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0].token_ids
        assert [done[i] for i in ids] == references
        lost = [r.getMessage() for r in caplog.records if "drafter actor lost" in r.getMessage()]
        assert len(lost) == 1 and "drafter actor rank 0" in lost[0] and "target rank" not in lost[0], lost
        assert engine.drafter.num_prefetch_hits == 0  # no drafting ahead unless ray_placement.draft_ahead
        deadline = time.monotonic() + 60
        while engine.drafter.actor is None and time.monotonic() < deadline:  # a replacement comes up
            engine.drafter.propose([])
            time.sleep(0.2)
        assert engine.drafter.actor is not None
        assert run_to_end(engine, prompts) == references
    finally:
        engine.drafter.shutdown()
        engine.executor.shutdown()


# ---- the shared n-gram pool across replicas ----------------------------------------------------------------

NGRAM_POOL = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3,
                               is_public_pool=True)


def _pool_drafter(pool_name: str, spec: SpeculativeConfig = NGRAM_POOL):
    """A drafter actor as an engine replica holds it, its drafter sharing the pool ``pool_name``."""
    from specray.cluster.drafter_actor import RemoteDrafter
    from specray.config import RayPlacement

    ctx = DrafterContext(target_model="unused", vocab_size=1000, max_model_len=512, max_num_seqs=4)
    return RemoteDrafter(spec, ctx, RayPlacement(drafter_num_cpus=0.1, pool_name=pool_name))


def test_an_llm_removes_the_shared_pool_it_created(monkeypatch):
    """The pool's actor is detached (it outlives any one replica): an LLM that created it removes it at shutdown,
    and leaves one that ran before it (a server's, another job's) alone."""
    from types import SimpleNamespace

    from specray.cluster import engine_actor
    from specray.config import EngineArgs

    running, killed = set(), []

    def get_actor(name, namespace):
        if name not in running:
            raise ValueError(name)
        return name

    monkeypatch.setattr(engine_actor.ray, "get_actor", get_actor)
    monkeypatch.setattr(engine_actor, "get_pool_actor", lambda name, method: running.add(
        engine_actor.pool_actor_name(name, method)) or engine_actor.pool_actor_name(name, method))
    monkeypatch.setattr(engine_actor.ray, "kill", killed.append)
    args = EngineArgs(model="m", distributed_executor_backend="ray", speculative_config=NGRAM_POOL,
                      ray_placement={"pool_name": "t-llm"})
    client = object.__new__(engine_actor.RayEngineClient)
    client.actor, client.pool = None, engine_actor.claim_pool(args)
    assert client.pool == "specray-ngram-pool:t-llm" and engine_actor.claim_pool(args) is None  # a second joins it
    monkeypatch.setattr(engine_actor.ray, "get", lambda ref, timeout: None)
    monkeypatch.setattr(engine_actor.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(engine_actor.placement_groups, "remove_owned", lambda owner: 0)
    client.actor = SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: "a1"),
                                   shutdown=SimpleNamespace(remote=lambda: None))
    client.shutdown()
    assert len(killed) == 2 and killed[1] == "specray-ngram-pool:t-llm"  # the engine actor, then the pool
    unpooled = EngineArgs(model="m", distributed_executor_backend="ray", speculative_config=NGRAM_POOL)
    assert engine_actor.claim_pool(unpooled) is None


def test_shared_pool_lets_a_replica_draft_from_another_replicas_text():
    import ray

    params = SamplingParams(temperature=0.0)
    first, second, alone = _pool_drafter("t-shared"), _pool_drafter("t-shared"), _pool_drafter("t-other")
    try:
        text = [900, 901, 902, 903, 904, 905, 906, 907]  # only the first replica ever sees these
        first.propose([DraftRequest("a", [1, 2, 3] + text, 4, params)])
        ray.get(first.actor.sync_pool.remote())
        ray.get(second.actor.sync_pool.remote())
        ask = DraftRequest("b", [7, 8, 901, 902], 4, params)
        assert second.propose([ask])[0].token_ids == [903, 904, 905, 906]
        assert alone.propose([ask])[0].token_ids == []
        # an n-gram drafter's actor never imports torch: it starts in a fraction of a second and stays small
        assert ray.get(second.actor.run.remote(probes.imported, "torch")) is False
    finally:
        for d in (first, second, alone):
            d.shutdown()
        for name in ("t-shared", "t-other"):
            ray.kill(ray.get_actor("specray-ngram-pool:" + name, namespace="specray"))


def test_a_pool_that_is_lost_or_never_placed_leaves_each_replica_its_own_text():
    """A replica whose shared pool actor dies, or never starts (here: created first under the pool's name asking for
    a resource no node has, as an actor the cluster cannot place), gives the pool up (a warning) and goes on drafting
    from its own text, keeping nothing more for the pool (its updates were kept for ever before)."""
    import ray

    from specray.cluster.ngram_pool import POOL_NAMESPACE, NgramPoolActor, pool_actor_name

    stuck = ray.remote(NgramPoolActor).options(name=pool_actor_name("t-stuck"), namespace=POOL_NAMESPACE,
                                               lifetime="detached", resources={"nowhere": 1}).remote()
    never, lost = _pool_drafter("t-stuck"), _pool_drafter("t-lost")
    params, text = SamplingParams(temperature=0.0), [900, 901, 902, 903, 904, 905, 906, 907]
    try:
        ray.get(never.actor.run.remote(probes.pool_link_state, 0.5))
        never.propose([DraftRequest("a", [1, 2, 3] + text, 4, params)])
        assert ray.get(never.actor.run.remote(probes.pool_link_state)) == (False, 0, True)  # waiting for it
        time.sleep(0.6)
        never.propose([DraftRequest("a", [1, 2, 3] + text + [1, 2], 4, params)])
        lost.propose([DraftRequest("a", [1, 2, 3] + text, 4, params)])
        lost.sync_pool()
        ray.kill(ray.get_actor(pool_actor_name("t-lost"), namespace=POOL_NAMESPACE))
        for i in range(3):
            lost.propose([DraftRequest("a", [1, 2, 3] + text + [1] * i, 4, params)])
        lost.sync_pool()  # waits for the exchange in flight (the dead pool's error), where a proposal only looks
        for drafter in (never, lost):
            assert ray.get(drafter.actor.run.remote(probes.pool_link_state)) == (True, 0, False)
            assert drafter.propose([DraftRequest("b", [7, 8, 901, 902], 4, params)])[0].token_ids == [903, 904, 905,
                                                                                                     906]
    finally:
        for drafter in (never, lost):
            drafter.shutdown()
        ray.kill(stuck)


# ---- several nodes -------------------------------------------------------------------------------------------

def test_tp_ranks_on_two_nodes_and_the_draft_model_on_a_third(tiny_llama_dir, tiny_draft_dir):
    import ray

    placement = dict(HALF_CPU, strategy="STRICT_SPREAD", worker_resources=[{"node0": 0.01}, {"node1": 0.01}],
                     drafter_resources={"node2": 0.01})
    prompts = prompts_for(8, seed=21)
    references = run_to_end(engine_for(tiny_llama_dir), prompts)
    engine = engine_for(tiny_llama_dir, tensor_parallel_size=2, ray_placement=placement,
                        speculative_config={"method": "draft_model", "model": str(tiny_draft_dir),
                                            "num_speculative_tokens": 3})
    try:
        nodes = {n["Resources"].get("node0") and "node0" or n["Resources"].get("node1") and "node1" or "node2":
                 n["NodeID"] for n in ray.nodes() if n["Alive"]}
        worker_nodes = ray.get([w.node_id.remote() for w in engine.executor.workers])
        assert worker_nodes == [nodes["node0"], nodes["node1"]]
        assert ray.get(engine.drafter.actor.node_id.remote()) == nodes["node2"]
        assert run_to_end(engine, prompts) == references
        assert engine.spec_stats.accepted_tokens > 0
    finally:
        engine.drafter.shutdown()
        engine.executor.shutdown()


# ---- drafting ahead while the target verifies ------------------------------------------------------------------

def test_prefetched_drafts_keep_greedy_output_exact(tiny_llama_dir):
    """The drafter actor drafts step t+1 during step t's verification, assuming every draft is kept. A
    self-draft (the target drafting for itself) always guesses right, so most steps use prefetched drafts; an
    n-gram drafter guesses right only sometimes. Either way the output is the plain greedy output."""
    prompts = prompts_for(4, seed=5)
    plain = engine_for(tiny_llama_dir)
    references = run_to_end(plain, prompts)
    # structured outputs: the self-draft drafts under the same grammar (in the actor, over histories with assumed
    # drafts), so it still always guesses right
    structured = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                structured_outputs={"regex": r"(ab|cd|the |[0-9]){4,30}x"})
    structured_references = run_to_end(plain, prompts, structured)
    for spec in ({"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3},
                 {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}):
        engine = engine_for(tiny_llama_dir, distributed_executor_backend="ray",
                            ray_placement=dict(HALF_CPU, draft_ahead=True), speculative_config=spec)
        try:
            assert run_to_end(engine, prompts) == references, spec["method"]
            assert engine.drafter.num_prefetch_hits > 0, spec["method"]
            if spec["method"] == "draft_model":
                assert engine.spec_stats.accepted_tokens == engine.spec_stats.draft_tokens
                assert engine.drafter.num_prefetch_hits >= engine.spec_stats.drafts // 2
                before = engine.spec_stats.copy()
            assert run_to_end(engine, prompts, structured) == structured_references, spec["method"]
            if spec["method"] == "draft_model":
                stats = engine.spec_stats
                assert stats.accepted_tokens - before.accepted_tokens == stats.draft_tokens - before.draft_tokens > 0
        finally:
            engine.drafter.shutdown()
            engine.executor.shutdown()


def test_async_scheduling_over_two_ranks_and_a_drafter_actor_keeps_greedy_output(tiny_llama_dir):
    """``async_scheduling`` on the Ray executor: the plan goes out on the step channel, the last step's outputs
    are built while the ranks compute, then the answers are read; beside a drafter actor drafting ahead, too."""
    prompts = prompts_for(6, seed=9)
    references = run_to_end(engine_for(tiny_llama_dir), prompts)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    for kw in ({"tensor_parallel_size": 2}, {"distributed_executor_backend": "ray",
                                             "ray_placement": dict(HALF_CPU, draft_ahead=True)}):
        kw.setdefault("ray_placement", HALF_CPU)
        engine = engine_for(tiny_llama_dir, speculative_config=spec, async_scheduling=True, **kw)
        try:
            assert run_to_end(engine, prompts) == references, kw
            assert engine.spec_stats.accepted_tokens > 0 and not engine.tracked
        finally:
            if engine.drafter is not None:
                engine.drafter.shutdown()
            engine.executor.shutdown()


class FakeChannel:
    """Stands for the drafter actor's channel: answers each message with the queued proposals."""

    def __init__(self):
        self.sent, self.answers = [], []

    def send(self, messages, what):
        self.sent.append(messages[0][0])

    def receive(self, timeout, what):
        return self.answers.pop(0)


def test_grammar_masks_go_to_the_driver_rank_alone():
    """Only the driver rank samples: the other ranks' message is the plan without its structured-outputs masks (one
    pickle for all of them), and a plan without masks is one message for every rank."""
    import numpy as np

    from specray.cluster.executor import RayExecutor
    from specray.contract import ScheduledChunk, StepPlan

    class Channel:
        def send(self, messages, what):
            self.messages = messages

        def receive(self, timeout, what):
            return None

    executor = RayExecutor.__new__(RayExecutor)
    executor.tp_size, executor.world_size, executor.driver = 3, 3, 0
    executor._restarting, executor.channel = None, Channel()
    chunk = ScheduledChunk("a", [1, 2], 0)
    masked = StepPlan(1, chunks=[chunk], token_bitmasks={"a": np.full((1, 4), -1, dtype=np.int32)})
    executor.execute(masked)
    first, *others = executor.channel.messages
    assert first[0] is masked and "a" in first[0].token_bitmasks
    assert all(m is others[0] for m in others) and others[0][0].token_bitmasks == {}
    assert others[0][0].chunks == masked.chunks and masked.token_bitmasks  # the plan itself is untouched
    plain = StepPlan(2, chunks=[chunk])
    executor.execute(plain)
    assert all(m is executor.channel.messages[0] for m in executor.channel.messages)
    executor.world_size, executor.driver = 6, 3  # two pipeline stages of three: the last stage's first rank
    executor.execute(masked)
    messages = executor.channel.messages
    assert len(messages) == 6 and messages[3][0] is masked
    assert all(m[0].token_bitmasks == {} for i, m in enumerate(messages) if i != 3)


def test_prefetch_is_used_only_when_the_target_kept_every_draft_and_its_own_token_was_guessed():
    from specray.cluster.drafter_actor import RemoteDrafter

    drafter = RemoteDrafter.__new__(RemoteDrafter)
    drafter.actors, drafter.channel = [object()], FakeChannel()
    drafter.sent, drafter.pending, drafter.pending_ids, drafter.num_prefetch_hits = {}, False, [], 0
    drafter.prefetched, drafter.events, drafter.unanswered = {}, [], deque()
    sp = SamplingParams(temperature=0.0)
    history = [1, 2, 3]
    # step t: the drafts [4, 5] are being verified; prefetch with them assumed kept (and one token more)
    drafter.sent["a"] = (3, [])
    drafter.prefetch([DraftRequest("a", history + [4, 5], 4, sp, num_assumed=2)])
    assert drafter.channel.sent[-1] == [("a", 3, [4, 5], 4, sp, 0)]  # only what the actor lacks
    drafter.channel.answers.append([Proposal([6, 7, 8, 9])])
    # the target kept 4 and 5 and its own token is the guess 6: drafts 7, 8 (k=2) without asking the actor
    assert drafter.propose([DraftRequest("a", history + [4, 5, 6], 2, sp)])[0].token_ids == [7, 8]
    assert drafter.num_prefetch_hits == 1 and len(drafter.channel.sent) == 1
    assert drafter._synced_prefix(DraftRequest("a", history + [4, 5, 6], 2, sp)) == 5
    # next step: drafts [7, 8] under verification, prefetch again; the target keeps 7, rejects 8, says 10
    drafter.prefetch([DraftRequest("a", history + [4, 5, 6, 7, 8], 4, sp, num_assumed=2)])
    assert drafter.channel.sent[-1] == [("a", 5, [6, 7, 8], 4, sp, 0)]
    drafter.channel.answers += [[Proposal([9, 1])], [Proposal([11])]]
    real = history + [4, 5, 6, 7, 10]
    assert drafter.propose([DraftRequest("a", real, 3, sp)])[0].token_ids == [11]  # asked afresh
    assert drafter.channel.sent[-1] == [("a", 7, [10], 3, sp, 0)]  # the actor rewinds to the kept 7
    assert drafter.num_prefetch_hits == 1


# ---- a draft model split over ranks ----------------------------------------------------------------------------

def test_draft_model_over_two_ranks_drafts_what_one_rank_drafts(tiny_llama_dir, tiny_draft_dir, tmp_path):
    """draft_tensor_parallel_size=2: two drafter actors (gloo) hold half the draft model each and draft in
    lockstep. With a fixed K (no timing-driven policy), greedy drafts from the split model are the one-rank
    drafts (the draft model in the engine's process), so every acceptance count matches exactly, and the output is
    the plain greedy output; likewise PARD's (``parallel_drafting``, its K drafts from one forward), whose every first
    draft is accepted."""
    import ray

    pard = Path(shutil.copytree(tiny_llama_dir, tmp_path / "pard"))
    config = json.loads((pard / "config.json").read_text())
    (pard / "config.json").write_text(json.dumps({**config, "pard_token": config["vocab_size"] - 1}))
    prompts = prompts_for(4, seed=8)
    references = run_to_end(engine_for(tiny_llama_dir), prompts)
    stats = {}
    for name, draft_tp in (("tiny", 1), ("tiny", 2), ("pard", 1), ("pard", 2)):
        spec = {"method": "draft_model", "model": str(tiny_draft_dir if name == "tiny" else pard),
                "num_speculative_tokens": 3, "adaptive": False, "draft_tensor_parallel_size": draft_tp,
                "parallel_drafting": name == "pard"}
        over_ray = dict(distributed_executor_backend="ray", ray_placement=HALF_CPU) if draft_tp > 1 else {}
        engine = engine_for(tiny_llama_dir, speculative_config=spec, **over_ray)
        try:
            if over_ray:
                assert len(engine.drafter.actors) == draft_tp
                # the engine checked the tokenizer and read the draft's config: the actors never import transformers
                assert ray.get([a.run.remote(probes.imported, "transformers") for a in engine.drafter.actors]) == [
                    False] * draft_tp
            assert run_to_end(engine, prompts) == references
            s = engine.spec_stats
            stats[name, draft_tp] = (s.drafts, s.draft_tokens, s.accepted_tokens, s.accepted_per_position[0])
        finally:
            engine.shutdown()
    assert stats["tiny", 2] == stats["tiny", 1] and stats["tiny", 1][0] > 0, stats
    assert stats["pard", 2] == stats["pard", 1] and stats["pard", 2][3] == stats["pard", 2][0] > 0, stats


def test_draft_tp_errors_are_clear(tiny_llama_dir, tiny_draft_dir, monkeypatch):
    """Each a ValueError naming the option, raised in the engine's process before any actor starts."""
    from specray.engine import builder
    from specray.engine.builder import check_engine_args

    def no_actors(*args):
        raise AssertionError("an executor was built before the drafter's options were checked")

    monkeypatch.setattr(builder, "executor_class", no_actors)

    with pytest.raises(ValueError,
                       match=r"draft_tensor_parallel_size is an option of method 'draft_model'.*not of method='ngram'"):
        check_engine_args(EngineArgs(model=str(tiny_llama_dir), speculative_config=SpeculativeConfig(
            method="ngram", draft_tensor_parallel_size=2)))
    spec = {"method": "draft_model", "model": str(tiny_draft_dir), "draft_tensor_parallel_size": 2}
    with pytest.raises(ValueError, match="distributed_executor_backend='ray'"):
        check_engine_args(EngineArgs(model=str(tiny_llama_dir), speculative_config=spec))
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size=3 does not split"):  # 4 heads, 3 ranks
        engine_for(tiny_llama_dir, distributed_executor_backend="ray", ray_placement=HALF_CPU,
                   speculative_config=dict(spec, draft_tensor_parallel_size=3))


def test_a_draft_model_of_another_tokenizer_drafts_through_text_in_its_actor(tiny_char_dir, tiny_char_permuted_dir):
    """The target's own weights over a permuted vocabulary (another tokenizer): the engine's process decides the
    translation (``DraftModelDrafter.prepare``), the drafter actor translates each history and its drafts; greedy
    output is plain greedy output, every draft kept."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_char_dir)
    prompts = [tok.encode(p) for p in ("def add(a, b):", "The quick brown fox", "for i in range(10):", "x")]
    references = run_to_end(engine_for(tiny_char_dir), prompts)
    spec = {"method": "draft_model", "model": str(tiny_char_permuted_dir), "num_speculative_tokens": 3,
            "adaptive": False}
    engine = engine_for(tiny_char_dir, distributed_executor_backend="ray", ray_placement=HALF_CPU,
                        speculative_config=spec)
    try:
        assert engine.drafter.ctx.translate_drafts
        assert run_to_end(engine, prompts) == references
        assert 0 < engine.spec_stats.accepted_tokens == engine.spec_stats.draft_tokens, engine.spec_stats
    finally:
        engine.shutdown()


# ---- the engine's drafter hooks through a drafter actor ----------------------------------------------------------

class RecordingChannel(FakeChannel):
    """FakeChannel that keeps whole messages: (updates, events)."""

    def send(self, messages, what):
        self.sent.append(messages[0])


def _hooked_drafter(hooks: list[str]):
    from specray.cluster.drafter_actor import RemoteDrafter

    drafter = RemoteDrafter.__new__(RemoteDrafter)
    drafter.actors, drafter.channel = [object()], RecordingChannel()
    drafter.sent, drafter.pending, drafter.pending_ids, drafter.num_prefetch_hits = {}, False, [], 0
    drafter.prefetched, drafter.events, drafter.unanswered = {}, [], deque()
    drafter._expose(hooks)
    return drafter


def test_remote_drafter_queues_hooks_in_order_and_sends_a_finished_history_as_a_delta():
    sp = SamplingParams(temperature=0.0)
    assert all(getattr(_hooked_drafter([]), h, None) is None
               for h in ("observe_verification", "observe_finished", "observe_node_tokens", "stats"))
    drafter = _hooked_drafter(["observe_verification", "observe_finished", "observe_node_tokens",
                               "reset_prefix_cache"])
    assert getattr(drafter, "stats", None) is None  # the actor's drafter keeps none: LLM.drafter_stats is None
    drafter.channel.answers.append([Proposal([4])])
    drafter.propose([DraftRequest("a", [1, 2, 3], 2, sp)])
    assert drafter.channel.sent[-1] == ([("a", 0, [1, 2, 3], 2, sp, 0)], [])
    drafter.observe_verification("a", 1, 1)  # queued: no message per hook call
    drafter.observe_node_tokens("a", [4, 7])
    drafter.observe_finished("a", [1, 2, 3, 4, 9])
    drafter.reset_prefix_cache()  # a draft model's cache, on every rank (LLM.reset_prefix_cache)
    assert len(drafter.channel.sent) == 1
    drafter.finish(["a"])  # one message: the events in the engine's order, the history's delta, the finish
    assert drafter.channel.sent[-1] == ([], [("observe_verification", "a", 1, 1), ("observe_node_tokens", "a", [4, 7]),
                                             ("observe_finished", "a", 3, [4, 9]), ("reset_prefix_cache",),
                                             ("finish", ["a"])])
    drafter.channel.answers += [[], [Proposal([8])]]  # finish's answer is read and dropped before the next one
    assert drafter.propose([DraftRequest("b", [5, 6], 2, sp)])[0].token_ids == [8]
    assert drafter.channel.sent[-1] == ([("b", 0, [5, 6], 2, sp, 0)], []) and not drafter.unanswered


def test_drafter_worker_applies_events_before_drafting():
    """The actor's side, in this process: a finished history arrives as a delta and completes the actor's copy,
    so suffix decoding's global tree gets the whole output, then ``finish`` releases it."""
    from specray.cluster.drafter_actor import DrafterWorker

    sp = SamplingParams(temperature=0.0)
    worker = DrafterWorker()
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=4, max_tree_depth=8)
    ctx = DrafterContext(target_model="unused", vocab_size=1000, max_model_len=512, max_num_seqs=4)
    assert worker.setup(spec, ctx, "unused") == ["observe_verification", "observe_finished", "stats"]
    prompt, answer = list(range(100, 120)), list(range(500, 512))
    worker.propose([("a", 0, prompt + answer[:1], 4, sp, 20)])
    worker.propose([("a", 21, answer[1:3], 4, sp, 20)])
    worker.propose([], [("observe_verification", "a", 4, 2), ("observe_finished", "a", 23, answer[3:]),
                        ("finish", ["a"])])
    (key, start, tokens), = worker.drafter.cache.records()
    assert key == "a" and tokens == prompt[-8:] + answer and worker.histories == {}
    assert worker.stats()["acc_tokens"] == 2
    proposal, = worker.propose([("b", 0, [7] + prompt[-6:] + answer[:1], 4, sp, 7)])
    assert proposal.token_ids[:4] == answer[1:5]


class RaisesForBad:
    """A user's drafter that raises whenever request "bad" is in the batch, or among those it finishes."""

    def propose(self, batch):
        if any(d.req_id == "bad" for d in batch):
            raise RuntimeError("boom")
        return [Proposal([7]) for _ in batch]

    def finish(self, req_ids):
        if "bad" in req_ids:
            raise RuntimeError("finish boom")


def test_drafter_worker_isolates_a_request_its_drafter_fails_on():
    """A drafter that raises in the actor for one request: the batch is asked again request by request, the
    others get their proposals and that one a DraftFailure (the engine then stops drafting for it alone), rather
    than the actor being lost for every request; its finish raising is logged and ignored, as in the engine."""
    from specray.cluster.drafter_actor import DrafterWorker
    from specray.drafters.base import DraftFailure

    sp = SamplingParams(temperature=0.0)
    worker = DrafterWorker()
    worker.drafter, worker.handlers = RaisesForBad(), {"finish": worker._finish}
    good, bad = worker.propose([("good", 0, [1, 2], 2, sp, 1), ("bad", 0, [3, 4], 2, sp, 1)])
    assert good == Proposal([7]) and bad == DraftFailure("RuntimeError('boom')")
    assert worker.histories == {"good": [1, 2], "bad": [3, 4]}
    assert worker.propose([("good", 2, [3], 2, sp, 1)], [("finish", ["bad"])]) == [Proposal([7])]
    assert worker.histories == {"good": [1, 2, 3]}


def test_llm_with_a_suffix_drafter_actor_gets_statistics_and_whole_outputs(tiny_llama_dir):
    """LLM(distributed_executor_backend="ray"): the suffix drafter runs in an actor. Its statistics are the
    engine's counts, and each finished output (its last step included) is in the actor's global tree, so the
    same prompt again drafts its whole answer from it. Greedy output is the plain output."""
    prompts = [{"prompt_token_ids": p} for p in prompts_for(3, seed=31)]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(str(tiny_llama_dir), max_model_len=256).generate(
        prompts, sp, use_tqdm=False)]
    spec = {"method": "suffix", "num_speculative_tokens": 8, "adaptive": False}
    with LLM(str(tiny_llama_dir), max_model_len=256, distributed_executor_backend="ray", ray_placement=HALF_CPU,
             speculative_config=spec) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == plain

        def records(engine):
            import ray

            engine.drafter.deliver()
            return ray.get(engine.drafter.actor.run.remote(lambda d: d.cache.records()))

        cached = [(start, tokens) for _, start, tokens in ray_get(llm.engine.actor.call.remote(records))]
        depth = 24  # max_tree_depth's default: the record starts that far before the first output token
        for prompt, out in zip(prompts, plain):
            ids = prompt["prompt_token_ids"]
            start = max(0, len(ids) - depth)
            assert (start, (ids + out)[start:]) in cached
        again = llm.generate(prompts[:1], sp, use_tqdm=False)[0]
        assert again.outputs[0].token_ids == plain[0]
        assert again.spec_stats.accepted_tokens >= MAX_TOKENS - 1 - 3  # all but one token per step of 9
        stats, spec_stats = llm.drafter_stats, llm.spec_stats
        twice = llm.generate(prompts[1], dataclasses.replace(sp, n=2), use_tqdm=False)[0]  # n through the actor
        assert [(c.index, c.token_ids) for c in twice.outputs] == [(0, plain[1]), (1, plain[1])]
    assert stats["name"] == "suffix" and stats["calls"] > 0 and stats["gen_tokens"] >= spec_stats.draft_tokens
    assert (stats["acc_tokens"], stats["acc_drafts"]) == (spec_stats.accepted_tokens,
                                                          spec_stats.accepted_per_position[0]), (stats, spec_stats)


def ray_get(ref):
    import ray

    return ray.get(ref, timeout=60)


# ---- suffix decoding's global tree shared across replicas ----------------------------------------------------------

def test_suffix_global_tree_is_shared_by_replicas_naming_one_pool():
    """Three replicas' suffix drafter actors: A's and B's name the pool "t-suffix", C's one of its own. What A
    finished, B drafts from its first output token on; C, with a pool of its own, has only its own text to draft
    from. The pools are suffix decoding's actors, not the n-gram drafter's of the same name. (Engines on Ray whose
    suffix drafter is an actor, with greedy output equal to the plain output: the test above.)"""
    import ray

    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=8, adaptive=False, is_public_pool=True)
    a, b, c = (_pool_drafter(pool, spec) for pool in ("t-suffix", "t-suffix", "t-suffix-other"))
    sp = SamplingParams(temperature=0.0)
    prompt, answer = list(range(100, 120)), list(range(500, 520))  # an answer only A's request ever saw
    try:
        assert a.propose([DraftRequest("a", prompt + answer[:1], 8, sp, num_prompt_tokens=20)])[0].token_ids == []
        a.observe_finished("a", prompt + answer)
        a.finish(["a"])
        a.sync_pool()  # A's record goes out (else with A's next proposal)
        for drafter in (b, c):
            drafter.sync_pool()  # what A published reaches B now (else with B's next proposal)
        ask = DraftRequest("b", prompt + answer[:1], 8, sp, num_prompt_tokens=20)  # the same prompt again
        assert b.propose([ask])[0].token_ids == answer[1:9]
        assert c.propose([ask])[0].token_ids == []
        names = {x["name"] for x in ray.util.list_named_actors(all_namespaces=True)}
        assert {"specray-suffix-pool:t-suffix", "specray-suffix-pool:t-suffix-other"} <= names
        assert "specray-ngram-pool:t-suffix" not in names  # the n-gram drafter's pools are other actors
    finally:
        for drafter in (a, b, c):
            drafter.shutdown()
        for name in ("t-suffix", "t-suffix-other"):
            ray.kill(ray.get_actor("specray-suffix-pool:" + name, namespace="specray"))
