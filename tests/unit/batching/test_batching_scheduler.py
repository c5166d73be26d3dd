"""Per-iteration batch-level scheduler: every case of DESIGN.md §4."""

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
    finished: set[str] | None = None,
    cand_requests: list[ScheduledRequest] | None = None,
    cand_batch: list[ScheduledRequest] | None = None,
    max_batch: int | None = None,
) -> IterationState:
    return IterationState(
        running=tuple(running),
        finished=frozenset(finished or ()),
        free_blocks=free,
        candidate_requests=tuple(cand_requests or ()),
        candidate_batch=tuple(cand_batch or ()),
        block_size=BS,
        max_batch=max_batch,
    )


def test_next_token_block_only_at_a_block_boundary() -> None:
    assert next_token_blocks(req("a", 32), BS) == 1  # 2 full blocks: token 33 starts block 3
    assert next_token_blocks(req("a", 33), BS) == 0
    assert next_token_blocks(req("a", 0), BS) == 1
    assert next_token_blocks(ScheduledRequest("a", 32, 3, 1), BS) == 0  # already holds the block


def test_finished_leave_and_free_their_blocks() -> None:
    plan = plan_iteration(state([req("a", 40), req("b", 100)], free=0, finished={"b"}))
    assert plan.finished == ("b",) and plan.evicted == () and plan.admitted == ()
    assert plan.free_blocks_after == blocks_for(100, BS)  # a (40 tokens) needs no new block


def test_lacking_memory_evicts_the_longest() -> None:
    running = [req("a", 32), req("b", 64), req("c", 48)]  # all three cross a block boundary: need 3
    plan = plan_iteration(state(running, free=1, cand_requests=[req("x", 5)]))
    assert plan.evicted == ("b",)  # frees 4 blocks, need drops to 2 <= 5
    assert plan.admitted == () and plan.admitted_from == ""  # eviction means no admission this time
    assert plan.free_blocks_after == 1 + 4 - 2


def test_eviction_repeats_until_the_next_iteration_fits() -> None:
    running = [req("a", 16), req("b", 32), req("c", 48)]  # need 3, hold 1 + 2 + 3
    plan = plan_iteration(state(running, free=0))
    assert plan.evicted == ("c",)  # frees 3, need 2: fits
    plan = plan_iteration(state([req("a", 16), req("b", 32), ScheduledRequest("c", 48, 0, 1)], free=0))
    assert plan.evicted == ("c", "b")  # c frees nothing: still short, then b


def test_eviction_during_a_switch_takes_the_longest_of_the_older_batch() -> None:
    running = [req("old1", 32, batch_id=1), req("old2", 64, batch_id=1), req("new1", 160, batch_id=2)]
    plan = plan_iteration(state(running, free=0))
    assert plan.evicted == ("old2",)  # new1 is longer, but old2 is the longest of the older batch
    assert plan.switching


def test_switch_ends_when_the_older_batch_is_evicted() -> None:
    running = [req("old1", 32, batch_id=1), ScheduledRequest("new1", 64, 4, 2)]
    plan = plan_iteration(state(running, free=0))
    assert plan.evicted == ("old1",) and not plan.switching


def test_admits_candidate_requests_first_and_not_the_batch() -> None:
    running = [req("a", 40)]
    plan = plan_iteration(
        state(running, free=10, cand_requests=[req("r1", 50), req("r2", 300)], cand_batch=[req("b1", 10, 2)])
    )
    assert plan.admitted == ("r1",) and plan.admitted_from == "requests"  # r2 needs 19 + 0 > 10 - 4
    assert not plan.switching and plan.free_blocks_after == 10 - 4


def test_nothing_from_the_batch_while_candidate_requests_wait() -> None:
    plan = plan_iteration(
        state([req("a", 40)], free=3, cand_requests=[req("r2", 300)], cand_batch=[req("b1", 10, 2)])
    )
    assert plan.admitted == ()


def test_empty_request_buffer_admits_from_the_batch_and_switches() -> None:
    plan = plan_iteration(
        state([req("a", 40)], free=4, cand_batch=[req("b1", 10, 2), req("b2", 20, 2), req("b3", 30, 2)])
    )
    assert plan.admitted == ("b1", "b2") and plan.admitted_from == "batch"  # 1 + 2 blocks, b3 needs 2 more
    assert plan.switching


