"""Hybrid linear-attention models (Qwen3.5: Gated DeltaNet beside gated full attention) replaying decode and verify
steps from graphs (``enforce_eager=False``; on CPU the padded static inputs run eagerly, as a CUDA graph would replay
them): the same tokens as eager steps, plain and with n-gram drafts (replays of 0..3 accepted drafts, sequences of
different draft counts padded to one row count, batches padded with sequences in the scratch state slot), seeded
sampling too; no host sync in the forward on a graph's static inputs; a failed graph step leaves the others' states
as they were."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specray.models.step_graphs import StepGraphs
from specray_test_hybrid_models import (  # tests/hybrid_models.py
    NGRAM, PROMPT_IDS, branched, greedy, recorded_batches, save, tree_graphs)

PROMPTS = PROMPT_IDS[:3]  # three requests: every graph step's batch padded to 4
BINARY = [-1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]  # a token tree's parents: two children per draft


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> Path:
    return save(tmp_path_factory.mktemp("qwen3_5_graphs"), "qwen3_5", 1)  # seed 1: replays of 0..3


def engine(folder: Path, eager: bool, spec=None):
    from specray import LLM

    return LLM(model=str(folder), max_model_len=128, enforce_eager=eager, speculative_config=spec)


def outputs(llm, params, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


@pytest.fixture(scope="module")
def eager_plain(hybrid_dir):
    return engine(hybrid_dir, True)


@pytest.fixture(scope="module")
def graph_ngram(hybrid_dir):
    return engine(hybrid_dir, False, NGRAM)


def recorded_tables(monkeypatch) -> list[tuple[tuple[int, int, int], torch.Tensor]]:
    """Every graph step's (shape, recurrent table [6, B]) from here on."""
    seen, run = [], StepGraphs.run

    def recording(self, shape, *args, recurrent=None, **kwargs):
        seen.append((tuple(shape), recurrent.table.clone()))
        return run(self, shape, *args, recurrent=recurrent, **kwargs)

    monkeypatch.setattr(StepGraphs, "run", recording)
    return seen


def test_states_kept_at_device_positions_equal_the_host_ones():
    """``keep_at`` as a device tensor (a graph step's) picks the same states as host lists, in the scan and across
    chunks of the chunked form; -1 keeps the state given (a padding sequence)."""
    from specray.models.gated_deltanet import chunked_gated_delta, gated_delta_scan, l2norm

    torch.manual_seed(1)
    b, length, h, dk, dv = 3, 21, 2, 8, 5
    q, k = l2norm(torch.randn(b, length, h, dk)), l2norm(torch.randn(b, length, h, dk))
    v, s0 = torch.randn(b, length, h, dv), torch.randn(b, h, dk, dv)
    g, beta = -torch.rand(b, length, h), torch.rand(b, length, h)
    _, want = gated_delta_scan(q, k, v, g, beta, s0, [6, 17, 0])
    for form in (gated_delta_scan, lambda *a: chunked_gated_delta(*a, chunk=8)):
        _, got = form(q, k, v, g, beta, s0, torch.tensor([6, 17, -1]))
        torch.testing.assert_close(got[:2], want[:2], atol=1e-5, rtol=1e-5)
        assert got[2].equal(s0[2]) and not want[2].equal(s0[2])


