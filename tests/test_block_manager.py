"""The KV block pool: allocation, contiguous placement, rewind, free, double-free detection, duck-typed owners."""

import random
from dataclasses import dataclass, field

import pytest

from specray.kv_blocks import BlockPool


@dataclass
class Owner:
    """Anything with a block table (a drafter's per-request state, say)."""

    block_ids: list[int] = field(default_factory=list)


def test_blocks_for():
    bm = BlockPool(8, 4)
    assert [bm.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_grows_to_cover_slots_and_is_idempotent():
    bm = BlockPool(8, 4)
    a = Owner()
    bm.allocate(a, 5)
    assert a.block_ids == [0, 1] and bm.num_free_blocks == 6
    bm.allocate(a, 8)
    assert a.block_ids == [0, 1] and bm.num_free_blocks == 6
    bm.allocate(a, 9)
    assert a.block_ids == [0, 1, 2] and bm.num_free_blocks == 5


def test_can_fit_counts_blocks_already_held():
    bm = BlockPool(4, 4)
    a, b = Owner(), Owner()
    bm.allocate(a, 8)
    assert bm.can_fit(a, 16) and not bm.can_fit(a, 17)
    assert bm.can_fit(b, 8) and not bm.can_fit(b, 9)


def test_rewind_frees_blocks_wholly_beyond_the_kept_slots():
    bm = BlockPool(8, 4)
    a = Owner()
    bm.allocate(a, 16)
    bm.rewind(a, 9)  # slot 8 is in block 2: blocks 0..2 stay
    assert a.block_ids == [0, 1, 2] and bm.num_free_blocks == 5
    bm.rewind(a, 8)  # block 2 now holds nothing kept
    assert a.block_ids == [0, 1] and bm.num_free_blocks == 6
    bm.rewind(a, 8)
    assert a.block_ids == [0, 1]
    bm.free(a)
    assert a.block_ids == [] and bm.num_free_blocks == 8


def test_freed_blocks_are_reused_and_never_shared():
    bm = BlockPool(6, 2)
    owners = [Owner() for _ in range(3)]
    for o in owners:
        bm.allocate(o, 4)
    bm.free(owners[1])
    c = Owner()
    bm.allocate(c, 3)
    held = [b for o in owners + [c] for b in o.block_ids]
    assert sorted(held) == list(range(6)) and bm.num_free_blocks == 0


def test_double_free_is_caught():
    bm = BlockPool(4, 4)
    a = Owner()
    bm.allocate(a, 4)
    stale = Owner(list(a.block_ids))
    bm.free(a)
    with pytest.raises(AssertionError, match="double free"):
        bm.free(stale)


@pytest.mark.parametrize("args, match", [((0, 4), "num_blocks=0"), ((4, 0), "block_size=0"), ((2.5, 4), "num_blocks")])
def test_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        BlockPool(*args)


def runs(table: list[int]) -> int:
    """How many runs of consecutive blocks a table is made of."""
    return sum(1 for i, b in enumerate(table) if i == 0 or b != table[i - 1] + 1)


def test_tables_growing_side_by_side_stay_contiguous():
    """Decode tails interleave (every table grows by a block in turn); each table still stays one run, because
    new tables start half way into the largest gap, leaving room for the table before them."""
    bm = BlockPool(256, 4)
    owners = [Owner() for _ in range(6)]
    for o in owners:
        bm.allocate(o, 3 * 4)  # prefill: 3 blocks
    for n in range(4, 30):
        for o in owners:
            bm.allocate(o, n * 4)
    assert all(len(o.block_ids) == 29 and runs(o.block_ids) == 1 for o in owners)


def test_a_blocked_table_continues_in_the_largest_gap():
    bm = BlockPool(16, 1)
    a, b, c = Owner(), Owner(), Owner()
    bm.allocate(a, 2)
    bm.allocate(b, 2)  # half way into [2, 16): blocks 9, 10
    assert a.block_ids == [0, 1] and b.block_ids == [9, 10]
    bm.allocate(c, 7)  # the largest gap is [11, 16) (5) vs [2, 9) (7): c fills [2, 9) from its start + 0
    assert c.block_ids == [2, 3, 4, 5, 6, 7, 8]
    bm.allocate(a, 4)  # block 2 is taken: a continues in the largest gap, [11, 16), after b's tail: half way
    assert a.block_ids == [0, 1, 13, 14] and runs(a.block_ids) == 2


def test_random_workload_keeps_the_pool_consistent():
    """Allocate, rewind and free at random: no block is ever held twice, free + held = all, and a fragmented
    pool still hands out every free block."""
    rng = random.Random(0)
    bm = BlockPool(64, 2)
    owners = [Owner() for _ in range(8)]
    for _ in range(3000):
        o = rng.choice(owners)
        op = rng.random()
        if op < 0.6:
            slots = len(o.block_ids) * 2 + rng.randint(1, 9)
            if bm.can_fit(o, slots):
                bm.allocate(o, slots)
        elif op < 0.9:
            bm.rewind(o, rng.randint(0, len(o.block_ids) * 2))
        else:
            bm.free(o)
        held = [b for w in owners for b in w.block_ids]
        assert len(held) == len(set(held)) and len(held) + bm.num_free_blocks == 64
    for o in owners:
        bm.free(o)
    big = Owner()
    bm.allocate(big, 128)
    assert sorted(big.block_ids) == list(range(64)) and bm.num_free_blocks == 0
