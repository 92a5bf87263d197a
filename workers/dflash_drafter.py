"""The worker side of DFlash (``method="dflash"``, :mod:`specray.models.dflash`): right after verification, on the
target's driver rank (or every rank, the model split over them), one pass of the DFlash model per step drafts every
request's whole chain.

Per request of the plan, the pass's rows are the positions the target just committed (a prefill chunk's, or a
decode's real tokens plus its accepted drafts, with the target's residual streams there: their context K/V is
written), then, for a request that drafts m tokens after this step (``ScheduledChunk.num_next_drafts``), its block:
the token the target just sampled and m mask tokens at the positions after it. Draft i is the model's argmax at
block row i (a sampled request's: drawn from q_i, its warpers over those logits, and kept for verification), each
with its probability under the model (the confidence the draft policy prices chains by). With a
``speculative_token_tree`` (Medusa's paths of top-k indices), the block holds one row per level of the tree and the
tree's depth d + 1 is filled from row d + 1's top-k (a sampled request's drawn from its q, children without
replacement), as Medusa fills its tree from its heads: the block's positions draft apart from one another as the
heads do.

The block's K/V lands in the m + 1 slots from the sampled token's position: the scheduler reserves m + 1 slots past
the verified drafts rather than a chain's m - 1 (``SchedulerConfig.worker_block_slots``). A request that drafts
nothing after a step has its context put off (held, as the other hidden-state drafters hold their first pass) until
it drafts again.

A decode's pass (every request's context rows at most ``SHORT_QUERY_MAX``: no prompt's) replays a graph of its own when
the target's steps do (:class:`DFlashStepGraphs`): each request's rows padded to the graph's, every row through the
layers in the fixed form :meth:`~specray.models.dflash.DFlashHead.forward_rows` takes (the block's rows a mask, the
context features scattered into place on the device), the block rows' outputs picked after it; prefill chunks' passes
run eagerly.
"""

from __future__ import annotations

import itertools

import torch

from specray.contract import StepPlan
from specray.models.attention import SHORT_QUERY_MAX, build_attention_metadata
from specray.models.dflash import DFlashHead, block_ancestors, dflash_aux_layers, load_dflash
from specray.models.step_graphs import StepGraphs
from specray.parallel import TPGroup
from specray.sampling_params import SamplingParams
from specray.workers.head_drafter import Drafted, Drawn, HiddenStateDrafter, _asked, _index
from specray.workers.medusa_drafter import ChoicesTrees


