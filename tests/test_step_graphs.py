"""Steps replayed from graphs (``enforce_eager=False``): on CPU the same padded static inputs run eagerly, which is
what a CUDA graph replays on a GPU. Outputs equal the eager engine's; padding rows touch no request's blocks; the
forward on the static inputs has no host sync (a capture would refuse one); what cannot be captured runs eagerly."""

import pytest
import torch

from specray import LLM
from specray.models.step_graphs import GRAPH_QUERY_MAX, GRAPH_ROWS_MAX
from specray_test_engine_runs import greedy, token_ids  # tests/engine_runs.py (registered by conftest)

PROMPTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox", "Hello world! How are you today?",
           "for i in range(10):", "Summarize the following text", "x"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def graphs_of(llm):
    return llm.engine.executor.worker.runner.graphs


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_gemma3_dir", "tiny_gemma2_dir"])
@pytest.mark.parametrize("spec", [None, NGRAM, {**NGRAM, "adaptive": True, "num_speculative_tokens": 5},
                                  {**NGRAM, "num_speculative_tokens": 6, "num_branches": 3}],
                         ids=["plain", "ngram", "ngram-adaptive", "ngram-tree"])
def test_graph_steps_equal_eager_steps(request, fixture, spec):
    """Batches of 6 (padded to 8) and of 1, block size 4 (contexts of many blocks, padded to powers of two, and
    requests' padding rows past their blocks), plain decoding and verify steps whose requests bring different
    draft counts (padded to the step's longest), and token trees (positions and ancestor masks as the graph's
    data, chains beside them); Gemma 3's sliding-window masks included. The graph engine caches
    prefixes: the second batch's request starts from the first's blocks, its table holding shared ones."""
    folder = str(request.getfixturevalue(fixture))
    kwargs = dict(max_model_len=256, block_size=4, speculative_config=spec)
    eager = LLM(model=folder, **kwargs)
    graphs = LLM(model=folder, enforce_eager=False, enable_prefix_caching=True, **kwargs)
    for prompts in (PROMPTS, PROMPTS[:1]):
        want = token_ids(eager.generate(prompts, greedy(), use_tqdm=False))
        assert token_ids(graphs.generate(prompts, greedy(), use_tqdm=False)) == want
    shapes = graphs_of(graphs).graphs
    assert any(b == 1 for b, _, _ in shapes), list(shapes)
    if spec is None:
        assert {q for _, q, _ in shapes} == {1} and any(b == 8 for b, _, _ in shapes), list(shapes)
    else:
        assert any(q > 1 for _, q, _ in shapes), list(shapes)
        assert graphs.spec_stats.accepted_tokens > 0
    assert graphs.engine.scheduler.block_manager.num_free_blocks == graphs.engine.scheduler.config.num_blocks
    assert graphs.engine.scheduler.prefix_cache_hits > 0


# lookahead decoding's wider window (W=5, N=4, G=5): 4 + 5 * 2 window nodes and 5 n-grams of 3: 29 nodes, a step of 30
# rows per request once its pool is full, past the eager path's short queries (SHORT_QUERY_MAX = 16)
WIDE = {"method": "lookahead", "max_window_size": 5, "max_ngram_size": 4, "max_verification_set_size": 5,
        "adaptive": False}


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_gemma3_dir"])
def test_wide_tree_steps_replay_graphs(request, fixture):
    """Verify steps of trees wider than the eager path's short queries (each attended on its own there) replay graphs
    of 32 rows per request, every row on the padded path: the eager engine's tokens, batches of 6 (padded to 8) and
    of 1, block size 4, Gemma 3's sliding windows included."""
    folder = str(request.getfixturevalue(fixture))
    kwargs = dict(max_model_len=256, block_size=4, speculative_config=WIDE)
    eager, graphs = LLM(model=folder, **kwargs), LLM(model=folder, enforce_eager=False, **kwargs)
    for prompts in (PROMPTS, PROMPTS[:1]):
        want = token_ids(eager.generate(prompts, greedy(24), use_tqdm=False))
        assert token_ids(graphs.generate(prompts, greedy(24), use_tqdm=False)) == want
    shapes = graphs_of(graphs).graphs
    assert {(8, 32), (1, 32)} <= {(b, q) for b, q, _ in shapes}, list(shapes)
    assert graphs.spec_stats.accepted_tokens > 0


