"""Verify a token tree of drafts against the target, batched: greedy matching and sibling rejection sampling.

Request b proposed k_b draft nodes; node i has token x_i and a parent (-1: the root, the last kept token; else an
earlier node, so nodes are in topological order). The target scored k_b + 1 rows: row 0 the root, row i + 1 node
i, and p_r = the request's warped target distribution at row r (the token AFTER that row's token). Row r's
children are tried in node order.

Sampling (deterministic drafts, q = one-hot; the sibling scheme of EAGLE and SGLang's tree speculative
sampling). Start at the root with r = p_0; for each child c of the current row, with u_c ~ U[0, 1):

    accept c   iff   u_c * sum(r) < r(x_c)           (u_c < r(x_c) / sum(r): r renormalised implicitly)
    on accept:  move to c's row and restart with r = p_(row of c)
    on reject:  r(x_c) = 0, then try the next sibling
    extra token ~ r / sum(r)  once every child of the current row is rejected (or it has none)

Each sibling test is the one-draft rejection step of Leviathan et al. against the residual left by the earlier
siblings, so the token emitted at each row is distributed exactly as p_row, and the path plus the extra token is
distributed as sampling from the target one token at a time.

Sampling with drafts drawn from q (recursive rejection sampling without replacement, Jeon et al. 2024; SpecInfer's
multi-draft verification with distinct siblings): a drafter that drew row r's children one after another without
replacement from its distribution q_r (Gumbel top-k) hands q_r for every row. With q the current sibling's
distribution (q_r, then q_r without the earlier siblings' tokens, renormalised), each child c is tested as

    accept c   iff   u_c * q(x_c) * sum(r) < r(x_c)        (u_c < min(1, (r(x_c) / sum(r)) / q(x_c)))
    on reject:  r = max(0, r - sum(r) * q)                  (norm(max(0, norm(r) - q)), scaled), q(x_c) = 0

which is again the one-draft step against the residual, now with the draft distribution that x_c was drawn from
given the earlier siblings: the token emitted at each row is still distributed exactly as p_row. A row without q
(a deterministic drafter's, or a greedy request's) is the one-hot case above. Which children exist may depend on
anything drawn before them (ancestors, earlier siblings, other rows), never on their own tokens (the drafter's
side of the bargain: :mod:`specray.workers.head_drafter`).

Greedy: a = argmax of every row; node i is correct iff x_i == a[parent row of i] and its parent is correct (the
root always is). The deepest correct node is accepted (ties: the smallest index; with distinct sibling tokens the
correct nodes form one chain and the sampling rule gives the same path for greedy rows, whose p is one-hot and
u = 0), and the extra token is a at its row.

Coupling (a sampled request's tree without q): the greedy rule with a replaced by y, the target's own token
sampled at every row (:func:`~specray.sampling.sample_by_inversion`; a seeded request's uniform keyed by the
sequence position of the token, the root's depth plus the row's). Child c of the current row is followed iff its
token is y there, which happens with probability p_row(x_c); given that no child matches, y is distributed as
p_row without the children's tokens, renormalised: the sibling rule's distribution. A seeded request's output is
then plain decoding's with the same seed, token for token, whatever the tree held.

Everything is padded (K nodes, M children per row, D = max depth, over the batch) and masked; the loops run over
depth and sibling index only (host ints), so nothing reads a tensor value back to the host except
:func:`unpad_tree`.

Typical acceptance (Medusa's, lossy, opt-in: :class:`TypicalAcceptance`): node i passes when p_(parent row)(x_i)
> min(epsilon, delta * exp(-H(p_(parent row)))); the deepest node whose whole path passes is accepted (ties: the
smallest index) and the extra token is sampled from p at its row. A greedy row's p is one-hot, so there it is the
greedy rule; a sampled request's output no longer follows the target's distribution exactly.

Relaxed acceptance (TensorRT-LLM's, for a reasoning model's thinking phase; lossy, opt-in, greedy requests only:
:class:`RelaxedAcceptance`): at a greedy row whose context is inside the thinking phase, the candidates are the
target's ``topk`` most likely tokens whose log-probability is within ``delta`` of the most likely one's; the row's
p is replaced by weights that are 1 on the most likely token, 1/2 on the other candidates and 0 elsewhere, and the
walk of the sampling rule runs (u = 0 on greedy rows): the first child that is a candidate is accepted, and the
extra token is the most likely one (it is never removed: were it a child, it would have been accepted). The walk
runs for every batch with relaxed acceptance on, so a request's output never depends on what shares its batch.

Node tokens (:func:`node_argmax`): argmax of rows 1..K, the target's greedy token after each node, for a drafter
that iterates on the target's guesses (lookahead decoding); read back in the same sync as the verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from specray.sampling import SamplingBatch, logits_to_probs, row_uniforms, sample, sample_by_inversion
from specray.tree import check_parents
from specray.tree import depths as node_depths
from specray.outputs import Logprob
from specray.verification import (TargetLogprobs, _accept_uniforms, _assemble, _gather_position, _to_host,
                                  entries_of, target_logprobs)


class PaddedTree(NamedTuple):
    target_logits: torch.Tensor  # [B, K+1, V]: row 0 the root, row i+1 node i; padding repeats the last row
    draft_token_ids: torch.Tensor  # [B, K] int64 x_i (padding: 0)
    parent_rows: torch.Tensor  # [B, K] int64: the row of node i's parent (0: the root; padding points at 0)
    num_drafts: torch.Tensor  # [B] int64 k_b
    draft_counts: list[int]  # the host copy of num_drafts
    children: torch.Tensor  # [B, K+1, M] int64: each row's children rows in node order, -1 padded
    max_depth: int  # D: the deepest node over the batch (the root is depth 0, the first level 1)
    depths: torch.Tensor  # [B, K] int64: each node's depth (padding: 0)
    # the drafter's q at each row whose children it drew from q [B, K+1, V] (rows without: 0), and which requests
    # drew theirs [B] bool; None when none did
    draft_probs: torch.Tensor | None = None
    has_q: torch.Tensor | None = None
    row_depths: list[list[int]] | None = None  # host: each request's rows' depths (the root 0, then its nodes')
    has_q_rows: list[bool] | None = None  # host copy of has_q


class TypicalAcceptance(NamedTuple):
    """Medusa's typical acceptance: keep x after p when p(x) > min(posterior_threshold, posterior_alpha *
    exp(-H(p)))."""

    posterior_threshold: float  # epsilon
    posterior_alpha: float  # delta


class RelaxedAcceptance(NamedTuple):
    """TensorRT-LLM's relaxed acceptance for the thinking phase: after a row inside ``begin_token`` ...
    ``end_token``, a greedy request keeps a draft among the target's ``topk`` most likely tokens whose
    log-probability is within ``delta`` of the most likely one's."""

    topk: int
    delta: float
    begin_token: int
    end_token: int

    def phases(self, root: bool, token_ids: Sequence[int], parents: Sequence[int]) -> list[bool]:
        """Whether each of a tree's k + 1 rows (the root, then the nodes) ends inside the thinking phase, given the
        root's (``root``: the committed tokens'); a node's is its parent's, switched on by ``begin_token`` and off
        by ``end_token``."""
        rows = [root]
        for token, parent in zip(token_ids, parents):
            inside = rows[parent + 1]
            rows.append(True if token == self.begin_token else False if token == self.end_token else inside)
        return rows


