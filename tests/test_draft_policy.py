"""The draft-length policy: acceptance estimates, the fitted cost model, and the k it picks."""

import itertools
import random

import pytest

from specray.sampling_params import SamplingParams
from specray.scheduler.draft_policy import (CONFIDENCE_BINS, Confidence, DraftLengthPolicy, PRIOR_COST,
                                            expected_tokens, robust_fit)
from specray.scheduler.request import Request
from specray.tree import DraftTree


_names = itertools.count()


def make_req(name=None) -> Request:
    """A request with its own id (the policy keeps evidence per id)."""
    return Request(name or f"r{next(_names)}", [1, 2, 3], SamplingParams(temperature=0.0))


def trained(policy: DraftLengthPolicy, alpha: float, steps: int = 60, k: int = 5, seed: int = 0) -> Request:
    """A request whose drafts were each accepted with probability alpha (geometric)."""
    rng, req = random.Random(seed), make_req()
    for _ in range(steps):
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        policy.observe(req, k, accepted)
    return req


def feed_cost(policy: DraftLengthPolicy, a: float, b: float, noise: float = 0.0, seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(64):
        n = rng.randint(1, 64)
        policy.observe_step(n, 4, (a + b * n) * (1 + noise * rng.uniform(-1, 1)))


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 3) == 4.0


def test_acceptance_estimate_starts_at_the_prior_and_tracks_evidence():
    policy = DraftLengthPolicy(5)
    assert policy.acceptance(make_req()) == pytest.approx(0.5)
    assert policy.acceptance(trained(policy, 0.9)) > 0.8
    assert policy.acceptance(trained(policy, 0.1)) < 0.2


def test_low_acceptance_drafts_nothing_high_acceptance_drafts_a_lot():
    policy = DraftLengthPolicy(8)
    feed_cost(policy, 0.030, 0.002)  # SmolLM2 on 2 CPU cores: a step ~30 ms, each token in it ~2 ms more
    assert policy.choose(trained(policy, 0.0), batch_size=1) == 0
    assert policy.choose(trained(policy, 0.95), batch_size=1) >= 5


def test_not_adaptive_is_always_num_speculative_tokens():
    policy = DraftLengthPolicy(4, adaptive=False)
    assert policy.choose(trained(policy, 0.0), batch_size=64) == 4


def test_prior_cost_until_two_distinct_sizes():
    policy = DraftLengthPolicy(4)
    for _ in range(5):
        policy.observe_step(8, 8, 0.01)
    assert policy.cost_model() == PRIOR_COST
    policy.observe_step(16, 8, 0.02)
    assert policy.cost_model() != PRIOR_COST


def test_fresh_policy_drafts_in_a_batch_before_any_cost_is_measured():
    """Until steps of two sizes are measured the prior prices a step; a batch of 8 that has drafted nothing yet
    must still draft (at the prior's even odds) or its cost of drafting is never measured."""
    policy = DraftLengthPolicy(8)
    assert policy.cost_model() == PRIOR_COST
    assert policy.choose(make_req(), batch_size=8) > 0


def test_cost_fit_recovers_the_line_despite_noise_and_outliers():
    policy = DraftLengthPolicy(4)
    feed_cost(policy, 0.010, 0.0005, noise=0.05)
    for n in (3, 40):
        policy.observe_step(n, 4, 0.5)  # two stalls (a GC pause, say)
    a, b = policy.cost_model()
    assert a == pytest.approx(0.010, rel=0.1) and b == pytest.approx(0.0005, rel=0.1)


def test_robust_fit_exact_line():
    a, b = robust_fit([(1, 3.0), (2, 5.0), (4, 9.0)])
    assert (a, b) == pytest.approx((1.0, 2.0))


def test_adapts_to_the_fitted_cost_model():
    """Same acceptance; memory-bound steps (tokens nearly free) draft long, compute-bound steps do not."""
    cheap, dear = DraftLengthPolicy(8), DraftLengthPolicy(8)
    feed_cost(cheap, 0.020, 0.00001)
    feed_cost(dear, 0.001, 0.002)
    req = trained(cheap, 0.6)
    assert cheap.choose(req, batch_size=1) >= 4
    assert dear.choose(req, batch_size=1) == 0


def test_bigger_batches_draft_less():
    policy = DraftLengthPolicy(8)
    req = trained(policy, 0.6)
    ks = [policy.best_k(policy.acceptance(req), b) for b in (1, 4, 16, 64)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]


