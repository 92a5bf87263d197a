"""Batched sampling: warp logits into probabilities, then draw one token per row.

Every row carries its own request's parameters, so one batch mixes greedy and sampled requests, and seeded
requests with unseeded ones. The per-row parameters live in tensors; which warpers run at all is decided by
Python flags computed once in :meth:`SamplingBatch.build` from the plain :class:`SamplingParams`, so nothing
here reads a tensor value back to the host (no ``.item()``, ``.tolist()``, ``bool(tensor)`` or ``nonzero``).
The caller does the one ``.tolist()`` at the end of a step.

Sampling uses the exponential race: with ``E_v ~ Exp(1)`` i.i.d., ``argmax_v p_v / E_v`` is distributed as
``p`` (``E_v / p_v ~ Exp(rate p_v)`` and the first arrival of independent exponential clocks is ``v`` with
probability ``p_v / sum p``). It needs no normalization and no host sync, and each row's noise can come from
its own request's generator, so a seeded request draws the same stream wherever it sits in any batch.

The target's own tokens are drawn by inversion instead (:func:`sample_by_inversion`): one uniform per row, the
token whose cumulative probability first exceeds it. A seeded request's uniform for the token at sequence position
t is a hash of (seed, t) alone (:func:`keyed_uniform`), so the token the target samples there depends on nothing
but p_t: not on the batch, the step, the draft count or what was verified before. Verification relies on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specray.sampling_params import SamplingParams

# Sampled rows colder than this are shifted by their largest logit before dividing by the temperature: with logits
# of any real scale, logits / T overflows float32 only far below it. _TINY: float32's smallest normal number.
COLD_TEMPERATURE = 1e-4
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SamplingBatch:
    """The sampling parameters of N rows, one row per token to sample.

    A request with K drafts has K+1 target rows; :meth:`build` with ``repeats`` gives them all its params and
    its generator. Build it with :meth:`build`; the Python flags below are computed there from the params.
    """

    temperature: torch.Tensor  # [N] float32 (1.0 on greedy rows, never read there)
    top_k: torch.Tensor  # [N] int64, 0 = off
    top_p: torch.Tensor  # [N] float32, 1.0 = off
    min_p: torch.Tensor  # [N] float32, 0.0 = off
    greedy: torch.Tensor  # [N] bool
    generators: list[torch.Generator | None]  # [N] a request's own generator, or None for the global RNG
    # Python-side, from the params (so skipping work needs no host sync):
    all_greedy: bool
    any_greedy: bool
    any_cold: bool  # some sampled row's temperature is below COLD_TEMPERATURE (logits / T could overflow)
    any_top_k: bool
    max_top_k: int  # the largest top_k over sampled rows (0 when none), the width of one torch.topk
    any_top_p: bool
    any_min_p: bool
    any_seeded: bool  # some sampled row has its own generator
    any_unseeded: bool  # some sampled row draws from the global RNG
    # (generator, its sampled rows), in order of first appearance; greedy rows are never listed, so a greedy
    # request never consumes randomness from its generator.
    seeded_rows: list[tuple[torch.Generator, list[int]]]
    seeds: list[int | None] = dataclasses.field(default_factory=list)  # [N] each sampled row's seed, else None
    # [N] the sequence position of the token each row samples (its key with the seed), or None when not given
    positions: list[int] | None = None

    def __len__(self) -> int:
        return len(self.generators)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
        repeats: Sequence[int] | None = None,
        positions: Sequence[int] | None = None,
    ) -> "SamplingBatch":
        """One row per entry of ``params`` (``repeats[i]`` rows for entry i, sharing its generator).
        ``positions[i]``: the sequence position of the first token entry i samples (its rows: the next ones)."""
        assert len(generators) == len(params), (len(generators), len(params))
        assert positions is None or len(positions) == len(params), (positions, len(params))
        if repeats is not None:
            assert len(repeats) == len(params), (len(repeats), len(params))
            if positions is not None:
                positions = [t + j for t, r in zip(positions, repeats) for j in range(r)]
            params = [sp for sp, r in zip(params, repeats) for _ in range(r)]
            generators = [g for g, r in zip(generators, repeats) for _ in range(r)]
        params, generators = list(params), list(generators)
        device = torch.device(device)
        greedy = [sp.greedy for sp in params]
        # One host-to-device copy for all five per-row tensors.
        # a temperature or top_p under float32's smallest normal would round to 0 (or a subnormal) on the device:
        # any positive one that small already keeps only the row's largest logits (top_p: its most likely token)
        table = torch.tensor(
            [[1.0 if g else max(sp.temperature, _TINY) for sp, g in zip(params, greedy)],
             [float(sp.top_k) for sp in params],
             [max(sp.top_p, _TINY) for sp in params],
             [sp.min_p for sp in params],
             [float(g) for g in greedy]],
            dtype=torch.float32,
        ).reshape(5, len(params)).to(device)
        sampled = [sp for sp, g in zip(params, greedy) if not g]
        top_ks = [sp.top_k for sp in sampled if sp.top_k > 0]
        return cls(
            temperature=table[0],
            top_k=table[1].long(),
            top_p=table[2],
            min_p=table[3],
            greedy=table[4].bool(),
            generators=generators,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_cold=any(sp.temperature < COLD_TEMPERATURE for sp in sampled),
            any_top_k=bool(top_ks),
            max_top_k=max(top_ks, default=0),
            any_top_p=any(sp.top_p < 1.0 for sp in sampled),
            any_min_p=any(sp.min_p > 0.0 for sp in sampled),
            any_seeded=any(g is not None for g, gr in zip(generators, greedy) if not gr),
            any_unseeded=any(g is None for g, gr in zip(generators, greedy) if not gr),
            seeded_rows=_group_rows(generators, greedy),
            seeds=[None if g else sp.seed for sp, g in zip(params, greedy)],
            positions=None if positions is None else list(positions),
        )

    def repeat_rows(self, n: int) -> "SamplingBatch":
        """Each row repeated ``n`` times in place (row i -> rows i*n .. i*n+n-1), e.g. for the K+1 positions of
        every request when it is verified."""
        if n == 1:
            return self

        def rep(t: torch.Tensor) -> torch.Tensor:  # [N] -> [N*n], a view-expand: no sync
            return t[:, None].expand(-1, n).reshape(-1)

        return dataclasses.replace(
            self,
            temperature=rep(self.temperature), top_k=rep(self.top_k), top_p=rep(self.top_p),
            min_p=rep(self.min_p), greedy=rep(self.greedy),
            generators=[g for g in self.generators for _ in range(n)],
            seeded_rows=[(g, [r * n + j for r in rows for j in range(n)]) for g, rows in self.seeded_rows],
            seeds=[x for x in self.seeds for _ in range(n)],
            positions=None if self.positions is None else [t + j for t in self.positions for j in range(n)],
        )


def _group_rows(generators: list[torch.Generator | None],
                greedy: list[bool]) -> list[tuple[torch.Generator, list[int]]]:
    """The sampled rows of each generator, in order of first appearance (plain Python, at build time)."""
    rows: dict[int, tuple[torch.Generator, list[int]]] = {}
    for i, (g, gr) in enumerate(zip(generators, greedy)):
        if g is not None and not gr:
            rows.setdefault(id(g), (g, []))[1].append(i)
    return list(rows.values())


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A request's own random stream (None: the request uses the global RNG)."""
    if seed is None:
        return None
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def draft_seed(seed: int | None) -> int | None:
    """A seeded request's drafts' own random stream, apart from the target's (seed + 1), kept in the 64-bit range a
    ``torch.Generator`` accepts: SamplingParams allows seeds up to 2**64 - 1."""
    return None if seed is None else (seed + 1) % (1 << 64)


