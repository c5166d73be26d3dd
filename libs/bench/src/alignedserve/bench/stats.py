"""Decode rates from iteration timestamps (pure: no torch, no clocks)."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeRate:
    """tok_s: batch / median iteration time; step_s: that median; steps: iterations measured."""

    tok_s: float
    step_s: float
    steps: int


def rate_from_gaps(batch: int, gaps: list[float]) -> DecodeRate:
    if not gaps:
        raise RuntimeError("no full-batch decode iterations were observed")
    step = statistics.median(gaps)
    return DecodeRate(tok_s=batch / step, step_s=step, steps=len(gaps))


def full_batch_gaps(stamps: list[list[float]]) -> list[float]:
    """Iteration gaps while every row decodes: from the last row's first token to the first row's
    last token. Rows of one iteration are stamped microseconds apart, so iterations are matched with a
    tolerance of a quarter of the typical gap."""
    late = max(stamps, key=lambda row: row[0])  # the row prefilled last: its stamps mark iterations
    own_gaps = [b - a for a, b in itertools.pairwise(late)]
    if not own_gaps:
        return []
    tolerance = 0.25 * statistics.median(own_gaps)
    end = min(row[-1] for row in stamps) + tolerance
    window = [t for t in late if t <= end]
    for row in stamps:  # every row must have a token in every window iteration
        if not all(any(abs(t - w) <= tolerance for t in row) for w in window):
            raise RuntimeError("continuous batching did not decode all rows in the same iterations")
    return [b - a for a, b in itertools.pairwise(window)]
