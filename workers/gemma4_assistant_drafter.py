"""The worker side of Gemma 4's assistant (``method="gemma4_assistant"``, :mod:`specray.models.gemma4_assistant`):
after verification, per request that drafts, the target's last hidden state at the position before the token it just
sampled (the last accepted draft's, or the last real token's: :func:`~specray.workers.head_drafter.rows_of_last_tokens`)
and that token start a chain: each step runs the assistant once at that token's position P, attending the target's
committed K/V before P in place (its own query only: no first pass, no K/V of its own, nothing written, so the
scheduler reserves no slots), and feeds its ``post_projection`` output and its draft to the next step, as
transformers' ``SinglePositionMultiTokenCandidateGenerator`` does.

A greedy request's drafts are the assistant's argmax, each with its probability under the assistant (the confidence the
draft policy prices chains by). A sampled request's chain is drawn from q, the request's own warpers over the
assistant's logits, from its draft stream (:class:`~specray.workers.head_drafter.DrawsFromQ`), and verified against
that q by rejection sampling, which keeps the target's distribution. Chains only; one rank only.

A request whose step kept a token tree's path that is not its first nodes (a lookup drafter's tree beside the
assistant, ``combine_with``) drafts nothing that step: the target's K/V of those nodes move into place only with the
next plan (``KVMove``), so they are not yet where the assistant would read them.

Each draft step replays a graph when the target's steps do (:class:`AssistantStepGraphs`): the batch padded to a
power of two (padding queries read block 0 of the target's cache: the assistant writes nothing, so any block serves
them), the query's token, feature and RoPE position the graph's inputs.
"""

from __future__ import annotations

import torch

from specray.contract import StepPlan
from specray.models.gemma4_assistant import Gemma4Assistant, draft_metadata, load_assistant
from specray.models.step_graphs import StepGraphs, why_eager
from specray.parallel import TPGroup
from specray.sampling import logits_to_probs, sample
from specray.sampling_params import SamplingParams
from specray.workers.head_drafter import Drafted, Drawn, DrawsFromQ, _Draw, _index, _scatter, rows_of_last_tokens


