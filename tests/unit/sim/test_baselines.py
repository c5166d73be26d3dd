"""The paper's baselines: each step scheduler's published rules, and whole runs that conserve requests."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import pytest

from alignedserve.core.workloads.spec import RequestSpec
from alignedserve.core.workloads.synthetic import synthetic
from alignedserve.core.workloads.transforms import with_poisson_arrivals
from alignedserve.sim.baselines.distserve import DistServeDecode, context_batch
from alignedserve.sim.baselines.engine import BaselineCluster
from alignedserve.sim.baselines.fastgen import SplitFuse
from alignedserve.sim.baselines.steps import StepView
from alignedserve.sim.baselines.systems import BASELINES, baseline_config
from alignedserve.sim.baselines.vllm import ChunkedPrefill, PrefillFirst
from alignedserve.sim.cli import main
from alignedserve.sim.cost_registry import make_cost_model

BS = 16


@dataclass
class Item:
    request_id: str
    prefix: int
    target: int
    final_len: int = 10_000


def view(running: list[Item], waiting: list[Item], free: int, capacity: int = 1000) -> StepView:
    return StepView(running, waiting, free, capacity, BS)


def decoding(i: str, prefix: int) -> Item:
    return Item(i, prefix, prefix)


def prompt(i: str, tokens: int, done: int = 0) -> Item:
    return Item(i, done, tokens)


# --- vLLM ------------------------------------------------------------------------------------------


def test_prefill_first_runs_whole_prompts_alone_then_decodes() -> None:
    s = PrefillFirst(max_num_seqs=8, max_num_batched_tokens=100)
    plan = s.plan(view([decoding("a", 40)], [prompt("p", 60), prompt("q", 30), prompt("r", 20)], free=50))
    assert plan.chunks == (("p", 60), ("q", 30)) and plan.decode == ()  # r would pass the token budget
    plan = s.plan(view([decoding("a", 40)], [prompt("big", 400)], free=50))
    assert plan.chunks == () and plan.decode == ("a",)  # 25 blocks for the prompt: does not fit, decode


def test_prefill_first_keeps_the_watermark_free() -> None:
    s = PrefillFirst(max_num_seqs=8, max_num_batched_tokens=10_000)
    plan = s.plan(view([], [prompt("p", 16 * 95)], free=100, capacity=1000))  # 95 blocks, 10 watermark
    assert plan.chunks == ()


def test_prefill_first_preempts_the_newest_when_growth_does_not_fit() -> None:
    s = PrefillFirst()
    running = [decoding("old", 32), decoding("mid", 48), decoding("new", 64)]  # all at a block boundary
    plan = s.plan(view(running, [], free=1))
    assert plan.preempted == ("new",) and plan.decode == ("old", "mid")


def test_chunked_prefill_serves_running_first_then_chunks_waiting_prompts() -> None:
    s = ChunkedPrefill(max_num_seqs=8, max_num_batched_tokens=64)
    running = [decoding("a", 40), prompt("p", 100, done=80)]
    plan = s.plan(view(running, [prompt("w", 500)], free=100))
    assert plan.decode == ("a",)
    assert plan.chunks == (("p", 20), ("w", 43))  # 64 tokens: 1 decode, p's last 20, w's first 43


def test_chunked_prefill_admits_nothing_after_a_preemption() -> None:
    s = ChunkedPrefill(max_num_seqs=8, max_num_batched_tokens=512)
    running = [decoding("a", 32), decoding("b", 48)]
    plan = s.plan(view(running, [prompt("w", 16)], free=1))
    assert plan.preempted == ("b",) and plan.decode == ("a",) and plan.chunks == ()


# --- FastGen ---------------------------------------------------------------------------------------


def test_splitfuse_fills_the_token_budget_decodes_first() -> None:
    s = SplitFuse(max_ragged_batch_size=50, max_ragged_sequence_count=10)
    running = [decoding("a", 40), decoding("b", 41)]
    plan = s.plan(view(running, [prompt("p", 30), prompt("q", 100)], free=100))
    assert plan.decode == ("a", "b") and plan.chunks == (("p", 30), ("q", 18))


def test_splitfuse_skips_a_decode_without_a_block_and_needs_whole_prompts_to_fit() -> None:
    s = SplitFuse()
    running = [decoding("a", 32), decoding("b", 40)]  # a needs a block, b does not
    plan = s.plan(view(running, [prompt("p", 400)], free=0))
    assert plan.decode == ("b",) and plan.chunks == () and plan.preempted == ()


def test_splitfuse_resets_when_nothing_can_run() -> None:
    plan = SplitFuse().plan(view([decoding("a", 32), decoding("b", 48)], [], free=0))
    assert plan.preempted == ("b", "a") and plan.decode == ()


# --- DistServe -------------------------------------------------------------------------------------


def test_distserve_reserves_final_lengths_fcfs() -> None:
    s = DistServeDecode(max_batch_size=10)
    running = [Item("a", 100, 100, final_len=320)]  # reserves 20 blocks
    waiting = [
        Item("w1", 50, 50, final_len=160),
        Item("w2", 50, 50, final_len=400),
        Item("w3", 10, 10, final_len=16),
    ]
    plan = s.plan(view(running, waiting, free=900, capacity=40))  # 20 + 10 fit; w2's 25 does not: stop
    assert plan.admitted == ("w1",) and plan.decode == ("a", "w1")


def test_distserve_context_batch_limits() -> None:
    assert context_batch([1000] * 200, free_blocks=10_000, block_size=BS) == 32  # 32,768 tokens a batch
    assert context_batch([16] * 200, free_blocks=10_000, block_size=BS) == 128  # 128 requests
    assert context_batch([160, 160], free_blocks=15, block_size=BS) == 1  # the prefill GPU's KV


# --- whole runs ------------------------------------------------------------------------------------


def _run(specs: list[RequestSpec], name: str, exact: bool = False) -> dict[str, float | int]:
    cost = make_cost_model("h100-opt-13b")
    metrics = BaselineCluster(specs, cost, baseline_config(name, specs, 1, 1, exact_iterations=exact)).run()
    assert Counter(metrics.completed_ids) == Counter(range(len(specs)))
    produced = dict(zip(metrics.completed_ids, metrics.output_tokens, strict=True))
    assert all(produced[i] == s.output_len for i, s in enumerate(specs))
    assert metrics.summary["decode_tokens"] == sum(s.output_len - 1 for s in specs)
    return metrics.summary


@pytest.mark.parametrize("name", BASELINES)
def test_every_request_completes_once_and_spans_equal_single_passes(name: str) -> None:
    specs = with_poisson_arrivals(synthetic(120, short_share=0.9, seed=1), rate=40.0, seed=1)
    fast, exact = _run(specs, name), _run(specs, name, exact=True)
    for key in ("decode_throughput_tok_s", "p99_tpot_ms", "mean_ttft_ms", "iterations", "time_bubble_s"):
        assert exact[key] == pytest.approx(fast[key], rel=1e-9, abs=1e-9), key


@pytest.mark.parametrize("name", BASELINES)
def test_memory_pressure_preempts_or_holds_back_and_conserves(name: str) -> None:
    specs = synthetic(60, short_share=0.2, seed=5, output=(200, 400))  # long prompts, all at once
    summary = _run(specs, name)
    if name in ("vllm", "fastgen"):
        assert summary["evictions"] > 0


def test_cli_runs_a_baseline_with_the_same_summary_keys(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "synthetic", "--requests", "80", "--rate", "40", "--json"]
    assert main([*argv, "--policy", "vllm"]) == 0
    baseline = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    aligned = json.loads(capsys.readouterr().out)
    assert set(baseline) == set(aligned) and baseline["completed"] == 80
