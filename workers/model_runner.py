"""Executes one step plan on one shard of the target model.

The runner sees only block tables and token ids (never the scheduler's requests): it applies the plan's
request deltas, runs one forward pass over the mixed batch, and on the driver rank verifies the drafts and
samples, answering with the tokens each request keeps.
"""

from __future__ import annotations

import logging

import torch

from specray.contract import StepPlan, StepResult
from specray.models.attention import build_attention_metadata
from specray.models.interface import CausalLM
from specray.models.kv_cache import KVCache, allocate_kv_cache
from specray.sampling import SamplingBatch, make_generator
from specray.sampling_params import SamplingParams
from specray.verification import pad_drafts, target_logprobs, unpad_with_logprobs, verify

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: str | torch.device = "cpu",
                 is_driver: bool = True):
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.is_driver = is_driver  # the driver rank samples and answers; the others only run the forward
        self.kv_cache: KVCache = allocate_kv_cache(model, num_blocks, block_size)  # this runner owns it
        self.block_tables: dict[str, list[int]] = {}
        self.params: dict[str, SamplingParams] = {}
        self.generators: dict[str, torch.Generator | None] = {}

    def apply_plan_state(self, plan: StepPlan) -> None:
        """Finished and preempted ids first, then new requests, then block-table deltas (the contract's order).
        A preempted request keeps its generator: resumed, it samples on from where its stream stopped."""
        for rid in plan.finished_req_ids:
            self.block_tables.pop(rid, None)
            self.params.pop(rid, None)
            self.generators.pop(rid, None)
        for rid in plan.preempted_req_ids:
            self.block_tables.pop(rid, None)
        for new in plan.new_requests:
            self.block_tables[new.req_id] = list(new.block_ids)
            if new.req_id not in self.params:
                self.params[new.req_id] = new.sampling_params
                self.generators[new.req_id] = make_generator(new.sampling_params.seed, self.device)
        for delta in plan.block_deltas:
            table = self.block_tables[delta.req_id]
            del table[delta.num_kept_blocks :]
            table.extend(delta.new_block_ids)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, draft_probs: dict[str, torch.Tensor] | None = None) -> StepResult | None:
        self.apply_plan_state(plan)
        if plan.is_empty:
            return StepResult(plan.step_id, [], [])
        hidden = self._forward(plan)  # [T, H]
        sampled = [i for i, c in enumerate(plan.chunks) if c.sample]
        rows = logit_rows(plan)
        logits = self.model.compute_logits(hidden[rows]) if rows else None  # [N, V]
        if not self.is_driver:
            return None
        kept, logprobs = self._verify(plan, sampled, logits, draft_probs or {}) if sampled else ([], None)
        n = len(plan.chunks)
        return StepResult(plan.step_id, [c.req_id for c in plan.chunks], _per_chunk(n, sampled, kept),
                          None if logprobs is None else _per_chunk(n, sampled, logprobs))

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        chunks = plan.chunks
        input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=self.device)
        meta = build_attention_metadata(
            [c.num_tokens for c in chunks],
            [c.start_pos for c in chunks],
            [self.block_tables[c.req_id] for c in chunks],
            self.block_size,
            self.device,
        )
        return self.model(input_ids, meta)

    def _verify(self, plan: StepPlan, sampled: list[int], logits: torch.Tensor, draft_probs: dict[str, torch.Tensor]
                ) -> tuple[list[list[int]], list[list[dict[int, float]]] | None]:
        """logits [N, V]: the 1 + k rows of each sampled chunk, back to back. Returns each sampled chunk's kept
        tokens and, when some request asked for them, their logprobs."""
        chunks = [plan.chunks[i] for i in sampled]
        drafts = [c.token_ids[len(c.token_ids) - c.num_draft_tokens :] for c in chunks]
        probs = [draft_probs.get(c.req_id) for c in chunks] if draft_probs else None
        if probs is not None:
            probs = [None if q is None else q[: c.num_draft_tokens] for q, c in zip(probs, chunks)]
        padded = pad_drafts(logits, drafts, probs)
        params = [self.params[c.req_id] for c in chunks]
        batch = SamplingBatch.build(params, [self.generators[c.req_id] for c in chunks], logits.device)
        tokens, num_accepted = verify(padded.target_logits, padded.draft_token_ids, padded.num_drafts,
                                      padded.draft_probs, batch, draft_counts=padded.draft_counts)
        logprobs = target_logprobs(padded.target_logits, tokens, [sp.logprobs for sp in params])
        return unpad_with_logprobs(tokens, num_accepted, logprobs)  # the step's one host sync


def logit_rows(plan: StepPlan) -> list[int]:
    """Hidden rows of the step whose logits it needs: the last 1 + k tokens of every chunk that samples."""
    rows, offset = [], 0
    for c in plan.chunks:
        offset += c.num_tokens
        if c.sample:
            rows.extend(range(offset - 1 - c.num_draft_tokens, offset))
    return rows


def _per_chunk(num_chunks: int, sampled: list[int], values: list) -> list[list]:
    """Per chunk of the plan: the sampled chunks' values, [] for the others (non-final prefill chunks)."""
    out: list[list] = [[] for _ in range(num_chunks)]
    for i, value in zip(sampled, values):
        out[i] = value
    return out
