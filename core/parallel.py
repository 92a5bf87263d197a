"""Tensor-parallel process group: the collectives our layers need (sum all-reduce, all-gather) and the driver's
broadcast of a step's verdict to a sharded draft head.

Plain ``torch.distributed`` collectives, so gloo (CPU) and NCCL (GPU) both work. With ``size == 1`` every op is a
no-op and torch.distributed need not be initialized at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in a tensor-parallel group. ``group`` is a torch.distributed ProcessGroup (or None
    for the default group / a single rank)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TPGroup(rank={self.rank}, size={self.size}): need size >= 1 and 0 <= rank < size")

    @classmethod
    def single(cls) -> "TPGroup":
        return cls(0, 1, None)

    @classmethod
    def from_world(cls) -> "TPGroup":
        """The whole initialized default process group as one TP group."""
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("TPGroup.from_world() needs torch.distributed initialized first: call "
                             "torch.distributed.init_process_group(backend='gloo' or 'nccl', ...)")
        return cls(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (in place when distributed; returns ``x``)."""
        if self.size == 1:
            return x
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` becomes rank 0's (in place when distributed; returns ``x``)."""
        if self.size == 1:
            return x
        dist.broadcast(x, group=self.group, group_src=0)
        return x


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """The decoder layers pipeline stage ``stage`` of ``num_stages`` holds: an even share each, the layers left over
    one each to the stages just before the last (which also holds the final norm and the LM head)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"pipeline_parallel_size={num_stages} must be between 1 and the model's "
                         f"num_hidden_layers={num_layers} (each stage holds at least one layer)")
    base, extra = divmod(num_layers, num_stages)
    counts = [base + (num_stages - 1 - extra <= s < num_stages - 1) for s in range(num_stages)]
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


@dataclass(frozen=True)
class PPGroup:
    """This rank's place in a pipeline of ``size`` stages: each stage holds a contiguous run of the decoder layers
    (:func:`stage_layers`) over its own tensor-parallel group, and hands its output to the next stage's rank of the
    same tensor-parallel index (``next_rank``, a global rank; ``prev_rank`` is the one it receives from).
    ``last_stage_embeds``: the last stage holds the token embedding too (a draft head there embeds tokens)."""

    stage: int = 0
    size: int = 1
    prev_rank: int | None = None
    next_rank: int | None = None
    last_stage_embeds: bool = False

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.stage < self.size:
            raise ValueError(f"PPGroup(stage={self.stage}, size={self.size}): need size >= 1 and 0 <= stage < size")
        assert (self.prev_rank is None) == self.is_first and (self.next_rank is None) == self.is_last, self

    @classmethod
    def single(cls) -> "PPGroup":
        return cls()

    @classmethod
    def of_rank(cls, rank: int, tp_size: int, pp_size: int) -> "PPGroup":
        """Global rank ``rank`` of ``tp_size * pp_size``, numbered stage by stage (stage s holds ranks
        ``s * tp_size .. s * tp_size + tp_size - 1``)."""
        stage = rank // tp_size
        return cls(stage, pp_size, rank - tp_size if stage > 0 else None,
                   rank + tp_size if stage < pp_size - 1 else None)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    @property
    def holds_embedding(self) -> bool:
        return self.is_first or (self.is_last and self.last_stage_embeds)

    def layers(self, num_layers: int) -> range:
        return stage_layers(num_layers, self.stage, self.size)

    def send(self, x: torch.Tensor) -> None:
        """Hand ``x`` to the next stage (blocking until it is received or buffered)."""
        dist.send(x.contiguous(), dst=self.next_rank)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """What the previous stage sent: a tensor of ``shape`` and ``dtype``, which every rank knows from the step's
        plan."""
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, src=self.prev_rank)
        return x
