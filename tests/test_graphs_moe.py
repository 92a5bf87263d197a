"""Mixture-of-experts steps replayed from graphs: the experts' sync-free grouped path (``torch._grouped_mm`` over the
stacked weights, inside ``sync_free_experts``) equals the per-expert loop of eager steps, for every router and
activation, on experts with no tokens, all pairs on one expert, a rank's slice of the experts (expert parallel) or of
their width, with biases; engines with ``enforce_eager=False`` give eager engines' greedy tokens with n-gram drafts
and replay their graphs; a graph's forward has no host sync; where the grouped path cannot run without one (or at
all), the refusal says why. On CPU ``torch._grouped_mm`` is torch's fallback: the grouped path has never run on a
GPU."""

from types import SimpleNamespace

import pytest
import torch

from specray import LLM
from specray.models import cpu_kernels
from specray.models.moe import SparseMoE, grouped_mm_blocker, sync_free_experts
from specray.parallel import TPGroup
from specray_test_engine_runs import greedy, refused_on_this_gpu, token_ids  # tests/engine_runs.py (registered by conftest)

H, I, E = 64, 32, 8
# one config per router (and GPT-OSS's biases and clamped SwiGLU, Llama-4's weight on the input)
CONFIGS = {
    "qwen3_moe": dict(num_experts=E, moe_intermediate_size=I, norm_topk_prob=True),
    "gpt_oss": dict(num_local_experts=E, intermediate_size=I, swiglu_limit=1.0),
    "llama4_text": dict(num_local_experts=E, intermediate_size=I),
    "deepseek_v3": dict(n_routed_experts=E, moe_intermediate_size=I, n_group=4, topk_group=2, n_shared_experts=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True),
    "deepseek_v2": dict(n_routed_experts=E, moe_intermediate_size=I, n_group=4, topk_group=1, n_shared_experts=1,
                        routed_scaling_factor=2.0, topk_method="group_limited_greedy"),
    # Nemotron-H's: DeepSeek-V3's router, gateless squared-ReLU experts and shared experts
    "nemotron_h": dict(n_routed_experts=E, moe_intermediate_size=I, n_group=4, topk_group=2,
                       moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5, norm_topk_prob=True,
                       mlp_hidden_act="relu2"),
}


def moe_block(model_type: str, tp: TPGroup = TPGroup(), expert_parallel: bool = False, seed: int = 0,
              top_k: int = 2, **overrides) -> SparseMoE:
    config = SimpleNamespace(model_type=model_type, hidden_act="silu", hidden_size=H, num_experts_per_tok=top_k,
                             **{**CONFIGS[model_type], **overrides})
    block = SparseMoE(config, tp, expert_parallel)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            if param.element_size() > 1:  # not the FP8 values (left as they are: only their refusal is tested)
                param.normal_(0.0, 0.5)
    return block.eval()


@pytest.fixture
def nan_past_the_groups(monkeypatch):
    """``torch._grouped_mm`` whose output rows past the last group (which the kernel leaves unwritten) hold NaN: so a
    path that lets them into the sum (a multiply by a 0/1 mask, say) fails here, as on a GPU it could."""
    real = torch._grouped_mm

    def grouped_mm(a, b, offs=None, **kwargs):
        out = real(a, b, offs=offs, **kwargs)
        past = torch.arange(out.shape[0], device=out.device) >= offs[-1]  # no host sync: the recorder watches
        return out.masked_fill(past[:, None], float("nan"))

    monkeypatch.setattr(torch, "_grouped_mm", grouped_mm)


