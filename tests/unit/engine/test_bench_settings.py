"""`alignedserve bench engine` flag handling (pure: no model, no torch)."""

from __future__ import annotations

import pytest

from alignedserve.bench.engine.cli import FULL, QUICK, _settings, build_parser
from alignedserve.bench.stats import full_batch_gaps, rate_from_gaps


def _parse(*argv: str):  # type: ignore[no-untyped-def]
    return _settings(build_parser().parse_args(list(argv)))


def test_full_run_covers_the_issue_grid() -> None:
    settings = _parse("--max-kv-gib", "8")
    assert settings.batches == [1, 16, 64, 256]
    assert settings.prefixes == [128, 2048]
    assert settings.dtypes == ["float32", "bfloat16"]
    assert settings.systems == ["engine", "hf_static", "hf_cb"]
    assert settings.steps == FULL.steps and settings.repeats == FULL.repeats
    assert settings.kv_budget_bytes == 8 * 2**30
    assert settings.ratio_steps == settings.steps


def test_quick_is_smaller_and_flags_override_it() -> None:
    quick = _parse("--quick")
    assert quick.batches == [1, 16, 64] and quick.steps == QUICK.steps and quick.repeats == 1
    custom = _parse(
        "--quick", "--batches", "64", "--dtypes", "bfloat16", "--steps", "4", "--ratio-steps", "6"
    )
    assert custom.batches == [64] and custom.dtypes == ["bfloat16"]
    assert custom.steps == 4 and custom.ratio_steps == 6


def test_default_kv_budget_comes_from_available_memory() -> None:
    assert _parse().kv_budget_bytes > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--batches", "64,x"), "--batches must be a comma list of integers"),
        (("--prefixes", "0"), "--prefixes must list positive integers"),
        (("--systems", "engine,vllm"), "unknown systems"),
        (("--dtypes", "float16"), "not benchmarked on CPU"),
        (("--steps", "1"), "--steps and --ratio-steps must be >= 2"),
        (("--repeats", "0"), "--repeats and --cb-repeats must be >= 1"),
    ],
)
def test_bad_flags_are_refused_with_a_reason(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _parse(*argv)


def test_decode_rate_is_batch_over_the_median_iteration() -> None:
    rate = rate_from_gaps(64, [0.5, 0.4, 10.0, 0.5, 0.6])  # one stall: the median ignores it
    assert rate.step_s == 0.5 and rate.tok_s == 128.0 and rate.steps == 5
    with pytest.raises(RuntimeError, match="no full-batch"):
        rate_from_gaps(8, [])


def test_full_batch_window_runs_from_last_first_token_to_first_last_token() -> None:
    # Row 0 prefilled in iteration 0, row 1 in iteration 1; stamps of one iteration differ by microseconds.
    rows = [
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
        [1.00002, 2.00001, 3.00003, 4.00001, 5.00002, 6.0],
    ]
    assert full_batch_gaps(rows) == pytest.approx([1.0, 1.0, 1.0, 1.0], abs=1e-4)


def test_full_batch_window_refuses_rows_that_skip_iterations() -> None:
    rows = [[0.0, 1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 3.0, 4.0, 5.0]]  # row 1 missed iteration 2
    with pytest.raises(RuntimeError, match="same iterations"):
        full_batch_gaps(rows)


def test_cb_repeats_default_to_repeats_and_never_exceed_them() -> None:
    assert _parse("--repeats", "4").cb_repeats == 4
    assert _parse("--repeats", "4", "--cb-repeats", "1").cb_repeats == 1
    assert _parse("--repeats", "2", "--cb-repeats", "9").cb_repeats == 2
    with pytest.raises(ValueError, match="--repeats and --cb-repeats must be >= 1"):
        _parse("--cb-repeats", "0")
