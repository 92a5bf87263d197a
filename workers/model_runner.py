"""Executes one step plan on one shard of the target model.

The runner sees only block tables and token ids (never the scheduler's requests): it applies the plan's
request deltas and K/V moves, runs one forward pass over the mixed batch, and on the driver rank verifies the
drafts and samples, answering with the tokens each request keeps.

A chunk whose drafts form a token tree (``ScheduledChunk.draft_parents``) gives each draft node the RoPE position
of its depth and an ancestor mask (it sees the context, the chunk's other tokens and its own ancestors); its
drafts are verified by :func:`specray.tree_verification.verify_tree`, and the accepted nodes' indices go back in
``StepResult.accepted_draft_indices`` so the scheduler can have their K/V moved into place (``StepPlan.kv_moves``).
A chunk with ``want_node_tokens`` (a chain or a tree) goes through the same path and also gets the target's argmax
after each of its nodes (``StepResult.node_tokens``).
Every rank builds the same positions and masks from the plan and applies the same moves: no collective.

With a hidden-state drafter (``drafter``: EAGLE, MTP, Medusa, ReDrafter on the driver rank) the forward also returns
the residual stream at the layers the drafter reads, and right after verification the drafter drafts each request's
next step from them (``StepResult.draft_token_ids``; see :mod:`specray.workers.head_drafter`). A head split over the
ranks has a drafter on every rank: the driver broadcasts its verdict (:func:`send_verdict`) and every rank drafts
from it in lockstep; only the driver's drafts are answered.
"""

from __future__ import annotations

import heapq
import logging

import numpy as np
import torch

from specray.contract import ScheduledChunk, StepPlan, StepResult
from specray.errors import RequestError, describe_plan
from specray.models.attention import build_attention_metadata
from specray.models.interface import CausalLM
from specray.models.gated_deltanet import RecurrentBatch
from specray.models.kv_cache import (SCRATCH_SLOTS, SLOTS_PER_REQUEST, KVCache, allocate_kv_cache,
                                     allocate_recurrent_state, fresh_tail_blocks)
from specray.models.lora import LoRASlots
from specray.outputs import SampleLogprobs
from specray.parallel import TPGroup
from specray.penalties import PenaltyHistory, penalize
from specray.sampling import SamplingBatch, apply_token_bitmask, make_generator, to_device
from specray.sampling_params import SamplingParams
from specray.tree import chain_parents, depths
from specray.tree_verification import (RelaxedAcceptance, TypicalAcceptance, node_argmax, pad_tree_drafts,
                                       tree_logprobs, unpad_tree, verify_tree)
from specray.verification import (PROMPT_ROWS_PER_PASS, pad_drafts, prompt_logprob_entries, target_logprobs,
                                  unpad_with_logprobs, verify)
