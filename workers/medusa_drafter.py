"""The worker side of Medusa (``method="medusa"``): after verification, one row per request, the target's hidden
state at the position whose logits gave the token it just sampled (the last accepted draft node's, or the last real
token's), goes through the K heads; head k's tokens fill depth k + 1 of the ``medusa_choices`` tree. No pass over
earlier positions and no KV cache: Medusa's heads have no attention.

A greedy request's tree holds each head's top-k: node [i0, ..., ik] is head k's ik-th best token. Each node's score
is its head's probability of its token, so the draft policy prices the tree as any scored tree (a path is kept with
probability about alpha^depth times its scores' product) and verifies the best prefix of it, with one-hot q.

A sampled request's tree is drawn from q, the request's own warpers (temperature, top-k, top-p, min-p) over the
heads' logits, from its draft stream (:class:`~specray.workers.head_drafter.DrawsFromQ`, seeded alike on every rank
of a split head): every node draws as many children as it has in ``medusa_choices``, one after another without
replacement from q of the head at their depth (the heads all read the same hidden state, so that q is the same for
every parent at a depth; each parent draws its own children), its j-th child in node order being its j-th draw.
Verification reads, per row, the q its children were drawn from (the root's: head 0's; node n's: head depth(n)'s)
and tests each child x against it, earlier siblings taken out (:mod:`specray.tree_verification`), which keeps the
target's distribution exactly. Which nodes exist is fixed by the choices before anything is drawn, save a node whose
draw has no mass under q (past its top-k or top-p support), which is dropped with its subtree: that depends on q
alone, never on the drawn tokens. The tree carries no scores (as the hidden-state drafter's drawn trees), so nothing
that sizes what is verified looks at what was drawn. Medusa's typical acceptance (opt-in, lossy) reads no q: with
it, every request's tree is the top-k one.

The heads' pass replays a graph when the target's steps do (:class:`~specray.models.step_graphs.FunctionGraphs`: the
rows padded to a power of two); what picks or draws from its logits runs eagerly.
"""

from __future__ import annotations

import torch

from specray.contract import StepPlan
from specray.models.medusa import MedusaHeads, load_medusa_heads
from specray.models.step_graphs import FunctionGraphs, why_eager
from specray.parallel import TPGroup
from specray.sampling import SamplingBatch, logits_to_probs, sample_without_replacement
from specray.sampling_params import SamplingParams
from specray.workers.head_drafter import (Drafted, Drawn, DrawsFromQ, check_tree_width, drawn_tree, rows_of_last_tokens,
                                          tree_rows)


class ChoicesLayout:
    """Where each node of a ``medusa_choices`` tree takes its token from (host lists, fixed by the choices), and the
    same as index tensors on a device (:meth:`on`)."""

    def __init__(self, choices: list[list[int]], top_k: int):
        index = {tuple(c): i for i, c in enumerate(choices)}
        self.parents = [index[tuple(c[:-1])] if len(c) > 1 else -1 for c in choices]
        self.levels = max(len(c) for c in choices)  # the heads the tree reads: head d fills depth d + 1
        # the top-k tree: node c is head len(c) - 1's c[-1]-th best, at that place of the heads' [K, top_k] rows
        self.ranked = [(len(c) - 1) * top_k + c[-1] for c in choices]
        depth = [0] + [len(c) for c in choices]  # of the root (-1), then of each node: depth[node + 1]
        children: dict[int, list[int]] = {}  # by parent (-1: the root), in node order
        for node, parent in enumerate(self.parents):
            children.setdefault(parent, []).append(node)
        # the drawn tree: per head, (parents drawing, draws per parent); each node's place among the draws
        self.draws, self.drawn = _draw_places(children, depth, self.levels)
        self.node_heads = [len(c) - 1 for c in choices]  # the head whose q each node was drawn from
        # per verification row (the root's, then each node's): the head its children are drawn from, or ``levels``
        # (a zero row of q) for a leaf
        self.row_heads = [depth[r] if r - 1 in children else self.levels for r in range(len(choices) + 1)]
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ranked, drawn, node_heads) as index tensors on ``device``, made once (no copy to the device per step)."""
        if device not in self._on:
            self._on[device] = tuple(torch.tensor(x, dtype=torch.long, device=device)
                                     for x in (self.ranked, self.drawn, self.node_heads))
        return self._on[device]


def _draw_places(children: dict[int, list[int]], depth: list[int], heads: int
                 ) -> tuple[list[tuple[int, int]], list[int]]:
    """Per head d, the parents at depth d (the root at depth 0) each draw as many children as the most any of them
    has, one row of draws per parent, the heads' rows laid back to back: (per head, (parents drawing, draws per
    parent)), and each node's place among all the draws (it is its parent's j-th draw, j its place among its
    siblings)."""
    draws, places, offset = [], [0] * (len(depth) - 1), 0
    for d in range(heads):
        drawing = [p for p in children if depth[p + 1] == d]
        width = max(len(children[p]) for p in drawing)
        for slot, p in enumerate(drawing):
            for j, node in enumerate(children[p]):
                places[node] = offset + slot * width + j
        draws.append((len(drawing), width))
        offset += len(drawing) * width
    return draws, places


def draw_tree(q: torch.Tensor, batch: SamplingBatch, layout: ChoicesLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, D, V] (each request's warped q of heads 0..D-1), ``batch`` its sampling -> every node's token [B, N] and
    its mass under the q it was drawn from [B, N] (0: past q's support). Each parent's children are drawn without
    replacement (in draw order) from q of the head at their depth, apart from every other parent's draws."""
    b, _, v = q.shape
    _, drawn, node_heads = layout.on(q.device)
    parts = []
    for d, (parents, width) in enumerate(layout.draws):
        rows = q[:, d, None].expand(b, parents, v).reshape(b * parents, v)  # one row per drawing parent
        parts.append(sample_without_replacement(rows, batch.repeat_rows(parents), width).view(b, parents * width))
    tokens = torch.cat(parts, dim=1).index_select(1, drawn)
    return tokens, q.reshape(b, -1).gather(1, node_heads * v + tokens)


