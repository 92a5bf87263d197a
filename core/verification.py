"""Verify drafts against the target: rejection sampling (Leviathan et al. 2023; Chen et al. 2023), batched.

Request b proposed drafts x_0 .. x_{k_b - 1} (k_b = num_drafts[b]) from its drafter's distributions q_i; the
target's one pass scored k_b + 1 positions, p_i = the request's warped target distribution at position i
(p_{k_b} is the one after all its drafts). Then, with u_i ~ U[0, 1):

    accept x_i   iff   u_i * q_i(x_i) < p_i(x_i)           (u_i < min(1, p_i(x_i) / q_i(x_i)), no division)
    n_b          = the number of leading accepted drafts (0 .. k_b)
    extra token  ~ norm(max(0, p_n - q_n))   if n_b < k_b   (the first rejection)
                 ~ p_{k_b}                   if n_b == k_b  (the bonus token)

and row b emits x_0 .. x_{n_b - 1} followed by the extra token: n_b + 1 tokens, distributed exactly as
sampling them one at a time from the target. A deterministic drafter (n-gram) has q_i = one-hot(x_i); then
the test is u_i < p_i(x_i) and the residual is p_i with x_i removed.

Greedy rows need no special case: p_i is one-hot on the target's argmax and u_i = 0, so a draft is accepted
iff it is that argmax, and the extra token is the argmax at the first mismatch (or the bonus position).

A row without q (a deterministic drafter's) is verified by coupling instead: the target samples its own token
y_i ~ p_i at every position (:func:`~specray.sampling.sample_by_inversion`, a seeded request's uniform keyed by
the token's sequence position), x_i is accepted iff x_i == y_i, and the extra token is y_n. This is the one-hot
case of the rule above: x_i is kept with probability p_i(x_i), and given a rejection y_n is distributed as p_n
without x_n, renormalised. Since y_i depends only on p_i and the key, a seeded request's output is the one plain
decoding samples with the same seed, token for token, whatever was drafted (up to float rounding: p_i from a step of
other shapes differs in its last bits, which moves a draw landing that close to a boundary of its cumulative sum).

Everything is padded to K = max_b k_b and masked; nothing reads a tensor value back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from specray.outputs import Logprob
from specray.sampling import (SamplingBatch, compute_logprobs, logits_to_probs, row_uniforms, sample,
                              sample_by_inversion, to_device)


def _accept_uniforms(batch: SamplingBatch, num_positions: int, draft_counts: Sequence[int] | None,
                     device: torch.device) -> torch.Tensor:
    """u [B, K] ~ U[0, 1): a seeded request draws its own count (``draft_counts[b]`` when given, else K) from
    its generator; the other sampled rows draw from the global RNG; greedy rows get 0 and draw nothing."""
    B, K = len(batch), num_positions
    u = torch.rand(B, K, device=device) if batch.any_unseeded else torch.zeros(B, K, device=device)
    for gen, rows in batch.seeded_rows:
        for b in rows:
            k_b = K if draft_counts is None else draft_counts[b]
            if k_b:
                u[b, :k_b] = torch.rand(k_b, generator=gen, device=device)
    return u.masked_fill(batch.greedy[:, None], 0.0) if batch.any_greedy else u


def _accepted_prefix(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor,
                     num_drafts: torch.Tensor) -> torch.Tensor:
    """p_draft, q_draft, u [B, K] (p_i(x_i), q_i(x_i), u_i); num_drafts [B] -> n [B] int64.

    accept_i = u_i * q_i(x_i) < p_i(x_i) and i < k_b;  n = the length of the leading run of accepts.
    """
    positions = torch.arange(u.shape[1], device=u.device)  # [K]
    accept = (u * q_draft < p_draft) & (positions[None, :] < num_drafts[:, None])  # [B, K]
    return accept.long().cumprod(dim=-1).sum(dim=-1)  # [B]


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p, q [B, V] -> max(0, p - q) [B, V], unnormalized (sampling does not need it normalized); where it has
    no mass (p == q: impossible at a rejection in exact arithmetic) fall back to p."""
    r = (p - q).clamp_min(0.0)
    return torch.where(r.sum(dim=-1, keepdim=True) > 0, r, p)


