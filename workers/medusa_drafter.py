"""The worker side of Medusa (``method="medusa"``): after verification, one row per request, the target's hidden
state at the position whose logits gave the token it just sampled (the last accepted draft node's, or the last real
token's), goes through the K heads; head k's top tokens fill depth k + 1 of the ``medusa_choices`` tree. No pass over
earlier positions and no KV cache: Medusa's heads have no attention.

Each node's score is its head's probability of its token, so the draft policy prices the tree as any scored tree
(a path is kept with probability about alpha^depth times its scores' product) and verifies the best prefix of it.
Drafts are deterministic candidates (top-k), so verification keeps the target's distribution exactly (sibling
rejection sampling); Medusa's typical acceptance is not offered.
"""

from __future__ import annotations

import torch

from specray.contract import StepPlan
from specray.models.medusa import MedusaHeads, load_medusa_heads
from specray.parallel import TPGroup
from specray.workers.head_drafter import Drafted, rows_of_last_tokens


class MedusaDrafter:
    """K Medusa heads and the token tree they fill."""

    aux_layers: tuple[int, ...] = ()
    kv_cache = None
    samples_from_q = False  # its trees are deterministic candidates

    def __init__(self, heads: MedusaHeads, choices: list[list[int]]):
        deepest = max(len(c) for c in choices)
        if deepest > heads.num_heads:
            raise ValueError(f"speculative_config.medusa_choices goes {deepest} levels deep but the checkpoint has "
                             f"{heads.num_heads} heads: one level per head; drop the deeper paths")
        self.heads = heads
        # split over the target's ranks: every rank runs the heads on its rows of their LM heads, in lockstep with
        # the driver (its verdict reaches them first: ModelRunner); the logits are all-gathered, so the tree is
        # the same on every rank
        self.tp: TPGroup = heads.tp
        self.choices = [list(c) for c in choices]
        index = {tuple(c): i for i, c in enumerate(self.choices)}
        self.parents = [index[tuple(c[:-1])] if len(c) > 1 else -1 for c in self.choices]
        self.top_k = 1 + max(i for c in self.choices for i in c)

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
        return cls(head, config["choices"])

    def drop(self, req_id: str, finished: bool = True) -> None:
        """Nothing is held per request."""

    def draft(self, plan: StepPlan, tables: dict[str, list[int]], hidden: torch.Tensor, aux: list[torch.Tensor],
              kept: dict[int, list[int]], paths: dict[int, list[int]],
              params: dict | None = None) -> list[Drafted | None]:
        """Per chunk of ``plan``, the first ``num_next_drafts`` nodes of the tree for its next step (None where
        none were asked for or nothing was committed)."""
        found = rows_of_last_tokens(plan, kept, paths)
        rows = [row for _, row in found]
        asked = [(i, plan.chunks[i].num_next_drafts) for i, _ in found]
        out: list[Drafted | None] = [None] * len(plan.chunks)
        if not rows:
            return out
        logits = self.heads(hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=hidden.device)))
        probs, tokens = torch.softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1)  # [B, K, top_k]
        # float64 holds every token id exactly (bf16 and fp16, a GPU model's dtypes, would round ids past 256)
        host = torch.stack([tokens.double(), probs.double()]).tolist()  # the drafts' one host sync
        for b, (i, n) in enumerate(asked):
            chosen = self.choices[:n]
            out[i] = Drafted([int(host[0][b][len(c) - 1][c[-1]]) for c in chosen], self.parents[: len(chosen)],
                             [host[1][b][len(c) - 1][c[-1]] for c in chosen])
        return out
