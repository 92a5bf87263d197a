"""specray.sampling: warpers keep exactly the right supports, seeded streams are batch-independent, sampling
reproduces the warped distribution (chi-square), and nothing syncs with the host."""


import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specray.sampling import (
    SamplingBatch,
    compute_logprobs,
    logits_to_probs,
    make_generator,
    sample,
    sample_logits,
)
from specray.sampling_params import SamplingParams as SP

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def build(params, seeds=None, device="cpu", repeats=None):
    seeds = seeds or [None] * len(params)
    return SamplingBatch.build(params, [make_generator(s, device) for s in seeds], device, repeats)


def support(probs_row):
    return set(torch.nonzero(probs_row > 0).flatten().tolist())


def test_recorder_catches_syncs(no_host_sync):
    x = torch.randn(4)
    for f in (lambda: x[0].item(), lambda: bool(x[0] > 0), lambda: x.nonzero(), lambda: x[x > 0],
              lambda: int(x.argmax()), lambda: x.tolist()):
        with pytest.raises(AssertionError):
            with no_host_sync():
                f()


# ---- warpers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_zero_is_argmax(device):
    torch.manual_seed(0)
    logits = torch.randn(6, 50, device=device)
    batch = build([SP(temperature=0.0)] * 6, device=device)
    probs = logits_to_probs(logits, batch)
    expected = logits.argmax(-1)
    assert torch.equal(probs, torch.nn.functional.one_hot(expected, 50).float())
    assert torch.equal(sample(probs, batch), expected)
    assert torch.equal(sample_logits(logits, batch), expected)
    # Mixed with sampled rows (and seeded greedy rows, whose generator stays untouched).
    gens = [make_generator(1, device), None, make_generator(2, device), None, None, None]
    state = gens[0].get_state()
    params = [SP(temperature=0.0, seed=1), SP(temperature=1.0), SP(temperature=0.0, seed=2, top_k=3),
              SP(temperature=0.5, top_p=0.5), SP(temperature=0.0, min_p=0.5), SP(temperature=2.0)]
    mixed = SamplingBatch.build(params, gens, device)
    tokens = sample_logits(logits, mixed)
    for i in (0, 2, 4):
        assert tokens[i] == expected[i]
        assert torch.equal(logits_to_probs(logits, mixed)[i], probs[i])
    assert torch.equal(gens[0].get_state(), state)


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    for t in (0.3, 1.0, 2.5):
        probs = logits_to_probs(logits, build([SP(temperature=t)]))
        torch.testing.assert_close(probs, torch.softmax(logits / t, -1))
    # a positive temperature however small keeps the largest logits (ties shared), never NaN: logits / T once
    # overflowed to inf below ~1e-37, and a T under float32's range rounded to 0, and the draw picked token 0
    logits = torch.tensor([[1.0, 30.0, 29.0, float("-inf")], [5.0, 2.0, 5.0, 0.0]])
    for t in (1e-5, 1e-40, 5e-324):
        batch = build([SP(temperature=t, seed=1)] * 2, seeds=[1, 1])
        probs = logits_to_probs(logits, batch)
        torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0]]))
        assert sample(probs, batch).tolist()[0] == 1


LOG_P = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)


@pytest.mark.parametrize(
    "params, kept",
    [
        (SP(top_k=1), {1}),
        (SP(top_k=2), {1, 3}),
        (SP(top_k=3), {1, 3, 2}),
        (SP(top_k=4), {0, 1, 2, 3}),
        (SP(top_k=100), {0, 1, 2, 3}),
        (SP(top_p=0.4), {1}),  # 0.5 >= 0.4
        (SP(top_p=0.75), {1, 3}),  # 0.8 >= 0.75
        (SP(top_p=0.85), {1, 3, 2}),  # 0.95 >= 0.85
        (SP(top_p=0.99), {0, 1, 2, 3}),
        (SP(min_p=0.2), {1, 3, 2}),  # threshold 0.1 drops 0.05
        (SP(min_p=0.5), {1, 3}),  # threshold 0.25
        (SP(min_p=0.7), {1}),  # threshold 0.35
        (SP(min_p=1.0), {1}),
        (SP(top_p=1e-50), {1}),  # 0 in float32: once no token kept, NaN probs (token 0 drawn)
        # top-p acts on the top-k renormalized probs: {0.5, 0.3, 0.15}/0.95 reaches 0.83 after two tokens
        # (on the raw probs it would need three).
        (SP(top_k=3, top_p=0.83), {1, 3}),
        (SP(top_p=0.83), {1, 3, 2}),
        (SP(top_p=0.9, min_p=0.4), {1, 3}),
    ],
)
def test_warper_support(params, kept):
    probs = logits_to_probs(LOG_P[None], build([params]))[0]
    assert support(probs) == kept
    expected = torch.zeros(4)
    idx = sorted(kept)
    expected[idx] = LOG_P.exp()[idx] / LOG_P.exp()[idx].sum()
    torch.testing.assert_close(probs, expected)


def test_top_k_keeps_ties_with_the_kth():
    probs = logits_to_probs(torch.tensor([[3.0, 2.0, 2.0, 1.0]]), build([SP(top_k=2)]))[0]
    assert support(probs) == {0, 1, 2}


