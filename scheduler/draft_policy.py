"""How many tokens to draft for each request this step (torch-free, deterministic).

Acceptance model (geometric): each draft position is accepted with probability alpha, independently, given the
positions before it were. Verifying k drafts then yields, counting the target's own token,

    E(k) = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)        (= k + 1 when alpha = 1)

tokens. One verification of k drafts with ``acc`` accepted is ``acc`` successes and, if acc < k, one failure of
that Bernoulli(alpha); a request's evidence is kept as exponentially discounted counts S and F (the policy's
:class:`Evidence` per request id, forgotten when the request finishes) and read as the posterior mean under a
Beta prior of strength m centred on the engine's acceptance so far (every request's evidence, discounted by
ENGINE_DECAY per verification, itself read with alpha0 as its prior), so a new request starts from what the drafter
has been achieving here rather than from a guess:

    alpha = (S + alpha_engine * m) / (S + F + m),   alpha_engine = (S_engine + alpha0 * m) / (S_engine + F_engine + m)

Cost model: a step over n tokens takes cost(n) = a + b * rows(n), fitted by least squares over a sliding window
of measured steps (with one pass that drops outliers beyond 3 median absolute residuals, e.g. a GC pause).
rows(n) is the row count the target's matmuls really run n tokens as (on CPU they pad to fast widths, so 4
tokens cost what 2 do; identity elsewhere). Until the window holds steps of two distinct sizes, a prior
(a = 1, b = 0.05, relative units) stands in. A lone request's step with k drafts costs a + b * rows(1 + k); in
a batch of B requests one request's share is  a / B + b * (1 + k).

Choice: k in [0, num_speculative_tokens] maximising E(k) / (a / B + b * (1 + k)), tokens per unit of time.
k = 0 unless the best k beats it by ``margin``; after ``probe_after`` steps in a row at k = 0 the request gets
one cheap probe of ``probe_k`` drafts, so a request whose text turned predictable can recover. Where a probe costs
more than the rows it verifies (a drafter that runs a model to propose), each probe that leaves the request at k = 0
doubles the wait before the next, up to ``probe_backoff`` times; a choice of k > 0 resets it.

Closed batches (offline ``generate``, where the time of the whole batch is what counts): once nothing waits, the
batch only drains and ends with its last request. Request j, with budget r_j tokens left (``max_tokens``; EOS may
end it sooner) and E_j expected tokens per step at its best k, needs about r_j / E_j more steps, so the batch
needs T = max_j r_j / E_j. A request with r_i < T finishes before the batch does even without drafting: its drafts
would bring its tokens sooner but not the end of the batch, and make every step dearer. It drafts nothing.

Kinds of guess (keys). A drafter may tell how strong each proposal's evidence is: an n-gram draft's key is the
length of the match it continues (a longer match is accepted far more often: on open-ended answers a 1-token
match is mostly a guess, a 4-token match mostly right; docs/benchmarks.md has the figures). A drafter that
proposes cheaply then proposes first, and the policy sizes k with the request's evidence for that key, read
with the engine's evidence for the key (every request's, discounted by ENGINE_DECAY per verification) as the
prior mean:

    alpha(req, key) = (S_key + alpha_key * m) / (S_key + F_key + m),   alpha_key = (S + alpha0 * m) / (S + F + m)

The request's overall counts (above) still take every verification.

Token trees. A tree drafter proposes nodes best first (``specray.tree``); verifying its first n nodes keeps, in
expectation, 1 + sum_{i<n} P(path to node i accepted) tokens. The path probability is the product of the nodes'
scores when the drafter gives them, each times alpha (as above, of the tree's key): a node is accepted when its
level continues at all (alpha, a tree's per-level acceptance) and the continuation is this node (its score, the
drafter's share for it among its siblings: a suffix tree's frequency, an n-gram trie's share of sightings). So a
single sighting's chain (every score 1) is priced as a chain of its kind of match is, alpha^depth, and siblings
split what their level is worth. The policy verifies the n in [0, nodes] maximising expected tokens per
unit cost, with the margin and probes of chains: the same rule, with node counts in place of k. A proposal that is
one investment (``Proposal.whole``: lookahead decoding's window, which pays by what it teaches the drafter as well
as by its accepted nodes) is verified all or nothing: all when the whole tree's rate beats drafting nothing by the
margin, or as the probe.

Confidence. A drafter that runs a model can tell its probability p_i for each draft of a chain (a hidden-state
head: the softmax of its own logits at its greedy choice). Were it calibrated, p_i would be the chance the target
keeps d_i given it kept the drafts before; heads are not (a small one is overconfident), but p_i still sorts
its drafts from likely to hopeless. So each draft is keyed by its ``Confidence`` (the drafter's key and the
tenth of [0, 1] its p_i falls in) and read with that key's evidence, whose prior mean before any verification is
the bin's middle (the calibrated guess), and a chain's first n drafts keep in expectation

    E(n) = 1 + sum_{j<=n} prod_{i<=j} alpha(req, Confidence(key, bin(p_i)))

tokens, priced as a tree's (the best n in [0, drafted]). A verified chain is evidence for each bin it reached:
one success per accepted draft's bin and one failure for the first rejected draft's bin; its overall counts and
its drafter's key take it as any chain's.

Per request, ``SamplingParams.num_speculative_tokens`` caps the engine's (0: that request never drafts).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from statistics import median
from typing import Callable

from specray.tree import DraftTree, depths, path_scores

# (a, b): the fixed cost of a step, and of each token in it, in relative units, until steps of two sizes are
# measured. A step's fixed cost dwarfs one more token's (on a CPU, and far more on a GPU); a prior that prices
# tokens dearer keeps a batch that has not drafted yet from drafting, so the cost of drafting is never measured
# and the policy never learns it would pay.
PRIOR_COST = (1.0, 0.05)
ENGINE_DECAY = 0.99  # the engine's evidence per key is every request's, so it forgets more slowly


@dataclass
class Evidence:
    """What the policy knows of one request: discounted counts of accepted / rejected draft positions (the
    evidence of the geometric acceptance model), the same kept apart per kind of guess ({key: [S, F]}), and how
    many steps in a row it chose to draft nothing."""

    accepts: float = 0.0
    rejects: float = 0.0
    keyed: dict[int, list[float]] = field(default_factory=dict)
    undrafted_steps: int = 0
    probing: bool = False  # the last choice was a probe
    probes: int = 0  # probes since the last choice of k > 0


_NO_EVIDENCE = Evidence()
CONFIDENCE_BINS = 10


@dataclass(frozen=True)
class Confidence:
    """The kind of a draft its drafter gave probability p for: the drafter's key (``source``) and the tenth of
    [0, 1] p falls in; before any verification its acceptance is taken to be the bin's middle."""

    source: object
    bin: int

    @classmethod
    def of(cls, source, p: float) -> "Confidence":
        if p != p:  # NaN: a head over a request's non-finite hidden states (that request's output is lost, no more)
            return cls(source, 0)
        return cls(source, min(max(int(p * CONFIDENCE_BINS), 0), CONFIDENCE_BINS - 1))

    @property
    def prior(self) -> float:
        return (self.bin + 0.5) / CONFIDENCE_BINS


