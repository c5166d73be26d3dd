"""Per-iteration scheduler with admission headroom (`growth_reserve`): beyond the paper's rule, the same
guarantees, no admit-then-evict thrash at the memory limit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alignedserve.batching.scheduler import next_token_blocks, plan_iteration
from alignedserve.batching.types import IterationState, ScheduledRequest
from alignedserve.core.blocks import blocks_for

BS = 16


def req(request_id: str, prefix_len: int, batch_id: int = 1) -> ScheduledRequest:
    return ScheduledRequest(request_id, prefix_len, blocks_for(prefix_len, BS), batch_id)


def state(
    running: list[ScheduledRequest],
    free: int,
    reserve: int,
    cand_requests: list[ScheduledRequest] | None = None,
    cand_batch: list[ScheduledRequest] | None = None,
    finished: frozenset[str] = frozenset(),
) -> IterationState:
    return IterationState(
        running=tuple(running),
        finished=finished,
        free_blocks=free,
        candidate_requests=tuple(cand_requests or ()),
        candidate_batch=tuple(cand_batch or ()),
        block_size=BS,
        growth_reserve=reserve,
    )


def test_reserve_zero_is_the_papers_rule() -> None:
    running = [req("a", 40)]
    cands = [req("b1", 10, 2), req("b2", 20, 2), req("b3", 30, 2)]
    paper = plan_iteration(state(running, 4, 0, cand_batch=cands))
    assert paper.admitted == ("b1", "b2") and paper.free_blocks_after == 1  # admits while it fits now


def test_admission_leaves_a_block_of_growth_per_running_request() -> None:
    running = [req("a", 40)]
    cands = [req("b1", 10, 2), req("b2", 20, 2), req("b3", 30, 2)]
    plan = plan_iteration(state(running, 6, 1, cand_batch=cands))
    # b1 (1 block) leaves 5 >= 2 running; b2 (2 blocks) would leave 3 >= 3: both; b3 (2) would leave 1 < 4
    assert plan.admitted == ("b1", "b2") and plan.free_blocks_after == 3
    assert plan.free_blocks_after >= 1 * (len(running) + len(plan.admitted))


def test_the_first_request_into_an_empty_worker_needs_no_reserve() -> None:
    lone = req("r", 33)  # holds 3 blocks, its next token fits
    assert plan_iteration(state([], 3, 1, cand_requests=[lone])).admitted == ("r",)
    assert plan_iteration(state([], 3, 1, cand_requests=[lone, req("s", 5)])).admitted == ("r",)


def test_a_finished_request_frees_room_for_the_reserve_too() -> None:
    running = [req("a", 40), req("done", 64)]  # done's 4 blocks come back
    plan = plan_iteration(state(running, 0, 1, cand_requests=[req("r", 20)], finished=frozenset({"done"})))
    assert plan.admitted == ("r",) and plan.free_blocks_after == 4 - 2


def test_negative_reserve_is_rejected() -> None:
    with pytest.raises(ValueError, match="growth_reserve"):
        plan_iteration(state([], 1, -1))


def _run(reserve: int, iterations: int = 64) -> tuple[int, int]:
    """A worker of 14 blocks at its memory limit with one evicted request waiting to rejoin; returns
    (evictions, readmissions). Plans are applied as the decode worker applies them."""
    capacity = 14
    prefixes = {"a": 34, "b": 48, "c": 48}  # 3 + 3 + 3 blocks
    waiting = {"r": 45}  # 3 blocks
    evictions = readmitted = 0
    for _ in range(iterations):
        running = [req(i, p) for i, p in prefixes.items()]
        cands = [req(i, p) for i, p in waiting.items()]
        used = sum(r.blocks for r in running)
        plan = plan_iteration(state(running, capacity - used, reserve, cand_requests=cands))
        for i in plan.evicted:
            waiting[i] = prefixes.pop(i)
            evictions += 1
        for i in plan.admitted:
            prefixes[i] = waiting.pop(i)
            readmitted += 1
        for i in prefixes:
            prefixes[i] += 1
    return evictions, readmitted


def test_paper_rule_thrashes_at_the_memory_limit_and_the_reserve_stops_it() -> None:
    # paper's rule: every time a request finishes a block the waiting one fits, is admitted, and the
    # batch's next block boundary evicts the longest again: two KV transfers per round trip
    paper_evictions, paper_readmitted = _run(reserve=0)
    evictions, readmitted = _run(reserve=1)
    assert paper_evictions >= 4 and paper_readmitted >= 3
    assert evictions <= 1 and readmitted <= 1


requests = st.builds(
    lambda i, p, extra, b: ScheduledRequest(f"r{i}", p, blocks_for(p, BS) + extra, b),
    st.integers(0, 10**6),
    st.integers(0, 200),
    st.integers(0, 1),
    st.integers(1, 3),
)


@settings(max_examples=200, deadline=None)
@given(
    everyone=st.lists(requests, max_size=14, unique_by=lambda r: r.request_id),
    cuts=st.tuples(st.integers(0, 14), st.integers(0, 14)),
    free=st.integers(0, 40),
    reserve=st.integers(0, 3),
)
def test_reserve_keeps_every_guarantee(
    everyone: list[ScheduledRequest], cuts: tuple[int, int], free: int, reserve: int
) -> None:
    a, b = sorted(cuts)
    running, cand_requests, cand_batch = everyone[:a], everyone[a:b], everyone[b:]
    plan = plan_iteration(state(running, free, reserve, cand_requests, cand_batch))
    paper = plan_iteration(state(running, free, 0, cand_requests, cand_batch))
    assert plan.evicted == paper.evicted  # eviction never depends on the reserve
    assert set(plan.admitted) <= set(paper.admitted) or plan.admitted_from == paper.admitted_from
    assert not (plan.evicted and plan.admitted)
    left = [r for r in running if r.request_id not in plan.evicted]
    pool = {r.request_id: r for r in (*cand_requests, *cand_batch)}
    now_running = left + [pool[i] for i in plan.admitted]
    held = sum(r.blocks for r in running) + free
    growth = sum(next_token_blocks(r, BS) for r in now_running)
    assert plan.free_blocks_after == held - sum(r.blocks for r in now_running) - growth >= 0
    if plan.admitted and len(now_running) > 1:
        assert plan.free_blocks_after >= reserve * len(now_running)
    if not running and paper.admitted and not plan.evicted:
        assert plan.admitted  # an empty worker always takes something that fits