def test_probe_after_consecutive_zero_steps():
    policy = DraftLengthPolicy(5, probe_after=8, probe_k=2)
    feed_cost(policy, 0.030, 0.002)
    req = trained(policy, 0.0)
    picks = [policy.choose(req, batch_size=1) for _ in range(18)]
    assert picks == [0] * 8 + [2] + [0] * 8 + [2]


def test_probes_back_off_while_they_find_nothing():
    policy = DraftLengthPolicy(5, probe_after=2, probe_k=2, probe_backoff=2)
    feed_cost(policy, 0.030, 0.002)
    req = trained(policy, 0.0)
    picks = [policy.choose(req, batch_size=1) for _ in range(30)]
    gaps = [len(run) for run in "".join("x" if k else "." for k in picks).split("x")[:-1]]
    assert set(picks) == {0, 2} and gaps == [2, 4, 8, 8], picks  # 2 steps, doubled twice at most
    policy.evidence(req.req_id).undrafted_steps = 0
    for _ in range(20):
        policy.observe(req, 2, 2)  # drafts match again: it drafts, and the next probe wait starts over
    assert policy.choose(req, batch_size=1) > 0
    ev = policy.evidence(req.req_id)
    ev.accepts, ev.rejects = 0.0, 50.0  # and miss again: probes start from the shortest wait
    assert [policy.choose(req, batch_size=1) for _ in range(3)] == [0, 0, 2]


def test_recovers_when_drafts_start_matching():
    policy = DraftLengthPolicy(5)
    req = trained(policy, 0.0)
    for _ in range(30):
        k = policy.choose(req, batch_size=1)
        if k:
            policy.observe(req, k, k)
    assert policy.choose(req, batch_size=1) > 0


def test_deterministic():
    a, b = DraftLengthPolicy(6), DraftLengthPolicy(6)
    feed_cost(a, 0.01, 0.001, noise=0.2)
    feed_cost(b, 0.01, 0.001, noise=0.2)
    ra, rb = trained(a, 0.7), trained(b, 0.7)
    assert [a.choose(ra, n) for n in range(1, 20)] == [b.choose(rb, n) for n in range(1, 20)]


@pytest.mark.parametrize("kw, match", [({"num_speculative_tokens": -1}, "num_speculative_tokens=-1"),
                                       ({"num_speculative_tokens": 2, "decay": 0}, "decay=0"),
                                       ({"num_speculative_tokens": 2, "window": 1}, "window=1")])
def test_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        DraftLengthPolicy(**kw)


def test_alone_it_fills_the_rows_the_matmuls_run_anyway():
    """With steps padded to fast widths (4 tokens cost what 2 do), a lone request drafts to fill the width:
    1 + k is always a width (1 or 3 drafts, never 2; 7, never 4-6), as a fit over raw token counts misses."""
    def rows(n):
        return next(w for w in (2, 4, 8, 16) if n <= w)

    padded, plain = DraftLengthPolicy(15, rows=rows), DraftLengthPolicy(15)
    for n in range(1, 17):
        for policy in (padded, plain):
            policy.observe_step(n, 1, 0.030 + 0.002 * rows(n))
    assert padded.cost_model() == pytest.approx((0.030, 0.002))
    ks = [padded.best_k(alpha / 20, batch_size=1) for alpha in range(20)]
    assert all(1 + k in (1, 2, 4, 8, 16) for k in ks), ks
    assert ks == sorted(ks) and {1, 3, 7} <= set(ks), ks
    assert any(1 + plain.best_k(alpha / 20, batch_size=1) not in (1, 2, 4, 8, 16) for alpha in range(20))


def test_closed_batch_requests_off_the_critical_path_draft_nothing():
    """A drained closed batch ends with its last request. Budgets 100, 60 and 95 with poor acceptance (about 1
    token per step): the batch needs ~100 more steps, and the 60- and 95-token requests finish before that
    without drafting. The 100-token one drafting well (~4.7 tokens per step): the 95-token one is now the
    longest (~90 steps). All drafting well: the batch needs ~21 steps, and every request is on its critical
    path."""
    policy = DraftLengthPolicy(5)
    feed_cost(policy, 1.0, 0.05)
    poor = [trained(policy, 0.05, seed=i) for i in range(3)]
    good = [trained(policy, 0.9, seed=i) for i in range(3)]
    assert policy.off_critical_path(poor, [100, 60, 95], 3) == [False, True, True]
    assert policy.off_critical_path(good[:1] + poor[1:], [100, 60, 95], 3) == [False, True, False]
    assert policy.off_critical_path(good, [100, 60, 95], 3) == [False, False, False]
    drained = trained(policy, 0.9, seed=4)
    assert policy.choose(drained, 3) > 0 and policy.choose(drained, 3, off_critical_path=True) == 0
    assert DraftLengthPolicy(4, adaptive=False).choose(drained, 3, off_critical_path=True) == 4  # a fixed K is the user's


