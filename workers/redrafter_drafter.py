"""The worker side of ReDrafter (``method="redrafter"``): after verification, per request, the target's hidden state
at the position whose logits gave the token it just sampled (the last accepted draft node's, or the last real
token's) and that token start a beam search of the recurrent drafter (:mod:`specray.models.redrafter`): ``beams``
beams of ``beam_length`` drafts, the best by the drafter's path log-probability. Beams share prefixes (they all start
from the same token, and keep forking from each other), so they are merged into a prefix tree, which is verified as
any token tree (ReDrafter's "dynamic tree attention" is this tree's ancestor mask). No KV cache: the drafter has no
attention.

A greedy request's nodes go best first by path log-probability (a parent's is never below its child's, so every prefix
of the order is a tree), each scored with its probability under the drafter given its parent, so the draft policy
prices the tree as any scored tree and verifies the best prefix; they are deterministic candidates (one-hot q).

A sampled request's beams are drawn from q, the request's own warpers (temperature, top-k, top-p, min-p) over the
drafter's logits, from its draft stream (:class:`~specray.workers.head_drafter.DrawsFromQ`, seeded alike on every rank
of a split drafter): the first step's ``beams`` tokens one after another without replacement from the one row's q
(siblings under the root), then each beam's next token from q given its own beam, ``beam_length`` tokens in all. Which
nodes exist is fixed before anything is drawn (``beams`` chains under the root; a draw without mass under q, past its
top-k or top-p support, is dropped with what follows it), never by the drawn tokens, and the tree carries no scores.
Nodes go level by level (each level's beams in draw order); verification reads, per row, the q its children were
drawn from and tests them by recursive rejection sampling (:mod:`specray.tree_verification`), which keeps the
target's distribution exactly.

A greedy batch's beam search replays a graph when the target's steps do
(:class:`~specray.models.step_graphs.FunctionGraphs`: the batch padded to a power of two, the search's shapes fixed by
the beams and their length); drawn beams run eagerly (their draws read each request's own generator).
"""

from __future__ import annotations

import torch

from specray.contract import StepPlan
from specray.models.redrafter import ReDrafterHead, load_redrafter
from specray.models.step_graphs import FunctionGraphs, why_eager
from specray.parallel import TPGroup
from specray.sampling import SamplingBatch, logits_to_probs, sample, sample_without_replacement
from specray.sampling_params import SamplingParams
from specray.workers.head_drafter import Drafted, Drawn, DrawsFromQ, drawn_tree, prefix_tree, tree_rows


