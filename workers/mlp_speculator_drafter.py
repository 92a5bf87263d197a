"""The worker side of IBM's MLP speculator (``method="mlp_speculator"``): after verification, per request, the target's
hidden state at the position whose logits gave the token it just sampled (the last accepted draft node's, or the last
real token's) and that token run the speculator's stages one after another (:mod:`specray.models.mlp_speculator`),
stage k's token feeding stage k + 1: a chain of drafts. No KV cache: the stages have no attention.

A greedy request's chain is each stage's argmax, each draft scored with its probability under its stage, so the draft
policy prices it as any scored chain (one-hot q). With ``candidate_tree`` a greedy request drafts IBM's candidate tree
instead (:meth:`MLPSpeculatorDrafter.candidate_search`): at stage k every path so far takes the stage's
``top_k_tokens_per_head[k]`` best tokens (each path's next stage reading its own token), and the ``n_candidates`` best
paths by path log q are merged into a prefix tree (:func:`~specray.workers.head_drafter.prefix_tree`, as ReDrafter's
beams), best first, each node scored with its q given its parent. A sampled request's chain is drawn from q, the
request's own warpers (temperature, top-k, top-p, min-p) over each stage's logits, from its draft stream
(:class:`~specray.workers.head_drafter.DrawsFromQ`, seeded alike on every rank of a split speculator), stage k + 1
reading the token drawn at stage k; the chain keeps each draft's q for rejection sampling, which keeps the target's
distribution exactly, and carries no scores. A draw without mass under its q (past its top-k or top-p support) ends the
chain there.

A greedy batch's chain (or candidate search) replays a graph when the target's steps do
(:class:`~specray.models.step_graphs.FunctionGraphs`: the batch padded to a power of two, every stage run); drawn
chains run eagerly (their draws read each request's own generator).
"""

from __future__ import annotations

import torch

from specray.contract import StepPlan
from specray.models.mlp_speculator import MLPSpeculatorHead, load_mlp_speculator
from specray.models.step_graphs import FunctionGraphs, why_eager
from specray.parallel import TPGroup
from specray.sampling import SamplingBatch, logits_to_probs, sample
from specray.sampling_params import SamplingParams
from specray.workers.head_drafter import Drafted, Drawn, DrawsFromQ, check_tree_width, prefix_tree


