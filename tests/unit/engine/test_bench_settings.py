"""`alignedserve bench engine` flag handling (pure: no model, no torch)."""

from __future__ import annotations

import pytest
from alignedserve.engine.bench import FULL, QUICK, _settings, build_parser


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
    ],
)
def test_bad_flags_are_refused_with_a_reason(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _parse(*argv)
