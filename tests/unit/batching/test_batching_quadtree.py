"""QuadTree: counters and oldest arrivals equal recomputed sums after any update sequence."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from alignedserve.batching.quadtree import INF, QuadTree
from alignedserve.batching.types import WaitingRequest

MAX_LEN, LEAF = 200, 4  # 50 leaves used of 64: a ragged right edge


def recomputed(tree: QuadTree, truth: dict[str, WaitingRequest], node: int) -> tuple[int, int, float]:
    lo, hi = tree.node_range(node)
    inside = [r for r in truth.values() if lo <= r.prefix_len < hi]
    return len(inside), sum(r.blocks for r in inside), min((r.arrival for r in inside), default=INF)


class TreeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tree = QuadTree(MAX_LEN, LEAF)
        self.truth: dict[str, WaitingRequest] = {}
        self.next_id = 0

    @rule(prefix=st.integers(0, MAX_LEN - 1), blocks=st.integers(0, 9), arrival=st.integers(0, 30))
    def insert(self, prefix: int, blocks: int, arrival: int) -> None:
        request = WaitingRequest(f"q{self.next_id}", prefix, blocks, float(arrival))
        self.next_id += 1
        self.tree.insert(request)
        self.truth[request.request_id] = request

    @precondition(lambda self: self.truth)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.truth)))
        assert self.tree.remove(request_id) == self.truth.pop(request_id)

    @precondition(lambda self: self.truth)
    @rule(data=st.data(), prefix=st.integers(0, MAX_LEN - 1), blocks=st.integers(0, 9))
    def move(self, data: st.DataObject, prefix: int, blocks: int) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.truth)))
        moved = self.tree.move(request_id, prefix, blocks)
        assert (moved.arrival, moved.prefix_len, moved.blocks) == (
            self.truth[request_id].arrival,
            prefix,
            blocks,
        )
        self.truth[request_id] = moved

    @rule(node=st.integers(0, 84))
    def pop_subtree(self, node: int) -> None:
        lo, hi = self.tree.node_range(node)
        taken = self.tree.pop_subtree(node)
        assert sorted(r.request_id for r in taken) == sorted(
            i for i, r in self.truth.items() if lo <= r.prefix_len < hi
        )
        for request in taken:
            del self.truth[request.request_id]

    @rule(leaf=st.integers(0, 63), budget=st.integers(0, 20), cap=st.integers(1, 5))
    def pop_oldest(self, leaf: int, budget: int, cap: int) -> None:
        node = self.tree.first_leaf + leaf
        lo, hi = self.tree.node_range(node)
        members = sorted((r for r in self.truth.values() if lo <= r.prefix_len < hi), key=lambda r: r.arrival)
        taken = self.tree.pop_oldest(node, budget, cap)
        # the taken are a block-fitting run of the oldest, and the next one would not fit (or cap)
        assert [r.arrival for r in taken] == [r.arrival for r in members[: len(taken)]]
        assert sum(r.blocks for r in taken) <= budget and len(taken) <= cap
        if len(taken) < min(cap, len(members)):
            assert sum(r.blocks for r in taken) + members[len(taken)].blocks > budget
        for request in taken:
            del self.truth[request.request_id]

    @invariant()
    def counters_match(self) -> None:
        tree = self.tree
        assert len(tree) == len(self.truth)
        for node in range(len(tree.count)):
            assert (tree.count[node], tree.blocks[node], tree.oldest[node]) == recomputed(
                tree, self.truth, node
            )


TestTreeMachine = TreeMachine.TestCase
TestTreeMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


def test_geometry_covers_max_len_with_block_wide_leaves() -> None:
    tree = QuadTree(max_len=8192, leaf_width=16)
    assert tree.depth == 5 and tree.num_leaves == 1024  # 16 * 4**5 = 16384 >= 8192
    assert tree.node_range(0) == (0, 16384)
    assert tree.node_range(tree.first_leaf + 3) == (48, 64)
    assert tree.node_range(4) == (3 * 4096, 4 * 4096)
    assert tree.leaf_of(8191) == tree.first_leaf + 511


def test_leaves_in_prefix_order_and_reverse() -> None:
    tree = QuadTree(256, 4)
    for i, prefix in enumerate((200, 3, 77, 78, 150)):
        tree.insert(WaitingRequest(f"r{i}", prefix, 1, 0.0))
    forward = [tree.node_range(leaf)[0] for leaf in tree.leaves_under(0)]
    assert forward == [0, 76, 148, 200]
    assert [tree.node_range(leaf)[0] for leaf in tree.leaves_under(0, reverse=True)] == forward[::-1]
    assert [tree.node_range(leaf)[0] for leaf in tree.leaves_overlapping(78, 150)] == [76, 148]


def test_late_arrival_reorders_a_leaf() -> None:
    tree = QuadTree(64, 4)
    for i, arrival in enumerate((5.0, 7.0, 1.0, 6.0)):
        tree.insert(WaitingRequest(f"r{i}", 9, 1, arrival))
    assert tree.oldest[0] == 1.0
    assert [r.arrival for r in tree.oldest_first(tree.leaf_of(9))] == [1.0, 5.0, 6.0, 7.0]
    tree.remove("r2")
    assert tree.oldest[0] == 5.0


def test_bad_input_raises_clear_errors() -> None:
    tree = QuadTree(64, 4)
    tree.insert(WaitingRequest("a", 10, 3, 0.0))
    with pytest.raises(ValueError, match="already waiting"):
        tree.insert(WaitingRequest("a", 11, 3, 0.0))
    with pytest.raises(ValueError, match="outside"):
        tree.insert(WaitingRequest("b", 64, 3, 0.0))
    with pytest.raises(ValueError, match="negative"):
        tree.insert(WaitingRequest("c", 1, -1, 0.0))
    with pytest.raises(KeyError, match="not waiting"):
        tree.remove("zzz")
    with pytest.raises(ValueError, match="outside"):
        tree.move("a", -1, 3)
    with pytest.raises(ValueError, match="max_len"):
        QuadTree(0, 4)
    assert tree.get("a").prefix_len == 10  # failed calls changed nothing


def test_many_late_arrivals_fold_into_order() -> None:
    tree = QuadTree(64, 4)
    for i in range(100):  # newest first: all but the first go to the late part of the leaf
        tree.insert(WaitingRequest(f"r{i}", 9, 1, float(100 - i)))
    leaf = tree.leaf_of(9)
    assert [r.arrival for r in tree.oldest_first(leaf)] == [float(a) for a in range(1, 101)]
    taken = tree.pop_oldest(leaf, max_blocks=10, cap=100)
    assert [r.arrival for r in taken] == [float(a) for a in range(1, 11)]
    assert tree.oldest[0] == 11.0 and tree.count[0] == 90
    tree.insert(WaitingRequest("late", 10, 1, 0.5))  # out of order again, after the fold
    assert tree.oldest[0] == 0.5
    assert tree.remove("late").arrival == 0.5 and tree.oldest[0] == 11.0
