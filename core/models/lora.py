"""LoRA on the tensor-parallel linears: every adapter of a step in a few matmuls per projection, no host sync.

Each adaptable projection keeps its adapters' matrices stacked over ``L = max_loras`` slots, padded to rank
``r = max_lora_rank``. For a projection of P merged parts (q/k/v: 3, gate/up: 2, else 1): ``a`` [P*L*r, in], its
rows ordered (part, slot, rank), and per part ``b_p`` [out_p, L*r], scaled by the adapter's ``s``. For rows ``x``
whose tokens belong to slots ``z`` (0: no adapter) part p of the projection's output gains

    delta_p = ((x a_p^T) * M) b_p^T,    M[t, c] = 1 if column c belongs to slot z[t], else 0

which is ``s (x A_p^T) B_p^T`` with each row's own adapter (zero rows of A and B past an adapter's rank add
nothing). Its cost grows with ``L * r``, not with the adapters a step uses: each row computes every slot's columns
and the mask keeps its own. Tensor parallelism splits ``b_p``'s output rows as the column-parallel weight is split
(``a`` whole on every rank), and ``a``'s input columns as a row-parallel weight is (``b`` whole, the delta added to
the rank's partial sum before the all-reduce). The token slots ``z`` are data, so a step of any adapters replays
the same CUDA graph (the graph reads them as a static input).

:class:`LoRASlots` (one per rank, the runner's) loads an adapter's tensors into a free slot when a step first needs
it, keeping ``max_cpu_loras`` adapters' tensors in host memory, least recently used out first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch

from specray.lora import (AdapterInfo, LoRAConfig, LoRARequest, module_of, of_other_tower, read_adapter,
                          weights_file)
from specray.models.gated_deltanet import FusedColumnLinear
from specray.models.layers import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear, QKVParallelLinear,
                                   RowParallelLinear, linear, other_stage_prefixes)
from specray.models.llama import unfuse

logger = logging.getLogger(__name__)


class LoRAContext:
    """What every LoRA projection of one model reads in a forward: each row's slot (0: none, 1..L), and the column
    mask made from them once per forward."""

    def __init__(self, config: LoRAConfig, dtype: torch.dtype, device: torch.device):
        self.num_slots = config.max_loras
        self.rank = config.max_lora_rank
        self.dtype = dtype
        self.device = device
        self.token_slots = torch.zeros(0, dtype=torch.long, device=device)
        self.active = False  # False: no row of the forward has an adapter, the projections add nothing
        self._mask: torch.Tensor | None = None
        self._columns = torch.arange(1, self.num_slots + 1, device=device).repeat_interleave(self.rank)  # [L*r]

    def set_token_slots(self, slots: torch.Tensor | None) -> None:
        """Each row's slot for the next forward ([T] int64 on the device); None: no row has an adapter (an eager
        forward then skips the adapters' matmuls; a graph always runs them, its slots being data)."""
        self.active = slots is not None
        self.token_slots = slots
        self._mask = None

    def mask(self, rows: int) -> torch.Tensor:
        # -> [rows, L*r]: 1 where the column's slot is the row's
        if self._mask is None:
            self._mask = (self.token_slots[:, None] == self._columns[None, :]).to(self.dtype)
        assert self._mask.shape[0] == rows, ("the token slots were set for another batch", self._mask.shape[0], rows)
        return self._mask


