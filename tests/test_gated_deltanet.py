"""The Gated DeltaNet recurrence (specray.models.gated_deltanet) and its recurrent state under failures.

The chunked form of the delta rule (``chunked_gated_delta``) equals the token-by-token scan in float32 (outputs and
states within 1e-5 of the largest value): padded batches of different lengths, lengths that are not a multiple of
the chunk, states carried in, decays near 0, large and mixed, the state kept after a chosen token; the model runs it
for long prefills (logits against transformers, beside a verify chunk) without a host sync. Then a step that fails
part way for one request of a hybrid model leaves the others' states as they were: their outputs with n-gram drafts
equal plain greedy decoding's, whether the step failed inside the runner (after a linear-attention layer wrote its
new states) or after the runner ran it whole; the variants without that protection fail the same comparison."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import specray.models.gated_deltanet as gdn
from specray.models.gated_deltanet import chunked_gated_delta, gated_delta_scan, l2norm, scanned_selective
from specray.workers.model_runner import ModelRunner, RecurrentSlots
import specray_test_hybrid_models as qwen  # tests/hybrid_models.py: the tiny models, Stepper, prompts

REL = 1e-5


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


DECAYS = {  # log decays g [B, L, H] from a generator
    "near-zero": lambda gen, shape: -torch.rand(shape, generator=gen) * 1e-4,
    "mixed": lambda gen, shape: -torch.rand(shape, generator=gen) * 3.0,
    "large": lambda gen, shape: -10.0 - torch.rand(shape, generator=gen) * 1e4,
    # mostly mild, a token in ten forgetting nearly everything: large cumulative decays within a chunk
    "spiky": lambda gen, shape: torch.where(torch.rand(shape, generator=gen) < 0.1, -1e3, -0.05),
}


def padded_batch(lengths: list[int], decay: str, seed: int, h: int = 3, dk: int = 8, dv: int = 5):
    """Sequences of ``lengths`` padded to the longest as the layer pads them (padding: g = 0, beta = 0; its q, k, v
    left random, as they must not matter), with random states carried in."""
    gen = torch.Generator().manual_seed(seed)
    b, length = len(lengths), max(lengths)
    q = l2norm(torch.randn(b, length, h, dk, generator=gen)) * dk ** -0.5
    k = l2norm(torch.randn(b, length, h, dk, generator=gen))
    v = torch.randn(b, length, h, dv, generator=gen)
    g = DECAYS[decay](gen, (b, length, h))
    beta = torch.rand(b, length, h, generator=gen)
    real = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None])[..., None]  # [B, L, 1]
    state = torch.randn(b, h, dk, dv, generator=gen)
    return q, k, v, g * real, beta * real, state


LENGTHS = [[1], [7, 3], [16], [64, 17, 40], [100, 64, 1], [130, 129, 65]]


@pytest.mark.parametrize("decay", list(DECAYS))
@pytest.mark.parametrize("lengths", LENGTHS, ids=["-".join(map(str, x)) for x in LENGTHS])
@pytest.mark.parametrize("chunk", [64, 16])
@pytest.mark.parametrize("delta", [True, False], ids=["delta", "gated"])
def test_chunked_form_equals_the_scan(lengths, decay, chunk, delta):
    """Outputs (every real token), final states, and the states kept after a draft-like token near each end, at the
    first token and in the middle (across chunk boundaries), equal the scan's: for the delta rule and for the plain
    gated one (Mamba-2's)."""
    args = padded_batch(lengths, decay, seed=len(lengths) * 1000 + sum(lengths))
    out, state = gated_delta_scan(*args, delta=delta)
    got, got_state = chunked_gated_delta(*args, chunk=chunk, delta=delta)
    for i, n in enumerate(lengths):
        assert rel_err(got[i, :n], out[i, :n]) < REL, (i, n)
    assert rel_err(got_state, state) < REL
    for keep_at in ([max(n - 3, 0) for n in lengths], [0] * len(lengths), [n // 2 for n in lengths]):
        _, kept = gated_delta_scan(*args, keep_at=keep_at, delta=delta)
        got_out, got_kept = chunked_gated_delta(*args, keep_at=keep_at, chunk=chunk, delta=delta)
        assert rel_err(got_kept, kept) < REL, keep_at
        assert rel_err(got_out, got) < REL, keep_at  # keeping a state changes no output


@pytest.mark.parametrize("decay", list(DECAYS))
@pytest.mark.parametrize("lengths", LENGTHS, ids=["-".join(map(str, x)) for x in LENGTHS])
def test_the_parallel_selective_scan_equals_the_token_scan(lengths, decay):
    """Mamba-1's selective scan (a decay per state row: exp(dt * A)) as a parallel prefix scan per chunk equals the
    token scan: outputs, final states, and states kept near each end, at the first token and (device tensor) in the
    middle."""
    q, k, v, g, beta, state = padded_batch(lengths, decay, seed=len(lengths) * 100 + sum(lengths))
    dt = -g  # Mamba-1's dt >= 0 and A < 0: the same decays, one per state row
    a = -torch.rand(q.shape[2], q.shape[3], generator=torch.Generator().manual_seed(7)) * 2.0
    args = (q, k, v, dt, beta, state)
    out, final = gated_delta_scan(*args, delta=False, decay_by=a)
    got, got_final = scanned_selective(*args, None, a, chunk=16)
    for i, n in enumerate(lengths):
        assert rel_err(got[i, :n], out[i, :n]) < REL, (i, n)
    assert rel_err(got_final, final) < REL
    for keep_at in ([max(n - 3, 0) for n in lengths], [0] * len(lengths), torch.tensor([n // 2 for n in lengths])):
        _, kept = gated_delta_scan(*args, keep_at=keep_at, delta=False, decay_by=a)
        assert rel_err(scanned_selective(*args, keep_at, a, chunk=16)[1], kept) < REL, keep_at
    if decay != "large":  # (a large decay forgets the state at the first token)
        shifted, _ = scanned_selective(*args[:5], torch.zeros_like(state), None, a)  # the state carried in matters
        assert rel_err(shifted, got) > 1e-3


def test_the_comparison_can_fail():
    """The same comparison catches a state not carried in and a kept state off by one token."""
    args = padded_batch([130, 70], "near-zero", seed=1)  # decays that keep the state carried in to the end
    out, state = gated_delta_scan(*args)
    zero_out, zero_state = chunked_gated_delta(*args[:5], torch.zeros_like(args[5]))
    assert rel_err(zero_out, out) > 1e-2 and rel_err(zero_state, state) > 1e-2
    _, kept = gated_delta_scan(*args, keep_at=[100, 40])
    _, off_by_one = chunked_gated_delta(*args, keep_at=[101, 40])
    assert rel_err(off_by_one, kept) > 1e-2
    plain_out, _ = chunked_gated_delta(*args, delta=False)  # the two rules differ
    assert rel_err(plain_out, out) > 1e-2


def test_long_prefill_beside_a_verify_chunk_matches_transformers(tmp_path, monkeypatch):
    """Through the model: prompts longer than a chunk (not a multiple of it) run the chunked form, one beside a
    verify chunk whose committed state is kept from it; logits equal transformers', and the replay after the verify
    chunk too (its state was kept after the right token)."""
    calls = []
    real = gdn.chunked_gated_delta
    monkeypatch.setattr(gdn, "chunked_gated_delta", lambda *a, **kw: calls.append(a[0].shape[1]) or real(*a, **kw))
    model, hf = qwen.ours(tmp_path, "qwen3_5", seed=11)
    a, b = qwen.tokens(150, 21), qwen.tokens(20, 22)
    ref_a, ref_b = qwen.hf_logits(hf, a), qwen.hf_logits(hf, b)
    run = qwen.Stepper(model, num_blocks=200)
    first = run.step([(0, a[:70], 0, 0), (1, b[:8], 0, 0)])
    assert (first[0] - ref_a[:70]).abs().max() < qwen.TOL and (first[1] - ref_b[:8]).abs().max() < qwen.TOL
    drafts = b[9:11] + [3]  # two right drafts, then a wrong one
    second = run.step([(0, a[70:140], 70, 0), (1, [b[8]] + drafts, 8, 3)])
    assert (second[0] - ref_a[70:140]).abs().max() < qwen.TOL
    assert (second[1][:3] - ref_b[8:11]).abs().max() < qwen.TOL
    third = run.step([(0, a[140:], 140, 0), (1, b[11:20], 11, 0)])  # b replays its 2 accepted drafts
    assert (third[0] - ref_a[140:]).abs().max() < qwen.TOL
    assert (third[1] - ref_b[11:20]).abs().max() < qwen.TOL
    assert calls and max(calls) == 70 and len(calls) == 2 * 2  # both steps with 70 tokens, each linear layer


def test_no_host_sync_in_a_chunked_step(tmp_path, no_host_sync):
    """A long prefill beside a verify chunk (the chunked form, a state kept) reads no tensor's value on the host."""
    model, _ = qwen.ours(tmp_path, "qwen3_5", seed=12)
    run = qwen.Stepper(model)
    seq = qwen.tokens(80, 13)
    run.step([(0, seq[:8], 0, 0)])
    with no_host_sync():
        run.step([(0, seq[8:11], 8, 2), (1, seq, 0, 0)])


# ---- a failed step leaves the other requests' states as they were ---------------------------------------------

@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> Path:
    return qwen.save(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5", 0)


@pytest.fixture(scope="module")
def plain_greedy(hybrid_dir):
    from specray import LLM

    return qwen.generate(LLM(model=str(hybrid_dir), max_model_len=128), qwen.greedy())


class Poison:
    """Makes the steps that hold request ``req_id`` raise, from its ``first``-th step on: ``where="inside"`` in the
    runner's forward, in the second linear-attention layer (after the first wrote its new states), ``"after"`` in
    the executor once the runner ran the step whole; as a RequestError naming the request, or as a plain error."""

    def __init__(self, monkeypatch, engine, req_id: str, where: str, typed: bool, first: int = 3):
        self.req_id, self.where, self.typed, self.first = req_id, where, typed, first
        self.seen = self.raised = 0
        self.armed = False
        self.layer_calls = 0
        if where == "inside":
            forward, layer = ModelRunner._forward, gdn.GatedDeltaNet.forward

            def runner_forward(runner, plan):
                self.armed, self.layer_calls = self._hit(plan), 0
                return forward(runner, plan)

            def layer_forward(module, x, meta):
                self.layer_calls += 1
                if self.armed and self.layer_calls == 2:
                    self._raise()
                return layer(module, x, meta)

            monkeypatch.setattr(ModelRunner, "_forward", runner_forward)
            monkeypatch.setattr(gdn.GatedDeltaNet, "forward", layer_forward)
        else:
            worker = engine.executor.worker  # the in-process executor's (its sync and async paths both call it)
            inner = worker.execute

            def execute(plan, draft_probs=None):
                result = inner(plan, draft_probs)
                if self._hit(plan):
                    self._raise()
                return result

            monkeypatch.setattr(worker, "execute", execute)

    def _hit(self, plan) -> bool:
        hit = any(c.req_id == self.req_id for c in plan.chunks)
        self.seen += hit
        return hit and self.seen >= self.first

    def _raise(self):
        from specray.errors import RequestError

        self.raised += 1
        if self.typed:
            raise RequestError([self.req_id], "injected fault")
        raise RuntimeError("injected fault")


def run_with_poison(monkeypatch, hybrid_dir, where: str, typed: bool, bad: int = 3,
                    enforce_eager: bool | None = None) -> tuple[list, dict, object]:
    """Every prompt of the engine comparison with n-gram drafts, prompt ``bad`` poisoned: the others' outputs in
    prompt order, the others' finished outputs by id, the run's drafting statistics."""
    from specray import LLM

    llm = LLM(model=str(hybrid_dir), max_model_len=128, speculative_config=qwen.NGRAM, enforce_eager=enforce_eager)
    engine = llm.engine
    ids = [engine.add_request(list(p), qwen.greedy()) for p in qwen.PROMPT_IDS]
    poison = Poison(monkeypatch, engine, ids[bad], where, typed)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert poison.raised >= 1
    others = [done[i].outputs[0].token_ids for i in ids if i != ids[bad]]
    assert done[ids[bad]].outputs[0].finish_reason == "error" and "injected fault" in done[ids[bad]].error
    return others, {i: done[i] for i in ids if i != ids[bad]}, llm.spec_stats


@pytest.mark.parametrize("where, typed", [("inside", True), ("inside", False), ("after", False), ("after", True)])
def test_a_failed_step_leaves_the_others_unharmed(hybrid_dir, plain_greedy, monkeypatch, where, typed):
    """One request's steps raise from its third on; the engine runs the step again without it (its others together
    when the error names it, else each alone): every other request's tokens are plain greedy decoding's, no error."""
    others, done, stats = run_with_poison(monkeypatch, hybrid_dir, where, typed)
    assert others == plain_greedy[:3] + plain_greedy[4:]
    assert all(o.error is None for o in done.values())
    assert 0 < stats.accepted_tokens < stats.draft_tokens, stats  # drafts accepted and rejected: replays ran


def test_without_two_slots_a_failure_harms_the_others(hybrid_dir, plain_greedy, monkeypatch):
    """The comparison above can fail: with each step writing the states it reads (no second slot), the same run
    without a failure is right, and with the failure inside the runner the others go on from half-advanced states.
    Eager steps: such a step is not idempotent, and capturing a CUDA graph runs its step's forward three times (two
    warm-ups and a replay), so on a GPU this variant is wrong from graphs even without a failure."""
    batch, commit = RecurrentSlots.batch, RecurrentSlots.commit

    def in_place(slots, chunks):
        out = batch(slots, chunks)
        out.targets = None
        return out

    def commit_in_place(slots):
        touched = [staged[1] for staged in slots._staged]
        kept = commit(slots)
        for slot in touched:  # the committed state stays where it was written: the slot it was read from
            slots.side[slot] ^= 1
        return kept

    monkeypatch.setattr(RecurrentSlots, "batch", in_place)
    monkeypatch.setattr(RecurrentSlots, "commit", commit_in_place)
    from specray import LLM

    llm = LLM(model=str(hybrid_dir), max_model_len=128, speculative_config=qwen.NGRAM, enforce_eager=True)
    assert qwen.generate(llm, qwen.greedy()) == plain_greedy  # the variant itself runs right
    others, _, _ = run_with_poison(monkeypatch, hybrid_dir, "inside", True, enforce_eager=True)
    assert others != plain_greedy[:3] + plain_greedy[4:]


def test_without_taking_a_step_back_a_failure_after_the_runner_fails_the_others(hybrid_dir, monkeypatch):
    """And when the runner ran the failed step whole, its retry needs the state before it: without taking the step
    back the others fail too."""
    monkeypatch.setattr(RecurrentSlots, "_retried", lambda slots, chunk: False)
    _, done, _ = run_with_poison(monkeypatch, hybrid_dir, "after", True)
    assert any(o.error is not None and "recurrent state is at" in o.error for o in done.values())


@pytest.mark.parametrize("kind", ["gated_deltanet", "mamba2", "mamba1"])
def test_a_token_tree_gives_each_draft_its_own_paths_state(kind):
    """A verify chunk whose drafts form a tree, after replaying pending drafts: every row's output equals the output
    that row gets when its path alone (the chunk's real tokens, then its ancestors, then it) runs as a chain from the
    same state; the committed state and conv history equal the chain's, and every draft is kept pending in node
    order (its input and gates). For Gated DeltaNet's delta rule and Mamba-2's plain gated one (its conv bias and D
    skip too)."""
    import types

    from specray.models.gated_deltanet import GatedDeltaNet, RecurrentBatch
    from specray.models.kv_cache import RecurrentState
    from specray.models.mamba1 import Mamba1Mixer
    from specray.models.mamba2 import Mamba2Mixer
    from specray.parallel import TPGroup

    torch.manual_seed(0)
    if kind == "gated_deltanet":
        layer = GatedDeltaNet(types.SimpleNamespace(
            hidden_act="silu", linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=6, linear_conv_kernel_dim=4, hidden_size=32, rms_norm_eps=1e-5), TPGroup.single())
    elif kind == "mamba1":  # (its dt, B and C from each row's conv output: the rows' g and beta unused)
        layer = Mamba1Mixer(types.SimpleNamespace(
            model_type="jamba", hidden_size=2, mamba_expand=2, mamba_d_state=8, mamba_d_conv=4, mamba_dt_rank=3,
            mamba_conv_bias=True, mamba_proj_bias=False, rms_norm_eps=1e-5), TPGroup.single())
        with torch.no_grad():  # (built, not loaded: every parameter given a value, the norms' weights near 1)
            for name, p in layer.named_parameters():
                if "layernorm" in name:
                    p.uniform_(0.5, 1.5)
                else:
                    p.normal_(0.0, 0.5)
    else:
        layer = Mamba2Mixer(types.SimpleNamespace(
            model_type="bamba", hidden_act="silu", mamba_n_heads=4, mamba_d_head=6, mamba_d_state=8, mamba_n_groups=2,
            mamba_d_conv=4, mamba_expand=2, hidden_size=12, mamba_conv_bias=True, mamba_proj_bias=False,
            rms_norm_eps=1e-5, time_step_limit=(0.0, float("inf"))), TPGroup.single())
        with torch.no_grad():
            layer.conv1d.bias.normal_(), layer.D.normal_()
    pend, width = 6, 3
    with torch.no_grad():
        layer.conv1d.weight.normal_(0.0, 0.5)
    state = RecurrentState([layer.state_spec], 4, pend, torch.float32, "cpu")
    st = state.layers[0]
    st.inputs.normal_(), st.matrix.normal_(), st.gates[:, :, 0].uniform_(-2.0, 0.0), st.gates[:, :, 1].uniform_()
    layer.bind_state(st)
    # 2 replayed drafts, 2 real tokens, then drafts: two children of the last real token, a grandchild of each,
    # and a great-grandchild under the second branch
    parents, real, replay = [-1, -1, 0, 1, 3], 2, 2
    rows = real + len(parents)
    mixed, g, beta = torch.randn(rows, st.inputs.shape[-1]), -torch.rand(rows, 4) * 2, torch.rand(rows, 4)
    before = [t.clone() for t in (st.inputs, st.gates, st.matrix)]

    def run(picks: list[int], tree: list[int] | None, target: int) -> torch.Tensor:
        for t, old in zip((st.inputs, st.gates, st.matrix), before):
            t.copy_(old)
        drafts = len(picks) - real
        batch = RecurrentBatch([0], [False], [replay], [drafts], [target], parents=None if tree is None else [tree])
        with torch.no_grad():
            return layer._recurrence(mixed[picks], g[picks], beta[picks], batch, [len(picks)])

    got = run(list(range(rows)), parents, 1)
    tree_state = [t[1].clone() for t in (st.inputs, st.gates, st.matrix)]
    for node in range(len(parents)):
        path, cur = [], node
        while cur >= 0:
            path.insert(0, real + cur)
            cur = parents[cur]
        want = run(list(range(real)) + path, None, 2)
        torch.testing.assert_close(got[real + node], want[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[:real], want[:real], atol=1e-5, rtol=1e-5)
    chain_state = [t[2] for t in (st.inputs, st.gates, st.matrix)]  # the last chain run's (a path of the tree)
    torch.testing.assert_close(tree_state[2], chain_state[2], atol=1e-5, rtol=1e-5)  # committed: the real tokens'
    assert tree_state[0][:width].equal(chain_state[0][:width])  # the conv history: the last committed inputs
    assert tree_state[0][width: width + len(parents)].equal(mixed[real:])  # every draft pending, in node order
    assert tree_state[1][: len(parents)].equal(torch.stack((g[real:], beta[real:]), dim=1))