def _gather_position(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x [B, P, V], pos [B] -> x[b, pos[b]] [B, V]."""
    return x.gather(1, pos[:, None, None].expand(-1, 1, x.shape[-1])).squeeze(1)


def _extra_distribution(p: torch.Tensor, draft_probs: torch.Tensor | None, draft_token_ids: torch.Tensor,
                        n: torch.Tensor, num_drafts: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """p [B, K+1, V], draft_probs [B, K, V] | None, draft_token_ids [B, K], n, num_drafts [B], greedy [B]
    -> the distribution of the extra token [B, V]: p_n if all k_b drafts were accepted (the bonus; greedy rows
    too, whose p is one-hot), else the residual max(0, p_n - q_n) at the first rejection n."""
    p_n = _gather_position(p, n)  # [B, V]
    K = draft_token_ids.shape[1]
    if K == 0:
        return p_n
    n_q = n.clamp(max=K - 1)  # where n == K every draft was accepted and q_n is not used
    if draft_probs is None:  # q_n = one-hot(x_n): the residual is p_n without x_n
        x_n = draft_token_ids.gather(1, n_q[:, None])  # [B, 1]
        q_n = torch.zeros_like(p_n).scatter_(-1, x_n, 1.0)
    else:
        q_n = _gather_position(draft_probs, n_q).float()
    bonus = (n == num_drafts) | greedy  # [B]
    return torch.where(bonus[:, None], p_n, _residual(p_n, q_n))


def verify(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    batch: SamplingBatch,
    draft_counts: Sequence[int] | None = None,
    has_q: Sequence[bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection-sample every request's drafts against the target, in one batch.

    target_logits [B, K+1, V]: row b's positions 0..k_b are real (p_i scores x_i; p_{k_b} is the bonus), the
        rest padding. draft_token_ids [B, K] int64 (padded with any valid id). num_drafts [B] int64 (k_b).
    draft_probs [B, K, V] | None: the drafter's q after the request's warpers; None for a deterministic
        drafter (q = one-hot on the draft).
    batch: one row per request (B rows).
    draft_counts: optional host copy of num_drafts. With it a seeded request draws exactly k_b uniforms, so its
        random stream does not depend on the other requests' draft counts; without it each draws K.
    has_q: host list [B], which rows' drafts have a q in ``draft_probs`` (None: all of them when it is given).
        Rows without (and every row when ``draft_probs`` is None) are verified by coupling.

    Returns (output_tokens [B, K+1] int64, num_accepted [B] int64): row b's tokens are
    output_tokens[b, :num_accepted[b] + 1]; the rest is -1. A row without q is coupled: one uniform per position
    (a seeded request's keyed by the position, with ``batch.positions``). A row with q: per seeded request k_b
    (or K) uniforms, then V exponentials for the extra token, from its generator. Greedy requests draw none.
    """
    B, K1, V = target_logits.shape
    K = K1 - 1
    assert draft_token_ids.shape == (B, K), (draft_token_ids.shape, target_logits.shape)
    assert len(batch) == B, (len(batch), B)
    assert draft_counts is None or (len(draft_counts) == B and max(draft_counts, default=0) <= K), draft_counts
    device = target_logits.device
    draft_token_ids = draft_token_ids.long()
    num_drafts = num_drafts.long()
    if batch.all_greedy:
        return _match_chain(target_logits.argmax(dim=-1), draft_token_ids, num_drafts)

    p = logits_to_probs(target_logits.reshape(B * K1, V), batch.repeat_rows(K1)).view(B, K1, V)  # [B, K+1, V]
    coupled = None
    if draft_probs is None or (has_q is not None and not all(has_q)):
        u = row_uniforms(batch, [range(K1)] * B, device)  # [B, K+1], position i keyed by the token it samples
        y = sample_by_inversion(p.view(B * K1, V), u.view(-1)).view(B, K1)  # [B, K+1] the target's own tokens
        coupled = _match_chain(y, draft_token_ids, num_drafts)
        if draft_probs is None:
            return coupled
    if K > 0:
        p_draft = p[:, :K].gather(-1, draft_token_ids[..., None]).squeeze(-1)  # [B, K] p_i(x_i)
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)  # q_i(x_i) = 1
        else:
            q_draft = draft_probs.gather(-1, draft_token_ids[..., None]).squeeze(-1).float()  # [B, K] q_i(x_i)
        u = _accept_uniforms(batch, K, draft_counts, device)  # [B, K]
        num_accepted = _accepted_prefix(p_draft, q_draft, u, num_drafts)  # [B]
    else:
        num_accepted = torch.zeros(B, dtype=torch.long, device=device)

    extra_dist = _extra_distribution(p, draft_probs, draft_token_ids, num_accepted, num_drafts, batch.greedy)
    extra = sample(extra_dist, batch)  # [B]
    tokens = _assemble(draft_token_ids, num_accepted, extra)
    if coupled is None:
        return tokens, num_accepted
    with_q = _bool_rows(has_q, device)[:, None]  # [B, 1]
    return torch.where(with_q, tokens, coupled[0]), torch.where(with_q[:, 0], num_accepted, coupled[1])


