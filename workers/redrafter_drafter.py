"""The worker side of ReDrafter (``method="redrafter"``): after verification, per request, the target's hidden state
at the position whose logits gave the token it just sampled (the last accepted draft node's, or the last real
token's) and that token start a beam search of the recurrent drafter (:mod:`specray.models.redrafter`): ``beams``
beams of ``beam_length`` drafts, the best by the drafter's path log-probability. Beams share prefixes (they all start
from the same token, and keep forking from each other), so they are merged into a prefix tree, which is verified as
any token tree (ReDrafter's "dynamic tree attention" is this tree's ancestor mask). No KV cache: the drafter has no
attention.

Nodes go best first by path log-probability (a parent's is never below its child's, so every prefix of the order is a
tree), each scored with its probability under the drafter given its parent, so the draft policy prices the tree as
any scored tree and verifies the best prefix. Beam search is deterministic, so the nodes are deterministic
candidates: verification keeps the target's distribution exactly with sampling too (sibling rejection sampling).
"""

from __future__ import annotations

import math

import torch

from specray.contract import StepPlan
from specray.models.redrafter import ReDrafterHead, load_redrafter
from specray.parallel import TPGroup
from specray.workers.head_drafter import Drafted, rows_of_last_tokens

class ReDrafterDrafter:
    """A recurrent drafter, its beam search, and the prefix tree of its beams."""

    aux_layers: tuple[int, ...] = ()
    kv_cache = None
    samples_from_q = False  # its trees are deterministic candidates

    def __init__(self, head: ReDrafterHead, beams: int, beam_length: int):
        self.head, self.beams, self.beam_length = head, beams, beam_length
        # split over the target's ranks: every rank runs the beam search on its rows of the LM head, in lockstep with
        # the driver (its verdict reaches them first: ModelRunner); the logits are all-gathered, so the beams are the
        # same on every rank
        self.tp: TPGroup = head.tp

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
        return cls(head, int(config["beams"]), int(config["beam_length"]))

    def drop(self, req_id: str, finished: bool = True) -> None:
        """Nothing is held per request."""

    def draft(self, plan: StepPlan, tables: dict[str, list[int]], hidden: torch.Tensor, aux: list[torch.Tensor],
              kept: dict[int, list[int]], paths: dict[int, list[int]],
              params: dict | None = None) -> list[Drafted | None]:
        """Per chunk of ``plan``, the first ``num_next_drafts`` nodes of its beams' prefix tree (None where none were
        asked for or nothing was committed)."""
        found = rows_of_last_tokens(plan, kept, paths)
        rows, last = [row for _, row in found], [kept[i][-1] for i, _ in found]
        asked = [(i, plan.chunks[i].num_next_drafts) for i, _ in found]
        out: list[Drafted | None] = [None] * len(plan.chunks)
        if not rows:
            return out
        device = hidden.device
        context = hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=device))
        tokens, own = self.beam_search(context, torch.tensor(last, dtype=torch.long, device=device))
        # float64 holds every token id exactly, whatever the head's dtype
        host = torch.stack([tokens.double(), own.double()]).tolist()  # the drafts' one host sync: [2, B, M, L]
        for b, (i, n) in enumerate(asked):
            out[i] = prefix_tree(host[0][b], host[1][b], n)
        return out

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


def prefix_tree(beams: list[list[float]], log_probs: list[list[float]], n: int) -> Drafted:
    """One request's beams (token ids and each token's log q given the beam before it) merged into a prefix tree;
    its best ``n`` nodes by path log-probability, parents first (ties by depth, then the order found), with parents
    and each node's q given its parent."""
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    nodes: list[tuple[int, int, float, float, int]] = []  # (token, parent, path log q, own log q, depth)
    for beam, lps in zip(beams, log_probs):
        parent, path = -1, 0.0
        for depth, (token, lp) in enumerate(zip(beam, lps), start=1):
            token, path = int(token), path + lp
            node = index.get((parent, token))
            if node is None:
                node = index[parent, token] = len(nodes)
                nodes.append((token, parent, path, lp, depth))
            parent = node
    order = sorted(range(len(nodes)), key=lambda j: (-nodes[j][2], nodes[j][4], j))[:n]
    where = {node: k for k, node in enumerate(order)}
    return Drafted([nodes[j][0] for j in order], [-1 if nodes[j][1] < 0 else where[nodes[j][1]] for j in order],
                   [math.exp(nodes[j][3]) for j in order])
