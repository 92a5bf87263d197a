"""The one protocol every drafter implements.

A drafter proposes, for a batch of requests, up to ``num_speculative_tokens`` next tokens each: a chain, or a
token tree of that many nodes (``Proposal.parents``; see ``specray.tree``). It is told
each request's whole token history every time it is asked (prompt + every token the target kept), so it can see
for itself what was accepted since its last proposal, rewind its own state to that, and update any pool.
It is asked every step for every decoding request, with ``num_speculative_tokens == 0`` when the engine wants
no draft this step (the drafter may still learn from the history).

Optional hooks the engine calls when a drafter has them: ``observe_verification(req_id, num_drafted,
num_accepted)``, ``observe_finished(req_id, token_ids)``, and ``observe_node_tokens(req_id, node_tokens)``: after a
step that verified a proposal with ``wants_node_tokens`` (a tree), the target's argmax token after each of its
nodes, in the proposal's node order, -1 for a node the scheduler cut (the list may stop before the proposal's end).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from specray.sampling_params import SamplingParams
from specray.tree import DraftTree, chain_parents

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(slots=True)  # one per decoding request every step
class DraftRequest:
    req_id: str
    token_ids: Sequence[int]  # prompt + kept output; the last one is not yet in the target's KV cache
    num_speculative_tokens: int
    sampling_params: SamplingParams
    # a prefetch (drafting ahead while the target verifies): the last ``num_assumed`` tokens are drafts the
    # target is still checking, assumed kept
    num_assumed: int = 0
    num_prompt_tokens: int = 0  # where the output starts in ``token_ids`` (a drafter applying penalties counts it)


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]  # may be empty: nothing convincing to propose
    # [len(token_ids), vocab] the drafter's distribution q for each proposed token, after the request's
    # temperature/top-k/top-p/min-p; None for a deterministic drafter (q is one-hot on the token).
    probs: "torch.Tensor | None" = None
    # how strong the guess is, for drafters that can tell (an n-gram draft: the length of the match it
    # continues); the draft-length policy keeps acceptance evidence per key. None: the drafter tells none.
    key: int | None = None
    # a token tree (``specray.tree``): node i's parent, -1 for the root (the last kept token), else an earlier
    # node; None: the tokens are a chain. Nodes best first, so cutting to the first n keeps a tree. Only
    # deterministic drafters (probs None) propose trees.
    parents: list[int] | None = None
    # per node, the drafter's estimate of P(node accepted | its parent accepted); None: it tells none
    scores: list[float] | None = None
    # verify all nodes or none: the proposal is one investment (lookahead decoding's window, whose nodes pay by
    # what the target's answers at them teach the drafter), priced whole by the draft policy, never cut by it
    # (the scheduler may still cut it to the token budget or the free slots: a prefix of its nodes, by depth)
    whole: bool = False
    # the drafter wants the target's argmax after each verified node (``observe_node_tokens``); trees only
    wants_node_tokens: bool = False

    def tree(self) -> DraftTree:
        """The proposal as a :class:`~specray.tree.DraftTree` (a chain when it names no parents)."""
        parents = chain_parents(len(self.token_ids)) if self.parents is None else self.parents
        return DraftTree(list(self.token_ids), list(parents), self.scores, self.wants_node_tokens)


@dataclass(slots=True)
class DraftFailure:
    """In place of a proposal: the drafter raised for this request (:func:`propose_isolating_failures`, in the
    engine's process or in a drafter actor); ``why`` says what it raised. The engine then drafts nothing more for
    the request."""

    why: str
    token_ids: tuple = ()  # no drafts, for code that looks at a proposal's tokens


def propose_isolating_failures(drafter, batch: list[DraftRequest]) -> list[Proposal | DraftFailure]:
    """``drafter.propose(batch)``; when it raises, or answers with a list of the wrong length, each request asked
    alone (a drafter rewinds its state to each history it is given, so asking again is safe), a
    :class:`DraftFailure` for one that still fails (its traceback logged): a drafter's failure on one request (a
    user-provided drafter's bug) costs that request its drafts, not every request. The engine's way, and a drafter
    actor's."""
    try:
        return _one_each(drafter, batch)
    except Exception as err:  # one request's failure must not cost the others their drafts: isolate it
        logger.error("drafting for %d requests failed (%r); asking for each alone", len(batch), err)
    out: list[Proposal | DraftFailure] = []
    for dreq in batch:
        try:
            out += _one_each(drafter, [dreq])
        except Exception as err:  # this request's own failure
            logger.exception("drafting failed for request %s", dreq.req_id)
            out.append(DraftFailure(repr(err)))
    return out


def _one_each(drafter, batch: list[DraftRequest]) -> list[Proposal]:
    proposals = list(drafter.propose(batch))
    if len(proposals) != len(batch):
        raise ValueError(f"the drafter {type(drafter).__name__} returned {len(proposals)} proposals for "
                         f"{len(batch)} requests; its propose must return one per request, in order")
    return proposals


@runtime_checkable
class Drafter(Protocol):
    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        """One proposal per request, in batch order, each at most ``num_speculative_tokens`` long."""
        ...

    def finish(self, req_ids: Sequence[str]) -> None:
        """Forget these requests and free what they hold (finished, aborted, or preempted)."""
        ...

    def shutdown(self) -> None:
        """Release what the drafter holds beyond its requests (actors, links); the engine is shutting down."""
        ...


def prepared(drafter_cls, spec, ctx: DrafterContext) -> DrafterContext:
    """The context a drafter is built from, in this process or another: a drafter class may define
    ``prepare(spec, ctx)``, the work that needs the engine's process (checks against the target's tokenizer,
    reading its model's config; done once, before any actor starts, so ``ctx.dtype`` and ``ctx.device`` still hold
    their defaults: the target's are filled in after), and returns the context its copies are built from (an actor
    then imports no transformers)."""
    prepare = getattr(drafter_cls, "prepare", None)
    if prepare is None or ctx.prepared:
        return ctx
    made = prepare(spec, ctx)
    if not isinstance(made, DrafterContext):
        raise ValueError(f"speculative_config.method={spec.method!r}: {drafter_cls.__name__}.prepare returned "
                         f"{type(made).__name__}; it must return the DrafterContext the drafter is built from "
                         "(ctx itself, or dataclasses.replace(ctx, ...))")
    return replace(made, prepared=True)


def proposes_cheaply(drafter) -> bool:
    """A drafter whose proposals cost next to nothing (a lookup, no model) says so with ``cheap_proposals =
    True``: the engine then asks it for the most drafts each request may have and sizes k after seeing the
    proposal's key."""
    return bool(getattr(drafter, "cheap_proposals", False))


@dataclass
class DrafterContext:
    """What a drafter may need to know about the target when it is built (``cls(spec_config, ctx)``)."""

    target_model: str
    vocab_size: int  # the target's vocabulary size (logit width)
    max_model_len: int
    max_num_seqs: int
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    block_size: int = 16  # tokens per KV block of a drafter's own paged cache (the engine's block_size)
    target_tokenizer: object | None = None  # the target's HF tokenizer, when a drafter must check it matches
    tp_group: object | None = None  # a draft model split over ranks: this process's TPGroup (None: one rank)
    # the draft model's config (specray.models.plain_config.PlainConfig) as the engine's process read it, its
    # tokenizer already checked against the target's there (``prepare``); None: the drafter reads and checks
    draft_model_config: object | None = None
    # the draft model's tokenizer is not the target's: its drafts are translated through text (draft_model's
    # ``prepare`` decides it where the target's tokenizer is at hand)
    translate_drafts: bool = False
    prepared: bool = False  # the drafter class's ``prepare`` ran on it (:func:`prepared`)
    # the engine caches prefixes (``enable_prefix_caching``): a drafter with a KV cache of its own may too
    enable_prefix_caching: bool = False
    # the engine's reasoning parser (structured outputs govern only what follows the thinking phase)
    reasoning_parser: str | None = None
    # the engine's: a drafter that runs a model replays its short steps from CUDA graphs on a GPU unless True
    enforce_eager: bool | None = None
    # the engine's kv_cache_dtype: a drafter with a KV cache of its own keeps it in the same format
    kv_cache_dtype: str = "auto"
