"""Decode attention strategy by batch shape (see `alignedserve.engine.attention` for the groupings).

Measured on a 2-core AVX-512 CPU (`python -m alignedserve.bench.engine.attention`, figures in docs/engine.md):
- all contexts within MAX_PAD_TOKENS of each other and few keys in all: one padded SDPA call is
  fastest (one gather, no sort);
- a single row: one call with no mask;
- otherwise: length buckets, each capped at MAX_GROUP_KEYS padded keys. Padding a short row to a long
  one wastes gather bandwidth (mixed 60x32 + 4x4096: padded 600 ms/layer vs bucketed 23-35 ms), and
  one huge gather spills out of cache (64 x 2048: padded 455 ms vs 64-key-capped buckets 160 ms).
"""

from __future__ import annotations

from alignedserve.engine.attention import (
    BucketedGrouping,
    DecodeGrouping,
    PaddedGrouping,
    PerSequenceGrouping,
)
from alignedserve.engine.decode_backend import GroupingSelector


class ShapeSelector(GroupingSelector):
    MAX_PAD_TOKENS = 128  # keys of padding that cost about one extra SDPA call
    MAX_GROUP_KEYS = 32768  # padded keys per call before the gather spills out of cache

    def __init__(self) -> None:
        self.padded = PaddedGrouping()
        self.single = PerSequenceGrouping()
        self.bucketed = BucketedGrouping(self.MAX_PAD_TOKENS, self.MAX_GROUP_KEYS)

    def select(self, context_lens: list[int]) -> DecodeGrouping:
        if len(context_lens) == 1:
            return self.single
        longest = max(context_lens)
        if (
            longest - min(context_lens) <= self.MAX_PAD_TOKENS
            and longest * len(context_lens) <= self.MAX_GROUP_KEYS
        ):
            return self.padded
        return self.bucketed