# ---- warping -----------------------------------------------------------------------------------------------


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N, V] float32
    return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """logits [N, V], top_k [N] (0 = off): keep v iff logit_v >= the row's k-th largest logit (ties with the
    k-th are kept), i.e. set the rest to -inf."""
    width = min(max_top_k, logits.shape[-1])
    top = logits.topk(width, dim=-1).values  # [N, width], descending
    kth = top.gather(-1, (top_k.clamp(1, width) - 1)[:, None])  # [N, 1]
    kth = kth.masked_fill((top_k == 0)[:, None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p_keep(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [N, V], top_p [N] -> keep [N, V] bool: the smallest set of most likely tokens whose mass reaches
    top_p, i.e. in descending order keep v iff the mass strictly before v is < top_p (the first is always kept)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # [N, V] mass strictly before each sorted token
    keep_sorted = (before < top_p[:, None]) | (top_p >= 1.0)[:, None]
    return torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)


def _min_p_keep(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """probs [N, V], min_p [N] -> keep [N, V] bool: keep v iff p_v >= min_p * max_u p_u (a ratio, so it does
    not matter whether probs are renormalized first)."""
    return probs >= min_p[:, None] * probs.amax(-1, keepdim=True)


def logits_to_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] -> probs [N, V] float32 of the distribution each row samples from.

    p = softmax(logits / T), then top-k (on logits), top-p (on the top-k renormalized probs), min-p, and one
    renormalization (HF's warper order). Greedy rows get the one-hot of argmax(logits), so downstream
    math (rejection sampling included) needs no special case for them.
    """
    logits = logits.float()
    if batch.all_greedy:
        return _one_hot_argmax(logits)
    if batch.any_cold:  # shifted so that the largest is 0: logits / T of a tiny T would overflow to inf (NaN probs)
        logits = logits - logits.amax(-1, keepdim=True)
    scaled = logits / batch.temperature[:, None]  # greedy rows carry T = 1
    if batch.any_top_k:
        scaled = _apply_top_k(scaled, batch.top_k, batch.max_top_k)
    probs = scaled.softmax(dim=-1)  # [N, V]
    if batch.any_top_p or batch.any_min_p:
        keep = torch.ones_like(probs, dtype=torch.bool)
        if batch.any_top_p:
            keep &= _top_p_keep(probs, batch.top_p)
        if batch.any_min_p:
            keep &= _min_p_keep(probs, batch.min_p)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)  # the argmax is always kept, so the sum is > 0
    if batch.any_greedy:
        probs = torch.where(batch.greedy[:, None], _one_hot_argmax(logits), probs)
    return probs


# ---- drawing -----------------------------------------------------------------------------------------------


def _exponential_noise(batch: SamplingBatch, vocab_size: int, device: torch.device) -> torch.Tensor:
    """E [N, V] ~ Exp(1): each seeded row from its request's generator (all rows of one generator in one draw,
    in row order), the other sampled rows from the global RNG. Greedy rows get ones and draw nothing."""
    n = len(batch)
    if batch.any_unseeded:
        noise = torch.empty(n, vocab_size, device=device).exponential_()
    else:
        noise = torch.ones(n, vocab_size, device=device)
    for gen, rows in batch.seeded_rows:
        draw = torch.empty(len(rows), vocab_size, device=device).exponential_(generator=gen)
        if rows == list(range(rows[0], rows[0] + len(rows))):  # contiguous (the usual case): a slice
            noise[rows[0] : rows[0] + len(rows)] = draw
        else:  # an index built from a host list: a host-to-device copy, not a sync
            noise.index_copy_(0, torch.tensor(rows, device=device), draw)
    # Exp(1) can round to 0; then p/E would be inf (fine) or 0/0 = nan (picked by argmax); keep E > 0.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def sample(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """probs [N, V] (need not be normalized; rows with any mass) -> tokens [N] int64.

    Greedy rows: argmax p. Sampled rows: argmax_v p_v / E_v with E ~ Exp(1) (the exponential race).
    """
    if batch.all_greedy:
        return probs.argmax(dim=-1)
    noise = _exponential_noise(batch, probs.shape[-1], probs.device)  # [N, V]
    sampled = (probs.float() / noise).argmax(dim=-1)  # [N]
    return torch.where(batch.greedy, probs.argmax(dim=-1), sampled) if batch.any_greedy else sampled


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` with no stream sync: on CUDA an asynchronous copy from pinned memory (a plain
    ``.to(device)`` copies from pageable memory and waits for the stream)."""
    device = torch.device(device)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of SplitMix64's output function: a bijection of 64-bit ints that scatters every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_uniform(seed: int, position: int) -> float:
    """U[0, 1) from (seed, position) alone, on the host (a counter-based draw: no stream, no device): the same
    float on every device and in every batch."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 11) * 2.0 ** -53


def row_uniforms(batch: SamplingBatch, offsets: Sequence[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    """u [N, J] for row i's J draws, draw j keyed by the sequence position ``batch.positions[i] + offsets[i][j]``
    for a seeded row (:func:`keyed_uniform`); without positions a seeded row draws from its generator; unseeded
    rows draw from the global RNG; greedy rows get 0. Host lists only: one host-to-device copy, no sync."""
    n, width = len(batch), max((len(o) for o in offsets), default=0)
    u = torch.rand(n, width, device=device) if batch.any_unseeded else torch.zeros(n, width, device=device)
    keyed_rows = [i for i, seed in enumerate(batch.seeds) if seed is not None and batch.positions is not None]
    if keyed_rows:
        table = [[keyed_uniform(batch.seeds[i], batch.positions[i] + o) for o in offsets[i]]
                 + [0.0] * (width - len(offsets[i])) for i in keyed_rows]
        keyed = to_device(torch.tensor(table, dtype=torch.float64), device).float()
        u = u.index_copy(0, to_device(torch.tensor(keyed_rows, dtype=torch.long), device), keyed)
    elif batch.positions is None:
        for gen, rows in batch.seeded_rows:
            for i in rows:
                u[i, : len(offsets[i])] = torch.rand(len(offsets[i]), generator=gen, device=device)
    u = u.clamp_max_(1.0 - 2.0 ** -24)  # float32 rounding must not reach 1
    return u.masked_fill(batch.greedy[:, None], 0.0) if batch.any_greedy else u


def sample_by_inversion(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [N, V] (need not be normalized), u [N] in [0, 1) -> tokens [N] int64: the first token whose
    cumulative probability exceeds u * sum(p), distributed as p. A token without mass is never picked (the sum
    does not rise there); a one-hot row (greedy) gives its token for any u."""
    cdf = probs.float().cumsum(dim=-1)  # [N, V]
    target = (u * cdf[:, -1])[:, None]  # [N, 1]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_max_(probs.shape[-1] - 1)
    # rounding at the very top of the cumulative sum could land past the last token with mass: take the argmax
    return torch.where(probs.gather(-1, tokens[:, None]).squeeze(-1) > 0, tokens, probs.argmax(dim=-1))


def sample_without_replacement(probs: torch.Tensor, batch: SamplingBatch, k: int) -> torch.Tensor:
    """probs [N, V] -> [N, k] int64: k distinct tokens per row, in the order that drawing them one after another
    without replacement gives (the exponential race: the k largest p_v / E_v, largest first). Greedy rows: the k
    most likely. A row with fewer than k tokens of mass ends with tokens of none (key 0): the caller drops them."""
    k = min(k, probs.shape[-1])
    if batch.all_greedy:
        return probs.topk(k, dim=-1).indices
    keys = probs.float() / _exponential_noise(batch, probs.shape[-1], probs.device)  # [N, V]
    drawn = keys.topk(k, dim=-1).indices
    return torch.where(batch.greedy[:, None], probs.topk(k, dim=-1).indices, drawn) if batch.any_greedy else drawn


def sample_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] -> tokens [N] int64."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    return sample(logits_to_probs(logits, batch), batch)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw model distribution (log_softmax of the logits, before any warper), as OpenAI reports it.

    logits [N, V], token_ids [N] -> (logprob of token_ids [N], their vocabulary rank [N] int64, top-k ids [N, k]
    int64, top-k logprobs [N, k]). A token's rank is the number of tokens at least as likely, itself included
    (1 = the most likely), as vLLM counts it.
    """
    logprobs = logits.float().log_softmax(dim=-1)  # [N, V]
    chosen = logprobs.gather(-1, token_ids.long()[:, None]).squeeze(-1)  # [N]
    rank = (logprobs >= chosen[:, None]).sum(dim=-1)  # [N]
    top_lp, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)  # [N, k]
    return chosen, rank, top_ids, top_lp


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> None:
    """In place: ``logits[rows[j]]`` keeps the tokens packed row ``words[j]`` allows (int32 words, bit t % 32 of
    word t // 32 for token t; see :mod:`specray.structured_outputs`) and every other token gets -inf. Tokens past
    the packed rows' end are refused too. No host sync."""
    n, num_words = words.shape
    V = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).reshape(n, num_words * 32).bool()  # [n, 32 W]
    if allowed.shape[1] >= V:
        allowed = allowed[:, :V]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