class ReDrafterDrafter(DrawsFromQ):
    """A recurrent drafter, its beam search (or a sampled request's beams drawn from q), and their tree."""

    aux_layers: tuple[int, ...] = ()
    kv_cache = None

    def __init__(self, head: ReDrafterHead, beams: int, beam_length: int, driver: bool = True, seed: int = 0,
                 step_graphs: bool = False):
        # split over the target's ranks: every rank runs the beams on its rows of the LM head, in lockstep with the
        # driver (its verdict reaches them first: ModelRunner); the logits are all-gathered and every rank draws from
        # the same streams, so the beams are the same on every rank
        super().__init__(head.tp, driver, seed)
        self.head, self.beams, self.beam_length = head, beams, beam_length
        # a drawn tree's parents, level by level: the first level under the root, each later node under its beam's
        self.drawn_parents = [-1] * beams + [node for node in range(beams * (beam_length - 1))]
        # over several ranks (the logits' all-gather inside) as the target's graphs: when asked for
        self.graphs = None
        if step_graphs and why_eager(head, self.tp.size, asked=True) is None:
            self.graphs = FunctionGraphs(self.beam_search, next(head.parameters()).device)

    @classmethod
    def load_head(cls, config: dict, target, target_config, tp: TPGroup | None = None) -> ReDrafterHead:
        """The drafter the worker's plain-data ``config`` names, on the target's device and dtype, reading the
        target's token embeddings (with ``tp``, this rank's share)."""
        return load_redrafter(config["model"], target_config, target.dtype, target.device, target=target, tp=tp)

    @classmethod
    def aux_layers_of(cls, config: dict, target_config) -> tuple[int, ...]:
        return ()  # the final hidden states only

    @classmethod
    def build(cls, head: ReDrafterHead, config: dict, num_blocks: int, block_size: int) -> "ReDrafterDrafter":
        return cls(head, int(config["beams"]), int(config["beam_length"]), driver=bool(config.get("driver", True)),
                   seed=int(config.get("seed", 0)), step_graphs=bool(config.get("step_graphs", False)))

    def _draft(self, plan: StepPlan, tables: dict[str, list[int]], hidden: torch.Tensor, aux: list[torch.Tensor],
               kept: dict[int, list[int]], paths: dict[int, list[int]],
               params: dict[str, SamplingParams] | None) -> list[Drafted | None]:
        """Per chunk of ``plan``, the first ``num_next_drafts`` nodes of its tree (None where none were asked for or
        nothing was committed): a greedy request's beams' prefix tree, a sampled one's beams drawn from q."""
        search = self.beam_search if self.graphs is None else self.graphs.run
        asked, rows, qs = self._from_last_rows(plan, hidden, kept, paths, params, search, self.drawn_beams)
        out: list[Drafted | None] = [None] * len(plan.chunks)
        length = self.beam_length
        for b, (i, n) in enumerate(asked):
            tokens, values = rows[b]  # a sampled request's: each token's mass; else its log q given its beam
            if b in qs:
                out[i] = self._keep_drawn(plan.chunks[i].req_id, tokens, values, n, qs[b])
            else:
                out[i] = prefix_tree([tokens[m: m + length] for m in range(0, len(tokens), length)],
                                     [values[m: m + length] for m in range(0, len(values), length)], n)
        return out

    def drawn_beams(self, context: torch.Tensor, first: torch.Tensor, batch: SamplingBatch
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """context [S, H] and first [S] of sampled requests (``batch``) -> their beams drawn from q, level by level:
        tokens [S, L * M] (level l's M at l * M ..), each one's mass under the q it was drawn from [S, L * M], and q
        of every row of the tree [S, 1 + L * M, V] (the root's, then each node's: its child's; the last level's
        zero). The first level is M draws without replacement from the one row's q; beam m's next token is drawn
        from q given beam m."""
        s, m = context.shape[0], self.beams
        state = self.head.step(torch.zeros_like(context), self.head.embed(first))  # [S, H]
        q = logits_to_probs(self.head.log_probs(context, state), batch)  # [S, V]: the first level's q
        tokens = sample_without_replacement(q, batch, m)  # [S, M]
        rows, drawn, mass = [q[:, None]], [tokens], [q.gather(1, tokens)]
        state, context, each = state[:, None].expand(s, m, -1), context[:, None].expand(s, m, -1), batch.repeat_rows(m)
        for _ in range(1, self.beam_length):
            state = self.head.step(state, self.head.embed(tokens))  # [S, M, H]
            q = logits_to_probs(self.head.log_probs(context, state).flatten(0, 1), each)  # [S * M, V]
            tokens = sample(q, each).view(s, m)
            q = q.view(s, m, -1)
            rows.append(q)
            drawn.append(tokens)
            mass.append(q.gather(2, tokens[:, :, None]).squeeze(2))
        rows.append(rows[0].new_zeros(s, m, rows[0].shape[-1]))  # the last level's: leaves
        return torch.cat(drawn, dim=1), torch.cat(mass, dim=1), torch.cat(rows, dim=1)

    def _keep_drawn(self, req_id: str, tokens: list[float], mass: list[float], n: int, q: torch.Tensor) -> Drafted:
        """A sampled request's drawn beams (host lists, level by level), cut to the first ``n`` nodes with mass (and a
        kept parent); on the driver, kept with their rows' q (``q`` [1 + L * M, V]) for their verification."""
        keep, drafted = drawn_tree(tokens, self.drawn_parents, mass, n)
        if self.driver:
            rows = torch.tensor(tree_rows(keep), device=q.device)
            self._drawn[req_id] = Drawn(drafted.token_ids, q.index_select(0, rows), drafted.parents)
        return drafted

    def beam_search(self, context: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """context [B, H] (the target's hidden state), first [B] (the token it gave) -> each request's ``beams``
        best beams by path log-probability: tokens [B, M, L] and each token's log q given its beam's earlier ones
        [B, M, L]. The search starts from one beam (the first step's M best tokens all grow from it), so the first
        step runs the drafter on one row per request, the others on M."""
        b, length, vocab = context.shape[0], self.beam_length, self.head.vocab_size
        device = context.device
        state = torch.zeros_like(context)[:, None]  # [B, 1, H]
        last = first[:, None]  # [B, 1]
        beam_lp = torch.zeros(b, 1, device=device)
        tokens = torch.empty(b, 1, 0, dtype=torch.long, device=device)
        own = torch.empty(b, 1, 0, device=device)
        for _ in range(length):
            width = last.shape[1]
            state = self.head.step(state, self.head.embed(last))  # [B, w, H]
            lp = self.head.log_probs(context[:, None].expand(b, width, -1), state)  # [B, w, V]: log q(next | beam)
            beam_lp, best = (beam_lp[:, :, None] + lp).view(b, width * vocab).topk(min(self.beams, width * vocab),
                                                                                     dim=-1)  # [B, M]
            parent, last = best // vocab, best % vocab
            m = last.shape[1]
            tokens = torch.cat((tokens.gather(1, parent[:, :, None].expand(b, m, tokens.shape[2])),
                                last[:, :, None]), dim=2)
            own = torch.cat((own.gather(1, parent[:, :, None].expand(b, m, own.shape[2])),
                             lp.gather(1, parent[:, :, None].expand(b, m, vocab)).gather(2, last[:, :, None])), dim=2)
            state = state.gather(1, parent[:, :, None].expand(b, m, state.shape[2]))
        return tokens, own
