"""specray.tree_verification: the padded layout; greedy trees against a plain reference walk (and chains against
verification.verify); sibling rejection sampling reproduces the target (chi-square over the first token and the
first pair, with a broken variant that must fail); seeded streams are batch-independent; mixed and empty rows;
a 64-node tree; logprobs at the path rows; nothing syncs with the host."""

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specray import tree_verification
from specray.sampling import SamplingBatch, logits_to_probs, make_generator, row_uniforms, sample_by_inversion
from specray.sampling_params import SamplingParams as SP
from specray.tree_verification import pad_tree_drafts, tree_logprobs, unpad_tree, verify_tree
from specray.verification import pad_drafts, verify

GREEDY = SP(temperature=0.0)


def build(params, seeds=None):
    seeds = seeds or [p.seed for p in params]
    return SamplingBatch.build(params, [make_generator(s, "cpu") for s in seeds], "cpu")


def run(logits, tokens, parents, params, seeds=None):
    """pad + verify + unpad -> (kept, accepted nodes, the padded tree, the verdict)."""
    padded = pad_tree_drafts(logits, tokens, parents)
    verdict = verify_tree(padded, build(params, seeds))
    kept, nodes, *_ = unpad_tree(verdict, None)
    return kept, nodes, padded, verdict


# ---- the padded layout --------------------------------------------------------------------------------------


def test_pad_tree_layout():
    V = 5
    logits = torch.arange(11 * V, dtype=torch.float32).view(11, V)  # rows: 5 + 1 + 2 + 3
    tokens = [[1, 2, 3, 4], [], [0], [2, 3]]
    parents = [[-1, -1, 0, 2], [], [-1], [-1, 0]]
    pt = pad_tree_drafts(logits, tokens, parents)
    assert pt.target_logits.shape == (4, 5, V)
    assert pt.target_logits[:, :, 0].tolist() == [[0, 5, 10, 15, 20], [25] * 5, [30, 35, 35, 35, 35],
                                                  [40, 45, 50, 50, 50]]
    assert pt.draft_token_ids.tolist() == [[1, 2, 3, 4], [0] * 4, [0] * 4, [2, 3, 0, 0]]
    assert pt.parent_rows.tolist() == [[0, 0, 1, 3], [0] * 4, [0] * 4, [0, 1, 0, 0]]
    assert pt.depths.tolist() == [[1, 1, 2, 3], [0] * 4, [1, 0, 0, 0], [1, 2, 0, 0]]
    assert pt.num_drafts.tolist() == [4, 0, 1, 2] and pt.draft_counts == [4, 0, 1, 2] and pt.max_depth == 3
    assert pt.children.tolist() == [
        [[1, 2], [3, -1], [-1, -1], [4, -1], [-1, -1]],
        [[-1, -1]] * 5,
        [[1, -1]] + [[-1, -1]] * 4,
        [[1, -1], [2, -1]] + [[-1, -1]] * 3,
    ]
    empty = pad_tree_drafts(logits[:2], [[], []], [[], []])
    assert empty.children.shape == (2, 1, 1) and empty.max_depth == 0 and empty.draft_token_ids.shape == (2, 0)
    with pytest.raises(AssertionError):
        pad_tree_drafts(logits[:3], [[1, 2]], [[-1, 1]])  # a parent must be an earlier node


# ---- greedy -------------------------------------------------------------------------------------------------


def random_tree(rng: random.Random, argmax_of_row, V: int, max_nodes: int, max_depth: int = 4,
                max_children: int = 3, p_match: float = 0.6):
    """(tokens, parents): nodes attach to random earlier rows (depth < max_depth, < max_children children);
    a node's token is its parent row's argmax with probability p_match (if no sibling took it), else another
    token no sibling has, so sibling tokens are distinct."""
    tokens, parents, depth, kids = [], [], {-1: 0}, {-1: []}
    for i in range(rng.randrange(max_nodes + 1)):
        open_ = [p for p in [-1] + list(range(i)) if depth[p] < max_depth and len(kids[p]) < max_children]
        p = rng.choice(open_)
        taken = {tokens[c] for c in kids[p]}
        a = argmax_of_row(p + 1)
        free = [t for t in range(V) if t not in taken and t != a]
        tok = a if a not in taken and rng.random() < p_match else rng.choice(free)
        tokens.append(tok)
        parents.append(p)
        depth[i], kids[i] = depth[p] + 1, []
        kids[p].append(i)
    return tokens, parents


def reference_walk(row_logits: torch.Tensor, tokens, parents):
    """Plain python: from the root follow the child whose token is the argmax of the current row."""
    argmax = row_logits.argmax(-1).tolist()
    cur, nodes = -1, []
    while True:
        nxt = [i for i, p in enumerate(parents) if p == cur and tokens[i] == argmax[cur + 1]]
        if not nxt:
            return [tokens[i] for i in nodes] + [argmax[cur + 1]], nodes
        cur = nxt[0]
        nodes.append(cur)


def random_greedy_batch(seed: int, B: int = 24, V: int = 8, max_nodes: int = 12):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    rows, tokens, parents = [], [], []
    for _ in range(B):
        logits = torch.randn(max_nodes + 1, V, generator=g)
        argmax = logits.argmax(-1).tolist()
        t, p = random_tree(rng, lambda r: argmax[r], V, max_nodes)
        rows.append(logits[: len(t) + 1])
        tokens.append(t)
        parents.append(p)
    return torch.cat(rows), rows, tokens, parents


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("general_path", [False, True])
def test_greedy_equals_the_reference_walk(seed, general_path):
    """Random trees (depth <= 4, branching <= 3); the all-greedy fast path, and greedy rows beside a sampled row
    (the sampling path with one-hot p and u = 0), both give the reference walk."""
    logits, rows, tokens, parents = random_greedy_batch(seed)
    B = len(tokens)
    params = [GREEDY] * B
    if general_path:  # one sampled request appended forces the general path
        logits, params = torch.cat([logits, rows[0]]), params + [SP()]
        tokens, parents = tokens + [tokens[0]], parents + [parents[0]]
    kept, nodes, padded, verdict = run(logits, tokens, parents, params)
    depths = []
    for b in range(B):
        assert (kept[b], nodes[b]) == reference_walk(rows[b], tokens[b], parents[b]), b
        depths.append(len(nodes[b]))
    assert len(set(depths)) >= 3 and max(depths) >= 2, depths  # the trees match to various depths
    # path_rows: row 0, the accepted nodes' rows, then the last one repeated; -1 after the extra token.
    path = verdict.path_rows.tolist()
    for b in range(B):
        n = len(nodes[b])
        assert path[b] == [0] + [i + 1 for i in nodes[b]] + [path[b][n]] * (padded.max_depth - n)
        assert verdict.output_tokens[b].tolist() == kept[b] + [-1] * (padded.max_depth - n)


