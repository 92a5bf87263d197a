"""A separate, smaller draft model, with the target's tokenizer or another one (its drafts then translated through
text: :mod:`specray.drafters.vocab_translation`).

It keeps its own paged KV cache in step with each request's history: every time it is asked, it finds the
longest prefix of the request's tokens that its cache already holds (the accepted drafts survive, rejected ones
do not), rewinds to it, feeds the rest in one batched catch-up pass, then drafts K tokens autoregressively; or,
with ``parallel_drafting`` (PARD: An et al. 2025, AMD's PARD checkpoints), all K from the catch-up pass itself, the
rest followed by K - 1 of the checkpoint's ``pard_token``, draft i + 1 read at the i-th of them (causal attention,
as the model was trained): one forward a step whatever K.
For sampled requests it draws each draft from q (the request's warped distribution over the draft logits) and
returns q, which rejection sampling needs. A request's penalties and logit bias shape its draft logits as they
shape the target's (its history and the drafts before each one counted), so drafts follow the penalized target;
verification against the target's own penalized distribution keeps the output exact either way. A request with
structured outputs drafts under its grammar too (each draft step's logits masked by what the grammar allows after
the history and the drafts before it; q is that masked distribution), so its drafts are never cut for the grammar.

Where the target's steps replay CUDA graphs (``enforce_eager``: a GPU by default), the draft model's short passes
(every request bringing at most ``SHORT_QUERY_MAX`` tokens: the draft steps, and catch-ups after verification) do
too (:class:`~specray.models.step_graphs.StepGraphs`, padding in scratch blocks of its own cache); long catch-ups
(a new request's prompt) run eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from specray.config import QUANTIZATIONS, SpeculativeConfig
from specray.drafters.base import DraftRequest, DrafterContext, Proposal
from specray.drafters.ngram import common_prefix
from specray.drafters.registry import options_of
from specray.drafters.vocab_translation import VocabTranslator, same_vocabulary, translatable
from specray.models.attention import SHORT_QUERY_MAX, build_attention_metadata
from specray.models.kv_cache import allocate_kv_cache
from specray.models.layers import check_heads_split, set_max_model_len
from specray.models.loader import check_quantization, load_model, load_tokenizer, read_config
from specray.models.step_graphs import StepGraphs, graphs_wanted, why_eager
from specray.parallel import TPGroup
from specray.penalties import penalize
from specray.sampling import (SamplingBatch, apply_token_bitmask, draft_seed, logits_to_probs, make_generator,
                              sample)
from specray.kv_blocks import BlockPool
from specray.structured_outputs import RequestGrammar, StructuredOutputs

logger = logging.getLogger(__name__)


@dataclass
class DraftModelOptions:
    """``speculative_config`` keys of ``method="draft_model"`` (vLLM's names)."""

    # required: a smaller model, best with the target's tokenizer (another one's drafts are translated through text)
    model: str | None = None
    draft_tensor_parallel_size: int = 1  # ranks its weights are split over (Ray actors of their own)
    # PARD (vLLM's name): all K drafts from one forward, the history followed by K - 1 copies of the checkpoint's
    # ``pard_token`` (a model trained for it: amd/PARD-*), draft i + 1 read at the i-th of them
    parallel_drafting: bool = False
    # vLLM's: the draft checkpoint's quantization method, checked against its config.json (None: read from there),
    # or "fp8" over an unquantized draft: its linears quantized to FP8 as it loads (specray.models.layers)
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.model is None:
            raise ValueError("speculative_config.model is required for method='draft_model': a path to a "
                             "smaller model with the target's tokenizer")
        if not self.model or not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model={self.model!r} must be a path or hub id (a string) for "
                             "method='draft_model': a smaller model with the target's tokenizer")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative_config.quantization={self.quantization!r} is not supported; one of "
                             f"{sorted(QUANTIZATIONS)}, or None to read it from the draft checkpoint's config.json")
        if not isinstance(self.parallel_drafting, bool):
            raise ValueError(f"speculative_config.parallel_drafting={self.parallel_drafting!r} must be a bool")
        tp = self.draft_tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={tp!r} must be an int >= 1")


