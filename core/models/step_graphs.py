"""Forward passes of decode steps replayed from CUDA graphs (vLLM's and SGLang's cure for a host-bound step).

On a GPU a small model's step is bound by the host: Python dispatches every op of every layer, and the GPU waits.
A CUDA graph records one step's kernels once and replays them with one launch. A graph fixes every shape and
every tensor it reads, so a step is padded to a *shape*: ``B`` sequences (the batch), ``Q`` rows each (the step's
most tokens of one sequence: plain decoding's 1, or the most drafts + 1) and ``nb`` context blocks each, all three
rounded up to powers of two. Each shape gets static input tensors (token ids, positions, slots, the blocks to
gather, the masks) and its graph, captured the first time the shape occurs; a later step of that shape copies its
inputs into them and replays.

Padding: a sequence with fewer than ``Q`` tokens gets padding tokens after its own, at the next positions, whose
K/V land in its own slots past its tokens (never attended: a row sees positions up to its own, and those slots
are rewritten before any row reaches them, as rejected drafts' are) or, past its blocks, in scratch blocks that
the runner allocates past the block manager's and no request owns. Padding sequences (token 0 at positions
0 .. Q-1) write only the scratch blocks. Padding rows' outputs are dropped; padding blocks of the gathered context
point at the sequence's first block and are masked out, as in the eager padded path.

Linear-attention layers (Gated DeltaNet: Qwen3.5, Qwen3-Next) replay too: the runner hands each step's state slots,
replays and draft counts over as one more static input (:class:`~specray.models.gated_deltanet.RecurrentGraphBatch`)
and the layer runs its fixed-shape recurrence on it; padding sequences start from zeros in a scratch state slot no
request owns, as their rows write scratch blocks. A step with token trees adds each row's parent row to that input
and replays graphs of its own (keyed by the shape and "tree"): the layer runs the recurrence's tree form. Chains'
graphs were captured on an H200 (the suite's tests); trees' are checked on CPU only.

Which steps qualify (the rest run eagerly): decode steps, every sequence bringing its last token and its drafts
(at most ``GRAPH_QUERY_MAX`` tokens, and at most ``GRAPH_ROWS_MAX`` rows in all once padded), as a chain or a token
tree (a tree's positions and ancestor masks are data the graph reads: its static positions and masks), over paged or latent attention (DeepSeek's: a graph step's rows are
all short, so they attend in the absorbed form); experts take their sync-free grouped path
(:func:`~specray.models.moe.sync_free_experts`, on in every forward here) where it has no host sync (on CUDA: bf16 on
compute capability 9.x or 10.x, never run on a GPU yet; :meth:`~specray.models.moe.SparseMoE.graph_blocker`); one
rank, or several when asked for (:func:`why_eager`). A hidden-state drafter's residual streams are outputs of the
graph beside the hidden states (its head's passes replay graphs of their own: :class:`HeadStepGraphs`). On CPU the
same static tensors are filled and the model runs on them eagerly, with no graph: what the suite checks (outputs
equal to the eager path's, and no host sync in the forward, which a capture would refuse).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from specray.models.attention import AttentionMetadata, build_attention_metadata
from specray.models.gated_deltanet import RecurrentGraphBatch
from specray.models.moe import sync_free_experts

logger = logging.getLogger(__name__)
# one capture at a time in a process: capturing synchronizes the device and empties the allocator's cache, which
# another thread's capture must not see (a drafter's graphs and the target's, in pipelined or async steps)
_CAPTURE_LOCK = threading.Lock()
# the most tokens of one sequence a graph step pads to (a wide token tree's: Medusa's 63 nodes and the sampled token,
# EAGLE-2's 60 tokens, lookahead decoding's window and n-grams), past the eager path's short queries
# (attention.SHORT_QUERY_MAX), and the most rows of a graph step once padded (batch x tokens): larger steps run
# eagerly, as prefills do, so the graphs' shared pool never holds more rows' activations than that
GRAPH_QUERY_MAX = 128
GRAPH_ROWS_MAX = 8192


def graphs_wanted(enforce_eager: bool | None, device: torch.device) -> bool:
    """``enforce_eager`` (vLLM's): False asks for graphs anywhere (on a CPU, the padded static inputs run eagerly:
    for tests); None, on a GPU only; True, never."""
    return enforce_eager is False or (enforce_eager is None and device.type == "cuda")


def why_eager(model: torch.nn.Module, num_ranks: int, asked: bool = False) -> str | None:
    """None when ``model``'s passes can replay graphs, else why they run eagerly (a layer that cannot be captured,
    or several ranks when graphs were not asked for). Over several ranks each rank captures graphs of its own share,
    in lockstep (every rank picks a step's shape from the same plan), with the model's collectives inside them:
    NCCL's can be captured, but ours never have been, so they replay only when asked for (``asked``:
    enforce_eager=False)."""
    if num_ranks > 1 and not asked:
        return (f"graphs replay at one rank unless asked for (enforce_eager=False), and it is split over {num_ranks} "
                "ranks (their collectives have never been captured in a CUDA graph here)")
    return graph_safe(model)


def graph_safe(model: torch.nn.Module) -> str | None:
    """None when ``model``'s forward can be captured, else why not."""
    for module in model.modules():
        blocker = getattr(module, "graph_blocker", None)  # the experts' grouped path; a family's own reason
        if blocker is not None and (why := blocker()) is not None:
            return f"the model cannot be captured: {why}"
        # a GatedDeltaNet layer is captured: on a graph step it runs its fixed-shape recurrence, reading each
        # sequence's slots, replays and drafts as data (a RecurrentGraphBatch the runner hands over, a static input)
    return None


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class StepShape(NamedTuple):
    """A step's padded shape, the key of its graph."""

    batch: int  # sequences, padding included
    query_len: int  # new tokens per sequence
    ctx_blocks: int  # context blocks gathered per sequence


