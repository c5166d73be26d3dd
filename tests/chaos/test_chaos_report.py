"""The chaos harness's own bookkeeping, without a stack: how a client's view is classified, which
completed streams count as wrong, and how the report's table is rewritten."""

from __future__ import annotations

from pathlib import Path

from chaos_load import (
    CLOSED,
    COMPLETED,
    ERROR,
    HEADER,
    MALFORMED,
    TABLE_END,
    TABLE_START,
    Outcome,
    Row,
    http_error,
    p99_tpot_ms,
    row,
    write_table,
    wrong_streams,
)


def test_an_openai_error_body_is_well_formed_and_a_plain_text_one_is_not() -> None:
    body = '{"error": {"message": "too many requests", "type": "rate_limit_exceeded"}}'
    assert http_error(Outcome("p", MALFORMED, status=429), body).end == ERROR
    assert http_error(Outcome("p", MALFORMED, status=500), "Internal Server Error").end == MALFORMED


def test_a_completed_stream_with_another_count_or_text_than_the_undisturbed_run_is_wrong() -> None:
    reference = {"p": "a b c"}
    good = Outcome("p", COMPLETED, text="a b c", completion_tokens=3)
    repeated = Outcome("p", COMPLETED, text="a b b c", completion_tokens=4)
    changed = Outcome("p", COMPLETED, text="a x c", completion_tokens=3)
    failed = Outcome("p", ERROR)
    assert wrong_streams([good, repeated, changed, failed], reference, 3) == [repeated, changed]


def test_the_table_between_the_markers_is_replaced_and_the_prose_kept(tmp_path: Path) -> None:
    doc = tmp_path / "reliability.md"
    doc.write_text(f"intro\n{TABLE_START}\nold table\n{TABLE_END}\noutro\n")
    rows = [
        Row("SIGKILL decode", 8, 8, 0, 0, 0, 0, 0, 0, 7.25),
        Row("burst", 60, 12, 48, 0, 0, 0, 0, 0, None, "P99 TPOT 90 ms (unloaded 40 ms)"),
    ]
    write_table(doc, rows)
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{TABLE_END}\noutro\n")
    assert "old table" not in text and "| SIGKILL decode | 8 | 8 | 0 | 0 | 0 | 0 | 0 | 0 | 7.2 | – |" in text
    assert "| burst | 60 | 12 | 48 | 0 | 0 | 0 | 0 | 0 | – | P99 TPOT 90 ms (unloaded 40 ms) |" in text
    assert all(line.count("|") == HEADER.splitlines()[0].count("|") for line in text.splitlines()[2:6])


def test_a_stream_whose_connection_closed_is_its_own_outcome_and_tpot_spans_its_tokens() -> None:
    closed = Outcome("p", CLOSED)
    done = Outcome("p", COMPLETED, completion_tokens=3, token_times=[1.0, 1.25, 1.5])
    case = row("gateway killed", [closed, done], wrong=0, leaked=0, recovery_s=None)
    assert (case.completed, case.closed, case.malformed) == (1, 1, 0)
    assert done.tpot_s() == 0.25 and Outcome("p", COMPLETED, token_times=[1.0]).tpot_s() is None
    assert p99_tpot_ms([closed, done]) == 250.0 and p99_tpot_ms([closed]) is None