class MLPSpeculatorDrafter(DrawsFromQ):
    """An MLP speculator's stages and the chain they draft (a sampled request's drawn from q)."""

    aux_layers: tuple[int, ...] = ()
    kv_cache = None

    def __init__(self, head: MLPSpeculatorHead, driver: bool = True, seed: int = 0, step_graphs: bool = False,
                 candidates: tuple[list[int], int] | None = None):
        # split over the target's ranks: every rank runs the stages on its rows of each head, in lockstep with the
        # driver (its verdict reaches them first: ModelRunner); the logits are all-gathered and every rank draws from
        # the same streams, so the chain is the same on every rank
        super().__init__(head.tp, driver, seed)
        self.head = head
        # IBM's candidate tree for greedy requests: (top-k per stage, candidates kept); None: chains
        self.candidates = None if candidates is None else (list(candidates[0]), int(candidates[1]))
        if self.candidates is not None:
            check_tree_width("top_k_tokens_per_head", max(self.candidates[0]), head.vocab_size)
        self.best = self.greedy_chain if self.candidates is None else self.candidate_search
        # over several ranks (the logits' all-gather inside) as the target's graphs: when asked for
        self.graphs = None
        if step_graphs and why_eager(head, self.tp.size, asked=True) is None:
            self.graphs = FunctionGraphs(self.best, next(head.parameters()).device)

    @classmethod
    def load_head(cls, config: dict, target, target_config, tp: TPGroup | None = None) -> MLPSpeculatorHead:
        """The speculator the worker's plain-data ``config`` names, on the target's device and dtype (with ``tp``,
        this rank's share)."""
        return load_mlp_speculator(config["model"], target_config, target.dtype, target.device, tp=tp)

    @classmethod
    def aux_layers_of(cls, config: dict, target_config) -> tuple[int, ...]:
        return ()  # the final hidden states only

    @classmethod
    def build(cls, head: MLPSpeculatorHead, config: dict, num_blocks: int, block_size: int) -> "MLPSpeculatorDrafter":
        return cls(head, driver=bool(config.get("driver", True)), seed=int(config.get("seed", 0)),
                   step_graphs=bool(config.get("step_graphs", False)), candidates=config.get("candidates"))

    def _draft(self, plan: StepPlan, tables: dict[str, list[int]], hidden: torch.Tensor, aux: list[torch.Tensor],
               kept: dict[int, list[int]], paths: dict[int, list[int]],
               params: dict[str, SamplingParams] | None) -> list[Drafted | None]:
        """Per chunk of ``plan``, its first ``num_next_drafts`` drafts (None where none were asked for or nothing was
        committed): a greedy request's argmax chain (or candidate tree), a sampled one's chain drawn from q."""
        best = self.best if self.graphs is None else self.graphs.run
        asked, rows, qs = self._from_last_rows(plan, hidden, kept, paths, params, best, self.drawn_chain)
        out: list[Drafted | None] = [None] * len(plan.chunks)
        stages = self.head.n_predict
        for b, (i, n) in enumerate(asked):
            if b not in qs and self.candidates is not None:  # the candidates (tokens, each one's log q) as a tree
                tokens, values = rows[b]
                out[i] = prefix_tree([tokens[m: m + stages] for m in range(0, len(tokens), stages)],
                                     [values[m: m + stages] for m in range(0, len(values), stages)], n)
                continue
            n = min(n, stages)  # a chain (a tree's engine may ask a sampled request for more)
            tokens, values = rows[b][0][:n], rows[b][1][:n]  # each draft's probability, or a drawn one's mass
            if b not in qs:
                out[i] = Drafted([int(t) for t in tokens], None, values)
                continue
            n = next((k for k, m in enumerate(values) if m <= 0), n)  # a draw past q's support ends the chain
            drafts = [int(t) for t in tokens[:n]]
            if self.driver:
                self._drawn[plan.chunks[i].req_id] = Drawn(drafts, qs[b][:n])
            out[i] = Drafted(drafts)
        return out

    def greedy_chain(self, context: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """context [B, H] (the target's hidden state), first [B] (the token it gave) -> every stage's argmax [B, K]
        and its probability under that stage [B, K], each stage reading the one before's token."""
        state, token, tokens, probs = self.head.start(context), first, [], []
        for k in range(self.head.n_predict):
            state = self.head.stage(k, state, token)
            p, token = torch.softmax(self.head.logits(k, state), dim=-1).max(dim=-1)
            tokens.append(token)
            probs.append(p)
        return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)

    def candidate_search(self, context: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """IBM's candidates: context [B, H] and first [B] -> the ``n`` best of the paths that take, at every stage
        k, the stage's ``top[k]`` best tokens under each path so far (each path's stage reading its own token), by
        path log q: tokens [B, n, K] and each token's log q given the path before it [B, n, K]."""
        top, n = self.candidates
        b = context.shape[0]
        state, last = self.head.start(context)[:, None], first[:, None]  # one path per request, then w
        tokens = torch.empty(b, 1, 0, dtype=torch.long, device=context.device)
        own = torch.empty(b, 1, 0, device=context.device)
        path = torch.zeros(b, 1, device=context.device)
        for k, width in enumerate(top):
            state = self.head.stage(k, state, last)  # [B, w, D]
            lp, best = torch.log_softmax(self.head.logits(k, state), dim=-1).topk(width, dim=-1)  # [B, w, top]
            w = state.shape[1]
            tokens = torch.cat((tokens[:, :, None].expand(b, w, width, k), best[..., None]), dim=3).view(b, -1, k + 1)
            own = torch.cat((own[:, :, None].expand(b, w, width, k), lp[..., None]), dim=3).view(b, -1, k + 1)
            path = (path[:, :, None] + lp).view(b, -1)
            state = state[:, :, None].expand(b, w, width, state.shape[-1]).reshape(b, w * width, -1)
            last = best.view(b, -1)
        keep = path.topk(n, dim=-1).indices[:, :, None].expand(b, n, len(top))
        return tokens.gather(1, keep), own.gather(1, keep)

    def drawn_chain(self, context: torch.Tensor, first: torch.Tensor, batch: SamplingBatch
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """context [S, H] and first [S] of sampled requests (``batch``) -> their chains drawn from q: tokens [S, K],
        each one's mass under the q it was drawn from [S, K], and those q [S, K, V]."""
        state, token, tokens, mass, qs = self.head.start(context), first, [], [], []
        for k in range(self.head.n_predict):
            state = self.head.stage(k, state, token)
            q = logits_to_probs(self.head.logits(k, state), batch)  # [S, V]
            token = sample(q, batch)
            tokens.append(token)
            mass.append(q.gather(1, token[:, None]).squeeze(1))
            qs.append(q)
        return torch.stack(tokens, dim=1), torch.stack(mass, dim=1), torch.stack(qs, dim=1)
