"""The chaos suite's stack and its report.

`make test` runs one case per fault class; `make chaos` (CHAOS_ALL=1) runs every case and, with
CHAOS_REPORT=docs/reliability.md, writes their rows into that file's table.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
import redis_databases
from chaos_load import HEADER, Row, write_table
from chaos_stack import STACK_ENV, ChaosStack, start_stack

CHAOS_REDIS_DB = redis_databases.CHAOS
ROWS: list[Row] = []


# module scope: the stack's processes stop (and free their memory) before other test folders run
@pytest.fixture(scope="module")
def chaos_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosStack]:
    """1 prefill, 2 decode workers, kvpool, batcher and gateway on a database of their own."""
    parts = urlsplit(redis_url)
    url = urlunsplit((parts.scheme, parts.netloc, f"/{CHAOS_REDIS_DB}", parts.query, ""))
    redis.Redis.from_url(url).flushdb()
    stack = start_stack(url, Path(tmp_path_factory.mktemp("chaos")), decode=2, env=STACK_ENV)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def chaos_rows() -> Iterator[list[Row]]:
    yield ROWS
    report = os.environ.get("CHAOS_REPORT")
    if report and ROWS:
        write_table(Path(report), ROWS)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if ROWS:
        terminalreporter.write_line("\n".join(["chaos:", HEADER, *(r.markdown() for r in ROWS)]))
