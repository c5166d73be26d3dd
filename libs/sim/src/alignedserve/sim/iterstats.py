"""Per-worker counters of the forward passes that decode, and where their time goes.

A decode worker (or a co-located replica) adds every span of unchanged iterations in closed form and
every single pass as it ends. The time of passes that decode splits into (docs/simulator.md):
- `linear_s`: weights, projections and MLP (`DecodeParts.linear_s`);
- `ideal_attention_s`: every KV byte read at the chip's full bandwidth;
- `interference_s`: prefill work sharing the pass (co-located chunked prefill / SplitFuse);
- the bubble: the rest — few long sequences that cannot fill the chip.
Outside those passes: `stall_s` (KV transfers the worker waits for before a pass), `prefill_only_s`
(co-located passes without a decode, which every running request waits through) and idle time.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from alignedserve.sim.cost import DecodeParts, SpanCost

# forward-pass durations the paper's Fig. 13 counts under (it quotes 30 ms)
THRESHOLDS_S = (0.010, 0.020, 0.030, 0.050, 0.100)
INF = float("inf")
# throughput windows (metrics.py): the middle half of the arrivals, and first decode -> last arrival
MID_START, MID_END, LAST_ARRIVAL = 0, 1, 2
MARKS = (MID_START, MID_END, LAST_ARRIVAL)


def arrival_mark(arrived: int, total: int) -> int | None:
    """Which mark the `arrived`-th arrival (1-based) of `total` sets, if any."""
    if arrived == total:
        return LAST_ARRIVAL
    if arrived == max(1, total // 4):
        return MID_START
    if arrived == max(1, (3 * total) // 4):
        return MID_END
    return None


def count_below(cost: SpanCost, iterations: int, limit_s: float) -> int:
    """Iterations j < `iterations` of a span whose duration first_s + j·step_s is below `limit_s`."""
    if cost.first_s >= limit_s:
        return 0
    if cost.step_s <= 0:
        return iterations
    return min(iterations, math.ceil((limit_s - cost.first_s) / cost.step_s))


class IterationStats:
    """Counters of one worker; `Metrics.finish` sums them over the cluster."""

    __slots__ = (
        "busy_s",
        "decode_tokens",
        "evictions",
        "ideal_attention_s",
        "interference_s",
        "iterations",
        "linear_s",
        "marks",
        "misaligned_bubble_s",
        "misaligned_iterations",
        "mixed_iterations",
        "prefill_only_s",
        "spread_iterations",
        "stall_s",
        "switch_iterations",
        "tokens_before",
        "under",
    )

    def __init__(self) -> None:
        self.iterations = 0  # passes that decode
        self.decode_tokens = 0
        self.mixed_iterations = 0  # holding requests of >= 2 origin batches
        self.switch_iterations = 0  # ... while the newest of them is still being admitted (a switch-over)
        self.misaligned_iterations = 0  # ... whose prefix ranges do not touch (a gap between them)
        self.spread_iterations = 0  # sum over iterations of (longest - shortest prefix)
        self.evictions = 0  # evictions (aligned, fcfs) or preemptions (baselines)
        self.busy_s = 0.0  # time in passes that decode
        self.linear_s = 0.0
        self.ideal_attention_s = 0.0
        self.interference_s = 0.0
        self.stall_s = 0.0
        self.prefill_only_s = 0.0
        self.misaligned_bubble_s = 0.0  # bubble inside misaligned iterations
        self.under = [0] * len(THRESHOLDS_S)
        # instants the throughput windows start or end (MARKS) and the tokens done by each
        self.marks = [INF] * len(MARKS)
        self.tokens_before = [0] * len(MARKS)

    def count_tokens(self, tokens: int, start: float, end: float, done_by: Callable[[float], int]) -> None:
        """`tokens` decoded by a pass or span over [start, end]; `done_by(t)`: how many of them by t."""
        self.decode_tokens += tokens
        for i, mark in enumerate(self.marks):
            if end <= mark:
                self.tokens_before[i] += tokens
            elif start < mark:  # the mark falls inside: count what came before it
                self.tokens_before[i] += done_by(mark)

    def add_span(self, cost: SpanCost, parts: DecodeParts, iterations: int, stall_s: float) -> float:
        """`iterations` decode iterations of an unchanged batch (their tokens are counted by the caller);
        returns the span's bubble."""
        k = iterations
        total = cost.total(k)
        linear = k * parts.linear_s
        ideal = k * parts.ideal_attention_s + parts.ideal_step_s * k * (k - 1) / 2.0
        self.iterations += k
        self.busy_s += total
        self.stall_s += stall_s
        self.linear_s += linear
        self.ideal_attention_s += ideal
        under = self.under
        for i, limit in enumerate(THRESHOLDS_S):
            under[i] += count_below(cost, k, limit)
        return total - linear - ideal

    def add_pass(self, duration_s: float, decode_only_s: float, parts: DecodeParts, stall_s: float) -> None:
        """One co-located pass that decodes; `decode_only_s`: the same decodes without the prefill work."""
        self.add_span(SpanCost(decode_only_s, 0.0), parts, 1, stall_s)
        extra = duration_s - decode_only_s
        self.busy_s += extra
        self.interference_s += extra
        for i, limit in enumerate(THRESHOLDS_S):  # the pass's own duration decides, not the decode part
            self.under[i] += (duration_s < limit) - (decode_only_s < limit)
