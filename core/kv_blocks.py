"""The paged KV cache's block pool: fixed-size blocks, handed out so that each table stays contiguous.
Torch-free and below both of its users (the scheduler's pool, and a draft model's own cache).

It works on anything with a ``block_ids`` list (a scheduler :class:`~specray.scheduler.request.Request`, or a
drafter's own per-request state): slot ``p`` of a request lives in block ``block_ids[p // block_size]``.
A table only grows at its end (``allocate``) and shrinks at its end (``rewind``, ``free``).

Placement: a table whose blocks are consecutive lets attention read its context as one view of the cache rather
than gathering it block by block (much the larger part of a step's attention at long contexts on CPU). So a table
grows into the block right after its last one whenever that block is free. Otherwise (a new table, or its
neighbour is taken) it starts a new run in the largest free gap: at the gap's start when no table ends just
before the gap, else half way in, leaving that table room to grow. Which blocks are free is one byte each, so
finding the next occupied block or the free gaps runs in C (``bytearray.find``, ``re``).
"""

from __future__ import annotations

import re

_FREE_RUN = re.compile(rb"\x01+")


def slots_of(block_table: list[int], positions: range | list[int], block_size: int) -> list[int]:
    """The slots of a sequence's slot indices ``positions`` through its block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} must be an int >= 1; give the KV cache at least one block")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be an int >= 1 (tokens per KV block, e.g. 16)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._is_free = bytearray(b"\x01") * num_blocks
        self._num_free = num_blocks
        self._tails: set[int] = set()  # the last block of every non-empty table

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def blocks_for(self, num_slots: int) -> int:
        """Blocks needed to hold ``num_slots`` token slots."""
        return -(-num_slots // self.block_size)

    def can_fit(self, req, num_slots: int) -> bool:
        """Whether ``req``'s table can be grown to cover ``num_slots`` slots from the free blocks."""
        return self.blocks_for(num_slots) - len(req.block_ids) <= self._num_free

    def allocate(self, req, num_slots: int) -> None:
        """Grow ``req.block_ids`` to cover ``num_slots`` slots (a no-op if it already does)."""
        need = self.blocks_for(num_slots) - len(req.block_ids)
        assert need <= self._num_free, f"allocate({num_slots} slots) needs {need} blocks, {self._num_free} free"
        if need <= 0:
            return
        table = req.block_ids
        self._tails.discard(table[-1] if table else -1)
        while need > 0:
            start, length = self._extension(table[-1] + 1) if table else (0, 0)
            if length == 0:
                start, length = self._new_run(need)
            taken = min(need, length)
            self._is_free[start : start + taken] = bytes(taken)
            table.extend(range(start, start + taken))
            self._num_free -= taken
            need -= taken
        self._tails.add(table[-1])

    def rewind(self, req, num_tokens: int) -> None:
        """Free every block wholly beyond the first ``num_tokens`` slots: a block goes back to the pool as soon
        as no valid token is left in it."""
        keep = self.blocks_for(num_tokens)
        table = req.block_ids
        if keep >= len(table):
            return
        self._tails.discard(table[-1])
        for block_id in table[keep:]:
            assert not self._is_free[block_id], f"double free of KV block {block_id}"
            self._is_free[block_id] = 1
        self._num_free += len(table) - keep
        del table[keep:]
        if table:
            self._tails.add(table[-1])

    def free(self, req) -> None:
        self.rewind(req, 0)

    def _extension(self, block_id: int) -> tuple[int, int]:
        """(block_id, free blocks from it up to the next taken one); length 0 if it is taken or past the end."""
        if block_id >= self.num_blocks or not self._is_free[block_id]:
            return block_id, 0
        end = self._is_free.find(0, block_id)
        return block_id, (self.num_blocks if end < 0 else end) - block_id

    def _new_run(self, need: int) -> tuple[int, int]:
        """Where a new run of up to ``need`` blocks starts, and how many free blocks follow: in the largest gap;
        half way into it if a table ends right before it (capped so that ``need`` blocks still fit)."""
        gap = max(_FREE_RUN.finditer(self._is_free), key=lambda m: m.end() - m.start())
        start, end = gap.span()
        if start - 1 in self._tails:
            start += max(0, min((end - start) // 2, end - start - need))
        return start, end - start
