"""Presence, frequency and repetition penalties (vLLM's definitions) at every verified position.

With ``c_v`` the number of times token v occurs in the output so far (the prompt not counted)::

    logits_v -= frequency_penalty * c_v + presence_penalty * [c_v > 0]

and for every token v of the prompt or the output so far, ``repetition_penalty`` r divides a positive logit by r
and multiplies a negative one by r (transformers' ``repetition_penalty``, from CTRL). ``logit_bias`` is added to
the logits before the penalties (it depends on no position). Before ``min_tokens`` outputs (the row's own,
drafts on its path counted) the tokens that would end the request get no probability. Outside
``allowed_token_ids`` no token has any; nor has the last token of a bad word's sequence where the row's output so
far (drafts on its path counted) ends with the rest of that sequence.

The penalty at a position depends on every token before it. A request that verifies k drafts has 1 + k logit
rows: row 0 follows its committed tokens, row i + 1 follows them plus the draft path to node i (a chain's drafts
0..i, a tree node's ancestors and itself). Each row is penalized by its own prefix, so verification checks every
draft against exactly the distribution decoding without speculation samples from there, and greedy speculative
output equals greedy plain output.

The driver rank keeps each penalized request's committed tokens (:class:`PenaltyHistory`): a step's chunk
writes its committed tokens at their positions (so a recomputed or rewound request overwrites what it had), and
the drafts a step accepts follow them. Counts are rebuilt from that list each step, as vLLM does; nothing is read
back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specray.contract import ScheduledChunk
from specray.sampling_params import SamplingParams
from specray.tree import depths, path_to


@dataclass
class _Tokens:
    num_prompt: int
    banned: list[int]  # banned before min_tokens outputs
    ids: list[int] = field(default_factory=list)  # the request's committed tokens: prompt, then output


class PenaltyHistory:
    """The committed tokens of every penalized request on this (driver) rank."""

    def __init__(self) -> None:
        self._requests: dict[str, _Tokens] = {}

    def add(self, req_id: str, params: SamplingParams, num_prompt_tokens: int, banned: Sequence[int] = (),
            computed: Sequence[int] | None = None) -> None:
        """``computed``: the tokens before its first chunk (cached blocks it starts from), if any."""
        if params.penalized and req_id not in self._requests:
            self._requests[req_id] = _Tokens(num_prompt_tokens, list(banned))
            self._requests[req_id].ids.extend(computed or ())

    def drop(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._requests

    def observe_chunk(self, chunk: ScheduledChunk) -> None:
        """The chunk's tokens other than its drafts are committed at positions ``start_pos`` on."""
        tokens = self._requests.get(chunk.req_id)
        if tokens is not None:
            del tokens.ids[chunk.start_pos:]
            tokens.ids.extend(chunk.token_ids[: chunk.num_tokens - chunk.num_draft_tokens])

    def observe_kept(self, req_id: str, kept: Sequence[int]) -> None:
        """A step kept ``kept``: its accepted drafts are committed now (their K/V was written); the target's own
        last token comes back as the next chunk's first."""
        tokens = self._requests.get(req_id)
        if tokens is not None:
            tokens.ids.extend(kept[:-1])

    def prefix(self, req_id: str) -> tuple[list[int], list[int], list[int]]:
        """The prompt's and the output's committed tokens, and the tokens banned before ``min_tokens``."""
        tokens = self._requests[req_id]
        return tokens.ids[: tokens.num_prompt], tokens.ids[tokens.num_prompt:], tokens.banned


def penalize(logits: torch.Tensor, rows: Sequence[int], params: SamplingParams, prompt: Sequence[int],
             output: Sequence[int], drafts: Sequence[int], parents: Sequence[int], banned: Sequence[int] = ()) -> None:
    """Penalize, in place, one request's 1 + k rows ``rows`` of ``logits`` [N, V]: row 0 after its committed
    ``prompt`` and ``output``, row i + 1 after those and node i's draft path (``parents``: -1 the root, else an
    earlier node; a chain is [-1, 0, 1, ...]). ``banned``: the tokens that get no probability on a row whose
    output so far is shorter than ``params.min_tokens``."""
    V, device = logits.shape[-1], logits.device
    k = len(drafts)
    assert len(rows) == k + 1 and len(parents) == k, (rows, k, parents)
    index = torch.tensor(rows, dtype=torch.long, device=device)
    block = logits.index_select(0, index).float()  # [k + 1, V]
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
        block[:, ids] += bias
    counts = _counts(output, V, device).repeat(k + 1, 1)  # [k + 1, V] the output's counts, every row
    if k:  # plus, on row i + 1, the drafts on node i's path
        pairs = [(i + 1, drafts[j]) for i in range(k) for j in path_to(parents, i)]
        at = torch.tensor(pairs, dtype=torch.long, device=device).unbind(1)
        counts.index_put_(at, torch.ones(len(pairs), dtype=torch.float32, device=device), accumulate=True)
    if params.repetition_penalty != 1.0:
        seen = (counts > 0) | (_counts(prompt, V, device) > 0)
        r = params.repetition_penalty
        block = torch.where(seen, torch.where(block > 0, block / r, block * r), block)
    if params.frequency_penalty != 0.0:
        block = block - params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        block = block - params.presence_penalty * (counts > 0).float()
    # row j follows len(output) + depth output tokens (row 0: depth 0; row i + 1: node i's depth)
    early = [j for j, depth in enumerate([0] + depths(parents)) if len(output) + depth < params.min_tokens]
    if early and banned:
        block[torch.tensor(early, dtype=torch.long, device=device)[:, None],
              torch.tensor(list(banned), dtype=torch.long, device=device)] = float("-inf")
    if params.allowed_token_ids is not None:
        allowed = torch.zeros(V, dtype=torch.bool, device=device)
        allowed[torch.tensor([t for t in params.allowed_token_ids if t < V], dtype=torch.long, device=device)] = True
        block = block.masked_fill(~allowed, float("-inf"))
    if params.bad_words_token_ids:
        pairs = [(row, t) for row, t in _bad_word_bans(params.bad_words_token_ids, output, drafts, parents)
                 if t < V]  # a draft model's vocabulary may be the smaller
        if pairs:
            at = torch.tensor(pairs, dtype=torch.long, device=device).unbind(1)
            block[at] = float("-inf")
    logits.index_copy_(0, index, block.to(logits.dtype))


def _bad_word_bans(sequences: Sequence[Sequence[int]], output: Sequence[int], drafts: Sequence[int],
                   parents: Sequence[int]) -> list[tuple[int, int]]:
    """(row, token) pairs to ban: on each of the 1 + k rows, the last token of every sequence whose other tokens
    end the row's output (the committed output, then the draft path to the row's node). Host lists only."""
    longest = max(len(s) for s in sequences) - 1
    tail = list(output[max(0, len(output) - longest):]) if longest else []
    pairs = []
    for row in range(len(drafts) + 1):
        path = [] if row == 0 else [drafts[j] for j in path_to(parents, row - 1)]
        before = (tail + path)[max(0, len(tail) + len(path) - longest):] if longest else []
        for seq in sequences:
            n = len(seq) - 1
            if n == 0 or (len(before) >= n and before[len(before) - n:] == list(seq[:n])):
                pairs.append((row, seq[-1]))
    return pairs


def _counts(tokens: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[1, V] float32: how often each token occurs in ``tokens``."""
    counts = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
    if tokens:
        ids = torch.tensor(list(tokens), dtype=torch.long, device=device)
        counts[0].index_add_(0, ids, torch.ones(len(tokens), dtype=torch.float32, device=device))
    return counts
