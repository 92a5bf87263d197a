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

Prefix caching (``enable_caching``, vLLM's automatic prefix caching): a block whose slots all hold committed tokens
is registered under its content, the exact key (the content id of the block before it, its tokens), so two requests
whose token lists agree on whole blocks share them (a reference count per block) and compute only the rest (requests
with a ``cache_salt`` only with those of the same salt: their chains start from it). A registered block whose count
falls to zero stays cached, out of the placement's way, until a table needs it: then the least recently freed cached
blocks are evicted first (the ends of freed tables before their starts), ahead of need so that a sixteenth of the
pool stays free, in runs for tables to grow into. Keys hold the tokens themselves rather than a hash of them, so no
two contents can collide, and a content id is never reused, so an evicted parent cannot make a stale child look like
a hit. A shared block is never written: a hit covers whole blocks of at most ``num_tokens - 1`` tokens (the last one
is always computed, for its logits), and every later write lands past it.
"""

from __future__ import annotations

import itertools
import re
from collections import OrderedDict
from collections.abc import Callable

_FREE_RUN = re.compile(rb"\x01+")


def slots_of(block_table: list[int], positions: range | list[int], block_size: int) -> list[int]:
    """The slots of a sequence's slot indices ``positions`` through its block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} must be an int >= 1; give the KV cache at least one block")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be an int >= 1 (tokens per KV block, e.g. 16)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._is_free = bytearray(b"\x01") * num_blocks
        self._num_free = num_blocks
        self._tails: set[int] = set()  # the last block of every non-empty table
        self.enable_caching = enable_caching
        self._refs = [0] * num_blocks  # how many tables hold each block
        # prefix caching: (parent content id, the block's tokens) -> (content id, block); each registered block's key
        self._cached: dict[tuple, tuple[int, int]] = {}
        self._key_of: dict[int, tuple] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks no table holds, oldest first
        self._content_ids = itertools.count(1)  # 0 is the root: the parent of a table's first block
        # free blocks kept in reserve by evicting cached ones ahead of need (a batch at a time, oldest first): with
        # none free, each table's growth would take a lone evicted block somewhere else, not the block after its end
        self._reserve = num_blocks // 16

    @property
    def num_free_blocks(self) -> int:
        """Blocks a table can take: the free ones and the cached ones no table holds (evicted when taken)."""
        return self._num_free + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, held by tables or not."""
        return len(self._key_of)

    def blocks_for(self, num_slots: int) -> int:
        """Blocks needed to hold ``num_slots`` token slots."""
        return -(-num_slots // self.block_size)

    def can_fit(self, req, num_slots: int) -> bool:
        """Whether ``req``'s table can be grown to cover ``num_slots`` slots from the free blocks."""
        return self.blocks_for(num_slots) - len(req.block_ids) <= self.num_free_blocks

    def allocate(self, req, num_slots: int) -> None:
        """Grow ``req.block_ids`` to cover ``num_slots`` slots (a no-op if it already does)."""
        need = self.blocks_for(num_slots) - len(req.block_ids)
        assert need <= self.num_free_blocks, f"allocate({num_slots} slots): {need} blocks, {self.num_free_blocks} free"
        if need <= 0:
            return
        short = need + self._reserve - self._num_free
        if short > 0 and self._evictable:  # old tables' blocks come free in runs, and growth finds room again
            self._evict(min(len(self._evictable), max(short, self._reserve)))
        table = req.block_ids
        self._tails.discard(table[-1] if table else -1)
        while need > 0:
            start, length = self._extension(table[-1] + 1) if table else (0, 0)
            if length == 0:
                start, length = self._new_run(need)
            taken = min(need, length)
            self._is_free[start : start + taken] = bytes(taken)
            self._refs[start : start + taken] = [1] * taken
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
        refs = self._refs
        for block_id in reversed(table[keep:]):  # the end first: evicted before the blocks that lead to it
            assert refs[block_id] > 0, f"double free of KV block {block_id}"
            refs[block_id] -= 1
            if refs[block_id]:
                continue  # another table still holds it
            if block_id in self._key_of:
                self._evictable[block_id] = None
            else:
                self._is_free[block_id] = 1
                self._num_free += 1
        del table[keep:]
        if self.enable_caching:
            del req.block_contents[keep:]
        if table:
            self._tails.add(table[-1])

    def free(self, req) -> None:
        self.rewind(req, 0)

    # ---- prefix caching ------------------------------------------------------------------------------
    def take_cached(self, req, token_ids: list[int], max_tokens: int, salt: str | None = None,
                    ends_at: Callable[[int], bool] | None = None) -> int:
        """Give an empty table the cached blocks of the longest prefix of ``token_ids`` that whole blocks of at
        most ``max_tokens`` tokens cover, among those cached with the same ``salt``; returns how many tokens they
        hold (0: no hit). ``ends_at``: the prefix must end with a block whose content id it accepts (a model with
        linear attention resumes only where its state was kept)."""
        assert not req.block_ids and not req.block_contents, req
        hit = self._cached_prefix(token_ids, max_tokens, salt)
        if ends_at is not None:
            while hit and not ends_at(hit[-1][0]):
                hit.pop()
        for content, block_id in hit:
            if self._refs[block_id] == 0:
                del self._evictable[block_id]
            self._refs[block_id] += 1
            req.block_ids.append(block_id)
            req.block_contents.append(content)
        if hit:
            self._tails.add(req.block_ids[-1])
        return len(hit) * self.block_size

    def cached_run(self, token_ids: list[int], max_tokens: int, salt: str | None = None) -> int:
        """How many tokens the longest prefix of ``token_ids`` in whole cached blocks holds (of at most
        ``max_tokens``, under ``salt``), whatever states were kept; nothing is taken."""
        return len(self._cached_prefix(token_ids, max_tokens, salt)) * self.block_size

    def _cached_prefix(self, token_ids: list[int], max_tokens: int, salt: str | None) -> list[tuple[int, int]]:
        """The (content id, block id) of each cached whole block of the longest such prefix, in order."""
        bs, parent, found = self.block_size, _root(salt), []
        for start in range(0, max_tokens - bs + 1, bs):
            entry = self._cached.get((parent, tuple(token_ids[start:start + bs])))
            if entry is None:
                break
            parent = entry[0]
            found.append(entry)
        return found

    def cache_blocks(self, req, token_ids: list[int], num_tokens: int, salt: str | None = None) -> None:
        """Register the table's blocks that the first ``num_tokens`` of ``token_ids`` fill (their K/V is
        written), past those already registered, under ``salt``. A content already cached in another block keeps
        that block; this table's copy stays private and is freed as usual, and the chain goes on from the cached
        content."""
        bs, contents, table = self.block_size, req.block_contents, req.block_ids
        for i in range(len(contents), min(num_tokens // bs, len(table))):
            key = (contents[i - 1] if i else _root(salt), tuple(token_ids[i * bs:(i + 1) * bs]))
            entry = self._cached.get(key)
            if entry is None:
                entry = (next(self._content_ids), table[i])
                self._cached[key] = entry
                self._key_of[table[i]] = key
            contents.append(entry[0])

    def reset_cache(self) -> int:
        """Forget every cached content (vLLM's ``reset_prefix_cache``): cached blocks no table holds become
        free; held ones stay with their tables, unregistered. Returns how many contents were dropped."""
        dropped = len(self._key_of)
        for block_id in self._evictable:
            self._is_free[block_id] = 1
        self._num_free += len(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        self._key_of.clear()
        return dropped

    def _evict(self, count: int) -> None:
        """Make the ``count`` least recently freed cached blocks free (their contents are forgotten)."""
        assert count <= len(self._evictable), (count, len(self._evictable))
        for _ in range(count):
            block_id, _ = self._evictable.popitem(last=False)
            del self._cached[self._key_of.pop(block_id)]
            self._is_free[block_id] = 1
        self._num_free += count

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


def _root(salt: str | None) -> int | tuple[str, str]:
    """The parent of a table's first block: 0, or the salt (never equal to a content id, an int)."""
    return 0 if salt is None else ("salt", salt)
