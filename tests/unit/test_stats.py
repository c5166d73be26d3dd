"""The one percentile rule (`alignedserve.core.stats.percentile`): numpy's default, linear between ranks."""

from __future__ import annotations

import random

import numpy as np
import pytest

from alignedserve.core.stats import percentile


def test_percentile_interpolates_linearly_between_closest_ranks() -> None:
    samples = [float(i) for i in range(1, 101)]
    assert percentile(samples, 50) == 50.5  # rank 49.5: halfway between 50 and 51
    assert percentile(samples, 99) == pytest.approx(99.01)  # rank 98.01
    assert percentile(samples, 100) == 100.0
    assert percentile(samples, 0) == 1.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # unsorted input; p50 is the median
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    with pytest.raises(ValueError):
        percentile([1.0], float("nan"))


def test_percentile_equals_numpys_default_to_the_bit() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        sample = [rng.lognormvariate(0.0, 2.0) for _ in range(rng.randint(1, 40))]
        q = rng.choice([0.0, 50.0, 90.0, 99.0, 99.9, 100.0, rng.uniform(0.0, 100.0)])
        assert percentile(sample, q) == float(np.percentile(sample, q))