def test_greedy_duplicate_siblings_deepest_then_smallest_index():
    """Siblings with the same token (a drafter that does not dedupe): the fast path accepts the deepest correct
    node, ties to the smallest index. (The sampling path, greedy rows included, takes the first accepted child;
    the two agree whenever sibling tokens are distinct.)"""
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    a = logits.argmax(-1).tolist()
    trees = [([a[0], a[0], a[2]], [-1, -1, 1]),  # the second duplicate has a correct child: it wins
             ([a[0], a[0], (a[1] + 1) % 8], [-1, -1, 0])]  # no correct child anywhere: the first duplicate
    kept, nodes, _, _ = run(torch.cat([logits, logits]), [t for t, _ in trees], [p for _, p in trees],
                            [GREEDY] * 2)
    assert nodes == [[1, 2], [0]] and kept == [[a[0], a[2], a[3]], [a[0], a[1]]]


def chain_inputs(seed: int, B: int = 16, V: int = 8, K: int = 4):
    """Random chains with k_b in 0..K whose drafts are mostly the argmax: (flat logits, drafts)."""
    g = torch.Generator().manual_seed(seed)
    rows, drafts = [], []
    for b in range(B):
        k = b % (K + 1)
        logits = torch.randn(k + 1, V, generator=g)
        wrong = torch.rand(k, generator=g) < 0.25
        drafts.append(torch.where(wrong, torch.randint(V, (k,), generator=g), logits[:k].argmax(-1)).tolist())
        rows.append(logits)
    return torch.cat(rows), drafts


@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
def test_chains_equal_verify(mode):
    """A chain is parents = [-1, 0, ..., k-2]: the same outputs as verification.verify on the same inputs, for
    sampled rows too (seeded and unseeded: the same uniforms, then the same exponentials)."""
    logits, drafts = chain_inputs(seed=5)
    B = len(drafts)
    parents = [list(range(-1, len(d) - 1)) for d in drafts]
    choices = {"greedy": [GREEDY], "sampled": [SP(seed=3), SP(), SP(temperature=0.7, top_k=3, seed=4)],
               "mixed": [GREEDY, SP(seed=3), SP(top_p=0.8), SP(temperature=0.0, seed=5)]}[mode]
    params = [choices[b % len(choices)] for b in range(B)]
    for step in range(3):
        torch.manual_seed(step)
        pt = pad_tree_drafts(logits, drafts, parents)
        tree = verify_tree(pt, build(params))
        torch.manual_seed(step)
        pd = pad_drafts(logits, drafts)
        out, n = verify(*pd[:4], build(params), draft_counts=pd.draft_counts)
        assert torch.equal(tree.output_tokens, out) and torch.equal(tree.num_accepted, n), step
    if mode == "greedy":
        assert int(n.sum()) > B // 2


# ---- sibling rejection sampling reproduces the target ----------------------------------------------------------

V = 6
# fixed trees (trees drawn from q: Q_TRIALS): every broken variant below fails by a wide margin at this many trials
N_TRIALS = 20_000