@dataclass
class _DraftState:
    cached: list[int] = field(default_factory=list)  # tokens whose KV this drafter holds
    block_ids: list[int] = field(default_factory=list)
    block_contents: list[int] = field(default_factory=list)  # prefix caching: its registered blocks' contents
    generator: torch.Generator | None = None
    grammar: RequestGrammar | None = None  # structured outputs: a matcher that has read ``grammar_tokens``
    grammar_tokens: list[int] = field(default_factory=list)  # the output tokens it has read


def translates(target, draft, target_name: str, draft_name: str) -> bool:
    """Whether the draft model's tokenizer is another than the target's (its drafts then go through text); a
    ValueError naming the fix where one of the two cannot be translated to or from."""
    if target is None or draft is None or same_vocabulary(target, draft):
        return False
    for tokenizer, name in ((target, f"the target {target_name!r}"), (draft, f"the draft {draft_name!r}")):
        why = translatable(tokenizer)
        if why is not None:
            raise ValueError(f"speculative_config.model={draft_name!r} uses another tokenizer than the target "
                             f"{target_name!r}, so its drafts would be translated through text, but the tokenizer "
                             f"of {name} cannot be: {why}; pick a draft model with the target's tokenizer")
    logger.info("the draft model %s has another tokenizer than the target %s: greedy requests' drafts are translated "
                "through text, sampled requests' drawn among the tokens both vocabularies hold", draft_name,
                target_name)
    return True