def _bool_rows(flags: Sequence[bool], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(list(flags), dtype=torch.bool), device)


def _match_chain(y: torch.Tensor, draft_token_ids: torch.Tensor,
                 num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y [B, K+1], the target's own token at each position (greedy: its argmax; else sampled, coupled): accept x_i
    iff x_i == y_i and i < k_b; the extra token is y_n."""
    K = draft_token_ids.shape[1]
    positions = torch.arange(K, device=y.device)  # [K]
    accept = (draft_token_ids == y[:, :K]) & (positions[None, :] < num_drafts[:, None])  # [B, K]
    n = accept.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    extra = y.gather(1, n[:, None]).squeeze(1)  # [B]
    return _assemble(draft_token_ids, n, extra), n


def _assemble(draft_token_ids: torch.Tensor, n: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """draft_token_ids [B, K], n [B], extra [B] -> [B, K+1]: x_0 .. x_{n-1}, extra, then -1."""
    K1 = draft_token_ids.shape[1] + 1
    positions = torch.arange(K1, device=draft_token_ids.device)[None, :]  # [1, K+1]
    drafts = torch.nn.functional.pad(draft_token_ids, (0, 1), value=-1)  # [B, K+1]
    out = torch.where(positions < n[:, None], drafts, torch.full_like(drafts, -1))
    return torch.where(positions == n[:, None], extra[:, None], out)


class PaddedDrafts(NamedTuple):
    target_logits: torch.Tensor  # [B, K+1, V]
    draft_token_ids: torch.Tensor  # [B, K] int64
    num_drafts: torch.Tensor  # [B] int64
    draft_probs: torch.Tensor | None  # [B, K, V] | None
    draft_counts: list[int]  # the host copy of num_drafts
    has_q: list[bool] | None = None  # host list [B]: which requests' drafts have a q in draft_probs


def pad_drafts(
    logits: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None] | None = None,
) -> PaddedDrafts:
    """Ragged per-request rows -> the padded layout of :func:`verify`, built from host lists only.

    logits [T, V]: request b's k_b + 1 logit rows, requests back to back (T = sum_b (k_b + 1)).
    draft_token_ids: request b's k_b drafts. draft_probs: request b's q [k_b, V'] (V' <= V) or None; requests
    without q get one-hot q on their drafts when some other request has q, and q is None when none has. A request
    with no drafts has none (it is verified by coupling, as without a drafter).

    Padding repeats a request's last row / last draft; :func:`verify` masks it out.
    Usage: ``pd = pad_drafts(...); verify(*pd[:4], batch, draft_counts=pd.draft_counts, has_q=pd.has_q)``.
    """
    counts = [len(d) for d in draft_token_ids]
    B, K, V = len(counts), max(counts, default=0), logits.shape[-1]
    assert logits.shape[0] == sum(counts) + B, (logits.shape, counts)
    device = logits.device
    rows, ids, start = [], [], 0
    for k, d in zip(counts, draft_token_ids):
        rows.extend(start + min(j, k) for j in range(K + 1))
        ids.extend(list(d) + [d[-1] if k else 0] * (K - k))
        start += k + 1
    target = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=device)).view(B, K + 1, V)
    draft_ids = torch.tensor(ids, dtype=torch.long, device=device).view(B, K)
    num_drafts = torch.tensor(counts, dtype=torch.long, device=device)
    q = None
    if draft_probs is not None:  # a request without drafts samples its token as one without q does (coupled, keyed):
        # the same token whether or not a request beside it brings a q this step
        draft_probs = [x if k else None for x, k in zip(draft_probs, counts)]
    if draft_probs is not None and any(x is not None for x in draft_probs):
        assert len(draft_probs) == B
        q = torch.zeros(B, K, V, device=device)
        one_hot: list[tuple[int, int, int]] = []  # (b, i, x_i) of the requests without q
        for b, (k, d, probs) in enumerate(zip(counts, draft_token_ids, draft_probs)):
            if probs is not None:
                q[b, :k, : probs.shape[-1]] = probs[:k]
            else:
                one_hot.extend((b, i, x) for i, x in enumerate(d))
        if one_hot:
            b_idx, i_idx, x_idx = torch.tensor(one_hot, dtype=torch.long, device=device).unbind(dim=1)
            q[b_idx, i_idx, x_idx] = 1.0
        q = _usable_q(q, draft_ids)
    has_q = None if q is None else [x is not None for x in draft_probs]
    return PaddedDrafts(target, draft_ids, num_drafts, q, counts, has_q)


def _usable_q(q: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """q [B, K, V] (pad_drafts' own, changed in place), draft_ids [B, K] -> q with each row that is no
    distribution its draft was drawn from (a value not finite or negative, or no mass on the draft: a drafter's bug)
    one-hot on its draft, which verifies any draft losslessly (a q of 0 on the draft would accept it always). On the
    device, no sync; row reductions and in-place passes (a where over q would allocate and fill two more)."""
    x = draft_ids[..., None]
    usable = (q.gather(-1, x) > 0) & (q.amin(-1, keepdim=True) >= 0) & torch.isfinite(q.sum(-1, keepdim=True))
    # a bad row: zeros (its NaN and inf too: they turn NaN when multiplied by 0), then 1 on the draft
    return q.mul_(usable).nan_to_num_(0.0, 0.0, 0.0).scatter_add_(-1, x, (~usable).to(q.dtype))


class TargetLogprobs(NamedTuple):
    """The target's raw logprobs at every output position of the M requests (of B) that asked for them."""

    rows: list[int]  # host list [M]: the request (0..B-1) of each row
    num_top: list[int]  # host list [M]: each request's own k
    chosen: torch.Tensor  # [M, K+1] log p_j(output token j); padding positions hold junk
    chosen_rank: torch.Tensor  # [M, K+1] int64: output token j's vocabulary rank at position j
    top_ids: torch.Tensor  # [M, K+1, k] int64, k = max(num_top)
    top_logprobs: torch.Tensor  # [M, K+1, k] descending


def target_logprobs(target_logits: torch.Tensor, output_tokens: torch.Tensor,
                    num_logprobs: Sequence[int | None]) -> TargetLogprobs | None:
    """Raw logprobs (log_softmax of the raw logits, before any warper) of each output token and the top-k.

    target_logits [B, K+1, V], output_tokens [B, K+1] (-1 padded, as :func:`verify` returns them):
    output token j of request b was chosen at position j, so its logprob is log_softmax(target_logits[b, j]).
    num_logprobs [B]: each request's k, or None for a request that asked for none (it costs nothing).
    Host lists only: no sync.
    """
    rows = [b for b, k in enumerate(num_logprobs) if k is not None]
    if not rows:
        return None
    B, K1, V = target_logits.shape
    if len(rows) < B:
        index = _device_index(rows, target_logits.device)
        target_logits, output_tokens = target_logits.index_select(0, index), output_tokens.index_select(0, index)
    num_top = [num_logprobs[b] for b in rows]
    chosen, rank, top_ids, top_lp = compute_logprobs(target_logits.reshape(-1, V),
                                                     output_tokens.reshape(-1).clamp_min(0),
                                                     max(num_top))  # [M*(K+1)] x 2, [M*(K+1), k] x 2
    M = len(rows)
    return TargetLogprobs(rows, num_top, chosen.view(M, K1), rank.view(M, K1), top_ids.view(M, K1, -1),
                          top_lp.view(M, K1, -1))


PROMPT_ROWS_PER_PASS = 256  # prompt logits are computed this many rows at a time (a [256, V] float32 slice)


def prompt_logprob_entries(logits_of, rows: list[int], token_ids: list[int], num_top: list[int],
                           rows_per_pass: int = PROMPT_ROWS_PER_PASS) -> list[dict[int, Logprob]]:
    """The raw logprob of ``token_ids[j]`` after hidden row ``rows[j]`` and the ``num_top[j]`` most likely there,
    as one {token_id: Logprob} per row (:func:`_entry`). ``logits_of(rows) -> [n, V]`` is called on slices of at
    most ``rows_per_pass`` rows, so a long prompt never holds its whole [N, V] logits; each slice is reduced on the
    device, and the entries come back in one host sync."""
    if not rows:
        return []
    k = max(num_top)
    parts = []
    for start in range(0, len(rows), rows_per_pass):
        logits = logits_of(rows[start : start + rows_per_pass])
        ids = torch.tensor(token_ids[start : start + rows_per_pass], dtype=torch.long).to(logits.device)
        parts.append(compute_logprobs(logits, ids, k))
    host = _to_host([torch.cat(column) for column in zip(*parts)])  # chosen, rank, top ids, top logprobs
    return [_entry(t, host[0][j], host[1][j], host[2][j][:n], host[3][j][:n])
            for j, (t, n) in enumerate(zip(token_ids, num_top))]


def _device_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """A host list -> an int64 index on ``device`` with no stream sync: on CUDA an asynchronous copy from pinned
    memory (a plain ``torch.tensor(rows, device=...)`` copies from pageable memory and waits for the stream)."""
    return to_device(torch.tensor(rows, dtype=torch.long), device)


def unpad_outputs(output_tokens: torch.Tensor, num_accepted: torch.Tensor) -> list[list[int]]:
    """The step's one host sync: output_tokens [B, K+1], num_accepted [B] -> each request's kept tokens."""
    return unpad_with_logprobs(output_tokens, num_accepted, None)[0]


def unpad_with_logprobs(output_tokens: torch.Tensor, num_accepted: torch.Tensor, logprobs: TargetLogprobs | None
                        ) -> tuple[list[list[int]], list[list[dict[int, Logprob]]] | None]:
    """The step's one host sync: output_tokens [B, K+1], num_accepted [B] and the logprobs -> each request's
    kept tokens and, per request, one {token_id: Logprob} per kept token (the chosen token first, then its
    top-k; [] for a request that asked for none). None when no request asked."""
    tensors = [output_tokens, num_accepted]
    if logprobs is not None:
        tensors += [logprobs.chosen, logprobs.chosen_rank, logprobs.top_ids, logprobs.top_logprobs]
    host = _to_host(tensors)
    tokens, n = host[0], host[1]
    kept = [[int(t) for t in row[: int(k) + 1]] for row, k in zip(tokens, n)]
    if logprobs is None:
        return kept, None
    per_request: list[list[dict[int, Logprob]]] = [[] for _ in kept]
    for m, (b, k) in enumerate(zip(logprobs.rows, logprobs.num_top)):
        per_request[b] = entries_of(kept[b], host[2:], m, k)
    return kept, per_request


def _to_host(tensors: list[torch.Tensor]) -> list[list]:
    """One device-to-host copy for several tensors: concatenated as float64 (exact for float32 values and for
    int64 ids < 2^53), then split and reshaped as nested lists on the host."""
    flat = torch.cat([t.reshape(-1).double() for t in tensors]).tolist()
    out, start = [], 0
    for t in tensors:
        out.append(_nest(flat[start : start + t.numel()], list(t.shape)))
        start += t.numel()
    return out


def _nest(flat: list, shape: list[int]) -> list:
    """A flat row-major list -> nested lists of ``shape`` (host only)."""
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def entries_of(kept: list[int], host: list[list], m: int, k: int) -> list[dict[int, Logprob]]:
    """Row ``m`` of a :class:`TargetLogprobs` on the host (``host``: its chosen, chosen_rank, top_ids and
    top_logprobs as nested lists) -> one entry per kept token, with the request's ``k`` most likely."""
    chosen, rank, top_ids, top_lp = (column[m] for column in host)
    return [_entry(t, chosen[j], rank[j], top_ids[j][:k], top_lp[j][:k]) for j, t in enumerate(kept)]


def _entry(token: int, chosen: float, rank: float, top_ids: list[float], top_logprobs: list[float]
           ) -> dict[int, Logprob]:
    """{token: Logprob} for the chosen token, then the top-k in descending order, ranked 1..k (the chosen one not
    twice)."""
    entry = {token: Logprob(chosen, int(rank))}
    for r, (t, lp) in enumerate(zip(top_ids, top_logprobs), start=1):
        entry.setdefault(int(t), Logprob(lp, r))
    return entry
