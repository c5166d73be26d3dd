"""Write benchmark results into a markdown document: tables, and named sections a rerun replaces.

A section is the text between `<!-- NAME:begin -->` and `<!-- NAME:end -->`; writing it again replaces
only that text, so several drivers share one `docs/benchmarks.md` and hand-written prose around the
markers survives. A document without the markers gets the section appended.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

DOC_TITLE = "# Benchmarks\n"


def begin_marker(name: str) -> str:
    return f"<!-- {name}:begin -->"


def end_marker(name: str) -> str:
    return f"<!-- {name}:end -->"


def replace_section(document: str, name: str, body: str) -> str:
    """`document` with section `name` set to `body` (appended at the end when it has no such section)."""
    begin, end = begin_marker(name), end_marker(name)
    block = f"{begin}\n{body.strip()}\n{end}"
    start = document.find(begin)
    if start < 0:
        if end in document:
            raise ValueError(f"section {name!r} has an end marker but no begin marker")
        separator = (
            "" if not document or document.endswith("\n\n") else ("\n" if document.endswith("\n") else "\n\n")
        )
        return f"{document}{separator}{block}\n"
    stop = document.find(end, start)
    if stop < 0:
        raise ValueError(f"section {name!r} has a begin marker but no end marker after it")
    if document.find(begin, start + len(begin)) >= 0:
        raise ValueError(f"section {name!r} appears more than once")
    return document[:start] + block + document[stop + len(end) :]


def write_section(path: Path, name: str, body: str) -> None:
    """Set section `name` of the markdown file at `path` (created with a title when missing); atomic."""
    document = path.read_text() if path.exists() else DOC_TITLE
    updated = replace_section(document, name, body)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.write_text(updated)
    staging.replace(path)


def fmt(value: float | None, digits: int = 1) -> str:
    """A number for a table cell: fixed digits, thousands separators; n/a for missing or non-finite."""
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:,.{digits}f}"


def fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.2f}×"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], text_columns: int = 1) -> str:
    """A GitHub markdown table: the first `text_columns` (the row's names) left-aligned, numbers right."""
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells, the table {len(headers)} columns: {row}")
    numeric = [i >= text_columns for i in range(len(headers))]
    rule = ["---:" if n else "---" for n in numeric]
    lines = [_row(headers), _row(rule), *(_row(r) for r in rows)]
    return "\n".join(lines)


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def safe_ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator; None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def relative_link(path: Path, doc_dir: Path) -> str:
    """`path` as a link from a document in `doc_dir` (absolute when it lies elsewhere)."""
    try:
        return str(path.resolve().relative_to(doc_dir.resolve()))
    except ValueError:
        return str(path.resolve())