def test_evidence_per_kind_of_guess():
    """Drafts after short n-gram matches fail where drafts after long ones hold: with the key of each
    verification kept, a request drafts for its long matches and not its short ones, where its overall
    acceptance (between the two) would draft after both. A new request starts from the engine's evidence for
    each key."""
    policy = DraftLengthPolicy(5)
    feed_cost(policy, 1.0, 0.05)
    req, rng = make_req(), random.Random(0)
    for _ in range(40):
        for key, alpha in ((1, 0.1), (4, 0.9)):
            accepted = 0
            while accepted < 5 and rng.random() < alpha:
                accepted += 1
            policy.observe(req, 5, accepted, key)
    assert policy.acceptance(req, 1) < 0.3 < 0.7 < policy.acceptance(req, 4)
    assert policy.acceptance(req, 1) < policy.acceptance(req) < policy.acceptance(req, 4)
    assert policy.choose(req, 8, key=1) == 0 < policy.choose(req, 8)  # the blended estimate drafts after both
    assert policy.choose(req, 8, key=4) >= 3
    fresh = make_req("fresh")
    # nothing of its own yet: every request's evidence, whatever its key, is its prior
    assert policy.acceptance(fresh, 1) < policy.acceptance(fresh) < policy.acceptance(fresh, 4)
    assert DraftLengthPolicy(5).acceptance(fresh) == pytest.approx(0.5)  # an engine that verified nothing yet
    assert policy.acceptance(fresh, 1) < 0.3 and policy.acceptance(fresh, 4) > 0.7
    assert policy.acceptance(fresh, 2) == pytest.approx(0.5)  # no request drafted after a 2-token match


def test_scored_trees_are_priced_with_the_acceptance_of_their_kind_of_guess():
    """An n-gram trie's shares are 1.0 along a single sighting whatever match it continues; what is kept is not.
    A node's chance is alpha (of the tree's key) times its score, so a single sighting's chain is priced as the
    chain of that key is, and siblings split their level's worth."""
    policy = DraftLengthPolicy(8)
    feed_cost(policy, 1.0, 0.05)
    chain = DraftTree([5, 6, 7, 8], [-1, 0, 1, 2], [1.0, 1.0, 1.0, 1.0])  # one sighting: every score 1
    req = make_req()
    for _ in range(30):
        policy.observe_tree(req, chain, 0, key=1)  # after a 1-token match nothing is kept
        policy.observe_tree(req, chain, 4, key=4)  # after a 4-token match everything is
    assert policy.choose_tree(req, 8, chain, key=1) == 0 == policy.choose(req, 8, key=1)
    assert policy.choose_tree(req, 8, chain, key=4) == 4
    fresh = make_req("fresh")  # the engine's evidence per key is its prior
    assert policy.choose_tree(fresh, 8, chain, key=1) == 0 < policy.choose_tree(fresh, 8, chain, key=4)
    # two siblings, each worth half its level: both pay after long matches (alpha near 1), neither after short
    forks = DraftTree([5, 6], [-1, -1], [0.5, 0.5])
    assert policy.choose_tree(req, 1, forks, key=4) == 2
    assert policy.choose_tree(req, 1, forks, key=1) == 0


def test_evidence_lives_in_the_policy_until_forgotten():
    policy = DraftLengthPolicy(5)
    req = trained(policy, 0.9)
    assert policy.acceptance(req) > 0.8 and not hasattr(req, "draft_accepts")
    engine = policy.acceptance(make_req("new"))  # what a request with no evidence of its own starts from
    assert policy.acceptance(req) > engine > 0.5
    policy.forget([req.req_id])
    assert policy.acceptance(req) == pytest.approx(engine) and req.req_id not in policy._evidence


def _best_k_by_definition(policy: DraftLengthPolicy, alpha: float, batch_size: int, limit: int) -> int:
    a, b = policy.cost_model()
    if batch_size <= 1:
        costs = [a + b * policy.rows(1 + k) for k in range(limit + 1)]
    else:
        costs = [a / batch_size + b * (1 + k) for k in range(limit + 1)]
    rates = [expected_tokens(alpha, k) / cost for k, cost in enumerate(costs)]
    best = max(range(len(rates)), key=rates.__getitem__)
    return best if rates[best] >= rates[0] * (1.0 + policy.margin) else 0


