"""specray.verification: greedy verification by hand; rejection sampling reproduces the target distribution
(chi-square over the first two emitted tokens, with negative controls that must fail); seeded streams are
batch-independent; nothing syncs with the host."""


import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specray import verification
from specray.sampling import (SamplingBatch, keyed_uniform, logits_to_probs, make_generator, sample,
                              sample_by_inversion)
from specray.sampling_params import SamplingParams as SP
from specray.verification import pad_drafts, unpad_outputs, verify

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def build(params, seeds=None, device="cpu"):
    seeds = seeds or [p.seed for p in params]
    return SamplingBatch.build(params, [make_generator(s, device) for s in seeds], device)


def peaked_logits(argmaxes: list[list[int]], vocab: int = 6, seed: int = 0) -> torch.Tensor:
    """[B, P, V] random logits whose argmax at (b, i) is argmaxes[b][i]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(argmaxes), len(argmaxes[0]), vocab, generator=g)
    for b, row in enumerate(argmaxes):
        for i, a in enumerate(row):
            logits[b, i, a] = 10.0
    return logits


# ---- greedy -------------------------------------------------------------------------------------------------

GREEDY = SP(temperature=0.0)


def run_greedy(argmaxes, drafts, num_drafts, with_probs=False):
    target = peaked_logits(argmaxes)
    B, K = len(drafts), len(drafts[0])
    q = torch.softmax(torch.randn(B, K, 6), -1) if with_probs else None
    out, n = verify(target, torch.tensor(drafts).view(B, K), torch.tensor(num_drafts), q, build([GREEDY] * B))
    return out.tolist(), n.tolist()


@pytest.mark.parametrize("with_probs", [False, True])
def test_greedy_all_accepted_gives_bonus(with_probs):
    out, n = run_greedy([[1, 2, 3, 4]], [[1, 2, 3]], [3], with_probs)
    assert (out, n) == ([[1, 2, 3, 4]], [3])


@pytest.mark.parametrize("with_probs", [False, True])
def test_greedy_first_mismatch(with_probs):
    out, n = run_greedy([[1, 2, 3, 4]], [[1, 5, 3]], [3], with_probs)  # 5 != 2: stop at position 1
    assert (out, n) == ([[1, 2, -1, -1]], [1])
    out, n = run_greedy([[1, 2, 3, 4]], [[0, 2, 3]], [3], with_probs)  # mismatch at 0: later matches ignored
    assert (out, n) == ([[1, -1, -1, -1]], [0])


def test_greedy_zero_drafts():
    target = peaked_logits([[4], [2]])
    out, n = verify(target, torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long), None,
                    build([GREEDY] * 2))
    assert (out.tolist(), n.tolist()) == ([[4], [2]], [0, 0])


@pytest.mark.parametrize("with_probs", [False, True])
def test_greedy_mixed_draft_counts_and_padding(with_probs):
    argmaxes = [[1, 2, 3, 4], [5, 0, 0, 0], [3, 3, 3, 3], [2, 4, 1, 0]]
    drafts = [
        [1, 2, 3],  # k=3, all accepted -> bonus 4
        [0, 5, 5],  # k=1, mismatch at 0 -> 5; padded positions happen to be argmaxes? no: 5 != 0
        [3, 3, 3],  # k=0: the padding matches the argmax everywhere and must still be ignored -> 3
        [2, 4, 1],  # k=2: both accepted; the padded third draft equals the argmax but is not a draft -> bonus 1
    ]
    out, n = run_greedy(argmaxes, drafts, [3, 1, 0, 2], with_probs)
    assert n == [3, 0, 0, 2]
    assert out == [[1, 2, 3, 4], [5, -1, -1, -1], [3, -1, -1, -1], [2, 4, 1, -1]]


def test_greedy_rows_beside_sampled_rows_and_untouched_generators():
    argmaxes = [[1, 2, 3], [4, 4, 4], [0, 5, 1]]
    target = peaked_logits(argmaxes)
    drafts = torch.tensor([[1, 0], [4, 4], [0, 5]])
    gens = [make_generator(1, "cpu"), make_generator(2, "cpu"), make_generator(3, "cpu")]
    states = [g.get_state() for g in gens]
    params = [SP(temperature=0.0, seed=1), SP(temperature=1.0, seed=2), SP(temperature=0.0, seed=3)]
    out, n = verify(target, drafts, torch.tensor([2, 2, 2]), None, SamplingBatch.build(params, gens, "cpu"))
    assert out[0].tolist() == [1, 2, -1] and out[2].tolist() == [0, 5, 1] and n[[0, 2]].tolist() == [1, 2]
    assert torch.equal(gens[0].get_state(), states[0]) and torch.equal(gens[2].get_state(), states[2])
    assert not torch.equal(gens[1].get_state(), states[1])


@pytest.mark.parametrize("with_probs", [False, True])
def test_all_greedy_fast_path_matches_the_general_path(with_probs):
    """An all-greedy batch skips the probabilities; a sampled row beside it forces the general path."""
    torch.manual_seed(3)
    B, K, vocab = 64, 4, 50
    target = torch.randn(B, K + 1, vocab)
    wrong = torch.rand(B, K) < 0.2  # drafts: mostly the argmax, some random
    drafts = torch.where(wrong, torch.randint(vocab, (B, K)), target[:, :K].argmax(-1))
    counts = torch.randint(K + 1, (B,))
    q = torch.softmax(torch.randn(B, K, vocab), -1) if with_probs else None
    fast = verify(target, drafts, counts, q, build([GREEDY] * B))
    pad = lambda x: torch.cat([x, x[:1]])  # noqa: E731
    general = verify(pad(target), pad(drafts), pad(counts), None if q is None else pad(q),
                     build([GREEDY] * B + [SP()]))
    assert torch.equal(fast[0], general[0][:B]) and torch.equal(fast[1], general[1][:B])
    assert int(fast[1].sum()) > B // 2


# ---- a toy language model for the distribution tests ----------------------------------------------------------

V = 6
N_TRIALS = 100_000


class ToyLM:
    """Context-dependent next-token logits over a small vocabulary: position 0 has fixed logits, later positions
    depend on the previous token (a bigram table)."""

    def __init__(self, seed: int, scale: float = 1.2):
        g = torch.Generator().manual_seed(seed)
        self.first = torch.randn(V, generator=g) * scale  # [V]
        self.bigram = torch.randn(V, V, generator=g) * scale  # [prev, V]

    def logits(self, prev: torch.Tensor | None, n: int) -> torch.Tensor:
        return self.first.expand(n, V) if prev is None else self.bigram[prev]  # [n, V]

    def probs(self, prev: torch.Tensor | None, n: int, sp: SP) -> torch.Tensor:
        """The warped distribution of each context, [n, V] (warped once per distinct context)."""
        if prev is None:
            return warp(self.first[None], sp).expand(n, V)
        return warp(self.bigram, sp)[prev]


def warp(logits: torch.Tensor, sp: SP) -> torch.Tensor:
    """The expected distribution, straight from the definitions (float64 numpy), independent of the code under
    test: softmax(l / T), top-k (ties kept), top-p on the renormalized result, min-p."""
    z = logits.double().numpy() / sp.temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = []
    for row in p:
        order = np.argsort(-row, kind="stable")
        keep = row >= row[order[min(sp.top_k, V) - 1]] if sp.top_k else np.ones(V, bool)
        row = np.where(keep, row, 0) / np.where(keep, row, 0).sum()
        if sp.top_p < 1:
            before = np.cumsum(row[order]) - row[order]
            keep[order[before >= sp.top_p]] = False
        keep &= row >= sp.min_p * row.max()
        row = np.where(keep, row, 0)
        out.append(row / row.sum())
    return torch.tensor(np.array(out), dtype=torch.float32)


class Drafter:
    """Proposes K tokens per trial from its own toy LM: ``mode`` is
    "fixed" (a deterministic guess, q one-hot / None), "onehot" (sampled from its LM but reported as one-hot:
    still exact), "probs" (sampled from q and q reported), or "wrong_q" (sampled from one LM, another's q
    reported: a broken drafter, for a negative control)."""

    def __init__(self, mode: str, sp: SP, seed: int = 11):
        self.mode, self.sp = mode, sp
        self.lm, self.liar = ToyLM(seed, scale=1.0), ToyLM(seed + 1, scale=1.0)

    def propose(self, prev: torch.Tensor | None, n: int, k: int, gen: torch.Generator):
        tokens, qs = [], []
        for _ in range(k):
            if self.mode == "fixed":
                tok = torch.full((n,), 2, dtype=torch.long) if prev is None else (prev * 5 + 1) % V
                q = None
            else:
                q = self.lm.probs(prev, n, self.sp)  # [n, V]
                tok = torch.multinomial(q, 1, generator=gen).squeeze(1)
                if self.mode == "wrong_q":
                    q = self.liar.probs(prev, n, self.sp)
            tokens.append(tok)
            qs.append(q)
            prev = tok
        draft_ids = torch.stack(tokens, 1) if k else torch.zeros(n, 0, dtype=torch.long)  # [n, K]
        q = torch.stack(qs, 1) if k and self.mode in ("probs", "wrong_q") else None  # [n, K, V] | None
        return draft_ids, q


def accept_all(target, draft_ids, num_drafts, q, batch):
    """A deliberately wrong verifier: accepts every draft, then samples the bonus."""
    B, K1, _ = target.shape
    out = torch.cat([draft_ids, torch.full((B, 1), -1)], 1)
    bonus = sample(logits_to_probs(target[:, -1], batch), batch)
    out[:, K1 - 1] = bonus
    return out, num_drafts.clone()


def first_two_tokens(target_lm: ToyLM, drafter: Drafter, sp: SP, k: int, verifier=verify, seed: int = 1):
    """Runs speculative decoding for N_TRIALS independent sequences until each has 2 tokens; returns
    (t0 [N], t1 [N], accepted-at-position-0 [N] bool).

    Seeds are fixed, so the tests are deterministic. Under a correct verifier the p-values are uniform: over
    seeds 0..14 and every case below (420 p-values) one fell under 1e-3, as chance predicts."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    n = N_TRIALS
    batch = build([sp] * n, [None] * n)
    # Step 1: k drafts after the (empty) prompt; the target scores positions 0..k given the drafts.
    drafts, q = drafter.propose(None, n, k, gen)
    target = torch.stack([target_lm.logits(None, n)] + [target_lm.logits(drafts[:, i], n) for i in range(k)], 1)
    out, acc = verifier(target, drafts, torch.full((n,), k), q, batch)
    t0, t1 = out[:, 0].clone(), out[:, 1].clone() if k else torch.full((n,), -1)
    # Step 2 for the sequences that kept only one token: one draft given t0.
    need = acc == 0
    m = int(need.sum())
    if m == 0:
        return t0, t1, ~need
    drafts2, q2 = drafter.propose(t0[need], m, 1, gen)
    target2 = torch.stack([target_lm.logits(t0[need], m), target_lm.logits(drafts2[:, 0], m)], 1)
    out2, _ = verifier(target2, drafts2, torch.ones(m, dtype=torch.long), q2, build([sp] * m, [None] * m))
    t1[need] = out2[:, 0]
    return t0, t1, ~need