def test_a_graph_steps_widest_shape():
    """A step replays a graph while each request brings at most GRAPH_QUERY_MAX tokens and the padded step at most
    GRAPH_ROWS_MAX rows; prefills (not a decode) never."""
    from specray.models.step_graphs import StepGraphs, StepShape

    graphs = StepGraphs(torch.nn.Identity(), 16, [], torch.device("cpu"), max_position=4096)
    assert graphs.shape([17, 3], [40, 0], decode=True) == StepShape(2, 32, 8)  # 40 + 32 slots: 5 blocks, to 8
    assert graphs.shape([GRAPH_QUERY_MAX], [0], decode=True) == StepShape(1, GRAPH_QUERY_MAX, GRAPH_QUERY_MAX // 16)
    assert graphs.shape([GRAPH_QUERY_MAX + 1], [0], decode=True) is None
    most = GRAPH_ROWS_MAX // 64
    assert graphs.shape([64] * most, [0] * most, decode=True).batch == most
    assert graphs.shape([64] * (most + 1), [0] * (most + 1), decode=True) is None
    assert graphs.shape([1] * (most + 1), [0] * (most + 1), decode=True).batch == 2 * most
    assert graphs.shape([4, 1], [0, 9], decode=False) is None


def test_a_padded_tree_step_keeps_its_rows_apart_from_the_padding():
    """A tree's rows padded to the graph's width: each real row sees what its ancestor mask says and never a
    padding row; a padding row sits at its slot index and sees what the last real row sees, and itself; a chain
    beside it keeps plain causal order; padding sequences come last."""
    from specray.models.step_graphs import _padded_tree

    anc = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two siblings
    positions, masks = _padded_tree([3, 2], [10, 20], [10, 11, 11, 20, 21], [anc, None], q=4, pads=1)
    assert positions == [10, 11, 11, 13, 20, 21, 22, 23, 0, 1, 2, 3]
    mask = masks[0]
    assert mask[:3, :3].equal(anc) and not mask[:3, 3].any()
    assert mask[3].tolist() == [True, False, True, True]
    assert masks[1:] == [None, None]


def test_padding_rows_write_only_scratch_blocks(tiny_llama_dir):
    """Padding sequences' K/V go to the scratch blocks past the block manager's: every block a request can own
    holds what the eager engine's holds after the same requests, and the scratch blocks were written."""
    kwargs = dict(model=str(tiny_llama_dir), max_model_len=128, block_size=4, num_kv_blocks=64)
    eager, llm = LLM(**kwargs), LLM(enforce_eager=False, **kwargs)
    runner = llm.engine.executor.worker.runner
    end = 64 + GRAPH_QUERY_MAX // 4  # the widest graph step's padding tokens in 4-slot blocks
    assert runner.graphs.scratch == list(range(64, end))
    for engine in (eager, llm):
        engine.generate(PROMPTS[:3], greedy(6), use_tqdm=False)  # 3 sequences padded to 4
    owned = torch.arange(64 * 4)
    want = eager.engine.executor.worker.runner.kv_cache.snapshot(owned)
    for got, ref in zip(runner.kv_cache.snapshot(owned), want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    (batch, q, _), graph = next(iter(runner.graphs.graphs.items()))
    assert (batch, q) == (4, 1) and len(runner.graphs.graphs) == 1
    assert all(64 * 4 <= s < end * 4 for s in graph.meta.slot_mapping[3:].tolist())  # the padding row's slot


def test_graph_forward_has_no_host_sync(tiny_llama_dir, no_host_sync):
    """A replay's inputs are loaded and the model runs on them with no host sync (a capture fails on one)."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=128, enforce_eager=False)
    llm.generate(PROMPTS[:2], greedy(3), use_tqdm=False)  # the shape (2, 1, 1) is set up
    graphs = graphs_of(llm)
    key, graph = next((k, g) for k, g in graphs.graphs.items() if k[:2] == (2, 1))
    from specray.models.attention import build_attention_metadata

    meta = build_attention_metadata([1, 1], [5, 6], [[0, 1], [2, 3]], 16, graphs.device, min_ctx_blocks=key[2],
                                    read_in_place=False)
    ids = torch.tensor([3, 4], device=graphs.device)
    with torch.inference_mode(), no_host_sync():
        graphs._load(graph, meta, ids)
        llm.engine.executor.worker.model(graph.input_ids, graph.meta)


@pytest.fixture(scope="module")
def tiny_unaligned_moe_dir(tmp_path_factory, make_tiny_model):
    """Qwen3-MoE with experts 30 wide: 120-byte fp32 rows, not the 16-byte multiple torch._grouped_mm needs."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_unaligned_moe"), "qwen3_moe", seed=4, num_hidden_layers=2,
                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=30)