class ChoicesTrees:
    """The part of a worker drafter that fills a ``medusa_choices`` tree from per-depth logits (Medusa's heads, or
    DFlash's block rows): a greedy request's top-k tree with each node's probability as its score, a sampled one's
    drawn from q (see the module docstring). Mixed into a :class:`~specray.workers.head_drafter.DrawsFromQ`."""

    def _init_choices(self, choices: list[list[int]], name: str, vocab: int) -> None:
        """``choices`` (``speculative_config.<name>``) over logits of ``vocab`` tokens."""
        self.choices = [list(c) for c in choices]
        self.top_k = 1 + max(i for c in self.choices for i in c)
        check_tree_width(name, self.top_k, vocab)
        self.layout = ChoicesLayout(self.choices, self.top_k)
        self.parents = self.layout.parents

    def _trees(self, plan: StepPlan, asked: list[tuple[int, int]], logits: torch.Tensor,
               params: dict[str, SamplingParams] | None, out: list[Drafted | None]) -> list[Drafted | None]:
        """Per (chunk index, nodes wanted) of ``asked``, with ``logits`` [B, D, V] its depths' logits (depth d + 1
        from row d), the first nodes of its tree put in ``out``."""
        device = logits.device
        tokens, scores = self._ranked(logits)  # [B, N] each
        draw = self._draw(plan, asked, params, device)
        sampled = [] if draw is None else draw.sampled
        q = None
        if sampled:
            rows = torch.tensor(sampled, device=device)
            batch = draw.batch(sampled, device)
            q = self._q(logits.index_select(0, rows), batch)  # [S, D + 1, V]
            drawn, mass = draw_tree(q[:, :-1], batch, self.layout)
            tokens, scores = tokens.index_copy(0, rows, drawn), scores.index_copy(0, rows, mass)
        # float64 holds every token id exactly (bf16 and fp16, a GPU model's dtypes, would round ids past 256)
        host = torch.stack([tokens.double(), scores.double()]).tolist()  # the drafts' one host sync
        where = {b: s for s, b in enumerate(sampled)}
        for b, (i, n) in enumerate(asked):
            if b in where:
                out[i] = self._keep_drawn(plan.chunks[i].req_id, host[0][b], host[1][b], n, q[where[b]])
            else:
                out[i] = Drafted([int(t) for t in host[0][b][:n]], self.parents[:n], host[1][b][:n])
        return out

    def _ranked(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, K, V] -> the top-k tree's tokens [B, N] and each one's probability under its head [B, N]."""
        probs, tokens = torch.softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1)  # [B, K, top_k]
        ranked = self.layout.on(logits.device)[0]
        return tokens.flatten(1).index_select(1, ranked), probs.flatten(1).index_select(1, ranked)

    def _q(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [S, K, V] of sampled requests -> q [S, D + 1, V]: each request's warpers over the logits of the
        D heads the tree reads, then a zero row (a leaf's: it draws nothing)."""
        s, d, v = logits.shape[0], self.layout.levels, logits.shape[-1]
        q = logits_to_probs(logits[:, :d].reshape(s * d, v), batch.repeat_rows(d)).view(s, d, v)
        return torch.cat([q, q.new_zeros(s, 1, v)], dim=1)

    def _keep_drawn(self, req_id: str, tokens: list[float], mass: list[float], n: int, q: torch.Tensor) -> Drafted:
        """A sampled request's drawn tree (host lists of every node's token and its mass under its q), cut to its
        first ``n`` nodes with mass (and a kept parent); on the driver, kept with its rows' q (``q`` [D + 1, V]: per
        head, then the zero row) for its verification."""
        keep, drafted = drawn_tree(tokens, self.parents, mass, n)
        if self.driver:
            heads = torch.tensor([self.layout.row_heads[r] for r in tree_rows(keep)], device=q.device)
            self._drawn[req_id] = Drawn(drafted.token_ids, q.index_select(0, heads), drafted.parents)
        return drafted


