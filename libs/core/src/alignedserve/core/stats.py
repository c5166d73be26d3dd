"""Summary statistics every report uses: one percentile rule for the load generator, the simulator and
the benchmarks. Pure: stdlib only."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(samples: Iterable[float], q: float) -> float:
    """The `q`-th percentile (q in [0, 100]) by linear interpolation between the closest ranks.

    This is numpy's default method ('linear', Hyndman & Fan's type 7), so it equals `np.percentile`,
    which is what vLLM's benchmark_serving reports. For sorted x_0 <= ... <= x_{n-1}: rank
    r = q/100 · (n - 1), value x_⌊r⌋ + (r - ⌊r⌋)·(x_⌈r⌉ - x_⌊r⌋); p50 is the median, p100 the maximum.
    The interpolation is written as numpy writes it (from the upper neighbour when r - ⌊r⌋ >= 0.5), so
    the result matches numpy's to the last bit.

    Raises ValueError for no samples or q outside [0, 100]: callers decide what an empty sample reports.
    """
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    rank = (len(ordered) - 1) * (q / 100)
    below = min(math.floor(rank), len(ordered) - 1)
    above = min(below + 1, len(ordered) - 1)
    low, high = ordered[below], ordered[above]
    weight = rank - below
    if weight >= 0.5:
        return high - (high - low) * (1 - weight)
    return low + (high - low) * weight
