"""The paged KV cache's block pool: fixed-size blocks handed out from a free list.

It works on anything with a ``block_ids`` list (a scheduler :class:`~specray.scheduler.request.Request`, or a
drafter's own per-request state): slot ``p`` of a request lives in block ``block_ids[p // block_size]``.
A table only grows at its end (``allocate``) and shrinks at its end (``rewind``, ``free``).
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} must be an int >= 1; give the KV cache at least one block")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be an int >= 1 (tokens per KV block, e.g. 16)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_slots: int) -> int:
        """Blocks needed to hold ``num_slots`` token slots."""
        return -(-num_slots // self.block_size)

    def can_fit(self, req, num_slots: int) -> bool:
        """Whether ``req``'s table can be grown to cover ``num_slots`` slots from the free blocks."""
        return self.blocks_for(num_slots) - len(req.block_ids) <= len(self._free)

    def allocate(self, req, num_slots: int) -> None:
        """Grow ``req.block_ids`` to cover ``num_slots`` slots (a no-op if it already does)."""
        need = self.blocks_for(num_slots) - len(req.block_ids)
        assert need <= len(self._free), f"allocate({num_slots} slots) needs {need} blocks, {len(self._free)} free"
        for _ in range(need):
            block_id = self._free.popleft()
            self._is_free[block_id] = False
            req.block_ids.append(block_id)

    def rewind(self, req, num_tokens: int) -> None:
        """Free every block wholly beyond the first ``num_tokens`` slots: a block goes back to the pool as soon
        as no valid token is left in it."""
        keep = self.blocks_for(num_tokens)
        for block_id in reversed(req.block_ids[keep:]):
            self._release(block_id)
        del req.block_ids[keep:]

    def free(self, req) -> None:
        self.rewind(req, 0)

    def _release(self, block_id: int) -> None:
        assert not self._is_free[block_id], f"double free of KV block {block_id}"
        self._is_free[block_id] = True
        self._free.append(block_id)
