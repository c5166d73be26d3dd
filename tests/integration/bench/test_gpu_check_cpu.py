"""`make gpu-check DEVICE=cpu`: the GPU check's script end to end on a tiny model, so it cannot rot
before a GPU session runs it. Started as `make gpu-check` starts it (the launcher, from the source tree);
every section must give figures or a skip line, none an error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LAUNCHER = ROOT / "libs" / "bench" / "run_gpu_check.py"

pytestmark = pytest.mark.timeout(300)


def test_gpu_check_runs_on_cpu() -> None:
    done = subprocess.run(
        [sys.executable, str(LAUNCHER), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    sections = ("environment", "gpu_tests", "copy_bandwidth", "decode", "scheduling", "motivating", "ucx")
    assert all("error" not in result[name] for name in sections), {
        n: result[n].get("error") for n in sections
    }
    assert "skipped" in result["gpu_tests"]  # no CUDA here: said so, not faked
    backends = {case["backend"] for case in result["decode"]["cases"]}
    assert backends == {"torch", "triton"}
    assert all(case["tok_s"] > 0 for case in result["decode"]["cases"])
    runs = result["scheduling"]["runs"]
    assert {(r["policy"], r["prefetch"]) for r in runs} == {
        (p, f) for p in ("aligned", "fcfs") for f in ("on", "off")
    }
    assert len({r["tokens"] for r in runs}) == 1  # every run decodes the whole pool
    assert set(result["motivating"]["mixed_over_short"]) == {"torch", "triton"}
    assert result["ucx"]["cases"] and result["ucx"]["ucx"]["transports"]
    targets = result["targets"]  # judged from the figures above; on CPU none is a GPU figure
    assert targets["device"] == "cpu" and targets["decode_hbm_share"]["met"] is None  # no batch >= 64
    assert targets["ucx_over_copy"]["met"] is None and "not a GPU figure" in targets["ucx_over_copy"]["why"]
    assert targets["ucx_over_copy"]["target"] == 0.7 and targets["mixed_over_short"]["paper"] == 1.61
    assert set(targets["aligned_over_fcfs"]["value"]) == {"on", "off"}
