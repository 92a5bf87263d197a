"""The plain-data contract between the scheduler and the workers (torch-free).

Per step the scheduler sends one :class:`StepPlan` to every shard and gets one :class:`StepResult` back (from
rank 0). Everything here is lists, ints and strings, so a plan pickles small and crosses Ray cheaply.

Token bookkeeping for one request, in the scheduler's terms::

    tokens:   t0 t1 ... t(c-1) | t(c) ... t(n-1)      | d1 ... dk
              KV already cached| computed this step   | draft tokens verified this step
              (num_computed=c) | (prefill chunk, or the last sampled token)

``ScheduledChunk.token_ids`` holds ``t(c) .. t(n-1)`` followed by ``d1 .. dk``; ``start_pos`` is ``c``;
``num_draft_tokens`` is ``k``. If the chunk reaches the end of the known tokens (``sample=True``), the worker
verifies the drafts and returns the accepted drafts plus one token of the target's own; otherwise (a
non-final prefill chunk) it returns nothing for that request.

Token trees (``specray.tree``): the drafts ``d1 .. dk`` may form a tree, ``ScheduledChunk.draft_parents[i]``
naming node i's parent (-1: the chunk's last non-draft token). Node i then takes slot index ``n + i`` (scratch) but
the RoPE position of its depth, ``n - 1 + depth``, and attends to the context and its ancestors only. The worker
returns the accepted path's node indices (``StepResult.accepted_draft_indices``); when they are not the first
nodes in order, the next plan carries a :class:`KVMove` that every rank applies, before anything else of the plan
but its drops, to move their K/V to the committed slot indices ``n .. n + accepted - 1``.

Node tokens (lookahead decoding, whose drafter needs the target's own guesses beside the verdict): a chunk with
``want_node_tokens`` gets back ``StepResult.node_tokens``, the target's argmax token after each of its draft nodes
(row i + 1 of its logits, whatever the request's sampling settings), in node order. They are read back to the host
with the verdict, in the step's one sync.

Prompt logprobs (``SamplingParams.prompt_logprobs``): for a request that asks, every rank computes the logits of
each of its prefill chunk's rows before the prompt's last and reduces them to the logprob of the prompt token after
the row (the chunk's next token, or for its last row ``next_token_id``, which a non-final chunk of such a request
carries) and the top-k; ``StepResult.prompt_logprobs`` answers them per chunk from the chunk's first prompt token
on (the entry for token ``start_pos + 1``). A prompt that is computed again after preemption is answered again;
the engine keeps the first answer.

Worker-side drafting (hidden-state drafters: EAGLE, MTP): a chunk with ``num_next_drafts = m`` has the worker draft
m tokens for the request's next step right after verifying this one, answered in ``StepResult.draft_token_ids``.
Drafting past the verified drafts writes the head's K/V at up to m - 1 positions beyond them: the scheduler
allocates those slots with the chunk's (and frees them on rewind; the next step rewrites them before reading).
A non-final prefill chunk carries ``next_token_id``, the prompt token after its last one. A chunk with
``worker_drafts`` verifies (a prefix of) the chain the worker drafted for it after the last step: for a sampled
request the worker drew those drafts from the head's q and keeps q for their verification (nothing of vocabulary size
crosses Ray). A worker drafter that raised after verifying answers the step's tokens without drafts and names its
requests in ``StepResult.drafting_failed`` (the engine asks it for none of theirs again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specray.multimodal import MultiModalInputs
from specray.outputs import SampleLogprobs
from specray.sampling_params import SamplingParams


@dataclass
class NewRequest:
    """A request the worker has not seen yet, or sees again after preemption (then it keeps the sampling state
    it held: ``sampling_params`` are the same)."""

    req_id: str
    sampling_params: SamplingParams
    block_ids: list[int]
    num_prompt_tokens: int = 0  # where its output starts (penalties count output tokens apart from the prompt)
    # the tokens that would end it (stop token ids, EOS unless ignore_eos), banned before min_tokens outputs
    stop_token_ids: list[int] = field(default_factory=list)
    # a penalized request starting from cached blocks (prefix caching): the tokens they hold, which its chunks skip
    computed_token_ids: list[int] | None = None
    # its prompt's images (specray.multimodal): the ranks embed each when a chunk first reaches its span
    multimodal: MultiModalInputs | None = None


@dataclass
class BlockTableDelta:
    """How a running request's block table changed since the last plan: keep the first
    ``num_kept_blocks`` entries (the rest were freed on rewind), then append ``new_block_ids``."""

    req_id: str
    num_kept_blocks: int
    new_block_ids: list[int]


@dataclass(slots=True)  # one per scheduled request every step
class ScheduledChunk:
    """The tokens one request runs through the model this step."""

    req_id: str
    token_ids: list[int]
    start_pos: int
    num_draft_tokens: int = 0
    sample: bool = True
    draft_parents: list[int] | None = None  # the drafts form this tree (None: a chain)
    want_node_tokens: bool = False  # answer the target's argmax after each draft node (StepResult.node_tokens)
    # a hidden-state drafter on the worker (specray.drafters.hidden_state): how many drafts to make for the next
    # step after verifying this chunk (the scheduler reserved the slots they write), and for a non-final prefill
    # chunk the prompt token that follows it (the head reads the token after each position)
    num_next_drafts: int = 0
    next_token_id: int | None = None
    # relaxed acceptance (SchedulerConfig.thinking_tokens): the committed tokens end inside the thinking phase
    thinking: bool = False
    # the drafts are (a prefix of) the chain the worker drafted for this request after the last step (not a lookup
    # drafter's): a sampled request's q for them is on the worker
    worker_drafts: bool = False
    # prefix caching on a model with linear attention (a recurrent state per request): start from the state kept in
    # snapshot slot ``restore_state`` (the state after the cached blocks this chunk starts behind), and keep the state
    # after this chunk (it ends at a block boundary) in snapshot slot ``save_state``; None: neither
    restore_state: int | None = None
    save_state: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class KVMove:
    """Move a running request's K/V from physical slots ``src`` to ``dst`` (the scheduler computed them with the
    block table as it was before the rewind that freed the scratch blocks): the accepted path of a token tree,
    into its committed slots. All sources are read before any destination is written."""

    req_id: str
    src: list[int]
    dst: list[int]


@dataclass
class StepPlan:
    """Everything a worker needs for one forward pass over a mixed batch."""

    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    block_deltas: list[BlockTableDelta] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # drop everything held for these
    # preempted since the last plan: drop their block tables but keep their sampling state, so that a seeded
    # request's random stream goes on where it stopped when it comes back (as a NewRequest)
    preempted_req_ids: list[str] = field(default_factory=list)
    # applied after the drops and before new requests and block deltas: the previous step's accepted tree paths
    kv_moves: list[KVMove] = field(default_factory=list)
    # structured outputs (specray.structured_outputs): per sampled chunk of a request with a grammar, the tokens it
    # allows at each of the chunk's 1 + k verified positions, a numpy int32 array [1 + k, ceil(V / 32)] with bit
    # t % 32 of word t // 32 set for an allowed token t; the driver rank masks those logits rows with it
    token_bitmasks: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class StepResult:
    """Per scheduled chunk, in plan order: the tokens the target kept (accepted drafts + one of its own);
    an empty list for a non-final prefill chunk.

    ``logprobs`` is None unless some chunk's request asked for them (``SamplingParams.logprobs``); then, per
    chunk, one ``{token_id: Logprob}`` per kept token (the kept token first, then the request's top-k, raw
    log_softmax of the target's logits at that token's position, with their vocabulary ranks; the engine adds the
    decoded tokens), and [] for the other chunks. The scheduler may
    keep only a prefix of a chunk's tokens (a stop token); the engine keeps the matching prefix of these."""

    step_id: int
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[SampleLogprobs] | None = None
    # None unless some chunk brought a tree; then per chunk the draft indices of its accepted nodes, root first
    # ([] for a chain chunk: its accepted drafts are its first ones)
    accepted_draft_indices: list[list[int]] | None = None
    # None unless some chunk asked (``want_node_tokens``); then per chunk that asked the target's argmax token
    # after each of its draft nodes, in node order (num_draft_tokens of them), [] for the other chunks
    node_tokens: list[list[int]] | None = None
    # None unless the worker drafts (a hidden-state drafter); then per chunk the drafts it made for the next step
    # (``ScheduledChunk.num_next_drafts`` of them at most, [] for the others)
    draft_token_ids: list[list[int]] | None = None
    # with them, for a worker drafter that drafts token trees: per chunk the drafts' parents ([] for a chain or no
    # drafts); and where the drafter scores its drafts, per chunk their scores (a tree node's probability under the
    # drafter given its parent; a chain's drafts' probabilities: the drafter's confidence), [] for none
    draft_parents: list[list[int]] | None = None
    draft_scores: list[list[float]] | None = None
    # None unless some chunk's request asked for prompt logprobs; then per chunk one {token_id: Logprob} per prompt
    # token from start_pos + 1 on that the chunk's rows predict ([] for the others: see the module docstring)
    prompt_logprobs: list[SampleLogprobs] | None = None
    # the requests a worker drafter failed to draft for after this step, and why (they get no drafts from it again)
    drafting_failed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class KVCacheInfo:
    """What one rank tells the executor before the KV cache is sized: the block count is the tightest rank's
    ``budget_bytes // bytes_per_block``; rank 0's dtype, device and vocabulary size configure the drafter."""

    bytes_per_block: int  # one block over every layer on this rank
    budget_bytes: int  # what this rank can give the cache
    dtype: str  # e.g. "float32"
    device: str  # e.g. "cpu", "cuda:0"
    vocab_size: int