class LinearLoRA:
    """One projection's stacked adapters (see the module docstring): ``a`` [P*L*r, in] with its columns ordered
    (part, slot, rank), and per part ``b[p]`` [out_p, L*r], the part's own output rows only."""

    def __init__(self, module: LinearBase, context: LoRAContext, parts: list, part_rows: list[int]):
        self.module = module
        self.context = context
        self.parts = parts  # the merged parameter's shard ids (None: not merged)
        self.part_rows = part_rows  # this rank's output rows of each part, in order
        self.row_parallel = isinstance(module, RowParallelLinear)
        width = context.num_slots * context.rank
        in_features = module.in_local if self.row_parallel else module.in_features
        kw = dict(dtype=context.dtype, device=context.device)
        self.a = torch.zeros(len(parts) * width, in_features, **kw)
        self.b = [torch.zeros(rows, width, **kw) for rows in part_rows]

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        mask = self.context.mask(x.shape[0])  # [T, L*r]
        shrunk = linear(x, self.a)  # [T, P*L*r]
        if len(self.b) == 1:
            return linear(shrunk * mask, self.b[0])
        width = mask.shape[1]
        return torch.cat([linear(shrunk[:, p * width: (p + 1) * width] * mask, b) for p, b in enumerate(self.b)],
                         dim=-1)

    def _columns(self, slot: int) -> slice:
        r = self.context.rank
        return slice((slot - 1) * r, slot * r)

    def clear(self, slot: int) -> None:
        cols, width = self._columns(slot), self.context.num_slots * self.context.rank
        for p, b in enumerate(self.b):
            self.a[p * width + cols.start: p * width + cols.stop].zero_()
            b[:, cols].zero_()

    def set(self, slot: int, part_id, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> None:
        """Load one part's A [r', in] and B [out, r'] (checkpoint tensors, whole) into ``slot``: this rank's shard."""
        part = self.parts.index(part_id)
        cols, r = self._columns(slot), self.context.rank
        a_rows = slice(part * self.context.num_slots * r + cols.start, part * self.context.num_slots * r + cols.stop)
        a = torch.zeros(r, lora_a.shape[1], dtype=lora_a.dtype)
        a[: lora_a.shape[0]] = lora_a
        b = torch.zeros(lora_b.shape[0], r, dtype=lora_b.dtype)
        b[:, : lora_b.shape[1]] = lora_b * scale
        module = self.module
        if self.row_parallel:  # A's input columns as the weight's; B whole
            shard = torch.zeros(r, module.in_local, dtype=a.dtype)
            module.weight_loader(shard, a)
            self.a[a_rows] = shard.to(self.a.dtype)
            self.b[0][:, cols] = b.to(self.b[0].dtype)
            return
        # B's output rows as the weight's (the projection's own loader puts a merged part's rows in place); A whole
        shard = torch.zeros(sum(self.part_rows), r, dtype=b.dtype)
        if part_id is None:
            module.weight_loader(shard, b)
        else:
            module.weight_loader(shard, b, part_id)
        start = sum(self.part_rows[:part])
        self.a[a_rows] = a.to(self.a.dtype)
        self.b[part][:, cols] = shard[start: start + self.part_rows[part]].to(self.b[part].dtype)


def _parts(module: LinearBase) -> tuple[list, list[int]]:
    """A projection's merged parts (shard ids; [None]: not merged) and this rank's output rows of each."""
    if isinstance(module, QKVParallelLinear):  # (Gemma 4's k = v layers: q and k alone, ``lora_parts``)
        parts = list(getattr(module, "lora_parts", ("q", "k", "v")))
        return parts, [module.q_size if part == "q" else module.kv_size for part in parts]
    if isinstance(module, FusedColumnLinear):
        # one checkpoint tensor (in_proj_qkv), so one adapter: its B's rows split over the parts by the module's loader
        return [None], [sum(module.local_sizes)]
    if isinstance(module, MergedColumnParallelLinear):
        return list(range(len(module.output_sizes))), list(module.local_sizes)
    return [None], [module.out_features if isinstance(module, RowParallelLinear) else module.out_local]


def adapter_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Every projection of ``model`` (built whole: one rank) that takes LoRA, by its checkpoint name
    (``model.layers.0.self_attn.q_proj``), with its weight's shape (out, in): what an adapter's B and A must fit."""
    adaptable = set(adaptable_modules(model))
    stacked = getattr(model, "stacked", {})
    shapes = {}
    for name, module in model.named_modules():
        if not (isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and name.startswith("model.layers.")
                and ".experts." not in name):
            continue
        parent, _, leaf = name.rpartition(".")
        in_features = module.in_local if isinstance(module, RowParallelLinear) else module.in_features
        parts, rows = _parts(module)
        pieces = {part: piece.strip(".") for piece, (merged, part) in stacked.items() if merged.strip(".") == leaf}
        for part, out_features in zip(parts, rows):
            checkpoint = leaf if part is None else pieces.get(part)
            if checkpoint in adaptable:
                shapes[f"{parent}.{checkpoint}"] = (out_features, in_features)
        if f".{leaf}." in getattr(model, "fused", {}):  # a fused checkpoint's adapters adapt the parts at once
            shapes[f"{parent}.{leaf}"] = (sum(rows), in_features)
    shapes.update(getattr(model, "adapter_fusions", dict)())  # fused otherwise than by rows (Qwen3-Next's)
    shapes.update(_renamed_fusions(model, shapes))
    return shapes


def _renamed_fusions(model: torch.nn.Module, shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """A fused checkpoint projection whose parts the family renames (Granite's ``shared_mlp.input_linear``: its
    gate and up rows, named ``mlp.gate_proj`` and ``mlp.up_proj`` here), by its checkpoint name in each layer, with
    its parts' rows summed: found forward, each part's checkpoint name renamed as the weights are
    (``adapter_module``) and looked up among ``shapes``."""
    rename, fused = getattr(model, "adapter_module", None), getattr(model, "fused", {})
    found = {}
    for i in range(len(getattr(getattr(model, "model", None), "layers", ())) if rename is not None else 0):
        for piece, parts in fused.items():
            name = f"model.layers.{i}{piece}"[:-1]
            ours = [rename(f"model.layers.{i}{part}"[:-1]) for part, _ in parts]
            if name not in shapes and all(o in shapes for o in ours):
                found[name] = (sum(shapes[o][0] for o in ours), shapes[ours[0]][1])
    return found


def adaptable_modules(model: torch.nn.Module) -> tuple[str, ...]:
    """The checkpoint names of the projections ``model``'s class applies LoRA to (``q_proj``, ...): its
    ``lora_modules``; none for a family without them."""
    return tuple(getattr(model, "lora_modules", ()))


class LoRASlots:
    """One rank's adapters: the slots of its model's LoRA projections, which adapter holds each, and the
    adapters' tensors kept in host memory."""

    def __init__(self, model: torch.nn.Module, config: LoRAConfig, device: torch.device):
        self.model = model
        self.config = config
        self.device = device
        self.adaptable = adaptable_modules(model)
        if not self.adaptable:
            raise ValueError(f"enable_lora: {type(model).__name__} does not take LoRA adapters in specray yet; "
                             "serve this model without enable_lora")
        self.context = LoRAContext(config, model.dtype, device)
        self.stacked = getattr(model, "stacked", {})
        self.fused = getattr(model, "fused", {})  # a fused checkpoint's projections (Phi-3's qkv_proj, gate_up_proj)
        self.other_stage = other_stage_prefixes(model)  # layers of other pipeline stages, whose adapters they load
        self.layers: dict[str, LinearLoRA] = {}  # our module name -> its LoRA
        for name, module in model.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and self._adaptable(name):
                module.lora = self.layers[name] = LinearLoRA(module, self.context, *_parts(module))
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.host: OrderedDict[int, tuple[AdapterInfo, dict]] = OrderedDict()  # lora_int_id -> its tensors

    def _adaptable(self, name: str) -> bool:
        leaf = name.rsplit(".", 1)[-1]
        names = {leaf} | {piece.strip(".") for piece, (merged, _) in self.stacked.items() if merged.strip(".") == leaf}
        return name.startswith("model.layers.") and ".experts." not in name and bool(names & set(self.adaptable))

    def slots_for(self, requests: list[LoRARequest | None]) -> list[int]:
        """Each request's slot (0: none), loading the adapters this step needs that no slot holds."""
        wanted = {r.lora_int_id: r for r in requests if r is not None}
        assert len(wanted) <= self.config.max_loras, ("the scheduler let more adapters into a step than max_loras",
                                                       sorted(wanted))
        for lora_id in wanted:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
        for lora_id, request in wanted.items():
            if lora_id not in self.slot_of:
                self._load(request, self._free_slot(wanted))
        return [0 if r is None else self.slot_of[r.lora_int_id] for r in requests]

    def _free_slot(self, wanted: dict) -> int:
        used = set(self.slot_of.values())
        for slot in range(1, self.config.max_loras + 1):
            if slot not in used:
                return slot
        victim = next(i for i in self.slot_of if i not in wanted)  # least recently used, not needed now
        return self.slot_of.pop(victim)

    def _load(self, request: LoRARequest, slot: int) -> None:
        info, tensors = self._host_tensors(request)
        for lora in self.layers.values():
            lora.clear(slot)
        for module, (lora_a, lora_b) in tensors.items():
            if module.startswith(self.other_stage):
                continue
            split = getattr(self.model, "split_adapter", lambda *_: None)(module, lora_b)  # (Qwen3-Next's)
            rename = getattr(self.model, "adapter_module", lambda name: name)  # the checkpoint's names as ours
            fold = getattr(self.model, "fold_adapter", lambda name, b: b)  # (Falcon-H1's multipliers)
            for piece, b in split or unfuse(f"{module}.", lora_b, self.fused):  # a fused one's B: its parts', A shared
                target, part = self._target(rename(piece[:-1]))
                b = fold(piece[:-1], b)
                self.layers[target].set(slot, part, lora_a, b, info.scale(lora_a.shape[0]))
        self.slot_of[request.lora_int_id] = slot
        logger.info("loaded LoRA adapter %r (id %d) into slot %d", request.lora_name, request.lora_int_id, slot)

    def _target(self, module: str) -> tuple[str, object]:
        parent, _, leaf = module.rpartition(".")
        for piece, (merged, part) in self.stacked.items():
            if piece.strip(".") == leaf and f"{parent}.{merged.strip('.')}" in self.layers:
                return f"{parent}.{merged.strip('.')}", part
        if module in self.layers:
            return module, None
        raise ValueError(f"the LoRA adapter adapts {module!r}, which has no LoRA slot in {type(self.model).__name__}")

    def _host_tensors(self, request: LoRARequest) -> tuple[AdapterInfo, dict]:
        held = self.host.get(request.lora_int_id)
        if held is not None:
            self.host.move_to_end(request.lora_int_id)
            return held
        # the engine checked its modules and shapes against the whole model's when a request first named it
        info = read_adapter(request.lora_path, None, self.config.max_lora_rank)
        held = self.host[request.lora_int_id] = info, _read_pairs(weights_file(Path(info.path)))
        while len(self.host) > self.config.cpu_loras:
            self.host.popitem(last=False)
        return held


def _read_pairs(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (lora_A [r, in], lora_B [out, r]) from an adapter's weights file."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        state = load_file(str(path), device="cpu")
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        found = module_of(key)
        if found is None:
            raise ValueError(f"{path}: tensor {key!r} is not a LoRA matrix of a projection")
        if not of_other_tower(found[0]):
            pairs.setdefault(found[0], {})[found[1]] = tensor.float()
    return {module: (pair["A"], pair["B"]) for module, pair in pairs.items()}
