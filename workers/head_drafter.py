"""The worker side of the drafters that read the target's hidden states (EAGLE-1, EAGLE-3, EAGLE-2 and static trees,
MTP): they run inside the target's workers (the driver rank, or every rank with the head split over them, each on its
share, from the driver's verdict), right after verification, so drafting costs no round trip and nothing of vocabulary
size leaves the worker. Their options live in :mod:`specray.drafters.hidden_state`; the worker gets them as plain data
(:func:`specray.drafters.hidden_state.worker_config`).

The step, for every request in the plan (one batched pass each):

1. **First pass** over the positions the target just committed: a prefill chunk's tokens (a non-final chunk
   reads the next prompt token from ``ScheduledChunk.next_token_id``), or a decode's real tokens plus its accepted
   drafts (a tree's accepted path). At position p the head reads token ``t[p+1]`` and the target's feature of p
   (its hidden row of that token), so the last row, whose next token is the one the target just sampled, drafts
   ``d1``. Its K/V lands in the committed slots, in the head's own cache on the target's block tables.
   Where ``t[p+1]`` is an image's token, the row takes the target's embedding of it (:meth:`add_images`).
2. **Draft steps** 2..m (``ScheduledChunk.num_next_drafts``): one row per request at the next position, with the
   head's own feedback feature and the token it just drafted. They write K/V into the slots the scheduler reserved
   past the verified drafts; the next step's first pass rewrites those positions before anything reads them.

**Distinct MTP modules** (:class:`~specray.models.draft_head.ChainedModules`, DeepSeek's
``num_nextn_predict_layers`` = M): module k at position p reads the token ``t[p+1+k]`` and module k-1's output at p,
so its K/V is exact only where that token is committed: up to position N - 1 - k once ``t[N]`` is. Every module runs
over the first pass's rows, each reading the tokens one further than the module before and, at each request's last
row, the draft the module before just made; the drafts are each module's argmax at the last row. The last M - 1
positions' target rows and tokens stay on the worker (:attr:`HiddenStateDrafter.tails`) and lead the next first
pass, so the positions each module computed from drafts are computed again from the committed tokens. Every module
runs whenever the request drafts, whatever its K (at most M).

A request that drafts nothing after this step (the policy's K = 0) costs the head nothing: its first pass is put off,
and the target's rows it would read (its features) wait on the worker (:class:`_Held`, at most ``HELD_POSITIONS``
recent positions) until the request drafts again; then the first pass runs over the held positions and the new ones
together, so the head's K/V is whole again before anything reads it. Positions dropped past the limit keep whatever
the head's cache held in their slots: later drafts may be poorer, never the output (verification decides).

A greedy request's drafts are the head's argmax, each with its probability under the head (the confidence the
draft policy prices chains by). A sampled request's chain is drawn from q, the request's own warpers (temperature,
top-k, top-p, min-p) over the head's logits, from the request's draft stream (seeded apart from the target's); q
stays here (:meth:`HiddenStateDrafter.q_of`) for the chain's verification by rejection sampling (accept x with
min(1, p(x)/q(x)), else resample from norm(max(0, p - q))), which keeps the target's distribution exactly. A drawn
chain carries no scores: a choice of how many to verify that looked at the drawn tokens would bias the output, so
the policy sizes it by its evidence alone. A greedy request's tree is EAGLE-2's (the best nodes by path
probability), verified with one-hot q. A sampled request's tree is drawn from q
(:meth:`HiddenStateDrafter._sampled_tree`): each row's children are drawn one after another without replacement,
and verified against the q they were drawn from (:mod:`specray.tree_verification`). What may decide which children
exist is fixed before they are drawn (the parents' draws and each parent's q), never the children's own tokens:
EAGLE-2's choice of the best k among every frontier node's candidates looks at the candidates, so here the k slots
of a level go to frontier node f's j-th child by the score the parent's path and q promise it (log path q of f +
log of q_f's j-th largest probability), and each f then draws as many children as it got slots. The nodes go level
by level (a level's children parent by parent, each parent's in draw order), the tree carries no scores, and it is
only ever cut to a prefix of that order, sized by the worker's shape rather than the tree's own
(``LLMEngine._as_priced``), so the cut never looks at a drawn token either. A static tree (vLLM's
``speculative_token_tree``, :class:`StaticShape`) is grown level by level the same way, its nodes fixed by the tree:
a greedy request's node of rank r is its parent's r-th best token; a sampled request's parent draws its children in
node order without replacement from its q, as Medusa's (its drawn tree priced as it is, as Medusa's).
Drafts return in ``StepResult.draft_token_ids`` and the engine hands them to the scheduler for the next step.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import torch

from specray.contract import StepPlan
from specray.models.attention import SHORT_QUERY_MAX, build_attention_metadata
from specray.models.draft_head import DraftHead
from specray.models.kv_cache import KVCache, allocate_kv_cache
from specray.models.step_graphs import HeadStepGraphs, StepGraphs, why_eager
from specray.multimodal import MultiModalInputs, rope_ids
from specray.parallel import TPGroup
from specray.sampling import (SamplingBatch, draft_seed, logits_to_probs, make_generator, sample,
                              sample_without_replacement)
from specray.sampling_params import SamplingParams
from specray.tree import kept_nodes

logger = logging.getLogger(__name__)


@dataclass
class Drafted:
    """One request's drafts for its next step: a chain, or a token tree (``parents``, with each node's
    probability under the head given its parent as ``scores``)."""

    token_ids: list[int]
    parents: list[int] | None = None
    scores: list[float] | None = None


@dataclass(frozen=True)
class TreeShape:
    """EAGLE-2's dynamic tree: each expanded node offers ``top_k`` children, ``top_k`` nodes are expanded per
    level, ``depth`` levels; the best ``num_speculative_tokens`` nodes are proposed."""

    top_k: int
    depth: int


class StaticShape:
    """A static token tree (vLLM's ``speculative_token_tree``): nodes as paths of candidate ranks, level by level
    (parents before children). Per level: its nodes' parents, the parents that have children there (the rows the
    level's head logits are read from: 0 the root's, n + 1 node n's), and per node its parent's place among them,
    its rank (a greedy request's: its parent's rank-th best token) and its place among its siblings (a sampled
    request's: its parent's that-many-th draw without replacement)."""

    def __init__(self, paths: list[list[int]]):
        self.paths = [tuple(p) for p in paths]
        assert [len(p) for p in self.paths] == sorted(len(p) for p in self.paths), "a static tree comes level by level"
        index = {p: i for i, p in enumerate(self.paths)}
        self.parents = [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]
        self.levels: list[tuple[list[int], list[int], list[int], list[int], list[int]]] = []
        self.widths: list[tuple[int, int]] = []  # per level: the top-k a greedy parent reads, a sampled one's draws
        for depth in range(1, max(len(p) for p in self.paths) + 1):
            nodes = [i for i, p in enumerate(self.paths) if len(p) == depth]
            rows = sorted({self.parents[i] + 1 for i in nodes})  # the drawing parents' rows
            siblings = {r: [i for i in nodes if self.parents[i] + 1 == r] for r in rows}
            self.levels.append(([self.parents[i] for i in nodes], rows,
                                [rows.index(self.parents[i] + 1) for i in nodes], [self.paths[i][-1] for i in nodes],
                                [siblings[self.parents[i] + 1].index(i) for i in nodes]))
            self.widths.append((1 + max(self.paths[i][-1] for i in nodes), max(len(k) for k in siblings.values())))
        self._on: dict[torch.device, list[tuple[torch.Tensor, ...]]] = {}
        self._parents: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
        """Each level's (parents, rows, place, rank, sibling) as index tensors on ``device``, made once."""
        if device not in self._on:
            self._on[device] = [tuple(torch.tensor(x, dtype=torch.long, device=device) for x in level)
                                for level in self.levels]
        return self._on[device]

    def parents_on(self, device: torch.device) -> torch.Tensor:
        """Every node's parent (-1: the root) [nodes] on ``device``, made once."""
        if device not in self._parents:
            self._parents[device] = torch.tensor(self.parents, dtype=torch.long, device=device)
        return self._parents[device]


@dataclass(frozen=True)
class _Row:
    """One request's part of the first pass."""

    chunk: int  # index in the plan
    rows: list[int]  # the target's hidden rows of its committed positions
    tokens: list[int]  # the token after each of those positions
    start: int  # position of the first
    drafts: int  # how many drafts to make (0: only its K/V)


@dataclass
class _Held:
    """A request's positions whose first pass is put off (it drafted nothing after them): from ``start`` on, the
    token after each and the target's rows the head reads there (a list of per-step pieces, each a tuple of
    tensors as :meth:`HiddenStateDrafter._source` gives them)."""

    start: int
    tokens: list[int]
    pieces: list[tuple[torch.Tensor, ...]]

    def joined(self) -> tuple[torch.Tensor, ...]:
        if len(self.pieces) > 1:
            self.pieces = [tuple(torch.cat(parts) for parts in zip(*self.pieces))]
        return self.pieces[0]

    def cut(self, lo: int, hi: int) -> None:
        """Keep positions ``start + lo`` .. ``start + hi - 1``."""
        self.pieces = [tuple(t[lo:hi] for t in self.joined())]
        self.start, self.tokens = self.start + lo, self.tokens[lo:hi]


class _Draw:
    """The drafting requests' sampling: their params and draft streams, by drafting row."""

    def __init__(self, params: list[SamplingParams], generators: list[torch.Generator | None]):
        self.params, self.generators = params, generators

    def batch(self, rows: list[int], device: torch.device) -> SamplingBatch:
        return SamplingBatch.build([self.params[j] for j in rows], [self.generators[j] for j in rows], device)

    @property
    def sampled(self) -> list[int]:
        """The rows that draw from q (the others draft the head's argmax or best)."""
        return [j for j, sp in enumerate(self.params) if not sp.greedy]


_GREEDY = SamplingParams(temperature=0.0)  # a request that draws nothing this step


class Drawn(NamedTuple):
    """What a sampled request drew after a step, kept until the next verifies it: a chain's tokens and each draft's
    q [k, V], or a tree's tokens, the q [k + 1, V] of each of its rows (the root's, then each node's: the q its
    children were drawn from) and its parents."""

    tokens: list[int]
    q: torch.Tensor
    parents: list[int] | None = None


class DrawsFromQ:
    """The part of a worker drafter that draws a sampled request's drafts from q (the request's own warpers over the
    drafter's logits): each request's draft stream, and what it drew after the last step with its q, which that
    request's next verification reads (:meth:`q_of`). Subclasses draft in ``_draft`` (the arguments of
    :meth:`draft`) and keep what they draw in ``_drawn`` (on the driver)."""

    def __init__(self, tp: TPGroup | None, driver: bool, seed: int):
        # a drafter split over the target's ranks drafts on every rank, in lockstep (their collectives pair up): the
        # driver's verdict reaches the others before drafting (ModelRunner), and what each rank draws must be the
        # same, so an unseeded request's drafts get a stream seeded alike on every rank (from the engine's seed and
        # the request's id) rather than the process's own
        self.tp: TPGroup = tp or TPGroup.single()
        self.driver = driver  # only the driver verifies: only it keeps the drawn drafts' q
        self.seed = seed
        self.q: dict[str, Drawn] = {}  # by request id: its last drawn chain or tree
        self._drawn: dict[str, Drawn] = {}  # what this step drew
        self.generators: dict[str, torch.Generator | None] = {}  # by request id: its draft stream

    @property
    def samples_from_q(self) -> bool:
        """A sampled request's chain or tree is drawn from q."""
        return True

    @property
    def split(self) -> bool:
        """The drafter is split over the target's ranks (every rank drafts, see ``tp``)."""
        return self.tp.size > 1

    def q_of(self, req_id: str, drafts: list[int], parents: list[int] | None = None) -> torch.Tensor | None:
        """q of what was drawn for ``req_id`` after the last step, of which ``drafts`` (with ``parents``, a tree's)
        is what the engine and scheduler kept: a chain's [len(drafts), V] (draft i's), a tree's [len(drafts) + 1,
        V] (each row's: the root's, then each kept node's; a tree cut to a chain's shape reads its first
        len(drafts) rows the chain's way). A tree is kept as a prefix of its nodes, or as the scheduler's
        ``trim_tree`` leaves it (the first nodes no deeper than a depth), whose rows :func:`kept_nodes` finds.
        None: its drafts were the drafter's argmax or best (a greedy request)."""
        drawn = self.q.get(req_id)
        if drawn is None:
            return None
        nodes = (list(range(len(drafts))) if parents is None or drawn.parents is None
                 else kept_nodes(drawn.parents, parents))
        assert [drawn.tokens[n] for n in nodes] == list(drafts), (req_id, drawn.tokens, drafts)
        tree = drawn.q.shape[0] > len(drawn.tokens)
        if nodes == list(range(len(nodes))):
            return drawn.q[: len(drafts) + tree]
        return drawn.q.index_select(0, _index(tree_rows(nodes), drawn.q.device))

    # whether the drafter embeds an image's rows as the target does: the runner then hands it them
    # (:meth:`HiddenStateDrafter.add_images`)
    reads_images = False

    def draft(self, plan: StepPlan, tables: dict[str, list[int]], hidden: torch.Tensor, aux: list[torch.Tensor],
              kept: dict[int, list[int]], paths: dict[int, list[int]],
              params: dict[str, SamplingParams] | None = None) -> list[Drafted | None]:
        """Drafts for every chunk of ``plan`` (None where none were asked for). ``hidden`` [T, H] and ``aux`` are
        the target's rows for the plan's tokens; ``kept[i]`` the tokens chunk i kept (accepted drafts + the
        target's), ``paths[i]`` its accepted tree nodes (absent for a chain). ``params``: every request's sampling
        parameters when a sampled request's drafts may be drawn from q (None: every draft is the drafter's argmax
        or best). What is drawn replaces, once all drafting is done, what this step's chunks verified."""
        self._drawn = {}
        out = self._draft(plan, tables, hidden, aux, kept, paths, params)
        verified = {c.req_id for c in plan.chunks if c.sample}
        self.q = {rid: q for rid, q in self.q.items() if rid not in verified} | self._drawn
        return out

    def _draft(self, plan: StepPlan, tables: dict[str, list[int]], hidden: torch.Tensor, aux: list[torch.Tensor],
               kept: dict[int, list[int]], paths: dict[int, list[int]],
               params: dict[str, SamplingParams] | None) -> list[Drafted | None]:
        raise NotImplementedError

    def drop(self, req_id: str, finished: bool = True) -> None:
        """Forget a finished or preempted request's drawn drafts; a preempted one keeps its draft stream (resumed,
        it draws on from where it stopped)."""
        self.q.pop(req_id, None)
        if finished:
            self.generators.pop(req_id, None)

    def _from_last_rows(self, plan: StepPlan, hidden: torch.Tensor, kept: dict[int, list[int]],
                        paths: dict[int, list[int]], params: dict[str, SamplingParams] | None, best, drawn
                        ) -> tuple[list[tuple[int, int]], dict[int, tuple[list, list]], dict[int, torch.Tensor]]:
        """For the drafters that read one row per request (ReDrafter, the MLP speculator): the target's hidden state
        whose logits gave the token each request just sampled, and that token (:func:`rows_of_last_tokens`), through
        ``best(context, first)`` -> (tokens, values) for the greedy requests and ``drawn(context, first, batch)`` ->
        (tokens, mass, q) for the sampled ones (q [S, rows, V]). Returns (per drafting row, (its chunk index, drafts
        asked for)), per drafting row its host lists (tokens, values or mass, flattened), and the sampled rows' q;
        the drafts' one host sync."""
        found = rows_of_last_tokens(plan, kept, paths)
        asked = [(i, plan.chunks[i].num_next_drafts) for i, _ in found]
        if not found:
            return asked, {}, {}
        device = hidden.device
        context = hidden.index_select(0, torch.tensor([row for _, row in found], device=device))
        last = torch.tensor([kept[i][-1] for i, _ in found], device=device)
        draw = self._draw(plan, asked, params, device)
        sampled = [] if draw is None else draw.sampled
        chosen = sorted(set(range(len(found))) - set(sampled))
        parts, qs = [], {}
        if chosen:
            index = torch.tensor(chosen, device=device)
            out = best(context.index_select(0, index), last.index_select(0, index))
            parts.append(torch.stack([t.double() for t in out]).flatten(2))
        if sampled:
            index = torch.tensor(sampled, device=device)
            tokens, mass, q = drawn(context.index_select(0, index), last.index_select(0, index),
                                    draw.batch(sampled, device))
            parts.append(torch.stack([tokens.double(), mass.double()]).flatten(2))
            qs = {b: q[s] for s, b in enumerate(sampled)}
        # float64 holds every token id exactly, whatever the head's dtype; the narrower part padded (never read)
        width = max(part.shape[2] for part in parts)
        host = torch.cat([torch.nn.functional.pad(part, (0, width - part.shape[2])) for part in parts], dim=1).tolist()
        return asked, {b: (host[0][j], host[1][j]) for j, b in enumerate(chosen + sampled)}, qs

    def _draw(self, plan: StepPlan, asked: list[tuple[int, int]], params: dict[str, SamplingParams] | None,
              device: torch.device) -> _Draw | None:
        """The sampling of the requests of ``asked`` ((chunk index, drafts to make) per drafting row) when some of
        them draft and sample (None: all drafts are argmax or best); a request that drafts nothing counts as greedy
        (it draws nothing from its stream). New draft streams go on ``device``."""
        if params is None:
            return None
        rows = [params[plan.chunks[i].req_id] if drafts else _GREEDY for i, drafts in asked]
        if all(sp.greedy for sp in rows):
            return None
        generators = []
        for sp, (i, _) in zip(rows, asked):
            rid = plan.chunks[i].req_id
            if rid not in self.generators and not sp.greedy:
                seed = draft_seed(sp.seed)
                if seed is None and self.split:  # every rank must draw alike
                    seed = shared_stream_seed(self.seed, rid)
                self.generators[rid] = make_generator(seed, device)
            generators.append(None if sp.greedy else self.generators[rid])
        return _Draw(rows, generators)


# the most positions one request keeps held for a later first pass: the adaptive policy probes every few steps,
# so a request it keeps off holds a handful; one that never drafts (its own K of 0) holds no more than this
HELD_POSITIONS = 64


class HiddenStateDrafter(DrawsFromQ):
    """The worker side of a hidden-state drafter: a :class:`DraftHead` and its paged KV cache."""

    reads_images = True
    graphs_class: type[StepGraphs] = HeadStepGraphs  # its passes' graphs (a drafter whose head runs otherwise: its own)

    def __init__(self, head: DraftHead, num_blocks: int, block_size: int, tree: TreeShape | StaticShape | None = None,
                 driver: bool = True, seed: int = 0, step_graphs: bool = False, kv_cache_dtype: str = "auto"):
        super().__init__(getattr(head, "tp", None), driver, seed)
        self.head = head
        self.tree = tree
        self.block_size = block_size
        if tree is not None:  # (over its own vocabulary: EAGLE-3's draft vocabulary)
            first = head.heads[0] if hasattr(head, "heads") else head
            vocab = getattr(first, "draft_vocab_size", None) or head.target.vocab_size
            if isinstance(tree, TreeShape):
                check_tree_width("dynamic_tree_max_topK", tree.top_k, vocab)
            else:
                check_tree_width("speculative_token_tree", max(top for top, _ in tree.widths), vocab)
        # the head's passes (a decode's first pass, a chain's draft steps, a tree's levels; distinct MTP modules' passes
        # over the first pass's rows, a graph per module) replayed from graphs when the target's steps are (a head
        # whose layers can be captured), their padding in scratch blocks of its own cache
        self.graphs: StepGraphs | None = None
        self.module_graphs: list[StepGraphs] = []
        scratch = 0
        if step_graphs:
            why = why_eager(head, self.tp.size, asked=True)  # the target's replay: over several ranks, asked for
            if why is None:
                scratch = StepGraphs.scratch_blocks_needed(block_size)
                blocks = list(range(num_blocks, num_blocks + scratch))
                # RoPE tables sized once, before any capture, for every position the target allows too: a table
                # grown later would leave the graphs reading the old one
                first = head.heads[0] if getattr(head, "num_modules", 1) > 1 else head
                positions = max(first.config.max_position_embeddings,
                                getattr(head.target, "max_position_embeddings", 0))
                if first is not head:
                    self.module_graphs = [HeadStepGraphs(module, block_size, blocks, head.device, positions)
                                          for module in head.heads]
                else:
                    self.graphs = self.graphs_class(head, block_size, blocks, head.device, positions)
            else:
                logger.info("the draft head's steps run eagerly, as %s", why)
        self.kv_cache: KVCache = allocate_kv_cache(head, num_blocks + scratch, block_size, kv_cache_dtype)
        self.held: dict[str, _Held] = {}  # by request id: positions whose first pass waits for its next drafts
        # distinct MTP modules: by request id, the last positions of its last first pass, run again with the next
        self.tails: dict[str, _Held] = {}
        self.tail_positions = getattr(head, "num_modules", 1) - 1
        # by request id: image embeddings its next first passes read (where a row's token is an image's, the head
        # embeds it as the target did), each piece by its first position: (positions, rows [n, H])
        self.images: dict[str, dict[int, tuple[list[int], torch.Tensor]]] = {}
        # the runner's requests with images (it shares its own): a head whose config rotates by multimodal RoPE
        # (``mrope_section``) takes a request's position ids as the target does
        self.multimodal: dict[str, MultiModalInputs] = {}
        first = head.heads[0] if hasattr(head, "heads") else head  # (distinct MTP modules: each the same RoPE)
        self.mrope = getattr(getattr(first, "rotary_emb", None), "mrope", None) is not None

    @classmethod
    def load_head(cls, config: dict, target, target_config, tp: TPGroup | None = None) -> DraftHead:
        """The head the worker's plain-data ``config`` names (see :func:`load_head`); with ``tp``, this rank's
        share of it."""
        return load_head(config, target, target_config, tp)

    @classmethod
    def aux_layers_of(cls, config: dict, target_config) -> tuple[int, ...]:
        """The target layers whose residual stream the head of the plain-data ``config`` reads, known before it is
        loaded (every pipeline stage carries the streams of its layers among them to the last stage)."""
        from specray.models.draft_head_loader import head_aux_layers

        return head_aux_layers(config["method"], config.get("head_config"), target_config)

    @classmethod
    def build(cls, head: DraftHead, config: dict, num_blocks: int, block_size: int) -> "HiddenStateDrafter":
        return cls(head, num_blocks, block_size, tree_shape_of(config), driver=bool(config.get("driver", True)),
                   seed=int(config.get("seed", 0)), step_graphs=bool(config.get("step_graphs", False)),
                   kv_cache_dtype=str(config.get("kv_cache_dtype", "auto")))

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.head.aux_layers

    def drop(self, req_id: str, finished: bool = True) -> None:
        """Forget a finished or preempted request's held positions (a preempted one recomputes them), and what it
        drew (:meth:`DrawsFromQ.drop`)."""
        self.held.pop(req_id, None)
        self.tails.pop(req_id, None)
        self.images.pop(req_id, None)
        super().drop(req_id, finished)

    def add_images(self, images: dict[str, tuple[list[int], torch.Tensor]]) -> None:
        """The image embeddings the head's next pass reads: by request id, positions and their rows [n, H]."""
        for rid, (positions, values) in images.items():
            self.images.setdefault(rid, {})[positions[0]] = (positions, values)  # a step run again: replaced

    def _inputs(self, plan: StepPlan, work: list[_Row]) -> list[MultiModalInputs | None] | None:
        """Per row of ``work``, its request's images when the head rotates by multimodal RoPE and a request of
        ``work`` has a position table; None: every row rotates by its slot."""
        inputs = [self.multimodal.get(plan.chunks[w.chunk].req_id) for w in work] if self.mrope else []
        return inputs if any(mm is not None and mm.rope_positions is not None for mm in inputs) else None

    @staticmethod
    def _rope(inputs: list[MultiModalInputs | None] | None, positions: list, device: torch.device
              ) -> tuple[torch.Tensor, int] | None:
        """The rows' multimodal RoPE ids [3, T] (``positions``: per request its rows' positions) and the largest;
        None without ``inputs``."""
        if inputs is None:
            return None
        axes, top = rope_ids(inputs, positions)
        return torch.tensor(axes, dtype=torch.long, device=device), top

    def _image_embeds(self, plan: StepPlan, work: list[_Row], shifts: int) -> list[tuple[torch.Tensor, ...] | None]:
        """Per module k < ``shifts``, the first pass's rows whose token is an image's (row p reads the token at
        p + 1 + k, up to the last committed one) and the target's embeddings of them (None: no such row); pieces
        that no later pass reads are forgotten."""
        if not self.images:
            return [None] * shifts
        rows: list[list[int]] = [[] for _ in range(shifts)]
        values: list[list[torch.Tensor]] = [[] for _ in range(shifts)]
        offset = 0
        for w in work:
            rid = plan.chunks[w.chunk].req_id
            end = w.start + len(w.tokens)  # the position of the last row's token
            pieces = self.images.get(rid, {})
            for k in range(shifts):
                for positions, embeds in pieces.values():
                    lo, hi = bisect.bisect_left(positions, w.start + 1 + k), bisect.bisect_right(positions, end)
                    rows[k].extend(offset + p - w.start - 1 - k for p in positions[lo:hi])
                    values[k].extend([embeds[lo:hi]] if lo < hi else [])
            offset += len(w.tokens)
            left = {first: piece for first, piece in pieces.items() if piece[0][-1] > end - self.tail_positions}
            if left:
                self.images[rid] = left
            else:
                self.images.pop(rid, None)
        return [(torch.tensor(r, dtype=torch.long, device=v[0].device), self._embedded(torch.cat(v))) if r else None
                for r, v in zip(rows, values)]

    def _embedded(self, values: torch.Tensor) -> torch.Tensor:
        """An image's rows as the head reads them: embeddings as they are, an image's codes (token ids, an encoder
        of discrete codes) through the target's embedding."""
        return values if values.is_floating_point() else self.head.target.embed(values)


    def _draft(self, plan: StepPlan, tables: dict[str, list[int]], hidden: torch.Tensor, aux: list[torch.Tensor],
               kept: dict[int, list[int]], paths: dict[int, list[int]],
               params: dict[str, SamplingParams] | None) -> list[Drafted | None]:
        work, later = self._first_pass_rows(plan, kept, paths)
        out: list[Drafted | None] = [None] * len(plan.chunks)
        device = hidden.device
        for w in later:
            self._hold(plan.chunks[w.chunk].req_id, w, self._source(hidden, aux, w.rows))
        if not work:
            return out
        work, source = self._with_held(plan, work, hidden, aux)
        features = self.head.target_features(source[0], source)  # (hidden,) or the aux layers' rows: see _source
        tokens = [t for w in work for t in w.tokens]
        lens, starts = [len(w.tokens) for w in work], [w.start for w in work]
        work_tables = [tables[plan.chunks[w.chunk].req_id] for w in work]
        images = self._image_embeds(plan, work, 1 + self.tail_positions)
        inputs = self._inputs(plan, work)
        rope = self._rope(inputs, [range(w.start, w.start + len(w.tokens)) for w in work], device)
        if self.tail_positions:
            ids = torch.tensor(tokens, dtype=torch.long, device=device)
            rows = (lens, starts, work_tables, rope)
            if self.tree is not None:
                return self._module_trees(plan, work, source, ids, features, rows, out, params, images)
            return self._chained(plan, work, source, ids, features, rows, out,
                                 self._draw(plan, _asked(work), params, self.head.device), images)
        feedback, normed = self._pass(tokens, features, lens, starts, work_tables, images[0], rope)
        drafting = [w for w in work if w.drafts > 0]
        if not drafting:
            return out
        last_rows = itertools.accumulate(len(w.tokens) for w in work)  # one past each request's last first-pass row
        ends = torch.tensor([end - 1 for end, w in zip(last_rows, work) if w.drafts > 0], device=device)
        feedback, normed = feedback.index_select(0, ends), normed.index_select(0, ends)
        block_tables = [tables[plan.chunks[w.chunk].req_id] for w in drafting]
        roots = [w.start + len(w.tokens) for w in drafting]  # the position of the token the target just sampled
        inputs = None if inputs is None else self._inputs(plan, drafting)
        if self.tree is not None:
            made = self._trees(plan, drafting, block_tables, roots, feedback, normed,
                               self._draw(plan, _asked(drafting), params, self.head.device), inputs)
        else:
            made = self._chain(plan, drafting, block_tables, roots, feedback, normed,
                               self._draw(plan, _asked(drafting), params, self.head.device), inputs)
        for w, drafted in zip(drafting, made):
            out[w.chunk] = drafted
        return out

    def _keep_drawn(self, plan: StepPlan, work: list[_Row], draw: _Draw | None, tokens: list[list[float]],
                    probs: list[torch.Tensor | None]) -> list[bool]:
        """Keep the drawn chains and their q (``probs``: per draft step [B, V], zero rows where a request was done
        drafting) for their verification (on the driver: only it verifies). Per row of ``work``: whether its chain
        was drawn."""
        if draw is None:
            return [False] * len(work)
        drawn = [not sp.greedy for sp in draw.params]
        if not self.driver:
            return drawn
        rows = [j for j, d in enumerate(drawn) if d]
        q = self.head.full_vocab(torch.stack(probs, dim=1).index_select(0, _index(rows, probs[0].device)), 0.0)
        for n, j in enumerate(rows):
            w = work[j]
            self._drawn[plan.chunks[w.chunk].req_id] = Drawn([int(t) for t in tokens[j][: w.drafts]], q[n, : w.drafts])
        return drawn

    def _chained(self, plan: StepPlan, work: list[_Row], source: tuple[torch.Tensor, ...], ids: torch.Tensor,
                 features: torch.Tensor, rows: tuple, out: list[Drafted | None], draw: _Draw | None,
                 images: list[tuple[torch.Tensor, ...] | None]) -> list[Drafted | None]:
        """Distinct MTP modules' chains (:meth:`_over_rows`): draft k + 1 is module k's argmax at each request's
        last row (for a sampled request, drawn from module k's q there), module k + 1's token at that row."""
        ends = torch.tensor(list(itertools.accumulate(rows[0])), device=ids.device) - 1
        tokens, confs, qs = [], [], []
        everyone = list(range(len(work)))

        def chain(k: int, feedback: torch.Tensor, normed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            conf, tok, probs = self._pick(normed.index_select(0, ends), draw, everyone)  # [B]: draft k + 1
            tokens.append(tok)
            confs.append(conf)
            qs.append(probs)
            return ids.roll(-1).index_copy(0, ends, tok)  # t[p+2+k] for module k + 1 (the last row: its draft)

        self._over_rows(ids, features, rows, images, chain)
        self._keep_tails(plan, work, source)
        if not any(w.drafts for w in work):
            return out
        # the drafts' one host sync: [2, B, M] (token ids are exact in float64)
        table = torch.stack([torch.stack(tokens, dim=1).double(), torch.stack(confs, dim=1).double()]).tolist()
        drawn = self._keep_drawn(plan, work, draw, table[0], qs)
        for w, ids_, p, d in zip(work, table[0], table[1], drawn):
            if w.drafts:
                assert w.drafts <= len(ids_), (w.drafts, len(ids_))
                out[w.chunk] = Drafted([int(t) for t in ids_[: w.drafts]], scores=None if d else p[: w.drafts])
        return out

    def _module_trees(self, plan: StepPlan, work: list[_Row], source: tuple[torch.Tensor, ...], ids: torch.Tensor,
                      features: torch.Tensor, rows: tuple, out: list[Drafted | None],
                      params: dict[str, SamplingParams] | None, images: list[tuple[torch.Tensor, ...] | None]
                      ) -> list[Drafted | None]:
        """Distinct MTP modules' token trees: every module over the first pass's rows (:meth:`_over_rows`: their
        K/V at the committed positions), then the trees as one module's (:meth:`_trees`), level k + 1 from module k
        (:class:`_ModuleLevels`). A request whose first pass holds fewer than ``num_modules - 1`` rows (a sequence
        that short, or a prompt all but its last tokens from cached blocks) lacks module k's output at position
        root - 1 - k and drafts nothing this step."""
        ends = [end - 1 for end in itertools.accumulate(rows[0])]
        last = self.tail_positions  # module k < last: its output at position root - 1 - k is a level's root row
        kept, first = [], []

        def roots(k: int, feedback: torch.Tensor, normed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            if k == 0:
                first.append(normed.index_select(0, _index(ends, ids.device)))
            if k < last:
                kept.append(feedback.index_select(0, _index([max(e - k, 0) for e in ends], ids.device)))
            return ids.roll(-1)  # the last k rows' tokens are drafts: the tree's passes place them instead

        self._over_rows(ids, features, rows, images, roots)
        self._keep_tails(plan, work, source)
        drafting = [j for j, w in enumerate(work) if w.drafts > 0 and len(w.tokens) >= last]
        if not drafting:
            return out
        index = _index(drafting, ids.device)
        module_roots = torch.stack(kept, dim=1).index_select(0, index)  # [B, M - 1, H]
        drafters = [work[j] for j in drafting]
        inputs = self._inputs(plan, drafters)
        made = self._trees(plan, drafters, [rows[2][j] for j in drafting],
                           [w.start + len(w.tokens) for w in drafters], module_roots[:, 0],
                           first[0].index_select(0, index),
                           self._draw(plan, _asked(drafters), params, self.head.device), inputs, module_roots)
        for w, drafted in zip(drafters, made):
            out[w.chunk] = drafted
        return out

    def _over_rows(self, ids: torch.Tensor, features: torch.Tensor, rows: tuple,
                   images: list[tuple[torch.Tensor, ...] | None],
                   then: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Distinct MTP modules over the first pass's rows (``rows``: their lens, starts, block tables and
        multimodal RoPE ids): module k + 1 reads module k's outputs and the tokens one further, ``then(k, feedback,
        normed, ids)`` giving them (each request's last row: module k's draft, or anything where a tree's passes
        follow). Each module's pass replays its graph where the rows have a graph's shape and no image or multimodal
        RoPE id, else all run eagerly over one metadata."""
        lens, starts, tables, rope = rows
        plain = rope is None and all(embeds is None for embeds in images)
        decode = max(lens) <= SHORT_QUERY_MAX  # the tokens just committed (a prompt's rows: more)
        shape = self.module_graphs[0].shape(lens, starts, decode) if self.module_graphs and plain else None
        meta = None
        if shape is None:
            meta = build_attention_metadata(lens, starts, tables, self.block_size, ids.device)
            meta.with_rope_positions(rope)
        for k in range(self.head.num_modules):
            if meta is None:
                features, (normed,) = self.module_graphs[k].run(shape, ids, lens, starts, tables, (features,))
            else:
                meta.input_embeds = images[k]  # the image rows module k's tokens take
                features, normed = self.head.module(k, ids, features, meta)
            ids = then(k, features, normed, ids)

    def _keep_tails(self, plan: StepPlan, work: list[_Row], source: tuple[torch.Tensor, ...]) -> None:
        """Each request's last ``tail_positions`` positions (their tokens and target rows), for the next first pass."""
        end = 0
        for w in work:
            end += len(w.tokens)
            n = min(self.tail_positions, len(w.tokens))
            piece = tuple(t[end - n: end].clone() for t in source)
            self.tails[plan.chunks[w.chunk].req_id] = _Held(w.start + len(w.tokens) - n, w.tokens[-n:], [piece])

    def _source(self, hidden: torch.Tensor, aux: list[torch.Tensor], rows: list[int]) -> tuple[torch.Tensor, ...]:
        """The target's rows the head reads at ``rows``: its residual stream at the head's layers (EAGLE-3), else
        its last hidden states."""
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        if self.head.aux_layers:
            return tuple(a.index_select(0, index) for a in aux)
        return (hidden.index_select(0, index),)

    def _hold(self, req_id: str, w: _Row, piece: tuple[torch.Tensor, ...]) -> None:
        held = self.held.get(req_id)
        if held is None or not held.start <= w.start <= held.start + len(held.tokens):
            self.held[req_id] = _Held(w.start, list(w.tokens), [piece])
            return
        if w.start < held.start + len(held.tokens):  # a step run again (a retry without a failed request)
            held.cut(0, w.start - held.start)
        held.tokens += w.tokens
        held.pieces.append(piece)
        if len(held.tokens) > HELD_POSITIONS:  # keep the most recent half: older positions stay as the cache has them
            held.cut(len(held.tokens) - HELD_POSITIONS // 2, len(held.tokens))

    def _with_held(self, plan: StepPlan, work: list[_Row], hidden: torch.Tensor, aux: list[torch.Tensor]
                   ) -> tuple[list[_Row], tuple[torch.Tensor, ...]]:
        """The first pass's rows and their sources: each request's tail and held positions (where they run on
        into this step's) before this step's."""
        if not any(plan.chunks[w.chunk].req_id in self.held or plan.chunks[w.chunk].req_id in self.tails
                   for w in work):
            return work, self._source(hidden, aux, [r for w in work for r in w.rows])
        rows, pieces = [], []
        for w in work:
            piece = self._source(hidden, aux, w.rows)
            rid = plan.chunks[w.chunk].req_id
            for before in (self.held.pop(rid, None), self.tails.pop(rid, None)):  # held, then the tail before it
                if before is not None and before.start < w.start <= before.start + len(before.tokens):
                    before.cut(0, w.start - before.start)  # all of it, but after a step that is run again
                    piece = tuple(torch.cat((h, p)) for h, p in zip(before.joined(), piece))
                    w = _Row(w.chunk, [], before.tokens + w.tokens, before.start, w.drafts)
            rows.append(w)
            pieces.append(piece)
        return rows, tuple(torch.cat(parts) for parts in zip(*pieces))

    def _chain(self, plan: StepPlan, work: list[_Row], tables: list[list[int]], roots: list[int],
               feedback: torch.Tensor, normed: torch.Tensor, draw: _Draw | None,
               inputs: list[MultiModalInputs | None] | None = None) -> list[Drafted]:
        """Each request's chain of ``drafts`` tokens: d1 from the first pass, then one row per step; a greedy
        request's the head's argmax, each with its probability under the head (its confidence, which the policy
        prices the chain by); a sampled one's drawn from q (``draw``), kept for its verification. ``inputs``: per
        request its images, where its steps take multimodal RoPE ids (:meth:`_inputs`)."""
        device = feedback.device
        everyone = list(range(len(work)))
        conf, tokens, probs = self._pick(normed, draw, everyone)  # [B] d1
        steps, confs, qs = [tokens], [conf], [probs]
        live = everyone  # requests still drafting
        for step in range(1, max(w.drafts for w in work)):
            keep = [j for j in live if work[j].drafts > step]
            if not keep:
                break
            if len(keep) != len(live):
                sel = torch.tensor([live.index(j) for j in keep], dtype=torch.long, device=device)
                tokens, feedback = tokens.index_select(0, sel), feedback.index_select(0, sel)
            live = keep
            # step s reads d_s at the position after the root's (root + s - 1), with the feedback of the last
            at = [roots[j] + step - 1 for j in live]
            rope = None if inputs is None else self._rope([inputs[j] for j in live], [[p] for p in at], device)
            feedback, normed = self._pass(tokens, feedback, [1] * len(live), at, [tables[j] for j in live],
                                          rope=rope)
            conf, tokens, probs = self._pick(normed, draw, live)
            steps.append(_scatter(tokens, live, len(work)))
            confs.append(_scatter(conf, live, len(work)))
            if probs is not None:
                qs.append(probs.new_zeros(len(work), probs.shape[1]).index_copy_(0, _index(live, device), probs))
        # the drafts' one host sync: [2, B, m] (token ids are exact in float64)
        table = torch.stack([torch.stack(steps, dim=1).double(), torch.stack(confs, dim=1).double()]).tolist()
        drawn = self._keep_drawn(plan, work, draw, table[0], qs)
        return [Drafted([int(t) for t in ids[: w.drafts]], scores=None if d else p[: w.drafts])
                for ids, p, w, d in zip(table[0], table[1], work, drawn)]

    def _pass(self, tokens: list[int] | torch.Tensor, features: torch.Tensor, lens: list[int], starts: list[int],
              tables: list[list[int]], images: tuple[torch.Tensor, ...] | None = None,
              rope: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over ``lens[i]`` tokens of each request from position ``starts[i]`` (a first pass, or a chain
        step's one row), each with its feature row (``images``: rows taking image embeddings; ``rope``: multimodal
        RoPE ids, :meth:`_rope`): from a graph when the pass has a graph's shape and neither, else eagerly.
        Returns (feedback, normed) [T, H] each."""
        plain = images is None and rope is None
        decode = max(lens) <= SHORT_QUERY_MAX  # the tokens just committed, a chain step's row (a prompt's: more)
        shape = None if self.graphs is None or not plain else self.graphs.shape(lens, starts, decode)
        if shape is None:
            ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(tokens, dtype=torch.long,
                                                                                device=features.device)
            meta = build_attention_metadata(lens, starts, tables, self.block_size, features.device)
            meta.input_embeds = images
            meta.with_rope_positions(rope)
            return self.head(ids, features, meta)
        feedback, (normed,) = self.graphs.run(shape, tokens, lens, starts, tables, (features,))
        return feedback, normed

    def _pick(self, normed: torch.Tensor, draw: _Draw | None, rows: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Per row (``rows``: which of the drafting requests): the draft (target ids) and its probability under
        the head: the head's argmax, or for a sampled request (``draw``) a token drawn from q, whose [N, V_draft]
        rows (over the head's vocabulary; one-hot on greedy rows) come third (None when no row samples)."""
        logits = self.head.draft_logits(normed)
        best, ids = logits.max(-1)
        conf, tokens = (best - logits.logsumexp(-1)).exp(), self.head.to_target_ids(ids)  # softmax at the argmax
        batch = None if draw is None else draw.batch(rows, normed.device)
        if batch is None or batch.all_greedy:
            return conf, tokens, None
        probs = logits_to_probs(logits, batch)  # q: the request's warpers over the head's logits (its vocabulary)
        drawn = self.head.to_target_ids(sample(probs, batch))
        return conf, torch.where(batch.greedy, tokens, drawn) if batch.any_greedy else drawn, probs

    def _trees(self, plan: StepPlan, work: list[_Row], tables: list[list[int]], roots: list[int],
               feedback: torch.Tensor, normed: torch.Tensor, draw: _Draw | None,
               inputs: list[MultiModalInputs | None] | None = None, module_roots: torch.Tensor | None = None
               ) -> list[Drafted]:
        """Greedy requests' trees by :meth:`_tree` (or :meth:`_static_tree`), sampled ones' by
        :meth:`_sampled_tree` (or :meth:`_static_tree`), each group in one batch (``inputs``: as :meth:`_chain`'s;
        ``module_roots`` [B, M - 1, H]: distinct MTP modules' outputs at their levels' root rows, where they draft)."""
        sampled = [] if draw is None else draw.sampled
        static = isinstance(self.tree, StaticShape)
        groups = [(list(range(len(work))), False)]
        if sampled:
            drawn = set(sampled)
            groups = [([j for j in range(len(work)) if j not in drawn], False), (sampled, True)]
        made: list[Drafted | None] = [None] * len(work)
        for group, from_q in groups:
            if not group:
                continue
            index = _index(group, feedback.device)
            levels = None if module_roots is None else _ModuleLevels(module_roots.index_select(0, index))
            args = ([work[j] for j in group], [tables[j] for j in group], [roots[j] for j in group],
                    feedback.index_select(0, index), normed.index_select(0, index),
                    None if inputs is None else [inputs[j] for j in group])
            batch = draw.batch(group, feedback.device) if from_q else None
            if static:
                out = self._static_tree(plan, *args, batch, levels=levels)
            else:
                out = (self._sampled_tree(plan, *args, batch, levels=levels) if from_q
                       else self._tree(*args, levels=levels))
            for j, drafted in zip(group, out):
                made[j] = drafted
        return made

    def _sampled_tree(self, plan: StepPlan, work: list[_Row], tables: list[list[int]], roots: list[int],
                      feedback: torch.Tensor, normed: torch.Tensor, inputs: list[MultiModalInputs | None] | None,
                      batch: SamplingBatch, levels: "_ModuleLevels | None" = None) -> list[Drafted]:
        """Sampled requests' trees drawn from q (the module docstring): the root's ``top_k`` children drawn without
        replacement from its q; then ``depth - 1`` times, the level's ``top_k`` slots shared out among the last
        level's nodes by the score each one's path and q promise its j-th child, each node drawing as many children
        as it got. A node's q [V_draft] is the request's warpers over the head's logits there; nodes past a q's
        support (a top-k or top-p cut) are left out, as are their would-be children. Each request keeps the first
        ``drafts`` nodes (level by level), and its rows' q stays here for their verification."""
        k, depth = self.tree.top_k, self.tree.depth
        device = feedback.device
        b, h = feedback.shape
        q_root = logits_to_probs(self.head.draft_logits(normed), batch)  # [B, Vd]
        vd = q_root.shape[-1]
        tok = sample_without_replacement(q_root, batch, k)  # [B, k] draft-vocabulary ids, in draw order
        own = q_root.gather(1, tok)  # [B, k] q of each drawn child
        valid = own > 0
        cum = torch.where(valid, own.log(), float("-inf"))  # path log q
        parents = torch.full((b, k), -1, dtype=torch.long, device=device)
        q_nodes = torch.zeros(b, k * depth, vd, device=device)  # q at each node that gets children
        node_features, ancestors, frontier, node_depth = _first_level(feedback, k)
        for d in range(2, depth + 1):
            n = tok.shape[1]
            fb, nm = self._over_nodes(tok, node_features, ancestors, node_depth, roots, tables, inputs, levels,
                                      parents)
            rows = nm.gather(1, frontier[:, :, None].expand(b, k, h)).reshape(b * k, h)
            q_f = logits_to_probs(self.head.draft_logits(rows), batch.repeat_rows(k)).view(b, k, vd)
            q_nodes[:, n - k : n] = q_f  # the frontier is the last level: nodes n - k .. n - 1
            pairs, filled = _slots(cum.gather(1, frontier), q_f)  # [B, k]: f * k + j of each new node
            drawn = sample_without_replacement(q_f.view(b * k, vd), batch.repeat_rows(k), k).view(b, k * k)
            new_tok = drawn.gather(1, pairs)
            slot_parent = pairs // k  # the frontier position of each new node's parent
            parent = frontier.gather(1, slot_parent)
            # q of each new node's token under its parent's q
            new_own = q_f.gather(1, slot_parent[:, :, None].expand(b, k, vd)).gather(2, new_tok[:, :, None]).squeeze(2)
            new_valid = filled & (new_own > 0)
            tok = torch.cat([tok, new_tok], dim=1)
            valid = torch.cat([valid, new_valid], dim=1)
            cum = torch.cat([cum, torch.where(new_valid, cum.gather(1, parent) + new_own.log(), float("-inf"))], 1)
            parents = torch.cat([parents, parent], dim=1)
            node_features = torch.cat([node_features, fb.gather(1, parent[:, :, None].expand(b, k, h))], dim=1)
            ancestors = _grown(ancestors, parent)
            frontier = torch.arange(n, n + k, device=device).expand(b, k)
            node_depth += [d] * k
        host = torch.stack([self.head.to_target_ids(tok).float(), parents.float(), valid.float()]).tolist()  # one sync
        q_rows = torch.cat([q_root[:, None], q_nodes[:, : tok.shape[1]]], dim=1)  # [B, 1 + nodes, Vd]
        made = []
        for i, w in enumerate(work):
            keep, drafted = drawn_tree(host[0][i], host[1][i], host[2][i], w.drafts)  # valid nodes lead each level
            made.append(drafted)
            if self.driver:  # the q it verifies against, over the target's vocabulary: only the kept rows
                q = self.head.full_vocab(q_rows[i].index_select(0, _index(tree_rows(keep), device)), 0.0)
                self._drawn[plan.chunks[w.chunk].req_id] = Drawn(drafted.token_ids, q, drafted.parents)
        return made

    def _tree(self, work: list[_Row], tables: list[list[int]], roots: list[int], feedback: torch.Tensor,
              normed: torch.Tensor, inputs: list[MultiModalInputs | None] | None = None,
              levels: "_ModuleLevels | None" = None) -> list[Drafted]:
        """EAGLE-2's dynamic tree per request: the root's ``top_k`` best children; then ``depth - 1`` times, every
        frontier node's ``top_k`` children, of which the ``top_k`` with the best path log-probability form the next
        frontier; finally the ``drafts`` best nodes by path log-probability (a parent's is never below its child's,
        so they form a tree). Each level runs the head once over every node so far as a token tree placed after the
        root (positions root + depth, ancestor masks), recomputing earlier levels instead of keeping their K/V: the
        nodes' slots are the scheduler's reserved ones past the root."""
        k, depth = self.tree.top_k, self.tree.depth
        device = feedback.device
        b, h = feedback.shape
        logp = torch.log_softmax(self.head.draft_logits(normed), dim=-1)
        own, tok = logp.topk(k, dim=-1)  # [B, k]: draft-vocabulary ids
        cum, parents = own.clone(), torch.full((b, k), -1, dtype=torch.long, device=device)
        node_features, ancestors, frontier, node_depth = _first_level(feedback, k)
        for d in range(2, depth + 1):
            n = tok.shape[1]
            fb, nm = self._over_nodes(tok, node_features, ancestors, node_depth, roots, tables, inputs, levels,
                                      parents)
            rows = frontier[:, :, None].expand(b, k, h)
            child_lp, child_tok = torch.log_softmax(self.head.draft_logits(nm.gather(1, rows).reshape(b * k, h)),
                                                    dim=-1).topk(k, dim=-1)  # [B*k, k]
            cand = (cum.gather(1, frontier)[:, :, None] + child_lp.view(b, k, k)).view(b, k * k)
            best_cum, best = cand.topk(k, dim=-1)  # [B, k]
            parent = frontier.gather(1, best // k)  # node index of each new node's parent
            new_tok = child_tok.view(b, k * k).gather(1, best)
            tok = torch.cat([tok, new_tok], dim=1)
            own = torch.cat([own, child_lp.view(b, k * k).gather(1, best)], dim=1)
            cum = torch.cat([cum, best_cum], dim=1)
            parents = torch.cat([parents, parent], dim=1)
            node_features = torch.cat([node_features, fb.gather(1, parent[:, :, None].expand(b, k, h))], dim=1)
            ancestors = _grown(ancestors, parent)
            frontier = torch.arange(n, n + k, device=device).expand(b, k)
            node_depth += [d] * k
        # the best nodes by path log-probability, parents first (ties broken by depth, then node order)
        order = torch.argsort(cum - 1e-6 * torch.tensor(node_depth, device=device), dim=-1, descending=True,
                              stable=True)
        host = torch.stack([self.head.to_target_ids(tok).float(), parents.float(), own.exp(), order.float()]
                           ).tolist()  # the drafts' one host sync
        made = []
        for i, w in enumerate(work):
            token_ids, par, prob, rank = host[0][i], host[1][i], host[2][i], [int(x) for x in host[3][i]]
            chosen = rank[: w.drafts]
            index = {node: j for j, node in enumerate(chosen)}
            made.append(Drafted([int(token_ids[n]) for n in chosen],
                                [-1 if par[n] < 0 else index[int(par[n])] for n in chosen],
                                [prob[n] for n in chosen]))
        return made

    def _static_tree(self, plan: StepPlan, work: list[_Row], tables: list[list[int]], roots: list[int],
                     feedback: torch.Tensor, normed: torch.Tensor, inputs: list[MultiModalInputs | None] | None,
                     batch: SamplingBatch | None = None, levels: "_ModuleLevels | None" = None) -> list[Drafted]:
        """A static tree per request (:class:`StaticShape`), level by level, each level after the first from one head
        pass over every node so far (:meth:`_over_nodes`, as EAGLE-2's levels): a greedy request's node of rank r is
        its parent's r-th best token, scored by its probability there; a sampled request's (``batch``) parent draws
        its children one after another without replacement from its q (the request's warpers over the head's logits),
        the tree carrying no scores, its rows' q kept for verification. Each request keeps its first ``drafts`` nodes
        (a sampled one's with mass under their q, their parents kept)."""
        shape: StaticShape = self.tree
        b, h = feedback.shape
        device = feedback.device
        tok = torch.zeros(b, 0, dtype=torch.long, device=device)  # draft-vocabulary ids
        own = torch.zeros(b, 0, device=device)  # each node's probability under its parent (sampled: its q there)
        node_features, depth = feedback.new_zeros(b, 0, h), []
        ancestors = torch.zeros(b, 0, 0, dtype=torch.bool, device=device)
        rows_fb, rows_nm = feedback[:, None], normed[:, None]  # row 0 the root's, row n + 1 node n's
        q_rows = None  # sampled: [B, 1 + nodes, V_draft], q at each row that has children (zeros elsewhere)
        for d, ((parents, rows, place, rank, sibling), (top, draws)) in enumerate(zip(shape.on(device), shape.widths),
                                                                                start=1):
            if depth:
                fb, nm = self._over_nodes(tok, node_features, ancestors, depth, roots, tables, inputs, levels,
                                          None if levels is None else shape.parents_on(device)[: len(depth)])
                rows_fb, rows_nm = torch.cat([feedback[:, None], fb], 1), torch.cat([normed[:, None], nm], 1)
            p, m = rows.numel(), parents.numel()
            logits = self.head.draft_logits(rows_nm.index_select(1, rows).reshape(b * p, h))
            if batch is None:
                probs, ids = torch.softmax(logits.float(), dim=-1).topk(top, dim=-1)
                new_tok, new_own = ids.view(b, p, -1)[:, place, rank], probs.view(b, p, -1)[:, place, rank]
            else:
                q = logits_to_probs(logits, batch.repeat_rows(p))  # [B * p, V_draft]
                drawn = sample_without_replacement(q, batch.repeat_rows(p), draws)
                q = q.view(b, p, -1)
                new_tok = drawn.view(b, p, -1)[:, place, sibling]
                new_own = q[:, place].gather(2, new_tok[:, :, None]).squeeze(2)
                if q_rows is None:
                    q_rows = q.new_zeros(b, 1 + len(shape.paths), q.shape[-1])
                q_rows[:, rows] = q
            ancestors = (torch.eye(m, dtype=torch.bool, device=device).expand(b, m, m) if d == 1
                         else _grown(ancestors, parents.expand(b, m)))
            node_features = torch.cat([node_features, rows_fb.index_select(1, parents + 1)], dim=1)
            tok, own, depth = torch.cat([tok, new_tok], dim=1), torch.cat([own, new_own], dim=1), depth + [d] * m
        host = torch.stack([self.head.to_target_ids(tok).double(), own.double()]).tolist()  # the drafts' one host sync
        made = []
        for i, w in enumerate(work):
            if batch is None:
                made.append(Drafted([int(t) for t in host[0][i][: w.drafts]], shape.parents[: w.drafts],
                                    host[1][i][: w.drafts]))
                continue
            keep, drafted = drawn_tree(host[0][i], shape.parents, [x > 0 for x in host[1][i]], w.drafts)
            made.append(drafted)
            if self.driver:  # the q it verifies against, over the target's vocabulary: only the kept rows
                q = self.head.full_vocab(q_rows[i].index_select(0, _index(tree_rows(keep), device)), 0.0)
                self._drawn[plan.chunks[w.chunk].req_id] = Drawn(drafted.token_ids, q, drafted.parents)
        return made

    def _over_nodes(self, tok: torch.Tensor, node_features: torch.Tensor, ancestors: torch.Tensor,
                    node_depth: list[int], roots: list[int], tables: list[list[int]],
                    inputs: list[MultiModalInputs | None] | None = None, levels: "_ModuleLevels | None" = None,
                    parents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One head pass over every node of each request's tree so far (tok [B, n] draft ids, each reading its
        parent's feedback ``node_features`` [B, n, H]): a node at depth dd reads its token at head position
        root + dd - 1, seeing its ancestors (``ancestors`` [B, n, n]), in the slots from the root's on. Returns the
        head's feedback and normed rows [B, n, H]. Distinct MTP modules (``levels``, with each node's parent
        [B, n] or [n], -1: the root): module k, k the deepest level so far, over the nodes k positions earlier (its
        rows read the tokens k further), each reading module k - 1's output at its parent's row."""
        b, n, h = node_features.shape
        k = 0
        if levels is not None:
            k = node_depth[-1]
            node_features = levels.features(k, parents)
            roots = [r - k for r in roots]
        positions = [[r + dd - 1 for dd in node_depth] for r in roots]
        flat = [p for own in positions for p in own]
        ids, features = self.head.to_target_ids(tok).reshape(-1), node_features.reshape(b * n, h)
        rope = self._rope(inputs, positions, tok.device)
        graphs = self.graphs if levels is None else (self.module_graphs[k] if self.module_graphs else None)
        # from a graph (the positions and ancestor masks its data) unless the head's trees take the host's help
        graphed = graphs is not None and rope is None and getattr(self.head, "graph_trees", True)
        shape = graphs.shape([n] * b, roots, decode=True) if graphed else None
        if shape is None:
            meta = build_attention_metadata([n] * b, list(roots), tables, self.block_size, tok.device,
                                            positions=flat, ancestors=list(ancestors))
            meta.with_rope_positions(rope)
            fb, nm = self.head(ids, features, meta) if levels is None else self.head.module(k, ids, features, meta)
        else:
            fb, (nm,) = graphs.run(shape, ids, [n] * b, list(roots), tables, (features,), positions=flat,
                                   ancestors=list(ancestors))
        fb, nm = fb.view(b, n, h), nm.view(b, n, h)
        if levels is not None:
            levels.done = fb
        return fb, nm

    def _first_pass_rows(self, plan: StepPlan, kept: dict[int, list[int]], paths: dict[int, list[int]]
                         ) -> tuple[list[_Row], list[_Row]]:
        """The first pass's rows of this step, and the rows of requests that draft nothing after it (held)."""
        work, later, offset = [], [], 0
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
            row = _Row(i, list(range(base, base + real)) + [base + real + n for n in nodes],
                       chunk.token_ids[1:real] + list(tokens), chunk.start_pos, chunk.num_next_drafts)
            (work if row.drafts else later).append(row)
        return work, later


class _ModuleLevels:
    """A tree's levels from distinct MTP modules (``roots`` [B, M - 1, H]: module k's output at position
    root - 1 - k, the committed token's row before a level's nodes). Module k runs over the nodes of depths 1..k,
    placed k positions before one module's (its rows read the tokens k further: the deepest nodes at the last
    committed position, as a chain's draft), each node reading module k - 1's output at its parent's row: the last
    level pass's output (``done``), or for a depth-1 node the root row's. Node features are thus read afresh at
    every level, not carried as one module's are."""

    def __init__(self, roots: torch.Tensor):
        self.roots = roots
        self.done: torch.Tensor | None = None  # the last level pass's feedback [B, n, H]

    def features(self, k: int, parents: torch.Tensor) -> torch.Tensor:
        """What module k's nodes read: [B, n, H] for ``parents`` [B, n] or [n] (-1: the root)."""
        rows = self.roots[:, k - 1: k]
        if self.done is not None:
            rows = torch.cat((rows, self.done), dim=1)
        b, n, h = rows.shape[0], parents.shape[-1], rows.shape[2]
        return rows.gather(1, (parents + 1).expand(b, n)[:, :, None].expand(b, n, h))


def _slots(cum: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A level of a tree drawn from q: the frontier's path log q ``cum`` [B, k] and q [B, k, V] -> the level's k
    slots as f * k + j (frontier node f's j-th child) [B, k], and whether each is filled [B, k]. Child (f, j)
    promises cum(f) + log(q_f's j-th largest probability): the k best promises win, known before anything is
    drawn, and since a node's promises fall with j, f wins its first c_f; the slots list them parent by parent,
    each parent's in draw order. A promise of -inf (an empty frontier node, or j past q_f's support) fills none."""
    b, k = cum.shape
    promise = cum[:, :, None] + q.topk(k, dim=-1).values.log()  # [B, k, k]
    top = promise.view(b, k * k).topk(k, dim=-1)
    wins = torch.where(top.values > float("-inf"), 1, 0)
    counts = torch.zeros(b, k, dtype=torch.long, device=cum.device).scatter_add_(1, top.indices // k, wins)
    slots = torch.arange(k * k, device=cum.device)
    taken = (slots % k)[None, :] < counts.repeat_interleave(k, dim=1)  # [B, k*k]: j < c_f
    pairs = torch.where(taken, slots, k * k).sort(dim=-1).values[:, :k]  # k*k: an empty slot
    return pairs.clamp_max(k * k - 1), pairs < k * k


def _first_level(feedback: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """A tree's first level of k nodes under each request's root (feedback [B, H]): what each node reads (its
    parent's feedback) [B, k, H], who sees whom [B, k, k], the frontier (node indices) [B, k], the depths."""
    b, h = feedback.shape
    ancestors = torch.eye(k, dtype=torch.bool, device=feedback.device).expand(b, k, k)
    frontier = torch.arange(k, device=feedback.device).expand(b, k)
    return feedback[:, None, :].expand(b, k, h), ancestors, frontier, [1] * k


def _grown(ancestors: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """ancestors [B, n, n] (node i sees node j) and the k new nodes' parents [B, k] -> [B, n + k, n + k]: a new
    node sees what its parent sees, and itself."""
    b, n, _ = ancestors.shape
    k = parent.shape[1]
    grown = torch.zeros(b, n + k, n + k, dtype=torch.bool, device=ancestors.device)
    grown[:, :n, :n] = ancestors
    grown[:, n:, :n] = ancestors.gather(1, parent[:, :, None].expand(b, k, n))
    grown[:, n:, n:] = torch.eye(k, dtype=torch.bool, device=ancestors.device)
    return grown


def _scatter(tokens: torch.Tensor, live: list[int], size: int) -> torch.Tensor:
    """``tokens`` [len(live)] placed at ``live`` in a [size] row (-1 elsewhere: requests done drafting)."""
    out = tokens.new_full((size,), -1)
    out[_index(live, tokens.device)] = tokens
    return out


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _asked(work: list[_Row]) -> list[tuple[int, int]]:
    return [(w.chunk, w.drafts) for w in work]


def drawn_tree(token_ids: list[float], parents: list[float], ok: list[float], n: int) -> tuple[list[int], Drafted]:
    """A tree drawn from q (host lists: each node's token, parent (-1: the root) and whether its token has mass
    under the q it was drawn from, parents before children) -> its first ``n`` nodes that have mass and whose parent
    is kept (a node past a q's support, a top-k or top-p cut, is dropped with its subtree), as (their indices in the
    drawn tree, the tree they make, without scores: what was drawn must not size what is verified)."""
    keep: list[int] = []
    index: dict[int, int] = {}  # drawn node -> kept node
    for node, (parent, good) in enumerate(zip(parents, ok)):
        if len(keep) == n:
            break
        if good and (parent < 0 or int(parent) in index):
            index[node] = len(keep)
            keep.append(node)
    return keep, Drafted([int(token_ids[node]) for node in keep],
                         [-1 if parents[node] < 0 else index[int(parents[node])] for node in keep])


def prefix_tree(beams: list[list[float]], log_probs: list[list[float]], n: int) -> Drafted:
    """One request's beams (token ids and each token's log q given the beam before it: ReDrafter's beams, an MLP
    speculator's candidates) merged into a prefix tree; its best ``n`` nodes by path log-probability, parents first
    (ties by depth, then the order found), with parents and each node's q given its parent."""
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


def tree_rows(nodes: list[int]) -> list[int]:
    """The verification rows of the tree of a drawn tree's ``nodes``: the root's (0), then each node's (index + 1)."""
    return [0] + [node + 1 for node in nodes]


def rows_of_last_tokens(plan: StepPlan, kept: dict[int, list[int]], paths: dict[int, list[int]]
                        ) -> list[tuple[int, int]]:
    """For the drafters that read one row per request (Medusa, ReDrafter): per chunk that asks for drafts and
    committed tokens, (its index in the plan, the step's hidden row whose logits gave the token it just sampled: its
    last accepted draft node's, or its last real token's)."""
    out, offset = [], 0
    for i, chunk in enumerate(plan.chunks):
        base, offset = offset, offset + chunk.num_tokens
        if not (chunk.sample and chunk.num_next_drafts and kept.get(i)):
            continue
        real = chunk.num_tokens - chunk.num_draft_tokens
        nodes = paths.get(i) or list(range(len(kept[i]) - 1))  # the accepted drafts' node indices
        out.append((i, base + real + nodes[-1] if nodes else base + real - 1))
    return out


def check_tree_width(name: str, width: int, vocab: int) -> None:
    """A tree option that asks a node for more of its best tokens than the head's vocabulary holds (they would fail
    every step's top-k, costing every request its drafts): a ValueError naming ``speculative_config.<name>``."""
    if width > vocab:
        raise ValueError(f"speculative_config.{name} asks a node for its {width} best tokens but the head drafts "
                         f"from a vocabulary of {vocab}: give at most {vocab} per node (ranks 0..{vocab - 1})")


def tree_shape_of(config: dict) -> TreeShape | StaticShape | None:
    """The tree a worker drafter's plain-data config asks for: EAGLE-2's dynamic one, a static one (None: chains)."""
    if config.get("static_tree") is not None:
        return StaticShape(config["static_tree"])
    tree = config.get("tree")
    return None if tree is None else TreeShape(*tree)


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



def shared_stream_seed(seed: int, req_id: str) -> int:
    """The seed of an unseeded request's draft stream on the ranks of a split head: the same on every rank (from the
    engine's ``seed`` and the request's id, never the process's RNG, which only the driver's sampling draws on) and
    apart for every request."""
    digest = hashlib.blake2b(f"{seed}:{req_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def load_head(config: dict, target, target_config, tp: TPGroup | None = None) -> DraftHead:
    """The head a worker drafter's plain-data ``config`` names (on the driver rank; with ``tp``, this rank's share
    of it on every rank), packed for the CPU kernels where they apply."""
    from specray.models.cpu_kernels import can_pack, pack_linear_weights
    from specray.models.draft_head_loader import load_draft_head

    head = load_draft_head(config["method"], config["model"], target, target_config,
                           feedback_normed=bool(config.get("mtp_feedback_normed", False)),
                           num_modules=int(config.get("mtp_modules", 1)), tp=tp,
                           expert_parallel=tp is not None and bool(config.get("expert_parallel", False)),
                           head_config=config.get("head_config"))
    if can_pack(head.device.type, str(head.dtype).removeprefix("torch.")):
        pack_linear_weights(head)  # the CPU kernels' layout, as the target's (specray.models.cpu_kernels)
    return head