def _routing(case: str, t: int, block: SparseMoE, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [t, k], expert ids [t, k]) over every expert of the model (a rank holds only some)."""
    k = block.top_k
    weights = torch.rand(t, k, generator=gen) + 0.1
    if case == "one":  # every pair on expert 5: the others get no rows
        return weights, torch.full((t, k), 5)
    if case == "few":  # experts 1 and 6 only
        return weights, torch.tensor([1, 6])[torch.randint(0, 2, (t, k), generator=gen)]
    return weights, torch.stack([torch.randperm(block.num_experts, generator=gen)[:k] for _ in range(t)])


@pytest.mark.parametrize("case", ["random", "one", "few"])
@pytest.mark.parametrize("split", ["whole", "ep-rank1", "width-rank1", "width-rank0"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "llama4_text", "nemotron_h"])
def test_grouped_experts_equal_the_loop(model_type, split, case, nan_past_the_groups):
    """The routed experts' share of one rank, grouped (graph steps) against the loop (eager steps), on the same
    routing (random; every pair on expert 5, top 1; only experts 1 and 6): the whole block, a rank of two holding
    experts 4..7 (expert parallel: the pairs of experts 0..3 add nothing) or half of every expert's width (rank 0
    adds GPT-OSS's down bias, rank 1 does not)."""
    tp = TPGroup() if split == "whole" else TPGroup(rank=int(split[-1]), size=2)
    block = moe_block(model_type, tp, expert_parallel=split.startswith("ep"), top_k=1 if case == "one" else 2)
    gen = torch.Generator().manual_seed(1)
    for t in (1, 7, 16):
        x = torch.randn(t, H, generator=gen)
        weights, ids = _routing(case, t, block, gen)
        with torch.no_grad():
            want = block._experts_looped(x, weights, ids)
            got = block._experts_grouped(x, weights, ids)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert want.abs().sum() > 0  # 16 tokens: some on this rank's experts