def pard_token(config, path: str) -> int:
    """The token a PARD draft model reads where drafts are to come (its config's ``pard_token``, or
    ``ptd_token_id``); a ValueError naming the fix when the checkpoint has none or it lies past its vocabulary."""
    token = getattr(config, "pard_token", None)
    if token is None:
        token = getattr(config, "ptd_token_id", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(token, int) or isinstance(token, bool) or token < 0 or (vocab is not None and token >= vocab):
        raise ValueError(f"speculative_config.parallel_drafting=true needs a PARD draft model: "
                         f"speculative_config.model={path!r} gives pard_token={token!r} in its config.json (vocab_size "
                         f"{vocab}); use a checkpoint trained for parallel drafting (e.g. amd/PARD-Qwen3-0.6B), or "
                         "drop parallel_drafting")
    return token


class DraftModelDrafter:
    @classmethod
    def prepare(cls, spec: SpeculativeConfig, ctx: DrafterContext) -> DrafterContext:
        """In the engine's process, before any actor starts: the tokenizer check, the draft's config, and that
        ``draft_tensor_parallel_size`` splits its heads."""
        options = options_of(spec)
        path = options.model
        translate = translates(ctx.target_tokenizer, load_tokenizer(path), ctx.target_model, path)
        config = read_config(path)
        set_max_model_len(config, ctx.max_model_len)  # the target's (a Phi-3 draft picks its LongRoPE factors by it)
        check_heads_split(config, options.draft_tensor_parallel_size, "speculative_config.draft_tensor_parallel_size",
                          "the draft model's")
        if options.parallel_drafting:
            pard_token(config, path)  # checked before any actor starts
        return replace(ctx, draft_model_config=config, translate_drafts=translate)

    def __init__(self, spec: SpeculativeConfig, ctx: DrafterContext):
        self.device = torch.device(ctx.device)
        path = options_of(spec).model
        translate = ctx.translate_drafts
        if ctx.draft_model_config is None:
            translate = translates(ctx.target_tokenizer, load_tokenizer(path), ctx.target_model, path)
        # another tokenizer's: each request's history in the draft's tokens, and its drafts in the target's
        self.translator = VocabTranslator(ctx.target_tokenizer or load_tokenizer(ctx.target_model),
                                          load_tokenizer(path)) if translate else None
        self._twins: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (see _twin_tensors)
        tp = ctx.tp_group or TPGroup.single()  # every rank runs this same drafter on its shard, in lockstep
        quantization = options_of(spec).quantization
        check_quantization(quantization, ctx.draft_model_config or read_config(path), path,
                           "speculative_config.quantization")
        self.model = load_model(path, tp, dtype=getattr(torch, ctx.dtype), device=self.device,
                                config=ctx.draft_model_config, quantization=quantization)
        self.pard = pard_token(ctx.draft_model_config or read_config(path), path) \
            if options_of(spec).parallel_drafting else None
        if self.translator is None and self.model.vocab_size > ctx.vocab_size:
            raise ValueError(f"speculative_config.model={path!r} has vocab_size={self.model.vocab_size}, "
                             f"larger than the target's {ctx.vocab_size}; the draft must share the target's vocabulary")
        # the vocabulary its q lives in (the target's, unless translated)
        self.vocab_size = ctx.vocab_size if self.translator is None else self.model.vocab_size
        # a translated history may take more of the draft's tokens than the target's: room for twice as many
        max_len = ctx.max_model_len * (1 if self.translator is None else 2)
        self.max_len = min(max_len, getattr(self.model, "max_position_embeddings", max_len))
        self.block_size = ctx.block_size
        per_seq = -(-(max_len + spec.num_speculative_tokens) // self.block_size) + 1
        num_blocks = ctx.max_num_seqs * per_seq
        self.graphs = self._graphs(ctx, tp, num_blocks)
        scratch = len(self.graphs.scratch) if self.graphs is not None else 0
        self.kv_cache = allocate_kv_cache(self.model, num_blocks + scratch, self.block_size, ctx.kv_cache_dtype)
        # with prefix caching, a request's state starts from the blocks of its longest whole-block prefix that an
        # earlier request's committed tokens filled (the draft model's own K/V of them), as the target's does
        self.blocks = BlockPool(num_blocks, self.block_size, enable_caching=ctx.enable_prefix_caching)
        self.seed = ctx.seed
        self.states: dict[str, _DraftState] = {}
        self._ctx = ctx
        self._structured: StructuredOutputs | None = None  # built on the first request with structured outputs

    def _graphs(self, ctx: DrafterContext, tp: TPGroup, num_blocks: int) -> StepGraphs | None:
        """Graphs for the short passes when the engine's steps replay them (``enforce_eager``: False, or None on a
        GPU) and the model can be captured (over several ranks: asked for); their padding goes to scratch blocks past
        ``num_blocks``."""
        if not graphs_wanted(ctx.enforce_eager, self.device):
            return None
        why = why_eager(self.model, tp.size, asked=ctx.enforce_eager is False)
        if why is not None:
            logger.info("the draft model's steps run eagerly, as %s", why)
            return None
        scratch = StepGraphs.scratch_blocks_needed(self.block_size)
        return StepGraphs(self.model, self.block_size, list(range(num_blocks, num_blocks + scratch)), self.device)

    # ---- protocol -------------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> None:
        """Forget the draft model's cached blocks too (the engine's ``reset_prefix_cache``); running requests keep
        the blocks they hold."""
        self.blocks.reset_cache()

    def finish(self, req_ids) -> None:
        for rid in req_ids:
            state = self.states.pop(rid, None)
            if state is not None:
                self.blocks.free(state)
            if self.translator is not None:
                self.translator.finish(rid)

    def shutdown(self) -> None:
        """Free the draft model's KV cache and every request's state."""
        self.finish(list(self.states))

    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in batch]
        own = batch if self.translator is None else [self._translated(d) for d in batch]
        active = [i for i, d in enumerate(own) if d.num_speculative_tokens > 0 and d.token_ids and self._prepare(d)]
        if not active:
            return proposals
        reqs = [own[i] for i in active]
        drafts, probs = self._draft(reqs)
        for i, tokens, q in zip(active, drafts, probs):
            if self.translator is not None:
                tokens, q = self._to_target(batch[i], tokens, q)
            proposals[i] = Proposal(tokens, q)
        return proposals

    def _to_target(self, d: DraftRequest, tokens: list[int], q: torch.Tensor | None
                   ) -> tuple[list[int], torch.Tensor | None]:
        """Translated drafts in the target's vocabulary. Drawn ones (a sampled request's, among the tokens both
        vocabularies hold) token for token, with q carried over to the target's ids (rejection sampling stays
        exact: q is what they were drawn from); greedy ones through their text (the target's tokens of it, no q:
        verified as an n-gram's)."""
        if q is None or not self._draws_twins():
            return self.translator.to_target(d.req_id, tokens, d.token_ids)[: d.num_speculative_tokens], None
        _, draft_ids, target_ids = self._twin_tensors()
        moved = q.new_zeros(q.shape[0], self._ctx.vocab_size)
        moved[:, target_ids] = q[:, draft_ids]
        return [self.translator.twins[t] for t in tokens], moved

    def _draws_twins(self) -> bool:
        """A translated draft model's sampled requests draw among the tokens both vocabularies hold (when any)."""
        return self.translator is not None and self._twin_tensors()[1].numel() > 0

    def _twin_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the draft ids that have no twin in the target's vocabulary as a mask [V_draft], the twins' draft ids, their
        target ids), on the device."""
        if self._twins is None:  # (ids past either model's logits never drawn, never proposed)
            pairs = [(d, t) for d, t in self.translator.twins.items()
                     if d < self.vocab_size and t < self._ctx.vocab_size]
            draft_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long)
            lonely = torch.ones(self.vocab_size, dtype=torch.bool).index_fill_(0, draft_ids, False)
            self._twins = (lonely.to(self.device), draft_ids.to(self.device),
                           torch.tensor([t for _, t in pairs], dtype=torch.long, device=self.device))
        return self._twins

    def _translated(self, d: DraftRequest) -> DraftRequest:
        """``d`` in the draft's tokens; its penalties and grammar name the target's ids, so it drafts without them."""
        return replace(d, token_ids=self.translator.to_draft(d.req_id, d.token_ids), num_prompt_tokens=0)

    # ---- internals ------------------------------------------------------------------------------------
    def _prepare(self, d: DraftRequest) -> bool:
        """Rewind this request's cache to the prefix it shares with the history; reserve slots for the rest."""
        state = self.states.get(d.req_id)
        if state is None:
            seed = d.sampling_params.seed
            state = _DraftState(generator=make_generator(draft_seed(seed), self.device))
            self.states[d.req_id] = state
            if self.blocks.enable_caching:
                hit = self.blocks.take_cached(state, d.token_ids, len(d.token_ids) - 1, d.sampling_params.cache_salt)
                state.cached.extend(d.token_ids[:hit])
        keep = min(common_prefix(state.cached, d.token_ids), len(d.token_ids) - 1)
        del state.cached[keep:]
        self.blocks.rewind(state, keep)
        slots = len(d.token_ids) + d.num_speculative_tokens - 1
        if slots > self.max_len or not self.blocks.can_fit(state, slots):
            return False
        self.blocks.allocate(state, slots)
        return True

    def _structured_outputs(self) -> StructuredOutputs:
        if self._structured is None:
            ctx = self._ctx
            tokenizer = ctx.target_tokenizer or load_tokenizer(ctx.target_model)
            eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
            self._structured = StructuredOutputs(tokenizer, ctx.vocab_size, eos, reasoning_parser=ctx.reasoning_parser)
        return self._structured

    def _grammar(self, d: DraftRequest, state: _DraftState) -> RequestGrammar | None:
        """The request's grammar after its history (None: no structured outputs, or nothing to draft under it).
        Rebuilt from the compiled spec when the history is not an extension of what it read (a prefetch's
        assumed drafts were rejected); the engine refused bad specs, and a history the grammar refuses (an
        assumed draft past the grammar's end) leaves the request unconstrained this time."""
        spec = d.sampling_params.structured_outputs
        if spec is None:
            return None
        output = list(d.token_ids[d.num_prompt_tokens:])
        grammar = state.grammar
        if grammar is None or state.grammar_tokens != output[:len(state.grammar_tokens)]:
            try:
                grammar = self._structured_outputs().grammar(spec, d.token_ids[:d.num_prompt_tokens])
            except ValueError:
                return None
            state.grammar, state.grammar_tokens = grammar, []
        new = output[len(state.grammar_tokens):]
        if new and not grammar.advance(new):
            state.grammar = None
            return None
        state.grammar_tokens = output
        return None if grammar.terminated else grammar

    def _draft(self, reqs: list[DraftRequest]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Each request's drafts: K forwards, each feeding the draft before (or, PARD, one forward whose K rows are
        read in turn), each row's logits shaped by the request's penalties and grammar given the drafts before it,
        then the draft taken (argmax, or drawn from q)."""
        states = [self.states[d.req_id] for d in reqs]
        feeds = [list(d.token_ids[len(s.cached):]) for d, s in zip(reqs, states)]
        rows = None if self.pard is None else self._parallel_rows(states, feeds,
                                                                    [d.num_speculative_tokens for d in reqs])
        drafts: list[list[int]] = [[] for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        grammars = [None if self.translator is not None else self._grammar(d, s) for d, s in zip(reqs, states)]
        read = [0] * len(reqs)  # drafts each grammar read (rolled back at the end)
        ended = [False] * len(reqs)  # the grammar is complete: nothing more to draft
        live = list(range(len(reqs)))
        for step in range(max(d.num_speculative_tokens for d in reqs)):
            if rows is None:
                logits = self._forward([states[i] for i in live], [feeds[i] for i in live])  # [len(live), V_draft]
            else:  # PARD: this step's row of every live request's one forward
                logits = rows[torch.tensor(live, device=self.device), step]
            if logits.shape[-1] < self.vocab_size:  # the target's vocabulary: q lives there, and penalties name its ids
                logits = torch.nn.functional.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=float("-inf"))
            for j, i in enumerate(live):
                d = reqs[i]
                if d.sampling_params.penalized and self.translator is None:
                    history = list(d.token_ids) + drafts[i]
                    penalize(logits, [j], d.sampling_params, history[: d.num_prompt_tokens],
                             history[d.num_prompt_tokens:], [], [])
            drawn = [j for j, i in enumerate(live) if not reqs[i].sampling_params.greedy]
            if drawn and self._draws_twins():  # a translated draft's drawn among the twins only
                index = torch.tensor(drawn, device=self.device)
                logits[index] = logits[index].masked_fill(self._twin_tensors()[0], float("-inf"))
            masked = [(j, grammars[i]) for j, i in enumerate(live) if grammars[i] is not None]
            if masked:  # after the penalties, as the target's rows
                words = torch.from_numpy(np.stack([g.mask_row() for _, g in masked])).to(self.device)
                apply_token_bitmask(logits, torch.tensor([j for j, _ in masked], device=self.device), words)
            tokens, q = self._sample(logits, [reqs[i] for i in live], [states[i] for i in live])
            for j, i in enumerate(live):
                if rows is None or step == 0:  # PARD's forward held the history alone as real tokens
                    states[i].cached.extend(feeds[i])
                drafts[i].append(tokens[j])
                if q is not None:
                    qs[i].append(q[j])
                feeds[i] = [tokens[j]]
                grammar = grammars[i]
                if grammar is not None:
                    ok = grammar.advance([tokens[j]])  # drawn under its mask: the grammar takes it
                    assert ok, (reqs[i].req_id, tokens[j], grammar.error)
                    read[i] += 1
                    ended[i] = grammar.terminated
            live = [i for i in live if len(drafts[i]) < reqs[i].num_speculative_tokens and not ended[i]]
            if not live:
                break
        for grammar, n in zip(grammars, read):
            if grammar is not None and n:
                grammar.rollback(n)
        if self.blocks.enable_caching:  # the blocks its committed tokens fill (never past them: drafts may go)
            for d, s in zip(reqs, states):
                self.blocks.cache_blocks(s, d.token_ids, min(len(s.cached), len(d.token_ids)),
                                         d.sampling_params.cache_salt)
        probs = [torch.stack(q) if q and not d.sampling_params.greedy else None for q, d in zip(qs, reqs)]
        return drafts, probs

    def _forward(self, states: list[_DraftState], feeds: list[list[int]]) -> torch.Tensor:
        """The draft model over each request's ``feeds`` after its cached tokens -> the logits of each feed's last
        token [B, V_draft]."""
        hidden = self._hidden(states, feeds)
        last = torch.tensor([sum(len(f) for f in feeds[: j + 1]) - 1 for j in range(len(feeds))], device=self.device)
        return self.model.compute_logits(hidden[last])  # [B, V_draft]

    def _parallel_rows(self, states: list[_DraftState], feeds: list[list[int]], counts: list[int]) -> torch.Tensor:
        """PARD: one forward over each request's feed followed by ``counts[i]`` - 1 pard tokens (causal, as the
        model was trained) -> the logits [B, max count, V_draft] of its last real token, then of each pard token:
        row k gives draft k + 1. The pard tokens' K/V land past the history and are overwritten by the next feed."""
        padded = [f + [self.pard] * (k - 1) for f, k in zip(feeds, counts)]
        hidden = self._hidden(states, padded)
        ends = [0]
        for f in padded:
            ends.append(ends[-1] + len(f))
        width = max(counts)
        index = [ends[j] + len(f) - 1 + min(r, k - 1) for j, (f, k) in enumerate(zip(feeds, counts))
                 for r in range(width)]  # a request's rows past its count repeat its last (never read)
        logits = self.model.compute_logits(hidden[torch.tensor(index, device=self.device)])
        return logits.view(len(feeds), width, -1)

    def _hidden(self, states: list[_DraftState], feeds: list[list[int]]) -> torch.Tensor:
        """The draft model's hidden states [T, H] over every request's ``feeds`` after its cached tokens."""
        lens, starts = [len(f) for f in feeds], [len(s.cached) for s in states]
        # short passes (at most SHORT_QUERY_MAX tokens each: no prompt's) from a graph
        decode = max(lens) <= SHORT_QUERY_MAX
        shape = None if self.graphs is None else self.graphs.shape(lens, starts, decode=decode)
        if shape is not None:
            hidden, _ = self.graphs.run(shape, [t for f in feeds for t in f], lens, starts,
                                        [s.block_ids for s in states])
            return hidden
        input_ids = torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=self.device)
        meta = build_attention_metadata(lens, starts, [s.block_ids for s in states], self.block_size, self.device)
        return self.model(input_ids, meta)  # [T, H]

    def _sample(self, logits: torch.Tensor, reqs: list[DraftRequest], states: list[_DraftState]):
        """Draw each request's next draft from q (``logits`` over the vocabulary q lives in: the target's, or a
        translated draft model's own); q only when some request samples."""
        batch = SamplingBatch.build([d.sampling_params for d in reqs], [s.generator for s in states], self.device)
        if batch.all_greedy:
            return logits.argmax(dim=-1).tolist(), None
        probs = logits_to_probs(logits, batch)  # [B, V]
        return sample(probs, batch).tolist(), probs