def test_rows_use_their_own_params():
    """Each row of a mixed batch warps exactly as it would alone."""
    torch.manual_seed(1)
    params = [SP(), SP(top_k=3), SP(top_p=0.6, temperature=0.7), SP(min_p=0.2), SP(temperature=0.0),
              SP(top_k=5, top_p=0.8, min_p=0.1, temperature=1.3)]
    logits = torch.randn(len(params), 20)
    together = logits_to_probs(logits, build(params))
    for i, sp in enumerate(params):
        torch.testing.assert_close(together[i], logits_to_probs(logits[i : i + 1], build([sp]))[0])
    torch.testing.assert_close(together.sum(-1), torch.ones(len(params)))


def test_build_repeats_rows():
    gens = [make_generator(1, "cpu"), None]
    batch = SamplingBatch.build([SP(top_k=3), SP(temperature=0.0)], gens, "cpu", repeats=[3, 2])
    assert len(batch) == 5
    assert batch.top_k.tolist() == [3, 3, 3, 0, 0]
    assert batch.greedy.tolist() == [False, False, False, True, True]
    assert batch.generators == [gens[0]] * 3 + [None] * 2
    assert batch.seeded_rows == [(gens[0], [0, 1, 2])]
    assert (batch.any_greedy, batch.all_greedy, batch.any_top_k, batch.max_top_k) == (True, False, True, 3)
    again = build([SP(top_k=3), SP(temperature=0.0)], [1, None]).repeat_rows(3)
    assert again.top_k.tolist() == [3, 3, 3, 0, 0, 0] and again.seeded_rows[0][1] == [0, 1, 2]


# ---- seeded streams -----------------------------------------------------------------------------------------


def _draw(batch, logits, steps):
    return torch.stack([sample_logits(logits, batch) for _ in range(steps)], dim=1)  # [N, steps]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_request_same_alone_and_in_batch(device):
    torch.manual_seed(0)
    logits = torch.randn(1, 1000, device=device)
    sp = SP(temperature=1.0, seed=7)
    alone = _draw(build([sp], [7], device), logits, 8)[0]
    others = [SP(), SP(seed=3), SP(temperature=0.0, seed=7), SP(top_k=50, seed=11)]
    for pos in (0, 2, 4):
        params = others[:pos] + [sp] + others[pos:]
        seeds = [p.seed for p in params]
        batch = build(params, seeds, device)
        got = _draw(batch, logits.expand(len(params), -1), 8)[pos]
        assert torch.equal(got, alone), pos
    # K+1 rows sharing one generator: the same stream wherever the request sits.
    alone3 = _draw(build([sp], [7], device, repeats=[3]), logits.expand(3, -1), 4)
    batch = build([SP(seed=5), sp, SP()], [5, 7, None], device, repeats=[2, 3, 1])
    got3 = _draw(batch, logits.expand(6, -1), 4)[2:5]
    assert torch.equal(got3, alone3)


def test_non_contiguous_rows_of_one_generator():
    """Rows that share a generator but are not adjacent still draw in row order from it."""
    g1, g2 = make_generator(3, "cpu"), make_generator(3, "cpu")
    logits = torch.randn(3, 500)
    sp = SP()
    together = sample_logits(logits[[0, 2]], SamplingBatch.build([sp, sp], [g1, g1], "cpu"))
    split = sample_logits(logits, SamplingBatch.build([sp, SP(), sp], [g2, None, g2], "cpu"))
    assert torch.equal(together, split[[0, 2]])


def test_different_seeds_differ_same_seed_repeats():
    logits = torch.zeros(1, 1000)
    a = _draw(build([SP(seed=1)], [1]), logits, 20)
    b = _draw(build([SP(seed=2)], [2]), logits, 20)
    a2 = _draw(build([SP(seed=1)], [1]), logits, 20)
    assert not torch.equal(a, b)
    assert torch.equal(a, a2)


# ---- the distribution ---------------------------------------------------------------------------------------


def reference_warp(logits: np.ndarray, sp: SP) -> np.ndarray:
    """A plain numpy statement of the warpers (temperature, top-k, top-p, min-p), for expectations."""
    z = logits / sp.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.ones_like(p, dtype=bool)
    if sp.top_k:
        keep &= p >= p[order[min(sp.top_k, len(p)) - 1]]
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    if sp.top_p < 1:
        before = np.cumsum(p[order]) - p[order]
        keep[order[before >= sp.top_p]] = False
    keep &= p >= sp.min_p * p.max()
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def assert_distribution(tokens: torch.Tensor, probs: np.ndarray, alpha: float = 1e-3) -> float:
    """Chi-square goodness of fit of ``tokens`` to ``probs``; cells with probability 0 must be empty."""
    counts = np.bincount(tokens.cpu().numpy().ravel(), minlength=len(probs)).astype(np.float64)
    assert counts[probs == 0].sum() == 0, f"tokens outside the support: {counts}"
    on = probs > 0
    pvalue = chisquare(counts[on], probs[on] / probs[on].sum() * counts.sum()).pvalue
    assert pvalue > alpha, f"chi-square p={pvalue:.2e}: counts {counts} vs expected {probs * counts.sum()}"
    return pvalue


