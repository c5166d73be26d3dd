"""Compute strategies: processor sharing by hand-computed cases, and a shared-cores cluster run."""

from __future__ import annotations

from collections import Counter

import pytest

from alignedserve.batching.policies import make_policy
from alignedserve.batching.scheduler import plan_iteration
from alignedserve.core.workloads.arrivals import ClosedLoop
from alignedserve.core.workloads.spec import RequestSpec
from alignedserve.core.workloads.synthetic import synthetic
from alignedserve.sim.cli import RunSpec, simulate
from alignedserve.sim.cluster import Cluster, ClusterConfig
from alignedserve.sim.compute import DedicatedDevices, SharedCores
from alignedserve.sim.cost_registry import make_cost_model
from alignedserve.sim.deployments import STACK
from alignedserve.sim.metrics import Metrics

P, D = ("prefill", 0), ("decode", 0)


def test_a_job_alone_takes_its_work() -> None:
    cores = SharedCores()
    assert cores.start(P, 2.0, now=1.0) == [(P, 3.0)]
    assert cores.finish(P, now=3.0) == []
    assert DedicatedDevices().start(P, 2.0, now=1.0) == [(P, 3.0)]


def test_overlapping_jobs_split_the_machine() -> None:
    cores = SharedCores()
    cores.start(P, 2.0, now=0.0)
    # at t=1 the pass has 1 s of work left; a 0.5 s iteration joins: both run at half speed, the
    # iteration ends at 1 + 0.5*2 = 2, then the pass does its last 0.5 s alone: 2.5
    assert cores.start(D, 0.5, now=1.0) == [(D, 2.0), (P, 2.5)]
    assert cores.finish(D, now=2.0) == [(P, 2.5)]
    assert cores.finish(P, now=2.5) == []


def test_a_job_that_ends_early_speeds_the_rest_up() -> None:
    cores = SharedCores()
    cores.start(P, 4.0, now=0.0)
    cores.start(D, 4.0, now=0.0)  # both would end at 8
    assert cores.finish(D, now=2.0) == [(P, 5.0)]  # cancelled at 2: P has 3 s left, alone


def test_a_job_cannot_start_twice() -> None:
    cores = SharedCores()
    cores.start(P, 1.0, now=0.0)
    with pytest.raises(ValueError, match="already running"):
        cores.start(P, 1.0, now=0.5)


def _run(specs: list[RequestSpec], compute: str) -> Metrics:
    cost = make_cost_model("cpu-smollm2")
    pool = make_policy("aligned", max_len=32768, leaf_width=cost.block_size)
    config = ClusterConfig(prefill_workers=1, decode_workers=1, min_batch=4, max_batch=16, compute=compute)
    return Cluster(specs, cost, pool, plan_iteration, config).run()


def test_shared_cores_conserve_requests_and_slow_overlapping_work() -> None:
    # a long decode, then prompts arriving while it runs: their prefill passes overlap its iterations
    specs = [RequestSpec(0.0, 64, 200)] + [RequestSpec(1.0 + i, 1024, 8) for i in range(4)]
    shared, dedicated = _run(specs, "shared"), _run(specs, "dedicated")
    for metrics in (shared, dedicated):
        assert metrics.completed == len(specs)
        assert Counter(metrics.completed_ids) == Counter(range(len(specs)))
    assert shared.summary["decode_tokens"] == dedicated.summary["decode_tokens"]
    assert shared.summary["duration_s"] > dedicated.summary["duration_s"]


def test_shared_cores_change_nothing_when_nothing_overlaps() -> None:
    specs = [RequestSpec(0.0, 64, 20), RequestSpec(100.0, 512, 10)]  # the second comes long after
    shared, dedicated = _run(specs, "shared"), _run(specs, "dedicated")
    assert shared.summary["duration_s"] == pytest.approx(dedicated.summary["duration_s"], rel=1e-9)


def test_unknown_compute_is_refused() -> None:
    with pytest.raises(ValueError, match="compute must be one of"):
        _run([RequestSpec(0.0, 64, 2)], "gpu")


def test_below_k_min_aligned_holds_no_request_back_in_a_closed_loop() -> None:
    # the stack's deployment at 16 in flight: the decode worker runs fewer than K_min, so the aligned
    # policy must ship what waits at once, as fcfs does (it used to wait up to the 10 s aging threshold)
    specs = [
        RequestSpec(0.0, max(16, s.input_len // 8), max(2, s.output_len // 8))
        for s in synthetic(64, short_share=0.95, seed=0)
    ]
    cost = make_cost_model(STACK.cost_model)
    runs = {
        policy: simulate(
            specs,
            cost,
            RunSpec(policy, True, STACK.cluster_config(policy, True, ClosedLoop(16)), STACK.starvation_s),
        )
        for policy in ("aligned", "fcfs")
    }
    aligned, fcfs = runs["aligned"], runs["fcfs"]
    assert aligned["completed"] == fcfs["completed"] == len(specs)
    assert float(aligned["max_wait_ms"]) < 0.5 * 1e3 * STACK.starvation_s  # nobody waited for aging
    assert float(aligned["p99_client_tpot_ms"]) <= 1.5 * float(fcfs["p99_client_tpot_ms"])
