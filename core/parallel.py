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