def expected_tokens(alpha: float, k: int) -> float:
    """E(k): tokens kept per verification of k drafts under the geometric model (the target's own included)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _discount(counts: list[float], decay: float, accepted: int, rejected: bool) -> None:
    counts[0] = decay * counts[0] + accepted
    counts[1] = decay * counts[1] + rejected


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares t = a + b * n over (n, t) points with at least two distinct n."""
    mean_n = sum(n for n, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    var = sum((n - mean_n) ** 2 for n, _ in points)
    b = sum((n - mean_n) * (t - mean_t) for n, t in points) / var
    return mean_t - b * mean_n, b


def robust_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Fit, drop points further than 3 median absolute residuals from the line, fit again."""
    a, b = fit_line(points)
    residuals = [abs(t - a - b * n) for n, t in points]
    cut = 3.0 * median(residuals) + 1e-9 * max(abs(t) for _, t in points)
    kept = [p for p, r in zip(points, residuals) if r <= cut]
    if len({n for n, _ in kept}) >= 2:
        a, b = fit_line(kept)
    return a, b


class DraftLengthPolicy:
    def __init__(self, num_speculative_tokens: int, adaptive: bool = True, *, window: int = 64, margin: float = 0.03,
                 probe_after: int = 8, probe_k: int = 2, probe_backoff: int = 0, prior_alpha: float = 0.5,
                 prior_strength: float = 2.0, decay: float = 0.9, rows: Callable[[int], int] | None = None):
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} must be an int >= 0")
        if window < 2:
            raise ValueError(f"window={window} must be >= 2 steps to fit a line")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay={decay} must be in (0, 1]; 1 keeps all evidence forever")
        self.num_speculative_tokens = num_speculative_tokens
        self.adaptive = adaptive
        self.margin = margin
        self.probe_after = probe_after
        self.probe_k = probe_k
        self.probe_backoff = probe_backoff
        self.prior_alpha = prior_alpha
        self.prior_strength = prior_strength
        self.decay = decay
        self.rows = rows or (lambda n: n)
        # the engine's [S, F] per key, over every request (None: every verification, whatever its key)
        self._key_evidence: dict[int | None, list[float]] = {None: [0.0, 0.0]}
        self._evidence: dict[str, Evidence] = {}  # per request id, until forget()
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._cost = PRIOR_COST
        self._stale = False
        self._costs_of: tuple[float, float] | None = None  # the cost model _costs was computed with
        self._costs: dict[tuple[int, int], list[float]] = {}  # (batch size, limit) -> costs for k = 0..limit

    # ---- cost -----------------------------------------------------------------------------------------
    def observe_step(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        """Record one measured step over ``num_tokens`` tokens (``num_seqs`` requests; the fit uses their rows)."""
        if num_tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        self._samples.append((float(self.rows(num_tokens)), seconds))
        self._stale = True

    def cost_model(self) -> tuple[float, float]:
        """(a, b) of cost(n) = a + b * rows(n): fitted once the window has two distinct n, else the prior."""
        if self._stale:
            self._stale = False
            self._cost = self._fit()
        return self._cost

    def _fit(self) -> tuple[float, float]:
        points = list(self._samples)
        if len({n for n, _ in points}) < 2:
            return PRIOR_COST
        a, b = robust_fit(points)
        a, b = max(a, 0.0), max(b, 0.0)  # noise can tip a small term negative; costs are not
        return (a, b) if a + b > 0 else PRIOR_COST

    # ---- acceptance -----------------------------------------------------------------------------------
    def evidence(self, req_id: str) -> Evidence:
        """The evidence kept for one request (created empty on first use)."""
        found = self._evidence.get(req_id)
        if found is None:
            found = self._evidence[req_id] = Evidence()
        return found

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop finished requests' evidence."""
        for req_id in req_ids:
            self._evidence.pop(req_id, None)

    def observe(self, req, num_drafted: int, num_accepted: int, key=None, scores: list[float] | None = None) -> None:
        """Update ``req``'s acceptance evidence from one verification of ``num_drafted`` drafts (of ``key``; a
        chain whose drafter gave each draft's probability as ``scores``: each draft's :class:`Confidence` too)."""
        assert 0 <= num_accepted <= num_drafted, (num_drafted, num_accepted)
        if num_drafted == 0:
            return
        rejected = num_accepted < num_drafted
        ev = self.evidence(req.req_id)
        ev.accepts = self.decay * ev.accepts + num_accepted
        ev.rejects = self.decay * ev.rejects + rejected
        _discount(self._key_evidence[None], ENGINE_DECAY, num_accepted, rejected)
        if key is not None:
            _discount(ev.keyed.setdefault(key, [0.0, 0.0]), self.decay, num_accepted, rejected)
            _discount(self._key_evidence.setdefault(key, [0.0, 0.0]), ENGINE_DECAY, num_accepted, rejected)
        if scores is not None:
            assert len(scores) >= num_drafted, (len(scores), num_drafted)
            for i, p in enumerate(scores[: min(num_accepted + 1, num_drafted)]):  # up to the first rejected draft
                conf = Confidence.of(key, p)
                accepted = i < num_accepted
                _discount(ev.keyed.setdefault(conf, [0.0, 0.0]), self.decay, accepted, not accepted)
                _discount(self._key_evidence.setdefault(conf, [0.0, 0.0]), ENGINE_DECAY, accepted, not accepted)

    def observe_tree(self, req, tree: DraftTree, num_accepted: int, key: int | None = None) -> None:
        """One verification of ``tree`` that kept ``num_accepted`` of its nodes (a path): the per-level evidence
        (accepted levels, one rejection if the path stopped above the tree's deepest node)."""
        if len(tree):
            self.observe(req, max(depths(tree.parents)), num_accepted, key)

    def choose_tree(self, req, batch_size: int, tree: DraftTree, off_critical_path: bool = False,
                    key: int | None = None) -> int:
        """How many of ``tree``'s first nodes ``req`` should verify next step (see the module docstring)."""
        limit = min(len(tree), self.num_speculative_tokens_for(req))
        if not self.adaptive or limit == 0:
            return limit
        if off_critical_path:
            return 0
        return self._with_probes(req, self._best_nodes(req, batch_size, tree, key, limit)[0], limit)

    def price(self, req, batch_size: int, drafts: list[int] | DraftTree, key=None,
              scores: list[float] | None = None) -> tuple[int, float]:
        """How many of a proposal's first drafts (a chain's, or a tree's nodes) are worth verifying for ``req``,
        and the expected tokens per unit cost of verifying them, by the rule of :meth:`choose_tree` (a chain is a
        tree without scores: alpha^depth per node, the geometric model; with its drafts' probabilities as
        ``scores``, each read with its :class:`Confidence`'s evidence) but with no probe and no other state touched:
        for weighing the proposals of several drafters against each other, and for cutting a scored chain."""
        tree = drafts if isinstance(drafts, DraftTree) else DraftTree(list(drafts), list(range(-1, len(drafts) - 1)))
        limit = min(len(tree), self.num_speculative_tokens_for(req))
        if not self.adaptive:
            return limit, 0.0
        if scores is not None:
            assert not isinstance(drafts, DraftTree) and len(scores) == len(drafts), (len(scores), len(drafts))
            gains = list(itertools.accumulate((self.acceptance(req, Confidence.of(key, p)) for p in scores),
                                              operator.mul))
            return self._best_of_gains(batch_size, gains, limit)
        return self._best_nodes(req, batch_size, tree, key, limit)

    def knows(self, key) -> bool:
        """Whether any verification of proposals of ``key`` has been observed (by any request)."""
        return sum(self._key_evidence.get(key, (0.0, 0.0))) > 0.0

    def settle(self, req, n: int, limit: int) -> int:
        """``n`` drafts (chosen by weighing proposals with :meth:`price`), or when n = 0 a probe if one is due:
        the probe rule of :meth:`choose`, once per request and step."""
        if not self.adaptive:
            return n
        return self._with_probes(req, n, limit)

    def _best_nodes(self, req, batch_size: int, tree: DraftTree, key, limit: int) -> tuple[int, float]:
        """(n, rate): the n in [0, limit] of ``tree``'s first nodes with the best expected tokens per unit cost
        (0 unless it beats none by the margin)."""
        return self._best_of_gains(batch_size, self._tree_gains(req, tree, key) if limit else [], limit)

    def _best_of_gains(self, batch_size: int, gains: list[float], limit: int) -> tuple[int, float]:
        """(n, rate) of :meth:`_best_nodes` given each node's probability of being kept (``gains``)."""
        costs = self._step_costs(batch_size, limit)
        base_rate = 1.0 / costs[0]
        if limit == 0:
            return 0, base_rate
        best, best_rate, expected = 0, base_rate, 1.0
        for n in range(1, limit + 1):
            expected += gains[n - 1]
            rate = expected / costs[n]
            if rate > best_rate:
                best, best_rate = n, rate
        return (best, best_rate) if best_rate >= base_rate * (1.0 + self.margin) else (0, base_rate)

    def choose_whole(self, req, batch_size: int, tree: DraftTree, off_critical_path: bool = False,
                     key: int | None = None) -> int:
        """All of ``tree``'s nodes or none, for a proposal that is one investment (``Proposal.whole``): all when
        the whole tree's expected tokens per unit cost beat drafting nothing by the margin, or when a probe is
        due (the drafter learns only from verified trees). Capped by the request's draft count."""
        limit = min(len(tree), self.num_speculative_tokens_for(req))
        if not self.adaptive or limit == 0:
            return limit
        if off_critical_path:
            return 0
        costs = self._step_costs(batch_size, limit)
        expected = 1.0 + sum(self._tree_gains(req, tree, key)[:limit])
        pays = expected / costs[limit] >= (1.0 + self.margin) / costs[0]
        return limit if self._with_probes(req, limit if pays else 0, limit) else 0

    def _tree_gains(self, req, tree: DraftTree, key: int | None) -> list[float]:
        """Per node, the probability that the path to it is kept: prod over its nodes of alpha * score, i.e.
        alpha^depth * the path's score product (alpha^depth without scores)."""
        alpha = self.acceptance(req, key)
        if tree.scores is None:
            return path_scores(tree, alpha)
        return [s * alpha ** d for s, d in zip(path_scores(tree, 1.0), depths(tree.parents))]

    def wait_or_probe(self, req, off_critical_path: bool = False) -> int:
        """No drafts for ``req`` this step unless a probe is due (then ``probe_k``): for a request whose last
        proposal was priced at nothing and that has no proposal to price now (a tree drafter waiting to be asked)."""
        limit = self.num_speculative_tokens_for(req)
        if not self.adaptive or limit == 0:
            return limit
        return 0 if off_critical_path else self._with_probes(req, 0, limit)

    def _with_probes(self, req, n: int, limit: int) -> int:
        """``n`` drafts, or after ``probe_after`` steps in a row without any (times 2 per probe since the last
        k > 0, up to ``probe_backoff`` doublings) a probe of ``probe_k``."""
        ev = self.evidence(req.req_id)
        ev.probing = False
        if n > 0:
            ev.undrafted_steps = ev.probes = 0
            return n
        if ev.undrafted_steps >= self.probe_after << min(ev.probes, self.probe_backoff):
            ev.undrafted_steps, ev.probing = 0, True
            ev.probes += 1
            return min(self.probe_k, limit)
        ev.undrafted_steps += 1
        return 0

    def acceptance(self, req, key: int | None = None) -> float:
        """alpha: the posterior mean per-position acceptance probability of ``req``'s drafts (of ``key``)."""
        ev = self._evidence.get(req.req_id, _NO_EVIDENCE)
        prior = self._posterior(*self._key_evidence.get(key, (0.0, 0.0)),
                                key.prior if isinstance(key, Confidence) else self.prior_alpha)
        if key is None:
            return self._posterior(ev.accepts, ev.rejects, prior)
        return self._posterior(*ev.keyed.get(key, (0.0, 0.0)), prior)

    def _posterior(self, accepts: float, rejects: float, prior: float) -> float:
        """The Beta posterior mean of S accepts and F rejects with a prior of strength m centred on ``prior``."""
        m = self.prior_strength
        return (accepts + prior * m) / (accepts + rejects + m)

    # ---- choice ---------------------------------------------------------------------------------------
    def num_speculative_tokens_for(self, req) -> int:
        """The engine's ``num_speculative_tokens``, capped by the request's own (None: no cap)."""
        cap = req.sampling_params.num_speculative_tokens
        return self.num_speculative_tokens if cap is None else min(self.num_speculative_tokens, cap)

    def choose(self, req, batch_size: int, off_critical_path: bool = False, key: int | None = None) -> int:
        """How many drafts ``req`` should verify next step, in a batch of ``batch_size`` requests, when its
        proposal is of ``key`` (None: not known yet, or the drafter tells none); none when it is
        ``off_critical_path`` of a closed batch (see :meth:`off_critical_path`)."""
        limit = self.num_speculative_tokens_for(req)
        if not self.adaptive or limit == 0:
            return limit
        if off_critical_path:
            return 0
        return self._with_probes(req, self.best_k(self.acceptance(req, key), batch_size, limit), limit)

    def off_critical_path(self, reqs: list, budgets: list[int], batch_size: int) -> list[bool]:
        """For a closed batch that only drains: which of ``reqs`` (every running request; ``budgets``: the tokens
        each may still produce) finish before the batch ends even without drafting: r_i < max_j r_j / E_j."""
        rates = []
        for req in reqs:
            alpha = self.acceptance(req)
            limit = self.num_speculative_tokens_for(req)
            k = self.best_k(alpha, batch_size, limit) if self.adaptive else limit
            rates.append(expected_tokens(alpha, k))
        steps = max(r / e for r, e in zip(budgets, rates))
        return [r < steps for r in budgets]

    def _step_costs(self, batch_size: int, limit: int) -> list[float]:
        """One request's share of a step's cost for k = 0..limit drafts, kept until the cost model changes
        (every request of a step asks with the same batch size)."""
        cost = self.cost_model()
        if cost != self._costs_of:
            self._costs_of, self._costs = cost, {}
        key = (max(batch_size, 1), limit)
        costs = self._costs.get(key)
        if costs is None:
            a, b = cost
            if batch_size <= 1:
                costs = [a + b * self.rows(1 + k) for k in range(limit + 1)]
            else:
                costs = [a / batch_size + b * (1 + k) for k in range(limit + 1)]
            self._costs[key] = costs
        return costs

    def best_k(self, alpha: float, batch_size: int, limit: int | None = None) -> int:
        """The k in [0, limit] (default: the engine's ``num_speculative_tokens``) maximising expected tokens per
        unit cost; 0 unless it beats k = 0 by ``margin``."""
        limit = self.num_speculative_tokens if limit is None else limit
        costs = self._step_costs(batch_size, limit)
        # rate(k) = expected_tokens(alpha, k) / cost(k), inlined (the same float operations): this runs for every
        # drafting request every step
        spread = 1.0 - alpha
        best, best_rate, base_rate = 0, -math.inf, 0.0
        for k, cost in enumerate(costs):
            rate = (k + 1.0) / cost if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / spread / cost
            if k == 0:
                base_rate = rate
            if rate > best_rate:  # ties go to the smaller k
                best, best_rate = k, rate
        return best if best_rate >= base_rate * (1.0 + self.margin) else 0