class ToyLM:
    """Bigram logits over V tokens: the root row has fixed logits, a node's row depends on its token."""

    def __init__(self, seed: int, scale: float = 1.2):
        g = torch.Generator().manual_seed(seed)
        self.first = torch.randn(V, generator=g) * scale  # [V]
        self.bigram = torch.randn(V, V, generator=g) * scale  # [prev, V]

    def tree_logits(self, root: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """root [n, V] logits of each request's root row; tokens: the tree's k tokens -> [n * (k + 1), V]."""
        rows = [root] + [self.bigram[t].expand(root.shape[0], V) for t in tokens]
        return torch.stack(rows, 1).reshape(-1, V)


def reference_probs(logits: torch.Tensor, sp: SP) -> np.ndarray:
    """The warped distribution from the definitions (float64 numpy): softmax(l / T), then top-k."""
    z = logits.double().numpy() / sp.temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    if sp.top_k:
        kth = -np.sort(-z, axis=-1)[..., sp.top_k - 1 : sp.top_k]
        p = np.where(z >= kth, p, 0.0)
    return p / p.sum(-1, keepdims=True)


# (tokens, parents): 2 siblings at the first level with two children under the first; 3 siblings (the least
# likely first, so later ones meet a residual) with a second level, and a third, under the third. Tokens are
# fixed, sibling tokens distinct, and chosen so that every level both accepts and rejects often (with ToyLM(3) at
# T = 1, p0 = [.39 .18 .17 .07 .16 .03]; the 2-sibling tree ends at depth 0 / 1 / 2 in 42% / 43% / 15% of the
# trials, the 3-sibling tree in 28% / 62% / 10%).
TREES = [
    ([0, 1, 5, 4], [-1, -1, 0, 0]),
    ([4, 0, 2, 5, 1, 2], [-1, -1, -1, 2, 2, 3]),
]
SECOND_STEP_TREE = ([0, 1], [-1, -1])  # the second step's tree, for the trials that kept one token


def first_two_tokens(lm: ToyLM, tree, sp: SP, seed: int = 1, verifier=verify_tree) -> tuple[torch.Tensor, torch.Tensor]:
    """N_TRIALS independent requests in one batch until each has 2 tokens -> (t0 [N], t1 [N])."""
    torch.manual_seed(seed)
    n = N_TRIALS
    tokens, parents = tree
    logits = lm.tree_logits(lm.first.expand(n, V), tokens)
    v = verifier(pad_tree_drafts(logits, [tokens] * n, [parents] * n), build([sp] * n, [None] * n))
    t0, t1 = v.output_tokens[:, 0], v.output_tokens[:, 1].clone()
    need = v.num_accepted == 0  # step 2 for those that kept one token: a tree after t0
    m = int(need.sum())
    tokens2, parents2 = SECOND_STEP_TREE
    logits2 = lm.tree_logits(lm.bigram[t0[need]], tokens2)
    v2 = verifier(pad_tree_drafts(logits2, [tokens2] * m, [parents2] * m), build([sp] * m, [None] * m))
    t1[need] = v2.output_tokens[:, 0]
    return t0, t1


def chi2_pvalue(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Goodness of fit; cells with probability 0 must be empty (else p = 0)."""
    if observed[expected_probs == 0].sum() > 0:
        return 0.0
    on = expected_probs > 0
    return chisquare(observed[on], expected_probs[on] / expected_probs[on].sum() * observed.sum()).pvalue


def pvalues(lm: ToyLM, sp: SP, t0: torch.Tensor, t1: torch.Tensor) -> tuple[float, float]:
    """p-values of the first token against p(x0) and of the pair against p(x0) p(x1 | x0)."""
    p0 = reference_probs(lm.first, sp)  # [V]
    p1 = reference_probs(lm.bigram, sp)  # [V, V] rows: the previous token
    first = np.bincount(t0.numpy(), minlength=V).astype(float)
    pair = np.bincount((t0 * V + t1).numpy(), minlength=V * V).astype(float)
    return chi2_pvalue(first, p0), chi2_pvalue(pair, (p0[:, None] * p1).ravel())


SIBLING_RULE = tree_verification._verify_sampled  # what trees with q (and relaxed acceptance) go through


@pytest.mark.parametrize("tree", TREES, ids=["2-siblings", "3-siblings"])
@pytest.mark.parametrize("sp", [SP(), SP(temperature=0.7, top_k=4)], ids=["T1", "T0.7-topk4"])
@pytest.mark.parametrize("verifier", [verify_tree, SIBLING_RULE], ids=["coupling", "sibling-rule"])
def test_sibling_sampling_reproduces_the_target(tree, sp, verifier):
    """A tree without q: verify_tree's coupling (the target samples its own token at each row, a child is kept
    iff it is that token) and the sibling rule, run directly on the same one-hot trees."""
    lm = ToyLM(seed=3)
    p_first, p_pair = pvalues(lm, sp, *first_two_tokens(lm, tree, sp, verifier=verifier))
    assert p_first > 1e-3 and p_pair > 1e-3, (p_first, p_pair)


def try_child_without_division(r, c, row_tokens, u, tested, q=None, has_q=None):
    """Broken: removes rejected siblings but tests u_c < r(x_c), forgetting to renormalise by sum(r)."""
    tested = tested & (c >= 0)
    c = c.clamp_min(0)[:, None]
    x = row_tokens.gather(1, c)
    accept = tested & (u.gather(1, c).squeeze(1) < r.gather(1, x).squeeze(1))
    return tree_verification._remove_token(r, x, tested & ~accept), accept, q


@pytest.mark.parametrize("tree", TREES, ids=["2-siblings", "3-siblings"])
@pytest.mark.parametrize("broken", ["no_renormalisation", "no_division"])
def test_broken_variants_fail_the_same_test(tree, broken, monkeypatch):
    """no_renormalisation: a rejected sibling is never removed, so every sibling is tested against the original
    p (accept iff u_c < p(x_c)) and the extra token comes from p, not the residual. no_division: removed, but
    the test forgets sum(r). Both must fail, so the test has teeth."""
    if broken == "no_renormalisation":
        monkeypatch.setattr(tree_verification, "_remove_token", lambda r, x, reject: r)
    else:
        monkeypatch.setattr(tree_verification, "_try_child", try_child_without_division)
    lm, sp = ToyLM(seed=3), SP()
    p_first, p_pair = pvalues(lm, sp, *first_two_tokens(lm, tree, sp, verifier=lambda *a: SIBLING_RULE(*a)))
    assert max(p_first, p_pair) < 1e-6, (p_first, p_pair)


# ---- trees drawn from q (recursive rejection sampling without replacement) ------------------------------------

Q_TRIALS = 40_000  # keeping q's rejected siblings is a subtle fault: at half as many trials it fails narrowly
Q_SHAPE = [-1, -1, -1, 0, 0, 2]  # 3 siblings; the first has 2 children, the third 1: 6 nodes, drawn per trial


class ToyDraft(ToyLM):
    """The drafter's bigram q, close to the target's (so siblings are accepted often and rejected often)."""

    def __init__(self, lm: ToyLM, seed: int, noise: float):
        g = torch.Generator().manual_seed(seed)
        self.first = lm.first + noise * torch.randn(V, generator=g)
        self.bigram = lm.bigram + noise * torch.randn(V, V, generator=g)


def draw_q_trees(draft: ToyDraft, root_q: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
    """n trees of shape Q_SHAPE, each row's children drawn from its q without replacement (Gumbel top-k, in the
    order drawn). root_q [n, V] -> (tokens per tree, q per row [n, 7, V])."""
    def draw(q: torch.Tensor, k: int) -> torch.Tensor:
        gumbel = -torch.log(-torch.log(torch.rand(q.shape).clamp_min(1e-20)))
        return (q.log() + gumbel).topk(k, dim=-1).indices  # [n, k]

    level1 = draw(root_q, 3)
    q1 = draft.bigram[level1].softmax(-1)  # [n, 3, V]: q at the three first-level rows
    under0, under2 = draw(q1[:, 0], 2), draw(q1[:, 2], 1)
    tokens = torch.cat([level1, under0, under2], dim=1)  # [n, 6] in Q_SHAPE's node order
    q_rows = torch.cat([root_q[:, None], draft.bigram[tokens].softmax(-1)], dim=1)  # [n, 7, V]
    return tokens.tolist(), q_rows


def first_two_tokens_q(lm: ToyLM, draft: ToyDraft, sp: SP, seed: int = 1, with_q: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As :func:`first_two_tokens`, every step's tree drawn from the drafter's q -> (t0, t1, accepted at step 1)."""
    torch.manual_seed(seed)

    def step(root_logits: torch.Tensor, root_q: torch.Tensor):
        n = root_logits.shape[0]
        tokens, q_rows = draw_q_trees(draft, root_q)
        logits = torch.cat([root_logits[:, None], lm.bigram[torch.tensor(tokens)]], dim=1)  # [n, 7, V]
        probs = list(q_rows) if with_q else None
        return verify_tree(pad_tree_drafts(logits.reshape(-1, V), tokens, [Q_SHAPE] * n, probs),
                           build([sp] * n, [None] * n))

    n = Q_TRIALS
    v = step(lm.first.expand(n, V), draft.first.softmax(-1).expand(n, V))
    t0, t1 = v.output_tokens[:, 0], v.output_tokens[:, 1].clone()
    need = v.num_accepted == 0
    if need.any():
        t1[need] = step(lm.bigram[t0[need]], draft.bigram[t0[need]].softmax(-1)).output_tokens[:, 0]
    return t0, t1, v.num_accepted


