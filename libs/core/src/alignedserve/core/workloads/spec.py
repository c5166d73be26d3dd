"""One request of a workload."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload."""

    arrival_s: float  # seconds after the workload's first arrival
    input_len: int  # prompt tokens (>= 1)
    output_len: int  # tokens to generate (>= 1), the first one included


def check_count(n: int) -> None:
    """A request count must be >= 0."""
    if n < 0:
        raise ValueError(f"request count must be >= 0, got {n}")