class TreeVerdict(NamedTuple):
    output_tokens: torch.Tensor  # [B, D+1] int64: the accepted path's tokens, the extra token, then -1
    num_accepted: torch.Tensor  # [B] int64 n_b: the accepted path's length (its last node's depth)
    path_rows: torch.Tensor  # [B, D+1] int64: output token j was chosen at row path_rows[b, j]; then repeats


# ---- the padded layout --------------------------------------------------------------------------------------


def _checked_depths(parents: Sequence[int]) -> list[int]:
    check_parents(parents)
    return node_depths(parents)


def _children_rows(parents: Sequence[int]) -> list[list[int]]:
    """The children rows of each of the k + 1 rows, in node order (node i is row i + 1, its parent row p + 1)."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        kids[p + 1].append(i + 1)
    return kids


def pad_tree_drafts(logits: torch.Tensor, draft_token_ids: Sequence[Sequence[int]],
                    draft_parents: Sequence[Sequence[int]],
                    draft_probs: Sequence[torch.Tensor | None] | None = None) -> PaddedTree:
    """Ragged per-request trees -> the padded layout of :func:`verify_tree`, built from host lists only.

    logits [T, V]: request b's k_b + 1 rows (root, then its nodes in order), requests back to back
    (T = sum_b (k_b + 1)). draft_token_ids[b], draft_parents[b]: request b's k_b tokens and parents
    (-1 = the root, else an earlier node). A chain is parents = [-1, 0, 1, ..., k - 2]. draft_probs[b]: the
    drafter's q [k_b + 1, V'] (V' <= V) at each of request b's rows, when it drew each row's children from it
    without replacement, else None (a request without nodes has none: it is verified by coupling).
    """
    counts = [len(d) for d in draft_token_ids]
    assert len(draft_parents) == len(counts) and [len(p) for p in draft_parents] == counts, (counts, draft_parents)
    B, K, V = len(counts), max(counts, default=0), logits.shape[-1]
    assert logits.shape[0] == sum(counts) + B, (logits.shape, counts)
    device = logits.device
    depths = [_checked_depths(p) for p in draft_parents]
    kids = [_children_rows(p) for p in draft_parents]
    M = max((len(c) for rows in kids for c in rows), default=0) or 1
    rows, table, children, start = [], [], [], 0
    for k, ids, parents, dep, ks in zip(counts, draft_token_ids, draft_parents, depths, kids):
        rows.extend(start + min(j, k) for j in range(K + 1))
        pad = [0] * (K - k)
        table.append([list(ids) + pad, [p + 1 for p in parents] + pad, dep + pad])  # [3, K]
        children.extend(c + [-1] * (M - len(c)) for c in ks + [[]] * (K - k))  # K+1 rows of M
        start += k + 1
    target = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=device)).view(B, K + 1, V)
    ids_t, parent_rows, depth_t = torch.tensor(table, dtype=torch.long, device=device).view(B, 3, K).unbind(1)
    children_t = torch.tensor(children, dtype=torch.long, device=device).view(B, K + 1, M)
    num_drafts = torch.tensor(counts, dtype=torch.long, device=device)
    max_depth = max((max(d, default=0) for d in depths), default=0)
    q, has_q = None, None
    has_q_rows = None
    if draft_probs is not None:  # a request without nodes samples its token as one without q does (coupled, keyed):
        # the same token whether or not a request beside it brings a q this step
        draft_probs = [x if k else None for x, k in zip(draft_probs, counts)]
    if draft_probs is not None and any(x is not None for x in draft_probs):
        assert len(draft_probs) == B, (len(draft_probs), B)
        q = torch.zeros(B, K + 1, V, device=device)
        for b, (k, probs) in enumerate(zip(counts, draft_probs)):
            if probs is not None:
                assert probs.shape[0] == k + 1, (probs.shape, k)
                q[b, : k + 1, : probs.shape[-1]] = probs
        has_q_rows = [x is not None for x in draft_probs]
        has_q = torch.tensor(has_q_rows, dtype=torch.bool).to(device)
    return PaddedTree(target, ids_t, parent_rows, num_drafts, counts, children_t, max_depth, depth_t, q, has_q,
                      [[0] + d for d in depths], None if has_q is None else has_q_rows)


# ---- verification -------------------------------------------------------------------------------------------


def verify_tree(padded: PaddedTree, batch: SamplingBatch, typical: TypicalAcceptance | None = None,
                relaxed: RelaxedAcceptance | None = None, thinking: torch.Tensor | None = None) -> TreeVerdict:
    """Verify every request's tree in one batch: the greedy walk for an all-greedy batch (argmax only), else
    sibling rejection sampling (greedy rows inside it are greedy through their one-hot p and u = 0), or with
    ``typical`` Medusa's typical acceptance (lossy), or with ``relaxed`` relaxed acceptance at the rows ``thinking``
    [B, K+1] bool marks (lossy; the caller marks greedy requests' rows only).

    A tree without q is verified by coupling (a seeded request's uniforms keyed by the sequence positions its rows
    sample, with ``batch.positions``); a tree drawn from q by the sibling rule, a seeded request drawing k_b
    uniforms (node i's u, tested at most once), then V exponentials for the extra token, from its generator, so
    its stream depends only on its own tree. Greedy requests draw none.
    """
    B, K1, _ = padded.target_logits.shape
    assert len(batch) == B, (len(batch), B)
    assert padded.draft_token_ids.shape == (B, K1 - 1), (padded.draft_token_ids.shape, B, K1)
    if relaxed is not None:
        assert thinking is not None and thinking.shape == (B, K1), (None if thinking is None else thinking.shape)
        if batch.all_greedy:
            return _verify_sampled(padded, batch, relaxed, thinking)
        exact = verify_tree(padded, batch, typical)  # a sampled request's verdict is the one without relaxing
        return _select(batch.greedy, _verify_sampled(padded, batch, relaxed, thinking), exact)
    if batch.all_greedy:
        return _verify_greedy(padded)
    if typical is not None:
        return _verify_typical(padded, batch, typical)
    if padded.has_q_rows is None:
        return _verify_coupled(padded, batch)
    sampled = _verify_sampled(padded, batch)
    if all(padded.has_q_rows):
        return sampled
    return _select(padded.has_q, sampled, _verify_coupled(padded, batch))


def _select(rows: torch.Tensor, a: TreeVerdict, b: TreeVerdict) -> TreeVerdict:
    """rows [B] bool: a's verdict where set, else b's."""
    return TreeVerdict(*(torch.where(rows.view(-1, *[1] * (x.dim() - 1)), x, y) for x, y in zip(a, b)))


def _row_table(x: torch.Tensor, root: float | int) -> torch.Tensor:
    """A per-node table [B, K] -> per-row [B, K+1] (row i + 1 = node i), row 0 holding ``root``."""
    return F.pad(x, (1, 0), value=root)


def _verdict(padded: PaddedTree, path: torch.Tensor, n: torch.Tensor, extra: torch.Tensor) -> TreeVerdict:
    """path [B, D+1] rows, n [B], extra [B] -> the tokens of rows path[1 .. n], the extra token, then -1."""
    row_tokens = _row_table(padded.draft_token_ids, 0)  # [B, K+1]
    path_tokens = row_tokens.gather(1, path[:, 1:])  # [B, D]
    return TreeVerdict(_assemble(path_tokens, n, extra), n, path)


def _verify_greedy(padded: PaddedTree) -> TreeVerdict:
    """a = argmax [B, K+1]; accept the deepest correct node (ties: the smallest index); extra = a at its row."""
    a = padded.target_logits.argmax(dim=-1)  # [B, K+1]
    best, n, path = _deepest(padded, padded.draft_token_ids == a.gather(1, padded.parent_rows))
    return _verdict(padded, path, n, a.gather(1, best[:, None]).squeeze(1))


def _verify_coupled(padded: PaddedTree, batch: SamplingBatch) -> TreeVerdict:
    """y [B, K+1], the target's own token sampled at every row (keyed by the sequence position of the token it
    samples); the greedy rule with y for the argmax."""
    logits = padded.target_logits
    B, K1, V = logits.shape
    p = logits_to_probs(logits.reshape(B * K1, V), batch.repeat_rows(K1))  # [B*(K+1), V]
    assert padded.row_depths is not None, "pad_tree_drafts records each row's depth"
    offsets = [d + [d[-1]] * (K1 - len(d)) for d in padded.row_depths]  # padding rows repeat the last row
    y = sample_by_inversion(p, row_uniforms(batch, offsets, logits.device).view(-1)).view(B, K1)
    best, n, path = _deepest(padded, padded.draft_token_ids == y.gather(1, padded.parent_rows))
    return _verdict(padded, path, n, y.gather(1, best[:, None]).squeeze(1))


def _verify_typical(padded: PaddedTree, batch: SamplingBatch, typical: TypicalAcceptance) -> TreeVerdict:
    """p of every row [B, K+1, V]; node i passes iff p_parent(x_i) > min(eps, delta * exp(-H(p_parent))); the
    deepest node whose path passes is accepted; the extra token is sampled from p at its row."""
    logits = padded.target_logits
    B, K1, V = logits.shape
    p = torch.stack([logits_to_probs(logits[:, j], batch) for j in range(K1)], dim=1)  # [B, K+1, V]
    entropy = -torch.special.xlogy(p, p).sum(-1)  # [B, K+1] (0 log 0 = 0)
    bar = torch.clamp(typical.posterior_alpha * torch.exp(-entropy), max=typical.posterior_threshold)  # [B, K+1]
    flat = (torch.arange(B, device=logits.device)[:, None] * K1 + padded.parent_rows).reshape(-1)  # parent rows
    p_x = p.view(B * K1, V)[flat, padded.draft_token_ids.reshape(-1)].view(B, K1 - 1)  # [B, K] p_parent(x_i)
    best, n, path = _deepest(padded, p_x > bar.gather(1, padded.parent_rows))
    extra = sample(p.view(B * K1, V)[torch.arange(B, device=logits.device) * K1 + best], batch)
    return _verdict(padded, path, n, extra)


def _deepest(padded: PaddedTree, passes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """passes [B, K] (node i's own test) -> (best row [B], its depth n [B], its path [B, D+1]): the deepest node
    whose whole path passes (ties: the smallest index; row 0, the root, when none does)."""
    correct = _correct_rows(passes, padded)  # [B, K+1]
    K1 = correct.shape[1]
    depth = _row_table(padded.depths, 0)  # [B, K+1]
    rows = torch.arange(K1, device=correct.device)  # [K+1]
    key = torch.where(correct, depth * (K1 + 1) - rows, -1)  # deeper first, then the smaller row; row 0: 0
    best = key.argmax(dim=-1)  # [B]
    n = depth.gather(1, best[:, None]).squeeze(1)  # [B]
    return best, n, _ancestor_path(_row_table(padded.parent_rows, 0), best, n, padded.max_depth)  # [B, D+1]


def _correct_rows(passes: torch.Tensor, padded: PaddedTree) -> torch.Tensor:
    """passes [B, K] -> correct [B, K+1] bool: row 0 always; node i iff i < k_b, it passes its own test (greedy:
    x_i == a[parent row]) and its parent is correct. ``match`` alone is exact at depth 1; each further round of
    gather makes one more level exact."""
    K = padded.draft_token_ids.shape[1]
    real = torch.arange(K, device=passes.device)[None, :] < padded.num_drafts[:, None]  # [B, K]
    match = passes & real  # [B, K]
    correct = match
    for _ in range(padded.max_depth - 1):
        correct = match & _row_table(correct, True).gather(1, padded.parent_rows)
    return _row_table(correct, True)


def _ancestor_path(parent_of_row: torch.Tensor, last: torch.Tensor, n: torch.Tensor, D: int) -> torch.Tensor:
    """parent_of_row [B, K+1], last [B] (a row at depth n [B]) -> path [B, D+1]: its ancestor at depth j for
    j <= n, then ``last`` repeated. Walks up from depth D: entering step j the row is at depth min(n, j + 1)."""
    cur, cols = last, [last]
    for j in range(D - 1, -1, -1):
        up = parent_of_row.gather(1, cur[:, None]).squeeze(1)  # [B]
        cur = torch.where(j < n, up, cur)
        cols.append(cur)
    return torch.stack(cols[::-1], dim=1)


def _verify_sampled(padded: PaddedTree, batch: SamplingBatch, relaxed: RelaxedAcceptance | None = None,
                    thinking: torch.Tensor | None = None) -> TreeVerdict:
    """Walk down one level per round (D + 1 rounds; at depth D no row has children): r = p of the current row
    [B, V] (only the rows needed; a ``thinking`` row's relaxed candidates' weights), try its children; rows that
    accepted none stop with their residual r."""
    logits, children, D = padded.target_logits, padded.children, padded.max_depth
    B, K1, V = logits.shape
    device = logits.device
    u = _row_table(_accept_uniforms(batch, K1 - 1, padded.draft_counts, device), 0.0)  # [B, K+1] u of each row
    row_tokens = _row_table(padded.draft_token_ids, 0)  # [B, K+1]
    cur = torch.zeros(B, dtype=torch.long, device=device)  # [B] the current row
    live = torch.ones(B, dtype=torch.bool, device=device)  # [B] still walking
    n = torch.zeros(B, dtype=torch.long, device=device)
    path, residual, p_stop = [cur], None, None
    for level in range(D + 1):
        row_logits = _gather_position(logits, cur)  # [B, V]
        p = logits_to_probs(row_logits, batch)  # [B, V] p of the current row
        if relaxed is not None:
            p = torch.where(thinking.gather(1, cur[:, None]), _candidate_weights(row_logits, relaxed), p)
        r, moved = p, torch.zeros_like(live)
        if level < D:
            q = None if padded.draft_probs is None else _gather_position(padded.draft_probs, cur)  # [B, V]
            r, nxt, moved = _try_children(p, _gather_position(children, cur), row_tokens, u, live, q, padded.has_q)
            cur = torch.where(moved, nxt, cur)
            n = n + moved.long()
            path.append(cur)  # a stopped row repeats its last row
        stop = (live & ~moved)[:, None]  # [B, 1] rows that end here keep this r (and p, the fallback)
        residual = r if residual is None else torch.where(stop, r, residual)
        p_stop = p if p_stop is None else torch.where(stop, p, p_stop)
        live = moved
    extra_dist = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_stop)  # no mass left: fall back to p
    return _verdict(padded, torch.stack(path, dim=1), n, sample(extra_dist, batch))


def _candidate_weights(logits: torch.Tensor, relaxed: RelaxedAcceptance) -> torch.Tensor:
    """logits [B, V] -> [B, V] float32: 1 on the most likely token, 1/2 on the other relaxed candidates (among the
    ``topk`` most likely, log-probability within ``delta`` of the most likely one's: a gap of raw logits, as the
    log-softmax shifts a row by one constant), 0 elsewhere."""
    top = logits.topk(min(relaxed.topk, logits.shape[-1]), dim=-1).values  # [B, k], best first
    candidates = (logits >= top[:, -1:]) & (top[:, :1] - logits <= relaxed.delta)
    weights = candidates.float() * 0.5
    return weights.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _try_children(p: torch.Tensor, kids: torch.Tensor, row_tokens: torch.Tensor, u: torch.Tensor,
                  live: torch.Tensor, q: torch.Tensor | None = None, has_q: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p [B, V], kids [B, M] (rows, -1 padded), row_tokens, u [B, K+1], live [B] -> (r [B, V], next row [B],
    moved [B]): the children tried in order against the residual r (starting at p) until one is accepted. With
    ``q`` [B, V] (the row's draft distribution; used where ``has_q`` [B]) each child is tested against the q it was
    drawn from, the earlier siblings' tokens taken out of it."""
    r, nxt, moved = p, kids[:, 0], torch.zeros_like(live)
    q = None if q is None else q.float()
    for s in range(kids.shape[1]):
        c = kids[:, s]  # [B]
        r, accept, q = _try_child(r, c, row_tokens, u, live & ~moved, q, has_q)
        nxt = torch.where(accept, c, nxt)
        moved = moved | accept
    return r, nxt, moved


def _try_child(r: torch.Tensor, c: torch.Tensor, row_tokens: torch.Tensor, u: torch.Tensor, tested: torch.Tensor,
               q: torch.Tensor | None = None, has_q: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """r [B, V], c [B] (a child row or -1), tested [B] -> (r, accept [B], q):
    accept iff c exists and u_c * q(x_c) * sum(r) < r(x_c), with q one-hot on x_c where there is no ``q``
    (then a rejected x_c leaves r with r(x_c) = 0), else the row's q so far normalised (a rejected x_c leaves
    max(0, r - sum(r) * q), and q without x_c)."""
    tested = tested & (c >= 0)
    c = c.clamp_min(0)[:, None]  # [B, 1]
    x = row_tokens.gather(1, c)  # [B, 1]
    total = r.sum(-1)  # [B]
    if q is None:
        accept = tested & (u.gather(1, c).squeeze(1) * total < r.gather(1, x).squeeze(1))  # [B]
        return _remove_token(r, x, tested & ~accept), accept, None
    q_norm = q / q.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)  # [B, V]
    q_x = torch.where(has_q, q_norm.gather(1, x).squeeze(1), 1.0)  # [B]: q(x_c), 1 for one-hot rows
    accept = tested & (u.gather(1, c).squeeze(1) * q_x * total < r.gather(1, x).squeeze(1))  # [B]
    reject = tested & ~accept
    residual = (r - total[:, None] * q_norm).clamp_min(0.0)  # [B, V] where there is q
    r = torch.where((reject & has_q)[:, None], residual, _remove_token(r, x, reject & ~has_q))
    return r, accept, torch.where(reject[:, None], q.scatter(1, x, 0.0), q)


def _remove_token(r: torch.Tensor, x: torch.Tensor, reject: torch.Tensor) -> torch.Tensor:
    """r [B, V], x [B, 1], reject [B] -> r with r(x) = 0 on the rejected rows (the renormalisation is implicit:
    the next test and the sampler divide by sum(r))."""
    return torch.where(reject[:, None], r.scatter(1, x, 0.0), r)


# ---- logprobs and the host sync -----------------------------------------------------------------------------


def tree_logprobs(padded: PaddedTree, verdict: TreeVerdict,
                  num_logprobs: Sequence[int | None]) -> TargetLogprobs | None:
    """Raw logprobs (log_softmax of the raw logits) of each output token and the top-k: output token j was chosen
    at row path_rows[b, j], so the path's logits [B, D+1, V] go to :func:`verification.target_logprobs`."""
    if all(k is None for k in num_logprobs):
        return None
    logits = padded.target_logits
    index = verdict.path_rows[..., None].expand(-1, -1, logits.shape[-1])  # [B, D+1, V]
    return target_logprobs(logits.gather(1, index), verdict.output_tokens, num_logprobs)


def node_argmax(padded: PaddedTree) -> torch.Tensor:
    """[B, K]: the target's argmax token after each node (rows 1..K; a padding node repeats the last row)."""
    return padded.target_logits[:, 1:].argmax(dim=-1)


def unpad_tree(verdict: TreeVerdict, logprobs: TargetLogprobs | None, node_tokens: torch.Tensor | None = None
               ) -> tuple[list[list[int]], list[list[int]], list[list[dict[int, Logprob]]] | None,
                          list[list[int]] | None]:
    """The step's one host sync -> (each request's kept tokens, the accepted draft indices in path order, per
    request one {token_id: Logprob} per kept token ([] for a request that asked for none; None when none asked),
    and ``node_tokens`` [B, K] (:func:`node_argmax`) as per-request rows of the request's k_b nodes, or None)."""
    tensors = [verdict.output_tokens, verdict.num_accepted, verdict.path_rows]
    if node_tokens is not None:
        tensors.append(node_tokens)
    if logprobs is not None:
        tensors += [logprobs.chosen, logprobs.chosen_rank, logprobs.top_ids, logprobs.top_logprobs]
    host = _to_host(tensors)
    tokens, counts, path = host[0], [int(k) for k in host[1]], host[2]
    kept = [[int(t) for t in row[: k + 1]] for row, k in zip(tokens, counts)]
    nodes = [[int(r) - 1 for r in row[1 : k + 1]] for row, k in zip(path, counts)]
    per_node = None
    if node_tokens is not None:
        per_node = [[int(t) for t in row] for row in host.pop(3)]
    if logprobs is None:
        return kept, nodes, None, per_node
    per_request: list[list[dict[int, Logprob]]] = [[] for _ in kept]
    for m, (b, k) in enumerate(zip(logprobs.rows, logprobs.num_top)):
        per_request[b] = entries_of(kept[b], host[3:], m, k)
    return kept, nodes, per_request, per_node
