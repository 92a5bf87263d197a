"""A seeded random workload against one engine per drafter (and one with two tensor-parallel Ray ranks): requests
arrive while others run, with mixed sampling settings, stop strings, per-request draft caps, aborts of running
requests, rejected bad requests, a KV pool small enough to preempt and chunked prefill. Afterwards: no KV block
leaked, and every finished greedy request (and every seeded sampled one, without speculation or with drafts that
carry no q, verified by coupling) has the tokens the plain engine gives it alone."""

import random
from pathlib import Path

import pytest

from specray import LLM, SamplingParams
from specray.config import EngineArgs
from specray.engine.builder import build_engine
from specray.engine.llm_engine import LLMEngine
from specray.models.step_graphs import StepShape


import specray_test_draft_heads as draft_heads  # noqa: E402  tests/draft_heads.py (tests/conftest.py registers it)

WORDS = ["def", "add", "(a, b)", ":", "\n", "return", "a", "+", "b", "the", "quick", "fox", "Hello", "world", "!"]
STEPS = 120
HEADS = ("eagle", "eagle3", "mtp", "medusa", "redrafter")  # drafters that run in the target's worker, from its hidden states
DRAIN_STEPS = 2000
# drafters whose drafts carry no q: verified by coupling, a seeded sampled request's output is plain decoding's
COUPLED = ("ngram", "ngram_mod", "suffix", "lookahead")


def random_prompt(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(1, 40)))


# structured outputs for some requests: masks, grammar-cut drafts and forced tokens under preemption and aborts
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "integer"}},
          "required": ["a", "b"], "additionalProperties": False}
STRUCTURED = [None] * 6 + [{"regex": r"(ab|cd|the |fox){1,8}x"}, {"choice": ["the quick fox", "hello world", "a"]},
                           {"json": SCHEMA, "disable_any_whitespace": True}]


def random_params(rng: random.Random) -> SamplingParams:
    greedy = rng.random() < 0.6
    return SamplingParams(temperature=0.0 if greedy else rng.choice([0.7, 1.0]), top_k=rng.choice([0, 5]),
                          top_p=rng.choice([1.0, 0.9]), max_tokens=rng.randint(1, 30), seed=rng.randint(0, 99),
                          ignore_eos=rng.random() < 0.7, stop=rng.choice([None, ["fox"], ["\n"]]),
                          num_speculative_tokens=rng.choice([None, None, 0, 2]),
                          structured_outputs=rng.choice(STRUCTURED))


def comparable(got, want, max_tokens: int) -> tuple[list[int], list[int]]:
    """Both outputs' tokens, the longer cut to the shorter where a run ended early because its request outgrew the
    whole KV pool (finish_reason "length" before ``max_tokens``)."""
    a, b = list(got.token_ids), list(want.token_ids)
    for out, other in ((got, b), (want, a)):
        cut = len(out.token_ids)
        if out.finish_reason == "length" and cut < max_tokens:
            del other[cut:]
    return a, b


# with prefix caching: prompts of an even number of tokens get it in front (shared blocks, drawn from no rng)
PREAMBLE = "Answer the question below in one short line, and do not repeat the question itself. "