class AssistantStepGraphs(StepGraphs):
    """The assistant's draft steps replayed from graphs: one query per request at mask position P - 1 over the
    target's cache (:func:`~specray.models.gemma4_assistant.draft_metadata`'s layout), its feature and RoPE position P
    the graph's inputs beside the token; the outputs the next step's feature and the normed row for the logits."""

    def __init__(self, head: Gemma4Assistant, block_size: int, device: torch.device):
        # padding queries read block 0, past a table's end as well: nothing is written, so no scratch block is needed
        super().__init__(head, block_size, [0], device, max_position=head.target.max_position_embeddings)

    def _forward(self, input_ids: torch.Tensor, meta, inputs: list[torch.Tensor]
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        feature, last = self.model(input_ids, inputs[0], inputs[1], meta)
        return feature, [last]


class Gemma4AssistantDrafter(DrawsFromQ):
    """The assistant and its chains (see the module docstring)."""

    aux_layers: tuple[int, ...] = ()
    kv_cache = None

    def __init__(self, head: Gemma4Assistant, block_size: int, driver: bool = True, seed: int = 0,
                 step_graphs: bool = False):
        super().__init__(head.tp, driver, seed)
        self.head, self.block_size = head, block_size
        self.graphs = None
        if step_graphs and why_eager(head, 1) is None:
            self.graphs = AssistantStepGraphs(head, block_size, head.device)

    @classmethod
    def load_head(cls, config: dict, target, target_config, tp: TPGroup | None = None) -> Gemma4Assistant:
        """The assistant the worker's plain-data ``config`` names, over the target (one rank: the target's K/V of
        every head must be on the rank that drafts)."""
        if tp is not None and tp.size > 1:
            raise ValueError(f"method='gemma4_assistant' runs on one rank; set tensor_parallel_size=1 (got {tp.size})")
        return load_assistant(config["model"], config["head_config"], target, target_config)

    @classmethod
    def aux_layers_of(cls, config: dict, target_config) -> tuple[int, ...]:
        return ()  # the final hidden states only

    @classmethod
    def build(cls, head: Gemma4Assistant, config: dict, num_blocks: int, block_size: int
              ) -> "Gemma4AssistantDrafter":
        return cls(head, block_size, driver=bool(config.get("driver", True)), seed=int(config.get("seed", 0)),
                   step_graphs=bool(config.get("step_graphs", False)))

    def _draft(self, plan: StepPlan, tables: dict[str, list[int]], hidden: torch.Tensor, aux: list[torch.Tensor],
               kept: dict[int, list[int]], paths: dict[int, list[int]],
               params: dict[str, SamplingParams] | None) -> list[Drafted | None]:
        """Per chunk of ``plan``, a chain of its ``num_next_drafts`` (None where none were asked for, nothing was
        committed, or a tree path's K/V still waits for its move)."""
        out: list[Drafted | None] = [None] * len(plan.chunks)
        found = [(i, row) for i, row in rows_of_last_tokens(plan, kept, paths)
                 if paths.get(i) in (None, list(range(len(paths.get(i) or []))))]
        if not found:
            return out
        self.head.bind_target_kv()
        device = hidden.device
        chunks = [plan.chunks[i] for i, _ in found]
        # P: the position of the token the target just sampled (its real tokens, then the accepted drafts)
        positions = [c.start_pos + c.num_tokens - c.num_draft_tokens + len(kept[i]) - 1
                     for c, (i, _) in zip(chunks, found)]
        block_tables = [tables[c.req_id] for c in chunks]
        wanted = [c.num_next_drafts for c in chunks]
        feature = hidden.index_select(0, _index([row for _, row in found], device))  # [B, Hb]
        tokens = torch.tensor([kept[i][-1] for i, _ in found], dtype=torch.long, device=device)
        draw = self._draw(plan, [(i, n) for (i, _), n in zip(found, wanted)], params, device)
        everyone = list(range(len(found)))
        live, steps, confs, qs, meta = everyone, [], [], [], None
        for step in range(max(wanted)):
            keep = [j for j in live if wanted[j] > step]
            if len(keep) != len(live):
                sel = _index([live.index(j) for j in keep], device)
                tokens, feature = tokens.index_select(0, sel), feature.index_select(0, sel)
                meta = None
            live = keep
            if meta is None:  # every step of a request reads the same keys at the same position
                meta = draft_metadata([positions[j] for j in live], [block_tables[j] for j in live], self.block_size,
                                      device)
                pos = _index([positions[j] for j in live], device)
                shape = None if self.graphs is None else self.graphs.shape([1] * len(live), meta.start_positions,
                                                                           decode=True)
            if shape is None:
                feature, last = self.head(tokens, feature, pos, meta)
            else:  # (the graph's outputs: read before its next replay, which copies them in first)
                feature, (last,) = self.graphs.run(shape, tokens, [1] * len(live), meta.start_positions,
                                                   [block_tables[j] for j in live], (feature, pos))
            conf, tokens, probs = self._pick(self.head.logits(last), draw, live)
            steps.append(_scatter(tokens, live, len(found)))
            confs.append(_scatter(conf, live, len(found)))
            qs.append(None if probs is None else
                      probs.new_zeros(len(found), probs.shape[1]).index_copy_(0, _index(live, device), probs))
        # the drafts' one host sync: [2, B, m] (token ids are exact in float64)
        table = torch.stack([torch.stack(steps, dim=1).double(), torch.stack(confs, dim=1).double()]).tolist()
        drawn = self._keep_drawn(chunks, wanted, draw, table[0], qs)
        for (i, _), ids, p, n, d in zip(found, table[0], table[1], wanted, drawn):
            out[i] = Drafted([int(t) for t in ids[:n]], scores=None if d else p[:n])
        return out

    def _pick(self, logits: torch.Tensor, draw: _Draw | None, rows: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """logits [N, V] of the drafting rows ``rows`` -> (each row's probability of its argmax, its draft: the argmax,
        or drawn from q for a sampled request, q [N, V] or None when no row samples)."""
        best, ids = logits.max(-1)
        conf = (best - logits.logsumexp(-1)).exp()
        batch = None if draw is None else draw.batch(rows, logits.device)
        if batch is None or batch.all_greedy:
            return conf, ids, None
        probs = logits_to_probs(logits, batch)
        drawn = sample(probs, batch)
        return conf, torch.where(batch.greedy, ids, drawn) if batch.any_greedy else drawn, probs

    def _keep_drawn(self, chunks, wanted: list[int], draw: _Draw | None, tokens: list[list[float]],
                    qs: list[torch.Tensor | None]) -> list[bool]:
        """Keep each drawn chain with its q (on the driver, the only rank that verifies); per row, whether it was
        drawn."""
        if draw is None:
            return [False] * len(chunks)
        drawn = [not sp.greedy for sp in draw.params]
        if self.driver:
            for j, (c, n) in enumerate(zip(chunks, wanted)):
                if drawn[j]:
                    q = torch.stack([qs[s][j] for s in range(n)])  # [n, V]: q of each draft step
                    self._drawn[c.req_id] = Drawn([int(t) for t in tokens[j][:n]], q)
        return drawn
