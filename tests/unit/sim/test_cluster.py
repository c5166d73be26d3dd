"""Simulator: conservation, determinism, spans equal iteration-by-iteration, bad input, the CLI."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from alignedserve.batching.policies import make_policy
from alignedserve.batching.scheduler import plan_iteration
from alignedserve.core.workloads.spec import RequestSpec
from alignedserve.core.workloads.synthetic import synthetic
from alignedserve.core.workloads.transforms import with_poisson_arrivals
from alignedserve.sim.cli import main
from alignedserve.sim.cluster import Cluster, ClusterConfig
from alignedserve.sim.cost_registry import make_cost_model
from alignedserve.sim.metrics import Metrics

TIMING_KEYS = {"sim_wall_s", "sched_p50_ms", "sched_p99_ms", "form_p99_ms"}


def _run(specs: list[RequestSpec], policy: str = "aligned", **config: object) -> Metrics:
    cost = make_cost_model("h100-opt-13b")
    settings = {"min_batch": 16 if policy != "fcfs" else 1, "dynamic_prefetch": policy != "fcfs", **config}
    pool = make_policy(policy, max_len=16 * 4**5, leaf_width=cost.block_size, starvation_s=None)
    return Cluster(specs, cost, pool, plan_iteration, ClusterConfig(**settings)).run()  # type: ignore[arg-type]


def _workload(n: int = 300, seed: int = 1) -> list[RequestSpec]:
    return with_poisson_arrivals(synthetic(n, short_share=0.9, seed=seed), rate=40.0, seed=seed)


def _deterministic(summary: dict[str, float | int]) -> dict[str, float | int]:
    return {k: v for k, v in summary.items() if k not in TIMING_KEYS}


@pytest.mark.parametrize("policy", ["aligned", "fcfs", "window"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_every_request_completes_once_with_its_output_length(policy: str, prefetch: bool) -> None:
    specs = _workload()
    metrics = _run(specs, policy, prefetch=prefetch, decode_workers=2, prefill_workers=2)
    assert metrics.completed == len(specs)
    assert Counter(metrics.completed_ids) == Counter(range(len(specs)))
    produced = dict(zip(metrics.completed_ids, metrics.output_tokens, strict=True))
    assert all(produced[i] == s.output_len for i, s in enumerate(specs))
    assert metrics.summary["decode_tokens"] == sum(s.output_len - 1 for s in specs)
    assert metrics.pool_blocks == 0  # the pool drained


def test_memory_pressure_evicts_and_still_conserves() -> None:
    # long prompts into workers with little KV memory: evictions must happen and lose nothing
    specs = synthetic(120, short_share=0.2, seed=5, output=(200, 400))
    metrics = _run(specs, "aligned", decode_workers=1, prefill_workers=1, max_batch=None)
    assert metrics.completed == len(specs)
    assert metrics.summary["evictions"] > 0


def test_same_seed_same_result() -> None:
    first = _run(_workload(seed=3)).summary
    again = _run(_workload(seed=3)).summary
    other = _run(_workload(seed=4)).summary
    assert _deterministic(first) == _deterministic(again)
    assert _deterministic(first) != _deterministic(other)


@pytest.mark.parametrize("policy", ["aligned", "fcfs"])
def test_spans_equal_calling_the_scheduler_every_iteration(policy: str) -> None:
    specs = _workload(150, seed=2)
    fast = _run(specs, policy, decode_workers=2, prefill_workers=2)
    exact = _run(specs, policy, decode_workers=2, prefill_workers=2, exact_iterations=True)
    assert exact.summary["sched_calls"] > fast.summary["sched_calls"]
    for key, value in _deterministic(fast.summary).items():
        if key in ("sched_calls", "form_calls"):
            continue
        assert exact.summary[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


def test_request_longer_than_a_worker_holds_is_rejected() -> None:
    with pytest.raises(ValueError, match="more KV than a decode worker holds"):
        _run([RequestSpec(0.0, 10_000_000, 5)])


def test_cli_json_has_the_promised_fields(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["--workload", "synthetic", "--short-share", "0.9", "--requests", "200", "--rate", "50", "--json"]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "completed",
        "decode_throughput_tok_s",
        "mean_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_tpot_ms",
        "mixed_iteration_fraction",
        "sched_p99_ms",
        "peak_pool_blocks",
        "max_wait_ms",
    ):
        assert key in out
    assert out["completed"] == 200


def test_cli_compare_reports_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["--requests", "150", "--rate", "30", "--compare", "--json", "--cost-model", "h100-llama-7b"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert set(out["runs"]) == {"aligned", "fcfs", "aligned_prefetch_off", "fcfs_prefetch_off"}
    assert out["ratios"]["throughput_aligned_over_fcfs"] > 0


def test_cli_bad_trace_is_a_clear_error(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trace", "/nonexistent/trace.csv"]) == 2
    assert "error" in capsys.readouterr().err
