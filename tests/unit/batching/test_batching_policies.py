"""Batch formation against brute-force oracles: fit, K_min, spread, low load, aging, prefetch."""

from __future__ import annotations

import pytest
from batching_oracles import BLOCK, MAX_LEN, limits_strategy, oracle, pools, spread
from hypothesis import given, settings
from hypothesis import strategies as st

from alignedserve.batching.aligned import AlignedPolicy
from alignedserve.batching.fcfs import FcfsPolicy
from alignedserve.batching.policies import POLICY_NAMES, make_policy
from alignedserve.batching.quadtree import QuadTree
from alignedserve.batching.room import DecodeRoom, load_adapted
from alignedserve.batching.search import density_first_search
from alignedserve.batching.types import BatchLimits, BatchPolicy, WaitingRequest
from alignedserve.batching.window import WindowPolicy

FAST = settings(max_examples=100, deadline=None)


# a decode worker with room for everything: K_min adapts to what waits (room.py)
IDLE = DecodeRoom(occupied=0, free_blocks=1 << 30, max_running=None)


def with_room(limits: BatchLimits, waiting: int) -> BatchLimits:
    return load_adapted(limits, IDLE, waiting)


def filled(name: str, pool: list[WaitingRequest], starvation_s: float | None = None) -> BatchPolicy:
    policy = make_policy(name, max_len=MAX_LEN, leaf_width=BLOCK, starvation_s=starvation_s)
    for request in pool:
        policy.add(request)
    return policy


@FAST
@given(pool=pools(), limits=limits_strategy, name=st.sampled_from(POLICY_NAMES))
def test_every_batch_fits_and_leaves_the_pool(
    pool: list[WaitingRequest], limits: BatchLimits, name: str
) -> None:
    policy = filled(name, pool)
    batch = policy.form_batch(with_room(limits, len(pool)), now=0.0)
    assert sum(r.blocks for r in batch) <= limits.max_blocks
    assert limits.max_requests is None or len(batch) <= limits.max_requests
    assert len({r.request_id for r in batch}) == len(batch)
    assert len(policy) == len(pool) - len(batch)
    assert not any(r.request_id in policy for r in batch)


@FAST
@given(pool=pools(), limits=limits_strategy)
def test_window_is_exact_narrowest_feasible(pool: list[WaitingRequest], limits: BatchLimits) -> None:
    best_count, narrowest = oracle(pool, limits)
    batch = filled("window", pool).form_batch(with_room(limits, len(pool)), now=0.0)
    assert len(batch) >= best_count  # reaches K_min whenever the waiting set allows
    assert spread(batch) == narrowest


@FAST
@given(pool=pools(uniform=True), limits=limits_strategy, name=st.sampled_from(("aligned", "window")))
def test_reaches_kmin_whenever_allowed_for_same_size_requests(
    pool: list[WaitingRequest], limits: BatchLimits, name: str
) -> None:
    best_count, _ = oracle(pool, limits)
    batch = filled(name, pool).form_batch(with_room(limits, len(pool)), now=0.0)
    assert len(batch) >= best_count


@FAST
@given(pool=pools(), limits=limits_strategy)
def test_aligned_short_batch_is_memory_full_or_exhausts_the_pool(
    pool: list[WaitingRequest], limits: BatchLimits
) -> None:
    """A batch below min(K_min, cap) stopped at a request that no longer fits (or took everything)."""
    policy = filled("aligned", pool)
    batch = policy.form_batch(with_room(limits, len(pool)), now=0.0)
    cap = limits.max_requests if limits.max_requests is not None else len(pool)
    if len(batch) < min(limits.min_requests, cap):
        used = sum(r.blocks for r in batch)
        left = [r for r in pool if r.request_id in policy]
        assert not left or any(used + r.blocks > limits.max_blocks for r in left)


@FAST
@given(pool=pools(max_size=12), limits=limits_strategy, starved_mode=st.booleans())
def test_density_first_stays_inside_the_subtree_it_reports(
    pool: list[WaitingRequest], limits: BatchLimits, starved_mode: bool
) -> None:
    """Spread bound: every request lies in `span`, a tree node's range, so spread < its width; a
    case-1 or leaf batch lies in the node the descent stopped at (a leaf: spread < leaf width)."""
    tree = QuadTree(MAX_LEN, BLOCK)
    for request in pool:
        tree.insert(request)
    result = density_first_search(tree, limits, starved_before=1e9 if starved_mode else None)
    lo, hi = result.span
    assert all(lo <= r.prefix_len < hi for r in result.requests)
    if result.case in ("fits", "leaf"):
        assert result.span == tree.node_range(result.node)
    if result.case == "leaf":
        assert spread(list(result.requests)) < BLOCK
    if result.requests:
        assert spread(list(result.requests)) < hi - lo


