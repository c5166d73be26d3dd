"""`alignedserve sim calibrate` measuring the real engine (SmolLM2), on a tiny grid."""

from __future__ import annotations

from pathlib import Path

import pytest

from alignedserve.bench.calibrate import read_samples
from alignedserve.core.cli import main as alignedserve
from alignedserve.sim.cpu_model import load_cpu_model


def test_calibrate_measures_the_engine_and_writes_model_and_samples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, samples = tmp_path / "cpu.json", tmp_path / "samples.jsonl"
    argv = ["calibrate", "--batches", "1,2", "--prefixes", "16,40", "--mixed", "1x16+1x40"]
    argv += ["--prompts", "16,40,2x8", "--repeats", "1", "--threads", "1"]
    assert alignedserve(["sim", *argv, "--out", str(out), "--write-samples", str(samples)]) == 0
    assert "decode fit: R²" in capsys.readouterr().err
    decode, prefill = read_samples(samples)
    # a fresh batch runs one warm-up iteration, then the timed one attends over prefix + 2 tokens
    assert [s.kv_lens for s in decode] == [(18,), (42,), (18, 18), (42, 42), (18, 42)]
    assert [s.input_lens for s in prefill] == [(16,), (40,), (8, 8)]
    assert all(s.seconds > 0 for s in (*decode, *prefill))
    model = load_cpu_model(out)
    calibration = model.calibration
    assert calibration.kv_bytes_per_token == 46080 and calibration.block_size == 16
    assert model.decode_capacity_blocks == 2 * 2**30 // (16 * 46080)  # the decode worker's KV budget
    assert calibration.decode_samples == 5 and "LLMEngine" in calibration.source
    assert set(calibration.fit) == {"decode", "prefill"}
    assert model.decode_iteration_s([100] * 4) > 0 and model.prefill_s([64]) > 0