def chi2_pvalue(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Goodness of fit; cells with probability 0 must be empty (else p = 0)."""
    if observed[expected_probs == 0].sum() > 0:
        return 0.0
    on = expected_probs > 0
    return chisquare(observed[on], expected_probs[on] / expected_probs[on].sum() * observed.sum()).pvalue


def joint_pvalues(target_lm: ToyLM, sp: SP, t0, t1) -> tuple[float, float]:
    """p-values of the first token against p(x0) and of the pair against p(x0) p(x1 | x0)."""
    p0 = target_lm.probs(None, 1, sp)[0].double().numpy()  # [V]
    p1 = target_lm.probs(torch.arange(V), V, sp).double().numpy()  # [V, V] rows: previous token
    first = np.bincount(t0.numpy(), minlength=V).astype(float)
    pair = np.bincount((t0 * V + t1).numpy(), minlength=V * V).astype(float)
    return chi2_pvalue(first, p0), chi2_pvalue(pair, (p0[:, None] * p1).ravel())


CASES = [
    ("fixed", SP()),
    ("onehot", SP()),
    ("probs", SP()),
    ("probs", SP(temperature=0.7, top_k=4)),
    ("probs", SP(temperature=1.3, top_p=0.85, min_p=0.05)),
    ("onehot", SP(temperature=0.8, top_k=3)),
    ("fixed", SP(temperature=0.6, top_p=0.9)),
]


@pytest.mark.parametrize("mode, sp", CASES)
@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampling_reproduces_the_target(mode, sp, k):
    target_lm = ToyLM(seed=3)
    t0, t1, _ = first_two_tokens(target_lm, Drafter(mode, sp), sp, k)
    p_first, p_pair = joint_pvalues(target_lm, sp, t0, t1)
    assert p_first > 1e-3 and p_pair > 1e-3, (p_first, p_pair)


def test_acceptance_rate_is_one_minus_total_variation():
    """Not only exact but efficient: draft 0 is accepted with probability sum_x min(p(x), q(x))."""
    sp = SP(temperature=0.9)
    target_lm, drafter = ToyLM(seed=3), Drafter("probs", sp)
    _, _, accepted = first_two_tokens(target_lm, drafter, sp, k=2)
    p = target_lm.probs(None, 1, sp)[0]
    q = drafter.lm.probs(None, 1, sp)[0]
    rate = torch.minimum(p, q).sum().item()
    observed = accepted.double().mean().item()
    assert abs(observed - rate) < 5 * (rate * (1 - rate) / N_TRIALS) ** 0.5, (observed, rate)


@pytest.mark.parametrize("broken", ["accept_all", "resample_from_p", "wrong_q"])
def test_negative_controls_fail_the_same_test(broken, monkeypatch):
    """A wrong verifier (or a drafter that lies about q) fails the chi-square test, so the test has teeth."""
    sp, mode, verifier = SP(), "probs", verify
    if broken == "accept_all":
        verifier = accept_all
    elif broken == "resample_from_p":  # the classic bug: after a rejection, sample from p, not max(0, p - q)
        monkeypatch.setattr(verification, "_residual", lambda p, q: p)
    else:
        mode = "wrong_q"
    target_lm = ToyLM(seed=3)
    t0, t1, _ = first_two_tokens(target_lm, Drafter(mode, sp), sp, k=2, verifier=verifier)
    p_first, p_pair = joint_pvalues(target_lm, sp, t0, t1)
    assert min(p_first, p_pair) < 1e-3, (p_first, p_pair)


def test_mixed_draft_counts_sampled():
    """Rows with K = 0..3 in one batch (padding beyond each row's count): each row's first token ~ p0."""
    sp = SP(temperature=0.8)
    target_lm, drafter = ToyLM(seed=4), Drafter("probs", sp)
    n, K = N_TRIALS, 3
    torch.manual_seed(7)
    drafts, q = drafter.propose(None, n, K, torch.Generator().manual_seed(8))
    target = torch.stack([target_lm.logits(None, n)] + [target_lm.logits(drafts[:, i], n) for i in range(K)], 1)
    counts = torch.arange(n) % (K + 1)
    out, acc = verify(target, drafts, counts, q, build([sp] * n, [None] * n))
    assert bool((acc <= counts).all())
    p0 = target_lm.probs(None, 1, sp)[0].double().numpy()
    for k in range(K + 1):
        rows = counts == k
        assert chi2_pvalue(np.bincount(out[rows, 0].numpy(), minlength=V).astype(float), p0) > 1e-3, k
        # Exactly num_accepted + 1 tokens, then -1.
        valid = (out[rows] >= 0).sum(1)
        assert torch.equal(valid, acc[rows] + 1)


# ---- edge cases ---------------------------------------------------------------------------------------------


def test_zero_drafts_is_plain_sampling():
    """K = 0: the token the target samples by inversion with the same uniform (keyed by the seed and the
    position; the greedy row its argmax)."""
    logits = torch.randn(3, 1, 50)
    params = [SP(seed=1), SP(seed=2, top_k=5), SP(temperature=0.0, seed=3)]
    keyed = SamplingBatch.build(params, [make_generator(p.seed, "cpu") for p in params], "cpu", positions=[7, 9, 4])
    out, n = verify(logits, torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, dtype=torch.long), None, keyed)
    u = torch.tensor([keyed_uniform(1, 7), keyed_uniform(2, 9), 0.0])
    expected = sample_by_inversion(logits_to_probs(logits[:, 0], keyed), u)
    assert torch.equal(out[:, 0], expected) and n.tolist() == [0, 0, 0]
    assert expected[2] == logits[2, 0].argmax()
    # beside a request whose drafts have a q, a request with a q but no drafts this step (a draft model's, at its
    # output's end) samples the same token: coupled, not the q path's race (which made a seeded request's last
    # token differ alone and in a batch)
    rows = torch.cat([logits[0], torch.randn(3, 50)])  # request 0: no drafts, one row; request 1: 2 drafts
    pd = pad_drafts(rows, [[], [4, 5]], [torch.zeros(0, 50), torch.softmax(torch.randn(2, 50), -1)])
    for other in (SP(seed=5), SP(temperature=0.0)):
        batch = SamplingBatch.build([params[0], other], [make_generator(1, "cpu"), make_generator(5, "cpu")], "cpu",
                                    positions=[7, 3])
        out, n = verify(*pd[:4], batch, draft_counts=pd.draft_counts, has_q=pd.has_q)
        assert out[0, 0] == expected[0] and n[0] == 0


def test_p_equals_q_accepts_everything():
    logits = torch.randn(500, 4, V)
    sp = SP(temperature=0.9)
    p = logits_to_probs(logits.view(-1, V), build([sp])).view(500, 4, V)
    drafts = torch.multinomial(p[:, :3].reshape(-1, V), 1).view(500, 3)
    _, n = verify(logits, drafts, torch.full((500,), 3), p[:, :3], build([sp] * 500, [None] * 500))
    assert bool((n == 3).all())


def test_degenerate_residual_falls_back_to_p():
    """A draft with p(x) = 0 but q one-hot on another token equal to p: max(0, p - q) is all zero."""
    logits = torch.full((1, 2, V), float("-inf"))
    logits[0, :, 3] = 0.0  # p = one-hot(3) at every position (a sampled request)
    q = torch.zeros(1, 1, V)
    q[0, 0, 3] = 1.0
    out, n = verify(logits, torch.tensor([[1]]), torch.tensor([1]), q, build([SP(temperature=1.0)]))
    assert out.tolist() == [[3, -1]] and n.tolist() == [0]


# ---- seeded streams -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_request_same_alone_and_in_batch(device):
    torch.manual_seed(0)
    sp = SP(temperature=1.0, top_k=40, seed=42)
    k, vocab = 3, 100
    target = torch.randn(1, k + 1, vocab, device=device) * 0.3  # flat: drafts get rejected now and then
    drafts = torch.randint(vocab, (1, k), device=device)
    q = torch.softmax(torch.randn(1, k, vocab, device=device), -1)

    def run(batch_rows: int, pos: int, steps: int = 6):
        others = [SP(), SP(seed=7), SP(temperature=0.0, seed=9), SP(top_p=0.5)][: batch_rows - 1]
        params = others[:pos] + [sp] + others[pos:]
        counts = [5 if p is not sp else k for p in params]  # the others draft more: padding K = 5
        K = max(counts)
        t = torch.randn(len(params), K + 1, vocab, device=device)
        t[pos, : k + 1] = target[0]
        d = torch.randint(vocab, (len(params), K), device=device)
        d[pos, :k] = drafts[0]
        qq = torch.softmax(torch.randn(len(params), K, vocab, device=device), -1)
        qq[pos, :k] = q[0]
        batch = build(params, device=device)
        runs = []
        for _ in range(steps):
            out, n = verify(t, d, torch.tensor(counts, device=device), qq, batch, draft_counts=counts)
            runs.append((out[pos, : k + 1].tolist(), int(n[pos])))
        return runs

    alone = run(1, 0)
    assert len({tuple(o) for o, _ in alone}) > 1  # the stream moves on
    assert run(3, 2) == alone
    assert run(5, 1) == alone


# ---- the padded layout --------------------------------------------------------------------------------------


def test_pad_drafts_and_unpad():
    vocab = 7
    logits = torch.arange(9 * vocab, dtype=torch.float32).view(9, vocab)  # rows: 3 + 1 + 2 + 3
    drafts = [[1, 2], [], [4], [5, 6]]
    probs = [torch.full((2, 5), 0.2), None, None, torch.full((2, vocab), 1 / vocab)]
    pd = pad_drafts(logits, drafts, probs)
    assert pd.target_logits.shape == (4, 3, vocab)
    assert pd.target_logits[:, :, 0].tolist() == [[0, 7, 14], [21, 21, 21], [28, 35, 35], [42, 49, 56]]
    assert pd.draft_token_ids.tolist() == [[1, 2], [0, 0], [4, 4], [5, 6]]
    assert pd.num_drafts.tolist() == [2, 0, 1, 2] and pd.draft_counts == [2, 0, 1, 2]
    assert pd.draft_probs.shape == (4, 2, vocab)
    torch.testing.assert_close(pd.draft_probs[0, 0], torch.tensor([0.2] * 5 + [0.0] * 2))
    assert pd.draft_probs[2, 0].tolist() == [0, 0, 0, 0, 1, 0, 0]  # one-hot for a request without q
    assert pad_drafts(logits, drafts).draft_probs is None
    out, n = verify(*pd[:4], build([GREEDY] * 4), draft_counts=pd.draft_counts)
    kept = unpad_outputs(out, n)
    assert kept == [[6], [6], [6], [6]]  # arange logits: the argmax is always the last id
    # a drafter's q that is no distribution its draft came from (no mass on it: it would be accepted always; a value
    # not finite, or negative) is verified as a deterministic draft, one-hot on it; a proper row stays as it is
    bad = torch.tensor([[0.0, 0.5, 0.5, 0, 0, 0, 0], [float("nan")] * vocab])
    negative = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.5, -0.5, 0.0]])
    pd = pad_drafts(logits, drafts, [torch.full((2, 5), 0.2), None, negative, bad])
    assert pd.draft_probs[3].tolist() == [[0, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0, 1]]
    assert pd.draft_probs[2, 0].tolist() == [0, 0, 0, 0, 1, 0, 0]
    torch.testing.assert_close(pd.draft_probs[0, 1], torch.tensor([0.2] * 5 + [0.0] * 2))


# ---- no host syncs ------------------------------------------------------------------------------------------

def test_recorder_catches_a_sync(no_host_sync):
    with pytest.raises(AssertionError):
        with no_host_sync():
            torch.ones(2).sum().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("with_counts", [False, True])
def test_verify_has_no_host_sync(no_host_sync, device, with_probs, with_counts):
    params = [SP(temperature=0.0), SP(seed=1, top_k=3), SP(top_p=0.7), SP(min_p=0.1, seed=2),
              SP(temperature=0.0, seed=3)]
    B, K, vocab = len(params), 3, 30
    batch = build(params, device=device)
    target = torch.randn(B, K + 1, vocab, device=device)
    drafts = torch.randint(vocab, (B, K), device=device)
    counts = [3, 0, 2, 1, 3]
    num_drafts = torch.tensor(counts, device=device)
    q = torch.softmax(torch.randn(B, K, vocab, device=device), -1) if with_probs else None
    empty = (torch.zeros(B, 1, vocab, device=device), torch.zeros(B, 0, dtype=torch.long, device=device),
             torch.zeros(B, dtype=torch.long, device=device))
    greedy = build([SP(temperature=0.0)] * B, device=device)
    with no_host_sync():
        verify(target, drafts, num_drafts, q, batch, draft_counts=counts if with_counts else None)
        verify(*empty, None, batch)
        verify(target, drafts, num_drafts, q, greedy)