@pytest.mark.parametrize("sp", [SP(), SP(temperature=0.7, top_k=4)], ids=["T1", "T0.7-topk4"])
def test_trees_drawn_from_q_reproduce_the_target(sp):
    """Siblings drawn without replacement from q and tested against it keep the target's distribution, and keep
    more tokens than the same trees verified as if they were fixed (one-hot q), which is lossless too."""
    lm = ToyLM(seed=3)
    draft = ToyDraft(lm, seed=5, noise=0.4)
    t0, t1, accepted = first_two_tokens_q(lm, draft, sp)
    p_first, p_pair = pvalues(lm, sp, t0, t1)
    assert p_first > 1e-3 and p_pair > 1e-3, (p_first, p_pair)
    t0, t1, accepted_one_hot = first_two_tokens_q(lm, draft, sp, with_q=False)
    assert min(pvalues(lm, sp, t0, t1)) > 1e-3
    assert accepted.float().mean() > accepted_one_hot.float().mean() + 0.05, (accepted.float().mean(),
                                                                             accepted_one_hot.float().mean())


def test_a_tree_drawn_from_the_target_itself_keeps_its_first_path():
    """q = p: min(1, p(x) / q(x)) = 1, so the first child of every row is accepted."""
    lm = ToyLM(seed=3)
    draft = ToyDraft(lm, seed=5, noise=0.0)
    *_, accepted = first_two_tokens_q(lm, draft, SP())
    assert bool((accepted == 2).all())  # node 0, then its first child (node 3)


def try_child_keeping_q(r, c, row_tokens, u, tested, q=None, has_q=None):
    """Broken: the earlier siblings' tokens are never taken out of q."""
    r, accept, _ = _TRY_CHILD(r, c, row_tokens, u, tested, q, has_q)
    return r, accept, q


def try_child_unscaled_residual(r, c, row_tokens, u, tested, q=None, has_q=None):
    """Broken: the residual subtracts q from the unnormalised r (max(0, r - q)); r sums to 1 until the first
    rejection, so only later siblings see the difference."""
    tested = tested & (c >= 0)
    c = c.clamp_min(0)[:, None]
    x = row_tokens.gather(1, c)
    q_norm = q / q.sum(-1, keepdim=True)
    accept = tested & (u.gather(1, c).squeeze(1) * q_norm.gather(1, x).squeeze(1) * r.sum(-1)
                       < r.gather(1, x).squeeze(1))
    reject = tested & ~accept
    r = torch.where(reject[:, None], (r - q_norm).clamp_min(0.0), r)
    return r, accept, torch.where(reject[:, None], q.scatter(1, x, 0.0), q)


_TRY_CHILD = tree_verification._try_child


@pytest.mark.parametrize("broken", [try_child_keeping_q, try_child_unscaled_residual], ids=["keeps-q", "unscaled"])
def test_broken_q_variants_fail_the_same_test(broken, monkeypatch):
    monkeypatch.setattr(tree_verification, "_try_child", broken)
    lm = ToyLM(seed=3)
    t0, t1, _ = first_two_tokens_q(lm, ToyDraft(lm, seed=5, noise=0.4), SP())
    assert min(pvalues(lm, SP(), t0, t1)) < 1e-6


# ---- Medusa's trees drawn from q (specray.workers.medusa_drafter), through the drafter itself ------------------

# five children at the root (under top-k 4 the fifth has no mass: dropped with its child), two under the first, one
# under the second, a third level under the first's first
MEDUSA_CHOICES = [[0], [0, 0], [1], [0, 1], [2], [1, 0], [0, 0, 0], [3], [4], [4, 0]]
MEDUSA_TRIALS = 10_000  # the drafter keeps each request's q on the host's side of a loop: half the toy's trials


class ToyMedusaHeads:
    """Three Medusa heads whose logits ignore the hidden state (Medusa's heads never see the drafted tokens): head 0
    a noisy copy of the target's root logits, heads 1 and 2 noisy copies of the log of the target's marginal one
    token further, so each depth has its own q, the same for every parent there."""

    tp, num_heads, vocab_size = None, 3, V

    def __init__(self, lm: ToyLM, seed: int, noise: float):
        g = torch.Generator().manual_seed(seed)
        marginal = (lm.first.softmax(-1)[:, None] * lm.bigram.softmax(-1)).sum(0).log()
        self.logits = torch.stack([lm.first, marginal, marginal]) + noise * torch.randn(3, V, generator=g)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(hidden.shape[0], -1, -1)


