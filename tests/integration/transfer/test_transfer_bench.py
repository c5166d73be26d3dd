"""`alignedserve bench transfer`: prints its JSON and exits (once it printed and then waited forever on a
UCX notifier thread that a query after the context's release had started)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_transfer_bench_prints_its_figures_and_exits() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "alignedserve.core.cli", "bench", "transfer", "--sizes-mb", "0.01,1",
         "--repeats", "2", "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert [case["bytes"] for case in report["cases"]] == [10485, 1 << 20]
    for case in report["cases"]:
        assert case["raw_gbps"] > 0 and case["kv_gbps"] > 0 and case["copy_gbps"] > 0
    assert "tcp" in report["transport"] and report["ucx"]["transports"] == report["transport"]
    assert report["ucx"]["kv_bytes_by_memory"]["received:host"] >= 2 * (10485 + (1 << 20))
