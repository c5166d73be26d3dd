"""Arrival processes: the closed loop on its own (pure), and driving a whole simulated cluster."""

from __future__ import annotations

import bisect

import pytest

from alignedserve.batching.policies import make_policy
from alignedserve.batching.scheduler import plan_iteration
from alignedserve.core.workloads.arrivals import OPEN_LOOP, ClosedLoop
from alignedserve.core.workloads.spec import RequestSpec
from alignedserve.core.workloads.synthetic import synthetic
from alignedserve.sim.cluster import Cluster, ClusterConfig
from alignedserve.sim.cost_registry import make_cost_model
from alignedserve.sim.records import SimRequest


def _requests(arrivals: list[float]) -> list[SimRequest]:
    return [SimRequest(i, t, 32, 8, 16) for i, t in enumerate(arrivals)]


def test_closed_loop_keeps_c_in_flight_and_follows_workload_order() -> None:
    # workload arrival times are ignored: a closed loop sends in workload order
    arrivals = ClosedLoop(2).start(_requests([5.0, 1.0, 9.0, 0.0, 3.0]))
    assert arrivals.next_at() == 0.0
    first, second = arrivals.pop(), arrivals.pop()
    assert (first.index, first.arrival, second.index, second.arrival) == (0, 0.0, 1, 0.0)
    assert arrivals.next_at() is None  # both slots busy: nothing arrives until a completion
    arrivals.completed(1.5)
    assert arrivals.next_at() == 1.5
    third = arrivals.pop()
    assert (third.index, third.arrival) == (2, 1.5)
    arrivals.completed(2.0)
    arrivals.completed(3.0)  # two slots free: each lets the next one in at its own instant
    fourth, fifth = arrivals.pop(), arrivals.pop()
    assert [(r.index, r.arrival) for r in (fourth, fifth)] == [(3, 2.0), (4, 3.0)]
    assert arrivals.exhausted and arrivals.next_at() is None
    arrivals.completed(4.0)  # nothing left to send
    assert arrivals.next_at() is None


def test_closed_loop_larger_than_the_workload_sends_everything_at_once() -> None:
    arrivals = ClosedLoop(10).start(_requests([1.0, 2.0, 3.0]))
    popped = [arrivals.pop() for _ in range(3)]
    assert [r.arrival for r in popped] == [0.0, 0.0, 0.0] and arrivals.exhausted
    arrivals.completed(1.0)
    assert arrivals.next_at() is None


def test_open_loop_sorts_by_time_keeping_ties_in_order() -> None:
    arrivals = OPEN_LOOP.start(_requests([2.0, 1.0, 1.0, 0.5]))
    order = []
    while arrivals.next_at() is not None:
        order.append(arrivals.pop().index)
    assert order == [3, 1, 2, 0]


def test_concurrency_must_be_positive() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        ClosedLoop(0)


def _cluster(specs: list[RequestSpec], concurrency: int | None, policy: str = "aligned") -> Cluster:
    cost = make_cost_model("cpu-smollm2")
    arrivals = ClosedLoop(concurrency) if concurrency is not None else OPEN_LOOP
    config = ClusterConfig(
        prefill_workers=1, decode_workers=1, min_batch=4, max_batch=16, fill=0.85, arrivals=arrivals
    )
    return Cluster(specs, cost, make_policy(policy, max_len=4096), plan_iteration, config)


@pytest.mark.parametrize("policy", ["aligned", "fcfs"])
def test_closed_loop_in_a_cluster_admits_one_request_per_completion(policy: str) -> None:
    specs = [RequestSpec(0.0, s.input_len // 8 + 1, s.output_len // 8 + 1) for s in synthetic(40, 0.9, 3)]
    cluster = _cluster(specs, 5, policy)
    metrics = cluster.run()
    assert metrics.completed == 40
    requests = cluster.by_index
    done = sorted(r.last_token_at if r.decode_tokens else r.first_token_at for r in requests)
    assert [r.arrival for r in requests[:5]] == [0.0] * 5
    # request i >= C arrives exactly when the (i - C + 1)-th request completes
    assert [r.arrival for r in requests[5:]] == pytest.approx(done[:35])
    for r in requests:  # never more than C in the system
        in_flight = sum(1 for q in requests if q.arrival <= r.arrival) - bisect.bisect_right(done, r.arrival)
        assert in_flight <= 5


def test_closed_loop_of_everyone_equals_all_arriving_at_once() -> None:
    specs = [RequestSpec(0.0, s.input_len // 8 + 1, s.output_len // 8 + 1) for s in synthetic(30, 0.9, 4)]
    closed = _cluster(specs, 100).run().summary
    at_once = _cluster(specs, None).run().summary
    for key in ("decode_tokens", "output_throughput_tok_s", "p99_client_tpot_ms", "iterations"):
        assert closed[key] == at_once[key]


def test_client_side_metrics_follow_the_load_generator_definitions() -> None:
    specs = [RequestSpec(0.0, 40, 20), RequestSpec(0.0, 300, 9), RequestSpec(0.0, 50, 1)]
    cluster = _cluster(specs, 2)
    summary = cluster.run().summary
    requests = cluster.by_index
    ends = [r.last_token_at if r.decode_tokens else r.first_token_at for r in requests]
    assert summary["duration_s"] == pytest.approx(max(ends))
    assert summary["output_throughput_tok_s"] == pytest.approx(30 / max(ends))
    # TPOT as the client sees it: first token (from prefill) to the last, pool wait included
    tpots = [
        (end - r.first_token_at) / (r.output_len - 1)
        for r, end in zip(requests, ends, strict=True)
        if r.output_len > 1
    ]
    assert summary["mean_client_tpot_ms"] == pytest.approx(1e3 * sum(tpots) / len(tpots))