@pytest.mark.parametrize("sp", [SP(), SP(temperature=0.7, top_k=5), SP(temperature=1.4, top_p=0.8),
                                SP(min_p=0.15, top_k=6, temperature=0.9)])
def test_sample_reproduces_the_warped_distribution(sp):
    torch.manual_seed(1234)
    logits = torch.randn(8) * 1.5
    expected = reference_warp(logits.double().numpy(), sp)
    n = 100_000
    # Global RNG, one row per draw.
    tokens = sample_logits(logits.expand(n, -1), build([sp] * n))
    assert_distribution(tokens, expected)
    # A seeded request: many rows drawn from its one generator.
    seeded = SP(**{**sp.__dict__, "seed": 99})
    tokens = sample_logits(logits.expand(n, -1), build([seeded], [99], repeats=[n]))
    assert_distribution(tokens, expected)


def test_negative_control_wrong_distribution_fails():
    """The chi-square check above can fail: tokens from the unwarped distribution do not match top-k."""
    torch.manual_seed(5)
    logits = torch.randn(8)
    tokens = sample_logits(logits.expand(100_000, -1), build([SP()] * 100_000))
    with pytest.raises(AssertionError):
        assert_distribution(tokens, reference_warp(logits.double().numpy(), SP(temperature=0.8)))


# ---- logprobs -----------------------------------------------------------------------------------------------


def test_compute_logprobs():
    torch.manual_seed(2)
    logits = torch.randn(3, 10)
    ids = torch.tensor([4, 0, 9])
    logits[1, 7] = logits[1, 0]  # a tie: both count in the rank of either
    chosen, rank, top_ids, top_lp = compute_logprobs(logits, ids, 3)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(chosen, ref[torch.arange(3), ids])
    order = ref.argsort(dim=-1, descending=True).tolist()
    assert rank.tolist()[0] == order[0].index(4) + 1 and rank.tolist()[2] == order[2].index(9) + 1
    assert rank.tolist()[1] == max(order[1].index(0), order[1].index(7)) + 1
    torch.testing.assert_close(top_lp, ref.topk(3, -1).values)
    assert torch.equal(top_ids, ref.topk(3, -1).indices)
    _, rank0, ids0, lp0 = compute_logprobs(logits, ids, 0)
    assert ids0.shape == (3, 0) and lp0.shape == (3, 0) and torch.equal(rank0, rank)


# ---- no host syncs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_has_no_host_sync(no_host_sync, device):
    params = [SP(temperature=0.0), SP(seed=1, top_k=3), SP(top_p=0.7), SP(min_p=0.1, seed=2), SP(temperature=0.0,
                                                                                                   seed=3)]
    batch = build(params, [p.seed for p in params], device, repeats=[1, 2, 1, 3, 1])
    logits = torch.randn(len(batch), 40, device=device)
    greedy = build([SP(temperature=0.0)] * 2, device=device)
    with no_host_sync():
        probs = logits_to_probs(logits, batch)
        sample(probs, batch)
        sample_logits(logits, batch)
        sample_logits(logits[:2], greedy)
        compute_logprobs(logits, torch.zeros(len(batch), dtype=torch.long, device=device), 5)


# ---- SamplingParams: everything a step turns into a tensor is checked when the params are made ----------------
@pytest.mark.parametrize("kw, field", [
    ({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"seed": 2**70}, "seed"), ({"seed": 1.5}, "seed"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": 10**400}, "temperature"),
    ({"top_p": float("nan")}, "top_p"), ({"top_k": 2.5}, "top_k"), ({"top_k": 2**40}, "top_k"),
    ({"min_p": float("nan")}, "min_p"), ({"max_tokens": 2.5}, "max_tokens"), ({"logprobs": 1.5}, "logprobs"),
    ({"stop_token_ids": [True]}, "stop_token_ids"), ({"stop": 123}, "stop=123"),
    ({"stop_token_ids": "7"}, "stop_token_ids='7'"), ({"bad_words": {"x": 1}}, "bad_words"),
    ({"ignore_eos": "false"}, "ignore_eos='false' must be True or False"), ({"skip_special_tokens": None},
                                                                            "skip_special_tokens"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"bad_words_token_ids": [[5]]}, "filled by the engine from bad_words"),
    ({"bad_words": ["x"], "bad_words_token_ids": [[-1]]}, "bad_words_token_ids=.* must be a list of token-id"),
])
def test_sampling_params_refuse_what_a_step_cannot_take(kw, field):
    from specray.sampling_params import SamplingParams

    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_sampling_params_take_every_seed_a_generator_takes():
    from specray.sampling import make_generator
    from specray.sampling_params import SEED_MAX, SEED_MIN, SamplingParams

    for seed in (SEED_MIN, -1, 0, 2**63, SEED_MAX):
        assert make_generator(SamplingParams(seed=seed).seed, "cpu") is not None
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[7]).check(vocab_size=5)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=6).check(vocab_size=5)