@pytest.mark.parametrize("fixture,why", [("tiny_unaligned_moe_dir", "not a multiple of 16 bytes")])
def test_models_that_cannot_be_captured_run_eagerly(request, fixture, why, caplog):
    llm = LLM(model=str(request.getfixturevalue(fixture)), max_model_len=128, enforce_eager=False)
    assert graphs_of(llm) is None
    assert why in caplog.text and "runs eagerly" in caplog.text
    assert len(token_ids(llm.generate(PROMPTS[:2], greedy(4), use_tqdm=False))[0]) == 4


@pytest.fixture(scope="module")
def tiny_dense_deepseek_dir(tmp_path_factory, make_tiny_model):
    """DeepSeek-V3's latent attention (YaRN) with no experts (every layer dense): its graphs alone."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    return make_tiny_model(tmp_path_factory.mktemp("tiny_dense_deepseek"), "deepseek_v3", seed=6,
                           initializer_range=0.05, num_hidden_layers=2, first_k_dense_replace=2, kv_lora_rank=16,
                           q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                           num_key_value_heads=4, rope_parameters=yarn)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_latent_attention_steps_replay_graphs(tiny_dense_deepseek_dir, kv_cache_dtype, no_host_sync):
    """DeepSeek's latent attention replays graphs: every row of a graph step is short, so it attends in the absorbed
    form over the latent cache, as the eager steps do; plain decoding and verify steps (n-gram chains and a tree,
    lookahead's wide trees, which eager steps attend on their own, unabsorbed) give the eager engine's tokens (an FP8
    latent cache too), and the forward on a graph's static inputs has no host sync."""
    kwargs = dict(model=str(tiny_dense_deepseek_dir), max_model_len=256, block_size=4, kv_cache_dtype=kv_cache_dtype)
    for spec in (None, {**NGRAM, "num_speculative_tokens": 4, "num_branches": 2}, WIDE):
        eager = LLM(speculative_config=spec, **kwargs)
        llm = LLM(enforce_eager=False, speculative_config=spec, **kwargs)
        params = greedy(24 if spec is WIDE else 8)  # (lookahead's pool fills as it goes)
        want = token_ids(eager.generate(PROMPTS[:5], params, use_tqdm=False))
        assert token_ids(llm.generate(PROMPTS[:5], params, use_tqdm=False)) == want
        shapes = graphs_of(llm).graphs
        assert any(b == 8 for b, _, _ in shapes) and (spec is None or any(q > 1 for _, q, _ in shapes)), list(shapes)
        assert spec is not WIDE or any(q == 32 for _, q, _ in shapes), list(shapes)  # wide trees: absorbed too
    key, graph = next(iter(shapes.items()))
    with torch.inference_mode(), no_host_sync():
        llm.engine.executor.worker.model(graph.input_ids, graph.meta)


def test_graphs_by_default_on_a_gpu_only(tiny_llama_dir, monkeypatch):
    """enforce_eager=None (the default, as vLLM's False): graphs where they replay (a GPU, one rank), eager elsewhere
    (a CPU would only run the padded steps); asked for with False, they run on CPU and over several ranks too;
    True: never."""
    assert LLM(model=str(tiny_llama_dir), max_model_len=64, device="cpu").engine.executor.worker.runner.graphs is None
    from specray.workers.worker import Worker

    def decides(enforce_eager, device, world_size=1, stages=1):
        fake = type("W", (), {})()
        fake.config = type("C", (), {"enforce_eager": enforce_eager})()
        fake.device, fake.world_size = torch.device(device), world_size
        fake.pp = type("P", (), {"size": stages})()
        fake.model = torch.nn.Linear(1, 1)
        return Worker._use_graphs(fake)

    assert decides(None, "cuda", 1) and decides(False, "cuda") and decides(False, "cpu")
    assert not decides(None, "cpu") and not decides(True, "cuda") and not decides(None, "cuda", world_size=2)
    assert decides(False, "cuda", world_size=2)  # over several ranks when asked for
    assert not decides(False, "cuda", world_size=2, stages=2)  # never over pipeline stages


def test_enforce_eager_must_be_a_bool(tiny_llama_dir):
    with pytest.raises(ValueError, match="enforce_eager='no' must be true, false or None"):
        LLM(model=str(tiny_llama_dir), enforce_eager="no")


def test_a_draft_models_short_passes_replay_graphs(tiny_llama_dir, tiny_draft_dir):
    """``draft_model`` beside a graph target: the draft model's draft steps and short catch-ups replay graphs of
    their own (on CPU, its static inputs eagerly), with the same drafts and acceptance as eager passes; 6 requests
    padded to 8, block size 4, prefix caching on (its own cache's shared blocks); every block a request can own
    holds in the draft model's cache what the eager engine's holds (padding sequences wrote only its scratch
    blocks)."""
    spec = {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 3, "adaptive": False}
    runs = {}
    for eager in (True, False):
        llm = LLM(model=str(tiny_llama_dir), max_model_len=256, block_size=4, speculative_config=spec,
                  enforce_eager=eager, enable_prefix_caching=True)
        outs = [llm.generate(PROMPTS, greedy(), use_tqdm=False) for _ in range(2)]  # the second from cached blocks
        stats = llm.spec_stats
        runs[eager] = (llm, [token_ids(o) for o in outs], (stats.drafts, stats.draft_tokens, stats.accepted_tokens))
    (eager, want, want_stats), (llm, got, got_stats) = runs[True], runs[False]
    assert got == want and got_stats == want_stats and 0 < got_stats[2] < got_stats[1], (got_stats, want_stats)
    drafter = llm.engine.drafter
    assert eager.engine.drafter.graphs is None and drafter.graphs.graphs
    assert 1 in {q for _, q, _ in drafter.graphs.graphs} and any(q > 1 for _, q, _ in drafter.graphs.graphs), (
        list(drafter.graphs.graphs))  # draft steps, and catch-ups after verification
    assert any(b == 8 for b, _, _ in drafter.graphs.graphs)  # 6 requests padded to 8
    num_blocks = drafter.blocks.num_blocks
    assert drafter.graphs.scratch == list(range(num_blocks, num_blocks + len(drafter.graphs.scratch)))
    owned = torch.arange(num_blocks * 4)
    for a, b in zip(drafter.kv_cache.snapshot(owned), eager.engine.drafter.kv_cache.snapshot(owned)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