def test_best_k_equals_its_definition_as_the_cost_model_changes():
    """best_k keeps each step's costs and inlines E(k)/cost; it must pick what the formula picks, ties and the
    margin included, at every alpha, batch size and limit, before and after the cost model is refitted."""
    rng = random.Random(0)
    policy = DraftLengthPolicy(8, rows=lambda n: max(n, 4))
    for round_ in range(4):
        if round_:
            feed_cost(policy, a=rng.uniform(0.0, 5.0), b=rng.uniform(0.01, 1.0), seed=round_)
        for _ in range(500):
            alpha = rng.choice([0.0, 1.0, 0.5, rng.random()])
            batch, limit = rng.choice([0, 1, 2, 8, 256]), rng.randint(0, 8)
            assert policy.best_k(alpha, batch, limit) == _best_k_by_definition(policy, alpha, batch, limit)


def test_confidence_bins_and_their_priors():
    assert Confidence.of("h", 0.0) == Confidence("h", 0)
    assert Confidence.of("h", 1.0) == Confidence("h", CONFIDENCE_BINS - 1)
    assert Confidence.of("h", float("nan")) == Confidence("h", 0)  # (a head over NaN hidden states: no crash)
    assert Confidence.of("h", 0.55).bin == 5 and Confidence.of("h", 0.55).prior == pytest.approx(0.55)
    assert Confidence.of("h", 0.3) != Confidence.of("other", 0.3)
    policy, req = DraftLengthPolicy(4), make_req()
    # nothing verified yet: a bin's acceptance is its middle (a calibrated drafter's), not the policy's prior
    assert policy.acceptance(req, Confidence.of("h", 0.95)) == pytest.approx(0.95)
    assert policy.acceptance(req, Confidence.of("h", 0.05)) == pytest.approx(0.05)


def test_scored_chain_is_cut_where_its_drafts_stop_paying():
    """A chain priced by its drafts' probabilities keeps the sure drafts before a doubtful one, and the same chain
    priced by the head's overall acceptance does not see where it turns."""
    policy = DraftLengthPolicy(8)
    feed_cost(policy, 1.0, 0.05)
    req, chain = make_req(), [5, 6, 7, 8, 9]
    sure_then_not = [0.99, 0.98, 0.97, 0.05, 0.9]
    n, rate = policy.price(req, 8, chain, "h", sure_then_not)
    assert n == 3 and rate > policy.price(req, 8, [], "h")[1]
    assert policy.price(req, 8, chain, "h", [0.02] * 5)[0] == 0  # hopeless from the first
    assert policy.price(req, 8, chain, "h", [0.99] * 5)[0] == 5
    assert policy.price(req, 8, chain, "h")[0] not in (0, 3)  # by the head's prior alone (0.5 per draft)


def test_verified_scored_chains_teach_each_confidence_bin():
    """An overconfident head: drafts it gives 0.9 are kept a third of the time. After verifications the 0.9 bin
    reads about 1/3, a bin it never reached keeps its prior, and the chain it was sure of is cut short where a
    policy that believed it would verify it all; the key's own counts take each verification as any chain's."""
    policy = DraftLengthPolicy(4)
    feed_cost(policy, 1.0, 0.05)
    req, rng = make_req(), random.Random(0)
    for _ in range(300):
        accepted = 0
        while accepted < 4 and rng.random() < 1 / 3:
            accepted += 1
        policy.observe(req, 4, accepted, "h", [0.95] * 4)
    assert policy.acceptance(req, Confidence.of("h", 0.95)) == pytest.approx(1 / 3, abs=0.08)
    assert policy.acceptance(req, Confidence.of("h", 0.45)) == pytest.approx(0.45)
    assert policy.acceptance(req, "h") == pytest.approx(1 / 3, abs=0.08)
    assert policy.acceptance(make_req("fresh"), Confidence.of("h", 0.95)) == pytest.approx(1 / 3, abs=0.1)
    believer = DraftLengthPolicy(4)
    feed_cost(believer, 1.0, 0.05)
    assert policy.price(req, 8, [1, 2, 3, 4], "h", [0.95] * 4)[0] <= 1 < 4 == believer.price(
        make_req(), 8, [1, 2, 3, 4], "h", [0.95] * 4)[0]
    # the first rejected draft's bin takes the failure, the drafts after it are no evidence
    other = make_req()
    policy.observe(other, 3, 1, "g", [0.95, 0.15, 0.55])
    assert policy.acceptance(other, Confidence.of("g", 0.95)) > 0.95 > 0.15 > policy.acceptance(
        other, Confidence.of("g", 0.15))
    assert policy.acceptance(other, Confidence.of("g", 0.55)) == pytest.approx(0.55)
