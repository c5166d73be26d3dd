"""`alignedserve bench shared-cpu`: each (layout, wait policy) runs in fresh processes, placed as the
layout says, under the policy's environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from alignedserve.core.cpu_layout import LAYOUTS


def test_each_layout_runs_placed_and_reports_both_engines() -> None:
    argv = ["--layouts", "split,prefill-yields", "--policies", "passive", "--json", "--batch", "2",
            "--prefix", "32", "--prompt", "64", "--steps", "6"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "alignedserve.core.cli", "bench", "shared-cpu", *argv],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    cpus = sorted(os.sched_getaffinity(0))
    assert [(r["layout"], r["policy"]) for r in report["runs"]] == [
        ("split", "passive"),
        ("prefill-yields", "passive"),
    ]
    for result in report["runs"]:
        layout = LAYOUTS[result["layout"]]
        for role in ("prefill", "decode"):
            placed = layout.place(role, cpus)
            assert result[f"{role}_placement"] == {"threads": placed.threads, "cpus": list(placed.cpus),
                                                   "nice": placed.nice}  # fmt: skip
        assert result["omp_wait_policy"] == "PASSIVE"
        assert result["decode_step_alone_ms"] > 0 and result["prefill_pass_alone_ms"] > 0
        expected = (
            result["decode_step_alone_ms"] / result["decode_step_beside_prefill_ms"]
            + result["prefill_pass_alone_ms"] / result["prefill_pass_beside_decode_ms"]
        )
        assert abs(result["machine_used"] - expected) < 0.02


def test_an_unknown_policy_or_layout_is_refused() -> None:
    for flag, value in (("--policies", "busy"), ("--layouts", "spread")):
        done = subprocess.run(
            [sys.executable, "-m", "alignedserve.core.cli", "bench", "shared-cpu", flag, value],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 2
        assert (
            "--layouts takes shared,prefill-yields,prefill-first,prefill-leads,split,split-decode-alone,"
            "split-pool-with-decode;"
            " --policies takes"
            " spin,short-spin,passive" in done.stderr
        )
