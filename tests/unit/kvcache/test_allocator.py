"""BlockAllocator: free list, block tables, capacity from a budget, clean refusal beyond it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from alignedserve.core.blocks import BlockAllocator, OutOfBlocks, blocks_for


def test_blocks_for_rounds_up() -> None:
    assert [blocks_for(t, 16) for t in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_allocate_extend_free_track_tables_and_free_count() -> None:
    allocator = BlockAllocator(num_blocks=10, block_size=4)
    assert allocator.allocate("a", 9) == [0, 1, 2]
    assert allocator.extend("a", 12) == []  # still fits in 3 blocks
    assert allocator.extend("a", 13) == [3]
    assert allocator.block_table("a") == [0, 1, 2, 3]
    assert allocator.capacity_tokens("a") == 16
    assert allocator.allocate("b", 4) == [4]
    assert (allocator.num_free, allocator.num_used) == (5, 5)
    assert allocator.free("a") == 4
    assert allocator.free("a") == 0  # freeing twice frees nothing
    assert allocator.num_free == 9 and "a" not in allocator


def test_freed_blocks_are_reused_first_in_table_order() -> None:
    """A stack: the next request takes the blocks freed last (memory written recently), ascending."""
    allocator = BlockAllocator(num_blocks=10, block_size=4)
    allocator.allocate("a", 12)  # [0, 1, 2]
    allocator.allocate("b", 8)  # [3, 4]
    allocator.free("a")
    assert allocator.allocate("c", 8) == [0, 1]
    allocator.free("b")
    assert allocator.allocate("d", 16) == [3, 4, 2, 5]  # b's, then a's last one, then never-used ones


def test_refusal_beyond_capacity_changes_nothing() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    allocator.allocate("a", 40)  # 3 blocks
    with pytest.raises(OutOfBlocks) as refused:
        allocator.allocate("b", 17)  # 2 blocks, 1 free
    assert (refused.value.needed, refused.value.free, refused.value.total) == (2, 1, 4)
    with pytest.raises(OutOfBlocks):
        allocator.extend("a", 80)
    assert allocator.block_table("a") == [0, 1, 2] and allocator.num_free == 1 and "b" not in allocator
    assert not allocator.can_allocate(17) and allocator.can_allocate(16)


def test_capacity_from_a_memory_budget() -> None:
    allocator = BlockAllocator.from_budget(budget_bytes=10_000, bytes_per_block=3_000, block_size=16)
    assert allocator.num_blocks == 3
    with pytest.raises(ValueError, match="raise the budget"):
        BlockAllocator.from_budget(budget_bytes=100, bytes_per_block=3_000, block_size=16)


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0, 16)
    allocator = BlockAllocator(4, 16)
    allocator.allocate("a", 1)
    with pytest.raises(ValueError, match="already holds"):
        allocator.allocate("a", 1)
    with pytest.raises(KeyError, match="holds no KV blocks"):
        allocator.block_table("missing")


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 70)), max_size=60))
def test_blocks_are_never_shared_or_lost(operations: list[tuple[int, int]]) -> None:
    allocator = BlockAllocator(num_blocks=12, block_size=8)
    for owner, tokens in operations:
        request_id = f"r{owner}"
        try:
            if tokens == 0:
                allocator.free(request_id)
            elif request_id in allocator:
                allocator.extend(request_id, tokens)
            else:
                allocator.allocate(request_id, tokens)
        except OutOfBlocks:
            pass
        held = [block for i in range(6) if f"r{i}" in allocator for block in allocator.block_table(f"r{i}")]
        assert len(held) == len(set(held)) == allocator.num_used
        assert allocator.num_used + allocator.num_free == 12