from specray.models.step_graphs import StepGraphs
from specray.multimodal import MultiModalInputs, rope_ids, step_rows

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: str | torch.device = "cpu",
                 is_driver: bool = True, drafter=None, typical_acceptance: tuple[float, float] | None = None,
                 relaxed_acceptance: tuple[int, float, int, int] | None = None, step_graphs: bool = False,
                 lora: LoRASlots | None = None, kv_cache_dtype: str = "auto",
                 aux_layers: tuple[int, ...] | None = None, max_num_seqs: int = 0, max_draft_tokens: int = 0,
                 recurrent_snapshots: int = 0, ssm_cache_dtype: torch.dtype = torch.float32,
                 encoder: torch.nn.Module | None = None):
        self.model = model
        # a vision-language model's image encoder (specray.multimodal), on the stage that embeds the prompt; the
        # requests' images, and each image's embeddings from the step that first reaches it until the prefill
        # passes it
        self.encoder = encoder
        self.multimodal: dict[str, MultiModalInputs] = {}
        self.image_embeds: dict[tuple[str, int], torch.Tensor] = {}
        self.lora = lora  # the model's LoRA adapter slots (enable_lora), None without
        self.block_size = block_size
        self.device = torch.device(device)
        self.is_driver = is_driver  # the driver rank samples and answers; the others only run the forward
        # decode and chain-verify steps replayed from graphs (CUDA graphs on a GPU), their padding in scratch blocks
        # past the block manager's
        scratch = StepGraphs.scratch_blocks_needed(block_size) if step_graphs else 0
        # this runner owns it
        self.kv_cache: KVCache = allocate_kv_cache(model, num_blocks + scratch, block_size, kv_cache_dtype)
        # linear-attention layers' recurrent state (None without): two slots per running request (max_num_seqs;
        # RecurrentSlots), a scratch slot past them for graph steps' padding sequences and, with prefix caching, the
        # states kept at block boundaries (snapshots) past that
        self.recurrent_state = allocate_recurrent_state(
            model, SLOTS_PER_REQUEST * max_num_seqs + SCRATCH_SLOTS + recurrent_snapshots, max_draft_tokens,
            ssm_cache_dtype)
        self.recurrent = None if self.recurrent_state is None else RecurrentSlots(max_num_seqs, max_draft_tokens)
        # the target layers whose residual stream the forward returns: the drafter's; a pipeline stage without the
        # drafter still carries those among its layers on to the last stage (``aux_layers``, from the worker)
        if aux_layers is None:
            aux_layers = drafter.aux_layers if drafter is not None else ()
        self.aux_layers = tuple(aux_layers)
        self.graphs = StepGraphs(model, block_size, list(range(num_blocks, num_blocks + scratch)), self.device,
                                 aux_layers, lora=None if lora is None else lora.context) if step_graphs else None
        self.block_tables: dict[str, list[int]] = {}
        self.params: dict[str, SamplingParams] = {}
        self.generators: dict[str, torch.Generator | None] = {}
        # a HiddenStateDrafter on the driver rank; a head split over the ranks has one on every rank, each drafting
        # in lockstep with the driver's verdict (``split``)
        self.drafter = drafter
        # (a hidden-state head embeds an image's rows as the target does: the runner hands it their embeddings)
        self.drafter_reads_images = drafter is not None and drafter.reads_images
        if self.drafter_reads_images:  # (and the positions of a request's tokens under multimodal RoPE)
            drafter.multimodal = self.multimodal
        self.split = getattr(drafter, "tp", None) is not None and drafter.tp.size > 1
        # sampled drafts verified by typical acceptance (posterior_threshold, posterior_alpha): every chunk goes
        # through tree verification (a chain is a tree), which implements it
        self.typical = None if typical_acceptance is None else TypicalAcceptance(*typical_acceptance)
        # greedy drafts in a thinking phase verified by relaxed acceptance: every chunk goes the same way
        self.relaxed = None if relaxed_acceptance is None else RelaxedAcceptance(*relaxed_acceptance)
        # a chain drafter on the worker draws a sampled request's drafts from its q, which rejection sampling then
        # reads; typical and relaxed acceptance read no q, so with them every draft is the head's argmax
        self.q_drafts = (self.drafter is not None and self.drafter.samples_from_q and self.typical is None
                         and self.relaxed is None)
        self.penalties = PenaltyHistory()  # the committed tokens of penalized requests (driver rank)
        # requests that asked for prompt logprobs: (k, their prompt's length), on every rank (their logits are
        # computed by every rank, as the step's others are)
        self.prompt_logprobs: dict[str, tuple[int, int]] = {}

    def apply_plan_state(self, plan: StepPlan) -> None:
        """Finished and preempted ids first, then new requests, then block-table deltas (the contract's order).
        A preempted request keeps its generator: resumed, it samples on from where its stream stopped."""
        if self.recurrent is not None:
            self.recurrent.apply(plan)
        for rid in plan.finished_req_ids:
            self.block_tables.pop(rid, None)
            self.params.pop(rid, None)
            self.generators.pop(rid, None)
            self.penalties.drop(rid)
            self.prompt_logprobs.pop(rid, None)
            self._drop_images(rid)
            if self.drafter is not None:
                self.drafter.drop(rid, finished=True)
        for rid in plan.preempted_req_ids:
            self.block_tables.pop(rid, None)
            self._drop_images(rid)
            if self.drafter is not None:
                self.drafter.drop(rid, finished=False)
        if plan.kv_moves:  # every request's moves at once: all sources are read before any is written
            src = [s for m in plan.kv_moves for s in m.src]
            dst = [d for m in plan.kv_moves for d in m.dst]
            self.kv_cache.copy_slots(_long(src, self.device), _long(dst, self.device))
            if self.recurrent is not None:  # a tree's accepted path: its drafts' pending inputs into path order
                self._move_pending(plan.kv_moves)
        for new in plan.new_requests:
            self.block_tables[new.req_id] = list(new.block_ids)
            if new.multimodal is not None:
                self.multimodal[new.req_id] = new.multimodal
            if new.req_id not in self.params:
                self.params[new.req_id] = new.sampling_params
                self.generators[new.req_id] = make_generator(new.sampling_params.seed, self.device)
                if new.sampling_params.prompt_logprobs is not None:
                    self.prompt_logprobs[new.req_id] = (new.sampling_params.prompt_logprobs, new.num_prompt_tokens)
                if self.is_driver:
                    self.penalties.add(new.req_id, new.sampling_params, new.num_prompt_tokens, new.stop_token_ids,
                                       new.computed_token_ids)
        for delta in plan.block_deltas:
            table = self.block_tables[delta.req_id]
            del table[delta.num_kept_blocks :]
            table.extend(delta.new_block_ids)

    def _drop_images(self, req_id: str) -> None:
        mm = self.multimodal.pop(req_id, None)
        for k in range(len(mm.items) if mm is not None else 0):
            self.image_embeds.pop((req_id, k), None)

    def _image_rows(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's rows that take image embeddings and those embeddings ([n] rows, [n, H], or with DeepStack
        [1 + k, n, H]: the input embeddings, then each of the first k layers' additions); None when no chunk
        reaches an image. An image is encoded when a step first reaches its span, and forgotten once the prefill
        has passed it. A drafter that reads images (a hidden-state head: its row at position p reads the token at
        p + 1) gets the embeddings of each chunk's positions start + 1 .. stop (the next chunk's first included)."""
        if self.encoder is None:
            return None
        rows: list[int] = []
        values: list[torch.Tensor] = []
        ahead: dict[str, tuple[list[int], torch.Tensor]] = {}  # the drafter's: by request, positions and rows
        offset = 0
        for c in chunks:
            mm = self.multimodal.get(c.req_id)
            stop = c.start_pos + c.num_tokens - c.num_draft_tokens
            for k, item in enumerate(mm.items if mm is not None and c.start_pos < mm.items[-1].end else ()):
                positions, indices = step_rows(item, c.start_pos, stop)
                later = step_rows(item, c.start_pos + 1, stop + 1) if self.drafter_reads_images else ((), ())
                if not positions and not later[0]:
                    continue
                key = (c.req_id, k)
                if key not in self.image_embeds:
                    self.image_embeds[key] = self._encode(c.req_id, item)
                embeds = self.image_embeds[key]
                if positions:
                    rows.extend(offset + p - c.start_pos for p in positions)
                    values.append(_embed_rows(embeds, indices, self.device))
                if later[0]:
                    first = _embed_rows(embeds, later[1], self.device)
                    ahead = _joined(ahead, c.req_id, list(later[0]), first[0] if first.dim() == 3 else first)
                if item.end <= stop:  # the prefill has passed it
                    del self.image_embeds[key]
            offset += c.num_tokens
        if ahead:
            self.drafter.add_images(ahead)
        if not rows:
            return None
        return _long(rows, self.device), torch.cat(values, dim=_row_axis(values[0])) if len(values) > 1 else values[0]

    def _encode(self, req_id: str, item) -> torch.Tensor:
        """One item's (image's, video's, audio's) embeddings [num_embeds, H]; an item the encoder cannot take fails
        its request alone."""
        dtype = next(self.encoder.parameters()).dtype
        data = {name: torch.from_numpy(np.ascontiguousarray(a)).to(
            self.device, dtype=dtype if np.issubdtype(a.dtype, np.floating) else None) for name, a in item.data.items()}
        try:
            embeds = self.encoder.encode(data)
        except (ValueError, RuntimeError) as err:
            raise RequestError([req_id], f"its {item.modality} at prompt position {item.offset} could not be "
                                         f"encoded: {err}") from err
        if embeds.shape[_row_axis(embeds)] != item.num_embeds:
            raise RequestError([req_id], f"its {item.modality} at prompt position {item.offset} gave "
                                         f"{embeds.shape[_row_axis(embeds)]} rows for {item.num_embeds} placeholders")
        return embeds

    def _image_masks(self, chunks: list[ScheduledChunk], ancestors: list[torch.Tensor | None] | None
                     ) -> list[torch.Tensor | None] | None:
        """Per chunk its [q, q] mask among its tokens (``ancestors``' or causal) with the rows of each image whose
        tokens attend to each other both ways seeing each other; None when the step holds no such image's rows (the
        scheduler gives a chunk the whole of such an image, or the rest of it after cached blocks)."""
        masks: list[torch.Tensor | None] = []
        found = False
        for i, c in enumerate(chunks):
            mask = None if ancestors is None else ancestors[i]
            mm = self.multimodal.get(c.req_id)
            stop = c.start_pos + c.num_tokens - c.num_draft_tokens
            for item in mm.items if mm is not None else ():
                a, b = max(item.offset, c.start_pos) - c.start_pos, min(item.end, stop) - c.start_pos
                if item.bidirectional and a < b:
                    if mask is None:
                        mask = torch.ones(c.num_tokens, c.num_tokens, dtype=torch.bool).tril_()
                    mask[a:b, a:b] = True
                    found = True
            masks.append(mask)
        return masks if found else None

    def _rope_positions(self, chunks: list[ScheduledChunk], positions: list[int] | None
                        ) -> tuple[list[list[int]], int] | None:
        """Multimodal RoPE: the step's position ids (three lists of T), and the largest, when a chunk's request
        carries a table for its prompt (its prompt tokens take the table's columns, later ones their position plus
        the request's delta on every axis); None otherwise."""
        if not any(self.multimodal.get(c.req_id) is not None and self.multimodal[c.req_id].rope_positions
                   is not None for c in chunks):
            return None
        own, offset = [], 0
        for c in chunks:  # (a tree's draft tokens sit past the prompt: their tree positions plus the delta)
            own.append(positions[offset:offset + c.num_tokens] if positions is not None
                       else range(c.start_pos, c.start_pos + c.num_tokens))
            offset += c.num_tokens
        return rope_ids([self.multimodal.get(c.req_id) for c in chunks], own)

    def _move_pending(self, moves) -> None:
        """A hybrid model's token trees: the drafts a verify chunk left pending are in node order; the next plan's
        K/V moves name the accepted path's nodes (each move's source slot: the node's position, its destination: the
        path's), so the pending inputs and gates are put in path order too, where the next chunk replays them
        (read with the block tables the moves were computed with: these, before this plan's deltas)."""
        src_rows, dst_rows, bs = [], [], self.block_size
        for move in moves:
            table, committed = self.block_tables[move.req_id], self.recurrent.position[move.req_id][0]
            slot = self.recurrent.committed_slot(move.req_id)
            for s, d in zip(move.src, move.dst):  # a slot's position: its block's place in the table, its offset
                src_rows.append((slot, table.index(s // bs) * bs + s % bs - committed))
                dst_rows.append((slot, table.index(d // bs) * bs + d % bs - committed))
        self.recurrent_state.move_pending(src_rows, dst_rows)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, draft_probs: dict[str, torch.Tensor] | None = None) -> StepResult | None:
        if self.recurrent is None:
            return self._execute(plan, draft_probs)
        try:
            result = self._execute(plan, draft_probs)
        except BaseException:
            self.recurrent.discard()  # the step wrote only slots nobody reads: every request's state is as before it
            raise
        self.recurrent_state.copy_slots(*self.recurrent.commit())  # the states its chunks keep, once it succeeded
        return result

    def _execute(self, plan: StepPlan, draft_probs: dict[str, torch.Tensor] | None) -> StepResult | None:
        self.apply_plan_state(plan)
        if plan.is_empty:
            return StepResult(plan.step_id, [], [])
        hidden, aux = self._forward(plan)  # [T, H], and the drafter's layers' residual stream
        if hidden is None:  # a pipeline stage before the last: its output went on to the next stage
            return None
        sampled = [i for i, c in enumerate(plan.chunks) if c.sample]
        rows = logit_rows(plan)
        logits = self.model.compute_logits(hidden[rows]) if rows else None  # [N, V]
        prompt_logprobs = self._prompt_logprobs(plan, hidden) if self.prompt_logprobs else None
        if not self.is_driver:
            if self.split:  # this rank's share of the head drafts with the driver's verdict
                verdict = receive_verdict(self.drafter.tp, plan, sampled, self.device)
                if verdict is not None:
                    self.drafter.draft(plan, self.block_tables, hidden, aux, *verdict,
                                       self.params if self.q_drafts else None)
            return None
        for chunk in plan.chunks:
            self.penalties.observe_chunk(chunk)
        verdict = None
        try:
            kept, logprobs, paths, nodes = self._verify_all(plan, sampled, logits,
                                                            self._with_worker_q(plan, draft_probs))
            verdict = dict(zip(sampled, kept)), {} if paths is None else {i: p for i, p in zip(sampled, paths) if p}
        finally:
            if self.split:  # also when verification failed (None: the other ranks draft nothing), so none waits
                send_verdict(self.drafter.tp, plan, sampled, verdict, self.device)
        for i, tokens in zip(sampled, kept):
            self.penalties.observe_kept(plan.chunks[i].req_id, tokens)
        n = len(plan.chunks)
        result = StepResult(plan.step_id, [c.req_id for c in plan.chunks], _per_chunk(n, sampled, kept),
                            None if logprobs is None else _per_chunk(n, sampled, logprobs),
                            None if paths is None else _per_chunk(n, sampled, paths),
                            None if nodes is None else _per_chunk(n, sampled, nodes),
                            prompt_logprobs=prompt_logprobs)
        if self.drafter is not None:
            drafted = self._draft(plan, hidden, aux, verdict, result)
            result.draft_token_ids = [[] if d is None else d.token_ids for d in drafted]
            if any(d is not None and d.parents is not None for d in drafted):
                result.draft_parents = [[] if d is None or d.parents is None else d.parents for d in drafted]
            if any(d is not None and d.scores is not None for d in drafted):
                result.draft_scores = [[] if d is None or d.scores is None else d.scores for d in drafted]
        return result

    def _draft(self, plan: StepPlan, hidden: torch.Tensor, aux: list[torch.Tensor], verdict: tuple,
               result: StepResult) -> list:
        """The worker drafter's drafts for the plan's chunks. Drafts only ever save target passes, so a drafter
        that raises (a head's bug, memory it could not get) costs the step's requests their drafts, not the tokens
        they kept: ``result.drafting_failed`` tells the engine, which asks the drafter for none of theirs again.
        A head split over the ranks drafts in lockstep with the others (which would wait on the driver), so its
        failure is the step's, as any rank's error is."""
        try:
            return self.drafter.draft(plan, self.block_tables, hidden, aux, *verdict,
                                      self.params if self.q_drafts else None)
        except Exception as err:  # the drafter's failure must not cost the step's verified tokens
            if self.split:
                raise
            logger.error("the drafter failed (%r); the requests of %s decode without drafts from now on", err,
                         describe_plan(plan), exc_info=err)
            result.drafting_failed = {c.req_id: repr(err) for c in plan.chunks}
            return [None] * len(plan.chunks)

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> list[SampleLogprobs] | None:
        """Per chunk, the logprobs of the prompt tokens its rows predict when its request asked for them ([] for
        the others; None when no chunk's request asked): row j of a chunk (position start_pos + j) predicts prompt
        token start_pos + j + 1, up to the prompt's last token. Every rank computes the logits (the step's other
        logits are computed by every rank too); the driver reduces them to the entries, in one host sync."""
        rows, token_ids, num_top, counts, offset = [], [], [], [], 0
        for c in plan.chunks:
            asked = self.prompt_logprobs.get(c.req_id)
            count = 0
            if asked is not None:
                k, num_prompt = asked
                end = c.start_pos + c.num_tokens - c.num_draft_tokens  # past the chunk's last non-draft token
                count = max(0, min(end, num_prompt - 1) - c.start_pos)
                nxt = c.token_ids[1 : c.num_tokens - c.num_draft_tokens] + [c.next_token_id]
                assert count == 0 or nxt[count - 1] is not None, (c.req_id, c.start_pos, end, num_prompt)
                rows.extend(range(offset, offset + count))
                token_ids.extend(nxt[:count])
                num_top.extend([k] * count)
            counts.append(count)
            offset += c.num_tokens
        if not rows:
            return None

        def logits_of(part: list[int]) -> torch.Tensor:
            return self.model.compute_logits(hidden[_long(part, hidden.device)])  # [n, V]

        if not self.is_driver:  # the same logits calls, nothing else
            for start in range(0, len(rows), PROMPT_ROWS_PER_PASS):
                logits_of(rows[start : start + PROMPT_ROWS_PER_PASS])
            return None
        entries = prompt_logprob_entries(logits_of, rows, token_ids, num_top, PROMPT_ROWS_PER_PASS)
        out, start = [], 0
        for count in counts:
            out.append(entries[start : start + count])
            start += count
        return out

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, list[torch.Tensor]]:
        chunks = plan.chunks
        token_ids = [t for c in chunks for t in c.token_ids]
        trees = any(c.draft_parents is not None for c in chunks)
        query_lens, starts = [c.num_tokens for c in chunks], [c.start_pos for c in chunks]
        tables = [self.block_tables[c.req_id] for c in chunks]
        positions = [p for c in chunks for p in tree_positions(c)] if trees else None
        ancestors = [ancestor_mask(c) for c in chunks] if trees else None
        lora_slots, adapted = self._lora_slots(chunks) if self.lora is not None else ((), False)
        self.kv_cache.zero_blocks(fresh_tail_blocks(query_lens, starts, tables, self.block_size))
        # a hybrid model's slots and replays (staged for commit: asked for once)
        recurrent = None if self.recurrent is None else self.recurrent.batch(chunks)
        if recurrent is not None:  # requests starting behind cached blocks: their kept states first
            self.recurrent_state.copy_slots(*self.recurrent.restores)
        # images (their rows, their masks) go in by the eager path; multimodal RoPE's positions by either
        images = rope = both_ways = None
        if self.multimodal:
            images, rope = self._image_rows(chunks), self._rope_positions(chunks, positions)
            both_ways = self._image_masks(chunks, ancestors)
            ancestors = ancestors if both_ways is None else both_ways
        eager = images is not None or both_ways is not None
        # a model's trees that take the host's help (graph_trees: DeepSeek-V4's) eagerly
        if self.graphs is not None and not eager and not (trees and not getattr(self.model, "graph_trees", True)):
            decode = all(c.num_tokens == 1 + c.num_draft_tokens for c in chunks)
            rows = 1 if recurrent is None else 1 + max(recurrent.replay)  # the replays fit the step's rows
            shape = self.graphs.shape(query_lens, starts, decode, min_rows=rows)
            if shape is not None:  # the slots and replays as the graph's data, padding in the scratch slot
                padded = None if recurrent is None else recurrent.padded(shape.batch, query_lens,
                                                                         self.recurrent.scratch, self.device,
                                                                         shape.query_len)
                return self.graphs.run(shape, token_ids, query_lens, starts, tables, positions=positions,
                                       ancestors=ancestors, inputs=lora_slots, recurrent=padded,
                                       rope_positions=None if rope is None else rope[0])
        if self.lora is not None:  # eager: without a row of an adapter, the projections skip theirs
            self.lora.context.set_token_slots(lora_slots[0] if adapted else None)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        if images is not None and not images[1].is_floating_point():  # an image's codes: the prompt's own tokens
            input_ids, images = input_ids.index_copy(0, *images), None
        meta = build_attention_metadata(query_lens, starts, tables, self.block_size, self.device,
                                        positions=positions, ancestors=ancestors)
        meta.recurrent = recurrent
        if images is not None and images[1].dim() == 3:  # DeepStack: the first layers' additions apart
            meta.input_embeds, meta.deepstack_embeds = (images[0], images[1][0]), images[1][1:]
        else:
            meta.input_embeds = images
        if rope is not None:  # (the rotary tables reach the largest of them)
            meta.with_rope_positions((torch.tensor(rope[0], dtype=torch.long, device=self.device), rope[1]))
        if self.aux_layers:
            out = self.model(input_ids, meta, aux_layers=self.aux_layers)
            return (None, []) if out is None else out  # None: a pipeline stage before the last
        return self.model(input_ids, meta), []

    def _lora_slots(self, chunks: list[ScheduledChunk]) -> tuple[tuple[torch.Tensor, ...], bool]:
        """Each token's LoRA slot ([T] on the device; 0: no adapter), its request's adapter loaded where no slot
        holds it yet, and whether any request of the step has one. Without graphs, a step with no adapter needs no
        slots (its projections skip the adapters): () then."""
        slots = self.lora.slots_for([self.params[c.req_id].lora_request for c in chunks])
        adapted = any(slots)
        if not adapted and self.graphs is None:
            return (), False
        per_token = [slot for slot, c in zip(slots, chunks) for _ in range(c.num_tokens)]
        return (to_device(torch.tensor(per_token, dtype=torch.long), self.device),), adapted

    def _with_worker_q(self, plan: StepPlan, draft_probs: dict[str, torch.Tensor] | None
                       ) -> dict[str, torch.Tensor]:
        """The drafts' q by request id: a probabilistic drafter's from the engine, and for a chunk that verifies
        the chain or tree this worker's drafter drew from its q (a sampled request), that q."""
        probs = dict(draft_probs or {})
        if self.q_drafts:
            for c in plan.chunks:
                if c.worker_drafts and c.sample:
                    tree = () if c.draft_parents is None else (c.draft_parents,)  # which of the tree's nodes it kept
                    q = self.drafter.q_of(c.req_id, c.token_ids[len(c.token_ids) - c.num_draft_tokens:], *tree)
                    if q is not None:
                        probs[c.req_id] = q
        return probs

    def _verify_all(self, plan: StepPlan, sampled: list[int], logits: torch.Tensor | None,
                    draft_probs: dict[str, torch.Tensor]) -> tuple[list, list | None, list | None, list | None]:
        """Every sampled chunk's kept tokens, logprobs, accepted tree paths and node tokens (the last three None
        when no chunk has them). Chains with a drafter's q go through :meth:`_verify` (rejection sampling against
        q); trees, chunks that want node tokens, and every chunk under typical or relaxed acceptance (rules only
        tree verification has) through :meth:`_verify_trees`. A step with both (a sampled request verifying the
        head's chain beside a lookup's tree) verifies the two groups apart, at one host sync each."""
        if not sampled:
            return [], None, None, None
        processed = self._processed(plan, sampled, logits)
        raw, logits = (None if processed is logits else logits), processed  # raw logits stay for logprobs
        every_chunk = self.typical is not None or self.relaxed is not None
        chunks = plan.chunks
        with_q = [] if every_chunk else [i for i in sampled if chunks[i].req_id in draft_probs and
                                         chunks[i].draft_parents is None and not chunks[i].want_node_tokens]
        with_q_set = set(with_q)
        rest = [i for i in sampled if i not in with_q_set] if with_q else sampled
        if not (every_chunk or any(chunks[i].draft_parents is not None or chunks[i].want_node_tokens for i in rest)):
            return (*self._verify(plan, sampled, logits, draft_probs, raw), None, None)
        if not with_q:
            return self._verify_trees(plan, sampled, logits, raw, draft_probs)
        rows = _logit_rows_by_chunk(plan, sampled)
        chains = self._verify(plan, with_q, _rows(logits, rows, with_q), draft_probs, _rows(raw, rows, with_q))
        trees = self._verify_trees(plan, rest, _rows(logits, rows, rest), _rows(raw, rows, rest), draft_probs)
        return _merge_groups(sampled, (with_q, chains), (rest, trees))

    def _processed(self, plan: StepPlan, sampled: list[int], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with every penalized request's rows penalized by their own prefixes, then the rows of every
        chunk that brings a grammar's masks (structured outputs) keeping only the tokens they allow: a copy (the
        raw rows stay for logprobs), or ``logits`` itself when no request in the step has either."""
        penalized = [i for i in sampled if plan.chunks[i].req_id in self.penalties]
        masked = [i for i in sampled if plan.chunks[i].req_id in plan.token_bitmasks]
        if not (penalized or masked):
            return logits
        logits = logits.clone()
        rows = _logit_rows_by_chunk(plan, sampled)
        for i in penalized:
            c = plan.chunks[i]
            prompt, output, banned = self.penalties.prefix(c.req_id)
            parents = c.draft_parents if c.draft_parents is not None else chain_parents(c.num_draft_tokens)
            penalize(logits, rows[i], self.params[c.req_id], prompt, output,
                     c.token_ids[c.num_tokens - c.num_draft_tokens:], parents, banned)
        if masked:
            masks = [plan.token_bitmasks[plan.chunks[i].req_id] for i in masked]
            # pinned and asynchronous on a GPU: a plain copy from pageable memory would wait for the stream
            words = to_device(torch.from_numpy(np.concatenate(masks) if len(masks) > 1 else masks[0]), logits.device)
            apply_token_bitmask(logits, _long([r for i in masked for r in rows[i]], logits.device), words)
        return logits

    def _verify(self, plan: StepPlan, sampled: list[int], logits: torch.Tensor, draft_probs: dict[str, torch.Tensor],
                raw: torch.Tensor | None = None) -> tuple[list[list[int]], list[SampleLogprobs] | None]:
        """logits [N, V]: the 1 + k rows of each sampled chunk, back to back (``raw``: before penalties and
        grammar masks, for logprobs; None: the same). Returns each sampled chunk's kept tokens and, when some request asked for
        them, their logprobs."""
        chunks = [plan.chunks[i] for i in sampled]
        drafts = [c.token_ids[len(c.token_ids) - c.num_draft_tokens :] for c in chunks]
        probs = [draft_probs.get(c.req_id) for c in chunks] if draft_probs else None
        if probs is not None:
            probs = [None if q is None else q[: c.num_draft_tokens] for q, c in zip(probs, chunks)]
        padded = pad_drafts(logits, drafts, probs)
        params = [self.params[c.req_id] for c in chunks]
        batch = SamplingBatch.build(params, [self.generators[c.req_id] for c in chunks], logits.device,
                                    positions=[_first_sampled_position(c) for c in chunks])
        tokens, num_accepted = verify(padded.target_logits, padded.draft_token_ids, padded.num_drafts,
                                      padded.draft_probs, batch, draft_counts=padded.draft_counts, has_q=padded.has_q)
        num_logprobs = [sp.logprobs for sp in params]
        if raw is not None and any(k is not None for k in num_logprobs):
            padded = pad_drafts(raw, drafts, None)
        logprobs = target_logprobs(padded.target_logits, tokens, num_logprobs)
        return unpad_with_logprobs(tokens, num_accepted, logprobs)  # the step's one host sync


    def _verify_trees(self, plan: StepPlan, sampled: list[int], logits: torch.Tensor, raw: torch.Tensor | None = None,
                      draft_probs: dict[str, torch.Tensor] | None = None
                      ) -> tuple[list[list[int]], list[SampleLogprobs] | None, list[list[int]],
                                 list[list[int]] | None]:
        """``sampled`` chunks through tree verification (a chain is a tree): trees drawn from a drafter's q (its
        rows' q in ``draft_probs``) and drafts without q (a chain with a drafter's q goes through :meth:`_verify`;
        under typical or relaxed acceptance no draft has one). When a chunk wants node tokens, the argmax after
        every node comes back in the same host sync (the others' entries are [])."""
        chunks = [plan.chunks[i] for i in sampled]
        drafts = [c.token_ids[len(c.token_ids) - c.num_draft_tokens :] for c in chunks]
        parents = [c.draft_parents if c.draft_parents is not None else chain_parents(c.num_draft_tokens)
                   for c in chunks]
        probs = None
        if draft_probs:
            probs = [draft_probs[c.req_id][: c.num_draft_tokens + 1]
                     if c.draft_parents is not None and c.req_id in draft_probs else None for c in chunks]
        padded = pad_tree_drafts(logits, drafts, parents, probs)
        params = [self.params[c.req_id] for c in chunks]
        batch = SamplingBatch.build(params, [self.generators[c.req_id] for c in chunks], logits.device,
                                    positions=[_first_sampled_position(c) for c in chunks])
        thinking = None
        if self.relaxed is not None:  # each row inside the thinking phase, for greedy requests only
            width = padded.draft_token_ids.shape[1] + 1
            rows = [self.relaxed.phases(c.thinking, d, p) if sp.greedy else [] for c, d, p, sp in
                    zip(chunks, drafts, parents, params)]
            thinking = torch.tensor([r + [False] * (width - len(r)) for r in rows], dtype=torch.bool,
                                    device=logits.device)
        verdict = verify_tree(padded, batch, self.typical, self.relaxed, thinking)
        num_logprobs = [sp.logprobs for sp in params]
        raw_padded = (padded if raw is None or all(k is None for k in num_logprobs)
                      else pad_tree_drafts(raw, drafts, parents))
        logprobs = tree_logprobs(raw_padded, verdict, num_logprobs)
        wanted = any(c.want_node_tokens for c in chunks)
        kept, paths, per_request, per_node = unpad_tree(verdict, logprobs,  # the step's one host sync
                                                        node_argmax(padded) if wanted else None)
        if per_node is not None:
            per_node = [row[: c.num_draft_tokens] if c.want_node_tokens else [] for row, c in zip(per_node, chunks)]
        return kept, per_request, paths, per_node


class RecurrentSlots:
    """Which recurrent-state slots each running request holds, and where its state stands, from the plans alone, so
    every rank agrees with no collective: a new request takes the lowest free pair of slots (plan order), a finished
    or preempted one frees it. A request's state is committed up to a position, with the drafts of its last verify
    chunk pending; its next chunk's start position says how many of them the target accepted (they are replayed
    first: :class:`~specray.models.gated_deltanet.RecurrentBatch`). A chunk at position 0 starts from zeros (a new
    request, or a preempted one recomputing everything).

    Request slot s is state slots 2s and 2s + 1 (``SLOTS_PER_REQUEST``): one holds the committed state (``side``), a
    step reads it and writes the other, and :meth:`commit` swaps them once the step succeeded (:meth:`discard` when
    it failed: nothing the step wrote is read). The slot a step replaced keeps the state before it until the request's
    next step writes it, so a retry of that step (a chunk starting before the committed position: the runner ran the
    step but it failed after, on another rank or in the executor) takes the step back and runs it again. Reading one
    slot and writing the other also makes a step's forward idempotent, which capturing a CUDA graph relies on: a
    capture runs the step it records three times (two warm-ups, then a replay)."""

    def __init__(self, num_slots: int, max_pending: int):
        self.free = list(range(num_slots))  # a heap: the lowest slot first
        self.max_pending = max_pending
        self.scratch = SLOTS_PER_REQUEST * num_slots  # the state slot past every request's: graph steps' padding
        self.snapshot_base = self.scratch + SCRATCH_SLOTS  # kept states (prefix caching): snapshot i is slot base + i
        self.restores: tuple[list[int], list[int]] = ([], [])  # this step's (snapshot slots, request slots)
        self._saves: list[tuple[int, int]] = []  # (request slot, snapshot) the step keeps once it succeeds
        self.slot_of: dict[str, int] = {}
        self.side = [0] * num_slots  # which of slot s's two state slots holds its committed state
        self.position: dict[str, tuple[int, int]] = {}  # req_id -> (committed position, pending drafts)
        # req_id -> (its position before its last step, that step's start): the state before that step, still in the
        # slot the step replaced
        self.undo: dict[str, tuple[tuple[int, int], int]] = {}
        self._staged: list[tuple[str, int, tuple[int, int], tuple[int, int], int]] = []  # the step's, until commit

    def apply(self, plan: StepPlan) -> None:
        for rid in [*plan.finished_req_ids, *plan.preempted_req_ids]:
            slot = self.slot_of.pop(rid, None)
            self.position.pop(rid, None)
            self.undo.pop(rid, None)
            if slot is not None:
                heapq.heappush(self.free, slot)
        for new in plan.new_requests:
            if new.req_id not in self.slot_of:
                assert self.free, f"more running requests than the {len(self.slot_of)} recurrent-state slots"
                self.slot_of[new.req_id] = heapq.heappop(self.free)

    def _retried(self, c: ScheduledChunk) -> bool:
        """Whether ``c`` runs its request's last step again (the state before that step is to be restored)."""
        held = self.position.get(c.req_id, (0, 0))
        undo = self.undo.get(c.req_id)
        return c.start_pos < held[0] and undo is not None and undo[1] == c.start_pos

    def batch(self, chunks: list[ScheduledChunk]) -> RecurrentBatch:
        """The step's slots and replays; a RequestError naming the chunks it cannot run (checked before anything
        changes). What the step will commit is staged for :meth:`commit`."""
        bad = {}
        for c in chunks:
            held = self.undo[c.req_id][0] if self._retried(c) else self.position.get(c.req_id, (0, 0))
            if c.num_draft_tokens > self.max_pending:
                bad[c.req_id] = (f"{c.num_draft_tokens} drafts, more than the {self.max_pending} the recurrent state "
                                 "keeps pending (num_speculative_tokens)")
            elif c.start_pos and c.restore_state is None and not 0 <= c.start_pos - held[0] <= held[1]:
                bad[c.req_id] = (f"its chunk starts at {c.start_pos} but its recurrent state is at {held[0]} with "
                                 f"{held[1]} drafts pending")
        if bad:
            raise RequestError(list(bad), "; ".join(f"{rid}: {why}" for rid, why in bad.items()))
        batch = RecurrentBatch([], [], [], [], [], parents=[c.draft_parents for c in chunks])
        if all(p is None for p in batch.parents):
            batch.parents = None
        self._staged, self._saves, self.restores = [], [], ([], [])
        for c in chunks:
            slot = self.slot_of[c.req_id]
            if c.restore_state is not None:  # it starts from a kept state, copied into its slot before the step
                self.position[c.req_id] = (c.start_pos, 0)
                self.undo.pop(c.req_id, None)
                self.restores[0].append(self.snapshot_base + c.restore_state)
                self.restores[1].append(2 * slot + self.side[slot])
            if c.save_state is not None:
                self._saves.append((slot, self.snapshot_base + c.save_state))
            if c.start_pos and self._retried(c):  # back to the state before the step this chunk runs again
                self.side[slot] ^= 1
                self.position[c.req_id] = self.undo[c.req_id][0]
            # the slot this step writes holds what the undo record points to: from now on it is gone
            self.undo.pop(c.req_id, None)
            committed = self.position.get(c.req_id, (0, 0))
            batch.slots.append(2 * slot + self.side[slot])
            batch.targets.append(2 * slot + 1 - self.side[slot])
            batch.fresh.append(c.start_pos == 0)
            batch.replay.append(0 if c.start_pos == 0 else c.start_pos - committed[0])
            batch.drafts.append(c.num_draft_tokens)
            self._staged.append((c.req_id, slot, committed, (c.start_pos + c.num_tokens - c.num_draft_tokens,
                                                            c.num_draft_tokens), c.start_pos))
        return batch

    def committed_slot(self, req_id: str) -> int:
        """The state slot holding ``req_id``'s committed state (and its pending drafts)."""
        slot = self.slot_of[req_id]
        return 2 * slot + self.side[slot]

    def commit(self) -> tuple[list[int], list[int]]:
        """The step succeeded: the slots it wrote hold its requests' committed states. Returns the (request slots,
        snapshot slots) to copy the states its chunks keep into."""
        for rid, slot, before, after, start in self._staged:
            self.side[slot] ^= 1
            self.position[rid] = after
            self.undo[rid] = (before, start)
        self._staged = []
        saves, self._saves = self._saves, []
        return [2 * slot + self.side[slot] for slot, _ in saves], [snapshot for _, snapshot in saves]

    def discard(self) -> None:
        """The step failed: what it wrote is never read, every request's state stays where it was (a restored one's
        is the kept state it started from, which a retry restores again)."""
        self._staged, self._saves = [], []


def _first_sampled_position(chunk) -> int:
    """The sequence position of the first token a sampled chunk's target rows choose: the one after its last
    committed token (its drafts' positions follow). It keys a seeded request's draw there."""
    return chunk.start_pos + chunk.num_tokens - chunk.num_draft_tokens


# ---- a split head's verdict: the driver's kept tokens and tree paths, sent to the other ranks -------------------
# One broadcast of int64 at a size every rank knows from the plan: a flag (1: a verdict follows, 0: the driver's
# verification failed, nothing is drafted), then per sampled chunk of k drafts its kept count and up to k + 1 tokens,
# its accepted path's length and up to k node indices.

def _verdict_widths(plan: StepPlan, sampled: list[int]) -> list[int]:
    return [2 * plan.chunks[i].num_draft_tokens + 3 for i in sampled]


def send_verdict(tp: TPGroup, plan: StepPlan, sampled: list[int],
                 verdict: tuple[dict[int, list[int]], dict[int, list[int]]] | None, device: torch.device) -> None:
    """The driver's side: ``verdict`` (kept tokens and non-empty tree paths by chunk index), or None."""
    values = [0]
    if verdict is not None:
        kept, paths = verdict
        values = [1]
        for i in sampled:
            k, tokens, path = plan.chunks[i].num_draft_tokens, kept[i], paths.get(i, [])
            values += [len(tokens), *tokens, *[0] * (k + 1 - len(tokens)), len(path), *path, *[0] * (k - len(path))]
    buffer = torch.zeros(1 + sum(_verdict_widths(plan, sampled)), dtype=torch.long, device=device)
    buffer[: len(values)] = torch.tensor(values, dtype=torch.long)
    tp.broadcast(buffer)


def receive_verdict(tp: TPGroup, plan: StepPlan, sampled: list[int], device: torch.device
                    ) -> tuple[dict[int, list[int]], dict[int, list[int]]] | None:
    """Another rank's side: the driver's verdict as the driver's drafter reads it, or None (nothing to draft)."""
    widths = _verdict_widths(plan, sampled)
    values = tp.broadcast(torch.zeros(1 + sum(widths), dtype=torch.long, device=device)).tolist()
    if not values[0]:
        return None
    kept, paths, at = {}, {}, 1
    for i, width in zip(sampled, widths):
        k = plan.chunks[i].num_draft_tokens
        kept[i] = values[at + 1: at + 1 + values[at]]
        path_at = at + k + 2
        if values[path_at]:
            paths[i] = values[path_at + 1: path_at + 1 + values[path_at]]
        at += width
    return kept, paths


def tree_positions(chunk: ScheduledChunk) -> list[int]:
    """RoPE positions of a chunk's tokens: slot indices for its ordinary tokens and a chain's drafts; a tree
    node at depth d sits at the root's position + d."""
    if chunk.draft_parents is None:
        return list(range(chunk.start_pos, chunk.start_pos + chunk.num_tokens))
    root = chunk.start_pos + chunk.num_tokens - chunk.num_draft_tokens - 1
    return list(range(chunk.start_pos, root + 1)) + [root + d for d in depths(chunk.draft_parents)]


def ancestor_mask(chunk: ScheduledChunk) -> torch.Tensor | None:
    """[q, q] bool among a tree chunk's tokens: ordinary tokens are causal; a node sees them, its ancestors and
    itself. None for a chunk without a tree (plain causal)."""
    if chunk.draft_parents is None:
        return None
    q, k = chunk.num_tokens, chunk.num_draft_tokens
    n = q - k
    mask = torch.ones(q, q, dtype=torch.bool).tril_()
    mask[n:, n:] = False
    for i, parent in enumerate(chunk.draft_parents):
        row = mask[n + i]
        row[n + i] = True
        if parent >= 0:
            row[n:] |= mask[n + parent, n:]  # a node sees what its parent sees, and itself
    return mask


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def logit_rows(plan: StepPlan) -> list[int]:
    """Hidden rows of the step whose logits it needs: the last 1 + k tokens of every chunk that samples."""
    rows, offset = [], 0
    for c in plan.chunks:
        offset += c.num_tokens
        if c.sample:
            rows.extend(range(offset - 1 - c.num_draft_tokens, offset))
    return rows


def _logit_rows_by_chunk(plan: StepPlan, sampled: list[int]) -> dict[int, list[int]]:
    """Per sampled chunk, its rows of the step's logits (:func:`logit_rows` order: 1 + k per chunk, back to back)."""
    out, start = {}, 0
    for i in sampled:
        n = 1 + plan.chunks[i].num_draft_tokens
        out[i], start = list(range(start, start + n)), start + n
    return out


def _rows(logits: torch.Tensor | None, rows: dict[int, list[int]], chunks: list[int]) -> torch.Tensor | None:
    if logits is None:
        return None
    return logits.index_select(0, _long([r for i in chunks for r in rows[i]], logits.device))


def _merge_groups(sampled: list[int], *groups: tuple[list[int], tuple]) -> tuple[list, list | None, list | None,
                                                                                 list | None]:
    """Two verification groups' answers (kept tokens, logprobs, tree paths, node tokens; a chain group has only
    the first two) back in ``sampled`` order; a column no group has stays None, one that only some group has gets
    its empty value ([] per chunk) for the others' chunks."""
    position = {i: n for n, i in enumerate(sampled)}
    columns: list[list | None] = [None] * 4
    for chunks, answers in groups:
        for c, values in enumerate(answers):
            if values is not None:
                column = columns[c] = columns[c] or [[] for _ in sampled]
                for i, value in zip(chunks, values):
                    column[position[i]] = value
    return columns[0], columns[1], columns[2], columns[3]


def _per_chunk(num_chunks: int, sampled: list[int], values: list) -> list[list]:
    """Per chunk of the plan: the sampled chunks' values, [] for the others (non-final prefill chunks)."""
    out: list[list] = [[] for _ in range(num_chunks)]
    for i, value in zip(sampled, values):
        out[i] = value
    return out


def _row_axis(embeds: torch.Tensor) -> int:
    """The axis of an image's rows: embeddings' [num_embeds, H], DeepStack's [1 + k, num_embeds, H], token ids'
    [num_embeds]."""
    return 1 if embeds.dim() == 3 else 0


def _embed_rows(embeds: torch.Tensor, indices: list[int], device: torch.device) -> torch.Tensor:
    """An image's embeddings [..., num_embeds, H] or token ids [num_embeds] at ``indices`` (all: as they are)."""
    axis = _row_axis(embeds)
    return embeds if len(indices) == embeds.shape[axis] else embeds.index_select(axis, _long(indices, device))


def _joined(pieces: dict[str, tuple[list[int], torch.Tensor]], req_id: str, positions: list[int],
            values: torch.Tensor) -> dict[str, tuple[list[int], torch.Tensor]]:
    """``pieces`` with a request's positions and rows added after any it holds (a chunk may reach several images)."""
    if req_id in pieces:
        before, rows = pieces[req_id]
        positions, values = before + positions, torch.cat((rows, values))
    pieces[req_id] = (positions, values)
    return pieces