def run_workload(engine: LLMEngine, rng: random.Random) -> tuple[dict, set]:
    """Add, step and abort at random; the finished outputs and the aborted ids. What arrives when (and the bad
    requests among it) is drawn from a generator of its own, the same for every case, so that every engine sees the
    same traffic and their reference outputs are shared (``REFERENCES``); ``rng`` picks what is aborted."""
    arrivals = random.Random(ARRIVALS_SEED)
    tok = engine.tokenizer
    preamble = tok.encode(PREAMBLE) if engine.scheduler.config.enable_prefix_caching else None
    pool_slots = engine.scheduler.block_manager.num_blocks * engine.scheduler.block_manager.block_size
    finished, requests, aborted = {}, {}, set()
    for step in range(STEPS):
        if arrivals.random() < 0.35:
            if arrivals.random() < 0.1:  # a bad request in the middle of the traffic: refused, nothing else harmed
                with pytest.raises(ValueError):
                    engine.add_request(tok.encode("Hello"), SamplingParams(temperature=-1.0))
                with pytest.raises(ValueError, match="regex"):  # a spec that does not compile
                    engine.add_request(tok.encode("Hello"), SamplingParams(structured_outputs={"regex": "(a"}))
            prompt = tok.encode(random_prompt(arrivals))
            if preamble is not None and len(prompt) % 2 == 0:
                prompt = preamble + prompt
            params = random_params(arrivals)
            if len(prompt) > pool_slots:  # could never fit: refused up front, nothing else harmed
                with pytest.raises(ValueError, match="KV cache holds only"):
                    engine.add_request(prompt, params)
            else:
                requests[engine.add_request(prompt, params)] = (prompt, params)
        running = sorted(r.req_id for r in engine.scheduler.running)
        if running and (rng.random() < 0.04 or (step >= STEPS // 2 and not aborted)):  # at least one abort
            victim = rng.choice(running)  # a running request holds blocks: aborting it must free them
            engine.abort_request([victim])
            aborted.add(victim)
        for out in engine.step() if engine.has_unfinished_requests() else []:
            if out.finished:
                finished[out.request_id] = out
    for _ in range(DRAIN_STEPS):  # bounded: a leaked pool would leave requests waiting forever
        if not engine.has_unfinished_requests():
            break
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert not engine.has_unfinished_requests(), f"requests still unfinished after {DRAIN_STEPS} more steps"
    return {r: (requests[r], finished[r]) for r in finished if r not in aborted}, aborted


@pytest.fixture(scope="module")
def alone(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), max_model_len=256)


NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
CASES = {
    "plain": {},
    # long_prefill_token_threshold: prompts prefilled in chunks of at most 12 tokens beside other requests
    "ngram": {"speculative_config": NGRAM, "long_prefill_token_threshold": 12},
    "ngram-public-pool": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                 "is_public_pool": True, "adaptive": False}},
    "ngram-tree": {"speculative_config": {**NGRAM, "num_speculative_tokens": 8, "num_branches": 3}},
    "suffix": {"speculative_config": {"method": "suffix", "num_speculative_tokens": 8}},
    "ngram_mod": {"speculative_config": {"method": "ngram_mod", "num_speculative_tokens": 6, "ngram_size_n": 3,
                                         "draft_min": 1, "draft_max": 8, "pool_size": 4096}},
    "draft_model": {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}},
    # node tokens back from the runner, trees cut by the scheduler (budget, free slots, max_tokens), per-request caps
    "lookahead": {"speculative_config": {"method": "lookahead", "num_speculative_tokens": 15}},
    # hidden-state heads drafting inside the target's worker (tests/draft_heads.py: heads often right): reserved
    # draft slots, drafts cut by the scheduler and the policy, per-request caps, the head's K/V across preemption
    "eagle": {"speculative_config": {"method": "eagle", "num_speculative_tokens": 3}},
    "eagle3": {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 4},
               "long_prefill_token_threshold": 12},
    "mtp3": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 3, "num_nextn_predict_layers": 3}},
    # token trees from one MTP module (EAGLE-2's) and an EAGLE-3 head's static tree (vLLM's speculative_token_tree),
    # the latter's steps and the head's passes (a tree's levels among them) from graphs
    "mtp-tree": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 4, "use_dynamic_tree": True,
                                        "dynamic_tree_max_topK": 2, "dynamic_tree_depth": 3}},
    "eagle3-static-graphs": {"speculative_config": {"method": "eagle3", "speculative_token_tree":
                                                    "[(0,), (1,), (0, 0), (0, 2), (0, 0, 0)]"},
                             "enforce_eager": False},
    # Medusa's token trees (no head K/V), and a head combined with a lookup drafter (either proposal per step)
    "medusa": {"speculative_config": {"method": "medusa", "num_speculative_tokens": 6}},
    "redrafter": {"speculative_config": {"method": "redrafter", "num_speculative_tokens": 6, "redrafter_num_beams": 3,
                                         "redrafter_draft_len_per_beam": 3}},
    "eagle3+suffix": {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 3,
                                             "combine_with": {"method": "suffix", "num_speculative_tokens": 6}}},
    # prefix caching (half the prompts share a preamble): requests start from cached blocks or wait for blocks a
    # running request is computing, shared blocks survive aborts and preemption, eviction under a full pool
    "ngram-prefix-cache": {"speculative_config": NGRAM, "long_prefill_token_threshold": 12,
                           "enable_prefix_caching": True},
    # (a fixed draft count: what finishes inside the workload's steps does not follow this machine's load)
    "eagle3-prefix-cache": {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 4,
                                                   "adaptive": False}, "enable_prefix_caching": True},
    # async scheduling: each step's outputs built while the next step runs, a stop string finishing its request one
    # step late (that step's tokens dropped) beside aborts, preemption and cached blocks
    "ngram-prefix-cache-async": {"speculative_config": NGRAM, "long_prefill_token_threshold": 12,
                                 "enable_prefix_caching": True, "async_scheduling": True},
    "draft_model-async": {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 3,
                                                 "adaptive": False}, "async_scheduling": True},
    "eagle3-async": {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 4},
                     "async_scheduling": True},
    # steps from graphs (on CPU their padded static inputs, eagerly): trees' positions and masks as the graphs' data,
    # a head's passes and a draft model's from graphs of their own, under preemption, aborts and chunked prefill
    "ngram-tree-graphs": {"speculative_config": {**NGRAM, "num_speculative_tokens": 8, "num_branches": 3},
                          "enforce_eager": False},
    "eagle3-graphs-async": {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 4},
                            "enforce_eager": False, "async_scheduling": True},
    "draft_model-graphs": {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 3,
                                                  "adaptive": False}, "enforce_eager": False,
                           "enable_prefix_caching": True},
    # two tensor-parallel ranks as Ray actors (gloo) and the drafter as its own actor: every rewind and
    # preemption reaches both shards' caches
    # a mixture of experts (tests/conftest.py's tiny Qwen3-MoE: tokens routed to experts, a host sync per layer)
    "ngram-moe": {"model_fixture": "tiny_qwen3_moe_dir", "speculative_config": {**NGRAM}},
    # a hybrid model (Qwen3.5's linear attention: a recurrent state per request) with prefix caching: requests resume
    # only where a state was kept (a prompt's last whole block, or where it parted from the preamble's blocks), the
    # kept states' slots given out and forgotten under preemption and aborts
    "ngram-hybrid-prefix-cache": {"model_fixture": "tiny_qwen3_5_dir", "speculative_config": {**NGRAM},
                                  "enable_prefix_caching": True},
    # the same hybrid with its own MTP layer (tests/draft_heads.py's, often right) growing EAGLE-2 trees: each node's
    # recurrent state from its parent's, the kept path's pending inputs moved, through aborts and preemption; its
    # verify steps from graphs of the recurrence's tree form, the head's tree levels from graphs of its own
    "mtp-tree-hybrid-graphs": {"model_fixture": "tiny_qwen3_5_dir",
                               "speculative_config": {"method": "mtp", "num_speculative_tokens": 4,
                                                      "use_dynamic_tree": True, "dynamic_tree_max_topK": 2,
                                                      "dynamic_tree_depth": 3},
                               "enforce_eager": False},
    "ngram-tree-tp2-ray": {"speculative_config": {**NGRAM, "num_branches": 3}, "tensor_parallel_size": 2, "distributed_executor_backend": "ray",
                      "ray_placement": {"worker_num_cpus": 0.5, "drafter_num_cpus": 0.25, "engine_num_cpus": 0.1}},
    # an EAGLE-3 head split over the two ranks, growing EAGLE-2 trees (sampled ones drawn from q): both shares of
    # its K/V through preemption, rewinds and aborts, every step's verdict sent from rank 0
    "eagle3-tree-tp2-ray": {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 4,
                                                   "use_dynamic_tree": True, "dynamic_tree_max_topK": 2,
                                                   "dynamic_tree_depth": 3},
                            "tensor_parallel_size": 2, "distributed_executor_backend": "ray",
                            "ray_placement": {"worker_num_cpus": 0.5, "drafter_num_cpus": 0.25, "engine_num_cpus": 0.1}},
    # steps kept in flight two at a time, each over its own cohort of requests (pipeline stages' batch queue): on
    # one local rank here, whose steps run in order in a thread of their own as a pipeline's ranks do; requests
    # in flight neither drafted for, scheduled, preempted nor re-admitted, through aborts, preemption, grammars
    "ngram-pipelined": {"speculative_config": NGRAM, "pipeline_depth": 2, "long_prefill_token_threshold": 12},
    "draft_model-pipelined": {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 3,
                                                     "adaptive": False}, "pipeline_depth": 2},
    "lookahead-pipelined": {"speculative_config": {"method": "lookahead", "num_speculative_tokens": 15},
                            "pipeline_depth": 2},
    "eagle3-tree-pipelined": {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 4,
                                                     "use_dynamic_tree": True, "dynamic_tree_max_topK": 2,
                                                     "dynamic_tree_depth": 3}, "pipeline_depth": 2},
    "mtp3-pipelined": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 3,
                                              "num_nextn_predict_layers": 3}, "pipeline_depth": 2},
    # two pipeline stages as Ray actors: the same over a real pipeline, each stage's rank computing one cohort's
    # step while the other computes the other's
    "eagle3-pp2-ray": {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 4},
                       "pipeline_parallel_size": 2,
                       "ray_placement": {"worker_num_cpus": 0.5, "drafter_num_cpus": 0.25, "engine_num_cpus": 0.1}},
}


