"""LoRA on the tensor-parallel linears: every adapter of a step in two matmuls per projection, no host sync.

Each adaptable projection keeps its adapters' matrices stacked over ``L = max_loras`` slots, padded to rank
``r = max_lora_rank``: ``a`` [L*P*r, in] and ``b`` [out, L*P*r] for a projection of P merged parts (q/k/v: 3,
gate/up: 2), the columns ordered (slot, part, rank), ``b`` already scaled by the adapter's ``s``. For rows ``x``
whose tokens belong to slots ``z`` (0: no adapter) the projection adds

    delta = ((x a^T) * M) b^T,    M[t, c] = 1 if column c belongs to slot z[t], else 0

which is ``s (x A^T) B^T`` with each row's own adapter (zero rows of A and B past an adapter's rank add nothing, and
a part's columns of ``b`` reach only that part's outputs). Tensor parallelism splits ``b``'s output rows as the
column-parallel weight is split (``a`` whole on every rank), and ``a``'s input columns as a row-parallel weight is
(``b`` whole, the delta added to the rank's partial sum before the all-reduce). The token slots ``z`` are data,
so a step of any adapters replays the same CUDA graph (the graph reads them as a static input).

:class:`LoRASlots` (one per rank, the runner's) loads an adapter's tensors into a free slot when a step first needs
it, keeping ``max_cpu_loras`` adapters' tensors in host memory, least recently used out first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch

from specray.lora import AdapterInfo, LoRAConfig, LoRARequest, module_of, read_adapter, weights_file
from specray.models.layers import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear, QKVParallelLinear,
                                   RowParallelLinear, linear)

logger = logging.getLogger(__name__)


class LoRAContext:
    """What every LoRA projection of one model reads in a forward: each row's slot (0: none, 1..L), and the column
    masks made from them once per forward (per part count)."""

    def __init__(self, config: LoRAConfig, dtype: torch.dtype, device: torch.device):
        self.num_slots = config.max_loras
        self.rank = config.max_lora_rank
        self.dtype = dtype
        self.device = device
        self.token_slots = torch.zeros(0, dtype=torch.long, device=device)
        self._masks: dict[int, torch.Tensor] = {}
        self._columns: dict[int, torch.Tensor] = {}

    def set_token_slots(self, slots: torch.Tensor) -> None:
        """Each row's slot for the next forward ([T] int64 on the device)."""
        self.token_slots = slots
        self._masks = {}

    def mask(self, parts: int, rows: int) -> torch.Tensor:
        # -> [rows, L*parts*r]: 1 where the column's slot is the row's
        mask = self._masks.get(parts)
        if mask is None:
            columns = self._columns.get(parts)
            if columns is None:
                columns = self._columns[parts] = torch.arange(
                    1, self.num_slots + 1, device=self.device).repeat_interleave(parts * self.rank)
            mask = self._masks[parts] = (self.token_slots[:, None] == columns[None, :]).to(self.dtype)
        assert mask.shape[0] == rows, ("the token slots were set for another batch", mask.shape[0], rows)
        return mask


class LinearLoRA:
    """One projection's stacked adapters (see the module docstring)."""

    def __init__(self, module: LinearBase, context: LoRAContext, parts: list):
        self.module = module
        self.context = context
        self.parts = parts  # the merged parameter's shard ids (None: not merged)
        self.row_parallel = isinstance(module, RowParallelLinear)
        slots, rank, width = context.num_slots, context.rank, len(parts) * context.rank
        in_features = module.in_local if self.row_parallel else module.in_features
        out_features = module.out_features if self.row_parallel else module.out_local
        kw = dict(dtype=context.dtype, device=context.device)
        self.a = torch.zeros(slots * width, in_features, **kw)
        self.b = torch.zeros(out_features, slots * width, **kw)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        shrunk = linear(x, self.a) * self.context.mask(len(self.parts), x.shape[0])
        return linear(shrunk, self.b)

    def _columns(self, slot: int, part: int) -> slice:
        r = self.context.rank
        start = ((slot - 1) * len(self.parts) + part) * r
        return slice(start, start + r)

    def clear(self, slot: int) -> None:
        for part in range(len(self.parts)):
            cols = self._columns(slot, part)
            self.a[cols].zero_()
            self.b[:, cols].zero_()

    def set(self, slot: int, part_id, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> None:
        """Load one part's A [r', in] and B [out, r'] (checkpoint tensors, whole) into ``slot``: this rank's shard."""
        part = self.parts.index(part_id)
        cols = self._columns(slot, part)
        rank = lora_a.shape[0]
        r = self.context.rank
        a = torch.zeros(r, lora_a.shape[1], dtype=lora_a.dtype)
        a[:rank] = lora_a
        b = torch.zeros(lora_b.shape[0], r, dtype=lora_b.dtype)
        b[:, :rank] = lora_b * scale
        module = self.module
        if self.row_parallel:  # A's input columns as the weight's; B whole
            shard = torch.zeros(r, module.in_local, dtype=a.dtype)
            module.weight_loader(shard, a)
            self.a[cols] = shard.to(self.a.dtype)
            self.b[:, cols] = b.to(self.b.dtype)
            return
        # B's output rows as the weight's (a merged part's rows only; the others stay zero); A whole
        shard = torch.zeros(self.b.shape[0], r, dtype=b.dtype)
        if part_id is None:
            module.weight_loader(shard, b)
        else:
            module.weight_loader(shard, b, part_id)
        self.a[cols] = a.to(self.a.dtype)
        self.b[:, cols] = shard.to(self.b.dtype)


def _parts(module: LinearBase) -> list:
    if isinstance(module, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(module, MergedColumnParallelLinear):
        return list(range(len(module.output_sizes)))
    return [None]


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
        self.layers: dict[str, LinearLoRA] = {}  # our module name -> its LoRA
        for name, module in model.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and self._adaptable(name):
                module.lora = self.layers[name] = LinearLoRA(module, self.context, _parts(module))
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
            target, part = self._target(module)
            self.layers[target].set(slot, part, lora_a, lora_b, info.scale(lora_a.shape[0]))
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
        num_layers = self.model.config.num_hidden_layers
        info = read_adapter(request.lora_path, self.adaptable, num_layers, self.config.max_lora_rank)
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
        pairs.setdefault(found[0], {})[found[1]] = tensor.float()
    return {module: (pair["A"], pair["B"]) for module, pair in pairs.items()}
