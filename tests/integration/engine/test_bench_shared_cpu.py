"""`alignedserve bench shared-cpu`: both policies run in fresh processes under their own environment."""

from __future__ import annotations

import json
import subprocess
import sys


def test_each_policy_runs_under_its_environment_and_reports_both_engines() -> None:
    argv = [
        "--policies",
        "spin,passive",
        "--json",
        "--batch",
        "2",
        "--prefix",
        "32",
        "--prompt",
        "64",
        "--steps",
        "6",
        "--threads",
        "1",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "alignedserve.core.cli", "bench", "shared-cpu", *argv],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    spin, passive = report["policies"]["spin"], report["policies"]["passive"]
    assert spin["omp_wait_policy"] == "(libgomp default)" and passive["omp_wait_policy"] == "PASSIVE"
    for result in (spin, passive):
        assert result["decode_step_alone_ms"] > 0 and result["prefill_pass_alone_ms"] > 0
        assert result["decode_slowdown"] > 0 and result["prefill_slowdown"] > 0
        expected = (
            result["decode_step_alone_ms"] / result["decode_step_beside_prefill_ms"]
            + result["prefill_pass_alone_ms"] / result["prefill_pass_beside_decode_ms"]
        )
        assert abs(result["machine_used"] - expected) < 0.02


def test_an_unknown_policy_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "alignedserve.core.cli", "bench", "shared-cpu", "--policies", "busy"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "--policies takes spin,short-spin,passive" in done.stderr
