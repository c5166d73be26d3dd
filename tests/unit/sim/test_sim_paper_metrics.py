"""The paper's metrics and model shapes: misaligned and switch-over iterations, the time breakdown, the
middle-window throughput, OPT models and tensor parallelism, mixed passes, the host-overhead what-if."""

from __future__ import annotations

import pytest

from alignedserve.core.workloads.synthetic import synthetic
from alignedserve.core.workloads.transforms import with_poisson_arrivals
from alignedserve.sim.cli import build_workload, parse_args, run_spec, simulate
from alignedserve.sim.cost import SpanCost
from alignedserve.sim.cost_registry import gpu_model, make_cost_model, paper_cost_model_name
from alignedserve.sim.decode import origins_apart
from alignedserve.sim.hardware import OPT_2_7B, OPT_13B, OPT_30B
from alignedserve.sim.iterstats import LAST_ARRIVAL, MID_END, MID_START, arrival_mark, count_below
from alignedserve.sim.overhead import HostOverhead
from alignedserve.sim.records import SimRequest


def _req(i: int, prefix: int, batch: int) -> SimRequest:
    r = SimRequest(i, 0.0, prefix, 10, 16)
    r.batch_id = batch
    return r


def test_origins_apart_only_when_their_prefix_ranges_leave_a_gap() -> None:
    assert not origins_apart([_req(0, 100, 1), _req(1, 200, 1)])  # one batch
    assert not origins_apart([_req(0, 100, 1), _req(1, 300, 1), _req(2, 250, 2)])  # overlapping
    assert origins_apart([_req(0, 100, 1), _req(1, 120, 1), _req(2, 400, 2)])  # a gap: misaligned
    assert origins_apart([_req(0, 100, 1), _req(1, 700, 2), _req(2, 720, 3), _req(3, 110, 3)])


def test_count_below_counts_span_iterations_under_a_duration() -> None:
    cost = SpanCost(0.010, 0.001)  # 10, 11, 12, ... ms
    assert count_below(cost, 100, 0.0125) == 3
    assert count_below(cost, 2, 0.0125) == 2
    assert count_below(cost, 100, 0.009) == 0
    assert count_below(SpanCost(0.005, 0.0), 7, 0.03) == 7


def test_arrival_marks_split_the_run_into_quarters() -> None:
    marks = [arrival_mark(i, 100) for i in range(1, 101)]
    assert marks[24] == MID_START and marks[74] == MID_END and marks[99] == LAST_ARRIVAL
    assert sum(m is not None for m in marks) == 3


def test_time_breakdown_adds_up_and_aligned_has_less_bubble_than_fcfs() -> None:
    args = parse_args(
        [
            "--workload",
            "synthetic",
            "--requests",
            "400",
            "--rate",
            "80",
            "--cost-model",
            "h100-opt-13b-paperfit",
        ]
    )
    specs = build_workload(args)
    cost = make_cost_model("h100-opt-13b-paperfit")
    runs = {p: simulate(specs, cost, run_spec(args, p, True)) for p in ("aligned", "fcfs")}
    for s in runs.values():
        parts = sum(float(s[k]) for k in ("time_linear_s", "time_attention_s", "time_bubble_s"))
        assert parts == pytest.approx(float(s["time_decode_busy_s"]), rel=1e-6)
        assert float(s["mean_iteration_ms"]) == pytest.approx(
            float(s["time_decode_busy_s"]) / int(s["iterations"]) * 1e3
        )
        assert (
            0
            <= float(s["iter_under_10ms"])
            <= float(s["iter_under_30ms"])
            <= float(s["iter_under_100ms"])
            <= 1
        )
        assert float(s["misaligned_iteration_fraction"]) <= float(s["mixed_iteration_fraction"])
        assert float(s["switch_iteration_fraction"]) <= float(s["mixed_iteration_fraction"])
        assert float(s["mid_throughput_tok_s"]) > 0
    assert runs["aligned"]["time_bubble_s"] < runs["fcfs"]["time_bubble_s"]
    assert runs["aligned"]["time_attention_s"] == pytest.approx(
        runs["fcfs"]["time_attention_s"]
    )  # same KV read


def test_opt_shapes_and_tensor_parallel_capacity() -> None:
    assert OPT_2_7B.kv_bytes_per_token == 320 * 1024 and OPT_13B.kv_bytes_per_token == 800 * 1024
    one = gpu_model(OPT_30B, tensor_parallel=1)
    two = make_cost_model(paper_cost_model_name("opt-30b", paperfit=False))
    assert paper_cost_model_name("opt-30b") == "h100-opt-30b-tp2-paperfit"
    # 60 GB of weights leave one GPU little KV; two GPUs hold twice the HBM less the same weights
    assert one.decode_capacity_blocks * 16 < 14_000 < 60_000 < two.decode_capacity_blocks * 16
    lens = [2000] * 16
    assert two.decode_iteration_s(lens) < one.decode_iteration_s(lens)
    assert OPT_30B.heads == 56


@pytest.mark.parametrize("name", ["h100-opt-2.7b-paperfit", "h100-opt-13b", "cpu-smollm2"])
def test_a_pass_without_prefill_is_a_decode_iteration_and_chunks_add_time(name: str) -> None:
    cost = make_cost_model(name)
    lens = [300, 900, 40]
    assert cost.step_s(lens, []) == pytest.approx(cost.decode_iteration_s(lens))
    assert cost.step_s(lens, [(0, 512)]) > cost.step_s(lens, [])
    assert cost.step_s(lens, [(1024, 512)]) > cost.step_s(lens, [(0, 512)])  # attends to its context
    parts = cost.decode_parts(lens)
    assert parts.linear_s + parts.ideal_attention_s <= cost.decode_iteration_s(lens) * (1 + 1e-9)


def test_host_overhead_adds_to_every_pass_only() -> None:
    inner = make_cost_model("h100-opt-13b")
    cost = HostOverhead(inner, 0.01)
    lens = [500] * 8
    assert cost.decode_iteration_s(lens) == pytest.approx(inner.decode_iteration_s(lens) + 0.01)
    assert cost.decode_span(lens).total(3) == pytest.approx(inner.decode_span(lens).total(3) + 0.03)
    assert cost.step_s([], [(0, 100)]) == pytest.approx(inner.step_s([], [(0, 100)]) + 0.01)
    assert cost.decode_iteration_s([]) == 0.0 and cost.prefill_s([100]) == inner.prefill_s([100])


def test_growth_reserve_cuts_evictions_on_the_paper_deployment() -> None:
    specs = with_poisson_arrivals(synthetic(600, short_share=0.9, seed=3), rate=120.0, seed=3)
    cost = make_cost_model("h100-opt-13b-paperfit")
    base = ["--workload", "synthetic", "--requests", "600"]
    ours = simulate(specs, cost, run_spec(parse_args(base), "aligned", True))
    paper = simulate(specs, cost, run_spec(parse_args([*base, "--growth-reserve", "0"]), "aligned", True))
    assert int(ours["evictions"]) < int(paper["evictions"])
