"""Brute-force oracles and strategies shared by the batching tests (small inputs only)."""

from __future__ import annotations

from itertools import combinations

from hypothesis import strategies as st

from alignedserve.batching.types import BatchLimits, WaitingRequest
from alignedserve.core.blocks import blocks_for

BLOCK = 4  # tokens per block in these tests: small, so many block boundaries are crossed
MAX_LEN = 256


def spread(batch: list[WaitingRequest]) -> int:
    return max(r.prefix_len for r in batch) - min(r.prefix_len for r in batch) if batch else 0


def oracle(pool: list[WaitingRequest], limits: BatchLimits) -> tuple[int, int]:
    """(best count, narrowest spread): the most requests up to min(K_min, cap) that fit together,
    and the smallest prefix spread of any set of that many that fits. Exhaustive over subsets."""
    cap = limits.max_requests if limits.max_requests is not None else len(pool)
    target = min(limits.min_requests, cap, len(pool))
    for size in range(target, 0, -1):
        spreads = [
            spread(list(group))
            for group in combinations(pool, size)
            if sum(r.blocks for r in group) <= limits.max_blocks
        ]
        if spreads:
            return size, min(spreads)
    return 0, 0


@st.composite
def pools(draw: st.DrawFn, max_size: int = 9, uniform: bool = False) -> list[WaitingRequest]:
    """Requests with blocks = ceil(prefix/BLOCK) (or one size for all when `uniform`), distinct arrivals."""
    size = draw(st.integers(0, max_size))
    prefixes = draw(st.lists(st.integers(0, MAX_LEN - 1), min_size=size, max_size=size))
    arrivals = draw(st.permutations(range(size)))
    fixed = draw(st.integers(1, 6))
    return [
        WaitingRequest(f"r{i}", p, fixed if uniform else blocks_for(p, BLOCK) + 1, float(a))
        for i, (p, a) in enumerate(zip(prefixes, arrivals, strict=True))
    ]


limits_strategy = st.builds(
    BatchLimits,
    max_blocks=st.integers(1, 200),
    min_requests=st.integers(1, 8),
    max_requests=st.one_of(st.none(), st.integers(1, 10)),
)