class MedusaDrafter(ChoicesTrees, DrawsFromQ):
    """K Medusa heads and the token tree they fill."""

    aux_layers: tuple[int, ...] = ()
    kv_cache = None

    def __init__(self, heads: MedusaHeads, choices: list[list[int]], driver: bool = True, seed: int = 0,
                 step_graphs: bool = False):
        deepest = max(len(c) for c in choices)
        if deepest > heads.num_heads:
            raise ValueError(f"speculative_config.medusa_choices goes {deepest} levels deep but the checkpoint has "
                             f"{heads.num_heads} heads: one level per head; drop the deeper paths")
        # split over the target's ranks: every rank runs the heads on its rows of their LM heads, in lockstep with
        # the driver (its verdict reaches them first: ModelRunner); the logits are all-gathered and every rank draws
        # from the same streams, so the tree is the same on every rank
        super().__init__(heads.tp, driver, seed)
        self.heads = heads
        self._init_choices(choices, "medusa_choices", heads.vocab_size)
        # over several ranks (the logits' all-gather inside) as the target's graphs: when asked for
        self.graphs = None
        if step_graphs and why_eager(heads, self.tp.size, asked=True) is None:
            self.graphs = FunctionGraphs(lambda rows: (heads(rows),), next(heads.parameters()).device)

    @classmethod
    def load_head(cls, config: dict, target, target_config, tp: TPGroup | None = None) -> MedusaHeads:
        """The heads the worker's plain-data ``config`` names, on the target's device and dtype (with ``tp``, this
        rank's share)."""
        return load_medusa_heads(config["model"], target_config, target.dtype, target.device, tp)

    @classmethod
    def aux_layers_of(cls, config: dict, target_config) -> tuple[int, ...]:
        return ()  # the final hidden states only

    @classmethod
    def build(cls, head: MedusaHeads, config: dict, num_blocks: int, block_size: int) -> "MedusaDrafter":
        return cls(head, config["choices"], driver=bool(config.get("driver", True)), seed=int(config.get("seed", 0)),
                   step_graphs=bool(config.get("step_graphs", False)))

    def _draft(self, plan: StepPlan, tables: dict[str, list[int]], hidden: torch.Tensor, aux: list[torch.Tensor],
               kept: dict[int, list[int]], paths: dict[int, list[int]],
               params: dict[str, SamplingParams] | None) -> list[Drafted | None]:
        """Per chunk of ``plan``, the first ``num_next_drafts`` nodes of the tree for its next step (None where
        none were asked for or nothing was committed): a greedy request's top-k tree, a sampled one's drawn."""
        found = rows_of_last_tokens(plan, kept, paths)
        out: list[Drafted | None] = [None] * len(plan.chunks)
        if not found:
            return out
        rows = hidden.index_select(0, torch.tensor([row for _, row in found], device=hidden.device))
        logits = self.heads(rows) if self.graphs is None else self.graphs.run(rows)[0]
        return self._trees(plan, [(i, plan.chunks[i].num_next_drafts) for i, _ in found], logits, params, out)
