"""The load-adaptive K_min (room.py): a decode worker with free slots never waits while requests do;
a saturated one still gets length-aligned batches. (The simulated stack with it, aligned vs fcfs on
light and heavy load: tests/unit/sim/test_sim_load_adaptive.py.)"""

from __future__ import annotations

import pytest
from batching_oracles import BLOCK, MAX_LEN, limits_strategy, pools, spread
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from alignedserve.batching.policies import POLICY_NAMES, make_policy
from alignedserve.batching.room import DecodeRoom, effective_min_requests, load_adapted
from alignedserve.batching.types import BatchLimits, BatchPolicy, WaitingRequest

rooms = st.builds(
    DecodeRoom,
    occupied=st.integers(0, 300),
    free_blocks=st.integers(0, 400),
    max_running=st.one_of(st.none(), st.integers(1, 300)),
)


def filled(name: str, pool: list[WaitingRequest]) -> BatchPolicy:
    policy = make_policy(name, max_len=MAX_LEN, leaf_width=BLOCK)
    for request in pool:
        policy.add(request)
    return policy


def test_free_slots_count_the_cap_and_the_blocks_beyond_growth() -> None:
    assert DecodeRoom(occupied=0, free_blocks=100, max_running=8).free_slots == 8
    assert DecodeRoom(occupied=6, free_blocks=100, max_running=8).free_slots == 2
    assert DecodeRoom(occupied=8, free_blocks=100, max_running=8).free_slots == 0  # at its cap
    assert DecodeRoom(occupied=5, free_blocks=7, max_running=64).free_slots == 2  # 5 blocks are growth
    assert DecodeRoom(occupied=5, free_blocks=3, max_running=64).free_slots == 0  # memory-full
    assert DecodeRoom(occupied=5, free_blocks=30, max_running=None).free_slots == 25


def test_k_eff_is_k_min_only_without_a_free_slot() -> None:
    assert effective_min_requests(16, free_slots=0, waiting=3) == 16  # saturated: wait for alignment
    assert effective_min_requests(16, free_slots=0, waiting=40) == 16
    assert effective_min_requests(16, free_slots=48, waiting=3) == 3  # what waits is all it can get
    assert effective_min_requests(16, free_slots=4, waiting=40) == 4  # what its slots can take now
    assert effective_min_requests(16, free_slots=48, waiting=40) == 16
    assert effective_min_requests(16, free_slots=48, waiting=0) == 1
    with pytest.raises(ValueError, match="K_min"):
        effective_min_requests(0, free_slots=1, waiting=1)


@settings(max_examples=300, deadline=None)
@given(pool=pools(), limits=limits_strategy, room=rooms, name=st.sampled_from(POLICY_NAMES))
def test_a_worker_with_free_slots_always_gets_a_batch_while_requests_wait(
    pool: list[WaitingRequest], limits: BatchLimits, room: DecodeRoom, name: str
) -> None:
    """Whatever the load: free slots and a waiting request that fits a worker -> a batch goes out."""
    assume(room.free_slots > 0 and any(r.blocks <= limits.max_blocks for r in pool))
    batch = filled(name, pool).form_batch(load_adapted(limits, room, len(pool)), now=0.0)
    assert batch
    assert sum(r.blocks for r in batch) <= limits.max_blocks


@settings(max_examples=200, deadline=None)
@given(pool=pools(), limits=limits_strategy, name=st.sampled_from(("aligned", "window")))
def test_a_saturated_worker_keeps_the_configured_k_min(
    pool: list[WaitingRequest], limits: BatchLimits, name: str
) -> None:
    """No free slot: the limits are the configured ones, so batching is exactly as before."""
    saturated = DecodeRoom(occupied=10, free_blocks=10, max_running=64)
    adapted = load_adapted(limits, saturated, len(pool))
    assert adapted == limits
    assert filled(name, pool).form_batch(adapted, now=0.0) == filled(name, pool).form_batch(limits, now=0.0)
    if len(pool) < limits.min_requests:
        assert filled(name, pool).form_batch(adapted, now=0.0) == []  # waits for a fuller batch


def two_clusters() -> list[WaitingRequest]:
    """Ten short requests around 40 tokens and ten long ones around 200, arrivals interleaved."""
    pool = []
    for i in range(10):
        pool.append(WaitingRequest(f"short{i}", 40 + i, 12, float(2 * i)))
        pool.append(WaitingRequest(f"long{i}", 200 + i, 52, float(2 * i + 1)))
    return pool


@pytest.mark.parametrize("room", [DecodeRoom(64, 64, 64), DecodeRoom(4, 1000, 64), DecodeRoom(0, 1000, None)])
def test_aligned_batches_group_by_length_whether_or_not_the_worker_has_room(room: DecodeRoom) -> None:
    limits = BatchLimits(max_blocks=600, min_requests=8, max_requests=64)
    batch = filled("aligned", two_clusters()).form_batch(load_adapted(limits, room, 20), now=0.0)
    assert len(batch) >= 8
    assert spread(batch) < 16  # one cluster, never a short-long mix
    fcfs = filled("fcfs", two_clusters()).form_batch(load_adapted(limits, room, 20), now=0.0)
    assert spread(fcfs) > 150  # the baseline mixes them (arrival order)
