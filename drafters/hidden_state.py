"""Drafters that read the target's hidden states (EAGLE-1, EAGLE-3, MTP): they run inside the target's driver
rank, right after verification, so drafting costs no round trip and nothing of vocabulary size leaves the worker.

The step, for every request in the plan (one batched pass each):

1. **First pass** over the positions the target just committed: a prefill chunk's tokens (a non-final chunk
   reads the next prompt token from ``ScheduledChunk.next_token_id``), or a decode's real tokens plus its accepted
   drafts (a tree's accepted path). At position p the head reads token ``t[p+1]`` and the target's feature of p
   (its hidden row of that token), so the last row, whose next token is the one the target just sampled, drafts
   ``d1``. Its K/V lands in the committed slots, in the head's own cache on the target's block tables.
2. **Draft steps** 2..m (``ScheduledChunk.num_next_drafts``): one row per request at the next position, with the
   head's own feedback feature and the token it just drafted. They write K/V into the slots the scheduler reserved
   past the verified drafts; the next step's first pass rewrites those positions before anything reads them.

Drafts are the head's argmax (deterministic candidates: with sampling, verification accepts draft x with
probability p(x) and resamples from p without x, which keeps the target's distribution exactly). They return in
``StepResult.draft_token_ids`` and the engine hands them to the scheduler for the next step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from specray.contract import ScheduledChunk, StepPlan
from specray.models.attention import build_attention_metadata
from specray.models.draft_head import DraftHead
from specray.models.kv_cache import KVCache, allocate_kv_cache

logger = logging.getLogger(__name__)


@dataclass
class EagleOptions:
    """``speculative_config`` keys of ``method="eagle"`` and ``"eagle3"``."""

    model: str | None = None  # the head's checkpoint folder or hub id (eagle3 on the default model: the bundled one)

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model={self.model!r} must be a path or hub id")


@dataclass
class MTPOptions:
    """``speculative_config`` keys of ``method="mtp"``."""

    model: str | None = None  # a checkpoint holding the MTP layers; None: the target's own
    # feed the next draft step the head's normed output, as transformers' MtpModel does (vLLM and SGLang feed the
    # block's output before the norm, the default)
    mtp_feedback_normed: bool = False

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model={self.model!r} must be a path or hub id")
        if not isinstance(self.mtp_feedback_normed, bool):
            raise ValueError(f"speculative_config.mtp_feedback_normed={self.mtp_feedback_normed!r} must be a bool")


@dataclass(frozen=True)
class _Row:
    """One request's part of the first pass."""

    chunk: int  # index in the plan
    rows: list[int]  # the target's hidden rows of its committed positions
    tokens: list[int]  # the token after each of those positions
    start: int  # position of the first
    drafts: int  # how many drafts to make (0: only its K/V)


class HiddenStateDrafter:
    """The worker side of a hidden-state drafter: a :class:`DraftHead` and its paged KV cache."""

    def __init__(self, head: DraftHead, num_blocks: int, block_size: int):
        self.head = head
        self.block_size = block_size
        self.kv_cache: KVCache = allocate_kv_cache(head, num_blocks, block_size)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.head.aux_layers

    def draft(self, plan: StepPlan, tables: dict[str, list[int]], hidden: torch.Tensor, aux: list[torch.Tensor],
              kept: dict[int, list[int]], paths: dict[int, list[int]]) -> list[list[int]]:
        """Drafts for every chunk of ``plan`` ([] where none were asked for). ``hidden`` [T, H] and ``aux`` are the
        target's rows for the plan's tokens; ``kept[i]`` the tokens chunk i kept (accepted drafts + the target's),
        ``paths[i]`` its accepted tree nodes (absent for a chain)."""
        work = self._first_pass_rows(plan, kept, paths)
        out: list[list[int]] = [[] for _ in plan.chunks]
        if not work:
            return out
        device = hidden.device
        rows = torch.tensor([r for w in work for r in w.rows], dtype=torch.long, device=device)
        features = self.head.target_features(hidden.index_select(0, rows), [a.index_select(0, rows) for a in aux])
        ids = torch.tensor([t for w in work for t in w.tokens], dtype=torch.long, device=device)
        meta = build_attention_metadata([len(w.rows) for w in work], [w.start for w in work],
                                        [tables[plan.chunks[w.chunk].req_id] for w in work], self.block_size, device)
        feedback, normed = self.head(ids, features, meta)
        drafting = [i for i, w in enumerate(work) if w.drafts > 0]
        if not drafting:
            return out
        ends = torch.tensor([sum(len(w.rows) for w in work[: i + 1]) - 1 for i in drafting], device=device)
        feedback, normed = feedback.index_select(0, ends), normed.index_select(0, ends)
        tokens = self.head.to_target_ids(self.head.draft_logits(normed).argmax(-1))  # [B] d1
        steps = [tokens]
        live = list(range(len(drafting)))  # indices into `drafting` still drafting
        positions = [work[i].start + len(work[i].rows) for i in drafting]  # the position whose next token is d1
        for step in range(1, max(work[i].drafts for i in drafting)):
            keep = [j for j in live if work[drafting[j]].drafts > step]
            if not keep:
                break
            if len(keep) != len(live):
                sel = torch.tensor([live.index(j) for j in keep], dtype=torch.long, device=device)
                tokens, feedback = tokens.index_select(0, sel), feedback.index_select(0, sel)
            live = keep
            meta = build_attention_metadata([1] * len(live), [positions[j] + step - 1 for j in live],
                                            [tables[plan.chunks[work[drafting[j]].chunk].req_id] for j in live],
                                            self.block_size, device)
            feedback, normed = self.head(tokens, feedback, meta)
            tokens = self.head.to_target_ids(self.head.draft_logits(normed).argmax(-1))
            steps.append(_scatter(tokens, live, len(drafting)))
        table = torch.stack(steps, dim=1).tolist()  # the drafts' one host sync: [B, m]
        for j, i in enumerate(drafting):
            w = work[i]
            out[w.chunk] = table[j][: w.drafts]
        return out

    def _first_pass_rows(self, plan: StepPlan, kept: dict[int, list[int]], paths: dict[int, list[int]]) -> list[_Row]:
        work, offset = [], 0
        for i, chunk in enumerate(plan.chunks):
            base = offset
            offset += chunk.num_tokens
            real = chunk.num_tokens - chunk.num_draft_tokens
            if not chunk.sample:
                if chunk.next_token_id is None:
                    continue  # a plan made without a hidden-state drafter in mind
                work.append(_Row(i, list(range(base, base + real)), chunk.token_ids[1:real] + [chunk.next_token_id],
                                 chunk.start_pos, 0))
                continue
            tokens = kept.get(i)
            if not tokens:
                continue  # failed in this step: nothing committed
            accepted = len(tokens) - 1
            nodes = paths.get(i) or list(range(accepted))
            rows = list(range(base, base + real)) + [base + real + n for n in nodes]
            work.append(_Row(i, rows, chunk.token_ids[1:real] + list(tokens), chunk.start_pos,
                             chunk.num_next_drafts))
        return work


