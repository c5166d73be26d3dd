"""`HostOverhead`: a cost model with a fixed host-side cost added to every forward pass.

The GPU cost models time the device work only. A serving engine also spends CPU time per pass
(scheduling, input preparation, kernel launches, sampling); when it is not overlapped with the device it
lengthens every iteration. No public figure gives it for the systems compared, so no default model has
it: `alignedserve bench paper` uses it only as a what-if (the paper's Fig. 11 says DistServe spends more
than 10 ms scheduling 80 % of its iterations). The overhead is booked as part of the linear time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from alignedserve.sim.cost import CostModel, DecodeParts, Link, SpanCost


class HostOverhead:
    """Wraps a `CostModel`; every decode iteration and every co-located pass takes `overhead_s` more."""

    def __init__(self, inner: CostModel, overhead_s: float) -> None:
        if overhead_s < 0:
            raise ValueError(f"overhead_s must be >= 0, got {overhead_s}")
        self.inner = inner
        self.overhead_s = overhead_s
        self.name = f"{inner.name}+host{overhead_s * 1e3:g}ms"
        self.block_size = inner.block_size
        self.kv_bytes_per_token = inner.kv_bytes_per_token

    @property
    def decode_capacity_blocks(self) -> int:
        return self.inner.decode_capacity_blocks

    def decode_iteration_s(self, kv_lens: Sequence[int]) -> float:
        return self.inner.decode_iteration_s(kv_lens) + (self.overhead_s if kv_lens else 0.0)

    def decode_span(self, kv_lens: Sequence[int]) -> SpanCost:
        span = self.inner.decode_span(kv_lens)
        return replace(span, first_s=span.first_s + self.overhead_s) if kv_lens else span

    def decode_parts(self, kv_lens: Sequence[int]) -> DecodeParts:
        parts = self.inner.decode_parts(kv_lens)
        return replace(parts, linear_s=parts.linear_s + self.overhead_s) if kv_lens else parts

    def prefill_s(self, input_lens: Sequence[int]) -> float:
        return self.inner.prefill_s(input_lens)

    def step_s(self, kv_lens: Sequence[int], chunks: Sequence[tuple[int, int]]) -> float:
        busy = kv_lens or chunks
        return self.inner.step_s(kv_lens, chunks) + (self.overhead_s if busy else 0.0)

    def transfer_s(self, blocks: int, link: Link) -> float:
        return self.inner.transfer_s(blocks, link)