def medusa_step(drafter, lm: ToyLM, root_logits: torch.Tensor, sp: SP, with_q: bool = True):
    """One step of n requests (root_logits [n, V]): the drafter draws each one's tree, which is verified against
    the q rows it hands over (or, without q, as fixed candidates) -> (the verdict, the trees)."""
    from specray.contract import ScheduledChunk, StepPlan

    n = root_logits.shape[0]
    plan = StepPlan(0, chunks=[ScheduledChunk(str(b), [0], 0, num_next_drafts=len(MEDUSA_CHOICES)) for b in range(n)])
    made = drafter.draft(plan, {}, torch.zeros(n, 1), [], {b: [0] for b in range(n)}, {},
                         {str(b): sp for b in range(n)})
    q = [drafter.q_of(str(b), d.token_ids, d.parents) for b, d in enumerate(made)] if with_q else None
    logits = torch.cat([torch.cat([root_logits[b, None], lm.bigram[d.token_ids]]) for b, d in enumerate(made)])
    padded = pad_tree_drafts(logits, [d.token_ids for d in made], [d.parents for d in made], q)
    return verify_tree(padded, build([sp] * n, [None] * n)), made


def first_two_tokens_medusa(lm: ToyLM, sp: SP, with_q: bool = True, row_heads=None):
    """As :func:`first_two_tokens`, every step's tree drawn by a MedusaDrafter over :class:`ToyMedusaHeads`
    (``row_heads``: the heads whose q its verification rows read, to break it) -> (t0, t1, accepted at step 1,
    the first step's trees)."""
    from specray.workers.medusa_drafter import MedusaDrafter

    torch.manual_seed(1)
    drafter = MedusaDrafter(ToyMedusaHeads(lm, seed=5, noise=0.4), MEDUSA_CHOICES)
    if row_heads is not None:
        drafter.layout.row_heads = row_heads(drafter.layout.row_heads)
    v, made = medusa_step(drafter, lm, lm.first.expand(MEDUSA_TRIALS, V), sp, with_q)
    t0, t1 = v.output_tokens[:, 0], v.output_tokens[:, 1].clone()
    need = v.num_accepted == 0
    if need.any():
        t1[need] = medusa_step(drafter, lm, lm.bigram[t0[need]], sp, with_q)[0].output_tokens[:, 0]
    return t0, t1, v.num_accepted, made


@pytest.mark.parametrize("sp", [SP(), SP(temperature=0.7, top_k=4)], ids=["T1", "T0.7-topk4"])
def test_medusa_trees_drawn_from_q_reproduce_the_target(sp):
    """Medusa's trees drawn from each depth's q (every parent drawing its own children without replacement) and
    verified against the q rows the drafter hands over keep the target's distribution, and keep more tokens than
    the same trees verified as fixed candidates (one-hot q, lossless too). Under top-k 4 the root's fifth child has
    no mass under q: it is dropped with its child."""
    lm = ToyLM(seed=3)
    t0, t1, accepted, made = first_two_tokens_medusa(lm, sp)
    p_first, p_pair = pvalues(lm, sp, t0, t1)
    assert p_first > 1e-3 and p_pair > 1e-3, (p_first, p_pair)
    assert {len(d.token_ids) for d in made} == {len(MEDUSA_CHOICES) - 2 * (sp.top_k == 4)}
    t0, t1, accepted_one_hot, _ = first_two_tokens_medusa(lm, sp, with_q=False)
    assert min(pvalues(lm, sp, t0, t1)) > 1e-3
    assert accepted.float().mean() > accepted_one_hot.float().mean() + 0.05, (accepted.float().mean(),
                                                                             accepted_one_hot.float().mean())


def test_medusa_trees_verified_against_the_wrong_heads_q_fail_the_same_test():
    """Broken: every row's children verified against head 0's q (the root's) instead of their own depth's."""
    lm = ToyLM(seed=3)
    t0, t1, *_ = first_two_tokens_medusa(lm, SP(), row_heads=lambda heads: [0 if h < 3 else h for h in heads])
    assert min(pvalues(lm, SP(), t0, t1)) < 1e-6


# ---- mixed batches, empty rows, a big tree ----------------------------------------------------------------------


def plain_tokens(logits: torch.Tensor, params, positions) -> list[int]:
    """What plain decoding samples: by inversion, each seeded row's uniform keyed by its position."""
    b = SamplingBatch.build(params, [make_generator(p.seed, "cpu") for p in params], "cpu", positions=positions)
    return sample_by_inversion(logits_to_probs(logits, b), row_uniforms(b, [[0]] * len(params), "cpu")[:, 0]).tolist()


def test_zero_drafts_everywhere_is_plain_sampling():
    """K = 0 for every row: the token plain sampling draws (the seeded rows' uniforms keyed by position)."""
    logits = torch.randn(3, 50)
    params = [SP(seed=1), SP(seed=2, top_k=5), SP(temperature=0.0, seed=3)]
    batch = SamplingBatch.build(params, [make_generator(p.seed, "cpu") for p in params], "cpu", positions=[5, 6, 7])
    v = verify_tree(pad_tree_drafts(logits, [[], [], []], [[], [], []]), batch)
    kept, nodes, *_ = unpad_tree(v, None)
    assert kept == [[t] for t in plain_tokens(logits, params, [5, 6, 7])] and nodes == [[], [], []]
    assert kept[2] == [int(logits[2].argmax())]
    assert v.output_tokens.shape == (3, 1) and v.path_rows.tolist() == [[0]] * 3
    # a request with a q but no nodes this step, beside a tree drawn from q: coupled still (not the q path's race),
    # so a seeded request's token does not depend on what runs beside it
    rows = torch.cat([logits[:1], torch.randn(3, 50)])
    probs = [torch.softmax(torch.randn(1, 50), -1), torch.softmax(torch.randn(3, 50), -1)]
    two = SamplingBatch.build([params[0], SP(seed=4)], [make_generator(1, "cpu"), make_generator(4, "cpu")], "cpu",
                              positions=[5, 2])
    kept, *_ = unpad_tree(verify_tree(pad_tree_drafts(rows, [[], [3, 4]], [[], [-1, -1]], probs), two), None)
    assert kept[0] == [plain_tokens(logits, params, [5, 6, 7])[0]]