def test_density_first_cases_on_a_hand_built_pool() -> None:
    tree = QuadTree(256, 4)  # root [0,256), children 64 wide, ..., leaves 4 wide
    dense = [WaitingRequest(f"d{i}", 129 + i % 3, 2, float(i)) for i in range(6)]  # one leaf [128,132)
    sparse = [WaitingRequest(f"s{i}", 10 + 50 * i, 2, 100.0 + i) for i in range(4)]
    for request in (*dense, *sparse):
        tree.insert(request)
    # case 2 then 1: the root (20 blocks) and its densest child [128,192) (14) do not fit 12 blocks;
    # the densest grandchild [128,144) holds the dense six: fits, and 6 >= 5
    result = density_first_search(tree, BatchLimits(max_blocks=12, min_requests=5))
    assert result.case == "fits" and {r.request_id for r in result.requests} == {r.request_id for r in dense}
    for request in dense:
        tree.insert(request)
    # the leaf alone exceeds 7 blocks: its 3 oldest that fit
    result = density_first_search(tree, BatchLimits(max_blocks=7, min_requests=5))
    assert result.case == "leaf" and [r.request_id for r in result.requests] == ["d0", "d1", "d2"]
    for request in result.requests:
        tree.insert(request)
    # case 3: the root has more than max_requests; its densest child [128,192) (dense six and s3 at
    # 160) fits but is too few for 8: borrow from the left sibling's nearest leaf first (s2 at 110)
    result = density_first_search(tree, BatchLimits(max_blocks=100, min_requests=8, max_requests=8))
    assert result.case == "borrowed" and result.span == (0, 256)
    assert {r.request_id for r in result.requests} == {*(r.request_id for r in dense), "s3", "s2"}


def test_low_load_waits_while_saturated_and_dispatches_with_free_slots() -> None:
    for name in ("aligned", "window"):
        policy = filled(name, [WaitingRequest(f"r{i}", 20 * i, 3, float(i)) for i in range(3)])
        limits = BatchLimits(max_blocks=100, min_requests=8)
        assert policy.form_batch(limits, now=0.0) == []  # the configured K_min: a saturated worker
        assert len(policy) == 3
        assert len(policy.form_batch(with_room(limits, len(policy)), now=0.0)) == 3
        assert policy.form_batch(with_room(limits, len(policy)), now=0.0) == []


@FAST
@given(
    pool=pools(max_size=12),
    limits=limits_strategy,
    name=st.sampled_from(("aligned", "window")),
    now=st.floats(0, 20),
    busy=st.booleans(),
)
def test_starved_oldest_request_is_in_the_next_batch(
    pool: list[WaitingRequest], limits: BatchLimits, name: str, now: float, busy: bool
) -> None:
    """The starvation bound's step: once the oldest has waited >= T, the next batch contains it."""
    policy = filled(name, pool, starvation_s=5.0)
    batch = policy.form_batch(limits if busy else with_room(limits, len(pool)), now=now)
    fitting = [r for r in pool if r.blocks <= limits.max_blocks]
    oldest = min(fitting, key=lambda r: r.arrival, default=None)
    if oldest is not None and oldest.arrival <= now - 5.0 and oldest == min(pool, key=lambda r: r.arrival):
        assert oldest in batch


def test_starvation_bound_in_a_steady_stream() -> None:
    """A far-off request among a dense stream waits no longer than T plus one formation round."""
    policy = AlignedPolicy(max_len=MAX_LEN, leaf_width=BLOCK, starvation_s=3.0)
    policy.add(WaitingRequest("lonely", 250, 10, 0.0))
    limits = BatchLimits(max_blocks=40, min_requests=4)
    served_at = None
    for step in range(20):
        for j in range(8):  # a dense cluster (40 blocks) keeps winning the density-first descent
            policy.add(WaitingRequest(f"s{step}-{j}", 20 + j, 5, float(step)))
        if any(
            r.request_id == "lonely"
            for r in policy.form_batch(with_room(limits, len(policy)), now=float(step))
        ):
            served_at = step
            break
    assert served_at == 3
    no_aging = filled("aligned", [WaitingRequest("lonely", 250, 10, 0.0)])
    for step in range(20):
        for j in range(8):
            no_aging.add(WaitingRequest(f"s{step}-{j}", 20 + j, 5, float(step)))
        no_aging.form_batch(with_room(limits, len(no_aging)), now=float(step))
    assert "lonely" in no_aging  # without aging it starves


