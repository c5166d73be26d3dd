"""The CPU model's fit: samples files both ways, fit quality, batch shapes, the gathered-KV regime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignedserve.bench.calibrate import (
    STAGED_KV_BYTES,
    gathered_regime,
    parse_shapes,
    read_samples,
    samples_jsonl,
)
from alignedserve.core.cli import main as alignedserve
from alignedserve.sim.cpu_model import DecodeSample, PrefillSample, describe_lens, fit_decode, load_cpu_model

KV_BYTES = 46080  # SmolLM2 float32: 30 layers x 3 KV heads x 64 x 2 (K, V) x 4 bytes


def _decode_seconds(kv_lens: tuple[int, ...]) -> float:
    multi = 0.03 if len(kv_lens) > 1 else 0.0
    return 0.05 + multi + 0.003 * len(kv_lens) + 2e-6 * sum(kv_lens)


def _samples() -> tuple[list[DecodeSample], list[PrefillSample]]:
    shapes = [(p,) * b for b in (1, 4, 16) for p in (64, 256, 1024)] + [(64,) * 12 + (1024,) * 4]
    decode = [DecodeSample(s, _decode_seconds(s)) for s in shapes]
    decode.append(DecodeSample((2048,) * 48, 4.0))  # past the staged K/V budget: gathered, much slower
    prefill = [
        PrefillSample((n,) * k, 0.06 + 1.4e-3 * n * k + 3e-7 * n * n * k)
        for n, k in ((16, 1), (256, 1), (1024, 1), (32, 8))
    ]
    return decode, prefill


def test_samples_round_trip(tmp_path: Path) -> None:
    decode, prefill = _samples()
    path = tmp_path / "s.jsonl"
    path.write_text(samples_jsonl(decode, prefill), encoding="utf-8")
    assert read_samples(path) == (decode, prefill)


def test_fit_recovers_the_model_and_reports_the_gathered_regime_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    decode, prefill = _samples()
    samples, out, again = tmp_path / "in.jsonl", tmp_path / "cpu.json", tmp_path / "again.jsonl"
    samples.write_text(samples_jsonl(decode, prefill), encoding="utf-8")
    argv = ["calibrate", "--samples", str(samples), "--kv-bytes-per-token", str(KV_BYTES), "--out", str(out)]
    assert alignedserve(["sim", *argv, "--write-samples", str(again)]) == 0
    err = capsys.readouterr().err
    assert "decode fit: R² 1.0000" in err and "48x2048" in err
    assert read_samples(again) == (decode, prefill)
    model = load_cpu_model(out)
    c = model.calibration.coefficients
    assert (c.decode_base_s, c.decode_multi_row_s, c.decode_per_seq_s) == pytest.approx((0.05, 0.03, 0.003))
    assert model.decode_iteration_s([100]) == pytest.approx(0.05 + 0.003 + 2e-4)
    assert model.decode_iteration_s([100, 300]) == pytest.approx(0.05 + 0.03 + 0.006 + 8e-4)
    assert model.decode_capacity_blocks == 2 * 2**30 // (16 * KV_BYTES)  # the engine's 2 GiB default
    fit = model.calibration.fit
    assert fit["decode"]["r2"] == pytest.approx(1.0) and fit["decode"]["max_relative"] < 1e-6
    assert len(fit["decode"]["residuals"]) == model.calibration.decode_samples == len(decode) - 1
    gathered = fit["decode_gathered_not_fitted"]["residuals"]
    assert [r["shape"] for r in gathered] == ["48x2048"] and gathered[0]["predicted_s"] < 4.0
    assert fit["prefill"]["rms_relative"] < 1e-6


def test_gathered_regime_is_the_staged_budget() -> None:
    fits = STAGED_KV_BYTES // KV_BYTES - 32  # one row: its tokens plus the staging headroom
    assert not gathered_regime(DecodeSample((fits,), 1.0), KV_BYTES)
    assert gathered_regime(DecodeSample((fits + 1,), 1.0), KV_BYTES)


def test_multi_row_term_needs_both_kinds_of_batch() -> None:
    only_batches = [DecodeSample((p,) * b, _decode_seconds((p,) * b)) for b in (2, 4, 16) for p in (64, 512)]
    base, _, _, multi = fit_decode(only_batches)
    assert multi == 0.0 and base == pytest.approx(0.08)  # the extra folds into the base


def test_shapes() -> None:
    assert parse_shapes("16, 8x32,12x64+4x1024") == [(16,), (32,) * 8, (64,) * 12 + (1024,) * 4]
    assert describe_lens((64,) * 12 + (1024,) * 4) == "12x64+4x1024"
    with pytest.raises(ValueError, match="bad shape"):
        parse_shapes("4xabc")


def test_bad_samples_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"kind": "decode", "kv_lens": [1], "seconds": 1}) + "\n{}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_samples(path)