def test_mixed_greedy_sampled_and_empty_rows():
    """Greedy rows beside sampled ones give the all-greedy result and leave their generators untouched; a
    seeded row with no drafts draws what plain sampling draws."""
    logits, rows, tokens, parents = random_greedy_batch(seed=11, B=6)
    tokens[2], parents[2] = [], []  # a greedy row with no drafts
    logits = torch.cat([r[: len(t) + 1] for r, t in zip(rows, tokens)])
    greedy_kept, greedy_nodes, _, _ = run(logits, tokens, parents, [GREEDY] * 6)
    root = torch.randn(1, 8)
    extra_rows = [rows[0][: len(tokens[0]) + 1], root, rows[1][: len(tokens[1]) + 1]]
    params = [SP(temperature=0.0, seed=s) for s in range(6)] + [SP(seed=40), SP(seed=41, top_k=3), SP()]
    gens = [make_generator(p.seed, "cpu") for p in params]
    states = [g.get_state() for g in gens[:6]]
    padded = pad_tree_drafts(torch.cat([logits] + extra_rows), tokens + [tokens[0], [], tokens[1]],
                             parents + [parents[0], [], parents[1]])
    kept, nodes, *_ = unpad_tree(verify_tree(padded, SamplingBatch.build(params, gens, "cpu")), None)
    assert kept[:6] == greedy_kept and nodes[:6] == greedy_nodes
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states))
    alone = build([SP(seed=41, top_k=3)])  # without positions: its generator's first uniform
    u = row_uniforms(alone, [[0]], "cpu")[:, 0]
    assert kept[7] == sample_by_inversion(logits_to_probs(root, alone), u).tolist() and nodes[7] == []


def big_tree(V: int = 32, seed: int = 0):
    """64 nodes, depth 6: a chain of 6 along the argmax, then 58 nodes under random rows of depth < 6 (distinct
    sibling tokens, none equal to the parent row's argmax) -> (logits [65, V], tokens, parents)."""
    rng = random.Random(seed)
    logits = torch.randn(65, V, generator=torch.Generator().manual_seed(seed))
    argmax = logits.argmax(-1).tolist()
    tokens, parents, depth = [], [], {-1: 0}
    for i in range(64):
        p = i - 1 if i < 6 else rng.choice([q for q in range(-1, i) if depth[q] < 6])
        taken = {tokens[c] for c, q in enumerate(parents) if q == p} | {argmax[p + 1]}
        tokens.append(argmax[p + 1] if i < 6 else rng.choice([t for t in range(V) if t not in taken]))
        parents.append(p)
        depth[i] = depth[p] + 1
    return logits, tokens, parents


def test_64_node_tree():
    logits, tokens, parents = big_tree()
    kept, nodes, padded, _ = run(logits, [tokens], [parents], [GREEDY])
    assert padded.max_depth == 6 and padded.children.shape[-1] >= 3
    assert nodes == [[0, 1, 2, 3, 4, 5]] and kept[0] == tokens[:6] + [int(logits[6].argmax())]
    for params in ([SP(seed=1)], [SP(temperature=0.5, seed=2)], [GREEDY, SP(seed=3)]):
        B = len(params)
        kept, nodes, _, v = run(torch.cat([logits] * B), [tokens] * B, [parents] * B, params)
        for b in range(B):  # a valid path: each accepted node's parent is the previous one, tokens match
            assert [parents[i] for i in nodes[b]] == ([-1] + nodes[b])[:-1]
            assert kept[b][:-1] == [tokens[i] for i in nodes[b]]
    assert nodes[0] == [0, 1, 2, 3, 4, 5]  # the greedy row beside a sampled one


# ---- seeded streams -------------------------------------------------------------------------------------------


def test_seeded_request_same_alone_and_in_batch():
    """A seeded request's verdict depends on its tree, its logits and the sequence position it samples at (its
    uniforms are keyed by seed and position), whatever the other trees (other K, branching and depth, seeded,
    unseeded and greedy neighbours) and its place in the batch."""
    Vs = 40
    g = torch.Generator().manual_seed(0)
    tokens, parents = [3, 7, 1, 9, 2], [-1, -1, 0, 0, 3]
    mine = torch.randn(6, Vs, generator=g) * 0.3  # flat, but the root's first two children likely
    mine[0, 3] += 1.5
    mine[0, 7] += 1.0
    sp = SP(temperature=1.0, top_k=30, seed=42)
    others = [([4, 5, 6, 7, 8, 9, 10], [-1, -1, -1, -1, 0, 4, 5], SP()),
              ([1], [-1], SP(seed=7)),
              ([2, 3, 4], [-1, 0, 1], SP(temperature=0.0, seed=9)),
              ([], [], SP(top_p=0.5, seed=8))]

    def steps(neighbours, pos, n_steps=8):
        """The verdict at sequence positions 100, 101, ... (the neighbours at positions of their own)."""
        reqs = neighbours[:pos] + [(tokens, parents, sp)] + neighbours[pos:]
        logits = torch.cat([mine if t is tokens else torch.randn(len(t) + 1, Vs, generator=g) for t, _, _ in reqs])
        padded = pad_tree_drafts(logits, [t for t, _, _ in reqs], [p for _, p, _ in reqs])
        out = []
        for step in range(n_steps):
            params = [s for _, _, s in reqs]
            where = [100 + step if t is tokens else 7 * j + step for j, (t, _, _) in enumerate(reqs)]
            batch = SamplingBatch.build(params, [make_generator(p.seed, "cpu") for p in params], "cpu",
                                        positions=where)
            kept, nodes, *_ = unpad_tree(verify_tree(padded, batch), None)
            out.append((kept[pos], nodes[pos]))
        return out

    alone = steps([], 0)
    assert len({tuple(k) for k, _ in alone}) > 1 and any(n for _, n in alone)  # each position its own draw
    assert steps(others, 2) == alone
    assert steps(others[::-1], 1) == alone
    assert steps(others[1:], 3) == alone


# ---- logprobs ------------------------------------------------------------------------------------------------