def test_fcfs_never_waits_for_kmin() -> None:
    policy = filled("fcfs", [WaitingRequest(f"r{i}", 20 * i, 3, float(i)) for i in range(3)])
    batch = policy.form_batch(BatchLimits(max_blocks=100, min_requests=8), now=0.0)
    assert [r.request_id for r in batch] == ["r0", "r1", "r2"]


def test_fcfs_takes_the_arrival_order_prefix_that_fits() -> None:
    policy = FcfsPolicy()
    for i, (prefix, blocks) in enumerate(((5, 3), (200, 9), (7, 15), (8, 2), (9, 50), (3, 1))):
        policy.add(WaitingRequest(f"r{i}", prefix, blocks, float(i)))
    limits = BatchLimits(max_blocks=20, min_requests=1)
    # r2 does not fit after r0 and r1 and blocks the queue: no overtaking by the smaller r3
    assert [r.request_id for r in policy.form_batch(limits, now=0.0)] == ["r0", "r1"]
    # r4 (50 blocks > B_max) can never go: passed over, and kept
    assert [r.request_id for r in policy.form_batch(limits, now=0.0)] == [
        "r2",
        "r3",
        "r5",
    ]
    assert len(policy) == 1 and "r4" in policy


@FAST
@given(
    pool=pools(max_size=12),
    name=st.sampled_from(POLICY_NAMES),
    lo=st.integers(0, MAX_LEN),
    width=st.integers(0, 80),
    max_blocks=st.integers(0, 100),
    max_requests=st.integers(0, 6),
)
def test_prefetch_takes_oldest_in_range_within_limits(
    pool: list[WaitingRequest], name: str, lo: int, width: int, max_blocks: int, max_requests: int
) -> None:
    policy = filled(name, pool)
    hi = lo + width
    chosen = policy.prefetch_candidates(lo, hi, max_blocks, max_requests)
    assert all(lo <= r.prefix_len <= hi for r in chosen)
    assert sum(r.blocks for r in chosen) <= max_blocks and len(chosen) <= max_requests
    assert [r.arrival for r in chosen] == sorted(r.arrival for r in chosen)
    assert not any(r.request_id in policy for r in chosen) and len(policy) == len(pool) - len(chosen)
    left = [r for r in pool if r.request_id in policy and lo <= r.prefix_len <= hi]
    if len(chosen) < max_requests:  # nothing left in range would still have fitted
        assert all(sum(r.blocks for r in chosen) + r.blocks > max_blocks for r in left)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_move_and_remove_keep_the_pool_consistent(name: str) -> None:
    policy = filled(name, [WaitingRequest("a", 10, 3, 0.0), WaitingRequest("b", 100, 26, 1.0)])
    policy.move("a", 101, 26)
    assert policy.remove("a").prefix_len == 101
    with pytest.raises(KeyError, match="not waiting"):
        policy.remove("a")
    with pytest.raises(ValueError, match="already waiting"):
        policy.add(WaitingRequest("b", 5, 2, 3.0))
    with pytest.raises(ValueError, match="negative"):
        policy.add(WaitingRequest("c", 5, -2, 3.0))
    with pytest.raises(ValueError, match="negative"):
        policy.move("b", 5, -1)
    batch = policy.form_batch(BatchLimits(max_blocks=30, min_requests=1), now=0.0)
    assert [r.request_id for r in batch] == ["b"]


def test_factory_and_limits_validation() -> None:
    assert isinstance(make_policy("aligned"), AlignedPolicy)
    assert isinstance(make_policy("window"), WindowPolicy)
    assert isinstance(make_policy("fcfs"), FcfsPolicy)
    with pytest.raises(ValueError, match="unknown batch policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="max_blocks"):
        make_policy("aligned").form_batch(BatchLimits(0, 1), now=0.0)
    with pytest.raises(ValueError, match="starvation_s"):
        make_policy("window", starvation_s=-1.0)