@pytest.mark.parametrize("trees", [False, True, "grouped"], ids=["chains", "trees", "trees-one-by-one"])
@pytest.mark.parametrize("q_rows", [4, 16], ids=["scan", "chunked"])
def test_the_fixed_shape_recurrence_equals_the_eager_one(q_rows, trees, monkeypatch):
    """The layer's graph form against its eager form on random states and inputs: sequences fresh (over a slot
    holding another request's old state), replaying 0..min(P, Q - 1) drafts (the runner widens a step's rows past
    its replays), bringing 1..Q rows with drafts among them, padded to B = 4 with a padding sequence: the same
    outputs for every real row, the same committed matrix, conv history, pending inputs and gates in each target
    slot, every other slot but the scratch one untouched. ``trees``: the drafts form token trees (each row's conv
    window and state from its own path: the tree form of the graph's recurrence), one sequence a chain beside them;
    "grouped": the tree form's sequences one at a time (as a batch whose rows' states outgrow TREE_STATE_BYTES)."""
    import types

    from specray.models import gated_deltanet
    from specray.models.gated_deltanet import GatedDeltaNet, RecurrentBatch
    from specray.models.kv_cache import RecurrentState
    from specray.parallel import TPGroup

    if trees == "grouped":
        monkeypatch.setattr(gated_deltanet, "TREE_STATE_BYTES", 1)

    cfg = types.SimpleNamespace(hidden_act="silu", linear_num_key_heads=2, linear_num_value_heads=4,
                                linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
                                hidden_size=32, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    layer, pend, width, scratch = GatedDeltaNet(cfg, TPGroup.single()), 5, 3, 8
    with torch.no_grad():
        layer.conv1d.weight.normal_(0.0, 0.5)
    state = RecurrentState([layer.state_spec], scratch + 1, pend, torch.float32, "cpu")
    st = state.layers[0]
    st.inputs.normal_(), st.matrix.normal_(), st.gates[:, :, 0].uniform_(-2.0, 0.0), st.gates[:, :, 1].uniform_()
    layer.bind_state(st)
    # (slot read, fresh, replays, real rows, drafts): each target is the slot's pair
    seqs = [(0, False, min(pend, q_rows - 1), 2, 1), (2, True, 0, q_rows, min(pend, q_rows - 1)),
            (6, False, 2, q_rows - 1, 0)]
    slots, fresh, replay, lens, drafts = (list(col) for col in zip(*seqs))
    parents = [BINARY[: k] if trees and k else None for k in drafts]
    batch = RecurrentBatch(slots, fresh, replay, drafts, [s + 1 for s in slots], parents=parents)
    b, channels = 4, st.inputs.shape[-1]
    mixed, g, beta = torch.randn(b * q_rows, channels), -torch.rand(b * q_rows, 4) * 2, torch.rand(b * q_rows, 4)
    real = [i * q_rows + j for i, n in enumerate(lens) for j in range(n)]
    before = [t.clone() for t in (st.inputs, st.gates, st.matrix)]
    with torch.no_grad():
        want = layer._recurrence(mixed[real], g[real], beta[real], batch, lens)
        eager = [t.clone() for t in (st.inputs, st.gates, st.matrix)]
        for t, old in zip((st.inputs, st.gates, st.matrix), before):
            t.copy_(old)
        table = batch.padded(b, lens, scratch, "cpu", q_rows)
        assert table.trees == bool(trees)
        got = layer._fixed_recurrence(mixed, g, beta, table)
    torch.testing.assert_close(got[real], want, atol=1e-5, rtol=1e-5)
    for slot, k in zip(batch.targets, drafts):
        torch.testing.assert_close(st.matrix[slot], eager[2][slot], atol=1e-5, rtol=1e-5)
        assert st.inputs[slot, : width + k].equal(eager[0][slot, : width + k])  # history and pending inputs
        assert st.gates[slot, :k].equal(eager[1][slot, :k])
        held = min(pend, q_rows)  # the rows a step of Q rows reads and writes: no padding kept pending there
        assert not st.inputs[slot, width + k: width + held].any() and not st.gates[slot, k: held].any()
    untouched = [s for s in range(scratch) if s not in batch.targets]
    for t, old in zip((st.inputs, st.gates, st.matrix), before):
        assert t[untouched].equal(old[untouched])
    assert st.matrix[scratch].abs().max() == 0  # the padding sequence started from zeros and kept them


def test_plain_graph_steps_equal_eager_steps(hybrid_dir, eager_plain, monkeypatch):
    """Plain decoding: every decode step a graph of 3 requests padded to 4 (the padding sequence in the scratch
    state slot), the tokens eager steps give."""
    llm = engine(hybrid_dir, False)
    seen = recorded_tables(monkeypatch)
    assert outputs(llm, greedy(12)) == outputs(eager_plain, greedy(12))
    runner = llm.engine.executor.worker.runner
    assert {shape[:2] for shape in runner.graphs.graphs} == {(4, 1)}, list(runner.graphs.graphs)
    scratch = runner.recurrent.scratch
    assert scratch == runner.recurrent_state.num_slots - 1
    assert len(seen) >= 11 and all(table[0, 3] == scratch == table[1, 3] for _, table in seen)


def test_verify_graph_steps_equal_eager_steps(hybrid_dir, eager_plain, graph_ngram, monkeypatch):
    """n-gram drafts on repetitive prompts (six requests, padded to 8): some accepted, some rejected, so the steps
    replay 0..3 drafts; requests bringing different draft counts in one step share its rows (padded to the most);
    greedy tokens equal eager plain decoding's."""
    seen = recorded_tables(monkeypatch)
    assert outputs(graph_ngram, greedy(32), PROMPT_IDS) == outputs(eager_plain, greedy(32), PROMPT_IDS)
    stats = graph_ngram.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, stats
    assert any(q > 1 for _, q, _ in graph_ngram.engine.executor.worker.runner.graphs.graphs)
    real = [table[:, table[5] > 0] for _, table in seen]  # the requests' columns, not the padding sequences'
    assert {int(r) for t in real for r in t[3]} == {0, 1, 2, 3}  # replays of 0..3 accepted drafts
    assert any(len(set(t[4].tolist())) > 1 for t in real)  # one step, different draft counts
    assert any(shape[0] == 8 and t.shape[1] < 8 for shape, t in zip((s for s, _ in seen), real))
    # each step's rows hold its replays (the recurrence replays in as many rows as the step has)
    assert all(shape[1] > int(t[3].max()) for shape, t in zip((s for s, _ in seen), real))


def test_preempted_requests_recompute_their_state_beside_graph_steps(hybrid_dir, eager_plain):
    """A KV pool so small that requests are preempted: each recomputes its state from token 0 (an eager prefill)
    while the others go on in graph steps; greedy tokens equal eager plain decoding's."""
    from specray import LLM

    llm = LLM(model=str(hybrid_dir), max_model_len=128, enforce_eager=False, speculative_config=NGRAM,
              block_size=4, num_kv_blocks=24)
    assert outputs(llm, greedy(), PROMPT_IDS) == outputs(eager_plain, greedy(), PROMPT_IDS)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.executor.worker.runner.graphs.graphs


def test_seeded_sampling_on_graphs_equals_eager(eager_plain, graph_ngram):
    """A seeded sampled request's tokens do not depend on graphs or drafts."""
    from specray import SamplingParams

    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    assert outputs(graph_ngram, params) == outputs(eager_plain, params)


def test_graph_forward_has_no_host_sync(graph_ngram, no_host_sync):
    """A verify step's inputs loaded into a graph's static tensors (slots, replays, draft counts among them) and the
    model run on them read no tensor's value on the host (a capture fails on one)."""
    from specray.models.attention import build_attention_metadata
    from specray.models.gated_deltanet import RecurrentBatch

    outputs(graph_ngram, greedy(8))
    runner = graph_ngram.engine.executor.worker.runner
    graphs = runner.graphs
    key, graph = next((k, g) for k, g in graphs.graphs.items() if k[1] > 1)
    b, q = key[0], key[1]
    meta = build_attention_metadata([q] * b, [5] * b, [[0, 1, 2, 3]] * b, 16, graphs.device,
                                    min_ctx_blocks=key[2], read_in_place=False)
    table = RecurrentBatch([0], [False], [2], [q - 1], [1]).padded(b, [q], runner.recurrent.scratch, graphs.device)
    meta.recurrent = table
    ids = torch.arange(b * q, device=graphs.device)
    with torch.inference_mode(), no_host_sync():
        graphs._load(graph, meta, ids)
        graph_ngram.engine.executor.worker.model(graph.input_ids, graph.meta)


def test_tree_verify_graph_steps_equal_eager_steps(hybrid_dir, eager_plain, monkeypatch, no_host_sync):
    """n-gram trees of three branches (six requests, padded to 8): their verify steps replay graphs of the
    recurrence's tree form (each row's conv window and state from its own path, the rows' parents the graph's data),
    apart from the chains' graphs; greedy tokens equal eager plain decoding's. A tree step's inputs (a star of drafts
    under the last token) load into such a graph and the model runs on them with no host sync."""
    from specray.models.attention import build_attention_metadata
    from specray.models.gated_deltanet import RecurrentBatch

    llm = engine(hybrid_dir, False, {**NGRAM, "num_speculative_tokens": 6, "num_branches": 3})
    batches = recorded_batches(monkeypatch)
    assert outputs(llm, greedy(32), PROMPT_IDS) == outputs(eager_plain, greedy(32), PROMPT_IDS)
    assert branched(batches) and tree_graphs(llm) and 0 < llm.spec_stats.accepted_tokens
    runner = llm.engine.executor.worker.runner
    graphs = runner.graphs
    (b, q, blocks), graph = next((k[0], g) for k, g in graphs.graphs.items() if "tree" in k)
    star = torch.eye(q, dtype=torch.bool)
    star[:, 0] = True  # every draft sees the last token and itself
    meta = build_attention_metadata([q] * b, [5] * b, [[0, 1, 2, 3]] * b, 16, graphs.device,
                                    positions=[5] + [6] * (q - 1) + list(range(5, 5 + q)) * (b - 1),
                                    ancestors=[star] + [None] * (b - 1), min_ctx_blocks=blocks, read_in_place=False)
    meta.recurrent = RecurrentBatch([0], [False], [0], [q - 1], parents=[[-1] * (q - 1)]).padded(
        b, [q], runner.recurrent.scratch, graphs.device, q)
    ids = torch.arange(b * q, device=graphs.device)
    with torch.inference_mode(), no_host_sync():
        graphs._load(graph, meta, ids)
        llm.engine.executor.worker.model(graph.input_ids, graph.meta)


def test_wide_tree_verify_graph_steps_equal_eager_steps(hybrid_dir, eager_plain, monkeypatch):
    """Lookahead decoding's wider window (29 nodes: 30 rows a request, past the eager path's short queries): its
    verify steps replay graphs of 32 rows per request in the recurrence's tree form; greedy tokens equal eager plain
    decoding's."""
    spec = {"method": "lookahead", "max_window_size": 5, "max_ngram_size": 4, "max_verification_set_size": 5,
            "adaptive": False}
    llm = engine(hybrid_dir, False, spec)
    batches = recorded_batches(monkeypatch)
    assert outputs(llm, greedy(32), PROMPT_IDS) == outputs(eager_plain, greedy(32), PROMPT_IDS)
    assert branched(batches) and 0 < llm.spec_stats.accepted_tokens
    trees = [key[0] for key in llm.engine.executor.worker.runner.graphs.graphs if "tree" in key]
    assert any(q == 32 for _, q, _ in trees), trees


def test_a_failed_graph_step_leaves_the_others_unharmed(hybrid_dir, eager_plain, graph_ngram, monkeypatch):
    """One request's graph steps raise in the second linear-attention layer (after the first wrote its new states)
    from its third step on: the engine runs the step again without it, and the others' tokens are plain greedy
    decoding's (the failed step wrote only slots nobody reads)."""
    from specray.models import gated_deltanet as gdn
    from specray.workers.model_runner import ModelRunner

    llm = graph_ngram.engine
    ids = [llm.add_request(list(p), greedy()) for p in PROMPT_IDS[:4]]
    bad = ids[1]
    poison = dict(steps=0, armed=False, layers=0, failed=[])
    forward, layer = ModelRunner._forward, gdn.GatedDeltaNet.forward

    def runner_forward(runner, plan):
        hit = any(c.req_id == bad for c in plan.chunks)
        poison["steps"] += hit
        poison["armed"], poison["layers"] = hit and poison["steps"] >= 3, 0
        return forward(runner, plan)

    def layer_forward(module, x, meta):
        poison["layers"] += 1
        if poison["armed"] and poison["layers"] == 2:
            poison["failed"].append(type(meta.recurrent).__name__)
            raise RuntimeError("injected fault")
        return layer(module, x, meta)

    monkeypatch.setattr(ModelRunner, "_forward", runner_forward)
    monkeypatch.setattr(gdn.GatedDeltaNet, "forward", layer_forward)
    done = {}
    while llm.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.step() if o.finished})
    assert done[bad].outputs[0].finish_reason == "error"
    assert poison["failed"] and set(poison["failed"]) == {"RecurrentGraphBatch"}  # graph steps failed
    want = outputs(eager_plain, greedy(), PROMPT_IDS[:4])
    assert [done[i].outputs[0].token_ids for i in ids if i != bad] == want[:1] + want[2:]
