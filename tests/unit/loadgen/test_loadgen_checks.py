"""What counts as the server producing the wrong number of tokens."""

from __future__ import annotations

from alignedserve.loadgen.checks import INPUT_LEN_MISMATCH, LengthCheck, warning_counts
from alignedserve.loadgen.records import LENGTH_MISMATCH, RequestRecord


def rec(expected: int, got: int, server_prompt: int | None = None) -> RequestRecord:
    return RequestRecord(0, 20, expected, 0.0, output_len=got, server_prompt_tokens=server_prompt)


def test_exact_output_with_ignore_eos_fails_on_any_difference() -> None:
    check = LengthCheck(exact_output=True)
    ok, short, long = rec(8, 8), rec(8, 5), rec(8, 9)
    for r in (ok, short, long):
        check.apply(r)
    assert ok.ok and short.error == LENGTH_MISMATCH and long.error == LENGTH_MISMATCH
    assert "asked for 8 output tokens, got 5" in short.error_detail


def test_without_ignore_eos_an_early_stop_is_fine_but_overrun_is_not() -> None:
    check = LengthCheck(exact_output=False, on_mismatch="warn")
    early, over = rec(8, 3), rec(8, 12)
    check.apply(early)
    check.apply(over)
    assert early.ok and early.warnings == []
    assert over.ok and over.warnings == [LENGTH_MISMATCH]


def test_input_mismatch_is_a_warning_and_failed_requests_are_left_alone() -> None:
    check = LengthCheck(exact_output=True)
    r = rec(4, 4, server_prompt=21)
    check.apply(r)
    assert r.ok and r.warnings == [INPUT_LEN_MISMATCH]
    failed = RequestRecord(1, 20, 4, 0.0, output_len=0, error="timeout")
    check.apply(failed)
    assert failed.error == "timeout" and failed.warnings == []
    assert warning_counts([r, failed]) == {INPUT_LEN_MISMATCH: 1}
