"""The Gated DeltaNet linear-attention layer (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), with tensor-parallel linears and a
recurrent state per request that the runner owns (:class:`~specray.models.kv_cache.RecurrentState`).

Per token t of a sequence, with the projections of its hidden state x_t:

* ``[q; k; v]_t = silu(causal_conv([q; k; v] inputs))``: a depthwise conv of width K over the last K inputs
  (the state keeps the last K - 1 committed ones);
* q and k are L2-normalised per head, q scaled by ``1 / sqrt(key_dim)``; each q/k head serves
  ``value_heads / key_heads`` consecutive value heads;
* the decay ``g_t = -exp(A_log) * softplus(a_t + dt_bias)`` (log space) and the strength ``beta_t = sigmoid(b_t)``;
* the delta rule on the matrix state S [key_dim, value_dim] per value head:
  ``S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = q_t^T S``;
* ``out = out_proj(rmsnorm(o_t) * w * silu(z_t))``, the norm over each head's value_dim.

Heads split over tensor-parallel ranks (key and value heads alike; every rank holds whole groups), so the conv, the
recurrence and the norm are local and ``out_proj`` reduces once.

A step's sequences each name a state slot and how to start (:class:`RecurrentBatch`): fresh (zeros, at position 0),
or from the slot's committed state after replaying the first ``replay`` of the drafts the request's previous chunk
left pending (the drafts the target accepted). The tokens of the chunk then run from there. Drafts are never
committed: the slot keeps the state after the chunk's last non-draft token and the drafts' inputs, for the next
chunk to replay. Everything a step needs is in Python lists built from the plan, so the layer reads no tensor's
value on the host.

A step replayed from a graph (:mod:`specray.models.step_graphs`: B sequences padded to a power of two, Q rows each)
hands the same facts over as device tensors instead (:class:`RecurrentGraphBatch`), which the graph reads as data,
and the layer runs a fixed-shape form of the same recurrence (:meth:`GatedDeltaNet._fixed_recurrence`): every
sequence's conv window is K - 1 history rows, Q replay rows and Q new rows, gathered by index math (the runner
picks the step's Q past its most replays: each sequence's replays fit);
rows past a sequence's own replays and tokens are padding (g = 0, beta = 0: the state stays as it is); the committed
state is selected on the device after each sequence's last committed token; the conv history, pending inputs and
gates go back by fixed-shape scatters. Padding sequences start from zeros in a scratch slot no request owns. A
graph step with token trees also reads each row's parent row (:meth:`RecurrentBatch.parent_rows`) and runs the tree
form (:meth:`RecurrentMixer._fixed_tree_conv`, :meth:`RecurrentMixer._fixed_tree_rule`): each row's conv window
gathered along its path, its state from its parent row's by one row of the mixer's own rule at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.kv_cache import RecurrentLayerState, RecurrentStateSpec
from specray.models.layers import (ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear, _copy, _param,
                                   divide, narrow)
from specray.parallel import TPGroup

L2_EPS = 1e-6  # q and k are divided by sqrt(sum of squares + this), as the reference kernels do


@dataclass
class RecurrentBatch:
    """Per sequence of a step, in the step's order: its state slot, whether it starts from zeros (its chunk starts
    at position 0), how many of the previous chunk's pending drafts to replay before its tokens (the accepted
    ones), and how many of its own last tokens are drafts (kept pending, not committed). ``targets``: the slots the
    step writes each sequence's new state into (None: the slots it reads). The runner gives each request two slots
    and writes the one it does not read, so that a step that fails part way leaves every state it read intact."""

    slots: list[int]
    fresh: list[bool]
    replay: list[int]
    drafts: list[int]
    targets: list[int] | None = None
    # per sequence, its drafts' tree (ScheduledChunk.draft_parents: each draft's parent draft, -1 for the chunk's last
    # real token) or None for a chain; None: every sequence a chain
    parents: list[list[int] | None] | None = None

    def padded(self, batch: int, query_lens: list[int], scratch: int, device: torch.device | str,
               width: int = 0) -> RecurrentGraphBatch:
        """These sequences as a graph step's device table (:class:`RecurrentGraphBatch`), with ``batch -
        len(query_lens)`` padding sequences after them: fresh, no replay, no drafts, no tokens, reading and writing
        state slot ``scratch`` (no request's). A step with a token tree also gives each sequence's ``width`` rows
        (the graph's) their parent rows (:meth:`parent_rows`)."""
        pads = batch - len(query_lens)
        assert pads >= 0 and len(query_lens) == len(self.slots), (batch, query_lens, self.slots)
        targets = self.slots if self.targets is None else self.targets
        rows = [self.slots + [scratch] * pads, targets + [scratch] * pads,
                [int(f) for f in self.fresh] + [1] * pads, self.replay + [0] * pads, self.drafts + [0] * pads,
                list(query_lens) + [0] * pads]
        if self.parents is not None and any(p is not None for p in self.parents):
            assert width >= max(query_lens), (width, query_lens)
            rows += [list(col) for col in zip(*self.parent_rows(query_lens, width),
                                              *[range(-1, width - 1)] * pads)]
        table = torch.tensor(rows, dtype=torch.long)
        if torch.device(device).type == "cuda":  # from pinned memory: an asynchronous copy, no wait for the stream
            table = table.pin_memory().to(device, non_blocking=True)
        return RecurrentGraphBatch(table)

    def parent_rows(self, query_lens: list[int], width: int) -> list[list[int]]:
        """Per sequence, the parent of each of its ``width`` rows among them (-1: the state it starts the rows
        from, after its replays): a chain's row j - 1; a tree's drafts (:func:`tree_rows`) their parent draft's row
        or the last real token's; padding rows past its tokens the row before."""
        out = []
        for n, drafts, parents in zip(query_lens, self.drafts, self.parents or [None] * len(query_lens)):
            chain = list(range(-1, width - 1))
            if parents is not None:
                real = n - drafts
                chain[real: n] = [real - 1 if p < 0 else real + p for p in parents]
            out.append(chain)
        return out


@dataclass
class RecurrentGraphBatch:
    """A graph step's :class:`RecurrentBatch` as data on the device: ``table`` [6, B] long, one column per sequence
    (padding ones included), its rows the state slot read, the slot written, fresh (1: start from zeros), the
    drafts replayed, the drafts among its tokens and its real tokens (the rest of its Q rows are padding); in a
    step with token trees, Q rows more: each of a sequence's Q rows' parent row (:meth:`RecurrentBatch.parent_rows`).
    A graph holds one as a static input and copies each step's into it (:meth:`copy_`)."""

    table: torch.Tensor

    @property
    def trees(self) -> bool:
        """Whether the step's rows carry parents (a step with token trees: graphs of their own)."""
        return self.table.shape[0] > 6

    def clone(self) -> RecurrentGraphBatch:
        return RecurrentGraphBatch(self.table.clone())

    def copy_(self, other: RecurrentGraphBatch) -> None:
        self.table.copy_(other.table)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    # x: [..., D] -> x / sqrt(sum(x^2) + eps) over D
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def causal_conv(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                act: bool = True) -> torch.Tensor:
    """Depthwise causal conv then silu (``act``): ``window`` [B, K - 1 + L, C] (per sequence the K - 1 inputs
    before the first output, then L inputs), ``weight`` [C, K], ``bias`` [C] or None -> [B, L, C], output t =
    silu(sum_j weight[:, j] * window[:, t + j] + bias)."""
    out = F.conv1d(window.transpose(1, 2).to(weight.dtype), weight[:, None, :], bias,
                   groups=weight.shape[0])  # [B, C, L]
    return (F.silu(out) if act else out).transpose(1, 2).to(window.dtype)


def _decayed(state: torch.Tensor, g: torch.Tensor, decay_by: torch.Tensor | None) -> torch.Tensor:
    """``state`` [..., H, dk, dv] times its decay: exp(g) per head (g [..., H]), or per head and key row where g
    has a key dimension (g [..., H, dk]: Kimi Delta Attention's per-channel decay, :mod:`specray.models.kimi_delta`),
    or with ``decay_by`` [H, dk] (Mamba-1's A) exp(g * decay_by) per head and key row."""
    if decay_by is None:
        if g.dim() == state.dim() - 1:  # one decay per key channel
            return state * g.exp()[..., None]
        return state * g.exp()[..., None, None]
    return state * (g[..., None] * decay_by).exp()[..., None]


def gated_delta_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, keep_at: list[int] | torch.Tensor | None = None, delta: bool = True,
                     decay_by: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule token by token (module docstring), float32, B sequences padded to L tokens: q, k [B, L, H,
    dk] (normalised, q scaled), v [B, L, H, dv], g, beta [B, L, H], state [B, H, dk, dv]. Padding tokens must have
    g = 0 and beta = 0 (they leave the state as it is). Returns the outputs [B, L, H, dv] and the state after token
    ``keep_at[b]`` of each sequence (None: after the last token; a host list, or a [B] long tensor on the device,
    where -1 keeps the state given). ``delta=False``: the plain gated rule of Mamba-2's state-space dual instead,
    ``S <- exp(g_t) S + k_t (beta_t v_t)^T`` (nothing subtracted: :mod:`specray.models.mamba2`); with ``decay_by``
    [H, dk], each key row of S decays by its own exp(g_t * decay_by) (Mamba-1's selective scan:
    :mod:`specray.models.mamba1`); with g [B, L, H, dk], by its own exp(g_t) (Kimi Delta Attention's per-channel
    decay: :mod:`specray.models.kimi_delta`; :func:`gated_delta_tree` takes g [L, H, dk] alike)."""
    length = q.shape[1]
    keep = None
    if isinstance(keep_at, torch.Tensor):  # [L, B, 1, 1, 1] by comparison on the device
        keep = (torch.arange(length, device=state.device)[:, None] == keep_at[None, :])[:, :, None, None, None]
    elif keep_at is not None:  # [L, B, 1, 1, 1]: sequence b's state is taken after its token keep_at[b]
        hits = torch.zeros(length, len(keep_at), dtype=torch.bool)
        hits[torch.tensor(keep_at), torch.arange(len(keep_at))] = True
        keep = hits.to(state.device)[:, :, None, None, None]
    kept = state
    outputs = []
    for t in range(length):
        state = _decayed(state, g[:, t], decay_by)
        k_t = k[:, t]  # [B, H, dk]
        written = v[:, t] - (state * k_t[..., None]).sum(-2) if delta else v[:, t]  # v - k^T S: [B, H, dv]
        state = state + k_t[..., None] * (written * beta[:, t, :, None])[..., None, :]
        outputs.append((state * q[:, t, :, :, None]).sum(-2))
        if keep is not None:
            kept = torch.where(keep[t], state, kept)
    return torch.stack(outputs, 1), (state if keep is None else kept)


def tree_rows(replayed: int, real: int, parents: list[int]) -> list[int]:
    """Each row's parent row in a verify chunk whose drafts form a tree: ``replayed`` replayed drafts and ``real``
    tokens in a chain (row 0's parent -1: the state it starts from), then the drafts, draft i's parent the chunk's
    last real token (``parents[i]`` -1) or draft ``parents[i]``."""
    chain = replayed + real
    return [j - 1 for j in range(chain)] + [chain - 1 if p < 0 else chain + p for p in parents]


def tree_windows(parent_rows: list[int], width: int) -> list[list[int]]:
    """Per row, the rows of its conv window in a pool of ``width`` history rows then the chunk's rows: its K - 1 =
    ``width`` nearest ancestors (the history's last rows past the first row's), oldest first, then itself."""
    out = []
    for j in range(len(parent_rows)):
        rows, cur, back = [width + j], j, width - 1
        while len(rows) <= width:
            cur = parent_rows[cur] if cur >= 0 else -1
            if cur >= 0:
                rows.append(width + cur)
            else:
                rows.append(back)
                back -= 1
        out.append(rows[::-1])
    return out


def gated_delta_tree(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, parent_rows: list[int], keep: int, delta: bool = True,
                     decay_by: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule (``delta=False``: the plain gated rule, :func:`gated_delta_scan`) over one sequence's rows
    that form a tree (:func:`tree_rows`): row j updates its parent row's state (``state`` [H, dk, dv] for parent
    -1), so every draft sees its own path only. q, k [L, H, dk], v [L, H, dv], g, beta [L, H], float32 -> the
    outputs [L, H, dv] and the state after row ``keep``."""
    states, outputs = [], []
    for j, parent in enumerate(parent_rows):
        s = _decayed(state if parent < 0 else states[parent], g[j], decay_by)
        written = v[j] - (s * k[j][..., None]).sum(-2) if delta else v[j]  # v - k^T S: [H, dv]
        s = s + k[j][..., None] * (written * beta[j][:, None])[:, None, :]
        states.append(s)
        outputs.append((s * q[j][..., None]).sum(-2))
    return torch.stack(outputs), states[keep]


# A step whose longest (padded) sequence has at least this many tokens runs the chunked form: below it the token loop
# launches fewer kernels than the chunked form's fixed work (decode and verify steps); where the two cross on CPU:
# docs/benchmarks.md, "Linear attention". On a GPU both cost their launches (several per token against a few per
# chunk), so the crossing should come no later.
CHUNKED_FROM = 16
# a graph step's token trees keep every row's state (RecurrentMixer._fixed_tree_rule): at most this many bytes of them
# at once, the batch's sequences taken in groups that fit
TREE_STATE_BYTES = 256 << 20
CHUNK = 64  # tokens per chunk of the chunked form (flash-linear-attention's size: C x C blocks stay small)


def _segment_sums(g: torch.Tensor) -> torch.Tensor:
    """g [..., C] -> [..., C, C]: entry (t, i) the sum of g over tokens i+1..t for t >= i (0 on the diagonal), -inf
    above it. Summed directly rather than as a difference of cumulative sums, which would cancel catastrophically
    once the cumulative log-decay grows large (a token of decay -1e4 would leave later differences no precision)."""
    c = g.shape[-1]
    x = g[..., :, None].expand(*g.shape, c)  # x[t, i] = g_t
    x = x.masked_fill(~torch.ones(c, c, dtype=torch.bool, device=g.device).tril(-1), 0.0)  # keep t > i
    seg = x.cumsum(-2)  # seg[t, i] = sum of g_s over i < s <= t
    return seg.masked_fill(~torch.ones(c, c, dtype=torch.bool, device=g.device).tril(), float("-inf"))



def to_chunks(chunk: int, *xs: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """Tensors [B, L, H, ...] as chunks [B, H, N, C, ...] of C = ``chunk`` tokens (a short sequence is one chunk of
    its own length, not padded up to a whole one), zero-padded to N * C tokens; -> (C, the chunked tensors)."""
    b, length, h = xs[0].shape[:3]
    chunk = min(chunk, length)
    n = -(-length // chunk)
    pad = n * chunk - length

    def blocks(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x
        x = x.reshape(b, n, chunk, h, *x.shape[3:])
        return x.permute(0, 3, 1, 2, *range(4, x.dim()))

    return chunk, [blocks(x) for x in xs]

def chunked_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, keep_at: list[int] | torch.Tensor | None = None, chunk: int = CHUNK,
                        delta: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gated_delta_scan`'s results (same arguments, same padding rule) computed chunk by chunk: the
    within-chunk dependency solved as one triangular system, the state carried between chunks by matrix products
    (the WY / UT-transform form of Yang et al., "Parallelizing Linear Transformers with the Delta Rule over Sequence
    Length" and "Gated Delta Networks"). Plain torch, float32.

    The math, per sequence and head (S [dk, dv], rows of K, V, Q are tokens). The scan is
    ``S_t = a_t S_{t-1} + k_t u_t^T`` with ``a_t = exp(g_t)`` and the written delta
    ``u_t = beta_t (v_t - k_t^T a_t S_{t-1})``. Within a chunk starting from state S0, with ``G_t`` the cumulative
    log-decay (``sum_{s<=t} g_s``) and ``D[t, i] = exp(G_t - G_i)`` for i <= t (0 above the diagonal),
    unrolling gives ``a_t S_{t-1} = exp(G_t) S0 + sum_{i<t} D[t, i] k_i u_i^T``, hence

    * ``u_t + beta_t sum_{i<t} D[t, i] (k_t . k_i) u_i = beta_t v_t - beta_t exp(G_t) k_t^T S0``, i.e.
      ``(I + A) U = diag(beta) V - diag(beta exp(G)) K S0`` with A strictly lower triangular,
      ``A[t, i] = beta_t D[t, i] (k_t . k_i)``. With ``T = (I + A)^-1`` (the UT transform):
      ``U = T diag(beta) V - (T diag(beta exp(G)) K) S0 = U~ - W S0``, where U~ and W do not depend on S0, so every
      chunk's are solved at once (one batched unit-triangular solve) and only ``W S0`` waits for the state;
    * outputs ``o_t = q_t^T S_t = exp(G_t) q_t^T S0 + sum_{i<=t} D[t, i] (q_t . k_i) u_i``:
      ``O = diag(exp(G)) Q S0 + (D * Q K^T) U``;
    * the state after the chunk's token j: ``S_j = exp(G_j) S0 + sum_{i<=j} D[j, i] k_i u_i^T``; the next chunk starts
      from j = C - 1, and ``keep_at`` reads other j the same way.

    Padding tokens (g = 0, beta = 0, also those that round the length up to whole chunks) write u_t = 0 and decay by
    1: they leave the state as it is, as in the scan.

    ``delta=False`` (the plain gated rule): nothing is subtracted, so ``U = diag(beta) V`` outright (A = 0, W = 0):
    no solve, and the same outputs and states from it (Mamba-2's chunked state-space dual form)."""
    b, length, h, dk = q.shape
    dv = v.shape[-1]
    chunk, (q, k, v, g, beta) = to_chunks(chunk, q, k, v, g, beta)  # [B, H, N, C(, d)]
    n = q.shape[2]
    decay = _segment_sums(g).exp()  # D [B, H, N, C, C]: exp(G_t - G_i) on and below the diagonal, 0 above
    cum = g.cumsum(-1)  # G [B, H, N, C]: log-decay from the chunk's start through token t
    if delta:
        strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
        a = (beta[..., None] * decay * (k @ k.transpose(-1, -2))).masked_fill(~strict, 0.0)  # A [B, H, N, C, C]
        rhs = torch.cat((beta[..., None] * v, (beta * cum.exp())[..., None] * k), -1)  # [.., C, dv + dk]
        eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
        u_free, w = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True).split([dv, dk], -1)
    else:
        u_free, w = beta[..., None] * v, None
    within = decay * (q @ k.transpose(-1, -2))  # D * Q K^T [B, H, N, C, C]
    q_start = q * cum.exp()[..., None]  # diag(exp(G)) Q: the start state's share of each output
    k_end = k * decay[..., -1, :, None]  # row i: k_i exp(G_{C-1} - G_i), each write's decay to the chunk's end
    end = cum[..., -1].exp()[..., None, None]  # exp(G_{C-1}) [B, H, N, 1, 1]
    keep = on_device = None
    if keep_at is not None:  # each sequence's chunk and token there, whose state is kept
        rows = torch.arange(b, device=q.device)
        if isinstance(keep_at, torch.Tensor):  # on the device (-1: the state given): every chunk selects by value
            at_chunk, at_token = keep_at.div(chunk, rounding_mode="floor"), keep_at.remainder(chunk)
            on_device = at_chunk[:, None, None, None]
        else:  # host lists: no sync
            at_chunk = torch.tensor([t // chunk for t in keep_at], device=q.device)
            at_token = torch.tensor([t % chunk for t in keep_at], device=q.device)
            keep = {c: torch.tensor([i for i, t in enumerate(keep_at) if t // chunk == c], device=q.device)
                    for c in {t // chunk for t in keep_at}}
        k_keep = k[rows, :, at_chunk] * decay[rows, :, at_chunk, at_token][..., None]  # [B, H, C, dk]: D[j, i] k_i
        start_keep = cum[rows, :, at_chunk, at_token].exp()[..., None, None]  # exp(G_j) [B, H, 1, 1]
        kept = state.clone()
    outputs = []
    for c in range(n):
        u = u_free[:, :, c] if w is None else u_free[:, :, c] - w[:, :, c] @ state  # U = U~ - W S0 [B, H, C, dv]
        outputs.append(q_start[:, :, c] @ state + within[:, :, c] @ u)
        if on_device is not None:
            kept = torch.where(on_device == c, start_keep * state + k_keep.transpose(-1, -2) @ u, kept)
        elif keep is not None and c in keep:
            idx = keep[c]
            kept.index_copy_(0, idx, start_keep[idx] * state[idx] + k_keep[idx].transpose(-1, -2) @ u[idx])
        state = end[:, :, c] * state + k_end[:, :, c].transpose(-1, -2) @ u
    out = torch.stack(outputs, 2).reshape(b, h, n * chunk, dv)[:, :, :length].transpose(1, 2)  # [B, L, H, dv]
    return out, (state if keep_at is None else kept)


def scanned_selective(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, keep_at: list[int] | torch.Tensor | None, decay_by: torch.Tensor,
                      chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gated_delta_scan`'s plain rule with ``decay_by`` (Mamba-1's selective scan: same arguments, same
    padding rule, the same results within float32 rounding) as a parallel prefix scan over each chunk of tokens,
    so a long prefill takes log2(chunk) steps a chunk rather than one a token.

    With the state's value rows fixed (S [dk, dv]), each entry follows ``h_t = a_t h_(t-1) + b_t``, a_t =
    exp(g_t decay_by) and b_t = k_t (beta_t v_t)^T: a linear recurrence, whose pairs (a, b) compose associatively,
    (a2, b2) after (a1, b1) = (a2 a1, a2 b1 + b2). The Hillis-Steele scan doubles the reach each step (row t takes
    row t - 2^i's composite), decays multiplying decays (no division, so no overflow however strong the decay); the
    state carried in joins the chunk's first row, and each chunk starts from the last one's end."""
    b, length, h, dk = q.shape
    keep = None
    if keep_at is not None:  # [B] on the device: -1 keeps the state given
        keep = keep_at if isinstance(keep_at, torch.Tensor) else torch.tensor(keep_at, device=state.device)
        kept = state.clone()
    outputs = []
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        a = (g[:, start:end, :, None] * decay_by).exp()[..., None]  # [B, C, H, dk, 1]
        x = k[:, start:end, ..., None] * (beta[:, start:end, :, None, None] * v[:, start:end, :, None, :])
        x = torch.cat((a[:, :1] * state[:, None] + x[:, :1], x[:, 1:]), 1)  # [B, C, H, dk, dv]: the state joins
        reach = 1
        while reach < end - start:  # after this step row t composes rows t - 2 reach + 1 .. t
            x = torch.cat((x[:, :reach], a[:, reach:] * x[:, :-reach] + x[:, reach:]), 1)
            a = torch.cat((a[:, :reach], a[:, reach:] * a[:, :-reach]), 1)
            reach *= 2
        outputs.append((x * q[:, start:end, ..., None]).sum(-2))  # q^T S per row: [B, C, H, dv]
        if keep is not None:  # the rows kept that lie in this chunk
            row = (keep - start).clamp(0, end - start - 1)
            at = x[torch.arange(b, device=x.device), row]  # [B, H, dk, dv]
            kept = torch.where(((keep >= start) & (keep < end))[:, None, None, None], at, kept)
        state = x[:, -1]
    return torch.cat(outputs, 1), (state if keep is None else kept)


class FusedColumnLinear(MergedColumnParallelLinear):
    """A column-parallel projection whose checkpoint tensor stacks several outputs (q, k, v of ``in_proj_qkv``):
    each rank holds its rows of each part, loaded from the one tensor (or part by part, ``shard_id``)."""

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int | None = None) -> None:
        if shard_id is not None:
            super().weight_loader(param, loaded, shard_id)
            return
        start = 0
        for i, size in enumerate(self.output_sizes):
            super().weight_loader(param, narrow(loaded, 0, start, size), i)
            start += size


def rank_rows(tp: TPGroup, *shape: int) -> nn.Parameter:
    """A parameter of ``shape`` loading this rank's rows (its first dimension's) of a checkpoint tensor that stacks
    every rank's in rank order, reshaped to ``shape`` (a conv's [C, 1, K] as [C, K])."""
    param = _param(*shape)
    rows = shape[0]
    param.weight_loader = lambda p, loaded: _copy(p, narrow(loaded, 0, tp.rank * rows, rows).reshape(p.shape))
    return param


def _head_param(count: int, tp: TPGroup) -> nn.Parameter:
    """A per-value-head parameter [count / ranks] loading this rank's heads of the checkpoint's [count]."""
    return rank_rows(tp, count // tp.size)


def depthwise_conv(tp: TPGroup, channels: int, kernel: int, bias: bool) -> nn.Module:
    """A recurrent mixer's ``conv1d`` over this rank's ``channels`` (the checkpoint's whole conv's rows in rank
    order): its weight [channels, kernel] and bias [channels] or None."""
    conv = nn.Module()
    conv.weight = rank_rows(tp, channels, kernel)
    conv.bias = rank_rows(tp, channels) if bias else None
    return conv


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x) * weight * silu(gate)`` over the last dimension: the norm in float32, the weight applied in x's
    dtype (a plain weight, not ``1 + w``)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(size)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate: [..., size] -> [..., size]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class RecurrentMixer(nn.Module):
    """What a layer with a recurrent state per request shares (Gated DeltaNet here, Mamba-2's mixer in
    :mod:`specray.models.mamba2`, LFM2's short conv in :mod:`specray.models.lfm2`): its slots, the replay of accepted
    drafts, token trees, the fixed-shape form for graph steps (module docstring). A subclass gives the conv
    (``conv1d.weight`` [C, K], ``conv1d.bias`` [C] or None; ``kernel`` K; ``conv_activation``), how its conv's output
    splits into q, k, v (:meth:`_split_heads`), its rule (``delta_rule``: the delta rule, else the plain gated one;
    or :meth:`_rule` and :meth:`_tree_rule` of its own: a conv alone keeps no matrix) and what it adds to the rule's
    outputs (:meth:`_skip`); its ``forward`` hands the conv's inputs and each token's g and beta to
    :meth:`recurrence`."""

    delta_rule = True
    conv_activation = True  # silu after the conv (LFM2's short conv: none)
    # each row's q, k, v, g and beta all come from its conv's output (Mamba-1's: _heads_and_gates), not g and beta
    # from the layer's input: replayed drafts' are recomputed from their conv outputs, and padding rows' zeroed
    gates_from_conv = False
    kernel: int
    state: RecurrentLayerState | None = None

    def bind_state(self, state: RecurrentLayerState) -> None:
        self.state = state

    def _split_heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _heads_and_gates(self, conv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(``gates_from_conv``) conv [B, L, C] -> q, k, v as :meth:`_split_heads` gives them, and g, beta [B, L,
        H] float32."""
        raise NotImplementedError

    def _skip(self, out: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The rule's outputs [B, L, H, dv] as the layer's (v: the rows' values, same shape): as they are."""
        return out

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        return causal_conv(window, self.conv1d.weight, getattr(self.conv1d, "bias", None), self.conv_activation)

    def _tree_conv(self, rows: torch.Tensor) -> torch.Tensor:
        """A tree's conv outputs [L, C] from each row's window ``rows`` [L, K, C] (its K - 1 nearest ancestors'
        inputs, oldest first, then its own: :func:`tree_windows`); a mixer with a conv of its own gives its own."""
        x = (rows.to(self.conv1d.weight.dtype) * self.conv1d.weight.t()).sum(1)  # [L, C]
        bias = getattr(self.conv1d, "bias", None)
        x = x if bias is None else x + bias
        return F.silu(x) if self.conv_activation else x

    def _rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, keep_at: list[int] | torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        scan = chunked_gated_delta if q.shape[1] >= CHUNKED_FROM else gated_delta_scan  # same results
        return scan(q, k, v, g, beta, state, keep_at, delta=self.delta_rule)

    def _tree_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, parent_rows: list[int], keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_rule` over one sequence's rows that form a tree (:func:`gated_delta_tree`)."""
        return gated_delta_tree(q, k, v, g, beta, state, parent_rows, keep, self.delta_rule)

    def recurrence(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta) -> torch.Tensor:
        """The step's outputs [T, H, dv] from the conv's inputs ``mixed`` [T, C] and each token's log decay ``g``
        and strength ``beta`` [T, H] (float32); meta.recurrent: the step's RecurrentBatch (meta.query_lens its
        sequences' tokens), or a graph step's RecurrentGraphBatch (B sequences of T / B rows each)."""
        batch: RecurrentBatch | RecurrentGraphBatch = meta.recurrent
        assert batch is not None and self.state is not None, "a linear-attention layer needs its recurrent state"
        if isinstance(batch, RecurrentGraphBatch):
            return self._fixed_recurrence(mixed, g, beta, batch)
        return self._recurrence(mixed, g, beta, batch, meta.query_lens)

    def _recurrence(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: RecurrentBatch,
                    query_lens: list[int]) -> torch.Tensor:
        """Each sequence's outputs [T, Hv, dv] from its state, replaying its accepted drafts first; writes each
        sequence's committed state and its chunk's pending drafts into its target slot."""
        st, width = self.state, self.kernel - 1
        seqs, start = [], 0
        for slot, fresh, n, k, q_len in zip(batch.slots, batch.fresh, batch.replay, batch.drafts, query_lens):
            assert k <= st.max_pending and (n == 0 or not fresh), (slot, n, k, st.max_pending)
            new = mixed[start: start + q_len]
            history = st.inputs.new_zeros(width, mixed.shape[1]) if fresh else st.inputs[slot, : width + n]
            window = torch.cat((history, new))  # [K - 1 + n + q, C]
            gates = st.gates[slot, :n]  # [n, 2, Hv]: the replayed drafts' g and beta
            seqs.append((slot, fresh, n, k, window, torch.cat((gates[:, 0], g[start: start + q_len])),
                         torch.cat((gates[:, 1], beta[start: start + q_len]))))
            start += q_len
        # every sequence's conv at once over its padded window: outputs past a sequence's own n + q are zeroed
        lengths = [len(s[4]) - width for s in seqs]  # n + q each
        conv = self._conv(torch.nn.utils.rnn.pad_sequence([s[4] for s in seqs], batch_first=True))  # [B, L, C]
        trees = {b: tree_rows(s[2], lengths[b] - s[2] - s[3], p)  # a tree's rows: their own windows and scan
                 for b, (s, p) in enumerate(zip(seqs, batch.parents or [None] * len(seqs))) if p is not None}
        for b, parent_rows in trees.items():  # each row's conv over its ancestors' inputs (host lists: no sync)
            windows = torch.tensor(tree_windows(parent_rows, width), dtype=torch.long, device=mixed.device)
            conv[b, : len(parent_rows)] = self._tree_conv(seqs[b][4][windows]).to(conv.dtype)
        real = (torch.arange(conv.shape[1]) < torch.tensor(lengths)[:, None]).to(conv.device)  # [B, L] (no sync)
        if self.gates_from_conv:
            q, k, v, g_pad, beta_pad = self._heads_and_gates(conv * real[..., None])
            g_pad, beta_pad = g_pad * real[..., None], beta_pad * real[..., None]  # padding: the state as it is
        else:
            q, k, v = self._split_heads(conv * real[..., None])
            g_pad = torch.nn.utils.rnn.pad_sequence([s[5] for s in seqs], batch_first=True)  # [B, L, Hv], 0 past end
            beta_pad = torch.nn.utils.rnn.pad_sequence([s[6] for s in seqs], batch_first=True)
        slots = torch.tensor(batch.slots, dtype=torch.long, device=mixed.device)
        initial = st.matrix.index_select(0, slots).float()
        fresh = [i for i, s in enumerate(seqs) if s[1]]
        if fresh:
            initial[fresh] = 0.0
        committed = [n - s[3] for n, s in zip(lengths, seqs)]  # replayed + non-draft tokens
        keep_at = [c - 1 for c in committed] if any(s[3] for s in seqs) else None
        out, kept = self._rule(q, k, v, g_pad, beta_pad, initial, keep_at)
        for b, parent_rows in trees.items():  # (the chain rule's rows for it, computed above, are not used)
            rows = len(parent_rows)
            out_b, kept_b = self._tree_rule(q[b, :rows], k[b, :rows], v[b, :rows], g_pad[b, :rows],
                                            beta_pad[b, :rows], initial[b], parent_rows, committed[b] - 1)
            out[b, :rows], kept[b] = out_b, kept_b
        out = self._skip(out, v)
        targets = batch.slots if batch.targets is None else batch.targets
        targets_t = torch.tensor(targets, dtype=torch.long, device=mixed.device)
        st.matrix.index_copy_(0, targets_t, kept.to(st.matrix.dtype))
        for (_, _, n, drafts, window, g_seq, beta_seq), done, row in zip(seqs, committed, targets):
            st.inputs[row, :width] = window[done: done + width]  # the last K - 1 committed inputs
            if drafts:
                st.inputs[row, width: width + drafts] = window[width + done:]
                st.gates[row, :drafts] = torch.stack((g_seq[done:], beta_seq[done:]), dim=1)
        rows = [b * out.shape[1] + s[2] + j for b, (s, n) in enumerate(zip(seqs, lengths)) for j in range(n - s[2])]
        return out.flatten(0, 1).index_select(0, torch.tensor(rows, dtype=torch.long, device=out.device))

    def _fixed_recurrence(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          batch: RecurrentGraphBatch) -> torch.Tensor:
        """:meth:`_recurrence` for a graph step, every shape fixed by the step's (B sequences, Q rows each; P =
        min(Q, max_pending) rows for replays, which the runner's choice of Q makes room for: ``StepGraphs.shape``'s
        ``min_rows``), every per-sequence fact read from ``batch.table`` on the device: the same outputs
        [B * Q, Hv, dv] (padding rows' are garbage, dropped by the caller) and the same writes, padding sequences'
        to their scratch slot. Per sequence b with n replays, q real rows and k drafts, its L = P + Q scan rows are
        its n replayed drafts, its q tokens, then padding (g = 0, beta = 0 and zero q/k/v: the state stays as it
        is); its conv window is K - 1 history rows then those rows' inputs."""
        st, width = self.state, self.kernel - 1
        b = batch.table.shape[1]
        q_rows = mixed.shape[0] // b
        # replay rows: as many as the step's rows (more replays than rows make the runner's shape wider), so a
        # plain decode step scans 2 rows a sequence, not the state's max_pending + 1
        pend = min(q_rows, st.max_pending)
        inputs_held, gates_held = st.inputs[:, : width + pend], st.gates[:, :pend]  # the rows a step reads or writes
        length = pend + q_rows  # scan rows per sequence
        dev = mixed.device
        slots, targets, fresh, replay, drafts, lens = batch.table[:6].unbind(0)  # [B] each
        fresh = fresh.bool()
        # the window: the stored rows (history, then pending inputs; zeros when fresh) then the new rows, compacted
        # so that the new rows follow the n replayed ones: window row j < K - 1 + n is stored row j, later ones are
        # new row j - (K - 1 + n), past the pool's end (padding) clamped
        stored = inputs_held.index_select(0, slots).masked_fill(fresh[:, None, None], 0.0)  # [B, K - 1 + P, C]
        pool = torch.cat((stored, mixed.view(b, q_rows, -1)), 1)  # [B, K - 1 + P + Q, C]
        j = torch.arange(width + length, device=dev)[None, :]
        src = torch.where(j < width + replay[:, None], j, j + pend - replay[:, None]).clamp(max=width + length - 1)
        window = pool.gather(1, src[..., None].expand(-1, -1, pool.shape[-1]))  # [B, K - 1 + L, C]
        r = torch.arange(length, device=dev)[None, :]
        real = (r < (replay + lens)[:, None])[..., None]  # [B, L, 1]: replayed or new, not padding
        parents = None
        if batch.trees:  # each scan row's parent row (-1: the initial state): the new rows' after the replays'
            new = (r >= replay[:, None]) & (r < (replay + q_rows)[:, None])
            given = batch.table[6:].t().gather(1, (r - replay[:, None]).clamp(0, q_rows - 1))  # [B, L]
            parents = torch.where(new, replay[:, None] + given, r - 1)
        conv = self._conv(window) if parents is None else self._fixed_tree_conv(window, parents)  # [B, L, C]
        conv = torch.where(real, conv, torch.zeros((), dtype=conv.dtype, device=dev))
        if self.gates_from_conv:
            q, k, v, g_new, beta_new = self._heads_and_gates(conv)
        else:
            q, k, v = self._split_heads(conv)
        # g and beta likewise: the pending drafts' stored gates, then the new rows'
        heads = g.shape[-1]
        zero = torch.zeros((), dtype=g.dtype, device=dev)
        if self.gates_from_conv:  # every row's from its conv's output (replayed rows' recomputed)
            g_rows, beta_rows = torch.where(real, g_new, zero), torch.where(real, beta_new, zero)
        else:
            gates = gates_held.index_select(0, slots)  # [B, P, 2, Hv]
            row_src = torch.where(r < replay[:, None], r, r + pend - replay[:, None]).clamp(max=length - 1)
            row_src = row_src[..., None].expand(-1, -1, heads)
            g_rows = torch.where(real, torch.cat((gates[:, :, 0], g.view(b, q_rows, heads)), 1).gather(1, row_src),
                                 zero)
            beta_rows = torch.where(real, torch.cat((gates[:, :, 1], beta.view(b, q_rows, heads)), 1).gather(
                1, row_src), zero)
        initial = st.matrix.index_select(0, slots).float().masked_fill(fresh[:, None, None, None], 0.0)
        committed = replay + lens - drafts  # [B]: rows through the last committed token (0: a padding sequence)
        if parents is None:
            out, kept = self._rule(q, k, v, g_rows, beta_rows, initial, committed - 1)  # -1: the initial state kept
        else:
            out, kept = self._fixed_tree_rule(q, k, v, g_rows, beta_rows, initial, parents, committed - 1)
        out = self._skip(out, v)
        st.matrix.index_copy_(0, targets, kept.to(st.matrix.dtype))
        # the target's stored rows: the last K - 1 committed inputs (window rows from `committed` on), then the
        # drafts' inputs; rows past the drafts are zeroed (padding is never kept pending)
        i = torch.arange(width + pend, device=dev)[None, :]
        rows_src = (committed[:, None] + i).clamp(max=width + length - 1)
        inputs = window.gather(1, rows_src[..., None].expand(-1, -1, window.shape[-1]))
        inputs_held.index_copy_(0, targets, inputs.masked_fill((i >= width + drafts[:, None])[..., None], 0.0))
        p = torch.arange(pend, device=dev)[None, :]
        draft_src = (committed[:, None] + p).clamp(max=length - 1)[..., None].expand(-1, -1, heads)
        pending = torch.stack((g_rows.gather(1, draft_src), beta_rows.gather(1, draft_src)), 2)  # [B, P, 2, Hv]
        gates_held.index_copy_(0, targets, pending.masked_fill((p >= drafts[:, None])[..., None, None], 0.0))
        # each sequence's Q new rows come after its n replayed ones
        out_src = (replay[:, None] + torch.arange(q_rows, device=dev)[None, :])[..., None, None]
        return out.gather(1, out_src.expand(-1, -1, *out.shape[2:])).flatten(0, 1)

    def _fixed_tree_conv(self, window: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """:meth:`_tree_conv` over a graph step's rows: ``window`` [B, K - 1 + L, C] (history, then the scan rows),
        ``parents`` [B, L] each scan row's parent row (-1: the history's last) -> [B, L, C]. Each row's K - 1
        nearest ancestors are found by following parents on the device (:func:`tree_windows`' rule: past the first
        row, the history's rows, newest first)."""
        width = self.kernel - 1
        b, length = parents.shape
        dev = window.device
        history = (torch.arange(width, device=dev) - 1).clamp(min=0).expand(b, width)  # a history row's: the one before
        up = torch.cat((history, width + parents), 1)  # [B, K - 1 + L]: each window row's parent row
        rows = [width + torch.arange(length, device=dev).expand(b, length)]
        for _ in range(width):
            rows.append(up.gather(1, rows[-1]))
        index = torch.stack(rows[::-1], -1)  # [B, L, K], oldest first
        picked = window[torch.arange(b, device=dev)[:, None, None], index]  # [B, L, K, C]
        return self._tree_conv(picked.flatten(0, 1)).view(b, length, -1).to(window.dtype)

    def _fixed_tree_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, initial: torch.Tensor, parents: torch.Tensor, keep_at: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_tree_rule` for a graph step: B sequences of L rows, row t updating its parent row's state
        (``parents`` [B, L], -1: ``initial``) by :meth:`_rule` over that one row; -> the outputs [B, L, ...] and
        the state after row ``keep_at`` [B] (-1: the initial one). Every row's state is kept, [1 + L, ...] per
        sequence, so the sequences go in groups whose states fit ``TREE_STATE_BYTES`` (a fixed split: the shapes'
        alone)."""
        b, length = parents.shape
        per_sequence = (1 + length) * initial[0].numel() * initial.element_size()
        group = max(1, TREE_STATE_BYTES // max(1, per_sequence))  # (a conv alone keeps an empty state)
        outs, kept = [], []
        for lo in range(0, b, group):
            part = slice(lo, lo + group)
            seq = torch.arange(min(group, b - lo), device=parents.device)
            states = initial.new_empty(len(seq), 1 + length, *initial.shape[1:])
            states[:, 0] = initial[part]
            rows_out = []
            for t in range(length):
                rows = slice(t, t + 1)
                out, states[:, t + 1] = self._rule(q[part, rows], k[part, rows], v[part, rows], g[part, rows],
                                                   beta[part, rows], states[seq, parents[part, t] + 1], None)
                rows_out.append(out)
            outs.append(torch.cat(rows_out, 1))
            kept.append(states[seq, keep_at[part] + 1])
        return torch.cat(outs), torch.cat(kept)


class ConvOnlyMixer(RecurrentMixer):
    """A recurrent mixer that is its conv alone (LFM2's short conv, ZAYA's convolutional attention, Qwen4-Exp's PLE
    conv and earlier ids, the Inklings' convs): no matrix to carry, the conv's outputs are the layer's, and a token
    tree's rows need nothing past their own windows (:func:`tree_windows`)."""

    def _split_heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        v = conv[:, :, None, :]  # [B, L, 1, C]
        return v, v, v

    def _rule(self, q, k, v, g, beta, state, keep_at):
        return v, state

    def _tree_rule(self, q, k, v, g, beta, state, parent_rows, keep):
        return v, state


def check_linear_heads_split(config, tp: int, pp: int) -> None:
    """A family's ``check_split``: ``tp`` ranks split the linear-attention layers' key and value heads (checked
    before any rank starts)."""
    for heads in ("linear_num_key_heads", "linear_num_value_heads"):
        if getattr(config, heads) % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not split this model's {heads}="
                             f"{getattr(config, heads)}; choose a tensor_parallel_size that divides it")


class GatedDeltaNet(RecurrentMixer):
    """One linear-attention layer over this rank's heads (module docstring); its checkpoint names are the
    transformers ones under ``linear_attn.``."""

    def __init__(self, config, tp: TPGroup):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported for linear attention; 'silu' is")
        key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if value_heads % key_heads:
            raise ValueError(f"linear_num_value_heads={value_heads} must be a multiple of linear_num_key_heads="
                             f"{key_heads}: each key head serves a group of value heads")
        self.key_heads = divide(key_heads, tp.size, "linear_num_key_heads")
        self.value_heads = divide(value_heads, tp.size, "linear_num_value_heads")
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        key, value, h = key_heads * self.dk, value_heads * self.dv, config.hidden_size
        self.in_proj_qkv = FusedColumnLinear(h, [key, key, value], tp)
        self.in_proj_z = ColumnParallelLinear(h, value, tp)
        self.in_proj_b = ColumnParallelLinear(h, value_heads, tp)
        self.in_proj_a = ColumnParallelLinear(h, value_heads, tp)
        self.conv1d = nn.Module()  # the checkpoint's conv1d.weight [C, 1, K]: this rank's channels, [C_local, K]
        self.conv1d.weight = _param(sum(self.in_proj_qkv.local_sizes), self.kernel)
        self.conv1d.weight.weight_loader = self._load_conv
        self.tp = tp
        self.dt_bias = _head_param(value_heads, tp)
        self.A_log = _head_param(value_heads, tp)
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(value, h, tp)

    def _load_conv(self, param: nn.Parameter, loaded: Any) -> None:
        """This rank's channels of each of q, k and v (the layout of its ``in_proj_qkv`` rows)."""
        rows, start = [], 0
        for size, local in zip(self.in_proj_qkv.output_sizes, self.in_proj_qkv.local_sizes):
            rows.append(narrow(loaded, 0, start + self.tp.rank * local, local))
            start += size
        _copy(param, torch.cat(rows).reshape(param.shape))

    @property
    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(conv_dim=self.conv1d.weight.shape[0], conv_width=self.kernel - 1,
                                  num_heads=self.value_heads, key_dim=self.dk, value_dim=self.dv)

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        # x: [T, H] -> [T, H] (meta.recurrent: see recurrence)
        t = x.shape[0]
        mixed = self.in_proj_qkv(x)  # [T, C]: q | k | v before the conv
        z = self.in_proj_z(x).view(t, self.value_heads, self.dv)
        beta = self.in_proj_b(x).sigmoid().float()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [T, Hv]
        o = self.recurrence(mixed, g, beta, meta)  # [T, Hv, dv]
        return self.out_proj(self.norm(o.to(x.dtype), z).reshape(t, -1))

    def _split_heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv [B, L, C] -> q, k [B, L, Hv, dk] (L2-normed, q scaled, each key head repeated over its value
        heads) and v [B, L, Hv, dv], float32."""
        b, length, _ = conv.shape
        key = self.key_heads * self.dk
        q, k, v = conv.float().split([key, key, self.value_heads * self.dv], dim=-1)
        group = self.value_heads // self.key_heads
        q = l2norm(q.reshape(b, length, self.key_heads, self.dk)) * self.dk ** -0.5
        k = l2norm(k.reshape(b, length, self.key_heads, self.dk))
        if group > 1:  # as repeat_interleave over the heads, which the dispatcher may see as a host sync
            q, k = (x[:, :, :, None].expand(b, length, self.key_heads, group, self.dk).reshape(
                b, length, self.value_heads, self.dk) for x in (q, k))
        return q, k, v.reshape(b, length, self.value_heads, self.dv)


class RecurrentModel:
    """The plumbing of a causal LM (on :class:`~specray.models.llama.LlamaForCausalLM`'s) whose layers mix attention
    (``self_attn``: paged KV, :meth:`kv_cache_specs`) with :class:`RecurrentMixer` layers (a recurrent state per
    request, :meth:`recurrent_state_specs`), which the runner allocates and binds: Qwen3.5's family
    (:mod:`specray.models.qwen3_5`), Mamba-2's hybrids (:mod:`specray.models.mamba_hybrid`)."""

    recurrent = True  # the builder and the runner keep a recurrent state per request (engine.builder.check_recurrent)
    recurrent_state_bound = False

    @classmethod
    def recurrent_layers(cls, config) -> bool:
        """Whether ``config`` gives the model any recurrent layer (a family's release may have none: granite-4.0-micro
        is a GraniteMoeHybrid of attention layers alone); without, it is served as an attention model."""
        return True

    @property
    def has_recurrent_layers(self) -> bool:
        has = self.__dict__.get("_has_recurrent")
        if has is None:
            has = self.__dict__["_has_recurrent"] = bool(self._recurrent_mixers())
        return has

    def _attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for _, layer in self.model.stage_layers() if hasattr(layer, "self_attn")]

    def _recurrent_mixers(self) -> list[RecurrentMixer]:
        return [m for _, layer in self.model.stage_layers() for m in layer.children() if isinstance(m, RecurrentMixer)]

    def kv_cache_specs(self) -> list:
        """One paged spec per attention layer, in layer order (the recurrent layers keep a state instead)."""
        return [attn.attn.kv_spec for attn in self._attention_layers()]

    def bind_kv_cache(self, cache) -> None:
        assert cache.specs == self.kv_cache_specs(), "the cache was allocated for another model's specs"
        for j, attn in enumerate(self._attention_layers()):
            attn.attn.bind_cache(cache.layer(j), cache.block_size, cache.fp8)
        self.kv_cache_allocated = True

    def recurrent_state_specs(self) -> list[RecurrentStateSpec]:
        """One spec per recurrent layer, in layer order: what it keeps per request on this rank."""
        return [mixer.state_spec for mixer in self._recurrent_mixers()]

    def bind_recurrent_state(self, state) -> None:
        assert state.specs == self.recurrent_state_specs(), "the state was allocated for another model's specs"
        for j, mixer in enumerate(self._recurrent_mixers()):
            mixer.bind_state(state.layer(j))
        self.recurrent_state_bound = True

    def forward(self, input_ids: torch.Tensor, meta, aux_layers=()):
        if not self.has_recurrent_layers:
            return super().forward(input_ids, meta, aux_layers)
        if not self.recurrent_state_bound:
            raise ValueError("the recurrent state is not allocated: call specray.models.kv_cache."
                             "allocate_recurrent_state(model, num_slots, max_pending) before the first forward")
        if meta.recurrent is None:
            raise ValueError("a hybrid model's step needs meta.recurrent (a RecurrentBatch, or a graph step's "
                             "RecurrentGraphBatch: each sequence's state slot and replay); the model runner sets it")
        return super().forward(input_ids, meta, aux_layers)