def _scatter(tokens: torch.Tensor, live: list[int], size: int) -> torch.Tensor:
    """``tokens`` [len(live)] placed at ``live`` in a [size] row (-1 elsewhere: requests done drafting)."""
    out = tokens.new_full((size,), -1)
    out[torch.tensor(live, dtype=torch.long, device=tokens.device)] = tokens
    return out


class WholeTarget:
    """What a head reads of a target split over tensor-parallel ranks (its embedding and LM head), whole on the
    driver rank. The target's own are split by vocabulary and end in a collective (an all-reduce per embedding, an
    all-gather per logits) that the other ranks, which do not draft, would never join. Built by
    :func:`whole_target`; it offers the head what it reads of a :class:`~specray.models.interface.CausalLM`."""

    def __init__(self, target, embedding: torch.Tensor, lm_head: torch.Tensor):
        self.vocab_size, self.dtype, self.device = target.vocab_size, target.dtype, target.device
        self.embedding = embedding  # [V, H]
        self.lm_head = SimpleNamespace(weight=lm_head)  # [V, H] (draft_head_loader.target_head_rows reads it)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(input_ids, self.embedding)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.lm_head.weight).float()


@torch.inference_mode()
def whole_target(target, keep: bool, chunk: int = 8192) -> WholeTarget | None:
    """Every rank of a tensor-parallel target calls this (it runs the target's collectives): the embedding of every
    token id and the LM head (the logits of the unit vectors: exact, a product with 1 and sums of zeros), a chunk at
    a time; a :class:`WholeTarget` of them where ``keep`` (the driver rank), else None (nothing kept)."""
    vocab, dtype, device = target.vocab_size, target.dtype, target.device
    embedding, lm_head = [], []
    for start in range(0, vocab, chunk):
        rows = target.embed(torch.arange(start, min(start + chunk, vocab), device=device))  # [c, H]
        if keep:
            embedding.append(rows)
    hidden_size = rows.shape[1]
    step = max(1, min(chunk, (1 << 24) // vocab))  # unit vectors per call: [step, V] float32 logits at a time
    for start in range(0, hidden_size, step):
        units = torch.eye(hidden_size, dtype=dtype, device=device)[start: start + step]
        columns = target.compute_logits(units).to(dtype)  # [step, V]: columns start.. of the head's [V, H]
        if keep:
            lm_head.append(columns)
    if not keep:
        return None
    return WholeTarget(target, torch.cat(embedding), torch.cat(lm_head).t().contiguous())


def load_head(method: str, options, target, target_config, target_model: str) -> DraftHead:
    """The ``method`` head for ``target`` (on the driver rank): ``options.model``'s checkpoint; for EAGLE-3 on the
    default model, the bundled head; for MTP, the target's own checkpoint unless ``options.model`` names one."""
    from specray.models.draft_head_loader import load_draft_head

    path = options.model
    if method == "eagle3" and path is None:
        from specray.models.bundled_heads import bundled_head

        path = bundled_head(target_model, method)
    if method == "mtp" and path is None:
        path = target_model
    return load_draft_head(method, path, target, target_config,
                           feedback_normed=bool(getattr(options, "mtp_feedback_normed", False)))