def test_logprobs_at_the_path_rows():
    logits, rows, tokens, parents = random_greedy_batch(seed=2, B=5, max_nodes=8)
    num_logprobs = [2, None, 0, 3, 1]
    params = [GREEDY, SP(seed=1), SP(seed=2), GREEDY, SP(temperature=0.5, seed=3)]
    padded = pad_tree_drafts(logits, tokens, parents)
    v = verify_tree(padded, build(params))
    kept, nodes, lps, _ = unpad_tree(v, tree_logprobs(padded, v, num_logprobs))
    assert tree_logprobs(padded, v, [None] * 5) is None and unpad_tree(v, None)[2] is None
    assert lps[1] == []
    for b, k in enumerate(num_logprobs):
        if k is None:
            continue
        assert len(lps[b]) == len(kept[b])
        for j, (tok, entry) in enumerate(zip(kept[b], lps[b])):
            row = int(v.path_rows[b, j])
            assert row == (0 if j == 0 else nodes[b][j - 1] + 1)
            ref = rows[b][row].log_softmax(-1)
            assert next(iter(entry)) == tok and entry[tok].logprob == pytest.approx(float(ref[tok]), abs=1e-5)
            assert entry[tok].rank == int((ref >= ref[tok]).sum())
            top = ref.topk(k)
            for rank, (t, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
                assert entry[t].logprob == pytest.approx(lp, abs=1e-5) and entry[t].rank in (rank, entry[tok].rank)
            assert len(entry) <= k + 1


# ---- no host syncs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [[GREEDY] * 4, [GREEDY, SP(seed=1, top_k=3), SP(top_p=0.7), SP(min_p=0.1)]],
                         ids=["greedy", "mixed"])
def test_verify_tree_has_no_host_sync(no_host_sync, params):
    logits, tokens, parents = big_tree()
    tokens, parents = [tokens, [], [1, 2], tokens[:10]], [parents, [], [-1, -1], parents[:10]]
    flat = torch.cat([logits, logits[:1], logits[:3], logits[:11]])
    batch = build(params)
    with no_host_sync():
        padded = pad_tree_drafts(flat, tokens, parents)
        v = verify_tree(padded, batch)
        tree_logprobs(padded, v, [1, None, 0, 2])
        verify_tree(pad_tree_drafts(flat[:4], [[]] * 4, [[]] * 4), batch)


# ---- typical acceptance (Medusa's, lossy, opt-in) -----------------------------------------------------------------

def _typical(logits, tokens, parents, params, eps, delta, seeds=None):
    padded = pad_tree_drafts(logits, tokens, parents)
    verdict = verify_tree(padded, build(params, seeds), tree_verification.TypicalAcceptance(eps, delta))
    kept, nodes, _, _ = unpad_tree(verdict, None)
    return kept, nodes


def test_typical_acceptance_keeps_what_passes_its_bar_and_follows_the_longest_passing_path():
    """Root p = [0.5, 0.3, 0.15, 0.05] (T = 1): H = 1.14, delta * exp(-H) = 0.096 with delta 0.3, so the bar is
    min(0.09, 0.096) = 0.09: tokens 0, 1, 2 pass, 3 does not. Node 0 (token 3) fails; its sibling node 1 (token 2)
    passes and has a passing child, so the path 1 -> 2 is kept although node 0 came first."""
    root = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    sure = torch.tensor([0.97, 0.01, 0.01, 0.01]).log()  # H small: bar = min(0.09, 0.3 * 0.87) = 0.09
    logits = torch.stack([root, sure, sure, sure])  # rows: root, node 0, node 1, node 2
    params = [SP(temperature=1.0, seed=3)]
    kept, nodes = _typical(logits, [[3, 2, 0]], [[-1, -1, 1]], params, 0.09, 0.3)
    assert nodes == [[1, 2]] and kept[0][:2] == [2, 0] and len(kept[0]) == 3
    # a bar over every token: nothing is kept, the extra token is sampled from the root's p
    kept, nodes = _typical(logits, [[3, 2, 0]], [[-1, -1, 1]], params, 0.9, 10.0)
    assert nodes == [[]] and len(kept[0]) == 1
    # no bar (threshold 0): every token the target gives any probability passes, the deepest path wins
    kept, nodes = _typical(logits, [[3, 2, 0]], [[-1, -1, 1]], params, 0.0, 0.3)
    assert nodes == [[1, 2]]


def test_typical_acceptance_leaves_greedy_rows_greedy():
    """In a batch with sampled rows, a greedy row's p is one-hot: its verdict is the greedy walk's."""
    torch.manual_seed(0)
    V, trees = 12, [([5, 1, 7, 2], [-1, -1, 0, 2]), ([4, 4, 9], [-1, 0, 1])]
    logits = torch.randn(sum(len(t) + 1 for t, _ in trees), V)
    tokens, parents = [t for t, _ in trees], [p for _, p in trees]
    a = logits.argmax(-1).tolist()
    tokens[0][0], tokens[0][2] = a[0], a[1]  # node 0 right, node 2 (child of 0) right: a path of 2
    greedy, _, _, _ = run(logits, tokens, parents, [GREEDY, GREEDY])
    mixed, _ = _typical(logits, tokens, parents, [GREEDY, SP(temperature=0.8, seed=1)], 0.09, 0.3)
    assert mixed[0] == greedy[0] and len(greedy[0]) == 3


# ---- relaxed acceptance (TensorRT-LLM's, for the thinking phase; lossy, opt-in) ------------------------------------

BEGIN, END = 6, 7  # the thinking phase's token ids in these tests


def _relaxed(logits, tokens, parents, params, topk, delta, roots, seeds=None):
    """Verify with relaxed acceptance, each request's root inside the thinking phase as ``roots`` says (greedy
    requests only, as the runner marks them)."""
    relaxed = tree_verification.RelaxedAcceptance(topk, delta, BEGIN, END)
    padded = pad_tree_drafts(logits, tokens, parents)
    width = padded.draft_token_ids.shape[1] + 1
    rows = [relaxed.phases(r, t, p) if sp.greedy else [] for r, t, p, sp in zip(roots, tokens, parents, params)]
    thinking = torch.tensor([r + [False] * (width - len(r)) for r in rows], dtype=torch.bool)
    kept, nodes, _, _ = unpad_tree(verify_tree(padded, build(params, seeds), relaxed=relaxed, thinking=thinking), None)
    return kept, nodes