def test_admission_across_a_block_boundary_counts_the_new_block() -> None:
    boundary = req("r", 32)  # holds 2 blocks, its next token needs a third
    assert plan_iteration(state([], free=2, cand_requests=[boundary])).admitted == ()
    plan = plan_iteration(state([], free=3, cand_requests=[boundary]))
    assert plan.admitted == ("r",) and plan.free_blocks_after == 0
    inside = req("s", 33)  # holds 3 blocks, room for its next token
    assert plan_iteration(state([], free=3, cand_requests=[inside])).admitted == ("s",)


def test_running_growth_is_reserved_before_admission() -> None:
    plan = plan_iteration(state([req("a", 32)], free=3, cand_requests=[req("r", 33)]))
    assert plan.admitted == ()  # a takes 1 of the 3: r needs 3


def test_max_batch_caps_admission() -> None:
    plan = plan_iteration(
        state([req("a", 40)], free=100, cand_batch=[req(f"b{i}", 10, 2) for i in range(5)], max_batch=3)
    )
    assert plan.admitted == ("b0", "b1")


def test_new_batch_on_an_empty_worker_is_not_a_switch() -> None:
    plan = plan_iteration(state([req("a", 40)], free=0, finished={"a"}, cand_batch=[req("b1", 10, 2)]))
    assert plan.finished == ("a",) and plan.admitted == ("b1",) and not plan.switching


def test_bad_state_is_rejected() -> None:
    with pytest.raises(ValueError, match="not running"):
        plan_iteration(state([req("a", 4)], free=1, finished={"zz"}))
    with pytest.raises(ValueError, match="twice"):
        plan_iteration(state([req("a", 4)], free=1, cand_batch=[req("a", 4, 2)]))
    with pytest.raises(ValueError, match="free_blocks"):
        plan_iteration(state([], free=-1))


requests = st.builds(
    lambda i, p, extra, b: ScheduledRequest(f"r{i}", p, blocks_for(p, BS) + extra, b),
    st.integers(0, 10**6),
    st.integers(0, 200),
    st.integers(0, 1),
    st.integers(1, 3),
)


@settings(max_examples=200, deadline=None)
@given(
    everyone=st.lists(requests, max_size=16, unique_by=lambda r: r.request_id),
    cuts=st.tuples(st.integers(0, 16), st.integers(0, 16)),
    free=st.integers(0, 30),
    done=st.sets(st.integers(0, 15)),
    max_batch=st.one_of(st.none(), st.integers(1, 8)),
)
def test_plan_invariants(
    everyone: list[ScheduledRequest], cuts: tuple[int, int], free: int, done: set[int], max_batch: int | None
) -> None:
    a, b = sorted(cuts)
    running, cand_requests, cand_batch = everyone[:a], everyone[a:b], everyone[b:]
    finished = {running[i].request_id for i in done if i < len(running)}
    plan = plan_iteration(state(running, free, finished, cand_requests, cand_batch, max_batch))
    assert set(plan.finished) == finished
    assert not (plan.evicted and plan.admitted)
    left = [r for r in running if r.request_id not in finished and r.request_id not in plan.evicted]
    pool = {r.request_id: r for r in (*cand_requests, *cand_batch)}
    admitted = [pool[i] for i in plan.admitted]
    now_running = left + admitted
    assert plan.free_blocks_after >= 0  # the next iteration always has its blocks
    held = sum(r.blocks for r in running) + free
    growth = sum(next_token_blocks(r, BS) for r in now_running)
    assert plan.free_blocks_after == held - sum(r.blocks for r in now_running) - growth
    if plan.admitted:
        source = cand_requests if plan.admitted_from == "requests" else cand_batch
        assert all(r in source for r in admitted) and (plan.admitted_from == "requests") == bool(
            cand_requests
        )
    if max_batch is not None and plan.admitted:
        assert len(now_running) <= max_batch
    assert plan.switching == (len({r.batch_id for r in now_running}) > 1)