@dataclass
class _Graph:
    meta: AttentionMetadata  # the static inputs: every tensor a graph reads
    input_ids: torch.Tensor  # [B*Q]
    hidden: torch.Tensor  # [B*Q, H]: the output, overwritten by each replay
    aux: list[torch.Tensor]  # [B*Q, H] each: the residual stream entering each of the drafter's aux layers
    graph: object | None  # torch.cuda.CUDAGraph; None on CPU (the model runs eagerly on the static inputs)
    inputs: list[torch.Tensor] = field(default_factory=list)  # [B*Q, ...] each: rows beside the ids (a head's feedback)


class StepGraphs:
    """The runner's graphs, one per step shape. ``scratch_blocks``: block ids no request owns, for padding rows."""

    def __init__(self, model: torch.nn.Module, block_size: int, scratch_blocks: list[int], device: torch.device,
                 aux_layers: tuple[int, ...] = (), max_position: int | None = None, lora=None):
        self.model = model
        # the model's LoRA context (specray.models.lora): each row's adapter slot is the step's one input beside the
        # ids, padding rows in slot 0 (no adapter)
        self.lora = lora
        # every position the model allows: the static inputs' RoPE tables are sized for it once
        self.max_position = model.max_position_embeddings if max_position is None else max_position
        self.aux_layers = tuple(aux_layers)  # a hidden-state drafter's: its residual streams are outputs too
        self.block_size = block_size
        self.scratch = scratch_blocks
        self.device = device
        self.capture = device.type == "cuda"
        self._recorder = _Recorder(device)
        self.graphs: dict[StepShape, _Graph] = {}

    @staticmethod
    def scratch_blocks_needed(block_size: int) -> int:
        return -(-GRAPH_QUERY_MAX // block_size)

    def shape(self, query_lens: list[int], start_positions: list[int], decode: bool,
              min_rows: int = 1) -> StepShape | None:
        """The padded shape of a step, or None when it runs eagerly. ``decode``: every sequence brings its last token
        and its drafts (a head's pass: the tokens just committed, a tree level's nodes), no prompt (prefills, of every
        length, stay eager, as in vLLM; a drafter's pass over at most ``SHORT_QUERY_MAX`` tokens of each request counts
        as a decode's, prompt or not). ``min_rows``: the fewest rows per sequence (a hybrid model's replays of accepted
        drafts take as many rows of its fixed-shape recurrence as the step has: one more than the most replays)."""
        q = _bucket(max(*query_lens, min_rows))  # a power of two, as GRAPH_QUERY_MAX is: fewer shapes as K varies
        batch = _bucket(len(query_lens))
        if not decode or q > GRAPH_QUERY_MAX or batch * q > GRAPH_ROWS_MAX:
            return None
        blocks = max(-(-(s + q) // self.block_size) for s in start_positions)
        return StepShape(batch, q, _bucket(blocks))

    def run(self, shape: StepShape, token_ids: list[int] | torch.Tensor, query_lens: list[int],
            start_positions: list[int], block_tables: list[list[int]], inputs: tuple[torch.Tensor, ...] = (),
            positions: list[int] | None = None, ancestors: list[torch.Tensor | None] | None = None,
            recurrent: RecurrentGraphBatch | None = None, rope_positions: list[list[int]] | None = None
            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The step's hidden states [T, H], T = sum(query_lens), and the aux layers' residual streams (a subclass's
        outputs: see :meth:`_forward`). ``token_ids``: a list, or a tensor on the device (scattered to its padded rows
        there). ``inputs``: rows beside the ids ([T, ...] each; a head's features), laid out
        with the ids' padding (zero rows). ``positions`` and ``ancestors``: a step of token trees (as
        :func:`~specray.models.attention.build_attention_metadata` takes them); a graph reads them as data (the
        positions and the masks are static inputs), so trees and chains share graphs. ``recurrent``: a hybrid
        model's state slots and replays, padded to ``shape.batch`` sequences (a static input too).
        ``rope_positions``: multimodal RoPE's three position ids of each of the step's tokens (a static input of a
        graph of its own, apart from the shape's plain one; padding rows at position 0)."""
        q, pads = shape.query_len, shape.batch - len(query_lens)
        # every sequence brings q rows, its own tokens first (see the module docstring for where padding goes)
        real = [b * q + j for b, n in enumerate(query_lens) for j in range(n)]
        index = torch.tensor(real, dtype=torch.long, device=self.device) if len(real) < shape.batch * q else None
        if isinstance(token_ids, torch.Tensor):  # each real row to its padded place (a device-side scatter: no sync)
            ids = token_ids if index is None else token_ids.new_zeros(shape.batch * q).index_copy_(0, index, token_ids)
        else:
            ids = torch.tensor(_padded_rows(token_ids, query_lens, q, pads), dtype=torch.long, device=self.device)
        if inputs and index is not None:
            inputs = tuple(x.new_zeros(shape.batch * q, *x.shape[1:]).index_copy_(0, index, x) for x in inputs)
        if ancestors is not None:
            positions, ancestors = _padded_tree(query_lens, start_positions, positions, ancestors, q, pads)
        meta = build_attention_metadata(
            [q] * shape.batch, start_positions + [0] * pads,
            [table + self.scratch for table in block_tables] + [self.scratch] * pads, self.block_size,
            self.device, positions=positions, ancestors=ancestors, min_ctx_blocks=shape.ctx_blocks,
            read_in_place=False, short_max=GRAPH_QUERY_MAX)
        meta.recurrent = recurrent
        tags = ()  # graphs apart from the shape's plain one: more static inputs, or another form of a layer
        if rope_positions is not None:
            rows = [_padded_rows(axis, query_lens, q, pads) for axis in rope_positions]
            meta.rope_positions = torch.tensor(rows, dtype=torch.long, device=self.device)
            tags += ("rope",)
        if recurrent is not None and recurrent.trees:  # the recurrence's tree form (each row from its parent's)
            tags += ("tree",)
        key: StepShape | tuple = (shape, *tags) if tags else shape
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(meta, ids, inputs)  # its warm-up ran this step
        else:
            self._load(graph, meta, ids, inputs)
            if graph.graph is not None:
                graph.graph.replay()
            else:
                hidden, aux = self._step(graph.input_ids, graph.meta, graph.inputs)
                for out, value in zip([graph.hidden, *graph.aux], [hidden, *aux]):
                    out.copy_(value)
        if index is None:
            return graph.hidden, list(graph.aux)
        return graph.hidden.index_select(0, index), [a.index_select(0, index) for a in graph.aux]

    def _step(self, input_ids: torch.Tensor, meta: AttentionMetadata, inputs: list[torch.Tensor]
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """:meth:`_forward` with the experts on their sync-free path (what a capture records, and its CPU stand-in)."""
        with sync_free_experts():
            return self._forward(input_ids, meta, inputs)

    def _forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, inputs: list[torch.Tensor]
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self.lora is not None:
            self.lora.set_token_slots(inputs[0])
        if self.aux_layers:
            return self.model(input_ids, meta, aux_layers=self.aux_layers)
        return self.model(input_ids, meta), []

    def _static(self, meta: AttentionMetadata) -> AttentionMetadata:
        """A copy of ``meta`` whose tensors are the graph's own; its masks are made by the first forward on it.
        ``max_position`` covers every position the model allows and padding past it, so the RoPE tables never
        grow inside a graph."""
        short = meta.short
        assert short is not None and short.token_index is None and not meta.own, "every sequence short, q rows each"
        return replace(meta, positions=meta.positions.clone(), slot_mapping=meta.slot_mapping.clone(),
                       max_position=self.max_position - 1 + GRAPH_QUERY_MAX,
                       _masks={}, _builders={},
                       short=replace(short, block_index=short.block_index.clone(),
                                     query_positions=short.query_positions.clone()),
                       recurrent=None if meta.recurrent is None else meta.recurrent.clone(),
                       rope_positions=None if meta.rope_positions is None else meta.rope_positions.clone())

    @staticmethod
    def _own_masks(static: AttentionMetadata) -> None:
        """Give the masks the first forward made storage of their own (a folded mask is an expanded view, which
        cannot be copied into)."""
        static._masks = {key: mask.clone(memory_format=torch.contiguous_format)
                         for key, mask in static._masks.items()}

    def _load(self, graph: _Graph, meta: AttentionMetadata, ids: torch.Tensor, inputs=()) -> None:
        """Copy this step's inputs into the graph's static tensors (device-side copies: no host sync)."""
        static = graph.meta
        graph.input_ids.copy_(ids)
        for held, value in zip(graph.inputs, inputs):
            held.copy_(value)
        static.positions.copy_(meta.positions)
        static.slot_mapping.copy_(meta.slot_mapping)
        static.short.block_index.copy_(meta.short.block_index)
        static.short.query_positions.copy_(meta.short.query_positions)
        if static.recurrent is not None:
            static.recurrent.copy_(meta.recurrent)
        if static.rope_positions is not None:
            static.rope_positions.copy_(meta.rope_positions)
        for key, held in static._masks.items():  # the masks (and position biases) the first forward made
            held.copy_(static._builders[key](meta))

    def _capture(self, meta: AttentionMetadata, ids: torch.Tensor, inputs=()) -> _Graph:
        static = self._static(meta)
        input_ids = ids.clone()
        held = [x.clone() for x in inputs]
        if not self.capture:
            hidden, aux = self._step(input_ids, static, held)
            self._own_masks(static)
            graph = _Graph(static, input_ids, hidden, aux, None, held)
            self._load(graph, meta, ids, inputs)  # the masks the forward just made, from this step's values
            return graph
        logger.info("capturing a CUDA graph of %s for %d sequences x %d tokens, %d context blocks each",
                    type(self.model).__name__, meta.num_seqs, meta.short.max_query_len, meta.short.num_ctx_blocks)
        cuda_graph, (hidden, aux) = self._recorder.record(lambda: self._step(input_ids, static, held),
                                                          lambda: self._own_masks(static))
        graph = _Graph(static, input_ids, hidden, aux, cuda_graph, held)
        self._load(graph, meta, ids, inputs)
        cuda_graph.replay()
        return graph


class _Recorder:
    """Records CUDA graphs on a stream of its own (torch's default capture stream is one per process, and a drafter's
    graphs may be captured while the target's are, in another thread: pipelined or async steps), every graph in one
    memory pool (they never run at once), one capture at a time in the process."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = None
        self.pool = None

    def record(self, step, between=None):
        """Run ``step`` twice off the capture (lazy inits happen there; ``between`` after the first: a graph's masks
        given storage of their own), then record it: (the graph, what the recorded ``step`` returned: its outputs,
        which each replay overwrites)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        stream = self.stream
        with _CAPTURE_LOCK:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                step()
                if between is not None:
                    between()
                step()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                out = step()
        return cuda_graph, out


class FunctionGraphs:
    """A drafter's pass that reads no cache (ReDrafter's beam search, Medusa's heads) replayed from graphs: ``fn``
    takes tensors of B rows each and returns a tuple of tensors of B rows each; one graph per batch padded to a power
    of two, the inputs' rows copied into its static tensors (padding rows zero) and the outputs' first B rows returned
    (views of its static outputs, which its next replay overwrites). On CPU ``fn`` runs eagerly on the static inputs,
    as :class:`StepGraphs`' stand-in does."""

    def __init__(self, fn, device: torch.device):
        self.fn, self.device = fn, device
        self.capture = device.type == "cuda"
        self._recorder = _Recorder(device)
        self.graphs: dict[int, tuple[list[torch.Tensor], tuple[torch.Tensor, ...], object | None]] = {}

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b = inputs[0].shape[0]
        batch = _bucket(b)
        held = self.graphs.get(batch)
        if held is None:
            static = [x.new_zeros(batch, *x.shape[1:]) for x in inputs]
            for into, x in zip(static, inputs):
                into[:b].copy_(x)
            if self.capture:
                logger.info("capturing a CUDA graph of %s for %d rows", getattr(self.fn, "__qualname__", "a pass"),
                            batch)
                graph, outs = self._recorder.record(lambda: self.fn(*static))
                graph.replay()
            else:
                graph, outs = None, self.fn(*static)
            self.graphs[batch] = (static, outs, graph)
        else:
            static, outs, graph = held
            for into, x in zip(static, inputs):
                into[:b].copy_(x)
                into[b:].zero_()
            if graph is not None:
                graph.replay()
            else:
                for out, value in zip(outs, self.fn(*static)):
                    out.copy_(value)
        return tuple(out[:b] for out in outs)


def _padded_rows(values: list[int], query_lens: list[int], q: int, pads: int) -> list[int]:
    """One value per token, each sequence's padded to ``q`` rows and ``pads`` padding sequences after them (zeros)."""
    padded, offset = [], 0
    for n in query_lens:
        padded += values[offset: offset + n] + [0] * (q - n)
        offset += n
    return padded + [0] * (pads * q)


def _padded_tree(query_lens: list[int], starts: list[int], positions: list[int],
                 ancestors: list[torch.Tensor | None], q: int, pads: int
                 ) -> tuple[list[int], list[torch.Tensor | None]]:
    """A tree step's positions and ancestor masks with every sequence's rows padded to ``q`` and ``pads`` padding
    sequences: a padding row sits at its slot index and sees what the sequence's last row sees, and itself; no real
    row sees a padding row."""
    out_pos, out_anc, offset = [], [], 0
    for n, start, anc in zip(query_lens, starts, ancestors):
        out_pos += positions[offset: offset + n] + list(range(start + n, start + q))
        offset += n
        if anc is None or n == q:
            out_anc.append(anc)
            continue
        mask = anc.new_zeros(q, q)  # where the mask lies (a draft head's trees: on the device)
        mask[:n, :n] = anc
        mask[n:, :n] = anc[n - 1]
        mask[range(n, q), range(n, q)] = True
        out_anc.append(mask)
    return out_pos + list(range(q)) * pads, out_anc + [None] * pads


class HeadStepGraphs(StepGraphs):
    """A hidden-state draft head's passes replayed from graphs, as the target's decode steps are: each request
    brings its tokens (a chain step's one draft; a decode's first pass, the tokens the target just committed) and a
    feature row for each (the head's feedback, or the target's fused features), the head's KV cache has scratch
    blocks of its own for padding, and the graph's outputs are the feedback for the next step and the normed rows
    the drafts are picked from (``run`` returns them as (feedback, [normed])). A tree's levels (EAGLE-2's, a static
    tree's: one pass over every node so far) replay the same graphs, their positions and ancestor masks loaded as
    data, unless the head's trees take the host's help (``graph_trees`` False: DeepSeek-V4's MTP block). Passes over
    more than ``GRAPH_QUERY_MAX`` tokens of one request (a long prompt's) run eagerly."""

    def __init__(self, head: torch.nn.Module, block_size: int, scratch_blocks: list[int], device: torch.device,
                 max_position: int):
        super().__init__(head, block_size, scratch_blocks, device, max_position=max_position)

    def _forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, inputs: list[torch.Tensor]
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        feedback, normed = self.model(input_ids, inputs[0], meta)
        return feedback, [normed]