def relaxed_reference(row_logits: torch.Tensor, tokens, parents, topk, delta, root: bool):
    """Plain python: from the root, follow the first child (node order) whose token is a candidate of the current
    row: the argmax, or inside the thinking phase one of the topk most likely within delta of it in logit; the
    phase switches on BEGIN and off END along the path. The extra token is the argmax."""
    cur, inside, nodes = -1, root, []
    while True:
        row = row_logits[cur + 1].tolist()
        best = max(range(len(row)), key=lambda t: (row[t], -t))
        ranked = sorted(range(len(row)), key=lambda t: -row[t])
        ok = {best} | ({t for t in ranked[:topk] if row[best] - row[t] <= delta} if inside else set())
        nxt = [i for i, p in enumerate(parents) if p == cur and tokens[i] in ok]
        if not nxt:
            return [tokens[i] for i in nodes] + [best], nodes
        cur = nxt[0]
        nodes.append(cur)
        inside = True if tokens[cur] == BEGIN else False if tokens[cur] == END else inside


def test_relaxed_phases_follow_each_path():
    relaxed = tree_verification.RelaxedAcceptance(3, 1.0, BEGIN, END)
    #            node:   0    1   2     3   4
    tokens, parents = [1, END, 2, BEGIN, 3], [-1, -1, 1, 0, 3]
    assert relaxed.phases(True, tokens, parents) == [True, True, False, False, True, True]
    assert relaxed.phases(False, tokens, parents) == [False, False, False, False, True, True]
    assert relaxed.phases(True, [], []) == [True]


def test_relaxed_acceptance_keeps_close_candidates_inside_the_thinking_phase_only():
    """Root logits: token 2 best (5.0), token 4 next (4.8), token 5 third (3.0). A chain drafting 4 then the
    argmax after it: inside the phase with top-2 and delta 0.5 both are kept; a top-1 rule, a delta under the gap,
    or a root outside the phase keeps none (the extra token is the argmax, 2)."""
    V = 8
    root = torch.full((V,), -1.0)
    root[2], root[4], root[5] = 5.0, 4.8, 3.0
    after = torch.full((V,), -1.0)
    after[3] = 2.0
    logits = torch.stack([root, after, after])
    chain = ([[4, 3]], [[-1, 0]])
    assert _relaxed(logits, *chain, [GREEDY], 2, 0.5, [True]) == ([[4, 3, 3]], [[0, 1]])
    for topk, delta, inside in ((1, 0.5, True), (2, 0.1, True), (2, 0.5, False)):
        assert _relaxed(logits, *chain, [GREEDY], topk, delta, [inside]) == ([[2]], [[]]), (topk, delta, inside)
    assert _relaxed(logits[:2], [[5]], [[-1]], [GREEDY], 3, 2.5, [True])[1] == [[0]]  # third, 2.0 below: within 2.5
    assert _relaxed(logits[:2], [[5]], [[-1]], [GREEDY], 2, 2.5, [True])[1] == [[]]  # but not in the top 2
    # the draft that ends the phase is tested inside it; the draft after it strictly
    logits = torch.stack([root, root, root])
    assert _relaxed(logits, [[END, 4]], [[-1, 0]], [GREEDY], 2, 0.5, [True]) == ([[2]], [[]])  # END not close
    root[END] = 4.9
    logits = torch.stack([root, root, root])
    assert _relaxed(logits, [[END, 4]], [[-1, 0]], [GREEDY], 2, 0.5, [True]) == ([[END, 2]], [[0]])
    assert _relaxed(logits, [[BEGIN, 4]], [[-1, 0]], [GREEDY], 3, 5.0, [False]) == ([[2]], [[]])


@pytest.mark.parametrize("seed", range(3))
def test_relaxed_acceptance_equals_the_reference_walk_alone_and_in_any_batch(seed):
    """Random trees with BEGIN/END tokens among the drafts and random phases at the roots: every greedy request's
    verdict is the reference walk's, in an all-greedy batch and beside sampled requests (whose verdicts, seeded,
    are exactly those of verification without relaxed acceptance)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    V, B, rows, tokens, parents, roots = 8, 16, [], [], [], []
    for _ in range(B):
        logits = torch.randn(13, V, generator=g) * 0.7
        ranked = logits.argsort(-1, descending=True).tolist()
        t, p = random_tree(rng, lambda r: ranked[r][rng.randrange(3)], V, 12, p_match=0.8)
        rows.append(logits[: len(t) + 1])
        tokens.append(t)
        parents.append(p)
        roots.append(rng.random() < 0.7)
    topk, delta = 3, 0.6
    want = [relaxed_reference(r, t, p, topk, delta, root) for r, t, p, root in zip(rows, tokens, parents, roots)]
    assert sum(len(n) for _, n in want) > sum(len(reference_walk(r, t, p)[1]) for r, t, p in zip(rows, tokens, parents))
    kept, nodes = _relaxed(torch.cat(rows), tokens, parents, [GREEDY] * B, topk, delta, roots)
    assert list(zip(kept, nodes)) == want
    # every other request sampled (seeded): the greedy ones keep their verdicts, the sampled ones get the verdict
    # they would get without relaxed acceptance
    params = [GREEDY if b % 2 else SP(temperature=0.9, seed=b) for b in range(B)]
    kept, nodes = _relaxed(torch.cat(rows), tokens, parents, params, topk, delta, roots)
    plain_kept, plain_nodes, _, _ = run(torch.cat(rows), tokens, parents, params)
    for b in range(B):
        assert (kept[b], nodes[b]) == (want[b] if b % 2 else (plain_kept[b], plain_nodes[b])), b


def test_relaxed_acceptance_has_no_host_sync(no_host_sync):
    logits, tokens, parents = big_tree()
    relaxed = tree_verification.RelaxedAcceptance(4, 1.0, BEGIN, END)
    thinking = torch.tensor([relaxed.phases(True, tokens, parents)])
    batch = build([GREEDY])
    with no_host_sync():
        verify_tree(pad_tree_drafts(logits, [tokens], [parents]), batch, relaxed=relaxed, thinking=thinking)