@pytest.mark.parametrize("name", list(CASES))
def test_random_workload_keeps_outputs_and_blocks(request, tiny_llama_dir, tiny_draft_dir, alone, tmp_path, name):
    kwargs = {**CASES[name]}
    fixture = kwargs.pop("model_fixture", None)
    model = str(tiny_llama_dir if fixture is None else request.getfixturevalue(fixture))
    if fixture is not None:
        alone = LLM(model=model, max_model_len=256)  # the same model's plain output, one rank
    spec = kwargs.get("speculative_config")
    if spec is not None and spec["method"] == "draft_model":
        kwargs["speculative_config"] = {**spec, "model": str(tiny_draft_dir)}
    if spec is not None and spec["method"] in HEADS:
        if spec["method"] == "medusa":
            head = str(draft_heads.write_medusa_heads(tmp_path / "head", tiny_llama_dir, accepting=True))
        elif spec["method"] == "redrafter":
            head = str(draft_heads.write_redrafter(tmp_path / "head", tiny_llama_dir, accepting=True))
        elif fixture is not None:  # a hybrid's own MTP layer, in a copy of its folder
            head = str(draft_heads.write_qwen_mtp(tmp_path / "head", Path(model)))
        else:
            head = str(draft_heads.write_accepting_head(tmp_path / "head", spec["method"], tiny_llama_dir,
                                                        num_modules=spec.get("num_nextn_predict_layers", 1)))
        if spec["method"] == "mtp":
            model = head  # the target's folder with its MTP layer added
        else:
            kwargs["speculative_config"] = {**spec, "model": head}
    if kwargs.get("distributed_executor_backend") == "ray" or kwargs.get("pipeline_parallel_size", 1) > 1:
        request.getfixturevalue("ray_cluster")
    depth = kwargs.pop("pipeline_depth", None)
    engine = build_engine(EngineArgs(
        model=model, max_model_len=256, num_kv_blocks=14, block_size=8, max_num_seqs=4,
        max_num_batched_tokens=48, **kwargs))
    if depth is not None:
        engine.pipeline_depth = depth
    try:
        exact_sampling = spec is None or (spec["method"] in COUPLED and "combine_with" not in spec)
        check_workload(engine, alone, random.Random(name), exact_sampling)
        if kwargs.get("enable_prefix_caching"):
            assert engine.scheduler.prefix_cache_hits > 0
        if spec is not None and spec["method"] in HEADS:  # the heads are often right: the accepted path ran
            assert engine.spec_stats.accepted_tokens > 0, engine.spec_stats
        if kwargs.get("enforce_eager") is False:  # steps really ran from graphs, the verify steps' among them
            runner = engine.executor.worker.runner
            shapes = [key if isinstance(key, StepShape) else key[0] for key in runner.graphs.graphs]  # (and tags)
            assert any(shape.query_len > 1 for shape in shapes)
            head = getattr(runner.drafter, "graphs", None)  # a head's passes too
            assert head is None or head.graphs
    finally:
        engine.shutdown()