class DFlashStepGraphs(StepGraphs):
    """DFlash's passes replayed from graphs (module docstring): the graph's inputs beside the ids are the context
    features at their rows and which rows are the block's; its output, every row's normed state."""

    def __init__(self, head: DFlashHead, block_size: int, scratch_blocks: list[int], device: torch.device,
                 max_position: int):
        super().__init__(head, block_size, scratch_blocks, device, max_position=max_position)

    def _forward(self, input_ids: torch.Tensor, meta, inputs: list[torch.Tensor]
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.model.forward_rows(inputs[0], input_ids, inputs[1], meta), []


class DFlashDrafter(ChoicesTrees, HiddenStateDrafter):
    """DFlash's model, its paged KV cache on the target's block tables, and its one pass per step; with ``choices``
    (``speculative_token_tree``), a token tree filled from the block's rows as Medusa's from its heads."""

    reads_images = False  # its blocks embed the last committed token and masks, never a prompt's image rows
    graphs_class = DFlashStepGraphs

    def __init__(self, head: DFlashHead, num_blocks: int, block_size: int, driver: bool = True, seed: int = 0,
                 kv_cache_dtype: str = "auto", choices: list[list[int]] | None = None, step_graphs: bool = False):
        super().__init__(head, num_blocks, block_size, None, driver=driver, seed=seed, step_graphs=step_graphs,
                         kv_cache_dtype=kv_cache_dtype)
        self.levels = None
        if choices is not None:
            self._init_choices(choices, "speculative_token_tree", head.target.vocab_size)
            self.levels = self.layout.levels  # the block's rows after the sampled token: one per level
            if self.levels > head.block_size - 1:
                raise ValueError(f"speculative_config.speculative_token_tree goes {self.levels} levels deep but the "
                                 f"DFlash checkpoint drafts blocks of {head.block_size}")

    @classmethod
    def load_head(cls, config: dict, target, target_config, tp: TPGroup | None = None) -> DFlashHead:
        return load_dflash(config["model"], target, target_config, tp, config.get("head_config"))

    @classmethod
    def aux_layers_of(cls, config: dict, target_config) -> tuple[int, ...]:
        return dflash_aux_layers(config["head_config"], target_config.num_hidden_layers)

    @classmethod
    def build(cls, head: DFlashHead, config: dict, num_blocks: int, block_size: int) -> "DFlashDrafter":
        return cls(head, num_blocks, block_size, driver=bool(config.get("driver", True)),
                   seed=int(config.get("seed", 0)), kv_cache_dtype=str(config.get("kv_cache_dtype", "auto")),
                   choices=config.get("choices"), step_graphs=bool(config.get("step_graphs", False)))

    def _draft(self, plan: StepPlan, tables: dict[str, list[int]], hidden: torch.Tensor, aux: list[torch.Tensor],
               kept: dict[int, list[int]], paths: dict[int, list[int]],
               params: dict[str, SamplingParams] | None) -> list[Drafted | None]:
        work, later = self._first_pass_rows(plan, kept, paths)
        out: list[Drafted | None] = [None] * len(plan.chunks)
        for w in later:
            self._hold(plan.chunks[w.chunk].req_id, w, self._source(hidden, aux, w.rows))
        if not work:
            return out
        work, source = self._with_held(plan, work, hidden, aux)
        head: DFlashHead = self.head
        device = hidden.device
        lens, starts, context_rows, block_rows, block_ids, ancestors = [], [], [], [], [], []
        offset = 0
        for w in work:
            n, m = len(w.tokens), w.drafts if self.levels is None or not w.drafts else self.levels
            block = m + 1 if m else 0
            context_rows += range(offset, offset + n)
            block_rows += range(offset + n, offset + n + block)
            if block:  # the token the target just sampled (the last one after a committed position), then m masks
                block_ids += [w.tokens[-1]] + [head.mask_token_id] * m
            lens.append(n + block)
            starts.append(w.start)
            ancestors.append(block_ancestors(n, block, device) if block else None)
            offset += n + block
        block_tables = [tables[plan.chunks[w.chunk].req_id] for w in work]
        context = head.context(source)  # (the aux layers' rows: see _source)
        # a decode's: each request's context rows the tokens just committed (a prompt's rows: more)
        decode = all(len(w.tokens) <= SHORT_QUERY_MAX for w in work)
        shape = None if self.graphs is None else self.graphs.shape(lens, starts, decode)
        if shape is None:
            meta = build_attention_metadata(lens, starts, block_tables, self.block_size, device, ancestors=ancestors)
            ids = torch.tensor(block_ids, dtype=torch.long, device=device)
            normed = head(context, ids, _index(context_rows, device), _index(block_rows, device), meta)
        else:  # every row through the layers (the block's a mask), the block rows' outputs picked after
            rows = context.new_zeros(offset, context.shape[-1]).index_copy_(0, _index(context_rows, device), context)
            in_block = [False] * offset
            for r in block_rows:
                in_block[r] = True
            taken = iter(block_ids)
            ids = [next(taken) if b else 0 for b in in_block]
            positions = [p for n, start in zip(lens, starts) for p in range(start, start + n)]
            flags = torch.tensor(in_block, dtype=torch.bool, device=device)[:, None]
            every, _ = self.graphs.run(shape, ids, lens, starts, block_tables, (rows, flags), positions=positions,
                                       ancestors=ancestors)
            normed = every.index_select(0, _index(block_rows, device))
        drafting = [w for w in work if w.drafts]
        if not drafting:
            return out
        if self.levels is not None:  # a tree: depth d + 1 from block row d + 1, each request's block levels + 1 long
            rows = [j * (self.levels + 1) + 1 + d for j in range(len(drafting)) for d in range(self.levels)]
            logits = head.draft_logits(normed.index_select(0, _index(rows, device)))
            return self._trees(plan, _asked(drafting), logits.view(len(drafting), self.levels, -1), params, out)
        # block row 0 is the sampled token's; rows 1..m give the drafts
        starts_in_block = itertools.accumulate((w.drafts + 1 for w in drafting), initial=0)
        picks = [s + 1 + i for s, w in zip(starts_in_block, drafting) for i in range(w.drafts)]
        owners = [j for j, w in enumerate(drafting) for _ in range(w.drafts)]  # each pick's drafting request
        draw = self._draw(plan, _asked(drafting), params, head.device)
        conf, tokens, probs = self._pick(normed.index_select(0, _index(picks, device)), draw, owners)
        # the drafts' one host sync: [2, N] (token ids are exact in float64)
        table = torch.stack([tokens.double(), conf.double()]).tolist()
        sampled = [False] * len(drafting) if draw is None else [not sp.greedy for sp in draw.params]
        first = 0
        for j, w in enumerate(drafting):
            chain = [int(t) for t in table[0][first: first + w.drafts]]
            if sampled[j] and self.driver:  # only the driver verifies: only it keeps q
                self._drawn[plan.chunks[w.chunk].req_id] = Drawn(chain, probs[first: first + w.drafts])
            out[w.chunk] = Drafted(chain, scores=None if sampled[j] else table[1][first: first + w.drafts])
            first += w.drafts
        return out
