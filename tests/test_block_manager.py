"""The KV block pool: allocation from a free list, rewind, free, double-free detection, duck-typed owners."""

from dataclasses import dataclass, field

import pytest

from specray.scheduler.block_manager import BlockManager


@dataclass
class Owner:
    """Anything with a block table (a drafter's per-request state, say)."""

    block_ids: list[int] = field(default_factory=list)


def test_blocks_for():
    bm = BlockManager(8, 4)
    assert [bm.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_grows_to_cover_slots_and_is_idempotent():
    bm = BlockManager(8, 4)
    a = Owner()
    bm.allocate(a, 5)
    assert a.block_ids == [0, 1] and bm.num_free_blocks == 6
    bm.allocate(a, 8)
    assert a.block_ids == [0, 1] and bm.num_free_blocks == 6
    bm.allocate(a, 9)
    assert a.block_ids == [0, 1, 2] and bm.num_free_blocks == 5


def test_can_fit_counts_blocks_already_held():
    bm = BlockManager(4, 4)
    a, b = Owner(), Owner()
    bm.allocate(a, 8)
    assert bm.can_fit(a, 16) and not bm.can_fit(a, 17)
    assert bm.can_fit(b, 8) and not bm.can_fit(b, 9)


def test_rewind_frees_blocks_wholly_beyond_the_kept_slots():
    bm = BlockManager(8, 4)
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
    bm = BlockManager(6, 2)
    owners = [Owner() for _ in range(3)]
    for o in owners:
        bm.allocate(o, 4)
    bm.free(owners[1])
    c = Owner()
    bm.allocate(c, 3)
    held = [b for o in owners + [c] for b in o.block_ids]
    assert sorted(held) == list(range(6)) and bm.num_free_blocks == 0


def test_double_free_is_caught():
    bm = BlockManager(4, 4)
    a = Owner()
    bm.allocate(a, 4)
    stale = Owner(list(a.block_ids))
    bm.free(a)
    with pytest.raises(AssertionError, match="double free"):
        bm.free(stale)


@pytest.mark.parametrize("args, match", [((0, 4), "num_blocks=0"), ((4, 0), "block_size=0"), ((2.5, 4), "num_blocks")])
def test_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        BlockManager(*args)