ARRIVALS_SEED = 0
REFERENCES: dict = {}  # (model, prompt, params) -> the plain engine's output of that request alone


def alone_output(alone: LLM, prompt: list[int], params: SamplingParams):
    key = (alone.engine_args.model, tuple(prompt), repr(params))
    if key not in REFERENCES:
        REFERENCES[key] = alone.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    return REFERENCES[key]


def check_workload(engine: LLMEngine, alone: LLM, rng: random.Random, exact_sampling: bool) -> None:
    """``exact_sampling``: seeded sampled requests must give plain decoding's tokens too (else only greedy ones)."""
    blocks = engine.scheduler.block_manager
    start = blocks.num_free_blocks
    done, aborted = run_workload(engine, rng)
    assert blocks.num_free_blocks == start
    # the workload really ran: enough requests finished, something was aborted, the pool ran out
    assert len(done) >= 15 and aborted and engine.scheduler.num_preemptions, (len(done), aborted)
    checked = sampled = 0
    for (prompt, params), out in done.values():
        if params.temperature > 0 and not exact_sampling:
            continue  # drafts with q, by rejection sampling: the same distribution, not the same tokens
        want = alone_output(alone, prompt, params)
        got, expected = comparable(out.outputs[0], want, params.max_tokens)
        assert got == expected, (prompt, params)
        checked += 1
        sampled += params.temperature > 0
    assert checked >= 8  # 13-45 in 32 seeded runs of the plain and ngram workloads
    assert sampled > 0 or not exact_sampling
