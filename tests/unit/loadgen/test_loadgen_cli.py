"""The `alignedserve-loadgen` command: outputs and the SLO gate's exit codes, against the
protocol-conformance server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignedserve.loadgen.cli import EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE, main
from alignedserve.loadgen.slo import EXIT_SLO_MISSED


def base_args(url: str) -> list[str]:
    return [
        "--endpoint", url, "--model", "smollm2", "--tokenizer", "smollm2", "--synthetic", "--short-share", "0.75",
        "--short-range", "20", "60", "--long-range", "200", "300", "--output-range", "3", "8",
        "--num-requests", "8", "--concurrency", "4", "--no-progress",
    ]  # fmt: skip


def test_json_and_plots(conformance_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    code = main(
        [
            *base_args(conformance_server),
            "--slo-ttft-ms",
            "60000",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "plots"),
        ]
    )
    assert code == EXIT_OK
    data = json.loads(out.read_text())
    assert data["completed"] == 8 and data["failed"] == 0 and data["max_concurrency"] == 4
    assert data["max_send_lag_ms"] is None  # closed loop: lag would only be the wait for a slot
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    assert data["total_output_tokens"] == sum(r["expected_output_len"] for r in data["requests"])
    assert all(len(r["chunk_times_s"]) == r["output_len"] for r in data["requests"])
    assert data["workload"]["source"] == "synthetic" and data["arrivals"]["arrivals"] == "closed_loop"
    for name in ("ttft_cdf.png", "tpot_cdf.png", "throughput.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"
    assert "Successful requests" in capsys.readouterr().out


def test_gate_passes_with_generous_targets(conformance_server: str) -> None:
    args = ["--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--fail-on-slo", "--min-slo-attainment", "1"]
    assert main([*base_args(conformance_server), *args, "--max-failures", "0"]) == EXIT_OK


def test_gate_exits_3_and_names_the_missed_target(
    conformance_server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--fail-on-slo", "--max-p99-ttft-ms", "0.001", "--max-failures", "0"]
    assert main([*base_args(conformance_server), *args]) == EXIT_SLO_MISSED
    err = capsys.readouterr().err
    assert "SLO missed: p99_ttft_ms" in err and "failed" not in err


def test_slo_limits_alone_gate_the_p99_and_failures(
    conformance_server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # what the Helm test hook runs: --slo-* with --fail-on-slo and no explicit run-level target
    assert (
        main(
            [
                *base_args(conformance_server),
                "--slo-ttft-ms",
                "60000",
                "--slo-tpot-ms",
                "60000",
                "--fail-on-slo",
            ]
        )
        == EXIT_OK
    )
    assert (
        main([*base_args(conformance_server), "--slo-tpot-ms", "0.0001", "--fail-on-slo"]) == EXIT_SLO_MISSED
    )
    assert "SLO missed: p99_tpot_ms" in capsys.readouterr().err
    assert (
        main(
            [*base_args(conformance_server), "--model", "http-500", "--slo-ttft-ms", "60000", "--fail-on-slo"]
        )
        == EXIT_SLO_MISSED
    )
    assert "SLO missed: failed = 8.000, target <= 0" in capsys.readouterr().err


def test_gate_counts_failures(conformance_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "http-500", "--fail-on-slo", "--max-failures", "2"]
    assert main([*base_args(conformance_server), *args]) == EXIT_SLO_MISSED
    assert "SLO missed: failed = 8.000, target <= 2" in capsys.readouterr().err


def test_a_run_with_no_completed_request_fails(
    conformance_server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*base_args(conformance_server), "--model", "http-500"]) == EXIT_RUN_FAILED
    captured = capsys.readouterr()
    assert "no request completed" in captured.err and "Failures: http_500" in captured.out


@pytest.mark.parametrize(
    "extra",
    [
        ["--fail-on-slo"],  # no target
        ["--no-stream", "--slo-ttft-ms", "100"],  # TTFT not observable
    ],
)
def test_inconsistent_options_exit_2(conformance_server: str, extra: list[str]) -> None:
    assert main([*base_args(conformance_server), *extra]) == EXIT_USAGE


def test_generated_workload_needs_an_arrival_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--endpoint", "http://127.0.0.1:9", "--model", "m", "--dataset", "sharegpt"]) == EXIT_USAGE
    assert "--request-rate" in capsys.readouterr().err


def test_bad_flags_are_rejected_by_the_parser() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--endpoint", "http://x", "--model", "m", "--concurrency", "0"])
    assert exit_info.value.code == EXIT_USAGE


def test_unknown_tokenizer_is_a_clear_run_failure(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["--endpoint", "http://127.0.0.1:9", "--model", "m", "--tokenizer", str(tmp_path / "nope"),
                 "--request-rate", "inf", "--num-requests", "1"])  # fmt: skip
    assert code == EXIT_RUN_FAILED
    assert "--tokenizer" in capsys.readouterr().err
