"""`alignedserve sim calibrate --samples`: the engine's timings in, a loadable CPU cost model out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignedserve.core.cli import main as alignedserve
from alignedserve.sim.cost import Link
from alignedserve.sim.cpu_model import CALIBRATION_PATH, load_cpu_model


def _samples(path: Path) -> None:
    lines = []
    for b in (1, 2, 4, 8):
        for s in (16, 128, 512):
            seconds = 0.02 + 0.003 * b + 1e-5 * b * s
            lines.append({"kind": "decode", "kv_lens": [s] * b, "seconds": seconds})
    for n in (32, 128, 512, 1024):
        lines.append({"kind": "prefill", "input_lens": [n], "seconds": 0.05 + 2e-4 * n + 1e-7 * n * n})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n", encoding="utf-8")


def test_fit_from_engine_samples_writes_a_usable_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    samples, out = tmp_path / "iterations.jsonl", tmp_path / "cpu.json"
    _samples(samples)
    args = ["calibrate", "--samples", str(samples), "--kv-bytes-per-token", "46080", "--out", str(out)]
    assert alignedserve(["sim", *args]) == 0
    capsys.readouterr()
    model = load_cpu_model(out)
    assert model.decode_iteration_s([100, 300]) == pytest.approx(0.02 + 0.006 + 4e-3, rel=1e-6)
    assert model.prefill_s([256]) == pytest.approx(0.05 + 2e-4 * 256 + 1e-7 * 256**2, rel=1e-6)
    assert model.transfer_s(10, Link.PCIE) > 0
    assert model.calibration.command.startswith("alignedserve sim calibrate --samples")


def test_bad_samples_are_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    samples = tmp_path / "bad.jsonl"
    samples.write_text('{"kind": "decode", "seconds": 1}\n', encoding="utf-8")
    args = ["calibrate", "--samples", str(samples), "--kv-bytes-per-token", "8", "--out", str(tmp_path / "x")]
    assert alignedserve(["sim", *args]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_shipped_calibration_loads() -> None:
    model = load_cpu_model(CALIBRATION_PATH)
    assert model.decode_capacity_blocks > 0
    assert model.decode_iteration_s([64] * 4) > 0