def test_pairs_of_another_ranks_experts_add_nothing(nan_past_the_groups):
    """Expert parallel, rank 1 of 2 (experts 4..7): tokens routed only to experts 0..3 get zeros from this rank,
    however the kernel left their rows."""
    block = moe_block("qwen3_moe", TPGroup(rank=1, size=2), expert_parallel=True)
    x, weights = torch.randn(5, H), torch.rand(5, 2)
    ids = torch.tensor([[0, 1], [2, 3], [0, 4], [3, 1], [7, 2]])
    with torch.no_grad():
        got = block._experts_grouped(x, weights, ids)
    assert got[[0, 1, 3]].eq(0).all() and got[[2, 4]].abs().sum(dim=-1).gt(0).all()
    torch.testing.assert_close(got, block._experts_looped(x, weights, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_the_whole_block_equals_its_eager_forward(model_type, nan_past_the_groups, no_host_sync):
    """The block's forward (its router, the experts, a shared expert where the family has one) inside
    ``sync_free_experts`` equals the eager forward, with no host sync; the eager one reads the group sizes back
    (the sync a capture refuses). Under inference mode, as the runner's steps run (ops such as repeat_interleave
    reach the sync check undecomposed there)."""
    block = moe_block(model_type)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = block(x)
        with sync_free_experts(), no_host_sync():
            got = block(x)
        with pytest.raises(AssertionError, match="host sync"), no_host_sync():
            block(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _grouped_kernel_here() -> bool:
    return torch.cuda.is_available() and grouped_mm_blocker(torch.device("cuda"), torch.bfloat16, E) is None


@pytest.mark.skipif(not _grouped_kernel_here(), reason="needs a GPU with torch._grouped_mm's bf16 kernel (9.x, 10.x)")
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_the_grouped_path_is_captured_and_replayed_on_a_gpu(model_type):
    """On a GPU with the grouped kernel (passed on an H200, 2026-11-27), in bf16: the block's
    forward inside ``sync_free_experts`` is captured in a CUDA graph (a host sync would fail the capture), and
    replays on new inputs to what the loop gives them."""
    block = moe_block(model_type).to("cuda", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(3)
    static = torch.randn(16, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    stream = torch.cuda.Stream()
    with torch.no_grad(), sync_free_experts():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture
            block(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block(static)
    for _ in range(3):
        static.copy_(torch.randn(16, H, device="cuda", dtype=torch.bfloat16, generator=gen))
        graph.replay()
        with torch.no_grad():
            want = block._experts_looped(static, *block.route(static))  # these families: no shared expert
        torch.testing.assert_close(out, want, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not _grouped_kernel_here(), reason="needs a GPU with torch._grouped_mm's bf16 kernel (9.x, 10.x)")
def test_eager_steps_take_the_grouped_path_on_a_gpu(no_host_sync):
    """Where the grouped kernel runs with no host sync, eager steps take it too (a prefill's experts in a few
    launches): a block's forward outside ``sync_free_experts`` syncs with nothing and gives the loop's sums; in
    float32 (the kernel's fallback would sync) eager steps keep the loop."""
    block = moe_block("qwen3_moe").to("cuda", torch.bfloat16)
    x = torch.randn(40, H, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(4))
    assert block.grouped_eagerly()
    with torch.no_grad():
        with no_host_sync():
            out = block(x)
        want = block._experts_looped(x, *block.route(x))
    torch.testing.assert_close(out, want, atol=3e-2, rtol=3e-2)
    assert not moe_block("qwen3_moe").to("cuda").grouped_eagerly()


def test_eager_steps_keep_the_loop_on_a_cpu(no_host_sync):
    """On a CPU eager steps keep the loop (only the experts with tokens run; torch's grouped matmul there is a loop
    itself), though the grouped path could run: a block's forward reads the group sizes back, once."""
    block = moe_block("qwen3_moe")
    assert block.graph_blocker() is None and not block.grouped_eagerly()
    with torch.no_grad(), pytest.raises(AssertionError, match="host sync"), no_host_sync():
        block(torch.randn(6, H))


# ---- engines --------------------------------------------------------------------------------------------------------

PROMPTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox", "Hello world! How are you today?",
           "for i in range(10):", "x"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


@pytest.mark.parametrize("fixture", ["tiny_qwen2_moe_dir", "tiny_glm4_moe_dir", "tiny_llama4_dir",
                                     "tiny_deepseek_dir"])
def test_moe_graph_steps_equal_eager_steps(request, fixture):
    """Greedy tokens with n-gram drafts (verify steps of several rows, padded to the step's longest) for 5 requests
    (padded to 8) and for one, graphs against eager: Qwen2-MoE's gated shared expert, GLM-4.5's grouped router and
    shared experts, Llama-4's top-1 sigmoid router weighting the experts' input (dense layers between), DeepSeek-V3's
    (latent attention); the graphs were used (their shapes recorded, verify steps among them)."""
    folder = str(request.getfixturevalue(fixture))
    kwargs = dict(max_model_len=128, block_size=4, speculative_config=NGRAM)
    eager = LLM(model=folder, **kwargs)
    graphs = LLM(model=folder, enforce_eager=False, **kwargs)
    for prompts in (PROMPTS, PROMPTS[:1]):
        want = token_ids(eager.generate(prompts, greedy(12), use_tqdm=False))
        assert token_ids(graphs.generate(prompts, greedy(12), use_tqdm=False)) == want
    if refused_on_this_gpu(graphs):
        return
    shapes = list(graphs.engine.executor.worker.runner.graphs.graphs)
    assert any(q > 1 for _, q, _ in shapes) and any(b == 8 for b, _, _ in shapes), shapes
    assert graphs.spec_stats.accepted_tokens > 0


def test_an_mtp_head_with_experts_replays_graphs(tiny_glm4_moe_dir, tmp_path):
    """GLM-4.5's MTP layer (experts and a shared one, as the target's) drafting chains: with graphs, the target's
    steps and the head's passes replay them, with the eager engine's tokens, drafts and acceptance."""
    import specray_test_draft_heads as draft_heads  # tests/draft_heads.py (registered by conftest)

    folder = str(draft_heads.write_deepseek_mtp(tmp_path / "mtp", tiny_glm4_moe_dir, bias_std=0.1))
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
    runs = {}
    for eager in (True, False):
        llm = LLM(folder, max_model_len=128, block_size=4, speculative_config=spec, enforce_eager=eager)
        outs = token_ids(llm.generate(PROMPTS[:3], greedy(10), use_tqdm=False))
        runs[eager] = outs, (llm.spec_stats.draft_tokens, llm.spec_stats.accepted_tokens)
    assert runs[False] == runs[True] and runs[True][1][1] > 0, runs
    if refused_on_this_gpu(llm):
        return
    head_graphs = llm.engine.executor.worker.runner.drafter.graphs
    assert llm.engine.executor.worker.runner.graphs.graphs and head_graphs is not None and head_graphs.graphs


def test_moe_graph_forward_has_no_host_sync(tiny_qwen3_moe_dir, no_host_sync):
    """A replay's inputs loaded and the graph's forward run on them (Qwen3-MoE: sparse layers beside a dense one)
    with no host sync; the same forward outside the graphs' mode (the loop of eager steps) syncs."""
    llm = LLM(model=str(tiny_qwen3_moe_dir), max_model_len=128, enforce_eager=False)
    if refused_on_this_gpu(llm):
        pytest.skip("this GPU's grouped matmul would sync (in this dtype): the model runs eagerly")
    llm.generate(PROMPTS[:2], greedy(3), use_tqdm=False)  # the shape (2, 1, 1) is set up
    graphs = llm.engine.executor.worker.runner.graphs
    key, graph = next((k, g) for k, g in graphs.graphs.items() if k[:2] == (2, 1))
    from specray.models.attention import build_attention_metadata

    meta = build_attention_metadata([1, 1], [5, 6], [[0, 1], [2, 3]], 16, graphs.device, min_ctx_blocks=key[2],
                                    read_in_place=False)
    with torch.inference_mode():
        with no_host_sync():
            graphs._load(graph, meta, torch.tensor([3, 4], device=graphs.device))
            graphs._step(graph.input_ids, graph.meta, graph.inputs)
        with pytest.raises(AssertionError, match="host sync"), no_host_sync():
            graphs._forward(graph.input_ids, graph.meta, graph.inputs)


# ---- refusals -------------------------------------------------------------------------------------------------------

def test_where_the_grouped_matmul_would_sync_graphs_are_refused():
    """torch._grouped_mm's CUTLASS kernel (bf16 on compute capability 9.x or 10.x) reads the offsets on the device;
    every other CUDA case takes the fallback that copies them to the host."""
    cuda = torch.device("cuda")
    assert grouped_mm_blocker(torch.device("cpu"), torch.float32, E) is None
    for capability in ((9, 0), (10, 0)):
        assert grouped_mm_blocker(cuda, torch.bfloat16, E, capability) is None
    for dtype, capability in ((torch.float32, (9, 0)), (torch.float16, (9, 0)), (torch.bfloat16, (8, 0)),
                              (torch.bfloat16, (12, 0))):
        why = grouped_mm_blocker(cuda, dtype, E, capability)
        assert "copies the experts' group offsets to the host" in why and str(dtype) in why, why
    assert "at most 1023" in grouped_mm_blocker(cuda, torch.bfloat16, 1024, (9, 0))


def test_blocks_the_grouped_path_cannot_run_say_why(monkeypatch):
    """An expert width or hidden size whose rows are not a whole number of 16 bytes (the grouped matmul's stride
    rule), and experts kept in FP8 (dequantized expert by expert): refused with the reason; aligned ones pass."""
    assert moe_block("qwen3_moe").graph_blocker() is None
    assert "expert width on this rank 30" in moe_block("qwen3_moe", moe_intermediate_size=30).graph_blocker()
    # a split by width over 2 ranks halves the width: 36 fits, 18 per rank does not
    assert moe_block("qwen3_moe", moe_intermediate_size=36).graph_blocker() is None
    assert "rank 18" in moe_block("qwen3_moe", TPGroup(rank=0, size=2), moe_intermediate_size=36).graph_blocker()
    monkeypatch.setattr(cpu_kernels, "FP8_EXPERTS", True)
    fp8 = moe_block("deepseek_v3", quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
    assert fp8.fp8_block == (16, 16) and "kept in FP8" in fp8.graph_blocker()
